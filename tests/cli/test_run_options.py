"""`run`'s options are declared once (runner/flags.py RUN_FLAGS): the command line's flags,
the library's keywords (options_for, egressbox.run) and RunOptions' fields correspond one to
one, the differences named here on purpose; a flag and the policy key it mirrors mean the same;
the command line builds its options through options_for, as the library does."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from egressbox import cli
from egressbox.cli.run import _cli_options
from egressbox.cli.run_start import no_sandbox
from egressbox.core.policy import parse_policy
from egressbox.runner.flags import RUN_FLAGS, dest
from egressbox.runner.options import RunOptions, options_for

# Flags of the command line's own, that set no library keyword, and why.
CLI_ONLY = {
    "--policy": "a file; the library takes a loaded Policy (policy=)",
    "--no-sandbox": "Harn's spelling of --profile unrestricted (cli/run_start.py no_sandbox)",
    "--allow-process-network": "Harn's flag, accepted: the proxy is always the way out",
    "--audit-log": "a file; the library takes an AuditSink (audit=, a keyword of run())",
    "--report-only": "the policy's mode; the library takes a Policy in report mode",
    "--report": "what the command line prints; the library returns RunResult.report",
    "--save-approved": "a file written from RunResult.approved",
    "--upstream": "the policy's upstream; the library takes a Policy with one",
    "--upstream-target": "the same",
}

# Library keywords no flag sets, and why.
LIBRARY_ONLY = {
    "policy": "the command line's --policy is a file, loaded while the launcher starts",
    "cwd": "the command line runs the command where it is started",
    "base_env": "the command line passes its own environment",
    "secrets": "the command line takes [[secret]] values from each entry's source",
    "trusted_files": "the command line names its own files (--policy, --audit-log, ...)",
    "run_settings": "the policy's run tables, read by the command line before the fork",
}

# RunOptions fields by another name than their keyword.
RENAMED = {"cmd": "argv", "env": "env_policy"}

# RunOptions fields no keyword sets: the policy's tables alone fill them.
FROM_POLICY = {
    "presets",
    "deny",
    "rlimit_nofile",
    "rlimit_as",
    "max_processes",
    "max_memory",
    "secret_names",
    "terminate",
    "secret_env",
    "notes",  # what is said about the profile chosen (deprecated names, a stricter policy)
    "workspace_asked",  # whether --workspace or the policy named the mode (an explicit
    # `staged` is refused where it cannot be built; the default falls back to direct)
}

# Policy keys by another name than the flag's keyword (the policy's names are Harn's or
# describe the table's own value).
POLICY_NAMES = {
    "env": "[env] policy",
    "grants": "[env] grant",
    "allow_loopback": "[process] allow_tcp_loopback",
    "read_only_workspace": "[filesystem] workspace",  # workspace = "read-only"
}


def _keywords() -> set[str]:
    parameters = inspect.signature(options_for).parameters
    return {name for name, p in parameters.items() if p.kind is not p.VAR_KEYWORD}


def test_every_flag_of_the_parser_is_declared_once() -> None:
    parser = cli.build_parser("run")
    sub = next(a for a in parser._actions if a.dest == "command")
    assert isinstance(sub.choices, dict)
    run = sub.choices["run"]
    parsed = {name for action in run._actions for name in action.option_strings} - {
        "-h",
        "--help",
    }
    declared = [name for flag in RUN_FLAGS for name in flag.names if name.startswith("-")]
    assert len(declared) == len(set(declared)), "a flag declared twice"
    assert parsed == set(declared)
    assert {flag.names[0]: dest(flag) for flag in RUN_FLAGS} == {
        (a.option_strings[0] if a.option_strings else a.dest): a.dest
        for a in run._actions
        if a.dest != "help"
    }


def test_flags_keywords_and_fields_correspond() -> None:
    keywords = _keywords()
    by_flag = {flag.keyword for flag in RUN_FLAGS if flag.keyword}
    cli_only = {flag.names[0] for flag in RUN_FLAGS if not flag.keyword}
    assert cli_only == set(CLI_ONLY)
    assert by_flag <= keywords, f"flags naming no keyword: {by_flag - keywords}"
    assert keywords - by_flag == set(LIBRARY_ONLY)
    fields = set(RunOptions._fields)
    filled = {RENAMED.get(k, k) for k in keywords - {"run_settings"}}
    assert filled <= fields, f"keywords filling no field: {filled - fields}"
    assert fields - filled == FROM_POLICY


def test_policy_keys_mirror_their_flags() -> None:
    from egressbox.core.policy import EnvSettings, FilesystemSettings, ProcessSettings

    tables: dict[str, tuple[str, ...]] = {
        "process": ProcessSettings._fields,
        "filesystem": FilesystemSettings._fields,
        "env": EnvSettings._fields,
    }
    mirrored = {flag.keyword: flag.policy_key for flag in RUN_FLAGS if flag.policy_key}
    for keyword, key in mirrored.items():
        table, name = key.strip("[").split("] ")
        assert name in tables[table], key
        assert key == POLICY_NAMES.get(keyword, f"[{table}] {keyword}"), key
    assert set(POLICY_NAMES) <= set(mirrored)


# One value per mirrored key: (TOML table, key, value), the flags saying the same, and the
# RunOptions field that then holds it. Given either way, the run is asked the same.
SAME_MEANING = [
    ("process", "profile", "unrestricted", ["--profile", "unrestricted"], "profile"),
    ("process", "timeout", 7, ["--timeout", "7"], "timeout"),
    ("process", "allow_tcp_loopback", True, ["--allow-loopback"], "allow_loopback"),
    ("filesystem", "read_roots", ["/r"], ["--read-root", "/r"], "read_roots"),
    ("filesystem", "write_roots", ["/w"], ["--write-root", "/w"], "write_roots"),
    ("filesystem", "process_read_roots", ["/p"], ["--process-read-root", "/p"], None),
    ("filesystem", "process_write_roots", ["/q"], ["--process-write-root", "/q"], None),
    ("filesystem", "unix_socket_roots", ["/s"], ["--unix-socket-root", "/s"], None),
    ("filesystem", "writable_trusted", ["/w/.envrc"], ["--writable-trusted", "/w/.envrc"], None),
    ("filesystem", "workspace", "read-only", ["--read-only-workspace"], "read_only_workspace"),
    ("filesystem", "toolchain_cache", "real", ["--toolchain-cache", "real"], None),
    ("env", "policy", "isolated", ["--env", "isolated"], "env_policy"),
    ("env", "grant", ["X=1"], ["--grant", "X=1"], "grants"),
]


def _cli(*argv: str, settings: Any = None) -> RunOptions:
    args = cli.build_parser("run").parse_args(["run", *argv, "--", "true"])
    assert no_sandbox(args) == ""
    options = _cli_options(args, ["true"], settings)
    assert options is not None
    return options


@pytest.mark.parametrize(("table", "key", "value", "flags", "field"), SAME_MEANING)
def test_a_policy_key_and_its_flag_mean_the_same(
    table: str, key: str, value: Any, flags: list[str], field: str | None
) -> None:
    field = field or key
    settings = parse_policy({table: {key: value}}, env={}).run_settings
    from_policy, from_flag = _cli(settings=settings), _cli(*flags)
    assert getattr(from_policy, field) == getattr(from_flag, field)
    assert getattr(from_flag, field) != getattr(_cli(), field)


# Each keyword a flag sets, given on the command line and to the library: the same options.
BOTH_WAYS: list[tuple[list[str], dict[str, Any]]] = [
    (["--profile", "os_hardened"], {"profile": "os_hardened"}),
    (["--read-only-root", "/r", "--read-root", "/s"], {"read_roots": ["/r", "/s"]}),
    (["--write-root", "/w"], {"write_roots": ["/w"]}),
    (["--sandbox-read-root", "/p"], {"process_read_roots": ["/p"]}),
    (["--sandbox-write-root", "/q"], {"process_write_roots": ["/q"]}),
    (["--env", "granted"], {"env": "granted"}),
    (["--grant", "A", "--grant", "B=2"], {"grants": {"A": None, "B": "2"}}),
    (["--env-remove", "HOME"], {"env_remove": ["HOME"]}),
    (["--grant-file", "/g"], {"grant_files": ["/g"]}),
    (["--allow-process-loopback"], {"allow_loopback": True}),
    (["--sandbox-unix-socket-root", "/s"], {"unix_socket_roots": ["/s"]}),
    (["--writable-trusted", "/w/.envrc"], {"writable_trusted": ["/w/.envrc"]}),
    (["--read-only-workspace"], {"read_only_workspace": True}),
    (["--toolchain-cache", "real"], {"toolchain_cache": "real"}),
    (["--allow-direct-network"], {"allow_direct_network": True}),
    (["--no-capture"], {"capture": False}),
    (["--user", "nobody"], {"user": "nobody"}),
    (["--pass-fd", "5"], {"pass_fds": [5]}),
    (["--timeout", "2.5"], {"timeout": 2.5}),
    (["--workspace", "direct"], {"workspace": "direct"}),
    (["--review"], {"review": True}),
    (["-q"], {"announce": False}),
    (["-v"], {"log_allowed": True}),
    (["--nameserver", "127.0.0.1:5353"], {"nameservers": [("127.0.0.1", 5353)]}),
]


def test_every_keyword_of_a_flag_is_shown_both_ways() -> None:
    shown = {k for _, keywords in BOTH_WAYS for k in keywords}
    # on_miss and ask_timeout need a terminal or a command to ask (tests/cli/test_run_cli.py).
    assert shown | {"cmd", "on_miss", "ask_timeout"} == {f.keyword for f in RUN_FLAGS} - {""}


@pytest.mark.parametrize(("flags", "keywords"), BOTH_WAYS)
def test_the_command_line_builds_what_the_library_does(
    flags: list[str], keywords: dict[str, Any]
) -> None:
    assert _cli(*flags) == options_for(["true"], policy=None, **keywords)


def test_the_command_line_names_its_own_files_trusted(tmp_path: Any) -> None:
    log = str(tmp_path / "audit.jsonl")
    options = _cli("--audit-log", log)
    assert options == options_for(["true"], policy=None, trusted_files=[log])
