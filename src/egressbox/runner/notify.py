"""The connect supervisor: the network boundary by address when the command has no network
namespace (confine/notify.py holds the filter that sends its connects here).

For each held `connect(fd, address, length)`: the address is read ONCE from the command's memory,
the notification is checked still valid (so the pid read is still that task), the socket is
taken with pidfd_getfd and OUR copy is connected, then the command is answered with the result.
The command's connect never runs in the kernel: whatever it writes into its memory afterwards,
the socket is connected where we decided.
- the proxy's own address and port (or the same port on ::1 / ::ffff:127.0.0.1): to the proxy,
  so HTTP_PROXY works;
- any other TCP destination: to the capture listener, the destination recorded in a side table
  (net/original.py Destinations) by the socket's local address, bound first so the entry exists
  before the proxy accepts; the proxy decides it as `tcp` with that destination;
- unix sockets: connected by us to the same path (a relative one from the command's directory),
  with the command's rights under `--user NAME` (this thread's fsuid, fsgid and groups are
  NAME's for the walk and the connect: root's would reach sockets NAME may not); in the host's
  view (no mount namespace) only a socket under a write root or a socket root, and not a host
  socket that was live under a write root at the start (EACCES otherwise: Landlock does not
  cover connect(2) to a pathname socket, so this is where the grants hold); abstract names
  only when the command has no Landlock scope (we would step over it);
- anything else: EAFNOSUPPORT (other families) or EPERM (non-stream inet sockets).

A dedicated thread, not the event loop: notifications come before the loop runs (the command
connects while `run` waits without asyncio for its first connection), and a blocking connect
made here must never stall the loop that has to accept it. Signals are blocked in the thread, so
a connect here is never cut short by one meant for `run`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Final

from egressbox.confine import face
from egressbox.net.original import Destinations

# Longest address a connect may give: sizeof(struct sockaddr_storage) (<sys/socket.h>).
MAX_SOCKADDR: Final = 128
_IN: Final = struct.Struct("!2xH4s8x")  # sockaddr_in after the native-order family
_IN6: Final = struct.Struct("!2xHI16sI")  # sockaddr_in6
_FAMILY: Final = struct.Struct("=H")
_U32: Final = 0xFFFFFFFF
LOOPBACK: Final = "127.0.0.1"
MAPPED_LOOPBACK: Final = "::ffff:127.0.0.1"

# A unix socket outside the grants: what a tool reports as "Permission denied" (Docker's CLI:
# "permission denied while trying to connect to the Docker daemon socket"), true of a grant,
# where ECONNREFUSED would say the daemon is down.
REFUSED: Final = errno.EACCES

_libc = ctypes.CDLL(None, use_errno=True)
# A connect asked again while the first is under way keeps its side-table entry.
_STILL_CONNECTING: Final = frozenset({0, errno.EINPROGRESS, errno.EALREADY, errno.EISCONN})


class ConnectSupervisor:
    """Serves one run's connect notifications on a thread of its own until close()."""

    def __init__(
        self,
        listener: int,
        *,
        proxy_ports: Sequence[int],
        capture_port: int | None,
        destinations: Destinations,
        abstract_allowed: bool,
        as_user: tuple[int, int, tuple[int, ...]] | None = None,
        unix_roots: Sequence[str] | None = None,
        unix_hidden: Sequence[str] = (),
    ) -> None:
        # The notification descriptor's kernel calls (confine/notify.py, through the face).
        self._kernel = face.supervisor(listener)
        self._as_user = as_user
        self._grants = None if unix_roots is None else UnixGrants(unix_roots, unix_hidden)
        self.unix_refused = 0  # unix connects refused outside the grants
        # The first one's path as the command gave it (printable): what the run's end names.
        self.unix_refused_first = ""
        self._proxy_ports = frozenset(proxy_ports)
        self._capture_port = capture_port
        self.destinations = destinations
        self._abstract = abstract_allowed
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="egressbox-connects", daemon=True)
        self.handled = 0
        self.cpu_s = 0.0  # thread CPU time spent on notifications (measured, --report)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the notification fd (idempotent). A command still
        running then gets ENOSYS from its connects: nothing connects without us."""
        if self._stop_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._stop_w, b"x")
            if self._thread.is_alive():
                self._thread.join(timeout)
            for fd in (self._stop_w, self._stop_r):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._kernel.close()
            self._stop_w = self._stop_r = -1

    # -- the thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        poller = select.poll()
        poller.register(self._kernel.fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while True:
            try:
                events = dict(poller.poll())
            except InterruptedError:
                continue
            if self._stop_r in events:
                return
            mask = events.get(self._kernel.fd, 0)
            if mask & select.POLLIN:
                started = time.thread_time()
                self._one()
                self.cpu_s += time.thread_time() - started
            elif mask & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                return  # every filtered task has exited

    def _one(self) -> None:
        held = self._kernel.receive()
        if held is None:
            return  # the task died (or its syscall was interrupted) meanwhile
        err = self._connect(held.id, held.pid, held.args)
        if err is None:
            if not self._kernel.still_valid(held.id):
                return  # the notification is gone: nobody to answer
            err = errno.EPERM  # never leave a live connect held: it would hang for good
        self.handled += 1
        self._kernel.answer(held.id, err)

    def _connect(self, ident: int, pid: int, args: Sequence[int]) -> int | None:
        """The connect's errno (0: connected), or None when the notification went away."""
        target_fd, address, length = args[0] & _U32, args[1], args[2] & _U32
        if not _FAMILY.size <= length <= MAX_SOCKADDR:
            return errno.EINVAL
        try:
            raw = self._kernel.read_address(pid, address, length)  # the one read of the address
        except OSError as exc:
            return errno.EFAULT if exc.errno in {errno.EFAULT, errno.EIO} else None
        if len(raw) != length:
            return errno.EFAULT
        taken = self._kernel.take_socket(ident, pid, target_fd)
        if taken is None or taken < 0:
            return None if taken is None else -taken
        try:
            return self._decide(taken, raw, pid)
        finally:
            os.close(taken)

    def _decide(self, sock_fd: int, raw: bytes, pid: int) -> int:
        try:
            probe = socket.socket(fileno=os.dup(sock_fd))
        except OSError as exc:
            return exc.errno or errno.ENOTSOCK
        with probe:
            family, kind = probe.family, probe.type
            local = probe.getsockname() if family in {socket.AF_INET, socket.AF_INET6} else None
        if family == socket.AF_UNIX:
            return self._unix(sock_fd, raw, pid)
        if family not in {socket.AF_INET, socket.AF_INET6}:
            return errno.EAFNOSUPPORT
        if _FAMILY.unpack_from(raw)[0] == socket.AF_UNSPEC:
            return _libc_connect(sock_fd, raw)  # dissolves an association: goes nowhere
        if kind != socket.SOCK_STREAM:
            return errno.EPERM
        return self._inet(sock_fd, raw, family, local)

    def _inet(self, sock_fd: int, raw: bytes, family: int, local: object) -> int:
        try:
            host, port = _inet_address(raw, family)
        except ValueError:
            return errno.EINVAL
        except LookupError:
            return errno.EAFNOSUPPORT
        if port in self._proxy_ports and _is_proxy_host(host):
            return _libc_connect(sock_fd, _sockaddr(family, LOOPBACK, port))
        if self._capture_port is None:
            return errno.ECONNREFUSED
        return self._capture(sock_fd, family, local, (host, port))

    def _capture(
        self, sock_fd: int, family: int, local: object, destination: tuple[str, int]
    ) -> int:
        assert self._capture_port is not None
        peer = _bound(sock_fd, family, local)
        if peer is None:
            return errno.ENETUNREACH  # an IPv6-only socket cannot reach the IPv4 listener
        self.destinations.put(peer, destination)
        err = _libc_connect(sock_fd, _sockaddr(family, LOOPBACK, self._capture_port))
        if err not in _STILL_CONNECTING:
            self.destinations.take(peer)
        return err

    def _unix(self, sock_fd: int, raw: bytes, pid: int) -> int:
        family = _FAMILY.unpack_from(raw)[0]
        if family != socket.AF_UNIX:
            return _libc_connect(sock_fd, raw)  # the kernel's own answer (EINVAL)
        path = raw[2:]
        if path[:1] == b"\0":
            if not self._abstract:
                return errno.EPERM  # what the command's Landlock scope answers
            return _libc_connect(sock_fd, raw)
        return self._unix_path(sock_fd, path.split(b"\0", 1)[0], pid)

    def _unix_path(self, sock_fd: int, path: bytes, pid: int) -> int:
        if not path:
            return errno.EINVAL
        try:
            # The command's root and directory are opened with our rights (a /proc link of
            # another task's); the walk below them and the connect with the command's own.
            same = _same_root(pid)
            base = _view_base(pid, path)
        except OSError as exc:
            return exc.errno or errno.ENOENT
        # In a view of its own (a constructed root) only granted sockets exist; in ours, the
        # grants are checked here. An absolute path starts at the command's root and climbs
        # no higher.
        grants = self._grants if same else None
        relative = same and not path.startswith(b"/")
        try:
            with _thread_credentials(self._as_user):
                return _connect_in_view(
                    self._kernel, sock_fd, base, path, same_root=relative, grants=grants
                )
        except OutsideGrantsError:
            # Counted apart from the kernel's own EACCES (a socket NAME may not write).
            self.unix_refused += 1
            self.unix_refused_first = self.unix_refused_first or printable_path(path)
            return REFUSED
        except OSError as exc:
            return exc.errno or errno.EACCES
        finally:
            os.close(base)


