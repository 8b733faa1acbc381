"""Name resolution for the proxy: the hosts file, then DNS, with a bounded TTL cache.

The proxy resolves every name itself and dials only the addresses it checked
(DESIGN §3.3), so this module is the only place a name becomes addresses.

Without explicit nameservers it behaves like the system's stub resolver: the
hosts file first, then the servers of the system configuration (resolv.conf).
With explicit nameservers (`--nameserver`) it asks only those, and never falls
back to the hosts file or the system configuration, even on NXDOMAIN or a
timeout: a user who names the servers gets exactly those servers.

A and AAAA are queried concurrently through dnspython, UDP with TCP fallback
on truncation, never with search domains, and the whole resolution (both
types, every server, every retry) ends within `timeout`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from egressbox.core.errors import Reason, ResolveError
from egressbox.core.ip import IPAddress
from egressbox.core.limits import DNS_CACHE_SIZE, DNS_MAX_TTL
from egressbox.core.limits import DNS_TIMEOUT as _LIMITS_DNS_TIMEOUT

if TYPE_CHECKING:
    from egressbox.core.policy import Policy


# The values and the reasoning behind them live in egressbox.core.limits, the one
# place for every limit: a whole resolution ends within 5 s (glibc's default
# per try), 4096 names (about 1 MiB), answers reused for at most 300 s so a
# change in DNS is seen within five minutes whatever the record's TTL.
DNS_TIMEOUT: float = _LIMITS_DNS_TIMEOUT
CACHE_SIZE: int = DNS_CACHE_SIZE
MAX_CACHE_TTL: float = DNS_MAX_TTL

# The well-known DNS port (RFC 1035 §4.2); resolv.conf cannot name another one.
DNS_PORT = 53
# Where the hosts file and the resolver configuration live on POSIX systems.
HOSTS_PATH = "/etc/hosts"
RESOLV_CONF = "/etc/resolv.conf"
# The hosts file and resolv.conf are stat()ed at most this often: a second is
# fresh enough for a human edit and keeps a syscall off every lookup.
RECHECK_INTERVAL = 1.0

_PORT_TEXT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True, slots=True)
class Resolution:
    """The addresses a name resolved to, and how they were found."""

    addresses: tuple[IPAddress, ...]  # deduplicated, non-empty; A answers first
    names: tuple[str, ...]  # the queried name, then each CNAME target in order
    ttl: float  # seconds this answer may still be reused
    source: str  # "hosts" | "dns" | "cache"

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("a Resolution needs at least one address")


class Resolver(Protocol):
    """What the proxy needs from a resolver (a seam: tests pass their own).

    A resolver may also offer `resolve_now(host) -> Resolution | None`: the
    answer when no query is needed (cache, hosts file), else None. The proxy
    then decides such names without a Task (see egress.check_now).
    """

    async def resolve(self, host: str) -> Resolution:
        """Resolve a normalized name (lowercase ASCII, no trailing dot, not an IP).

        Raises ResolveError with reason dns_failure or dns_timeout.
        """
        ...


class DnsMeter(Protocol):
    """Told of every query a DnsResolver sends (one per shared query: its seconds and
    outcome, `answer` or a ResolveError's reason) and of every answer taken from its
    cache; serve's metrics (egressbox.serve.metrics) count them."""

    def dns_query(self, seconds: float, outcome: str) -> None: ...

    def dns_cache_hit(self) -> None: ...


# --------------------------------------------------------------------------
# Nameserver text


def parse_nameserver(text: str) -> tuple[str, int]:
    """Parse "IP", "IP:PORT", "[v6]" or "[v6]:PORT" into (canonical IP, port).

    The port defaults to 53. A name is refused: resolving the resolver's own
    address would need a resolver.
    """
    value = text.strip()
    if value.startswith("["):
        host, sep, port_text = value[1:].partition("]")
        if not sep or (port_text and not port_text.startswith(":")):
            raise ValueError(_nameserver_usage(text, "unbalanced brackets"))
        ip = _nameserver_ip(text, host, ipaddress.IPv6Address)
        return ip, _nameserver_port(text, port_text[1:] if port_text else None)
    if value.count(":") > 1:
        # A bare IPv6 address; a port needs the brackets to be unambiguous.
        return _nameserver_ip(text, value, ipaddress.IPv6Address), DNS_PORT
    host, sep, port_text = value.partition(":")
    ip = _nameserver_ip(text, host, ipaddress.IPv4Address)
    return ip, _nameserver_port(text, port_text if sep else None)


def _nameserver_ip(
    text: str, host: str, kind: type[ipaddress.IPv4Address] | type[ipaddress.IPv6Address]
) -> str:
    if "%" in host:
        raise ValueError(_nameserver_usage(text, "a zone id (%) is not supported"))
    try:
        return str(kind(host))
    except ValueError:
        pass
    what = "IPv6 address" if kind is ipaddress.IPv6Address else "IP address"
    hint = f"{host!r} is not an {what}" if host else "the address is missing"
    if host and not _looks_numeric(host):
        hint += " (names are not accepted: the nameserver must be an IP address)"
    raise ValueError(_nameserver_usage(text, hint))


def _looks_numeric(host: str) -> bool:
    return all(c in "0123456789abcdefABCDEF.:" for c in host)


def _nameserver_port(text: str, port_text: str | None) -> int:
    if port_text is None:
        return DNS_PORT
    if not _PORT_TEXT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
        raise ValueError(_nameserver_usage(text, f"port {port_text!r} is not 1-65535"))
    return int(port_text)


def _nameserver_usage(text: str, problem: str) -> str:
    return f"bad nameserver {text!r}: {problem}; expected IP, IP:PORT, [IPv6] or [IPv6]:PORT"


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _seconds(value: float) -> str:
    # "5.0 s" and "0.5 s", but "0.25 s" rather than a misleading "0.2 s".
    return f"{value:.1f}" if round(value, 1) == value else f"{value:.3g}"


# --------------------------------------------------------------------------
# Files that are re-read when they change


class _FileWatch:
    """Tells whether a file changed, stat()ing it at most once per interval."""

    def __init__(self, path: str, clock: Callable[[], float]) -> None:
        self.path = path
        self._clock = clock
        self._checked_at: float | None = None
        self._stamp: tuple[int, int, int, int] | None = None

    def changed(self) -> bool:
        """True on the first call and whenever the file's identity or mtime moved."""
        now = self._clock()
        first = self._checked_at is None
        if not first and 0 <= now - (self._checked_at or 0.0) < RECHECK_INTERVAL:
            return False
        self._checked_at = now
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)
        except OSError:
            stamp = None
        moved = stamp != self._stamp
        self._stamp = stamp
        return first or moved


