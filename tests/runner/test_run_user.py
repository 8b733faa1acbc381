"""`sudo egressbox run --user NAME -- CMD`: root sets the run up, the command runs as NAME.

Run as root with the unprivileged test user (tests/unprivileged.py). Judged on the host after
the run: what the command wrote (files, directories, a symbolic link, applied through the staged
layer's gate, renamed or copied) is owned by NAME; `id -u` printed NAME's uid; a root-only file
in the workspace stayed unread. Without root, --user is refused with a message.
"""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressbox.core.errors import EgressboxError
from egressbox.runner.account import environment, lookup
from unprivileged import BASE_DIR, TEST_USER, UnavailableError, ensure_user

RUN_TIMEOUT = 120.0
SECRET = "root-only-secret-4c1d"


@pytest.fixture
def account() -> tuple[int, int]:
    if os.geteuid() != 0:
        pytest.skip("--user needs egressbox started as root")
    try:
        return ensure_user(TEST_USER)
    except UnavailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def places(account: tuple[int, int]) -> Iterator[tuple[Path, Path]]:
    """A workspace NAME owns, in a directory NAME can reach (not under root's 0700 temp), and
    egressbox's state outside every root."""
    BASE_DIR.mkdir(parents=True, exist_ok=True)
    os.chmod(BASE_DIR, 0o755)
    top = Path(tempfile.mkdtemp(prefix="run-user-", dir=BASE_DIR))
    os.chmod(top, 0o755)
    workspace, state = top / "ws", top / "state"
    workspace.mkdir()
    (workspace / "sub").mkdir()
    for path in (workspace, workspace / "sub"):
        os.chown(path, *account)
    secret = workspace / "secret.txt"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)  # root's own, inside NAME's workspace
    try:
        yield workspace, state
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _run(workspace: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}
    env["EGRESSBOX_STATE_DIR"] = str(state)
    if "EGRESSBOX_PURE" in os.environ:
        env["EGRESSBOX_PURE"] = os.environ["EGRESSBOX_PURE"]
    return subprocess.run(
        [sys.executable, "-m", "egressbox", "run", "--quiet", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=workspace,
        stdin=subprocess.DEVNULL,
        timeout=RUN_TIMEOUT,
        check=False,
    )


SCRIPT = (
    "id -u > uid.txt; id -G > groups.txt; echo $HOME > home.txt; "
    "mkdir -p made/deep; echo x > made/deep/file; echo y > sub/new; ln -s uid.txt link; "
    "cat secret.txt > leaked.txt 2>/dev/null; echo z > secret.txt 2>/dev/null; "
    "touch $TMPDIR/scratch-ok && echo ok > tmpdir.txt"
)


def _owned(path: Path, uid: int) -> bool:
    return os.lstat(path).st_uid == uid


@pytest.mark.parametrize("workspace_mode", ["staged", "direct"])
def test_the_command_runs_as_name_and_its_files_are_names(
    places: tuple[Path, Path], account: tuple[int, int], workspace_mode: str
) -> None:
    workspace, state = places
    uid, gid = account
    result = _run(
        workspace,
        state,
        "--workspace",
        workspace_mode,
        "--user",
        TEST_USER,
        "--",
        "sh",
        "-c",
        SCRIPT,
    )
    assert result.returncode == 0, result.stderr
    entry = pwd.getpwuid(uid)
    # Judged on the host: what the command printed about itself, and who owns what it made.
    assert (workspace / "uid.txt").read_text().split() == [str(uid)]
    assert str(gid) in (workspace / "groups.txt").read_text().split()
    assert "0" not in (workspace / "groups.txt").read_text().split()
    assert (workspace / "home.txt").read_text().strip() == entry.pw_dir
    for made in ("uid.txt", "made", "made/deep", "made/deep/file", "sub/new", "link"):
        assert _owned(workspace / made, uid), made
    assert os.readlink(workspace / "link") == "uid.txt"
    assert (workspace / "tmpdir.txt").read_text().strip() == "ok"
    # A root-only file in sight stayed unread and unchanged.
    assert SECRET not in (workspace / "leaked.txt").read_text()
    assert (workspace / "secret.txt").read_text() == SECRET
    assert _owned(workspace / "secret.txt", 0)


WRAPPER = Path(__file__).resolve().parents[1] / "no_namespaces.py"
# The command: connects to each unix socket named, says what happened.
UNIX_CLIENT = """
import socket, sys
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        s.sendall(b"from the command")
        print("connected", path, flush=True)
    except OSError as exc:
        print("refused", path, exc.errno, flush=True)
    s.close()
"""


def _unix_listener(path: Path, owner: tuple[int, int], mode: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    os.chown(path, *owner)
    os.chmod(path, mode)
    sock.listen(4)
    sock.settimeout(0.5)
    return sock


def _received(sock: socket.socket) -> bytes:
    try:
        conn, _ = sock.accept()
    except TimeoutError:
        return b""
    with conn:
        conn.settimeout(2)
        return conn.recv(100)


def test_the_connect_supervisor_connects_unix_sockets_with_names_rights(
    places: tuple[Path, Path], account: tuple[int, int]
) -> None:
    """Where no namespace can be made (a container's seccomp profile, tests/no_namespaces.py)
    `run --user NAME` falls back to the connect supervisor in root's `run`, which makes the
    command's connects itself: a unix socket only root may use (0600, root's), under a
    granted socket root, must stay out of the command's reach; one NAME may use must work.
    (Both live before the run, so they are the host's: only a socket root admits them.)
    Judged by the listeners."""
    workspace, state = places
    (workspace / "client.py").write_text(UNIX_CLIENT)
    sockets = workspace.parent / "sockets"
    sockets.mkdir(mode=0o755)
    root_only = _unix_listener(sockets / "root.sock", (0, 0), 0o600)
    names = _unix_listener(sockets / "name.sock", account, 0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}
    env |= {"EGRESSBOX_STATE_DIR": str(state), "EGRESSBOX_PURE": "1"}
    argv = [sys.executable, str(WRAPPER), sys.executable, "-m", "egressbox", "run", "--report"]
    argv += ["--user", TEST_USER, "--unix-socket-root", str(sockets), "--"]
    argv += ["/usr/bin/python3", "client.py", str(sockets / "root.sock")]
    argv += [str(sockets / "name.sock")]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, env=env, cwd=workspace,
            stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT, check=False,
        )  # fmt: skip
        got_root, got_name = _received(root_only), _received(names)
    finally:
        root_only.close()
        names.close()
    assert done.returncode == 0, done.stderr
    assert "network_namespace: none" in done.stderr and "connect supervisor" in done.stderr
    assert got_root == b"", "the command reached root's 0600 socket through the supervisor"
    assert f"refused {sockets / 'root.sock'} {errno.EACCES}" in done.stdout, done.stdout
    assert got_name == b"from the command", done.stdout
    assert f"connected {sockets / 'name.sock'}" in done.stdout, done.stdout


def test_the_report_says_who_the_command_ran_as(
    places: tuple[Path, Path], account: tuple[int, int]
) -> None:
    workspace, state = places
    result = _run(workspace, state, "--report", "--user", TEST_USER, "--", "true")
    assert result.returncode == 0, result.stderr
    assert "network_boundary: full" in result.stderr
    assert "capabilities: full" in result.stderr


def test_user_is_refused_without_root() -> None:
    with pytest.raises(EgressboxError, match=r"--user nobody needs egressbox started as root"):
        lookup("nobody", euid=1000)


def test_unknown_user_and_root_are_refused() -> None:
    with pytest.raises(EgressboxError, match="no such user"):
        lookup("egressbox-no-such-user-x", euid=0)
    with pytest.raises(EgressboxError, match="is uid 0"):
        lookup("root", euid=0)


def test_the_environment_is_names() -> None:
    account = lookup("nobody", euid=0)
    env = environment({"HOME": "/root", "USER": "root", "XDG_CACHE_HOME": "/root/.cache"}, account)
    assert env["HOME"] == account.home
    assert env["USER"] == env["LOGNAME"] == "nobody"
    assert "XDG_CACHE_HOME" not in env


def test_user_without_cap_sys_admin_is_refused_with_the_reason(
    places: tuple[Path, Path], account: tuple[int, int]
) -> None:
    """Root without CAP_SYS_ADMIN (dropped for real) makes its namespaces in a user namespace
    of its own, where only uid 0 is mapped: NAME could not be become there, so --user is
    refused with the reason and the command never runs."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed")
    workspace, state = places
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}
    env |= {"EGRESSBOX_STATE_DIR": str(state), "EGRESSBOX_PURE": "1"}
    drop = ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", "--"]
    run = [sys.executable, "-m", "egressbox", "run", "--user", TEST_USER, "--", "touch", "ran"]
    done = subprocess.run(
        [*drop, *run],
        capture_output=True, text=True, env=env, cwd=workspace, stdin=subprocess.DEVNULL,
        timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 126, done.stderr
    assert "--user needs CAP_SYS_ADMIN" in done.stderr
    assert not (workspace / "ran").exists()
