"""The network boundary where namespaces are refused, reproduced here and judged on the host.

`egressbox run` (and `egressbox doctor`) start in an environment that keeps namespaces from
them: a seccomp filter refusing namespace creation (what Docker's default profile does to an
unprivileged container: tests/no_namespaces.py), as root and as the unprivileged test user; a
user namespace where `user.max_user_namespaces` is 0, with and without capabilities in it; one
where `user.max_net_namespaces` is 0; root without CAP_SYS_ADMIN (which must make a user
namespace first); a user namespace whose uid 0 holds no capability (a nested sandbox). The
command then makes the attacks a hostile child would make: a direct connect to the proxy's port
number on another loopback address, and to another listener; the listeners say whether anything
arrived.
Allowed traffic through HTTP_PROXY and a proxy-unaware curl must work and be audited, and
doctor, run in the same environment, must name what blocks namespaces.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from egressbox.confine import notify
from egressbox.net.original import Destinations
from recording import ORIGIN_ANSWER, Recording
from unprivileged import Actor, UnavailableError, invoking_actor, unprivileged_actor

pytest.importorskip("pyseccomp")
WHY = notify.support()
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "supported")
RUN_TIMEOUT = 60  # seconds for one confined run (start-up is ~0.1 s; the child waits on us)
DOCTOR_TIMEOUT = 60
NO_NAMESPACES = Path(__file__).resolve().parents[1] / "no_namespaces.py"
STATE_ROOT = Path(os.environ.get("EGRESSBOX_TEST_STATE_ROOT", "/root"))
CHILD_PYTHON = "/usr/bin/python3"  # readable by every user (a pyenv build under /root is not)
# Makes the user namespace's limit 0, then runs the rest of its arguments (sh -c's "$@").
ZERO_USERNS = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
ZERO_NETNS = 'echo 0 > /proc/sys/user/max_net_namespaces && exec "$@"'
# Leaves uid 0 without a capability: bounding, inheritable and ambient sets emptied.
NO_CAPS = ("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--")

# The command: says the proxy's port, waits for the host's word, then attacks and works.
CHILD = textwrap.dedent(
    """
    import os, select, socket, subprocess, sys, urllib.request
    port = int(os.environ["http_proxy"].rstrip("/").rsplit(":", 1)[1])
    print(port, flush=True)
    other, origin = (int(x) for x in sys.stdin.readline().split())
    for host, p in (("127.0.0.2", port), ("127.0.0.1", other), ("::1", other)):
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        s.settimeout(3)
        try:
            s.connect((host, p))
            s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
            print("ATTACK", host, p, s.recv(100), flush=True)
        except OSError as exc:
            print("ATTACK", host, p, "failed", exc.errno, flush=True)
        s.close()
    # A non-blocking connect: EINPROGRESS, then SO_ERROR 0 on the same socket.
    s = socket.socket()
    s.setblocking(False)
    print("NONBLOCK", s.connect_ex(("127.0.0.1", origin)), flush=True)
    select.select([], [s], [], 5)
    print("SOERROR", s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), flush=True)
    s.sendall(b"GET /nonblocking HTTP/1.0\\r\\n\\r\\n")
    select.select([s], [], [], 5)
    print("NONBLOCK-READ", s.recv(100)[:12], flush=True)
    s.close()
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        print("UDP made", flush=True)
    except OSError as exc:
        print("UDP", exc.errno, flush=True)
    body = urllib.request.urlopen(f"http://localhost:{origin}/via-proxy", timeout=10).read()
    print("PROXY", body, flush=True)
    curl = subprocess.run(["curl", "-sS", "--noproxy", "*", "-m", "10",
                           f"http://localhost:{origin}/captured"], capture_output=True)
    print("CURL", curl.returncode, curl.stdout, flush=True)
    """
)


def _tcp_listener(host: str, port: int = 0) -> Recording:
    """A loopback listener that records every connection it accepts (and answers HTTP)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(16)
    return Recording(sock, ORIGIN_ANSWER)


@dataclass(frozen=True)
class Environment:
    """Where egressbox starts: argv put before its own, who runs it, and what to expect."""

    name: str
    prefix: tuple[str, ...]
    unprivileged: bool = False
    # What egressbox can still do there: a network namespace (made with the capabilities
    # the user namespace gives), else the connect supervisor.
    namespace: bool = False
    cause: str = ""  # doctor's namespace_blocker cause; "" when namespaces still work
    needs: tuple[str, ...] = ()  # tools the prefix runs
    # Words doctor's user_namespace and network_namespace rows hold (with `namespace`).
    user_detail: str = ""
    net_detail: str = ""


