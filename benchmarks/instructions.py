"""User-space instructions per operation of `egressbox serve`, counted by callgrind.

    python -m benchmarks.instructions [--ops 2000] [--warmup 300] [--concurrency 4]
                                      [--tests connect,socks5,http,keepalive]
                                      [--tree NAME=SRC ...] [--keep]

Wall time and CPU time on a shared 2-core machine move by a third between runs; instruction
counts do not (the same binary, inputs and environment give the same count whatever else the
machine does). So this is how a step of the per-connection work is judged before an
interleaved `proxy.py` run: the proxy runs under `valgrind --tool=callgrind`, the compiled
generator (benchmarks/build/loadgen) runs --warmup operations, the counters are zeroed
(`callgrind_control -z`), the generator runs exactly --ops operations at --concurrency
clients, and the counts since the zero are dumped (`callgrind_control -d`) and divided by
--ops. The count covers
everything the proxy's process executed in user space in that window (the interpreter, uvloop,
libc, the compiled core); the kernel's work is not in it (see profile_tunnel.py for system
calls).

Tests: `connect` (a short CONNECT tunnel with a 64-byte echo), `socks5` (the same through
SOCKS5, the host as a domain name), `http` (an absolute-form GET, one request per connection),
`keepalive` (requests on kept-alive connections). The proxy is configured as in proxy.py:
audit log on, `--quiet`, the loopback policy. `--tree NAME=SRC` (repeatable) runs egressbox
imported from SRC (a tree built with `setup.py build_ext --inplace`) to compare builds; by
default, the one this interpreter imports. Everything is on 127.0.0.1; every run is bounded by
--ops and a timeout. Needs valgrind (benchmarks/setup.sh installs it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import proxy as bench

VALGRIND_START_TIMEOUT = 180.0  # the interpreter's start under callgrind takes ~50x longer
OP_TIMEOUT_S = "30"  # per operation, for the generator (10 s by default; callgrind is slow)
TESTS = {
    # name: (loadgen mode, --via, origin port attribute, extra arguments)
    "connect": ("tunnel", "connect", "echo", ()),
    "socks5": ("tunnel", "socks5", "echo", ()),
    "http": ("http", "proxy", "http", ("--requests-per-connection", "1")),
    "keepalive": ("http", "proxy", "http", ("--requests-per-connection", "0")),
}


def start_counted(workdir: Path, src: str | None) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """`egressbox serve` under callgrind, configured as in proxy.py."""
    policy = bench.egressbox_policy(workdir)
    argv = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={workdir / 'callgrind.out'}",
        sys.executable,
        "-m",
        "egressbox",
        "serve",
        "--policy",
        str(policy),
        "--audit-log",
        str(workdir / "audit.jsonl"),
        "--quiet",
    ]
    env = dict(os.environ, PYTHONHASHSEED="0")
    if src is not None:
        env["PYTHONPATH"] = src
    with open(workdir / "stderr.log", "wb") as err:
        proc = bench.spawn(argv, stderr=err, env=env)
    ready = bench.read_json(proc, VALGRIND_START_TIMEOUT)
    ports = {
        name: int(value.rsplit(":", 1)[1])
        for name, value in ready.items()
        if isinstance(value, str) and value.startswith(f"{bench.HOST}:")
    }
    return proc, ports


def load(test: str, ports: dict[str, int], origins: bench.Origins, ops: int, clients: int) -> int:
    """Run exactly `ops` operations of `test`; the number the generator recorded."""
    mode, via, origin, extra = TESTS[test]
    listener = ports["socks5"] if via == "socks5" else ports["http"]
    argv = [str(bench.LOADGEN), mode, "--via", via, "--proxy", f"{bench.HOST}:{listener}"]
    argv += ["--target", f"{bench.HOST}:{getattr(origins, origin)}", *extra]
    argv += ["--concurrency", str(clients), "--threads", "1", "--timeout", OP_TIMEOUT_S]
    argv += ["--warmup", "0", "--duration", "600", "--count", str(ops)]
    result = bench.run_generator(argv, 600 + bench.RUN_TIMEOUT)
    if result.get("errors"):
        raise RuntimeError(f"{test}: the generator counted errors: {result.get('error_kinds')}")
    recorded: int = result["ops"]
    return recorded


def collected(out: Path) -> int:
    """The total instruction count callgrind wrote ('summary:' or 'totals:' line)."""
    for line in out.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def control(proc: subprocess.Popen[bytes], option: str) -> None:
    subprocess.run(
        ["callgrind_control", option, str(proc.pid)],
        check=True,
        timeout=120,
        stdout=subprocess.DEVNULL,
    )


def count(test: str, src: str | None, origins: bench.Origins, args: argparse.Namespace) -> float:
    """Instructions per operation of `test` for egressbox imported from `src`."""
    workdir = Path(tempfile.mkdtemp(prefix="egressbox-instructions-"))
    try:
        proc, ports = start_counted(workdir, src)
        load(test, ports, origins, args.warmup, args.concurrency)
        control(proc, "-z")
        ops = load(test, ports, origins, args.ops, args.concurrency)
        control(proc, "-d")  # writes callgrind.out.1: the counts since the zero
        bench.stop(proc, grace=60.0)
        return collected(workdir / "callgrind.out.1") / max(1, ops)
    finally:
        if args.keep:  # the callgrind files, for callgrind_annotate
            bench.log(f"{test}: kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations counted per test")
    parser.add_argument("--warmup", type=int, default=300, help="operations before counting")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tests", default=",".join(TESTS))
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=SRC")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory")
    args = parser.parse_args(argv)
    tests = args.tests.split(",")
    unknown = set(tests) - set(TESTS)
    if unknown:
        parser.error(f"unknown tests {sorted(unknown)}: choose from {', '.join(TESTS)}")
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (benchmarks/setup.sh installs it)", file=sys.stderr)
            return 2
    if not bench.LOADGEN.exists():
        print("run benchmarks/setup.sh first (benchmarks/build/loadgen)", file=sys.stderr)
        return 2
    trees: list[tuple[str, str | None]] = [("this", None)]
    if args.tree:
        split = (tree.partition("=") for tree in args.tree)
        trees = [(name, str(Path(src).resolve())) for name, _, src in split]
    rows: dict[str, dict[str, float]] = {name: {} for name, _ in trees}
    try:
        origins = bench.start_origins()
        for test in tests:
            for name, src in trees:
                bench.log(f"{name}: {test}, {args.warmup} + {args.ops} operations under callgrind")
                rows[name][test] = count(test, src, origins, args)
    finally:
        bench.stop_all()
    print(f"Instructions per operation ({args.ops} at {args.concurrency} clients, callgrind):\n")
    print("| tree | " + " | ".join(tests) + " |")
    print("|---|" + "---:|" * len(tests))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[t] / 1000:,.1f}k" for t in tests) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
