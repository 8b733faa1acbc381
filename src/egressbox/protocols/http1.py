"""Sans-IO HTTP/1.1 for a forward proxy: request heads and bodies in, replies out.

No I/O and no asyncio (DESIGN §10): the server feeds bytes and writes what
comes back. Four machines and a few builders:

- `RequestHeadParser`: a client's request head -> `RequestHead` (CONNECT or
  absolute-form FORWARD of an http:// or ws:// URL), or `HttpError` with the
  status to answer.
- `RequestBodyReader`: the client's body after the head -> bytes for the
  upstream, the end of the body and the bytes beyond it (a pipelined request).
- `ResponseFramer`: the upstream's response -> events whose `.data` is exactly
  what to write to the client, ending in `EndOfMessage`, or in `Upgraded`
  when a 101 answers an upgrade request (then both sides relay raw bytes).
- `forward_head`, `connect_established`, `error_reply`: bytes to send.

Why our own strict parser instead of h11: a proxy sits between two parsers,
and every message that they could read differently (CL.TE, TE.TE, obs-fold,
bare LF, duplicate Content-Length ...) is a request-smuggling hole. So
anything ambiguous is refused, and what goes out is re-framed canonically
(one Content-Length, or chunks we encode ourselves), never copied through.

HTTP/1.1 Upgrade (RFC 9110 §7.8; a WebSocket is `GET ws://host/path` with
`Upgrade: websocket`) is passed through only without a request body, so the
first byte after the request head is the new protocol's, with nothing to
disagree on; the response after a refused upgrade ends the connection.

Messages in `HttpError` are fixed texts: they never echo request bytes, which
could carry credentials or paths (DESIGN §6).
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import NamedTuple

from egressbox import hosts, limits
from egressbox.errors import EgressboxError, HostError

# -- limits (each with where its value came from) ---------------------------------

# RFC 9112 §2.2: a server SHOULD ignore at least one empty line before the
# request line (some clients send CRLF after a POST body). A few are skipped;
# an endless stream of them is not a request.
MAX_LEADING_EMPTY_LINES = 4
# Apache's LimitRequestFields default; real clients send a few dozen fields.
MAX_HEADER_FIELDS = 100
# 18 decimal digits always fit a signed 64-bit integer, so every hop behind
# us reads the same number we do (a longer one could wrap or saturate in C).
MAX_CONTENT_LENGTH_DIGITS = 18
# 16 hex digits: chunks up to 2**64-1 bytes. Longer (zero-padded) sizes are
# refused instead of trusting every other hop to read them alike.
MAX_CHUNK_SIZE_DIGITS = 16
# A chunk-size line with its extensions, which we drop; nobody uses them in
# practice, so 4 KiB is generous and bounds what we buffer for one line.
MAX_CHUNK_LINE_BYTES = 4096
# A trailer section is a header section, so it gets the head's budget.
MAX_TRAILER_BYTES = limits.MAX_HEAD_BYTES
# 1xx responses before the final one (103 Early Hints, 102 Processing); more
# is a misbehaving upstream, not a reason to keep reading forever.
MAX_INFORMATIONAL_RESPONSES = 16
# An error reply's message is one short line for a human; anything longer is
# only room for reflecting attacker-chosen text.
MAX_MESSAGE_CHARS = 200

HTTP_10 = "HTTP/1.0"
HTTP_11 = "HTTP/1.1"
# Every http:// URL without a port means port 80 (RFC 9110 §4.2.1), and so
# does every ws:// URL (RFC 6455 §3).
HTTP_DEFAULT_PORT = 80
# Absolute-form schemes forwarded in plain text; the TLS ones need CONNECT.
_PLAIN_SCHEMES = frozenset({"http", "ws"})
_TLS_SCHEMES = frozenset({"https", "wss"})

# tchar (RFC 9110 §5.6.2).
_TOKEN_RE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# protocol = protocol-name ["/" protocol-version], both tokens (RFC 9110 §7.8).
_PROTOCOL_RE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+(?:/[!#$%&'*+\-.^_`|~0-9A-Za-z]+)?")
# CTLs other than HTAB, which field values may hold (RFC 9110 §5.5).
_CONTROL_RE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_VERSION_RE = re.compile(rb"HTTP/[0-9]+(?:\.[0-9]+)?")
_SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")
_DIGITS_RE = re.compile(r"[0-9]+")
_PATH_START_RE = re.compile(r"[/?]")
# chunk-size, then optional extensions: printable, since we drop them anyway.
_CHUNK_LINE_RE = re.compile(rb"([0-9A-Fa-f]+)(?:[ \t]*;[\t\x20-\x7e\x80-\xff]*)?")
# status-line; a missing SP before an empty reason is tolerated (seen in the wild).
_STATUS_LINE_RE = re.compile(rb"(HTTP/1\.[01]) ([1-5][0-9][0-9])(?: ([\t\x20-\x7e\x80-\xff]*))?")
_REASON_CODE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CR_OR_LF_RE = re.compile(rb"[\r\n]")
# The whole-head path's shortcuts, each matching only text that the general
# functions accept and turn into the same value (checked by property tests): a
# CONNECT line, or an `http://` line, whose host has no brackets, colon,
# userinfo or URL delimiter; and a field block in which every line is
# `token ":" value CRLF` with no control character but HTAB in the value.
# Anything else takes the general path.
_CONNECT_LINE_RE = re.compile(rb"CONNECT ([^\x00-\x20\x7f-\xff/?#@:\[\]]+):([0-9]+) (HTTP/1\.[01])")
_ABSOLUTE_LINE_RE = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) (http://([^\x00-\x20\x7f-\xff/?#@:\[\]]+)(?::([0-9]+))?"
    rb"(/[^\x00-\x20\x7f-\xff#]*)?) (HTTP/1\.[01])"
)
_FIELD_LINE = rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):([^\x00-\x08\x0a-\x1f\x7f]*)\r\n"
_FIELD_LINE_RE = re.compile(_FIELD_LINE)
_FIELD_BLOCK_RE = re.compile(b"(?:" + _FIELD_LINE + b")*")
_CR = 0x0D
_LF = 0x0A
_OWS = " \t"

# Connection-level fields (RFC 9110 §7.6.1): never forwarded to the next hop.
# Transfer-Encoding is among them because we re-emit our own framing field.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# A client could name these in `Connection:` to make us drop them, and so
# strip the framing of a body it still sends (smuggling): never drop them.
_NEVER_DROPPED = frozenset({"host", "content-length", "transfer-encoding"})
# Unicode categories removed from reply messages: controls (CR, LF, C1),
# format characters (bidi overrides), line/paragraph separators, surrogates.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})

# RFC 9110 §15.3.5, §15.4.5: these responses never have a body.
_NO_BODY_STATUSES = frozenset({HTTPStatus.NO_CONTENT, HTTPStatus.NOT_MODIFIED})

_LAST_CHUNK = b"0\r\n\r\n"
_CONNECT_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"

# -- errors -----------------------------------------------------------------------------


class HttpError(EgressboxError):
    """A message we refuse; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message


class UpstreamResponseError(HttpError):
    """The upstream's response cannot be framed safely: answer 502 (if no head was sent yet)."""

    def __init__(self, message: str) -> None:
        super().__init__(HTTPStatus.BAD_GATEWAY, message)


def _bad_request(message: str) -> HttpError:
    return HttpError(HTTPStatus.BAD_REQUEST, message)


