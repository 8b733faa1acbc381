"""Direct mode's way back: what a confined child leaves in host-trusted places, judged on the host.

Each test makes the attack a hostile child would make inside `egressbox run` (rename the
directory above a read-only bind, make a `.git/commondir` or a nested repository with a hook,
swap the policy's or the audit log's directory, rewrite `.git/config`), then looks at the host:
the host's own `git status` (does it run the child's command? a marker file says), the inode
and contents of the protected files, the run's exit code and what it said. A baseline run of the
same attack without egressbox proves it is real. Every test runs as the invoking user (root
here) and as an unprivileged user (tests/unprivileged.py). Nothing touches the network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unprivileged import BASE_DIR, Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(900),
]

RUN_TIMEOUT = 120.0
EXIT_TAMPERED = 125  # src/egressbox/core/exitcodes.py


@dataclass
class Box:
    """One actor's workspace (a git repository), a directory outside every root, and the
    state directory where egressbox moves things aside."""

    actor: Actor
    workspace: Path
    outside: Path

    @property
    def state(self) -> Path:
        return self.outside / "state"

    @property
    def marker(self) -> Path:
        return self.outside / "fsmonitor-ran"

    def run(self, argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        env = self.actor.base_env(self.outside) | {
            "XDG_STATE_HOME": str(self.state),
            "EGRESSBOX_STATE_DIR": str(self.state / "egressbox"),
        }
        for name in ("EGRESSBOX_PURE", "PYTHONPATH"):  # the sources this test imports
            if name in os.environ and not self.actor.runuser:
                env[name] = os.environ[name]
        command, env = self.actor.command(argv, env)
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd or self.workspace,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def egressbox(self, script: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`egressbox run --workspace direct --write-root WORKSPACE ARGS -- sh -c SCRIPT`."""
        argv = [*self.actor.egressbox, "run", "--quiet", "--workspace", "direct"]
        argv += ["--write-root", str(self.workspace)]
        return self.run([*argv, *args, "--", "sh", "-c", textwrap.dedent(script)])

    def git(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """The host's git, as the actor, the way a shell prompt runs it."""
        return self.run(["git", *args], cwd=cwd)

    def own_tree(self, path: Path) -> None:
        for directory, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                os.lchown(os.path.join(directory, name), self.actor.uid, self.actor.gid)
        os.lchown(path, self.actor.uid, self.actor.gid)


@pytest.fixture
def box(actor: Actor) -> Iterator[Box]:
    workspace = actor.make_dir("/tmp", "egressbox-direct-ws-")
    BASE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    outside = actor.make_dir(BASE_DIR, "direct-outside-")
    made = Box(actor, workspace, outside)
    subprocess.run(["git", "init", "-q", str(workspace)], check=True, timeout=60)
    (workspace / "README").write_text("hello\n", encoding="utf-8")
    made.own_tree(workspace)
    try:
        yield made
    finally:
        for path in (workspace, outside):
            shutil.rmtree(path, ignore_errors=True)


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-3000:]}"


def _fsmonitor_config(box: Box) -> str:
    return f"[core]\n\tfsmonitor = touch {box.marker}; false\n"


def _held(box: Box) -> list[Path]:
    return sorted(
        p
        for p in box.state.rglob("*")
        if p.name != "MANIFEST" and p.parent.parent == box.state / "egressbox" / "held"
    )


# -- the directory above a read-only bind ----------------------------------------------------


def test_renaming_the_git_directory_is_refused_and_the_host_git_is_intact(box: Box) -> None:
    git = box.workspace / ".git"
    before = os.stat(git).st_ino, (git / "config").read_bytes()
    done = box.egressbox(
        f"""
        mv .git .git.old && echo renamed
        rmdir .git 2>/dev/null && echo removed
        mkdir -p .git 2>/dev/null
        printf '{_fsmonitor_config(box)}' > .git/config 2>/dev/null && echo wrote
        exit 0
        """
    )
    assert done.returncode == 0, _explain(done)
    assert "renamed" not in done.stdout and "removed" not in done.stdout, _explain(done)
    assert "Device or resource busy" in done.stderr, _explain(done)
    assert (os.stat(git).st_ino, (git / "config").read_bytes()) == before
    assert not (box.workspace / ".git.old").exists()
    status = box.git("status", "--short")
    assert status.returncode == 0, _explain(status)
    assert not box.marker.exists()


# -- files git reads that no list names --------------------------------------------------------


COMMONDIR_ATTACK = """
    mkdir -p evil/refs evil/objects
    printf 'ref: refs/heads/main\\n' > evil/HEAD
    printf '{config}' > evil/config
    echo "$PWD/evil" > .git/commondir
"""


def test_the_commondir_attack_is_real_without_egressbox(box: Box) -> None:
    script = COMMONDIR_ATTACK.format(config=_fsmonitor_config(box))
    done = box.run(["sh", "-c", textwrap.dedent(script)])
    assert done.returncode == 0, _explain(done)
    box.git("status")
    assert box.marker.exists(), "the baseline attack did not run its command"


