"""Harn's flag names parse to the same options as egressbox's; the profile ladder's rules."""

from __future__ import annotations

from typing import Any

import pytest

from egressbox import cli
from egressbox.cli.run import _cli_options
from egressbox.cli.run_start import no_sandbox
from egressbox.confine.grants import (
    SYSTEM_RUNTIME,
    Profile,
    bound_socket_paths,
    parse_profile,
    plan_filesystem,
    socket_bind_roots,
    sockets_to_hide,
    strictest,
)
from egressbox.core.policy import ProcessSettings, RunSettings, parse_policy
from egressbox.runner.options import RunOptions, chosen_profile, effective_profile

# (Harn's flag, egressbox's): each takes a path.
PATH_ALIASES = [
    ("--read-only-root", "--read-root"),
    ("--sandbox-read-root", "--process-read-root"),
    ("--sandbox-write-root", "--process-write-root"),
    ("--sandbox-unix-socket-root", "--unix-socket-root"),
]


def _options(*argv: str, settings: RunSettings | None = None) -> RunOptions:
    args = cli.build_parser("run").parse_args(["run", *argv, "--", "true"])
    assert no_sandbox(args) == ""
    options = _cli_options(args, ["true"], settings)
    assert options is not None
    return options


def _problem(*argv: str) -> str:
    args = cli.build_parser("run").parse_args(["run", *argv, "--", "true"])
    return no_sandbox(args)


@pytest.mark.parametrize(("harn", "ours"), PATH_ALIASES)
def test_harn_root_flags_are_ours(harn: str, ours: str) -> None:
    assert _options(harn, "/srv/a", harn, "/srv/b") == _options(ours, "/srv/a", ours, "/srv/b")


def test_harn_switches_are_ours() -> None:
    assert _options("--allow-process-loopback") == _options("--allow-loopback")
    assert _options("--allow-process-loopback").allow_loopback
    assert _options("--no-sandbox") == _options("--profile", "unrestricted")
    # The command reaches the network through the proxy either way: nothing changes.
    assert _options("--allow-process-network") == _options()


@pytest.mark.parametrize(
    "flag", ["--write-root", "--read-only-root", "--sandbox-write-root", "--sandbox-read-root"]
)
def test_no_sandbox_refuses_a_root(flag: str) -> None:
    assert "--no-sandbox refuses" in _problem("--no-sandbox", flag, "/srv/a")
    assert "contradicts" in _problem("--no-sandbox", "--profile", "os_hardened")


def test_default_profile_is_worktree_and_the_old_name_warns() -> None:
    assert _options().profile is Profile.WORKTREE
    assert _options().notes == ()
    old = _options("--profile", "workspace_paths")
    assert old.profile is Profile.WORKTREE
    (note,) = old.notes
    assert "deprecated name of worktree" in note and "unrestricted" in note
    with pytest.raises(ValueError, match="testbench"):
        parse_profile("wasi")


def _settings(profile: str | None = None, **process: Any) -> RunSettings:
    return RunSettings(process=ProcessSettings(profile=profile, **process))


@pytest.mark.parametrize(
    ("flag", "table", "expected"),
    [
        (None, None, Profile.WORKTREE),
        ("unrestricted", None, Profile.UNRESTRICTED),
        (None, "unrestricted", Profile.UNRESTRICTED),
        ("unrestricted", "os_hardened", Profile.OS_HARDENED),
        ("os_hardened", "unrestricted", Profile.OS_HARDENED),
        ("unrestricted", "worktree", Profile.WORKTREE),
        ("worktree", "workspace_paths", Profile.WORKTREE),
    ],
)
def test_strictest_wins_between_the_flag_and_the_policy(
    flag: str | None, table: str | None, expected: Profile
) -> None:
    argv = ("--profile", flag) if flag else ()
    options = _options(*argv, settings=_settings(table))
    assert options.profile is expected
    overridden = flag is not None and Profile(flag) is not expected
    assert any("stricter and wins" in n for n in options.notes) == overridden


def test_strictest_wins_with_an_outer_run_too() -> None:
    assert effective_profile(Profile.UNRESTRICTED, {"EGRESSBOX_PROFILE": "os_hardened"}) is (
        Profile.OS_HARDENED
    )
    # An outer run of the old default passes its old name: it still means worktree.
    outer = {"EGRESSBOX_PROFILE": "workspace_paths"}
    assert effective_profile(Profile.UNRESTRICTED, outer) is Profile.WORKTREE
    assert strictest() is Profile.WORKTREE
    assert chosen_profile(None, None) == (Profile.WORKTREE, [])


def test_allow_tcp_loopback_is_a_policy_key() -> None:
    policy = parse_policy({"process": {"allow_tcp_loopback": True}}, env={})
    assert policy.run_settings.process.allow_tcp_loopback
    assert _options(settings=policy.run_settings).allow_loopback
    assert not _options().allow_loopback
    with pytest.raises(Exception, match="allow_tcp_loopback"):
        parse_policy({"process": {"allow_tcp_loopback": "yes"}}, env={})


def test_nix_store_is_system_runtime() -> None:
    assert "/nix/store" in SYSTEM_RUNTIME
    fs = plan_filesystem(home="/home/u", write_roots=(), read_roots=(), executables=())
    assert "/nix/store" in fs.read
    without = plan_filesystem(
        home="/home/u", write_roots=(), read_roots=(), executables=(), presets=()
    )
    assert "/nix/store" not in without.read


def test_live_sockets_under_grants_are_hidden_except_under_socket_roots() -> None:
    table = (
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000: 00000002 00000000 00010000 0001 01 11 /srv/data/db.sock\n"
        "0000: 00000002 00000000 00010000 0001 01 12 /run/sockets/agent.sock\n"
        "0000: 00000002 00000000 00010000 0001 01 13 @abstract\n"
        "0000: 00000002 00000000 00010000 0001 01 14 relative.sock\n"
        "0000: 00000003 00000000 00000000 0001 03 15\n"
        "0000: 00000002 00000000 00010000 0001 01 16 /srv/data/with space.sock\n"
        "0000: 00000002 00000000 00010000 0001 01 17 /elsewhere/x.sock\n"
    )
    found = bound_socket_paths(table)
    assert found == (
        "/srv/data/db.sock",
        "/run/sockets/agent.sock",
        "/srv/data/with space.sock",
        "/elsewhere/x.sock",
    )
    hidden = sockets_to_hide(found, ["/srv/data", "/run/sockets"], ["/run/sockets"])
    assert hidden == ("/srv/data/db.sock", "/srv/data/with space.sock")


def test_socket_roots_inside_the_private_temp_are_connect_only() -> None:
    write = ("/home/u/project", "/tmp", "/var/tmp", "/dev")
    roots = ("/tmp/.X11-unix", "/home/u/project/run", "/srv/sockets")
    assert socket_bind_roots(roots, write, ("/home/u/project",)) == (
        "/home/u/project/run",
        "/srv/sockets",
    )
