"""confine/env.py's rules, table by table: which names and values `inherited` holds back,
what a grant or --env-remove changes, and the variables it extends rather than replaces.
(The same for real, through `egressbox run`: tests/runner/test_run_environment.py.)"""

from __future__ import annotations

import pytest

from egressbox.confine.env import (
    PORT_TEMPLATES,
    EnvPolicy,
    HeldBack,
    ProxyEndpoints,
    Scratch,
    child_environment,
    held_back,
    looks_like_credential,
    without_java_proxy,
)

HELD_NAMES = [
    "GITHUB_TOKEN",
    "GH_TOKEN",
    "GITLAB_TOKEN",
    "CI_JOB_TOKEN",
    "NPM_TOKEN",
    "NODE_AUTH_TOKEN",
    "npm_config__auth",
    "npm_config_//registry.npmjs.org/:_authToken",
    "HF_TOKEN",
    "VAULT_TOKEN",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_CONNECTION_STRING",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "DOCKER_AUTH_CONFIG",
    "TWINE_PASSWORD",
    "UV_INDEX_PRIVATE_PASSWORD",
    "PGPASSWORD",
    "MYSQL_PWD",
    "SSH_AUTH_SOCK",
    "KRB5CCNAME",
    "EGRESSBOX_ADMIN_TOKEN",
    "SLACK_WEBHOOK_URL",
    "KEY",
    "client_secret",
]
PASSED_NAMES = [
    "PATH",
    "HOME",
    "KUBECONFIG",  # a path: the filesystem grants decide whether its file is readable
    "TOKENIZERS_PARALLELISM",
    "GIT_AUTHOR_NAME",
    "XKB_KEYBOARD",
    "KEYMAP",
    "AWS_REGION",
    "AWS_PROFILE",
    "XAUTHORITY",
    "LS_COLORS",
]


@pytest.mark.parametrize("name", HELD_NAMES)
def test_credential_names_are_held(name: str) -> None:
    assert looks_like_credential(name, "x")


@pytest.mark.parametrize("name", PASSED_NAMES)
def test_other_names_pass(name: str) -> None:
    assert not looks_like_credential(name, "/usr/bin:/bin")


@pytest.mark.parametrize(
    ("value", "held"),
    [
        ("https://user:s3cret@pypi.example/simple", True),
        ("https://glpat-abcdefghijklmnopqrst@gitlab.example/x.git", True),
        ("https://a https://b:c@d", True),
        ("ssh://git@github.com/org/repo", False),
        ("https://pypi.org/simple", False),
        ("https://user@host/", False),
        ("ghp_" + "A1" * 18, True),
        ("sk-ant-api03-" + "x" * 30, True),
        ("AKIAABCDEFGHIJKLMNOP", True),
        ("Authorization: Bearer abc", True),
        ("--header=Bearer abcdefghijklmnopqrstuvwxyz", True),
        ("task-list-of-many-words", False),
        ("/home/me/.local/bin", False),
    ],
)
def test_values_that_are_credentials_are_held_whatever_the_name(value: str, held: bool) -> None:
    assert looks_like_credential("SOME_SETTING", value) is held


def test_git_config_pairs_go_as_a_group_when_one_carries_a_credential() -> None:
    base = {
        "GIT_CONFIG_COUNT": "2",
        "GIT_CONFIG_KEY_0": "http.https://github.com/.extraheader",
        "GIT_CONFIG_VALUE_0": "AUTHORIZATION: basic eDp5",
        "GIT_CONFIG_KEY_1": "core.autocrlf",
        "GIT_CONFIG_VALUE_1": "false",
    }
    held = held_back(base, policy=EnvPolicy.INHERITED, grants={})
    assert set(held.credentials) == set(base), "git refuses a count whose pair is missing"
    harmless = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.autocrlf"}
    assert held_back(harmless, policy=EnvPolicy.INHERITED, grants={}) == HeldBack()


