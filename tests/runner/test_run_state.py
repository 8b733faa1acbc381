"""What a confined child leaves behind cannot steer the host: egressbox's state (the probe
cache) and the files the host writes during and after a run (the audit log, --save-approved's
policy). Each attack is made by a real confined child, as the invoking user and as an
unprivileged one, and judged on the host afterwards: the state directory's bytes, the next
run's --report, the directory a planted link points to."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from egressbox.runner.own_state import STATE_ENV
from unprivileged import BASE_DIR, Actor

RUN_TIMEOUT = 120
MUST_APPLY = ("pid_namespace", "landlock_fs")


@dataclass
class Box:
    """A HOME that is the writable workspace, a state directory outside every root, and a
    directory outside every root that the child's links point to."""

    actor: Actor
    home: Path
    state: Path
    outside: Path

    def run(self, *args: str, state: Path | None = None) -> subprocess.CompletedProcess[str]:
        place = str(state or self.state)
        # XDG_STATE_HOME: the staged workspace's layers (runner/layers.py) live there.
        env = self.actor.base_env(self.home) | {STATE_ENV: place, "XDG_STATE_HOME": place}
        if os.environ.get("EGRESSBOX_PURE") == "1" and not self.actor.runuser:
            env["EGRESSBOX_PURE"] = "1"  # the sources under test, not a compiled core
        argv = [*self.actor.egressbox, "run", "--write-root", str(self.home), *args]
        command, env = self.actor.command(argv, env)
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            cwd=self.home,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def shell(
        self, script: str, *options: str, args: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        """`run OPTIONS -- sh -c SCRIPT sh ARGS` (ARGS are $1, $2...)."""
        return self.run(*options, "--", "/bin/sh", "-c", textwrap.dedent(script), "sh", *args)


@pytest.fixture
def box(actor: Actor) -> Iterator[Box]:
    BASE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    made = [
        actor.make_dir("/tmp", "egressbox-state-home-"),
        actor.make_dir(BASE_DIR, "state-test-", 0o700),
        actor.make_dir(BASE_DIR, "chosen-by-the-child-"),
    ]
    try:
        yield Box(actor, *made)
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-3000:]}"


def _applied(done: subprocess.CompletedProcess[str]) -> set[str]:
    return {
        line.split("enforcement: ", 1)[1].split(":", 1)[0]
        for line in done.stderr.splitlines()
        if "enforcement: " in line and ": full (" in line
    }


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _forged(entry: bytes) -> bytes:
    """A probe entry under its true key that says nothing is available."""
    data = json.loads(entry)
    data["available"] = []
    data["status"] = dict.fromkeys(data["status"], "cannot_attach")
    data["abi"] = 0
    return json.dumps(data).encode()


# The child tries every place a probe cache was, or is, kept: the state directory itself (if
# it could see it), and the old places under the home directory, whose parents it may rename.
FORGE = """
    set -u
    state="$1"; forged="$HOME/forged"
    for d in "$state" "$HOME/.cache/egressbox" "$HOME/.local/state/egressbox"; do
        mv "$(dirname "$d")" "$(dirname "$d").moved" 2>/dev/null
        mkdir -p "$d" 2>/dev/null && cp "$forged"/* "$d"/ 2>/dev/null
        for f in "$forged"/*; do cp "$f" "$d/v2-$(basename "$f")" 2>/dev/null; done
    done
    exit 0
"""


def test_a_child_cannot_rewrite_the_probe_cache(box: Box) -> None:
    first = box.run("--report", "--", "/bin/true")
    assert first.returncode == 0, _explain(first)
    applied = _applied(first)
    wanted = {m for m in MUST_APPLY if m in applied}
    if not wanted:
        pytest.skip(f"neither {MUST_APPLY} applies here: {_explain(first)}")
    before = _contents(box.state)
    probes = {n: c for n, c in before.items() if "-probe-" in n}
    assert probes, before.keys()
    forged = box.home / "forged"
    forged.mkdir()
    for name, entry in probes.items():
        (forged / name).write_bytes(_forged(entry))
    box.actor.own(forged, 0o755)
    for name in probes:
        box.actor.own(forged / name, 0o644)
    attack = box.shell(FORGE, args=(str(box.state),))
    assert attack.returncode == 0, _explain(attack)
    # On the host: the state directory holds what it held, and the next run applies as much.
    assert _contents(box.state) == before
    after = box.run("--report", "--", "/bin/true")
    assert after.returncode == 0, _explain(after)
    assert wanted <= _applied(after), _explain(after)


def test_a_forged_entry_in_the_state_itself_takes_nothing_away(box: Box) -> None:
    # What a child without filesystem confinement could do (it has the invoker's files):
    # the cache may add a mechanism, never remove one without probing again.
    first = box.run("--report", "--", "/bin/true")
    assert first.returncode == 0, _explain(first)
    wanted = {m for m in MUST_APPLY if m in _applied(first)}
    if not wanted:
        pytest.skip(f"neither {MUST_APPLY} applies here: {_explain(first)}")
    for path in box.state.glob("*-probe-*.json"):
        path.write_bytes(_forged(path.read_bytes()))
    after = box.run("--report", "--", "/bin/true")
    assert after.returncode == 0, _explain(after)
    assert wanted <= _applied(after), _explain(after)


