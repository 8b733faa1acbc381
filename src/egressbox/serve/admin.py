"""serve's admin listener (`serve --admin ADDR:PORT`): /metrics, /healthz and /readyz.

A listener apart from the proxy's ports, never one of them: it answers three GET paths, one
request per connection, and nothing else. It never dials, forwards or tunnels anything, so it
cannot become a proxy; an absolute-form target, CONNECT, a body or any other path is refused.
Every exchange is bounded: the request head (ADMIN_HEAD_BYTES), the time to its first byte
(ADMIN_FIRST_BYTE_TIMEOUT) and to its end (ADMIN_HEAD_TIMEOUT), the time the answer may take
to be read (ADMIN_ANSWER_TIMEOUT), and the connections open at once (ADMIN_MAX_CONNECTIONS,
so a flood of admin clients cannot take the proxy's descriptors).

Health never starves behind slow clients: a connection that comes while the listener is full
evicts an older one instead of being turned away, the oldest of the least worth keeping: one
that has sent nothing, else one dripping its head, else one whose answer is still unread (a
slow reader of /metrics), and only then one whose request waits unread in the kernel (a probe
accepted in the same burst). A probe or a scrape writes its request at once and is answered
as soon as it is read, so silent, dripping and unread connections, sixteen or a thousand, cost
a balancer's probe nothing. (A client that opens connections that send at once, faster than
the listener reads them, can still evict a probe: that is a flood of the port, which the
network in front of it has to stop.)

The proxy's HTTP grammar (protocols.http1) refuses origin-form by design (a proxy is sent
absolute URLs), so this listener reads its request line and fields itself: a strict,
single-purpose reading, because nothing it reads is passed on.

- `/healthz`: 200 while the process serves (its event loop answers).
- `/readyz`: 200 while it accepts and its audit log can be written; 503 with the reason while
  draining after SIGTERM/SIGINT, while refusing for an unwritable audit log, or (with
  `--workers`) while any worker is not ready.
- `/metrics`: the Prometheus text format (OpenMetrics when asked), see metrics.py. With a
  bearer token configured (`--admin-token-file FILE` or $EGRESSBOX_ADMIN_TOKEN, never a
  command-line value that `ps` would show) it wants `Authorization: Bearer TOKEN`; the health
  paths stay open, since probes (kubelet, a load balancer) carry no secret and learn nothing
  but up or ready from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import ipaddress
import re
import socket
import struct
import termios
from collections.abc import MutableMapping
from typing import Final, Protocol, cast

from egressbox.core.hosts import format_authority

# A scraper's or a probe's GET is a few hundred bytes; 8 KiB leaves room for a long token.
ADMIN_HEAD_BYTES = 8192
# From accept to the first byte of the request. A probe (the kubelet, HAProxy's httpchk) or
# Prometheus writes its GET as soon as the handshake ends, so the byte arrives within a round
# trip; half a second still covers one retransmission of a lost first segment on a LAN (Linux's
# minimum RTO is 200 ms), and a silent connection holds its slot ten times shorter than the
# 5 s it used to.
ADMIN_FIRST_BYTE_TIMEOUT = 0.5
# From accept to the end of the request head: a probe's or a scrape's head is one segment of a
# few hundred bytes, so 2 s is several retransmissions; a client that drips its head byte by
# byte is cut here (and is evicted first before that when the listener is full).
ADMIN_HEAD_TIMEOUT = 2.0
# From the whole request head to the last byte of the answer taken by the client. The kernel's
# buffers take a whole scrape (tens of KiB) at once from a client that reads at all; only a
# client that stops reading waits here, holding the answer in memory, so it is cut short.
ADMIN_ANSWER_TIMEOUT = 2.0
# Admin connections open at once, whatever their state (Prometheus opens one per scrape, a
# probe one each, all of them short): the bound on the descriptors the listener holds. A
# connection beyond it evicts an idle one (see the module's docstring), it is never refused.
ADMIN_MAX_CONNECTIONS = 16
# The kernel's queue of connections not yet accepted, also the most accepted in one wake-up
# (asyncio's backlog): a probe behind a burst waits in this queue for a moment, not for a SYN
# retransmission (1 s). A burst can hold ADMIN_MAX_CONNECTIONS + ADMIN_ACCEPT_BACKLOG
# descriptors for one turn of the event loop, until the evicted ones are closed.
ADMIN_ACCEPT_BACKLOG = 64
# Where the token may come from besides --admin-token-file (removed from the environment once
# read, so nothing serve starts inherits it).
TOKEN_ENV = "EGRESSBOX_ADMIN_TOKEN"  # noqa: S105 (the variable's name, not a token)
# RFC 6750 b64token, bounded.
_TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
MAX_TOKEN_CHARS = 4096
_REQUEST_LINE_RE = re.compile(rb"([A-Z]{1,16}) ([\x21-\x7e]{1,2048}) HTTP/1\.[01]")
_FIELD_RE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([\x20-\x7e\t]*?)[ \t]*")
PATHS = ("/metrics", "/healthz", "/readyz")
_INT_ZERO = struct.pack("i", 0)
# SO_LINGER on, zero seconds: close() resets the connection and drops what is unsent.
_LINGER_RESET = struct.pack("ii", 1, 0)


class Status(Protocol):
    """What the admin listener reports on (fleet.ProcessStatus)."""

    def ready(self) -> tuple[bool, str]:
        """(ready, why not)."""
        ...

    def metrics(self, accept: str) -> tuple[bytes, str]:
        """(body, content type) for a scraper that sent `accept`."""
        ...


# -- settings -------------------------------------------------------------------------------


def parse_admin_address(text: str) -> tuple[str, int]:
    """`ADDR:PORT` or `[v6]:PORT` (the port is required; 0 picks a free one)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r}: give ADDR:PORT, e.g. 127.0.0.1:9464 or [::1]:9464")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: put an IPv6 address in brackets, e.g. [::1]:9464")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not an IP address") from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: {port_text!r} is not a TCP port (0-65535)")
    return str(ip), int(port_text)


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def read_token(path: str | None, environ: MutableMapping[str, str]) -> str | None:
    """The bearer token from `path` or from $EGRESSBOX_ADMIN_TOKEN (popped from `environ`),
    or None. ValueError when both are given, or the token is empty or not a b64token."""
    from_env = environ.pop(TOKEN_ENV, None)
    if path is None:
        return None if from_env is None else _checked_token(from_env, TOKEN_ENV)
    if from_env is not None:
        raise ValueError(f"both --admin-token-file and ${TOKEN_ENV} are set; give one")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(MAX_TOKEN_CHARS + 2)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    return _checked_token(text.rstrip("\r\n"), path)


