"""The sandbox's child side: the harness that runs a program's tests inside the limited child process.

Everything here is what the child of
:func:`~nip_like.scenarios.code_validation.sandbox.run_program` runs or is
started with: the lists of what is blocked (:data:`BLOCKED_MODULES`,
:data:`REMOVED_FUNCTIONS`, :data:`GUARDED_PATH_FUNCTIONS`), how answers are
compared (:func:`canonical_value`, :func:`value_digest`, :func:`text_digest`,
which run on both sides), the harness itself (:func:`_child_main`, copied
into the child by its source, :func:`harness_source`) and the child's
environment (:func:`child_environment`). The parent's side (limits, test
suites, starting the child, reading its results) is
:mod:`~nip_like.scenarios.code_validation.sandbox`.

The child
---------
``sys.executable -s -S -P -c <bootstrap>``: no user site, no ``site`` module
(so only the standard library is importable), no script folder on
``sys.path``, and an environment built from scratch (no inherited variables,
no proxies, ``PYTHONHASHSEED=0`` so that programs that iterate over sets of
strings give the same answer every run: ``-I`` would ignore that variable,
and the fresh environment gives what ``-I`` gives otherwise). It runs in a new
session (its own process group, killed whole at the end), with standard
input at ``/dev/null``, its working folder a fresh temporary folder that is
removed afterwards, and ``HOME`` and ``TMPDIR`` pointing there.

The bootstrap (:data:`BOOTSTRAP`) loads the compiled harness
(:func:`harness_source`) and the job from a file beside that folder (in its
parent); the harness (:func:`_child_main`) deletes the file, enters the
operating system's isolation when the job asks for it
(:func:`~nip_like.scenarios.code_validation.isolation.enter_view`: a
read-only view, a fork, user 65534), then, before any line of the program
runs:

* sets resource limits on itself (``RLIMIT_AS`` memory, ``RLIMIT_CPU``,
  ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored so that a big write fails
  instead of killing, ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` 0, and
  ``RLIMIT_NPROC`` 0, which stops ``fork`` and threads for a user other
  than root; root is exempt from it). They are set there rather than in a
  ``preexec_fn``, which is unsafe in a multi-threaded parent such as a
  torch process;
* removes ``fork``, ``forkpty``, ``system``, the ``exec*``, ``spawn*`` and
  ``posix_spawn*`` functions, ``kill``, ``killpg`` and ``_exit`` from
  ``os`` and ``posix`` (and ``pidfd_send_signal`` from ``_signal``), and
  refuses to import ``socket``, ``ssl``, ``subprocess``,
  ``multiprocessing``, ``concurrent``, ``ctypes``, ``pty``, ``asyncio`` and
  the network clients, with their submodules (:data:`BLOCKED_MODULES`);
* replaces ``open`` and the path functions of ``os`` (``stat``,
  ``listdir``, ``scandir``, ``remove``, ``rename``, ``mkdir``, ``chdir``,
  ...) by versions that refuse, with ``PermissionError``, any path whose
  real path is outside the working folder.

Then it runs the tests one by one, each under a per-test CPU-time alarm
(:attr:`SandboxLimits.test_time_limit
<nip_like.scenarios.code_validation.sandbox.SandboxLimits.test_time_limit>`),
with ``sys.stdin``, ``sys.stdout`` and ``sys.stderr`` replaced by in-memory
streams (the output capped at :attr:`SandboxLimits.output_kib
<nip_like.scenarios.code_validation.sandbox.SandboxLimits.output_kib>`), and
writes one line per test on a pipe of its own: the test's index, a status,
the SHA-256 of the canonical answer (:func:`value_digest`,
:func:`text_digest`) and a short preview. The expected answers never enter
the child; the parent compares digests.

This module registers nothing.
"""

from __future__ import annotations

import inspect
from hashlib import sha256
from typing import Any

from nip_like.scenarios.code_validation.isolation import enter_view

