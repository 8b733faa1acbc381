"""`egressbox run` captures: judged from the host, as the invoking user and as an unprivileged one.

The launcher side of capture (DESIGN 7a): local routes and nftables rules in the child's
namespace, the capture and DNS sockets handed to the parent, the view's resolv.conf and hosts,
and UDP sockets allowed by seccomp because every datagram ends inside the namespace. What a
child does is only a hint; the host's own listeners say whether anything got out. Nothing
leaves loopback; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import re
import select
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from egressbox.confine.grants import CAPTURE_HOSTS, CAPTURE_RESOLV_CONF
from egressbox.runner.facts import host_facts
from unprivileged import Actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(900),
]

RUN_TIMEOUT = 120.0
QUIET_WAIT = 0.5  # after the run: anything that got out has arrived long before
REPORT_LINE = re.compile(r"^egressbox: enforcement: (\w+): (full|partial|none) \((.*)\)$")


def _needs_capture() -> None:
    facts = host_facts()
    if not {"network_namespace", "mount_namespace", "seccomp", "capture"} <= facts.available:
        pytest.skip(f"capture needs a network and mount namespace and seccomp: {facts.status}")


@dataclass
class Box:
    actor: Actor
    workspace: Path

    def egressbox(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [*self.actor.egressbox, "run", "--quiet", "--write-root", str(self.workspace)]
        environment = self.actor.base_env(self.workspace)
        command, environment = self.actor.command([*argv, *args], environment)
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

    def python(self, code: str, *args: str) -> subprocess.CompletedProcess[str]:
        return self.egressbox(*args, "--", self.actor.python, "-c", textwrap.dedent(code))


@pytest.fixture
def box(actor: Actor) -> Iterator[Box]:
    _needs_capture()
    workspace = actor.make_dir("/tmp", "egressbox-capture-ws-")
    try:
        yield Box(actor, workspace)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-3000:]}"


def _report(done: subprocess.CompletedProcess[str]) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in done.stderr.splitlines():
        match = REPORT_LINE.match(line)
        if match:
            rows[match[1]] = (match[2], match[3])
    return rows


# -- the report ------------------------------------------------------------------------------


def test_the_report_says_capture_is_applied(box: Box) -> None:
    done = box.egressbox("--report", "--", "true")
    assert done.returncode == 0, _explain(done)
    rows = _report(done)
    state, detail = rows["capture"]
    assert state == "full", _explain(done)
    assert "IPv4" in detail and "127.0.0.53:53" in detail, detail
    assert rows["network_boundary"][0] == "full", _explain(done)
    assert rows["seccomp"][0] == "full", _explain(done)
    assert "UDP" in rows["seccomp"][1], _explain(done)
    assert "any port" in rows["landlock_net"][1], _explain(done)
    assert "confinement is partial" not in done.stderr, _explain(done)


def test_no_capture_is_said_in_the_report(box: Box) -> None:
    done = box.egressbox("--no-capture", "--report", "--", "true")
    assert done.returncode == 0, _explain(done)
    rows = _report(done)
    assert rows["capture"] == ("none", "turned off (--no-capture)"), _explain(done)
    assert "UDP" not in rows["seccomp"][1], _explain(done)
    assert "proxy's ports" in rows["landlock_net"][1], _explain(done)
    assert "confinement is partial" not in done.stderr, _explain(done)


# -- the child's view ------------------------------------------------------------------------


def test_resolv_conf_and_hosts_name_only_the_sandbox(box: Box) -> None:
    script = "cat /etc/resolv.conf; echo ---; cat /etc/hosts; echo ---; getent hosts localhost"
    done = box.egressbox("--", "/bin/sh", "-c", script)
    assert done.returncode == 0, _explain(done)
    resolv, hosts, localhost = done.stdout.split("---\n")
    assert resolv == CAPTURE_RESOLV_CONF, _explain(done)
    assert hosts == CAPTURE_HOSTS, _explain(done)
    assert localhost.split()[0] in ("127.0.0.1", "::1"), _explain(done)


def test_without_capture_etc_is_the_hosts(box: Box) -> None:
    done = box.egressbox("--no-capture", "--", "/bin/cat", "/etc/hosts")
    assert done.returncode == 0, _explain(done)
    assert done.stdout == Path("/etc/hosts").read_text(encoding="utf-8"), _explain(done)
    resolv = box.egressbox("--no-capture", "--", "/bin/cat", "/etc/resolv.conf")
    assert "egressbox" not in resolv.stdout, _explain(resolv)
    if not Path("/etc/resolv.conf").is_symlink():  # a link may lead out of the view
        host = Path("/etc/resolv.conf").read_text(encoding="utf-8")
        assert resolv.stdout == host, _explain(resolv)


# -- UDP: allowed, and it reaches nothing on the host ----------------------------------------


@contextlib.contextmanager
def _host_listeners() -> Iterator[list[socket.socket]]:
    """A UDP socket and a TCP listener on the host's 127.0.0.1 and ::1 (where available)."""
    made: list[socket.socket] = []
    try:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            try:
                udp = socket.socket(family, socket.SOCK_DGRAM)
            except OSError:
                continue
            made.append(udp)
            udp.bind((host, 0))
            tcp = socket.socket(family, socket.SOCK_STREAM)
            made.append(tcp)
            tcp.bind((host, 0))
            tcp.listen(16)
        yield made
    finally:
        for sock in made:
            sock.close()