def _checked_token(token: str, where: str) -> str:
    if not token:
        raise ValueError(f"{where}: the token is empty")
    if len(token) > MAX_TOKEN_CHARS or not _TOKEN_RE.fullmatch(token):
        raise ValueError(
            f"{where}: a token is up to {MAX_TOKEN_CHARS} characters of A-Z a-z 0-9 - . _ ~ + /"
            " (and trailing =), on one line"
        )
    return token


def bind_admin(host: str, port: int) -> socket.socket:
    """The admin listening socket (OSError names the address)."""
    from egressbox.proxy.server import bind_listener

    try:
        return bind_listener(host, port)
    except OSError as exc:
        where = format_authority(host, port)
        raise OSError(exc.errno, f"admin listener on {where}: {exc.strerror}") from None


def address_of(sock: socket.socket) -> tuple[str, int]:
    """(canonical IP text, port) a listening socket is bound to."""
    host, port = sock.getsockname()[:2]
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port)


# -- the listener ---------------------------------------------------------------------------


class AdminServer:
    """Serves `status` on a listening socket until close()."""

    def __init__(self, sock: socket.socket, status: Status, *, token: str | None = None) -> None:
        self._sock = sock
        self._status = status
        self._token = token.encode("ascii") if token is not None else None
        self._server: asyncio.Server | None = None
        # Open connections in the order they were accepted (a dict keeps it): the oldest
        # of a kind is the first one found.
        self._open: dict[_AdminConnection, None] = {}
        self.evicted = 0  # connections closed to make room for a newer one
        self.authority = format_authority(*address_of(sock))

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _AdminConnection(self, loop), sock=self._sock, backlog=ADMIN_ACCEPT_BACKLOG
        )

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for connection in list(self._open):
            connection.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)

    def opened(self, connection: _AdminConnection) -> None:
        """A connection was accepted: room is made for it, never refused."""
        while len(self._open) >= ADMIN_MAX_CONNECTIONS:
            victim = self._victim()
            if victim is None:  # not reached: the loop runs only while one is open
                break
            self.evicted += 1
            victim.abort()
        self._open[connection] = None

    def closed(self, connection: _AdminConnection) -> None:
        self._open.pop(connection, None)

    def _victim(self) -> _AdminConnection | None:
        """The oldest connection of the least worth keeping (see _AdminConnection.worth)."""
        chosen: _AdminConnection | None = None
        lowest = _WORTH_PENDING + 1
        for connection in self._open:  # oldest first
            worth = connection.worth()
            if worth < lowest:
                chosen, lowest = connection, worth
                if worth == _WORTH_SILENT:
                    break
        return chosen

    # -- one request, bytes in, bytes out --------------------------------------------------

    def respond(self, head: bytes) -> bytes:
        """The whole response to one request head (b"": it was over ADMIN_HEAD_BYTES)."""
        request = _read_request(head)
        if isinstance(request, bytes):
            return request  # the refusal
        method, target, fields = request
        body_wanted = method == b"GET"
        path = target.split("?", 1)[0]
        if path == "/healthz":
            return _reply(200, "ok\n", body_wanted=body_wanted)
        if path == "/readyz":
            ready, why = self._status.ready()
            text = "ready\n" if ready else f"not ready: {why}\n"
            return _reply(200 if ready else 503, text, body_wanted=body_wanted)
        if path == "/metrics":
            if not self._authorized(fields.get("authorization", "")):
                return _reply(
                    401,
                    "a bearer token is required\n",
                    extra=(("WWW-Authenticate", 'Bearer realm="egressbox"'),),
                )
            body, content_type = self._status.metrics(fields.get("accept", ""))
            return _reply(200, body, content_type=content_type, body_wanted=body_wanted)
        return _reply(404, f"not found; the admin listener serves {', '.join(PATHS)}\n")

    def _authorized(self, value: str) -> bool:
        if self._token is None:
            return True
        scheme, _, given = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode("ascii", "replace"), self._token)