#: Modules a program may not import, with their submodules (the harness imports none of them). Only
#: ``urllib``'s network parts are listed: ``pathlib`` imports ``urllib.parse``.
BLOCKED_MODULES = (
    "socket",
    "_socket",
    "ssl",
    "_ssl",
    "subprocess",
    "_posixsubprocess",
    "multiprocessing",
    "_multiprocessing",
    "concurrent",
    "ctypes",
    "_ctypes",
    "pty",
    "asyncio",
    "_asyncio",
    "socketserver",
    "http",
    "urllib.request",
    "urllib.robotparser",
    "ftplib",
    "smtplib",
    "poplib",
    "imaplib",
    "telnetlib",
    "xmlrpc",
    "webbrowser",
)

#: Functions of ``os`` and ``posix`` that the harness removes before a program runs.
REMOVED_FUNCTIONS = (
    "fork",
    "forkpty",
    "vfork",
    "system",
    "popen",
    "execl",
    "execle",
    "execlp",
    "execlpe",
    "execv",
    "execve",
    "execvp",
    "execvpe",
    "fexecve",
    "spawnl",
    "spawnle",
    "spawnlp",
    "spawnlpe",
    "spawnv",
    "spawnve",
    "spawnvp",
    "spawnvpe",
    "posix_spawn",
    "posix_spawnp",
    "kill",
    "killpg",
    "_exit",
    "register_at_fork",
)

#: Functions of ``os`` whose path arguments must lie inside the working folder.
GUARDED_PATH_FUNCTIONS = (
    "open",
    "stat",
    "lstat",
    "access",
    "listdir",
    "scandir",
    "remove",
    "unlink",
    "rename",
    "replace",
    "mkdir",
    "rmdir",
    "chdir",
    "chmod",
    "chown",
    "lchown",
    "truncate",
    "utime",
    "link",
    "symlink",
    "readlink",
    "mkfifo",
    "mknod",
    "statvfs",
    "chroot",
    "getxattr",
    "setxattr",
    "listxattr",
    "removexattr",
)

#: How many characters of an answer or an error the child sends back.
PREVIEW_CHARS = 120


# ---------------------------------------------------------------- answers (these run in the child too)
# The functions from here to _child_main are copied into the child's harness by their source
# (harness_source): they use builtins only, and their annotations name builtins only.


def canonical_value(value: object, depth: int = 0) -> object:
    """Return the form in which a call-style answer is compared.

    Tuples become lists, ``bool`` becomes ``int`` and a float with an integral
    value becomes that ``int`` (so ``True == 1`` and ``2.0 == 2``, as in
    Python); a dict becomes a sorted list of ``[key, value]`` pairs; lists,
    strings, ints, other floats and ``None`` stay. Anything else (a set, an
    object) is refused.

    Raises
    ------
    TypeError
        For a value of another type, or nested more than 100 deep.
    """
    if depth > 100:
        raise TypeError("the answer is nested more than 100 deep")
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if value == value and abs(value) != float("inf") and value.is_integer():
            return int(value)
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [canonical_value(item, depth + 1) for item in value]
    if isinstance(value, dict):
        pairs = [[canonical_value(key, depth + 1), canonical_value(item, depth + 1)] for key, item in value.items()]
        return ["dict", sorted(pairs, key=repr)]
    raise TypeError(f"the answer is a {type(value).__name__}, which is not compared (use lists, numbers, strings)")


def value_digest(value: object) -> str:
    """Return the SHA-256 (hex) of ``repr(canonical_value(value))``: equal answers, equal digests."""
    return sha256(repr(canonical_value(value)).encode("utf-8", "surrogatepass")).hexdigest()


def normalise_text(text: str) -> str:
    """Return printed text as it is compared: each line stripped, leading and trailing blank lines dropped."""
    return "\n".join(line.strip() for line in text.strip().splitlines())


def text_digest(text: str) -> str:
    """Return the SHA-256 (hex) of :func:`normalise_text` of ``text``."""
    return sha256(normalise_text(text).encode("utf-8", "surrogatepass")).hexdigest()


