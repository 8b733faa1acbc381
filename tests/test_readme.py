"""The reference in docs/ stays true to the code: every flag a command's table shows exists on
that command's parser, every flag a parser has is in its command's section, the reason codes
are exactly the `Reason` enum's, every policy key the loader accepts is documented, and every
metric `serve --admin` exports is in the metrics table. README.md links only to pages that exist."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from egressbox.cli import build_parser
from egressbox.core import limits, policy, secrets
from egressbox.core.errors import Reason

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
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
# changes, apply and discard share one section of docs/commands.md.
SECTION_OF = {"changes": "changes", "apply": "changes", "discard": "changes"}
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The text under the first heading that starts with `heading`, to the next one of its level."""
    level = heading.split(" ", 1)[0]
    start = next((i for i, line in enumerate(text.splitlines()) if line.startswith(heading)), None)
    assert start is not None, f"no section {heading!r}"
    lines = text.splitlines()[start + 1 :]
    end = next(
        (i for i, line in enumerate(lines) if re.match(rf"#{{1,{len(level)}}} ", line)),
        len(lines),
    )
    return "\n".join(lines[:end])


def _command_section(command: str) -> str:
    name = SECTION_OF.get(command, command)
    return _section(_page("commands.md"), f"## `egressbox {name}")


def _parser_flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen = sub.choices[command]
    flags = {o for action in chosen._actions for o in action.option_strings}
    return {f for f in flags if f.startswith("--") and f != "--help"}


def _table_first_cells(section: str) -> list[str]:
    return [
        line.split("|")[1]
        for line in section.splitlines()
        if line.startswith("| `--") and line.count("|") >= 3
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_a_command_table_shows_exists(command: str) -> None:
    section = _command_section(command)
    shown = {flag for cell in _table_first_cells(section) for flag in FLAG.findall(cell)}
    if command in SECTION_OF:  # one section for three commands: the union of their flags
        known = set().union(*(_parser_flags(c) for c in SECTION_OF))
    else:
        known = _parser_flags(command)
    assert shown - known == set()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_a_command_is_in_its_table(command: str) -> None:
    section = _command_section(command)
    shown = {flag for cell in _table_first_cells(section) for flag in FLAG.findall(cell)}
    assert _parser_flags(command) - shown == set()


def test_the_reason_codes_are_the_enums() -> None:
    section = _section(_page("audit.md"), "## Reason codes")
    listed = {
        m.group(1) for line in section.splitlines() if (m := re.match(r"\| `([a-z_]+)` \|", line))
    }
    assert listed == {reason.value for reason in Reason}


POLICY_TABLES = {
    "egress": policy.EGRESS_KEYS,
    "dns": policy.DNS_KEYS,
    "limits": tuple(limits.LIMIT_BOUNDS),
    "process": policy.PROCESS_KEYS,
    "filesystem": policy.FILESYSTEM_KEYS,
    "env": policy.ENV_KEYS,
    "secret": secrets.SECRET_KEYS,
    "request_rule": secrets.REQUEST_RULE_KEYS,
    "tls": secrets.TLS_KEYS,
}


def test_the_policy_tables_are_the_loaders() -> None:
    example = _page("policy.md").split("```toml", 1)[1].split("```", 1)[0]
    tables = re.findall(r"^\[\[?([a-z_]+)\]\]?", example, re.M)
    assert set(tables) == set(policy.TOP_KEYS)


@pytest.mark.parametrize("table", sorted(POLICY_TABLES))
def test_every_policy_key_is_in_the_example(table: str) -> None:
    example = _page("policy.md").split("```toml", 1)[1].split("```", 1)[0]
    body = example.split(f"[{table}]", 1)[1].split("\n[", 1)[0]
    keys = set(re.findall(r"^#?\s*([a-z_]+)\s*=", body, re.M))
    assert keys == set(POLICY_TABLES[table])


def test_every_metric_is_in_the_metrics_table() -> None:
    source = (ROOT / "src/egressbox/serve/metrics.py").read_text(encoding="utf-8")
    exported = set(re.findall(r'"(egressbox_[a-z_]+)"', source))
    table = _section(_page("production.md"), "## Metrics")
    listed = set(re.findall(r"^\| `(egressbox_[a-z_]+)` \|", table, re.M))
    # prometheus_client adds _total to a counter's name
    assert {m.removesuffix("_total") for m in listed} == exported


def test_readme_links_lead_to_pages_that_exist() -> None:
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (page.parent / target).exists(), f"{page.name} links to a missing {target}"
