"""What a planned run reads and makes on the host before the fork: `read_host` (the live unix
sockets, real paths, the clean copies' sources, the cgroup, whether connects can be
supervised), `set_up` (the proxy's listeners on the host's loopback without a network
namespace, the connect supervisor's capture listener, the staged layer in the launcher's
plan), the scratch space without a mount namespace, and the host's facts (the probe, the
compiled seccomp filter). Planning itself is confine/planning.py, which does none of this.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from egressbox.confine import cgroup, netns
from egressbox.confine.grants import (
    PACKAGE_MANAGER_CONFIG,
    PROC_NET_UNIX,
    FsPlan,
    Mechanism,
    bound_socket_paths,
    expand_user,
    is_under,
)
from egressbox.confine.launcher import give_directories
from egressbox.confine.planning import (
    Confinement,
    Grants,
    HostReads,
    Plan,
    filesystem,
    held_paths,
    scratch_paths,
)
from egressbox.confine.spec import LaunchPlan
from egressbox.core.errors import EgressboxError

if TYPE_CHECKING:
    # Types only: the environment's module (~3 ms), the clean copies and the probe load when
    # used; a launcher forked ahead of time (runner/zygote.py) loads this module.
    from egressbox.confine.cgroup import CgroupPlan
    from egressbox.confine.clean import CleanCopies
    from egressbox.confine.env import Scratch
    from egressbox.confine.probe import Mechanism as HostMechanism
    from egressbox.confine.staging import StagingSpec


def read_host(
    planned: Plan,
    grants: Grants,
    *,
    budget: int | None,
    max_processes: int | None,
) -> HostReads:
    """What `finish` needs of the host for these grants under `planned` (reads only): the
    grants themselves are planned here as `finish` will, to know which paths to read."""
    mechanisms = planned.mechanisms
    mounts = Mechanism.MOUNT_NAMESPACE in mechanisms
    files = mounts or Mechanism.LANDLOCK_FS in mechanisms
    connects = "" if Mechanism.NETWORK_NAMESPACE in mechanisms else connects_off(mechanisms)
    supervised = Mechanism.NETWORK_NAMESPACE not in mechanisms and not connects
    fs = filesystem(grants, mounts)
    copies = _gather_copies(fs, grants) if files else None
    reads = HostReads(copies=copies, connects_off=connects, supervised=supervised)
    if mounts or supervised:
        # The paths the world or the supervisor holds the live sockets against.
        paths = held_paths(fs, grants, reads, mounts)
        reads = reads._replace(
            live_sockets=_live_sockets(), real={p: os.path.realpath(p) for p in paths}
        )
    group, group_off = probe_cgroup(budget, max_processes)
    return reads._replace(
        cgroup=group,
        cgroup_off=group_off,
        connect_filter=connect_filter() if supervised else b"",
    )


def _live_sockets() -> tuple[str, ...]:
    """The host's bound unix sockets, as real paths; /proc/net/unix lists the sockets of this
    network namespace."""
    try:
        with open(PROC_NET_UNIX, encoding="utf-8", errors="surrogateescape") as f:
            table = f.read()
    except OSError:
        return ()
    found = [os.path.realpath(p) for p in bound_socket_paths(table)]
    return tuple(p for p in dict.fromkeys(found) if _is_socket(p))


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _gather_copies(fs: FsPlan, g: Grants) -> CleanCopies | None:
    """The tools' configuration files in view, read and cleaned (confine/clean.py); None when
    none is in view."""
    from egressbox.confine import clean

    presets = (
        *(expand_user(p, g.home) for p in PACKAGE_MANAGER_CONFIG),
        *clean.SYSTEM_TOOL_CONFIG,
    )
    in_view = (*fs.read, *fs.write)
    entries = [p for p in presets if any(is_under(p, r) for r in in_view) and os.path.lexists(p)]
    if not entries:
        return None
    return clean.gather(entries, home=g.home, deny=fs.deny, passed=g.passed)


def probe_cgroup(budget: int | None, max_processes: int | None) -> tuple[CgroupPlan | None, str]:
    """The run's memory budget as a cgroup where the host delegates one, or why not."""
    if budget is None:
        return None, "the host's memory size is unknown"

    return cgroup.probe(budget, max_processes, f"{cgroup.PREFIX}{os.getpid()}")


def connects_off(chosen: frozenset[Mechanism]) -> str:
    """Why this run's connects cannot be supervised without a namespace ("" when they can)."""
    from egressbox.confine import notify

    if Mechanism.SECCOMP not in chosen:
        return "the profile applies no seccomp filter"
    return notify.support()


def connect_filter() -> bytes:
    """The connect supervisor's seccomp filter for this machine (Plan's launcher plan)."""
    from egressbox.confine import notify

    return notify.program()