def parse_hosts(text: str) -> dict[str, tuple[IPAddress, ...]]:
    """Parse hosts-file text into name -> addresses, skipping malformed lines.

    Names are lowercased with one trailing dot stripped, the form every host
    reaching the resolver is in. A name on several lines collects every
    address, in file order, as glibc's getaddrinfo does.
    """
    table: dict[str, list[IPAddress]] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        address = _hosts_address(fields[0]) if len(fields) >= 2 else None
        if address is None:
            continue
        for raw in fields[1:]:
            name = raw.lower().removesuffix(".")
            if name and address not in table.setdefault(name, []):
                table[name].append(address)
    return {name: tuple(addresses) for name, addresses in table.items()}


def _hosts_address(text: str) -> IPAddress | None:
    # A scoped address (fe80::1%eth0) names an interface, not a destination
    # the proxy can pin and judge, so such lines are skipped like bad ones.
    if "%" in text:
        return None
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class _HostsFile:
    def __init__(self, path: str, clock: Callable[[], float]) -> None:
        self._watch = _FileWatch(path, clock)
        self._table: dict[str, tuple[IPAddress, ...]] = {}

    def lookup(self, host: str) -> tuple[IPAddress, ...]:
        if self._watch.changed():
            self._table = parse_hosts(_read_text(self._watch.path))
        return self._table.get(host, ())


def _read_text(path: str) -> str:
    # Small files read inline on purpose (at most once per change): a thread
    # hop would cost more than the read. A missing file is an empty one.
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return ""


# --------------------------------------------------------------------------
# Which DNS servers to ask


@dataclass(frozen=True, slots=True)
class _Upstream:
    """The resolver that asks the configured DNS servers, and how messages name them."""

    resolver: dns.asyncresolver.Resolver
    label: str  # "DNS server 127.0.0.1:5353", for messages


