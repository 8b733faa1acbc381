"""Fuzz chunked body decoding (RFC 9112 §7.1): sizes, extensions, data, trailers.

The bytes are a chunked body and whatever follows it. They are decoded as a client's
request body (`RequestBodyReader`) and as an origin's response body (`ResponseFramer`
after a chunked head). Checked:

- the only exception is HttpError (400) or UpstreamResponseError (502);
- fed whole and fed in two pieces: the same body, end, bytes after it, or error;
- the request side and the response side decode alike: same body, end and refusal;
- what we send on is canonical chunks that decode to the same body, by us and by h11;
- an accepted body, read again in one pass (`canonical_chunked`), has the same body and
  end; h11 reads it so, and reads the input so whenever it accepts it too (h11 is
  stricter about some forms the RFC allows: a refusal by h11 is no finding, a
  different reading is).
"""

from __future__ import annotations

from dataclasses import dataclass

import atheris

import harness
from http_reference import canonical_chunked, decode_chunks, h11_request

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.core import hosts
    from egressbox.protocols import http1

harness.check_pure([http1, hosts])

_REQUEST_HEAD = b"POST / HTTP/1.1\r\nHost: example.com\r\nTransfer-Encoding: chunked\r\n\r\n"
_RESPONSE_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


def _client() -> http1.RequestHead:
    head = http1.RequestHeadParser().feed(
        b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n"
    )
    assert head is not None
    return head


_CLIENT = _client()


@dataclass(frozen=True)
class Decoded:
    body: bytes  # so far, if not done
    done: bool
    trailing: bytes  # after the body (request side only)
    error: str | None


def request_side(chunks: list[bytes]) -> tuple[Decoded, bytes]:
    """The request body reader's verdict, and the bytes it sent on."""
    reader = http1.RequestBodyReader(http1.CHUNKED_BODY)
    sent = bytearray()
    try:
        for chunk in chunks:
            sent += reader.feed(chunk)
    except http1.HttpError as exc:
        assert exc.status == 400, exc.status
        return Decoded(b"", False, b"", exc.message), b""
    body = decode_chunks(bytes(sent), ended=reader.done)
    return Decoded(body, reader.done, reader.trailing, None), bytes(sent)


def response_side(chunks: list[bytes]) -> Decoded:
    framer = http1.ResponseFramer(_CLIENT)
    events: list[http1.ResponseEvent] = []
    try:
        events += framer.feed(_RESPONSE_HEAD)
        for chunk in chunks:
            events += framer.feed(chunk)
    except http1.UpstreamResponseError as exc:
        return Decoded(b"", False, b"", exc.message)
    assert isinstance(events[0], http1.ResponseHead)
    ended = isinstance(events[-1], http1.EndOfMessage)
    sent = b"".join(event.data for event in events[1:])
    return Decoded(decode_chunks(sent, ended=ended), ended, b"", None)


def test_one_input(data: bytes) -> None:
    whole, sent = request_side([data])
    split, _ = request_side(harness.pieces(data))
    assert split == whole, (split, whole)
    upstream = response_side([data])
    assert response_side(harness.pieces(data)) == upstream
    # The framer drops what follows the body; the rest must agree.
    assert upstream == Decoded(whole.body, whole.done, b"", whole.error), (upstream, whole)
    if not whole.done:
        return
    again, resent = request_side([sent])
    assert (again, resent) == (Decoded(whole.body, True, b"", None), sent), "not canonical"
    seen = h11_request(_REQUEST_HEAD + sent)
    assert seen is not None and (seen.body, seen.trailing) == (whole.body, b"")
    canonical, body, rest = canonical_chunked(data)
    assert (body, rest) == (whole.body, whole.trailing)
    seen = h11_request(_REQUEST_HEAD + canonical + rest)
    assert seen is not None, "h11 refuses the body without its extensions and trailers"
    assert (seen.body, seen.trailing) == (whole.body, whole.trailing)
    seen = h11_request(_REQUEST_HEAD + data)
    if seen is not None:
        assert (seen.body, seen.trailing) == (whole.body, whole.trailing), seen


if __name__ == "__main__":
    harness.main(test_one_input)