Fail = Callable[[str], HttpError]

# -- values -------------------------------------------------------------------------------


class RequestKind(enum.Enum):
    CONNECT = "connect"  # authority-form: open a tunnel
    FORWARD = "forward"  # absolute-form http:// or ws:// URL: forward one request


class FramingKind(enum.Enum):
    NONE = "none"
    LENGTH = "length"
    CHUNKED = "chunked"


@dataclass(frozen=True, slots=True)
class BodyFraming:
    """How a request body is delimited: no body, `length` bytes, or chunked."""

    kind: FramingKind
    length: int = 0


NO_BODY = BodyFraming(FramingKind.NONE)
CHUNKED_BODY = BodyFraming(FramingKind.CHUNKED)
_EMPTY_BODY = BodyFraming(FramingKind.LENGTH, 0)


class Authority(NamedTuple):
    """Host and port of the request target.

    `host` is the text as the client wrote it (brackets kept around IPv6): it
    is NOT normalized here. Pass it to `hosts.normalize_host` (the decision
    does) before comparing it with anything.
    """

    host: str
    port: int


Fields = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A validated request head.

    `headers` are (name, value) in the order received: names as sent, values
    with surrounding whitespace removed, decoded as Latin-1 so that encoding
    them back gives the exact bytes. The target, path and headers are left out
    of repr(): they may carry credentials and must not reach a log.

    `upgrade` lists the protocols of an upgrade request (an HTTP/1.1 FORWARD
    with `Upgrade` and `Connection: upgrade`, and no body), as sent; it is
    empty for every other request, whose Upgrade field is dropped.
    """

    method: str
    version: str
    kind: RequestKind
    authority: Authority
    body: BodyFraming
    expect_continue: bool
    keep_alive: bool
    target: str = field(repr=False)
    origin_target: str | None = field(repr=False)  # path+query; None for CONNECT
    headers: Fields = field(repr=False)
    connection_tokens: frozenset[str] = field(repr=False)
    upgrade: tuple[str, ...] = ()

    @property
    def host(self) -> str:
        return self.authority.host

    @property
    def port(self) -> int:
        return self.authority.port

    def header(self, name: str) -> list[str]:
        """Every value of the header `name` (case-insensitive), in order."""
        return _values(self.headers, name)


# The field index of the head looked at last: a head's checks ask for seven or
# more names, and one pass that indexes every field beats a scan per name.
# Swapped as one tuple (atomic), and it holds `fields` itself, so an identity
# match can never be a new head at a recycled address.
_LAST_INDEX: list[tuple[Fields, dict[str, list[str]]]] = [((), {})]


def _values(fields: Fields, name: str) -> list[str]:
    last = _LAST_INDEX[0]
    if last[0] is not fields:
        index: dict[str, list[str]] = {}
        for key, value in fields:
            index.setdefault(key.lower(), []).append(value)
        last = _LAST_INDEX[0] = (fields, index)
    found = last[1].get(name.lower())
    return list(found) if found else []


# -- lines ----------------------------------------------------------------------------------


class _LineBuffer:
    """Received bytes not yet consumed, handed out as CRLF lines or raw runs.

    Every check here depends only on the bytes seen, never on how they were
    split across feeds, so chunking cannot change a verdict. Each byte is
    scanned once even when bytes arrive one at a time.
    """

    def __init__(self, fail: Fail) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._scanned = 0  # bytes after _pos already known to hold no CR/LF
        self.consumed = 0  # total bytes handed out so far
        self._fail = fail

    @property
    def available(self) -> int:
        return len(self._buf) - self._pos

    def extend(self, data: bytes) -> None:
        if self._pos:
            del self._buf[: self._pos]  # keep only what is still unread
            self._pos = 0
        self._buf += data

    def line(self, budget: int, too_long: Callable[[], HttpError]) -> bytes | None:
        """The next line without its CRLF, or None until it has arrived.

        The line with its CRLF must fit in `budget` bytes, else `too_long()` is raised
        (a factory: the error is only built when it is raised).
        A CR not followed by LF, or an LF without CR, is refused at once.
        """
        end = min(len(self._buf), self._pos + budget)
        found = _CR_OR_LF_RE.search(self._buf, self._pos + self._scanned, end)
        if found is None:
            self._scanned = max(end - self._pos, 0)
        else:
            at = found.start()
            if self._buf[at] == _LF:
                raise self._fail("a line ends in a bare LF; lines must end in CRLF")
            if at + 1 < end:
                if self._buf[at + 1] != _LF:
                    raise self._fail("a bare CR inside a line is not allowed")
                return self._consume_line(at)
            self._scanned = at - self._pos  # look at this CR again with the next byte
        if self.available >= budget:
            raise too_long()
        return None

    def _consume_line(self, cr: int) -> bytes:
        line = bytes(self._buf[self._pos : cr])
        self._advance(cr + 2)
        return line

    def take(self, limit: int | None = None) -> bytes:
        """Up to `limit` (default: all) of the unread bytes, as they are."""
        count = self.available if limit is None else min(limit, self.available)
        data = bytes(self._buf[self._pos : self._pos + count])
        self._advance(self._pos + count)
        return data

    def _advance(self, pos: int) -> None:
        self.consumed += pos - self._pos
        self._pos = pos
        self._scanned = 0


def _parse_field_line(line: bytes, fail: Fail) -> tuple[str, str]:
    """`name: value` (RFC 9112 §5), strictly; value without surrounding OWS."""
    if line[:1] in (b" ", b"\t"):
        raise fail("obs-fold (a header line starting with whitespace) is not allowed")
    name, colon, value = line.partition(b":")
    if not colon:
        raise fail("a header line has no colon")
    if name[-1:] in (b" ", b"\t"):
        raise fail("whitespace between a header name and its colon is not allowed")
    if not _TOKEN_RE.fullmatch(name):
        raise fail("a header name is not a token")
    if _CONTROL_RE.search(value):
        raise fail("a control character in a header value is not allowed")
    return name.decode("ascii"), value.strip(b" \t").decode("latin-1")


def _plain_fields(data: bytes, start: int, stop: int) -> Fields | None:
    """The fields of data[start:stop] when every line there is a plain field line
    (`_FIELD_BLOCK_RE`): what `_parse_field_line` gives for each. Else None."""
    if not _FIELD_BLOCK_RE.fullmatch(data, start, stop):
        return None
    return tuple(
        (name.decode("ascii"), value.strip(b" \t").decode("latin-1"))
        for name, value in _FIELD_LINE_RE.findall(data, start, stop)
    )


def _list_items(values: list[str]) -> list[str]:
    """The elements of a comma-separated field (RFC 9110 §5.6.1), empty ones dropped."""
    items = (item.strip(_OWS) for value in values for item in value.split(","))
    return [item for item in items if item]


def _connection_tokens(fields: Fields, fail: Fail | None) -> frozenset[str]:
    """Lower-cased `Connection` options; with `fail`, a non-token is refused."""
    items = _list_items(_values(fields, "connection"))
    if fail is not None and not all(_TOKEN_RE.fullmatch(i.encode("latin-1")) for i in items):
        raise fail("malformed Connection header")
    return frozenset(item.lower() for item in items)


def _content_length(values: list[str], fail: Fail) -> int:
    if len(values) > 1:
        raise fail("more than one Content-Length header")
    value = values[0]
    if "," in value:
        raise fail("Content-Length must be one number, not a list")
    if not _DIGITS_RE.fullmatch(value):
        raise fail("Content-Length must be decimal digits only")
    if len(value) > MAX_CONTENT_LENGTH_DIGITS:
        raise fail("Content-Length is too large")
    return int(value)


class _Coding(enum.Enum):
    CHUNKED = "chunked"  # exactly one coding: chunked
    MALFORMED = "malformed"  # chunked is not the single final coding
    UNSUPPORTED = "unsupported"  # valid, e.g. `gzip, chunked`, but refused


def _transfer_coding(value: str) -> _Coding:
    # Only a lone `chunked` is accepted. `gzip, chunked` is valid HTTP, but
    # supporting it buys nothing and every extra form is one more way for two
    # hops to disagree on where a body ends.
    codings = [c.strip(_OWS).lower() for c in value.split(",")]
    if codings == ["chunked"]:
        return _Coding.CHUNKED
    if codings[-1] != "chunked" or codings.count("chunked") != 1:
        return _Coding.MALFORMED
    return _Coding.UNSUPPORTED


def _strip_for_next_hop(fields: Fields, connection: frozenset[str]) -> Fields:
    """Drop hop-by-hop fields, fields named in Connection, and every Proxy-*."""
    dropped = (connection - _NEVER_DROPPED) | _HOP_BY_HOP
    return tuple(
        (name, value)
        for name, value in fields
        if name.lower() not in dropped and not name.lower().startswith("proxy-")
    )


def _serialize(start_line: str, fields: Sequence[tuple[str, str]]) -> bytes:
    lines = [start_line, *(f"{name}: {value}" for name, value in fields)]
    # Latin-1 gives back the exact bytes each value was decoded from.
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# -- request head --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _RequestLine:
    method: str
    target: str
    version: str
    kind: RequestKind
    authority: Authority
    origin_target: str | None


class RequestHeadParser:
    """Parse one request head fed in any chunking.

    `feed` returns None while more bytes are needed, the `RequestHead` once
    the head is complete (then `trailing` holds the bytes after it, which the
    body reader or the next parser must get), or raises `HttpError`. After an
    error every further `feed` raises the same error.
    """

    def __init__(self, max_head_bytes: int = limits.MAX_HEAD_BYTES) -> None:
        self._max_head_bytes = max_head_bytes
        self._lines = _LineBuffer(_bad_request)
        self._head_start = 0
        self._empty_lines = 0
        self._request_line: _RequestLine | None = None
        self._fields: list[tuple[str, str]] = []
        self._head: RequestHead | None = None
        self._trailing = b""
        self._error: HttpError | None = None

    @property
    def trailing(self) -> bytes:
        """Bytes received after the head (empty until a head was returned)."""
        return self._trailing

    def feed(self, data: bytes) -> RequestHead | None:
        if self._error is not None:
            raise self._error
        if self._head is not None:
            raise RuntimeError("the head is complete; feed further bytes to the body reader")
        try:
            if not self._lines.consumed and not self._lines.available and type(data) is bytes:
                head = self._whole_head(data)
                if head is not None:
                    return head
            self._lines.extend(data)
            return self._advance()
        except HttpError as exc:
            self._error = exc
            raise

    def _whole_head(self, data: bytes) -> RequestHead | None:
        """Fast path: a whole head in the first feed, parsed without the line buffer.

        Taken only when the line-by-line path would see the same lines: no leading
        empty line, every line ends in CRLF with no bare CR or LF, and the head fits
        the limit. The same checks then run in the same order, so the head or the
        error is the same. Returns None (nothing changed) to take the slow path.
        """
        end = data.find(b"\r\n\r\n")
        if end <= 0 or end + 4 > self._max_head_bytes:
            return None
        breaks = data.count(b"\r\n", 0, end)
        if data.count(b"\r", 0, end) != breaks or data.count(b"\n", 0, end) != breaks:
            return None
        line_end = data.find(b"\r\n", 0, end + 2)
        if line_end == 0:
            return None  # a leading empty line: the line path skips it
        request_line = _plain_request_line(data, line_end)
        if request_line is None:
            request_line = _parse_request_line(data[:line_end])
        self._request_line = request_line
        head = _build_head(request_line, self._field_block(data, line_end + 2, end + 2))
        self._head = head
        self._trailing = data[end + 4 :]
        return head

    def _field_block(self, data: bytes, start: int, stop: int) -> Fields:
        """The fields of the CRLF-ended lines in data[start:stop] (none if start >= stop)."""
        if start >= stop:
            return ()
        fields = _plain_fields(data, start, stop)
        if fields is not None and len(fields) <= MAX_HEADER_FIELDS:
            return fields
        for line in data[start : stop - 2].split(b"\r\n"):
            self._on_field_line(line)  # the same checks, one line at a time, in order
        return tuple(self._fields)

    def _advance(self) -> RequestHead | None:
        while True:
            line = self._next_line()
            if line is None:
                return None
            if self._request_line is None:
                self._on_first_line(line)
            elif line:
                self._on_field_line(line)
            else:
                return self._finish(self._request_line)

    def _next_line(self) -> bytes | None:
        budget = self._max_head_bytes - (self._lines.consumed - self._head_start)
        if self._request_line is None:
            return self._lines.line(budget, self._line_too_long)
        return self._lines.line(budget, self._head_too_long)

    def _line_too_long(self) -> HttpError:
        return HttpError(
            HTTPStatus.REQUEST_URI_TOO_LONG,
            f"request line is longer than {self._max_head_bytes} bytes",
        )

    def _head_too_long(self) -> HttpError:
        return HttpError(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            f"request head is larger than {self._max_head_bytes} bytes",
        )

    def _on_first_line(self, line: bytes) -> None:
        if line:
            self._request_line = _parse_request_line(line)
            return
        self._empty_lines += 1
        if self._empty_lines > MAX_LEADING_EMPTY_LINES:
            raise _bad_request("too many empty lines before the request line")
        self._head_start = self._lines.consumed  # skipped lines do not count

    def _on_field_line(self, line: bytes) -> None:
        if len(self._fields) >= MAX_HEADER_FIELDS:
            raise HttpError(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                f"more than {MAX_HEADER_FIELDS} header fields",
            )
        self._fields.append(_parse_field_line(line, _bad_request))

    def _finish(self, request_line: _RequestLine) -> RequestHead:
        head = _build_head(request_line, tuple(self._fields))
        self._head = head
        self._trailing = self._lines.take()
        return head


def _parse_request_line(line: bytes) -> _RequestLine:
    """`METHOD SP request-target SP HTTP-version` (RFC 9112 §3), single spaces."""
    if _CONTROL_RE.search(line) or b"\t" in line:
        raise _bad_request("a control character in the request line is not allowed")
    if not line.isascii():
        raise _bad_request("the request line must be ASCII")
    parts = line.split(b" ")
    if len(parts) != 3 or not all(parts):
        raise _bad_request("the request line must be METHOD SP TARGET SP HTTP/1.1, single spaces")
    method, target, version = (part.decode("ascii") for part in parts)
    if version not in (HTTP_10, HTTP_11):
        if _VERSION_RE.fullmatch(parts[2]):
            raise HttpError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, "only HTTP/1.1 and 1.0")
        raise _bad_request("malformed HTTP version in the request line")
    if not _TOKEN_RE.fullmatch(parts[0]):
        raise _bad_request("the method is not a token")
    kind, authority, origin_target = _interpret_target(method, target)
    return _RequestLine(method, target, version, kind, authority, origin_target)


def _plain_request_line(data: bytes, end: int) -> _RequestLine | None:
    """What `_parse_request_line` gives for data[:end] when it is a plain CONNECT
    or `http://` line (see _CONNECT_LINE_RE); else None."""
    connect = _CONNECT_LINE_RE.fullmatch(data, 0, end)
    if connect is not None:
        host, raw_port, version = (part.decode("ascii") for part in connect.groups())
        authority = Authority(host, _target_port(raw_port, connect=True))
        target = f"{host}:{raw_port}"
        return _RequestLine("CONNECT", target, version, RequestKind.CONNECT, authority, None)
    forward = _ABSOLUTE_LINE_RE.fullmatch(data, 0, end)
    if forward is None or forward.group(1) == b"CONNECT":
        return None
    method, target, host = (part.decode("ascii") for part in forward.group(1, 2, 3))
    raw_port, path = forward.group(4, 5)
    port = HTTP_DEFAULT_PORT if raw_port is None else _target_port(raw_port.decode(), False)
    # RFC 9112 §3.2.4: an empty path is sent as "/", or "*" for OPTIONS.
    empty = "*" if method == "OPTIONS" else "/"
    origin = empty if path is None else path.decode("ascii")
    version = forward.group(6).decode("ascii")
    authority = Authority(host, port)
    return _RequestLine(method, target, version, RequestKind.FORWARD, authority, origin)


def _interpret_target(method: str, target: str) -> tuple[RequestKind, Authority, str | None]:
    if method == "CONNECT":
        return RequestKind.CONNECT, _connect_authority(target), None
    if target == "*":
        raise _bad_request("asterisk-form (OPTIONS *) is not proxied; send an absolute http:// URL")
    if target.startswith("/"):
        raise _bad_request(
            "this is a proxy: send absolute-form (GET http://host/path) or CONNECT host:port"
        )
    scheme = _SCHEME_RE.match(target)
    if scheme is None:
        raise _bad_request(
            "the request target must be absolute-form (http://host/path);"
            " only CONNECT takes host:port"
        )
    name = scheme.group(1).lower()
    if name in _TLS_SCHEMES:
        raise _bad_request(
            "for https:// and wss:// URLs use CONNECT host:443 (a TLS tunnel through the proxy)"
        )
    if name not in _PLAIN_SCHEMES:
        raise _bad_request(
            "only http:// and ws:// URLs are forwarded; tunnel other protocols with CONNECT"
        )
    authority, origin_target = _absolute_form(method, target[scheme.end() :])
    return RequestKind.FORWARD, authority, origin_target


def _connect_authority(target: str) -> Authority:
    """authority-form `host:port` / `[v6]:port` (RFC 9112 §3.2.3); port required."""
    if any(c in target for c in "/?#"):
        raise _bad_request("CONNECT needs host:port (authority-form), not a URL")
    return _authority(target, default_port=None)


def _absolute_form(method: str, rest: str) -> tuple[Authority, str]:
    """What follows `http://` or `ws://`: authority, path and query (RFC 9112 §3.2.2)."""
    if "#" in rest:
        raise _bad_request("a fragment (#) is not allowed in the request target")
    found = _PATH_START_RE.search(rest)
    cut = found.start() if found is not None else len(rest)
    authority = _authority(rest[:cut], default_port=HTTP_DEFAULT_PORT)
    path = rest[cut:]
    if not path:
        # RFC 9112 §3.2.4: an empty path is sent as "/", or "*" for OPTIONS.
        return authority, "*" if method == "OPTIONS" else "/"
    return authority, path if path.startswith("/") else "/" + path


def _authority(text: str, default_port: int | None) -> Authority:
    if "@" in text:
        raise _bad_request("userinfo (user@) is not allowed in the request target")
    try:
        host, raw_port = hosts.split_authority(text)
    except HostError as exc:
        raise _bad_request(f"malformed host in the request target: {exc}") from None
    if not host or host == "[]":
        raise _bad_request("the request target has an empty host")
    if raw_port is None:
        if default_port is None:
            raise _bad_request("CONNECT needs a port: CONNECT host:port")
        return Authority(host, default_port)
    return Authority(host, _target_port(raw_port, connect=default_port is None))


def _port(text: str, where: str) -> int:
    try:
        return hosts.parse_port(text)
    except HostError:
        raise _bad_request(f"bad port in {where}: use a number from 1 to 65535") from None


class BadTargetPortError(HttpError):
    """The request target's port is not 1-65535: a destination the proxy
    denies (bad_port, audited) rather than a malformed message."""

    def __init__(self, connect: bool) -> None:
        super().__init__(400, "bad port in the request target: use a number from 1 to 65535")
        self.connect = connect


def _target_port(text: str, connect: bool) -> int:
    try:
        return hosts.parse_port(text)
    except HostError:
        raise BadTargetPortError(connect) from None


def _build_head(line: _RequestLine, fields: Fields) -> RequestHead:
    """Checks that need the whole head, in a fixed order, then the value."""
    _check_host(line, _values(fields, "host"))
    body = _request_framing(line, fields)
    expect_continue = _expect_continue(line, _values(fields, "expect"))
    connection = _connection_tokens(fields, _bad_request)
    upgrade = _upgrade(line, fields, connection, body)
    return RequestHead(
        method=line.method,
        version=line.version,
        kind=line.kind,
        authority=line.authority,
        body=body,
        expect_continue=expect_continue,
        keep_alive=_keep_alive(line.version, connection, fields),
        target=line.target,
        origin_target=line.origin_target,
        headers=fields,
        connection_tokens=connection,
        upgrade=upgrade,
    )


def _check_host(line: _RequestLine, values: list[str]) -> None:
    # RFC 9112 §3.2: 400 for a missing Host in HTTP/1.1, for more than one,
    # and for an invalid one.
    if len(values) > 1:
        raise _bad_request("more than one Host header")
    if not values:
        # CONNECT names its target in the request line; many tunnelling
        # clients (ssh ProxyCommands, some SDKs) send no Host with it.
        if line.version == HTTP_11 and line.kind is not RequestKind.CONNECT:
            raise _bad_request("an HTTP/1.1 request needs a Host header")
        return
    try:
        raw_host, raw_port = hosts.split_authority(values[0])
    except HostError:
        raise _bad_request("malformed Host header") from None
    port = HTTP_DEFAULT_PORT if raw_port is None else _port(raw_port, "the Host header")
    if line.kind is RequestKind.FORWARD and (
        port != line.authority.port or not _same_host(raw_host, line.authority.host)
    ):
        # An origin that routes by Host would otherwise serve a host that the
        # policy never decided on.
        raise _bad_request("Host header does not match the request target")


def _same_host(left: str, right: str) -> bool:
    if left == right:  # the common case: one spelling, so one normalization
        return True
    try:
        return hosts.normalize_host(left).text == hosts.normalize_host(right).text
    except HostError:
        # Not a valid host: only the same spelling counts, and the decision
        # will refuse it as bad_host anyway.
        return left.lower() == right.lower()


def _request_framing(line: _RequestLine, fields: Fields) -> BodyFraming:
    """Body framing (RFC 9112 §6), refusing every form that hops could read differently."""
    te = _values(fields, "transfer-encoding")
    cl = _values(fields, "content-length")
    if te and cl:
        raise _bad_request("Content-Length together with Transfer-Encoding is refused")
    if te:
        framing = _chunked_request(line, te)
    elif cl:
        framing = BodyFraming(FramingKind.LENGTH, _content_length(cl, _bad_request))
    else:
        framing = NO_BODY
    if line.kind is RequestKind.CONNECT and framing not in (NO_BODY, _EMPTY_BODY):
        # Bytes after a CONNECT head are tunnel data; a body would be ambiguous.
        raise _bad_request("a CONNECT request cannot carry a body")
    return framing


def _chunked_request(line: _RequestLine, te: list[str]) -> BodyFraming:
    if line.version == HTTP_10:
        raise _bad_request("Transfer-Encoding is not allowed in an HTTP/1.0 request")
    if len(te) > 1:
        raise _bad_request("more than one Transfer-Encoding header")
    coding = _transfer_coding(te[0])
    if coding is _Coding.MALFORMED:
        raise _bad_request("Transfer-Encoding must be exactly chunked")
    if coding is _Coding.UNSUPPORTED:
        raise HttpError(HTTPStatus.NOT_IMPLEMENTED, "only Transfer-Encoding: chunked is supported")
    return CHUNKED_BODY


def _expect_continue(line: _RequestLine, values: list[str]) -> bool:
    items = [item.strip(_OWS).lower() for value in values for item in value.split(",")]
    if any(item != "100-continue" for item in items):
        raise HttpError(HTTPStatus.EXPECTATION_FAILED, "only Expect: 100-continue is supported")
    # RFC 9110 §10.1.1: a 100-continue expectation in HTTP/1.0 is ignored.
    return bool(items) and line.version == HTTP_11


def _upgrade(
    line: _RequestLine, fields: Fields, connection: frozenset[str], body: BodyFraming
) -> tuple[str, ...]:
    """The protocols an upgrade request offers (RFC 9110 §7.8), or () for none."""
    if line.kind is not RequestKind.FORWARD or "upgrade" not in connection:
        # Without the `upgrade` option, Upgrade is a stray hop-by-hop field.
        return ()
    if line.version != HTTP_11:
        # RFC 9110 §7.8: a server MUST ignore Upgrade in an HTTP/1.0 request.
        return ()
    protocols = tuple(_list_items(_values(fields, "upgrade")))
    if not protocols:
        return ()
    if not all(_PROTOCOL_RE.fullmatch(p.encode("latin-1")) for p in protocols):
        raise _bad_request("malformed Upgrade header")
    if body not in (NO_BODY, _EMPTY_BODY):
        # After a 101 the next byte belongs to the new protocol: with a body,
        # we and the upstream could disagree on where it starts (smuggling).
        raise _bad_request("an Upgrade request cannot carry a body")
    return protocols


def _keep_alive(version: str, connection: frozenset[str], fields: Fields) -> bool:
    # Old clients send Proxy-Connection; honoring its `close` is always safe.
    proxy_connection = {item.lower() for item in _list_items(_values(fields, "proxy-connection"))}
    if "close" in connection or "close" in proxy_connection:
        return False
    return version == HTTP_11 or "keep-alive" in connection


def proxy_credentials(head: RequestHead) -> tuple[str, str] | None:
    """(user, password) from `Proxy-Authorization: Basic ...` (RFC 7617), else None.

    None also for a malformed or repeated header: the caller answers 407.
    Never log the result or the header.
    """
    values = head.header("proxy-authorization")
    if len(values) != 1:
        return None
    scheme, _, token = values[0].partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(_OWS), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(":")
    # RFC 7617 §2: user-id and password contain no control characters.
    if not colon or any(unicodedata.category(c) == "Cc" for c in decoded):
        return None
    return user, password


# -- builders -------------------------------------------------------------------------------


def forward_head(head: RequestHead, *, keep_alive: bool = False) -> bytes:
    """The request head for the upstream, in origin-form.

    Hop-by-hop fields, fields named in Connection, and every Proxy-* field
    (credentials for us, never for the origin) are dropped; the others keep
    their order. Host stays as the client sent it (it was checked to name the
    target), or is added for an HTTP/1.0 client that sent none.
    `Connection: close` is sent unless `keep_alive`: the forwarder keeps an
    upstream connection only for the next request of the same client
    connection, and only when that request's own decision admits the same
    host, port and address (never shared between client connections). An
    upgrade request sends its own `Upgrade` with `Connection: Upgrade`
    instead: after a 101 the connection carries the new protocol, still to
    the checked target.
    """
    if head.kind is not RequestKind.FORWARD or head.origin_target is None:
        raise ValueError("forward_head is for absolute-form requests, not CONNECT")
    fields = list(_strip_for_next_hop(head.headers, head.connection_tokens))
    if head.body.kind is FramingKind.LENGTH:
        fields = _canonical_length(fields, head.body.length)
    if not head.header("host"):
        fields.insert(0, ("Host", _host_value(head.authority)))
    if head.body.kind is FramingKind.CHUNKED:
        fields.append(("Transfer-Encoding", "chunked"))  # the body reader re-encodes
    if head.upgrade:
        fields.append(("Upgrade", ", ".join(head.upgrade)))
        fields.append(("Connection", "Upgrade"))
    elif not keep_alive:
        fields.append(("Connection", "close"))
    return _serialize(f"{head.method} {head.origin_target} {HTTP_11}", fields)


def _canonical_length(fields: list[tuple[str, str]], length: int) -> list[tuple[str, str]]:
    """One Content-Length, in plain decimal, where the first one was: the parser accepted
    `0005` or `5, 5` as 5, and the next hop must not read them any other way."""
    out: list[tuple[str, str]] = []
    seen = False
    for name, value in fields:
        if name.lower() != "content-length":
            out.append((name, value))
        elif not seen:
            seen = True
            out.append(("Content-Length", str(length)))
    return out


def _host_value(authority: Authority) -> str:
    if authority.port == HTTP_DEFAULT_PORT:
        return authority.host
    return f"{authority.host}:{authority.port}"


def connect_established() -> bytes:
    """The reply that turns a CONNECT connection into a tunnel."""
    return _CONNECT_ESTABLISHED


def sanitize_message(text: str) -> str:
    """One printable line of at most MAX_MESSAGE_CHARS: no CR/LF or other controls."""
    # Bound the work first, then blank every unsafe character and squeeze runs
    # of whitespace, so neither a header nor a second body line can be forged.
    head = text[: MAX_MESSAGE_CHARS * 2]
    cleaned = "".join(" " if unicodedata.category(c) in _UNSAFE_CATEGORIES else c for c in head)
    line = " ".join(cleaned.split())
    if len(line) > MAX_MESSAGE_CHARS or len(text) > len(head):
        line = line[: MAX_MESSAGE_CHARS - 3].rstrip() + "..."
    return line


def error_reply(
    status: int,
    reason_code: str,
    message: str,
    *,
    extra_headers: Sequence[tuple[str, str]] = (),
) -> bytes:
    """A complete error response that also closes the connection.

    `reason_code` is a snake_case code (errors.Reason, or e.g. bad_request);
    `message` is sanitized. `Connection: close` always: after a refusal any
    unread body must never be parsed as a request (DESIGN §3).
    """
    if not 400 <= status <= 599:
        raise ValueError("error_reply is for 4xx and 5xx statuses")
    if not _REASON_CODE_RE.fullmatch(reason_code):
        raise ValueError("reason_code must be a snake_case code")
    body = f"egressbox: {reason_code}: {sanitize_message(message)}\n".encode()
    fields = [
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(body))),
        ("Connection", "close"),
        ("X-Egressbox-Reason", reason_code),
        ("Proxy-Agent", "egressbox"),  # no version: it only helps an attacker
        ("Server", "egressbox"),
    ]
    fields.extend(_checked_extra(name, value) for name, value in extra_headers)
    return _serialize(f"{HTTP_11} {status} {_reason_phrase(status)}", fields) + body


def _checked_extra(name: str, value: str) -> tuple[str, str]:
    reserved = {"content-length", "content-type", "connection", "x-egressbox-reason"}
    if not _TOKEN_RE.fullmatch(name.encode("ascii", "replace")) or name.lower() in reserved:
        raise ValueError("extra header name must be a token and not a framing field")
    if not value.isascii() or _CONTROL_RE.search(value.encode("ascii")):
        raise ValueError("extra header value must be printable ASCII")
    return name, value


def _reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Client Error" if status < 500 else "Server Error"


# -- bodies -----------------------------------------------------------------------------------


def _encode_chunk(data: bytes) -> bytes:
    # Callers never pass b"": an empty chunk would mean the end of the body.
    return b"%x\r\n" % len(data) + data + b"\r\n"


class _ChunkState(enum.Enum):
    SIZE = "size"
    DATA = "data"
    DATA_END = "data_end"
    TRAILERS = "trailers"
    DONE = "done"


class _ChunkedDecoder:
    """Strict chunked decoding (RFC 9112 §7.1) over a shared `_LineBuffer`.

    Data comes out as it arrives. Chunk extensions and trailer fields are
    validated and dropped: extensions mean nothing to us, and the `Trailer`
    header announcing fields is hop-by-hop and not forwarded either.
    """

    def __init__(self, lines: _LineBuffer, fail: Fail) -> None:
        self._lines = lines
        self._fail = fail
        self._state = _ChunkState.SIZE
        self._remaining = 0
        self._trailer_bytes = 0

    @property
    def done(self) -> bool:
        return self._state is _ChunkState.DONE

    def read(self) -> list[bytes]:
        """Decoded data from what the buffer holds; stops at the end of the body."""
        pieces: list[bytes] = []
        while self._state is not _ChunkState.DONE:
            if self._state is _ChunkState.DATA:
                piece = self._lines.take(self._remaining)
                if not piece:
                    break
                pieces.append(piece)
                self._remaining -= len(piece)
                if not self._remaining:
                    self._state = _ChunkState.DATA_END
                continue
            line = self._next_line()
            if line is None:
                break
            self._on_line(line)
        return pieces

    def _next_line(self) -> bytes | None:
        if self._state is _ChunkState.SIZE:
            return self._lines.line(MAX_CHUNK_LINE_BYTES, self._size_line_too_long)
        if self._state is _ChunkState.DATA_END:
            return self._lines.line(2, self._no_crlf_after_data)
        budget = MAX_TRAILER_BYTES - self._trailer_bytes
        return self._lines.line(budget, self._trailers_too_large)

    def _size_line_too_long(self) -> HttpError:
        return self._fail("chunk size line too long")

    def _no_crlf_after_data(self) -> HttpError:
        return self._fail("chunk data must be followed by CRLF")

    def _trailers_too_large(self) -> HttpError:
        return self._fail("trailer section is too large")

    def _on_line(self, line: bytes) -> None:
        if self._state is _ChunkState.SIZE:
            size = self._chunk_size(line)
            self._remaining = size
            self._state = _ChunkState.DATA if size else _ChunkState.TRAILERS
        elif self._state is _ChunkState.DATA_END:
            if line:  # unreachable: a 2-byte budget leaves room for CRLF only
                raise self._fail("chunk data must be followed by CRLF")
            self._state = _ChunkState.SIZE
        elif line:
            _parse_field_line(line, self._fail)  # validated, then dropped
            self._trailer_bytes += len(line) + 2
        else:
            self._state = _ChunkState.DONE

    def _chunk_size(self, line: bytes) -> int:
        match = _CHUNK_LINE_RE.fullmatch(line)
        if match is None:
            raise self._fail("malformed chunk size line")
        digits = match.group(1)
        if len(digits) > MAX_CHUNK_SIZE_DIGITS:
            raise self._fail("chunk size is too large")
        return int(digits, 16)


class RequestBodyReader:
    """The client's request body after the head, re-framed for the upstream.

    `feed` returns the bytes to send upstream: a Content-Length body passes
    through unchanged (it is exactly `length` bytes), a chunked body is
    decoded and re-encoded canonically. Once `done`, `trailing` holds every
    byte fed beyond the body (a pipelined request: give it to a new
    `RequestHeadParser`); bytes fed after that are appended to it.
    """

    def __init__(self, framing: BodyFraming) -> None:
        self._framing = framing
        self._remaining = framing.length
        self._lines = _LineBuffer(_bad_request)
        self._chunks = _ChunkedDecoder(self._lines, _bad_request)
        self._done = framing.kind is FramingKind.NONE or (
            framing.kind is FramingKind.LENGTH and not framing.length
        )
        self._trailing = bytearray()
        self._error: HttpError | None = None

    @property
    def done(self) -> bool:
        return self._done

    @property
    def trailing(self) -> bytes:
        return bytes(self._trailing)

    def feed(self, data: bytes) -> bytes:
        if self._error is not None:
            raise self._error
        if self._done:
            self._trailing += data
            return b""
        if self._framing.kind is FramingKind.LENGTH:
            return self._feed_length(data)
        try:
            return self._feed_chunked(data)
        except HttpError as exc:
            self._error = exc
            raise

    def feed_eof(self) -> None:
        """The client closed its side; a body cut short is an error."""
        if not self._done:
            raise _bad_request("the connection closed before the end of the request body")

    def _feed_length(self, data: bytes) -> bytes:
        body = data[: self._remaining]
        self._remaining -= len(body)
        if not self._remaining:
            self._done = True
            self._trailing += data[len(body) :]
        return body

    def _feed_chunked(self, data: bytes) -> bytes:
        self._lines.extend(data)
        out = b"".join(_encode_chunk(piece) for piece in self._chunks.read())
        if self._chunks.done:
            self._done = True
            self._trailing += self._lines.take()
            out += _LAST_CHUNK
        return out


# -- responses --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InformationalResponse:
    """A 1xx from the upstream; `data` is empty when it must not reach the client."""

    status: int
    data: bytes


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The final response head, re-serialized for the client in `data`."""

    status: int
    reason: str
    headers: Fields
    data: bytes
    keep_alive: bool


