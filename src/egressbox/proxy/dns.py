"""egressbox's DNS inside a child's namespace: names the policy could admit, and no others.

With capture on, the child's /etc/resolv.conf names 127.0.0.53, where the launcher bound a UDP
socket and a TCP listener that this module serves. A question for a name that some allow entry
could admit goes through the gate as a request would (name rules, egressbox's own resolution,
every address checked; audited with protocol `dns` and port 0); if the gate allows it, the answer
is the name's synthetic address (synthetic.py), never a real one, so the child's connection to it
is captured and decided again as `name:port`. Any other question is NXDOMAIN, audited, without
any upstream query: labels chosen by the child exfiltrate nothing. Reverse lookups of synthetic
addresses answer the name. Other record types of an admitted name get an empty answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import TYPE_CHECKING

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from egressbox.audit.record import AuditProtocol
from egressbox.core.decide import Decision, bad_target, deny, parse_target
from egressbox.core.errors import HostError, Reason
from egressbox.core.synthetic import TTL, ExhaustedError, SyntheticNames, address_of_reverse

if TYPE_CHECKING:
    from egressbox.proxy.gate import ProxyState

# The port a name is judged for when every entry that could admit it names no port.
DEFAULT_PORT = 443
# A DNS message over TCP is length-prefixed (RFC 1035 4.2.2); one connection may carry several.
MAX_TCP_MESSAGE = 65535
TCP_IDLE_TIMEOUT = 10.0
# Questions decided at once per socket: a child flooding the resolver waits, it does not
# make the proxy hold unbounded work.
MAX_IN_FLIGHT = 64
ADDRESS_TYPES = (dns.rdatatype.A, dns.rdatatype.AAAA)


class Answerer:
    """Turns one query message into one response message (bytes in, bytes out)."""

    def __init__(self, state: ProxyState, names: SyntheticNames) -> None:
        self.state = state
        self.names = names

    async def respond(self, wire: bytes) -> bytes | None:
        """The response to `wire`; None when it is not even a DNS header (drop it)."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return _formerr(wire)
        response = dns.message.make_response(query, recursion_available=True)
        if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
            response.set_rcode(dns.rcode.NOTIMP if query.question else dns.rcode.FORMERR)
            return response.to_wire()
        question = query.question[0]
        if question.rdclass != dns.rdataclass.IN:
            response.set_rcode(dns.rcode.REFUSED)
            return response.to_wire()
        await self._answer(question.name, question.rdtype, response)
        return response.to_wire()

    async def _answer(
        self, qname: dns.name.Name, rdtype: int, response: dns.message.Message
    ) -> None:
        text = qname.to_text(omit_final_dot=True)
        if rdtype == dns.rdatatype.PTR:
            self._reverse(qname, text, response)
            return
        decision = await self.decide(text)
        if not decision.allowed:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return
        if rdtype not in ADDRESS_TYPES:
            return  # the name exists; it has no records of this type for the child
        try:
            v4, v6 = self.names.addresses(decision.host)
        except ExhaustedError:
            response.set_rcode(dns.rcode.SERVFAIL)
            return
        address = str(v4 if rdtype == dns.rdatatype.A else v6)
        kind = dns.rdatatype.A if rdtype == dns.rdatatype.A else dns.rdatatype.AAAA
        rrset = dns.rrset.from_text(qname, TTL, dns.rdataclass.IN, kind, address)
        response.answer.append(rrset)

    def _reverse(self, qname: dns.name.Name, text: str, response: dns.message.Message) -> None:
        address = address_of_reverse(text)
        name = self.names.name_for(address) if address is not None else None
        if name is None:
            # Not one of ours: a real address's name is none of the child's business.
            self._audit_refusal(text, Reason.NO_ALLOW_RULE, "a reverse lookup of another address")
            response.set_rcode(dns.rcode.NXDOMAIN)
            return
        rrset = dns.rrset.from_text(qname, TTL, dns.rdataclass.IN, dns.rdatatype.PTR, name + ".")
        response.answer.append(rrset)

    async def decide(self, name: str) -> Decision:
        """The gate's decision for a name, judged for the port of an entry that could admit
        it, and audited with protocol dns and port 0 (a question has no port)."""
        from egressbox.proxy.gate import gate_audited, gate_now

        state = self.state
        port = self._port_for(name)
        if port is None:
            return self._audit_refusal(name, Reason.NO_ALLOW_RULE, "no allow entry names it")
        decided = gate_now(state, AuditProtocol.DNS, name, port, record_port=0)
        if isinstance(decided, Decision):
            return decided
        finished = await decided.finish()
        return gate_audited(state, AuditProtocol.DNS, finished, name, port, record_port=0)

    def _port_for(self, name: str) -> int | None:
        """A port some allow entry admits `name` on; None when none could admit it (then no
        resolver is asked). In report mode every name is judged (as the proxy would)."""
        policy = self.state.policy
        if policy is None:
            return None
        try:
            host = parse_target(name, DEFAULT_PORT).host
        except HostError:
            return DEFAULT_PORT  # the gate says bad_host, audited
        if host.is_ip:
            return None  # an address is no name to look up
        near = policy.allow.for_any_port(host.text, None)
        if not near:
            return DEFAULT_PORT if policy.mode.value == "report" else None
        ports = [rule.port for rule in near]
        return DEFAULT_PORT if None in ports else next(p for p in ports if p is not None)

    def _audit_refusal(self, name: str, reason: Reason, detail: str) -> Decision:
        from egressbox.proxy.gate import gate_audited

        try:
            target = parse_target(name, DEFAULT_PORT)
        except HostError as exc:
            decision = bad_target(exc, 0)
        else:
            decision = deny(reason, target, detail)
        return gate_audited(self.state, AuditProtocol.DNS, decision, name, 0, record_port=0)


def _formerr(wire: bytes) -> bytes | None:
    """FORMERR for a message that has at least a header (its id is kept), else nothing."""
    if len(wire) < 12:
        return None
    ident, flags = struct.unpack("!HH", wire[:4])
    reply = (flags | 0x8000) & ~0x000F | dns.rcode.FORMERR  # QR set, the rcode FORMERR
    return struct.pack("!HHHHHH", ident, reply & 0xFFFF, 0, 0, 0, 0)


class UdpServer(asyncio.DatagramProtocol):
    """Answers each datagram on the namespace's DNS socket."""

    def __init__(self, answerer: Answerer) -> None:
        self.answerer = answerer
        self.transport: asyncio.DatagramTransport | None = None
        self.in_flight = 0
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        if self.in_flight >= MAX_IN_FLIGHT:
            return  # a resolver retries; a flood waits its turn
        self.in_flight += 1
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | object, int]) -> None:
        try:
            out = await self.answerer.respond(data)
            if out is not None and self.transport is not None:
                self.transport.sendto(out, addr)
        except Exception as exc:  # a bug must not stop the resolver
            self.answerer.state.internal_error("dns", exc)
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.transport is not None:
            self.transport.close()


async def serve_tcp(
    answerer: Answerer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Length-prefixed messages on one TCP connection, until it ends or goes idle."""
    try:
        while True:
            async with asyncio.timeout(TCP_IDLE_TIMEOUT):
                size = struct.unpack("!H", await reader.readexactly(2))[0]
                wire = await reader.readexactly(size)
            out = await answerer.respond(wire)
            if out is None:
                break
            writer.write(struct.pack("!H", len(out)) + out)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        pass
    except Exception as exc:  # a bug must not stop the resolver
        answerer.state.internal_error("dns", exc)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, TimeoutError):
            await writer.wait_closed()
