"""The gate's apply (confine/staging.py apply_tree) for `run --user`: what it creates on the host
is given to the target's owner, never through a link; and a layer on another file system than
the root (a tmpfs here: rename and copy_file_range both say EXDEV) is copied byte for byte, no
temporary file left behind. Judged on the host's files."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressbox.confine import staging

OWNER = (4242, 4343)  # ids no account has: whatever owns them here was given them
SHM = Path("/dev/shm")


@pytest.fixture
def layer_dir() -> Iterator[Path]:
    if not SHM.is_dir():
        pytest.skip("no /dev/shm")
    made = Path(tempfile.mkdtemp(prefix="egressbox-test-layer-", dir=SHM))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def _apply(upper: Path, root: Path, layer: Path, owner: tuple[int, int] | None) -> staging.Outcome:
    up_fd = os.open(upper, os.O_DIRECTORY | os.O_CLOEXEC)
    root_fd = os.open(root, os.O_DIRECTORY | os.O_CLOEXEC)
    layer_fd = os.open(layer, os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        target = staging.Target(0, root_fd, str(root), staging.Rules(), owner)
        return staging.apply_tree(up_fd, target, staging.Journal(layer_fd))
    finally:
        for fd in (up_fd, root_fd, layer_fd):
            os.close(fd)


def _layer(layer_dir: Path) -> Path:
    upper = layer_dir / "u0"
    (upper / "made" / "deep").mkdir(parents=True)
    (upper / "made" / "deep" / "file").write_bytes(os.urandom(3 << 20))
    (upper / "top.txt").write_text("top\n")
    os.symlink("top.txt", upper / "link")
    return upper


def test_new_entries_go_to_the_owner_across_file_systems(tmp_path: Path, layer_dir: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving files to another uid needs root")
    if os.stat(tmp_path).st_dev == os.stat(layer_dir).st_dev:
        pytest.skip("the layer and the root share a file system here")
    upper = _layer(layer_dir)
    expected = (upper / "made" / "deep" / "file").read_bytes()
    root = tmp_path / "root"
    root.mkdir()
    outcome = _apply(upper, root, layer_dir, OWNER)
    assert outcome.failed == []
    assert (root / "made" / "deep" / "file").read_bytes() == expected
    for name in ("made", "made/deep", "made/deep/file", "top.txt", "link"):
        st = os.lstat(root / name)
        assert (st.st_uid, st.st_gid) == OWNER, name
    assert os.readlink(root / "link") == "top.txt"
    leftovers = [p for p in root.rglob("*") if p.name.startswith(staging.TEMP_PREFIX)]
    assert leftovers == []


def test_without_an_owner_the_applier_keeps_them(tmp_path: Path, layer_dir: Path) -> None:
    upper = _layer(layer_dir)
    root = tmp_path / "root"
    root.mkdir()
    outcome = _apply(upper, root, layer_dir, None)
    assert outcome.failed == []
    assert os.lstat(root / "made" / "deep").st_uid == os.geteuid()
    assert (root / "top.txt").read_text() == "top\n"
