"""HTTP/1.1 request heads, bodies, response framing and replies (protocols/http1.py).

Every message is fed whole, byte by byte, and in random splits (DESIGN §10),
and must give the same result each way, with the bytes after it kept exactly.
h11 serves as an independent second parser: whatever we accept, it must read
with the same framing, so no message can mean one thing to us and another to
the hop behind us.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import itertools
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from egressbox.core.errors import EgressboxError
from egressbox.core.limits import MAX_HEAD_BYTES
from egressbox.protocols import http1
from egressbox.protocols.http1 import (
    CHUNKED_BODY,
    MAX_CHUNK_LINE_BYTES,
    MAX_HEADER_FIELDS,
    MAX_INFORMATIONAL_RESPONSES,
    MAX_LEADING_EMPTY_LINES,
    MAX_MESSAGE_CHARS,
    NO_BODY,
    Authority,
    BodyData,
    BodyFraming,
    EndOfMessage,
    FramingKind,
    HttpError,
    InformationalResponse,
    RequestBodyReader,
    RequestHead,
    RequestHeadParser,
    RequestKind,
    ResponseEvent,
    ResponseFramer,
    ResponseHead,
    Upgraded,
    UpstreamResponseError,
    connect_established,
    error_reply,
    forward_head,
    proxy_credentials,
    sanitize_message,
)

# Bytes a client sent after the head (a body or the next request): they must
# come out of the parser exactly as they went in.
TRAILING = b"NEXT \r\n\x00\xff\n\r"
SMALL_HEAD = 256  # a small max_head_bytes so limit tests stay fast byte by byte
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- feeding helpers ---------------------------------------------------------------------


def whole(raw: bytes) -> list[bytes]:
    return [raw]


def bytewise(raw: bytes) -> list[bytes]:
    return [raw[i : i + 1] for i in range(len(raw))]


def split_at(raw: bytes, cuts: Iterable[int]) -> list[bytes]:
    """Pieces of raw cut at the given offsets (repeats give empty feeds)."""
    points = sorted(min(max(c, 0), len(raw)) for c in cuts)
    edges = [0, *points, len(raw)]
    return [raw[a:b] for a, b in itertools.pairwise(edges)]


@dataclass(frozen=True)
class Parsed:
    head: RequestHead | None
    trailing: bytes
    error: tuple[int, str] | None


def run_parser(chunks: Sequence[bytes], max_head_bytes: int = MAX_HEAD_BYTES) -> Parsed:
    parser = RequestHeadParser(max_head_bytes)
    for index, chunk in enumerate(chunks):
        try:
            head = parser.feed(chunk)
        except HttpError as exc:
            return Parsed(None, b"", (exc.status, exc.message))
        if head is not None:
            return Parsed(head, parser.trailing + b"".join(chunks[index + 1 :]), None)
    return Parsed(None, b"", None)


def parse(raw: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> Parsed:
    """Parse whole and byte by byte; both must agree."""
    first = run_parser(whole(raw), max_head_bytes)
    assert run_parser(bytewise(raw), max_head_bytes) == first
    return first


def accept(raw: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> RequestHead:
    parsed = parse(raw + TRAILING, max_head_bytes)
    assert parsed.error is None, parsed.error
    assert parsed.head is not None, "incomplete"
    assert parsed.trailing == TRAILING
    return parsed.head


def refuse(raw: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> tuple[int, str]:
    parsed = parse(raw + TRAILING, max_head_bytes)
    assert parsed.error is not None, parsed.head
    return parsed.error


def req(line: str, *fields: str, host: str | None = "example.com") -> bytes:
    """A request head: request line, a Host field unless None, then fields."""
    lines = [line]
    if host is not None:
        lines.append(f"Host: {host}")
    lines.extend(fields)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


GET = "GET http://example.com/ HTTP/1.1"
POST = "POST http://example.com/ HTTP/1.1"
WS_GET = "GET ws://example.com/chat HTTP/1.1"
# What aiohttp and browsers send with a WebSocket request (RFC 6455 §4.1).
WS_KEY = "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="
WS = ("Upgrade: websocket", "Connection: Upgrade", WS_KEY, "Sec-WebSocket-Version: 13")


# -- request heads: accepted ----------------------------------------------------------------


@dataclass(frozen=True)
class Want:
    kind: RequestKind
    authority: Authority
    origin_target: str | None = None
    body: BodyFraming = NO_BODY
    keep_alive: bool = True
    expect_continue: bool = False
    upgrade: tuple[str, ...] = ()


FORWARD = RequestKind.FORWARD
CONNECT = RequestKind.CONNECT
EX80 = Authority("example.com", 80)

ACCEPTED: list[tuple[str, bytes, Want]] = [
    ("simple GET", req(GET), Want(FORWARD, EX80, "/")),
    ("no path", req("GET http://example.com HTTP/1.1"), Want(FORWARD, EX80, "/")),
    ("query only", req("GET http://example.com?a=1 HTTP/1.1"), Want(FORWARD, EX80, "/?a=1")),
    (
        "path and query",
        req("GET http://example.com/a/b?c=d&e HTTP/1.1"),
        Want(FORWARD, EX80, "/a/b?c=d&e"),
    ),
    (
        "explicit port",
        req("GET http://example.com:8080/x HTTP/1.1", host="example.com:8080"),
        Want(FORWARD, Authority("example.com", 8080), "/x"),
    ),
    (
        "explicit default port, Host without it",
        req("GET http://example.com:80/ HTTP/1.1"),
        Want(FORWARD, EX80, "/"),
    ),
    (
        "scheme and host case, host kept raw",
        req("GET HTTP://Example.COM/ HTTP/1.1", host="example.com"),
        Want(FORWARD, Authority("Example.COM", 80), "/"),
    ),
    (
        "Host compared after normalization",
        req("GET http://example.com/ HTTP/1.1", host="EXAMPLE.com."),
        Want(FORWARD, EX80, "/"),
    ),
    (
        "IDN Host against its A-label",
        req("GET http://xn--bcher-kva.de/ HTTP/1.1", host="bücher.de"),
        Want(FORWARD, Authority("xn--bcher-kva.de", 80), "/"),
    ),
    (
        "IPv6 literal",
        req("GET http://[2001:db8::1]:8080/ HTTP/1.1", host="[2001:DB8:0::1]:8080"),
        Want(FORWARD, Authority("[2001:db8::1]", 8080), "/"),
    ),
    (
        "OPTIONS with empty path goes out as *",
        req("OPTIONS http://example.com HTTP/1.1"),
        Want(FORWARD, EX80, "*"),
    ),
    ("any token method", req("PURGE http://example.com/ HTTP/1.1"), Want(FORWARD, EX80, "/")),
    (
        "lower-case method is a token",
        req("get http://example.com/ HTTP/1.1"),
        Want(FORWARD, EX80, "/"),
    ),
    (
        "HTTP/1.0 without Host",
        req("GET http://example.com/ HTTP/1.0", host=None),
        Want(FORWARD, EX80, "/", keep_alive=False),
    ),
    (
        "HTTP/1.0 keep-alive",
        req("GET http://example.com/ HTTP/1.0", "Connection: keep-alive"),
        Want(FORWARD, EX80, "/", keep_alive=True),
    ),
    (
        "Connection: close",
        req(GET, "Connection: close"),
        Want(FORWARD, EX80, "/", keep_alive=False),
    ),
    (
        "Connection tokens are case-insensitive lists",
        req(GET, "Connection: Keep-Alive, ,CLOSE"),
        Want(FORWARD, EX80, "/", keep_alive=False),
    ),
    (
        "Proxy-Connection: close",
        req(GET, "Proxy-Connection: close"),
        Want(FORWARD, EX80, "/", keep_alive=False),
    ),
    (
        "Content-Length",
        req("POST http://example.com/ HTTP/1.1", "Content-Length: 12"),
        Want(FORWARD, EX80, "/", BodyFraming(FramingKind.LENGTH, 12)),
    ),
    (
        "Content-Length 0",
        req("POST http://example.com/ HTTP/1.1", "Content-Length: 0"),
        Want(FORWARD, EX80, "/", BodyFraming(FramingKind.LENGTH, 0)),
    ),
    (
        "Content-Length with leading zeros",
        req("POST http://example.com/ HTTP/1.1", "Content-Length: 007"),
        Want(FORWARD, EX80, "/", BodyFraming(FramingKind.LENGTH, 7)),
    ),
    (
        "chunked",
        req("POST http://example.com/ HTTP/1.1", "Transfer-Encoding: chunked"),
        Want(FORWARD, EX80, "/", CHUNKED_BODY),
    ),
    (
        "chunked, any case, HTAB as whitespace",
        req("POST http://example.com/ HTTP/1.1", "Transfer-Encoding:\tChunked \t"),
        Want(FORWARD, EX80, "/", CHUNKED_BODY),
    ),
    (
        "Expect: 100-continue",
        req("PUT http://example.com/ HTTP/1.1", "Expect: 100-Continue", "Content-Length: 1"),
        Want(FORWARD, EX80, "/", BodyFraming(FramingKind.LENGTH, 1), expect_continue=True),
    ),
    (
        "Expect: 100-continue is ignored in HTTP/1.0",
        req("GET http://example.com/ HTTP/1.0", "Expect: 100-continue"),
        Want(FORWARD, EX80, "/", keep_alive=False),
    ),
    (
        "CONNECT",
        req("CONNECT example.com:443 HTTP/1.1", host="example.com:443"),
        Want(CONNECT, Authority("example.com", 443)),
    ),
    (
        "CONNECT keeps the host as written",
        req("CONNECT Example.COM.:443 HTTP/1.1", host="example.com:443"),
        Want(CONNECT, Authority("Example.COM.", 443)),
    ),
    (
        "CONNECT IPv6",
        req("CONNECT [2001:db8::1]:443 HTTP/1.1", host="[2001:db8::1]:443"),
        Want(CONNECT, Authority("[2001:db8::1]", 443)),
    ),
    (
        "CONNECT HTTP/1.0 without Host (Python's http.client)",
        req("CONNECT example.com:443 HTTP/1.0", host=None),
        Want(CONNECT, Authority("example.com", 443), keep_alive=False),
    ),
    (
        "CONNECT with Content-Length: 0",
        req("CONNECT example.com:443 HTTP/1.1", "Content-Length: 0"),
        Want(CONNECT, Authority("example.com", 443), body=BodyFraming(FramingKind.LENGTH, 0)),
    ),
    (
        "CONNECT to a name the decision will refuse (not ours to judge)",
        req("CONNECT exa%mple.com:443 HTTP/1.1"),
        Want(CONNECT, Authority("exa%mple.com", 443)),
    ),
    (
        "one leading empty line",
        b"\r\n" + req(GET),
        Want(FORWARD, EX80, "/"),
    ),
    (
        "the most leading empty lines",
        b"\r\n" * MAX_LEADING_EMPTY_LINES + req(GET),
        Want(FORWARD, EX80, "/"),
    ),
    # ws:// and Upgrade (RFC 9110 §7.8, RFC 6455 §4.1)
    ("ws:// WebSocket", req(WS_GET, *WS), Want(FORWARD, EX80, "/chat", upgrade=("websocket",))),
    (
        "ws:// with a port, query and any scheme case",
        req("GET WS://example.com:8080/c?x=1 HTTP/1.1", *WS, host="example.com:8080"),
        Want(FORWARD, Authority("example.com", 8080), "/c?x=1", upgrade=("websocket",)),
    ),
    (
        "ws:// without a path",
        req("GET ws://example.com HTTP/1.1", *WS),
        Want(FORWARD, EX80, "/", upgrade=("websocket",)),
    ),
    (
        "ws:// without Upgrade is an ordinary request",
        req("POST ws://example.com/ HTTP/1.1", "Content-Length: 2"),
        Want(FORWARD, EX80, "/", BodyFraming(FramingKind.LENGTH, 2)),
    ),
    (
        "http:// upgrade",
        req(GET, "Upgrade: websocket", "Connection: upgrade"),
        Want(FORWARD, EX80, "/", upgrade=("websocket",)),
    ),
    (
        "Upgrade lists over several fields, with versions",
        req(GET, "Upgrade: h2c, ,TLS/1.2", "Connection: keep-alive, UPGRADE", "Upgrade: WebSocket"),
        Want(FORWARD, EX80, "/", upgrade=("h2c", "TLS/1.2", "WebSocket")),
    ),
    (
        "upgrade with Content-Length: 0",
        req(WS_GET, *WS, "Content-Length: 0"),
        Want(FORWARD, EX80, "/chat", BodyFraming(FramingKind.LENGTH, 0), upgrade=("websocket",)),
    ),
    (
        "upgrade and Connection: close",
        req(WS_GET, "Upgrade: websocket", "Connection: close, upgrade"),
        Want(FORWARD, EX80, "/chat", keep_alive=False, upgrade=("websocket",)),
    ),
    (
        "Upgrade without Connection: upgrade is no upgrade",
        req(POST, "Upgrade: websocket", "Connection: keep-alive", "Content-Length: 3"),
        Want(FORWARD, EX80, "/", BodyFraming(FramingKind.LENGTH, 3)),
    ),
    (
        "Connection: upgrade without Upgrade is no upgrade",
        req(WS_GET, "Connection: upgrade"),
        Want(FORWARD, EX80, "/chat"),
    ),
    (
        "an empty Upgrade offers nothing",
        req(GET, "Upgrade: ,", "Connection: upgrade"),
        Want(FORWARD, EX80, "/"),
    ),
    (
        "Upgrade in HTTP/1.0 is ignored, body and all",
        req("POST ws://example.com/ HTTP/1.0", *WS, "Content-Length: 4"),
        Want(FORWARD, EX80, "/", BodyFraming(FramingKind.LENGTH, 4), keep_alive=False),
    ),
    (
        "Upgrade with CONNECT means nothing",
        req("CONNECT example.com:80 HTTP/1.1", *WS, host="example.com:80"),
        Want(CONNECT, EX80),
    ),
]


@pytest.mark.parametrize(("raw", "want"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted(raw: bytes, want: Want) -> None:
    head = accept(raw)
    got = Want(
        head.kind,
        head.authority,
        head.origin_target,
        head.body,
        head.keep_alive,
        head.expect_continue,
        head.upgrade,
    )
    assert got == want
    assert (head.host, head.port) == want.authority


def test_head_fields() -> None:
    raw = req(
        "POST http://example.com/p HTTP/1.1",
        "X-A:  one \t",
        "x-a: two",
        "Empty:",
        "Latin: caf\xe9",
        "Content-Length: 0",
    )
    head = accept(raw)
    assert head.method == "POST"
    assert head.version == "HTTP/1.1"
    assert head.target == "http://example.com/p"
    assert head.headers == (
        ("Host", "example.com"),
        ("X-A", "one"),
        ("x-a", "two"),
        ("Empty", ""),
        ("Latin", "caf\xe9"),
        ("Content-Length", "0"),
    )
    assert head.header("X-a") == ["one", "two"]
    assert head.header("missing") == []


def test_a_head_answers_from_its_own_fields() -> None:
    """Each head keeps the field index its parser built; a head rebuilt from rewritten
    fields (as proxy/terminate.py does with a secret's value) answers from those fields,
    never from the index of the head it was made from, nor of the head parsed last."""
    first = accept(req("GET http://example.com/ HTTP/1.1", "Proxy-Authorization: Basic old"))
    second = accept(req("GET http://example.com/ HTTP/1.1", "Proxy-Authorization: Basic two"))
    assert first.header("proxy-authorization") == ["Basic old"]
    assert second.header("Proxy-Authorization") == ["Basic two"]
    rewritten = (("Host", "other.example"), ("Proxy-Authorization", "Basic new"), ("X-B", "b"))
    # Rebuilt through the constructor (no index handed in), as proxy/terminate.py does.
    rebuilt = dataclasses.replace(first, headers=rewritten)
    assert rebuilt.header("proxy-authorization") == ["Basic new"]
    assert rebuilt.header("host") == ["other.example"] and rebuilt.header("x-b") == ["b"]
    assert rebuilt.header("Host") == ["other.example"]
    assert first.header("proxy-authorization") == ["Basic old"]  # the original is unchanged
    # What a caller does with the returned list never reaches the head.
    first.header("proxy-authorization").append("mine")
    assert first.header("proxy-authorization") == ["Basic old"]


def test_repr_hides_target_and_headers() -> None:
    head = accept(req("GET http://example.com/secret?token=1 HTTP/1.1", "Cookie: c=1"))
    assert "secret" not in repr(head)
    assert "c=1" not in repr(head)


# -- request heads: refused -----------------------------------------------------------------

REFUSED: list[tuple[str, bytes, int, str]] = [
    # request line
    ("origin-form", req("GET /path HTTP/1.1"), 400, "this is a proxy"),
    ("asterisk-form", req("OPTIONS * HTTP/1.1"), 400, "asterisk-form"),
    ("https absolute-form", req("GET https://example.com/ HTTP/1.1"), 400, "use CONNECT"),
    ("wss absolute-form", req("GET wss://example.com/ HTTP/1.1", *WS), 400, "use CONNECT"),
    ("WSS absolute-form", req("GET WSS://example.com:8443/ HTTP/1.1"), 400, "use CONNECT"),
    ("ftp", req("GET ftp://example.com/ HTTP/1.1"), 400, "only http:// and ws://"),
    ("wsx", req("GET wsx://example.com/ HTTP/1.1"), 400, "only http:// and ws://"),
    ("ws without slashes", req("GET ws:example.com/ HTTP/1.1"), 400, "absolute-form"),
    ("ws userinfo", req("GET ws://u:p@example.com/ HTTP/1.1", *WS), 400, "userinfo"),
    ("authority-form without CONNECT", req("GET example.com:80 HTTP/1.1"), 400, "absolute-form"),
    ("lower-case connect", req("connect example.com:443 HTTP/1.1"), 400, "absolute-form"),
    ("userinfo", req("GET http://user:pw@example.com/ HTTP/1.1"), 400, "userinfo"),
    ("userinfo in CONNECT", req("CONNECT user@example.com:443 HTTP/1.1"), 400, "userinfo"),
    ("fragment", req("GET http://example.com/#top HTTP/1.1"), 400, "fragment"),
    ("empty host", req("GET http:///x HTTP/1.1"), 400, "empty host"),
    ("empty host with port", req("GET http://:80/ HTTP/1.1"), 400, "empty host"),
    ("empty port", req("GET http://example.com:/ HTTP/1.1"), 400, "bad port"),
    ("port 0", req("GET http://example.com:0/ HTTP/1.1"), 400, "bad port"),
    ("port too big", req("GET http://example.com:65536/ HTTP/1.1"), 400, "bad port"),
    ("port with sign", req("GET http://example.com:+80/ HTTP/1.1"), 400, "bad port"),
    ("unbracketed IPv6", req("GET http://2001:db8::1/ HTTP/1.1"), 400, "malformed host"),
    ("unclosed bracket", req("GET http://[2001:db8::1/ HTTP/1.1"), 400, "malformed host"),
    ("CONNECT without port", req("CONNECT example.com HTTP/1.1"), 400, "needs a port"),
    ("CONNECT empty host", req("CONNECT :443 HTTP/1.1"), 400, "empty host"),
    ("CONNECT empty brackets", req("CONNECT []:443 HTTP/1.1"), 400, "empty host"),
    ("CONNECT bad port", req("CONNECT example.com:http HTTP/1.1"), 400, "bad port"),
    ("CONNECT to a URL", req("CONNECT http://example.com:443/ HTTP/1.1"), 400, "not a URL"),
    ("CONNECT with a path", req("CONNECT example.com:443/x HTTP/1.1"), 400, "not a URL"),
    ("CONNECT unbracketed IPv6", req("CONNECT 2001:db8::1:443 HTTP/1.1"), 400, "malformed host"),
    ("HTTP/1.2", req("GET http://example.com/ HTTP/1.2"), 505, "HTTP/1.1"),
    ("HTTP/2.0", req("GET http://example.com/ HTTP/2.0"), 505, "HTTP/1.1"),
    ("HTTP/0.9 style", req("GET http://example.com/ HTTP/0.9"), 505, "HTTP/1.1"),
    ("lower-case version", req("GET http://example.com/ http/1.1"), 400, "version"),
    ("garbage version", req("GET http://example.com/ HTTP/1.1x"), 400, "version"),
    ("no version", req("GET http://example.com/"), 400, "single spaces"),
    ("double space", req("GET  http://example.com/ HTTP/1.1"), 400, "single spaces"),
    ("trailing space", req("GET http://example.com/ HTTP/1.1 "), 400, "single spaces"),
    ("leading space", req(" GET http://example.com/ HTTP/1.1"), 400, "single spaces"),
    ("tab separator", req("GET\thttp://example.com/ HTTP/1.1"), 400, "control character"),
    ("space in target", req("GET http://example.com/a b HTTP/1.1"), 400, "single spaces"),
    ("method not a token", req("GE(T http://example.com/ HTTP/1.1"), 400, "token"),
    ("non-ASCII target", req("GET http://example.com/caf\xe9 HTTP/1.1"), 400, "ASCII"),
    ("NUL in the request line", req("GET http://example.com/\x00 HTTP/1.1"), 400, "control"),
    ("DEL in the request line", req("GET http://example.com/\x7f HTTP/1.1"), 400, "control"),
    # Host
    ("missing Host", req(GET, host=None), 400, "needs a Host"),
    ("two Host fields", req(GET, "Host: example.com"), 400, "more than one Host"),
    ("Host names another host", req(GET, host="other.example"), 400, "does not match"),
    ("Host names another port", req(GET, host="example.com:8080"), 400, "does not match"),
    (
        "Host omits a non-default port",
        req("GET http://example.com:8080/ HTTP/1.1"),
        400,
        "does not match",
    ),
    ("empty Host", req(GET, host=""), 400, "does not match"),
    ("Host with userinfo", req(GET, host="u@example.com"), 400, "malformed Host"),
    ("Host with a bad port", req(GET, host="example.com:x"), 400, "bad port"),
    (
        "Host differs from an unnormalizable target",
        req("GET http://exa%mple.com/ HTTP/1.1", host="example.com"),
        400,
        "does not match",
    ),
    # fields
    ("obs-fold", req(GET, "X-A: one", " two"), 400, "obs-fold"),
    ("obs-fold with tab", req(GET, "X-A: one", "\ttwo"), 400, "obs-fold"),
    ("space before colon", req(GET, "X-A : one"), 400, "whitespace between"),
    ("tab before colon", req(GET, "X-A\t: one"), 400, "whitespace between"),
    ("no colon", req(GET, "X-A one"), 400, "no colon"),
    ("empty name", req(GET, ": one"), 400, "not a token"),
    ("name not a token", req(GET, "X(A): one"), 400, "not a token"),
    ("non-ASCII name", req(GET, "Caf\xe9: one"), 400, "not a token"),
    ("NUL in a value", req(GET, "X-A: o\x00ne"), 400, "control character"),
    ("VT in a value", req(GET, "X-A: o\x0bne"), 400, "control character"),
    ("DEL in a value", req(GET, "X-A: o\x7fne"), 400, "control character"),
    (
        "too many fields",
        req(GET, *(f"X-{i}: v" for i in range(MAX_HEADER_FIELDS))),
        431,
        "header fields",
    ),
    ("Expect other than 100-continue", req(GET, "Expect: 200-ok"), 417, "100-continue"),
    ("Expect list", req(GET, "Expect: 100-continue, foo"), 417, "100-continue"),
    ("empty Expect", req(GET, "Expect:"), 417, "100-continue"),
    ("malformed Connection", req(GET, "Connection: a b"), 400, "Connection"),
    # line endings
    (
        "bare LF after the request line",
        b"GET http://example.com/ HTTP/1.1\nHost: a\r\n\r\n",
        400,
        "bare LF",
    ),
    ("bare LF after a field", b"GET http://a/ HTTP/1.1\r\nHost: a\n\r\n", 400, "bare LF"),
    ("bare LF at the end", b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\n", 400, "bare LF"),
    ("bare CR in a value", b"GET http://a/ HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n", 400, "bare CR"),
    ("bare CR as line end", b"GET http://a/ HTTP/1.1\rHost: a\r\n\r\n", 400, "bare CR"),
    ("bare LF as leading line", b"\nGET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n", 400, "bare LF"),
    (
        "too many leading empty lines",
        b"\r\n" * (MAX_LEADING_EMPTY_LINES + 1) + req(GET),
        400,
        "empty lines",
    ),
    # CONNECT with a body
    (
        "CONNECT with Content-Length",
        req("CONNECT a.b:443 HTTP/1.1", "Content-Length: 5"),
        400,
        "body",
    ),
    ("CONNECT chunked", req("CONNECT a.b:443 HTTP/1.1", "Transfer-Encoding: chunked"), 400, "body"),
    # Upgrade: the bytes after the head are the new protocol's, never a body
    (
        "upgrade with Content-Length",
        req(WS_GET, *WS, "Content-Length: 5"),
        400,
        "cannot carry a body",
    ),
    ("upgrade chunked", req(WS_GET, *WS, "Transfer-Encoding: chunked"), 400, "cannot carry a body"),
    ("ws Host mismatch", req(WS_GET, *WS, host="other.example"), 400, "does not match"),
    ("Upgrade not a token", req(GET, "Upgrade: web socket", "Connection: upgrade"), 400, "Upgrade"),
    (
        "Upgrade empty version",
        req(GET, "Upgrade: websocket/", "Connection: upgrade"),
        400,
        "Upgrade",
    ),
    ("Upgrade two versions", req(GET, "Upgrade: a/1/2", "Connection: upgrade"), 400, "Upgrade"),
]

# Request smuggling (CL.TE, TE.CL, TE.TE and friends): each one refused.
SMUGGLING: list[tuple[str, bytes, int, str]] = [
    ("CL.TE", req(POST, "Content-Length: 6", "Transfer-Encoding: chunked"), 400, "together"),
    ("TE.CL", req(POST, "Transfer-Encoding: chunked", "Content-Length: 6"), 400, "together"),
    (
        "CL.TE with CL 0",
        req(POST, "Content-Length: 0", "Transfer-Encoding: chunked"),
        400,
        "together",
    ),
    ("xchunked", req(POST, "Transfer-Encoding: xchunked"), 400, "exactly chunked"),
    ("chunkedx", req(POST, "Transfer-Encoding: chunkedx"), 400, "exactly chunked"),
    ("quoted chunked", req(POST, 'Transfer-Encoding: "chunked"'), 400, "exactly chunked"),
    (
        "chunked with a parameter",
        req(POST, "Transfer-Encoding: chunked;q=1"),
        400,
        "exactly chunked",
    ),
    ("space before colon", req(POST, "Transfer-Encoding : chunked"), 400, "whitespace between"),
    ("tab before colon", req(POST, "Transfer-Encoding\t: chunked"), 400, "whitespace between"),
    ("VT before value", req(POST, "Transfer-Encoding:\x0bchunked"), 400, "control character"),
    ("FF after value", req(POST, "Transfer-Encoding: chunked\x0c"), 400, "control character"),
    ("NUL in value", req(POST, "Transfer-Encoding: chunk\x00ed"), 400, "control character"),
    ("underscore name", req(POST, "Transfer_Encoding: chunked", "Content-Length: 3"), 0, ""),
    (
        "duplicate TE",
        req(POST, "Transfer-Encoding: chunked", "Transfer-Encoding: chunked"),
        400,
        "more than one Transfer-Encoding",
    ),
    (
        "TE then identity",
        req(POST, "Transfer-Encoding: chunked", "Transfer-Encoding: identity"),
        400,
        "more than one Transfer-Encoding",
    ),
    ("chunked, identity", req(POST, "Transfer-Encoding: chunked, identity"), 400, "exactly"),
    ("chunked, chunked", req(POST, "Transfer-Encoding: chunked, chunked"), 400, "exactly"),
    ("identity", req(POST, "Transfer-Encoding: identity"), 400, "exactly chunked"),
    ("empty TE", req(POST, "Transfer-Encoding:"), 400, "exactly chunked"),
    ("gzip, chunked", req(POST, "Transfer-Encoding: gzip, chunked"), 501, "only"),
    (
        "TE in HTTP/1.0",
        req("POST http://example.com/ HTTP/1.0", "Transfer-Encoding: chunked"),
        400,
        "HTTP/1.0",
    ),
    ("obs-fold TE", req(POST, "Transfer-Encoding:", " chunked"), 400, "obs-fold"),
    ("obs-fold before TE", req(POST, "X: y", " Transfer-Encoding: chunked"), 400, "obs-fold"),
    ("CL +5", req(POST, "Content-Length: +5"), 400, "digits"),
    ("CL -5", req(POST, "Content-Length: -5"), 400, "digits"),
    ("CL 5, 5", req(POST, "Content-Length: 5, 5"), 400, "not a list"),
    ("CL 5,5", req(POST, "Content-Length: 5,5"), 400, "not a list"),
    ("CL twice, equal", req(POST, "Content-Length: 5", "Content-Length: 5"), 400, "more than one"),
    (
        "CL twice, different",
        req(POST, "Content-Length: 5", "Content-Length: 6"),
        400,
        "more than one",
    ),
    ("CL hex", req(POST, "Content-Length: 0x5"), 400, "digits"),
    ("CL inner space", req(POST, "Content-Length: 1 0"), 400, "digits"),
    ("CL exponent", req(POST, "Content-Length: 1e3"), 400, "digits"),
    ("CL empty", req(POST, "Content-Length:"), 400, "digits"),
    ("CL Unicode digits", req(POST, "Content-Length: \xb2"), 400, "digits"),
    ("CL too many digits", req(POST, "Content-Length: " + "9" * 19), 400, "too large"),
    ("CL with NUL", req(POST, "Content-Length: 5\x00"), 400, "control character"),
    ("bare LF", b"POST http://a/ HTTP/1.1\r\nHost: a\r\nContent-Length: 5\n\r\n", 400, "bare LF"),
    (
        "CR mid-line",
        b"POST http://a/ HTTP/1.1\r\nHost: a\r\nX: 1\rContent-Length: 5\r\n\r\n",
        400,
        "bare CR",
    ),
    ("NUL in the name", req(POST, "Content-Length\x00: 5"), 400, "not a token"),
    ("two Hosts", req(POST, "Host: evil.example"), 400, "more than one Host"),
]
# A name that merely resembles a framing field is just another field.
SMUGGLING = [case for case in SMUGGLING if case[2]]


@pytest.mark.parametrize(
    ("raw", "status", "text"),
    [c[1:] for c in REFUSED + SMUGGLING],
    ids=[c[0] for c in REFUSED + SMUGGLING],
)
def test_refused(raw: bytes, status: int, text: str) -> None:
    got_status, message = refuse(raw)
    assert got_status == status, message
    assert text in message


def test_lookalike_framing_field_is_an_ordinary_field() -> None:
    head = accept(req(POST, "Transfer_Encoding: chunked", "Content-Length: 3"))
    assert head.body == BodyFraming(FramingKind.LENGTH, 3)


ALL_REQUESTS = [c[1] for c in ACCEPTED] + [c[1] for c in REFUSED + SMUGGLING]


@pytest.mark.parametrize("raw", ALL_REQUESTS)
@FAST
@given(cuts=st.lists(st.integers(0, 600), max_size=6))
def test_random_splits_agree(raw: bytes, cuts: list[int]) -> None:
    data = raw + TRAILING
    assert run_parser(split_at(data, cuts)) == run_parser(whole(data))


# -- request heads: limits and life cycle ------------------------------------------------------


def padded_head(total: int) -> bytes:
    """A valid head of exactly `total` bytes (a padding field fills it up)."""
    base = req(GET, "X-Pad: ")
    head = req(GET, "X-Pad: " + "a" * (total - len(base)))
    assert len(head) == total
    return head


def test_head_of_exactly_the_limit_is_accepted() -> None:
    head = accept(padded_head(SMALL_HEAD), max_head_bytes=SMALL_HEAD)
    assert head.header("x-pad")


def test_leading_empty_lines_do_not_count_against_the_limit() -> None:
    accept(b"\r\n\r\n" + padded_head(SMALL_HEAD), max_head_bytes=SMALL_HEAD)


def test_head_one_byte_over_the_limit_is_431() -> None:
    status, message = refuse(padded_head(SMALL_HEAD + 1), max_head_bytes=SMALL_HEAD)
    assert status == 431
    assert str(SMALL_HEAD) in message


def test_unfinished_head_over_the_limit_is_431_without_waiting() -> None:
    data = req(GET)[:-2] + b"X: " + b"a" * SMALL_HEAD  # never ends
    assert run_parser(whole(data), SMALL_HEAD).error == (
        431,
        f"request head is larger than {SMALL_HEAD} bytes",
    )
    assert run_parser(bytewise(data), SMALL_HEAD).error is not None


def test_request_line_over_the_limit_is_414() -> None:
    long_line = "GET http://example.com/" + "a" * SMALL_HEAD + " HTTP/1.1"
    status, _ = refuse(req(long_line), max_head_bytes=SMALL_HEAD)
    assert status == 414
    status, _ = refuse(b"GET http://example.com/" + b"a" * SMALL_HEAD, max_head_bytes=SMALL_HEAD)
    assert status == 414


def test_default_limit_applies() -> None:
    assert accept(padded_head(MAX_HEAD_BYTES)).header("x-pad")
    assert refuse(padded_head(MAX_HEAD_BYTES + 1))[0] == 431


def test_incomplete_head_needs_more_bytes() -> None:
    raw = req(GET)
    for cut in range(len(raw)):
        assert run_parser(whole(raw[:cut])) == Parsed(None, b"", None)


def test_errors_are_sticky_and_finished_parsers_refuse_bytes() -> None:
    parser = RequestHeadParser()
    with pytest.raises(HttpError) as first:
        parser.feed(b"GET / HTTP/1.1\r\n")
    with pytest.raises(HttpError) as again:
        parser.feed(b"Host: a\r\n\r\n")
    assert again.value is first.value
    done = RequestHeadParser()
    assert done.feed(req(GET)) is not None
    with pytest.raises(RuntimeError):
        done.feed(b"x")


def test_http_error_is_an_egressbox_error() -> None:
    assert issubclass(HttpError, EgressboxError)
    assert issubclass(UpstreamResponseError, HttpError)
    assert UpstreamResponseError("x").status == 502


def test_byte_by_byte_is_linear() -> None:
    # Each byte is scanned once: a 64 KiB line fed one byte at a time must
    # not take quadratic time (a slowloris would otherwise burn CPU).
    parser = RequestHeadParser()
    parser.feed(b"GET http://example.com/")
    with pytest.raises(HttpError) as caught:
        for _ in range(MAX_HEAD_BYTES):
            parser.feed(b"a")
    assert caught.value.status == 414


# -- fuzzing the head parser ------------------------------------------------------------------

SEEDS = [
    req(GET),
    req(POST, "Content-Length: 5") + b"hello",
    req(POST, "Transfer-Encoding: chunked") + b"5\r\nhello\r\n0\r\n\r\n",
    req("CONNECT example.com:443 HTTP/1.1", host="example.com:443"),
    req("GET http://example.com/ HTTP/1.0", "Connection: keep-alive", host=None),
    req(
        "PUT http://[::1]:81/x?y HTTP/1.1",
        "Expect: 100-continue",
        "Content-Length: 1",
        host="[::1]:81",
    ),
    req(WS_GET, *WS) + b"\x81\x02hi",
]
# Bytes that tend to matter to HTTP parsers.
INTERESTING = [b"\r", b"\n", b"\r\n", b" ", b"\t", b"\x00", b":", b",", b"0", b"5", b"a", b"\xff"]
INTERESTING += [
    b"chunked",
    b"Content-Length: 3\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Host: b\r\n",
    b"Upgrade: websocket\r\n",
    b"Connection: upgrade\r\n",
]


@st.composite
def mutated(draw: st.DrawFn, seeds: Sequence[bytes] = SEEDS) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data)))
        piece = draw(st.sampled_from(INTERESTING) | st.binary(max_size=3))
        action = draw(st.sampled_from(["insert", "delete", "replace"]))
        if action == "insert":
            data[at:at] = piece
        elif action == "delete":
            del data[at : at + len(piece)]
        else:
            data[at : at + len(piece)] = piece
    return bytes(data)


@FUZZ
@given(data=st.binary(max_size=300) | mutated(), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_fuzz_parser_gives_head_none_or_http_error(data: bytes, cuts: list[int]) -> None:
    # run_parser catches HttpError only: any other exception fails the test.
    assert run_parser(split_at(data, cuts)) == run_parser(whole(data))


def h11_request(data: bytes) -> tuple[bytes, bytes] | None:
    """(body, bytes after it) as h11 reads a FORWARD request, or None if it refuses."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    body = b""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return None  # incomplete to h11
            if isinstance(event, h11.Data):
                body += event.data
            if isinstance(event, h11.EndOfMessage):
                return body, conn.trailing_data[0]
    except h11.RemoteProtocolError:
        return None


@FUZZ
@given(data=mutated())
def test_fuzz_h11_reads_every_accepted_request_alike(data: bytes) -> None:
    # A second parser sees the same message and the same end of body: no
    # request we forward can be split differently by the hop behind us.
    parsed = run_parser(whole(data))
    if parsed.head is None or parsed.head.kind is not RequestKind.FORWARD:
        return
    reader = RequestBodyReader(parsed.head.body)
    try:
        out = reader.feed(parsed.trailing)
    except HttpError:
        return  # a body we refuse is never forwarded
    if not reader.done:
        return
    ours = dechunk(out) if parsed.head.body.kind is FramingKind.CHUNKED else out
    # h11 does not skip the empty lines that RFC 9112 §2.2 lets us skip.
    assert h11_request(data.lstrip(b"\r\n")) == (ours, reader.trailing)


# -- request bodies ---------------------------------------------------------------------------


def dechunk(data: bytes) -> bytes:
    """Decode chunks as we emit them: canonical sizes, no extensions, no trailers."""
    body = b""
    while True:
        match = re.match(rb"([1-9a-f][0-9a-f]*|0)\r\n", data)
        assert match is not None, data[:40]
        size = int(match.group(1), 16)
        data = data[match.end() :]
        if size == 0:
            assert data == b"\r\n"
            return body
        assert data[size : size + 2] == b"\r\n"
        body += data[:size]
        data = data[size + 2 :]


def run_body(framing: BodyFraming, chunks: Sequence[bytes]) -> tuple[bytes, bool, bytes] | int:
    """(upstream bytes, done, trailing), or the HttpError status."""
    reader = RequestBodyReader(framing)
    out = b""
    try:
        for chunk in chunks:
            out += reader.feed(chunk)
    except HttpError as exc:
        return exc.status
    return out, reader.done, reader.trailing


def body_every_way(framing: BodyFraming, data: bytes) -> tuple[bytes, bool, bytes] | int:
    first = run_body(framing, whole(data))
    split = run_body(framing, bytewise(data))
    if (
        isinstance(first, tuple)
        and isinstance(split, tuple)
        and framing.kind is FramingKind.CHUNKED
    ):
        # Chunk boundaries follow the feeds; the decoded body may not.
        assert (dechunk(split[0]), split[1:]) == (dechunk(first[0]), first[1:])
    else:
        assert split == first
    return first


CHUNKED_OK: list[tuple[str, bytes, bytes]] = [
    ("one chunk", b"5\r\nhello\r\n0\r\n\r\n", b"hello"),
    ("two chunks", b"3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n", b"hello"),
    ("empty body", b"0\r\n\r\n", b""),
    ("upper-case hex", b"A\r\n0123456789\r\n0\r\n\r\n", b"0123456789"),
    ("leading zeros", b"005\r\nhello\r\n000\r\n\r\n", b"hello"),
    ("extensions dropped", b'5;a=b;c="d e"\r\nhello\r\n0;x\r\n\r\n', b"hello"),
    ("BWS before an extension", b"5 \t;a\r\nhello\r\n0\r\n\r\n", b"hello"),
    ("trailers dropped", b"5\r\nhello\r\n0\r\nX-T: 1\r\nY: 2\r\n\r\n", b"hello"),
    ("CRLF inside the data", b"4\r\n\r\n\r\n\r\n0\r\n\r\n", b"\r\n\r\n"),
    (
        "largest size line",
        b"5;" + b"a" * (MAX_CHUNK_LINE_BYTES - 4) + b"\r\nhello\r\n0\r\n\r\n",
        b"hello",
    ),
]


@pytest.mark.parametrize(
    ("data", "body"), [c[1:] for c in CHUNKED_OK], ids=[c[0] for c in CHUNKED_OK]
)
def test_chunked_body(data: bytes, body: bytes) -> None:
    got = body_every_way(CHUNKED_BODY, data + TRAILING)
    assert isinstance(got, tuple)
    out, done, trailing = got
    assert done
    assert dechunk(out) == body
    assert trailing == TRAILING


CHUNKED_BAD: list[tuple[str, bytes]] = [
    ("space before size", b" 5\r\nhello\r\n0\r\n\r\n"),
    ("space after size", b"5 \r\nhello\r\n0\r\n\r\n"),
    ("0x prefix", b"0x5\r\nhello\r\n0\r\n\r\n"),
    ("plus sign", b"+5\r\nhello\r\n0\r\n\r\n"),
    ("minus sign", b"-5\r\nhello\r\n0\r\n\r\n"),
    ("empty size", b"\r\nhello\r\n0\r\n\r\n"),
    ("underscore", b"0_5\r\nhello\r\n0\r\n\r\n"),
    ("too many digits", b"1" + b"0" * 16 + b"\r\n"),
    ("zero-padded past 16 digits", b"0" * 16 + b"5\r\nhello\r\n0\r\n\r\n"),
    ("bare LF after size", b"5\nhello\r\n0\r\n\r\n"),
    ("bare CR after size", b"5\rhello\r\n0\r\n\r\n"),
    ("data longer than size", b"5\r\nhello!\r\n0\r\n\r\n"),
    ("data shorter than size", b"5\r\nhell\r\n0\r\n\r\n"),
    ("bare LF after data", b"5\r\nhello\n0\r\n\r\n"),
    ("bare LF at the end", b"5\r\nhello\r\n0\r\n\n"),
    ("control in extension", b"5;a\x00\r\nhello\r\n0\r\n\r\n"),
    ("size line too long", b"5;" + b"a" * MAX_CHUNK_LINE_BYTES + b"\r\n"),
    ("obs-fold trailer", b"0\r\nX: 1\r\n 2\r\n\r\n"),
    ("trailer without colon", b"0\r\nX\r\n\r\n"),
    ("trailer name with space", b"0\r\nX : 1\r\n\r\n"),
]


@pytest.mark.parametrize("data", [c[1] for c in CHUNKED_BAD], ids=[c[0] for c in CHUNKED_BAD])
def test_malformed_chunked_body_is_400(data: bytes) -> None:
    assert body_every_way(CHUNKED_BODY, data + TRAILING) == 400


def test_a_cr_that_ends_chunk_data_leaves_a_bare_lf_after_it_bare() -> None:
    # The chunk's data is one CR; the LF after it is not the end of a CRLF line, however
    # the bytes were split (also when the data's CR was consumed in an earlier feed).
    data = b"1\r\n\r\n\r\n0\r\n\r\n"
    for cut in range(len(data) + 1):
        reader = RequestBodyReader(CHUNKED_BODY)
        with pytest.raises(HttpError, match="bare LF"):
            reader.feed(data[:cut])
            reader.feed(data[cut:])


def test_length_body_passes_through_unchanged() -> None:
    body = b"0\r\n\r\nGET http://x/ HTTP/1.1\r\n"
    got = body_every_way(BodyFraming(FramingKind.LENGTH, len(body)), body + TRAILING)
    assert got == (body, True, TRAILING)


def test_empty_bodies_are_done_at_once() -> None:
    for framing in (NO_BODY, BodyFraming(FramingKind.LENGTH, 0)):
        reader = RequestBodyReader(framing)
        assert reader.done
        reader.feed_eof()
        assert reader.feed(b"GET ") == b""
        assert reader.feed(b"http") == b""
        assert reader.trailing == b"GET http"


def test_body_cut_short_is_an_error() -> None:
    for framing, data in ((BodyFraming(FramingKind.LENGTH, 5), b"hel"), (CHUNKED_BODY, b"5\r\nhe")):
        reader = RequestBodyReader(framing)
        reader.feed(data)
        assert not reader.done
        with pytest.raises(HttpError) as caught:
            reader.feed_eof()
        assert caught.value.status == 400


def test_body_errors_are_sticky() -> None:
    reader = RequestBodyReader(CHUNKED_BODY)
    with pytest.raises(HttpError) as first:
        reader.feed(b"x\r\n")
    with pytest.raises(HttpError) as again:
        reader.feed(b"0\r\n\r\n")
    assert again.value is first.value


def chunk_encode(pieces: Sequence[bytes], extension: bytes, trailer: bytes) -> bytes:
    out = b"".join(b"%X%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces if p)
    return out + b"0" + extension + b"\r\n" + trailer + b"\r\n"


@FUZZ
@given(
    pieces=st.lists(st.binary(max_size=40), max_size=5),
    extension=st.sampled_from([b"", b";x", b";a=b", b' ;q="1 2"']),
    trailer=st.sampled_from([b"", b"X-T: 1\r\n"]),
    after=st.binary(max_size=20),
    cuts=st.lists(st.integers(0, 300), max_size=8),
)
def test_chunked_round_trip(
    pieces: list[bytes], extension: bytes, trailer: bytes, after: bytes, cuts: list[int]
) -> None:
    data = chunk_encode(pieces, extension, trailer) + after
    got = run_body(CHUNKED_BODY, split_at(data, cuts))
    assert isinstance(got, tuple)
    out, done, trailing = got
    assert done
    assert dechunk(out) == b"".join(pieces)
    assert trailing == after


@FUZZ
@given(
    framing=st.sampled_from([CHUNKED_BODY, BodyFraming(FramingKind.LENGTH, 7), NO_BODY]),
    data=st.binary(max_size=200),
    cuts=st.lists(st.integers(0, 250), max_size=6),
)
def test_fuzz_body_reader_gives_bytes_or_http_error(
    framing: BodyFraming, data: bytes, cuts: list[int]
) -> None:
    result = run_body(framing, split_at(data, cuts))  # HttpError only
    if isinstance(result, tuple) and result[1]:
        out, _, trailing = result
        upstream = dechunk(out) if framing is CHUNKED_BODY else out
        assert len(upstream) <= len(data) and data.endswith(trailing)


# -- forward_head -----------------------------------------------------------------------------


def test_forward_head_strips_hop_by_hop_and_proxy_fields() -> None:
    head = accept(
        req(
            "POST http://example.com/a?b HTTP/1.1",
            "Accept: */*",
            "Proxy-Authorization: Basic dTpw",
            "Proxy-Connection: keep-alive",
            "Connection: keep-alive, X-Secret, content-length",
            "X-Secret: 1",
            "Keep-Alive: timeout=5",
            "TE: trailers",
            "Trailer: X-T",
            "Upgrade: websocket",
            "Content-Length: 3",
            "X-Last: z",
        )
    )
    assert forward_head(head) == (
        b"POST /a?b HTTP/1.1\r\n"
        b"Host: example.com\r\n"
        b"Accept: */*\r\n"
        b"Content-Length: 3\r\n"  # named in Connection, but never dropped
        b"X-Last: z\r\n"
        b"Connection: close\r\n"
        b"\r\n"
    )


def test_forward_head_reemits_chunked_once() -> None:
    head = accept(req(POST, "Transfer-Encoding: Chunked", "X: 1"))
    assert forward_head(head) == (
        b"POST / HTTP/1.1\r\nHost: example.com\r\nX: 1\r\n"
        b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )


def test_forward_head_keeps_bytes_and_adds_host_for_http10() -> None:
    head = accept(req("GET http://[::1]:8080/x HTTP/1.0", "X: caf\xe9", host=None))
    assert forward_head(head) == (
        b"GET /x HTTP/1.1\r\nHost: [::1]:8080\r\nX: caf\xe9\r\nConnection: close\r\n\r\n"
    )


def test_forward_head_passes_an_upgrade_on() -> None:
    head = accept(
        req(
            WS_GET,
            "Proxy-Connection: keep-alive",
            "Proxy-Authorization: Basic dTpw",
            "Connection: keep-alive, Upgrade, X-Hop",
            "X-Hop: 1",
            "Upgrade: websocket",
            "Origin: http://example.com",
            WS_KEY,
            "Sec-WebSocket-Version: 13",
            "Sec-WebSocket-Protocol: chat, superchat",
            "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits",
        )
    )
    assert forward_head(head) == (
        b"GET /chat HTTP/1.1\r\n"
        b"Host: example.com\r\n"
        b"Origin: http://example.com\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Protocol: chat, superchat\r\n"
        b"Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n"
        b"Upgrade: websocket\r\n"
        b"Connection: Upgrade\r\n"  # no close: the connection carries the new protocol
        b"\r\n"
    )


def test_forward_head_upgrade_lists_and_empty_body() -> None:
    head = accept(
        req(
            "OPTIONS ws://example.com HTTP/1.1",
            "Upgrade: h2c, TLS/1.2",
            "Upgrade: websocket",
            "Connection: upgrade",
            "Content-Length: 0",
        )
    )
    assert forward_head(head) == (
        b"OPTIONS * HTTP/1.1\r\nHost: example.com\r\nContent-Length: 0\r\n"
        b"Upgrade: h2c, TLS/1.2, websocket\r\nConnection: Upgrade\r\n\r\n"
    )


@pytest.mark.parametrize(
    "raw",
    [
        # RFC 9110 §7.8: Upgrade in HTTP/1.0 is ignored.
        req(
            "GET ws://example.com/chat HTTP/1.0",
            "Upgrade: websocket",
            "Connection: Upgrade",
            WS_KEY,
        ),
        # Without the `upgrade` connection option it is a stray hop-by-hop field.
        req(WS_GET, "Upgrade: websocket", WS_KEY),
    ],
    ids=["HTTP/1.0", "no Connection: upgrade"],
)
def test_forward_head_drops_an_upgrade_that_is_none(raw: bytes) -> None:
    head = accept(raw)
    assert head.upgrade == ()
    assert forward_head(head) == (
        b"GET /chat HTTP/1.1\r\nHost: example.com\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nConnection: close\r\n\r\n"
    )


def test_forward_head_refuses_connect() -> None:
    with pytest.raises(ValueError, match="CONNECT"):
        forward_head(accept(req("CONNECT a.b:443 HTTP/1.1")))


# -- replies ------------------------------------------------------------------------------------


def split_reply(reply: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines)
    return status_line, fields, body


def test_connect_established() -> None:
    assert connect_established() == b"HTTP/1.1 200 Connection established\r\n\r\n"


def test_error_reply() -> None:
    reply = error_reply(403, "no_allow_rule", "example.com:443 is not allowed")
    status_line, fields, body = split_reply(reply)
    assert status_line == "HTTP/1.1 403 Forbidden"
    assert body == b"egressbox: no_allow_rule: example.com:443 is not allowed\n"
    assert fields == {
        "Content-Type": "text/plain; charset=utf-8",
        "Content-Length": str(len(body)),
        "Connection": "close",
        "X-Egressbox-Reason": "no_allow_rule",
        "Proxy-Agent": "egressbox",
        "Server": "egressbox",
    }


def test_error_reply_sanitizes_the_message() -> None:
    evil = "bad\r\nSet-Cookie: a=1\r\n\r\n<script>\x00\x1b[31m\u2028\u202eend"
    reply = error_reply(400, "bad_request", evil)
    assert reply.count(b"\r\n\r\n") == 1
    _status_line, fields, body = split_reply(reply)
    assert "Set-Cookie" not in fields
    assert int(fields["Content-Length"]) == len(body)
    assert body.count(b"\n") == 1 and body.endswith(b"\n")
    assert b"\r" not in body and b"\x00" not in body and b"\x1b" not in body
    assert body == b"egressbox: bad_request: bad Set-Cookie: a=1 <script> [31m end\n"


def test_error_reply_message_is_capped() -> None:
    _, fields, body = split_reply(error_reply(502, "bad_gateway", "é" * 5000))
    assert int(fields["Content-Length"]) == len(body)
    message = body.decode().removeprefix("egressbox: bad_gateway: ").removesuffix("\n")
    assert len(message) == MAX_MESSAGE_CHARS and message.endswith("...")
    assert sanitize_message("a\tb  \n c") == "a b c"
    assert sanitize_message("x" * MAX_MESSAGE_CHARS) == "x" * MAX_MESSAGE_CHARS


def test_error_reply_extra_headers_and_statuses() -> None:
    reply = error_reply(
        407, "auth_required", "", extra_headers=[("Proxy-Authenticate", 'Basic realm="e"')]
    )
    status_line, fields, _ = split_reply(reply)
    assert status_line == "HTTP/1.1 407 Proxy Authentication Required"
    assert fields["Proxy-Authenticate"] == 'Basic realm="e"'
    assert split_reply(error_reply(499, "client_gone", "x"))[0] == "HTTP/1.1 499 Client Error"
    assert split_reply(error_reply(599, "odd", "x"))[0] == "HTTP/1.1 599 Server Error"


@pytest.mark.parametrize(
    ("status", "code", "extra"),
    [
        (200, "ok", ()),
        (403, "Bad-Code", ()),
        (403, "no\r\nX: 1", ()),
        (403, "", ()),
        (403, "deny", (("X", "a\r\nY: b"),)),
        (403, "deny", (("Bad Name", "v"),)),
        (403, "deny", (("Content-Length", "0"),)),
        (403, "deny", (("X", "caf\xe9"),)),
    ],
)
def test_error_reply_refuses_unsafe_arguments(
    status: int, code: str, extra: tuple[tuple[str, str], ...]
) -> None:
    with pytest.raises(ValueError):
        error_reply(status, code, "m", extra_headers=extra)


# -- proxy credentials ----------------------------------------------------------------------------


def basic(text: str) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ((basic("user:pass"),), ("user", "pass")),
        ((basic("user:pa:ss"),), ("user", "pa:ss")),
        ((basic(":"),), ("", "")),
        ((basic("jürgen:pässword"),), ("jürgen", "pässword")),
        (("Proxy-Authorization: basic dXNlcjpwYXNz",), ("user", "pass")),
        ((), None),
        ((basic("nocolon"),), None),
        ((basic("user:pa\nss"),), None),
        (("Proxy-Authorization: Bearer dXNlcjpwYXNz",), None),
        (("Proxy-Authorization: Basic not*base64",), None),
        (("Proxy-Authorization: Basic " + base64.b64encode(b"\xff:x").decode(),), None),
        ((basic("a:b"), basic("c:d")), None),
    ],
)
def test_proxy_credentials(fields: tuple[str, ...], want: tuple[str, str] | None) -> None:
    assert proxy_credentials(accept(req(GET, *fields))) == want