class OutsideGrantsError(PermissionError):
    """The socket a unix connect names lies outside the grants (answered with REFUSED)."""


def printable_path(path: bytes) -> str:
    """`path` for a line on the terminal: UTF-8 where it is, every other byte and every
    control character escaped (\\xNN), so a name cannot move the cursor or forge a line. Its
    length is bounded by the address it came from (MAX_SOCKADDR bytes, 4 characters each at
    most)."""
    text = path.decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class UnixGrants:
    """Where the host's view admits a unix socket connect: the socket lies under one of
    `roots` (real paths) and is none of `hidden` (the host's sockets live under a write root
    at the start, compared by device and inode: a hard link elsewhere is the same socket)."""

    def __init__(self, roots: Sequence[str], hidden: Sequence[str]) -> None:
        self.roots = tuple(os.path.realpath(r) for r in roots)
        self.hidden = frozenset(_identities(hidden))

    def admits(self, node: int) -> bool:
        """Whether the O_PATH descriptor `node` (the socket the walk found) is granted: by its
        path as the kernel reports it, of the one object the connect will reach."""
        try:
            where = os.readlink(f"/proc/self/fd/{node}")
            found = os.fstat(node)
        except OSError:
            return False
        if not where.startswith("/") or (found.st_dev, found.st_ino) in self.hidden:
            return False
        return any(where == r or where.startswith(r.rstrip("/") + "/") for r in self.roots)


