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

One grammar, one path, whatever the chunking: `_LineBuffer` frames the bytes and
only looks for where lines and heads end (refusing a bare CR or LF in a line or head
not yet complete, and a line or head over the limit, as soon as it sees them); a
head's start line is read as soon as it is complete (`_request_line`, `_status_line`),
its field lines once the empty line has come (`_field_lines`, also for a chunked
body's trailers). Their regular expressions are the grammar, and admit no CR or LF but
the CRLF that ends a line: a bare one in a complete line or head is refused by them,
in the same feed. The reason given for a refusal is worked out only after a line was
refused (`_bare_fault` first: a bare CR or LF is named as such).

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
from typing import Final, NamedTuple

from egressbox.core import hosts, limits
from egressbox.core.errors import EgressboxError, HostError

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_STATUS_BAD_GATEWAY: Final = HTTPStatus.BAD_GATEWAY
_STATUS_BAD_REQUEST: Final = HTTPStatus.BAD_REQUEST
_STATUS_CONTINUE: Final = HTTPStatus.CONTINUE
_STATUS_EXPECTATION_FAILED: Final = HTTPStatus.EXPECTATION_FAILED
_STATUS_HTTP_VERSION_NOT_SUPPORTED: Final = HTTPStatus.HTTP_VERSION_NOT_SUPPORTED
_STATUS_NOT_IMPLEMENTED: Final = HTTPStatus.NOT_IMPLEMENTED
_STATUS_NO_CONTENT: Final = HTTPStatus.NO_CONTENT
_STATUS_REQUEST_HEADER_FIELDS_TOO_LARGE: Final = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
_STATUS_REQUEST_URI_TOO_LONG: Final = HTTPStatus.REQUEST_URI_TOO_LONG
_STATUS_SWITCHING_PROTOCOLS: Final = HTTPStatus.SWITCHING_PROTOCOLS

# -- limits (each with where its value came from) ---------------------------------

# RFC 9112 §2.2: a server SHOULD ignore at least one empty line before the
# request line (some clients send CRLF after a POST body). A few are skipped;
# an endless stream of them is not a request.
MAX_LEADING_EMPTY_LINES = 4
# Apache's LimitRequestFields default; real clients send a few dozen fields.
MAX_HEADER_FIELDS: Final = 100
# 18 decimal digits always fit a signed 64-bit integer, so every hop behind
# us reads the same number we do (a longer one could wrap or saturate in C).
MAX_CONTENT_LENGTH_DIGITS: Final = 18
# 16 hex digits: chunks up to 2**64-1 bytes. Longer (zero-padded) sizes are
# refused instead of trusting every other hop to read them alike.
MAX_CHUNK_SIZE_DIGITS: Final = 16
# A chunk-size line with its extensions, which we drop; nobody uses them in
# practice, so 4 KiB is generous and bounds what we buffer for one line.
MAX_CHUNK_LINE_BYTES: Final = 4096
# A trailer section is a header section, so it gets the head's budget.
MAX_TRAILER_BYTES: Final = limits.MAX_HEAD_BYTES
# 1xx responses before the final one (103 Early Hints, 102 Processing); more
# is a misbehaving upstream, not a reason to keep reading forever.
MAX_INFORMATIONAL_RESPONSES: Final = 16
# An error reply's message is one short line for a human; anything longer is
# only room for reflecting attacker-chosen text.
MAX_MESSAGE_CHARS = 200

HTTP_10: Final = "HTTP/1.0"
HTTP_11: Final = "HTTP/1.1"
# Every http:// URL without a port means port 80 (RFC 9110 §4.2.1), and so
# does every ws:// URL (RFC 6455 §3).
HTTP_DEFAULT_PORT: Final = 80
HTTPS_DEFAULT_PORT: Final = 443  # a terminated connection's scheme (proxy/terminate.py)
# Absolute-form schemes forwarded in plain text; the TLS ones need CONNECT.
_PLAIN_SCHEMES: Final = frozenset({"http", "ws"})
_TLS_SCHEMES: Final = frozenset({"https", "wss"})

# The grammar, as regular expressions over heads decoded as Latin-1 (one character per
# byte, so encoding a value back gives the exact bytes). tchar (RFC 9110 §5.6.2):
_TCHAR = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_TOKEN_RE: Final = re.compile(rf"{_TCHAR}+")
# protocol = protocol-name ["/" protocol-version], both tokens (RFC 9110 §7.8).
_PROTOCOL_RE: Final = re.compile(rf"{_TCHAR}+(?:/{_TCHAR}+)?")
# CTLs other than HTAB, which field values may hold (RFC 9110 §5.5).
_CONTROL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# request-line = method SP request-target SP HTTP-version (RFC 9112 §3), single spaces;
# the target is visible ASCII, and its form (authority or absolute) is read by
# `_interpret_target`. Only HTTP/1.1 and 1.0. (`++`, possessive: a repeat here never
# gives back a character to what follows it, which no character of its set can start;
# the engine then keeps no state to backtrack with.)
_REQUEST_LINE_RE: Final = re.compile(rf"{_TCHAR}++ [!-~]++ HTTP/1\.[01]")
# field-line = field-name ":" OWS field-value OWS (RFC 9112 §5): no whitespace before
# the colon, none at the start (obs-fold), no control character but HTAB in the value
# (written as the characters allowed: in a Latin-1 text every one is at most \xff, and
# the regex engine tests this set faster than its complement).
_FIELD_LINE = rf"({_TCHAR}++):([\t\x20-\x7e\x80-\xff]*+)"
_FIELD_LINE_RE = re.compile(_FIELD_LINE)
# Every field line of a block at once: a match can only start at a line's start and
# ends at its CRLF, so a block is valid when there are as many matches as lines.
_FIELD_LINES_RE: Final = re.compile(rf"(?m)^{_FIELD_LINE}\r\n")
# status-line; a missing SP before an empty reason is tolerated (seen in the wild).
_STATUS_LINE_RE: Final = re.compile(
    r"(HTTP/1\.[01]) ([1-5][0-9][0-9])(?: ([\t\x20-\x7e\x80-\xff]*))?"
)
_VERSION_RE = re.compile(r"HTTP/[0-9]+(?:\.[0-9]+)?")
_SCHEME_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*+://")
# chunk-size, then optional extensions: printable, since we drop them anyway.
_CHUNK_LINE_RE: Final = re.compile(rb"([0-9A-Fa-f]+)(?:[ \t]*;[\t\x20-\x7e\x80-\xff]*)?")
_REASON_CODE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
# Framing: a CR not followed by LF, or an LF not after a CR (in bytes, and in a text).
_BARE_CR_OR_LF_RE = re.compile(rb"\r(?!\n)|(?<!\r)\n")
_BARE_CR_OR_LF_TEXT_RE = re.compile(r"\r(?!\n)|(?<!\r)\n")
_CR: Final = 0x0D
_LF: Final = 0x0A
_OWS: Final = " \t"

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
# A response head we pass on loses its Content-Length too: we write our own framing.
_HOP_BY_HOP_AND_LENGTH: Final = _HOP_BY_HOP | {"content-length"}
# A forwarded request loses the client's Host: forward_head writes the decided one.
_HOP_BY_HOP_AND_HOST: Final = _HOP_BY_HOP | {"host"}
# A client could name these in `Connection:` to make us drop them, and so
# strip the framing of a body it still sends (smuggling): never drop them.
_NEVER_DROPPED: Final = frozenset({"host", "content-length", "transfer-encoding"})
# Unicode categories removed from reply messages: controls (CR, LF, C1),
# format characters (bidi overrides), line/paragraph separators, surrogates.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})

# RFC 9110 §15.3.5, §15.4.5: these responses never have a body.
_NO_BODY_STATUSES: Final = frozenset({HTTPStatus.NO_CONTENT, HTTPStatus.NOT_MODIFIED})

_LAST_CHUNK: Final = b"0\r\n\r\n"
_CONNECT_ESTABLISHED: Final = b"HTTP/1.1 200 Connection established\r\n\r\n"

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
        super().__init__(_STATUS_BAD_GATEWAY, message)


def _bad_request(message: str) -> HttpError:
    return HttpError(_STATUS_BAD_REQUEST, message)


Fail = Callable[[str], HttpError]

# -- values -------------------------------------------------------------------------------


class RequestKind(enum.Enum):
    CONNECT = "connect"  # authority-form: open a tunnel
    FORWARD = "forward"  # absolute-form http:// or ws:// URL: forward one request


# RequestKind's members, bound once (the rule at the top).
_REQUEST_KIND_CONNECT: Final = RequestKind.CONNECT
_REQUEST_KIND_FORWARD: Final = RequestKind.FORWARD


class FramingKind(enum.Enum):
    NONE = "none"
    LENGTH = "length"
    CHUNKED = "chunked"


# FramingKind's members, bound once (the rule at the top).
_FRAMING_KIND_CHUNKED: Final = FramingKind.CHUNKED
_FRAMING_KIND_LENGTH: Final = FramingKind.LENGTH
_FRAMING_KIND_NONE: Final = FramingKind.NONE


@dataclass(frozen=True, slots=True)
class BodyFraming:
    """How a request body is delimited: no body, `length` bytes, or chunked."""

    kind: FramingKind
    length: int = 0


NO_BODY: Final = BodyFraming(FramingKind.NONE)
CHUNKED_BODY: Final = BodyFraming(FramingKind.CHUNKED)


class Authority(NamedTuple):
    """Host and port of the request target.

    `host` is the text as the client wrote it (brackets kept around IPv6): it
    is NOT normalized here. Pass it to `hosts.normalize_host` (the decision
    does) before comparing it with anything.
    """

    host: str
    port: int


Fields = tuple[tuple[str, str], ...]
# Every value of each lower-cased field name in _INDEXED, in order. Read only: the
# lists are shared.
_Index = dict[str, list[str]]


@dataclass(frozen=True, slots=True, init=False)
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
    # The field index of `headers` (see _index), built once by the parser that read
    # them; for a head built from rewritten fields, by its first header() call.
    _index: _Index | None = field(default=None, init=False, repr=False, compare=False)

    def __init__(  # noqa: PLR0917 - the dataclass's own signature, fields in order
        self,
        method: str,
        version: str,
        kind: RequestKind,
        authority: Authority,
        body: BodyFraming,
        expect_continue: bool,
        keep_alive: bool,
        target: str,
        origin_target: str | None,
        headers: Fields,
        connection_tokens: frozenset[str],
        upgrade: tuple[str, ...] = (),
        index: _Index | None = None,
    ) -> None:
        # The generated __init__ of a frozen dataclass is interpreted Python that calls
        # object.__setattr__ per field (~2 us a head); compiled, each call below is one
        # store into the object. Still frozen: assigning a field later raises.
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "authority", authority)
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "expect_continue", expect_continue)
        object.__setattr__(self, "keep_alive", keep_alive)
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "origin_target", origin_target)
        object.__setattr__(self, "headers", headers)
        object.__setattr__(self, "connection_tokens", connection_tokens)
        object.__setattr__(self, "upgrade", upgrade)
        object.__setattr__(self, "_index", index)

    @property
    def host(self) -> str:
        return self.authority.host

    @property
    def port(self) -> int:
        return self.authority.port

    def header(self, name: str) -> list[str]:
        """Every value of the header `name` (case-insensitive), in order."""
        key = name.lower()
        if key not in _INDEXED:
            return [value for other, value in self.headers if other.lower() == key]
        index = self._index
        if index is None:  # a head built from rewritten fields: indexed once, when first asked
            index = _index(self.headers)
            object.__setattr__(self, "_index", index)
        return list(index.get(key, _NONE))