def test_a_writable_root_holding_the_state_is_refused(box: Box) -> None:
    inside = box.home / "egressbox-state"
    done = box.run("--", "/bin/touch", str(box.home / "ran"), state=inside)
    assert done.returncode == 120, _explain(done)  # EXIT_UNSAFE_GRANT
    assert "contains egressbox's state directory" in done.stderr, _explain(done)
    assert STATE_ENV in done.stderr
    assert not (box.home / "ran").exists()


def _real_dir(*candidates: Path) -> Path | None:
    """The one of `candidates` that is a directory and not a link (where the file went)."""
    found = [p for p in candidates if p.is_dir() and not p.is_symlink()]
    return found[0] if found else None


# The directory may be a mount point the child cannot move (direct mode binds the directories
# holding host-trusted files onto themselves): then the first wall held, and the held
# directory is the second; either way the file must stay out of the link's target.
SWAP = """
    set -u
    cd "$HOME"
    if mv "$1" "$1.moved"; then ln -s "$2" "$1" && echo swapped; fi
    {after}
    exit 0
"""
# Through the proxy (the variables point at it; capture takes it otherwise): one deny record.
REQUEST = "curl -q -sS --max-time 10 http://blocked.example/ >/dev/null 2>&1; true"


def _refused_for_its_place(done: subprocess.CompletedProcess[str], flag: str) -> bool:
    """A run that refuses the file inside a writable root is the other acceptable answer."""
    return done.returncode != 0 and flag in done.stderr and "ran" not in done.stdout


# "lifted": --writable-trusted takes the log off the protected list and --workspace direct
# makes the child's writes live, so the child really moves the log's directory during the
# run: the held directory alone keeps the records where they were. By default the directory
# cannot be moved (a mount point) or the move is staged and held back by the gate.
@pytest.mark.parametrize("protection", ["default", "lifted"])
def test_a_link_swapped_in_on_the_audit_logs_directory_leads_nowhere(
    box: Box, protection: str
) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    logs = box.home / "logs"
    logs.mkdir()
    box.actor.own(logs, 0o755)
    log = str(logs / "audit.jsonl")
    lift = ("--writable-trusted", log, "--workspace", "direct") if protection == "lifted" else ()
    script = SWAP.format(after=f"{REQUEST}; echo ran")
    done = box.shell(script, "--audit-log", log, *lift, args=("logs", str(box.outside)))
    assert list(box.outside.iterdir()) == [], _explain(done)
    if _refused_for_its_place(done, "--audit-log"):
        return
    assert done.returncode == 0, _explain(done)
    if protection == "lifted":
        assert "swapped" in done.stdout, _explain(done)
    where = _real_dir(logs, box.home / "logs.moved")
    assert where is not None, _explain(done)
    records = [json.loads(line) for line in (where / "audit.jsonl").read_text().splitlines()]
    assert ("blocked.example", "deny") in {(r["host"], r["decision"]) for r in records}


@pytest.mark.parametrize("workspace", ["staged", "direct"])
def test_a_link_swapped_in_on_save_approveds_directory_leads_nowhere(
    box: Box, workspace: str
) -> None:
    out = box.home / "out"
    out.mkdir()
    box.actor.own(out, 0o755)
    target = out / "approved.toml"
    done = box.shell(
        SWAP.format(after="echo ran"),
        "--workspace",
        workspace,
        "--ask-command",
        "/bin/true",
        "--save-approved",
        str(target),
        args=("out", str(box.outside)),
    )
    assert list(box.outside.iterdir()) == [], _explain(done)
    if _refused_for_its_place(done, "--save-approved"):
        return
    assert done.returncode == 0, _explain(done)
    where = _real_dir(out, box.home / "out.moved")
    assert where is not None, _explain(done)
    if (where / "approved.toml").exists():  # written where its directory was at start
        assert "[egress]" in (where / "approved.toml").read_text(), _explain(done)
    else:  # that directory is gone (a staged move applied at exit): said, nothing written
        assert "was removed after egressbox opened it" in done.stderr, _explain(done)


def test_a_path_through_a_link_inside_a_writable_root_is_refused(box: Box) -> None:
    # A link the command could point elsewhere before the next run: refused before any
    # child runs, naming the real path to use instead.
    logs = box.home / "logs"
    logs.mkdir()
    box.actor.own(logs, 0o755)
    (box.home / "logs-link").symlink_to(logs)
    done = box.run(
        "--audit-log", str(box.home / "logs-link" / "audit.jsonl"), "--", "/bin/touch", "ran"
    )
    assert done.returncode == 120, _explain(done)  # EXIT_UNSAFE_GRANT
    assert "leads through the symbolic link" in done.stderr, _explain(done)
    assert str(logs / "audit.jsonl") in done.stderr
    assert not (box.home / "ran").exists()
