"""Relay speed, CPU and idle memory on loopback, with source, relay and sink as separate processes.

    .venv/bin/python benchmarks/relay.py [--mib 1024] [--runs 3] [--tunnels 2000]

For each relay design it pushes --mib MiB through source -> relay -> sink
(--runs times, median MB/s), and records the relay process's CPU seconds per
GB (getrusage in the relay process, from accept to the end of the relay). It
also runs a ping-pong of small messages (round trips per second, a proxy for
interactive traffic), measures the CPU cost of one Protocol->splice switch
(in-process, to tune SPLICE_THRESHOLD), and the RSS per idle tunnel (RSS
delta over --tunnels idle tunnels / --tunnels) in the relay process.

Every process binds 127.0.0.1 only; every loop is bounded by a byte or
connection count, and every child is killed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Coroutine
from typing import Any

import uvloop

from egressbox.net.relay import SPLICE_THRESHOLD, Tunnel, open_tunnel, relay

HOST = "127.0.0.1"
CHUNK = 1 << 20  # source/sink syscall size: 1 MiB, as in FIELD-NOTES' measurements
PING_SIZE = 1024  # one small request/response message
PING_COUNT = 20_000  # round trips per ping-pong run
IDLE_WARM_UP = 100  # tunnels opened before the RSS baseline is taken
SWITCH_SAMPLES = 300  # tunnels per variant when timing the switch
CHILD_TIMEOUT = 300.0  # no child may run longer than this

# mode -> (event loop, splice_threshold); None = no relay (direct).
MODES: dict[str, tuple[str, int | None] | None] = {
    "direct": None,
    "protocol": ("asyncio", None),
    "protocol-uvloop": ("uvloop", None),
    "splice": ("asyncio", 0),
    "splice-uvloop": ("uvloop", 0),
    "hybrid": ("asyncio", SPLICE_THRESHOLD),
    "hybrid-uvloop": ("uvloop", SPLICE_THRESHOLD),
}


# --- helpers used by every role ---------------------------------------------------------


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def raise_nofile() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_loop(kind: str, main: Coroutine[Any, Any, None]) -> None:
    if kind == "uvloop":
        uvloop.run(main)
    else:
        asyncio.run(main)


def listener() -> socket.socket:
    sock = socket.create_server((HOST, 0), backlog=4096)
    emit({"port": sock.getsockname()[1]})
    return sock


# --- roles (each runs in its own process) -------------------------------------------------


def role_sink() -> None:
    with listener() as server:
        conn, _ = server.accept()
        started = time.perf_counter()
        buf, total = bytearray(CHUNK), 0
        with conn:
            while n := conn.recv_into(buf):
                total += n
        emit({"bytes": total, "seconds": time.perf_counter() - started})


def role_source(port: int, nbytes: int) -> None:
    chunk = memoryview(os.urandom(CHUNK))
    with socket.create_connection((HOST, port)) as sock:
        left = nbytes
        while left:
            n = min(left, CHUNK)
            sock.sendall(chunk[:n])
            left -= n
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(CHUNK):
            pass


def role_echo() -> None:
    with listener() as server:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(CHUNK):
                conn.sendall(data)


def role_pingpong(port: int) -> None:
    message = os.urandom(PING_SIZE)
    with socket.create_connection((HOST, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        for _ in range(PING_COUNT):
            sock.sendall(message)
            got = 0
            while got < PING_SIZE:
                got += len(sock.recv(PING_SIZE - got))
        emit({"round_trips_per_s": PING_COUNT / (time.perf_counter() - started)})


async def connect_upstream(port: int) -> socket.socket:
    """A connected, non-blocking socket to the upstream on HOST."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (HOST, port)), 5.0)
    except BaseException:
        sock.close()
        raise
    return sock


