"""The run's memory budget as a cgroup v2 of its own, where the host delegates one.

One figure bounds the whole run: every process of the command, and the pages of its private
tmpfs (they are charged to the cgroup of the process that wrote them). `probe` decides in the
parent, from /proc and the cgroup files, whether a child cgroup can be made under the current
one; `enter` (in the launcher, before it unshares) makes it, writes ``memory.max`` (and
``memory.swap.max = 0``: swapping out is no escape from the budget, and ``pids.max``) and moves
the launcher into it, so the reaper and the command are born inside; `leave` (in the launcher,
once the reaper is gone) reads what happened, moves the launcher back, kills what is left and
removes the cgroup.

When can a cgroup be made: cgroup v2 forbids processes in a cgroup whose children have
controllers (the "no internal process" rule), so the current cgroup must already enable
``memory`` for its children (a delegated, otherwise empty, subtree) or be the root of the
hierarchy (root in a host or a container with its own cgroup namespace may enable it there).
The directory must be writable by the invoker (root, or a delegation to its uid). Anything
else: no cgroup, and the reason, for the run's report.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import NamedTuple

PREFIX = "egressbox-"
# After the reaper is gone the kernel may take a moment to free the cgroup's last task.
EMPTY_WAIT = 2.0
_POLL = 0.01


class CgroupPlan(NamedTuple):
    """Where the run's cgroup goes and what bounds it."""

    parent: str  # the current cgroup's directory
    name: str
    memory_max: int
    pids_max: int | None
    enable: tuple[str, ...] = ()  # controllers to enable in parent's subtree_control first

    @property
    def path(self) -> str:
        return os.path.join(self.parent, self.name)


class Outcome(NamedTuple):
    oom_kills: int
    peak: int | None  # memory.peak, bytes (Linux 5.19+)


def cgroup2_mount(mountinfo: str) -> str | None:
    """The mount point of the cgroup v2 hierarchy, from /proc/self/mountinfo's text."""
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            return left.split(" ")[4]
    return None


def current_path(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path ("0::/a/b" in /proc/self/cgroup)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def probe(
    memory_max: int, pids_max: int | None, name: str, *, root: str = "/"
) -> tuple[CgroupPlan | None, str]:
    """A plan for the run's cgroup, or None and why not (a sentence for the report)."""
    try:
        mountinfo = _read(os.path.join(root, "proc/self/mountinfo"))
        proc_cgroup = _read(os.path.join(root, "proc/self/cgroup"))
    except OSError as exc:
        return None, f"/proc cannot be read: {exc.strerror}"
    mount = cgroup2_mount(mountinfo)
    here = current_path(proc_cgroup)
    if mount is None or here is None:
        return None, "no cgroup v2 hierarchy is mounted"
    parent = os.path.normpath(os.path.join(root, mount.lstrip("/"), here.lstrip("/")))
    try:
        enable, pids = _controllers(parent, here, root)
    except _NoCgroupError as exc:
        return None, str(exc)
    return CgroupPlan(parent, name, memory_max, pids_max if pids else None, enable), ""


class _NoCgroupError(Exception):
    """Why the run gets no cgroup (a sentence for the report)."""


def _controllers(parent: str, here: str, root: str) -> tuple[tuple[str, ...], bool]:
    """Which controllers must be enabled in `parent` first, and whether pids is there."""
    try:
        available = _read(os.path.join(parent, "cgroup.controllers")).split()
        enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
    except OSError as exc:
        raise _NoCgroupError(f"{parent} cannot be read: {exc.strerror}") from None
    if "memory" not in available:
        v1 = os.path.isdir(os.path.join(root, "sys/fs/cgroup/memory"))
        raise _NoCgroupError(
            f"the memory controller is not available to {here} in the cgroup v2 hierarchy"
            + (" (it is bound to a cgroup v1 hierarchy here)" if v1 else "")
        )
    wanted = ("memory", "pids") if "pids" in available else ("memory",)
    enable = tuple(c for c in wanted if c not in enabled)
    if enable and here != "/":
        raise _NoCgroupError(
            f"{here} holds processes and does not enable {' and '.join(enable)} for child "
            "cgroups (cgroup v2's no-internal-process rule); start egressbox in a delegated "
            "cgroup that does"
        )
    if not os.access(parent, os.W_OK):
        raise _NoCgroupError(f"{here} is not delegated to uid {os.geteuid()} (not writable)")
    return enable, "pids" in wanted


def enter(plan: CgroupPlan) -> str:
    """Make the run's cgroup and move this process into it; returns its path.

    Raises OSError with the step in its text; a half-made cgroup is removed again.
    """
    _sweep(plan.parent)
    if plan.enable:
        _write(plan.parent, "cgroup.subtree_control", " ".join(f"+{c}" for c in plan.enable))
    path = plan.path
    os.mkdir(path, 0o755)
    try:
        _write(path, "memory.max", str(plan.memory_max))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(path, "memory.swap.max", "0")
        if plan.pids_max is not None:
            _write(path, "pids.max", str(plan.pids_max))
        _write(path, "cgroup.procs", "0")
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        raise
    return path


def leave(path: str) -> Outcome:
    """What the run's cgroup saw; then this process out, any process left killed, removed."""
    outcome = Outcome(_oom_kills(path), _int(path, "memory.peak"))
    with contextlib.suppress(OSError):
        _write(os.path.dirname(path), "cgroup.procs", "0")
    if _populated(path):
        with contextlib.suppress(OSError):
            _write(path, "cgroup.kill", "1")  # Linux 5.14+; before it, a PID namespace did
    deadline = time.monotonic() + EMPTY_WAIT
    while _populated(path) and time.monotonic() < deadline:
        time.sleep(_POLL)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return outcome


def _sweep(parent: str) -> None:
    """Remove cgroups of earlier runs whose launcher died without removing its own (SIGKILL):
    an empty one goes, a populated one refuses rmdir and stays."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX) :] if name.startswith(PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(parent, name))


def _oom_kills(path: str) -> int:
    try:
        events = _read(os.path.join(path, "memory.events"))
    except OSError:
        return 0
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


def _populated(path: str) -> bool:
    try:
        events = _read(os.path.join(path, "cgroup.events"))
    except OSError:
        return False  # gone (or never made): nothing to wait for
    return "populated 1" in events.splitlines()


def _int(path: str, name: str) -> int | None:
    try:
        text = _read(os.path.join(path, name)).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read(path: str) -> str:
    with open(path, encoding="ascii", errors="replace") as handle:
        return handle.read()


def _write(directory: str, name: str, value: str) -> None:
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    except OSError as exc:
        raise OSError(exc.errno, f"{name} of {directory}: {exc.strerror}") from None
    finally:
        os.close(fd)
