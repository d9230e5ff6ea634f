"""Isolation of the sandbox's child by the operating system: namespaces, a read-only view, an unprivileged user.

Where the kernel allows it (Linux, ``unshare`` from util-linux installed,
and the right to create namespaces, as root has outside most containers),
:func:`~nip_like.scenarios.code_validation.sandbox.run_program` starts its
child through :func:`command`::

    unshare --net --mount --pid --fork --kill-child --ipc --uts --propagation private -- python ...

and the child's harness calls :func:`enter_view` before anything else. The
program then runs

* in a network namespace of its own, with no interface up (not even the
  loopback): every connection fails;
* in a PID namespace whose first process (the harness, before it forks the
  program's process) lives exactly as long as the run: when it ends, or the
  parent kills the child's process group, the kernel kills every process
  left in the namespace, ``setsid`` or not. The parent's processes are not
  visible there, so none can be signalled;
* in a mount namespace whose root is a fresh, read-only tmpfs holding only
  read-only, ``nosuid`` binds of ``/usr`` (and the ``/bin``, ``/lib``, ...
  links to it), the interpreter's installation (:func:`view_binds`), four
  devices (``/dev/null``, ``/dev/zero``, ``/dev/random``, ``/dev/urandom``)
  and, at the same path as outside, the program's folder: a tmpfs of its own
  of at most :func:`folder_kib` KiB, the only place it can write. There is
  no ``/etc``, ``/home``, ``/proc``, ``/sys``, ``/tmp`` outside that folder,
  nor the project's files;
* in IPC and UTS namespaces of its own;
* as user and group 65534 (``nobody``) with no supplementary groups, so
  without capabilities: it cannot mount, ``chroot`` back out, raise its
  limits or bring an interface up, and ``RLIMIT_NPROC`` (0) stops it from
  starting processes and threads at all.

Where any of this is unavailable, :func:`current` says why (once, in the
log) and the child runs with the in-process guard alone, as before; the
guard (:mod:`~nip_like.scenarios.code_validation.harness`) is kept under the
isolation either way. :func:`summary` is what a run's ``summary.json``
records under ``sandbox_isolation``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: The user and group the program runs as inside the namespaces (``nobody``).
UNPRIVILEGED_ID = 65534

#: The namespaces and options given to ``unshare``.
UNSHARE_OPTIONS = ("--net", "--mount", "--pid", "--fork", "--kill-child", "--ipc", "--uts", "--propagation", "private")

#: The devices the view holds (bound from the host, read-only).
VIEW_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

#: Top-level folders of the view that are bound from the host when they are folders, or copied as links.
VIEW_TOP_LEVEL = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@dataclass(frozen=True)
class Isolation:
    """Whether programs run in namespaces, and if not, why.

    Parameters
    ----------
    enabled : bool
        The child runs under :func:`command` and :func:`enter_view`.
    reason : str
        Why not, in a few words (empty when enabled).
    """

    enabled: bool
    reason: str = ""

    def summary(self) -> str:
        """Return the one-line description written to a run's ``summary.json``."""
        if self.enabled:
            return "namespaces (network, PID, mount, IPC, UTS), read-only view, user 65534, in-process guard"
        return f"in-process guard only ({self.reason})"


def folder_kib(file_size_kib: int) -> int:
    """Return the size, in KiB, of the program's writable folder in the view: four of its largest files, at least 1 MiB."""
    return max(1024, 4 * file_size_kib)


def view_binds() -> tuple[list[str], dict[str, str]]:
    """Return the host folders bound read-only into the view, and its links (``/lib`` -> ``usr/lib``, ...).

    The folders are ``/usr`` and, for each of :data:`VIEW_TOP_LEVEL` that is
    a real folder, that folder; then the interpreter's installation
    (``sys.base_prefix``, resolved) unless it lies in one already.
    """
    binds: list[str] = []
    links: dict[str, str] = {}
    for path in VIEW_TOP_LEVEL:
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            binds.append(path)
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == bound or prefix.startswith(bound + os.sep) for bound in binds):
        binds.append(prefix)
    return binds, links


def view_spec(folder: str, view_root: str, file_size_kib: int) -> dict:
    """Return what :func:`enter_view` needs, as plain values (it travels to the child in the job).

    Parameters
    ----------
    folder : str
        The program's folder: its working folder, at the same path inside the
        view as outside.
    view_root : str
        An empty host folder, where the view's root is mounted (in the
        child's mount namespace only).
    file_size_kib : int
        The largest file the program may write (sizes its folder).
    """
    binds, links = view_binds()
    return {
        "root": view_root,
        "folder": folder,
        "binds": binds,
        "links": links,
        "devices": list(VIEW_DEVICES),
        "folder_kib": folder_kib(file_size_kib),
        "user": UNPRIVILEGED_ID,
        "host_mount_namespace": os.readlink("/proc/self/ns/mnt"),
    }


