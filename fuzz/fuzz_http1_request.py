"""Fuzz the client side of HTTP/1.1: request heads, their bodies, pipelined requests.

The bytes are one client connection: heads (CONNECT, absolute-form `http://` and
`ws://` lines) each followed by its body, up to MAX_MESSAGES requests, until a CONNECT
or an upgrade hands the connection over to raw bytes. Checked on every input:

- the only exception is HttpError (with its subclass BadTargetPortError);
- fed whole and fed in two pieces, the connection gives the same requests, bodies,
  error and leftover bytes (only the chunk boundaries of a re-encoded body may move),
  with the default head limit and with a small one that inputs reach;
- what would go upstream (`forward_head` and the re-encoded body) parses with h11 to the
  same method, target, fields and body, with nothing left over;
- when the first request is forwarded and its body is complete, h11 reads the input to
  the same body and the same bytes after it (tests/protocols/test_http1.py's agreement test).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import atheris

import harness
from http_reference import canonical_chunked, decode_chunks, h11_request

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.core import hosts, limits
    from egressbox.protocols import http1

harness.check_pure([http1, hosts])

MAX_MESSAGES = 8
# A head limit that inputs reach (the default, 64 KiB, is beyond libFuzzer's inputs):
# the 414 and 431 refusals, found by the head scanner as bytes arrive, must not depend
# on the chunking either.
SMALL_HEAD = 256


@dataclass(frozen=True)
class Message:
    head: http1.RequestHead
    body: bytes  # what the upstream would get, chunks decoded
    # The body as we would send it (its chunks follow the feeds) and, when fed
    # whole, every byte after it: not compared between two ways of feeding.
    wire: bytes = field(default=b"", compare=False)
    after: bytes = field(default=b"", compare=False)


@dataclass(frozen=True)
class Connection:
    """Everything the parsers made of one client connection, however it was fed."""

    messages: tuple[Message, ...]
    error: tuple[int, str, type[http1.HttpError]] | None
    stage: str  # "head" or "body" while waiting for more, "tunnel" or "stop" at the end
    partial_body: bytes  # of the request whose body is still being read
    leftover: bytes  # after a CONNECT, an upgrade or the last message: not parsed


class _Driver:
    def __init__(self, max_head_bytes: int) -> None:
        self.max_head_bytes = max_head_bytes
        self.messages: list[Message] = []
        self.parser: http1.RequestHeadParser | None = http1.RequestHeadParser(max_head_bytes)
        self.head: http1.RequestHead | None = None
        self.reader: http1.RequestBodyReader | None = None
        self.raw_body = bytearray()
        self.leftover = bytearray()
        self.stage = "head"

    def feed(self, data: bytes) -> None:
        while self.stage in ("head", "body"):
            step = self._feed_head if self.stage == "head" else self._feed_body
            rest = step(data)
            if rest is None:
                return
            data = rest
        self.leftover += data

    def _feed_head(self, data: bytes) -> bytes | None:
        assert self.parser is not None
        head = self.parser.feed(data)
        if head is None:
            return None
        rest = self.parser.trailing
        self.parser = None
        if head.kind is http1.RequestKind.CONNECT or head.upgrade:
            # Tunnel bytes from here on (after the 101, for an upgrade).
            self.messages.append(Message(head, b"", b"", rest))
            self.stage = "tunnel"
            return rest
        self.head = head
        self.reader = http1.RequestBodyReader(head.body)
        self.raw_body = bytearray()
        self.stage = "body"
        return rest

    def _feed_body(self, data: bytes) -> bytes | None:
        assert self.reader is not None and self.head is not None
        self.raw_body += self.reader.feed(data)
        if not self.reader.done:
            return None
        rest = self.reader.trailing
        body = self._body(ended=True)
        self.messages.append(Message(self.head, body, bytes(self.raw_body), rest))
        self.head, self.reader = None, None
        if len(self.messages) >= MAX_MESSAGES:
            self.stage = "stop"
        else:
            self.parser = http1.RequestHeadParser(self.max_head_bytes)
            self.stage = "head"
        return rest

    def _body(self, *, ended: bool) -> bytes:
        assert self.head is not None
        if self.head.body.kind is http1.FramingKind.CHUNKED:
            return decode_chunks(bytes(self.raw_body), ended=ended)
        return bytes(self.raw_body)

    def result(self, error: http1.HttpError | None) -> Connection:
        partial = self._body(ended=False) if self.stage == "body" and error is None else b""
        failure = None if error is None else (error.status, error.message, type(error))
        return Connection(tuple(self.messages), failure, self.stage, partial, bytes(self.leftover))


def connection(chunks: list[bytes], max_head_bytes: int = limits.MAX_HEAD_BYTES) -> Connection:
    driver = _Driver(max_head_bytes)
    try:
        for chunk in chunks:
            driver.feed(chunk)
    except http1.HttpError as exc:
        return driver.result(exc)
    if driver.stage == "body":
        assert driver.reader is not None
        try:
            driver.reader.feed_eof()
        except http1.HttpError:
            pass
        else:
            raise AssertionError("feed_eof() accepted a body cut short")
    return driver.result(None)


def check_forwarded(message: Message) -> None:
    """h11, as the origin, reads what we would send upstream as the same request."""
    head = message.head
    try:
        out = http1.forward_head(head) + message.wire
    except ValueError:
        return  # a host the decision refuses (bad_host) is never forwarded
    seen = h11_request(out)
    assert seen is not None, f"h11 refuses what we forward: {out[:300]!r}"
    assert head.origin_target is not None
    assert seen.method == head.method.encode("ascii")
    assert seen.target == head.origin_target.encode("ascii")
    assert seen.body == message.body
    assert seen.trailing == b""
    lines = out[: out.index(b"\r\n\r\n")].split(b"\r\n")[1:]
    assert seen.headers == tuple(tuple(line.split(b": ", 1)) for line in lines)


def check_with_h11(data: bytes, result: Connection) -> None:
    """h11 reads the first forwarded request of the input as we do: same body, same end.

    Strict, as tests/protocols/test_http1.py's agreement test: h11 must accept the request. A
    chunked body is given to h11 without its extensions and trailers (which we drop):
    h11 is stricter than RFC 9112 about their form, fuzz_chunked covers them.
    """
    if not result.messages:
        return
    first = result.messages[0]
    if first.head.kind is not http1.RequestKind.FORWARD or first.head.upgrade:
        return
    # h11 does not skip the empty lines that RFC 9112 §2.2 lets us skip.
    stripped = data.lstrip(b"\r\n")
    seen = h11_request(stripped)
    if seen is not None:
        assert (seen.body, seen.trailing) == (first.body, first.after), seen
    if first.head.body.kind is http1.FramingKind.CHUNKED:
        parser = http1.RequestHeadParser()
        assert parser.feed(stripped) == first.head
        body_start = len(stripped) - len(parser.trailing)
        canonical, body, rest = canonical_chunked(parser.trailing)
        assert (body, rest) == (first.body, first.after)
        stripped = stripped[:body_start] + canonical + rest
        seen = h11_request(stripped)
    assert seen is not None, "h11 refuses a request that we accept"
    assert (seen.body, seen.trailing) == (first.body, first.after), seen


def test_one_input(data: bytes) -> None:
    parts = harness.pieces(data)
    whole = connection([data])
    split = connection(parts)
    assert split == whole, (split, whole)
    small = connection([data], SMALL_HEAD)
    assert connection(parts, SMALL_HEAD) == small, small
    for message in whole.messages:
        http1.proxy_credentials(message.head)  # never raises: None for anything malformed
        if message.head.kind is http1.RequestKind.FORWARD:
            check_forwarded(message)
    check_with_h11(data, whole)


if __name__ == "__main__":
    harness.main(test_one_input)
