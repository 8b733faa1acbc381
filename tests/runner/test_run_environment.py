"""The confined command's environment under `egressbox run` (confine/env.py), for real.

Each case starts `egressbox run ... -- env` in a child process, as the invoking user and as
an unprivileged user, with a caller's environment holding credentials, and reads what the
command was given from its output: credentials held back by default and named (names only)
on one stderr line, `--grant` passing one on purpose, `--env-remove` dropping one, a
compiler wrapper held back, the JVM's options extended rather than replaced, and an
inherited TMPDIR inside the workspace kept. Every wait is bounded.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unprivileged import Actor, repo_root

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    # The first test as the unprivileged user may build its venv (pip install) once.
    pytest.mark.timeout(900),
]

RUN_TIMEOUT = 120.0
DENY_ALL = repo_root() / "policies" / "deny-all.toml"
# The caller's credentials (made-up values, each unique so that a leak is recognised).
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAABCDEFGHIJKLMNOP",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value-1",
    "AWS_SESSION_TOKEN": "aws-session-value-2",
    "GITHUB_TOKEN": "github-token-value-3",
    "GH_TOKEN": "gh-token-value-4",
    "OPENAI_API_KEY": "openai-key-value-5",
    "ANTHROPIC_API_KEY": "anthropic-key-value-6",
    "NPM_TOKEN": "npm-token-value-7",
    "NODE_AUTH_TOKEN": "node-auth-value-8",
    "TWINE_PASSWORD": "twine-password-value-9",
    "HF_TOKEN": "hf-token-value-10",
    "AZURE_CLIENT_SECRET": "azure-secret-value-11",
    "GOOGLE_APPLICATION_CREDENTIALS": "/nowhere/gcp-key-12.json",
    "DOCKER_AUTH_CONFIG": "docker-auth-value-13",
    "VAULT_TOKEN": "vault-token-value-14",
    "EGRESSBOX_ADMIN_TOKEN": "egressbox-admin-value-15",
    "SSH_AUTH_SOCK": "/nowhere/agent-16.sock",
    "PIP_INDEX_URL": "https://user:pip-password-17@pypi.example.invalid/simple",
    "MY_SETTING": "ghp_" + "a" * 36,  # a GitHub token, whatever the name
}
# Kept whatever the policy: they look like nothing secret.
HARMLESS = {
    "AWS_REGION": "eu-west-1",
    "TOKENIZERS_PARALLELISM": "false",
    "GIT_AUTHOR_NAME": "Someone",
    "UV_INDEX_URL": "https://pypi.example.invalid/simple",
    "KUBECONFIG": "/nowhere/kubeconfig",
}


@dataclass
class Box:
    actor: Actor
    workspace: Path
    home: Path

    def run(self, *args: str, env: dict[str, str]) -> tuple[dict[str, str], str]:
        """`egressbox run ARGS -- env`: the command's environment, and our stderr."""
        argv = [*self.actor.egressbox, "run", "--policy", str(DENY_ALL), *args, "--", "env"]
        base = self.actor.base_env(self.home) | env
        command, environment = self.actor.command(argv, base)
        done = subprocess.run(
            command,
            capture_output=True,
            env=environment,
            cwd=self.workspace,
            timeout=RUN_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        stderr = done.stderr.decode(errors="replace")
        assert done.returncode == 0, stderr
        lines = done.stdout.decode(errors="replace").splitlines()
        return dict(line.partition("=")[::2] for line in lines if "=" in line), stderr


@pytest.fixture
def box(actor: Actor) -> Iterator[Box]:
    workspace = actor.make_dir("/tmp", "egressbox-env-ws-")
    home = actor.make_dir("/tmp", "egressbox-env-home-")
    try:
        yield Box(actor, workspace, home)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def _held_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "held back from the command's" in line]
    assert len(lines) == 1, stderr
    return lines[0]


def test_credentials_are_held_back_and_named_once(box: Box) -> None:
    tmpdir = box.workspace / "mytmp"
    tmpdir.mkdir()
    box.actor.own(tmpdir)
    caller = CREDENTIALS | HARMLESS | {"RUSTC_WRAPPER": "sccache", "TMPDIR": str(tmpdir)}
    caller |= {"JAVA_TOOL_OPTIONS": "-Xmx1g", "MAVEN_OPTS": "-Xmx2g -Dhttps.proxyHost=corp"}
    env, stderr = box.run("--env-remove", "AWS_REGION", env=caller)
    line = _held_line(stderr)
    for name, value in CREDENTIALS.items():
        assert name not in env, name
        assert name in line, name
        assert value not in stderr and all(value not in v for v in env.values()), name
    assert "RUSTC_WRAPPER" not in env and "RUSTC_WRAPPER" in line
    for name, value in HARMLESS.items():
        if name != "AWS_REGION":
            assert env.get(name) == value, name
    assert "AWS_REGION" not in env, "--env-remove drops it"
    # The JVM's options: the caller's first, the proxy's after them (the last one wins).
    java = env["JAVA_TOOL_OPTIONS"].split()
    assert java[0] == "-Xmx1g" and "-Dhttp.proxyHost=127.0.0.1" in java, java
    port = next(w for w in java if w.startswith("-Dhttp.proxyPort="))
    assert port.partition("=")[2].isdigit(), java
    maven = env["MAVEN_OPTS"].split()  # (toolchains.py may add the repository's place)
    assert maven[0] == "-Xmx2g" and not any("proxyHost" in w for w in maven), maven
    assert env["TMPDIR"] == str(tmpdir), "inside the workspace: kept"


def test_grant_passes_one_on_purpose(box: Box) -> None:
    caller = CREDENTIALS | {"RUSTC_WRAPPER": "sccache", "TMPDIR": "/var/tmp"}
    env, stderr = box.run("--grant", "GITHUB_TOKEN", "--grant", "RUSTC_WRAPPER", env=caller)
    assert env["GITHUB_TOKEN"] == CREDENTIALS["GITHUB_TOKEN"]
    assert env["RUSTC_WRAPPER"] == "sccache"
    line = _held_line(stderr)
    assert "GITHUB_TOKEN" not in line and "RUSTC_WRAPPER" not in line
    assert "OPENAI_API_KEY" not in env and "OPENAI_API_KEY" in line
    # A TMPDIR outside every write root is replaced by the scratch space in the workspace.
    assert env["TMPDIR"].startswith(str(box.workspace)), env["TMPDIR"]


def test_nothing_held_back_says_nothing(box: Box) -> None:
    _, stderr = box.run(env=dict(HARMLESS))
    assert "held back" not in stderr, stderr
