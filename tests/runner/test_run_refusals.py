"""Refusal records of `egressbox run` with real confined children, and the stderr pass-through.

Each refused action is first done where nothing confines it (outside egressbox, or under the
`unrestricted` profile, which has no filesystem rules), to prove it would succeed there; then
under the default profile, where the run must name the boundary and the path on its one
refusal line. A command that fails for its own reasons inside a granted root gets no line.
The child's stderr passes through the parent (a pipe, or a pty when the parent's stderr is a
terminal): its bytes must arrive unchanged and in order, and a pty must look like a terminal.

Every child runs in its own process tree, as the invoking user and as the unprivileged test
user (tests/unprivileged.py). Nothing leaves loopback; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
import tty
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from unix_listener import UnixListener
from unprivileged import (
    BASE_DIR,
    Actor,
    invoking_actor,
)

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    # The first test as the unprivileged user may build its venv (pip install) once.
    pytest.mark.timeout(900),
]

RUN_TIMEOUT = 120.0
SSH_SECRET = "-----BEGIN OPENSSH PRIVATE KEY----- egressbox refusal test\n"
# A listener thread's accept tick (how quickly it notices it should stop).
TICK = 0.1
# A grandchild that keeps the command's stderr open sleeps this long; the run must end well
# before it wakes.
LINGER_S = 30
LINGER_BOUND_S = 10.0
# Reading the pty's master side in the pty test.
PTY_READ_TIMEOUT = 60.0
# A client for a pathname unix socket that reports failures the way tools do: "PATH: strerror".
UNIX_CLIENT = textwrap.dedent(
    """
    import socket, sys
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(sys.argv[1])
    except OSError as exc:
        sys.exit(f"unix-client: {sys.argv[1]}: {exc.strerror}")
    sock.close()
    """
)


@dataclass
class Box:
    """One actor's workspace, fake home (with a key under .ssh) and an ungranted directory."""

    actor: Actor
    workspace: Path
    home: Path
    outside: Path

    @property
    def key(self) -> Path:
        return self.home / ".ssh" / "id_rsa"

    def run(
        self, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        command, environment = self.actor.command(argv, env or self.actor.base_env(self.home))
        return subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=environment,
            cwd=cwd or self.workspace,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def egressbox(self, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
        """`egressbox run --quiet --policy DENY-ALL ARGS`, with the workspace as cwd (and so
        the write root); with a policy, run says nothing of its own on stderr."""
        policy = self.home / "deny-all.toml"
        if not policy.exists():
            policy.write_text("[egress]\nallow = []\n", encoding="utf-8")
            self.actor.own(policy, 0o644)
        argv = [*self.actor.egressbox, "run", "--quiet", "--policy", str(policy), *args]
        return self.run(argv, cwd=cwd)


@pytest.fixture
def box(actor: Actor) -> Iterator[Box]:
    workspace = actor.make_dir("/tmp", "egressbox-refusal-ws-")
    home = actor.make_dir("/tmp", "egressbox-refusal-home-")
    # Neither granted nor hidden (not under /tmp or /run): Landlock alone refuses writes here.
    BASE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    outside = actor.make_dir(BASE_DIR, "refusal-outside-")
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700)
    actor.own(ssh, 0o700)
    (ssh / "id_rsa").write_text(SSH_SECRET, encoding="utf-8")
    actor.own(ssh / "id_rsa", 0o600)
    (home / "notes.txt").write_text("notes\n", encoding="utf-8")
    actor.own(home / "notes.txt", 0o644)
    try:
        yield Box(actor, workspace, home, outside)
    finally:
        for path in (workspace, home, outside):
            shutil.rmtree(path, ignore_errors=True)


def _text(data: bytes) -> str:
    return data.decode(errors="replace")


def _explain(done: subprocess.CompletedProcess[bytes]) -> str:
    out, err = _text(done.stdout)[-2000:], _text(done.stderr)[-3000:]
    return f"exit {done.returncode}\nstdout: {out}\nstderr: {err}"


def _refusal_line(done: subprocess.CompletedProcess[bytes]) -> str:
    lines = [line for line in _text(done.stderr).splitlines() if "; refused by " in line]
    assert len(lines) == 1, _explain(done)
    return lines[0]


# -- home_read ----------------------------------------------------------------------------


def test_reading_a_key_under_home_ssh_is_home_read(box: Box) -> None:
    free = box.run(["cat", str(box.key)])
    assert free.returncode == 0 and _text(free.stdout) == SSH_SECRET, _explain(free)
    loose = box.egressbox("--profile", "unrestricted", "--", "cat", str(box.key))
    assert loose.returncode == 0 and _text(loose.stdout) == SSH_SECRET, _explain(loose)

    done = box.egressbox("--read-root", str(box.home), "--", "cat", str(box.key))
    assert done.returncode == 1, _explain(done)
    assert SSH_SECRET not in _text(done.stdout)
    line = _refusal_line(done)
    assert line.startswith(f"egressbox: command exited 1; refused by home_read: {box.key} ("), line
    assert "from the command's error output" in line
    assert "the deny list always wins" in line


def test_reading_an_ungranted_file_under_home_is_home_read(box: Box) -> None:
    notes = box.home / "notes.txt"
    loose = box.egressbox("--profile", "unrestricted", "--", "cat", str(notes))
    assert loose.returncode == 0, _explain(loose)

    done = box.egressbox("--", "cat", str(notes))
    assert done.returncode == 1, _explain(done)
    line = _refusal_line(done)
    assert f"refused by home_read: {notes} (" in line, line
    assert f"--read-root {notes} admits it" in line  # exactly the file, not the home


# -- write --------------------------------------------------------------------------------


def _writers(box: Box, target: Path) -> dict[str, list[str]]:
    return {
        "touch": ["touch", str(target)],
        "python": [box.actor.python, "-c", f"open({str(target)!r}, 'w').write('x')"],
    }


@pytest.mark.parametrize("writer", ["touch", "python"])
def test_writing_outside_the_roots_is_write(box: Box, writer: str) -> None:
    free_target = box.outside / f"free-{writer}"
    free = box.run(_writers(box, free_target)[writer])
    assert free.returncode == 0 and free_target.exists(), _explain(free)
    loose_target = box.outside / f"loose-{writer}"
    loose = box.egressbox("--profile", "unrestricted", "--", *_writers(box, loose_target)[writer])
    assert loose.returncode == 0 and loose_target.exists(), _explain(loose)

    target = box.outside / f"boxed-{writer}"
    done = box.egressbox("--", *_writers(box, target)[writer])
    assert done.returncode == 1, _explain(done)
    assert not target.exists()
    err = _text(done.stderr)
    if writer == "python":
        # Python says only "No such file or directory" (its directory is not in the view):
        # not found, no boundary, with what admits the directory were it a creation.
        assert "refused by" not in err, _explain(done)
        assert f"not found: {target} (" in err, _explain(done)
        assert f"if the command was creating it, --write-root {box.outside} admits it" in err
        return
    line = _refusal_line(done)
    assert f"refused by write: {target} (" in line, line
    assert f"--write-root {box.outside} admits it" in line


def test_touching_etc_is_write(box: Box) -> None:
    if box.actor.uid != 0:
        pytest.skip("only root may create files in /etc outside egressbox")
    target = Path(f"/etc/egressbox-x-{uuid.uuid4().hex[:8]}")
    try:
        loose = box.egressbox("--profile", "unrestricted", "--", "touch", str(target))
        assert loose.returncode == 0 and target.exists(), _explain(loose)
        target.unlink()
        done = box.egressbox("--", "touch", str(target))
        assert done.returncode == 1, _explain(done)
        assert not target.exists()
        assert f"refused by write: {target} (" in _refusal_line(done)
    finally:
        with contextlib.suppress(FileNotFoundError):
            target.unlink()


# -- local_socket -------------------------------------------------------------------------


@pytest.fixture(params=["run", "tmp"])
def unix_listener(request: pytest.FixtureRequest) -> Iterator[UnixListener]:
    parent = "/run" if request.param == "run" else "/tmp"
    if not os.access(parent, os.W_OK):
        pytest.skip(f"{parent} is not writable here")
    directory = Path(parent) / f"egressbox-refusal-{uuid.uuid4().hex[:12]}"
    directory.mkdir(mode=0o755)
    listener = UnixListener(directory / "listener.sock")
    try:
        yield listener
    finally:
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)


