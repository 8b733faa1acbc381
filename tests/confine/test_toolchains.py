"""Toolchain caches (confine/toolchains.py): where each cache goes in scratch and real mode,
which caller values stand, and the hint a refusal on one of them gets. Pure."""

from __future__ import annotations

import pytest

from egressbox.confine.toolchains import (
    CACHES,
    GO_CACHE_RW,
    MISSING,
    NEVER_REAL,
    CacheMode,
    cache_hint,
    innermost,
    plan_caches,
)

HOME = "/home/alice"
SCRATCH = "/work/p/.egressbox/cache"
# The variables the issue names, one per toolchain (Maven's is the system property).
EXPECTED = {
    "GOCACHE": "go-build",
    "GOMODCACHE": "go-mod",
    "GOPATH": "go-path",
    "CARGO_HOME": "cargo",
    "PNPM_HOME": "pnpm",
    "YARN_CACHE_FOLDER": "yarn",
    "YARN_GLOBAL_FOLDER": "yarn-global",
    "npm_config_cache": "npm",
    "PIP_CACHE_DIR": "pip",
    "UV_CACHE_DIR": "uv",
    "PYTHONUSERBASE": "python-user",
    "XDG_CACHE_HOME": "xdg",
    "GRADLE_USER_HOME": "gradle",
}


def test_scratch_mode_points_every_cache_into_the_scratch_space() -> None:
    plan = plan_caches({}, home=HOME, scratch=SCRATCH, mode=CacheMode.SCRATCH)
    for name, sub in EXPECTED.items():
        assert plan.env[name] == f"{SCRATCH}/{sub}", name
    assert plan.env["MAVEN_OPTS"] == f"-Dmaven.repo.local={SCRATCH}/m2"
    assert plan.env["GOFLAGS"] == GO_CACHE_RW  # so `rm -rf .egressbox` works
    assert plan.grants == () and plan.kept == ()
    assert "CARGO_TARGET_DIR" not in plan.env  # target/ belongs in the project


def test_a_value_the_caller_set_stands() -> None:
    env = {"GOMODCACHE": "/srv/gomod", "npm_config_cache": "~/.npm-mine", "GOFLAGS": "-v"}
    plan = plan_caches(env, home=HOME, scratch=SCRATCH, mode=CacheMode.SCRATCH)
    assert "GOMODCACHE" not in plan.env and "npm_config_cache" not in plan.env
    assert set(plan.kept) == {"GOMODCACHE", "npm_config_cache"}
    assert "GOFLAGS" not in plan.env  # the caller's flags stay as they are
    assert plan.env["GOCACHE"] == f"{SCRATCH}/go-build"
    user = [r for r in plan.roots if r.user_set]
    assert {(r.variable, r.path) for r in user} == {
        ("GOMODCACHE", "/srv/gomod"),
        ("npm_config_cache", f"{HOME}/.npm-mine"),
    }


def test_an_outer_runs_value_is_replaced() -> None:
    outer = "/outer/.egressbox/cache"
    env = {"XDG_CACHE_HOME": f"{outer}/xdg", "MAVEN_OPTS": f"-Xmx1g -Dmaven.repo.local={outer}/m2"}
    plan = plan_caches(env, home=HOME, scratch=SCRATCH, mode=CacheMode.SCRATCH)
    assert plan.env["XDG_CACHE_HOME"] == f"{SCRATCH}/xdg"
    assert plan.env["MAVEN_OPTS"] == f"-Xmx1g -Dmaven.repo.local={SCRATCH}/m2"
    assert plan.kept == ()


def test_maven_options_of_the_caller_keep_their_other_flags() -> None:
    plan = plan_caches({"MAVEN_OPTS": "-Xmx2g"}, home=HOME, scratch=SCRATCH, mode=CacheMode.SCRATCH)
    assert plan.env["MAVEN_OPTS"] == f"-Xmx2g -Dmaven.repo.local={SCRATCH}/m2"
    mine = {"MAVEN_OPTS": "-Dmaven.repo.local=/srv/m2"}
    plan = plan_caches(mine, home=HOME, scratch=SCRATCH, mode=CacheMode.SCRATCH)
    assert "MAVEN_OPTS" not in plan.env and plan.kept == ("MAVEN_OPTS",)


