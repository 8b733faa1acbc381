"""`egressbox check FILE...`: validate policy files, every problem with its key and fix."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from egressbox.core.errors import PolicyError, print_policy_error
from egressbox.core.exitcodes import EXIT_OK, EXIT_USAGE

if TYPE_CHECKING:
    from egressbox.cli.options import Subparsers
    from egressbox.core.policy import Policy


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "check",
        help="validate policy files and report every problem",
        description="Validate policy files. Prints every problem with its key and the fix, "
        "then warnings. Exit 0 when all files are valid, 2 otherwise.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="policy file (TOML)")
    p.add_argument("--quiet", "-q", action="store_true", help="print errors only")


def main(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            from egressbox.core.policy import load_policy

            policy = load_policy(path, env={})
        except PolicyError as exc:
            print_policy_error(exc, sys.stdout)
            status = EXIT_USAGE
            continue
        print(f"{path}: ok ({_summary(policy)})")
        if not args.quiet:
            from egressbox.core.secrets import serve_needs_ca

            ca = serve_needs_ca(policy.secrets, policy.request_rules, policy.tls)
            for warning in (*policy.warnings, *([ca] if ca else [])):
                print(f"  warning: {warning}")
    return status


def _summary(policy: Policy) -> str:
    allow, deny = len(policy.allow.rules), len(policy.deny.rules)
    return (
        f"{allow} allow, {deny} deny, {len(policy.allow_cidrs)} allow_cidrs, "
        f"{len(policy.deny_cidrs)} deny_cidrs; mode {policy.mode.value}"
    )