async def relay_one(threshold: int | None, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = listener()
    server.setblocking(False)
    client, _ = await loop.sock_accept(server)
    server.close()
    cpu = cpu_seconds()
    upstream = await connect_upstream(upstream_port)
    stats = await relay(client, upstream, idle_timeout=600.0, splice_threshold=threshold)
    emit({"cpu": cpu_seconds() - cpu, "spliced": stats.spliced})


def role_hold() -> None:
    raise_nofile()
    held: list[socket.socket] = []
    with listener() as server:
        while True:  # ends when the parent kills this process
            held.append(server.accept()[0])


def role_opener(port: int, count: int) -> None:
    raise_nofile()
    conns = [socket.create_connection((HOST, port)) for _ in range(count)]
    emit({"opened": len(conns)})
    sys.stdin.read()  # hold them until the parent kills this process


async def relay_idle(threshold: int | None, upstream_port: int, count: int, tasks: bool) -> None:
    raise_nofile()
    loop = asyncio.get_running_loop()
    server = listener()
    server.setblocking(False)
    kept: list[Tunnel | asyncio.Task[Any]] = []
    baseline = 0
    for i in range(IDLE_WARM_UP + count):
        if i == IDLE_WARM_UP:
            gc.collect()
            baseline = rss_bytes()
        client, _ = await loop.sock_accept(server)
        upstream = await connect_upstream(upstream_port)
        if tasks:
            coro = relay(client, upstream, idle_timeout=600.0, splice_threshold=threshold)
            kept.append(asyncio.create_task(coro))
        else:
            kept.append(
                await open_tunnel(client, upstream, idle_timeout=600.0, splice_threshold=threshold)
            )
    await asyncio.sleep(0.5)
    gc.collect()
    emit({"bytes_per_tunnel": (rss_bytes() - baseline) / count})
    await asyncio.sleep(CHILD_TIMEOUT)


def run_role(argv: list[str]) -> None:
    role, args = argv[0], argv[1:]
    if role == "sink":
        role_sink()
    elif role == "source":
        role_source(int(args[0]), int(args[1]))
    elif role == "echo":
        role_echo()
    elif role == "pingpong":
        role_pingpong(int(args[0]))
    elif role == "hold":
        role_hold()
    elif role == "opener":
        role_opener(int(args[0]), int(args[1]))
    elif role == "relay":
        kind, threshold = mode_of(args[0])
        run_loop(kind, relay_one(threshold, int(args[1])))
    elif role == "idle":
        kind, threshold = mode_of(args[0])
        run_loop(kind, relay_idle(threshold, int(args[1]), int(args[2]), args[3] == "task"))
    else:
        raise SystemExit(f"unknown role {role}")


def mode_of(name: str) -> tuple[str, int | None]:
    mode = MODES[name]
    assert mode is not None
    return mode


# --- the parent: spawn roles, collect figures ---------------------------------------------


class Children:
    """Child processes of one measurement; all are killed on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=CHILD_TIMEOUT)

    def spawn(self, *args: object) -> subprocess.Popen[str]:
        command = [sys.executable, __file__, "--role", *map(str, args)]
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc


def read_record(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"child {proc.args!r} ended without output")
    record: dict[str, Any] = json.loads(line)
    return record


def through(
    kids: Children, mode: str, server_port: int
) -> tuple[int, subprocess.Popen[str] | None]:
    """The port a client should use: the server's, or a relay's in front of it."""
    if MODES[mode] is None:
        return server_port, None
    proc = kids.spawn("relay", mode, server_port)
    return read_record(proc)["port"], proc


def bulk_run(mode: str, nbytes: int) -> tuple[float, float | None]:
    """One transfer: (MB/s, relay CPU s/GB or None for direct)."""
    with Children() as kids:
        sink = kids.spawn("sink")
        port, relay_proc = through(kids, mode, read_record(sink)["port"])
        kids.spawn("source", port, nbytes).wait(timeout=CHILD_TIMEOUT)
        result = read_record(sink)
        cpu = None if relay_proc is None else read_record(relay_proc)["cpu"]
    rate = result["bytes"] / result["seconds"] / 1e6
    return rate, None if cpu is None else cpu / (result["bytes"] / 1e9)


def pingpong_run(mode: str) -> tuple[float, float | None]:
    """One ping-pong: (round trips/s, relay CPU us per round trip or None for direct)."""
    with Children() as kids:
        echo = kids.spawn("echo")
        port, relay_proc = through(kids, mode, read_record(echo)["port"])
        pinger = kids.spawn("pingpong", port)
        rate: float = read_record(pinger)["round_trips_per_s"]
        pinger.wait(timeout=CHILD_TIMEOUT)
        cpu = None if relay_proc is None else read_record(relay_proc)["cpu"]
    return rate, None if cpu is None else cpu / PING_COUNT * 1e6


def idle_run(mode: str, count: int, tasks: bool) -> float:
    with Children() as kids:
        hold = kids.spawn("hold")
        relay_proc = kids.spawn(
            "idle", mode, read_record(hold)["port"], count, "task" if tasks else "tunnel"
        )
        opener = kids.spawn("opener", read_record(relay_proc)["port"], IDLE_WARM_UP + count)
        read_record(opener)
        per_tunnel: float = read_record(relay_proc)["bytes_per_tunnel"]
        return per_tunnel


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server((HOST, 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def switch_cost() -> float:
    """CPU seconds one Protocol->splice switch adds (threshold 1 vs never), in-process."""
    loop = asyncio.get_running_loop()
    spent: dict[int | None, float] = {}
    for threshold in (None, 1):
        started = time.process_time()
        for _ in range(SWITCH_SAMPLES):
            a, b = tcp_pair()
            c, d = tcp_pair()
            tunnel = await open_tunnel(b, c, idle_timeout=60.0, splice_threshold=threshold)
            await loop.sock_sendall(a, b"x")
            await loop.sock_recv(d, 1)
            tunnel.abort()
            await tunnel.done
            a.close()
            d.close()
        spent[threshold] = (time.process_time() - started) / SWITCH_SAMPLES
    return spent[1] - spent[None]


def measure_switch(kind: str) -> float:
    result: list[float] = []

    async def main() -> None:
        result.append(await switch_cost())

    run_loop(kind, main())
    return result[0]


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def bulk_table(nbytes: int, runs: int) -> dict[str, float]:
    rows, cpu_by_mode = [], {}
    direct = 0.0
    for mode in MODES:
        samples = [bulk_run(mode, nbytes) for _ in range(runs)]
        rate = statistics.median(s[0] for s in samples)
        cpus = [s[1] for s in samples if s[1] is not None]
        cpu = statistics.median(cpus) if cpus else None
        direct = direct or rate
        pings = [pingpong_run(mode) for _ in range(runs)]
        rt = statistics.median(p[0] for p in pings)
        rt_cpus = [p[1] for p in pings if p[1] is not None]
        rt_cpu = f"{statistics.median(rt_cpus):.1f}" if rt_cpus else "-"
        if cpu is not None:
            cpu_by_mode[mode] = cpu
        rows.append(
            [
                mode,
                f"{rate:.0f}",
                f"{rate / direct:.2f}",
                "-" if cpu is None else f"{cpu:.2f}",
                f"{rt:.0f}",
                rt_cpu,
            ]
        )
        print(f"  {mode}: done", file=sys.stderr)
    header = [
        "relay",
        "MB/s (median)",
        "vs direct",
        "relay CPU s/GB",
        "1 KiB round trips/s",
        "relay CPU us/round trip",
    ]
    print_table(f"Bulk {nbytes >> 20} MiB x {runs} runs; ping-pong {PING_COUNT}", header, rows)
    return cpu_by_mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB per bulk run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tunnels", type=int, default=2000, help="idle tunnels for RSS")
    parser.add_argument("--role", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        run_role(args.role)
        return
    cpu = bulk_table(args.mib << 20, args.runs)

    rows = []
    for kind, protocol, splice in (
        ("asyncio", "protocol", "splice"),
        ("uvloop", "protocol-uvloop", "splice-uvloop"),
    ):
        cost = measure_switch(kind)
        saving = (cpu[protocol] - cpu[splice]) / 1e9  # CPU seconds saved per byte
        even = cost / saving if saving > 0 else float("inf")
        rows.append([kind, f"{cost * 1e6:.0f}", f"{even / 1024:.0f}"])
    print_table("Switch cost", ["loop", "CPU us per switch", "break-even KiB"], rows)

    rows = []
    for mode, tasks in (
        ("protocol", False),
        ("protocol-uvloop", False),
        ("protocol-uvloop", True),
        ("splice", False),
        ("splice-uvloop", False),
    ):
        per = idle_run(mode, args.tunnels, tasks)
        how = "relay() in a Task" if tasks else "open_tunnel(), no Task"
        rows.append([mode, how, f"{per / 1024:.2f}"])
    print_table(f"Idle memory ({args.tunnels} tunnels)", ["relay", "API", "KiB per tunnel"], rows)


if __name__ == "__main__":
    main()