# -- response framing -------------------------------------------------------------------------


def request(line: str = GET, *fields: str, host: str | None = "example.com") -> RequestHead:
    return accept(req(line, *fields, host=host))


@dataclass(frozen=True)
class Relayed:
    """What the client would receive, independent of how bytes were split."""

    informational: tuple[bytes, ...]
    head: bytes
    body: bytes  # decoded if it went out chunked
    ended: bool
    keep_alive: bool | None
    upgraded: bool = False  # head is then the 101's
    trailing: bytes = b""  # after a 101: the upstream's bytes that followed it


def relay(framer: ResponseFramer, chunks: Sequence[bytes], eof: bool) -> Relayed | int:
    events: list[ResponseEvent] = []
    try:
        for chunk in chunks:
            events += framer.feed(chunk)
        if eof:
            events += framer.feed_eof()
    except UpstreamResponseError as exc:
        return exc.status
    return summarize(events, framer.trailing)


def summarize(events: list[ResponseEvent], trailing: bytes = b"") -> Relayed:
    informational = tuple(e.data for e in events if isinstance(e, InformationalResponse))
    heads = [e for e in events if isinstance(e, ResponseHead)]
    ends = [e for e in events if isinstance(e, EndOfMessage)]
    upgrades = [e for e in events if isinstance(e, Upgraded)]
    assert len(heads) <= 1 and len(ends) <= 1
    if ends:
        assert events[-1] is ends[0], "nothing may follow the end"
    if upgrades:
        assert events[-1] is upgrades[0] and not heads, "a 101 is the last event"
        return Relayed(informational, upgrades[0].data, b"", False, None, True, trailing)
    assert not trailing
    body = b"".join(e.data for e in events if isinstance(e, BodyData | EndOfMessage))
    head = heads[0].data if heads else b""
    if heads and ("Transfer-Encoding", "chunked") in heads[0].headers:
        # Every BodyData is whole chunks, so a body still open decodes too.
        body = dechunk(body if ends else body + b"0\r\n\r\n")
    keep_alive = ends[0].keep_alive if ends else None
    if heads and ends:
        assert heads[0].keep_alive == ends[0].keep_alive
    return Relayed(informational, head, body, bool(ends), keep_alive)


