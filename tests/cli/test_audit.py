"""Tests for `egressbox audit` (egressbox.cli.audit) and the audit.py parts it stands on:
sink rotation and reopen, the line lexer, rotated-file discovery, the
stream reader with progress, and --follow across rotation and truncation.

Files are real (tmp_path); --follow and SIGINT are tested in a real child process.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressbox.audit.record import (
    AuditProtocol,
    AuditRecord,
    InvalidRecordError,
    JsonlFileSink,
    MalformedLine,
    follow_records,
    read_records,
    read_stream,
    rotated_files,
    rotation_index,
)
from egressbox.cli import audit as audit_cli
from egressbox.core.errors import AuditError, Reason, Verdict
from egressbox.core.policy import Policy, load_policy

T0 = datetime(2026, 11, 30, 11, 0, tzinfo=UTC)
CHILD_TIMEOUT = 30.0  # seconds; generous for a loaded CI machine, still bounded
WAIT_STEP = 0.01


def rec(
    host: str = "pypi.org",
    port: int = 443,
    decision: Verdict = Verdict.ALLOW,
    reason: Reason = Reason.ALLOWED,
    protocol: AuditProtocol = AuditProtocol.CONNECT,
    seconds: float = 0,
) -> AuditRecord:
    return AuditRecord(T0 + timedelta(seconds=seconds), protocol, host, port, decision, reason)


def numbered(count: int, start: int = 0) -> list[AuditRecord]:
    """Distinct records (host and time carry the index) to check order and loss."""
    return [rec(host=f"h{i:04d}.example.com", seconds=i) for i in range(start, start + count)]


def write_log(path: Path, records: Sequence[AuditRecord], extra: str = "") -> Path:
    path.write_text("".join(r.to_json() + "\n" for r in records) + extra)
    return path


def lines_of(paths: Sequence[str | Path]) -> list[str]:
    out: list[str] = []
    for path in paths:
        data = Path(path).read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        out += data.decode().splitlines()
    return out


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_cli(
    argv: Sequence[str], *, tty: bool = False, err_tty: bool = False
) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="egressbox audit")
    audit_cli.configure(parser)
    args = parser.parse_args(list(argv))
    out = FakeTTY() if tty else io.StringIO()
    err = FakeTTY() if err_tty else io.StringIO()
    code = audit_cli.run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def wait_until(condition: Callable[[], bool], timeout: float = CHILD_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(WAIT_STEP)


# --------------------------------------------------------------------------- sink rotation


def test_rotation_keeps_every_record_whole_and_in_order(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    records = numbered(100)
    line_size = len(records[0].to_json()) + 1
    with JsonlFileSink(path, max_bytes=line_size * 7 + 3, keep=100) as sink:
        for record in records:
            sink.write(record)
    files = rotated_files(path)
    assert files[-1] == str(path) and len(files) == 15  # 14 full files of 7, one of 2
    for name in files:
        assert os.path.getsize(name) <= line_size * 7 + 3
        assert Path(name).read_bytes().endswith(b"\n")
    assert lines_of(files) == [r.to_json() for r in records]


def test_rotation_drops_generations_beyond_keep(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    records = numbered(20)
    line_size = len(records[0].to_json()) + 1
    with JsonlFileSink(path, max_bytes=line_size * 2, keep=3) as sink:
        for record in records:
            sink.write(record)
    assert sorted(os.listdir(tmp_path)) == [
        "audit.jsonl",
        "audit.jsonl.1",
        "audit.jsonl.2",
        "audit.jsonl.3",
    ]
    assert lines_of(rotated_files(path)) == [r.to_json() for r in records[-8:]]


def test_a_record_longer_than_max_bytes_gets_a_file_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with JsonlFileSink(path, max_bytes=10, keep=5) as sink:
        for record in numbered(3):
            sink.write(record)
    assert [len(lines_of([name])) for name in rotated_files(path)] == [1, 1, 1]


def test_rotation_shifts_compressed_generations_too(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    old = numbered(2)
    (tmp_path / "audit.jsonl.1.gz").write_bytes(gzip.compress(old[0].to_json().encode() + b"\n"))
    (tmp_path / "audit.jsonl.2.gz").write_bytes(gzip.compress(old[1].to_json().encode() + b"\n"))
    with JsonlFileSink(path, keep=2) as sink:
        sink.write(rec(host="new.example.com"))
        sink.rotate()
        sink.write(rec(host="newest.example.com"))
    assert sorted(os.listdir(tmp_path)) == [
        "audit.jsonl",
        "audit.jsonl.1",
        "audit.jsonl.2.gz",
    ]
    assert [json.loads(line)["host"] for line in lines_of(rotated_files(path))] == [
        "h0000.example.com",
        "new.example.com",
        "newest.example.com",
    ]


def test_failed_rotation_raises_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    blocker = tmp_path / "audit.jsonl.1"
    blocker.mkdir()  # a file cannot be renamed over a directory
    (blocker / "keep").write_text("x")
    records = numbered(3)
    line_size = len(records[0].to_json()) + 1
    with JsonlFileSink(path, max_bytes=line_size, keep=1) as sink:
        sink.write(records[0])
        with pytest.raises(AuditError, match="cannot rotate audit log"):
            sink.write(records[1])
        (blocker / "keep").unlink()
        blocker.rmdir()
        sink.write(records[2])
    assert lines_of([blocker, path]) == [records[0].to_json(), records[2].to_json()]


def test_reopen_follows_an_external_logrotate(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    records = numbered(3)
    with JsonlFileSink(path) as sink:
        sink.write(records[0])
        os.rename(path, tmp_path / "audit.jsonl.1")  # logrotate's "create" mode
        sink.write(records[1])  # still the renamed file: nothing lost
        sink.reopen()  # the signal handler
        sink.write(records[2])
    assert lines_of([tmp_path / "audit.jsonl.1"]) == [r.to_json() for r in records[:2]]
    assert lines_of([path]) == [records[2].to_json()]


def test_reopen_failure_keeps_writing_to_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with JsonlFileSink(path) as sink:
        os.rename(path, tmp_path / "moved.jsonl")
        path.mkdir()  # the path now names a directory: cannot reopen
        with pytest.raises(AuditError):
            sink.reopen()
        sink.write(rec())
    assert lines_of([tmp_path / "moved.jsonl"]) == [rec().to_json()]


def test_rotation_under_concurrent_threads_loses_and_splits_nothing(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    threads, each = 8, 400
    with JsonlFileSink(path, max_bytes=8192, keep=1000) as sink:

        def writer(t: int) -> None:
            for i in range(each):
                sink.write(rec(host=f"t{t}.example.com", port=i + 1))

        workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    lines = lines_of(rotated_files(path))
    parsed = [AuditRecord.from_json(line) for line in lines]
    assert len(parsed) == threads * each
    assert {(r.host, r.port) for r in parsed} == {
        (f"t{t}.example.com", i + 1) for t in range(threads) for i in range(each)
    }
    for t in range(threads):  # each thread's records stay in its own order
        ports = [r.port for r in parsed if r.host == f"t{t}.example.com"]
        assert ports == sorted(ports)


@pytest.mark.parametrize(("max_bytes", "keep"), [(0, 5), (-1, 5), (100, 0)])
def test_rotation_settings_are_checked(tmp_path: Path, max_bytes: int, keep: int) -> None:
    with pytest.raises(ValueError):
        JsonlFileSink(tmp_path / "a.jsonl", max_bytes=max_bytes, keep=keep)


def test_writes_after_close_fail_cleanly(tmp_path: Path) -> None:
    sink = JsonlFileSink(tmp_path / "a.jsonl", max_bytes=100)
    sink.close()
    with pytest.raises(AuditError, match="closed"):
        sink.write(rec())
    with pytest.raises(AuditError, match="closed"):
        sink.rotate()


# --------------------------------------------------------------------------- the lexer

_hosts = st.one_of(
    st.from_regex(r"[0-9A-Za-z._:-]{0,40}", fullmatch=True),
    st.text(min_size=0, max_size=20).filter(lambda h: all(c.isalnum() for c in h)),
)


@settings(max_examples=300, deadline=None)
@given(
    ts=st.datetimes(
        min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(UTC)
    ),
    protocol=st.sampled_from(AuditProtocol),
    host=_hosts,
    port=st.integers(0, 65535),
    decision=st.sampled_from(Verdict),
    reason=st.sampled_from(Reason),
)
def test_the_lexer_and_json_loads_read_equal_records(
    ts: datetime,
    protocol: AuditProtocol,
    host: str,
    port: int,
    decision: Verdict,
    reason: Reason,
) -> None:
    from egressbox.audit import record as audit

    record = AuditRecord(ts, protocol, host, port, decision, reason)
    line = record.to_json()
    # The one serializer writes exactly what json.dumps would.
    assert line == json.dumps(record.to_dict(), ensure_ascii=True, separators=(",", ":"))
    # The same line, spaced out: json.loads reads it, the lexer does not.
    spaced = json.dumps(record.to_dict(), ensure_ascii=True, indent=1)
    assert audit._LINE_SHAPE.fullmatch(spaced) is None
    for text in (line, line + "\n", spaced, "  " + line + "\n"):
        parsed = AuditRecord.from_json(text)
        assert parsed == record
        assert type(parsed.protocol) is AuditProtocol and type(parsed.reason) is Reason
    if "\\" not in line:
        assert audit._LINE_SHAPE.fullmatch(line) is not None  # the common case is lexed


@pytest.mark.parametrize(
    "change",
    [
        ('"port":443', '"port":70000'),
        ('"reason":"allowed"', '"reason":"nope"'),
        ("2026-11-30", "2026-13-30"),
        ("2026-11-30", "0000-11-30"),
        ('"host":"pypi.org"', '"host":"py pi.org"'),
    ],
)
def test_lines_the_lexer_reads_are_still_validated(
    change: tuple[str, str],
) -> None:
    line = rec().to_json().replace(*change)
    with pytest.raises(InvalidRecordError):
        AuditRecord.from_json(line)


# --------------------------------------------------------------------------- reading helpers


def test_rotated_files_are_found_oldest_first(tmp_path: Path) -> None:
    for name in ("a.jsonl", "a.jsonl.1", "a.jsonl.2.gz", "a.jsonl.10", "a.jsonl.x", "a.jsonlz"):
        (tmp_path / name).write_text("")
    base = str(tmp_path / "a.jsonl")
    assert [os.path.basename(p) for p in rotated_files(base)] == [
        "a.jsonl.10",
        "a.jsonl.2.gz",
        "a.jsonl.1",
        "a.jsonl",
    ]
    assert rotation_index(base + ".3.gz", base) == 3
    assert rotation_index(base + ".0", base) is None
    assert rotation_index(base, base) == 0


def test_read_stream_reads_plain_and_gzip(tmp_path: Path) -> None:
    data = "".join(r.to_json() + "\n" for r in numbered(3)).encode()
    for blob in (data, gzip.compress(data)):
        items = list(read_stream(io.BufferedReader(io.BytesIO(blob))))
        assert items == numbered(3)


def test_progress_reports_bytes_consumed(tmp_path: Path) -> None:
    path = write_log(tmp_path / "a.jsonl", numbered(10_000))
    seen: list[int] = []
    assert sum(1 for _ in read_records(path, progress=seen.append)) == 10_000
    assert seen == sorted(seen) and len(seen) >= 2
    assert seen[-1] == path.stat().st_size
    gz = tmp_path / "a.jsonl.1.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    seen.clear()
    assert sum(1 for _ in read_records(gz, progress=seen.append)) == 10_000
    assert seen[-1] == gz.stat().st_size


# --------------------------------------------------------------------------- follow (library)


class Follower:
    """Runs follow_records in a thread, collecting what it yields."""

    def __init__(self, path: Path) -> None:
        self.items: list[AuditRecord | MalformedLine] = []
        self.stop = threading.Event()
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(path,), daemon=True)
        self.thread.start()
        assert self.started.wait(CHILD_TIMEOUT)

    def _run(self, path: Path) -> None:
        try:
            items = follow_records(path, poll_interval=0.005, should_stop=self.stop.is_set)
            self.started.set()
            for item in items:
                self.items.append(item)
        except BaseException as exc:
            self.error = exc
            self.started.set()

    def records(self) -> list[AuditRecord]:
        return [item for item in self.items if isinstance(item, AuditRecord)]

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(CHILD_TIMEOUT)
        assert not self.thread.is_alive()
        assert self.error is None, self.error


def test_follow_reads_existing_then_new_records_across_rotations(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    records = numbered(600)
    line_size = len(records[0].to_json()) + 1
    write_log(path, records[:10])
    with JsonlFileSink(path, max_bytes=line_size * 5, keep=1000) as sink:
        follower = Follower(path)
        for record in records[10:]:
            sink.write(record)  # rotates every 5 records: often several times per poll
        wait_until(lambda: len(follower.items) >= len(records))
        follower.finish()
    assert follower.items == records


def test_follow_catches_up_on_generations_rotated_between_polls(tmp_path: Path) -> None:
    # Deterministic: the follower's sleep is where the log rotates, three times per poll,
    # and an external compressor gzips one generation in between.
    path = tmp_path / "audit.jsonl"
    records = numbered(7)
    batches = iter([records[1:4], records[4:7]])
    done = False
    with JsonlFileSink(path, keep=100) as sink:
        sink.write(records[0])

        def sleep(_: float) -> None:
            nonlocal done
            batch = next(batches, None)
            if batch is None:
                done = True
                return
            for record in batch:
                sink.rotate()
                sink.write(record)
            gen2 = tmp_path / "audit.jsonl.2"
            (tmp_path / "audit.jsonl.2.gz").write_bytes(gzip.compress(gen2.read_bytes()))
            gen2.unlink()

        items = list(follow_records(path, sleep=sleep, should_stop=lambda: done))
    assert items == records


def test_follow_rereads_a_truncated_file(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", numbered(3))
    follower = Follower(path)
    wait_until(lambda: len(follower.items) == 3)
    with open(path, "r+b") as f:  # logrotate copytruncate
        f.truncate(0)
    wait_until(lambda: follower.records() == numbered(3) and os.path.getsize(path) == 0)
    time.sleep(0.05)  # let the follower notice the truncation before new data arrives
    with JsonlFileSink(path) as sink:
        sink.write(numbered(1, start=7)[0])
    wait_until(lambda: len(follower.items) == 4)
    follower.finish()
    assert follower.records() == [*numbered(3), *numbered(1, start=7)]


def test_follow_reports_malformed_and_torn_lines_and_goes_on(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", numbered(1), extra="garbage\n{partial")
    follower = Follower(path)
    wait_until(lambda: len(follower.items) == 2)
    with JsonlFileSink(path) as sink:  # opening it terminates the torn tail
        sink.write(numbered(1, start=1)[0])
    wait_until(lambda: len(follower.items) == 4)
    follower.finish()
    bad = [item for item in follower.items if isinstance(item, MalformedLine)]
    assert [(b.source, b.line_number) for b in bad] == [(str(path), 2), (str(path), 3)]
    assert follower.records() == numbered(2)


def test_follow_of_a_missing_file_fails_at_once(tmp_path: Path) -> None:
    with pytest.raises(AuditError, match="cannot read audit log"):
        next(follow_records(tmp_path / "missing.jsonl"))


def test_follow_bounds_an_endless_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b"x" * (3 * 64 * 1024) + b"\n" + rec().to_json().encode() + b"\n")
    items = list(follow_records(path, should_stop=lambda: True))
    assert isinstance(items[0], MalformedLine) and "longer than" in items[0].error
    assert items[1:] == [rec()]


# --------------------------------------------------------------------------- the command

MIXED = [
    rec("pypi.org", 443, seconds=0),
    rec("pypi.org", 443, seconds=10),
    rec("evil.test", 443, Verdict.DENY, Reason.NO_ALLOW_RULE, seconds=20),
    rec("cdn.example.com", 80, Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE, AuditProtocol.HTTP, 30),
    rec("10.0.0.1", 5432, Verdict.DENY, Reason.PRIVATE_ADDRESS, AuditProtocol.SOCKS5, 40),
    rec("pypi.org", 443, Verdict.DENY, Reason.DNS_FAILURE, seconds=50),
]


def test_json_lines_when_not_a_terminal(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED)
    code, out, err = run_cli([str(path)])
    assert (code, err) == (0, "")
    assert out.splitlines() == [r.to_json() for r in MIXED]


def test_table_on_a_terminal_and_json_when_asked(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED[:2])
    code, out, _ = run_cli([str(path)], tty=True)
    assert code == 0
    assert out.splitlines() == [
        "TS                        PROTOCOL  HOST" + " " * 39 + "PORT  DECISION    REASON",
        "2026-11-30T11:00:00.000Z  connect   pypi.org" + " " * 36 + "443  allow       allowed",
        "2026-11-30T11:00:10.000Z  connect   pypi.org" + " " * 36 + "443  allow       allowed",
    ]
    _, out, _ = run_cli([str(path), "--json"], tty=True)
    assert out.splitlines() == [r.to_json() for r in MIXED[:2]]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--decision", "deny"], [2, 4, 5]),
        (["--decision", "would_deny"], [3]),
        (["--host", "*.EXAMPLE.com"], [3]),
        (["--host", "pypi.org", "--reason", "allowed"], [0, 1]),
        (["--port", "5432"], [4]),
        (["--protocol", "socks5"], [4]),
        (["--since", "2026-11-30T11:00:20Z"], [2, 3, 4, 5]),
        (["--until", "2026-11-30T11:00:20Z"], [0, 1]),
        (["--since", "2026-11-30T12:00:10+01:00", "--until", "2026-11-30T11:00:41"], [1, 2, 3, 4]),
        (["--since", "2026-11-30"], [0, 1, 2, 3, 4, 5]),
    ],
)
def test_filters(tmp_path: Path, args: list[str], expected: list[int]) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED)
    code, out, _ = run_cli([str(path), *args])
    assert code == 0
    assert out.splitlines() == [MIXED[i].to_json() for i in expected]


def test_relative_since_uses_the_clock(tmp_path: Path) -> None:
    recent = datetime.now(UTC) - timedelta(minutes=5)
    records = [
        rec(seconds=-(10**8)),  # three years before T0
        AuditRecord.create(
            AuditProtocol.HTTP, "new.test", 80, Verdict.ALLOW, Reason.ALLOWED, now=lambda: recent
        ),
    ]
    path = write_log(tmp_path / "audit.jsonl", records)
    _, out, _ = run_cli([str(path), "--since", "1h"])
    assert out.splitlines() == [records[1].to_json()]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2h", timedelta(hours=2)),
        ("30m", timedelta(minutes=30)),
        ("1d12h", timedelta(days=1, hours=12)),
        ("1w", timedelta(weeks=1)),
        ("45s", timedelta(seconds=45)),
        ("now", timedelta(0)),
    ],
)
def test_parse_time_relative_forms(text: str, expected: timedelta) -> None:
    now = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert audit_cli.parse_time(text, now=now) == now - expected


def test_parse_time_absolute_forms() -> None:
    assert audit_cli.parse_time("2026-11-30T11:08:16.123Z") == datetime(
        2026, 11, 30, 11, 8, 16, 123000, tzinfo=UTC
    )
    assert audit_cli.parse_time("2026-11-30 13:00+02:00") == datetime(
        2026, 11, 30, 11, 0, tzinfo=UTC
    )
    assert audit_cli.parse_time("2026-11-30") == datetime(2026, 11, 30, tzinfo=UTC)


@pytest.mark.parametrize("bad", ["yesterday", "2h ago", "-2h", "2026-02-30", "", "99999999999w"])
def test_bad_times_are_usage_errors(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        audit_cli.main([str(tmp_path / "a.jsonl"), "--since", bad])
    assert exc.value.code == 2
    assert "--since" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--summary", "--follow"],
        ["--summary", "--suggest-policy"],
        ["B", "--follow"],
        ["--output", "x.toml"],
        ["--since", "2026-11-30T12:00Z", "--until", "2026-11-30T11:00Z"],
        ["-", "-"],
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str]) -> None:
    path = write_log(tmp_path / "A", MIXED)
    write_log(tmp_path / "B", MIXED)
    argv = [str(tmp_path / a) if a == "B" else a for a in args]
    code, out, err = run_cli([str(path), *argv])
    assert code == 2 and out == ""
    assert err.startswith("egressbox audit: ")


def test_malformed_lines_are_reported_with_file_and_line_and_skipped(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED[:1], extra='{"ts": 1}\n')
    with path.open("a") as f:
        f.write(MIXED[1].to_json() + "\n" + "torn")
    code, out, err = run_cli([str(path)])
    assert code == 0
    assert out.splitlines() == [MIXED[0].to_json(), MIXED[1].to_json()]
    assert err.splitlines() == [
        f"egressbox audit: skipped malformed line {path}:2: missing keys: protocol, host, port, "
        "decision, reason",
        f"egressbox audit: skipped malformed line {path}:4: torn final line (no trailing "
        "newline): a writer stopped mid-record",
    ]


def test_malformed_reports_are_capped(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED[:1], extra="x\n" * 100)
    code, _, err = run_cli([str(path), "--summary"])
    assert code == 0
    lines = err.splitlines()
    assert len(lines) == audit_cli.MAX_REPORTED_MALFORMED + 1
    assert lines[-1] == "egressbox audit: 80 more malformed lines skipped (100 in all)"


def test_gzip_rotated_directory_and_glob_sources(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    write_log(logs / "audit.jsonl", MIXED[4:])
    write_log(logs / "audit.jsonl.1", MIXED[2:4])
    (logs / "audit.jsonl.2.gz").write_bytes(
        gzip.compress("".join(r.to_json() + "\n" for r in MIXED[:2]).encode())
    )
    (logs / "notes.txt").write_text("not a log\n")
    expected = [r.to_json() for r in MIXED]
    for argv in (
        [str(logs)],
        [str(logs / "audit.jsonl*")],
        ["--rotated", str(logs / "audit.jsonl")],
        ["--rotated", str(logs / "audit.jsonl"), str(logs / "audit.jsonl.1")],  # read once
    ):
        code, out, err = run_cli(argv)
        assert (code, err) == (0, ""), argv
        assert out.splitlines() == expected, argv
    # Explicit files are read in the order given.
    _, out, _ = run_cli([str(logs / "audit.jsonl"), str(logs / "audit.jsonl.2.gz")])
    assert out.splitlines() == [r.to_json() for r in MIXED[4:] + MIXED[:2]]


def test_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    data = gzip.compress("".join(r.to_json() + "\n" for r in MIXED).encode())

    class Stdin:
        buffer = io.BufferedReader(io.BytesIO(data))

    monkeypatch.setattr(sys, "stdin", Stdin())
    code, out, _ = run_cli(["-", "--decision", "allow"])
    assert code == 0
    assert out.splitlines() == [r.to_json() for r in MIXED[:2]]


def test_unreadable_files_are_reported_and_the_rest_is_read(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED[:1])
    code, out, err = run_cli([str(tmp_path / "missing.jsonl"), str(path), str(tmp_path / "*.nope")])
    assert code == 1
    assert out.splitlines() == [MIXED[0].to_json()]
    assert "cannot read audit log" in err and "missing.jsonl" in err
    assert "*.nope: no audit log matches" in err


def test_summary_json(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED)
    code, out, _ = run_cli([str(path), "--summary"])
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows[0] == {
        "host": "pypi.org",
        "port": 443,
        "total": 3,
        "decisions": {"allow": 2, "deny": 1},
        "reasons": {"allowed": 2, "dns_failure": 1},
        "first_ts": "2026-11-30T11:00:00.000Z",
        "last_ts": "2026-11-30T11:00:50.000Z",
    }
    assert [(r["host"], r["total"]) for r in rows] == [
        ("pypi.org", 3),
        ("10.0.0.1", 1),
        ("cdn.example.com", 1),
        ("evil.test", 1),
    ]


def test_summary_table_on_a_terminal(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED)
    code, out, _ = run_cli([str(path), "--summary", "--decision", "deny"], tty=True)
    assert code == 0
    assert out.splitlines() == [
        "HOST:PORT        TOTAL    ALLOW     DENY  WOULD_DENY  REASONS            "
        "FIRST SEEN                LAST SEEN",
        "10.0.0.1:5432        1        0        1           0  private_address=1  "
        "2026-11-30T11:00:40.000Z  2026-11-30T11:00:40.000Z",
        "evil.test:443        1        0        1           0  no_allow_rule=1    "
        "2026-11-30T11:00:20.000Z  2026-11-30T11:00:20.000Z",
        "pypi.org:443         1        0        1           0  dns_failure=1      "
        "2026-11-30T11:00:50.000Z  2026-11-30T11:00:50.000Z",
    ]


def test_progress_bar_only_on_a_terminal_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit_cli, "PROGRESS_DELAY", 0.0)  # as if reading took long
    path = write_log(tmp_path / "audit.jsonl", numbered(20_000))
    _, out, err = run_cli([str(path), "--summary"], err_tty=True)
    assert "100%" in err and err.startswith("\r[") and err.endswith("\r\x1b[K")
    assert err.count("\r\x1b[K") == 1
    assert len(out.splitlines()) == 20_000
    _, _, err = run_cli([str(path), "--summary"])
    assert err == ""
    _, _, err = run_cli([str(path)], err_tty=True)  # streamed records: no bar
    assert err == ""


def test_progress_bar_drawing() -> None:
    out = io.StringIO()
    ticks = iter([0.0, 0.0, 0.05, 0.2])  # made, then three updates
    bar = audit_cli.ProgressBar(4 * 1024 * 1024, out, clock=lambda: next(ticks), delay=0)
    bar.update(1024 * 1024)
    bar.update(2 * 1024 * 1024)  # throttled
    bar.update(4 * 1024 * 1024)
    bar.clear()
    assert out.getvalue() == (
        "\r[#######.......................]  25%  1.0 of 4.0 MiB"
        "\r[##############################] 100%  4.0 of 4.0 MiB"
        "\r\x1b[K"
    )


def test_progress_bar_waits_before_drawing_anything() -> None:
    out = io.StringIO()
    now = [0.0]
    bar = audit_cli.ProgressBar(1000, out, clock=lambda: now[0], delay=1.5)
    for position, moment in ((400, 0.2), (1000, 1.4)):
        now[0] = moment
        bar.update(position)
    bar.file_done(1000)
    bar.clear()
    assert out.getvalue() == ""  # done within the delay: no bar, nothing to clear
    now[0] = 2.0
    bar.update(500)
    bar.clear()
    bar.clear()
    assert out.getvalue().startswith("\r[") and out.getvalue().count("\r\x1b[K") == 1


def test_a_small_summary_on_a_terminal_draws_no_bar(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED * 2)  # about 1.4 KB
    assert path.stat().st_size < 2048
    code, out, err = run_cli([str(path), "--summary"], tty=True, err_tty=True)
    assert (code, err) == (0, "")
    assert out.startswith("HOST:PORT")


def test_suggest_policy_to_a_file_passes_check(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED)
    target = tmp_path / "policy.toml"
    code, out, err = run_cli(["--suggest-policy", str(path), "--output", str(target)])
    assert (code, out) == (0, "")
    assert err == (
        f"egressbox: wrote a policy admitting 3 destinations to {target} (1 commented out); "
        f"check it with egressbox check {target}\n"
    )
    policy = load_policy(str(target), env={})
    assert sorted(rule.text for rule in policy.allow.rules) == [
        "10.0.0.1:5432",
        "cdn.example.com:80",
        "pypi.org:443",
    ]
    text = target.read_text()
    assert f"# Sources: {path}" in text
    # A private destination refused only for its range gets the one-address grant it needs.
    assert '"10.0.0.1/32"' in text
    assert '    # "evil.test:443",  # denied in the log: no_allow_rule' in text
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("policy")] == ["policy.toml"]


def test_suggest_policy_honours_filters_and_base(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED)
    base = tmp_path / "base.toml"
    base.write_text(
        '[egress]\nmode = "report"\nallow_cidrs = ["10.0.0.0/24"]\ndeny = ["*.bad.test"]\n'
    )
    code, out, _ = run_cli(
        [
            "--suggest-policy",
            str(path),
            "--base-policy",
            str(base),
            "--since",
            "2026-11-30T11:00:25Z",
        ]
    )
    assert code == 0
    policy = load_policy_text(tmp_path, out)
    # 10.0.0.1 is in the base's allow_cidrs: admitted with no grant of its own.
    assert [rule.text for rule in policy.allow.rules] == ["cdn.example.com:80", "10.0.0.1:5432"]
    assert [rule.text for rule in policy.deny.rules] == ["*.bad.test"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[egress]\nallow = 3\n")
    code, _, err = run_cli(["--suggest-policy", str(path), "--base-policy", str(bad)])
    assert code == 2 and "egress.allow" in err


def test_suggest_policy_from_enforce_and_dns_records_on_the_command_line(tmp_path: Path) -> None:
    records = [
        rec("pypi.org", 443),
        rec("pypi.org", 0, protocol=AuditProtocol.DNS),
        rec("example.com", 80, Verdict.DENY, Reason.NO_ALLOW_RULE, AuditProtocol.HTTP),
        rec("127.0.0.1", 22, Verdict.DENY, Reason.NO_ALLOW_RULE, AuditProtocol.TCP),
        rec("127.0.0.1", 8080, Verdict.DENY, Reason.SELF_CONNECTION),
        rec("asked.test", 0, protocol=AuditProtocol.DNS),
    ]
    path = write_log(tmp_path / "audit.jsonl", records)
    base = tmp_path / "base.toml"
    base.write_text('[egress]\nallow_cidrs = ["127.0.0.0/8"]\n')
    target = tmp_path / "learned.toml"
    argv = ["--suggest-policy", str(path), "--base-policy", str(base), "-o", str(target)]
    code, _, err = run_cli(argv)
    assert code == 0
    assert "admitting 1 destination to" in err and "(4 commented out)" in err
    policy = load_policy(str(target), env={})
    assert [rule.text for rule in policy.allow.rules] == ["pypi.org:443"]
    text = target.read_text()
    assert '    # "example.com:80",  # denied in the log: no_allow_rule' in text
    assert '    # "127.0.0.1:8080",  # denied in the log: self_connection' in text
    assert "#   asked.test: allow" in text


def test_an_output_path_with_a_space_is_quoted_in_the_check_hint(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED[:1])
    target = tmp_path / "my policy.toml"
    code, _, err = run_cli(["--suggest-policy", str(path), "-o", str(target)])
    assert code == 0
    assert err.endswith(f"check it with egressbox check '{target}'\n")


def test_an_empty_result_says_so_on_stderr(tmp_path: Path) -> None:
    path = write_log(tmp_path / "audit.jsonl", MIXED)
    argv = [str(path), "--decision", "deny", "--host", "*.nowhere.test", "--since", "2026-11-30"]
    expected = (
        "egressbox: no record matches --decision deny --host '*.nowhere.test' "
        f"--since 2026-11-30T00:00:00.000Z (6 records read from {path})\n"
    )
    for extra, tty in (([], True), ([], False), (["--json"], True), (["--summary"], True)):
        code, out, err = run_cli([*argv, *extra], tty=tty)
        assert (code, out, err) == (0, "", expected), extra


def test_an_empty_log_says_no_record_was_found(tmp_path: Path) -> None:
    empty = write_log(tmp_path / "empty.jsonl", [])
    other = write_log(tmp_path / "other.jsonl", [], extra="not json\n")
    code, out, err = run_cli([str(empty), str(other), "--summary"], tty=True)
    assert (code, out) == (0, "")
    assert err.splitlines()[-1] == (
        f"egressbox: no record found (0 records read from {empty}, {other})"
    )
    code, out, err = run_cli([str(tmp_path / "missing.jsonl")])
    assert (code, out) == (1, "")
    assert "no record" not in err  # the unreadable file was said, nothing else to add


def load_policy_text(tmp_path: Path, text: str) -> Policy:
    target = tmp_path / "suggested.toml"
    target.write_text(text)
    return load_policy(str(target), env={})


def test_add_parser_registers_the_subcommand(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser(prog="egressbox")
    sub = parser.add_subparsers(dest="command", required=True)
    audit_cli.add_parser(sub)
    path = write_log(tmp_path / "audit.jsonl", MIXED)
    args = parser.parse_args(["audit", str(path), "--decision", "would_deny"])
    out = io.StringIO()
    assert audit_cli.run(args, out=out, err=io.StringIO()) == 0
    assert out.getvalue().splitlines() == [MIXED[3].to_json()]


# --------------------------------------------------------------------------- --follow, for real


def _child_env() -> dict[str, str]:
    src = str(Path(audit_cli.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _read_lines(proc: subprocess.Popen[bytes], count: int) -> Iterator[str]:
    assert proc.stdout is not None
    for _ in range(count):
        line = proc.stdout.readline()
        assert line, "the follower exited early"
        yield line.decode().rstrip("\n")


def test_follow_command_across_rotation_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    records = numbered(60)
    write_log(path, records[:5])
    proc = subprocess.Popen(
        [sys.executable, "-m", "egressbox.cli.audit", str(path), "--follow", "--host", "h*"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
    )
    try:
        assert list(_read_lines(proc, 5)) == [r.to_json() for r in records[:5]]
        line_size = len(records[0].to_json()) + 1
        with JsonlFileSink(path, max_bytes=line_size * 10, keep=100) as sink:
            for record in records[5:]:
                sink.write(record)
        assert list(_read_lines(proc, 55)) == [r.to_json() for r in records[5:]]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(CHILD_TIMEOUT) == 0
        assert proc.stderr is not None and proc.stderr.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(CHILD_TIMEOUT)
