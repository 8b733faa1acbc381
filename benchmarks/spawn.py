"""What `egressbox run -- true` adds over a bare `true`, and where the time goes.

    python benchmarks/spawn.py [--runs 21] [--warmup 3] [--policy FILE] [--profiles P,...]
                               [--timeline-runs 11] [--no-timeline] [--json FILE]

1. End to end: after --warmup runs of each, --runs rounds over the variants in turn (A B C A B
   C ...: a load that drifts on a shared machine weighs on all alike), each a posix_spawn +
   wait4 of the whole command with output to /dev/null, from a scratch workspace under /tmp
   (the default write root is the current directory):
     true                      the bare command
     python -c pass            the interpreter alone (what any Python front costs)
     run -- true               no policy (every destination denied; capture on)
     run --policy P -- true    the policy's run settings read before the fork (capture on)
     run ... --no-capture      the same without capture (no nftables rules, no DNS view)
   and `run --policy P --profile X -- true` for each of --profiles. Median and p90 wall time;
   "added" is the variant's median minus the bare `true` median (target: 30 ms or less);
   "cpu" is user + system time of the whole process tree (from wait4), less sensitive to
   other load than wall time. The load average is printed with the table.

2. Timeline (--timeline-runs traced runs of `run --policy P -- true`): a copy of the command
   whose steps are wrapped to write a monotonic timestamp at entry and exit (`> step`,
   `< step`) and around each egressbox import, per process (P0 `egressbox run`, P1 the
   zygote that becomes the launcher, P2 the reaper, pid 1 of the command's namespace, P3
   the command until its exec). The median time since the spawn of each mark, in order.
   Tracing itself costs a little: the traced total is above the untraced median.

3. The parent's imports, one `python -X importtime` run: the modules with most self time.

Python's bytecode caches matter to start-up: PYTHONDONTWRITEBYTECODE is removed from the
environment of every timed command, as are EGRESSBOX_* settings of an outer run. Nothing
touches the network: `true` never connects. Every loop is bounded by --runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

# Keep this module's top-level imports minimal: the tracer (--trace-run) runs the command in
# this process, and anything imported here would make egressbox's imports look cheaper.

TARGET_ADDED_MS = 30.0
MAX_RUNS = 1000  # a bound on any --runs value
TRACE_FD_ENV = "EGRESSBOX_BENCH_TRACE_FD"
TRACE_T0_ENV = "EGRESSBOX_BENCH_T0"
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_POLICY = os.path.join(HERE, "..", "policies", "pypi.toml")

# -- the tracer (`spawn.py --trace-run ARGS...`: runs `egressbox ARGS` with marks) ---------

# Steps of `egressbox run`, by module: wrapped where they are defined, before any importer
# binds them. A name that no longer exists is skipped.
TRACED: dict[str, tuple[str, ...]] = {
    "egressbox.cli": ("build_parser",),
    "egressbox.cli.run": ("run_command", "_cli_run_settings", "_cli_options", "_cli_policy"),
    "egressbox.runner.zygote": ("start", "launch", "_preload", "_walk_etc_while_waiting"),
    "egressbox.runner.facts": ("host_facts", "_compiled_seccomp"),
    "egressbox.runner.assemble": ("prepare",),
    "egressbox.runner.spawn": ("spawn", "_receive", "confirm", "open_stdio"),
    "egressbox.runner.supervise": ("_exit_before_first_connection", "_result"),
    "egressbox.confine.launcher": (
        "launcher_main",
        "_preload",
        "_unshare",
        "_listeners",
        "_capture",
        "_walk_etc",
        "_mounts",
        "_await_go",
        "_supervise",
        "_restrict",
        "_landlock",
        "_close_fds",
        "_seccomp",
        "_report_applied",
    ),
    "egressbox.confine.world": ("_pivot", "_mask_all", "_bind_all", "_proc", "_dev"),
    "egressbox.confine.capture": ("install_redirect",),
}


class _Tracer:
    def __init__(self, fd: int, t0: float) -> None:
        self.fd = fd
        self.t0 = t0

    def mark(self, what: str) -> None:
        line = f"{(time.monotonic() - self.t0) * 1000:.3f} {os.getpid()} {what}\n"
        with contextlib.suppress(OSError):  # closed by the command's exec
            os.write(self.fd, line.encode())

    def wrap(self, module: Any, name: str) -> None:
        inner = getattr(module, name, None)
        if not callable(inner):
            return
        if name == "_close_fds":
            inner = self._keeping_trace_fd(inner)
        mark = self.mark

        def traced(*args: Any, **kwargs: Any) -> Any:
            mark(f"> {name}")
            try:
                return inner(*args, **kwargs)
            finally:
                mark(f"< {name}")

        setattr(module, name, traced)

    def _keeping_trace_fd(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        fd = self.fd

        def close_fds(keep: tuple[int, ...]) -> Any:
            return inner((*keep, fd))

        return close_fds


def trace_run(args: list[str]) -> int:
    """Run `egressbox ARGS` in this process, marking each step (see TRACED)."""
    import importlib.util  # egressbox imports it too (importlib.abc would add ~5 ms)

    tracer = _Tracer(int(os.environ[TRACE_FD_ENV]), float(os.environ[TRACE_T0_ENV]))
    tracer.mark("interpreter up")

    class Finder:
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if not fullname.startswith("egressbox"):
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(fullname)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            real_exec = loader.exec_module

            def exec_module(module: Any) -> None:
                tracer.mark(f"import> {fullname}")
                real_exec(module)
                tracer.mark(f"import< {fullname}")
                for name in TRACED.get(fullname, ()):
                    tracer.wrap(module, name)

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, Finder())
    real_fork, real_execve = os.fork, os.execve

    def fork() -> int:
        pid = real_fork()
        tracer.mark("fork (parent)" if pid else "forked")
        return pid

    def execve(*exec_args: Any) -> Any:
        tracer.mark("execve")
        return real_execve(*exec_args)

    os.fork = fork
    os.execve = execve  # type: ignore[assignment]
    from egressbox.cli import main

    sys.argv = ["egressbox", *args]
    return main()  # as the console script: `run` ends with os._exit, no interpreter teardown


def timeline(argv: list[str], runs: int, cwd: str, env: dict[str, str]) -> list[dict[str, Any]]:
    """Median time since the spawn of each mark over `runs` traced runs, in order."""
    import statistics

    samples: dict[tuple[int, str, int], list[float]] = {}
    for _ in range(runs + 1):  # the first fills the bytecode caches
        marks, total = _traced_once(argv, cwd, env)
        pids: list[str] = []
        seen: dict[tuple[int, str], int] = {}
        for at, pid, what in marks:
            if pid not in pids:
                pids.append(pid)
            key = (pids.index(pid), what)
            seen[key] = seen.get(key, -1) + 1
            samples.setdefault((*key, seen[key]), []).append(at)
        samples.setdefault((0, "exited (wait4)", 0), []).append(total)
    rows = [
        {"process": f"P{proc}", "mark": what, "ms": statistics.median(times[1:] or times)}
        for (proc, what, _), times in samples.items()
    ]
    return sorted(rows, key=lambda row: float(row["ms"]))


def _traced_once(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[list[Any], float]:
    read_fd, write_fd = os.pipe()
    os.set_inheritable(write_fd, True)
    t0 = time.monotonic()
    traced_env = {**env, TRACE_FD_ENV: str(write_fd), TRACE_T0_ENV: repr(t0)}
    command = [sys.executable, os.path.abspath(__file__), "--trace-run", *argv]
    pid = _spawn(command, cwd, traced_env)
    os.close(write_fd)
    os.waitpid(pid, 0)
    total = (time.monotonic() - t0) * 1000
    data = b""
    while chunk := os.read(read_fd, 65536):
        data += chunk
    os.close(read_fd)
    marks = []
    for line in data.decode().splitlines():
        at, process, what = line.split(" ", 2)
        marks.append((float(at), process, what))
    return marks, total


# -- timing whole commands ------------------------------------------------------------


def _spawn(argv: list[str], cwd: str, env: dict[str, str]) -> int:
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        actions = [(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)]
        here = os.getcwd()
        os.chdir(cwd)  # posix_spawn has no cwd argument on Python 3.11
        try:
            return os.posix_spawn(argv[0], argv, env, file_actions=actions)
        finally:
            os.chdir(here)
    finally:
        os.close(devnull)


def time_command(argv: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one posix_spawn + wait4, output to /dev/null.

    CPU is user + system time of the command and every descendant it reaped (the zygote that
    became the launcher, the reaper, `true`).
    """
    began = time.perf_counter()
    pid = _spawn(argv, cwd, env)
    _, status, usage = os.wait4(pid, 0)
    elapsed = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {os.waitstatus_to_exitcode(status)}")
    return elapsed, usage.ru_utime + usage.ru_stime