def relay_every_way(head: RequestHead, data: bytes, eof: bool) -> Relayed | int:
    first = relay(ResponseFramer(head), whole(data), eof)
    assert relay(ResponseFramer(head), bytewise(data), eof) == first
    return first


def test_response_with_length() -> None:
    got = relay_every_way(
        request(),
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive, X-Hop\r\n"
        b"Keep-Alive: timeout=5\r\nX-Hop: 1\r\nProxy-Authenticate: Basic\r\nX-End: 2\r\n\r\n"
        b"helloGARBAGE AFTER THE END",
        eof=False,
    )
    assert got == Relayed(
        (),
        b"HTTP/1.1 200 OK\r\nX-End: 2\r\nContent-Length: 5\r\n\r\n",
        b"hello",
        ended=True,
        keep_alive=True,
    )


def test_chunked_response_is_rechunked() -> None:
    got = relay_every_way(
        request(),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n0\r\nT: 1\r\n\r\n",
        eof=False,
    )
    assert got == Relayed(
        (), b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"hello", True, True
    )


def test_close_delimited_response_to_http11_client_is_chunked() -> None:
    got = relay_every_way(request(), b"HTTP/1.0 200 OK\r\nX: 1\r\n\r\nhello world", eof=True)
    assert got == Relayed(
        (),
        b"HTTP/1.1 200 OK\r\nX: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"hello world",
        True,
        True,
    )


