"""Tests for egressbox.audit.record: the six-key record, the sinks, the reader, filter and summary.

Files are real (tmp_path); concurrency and crash tests use real child processes.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import gzip
import json
import os
import pickle
import select
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressbox.audit import record as audit
from egressbox.audit.record import (
    KEYS,
    MAX_LINE_BYTES,
    AuditProtocol,
    AuditRecord,
    AuditSink,
    CallbackSink,
    InvalidRecordError,
    JsonlFileSink,
    MalformedLine,
    MemorySink,
    RecordFilter,
    StreamSink,
    SummaryRow,
    TeeSink,
    decision_line,
    iter_records,
    read_records,
    summarize,
)
from egressbox.core.errors import AuditError, Reason, Verdict

T0 = datetime(2026, 11, 30, 11, 8, 16, 123000, tzinfo=UTC)
CHILD_TIMEOUT = 60  # seconds; generous for a loaded CI machine, still bounded


def make(
    host: str = "pypi.org",
    port: int = 443,
    decision: Verdict = Verdict.ALLOW,
    reason: Reason = Reason.ALLOWED,
    protocol: AuditProtocol = AuditProtocol.CONNECT,
    ts: datetime = T0,
) -> AuditRecord:
    return AuditRecord(ts, protocol, host, port, decision, reason)


def line_of(record: AuditRecord) -> str:
    return record.to_json() + "\n"


def valid_dict() -> dict[str, Any]:
    return json.loads(make().to_json())  # type: ignore[no-any-return]


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data)


def records_only(items: Iterable[AuditRecord | MalformedLine]) -> list[AuditRecord]:
    out = []
    for item in items:
        assert isinstance(item, AuditRecord), str(item)
        out.append(item)
    return out


# --------------------------------------------------------------------------- the record


def test_exact_json_shape_and_key_order() -> None:
    clock = datetime(2026, 11, 30, 11, 8, 16, 123456, tzinfo=UTC)
    record = AuditRecord.create(
        AuditProtocol.CONNECT, "pypi.org", 443, Verdict.ALLOW, Reason.ALLOWED, now=lambda: clock
    )
    assert record.to_json() == (
        '{"ts":"2026-11-30T11:08:16.123Z","protocol":"connect","host":"pypi.org",'
        '"port":443,"decision":"allow","reason":"allowed"}'
    )
    assert list(json.loads(record.to_json(), object_pairs_hook=dict)) == list(KEYS)
    assert list(record.to_dict()) == list(KEYS)
    assert record.to_dict()["port"] == 443


def test_json_is_ascii_only() -> None:
    record = make(host="bücher.example")
    assert record.to_json().isascii()
    assert AuditRecord.from_json(record.to_json()) == record


def test_round_trip() -> None:
    record = make(
        host="2001:db8::1",
        port=0,
        decision=Verdict.WOULD_DENY,
        reason=Reason.NO_ALLOW_RULE,
        protocol=AuditProtocol.SOCKS5,
    )
    assert AuditRecord.from_json(record.to_json()) == record
    assert AuditRecord.from_json(line_of(record)) == record


def test_create_default_clock_is_utc_now() -> None:
    before = datetime.now(UTC) - timedelta(milliseconds=1)
    record = AuditRecord.create(AuditProtocol.HTTP, "a.example", 80, Verdict.DENY, Reason.DENY_RULE)
    after = datetime.now(UTC)
    assert before <= record.ts <= after
    assert record.ts.tzinfo is UTC
    assert str(record.to_dict()["ts"]).endswith("Z")


def test_create_converts_other_offsets_and_truncates_to_milliseconds() -> None:
    local = datetime(2026, 11, 30, 13, 8, 16, 999999, tzinfo=timezone(timedelta(hours=2)))
    record = AuditRecord.create(
        AuditProtocol.HTTP, "a.example", 80, Verdict.DENY, Reason.DENY_RULE, now=lambda: local
    )
    assert record.ts == datetime(2026, 11, 30, 11, 8, 16, 999000, tzinfo=UTC)
    assert record.to_dict()["ts"] == "2026-11-30T11:08:16.999Z"


def test_early_years_are_zero_padded() -> None:
    record = make(ts=datetime(999, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert record.to_dict()["ts"] == "0999-01-02T03:04:05.000Z"
    assert AuditRecord.from_json(record.to_json()) == record


def test_string_values_are_coerced_to_enums() -> None:
    record = AuditRecord(
        T0,
        cast(AuditProtocol, "http"),
        "a.example",
        80,
        cast(Verdict, "deny"),
        cast(Reason, "bad_port"),
    )
    assert record.protocol is AuditProtocol.HTTP
    assert record.decision is Verdict.DENY
    assert record.reason is Reason.BAD_PORT


def test_naive_ts_is_rejected() -> None:
    with pytest.raises(InvalidRecordError, match="timezone-aware"):
        make(ts=datetime(2026, 1, 1))


@pytest.mark.parametrize(
    "host",
    [
        "a b",
        "x\ny",
        "x\ry",
        "tab\there",
        "a" * 256,
        "nul\x00",
        "bidi\u202eflip",
        "nbsp\u00a0x",
        "line\u2028sep",
        "evil.example/admin",
        "evil.example?token=1",
        "user:pass@evil.example",
        "evil.example#frag",
        "back\\slash",
    ],
)
def test_host_guard_rejects(host: str) -> None:
    with pytest.raises(InvalidRecordError, match="host"):
        make(host=host)


@pytest.mark.parametrize(
    "host", ["", "a" * 255, "xn--strae-oqa.de", "::1", "[2001:db8::1]", "10.0.0.1", "_srv.a-b.c"]
)
def test_host_guard_accepts(host: str) -> None:
    assert make(host=host).host == host


def test_host_must_be_a_string() -> None:
    with pytest.raises(InvalidRecordError, match="host must be a string"):
        make(host=cast(str, b"pypi.org"))


@pytest.mark.parametrize("port", [-1, 65536, True, "443", 443.0, None])
def test_port_guard_rejects(port: object) -> None:
    with pytest.raises(InvalidRecordError, match="port"):
        make(port=cast(int, port))


@pytest.mark.parametrize("port", [0, 1, 65535])
def test_port_guard_accepts(port: int) -> None:
    assert make(port=port).port == port


def test_invalid_record_error_is_an_audit_error_and_value_error() -> None:
    with pytest.raises(AuditError):
        make(port=-1)
    with pytest.raises(ValueError, match="port"):
        make(port=-1)


def _with(**changes: Any) -> str:
    data = valid_dict()
    data.update(changes)
    return dumps(data)


def _without(key: str) -> str:
    data = valid_dict()
    del data[key]
    return dumps(data)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (_with(path="/secret"), "unexpected keys: 'path'"),
        (_with(headers={}), "unexpected keys: 'headers'"),
        (_without("host"), "missing keys: host"),
        (_without("ts"), "missing keys: ts"),
        ("{}", "missing keys: ts, protocol, host, port, decision, reason"),
        (_with(port="443"), "port must be an integer, got str"),
        (_with(port=443.0), "port must be an integer, got float"),
        (_with(port=True), "port must be an integer, got bool"),
        (_with(port=None), "port must be an integer, got NoneType"),
        (_with(port=70000), "port 70000 is out of range"),
        (_with(host=5), "host must be a string, got int"),
        (_with(host="a b"), "forbidden character ' '"),
        (_with(ts=0), "ts must be a string, got int"),
        (_with(protocol="explain"), "protocol 'explain' is not one of: http, connect, socks5"),
        (_with(protocol="HTTP"), "protocol 'HTTP' is not one of"),
        (_with(protocol=1), "protocol must be a string"),
        (_with(decision="maybe"), "decision 'maybe' is not one of: allow, deny, would_deny"),
        (_with(reason="because"), "reason 'because' is not one of: allowed, "),
        (_with(ts="yesterday"), "is not an RFC 3339 timestamp"),
        (_with(ts="2026-11-30 11:08:16.123Z"), "is not an RFC 3339 timestamp"),
        (_with(ts="2026-11-30T11:08:16.123"), "is not an RFC 3339 timestamp"),
        (_with(ts="2026-13-30T11:08:16.123Z"), "is not a valid date and time"),
        (_with(ts="2026-11-30T11:08:60.000Z"), "is not a valid date and time"),
        (_with(ts="2026-11-30T11:08:16.123+01:00"), "is not UTC"),
        ('{"ts": 1, "ts": 2}', "duplicate key 'ts'"),
        ("[]", "expected a JSON object, got list"),
        ('"text"', "expected a JSON object, got str"),
        ("", "not valid JSON"),
        ("{", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
        ('{"port": ' + "9" * 5000 + "}", "not valid JSON"),
    ],
)
def test_from_json_rejects(line: str, message: str) -> None:
    with pytest.raises(InvalidRecordError) as caught:
        AuditRecord.from_json(line)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("ts", "expected"),
    [
        ("2026-11-30T11:08:16Z", datetime(2026, 11, 30, 11, 8, 16, tzinfo=UTC)),
        ("2026-11-30T11:08:16.5+00:00", datetime(2026, 11, 30, 11, 8, 16, 500000, tzinfo=UTC)),
        ("2026-11-30t11:08:16.123z", T0),
        ("2026-11-30T11:08:16.123987654Z", T0),
    ],
)
def test_from_json_accepts_other_rfc3339_utc_spellings(ts: str, expected: datetime) -> None:
    assert AuditRecord.from_json(_with(ts=ts)).ts == expected


def test_record_is_frozen() -> None:
    record = make()
    with pytest.raises(AttributeError):
        record.host = "other"  # type: ignore[misc]


def test_values_copy_and_pickle_as_themselves() -> None:
    # Compiled too, where the frozen classes are remade by their __init__ (__reduce__).
    record = make(host="copy.example", port=8443)
    values: list[object] = [
        record,
        MalformedLine("audit.jsonl", 3, "not valid JSON"),
        RecordFilter(host="*.Example.COM", port=443, since=T0),
        summarize([record])[0],
    ]
    for value in values:
        for copied in (copy.copy(value), copy.deepcopy(value), pickle.loads(pickle.dumps(value))):
            assert copied == value
            assert type(copied) is type(value)


def test_errors_keep_their_cause_or_hide_their_context() -> None:
    # `raise ... from exc` and `from None` hold compiled as well (see audit._chained).
    with pytest.raises(InvalidRecordError, match="not valid JSON") as caught:
        AuditRecord.from_json("{")
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__
    with pytest.raises(AuditError, match="cannot read audit log") as unreadable:
        next(read_records("/nonexistent/audit.jsonl"))
    assert isinstance(unreadable.value.__cause__, FileNotFoundError)
    assert unreadable.value.__suppress_context__


# --------------------------------------------------------------------------- file sink


def test_file_sink_writes_lines_and_sets_flags(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    first, second = make(), make(host="files.pythonhosted.org", decision=Verdict.DENY)
    with JsonlFileSink(path) as sink:
        flags = fcntl.fcntl(sink.fileno(), fcntl.F_GETFL)
        assert flags & os.O_APPEND
        assert flags & os.O_ACCMODE == os.O_WRONLY
        assert not flags & os.O_NONBLOCK
        assert fcntl.fcntl(sink.fileno(), fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        sink.write(first)
        sink.write(second)
    assert path.read_text() == line_of(first) + line_of(second)
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_each_record_is_exactly_one_whole_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bytes] = []
    real_write = os.write

    def spy(fd: int, data: bytes) -> int:
        calls.append(bytes(data))
        return real_write(fd, data)

    with JsonlFileSink(tmp_path / "audit.jsonl") as sink:
        monkeypatch.setattr(os, "write", spy)
        for port in (1, 2, 3):
            sink.write(make(port=port))
    assert calls == [line_of(make(port=port)).encode() for port in (1, 2, 3)]


def short_writes(monkeypatch: pytest.MonkeyPatch, *budget: int) -> None:
    """os.write lands only the first budget[i] bytes of its i-th call (then all)."""
    real_write = os.write
    left = list(budget)

    def flaky(fd: int, data: bytes) -> int:
        return real_write(fd, data[: left.pop(0)] if left else data)

    monkeypatch.setattr(os, "write", flaky)


def test_a_short_writes_fragment_is_blanked_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    with JsonlFileSink(path) as sink:
        sink.write(make(port=1))
        short_writes(monkeypatch, 10)
        with pytest.raises(AuditError, match=r"short write of audit record to .*: 10 of"):
            sink.write(make(port=2))
        # The 10 bytes are spaces now; the next record follows them on their line.
        assert path.read_text() == line_of(make(port=1)) + " " * 10
        assert list(read_records(path)) == [make(port=1)]  # trailing spaces: no tear
        sink.write(make(port=3))
    assert path.read_text() == line_of(make(port=1)) + " " * 10 + line_of(make(port=3))
    assert records_only(read_records(path)) == [make(port=1), make(port=3)]


def test_a_fragment_is_blanked_after_what_others_appended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another writer appends between our short write and its repair: only our bytes change.
    path = tmp_path / "audit.jsonl"
    other = JsonlFileSink(path)
    real_blank = audit._blank

    def blank_later(fd: int, fragment: bytes, offset: int) -> bool:
        other.write(make(port=7))
        return real_blank(fd, fragment, offset)

    with JsonlFileSink(path) as sink:
        monkeypatch.setattr(audit, "_blank", blank_later)
        short_writes(monkeypatch, 30)
        with pytest.raises(AuditError, match="short write"):
            sink.write(make(port=1))
    other.close()
    assert path.read_text() == " " * 30 + line_of(make(port=7))
    assert records_only(read_records(path)) == [make(port=7)]


def test_a_fragment_that_cannot_be_blanked_is_ended_by_a_newline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    monkeypatch.setattr(audit, "_blank", lambda fd, fragment, offset: False)
    with JsonlFileSink(path) as sink:
        short_writes(monkeypatch, 10)
        with pytest.raises(AuditError, match="short write"):
            sink.write(make(port=1))
        sink.write(make(port=2))
    assert path.read_text() == line_of(make(port=1))[:10] + "\n" + line_of(make(port=2))


def test_a_short_write_after_a_torn_tail_keeps_the_newline_that_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text('{"ts":"2026-')  # a writer died here
    with JsonlFileSink(path) as sink:
        short_writes(monkeypatch, 5)
        with pytest.raises(AuditError, match="short write"):
            sink.write(make(port=1))
        sink.write(make(port=2))
    assert path.read_text() == '{"ts":"2026-\n' + " " * 4 + line_of(make(port=2))
    items = list(read_records(path))
    assert isinstance(items[0], MalformedLine)
    assert items[1:] == [make(port=2)]


def test_stream_sink_ends_a_fragment_with_a_newline(monkeypatch: pytest.MonkeyPatch) -> None:
    read_end, write_end = os.pipe()
    try:
        sink = StreamSink(write_end)
        short_writes(monkeypatch, 10)
        with pytest.raises(AuditError, match="short write"):
            sink.write(make(port=1))  # then the repair newline goes out whole
        sink.write(make(port=2))
        data = os.read(read_end, 65536).decode()
    finally:
        os.close(read_end)
        os.close(write_end)
    assert data == line_of(make(port=1))[:10] + "\n" + line_of(make(port=2))


def test_file_sink_appends_to_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    for port in (1, 2):
        with JsonlFileSink(path) as sink:
            sink.write(make(port=port))
    assert [r.port for r in records_only(read_records(path))] == [1, 2]


def test_file_sink_closed_refuses_writes(tmp_path: Path) -> None:
    sink = JsonlFileSink(tmp_path / "audit.jsonl")
    sink.close()
    sink.close()  # idempotent
    with pytest.raises(AuditError, match="closed"):
        sink.write(make())
    with pytest.raises(AuditError, match="closed"):
        sink.fileno()


def test_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target.jsonl"
    target.write_text("")
    link = tmp_path / "audit.jsonl"
    link.symlink_to(target)
    with pytest.raises(AuditError, match=r"symbolic link.*O_NOFOLLOW"):
        JsonlFileSink(link)
    assert target.read_text() == ""


def test_dangling_symlink_is_refused_and_target_not_created(tmp_path: Path) -> None:
    target = tmp_path / "planted.jsonl"
    link = tmp_path / "audit.jsonl"
    link.symlink_to(target)
    with pytest.raises(AuditError, match="symbolic link"):
        JsonlFileSink(link)
    assert not target.exists()


def test_special_files_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(AuditError, match=r"FIFO.*regular file"):
        JsonlFileSink(fifo)  # must not block waiting for a reader
    with pytest.raises(AuditError, match="directory"):
        JsonlFileSink(tmp_path)
    if os.path.exists("/dev/null"):
        with pytest.raises(AuditError, match="character device"):
            JsonlFileSink("/dev/null")


def test_unwritable_location_raises_audit_error(tmp_path: Path) -> None:
    with pytest.raises(AuditError, match="cannot be opened"):
        JsonlFileSink(tmp_path / "missing-dir" / "audit.jsonl")


def test_write_error_raises_audit_error(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    sink = JsonlFileSink(path)
    # Swap a read-only descriptor in under the sink: write(2) then fails with EBADF, and
    # the number stays ours, so close() cannot hit a descriptor that someone else reused.
    read_only = os.open(path, os.O_RDONLY)
    os.dup2(read_only, sink.fileno())
    os.close(read_only)
    with pytest.raises(AuditError, match="Bad file descriptor") as caught:
        sink.write(make())
    assert isinstance(caught.value.__cause__, OSError)
    sink.close()


def test_full_device_raises_audit_error() -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    fd = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
    try:
        with pytest.raises(AuditError, match="No space left"):
            StreamSink(fd).write(make())
    finally:
        os.close(fd)


SHORT_WRITER = """
import json, resource, signal, sys
from datetime import datetime, UTC
from egressbox.audit.record import AuditProtocol, AuditRecord, JsonlFileSink
from egressbox.core.errors import AuditError, Reason, Verdict