def _explicit_upstream(servers: Sequence[tuple[str, int]]) -> _Upstream:
    resolver = dns.asyncresolver.Resolver(configure=False)
    resolver.nameservers = [dns.nameserver.Do53Nameserver(ip, port) for ip, port in servers]
    return _Upstream(resolver, _servers_label([_hostport(ip, port) for ip, port in servers]))


def _servers_label(endpoints: Sequence[str], suffix: str = "") -> str:
    noun = "DNS server" if len(endpoints) == 1 else "DNS servers"
    return f"{noun} {', '.join(endpoints)}{suffix}"


class _SystemConfig:
    """The servers of resolv.conf, reloaded when the file changes (as glibc does)."""

    def __init__(self, path: str, clock: Callable[[], float]) -> None:
        self._watch = _FileWatch(path, clock)
        self._upstream: _Upstream | None = None
        self._problem = ""

    def get(self) -> _Upstream:
        if self._watch.changed():
            self._load()
        if self._upstream is None:
            raise ResolveError(Reason.DNS_FAILURE, self._problem)
        return self._upstream

    def _load(self) -> None:
        path = self._watch.path
        try:
            resolver = dns.asyncresolver.Resolver(filename=path, configure=True)
        except (dns.exception.DNSException, ValueError, OSError) as exc:
            self._upstream = None
            self._problem = (
                f"no usable DNS server in the system configuration ({path}: {exc}); "
                "give a nameserver explicitly"
            )
            return
        resolver.port = DNS_PORT
        endpoints = [_nameserver_text(ns, resolver.port) for ns in resolver.nameservers]
        self._upstream = _Upstream(resolver, _servers_label(endpoints, f" (from {path})"))


def _nameserver_text(nameserver: str | dns.nameserver.Nameserver, port: int) -> str:
    if isinstance(nameserver, dns.nameserver.AddressAndPortNameserver):
        return _hostport(nameserver.address, nameserver.port)
    return _hostport(nameserver, port) if isinstance(nameserver, str) else str(nameserver)


# --------------------------------------------------------------------------
# The cache


class _AnswerCache:
    """LRU of answers, each valid until min(TTL, max_ttl) seconds after it came."""

    def __init__(self, size: int, max_ttl: float) -> None:
        self._size = size
        self._max_ttl = max_ttl
        self._entries: OrderedDict[str, tuple[float, Resolution]] = OrderedDict()

    def get(self, host: str, now: float) -> Resolution | None:
        entry = self._entries.get(host)
        if entry is None:
            return None
        expires, answer = entry
        if now >= expires:
            del self._entries[host]
            return None
        self._entries.move_to_end(host)
        return replace(answer, ttl=expires - now, source="cache")

    def put(self, host: str, answer: Resolution, now: float) -> None:
        ttl = min(answer.ttl, self._max_ttl)
        # TTL 0 means "do not reuse": a rebinding name must be asked afresh.
        if ttl <= 0 or self._size <= 0:
            return
        self._entries[host] = (now + ttl, answer)
        self._entries.move_to_end(host)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# --------------------------------------------------------------------------
# The resolver

# What one query type ends with: an answer (maybe without records) or why not.
_TypeResult = dns.resolver.Answer | Exception


