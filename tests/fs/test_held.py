"""Held directories: what the host writes (audit log and its rotations, --save-approved's policy,
egressbox's state) stays where its directory was when it was opened, whatever is done to the
path afterwards; judged by looking at the directories on the host."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from egressbox.audit.record import AuditRecord, JsonlFileSink, read_records, shift_rotated
from egressbox.core.errors import AuditError, Reason, Verdict
from egressbox.fs.held import HeldDir, HeldFile, SymlinkOnPathError, component
from egressbox.proxy.approval import Answer, Approved, save_approved


def _record(port: int) -> AuditRecord:
    return AuditRecord.create(
        protocol="connect",
        host="blocked.example",
        port=port,
        decision=Verdict.DENY,
        reason=Reason.NO_ALLOW_RULE,
    )


def _ports(path: Path) -> list[int]:
    return [r.port for r in read_records(path) if isinstance(r, AuditRecord)]


def _swap_for_link(directory: Path, target: Path) -> Path:
    """What a child that can write beside `directory` does: move it away, link its name to
    `target`. Returns where the directory went."""
    moved = directory.with_name(directory.name + ".moved")
    directory.rename(moved)
    directory.symlink_to(target)
    return moved


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """The directory the planted link points to: nothing may ever appear in it."""
    place = tmp_path / "chosen-by-the-child"
    place.mkdir()
    return place


def test_the_users_own_links_at_start_are_followed(tmp_path: Path) -> None:
    real = tmp_path / "srv-log"
    real.mkdir()
    (tmp_path / "log").symlink_to(real)  # /var/log -> /srv/log, made by the administrator
    with HeldDir.open(tmp_path / "log" / ".") as held:
        assert held.path == str(real)
        held.write_atomically("a.txt", b"x", 0o640)
    assert (real / "a.txt").read_bytes() == b"x"
    assert (real / "a.txt").stat().st_mode & 0o777 == 0o640


def test_a_link_appearing_between_resolving_and_opening_is_refused(
    tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = tmp_path / "a"
    (parent / "b").mkdir(parents=True)
    path = str(parent / "b")
    # The path was resolved, then `a` became a link before the walk reached it.
    monkeypatch.setattr(os.path, "realpath", str)
    _swap_for_link(parent, target)
    (target / "b").mkdir()
    with pytest.raises(SymlinkOnPathError) as info:
        HeldDir.open(path)
    assert info.value.errno == errno.ELOOP
    assert str(parent) in str(info.value) and "symbolic link" in str(info.value)


def test_a_link_as_the_final_name_is_never_followed(tmp_path: Path, target: Path) -> None:
    (tmp_path / "audit.jsonl").symlink_to(target / "audit.jsonl")
    with HeldDir.open(tmp_path) as held, pytest.raises(OSError) as info:
        held.open_file("audit.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    assert info.value.errno == errno.ELOOP
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/abs", "nul\0"])
def test_names_are_single_components(name: str) -> None:
    with pytest.raises(ValueError, match="single file name"):
        component(name)


def test_created_directories_are_private_and_missing_ones_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        HeldDir.open(tmp_path / "x" / "y")
    with HeldDir.open(tmp_path / "x" / "y", create_mode=0o700):
        pass
    assert (tmp_path / "x" / "y").stat().st_mode & 0o777 == 0o700


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "p.toml").write_text("old\n")

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with HeldDir.open(tmp_path) as held, pytest.raises(OSError, match="No space"):
        held.write_atomically("p.toml", b"new\n", 0o644)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.toml"]
    assert (tmp_path / "p.toml").read_text() == "old\n"


# -- the audit log --------------------------------------------------------------------------


def test_audit_records_stay_in_the_directory_of_the_start(tmp_path: Path, target: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    with JsonlFileSink(logs / "audit.jsonl") as sink:
        sink.write(_record(1))
        moved = _swap_for_link(logs, target)
        sink.write(_record(2))
        sink.reopen()  # as after an external logrotate: by name, in the held directory
        sink.write(_record(3))
    assert list(target.iterdir()) == []
    assert _ports(moved / "audit.jsonl") == [1, 2, 3]


def test_rotation_under_a_swapped_directory_stays_in_the_held_one(
    tmp_path: Path, target: Path
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    line = len(_record(1).to_json()) + 1
    with JsonlFileSink(logs / "audit.jsonl", max_bytes=2 * line, keep=2) as sink:
        sink.write(_record(1))
        moved = _swap_for_link(logs, target)
        for port in range(2, 8):
            sink.write(_record(port))
    assert list(target.iterdir()) == []
    names = sorted(p.name for p in moved.iterdir())
    assert names == ["audit.jsonl", "audit.jsonl.1", "audit.jsonl.2"]
    ports = [
        p for n in ("audit.jsonl.2", "audit.jsonl.1", "audit.jsonl") for p in _ports(moved / n)
    ]
    assert ports == [3, 4, 5, 6, 7]  # 1 and 2 went with the oldest file beyond keep


def test_a_link_on_the_audit_logs_path_at_start_is_resolved_and_said(
    tmp_path: Path, target: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.setattr(os.path, "realpath", str)  # swapped right after resolving
    _swap_for_link(logs, target)
    with pytest.raises(AuditError, match="symbolic link") as info:
        JsonlFileSink(logs / "audit.jsonl")
    assert "cannot be opened: its directory" in str(info.value)
    assert list(target.iterdir()) == []


def test_shift_rotated_renames_only_inside_the_directory(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("0\n")
    (tmp_path / "a.jsonl.1").write_text("1\n")
    shift_rotated(str(tmp_path / "a.jsonl"), 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl.1", "a.jsonl.2"]
    assert (tmp_path / "a.jsonl.1").read_text() == "0\n"


# -- --save-approved ------------------------------------------------------------------------


def test_save_approved_goes_where_its_directory_was_held(tmp_path: Path, target: Path) -> None:
    out = tmp_path / "policies"
    out.mkdir()
    held = HeldFile(out / "approved.toml")  # at start, before the child
    moved = _swap_for_link(out, target)  # the child's move, during the run
    try:
        save_approved(held, [Approved("pypi.org", 443, Answer.SESSION)])
    finally:
        held.close()
    assert list(target.iterdir()) == []
    text = (moved / "approved.toml").read_text()
    assert '"pypi.org:443",' in text
    assert (moved / "approved.toml").stat().st_mode & 0o777 == 0o644
    assert [p.name for p in moved.iterdir()] == ["approved.toml"]  # no temporary left


def test_save_approved_replaces_a_link_never_writes_through_it(
    tmp_path: Path, target: Path
) -> None:
    (tmp_path / "approved.toml").symlink_to(target / "approved.toml")
    save_approved(str(tmp_path / "approved.toml"), [])
    assert list(target.iterdir()) == []
    assert not (tmp_path / "approved.toml").is_symlink()
    assert "[egress]" in (tmp_path / "approved.toml").read_text()


def test_a_held_directory_removed_meanwhile_is_said_and_nothing_written(
    tmp_path: Path, target: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    held = HeldFile(out / "approved.toml")
    out.rmdir()
    out.symlink_to(target)
    try:
        with pytest.raises(FileNotFoundError, match="was removed after egressbox opened it"):
            save_approved(held, [])
    finally:
        held.close()
    assert list(target.iterdir()) == []
