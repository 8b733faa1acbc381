"""egressbox against a direct connection and other proxies, side by side, on loopback.

    benchmarks/setup.sh        # squid, tinyproxy (apt); builds benchmarks/build/{loadgen,origin}
    .venv/bin/python benchmarks/proxy.py [--quick] [--json out.json] [--markdown out.md]

Starts the loopback origins (benchmarks/build/origin, from origin.c: a bulk
sink, an echo port and a small-response HTTP port), then each proxy in its
fastest configuration (squid and tinyproxy with per-connection logging off,
egressbox with its audit log on; the configurations are printed under the
tables), each allowed to reach only the loopback origins. Then, in
interleaved rounds (every target once per round, the order rotated each
round, so that noise hits all alike), the compiled load generator
(benchmarks/build/loadgen, from loadgen.c) measures:

- one tunnel: --gib GiB up through one CONNECT or SOCKS5 tunnel to the sink;
  MB/s and the proxy's CPU seconds per GiB (utime + stime of its whole
  process tree, all threads, from /proc);
- short tunnels at 1, 16 and 128 clients: connect, CONNECT 127.0.0.1:PORT or
  SOCKS5 with the host as a domain name, the 200 / success reply, one 64-byte
  echo, close; tunnels/s, p50/p99 latency, the proxy's CPU per tunnel (user
  and system) over exactly the recorded window;
- plain HTTP, one request per connection and kept-alive, at 1, 16 and 128
  clients: absolute-form GETs of a 13-byte body; requests/s, latency, the
  proxy's CPU per request.

Every cell is also run with no proxy ("direct", same generator and origin):
the reference for the ratios and the check that the generator is not the
bottleneck. Last, each proxy is started afresh and holds 2,000 and 10,000
idle CONNECT tunnels (each checked with an echo) while its RSS is read.

--pin-load CPUS / --pin-proxy CPUS run the generator and origin, and the
proxies, under `taskset -c` (e.g. the `serve --workers N` scaling runs).

The machine has 2 cores: generator, origin and proxy share them, so
absolute rates are this box's, and ratios within one run are what to
compare. Everything listens on and connects to 127.0.0.1, every loop is
bounded in count and time, and every process started here is killed at the
end, also on error or Ctrl-C.
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
BUILD = HERE / "build"
LOADGEN = BUILD / "loadgen"
ORIGIN = BUILD / "origin"
HOST = "127.0.0.1"
GIB = 1 << 30
CHUNK = 4 << 20  # bytes per write(2) of the one-tunnel sender (the sink reads as much)
CONCURRENCY = (1, 16, 128)
CPU_AT = 16  # the concurrency whose CPU per tunnel / request the summary shows
GENERATOR_THREADS = 2
IDLE_COUNTS = (2000, 10000)
IDLE_IN_FLIGHT = 256  # handshakes at once while opening idle tunnels
# --tests: one tunnel, short tunnels, plain HTTP one request per connection, kept-alive
TESTS = ("throughput", "tunnels", "http", "keepalive")
RATE_TESTS = ("tunnels", "http", "keepalive")
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
DEFAULT_PROXIES = ("egressbox", "squid", "tinyproxy", FLOOR)
# Where the CPUs to pin to are given: {"load": "0", "proxy": "1"} (taskset -c lists).
PINNING: dict[str, str | None] = {"load": None, "proxy": None}

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
# benchmarks/setup.sh installs pproxy here (never into the project's .venv).
PPROXY_LIB = BUILD / "pylib"


# --- processes ------------------------------------------------------------------------------

_children: list[subprocess.Popen[bytes]] = []


def spawn(
    argv: list[str],
    *,
    stdin: int | None = subprocess.DEVNULL,
    stdout: int | IO[bytes] | None = subprocess.PIPE,
    stderr: int | IO[bytes] | None = subprocess.DEVNULL,
    cpus: str | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start a child in its own process group (under `taskset -c cpus` if given);
    it is killed by stop_all() at the latest."""
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    proc = subprocess.Popen(
        argv, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True, env=env
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


def command_output(argv: list[str], env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=10, check=False, env=env
        )
    except OSError:
        return ""
    return (done.stdout + done.stderr).strip()


# --- origins and proxies -------------------------------------------------------------------


@dataclass
class Origins:
    bulk: int
    echo: int
    http: int
    proc: subprocess.Popen[bytes]


def start_origins() -> Origins:
    proc = spawn([str(ORIGIN), "--threads", "2"], cpus=PINNING["load"])
    ports = read_json(proc, START_TIMEOUT)
    return Origins(ports["bulk"], ports["echo"], ports["http"], proc)


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
    config: str  # its configuration here, logging first
    processes: int = 1  # serving processes: each has its own descriptor limit


def egressbox_program() -> str:
    """The console script of the interpreter running this (the project's .venv)."""
    return str(Path(sys.executable).parent / "egressbox")


def egressbox_policy(workdir: Path) -> Path:
    """The benchmark policy: the loopback origins only, and room for the idle test."""
    policy = workdir / "policy.toml"
    policy.write_text(
        "[egress]\n"
        'allow = ["127.0.0.1"]\n'
        'allow_cidrs = ["127.0.0.0/8"]\n'
        "[limits]\n"
        "max_connections = 50000\n"  # the idle test holds 10,000 tunnels
    )
    return policy


def start_egressbox(
    workdir: Path,
    origins: Origins,
    workers: int = 1,
    env: dict[str, str] | None = None,
    name: str | None = None,
) -> Proxy:
    """`egressbox serve`; with workers > 1, `serve --workers N` (SO_REUSEPORT); `env` and
    `name` for a variant imported from another tree (--egressbox-pythonpath)."""
    policy = egressbox_policy(workdir)
    argv = [egressbox_program(), "serve", "--policy", str(policy)]
    argv += ["--audit-log", str(workdir / "audit.jsonl"), "--quiet"]
    if workers > 1:
        argv += ["--workers", str(workers)]
    proc, ports = start_with_ready_line(argv, workdir, env)
    if name is None:
        name = "egressbox" if workers == 1 else f"egressbox-w{workers}"
    return Proxy(name, proc, ports["http"], ports["socks5"], workdir)


def start_with_ready_line(
    argv: list[str], workdir: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """Start a proxy that prints a JSON ready line of `"name": "HOST:PORT"` listeners."""
    with open(workdir / "stderr.log", "wb") as err:
        proc = spawn(argv, stderr=err, cpus=PINNING["proxy"], env=env)
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
        "access_log none\n"  # its fastest: no line per request
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
        proc = spawn(
            [program, "-N", "-f", str(conf)], stdout=err, stderr=err, cpus=PINNING["proxy"]
        )
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
        # Its fastest: nothing per connection (Connect/Info write and fsync lines each).
        "LogLevel Critical\n"
        f'PidFile "{workdir}/tinyproxy.pid"\n'
        f"Allow {HOST}\n"
        f"ConnectPort {origins.bulk}\n"
        f"ConnectPort {origins.echo}\n"
        "DisableViaHeader Yes\n"
    )
    with open(workdir / "stderr.log", "wb") as err:
        proc = spawn(
            [program, "-d", "-c", str(conf)], stdout=err, stderr=err, cpus=PINNING["proxy"]
        )
    wait_port(port, proc)
    return Proxy("tinyproxy", proc, port, None, workdir)


def pproxy_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(PPROXY_LIB)}


