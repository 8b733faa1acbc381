"""Clean copies of the tools' configuration files (confine/clean.py): no credential survives.

Each format is fed the places real users put tokens (git's extraheader and URLs, pip's index
URLs, cargo's registry tokens, uv's index URLs, conda's channel tokens); the clean text must
hold none of the secret and keep the settings a build needs. Property tests vary the secret,
the key name and the URL.
"""

from __future__ import annotations

import datetime
import os
import string
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressbox.confine import clean
from egressbox.confine.clean import (
    UncleanableError,
    clean_git,
    clean_ini,
    clean_text,
    clean_toml,
    clean_yaml,
    dump_toml,
    gather,
    strip_urls,
)

SECRET = "Zq7secretVALUE9x"  # a fake credential the tests look for

GITCONFIG = f"""# the user's config
[user]
\tname = Alice Example
\temail = alice@example.com
[http]
\textraheader = AUTHORIZATION: bearer {SECRET}
[http "https://git.example.com"]
\textraHeader = "Authorization: Basic {SECRET}"
[credential]
\thelper = store --file ~/.{SECRET}
[credential "https://github.com"]
\tusername = {SECRET}
[url "https://alice:{SECRET}@git.example.com/"]
\tinsteadOf = https://git.example.com/
[remote "origin"]
\turl = https://x-access-token:{SECRET}@github.com/a/b.git
\tfetch = +refs/heads/*:refs/remotes/origin/*
[core] sshCommand = sshpass -p {SECRET} ssh
\teditor = vim
[url "ssh://git@github.com/"]
\tinsteadOf = gh:
[alias]
\tlg = log --graph \\
  --oneline
"""


def test_git_config_keeps_settings_and_loses_every_credential() -> None:
    done = clean_git(GITCONFIG)
    assert SECRET not in done.text
    for kept in ("name = Alice Example", "editor = vim", "lg = log --graph \\\n  --oneline"):
        assert kept in done.text
    assert "url = https://github.com/a/b.git" in done.text
    assert '[url "https://git.example.com/"]' in done.text
    assert '[url "ssh://git@github.com/"]' in done.text  # an ssh login name is no secret
    assert "[credential" not in done.text
    assert {"http.extraheader", "core.sshcommand", "credential.helper"} <= set(done.removed)
    assert all(SECRET not in what for what in done.removed)  # names, never values


def test_git_config_includes_stay_only_when_the_caller_cleans_them() -> None:
    text = '[include]\n\tpath = ~/.extra\n[includeIf "gitdir:~/w/"]\n\tpath = "w.inc"\n'
    assert "path" not in clean_git(text).text
    asked: list[str] = []

    def cleans(path: str) -> bool:
        asked.append(path)
        return path == "w.inc"

    kept = clean_git(text, cleans)
    assert asked == ["~/.extra", "w.inc"]
    assert 'path = "w.inc"' in kept.text and "~/.extra" not in kept.text


@pytest.mark.parametrize(
    "text",
    ["key = value\n", "[user]\n\tname = a\n\t= nothing\n", "[user]\n\tname = a\n!!!\n"],
)
def test_git_text_that_is_not_git_config_is_refused(text: str) -> None:
    with pytest.raises(UncleanableError):
        clean_git(text)


def test_pip_conf() -> None:
    text = (
        "[global]\n"
        f"index-url = https://user:{SECRET}@pypi.example.com/simple\n"
        "extra-index-url =\n"
        f"    https://__token__:{SECRET}@extra.example.com/simple\n"
        "    https://pypi.org/simple\n"
        "client-cert = /home/a/client.pem\n"
        f"password = {SECRET}\n"
        f"    continued-{SECRET}\n"
        "timeout = 60\n"
    )
    done = clean_ini(text)
    assert SECRET not in done.text
    assert "index-url = https://pypi.example.com/simple" in done.text
    assert "    https://extra.example.com/simple\n    https://pypi.org/simple" in done.text
    assert "timeout = 60" in done.text and "client-cert" not in done.text
    with pytest.raises(UncleanableError):
        clean_ini("no section here\n")