def test_unsized_responses_to_http10_client_close_the_connection() -> None:
    client = request("GET http://example.com/ HTTP/1.0", "Connection: keep-alive")
    close_delimited = relay_every_way(client, b"HTTP/1.1 200 OK\r\n\r\nhello", eof=True)
    assert close_delimited == Relayed(
        (), b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"hello", True, False
    )
    chunked = relay_every_way(
        client,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        eof=False,
    )
    assert chunked == close_delimited
    sized = relay_every_way(client, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", eof=False)
    assert sized == Relayed(
        (),
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\n",
        b"hello",
        True,
        True,
    )


def test_client_connection_close_is_echoed() -> None:
    got = relay_every_way(
        request(GET, "Connection: close"),
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        eof=False,
    )
    assert got == Relayed(
        (), b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", b"", True, False
    )


@pytest.mark.parametrize(
    ("method", "response", "head"),
    [
        (
            "HEAD",
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
        ),
        (
            "HEAD",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\n",
        ),
        (
            "GET",
            b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
        ),
        (
            "GET",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
            b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
        ),
    ],
)
def test_responses_without_body(method: str, response: bytes, head: bytes) -> None:
    client = request(f"{method} http://example.com/ HTTP/1.1")
    got = relay_every_way(client, response + b"hello", eof=False)
    assert got == Relayed((), head, b"", True, True)


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\nConnection: x\r\nX: y\r\n\r\n"
FINAL = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def test_informational_responses() -> None:
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
    asked = request(POST, "Expect: 100-continue", "Content-Length: 1")
    got = relay_every_way(asked, CONTINUE + EARLY_HINTS + FINAL, eof=False)
    assert isinstance(got, Relayed)
    assert got.informational == (CONTINUE, hints)
    not_asked = relay_every_way(
        request(POST, "Content-Length: 1"), CONTINUE + EARLY_HINTS + FINAL, eof=False
    )
    assert isinstance(not_asked, Relayed)
    assert not_asked.informational == (b"", hints)  # seen, but not relayed
    old = request("GET http://example.com/ HTTP/1.0")
    to_http10 = relay_every_way(old, CONTINUE + EARLY_HINTS + FINAL, eof=False)
    assert isinstance(to_http10, Relayed)
    assert to_http10.informational == (b"", b"")


def test_a_relayed_1xx_carries_no_framing_field() -> None:
    # RFC 9110 §8.6 and RFC 9112 §6.1: no Content-Length or Transfer-Encoding on a 1xx.
    sent = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\nContent-Length: 7\r\n\r\n"
    got = relay_every_way(request(), sent + FINAL, eof=False)
    assert isinstance(got, Relayed)
    assert got.informational == (b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n",)


RESPONSE_REFUSED: list[tuple[str, bytes, bool, str]] = [
    (
        "CL and TE",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        False,
        "both",
    ),
    (
        "CL twice, equal",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n",
        False,
        "more than one",
    ),
    ("CL list", b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\n", False, "list"),
    ("CL sign", b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\n", False, "digits"),
    ("CL on HEAD still checked", b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", False, "digits"),
    ("TE gzip", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", False, "other than chunked"),
    (
        "TE gzip, chunked",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        False,
        "other than",
    ),
    (
        "TE twice",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
        False,
        "more than one",
    ),
    ("TE in HTTP/1.0", b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", False, "HTTP/1.0"),
    ("bare LF", b"HTTP/1.1 200 OK\nContent-Length: 0\n\n", False, "bare LF"),
    ("obs-fold", b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\nContent-Length: 0\r\n\r\n", False, "obs-fold"),
    ("space before colon", b"HTTP/1.1 200 OK\r\nContent-Length : 0\r\n\r\n", False, "whitespace"),
    ("NUL", b"HTTP/1.1 200 OK\r\nX: \x00\r\n\r\n", False, "control"),
    ("short status", b"HTTP/1.1 20 OK\r\n\r\n", False, "status line"),
    ("status 600", b"HTTP/1.1 600 OK\r\n\r\n", False, "status line"),
    ("HTTP/2", b"HTTP/2 200 OK\r\n\r\n", False, "status line"),
    ("ICY", b"ICY 200 OK\r\n\r\n", False, "status line"),
    ("HTTP/0.9 body", b"<html>hello</html>", True, "closed before"),
    (
        "101 to a request that asked for no upgrade",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
        False,
        "asked for none",
    ),
    (
        "1xx with TE twice",
        b"HTTP/1.1 100 Continue\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n"
        b"\r\nHTTP/1.1 204 No Content\r\n\r\n",
        False,
        "more than one",
    ),
    (
        "1xx with CL and TE",
        b"HTTP/1.1 103 Early Hints\r\nContent-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n",
        False,
        "both",
    ),
    (
        "too many 1xx",
        b"HTTP/1.1 102 Processing\r\n\r\n" * (MAX_INFORMATIONAL_RESPONSES + 1),
        False,
        "1xx",
    ),
    (
        "malformed chunk",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5x\r\n",
        False,
        "chunk",
    ),
    (
        "EOF inside the body",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel",
        True,
        "closed before",
    ),
    (
        "EOF inside chunks",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        True,
        "closed",
    ),
    ("EOF inside the head", b"HTTP/1.1 200 OK\r\nContent-Le", True, "closed before"),
    ("EOF before anything", b"", True, "closed before"),
    (
        "head too large",
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n",
        False,
        "larger",
    ),
]


@pytest.mark.parametrize(
    ("data", "eof", "text"),
    [c[1:] for c in RESPONSE_REFUSED],
    ids=[c[0] for c in RESPONSE_REFUSED],
)
def test_response_refused_with_502(data: bytes, eof: bool, text: str) -> None:
    for chunks in (whole(data), bytewise(data)):
        framer = ResponseFramer(request())
        with pytest.raises(UpstreamResponseError, match=re.escape(text)) as caught:
            for chunk in chunks:
                framer.feed(chunk)
            if eof:
                framer.feed_eof()
        assert caught.value.status == 502
        with pytest.raises(UpstreamResponseError):
            framer.feed(b"more")  # sticky


# -- upgrades (101 Switching Protocols) -----------------------------------------------------

WS_ACCEPT = "Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
SWITCH = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    + WS_ACCEPT.encode()
    + b"\r\n\r\n"
)
SWITCHED = (
    b"HTTP/1.1 101 Switching Protocols\r\n"
    + WS_ACCEPT.encode()
    + b"\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
)
# A WebSocket text frame "hello", as a server may send right behind its 101;
# then bytes that look like HTTP, which after a 101 are just data.
FRAME = b"\x81\x05hello" + b"HTTP/1.1 200 OK\r\n\r\n\r\n"


def ws_request(*fields: str) -> RequestHead:
    return request(WS_GET, *(fields or WS))


@pytest.mark.parametrize("eof", [False, True])
def test_101_to_an_upgrade_request_ends_in_upgraded(eof: bool) -> None:
    got = relay_every_way(ws_request(), SWITCH + FRAME, eof=eof)
    assert got == Relayed((), SWITCHED, b"", False, None, upgraded=True, trailing=FRAME)
    assert relay_every_way(ws_request(), SWITCH, eof=eof) == Relayed(
        (), SWITCHED, b"", False, None, upgraded=True
    )


def test_upgraded_event_and_later_bytes() -> None:
    framer = ResponseFramer(ws_request())
    assert framer.feed(SWITCH[:-1]) == []
    assert framer.trailing == b""
    events = framer.feed(SWITCH[-1:] + b"ab")
    assert events == [
        Upgraded(
            (
                ("Sec-WebSocket-Accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
                ("Upgrade", "websocket"),
                ("Connection", "Upgrade"),
            ),
            SWITCHED,
        )
    ]
    assert framer.feed(b"cd") == []  # the framer is done: later bytes only add up
    assert framer.feed_eof() == []
    assert framer.trailing == b"abcd"


def test_101_head_is_rebuilt_for_the_client() -> None:
    response = (
        b"HTTP/1.1 101 Web Socket Protocol Handshake\r\n"
        b"Upgrade: WebSocket\r\n"
        b"Connection: keep-alive, Upgrade, X-Hop\r\n"
        b"X-Hop: 1\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"Proxy-Authenticate: Basic\r\n"
        b"Content-Length: 0\r\n"
        b"Sec-WebSocket-Protocol: chat\r\n\r\n"
    )
    got = relay_every_way(ws_request(*WS, "Sec-WebSocket-Protocol: chat"), response, eof=False)
    assert got == Relayed(
        (),
        b"HTTP/1.1 101 Web Socket Protocol Handshake\r\nSec-WebSocket-Protocol: chat\r\n"
        b"Upgrade: WebSocket\r\nConnection: Upgrade\r\n\r\n",
        b"",
        False,
        None,
        upgraded=True,
    )


def test_101_after_informational_responses() -> None:
    got = relay_every_way(ws_request(), CONTINUE + EARLY_HINTS + SWITCH + FRAME, eof=False)
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
    assert got == Relayed((b"", hints), SWITCHED, b"", False, None, True, FRAME)


def test_101_to_one_of_several_offered_protocols() -> None:
    client = request(GET, "Upgrade: h2c, TLS/1.2, websocket/13", "Connection: Upgrade")
    response = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: TLS/1.3, WEBSOCKET\r\n\r\n"
    got = relay_every_way(client, response, eof=False)
    assert isinstance(got, Relayed) and got.upgraded
    assert got.head == (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: TLS/1.3, WEBSOCKET\r\n"
        b"Connection: Upgrade\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("response", "head"),
    [
        (
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nnop",
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\nConnection: close\r\n\r\n",
        ),
        (
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n\r\nnop",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        ),
    ],
    ids=["404", "close-delimited 200"],
)
def test_refused_upgrade_is_an_ordinary_response_that_closes(response: bytes, head: bytes) -> None:
    got = relay_every_way(ws_request(), response, eof=True)
    assert got == Relayed((), head, b"nop", True, False)


UPGRADE_REFUSED: list[tuple[str, RequestHead, bytes, str]] = [
    (
        "101 without Upgrade",
        ws_request(),
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\n\r\n",
        "without an Upgrade",
    ),
    (
        "101 with an empty Upgrade",
        ws_request(),
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: ,\r\n\r\n",
        "without an Upgrade",
    ),
    (
        "101 to a protocol not offered",
        ws_request(),
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
        "not offered",
    ),
    (
        "101 to one offered and one not",
        ws_request(),
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket, h2c\r\n\r\n",
        "not offered",
    ),
    (
        "101 with a malformed Upgrade",
        ws_request(),
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: web socket\r\n\r\n",
        "malformed Upgrade",
    ),
    (
        "101 from HTTP/1.0",
        ws_request(),
        b"HTTP/1.0 101 Switching\r\nUpgrade: websocket\r\n\r\n",
        "HTTP/1.0",
    ),
    (
        "101 with a malformed Content-Length",
        ws_request(),
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nContent-Length: x\r\n\r\n",
        "digits",
    ),
    (
        "101 with CL and TE",
        ws_request(),
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nContent-Length: 0\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        "both",
    ),
    (
        "101 to HTTP/1.0, whose Upgrade was ignored",
        request("GET ws://example.com/chat HTTP/1.0", *WS),
        SWITCH,
        "asked for none",
    ),
    (
        "101 when Connection: upgrade was missing",
        request(WS_GET, "Upgrade: websocket"),
        SWITCH,
        "asked for none",
    ),
]


@pytest.mark.parametrize(
    ("client", "data", "text"),
    [c[1:] for c in UPGRADE_REFUSED],
    ids=[c[0] for c in UPGRADE_REFUSED],
)
def test_upgrade_response_refused_with_502(client: RequestHead, data: bytes, text: str) -> None:
    for chunks in (whole(data + FRAME), bytewise(data + FRAME)):
        framer = ResponseFramer(client)
        with pytest.raises(UpstreamResponseError, match=re.escape(text)) as caught:
            for chunk in chunks:
                framer.feed(chunk)
        assert caught.value.status == 502
        with pytest.raises(UpstreamResponseError):
            framer.feed(b"more")  # sticky
        assert framer.trailing == b""


def test_framer_is_done_after_the_end() -> None:
    framer = ResponseFramer(request())
    events = framer.feed(FINAL)
    assert isinstance(events[-1], EndOfMessage)
    assert framer.feed(b"HTTP/1.1 200 OK\r\n\r\n") == []
    assert framer.feed_eof() == []


def test_framer_refuses_connect() -> None:
    with pytest.raises(ValueError, match="CONNECT"):
        ResponseFramer(request("CONNECT a.b:443 HTTP/1.1"))


def test_response_head_event() -> None:
    events = ResponseFramer(request()).feed(b"HTTP/1.1 404 \r\nX: 1\r\nContent-Length: 0\r\n\r\n")
    head = events[0]
    assert isinstance(head, ResponseHead)
    assert (head.status, head.reason, head.keep_alive) == (404, "", True)
    assert head.headers == (("X", "1"), ("Content-Length", "0"))
    assert head.data == b"HTTP/1.1 404 \r\nX: 1\r\nContent-Length: 0\r\n\r\n"


def test_large_body_streams_without_buffering() -> None:
    framer = ResponseFramer(request())
    framer.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 3000000\r\n\r\n")
    for _ in range(3):
        events = framer.feed(b"x" * 1_000_000)
        assert [type(e) for e in events[:1]] == [BodyData]
    assert isinstance(events[-1], EndOfMessage)


RESPONSE_SEEDS = [
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"HTTP/1.0 200 OK\r\nX: 1\r\n\r\nhello",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
    b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" + SWITCH + FRAME,
]


@FUZZ
@given(
    data=st.binary(max_size=200) | mutated(RESPONSE_SEEDS),
    cuts=st.lists(st.integers(0, 250), max_size=6),
    eof=st.booleans(),
    method=st.sampled_from(["GET", "HEAD", "UPGRADE"]),
)
def test_fuzz_framer_gives_events_or_502(
    data: bytes, cuts: list[int], eof: bool, method: str
) -> None:
    if method == "UPGRADE":
        client = ws_request()
    else:
        client = request(f"{method} http://example.com/ HTTP/1.1")
    got = relay(ResponseFramer(client), split_at(data, cuts), eof)  # 502 only
    assert got == relay(ResponseFramer(client), whole(data), eof)


def h11_response(method: str, data: bytes, eof: bool) -> tuple[int, bytes] | None:
    """(final status, body) as h11 reads the response, or None if it refuses."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target="/", headers=[("Host", "example.com")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    if eof:
        conn.receive_data(b"")
    status, body = 0, b""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return None
            if isinstance(event, h11.Response):
                status = event.status_code
            if isinstance(event, h11.Data):
                body += event.data
            if isinstance(event, h11.EndOfMessage):
                return status, body
    except h11.RemoteProtocolError:
        return None


@FUZZ
@given(data=mutated(RESPONSE_SEEDS), eof=st.booleans(), method=st.sampled_from(["GET", "HEAD"]))
def test_fuzz_h11_reads_every_accepted_response_alike(data: bytes, eof: bool, method: str) -> None:
    got = relay(ResponseFramer(request(f"{method} http://example.com/ HTTP/1.1")), whole(data), eof)
    if not isinstance(got, Relayed) or not got.ended:
        return
    status = int(got.head.split(b" ")[1])
    assert h11_response(method, data, eof) == (status, got.body)


# -- purity -------------------------------------------------------------------------------------

FORBIDDEN = {"asyncio", "socket", "ssl", "selectors", "threading"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_protocol_modules_import_no_io() -> None:
    package = Path(http1.__file__).parent
    for path in (package / "http1.py", package / "__init__.py"):
        roots = {name.split(".")[0] for name in imported_modules(path)}
        assert not roots & FORBIDDEN, path.name


def test_importing_http1_loads_no_io_module() -> None:
    code = (
        "import sys, egressbox.protocols.http1\n"
        f"print(sorted(set({sorted(FORBIDDEN)!r}) & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_connect_without_host_header_is_accepted() -> None:
    # Tunnelling clients (nc -X connect, some SDKs) send no Host with CONNECT.
    parser = http1.RequestHeadParser()
    head = parser.feed(b"CONNECT a.b:443 HTTP/1.1\r\n\r\nhello")
    assert head is not None
    assert (head.kind, head.host, head.port) == (http1.RequestKind.CONNECT, "a.b", 443)
    assert parser.trailing == b"hello"


# -- request heads: one path, whatever the chunking --------------------------------------------


def first_byte_apart(data: bytes, max_head_bytes: int) -> Parsed:
    """The first byte alone, then the rest: the head is never whole in the first feed."""
    return run_parser([data[:1], data[1:]], max_head_bytes)


def same_every_way(data: bytes, limit: int, cut: int) -> None:
    """Whole, with the first byte apart, and cut at `cut`: one verdict, one head, one rest."""
    first = run_parser(whole(data), limit)
    assert first_byte_apart(data, limit) == first
    assert run_parser(split_at(data, [cut]), limit) == first


@st.composite
def random_heads(draw: st.DrawFn) -> bytes:
    """Heads built from valid and invalid request lines and field lines, CRLF or not."""
    first = draw(
        st.sampled_from([GET, POST, "CONNECT example.com:443 HTTP/1.1", "GET / HTTP/2", "GET  /"])
        | st.binary(max_size=30).map(lambda b: b.decode("latin-1"))
    )
    fields = draw(
        st.lists(
            st.sampled_from(["Host: example.com", "Content-Length: 3", "X: y", " fold", "A : b"])
            | st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
            max_size=6,
        )
    )
    ends = draw(st.sampled_from(["\r\n\r\n", "\r\n\r\nrest", "\n\r\n", "\r\n\r\r\n\r\n"]))
    lead = draw(st.sampled_from(["", "", "\r\n"]))
    return (lead + "\r\n".join([first, *fields]) + ends).encode("latin-1")


COMMON_FIELDS = [
    "Host: a.b:443",
    "host: a.b",
    "Host: a.b:0",
    "Host: [::1]:443",
    "Proxy-Connection: close",
    "Connection: keep-alive, x",
    "Connection: a b",
    "Proxy-Authorization: Basic dTpw",
    "X:\ty\t",
    "X: caf\xe9",
    "X:",
    "Content-Length: 0",
    "Content-Length: 3",
    "Transfer-Encoding: chunked",
    "Expect: 100-continue",
    "Upgrade: websocket",
]


@st.composite
def common_heads(draw: st.DrawFn) -> bytes:
    """CONNECT and http:// heads near the edges of the common shapes: hosts with brackets,
    userinfo or URL delimiters, ports out of range, other versions and methods, and field
    blocks at the field limit or one past it."""
    host = draw(
        st.sampled_from(["a.b", "127.0.0.1", "[::1]", "a@b", "", "x%y", "a[b", "a/b", "a?b"])
        | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7F), min_size=1, max_size=8)
    )
    port = draw(st.sampled_from(["443", "0", "65535", "65536", "00443", "", "4x", "99999999"]))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/1.2", "HTTP/2"]))
    method = draw(st.sampled_from(["CONNECT", "CONNECT", "connect", "GET", "OPTIONS", "P@ST"]))
    if draw(st.booleans()):
        scheme = draw(st.sampled_from(["http://", "http://", "HTTP://", "ws://", "https://"]))
        authority = host if draw(st.booleans()) else f"{host}:{port}"
        path = draw(
            st.sampled_from(["", "/", "/a?b=c", "?q", "/#f", "/caf\xe9", "/a b", "/\x7f", "//x"])
        )
        target = scheme + authority + path
    else:
        target = f"{host}:{port}"
    fields = draw(st.lists(st.sampled_from(COMMON_FIELDS), max_size=5))
    if draw(st.booleans()):
        fields = fields + ["X: y"] * (MAX_HEADER_FIELDS - len(fields) + draw(st.integers(0, 1)))
    lines = [f"{method} {target} {version}", *fields]
    return ("\r\n".join(lines) + "\r\n\r\n" + draw(st.sampled_from(["", "tail"]))).encode("latin-1")


@FUZZ
@given(
    data=common_heads(),
    limit=st.sampled_from([MAX_HEAD_BYTES, SMALL_HEAD]),
    cut=st.integers(0, 600),
)
def test_common_shaped_heads_do_not_depend_on_chunking(data: bytes, limit: int, cut: int) -> None:
    same_every_way(data, limit, cut)


@FUZZ
@given(
    data=random_heads() | mutated() | st.binary(max_size=300),
    limit=st.sampled_from([MAX_HEAD_BYTES, SMALL_HEAD, 40]),
    cut=st.integers(0, 300),
)
def test_random_heads_do_not_depend_on_chunking(data: bytes, limit: int, cut: int) -> None:
    same_every_way(data, limit, cut)


@pytest.mark.parametrize("raw", ALL_REQUESTS)
def test_every_listed_request_is_read_alike_at_every_limit(raw: bytes) -> None:
    data = raw + TRAILING
    for limit in (MAX_HEAD_BYTES, SMALL_HEAD, len(raw), len(raw) - 1):
        same_every_way(data, limit, len(raw) // 2)


def test_every_name_asked_of_an_index_is_indexed() -> None:
    # The field index holds only the names in _INDEXED: a lookup of any other name
    # there would find nothing, whatever the head holds.
    # The source beside the module (compiled, __file__ is the extension).
    source = (Path(http1.__file__).parent / "http1.py").read_text(encoding="utf-8")
    asked = set(re.findall(r"index(?:\(fields\))?\.get\(\s*\"([^\"]+)\"", source))
    assert asked
    assert asked <= http1._INDEXED, asked - http1._INDEXED


def test_a_head_gives_every_value_of_any_name() -> None:
    head = accept(req(GET, "X-One: 1", "x-one: 2", "Accept: */*", "Connection: close"))
    assert head.header("X-ONE") == ["1", "2"]
    assert head.header("accept") == ["*/*"]
    assert head.header("connection") == ["close"]
    assert head.header("missing") == []
    head.header("x-one").append("3")  # a copy: the head is unchanged
    assert head.header("x-one") == ["1", "2"]


def test_a_head_is_still_frozen() -> None:
    head = accept(req(GET))
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        head.method = "POST"  # type: ignore[misc]
    assert hash(head) == hash(accept(req(GET)))


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[bytes]:
    """Record the bytes that the module function `name` reads each time (it still runs)."""
    calls: list[bytes] = []
    real = getattr(http1, name)

    def counting(*args: object) -> object:
        calls.append(next(arg for arg in args if isinstance(arg, bytes)))
        return real(*args)

    monkeypatch.setattr(http1, name, counting)
    return calls


@pytest.mark.pure_only
def test_one_reading_of_a_request_head_however_it_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = count_calls(monkeypatch, "_request_line")
    heads = count_calls(monkeypatch, "_request_head")
    raw = req("CONNECT example.com:443 HTTP/1.1", "User-Agent: x", host="example.com:443")
    for chunks in (whole(raw + TRAILING), bytewise(raw + TRAILING), split_at(raw, [9, 40])):
        lines.clear()
        heads.clear()
        parsed = run_parser(chunks)
        assert parsed.head is not None
        assert parsed.head.kind is RequestKind.CONNECT
        # Each line read once: the request line when it is complete, then the head.
        assert lines == [b"CONNECT example.com:443 HTTP/1.1"]
        assert heads == [raw[:-2]]


@pytest.mark.pure_only
def test_one_reading_of_a_response_head_however_it_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = count_calls(monkeypatch, "_status_line")
    heads = count_calls(monkeypatch, "_response_fields")
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n"
    for chunks in (whole(head + b"ok"), bytewise(head + b"ok"), split_at(head + b"ok", [5, 20])):
        lines.clear()
        heads.clear()
        framer = ResponseFramer(request())
        events = [event for chunk in chunks for event in framer.feed(chunk)]
        assert [type(e) for e in events if not isinstance(e, BodyData)] == [
            ResponseHead,
            EndOfMessage,
        ]
        assert lines == [b"HTTP/1.1 200 OK"]
        assert heads == [head[:-2]]


def test_framing_faults_are_refused_before_the_head_is_complete() -> None:
    # The head's end need not have arrived for a bare CR or LF, or for a head past the
    # limit: the scanner refuses them as soon as it sees them.
    for partial, status in [
        (b"GET http://a/ HTTP/1.1\nHost", 400),
        (b"GET http://a/ HTTP/1.1\r\nHost: a\rb", 400),
        (b"GET http://a/" + b"a" * SMALL_HEAD, 414),
        (b"GET http://a/ HTTP/1.1\r\nX: " + b"a" * SMALL_HEAD, 431),
    ]:
        for chunks in (whole(partial), bytewise(partial)):
            parsed = run_parser(chunks, SMALL_HEAD)
            assert parsed.error is not None
            assert parsed.error[0] == status


def test_the_start_line_is_read_as_soon_as_it_is_complete() -> None:
    # A client or an upstream that speaks no HTTP (a banner, then silence) is refused
    # at once, without waiting for a head that never comes.
    for line in (b"SSH-2.0-OpenSSH_9.2\r\n", b"GET / HTTP/1.1\r\n", b"GET http://a/ HTTP/2\r\n"):
        assert run_parser(whole(line)).error is not None
        assert run_parser(bytewise(line)) == run_parser(whole(line))
    framer = ResponseFramer(request())
    with pytest.raises(UpstreamResponseError, match="malformed status line"):
        framer.feed(b"220 mail.example.com ESMTP\r\n")


def test_field_lines_are_read_once_the_head_is_complete() -> None:
    # A bad field line is refused when the empty line arrives, whatever the chunking.
    partial = req(GET, " folded")[:-2]
    assert run_parser(whole(partial)) == Parsed(None, b"", None)
    assert run_parser(bytewise(partial)) == Parsed(None, b"", None)
    assert refuse(req(GET, " folded"))[0] == 400


# -- responses: one path whatever the chunking, and reuse of the upstream connection -----------


@FUZZ
@given(
    data=st.binary(max_size=200) | mutated(RESPONSE_SEEDS),
    limit=st.sampled_from([MAX_HEAD_BYTES, SMALL_HEAD, 40, 20]),
    eof=st.booleans(),
    cut=st.integers(0, 200),
)
def test_responses_do_not_depend_on_chunking(data: bytes, limit: int, eof: bool, cut: int) -> None:
    client = request()
    first = relay(ResponseFramer(client, limit), whole(data), eof)
    assert relay(ResponseFramer(client, limit), [data[:1], data[1:]], eof) == first
    assert relay(ResponseFramer(client, limit), split_at(data, [cut]), eof) == first


@pytest.mark.parametrize(
    ("response", "reusable"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", True),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", True),
        (b"HTTP/1.1 204 No Content\r\n\r\n", True),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: x, Close\r\n\r\nok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokX", False),  # a byte after the end
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\no", False),  # not ended
    ],
)
def test_reusable_only_after_a_clean_persistent_response(response: bytes, reusable: bool) -> None:
    for chunks in (whole(response), bytewise(response)):
        framer = ResponseFramer(request())
        for chunk in chunks:
            framer.feed(chunk)
        assert framer.reusable is reusable


def test_a_byte_after_the_end_in_a_later_feed_spoils_reuse() -> None:
    framer = ResponseFramer(request())
    framer.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert framer.reusable
    assert framer.feed(b"HTTP/1.1 200 OK\r\n") == []
    assert not framer.reusable


def test_a_close_delimited_body_is_never_reusable() -> None:
    framer = ResponseFramer(request())
    framer.feed(b"HTTP/1.1 200 OK\r\n\r\nbody")
    framer.feed_eof()
    assert not framer.reusable


def test_forward_head_asks_for_persistence_only_when_told() -> None:
    head = request()
    assert b"\r\nConnection: close\r\n" in forward_head(head)
    kept = forward_head(head, keep_alive=True)
    assert b"Connection:" not in kept
    upgrade = forward_head(ws_request(), keep_alive=True)
    assert b"\r\nConnection: Upgrade\r\n" in upgrade


@given(st.text(max_size=22) | st.from_regex(r"[0-9]{1,20}", fullmatch=True))
def test_content_length_takes_ascii_digits_only(text: str) -> None:
    """The one reading of a Content-Length value agrees with `[0-9]+` up to 18 digits."""
    wanted = re.fullmatch(r"[0-9]+", text) is not None and len(text) <= 18
    try:
        length = http1._content_length([text], http1._bad_request)
    except http1.HttpError:
        assert not wanted
    else:
        assert wanted
        assert length == int(text)
