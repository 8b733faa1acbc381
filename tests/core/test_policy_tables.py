"""[process], [filesystem] and [env]: every key, the defaults, errors, load_run_settings,
and how `egressbox run` / the library take them as defaults (flags win or add)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from egressbox import cli
from egressbox.cli.run import _cli_options
from egressbox.confine.env import EnvPolicy
from egressbox.confine.grants import DEFAULT_PRESETS, PRESETS, Profile
from egressbox.core.errors import PolicyError
from egressbox.core.policy import (
    ENV_POLICIES,
    MIN_RLIMIT_AS,
    PROFILES,
    EnvSettings,
    FilesystemSettings,
    Policy,
    ProcessSettings,
    RunSettings,
    load_policy,
    load_run_settings,
    parse_policy,
)
from egressbox.core.policy import PRESETS as POLICY_PRESETS
from egressbox.runner.options import RunOptions, options_for

FULL = {
    "process": {
        "profile": "unrestricted",
        "timeout": 90,
        "rlimit_nofile": 256,
        "rlimit_as": 2 * 1024**3,
    },
    "filesystem": {
        "read_roots": ["/srv/data", "~/src"],
        "write_roots": ["/srv/out"],
        "presets": ["system_runtime", "user_temp"],
        "deny": ["~/.secrets", "/etc/shadow-ish"],
    },
    "env": {"policy": "isolated", "grant": ["CI", "LANG=C.UTF-8", "EMPTY="]},
}
FULL_TOML = """
[egress]
allow = ["pypi.org:443"]

[process]
profile = "unrestricted"
timeout = 90
rlimit_nofile = 256
rlimit_as = 2147483648

[filesystem]
read_roots = ["/srv/data", "~/src"]
write_roots = ["/srv/out"]
presets = ["system_runtime", "user_temp"]
deny = ["~/.secrets", "/etc/shadow-ish"]

