"""Every example in README.md and docs/ runs as pasted.

A ```sh, ```console or ```python block is run unless the line before it is an
`<!-- illustrative: REASON -->` comment (a block that needs the internet, installs something or
names the reader's own files). The blocks of one page run in order, in one working directory
that holds a copy of `policies/`, with the virtual environment's `egressbox` first on the PATH
and egressbox's state isolated; everything they reach is on loopback. An `sh` block must exit 0;
a `console` block's `$ ` commands are run one by one and the lines shown under each must appear
in its output (stdout and stderr), in order, `...` matching anything; a `python` block must exit
0 (its asserts say what it expects). Processes a block leaves in the background are stopped when
the page is done."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unprivileged import BASE_DIR

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = ("sh", "console", "python")
ILLUSTRATIVE = re.compile(r"<!-- illustrative: (\S.*) -->")
# Ports the README's tour uses on loopback (a web server and `serve`).
TOUR_PORTS = (8765, 3128)
# One block or command: generous for an interpreted `egressbox run` on a loaded 2-core host.
BLOCK_TIMEOUT = 120.0


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    text: str
    illustrative: str | None  # the reason, when it is not run


def blocks(page: Path) -> list[Block]:
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        fence = re.match(r"^```([a-z]*)\s*$", lines[index])
        if not fence or not fence.group(1):
            index += 1
            continue
        end = lines.index("```", index + 1)
        previous = lines[index - 1] if index else ""
        marker = ILLUSTRATIVE.fullmatch(previous.strip())
        if fence.group(1) in RUNNABLE:
            body = "\n".join(lines[index + 1 : end]) + "\n"
            reason = marker.group(1) if marker else None
            found.append(Block(page.name, index + 1, fence.group(1), body, reason))
        index = end + 1
    return found


def test_every_illustrative_marker_gives_a_reason_and_precedes_a_block() -> None:
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            if "<!-- illustrative" in line:
                assert ILLUSTRATIVE.fullmatch(line.strip()), f"{page.name}:{number + 1}: no reason"
                assert lines[number + 1].startswith("```"), f"{page.name}:{number + 1}"


def test_the_readme_has_runnable_examples() -> None:
    runnable = [b for b in blocks(ROOT / "README.md") if b.illustrative is None]
    assert {b.language for b in runnable} >= {"sh", "console"}
    assert [b for b in blocks(ROOT / "docs" / "library.md") if b.language == "python"]


class Session:
    """One page's working directory, environment and background processes."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        venv_bin = Path(sys.executable).parent
        self.env = dict(os.environ)
        self.env["PATH"] = f"{venv_bin}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["EGRESSBOX_STATE_DIR"] = str(workdir.parent / "state")
        self.env.pop("COLUMNS", None)
        self.groups: list[int] = []

    def shell(self, script: str, *, strict: bool) -> subprocess.CompletedProcess[str]:
        options = ["-euo", "pipefail"] if strict else []
        process = subprocess.Popen(
            ["bash", *options, "-c", script],
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its background jobs stay in a group we can stop
        )
        self.groups.append(process.pid)
        try:
            output, _ = process.communicate(timeout=BLOCK_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"timed out after {BLOCK_TIMEOUT} s: {script}\n{output}")
        return subprocess.CompletedProcess(script, process.returncode, output, "")

    def python(self, source: str) -> subprocess.CompletedProcess[str]:
        path = self.workdir / "example.py"
        path.write_text(source, encoding="utf-8")
        return subprocess.run(
            [sys.executable, str(path)],
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
            check=False,
        )

    def close(self) -> None:
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGTERM)


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line.rstrip())
        else:
            raise AssertionError(f"console block starts with output: {line!r}")
    return steps


def shown_lines_appear(shown: list[str], output: str) -> bool:
    """Every shown line matches a line of the output, in order (`...` matches anything)."""
    actual = iter(line.rstrip() for line in output.splitlines())
    for expected in (line for line in shown if line):
        pattern = re.compile(".*".join(re.escape(part) for part in expected.split("...")))
        if not any(pattern.fullmatch(line) for line in actual):
            return False
    return True


def run_block(session: Session, block: Block) -> None:
    where = f"{block.page}:{block.line}"
    if block.language == "sh":
        done = session.shell(block.text, strict=True)
        assert done.returncode == 0, f"{where} exited {done.returncode}:\n{done.stdout}"
    elif block.language == "console":
        for command, shown in console_steps(block.text):
            done = session.shell(command, strict=False)
            assert shown_lines_appear(shown, done.stdout), (
                f"{where}: `{command}` printed\n{done.stdout}\nwhere the page shows\n"
                + "\n".join(shown)
            )
    else:
        done = session.python(block.text)
        assert done.returncode == 0, f"{where} exited {done.returncode}:\n{done.stderr}"


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    # Outside /tmp, as a real project is: the confined child's /tmp is a private one.
    try:
        BASE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        base = Path(os.fspath(BASE_DIR))
        work = base / f"docs-{os.getpid()}-{tmp_path.name}"
        work.mkdir()
    except PermissionError:
        work = tmp_path / "work"
        work.mkdir()
    (work / "project").mkdir()
    shutil.copytree(ROOT / "policies", work / "project" / "policies")
    try:
        yield work / "project"
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _port_in_use(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_every_example_runs_as_pasted(page: Path, workdir: Path) -> None:
    runnable = [b for b in blocks(page) if b.illustrative is None]
    if not runnable:
        pytest.skip(f"{page.name}: every block is illustrative")
    busy = [p for p in TOUR_PORTS if _port_in_use(p)]
    if busy and any(str(p) in b.text for b in runnable for p in busy):
        pytest.skip(f"loopback port(s) {busy} in use by another program")
    session = Session(workdir)
    try:
        for block in runnable:
            run_block(session, block)
    finally:
        session.close()
