"""A developer's home and projects for the confined-workflow tests (tests/runner/), shared by
the workflow and staged-workspace tests: the actor's home outside /tmp, a project base
under /tmp, both removed after the test; commands run as the actor with a bounded wait."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unprivileged import BASE_DIR, Actor

RUN_TIMEOUT = 300.0
IDENTITY = ("-c", "user.email=t@example.invalid", "-c", "user.name=t")
GO = shutil.which("go")
NPM = shutil.which("npm")
GIT = shutil.which("git")
MAKE = shutil.which("make")
CARGO = shutil.which("cargo")
# The command's own error output, in a locale that is not English (for the locale test).
FOREIGN = "de_DE.UTF-8"


@dataclass
class Dev:
    """One actor's home and a directory for its projects (both its own, under /tmp)."""

    actor: Actor
    home: Path
    base: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = self.actor.base_env(self.home)
        # The compiled core may be older than the sources under test; children test what the
        # test process tests.
        if os.environ.get("EGRESSBOX_PURE"):
            env["EGRESSBOX_PURE"] = os.environ["EGRESSBOX_PURE"]
        return env | extra

    def run(
        self, argv: list[str], cwd: Path, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        command, environment = self.actor.command(argv, env or self.env())
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=environment,
            cwd=cwd,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def egressbox(
        self, cwd: Path, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`egressbox run ARGS` from `cwd` (no --write-root: the project root is the default)."""
        return self.run([*self.actor.egressbox, "run", *args], cwd, env)

    def project(self, name: str, marker: str = ".git") -> Path:
        """A project directory: a git repository, one with an egressbox.toml, or a plain one
        ("": the working directory is then the workspace)."""
        root = self.base / name
        root.mkdir()
        self.actor.own(root, 0o755)
        if marker == ".git":
            self.git(root, "init", "-q", "-b", "main")
        elif marker:
            (root / marker).write_text("[egress]\nallow = []\n", encoding="utf-8")
        self.own_tree(root)
        return root

    def git(self, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
        assert GIT is not None
        done = self.run([GIT, *IDENTITY, *args], cwd)
        assert done.returncode == 0, _explain(done)
        return done

    def own_tree(self, root: Path) -> None:
        for path in (root, *root.rglob("*")):
            if not path.is_symlink():
                os.chown(path, self.actor.uid, self.actor.gid)


@pytest.fixture
def dev(actor: Actor) -> Iterator[Dev]:
    # The home directory outside /tmp, as a real one is: the child's /tmp is private, so a
    # cache pointed there would vanish with the run rather than be refused.
    BASE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    home = actor.make_dir(BASE_DIR, "dev-home-")
    base = actor.make_dir("/tmp", "egressbox-dev-work-")
    try:
        yield Dev(actor, home, base)
    finally:
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-4000:]}"


def _needs(tool: str | None, name: str) -> None:
    if tool is None:
        pytest.skip(f"{name} is not installed")