def command(argv: list[str]) -> list[str]:
    """Return ``argv`` run through ``unshare`` in new namespaces (:data:`UNSHARE_OPTIONS`)."""
    return [shutil.which("unshare") or "unshare", *UNSHARE_OPTIONS, "--", *argv]


# ---------------------------------------------------------------- the child's side
# enter_view is copied into the child's harness by its source: builtins and imports inside it only.


def enter_view(spec: dict) -> None:
    """In the child, inside the new namespaces: build the read-only view, enter it, fork, drop to user 65534.

    The process that calls this stays behind as the PID namespace's first
    process: it waits for the forked one and ends with its status (128 + the
    signal's number for a signal), which ends the namespace and every
    process still in it. The forked one returns, in the view's program
    folder, as user and group ``spec["user"]``. Refuses (status 70) when the
    mount namespace is the host's, so that nothing is ever mounted there.
    """
    import _ctypes  # not ctypes, whose import costs a run about 10 ms more
    import os

    if os.readlink("/proc/self/ns/mnt") == spec["host_mount_namespace"]:
        os.write(2, b"sandbox: not in a new mount namespace; refusing to mount\n")
        os._exit(70)

    class Int(_ctypes._SimpleCData):
        _type_ = "i"

    class UnsignedLong(_ctypes._SimpleCData):
        _type_ = "L"

    class Function(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int

    class Library:
        _handle = _ctypes.dlopen(None, 0)

    mount_call = Function(("mount", Library()))
    read_only, no_suid, no_dev, remount, bind, recursive, private = 1, 2, 4, 32, 4096, 16384, 1 << 18

    def mount(source, target, kind, flags, options=None):
        encoded = [None if text is None else text.encode() for text in (source, target, kind, options)]
        if mount_call(encoded[0], encoded[1], encoded[2], UnsignedLong(flags), encoded[3]) != 0:
            number = _ctypes.get_errno()
            raise OSError(number, f"mount {target}: {os.strerror(number)}")

    root = spec["root"]
    mount(None, "/", None, recursive | private)
    mount("nip_like_view", root, "tmpfs", no_suid | no_dev, "size=256k,nr_inodes=512,mode=755")
    for path in spec["binds"]:
        target = root + path
        os.makedirs(target, exist_ok=True)
        mount(path, target, None, bind)
        mount(None, target, None, remount | bind | read_only | no_suid | no_dev)
    for path in spec["devices"]:
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb"):
            pass
        mount(path, target, None, bind)
        mount(None, target, None, remount | bind | read_only | no_suid)
    for path, target in spec["links"].items():
        os.symlink(target, root + path)
    folder, user = root + spec["folder"], spec["user"]
    os.makedirs(folder)
    options = f"size={spec['folder_kib']}k,nr_inodes=4096,mode=700,uid={user},gid={user}"
    mount("nip_like_folder", folder, "tmpfs", no_suid | no_dev, options)
    mount(None, root, None, remount | read_only | no_suid | no_dev)
    os.chroot(root)
    os.chdir(spec["folder"])
    child = os.fork()
    if child:
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        code = os.waitstatus_to_exitcode(status)
        os._exit(128 - code if code < 0 else code)
    os.setgroups([])
    os.setgid(user)
    os.setuid(user)


# ---------------------------------------------------------------- whether to use it

_current: Isolation | None = None
_lock = threading.Lock()


def current(probe: Callable[[], str]) -> Isolation:
    """Return whether programs run isolated in this process; decided once, by ``probe``, and logged once if not.

    Parameters
    ----------
    probe : callable
        Runs a small program through :func:`command` and :func:`enter_view`
        and returns ``""`` if it passed, else why it did not (in a few
        words). Called at most once per process, and not at all off Linux or
        without ``unshare``.
    """
    global _current
    with _lock:
        if _current is None:
            if not sys.platform.startswith("linux"):
                reason = f"namespaces need Linux, this is {sys.platform}"
            elif shutil.which("unshare") is None:
                reason = "util-linux's unshare is not installed"
            else:
                reason = probe()
            _current = Isolation(not reason, reason)
            if reason:
                log.warning("The code sandbox runs programs without namespaces (%s): the in-process guard only", reason)
        return _current


def used() -> Isolation | None:
    """Return the isolation decided in this process, or ``None`` if no program ran here."""
    return _current


def decide(isolation: Isolation | None) -> None:
    """Set (or with ``None`` forget) the decision of :func:`current`; for tests and measurements."""
    global _current
    with _lock:
        _current = isolation
