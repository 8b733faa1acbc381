"""The project root, a workspace's git directories and the project policy's trust
(runner/project.py), on real directories and real git repositories."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from egressbox.runner.project import (
    find_project_root,
    git_grants,
    is_trusted,
    remember,
)

GIT = shutil.which("git")
needs_git = pytest.mark.skipif(GIT is None, reason="git is not installed")
GIT_TIMEOUT = 60


def _git(cwd: Path, *args: str) -> None:
    assert GIT is not None
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd)}
    identity = ["-c", "user.email=t@example.invalid", "-c", "user.name=t"]
    subprocess.run(
        [GIT, *identity, *args],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
        timeout=GIT_TIMEOUT,
    )


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    _git(path, "init", "-q", "-b", "main")
    _git(path, "commit", "-q", "--allow-empty", "-m", "init")
    return path


def test_the_nearest_marker_is_the_project_root(tmp_path: Path) -> None:
    (tmp_path / "p" / ".git").mkdir(parents=True)
    deep = tmp_path / "p" / "a" / "b"
    deep.mkdir(parents=True)
    found = find_project_root(str(deep))
    assert (found.path, found.marker) == (str(tmp_path / "p"), ".git")
    assert "holds .git" in found.reason
    (tmp_path / "p" / "a" / "egressbox.toml").write_text("[egress]\n", encoding="utf-8")
    found = find_project_root(str(deep))
    assert (found.path, found.marker) == (str(tmp_path / "p" / "a"), "egressbox.toml")
    assert found.policy == str(tmp_path / "p" / "a" / "egressbox.toml")


def test_without_a_marker_the_working_directory(tmp_path: Path) -> None:
    found = find_project_root(str(tmp_path))
    assert (found.path, found.marker) == (str(tmp_path), "")
    assert "the working directory" in found.reason and found.policy is None


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
def test_another_users_marker_is_passed_over(tmp_path: Path) -> None:
    planted = tmp_path / "shared"
    (planted / ".git").mkdir(parents=True)
    os.chown(planted / ".git", 65534, 65534)
    mine = planted / "mine"
    mine.mkdir()
    found = find_project_root(str(mine))
    assert found.path == str(mine) and found.marker == ""
    assert found.passed_over == (str(planted / ".git"),)


def test_a_symlinked_policy_is_no_project_policy(tmp_path: Path) -> None:
    (tmp_path / "real.toml").write_text("[egress]\n", encoding="utf-8")
    (tmp_path / "egressbox.toml").symlink_to(tmp_path / "real.toml")
    found = find_project_root(str(tmp_path))
    # A symlink is no marker of the invoker's, so it does not make a project root either.
    assert found.policy is None


@needs_git
def test_a_submodule_leads_on_to_its_superproject(tmp_path: Path) -> None:
    sub_origin = _repo(tmp_path / "origin")
    top = _repo(tmp_path / "top")
    _git(top, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub_origin), "sub")
    assert (top / "sub" / ".git").is_file()
    found = find_project_root(str(top / "sub"))
    assert found.path == str(top) and found.marker == ".git"


@needs_git
def test_a_linked_worktree_gets_its_common_dir_and_protects_what_names_it(tmp_path: Path) -> None:
    main = _repo(tmp_path / "main")
    _git(main, "worktree", "add", "-q", str(tmp_path / "wt"), "-b", "feature")
    wt = str(tmp_path / "wt")
    grants = git_grants(wt)
    common = str(main / ".git")
    assert grants.write == ((common, f"the git common directory of the worktree {wt}"),)
    gitdir = os.path.join(common, "worktrees", "wt")
    for trusted in (
        f"{wt}/.git",
        f"{gitdir}/commondir",
        f"{gitdir}/gitdir",
        f"{common}/config",
        f"{common}/hooks",
        f"{common}/objects/info/alternates",
    ):
        assert trusted in grants.protect, trusted


@needs_git
def test_a_forged_git_file_grants_nothing(tmp_path: Path) -> None:
    target = _repo(tmp_path / "elsewhere")
    ws = tmp_path / "ws"
    ws.mkdir()
    # Names a real repository, but no worktree of it points back here.
    (ws / ".git").write_text(f"gitdir: {target}/.git\n", encoding="utf-8")
    grants = git_grants(str(ws))
    assert grants.write == () and grants.read == ()
    assert grants.protect == (f"{ws}/.git",) and grants.notes
    # A worktree layout whose back-pointer names another worktree.
    _git(target, "worktree", "add", "-q", str(tmp_path / "real-wt"))
    gitdir = target / ".git" / "worktrees" / "real-wt"
    (ws / ".git").write_text(f"gitdir: {gitdir}\n", encoding="utf-8")
    forged = git_grants(str(ws))
    assert forged.write == () and "does not name" in forged.notes[0]


@needs_git
def test_alternates_are_read_only_grants(tmp_path: Path) -> None:
    origin = _repo(tmp_path / "origin")
    clone = tmp_path / "clone"
    subprocess.run(
        [GIT or "git", "clone", "-q", "--shared", str(origin), str(clone)],
        check=True,
        capture_output=True,
        timeout=GIT_TIMEOUT,
    )
    grants = git_grants(str(clone))
    assert grants.read == ((str(origin / ".git" / "objects"), f"git alternates of {clone}"),)
    assert grants.write == ()
    assert f"{clone}/.git/objects/info/alternates" in grants.protect


def test_an_alternate_that_is_no_object_store_is_not_granted(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / ".git" / "objects" / "info").mkdir(parents=True)
    secret = tmp_path / "documents"
    secret.mkdir()
    (ws / ".git" / "objects" / "info" / "alternates").write_text(f"{secret}\n", encoding="utf-8")
    grants = git_grants(str(ws))
    assert grants.read == () and "not an object store" in grants.notes[0]


def test_a_project_policy_is_trusted_once_used_and_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EGRESSBOX_STATE_DIR", str(tmp_path / "state"))
    policy = tmp_path / "egressbox.toml"
    policy.write_text('[egress]\nallow = ["pypi.org:443"]\n', encoding="utf-8")
    assert not is_trusted(str(policy))
    remember(str(policy))
    assert is_trusted(str(policy))
    policy.write_text('[egress]\nallow = ["*.evil.example"]\n', encoding="utf-8")
    assert not is_trusted(str(policy))  # rewritten (by a command, or a pull): ask again