# The names that this module's checks and builders ask an index for. Only these are
# indexed: most fields of a head are none of them (User-Agent, Accept, Cookie ...),
# and `_values` finds any other name by a scan of the fields.
_INDEXED: Final = frozenset(
    {
        "connection",
        "content-length",
        "expect",
        "host",
        "proxy-authorization",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
    }
)
# What a name absent from an index gives; never mutated.
_NONE: Final[list[str]] = []


def _index(fields: Fields) -> _Index:
    """The field index of a head: its checks ask for seven or more names, and one pass
    that indexes every field beats a scan per name. Built once per head by whoever
    parsed it, and handed along with it (a request keeps its own)."""
    index: _Index = {}
    for name, value in fields:
        key = name.lower()
        if key not in _INDEXED:
            continue
        values = index.get(key)
        if values is None:
            index[key] = [value]
        else:
            values.append(value)
    return index


# -- framing: heads and lines ------------------------------------------------------------


class _LineBuffer:
    """Received bytes not yet consumed, handed out as whole heads, CRLF lines or raw runs.

    Framing only, no grammar: a head is the lines before the first empty line, a line
    ends in CRLF, and a CR not followed by LF or an LF without a CR is refused as soon
    as it is seen: here while its line or head is incomplete, and in a complete `line`;
    in a complete start line or head, which the grammar reads at once, by that grammar
    (it admits no CR or LF but a line's CRLF, so checking here first would only repeat
    its pass). Every verdict depends only on the bytes seen, never on how they were
    split across feeds, and a scan resumes where the last one stopped, so each byte is
    looked at a bounded number of times even when bytes arrive one at a time.
    """

    def __init__(self, fail: Fail) -> None:
        self._buf: bytes | bytearray = b""
        self._pos = 0
        # Bytes after _pos known to hold no bare CR or LF and no terminator (or after
        # `first_line`, that line, whose grammar is read next); never ending in a CR,
        # whose LF may be the next byte.
        self._scanned = 0
        self._fail = fail

    @property
    def available(self) -> int:
        return len(self._buf) - self._pos

    def extend(self, data: bytes) -> None:
        buf = self._buf
        if self._pos >= len(buf):
            # Nothing unread (the common case: a whole head in one read): keep the
            # bytes as they came, without a copy.
            self._buf = data if type(data) is bytes else bytes(data)
            self._pos = 0
        elif isinstance(buf, bytearray):
            if self._pos:
                del buf[: self._pos]  # keep only what is still unread
                self._pos = 0
            buf.extend(data)
        else:
            self._buf = bytearray(buf[self._pos :]) + data
            self._pos = 0

    def head(self, budget: int, too_long: Callable[[bool], HttpError]) -> bytes | None:
        """The next head: its lines before the first empty line, each with its CRLF
        (b"" when the first line is empty), consumed with that empty line; None until
        the empty line has arrived.

        The head with its empty line must fit in `budget` bytes, else
        `too_long(first_line_ended)` is raised (a factory: the error is only built when
        it is raised). A bare CR or LF in the head is left to `_field_lines`, which
        every head is read by next.
        """
        buf, pos = self._buf, self._pos
        stop = min(len(buf), pos + budget)
        start = pos + self._scanned
        if start == pos and buf.startswith(b"\r\n", pos, stop):
            self._advance(pos + 2)
            return b""
        # A terminator may begin in bytes already scanned and end in new ones.
        found = buf.find(b"\r\n\r\n", max(start - 3, pos), stop)
        if found < 0:
            self._wait(start, stop, budget, too_long)
            return None
        head = self._bytes(pos, found + 2)
        self._advance(found + 4)
        return head

    def line(self, budget: int, too_long: Callable[[bool], HttpError]) -> bytes | None:
        """The next line without its CRLF, or None until it has arrived.

        The line with its CRLF must fit in `budget` bytes, else `too_long(False)` is raised.
        """
        end = self._line_end(budget, too_long)
        if end < 0:
            return None
        start = self._pos + self._scanned
        buf = self._buf
        if buf.find(b"\r", start, end) >= 0 or buf.find(b"\n", start, end) >= 0:
            # Before the first CRLF, any CR or LF is a bare one: say which (none is the
            # common case, which needs no count of CRs, LFs and CRLFs).
            self._refuse_bare_among_crlf(start, end + 2)
        line = self._bytes(self._pos, end)
        self._advance(end + 2)
        return line

    def first_line(self, budget: int, too_long: Callable[[bool], HttpError]) -> bytes | None:
        """Like `line`, but the line stays unread: a head's start line, to be read as
        soon as it is complete. Call `head` next (its scan goes on after this line).
        A bare CR or LF in the line is left to the start line's grammar, read next."""
        end = self._line_end(budget, too_long)
        if end < 0:
            return None
        self._scanned = end + 2 - self._pos
        return self._bytes(self._pos, end)

    def _line_end(self, budget: int, too_long: Callable[[bool], HttpError]) -> int:
        """Where the next line's CRLF starts, or -1 until it has arrived."""
        buf, pos = self._buf, self._pos
        stop = min(len(buf), pos + budget)
        start = pos + self._scanned
        found = buf.find(b"\r\n", start, stop)
        if found < 0:
            self._wait(start, stop, budget, too_long)
        return found

    def _bytes(self, start: int, end: int) -> bytes:
        buf = self._buf
        if isinstance(buf, bytes):
            return buf[start:end]  # compiled, a native slice (bytes(...) is a call)
        return bytes(buf[start:end])

    def _wait(
        self, start: int, stop: int, budget: int, too_long: Callable[[bool], HttpError]
    ) -> None:
        """No terminator up to `stop`: refuse a bare CR or LF, or a run that fills the
        budget without one (`too_long(True)` if a line ended within it); else remember
        how far the bytes are clean."""
        self._refuse_bare(start, stop)
        if stop - self._pos >= budget:
            raise too_long(self._buf.find(b"\r\n", self._pos, stop) >= 0)
        # A CR at the end may be the start of a CRLF: look at it again with the next byte.
        back = 1 if stop > start and self._buf[stop - 1] == _CR else 0
        self._scanned = stop - back - self._pos

    def _refuse_bare(self, start: int, end: int) -> None:
        """Refuse a CR not followed by LF, or an LF not after a CR, in buf[start:end];
        a CR that is the last byte there is left alone (its LF may come next).

        `start` is where a line starts or where the scan stopped (never just after
        a CR), so an LF there is bare whatever byte came before it.
        """
        buf = self._buf
        if buf.find(b"\n", start, end) < 0 and buf.find(b"\r", start, end) < 0:
            return  # not one CR or LF: the common case for bytes that arrive few at a time
        self._refuse_bare_among_crlf(start, end)

    def _refuse_bare_among_crlf(self, start: int, end: int) -> None:
        """`_refuse_bare` for bytes that hold a CRLF (a line's end): the test for no CR
        or LF at all could only fail there."""
        buf = self._buf
        crlf = buf.count(b"\r\n", start, end)
        if buf.count(b"\r", start, end) == crlf and buf.count(b"\n", start, end) == crlf:
            return  # every CR and every LF is in a CRLF
        found = _BARE_CR_OR_LF_RE.search(buf, start, end)
        if buf[start] == _LF or (found is not None and buf[found.start()] == _LF):
            raise self._fail("a line ends in a bare LF; lines must end in CRLF")
        if found is not None and found.start() + 1 < end:
            raise self._fail("a bare CR inside a line is not allowed")

    def take(self, limit: int | None = None) -> bytes:
        """Up to `limit` (default: all) of the unread bytes, as they are."""
        count = self.available if limit is None else min(limit, self.available)
        pos = self._pos
        # Nothing after a head is the common case: no slice to make then.
        data = self._bytes(pos, pos + count) if count else b""
        self._advance(pos + count)
        return data

    def _advance(self, pos: int) -> None:
        self._pos = pos
        self._scanned = 0


