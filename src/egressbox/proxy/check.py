"""The one place where policy, DNS and addresses meet.

`check()` normalizes the target, applies the name rules (no DNS for a name
that no allow entry admits), resolves with the proxy's own resolver, judges
every address and returns a Decision whose addresses are the only ones the
dialer may use.

`check_now()` is the same decision without awaiting: it returns the Decision
when no DNS query is needed (an IP literal, a name the rules deny, a name the
resolver answers from its cache or the hosts file), and otherwise a `Pending`
whose `finish()` does the query and the rest. `check()` is `check_now()` plus
`finish()`, so both paths decide alike.

`recheck()` judges a connection that is already open again (a policy swap
with close_denied): the same rules on the addresses it was admitted with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

from egressbox.core.decide import (
    NO_SELF,
    Decision,
    NamePass,
    SelfEndpoints,
    bad_target,
    decide_addresses,
    decide_name,
    deny,
    parse_target,
)
from egressbox.core.errors import HostError, ResolveError
from egressbox.core.ip import IPAddress
from egressbox.core.policy import Policy

if TYPE_CHECKING:
    from egressbox.net.resolve import Resolution, Resolver


class Pending:
    """A decision that needs a DNS query: the name rules passed, the addresses are to come.

    Keeps the policy, resolver and endpoints it was started with, so a policy
    swapped meanwhile cannot mix two policies into one decision.
    """

    __slots__ = ("passed", "policy", "resolver", "self_endpoints")

    def __init__(
        self, policy: Policy, resolver: Resolver, passed: NamePass, self_endpoints: SelfEndpoints
    ) -> None:
        self.policy = policy
        self.resolver = resolver
        self.passed = passed
        self.self_endpoints = self_endpoints

    async def finish(self) -> Decision:
        """Resolve the name and judge its addresses."""
        passed = self.passed
        try:
            answer = await self.resolver.resolve(passed.target.host.text)
        except ResolveError as exc:
            rule = passed.rule.text if passed.rule is not None else None
            return deny(exc.reason, passed.target, str(exc), rule=rule)
        return _judge(self.policy, passed, answer, self.self_endpoints)


def _judge(
    policy: Policy, passed: NamePass, answer: Resolution, self_endpoints: SelfEndpoints
) -> Decision:
    return decide_addresses(
        policy, passed, answer.addresses, names=answer.names, self_endpoints=self_endpoints
    )


class _Memo(NamedTuple):
    """A decision made without a query, and everything it was made from."""

    policy: Policy | None
    self_endpoints: SelfEndpoints
    name: str  # the normalized name its answer is cached under ("" for none)
    answer: Resolution | None  # the cached answer it judged (None: no DNS involved)
    decision: Decision


# Decisions that needed no query, by (host, port) as asked. A hit needs the
# same policy and endpoint objects and, for a name, the very cache entry the
# resolver still holds: a reload, a new DNS answer or an expired
# one decides afresh. Clients ask for the same few targets again and again
# (a kept-alive client, a build's many fetches), and a hit skips host
# normalization and the rules (measured: ~5 of ~6 us per decision).
MEMO_SIZE: Final = 1024
_memo: Final[dict[tuple[str, int | str], _Memo]] = {}


def check_now(
    policy: Policy | None,
    resolver: Resolver,
    host: str,
    port: int | str,
    *,
    self_endpoints: SelfEndpoints = NO_SELF,
) -> Decision | Pending:
    """The decision for `host:port` if it needs no DNS query, else a Pending to finish."""
    key = (host, port)
    memo = _memo.get(key)
    lookup: Callable[[str], Resolution | None] | None = getattr(resolver, "resolve_now", None)
    if memo is not None and _still_holds(memo, policy, self_endpoints, lookup):
        return memo.decision
    decided, name, answer = _check_now(
        policy, resolver, host, port, lookup=lookup, self_endpoints=self_endpoints
    )
    if isinstance(decided, Decision):
        if len(_memo) >= MEMO_SIZE:
            _memo.clear()
        _memo[key] = _Memo(policy, self_endpoints, name, answer, decided)
    return decided


def _still_holds(
    memo: _Memo,
    policy: Policy | None,
    self_endpoints: SelfEndpoints,
    lookup: Callable[[str], Resolution | None] | None,
) -> bool:
    if memo.policy is not policy or memo.self_endpoints is not self_endpoints:
        return False
    if memo.answer is None:
        return True
    held = None if lookup is None else lookup(memo.name)
    # The cache hands out a copy of its entry with the remaining TTL, so the
    # answer is the same entry when it shares the entry's addresses tuple: a new
    # query or a new entry builds a new one (and the memo keeps the old alive,
    # so its identity cannot be reused).
    return held is not None and held.addresses is memo.answer.addresses


def _check_now(
    policy: Policy | None,
    resolver: Resolver,
    host: str,
    port: int | str,
    *,
    lookup: Callable[[str], Resolution | None] | None,
    self_endpoints: SelfEndpoints,
) -> tuple[Decision | Pending, str, Resolution | None]:
    """check_now() without the memo; also the name and cached answer it used."""
    try:
        target = parse_target(host, port)
    except HostError as exc:
        return bad_target(exc, port), "", None
    named = decide_name(policy, target)
    if isinstance(named, Decision):
        return named, "", None
    assert policy is not None  # decide_name returns a Decision without a policy
    ip = target.host.ip
    if ip is not None:
        return decide_addresses(policy, named, (ip,), self_endpoints=self_endpoints), "", None
    name = target.host.text
    if lookup is not None:
        answer = lookup(name)
        if answer is not None:
            return _judge(policy, named, answer, self_endpoints), name, answer
    return Pending(policy, resolver, named, self_endpoints), name, None


async def check(
    policy: Policy | None,
    resolver: Resolver,
    host: str,
    port: int | str,
    *,
    self_endpoints: SelfEndpoints = NO_SELF,
) -> Decision:
    """Decide whether `host:port` may be reached, resolving it if needed."""
    decided = check_now(policy, resolver, host, port, self_endpoints=self_endpoints)
    if isinstance(decided, Pending):
        return await decided.finish()
    return decided


def recheck(
    policy: Policy | None,
    host: str,
    port: int | str,
    addresses: Sequence[IPAddress],
    *,
    self_endpoints: SelfEndpoints = NO_SELF,
) -> Decision:
    """The decision for a connection already open to `addresses`, under `policy`.

    The name rules, then the addresses the connection was admitted with, judged
    as check() judges a fresh answer; but no DNS query, no memo and no audit
    record (the connection was audited when it was decided; the caller closes
    what no longer passes: EgressProxy.close_denied). The CNAME chain is not
    kept with a connection, so a deny entry that names only an alias is not
    seen here.
    """
    try:
        target = parse_target(host, port)
    except HostError as exc:
        return bad_target(exc, port)
    named = decide_name(policy, target)
    if isinstance(named, Decision):
        return named
    assert policy is not None  # decide_name returns a Decision without a policy
    return decide_addresses(policy, named, addresses, self_endpoints=self_endpoints)