def test_only_inherited_holds_back_and_grants_and_removals_win() -> None:
    base = {"GITHUB_TOKEN": "t", "RUSTC_WRAPPER": "sccache", "LANG": "C", "TERM": "x"}
    held = held_back(base, policy=EnvPolicy.INHERITED, grants={"LANG": None}, remove=["TERM"])
    assert held == HeldBack(("GITHUB_TOKEN",), ("RUSTC_WRAPPER",), ("TERM",))
    granted = held_back(base, policy=EnvPolicy.INHERITED, grants={"GITHUB_TOKEN": None})
    assert granted.credentials == ()
    assert held_back(base, policy=EnvPolicy.ISOLATED, grants={}, remove=["TERM"]) == HeldBack(
        removed=("TERM",)
    )
    notice = held.notice()
    assert notice is not None and "GITHUB_TOKEN" in notice and "sccache" in notice
    assert HeldBack().notice() is None


def _env(base: dict[str, str], **kwargs: object) -> dict[str, str]:
    options: dict[str, object] = {
        "policy": EnvPolicy.INHERITED,
        "grants": {},
        "proxy": ProxyEndpoints("127.0.0.1", 8080, "127.0.0.1", 1080),
        "scratch": Scratch("/ws/.egressbox/tmp", "/ws/.egressbox/cache"),
        "profile": "workspace_paths",
    } | kwargs
    return child_environment(base, **options)  # type: ignore[arg-type]


def test_the_child_environment_lacks_what_is_held_back() -> None:
    env = _env({"GITHUB_TOKEN": "t", "A": "1", "B": "2"}, remove=["B"])
    assert "GITHUB_TOKEN" not in env and env["A"] == "1" and "B" not in env
    env = _env({"GITHUB_TOKEN": "t"}, grants={"GITHUB_TOKEN": None})
    assert env["GITHUB_TOKEN"] == "t"


@pytest.mark.parametrize(
    ("tmpdir", "kept"),
    [
        ("/ws/build/tmp", True),
        ("/ws", True),
        ("/ws/../etc", False),
        ("/wsx/tmp", False),
        ("/tmp", False),
        ("relative/tmp", False),
    ],
)
def test_an_inherited_tmpdir_inside_a_write_root_is_kept(tmpdir: str, kept: bool) -> None:
    env = _env({"TMPDIR": tmpdir}, writable=["/ws"])
    assert env["TMPDIR"] == (tmpdir if kept else "/ws/.egressbox/tmp")
    assert env["TMP"] == env["TEMP"] == "/ws/.egressbox/tmp"


def test_java_options_are_extended_not_replaced() -> None:
    env = _env({"JAVA_TOOL_OPTIONS": "-Xmx1g -Dhttp.proxyHost=corp -Dfile.encoding=UTF-8"})
    assert env["JAVA_TOOL_OPTIONS"] == (
        "-Xmx1g -Dfile.encoding=UTF-8 -Dhttp.proxyHost=127.0.0.1 -Dhttp.proxyPort=8080"
        " -Dhttps.proxyHost=127.0.0.1 -Dhttps.proxyPort=8080"
    )
    env = _env({"_JAVA_OPTIONS": "-Xss4m -DsocksProxyHost=x", "GRADLE_OPTS": "-Xmx3g"})
    assert env["_JAVA_OPTIONS"] == "-Xss4m" and env["GRADLE_OPTS"] == "-Xmx3g"
    assert without_java_proxy(' -Dname="a b" ') == '-Dname="a b"'


def test_java_options_survive_the_port_template() -> None:
    # The launcher fills "{http}" with str.format: the caller's braces must come back as such.
    env = _env({"JAVA_TOOL_OPTIONS": "-Dx={y}"}, proxy=PORT_TEMPLATES)
    filled = env["JAVA_TOOL_OPTIONS"].format(http=3128, socks=1080)
    assert filled.startswith("-Dx={y} -Dhttp.proxyHost=127.0.0.1 -Dhttp.proxyPort=3128")