def measure_interleaved(
    variants: dict[str, list[str]], *, runs: int, warmup: int, cwd: str, env: dict[str, str]
) -> dict[str, list[tuple[float, float]]]:
    """Round-robin over the variants; a variant that fails its warm-up is left out."""
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
    """The caller's environment without settings of an outer run, bytecode caches allowed."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("EGRESSBOX_") and k != "PYTHONDONTWRITEBYTECODE"
    }


def variants_for(true: str, policy: str, profiles: list[str]) -> dict[str, list[str]]:
    run = [*egressbox_command(), "run", "--quiet"]
    found = {
        "true": [true],
        "python -c pass": [sys.executable, "-c", "pass"],
        "run -- true": [*run, "--", true],
        "run --policy P -- true": [*run, "--policy", policy, "--", true],
        "run --policy P --no-capture -- true": [*run, "--policy", policy, "--no-capture"],
    }
    found["run --policy P --no-capture -- true"] += ["--", true]
    for profile in profiles:
        found[f"run --policy P --profile {profile}"] = [
            *run,
            "--policy",
            policy,
            "--profile",
            profile,
            "--",
            true,
        ]
    return found


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--trace-run"]:
        return trace_run(args_in[1:])
    import argparse
    import json
    import shutil
    import tempfile

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21, help="timed rounds over the variants")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per variant first")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="policy file P (TOML)")
    parser.add_argument("--profiles", default="", help="also time these profiles (comma list)")
    parser.add_argument("--timeline-runs", type=int, default=11, help="traced runs")
    parser.add_argument("--no-timeline", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(args_in)
    runs = max(1, min(args.runs, MAX_RUNS))
    warmup = max(0, min(args.warmup, MAX_RUNS))
    policy = os.path.realpath(args.policy)
    profiles = [p for p in args.profiles.split(",") if p]
    true = shutil.which("true") or "/bin/true"
    env = bench_env()
    results: dict[str, object] = {"runs": runs, "target_added_ms": TARGET_ADDED_MS}
    workspace = tempfile.mkdtemp(prefix="egressbox-spawn-")
    try:
        variants = variants_for(true, policy, profiles)
        timings = measure_interleaved(variants, runs=runs, warmup=warmup, cwd=workspace, env=env)
        load = os.getloadavg()
        results["load_average"] = load
        results["end_to_end"] = print_table(timings, runs, load)
        if not args.no_timeline:
            rows = timeline(
                ["run", "--quiet", "--policy", policy, "--", true],
                max(1, min(args.timeline_runs, MAX_RUNS)),
                workspace,
                env,
            )
            print_timeline(rows)
            results["timeline"] = rows
        results["slowest_imports"] = slowest_imports(workspace, env)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


def print_table(
    timings: dict[str, list[tuple[float, float]]], runs: int, load: tuple[float, float, float]
) -> list[dict[str, object]]:
    bare = median([wall for wall, _ in timings.get("true", [(0.0, 0.0)])]) * 1000
    print(f"{runs} interleaved rounds; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    head = f"{'variant':<40}{'median ms':>10}{'p90 ms':>9}{'added ms':>10}{'cpu ms':>9}"
    print(f"{head}{'target':>8}")
    out: list[dict[str, object]] = []
    for name, samples in timings.items():
        walls = [wall for wall, _ in samples]
        mid, p90 = median(walls) * 1000, percentile(walls, 0.9) * 1000
        cpu = median([c for _, c in samples]) * 1000
        added = mid - bare
        is_run = name.startswith("run")
        verdict = ("ok" if added <= TARGET_ADDED_MS else "over") if is_run else ""
        added_text = f"{added:.1f}" if name != "true" else ""
        print(f"{name:<40}{mid:>10.1f}{p90:>9.1f}{added_text:>10}{cpu:>9.1f}{verdict:>8}")
        out.append(
            {"variant": name, "median_ms": mid, "p90_ms": p90, "added_ms": added, "cpu_ms": cpu}
        )
    return out


def print_timeline(rows: list[dict[str, Any]]) -> None:
    print("\ntimeline of `run --policy P -- true` (median ms since the spawn, traced):")
    for row in rows:
        print(f"  {row['ms']:8.2f}  {row['process']}  {row['mark']}")


# What the parent process of `egressbox run` imports before it hands its plan over.
PARENT_IMPORTS = ("egressbox.cli", "egressbox.cli.run", "egressbox.core.policy", "tomllib")
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
    print(f"\nimports of the parent ({', '.join(PARENT_IMPORTS)}), one run:")
    print(f"  {len(rows)} modules, {total / 1000:.1f} ms of import time; most self time:")
    shown = sorted(rows, reverse=True)[:SLOWEST_SHOWN]
    for own, cumulative, name in shown:
        print(f"  {own / 1000:>7.1f} ms self {cumulative / 1000:>7.1f} ms cumulative  {name}")
    return [{"module": n, "self_ms": o / 1000, "cumulative_ms": c / 1000} for o, c, n in shown]


if __name__ == "__main__":
    sys.exit(main())