def namespace_blocker() -> str:
    """What blocks namespaces here and the fix, in a line ("" when nothing is found): a test
    unshare in a child and a few /proc reads."""
    from egressbox.confine.probe import namespace_blocker as find

    found = find()
    return found.line() if found is not None else ""


def bind_host_listeners() -> list[socket.socket]:
    """No network namespace: the proxy listens on the host's loopback and Landlock ports plus
    seccomp hold the child to those port numbers."""
    listeners: list[socket.socket] = []
    try:
        for _ in range(2):
            listeners.append(netns.bind_listener("127.0.0.1", 0))
    except OSError as exc:
        for sock in listeners:
            sock.close()
        # e.g. inside another run's Landlock domain, which refuses every bind
        raise EgressboxError(
            f"cannot listen on 127.0.0.1 for the proxy: {exc.strerror or exc}"
        ) from None
    return listeners


def bind_host_capture() -> socket.socket:
    """The capture listener on the host's loopback: the connect supervisor connects every
    command socket bound elsewhere to it (the proxy learns the destination from its table)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


class SetUp(NamedTuple):
    """What `set_up` made for a planned run, and the launcher's plan completed with it."""

    launcher: LaunchPlan
    listeners: list[socket.socket]  # the proxy's, on the host's loopback (no namespace)
    host_capture: socket.socket | None  # the connect supervisor's capture listener


def set_up(plan: Confinement, *, staged: StagingSpec | None = None) -> SetUp:
    """Make on the host what the planned run needs before its launch: without a network
    namespace the proxy's listeners (and, supervised with capture, the capture listener);
    `staged` is the staged workspace's layer (made by the caller), which holds the host-trusted
    paths back at the run's end instead of binding them read-only. On failure nothing made
    stays open."""
    launcher = plan.launcher
    if staged is not None and launcher.world is not None:
        held = set(plan.trusted)
        world = launcher.world._replace(
            read_only=tuple(p for p in launcher.world.read_only if p not in held)
        )
        launcher = launcher._replace(world=world, staged=staged)
    if Mechanism.NETWORK_NAMESPACE in plan.mechanisms:
        return SetUp(launcher, [], None)
    listeners = bind_host_listeners()
    launcher = launcher._replace(host_ports=tuple(s.getsockname()[1] for s in listeners))
    try:
        capture = bind_host_capture() if plan.supervised and plan.captures else None
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    return SetUp(launcher, listeners, capture)


def make_scratch(root: str, name: str, owner: tuple[int, int] | None = None) -> Scratch | None:
    """Without a mount namespace: the scratch space made on the host, never through a link;
    `owner` (--user) is given it. None when it cannot be made.

    An earlier child could have left `name` (or `tmp` in it) as a symlink to any directory of
    the invoker's: every step opens the next name with O_NOFOLLOW.
    """
    try:
        top = os.open(root, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        base = _subdir(top, name)
        try:
            for sub in ("tmp", "cache"):
                os.close(_subdir(base, sub))
            _write_ignore(base)
        finally:
            os.close(base)
    except OSError:
        return None
    finally:
        os.close(top)
    made = scratch_paths(root, name)
    if owner is not None:
        give_scratch(made, owner)
    return made


def private_scratch(owner: tuple[int, int] | None = None) -> Scratch:
    """A read-only workspace's scratch space without a mount namespace: a private directory of
    the host's, for this run only (the caller removes its parent at the end)."""
    import tempfile

    from egressbox.confine.env import Scratch

    made = tempfile.mkdtemp(prefix="egressbox-scratch-")
    for name in ("tmp", "cache"):
        os.mkdir(os.path.join(made, name), 0o700)
    scratch = Scratch(os.path.join(made, "tmp"), os.path.join(made, "cache"))
    if owner is not None:
        give_scratch(scratch, owner)
    return scratch


def give_scratch(scratch: Scratch, owner: tuple[int, int]) -> None:
    """--user: the scratch space made on the host (TMPDIR, caches) is NAME's."""
    give_directories((os.path.dirname(scratch.tmp), scratch.tmp, scratch.cache), owner)


def _subdir(parent: int, name: str) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=parent)
    return os.open(name, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)


def _write_ignore(base: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(".gitignore", flags, 0o644, dir_fd=base)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write("# egressbox scratch space (temp files and caches)\n*\n")


def probe(names: Sequence[str]) -> list[HostMechanism]:
    """Probe these mechanisms on this host (confine/probe.py; a child for each namespace)."""
    from egressbox.confine.probe import probe_mechanisms

    return list(probe_mechanisms(tuple(names)))


def compile_seccomp(*, allow_udp: bool) -> bytes:
    """The command's seccomp filter as a BPF program (b"": the launcher builds it itself)."""
    from egressbox.confine.seccomp import SeccompOptions, Status, compile_filter

    compiled = compile_filter(SeccompOptions(allow_udp=allow_udp))
    return compiled.program if compiled.status is Status.FULL else b""
