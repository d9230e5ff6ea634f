"""The code sandbox's isolation by the operating system: the escapes that leave the in-process guard stay contained.

Each hostile program first gets past the guard (it re-creates ``posix``
through ``_imp``, or drops the guard's import blocker with
``sys.meta_path.pop(0)``), so that what stops it is the namespaces, the
read-only view and the unprivileged user of
:mod:`nip_like.scenarios.code_validation.isolation`. "Contained" means: the
trainer and every process outside live on, no process of the program
outlives its run, nothing is written outside its folder (in the view, a
tmpfs of its own), no connection is made, and no file outside the view
(``/etc``, ``/root``, the project, the run folders) can be read. The
programs report what the operating system answered, so a test also fails if
the guard, not the isolation, stopped them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nip_like.experiment import run_experiment
from nip_like.scenarios.code_validation import isolation
from nip_like.scenarios.code_validation.sandbox import SandboxError, SandboxLimits, TestSuite, _probe, run_program
from tests.test_code_validation_scenario import TEXT_RUN, config, text_folder  # noqa: F401 - text_folder: the fixture

LIMITS = SandboxLimits(time_limit=3.0, test_time_limit=1.0)
#: One call-style test of ``f()``; its expected answer is never given, so the reason shows the answer.
CALL = TestSuite(inputs=[[]], outputs=["contained"], fn_name="f")
#: What a hostile program starts with: the ``posix`` module and the blocked imports back.
ESCAPE = (
    "import sys, _imp\n"
    "from importlib.machinery import ModuleSpec, BuiltinImporter\n"
    "p = _imp.create_builtin(ModuleSpec('posix', BuiltinImporter))\n"
    "sys.meta_path.pop(0)\n"
)


@pytest.fixture
def namespaces():
    """Skip where this machine gives no namespaces (there these escapes are known to work: the guard only)."""
    state = isolation.current(_probe)
    if not state.enabled:
        pytest.skip(f"no namespaces here: {state.reason}")


def answer(body: str, limits: SandboxLimits = LIMITS) -> str:
    """Run ``ESCAPE`` then ``def f():`` with ``body``; return what ``f`` answered or raised (its outcome's reason)."""
    source = ESCAPE + "def f():\n" + "".join(f"    {line}\n" for line in body.strip("\n").splitlines())
    run = run_program(source, CALL, limits)
    return run.outcomes[0].reason


@contextmanager
def listener() -> Iterator[socket.socket]:
    """A non-blocking TCP socket listening on a free port of 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        yield server


def outside_processes(marker: str) -> list[int]:
    """The pids of the processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.usefixtures("namespaces")
def test_a_program_cannot_kill_the_trainer_or_any_process_outside():
    outside = subprocess.Popen(["sleep", "30"])
    try:
        body = (
            f"ppid, results = p.getppid(), []\n"
            f"if ppid != 1:\n"
            f"    return f'the parent is visible as {{ppid}}'\n"
            f"for pid in (ppid, {os.getpid()}, {outside.pid}):\n"
            f"    try:\n"
            f"        p.kill(pid, 9)\n"
            f"        results.append('killed')\n"
            f"    except OSError as error:\n"
            f"        results.append(type(error).__name__)\n"
            f"return results"
        )
        reason = answer(body)
        assert reason == "wrong answer: got ['PermissionError', 'ProcessLookupError', 'ProcessLookupError']", reason
        assert outside.poll() is None, "the process outside the sandbox lives"
    finally:
        outside.kill()
        outside.wait()


@pytest.mark.usefixtures("namespaces")
def test_a_program_cannot_start_processes_that_outlive_its_run():
    marker = f"45.{os.getpid()}1"
    body = (
        "import subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        "return 'started'"
    )
    reason = answer(body)
    assert reason.startswith("error: BlockingIOError: [Errno 11] Resource temporarily unavailable"), reason
    assert outside_processes(marker) == []


@pytest.mark.usefixtures("namespaces")
def test_processes_started_in_spite_of_the_process_limit_die_with_the_run(monkeypatch):
    """With ``RLIMIT_NPROC`` lifted the program does start processes: the PID namespace's end kills them all."""
    rlimits = SandboxLimits.rlimits
    monkeypatch.setattr(SandboxLimits, "rlimits", lambda self: [pair for pair in rlimits(self) if pair[0] != "RLIMIT_NPROC"])
    marker = f"46.{os.getpid()}2"
    body = (
        "import subprocess\n"
        f"a = subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
        f"b = subprocess.Popen(['sh', '-c', 'sleep {marker} & sleep {marker}'], start_new_session=True)\n"
        "import time\n"
        "time.sleep(0.3)\n"
        "return [a.pid > 2, a.poll(), b.pid > 2]"
    )
    reason = answer(body)
    assert reason == "wrong answer: got [1, None, 1]", reason
    assert outside_processes(marker) == []


@pytest.mark.usefixtures("namespaces")
def test_a_program_cannot_write_a_file_outside_its_folder(tmp_path):
    targets = [tmp_path / "io.txt", tmp_path / "db.sqlite", Path("/usr") / f"nip_like_escape_{os.getpid()}"]
    body = (
        "import io, sqlite3\n"
        "results = []\n"
        f"for path in {[str(target) for target in targets]!r}:\n"
        "    try:\n"
        "        io.FileIO(path, 'w').write(b'x')\n"
        "        results.append('written')\n"
        "    except OSError as error:\n"
        "        results.append(error.strerror)\n"
        "try:\n"
        f"    sqlite3.connect({str(targets[1])!r}).execute('create table t (x)')\n"
        "    results.append('written')\n"
        "except sqlite3.Error as error:\n"
        "    results.append(str(error))\n"
        "return results"
    )
    try:
        reason = answer(body)
        assert reason == (
            "wrong answer: got ['No such file or directory', 'No such file or directory', "
            "'Read-only file system', 'unable to open database file']"
        ), reason
        assert not any(target.exists() for target in targets)
        assert list(tmp_path.iterdir()) == []
    finally:
        targets[2].unlink(missing_ok=True)


@pytest.mark.usefixtures("namespaces")
def test_a_program_can_fill_only_its_own_small_folder():
    body = (
        "import io\n"
        "written = 0\n"
        "try:\n"
        "    for index in range(100):\n"
        "        io.FileIO(f'part{index}', 'w').write(b'x' * (512 << 10))\n"
        "        written += 1\n"
        "except OSError as error:\n"
        "    return [written, error.strerror]\n"
        "return [written, 'no error']"
    )
    limits = SandboxLimits(time_limit=3.0, test_time_limit=1.0, file_size_kib=512)
    reason = answer(body, limits)
    expected = isolation.folder_kib(512) // 512  # whole files that fit
    assert reason in (f"wrong answer: got [{expected}, 'No space left on device']",
                      f"wrong answer: got [{expected - 1}, 'No space left on device']"), reason


@pytest.mark.usefixtures("namespaces")
def test_a_program_cannot_connect_even_to_localhost():
    with listener() as server:
        port = server.getsockname()[1]
        body = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "except OSError as error:\n"
            "    return error.strerror\n"
            "return 'connected'"
        )
        reason = answer(body)
        assert reason == "wrong answer: got 'Network is unreachable'", reason
        with pytest.raises(BlockingIOError):
            server.accept()


