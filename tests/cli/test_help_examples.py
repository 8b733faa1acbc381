"""Each command's `--help` ends with examples, and every example is a command line the real
parser takes (a renamed or removed flag breaks this test, not a user's paste)."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

import pytest

from egressbox.cli import build_parser

COMMANDS = (
    "serve",
    "run",
    "audit",
    "check",
    "explain",
    "doctor",
    "connect",
    "changes",
    "apply",
    "discard",
)
# An example has two or three lines (the brief for `--help`); audit keeps its four.
MIN_EXAMPLES, MAX_EXAMPLES = 2, 4


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen: argparse.ArgumentParser = sub.choices[command]
    return chosen


def _examples(help_text: str) -> list[str]:
    tail = help_text.rstrip("\n").rsplit("\nexamples:\n", 1)
    assert len(tail) == 2, "the help does not end with examples"
    lines = tail[1].splitlines()
    assert all(line.startswith("  ") for line in lines), lines
    return [line.strip() for line in lines]


def _egressbox_argv(example: str) -> list[str]:
    """The arguments egressbox gets from an example line (inside ssh's ProxyCommand too;
    only the first command of a `&&` or `>` line)."""
    words = shlex.split(example, comments=True)
    if words[0] == "ssh":  # ssh fills in %h and %p
        proxy_command = next(w for w in words if w.startswith("ProxyCommand="))
        filled = proxy_command.split("=", 1)[1].replace("%h", "example.org").replace("%p", "22")
        words = shlex.split(filled)
    for stop in ("&&", ">", "|"):
        if stop in words:
            words = words[: words.index(stop)]
    assert words[0] == "egressbox", example
    return words[1:]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_ends_with_examples_the_parser_takes(command: str) -> None:
    examples = _examples(_subparser(command).format_help())
    assert MIN_EXAMPLES <= len(examples) <= MAX_EXAMPLES
    commands = []
    for example in examples:
        # parse_args exits (SystemExit) on a flag the command does not take
        commands.append(build_parser().parse_args(_egressbox_argv(example)).command)
    assert command in commands  # others may lead up to it (`run --review` before `changes`)


def test_the_top_level_help_ends_with_examples() -> None:
    for example in _examples(build_parser().format_help()):
        build_parser().parse_args(_egressbox_argv(example))


def test_help_as_a_user_sees_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "egressbox", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.rstrip().endswith("-- make test")
    assert "\nexamples:\n  egressbox run --policy policies/pypi.toml" in done.stdout