path, limit = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # turn the signal into EFBIG / a short write
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
record = AuditRecord(datetime(2026, 1, 1, tzinfo=UTC), AuditProtocol.HTTP, "a.example", 80,
                     Verdict.ALLOW, Reason.ALLOWED)
outcomes = []
with JsonlFileSink(path) as sink:
    for _ in range(3):
        try:
            sink.write(record)
            outcomes.append("ok")
        except AuditError as exc:
            outcomes.append(str(exc))
print(json.dumps(outcomes))
"""


def run_child(code: str, *args: str, stdin: str = "") -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    package_root = str(Path(audit.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


def test_short_write_raises_and_next_writer_keeps_records_whole(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    line_length = len(make(host="a.example").to_json()) + 1
    limit = line_length + line_length // 2
    outcomes = json.loads(run_child(SHORT_WRITER, str(path), str(limit)))
    assert outcomes[0] == "ok"
    assert outcomes[1].startswith("short write of audit record")
    assert "File too large" in outcomes[2]
    assert path.stat().st_size == limit  # the second record's fragment: blanked, in place
    assert path.read_bytes()[line_length:] == b" " * (limit - line_length)

    # A later writer continues on the blanked line: every line is a whole record.
    with JsonlFileSink(path) as sink:
        sink.write(make(port=9))
    items = records_only(read_records(path))
    assert [item.host for item in items] == ["a.example", "pypi.org"]
    assert items[1].port == 9


def test_new_sink_terminates_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text(line_of(make(port=1)) + '{"ts":"2026-')
    with JsonlFileSink(path) as sink:
        sink.write(make(port=2))
        sink.write(make(port=3))
    items = list(read_records(path))
    assert [getattr(item, "port", None) for item in items] == [1, None, 2, 3]
    assert isinstance(items[1], MalformedLine)


def test_a_blanked_tail_is_no_fragment(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text(line_of(make(port=1)) + " " * 40)
    with JsonlFileSink(path) as sink:
        sink.write(make(port=2))
    assert path.read_text() == line_of(make(port=1)) + " " * 40 + line_of(make(port=2))


def test_whole_tail_gets_no_blank_line(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text(line_of(make(port=1)))
    with JsonlFileSink(path) as sink:
        sink.write(make(port=2))
    assert path.read_text() == line_of(make(port=1)) + line_of(make(port=2))


# --------------------------------------------------------------------------- concurrency, crash

WRITER = """
import sys
from datetime import datetime, UTC
from egressbox.audit.record import AuditProtocol, AuditRecord, JsonlFileSink
from egressbox.core.errors import Reason, Verdict