# -- field lines ------------------------------------------------------------------------------


def _field_lines(text: str, start: int, fail: Fail, max_fields: int | None) -> Fields:
    """The field lines of text[start:], each ending in CRLF, read by the one field-line
    grammar (`_FIELD_LINES_RE`): (name, value) in order, the value without surrounding
    OWS. More than `max_fields` is refused with 431 (counted in order: a bad line before
    the limit is a 400, one after it a 431), a bare CR or LF with 400 before anything.

    A match holds one LF, at its end after a CR, and starts where the text does or
    after an LF; the text ends in one (a head's lines do). So with as many matches as
    LFs, the text is those matches and nothing else: no line skipped (its LF would be
    outside them), no bare CR or LF (the framing left them to this grammar).
    """
    pairs: list[tuple[str, str]] = _FIELD_LINES_RE.findall(text, start)
    if len(pairs) != text.count("\n", start):
        raise _field_block_error(text[start:], fail, max_fields)
    if max_fields is not None and len(pairs) > max_fields:
        raise _too_many_fields(max_fields)
    return tuple([(name, value.strip(_OWS)) for name, value in pairs])


def _too_many_fields(max_fields: int) -> HttpError:
    return HttpError(
        _STATUS_REQUEST_HEADER_FIELDS_TOO_LARGE, f"more than {max_fields} header fields"
    )


def _field_block_error(block: str, fail: Fail, max_fields: int | None) -> HttpError:
    """Why a block that `_field_lines` refused is refused: a bare CR or LF, else the
    first line that is not a field line, or the limit if it comes first. Classification
    only: it accepts nothing."""
    bare = _bare_fault(block, fail)
    if bare is not None:
        return bare
    for index, line in enumerate(block.split("\r\n")[:-1]):
        if max_fields is not None and index >= max_fields:
            return _too_many_fields(max_fields)
        if not _FIELD_LINE_RE.fullmatch(line):
            return _field_line_error(line, fail)
    return fail("malformed header line")  # not reached: some line did not match


def _bare_fault(text: str, fail: Fail) -> HttpError | None:
    """The refusal of the first bare CR or LF in `text` (whole lines, or a line without
    its CRLF), if there is one: the framing's own, in the same words."""
    found = _BARE_CR_OR_LF_TEXT_RE.search(text)
    if found is None:
        return None
    if text[found.start()] == "\n":
        return fail("a line ends in a bare LF; lines must end in CRLF")
    return fail("a bare CR inside a line is not allowed")


def _field_line_error(line: str, fail: Fail) -> HttpError:
    """Why `line` is not a field line (`_FIELD_LINE_RE` refused it), in reading order."""
    if line[:1] in (" ", "\t"):
        return fail("obs-fold (a header line starting with whitespace) is not allowed")
    name, colon, _ = line.partition(":")
    if not colon:
        return fail("a header line has no colon")
    if name[-1:] in (" ", "\t"):
        return fail("whitespace between a header name and its colon is not allowed")
    if not _TOKEN_RE.fullmatch(name):
        return fail("a header name is not a token")
    return fail("a control character in a header value is not allowed")


