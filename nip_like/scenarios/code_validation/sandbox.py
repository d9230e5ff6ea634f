"""Run a Python program's tests in a separate, limited, isolated process: buggy, runaway and hostile programs stay in.
:func:`run_program` runs every test of one program in one fresh child
interpreter and returns a :class:`ProgramRun`: one :class:`TestOutcome` per
test, each passed or failed with a one-line reason. A program that loops,
crashes, prints megabytes, allocates gigabytes, exits, forks, opens a socket
or touches files outside its folder fails its tests; the caller never hangs
and never crashes. :func:`run_programs` runs many programs, optionally on
several threads (each program still gets a process of its own).
The child
---------
``sys.executable -s -S -P -c <bootstrap>`` in a fresh temporary folder, with
an environment built from scratch, in a session of its own, and where the
kernel allows it in namespaces of its own (through ``unshare``: no network,
a PID namespace that dies with the run, a read-only view of the file system
whose only writable place is the folder, user 65534; see
:mod:`~nip_like.scenarios.code_validation.isolation`, decided once per
process). The harness of :mod:`~nip_like.scenarios.code_validation.harness`
enters that isolation, sets resource limits, removes the functions that
start processes, refuses the network and process modules and confines paths
to its folder before any line of the program runs, then runs the tests one
by one and writes one line per test on a pipe of its own. The expected
answers never enter the child; the parent compares digests.

The parent
----------
The parent reads that pipe and the child's own standard output and error
(where a raw ``os.write(1, ...)`` lands) in chunks, keeping a 2 KiB tail
only; more than :attr:`SandboxLimits.output_kib` there, or past the
wall-clock :attr:`SandboxLimits.time_limit`, it kills the child's process
group (and with it the PID namespace and every process in it) and fails
every test not yet reported, with the reason. While it waits it looks for a
stop request every :data:`~nip_like.interrupts.POLL_SECONDS`
(:func:`~nip_like.interrupts.raise_if_stop_requested`): the child is killed
and :class:`~nip_like.interrupts.StopNow` raised.

What it is not
--------------
The in-process guard alone is no security boundary: a program written to
get out leaves it in a few lines (``sys.meta_path.pop(0)``, ``_imp``,
``io.FileIO``, ``gc``, ...). The namespaces are what contain such a program;
where they are unavailable a warning says so once, and untrusted code
belongs in a container or VM. Even with them, the program shares the
kernel, has no seccomp filter, can read the public files of ``/usr`` and the
interpreter's installation, and its CPU and memory are bounded by resource
limits, not a cgroup (docs: "Running untrusted programs" in
``guarantees``).
"""

from __future__ import annotations

import marshal
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nip_like import interrupts
from nip_like.errors import ConfigError, NipLikeError
from nip_like.scenarios.code_validation import isolation
from nip_like.scenarios.code_validation.harness import (
    BLOCKED_MODULES,
    BOOTSTRAP,
    GUARDED_PATH_FUNCTIONS,
    PREVIEW_CHARS,
    REMOVED_FUNCTIONS,
    child_environment,
    harness_code,
    text_digest,
    value_digest,
)


#: What a stop request (SIGINT, SIGTERM) finds the run waiting for while the sandbox runs programs.
WAITING_FOR = "programs running in the code sandbox"


