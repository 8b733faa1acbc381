"""egressbox against a direct connection and other proxies, side by side, on loopback.

    benchmarks/setup.sh                    # squid, tinyproxy, wrk (apt), pproxy (pip)
    .venv/bin/python benchmarks/proxy.py [--quick] [--json out.json] [--markdown out.md]

Starts the loopback origins (origin.py: a bulk sink/source process and a
uvloop echo + HTTP process), then egressbox (`egressbox serve`, audit log to
a file), squid, tinyproxy and pproxy, each configured to reach only the
loopback origins and each writing its access log to a file (pproxy has
none). Then, in interleaved rounds (every target once per round, the order
rotated each round, so that noise hits all alike):

- one-tunnel throughput: loadgen.py streams --gib GiB through one CONNECT or
  SOCKS5 tunnel to the sink; MB/s, and the proxy's CPU seconds per GiB
  (utime + stime of the proxy's whole process tree, all threads, from /proc);
- short tunnels: two loadgen.py processes (uvloop) run connect + handshake +
  one 64-byte echo round trip + close at concurrency 1, 16 and 128; tunnels/s,
  p50/p99 latency, the proxy's CPU microseconds per tunnel and the CPU the
  generator itself used;
- plain HTTP: wrk sends absolute-form GETs (a Lua script sets the path to
  the origin's URL and the Host header) at concurrency 1, 16 and 128;
  requests/s, p50/p99 latency, proxy CPU microseconds per request.

Every cell is also run with no proxy at all ("direct", same generator), the
check that the load generator is not the bottleneck. Last, each proxy is
started afresh and holds 2,000 and 10,000 idle CONNECT tunnels (each checked
with an echo round trip) while its RSS is read from /proc (VmRSS over the
baseline after a warm-up, and VmHWM).

The machine has 2 cores: the generator, the origin and the proxy share
them, so absolute rates are this box's, and ratios within one run are what
to compare. Everything listens on 127.0.0.1 only, every loop is bounded in
count and time, and every process started here is killed at the end, also
on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import pwd
import re
import resource
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
HOST = "127.0.0.1"
GIB = 1 << 30
CONCURRENCY = (1, 16, 128)
IDLE_COUNTS = (2000, 10000)
TESTS = ("throughput", "setup", "http")  # --tests: one tunnel, short tunnels, plain HTTP
WANTED_NOFILE = 65536  # fds for 10,000 tunnels (2 per tunnel in the proxy) and headroom
FD_HEADROOM = 200  # fds a proxy needs besides its tunnels (listeners, logs, epoll, ...)
IDLE_WARM_UP = 100  # tunnels opened and closed before a fresh proxy's RSS baseline
START_TIMEOUT = 15.0  # a proxy or origin must be ready within this
RUN_TIMEOUT = 120.0  # no single measurement may take longer
CLK_TCK = os.sysconf("SC_CLK_TCK")
NOISE_CORES = 0.25  # a sample during which other processes used more CPU than this is redone
NOISE_RETRIES = 2
# The reference floor (benchmarks/floor_proxy.py): a row to compare with, never
# "the best other proxy", since it decides and records nothing.
FLOOR = "uvloop-floor"

# pproxy 2.7.9 calls uvloop.install() and then asyncio.get_event_loop(), which
# raises with uvloop >= 0.21 on Python 3.11; this shim gives it a loop, so it
# runs on uvloop as its author intends (its fastest configuration).
PPROXY_SHIM = """
import asyncio, sys
try:
    import uvloop
except ImportError:
    uvloop = None
if uvloop is not None:
    def install():
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.set_event_loop(uvloop.new_event_loop())
    uvloop.install = install
from pproxy.server import main
sys.exit(main())
"""

WRK_SCRIPT = """
wrk.method = "GET"
wrk.path = "{path}"
wrk.headers["Host"] = "{host}"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, ' ..
    '"connect_errors": %d, "read_errors": %d, "write_errors": %d, "status_errors": %d, ' ..
    '"timeouts": %d}}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


# --- processes ------------------------------------------------------------------------------

_children: list[subprocess.Popen[bytes]] = []


def spawn(
    argv: list[str],
    *,
    stdin: int | None = subprocess.DEVNULL,
    stdout: int | IO[bytes] | None = subprocess.PIPE,
    stderr: int | IO[bytes] | None = subprocess.DEVNULL,
    cwd: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start a child in its own process group; it is killed by stop_all() at the latest."""
    proc = subprocess.Popen(
        argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd, start_new_session=True
    )
    _children.append(proc)
    return proc


def stop(proc: subprocess.Popen[bytes], grace: float = 3.0) -> None:
    """SIGTERM the child's process group (helpers too), then SIGKILL after `grace`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    # The group may outlive its leader (squid's helpers): kill what is left of it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    if proc in _children:
        _children.remove(proc)


def stop_all() -> None:
    for proc in list(reversed(_children)):
        stop(proc, grace=2.0)


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """One line of the child's stdout within `timeout` (RuntimeError otherwise)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    fd = proc.stdout.fileno()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise RuntimeError(f"no output from {proc.args!r} within {timeout:.0f} s")
        byte = os.read(fd, 1)
        if not byte:
            raise RuntimeError(f"{proc.args!r} exited ({proc.wait()}) before answering")
        line += byte
    return line.decode()


def read_json(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(read_line(proc, timeout))
    return result


def tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of pid's process tree: every thread, dead threads included."""
    total = 0
    for member in tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / CLK_TCK


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in KiB, summed over pid's process tree."""
    rss = hwm = 0
    for member in tree(pid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm += int(line.split()[1])
    return rss, hwm


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} at start")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1.0):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.args!r} is not listening on {port} after {timeout:.0f} s")


