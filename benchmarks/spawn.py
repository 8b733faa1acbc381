"""What `egressbox run -- true` adds over a bare `true`, per profile, and where it goes.

    python benchmarks/spawn.py [--runs 30] [--warmup 3] [--profiles unrestricted,...]
                               [--breakdown-runs 10] [--no-breakdown] [--json FILE]

1. End to end (hyperfine-like): after --warmup runs, --runs timed runs of each
   variant, each a posix_spawn + wait4 of the whole command with output to
   /dev/null: a bare `true`, then `egressbox run --profile P -- true` for every
   profile, from a scratch workspace under /tmp (the default write root is
   the current directory). Median and p90 wall time; "added" is the variant's
   median minus the bare `true` median. Target: added <= 60 ms.

2. Breakdown (no tracing hook exists in egressbox, so the pieces are timed in
   a probe): `python -c pass` (interpreter start), then a fresh probe process
   per run (`spawn.py --probe P`) that walks the same steps as `egressbox run`
   with a timestamp after each:
     import_cli     import egressbox.cli (what the console script does first)
     cli_setup      parse the arguments, load the policy (run's _cli_options; it
                    imports egressbox.resolve, so dnspython, for --nameserver)
     pre_fork_imp   imports run makes before the fork (egressbox.proxy.server for its log)
     host_probe     run.host_facts(): probing namespaces, Landlock, seccomp
     prepare        run.prepare(): resolve CMD, plan the filesystem, environment
     fork_listen    run.spawn(): fork the launcher until its listeners arrive
     post_fork_imp  imports after the fork (egressbox.serve, uvloop), the loop
     proxy_start    EgressProxy.start() on the received sockets
     wait_child     until the launcher (and so `true`) has exited, reaped
   and, separately and warm, child_path: spawn() + waitpid with no proxy at
   all, i.e. fork -> unshare -> bind -> mounts -> Landlock -> seccomp -> exec
   `true` -> exit, the child's own critical path. The "cpu ms" column of the
   end-to-end table (user + system time of the whole process tree, from
   wait4) is the figure to trust on a busy machine; wall times there move
   with other load.

Nothing touches the network: `true` never connects, and no policy is given
(every destination would be denied). Every loop is bounded by --runs.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from egressbox.runner.assemble import Prepared

# Keep the module's top-level imports minimal: `--probe` times imports, and
# anything imported here would make egressbox's own imports look cheaper.

TARGET_ADDED_MS = 60.0
PROFILES = ("unrestricted", "workspace_paths", "worktree", "os_hardened")
STAGES = (
    "import_cli",
    "cli_setup",
    "pre_fork_imp",
    "host_probe",
    "prepare",
    "fork_listen",
    "post_fork_imp",
    "proxy_start",
    "wait_child",
)
MAX_RUNS = 1000  # a bound on any --runs value


# -- the probe (runs in a fresh process) -------------------------------------------------


def probe(profile: str) -> dict[str, float]:
    """Walk `egressbox run --profile P -- true` step by step; seconds per stage."""
    marks = [("start", time.perf_counter())]

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter()))

    import egressbox.cli as cli

    mark("import_cli")
    from egressbox.cli.run import _cli_options
    from egressbox.runner.assemble import prepare
    from egressbox.runner.facts import host_facts
    from egressbox.runner.spawn import spawn
    from egressbox.runner.supervise import supervise

    argv = ["run", "--profile", profile, "--quiet", "--", "true"]
    args = cli.build_parser().parse_args(argv)
    command = list(args.cmd)
    options = _cli_options(args, command[1:] if command[:1] == ["--"] else command)
    assert options is not None
    mark("cli_setup")
    from egressbox.proxy.server import EgressProxy  # run's _run_reporting_errors imports it first

    mark("pre_fork_imp")
    facts = host_facts()
    mark("host_probe")
    prepared = prepare(options, facts)
    mark("prepare")
    launched = spawn(prepared)
    launched.go()  # run sends it once the policy is loaded (here: already)
    mark("fork_listen")
    from egressbox.serve import run_loop

    proxy_times: list[float] = []
    original_start = EgressProxy.start

    async def timed_start(self: EgressProxy) -> None:
        began = time.perf_counter()
        await original_start(self)
        proxy_times.append(time.perf_counter() - began)

    EgressProxy.start = timed_start  # type: ignore[method-assign]
    loop_entered: list[float] = []

    async def main() -> int:
        loop_entered.append(time.perf_counter())
        await supervise(launched, options, prepared)
        return 0

    run_loop(main)
    mark("end")
    EgressProxy.start = original_start  # type: ignore[method-assign]
    times = {name: at - marks[i][1] for i, (name, at) in enumerate(marks[1:])}
    post_fork = loop_entered[0] - marks[-2][1] if loop_entered else 0.0
    proxy = proxy_times[0] if proxy_times else 0.0
    times["post_fork_imp"] = post_fork
    times["proxy_start"] = proxy
    times["wait_child"] = times.pop("end") - post_fork - proxy
    times["total_inside"] = marks[-1][1] - marks[0][1]
    times["child_path"] = child_path(prepared)
    return times


def child_path(prepared: Prepared) -> float:
    """spawn() + waitpid with no proxy: the confined child's own critical path (warm)."""
    from egressbox.runner.spawn import spawn

    began = time.perf_counter()
    launched = spawn(prepared)
    launched.go()
    for sock in launched.listeners:
        sock.close()
    os.waitpid(launched.pid, 0)
    elapsed = time.perf_counter() - began
    if launched.tee is not None:
        launched.tee.finish()
    return elapsed


