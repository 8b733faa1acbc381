"""`egressbox doctor`: which confinement mechanisms this host supports, per profile."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import egressbox
from egressbox.cli.options import add_upstream, terminal_columns
from egressbox.core.exitcodes import EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from egressbox.cli.options import Subparsers


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "doctor",
        help="show which confinement mechanisms this host supports",
        description="Probe this host: Landlock ABI, seccomp, no_new_privs, user, network, "
        "mount and PID namespaces. Nothing is changed.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--policy", metavar="FILE", help="also say how its [egress] upstream would be used"
    )
    p.add_argument(
        "--apparmor-profile",
        action="store_true",
        help="print an AppArmor profile that lets this egressbox create user namespaces "
        "where Ubuntu restricts them, and exit (install it under /etc/apparmor.d/)",
    )
    add_upstream(p, doctor=True)


def main(args: argparse.Namespace) -> int:
    from egressbox.confine.probe import format_table, namespace_blocker, probe_host, to_json

    if args.apparmor_profile:
        from egressbox.confine.blockers import apparmor_profile
        from egressbox.confine.probe import entry_point

        print(apparmor_profile(entry_point()), end="")
        return EXIT_OK
    try:
        chaining = _doctor_upstream(args)
    except ValueError as exc:
        print(f"egressbox doctor: --upstream: {exc}", file=sys.stderr)
        return EXIT_USAGE
    support = probe_host()
    from egressbox.runner.facts import remember_probe

    remember_probe(support)  # what `run` believes next is what doctor says now
    profiles = profile_support(support)
    core = _core_line()
    blocked = namespace_blocker()
    if args.json:
        data = to_json(support)
        data["namespace_blocker"] = (
            None
            if blocked is None
            else {"cause": blocked.cause, "why": blocked.why, "fix": blocked.fix}
        )
        data["profiles"] = profiles
        data["proxy_core"] = core
        data["upstream"] = chaining
        print(json.dumps(data))
        return EXIT_OK
    print(format_table(support))
    print()
    if blocked is not None:
        print(f"namespaces: blocked ({blocked.cause}): {blocked.why}")
        print(f"  to lift it: {blocked.fix}")
        print()
    print(_profiles_table(profiles))
    print()
    print(f"proxy core: {core}")
    print(f"upstream: {chaining['line']}")
    return EXIT_OK


def _doctor_upstream(args: argparse.Namespace) -> dict[str, Any]:
    """The upstream `serve`/`run` would chain through (--upstream, else --policy's), and
    whether pinning holds through it."""
    from egressbox.core.upstream import parse_upstream
    from egressbox.protocols.upstream import describe_upstream

    upstream = None
    if args.upstream is not None:
        upstream = parse_upstream(args.upstream, args.upstream_target or "address")
    elif args.policy is not None:
        from egressbox.core.policy import load_policy

        upstream = load_policy(args.policy, env={}).upstream
    return describe_upstream(upstream)


def _core_line() -> str:
    """Whether the proxy core runs compiled, and how to get it if not."""
    if egressbox.compiled_core():
        return "compiled (mypyc)"
    if os.environ.get(egressbox.PURE_ENV) == "1":
        return f"interpreted ({egressbox.PURE_ENV}=1)"
    return (
        "interpreted: with gcc and the Python headers (Debian: python3-dev) a reinstall"
        " compiles it, for less CPU per connection"
    )


def profile_support(support: object) -> dict[str, dict[str, object]]:
    """What each `run` profile would enforce on this host, and what it would refuse."""
    from egressbox.confine.grants import HostFacts, Profile, choose_mechanisms, wanted
    from egressbox.confine.probe import HostSupport
    from egressbox.runner.report import SUPERVISOR, planned_network_boundary

    assert isinstance(support, HostSupport)
    status = {m.name: m.status.value for m in support.mechanisms()}
    available = frozenset(n for n, v in status.items() if v == "available")
    facts = HostFacts(available, status, support.landlock.abi or 0, support.euid)
    result: dict[str, dict[str, object]] = {}
    for profile in Profile:
        chosen, refusals = choose_mechanisms(profile, facts)
        enforced = [m.value for m in chosen]
        boundary, supervised = planned_network_boundary(chosen, available)
        if supervised:
            enforced.append(SUPERVISOR)  # holds the boundary by address in place of a namespace
        result[profile.value] = {
            "enforced": sorted(enforced),
            "missing": sorted(m.value for m in wanted(profile) - chosen),
            "refuses": [r.message() for r in refusals],
            "network_boundary": boundary.value,
        }
    return result


def _profiles_table(profiles: dict[str, dict[str, object]], width: int = 0) -> str:
    """PROFILE, WOULD ENFORCE HERE, MISSING, sized to their contents and to the terminal
    (or `width`): a list too long for its column wraps between items, a refusal under its row."""
    import itertools
    import textwrap

    width = width or terminal_columns()
    rows = [(name, _texts(r["enforced"]), _texts(r["missing"])) for name, r in profiles.items()]
    name_w = max(len(name) for name in ["PROFILE", *profiles])
    # The widest a column needs (all on one line), and the least (its longest item).
    most = [max(len(", ".join(r[i])) for r in rows) for i in (1, 2)]
    least = [max((len(item) + 1 for r in rows for item in r[i]), default=1) for i in (1, 2)]
    missing_w = max(most[1], len("MISSING"))
    room = width - name_w - 4
    if max(most[0], len("WOULD ENFORCE HERE")) + missing_w > room:
        missing_w = max(len("MISSING"), least[1], min(missing_w, room // 3))
    enforced_w = max(len("WOULD ENFORCE HERE"), least[0], min(most[0], room - missing_w))
    lines = [f"{'PROFILE':<{name_w}}  {'WOULD ENFORCE HERE':<{enforced_w}}  MISSING"]
    for name, enforced, missing in rows:
        cells = (_pack(enforced, enforced_w), _pack(missing, missing_w))
        for first, (left, right) in enumerate(itertools.zip_longest(*cells, fillvalue="")):
            label = "" if first else name
            lines.append(f"{label:<{name_w}}  {left:<{enforced_w}}  {right}".rstrip())
        indent = " " * (name_w + 2)
        for refusal in _texts(profiles[name]["refuses"]):
            wrapped = textwrap.wrap(refusal, max(width - len(indent), 20))
            lines += [indent + line for line in wrapped]
    return "\n".join(lines)


def _texts(value: object) -> list[str]:
    return [str(item) for item in value] if isinstance(value, list) else []


def _pack(items: list[str], width: int) -> list[str]:
    """A comma-separated list in lines of at most `width`, broken only between items."""
    lines = [""]
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if lines[-1] and len(lines[-1]) + 1 + len(piece) > width:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}".lstrip()
    return lines if items else ["-"]