def _nothing_arrived(listeners: list[socket.socket]) -> list[str]:
    ready, _, _ = select.select(listeners, [], [], QUIET_WAIT)
    return [str(sock.getsockname()) for sock in ready]


UDP_ATTACK = """
    import socket
    sent = 0
    for host, port in [("8.8.8.8", 53), ("1.1.1.1", 443)] + {targets!r}:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.sendto(b"egressbox-capture-probe", (host, port))
                sent += 1
        except OSError as exc:
            print("sendto", host, port, exc.strerror)
    for host, port in {tcp!r}:
        try:
            socket.create_connection((host, port), timeout=3).close()
            print("connected", host, port)
        except OSError as exc:
            print("connect", host, port, exc.strerror or exc)
    print("sent", sent)
"""


def test_udp_is_allowed_and_reaches_nothing_on_the_host(box: Box) -> None:
    with _host_listeners() as listeners:
        udp = [s.getsockname()[:2] for s in listeners if s.type == socket.SOCK_DGRAM]
        tcp = [s.getsockname()[:2] for s in listeners if s.type == socket.SOCK_STREAM]
        started = time.monotonic()
        done = box.python(UDP_ATTACK.format(targets=udp, tcp=tcp))
        assert _nothing_arrived(listeners) == [], _explain(done)
    assert done.returncode == 0, _explain(done)
    # A DNS question to any address is sent (it goes to the sandbox's DNS address); any other
    # datagram is dropped inside the namespace, and its sendto says so.
    assert "sent 1\n" in done.stdout, _explain(done)
    refused = [line for line in done.stdout.splitlines() if line.startswith("sendto")]
    assert len(refused) == 1 + len(udp), _explain(done)
    assert all(line.endswith("Operation not permitted") for line in refused), _explain(done)
    assert time.monotonic() - started < 60, _explain(done)


def test_a_name_lookup_ends_quickly(box: Box) -> None:
    code = """
        import socket, time
        started = time.monotonic()
        try:
            socket.getaddrinfo("egressbox-capture-test.example", 443)
            print("resolved")
        except socket.gaierror as exc:
            print("failed", exc.errno)
        print(round(time.monotonic() - started, 1))
    """
    done = box.python(code)
    assert done.returncode == 0, _explain(done)
    assert "resolved" not in done.stdout, _explain(done)  # no policy: nothing resolves
    assert float(done.stdout.split()[-1]) < 5.0, _explain(done)


SOCKET_PROBE = """
    import errno, socket
    for name, args in (
        ("udp", (socket.AF_INET, socket.SOCK_DGRAM, 0)),
        ("udp6", (socket.AF_INET6, socket.SOCK_DGRAM, 17)),
        ("raw", (socket.AF_INET, socket.SOCK_RAW, 1)),
        ("ping", (socket.AF_INET, socket.SOCK_DGRAM, 1)),
        ("mptcp", (socket.AF_INET, socket.SOCK_STREAM, 262)),
        ("sctp", (socket.AF_INET, socket.SOCK_STREAM, 132)),
        ("packet", (17, socket.SOCK_RAW, 0)),
        ("netlink", (16, socket.SOCK_RAW, 0)),
    ):
        try:
            socket.socket(*args).close()
            print(name, "created")
        except OSError as exc:
            print(name, errno.errorcode[exc.errno])
"""


def _sockets(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return dict(line.split() for line in done.stdout.splitlines())


def test_raw_mptcp_and_the_rest_stay_refused(box: Box) -> None:
    done = box.python(SOCKET_PROBE)
    assert done.returncode == 0, _explain(done)
    assert _sockets(done) == {
        "udp": "created",
        "udp6": "created",
        "raw": "EPERM",
        "ping": "EPROTONOSUPPORT",
        "mptcp": "EPROTONOSUPPORT",
        "sctp": "EPROTONOSUPPORT",
        "packet": "EAFNOSUPPORT",
        "netlink": "EAFNOSUPPORT",
    }, _explain(done)


def test_no_capture_refuses_udp_as_before(box: Box) -> None:
    done = box.python(SOCKET_PROBE, "--no-capture")
    assert done.returncode == 0, _explain(done)
    found = _sockets(done)
    assert found["udp"] == found["udp6"] == "EPERM", _explain(done)
    assert found["raw"] == "EPERM" and found["mptcp"] == "EPROTONOSUPPORT", _explain(done)


def test_a_direct_connection_never_reaches_the_host(box: Box) -> None:
    # Captured (and decided by the proxy, or refused where nothing serves it): the host's
    # listener on the same loopback port sees nothing, with or without capture.
    with _host_listeners() as listeners:
        tcp = [s.getsockname()[:2] for s in listeners if s.type == socket.SOCK_STREAM]
        for flags in ((), ("--no-capture",)):
            done = box.python(UDP_ATTACK.format(targets=[], tcp=tcp), *flags)
            assert done.returncode == 0, _explain(done)
        assert _nothing_arrived(listeners) == [], _explain(done)
