"""Confinement's one face: plan(request, facts) -> Plan, pure, and launch(plan) -> Launched.

`plan` decides the child's world and what the launcher applies from a Request that holds
what was read of the host already (the live unix sockets to cover, the memory budget and its
cgroup, the ids, the directory): it reads and changes nothing. `launch` forks the launcher
(confine/launcher.py) with the plan and returns its pid, the channel to it and the pipe its
report of what it applied arrives on. The set-up with I/O that a plan needs before the fork
(the proxy's listeners on the host's loopback when there is no network namespace) is here
too, named as such (bind_host_listeners, bind_host_capture), not in the plan.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from egressbox.confine import netns
from egressbox.confine.grants import (
    CAPTURE_FILES,
    FsPlan,
    HostFacts,
    Mechanism,
    Profile,
    WorldSpec,
    host_has,
    is_under,
    socket_bind_roots,
)
from egressbox.confine.launcher import LaunchPlan
from egressbox.core.errors import EgressboxError

if TYPE_CHECKING:
    from egressbox.confine.cgroup import CgroupPlan
    from egressbox.confine.env import Scratch

Plan = LaunchPlan


class Request(NamedTuple):
    """What a confined command is to get, with what was read of the host for it."""

    argv: tuple[str, ...]
    executable: str  # the command resolved on the child's PATH
    cwd: str  # real path
    env: dict[str, str]
    env_ports: Mapping[str, str]  # NAME -> template with {http}/{socks}
    mechanisms: frozenset[Mechanism]  # chosen for the profile on this host
    profile: Profile
    fs: FsPlan
    workspaces: tuple[str, ...]  # the writable workspace roots
    process_write: tuple[str, ...]  # the tools' writable roots
    socket_roots: tuple[str, ...]
    read_only_scratch: str  # a read-only workspace's scratch ("": a writable workspace)
    scratch: Scratch | None
    # The host's live unix sockets under a grant and not under a socket root (what the world
    # covers): read by the caller, from the grants granted_paths() gives.
    hidden_sockets: tuple[str, ...]
    allow_loopback: bool
    pass_fds: tuple[int, ...]
    rlimit_nofile: int | None
    rlimit_as: int | None
    max_processes: int | None
    memory: int | None  # the run's memory budget in bytes (None: unknown)
    tmp_size: int  # the private /tmp's and /dev/shm's sizes within it
    shm_size: int
    cgroup: CgroupPlan | None
    cgroup_off: str
    host_ports: tuple[int, ...]  # without a namespace: the proxy's listeners on the host
    uid: int
    gid: int
    parent_pid: int
    capture: bool
    copies: tuple[tuple[str, str], ...] = ()  # files the view holds: (path, contents)


def granted_paths(
    fs: FsPlan, workspaces: Sequence[str], process_write: Sequence[str], socket_roots: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The roots bound read-only and read-write. A read grant inside a writable root adds
    nothing (a venv in the workspace stays writable); read-only roots nested in writable ones
    are fs.read_only_inside_write."""
    writable = (*workspaces, *process_write)
    readable = tuple(
        p for p in (*fs.read, *socket_roots) if not any(is_under(p, w) for w in writable)
    )
    return readable, writable


