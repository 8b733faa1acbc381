"""systemd's two protocols that `serve` speaks: socket activation and readiness notification.

Socket activation (sd_listen_fds(3)): systemd (or any parent that follows the protocol)
passes listening sockets as descriptors 3, 4, ... and says so in LISTEN_PID (our pid),
LISTEN_FDS (how many) and LISTEN_FDNAMES (their FileDescriptorName=, colon-separated).
`serve` then serves those sockets instead of binding its own: names `http`, `socks5` and
`admin` say which is which; when none of the names is one of these (systemd's default name
is the socket unit's), the descriptors are taken in that order. The variables are removed
from the environment once read, as sd_listen_fds(1) does, so that no process started later
takes the descriptors for its own.

Readiness (sd_notify(3)): with NOTIFY_SOCKET set (a `Type=notify` unit), `serve` sends
`READY=1` when it prints its ready line and `STOPPING=1` when it starts to drain, as one
datagram each on that AF_UNIX socket (a leading `@` names an abstract socket).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import MutableMapping

SD_LISTEN_FDS_START = 3
# What `serve` takes from a parent; more would be a misconfigured unit.
MAX_LISTEN_FDS = 3
KINDS = ("http", "socks5", "admin")


class ActivationError(ValueError):
    """Inherited descriptors that `serve` cannot serve (exit 3, like a port in use)."""


def listen_fds(environ: MutableMapping[str, str] | None = None) -> dict[str, socket.socket]:
    """The listening TCP sockets passed for this process, by kind ({} when none)."""
    env = os.environ if environ is None else environ
    pid_text = env.pop("LISTEN_PID", None)
    count_text = env.pop("LISTEN_FDS", None)
    names_text = env.pop("LISTEN_FDNAMES", None)
    if count_text is None or pid_text is None:
        return {}
    if not pid_text.isdigit() or int(pid_text) != os.getpid():
        return {}  # meant for another process (our parent's, say)
    if not count_text.isdigit() or not 1 <= int(count_text) <= MAX_LISTEN_FDS:
        raise ActivationError(
            f"LISTEN_FDS={count_text!r}: serve takes 1 to {MAX_LISTEN_FDS} sockets "
            f"({', '.join(KINDS)})"
        )
    count = int(count_text)
    kinds = _kinds(names_text.split(":") if names_text else [], count)
    found: dict[str, socket.socket] = {}
    try:
        for offset, kind in enumerate(kinds):
            found[kind] = _listening_socket(SD_LISTEN_FDS_START + offset, kind)
    except BaseException:
        for sock in found.values():
            sock.close()
        raise
    return found


def _kinds(names: list[str], count: int) -> list[str]:
    if names and len(names) != count:
        raise ActivationError(f"LISTEN_FDNAMES names {len(names)} sockets, LISTEN_FDS {count}")
    known = [name for name in names if name in KINDS]
    if not known:
        return list(KINDS[:count])  # unnamed (or named after the unit): in order
    if len(known) != count or len(set(known)) != count:
        raise ActivationError(
            f"LISTEN_FDNAMES={':'.join(names)!r}: name each socket once, with "
            f"FileDescriptorName= {' / '.join(KINDS)}"
        )
    return known


def _listening_socket(fd: int, kind: str) -> socket.socket:
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ActivationError(f"descriptor {fd} ({kind}) is not a socket: {exc}") from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise ActivationError(
            f"descriptor {fd} ({kind}) is not a TCP socket: use ListenStream=ADDR:PORT"
        )
    if not listening:
        sock.detach()
        raise ActivationError(f"descriptor {fd} ({kind}) is not listening")
    # Inherited descriptors are not close-on-exec: a program serve starts must not get them.
    os.set_inheritable(fd, False)
    sock.setblocking(False)
    return sock


class Notifier:
    """Sends sd_notify messages to NOTIFY_SOCKET, if the supervisor gave one."""

    def __init__(self, address: str | None) -> None:
        self.address: str | bytes | None = None
        if address and address[0] in "/@":
            # An abstract socket's name starts with a NUL byte instead of the '@'.
            self.address = b"\0" + address[1:].encode() if address[0] == "@" else address

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """The notifier of NOTIFY_SOCKET, removed from the environment (only this process,
        the unit's main one, may notify; nothing it starts should try)."""
        env = os.environ if environ is None else environ
        return cls(env.pop("NOTIFY_SOCKET", None))

    def notify(self, *assignments: str) -> bool:
        """Send `READY=1`, `STOPPING=1`, `STATUS=...` (one datagram); False if not sent."""
        if self.address is None:
            return False
        data = "\n".join(assignments).encode()
        with (
            contextlib.suppress(OSError),
            socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock,
        ):
            # Never wait on a full queue: a notification is not worth a stalled loop.
            sock.sendto(data, socket.MSG_DONTWAIT, self.address)
            return True
        return False
