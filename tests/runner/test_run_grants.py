"""Profiles and grants as Harn's documents say, in real confined runs judged from the host.

Each test runs `egressbox run` as the invoking user and as an unprivileged one (the `actor`
fixture), makes the attempt a hostile or ordinary command would make, and judges afterwards
what the host saw: a listener's accept count, a file on disk, the run's stderr lines.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from egressbox.runner.facts import host_facts
from unprivileged import Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    # The first test as the unprivileged user may build its venv (pip install) once.
    pytest.mark.timeout(900),
]

# One `egressbox run` (start-up, the command, the proxy's shutdown); generous for CI.
RUN_TIMEOUT = 120.0
# The line an unconfined run says once (runner/assemble.py UNCONFINED_FILES).
UNCONFINED = "no filesystem rules"


@dataclass
class Box:
    actor: Actor
    workspace: Path
    home: Path

    def run(
        self, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        environment = {**self.actor.base_env(self.home), **(env or {})}
        command, environment = self.actor.command(argv, environment)
        return subprocess.run(
            command,
            capture_output=True,
            env=environment,
            cwd=self.workspace,
            timeout=RUN_TIMEOUT,
            check=False,
        )

    def egressbox(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        return self.run([*self.actor.egressbox, "run", "--quiet", *args], env)

    def python(
        self, code: str, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[bytes]:
        """`egressbox run ARGS -- python -c CODE`."""
        return self.egressbox(*args, "--", self.actor.python, "-c", textwrap.dedent(code), env=env)


@pytest.fixture
def box(actor: Actor) -> Iterator[Box]:
    made = [
        actor.make_dir("/tmp", "egressbox-grants-ws-"),
        actor.make_dir("/tmp", "egressbox-grants-home-"),
    ]
    try:
        yield Box(actor, made[0], made[1])
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def confined() -> None:
    facts = host_facts()
    for needed in ("mount_namespace", "landlock"):
        if needed not in facts.available:
            pytest.skip(f"needs {needed}: {dict(facts.status)}")


def _explain(done: subprocess.CompletedProcess[bytes]) -> str:
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    return f"exit {done.returncode}\nstdout: {out[-2000:]}\nstderr: {err[-3000:]}"


def _lines(done: subprocess.CompletedProcess[bytes]) -> dict[str, str]:
    found = {}
    for line in done.stdout.decode(errors="replace").splitlines():
        label, _, rest = line.partition(" ")
        found[label] = rest
    return found


class _Listener:
    """A host's unix socket listener that counts what it accepted (never blocks)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o777)  # the unprivileged actor may connect as far as DAC goes
        self.sock.listen(8)
        self.sock.setblocking(False)

    def accepted(self) -> int:
        count = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                conn, _ = self.sock.accept()
                conn.close()
                count += 1
        return count

    def close(self) -> None:
        self.sock.close()


# -- unix sockets: socket roots bind and connect, read roots nothing ----------------------

# A parent directory outside the private temporary directories, made once.
OUTSIDE_TEMP = Path("/var/lib/egressbox-grants")


def _outside_temp() -> Path:
    OUTSIDE_TEMP.mkdir(mode=0o755, exist_ok=True)
    return OUTSIDE_TEMP


SOCKETS_PROBE = """
import os, socket, sys
read_sock, root_sock, own = sys.argv[1:4]
def connect(label, path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        print(label, "connected")
    except OSError as exc:
        print(label, "refused", exc.errno)
    finally:
        s.close()
connect("read_root", read_sock)
connect("socket_root", root_sock)
server = socket.socket(socket.AF_UNIX)
try:
    server.bind(own)
    server.listen(1)
    client = socket.socket(socket.AF_UNIX)
    client.connect(own)
    conn, _ = server.accept()
    client.sendall(b"ping")
    print("own", "echo" if conn.recv(4) == b"ping" else "silent")
except OSError as exc:
    print("own", "refused", exc.errno)
try:
    with open(os.path.join(os.path.dirname(own), "planted.txt"), "w") as f:
        f.write("x")
    print("write", "ok")
except OSError as exc:
    print("write", "refused", exc.errno)
"""


