"""Audit log throughput: records written by the sink, and records read by --summary.

    .venv/bin/python benchmarks/audit.py [--records 200000] [--threads 8] [--processes 4]
        [--connections 3000] [--concurrency 100] [--read-mb 100] [--json FILE]

Write side:
  sink              one thread writing records into a JsonlFileSink (one write(2) each),
                    without and with rotation (--rotate-mb, keep 3);
  decision_line     the proxy's line per decision alone, without writing it (CPU time);
  sink, line path   the proxy's own path per decision: decision_line (the record's line,
                    no record object) then write_json, one thread;
  sink threads      --threads threads sharing one sink (the lock and the GIL in play);
  sink processes    --processes processes, each with its own sink on the same file
                    (O_APPEND: the kernel orders the lines);
  proxy             an in-process EgressProxy on loopback answering --connections CONNECT
                    requests, at most --concurrency at once, with no sink and with a
                    JsonlFileSink: connections per second, i.e. records per second written
                    under concurrent connections, and the cost per connection the sink adds
                    (best of --rounds, alternated). Two paths: a denied name (decision,
                    record, 403; no DNS) and an allowed IP literal (record, dial, tunnel).

Read side:
  summarize         read_records + summarize over a generated ~--read-mb MB log;
  audit --summary   the command's own path (filter, malformed-line accounting);
  gzip              the same log gzip-compressed (compression level 6);
  and the peak RSS of `audit --summary` run as its own process: the same for a 10 MB
  and a 100 MB log, as memory grows with distinct host:port pairs, not with the file.

Every loop is bounded by a record or connection count; files live in a temporary
directory that is removed at the end; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gzip
import io
import json
import multiprocessing
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from egressbox.audit.record import (
    AuditProtocol,
    AuditRecord,
    JsonlFileSink,
    decision_line,
    read_records,
    summarize,
)
from egressbox.cli import audit as audit_cli
from egressbox.core.errors import Reason, Verdict
from egressbox.core.policy import parse_policy
from egressbox.proxy.server import EgressProxy

HOST = "127.0.0.1"
IO_TIMEOUT = 10.0  # seconds per client step; a stuck proxy fails the run instead of hanging
DISTINCT_TARGETS = 2_000  # host:port pairs in the generated log: a busy proxy's variety
OUTCOMES = (
    (Verdict.ALLOW, Reason.ALLOWED),
    (Verdict.ALLOW, Reason.ALLOWED),
    (Verdict.ALLOW, Reason.ALLOWED),
    (Verdict.DENY, Reason.NO_ALLOW_RULE),
    (Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE),
    (Verdict.DENY, Reason.PRIVATE_ADDRESS),
)


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    records: int
    seconds: float
    note: str = ""

    @property
    def per_second(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def us_each(self) -> float:
        return self.seconds / self.records * 1e6 if self.records else 0.0


def sample_records(count: int) -> list[AuditRecord]:
    t0 = datetime(2026, 11, 30, tzinfo=UTC)
    out = []
    for i in range(count):
        verdict, reason = OUTCOMES[i % len(OUTCOMES)]
        target = i % DISTINCT_TARGETS
        host = f"svc{target}.team{target % 37}.example.com"
        protocol = (AuditProtocol.CONNECT, AuditProtocol.HTTP, AuditProtocol.SOCKS5)[i % 3]
        ts = t0 + timedelta(milliseconds=i)
        out.append(AuditRecord(ts, protocol, host, 443, verdict, reason))
    return out


# --------------------------------------------------------------------------- sink


def bench_sink(
    directory: str, records: Sequence[AuditRecord], rotate_bytes: int | None, name: str
) -> Row:
    path = os.path.join(directory, f"{name.replace(' ', '-')}.jsonl")
    with JsonlFileSink(path, max_bytes=rotate_bytes, keep=3) as sink:
        write = sink.write
        start = time.perf_counter()
        for record in records:
            write(record)
        seconds = time.perf_counter() - start
    note = f"rotating every {rotate_bytes // 2**20} MiB" if rotate_bytes else "no rotation"
    return Row(name, len(records), seconds, note)


def bench_line_path(directory: str, records: Sequence[AuditRecord]) -> Row:
    """decision_line + write_json per record: what the proxy does for each decision."""
    path = os.path.join(directory, "line-path.jsonl")
    fields = [(r.protocol, r.host, r.port, r.decision, r.reason) for r in records]
    clock = time.time_ns
    with JsonlFileSink(path) as sink:
        write = sink.write_json
        start = time.perf_counter()
        for protocol, host, port, verdict, reason in fields:
            line = decision_line(protocol, host, port, verdict, reason, now_ns=clock())
            if line is None:
                raise SystemExit(f"decision_line refused {host!r}")
            write(line)
        seconds = time.perf_counter() - start
    return Row("sink, line path", len(records), seconds, "decision_line + write_json")


def bench_line_only(records: Sequence[AuditRecord]) -> Row:
    """decision_line alone, in CPU time (no write): the user-space cost of the line."""
    fields = [(r.protocol, r.host, r.port, r.decision, r.reason) for r in records]
    clock = time.time_ns
    start = time.process_time()
    for protocol, host, port, verdict, reason in fields:
        if decision_line(protocol, host, port, verdict, reason, now_ns=clock()) is None:
            raise SystemExit(f"decision_line refused {host!r}")
    seconds = time.process_time() - start
    return Row("decision_line", len(records), seconds, "CPU time, no write")


def bench_sinks(directory: str, args: argparse.Namespace) -> list[Row]:
    records = sample_records(args.records)
    return [
        bench_sink(directory, records, None, "sink, 1 thread"),
        bench_line_only(records),
        bench_line_path(directory, records),
        bench_sink(directory, records, args.rotate_mb * 2**20, "sink, 1 thread, rotating"),
        bench_threads(directory, records, args.threads),
        bench_processes(directory, args.records, args.processes),
    ]


def bench_threads(directory: str, records: Sequence[AuditRecord], threads: int) -> Row:
    path = os.path.join(directory, "threads.jsonl")
    per = len(records) // threads
    with JsonlFileSink(path) as sink:
        barrier = threading.Barrier(threads + 1)

        def work(chunk: Sequence[AuditRecord]) -> None:
            barrier.wait()
            for record in chunk:
                sink.write(record)

        workers = [
            threading.Thread(target=work, args=(records[i * per : (i + 1) * per],))
            for i in range(threads)
        ]
        for worker in workers:
            worker.start()
        barrier.wait()
        start = time.perf_counter()
        for worker in workers:
            worker.join()
        seconds = time.perf_counter() - start
    return Row(f"sink, {threads} threads", per * threads, seconds, "one shared sink")


def _process_writer(path: str, count: int, ready: Any, go: Any) -> None:
    records = sample_records(count)
    with JsonlFileSink(path) as sink:
        ready.put(True)
        go.wait()
        for record in records:
            sink.write(record)


def bench_processes(directory: str, count: int, processes: int) -> Row:
    path = os.path.join(directory, "processes.jsonl")
    ctx = multiprocessing.get_context("fork")
    ready, go = ctx.Queue(), ctx.Event()
    per = count // processes
    children = [
        ctx.Process(target=_process_writer, args=(path, per, ready, go)) for _ in range(processes)
    ]
    for child in children:
        child.start()
    for _ in children:
        ready.get(timeout=60)
    start = time.perf_counter()
    go.set()
    for child in children:
        child.join(timeout=600)
    seconds = time.perf_counter() - start
    lines = sum(1 for _ in open(path, "rb"))  # noqa: SIM115 - read once, closed by GC
    if lines != per * processes:
        raise SystemExit(f"lost records: {lines} of {per * processes}")
    return Row(f"sink, {processes} processes", lines, seconds, "a sink each, one file")


# --------------------------------------------------------------------------- proxy


async def _origin() -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.read(1)  # the client closes; nothing is sent
        writer.close()

    return await asyncio.start_server(handle, HOST, 0)


async def _one_connect(address: tuple[str, int], target: str, expect: bytes) -> None:
    reader, writer = await asyncio.open_connection(*address)
    try:
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(expect):
            raise SystemExit(f"unexpected reply to CONNECT {target}: {head[:40]!r}")
    finally:
        writer.close()


async def _drive(
    address: tuple[str, int], target: str, expect: bytes, connections: int, concurrency: int
) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            await asyncio.wait_for(_one_connect(address, target, expect), IO_TIMEOUT)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(connections)))
    return time.perf_counter() - start


async def _proxy_round(
    directory: str, path_kind: str, with_sink: bool, connections: int, concurrency: int
) -> float:
    origin = await _origin()
    port = origin.sockets[0].getsockname()[1]
    policy = parse_policy(
        {"egress": {"allow": [f"{HOST}:{port}"], "allow_cidrs": ["127.0.0.0/8"]}}, env={}
    )
    sink = JsonlFileSink(os.path.join(directory, "proxy.jsonl")) if with_sink else None
    target, expect = (
        ("denied.example:443", b"HTTP/1.1 403")
        if path_kind == "denied"
        else (f"{HOST}:{port}", b"HTTP/1.1 200")
    )
    try:
        async with EgressProxy(policy, audit=sink) as proxy:
            assert proxy.http_address is not None
            return await _drive(proxy.http_address, target, expect, connections, concurrency)
    finally:
        if sink is not None:
            sink.close()
        origin.close()
        await origin.wait_closed()


def run_async(main: Callable[[], Coroutine[Any, Any, float]]) -> float:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def bench_proxy(directory: str, args: argparse.Namespace) -> list[Row]:
    rows = []
    for kind in ("denied", "allowed"):
        best: dict[bool, float] = {}
        for _ in range(args.rounds):
            for with_sink in (False, True):  # alternated, so drift hits both alike
                seconds = run_async(
                    functools.partial(
                        _proxy_round, directory, kind, with_sink, args.connections, args.concurrency
                    )
                )
                best[with_sink] = min(best.get(with_sink, seconds), seconds)
        cost = (best[True] - best[False]) / args.connections * 1e6
        rows.append(Row(f"proxy {kind}, no sink", args.connections, best[False], "baseline"))
        rows.append(
            Row(
                f"proxy {kind}, JsonlFileSink",
                args.connections,
                best[True],
                f"sink adds {cost:+.1f} us/connection",
            )
        )
    return rows


# --------------------------------------------------------------------------- read


def generate_log(path: str, megabytes: int) -> int:
    """Write about `megabytes` MB of records; returns the count. Memory: one batch."""
    target = megabytes * 1_000_000
    batch = sample_records(10_000)
    lines = [record.to_json() + "\n" for record in batch]
    written = count = 0
    with open(path, "w", encoding="ascii") as f:
        while written < target:
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk)
            count += len(lines)
    return count


def child_summary_rss(path: str) -> float:
    """Peak RSS (MiB) of `egressbox audit FILE --summary` run as its own process."""
    code = "import sys; from egressbox.cli.audit import main; sys.exit(main(sys.argv[1:]))"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run(
        [sys.executable, "-c", code, path, "--summary"],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=600,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(before, after) / 1024


def bench_read(directory: str, megabytes: int) -> list[Row]:
    path = os.path.join(directory, "big.jsonl")
    count = generate_log(path, megabytes)
    size_mb = os.path.getsize(path) / 1e6
    start = time.perf_counter()
    rows = summarize(item for item in read_records(path) if isinstance(item, AuditRecord))
    seconds = time.perf_counter() - start
    assert sum(row.total for row in rows) == count
    out = [Row("summarize", count, seconds, f"{size_mb:.0f} MB, {size_mb / seconds:.0f} MB/s")]

    args = argparse.ArgumentParser()
    audit_cli.configure(args)
    start = time.perf_counter()
    code = audit_cli.run(args.parse_args([path, "--summary"]), out=io.StringIO(), err=io.StringIO())
    seconds = time.perf_counter() - start
    assert code == 0
    rss = child_summary_rss(path)
    note = f"{size_mb / seconds:.0f} MB/s; as a command, peak RSS {rss:.0f} MiB"
    out.append(Row("audit --summary", count, seconds, note))

    gz_path = path + ".1.gz"
    with open(path, "rb") as src, gzip.open(gz_path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    gz_mb = os.path.getsize(gz_path) / 1e6
    start = time.perf_counter()
    rows = summarize(item for item in read_records(gz_path) if isinstance(item, AuditRecord))
    seconds = time.perf_counter() - start
    assert sum(row.total for row in rows) == count
    out.append(Row("summarize, gzip input", count, seconds, f"{gz_mb:.1f} MB compressed"))
    return out


# --------------------------------------------------------------------------- main


def print_table(rows: Sequence[Row]) -> None:
    print(
        f"{'measurement':<34} {'records':>9} {'seconds':>8} {'records/s':>11} {'us each':>8}  note"
    )
    for row in rows:
        print(
            f"{row.name:<34} {row.records:>9} {row.seconds:>8.3f} {row.per_second:>11,.0f} "
            f"{row.us_each:>8.2f}  {row.note}"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--records", type=int, default=200_000, help="records per sink measurement")
    p.add_argument("--rotate-mb", type=int, default=8, help="rotation size for the rotating sink")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--connections", type=int, default=3_000, help="CONNECTs per proxy round")
    p.add_argument("--concurrency", type=int, default=100, help="connections open at once")
    p.add_argument("--rounds", type=int, default=3, help="proxy rounds; the best is kept")
    p.add_argument("--read-mb", type=int, default=100, help="size of the generated log")
    p.add_argument(
        "--only", choices=("sink", "proxy", "read"), action="append", help="run just these parts"
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs")
    directory = tempfile.mkdtemp(prefix="egressbox-audit-bench-")
    try:
        parts = set(args.only or ("sink", "proxy", "read"))
        rows = bench_sinks(directory, args) if "sink" in parts else []
        rows += bench_proxy(directory, args) if "proxy" in parts else []
        rows += bench_read(directory, args.read_mb) if "read" in parts else []
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print_table(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(row) | {"per_second": row.per_second} for row in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