path, worker, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with JsonlFileSink(path) as sink:
    print("ready", flush=True)
    sys.stdin.read()  # the parent closes stdin once every writer is ready: start together
    for n in range(count):
        # Varying lengths put records across page boundaries at varying offsets.
        host = f"w{worker}-" + "x" * (n % 97) + ".example"
        sink.write(AuditRecord(datetime.now(UTC), AuditProtocol.SOCKS5, host, n,
                               Verdict.DENY, Reason.NO_ALLOW_RULE))
"""


def test_concurrent_processes_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    workers, count = 8, 2000
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), str(worker), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for worker in range(workers)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in procs:
            assert proc.wait(timeout=CHILD_TIMEOUT) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
    ports: dict[str, list[int]] = {}
    for record in records_only(read_records(path)):
        ports.setdefault(record.host.split("-")[0], []).append(record.port)
    assert sorted(ports) == sorted(f"w{worker}" for worker in range(workers))
    for seen in ports.values():
        assert seen == list(range(count))  # each writer's own records stay in order


def test_concurrent_threads_share_one_sink(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    threads_n, count = 8, 500
    with JsonlFileSink(path) as sink:

        def work(worker: int) -> None:
            for n in range(count):
                sink.write(make(host=f"t{worker}.example", port=n))

        threads = [threading.Thread(target=work, args=(w,)) for w in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=CHILD_TIMEOUT)
    per_host: dict[str, list[int]] = {}
    for record in records_only(read_records(path)):
        per_host.setdefault(record.host, []).append(record.port)
    assert sorted(per_host) == sorted(f"t{worker}.example" for worker in range(threads_n))
    assert all(ports == list(range(count)) for ports in per_host.values())


CRASHER = """
import sys
from datetime import datetime, UTC
from egressbox.audit.record import AuditProtocol, AuditRecord, JsonlFileSink
from egressbox.core.errors import Reason, Verdict

