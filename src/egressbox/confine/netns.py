"""The child's network namespace: only `lo`, and the proxy's listeners bound inside it.

The launcher unshares the namespace, brings `lo` up with one ioctl (exec'ing
`ip` would fail without a uid map), binds and listens on 127.0.0.1 inside it,
and sends the listening sockets to the unconfined parent over an AF_UNIX
socketpair. The parent serves them with asyncio and verifies (SIOCGSKNS)
that they really live in another namespace. No bridge process, no extra copy.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
from collections.abc import Sequence

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCGSKNS = 0x894C  # socket -> fd of its network namespace (Linux >= 4.9)
IFF_UP = 0x1
_IFREQ = "16sH22x"
# Backlog of the listeners inside the namespace: the child may start many
# connections before the parent's event loop serves them.
LISTEN_BACKLOG = 1024
# Largest control message we exchange (a JSON object and a few fds).
MAX_MESSAGE = 64 * 1024
MAX_FDS = 8


def loopback_up() -> None:
    """Bring `lo` up in the current (new) network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))


def write_id_maps(uid: int, gid: int) -> None:
    """Map our own uid/gid 1:1 in a new user namespace (never to 0).

    A process that changed its uid without exec (a probe child of root's) is not dumpable, so
    its /proc/self files are root's and it could not write them: made dumpable first (the
    exec that follows sets the flag again from the program's own rules)."""
    from egressbox.confine import syscalls

    syscalls.prctl(syscalls.PR_SET_DUMPABLE, 1)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def bind_listener(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def send_message(chan: socket.socket, message: dict[str, object], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(chan, [data], list(fds))
    else:
        chan.sendall(data)


def recv_message(chan: socket.socket) -> tuple[dict[str, object], list[int]]:
    """One message (SOCK_SEQPACKET keeps boundaries); ({}, []) at end of stream."""
    data, fds, _flags, _addr = socket.recv_fds(chan, MAX_MESSAGE, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        return {}, []
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("launcher sent a malformed message")
    return message, list(fds)


def namespace_inode(sock: socket.socket) -> int:
    """The inode of the network namespace a socket lives in."""
    ns_fd = fcntl.ioctl(sock.fileno(), SIOCGSKNS)
    try:
        return os.fstat(ns_fd).st_ino
    finally:
        os.close(ns_fd)


def own_namespace_inode() -> int:
    return os.stat("/proc/self/ns/net").st_ino