def _list_items(values: list[str]) -> list[str]:
    """The elements of a comma-separated field (RFC 9110 §5.6.1), empty ones dropped."""
    items: list[str] = []
    for value in values:
        for raw in value.split(","):
            item = raw.strip(_OWS)
            if item:
                items.append(item)
    return items


_NO_TOKENS: Final[frozenset[str]] = frozenset()


def _connection_tokens(index: _Index, fail: Fail | None) -> frozenset[str]:
    """Lower-cased `Connection` options; with `fail`, a non-token is refused."""
    values = index.get("connection")
    if values is None:
        return _NO_TOKENS
    tokens: set[str] = set()
    for item in _list_items(values):
        if fail is not None and not _TOKEN_RE.fullmatch(item):
            raise fail("malformed Connection header")
        tokens.add(item.lower())
    return frozenset(tokens)


def _content_length(values: list[str], fail: Fail) -> int:
    if len(values) > 1:
        raise fail("more than one Content-Length header")
    value = values[0]
    if "," in value:
        raise fail("Content-Length must be one number, not a list")
    # ASCII digits only (int() would take "+1", " 1", "1_0" or other scripts' digits):
    # two str predicates, a third of a regex match's cost, on every sized message.
    if not (value.isascii() and value.isdigit()):
        raise fail("Content-Length must be decimal digits only")
    if len(value) > MAX_CONTENT_LENGTH_DIGITS:
        raise fail("Content-Length is too large")
    return int(value)


class _Coding(enum.Enum):
    CHUNKED = "chunked"  # exactly one coding: chunked
    MALFORMED = "malformed"  # chunked is not the single final coding
    UNSUPPORTED = "unsupported"  # valid, e.g. `gzip, chunked`, but refused


# _Coding's members, bound once (the rule at the top).
_CODING_CHUNKED: Final = _Coding.CHUNKED
_CODING_MALFORMED: Final = _Coding.MALFORMED
_CODING_UNSUPPORTED: Final = _Coding.UNSUPPORTED


def _transfer_coding(value: str) -> _Coding:
    # Only a lone `chunked` is accepted. `gzip, chunked` is valid HTTP, but
    # supporting it buys nothing and every extra form is one more way for two
    # hops to disagree on where a body ends.
    codings = [c.strip(_OWS).lower() for c in value.split(",")]
    if codings == ["chunked"]:
        return _CODING_CHUNKED
    if codings[-1] != "chunked" or codings.count("chunked") != 1:
        return _CODING_MALFORMED
    return _CODING_UNSUPPORTED


def _next_hop_fields(
    fields: Fields, connection: frozenset[str], dropped: frozenset[str] = _HOP_BY_HOP
) -> list[tuple[str, str]]:
    """The fields without those in `dropped` (hop-by-hop), those named in Connection,
    and every Proxy-*, in order."""
    if connection:
        dropped = dropped | (connection - _NEVER_DROPPED)
    kept: list[tuple[str, str]] = []
    for name, value in fields:
        key = name.lower()
        if key not in dropped and not key.startswith("proxy-"):
            kept.append((name, value))
    return kept


def _serialize(start_line: str, fields: Sequence[tuple[str, str]]) -> bytes:
    lines = "".join([f"{name}: {value}\r\n" for name, value in fields])
    # Latin-1 gives back the exact bytes each value was decoded from.
    return f"{start_line}\r\n{lines}\r\n".encode("latin-1")


# -- request head --------------------------------------------------------------------------


class _RequestLine:
    """The request line, read; built once per head and never changed."""

    # A plain class: compiled, its __init__ is native (a dataclass's is interpreted).
    default_port = HTTP_DEFAULT_PORT  # a Host field without a port names this one
    __slots__ = (
        "authority",
        "authority_text",
        "kind",
        "method",
        "origin_target",
        "target",
        "version",
    )

    def __init__(  # noqa: PLR0917
        self,
        method: str,
        target: str,
        version: str,
        kind: RequestKind,
        authority_text: str,
        authority: Authority,
        origin_target: str | None,
    ) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.kind = kind
        self.authority_text = authority_text  # as written in the target: host[:port]
        self.authority = authority
        self.origin_target = origin_target


class _OriginLine(_RequestLine):
    """An origin-form request line on a connection the proxy terminates (proxy/terminate.py):
    the target is the connection's own, a Host without a port means https's."""

    __slots__ = ()
    default_port = HTTPS_DEFAULT_PORT


class RequestHeadParser:
    """Parse one request head fed in any chunking.

    `feed` returns None while more bytes are needed, the `RequestHead` once
    the head is complete (then `trailing` holds the bytes after it, which the
    body reader or the next parser must get), or raises `HttpError`. After an
    error every further `feed` raises the same error.

    One path whatever the chunking: `_LineBuffer` frames the bytes (refusing a bare
    CR or LF, or a line or head beyond the limit, as soon as it is seen);
    `_request_line` reads the request line once it is complete (a client that sends
    no HTTP is refused at once), and `_request_head` the field lines once the head is.
    """

    def __init__(
        self, max_head_bytes: int = limits.MAX_HEAD_BYTES, *, origin: Authority | None = None
    ) -> None:
        """`origin`: read origin-form requests (`GET /path`) to this normalized host and
        port, on a TLS connection the proxy terminates; nothing else is accepted then."""
        self._max_head_bytes = max_head_bytes
        self._origin = origin
        self._lines = _LineBuffer(_bad_request)
        self._empty_lines = 0
        self._line: _RequestLine | None = None
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
            self._lines.extend(data)
            head = self._read()
        except HttpError as exc:
            self._error = exc
            raise
        if head is not None:
            self._head = head
            self._trailing = self._lines.take()
        return head

    def _read(self) -> RequestHead | None:
        while self._line is None:
            first = self._lines.first_line(self._max_head_bytes, self._too_long)
            if first is None:
                return None
            if first:
                origin = self._origin
                self._line = _request_line(first) if origin is None else _origin_line(first, origin)
            else:
                self._skip_empty_line()
        raw = self._lines.head(self._max_head_bytes, self._too_long)
        return None if raw is None else _request_head(self._line, raw)

    def _skip_empty_line(self) -> None:
        # The limit counts from the request line: skipped lines are not part of the head.
        self._lines.take(2)
        self._empty_lines += 1
        if self._empty_lines > MAX_LEADING_EMPTY_LINES:
            raise _bad_request("too many empty lines before the request line")

    def _too_long(self, line_ended: bool) -> HttpError:
        if not line_ended:
            return HttpError(
                _STATUS_REQUEST_URI_TOO_LONG,
                f"request line is longer than {self._max_head_bytes} bytes",
            )
        return HttpError(
            _STATUS_REQUEST_HEADER_FIELDS_TOO_LARGE,
            f"request head is larger than {self._max_head_bytes} bytes",
        )


def _request_line(raw: bytes) -> _RequestLine:
    """The one reading of a request line: `METHOD SP request-target SP HTTP-version`
    (RFC 9112 §3), however the bytes were split."""
    line = raw.decode("latin-1")  # one character per byte: encoding back gives the bytes
    if _REQUEST_LINE_RE.fullmatch(line) is None:
        raise _bare_fault(line, _bad_request) or _request_line_error(line)
    # The three parts, as matched: single spaces between them, and none inside one.
    method, target, version = line.split(" ")
    kind, authority_text, authority, origin_target = _interpret_target(method, target)
    return _RequestLine(method, target, version, kind, authority_text, authority, origin_target)