@dataclass(frozen=True, slots=True)
class BodyData:
    """Body bytes already framed for the client."""

    data: bytes


@dataclass(frozen=True, slots=True)
class EndOfMessage:
    """The response is complete; `data` finishes its framing (maybe empty).

    `keep_alive`: whether the client connection may carry another request,
    as far as this response goes. The glue must also close if the request
    body was not read to its end.
    """

    data: bytes
    keep_alive: bool


@dataclass(frozen=True, slots=True)
class Upgraded:
    """A 101 Switching Protocols answered the upgrade request; the framer is done.

    `data` is the 101 head for the client, re-serialized with the upstream's
    `Upgrade` and `Connection: Upgrade`. From here on both sides speak the new
    protocol: relay raw bytes both ways, starting with `ResponseFramer.trailing`
    to the client, and never parse that connection as HTTP again.
    """

    headers: Fields
    data: bytes


ResponseEvent = InformationalResponse | ResponseHead | BodyData | EndOfMessage | Upgraded


class _UpstreamBody(enum.Enum):
    NONE = "none"
    LENGTH = "length"
    CHUNKED = "chunked"
    CLOSE = "close"  # delimited by the upstream closing the connection


class _Phase(enum.Enum):
    HEAD = "head"
    BODY = "body"
    DONE = "done"
    UPGRADED = "upgraded"  # after a 101: every byte is the new protocol's