def test_socket_roots_admit_bind_and_connect_read_roots_no_socket(box: Box, confined: None) -> None:
    shared = box.actor.make_dir("/tmp", "egressbox-grants-read-")
    # Outside /tmp and /var/tmp, whose private views are writable as a whole: a socket root
    # there is connect only (a bind would need a read-write bind that Landlock cannot narrow).
    sockets = box.actor.make_dir(_outside_temp(), "egressbox-grants-sock-")
    listeners = [_Listener(shared / "host.sock"), _Listener(sockets / "host.sock")]
    own = sockets / "own.sock"
    try:
        done = box.egressbox(
            "--read-root",
            str(shared),
            "--unix-socket-root",
            str(sockets),
            "--",
            box.actor.python,
            "-c",
            SOCKETS_PROBE,
            str(shared / "host.sock"),
            str(sockets / "host.sock"),
            str(own),
        )
        assert done.returncode == 0, _explain(done)
        seen = _lines(done)
        # Judged at the listeners: the read root's socket never saw a connection.
        assert listeners[0].accepted() == 0, _explain(done)
        assert listeners[1].accepted() == 1, _explain(done)
        assert seen["read_root"].startswith("refused"), _explain(done)
        assert seen["own"] == "echo", _explain(done)
        # The socket the command bound is the host's file; nothing else was written there.
        assert stat.S_ISSOCK(os.lstat(own).st_mode)
        assert not (sockets / "planted.txt").exists()
        assert seen["write"].startswith("refused"), _explain(done)
    finally:
        for listener in listeners:
            listener.close()
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)


def test_a_socket_in_the_workspace_is_not_reachable(box: Box, confined: None) -> None:
    """A host daemon's socket inside the workspace (a write root): not a socket root, so it
    does not accept the command (staged: the overlay's socket inode is not the daemon's)."""
    listener = _Listener(box.workspace / "daemon.sock")
    try:
        done = box.python(
            """
            import socket
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect("daemon.sock")
                print("daemon connected")
            except OSError as exc:
                print("daemon refused", exc.errno)
            """
        )
        assert done.returncode == 0, _explain(done)
        assert listener.accepted() == 0, _explain(done)
        assert _lines(done)["daemon"].startswith("refused"), _explain(done)
    finally:
        listener.close()


# -- unrestricted / --no-sandbox / EGRESSBOX_SANDBOX=off ------------------------------------

READ_HOME_FILE = """
import sys
try:
    print("read", open(sys.argv[1]).read())
except OSError as exc:
    print("read", "refused", exc.errno)
"""


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (("--no-sandbox",), {}),
        (("--profile", "unrestricted"), {}),
        ((), {"EGRESSBOX_SANDBOX": "off"}),
    ],
    ids=["no-sandbox", "unrestricted", "sandbox-off"],
)
def test_unconfined_files_are_said_once_and_mean_it(
    box: Box, flags: tuple[str, ...], env: dict[str, str]
) -> None:
    secret = box.home / "notes.txt"  # outside every root
    secret.write_text("visible")
    box.actor.own(secret, 0o600)
    done = box.egressbox(*flags, "--", box.actor.python, "-c", READ_HOME_FILE, str(secret), env=env)
    assert done.returncode == 0, _explain(done)
    assert _lines(done)["read"] == "visible", _explain(done)
    said = [line for line in done.stderr.decode().splitlines() if UNCONFINED in line]
    assert len(said) == 1, _explain(done)
    assert "the network boundary stays" in said[0]
    # The same read under the default profile is refused.
    confined = box.egressbox("--", box.actor.python, "-c", READ_HOME_FILE, str(secret))
    if "mount_namespace" in host_facts().available:
        assert _lines(confined)["read"].startswith("refused"), _explain(confined)
    assert UNCONFINED not in confined.stderr.decode(), _explain(confined)


