"""egressbox's caches are believed only when they are the invoker's alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from egressbox.confine import cache


def _stored(tmp_path: Path) -> str:
    path = str(tmp_path / "egressbox" / "v2-probe.json")
    cache.write(path, b'{"ok": 1}')
    return path


def test_a_cache_of_ours_round_trips_with_private_modes(tmp_path: Path) -> None:
    path = _stored(tmp_path)
    assert cache.read(path) == b'{"ok": 1}'
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o620, 0o602])
def test_a_cache_file_others_may_write_is_ignored(tmp_path: Path, mode: int) -> None:
    path = _stored(tmp_path)
    os.chmod(path, mode)
    assert cache.read(path) is None


def test_a_cache_directory_others_may_write_is_ignored(tmp_path: Path) -> None:
    path = _stored(tmp_path)
    os.chmod(os.path.dirname(path), 0o777)
    assert cache.read(path) is None
    cache.write(path, b"forged")  # nor is it written into
    os.chmod(os.path.dirname(path), 0o700)
    assert cache.read(path) == b'{"ok": 1}'


def test_a_symlinked_cache_file_is_ignored(tmp_path: Path) -> None:
    path = _stored(tmp_path)
    elsewhere = tmp_path / "forged.json"
    elsewhere.write_bytes(b'{"forged": 1}')
    os.unlink(path)
    os.symlink(elsewhere, path)
    assert cache.read(path) is None


def test_a_cache_owned_by_another_user_is_ignored(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    path = _stored(tmp_path)
    os.chown(path, 65534, 65534)
    assert cache.read(path) is None


def test_names_carry_the_format_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.path("probe.json") == str(tmp_path / "egressbox" / "v2-probe.json")
