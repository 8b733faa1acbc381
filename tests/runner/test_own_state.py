"""egressbox's state: where it lives, and files believed only when they are the invoker's alone
(a second wall: the first is that no plan grants the directory, tests/runner/test_run_state.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from egressbox.runner import own_state


def _stored(tmp_path: Path) -> str:
    path = str(tmp_path / "egressbox" / "v3-probe.json")
    own_state.write(path, b'{"ok": 1}')
    return path


def test_a_cache_of_ours_round_trips_with_private_modes(tmp_path: Path) -> None:
    path = _stored(tmp_path)
    assert own_state.read(path) == b'{"ok": 1}'
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o620, 0o602])
def test_a_cache_file_others_may_write_is_ignored(tmp_path: Path, mode: int) -> None:
    path = _stored(tmp_path)
    os.chmod(path, mode)
    assert own_state.read(path) is None


def test_a_cache_directory_others_may_write_is_ignored(tmp_path: Path) -> None:
    path = _stored(tmp_path)
    os.chmod(os.path.dirname(path), 0o777)
    assert own_state.read(path) is None
    own_state.write(path, b"forged")  # nor is it written into
    os.chmod(os.path.dirname(path), 0o700)
    assert own_state.read(path) == b'{"ok": 1}'


def test_a_symlinked_cache_file_is_ignored(tmp_path: Path) -> None:
    path = _stored(tmp_path)
    elsewhere = tmp_path / "forged.json"
    elsewhere.write_bytes(b'{"forged": 1}')
    os.unlink(path)
    os.symlink(elsewhere, path)
    assert own_state.read(path) is None


def test_a_cache_owned_by_another_user_is_ignored(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    path = _stored(tmp_path)
    os.chown(path, 65534, 65534)
    assert own_state.read(path) is None


def test_names_carry_the_format_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(own_state.STATE_ENV, str(tmp_path))
    assert own_state.path("probe.json") == str(tmp_path / "v3-probe.json")


def test_the_state_lives_outside_every_tool_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not under $XDG_CACHE_HOME (~/.cache): toolchain presets grant pieces of it.
    monkeypatch.delenv(own_state.STATE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    monkeypatch.setenv("XDG_STATE_HOME", "/somewhere/state")
    expected = own_state.ROOT_DIRECTORY if os.geteuid() == 0 else "/somewhere/state/egressbox"
    assert own_state.directory() == expected
    monkeypatch.setenv(own_state.STATE_ENV, "relative/ignored")
    assert own_state.directory() == expected


def test_a_symlink_on_the_way_to_the_cache_is_not_followed(tmp_path: Path) -> None:
    # The directory is resolved and then walked without links: a link swapped in for a
    # directory of the path after resolving cannot lead the read elsewhere.
    real = tmp_path / "state"
    path = _stored(real)
    forged = tmp_path / "forged"
    forged.mkdir(mode=0o700)
    own_state.write(str(forged / "egressbox" / "v3-probe.json"), b'{"forged": 1}')
    from egressbox.fs.held import HeldDir

    with HeldDir.open(real / "egressbox") as held:
        (real / "egressbox").rename(tmp_path / "moved")
        (real / "egressbox").symlink_to(forged / "egressbox")
        fd = held.open_file("v3-probe.json", os.O_RDONLY)
        try:
            assert os.read(fd, 100) == b'{"ok": 1}'  # the file of the held directory
        finally:
            os.close(fd)
    assert path.endswith("v3-probe.json")


def test_remove_and_prune_keep_the_newest(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(own_state.STATE_ENV, str(tmp_path / "state"))
    for index in range(5):
        own_state.write(own_state.path(f"probe-{index}.json"), b"{}")
        os.utime(own_state.path(f"probe-{index}.json"), ns=(index * 10**9, index * 10**9))
    own_state.write(own_state.path("trusted-policies.json"), b"{}")
    own_state.prune("probe-", 2)
    assert sorted(os.listdir(tmp_path / "state")) == [
        "v3-probe-3.json",
        "v3-probe-4.json",
        "v3-trusted-policies.json",
    ]
    own_state.remove(own_state.path("probe-4.json"))
    assert own_state.read(own_state.path("probe-4.json")) is None