def test_cargo_and_uv_toml() -> None:
    cargo = (
        f'[registry]\ntoken = "{SECRET}"\nglobal-credential-providers = ["cargo:token"]\n'
        f'[registries.corp]\nindex = "sparse+https://u:{SECRET}@r.example.com/"\n'
        f'token = "{SECRET}"\ncredential-provider = "cargo:libsecret"\n'
        "[net]\nretry = 3\ngit-fetch-with-cli = true\n"
    )
    done = clean_toml(cargo)
    data = tomllib.loads(done.text)
    assert SECRET not in done.text
    assert data["registries"]["corp"] == {"index": "sparse+https://r.example.com/"}
    assert data["net"] == {"retry": 3, "git-fetch-with-cli": True}
    uv = (
        f'[[index]]\nname = "corp"\nurl = "https://me:{SECRET}@pypi.example.com/simple"\n'
        'default = true\n[pip]\nindex-url = "https://pypi.org/simple"\n'
    )
    data = tomllib.loads(clean_toml(uv).text)
    assert data["index"] == [
        {"name": "corp", "url": "https://pypi.example.com/simple", "default": True}
    ]
    with pytest.raises(UncleanableError):
        clean_toml("[registry\ntoken = 1\n")


def test_condarc() -> None:
    text = (
        "channels:\n"
        f"  - https://conda.anaconda.org/t/{SECRET}/private\n"
        "  - conda-forge\n"
        f"channel_alias: https://u:{SECRET}@conda.example.com\n"
        "proxy_servers:\n"
        f"  https: http://user:{SECRET}@proxy.example.com:8080\n"
        "anaconda_token:\n"
        f"  nested: {SECRET}\n"
        f"  - {SECRET}\n"
        "ssl_verify: true\n"
    )
    done = clean_yaml(text)
    assert SECRET not in done.text
    assert "  - https://conda.anaconda.org/private\n  - conda-forge\n" in done.text
    assert "https: http://proxy.example.com:8080" in done.text
    assert "ssl_verify: true" in done.text
    with pytest.raises(UncleanableError):
        clean_yaml(f"servers: {{token: {SECRET}}}\n")


def test_known_token_shapes_go_whatever_their_key() -> None:
    token = "ghp_" + "a1B2" * 9
    assert token not in clean_git(f"[alias]\n\tpush2 = !git push https://{token}@h/x\n").text
    assert token not in clean_git(f"[alias]\n\tx = !curl -H 'X: {token}'\n").text
    assert token not in clean_text(f"*.bin filter=lfs\n# {token}\n").text
    assert "*.bin filter=lfs" in clean_text(f"*.bin filter=lfs\n# {token}\n").text


# -- properties ----------------------------------------------------------------------------

_USER = st.text(string.ascii_letters + string.digits + "-._~%!$&'()*+,;=", min_size=1)
_PASSWORD = st.text(string.ascii_letters + string.digits + "-._~%!$&'()*+,;=:@", min_size=1)
_HOST = st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z]{2,6}){1,2}", fullmatch=True)
_PATH = st.from_regex(r"(/[A-Za-z0-9._-]{0,12}){0,3}", fullmatch=True)
_SCHEME = st.sampled_from(["https", "http", "ssh", "git+ssh", "sparse+https", "ftp", "s3"])


@given(_SCHEME, _USER, _PASSWORD, _HOST, _PATH)
def test_a_url_loses_its_password_and_keeps_its_host_and_path(
    scheme: str, user: str, password: str, host: str, path: str
) -> None:
    url = f"{scheme}://{user}:{password}@{host}{path}"
    removed: list[str] = []
    assert strip_urls(f"url = {url}\n", removed) == f"url = {scheme}://{host}{path}\n"
    assert removed