def start_pproxy(workdir: Path, origins: Origins) -> Proxy:
    port = free_port()
    argv = [sys.executable, "-c", PPROXY_SHIM, "-l", f"http+socks5://{HOST}:{port}"]
    with open(workdir / "stderr.log", "wb") as err:
        proc = spawn(argv, stdout=err, stderr=err, cpus=PINNING["proxy"], env=pproxy_env())
    wait_port(port, proc)
    return Proxy("pproxy", proc, port, port, workdir)


def start_floor(workdir: Path, origins: Origins) -> Proxy:
    """benchmarks/floor_proxy.py: CONNECT and relay only, nothing decided or recorded."""
    proc, ports = start_with_ready_line([sys.executable, str(HERE / "floor_proxy.py")], workdir)
    return Proxy(FLOOR, proc, ports["http"], None, workdir, forwards=False)


def egressbox_version(env: dict[str, str] | None = None) -> str:
    """Its version, whether its core ran compiled, and which tree it was imported from."""
    probe = (
        "import egressbox; print(egressbox.__version__, egressbox.compiled_core(),"
        " egressbox.__file__)"
    )
    out = command_output([sys.executable, "-c", probe], env=env).split()
    if len(out) < 3:
        return "?"
    version, compiled, where = out[0], out[1] == "True", Path(out[2]).resolve()
    source = HERE.parent / "src"
    if where.is_relative_to(source):
        rev = command_output(["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"])
        dirty = command_output(["git", "-C", str(HERE), "status", "--porcelain", "--", str(source)])
        if re.fullmatch(r"[0-9a-f]{7,}", rev):
            version += f" (git {rev}{' + uncommitted changes' if dirty else ''})"
    else:
        version += " (imported from outside this checkout: PYTHONPATH or an install)"
    return f"{version}, {'compiled core (mypyc)' if compiled else 'interpreted core'}"