# -- timing whole commands ------------------------------------------------------------


def time_command(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one posix_spawn + wait4, output to /dev/null.

    CPU is user + system time of the command and every descendant it reaped
    (the launcher, the reaper, `true`): far less sensitive than wall time to
    other load on the machine.
    """
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        actions = [
            (os.POSIX_SPAWN_DUP2, devnull, 0),
            (os.POSIX_SPAWN_DUP2, devnull, 1),
            (os.POSIX_SPAWN_DUP2, devnull, 2),
        ]
        here = os.getcwd()
        os.chdir(cwd)  # posix_spawn has no cwd argument on Python 3.11
        try:
            began = time.perf_counter()
            pid = os.posix_spawn(argv[0], argv, env, file_actions=actions)
            _, status, usage = os.wait4(pid, 0)
            elapsed = time.perf_counter() - began
        finally:
            os.chdir(here)
    finally:
        os.close(devnull)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {os.waitstatus_to_exitcode(status)}")
    return elapsed, usage.ru_utime + usage.ru_stime


def measure(
    argv: list[str], *, runs: int, warmup: int, cwd: str, env: dict[str, str]
) -> list[float]:
    for _ in range(warmup):
        time_command(argv, cwd, env)
    return [time_command(argv, cwd, env)[0] for _ in range(runs)]


def measure_interleaved(
    variants: dict[str, list[str]], *, runs: int, warmup: int, cwd: str, env: dict[str, str]
) -> dict[str, list[tuple[float, float]]]:
    """Round-robin over the variants, so a load that drifts (a busy 2-core machine)
    weighs on all of them alike. A variant that fails its warm-up is left out."""
    kept: dict[str, list[str]] = {}
    for name, argv in variants.items():
        try:
            for _ in range(warmup):
                time_command(argv, cwd, env)
        except RuntimeError as exc:
            print(f"{name}: skipped ({exc})", file=sys.stderr)
            continue
        kept[name] = argv
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in kept}
    for _ in range(runs):
        for name, argv in kept.items():
            timings[name].append(time_command(argv, cwd, env))
    return timings


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def egressbox_command() -> list[str]:
    """The installed console script beside this interpreter, else `python -m egressbox`."""
    script = os.path.join(os.path.dirname(sys.executable), "egressbox")
    if os.access(script, os.X_OK):
        return [script]
    return [sys.executable, "-m", "egressbox"]


def bench_env() -> dict[str, str]:
    """The caller's environment without a profile or sandbox mode of an outer run."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import shutil
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="timed runs per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per variant first")
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument(
        "--breakdown-runs", type=int, default=10, help="probe processes per profile"
    )
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--probe", metavar="PROFILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.probe)))
        return 0
    runs = max(1, min(args.runs, MAX_RUNS))
    warmup = max(0, min(args.warmup, MAX_RUNS))
    profiles = [p for p in args.profiles.split(",") if p]
    true = shutil.which("true") or "/bin/true"
    env = bench_env()
    results: dict[str, object] = {
        "runs": runs,
        "warmup": warmup,
        "target_added_ms": TARGET_ADDED_MS,
    }
    workspace = tempfile.mkdtemp(prefix="egressbox-spawn-")
    try:
        variants = {"": [true]}
        for profile in profiles:
            variants[profile] = [*egressbox_command(), "run", "--profile", profile, "--quiet"]
            variants[profile] += ["--", true]
        timings = measure_interleaved(variants, runs=runs, warmup=warmup, cwd=workspace, env=env)
        bare = timings.pop("")
        rows: list[tuple[str, list[tuple[float, float]], str | None]] = [
            ("true (bare)", bare, None)
        ]
        rows += [(f"run --profile {p}", t, p) for p, t in timings.items()]
        table = print_table(rows, median([wall for wall, _ in bare]))
        results["end_to_end"] = table
        if not args.no_breakdown:
            results["breakdown"] = breakdown(
                [p for _, _, p in rows if p is not None],
                max(1, min(args.breakdown_runs, MAX_RUNS)),
                workspace,
                env,
            )
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