@dataclass(frozen=True, slots=True)
class _StatusLine:
    version: str
    status: int
    reason: str


class ResponseFramer:
    """Frame the upstream's response to one FORWARD request for the client.

    Feed upstream bytes to `feed` (and `feed_eof` when the upstream closes);
    write each event's `.data` to the client in order. Nothing is buffered
    beyond one line. Bodies go out with a Content-Length, as chunks we encode,
    or (to an HTTP/1.0 client) delimited by closing the client connection.
    Bytes after the end of the response are dropped: the upstream connection
    serves one request only. `UpstreamResponseError` means 502 if no
    `ResponseHead` was written yet; after that, only closing is left.

    To an upgrade request (`RequestHead.upgrade`), a 101 naming an offered
    protocol ends in `Upgraded`; then `trailing` holds the bytes after the 101
    head, and bytes fed later are appended to it. A 101 to any other request
    is refused; any other final response is framed as usual and ends the
    client connection (`keep_alive` is False).
    """

    def __init__(self, request: RequestHead, max_head_bytes: int = limits.MAX_HEAD_BYTES) -> None:
        if request.kind is not RequestKind.FORWARD:
            raise ValueError("a CONNECT response is not framed: the tunnel relays bytes")
        self._request = request
        self._max_head_bytes = max_head_bytes
        self._lines = _LineBuffer(UpstreamResponseError)
        self._chunks = _ChunkedDecoder(self._lines, UpstreamResponseError)
        self._phase = _Phase.HEAD
        self._head_start = 0
        self._status: _StatusLine | None = None
        self._fields: list[tuple[str, str]] = []
        self._informational = 0
        self._body = _UpstreamBody.NONE
        self._remaining = 0
        self._chunk_to_client = False
        self._keep_alive = False
        self._persistent = False  # the upstream may carry another request after this one
        self._extra = False  # bytes came after the end of the response
        self._trailing = bytearray()
        self._error: HttpError | None = None

    @property
    def trailing(self) -> bytes:
        """After `Upgraded`: the upstream's bytes after the 101 head (else empty)."""
        return bytes(self._trailing)

    @property
    def reusable(self) -> bool:
        """The response ended cleanly and the upstream connection may carry another request.

        Only an HTTP/1.1 response without `Connection: close`, framed by its
        length or by chunks (never by the close), with not one byte after its
        end: a stray byte would be read as the next response's start.
        """
        return (
            self._phase is _Phase.DONE
            and self._persistent
            and not self._extra
            and not self._lines.available
        )

    def feed(self, data: bytes) -> list[ResponseEvent]:
        if self._error is not None:
            raise self._error
        if self._phase is _Phase.UPGRADED:
            self._trailing += data
            return []
        if self._phase is _Phase.DONE:
            self._extra = self._extra or bool(data)
            return []
        if (
            self._phase is _Phase.HEAD
            and self._status is None
            and not self._lines.available
            and type(data) is bytes
        ):
            return self._guarded(lambda: self._whole_head(data))
        self._lines.extend(data)
        return self._guarded(self._advance)

    def _whole_head(self, data: bytes) -> list[ResponseEvent]:
        """Fast path: a whole head at the start of a feed, split at once instead of line by line.

        Taken only when the line path would see the same lines (every line ends
        in CRLF, no bare CR or LF, the head fits the limit); the same checks run
        in the same order, so the events or the error are the same.
        """
        end = data.find(b"\r\n\r\n")
        budget = self._max_head_bytes - (self._lines.consumed - self._head_start)
        breaks = data.count(b"\r\n", 0, end)
        if (
            end <= 0
            or end + 4 > budget
            or data.count(b"\r", 0, end) != breaks
            or data.count(b"\n", 0, end) != breaks
        ):
            self._lines.extend(data)
            return self._advance()
        line_end = data.find(b"\r\n", 0, end + 2)
        status = _parse_status_line(data[:line_end])
        fields = _plain_fields(data, line_end + 2, end + 2) if line_end < end else ()
        if fields is None:
            lines = data[line_end + 2 : end].split(b"\r\n")
            fields = tuple(_parse_field_line(line, UpstreamResponseError) for line in lines)
        self._lines.consumed += end + 4
        self._lines.extend(data[end + 4 :])
        event = self._complete_head(status, fields)
        return [event, *self._advance()]

    def feed_eof(self) -> list[ResponseEvent]:
        """The upstream closed: ends a close-delimited body, else it was cut short."""
        if self._error is not None:
            raise self._error
        if self._phase in (_Phase.DONE, _Phase.UPGRADED):
            return []
        return self._guarded(self._on_eof)

    def _guarded(self, step: Callable[[], list[ResponseEvent]]) -> list[ResponseEvent]:
        try:
            return step()
        except HttpError as exc:
            self._error = exc
            raise

    def _on_eof(self) -> list[ResponseEvent]:
        if self._phase is _Phase.BODY and self._body is _UpstreamBody.CLOSE:
            return [self._end()]
        raise UpstreamResponseError("the upstream closed before the response was complete")

    def _advance(self) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        while self._phase is _Phase.HEAD:
            event = self._read_head()
            if event is None:
                return events
            events.append(event)
        if self._phase is _Phase.BODY:
            events.extend(self._read_body())
        return events

    def _read_head(self) -> ResponseEvent | None:
        while True:
            budget = self._max_head_bytes - (self._lines.consumed - self._head_start)
            line = self._lines.line(budget, self._response_head_too_long)
            if line is None:
                return None
            if self._status is None:
                self._status = _parse_status_line(line)
            elif line:
                self._fields.append(_parse_field_line(line, UpstreamResponseError))
            else:
                return self._complete_head(self._status, tuple(self._fields))

    def _response_head_too_long(self) -> HttpError:
        return UpstreamResponseError(f"response head is larger than {self._max_head_bytes} bytes")

    def _complete_head(self, status: _StatusLine, fields: Fields) -> ResponseEvent:
        self._status = None
        self._fields = []
        self._head_start = self._lines.consumed
        if status.status == HTTPStatus.SWITCHING_PROTOCOLS:
            return self._upgraded(status, fields)
        if status.status < 200:
            return self._informational_event(status, fields)
        return self._final_head(status, fields)

    def _upgraded(self, status: _StatusLine, fields: Fields) -> Upgraded:
        offered = {_protocol_name(p) for p in self._request.upgrade}
        if not offered:
            raise UpstreamResponseError("101 Switching Protocols to a request that asked for none")
        if status.version != HTTP_11:
            raise UpstreamResponseError("101 Switching Protocols in an HTTP/1.0 response")
        # The framing fields are checked as on any response, then dropped:
        # a 101 has no body (RFC 9110 §15.2), the new protocol follows at once.
        _response_framing(self._request, status, fields)
        protocols = _list_items(_values(fields, "upgrade"))
        if not protocols:
            raise UpstreamResponseError("101 Switching Protocols without an Upgrade header")
        if not all(_PROTOCOL_RE.fullmatch(p.encode("latin-1")) for p in protocols):
            raise UpstreamResponseError("malformed Upgrade header in a 101 response")
        # RFC 9110 §7.8: a server MUST NOT switch to a protocol not offered.
        if not {_protocol_name(p) for p in protocols} <= offered:
            raise UpstreamResponseError(
                "101 Switching Protocols to a protocol that was not offered"
            )
        kept = [
            item
            for item in _strip_for_next_hop(fields, _connection_tokens(fields, None))
            if item[0].lower() != "content-length"
        ]
        kept.extend([("Upgrade", ", ".join(protocols)), ("Connection", "Upgrade")])
        self._phase = _Phase.UPGRADED
        self._trailing += self._lines.take()
        return Upgraded(tuple(kept), _serialize(_status_text(status), kept))

    def _informational_event(self, status: _StatusLine, fields: Fields) -> InformationalResponse:
        self._informational += 1
        if self._informational > MAX_INFORMATIONAL_RESPONSES:
            raise UpstreamResponseError("too many 1xx responses")
        # A 1xx has no body (RFC 9112 §6.3) and must carry no framing field
        # (RFC 9110 §8.6, RFC 9112 §6.1), but a malformed one is refused as on
        # any response: a lenient client behind us could still read it.
        _response_framing(self._request, status, fields)
        # RFC 9110 §15.2: no 1xx to an HTTP/1.0 client. A 100 goes only to a
        # client that asked for it: some clients take an unexpected one for
        # the final answer.
        relay = self._request.version == HTTP_11 and (
            status.status != HTTPStatus.CONTINUE or self._request.expect_continue
        )
        if not relay:
            return InformationalResponse(status.status, b"")
        kept = [
            item
            for item in _strip_for_next_hop(fields, _connection_tokens(fields, None))
            if item[0].lower() != "content-length"
        ]
        return InformationalResponse(status.status, _serialize(_status_text(status), kept))

    def _final_head(self, status: _StatusLine, fields: Fields) -> ResponseHead:
        self._body, self._remaining, length = _response_framing(self._request, status, fields)
        tokens = _connection_tokens(fields, None)
        self._persistent = (
            status.version == HTTP_11
            and "close" not in tokens
            and self._body is not _UpstreamBody.CLOSE
        )
        client_11 = self._request.version == HTTP_11
        unsized = self._body in (_UpstreamBody.CHUNKED, _UpstreamBody.CLOSE)
        self._chunk_to_client = unsized and client_11
        # An HTTP/1.0 client learns where an unsized body ends only by the close,
        # and a client that asked for an upgrade gets none: its connection ends.
        self._keep_alive = (
            self._request.keep_alive and not self._request.upgrade and (client_11 or not unsized)
        )
        kept = [
            item
            for item in _strip_for_next_hop(fields, tokens)
            if item[0].lower() != "content-length"
        ]
        kept.extend(self._framing_fields(length, client_11))
        self._phase = _Phase.BODY
        data = _serialize(_status_text(status), kept)
        return ResponseHead(status.status, status.reason, tuple(kept), data, self._keep_alive)

    def _framing_fields(self, length: int | None, client_11: bool) -> list[tuple[str, str]]:
        framing: list[tuple[str, str]] = []
        if self._chunk_to_client:
            framing.append(("Transfer-Encoding", "chunked"))
        elif length is not None:
            framing.append(("Content-Length", str(length)))
        if not self._keep_alive:
            framing.append(("Connection", "close"))
        elif not client_11:
            framing.append(("Connection", "keep-alive"))  # HTTP/1.0 closes by default
        return framing

    def _read_body(self) -> list[ResponseEvent]:
        if self._body is _UpstreamBody.CHUNKED:
            pieces = self._chunks.read()
            finished = self._chunks.done
        elif self._body is _UpstreamBody.LENGTH:
            pieces = [self._lines.take(self._remaining)]
            self._remaining -= len(pieces[0])
            finished = not self._remaining
        else:
            pieces = [self._lines.take()] if self._body is _UpstreamBody.CLOSE else []
            finished = self._body is _UpstreamBody.NONE
        events: list[ResponseEvent] = [BodyData(self._for_client(p)) for p in pieces if p]
        if finished:
            events.append(self._end())
        return events

    def _for_client(self, piece: bytes) -> bytes:
        return _encode_chunk(piece) if self._chunk_to_client else piece

    def _end(self) -> EndOfMessage:
        self._phase = _Phase.DONE
        return EndOfMessage(_LAST_CHUNK if self._chunk_to_client else b"", self._keep_alive)