def pproxy_version() -> str:
    probe = "import importlib.metadata as m; print(m.version('pproxy'))"
    version = command_output([sys.executable, "-c", probe], env=pproxy_env()) or "?"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"{version} (PyPI, on {loop})"


def first_line(argv: list[str]) -> str:
    lines = command_output(argv).splitlines()
    return lines[0] if lines else "?"


EGRESSBOX_CONFIG = (
    "audit log on: one JSON line per decision to a file (`--audit-log FILE`); `--quiet` (no"
    " stderr line per connection)"
)

KINDS = [
    ProxyKind("egressbox", "egressbox", start_egressbox, egressbox_version, EGRESSBOX_CONFIG),
    ProxyKind(
        "egressbox-w2",
        "egressbox",
        partial(start_egressbox, workers=2),
        egressbox_version,
        "as egressbox, with `--workers 2` (two processes sharing the ports with SO_REUSEPORT;"
        " one audit log, O_APPEND)",
        processes=2,
    ),
    ProxyKind(
        "squid",
        "squid",
        start_squid,
        lambda: first_line([which("squid") or "squid", "-v"]),
        "`access_log none` (no line per request); `cache deny all`, `cache_mem 0 MB`;"
        " errors only to cache_log",
    ),
    ProxyKind(
        "tinyproxy",
        "tinyproxy",
        start_tinyproxy,
        lambda: first_line([which("tinyproxy") or "tinyproxy", "-v"]),
        "`LogLevel Critical` to a file (no line per connection); `MaxClients 20000`",
    ),
    ProxyKind(
        "pproxy",
        "pproxy",
        start_pproxy,
        pproxy_version,
        "no access log (pproxy has none); `-l http+socks5://`",
    ),
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
        return Path(egressbox_program()).exists()
    if kind.program == "pproxy":
        return (PPROXY_LIB / "pproxy").is_dir()
    if kind.program == "uvloop":
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


def generator(mode: str, cell: Cell, proxy: Proxy | None, target: int, *extra: str) -> list[str]:
    """argv of benchmarks/build/loadgen for one cell; proxy CPU is read over its window."""
    via = cell.via
    if mode == "http":
        via = "direct" if proxy is None else "proxy"
    argv = [str(LOADGEN), mode, "--via", via, "--target", f"{HOST}:{target}"]
    if proxy is not None:
        argv += ["--proxy", f"{HOST}:{proxy_port(proxy, cell.via)}"]
        argv += ["--cpu", "proxy=" + ",".join(str(pid) for pid in tree(proxy.pid))]
    return [*argv, *extra]


def run_generator(argv: list[str], timeout: float) -> dict[str, Any]:
    proc = spawn(argv, cpus=PINNING["load"])
    try:
        return read_json(proc, timeout)
    finally:
        stop(proc)


def rotated(items: list[Cell], by: int) -> list[Cell]:
    if not items:
        return items
    by %= len(items)
    return items[by:] + items[:by]


# --- measurements ----------------------------------------------------------------------------


def measure_throughput(
    cell: Cell, proxy: Proxy | None, origins: Origins, size: int
) -> dict[str, Any]:
    argv = generator("throughput", cell, proxy, origins.bulk, "--bytes", str(size))
    result = run_generator([*argv, "--chunk", str(CHUNK)], RUN_TIMEOUT)
    sample: dict[str, Any] = {"mb_per_s": result["mb_per_s"], "cpu_s_per_gib": None}
    if proxy is not None:
        cpu = result["cpu"]["proxy"]
        sample["cpu_s_per_gib"] = (cpu["utime_s"] + cpu["stime_s"]) / (result["bytes"] / GIB)
    return sample


def measure_rate(
    test: str,
    cell: Cell,
    proxy: Proxy | None,
    origins: Origins,
    concurrency: int,
    params: Params,
) -> dict[str, Any]:
    """One run of the short-tunnel or plain-HTTP generator; rates over its recorded window."""
    mode, target, extra = "tunnel", origins.echo, []
    if test in ("http", "keepalive"):
        mode, target = "http", origins.http
        extra = ["--requests-per-connection", "1" if test == "http" else "0"]
    extra += ["--concurrency", str(concurrency), "--threads", str(GENERATOR_THREADS)]
    extra += ["--warmup", str(params.warmup), "--duration", str(params.duration)]
    extra += ["--cpu", f"origin={origins.proc.pid}"]
    result = run_generator(
        generator(mode, cell, proxy, target, *extra), params.warmup + params.duration + RUN_TIMEOUT
    )
    ops, seconds = result["ops"], result["elapsed"]
    origin = result["cpu"]["origin"]
    sample: dict[str, Any] = {
        "per_s": result["per_s"],
        "p50_ms": result["p50_us"] / 1000,
        "p99_ms": result["p99_us"] / 1000,
        "generator_cores": result["generator_cpu_s"] / seconds,
        "generator_user_us": result["generator_utime_s"] / ops * 1e6 if ops else None,
        "origin_cores": (origin["utime_s"] + origin["stime_s"]) / seconds,
        "busy_cores": result["busy_cores"],
        "errors": result["errors"],
        "error_kinds": result["error_kinds"],
        "reconnects": result["reconnects"],
        "cpu_us": None,
    }
    if proxy is not None and ops:
        cpu = result["cpu"]["proxy"]
        sample["user_us"] = cpu["utime_s"] / ops * 1e6
        sample["sys_us"] = cpu["stime_s"] / ops * 1e6
        sample["cpu_us"] = sample["user_us"] + sample["sys_us"]
        sample["proxy_cores"] = (cpu["utime_s"] + cpu["stime_s"]) / seconds
    return sample


def idle_generator(cell: Cell, proxy: Proxy, origins: Origins, count: int) -> list[str]:
    extra = ["--count", str(count), "--concurrency", str(IDLE_IN_FLIGHT), "--hold", "120"]
    return generator("idle", cell, proxy, origins.echo, *extra)


def measure_idle(kind: ProxyKind, workdir: Path, origins: Origins, count: int) -> dict[str, Any]:
    proxy = kind.start(workdir, origins)
    cell = Cell(kind.name, "connect")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        warm = spawn(
            idle_generator(cell, proxy, origins, IDLE_WARM_UP),
            stdin=subprocess.PIPE,
            cpus=PINNING["load"],
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
            idle_generator(cell, proxy, origins, count),
            stdin=subprocess.PIPE,
            cpus=PINNING["load"],
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

    Ours: this process, its waited children (generators) and the process trees
    of the long-running children (origin, proxies). Everything else that was
    busy is other load (other users' jobs, a build, a test suite). A sample
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


def load_average() -> str:
    with contextlib.suppress(OSError):
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return "?"


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
        measure_throughput(Cell(proxy.name, via), proxy, origins, 1 << 20)
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
    idle_counts: tuple[int, ...]
    idle_note: str = ""
    idle_fits: int = 0  # tunnels one proxy process can hold (0: no cap)
    retake_budget: float = 0.0  # seconds of retaken samples the whole run may spend
    concurrency: tuple[int, ...] = CONCURRENCY
    tests: tuple[str, ...] = TESTS
    pin_load: str | None = None
    pin_proxy: str | None = None


@dataclass
class Results:
    throughput: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # test ("tunnels", "http", "keepalive") -> row label -> concurrency -> samples
    rates: dict[str, dict[str, dict[int, list[dict[str, Any]]]]] = field(default_factory=dict)
    idle: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def start_proxies(kinds: list[ProxyKind], workroot: Path, origins: Origins) -> dict[str, Proxy]:
    proxies: dict[str, Proxy] = {}
    for kind in kinds:
        workdir = workroot / kind.name
        workdir.mkdir()
        proxies[kind.name] = proxy = kind.start(workdir, origins)
        smoke(proxy, origins)
        log(f"started {kind.name} (pid {proxy.pid})")
    return proxies


def run(
    params: Params, kinds: list[ProxyKind], workroot: Path, results: Results, info: dict[str, str]
) -> None:
    origins = start_origins()
    proxies = start_proxies(kinds, workroot, origins)
    cells = {
        "throughput": cells_for(proxies, socks=True),
        "tunnels": cells_for(proxies, socks=True),
        "http": cells_for(proxies, socks=False, forwarding=True),
        "keepalive": cells_for(proxies, socks=False, forwarding=True),
    }
    size = int(params.gib * GIB)

    def of(cell: Cell) -> Proxy | None:
        return None if cell.proxy is None else proxies[cell.proxy]

    watched = [origins.proc.pid] + [p.pid for p in proxies.values()]
    meter = LoadMeter(watched, params.retake_budget)
    info["loadavg_start"] = load_average()
    for number in range(params.rounds):
        order = rotated(cells["throughput"], number) if "throughput" in params.tests else []
        if order:
            log(f"round {number + 1}/{params.rounds}: one tunnel")
        for cell in order + order[::-1]:  # two runs per round, the second in reverse order
            sample = meter.measure(partial(measure_throughput, cell, of(cell), origins, size))
            results.throughput.setdefault(cell.label, []).append(sample)
            log(f"  {cell.label:22} {sample['mb_per_s']:8.0f} MB/s{noise(sample)}")
        for test in RATE_TESTS:
            if test not in params.tests:
                continue
            for conc in params.concurrency:
                log(f"round {number + 1}/{params.rounds}: {test}, concurrency {conc}")
                for cell in rotated(cells[test], number):
                    job = partial(measure_rate, test, cell, of(cell), origins, conc, params)
                    sample = meter.measure(job)
                    label = cell.label if test == "tunnels" else cell.proxy or "direct"
                    table = results.rates.setdefault(test, {}).setdefault(label, {})
                    table.setdefault(conc, []).append(sample)
                    cpu = sample["cpu_us"]
                    log(
                        f"  {label:22} {sample['per_s']:8.0f}/s p50 {sample['p50_ms']:.2f}"
                        f" p99 {sample['p99_ms']:.2f} ms"
                        + (f" cpu {cpu:.0f} us" if cpu else "")
                        + f" errors {sample['errors']}{noise(sample)}"
                    )
    info["loadavg_end"] = load_average()
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
    stop(origins.proc)


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
        "nofile": str(resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
    }


def all_samples(results: Results) -> list[dict[str, Any]]:
    found = [s for samples in results.throughput.values() for s in samples]
    for table in results.rates.values():
        found += [s for by_conc in table.values() for samples in by_conc.values() for s in samples]
    return found


def report(results: Results, params: Params, info: dict[str, str], versions: dict[str, str]) -> str:
    out: list[str] = []
    add = out.append
    add(
        f"Measured {info['date']} on {info['nproc']} cores ({info['cpu']}), Linux {info['kernel']},"
        f" Python {info['python']}, uvloop {info['uvloop']}; load generator benchmarks/loadgen.c"
        f" ({GENERATOR_THREADS} threads), origin benchmarks/origin.c; {params.rounds} interleaved"
        " round(s); medians over rounds."
    )
    if params.pin_load or params.pin_proxy:
        add(
            f"Pinned with taskset: generator and origin on CPU {params.pin_load or 'any'},"
            f" proxies on CPU {params.pin_proxy or 'any'}."
        )
    others = [s["other_cores"] for s in all_samples(results) if s.get("other_cores") is not None]
    if others:
        retried = sum(1 for sample in all_samples(results) if sample.get("attempts", 1) > 1)
        add(
            f"Other processes on the machine used {statistics.median(others):.2f} cores (median;"
            f" max {max(others):.2f}) during the samples; {retried} of {len(others)} samples"
            f" were retaken (within a {params.retake_budget:g} s budget) because others used"
            f" more than {NOISE_CORES} cores. Load average at the start and end:"
            f" {info.get('loadavg_start', '?')} / {info.get('loadavg_end', '?')}."
        )
    add("")
    add("| proxy | version | configuration |")
    add("|---|---|---|")
    for kind in KINDS:
        if kind.name in versions:
            add(f"| {kind.name} | {versions[kind.name]} | {kind.config} |")
    add("")
    summary_table(results, params, add)
    if results.throughput:
        throughput_table(results, params, add)
    for test in RATE_TESTS:
        if test in results.rates:
            rate_table(test, results.rates[test], params, add)
    if results.idle:
        idle_table(results, add)
        if params.idle_note:
            add(f"Idle count: {params.idle_note}.")
            add("")
    add(checks(results))
    return "\n".join(out)


def column_names(results: Results) -> list[str]:
    """direct, then every proxy that has a row somewhere, in KINDS order."""
    labels = set(results.throughput) | set(results.idle)
    for table in results.rates.values():
        labels |= set(table)
    names = {label.split()[0] for label in labels}
    return ["direct"] + [k.name for k in KINDS if k.name in names]


def triple(by_conc: dict[int, list[dict[str, Any]]] | None, key: str = "per_s") -> str:
    if not by_conc:
        return "-"
    return " / ".join(fmt(summarize(by_conc.get(c, []), key)) for c in sorted(by_conc))


def summary_table(results: Results, params: Params, add: Callable[[str], None]) -> None:
    names = column_names(results)
    rates = results.rates

    def row(title: str, cell: Callable[[str], str]) -> None:
        add(f"| {title} | " + " | ".join(cell(name) for name in names) + " |")

    def rate_of(test: str, suffix: str) -> Callable[[str], str]:
        def cell(name: str) -> str:
            if name == "direct" and suffix == "SOCKS5":
                return "-"  # one direct row, under CONNECT
            label = name if name == "direct" or not suffix else f"{name} {suffix}"
            return triple(rates.get(test, {}).get(label))

        return cell

    def cpu_of(test: str, suffix: str) -> Callable[[str], str]:
        def cell(name: str) -> str:
            if name == "direct":
                return "-"
            label = f"{name} {suffix}" if suffix else name
            samples = rates.get(test, {}).get(label, {}).get(CPU_AT, [])
            total, user = summarize(samples, "cpu_us"), summarize(samples, "user_us")
            if total is None or user is None:
                return "-"
            return f"{total:.0f} µs ({user:.0f} user)"

        return cell

    def throughput(name: str) -> str:
        label = name if name == "direct" else f"{name} CONNECT"
        samples = results.throughput.get(label)
        if not samples:
            return "-"
        cpu = summarize(samples, "cpu_s_per_gib")
        rate = fmt(summarize(samples, "mb_per_s"))
        return rate if cpu is None else f"{rate} ({cpu:.2f})"

    def idle(name: str) -> str:
        by_count = results.idle.get(name, {})
        values = [fmt(s["kib_per_tunnel"], 1) for _, s in sorted(by_count.items())]
        return " / ".join(values) + " KiB" if values else "-"

    concs = " / ".join(str(c) for c in params.concurrency)
    add("**Summary** (medians over rounds; the tables below have every figure)")
    add("")
    add("| | " + " | ".join(names) + " |")
    add("|---|" + "---:|" * len(names))
    row(f"short CONNECT tunnels/s at {concs} clients", rate_of("tunnels", "CONNECT"))
    row(f"short SOCKS5 tunnels/s at {concs} clients", rate_of("tunnels", "SOCKS5"))
    row(f"proxy CPU per short CONNECT tunnel ({CPU_AT} clients)", cpu_of("tunnels", "CONNECT"))
    row(f"proxy CPU per short SOCKS5 tunnel ({CPU_AT} clients)", cpu_of("tunnels", "SOCKS5"))
    row(f"plain HTTP, one request per connection, req/s at {concs}", rate_of("http", ""))
    row(f"proxy CPU per request, one per connection ({CPU_AT} clients)", cpu_of("http", ""))
    row(f"plain HTTP, kept-alive, req/s at {concs}", rate_of("keepalive", ""))
    row(f"proxy CPU per kept-alive request ({CPU_AT} clients)", cpu_of("keepalive", ""))
    row("one tunnel (CONNECT), MB/s (proxy CPU s/GiB)", throughput)
    row("memory per idle tunnel (2,000 / 10,000 tunnels)", idle)
    add("")


def throughput_table(results: Results, params: Params, add: Callable[[str], None]) -> None:
    direct = summarize(results.throughput.get("direct", []), "mb_per_s")
    add(
        f"**One tunnel** ({params.gib:g} GiB up through one tunnel per run in {CHUNK >> 20} MiB"
        " writes, two runs per round; CPU = utime + stime of the proxy's process tree per GiB)"
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


RATE_TITLES = {
    "tunnels": (
        "**Short tunnels** (connect, CONNECT or SOCKS5 handshake, one 64-byte echo, close;"
        " latency = connect() to the echo's last byte)"
    ),
    "http": (
        "**Plain HTTP, one request per connection** (connect, absolute-form GET of a 13-byte"
        " body, read the response, close; latency = connect() to the body's last byte)"
    ),
    "keepalive": (
        "**Plain HTTP, kept-alive** (one connection per client, absolute-form GETs of a 13-byte"
        " body one after another; latency = request write to the body's last byte)"
    ),
}


def rate_table(
    test: str,
    table: dict[str, dict[int, list[dict[str, Any]]]],
    params: Params,
    add: Callable[[str], None],
) -> None:
    concs = params.concurrency
    per = "tunnel" if test == "tunnels" else "request"
    add(
        RATE_TITLES[test][:-1] + f"; {params.duration:g} s recorded per run after"
        f" {params.warmup:g} s; CPU = the proxy's user + system CPU per {per} over the"
        " recorded window)"
    )
    add("")
    head = "| target |" + "".join(f" c={c} /s | c={c} p50/p99 ms |" for c in concs)
    add(head + f" CPU µs/{per} (c={CPU_AT}) | user / sys µs | generator cores (c={CPU_AT}) |")
    add("|---|" + "---:|---:|" * len(concs) + "---:|---:|---:|")
    notes = []
    for label, by_conc in table.items():
        row = f"| {label} |"
        for conc in concs:
            samples = by_conc.get(conc, [])
            rate = fmt(summarize(samples, "per_s"))
            p50, p99 = fmt(summarize(samples, "p50_ms"), 2), fmt(summarize(samples, "p99_ms"), 2)
            row += f" {rate} | {p50} / {p99} |"
        at = by_conc.get(CPU_AT, [])
        user, sys_us = fmt(summarize(at, "user_us")), fmt(summarize(at, "sys_us"))
        row += f" {fmt(summarize(at, 'cpu_us'))} | {user} / {sys_us} |"
        row += f" {fmt(summarize(at, 'generator_cores'), 2)} |"
        add(row)
        kinds: dict[str, int] = {}
        reconnects = 0
        for samples in by_conc.values():
            for sample in samples:
                reconnects += sample.get("reconnects", 0)
                for kind, n in sample["error_kinds"].items():
                    kinds[kind] = kinds.get(kind, 0) + n
        if kinds:
            notes.append(f"{label}: " + ", ".join(f"{k} {n:,}" for k, n in kinds.items()))
        if reconnects:
            notes.append(f"{label}: {reconnects:,} kept-alive connections closed by the server")
    add("")
    if notes:
        add("Counted by the generator (all runs): " + "; ".join(notes) + ".")
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
    """The issue's targets for egressbox, each with its figures, and the generator's headroom."""
    lines = ["**Targets** (egressbox)", ""]
    direct = summarize(results.throughput.get("direct", []), "mb_per_s")
    for via in ("CONNECT", "SOCKS5"):
        mine = summarize(results.throughput.get(f"egressbox {via}", []), "mb_per_s")
        if mine is not None and direct:
            met = "met" if mine >= 0.5 * direct else "MISSED"
            lines.append(f"- one tunnel, {via}: {mine / direct:.2f} x direct (>= 0.5: {met})")
    for test, suffix, name in (
        ("tunnels", " CONNECT", "short CONNECT tunnels"),
        ("tunnels", " SOCKS5", "short SOCKS5 tunnels"),
        ("http", "", "plain HTTP, one request per connection"),
        ("keepalive", "", "plain HTTP, kept-alive"),
    ):
        table = results.rates.get(test, {})
        mine_by = table.get("egressbox" + suffix, {})
        for other in ("squid", "tinyproxy"):
            theirs_by = table.get(other + ("" if test != "tunnels" else " CONNECT"), {})
            parts, ok = [], True
            for conc, samples in sorted(mine_by.items()):
                mine = summarize(samples, "per_s")
                theirs = summarize(theirs_by.get(conc, []), "per_s")
                if mine is None or not theirs:
                    continue
                parts.append(f"c={conc}: {mine / theirs:.2f} x")
                ok = ok and mine >= theirs
            if parts:
                verdict = "at or above" if ok else "below at some concurrency"
                lines.append(f"- {name} vs {other}: {', '.join(parts)} ({verdict})")
    lines += headroom(results)
    return "\n".join(lines)


def headroom(results: Results) -> list[str]:
    """Direct (same generator, no proxy) over the fastest proxy, and the generator's CPU."""
    lines = ["", "**Generator headroom** (direct over the fastest proxy row; >= 3 x wanted)", ""]
    for test, table in results.rates.items():
        direct_by = table.get("direct", {})
        ratios = []
        for conc, samples in sorted(direct_by.items()):
            direct = summarize(samples, "per_s")
            best_label, best = max(
                (
                    (label, summarize(by.get(conc, []), "per_s") or 0.0)
                    for label, by in table.items()
                    if label != "direct"
                ),
                key=lambda kv: kv[1],
                default=("-", 0.0),
            )
            if direct and best:
                ratios.append(f"c={conc}: {direct / best:.1f} x ({best_label})")
        rows = [by.get(CPU_AT, []) for label, by in table.items() if label != "direct"]
        cores = max((summarize(r, "generator_cores") or 0.0 for r in rows), default=0.0)
        users = [u for u in (summarize(r, "generator_user_us") for r in rows) if u is not None]
        if ratios:
            lines.append(
                f"- {test}: {', '.join(ratios)}; the generator used at most {cores:.2f} cores"
                f" in a proxy row at c={CPU_AT}"
                + (f", {max(users):.1f} µs of user CPU per operation" if users else "")
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
        rates={test: by_int(table) for test, table in saved["rates"].items()},
        idle=by_int(saved["idle"]),
    )
    return report(results, params, payload["machine"], payload["versions"])


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs (~3 min)")
    parser.add_argument("--json", metavar="FILE", help="write every sample as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the tables as Markdown")
    parser.add_argument(
        "--proxies",
        default=",".join(DEFAULT_PROXIES),
        help="comma-separated subset of: " + ", ".join(k.name for k in KINDS),
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; quick 2)")
    parser.add_argument("--duration", type=float, help="seconds recorded per rate run")
    parser.add_argument("--gib", type=float, help="GiB per one-tunnel run")
    parser.add_argument("--no-idle", action="store_true", help="skip the idle-tunnel test")
    parser.add_argument(
        "--tests",
        default=",".join(TESTS),
        help="comma-separated subset of: throughput (one tunnel), tunnels (short tunnels),"
        " http (one request per connection), keepalive; the idle test follows --no-idle",
    )
    parser.add_argument(
        "--concurrency", default=",".join(map(str, CONCURRENCY)), help="client counts"
    )
    parser.add_argument("--pin-load", metavar="CPUS", help="taskset -c list: generator, origin")
    parser.add_argument("--pin-proxy", metavar="CPUS", help="taskset -c list: the proxies")
    parser.add_argument(
        "--egressbox-pythonpath",
        metavar="NAME=PATH",
        action="append",
        default=[],
        help="also run egressbox imported from PATH as proxy NAME (repeatable; A/B of builds)",
    )
    parser.add_argument(
        "--from-json", metavar="FILE", help="only print the tables of an earlier --json run"
    )
    return parser.parse_args(argv)


def make_params(args: argparse.Namespace, hard: int) -> Params:
    if args.quick:
        params = Params(2, 0.5, 1.0, 0.2, IDLE_COUNTS[:1])
        params.retake_budget = 20.0
    else:
        params = Params(3, 1.0, 2.0, 0.3, IDLE_COUNTS)
        params.retake_budget = 150.0
    if args.rounds is not None:
        params.rounds = args.rounds
    if args.duration is not None:
        params.duration = args.duration
    if args.gib is not None:
        params.gib = args.gib
    params.idle_fits = (hard - FD_HEADROOM) // 2  # two fds per tunnel in the proxy
    if args.no_idle:
        params.idle_counts = ()
    params.tests = tuple(t for t in args.tests.split(",") if t)
    params.concurrency = tuple(int(c) for c in args.concurrency.split(",") if c)
    params.pin_load, params.pin_proxy = args.pin_load, args.pin_proxy
    if params.idle_fits < max(params.idle_counts, default=0):
        params.idle_note = (
            f"{max(IDLE_COUNTS):,} tunnels need {2 * max(IDLE_COUNTS):,}+ descriptors in the"
            f" proxy; the hard RLIMIT_NOFILE here is {hard:,} and raising it needs"
            f" CAP_SYS_RESOURCE, so a one-process proxy is capped at {params.idle_fits:,}"
        )
    return params


def egressbox_variant(spec: str) -> ProxyKind:
    """NAME=PATH: egressbox imported from PATH first (another build of the tree, for A/B)."""
    name, _, path = spec.partition("=")
    if not name or not path:
        raise SystemExit(f"--egressbox-pythonpath wants NAME=PATH, got {spec!r}")
    env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
    return ProxyKind(
        name,
        "egressbox",
        partial(start_egressbox, env=env, name=name),
        partial(egressbox_version, env=env),
        f"as egressbox, imported from the tree {name} (PYTHONPATH)",
    )


def chosen_kinds(wanted: list[str]) -> list[ProxyKind]:
    kinds = []
    for kind in KINDS:
        if kind.name not in wanted:
            continue
        if installed(kind):
            kinds.append(kind)
        else:
            log(f"{kind.name} is not installed: skipped (run benchmarks/setup.sh)")
    return kinds


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.from_json:
        text = report_from_json(Path(args.from_json))
        print(text)
        if args.markdown:
            Path(args.markdown).write_text(text + "\n")
        return 0
    if not (LOADGEN.exists() and ORIGIN.exists()):
        log("benchmarks/build/loadgen and origin are missing: run benchmarks/setup.sh")
        return 2
    unknown = set(args.tests.split(",")) - set(TESTS) - {""}
    if unknown:
        log(f"unknown test(s): {', '.join(sorted(unknown))}; choose from {', '.join(TESTS)}")
        return 2
    params = make_params(args, raise_nofile())
    PINNING["load"], PINNING["proxy"] = params.pin_load, params.pin_proxy
    if params.idle_note:
        log(params.idle_note)
    kinds = chosen_kinds(args.proxies.split(","))
    kinds += [egressbox_variant(spec) for spec in args.egressbox_pythonpath]
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
        run(params, kinds, workroot, results, info)
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
                "rates": results.rates,
                "idle": results.idle,
            },
        }
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
