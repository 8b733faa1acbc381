"""Run the fuzz targets one after another, each for a bounded time (`fuzz/run`).

usage: fuzz/run [--merge] [--rss-limit-mb N] [SECONDS_PER_TARGET] [TARGET...]

SECONDS_PER_TARGET defaults to 60; TARGET is a name such as `fuzz_socks5` (or `socks5`,
or a path), every `fuzz/fuzz_*.py` by default. Each target runs under libFuzzer
(atheris) with `-max_total_time`, an RSS limit and a per-input timeout, reading its
seeds from `fuzz/corpus/TARGET/` and writing the inputs it finds to a temporary
directory, never into the repository unless `--merge` (then only those that add
coverage are copied into the corpus, by `-merge=1`). Printed per target: executions,
seconds, and the coverage libFuzzer reports at the end (`cov:` edges and `ft:`
features). Any crash, timeout or out-of-memory fails the run (exit 1); its input is
kept under the temporary directory, whose path is printed with the way to replay it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
CORPUS_DIR = FUZZ_DIR / "corpus"
# Targets that share a dictionary; any other uses fuzz/NAME.dict for fuzz_NAME, if any.
DICTIONARIES = {
    "fuzz_http1_request": "http.dict",
    "fuzz_http1_response": "http.dict",
    "fuzz_chunked": "http.dict",
}
MAX_LEN = 4096  # bytes per input: room for pipelined requests and whole policy files
INPUT_TIMEOUT = 10  # seconds for one input: the parsers take milliseconds
# Startup (imports, instrumentation, reading the corpus) beyond -max_total_time,
# after which a target that has not exited is stopped and counted as failed.
GRACE_SECONDS = 120
FAILURE_ARTIFACTS = ("crash-", "timeout-", "oom-", "leak-")

_DONE = re.compile(r"^#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/", re.MULTILINE)
_EXECUTED = re.compile(r"^stat::number_of_executed_units:\s+(\d+)", re.MULTILINE)
_NEW_UNITS = re.compile(r"^stat::new_units_added:\s+(\d+)", re.MULTILINE)
_PROGRESS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+)", re.MULTILINE)


@dataclass
class Result:
    target: str
    seconds: float
    executions: int | None
    cov: int | None
    ft: int | None
    corpus: int | None
    new_units: int | None
    failures: list[Path]
    returncode: int
    log: Path

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.failures


def all_targets() -> list[str]:
    return sorted(path.stem for path in FUZZ_DIR.glob("fuzz_*.py"))


def resolve(name: str) -> str | None:
    stem = Path(name).stem
    for candidate in (stem, f"fuzz_{stem}"):
        if (FUZZ_DIR / f"{candidate}.py").is_file():
            return candidate
    return None


def dictionary(target: str) -> Path | None:
    path = FUZZ_DIR / DICTIONARIES.get(target, target.removeprefix("fuzz_") + ".dict")
    return path if path.is_file() else None


def run_target(target: str, seconds: int, rss_limit_mb: int, work: Path, merge: bool) -> Result:
    base = work / target
    found, artifacts, tmp = base / "corpus", base / "artifacts", base / "tmp"
    for directory in (found, artifacts, tmp):
        directory.mkdir(parents=True)
    seeds = CORPUS_DIR / target
    seeds.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        str(FUZZ_DIR / f"{target}.py"),
        f"-max_total_time={seconds}",
        f"-rss_limit_mb={rss_limit_mb}",
        f"-timeout={INPUT_TIMEOUT}",
        f"-max_len={MAX_LEN}",
        "-print_final_stats=1",
        f"-artifact_prefix={artifacts}/",
    ]
    words = dictionary(target)
    if words is not None:
        command.append(f"-dict={words}")
    command += [str(found), str(seeds)]  # new inputs go to the first directory
    env = {**os.environ, "EGRESSBOX_PURE": "1", "TMPDIR": str(tmp)}
    log = base / "log"
    started = time.monotonic()
    with log.open("wb") as out:
        try:
            returncode = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=seconds + GRACE_SECONDS,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            returncode = -1
            out.write(b"\nfuzz/run: stopped: the target did not finish in time\n")
    elapsed = time.monotonic() - started
    text = log.read_text(errors="replace")
    done = _DONE.findall(text)
    progress = _PROGRESS.findall(text)
    executed = _EXECUTED.findall(text)
    new_units = _NEW_UNITS.findall(text)
    failures = sorted(p for p in artifacts.iterdir() if p.name.startswith(FAILURE_ARTIFACTS))
    result = Result(
        target,
        elapsed,
        int(executed[-1]) if executed else (int(progress[-1][0]) if progress else None),
        int(done[-1][1]) if done else (int(progress[-1][1]) if progress else None),
        int(done[-1][2]) if done else (int(progress[-1][2]) if progress else None),
        int(done[-1][3]) if done else None,
        int(new_units[-1]) if new_units else None,
        failures,
        returncode,
        log,
    )
    if result.ok and merge:
        _merge(target, seeds, found, env)
    return result


def _merge(target: str, seeds: Path, found: Path, env: dict[str, str]) -> None:
    before = len(list(seeds.iterdir()))
    subprocess.run(
        [sys.executable, str(FUZZ_DIR / f"{target}.py"), "-merge=1", str(seeds), str(found)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        check=True,
    )
    added = len(list(seeds.iterdir())) - before
    print(f"  merged: {added} new input(s) into {seeds.relative_to(FUZZ_DIR.parent)}")


def _figure(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def report(result: Result) -> None:
    status = "ok" if result.ok else "FAILED"
    print(
        f"{result.target}: {status}: {_figure(result.executions)} executions in"
        f" {result.seconds:.0f} s, cov {_figure(result.cov)}, ft {_figure(result.ft)},"
        f" corpus {_figure(result.corpus)} ({_figure(result.new_units)} new)",
        flush=True,
    )
    if result.ok:
        return
    print(f"  log: {result.log}")
    for path in result.failures:
        print(f"  failing input: {path}")
        print(f"  replay: {sys.executable} fuzz/{result.target}.py {path}")
    if not result.failures:
        print(f"  exit status {result.returncode} without a failing input (see the log)")
    excerpt = _exception(result.log.read_text(errors="replace"))
    for line in excerpt:
        print(f"  | {line}")
    sys.stdout.flush()


def _exception(text: str) -> list[str]:
    """The Python exception that atheris printed, if any (at most 40 lines)."""
    start = text.find("=== Uncaught Python exception: ===")
    if start < 0:
        return []
    lines = text[start:].splitlines()[1:]
    end = next((i for i, line in enumerate(lines) if not line.strip() and i > 0), len(lines))
    return lines[:end][:40]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fuzz/run", description=__doc__.split("\n")[0])
    parser.add_argument("--merge", action="store_true", help="add new coverage to fuzz/corpus")
    parser.add_argument("--rss-limit-mb", type=int, default=2048)
    parser.add_argument("words", nargs="*", metavar="[SECONDS_PER_TARGET] [TARGET...]")
    args = parser.parse_args(argv)
    words: list[str] = list(args.words)
    seconds = 60
    if words and words[0].isdigit():
        seconds = int(words.pop(0))
    if seconds < 1:
        parser.error("SECONDS_PER_TARGET must be at least 1")
    targets = []
    for word in words:
        target = resolve(word)
        if target is None:
            parser.error(f"no target {word!r}; targets: {', '.join(all_targets())}")
        targets.append(target)
    targets = targets or all_targets()
    if importlib.util.find_spec("atheris") is None:
        print(
            f"fuzz/run: atheris is not installed for {sys.executable}:"
            " run scripts/setup, or .venv/bin/pip install atheris",
            file=sys.stderr,
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="egressbox-fuzz-"))
    print(f"fuzz/run: {len(targets)} target(s), {seconds} s each, work in {work}", flush=True)
    results = []
    for target in targets:
        result = run_target(target, seconds, args.rss_limit_mb, work, args.merge)
        report(result)
        results.append(result)
    failed = [r.target for r in results if not r.ok]
    if failed:
        print(f"fuzz/run: FAILED: {', '.join(failed)} (inputs and logs kept in {work})")
    else:
        shutil.rmtree(work)
    # The closing line in the plain form CI logs are read for: targets, not tests.
    print(f"fuzz: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
