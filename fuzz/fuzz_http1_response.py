"""Fuzz the upstream side of HTTP/1.1: response heads and framing (`ResponseFramer`).

The bytes are what an origin sends back; each input is framed for several requests
(GET, HEAD, an HTTP/1.0 client, a PUT that expects 100-continue, `Connection: close`,
a WebSocket upgrade), first without and then with the origin closing. Checked:

- the only exception is UpstreamResponseError (the proxy's 502);
- the events are well formed: 1xx only before the final head, at most one head and
  one end, nothing after the end or after `Upgraded`;
- fed whole and fed in two pieces, the client gets the same 1xx, head, body, end,
  keep-alive and reuse verdict, or the same error (also with a small head limit);
- what we write to the client parses with h11 to the same status and body;
- for GET and HEAD, h11 reads the input to the same status and body
  (tests/protocols/test_http1.py's agreement test).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import atheris

import harness
from http_reference import canonical_chunked, decode_chunks, h11_response

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.core import hosts, limits
    from egressbox.protocols import http1

harness.check_pure([http1, hosts])


def _request(raw: bytes) -> http1.RequestHead:
    head = http1.RequestHeadParser().feed(raw)
    assert head is not None
    return head


# (name, the request, the method h11 sends for the comparisons, or None for none)
REQUESTS = [
    ("get", b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n", "GET"),
    ("head", b"HEAD http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n", "HEAD"),
    ("http10", b"GET http://example.com/ HTTP/1.0\r\n\r\n", "GET"),
    (
        "continue",
        b"PUT http://example.com/ HTTP/1.1\r\nHost: example.com\r\n"
        b"Expect: 100-continue\r\nContent-Length: 1\r\n\r\n",
        "PUT",
    ),
    (
        "close",
        b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n",
        "GET",
    ),
    (
        "upgrade",
        b"GET ws://example.com/chat HTTP/1.1\r\nHost: example.com\r\n"
        b"Upgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        None,
    ),
]
HEADS = [(name, _request(raw), method) for name, raw, method in REQUESTS]
# A head limit that inputs reach (see fuzz_http1_request).
SMALL_HEAD = 256
# Agreement with h11 on the input: as tests/protocols/test_http1.py, for an HTTP/1.1 GET or HEAD.
COMPARED_INPUT = {"get", "head"}


@dataclass(frozen=True)
class Relayed:
    """What the client receives, whatever the chunking (chunks decoded)."""

    informational: tuple[bytes, ...]
    head: bytes
    status: int
    body: bytes
    ended: bool
    keep_alive: bool | None
    reusable: bool
    upgraded: bool
    trailing: bytes  # after a 101: the upstream's bytes that followed it
    sent: bytes = field(default=b"", compare=False)  # chunks follow the feeds


@dataclass(frozen=True)
class Refused:
    status: int
    message: str


def summarize(framer: http1.ResponseFramer, events: list[http1.ResponseEvent]) -> Relayed:
    informational: list[bytes] = []
    head: http1.ResponseHead | None = None
    body = bytearray()
    end: http1.EndOfMessage | None = None
    upgraded: http1.Upgraded | None = None
    for event in events:
        assert end is None and upgraded is None, "an event after the end"
        if isinstance(event, http1.InformationalResponse):
            assert head is None, "a 1xx after the final head"
            informational.append(event.data)
        elif isinstance(event, http1.ResponseHead):
            assert head is None, "two final heads"
            head = event
        elif isinstance(event, http1.BodyData):
            assert head is not None and event.data, "body data before the head, or empty"
            body += event.data
        elif isinstance(event, http1.EndOfMessage):
            assert head is not None, "the end before the head"
            assert event.keep_alive == head.keep_alive
            body += event.data
            end = event
        else:
            assert head is None, "a 101 after a final head"
            upgraded = event
    sent = b"".join(event.data for event in events)
    if upgraded is not None:
        return Relayed(
            tuple(informational),
            upgraded.data,
            101,
            b"",
            False,
            None,
            False,
            True,
            framer.trailing,
            sent,
        )
    assert not framer.trailing
    if head is not None and ("Transfer-Encoding", "chunked") in head.headers:
        decoded = decode_chunks(bytes(body), ended=end is not None)
    else:
        decoded = bytes(body)
    return Relayed(
        tuple(informational),
        b"" if head is None else head.data,
        0 if head is None else head.status,
        decoded,
        end is not None,
        None if end is None else end.keep_alive,
        framer.reusable,
        False,
        b"",
        sent,
    )


def relay(
    request: http1.RequestHead, chunks: list[bytes], max_head_bytes: int = limits.MAX_HEAD_BYTES
) -> tuple[Relayed | Refused, ...]:
    """(before the upstream closes, after it closes), each Relayed or Refused."""
    framer = http1.ResponseFramer(request, max_head_bytes)
    events: list[http1.ResponseEvent] = []
    try:
        for chunk in chunks:
            events += framer.feed(chunk)
    except http1.UpstreamResponseError as exc:
        refused = Refused(exc.status, exc.message)
        return refused, refused
    before = summarize(framer, events)
    try:
        events += framer.feed_eof()
    except http1.UpstreamResponseError as exc:
        return before, Refused(exc.status, exc.message)
    return before, summarize(framer, events)


def check_with_h11(
    name: str, method: str, data: bytes, results: tuple[Relayed | Refused, ...]
) -> None:
    before, after = results
    for got, eof in ((before, False), (after, True)):
        if not isinstance(got, Relayed) or not got.ended:
            continue
        # The client side: what we send is one well-framed response (close-delimited
        # bodies go to a client that sees the close: the connection ends with them).
        closes = got.keep_alive is False
        assert h11_response(method, got.sent, eof=closes) == (got.status, got.body), name
        if name in COMPARED_INPUT:
            check_input(method, data, got, eof=eof)
        return


def check_input(method: str, data: bytes, got: Relayed, *, eof: bool) -> None:
    """h11 reads the origin's bytes to the same response (strictly, as in
    tests/protocols/test_http1.py).

    A chunked body is given to h11 without its extensions and trailers, which we drop:
    h11 is stricter about their form (BWS before `;`, and it validates framing fields such
    as Content-Length even in a trailer); fuzz_chunked covers the chunk syntax itself.
    """
    seen = h11_response(method, data, eof=eof)
    if seen is not None:
        assert seen == (got.status, got.body), seen
        return
    final_start = heads_end = 0
    for _ in range(len(got.informational) + 1):  # the 1xx heads, then the final one
        final_start, heads_end = heads_end, data.index(b"\r\n\r\n", heads_end) + 4
    final = data[final_start:heads_end]
    names = {line.partition(b":")[0].lower() for line in final.split(b"\r\n")[1:]}
    chunked = b"transfer-encoding" in names and method != "HEAD" and got.status not in (204, 304)
    assert chunked, "h11 refuses a response that we accept"
    canonical, body, _ = canonical_chunked(data[heads_end:])
    assert body == got.body
    seen = h11_response(method, data[:heads_end] + canonical, eof=eof)
    assert seen == (got.status, got.body), seen


def test_one_input(data: bytes) -> None:
    parts = harness.pieces(data)
    for name, request, method in HEADS:
        whole = relay(request, [data])
        split = relay(request, parts)
        assert split == whole, (name, split, whole)
        small = relay(request, [data], SMALL_HEAD)
        assert relay(request, parts, SMALL_HEAD) == small, (name, small)
        if method is not None:
            check_with_h11(name, method, data, whole)


if __name__ == "__main__":
    harness.main(test_one_input)