class DnsResolver:
    """The default Resolver: hosts file, then dnspython; timeout; TTL cache.

    Concurrent lookups of one name share a single DNS query. Failures are not
    cached, so a name that failed is asked again on the next lookup.
    """

    def __init__(
        self,
        nameservers: Sequence[tuple[str, int]] | None = None,
        *,
        hosts_path: str | None = HOSTS_PATH,
        timeout: float = DNS_TIMEOUT,
        cache_size: int = CACHE_SIZE,
        max_ttl: float = MAX_CACHE_TTL,
        clock: Callable[[], float] = time.monotonic,
        resolv_conf: str = RESOLV_CONF,
        meter: DnsMeter | None = None,
    ) -> None:
        """Resolve with `nameservers` only, or (if none) the hosts file and the system.

        An empty `nameservers` counts as none. `hosts_path` (None: no hosts
        file) and `resolv_conf` are read only without nameservers. `clock`
        drives cache expiry and the once-a-second file checks; a test may pass
        a fake one. `meter` hears of each query and cache hit.
        """
        _check_settings(timeout, cache_size, max_ttl)
        self.meter = meter
        self._timeout = timeout
        self._clock = clock
        self._cache = _AnswerCache(cache_size, max_ttl)
        self._inflight: dict[str, asyncio.Task[Resolution]] = {}
        self._hosts: _HostsFile | None = None
        self._system: _SystemConfig | None = None
        self._explicit: _Upstream | None = None
        if nameservers:
            self._explicit = _explicit_upstream([_check_server(s) for s in nameservers])
        else:
            self._hosts = _HostsFile(hosts_path, clock) if hosts_path else None
            self._system = _SystemConfig(resolv_conf, clock)

    def clear_cache(self) -> None:
        """Forget every cached answer (the hosts file is re-read on change anyway)."""
        self._cache.clear()

    def resolve_now(self, host: str) -> Resolution | None:
        """The answer for `host` if no query is needed (hosts file or cache), else None."""
        if self._hosts is not None:
            addresses = self._hosts.lookup(host)
            if addresses:
                # Not cached: the file is the cache, re-read when it changes.
                return Resolution(addresses, (host,), 0.0, "hosts")
        cached = self._cache.get(host, self._clock())
        if cached is not None and self.meter is not None:
            self.meter.dns_cache_hit()
        return cached

    async def resolve(self, host: str) -> Resolution:
        """Resolve `host`; see the Resolver protocol."""
        answer = self.resolve_now(host)
        if answer is not None:
            return answer
        return await self._shared_query(host)

    async def _shared_query(self, host: str) -> Resolution:
        task = self._inflight.get(host)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._query_and_cache(host))
            self._inflight[host] = task
            task.add_done_callback(lambda done: self._query_done(host, done))
        # Shielded: one waiter giving up must not cancel the others' query.
        return await asyncio.shield(task)

    def _query_done(self, host: str, task: asyncio.Task[Resolution]) -> None:
        if self._inflight.get(host) is task:
            del self._inflight[host]
        if not task.cancelled():
            task.exception()  # retrieved, so no "never retrieved" warning

    async def _query_and_cache(self, host: str) -> Resolution:
        started = time.perf_counter()
        try:
            answer = await self._query(host)
        except ResolveError as exc:
            self._measured(started, exc.reason.value)
            raise
        self._measured(started, "answer")
        self._cache.put(host, answer, self._clock())
        return answer

    def _measured(self, started: float, outcome: str) -> None:
        if self.meter is not None:
            self.meter.dns_query(time.perf_counter() - started, outcome)

    async def _query(self, host: str) -> Resolution:
        upstream = self._upstream()
        qname = _qname(host)
        deadline = asyncio.get_running_loop().time() + self._timeout
        results = await asyncio.gather(
            self._query_type(upstream.resolver, qname, dns.rdatatype.A, deadline),
            self._query_type(upstream.resolver, qname, dns.rdatatype.AAAA, deadline),
        )
        return _combine(host, results, upstream.label, self._timeout)

    def _upstream(self) -> _Upstream:
        if self._explicit is not None:
            return self._explicit
        assert self._system is not None  # one of the two is always set
        return self._system.get()

    async def _query_type(
        self,
        resolver: dns.asyncresolver.Resolver,
        qname: dns.name.Name,
        rdtype: dns.rdatatype.RdataType,
        deadline: float,
    ) -> _TypeResult:
        try:
            # `lifetime` bounds dnspython's own retries; the asyncio deadline
            # also covers its back-off sleeps, which do not check the lifetime.
            async with asyncio.timeout_at(deadline):
                return await resolver.resolve(
                    qname,
                    rdtype,
                    raise_on_no_answer=False,
                    lifetime=self._timeout,
                    search=False,
                )
        except (TimeoutError, dns.exception.DNSException, OSError, ValueError) as exc:
            return exc


def _check_settings(timeout: float, cache_size: int, max_ttl: float) -> None:
    if not timeout > 0:
        raise ValueError(f"DNS timeout must be positive, not {timeout!r}")
    if cache_size < 0:
        raise ValueError(f"DNS cache size must be 0 or more, not {cache_size!r}")
    if max_ttl < 0:
        raise ValueError(f"DNS max TTL must be 0 or more, not {max_ttl!r}")


def _check_server(server: tuple[str, int]) -> tuple[str, int]:
    ip, port = server
    try:
        canonical = str(ipaddress.ip_address(ip))
    except ValueError:
        raise ValueError(f"nameserver {ip!r} is not an IP address") from None
    if "%" in canonical or not 1 <= port <= 65535:
        raise ValueError(f"bad nameserver {_hostport(ip, port)}")
    return canonical, port


