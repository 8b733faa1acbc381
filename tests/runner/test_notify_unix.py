"""Unix sockets where namespaces are refused: the connect supervisor admits only the grants.

Without a mount namespace the command sees the host's whole tree, and Landlock does not
cover connect(2) to a pathname socket: the supervisor (src/egressbox/runner/notify.py) is the
wall. `egressbox run` starts under tests/no_namespaces.py's filter (a container's seccomp
profile), as root and as the unprivileged test user; the command connects to host listeners
the test made with mode 0777 (so file permissions alone would let it in) and each listener
says what reached it: one outside every grant, one in the workspace that was live before the
run, a symlink in the workspace to the outside one, and an abstract name get nothing; one in
a `--unix-socket-root` and one the workspace gains during the run (a server the command
would start itself) get the payload.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressbox.confine import notify
from recording import Recording
from unprivileged import Actor, UnavailableError, invoking_actor, unprivileged_actor

pytest.importorskip("pyseccomp")
WHY = notify.support()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "supported")
RUN_TIMEOUT = 60  # seconds for one confined run (start-up is ~0.1 s)
NO_NAMESPACES = Path(__file__).resolve().parents[1] / "no_namespaces.py"
STATE_ROOT = Path(os.environ.get("EGRESSBOX_TEST_STATE_ROOT", "/root"))
CHILD_PYTHON = "/usr/bin/python3"  # readable by every user

# Says it started, waits for the host's word, then connects to each NAME=PATH it was given
# (@NAME: an abstract name) and sends its name.
CHILD = textwrap.dedent(
    """
    import socket, sys
    print("READY", flush=True)
    sys.stdin.readline()
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(3)
        try:
            s.connect("\\0" + path[1:] if path.startswith("@") else path)
            s.sendall(b"payload:" + name.encode())
            print("CONNECTED", name, flush=True)
        except OSError as exc:
            print("REFUSED", name, exc.errno, flush=True)
        s.close()
    """
)


def _unix_listener(address: str) -> Recording:
    """A unix listener (a path made mode 0777, or an abstract name) that records what every
    connection it accepts sends."""
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(address)
    if not address.startswith("\0"):
        os.chmod(address, 0o777)
    sock.listen(8)
    return Recording(sock)


@pytest.fixture(params=["root", "unprivileged"])
def actor(request: pytest.FixtureRequest) -> Actor:
    if request.param == "root":
        return invoking_actor()
    try:
        return unprivileged_actor()
    except UnavailableError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def public_dirs() -> Iterator[tuple[Path, Path]]:
    """Two fresh directories outside every grant, mode 0777: one for the outside socket, one
    to be granted as a socket root."""
    made = [Path(tempfile.mkdtemp(prefix=f"egressbox-unix-{n}-", dir="/var/tmp")) for n in "og"]
    for path in made:
        os.chmod(path, 0o777)
    try:
        yield made[0], made[1]
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def test_unix_connects_reach_only_what_the_grants_hold(
    actor: Actor, public_dirs: tuple[Path, Path]
) -> None:
    outside_dir, granted_dir = public_dirs
    top = actor.make_dir("/tmp", "egressbox-notify-unix-")
    work = actor.make_dir(top, "work-")
    state = actor.state_dir() if actor.runuser else STATE_ROOT / ".egressbox-test-notify-unix"
    (top / "child.py").write_text(CHILD)
    os.chmod(top / "child.py", 0o644)
    wrapper = top / NO_NAMESPACES.name
    shutil.copy(NO_NAMESPACES, wrapper)
    os.chmod(wrapper, 0o644)
    abstract = f"egressbox-test-{os.getpid()}-{actor.uid}"
    listeners = {
        "outside": _unix_listener(str(outside_dir / "daemon.sock")),
        "granted": _unix_listener(str(granted_dir / "agent.sock")),
        "before": _unix_listener(str(work / "before.sock")),
        "abstract": _unix_listener("\0" + abstract),
    }
    os.symlink(outside_dir / "daemon.sock", work / "link.sock")
    targets = {
        "outside": str(outside_dir / "daemon.sock"),
        "granted": str(granted_dir / "agent.sock"),
        "before": "before.sock",
        "link": str(work / "link.sock"),
        "after": str(work / "after.sock"),
        "after_relative": "after.sock",
        "abstract": "@" + abstract,
    }
    env = actor.base_env(top) | {"EGRESSBOX_STATE_DIR": str(state), "EGRESSBOX_PURE": "1"}
    if not actor.runuser and "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    run = ["run", "--report", "--read-root", str(top), "--unix-socket-root", str(granted_dir)]
    run += ["--", CHILD_PYTHON, str(top / "child.py"), *(f"{k}={v}" for k, v in targets.items())]
    argv, env = actor.command([actor.python, str(wrapper), *actor.egressbox, *run], env)
    proc = subprocess.Popen(
        argv, cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        if first.strip() != "READY":
            proc.kill()
            pytest.fail(f"the command did not start: {first!r} {proc.communicate()[1]}")
        # A socket the workspace gains during the run, as the command's own server's would.
        listeners["after"] = _unix_listener(str(work / "after.sock"))
        actor.own(work / "after.sock")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for listener in listeners.values():
            listener.close()
        shutil.rmtree(top, ignore_errors=True)
        if not actor.runuser:
            shutil.rmtree(state, ignore_errors=True)
    assert "network_namespace: none" in err and "mount_namespace: none" in err, err
    received = {name: listener.accepted for name, listener in listeners.items()}
    assert received["outside"] == [], (received, out)  # neither directly nor by the symlink
    assert received["before"] == [], (received, out)
    assert received["abstract"] == [], (received, out)
    assert received["granted"] == [b"payload:granted"], (received, out, err)
    assert sorted(received["after"]) == [b"payload:after", b"payload:after_relative"], (
        received, out, err,
    )  # fmt: skip
    refused = {line.split()[1]: line.split()[2] for line in out.splitlines() if "REFUSED" in line}
    assert refused == {"outside": "13", "before": "13", "link": "13", "abstract": "1"}, out
    # The user is told, once, at the end: the count of the refusals by the grants (the
    # outside socket, the live one in the workspace, the symlink; not the abstract name) and
    # the first path as the command gave it.
    said = [line for line in err.splitlines() if "outside the grants" in line]
    assert said == [
        f"egressbox: refused 3 connects to unix sockets outside the grants (first: "
        f"{targets['outside']}); --unix-socket-root DIR admits a directory's sockets"
    ], err


@pytest.mark.parametrize("quiet", [False, True], ids=["no-refusal", "quiet"])
def test_no_line_without_refusals_or_with_quiet(
    public_dirs: tuple[Path, Path], quiet: bool
) -> None:
    """A run whose unix connects all reach granted sockets says nothing of them; nor does
    a --quiet run, refused or not (its refusal still reaches the command as EACCES)."""
    actor = invoking_actor()
    outside_dir, granted_dir = public_dirs
    top = Path(tempfile.mkdtemp(prefix="egressbox-notify-unix-", dir="/tmp"))
    (top / "child.py").write_text(CHILD)
    (top / "work").mkdir()
    listener = _unix_listener(str(granted_dir / "agent.sock"))
    outside = _unix_listener(str(outside_dir / "daemon.sock"))
    env = actor.base_env(top) | {
        "EGRESSBOX_STATE_DIR": str(STATE_ROOT / ".egressbox-test-notify-unix-quiet"),
        "EGRESSBOX_PURE": "1",
    }
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    run = ["run", "--report", "--read-root", str(top), "--unix-socket-root", str(granted_dir)]
    run += ["--quiet"] if quiet else []
    run += ["--", CHILD_PYTHON, str(top / "child.py"), f"granted={granted_dir / 'agent.sock'}"]
    run += [f"outside={outside_dir / 'daemon.sock'}"] if quiet else []
    argv, env = actor.command([actor.python, str(NO_NAMESPACES), *actor.egressbox, *run], env)
    try:
        proc = subprocess.run(
            argv, check=False, cwd=top / "work", env=env, input="go\n", capture_output=True,
            text=True, timeout=RUN_TIMEOUT,
        )  # fmt: skip
    finally:
        listener.close()
        outside.close()
        shutil.rmtree(top, ignore_errors=True)
        shutil.rmtree(STATE_ROOT / ".egressbox-test-notify-unix-quiet", ignore_errors=True)
    assert listener.accepted == [b"payload:granted"], (proc.stdout, proc.stderr)
    assert outside.accepted == [], (proc.stdout, proc.stderr)
    assert ("REFUSED outside 13" in proc.stdout) is quiet, proc.stdout
    assert "outside the grants" not in proc.stderr, proc.stderr


def test_the_refused_path_is_shown_escaped() -> None:
    """The path comes from the command: a control character or a byte that is not UTF-8
    cannot reach the terminal as itself (no forged line, no cursor move)."""
    from egressbox.runner.notify import printable_path

    assert printable_path("/run/dökcer.sock".encode()) == "/run/dökcer.sock"
    shown = printable_path(b"/tmp/a\negressbox: forged\x1b[2J\xff.sock")
    assert shown == "/tmp/a\\negressbox: forged\\x1b[2J\\xff.sock"
    assert shown.isprintable()