def _unix_clients(box: Box, path: Path) -> dict[str, list[str]]:
    clients = {"python": [box.actor.python, "-c", UNIX_CLIENT, str(path)]}
    nc = shutil.which("nc")
    if nc is not None:
        clients["nc"] = [nc, "-U", str(path)]
    return clients


@pytest.mark.parametrize("client", ["python", "nc"])
def test_connecting_to_a_host_unix_socket_is_local_socket(
    box: Box, unix_listener: UnixListener, client: str
) -> None:
    argv = _unix_clients(box, unix_listener.path).get(client)
    if argv is None:
        pytest.skip(f"{client} is not installed")
    loose = box.egressbox("--profile", "unrestricted", "--", *argv)
    assert loose.returncode == 0, _explain(loose)
    assert unix_listener.accepted == 1

    done = box.egressbox("--", *argv)
    assert done.returncode != 0, _explain(done)
    assert unix_listener.accepted == 1
    line = _refusal_line(done)
    assert f"refused by local_socket: {unix_listener.path} (" in line, line


# -- the command's own failure: no refusal line -----------------------------------------------


def test_a_failure_inside_a_granted_root_is_no_refusal(box: Box) -> None:
    missing = box.workspace / "nonexistent-in-workspace"
    free = box.run(["ls", str(missing)])
    assert free.returncode == 2, _explain(free)
    done = box.egressbox("--write-root", str(box.workspace), "--", "ls", str(missing))
    assert done.returncode == 2, _explain(done)
    assert str(missing) in _text(done.stderr)
    assert "egressbox:" not in _text(done.stderr), _explain(done)


