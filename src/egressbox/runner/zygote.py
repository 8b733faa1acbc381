"""A launcher forked before the run's plan exists, so that its imports overlap the planning.

`egressbox run` forks this process as soon as it knows it will run a command, before it
plans the run (the policy's run settings, the command on PATH, the roots). The zygote imports
what the launcher needs (ctypes, the confinement modules, libnftables) and walks /etc while
the parent plans on the other core;
spawn() then sends it the plan and the descriptors a launcher forked at that moment would
have inherited (the report pipe, the command's std fds), and it becomes that launcher
(confine/launcher.py launcher_main). Nothing is unshared, bound or confined before the plan
arrives, and the command starts only on the parent's word, as before.

The zygote holds no descriptor the parent opens later (the audit log, the policy file).
Without a zygote (the library, or one that died or could not take the plan) spawn() forks
the launcher as before.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import socket
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from egressbox.confine.spec import LaunchPlan

# The plan and the targets of its descriptors travel as one SOCK_SEQPACKET message, which
# must fit the socket's send buffer (about 208 KiB by default); a larger plan (a very large
# environment) is launched by a fresh fork instead.
MAX_PLAN = 128 * 1024
MAX_FDS = 8
# Targets of the descriptors sent that are not std fds to dup2() onto.
REPORT = -1  # the report pipe (close-on-exec: the command's exec closes it)
CHANNEL = -2  # the launcher's channel to `egressbox run`
EXIT_NO_PLAN = 126  # the zygote exits so when no plan comes (nothing ran)

_pending: list[Zygote] = []


class Zygote:
    """A forked process waiting for its plan on `chan`."""

    def __init__(self, pid: int, chan: socket.socket) -> None:
        self.pid = pid
        self.chan = chan

    def discard(self) -> None:
        """No plan will come: stop it and reap it."""
        self.chan.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def start() -> None:
    """Fork the zygote now (at most one waits at a time).

    Confinement's face (and through it the launcher's module, with the plan's types and
    sockets) is imported first: both sides need it (the parent plans through it, the child
    becomes the launcher through it), so it is imported once, before the fork.
    """
    if _pending:
        return
    from egressbox.confine import face

    del face
    parent_chan, child_chan = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        parent_chan.close()
        child_chan.close()
        return  # spawn() forks the launcher itself
    if pid == 0:
        parent_chan.close()
        _main(child_chan, parent)
    child_chan.close()
    _pending.append(Zygote(pid, parent_chan))


def discard() -> None:
    """The run ended before it launched (a refusal, a usage error): stop the zygote."""
    while _pending:
        _pending.pop().discard()


def launch(plan: LaunchPlan, chan: socket.socket, child_fds: dict[int, int]) -> int | None:
    """Hand the plan to the waiting zygote and return its pid, or None when there is no
    zygote or it cannot take the plan (fork the launcher then).

    `chan` is the launcher's end of its channel to us; `child_fds` maps the launcher's std fds
    to the descriptors it dup2()s onto them; the report pipe is `plan.report_fd`. They are
    sent, not inherited: we keep our copies and close them as after a fork.
    """
    if not _pending:
        return None
    zygote = _pending.pop()
    targets = [REPORT, CHANNEL, *child_fds]
    fds = [plan.report_fd, chan.fileno(), *child_fds.values()]
    data = dumps((targets, plan))
    try:
        if len(data) > MAX_PLAN:
            raise OSError("the plan is too large for one message")
        socket.send_fds(zygote.chan, [data], fds)
    except OSError:
        zygote.discard()
        return None
    zygote.chan.close()  # the plan is there; what follows goes over `chan`
    return zygote.pid


# -- in the zygote -------------------------------------------------------------------------


def _main(chan: socket.socket, parent: int) -> NoReturn:
    """Import, wait for the plan, become the launcher; never returns (not even on ^C: this is
    a forked copy of `egressbox run`, which must not go on running twice).

    A failure before the plan arrives is not ours to report: the launcher imports (and
    walks) again what is missing, and reports what fails to `egressbox run`.
    """
    try:
        with contextlib.suppress(Exception):
            _die_with(parent)
            _preload()
            _walk_etc_while_waiting(chan)
        received = _receive(chan)  # a plan that does not arrive whole raises: never launched
        if received is not None:  # None: the parent closed our channel (or died)
            plan, launcher_chan = received
            chan.close()
            from egressbox.confine import face

            face.become_launcher(plan, launcher_chan)
    finally:
        os._exit(EXIT_NO_PLAN)


def _die_with(parent: int) -> None:
    """SIGKILL this process when `egressbox run` dies (checked again: it may be gone)."""
    from egressbox.confine import face

    face.die_with_parent()
    if os.getppid() != parent:
        os._exit(EXIT_NO_PLAN)


def _preload() -> None:
    """What the launcher imports first (confine/launcher.py _preload), now, while the parent
    plans; the launcher imports whatever this misses itself."""
    from egressbox.confine import face

    face.preload_launcher()  # a failure is found again, and reported, by the launcher


def _walk_etc_while_waiting(chan: socket.socket) -> None:
    """The launcher's walk of /etc (for the entries only their owner may read), done now if
    no plan has come yet: time the parent spends planning anyway. Reading /etc changes
    nothing, and the launcher uses the result only when its plan grants /etc."""
    import select

    if select.select([chan], [], [], 0)[0]:
        return  # the plan is here: the launcher walks /etc itself when it needs to
    from egressbox.confine import face

    face.walk_etc_early()


def _receive(chan: socket.socket) -> tuple[LaunchPlan, int] | None:
    """The plan and the launcher's channel, the std fds dup2()ed and the report pipe
    close-on-exec; None when the parent closed our channel instead."""
    data, fds, flags, _ = socket.recv_fds(chan, MAX_PLAN, MAX_FDS)
    if not data:
        return None
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        raise ValueError("the plan arrived truncated")
    targets, plan = loads(data)
    if len(targets) != len(fds):
        raise ValueError("the plan's descriptors did not all arrive")
    report = launcher_chan = -1
    for target, fd in zip(targets, (_lift(fd) for fd in fds), strict=True):
        if target == REPORT:
            os.set_inheritable(fd, False)  # closed by the command's exec, as a pipe of ours is
            report = fd
        elif target == CHANNEL:
            os.set_inheritable(fd, False)  # as the socket pair a fork would have inherited
            launcher_chan = fd
        else:
            os.dup2(fd, target)
            os.close(fd)
    replaced: LaunchPlan = plan._replace(report_fd=report)
    return replaced, launcher_chan


def _lift(fd: int) -> int:
    """`fd` above 2, where no dup2() onto a std fd can overwrite it."""
    if fd > 2:
        return fd
    import fcntl

    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


# -- the plan on the wire ------------------------------------------------------------------

# marshal is built in (nothing to import on either side, unlike pickle: ~1.5 ms), and the plan
# is made of what it carries: strings, numbers, bytes, tuples, lists, dicts (and read-only
# mappings, sent as dicts) and records (NamedTuples and dataclasses), sent as
# (_RECORD, module, name, fields). Anything else (an enum member) makes the plan go
# as a pickle instead. Either way it comes from our own parent, over a socket pair made
# before the fork.
_MARSHAL, _PICKLE = b"M", b"P"
_RECORD = "\0record"  # no path, argument or environment string can hold a NUL


def dumps(value: Any) -> bytes:
    import marshal

    try:
        return _MARSHAL + marshal.dumps(_flat(value))
    except (ValueError, TypeError):
        import pickle

        return _PICKLE + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    import marshal

    if data[:1] == _MARSHAL:
        return _built(marshal.loads(data[1:]))  # noqa: S302 (our parent's, see above)
    if data[:1] == _PICKLE:
        import pickle

        return pickle.loads(data[1:])  # noqa: S301 (our parent's, see above)
    raise ValueError("the plan is in no known form")


def _flat(value: Any) -> Any:
    kind = type(value)
    names = getattr(kind, "_fields", None)
    if names is not None and isinstance(value, tuple):  # a NamedTuple: by name, as it is built
        flat = {name: _flat(item) for name, item in zip(names, value, strict=True)}
        return (_RECORD, kind.__module__, kind.__qualname__, flat)
    dataclass_fields = getattr(kind, "__dataclass_fields__", None)
    if dataclass_fields is not None:
        import dataclasses

        fields = dataclasses.fields(value)
        if len(fields) != len(dataclass_fields) or not all(f.init for f in fields):
            raise TypeError("a dataclass with fields its constructor does not take")
        flat = {f.name: _flat(getattr(value, f.name)) for f in fields}
        return (_RECORD, kind.__module__, kind.__qualname__, flat)
    if kind in (tuple, list):
        return kind(_flat(item) for item in value)
    if kind is dict or kind is MappingProxyType:
        return {key: _flat(item) for key, item in value.items()}
    return value  # marshal takes it, or says it cannot


def _built(value: Any) -> Any:
    if type(value) is tuple and value[:1] == (_RECORD,):
        _, module, name, flat = value
        if not module.startswith("egressbox."):
            raise ValueError(f"the plan names a class outside egressbox: {module}")

        kind: Any = importlib.import_module(module)
        for part in name.split("."):
            kind = getattr(kind, part)
        return kind(**{key: _built(item) for key, item in flat.items()})
    if type(value) in (tuple, list):
        return type(value)(_built(item) for item in value)
    if type(value) is dict:
        return {key: _built(item) for key, item in value.items()}
    return value