path, size = sys.argv[1], int(sys.argv[2])
def record(host):
    return AuditRecord(datetime.now(UTC), AuditProtocol.CONNECT, host, 443,
                       Verdict.ALLOW, Reason.ALLOWED)
one = record("h" * (size - 1 - len(record("").to_json())))
with JsonlFileSink(path) as sink:
    sink.write(one)
    print("writing", flush=True)
    # The same record each time keeps the loop tight, so the kill most likely lands in or
    # near write(2). Bounded; the parent kills us long before the end.
    for _ in range(50_000_000):
        sink.write(one)
"""


@pytest.mark.parametrize("attempt", range(5))
def test_sigkill_never_leaves_a_torn_record(tmp_path: Path, attempt: int) -> None:
    # Records are 128 bytes, a divisor of the page size, so none straddles a page: Linux can
    # cut a write between page-cache pages on SIGKILL (handled by the torn-tail repair,
    # tested above); here we check that our side never splits a record into two writes.
    path = tmp_path / "audit.jsonl"
    size = 128
    proc = subprocess.Popen(
        [sys.executable, "-c", CRASHER, str(path), str(size)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "writing\n"
        threading.Event().wait(0.02 * (attempt + 1))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=CHILD_TIMEOUT)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    data = path.read_bytes()
    assert len(data) % size == 0
    assert data.endswith(b"\n")
    records = records_only(read_records(path))
    assert len(records) == len(data) // size > 1


# --------------------------------------------------------------------------- other sinks


def test_stream_sink_on_a_pipe(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    try:
        sink = StreamSink(write_end)
        sink.write(make(port=1))
        sink.write(make(port=2))
        sink.close()  # does not close the descriptor it was given
        os.fstat(write_end)
        data = os.read(read_end, 65536).decode()
    finally:
        os.close(read_end)
        os.close(write_end)
    assert data == line_of(make(port=1)) + line_of(make(port=2))


def test_longest_record_fits_in_pipe_buf() -> None:
    # Atomic pipe writes need every line to be at most PIPE_BUF bytes.
    longest = make(
        host="\U0001f600" * 255,
        port=65535,
        decision=Verdict.WOULD_DENY,
        reason=Reason.TOO_MANY_CONNECTIONS,
        protocol=AuditProtocol.CONNECT,
    )
    assert len(line_of(longest).encode()) <= select.PIPE_BUF


def test_full_nonblocking_pipe_raises_instead_of_tearing() -> None:
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(write_end, False)
        sink = StreamSink(write_end)
        with pytest.raises(AuditError, match="Resource temporarily unavailable"):
            for _ in range(100_000):
                sink.write(make())
        os.set_blocking(read_end, False)
        data = b""
        while True:
            try:
                chunk = os.read(read_end, 65536)
            except BlockingIOError:
                break
            data += chunk
    finally:
        os.close(read_end)
        os.close(write_end)
    assert data
    assert data.endswith(b"\n")
    assert len(records_only(iter_records(data.decode().splitlines(keepends=True)))) > 0


def test_memory_sink() -> None:
    sink = MemorySink()
    sink.write(make(port=1))
    sink.write(make(port=2))
    sink.close()
    assert [r.port for r in sink.records] == [1, 2]
    with pytest.raises(AuditError, match="MemorySink is closed"):
        sink.write(make())


def test_callback_sink_wraps_failures() -> None:
    seen: list[AuditRecord] = []
    CallbackSink(seen.append).write(make())
    assert seen == [make()]

    def broken(record: AuditRecord) -> None:
        raise RuntimeError("disk on fire")

    with pytest.raises(AuditError, match="disk on fire") as caught:
        CallbackSink(broken).write(make())
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_tee_sink_tries_every_sink_then_raises() -> None:
    first, last = MemorySink(), MemorySink()

    def broken(record: AuditRecord) -> None:
        raise RuntimeError("nope")

    tee = TeeSink(first, CallbackSink(broken), last)
    with pytest.raises(AuditError, match=r"1 of 3 audit sinks failed to write: .*nope"):
        tee.write(make())
    assert first.records == [make()]
    assert last.records == [make()]
    tee.close()
    with pytest.raises(AuditError, match="3 of 3 audit sinks failed to write"):
        tee.write(make())


def test_every_sink_satisfies_the_protocol(tmp_path: Path) -> None:
    with JsonlFileSink(tmp_path / "a.jsonl") as file_sink:
        sinks: list[object] = [
            file_sink,
            StreamSink(1),
            MemorySink(),
            CallbackSink(print),
            TeeSink(),
        ]
        assert all(isinstance(sink, AuditSink) for sink in sinks)


# --------------------------------------------------------------------------- reading


def test_iter_records_reports_and_skips_malformed_lines() -> None:
    good1, good2 = make(port=1), make(port=2)
    lines = [
        line_of(good1),
        "not json\n",
        "\n",
        _with(extra=1) + "\n",
        line_of(good2),
        line_of(make(port=3))[:-10],  # torn tail
    ]
    items = list(iter_records(lines, source="audit.log"))
    assert items[0] == good1
    assert items[4] == good2
    bad = [item for item in items if isinstance(item, MalformedLine)]
    assert [item.line_number for item in bad] == [2, 3, 4, 6]
    assert str(bad[0]).startswith("audit.log:2: not valid JSON")
    assert str(bad[2]) == "audit.log:4: unexpected keys: 'extra'"
    assert bad[3].error.startswith("torn final line")
    assert str(MalformedLine("", 7, "boom")) == "<input>:7: boom"


def test_iter_records_only_the_final_line_can_be_torn() -> None:
    lines = [make(port=1).to_json(), make(port=2).to_json()]
    items = list(iter_records(lines))
    assert items[0] == make(port=1)
    assert isinstance(items[1], MalformedLine)
    assert items[1].line_number == 2
    assert list(iter_records([])) == []


def write_log(path: Path, lines: list[str], *, compress: bool = False) -> None:
    data = "".join(lines).encode()
    path.write_bytes(gzip.compress(data) if compress else data)


LOG_LINES = [line_of(make(port=1)), "garbage\n", line_of(make(port=2)), '{"ts":']


@pytest.mark.parametrize("compress", [False, True])
def test_read_records_plain_and_gzip(tmp_path: Path, compress: bool) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, LOG_LINES, compress=compress)
    items = list(read_records(path))
    assert items[0] == make(port=1)
    assert items[2] == make(port=2)
    assert [(i.source, i.line_number) for i in items if isinstance(i, MalformedLine)] == [
        (str(path), 2),
        (str(path), 4),
    ]


def test_read_records_gzip_members_concatenated(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl.gz"
    path.write_bytes(
        gzip.compress(line_of(make(port=1)).encode())
        + gzip.compress(line_of(make(port=2)).encode())
    )
    assert [r.port for r in records_only(read_records(path))] == [1, 2]


def test_read_records_truncated_gzip(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl.gz"
    lines = [line_of(make(port=n)) for n in range(200)]
    data = gzip.compress("".join(lines).encode())
    path.write_bytes(data[: len(data) - 20])
    items = list(read_records(path))
    *records, last = items
    assert isinstance(last, MalformedLine)
    assert "compressed data is damaged" in last.error
    assert last.line_number == len(records) + 1
    assert [r.port for r in records_only(records)] == list(range(len(records)))


def test_read_records_bad_gzip_body(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl.gz"
    path.write_bytes(b"\x1f\x8b" + b"not really gzip at all\n")
    items = list(read_records(path))
    assert len(items) == 1
    assert isinstance(items[0], MalformedLine)
    assert items[0].line_number == 1


def test_read_records_long_and_undecodable_lines(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(
        b"x" * (3 * MAX_LINE_BYTES + 5)
        + b"\n"
        + b"\xff\xfe not utf-8\n"
        + line_of(make(port=7)).encode()
    )
    items = list(read_records(path))
    assert len(items) == 3
    assert isinstance(items[0], MalformedLine)
    assert "longer than" in items[0].error
    assert isinstance(items[1], MalformedLine)
    assert "not valid UTF-8" in items[1].error
    assert items[2] == make(port=7)


def test_read_records_long_final_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(line_of(make()).encode() + b"y" * (MAX_LINE_BYTES + 1))
    items = list(read_records(path))
    assert items[0] == make()
    assert isinstance(items[1], MalformedLine)
    assert items[1].line_number == 2


def test_read_records_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AuditError, match="cannot read audit log"):
        list(read_records(tmp_path / "nope.jsonl"))


def test_read_records_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b"")
    assert list(read_records(path)) == []


# --------------------------------------------------------------------------- filter, summary

SAMPLE = [
    make("pypi.org", 443, Verdict.ALLOW, Reason.ALLOWED, AuditProtocol.CONNECT, T0),
    make(
        "files.pypi.org",
        443,
        Verdict.ALLOW,
        Reason.ALLOWED,
        AuditProtocol.HTTP,
        T0 + timedelta(seconds=1),
    ),
    make(
        "evil.example",
        80,
        Verdict.DENY,
        Reason.NO_ALLOW_RULE,
        AuditProtocol.HTTP,
        T0 + timedelta(seconds=2),
    ),
    make(
        "169.254.169.254",
        80,
        Verdict.DENY,
        Reason.DENY_CIDR,
        AuditProtocol.SOCKS5,
        T0 + timedelta(seconds=3),
    ),
    make(
        "evil.example",
        80,
        Verdict.WOULD_DENY,
        Reason.NO_ALLOW_RULE,
        AuditProtocol.CONNECT,
        T0 + timedelta(seconds=4),
    ),
    make(
        "evil.example",
        443,
        Verdict.DENY,
        Reason.NO_ALLOW_RULE,
        AuditProtocol.CONNECT,
        T0 + timedelta(seconds=5),
    ),
]


@pytest.mark.parametrize(
    ("flt", "expected"),
    [
        (RecordFilter(), [0, 1, 2, 3, 4, 5]),
        (RecordFilter(decision=Verdict.DENY), [2, 3, 5]),
        (RecordFilter(decision=Verdict.WOULD_DENY), [4]),
        (RecordFilter(host="*.pypi.org"), [1]),
        (RecordFilter(host="*PyPI.org"), [0, 1]),
        (RecordFilter(host="169.254.*"), [3]),
        (RecordFilter(port=80), [2, 3, 4]),
        (RecordFilter(protocol=AuditProtocol.CONNECT), [0, 4, 5]),
        (RecordFilter(reason=Reason.NO_ALLOW_RULE), [2, 4, 5]),
        (RecordFilter(since=T0 + timedelta(seconds=3)), [3, 4, 5]),
        (RecordFilter(until=T0 + timedelta(seconds=2)), [0, 1]),
        (
            RecordFilter(since=T0 + timedelta(seconds=1), until=T0 + timedelta(seconds=4)),
            [1, 2, 3],
        ),
        (RecordFilter(host="evil.example", port=80, decision=Verdict.DENY), [2]),
        (RecordFilter(host="nothing.example"), []),
    ],
)
def test_filter(flt: RecordFilter, expected: list[int]) -> None:
    assert [i for i, record in enumerate(SAMPLE) if flt.matches(record)] == expected


def test_filter_since_is_inclusive_until_exclusive_across_offsets() -> None:
    plus_one = timezone(timedelta(hours=1))
    at = T0.astimezone(plus_one)
    assert RecordFilter(since=at).matches(SAMPLE[0])
    assert not RecordFilter(until=at).matches(SAMPLE[0])


def test_filter_rejects_naive_times() -> None:
    with pytest.raises(ValueError, match="since must be timezone-aware"):
        RecordFilter(since=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="until must be timezone-aware"):
        RecordFilter(until=datetime(2026, 1, 1))


def test_summary() -> None:
    rows = summarize(SAMPLE)
    assert rows == [
        SummaryRow(
            host="evil.example",
            port=80,
            total=2,
            decisions={Verdict.DENY: 1, Verdict.WOULD_DENY: 1},
            reasons={Reason.NO_ALLOW_RULE: 2},
            first_ts=T0 + timedelta(seconds=2),
            last_ts=T0 + timedelta(seconds=4),
        ),
        SummaryRow(
            "169.254.169.254",
            80,
            1,
            {Verdict.DENY: 1},
            {Reason.DENY_CIDR: 1},
            T0 + timedelta(seconds=3),
            T0 + timedelta(seconds=3),
        ),
        SummaryRow(
            "evil.example",
            443,
            1,
            {Verdict.DENY: 1},
            {Reason.NO_ALLOW_RULE: 1},
            T0 + timedelta(seconds=5),
            T0 + timedelta(seconds=5),
        ),
        SummaryRow(
            "files.pypi.org",
            443,
            1,
            {Verdict.ALLOW: 1},
            {Reason.ALLOWED: 1},
            T0 + timedelta(seconds=1),
            T0 + timedelta(seconds=1),
        ),
        SummaryRow(
            "pypi.org",
            443,
            1,
            {Verdict.ALLOW: 1},
            {Reason.ALLOWED: 1},
            T0,
            T0,
        ),
    ]
    assert rows[0].to_dict() == {
        "host": "evil.example",
        "port": 80,
        "total": 2,
        "decisions": {"deny": 1, "would_deny": 1},
        "reasons": {"no_allow_rule": 2},
        "first_ts": "2026-11-30T11:08:18.123Z",
        "last_ts": "2026-11-30T11:08:20.123Z",
    }


def test_summary_uses_earliest_and_latest_even_out_of_order() -> None:
    late, early = make(ts=T0 + timedelta(hours=1)), make(ts=T0)
    (row,) = summarize([late, early, late])
    assert (row.total, row.first_ts, row.last_ts) == (3, T0, T0 + timedelta(hours=1))
    assert list(row.decisions) == [Verdict.ALLOW]
    assert summarize([]) == []


def test_summary_streams_from_a_generator(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    write_log(path, [line_of(record) for record in SAMPLE] + ["junk\n"])
    from_file = summarize(item for item in read_records(path) if isinstance(item, AuditRecord))
    assert from_file == summarize(SAMPLE)


# --------------------------------------------------------------------------- properties

HOSTS = st.text(
    st.characters(
        exclude_categories=("Cc", "Cf", "Cs", "Zs", "Zl", "Zp"), exclude_characters="/?#@\\"
    ),
    max_size=255,
).filter(lambda host: not any(char.isspace() for char in host))

RECORDS = st.builds(
    AuditRecord,
    ts=st.datetimes(timezones=st.just(UTC)),
    protocol=st.sampled_from(AuditProtocol),
    host=HOSTS,
    port=st.integers(0, 65535),
    decision=st.sampled_from(Verdict),
    reason=st.sampled_from(Reason),
)

# Objects near the contract: right and wrong keys, right and wrong values.
NEAR_RECORDS = st.dictionaries(
    st.sampled_from([*KEYS, "path", "Host"]),
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=30),
        st.sampled_from([*AuditProtocol, *Verdict, *Reason, "2026-11-30T11:08:16.123Z"]),
    ),
).map(lambda data: json.dumps(data) + "\n")


@given(RECORDS)
def test_property_round_trip(record: AuditRecord) -> None:
    line = record.to_json()
    assert AuditRecord.from_json(line) == record
    assert AuditRecord.from_json(line).to_json() == line
    assert line.isascii()
    assert len(line) + 1 <= select.PIPE_BUF


@given(
    st.lists(
        st.one_of(
            RECORDS.map(lambda r: (r, line_of(r))),
            st.text().map(lambda text: (None, text)),
            st.text().map(lambda text: (None, text + "\n")),
            NEAR_RECORDS.map(lambda text: (None, text)),
        ),
        max_size=20,
    )
)
def test_property_iter_records_never_raises(
    tagged: list[tuple[AuditRecord | None, str]],
) -> None:
    items = list(iter_records([line for _, line in tagged], source="fuzz"))
    assert len(items) == len(tagged)
    for (expected, _), item in zip(tagged, items, strict=True):
        assert isinstance(item, AuditRecord | MalformedLine)
        if expected is not None:
            assert item == expected


@given(st.lists(st.binary(max_size=200), max_size=10), st.booleans())
def test_property_read_records_never_raises(chunks: list[bytes], compress: bool) -> None:
    data = b"".join(chunks)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "fuzz.jsonl"
        path.write_bytes(gzip.compress(data) if compress else data)
        items = list(read_records(path))
    assert all(isinstance(item, AuditRecord | MalformedLine) for item in items)
    if compress or not data.startswith(b"\x1f\x8b"):  # else it is read as a broken .gz
        # One item per "\n"-terminated line, plus one for an unterminated tail (unless
        # it is only spaces: a blanked fragment, no record and no tear).
        last = data.rpartition(b"\n")[2]
        tail = bool(last) and last.strip(b" ") != b""
        assert len(items) == data.count(b"\n") + tail


@given(st.lists(RECORDS, min_size=1, max_size=4), st.sampled_from([0, 1, 999_999]))
def test_property_to_json_is_json_dumps_byte_for_byte(records: list[AuditRecord], us: int) -> None:
    # to_json() has a fast path (no json.dumps, a cached per-second ts prefix); records
    # in the same second and in different seconds must give the exact json.dumps text.
    same_second = [
        AuditRecord(
            records[0].ts.replace(microsecond=us),
            r.protocol,
            r.host,
            r.port,
            r.decision,
            r.reason,
        )
        for r in records
    ]
    for record in [*records, *same_second]:
        line = record.to_json()
        assert line == json.dumps(record.to_dict(), ensure_ascii=True, separators=(",", ":"))


# --------------------------------------------------------------------------- the proxy's fast line

PLAIN_HOSTS = st.from_regex(r"[0-9A-Za-z._:-]{0,255}", fullmatch=True)
# Unix nanoseconds from 1970 to the end of year 9999 (what a record's ts can hold).
NANOSECONDS = st.integers(0, 253402300799 * 10**9 + 999_999_999)


def stamped(now_ns: int) -> datetime:
    """What datetime.now(UTC) gives at `now_ns`: microseconds, rounded down."""
    seconds, rest = divmod(now_ns, 10**9)
    return datetime.fromtimestamp(seconds, UTC) + timedelta(microseconds=rest // 1000)


@given(
    st.lists(
        st.tuples(
            NANOSECONDS,
            st.sampled_from(AuditProtocol),
            st.one_of(PLAIN_HOSTS, HOSTS),
            st.integers(0, 65535),
            st.sampled_from(Verdict),
            st.sampled_from(Reason),
        ),
        min_size=1,
        max_size=20,
    )
)
def test_property_decision_line_is_the_records_line(
    fields: list[tuple[int, AuditProtocol, str, int, Verdict, Reason]],
) -> None:
    fast_file, slow_file = bytearray(), bytearray()
    with tempfile.TemporaryDirectory() as directory:
        fast_path, slow_path = Path(directory) / "fast.jsonl", Path(directory) / "slow.jsonl"
        with JsonlFileSink(fast_path) as fast, JsonlFileSink(slow_path) as slow:
            for now_ns, protocol, host, port, decision, reason in fields:
                record = AuditRecord(stamped(now_ns), protocol, host, port, decision, reason)
                line = decision_line(protocol, host, port, decision, reason, now_ns=now_ns)
                assert line == record.to_json()  # valid fields: never None
                fast.write_json(line)
                slow.write(record)
        fast_file += fast_path.read_bytes()
        slow_file += slow_path.read_bytes()
    assert fast_file == slow_file


def test_decision_line_leaves_the_unusual_to_the_record() -> None:
    now = 1_796_036_896_123_456_789
    args = (AuditProtocol.CONNECT, "example.com", 443, Verdict.ALLOW, Reason.ALLOWED)
    assert decision_line(*args, now_ns=now) == (
        '{"ts":"2026-11-30T11:08:16.123Z","protocol":"connect","host":"example.com",'
        '"port":443,"decision":"allow","reason":"allowed"}'
    )
    invalid = (AuditProtocol.CONNECT, "(invalid)", 0, Verdict.DENY, Reason.BAD_HOST)
    assert decision_line(*invalid, now_ns=now) == (
        '{"ts":"2026-11-30T11:08:16.123Z","protocol":"connect","host":"(invalid)",'
        '"port":0,"decision":"deny","reason":"bad_host"}'
    )
    # Not the enum member: AuditRecord coerces the string.
    protocol = cast(AuditProtocol, "connect")
    assert decision_line(protocol, "example.com", 443, *args[3:], now_ns=now) is None
    bad_fields: list[tuple[Any, ...]] = [
        (AuditProtocol.CONNECT, "example.com", 65536, Verdict.ALLOW, Reason.ALLOWED),
        (AuditProtocol.CONNECT, "example.com", True, Verdict.ALLOW, Reason.ALLOWED),
        (AuditProtocol.CONNECT, "evil.example/admin", 80, Verdict.DENY, Reason.BAD_HOST),
        (AuditProtocol.CONNECT, "a b", 80, Verdict.DENY, Reason.BAD_HOST),
        (AuditProtocol.CONNECT, b"example.com", 80, Verdict.DENY, Reason.BAD_HOST),
    ]
    for bad in bad_fields:
        assert decision_line(*bad, now_ns=now) is None
        with pytest.raises(InvalidRecordError):  # the record says what is wrong
            AuditRecord.create(*bad)


@pytest.fixture
def line_tails() -> Iterator[dict[tuple[str, int, AuditProtocol, Verdict, Reason], str]]:
    """decision_line's cache of line tails, empty for the test and as it was after it.

    Emptied in place rather than replaced: compiled, decision_line holds the dict itself
    (a Final), not the module attribute a monkeypatch would swap."""
    tails = audit._line_tails
    saved = dict(tails)
    tails.clear()
    yield tails
    tails.clear()
    tails.update(saved)


def test_decision_line_of_fields_seen_before_is_still_the_records_line(
    line_tails: dict[tuple[str, int, AuditProtocol, Verdict, Reason], str],
) -> None:
    # The text after the timestamp is kept per (host, port, protocol, decision, reason):
    # the same fields at other instants, and other fields for the same host, still give
    # each record's own line.
    instants = (1_796_036_896_123_456_789, 1_796_036_897_000_000_000, 1_796_036_896_123_999_999)
    host, port = "repeat.example", 8443
    for decision, reason in (
        (Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE),
        (Verdict.ALLOW, Reason.ALLOWED),
    ):
        for now_ns in instants:
            args = (AuditProtocol.SOCKS5, host, port, decision, reason)
            line = decision_line(*args, now_ns=now_ns)
            assert line == AuditRecord(stamped(now_ns), *args).to_json()
    assert len(line_tails) == 2
    # A host the guard refuses never gets an entry, however often it is asked for.
    bad = (AuditProtocol.CONNECT, "a b", 80, Verdict.DENY, Reason.BAD_HOST)
    for now_ns in instants:
        assert decision_line(*bad, now_ns=now_ns) is None
    assert len(line_tails) == 2


def test_decision_line_cache_is_bounded(
    line_tails: dict[tuple[str, int, AuditProtocol, Verdict, Reason], str],
) -> None:
    # At its own bound (a Final: compiled code does not see a patched one), and past it.
    size = audit._TAIL_CACHE_SIZE
    now_ns = 1_796_036_896_123_456_789
    for index in range(size + 7):
        args = (AuditProtocol.CONNECT, f"h{index}.example", 443, Verdict.ALLOW, Reason.ALLOWED)
        assert decision_line(*args, now_ns=now_ns) == AuditRecord(stamped(now_ns), *args).to_json()
        assert len(line_tails) == min(index + 1, size)  # full: formatted as before


# --------------------------------------------------------------------------- one serializer

# Any text at all: quotes, backslashes, controls, non-ASCII and lone surrogates, which the
# host guard would refuse, still render exactly as json.dumps would.
ANY_TEXT = st.text(st.characters(codec=None), max_size=40)


@given(
    st.datetimes(timezones=st.just(UTC)),
    st.sampled_from(AuditProtocol),
    st.one_of(ANY_TEXT, HOSTS, PLAIN_HOSTS, st.sampled_from(['"', "\\", "\x7f", "é", "\ud800"])),
    st.integers(0, 65535),
    st.sampled_from(Verdict),
    st.sampled_from(Reason),
)
def test_property_record_line_is_json_dumps_byte_for_byte(
    ts: datetime,
    protocol: AuditProtocol,
    host: str,
    port: int,
    decision: Verdict,
    reason: Reason,
) -> None:
    text = audit.format_ts(ts)
    line = audit.record_line(protocol, host, port, decision, reason, ts=text)
    expected = {
        "ts": text,
        "protocol": protocol.value,
        "host": host,
        "port": port,
        "decision": decision.value,
        "reason": reason.value,
    }
    assert line == json.dumps(expected, ensure_ascii=True, separators=(",", ":"))
    assert line.isascii()


def test_enum_values_and_timestamps_need_no_escaping() -> None:
    # record_line puts these in quotes as they are: none may need a JSON escape.
    for value in [*AuditProtocol, *Verdict, *Reason]:
        assert json.dumps(value.value) == f'"{value.value}"'
    assert json.dumps(audit.format_ts(T0)) == f'"{audit.format_ts(T0)}"'


# --------------------------------------------------------------------------- one parser

# Six values in contract order that the lexer may or may not take, compact as record_line
# writes: the lexer must read exactly what json.loads reads, or leave the line to it.
LEXABLE_VALUES = st.tuples(
    st.one_of(
        st.just("2026-11-30T11:08:16.123Z"),
        st.from_regex(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fullmatch=True),
        st.text(max_size=30),
    ),
    st.one_of(st.sampled_from([*AuditProtocol, "HTTP", ""]), ANY_TEXT, st.integers()),
    st.one_of(HOSTS, PLAIN_HOSTS, ANY_TEXT, st.integers()),
    st.one_of(
        st.integers(-(2**70), 2**70), st.integers(0, 65535), st.booleans(), st.none(), st.floats()
    ),
    st.one_of(st.sampled_from([*Verdict, "maybe"]), ANY_TEXT),
    st.one_of(st.sampled_from([*Reason, "because"]), ANY_TEXT),
)


def _outcome(line: str) -> AuditRecord | str:
    try:
        return AuditRecord.from_json(line)
    except InvalidRecordError as exc:
        return str(exc)


@given(LEXABLE_VALUES, st.booleans())
def test_property_the_lexer_reads_what_json_loads_reads(
    values: tuple[object, ...], ensure_ascii: bool
) -> None:
    data = dict(zip(KEYS, values, strict=True))
    compact = json.dumps(data, ensure_ascii=ensure_ascii, separators=(",", ":"))
    match = audit._LINE_SHAPE.fullmatch(compact)
    if match is not None:
        lexed = list(match.groups())
        lexed[3] = int(lexed[3])
        assert lexed == list(json.loads(compact).values())
    # The same object spaced out always goes to json.loads: the outcome is the same,
    # a record or the same error.
    spaced = json.dumps(data, ensure_ascii=ensure_ascii, indent=2)
    assert audit._LINE_SHAPE.fullmatch(spaced) is None
    assert _outcome(compact) == _outcome(spaced) == _outcome(" " + compact + "\n")


def test_one_validation_for_records_built_and_parsed() -> None:
    # The parser's errors are the constructor's: both go through the same checks.
    fields: dict[str, Any] = {
        "ts": T0,
        "protocol": AuditProtocol.CONNECT,
        "host": "pypi.org",
        "port": 443,
        "decision": Verdict.ALLOW,
        "reason": Reason.ALLOWED,
    }
    for name, value in [("host", "a b"), ("port", 70000), ("protocol", "ftp"), ("reason", "x")]:
        with pytest.raises(InvalidRecordError) as built:
            AuditRecord(**{**fields, name: value})
        assert _outcome(_with(**{name: value})) == str(built.value)


def test_leading_spaces_and_a_blanked_tail_are_read_as_json_allows(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    text = line_of(make(port=1)) + "   " + line_of(make(port=2)) + "    "
    path.write_text(text)
    assert records_only(read_records(path)) == [make(port=1), make(port=2)]
    assert list(iter_records(text.splitlines(keepends=True))) == [make(port=1), make(port=2)]
    # A blank line or other trailing whitespace is still no record.
    assert [type(i) for i in iter_records(["\n", " \t"])] == [MalformedLine, MalformedLine]


# --------------------------------------------------------------------------- full disk: reserve


def reserve_of(path: Path) -> int:
    info = path.stat()
    return info.st_blocks * 512 - info.st_size


def test_space_is_reserved_ahead_of_the_end(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    with JsonlFileSink(path) as sink:
        sink.write(make())
        if not sink._reserving:
            pytest.skip("this file system has no fallocate(FALLOC_FL_KEEP_SIZE)")
        assert reserve_of(path) >= audit.DEFAULT_WRITERS * audit._CHECK_BYTES
        assert path.stat().st_size == len(line_of(make()))  # the size is the records'
    assert path.read_text() == line_of(make())


def test_the_reserve_is_looked_at_once_per_4_kib_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int]] = []
    real = audit._allocate
    real_fstat = os.fstat
    looks = [0]

    def counting_fstat(fd: int) -> os.stat_result:
        looks[0] += 1
        return real_fstat(fd)

    def spy(fd: int, offset: int, length: int) -> int:
        calls.append((offset, length))
        return real(fd, offset, length)

    monkeypatch.setattr(audit, "_allocate", spy)
    with JsonlFileSink(tmp_path / "audit.jsonl") as sink:
        monkeypatch.setattr(os, "fstat", counting_fstat)
        record = make()
        count = 10_000
        for _ in range(count):
            sink.write(record)
        monkeypatch.setattr(os, "fstat", real_fstat)
    written = count * len(line_of(record))
    assert looks[0] <= count // (audit._CHECK_BYTES // len(line_of(record))) + 1
    assert len(calls) <= written // (audit._RESERVE_CHUNK // 2) + 1


def test_no_room_for_the_reserve_means_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    monkeypatch.setattr(audit, "_allocate", lambda fd, offset, length: errno.ENOSPC)
    with JsonlFileSink(path) as sink:
        with pytest.raises(AuditError, match=r"cannot reserve .*No space left.*not written"):
            sink.write(make(port=1))
        assert path.read_bytes() == b""  # absent, not torn
        assert not sink.can_write()
        with pytest.raises(AuditError, match="No space left"):
            sink.write(make(port=2))  # asked again at every write until it works
        monkeypatch.setattr(audit, "_allocate", lambda fd, offset, length: 0)
        assert sink.can_write()  # space is back
        sink.write(make(port=3))
    assert path.read_text() == line_of(make(port=3))


def test_a_smaller_reserve_is_taken_when_the_chunk_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int] = []

    def tight(fd: int, offset: int, length: int) -> int:
        asked.append(length)
        return errno.ENOSPC if length > audit.DEFAULT_WRITERS * audit._CHECK_BYTES else 0

    monkeypatch.setattr(audit, "_allocate", tight)
    with JsonlFileSink(tmp_path / "audit.jsonl") as sink:
        sink.write(make())
    assert asked == [audit._RESERVE_CHUNK, audit.DEFAULT_WRITERS * audit._CHECK_BYTES]


def test_without_fallocate_the_sink_writes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "audit.jsonl"
    monkeypatch.setattr(audit, "_allocate", lambda fd, offset, length: errno.EOPNOTSUPP)
    with JsonlFileSink(path) as sink:
        sink.write(make(port=1))
        assert not sink._reserving
        assert sink.can_write()  # statvfs: this disk has room
        sink.write(make(port=2))
    assert records_only(read_records(path)) == [make(port=1), make(port=2)]


def test_rotation_reserves_no_further_than_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    size = len(line_of(make()))
    with JsonlFileSink(path, max_bytes=100 * size, keep=2) as sink:
        for _ in range(250):
            sink.write(make())
        if not sink._reserving:
            pytest.skip("this file system has no fallocate(FALLOC_FL_KEEP_SIZE)")
    rotated = Path(f"{path}.1")
    assert rotated.stat().st_size == 100 * size
    # What was reserved stops at max_bytes (rounded up to the file system's block).
    assert rotated.stat().st_blocks * 512 < 100 * size + 2 * audit._CHECK_BYTES
    assert len(records_only(read_records(rotated))) == 100


def test_writers_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="writers"):
        JsonlFileSink(tmp_path / "audit.jsonl", writers=0)


@pytest.mark.parametrize(
    ("tail", "after"),
    [("", ""), ('{"ts":"2026-', '{"ts":"2026-\n'), (" " * 30, " " * 30)],
)
def test_end_torn_tail_ends_a_fragment_and_leaves_a_blanked_one(
    tmp_path: Path, tail: str, after: str
) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_text(line_of(make()) + tail)
    audit.end_torn_tail(str(path))
    assert path.read_text() == line_of(make()) + after
    audit.end_torn_tail(str(tmp_path / "missing.jsonl"))  # best effort: no error