class SandboxError(NipLikeError):
    """The sandbox itself could not run (the interpreter did not start); a program's failures are never this."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one program's child process may use.

    Parameters
    ----------
    time_limit : float
        Wall-clock seconds for the whole child, interpreter start and every
        test included; the child's process group is killed then. Its CPU time
        is limited to ``ceil(time_limit) + 1`` seconds as well.
    test_time_limit : float
        CPU seconds for one test (the harness's ``ITIMER_PROF`` alarm); a test
        past it fails and the next one starts. CPU time, not wall-clock time,
        so that a busy machine does not fail a fast program; a test that
        blocks without computing, or a program that catches the alarm's
        exception, is stopped by ``time_limit``.
    memory_mib : int
        The child's address space, in MiB (``RLIMIT_AS``); an allocation past
        it raises ``MemoryError`` in the program.
    output_kib : int
        Most KiB a test may print (more fails that test), and most KiB the
        child may write to its real standard output and error together (more
        kills it).
    file_size_kib : int
        Largest file the child may write, in KiB (``RLIMIT_FSIZE``).
    open_files : int
        Most open file descriptors (``RLIMIT_NOFILE``).

    Raises
    ------
    ConfigError
        If a value is out of range, naming the field.
    """

    time_limit: float = 10.0
    test_time_limit: float = 2.0
    memory_mib: int = 256
    output_kib: int = 64
    file_size_kib: int = 1024
    open_files: int = 64

    def __post_init__(self) -> None:
        for name in ("time_limit", "test_time_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"SandboxLimits.{name} must be a positive number of seconds, got {value!r}")
        for name, lowest in (("memory_mib", 64), ("output_kib", 1), ("file_size_kib", 0), ("open_files", 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ConfigError(f"SandboxLimits.{name} must be an integer >= {lowest}, got {value!r}")

    def rlimits(self) -> list[tuple[str, int]]:
        """Return the ``resource`` limits the harness sets on itself, as ``(RLIMIT_name, value)`` pairs."""
        return [
            ("RLIMIT_AS", self.memory_mib << 20),
            ("RLIMIT_CPU", math.ceil(self.time_limit) + 1),
            ("RLIMIT_FSIZE", self.file_size_kib << 10),
            ("RLIMIT_NOFILE", self.open_files),
            ("RLIMIT_CORE", 0),
            ("RLIMIT_NPROC", 0),
        ]


@dataclass(frozen=True)
class TestSuite:
    """The hidden tests of a problem, in one of two styles.

    Parameters
    ----------
    inputs : sequence
        One entry per test. Call style: the list of positional arguments
        (JSON values; anything that is not a list is one argument). Standard
        input style: the text the program reads.
    outputs : sequence
        The expected answers, one per test. Call style: the returned value
        (compared by :func:`canonical_value`). Standard input style: the text
        printed (a list of lines is joined with newlines), compared by
        :func:`normalise_text`.
    fn_name : str or None
        Call style: the function to call, a top-level function of the
        program or a method of its class ``Solution``; ``None`` for the
        standard input style, where the whole program runs once per test.
    lenient_lists : bool
        Also accept, for an expected answer that is a non-empty list, its
        first element (the rule of the APPS test harness, whose call-style
        answers are often wrapped in a list).

    Raises
    ------
    ValueError
        If ``inputs`` and ``outputs`` differ in length, or an input of the
        standard input style is not a string.
    """

    __test__ = False  # not a pytest test class

    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    fn_name: str | None = None
    lenient_lists: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if len(self.inputs) != len(self.outputs):
            raise ValueError(f"a test suite needs one output per input, got {len(self.inputs)} and {len(self.outputs)}")
        if self.fn_name is None and not all(isinstance(text, str) for text in self.inputs):
            raise ValueError("the inputs of a standard-input test suite must be strings")

    def __len__(self) -> int:
        return len(self.inputs)

    def expected_digests(self) -> list[frozenset[str]]:
        """Return, per test, the digests of the answers that pass it."""
        digests = []
        for output in self.outputs:
            if self.fn_name is None:
                text = output if isinstance(output, str) else "\n".join(str(line) for line in output)
                digests.append(frozenset({text_digest(text)}))
                continue
            accepted = {value_digest(output)}
            if self.lenient_lists and isinstance(output, list) and output:
                accepted.add(value_digest(output[0]))
            digests.append(frozenset(accepted))
        return digests


@dataclass(frozen=True)
class TestOutcome:
    """Whether one test passed, and if not, why (one line).

    Parameters
    ----------
    passed : bool
        The program gave the expected answer within the limits.
    reason : str
        Empty for a passed test; else for example ``"wrong answer: got 3"``,
        ``"error: ZeroDivisionError: integer division or modulo by zero"``,
        ``"time limit exceeded (the test used more than 0.1 s of CPU)"``.
    """

    __test__ = False  # not a pytest test class

    passed: bool
    reason: str = ""


@dataclass(frozen=True)
class ProgramRun:
    """The outcome of every test of one program.

    Parameters
    ----------
    outcomes : tuple of TestOutcome
        One per test, in the suite's order.
    seconds : float
        Wall-clock time of the child, start to end.
    """

    outcomes: tuple[TestOutcome, ...]
    seconds: float = field(default=0.0, compare=False)

    @property
    def passed(self) -> bool:
        """Whether every test passed (a program without tests does not pass)."""
        return bool(self.outcomes) and all(outcome.passed for outcome in self.outcomes)

    @property
    def num_passed(self) -> int:
        """How many tests passed."""
        return sum(outcome.passed for outcome in self.outcomes)

    @property
    def reason(self) -> str:
        """The first failed test's reason, prefixed with its index; empty if all passed."""
        for index, outcome in enumerate(self.outcomes):
            if not outcome.passed:
                return f"test {index}: {outcome.reason}"
        return "" if self.outcomes else "no tests"


# ---------------------------------------------------------------- the parent side


@dataclass
class _Reading:
    """What the parent read from one child."""

    reports: dict[int, tuple[str, str, str]] = field(default_factory=dict)
    ready: bool = False
    tail: bytes = b""
    output_exceeded: bool = False
    timed_out: bool = False
    stopped: bool = False


def _read_child(
    process: subprocess.Popen, result_fd: int, deadline: float, limits: SandboxLimits, size: int, stop_on: Any
) -> _Reading:
    """Read the child's result lines and output in chunks until both end, the deadline passes or a limit is hit."""
    reading = _Reading()
    output_limit = limits.output_kib << 10
    results_limit = output_limit + 400 * size
    output_bytes = results_bytes = 0
    partial = b""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout.fileno(), selectors.EVENT_READ, "output")
        selector.register(result_fd, selectors.EVENT_READ, "results")
        while selector.get_map():
            interrupts.raise_if_stop_requested(WAITING_FOR)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reading.timed_out = True
                return reading
            for key, _ in selector.select(min(remaining, interrupts.POLL_SECONDS)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                if key.data == "output":
                    output_bytes += len(chunk)
                    reading.tail = (reading.tail + chunk)[-2048:]
                    if output_bytes > output_limit:
                        reading.output_exceeded = True
                        return reading
                    continue
                results_bytes += len(chunk)
                if results_bytes > results_limit:
                    reading.output_exceeded = True
                    return reading
                *lines, partial = (partial + chunk).split(b"\n")
                for line in lines:
                    if line == b"ready":
                        reading.ready = True
                        continue
                    fields = line.decode("utf-8", "replace").split("\t", 3)
                    if len(fields) != 4 or not fields[0].isdigit() or int(fields[0]) >= size:
                        continue
                    index = int(fields[0])
                    reading.reports.setdefault(index, (fields[1], fields[2], fields[3]))
                    if stop_on(index, reading.reports[index]):
                        reading.stopped = True
                        return reading
    return reading


def _returncode(process: subprocess.Popen, isolated: bool) -> int:
    """The child's status, a signal as ``-number``: the first process of a PID namespace reports 128 + the signal."""
    code = process.returncode
    if isolated and code > 128 and code - 128 in signal.valid_signals():
        return 128 - code
    return code


def _missing_reason(reading: _Reading, returncode: int, limits: SandboxLimits) -> str:
    """Why a test has no result line."""
    if reading.output_exceeded:
        return f"output limit exceeded (more than {limits.output_kib} KiB printed)"
    if reading.timed_out:
        return f"time limit exceeded (the program ran past {limits.time_limit:g} s)"
    if reading.stopped:
        return "not run (stopped at the first failure)"
    last = " ".join(reading.tail.decode("utf-8", "replace").strip().splitlines()[-1:])[:PREVIEW_CHARS]
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        extra = {"SIGXCPU": " (CPU time limit)", "SIGSEGV": " (a crash, e.g. a stack overflow)"}.get(name, "")
        return f"the process was killed by {name}{extra}"
    if returncode > 0:
        return f"the process ended with status {returncode}" + (f": {last}" if last else "")
    return "the program ended the process before this test"


def _outcome(report: tuple[str, str, str], accepted: frozenset[str], limits: SandboxLimits) -> TestOutcome:
    """Turn one result line into a :class:`TestOutcome`."""
    status, digest, detail = report
    if status == "ok":
        return TestOutcome(True) if digest in accepted else TestOutcome(False, f"wrong answer: got {detail}")
    if status == "timeout":
        return TestOutcome(False, f"time limit exceeded (the test used more than {limits.test_time_limit:g} s of CPU)")
    if status == "output":
        return TestOutcome(False, f"output limit exceeded (more than {limits.output_kib} KiB printed)")
    return TestOutcome(False, f"error: {detail}" if detail else "error")


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the child's whole process group; the unreaped child keeps the group's id ours until then."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(
    source: str,
    suite: TestSuite,
    limits: SandboxLimits | None = None,
    *,
    stop_at_first_failure: bool = False,
) -> ProgramRun:
    """Run every test of ``suite`` on the program ``source`` in one sandboxed child process.

    Parameters
    ----------
    source : str
        The program's Python source.
    suite : TestSuite
        The tests and their expected answers (which never enter the child).
    limits : SandboxLimits, optional
        The child's limits; :class:`SandboxLimits` defaults if omitted.
    stop_at_first_failure : bool
        Kill the child as soon as one test fails; the tests after it fail as
        ``"not run (stopped at the first failure)"``. Enough to label a
        program, and much faster for programs that loop.

    Returns
    -------
    ProgramRun
        One outcome per test. Never raises for anything the program does.

    Raises
    ------
    SandboxError
        If the child interpreter cannot be started at all.
    nip_like.interrupts.StopNow
        If SIGINT or SIGTERM asked the run to stop (the child is killed first).
    """
    interrupts.raise_if_stop_requested(WAITING_FOR)
    isolated = isolation.current(_probe).enabled
    return _run(source, suite, limits or SandboxLimits(), stop_at_first_failure, isolated)


def _probe() -> str:
    """Run one small program in the namespaces: ``""`` if it passed, else why not (for :func:`isolation.current`)."""
    try:
        run = _run("def f():\n    return 1\n", TestSuite([[]], [1], "f"), SandboxLimits(), False, True)
    except (SandboxError, OSError) as error:
        return str(error)
    return "" if run.passed else f"a test program failed in them: {run.reason}"


def _run(source: str, suite: TestSuite, limits: SandboxLimits, stop_at_first_failure: bool, isolated: bool) -> ProgramRun:
    """:func:`run_program`, in the namespaces of :mod:`.isolation` or not."""
    accepted = suite.expected_digests()
    started = time.monotonic()

    def stop_on(index: int, report: tuple[str, str, str]) -> bool:
        return stop_at_first_failure and not _outcome(report, accepted[index], limits).passed

    with tempfile.TemporaryDirectory(prefix="nip_like_sandbox_", ignore_cleanup_errors=True) as parent:
        folder, view_root = os.path.join(parent, "program"), os.path.join(parent, "view")
        os.mkdir(folder)
        os.mkdir(view_root)
        view = isolation.view_spec(folder, view_root, limits.file_size_kib) if isolated else None
        read_fd, write_fd = os.pipe()
        job = {
            "source": source,
            "fn_name": suite.fn_name,
            "inputs": list(suite.inputs),
            "result_fd": write_fd,
            "rlimits": limits.rlimits(),
            "test_time": float(limits.test_time_limit),
            "output_limit": limits.output_kib << 10,
            "preview": PREVIEW_CHARS,
            "blocked": list(BLOCKED_MODULES),
            "removed": list(REMOVED_FUNCTIONS),
            "guarded": list(GUARDED_PATH_FUNCTIONS),
            "view": view,
        }
        argv = [sys.executable, "-s", "-S", "-P", "-c", BOOTSTRAP]
        try:
            Path(parent, "job.marshal").write_bytes(marshal.dumps((harness_code(), job)))
            process = subprocess.Popen(
                isolation.command(argv) if isolated else argv,
                cwd=folder,
                env=child_environment(folder),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        except (OSError, ValueError) as error:
            os.close(read_fd)
            raise SandboxError(f"could not start the sandbox's Python interpreter ({error})") from error
        finally:
            os.close(write_fd)
        try:
            reading = _read_child(process, read_fd, started + limits.time_limit, limits, len(suite), stop_on)
        finally:
            _kill_group(process)
            process.wait()
            os.close(read_fd)
            assert process.stdout is not None
            process.stdout.close()
    if isolated and not (reading.ready or reading.timed_out or reading.output_exceeded):
        last = " ".join(reading.tail.decode("utf-8", "replace").strip().splitlines()[-1:])[:200]
        raise SandboxError(f"the sandbox's namespaces failed before the program ran (status {process.returncode}): {last}")
    missing = _missing_reason(reading, _returncode(process, isolated), limits)
    outcomes = tuple(
        _outcome(reading.reports[index], accepted[index], limits)
        if index in reading.reports
        else TestOutcome(False, missing)
        for index in range(len(suite))
    )
    return ProgramRun(outcomes=outcomes, seconds=time.monotonic() - started)


def run_programs(
    jobs: Sequence[tuple[str, TestSuite]],
    limits: SandboxLimits | None = None,
    *,
    stop_at_first_failure: bool = False,
    workers: int = 1,
) -> list[ProgramRun]:
    """Run :func:`run_program` on each ``(source, suite)`` of ``jobs``; the results in the same order.

    ``workers`` threads start children at once (each program keeps its own
    process); the results do not depend on it. A stop request (SIGINT,
    SIGTERM under :func:`nip_like.interrupts.handle_interrupts`) raises
    :class:`~nip_like.interrupts.StopNow` within about
    :data:`~nip_like.interrupts.POLL_SECONDS`, once the children running
    are killed and the programs not started are dropped.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an integer >= 1, got {workers!r}")

    def run(job: tuple[str, TestSuite]) -> ProgramRun:
        return run_program(job[0], job[1], limits, stop_at_first_failure=stop_at_first_failure)

    if workers == 1:
        return [run(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        try:
            return [future.result() for future in futures]
        finally:
            for future in futures:
                future.cancel()