def _identities(paths: Sequence[str]) -> Iterator[tuple[int, int]]:
    for path in paths:
        try:
            found = os.lstat(path)
        except OSError:
            continue  # gone since it was listed: nothing to refuse
        yield found.st_dev, found.st_ino


def _connect_in_view(
    kernel: face.Notifications,
    sock_fd: int,
    base: int,
    path: bytes,
    *,
    same_root: bool,
    grants: UnixGrants | None,
) -> int:
    try:
        node = _socket_node(kernel, base, path, same_root=same_root)
    except OSError as exc:
        return exc.errno or errno.ENOENT
    try:
        if grants is not None and not grants.admits(node):
            raise OutsideGrantsError(REFUSED, "outside the unix socket grants")
        address = f"/proc/self/fd/{node}".encode()
        return _libc_connect(sock_fd, _FAMILY.pack(socket.AF_UNIX) + address + b"\0")
    finally:
        os.close(node)


# Per-thread credential calls (<asm/unistd.h>). glibc's setgroups changes every thread of the
# process (it signals them all); the raw call, like setfsuid and setfsgid, changes only the
# calling thread, the supervisor's own, while the proxy's threads keep root's rights.
_CRED_CALLS: Final = {
    "x86_64": {"setgroups": 116, "setfsuid": 122, "setfsgid": 123},
    "aarch64": {"setgroups": 159, "setfsuid": 151, "setfsgid": 152},
}
_NO_ID: Final = 0xFFFFFFFF  # (uid_t)-1: setfsuid/setfsgid change nothing, answer the current


@contextlib.contextmanager
def _thread_credentials(ids: tuple[int, int, tuple[int, ...]] | None) -> Iterator[None]:
    """--user NAME: this thread's filesystem uid and gid and its groups are NAME's for the
    block (the path walk and connect(2)'s write permission on the socket are checked against
    them; a change of fsuid from 0 also drops the file capabilities, CAP_DAC_OVERRIDE among
    them), then root's again. Raises OSError (EPERM) when they cannot be set: the connect is
    then refused, never made as root."""
    if ids is None:
        yield
        return
    uid, gid, groups = ids
    calls = _CRED_CALLS.get(os.uname().machine)
    if calls is None:
        raise OSError(errno.EPERM, "no per-thread credential calls for this architecture")
    saved = os.getgroups()  # the process's, which this thread had until now
    try:
        _set_groups(calls["setgroups"], groups)
        _libc.syscall(calls["setfsgid"], ctypes.c_uint(gid))
        _libc.syscall(calls["setfsuid"], ctypes.c_uint(uid))
        now = (
            _libc.syscall(calls["setfsuid"], ctypes.c_uint(_NO_ID)),
            _libc.syscall(calls["setfsgid"], ctypes.c_uint(_NO_ID)),
        )
        if now != (uid, gid):
            raise OSError(errno.EPERM, f"could not take uid {uid}'s rights")
        yield
    finally:
        _libc.syscall(calls["setfsuid"], ctypes.c_uint(os.geteuid()))
        _libc.syscall(calls["setfsgid"], ctypes.c_uint(os.getegid()))
        _set_groups(calls["setgroups"], tuple(saved))


def _set_groups(number: int, groups: Sequence[int]) -> None:
    array = (ctypes.c_uint * max(len(groups), 1))(*groups)
    if _libc.syscall(number, ctypes.c_long(len(groups)), array) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setgroups: {os.strerror(err)}")