def print_table(
    rows: list[tuple[str, list[tuple[float, float]], str | None]], bare_median: float
) -> list[dict[str, object]]:
    head = f"{'variant':<32}{'median ms':>10}{'p90 ms':>9}{'added ms':>10}{'cpu ms':>9}"
    print(f"{head}{'target':>8}")
    out: list[dict[str, object]] = []
    for name, samples, profile in rows:
        walls = [wall for wall, _ in samples]
        mid, p90 = median(walls) * 1000, percentile(walls, 0.9) * 1000
        cpu = median([c for _, c in samples]) * 1000
        added = mid - bare_median * 1000
        verdict = "" if profile is None else ("ok" if added <= TARGET_ADDED_MS else "over")
        added_text = "" if profile is None else f"{added:.1f}"
        print(f"{name:<32}{mid:>10.1f}{p90:>9.1f}{added_text:>10}{cpu:>9.1f}{verdict:>8}")
        out.append(
            {"variant": name, "median_ms": mid, "p90_ms": p90, "added_ms": added, "cpu_ms": cpu}
        )
    return out


def breakdown(
    profiles: list[str], runs: int, workspace: str, env: dict[str, str]
) -> dict[str, object]:
    import json
    import subprocess

    python_start = measure(
        [sys.executable, "-c", "pass"], runs=runs, warmup=1, cwd=workspace, env=env
    )
    print(f"\ninterpreter start (python -c pass): median {median(python_start) * 1000:.1f} ms")
    result: dict[str, object] = {"python_start_ms": median(python_start) * 1000}
    columns = [*STAGES, "total_inside", "child_path"]
    samples: dict[str, dict[str, list[float]]] = {p: {c: [] for c in columns} for p in profiles}
    for _ in range(runs):  # round-robin, as for the end-to-end runs
        for profile in profiles:
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--probe", profile],
                cwd=workspace,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            times = json.loads(done.stdout.strip().splitlines()[-1])
            for c in columns:
                samples[profile][c].append(float(times.get(c, 0.0)))
    header = "".join(f"{c[:11]:>12}" for c in columns)
    print(f"\nmedian ms per stage, {runs} probe processes each\n{'profile':<16}{header}")
    for profile in profiles:
        medians = {c: median(v) * 1000 for c, v in samples[profile].items()}
        print(f"{profile:<16}" + "".join(f"{medians[c]:>12.1f}" for c in columns))
        result[profile] = medians
    result["slowest_imports"] = slowest_imports(workspace, env)
    return result


# What the parent process of `egressbox run` imports, before and after the fork.
PARENT_IMPORTS = (
    "egressbox.cli",
    "egressbox.runner.api",
    "egressbox.resolve",
    "egressbox.proxy.server",
    "egressbox.serve",
    "egressbox.proxy.listeners",
)
SLOWEST_SHOWN = 12


def slowest_imports(workspace: str, env: dict[str, str]) -> list[dict[str, object]]:
    """One `python -X importtime` of the parent's imports: the modules with most self time."""
    import subprocess

    code = "; ".join(f"import {name}" for name in PARENT_IMPORTS)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows: list[tuple[int, int, str]] = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        fields = line.removeprefix("import time:").split("|", 2)
        rows.append((int(fields[0]), int(fields[1]), fields[2].strip()))
    total = sum(own for own, _, _ in rows)
    print(f"\nimports of the parent ({', '.join(PARENT_IMPORTS)}), one cold-ish run:")
    print(f"  {len(rows)} modules, {total / 1000:.1f} ms of import time; most self time:")
    shown = sorted(rows, reverse=True)[:SLOWEST_SHOWN]
    for own, cumulative, name in shown:
        print(f"  {own / 1000:>7.1f} ms self {cumulative / 1000:>7.1f} ms cumulative  {name}")
    return [{"module": n, "self_ms": o / 1000, "cumulative_ms": c / 1000} for o, c, n in shown]


if __name__ == "__main__":
    sys.exit(main())
