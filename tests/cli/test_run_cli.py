"""`egressbox run` as a command: exit codes, stdio, argv and cwd, --report, profile nesting,
refusals, no orphans, and nothing left listening after the run.

Every confined command runs in its own process tree, started with subprocess (`python -m
egressbox run ...`, or a small script calling the library), as the invoking user and, where
the case depends on who runs it, as an unprivileged user too (tests/unprivileged.py).
The only cases run inside the pytest process are refusals, which happen before anything forks.
No byte leaves 127.0.0.0/8 or namespaces created here; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import egressbox
from egressbox import cli
from egressbox.confine.grants import HOST_NEEDS, PROBED_MECHANISMS, HostFacts, Mechanism, Profile
from egressbox.runner.api import run_options_sync
from egressbox.runner.facts import host_facts
from egressbox.runner.options import RunOptions, RunRefusedError
from unprivileged import Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    # The first test as the unprivileged user may build its venv (pip install) once.
    pytest.mark.timeout(900),
]

# One `egressbox run` (start-up, the command, the proxy's shutdown); generous for CI.
RUN_TIMEOUT = 120.0
# The probe's confinement mechanisms (confine/grants.py PROBED_MECHANISMS), for simulated
# HostFacts: capture and the connect supervisor are ways to the proxy, not confinement.
HOST_MECHANISMS = tuple(
    name for name in PROBED_MECHANISMS if name not in ("capture", "connect_supervisor")
)
REPORT_LINE = re.compile(r"^egressbox: enforcement: (\w+): (full|partial|none) \((.*)\)$")


# -- fixtures ---------------------------------------------------------------------------


@dataclass
class Box:
    """Runs `egressbox run` (or anything) as one actor, in its own workspace under /tmp."""

    actor: Actor
    workspace: Path
    home: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {**self.actor.base_env(self.home), **extra}

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stdin: bytes = b"",
    ) -> subprocess.CompletedProcess[bytes]:
        command, environment = self.actor.command(argv, env or self.env())
        return subprocess.run(
            command,
            input=stdin,
            capture_output=True,
            env=environment,
            cwd=cwd or self.workspace,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def egressbox(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stdin: bytes = b"",
    ) -> subprocess.CompletedProcess[bytes]:
        """`egressbox run --quiet ARGS` (no per-connection lines on stderr)."""
        argv = [*self.actor.egressbox, "run", "--quiet", *args]
        return self.run(argv, env=env, cwd=cwd, stdin=stdin)


@pytest.fixture
def box(actor: Actor) -> Iterator[Box]:
    workspace = actor.make_dir("/tmp", "egressbox-cli-ws-")
    home = actor.make_dir("/tmp", "egressbox-cli-home-")
    try:
        yield Box(actor, workspace, home)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def _text(data: bytes) -> str:
    return data.decode(errors="replace")


def _explain(done: subprocess.CompletedProcess[bytes]) -> str:
    out, err = _text(done.stdout)[-2000:], _text(done.stderr)[-3000:]
    return f"exit {done.returncode}\nstdout: {out}\nstderr: {err}"


def _facts_without(
    *missing: str, landlock_abi: int = 7, status: str = "absent_on_host"
) -> HostFacts:
    statuses = {name: ("available" if name not in missing else status) for name in HOST_MECHANISMS}
    available = frozenset(name for name, value in statuses.items() if value == "available")
    return HostFacts(available, statuses, landlock_abi, os.geteuid())


@pytest.fixture(scope="session")
def every_mechanism() -> None:
    """Skip unless this host offers every mechanism (the cases expect `full` everywhere)."""
    facts = host_facts()
    missing = [name for name in HOST_MECHANISMS if name not in facts.available]
    if missing or facts.landlock_abi < 6:
        pytest.skip(f"this host lacks {missing or 'Landlock ABI 6'}")


needs_every_mechanism = pytest.mark.usefixtures("every_mechanism")


# -- exit codes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("exit 0", 0),
        ("exit 7", 7),
        ("exit 255", 255),
        ("kill -TERM $$", 128 + signal.SIGTERM),
        ("kill -KILL $$", 128 + signal.SIGKILL),
        ("kill -SEGV $$", 128 + signal.SIGSEGV),
    ],
    ids=["zero", "seven", "255", "sigterm", "sigkill", "sigsegv"],
)
def test_exit_code_is_the_commands(box: Box, script: str, expected: int) -> None:
    done = box.egressbox("--", "/bin/sh", "-c", script)
    assert done.returncode == expected, _explain(done)


@pytest.mark.parametrize("name", ["egressbox-no-such-command-{}", "./missing-{}"])
def test_command_not_found_exits_127(box: Box, name: str) -> None:
    missing = name.format(uuid.uuid4().hex[:8])
    done = box.egressbox("--", missing, "arg")
    assert done.returncode == 127, _explain(done)
    assert missing in _text(done.stderr)


def test_command_that_cannot_be_executed_exits_123(box: Box) -> None:
    """Found but not executable: 123 (EXIT_CANNOT_EXECUTE), never 126, which says that the
    confinement the profile requires is unavailable."""
    script = box.workspace / "not-executable.sh"
    script.write_text("#!/bin/sh\necho ran\n", encoding="utf-8")
    box.actor.own(script, 0o644)
    done = box.egressbox("--", str(script))
    assert done.returncode == 123, _explain(done)
    assert b"Permission denied" in done.stderr and b"refused by" not in done.stderr
    assert b"ran" not in done.stdout


# -- os_hardened fails closed -----------------------------------------------------------


@pytest.mark.parametrize(
    ("facts", "refused"),
    [
        (
            _facts_without("landlock", landlock_abi=0),
            {"landlock_fs", "landlock_net", "landlock_scope"},
        ),
        (_facts_without(landlock_abi=3), {"landlock_net", "landlock_scope"}),
        (_facts_without("seccomp"), {"seccomp"}),
        (
            _facts_without("network_namespace", "mount_namespace", status="cannot_attach"),
            {"network_namespace", "mount_namespace"},
        ),
    ],
    ids=["no-landlock", "landlock-abi-3", "no-seccomp", "namespaces-not-attachable"],
)
def test_os_hardened_refuses_when_a_mechanism_is_missing(
    tmp_path: Path, facts: HostFacts, refused: set[str]
) -> None:
    marker = tmp_path / "ran"
    options = RunOptions(
        argv=("/bin/sh", "-c", f"touch {marker}"),
        policy=None,
        profile=Profile.OS_HARDENED,
        cwd=str(tmp_path),
    )
    with pytest.raises(RunRefusedError) as caught:
        run_options_sync(options, facts=facts)
    by_name = {r.mechanism.value: r for r in caught.value.refusals}
    assert set(by_name) == refused
    for name, refusal in by_name.items():
        host_status = facts.status[HOST_NEEDS[Mechanism(name)]]
        # Present but with too old a Landlock ABI counts as absent.
        assert refusal.availability == (
            "absent_on_host" if host_status == "available" else host_status
        )
        message = refusal.message()
        # The facts: the mechanism, its availability here (Harn's value), the profile; the
        # remedy apart from them.
        for part in (name, refusal.harn_availability, "os_hardened"):
            assert part and part in message, message
        assert refusal.admit not in message and refusal.admit in refusal.remedy()
        fields = refusal.fields()
        assert fields["source"] == "sandbox_mechanism"
        assert fields["sandbox_mechanism"]["availability"] in (
            "absent_on_host",
            "entry_point_cannot_attach",
        )
        if name.startswith("landlock"):
            assert fields["sandbox_mechanism"]["mechanism"] == "linux_landlock"
        assert fields["remedy"] == refusal.remedy()
    assert caught.value.code == 126 and caught.value.cause == "confinement_unavailable"
    assert not marker.exists()


def test_os_hardened_refusal_on_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Refused before anything forks, so this runs in the test process.
    monkeypatch.setattr(
        "egressbox.runner.api.host_facts", lambda: _facts_without("landlock", landlock_abi=0)
    )
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    code = cli.main(["run", "--profile", "os_hardened", "--", "/bin/sh", "-c", f"touch {marker}"])
    err = capsys.readouterr().err
    assert code == 126, err
    assert not marker.exists()
    for name in ("landlock_fs", "landlock_net", "landlock_scope"):
        facts = (
            f"egressbox: refused: profile os_hardened requires {name} (linux_landlock), "
            "which is absent_on_host here (the profile requires it"
        )
        assert facts in err, err
        assert f"egressbox: to admit {name}: " in err, err  # the remedy, on a line of its own


@needs_every_mechanism
def test_os_hardened_runs_where_every_mechanism_exists(box: Box) -> None:
    done = box.egressbox("--profile", "os_hardened", "--report", "--", "/bin/sh", "-c", "exit 0")
    assert done.returncode == 0, _explain(done)


def test_worktree_is_best_effort_and_warns(tmp_path: Path) -> None:
    """A missing mechanism: worktree runs with a warning; EGRESSBOX_SANDBOX=enforce refuses."""
    script = textwrap.dedent(
        """
        import json, sys
        from egressbox.confine.grants import HostFacts, Profile
        from egressbox.runner.options import RunOptions
        from egressbox.runner.api import run_options_sync
        names = ["landlock", "seccomp", "no_new_privs", "user_namespace", "network_namespace",
                 "mount_namespace", "pid_namespace", "close_range"]
        status = {n: "available" for n in names} | {"pid_namespace": "cannot_attach"}
        facts = HostFacts(frozenset(n for n in names if status[n] == "available"), status, 7,
                          int(sys.argv[1]))
        options = RunOptions(argv=("/bin/sh", "-c", "echo ran"), policy=None,
                             profile=Profile.WORKTREE, cwd=sys.argv[2])
        result = run_options_sync(options, facts=facts, capture_output=True)
        print(json.dumps({"code": result.exit_code, "out": result.stdout.decode(),
                          "warnings": result.warnings}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX")}
    done = subprocess.run(
        [sys.executable, "-c", script, str(os.geteuid()), str(tmp_path)],
        capture_output=True,
        env=env,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, _explain(done)
    result = json.loads(done.stdout)
    assert result["code"] == 0 and result["out"] == "ran\n", result
    assert any("pid_namespace" in w for w in result["warnings"]), result
    assert b"warning: profile worktree runs without pid_namespace" in done.stderr, _explain(done)

    facts = _facts_without("pid_namespace", status="cannot_attach")
    enforce = RunOptions(
        argv=("/bin/true",),
        policy=None,
        profile=Profile.WORKTREE,
        cwd=str(tmp_path),
        base_env={"EGRESSBOX_SANDBOX": "enforce", "PATH": "/usr/bin:/bin"},
    )
    with pytest.raises(RunRefusedError) as caught:
        run_options_sync(enforce, facts=facts)
    assert [r.mechanism for r in caught.value.refusals] == [Mechanism.PID_NAMESPACE]
    assert "cannot_attach" in str(caught.value)


# -- stdio, argv, cwd, report -----------------------------------------------------------


def test_stdin_stdout_stderr_pass_through(box: Box) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB, every byte value
    done = box.egressbox("--", "/bin/sh", "-c", "cat; echo to-stderr >&2; exit 3", stdin=data)
    assert done.returncode == 3, _explain(done)
    assert done.stdout == data
    assert b"to-stderr\n" in done.stderr


def test_argv_and_cwd_are_kept(box: Box) -> None:
    cwd = box.workspace / "sub dir"
    cwd.mkdir()
    box.actor.own(cwd, 0o755)
    args = ["a b", "", "ünïcødé", "--flag", "$HOME", "*", "-", "x=y"]
    script = "import json, os, sys; print(json.dumps([sys.argv[1:], os.getcwd()]))"
    done = box.egressbox(
        "--write-root",
        str(box.workspace),
        "--",
        box.actor.python,
        "-c",
        script,
        *args,
        cwd=cwd,
    )
    assert done.returncode == 0, _explain(done)
    assert json.loads(done.stdout) == [args, str(cwd)]


@needs_every_mechanism
def test_report_lists_every_mechanism(box: Box) -> None:
    done = box.egressbox("--report", "--", "/bin/sh", "-c", "exit 0")
    assert done.returncode == 0, _explain(done)
    rows = {}
    for line in _text(done.stderr).splitlines():
        match = REPORT_LINE.match(line)
        if match:
            rows[match[1]] = match[2]
    # Each mechanism, then what they add up to: the network boundary, the file system (a
    # constructed root with Landlock as a second wall), capture and the staged workspace.
    outcomes = {"network_boundary", "filesystem", "capture", "workspace"}
    expected = {m.value for m in Mechanism} | outcomes
    # memory is full only under a cgroup of the run's own (confine/cgroup.py), partial without.
    assert set(rows) == expected | {"memory"}, _explain(done)
    assert {rows[name] for name in expected} == {"full"}, rows
    assert rows["memory"] in {"full", "partial"}, rows
    # The profile the command ran under is said once, apart from the rows.
    assert _text(done.stderr).count("egressbox: profile: worktree (") == 1, _explain(done)
    quiet = box.egressbox("--", "/bin/sh", "-c", "exit 0")
    assert b"enforcement:" not in quiet.stderr, _explain(quiet)


# -- profile nesting ---------------------------------------------------------------------


def _package_root(box: Box) -> str:
    """Where the actor's interpreter imports egressbox from (an editable install: src/)."""
    if not box.actor.runuser:
        return str(Path(egressbox.__file__).resolve().parents[1])
    code = "import egressbox, pathlib; print(pathlib.Path(egressbox.__file__).resolve().parents[1])"
    done = box.run([box.actor.python, "-c", code])
    assert done.returncode == 0, _explain(done)
    return _text(done.stdout).strip()


def test_nested_run_gets_the_strictest_profile(box: Box) -> None:
    inner = [*box.actor.egressbox, "run", "--quiet", "--profile", "unrestricted", "--"]
    inner += ["/bin/sh", "-c", 'echo "inner=$EGRESSBOX_PROFILE"']
    # The inner run serves its proxy on the outer namespace's lo: it may bind there.
    done = box.egressbox("--allow-loopback", "--read-root", _package_root(box), "--", *inner)
    assert done.returncode == 0, _explain(done)
    assert done.stdout == b"inner=worktree\n", _explain(done)


@needs_every_mechanism
def test_nested_run_inside_os_hardened_is_refused(box: Box) -> None:
    inner = [*box.actor.egressbox, "run", "--quiet", "--profile", "unrestricted", "--", "true"]
    done = box.egressbox(
        "--profile", "os_hardened", "--read-root", _package_root(box), "--", *inner
    )
    assert done.returncode == 126, _explain(done)
    # The inner run became os_hardened and found no namespaces to create inside the box.
    assert re.search(
        rb"refused: profile os_hardened requires (network|mount|pid)_namespace", done.stderr
    ), _explain(done)


@pytest.mark.parametrize(
    ("inherited", "requested", "effective"),
    [
        ("worktree", "unrestricted", "worktree"),
        ("unrestricted", "worktree", "worktree"),
        ("not-a-profile", "unrestricted", "unrestricted"),
    ],
)
def test_inherited_profile_variable_is_honoured(
    box: Box, inherited: str, requested: str, effective: str
) -> None:
    env = box.env(EGRESSBOX_PROFILE=inherited)
    done = box.egressbox(
        "--profile", requested, "--", "/bin/sh", "-c", 'echo "$EGRESSBOX_PROFILE"', env=env
    )
    assert done.returncode == 0, _explain(done)
    assert _text(done.stdout) == f"{effective}\n"


# -- nothing outlives the run -------------------------------------------------------------

DAEMON = """
import os, sys
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        sleeper = [sys.executable, "-c", "import time; time.sleep(1000)", sys.argv[1]]
        os.execv(sys.executable, sleeper)
    os._exit(0)
os.wait()
print("daemon started", flush=True)
"""


def _pids_with(marker: str) -> list[int]:
    done = subprocess.run(
        ["pgrep", "-f", marker], capture_output=True, text=True, timeout=30, check=False
    )
    return [int(pid) for pid in done.stdout.split()]


def _kill_all(marker: str) -> None:
    for pid in _pids_with(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_no_daemon_outlives_the_run(box: Box) -> None:
    if shutil.which("pgrep") is None:
        pytest.skip("pgrep is not installed")
    marker = f"egressbox-test-daemon-{uuid.uuid4().hex}"
    try:
        # Unconfined, the double-forked setsid daemon survives its parent...
        done = box.run([box.actor.python, "-c", DAEMON, marker])
        assert done.stdout == b"daemon started\n", _explain(done)
        assert _pids_with(marker), "the daemon did not start"
        _kill_all(marker)
        deadline = time.monotonic() + 10
        while _pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        # ...under `egressbox run` it is gone by the time the run returns.
        done = box.egressbox("--", box.actor.python, "-c", DAEMON, marker)
        assert done.returncode == 0 and done.stdout == b"daemon started\n", _explain(done)
        assert _pids_with(marker) == []
    finally:
        _kill_all(marker)


LIBRARY_RUN = """
import json, os, sys
from egressbox.runner.api import run_sync

def fds():
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            found[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the directory's own descriptor, closed by now
    return found

child = "import os; print(os.stat('/proc/self/ns/net').st_ino)"
seen = {"own": os.stat("/proc/self/ns/net").st_ino, "fds": [fds()], "netns": []}
for _ in range(2):
    result = run_sync([sys.executable, "-c", child], policy=None, capture_output=True)
    assert result.exit_code == 0, result
    seen["netns"].append(int(result.stdout))
    seen["fds"].append(fds())
print(json.dumps(seen))
"""


def _sockets(fds: dict[str, str]) -> dict[str, str]:
    return {fd: target for fd, target in fds.items() if target.startswith("socket:")}


def test_namespace_and_its_listeners_are_gone_after_the_run(box: Box) -> None:
    done = box.run([box.actor.python, "-c", LIBRARY_RUN])
    assert done.returncode == 0, _explain(done)
    seen = json.loads(done.stdout)
    before, first, second = seen["fds"]
    assert seen["own"] not in seen["netns"]
    # The listeners the caller served (inside the child's namespace) are closed...
    assert _sockets(first) == _sockets(before), seen
    # ...and nothing accumulates from run to run (uvloop keeps one signal pipe per process).
    assert second == first, seen
    # Nothing on the host is left in either child's network namespace.
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                assert (entry / "ns/net").stat().st_ino not in seen["netns"], entry


# -- the refusal line --------------------------------------------------------------------


@pytest.fixture
def tripwire() -> Iterator[socket.socket]:
    """A loopback listener nobody serves: a connection that reached it waits in its backlog."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    try:
        yield sock
    finally:
        sock.close()


def _connections(sock: socket.socket) -> int:
    count = 0
    for _ in range(100):
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            break
        conn.close()
        count += 1
    return count


def test_failure_after_a_denial_names_the_destination(box: Box, tripwire: socket.socket) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    port = tripwire.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    curl = ["curl", "-q", "--silent", "--fail", "--max-time", "20", url]
    done = box.egressbox("--", *curl)
    assert done.returncode == 22, _explain(done)  # curl --fail on the proxy's 403
    line = rf"egressbox: command exited 22; refused by egress: 127\.0\.0\.1:{port} \((\w+)\)"
    assert re.search(line.encode(), done.stderr), _explain(done)
    assert _connections(tripwire) == 0
    # A command that shrugs the denial off succeeds, and no refusal is claimed.
    done = box.egressbox("--", "/bin/sh", "-c", " ".join(curl) + "; exit 0")
    assert done.returncode == 0, _explain(done)
    assert b"refused by" not in done.stderr, _explain(done)


def test_failure_without_a_denial_is_no_refusal(box: Box) -> None:
    done = box.egressbox("--", "/bin/sh", "-c", "exit 3")
    assert done.returncode == 3
    assert b"refused by" not in done.stderr, _explain(done)


# -- process roots -------------------------------------------------------------------------

PROCESS_ROOT_CHILD = """
import json, os, sys
root = sys.argv[1]
with open(os.path.join(root, "state.txt"), "w", encoding="utf-8") as handle:
    handle.write("written by the tool")
print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd()}))
"""


def test_a_process_write_root_is_writable_and_gets_no_tmpdir(box: Box) -> None:
    cache = box.actor.make_dir("/tmp", "egressbox-cli-cache-")
    try:
        argv = [box.actor.python, "-c", PROCESS_ROOT_CHILD, str(cache)]
        refused = box.egressbox("--", *argv)
        assert refused.returncode == 1, _explain(refused)
        assert not (cache / "state.txt").exists()

        done = box.egressbox("--report", "--process-write-root", str(cache), "--", *argv)
        assert done.returncode == 0, _explain(done)
        assert (cache / "state.txt").read_text(encoding="utf-8") == "written by the tool"
        seen = json.loads(done.stdout)
        assert seen["cwd"] == str(box.workspace)
        scratch = str(box.workspace / ".egressbox")
        for name in ("TMPDIR", "TMP", "TEMP"):
            assert seen["env"][name].startswith(scratch), seen["env"]
        # EGRESSBOX_ROOTS lists every grant for a run nested in this one (runner/assemble.py
        # roots_variable); no other variable points the tool at the root.
        nested = json.loads(seen["env"].pop("EGRESSBOX_ROOTS"))
        assert str(cache) in nested["write"], nested
        assert not any(str(cache) in value for value in seen["env"].values()), seen["env"]
        assert sorted(p.name for p in cache.iterdir()) == ["state.txt"]
        assert f"egressbox: root: process_write: {cache} (".encode() in done.stderr, _explain(done)
        assert f"egressbox: root: workspace: {box.workspace} (".encode() in done.stderr
    finally:
        shutil.rmtree(cache, ignore_errors=True)
