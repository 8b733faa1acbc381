"""README's tables stay true to the code: every flag a command row shows exists on that
command's parser, every flag a parser has is documented, and the reason codes listed are
exactly the `Reason` enum's."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from egressbox.cli import build_parser
from egressbox.core.errors import Reason

README = Path(__file__).resolve().parents[1] / "README.md"
COMMANDS = ("serve", "run", "audit", "check", "explain", "doctor", "connect")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _parser_flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen = sub.choices[command]
    flags = {o for action in chosen._actions for o in action.option_strings}
    return {f for f in flags if f.startswith("--") and f != "--help"}


def _rows(command: str) -> list[str]:
    return [
        line
        for line in _readme().splitlines()
        if line.startswith(f"| `egressbox {command}") and line.count("|") >= 3
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_a_command_row_shows_exists(command: str) -> None:
    rows = _rows(command)
    assert rows, f"README has no row for `egressbox {command}`"
    shown = {flag for row in rows for flag in FLAG.findall(row.split("|")[1])}
    assert shown - _parser_flags(command) == set()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_a_command_is_documented(command: str) -> None:
    text = _readme()
    missing = {flag for flag in _parser_flags(command) if flag not in text}
    assert missing == set()


def test_the_reason_codes_are_the_enums() -> None:
    text = _readme()
    section = text.split("## Reason codes", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([a-z_]+)`", section))
    assert listed == {reason.value for reason in Reason}
