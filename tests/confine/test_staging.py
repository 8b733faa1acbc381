"""The gate's pure decisions (held_reason's table) and its openat2 resolution, on real files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from egressbox.confine import staging
from egressbox.confine.staging import DIR, FILE, OPAQUE, SYMLINK, WHITEOUT, Rules, held_reason


@pytest.mark.parametrize(
    ("path", "kind", "host", "reason"),
    [
        (".git/config", FILE, FILE, "git_control"),
        (".git/config.worktree", FILE, None, "git_control"),
        (".git/commondir", FILE, None, "git_control"),
        (".git/hooks/pre-commit", FILE, None, "git_control"),
        (".git/info/attributes", FILE, None, "git_control"),
        (".git/objects/info/alternates", FILE, None, "git_control"),
        (".git/modules/lib/config", FILE, FILE, "git_control"),
        (".git/modules/a/b/hooks/x", FILE, None, "git_control"),
        (".git/worktrees/wt/commondir", FILE, FILE, "git_control"),
        # A new repository lands as data; its control files are held by the rows above.
        ("sub/.git", DIR, None, None),
        (".git", DIR, None, None),
        ("sub/.git/config", FILE, None, "git_control"),
        ("sub/.git/hooks", DIR, None, "git_control"),
        ("sub/.git", FILE, None, "new_git_entry"),
        ("sub/.git", SYMLINK, None, "new_git_entry"),
        (".git", OPAQUE, DIR, "git_replaced"),
        (".git", WHITEOUT, DIR, "git_replaced"),
        (".git", FILE, DIR, "git_replaced"),
        (".git", SYMLINK, FILE, "git_replaced"),
        (".git/objects", WHITEOUT, DIR, "git_control"),
        (".git/modules", OPAQUE, DIR, "git_control"),
        ("a/b/.bashrc", FILE, None, "shell_startup"),
        (".config/fish/config.fish", FILE, None, "shell_startup"),
        (".envrc", FILE, FILE, "direnv"),
        ("x/.vscode/tasks.json", FILE, None, "editor_tasks"),
        (".idea", DIR, None, "editor_tasks"),
        ("egressbox.toml", FILE, FILE, "egressbox_own"),
        # What git writes in a commit, and ordinary files, are applied.
        (".git/objects/ab/cdef", FILE, None, None),
        (".git/refs/heads/main", FILE, FILE, None),
        (".git/index", FILE, FILE, None),
        (".git/HEAD", FILE, FILE, None),
        (".git/logs/HEAD", FILE, FILE, None),
        (".git/packed-refs", FILE, None, None),
        (".git", DIR, DIR, None),
        ("src/main.c", FILE, FILE, None),
        (".git.old/config", FILE, None, None),
        ("node_modules", OPAQUE, DIR, None),
    ],
)
def test_held_reason_table(path: str, kind: str, host: str | None, reason: str | None) -> None:
    assert held_reason(tuple(path.split("/")), kind, host) == reason


def test_a_deleted_directory_that_holds_a_trusted_name_is_held() -> None:
    parts = ("vendor",)
    assert held_reason(parts, WHITEOUT, DIR, holds_trusted=lambda: True) == "trusted_ancestor"
    assert held_reason(parts, WHITEOUT, DIR, holds_trusted=lambda: False) is None


def test_egressbox_own_files_their_rotations_and_lifted_paths() -> None:
    rules = Rules(own=(("logs", "audit.jsonl"),), lifted=((".git", "hooks"),))
    assert held_reason(("logs", "audit.jsonl"), FILE, FILE, rules) == "egressbox_own"
    assert held_reason(("logs", "audit.jsonl.1"), FILE, None, rules) == "egressbox_own"
    assert held_reason(("logs", "other"), FILE, None, rules) is None
    assert held_reason((".git", "hooks", "pre-commit"), FILE, None, rules) is None


def test_a_root_that_is_a_git_directory_holds_its_control_files() -> None:
    rules = Rules(git_dir=True)
    assert held_reason(("commondir",), FILE, None, rules) == "git_control"
    assert held_reason(("HEAD",), FILE, FILE, rules) is None


def test_openat2_never_resolves_through_a_symlink_or_out_of_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for path, codes in (
            ("link/x", (errno.ELOOP,)),
            ("link", (errno.ELOOP,)),
            ("../outside", (errno.EXDEV,)),
            (str(outside), (errno.EXDEV,)),
        ):
            with pytest.raises(OSError) as caught:
                staging.openat2(fd, path, os.O_PATH)
            assert caught.value.errno in codes, path
    finally:
        os.close(fd)
