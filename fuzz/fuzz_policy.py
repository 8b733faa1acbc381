"""Fuzz the policy file: TOML bytes into a validated Policy (`policy.parse_policy`).

The bytes are a policy file. Outcomes allowed: a Policy, PolicyError (with at least
one problem, each a located line of text), or tomllib's TOMLDecodeError (not TOML at
all). Checked:

- in memory (`tomllib.loads` + `parse_policy`) and from a file (`load_policy`) the
  same bytes give the same policy, or both refuse (the file reader turns decode
  errors into PolicyError);
- `load_run_settings` (what `run` reads before its fork) accepts what `load_policy`
  accepts, with the same settings, and refuses nothing that it accepts;
- every rule's canonical text parses back to the same rule;
- split in two at the data's point, the first piece is the file and the second the
  EGRESSBOX_ALLOW variable: its entries act exactly as the same entries appended to
  the file's `egress.allow` (same rules, same number of problems).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import os
import tempfile
import tomllib
from collections.abc import Mapping
from typing import Any

import atheris

import harness

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.core import hosts, policy, rules
    from egressbox.core.errors import PolicyError

harness.check_pure([policy, rules, hosts])

# Written for every input, under $TMPDIR (fuzz/run points it at its own temporary
# directory: libFuzzer's exit skips atexit handlers).
_FILE = os.path.join(tempfile.gettempdir(), f"egressbox-fuzz-policy-{os.getpid()}.toml")


@atexit.register
def _remove_file() -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_FILE)


NO_ENV: Mapping[str, str] = {}
Summary = tuple[tuple[str, object], ...]


def summary(found: policy.Policy, *, warnings: bool = True) -> Summary:
    """Every public field of a Policy, comparable (Policy compares by identity)."""
    values: list[tuple[str, object]] = []
    for item in dataclasses.fields(found):
        if item.name.startswith("_") or item.name == "source":
            continue
        value = getattr(found, item.name)
        if isinstance(value, rules.RuleSet):
            value = value.rules
        elif item.name == "warnings" and not warnings:
            value = len(value)
        values.append((item.name, value))
    return tuple(values)


def outcome(parse: Any) -> Summary | int:
    """The summary of the policy that `parse()` returns, or its number of problems."""
    try:
        found = parse()
    except PolicyError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
        return len(exc.problems)
    return summary(found)


def check_rules(found: policy.Policy) -> None:
    for ruleset in (found.allow, found.deny):
        for rule in ruleset.rules:
            again = rules.parse_pattern(rule.text, private=rule.private, broad=rule.broad)
            assert again == rule, (rule, again)


def with_env_allow(document: dict[str, Any], env_text: str) -> dict[str, Any] | None:
    """The document with EGRESSBOX_ALLOW's entries appended to egress.allow (or None)."""
    changed = copy.deepcopy(document)
    egress = changed.setdefault("egress", {})
    if not isinstance(egress, dict):
        return None
    allow = egress.get("allow", [])
    if not isinstance(allow, list):
        return None
    egress["allow"] = allow + [item for item in env_text.split(",") if item.strip()]
    return changed


def in_memory(data: bytes, env: Mapping[str, str] = NO_ENV) -> Summary | int | None:
    """parse_policy's outcome, or None when the bytes are not a TOML document."""
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return outcome(lambda: policy.parse_policy(document, source=_FILE, env=env))


def test_one_input(data: bytes) -> None:
    with open(_FILE, "wb") as f:
        f.write(data)
    from_file = outcome(lambda: policy.load_policy(_FILE, env=NO_ENV))
    memory = in_memory(data)
    assert from_file == (1 if memory is None else memory), (from_file, memory)
    try:
        settings = policy.load_run_settings(_FILE)
    except PolicyError:
        assert isinstance(from_file, int), "load_run_settings refuses what load_policy takes"
    else:
        if not isinstance(from_file, int):
            assert dict(from_file)["process"] == settings.process
            assert dict(from_file)["filesystem"] == settings.filesystem
            assert dict(from_file)["env"] == settings.env
    if not isinstance(from_file, int):
        check_rules(policy.load_policy(_FILE, env=NO_ENV))

    cut = harness.split_point(data)
    env_text = data[cut:].decode("utf-8", "surrogateescape")
    try:
        document = tomllib.loads(data[:cut].decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError):
        return
    appended = with_env_allow(document, env_text)
    if appended is None:
        return
    env = {policy.ENV_ALLOW: env_text}
    through_env = _without_warnings(lambda: policy.parse_policy(document, env=env))
    through_file = _without_warnings(lambda: policy.parse_policy(appended, env=NO_ENV))
    assert through_env == through_file, (through_env, through_file)


def _without_warnings(parse: Any) -> Summary | int:
    try:
        found = parse()
    except PolicyError as exc:
        return len(exc.problems)
    return summary(found, warnings=False)


if __name__ == "__main__":
    harness.main(test_one_input)