def test_a_new_commondir_is_moved_aside_and_git_status_runs_nothing(box: Box) -> None:
    script = COMMONDIR_ATTACK.format(config=_fsmonitor_config(box))
    done = box.egressbox(script)
    assert done.returncode == EXIT_TAMPERED, _explain(done)
    commondir = box.workspace / ".git" / "commondir"
    assert f"the command made {commondir}" in done.stderr, _explain(done)
    assert "moved aside to" in done.stderr and "exit code was 0" in done.stderr, _explain(done)
    assert not commondir.exists()
    assert any(p.name.endswith("-commondir") for p in _held(box)), _explain(done)
    status = box.git("status", "--short")
    assert status.returncode == 0, _explain(status)
    assert not box.marker.exists(), "the host's git status ran the child's command"


def test_a_nested_repository_with_a_hook_is_moved_aside(box: Box) -> None:
    done = box.egressbox(
        f"""
        git init -q sub
        printf '#!/bin/sh\\ntouch {box.marker}\\n' > sub/.git/hooks/post-checkout
        chmod +x sub/.git/hooks/post-checkout
        printf '{_fsmonitor_config(box)}' >> sub/.git/config
        echo kept > sub/ordinary.txt
        """
    )
    assert done.returncode == EXIT_TAMPERED, _explain(done)
    nested = box.workspace / "sub" / ".git"
    assert f"the command made {nested}" in done.stderr, _explain(done)
    assert not nested.exists()
    assert (box.workspace / "sub" / "ordinary.txt").read_text(encoding="utf-8") == "kept\n"
    held = [p for p in _held(box) if p.name.endswith("-.git")]
    assert held and (held[0] / "hooks" / "post-checkout").exists(), _explain(done)
    box.git("status", cwd=box.workspace / "sub")
    assert not box.marker.exists()


def test_an_untouched_repository_and_ordinary_work_exit_with_the_command_code(box: Box) -> None:
    done = box.egressbox("echo work > file.txt; git add file.txt; exit 7")
    assert done.returncode == 7, _explain(done)
    assert "host trusts" not in done.stderr, _explain(done)
    assert (box.workspace / "file.txt").exists()


# -- egressbox's own files ------------------------------------------------------------------


def test_the_policy_directory_cannot_be_swapped(box: Box) -> None:
    conf = box.workspace / "conf"
    conf.mkdir()
    policy = conf / "policy.toml"
    policy.write_text('[egress]\nallow = ["example.test:443"]\n', encoding="utf-8")
    box.own_tree(conf)
    before = os.stat(conf).st_ino, policy.read_bytes()
    attack = """
        mv conf conf.old && echo renamed
        mkdir -p conf2 && printf '[egress]\\nallow = ["attacker.test:443"]\\n' > conf2/policy.toml
        mv -T conf2 conf 2>/dev/null && echo replaced
        exit 0
    """
    done = box.egressbox(attack, "--policy", str(policy))
    assert done.returncode == 0, _explain(done)
    assert "renamed" not in done.stdout and "replaced" not in done.stdout, _explain(done)
    assert (os.stat(conf).st_ino, policy.read_bytes()) == before
    again = box.egressbox("cat conf/policy.toml", "--policy", str(policy))
    assert again.returncode == 0, _explain(again)
    assert "attacker.test" not in again.stdout, _explain(again)


def test_the_audit_log_directory_cannot_be_swapped(box: Box) -> None:
    logs = box.workspace / "logs"
    logs.mkdir()
    box.own_tree(logs)
    audit = logs / "audit.jsonl"
    attack = """
        mv logs logs.old && echo renamed
        rmdir logs 2>/dev/null && echo removed
        echo '{"forged": true}' >> logs/audit.jsonl 2>/dev/null && echo forged
        exit 0
    """
    inode = os.stat(logs).st_ino
    done = box.egressbox(attack, "--audit-log", str(audit))
    assert done.returncode == 0, _explain(done)
    assert "renamed" not in done.stdout and "forged" not in done.stdout, _explain(done)
    assert os.stat(logs).st_ino == inode
    assert not (box.workspace / "logs.old").exists()
    assert "forged" not in (audit.read_text(encoding="utf-8") if audit.exists() else "")


# -- without a mount namespace: changes put back after the run -------------------------------


def test_a_rewritten_git_config_is_put_back(box: Box) -> None:
    config = box.workspace / ".git" / "config"
    before = config.read_bytes()
    # The unrestricted profile has no filesystem rules: the child can write anything.
    done = box.egressbox(
        f"printf '{_fsmonitor_config(box)}' >> .git/config", "--profile", "unrestricted"
    )
    assert done.returncode == EXIT_TAMPERED, _explain(done)
    assert f"the command changed {config}" in done.stderr, _explain(done)
    assert config.read_bytes() == before
    box.git("status")
    assert not box.marker.exists()


def test_a_swapped_git_directory_is_put_back(box: Box) -> None:
    git = box.workspace / ".git"
    inode = os.stat(git).st_ino
    done = box.egressbox(
        f"""
        mv .git .git.old && cp -a .git.old .git
        printf '{_fsmonitor_config(box)}' >> .git/config
        """,
        "--profile",
        "unrestricted",
    )
    assert done.returncode == EXIT_TAMPERED, _explain(done)
    assert f"the command replaced {git}" in done.stderr, _explain(done)
    assert os.stat(git).st_ino == inode
    assert not (box.workspace / ".git.old").exists()
    box.git("status")
    assert not box.marker.exists()
