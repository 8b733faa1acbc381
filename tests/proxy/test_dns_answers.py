"""egressbox's DNS inside a child's namespace, asked directly: synthetic answers for names the
policy could admit, NXDOMAIN without any upstream query for the rest, every question audited
with protocol `dns` and port 0. The upstream is the tests' own DNS server on loopback."""

from __future__ import annotations

import ipaddress
import secrets

import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from dnsserver import DnsServer
from egressbox.core.synthetic import V4_NETWORK, V6_NETWORK, SyntheticNames
from egressbox.proxy.dns import Answerer
from proxy_fixtures import StartProxy, Wire

pytestmark = pytest.mark.usefixtures("dials")


async def _ask(answerer: Answerer, name: str, rdtype: str) -> dns.message.Message:
    wire = await answerer.respond(dns.message.make_query(name, rdtype).to_wire())
    assert wire is not None
    return dns.message.from_wire(wire)


def _addresses(reply: dns.message.Message) -> list[str]:
    return [item.to_text() for rrset in reply.answer for item in rrset]


async def test_an_admitted_name_gets_its_synthetic_addresses(
    start_proxy: StartProxy, wire: Wire
) -> None:
    proxy = await start_proxy()
    answerer = Answerer(proxy.state, SyntheticNames())
    a = await _ask(answerer, "origin.test", "A")
    aaaa = await _ask(answerer, "origin.test", "AAAA")
    assert a.rcode() == dns.rcode.NOERROR and aaaa.rcode() == dns.rcode.NOERROR
    v4, v6 = ipaddress.ip_address(_addresses(a)[0]), ipaddress.ip_address(_addresses(aaaa)[0])
    assert v4 in V4_NETWORK and v6 in V6_NETWORK
    assert all(rrset.ttl <= 10 for rrset in (*a.answer, *aaaa.answer))
    again = await _ask(answerer, "ORIGIN.test.", "A")
    assert _addresses(again) == [str(v4)]  # one name, one address, however spelt
    ptr = await _ask(answerer, v4.reverse_pointer, "PTR")
    assert _addresses(ptr) == ["origin.test."]
    assert wire.summary(proxy.records) == [("dns", "origin.test", 0, "allow", "allowed")] * 3


async def test_a_name_no_entry_admits_is_nxdomain_without_an_upstream_query(
    start_proxy: StartProxy, zone: DnsServer, wire: Wire
) -> None:
    proxy = await start_proxy()
    answerer = Answerer(proxy.state, SyntheticNames())
    zone.clear_queries()
    labels = [secrets.token_hex(8) for _ in range(5)]
    for label in labels:
        reply = await _ask(answerer, f"{label}.exfil.example", "A")
        assert reply.rcode() == dns.rcode.NXDOMAIN and not reply.answer
    assert zone.queries == []  # nothing the child chose reached a resolver
    assert [r[3:] for r in wire.summary(proxy.records)] == [("deny", "no_allow_rule")] * 5
    assert {r[0] for r in wire.summary(proxy.records)} == {"dns"}


async def test_a_denied_or_private_answer_is_nxdomain_and_audited(
    start_proxy: StartProxy, wire: Wire
) -> None:
    proxy = await start_proxy()
    answerer = Answerer(proxy.state, SyntheticNames())
    denied = await _ask(answerer, "blocked.ok.test", "A")
    rebound = await _ask(answerer, "rebind.test", "A")
    assert denied.rcode() == dns.rcode.NXDOMAIN and rebound.rcode() == dns.rcode.NXDOMAIN
    reasons = [r[4] for r in wire.summary(proxy.records)]
    assert reasons[0] == "deny_rule" and reasons[1] in ("private_address", "dns_failure")


async def test_other_types_and_foreign_reverse_lookups(start_proxy: StartProxy) -> None:
    proxy = await start_proxy()
    answerer = Answerer(proxy.state, SyntheticNames())
    txt = await _ask(answerer, "origin.test", "TXT")
    assert txt.rcode() == dns.rcode.NOERROR and not txt.answer
    foreign = await _ask(answerer, ipaddress.ip_address("8.8.8.8").reverse_pointer, "PTR")
    assert foreign.rcode() == dns.rcode.NXDOMAIN
    assert await answerer.respond(b"\x00\x01") is None
    formerr = await answerer.respond(b"\x12\x34" + b"\x01\x00" + b"\x00" * 8 + b"\xff")
    assert formerr is not None and dns.message.from_wire(formerr).rcode() == dns.rcode.FORMERR
    assert dns.rdatatype.TXT  # the type exists in this dnspython