@given(_USER.filter(lambda u: ":" not in u), _HOST)
def test_a_user_name_alone_goes_over_http(user: str, host: str) -> None:
    assert strip_urls(f"https://{user}@{host}/x", []) == f"https://{host}/x"


_SECRET_WORDS = st.sampled_from(
    ["token", "Password", "passwd", "SECRET", "auth", "credential", "apiKey", "extraHeader"]
)
_AFFIX = st.from_regex(r"[a-z]{0,6}", fullmatch=True)


@given(_AFFIX, _SECRET_WORDS, _AFFIX)
def test_a_key_named_like_a_secret_loses_its_value_in_every_format(
    before: str, word: str, after: str
) -> None:
    key = f"{before}{word}{after}"
    if key.lower().startswith("author") or "author" in key.lower():
        return
    value = "kept-" + SECRET
    assert SECRET not in clean_git(f"[section]\n\t{key} = {value}\n").text
    assert SECRET not in clean_ini(f"[global]\n{key} = {value}\n").text
    assert SECRET not in clean_toml(f'[table]\n"{key}" = "{value}"\n').text
    assert SECRET not in clean_yaml(f"{key}: {value}\n").text


_TOML_KEY = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)
_TOML_SCALAR = (
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.booleans()
    | st.floats(allow_nan=False)
    | st.dates()
    | st.datetimes(timezones=st.none() | st.just(datetime.UTC))
)
_TOML_VALUE = st.recursive(
    _TOML_SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TOML_KEY, inner, max_size=3),
    max_leaves=8,
)


@given(st.dictionaries(_TOML_KEY, _TOML_VALUE, max_size=5))
def test_dump_toml_round_trips(data: dict[str, object]) -> None:
    assert tomllib.loads(dump_toml(data)) == data


# -- gathering the host's files ---------------------------------------------------------------


def test_gather_copies_files_and_directories_and_refuses_what_it_cannot_clean(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    (home / ".config" / "git").mkdir(parents=True)
    (home / ".gitconfig").write_text(
        f"[include]\n\tpath = .gitconfig.local\n[http]\n\textraheader = {SECRET}\n"
    )
    (home / ".gitconfig.local").write_text(f"[user]\n\tname = A\n\tpassword = {SECRET}\n")
    (home / ".config" / "git" / "config").write_text("[core]\n\teditor = vi\n")
    (home / ".config" / "git" / "unknown.bin").write_text(SECRET)
    (home / ".condarc").write_text(f"x: {{token: {SECRET}}}\n")
    outside = tmp_path / "shadow"
    outside.write_text("root:x:0:0\n")
    outside.chmod(0o600)
    (home / ".config" / "pip").mkdir()
    os.symlink(outside, home / ".config" / "pip" / "pip.conf")
    entries = [str(home / p) for p in (".gitconfig", ".config/git", ".condarc", ".config/pip")]
    got = gather(entries, home=str(home), deny=())
    files = dict(got.files)
    assert set(files) == {
        str(home / ".gitconfig"),
        str(home / ".gitconfig.local"),
        str(home / ".config/git/config"),
    }
    assert all(SECRET not in text for text in files.values())
    assert "path = .gitconfig.local" in files[str(home / ".gitconfig")]
    assert set(got.originals) == {*files, *(str(home / p) for p in _REFUSED)}
    notes = "\n".join(got.notes)
    for refused in _REFUSED:
        assert f"{home / refused}: not granted" in notes
    assert "outside the home and not world-readable" in notes


_REFUSED = (".config/git/unknown.bin", ".condarc", ".config/pip/pip.conf")


def test_kind_of() -> None:
    assert clean.kind_of("/h/.cargo/config.toml", "/h") == clean.TOML
    assert clean.kind_of("/etc/gitconfig", "/h") == clean.GIT
    assert clean.kind_of("/h/.config/uv/other.json", "/h") is None
