"""Audit logs written by the real proxy, read back by `egressbox audit`.

1. Concurrent load: hundreds of CONNECT and SOCKS5 clients (at most 100 at once) reach a
   loopback origin through an EgressProxy whose JsonlFileSink rotates every 4 KiB; the
   reader's output over the rotated files must equal the proxy's own records, line for
   line, and the summary must match the clients' plan exactly.
2. Round trip: a client runs under report mode, a policy is suggested from the log, the
   suggestion passes `egressbox check` and is enforced: the same client succeeds, a new
   destination is denied.

Traffic goes to 127.0.0.0/8 only; names resolve through the real test DNS server.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dnsserver import NXDOMAIN, A, DnsServer
from egressbox.audit.record import AuditProtocol, AuditRecord, JsonlFileSink, rotated_files
from egressbox.cli import audit as audit_cli
from egressbox.cli import main as cli_main
from egressbox.core.errors import Reason, Verdict
from egressbox.core.policy import Mode, Policy, load_policy, parse_policy
from egressbox.net.resolve import DnsResolver
from egressbox.proxy.server import EgressProxy

IO_TIMEOUT = 10.0  # seconds per client step: generous on a loaded machine, still bounded
MAX_CONCURRENT = 100
LOOPBACK = "127.0.0.1"
OK = "ok"


# --------------------------------------------------------------------------- origin, clients


async def _pong(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        line = await reader.readline()
        writer.write(b"pong " + line)
        await writer.drain()
    finally:
        writer.close()


@dataclass
class Origin:
    server: asyncio.Server

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def start_origin() -> Origin:
    return Origin(await asyncio.start_server(_pong, LOOPBACK, 0))


async def _ping(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    writer.write(b"ping\n")
    await writer.drain()
    line = await reader.readline()
    assert line == b"pong ping\n", line
    return OK


async def via_connect(proxy: EgressProxy, host: str, port: int) -> str:
    """OK after a ping through a CONNECT tunnel, else the refusal's reason code."""
    assert proxy.http_address is not None
    reader, writer = await asyncio.open_connection(*proxy.http_address)
    try:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        writer.write(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        if head.split()[1] == "200":
            return await _ping(reader, writer)
        return _header(head, "X-Egressbox-Reason")
    finally:
        writer.close()


def _header(head: str, name: str) -> str:
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    raise AssertionError(f"no {name} in {head!r}")


async def via_socks(proxy: EgressProxy, host: str, port: int) -> str:
    """OK after a ping through a SOCKS5 tunnel, else ``socks:CODE``."""
    assert proxy.socks_address is not None
    reader, writer = await asyncio.open_connection(*proxy.socks_address)
    try:
        writer.write(b"\x05\x01\x00")
        assert await reader.readexactly(2) == b"\x05\x00"
        name = host.encode()
        writer.write(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + port.to_bytes(2, "big"))
        version, code, _, atyp = await reader.readexactly(4)
        await reader.readexactly({1: 4, 4: 16}[atyp] + 2)
        assert version == 5
        return await _ping(reader, writer) if code == 0 else f"socks:{code}"
    finally:
        writer.close()


async def visit(proxy: EgressProxy, protocol: AuditProtocol, host: str, port: int) -> str:
    client = via_socks if protocol is AuditProtocol.SOCKS5 else via_connect
    return await asyncio.wait_for(client(proxy, host, port), IO_TIMEOUT)


def run_audit(argv: Sequence[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="egressbox audit")
    audit_cli.configure(parser)
    out, err = io.StringIO(), io.StringIO()
    code = audit_cli.run(parser.parse_args(list(argv)), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def resolver_for(server: DnsServer) -> DnsResolver:
    return DnsResolver([server.nameserver], timeout=2.0)


# --------------------------------------------------------------------------- concurrent load

LOAD_CONNECTIONS = 400
LOAD_NAMES = 10


@dataclass(frozen=True)
class Visit:
    protocol: AuditProtocol
    host: str
    port: int
    decision: Verdict
    reason: Reason

    @property
    def key(self) -> tuple[str, str, int, str, str]:
        return (self.protocol.value, self.host, self.port, self.decision, self.reason)


def load_plan(origin_port: int) -> list[Visit]:
    """What each client does and the decision it must get, cycling through every kind."""
    kinds = [
        *[
            (f"h{i}.load.test", origin_port, Verdict.ALLOW, Reason.ALLOWED)
            for i in range(LOAD_NAMES)
        ],
        ("ok.test", origin_port, Verdict.ALLOW, Reason.ALLOWED),
        ("bad.load.test", origin_port, Verdict.DENY, Reason.DENY_RULE),
        ("nope.test", 443, Verdict.DENY, Reason.NO_ALLOW_RULE),
        ("priv.load.test", origin_port, Verdict.DENY, Reason.PRIVATE_ADDRESS),
        ("nx.load.test", origin_port, Verdict.DENY, Reason.DNS_FAILURE),
    ]
    plan = []
    for i in range(LOAD_CONNECTIONS):
        host, port, decision, reason = kinds[i % len(kinds)]
        protocol = AuditProtocol.SOCKS5 if i % 3 == 0 else AuditProtocol.CONNECT
        plan.append(Visit(protocol, host, port, decision, reason))
    return plan


def load_policy_for(origin_port: int) -> Policy:
    return parse_policy(
        {
            "egress": {
                "allow": [f"*.load.test:{origin_port}", "ok.test"],
                "deny": ["bad.load.test"],
                "allow_cidrs": ["127.0.0.0/8"],
            }
        },
        env={},
    )


def program_load_zone(server: DnsServer) -> None:
    for i in range(LOAD_NAMES):
        server.set(f"h{i}.load.test", A(LOOPBACK))
    for name in ("ok.test", "bad.load.test"):
        server.set(name, A(LOOPBACK))
    server.set("priv.load.test", A("10.0.0.1"))
    server.set_behaviour("nx.load.test", NXDOMAIN)


async def drive(proxy: EgressProxy, plan: Sequence[Visit]) -> list[str]:
    gate = asyncio.Semaphore(MAX_CONCURRENT)

    async def one(item: Visit) -> str:
        async with gate:
            return await visit(proxy, item.protocol, item.host, item.port)

    return list(await asyncio.gather(*(one(item) for item in plan)))


async def test_reader_matches_the_proxy_exactly_under_concurrent_load(
    dns_server: DnsServer, tmp_path: Path
) -> None:
    program_load_zone(dns_server)
    origin = await start_origin()
    log = tmp_path / "audit.jsonl"
    max_bytes = 4 * 1024
    plan = load_plan(origin.port)
    sink = JsonlFileSink(log, max_bytes=max_bytes, keep=10_000)
    proxy = EgressProxy(
        load_policy_for(origin.port),
        resolver=resolver_for(dns_server),
        audit=sink,
        keep_records=True,
    )
    try:
        async with proxy:
            outcomes = await drive(proxy, plan)
    finally:
        sink.close()
        await origin.close()

    # Every allowed client really reached the origin; every refusal said why.
    for item, outcome in zip(plan, outcomes, strict=True):
        if item.decision is Verdict.ALLOW:
            assert outcome == OK, (item, outcome)
        else:
            assert outcome != OK, (item, outcome)
            if item.protocol is AuditProtocol.CONNECT:
                assert outcome == item.reason.value

    files = rotated_files(log)
    assert len(files) > 5, "the load should have rotated the log several times"
    assert all(os.path.getsize(name) <= max_bytes for name in files)

    # The reader's output over the rotated files is the proxy's record stream, exactly.
    code, out, err = run_audit(["--rotated", str(log), "--json"])
    assert (code, err) == (0, "")
    assert out.splitlines() == [record.to_json() for record in proxy.records]
    read = [AuditRecord.from_json(line) for line in out.splitlines()]
    got = Counter(
        (r.protocol.value, r.host, r.port, r.decision.value, r.reason.value) for r in read
    )
    assert got == Counter(item.key for item in plan)

    # The summary, per host:port, matches the plan exactly.
    code, out, err = run_audit(["--rotated", str(log), "--summary"])
    assert (code, err) == (0, "")
    summary = {(row["host"], row["port"]): row for row in map(json.loads, out.splitlines())}
    expected: dict[tuple[str, int], Counter[str]] = {}
    for item in plan:
        expected.setdefault((item.host, item.port), Counter())[item.decision.value] += 1
    assert {key: Counter(row["decisions"]) for key, row in summary.items()} == expected
    totals = [row["total"] for row in map(json.loads, out.splitlines())]
    assert totals == sorted(totals, reverse=True)

    # Filters over the same files.
    code, out, _ = run_audit([str(tmp_path), "--decision", "deny", "--protocol", "socks5"])
    denied_socks = [i for i in plan if i.decision is Verdict.DENY and i.protocol.value == "socks5"]
    assert len(out.splitlines()) == len(denied_socks)
    code, out, _ = run_audit([str(tmp_path), "--host", "h?.load.test"])
    assert len(out.splitlines()) == sum(
        1 for i in plan if i.host.endswith(".load.test") and i.host[1].isdigit()
    )


# --------------------------------------------------------------------------- the round trip

SIBLINGS = ("a.svc.test", "b.svc.test", "c.svc.test")


def program_roundtrip_zone(server: DnsServer) -> None:
    for name in (*SIBLINGS, "d.svc.test", "api.test", "other.test", "blocked.test"):
        server.set(name, A(LOOPBACK))


async def run_client(proxy: EgressProxy, port: int) -> dict[str, str]:
    """The "trusted program": a fixed set of destinations over both listeners."""
    outcomes = {}
    for name in SIBLINGS:
        outcomes[name] = await visit(proxy, AuditProtocol.CONNECT, name, port)
    outcomes["api.test"] = await visit(proxy, AuditProtocol.SOCKS5, "api.test", port)
    outcomes[LOOPBACK] = await visit(proxy, AuditProtocol.CONNECT, LOOPBACK, port)
    outcomes["blocked.test"] = await visit(proxy, AuditProtocol.CONNECT, "blocked.test", port)
    assert proxy.http_address is not None
    outcomes["self"] = await visit(proxy, AuditProtocol.CONNECT, LOOPBACK, proxy.http_address[1])
    return outcomes


REPORT_POLICY = """\
[egress]
mode = "report"
deny = ["blocked.test"]
allow_cidrs = ["127.0.0.0/8"]
"""


async def test_report_suggest_enforce_round_trip(dns_server: DnsServer, tmp_path: Path) -> None:
    program_roundtrip_zone(dns_server)
    origin = await start_origin()
    other = await start_origin()
    report_file = tmp_path / "report.toml"
    report_file.write_text(REPORT_POLICY)
    report = load_policy(str(report_file), env={})
    assert report.mode is Mode.REPORT
    log = tmp_path / "report.jsonl"
    resolver = resolver_for(dns_server)
    try:
        # 1. Learn: report mode lets everything but the enforced bans through.
        sink = JsonlFileSink(log)
        try:
            async with EgressProxy(report, resolver=resolver, audit=sink, keep_records=True) as p:
                learned = await run_client(p, origin.port)
                learned_records = p.records
        finally:
            sink.close()
        expected = {name: OK for name in (*SIBLINGS, "api.test", LOOPBACK)}
        expected |= {"blocked.test": "deny_rule", "self": "self_connection"}
        assert learned == expected
        assert {r.decision for r in learned_records} == {Verdict.WOULD_DENY, Verdict.DENY}

        code, out, err = run_audit([str(log), "--json"])
        assert (code, err) == (0, "")
        assert out.splitlines() == [r.to_json() for r in learned_records]

        # 2. Suggest, and check it as a user would.
        suggested = tmp_path / "suggested.toml"
        argv = [
            "--suggest-policy",
            str(log),
            "--base-policy",
            str(report_file),
            "-o",
            str(suggested),
        ]
        assert run_audit(argv)[0] == 0
        assert cli_main(["check", str(suggested)]) == 0
        enforced = load_policy(str(suggested), env={})
        assert enforced.mode is Mode.ENFORCE
        assert sorted(rule.text for rule in enforced.allow.rules) == sorted(
            [f"*.svc.test:{origin.port}", f"api.test:{origin.port}", f"127.0.0.1:{origin.port}"]
        )
        text = suggested.read_text()
        # A loopback destination the program used is admitted (the base policy's allow_cidrs
        # already lift the ban; otherwise core/local.py adds the one-address grant, said why);
        # the proxy's own port stays a comment.
        assert f'    "127.0.0.1:{origin.port}",' in text
        assert 'allow_cidrs = ["127.0.0.0/8"]' in text
        assert f'# "127.0.0.1:{proxy_port_of(learned_records)}",' in text  # self: commented out

        # 3. Enforce: the same client succeeds; new destinations are denied.
        async with EgressProxy(enforced, resolver=resolver, keep_records=True) as proxy:
            again = await run_client(proxy, origin.port)
            # Enforced, the proxy's own port has no allow entry: refused before the loop check.
            assert again == expected | {"self": "no_allow_rule", LOOPBACK: OK}
            assert await visit(proxy, AuditProtocol.CONNECT, "other.test", origin.port) == (
                "no_allow_rule"
            )
            assert await visit(proxy, AuditProtocol.CONNECT, "a.svc.test", other.port) == (
                "no_allow_rule"
            )
            assert await visit(proxy, AuditProtocol.CONNECT, "d.svc.test", origin.port) == OK
            decisions = Counter((r.decision, r.reason) for r in proxy.records)
        assert decisions == Counter(
            {
                (Verdict.ALLOW, Reason.ALLOWED): 6,
                (Verdict.DENY, Reason.DENY_RULE): 1,
                (Verdict.DENY, Reason.NO_ALLOW_RULE): 3,
            }
        )
    finally:
        await origin.close()
        await other.close()


def proxy_port_of(records: Sequence[AuditRecord]) -> int:
    return next(r.port for r in records if r.reason is Reason.SELF_CONNECTION)