def test_no_sandbox_refuses_root_flags(box: Box) -> None:
    for flag in ("--write-root", "--sandbox-write-root", "--read-only-root", "--sandbox-read-root"):
        done = box.egressbox("--no-sandbox", flag, str(box.workspace), "--", "true")
        assert done.returncode == 2, _explain(done)
        assert b"--no-sandbox refuses" in done.stderr, _explain(done)


# -- allow_tcp_loopback ----------------------------------------------------------------------

LOOPBACK_PROBE = """
import socket
try:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname(), timeout=5)
    conn, _ = server.accept()
    client.sendall(b"hi")
    print("loopback", "echo" if conn.recv(2) == b"hi" else "silent")
except OSError as exc:
    print("loopback", "refused", exc.errno)
"""


def test_allow_tcp_loopback_key_works_like_the_flag(box: Box) -> None:
    if "network_namespace" not in host_facts().available:
        pytest.skip("--allow-loopback needs a network namespace")
    granted = box.home / "loopback.toml"
    granted.write_text("[egress]\nallow = []\n[process]\nallow_tcp_loopback = true\n")
    plain = box.home / "plain.toml"
    plain.write_text("[egress]\nallow = []\n")
    for path in (granted, plain):
        box.actor.own(path, 0o644)
    by_key = box.python(LOOPBACK_PROBE, "--policy", str(granted))
    by_flag = box.python(LOOPBACK_PROBE, "--policy", str(plain), "--allow-process-loopback")
    neither = box.python(LOOPBACK_PROBE, "--policy", str(plain))
    assert _lines(by_key)["loopback"] == "echo", _explain(by_key)
    assert _lines(by_flag)["loopback"] == "echo", _explain(by_flag)
    assert _lines(neither)["loopback"].startswith("refused"), _explain(neither)


# -- process write roots obey a read-only workspace ---------------------------------------


def test_process_write_root_is_read_only_under_a_read_only_workspace(
    box: Box, confined: None
) -> None:
    cache = box.actor.make_dir("/tmp", "egressbox-grants-cache-")
    write = f"open({str(cache / 'f')!r}, 'w').write('x')"
    code = f"""
    try:
        {write}
        print("cache", "written")
    except OSError as exc:
        print("cache", "refused", exc.errno)
    """
    try:
        held = box.python(code, "--read-only-workspace", "--sandbox-write-root", str(cache))
        assert held.returncode == 0, _explain(held)
        assert not (cache / "f").exists(), _explain(held)
        assert _lines(held)["cache"].startswith("refused"), _explain(held)
        free = box.python(code, "--sandbox-write-root", str(cache))
        assert (cache / "f").read_text() == "x", _explain(free)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# -- a nested run refuses roots outside its parent's --------------------------------------


def _package_root(box: Box) -> str:
    code = "import egressbox, pathlib; print(pathlib.Path(egressbox.__file__).resolve().parents[1])"
    done = box.run([box.actor.python, "-c", code])
    assert done.returncode == 0, _explain(done)
    return done.stdout.decode().strip()


def test_nested_run_refuses_a_root_outside_its_parent_before_it_starts(
    box: Box, confined: None
) -> None:
    outside = box.actor.make_dir(_outside_temp(), "egressbox-grants-outside-")
    started = ["/bin/sh", "-c", "echo inner-started"]
    package = _package_root(box)
    try:
        inner = [*box.actor.egressbox, "run", "--quiet", "--read-root", str(outside), "--"]
        done = box.egressbox("--allow-loopback", "--read-root", package, "--", *inner, *started)
        assert done.returncode != 0, _explain(done)
        assert b"nested in another egressbox run" in done.stderr, _explain(done)
        assert str(outside).encode() in done.stderr, _explain(done)
        assert b"inner-started" not in done.stdout, _explain(done)
        # Inside the parent's roots the same nested run starts.
        inner_ok = [*box.actor.egressbox, "run", "--quiet", "--read-root", package, "--"]
        ok = box.egressbox("--allow-loopback", "--read-root", package, "--", *inner_ok, *started)
        assert ok.returncode == 0, _explain(ok)
        assert ok.stdout == b"inner-started\n", _explain(ok)
    finally:
        shutil.rmtree(outside, ignore_errors=True)