# -- the library: classification from captured output --------------------------------------

LIBRARY_RUN = """
import json, sys
from egressbox import run_sync

key, home = sys.argv[1], sys.argv[2]
result = run_sync(["cat", key], policy=None, capture_output=True, read_roots=[home])
refusal = result.refusal
print(json.dumps({
    "code": result.exit_code,
    "stderr": result.stderr.decode(errors="replace"),
    "boundary": refusal and refusal.boundary,
    "paths": refusal and list(refusal.paths),
    "source": refusal and refusal.source,
    "evidence": refusal and list(refusal.evidence),
}))
"""


def test_library_returns_a_typed_record_from_captured_stderr(box: Box) -> None:
    done = box.run([box.actor.python, "-c", LIBRARY_RUN, str(box.key), str(box.home)])
    assert done.returncode == 0, _explain(done)
    seen = json.loads(done.stdout)
    assert seen["code"] == 1, seen
    assert seen["boundary"] == "home_read", seen
    assert seen["paths"] == [str(box.key)], seen
    assert seen["source"] == "from the command's error output", seen
    assert seen["evidence"] == [seen["stderr"].strip()], seen


# -- the stderr pass-through ---------------------------------------------------------------

# Writes every byte value, then chunks of random bytes with pauses, then a large block,
# to fd 2, with markers on stdout in between; exits 0 (no refusal line follows).
BYTES_WRITER = """
import os, random, sys, time
rng = random.Random(int(sys.argv[1]))
os.write(2, bytes(range(256)))
for n in range(20):
    os.write(2, rng.randbytes(rng.randrange(1, 5000)))
    if n % 5 == 0:
        time.sleep(0.01)
data = rng.randbytes(300_000)
view = memoryview(data)
while view:
    view = view[os.write(2, view):]
"""


def _expected_bytes(seed: int) -> bytes:
    rng = random.Random(seed)
    out = bytes(range(256))
    for _ in range(20):
        out += rng.randbytes(rng.randrange(1, 5000))
    return out + rng.randbytes(300_000)


def test_stderr_bytes_arrive_unchanged_and_in_order(box: Box) -> None:
    seed = random.randrange(1 << 30)
    done = box.egressbox("--", box.actor.python, "-c", BYTES_WRITER, str(seed))
    assert done.returncode == 0, _explain(done)
    assert done.stderr == _expected_bytes(seed)