def _origin_line(raw: bytes, origin: Authority) -> _RequestLine:
    """The one reading of a request line, for a terminated connection: origin-form only."""
    line = raw.decode("latin-1")
    if _REQUEST_LINE_RE.fullmatch(line) is None:
        raise _bare_fault(line, _bad_request) or _request_line_error(line)
    method, target, version = line.split(" ")
    if method == "CONNECT" or not target.startswith("/") or "#" in target:
        raise _bad_request("send origin-form requests (GET /path) on this connection")
    text = host_field(origin.host, origin.port, default_port=HTTPS_DEFAULT_PORT)
    return _OriginLine(method, target, version, _REQUEST_KIND_FORWARD, text, origin, target)


def _request_head(line: _RequestLine, raw: bytes) -> RequestHead:
    """The one reading of the rest of a request head (its lines, the request line
    first, as `_LineBuffer.head` hands them out): the field lines in order, then the
    checks that need the whole head."""
    text = raw.decode("latin-1")
    fields = _field_lines(text, text.find("\r\n") + 2, _bad_request, MAX_HEADER_FIELDS)
    return _build_head(line, fields)


def _request_line_error(line: str) -> HttpError:
    """Why `_REQUEST_LINE_RE` refused `line`, in reading order. Classification only:
    every branch refuses (the statuses differ: 505 for another HTTP version)."""
    if _CONTROL_RE.search(line) or "\t" in line:
        return _bad_request("a control character in the request line is not allowed")
    if not line.isascii():
        return _bad_request("the request line must be ASCII")
    parts = line.split(" ")
    if len(parts) != 3 or not all(parts):
        return _bad_request("the request line must be METHOD SP TARGET SP HTTP/1.1, single spaces")
    if parts[2] not in (HTTP_10, HTTP_11):
        if _VERSION_RE.fullmatch(parts[2]):
            return HttpError(_STATUS_HTTP_VERSION_NOT_SUPPORTED, "only HTTP/1.1 and 1.0")
        return _bad_request("malformed HTTP version in the request line")
    # Three visible-ASCII parts and a known version: the method is what failed.
    return _bad_request("the method is not a token")


def _interpret_target(method: str, target: str) -> tuple[RequestKind, str, Authority, str | None]:
    """The target's kind, its authority (as written, and read) and its path and query."""
    if method == "CONNECT":
        return _REQUEST_KIND_CONNECT, target, _connect_authority(target), None
    if target == "*":
        raise _bad_request("asterisk-form (OPTIONS *) is not proxied; send an absolute http:// URL")
    if target.startswith("/"):
        raise _bad_request(
            "this is a proxy: send absolute-form (GET http://host/path) or CONNECT host:port"
        )
    if _SCHEME_RE.match(target) is None:
        raise _bad_request(
            "the request target must be absolute-form (http://host/path);"
            " only CONNECT takes host:port"
        )
    # The scheme matched ends at the first colon (none is in its characters): no group
    # to ask the match for.
    written = target[: target.find(":")]
    name = written.lower()
    if name in _TLS_SCHEMES:
        raise _bad_request(
            "for https:// and wss:// URLs use CONNECT host:443 (a TLS tunnel through the proxy)"
        )
    if name not in _PLAIN_SCHEMES:
        raise _bad_request(
            "only http:// and ws:// URLs are forwarded; tunnel other protocols with CONNECT"
        )
    after = target[len(written) + 3 :]  # after the scheme's "://"
    authority_text, authority, origin_target = _absolute_form(method, after)
    return _REQUEST_KIND_FORWARD, authority_text, authority, origin_target


def _connect_authority(target: str) -> Authority:
    """authority-form `host:port` / `[v6]:port` (RFC 9112 §3.2.3); port required."""
    if "/" in target or "?" in target or "#" in target:
        raise _bad_request("CONNECT needs host:port (authority-form), not a URL")
    return _authority(target, default_port=None)


def _absolute_form(method: str, rest: str) -> tuple[str, Authority, str]:
    """What follows `http://` or `ws://`: authority (as written, and read), path and
    query (RFC 9112 §3.2.2)."""
    if "#" in rest:
        raise _bad_request("a fragment (#) is not allowed in the request target")
    cut = _path_start(rest)
    text = rest[:cut]
    authority = _authority(text, default_port=HTTP_DEFAULT_PORT)
    path = rest[cut:]
    if not path:
        # RFC 9112 §3.2.4: an empty path is sent as "/", or "*" for OPTIONS.
        return text, authority, "*" if method == "OPTIONS" else "/"
    return text, authority, path if path.startswith("/") else "/" + path


def _path_start(rest: str) -> int:
    """Where the path ("/") or the query ("?") begins in `rest`, else its length."""
    cut = len(rest)
    for mark in "/?":
        found = rest.find(mark, 0, cut)
        if found >= 0:
            cut = found
    return cut


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
        return _new_authority(host, default_port)
    return _new_authority(host, _target_port(raw_port, connect=default_port is None))


def _new_authority(host: str, port: int) -> Authority:
    # tuple.__new__ in C: the NamedTuple's own __new__ is generated Python code, an
    # interpreted frame per head (~1,500 instructions under callgrind).
    return tuple.__new__(Authority, (host, port))


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
    index = _index(fields)
    _check_host(line, index.get("host", _NONE))
    body = _request_framing(line, index)
    expect_continue = _expect_continue(line, index.get("expect", _NONE))
    connection = _connection_tokens(index, _bad_request)
    upgrade = _upgrade(line, index, connection, body)
    return RequestHead(
        method=line.method,
        version=line.version,
        kind=line.kind,
        authority=line.authority,
        body=body,
        expect_continue=expect_continue,
        keep_alive=_keep_alive(line.version, connection, index),
        target=line.target,
        origin_target=line.origin_target,
        headers=fields,
        connection_tokens=connection,
        upgrade=upgrade,
        index=index,
    )


