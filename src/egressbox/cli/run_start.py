"""`egressbox run`'s flags and start: the launcher's zygote starts before the body's imports.

The body (cli/run.py) imports the runner, which this module must not: `run`'s parser is
built, and the zygote started, before that import (benchmarks/spawn.py measures it).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from egressbox.cli.options import add_ask_common, add_nameserver, add_upstream, seconds
from egressbox.core.exitcodes import EXIT_USAGE

if TYPE_CHECKING:
    from egressbox.cli.options import Subparsers


def add_parser(sub: Subparsers) -> None:
    from egressbox.runner.flags import RUN_FLAGS

    p = sub.add_parser(
        "run",
        help="run a command confined behind a managed proxy",
        description="Run CMD behind a managed proxy on ephemeral loopback ports, confined so "
        "that the proxy is the only endpoint it can reach (network namespace, Landlock, "
        "seccomp, no new privileges). stdin/stdout/stderr pass through; the exit code is "
        "CMD's (128+N when it dies from signal N), 126 when the profile's required "
        "confinement is unavailable, 127 when CMD is not found.",
    )
    shared = {"ask_common": add_ask_common, "upstream": add_upstream}
    shared["nameserver"] = add_nameserver
    groups: dict[str, Any] = {}
    for flag in RUN_FLAGS:  # declared once, with the keyword each sets (runner/flags.py)
        if flag.shared:
            add = shared.pop(flag.shared, None)  # a helper adds its flags once
            if add is not None:
                add(p)
            continue
        target: Any = p
        if flag.group:
            if flag.group not in groups:
                groups[flag.group] = p.add_mutually_exclusive_group()
            target = groups[flag.group]
        kwargs = dict(flag.argparse)
        if "type" in kwargs:
            kwargs["type"] = _ARG_TYPES[kwargs["type"]]
        target.add_argument(*flag.names, **kwargs)


# The converters runner/flags.py names by "type".
_ARG_TYPES: dict[str, Any] = {"seconds": seconds, "int": int}


_ROOT_FLAGS = (
    ("write_root", "--write-root"),
    ("read_root", "--read-root/--read-only-root"),
    ("process_write_root", "--process-write-root/--sandbox-write-root"),
    ("process_read_root", "--process-read-root/--sandbox-read-root"),
)


def no_sandbox(args: argparse.Namespace) -> str:
    """--no-sandbox as --profile unrestricted; a problem with it ("" when none)."""
    if not getattr(args, "no_sandbox", False):
        return ""
    given = [flag for dest, flag in _ROOT_FLAGS if getattr(args, dest, None)]
    if given:
        return f"--no-sandbox refuses {', '.join(given)}: without a sandbox a root means nothing"
    if args.profile not in (None, "unrestricted"):
        return f"--no-sandbox is --profile unrestricted; --profile {args.profile} contradicts it"
    args.profile = "unrestricted"
    return ""


def main(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print(
            "egressbox run: give the command after --, e.g. egressbox run -- curl URL",
            file=sys.stderr,
        )
        return EXIT_USAGE
    problem = no_sandbox(args)
    if problem:
        print(f"egressbox run: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from egressbox.runner import zygote

    # The launcher's imports run in the zygote while this process plans the run.
    zygote.start()
    try:
        from egressbox.cli.run import run_command

        return run_command(args, argv)
    finally:
        zygote.discard()
