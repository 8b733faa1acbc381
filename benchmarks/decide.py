"""How many decisions per second the policy engine makes, by policy size.

    python benchmarks/decide.py [--sizes 10,1000,10000] [--seconds 0.5] [--json FILE]

Policies of 10, 1,000 and 10,000 rules with a realistic mix (exact names with
and without ports, wildcards, a few IPs and CIDRs, some deny entries) are
asked a mix of queries: hits on exact names, hits through wildcards at
several depths, and misses (unknown names, wildcard apexes, wrong ports).

Modes:
  name        parse_target + decide_name: normalization and the name rules,
              the work done for every request before any DNS.
  name-cold   the same without parse_target's cache of normalized hosts
              (normalize_host on every query): the cost of a first sight.
  check       egress.check end to end, with a resolver that answers from a
              dict as a warm cache would (misses never resolve).
  check-dns   egress.check with the real DnsResolver, its cache pre-warmed;
              pointed at a server that is never asked (skipped if the
              resolver's cache cannot be pre-warmed).

Nothing touches the network. Every measurement is bounded in time
(--seconds) and in iterations (--max-decisions). The target is at least
200,000 name-only decisions/s at 10,000 rules, and the rate must not fall
in proportion to the rule count (lookups are by label, not by rule).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from egressbox.core.decide import Decision, NamePass, Target, decide_name, parse_target
from egressbox.core.errors import Reason, ResolveError
from egressbox.core.hosts import check_port, normalize_host
from egressbox.core.policy import Policy, parse_policy
from egressbox.net.resolve import Resolution
from egressbox.proxy.check import check

TARGET_NAME_RATE = 200_000  # name-only decisions/s at 10,000 rules
DEFAULT_SIZES = (10, 1_000, 10_000)
MAX_SLOWDOWN = 3.0  # smallest-policy rate / largest-policy rate still called "flat"
QUERY_POOL = 2_000  # distinct queries, cycled: a busy proxy sees repeat names
PUBLIC_V4 = ipaddress.IPv4Address("151.101.0.223")
PUBLIC_V6 = ipaddress.IPv6Address("2a04:4e42::223")
PORTS = (443, 443, 443, 80, 22, 8443)


@dataclass(frozen=True, slots=True)
class Query:
    host: str
    port: int
    kind: str  # "exact", "wildcard" or "miss"


@dataclass(frozen=True, slots=True)
class Result:
    rules: int
    mode: str
    decisions: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.decisions / self.seconds if self.seconds else 0.0

    @property
    def us_per_decision(self) -> float:
        return self.seconds / self.decisions * 1e6 if self.decisions else 0.0


# -- the workload -------------------------------------------------------------------------


def build_entries(
    size: int, rng: random.Random
) -> tuple[list[str], list[tuple[str, int]], list[str]]:
    """(allow, exact names with a port they admit, wildcard suffixes) for `size` rules."""
    allow: list[str] = []
    exact: list[tuple[str, int]] = []
    suffixes: list[str] = []
    for i in range(size):
        roll = rng.random()
        team, env = f"team{i % 97}", ("prod", "stage", "dev")[i % 3]
        if roll < 0.45:
            name = f"svc{i}.{team}.{env}.example.com"
            allow.append(name)
            exact.append((name, rng.choice(PORTS)))
        elif roll < 0.75:
            name, port = f"api{i}.{team}.example.net", rng.choice(PORTS)
            allow.append(f"{name}:{port}")
            exact.append((name, port))
        elif roll < 0.95:
            suffix = f"zone{i}.{env}.example.org"
            wildcard = f"*.{suffix}"
            allow.append(wildcard if rng.random() < 0.5 else f"{wildcard}:443")
            suffixes.append(suffix)
        elif roll < 0.98:
            allow.append(f"203.{i % 256}.{(i // 256) % 256}.0/24:443")
        else:
            allow.append(f"198.{i % 256}.{(i // 256) % 256}.7")
    return allow, exact, suffixes


def build_policy(size: int, seed: int = 1) -> tuple[Policy, list[Query]]:
    rng = random.Random(seed)
    allow, exact, suffixes = build_entries(size, rng)
    deny = ["*.internal", "evil.example.com", "*.blocked.example.net"]
    policy = parse_policy(
        {
            "egress": {
                "allow": allow,
                "deny": deny,
                "deny_cidrs": ["169.254.169.254/32", "fd00:ec2::254/128"],
            }
        },
        env={},
    )
    queries: list[Query] = []
    for _ in range(QUERY_POOL):
        roll = rng.random()
        if roll < 0.4 and exact:
            name, port = rng.choice(exact)
            queries.append(Query(name.upper() if rng.random() < 0.1 else name, port, "exact"))
        elif roll < 0.7 and suffixes:
            labels = ".".join(f"n{rng.randrange(1000)}" for _ in range(rng.randint(1, 3)))
            queries.append(Query(f"{labels}.{rng.choice(suffixes)}", 443, "wildcard"))
        else:
            queries.append(rng.choice(_misses(rng, exact, suffixes)))
    return policy, queries


def _misses(
    rng: random.Random, exact: Sequence[tuple[str, int]], suffixes: Sequence[str]
) -> list[Query]:
    found = [Query(f"unknown{rng.randrange(10**6)}.example.io", 443, "miss")]
    if suffixes:
        found.append(Query(rng.choice(suffixes), 443, "miss"))  # a wildcard never admits its apex
    if exact:
        found.append(Query(f"www.{rng.choice(exact)[0]}", 443, "miss"))
        name, port = rng.choice(exact)
        if name.startswith("api"):  # "api*" entries carry a port: ask another one
            found.append(Query(name, 1 + port % 65535, "miss"))
    return found


def verify(policy: Policy, queries: Sequence[Query]) -> None:
    """Make sure hits hit and misses miss, so the figures measure what they claim."""
    for query in queries:
        result = decide_name(policy, parse_target(query.host, query.port))
        hit = isinstance(result, NamePass)
        if hit != (query.kind != "miss"):
            raise SystemExit(f"benchmark workload is wrong: {query} gave {result}")
        if isinstance(result, Decision) and result.reason is not Reason.NO_ALLOW_RULE:
            raise SystemExit(f"benchmark workload is wrong: {query} gave {result}")


# -- resolvers -------------------------------------------------------------------------------


class Resolver(Protocol):
    async def resolve(self, host: str) -> Resolution: ...


class WarmCache:
    """Answers from a dict, as a resolver whose cache already holds every name."""

    def __init__(self, answers: dict[str, Resolution]) -> None:
        self._answers = answers

    async def resolve(self, host: str) -> Resolution:
        answer = self._answers.get(host)
        if answer is None:
            raise ResolveError(Reason.DNS_FAILURE, f"{host}: not in the warm cache")
        return answer


def answers_for(queries: Sequence[Query]) -> dict[str, Resolution]:
    answer = (PUBLIC_V4, PUBLIC_V6)
    hosts = {parse_target(q.host, q.port).host.text for q in queries if q.kind != "miss"}
    return {host: Resolution(answer, (host,), 300.0, "cache") for host in hosts}


def warm_dns_resolver(answers: dict[str, Resolution]) -> Resolver | None:
    """The real DnsResolver with every answer already in its cache, or None.

    It is pointed at the discard port on loopback, so even a cache miss would
    never leave the machine; the probe below makes sure the cache answers.
    """
    try:
        from egressbox.net.resolve import DnsResolver
    except ImportError:
        return None
    try:
        resolver = DnsResolver([("127.0.0.1", 9)], cache_size=len(answers) + 16, timeout=1.0)
    except (TypeError, ValueError):
        return None
    cache: Any = getattr(resolver, "_cache", None)
    if cache is None or not callable(getattr(cache, "put", None)):
        return None
    now = time.monotonic()
    for host, answer in answers.items():
        cache.put(host, answer, now)
    if answers and not _answers_from_cache(resolver, next(iter(answers))):
        return None
    return resolver


def _answers_from_cache(resolver: Resolver, host: str) -> bool:
    async def probe() -> bool:
        try:
            answer = await asyncio.wait_for(resolver.resolve(host), 0.5)
        except (ResolveError, TimeoutError):
            return False
        return answer.source == "cache"

    return asyncio.run(probe())


# -- measuring --------------------------------------------------------------------------------


def measure(run_batch: Callable[[], int], seconds: float, max_decisions: int) -> tuple[int, float]:
    """Call run_batch until `seconds` pass or `max_decisions` are made."""
    run_batch()  # warm-up: caches, branch predictors, lazily built indexes
    done, start = 0, time.perf_counter()
    elapsed = 0.0
    while elapsed < seconds and done < max_decisions:
        done += run_batch()
        elapsed = time.perf_counter() - start
    return done, elapsed


def bench_name(
    policy: Policy, queries: Sequence[Query], seconds: float, cap: int
) -> tuple[int, float]:
    pairs = [(q.host, q.port) for q in queries]

    def batch() -> int:
        for host, port in pairs:
            decide_name(policy, parse_target(host, port))
        return len(pairs)

    return measure(batch, seconds, cap)


def bench_name_cold(
    policy: Policy, queries: Sequence[Query], seconds: float, cap: int
) -> tuple[int, float]:
    pairs = [(q.host, q.port) for q in queries]

    def batch() -> int:
        for host, port in pairs:
            decide_name(policy, Target(normalize_host(host), check_port(port)))
        return len(pairs)

    return measure(batch, seconds, cap)


def bench_check(
    policy: Policy, queries: Sequence[Query], resolver: Resolver, seconds: float, cap: int
) -> tuple[int, float]:
    pairs = [(q.host, q.port) for q in queries]

    async def batch() -> int:
        for host, port in pairs:
            await check(policy, resolver, host, port)
        return len(pairs)

    async def run() -> tuple[int, float]:
        await batch()  # warm-up
        done, start = 0, time.perf_counter()
        elapsed = 0.0
        while elapsed < seconds and done < cap:
            done += await batch()
            elapsed = time.perf_counter() - start
        return done, elapsed

    return asyncio.run(run())


def run(sizes: Sequence[int], seconds: float, cap: int, modes: Sequence[str]) -> list[Result]:
    results: list[Result] = []
    for size in sizes:
        policy, queries = build_policy(size)
        verify(policy, queries)
        answers = answers_for(queries)
        if "name" in modes:
            done, elapsed = bench_name(policy, queries, seconds, cap)
            results.append(Result(size, "name", done, elapsed))
        if "name-cold" in modes:
            done, elapsed = bench_name_cold(policy, queries, seconds, cap)
            results.append(Result(size, "name-cold", done, elapsed))
        if "check" in modes:
            done, elapsed = bench_check(policy, queries, WarmCache(answers), seconds, cap)
            results.append(Result(size, "check", done, elapsed))
        if "check-dns" in modes:
            resolver = warm_dns_resolver(answers)
            if resolver is None:
                print(
                    f"check-dns skipped at {size} rules: cannot pre-warm DnsResolver",
                    file=sys.stderr,
                )
            else:
                done, elapsed = bench_check(policy, queries, resolver, seconds, cap)
                results.append(Result(size, "check-dns", done, elapsed))
    return results


def table(results: Sequence[Result]) -> str:
    lines = [f"{'rules':>7}  {'mode':<10}  {'decisions/s':>12}  {'us/decision':>11}"]
    for r in results:
        lines.append(
            f"{r.rules:>7}  {r.mode:<10}  {r.per_second:>12,.0f}  {r.us_per_decision:>11.2f}"
        )
    return "\n".join(lines)


def verdict(results: Sequence[Result]) -> tuple[bool, str]:
    """Whether the name-only rate meets the target and stays flat with rule count."""
    name = {r.rules: r.per_second for r in results if r.mode == "name"}
    if not name:
        return True, "no name-only figures"
    largest, smallest = max(name), min(name)
    rate = name[largest]
    ratio = name[smallest] / rate if rate else float("inf")
    # Lookups cost O(labels): a 1,000-fold larger policy may cost a little
    # (bigger dicts, colder caches) but nowhere near in proportion.
    flat = largest == smallest or ratio < MAX_SLOWDOWN
    ok = flat and (largest < 10_000 or rate >= TARGET_NAME_RATE)
    message = (
        f"name-only at {largest} rules: {rate:,.0f}/s (target {TARGET_NAME_RATE:,}/s at"
        f" 10000 rules); {smallest} rules is {ratio:.2f}x faster"
        f" ({'flat' if flat else 'grows with rule count'}): {'ok' if ok else 'MISSED'}"
    )
    return ok, message


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="comma-separated policy sizes (allow rules)",
    )
    parser.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    parser.add_argument("--max-decisions", type=int, default=2_000_000, help="cap per measurement")
    parser.add_argument(
        "--modes",
        default="name,name-cold,check,check-dns",
        help="comma-separated: name,name-cold,check,check-dns",
    )
    parser.add_argument(
        "--json", metavar="FILE", help="also write the results as JSON ('-': stdout)"
    )
    parser.add_argument(
        "--assert-target", action="store_true", help="exit 1 when the name-only target is missed"
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    seconds = min(max(args.seconds, 0.01), 30.0)
    results = run(sizes, seconds, max(args.max_decisions, 1), modes)
    ok, message = verdict(results)
    print(table(results))
    print(message)
    if args.json:
        document = {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "machine": platform.machine(),
            "seconds_per_measurement": seconds,
            "query_pool": QUERY_POOL,
            "target_name_per_second_at_10000_rules": TARGET_NAME_RATE,
            "target_met": ok,
            "results": [
                asdict(r)
                | {
                    "per_second": round(r.per_second, 1),
                    "us_per_decision": round(r.us_per_decision, 3),
                }
                for r in results
            ],
        }
        text = json.dumps(document, indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text)
    return 1 if args.assert_target and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