def _check_host(line: _RequestLine, values: list[str]) -> None:
    # RFC 9112 §3.2: 400 for a missing Host in HTTP/1.1, for more than one,
    # and for an invalid one.
    if len(values) > 1:
        raise _bad_request("more than one Host header")
    if not values:
        # CONNECT names its target in the request line; many tunnelling
        # clients (ssh ProxyCommands, some SDKs) send no Host with it.
        if line.version == HTTP_11 and line.kind is not _REQUEST_KIND_CONNECT:
            raise _bad_request("an HTTP/1.1 request needs a Host header")
        return
    if values[0] == line.authority_text:
        # The target's own spelling (curl's CONNECT, most clients' Host): it was read
        # already, to the same host and port, so it is well-formed and names the target.
        return
    try:
        raw_host, raw_port = hosts.split_authority(values[0])
    except HostError:
        raise _bad_request("malformed Host header") from None
    port = line.default_port if raw_port is None else _port(raw_port, "the Host header")
    if line.kind is _REQUEST_KIND_FORWARD and (
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


def _bodiless(framing: BodyFraming) -> bool:
    return framing.kind is _FRAMING_KIND_NONE or (
        framing.kind is _FRAMING_KIND_LENGTH and not framing.length
    )


def _request_framing(line: _RequestLine, index: _Index) -> BodyFraming:
    """Body framing (RFC 9112 §6), refusing every form that hops could read differently."""
    te = index.get("transfer-encoding")
    cl = index.get("content-length")
    if te is not None and cl is not None:
        raise _bad_request("Content-Length together with Transfer-Encoding is refused")
    if te is not None:
        framing = _chunked_request(line, te)
    elif cl is not None:
        framing = BodyFraming(_FRAMING_KIND_LENGTH, _content_length(cl, _bad_request))
    else:
        framing = NO_BODY
    if line.kind is _REQUEST_KIND_CONNECT and not _bodiless(framing):
        # Bytes after a CONNECT head are tunnel data; a body would be ambiguous.
        raise _bad_request("a CONNECT request cannot carry a body")
    return framing


def _chunked_request(line: _RequestLine, te: list[str]) -> BodyFraming:
    if line.version == HTTP_10:
        raise _bad_request("Transfer-Encoding is not allowed in an HTTP/1.0 request")
    if len(te) > 1:
        raise _bad_request("more than one Transfer-Encoding header")
    coding = _transfer_coding(te[0])
    if coding is _CODING_MALFORMED:
        raise _bad_request("Transfer-Encoding must be exactly chunked")
    if coding is _CODING_UNSUPPORTED:
        raise HttpError(_STATUS_NOT_IMPLEMENTED, "only Transfer-Encoding: chunked is supported")
    return CHUNKED_BODY


def _expect_continue(line: _RequestLine, values: list[str]) -> bool:
    if not values:
        return False
    items = [item.strip(_OWS).lower() for value in values for item in value.split(",")]
    if any(item != "100-continue" for item in items):
        raise HttpError(_STATUS_EXPECTATION_FAILED, "only Expect: 100-continue is supported")
    # RFC 9110 §10.1.1: a 100-continue expectation in HTTP/1.0 is ignored.
    return line.version == HTTP_11


def _upgrade(
    line: _RequestLine, index: _Index, connection: frozenset[str], body: BodyFraming
) -> tuple[str, ...]:
    """The protocols an upgrade request offers (RFC 9110 §7.8), or () for none."""
    if line.kind is not _REQUEST_KIND_FORWARD or "upgrade" not in connection:
        # Without the `upgrade` option, Upgrade is a stray hop-by-hop field.
        return ()
    if line.version != HTTP_11:
        # RFC 9110 §7.8: a server MUST ignore Upgrade in an HTTP/1.0 request.
        return ()
    protocols = tuple(_list_items(index.get("upgrade", _NONE)))
    if not protocols:
        return ()
    if not all(_PROTOCOL_RE.fullmatch(p) for p in protocols):
        raise _bad_request("malformed Upgrade header")
    if not _bodiless(body):
        # After a 101 the next byte belongs to the new protocol: with a body,
        # we and the upstream could disagree on where it starts (smuggling).
        raise _bad_request("an Upgrade request cannot carry a body")
    return protocols


def _keep_alive(version: str, connection: frozenset[str], index: _Index) -> bool:
    if "close" in connection:
        return False
    # Old clients send Proxy-Connection; honoring its `close` is always safe.
    for item in _list_items(index.get("proxy-connection", _NONE)):
        if item.lower() == "close":
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


def forward_head(
    head: RequestHead,
    *,
    keep_alive: bool = False,
    host: str | None = None,
    default_port: int = HTTP_DEFAULT_PORT,
) -> bytes:
    """The request head for the upstream, in origin-form.

    Hop-by-hop fields, fields named in Connection, and every Proxy-* field
    (credentials for us, never for the origin) are dropped; the others keep
    their order. Host is written first, from `host`: the normalized host the
    decision admitted (by default the target's host, normalized the same way),
    never the client's spelling. The parser checked that the client's Host names
    the target, but "names" is an IDNA mapping: `ALLOWED.test.`, a soft hyphen
    or U+00AA for `a` name it too, and an origin that routes by Host must only
    ever see the name decided (RFC 9112 §3.2.2: a proxy sent an absolute-form
    target generates Host from it, and does not forward the received one).
    `Connection: close` is sent unless `keep_alive`: the forwarder keeps an
    upstream connection only for the next request of the same client
    connection, and only when that request's own decision admits the same
    host, port and address (never shared between client connections). An
    upgrade request sends its own `Upgrade` with `Connection: Upgrade`
    instead: after a 101 the connection carries the new protocol, still to
    the checked target.
    """
    if head.kind is not _REQUEST_KIND_FORWARD or head.origin_target is None:
        raise ValueError("forward_head is for absolute-form requests, not CONNECT")
    if host is None:
        host = _decided_host(head.authority.host)
    fields = _next_hop_fields(head.headers, head.connection_tokens, _HOP_BY_HOP_AND_HOST)
    if head.body.kind is _FRAMING_KIND_LENGTH:
        fields = _canonical_length(fields, head.body.length)
    fields.insert(0, ("Host", host_field(host, head.authority.port, default_port=default_port)))
    if head.body.kind is _FRAMING_KIND_CHUNKED:
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


def host_field(host: str, port: int, *, default_port: int = HTTP_DEFAULT_PORT) -> str:
    """The Host field value for a normalized host (hosts.normalize_host's text): an IPv6
    address in brackets, the port unless it is the scheme's default (RFC 9110 §7.2): http's
    and ws's, or https's on a terminated connection."""
    text = f"[{host}]" if ":" in host else host
    return text if port == default_port else f"{text}:{port}"


def _decided_host(raw: str) -> str:
    """The target's host normalized as the decision normalizes it (ValueError when it
    could never have been admitted)."""
    try:
        return hosts.normalize_host(raw).text
    except HostError:
        raise ValueError("forward_head needs a host the decision could admit") from None


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
    if not _TOKEN_RE.fullmatch(name) or name.lower() in reserved:
        raise ValueError("extra header name must be a token and not a framing field")
    if not value.isascii() or _CONTROL_RE.search(value):
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


# _ChunkState's members, bound once (the rule at the top).
_CHUNK_STATE_DATA: Final = _ChunkState.DATA
_CHUNK_STATE_DATA_END: Final = _ChunkState.DATA_END
_CHUNK_STATE_DONE: Final = _ChunkState.DONE
_CHUNK_STATE_SIZE: Final = _ChunkState.SIZE
_CHUNK_STATE_TRAILERS: Final = _ChunkState.TRAILERS


class _ChunkedDecoder:
    """Strict chunked decoding (RFC 9112 §7.1) over a shared `_LineBuffer`.

    Data comes out as it arrives. Chunk extensions and trailer fields are
    validated and dropped: extensions mean nothing to us, and the `Trailer`
    header announcing fields is hop-by-hop and not forwarded either.
    """

    def __init__(self, lines: _LineBuffer, fail: Fail) -> None:
        self._lines = lines
        self._fail = fail
        self._state = _CHUNK_STATE_SIZE
        self._remaining = 0

    @property
    def done(self) -> bool:
        return self._state is _CHUNK_STATE_DONE

    def read(self) -> list[bytes]:
        """Decoded data from what the buffer holds; stops at the end of the body."""
        pieces: list[bytes] = []
        while self._state is not _CHUNK_STATE_DONE:
            if self._state is _CHUNK_STATE_DATA:
                piece = self._lines.take(self._remaining)
                if not piece:
                    break
                pieces.append(piece)
                self._remaining -= len(piece)
                if not self._remaining:
                    self._state = _CHUNK_STATE_DATA_END
                continue
            if self._state is _CHUNK_STATE_TRAILERS:
                if not self._read_trailers():
                    break
                continue
            line = self._next_line()
            if line is None:
                break
            self._on_line(line)
        return pieces

    def _read_trailers(self) -> bool:
        # A trailer section is a field block, read like a head's (and then dropped).
        raw = self._lines.head(MAX_TRAILER_BYTES, self._trailers_too_large)
        if raw is None:
            return False
        _field_lines(raw.decode("latin-1"), 0, self._fail, None)
        self._state = _CHUNK_STATE_DONE
        return True

    def _next_line(self) -> bytes | None:
        if self._state is _CHUNK_STATE_SIZE:
            return self._lines.line(MAX_CHUNK_LINE_BYTES, self._size_line_too_long)
        return self._lines.line(2, self._no_crlf_after_data)

    def _size_line_too_long(self, _line_ended: bool) -> HttpError:
        return self._fail("chunk size line too long")

    def _no_crlf_after_data(self, _line_ended: bool) -> HttpError:
        return self._fail("chunk data must be followed by CRLF")

    def _trailers_too_large(self, _line_ended: bool) -> HttpError:
        return self._fail("trailer section is too large")

    def _on_line(self, line: bytes) -> None:
        if self._state is _CHUNK_STATE_SIZE:
            size = self._chunk_size(line)
            self._remaining = size
            self._state = _CHUNK_STATE_DATA if size else _CHUNK_STATE_TRAILERS
        else:  # DATA_END
            if line:  # unreachable: a 2-byte budget leaves room for CRLF only
                raise self._fail("chunk data must be followed by CRLF")
            self._state = _CHUNK_STATE_SIZE

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
        self._done = framing.kind is _FRAMING_KIND_NONE or (
            framing.kind is _FRAMING_KIND_LENGTH and not framing.length
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
        if self._framing.kind is _FRAMING_KIND_LENGTH:
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


@dataclass(frozen=True, slots=True, init=False)
class ResponseHead:
    """The final response head, re-serialized for the client in `data`."""

    status: int
    reason: str
    headers: Fields
    data: bytes
    keep_alive: bool

    def __init__(
        self, status: int, reason: str, headers: Fields, data: bytes, keep_alive: bool
    ) -> None:
        # Written out for the same reason as RequestHead's: compiled stores, one a field.
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "headers", headers)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "keep_alive", keep_alive)