@pytest.mark.usefixtures("namespaces")
def test_a_program_cannot_read_files_outside_the_view(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    project_file = Path(__file__).resolve()
    body = (
        "from importlib.machinery import SourceFileLoader\n"
        "results = []\n"
        f"for path in ['/etc/passwd', {str(secret)!r}, {str(project_file)!r}, '/proc/1/environ']:\n"
        "    try:\n"
        "        SourceFileLoader('x', path).get_data(path)\n"
        "        results.append('read')\n"
        "    except OSError as error:\n"
        "        results.append(error.strerror)\n"
        "return [sorted(set(results)), len(results), sorted(p.listdir('/'))]"
    )
    reason = answer(body)
    assert reason.startswith("wrong answer: got [['No such file or directory'], 4, ["), reason
    top = set(eval(reason.removeprefix("wrong answer: got "))[2])  # noqa: S307 - the test's own answer
    prefix = Path(os.path.realpath(sys.base_prefix)).parts[1]
    assert top <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "dev", "tmp", prefix}, top


@pytest.mark.usefixtures("namespaces")
def test_the_program_runs_as_an_unprivileged_user_in_its_own_folder():
    body = "import os\nreturn [p.getuid(), p.getgid(), p.getgroups(), p.getpid(), p.getppid(), len(p.listdir('.'))]"
    reason = answer(body)
    assert reason == f"wrong answer: got [{isolation.UNPRIVILEGED_ID}, {isolation.UNPRIVILEGED_ID}, [], 2, 1, 0]", reason