# What an open connection is worth keeping when a newer one needs its room, least first:
# it has sent nothing; it has sent part of a head and nothing more is waiting (a drip);
# its answer is written and not read yet (a slow reader); bytes it sent are waiting in the
# kernel, not read yet (most likely a probe's request, accepted in the same burst as this
# newcomer: the event loop reads it in a moment).
_WORTH_SILENT: Final = 0
_WORTH_DRIPPING: Final = 1
_WORTH_ANSWERED: Final = 2
_WORTH_PENDING: Final = 3


class _AdminConnection(asyncio.Protocol):
    """One admin connection: its request head, the answer, and a deadline for each."""

    def __init__(self, server: AdminServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._head = bytearray()  # the request head so far (a drip appends byte by byte)
        self._accepted = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._fd = -1
        self.answered = False  # the whole head came and its answer was written

    def worth(self) -> int:
        """How much this connection is worth keeping (one of the _WORTH_ values)."""
        if self._waiting():
            return _WORTH_PENDING
        if self.answered:
            return _WORTH_ANSWERED
        return _WORTH_DRIPPING if self._head else _WORTH_SILENT

    def _waiting(self) -> bool:
        """Whether bytes this client sent wait in the kernel, unread (FIONREAD)."""
        if self.answered:
            return False  # a request's answer is written; anything more is dropped
        try:
            count = fcntl.ioctl(self._fd, termios.FIONREAD, _INT_ZERO)
        except OSError:
            return False
        return bool(struct.unpack("i", count)[0])

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._fd = transport.get_extra_info("socket").fileno()
        self._accepted = self._loop.time()
        self._server.opened(self)
        self._arm(self._accepted + ADMIN_FIRST_BYTE_TIMEOUT)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # one request per connection: anything after its head is dropped
        if not self._head:
            self._arm(self._accepted + ADMIN_HEAD_TIMEOUT)
        searched = max(0, len(self._head) - 3)
        self._head += data
        end = self._head.find(b"\r\n\r\n", searched)
        if end >= 0 and end + 4 <= ADMIN_HEAD_BYTES:
            self._answer(bytes(self._head[: end + 4]))
        elif len(self._head) >= ADMIN_HEAD_BYTES:
            self._answer(b"")  # over the limit: 431

    def eof_received(self) -> bool:
        # Half-closed before a whole head: there is no request to answer.
        self.abort()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._server.closed(self)

    def abort(self) -> None:
        self._server.closed(self)
        transport = self._transport
        if transport is None:
            return
        if self.answered:
            # The kernel would go on sending an orphaned answer to a client that does not
            # read it (its buffer is up to tcp_wmem's 4 MiB): a reset drops it with the
            # descriptor.
            sock = transport.get_extra_info("socket")
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        transport.abort()

    def _answer(self, head: bytes) -> None:
        transport = self._transport
        assert transport is not None
        self.answered = True
        self._head = bytearray()
        try:
            response = self._server.respond(head)
        except Exception:  # a bug in a renderer: this client gets a 500, the listener goes on
            response = _reply(500, "internal error\n")
        transport.write(response)
        if transport.can_write_eof():
            transport.write_eof()
        # close() lets what is buffered go out first; a client that does not read it by
        # the deadline is aborted.
        transport.close()
        self._arm(self._loop.time() + ADMIN_ANSWER_TIMEOUT)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self.abort)