def _qname(host: str) -> dns.name.Name:
    # Absolute, so no search domain or ndots rule can ever be applied.
    try:
        return dns.name.from_text(host, origin=dns.name.root)
    except (dns.exception.DNSException, ValueError) as exc:
        raise ResolveError(Reason.DNS_FAILURE, f"cannot look up {host!r}: {exc}") from None


# --------------------------------------------------------------------------
# Turning the two answers into a Resolution or an error


def _combine(host: str, results: Iterable[_TypeResult], label: str, timeout: float) -> Resolution:
    """One type may fail or be empty as long as the other has addresses."""
    results = list(results)
    answers = [r for r in results if isinstance(r, dns.resolver.Answer)]
    addresses = tuple(dict.fromkeys(a for answer in answers for a in _addresses(answer)))
    names = _names(host, answers)
    if addresses:
        # Every RRset counts, the CNAMEs' and a NODATA answer's negative TTL
        # too: the answer "no AAAA" expires like any other.
        ttl = min(answer.chaining_result.minimum_ttl for answer in answers)
        return Resolution(addresses, names, float(ttl), "dns")
    raise _failure(host, names, [r for r in results if isinstance(r, Exception)], label, timeout)


def _addresses(answer: dns.resolver.Answer) -> list[IPAddress]:
    if answer.rrset is None:
        return []
    return [ipaddress.ip_address(rdata.to_text()) for rdata in answer.rrset]


def _names(host: str, answers: Sequence[dns.resolver.Answer]) -> tuple[str, ...]:
    names = [host]
    for answer in answers:
        for cname in answer.chaining_result.cnames:
            for rdata in cname:
                names.append(rdata.to_text().lower().removesuffix("."))
    return tuple(dict.fromkeys(names))


def _failure(
    host: str, names: Sequence[str], errors: Sequence[Exception], label: str, timeout: float
) -> ResolveError:
    # A timeout outranks the rest: an answer might still have been coming.
    if any(isinstance(e, (TimeoutError, dns.exception.Timeout)) for e in errors):
        message = f"{label} did not answer within {_seconds(timeout)} s for {host}"
        return ResolveError(Reason.DNS_TIMEOUT, message)
    failures = [e for e in errors if not isinstance(e, dns.resolver.NXDOMAIN)]
    if failures:
        return ResolveError(
            Reason.DNS_FAILURE, f"DNS lookup of {host} failed: {_explain(failures)}"
        )
    alias = f" (alias of {names[-1]})" if len(names) > 1 else ""
    if len(errors) == 2:  # NXDOMAIN for both types
        return ResolveError(
            Reason.DNS_FAILURE, f"{host}{alias} does not exist (NXDOMAIN from {label})"
        )
    return ResolveError(Reason.DNS_FAILURE, f"no A or AAAA record for {host}{alias}")


def _explain(errors: Sequence[Exception]) -> str:
    parts: list[str] = []
    for error in errors:
        if isinstance(error, dns.resolver.NoNameservers):
            parts.extend(_server_errors(error))
        else:
            parts.append(str(error) or type(error).__name__)
    return "; ".join(dict.fromkeys(parts))


def _server_errors(error: dns.resolver.NoNameservers) -> list[str]:
    """Per-server reasons, e.g. "127.0.0.1:5353 answered SERVFAIL"."""
    parts = []
    for server, _tcp, port, problem, _response in error.kwargs.get("errors", []):
        where = _hostport(str(server).removeprefix("Do53:").rsplit("@", 1)[0], port)
        if isinstance(problem, str):
            parts.append(f"{where} answered {problem}")
        else:
            parts.append(f"{where}: {problem or type(problem).__name__}")
    return parts or ["no DNS server could answer"]


def resolver_for(
    policy: Policy | None, servers: list[tuple[str, int]], meter: DnsMeter | None = None
) -> DnsResolver:
    """The resolver a command uses: --nameserver wins over [dns] nameservers."""
    settings = policy.dns if policy is not None else None
    if not servers and settings is not None and settings.nameservers:
        servers = [(str(ip), port) for ip, port in settings.nameservers]
    if settings is None:
        return DnsResolver(servers or None, meter=meter)
    return DnsResolver(
        servers or None,
        timeout=settings.timeout,
        cache_size=settings.cache_size,
        max_ttl=settings.max_ttl,
        meter=meter,
    )
