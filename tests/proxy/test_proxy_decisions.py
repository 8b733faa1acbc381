"""Decisions as clients see them: denials, secrets, DNS rebinding, report mode.

Every denial is checked on all three listeners (CONNECT, plain HTTP, SOCKS5):
the status or SOCKS reply code, the reason header and one-line body, exactly
one audit record, and that the forbidden destination saw no connection at
all (a tripwire listener counts what reached its backlog; the dial guard
records every dial the proxy attempted).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from dnsserver import A
from egressbox.audit.record import KEYS, JsonlFileSink

if TYPE_CHECKING:
    from pathlib import Path

    from dnsserver import DnsServer
    from egressbox.proxy.server import EgressProxy
    from proxy_fixtures import (
        Curl,
        DialGuard,
        HttpOrigin,
        Origins,
        Reply,
        StartProxy,
        Tripwire,
        Wire,
    )

IO_TIMEOUT = 15.0

pytestmark = pytest.mark.usefixtures("dials")

# The proxy's resolver timeout in the dns_timeout cases (they wait for it).
SHORT_DNS_TIMEOUT = 0.5

# -- denials on every listener ---------------------------------------------------------


@dataclass(frozen=True)
class Denial:
    host: str  # as the client asks for it
    reason: str
    tripwire: str | None = "127.0.0.1"  # where the destination would be (None: off loopback)
    port: str = "tripwire"  # "tripwire", "self-http", "self-socks", or a literal port
    audited_host: str | None = None  # None: the host as asked
    audited_port: int | None = None  # None: the port as asked

    @property
    def status(self) -> int:
        return {"dns_failure": 502, "dns_timeout": 504}.get(self.reason, 403)

    @property
    def socks_code(self) -> int:
        return 0x04 if self.reason.startswith("dns_") else 0x02


DENIALS = {
    "no_allow_rule": Denial("unlisted.test", "no_allow_rule"),
    "deny_rule": Denial("blocked.ok.test", "deny_rule"),
    "deny_cidr": Denial("cidr.ok.test", "deny_cidr", tripwire="127.0.0.9"),
    "private_loopback": Denial("private.ok.test", "private_address", tripwire="127.0.0.2"),
    "private_10": Denial("ten.ok.test", "private_address", tripwire=None, port="443"),
    "self_ip": Denial("127.0.0.1", "self_connection", tripwire=None, port="self-http"),
    "self_name": Denial("origin.test", "self_connection", tripwire=None, port="self-socks"),
    "bad_host_short": Denial("127.1", "bad_host", audited_host="(invalid)"),
    "bad_host_int": Denial("2130706433", "bad_host", audited_host="(invalid)"),
    "bad_host_hex": Denial("0x7f.0.0.1", "bad_host", audited_host="(invalid)"),
    "bad_port_zero": Denial(
        "origin.test", "bad_port", port="0", audited_host="(invalid)", audited_port=0
    ),
    "bad_port_big": Denial(
        "origin.test", "bad_port", port="65536", audited_host="(invalid)", audited_port=0
    ),
    "dns_failure": Denial("nx.ok.test", "dns_failure", tripwire=None, port="8080"),
    "dns_timeout": Denial("slow.ok.test", "dns_timeout", tripwire=None, port="8080"),
}
# protocols/http1.py refuses a bad port in the request target (and Host
# header) itself with an unaudited 400 bad_request, while a bad host reaches
# the decision (403 bad_host, audited) and SOCKS5 port 0 is denied bad_port.
# Names the policy refuses before any DNS query.
NO_DNS = {"no_allow_rule", "deny_rule", "bad_host_short", "bad_host_int", "bad_host_hex"}


def target_port(case: Denial, proxy: EgressProxy, tripwire: Tripwire | None) -> str:
    if case.port == "tripwire":
        assert tripwire is not None
        return str(tripwire.port)
    if case.port == "self-http":
        assert proxy.http_address is not None
        return str(proxy.http_address[1])
    if case.port == "self-socks":
        assert proxy.socks_address is not None
        return str(proxy.socks_address[1])
    return case.port


def assert_refusal_reply(reply: Reply, case: Denial) -> None:
    assert reply.status == case.status, reply
    assert reply.header("X-Egressbox-Reason") == case.reason
    assert reply.header("Connection") == "close"
    assert reply.body.endswith(b"\n") and reply.body.count(b"\n") == 1, reply.body
    assert case.reason.encode() in reply.body
    assert reply.closed


@pytest.mark.parametrize("listener", ["connect", "http", "socks5"])
@pytest.mark.parametrize("name", DENIALS.keys())
async def test_denial(
    start_proxy: StartProxy,
    origins: Origins,
    zone: DnsServer,
    dials: DialGuard,
    wire: Wire,
    request: pytest.FixtureRequest,
    listener: str,
    name: str,
) -> None:
    case = DENIALS[name]
    if case.reason == "dns_timeout":
        proxy = await start_proxy(dns_timeout=SHORT_DNS_TIMEOUT)
    else:
        proxy = await start_proxy()
    tripwire = origins.tripwire(case.tripwire) if case.tripwire is not None else None
    port_text = target_port(case, proxy, tripwire)
    authority = f"{case.host}:{port_text}"
    if listener == "socks5":
        port = int(port_text)
        if port > 0xFFFF:
            pytest.skip("a SOCKS5 port has 16 bits: 65536 cannot be asked for")
        as_domain = case.reason == "bad_host"  # spelled as a name, never as an address
        code, closed = await wire.socks_exchange(
            proxy.socks_address, case.host, port, as_domain=as_domain
        )
        assert (code, closed) == (case.socks_code, True)
    else:
        if listener == "connect":
            raw = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
        else:
            raw = f"GET http://{authority}/x HTTP/1.1\r\nHost: {authority}\r\n\r\n"
        assert_refusal_reply(await wire.exchange(proxy.http_address, raw.encode()), case)
    audited_port = case.audited_port if case.audited_port is not None else int(port_text)
    expected = (listener, case.audited_host or case.host, audited_port, "deny", case.reason)
    assert wire.summary(proxy.records) == [expected]
    # Nothing was dialed, and the destination saw no connection.
    assert dials.calls == []
    if tripwire is not None:
        assert tripwire.connections() == 0
    if name in NO_DNS:
        assert zone.queries_for(case.host) == []


async def test_denied_plain_request_with_a_body_is_not_parsed_further(
    proxy: EgressProxy, origins: Origins, wire: Wire, dials: DialGuard
) -> None:
    # The unread body of a refused request looks like a request to an allowed
    # host: it must not be parsed as one (the refusal closes the connection).
    tripwire = origins.tripwire()
    port = tripwire.port
    smuggled = f"GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\n\r\n"
    request = (
        f"POST http://unlisted.test:{port}/ HTTP/1.1\r\n"
        f"Host: unlisted.test:{port}\r\nContent-Length: {len(smuggled)}\r\n\r\n{smuggled}"
    )
    reply = await wire.exchange(proxy.http_address, request.encode())
    assert reply.status == 403
    assert reply.closed
    assert wire.summary(proxy.records) == [
        ("http", "unlisted.test", tripwire.port, "deny", "no_allow_rule")
    ]
    assert dials.calls == []
    assert tripwire.connections() == 0


@pytest.mark.pure_only
@pytest.mark.parametrize("listener", ["connect", "http", "socks5"])
async def test_allowed_destination_that_refuses_the_connection(
    proxy: EgressProxy, origins: Origins, dials: DialGuard, wire: Wire, listener: str
) -> None:
    # Allowed (and audited so), then the dial fails: 502 / SOCKS 0x05, and the
    # reason names the upstream failure, not a policy denial.
    port = origins.refusing_port()
    authority = f"origin.test:{port}"
    if listener == "socks5":
        code, closed = await wire.socks_exchange(proxy.socks_address, "origin.test", port)
        assert (code, closed) == (0x05, True)
    else:
        if listener == "connect":
            raw = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n"
        else:
            raw = f"GET http://{authority}/ HTTP/1.1\r\nHost: {authority}\r\n\r\n"
        reply = await wire.exchange(proxy.http_address, raw.encode())
        assert (reply.status, reply.header("X-Egressbox-Reason")) == (502, "connect_refused")
        assert reply.body.count(b"\n") == 1 and reply.closed
    assert wire.summary(proxy.records) == [(listener, "origin.test", port, "allow", "allowed")]
    assert [str(ip) for ip in dials.addresses()] == ["127.0.0.1"]


@pytest.mark.parametrize("listener", ["connect", "http", "socks5"])
@pytest.mark.parametrize("upstream", ["denied", "refusing", "echo"])
async def test_client_gone_before_the_answer_is_no_internal_error(
    proxy: EgressProxy,
    origins: Origins,
    wire: Wire,
    capfd: pytest.CaptureFixture[str],
    listener: str,
    upstream: str,
) -> None:
    # The client sends its request and closes at once: the proxy's answer then
    # meets a reset (on loopback, inside the very send). Denied, refused by the
    # upstream or tunnelled, it must end quietly, with the decision audited.
    host = "unlisted.test" if upstream == "denied" else "origin.test"
    if upstream == "denied":
        port = origins.tripwire().port
    elif upstream == "refusing":
        port = origins.refusing_port()
    else:
        port = (await origins.echo()).port
    authority = f"{host}:{port}"
    if listener == "socks5":
        raw = wire.socks_hello(host, port)
        address = proxy.socks_address
    elif listener == "connect":
        raw = f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
        address = proxy.http_address
    else:
        raw = f"GET http://{authority}/ HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()
        address = proxy.http_address
    _, writer = await wire.open(address)
    writer.write(raw)
    await wire.close(writer)
    await wire.wait_for_records(proxy, 1)  # the proxy got the request (not just the SYN)
    await proxy.close(IO_TIMEOUT)  # waits (bounded) until the proxy is done with it
    assert proxy.state.connections == set()
    assert len(proxy.records) == 1
    assert "internal error" not in capfd.readouterr().err


# -- secrets never reach the audit log, the diagnostics or stderr ---------------------------

SECRETS = {
    "path": "sekrit-path-4b1d",
    "query": "sekrit-query-9e2a",
    "userinfo": "sekrit-userinfo-77c3",
    "authorization": "sekrit-bearer-0f5e",
    "cookie": "sekrit-cookie-a1b8",
    "proxy_password": "sekrit-proxyauth-5d6c",
    "socks_user": "sekrit-socksuser-3e9f",
    "socks_password": "sekrit-sockspass-c2d4",
    "body": "sekrit-body-81fa",
}


def secret_forms() -> list[str]:
    """Each secret as written, and base64-encoded as clients put it in Basic headers."""
    forms = list(SECRETS.values())
    for value in SECRETS.values():
        forms.append(base64.b64encode(value.encode()).decode())
        forms.append(base64.b64encode(f"user:{value}".encode()).decode())
    return forms


def assert_no_secret(text: str, where: str) -> None:
    leaked = [form for form in secret_forms() if form in text]
    assert leaked == [], f"secrets leaked into {where}: {leaked}"


def secret_request_args(port: int, host: str = "origin.test") -> list[str]:
    """curl arguments that plant a secret in every part of one request."""
    url = (
        f"http://user:{SECRETS['userinfo']}@{host}:{port}/echo/{SECRETS['path']}"
        f"?token={SECRETS['query']}"
    )
    return [
        "-H",
        f"Authorization: Bearer {SECRETS['authorization']}",
        "-b",
        f"session={SECRETS['cookie']}",
        "--data-binary",
        f"payload={SECRETS['body']}",
        url,
    ]


def check_socks_credentials(user: str, password: str) -> bool:
    return (user, password) == (SECRETS["socks_user"], SECRETS["socks_password"])


def audit_lines(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    for record in records:
        assert tuple(record) == KEYS  # exactly the six keys, in contract order
    return records


async def test_secrets_stay_out_of_audit_logs_and_stderr(
    start_proxy: StartProxy,
    origin: HttpOrigin,
    origins: Origins,
    curl: Curl,
    wire: Wire,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    audit_path = tmp_path / "audit.jsonl"
    sink = JsonlFileSink(str(audit_path))
    log: list[str] = []
    proxy = await start_proxy(audit=sink, log=log.append, socks_credentials=check_socks_credentials)
    forbidden = origins.tripwire()
    proxy_auth = ["-U", f"user:{SECRETS['proxy_password']}"]
    socks_user = f"{SECRETS['socks_user']}:{SECRETS['socks_password']}"
    assert proxy.http_url is not None and proxy.socks_address is not None
    socks_url = "socks5h://{}@{}:{}".format(socks_user, *proxy.socks_address)
    decisions = 0

    # Plain forwarding and CONNECT, allowed then denied, with Proxy-Authorization.
    for route in (["-x", proxy.http_url], ["-p", "-x", proxy.http_url]):
        allowed = await curl(*route, *proxy_auth, *secret_request_args(origin.port))
        assert json.loads(allowed.stdout)["method"] == "POST"
        denied = await curl(
            *route,
            *proxy_auth,
            *secret_request_args(forbidden.port, "unlisted.test"),
            check=False,
        )
        assert_no_secret(denied.stdout.decode(errors="replace"), "a refusal reply")
        decisions += 2

    # SOCKS5 with credentials: right (allowed, then denied destination), then wrong.
    allowed = await curl("-x", socks_url, *secret_request_args(origin.port))
    assert json.loads(allowed.stdout)["method"] == "POST"
    await curl("-x", socks_url, *secret_request_args(forbidden.port, "unlisted.test"), check=False)
    decisions += 2
    wrong = socks_url.replace(SECRETS["socks_password"], SECRETS["proxy_password"])
    refused = await curl("-x", wrong, *secret_request_args(origin.port), check=False)
    assert refused.returncode != 0  # refused at authentication: not a decision

    # Raw requests the parser refuses (400, no decision): userinfo in the
    # request target, and a malformed header next to a credential.
    raw_userinfo = (
        f"GET http://u:{SECRETS['userinfo']}@origin.test:{origin.port}/{SECRETS['path']} "
        f"HTTP/1.1\r\nHost: origin.test\r\n\r\n"
    )
    raw_malformed = (
        f"GET http://origin.test:{origin.port}/{SECRETS['path']}?q={SECRETS['query']} "
        f"HTTP/1.1\r\nHost: origin.test\r\nAuthorization: Bearer {SECRETS['authorization']}"
        f"\r\nBad Name: {SECRETS['cookie']}\r\n\r\n"
    )
    for raw in (raw_userinfo, raw_malformed):
        reply = await wire.exchange(proxy.http_address, raw.encode())
        assert reply.status == 400
        assert_no_secret(reply.head.decode("latin-1") + reply.body.decode(), "a 400 reply")

    # The origin never sees the proxy credentials (Proxy-* is hop-by-hop).
    assert origin.requests
    for seen in origin.requests:
        assert "proxy-authorization" not in dict(seen.headers)
    assert forbidden.connections() == 0

    await proxy.close(IO_TIMEOUT)  # finished tunnels write their diagnostic lines
    sink.close()
    records = audit_lines(audit_path)
    assert len(records) == decisions == len(proxy.records)
    assert [r["decision"] for r in records] == ["allow", "deny"] * 3
    assert_no_secret(audit_path.read_text(encoding="utf-8"), "the audit log")
    assert log, "the proxy wrote no diagnostic line"
    assert_no_secret("\n".join(log), "the diagnostic log")
    captured = capfd.readouterr()
    assert_no_secret(captured.out + captured.err, "stdout/stderr")


def toml_policy(data: dict[str, Any]) -> str:
    lines = ["[egress]"]
    for key, value in data["egress"].items():
        lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


# -- DNS rebinding with the real test DNS server ------------------------------------------

REBIND_POLICY = {
    "egress": {
        "allow": ["rebind.test", "mixed.test", "ten.test"],
        "allow_cidrs": ["127.0.0.1/32"],
    }
}


async def connect_and_echo(
    wire: Wire, proxy: EgressProxy, host: str, port: int, payload: bytes
) -> int:
    """CONNECT host:port; on 200, echo a payload through the tunnel. The status."""
    reader, writer = await wire.open(proxy.http_address)
    try:
        writer.write(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        status, headers, _ = await wire.read_head(reader)
        if status == 200:
            writer.write(payload)
            assert await wire.read_exactly(reader, len(payload)) == payload
        else:
            assert headers["x-egressbox-reason"]
        return status
    finally:
        await wire.close(writer)


@pytest.mark.pure_only
async def test_rebinding_answer_is_decided_again_and_denied(
    start_proxy: StartProxy, origins: Origins, zone: DnsServer, dials: DialGuard, wire: Wire
) -> None:
    echo, rebound = await origins.echo_with_twin("127.0.0.3")
    zone.set_sequence("rebind.test", [[A("127.0.0.1", ttl=0)], [A("127.0.0.3", ttl=0)]])
    proxy = await start_proxy(REBIND_POLICY)

    assert await connect_and_echo(wire, proxy, "rebind.test", echo.port, b"first") == 200
    assert await connect_and_echo(wire, proxy, "rebind.test", echo.port, b"second") == 403
    code, _ = await wire.socks_exchange(proxy.socks_address, "rebind.test", echo.port)
    assert code == 0x02

    assert wire.summary(proxy.records) == [
        ("connect", "rebind.test", echo.port, "allow", "allowed"),
        ("connect", "rebind.test", echo.port, "deny", "private_address"),
        ("socks5", "rebind.test", echo.port, "deny", "private_address"),
    ]
    assert echo.accepted == 1 and bytes(echo.received[0]) == b"first"
    assert rebound.connections() == 0
    assert [str(ip) for ip in dials.addresses()] == ["127.0.0.1"]
    # TTL 0: every decision asked the DNS server again.
    assert len([q for q in zone.queries_for("rebind.test") if q.rtype == "A"]) == 3


async def test_mixed_answer_is_denied_entirely(
    start_proxy: StartProxy, origins: Origins, zone: DnsServer, dials: DialGuard, wire: Wire
) -> None:
    echo, other = await origins.echo_with_twin("127.0.0.3")
    zone.set("mixed.test", A("127.0.0.1"), A("127.0.0.3"))
    proxy = await start_proxy(REBIND_POLICY)
    assert await connect_and_echo(wire, proxy, "mixed.test", echo.port, b"x") == 403
    code, _ = await wire.socks_exchange(proxy.socks_address, "mixed.test", echo.port)
    assert code == 0x02
    assert wire.summary(proxy.records) == [
        ("connect", "mixed.test", echo.port, "deny", "private_address"),
        ("socks5", "mixed.test", echo.port, "deny", "private_address"),
    ]
    assert echo.accepted == 0
    assert other.connections() == 0
    assert dials.calls == []


async def test_private_answer_is_denied_before_dialing(
    start_proxy: StartProxy, zone: DnsServer, dials: DialGuard, wire: Wire
) -> None:
    proxy = await start_proxy(REBIND_POLICY)
    assert await connect_and_echo(wire, proxy, "ten.test", 443, b"x") == 403
    request = b"GET http://ten.test/ HTTP/1.1\r\nHost: ten.test\r\n\r\n"
    reply = await wire.exchange(proxy.http_address, request)
    assert reply.status == 403
    assert reply.header("X-Egressbox-Reason") == "private_address"
    assert wire.summary(proxy.records) == [
        ("connect", "ten.test", 443, "deny", "private_address"),
        ("http", "ten.test", 80, "deny", "private_address"),
    ]
    assert zone.queries_for("ten.test")  # it was resolved...
    assert dials.calls == []  # ...and never dialed


# -- cloud metadata endpoints ------------------------------------------------------------

# Every broad grant that could reach the endpoints: CIDR allow entries, allow_cidrs and
# allow_private. None of them lifts the metadata class (only an exact IP entry would).
METADATA_POLICY: dict[str, Any] = {
    "egress": {
        "allow": ["169.254.0.0/16:80", "100.64.0.0/10", "imds.ok.test"],
        "allow_cidrs": ["169.254.0.0/16", "100.64.0.0/10"],
        "allow_private": True,
    }
}


@pytest.mark.parametrize("mode", ["enforce", "report"])
async def test_metadata_endpoints_are_refused_before_dialing(
    start_proxy: StartProxy, zone: DnsServer, dials: DialGuard, wire: Wire, mode: str
) -> None:
    zone.set("imds.ok.test", A("169.254.169.254"))
    proxy = await start_proxy({"egress": {**METADATA_POLICY["egress"], "mode": mode}})
    raw = b"CONNECT 169.254.169.254:80 HTTP/1.1\r\nHost: 169.254.169.254:80\r\n\r\n"
    reply = await wire.exchange(proxy.http_address, raw)
    assert reply.status == 403
    assert reply.header("X-Egressbox-Reason") == "metadata_address"
    assert b"metadata_address" in reply.body and reply.closed
    expected = [("connect", "169.254.169.254", 80, "deny", "metadata_address")]
    assert wire.summary(proxy.records) == expected
    code, closed = await wire.socks_exchange(proxy.socks_address, "100.100.100.200", 80)
    assert (code, closed) == (0x02, True)
    expected.append(("socks5", "100.100.100.200", 80, "deny", "metadata_address"))
    assert wire.summary(proxy.records) == expected
    # A name that resolves to an endpoint: resolved, refused, never dialed.
    code, closed = await wire.socks_exchange(proxy.socks_address, "imds.ok.test", 80)
    assert (code, closed) == (0x02, True)
    expected.append(("socks5", "imds.ok.test", 80, "deny", "metadata_address"))
    assert wire.summary(proxy.records) == expected
    assert zone.queries_for("imds.ok.test")
    assert dials.calls == []


# -- report mode ----------------------------------------------------------------------------

REPORT_POLICY = {
    "egress": {
        "mode": "report",
        "allow": ["origin.test"],
        "deny": ["blocked.ok.test"],
        "allow_cidrs": ["127.0.0.1/32"],
    }
}


@pytest.mark.pure_only
async def test_report_mode_lets_name_misses_through_and_keeps_the_address_ban(
    start_proxy: StartProxy,
    origin: HttpOrigin,
    origins: Origins,
    curl: Curl,
    dials: DialGuard,
    wire: Wire,
) -> None:
    proxy = await start_proxy(REPORT_POLICY)
    assert proxy.http_url is not None and proxy.http_address is not None
    not_admitted = origins.tripwire("127.0.0.2")
    port = origin.port
    ok = [
        ("-x", origin.url("origin.test")),
        ("-x", origin.url("unlisted.test")),
        ("-p", origin.url("unlisted.test")),
        ("-x", origin.url("127.0.0.1")),
    ]
    for flag, url in ok:
        args = ["-x", proxy.http_url, url] if flag == "-x" else ["-p", "-x", proxy.http_url, url]
        assert (await curl(*args)).stdout == b"hello from v4"
    refused = [
        f"http://ten.ok.test:{port}/",
        f"http://private.ok.test:{not_admitted.port}/",
        f"http://blocked.ok.test:{port}/",
        f"http://127.0.0.1:{proxy.http_address[1]}/",
    ]
    for url in refused:
        result = await curl("-x", proxy.http_url, "-o", os.devnull, "-w", "%{http_code}", url)
        assert result.stdout == b"403"
    assert wire.summary(proxy.records) == [
        ("http", "origin.test", port, "allow", "allowed"),
        ("http", "unlisted.test", port, "would_deny", "no_allow_rule"),
        ("connect", "unlisted.test", port, "would_deny", "no_allow_rule"),
        ("http", "127.0.0.1", port, "would_deny", "no_allow_rule"),
        ("http", "ten.ok.test", port, "deny", "private_address"),
        ("http", "private.ok.test", not_admitted.port, "deny", "private_address"),
        ("http", "blocked.ok.test", port, "deny", "deny_rule"),
        ("http", "127.0.0.1", proxy.http_address[1], "deny", "self_connection"),
    ]
    assert origin.accepted == 4
    assert not_admitted.connections() == 0
    assert {str(ip) for ip in dials.addresses()} == {"127.0.0.1"}


# -- the serve command ----------------------------------------------------------------------


async def read_line(stream: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(stream.readline(), IO_TIMEOUT)


async def test_serve_command_audits_and_keeps_secrets_out_of_stderr(
    zone: DnsServer, origin: HttpOrigin, origins: Origins, curl: Curl, tmp_path: Path
) -> None:
    policy_path = tmp_path / "policy.toml"
    policy_path.write_text(
        toml_policy({"egress": {"allow": ["origin.test"], "allow_cidrs": ["127.0.0.1/32"]}}),
        encoding="utf-8",
    )
    audit_path = tmp_path / "audit.jsonl"
    forbidden = origins.tripwire()
    command = [
        sys.executable,
        "-m",
        "egressbox",
        "serve",
        "--policy",
        str(policy_path),
        "--nameserver",
        zone.address,
        "--audit-log",
        str(audit_path),
    ]
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = await read_line(proc.stdout)
        if not line:
            err = await asyncio.wait_for(proc.stderr.read(), IO_TIMEOUT)
            pytest.fail(f"serve ended before its ready line: {err.decode(errors='replace')}")
        ready = json.loads(line)
        assert ready["event"] == "ready"
        http_url = f"http://{ready['http']}"
        proxy_auth = ["-U", f"user:{SECRETS['proxy_password']}"]
        for route in (["-x", http_url], ["-p", "-x", http_url]):
            await curl(*route, *proxy_auth, *secret_request_args(origin.port))
            denied = secret_request_args(forbidden.port, "unlisted.test")
            await curl(*route, *proxy_auth, *denied, check=False)
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), IO_TIMEOUT)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    assert proc.returncode == 0
    assert out == b""  # nothing follows the ready line on stdout
    assert_no_secret(err.decode(errors="replace"), "serve's stderr")
    assert err.count(b"\n") >= 4  # one diagnostic line per connection
    records = audit_lines(audit_path)
    assert [(r["protocol"], r["host"], r["decision"]) for r in records] == [
        ("http", "origin.test", "allow"),
        ("http", "unlisted.test", "deny"),
        ("connect", "origin.test", "allow"),
        ("connect", "unlisted.test", "deny"),
    ]
    assert_no_secret(audit_path.read_text(encoding="utf-8"), "serve's audit log")
    assert forbidden.connections() == 0