def test_a_grandchild_holding_stderr_does_not_hold_the_run(box: Box) -> None:
    """Unrestricted has no PID namespace: a daemon outlives the command with its stderr."""
    pid_file = box.workspace / "linger.pid"
    script = f"sleep {LINGER_S} >/dev/null </dev/null & echo $! > {pid_file}; echo bye >&2; exit 3"
    started = time.monotonic()
    try:
        done = box.egressbox("--profile", "unrestricted", "--", "/bin/sh", "-c", script)
        elapsed = time.monotonic() - started
        assert done.returncode == 3, _explain(done)
        assert elapsed < LINGER_BOUND_S, _explain(done)
        err = _text(done.stderr)
        assert err.endswith("bye\n") and "refused by" not in err, _explain(done)  # no evidence
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text(encoding="ascii")), signal.SIGKILL)


LIBRARY_LINGER = """
import json, sys, time
from egressbox import run_sync

script = sys.argv[1]
started = time.monotonic()
result = run_sync(["/bin/sh", "-c", script], policy=None, capture_output=True,
                  profile="unrestricted")
print(json.dumps({"code": result.exit_code, "elapsed": time.monotonic() - started,
                  "stderr": result.stderr.decode(errors="replace")}))
"""


def test_captured_output_is_not_held_by_a_grandchild(box: Box) -> None:
    pid_file = box.workspace / "linger-library.pid"
    script = f"sleep {LINGER_S} >/dev/null </dev/null & echo $! > {pid_file}; echo bye >&2; exit 3"
    try:
        done = box.run([box.actor.python, "-c", LIBRARY_LINGER, script])
        assert done.returncode == 0, _explain(done)
        seen = json.loads(done.stdout)
        assert seen["code"] == 3 and seen["stderr"] == "bye\n", seen
        assert seen["elapsed"] < LINGER_BOUND_S, seen
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text(encoding="ascii")), signal.SIGKILL)


PTY_CHILD = """
import os, sys
size = os.get_terminal_size(2)
print(os.isatty(2), size.columns, size.lines, flush=True)
os.write(2, b"one\\ntwo\\r\\n\\x1b[31mred\\x1b[0m\\x00\\xff")
"""


def test_a_terminal_stderr_reaches_the_child_as_a_pty(box: Box) -> None:
    master, slave = pty.openpty()
    try:
        tty.setraw(slave)  # so that what the parent writes arrives exactly
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 45, 123, 0, 0))
        policy = box.home / "deny-all.toml"
        policy.write_text("[egress]\nallow = []\n", encoding="utf-8")
        box.actor.own(policy, 0o644)
        argv = [*box.actor.egressbox, "run", "--quiet", "--policy", str(policy)]
        argv += ["--", box.actor.python, "-c", PTY_CHILD]
        command, env = box.actor.command(argv, box.actor.base_env(box.home))
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            env=env,
            cwd=box.workspace,
        )
        os.close(slave)
        slave = -1
        seen = _read_until_closed(master, proc)
        stdout = proc.stdout.read() if proc.stdout else b""
        assert proc.wait(timeout=RUN_TIMEOUT) == 0, (stdout, seen)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert stdout.split() == [b"True", b"123", b"45"], (stdout, seen)
    # The terminal relay's filter (runner/vtfilter.py) passes text, SGR and NUL as they are
    # and drops a byte that is no UTF-8 (0xff), which a terminal could read otherwise.
    assert seen == b"one\ntwo\r\n\x1b[31mred\x1b[0m\x00", seen


def _read_until_closed(master: int, proc: subprocess.Popen[bytes]) -> bytes:
    seen = b""
    deadline = time.monotonic() + PTY_READ_TIMEOUT
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every slave side is closed
                break
            if not data:
                break
            seen += data
        elif proc.poll() is not None:
            break
    return seen


WINCH_CHILD = """
import os, signal, time
sizes = []
signal.signal(signal.SIGWINCH, lambda *_: sizes.append(os.get_terminal_size(2)))
print("ready", os.get_terminal_size(2).columns, flush=True)
for _ in range(1000):
    if sizes:
        break
    time.sleep(0.01)
print("resized", sizes[-1].columns if sizes else 0, sizes[-1].lines if sizes else 0, flush=True)
"""


