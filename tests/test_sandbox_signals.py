"""A stop request (SIGTERM, SIGINT) ends the sandbox's labelling loop at once, and kills the programs it waits on."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from nip_like.interrupts import StopNow, handle_interrupts
from nip_like.scenarios.code_validation.sandbox import WAITING_FOR, SandboxLimits, TestSuite, run_programs
from tests.conftest import popen_cli
from tests.test_sandbox_isolation import outside_processes

#: Long enough that only a stop request ends a run early.
PATIENT = SandboxLimits(time_limit=30.0, test_time_limit=20.0)


def signal_when(condition, signum: int = signal.SIGTERM, pid: int | None = None, within: float = 60.0) -> threading.Thread:
    """Send ``signum`` to ``pid`` (this process) as soon as ``condition()`` holds (at most ``within`` seconds on)."""

    def wait_then_signal() -> None:
        deadline = time.monotonic() + within
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid or os.getpid(), signum)

    thread = threading.Thread(target=wait_then_signal, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stop_request_ends_the_labelling_within_a_second_and_kills_the_programs_processes(monkeypatch, workers):
    # The process limit lifted, so that each program leaves a process of its own: the stop must end those too.
    rlimits = SandboxLimits.rlimits
    monkeypatch.setattr(SandboxLimits, "rlimits", lambda self: [pair for pair in rlimits(self) if pair[0] != "RLIMIT_NPROC"])
    marker = f"50.{os.getpid()}{workers}"
    source = (
        "import sys\nsys.meta_path.pop(0)  # past the guard's import blocker\n"
        f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'])\ntime.sleep(25)\n"
    )
    jobs = [(source, TestSuite(inputs=[""], outputs=[""]))] * 4
    with handle_interrupts():
        sender = signal_when(lambda: outside_processes(marker))
        with pytest.raises(StopNow, match=f"^stopped while waiting for {WAITING_FOR}$"):
            run_programs(jobs, PATIENT, workers=workers)
        stopped = time.monotonic()
        sender.join()
    assert outside_processes(marker) == []
    assert time.monotonic() - stopped < 1.0


def sleeping_data_file(path: Path, problems: int = 10) -> Path:
    """A Buggy-APPS file whose programs all sleep a minute (each would take the sandbox's 30 s to label)."""
    sleeping = "import time\ntime.sleep(60)\nprint(int(input()) + 1)\n"
    record = {
        "question": "Print the number plus one.",
        "solutions": [sleeping],
        "buggy_solutions": [sleeping.replace("+ 1", "+ 2")],
        "input_output": {"inputs": ["1\n"], "outputs": ["2\n"]},
    }
    path.write_text("".join(json.dumps({**record, "problem_id": index}) + "\n" for index in range(problems)))
    return path


def sandbox_children(pid: int) -> list[int]:
    """The sandbox's processes that ``pid`` started (``unshare`` or the harness's interpreter)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and (b"unshare" in command or b"import marshal" in command):
            found.append(int(entry.name))
    return found


@pytest.mark.slow  # a whole run's start-up (torch), then seconds
@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_run_labelling_a_data_file_stops_within_ten_seconds_with_its_one_line(tmp_path, signum, status):
    data = sleeping_data_file(tmp_path / "sleeping.jsonl")
    run_dir = tmp_path / "run"
    running = popen_cli([
        "preset=none", "scenario=code_validation", "trainer=expert_iteration", "protocol=nip",
        f"scenario.cache_dir={tmp_path / 'cache'}", f"scenario.data_file={data}", "run.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ])
    try:
        deadline = time.monotonic() + 300
        while not (children := sandbox_children(running.pid)) and running.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert children, f"the run labelled nothing: {running.poll()} {running.stderr.read() if running.poll() else ''}"
        running.send_signal(signum)
        signalled = time.monotonic()
        _, stderr = running.communicate(timeout=30)
        elapsed = time.monotonic() - signalled
    finally:
        running.kill()
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert running.returncode == status, stderr
    assert elapsed < 10.0, elapsed  # the stop itself takes 0.1 s; the rest is the process's close
    assert re.fullmatch(
        rf"interrupted at once (while setting up|during iteration 1), waiting for {WAITING_FOR}, before the first "
        rf"checkpoint; start it again with: python -m nip_like\.resume {re.escape(str(run_dir))}",
        lines[-1],
    ), stderr
    assert not any(Path(f"/proc/{pid}").exists() for pid in children)