def raise_nofile() -> int:
    """Raise RLIMIT_NOFILE (inherited by every child) as far as this process may."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < WANTED_NOFILE:
        with contextlib.suppress(ValueError, OSError):  # needs CAP_SYS_RESOURCE
            resource.setrlimit(resource.RLIMIT_NOFILE, (WANTED_NOFILE, WANTED_NOFILE))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def which(name: str) -> str | None:
    """A program from this interpreter's bin directory, PATH or the sbin directories."""
    path = os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]
    )
    return shutil.which(name, path=path)


def command_output(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except OSError:
        return ""
    return (done.stdout + done.stderr).strip()


# --- origins and proxies -------------------------------------------------------------------


@dataclass
class Origins:
    bulk: int
    echo: int
    http: int
    procs: list[subprocess.Popen[bytes]]


def start_origins() -> Origins:
    bulk = spawn([sys.executable, str(HERE / "origin.py"), "bulk"])
    serve = spawn([sys.executable, str(HERE / "origin.py"), "serve"])
    ports = read_json(bulk, START_TIMEOUT) | read_json(serve, START_TIMEOUT)
    return Origins(ports["bulk"], ports["echo"], ports["http"], [bulk, serve])


@dataclass
class Proxy:
    name: str
    proc: subprocess.Popen[bytes]
    http: int | None  # port of the HTTP (CONNECT and forwarding) listener
    socks: int | None  # port of the SOCKS5 listener
    workdir: Path
    forwards: bool = True  # forwards absolute-form http:// requests (plain HTTP)

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass(frozen=True)
class ProxyKind:
    name: str
    program: str  # what must be installed
    start: Callable[[Path, Origins], Proxy]
    version: Callable[[], str]
    logging: str  # what it logs in this benchmark
    processes: int = 1  # serving processes: each has its own descriptor limit


def start_egressbox(workdir: Path, origins: Origins, workers: int = 1) -> Proxy:
    """`egressbox serve`; with workers > 1, `serve --workers N` (SO_REUSEPORT)."""
    policy = workdir / "policy.toml"
    policy.write_text(
        "[egress]\n"
        'allow = ["127.0.0.1"]\n'
        'allow_cidrs = ["127.0.0.0/8"]\n'
        "[limits]\n"
        "max_connections = 50000\n"  # the idle test holds 10,000 tunnels
    )
    argv = [sys.executable, "-m", "egressbox", "serve", "--policy", str(policy)]
    argv += ["--audit-log", str(workdir / "audit.jsonl"), "--quiet"]
    if workers > 1:
        argv += ["--workers", str(workers)]
    proc, ports = start_with_ready_line(argv, workdir)
    name = "egressbox" if workers == 1 else f"egressbox-w{workers}"
    return Proxy(name, proc, ports["http"], ports["socks5"], workdir)


def start_with_ready_line(
    argv: list[str], workdir: Path
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """Start a proxy that prints a JSON ready line of `"name": "HOST:PORT"` listeners."""
    with open(workdir / "stderr.log", "wb") as err:
        proc = spawn(argv, stderr=err)
    ready = read_json(proc, START_TIMEOUT)
    ports = {
        name: int(value.rsplit(":", 1)[1])
        for name, value in ready.items()
        if isinstance(value, str) and value.startswith(f"{HOST}:")
    }
    return proc, ports


def start_squid(workdir: Path, origins: Origins) -> Proxy:
    program = which("squid")
    assert program is not None
    port = free_port()
    conf = workdir / "squid.conf"
    conf.write_text(
        f"http_port {HOST}:{port}\n"
        f"acl bench_client src {HOST}/32\n"
        f"acl bench_ports port {origins.bulk} {origins.echo} {origins.http}\n"
        "acl CONNECT method CONNECT\n"
        "http_access deny CONNECT !bench_ports\n"
        "http_access allow bench_client\n"
        "http_access deny all\n"
        "cache deny all\n"
        "cache_mem 0 MB\n"
        f"access_log stdio:{workdir}/access.log\n"
        f"cache_log {workdir}/cache.log\n"
        "cache_store_log none\n"
        f"pid_filename {workdir}/squid.pid\n"
        f"coredump_dir {workdir}\n"
        "max_filedescriptors 65536\n"
        "shutdown_lifetime 0 seconds\n"
        "pinger_enable off\n"
        "client_db off\n"
        "visible_hostname egressbox-bench\n"
    )
    if os.geteuid() == 0:  # squid drops root for its effective user, which must write here
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam("proxy")
            os.chown(workdir, user.pw_uid, user.pw_gid)
    with open(workdir / "stderr.log", "wb") as err:
        proc = spawn([program, "-N", "-f", str(conf)], stdout=err, stderr=err)
    wait_port(port, proc)
    return Proxy("squid", proc, port, None, workdir)


def start_tinyproxy(workdir: Path, origins: Origins) -> Proxy:
    program = which("tinyproxy")
    assert program is not None
    port = free_port()
    conf = workdir / "tinyproxy.conf"
    conf.write_text(
        f"Port {port}\n"
        f"Listen {HOST}\n"
        "Timeout 600\n"
        "MaxClients 20000\n"
        f'LogFile "{workdir}/tinyproxy.log"\n'
        "LogLevel Connect\n"
        f'PidFile "{workdir}/tinyproxy.pid"\n'
        f"Allow {HOST}\n"
        f"ConnectPort {origins.bulk}\n"
        f"ConnectPort {origins.echo}\n"
        "DisableViaHeader Yes\n"
    )
    with open(workdir / "stderr.log", "wb") as err:
        proc = spawn([program, "-d", "-c", str(conf)], stdout=err, stderr=err)
    wait_port(port, proc)
    return Proxy("tinyproxy", proc, port, None, workdir)


def start_pproxy(workdir: Path, origins: Origins) -> Proxy:
    port = free_port()
    argv = [sys.executable, "-c", PPROXY_SHIM, "-l", f"http+socks5://{HOST}:{port}"]
    with open(workdir / "stderr.log", "wb") as err:
        proc = spawn(argv, stdout=err, stderr=err)
    wait_port(port, proc)
    return Proxy("pproxy", proc, port, port, workdir)


def start_floor(workdir: Path, origins: Origins) -> Proxy:
    """benchmarks/floor_proxy.py: CONNECT and relay only, nothing decided or recorded."""
    proc, ports = start_with_ready_line([sys.executable, str(HERE / "floor_proxy.py")], workdir)
    return Proxy(FLOOR, proc, ports["http"], None, workdir, forwards=False)


def egressbox_version() -> str:
    version = importlib.metadata.version("egressbox")
    rev = command_output(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"])
    dirty = command_output(["git", "-C", str(HERE), "status", "--porcelain", "--", "../src"])
    if re.fullmatch(r"[0-9a-f]{7,}", rev):
        version += f" (git {rev}{' + uncommitted changes' if dirty else ''})"
    core = command_output(
        [sys.executable, "-c", "import egressbox; print(egressbox.compiled_core())"]
    )
    return version + (", compiled core" if core == "True" else ", interpreted core")


def pproxy_version() -> str:
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"{importlib.metadata.version('pproxy')} (PyPI, on {loop})"


def first_line(argv: list[str]) -> str:
    lines = command_output(argv).splitlines()
    return lines[0] if lines else "?"


KINDS = [
    ProxyKind(
        "egressbox",
        "egressbox",
        start_egressbox,
        egressbox_version,
        "audit log (one JSON line per decision) to a file; --quiet (no stderr line)",
    ),
    ProxyKind(
        "egressbox-w2",
        "egressbox",
        partial(start_egressbox, workers=2),
        egressbox_version,
        "as egressbox, with --workers 2 (two processes sharing the ports with SO_REUSEPORT;"
        " one audit log, O_APPEND)",
        processes=2,
    ),
    ProxyKind(
        "squid",
        "squid",
        start_squid,
        lambda: first_line([which("squid") or "squid", "-v"]),
        "access_log (stdio, one line per request); cache deny all",
    ),
    ProxyKind(
        "tinyproxy",
        "tinyproxy",
        start_tinyproxy,
        lambda: first_line([which("tinyproxy") or "tinyproxy", "-v"]),
        "LogLevel Connect (3 lines per connection) to a file",
    ),
    ProxyKind("pproxy", "pproxy", start_pproxy, pproxy_version, "no access log (pproxy has none)"),
    ProxyKind(
        FLOOR,
        "uvloop",
        start_floor,
        lambda: f"benchmarks/floor_proxy.py on uvloop {importlib.metadata.version('uvloop')}",
        "nothing: a reference floor, not a proxy (CONNECT and relay only: no policy, DNS,"
        " audit, limits or timeouts); no plain HTTP",
    ),
]


def installed(kind: ProxyKind) -> bool:
    if kind.program == "egressbox":
        return True
    if kind.program in ("pproxy", "uvloop"):
        return importlib.util.find_spec(kind.program) is not None
    return which(kind.program) is not None


# --- cells -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One row of a table: a target reached one way."""

    proxy: str | None  # None: direct
    via: str  # direct | connect | socks5

    @property
    def label(self) -> str:
        if self.proxy is None:
            return "direct"
        return f"{self.proxy} {'CONNECT' if self.via == 'connect' else 'SOCKS5'}"


def cells_for(proxies: dict[str, Proxy], *, socks: bool, forwarding: bool = False) -> list[Cell]:
    """Direct, then each proxy by CONNECT and (with `socks`) SOCKS5; with
    `forwarding`, only the proxies that forward plain HTTP."""
    cells = [Cell(None, "direct")]
    for name, proxy in proxies.items():
        if forwarding and not proxy.forwards:
            continue
        if proxy.http is not None:
            cells.append(Cell(name, "connect"))
        if socks and proxy.socks is not None:
            cells.append(Cell(name, "socks5"))
    return cells


def proxy_port(proxy: Proxy, via: str) -> int:
    port = proxy.socks if via == "socks5" else proxy.http
    assert port is not None
    return port


def loadgen(role: str, cell: Cell, proxy: Proxy | None, target: int, *extra: str) -> list[str]:
    argv = [sys.executable, str(HERE / "loadgen.py"), role, "--via", cell.via]
    if proxy is not None:
        argv += ["--proxy", f"{HOST}:{proxy_port(proxy, cell.via)}"]
    return [*argv, "--target", f"{HOST}:{target}", *extra]


def rotated(items: list[Cell], by: int) -> list[Cell]:
    if not items:
        return items
    by %= len(items)
    return items[by:] + items[:by]


def percentile(sorted_values: list[int], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return float(sorted_values[index])


# --- measurements ----------------------------------------------------------------------------


def measure_throughput(
    cell: Cell, proxy: Proxy | None, origins: Origins, size: int
) -> dict[str, Any]:
    argv = loadgen("throughput", cell, proxy, origins.bulk, "--bytes", str(size))
    before = cpu_seconds(proxy.pid) if proxy else 0.0
    proc = spawn(argv)
    try:
        result = read_json(proc, RUN_TIMEOUT)
    finally:
        stop(proc)
    cpu = cpu_seconds(proxy.pid) - before if proxy else float("nan")
    return {
        "mb_per_s": result["bytes"] / result["seconds"] / 1e6,
        "cpu_s_per_gib": cpu / (result["bytes"] / GIB) if proxy else None,
    }


def measure_setup(
    cell: Cell,
    proxy: Proxy | None,
    origins: Origins,
    concurrency: int,
    duration: float,
    warmup: float,
) -> dict[str, Any]:
    split = (
        [concurrency] if concurrency == 1 else [concurrency // 2, concurrency - concurrency // 2]
    )
    timing = ["--duration", str(duration), "--warmup", str(warmup)]
    procs = [
        spawn(
            loadgen("setup", cell, proxy, origins.echo, "--concurrency", str(k), *timing),
            stdin=subprocess.PIPE,
        )
        for k in split
    ]
    try:
        for proc in procs:
            read_json(proc, START_TIMEOUT)  # {"event": "ready"}
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        time.sleep(warmup)
        before = cpu_seconds(proxy.pid) if proxy else 0.0
        origin_before = cpu_seconds(origins.procs[1].pid)
        time.sleep(duration)
        cpu = cpu_seconds(proxy.pid) - before if proxy else float("nan")
        origin_cpu = cpu_seconds(origins.procs[1].pid) - origin_before
        results = [read_json(proc, duration + warmup + RUN_TIMEOUT) for proc in procs]
    finally:
        for proc in procs:
            stop(proc)
    latencies = sorted(v for r in results for v in r["latencies_us"])
    count = len(latencies)
    errors: dict[str, int] = {}
    for r in results:
        for kind, n in r["error_kinds"].items():
            errors[kind] = errors.get(kind, 0) + n
    return {
        "per_s": count / duration,
        "p50_ms": percentile(latencies, 0.50) / 1000,
        "p99_ms": percentile(latencies, 0.99) / 1000,
        "cpu_us": cpu / count * 1e6 if proxy and count else None,
        "proxy_cores": cpu / duration if proxy else None,
        "generator_cores": sum(r["cpu_seconds"] for r in results)
        / sum(r["elapsed"] for r in results)
        * len(results),
        "origin_cores": origin_cpu / duration,
        "errors": sum(r["errors"] for r in results),
        "error_kinds": errors,
    }


def measure_http(
    cell: Cell,
    proxy: Proxy | None,
    origins: Origins,
    concurrency: int,
    duration: float,
    workdir: Path,
) -> dict[str, Any]:
    wrk = which("wrk")
    assert wrk is not None
    origin = f"{HOST}:{origins.http}"
    script = workdir / f"wrk-{'direct' if proxy is None else 'proxy'}.lua"
    path = "/" if proxy is None else f"http://{origin}/"
    script.write_text(WRK_SCRIPT.format(path=path, host=origin))
    server = origin if proxy is None else f"{HOST}:{proxy_port(proxy, 'connect')}"
    threads = min(2, concurrency)
    argv = [wrk, "-t", str(threads), "-c", str(concurrency), "-d", f"{duration:g}s"]
    argv += ["--timeout", "5s", "-s", str(script), f"http://{server}/"]
    before = cpu_seconds(proxy.pid) if proxy else 0.0
    proc = spawn(argv)
    try:
        out, _ = proc.communicate(timeout=duration + RUN_TIMEOUT)
    finally:
        stop(proc)
    cpu = cpu_seconds(proxy.pid) - before if proxy else float("nan")
    text = out.decode(errors="replace")
    found = re.search(r"^WRKJSON (.*)$", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"wrk printed no summary: {text[-500:]}")
    stats: dict[str, Any] = json.loads(found.group(1))
    seconds = stats["duration_us"] / 1e6
    requests = stats["requests"]
    errors = sum(stats[k] for k in stats if k.endswith("_errors") or k == "timeouts")
    return {
        "per_s": requests / seconds,
        "p50_ms": stats["p50_us"] / 1000,
        "p99_ms": stats["p99_us"] / 1000,
        "cpu_us": cpu / requests * 1e6 if proxy and requests else None,
        "proxy_cores": cpu / seconds if proxy else None,
        "errors": errors,
        "error_kinds": {k: v for k, v in stats.items() if v and k not in _WRK_NOT_ERRORS},
    }


_WRK_NOT_ERRORS = {"requests", "duration_us", "p50_us", "p99_us"}


def measure_idle(kind: ProxyKind, workdir: Path, origins: Origins, count: int) -> dict[str, Any]:
    proxy = kind.start(workdir, origins)
    cell = Cell(kind.name, "connect")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        warm = spawn(
            loadgen("idle", cell, proxy, origins.echo, "--count", str(IDLE_WARM_UP)),
            stdin=subprocess.PIPE,
        )
        procs.append(warm)
        read_json(warm, RUN_TIMEOUT)
        assert warm.stdin is not None
        warm.stdin.write(b"close\n")
        warm.stdin.flush()
        read_json(warm, RUN_TIMEOUT)
        stop(warm)
        time.sleep(1.0)
        base_rss, _ = memory_kib(proxy.pid)
        gen = spawn(
            loadgen("idle", cell, proxy, origins.echo, "--count", str(count)),
            stdin=subprocess.PIPE,
        )
        procs.append(gen)
        opened = read_json(gen, RUN_TIMEOUT)
        time.sleep(1.0)  # let the proxy settle (timers, buffers)
        rss, hwm = memory_kib(proxy.pid)
        assert gen.stdin is not None
        gen.stdin.write(b"close\n")
        gen.stdin.flush()
        with contextlib.suppress(RuntimeError):
            read_json(gen, RUN_TIMEOUT)
    finally:
        for proc in procs:
            stop(proc)
        stop(proxy.proc)
    held = opened["open"]
    return {
        "asked": count,
        "open": held,
        "failed": opened["failed"],
        "error_kinds": opened["error_kinds"],
        "open_seconds": opened["seconds"],
        "baseline_rss_kib": base_rss,
        "rss_kib": rss,
        "peak_rss_kib": hwm,
        "kib_per_tunnel": (rss - base_rss) / held if held else None,
    }


# --- other load on the machine ------------------------------------------------------------------


def system_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (user, nice, system, irq, softirq)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
    return (user + nice + system + irq + softirq) / CLK_TCK


class LoadMeter:
    """Measures how much CPU processes that are not ours used during a sample.

    Ours: this process, its waited children (generators, wrk) and the process
    trees of the long-running children (origins, proxies). Everything else that
    was busy is other load (other users' jobs, a build, a test suite). A sample
    taken while others used more than NOISE_CORES is repeated (at most
    NOISE_RETRIES times, while the run's retake budget lasts) and the quietest
    attempt is kept.
    """

    def __init__(self, pids: list[int], budget: float) -> None:
        self.pids = pids
        self.budget = budget  # seconds all retakes together may take

    def _ours(self) -> float:
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return own + sum(cpu_seconds(pid) for pid in self.pids)

    def measure(self, sample: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        best: dict[str, Any] | None = None
        for attempt in range(NOISE_RETRIES + 1):
            started, busy, ours = time.monotonic(), system_busy_seconds(), self._ours()
            result = sample()
            elapsed = time.monotonic() - started
            other = (system_busy_seconds() - busy) - (self._ours() - ours)
            result["other_cores"] = max(0.0, other / elapsed)
            result["attempts"] = attempt + 1
            if best is None or result["other_cores"] < best["other_cores"]:
                best = result
            if attempt:
                self.budget -= elapsed
            if result["other_cores"] <= NOISE_CORES or self.budget < elapsed:
                break
        assert best is not None
        return best


def noise(sample: dict[str, Any]) -> str:
    other = sample.get("other_cores", 0.0)
    return f"  [other load {other:.2f} cores]" if other > NOISE_CORES / 2 else ""


# --- smoke check -----------------------------------------------------------------------------


def http_get_via(proxy_port_number: int, origin: int) -> bytes:
    with socket.create_connection((HOST, proxy_port_number), timeout=5.0) as sock:
        url = f"http://{HOST}:{origin}/"
        sock.sendall(
            f"GET {url} HTTP/1.1\r\nHost: {HOST}:{origin}\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def smoke(proxy: Proxy, origins: Origins) -> None:
    """Each way of reaching the origin works through this proxy (else: RuntimeError)."""
    for via in ("connect", "socks5"):
        if (proxy.http if via == "connect" else proxy.socks) is None:
            continue
        cell = Cell(proxy.name, via)
        measure_throughput(cell, proxy, origins, 1 << 20)
    if not proxy.forwards:
        return
    assert proxy.http is not None
    reply = http_get_via(proxy.http, origins.http)
    if not reply.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200")):
        raise RuntimeError(f"{proxy.name}: plain HTTP GET failed: {reply[:200]!r}")


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Params:
    rounds: int
    gib: float
    duration: float
    warmup: float
    http_duration: float
    idle_counts: tuple[int, ...]
    idle_note: str = ""
    idle_fits: int = 0  # tunnels one proxy process can hold (0: no cap)
    retake_budget: float = 0.0  # seconds of retaken samples the whole run may spend
    concurrency: tuple[int, ...] = CONCURRENCY
    tests: tuple[str, ...] = TESTS


@dataclass
class Results:
    throughput: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    setup: dict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    http: dict[str, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    idle: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(params: Params, kinds: list[ProxyKind], workroot: Path, results: Results) -> None:
    origins = start_origins()
    proxies: dict[str, Proxy] = {}
    for kind in kinds:
        workdir = workroot / kind.name
        workdir.mkdir()
        proxies[kind.name] = proxy = kind.start(workdir, origins)
        smoke(proxy, origins)
        log(f"started {kind.name} (pid {proxy.pid})")
    tunnel_cells = cells_for(proxies, socks=True)
    http_cells = cells_for(proxies, socks=False, forwarding=True)
    size = int(params.gib * GIB)

    def of(cell: Cell) -> Proxy | None:
        return None if cell.proxy is None else proxies[cell.proxy]

    watched = [proc.pid for proc in origins.procs] + [p.pid for p in proxies.values()]
    meter = LoadMeter(watched, params.retake_budget)
    for number in range(params.rounds):
        order = rotated(tunnel_cells, number) if "throughput" in params.tests else []
        if order:
            log(f"round {number + 1}/{params.rounds}: throughput")
        for cell in order + order[::-1]:  # two runs per round, the second in reverse order
            sample = meter.measure(partial(measure_throughput, cell, of(cell), origins, size))
            results.throughput.setdefault(cell.label, []).append(sample)
            log(f"  {cell.label:20} {sample['mb_per_s']:8.0f} MB/s{noise(sample)}")
        for conc in params.concurrency if "setup" in params.tests else ():
            log(f"round {number + 1}/{params.rounds}: short tunnels, concurrency {conc}")
            for cell in rotated(tunnel_cells, number):
                job = partial(
                    measure_setup, cell, of(cell), origins, conc, params.duration, params.warmup
                )
                sample = meter.measure(job)
                results.setup.setdefault(cell.label, {}).setdefault(conc, []).append(sample)
                log(
                    f"  {cell.label:20} {sample['per_s']:8.0f}/s p50 {sample['p50_ms']:.2f}"
                    f" p99 {sample['p99_ms']:.2f} ms errors {sample['errors']}{noise(sample)}"
                )
        for conc in params.concurrency if "http" in params.tests else ():
            log(f"round {number + 1}/{params.rounds}: plain HTTP, concurrency {conc}")
            for cell in rotated(http_cells, number):
                job = partial(
                    measure_http, cell, of(cell), origins, conc, params.http_duration, workroot
                )
                sample = meter.measure(job)
                label = cell.proxy or "direct"
                results.http.setdefault(label, {}).setdefault(conc, []).append(sample)
                log(
                    f"  {label:20} {sample['per_s']:8.0f}/s p50 {sample['p50_ms']:.2f}"
                    f" p99 {sample['p99_ms']:.2f} ms errors {sample['errors']}{noise(sample)}"
                )
    for proxy in proxies.values():
        stop(proxy.proc)
    for count in params.idle_counts:
        for kind in kinds:
            # Capped by the descriptor limit of each serving process (results stay
            # under the nominal count; the table shows how many were open).
            opened = min(count, params.idle_fits * kind.processes) if params.idle_fits else count
            log(f"idle: {kind.name}, {opened} tunnels")
            workdir = workroot / f"{kind.name}-idle-{count}"
            workdir.mkdir()
            sample = measure_idle(kind, workdir, origins, opened)
            results.idle.setdefault(kind.name, {})[count] = sample
            log(
                f"  open {sample['open']} failed {sample['failed']}"
                f" rss {sample['rss_kib'] / 1024:.1f} MiB"
                f" ({sample['kib_per_tunnel'] or 0:.2f} KiB/tunnel)"
            )
    for proc in origins.procs:
        stop(proc)


# --- report ------------------------------------------------------------------------------------


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(samples: list[dict[str, Any]], key: str) -> float | None:
    return median([s.get(key) for s in samples])


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:,.{digits}f}"


def machine() -> dict[str, str]:
    model = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "date": time.strftime("%Y-%m-%d"),
        "nproc": str(os.cpu_count()),
        "cpu": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvloop": importlib.metadata.version("uvloop"),
        "wrk": " ".join(first_line([which("wrk") or "wrk", "-v"]).split()[:2]),
        "nofile": str(resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
    }


def all_samples(results: Results) -> list[dict[str, Any]]:
    found = [s for samples in results.throughput.values() for s in samples]
    for table in (results.setup, results.http):
        found += [s for by_conc in table.values() for samples in by_conc.values() for s in samples]
    return found


def rate_cells(samples: list[dict[str, Any]]) -> str:
    rate = fmt(summarize(samples, "per_s"))
    p50, p99 = fmt(summarize(samples, "p50_ms"), 2), fmt(summarize(samples, "p99_ms"), 2)
    return f" {rate} | {p50} / {p99} |"


def report(results: Results, params: Params, info: dict[str, str], versions: dict[str, str]) -> str:
    out: list[str] = []
    add = out.append
    add(
        f"Measured {info['date']} on {info['nproc']} cores ({info['cpu']}), Linux {info['kernel']},"
        f" Python {info['python']}, uvloop {info['uvloop']}, {info['wrk']};"
        f" {params.rounds} interleaved round(s); medians over rounds."
    )
    others = [
        sample["other_cores"]
        for sample in all_samples(results)
        if sample.get("other_cores") is not None
    ]
    if others:
        retried = sum(1 for sample in all_samples(results) if sample.get("attempts", 1) > 1)
        add(
            f"Other processes on the machine used {statistics.median(others):.2f} cores (median;"
            f" max {max(others):.2f}) during the samples; {retried} of {len(others)} samples"
            f" were retaken (within a {params.retake_budget:g} s budget) because others used"
            f" more than {NOISE_CORES} cores."
        )
    add("")
    add("| proxy | version | logging |")
    add("|---|---|---|")
    for kind in KINDS:
        if kind.name in versions:
            add(f"| {kind.name} | {versions[kind.name]} | {kind.logging} |")
    add("")
    if results.throughput:
        throughput_table(results, params, add)
    if results.setup:
        rate_table(results.setup, params, add, http=False)
    if results.http:
        rate_table(results.http, params, add, http=True)
    if results.idle:
        idle_table(results, add)
        if params.idle_note:
            add(f"Idle count: {params.idle_note}.")
            add("")
    add(checks(results))
    return "\n".join(out)


def throughput_table(results: Results, params: Params, add: Callable[[str], None]) -> None:
    direct = summarize(results.throughput.get("direct", []), "mb_per_s")
    add(
        f"**One tunnel** ({params.gib:g} GiB up through one tunnel per run, two runs per round;"
        " CPU = utime + stime of the proxy's process tree per GiB moved)"
    )
    add("")
    add("| target | MB/s | x direct | proxy CPU s/GiB |")
    add("|---|---:|---:|---:|")
    for label, samples in results.throughput.items():
        rate = summarize(samples, "mb_per_s")
        ratio = rate / direct if rate and direct else None
        cpu = summarize(samples, "cpu_s_per_gib")
        add(f"| {label} | {fmt(rate)} | {fmt(ratio, 2)} | {fmt(cpu, 3)} |")
    add("")


def rate_table(
    table: dict[str, dict[int, list[dict[str, Any]]]],
    params: Params,
    add: Callable[[str], None],
    *,
    http: bool,
) -> None:
    concs = params.concurrency
    if http:
        add(
            f"**Plain HTTP** (wrk, keep-alive, absolute-form GET of a 13-byte body,"
            f" {params.http_duration:g} s per run; latency from wrk; CPU = proxy CPU per request)"
        )
    else:
        add(
            f"**Short tunnels** (connect, handshake, one 64-byte echo, close;"
            f" {params.duration:g} s per run from 2 generator processes; latency = connect() to"
            " the echo's last byte; CPU = proxy CPU per tunnel)"
        )
    add("")
    unit = "req/s" if http else "/s"
    per = "request" if http else "tunnel"
    head = "| target |" + "".join(f" c={c} {unit} | c={c} p50/p99 ms |" for c in concs)
    add(head + f" CPU us/{per} (c={concs[-1]}) |")
    add("|---|" + "---:|---:|" * len(concs) + "---:|")
    notes = []
    for label, by_conc in table.items():
        row = f"| {label} |"
        for conc in concs:
            row += rate_cells(by_conc.get(conc, []))
        row += f" {fmt(summarize(by_conc.get(concs[-1], []), 'cpu_us'))} |"
        add(row)
        kinds: dict[str, int] = {}
        for samples in by_conc.values():
            for sample in samples:
                for kind, n in sample["error_kinds"].items():
                    kinds[kind] = kinds.get(kind, 0) + n
        if kinds:
            notes.append(f"{label}: " + ", ".join(f"{k} {n:,}" for k, n in kinds.items()))
    add("")
    if notes:
        add("Errors counted by the generator: " + "; ".join(notes) + ".")
        add("")


def idle_table(results: Results, add: Callable[[str], None]) -> None:
    add(
        "**Idle tunnels** (fresh proxy; CONNECT tunnels each checked with an echo, then held"
        " idle; RSS of the proxy's process tree; KiB/tunnel = (VmRSS - baseline) / tunnels)"
    )
    add("")
    counts = sorted({n for by in results.idle.values() for n in by})
    add(
        "| proxy | baseline MiB |"
        + "".join(f" {n:,} open | peak MiB | KiB/tunnel |" for n in counts)
    )
    add("|---|---:|" + "---:|---:|---:|" * len(counts))
    for name, by_count in results.idle.items():
        base = min(s["baseline_rss_kib"] for s in by_count.values()) / 1024
        row = f"| {name} | {base:.1f} |"
        for n in counts:
            s = by_count.get(n)
            if s is None:
                row += " - | - | - |"
                continue
            row += (
                f" {s['open']:,} | {s['peak_rss_kib'] / 1024:.1f} | {fmt(s['kib_per_tunnel'], 2)} |"
            )
        add(row)
    add("")


def checks(results: Results) -> str:
    """The issue's targets for egressbox, each with its figures."""
    lines = ["**Targets** (egressbox)", ""]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    direct = summarize(results.throughput.get("direct", []), "mb_per_s")
    for via in ("CONNECT", "SOCKS5"):
        mine = summarize(results.throughput.get(f"egressbox {via}", []), "mb_per_s")
        if mine is None or direct is None:
            continue
        others = {
            label: summarize(samples, "mb_per_s")
            for label, samples in results.throughput.items()
            if not label.startswith(("egressbox", "direct", FLOOR))
        }
        best_label, best = max(others.items(), key=lambda kv: kv[1] or 0, default=("-", None))
        lines.append(
            f"- one tunnel, {via}: {mine / direct:.3f} x direct (>= 0.6: "
            f"{verdict(mine >= 0.6 * direct)})"
            + (
                f"; {mine / best:.3f} x the best other proxy ({best_label}; >= 1.5:"
                f" {verdict(mine >= 1.5 * best)})"
                if best
                else ""
            )
        )
    for table, name, suffix in (
        (results.setup, "short tunnels", " CONNECT"),
        (results.http, "plain HTTP", ""),
    ):
        mine_by = table.get("egressbox" + suffix, {})
        for other in ("squid" + suffix, "tinyproxy" + suffix):
            theirs_by = table.get(other, {})
            parts = []
            ok = True
            for conc, samples in mine_by.items():
                mine = summarize(samples, "per_s")
                theirs = summarize(theirs_by.get(conc, []), "per_s")
                if mine is None or theirs is None:
                    continue
                parts.append(f"c={conc}: {mine / theirs:.2f} x")
                ok = ok and mine >= theirs
            if parts:
                goal = "at least" if other.startswith("squid") else "aiming at"
                lines.append(
                    f"- {name} vs {other.split()[0]} ({goal}): {', '.join(parts)}"
                    f" ({verdict(ok) if goal == 'at least' else 'reached' if ok else 'not yet'})"
                )
    lines += headroom(results)
    idle = results.idle.get("egressbox", {})
    for _, s in sorted(idle.items()):
        per = s["kib_per_tunnel"]
        if per is not None:
            met = verdict(per <= 8)
            lines.append(f"- idle, {s['open']:,} tunnels: {per:.2f} KiB per tunnel (<= 8: {met})")
    return "\n".join(lines)


def headroom(results: Results) -> list[str]:
    """Direct (same generator, no proxy) over the fastest proxy: the generator's headroom."""
    lines = []
    for table, name in ((results.setup, "short tunnels"), (results.http, "plain HTTP")):
        direct_by = table.get("direct", {})
        ratios = []
        for conc, samples in sorted(direct_by.items()):
            direct = summarize(samples, "per_s")
            best = max(
                (
                    summarize(by.get(conc, []), "per_s") or 0
                    for k, by in table.items()
                    if k != "direct"
                ),
                default=0,
            )
            if direct and best:
                ratios.append(f"c={conc}: {direct / best:.1f} x")
        if ratios:
            lines.append(
                f"- generator headroom, {name}: direct over the fastest proxy {', '.join(ratios)}"
            )
    return lines


def report_from_json(path: Path) -> str:
    """The tables of a run saved with --json (JSON turned the concurrency keys into text)."""
    payload = json.loads(path.read_text())
    saved = payload["results"]
    params = Params(**{**payload["params"], "idle_counts": tuple(payload["params"]["idle_counts"])})
    params.concurrency = tuple(params.concurrency)

    def by_int(table: dict[str, dict[str, Any]]) -> dict[str, dict[int, Any]]:
        return {label: {int(k): v for k, v in by.items()} for label, by in table.items()}

    results = Results(
        throughput=saved["throughput"],
        setup=by_int(saved["setup"]),
        http=by_int(saved["http"]),
        idle=by_int(saved["idle"]),
    )
    return report(results, params, payload["machine"], payload["versions"])


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (~2 min)")
    parser.add_argument("--json", metavar="FILE", help="write every sample as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the tables as Markdown")
    parser.add_argument(
        "--proxies",
        default=",".join(k.name for k in KINDS),
        help="comma-separated subset of: " + ", ".join(k.name for k in KINDS),
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; quick 2)")
    parser.add_argument("--no-idle", action="store_true", help="skip the idle-tunnel test")
    parser.add_argument(
        "--tests",
        default=",".join(TESTS),
        help="comma-separated subset of: throughput (one tunnel), setup (short tunnels),"
        " http (plain HTTP); the idle test is governed by --no-idle",
    )
    parser.add_argument(
        "--from-json", metavar="FILE", help="only print the tables of an earlier --json run"
    )
    args = parser.parse_args(argv)
    if args.from_json:
        text = report_from_json(Path(args.from_json))
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text + "\n")
        return 0

    hard = raise_nofile()
    fits = (hard - FD_HEADROOM) // 2  # two fds per tunnel in the proxy
    counts = IDLE_COUNTS
    if args.quick:
        params = Params(2 if args.rounds is None else args.rounds, 0.5, 1.0, 0.2, 1.0, counts[:1])
        params.retake_budget = 20.0
    else:
        params = Params(3 if args.rounds is None else args.rounds, 2.0, 3.0, 0.3, 3.0, counts)
        params.retake_budget = 150.0
    params.idle_fits = fits
    if args.no_idle:
        params.idle_counts = ()
    params.tests = tuple(t for t in args.tests.split(",") if t)
    unknown = set(params.tests) - set(TESTS)
    if unknown:
        parser.error(
            f"unknown test(s): {', '.join(sorted(unknown))}; choose from {', '.join(TESTS)}"
        )
    wanted = args.proxies.split(",")
    kinds = []
    for kind in KINDS:
        if kind.name not in wanted:
            continue
        if installed(kind):
            kinds.append(kind)
        else:
            log(f"{kind.name} is not installed: skipped (run benchmarks/setup.sh)")
    if which("wrk") is None:
        log("wrk is not installed (run benchmarks/setup.sh)")
        return 2
    if fits < max(params.idle_counts, default=0):
        params.idle_note = (
            f"{max(IDLE_COUNTS):,} tunnels need {2 * max(IDLE_COUNTS):,}+ descriptors in the"
            f" proxy; the hard RLIMIT_NOFILE here is {hard:,} and raising it needs"
            f" CAP_SYS_RESOURCE, so a one-process proxy is capped at {fits:,} (a proxy with"
            f" several processes at that many per process)"
        )
        log(params.idle_note)

    info = machine()
    versions = {kind.name: kind.version() for kind in kinds}
    results = Results()
    workroot = Path(tempfile.mkdtemp(prefix="egressbox-bench-"))
    os.chmod(workroot, 0o755)  # squid's effective user must reach its own directory

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    started = time.monotonic()
    try:
        run(params, kinds, workroot, results)
    finally:
        stop_all()
        shutil.rmtree(workroot, ignore_errors=True)
    log(f"finished in {time.monotonic() - started:.0f} s")
    text = report(results, params, info, versions)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        payload = {
            "machine": info,
            "versions": versions,
            "params": params.__dict__,
            "results": {
                "throughput": results.throughput,
                "setup": results.setup,
                "http": results.http,
                "idle": results.idle,
            },
        }
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