def _view_base(pid: int, path: bytes) -> int:
    """An O_PATH descriptor of the command's root (absolute `path`) or working directory."""
    where = "root" if path.startswith(b"/") else "cwd"
    return os.open(f"/proc/{pid}/{where}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def _socket_node(kernel: face.Notifications, base: int, path: bytes, *, same_root: bool) -> int:
    """An O_PATH descriptor of the unix socket file `path` names for the command, found from
    `base` (_view_base; `same_root`: the command's root is ours) in the command's own view:
    its root (a constructed one has no host sockets) or its working directory, symlinks
    resolved inside that root, never through a /proc magic link (ours would be the
    supervisor's). Connecting to /proc/self/fd/N then reaches exactly that node, whatever the
    path's length. Raises OSError (ENOENT, ELOOP, EXDEV...)."""
    # With our root the command's `..` may climb above its working directory as the kernel
    # would let it; a relative path in a view of its own cannot (its place in that view is
    # unknown to us), so the directory is taken as the root.
    return kernel.open_beneath(base, path, in_root=not same_root)


def _same_root(pid: int) -> bool:
    mine, theirs = os.stat("/"), os.stat(f"/proc/{pid}/root")
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _libc_connect(fd: int, address: bytes) -> int:
    """connect(2) on our copy of the socket: its errno (0 when connected). A non-blocking
    socket (the flag is the command's, shared by both copies) answers EINPROGRESS, and the
    command finishes the connect as usual (poll, SO_ERROR) on the socket it holds."""
    buffer = ctypes.create_string_buffer(address, len(address))
    if _libc.connect(ctypes.c_int(fd), buffer, ctypes.c_uint(len(address))) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def _inet_address(raw: bytes, family: int) -> tuple[str, int]:
    """(host, port) of an inet sockaddr for a socket of `family`; LookupError when the two
    families differ (the kernel's EAFNOSUPPORT), ValueError when it is too short."""
    given = _FAMILY.unpack_from(raw)[0]
    if given != family:
        # An IPv6 socket takes an AF_INET address only as a v4-mapped one.
        raise LookupError(given)
    if family == socket.AF_INET:
        if len(raw) < _IN.size:
            raise ValueError("short sockaddr_in")
        port, packed = _IN.unpack_from(raw)
        return socket.inet_ntop(socket.AF_INET, packed), port
    if len(raw) < _IN6.size - 4:  # sin6_scope_id is optional (SIN6_LEN_RFC2133)
        raise ValueError("short sockaddr_in6")
    port, _flow, packed, _scope = _IN6.unpack_from(raw.ljust(_IN6.size, b"\0"))
    address = ipaddress.IPv6Address(packed)
    mapped = address.ipv4_mapped
    return (str(mapped) if mapped is not None else str(address)), port


def _is_proxy_host(host: str) -> bool:
    return host in {LOOPBACK, "::1"}


def _sockaddr(family: int, host: str, port: int) -> bytes:
    if family == socket.AF_INET:
        return _FAMILY.pack(family) + _IN.pack(port, socket.inet_aton(host))[2:]
    packed = socket.inet_pton(socket.AF_INET6, MAPPED_LOOPBACK if host == LOOPBACK else host)
    return _FAMILY.pack(family) + _IN6.pack(port, 0, packed, 0)[2:]


def _bound(sock_fd: int, family: int, local: object) -> tuple[str, int] | None:
    """The address the capture listener will see this socket come from: bound now (loopback,
    an ephemeral port) unless the command bound it, so the side table is filled before the
    proxy can accept. None: it cannot be bound there."""
    port = local[1] if isinstance(local, tuple) else 0
    if port:
        host = str(local[0]) if isinstance(local, tuple) else LOOPBACK
        return (_unmapped(host) if host not in {"0.0.0.0", "::"} else LOOPBACK), int(port)
    with socket.socket(fileno=os.dup(sock_fd)) as sock:
        try:
            sock.bind((LOOPBACK if family == socket.AF_INET else MAPPED_LOOPBACK, 0))
        except OSError:
            return None
        return _unmapped(str(sock.getsockname()[0])), int(sock.getsockname()[1])


def _unmapped(host: str) -> str:
    return host.removeprefix("::ffff:")


def receive_listener(chan: socket.socket, timeout: float) -> int:
    """The notification fd the command sends before exec ({"event": "notify"}); raises
    OSError when it does not come (the command must then not start)."""
    chan.settimeout(timeout)
    try:
        message, fds = face.launcher_word(chan)
    finally:
        chan.settimeout(None)
    if message.get("event") != "notify" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        why = message.get("message") or "the command sent no connect supervisor descriptor"
        raise OSError(errno.EPROTO, str(why))
    return fds[0]