def test_a_new_window_size_reaches_the_childs_pty_before_sigwinch(tmp_path: Path) -> None:
    actor = invoking_actor()  # signals go to `egressbox run` itself, not through runuser
    master, slave = pty.openpty()
    try:
        tty.setraw(slave)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 10, 20, 0, 0))
        argv = [*actor.egressbox, "run", "--quiet", "--", actor.python, "-c", WINCH_CHILD]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            env=actor.base_env(tmp_path / "home"),  # the workspace is not the home directory
            cwd=tmp_path,
        )
        assert proc.stdout is not None
        try:
            assert proc.stdout.readline().split() == [b"ready", b"20"]
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 150, 0, 0))
            proc.send_signal(signal.SIGWINCH)
            assert proc.stdout.readline().split() == [b"resized", b"150", b"50"]
            assert proc.wait(timeout=RUN_TIMEOUT) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=RUN_TIMEOUT)
    finally:
        os.close(master)
        os.close(slave)


# -- evidence only: read, write, exec, connect and exit, in one table -----------------------------

# A name the policy does not admit; the proxy refuses it before any lookup (nothing leaves).
DENIED_HOST = "denied.egressbox.test"
# The proxy variables the run sets lead the request to the proxy, which answers 403.
FETCH = "import urllib.request; urllib.request.urlopen('http://{host}/', timeout=20)"


@dataclass(frozen=True)
class Case:
    """A confined command, its exit code, and the one refusal line expected (None: no line
    of egressbox's at all: the exit status says everything)."""

    argv: list[str]
    code: int
    line: str | None = None  # a fragment of the refusal line, with {key}, {outside}, {tool}
    hint: str | None = None  # a fragment of its hint


def _cases(box: Box) -> dict[str, Case]:
    tool = box.outside / "tool"
    return {
        # read: files the host lacks too are "not found", no boundary
        "read-missing-cat": Case(["cat", "/nonexistent.txt"], 1),
        "read-missing-python": Case([box.actor.python, "-c", "open('/nothere')"], 1),
        # ... even when its directory exists on the host only: "not found", no boundary
        "read-missing-ls": Case(
            ["ls", "/srv/egressbox-nothere"], 2, "; not found: /srv/egressbox-nothere ("
        ),
        # read: a credential path, refused whatever the grants
        "read-credential": Case(
            ["cat", str(box.key)], 1, f"refused by home_read: {box.key} (", "deny list"
        ),
        # write: outside the write roots, a new file: its directory is what admits it
        "write-outside": Case(
            ["touch", str(box.outside / "new.txt")],
            1,
            f"refused by write: {box.outside / 'new.txt'} (",
            f"--write-root {box.outside} admits it",
        ),
        # exec: a program the host has, outside every root (the shell cannot find it)
        "exec-outside": Case(
            ["/bin/sh", "-c", str(tool)],
            127,
            f"refused by read: {tool} (",
            f"--read-root {tool} admits it",
        ),
        # connect: a destination the policy does not admit, denied by the proxy
        "connect-denied": Case(
            [box.actor.python, "-c", FETCH.format(host=DENIED_HOST)],
            1,
            f"refused by egress: {DENIED_HOST}:80 (",
        ),
        # exit: the command's own status, and nothing else
        "exit-false": Case(["false"], 1),
        "exit-3": Case(["/bin/sh", "-c", "exit 3"], 3),
        "exit-sigint": Case(["/bin/sh", "-c", "kill -INT $$"], 130),
        "exit-not-found": Case(["/bin/sh", "-c", "egressbox-no-such-command"], 127),
    }


@pytest.mark.parametrize(
    "name",
    [
        "read-missing-cat",
        "read-missing-python",
        "read-missing-ls",
        "read-credential",
        "write-outside",
        "exec-outside",
        "connect-denied",
        "exit-false",
        "exit-3",
        "exit-sigint",
        "exit-not-found",
    ],
)
def test_a_refusal_line_only_with_evidence(box: Box, name: str) -> None:
    assert not Path("/srv/egressbox-nothere").exists()
    if name == "read-missing-ls" and not Path("/srv").is_dir():
        pytest.skip("/srv does not exist on this host")
    tool = box.outside / "tool"
    shutil.copy("/bin/true", tool)
    box.actor.own(tool, 0o755)
    case = _cases(box)[name]
    done = box.egressbox("--read-root", str(box.home), "--", *case.argv)
    assert done.returncode == case.code, _explain(done)
    err = _text(done.stderr)
    if case.line is None:
        assert "egressbox:" not in err, _explain(done)
        return
    if "; not found: " in case.line:
        assert "refused by" not in err, _explain(done)  # no boundary named
        lines = [line for line in err.splitlines() if "; not found: " in line]
        assert len(lines) == 1, _explain(done)
        line = lines[0]
    else:
        line = _refusal_line(done)
    assert case.line in line, line
    if case.hint is not None:
        assert case.hint in line, line
    # No hint opens the root or the home directory (or one of its parents).
    for flag in ("--read-root", "--write-root"):
        for wide in ("/", str(box.home), str(box.home.parent)):
            assert f"{flag} {wide} " not in line, line
    if name == "write-outside":
        assert not (box.outside / "new.txt").exists()  # judged on the host