def _child_main(job: dict) -> None:
    """The harness: the child's whole program (see the module's docstring). Runs only in the child, on ``job``."""
    import _signal as signal  # not ``signal``: it imports enum, which doubles the child's start-up time
    import builtins
    import io
    import os
    import posix
    import resource
    import sys

    os.remove("../job.marshal")
    if job["view"] is not None:
        enter_view(job["view"])
    write, exit_now, result_fd = os.write, os._exit, job["result_fd"]
    write(result_fd, b"ready\n")  # the sandbox is set up: what follows is the program's doing
    for name, value in job["rlimits"]:
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError, AttributeError):
            pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def leave(code=None):
        raise SystemExit(code)

    builtins.exit = builtins.quit = leave  # what ``site`` (not loaded) would give

    class TimeLimit(BaseException):
        """The per-test CPU-time alarm went off."""

    class OutputLimit(BaseException):
        """A test printed more than the limit."""

    def on_alarm(signum, frame):
        raise TimeLimit()

    signal.signal(signal.SIGPROF, on_alarm)
    set_timer, cpu_timer, test_time = signal.setitimer, signal.ITIMER_PROF, job["test_time"]
    output_limit = job["output_limit"]

    class CappedBuffer(io.BytesIO):
        """A byte buffer that raises :class:`OutputLimit` past ``output_limit`` bytes."""

        def write(self, data):
            if self.tell() + len(data) > output_limit:
                raise OutputLimit()
            return super().write(data)

    # ---- guards: imports, processes, signals, paths
    blocked = frozenset(job["blocked"])

    def is_blocked(name):
        parts = name.split(".")
        return any(".".join(parts[:end]) in blocked for end in range(1, len(parts) + 1))

    class Blocker:
        """A meta-path finder that refuses the blocked modules."""

        @staticmethod
        def find_spec(name, path=None, target=None):
            if is_blocked(name):
                raise ImportError(f"the sandbox does not allow importing {name}")
            return None

    for name in list(sys.modules):
        if is_blocked(name):
            del sys.modules[name]
    sys.meta_path.insert(0, Blocker)
    for module in (os, posix):
        for name in job["removed"]:
            if hasattr(module, name):
                delattr(module, name)
    if hasattr(signal, "pidfd_send_signal"):
        del signal.pidfd_send_signal

    root = os.path.realpath(os.getcwd())
    checking = [False]

    def inside(path):
        if isinstance(path, int) or checking[0]:
            return True
        checking[0] = True
        try:
            real = os.path.realpath(os.fsdecode(os.fspath(path)))
        finally:
            checking[0] = False
        return real == root or real.startswith(root + os.sep)

    def guarded(function, name):
        def guard(*args, **kwargs):
            paths = list(args[:2] if name in ("rename", "replace", "link", "symlink") else args[:1])
            paths += [kwargs[key] for key in ("path", "file", "src", "dst") if key in kwargs]
            for path in paths:
                if path is not None and not inside(path):
                    raise PermissionError(f"the sandbox does not allow access to {path!r}, outside its folder")
            return function(*args, **kwargs)

        return guard

    builtins.open = io.open = guarded(io.open, "open")
    for name in job["guarded"]:
        if hasattr(os, name):
            setattr(os, name, guarded(getattr(os, name), name))

    # ---- the tests
    def describe(error):
        try:
            text = str(error)
        except BaseException:
            text = ""
        return f"{type(error).__name__}: {text}" if text else type(error).__name__

    def report(index, status, digest, detail):
        line = " ".join(str(detail).split())[: job["preview"]]
        write(result_fd, f"{index}\t{status}\t{digest}\t{line}\n".encode("utf-8", "replace"))

    def attempt(call):
        """Run ``call()`` under the alarm, with fresh standard streams; return (status, digest, detail)."""
        try:
            try:
                set_timer(cpu_timer, test_time)
                return call()
            finally:
                set_timer(cpu_timer, 0)
        except TimeLimit:
            return ("timeout", "", "")
        except OutputLimit:
            return ("output", "", "")
        except BaseException as error:
            return ("error", "", describe(error))

    def streams(text):
        sys.stdin = io.TextIOWrapper(io.BytesIO(text.encode("utf-8", "surrogatepass")), encoding="utf-8")
        captured = io.TextIOWrapper(CappedBuffer(), encoding="utf-8", errors="replace", write_through=True)
        sys.stdout = sys.stderr = captured
        return captured

    source, fn_name, inputs = job["source"], job["fn_name"], job["inputs"]
    try:
        code = compile(source, "<program>", "exec")
        load_error = ""
    except BaseException as error:
        code, load_error = None, describe(error)

    if fn_name is None:
        for index, text in enumerate(inputs):
            if code is None:
                report(index, "error", "", load_error)
                continue
            captured = streams(text)

            def run_main(captured=captured):
                try:
                    exec(code, {"__name__": "__main__", "__builtins__": builtins})
                except SystemExit as stop:
                    if stop.code not in (None, 0):
                        raise
                captured.flush()
                printed = captured.buffer.getvalue().decode("utf-8", "replace")
                return ("ok", text_digest(printed), repr(printed[: job["preview"]]))

            report(index, *attempt(run_main))
        exit_now(0)

    namespace = {"__name__": "__program__", "__builtins__": builtins}
    function = None
    if code is not None:
        streams("")

        def load():
            exec(code, namespace)
            found = namespace.get(fn_name)
            if found is None and isinstance(namespace.get("Solution"), type):
                found = getattr(namespace["Solution"](), fn_name, None)
            if not callable(found):
                return ("error", "", f"the program defines no function {fn_name}")
            namespace["__function__"] = found
            return ("ok", "", "")

        status, _, load_error = attempt(load)
        if status == "ok":
            function = namespace.pop("__function__")
        elif status == "timeout":
            load_error = "time limit exceeded while loading the program"
        elif status == "output":
            load_error = "output limit exceeded while loading the program"
    for index, arguments in enumerate(inputs):
        if function is None:
            report(index, "error", "", f"the program failed to load: {load_error}")
            continue
        streams("")

        def call(arguments=arguments):
            value = function(*arguments) if isinstance(arguments, list) else function(arguments)
            return ("ok", value_digest(value), repr(canonical_value(value))[: job["preview"]])

        report(index, *attempt(call))
    exit_now(0)


