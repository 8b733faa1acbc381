"""The one place where policy, DNS and addresses meet.

`check()` normalizes the target, applies the name rules (no DNS for a name
that no allow entry admits), resolves with the proxy's own resolver, judges
every address and returns a Decision whose addresses are the only ones the
dialer may use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from egressbox.decide import (
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
from egressbox.errors import HostError, ResolveError
from egressbox.policy import Policy

if TYPE_CHECKING:
    from egressbox.resolve import Resolver


async def check(
    policy: Policy | None,
    resolver: Resolver,
    host: str,
    port: int | str,
    *,
    self_endpoints: SelfEndpoints = NO_SELF,
) -> Decision:
    """Decide whether `host:port` may be reached, resolving it if needed."""
    try:
        target = parse_target(host, port)
    except HostError as exc:
        return bad_target(exc, port)
    named = decide_name(policy, target)
    if isinstance(named, Decision):
        return named
    assert policy is not None  # decide_name returns a Decision without a policy
    return await _check_addresses(policy, resolver, named, self_endpoints)


async def _check_addresses(
    policy: Policy, resolver: Resolver, passed: NamePass, self_endpoints: SelfEndpoints
) -> Decision:
    host = passed.target.host
    if host.ip is not None:
        return decide_addresses(policy, passed, (host.ip,), self_endpoints=self_endpoints)
    try:
        answer = await resolver.resolve(host.text)
    except ResolveError as exc:
        rule = passed.rule.text if passed.rule is not None else None
        return deny(exc.reason, passed.target, str(exc), rule=rule)
    return decide_addresses(
        policy, passed, answer.addresses, names=answer.names, self_endpoints=self_endpoints
    )
