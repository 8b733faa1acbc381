"""The workspace a run plans (runner/workspace.py, runner/assemble.py): read-only
workspaces, the toolchain environment, refusals of what cannot be applied, and the
requirement fields of a mechanism refusal. Planning only: nothing is started."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from egressbox.confine.grants import HostFacts, Profile
from egressbox.core.errors import EgressboxError
from egressbox.runner.assemble import Prepared, prepare
from egressbox.runner.options import RunRefusedError, options_for
from egressbox.runner.supervise import clean_up

# Landlock (filesystem, TCP, scopes), seccomp and no_new_privs, but no namespaces: the host
# of an unprivileged user without user namespaces.
LANDLOCK_ONLY = HostFacts(frozenset({"landlock", "seccomp", "no_new_privs"}), {}, 7, os.geteuid())
NOTHING = HostFacts(frozenset(), {}, 0, os.geteuid())


def _prepare(tmp_path: Path, facts: HostFacts, **kwargs: Any) -> Prepared:
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    options = options_for(
        ["/bin/true"],
        policy=None,
        cwd=str(tmp_path / "ws"),
        base_env={"HOME": str(home), "PATH": "/bin:/usr/bin"},
        allow_direct_network=True,
        **kwargs,
    )
    prepared = prepare(options, facts)
    for sock in prepared.host_listeners:
        sock.close()
    return prepared


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "ws").mkdir()
    return tmp_path / "ws"


def test_a_read_only_workspace_without_mounts_keeps_its_scratch_off_the_project(
    tmp_path: Path, ws: Path
) -> None:
    prepared = _prepare(tmp_path, LANDLOCK_ONLY, read_only_workspace=True)
    plan = prepared.plan
    assert str(ws) in plan.read and str(ws) not in plan.write
    assert not (ws / ".egressbox").exists()
    (scratch,) = prepared.cleanup
    assert plan.env["TMPDIR"] == f"{scratch}/tmp" and os.path.isdir(scratch)
    assert plan.env["CARGO_TARGET_DIR"] == f"{scratch}/cache/cargo-target"
    assert prepared.read_only_workspaces == (str(ws),)
    clean_up(prepared)
    assert not os.path.exists(scratch) and prepared.cleanup == []


def test_a_read_only_workspace_without_filesystem_rules_is_refused(
    tmp_path: Path, ws: Path
) -> None:
    with pytest.raises(EgressboxError, match=r"read-only workspace .* cannot be applied"):
        _prepare(tmp_path, NOTHING, read_only_workspace=True)
    assert not (ws / ".egressbox").exists()


def test_deny_entries_without_filesystem_rules_are_said(tmp_path: Path, ws: Path) -> None:
    from egressbox.core.policy import parse_policy

    policy = parse_policy({"filesystem": {"deny": ["~/.vault"]}}, env={})
    home = tmp_path / "home"
    home.mkdir()
    options = options_for(
        ["/bin/true"],
        policy=policy,
        cwd=str(ws),
        base_env={"HOME": str(home), "PATH": "/bin"},
        allow_direct_network=True,
    )
    prepared = prepare(options, NOTHING)
    for sock in prepared.host_listeners:
        sock.close()
    assert any("deny entries are not applied" in w for w in prepared.warnings)


def test_the_child_gets_english_messages_unless_a_locale_was_chosen(
    tmp_path: Path, ws: Path
) -> None:
    env = _prepare(tmp_path, LANDLOCK_ONLY).plan.env
    assert env["LC_MESSAGES"] == "C"
    prepared = _prepare(tmp_path, LANDLOCK_ONLY, grants={"LC_ALL": "fr_FR.UTF-8"})
    assert "LC_MESSAGES" not in prepared.plan.env and prepared.foreign_locale == "fr_FR.UTF-8"
    english = _prepare(tmp_path, LANDLOCK_ONLY, grants={"LC_MESSAGES": "en_GB.UTF-8"})
    assert english.foreign_locale == ""


def test_caches_point_into_the_scratch_space_and_a_grant_wins(tmp_path: Path, ws: Path) -> None:
    prepared = _prepare(tmp_path, LANDLOCK_ONLY, grants={"GOMODCACHE": "/srv/gomod"})
    env = prepared.plan.env
    scratch = f"{ws}/.egressbox/cache"
    assert env["GOCACHE"] == f"{scratch}/go-build" and env["CARGO_HOME"] == f"{scratch}/cargo"
    assert env["GOMODCACHE"] == "/srv/gomod"
    assert any(r.variable == "GOMODCACHE" and r.user_set for r in prepared.caches)


def test_a_fallback_refusal_says_the_selector_made_it(tmp_path: Path, ws: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    options = options_for(
        ["/bin/true"],
        policy=None,
        profile="worktree",
        cwd=str(ws),
        base_env={"HOME": str(home), "PATH": "/bin", "EGRESSBOX_SANDBOX": "enforce"},
        allow_direct_network=True,
    )
    with pytest.raises(RunRefusedError) as info:
        prepare(options, LANDLOCK_ONLY)
    refusals = info.value.refusals
    assert refusals and all(r.requirement == "fallback" and r.selector_honored for r in refusals)
    assert all(r.profile is Profile.WORKTREE for r in refusals)
    # The fact (the selector made it a refusal) is in the message; the way out is the remedy's.
    facts, remedy = info.value.messages[0], info.value.messages[1]
    assert "EGRESSBOX_SANDBOX=enforce made the missing mechanism a refusal" in facts
    assert "EGRESSBOX_SANDBOX=warn" in remedy and "EGRESSBOX_SANDBOX=warn" not in facts
    assert remedy == refusals[0].fields()["remedy"]