def _parse_status_line(line: bytes) -> _StatusLine:
    match = _STATUS_LINE_RE.fullmatch(line)
    if match is None:
        raise UpstreamResponseError("malformed status line from the upstream")
    version, status, reason = match.groups()
    return _StatusLine(version.decode("ascii"), int(status), (reason or b"").decode("latin-1"))


def _protocol_name(protocol: str) -> str:
    """The name part of `name/version`, lower-cased (names are case-insensitive)."""
    return protocol.partition("/")[0].lower()


def _status_text(status: _StatusLine) -> str:
    return f"{HTTP_11} {status.status} {status.reason}"


def _response_framing(
    request: RequestHead, status: _StatusLine, fields: Fields
) -> tuple[_UpstreamBody, int, int | None]:
    """(body kind, bytes to read, Content-Length to show), per RFC 9112 §6.3.

    The framing fields are checked even when the status means no body, so a
    malformed response is refused the same way whatever the request was.
    """
    te = _values(fields, "transfer-encoding")
    cl = _values(fields, "content-length")
    if te and cl:
        raise UpstreamResponseError("the upstream sent both Content-Length and Transfer-Encoding")
    if te:
        _check_response_te(status, te)
    length = _content_length(cl, UpstreamResponseError) if cl else None
    if request.method == "HEAD" or status.status in (
        HTTPStatus.NO_CONTENT,
        HTTPStatus.NOT_MODIFIED,
    ):
        # No body; a Content-Length describes the representation (HEAD, 304)
        # and is kept, but RFC 9110 §8.6 forbids it on a 204.
        shown = None if status.status == HTTPStatus.NO_CONTENT else length
        return _UpstreamBody.NONE, 0, shown
    if te:
        return _UpstreamBody.CHUNKED, 0, None
    if length is not None:
        return _UpstreamBody.LENGTH, length, length
    return _UpstreamBody.CLOSE, 0, None


def _check_response_te(status: _StatusLine, te: list[str]) -> None:
    if len(te) > 1:
        raise UpstreamResponseError("the upstream sent more than one Transfer-Encoding header")
    if status.version == HTTP_10:
        # RFC 9112 §6.1: Transfer-Encoding in HTTP/1.0 means faulty framing.
        raise UpstreamResponseError("Transfer-Encoding in an HTTP/1.0 response")
    if _transfer_coding(te[0]) is not _Coding.CHUNKED:
        raise UpstreamResponseError("the upstream used a Transfer-Encoding other than chunked")