def _zero_userns(*rest: str) -> tuple[str, ...]:
    return ("unshare", "--user", "--map-root-user", "--", "sh", "-c", ZERO_USERNS, "sh", *rest)


ENVIRONMENTS = [
    Environment("seccomp_refusal", ("@python", "@no_namespaces"), cause="seccomp_profile"),
    Environment(
        "seccomp_refusal_unprivileged",
        ("@python", "@no_namespaces"),
        unprivileged=True,
        cause="seccomp_profile",
    ),
    # uid 0 of its own user namespace still has CAP_SYS_ADMIN there: egressbox makes its
    # network namespace without a user namespace, so the limit does not matter.
    Environment(
        "max_user_namespaces_0",
        _zero_userns(),
        namespace=True,
        needs=("unshare",),
        user_detail="max_*_namespaces",  # the limit is named all the same
        net_detail="unshare(CLONE_NEWNET)",
    ),
    # Root without CAP_SYS_ADMIN (a container's root with Docker's default capabilities, its
    # seccomp profile lifted): a user namespace first, as for an unprivileged user.
    Environment(
        "root_without_sys_admin",
        ("setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", "--"),
        namespace=True,
        needs=("setpriv",),
        user_detail="unshare(CLONE_NEWUSER) works",
        net_detail="unshare(CLONE_NEWUSER|CLONE_NEWNET) works",
    ),
    # Network namespaces disabled where every other kind works: doctor names that sysctl.
    Environment(
        "max_net_namespaces_0",
        ("unshare", "--user", "--map-root-user", "--", "sh", "-c", ZERO_NETNS, "sh"),
        cause="max_net_namespaces",
        needs=("unshare",),
    ),
    Environment(
        "max_user_namespaces_0_without_capabilities",
        _zero_userns(*NO_CAPS),
        cause="max_user_namespaces",
        needs=("unshare", "setpriv"),
    ),
    Environment(
        "user_namespace_without_capabilities",
        ("unshare", "--user", "--map-root-user", "--", *NO_CAPS),
        cause="nested_sandbox",
        needs=("unshare", "setpriv"),
    ),
]


@dataclass
class Place:
    """One environment made ready: the actor, its directories, the argv prefix."""

    env: Environment
    actor: Actor
    top: Path
    state: Path
    prefix: list[str]

    def command(self, *egressbox: str) -> tuple[list[str], dict[str, str]]:
        """argv and environment that start `egressbox ARGS` in this environment."""
        env = self.actor.base_env(self.top)
        env |= {"EGRESSBOX_STATE_DIR": str(self.state), "EGRESSBOX_PURE": "1"}
        if not self.actor.runuser and "PYTHONPATH" in os.environ:
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        return self.actor.command([*self.prefix, *self.actor.egressbox, *egressbox], env)


