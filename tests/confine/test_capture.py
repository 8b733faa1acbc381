"""Capture in the child's namespace (confine/capture.py): the rtnetlink message and the nftables
ruleset as bytes and text, then the real thing in a throwaway network namespace (a forked
child), and the world's own files (/etc/resolv.conf through a host symlink).

Nothing leaves the throwaway namespace: its only interface is lo.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from egressbox.confine import capture, netns, syscalls, world
from egressbox.confine.grants import (
    CAPTURE_FILES,
    CAPTURE_HOSTS,
    CAPTURE_RESOLV_CONF,
    HostFacts,
    WorldSpec,
)
from egressbox.confine.probe import probe_host
from egressbox.core.original import original_destination
from egressbox.runner.assemble import prepare
from egressbox.runner.options import options_for
from forking import fork_call

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="capture is Linux only")

IO_TIMEOUT = 5.0


# -- rtnetlink -------------------------------------------------------------------------------


@pytest.mark.skipif(sys.byteorder != "little", reason="expected bytes are little-endian")
@pytest.mark.parametrize(("family", "family_byte"), [(socket.AF_INET, 2), (socket.AF_INET6, 10)])
def test_route_message_bytes(family: int, family_byte: int) -> None:
    message = capture.route_message(family, 1, seq=7)
    header = bytes.fromhex(
        "24000000"  # nlmsg_len 36
        "1800"  # RTM_NEWROUTE
        "0506"  # NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE
        "07000000"  # seq
        "00000000"  # pid: the kernel
    )
    rtmsg = bytes([family_byte, 0, 0, 0, 254, 3, 254, 2]) + bytes(4)
    # dst_len 0 (every address), table main, proto boot, scope host, type local, no flags
    oif = bytes.fromhex("0800040001000000")  # RTA_OIF = lo's index 1
    assert message == header + rtmsg + oif


def _ack(seq: int, error: int) -> bytes:
    body = struct.pack("=i", error) + capture.route_message(socket.AF_INET, 1, seq)[:16]
    return struct.pack("=IHHII", 16 + len(body), capture.NLMSG_ERROR, 0, seq, 0) + body


def test_parse_ack() -> None:
    assert capture.parse_ack(_ack(1, 0), 1) == 0
    assert capture.parse_ack(_ack(1, -errno.EPERM), 1) == -errno.EPERM
    assert capture.parse_ack(_ack(2, 0), 1) is None
    assert capture.parse_ack(_ack(2, -1) + _ack(1, -errno.EEXIST), 1) == -errno.EEXIST
    assert capture.parse_ack(b"", 1) is None
    assert capture.parse_ack(b"\x00" * 15, 1) is None
    assert capture.parse_ack(struct.pack("=IHHII", 0, 2, 0, 1, 0), 1) is None  # length 0: stop


# -- the ruleset -----------------------------------------------------------------------------


def test_ruleset_text() -> None:
    text = capture.ruleset((40001, 40002), 40003)
    assert text == (
        "table inet egressbox {\n"
        "\tchain output {\n"
        "\t\ttype nat hook output priority -100; policy accept;\n"
        "\t\tip daddr 127.0.0.1 tcp dport { 40001, 40002, 40003 } accept\n"
        "\t\tip6 daddr ::1 tcp dport 40003 accept\n"
        "\t\tip daddr 127.0.0.53 tcp dport 53 accept\n"
        "\t\tip daddr 127.0.0.53 udp dport 53 accept\n"
        "\t\tmeta nfproto ipv4 udp dport 53 dnat ip to 127.0.0.53:53\n"
        "\t\tmeta l4proto tcp redirect to :40003\n"
        "\t}\n"
        "\tchain udp_output {\n"
        "\t\ttype filter hook output priority 0; policy accept;\n"
        "\t\tmeta l4proto udp ct reply ip saddr 127.0.0.53 ct reply proto-src 53 accept\n"
        "\t\tmeta l4proto udp drop\n"
        "\t}\n"
        "}\n"
    )


def test_ruleset_variants() -> None:
    v4 = capture.ruleset((1, 2), 3, ipv6=False)
    assert "ip6" not in v4
    loopback = capture.ruleset((1, 2), 3, allow_loopback=True).splitlines()
    accept = loopback.index("\t\tip daddr 127.0.0.0/8 accept")
    assert loopback[accept + 1] == "\t\tip6 daddr ::1 accept"
    # Loopback is left alone before anything is redirected.
    assert accept < loopback.index("\t\tmeta l4proto tcp redirect to :3")
    assert "dport { 1, 2, 3 }" in capture.ruleset((1, 2, 2), 3)


# -- the real thing, in a throwaway namespace ------------------------------------------------


@pytest.fixture(scope="module")
def capture_works() -> None:
    found = probe_host().capture
    if not found.available:
        pytest.skip(f"capture: {found.status}: {found.detail}")


def _namespace() -> tuple[str, ...]:
    """A fresh network namespace (a user namespace too unless root), lo up, routes added."""
    flags = syscalls.CLONE_NEWNET
    if os.geteuid() != 0:
        flags |= syscalls.CLONE_NEWUSER
    syscalls.unshare(flags)
    netns.loopback_up()
    return capture.add_local_routes()


def _accepted(listener: socket.socket) -> socket.socket:
    listener.settimeout(IO_TIMEOUT)
    conn, _ = listener.accept()
    return conn


def _redirected(allow_loopback: bool) -> dict[str, Any]:
    families = _namespace()
    proxy = netns.bind_listener("127.0.0.1", 0)
    made = capture.open_sockets(16)
    port = made.capture_port
    ipv6 = made.dual_stack and "ipv6" in families
    capture.install_redirect(
        [proxy.getsockname()[1]], port, ipv6=ipv6, allow_loopback=allow_loopback
    )
    seen: dict[str, Any] = {"families": list(families), "dual_stack": made.dual_stack}
    targets = [("v4", socket.AF_INET, ("192.0.2.7", 8443)), ("v4loop", socket.AF_INET, None)]
    if ipv6:
        targets.append(("v6", socket.AF_INET6, ("2001:db8::5", 443)))
    own = netns.bind_listener("127.0.0.1", 0)  # the child's own server on lo
    for name, family, target in targets:
        with socket.socket(family, socket.SOCK_STREAM) as client:
            client.settimeout(IO_TIMEOUT)
            client.connect(target or own.getsockname())
            listener = own if target is None and allow_loopback else made.capture
            with _accepted(listener) as conn:
                seen[name] = list(original_destination(conn))
    # The proxy's own listener is reached as itself, never redirected.
    with socket.create_connection(proxy.getsockname(), timeout=IO_TIMEOUT):
        _accepted(proxy).close()
    # UDP to port 53 anywhere reaches the DNS socket, and the answer comes back from there.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
        client.settimeout(IO_TIMEOUT)
        client.sendto(b"question", ("198.51.100.9", 53))
        made.dns_udp.settimeout(IO_TIMEOUT)
        data, peer = made.dns_udp.recvfrom(100)
        made.dns_udp.sendto(b"answer", peer)
        reply, source = client.recvfrom(100)
        seen["dns_udp"] = [data.decode(), reply.decode(), list(source)]
        # Other UDP goes nowhere, and says so: the datagram is dropped, sendto fails.
        seen["stray"] = {}
        for family, target in (
            (socket.AF_INET, ("198.51.100.9", 5353)),
            (socket.AF_INET, ("127.0.0.1", 9)),
            (socket.AF_INET6, ("::1", 53)),
            (socket.AF_INET6, ("2001:db8::1", 53)),
        ):
            with socket.socket(family, socket.SOCK_DGRAM) as stray:
                try:
                    stray.sendto(b"stray", target)
                    seen["stray"][target[0]] = "sent"
                except OSError as exc:
                    seen["stray"][target[0]] = errno.errorcode[exc.errno or 0]
        made.dns_udp.settimeout(0.3)
        try:
            made.dns_udp.recvfrom(100)
            seen["dns_after_stray"] = "received"
        except TimeoutError:
            seen["dns_after_stray"] = "nothing"
    with socket.create_connection((capture.DNS_HOST, 53), timeout=IO_TIMEOUT):
        _accepted(made.dns_tcp).close()
        seen["dns_tcp"] = "accepted"
    return seen


@pytest.mark.parametrize("allow_loopback", [False, True])
def test_every_connection_is_captured(capture_works: None, allow_loopback: bool) -> None:
    seen = fork_call(lambda: _redirected(allow_loopback))
    assert seen["v4"] == ["192.0.2.7", 8443]
    # Its own server on lo: reached directly with allow_loopback, else captured (and the
    # original destination says where it went).
    assert seen["v4loop"][0] == "127.0.0.1"
    if "ipv6" in seen["families"] and seen["dual_stack"]:
        assert seen["v6"] == ["2001:db8::5", 443]
    assert seen["dns_udp"] == ["question", "answer", ["198.51.100.9", 53]]
    assert seen["stray"] == dict.fromkeys(
        ("198.51.100.9", "127.0.0.1", "::1", "2001:db8::1"), "EPERM"
    )
    assert seen["dns_after_stray"] == "nothing"
    assert seen["dns_tcp"] == "accepted"


def _loopback_is_captured() -> dict[str, Any]:
    _namespace()
    made = capture.open_sockets(4)
    capture.install_redirect([], made.capture_port, ipv6=made.dual_stack)
    own = netns.bind_listener("127.0.0.1", 0)
    with socket.create_connection(own.getsockname(), timeout=IO_TIMEOUT):
        made.capture.settimeout(IO_TIMEOUT)
        conn, _ = made.capture.accept()
    own.settimeout(0.2)
    try:
        own.accept()
        reached = "own server"
    except TimeoutError:
        reached = "capture only"
    return {"reached": reached, "original": list(original_destination(conn))}


def test_without_allow_loopback_even_loopback_is_captured(capture_works: None) -> None:
    seen = fork_call(_loopback_is_captured)
    assert seen["reached"] == "capture only"
    assert seen["original"][0] == "127.0.0.1"


def test_self_test_in_a_child(capture_works: None) -> None:
    assert "nat redirect" in fork_call(lambda: {"text": capture.self_test()})["text"]


def test_a_bad_ruleset_says_why(capture_works: None) -> None:
    def body() -> dict[str, Any]:
        _namespace()
        try:
            capture._library().run("table inet egressbox { chain c { nonsense; } }")
        except capture.CaptureError as exc:
            return {"error": str(exc)}
        return {"error": ""}

    assert "nftables refused the capture rules" in fork_call(body)["error"]


# -- the child's files: resolv.conf through a host symlink -----------------------------------


@pytest.fixture(scope="module")
def mounts_work() -> None:
    found = probe_host().mount_namespace
    if not found.available:
        pytest.skip(f"mount namespace: {found.status}: {found.detail}")


def _world_files(etc: str, files: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    flags = syscalls.CLONE_NEWNS
    if os.geteuid() != 0:
        flags |= syscalls.CLONE_NEWUSER
    syscalls.unshare(flags)
    if os.geteuid() != 0:
        netns.write_id_maps(os.getuid(), os.getgid())
    spec = WorldSpec(grants=((etc, False),), files=files, new_proc=False, cwd="/")
    report = world.apply_world(spec)
    seen: dict[str, Any] = {"steps": list(report.steps), "skipped": report.skipped}
    for path, _ in files:
        with open(path, encoding="utf-8") as handle:
            seen[path] = handle.read()
        try:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write("nameserver 10.0.0.1\n")
            seen[f"write {path}"] = "written"
        except OSError as exc:
            seen[f"write {path}"] = errno.errorcode[exc.errno or 0]
    return seen


def test_files_follow_a_host_symlink_inside_the_view(mounts_work: None, tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "resolv.conf").symlink_to("../run/egressbox-test/resolve/stub-resolv.conf")
    (etc / "absolute.conf").symlink_to("/run/egressbox-abs/resolv.conf")
    (etc / "hosts").write_text("10.9.9.9 host-only-name\n")
    hosts_before = (etc / "hosts").read_text()
    os.chmod(tmp_path, 0o755)
    files = (
        (str(etc / "resolv.conf"), CAPTURE_RESOLV_CONF),
        (str(etc / "absolute.conf"), "absolute\n"),
        (str(etc / "hosts"), CAPTURE_HOSTS),
    )
    seen = fork_call(lambda: _world_files(str(etc), files))
    assert seen[str(etc / "resolv.conf")] == CAPTURE_RESOLV_CONF, seen
    assert seen[str(etc / "absolute.conf")] == "absolute\n", seen
    assert seen[str(etc / "hosts")] == CAPTURE_HOSTS, seen
    for path, _ in files:
        assert seen[f"write {path}"] in ("EROFS", "EACCES"), seen
    relative = str(tmp_path / "run/egressbox-test/resolve/stub-resolv.conf")
    assert f"file {etc / 'resolv.conf'} (at {relative})" in seen["steps"], seen
    # Nothing of it on the host: the link still dangles, the hosts file is the host's.
    assert not (tmp_path / "run").exists()
    assert not Path("/run/egressbox-abs").exists()
    assert (etc / "hosts").read_text() == hosts_before


def test_capture_files_say_what_the_child_needs() -> None:
    assert dict(CAPTURE_FILES) == {
        "/etc/resolv.conf": CAPTURE_RESOLV_CONF,
        "/etc/hosts": CAPTURE_HOSTS,
    }
    assert "nameserver 127.0.0.53" in CAPTURE_RESOLV_CONF
    assert "options edns0" in CAPTURE_RESOLV_CONF
    assert "search" not in CAPTURE_RESOLV_CONF and "domain" not in CAPTURE_RESOLV_CONF
    lines = [line.split() for line in CAPTURE_HOSTS.splitlines()]
    assert lines == [
        ["127.0.0.1", "localhost"],
        ["::1", "localhost", "ip6-localhost", "ip6-loopback"],
    ]


# -- planning: on by default where the host allows it, never a refusal -----------------------


def _planned(tmp_path: Path, available: set[str], **kwargs: Any) -> Any:
    options = options_for(
        ["/bin/true"],
        policy=None,
        cwd=str(tmp_path),
        base_env={"HOME": str(tmp_path / "home"), "PATH": "/bin"},
        allow_direct_network=True,  # planning only: nothing runs
        **kwargs,
    )
    status = {name: "available" for name in available}
    prepared = prepare(options, HostFacts(frozenset(available), status, 0, os.geteuid()))
    for sock in prepared.host_listeners:
        sock.close()
    return prepared


NAMESPACES = {"network_namespace", "mount_namespace", "pid_namespace"}


def test_capture_is_planned_where_the_host_allows_it(tmp_path: Path) -> None:
    prepared = _planned(tmp_path, NAMESPACES | {"capture"})
    assert prepared.plan.capture and prepared.capture_off == ""
    assert prepared.plan.world is not None
    # The capture files, besides the clean copies of tools' configuration (confine/clean.py).
    assert set(CAPTURE_FILES) <= set(prepared.plan.world.files)
    rows = {row.mechanism: row for row in prepared.report}
    assert rows["capture"].enforcement.value == "full"


@pytest.mark.parametrize(
    ("available", "kwargs", "why"),
    [
        (NAMESPACES | {"capture"}, {"capture": False}, "turned off (--no-capture)"),
        (NAMESPACES, {}, "unavailable on this host"),
        ({"capture"}, {}, "needs a network namespace"),
    ],
)
def test_capture_off_is_said_not_refused(
    tmp_path: Path, available: set[str], kwargs: dict[str, Any], why: str
) -> None:
    prepared = _planned(tmp_path, available, **kwargs)
    assert not prepared.plan.capture
    assert why in prepared.capture_off
    if prepared.plan.world is not None:
        capture_paths = {path for path, _ in CAPTURE_FILES}
        assert not capture_paths & {path for path, _ in prepared.plan.world.files}
    rows = {row.mechanism: row for row in prepared.report}
    assert rows["capture"].enforcement.value == "none"
    assert why in rows["capture"].detail


def test_the_launchers_word_decides_the_report() -> None:
    from egressbox.confine.grants import Mechanism, Profile
    from egressbox.runner.report import applied_report

    chosen = frozenset({Mechanism.NETWORK_NAMESPACE})
    done = {"status": "full", "families": ["ipv4", "ipv6"], "capture_port": 4, "dns": "x:53"}
    rows, _ = applied_report(Profile.UNRESTRICTED, chosen, {"capture": done})
    row = next(r for r in rows if r.mechanism == "capture")
    assert row.enforcement.value == "full" and "IPv4 and IPv6" in row.detail
    assert "does not serve" not in row.detail
    rows, _ = applied_report(Profile.UNRESTRICTED, chosen, {"capture": done}, capture_served=False)
    assert "does not serve" in next(r for r in rows if r.mechanism == "capture").detail
    failed = {"status": "none", "reason": "nftables refused the capture rules: x"}
    rows, _ = applied_report(Profile.UNRESTRICTED, chosen, {"capture": failed})
    row = next(r for r in rows if r.mechanism == "capture")
    assert row.enforcement.value == "none" and "nftables refused" in row.detail


def test_probe_is_quick(capture_works: None) -> None:
    started = time.monotonic()
    probe_host()
    assert time.monotonic() - started < 1.0
