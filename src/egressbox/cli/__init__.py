"""The `egressbox` command: a thin shell over the library (same names, same defaults).

Each command is a module of this package (src/egressbox/cli/<module>.py) with
`add_parser(sub)` and an entry taking the parsed arguments; a command's module is imported
only when that command runs or the whole `--help` is asked for (start-up time).

Exit codes (README "Exit codes"): 0 ok; 1 runtime error; 2 usage or bad policy;
3 a server that could not start; for `run`, the child's code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from egressbox.cli import startup
from egressbox.cli.options import terminal_columns
from egressbox.core.errors import EgressboxError, PolicyError, print_policy_error
from egressbox.core.exitcodes import EXIT_RUNTIME, EXIT_USAGE
from egressbox.core.version import __version__

startup.prepare()

DESCRIPTION = """\
egressbox decides which network destinations a program may reach.

A policy file (TOML) lists the hosts a program may talk to; egressbox
resolves names itself, checks every address and refuses the rest.
Start with `egressbox check POLICY` and `egressbox explain --policy POLICY HOST`.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter, sized like it but without importing shutil (and with it
    bz2 and lzma: ~1.3 ms of every `run`'s start, since each add_argument builds one)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24) -> None:
        super().__init__(prog, indent_increment, max_help_position, terminal_columns() - 2)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from egressbox.cli.examples import epilog

        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("epilog", epilog(kwargs.get("prog")))  # `--help` ends with examples
        super().__init__(*args, **kwargs)


# The commands in `--help`'s order: name -> (module under egressbox.cli, its entry). `run`'s
# parser and start live apart from its body (cli/run.py), which imports the runner only once
# the launcher's zygote is starting.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "main"),
    "run": ("run_start", "main"),
    "check": ("check", "main"),
    "explain": ("explain", "main"),
    "doctor": ("doctor", "main"),
    "connect": ("connect", "command"),
    # A staged run's layer: listed, applied or dropped.
    "changes": ("changes", "main"),
    "apply": ("apply", "main"),
    "discard": ("discard", "main"),
    "audit": ("audit", "run"),
}
# What `--help` says of a command whose parser is not built (another command is parsed).
AUDIT_HELP = "read audit logs, summarize them, suggest a policy"


def _module(command: str) -> Any:
    return importlib.import_module(f"egressbox.cli.{COMMANDS[command][0]}")


def _entry(command: str) -> Callable[[argparse.Namespace], int]:
    entry: Callable[[argparse.Namespace], int] = getattr(_module(command), COMMANDS[command][1])
    return entry


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; `command` (when known) lets other commands skip importing
    their modules (the audit reader, the policy), which `run`'s start-up time would pay for."""
    parser = _Parser(prog="egressbox", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"egressbox {__version__}")
    parser_class: type[argparse.ArgumentParser] = _Parser
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=parser_class
    )
    for name in COMMANDS:
        if command in (None, name):
            _module(name).add_parser(sub)
        elif name == "audit":
            sub.add_parser(name, help=AUDIT_HELP)
        else:
            sub.add_parser(name)  # another command is parsed: only its name is needed
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand when argv starts with it (no top-level option before it, such as
    --help, could then list the other commands)."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_of(words)).parse_args(words)
    try:
        code = _entry(args.command)(args)
        if argv is None and args.command == "run":
            # The command has finished and every record is written: skip the
            # interpreter's teardown of the proxy's modules (~7 ms per run).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except PolicyError as exc:
        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE
    except EgressboxError as exc:
        print(f"egressbox: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `egressbox ... | head`: the reader left; exit quietly like coreutils.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