@pytest.fixture(params=ENVIRONMENTS, ids=lambda e: e.name)
def place(request: pytest.FixtureRequest) -> Iterator[Place]:
    env: Environment = request.param
    for tool in (*env.needs, "curl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    if env.unprivileged:
        try:
            actor = unprivileged_actor()
        except UnavailableError as exc:
            pytest.skip(str(exc))
    else:
        actor = invoking_actor()
    top = actor.make_dir("/tmp", f"egressbox-notify-{env.name}-")
    # egressbox's state outside every root a run without a mount namespace makes writable
    # (/tmp among them): the test user's own, or one of root's.
    state = actor.state_dir() if actor.runuser else STATE_ROOT / f".egressbox-test-{env.name}"
    if not actor.runuser:
        shutil.rmtree(state, ignore_errors=True)
    # The wrapper is copied where the actor can read it (the checkout may not be).
    wrapper = top / NO_NAMESPACES.name
    shutil.copy(NO_NAMESPACES, wrapper)
    os.chmod(wrapper, 0o644)
    swap = {"@python": actor.python, "@no_namespaces": str(wrapper)}
    prefix = [swap.get(arg, arg) for arg in env.prefix]
    try:
        yield Place(env, actor, top, state, prefix)
    finally:
        shutil.rmtree(top, ignore_errors=True)
        if not actor.runuser:
            shutil.rmtree(state, ignore_errors=True)


def _run_in(
    place: Place, origin: Recording, other: Recording
) -> tuple[str, str, list[dict[str, object]]]:
    """`egressbox run --report` of CHILD in the place; the trap on 127.0.0.2 at the proxy's
    port must receive nothing. Returns stdout, stderr and the audit records."""
    work = place.actor.make_dir(place.top, "work-")
    (place.top / "child.py").write_text(CHILD)
    policy = place.top / "policy.toml"
    policy.write_text(
        f'[egress]\nallow = ["localhost:{origin.port}", "127.0.0.1:{origin.port}"]\n'
        'allow_cidrs = ["127.0.0.0/8"]\n'
    )
    audit = place.top / "audit.jsonl"
    for path in (place.top / "child.py", policy):
        os.chmod(path, 0o644)
    run = ["run", "--policy", str(policy), "--report", "--audit-log", str(audit)]
    run += ["--read-root", str(place.top), "--", CHILD_PYTHON, str(place.top / "child.py")]
    argv, env = place.command(*run)
    proc = subprocess.Popen(
        argv, cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        if not first.strip().isdigit():
            proc.kill()
            _, err = proc.communicate(timeout=RUN_TIMEOUT)
            pytest.fail(f"the command did not start: {first!r} {err}")
        trap = _tcp_listener("127.0.0.2", int(first))  # the proxy's port number elsewhere
        try:
            proc.stdin.write(f"{other.port} {origin.port}\n")
            proc.stdin.flush()
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
        finally:
            trap.close()
        assert trap.accepted == [], f"a direct connect reached 127.0.0.2 on the proxy's port: {out}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = audit.read_text().splitlines() if audit.exists() else []
    return out, err, [json.loads(line) for line in lines]


def _doctor_in(place: Place) -> dict[str, Any]:
    argv, env = place.command("doctor", "--json")
    done = subprocess.run(
        argv, cwd=place.top, env=env, capture_output=True, text=True, timeout=DOCTOR_TIMEOUT,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def test_where_namespaces_are_refused_only_the_proxy_is_reached(place: Place) -> None:
    origin, other = _tcp_listener("127.0.0.1"), _tcp_listener("127.0.0.1")
    try:
        out, err, records = _run_in(place, origin, other)
    finally:
        origin.close()
        other.close()
    assert other.accepted == [], f"another listener was reached: {out}"
    assert "network_boundary: full" in err, err
    if place.env.namespace:
        assert "network_namespace: full" in err, err
    else:
        assert "network_namespace: none" in err and "connect supervisor" in err, err
        assert f"UDP {1}" in out, out  # EPERM: no UDP socket without a namespace
    assert "NONBLOCK 115" in out and "SOERROR 0" in out, out
    assert "PROXY b'origin'" in out, out
    assert "CURL 0 b'origin'" in out, out
    paths = {line.split(b" ")[1] for line in origin.accepted if line}
    assert {b"/via-proxy", b"/captured", b"/nonblocking"} <= paths, origin.accepted
    captured = [r for r in records if r["protocol"] == "tcp" and r["port"] == origin.port]
    assert captured and all(r["decision"] == "allow" for r in captured), records
    refused = {(r["host"], r["port"]) for r in records if r["decision"] == "deny"}
    assert ("127.0.0.1", other.port) in refused, records
    _doctor_agrees(place, err)


def _doctor_agrees(place: Place, run_err: str) -> None:
    """doctor, in the same environment, names what blocks namespaces (run said it too) and
    what would hold the network boundary."""
    report = _doctor_in(place)
    supervisor = report["mechanisms"]["connect_supervisor"]
    assert supervisor["status"] == "available", supervisor
    assert report["profiles"]["worktree"]["network_boundary"] == "full", report["profiles"]
    blocked = report["namespace_blocker"]
    if place.env.namespace:
        assert blocked is None, blocked
        user, net = (report["mechanisms"][n] for n in ("user_namespace", "network_namespace"))
        assert place.env.user_detail in user["detail"], user
        assert place.env.net_detail in net["detail"], net
        return
    assert blocked is not None and blocked["cause"] == place.env.cause, blocked
    if place.env.cause.startswith("max_"):  # the sysctl that blocks, not another one
        assert f"sudo sysctl -w user.{place.env.cause}=" in blocked["fix"], blocked
    assert "connect_supervisor" in report["profiles"]["worktree"]["enforced"]
    assert f"no namespaces here: {blocked['why']}" in " ".join(run_err.split()), run_err


def test_destinations_are_taken_once_and_bounded() -> None:
    table = Destinations(limit=2)
    table.put(("127.0.0.1", 1), ("198.51.100.7", 443))
    table.put(("127.0.0.1", 2), ("203.0.113.9", 22))
    table.put(("127.0.0.1", 3), ("192.0.2.1", 80))  # the oldest goes
    assert table.take(("127.0.0.1", 1)) is None
    assert table.take(("127.0.0.1", 2)) == ("203.0.113.9", 22)
    assert table.take(("127.0.0.1", 2)) is None  # once
    assert len(table) == 1


def test_the_filter_program_is_well_formed() -> None:
    code = notify.program()
    assert code and len(code) % 8 == 0
    # Ends with the shared return blocks: notify, allow, EPERM, ENOSYS, kill.
    tail = range(len(code) - 40, len(code), 8)
    last = [int.from_bytes(code[i + 4 : i + 8], "little") for i in tail]
    assert last == [notify.RET_USER_NOTIF, notify.RET_ALLOW, notify.RET_ERRNO | 1,
                    notify.RET_ERRNO | 38, notify.RET_KILL_PROCESS]  # fmt: skip


# Attacks on the supervisor itself: a connect from a thread other than the first (it was
# held for good), and a unix socket of the host that the command's own view does not have.
ATTACKS = textwrap.dedent(
    """
    import os, socket, sys, threading
    port = int(os.environ["http_proxy"].rstrip("/").rsplit(":", 1)[1])
    def from_a_thread():
        s = socket.socket()
        s.connect(("127.0.0.1", port))
        print("THREAD connected", flush=True)
    t = threading.Thread(target=from_a_thread, daemon=True)
    t.start()
    t.join(10)
    print("THREAD", "held" if t.is_alive() else "done", flush=True)
    os.mkdir("own")
    mine = socket.socket(socket.AF_UNIX)
    mine.bind("own/s.sock")
    mine.listen()
    for path in ("own/s.sock", os.path.abspath("own/s.sock")):
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        print("OWN", path, "ok" if mine.accept() else "no", flush=True)
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
        s.sendall(b"escaped")
        print("HOST connected", flush=True)
    except OSError as exc:
        print("HOST", exc.errno, flush=True)
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare is not installed")
def test_the_supervisor_serves_threads_and_connects_unix_sockets_in_the_commands_view(
    tmp_path: Path,
) -> None:
    """max_net_namespaces = 0 in a user namespace of its own: the command gets its constructed
    root (a mount namespace) but no network namespace, so the supervisor holds its connects.
    A host socket outside that view must stay out of reach (the supervisor connected it by
    the host's path before); the command's own sockets work by relative and absolute path."""
    host = socket.socket(socket.AF_UNIX)
    path = f"/run/egressbox-test-notify-{os.getpid()}.sock"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    host.bind(path)
    host.listen(4)
    host.settimeout(0.5)
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "attacks.py").write_text(ATTACKS)
    state = STATE_ROOT / ".egressbox-test-notify-netns0"
    env = {**os.environ, "EGRESSBOX_STATE_DIR": str(state), "EGRESSBOX_PURE": "1"}
    zero = 'echo 0 > /proc/sys/user/max_net_namespaces && exec "$@"'
    argv = ["unshare", "--user", "--map-root-user", "--", "sh", "-c", zero, "sh"]
    argv += [*invoking_actor().egressbox, "run", "--report", "--read-root", str(tmp_path)]
    argv += ["--workspace", "direct", "--", CHILD_PYTHON, str(tmp_path / "attacks.py"), path]
    try:
        done = subprocess.run(
            argv, cwd=work, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
            check=False,
        )  # fmt: skip
        with pytest.raises(TimeoutError):
            host.accept()
    finally:
        host.close()
        os.unlink(path)
        shutil.rmtree(state, ignore_errors=True)
    assert "network_namespace: none" in done.stderr and "mount_namespace: full" in done.stderr
    assert "THREAD connected" in done.stdout and "THREAD done" in done.stdout, done
    assert done.stdout.count("ok\n") == 2, done.stdout
    assert f"HOST {errno.ENOENT}" in done.stdout, done.stdout