@dataclass(frozen=True, slots=True, init=False)
class BodyData:
    """Body bytes already framed for the client."""

    data: bytes

    def __init__(self, data: bytes) -> None:
        object.__setattr__(self, "data", data)  # compiled (see RequestHead)


@dataclass(frozen=True, slots=True, init=False)
class EndOfMessage:
    """The response is complete; `data` finishes its framing (maybe empty).

    `keep_alive`: whether the client connection may carry another request,
    as far as this response goes. The glue must also close if the request
    body was not read to its end.
    """

    data: bytes
    keep_alive: bool

    def __init__(self, data: bytes, keep_alive: bool) -> None:
        object.__setattr__(self, "data", data)  # compiled (see RequestHead)
        object.__setattr__(self, "keep_alive", keep_alive)


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


# _UpstreamBody's members, bound once (the rule at the top).
_UPSTREAM_BODY_CHUNKED: Final = _UpstreamBody.CHUNKED
_UPSTREAM_BODY_CLOSE: Final = _UpstreamBody.CLOSE
_UPSTREAM_BODY_LENGTH: Final = _UpstreamBody.LENGTH
_UPSTREAM_BODY_NONE: Final = _UpstreamBody.NONE


class _Phase(enum.Enum):
    HEAD = "head"
    BODY = "body"
    DONE = "done"
    UPGRADED = "upgraded"  # after a 101: every byte is the new protocol's


# _Phase's members, bound once (the rule at the top).
_PHASE_BODY: Final = _Phase.BODY
_PHASE_DONE: Final = _Phase.DONE
_PHASE_HEAD: Final = _Phase.HEAD
_PHASE_UPGRADED: Final = _Phase.UPGRADED


class _StatusLine:
    """A response's status line, parsed."""

    # A plain class, as _RequestLine: compiled, its __init__ is native.
    __slots__ = ("reason", "status", "version")

    def __init__(self, version: str, status: int, reason: str) -> None:
        self.version = version
        self.status = status
        self.reason = reason


