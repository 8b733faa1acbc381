"""systemd's protocols, spoken by `serve`: socket activation (LISTEN_FDS, LISTEN_PID,
LISTEN_FDNAMES from a parent that passes listening sockets as descriptors 3...) and readiness
(READY=1 with the ready line, STOPPING=1 on the drain, datagrams on NOTIFY_SOCKET). The parent
here is a small Python launcher that does what systemd does before it execs serve."""

from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from egressbox.serve.systemd import ActivationError, Notifier, _kinds, listen_fds
from serving import IO_TIMEOUT, admin_get, connect_through, policy_text, serving, write_atomically

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="serve is tested on Linux")

# What systemd does for a socket-activated service, in the exec'd process's terms: the
# listening sockets become descriptors 3, 4, ... and LISTEN_PID names the process itself.
LAUNCHER = textwrap.dedent(
    """
    import fcntl, os, sys
    fds = [int(fd) for fd in os.environ.pop("TEST_FDS").split(",") if fd]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
    for offset, fd in enumerate(high):
        os.dup2(fd, 3 + offset)
        os.close(fd)
    os.environ["LISTEN_FDS"] = str(len(fds))
    if os.environ.pop("TEST_PID_MISMATCH", ""):
        os.environ["LISTEN_PID"] = "1"
    else:
        os.environ["LISTEN_PID"] = str(os.getpid())
    names = os.environ.pop("TEST_FDNAMES", None)
    if names is not None:
        os.environ["LISTEN_FDNAMES"] = names
    os.execv(sys.argv[1], sys.argv[1:])
    """
)


def launcher() -> list[str]:
    return [sys.executable, "-c", LAUNCHER]


def listener() -> socket.socket:
    sock = socket.create_server(("127.0.0.1", 0))
    return sock


def authority(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


class NotifySocket:
    """A fake NOTIFY_SOCKET: the datagrams serve sends, as lists of assignments."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(IO_TIMEOUT)

    def next(self) -> list[str]:
        return self.sock.recv(4096).decode().split("\n")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify")
    try:
        yield sock
    finally:
        sock.close()


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    path = tmp_path / "policy.toml"
    write_atomically(path, policy_text([]))
    return path


def activated_env(sockets: Sequence[socket.socket], names: str | None = None) -> dict[str, str]:
    env = {"TEST_FDS": ",".join(str(s.fileno()) for s in sockets)}
    if names is not None:
        env["TEST_FDNAMES"] = names
    return env


# -- the protocol, read -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "count", "kinds"),
    [
        ([], 2, ["http", "socks5"]),
        (["egressbox.socket"], 1, ["http"]),
        (["socks5", "http"], 2, ["socks5", "http"]),
        (["admin", "http", "socks5"], 3, ["admin", "http", "socks5"]),
    ],
)
def test_names_say_which_socket_is_which(names: list[str], count: int, kinds: list[str]) -> None:
    assert _kinds(names, count) == kinds


@pytest.mark.parametrize(
    ("names", "count"), [(["http"], 2), (["http", "http"], 2), (["http", "other"], 2)]
)
def test_names_that_do_not_add_up_are_refused(names: list[str], count: int) -> None:
    with pytest.raises(ActivationError):
        _kinds(names, count)


def test_variables_for_another_process_are_ignored_and_removed() -> None:
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "http"}
    assert listen_fds(env) == {}
    assert env == {}
    assert listen_fds({}) == {}
    with pytest.raises(ActivationError, match="LISTEN_FDS"):
        listen_fds({"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "9"})


def test_the_notifier_sends_datagrams_to_a_path_or_an_abstract_name(tmp_path: Path) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "n")}
    receiver = NotifySocket(tmp_path / "n")
    try:
        notifier = Notifier.from_environ(env)
        assert "NOTIFY_SOCKET" not in env  # nothing serve starts may notify
        assert notifier.notify("READY=1", "STATUS=x")
        assert receiver.next() == ["READY=1", "STATUS=x"]
    finally:
        receiver.close()
    name = f"egressbox-test-{os.getpid()}-{time.monotonic_ns()}"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract.bind("\0" + name)
    abstract.settimeout(IO_TIMEOUT)
    try:
        assert Notifier(f"@{name}").notify("STOPPING=1")
        assert abstract.recv(100) == b"STOPPING=1"
    finally:
        abstract.close()
    assert not Notifier(None).notify("READY=1")
    assert not Notifier("vsock:2:1").notify("READY=1")  # not spoken here: ignored


# -- serve, activated ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_uses_the_passed_sockets_and_notifies(
    tmp_path: Path, policy: Path, notify: NotifySocket, workers: str
) -> None:
    http, socks, admin = listener(), listener(), listener()
    try:
        env = activated_env([admin, socks, http], "admin:socks5:http")
        env["NOTIFY_SOCKET"] = str(notify.path)
        with serving(
            tmp_path / "serve",
            "--policy",
            str(policy),
            "--workers",
            workers,
            env=env,
            launcher=launcher(),
            pass_fds=[http.fileno(), socks.fileno(), admin.fileno()],
        ) as proc:
            assert proc.ready["http"] == authority(http)
            assert proc.ready["socks5"] == authority(socks)
            assert proc.ready["admin"] == authority(admin)
            assert "READY=1" in notify.next()
            # Our copies close: only serve holds the listeners now.
            for sock in (http, socks, admin):
                sock.close()
            conn, status = connect_through(proc.address("http"), "denied.test:443")
            conn.close()
            assert status == 403
            assert admin_get(proc.ready["admin"], "/readyz")[0] == 200
            proc.send(signal.SIGTERM)
            assert "STOPPING=1" in notify.next()
            assert proc.wait() == 0
    finally:
        for sock in (http, socks, admin):
            sock.close()


def test_unnamed_sockets_are_http_then_socks5(tmp_path: Path, policy: Path) -> None:
    http, socks = listener(), listener()
    try:
        with serving(
            tmp_path / "serve",
            "--policy",
            str(policy),
            env=activated_env([http, socks]),
            launcher=launcher(),
            pass_fds=[http.fileno(), socks.fileno()],
        ) as proc:
            assert proc.ready == {
                "event": "ready",
                "http": authority(http),
                "socks5": authority(socks),
            }
    finally:
        http.close()
        socks.close()


def test_sockets_for_another_pid_are_not_taken(tmp_path: Path, policy: Path) -> None:
    http = listener()
    try:
        env = {**activated_env([http]), "TEST_PID_MISMATCH": "1"}
        with serving(
            tmp_path / "serve",
            "--policy",
            str(policy),
            env=env,
            launcher=launcher(),
            pass_fds=[http.fileno()],
        ) as proc:
            assert proc.ready["http"] != authority(http)  # its own, from the flags
    finally:
        http.close()


def test_a_socket_that_is_not_listening_exits_3(tmp_path: Path, policy: Path) -> None:
    bound = socket.socket()
    bound.bind(("127.0.0.1", 0))
    try:
        with serving(
            tmp_path / "serve",
            "--policy",
            str(policy),
            env=activated_env([bound], "http"),
            launcher=launcher(),
            pass_fds=[bound.fileno()],
            ready=False,
        ) as proc:
            assert proc.wait() == 3
            assert "socket activation: descriptor 3 (http) is not listening" in proc.stderr()
            assert proc.stdout() == ""
    finally:
        bound.close()
