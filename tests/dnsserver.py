"""A real authoritative DNS server on loopback, for tests.

It answers over UDP and TCP on one ephemeral port, from a zone that tests
program per name: records (A, AAAA, CNAME with TTLs), answers that change
between queries (the DNS-rebinding case), NXDOMAIN, SERVFAIL, REFUSED,
silence (to test timeouts) and forced truncation (so a client must retry over
TCP). Every query is logged as (name, type, transport), so a test can assert
which queries were made, or that none was.

The server runs its own event loop in a background thread, so sync and async
tests use it alike:

    with DnsServer({"a.test": [A("192.0.2.1")]}) as server:
        server.set("b.test", CNAME("a.test"))
        server.set_sequence("rebind.test", [[A("192.0.2.7", ttl=0)], [A("127.0.0.1", ttl=0)]])
        server.set_behaviour("slow.test", SILENT)
        ...  # point a resolver at server.nameserver ("127.0.0.1", port)
        assert server.queries_for("a.test") == []

The `dns_server` fixture yields a started server and stops it afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, cast

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import pytest

# Seconds the test thread waits for the server to start or stop: generous, as
# a loaded CI machine can be slow, yet a hang still fails the test run.
CONTROL_TIMEOUT = 10.0
# Tries to find one port free for both UDP and TCP (TCP picks it, UDP may clash).
BIND_ATTEMPTS = 20
# Default record TTL, and the default negative TTL (SOA minimum) of
# NXDOMAIN/NODATA answers: long, so caching tests are not cut short by the
# absent type.
DEFAULT_TTL = 300
NEGATIVE_TTL = 3600
# Longest CNAME chain followed inside the zone (dnspython gives up at 16 too).
MAX_CHAIN = 16
# Largest UDP answer for a query without EDNS (RFC 1035 §4.2.1).
CLASSIC_UDP_SIZE = 512

Transport = Literal["udp", "tcp"]


class Behaviour(enum.Enum):
    """A programmed misbehaviour for a name."""

    NXDOMAIN = "nxdomain"
    SERVFAIL = "servfail"
    REFUSED = "refused"
    SILENT = "silent"  # never answer: the client must time out


NXDOMAIN = Behaviour.NXDOMAIN
SERVFAIL = Behaviour.SERVFAIL
REFUSED = Behaviour.REFUSED
SILENT = Behaviour.SILENT


@dataclass(frozen=True, slots=True)
class Record:
    rtype: str  # "A", "AAAA" or "CNAME"
    value: str
    ttl: int = DEFAULT_TTL


def A(address: str, ttl: int = DEFAULT_TTL) -> Record:
    return Record("A", address, ttl)


def AAAA(address: str, ttl: int = DEFAULT_TTL) -> Record:
    return Record("AAAA", address, ttl)


def CNAME(target: str, ttl: int = DEFAULT_TTL) -> Record:
    return Record("CNAME", target, ttl)


@dataclass(frozen=True, slots=True)
class Query:
    name: str  # lowercase, no trailing dot
    rtype: str  # "A", "AAAA", ...
    transport: Transport


# One answer set, or a behaviour, that a name serves for one query.
Step = tuple[Record, ...] | Behaviour


@dataclass
class _Entry:
    steps: list[Step]
    truncate: bool = False
    by_type: dict[str, Behaviour] = field(default_factory=dict)
    # Queries served so far per type: A and AAAA of one lookup see the same step.
    served: dict[str, int] = field(default_factory=dict)

    def next_step(self, rtype: str) -> Step:
        if rtype in self.by_type:
            return self.by_type[rtype]
        index = self.served.get(rtype, 0)
        self.served[rtype] = index + 1
        return self.steps[min(index, len(self.steps) - 1)]


def _norm(name: str | dns.name.Name) -> str:
    text = name.to_text() if isinstance(name, dns.name.Name) else name
    return text.lower().removesuffix(".")


class DnsServer:
    """An authoritative server for any name, on UDP and TCP of one loopback port."""

    def __init__(
        self,
        zone: Mapping[str, Sequence[Record] | Behaviour] | None = None,
        *,
        host: str = "127.0.0.1",
        negative_ttl: int = NEGATIVE_TTL,
    ) -> None:
        self.host = host
        self.negative_ttl = negative_ttl
        self.port = 0
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._log: list[Query] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tcp_tasks: set[asyncio.Task[None]] = set()
        self.errors: list[Exception] = []  # exceptions raised while answering
        for name, value in (zone or {}).items():
            if isinstance(value, Behaviour):
                self.set_behaviour(name, value)
            else:
                self.set(name, *value)

    # -- programming the zone (any thread) --------------------------------

    def set(self, name: str, *records: Record, truncate: bool = False) -> None:
        """Serve these records for `name` (no records: the name exists, NODATA)."""
        self.set_sequence(name, [records], truncate=truncate)

    def set_sequence(
        self, name: str, steps: Sequence[Sequence[Record] | Behaviour], *, truncate: bool = False
    ) -> None:
        """Serve the steps in turn, one per query of each type; the last one repeats."""
        if not steps:
            raise ValueError("set_sequence needs at least one step")
        frozen: list[Step] = [s if isinstance(s, Behaviour) else tuple(s) for s in steps]
        with self._lock:
            self._entries[_norm(name)] = _Entry(frozen, truncate)

    def set_behaviour(
        self, name: str, behaviour: Behaviour, *, only: Iterable[str] | None = None
    ) -> None:
        """Misbehave for `name`; with `only`, just for those query types (e.g. "AAAA")."""
        key = _norm(name)
        with self._lock:
            if only is None:
                self._entries[key] = _Entry([behaviour])
                return
            entry = self._entries.setdefault(key, _Entry([()]))
            for rtype in only:
                entry.by_type[rtype.upper()] = behaviour

    def remove(self, name: str) -> None:
        """Forget `name`: it is NXDOMAIN from now on."""
        with self._lock:
            self._entries.pop(_norm(name), None)

    # -- the query log ------------------------------------------------------

    @property
    def queries(self) -> list[Query]:
        """Every query received so far, in order (a copy)."""
        with self._lock:
            return list(self._log)

    def queries_for(self, name: str) -> list[Query]:
        key = _norm(name)
        return [q for q in self.queries if q.name == key]

    def clear_queries(self) -> None:
        with self._lock:
            self._log.clear()

    # -- addresses ----------------------------------------------------------

    @property
    def nameserver(self) -> tuple[str, int]:
        """(IP, port), as a resolver's nameservers list takes it."""
        return self.host, self.port

    @property
    def address(self) -> str:
        """The server as `--nameserver` takes it: "IP:PORT" or "[v6]:PORT"."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # -- life cycle (test thread) ---------------------------------------------

    def start(self) -> DnsServer:
        if self._loop is not None:
            raise RuntimeError("DnsServer already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="test-dns-server", daemon=True)
        self._loop, self._thread = loop, thread
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._open(), loop).result(CONTROL_TIMEOUT)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._close(), loop).result(CONTROL_TIMEOUT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CONTROL_TIMEOUT)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> DnsServer:
        # `with DnsServer(...).start() as server` works too: start() may come first.
        return self if self._loop is not None else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- the server (its own thread) --------------------------------------------

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(BIND_ATTEMPTS):
            tcp = await asyncio.start_server(self._serve_tcp, self.host, 0)
            port = tcp.sockets[0].getsockname()[1]
            try:
                udp, _ = await loop.create_datagram_endpoint(
                    lambda: _UdpProtocol(self), local_addr=(self.host, port)
                )
            except OSError:
                tcp.close()
                await tcp.wait_closed()
                continue
            self._tcp, self._udp, self.port = tcp, udp, port
            return
        raise OSError(f"no port free for both UDP and TCP on {self.host}")

    async def _close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for task in list(self._tcp_tasks):
            task.cancel()
        await asyncio.gather(*self._tcp_tasks, return_exceptions=True)
        if self._tcp is not None:
            await self._tcp.wait_closed()

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tcp_tasks.add(task)
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(2), "big")
                reply = self.respond(await reader.readexactly(size), "tcp")
                if reply is not None:  # silence: keep the connection, say nothing
                    writer.write(len(reply).to_bytes(2, "big") + reply)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._tcp_tasks.discard(task)
            writer.close()

    # -- answering (pure apart from the zone state) -------------------------------

    def respond(self, wire: bytes, transport: Transport) -> bytes | None:
        """The reply to one query message, or None to stay silent."""
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None  # not DNS: drop it, as servers do
        try:
            return self._answer(query, transport)
        except Exception as exc:
            # A bug here must not look like a timeout to the test: record it
            # and fail fast with SERVFAIL.
            with self._lock:
                self.errors.append(exc)
            response = dns.message.make_response(query)
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()

    def _answer(self, query: dns.message.Message, transport: Transport) -> bytes | None:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if len(query.question) != 1:
            response.set_rcode(dns.rcode.FORMERR)
            return response.to_wire()
        question = query.question[0]
        rtype = dns.rdatatype.to_text(question.rdtype)
        name = _norm(question.name)
        with self._lock:
            self._log.append(Query(name, rtype, transport))
            entry = self._entries.get(name)
            if entry is not None and entry.truncate and transport == "udp":
                response.flags |= dns.flags.TC  # no step used: the TCP retry gets it
                return response.to_wire()
            if not self._fill(response, name, rtype):
                return None
        return _to_wire(response, query, transport)

    def _fill(self, response: dns.message.Message, name: str, rtype: str) -> bool:
        """Answer `name` (following CNAMEs in the zone); False means stay silent."""
        for _ in range(MAX_CHAIN):
            entry = self._entries.get(name)
            step = entry.next_step(rtype) if entry else Behaviour.NXDOMAIN
            if isinstance(step, Behaviour):
                return _misbehave(response, step, self.negative_ttl)
            matching = [r for r in step if r.rtype == rtype]
            cnames = [r for r in step if r.rtype == "CNAME"]
            if matching or not cnames:
                _add(response, name, rtype, matching, self.negative_ttl)
                return True
            _add(response, name, "CNAME", cnames[:1], self.negative_ttl)
            name = _norm(cnames[0].value)
        return True  # a loop: hand back the chain so far, the client rejects it


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self._server = server
        self._transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector loop's datagram transport does not subclass DatagramTransport.
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        reply = self._server.respond(data, "udp")
        if reply is not None and self._transport is not None:
            self._transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # a client that went away (ICMP unreachable) is not our problem


def _misbehave(response: dns.message.Message, behaviour: Behaviour, negative_ttl: int) -> bool:
    if behaviour is Behaviour.SILENT:
        return False
    rcode = {
        Behaviour.NXDOMAIN: dns.rcode.NXDOMAIN,
        Behaviour.SERVFAIL: dns.rcode.SERVFAIL,
        Behaviour.REFUSED: dns.rcode.REFUSED,
    }[behaviour]
    response.set_rcode(rcode)
    if behaviour is Behaviour.NXDOMAIN:
        response.authority.append(_soa(negative_ttl))
    return True


def _add(
    response: dns.message.Message, name: str, rtype: str, records: list[Record], negative_ttl: int
) -> None:
    if not records:
        response.authority.append(_soa(negative_ttl))  # NODATA: the SOA gives the negative TTL
        return
    ttl = min(r.ttl for r in records)  # one RRset has one TTL
    # A CNAME target must be absolute, or it cannot be put on the wire.
    values = [_norm(r.value) + "." if r.rtype == "CNAME" else r.value for r in records]
    response.answer.append(dns.rrset.from_text_list(name + ".", ttl, "IN", rtype, values))


def _soa(negative_ttl: int) -> dns.rrset.RRset:
    # At the root, so it is "a superdomain" of every name the server answers.
    rdata = f"ns.test. hostmaster.test. 1 3600 600 86400 {negative_ttl}"
    return dns.rrset.from_text(".", negative_ttl, "IN", "SOA", rdata)


def _to_wire(response: dns.message.Message, query: dns.message.Message, transport: str) -> bytes:
    if transport == "tcp":
        return response.to_wire()
    limit = max(query.payload, CLASSIC_UDP_SIZE) if query.edns >= 0 else CLASSIC_UDP_SIZE
    try:
        return response.to_wire(max_size=limit)
    except dns.exception.TooBig:
        # Too big for UDP: an empty answer with TC set, as real servers send.
        truncated = dns.message.make_response(query)
        truncated.flags |= dns.flags.AA | dns.flags.TC
        return truncated.to_wire()


@pytest.fixture
def dns_server() -> Iterator[DnsServer]:
    """A started DnsServer on 127.0.0.1 with an empty zone (every name NXDOMAIN)."""
    with DnsServer() as server:
        yield server