class ResponseFramer:
    """Frame the upstream's response to one FORWARD request for the client.

    Feed upstream bytes to `feed` (and `feed_eof` when the upstream closes);
    write each event's `.data` to the client in order. Nothing is buffered
    beyond one head (body bytes go out as they come). Bodies go out with a
    Content-Length, as chunks we encode, or (to an HTTP/1.0 client) delimited
    by closing the client connection.
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
        if request.kind is not _REQUEST_KIND_FORWARD:
            raise ValueError("a CONNECT response is not framed: the tunnel relays bytes")
        self._request = request
        self._max_head_bytes = max_head_bytes
        self._lines = _LineBuffer(UpstreamResponseError)
        self._chunks = _ChunkedDecoder(self._lines, UpstreamResponseError)
        self._phase = _PHASE_HEAD
        self._status: _StatusLine | None = None  # of the head being read
        self._informational = 0
        self._body = _UPSTREAM_BODY_NONE
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
            self._phase is _PHASE_DONE
            and self._persistent
            and not self._extra
            and not self._lines.available
        )

    def feed(self, data: bytes) -> list[ResponseEvent]:
        if self._error is not None:
            raise self._error
        if self._phase is _PHASE_UPGRADED:
            self._trailing += data
            return []
        if self._phase is _PHASE_DONE:
            self._extra = self._extra or bool(data)
            return []
        self._lines.extend(data)
        return self._guarded(self._advance)

    def feed_eof(self) -> list[ResponseEvent]:
        """The upstream closed: ends a close-delimited body, else it was cut short."""
        if self._error is not None:
            raise self._error
        if self._phase in (_PHASE_DONE, _PHASE_UPGRADED):
            return []
        return self._guarded(self._on_eof)

    def _guarded(self, step: Callable[[], list[ResponseEvent]]) -> list[ResponseEvent]:
        try:
            return step()
        except HttpError as exc:
            self._error = exc
            raise

    def _on_eof(self) -> list[ResponseEvent]:
        if self._phase is _PHASE_BODY and self._body is _UPSTREAM_BODY_CLOSE:
            return [self._end()]
        raise UpstreamResponseError("the upstream closed before the response was complete")

    def _advance(self) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        while self._phase is _PHASE_HEAD:
            event = self._head_event()
            if event is None:
                return events
            events.append(event)
        if self._phase is _PHASE_BODY:
            events.extend(self._read_body())
        return events

    def _head_event(self) -> ResponseEvent | None:
        # The status line is read as soon as it is complete: an upstream that speaks
        # no HTTP (a banner, then silence) is refused at once.
        too_long = self._response_head_too_long
        if self._status is None:
            first = self._lines.first_line(self._max_head_bytes, too_long)
            if first is None:
                return None
            self._status = _status_line(first)
        raw = self._lines.head(self._max_head_bytes, too_long)
        if raw is None:
            return None
        status, self._status = self._status, None
        fields = _response_fields(raw)
        index = _index(fields)
        if status.status == _STATUS_SWITCHING_PROTOCOLS:
            return self._upgraded(status, fields, index)
        if status.status < 200:
            return self._informational_event(status, fields, index)
        return self._final_head(status, fields, index)

    def _response_head_too_long(self, _line_ended: bool) -> HttpError:
        return UpstreamResponseError(f"response head is larger than {self._max_head_bytes} bytes")

    def _upgraded(self, status: _StatusLine, fields: Fields, index: _Index) -> Upgraded:
        offered = {_protocol_name(p) for p in self._request.upgrade}
        if not offered:
            raise UpstreamResponseError("101 Switching Protocols to a request that asked for none")
        if status.version != HTTP_11:
            raise UpstreamResponseError("101 Switching Protocols in an HTTP/1.0 response")
        # The framing fields are checked as on any response, then dropped:
        # a 101 has no body (RFC 9110 §15.2), the new protocol follows at once.
        _response_framing(self._request, status, index)
        protocols = _list_items(index.get("upgrade", _NONE))
        if not protocols:
            raise UpstreamResponseError("101 Switching Protocols without an Upgrade header")
        if not all(_PROTOCOL_RE.fullmatch(p) for p in protocols):
            raise UpstreamResponseError("malformed Upgrade header in a 101 response")
        # RFC 9110 §7.8: a server MUST NOT switch to a protocol not offered.
        if not {_protocol_name(p) for p in protocols} <= offered:
            raise UpstreamResponseError(
                "101 Switching Protocols to a protocol that was not offered"
            )
        tokens = _connection_tokens(index, None)
        kept = _next_hop_fields(fields, tokens, _HOP_BY_HOP_AND_LENGTH)
        kept.extend([("Upgrade", ", ".join(protocols)), ("Connection", "Upgrade")])
        self._phase = _PHASE_UPGRADED
        self._trailing += self._lines.take()
        return Upgraded(tuple(kept), _serialize(_status_text(status), kept))

    def _informational_event(
        self, status: _StatusLine, fields: Fields, index: _Index
    ) -> InformationalResponse:
        self._informational += 1
        if self._informational > MAX_INFORMATIONAL_RESPONSES:
            raise UpstreamResponseError("too many 1xx responses")
        # A 1xx has no body (RFC 9112 §6.3) and must carry no framing field
        # (RFC 9110 §8.6, RFC 9112 §6.1), but a malformed one is refused as on
        # any response: a lenient client behind us could still read it.
        _response_framing(self._request, status, index)
        # RFC 9110 §15.2: no 1xx to an HTTP/1.0 client. A 100 goes only to a
        # client that asked for it: some clients take an unexpected one for
        # the final answer.
        relay = self._request.version == HTTP_11 and (
            status.status != _STATUS_CONTINUE or self._request.expect_continue
        )
        if not relay:
            return InformationalResponse(status.status, b"")
        tokens = _connection_tokens(index, None)
        kept = _next_hop_fields(fields, tokens, _HOP_BY_HOP_AND_LENGTH)
        return InformationalResponse(status.status, _serialize(_status_text(status), kept))

    def _final_head(self, status: _StatusLine, fields: Fields, index: _Index) -> ResponseHead:
        self._body, self._remaining, length = _response_framing(self._request, status, index)
        tokens = _connection_tokens(index, None)
        self._persistent = (
            status.version == HTTP_11
            and "close" not in tokens
            and self._body is not _UPSTREAM_BODY_CLOSE
        )
        client_11 = self._request.version == HTTP_11
        unsized = self._body in (_UPSTREAM_BODY_CHUNKED, _UPSTREAM_BODY_CLOSE)
        self._chunk_to_client = unsized and client_11
        # An HTTP/1.0 client learns where an unsized body ends only by the close,
        # and a client that asked for an upgrade gets none: its connection ends.
        self._keep_alive = (
            self._request.keep_alive and not self._request.upgrade and (client_11 or not unsized)
        )
        kept = _next_hop_fields(fields, tokens, _HOP_BY_HOP_AND_LENGTH)
        kept.extend(self._framing_fields(length, client_11))
        self._phase = _PHASE_BODY
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
        if self._body is _UPSTREAM_BODY_CHUNKED:
            pieces = self._chunks.read()
            finished = self._chunks.done
        elif self._body is _UPSTREAM_BODY_LENGTH:
            pieces = [self._lines.take(self._remaining)]
            self._remaining -= len(pieces[0])
            finished = not self._remaining
        else:
            pieces = [self._lines.take()] if self._body is _UPSTREAM_BODY_CLOSE else []
            finished = self._body is _UPSTREAM_BODY_NONE
        events: list[ResponseEvent] = [BodyData(self._for_client(p)) for p in pieces if p]
        if finished:
            events.append(self._end())
        return events

    def _for_client(self, piece: bytes) -> bytes:
        return _encode_chunk(piece) if self._chunk_to_client else piece

    def _end(self) -> EndOfMessage:
        self._phase = _PHASE_DONE
        return EndOfMessage(_LAST_CHUNK if self._chunk_to_client else b"", self._keep_alive)


def _status_line(raw: bytes) -> _StatusLine:
    """The one reading of a status line, however the bytes were split."""
    line = raw.decode("latin-1")
    match = _STATUS_LINE_RE.fullmatch(line)
    if match is None:
        bare = _bare_fault(line, UpstreamResponseError)
        raise bare or UpstreamResponseError("malformed status line from the upstream")
    version, status, reason = match.groups()
    return _StatusLine(version, int(status), reason or "")


def _response_fields(raw: bytes) -> Fields:
    """The one reading of a response head's field lines (the head's lines, the status
    line first, as `_LineBuffer.head` hands them out)."""
    text = raw.decode("latin-1")
    return _field_lines(text, text.find("\r\n") + 2, UpstreamResponseError, None)


def _protocol_name(protocol: str) -> str:
    """The name part of `name/version`, lower-cased (names are case-insensitive)."""
    return protocol.partition("/")[0].lower()


def _status_text(status: _StatusLine) -> str:
    return f"{HTTP_11} {status.status} {status.reason}"


def _response_framing(
    request: RequestHead, status: _StatusLine, index: _Index
) -> tuple[_UpstreamBody, int, int | None]:
    """(body kind, bytes to read, Content-Length to show), per RFC 9112 §6.3.

    The framing fields are checked even when the status means no body, so a
    malformed response is refused the same way whatever the request was.
    """
    te = index.get("transfer-encoding")
    cl = index.get("content-length")
    if te is not None and cl is not None:
        raise UpstreamResponseError("the upstream sent both Content-Length and Transfer-Encoding")
    if te is not None:
        _check_response_te(status, te)
    length = _content_length(cl, UpstreamResponseError) if cl is not None else None
    if request.method == "HEAD" or status.status in _NO_BODY_STATUSES:
        # No body; a Content-Length describes the representation (HEAD, 304)
        # and is kept, but RFC 9110 §8.6 forbids it on a 204.
        shown = None if status.status == _STATUS_NO_CONTENT else length
        return _UPSTREAM_BODY_NONE, 0, shown
    if te:
        return _UPSTREAM_BODY_CHUNKED, 0, None
    if length is not None:
        return _UPSTREAM_BODY_LENGTH, length, length
    return _UPSTREAM_BODY_CLOSE, 0, None


def _check_response_te(status: _StatusLine, te: list[str]) -> None:
    if len(te) > 1:
        raise UpstreamResponseError("the upstream sent more than one Transfer-Encoding header")
    if status.version == HTTP_10:
        # RFC 9112 §6.1: Transfer-Encoding in HTTP/1.0 means faulty framing.
        raise UpstreamResponseError("Transfer-Encoding in an HTTP/1.0 response")
    if _transfer_coding(te[0]) is not _CODING_CHUNKED:
        raise UpstreamResponseError("the upstream used a Transfer-Encoding other than chunked")
