"""`egressbox run` with a policy's [process], [filesystem] and [env] tables, and --timeout.

Each run is a subprocess (`python -m egressbox run ...`) as the invoking user, in its own
workspace; loopback only, every wait bounded.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressbox.confine.grants import CREDENTIALS, HostFacts, Profile, expand_user
from egressbox.core.policy import parse_policy
from egressbox.runner.assemble import prepare
from egressbox.runner.facts import host_facts
from egressbox.runner.options import KILL_GRACE, options_for

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(300),
]

RUN_TIMEOUT = 60.0
REPORT_LINE = re.compile(r"^egressbox: enforcement: (\w+): (full|partial|none) \((.*)\)$")


class Box:
    def __init__(self, root: Path) -> None:
        self.workspace = root / "ws"
        self.workspace.mkdir()
        self.policy = root / "policy.toml"

    def write_policy(self, text: str) -> str:
        self.policy.write_text(text)
        return str(self.policy)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}
        return env | extra

    def run(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = RUN_TIMEOUT
    ) -> subprocess.CompletedProcess[bytes]:
        argv = [sys.executable, "-m", "egressbox", "run", "--quiet", *args]
        return subprocess.run(
            argv,
            capture_output=True,
            env=env or self.env(),
            cwd=self.workspace,
            timeout=timeout,
            check=False,
        )


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    yield Box(tmp_path)


def _explain(done: subprocess.CompletedProcess[bytes]) -> str:
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    return f"exit {done.returncode}\nstdout: {out}\nstderr: {err}"


def _report(done: subprocess.CompletedProcess[bytes]) -> dict[str, str]:
    rows = {}
    for line in done.stderr.decode(errors="replace").splitlines():
        match = REPORT_LINE.match(line)
        if match:
            rows[match[1]] = match[2]
    return rows


def _has(*names: str) -> bool:
    return set(names) <= host_facts().available


def test_process_profile_shows_in_the_report(box: Box) -> None:
    policy = box.write_policy('[process]\nprofile = "unrestricted"\n')
    done = box.run(
        "--policy", policy, "--report", "--", "/bin/sh", "-c", 'echo "$EGRESSBOX_PROFILE"'
    )
    assert done.returncode == 0, _explain(done)
    assert done.stdout == b"unrestricted\n", _explain(done)
    rows = _report(done)
    # unrestricted wants only the network boundary: no filesystem confinement rows.
    assert "network_boundary" in rows and "landlock_fs" not in rows, _explain(done)
    assert "mount_namespace" not in rows, _explain(done)


def test_profile_flag_wins_over_the_table(box: Box) -> None:
    policy = box.write_policy('[process]\nprofile = "unrestricted"\n')
    argv = ["--policy", policy, "--profile", "workspace_paths", "--report"]
    done = box.run(*argv, "--", "/bin/sh", "-c", 'echo "$EGRESSBOX_PROFILE"')
    assert done.returncode == 0, _explain(done)
    assert done.stdout == b"worktree\n", _explain(done)
    assert "landlock_fs" in _report(done), _explain(done)


def test_filesystem_write_roots_apply_without_write_root(box: Box, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    policy = box.write_policy(f'[filesystem]\nwrite_roots = ["{out}"]\n')
    script = f"echo ok > {out}/made && echo made; echo no > ./cwd-file && echo cwd-written"
    # The current directory is no longer a root: it would not exist for the command.
    refused = box.run("--policy", policy, "--", "/bin/sh", "-c", script)
    assert refused.returncode == 122, _explain(refused)  # EXIT_CWD_UNAVAILABLE
    assert f"--read-root {box.workspace}".encode() in refused.stderr, _explain(refused)
    readable = ("--read-root", str(box.workspace))
    done = box.run("--policy", policy, *readable, "--", "/bin/sh", "-c", script)
    assert (out / "made").read_text() == "ok\n", _explain(done)
    assert b"made\n" in done.stdout, _explain(done)
    # The scratch space moved to the first writable root: the table's.
    assert (out / ".egressbox").is_dir()
    if _has("landlock"):
        # The current directory is no longer the default writable root.
        assert not (box.workspace / "cwd-file").exists(), _explain(done)
    # --write-root adds to the table: both are writable, the flag's first.
    flag_root = tmp_path / "flag"
    flag_root.mkdir()
    script = f"echo a > {out}/again && echo b > {flag_root}/flag"
    argv = ["--policy", policy, "--write-root", str(flag_root)]
    done = box.run(*argv, *readable, "--", "/bin/sh", "-c", script)
    assert done.returncode == 0, _explain(done)
    assert (out / "again").exists() and (flag_root / "flag").exists()
    assert (flag_root / ".egressbox").is_dir()


def test_env_isolated_drops_a_planted_variable(box: Box) -> None:
    policy = box.write_policy('[env]\npolicy = "isolated"\ngrant = ["GIVEN=yes"]\n')
    env = box.env(PLANTED_VALUE="s3cret")
    script = 'echo "${PLANTED_VALUE-unset} ${GIVEN-unset}"'
    done = box.run("--policy", policy, "--", "/bin/sh", "-c", script, env=env)
    assert done.returncode == 0, _explain(done)
    assert done.stdout == b"unset yes\n", _explain(done)
    # --env wins over the table; the table's grant still applies.
    done = box.run("--policy", policy, "--env", "inherited", "--", "/bin/sh", "-c", script, env=env)
    assert done.returncode == 0, _explain(done)
    assert done.stdout == b"s3cret yes\n", _explain(done)


def test_process_rlimit_nofile_is_visible_inside(box: Box) -> None:
    policy = box.write_policy("[process]\nrlimit_nofile = 64\n")
    done = box.run("--policy", policy, "--", "/bin/sh", "-c", "ulimit -n; ulimit -H -n")
    assert done.returncode == 0, _explain(done)
    assert done.stdout == b"64\n64\n", _explain(done)


def test_prepare_applies_presets_deny_and_rlimits(tmp_path: Path) -> None:
    policy = parse_policy(
        {
            "process": {"rlimit_nofile": 128, "rlimit_as": 1 << 30},
            "filesystem": {"presets": ["system_runtime"], "deny": ["~/.vault", "/srv/keys"]},
        },
        env={},
    )
    home = str(tmp_path / "home")
    options = options_for(
        ["/bin/true"],
        policy=policy,
        cwd=str(tmp_path),
        base_env={"HOME": home, "PATH": "/bin"},
        allow_direct_network=True,  # planning only: nothing runs
    )
    facts = HostFacts(frozenset(), {}, 0, os.geteuid())
    prepared = prepare(options, facts)
    for sock in prepared.host_listeners:
        sock.close()
    plan = prepared.plan
    assert plan.rlimit_nofile == 128 and plan.rlimit_as == 1 << 30
    assert f"{home}/.vault" in plan.deny and "/srv/keys" in plan.deny
    assert set(expand_user(p, home) for p in CREDENTIALS) <= set(plan.deny)
    assert "/usr" in plan.read and f"{home}/.cargo" not in plan.read
    assert "/tmp" not in plan.write  # no user_temp preset
    assert Profile(plan.env["EGRESSBOX_PROFILE"]) is Profile.WORKTREE


# -- --timeout -------------------------------------------------------------------------------


def _pids_with(marker: str) -> list[int]:
    done = subprocess.run(
        ["pgrep", "-f", marker], capture_output=True, text=True, timeout=30, check=False
    )
    return [int(pid) for pid in done.stdout.split()]


@contextlib.contextmanager
def _marker() -> Iterator[str]:
    if shutil.which("pgrep") is None:
        pytest.skip("pgrep is not installed")
    marker = f"egressbox-timeout-{uuid.uuid4().hex}"
    try:
        yield marker
    finally:
        for pid in _pids_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _sleeper(marker: str) -> list[str]:
    return [sys.executable, "-c", "import time, sys; time.sleep(30)", marker]


def _assert_timed_out(done: subprocess.CompletedProcess[bytes], seconds: str) -> None:
    assert done.returncode == 124, _explain(done)
    assert f"the timeout of {seconds} s expired".encode() in done.stderr, _explain(done)


def test_timeout_stops_the_command_with_124(box: Box) -> None:
    with _marker() as marker:
        start = time.monotonic()
        done = box.run("--timeout", "1", "--", *_sleeper(marker), timeout=30)
        elapsed = time.monotonic() - start
        _assert_timed_out(done, "1")
        assert elapsed < 1 + KILL_GRACE, elapsed
        assert _pids_with(marker) == []


def test_timeout_from_the_table_and_the_flag_wins(box: Box) -> None:
    policy = box.write_policy("[process]\ntimeout = 1\n")
    with _marker() as marker:
        done = box.run("--policy", policy, "--", *_sleeper(marker), timeout=30)
        _assert_timed_out(done, "1")
        assert _pids_with(marker) == []
    done = box.run("--policy", policy, "--timeout", "20", "--", "/bin/sh", "-c", "sleep 2; exit 3")
    assert done.returncode == 3, _explain(done)


CONNECT_THEN_SLEEP = """
import os, socket, sys, time, urllib.parse
url = urllib.parse.urlsplit(os.environ["http_proxy"])
sock = socket.create_connection((url.hostname, url.port), timeout=10)
print("connected", flush=True)
time.sleep(30)
"""


def test_timeout_after_the_first_connection(box: Box) -> None:
    """The proxy is serving (the asyncio phase) when the timeout expires."""
    with _marker() as marker:
        start = time.monotonic()
        cmd = [sys.executable, "-c", CONNECT_THEN_SLEEP, marker]
        done = box.run("--timeout", "1.5", "--", *cmd, timeout=30)
        _assert_timed_out(done, "1.5")
        assert done.stdout == b"connected\n", _explain(done)
        assert time.monotonic() - start < 1.5 + KILL_GRACE
        assert _pids_with(marker) == []


def test_timeout_kills_a_command_that_ignores_sigterm(box: Box) -> None:
    if not _has("pid_namespace"):
        pytest.skip("needs a PID namespace to kill the whole tree")
    with _marker() as marker:
        script = f"trap '' TERM; sleep 30; echo {marker}"
        start = time.monotonic()
        done = box.run("--timeout", "0.5", "--", "/bin/sh", "-c", script, timeout=30)
        elapsed = time.monotonic() - start
        _assert_timed_out(done, "0.5")
        assert KILL_GRACE <= elapsed < 0.5 + KILL_GRACE + 10, elapsed
        assert _pids_with(marker) == []