def test_without_namespaces_the_run_says_so_once_and_the_guard_still_runs(monkeypatch, caplog):
    monkeypatch.setattr(isolation, "_current", None)
    calls = []

    def failing_probe() -> str:
        calls.append(1)
        return "unshare failed: Operation not permitted"

    with caplog.at_level(logging.WARNING, logger=isolation.__name__):
        first = isolation.current(failing_probe)
        second = isolation.current(failing_probe)
    assert first is second and not first.enabled and calls == [1]
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "The code sandbox runs programs without namespaces (unshare failed: Operation not permitted): the in-process guard only"
    ]
    assert isolation.used().summary() == "in-process guard only (unshare failed: Operation not permitted)"
    guarded = run_program("import socket\ndef f():\n    return 1\n", CALL, LIMITS)
    assert "does not allow importing socket" in guarded.outcomes[0].reason
    uid = run_program("import os\ndef f():\n    return os.getuid()\n", CALL, LIMITS)
    assert uid.outcomes[0].reason == f"wrong answer: got {os.getuid()}"  # no user change without namespaces


@pytest.mark.usefixtures("namespaces")
def test_the_decision_is_recorded_for_the_runs_summary(monkeypatch):
    monkeypatch.setattr(isolation, "_current", None)
    assert isolation.used() is None  # no program ran: no field in summary.json
    started = time.monotonic()
    state = isolation.current(_probe)
    assert state.enabled and isolation.used() is state
    assert state.summary() == "namespaces (network, PID, mount, IPC, UTS), read-only view, user 65534, in-process guard"
    assert time.monotonic() - started < 5.0


@pytest.mark.slow  # a whole text run: labelling, a tiny model, one iteration
def test_a_run_that_labelled_programs_records_their_isolation_in_its_summary(tmp_path, text_folder, monkeypatch):
    monkeypatch.setattr(isolation, "_current", None)  # decided afresh by this run's first program
    run = config(tmp_path / "cache", *TEXT_RUN, f"scenario.default_model.path={text_folder}", "trainer.num_iterations=1",
                 "trainer.warm_start_episodes=0")
    run_experiment(run, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["sandbox_isolation"] == isolation.current(_probe).summary()
    assert summary["sandbox_isolation"].startswith(("namespaces (network, PID, mount", "in-process guard only ("))


@pytest.mark.usefixtures("namespaces")
def test_namespaces_that_fail_before_the_program_runs_stop_the_labelling_instead_of_failing_the_program(monkeypatch):
    monkeypatch.setattr(isolation, "view_binds", lambda: (["/nonexistent_nip_like_folder"], {}))
    with pytest.raises(SandboxError, match=r"^the sandbox's namespaces failed before the program ran \(status 1\): .*"
                                           r"No such file or directory"):
        run_program("def f():\n    return 'contained'\n", CALL, LIMITS)
    assert _probe().startswith("the sandbox's namespaces failed before the program ran")