def test_a_namespace_refused_by_seccomp_is_said(box: Box) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("util-linux unshare is not installed")
    done = box.egressbox("--", unshare, "-r", "true")
    assert done.returncode != 0, _explain(done)
    line = _refusal_line(done)
    assert "refused by seccomp (" in line and "new namespaces" in line, line


# -- no silent loss: the private file systems ------------------------------------------------


def test_a_write_on_the_private_tmp_is_named_at_any_depth(box: Box) -> None:
    """From a workspace below /tmp, a write beside it lands on the child's private /tmp: the
    run names it and says it was not kept; the host never gets it."""
    nested = box.workspace / "ws"
    nested.mkdir()
    box.actor.own(nested, 0o755)
    beside = box.workspace / "outside.txt"
    deep = box.workspace / "a" / "b"
    script = f"touch {beside} && mkdir -p {deep} && touch {deep}/c"
    done = box.egressbox("--", "/bin/sh", "-c", script, cwd=nested)
    assert done.returncode == 0, _explain(done)
    assert not beside.exists() and not (box.workspace / "a").exists()
    notes = [line for line in _text(done.stderr).splitlines() if "egressbox: note:" in line]
    assert len(notes) == 1, _explain(done)
    assert str(beside) in notes[0] and str(box.workspace / "a") in notes[0], notes[0]
    assert "not kept" in notes[0], notes[0]
    # What it wrote in its workspace is the host's, and no note says otherwise.
    kept = box.egressbox("--", "touch", "kept.txt", cwd=nested)
    assert kept.returncode == 0 and (nested / "kept.txt").exists(), _explain(kept)
    assert "egressbox: note:" not in _text(kept.stderr), _explain(kept)


@pytest.mark.parametrize("private", ["/tmp", "/var/tmp", "/dev/shm"])
def test_a_workspace_the_child_gets_privately_is_refused(box: Box, private: str) -> None:
    if not Path(private).is_dir():
        pytest.skip(f"{private} does not exist here")
    policy = box.home / "deny-all.toml"
    policy.write_text("[egress]\nallow = []\n", encoding="utf-8")
    box.actor.own(policy, 0o644)
    argv = [*box.actor.egressbox, "run", "--report", "--policy", str(policy), "--", "true"]
    done = box.run(argv, cwd=Path(private))
    assert done.returncode == 122, _explain(done)  # EXIT_CWD_UNAVAILABLE
    err = _text(done.stderr)
    assert f"{private} is a directory the command gets privately" in err, err
    assert f"workspace: {private} (read+write" not in err, err


LIBRARY_REFUSED = """
import json, sys
import egressbox

try:
    egressbox.run_sync(["true"], policy=None, cwd=sys.argv[1])
except egressbox.RunRefusedError as exc:
    print(json.dumps({"cause": exc.cause, "code": exc.code, "messages": exc.messages}))
result = egressbox.run_sync(["true"], policy=None, cwd=sys.argv[2])
print(json.dumps({"profile": result.profile, "refusal": result.refusal is None}))
"""


def test_the_library_gets_a_typed_refusal_and_the_profile(box: Box) -> None:
    done = box.run([box.actor.python, "-c", LIBRARY_REFUSED, "/tmp", str(box.workspace)])
    assert done.returncode == 0, _explain(done)
    refused, ran = (json.loads(line) for line in _text(done.stdout).splitlines())
    assert refused["cause"] == "private_directory" and refused["code"] == 122, refused
    assert ran["profile"] and ran["refusal"], ran  # the profile confined under; no refusal
