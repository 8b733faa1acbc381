"""`egressbox explain HOST[:PORT]`: what a policy decides for a destination, resolved for real."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from egressbox.cli.options import add_nameserver
from egressbox.core.errors import HostError
from egressbox.core.exitcodes import EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from egressbox.cli.options import Subparsers
    from egressbox.core.decide import Decision

EXPLAIN_DEFAULT_PORT = 443


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "explain",
        help="show what a policy decides for a destination (resolving it for real)",
        description="Decide HOST[:PORT] as the proxy would: name rules, real DNS resolution, "
        "every address checked. Prints the decision, the reason code, the matching rule and "
        f"the addresses. The port defaults to {EXPLAIN_DEFAULT_PORT}. A malformed target is "
        "a deny with bad_host or bad_port (exit 0).",
    )
    p.add_argument("target", metavar="HOST[:PORT]", help="e.g. pypi.org:443 or [2001:db8::1]:80")
    from egressbox.core.policy import ENV_ALLOW

    p.add_argument(
        "--policy",
        metavar="FILE",
        help=f"policy file (TOML); without it and without {ENV_ALLOW}, everything is denied",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_nameserver(p)


# explain takes a URL too: its port defaults by scheme.
URL_DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443, "ftp": 21, "ssh": 22}


def split_target(text: str) -> tuple[str, str | int]:
    """`HOST[:PORT]` or a URL for explain; a bare IPv6 address is accepted without brackets."""
    scheme, sep, rest = text.partition("://")
    if sep and scheme.isalpha():
        authority = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
        url_host, url_port = split_target(authority)
        default = URL_DEFAULT_PORTS.get(scheme.lower(), EXPLAIN_DEFAULT_PORT)
        has_port = authority.rsplit("]", 1)[-1].count(":") == 1
        return url_host, url_port if has_port else default
    try:
        from egressbox.core.hosts import split_authority

        host, port = split_authority(text)
    except HostError:
        # A bare IPv6 address (no port), or garbage that check() will call bad_host.
        return text, EXPLAIN_DEFAULT_PORT
    return host, EXPLAIN_DEFAULT_PORT if port is None else port


def main(args: argparse.Namespace) -> int:
    from egressbox.core.policy import load_policy_or_environment
    from egressbox.net.resolve import parse_nameserver, resolver_for
    from egressbox.proxy.check import check

    policy = load_policy_or_environment(args.policy)
    from egressbox.core.policy import Mode

    if policy is not None and policy.mode is Mode.REPORT:
        print("egressbox: warning: report mode lets denied names through", file=sys.stderr)
    try:
        servers = [parse_nameserver(text) for text in args.nameserver]
    except ValueError as exc:
        print(f"egressbox: --nameserver: {exc}", file=sys.stderr)
        return EXIT_USAGE
    resolver = resolver_for(policy, servers)
    host, port = split_target(args.target)
    import asyncio

    decision = asyncio.run(check(policy, resolver, host, port))
    print(_explain_json(decision) if args.json else _explain_text(decision))
    return EXIT_OK


def _ip_texts(decision: Decision) -> list[str]:
    from egressbox.core.hosts import canonical_ip_text

    return [canonical_ip_text(ip) for ip in decision.addresses]


def decision_dict(decision: Decision) -> dict[str, object]:
    return {
        "decision": decision.verdict.value,
        "reason": decision.reason.value,
        "host": decision.host,
        "port": decision.port,
        "addresses": _ip_texts(decision),
        "rule": decision.rule,
        "detail": decision.detail,
    }


def _explain_json(decision: Decision) -> str:
    return json.dumps(decision_dict(decision))


def _explain_text(decision: Decision) -> str:
    d = decision_dict(decision)
    addresses = ", ".join(_ip_texts(decision)) or "-"
    target = f"{decision.host}:{decision.port}" if decision.port else decision.host
    return "\n".join(
        [
            f"{d['decision']}  {target}",
            f"  reason:    {d['reason']}",
            f"  rule:      {d['rule'] or '-'}",
            f"  addresses: {addresses}",
            f"  detail:    {d['detail']}",
        ]
    )