def test_real_mode_grants_the_existing_real_caches_only() -> None:
    existing = {f"{HOME}/.npm", f"{HOME}/.cache/go-build", f"{HOME}/.cargo/registry"}

    def check(path: str) -> str:
        return "" if path in existing else MISSING

    plan = plan_caches({}, home=HOME, scratch=SCRATCH, mode=CacheMode.REAL, check=check)
    assert set(plan.grants) == {
        (f"{HOME}/.npm", "npm"),
        (f"{HOME}/.cache/go-build", "go"),
        (f"{HOME}/.cargo/registry", "cargo"),
    }
    assert plan.env["npm_config_cache"] == f"{HOME}/.npm"
    assert plan.env["GOCACHE"] == f"{HOME}/.cache/go-build"
    assert "CARGO_HOME" not in plan.env  # ~/.cargo stays; only its download caches are granted
    # A cache that does not exist yet stays in the scratch space; nothing is made at home.
    assert plan.env["PIP_CACHE_DIR"] == f"{SCRATCH}/pip"
    # What the host runs is never a real grant, whatever the mode.
    for name in ("GOPATH", "PYTHONUSERBASE", "XDG_CACHE_HOME"):
        assert plan.env[name].startswith(SCRATCH), name
    assert plan.notes == ()


def test_real_mode_says_why_a_cache_is_not_granted() -> None:
    def check(path: str) -> str:
        return "a symlink is on its way" if path.endswith(".npm") else MISSING

    plan = plan_caches({}, home=HOME, scratch=SCRATCH, mode=CacheMode.REAL, check=check)
    assert plan.grants == ()
    assert plan.notes == (f"npm's cache {HOME}/.npm is not granted: a symlink is on its way",)
    assert plan.env["npm_config_cache"] == f"{SCRATCH}/npm"


def test_real_mode_follows_the_callers_base_locations() -> None:
    env = {"GOPATH": "/srv/go:/other", "XDG_CACHE_HOME": "/srv/cache"}
    plan = plan_caches(env, home=HOME, scratch=SCRATCH, mode=CacheMode.REAL, check=lambda _: "")
    grants = dict(plan.grants)
    assert "/srv/go/pkg/mod" in grants and "/srv/cache/pip" in grants
    assert "/srv/go" not in grants and "/srv/cache" not in grants  # never the whole base


def test_never_real_are_the_locations_the_host_runs_code_from() -> None:
    assert {"GOPATH", "PYTHONUSERBASE", "XDG_CACHE_HOME", "YARN_GLOBAL_FOLDER"} == NEVER_REAL
    assert {c.variable for c in CACHES} >= set(EXPECTED)


def test_the_innermost_cache_location_wins() -> None:
    plan = plan_caches({}, home=HOME, scratch=SCRATCH, mode=CacheMode.SCRATCH)
    found = innermost(plan.roots, f"{HOME}/.cache/go-build/ab/cd")
    assert found is not None and found.variable == "GOCACHE"
    found = innermost(plan.roots, f"{HOME}/.cache/some-tool/x")
    assert found is not None and found.variable == "XDG_CACHE_HOME"
    assert innermost(plan.roots, f"{HOME}/.local/share/other") is None
    found = innermost(plan.roots, f"{HOME}/.local/lib/python3.11/site-packages")
    assert found is not None and found.variable == "PYTHONUSERBASE"


@pytest.mark.parametrize(
    ("env", "refused", "needles"),
    [
        (
            {"GOMODCACHE": "/srv/gomod"},
            "/srv/gomod/cache/download",
            [
                "GOMODCACHE points at /srv/gomod",
                "--process-write-root /srv/gomod grants it",
                "or unset GOMODCACHE",
                "--toolchain-cache real",
            ],
        ),
        (
            {},
            f"{HOME}/.npm/_cacache",
            [f"{HOME}/.npm is npm's default location (npm_config_cache)", "--toolchain-cache real"],
        ),
        (
            {},
            f"{HOME}/.cache/tool-x/db",
            [f"--process-write-root {HOME}/.cache/tool-x grants it"],
        ),
        (
            {"GOPATH": "/srv/go"},
            "/srv/go/bin/x",
            ["GOPATH points at /srv/go", "--process-write-root /srv/go"],
        ),
    ],
)
def test_a_hint_names_the_variable_and_the_grant(
    env: dict[str, str], refused: str, needles: list[str]
) -> None:
    plan = plan_caches(env, home=HOME, scratch=SCRATCH, mode=CacheMode.SCRATCH)
    root = innermost(plan.roots, refused)
    assert root is not None
    hint = cache_hint(root, refused, mode=CacheMode.SCRATCH)
    for needle in needles:
        assert needle in hint, hint
    if root.variable in NEVER_REAL:
        assert "--toolchain-cache real" not in hint
