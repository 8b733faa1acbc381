"""The parent's side of launching: `launch` forks the launcher (confine/launcher.py) with its
plan and keeps the ends it talks over; what a launcher forked ahead of time
(runner/zygote.py) does before its plan arrives; and the connect supervisor's kernel side
(confine/notify.py), whose policy is the runner's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from egressbox.confine import launcher, netns
from egressbox.confine.launcher import launcher_main
from egressbox.confine.spec import LaunchPlan

if TYPE_CHECKING:
    # Types only: the supervisor's module loads when a run's connects are supervised.
    from egressbox.confine.notify import Notifications


class Launched(NamedTuple):
    """A launcher forked with its plan (runner/spawn.py's Launched is built from it)."""

    pid: int
    chan: socket.socket  # to the launcher: its listeners and its word come over it
    report_fd: int  # what it applied arrives here just before the command's exec


# A launcher forked ahead of time (runner/zygote.py): given the plan, the launcher's end of
# the channel and the descriptors to dup2, its pid; None when there is none (fork then).
Forker = Callable[[LaunchPlan, socket.socket, dict[int, int]], "int | None"]


def launch(
    plan: LaunchPlan,
    *,
    child_fds: Mapping[int, int] | None = None,
    in_child: Callable[[], None] | None = None,
    forker: Forker | None = None,
) -> Launched:
    """Fork the launcher with `plan` (a Confinement's launcher plan, as `set_up` completed it):
    `child_fds` are dup2()ed onto its std fds (target: source), then `in_child` runs in it.
    On failure nothing of the launch stays open."""
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


def launcher_word(chan: socket.socket) -> tuple[dict[str, object], list[int]]:
    """The launcher's next message on `chan` (Launched.chan) and the descriptors it sent with
    it (its listeners); ({}, []) when it closed its end."""
    return netns.recv_message(chan)


def on_host_network(sockets: Sequence[socket.socket]) -> bool:
    """Whether any of these sockets lives in this process's network namespace (the launcher's
    listeners must not: the command's namespace is private)."""
    own = netns.own_namespace_inode()
    return any(netns.namespace_inode(s) == own for s in sockets)


def _launcher(  # noqa: PLR0917 (the launch's own ends, in the child)
    plan: LaunchPlan,
    parent_chan: socket.socket,
    child_chan: socket.socket,
    report_r: int,
    fds: Mapping[int, int],
    in_child: Callable[[], None] | None,
) -> NoReturn:
    parent_chan.close()
    os.close(report_r)
    for target, source in fds.items():
        os.dup2(source, target)
    if in_child is not None:
        in_child()
    launcher_main(plan, child_chan.detach())


def supervisor(fd: int) -> Notifications:
    """The kernel's side of a connect supervisor's notification descriptor `fd` (the one the
    launcher sends before exec): receiving, checking, answering the held connects and reaching
    into the task that made them. The policy of what to connect where is the caller's."""
    from egressbox.confine import notify

    return notify.Notifications(fd)


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (a launcher forked ahead of time)."""
    from egressbox.confine import syscalls

    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)


def preload_launcher() -> None:
    """What the launcher imports first (confine/launcher.py _preload), now; a library that
    fails to load is found again, and reported, by the launcher."""
    import resource

    from egressbox.confine import caps, capture, landlock, landlock_apply, launcher, world

    del resource, caps, landlock, landlock_apply, launcher, world
    with contextlib.suppress(capture.CaptureError):
        capture.load_library()


def walk_etc_early() -> None:
    """The launcher's walk of /etc (the entries only their owner may read), done ahead."""
    launcher.walk_etc_early()


def become_launcher(plan: LaunchPlan, chan_fd: int) -> NoReturn:
    """This process becomes the launcher of `plan` (its channel to the parent: `chan_fd`)."""
    launcher_main(plan, chan_fd)