def _read_request(head: bytes) -> tuple[bytes, str, dict[str, str]] | bytes:
    """(method, target, fields) of a request this listener answers, or the refusal."""
    if not head:
        return _reply(431, "request head too large\n")
    lines = head[:-4].split(b"\r\n")
    line = _REQUEST_LINE_RE.fullmatch(lines[0])
    fields = _fields(lines[1:]) if line is not None else None
    if line is None or fields is None:
        return _reply(400, "malformed request line or header field\n")
    method, target = line.group(1), line.group(2).decode("ascii")
    if "transfer-encoding" in fields or fields.get("content-length", "0") != "0":
        return _reply(400, "the admin listener takes no request body\n")
    if not target.startswith("/"):
        paths = ", ".join(PATHS)
        return _reply(400, f"this is egressbox's admin listener, not a proxy: GET {paths}\n")
    if method not in (b"GET", b"HEAD"):
        return _reply(405, "only GET and HEAD\n", extra=(("Allow", "GET, HEAD"),))
    return method, target, fields


def _fields(lines: list[bytes]) -> dict[str, str] | None:
    """Header fields by lower-cased name (the last one wins); None for a malformed line or
    a field given twice that matters here."""
    found: dict[str, str] = {}
    for line in lines:
        match = _FIELD_RE.fullmatch(line)
        if match is None:
            return None
        name = match.group(1).decode("ascii").lower()
        if name in found and name in ("authorization", "content-length", "transfer-encoding"):
            return None
        found[name] = match.group(2).decode("ascii")
    return found


def _reply(
    status: int,
    body: str | bytes,
    *,
    content_type: str = "text/plain; charset=utf-8",
    body_wanted: bool = True,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    from http import HTTPStatus

    data = body.encode() if isinstance(body, str) else body
    fields = [
        ("Content-Type", content_type),
        ("Content-Length", str(len(data))),
        ("Cache-Control", "no-store"),
        ("Connection", "close"),
        ("Server", "egressbox"),
        *extra,
    ]
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in fields) + "\r\n"
    return head.encode("ascii") + (data if body_wanted else b"")