[env]
policy = "isolated"
grant = ["CI", "LANG=C.UTF-8", "EMPTY="]
"""


def parse(data: Mapping[str, Any]) -> Policy:
    return parse_policy(data, env={})


def problems(data: Mapping[str, Any]) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(data, env={})
    return info.value.problems


def one_problem(data: Mapping[str, Any]) -> str:
    found = problems(data)
    assert len(found) == 1, found
    return found[0]


# -- values -------------------------------------------------------------------------------


def test_defaults_change_nothing() -> None:
    policy = parse({})
    assert policy.process == ProcessSettings(None, None, None, None)
    assert policy.filesystem == FilesystemSettings((), (), DEFAULT_PRESETS, ())
    assert policy.env == EnvSettings(None, ())
    assert policy.run_settings == RunSettings()
    assert Policy().run_settings == RunSettings()
    defaults = options_for(["true"], policy=policy)
    plain = RunOptions(argv=("true",), policy=policy)
    assert defaults == plain


def test_names_match_the_confinement_enums() -> None:
    from egressbox.confine.grants import PROFILE_NAMES

    assert PROFILE_NAMES == PROFILES
    assert {Profile(name) for name in PROFILES} == set(Profile)
    assert tuple(e.value for e in EnvPolicy) == ENV_POLICIES
    assert tuple(PRESETS) == POLICY_PRESETS == DEFAULT_PRESETS


def test_every_key() -> None:
    policy = parse(FULL)
    assert policy.process == ProcessSettings("unrestricted", 90.0, 256, 2 * 1024**3)
    assert isinstance(policy.process.timeout, float)
    assert policy.filesystem == FilesystemSettings(
        read_roots=("/srv/data", "~/src"),
        write_roots=("/srv/out",),
        presets=("system_runtime", "user_temp"),
        deny=("~/.secrets", "/etc/shadow-ish"),
    )
    assert policy.env == EnvSettings("isolated", (("CI", None), ("LANG", "C.UTF-8"), ("EMPTY", "")))


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile(profile: str) -> None:
    assert parse({"process": {"profile": profile}}).process.profile == profile


@pytest.mark.parametrize("value", ENV_POLICIES)
def test_each_env_policy(value: str) -> None:
    assert parse({"env": {"policy": value}}).env.policy == value


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("timeout", 0.5),
        ("timeout", 7 * 24 * 3600),
        ("rlimit_nofile", 16),
        ("rlimit_nofile", 1048576),
        ("rlimit_as", MIN_RLIMIT_AS),
        ("rlimit_as", 1 << 50),
    ],
)
def test_process_bounds_accepted(key: str, value: float) -> None:
    assert getattr(parse({"process": {key: value}}).process, key) == value


def test_empty_presets_and_duplicates() -> None:
    assert parse({"filesystem": {"presets": []}}).filesystem.presets == ()
    twice = {"filesystem": {"presets": ["user_temp", "user_temp"]}}
    assert parse(twice).filesystem.presets == ("user_temp",)


def test_home_relative_paths_are_kept_as_written() -> None:
    fs = parse({"filesystem": {"read_roots": ["~", "~/x"]}}).filesystem
    assert fs.read_roots == ("~", "~/x")


# -- errors name the key path and the fix ----------------------------------------------------


@pytest.mark.parametrize(
    ("data", "path", "fix"),
    [
        (
            {"process": {"profile": "workspce_paths"}},
            "process.profile",
            'did you mean "workspace_paths"',
        ),
        ({"process": {"profile": 3}}, "process.profile", '"os_hardened"'),
        ({"process": {"timeout": 0}}, "process.timeout", "more than 0 and at most 604800"),
        ({"process": {"timeout": -1}}, "process.timeout", "e.g. timeout = 600"),
        ({"process": {"timeout": 7 * 24 * 3600 + 1}}, "process.timeout", "at most 604800"),
        ({"process": {"timeout": "10s"}}, "process.timeout", "must be a number"),
        ({"process": {"timeout": True}}, "process.timeout", "must be a number"),
        (
            {"process": {"rlimit_nofile": 15}},
            "process.rlimit_nofile",
            "at least 16 and at most 1048576",
        ),
        ({"process": {"rlimit_nofile": 1048577}}, "process.rlimit_nofile", "at most 1048576"),
        ({"process": {"rlimit_nofile": 64.0}}, "process.rlimit_nofile", "a whole number"),
        ({"process": {"rlimit_as": MIN_RLIMIT_AS - 1}}, "process.rlimit_as", "at least 67108864"),
        ({"process": {"rlimit_as": "1G"}}, "process.rlimit_as", "e.g. rlimit_as = 4294967296"),
        (
            {"filesystem": {"read_roots": ["rel/dir"]}},
            "filesystem.read_roots[0]",
            "write it from /",
        ),
        (
            {"filesystem": {"write_roots": ["/ok", "~user/x"]}},
            "filesystem.write_roots[1]",
            "not an absolute path",
        ),
        ({"filesystem": {"write_roots": "/srv"}}, "filesystem.write_roots", "must be a list"),
        ({"filesystem": {"deny": [1]}}, "filesystem.deny[0]", "must be a string"),
        (
            {"filesystem": {"presets": ["user_tmp"]}},
            "filesystem.presets[0]",
            'did you mean "user_temp"',
        ),
        ({"filesystem": {"presets": "user_temp"}}, "filesystem.presets", "must be a list"),
        ({"env": {"policy": "isolatd"}}, "env.policy", 'did you mean "isolated"'),
        ({"env": {"grant": ["1BAD"]}}, "env.grant[0]", '"NAME=VALUE"'),
        ({"env": {"grant": ["=x"]}}, "env.grant[0]", 'e.g. "CI"'),
        ({"env": {"grant": "CI"}}, "env.grant", "must be a list"),
        ({"env": {"grant": [True]}}, "env.grant[0]", "must be a string"),
        ({"process": "fast"}, "process", "must be a table ([process])"),
        ({"env": []}, "env", "must be a table ([env])"),
    ],
)
def test_errors_name_path_and_fix(data: Mapping[str, Any], path: str, fix: str) -> None:
    problem = one_problem(data)
    assert problem.startswith(f"{path}: "), problem
    assert fix in problem, problem


@pytest.mark.parametrize(
    ("data", "path", "hint"),
    [
        ({"process": {"timout": 1}}, "process.timout", 'did you mean "timeout"'),
        ({"process": {"rlimit_nofiles": 64}}, "process.rlimit_nofiles", '"rlimit_nofile"'),
        ({"filesystem": {"write_root": []}}, "filesystem.write_root", '"write_roots"'),
        ({"filesystem": {"presets_": []}}, "filesystem.presets_", '"presets"'),
        ({"env": {"grants": []}}, "env.grants", 'did you mean "grant"'),
        ({"proces": {}}, "proces", 'did you mean "process"'),
        ({"filesytem": {}}, "filesytem", 'did you mean "filesystem"'),
    ],
)
def test_unknown_keys_are_errors(data: Mapping[str, Any], path: str, hint: str) -> None:
    problem = one_problem(data)
    assert problem.startswith(f"{path}: unknown key; "), problem
    assert hint in problem and "known keys:" in problem, problem


def test_every_problem_is_collected() -> None:
    found = problems(
        {
            "process": {"timeout": 0, "rlimit_nofile": 1},
            "filesystem": {"read_roots": ["x"]},
            "env": {"policy": "none"},
        }
    )
    assert [p.split(":")[0] for p in found] == [
        "process.timeout",
        "process.rlimit_nofile",
        "filesystem.read_roots[0]",
        "env.policy",
    ]


# -- load_run_settings ----------------------------------------------------------------------


def test_load_run_settings_equals_the_full_parse(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(FULL_TOML)
    settings = load_run_settings(str(path))
    policy = load_policy(str(path), env={})
    assert settings == policy.run_settings
    assert settings == RunSettings(policy.process, policy.filesystem, policy.env)
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert load_run_settings(str(empty)) == RunSettings() == load_policy(str(empty)).run_settings


def test_load_run_settings_reports_problems_of_its_tables_only(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[egress]\nallow = ["*"]\n[process]\nprofile = "strict"\n')
    with pytest.raises(PolicyError) as info:
        load_run_settings(str(path))
    assert info.value.source == str(path)
    assert [p.split(":")[0] for p in info.value.problems] == ["process.profile"]
    with pytest.raises(PolicyError) as full:
        load_policy(str(path), env={})
    assert [p.split(":")[0] for p in full.value.problems] == ["egress.allow[0]", "process.profile"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("[process\n", "not valid TOML"), (None, "cannot read the policy file")],
)
def test_load_run_settings_bad_files(tmp_path: Path, text: str | None, fragment: str) -> None:
    path = tmp_path / "p.toml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_run_settings(str(path))
    assert fragment in info.value.problems[0]


def test_load_run_settings_does_not_import_idna(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(FULL_TOML)
    code = (
        "import json, sys\n"
        "from egressbox.core.policy import load_run_settings\n"
        "s = load_run_settings(sys.argv[1])\n"
        "heavy = sorted(m for m in ('idna', 'egressbox.core.hosts', 'egressbox.core.rules',"
        " 'asyncio')"
        " if m in sys.modules)\n"
        "print(json.dumps([heavy, s.process.profile]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[], "unrestricted"]


# -- run: the tables are defaults; flags win or add ---------------------------------------------


def test_library_takes_the_tables_as_defaults() -> None:
    policy = parse(FULL)
    options = options_for(["true"], policy=policy)
    assert options.profile is Profile.UNRESTRICTED
    assert options.env_policy is EnvPolicy.ISOLATED
    assert options.timeout == 90.0
    assert options.rlimit_nofile == 256 and options.rlimit_as == 2 * 1024**3
    assert options.read_roots == ("/srv/data", "~/src")
    assert options.write_roots == ("/srv/out",)
    assert options.presets == ("system_runtime", "user_temp")
    assert options.deny == ("~/.secrets", "/etc/shadow-ish")
    assert options.grants == {"CI": None, "LANG": "C.UTF-8", "EMPTY": ""}


def test_library_keywords_win_or_add() -> None:
    policy = parse(FULL)
    options = options_for(
        ["true"],
        policy=policy,
        profile="worktree",
        env="inherited",
        timeout=5,
        write_roots=["/w"],
        read_roots=["/r", "/srv/data"],
        grants={"LANG": "C", "X": "1"},
    )
    assert options.profile is Profile.WORKTREE
    assert options.env_policy is EnvPolicy.INHERITED
    assert options.timeout == 5
    assert options.write_roots == ("/w", "/srv/out")
    assert options.read_roots == ("/r", "/srv/data", "~/src")
    assert options.grants == {"CI": None, "LANG": "C", "EMPTY": "", "X": "1"}


def test_library_rejects_a_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout"):
        options_for(["true"], policy=None, timeout=0)


def _cli(*argv: str, settings: RunSettings | None = None) -> RunOptions | None:
    args = cli.build_parser("run").parse_args(["run", *argv, "--", "true"])
    return _cli_options(args, ["true"], settings)


def test_cli_defaults_without_a_policy() -> None:
    options = _cli()
    assert options is not None
    assert options.profile is Profile.WORKTREE
    assert options.env_policy is EnvPolicy.INHERITED
    assert options.timeout is None
    assert options == RunOptions(argv=("true",), policy=None)


def test_cli_flags_win_or_add() -> None:
    settings = parse(FULL).run_settings
    options = _cli(settings=settings)
    assert options is not None and options.profile is Profile.UNRESTRICTED
    assert options.env_policy is EnvPolicy.ISOLATED and options.timeout == 90.0
    options = _cli(
        "--profile",
        "os_hardened",
        "--env",
        "granted",
        "--timeout",
        "2.5",
        "--write-root",
        "/w",
        "--grant",
        "CI=yes",
        settings=settings,
    )
    assert options is not None
    assert options.profile is Profile.OS_HARDENED
    assert options.env_policy is EnvPolicy.GRANTED
    assert options.timeout == 2.5
    assert options.write_roots == ("/w", "/srv/out")
    assert options.grants["CI"] == "yes"
    assert options.rlimit_nofile == 256


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_cli_timeout_must_be_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser("run").parse_args(["run", "--timeout", value, "--", "true"])
    assert info.value.code == 2
    assert "--timeout" in capsys.readouterr().err


# -- process roots: granted to the command's tools, never workspaces -------------------------


def test_process_roots_parse_and_default_to_none() -> None:
    assert parse({}).filesystem.process_read_roots == ()
    assert parse({}).filesystem.process_write_roots == ()
    fs = parse(
        {
            "filesystem": {
                "write_roots": ["~/project"],
                "process_read_roots": ["~/.npmrc.d"],
                "process_write_roots": ["~/.cache/pip", "/var/cache/tool"],
            }
        }
    ).filesystem
    assert fs.write_roots == ("~/project",)
    assert fs.process_read_roots == ("~/.npmrc.d",)
    assert fs.process_write_roots == ("~/.cache/pip", "/var/cache/tool")


@pytest.mark.parametrize("key", ["process_read_roots", "process_write_roots"])
@pytest.mark.parametrize(
    ("value", "where", "fix"),
    [
        (["cache"], "[0]", "write it from /"),
        (["/ok", "~user/x"], "[1]", "not an absolute path"),
        ("/srv", "", "must be a list"),
        ([7], "[0]", "must be a string"),
    ],
)
def test_process_root_errors_name_the_key_and_the_fix(
    key: str, value: Any, where: str, fix: str
) -> None:
    problem = one_problem({"filesystem": {key: value}})
    assert problem.startswith(f"filesystem.{key}{where}: "), problem
    assert fix in problem, problem


@pytest.mark.parametrize("key", ["process_read_roots", "process_write_roots"])
@pytest.mark.parametrize("workspace_key", ["write_roots", "read_roots"])
def test_a_process_root_cannot_also_be_a_workspace_root(key: str, workspace_key: str) -> None:
    problem = one_problem({"filesystem": {workspace_key: ["/srv/x"], key: ["/srv/y", "/srv/x"]}})
    assert problem.startswith(f"filesystem.{key}[1]: "), problem
    assert f"also in filesystem.{workspace_key}" in problem, problem
    assert "remove it from one list" in problem, problem


def test_misspelt_process_root_key_suggests_the_right_one() -> None:
    problem = one_problem({"filesystem": {"process_write_root": []}})
    assert problem.startswith("filesystem.process_write_root: unknown key; "), problem
    assert '"process_write_roots"' in problem, problem


def test_process_roots_from_the_table_flags_and_keywords_add_up() -> None:
    settings = parse(
        {"filesystem": {"process_read_roots": ["/r1"], "process_write_roots": ["/w1"]}}
    ).run_settings
    options = _cli(
        "--process-read-root",
        "/r0",
        "--process-write-root",
        "/w0",
        "--process-write-root",
        "/w1",
        settings=settings,
    )
    assert options is not None
    assert options.process_read_roots == ("/r0", "/r1")
    assert options.process_write_roots == ("/w0", "/w1")
    assert options.write_roots == () and options.read_roots == ()
    policy = parse({"filesystem": {"process_write_roots": ["/w1"]}})
    library = options_for(["true"], policy=policy, process_write_roots=["/w2"])
    assert library.process_write_roots == ("/w2", "/w1")
    assert library.write_roots == ()


def test_process_roots_are_granted_but_hold_no_scratch_space(tmp_path: Path) -> None:
    from egressbox.confine.grants import HostFacts
    from egressbox.runner.assemble import prepare

    workspace, cache, tools = tmp_path / "ws", tmp_path / "cache", tmp_path / "tools"
    for path in (workspace, cache, tools):
        path.mkdir()
    options = RunOptions(
        argv=("/bin/true",),
        policy=None,
        profile=Profile.WORKTREE,
        cwd=str(workspace),
        process_write_roots=(str(cache),),
        process_read_roots=(str(tools),),
        base_env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        allow_direct_network=True,  # planning only: nothing runs
    )
    prepared = prepare(options, HostFacts(frozenset()))
    plan = prepared.plan
    assert str(cache) in plan.write and str(tools) in plan.read
    assert str(tools) not in plan.write
    # The working directory is still the workspace: TMPDIR and caches live there.
    assert plan.env["TMPDIR"].startswith(str(workspace / ".egressbox"))
    assert not any(value.startswith(str(cache)) for value in plan.env.values())
    assert not (cache / ".egressbox").exists()
    kinds = {(r.kind, r.path) for r in prepared.roots}
    assert ("workspace", str(workspace)) in kinds
    assert ("process_write", str(cache)) in kinds
    assert ("process_read", str(tools)) in kinds


# -- [filesystem] workspace and toolchain_cache ---------------------------------------------------


def test_workspace_and_toolchain_cache_keys() -> None:
    fs = parse({"filesystem": {"workspace": "read-only", "toolchain_cache": "real"}}).filesystem
    assert (fs.workspace, fs.toolchain_cache) == ("read-only", "real")
    unset = parse({}).filesystem
    assert (unset.workspace, unset.toolchain_cache) == (None, None)


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        (
            {"workspace": "readonly"},
            "filesystem.workspace: unknown value 'readonly'; did you mean \"read-only\"?",
        ),
        ({"toolchain_cache": "host"}, "filesystem.toolchain_cache: unknown value 'host'"),
        ({"workspace": True}, "filesystem.workspace: must be a string"),
    ],
)
def test_workspace_and_toolchain_cache_errors(table: dict[str, Any], needle: str) -> None:
    assert needle in one_problem({"filesystem": table})


def test_the_tables_read_only_workspace_and_caches_reach_the_run() -> None:
    policy = parse({"filesystem": {"workspace": "read-only", "toolchain_cache": "real"}})
    options = options_for(["true"], policy=policy)
    assert options.read_only_workspace and options.toolchain_cache == "real"
    # The flag can make a workspace read-only, never writable again; the caller's cache mode wins.
    plain = options_for(
        ["true"], policy=parse({}), read_only_workspace=True, toolchain_cache="real"
    )
    assert plain.read_only_workspace and plain.toolchain_cache == "real"
    assert (
        options_for(["true"], policy=policy, toolchain_cache="scratch").toolchain_cache == "scratch"
    )
    with pytest.raises(ValueError, match="toolchain_cache must be"):
        options_for(["true"], policy=None, toolchain_cache="elsewhere")