_HARNESS_PRELUDE = """\
try:
    from _sha256 import sha256
except ImportError:
    try:
        from _sha2 import sha256
    except ImportError:
        from hashlib import sha256
"""

#: What the interpreter is told to run: load the job file (the harness's compiled code and the job) and run it.
BOOTSTRAP = 'import marshal; code, job = marshal.loads(open("../job.marshal", "rb").read()); exec(code)'

_harness: str | None = None
_harness_code: Any = None


def harness_source() -> str:
    """Return the harness's source: the answer functions above, then :func:`_child_main` called on ``job``."""
    global _harness
    if _harness is None:
        functions = (canonical_value, value_digest, normalise_text, text_digest, enter_view)
        parts = [inspect.getsource(function) for function in functions]
        _harness = "\n\n".join([_HARNESS_PRELUDE, *parts, inspect.getsource(_child_main), "_child_main(job)\n"])
    return _harness


def harness_code() -> Any:
    """Return :func:`harness_source` compiled once (the child is this interpreter, so it loads the code object)."""
    global _harness_code
    if _harness_code is None:
        _harness_code = compile(harness_source(), "<sandbox harness>", "exec")
    return _harness_code


def child_environment(folder: str) -> dict[str, str]:
    """Return the child's whole environment: nothing is inherited (no proxies, no ``PYTHONPATH``)."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": folder,
        "TMPDIR": folder,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONSAFEPATH": "1",
        "no_proxy": "*",
        "NO_PROXY": "*",
    }
