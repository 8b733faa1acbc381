"""h11 as the second opinion on HTTP/1.1, and a decoder for the chunks egressbox writes.

The comparisons are those of tests/protocols/test_http1.py (`h11_request`, `h11_response`,
`dechunk`): whatever egressbox accepts, h11 must read with the same framing, so no
message can mean one thing to the proxy and another to the hop behind it. The fuzz
targets also hand h11 what egressbox *writes* (the forwarded request, the framed
response): that must always parse, to the same message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import h11

__all__ = ["H11Request", "canonical_chunked", "decode_chunks", "h11_request", "h11_response"]

# One chunk as egressbox encodes it: lower-case hex without leading zeros, no extension.
_CHUNK_SIZE = re.compile(rb"([1-9a-f][0-9a-f]*|0)\r\n")
_HEX = re.compile(rb"[0-9A-Fa-f]+")


def decode_chunks(data: bytes, *, ended: bool) -> bytes:
    """The body in chunks that egressbox wrote (`ended`: up to and with the last chunk).

    An AssertionError if `data` is not exactly such chunks: egressbox re-frames every
    body canonically, so anything else in its output is a bug.
    """
    body = bytearray()
    while data:
        match = _CHUNK_SIZE.match(data)
        assert match is not None, f"not a canonical chunk: {data[:40]!r}"
        size = int(match.group(1), 16)
        data = data[match.end() :]
        if size == 0:
            assert ended, "a last chunk before the end of the body"
            assert data == b"\r\n", f"bytes after the last chunk: {data[:40]!r}"
            return bytes(body)
        assert data[size : size + 2] == b"\r\n", "chunk data not followed by CRLF"
        body += data[:size]
        data = data[size + 2 :]
    assert not ended, "the body ended without its last chunk"
    return bytes(body)


def canonical_chunked(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(the chunks without extensions or trailers, the body, the bytes after the body).

    For a chunked body that egressbox accepted, read again in one pass from the grammar
    of RFC 9112 §7.1 as `http1` documents it (size, optional `BWS ; extension`, CRLF;
    data; CRLF; trailer lines; an empty line). What egressbox drops (extensions, trailer
    fields) is dropped here too, so h11 can read the result even where it is stricter
    about the forms the RFC allows (BWS before `;`).
    """
    out, body = bytearray(), bytearray()
    while True:
        line, data = _line(data)
        digits = _HEX.match(line)
        assert digits is not None, f"no chunk size: {line[:40]!r}"
        size = int(digits.group(), 16)
        out += b"%x\r\n" % size
        if size == 0:
            break
        body += data[:size]
        out += data[:size] + b"\r\n"
        assert data[size : size + 2] == b"\r\n", "chunk data not followed by CRLF"
        data = data[size + 2 :]
    while True:
        line, data = _line(data)
        if not line:
            return bytes(out + b"\r\n"), bytes(body), data


def _line(data: bytes) -> tuple[bytes, bytes]:
    end = data.index(b"\r\n")
    return data[:end], data[end + 2 :]


@dataclass(frozen=True)
class H11Request:
    """A request as h11 reads it: the parts that decide where it goes and where it ends."""

    method: bytes
    target: bytes
    headers: tuple[tuple[bytes, bytes], ...]  # raw names, values as h11 keeps them
    body: bytes
    trailing: bytes  # the bytes after the end of the body


def h11_request(data: bytes) -> H11Request | None:
    """The first request in `data` as h11 reads it, or None if h11 refuses or needs more."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    request: h11.Request | None = None
    body = bytearray()
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return None
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return H11Request(
                    request.method,
                    request.target,
                    tuple(request.headers.raw_items()),
                    bytes(body),
                    conn.trailing_data[0],
                )
    except h11.RemoteProtocolError:
        return None


def h11_response(method: str, data: bytes, *, eof: bool) -> tuple[int, bytes] | None:
    """(final status, body) of the response to `method /` as h11 reads it, or None."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method=method, target="/", headers=[("Host", "example.com")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    if eof:
        conn.receive_data(b"")
    status, body = 0, bytearray()
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return None
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, bytes(body)
    except h11.RemoteProtocolError:
        return None
