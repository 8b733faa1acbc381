"""One memory budget for the whole run ([process] max_memory), judged from the host.

A child fills its private /tmp, /var/tmp and /dev/shm until the kernel says ENOSPC; the host
then looks into the child's mount namespace (/proc/PID/root) and adds up what those file
systems hold and may hold: never more than the budget. Where the host delegates a cgroup v2,
a child that allocates beyond the budget is OOM-killed, `run` exits 128+9 and says why, and
the run's cgroup is gone afterwards. As the invoking user and as an unprivileged one.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from egressbox.confine import cgroup
from unprivileged import BASE_DIR, Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(600),
]

BUDGET = 256 << 20  # small enough to fill quickly, above policy's 64 MiB floor
RUN_TIMEOUT = 120.0
FULL_WAIT = 60.0
PRIVATE = ("tmp", "var/tmp", "dev/shm", "run")

FILL = """
    import sys
    wrote = {}
    for where in ("/tmp", "/var/tmp", "/dev/shm"):
        n = 0
        try:
            with open(where + "/fill", "wb") as f:
                while n < 1 << 31:  # bounded: 2 GiB at most per file system
                    f.write(b"x" * (1 << 20)); f.flush(); n += 1 << 20
        except OSError as exc:
            wrote[where] = (n, exc.errno)
    print(wrote, flush=True)  # full: the host may look now
    sys.stdin.read(1)  # until the host has looked (or is gone)
"""


@dataclass
class Budgeted:
    actor: Actor
    workspace: Path
    policy: Path
    home: Path

    def start(self, *argv: str) -> subprocess.Popen[str]:
        env = self.actor.base_env(self.home)
        base = [*self.actor.egressbox, "run", "--quiet", "--policy", str(self.policy)]
        command, env = self.actor.command([*base, "--write-root", str(self.workspace), *argv], env)
        return subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=self.workspace,
        )


@pytest.fixture
def budgeted(actor: Actor) -> Iterator[Budgeted]:
    BASE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    top = actor.make_dir(BASE_DIR, "budget-")
    home, workspace = top / "home", top / "work"
    for directory in (home, workspace):
        directory.mkdir()
        actor.own(directory, 0o755)
    policy = top / "policy.toml"
    policy.write_text(f"[process]\nmax_memory = {BUDGET}\n", encoding="utf-8")
    actor.own(policy, 0o644)
    try:
        yield Budgeted(actor, workspace, policy, home)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _pid_with(token: str) -> int | None:
    """The command's host pid: `python -c CODE TOKEN ...` (egressbox's own processes name the
    token further along their command lines)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        if argv[1:2] == [b"-c"] and argv[3:4] == [token.encode()]:
            return int(entry)
    return None


def _used_and_size(pid: int) -> tuple[int, int]:
    used = size = 0
    for path in PRIVATE:
        st = os.statvfs(f"/proc/{pid}/root/{path}")
        used += (st.f_blocks - st.f_bfree) * st.f_frsize
        size += st.f_blocks * st.f_frsize
    return used, size


def test_the_private_file_systems_share_the_budget(budgeted: Budgeted) -> None:
    token = uuid.uuid4().hex
    code = textwrap.dedent(FILL)
    run = budgeted.start("--", budgeted.actor.python, "-c", code, token)
    assert run.stdout is not None and run.stdin is not None
    try:
        ready, _, _ = select.select([run.stdout], [], [], FULL_WAIT)
        assert ready, "the child did not fill its file systems in time"
        out = run.stdout.readline()
        pid = _pid_with(token)
        assert pid is not None, out
        used, size = _used_and_size(pid)  # from the host, into the child's mount namespace
        _, err = run.communicate(input="go", timeout=RUN_TIMEOUT)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=RUN_TIMEOUT)
    assert run.returncode == 0, err
    assert size <= BUDGET, (size, BUDGET)
    assert used <= BUDGET
    assert used > BUDGET // 2, (used, out)  # the child did fill them: the limit held, not luck
    assert out.count(", 28)") == 3, out  # ENOSPC on each (the child's word: a hint only)


def test_the_report_says_what_bounds_memory(budgeted: Budgeted) -> None:
    run = budgeted.start("--report", "--", "true")
    _, err = run.communicate(timeout=RUN_TIMEOUT)
    assert run.returncode == 0, err
    line = next(x for x in err.splitlines() if "enforcement: memory:" in x)
    plan, why = cgroup.probe(BUDGET, None, "probe")
    if plan is None:
        assert f"no cgroup: {why}" in line, line
        assert "tmpfs sizes sum to 256 MiB" in line, line
        assert "per-process RLIMIT_DATA 256 MiB" in line, line
    else:
        assert "cgroup 256 MiB for the whole run" in line, line


def test_beyond_the_budget_a_cgroup_kills_and_run_says_so(budgeted: Budgeted) -> None:
    plan, why = cgroup.probe(BUDGET, None, f"{cgroup.PREFIX}probe")
    if plan is None:
        pytest.skip(f"no cgroup for the run on this host: {why}")
    grow = "chunks = []\nfor _ in range(1024):\n    chunks.append(bytearray(1 << 20))\n"
    run = budgeted.start("--", budgeted.actor.python, "-c", grow)
    _, err = run.communicate(timeout=RUN_TIMEOUT)
    assert run.returncode == 128 + 9, err
    assert "the run reached its memory budget" in err, err
    left = [n for n in os.listdir(plan.parent) if n == f"{cgroup.PREFIX}{run.pid}"]
    assert left == []  # judged on the host: the run's cgroup is gone
