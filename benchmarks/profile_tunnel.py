"""Where a short CONNECT tunnel's time goes, per tunnel, egressbox against its peers.

    benchmarks/setup.sh     # squid, tinyproxy, strace, perf, py-spy; builds the generator
    .venv/bin/python -m benchmarks.profile_tunnel [--tunnels 3000] [--seconds 5]
                                                  [--proxies egressbox,tinyproxy,squid]

Starts benchmarks/build/origin and each proxy as benchmarks/proxy.py does
(same configurations: peers with per-connection logging off, egressbox with
its audit log on), then for each proxy, with benchmarks/build/loadgen driving
short CONNECT tunnels (connect, CONNECT, 200, 64-byte echo, close) at 16
clients:

1. untraced: --seconds of load; the proxy's user and system CPU per tunnel
   (/proc/PID/stat of its process tree over the generator's recorded window);
2. `strace -c -f` attached to every process of the proxy while exactly
   --tunnels tunnels are recorded (the generator stops at that count): system
   calls per tunnel by name, and strace's kernel time per tunnel (ptrace slows
   the proxy down many times; the counts are exact, the times only rough: the
   untraced system time of step 1 is the figure to quote);
3. for egressbox only: `perf record -g` of its process for --profile-seconds under
   the same load (the share of samples by DSO: kernel, interpreter, uvloop,
   the mypyc-compiled core, libc), and `py-spy record --native` (the share of
   samples by leaf function and by egressbox function on the stack).

Prints Markdown. Needs root or CAP_SYS_PTRACE (strace, py-spy) and
perf_event_paranoid <= 1 or root (perf); a tool that is missing is skipped
with a note. Everything is on 127.0.0.1; every run is bounded by count and
time; every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import proxy as bench

CONCURRENCY = 16
STRACE_ROW = re.compile(
    r"^\s*(?P<pct>[\d.]+)\s+(?P<seconds>[\d.]+)\s+(?P<usecs>\d+)\s+(?P<calls>\d+)"
    r"(?:\s+(?P<errors>\d+))?\s+(?P<name>\w+)\s*$"
)
PY_SPY = bench.BUILD / "pylib" / "bin" / "py-spy"
FRAME = re.compile(r"^(?P<func>[^ ]+)(?: \((?P<file>[^:]*)(?::\d+)?\))?$")


def tunnel_load(proxy: bench.Proxy, origins: bench.Origins, *extra: str) -> list[str]:
    cell = bench.Cell(proxy.name, "connect")
    argv = bench.generator("tunnel", cell, proxy, origins.echo, *extra)
    return [*argv, "--concurrency", str(CONCURRENCY), "--threads", "2"]


def untraced(proxy: bench.Proxy, origins: bench.Origins, seconds: float) -> dict[str, float]:
    argv = tunnel_load(proxy, origins, "--warmup", "0.5", "--duration", str(seconds))
    result = bench.run_generator(argv, seconds + bench.RUN_TIMEOUT)
    cpu, ops = result["cpu"]["proxy"], max(1, result["ops"])
    return {
        "per_s": result["per_s"],
        "user_us": cpu["utime_s"] / ops * 1e6,
        "sys_us": cpu["stime_s"] / ops * 1e6,
    }


def parse_strace(text: str) -> dict[str, tuple[int, float, int]]:
    """{syscall: (calls, seconds, errors)} from `strace -c` output (and "total")."""
    rows = {}
    for line in text.splitlines():
        found = STRACE_ROW.match(line)
        if found:
            errors = int(found["errors"] or 0)
            rows[found["name"]] = (int(found["calls"]), float(found["seconds"]), errors)
    return rows


def traced(
    proxy: bench.Proxy, origins: bench.Origins, tunnels: int, workdir: Path
) -> dict[str, Any]:
    """strace -c -f of the proxy's processes while exactly `tunnels` tunnels are recorded."""
    out = workdir / f"strace-{proxy.name}.txt"
    argv = ["strace", "-c", "-f", "-o", str(out)]
    for pid in bench.tree(proxy.pid):
        argv += ["-p", str(pid)]
    tracer = bench.spawn(argv, stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # attached (strace has no ready signal); an idle proxy makes few calls
    try:
        load = tunnel_load(proxy, origins, "--warmup", "0", "--duration", "300")
        result = bench.run_generator([*load, "--count", str(tunnels)], 300 + bench.RUN_TIMEOUT)
    finally:
        tracer.send_signal(signal.SIGINT)  # detach and write the summary
        tracer.wait(30)
        bench.stop(tracer)
    rows = parse_strace(out.read_text())
    return {"ops": result["ops"], "rows": rows}


def perf_profile(proxy: bench.Proxy, origins: bench.Origins, seconds: float, workdir: Path) -> str:
    if shutil.which("perf") is None:
        return "perf is not installed (benchmarks/setup.sh installs linux-perf).\n"
    data = workdir / "perf.data"
    pids = ",".join(str(pid) for pid in bench.tree(proxy.pid))
    recorder = bench.spawn(
        ["perf", "record", "-g", "-o", str(data), "-p", pids, "--", "sleep", str(seconds)],
        stdout=subprocess.DEVNULL,
    )
    load = tunnel_load(proxy, origins, "--warmup", "0", "--duration", str(seconds + 1.0))
    bench.run_generator(load, seconds + bench.RUN_TIMEOUT)
    recorder.wait(60)
    by_dso = report_perf(data, "dso", 10)
    by_sym = report_perf(data, "dso,sym", 25)
    return (
        "perf, share of the samples by DSO (self):\n\n```\n" + by_dso + "```\n\n"
        "perf, system calls (inclusive: the kernel work each one does, the receiver's TCP"
        " input on loopback included):\n\n```\n" + syscall_shares(data) + "```\n\n"
        "perf, top symbols (self):\n\n```\n" + by_sym + "```\n"
    )


def syscall_shares(data: Path) -> str:
    argv = ["perf", "report", "-i", str(data), "--stdio", "--children", "-q", "-g", "none"]
    text = bench.command_output([*argv, "--sort", "sym", "--percent-limit", "0.3"])
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[-1].startswith("__x64_sys_"):
            rows.append(f"{parts[0]:>8}  {parts[-1].removeprefix('__x64_sys_')}")
    return "\n".join(rows[:15]) + "\n"


def report_perf(data: Path, keys: str, top: int) -> str:
    argv = ["perf", "report", "-i", str(data), "--stdio", "--no-children", "-q", "-g", "none"]
    text = bench.command_output([*argv, "--sort", keys, "--percent-limit", "0.5"])
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(lines[:top]) + "\n"


def py_spy_profile(
    proxy: bench.Proxy,
    origins: bench.Origins,
    seconds: float,
    workdir: Path,
    keep: Path | None = None,
) -> str:
    if not PY_SPY.exists():
        return "py-spy is not installed (benchmarks/setup.sh installs it).\n"
    raw = workdir / "py-spy.txt"
    argv = [str(PY_SPY), "record", "--native", "-r", "400", "-f", "raw"]
    argv += ["-d", str(int(seconds)), "-o", str(raw), "--pid", str(proxy.pid)]
    recorder = bench.spawn(argv, stdout=subprocess.DEVNULL)
    load = tunnel_load(proxy, origins, "--warmup", "0", "--duration", str(seconds + 1.0))
    bench.run_generator(load, seconds + bench.RUN_TIMEOUT)
    recorder.wait(60)
    if not raw.exists():
        return "py-spy wrote no profile.\n"
    if keep is not None:
        shutil.copyfile(raw, keep)
    return summarize_stacks(raw.read_text())


def frame_name(frame: str) -> str:
    found = FRAME.match(frame.strip())
    if not found:
        return frame.strip()
    where = Path(found["file"] or "").name
    return f"{found['func']} ({where})" if where else found["func"]


def summarize_stacks(text: str) -> str:
    """Shares of py-spy's samples: by leaf frame (self) and by egressbox frame on the stack."""
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()  # system call <- egressbox caller
    user: collections.Counter[str] = collections.Counter()  # inclusive, user-space leaves only
    total = users = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [frame_name(f) for f in stack.split(";")]
        leaf[frames[-1]] += n
        for name in set(frames):
            if is_ours(name):
                inclusive[name] += n
        if frames[-1].endswith("(libc.so.6)"):
            caller = next((f for f in reversed(frames) if "CPyDef" in f or ".py)" in f), "?")
            calls[f"{frames[-1].split()[0]} <- {caller}"] += n
            continue
        users += n
        for name in set(frames):
            if "CPyDef" in name or ".py)" in name:
                user[name] += n
    if not total:
        return "py-spy recorded no samples.\n"
    out = [f"py-spy --native, {total:,} samples; self (leaf frame):", "", "```"]
    out += [f"{n / total * 100:5.1f} %  {name}" for name, n in leaf.most_common(25)]
    out += ["```", "", "py-spy, egressbox and uvloop frames on the stack (inclusive):", "", "```"]
    out += [f"{n / total * 100:5.1f} %  {name}" for name, n in inclusive.most_common(30)]
    out += ["```", "", "py-spy, libc calls by their nearest egressbox caller:", "", "```"]
    out += [f"{n / total * 100:5.1f} %  {name}" for name, n in calls.most_common(20)]
    out += ["```", "", f"py-spy, the {users:,} samples outside libc (user space), inclusive:"]
    out += ["", "```"]
    out += [f"{n / max(1, users) * 100:5.1f} %  {name}" for name, n in user.most_common(40)]
    return "\n".join([*out, "```", ""])


def is_ours(name: str) -> bool:
    return "egressbox" in name or "CPyDef" in name or "uvloop" in name


def strace_table(results: dict[str, dict[str, Any]], top: int = 30) -> str:
    names = list(results)
    per: dict[str, dict[str, float]] = {}
    for name, result in results.items():
        ops = max(1, result["ops"])
        per[name] = {call: calls / ops for call, (calls, _, _) in result["rows"].items()}
    calls = sorted(
        {c for rows in per.values() for c, n in rows.items() if c != "total" and n >= 0.1},
        key=lambda c: -max(per[n].get(c, 0.0) for n in names),
    )[:top]
    out = ["| system call per tunnel | " + " | ".join(names) + " |"]
    out.append("|---|" + "---:|" * len(names))
    for call in ["total", *calls]:
        cells = [f"{per[n].get(call, 0.0):.2f}" for n in names]
        label = "**total**" if call == "total" else f"`{call}`"
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    kernel = []
    for result in results.values():
        total = result["rows"].get("total")
        if total:
            kernel.append(f"{total[1] / max(1, result['ops']) * 1e6:.0f}")
    out.append("| strace's kernel time per tunnel, µs | " + " | ".join(kernel) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tunnels", type=int, default=3000, help="tunnels traced per proxy")
    parser.add_argument("--seconds", type=float, default=5.0, help="the untraced run")
    parser.add_argument("--profile-seconds", type=float, default=15.0, help="perf, py-spy")
    parser.add_argument("--proxies", default="egressbox,tinyproxy,squid")
    parser.add_argument("--py-spy-raw", metavar="FILE", type=Path, help="keep py-spy's stacks")
    args = parser.parse_args(argv)
    if not bench.LOADGEN.exists():
        print("run benchmarks/setup.sh first (benchmarks/build/loadgen)", file=sys.stderr)
        return 2
    if shutil.which("strace") is None:
        print("strace is not installed (benchmarks/setup.sh installs it)", file=sys.stderr)
        return 2
    bench.raise_nofile()
    kinds = bench.chosen_kinds(args.proxies.split(","))
    workroot = Path(tempfile.mkdtemp(prefix="egressbox-profile-"))
    workroot.chmod(0o755)  # squid's effective user must reach its own directory
    out: list[str] = []
    try:
        origins = bench.start_origins()
        proxies = bench.start_proxies(kinds, workroot, origins)
        plain, traces = {}, {}
        for name, proxy in proxies.items():
            bench.log(f"{name}: untraced, then strace -c -f for {args.tunnels} tunnels")
            plain[name] = untraced(proxy, origins, args.seconds)
            traces[name] = traced(proxy, origins, args.tunnels, workroot)
        out.append(f"Short CONNECT tunnels at {CONCURRENCY} clients.\n")
        out.append("| untraced, per tunnel | " + " | ".join(plain) + " |")
        out.append("|---|" + "---:|" * len(plain))
        for key, title in (("per_s", "tunnels/s"), ("user_us", "user µs"), ("sys_us", "sys µs")):
            out.append(f"| {title} | " + " | ".join(fmt(p[key]) for p in plain.values()) + " |")
        out.append("")
        out.append(strace_table(traces))
        if "egressbox" in proxies:
            bench.log("egressbox: perf record, then py-spy record")
            proxy = proxies["egressbox"]
            out.append(perf_profile(proxy, origins, args.profile_seconds, workroot))
            out.append(
                py_spy_profile(proxy, origins, args.profile_seconds, workroot, args.py_spy_raw)
            )
    finally:
        bench.stop_all()
        shutil.rmtree(workroot, ignore_errors=True)
    print("\n".join(out))
    return 0


def fmt(value: float) -> str:
    return f"{value:,.0f}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