def plan(request: Request, facts: HostFacts) -> Plan:
    """What the launcher applies: the child's world and its walls (pure). A mechanism the
    host lacks (facts) is never planned."""
    r = request
    chosen = frozenset(m for m in r.mechanisms if host_has(facts, m))
    mounts = Mechanism.MOUNT_NAMESPACE in chosen
    readable, writable = granted_paths(r.fs, r.workspaces, r.process_write, r.socket_roots)
    # Only socket roots admit a socket: a bind there (read-write bind, Landlock admitting the
    # making of a socket and no other write) and a connect; a live socket under any other
    # grant is covered (grants.py sockets_to_hide). Without Landlock's filesystem rules a
    # read-write bind would make the socket root writable: it stays read-only (connect only).
    landlock = Mechanism.LANDLOCK_FS in chosen
    socket_bind = socket_bind_roots(r.socket_roots, r.fs.write, writable) if landlock else ()
    world = WorldSpec(
        grants=(*((p, False) for p in readable), *((p, True) for p in writable)),
        read_only=r.fs.read_only_inside_write,
        mask=(*r.fs.deny, *(r.hidden_sockets if mounts else ())),
        socket_roots=r.socket_roots,
        socket_bind=socket_bind if mounts else (),
        scratch=(r.scratch.tmp, r.scratch.cache) if r.scratch is not None and mounts else (),
        cwd=r.cwd,
        protect_kernel=r.uid == 0,
        max_processes=r.max_processes,
        tmp_size=str(r.tmp_size),
        shm_size=str(r.shm_size),
        # Captured: the child's resolver asks egressbox's DNS inside the namespace.
        # and the tools' configuration files as clean copies (confine/clean.py).
        files=(*(CAPTURE_FILES if r.capture else ()), *r.copies),
    )
    # The read-only workspace's scratch is in the view's private /tmp: Landlock must let the
    # command write there whatever the presets say (it is never bound from the host).
    scratch = (r.read_only_scratch,) if r.read_only_scratch and mounts else ()
    return LaunchPlan(
        argv=r.argv,
        executable=r.executable,
        cwd=world.cwd,
        env=r.env,
        mechanisms=tuple(sorted(m.value for m in chosen)),
        uid=r.uid,
        gid=r.gid,
        host_ports=r.host_ports,
        read=(*r.fs.read, *r.socket_roots),
        write=(*r.fs.write, *scratch),
        deny=r.fs.deny,
        read_only_inside_write=r.fs.read_only_inside_write,
        sockets=socket_bind,
        allow_loopback=r.allow_loopback,
        pass_fds=r.pass_fds,
        rlimit_nofile=r.rlimit_nofile,
        rlimit_as=r.rlimit_as,
        rlimit_nproc=r.max_processes,
        rlimit_data=r.memory,
        cgroup=r.cgroup,
        cgroup_off=r.cgroup_off,
        best_effort=r.profile is not Profile.OS_HARDENED,
        env_ports=r.env_ports,
        parent_pid=r.parent_pid,
        world=world if mounts else None,
        capture=r.capture,
    )


class Launched(NamedTuple):
    """A launcher forked with its plan (runner/spawn.py's Launched is built from it)."""

    pid: int
    chan: socket.socket  # to the launcher: its listeners and its word come over it
    report_fd: int  # what it applied arrives here just before the command's exec


# A launcher forked ahead of time (runner/zygote.py): given the plan, the launcher's end of
# the channel and the descriptors to dup2, its pid; None when there is none (fork then).
Forker = Callable[[Plan, socket.socket, dict[int, int]], "int | None"]


def launch(
    plan: Plan,
    *,
    child_fds: Mapping[int, int] | None = None,
    in_child: Callable[[], None] | None = None,
    forker: Forker | None = None,
) -> Launched:
    """Fork the launcher with `plan`: `child_fds` are dup2()ed onto its std fds (target:
    source), then `in_child` runs in it. On failure nothing of the launch stays open."""
    fds = dict(child_fds or {})
    parent_chan, child_chan = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # What the launcher applied arrives on this pipe just before exec, which closes it.
    report_r, report_w = os.pipe()
    plan = plan._replace(report_fd=report_w)
    try:
        pid = (forker(plan, child_chan, fds) if forker is not None else None) or os.fork()
    except BaseException:
        for end in (parent_chan, child_chan):
            end.close()
        os.close(report_r)
        os.close(report_w)
        raise
    if pid == 0:  # the launcher
        _launcher(plan, parent_chan, child_chan, report_r, fds, in_child)
    child_chan.close()
    os.close(report_w)
    return Launched(pid, parent_chan, report_r)


def _launcher(  # noqa: PLR0917 (the launch's own ends, in the child)
    plan: Plan,
    parent_chan: socket.socket,
    child_chan: socket.socket,
    report_r: int,
    fds: Mapping[int, int],
    in_child: Callable[[], None] | None,
) -> NoReturn:
    from egressbox.confine.launcher import launcher_main

    parent_chan.close()
    os.close(report_r)
    for target, source in fds.items():
        os.dup2(source, target)
    if in_child is not None:
        in_child()
    launcher_main(plan, child_chan.detach())


# -- set-up with I/O before the fork --------------------------------------------------------


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
