"""Fuzz the audit log reader: one line into an AuditRecord (`AuditRecord.from_json`).

The bytes are a line of an audit log. Outcomes allowed: a record, or AuditError
(InvalidRecordError) for anything that breaks the six-key contract. Checked:

- the reader agrees with the contract read plainly (json.loads without duplicate
  keys, exactly the six keys, the record's own checks): its shortcut for the lines
  egressbox writes never takes a line that reading would refuse or read otherwise;
- a record writes back (`to_json`) as json.dumps would, reads back equal, and the
  proxy's own line builder (`decision_line`) writes the same text;
- split in two at the data's point, the pieces as two lines of a log (plain and
  gzip) read as each line does on its own, numbered, with a torn last line reported.
"""

from __future__ import annotations

import gzip
import io
import json
from datetime import UTC, datetime

import atheris

import harness

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.audit import record as audit
    from egressbox.core.errors import AuditError

harness.check_pure([audit])

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SOURCE = "fuzz.jsonl"


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _DuplicateKeyError
    return dict(pairs)


def strict(line: str) -> audit.AuditRecord | None:
    """The line by the contract alone: json.loads, the six keys, the record's checks."""
    try:
        data = json.loads(line, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or set(data) != set(audit.KEYS):
        return None
    try:
        return audit.AuditRecord(
            audit.parse_ts(data["ts"]),
            data["protocol"],
            data["host"],
            data["port"],
            data["decision"],
            data["reason"],
        )
    except AuditError:
        return None


def read(line: str) -> audit.AuditRecord | None:
    try:
        return audit.AuditRecord.from_json(line)
    except AuditError as exc:
        assert isinstance(exc, audit.InvalidRecordError), type(exc)
        return None


def check_record(record: audit.AuditRecord) -> None:
    line = record.to_json()
    assert line == json.dumps(record.to_dict(), ensure_ascii=True, separators=(",", ":"))
    assert audit.AuditRecord.from_json(line) == record
    assert audit.AuditRecord.from_json(line + "\n") == record
    assert strict(line) == record
    if record.ts >= _EPOCH:
        since = record.ts - _EPOCH
        now_ns = (since.days * 86400 + since.seconds) * 10**9 + since.microseconds * 1000
        fast = audit.decision_line(
            record.protocol, record.host, record.port, record.decision, record.reason, now_ns=now_ns
        )
        assert fast is None or fast == line, (fast, line)


def stream(blob: bytes) -> list[audit.AuditRecord | audit.MalformedLine]:
    return list(audit.read_stream(io.BufferedReader(io.BytesIO(blob)), _SOURCE))


def expected_lines(blob: bytes) -> list[audit.AuditRecord | audit.MalformedLine]:
    """What a reader must give for `blob`: one item per line, a torn tail reported."""
    items: list[audit.AuditRecord | audit.MalformedLine] = []
    lines = blob.split(b"\n")
    for number, raw in enumerate(lines[:-1], start=1):
        try:
            text = (raw + b"\n").decode("utf-8")
        except UnicodeDecodeError:
            items.append(audit.MalformedLine(_SOURCE, number, "utf-8"))
            continue
        record = read(text)
        items.append(record if record is not None else audit.MalformedLine(_SOURCE, number, ""))
    if lines[-1]:
        items.append(audit.MalformedLine(_SOURCE, len(lines), "torn"))
    return items


def same_lines(got: list[object], want: list[object], tail: bytes) -> bool:
    """`got` is `want`, but a last line of spaces only may be reported or not: a sink
    blanks a fragment with spaces, and a reader may skip such a tail as no record."""
    if got == want:
        return True
    return bool(tail) and not tail.strip(b" ") and got == want[:-1]


def _kinds(items: list[audit.AuditRecord | audit.MalformedLine]) -> list[object]:
    # Malformed lines compare by where they are; their message is for a person.
    return [
        (item.source, item.line_number) if isinstance(item, audit.MalformedLine) else item
        for item in items
    ]


def test_one_input(data: bytes) -> None:
    try:
        line = data.decode("utf-8")
    except UnicodeDecodeError:
        line = None
    if line is not None:
        record = read(line)
        assert strict(line) == record, (line, record)
        if record is not None:
            check_record(record)
    cut = harness.split_point(data)
    blob = data[:cut] + b"\n" + data[cut:]
    if blob.startswith(b"\x1f\x8b"):
        stream(blob)  # read as a (broken) gzip file: malformed lines, never an exception
        return
    want = _kinds(expected_lines(blob))
    tail = blob.rsplit(b"\n", 1)[-1]
    got = _kinds(stream(blob))
    assert same_lines(got, want, tail), (got, want)
    assert _kinds(stream(gzip.compress(blob, mtime=0))) == got


if __name__ == "__main__":
    harness.main(test_one_input)
