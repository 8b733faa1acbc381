"""expand_excluding: a grant minus denied paths, as Landlock (allow-only) needs it."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from egressbox.confine.grants import expand_excluding, is_under


def test_a_root_without_denied_paths_stays_whole(tmp_path: Path) -> None:
    assert expand_excluding(str(tmp_path), ["/elsewhere/x"]) == [str(tmp_path)]


def test_a_denied_root_is_dropped(tmp_path: Path) -> None:
    assert expand_excluding(str(tmp_path), [str(tmp_path)]) == []


def test_siblings_along_the_denied_path_are_granted(tmp_path: Path) -> None:
    for name in ("a/keys/x", "a/notes", "b"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    granted = expand_excluding(str(tmp_path), [str(tmp_path / "a" / "keys")])
    assert granted == [str(tmp_path / "a" / "notes"), str(tmp_path / "b")]


def test_a_sibling_symlink_is_never_granted(tmp_path: Path) -> None:
    # `current -> run` next to `run`: a rule on the link would grant its target,
    # the directory that holds the denied path.
    (tmp_path / "run" / "keys").mkdir(parents=True)
    (tmp_path / "run" / "ok").mkdir()
    os.symlink(tmp_path / "run", tmp_path / "current")
    granted = expand_excluding(str(tmp_path), [str(tmp_path / "run" / "keys")])
    assert granted == [str(tmp_path / "run" / "ok")]


def test_an_unreadable_directory_grants_nothing_below_it() -> None:
    def listdir(path: str) -> list[str]:
        raise PermissionError(path)

    assert expand_excluding("/r", ["/r/a/b"], listdir=listdir) == []


TREE = {
    "/r": ["a", "b", "c"],
    "/r/a": ["x", "y"],
    "/r/b": ["z"],
    "/r/c": [],
    "/r/a/x": [],
    "/r/a/y": [],
    "/r/b/z": [],
}
LEAVES = ["/r/a/x", "/r/a/y", "/r/b/z", "/r/c"]


@given(st.lists(st.sampled_from(sorted(TREE)), max_size=3))
def test_no_denied_path_is_granted_and_every_other_leaf_is(denied: list[str]) -> None:
    granted = expand_excluding("/r", denied, listdir=lambda p: TREE[p], is_link=lambda p: False)
    for path in granted:
        assert not any(is_under(path, d) or is_under(d, path) for d in denied)
    for leaf in LEAVES:
        covered = any(is_under(leaf, g) for g in granted)
        assert covered == (not any(is_under(leaf, d) for d in denied))
