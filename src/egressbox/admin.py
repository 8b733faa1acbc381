"""serve's admin listener (`serve --admin ADDR:PORT`): /metrics, /healthz and /readyz.

A listener apart from the proxy's ports, never one of them: it answers three GET paths, one
request per connection, and nothing else. It never dials, forwards or tunnels anything, so it
cannot become a proxy; an absolute-form target, CONNECT, a body or any other path is refused.
Every exchange is bounded: the request head (ADMIN_HEAD_BYTES), the time from accept to the
last byte of the answer (ADMIN_REQUEST_TIMEOUT) and the connections open at once
(ADMIN_MAX_CONNECTIONS: more are closed at once, so a flood of admin clients cannot take the
proxy's descriptors).

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
import hmac
import ipaddress
import re
import socket
from collections.abc import MutableMapping
from typing import Protocol

from egressbox.hosts import format_authority

# A scraper's or a probe's GET is a few hundred bytes; 8 KiB leaves room for a long token.
ADMIN_HEAD_BYTES = 8192
# From accept to the last byte of the answer: a scrape renders in milliseconds.
ADMIN_REQUEST_TIMEOUT = 5.0
# Admin connections open at once (Prometheus opens one per scrape, probes one each).
ADMIN_MAX_CONNECTIONS = 16
# Where the token may come from besides --admin-token-file (removed from the environment once
# read, so nothing serve starts inherits it).
TOKEN_ENV = "EGRESSBOX_ADMIN_TOKEN"  # noqa: S105 (the variable's name, not a token)
# RFC 6750 b64token, bounded.
_TOKEN_RE = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
MAX_TOKEN_CHARS = 4096
_REQUEST_LINE_RE = re.compile(rb"([A-Z]{1,16}) ([\x21-\x7e]{1,2048}) HTTP/1\.[01]")
_FIELD_RE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([\x20-\x7e\t]*?)[ \t]*")
PATHS = ("/metrics", "/healthz", "/readyz")


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
        self._active = 0
        self._handlers: set[asyncio.Task[None]] = set()
        self.authority = format_authority(*address_of(sock))

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accepted, sock=self._sock, limit=ADMIN_HEAD_BYTES
        )

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._handlers):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._active >= ADMIN_MAX_CONNECTIONS or task is None:
            writer.transport.abort()
            return
        self._active += 1
        self._handlers.add(task)
        answered = False
        try:
            async with asyncio.timeout(ADMIN_REQUEST_TIMEOUT):
                await self._exchange(reader, writer)
            answered = True
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._active -= 1
            self._handlers.discard(task)
            if answered:
                writer.close()  # after what is still buffered has gone out
            else:
                writer.transport.abort()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            head = b""
        writer.write(self.respond(head))
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

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
