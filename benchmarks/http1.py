"""Microseconds per head for the HTTP/1.1 parsers, in-process (protocols/http1.py).

    python benchmarks/http1.py [--rounds 7] [--seconds 0.2] [--json FILE]

Three heads that a proxy sees all the time:

  connect    `CONNECT host:443` as curl sends it (Host, User-Agent, Proxy-Connection)
  get        an absolute-form `GET http://host/path?query` with 8 header fields, as a
             browser or an HTTP library sends it
  response   `HTTP/1.1 200 OK` with 7 fields and a Content-Length, and its 13-byte body,
             framed for the client (the events the forwarder writes)

Each is parsed by a fresh `RequestHeadParser` (or `ResponseFramer`), as the proxy
does per request, fed three ways: `whole` (one feed: the common case, one read of
the socket), `halves` (two feeds, cut in the middle of a field line) and `bytewise`
(one byte per feed: the worst case, not a real client). The head is parsed and
checked every time; nothing is cached between runs but what the module caches
itself.

Timing: CPU time of this process (`time.process_time`, so that waiting for a core
on a shared machine is not counted); each round runs a loop for about --seconds
(at most --max-loops heads) and the figure kept is the best round's mean. Whether
the module ran compiled (mypyc) or interpreted is printed: set EGRESSBOX_PURE=1 for
the interpreted one.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import egressbox
from egressbox.protocols import http1

CONNECT = (
    b"CONNECT example.com:443 HTTP/1.1\r\n"
    b"Host: example.com:443\r\n"
    b"User-Agent: curl/7.88.1\r\n"
    b"Proxy-Connection: Keep-Alive\r\n"
    b"\r\n"
)
GET = (
    b"GET http://www.example.com/static/app.js?v=3 HTTP/1.1\r\n"
    b"Host: www.example.com\r\n"
    b"User-Agent: Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0\r\n"
    b"Accept: */*\r\n"
    b"Accept-Language: en-US,en;q=0.5\r\n"
    b"Accept-Encoding: gzip, deflate\r\n"
    b"Referer: http://www.example.com/\r\n"
    b"Cookie: session=0123456789abcdef; theme=dark\r\n"
    b"Connection: keep-alive\r\n"
    b"\r\n"
)
RESPONSE = (
    b"HTTP/1.1 200 OK\r\n"
    b"Date: Mon, 30 Nov 2026 12:00:00 GMT\r\n"
    b"Server: nginx/1.22.1\r\n"
    b"Content-Type: text/plain\r\n"
    b"Content-Length: 13\r\n"
    b"Last-Modified: Mon, 30 Nov 2026 11:00:00 GMT\r\n"
    b'ETag: "6566a0e0-d"\r\n'
    b"Accept-Ranges: bytes\r\n"
    b"\r\n"
    b"Hello, world!"
)
HEADS = {"connect": CONNECT, "get": GET, "response": RESPONSE}
# The request the response answers (the framer needs it); parsed once, outside the loop.
FOR_RESPONSE = b"GET http://www.example.com/ HTTP/1.1\r\nHost: www.example.com\r\n\r\n"


def whole(raw: bytes) -> list[bytes]:
    return [raw]


def halves(raw: bytes) -> list[bytes]:
    cut = len(raw) // 2
    return [raw[:cut], raw[cut:]]


def bytewise(raw: bytes) -> list[bytes]:
    return [raw[i : i + 1] for i in range(len(raw))]


SPLITS: dict[str, Callable[[bytes], list[bytes]]] = {
    "whole": whole,
    "halves": halves,
    "bytewise": bytewise,
}


def request_once(chunks: Sequence[bytes]) -> None:
    parser = http1.RequestHeadParser()
    for chunk in chunks:
        if parser.feed(chunk) is not None:
            return
    raise AssertionError("the head did not complete")


def response_once(request: http1.RequestHead, chunks: Sequence[bytes]) -> None:
    framer = http1.ResponseFramer(request)
    for chunk in chunks:
        events = framer.feed(chunk)
        if events and isinstance(events[-1], http1.EndOfMessage):
            return
    raise AssertionError("the response did not complete")


def runner(name: str, chunks: list[bytes]) -> Callable[[], None]:
    if name != "response":
        return lambda: request_once(chunks)
    request = http1.RequestHeadParser().feed(FOR_RESPONSE)
    assert request is not None
    return lambda: response_once(request, chunks)


def best_mean_us(run: Callable[[], None], rounds: int, seconds: float, max_loops: int) -> float:
    """The best round's mean time per call, in microseconds (each round bounded)."""
    run()  # warm up: imports, regex compilation, the module's caches
    best = float("inf")
    for _ in range(rounds):
        loops = 0
        started = time.process_time()
        deadline = time.monotonic() + seconds  # wall time: bounded however busy the machine
        while loops < max_loops:
            for _ in range(100):
                run()
            loops += 100
            if time.monotonic() >= deadline:
                break
        best = min(best, (time.process_time() - started) / loops * 1e6)
    return best


@dataclass(frozen=True)
class Row:
    head: str
    split: str
    bytes: int
    us_per_head: float


def measure(args: argparse.Namespace) -> list[Row]:
    rows = []
    for name, raw in HEADS.items():
        for split in args.splits:
            chunks = SPLITS[split](raw)
            # Byte by byte is ~50-100 x slower: fewer loops keep each round short.
            loops = args.max_loops if split != "bytewise" else max(args.max_loops // 50, 100)
            us = best_mean_us(runner(name, chunks), args.rounds, args.seconds, loops)
            rows.append(Row(name, split, len(raw), us))
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.2, help="per round (bounded)")
    parser.add_argument("--max-loops", type=int, default=200_000, help="heads per round at most")
    parser.add_argument("--splits", default="whole,halves,bytewise", type=lambda s: s.split(","))
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    unknown = set(args.splits) - set(SPLITS)
    if unknown:
        parser.error(f"unknown split(s) {sorted(unknown)}; choose from {sorted(SPLITS)}")
    build = "compiled (mypyc)" if egressbox.compiled_core() else "interpreted"
    print(f"egressbox http1, {build}, Python {platform.python_version()}")
    rows = measure(args)
    print(f"{'head':<10} {'split':<9} {'bytes':>5} {'us/head':>9}")
    for row in rows:
        print(f"{row.head:<10} {row.split:<9} {row.bytes:>5} {row.us_per_head:>9.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"build": build, "rows": [asdict(r) for r in rows]}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
