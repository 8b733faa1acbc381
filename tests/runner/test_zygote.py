"""The zygote (runner/zygote.py): a launcher forked before the plan exists runs the command as
a launcher forked at spawn time would, holds nothing the parent opens later, and never
outlives a run that did not launch.

Commands run in their own process trees (`python -m egressbox run ...`); only the refusal
case, which launches nothing, runs in the pytest process. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from egressbox import cli
from egressbox.confine.grants import HostFacts, Mechanism
from egressbox.runner import zygote
from egressbox.runner.assemble import prepare
from egressbox.runner.facts import host_facts
from egressbox.runner.options import options_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="egressbox run is Linux only")

RUN_TIMEOUT = 120.0


def _run(cwd: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "egressbox", "run", "--quiet", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
        cwd=cwd,
    )


def test_the_command_gets_its_streams_exit_code_and_nothing_else(tmp_path: Path) -> None:
    script = "cat; echo to-stderr >&2; ls /proc/self/fd; exit 7"
    done = _run(tmp_path, "--", "/bin/sh", "-c", script, stdin="from-stdin\n")
    assert done.returncode == 7, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "from-stdin"
    # 0-2, and the directory `ls` reads: no report pipe, channel or listener leaked.
    assert sorted(lines[1:], key=int) == ["0", "1", "2", "3"], done.stdout
    assert "to-stderr" in done.stderr


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    pending = [pid]
    while pending and len(found) < MAX_TREE:
        current = pending.pop()
        try:
            text = Path(f"/proc/{current}/task/{current}/children").read_text()
        except OSError:
            continue
        children = [int(word) for word in text.split()]
        found += children
        pending += children
    return found


def _open_files(pid: int) -> set[str]:
    names: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return names
    for fd in fds:
        with contextlib.suppress(OSError):
            names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return names


MAX_TREE = 16  # the launcher, its reaper, the command (and sh's own children)


def test_the_audit_log_is_held_by_nothing_of_the_command_s_tree(tmp_path: Path) -> None:
    # The zygote was forked before the audit log was opened: the launcher and its reaper
    # (and so the command's PID namespace) never hold it. Judged from the host side while
    # the command waits.
    log = tmp_path / "audit.jsonl"
    argv = [sys.executable, "-m", "egressbox", "run", "--quiet", "--audit-log", str(log)]
    argv += ["--", "/bin/sh", "-c", "echo ready; read line"]
    with subprocess.Popen(
        argv, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as run:
        assert run.stdin is not None and run.stdout is not None
        try:
            ready, _, _ = select.select([run.stdout], [], [], RUN_TIMEOUT)
            assert ready and run.stdout.readline().strip() == "ready"
            assert str(log) in _open_files(run.pid)  # the proxy's own sink
            tree = _descendants(run.pid)
            assert len(tree) >= 2, tree  # the launcher and the reaper at least
            holders = [pid for pid in tree if str(log) in _open_files(pid)]
        finally:
            run.stdin.write("done\n")
            run.stdin.close()
            run.wait(RUN_TIMEOUT)
    assert holders == []
    assert run.returncode == 0


def _no_landlock() -> HostFacts:
    names = ("seccomp", "no_new_privs", "user_namespace", "network_namespace")
    status = {name: "available" for name in names} | {"landlock": "absent_on_host"}
    return HostFacts(frozenset(names), status, 0, os.geteuid())


def test_a_refused_run_leaves_no_zygote(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[int] = []
    real_start = zygote.start

    def start() -> None:
        real_start()
        started.extend(z.pid for z in zygote._pending)

    monkeypatch.setattr(zygote, "start", start)
    monkeypatch.setattr("egressbox.runner.api.host_facts", _no_landlock)
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", "--profile", "os_hardened", "--", "/bin/true"])
    assert code == 126, capsys.readouterr().err
    assert len(started) == 1
    assert not zygote._pending
    # Reaped: the pid is no child of ours any more.
    with pytest.raises(ChildProcessError):
        os.waitpid(started[0], os.WNOHANG)


def test_a_plan_crosses_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    plan = prepare(options_for(["/bin/true"], policy=None), host_facts()).plan
    data = zygote.dumps(([zygote.REPORT, 2], plan))
    assert data[:1] == b"M"  # marshal: nothing to import on either side
    targets, crossed = zygote.loads(data)
    assert (targets, crossed) == ([zygote.REPORT, 2], plan)
    # Records cross as themselves (a NamedTuple equals a plain tuple of its values).
    assert type(crossed) is type(plan)
    assert plan.world is None or type(crossed.world) is type(plan.world)
    # What marshal cannot carry (an enum member) crosses as a pickle, equal all the same.
    odd = plan._replace(mechanisms=(Mechanism.SECCOMP,))
    data = zygote.dumps(odd)
    assert data[:1] == b"P"
    assert zygote.loads(data) == odd


def test_a_plan_names_only_egressbox_classes() -> None:
    import marshal

    forged = b"M" + marshal.dumps(("\0record", "os", "system", {"command": "true"}))
    with pytest.raises(ValueError, match="outside egressbox"):
        zygote.loads(forged)
