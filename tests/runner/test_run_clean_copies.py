"""The tools' configuration files reach a confined child as clean copies, never whole.

A home directory holds the places users keep tokens (git's extraheader and remote URLs, pip's
index URL, uv's index, cargo's registry token, conda's channel token); a confined child reads
every one of them. The fake token must appear nowhere in what the child could print, while
the settings a build needs still work (`git config --get user.name`, the index host). Judged
from the host: the child's whole output, and the originals unchanged. As the invoking user
(root here) and as an unprivileged one. Nothing leaves loopback; every wait is bounded.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from egressbox.confine.grants import HostFacts
from egressbox.core.policy import parse_policy
from egressbox.runner.api import run_options_sync
from egressbox.runner.facts import host_facts
from egressbox.runner.options import RunOptions
from unprivileged import BASE_DIR, Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(900),
]

RUN_TIMEOUT = 120.0
TOKEN = "cleanTOKEN7a9f3e"  # a fake credential: the tests look for it in the child's output

FILES = {
    ".gitconfig": (
        "[user]\n\tname = Alice Example\n"
        f"[http]\n\textraheader = AUTHORIZATION: bearer {TOKEN}\n"
        f'[url "https://alice:{TOKEN}@git.example.com/"]\n\tinsteadOf = https://git.example.com/\n'
        "[include]\n\tpath = ~/.gitconfig.local\n"
    ),
    ".gitconfig.local": f"[core]\n\teditor = nano\n[github]\n\ttoken = {TOKEN}\n",
    ".config/git/config": f'[remote "origin"]\n\turl = https://x:{TOKEN}@github.com/a/b\n',
    ".config/git/unknown-tool.json": f'{{"key": "{TOKEN}"}}\n',
    ".config/pip/pip.conf": (
        f"[global]\nindex-url = https://user:{TOKEN}@pypi.example.com/simple\ntimeout = 60\n"
    ),
    ".config/uv/uv.toml": (
        f'[[index]]\nname = "corp"\nurl = "https://me:{TOKEN}@uv.example.com/simple"\n'
    ),
    ".cargo/config.toml": (
        f'[registries.corp]\nindex = "sparse+https://r.example.com/"\ntoken = "{TOKEN}"\n'
        "[net]\nretry = 3\n"
    ),
    ".condarc": f"channels:\n  - https://conda.anaconda.org/t/{TOKEN}/private\n  - conda-forge\n",
}
# What the child must still see (the settings without the credentials).
KEPT = (
    "name = Alice Example",
    "editor = nano",
    "url = https://github.com/a/b",
    "index-url = https://pypi.example.com/simple",
    'url = "https://uv.example.com/simple"',
    'index = "sparse+https://r.example.com/"',
    "  - https://conda.anaconda.org/private",
)


@dataclass
class Home:
    actor: Actor
    home: Path
    workspace: Path

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = self.actor.base_env(self.home)
        argv = [*self.actor.egressbox, "run", "--quiet", "--write-root", str(self.workspace)]
        command, env = self.actor.command([*argv, *args], env)
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=env,
            cwd=self.workspace,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def digests(self) -> dict[str, str]:
        return {name: hashlib.sha256((self.home / name).read_bytes()).hexdigest() for name in FILES}


@pytest.fixture
def home(actor: Actor) -> Iterator[Home]:
    BASE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    top = actor.make_dir(BASE_DIR, "clean-home-", 0o700)
    workspace = top / "work"
    workspace.mkdir()
    actor.own(workspace, 0o755)
    for name, text in FILES.items():
        path = top / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        actor.own(path, 0o600)
        for parent in path.relative_to(top).parents:
            actor.own(top / parent)
    try:
        yield Home(actor, top, workspace)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"


def _cat_all(home: Home) -> str:
    paths = " ".join(str(home.home / name) for name in FILES)
    return f"cat {paths}; git config --get user.name; git config --get core.editor; true"


def test_no_granted_file_carries_a_credential(home: Home) -> None:
    before = home.digests()
    done = home.run("--", "sh", "-c", _cat_all(home))
    assert done.returncode == 0, _explain(done)
    assert TOKEN not in done.stdout + done.stderr, _explain(done)
    for kept in KEPT:
        assert kept in done.stdout, _explain(done)
    assert "Alice Example\nnano\n" in done.stdout, _explain(done)  # git reads its config
    assert "unknown-tool.json: not granted" in done.stderr, _explain(done)
    assert home.digests() == before  # the host's originals are untouched


def test_grant_file_passes_one_original_and_says_so(home: Home) -> None:
    pip = home.home / ".config/pip/pip.conf"
    done = home.run("--grant-file", str(pip), "--", "sh", "-c", _cat_all(home))
    assert done.returncode == 0, _explain(done)
    assert f"index-url = https://user:{TOKEN}@pypi.example.com/simple" in done.stdout
    assert done.stdout.count(TOKEN) == 1, _explain(done)  # that file only
    assert f"--grant-file {pip}: the original is in the command's view" in done.stderr


def test_grant_file_refuses_what_is_not_a_file(home: Home) -> None:
    done = home.run("--grant-file", str(home.home / ".config"), "--", "true")
    assert done.returncode != 0
    assert "not a file" in done.stderr, _explain(done)


NO_NAMESPACES = {
    "network_namespace": "cannot_attach",
    "mount_namespace": "cannot_attach",
    "pid_namespace": "cannot_attach",
    "user_namespace": "cannot_attach",
}


def test_without_a_mount_namespace_the_originals_are_not_granted(tmp_path: Path) -> None:
    real = host_facts()
    if "landlock" not in real.available or real.landlock_abi < 1:
        pytest.skip("needs Landlock: " + str(dict(real.status)))
    facts = HostFacts(frozenset({"landlock", "seccomp", "no_new_privs"}), NO_NAMESPACES, 7, 0)
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    reader = "import sys\nfor p in sys.argv[1:]:\n    try:\n        print(open(p).read())\n"
    reader += "    except OSError as exc:\n        print(p, 'refused', exc.errno)\n"
    options = RunOptions(
        argv=(sys.executable, "-c", reader, *(str(tmp_path / n) for n in FILES)),
        policy=parse_policy({"egress": {"allow": []}}, env={}),
        write_roots=(str(work),),
        cwd=str(work),
        base_env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    result = run_options_sync(options, facts=facts, capture_output=True)
    out = (result.stdout or b"").decode()
    assert result.exit_code == 0, result.stderr
    assert TOKEN not in out
    assert out.count("refused") == len(FILES), out
    assert any("a clean copy needs a mount namespace" in w for w in result.warnings)
