"""Audit records: the six-key JSON Lines contract, the sinks that write it, and a reader.

One record per decision, exactly ``ts, protocol, host, port, decision, reason`` in that
order (DESIGN.md section 6). Nothing else ever enters a record: the host guard below is a
last line of defence so that a caller bug cannot smuggle a path, header or credential in.

One serializer, one parser. ``record_line`` renders every line egressbox writes or prints
(``AuditRecord.to_json``, the proxy's ``decision_line``, ``egressbox audit --json``), byte
for byte what ``json.dumps`` makes of the six-key dict. ``parse_record`` reads every line
(``read_records``, ``follow_records``, ``iter_records``, and through them ``egressbox
audit``, its filters, summary and ``--suggest-policy``), with one validation: the checks
of ``AuditRecord`` itself.

Writers emit each record as ONE ``write(2)`` of a whole line on an ``O_APPEND`` descriptor.
The kernel appends it at the current end of file as a unit, so writers in several threads or
processes never interleave. A record is whole or absent, also when the disk fills up: see
``JsonlFileSink`` for how (space reserved ahead, and a fragment left by a short write blanked
in place). One case stays: Linux checks for a fatal signal between page-cache pages, so a
SIGKILL can cut a record that straddles a page boundary; the next sink opened on the file
starts with a newline, which keeps that fragment on a line of its own, reported by the reader.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import glob
import gzip
import json
import os
import re
import stat
import threading
import time
import unicodedata
import zlib
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from json.encoder import encode_basestring_ascii
from types import TracebackType
from typing import Any, Final, Protocol, Self, TypeVar

from egressbox.audit.sink import AuditSink
from egressbox.core.errors import AuditError, Reason, Verdict
from egressbox.core.limits import MAX_PORT
from egressbox.fs.held import HeldDir, SymlinkOnPathError

__all__ = [
    "DEFAULT_KEEP",
    "DEFAULT_WRITERS",
    "FOLLOW_POLL_SECONDS",
    "KEYS",
    "MAX_LINE_BYTES",
    "AuditProtocol",
    "AuditRecord",
    "AuditSink",
    "CallbackSink",
    "InvalidRecordError",
    "JsonlFileSink",
    "MalformedLine",
    "MemorySink",
    "RecordFilter",
    "StreamSink",
    "SummaryRow",
    "TeeSink",
    "decision_line",
    "end_torn_tail",
    "follow_records",
    "format_ts",
    "iter_records",
    "parse_record",
    "parse_ts",
    "read_records",
    "read_stream",
    "record_line",
    "rotated_files",
    "rotated_name",
    "rotation_index",
    "shift_rotated",
    "summarize",
]

# The contract: these keys, in this order, and no others.
KEYS: Final = ("ts", "protocol", "host", "port", "decision", "reason")

# DNS names are at most 253 bytes; 255 leaves room for bracketed IPv6 text.
MAX_HOST_CHARS: Final = 255

# Rotated files kept by default (audit.jsonl.1 .. audit.jsonl.5), as logrotate's common
# "rotate 5"; with --audit-max-bytes 100 MiB that bounds the log to about 600 MiB.
DEFAULT_KEEP: Final = 5

# The longest valid record is under 4 KiB (255 host characters, each escaped by ensure_ascii
# as a 12-byte surrogate pair, plus about 120 bytes for the rest), so anything longer is not a
# record; the limit bounds the reader's memory on a file that is not an audit log at all.
MAX_LINE_BYTES: Final = 64 * 1024

# Characters that never occur in a normalized host or IP text. Separators and controls would
# let a caller forge lines or fields; '/', '?', '#', '@' and '\\' are how a path, query,
# fragment or userinfo (a credential) would ride along if a raw URL were passed by mistake.
_FORBIDDEN_HOST_CHARS: Final = frozenset("/?#@\\")
_FORBIDDEN_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zs", "Zl", "Zp"})

# Hosts made only of these characters need neither escaping in JSON nor a closer look.
_PLAIN_HOST: Final = re.compile(r"[0-9A-Za-z._:-]{0,255}", re.ASCII)

_GZIP_MAGIC: Final = b"\x1f\x8b"
_SKIP_CHUNK: Final = 64 * 1024

_RFC3339: Final = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:[Zz]|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)
# The spelling record_line writes, which datetime.fromisoformat reads directly.
_RFC3339_WRITTEN: Final = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", re.ASCII)

_E = TypeVar("_E", bound=StrEnum)


class AuditProtocol(StrEnum):
    """The listener protocol a decision was made for."""

    HTTP = "http"
    CONNECT = "connect"
    SOCKS5 = "socks5"
    # `run` with capture: a connection the child made without the proxy, and a DNS question
    # the child asked egressbox's resolver in its namespace (port 0: a name has none).
    TCP = "tcp"
    DNS = "dns"


class InvalidRecordError(AuditError, ValueError):
    """A record (built in code or read from a line) that breaks the contract."""


def _show(value: object, limit: int = 40) -> str:
    """A short, escaped rendering of a bad value for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_X = TypeVar("_X", bound=BaseException)


def _chained(error: _X, cause: BaseException | None) -> _X:
    """``error`` with ``cause`` as its cause, as ``raise error from cause`` sets it.

    Compiled code drops a raise statement's ``from`` clause (mypyc does not compile it),
    so each ``raise ... from cause`` here goes through this as well: the cause is then the
    same compiled and interpreted, and None hides the context as ``from None`` does.
    """
    error.__cause__ = cause  # which also sets __suppress_context__, as `from` does
    return error


# --------------------------------------------------------------------------- the serializer


def format_ts(ts: datetime) -> str:
    """RFC 3339 UTC with milliseconds and 'Z', e.g. 2026-11-30T11:08:16.123Z."""
    # isoformat pads the year to four digits, which strftime("%Y") does not on glibc.
    utc = (ts if ts.tzinfo is UTC else ts.astimezone(UTC)).replace(tzinfo=None)
    return utc.isoformat(timespec="milliseconds") + "Z"


# The host guard's verdicts, cached: a normalized host that passed it -> its JSON string
# literal. A proxy meets the same few hundred names over and over; a lookup here replaces
# the guard's regular expression and the escaping. Bounded: cleared when full.
_HOST_CACHE_SIZE: Final = 4096
_host_json: Final[dict[str, str]] = {}


def record_line(
    protocol: AuditProtocol,
    host: str,
    port: int,
    decision: Verdict,
    reason: Reason,
    *,
    ts: str,
) -> str:
    """THE audit line, without its newline: every record egressbox writes or prints.

    Byte for byte ``json.dumps(six-key dict, ensure_ascii=True, separators=(",", ":"))``
    (a property test checks it for any host, escapes included): the enum values and
    ``ts`` (``format_ts`` text) need no escaping, and the host is escaped by the same C
    function json.dumps uses. It renders what it is given; ``AuditRecord`` and
    ``decision_line`` check the fields first.
    """
    return '{"ts":"%s","protocol":"%s","host":%s,"port":%d,"decision":"%s","reason":"%s"}' % (  # noqa: UP031 (measured: faster than an f-string here)
        ts,
        protocol,
        _host_json.get(host) or encode_basestring_ascii(host),
        port,
        decision,
        reason,
    )


# The last second whose text was built, and that text up to the seconds ("...T11:08:16"):
# the proxy writes many records per second, so the text is rebuilt once a second.
_FIRST_SECOND: Final = datetime.min.replace(tzinfo=UTC)
_last_second: Final[list[tuple[datetime, str]]] = [(_FIRST_SECOND, format_ts(_FIRST_SECOND)[:-5])]
# A ts's text after the seconds, by its millisecond (".000Z" ... ".999Z"): looked up, not
# formatted, per record.
_MS_SUFFIX: Final = tuple(f".{ms:03d}Z" for ms in range(1000))


def _record_ts(ts: datetime) -> str:
    """format_ts(ts) for a record's ts (UTC, whole milliseconds), reusing the second's text."""
    if ts.tzinfo is not UTC:
        return format_ts(ts)
    second = ts.replace(microsecond=0)
    last, text = _last_second[0]
    if second != last:
        text = format_ts(second)[:-5]  # drop ".000Z"
        _last_second[0] = (second, text)
    return text + _MS_SUFFIX[ts.microsecond // 1000]


# The same for decision_line's clock (Unix nanoseconds), cached per millisecond: the proxy
# stamps several records within one millisecond under load, and rebuilds the seconds text
# once a second; the millisecond digits come from a table (no formatting per record).
_NS_PER_MS: Final = 1_000_000


class _Stamp:
    """The last millisecond stamped (Unix ms) and its text, the last second and its text.

    Each pair is one tuple, replaced whole: a thread never sees one's number with
    another's text."""

    __slots__ = ("ms", "second")

    def __init__(self) -> None:
        self.ms: tuple[int, str] = (-1, "")
        self.second: tuple[int, str] = (-1, "")


_stamp: Final = _Stamp()


def _ns_ts(now_ns: int) -> str:
    """format_ts of the instant ``now_ns`` (Unix ns), milliseconds rounded down."""
    ms = now_ns // _NS_PER_MS
    last_ms, text = _stamp.ms
    if ms == last_ms:
        return text
    second, within = ms // 1000, ms % 1000  # compiled, two native operations; divmod is a call
    last_second, second_text = _stamp.second
    if second != last_second:
        second_text = format_ts(datetime.fromtimestamp(second, UTC))[:-5]  # no ".000Z"
        _stamp.second = (second, second_text)
    text = second_text + _MS_SUFFIX[within]
    _stamp.ms = (ms, text)
    return text


def decision_line(
    protocol: object,
    host: object,
    port: object,
    decision: object,
    reason: object,
    *,
    now_ns: int,
) -> str | None:
    """The line ``AuditRecord`` stamped at ``now_ns`` (Unix ns) would write, built directly.

    The proxy's fast path for a decision's fields: no record object, the same checks
    (enum members, port range, the host guard) and the same serializer, whose text after
    the timestamp is kept for the five values seen before (``_line_tails``: then neither
    guard nor formatting runs again). None when a field fails them: build an AuditRecord
    then, which says what is wrong. A test checks the two agree.
    """
    # The fields are typed object, as AuditRecord's are: compiled, a parameter typed
    # AuditProtocol would raise TypeError for the string "http" instead of returning None.
    if (
        type(protocol) is not AuditProtocol
        or type(decision) is not Verdict
        or type(reason) is not Reason
        or type(port) is not int
        or not 0 <= port <= MAX_PORT
        or type(host) is not str
    ):
        return None
    tail = _line_tails.get((host, port, protocol, decision, reason))
    if tail is None:
        if host not in _host_json and _host_problem(host) is not None:
            return None
        if len(_line_tails) >= _TAIL_CACHE_SIZE:
            return record_line(protocol, host, port, decision, reason, ts=_ns_ts(now_ns))
        tail = _line_tail(protocol, host, port, decision, reason)
    return f"{_TS_OPEN}{_ns_ts(now_ns)}{tail}"


# record_line's text after the timestamp, by the other five values: the proxy decides
# on the same destinations over and over, and a lookup replaces the formatting and the
# host guard (only a host that passed it has an entry). Keys hold exact types only (the
# members, an int, a str: decision_line checks them first). Bounded: once full, other
# values are formatted as without it (never cleared: more values than entries, visited
# in turn, would miss every time, and a miss that fills an entry costs a third more).
_TAIL_CACHE_SIZE: Final = 4096
_line_tails: Final[dict[tuple[str, int, AuditProtocol, Verdict, Reason], str]] = {}
# Where every line starts; the timestamp follows.
_TS_OPEN: Final = '{"ts":"'


def _line_tail(
    protocol: AuditProtocol, host: str, port: int, decision: Verdict, reason: Reason
) -> str:
    """record_line's text after the timestamp for these values, now cached."""
    tail = record_line(protocol, host, port, decision, reason, ts="")[len(_TS_OPEN) :]
    _line_tails[(host, port, protocol, decision, reason)] = tail
    return tail


# --------------------------------------------------------------------------- checks


def parse_ts(text: object) -> datetime:
    """Parse an RFC 3339 UTC timestamp ('Z' or a zero offset) into an aware datetime."""
    if not isinstance(text, str):
        raise InvalidRecordError(f"ts must be a string, got {type(text).__name__}")
    if _RFC3339_WRITTEN.fullmatch(text):
        return _written_ts(text)
    match = _RFC3339.fullmatch(text)
    if match is None:
        raise InvalidRecordError(f"ts {_show(text)} is not an RFC 3339 timestamp")
    year, month, day, hour, minute, second, fraction, sign, off_h, off_m = match.groups()
    if sign is not None and (off_h, off_m) != ("00", "00"):
        raise InvalidRecordError(f"ts {_show(text)} is not UTC (expected 'Z')")
    micros = int((fraction or "").ljust(6, "0")[:6])
    try:
        return datetime(
            int(year), int(month), int(day), int(hour), int(minute), int(second), micros, UTC
        )
    except ValueError as exc:
        raise _chained(
            InvalidRecordError(f"ts {_show(text)} is not a valid date and time: {exc}"), None
        ) from None


def _written_ts(text: str) -> datetime:
    """parse_ts for text in the spelling format_ts writes (checked by the caller)."""
    try:
        return datetime.fromisoformat(text)  # "...Z": tzinfo is UTC itself
    except ValueError as exc:
        raise _chained(
            InvalidRecordError(f"ts {_show(text)} is not a valid date and time: {exc}"), None
        ) from None


def _check_ts(value: object) -> datetime:
    if not isinstance(value, datetime):
        raise InvalidRecordError(f"ts must be a datetime, got {type(value).__name__}")
    if value.utcoffset() is None:
        raise InvalidRecordError("ts must be timezone-aware (UTC)")
    try:
        utc = value.astimezone(UTC)
    except OverflowError as exc:
        raise _chained(InvalidRecordError(f"ts {value} cannot be expressed in UTC"), exc) from exc
    # The line carries milliseconds; truncating here makes a record equal its re-read self.
    return utc.replace(microsecond=utc.microsecond // 1000 * 1000)


def _forbidden_in_host(char: str) -> bool:
    return (
        char in _FORBIDDEN_HOST_CHARS
        or char.isspace()
        or unicodedata.category(char) in _FORBIDDEN_CATEGORIES
    )


def _host_problem(value: object) -> str | None:
    """The host guard: what is wrong with ``value`` as a record's host, or None.

    A host that passes is cached with its JSON text (see ``_host_json``).
    """
    if not isinstance(value, str):
        return f"host must be a string, got {type(value).__name__}"
    if len(value) > MAX_HOST_CHARS:
        return f"host is {len(value)} characters long (max {MAX_HOST_CHARS})"
    if not _PLAIN_HOST.fullmatch(value):  # else the usual normalized name or IP text
        for index, char in enumerate(value):
            if _forbidden_in_host(char):
                return (
                    f"host {_show(value)} has forbidden character {char!r} at index {index}: "
                    "audit hosts must be normalized names or IP text"
                )
    if type(value) is str:
        if len(_host_json) >= _HOST_CACHE_SIZE:
            _host_json.clear()
        _host_json[value] = encode_basestring_ascii(value)
    return None


def _check_host(value: object) -> None:
    if type(value) is str and value in _host_json:
        return
    problem = _host_problem(value)
    if problem is not None:
        raise InvalidRecordError(problem)


def _check_port(value: object) -> None:
    # bool is an int subclass; True is not a port.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRecordError(f"port must be an integer, got {type(value).__name__}")
    if not 0 <= value <= MAX_PORT:
        raise InvalidRecordError(f"port {value} is out of range 0..{MAX_PORT}")


_PROTOCOLS: Final = {member.value: member for member in AuditProtocol}
_VERDICTS: Final = {member.value: member for member in Verdict}
_REASONS: Final = {member.value: member for member in Reason}


def _coerce(kind: type[_E], members: Mapping[str, _E], value: object, name: str) -> _E:
    if type(value) is kind:  # already a member (the proxy's case): kind(value) is value
        return value
    if not isinstance(value, str):
        raise InvalidRecordError(f"{name} must be a string, got {type(value).__name__}")
    member = members.get(value)
    if member is None:
        choices = ", ".join(member.value for member in kind)
        raise InvalidRecordError(f"{name} {_show(value)} is not one of: {choices}")
    return member


_Fields = tuple[datetime, AuditProtocol, str, int, Verdict, Reason]


def _validated(  # noqa: PLR0917 - the six values of the contract, in its order
    ts: object, protocol: object, host: object, port: object, decision: object, reason: object
) -> _Fields:
    """THE validation of a record's six values, built in code or parsed: normalized values,
    or InvalidRecordError saying what is wrong. Checks in contract order.

    Each check starts with the usual case inline (a member, a plain str found in the
    table, a host the guard passed before), which a record costs on the proxy's and the
    reader's hot paths; anything else goes to the full check that explains the problem.
    """
    if type(ts) is not datetime or ts.tzinfo is not UTC or ts.microsecond % 1000:
        ts = _check_ts(ts)  # else already UTC in whole milliseconds (clock and parser)
    if type(protocol) is not AuditProtocol:
        protocol = (type(protocol) is str and _PROTOCOLS.get(protocol)) or _coerce(
            AuditProtocol, _PROTOCOLS, protocol, "protocol"
        )
    if type(host) is not str or host not in _host_json:
        _check_host(host)
    if type(port) is not int or not 0 <= port <= MAX_PORT:
        _check_port(port)
    if type(decision) is not Verdict:
        decision = (type(decision) is str and _VERDICTS.get(decision)) or _coerce(
            Verdict, _VERDICTS, decision, "decision"
        )
    if type(reason) is not Reason:
        reason = (type(reason) is str and _REASONS.get(reason)) or _coerce(
            Reason, _REASONS, reason, "reason"
        )
    return ts, protocol, host, port, decision, reason  # type: ignore[return-value]


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True, init=False)
class AuditRecord:
    """One decision. Fields are validated (and enum strings coerced) on construction."""

    ts: datetime
    protocol: AuditProtocol
    host: str
    port: int
    decision: Verdict
    reason: Reason

    def __init__(  # noqa: PLR0917 - the dataclass's own signature, fields in order
        self,
        ts: object,
        protocol: object,
        host: object,
        port: object,
        decision: object,
        reason: object,
    ) -> None:
        # Written out, and taking any values: compiled, the generated __init__'s typed
        # parameters would refuse a protocol given as its string (coerced here) and report a
        # bad value as TypeError, not InvalidRecordError. Frozen: the normalized values go in
        # through object.__setattr__, once, here (compiled, one store into the object each).
        fields = _validated(ts, protocol, host, port, decision, reason)
        object.__setattr__(self, "ts", fields[0])
        object.__setattr__(self, "protocol", fields[1])
        object.__setattr__(self, "host", fields[2])
        object.__setattr__(self, "port", fields[3])
        object.__setattr__(self, "decision", fields[4])
        object.__setattr__(self, "reason", fields[5])

    def __reduce__(self) -> tuple[type[AuditRecord], _Fields]:
        # Copied and pickled as its values, remade by __init__: compiled, the default way
        # (an empty object, then each field set) fails on a frozen class. So for every
        # frozen class here.
        return AuditRecord, (
            self.ts,
            self.protocol,
            self.host,
            self.port,
            self.decision,
            self.reason,
        )

    @classmethod
    def create(
        cls,
        protocol: object,
        host: object,
        port: object,
        decision: object,
        reason: object,
        *,
        now: Callable[[], datetime] | None = None,
    ) -> AuditRecord:
        """A record stamped with the current UTC time (``now`` is the clock seam for tests)."""
        # Any values, as __init__ takes them (compiled, a parameter typed int would turn
        # True into 1 before the port check could refuse it).
        clock = _utc_now if now is None else now
        return cls(clock(), protocol, host, port, decision, reason)

    def to_dict(self) -> dict[str, str | int]:
        """The record as JSON-ready values, keys in contract order."""
        return {
            "ts": format_ts(self.ts),
            "protocol": self.protocol.value,
            "host": self.host,
            "port": self.port,
            "decision": self.decision.value,
            "reason": self.reason.value,
        }

    def to_json(self) -> str:
        """The record's line (``record_line``): compact, ASCII-only, no trailing newline."""
        return record_line(
            self.protocol, self.host, self.port, self.decision, self.reason, ts=_record_ts(self.ts)
        )

    @classmethod
    def from_json(cls, line: str) -> AuditRecord:
        """``parse_record(line)``: raises InvalidRecordError (an AuditError) on any flaw."""
        return parse_record(line)


# --------------------------------------------------------------------------- the parser

# A lexer for the lines record_line writes, and for any line of the same shape: the six
# keys in contract order, strings without escapes, an integer port, no spaces. For a line
# it matches, its groups are exactly the values json.loads would give (JSON strings hold no
# raw '"', '\\' or control character; a bounded integer literal is an int), so it only
# saves the time of json.loads; every other line goes to json.loads. Either way the values
# then meet the same validation, AuditRecord's. A property test checks the equivalence.
_STRING: Final = r'"([^"\\\x00-\x1f]*)"'
_LINE_SHAPE: Final = re.compile(
    r'\{"ts":"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)",'  # format_ts's spelling
    rf'"protocol":{_STRING},"host":{_STRING},'
    rf'"port":(-?(?:0|[1-9][0-9]{{0,17}})),"decision":{_STRING},"reason":{_STRING}\}}\n?',
    re.ASCII,  # \d is [0-9], as in JSON; the negated classes still take any other character
)


class _DuplicateKeyError(ValueError):
    pass


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last of two equal keys; a record must not be ambiguous.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(f"duplicate key {_show(key)}")
        result[key] = value
    return result


def _load_object(line: str) -> dict[str, Any]:
    try:
        data = json.loads(line, object_pairs_hook=_reject_duplicates)
    except _DuplicateKeyError as duplicate:  # its own name: compiled, a name has one type
        raise _chained(InvalidRecordError(str(duplicate)), None) from None
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and over-long integer literals.
        raise _chained(InvalidRecordError(f"not valid JSON: {exc}"), None) from None
    if not isinstance(data, dict):
        raise InvalidRecordError(f"expected a JSON object, got {type(data).__name__}")
    return data


def _check_keys(data: Mapping[str, Any]) -> None:
    missing = [key for key in KEYS if key not in data]
    extra = [key for key in data if key not in KEYS]
    problems = []
    if missing:
        problems.append("missing keys: " + ", ".join(missing))
    if extra:
        problems.append("unexpected keys: " + ", ".join(_show(key) for key in extra[:5]))
    if problems:
        raise InvalidRecordError("; ".join(problems))


def parse_record(line: str) -> AuditRecord:
    """THE parser: one line (its newline optional) into a validated record.

    Exactly the six keys, each value of its type and known values for protocol, decision
    and reason, a normalized host, a port in range, an RFC 3339 UTC ts; anything else
    raises InvalidRecordError (an AuditError and a ValueError) saying what is wrong.
    Whitespace around the object is JSON's and allowed (a blanked fragment leaves spaces
    before the next record; see JsonlFileSink).
    """
    match = _LINE_SHAPE.fullmatch(line)
    if match is not None:
        ts, protocol, host, port, decision, reason = match.groups()
        return AuditRecord(_written_ts(ts), protocol, host, int(port), decision, reason)
    # Any other spelling of an object: json.loads reads it.
    data = _load_object(line)
    _check_keys(data)
    return AuditRecord(
        parse_ts(data["ts"]),
        data["protocol"],
        data["host"],
        data["port"],
        data["decision"],
        data["reason"],
    )


# --------------------------------------------------------------------------- sinks

# Every sink here is an AuditSink, the protocol (imported above) that isinstance() checks:
# it lives in egressbox.audit.sink, interpreted, because compiled it could not be checked.


class _FdSink:
    """Writes each record as one write(2) of a whole line to a descriptor."""

    def __init__(self, fd: int, name: str, *, owns_fd: bool) -> None:
        self._fd: int | None = fd
        self._name = name
        self._owns_fd = owns_fd
        # True when the descriptor's stream may end in a fragment: the next line starts with
        # a newline so that the fragment cannot swallow it. Threads racing on this flag cost
        # at most one blank line, never a record.
        self._torn = False

    def fileno(self) -> int:
        if self._fd is None:
            raise AuditError(f"audit sink {self._name} is closed")
        return self._fd

    def write(self, record: AuditRecord) -> None:
        self.write_json(record.to_json())

    def write_json(self, text: str) -> None:
        """Write one record given as its line (``record.to_json()`` or decision_line())."""
        self._write_line(text.encode("ascii"))

    def _write_line(self, line: bytes) -> None:
        fd = self.fileno()
        data = (b"\n" if self._torn else b"") + line + b"\n"
        try:
            written = os.write(fd, data)
        except OSError as exc:
            raise _chained(
                AuditError(f"cannot write audit record to {self._name}: {exc}"), exc
            ) from exc
        if written != len(data):
            self._torn = not _end_line(fd)
            raise _short_write(self._name, written, len(data))
        self._torn = False

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None or not self._owns_fd:
            return
        try:
            os.close(fd)
        except OSError as exc:
            # close() can report a deferred write error (NFS); records may be lost.
            raise _chained(
                AuditError(f"closing audit log {self._name} failed: {exc}"), exc
            ) from exc

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _short_write(name: str, written: int, size: int) -> AuditError:
    return AuditError(
        f"short write of audit record to {name}: {written} of {size} bytes "
        "(disk full, file size limit or an interrupted terminal write)"
    )


def _end_line(fd: int) -> bool:
    """Best effort: terminate a fragment left by a short write. True if it worked."""
    try:
        return os.write(fd, b"\n") == 1
    except OSError:
        return False


_FILE_KINDS: Final = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


_SYMLINK_WHY: Final = (
    "is a symbolic link; refusing to follow it (O_NOFOLLOW) so that a planted link "
    "cannot redirect the audit log"
)


def _refuse_special(path: str, mode: int) -> None:
    if stat.S_ISLNK(mode):
        raise AuditError(f"audit log {path} {_SYMLINK_WHY}")
    if not stat.S_ISREG(mode):
        raise AuditError(f"audit log {path} is {_kind(mode)}; it must be a regular file")


def _hold_directory(path: str) -> tuple[HeldDir, str]:
    """The log's directory, held from now on (egressbox.fs.held), and the log's file name.

    Opened before any child runs: a directory on the way that a child replaces with a
    symbolic link later cannot move the log, its rotations or a reopen elsewhere.
    """
    folder, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise AuditError(f"audit log {path} names a directory; it must name a file")
    try:
        return HeldDir.open(folder or "."), name
    except OSError as exc:
        # SymlinkOnPathError's text names the component; other errors' strerror suffices.
        why = str(exc) if isinstance(exc, SymlinkOnPathError) else exc.strerror
        where = folder or "."
        raise _chained(
            AuditError(f"audit log {path} cannot be opened: its directory {where}: {why}"), exc
        ) from exc


def _open_append(folder: HeldDir, name: str, path: str, mode: int) -> tuple[int, os.stat_result]:
    """Open (creating) a regular file for appending, refusing links and special files."""
    # lstat first so that a device or FIFO is refused without opening it (opening some
    # devices has side effects); the fstat below is the check that cannot race.
    try:
        _refuse_special(path, folder.lstat(name).st_mode)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise _chained(AuditError(f"cannot open audit log {path}: {exc.strerror}"), exc) from exc
    # Relative to the held directory, and O_NOFOLLOW on the name itself: no link anywhere on
    # the way. O_NONBLOCK keeps a FIFO swapped in after the lstat from blocking the open;
    # O_NOCTTY keeps a terminal from becoming our controlling one.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = folder.open_file(name, flags, mode)
    except OSError as exc:
        raise _chained(_describe_open_error(path, exc), exc) from exc
    try:
        info = os.fstat(fd)
        _refuse_special(path, info.st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


def _describe_open_error(path: str, exc: OSError) -> AuditError:
    reasons = {
        errno.ELOOP: _SYMLINK_WHY,
        errno.ENXIO: "is a FIFO or socket; it must be a regular file",
        errno.EISDIR: "is a directory; it must be a regular file",
    }
    why = reasons.get(exc.errno or 0, f"cannot be opened: {exc.strerror}")
    return AuditError(f"audit log {path} {why}")


# How much of a file's end is read to tell a fragment from a blanked one.
_TAIL_PEEK: Final = 8192


def _ends_in_fragment(folder: HeldDir, name: str, info: os.stat_result) -> bool:
    """True if the existing file ends in part of a line (a writer died mid-record).

    Spaces after the last newline are a blanked fragment (see JsonlFileSink): the next
    record may follow them on the same line.
    """
    if info.st_size == 0:
        return False
    try:
        fd = folder.open_file(name, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False  # unreadable (write-only permissions): skip the repair, not the log
    try:
        again = os.fstat(fd)
        if (again.st_dev, again.st_ino) != (info.st_dev, info.st_ino):
            return False  # the path was replaced meanwhile; it is not our file
        peek = min(info.st_size, _TAIL_PEEK)
        tail = os.pread(fd, peek, info.st_size - peek).rpartition(b"\n")[2]
        return tail.strip(b" ") != b""
    except OSError:
        return False
    finally:
        os.close(fd)


def end_torn_tail(path: str) -> None:
    """Append a newline to a log whose last record a crash cut short (best effort).

    For a process about to start several writers (``serve --workers``): done once, before
    any of them opens the file. A blanked tail (spaces) is no fragment and stays as it is.
    """
    with contextlib.suppress(OSError, AuditError):
        folder, name = _hold_directory(path)
        with folder:
            fd = folder.open_file(name, os.O_WRONLY | os.O_APPEND)
            try:
                if _ends_in_fragment(folder, name, os.fstat(fd)):
                    os.write(fd, b"\n")
            finally:
                os.close(fd)


# ---- space reserved ahead of the end of the log

# Writers a file sink's reserve is sized for by default: every `serve --workers N` up to 64
# (each worker has its own sink on the file), and then some.
DEFAULT_WRITERS: Final = 64
# A sink looks at the reserve before a write that takes its own bytes since the last look
# past this: more than the longest valid record, so a look per record is never needed.
_CHECK_BYTES: Final = 4096
# Reserved at a time when the reserve runs low (at least twice the margin).
_RESERVE_CHUNK: Final = 1 << 20
_FALLOC_FL_KEEP_SIZE: Final = 0x01
# fallocate errors that mean "not here" (the file system or the kernel cannot): reserving
# is then given up for that file, and a short write's fragment is blanked instead.
_UNSUPPORTED: Final = frozenset(
    {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.EPERM, errno.EACCES}
)
_NO_ROOM: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

Allocate = Callable[[int, int, int], int]


@functools.cache
def _libc_fallocate() -> Allocate | None:
    """fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, length) -> 0 or an errno; None if absent."""
    try:
        import ctypes  # here: only a file sink needs it, and it costs ~2 ms to import
    except ImportError:  # pragma: no cover - every CPython build we run has it
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None  # not Linux (or no libc symbol): no reserve, the blanking still holds
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    call.restype = ctypes.c_int

    def allocate(fd: int, offset: int, length: int) -> int:
        for _ in range(3):  # ctypes does not retry EINTR the way the os module does
            if call(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
                return 0
            code = ctypes.get_errno()
            if code != errno.EINTR:
                return code
        return errno.EINTR

    return allocate


def _fallocate(fd: int, offset: int, length: int) -> int:
    """Reserve ``length`` bytes from ``offset`` without changing the size: 0 or an errno."""
    call = _libc_fallocate()
    return errno.ENOSYS if call is None else call(fd, offset, length)


# A module-level seam: tests replace it to run a sink as on a file system without
# fallocate. A variable, not the def itself, so that compiled callers look it up at each
# call as interpreted ones do (a call per ~0.75 MiB written).
_allocate: Allocate = _fallocate


def _blank_in_place(fd: int, fragment: bytes, offset: int) -> bool:
    """Overwrite ``fragment`` at ``offset`` in fd's file with as many spaces; True if done.

    Through a second, non-appending descriptor on the same file (pwrite on an O_APPEND
    descriptor appends), after checking that those bytes are the fragment indeed. Only the
    fragment's own bytes are touched, whatever other writers appended after it, and an
    overwrite in place needs no new block (on a copy-on-write file system it may; then it
    fails and the caller falls back to a newline).
    """
    try:
        other = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False  # no /proc, or the file is not readable: no way to check the bytes
    try:
        if not _same_inode(os.fstat(fd), os.fstat(other)):
            return False
        if os.pread(other, len(fragment), offset) != fragment:
            return False
        return os.pwrite(other, b" " * len(fragment), offset) == len(fragment)
    except OSError:
        return False
    finally:
        os.close(other)


# A seam as _allocate is (tests make it fail, or let another writer append first); called
# after a short write only.
_blank: Callable[[int, bytes, int], bool] = _blank_in_place


class JsonlFileSink(_FdSink):
    """Appends records to a regular file (created with ``mode``) as JSON Lines.

    Safe to share between threads, and between processes that each open the same path.

    Whole or absent, also on a full disk. Two mechanisms, the first one the rule:

    1. Space reserved ahead. The sink keeps blocks allocated beyond the end of the file
       (``fallocate(FALLOC_FL_KEEP_SIZE)``: the size stays, the blocks are the file's), so
       that an appended record lands in blocks that exist and a write never runs out of
       space half-way. Before a write that takes its own bytes since its last look past
       4 KiB (more than any record), the sink looks (``fstat``: ``st_blocks * 512 -
       st_size``) and, when the reserve is under ``writers * 4 KiB``, allocates 1 MiB more
       (at least twice that margin). Every writer does the same, so between two looks by
       anyone at most ``writers * 4 KiB`` is appended: the reserve covers it for up to
       ``writers`` processes. When the reserve cannot be made (ENOSPC, EDQUOT), the record
       is not written at all and write() raises AuditError: the record is absent, and
       the proxy refuses (and asks ``can_write()`` again now and then to recover). The
       cost is one ``fstat`` per 4 KiB written and one ``fallocate`` per ~0.75 MiB.
       With ``max_bytes`` the reserve stops at ``max_bytes``: the file rotates before
       it would grow past it, so nothing is left reserved in a rotated file. This holds
       where writing into allocated blocks needs no new ones: tmpfs, ext4, XFS; on a
       copy-on-write file system (btrfs) metadata may still run out, and 2. applies.
    2. A fragment blanked in place. Where space cannot be reserved (no fallocate: some
       network and FUSE file systems), or a write is cut short anyway (RLIMIT_FSIZE, more
       writers than ``writers``), a short write's bytes are overwritten with spaces at the
       offset where they landed (the descriptor's offset after an O_APPEND write is the end
       of that write, and the bytes are compared before they are overwritten). Only those
       bytes are touched: whatever another process appended after them stays. The spaces
       become leading whitespace of the next record on that line, which JSON allows and
       the reader accepts; spaces at the very end of the file are no record and no tear.
       Only if that overwrite fails (no /proc, a copy-on-write file system still full) is
       the fragment ended by the next write's leading newline: a malformed line, reported
       by the reader, never a record glued to another.

    The fragment is not cut off with ftruncate, though it could look safe when the file's
    size shows nobody appended after it: between that fstat and the ftruncate another
    process may append a whole record (space freed meanwhile), which the ftruncate would
    then destroy after its writer was told it was written.

    Rotation (``max_bytes``): before a write that would take the file past ``max_bytes``,
    ``audit.jsonl`` becomes ``audit.jsonl.1`` (``.1`` becomes ``.2`` and so on, ``.gz``
    copies left by an external compressor included; the oldest beyond ``keep`` is deleted)
    and a fresh file is opened. A record always goes whole into one file, and is never
    dropped: a failed rotation raises AuditError before anything is written. A record
    longer than ``max_bytes`` gets a file of its own. Only the one process that owns the log
    may rotate it: another process appending to the same path would keep writing into the
    renamed file.

    The log's directory is resolved and held when the sink is made (egressbox.fs.held): the
    file, its rotations and every reopen are opened relative to that descriptor, never
    through a symbolic link, so a directory on the way replaced later (by a confined child
    that can write beside it) cannot send a record, or a rotated file, anywhere else.

    ``reopen()`` is for an external logrotate: after it has renamed the file, a signal
    handler calls ``reopen()`` and the sink continues in a new file at the same path (the
    old file keeps its unused reserve, at most 1 MiB, until it is compressed or removed:
    other workers may still append to it). Writes, rotation and reopen hold one lock, so no
    thread writes to a closed descriptor; call reopen() from an event loop
    (``loop.add_signal_handler``) or another thread, never from a ``signal.signal``
    handler that may interrupt a write in the same thread.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: int = 0o600,
        max_bytes: int | None = None,
        keep: int = DEFAULT_KEEP,
        writers: int = DEFAULT_WRITERS,
    ) -> None:
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {max_bytes}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1 rotated file, got {keep}")
        if writers < 1:
            raise ValueError(f"writers must be at least 1, got {writers}")
        self.path = os.fspath(path)
        self.max_bytes = max_bytes
        self.keep = keep
        self._mode = mode
        self._lock = threading.Lock()
        self._margin = writers * _CHECK_BYTES
        self._chunk = max(_RESERVE_CHUNK, 2 * self._margin)
        self._reserving = True  # until fallocate says this file system cannot
        # Held for the sink's life: writes, rotations and reopens stay in this directory.
        self._dir, self._file = _hold_directory(self.path)
        try:
            fd, info = _open_append(self._dir, self._file, self.path, mode)
        except BaseException:
            self._dir.close()
            raise
        super().__init__(fd, self.path, owns_fd=True)
        self._torn = _ends_in_fragment(self._dir, self._file, info)
        self._size = info.st_size
        self._unchecked = _CHECK_BYTES  # bytes written since the last look at the reserve

    def write(self, record: AuditRecord) -> None:
        self.write_json(record.to_json())

    def write_json(self, text: str) -> None:
        data = (text + "\n").encode("ascii")
        with self._lock:
            if self.max_bytes is not None:
                # The line, its newline, and the newline that ends a torn tail, if any.
                self._rotate_if_full(len(data) + self._torn)
            size = len(data) + self._torn
            if self._unchecked + size > _CHECK_BYTES:
                failed = self._reserve()
                if failed is not None:
                    raise _chained(
                        AuditError(
                            f"cannot write audit record to {self.path}: cannot reserve space "
                            f"ahead of its end ({failed}); the record was not written"
                        ),
                        failed,
                    ) from failed
            self._unchecked += size
            self._size += size
            self._write_data(data)

    def can_write(self) -> bool:
        """True if a record would find room now (for a writer refusing after a failure).

        Makes the reserve where the file system can; elsewhere asks statvfs for free
        space and RLIMIT_FSIZE for room. Never writes.
        """
        with self._lock:
            if self._fd is None:
                return False
            if self._reserving:
                return self._reserve() is None
            return self._room_without_reserve()

    def reopen(self) -> None:
        """Open ``path`` anew (after an external rename); on failure keep the old file."""
        with self._lock:
            self._swap()

    def rotate(self) -> None:
        """Rotate now, whatever the size (``max_bytes`` need not be set)."""
        with self._lock:
            self._rotate()

    def close(self) -> None:
        with self._lock:
            try:
                super().close()
            finally:
                self._dir.close()

    def _write_line(self, line: bytes) -> None:
        self._write_data(line + b"\n")

    def _write_data(self, data: bytes) -> None:
        """One write(2) of a line and its newline; a short write's fragment is blanked."""
        fd = self._fd
        if fd is None:
            raise AuditError(f"audit sink {self.path} is closed")
        lead = self._torn  # the first byte then ends a fragment before us: keep it
        if lead:
            data = b"\n" + data
        try:
            written = os.write(fd, data)
        except OSError as exc:
            raise _chained(
                AuditError(f"cannot write audit record to {self.path}: {exc}"), exc
            ) from exc
        if written != len(data):
            self._torn = not self._blank_short_write(fd, data[:written], lead)
            raise _short_write(self.path, written, len(data))
        self._torn = False

    def _blank_short_write(self, fd: int, landed: bytes, lead: bool) -> bool:
        """Blank the part of a record a short write left; True if no fragment remains."""
        try:
            end = os.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND: the end of what just landed
        except OSError:
            return False
        start = end - len(landed) + lead
        fragment = landed[lead:]
        return not fragment or _blank(fd, fragment, start)

    def _reserve(self) -> OSError | None:
        """Make sure the space the next records need is allocated; None, or what failed."""
        if not self._reserving:
            self._unchecked = 0
            return None
        fd = self.fileno()
        try:
            info = os.fstat(fd)
        except OSError as exc:
            return exc
        needed, length = self._margin, self._chunk
        if self.max_bytes is not None:
            # The file rotates before it grows past max_bytes: reserve up to there only.
            room = max(self.max_bytes - info.st_size, _CHECK_BYTES)
            needed, length = min(needed, room), min(length, room)
        if info.st_blocks * 512 - info.st_size >= needed:
            self._unchecked = 0
            return None
        code = _allocate(fd, info.st_size, length)
        if code in _NO_ROOM and length > needed:
            code = _allocate(fd, info.st_size, needed)  # what is left may still do
        if code == 0:
            self._unchecked = 0
            return None
        if code in _UNSUPPORTED:
            self._reserving = False  # blanking a short write's fragment still holds
            self._unchecked = 0
            return None
        return OSError(code, f"{os.strerror(code)}: {needed} bytes")

    def _room_without_reserve(self) -> bool:
        import resource  # the slow path of a failed log only

        try:
            fs = os.fstatvfs(self.fileno())
        except OSError:
            return False
        if fs.f_bavail * fs.f_frsize < self._margin:
            return False
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        return soft == resource.RLIM_INFINITY or self._size + _CHECK_BYTES <= soft

    def _rotate_if_full(self, needed: int) -> None:
        # The size is counted here, and asked of the kernel (fstat) only when the count
        # says the file is full: another writer's appends make the count low, never high.
        assert self.max_bytes is not None
        if self._size + needed <= self.max_bytes:
            return
        try:
            self._size = os.fstat(self.fileno()).st_size
        except OSError as exc:
            raise _chained(
                AuditError(f"cannot check the size of audit log {self.path}: {exc}"), exc
            ) from exc
        if self._size > 0 and self._size + needed > self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        fd = self.fileno()
        try:
            if _same_file(self._dir, self._file, fd):
                _shift_rotated_in(self._dir, self._file, self.keep)
        except OSError as exc:
            raise _chained(AuditError(f"cannot rotate audit log {self.path}: {exc}"), exc) from exc
        # If the path no longer names our file, someone else rotated it: just reopen.
        self._swap()

    def _swap(self) -> None:
        fd, info = _open_append(self._dir, self._file, self.path, self._mode)
        old, self._fd = self._fd, fd
        self._torn = _ends_in_fragment(self._dir, self._file, info)
        self._size = info.st_size
        self._unchecked = _CHECK_BYTES  # a new file: look at its reserve before writing
        if old is not None:
            with contextlib.suppress(OSError):
                os.close(old)


def _same_file(folder: HeldDir, name: str, fd: int) -> bool:
    try:
        named = folder.lstat(name)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


def rotated_name(path: str, index: int, *, compressed: bool = False) -> str:
    """``audit.jsonl`` -> ``audit.jsonl.3`` (or ``audit.jsonl.3.gz``)."""
    return f"{path}.{index}" + (".gz" if compressed else "")


def shift_rotated(path: str, keep: int) -> None:
    """Rename ``path`` to ``path.1`` after shifting ``.N[.gz]`` to ``.N+1``; drop ``.keep``.

    Each step is one rename, so a crash part-way leaves a gap in the numbers, never a lost
    or half-copied file. Raises OSError.
    """
    folder, name = os.path.split(path)
    with HeldDir.open(folder or ".") as held:
        _shift_rotated_in(held, name, keep)


def _shift_rotated_in(folder: HeldDir, name: str, keep: int) -> None:
    """shift_rotated() within a held directory: no rename ever leaves it."""
    for compressed in (False, True):
        with contextlib.suppress(FileNotFoundError):
            folder.unlink(rotated_name(name, keep, compressed=compressed))
    for index in range(keep - 1, 0, -1):
        for compressed in (False, True):
            with contextlib.suppress(FileNotFoundError):
                folder.replace(
                    rotated_name(name, index, compressed=compressed),
                    rotated_name(name, index + 1, compressed=compressed),
                )
    folder.replace(name, rotated_name(name, 1))


_ROTATED_SUFFIX: Final = re.compile(r"\.([1-9][0-9]{0,5})(\.gz)?", re.ASCII)


def rotation_index(path: str, base: str) -> int | None:
    """0 for ``base`` itself, N for ``base.N`` or ``base.N.gz``, None for anything else."""
    if path == base:
        return 0
    if not path.startswith(base):
        return None
    match = _ROTATED_SUFFIX.fullmatch(path, len(base))
    return int(match.group(1)) if match else None


def rotated_files(path: str | os.PathLike[str]) -> list[str]:
    """``path`` and its rotated siblings that exist, oldest first (``.N.gz`` ... ``.1``, base)."""
    base = os.fspath(path)
    found: list[tuple[int, str]] = []
    for candidate in [*glob.glob(glob.escape(base) + ".*"), base]:
        index = rotation_index(candidate, base)
        if index is not None and os.path.isfile(candidate):
            found.append((index, candidate))
    # .N and .N.gz both present (a compressor mid-run): keep the order stable, plain first.
    found.sort(key=lambda item: (-item[0], item[1].endswith(".gz")))
    return [name for _, name in found]


class StreamSink(_FdSink):
    """Writes records to an inherited descriptor such as stdout (fd 1); never closes it.

    Each line is one write(2). On a pipe, POSIX makes writes of at most PIPE_BUF bytes
    (4096 on Linux) atomic, and every valid record is shorter than that, so readers of the
    pipe never see interleaved records either: a blocking pipe takes such a line whole, and
    a non-blocking one refuses it whole (EAGAIN). Any failure or short write (a terminal
    interrupted by a signal) is raised as AuditError, never retried as a second write.
    """

    def __init__(self, fd: int) -> None:
        super().__init__(fd, f"fd {fd}", owns_fd=False)


class _ClosableSink:
    def __init__(self) -> None:
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise AuditError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        self._closed = True


class CallbackSink(_ClosableSink):
    """Hands each record to a function; anything it raises becomes an AuditError."""

    def __init__(self, callback: Callable[[AuditRecord], object]) -> None:
        super().__init__()
        self._callback = callback

    def write(self, record: AuditRecord) -> None:
        self._check_open()
        try:
            self._callback(record)
        except AuditError:
            raise
        except Exception as exc:
            raise _chained(AuditError(f"audit callback failed: {exc!r}"), exc) from exc


class MemorySink(_ClosableSink):
    """Keeps records in ``self.records`` (for ``run`` results and tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[AuditRecord] = []

    def write(self, record: AuditRecord) -> None:
        self._check_open()
        self.records.append(record)


class TeeSink:
    """Writes to every sink; if any fails, the others are still tried, then AuditError."""

    def __init__(self, *sinks: AuditSink) -> None:
        self.sinks = sinks

    def write(self, record: AuditRecord) -> None:
        self._each(lambda sink: sink.write(record), "write")

    def close(self) -> None:
        self._each(lambda sink: sink.close(), "close")

    def _each(self, action: Callable[[AuditSink], None], verb: str) -> None:
        failures: list[Exception] = []
        for sink in self.sinks:
            try:
                action(sink)
            except Exception as exc:
                failures.append(exc)
        if failures:
            detail = "; ".join(str(exc) or repr(exc) for exc in failures)
            message = f"{len(failures)} of {len(self.sinks)} audit sinks failed to {verb}: "
            raise _chained(AuditError(message + detail), failures[0]) from failures[0]


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class MalformedLine:
    """A line that is not a valid record; report it as ``SOURCE:LINE: error`` and go on."""

    source: str
    line_number: int
    error: str

    def __str__(self) -> str:
        return f"{self.source or '<input>'}:{self.line_number}: {self.error}"

    def __reduce__(self) -> tuple[type[MalformedLine], tuple[str, int, str]]:
        return MalformedLine, (self.source, self.line_number, self.error)  # see AuditRecord's


_TORN: Final = "torn final line (no trailing newline): a writer stopped mid-record"


def _blanked(tail: str | bytes) -> bool:
    """True for a final line of spaces only: a fragment blanked by JsonlFileSink, waiting
    for the next record to follow it; no record, and no tear."""
    if isinstance(tail, str):
        return bool(tail) and not tail.strip(" ")
    return bool(tail) and not tail.strip(b" ")


def _parse_line(text: str, source: str, number: int) -> AuditRecord | MalformedLine:
    if len(text) > MAX_LINE_BYTES:
        return MalformedLine(source, number, f"line longer than {MAX_LINE_BYTES} characters")
    try:
        return parse_record(text)
    except AuditError as exc:
        return MalformedLine(source, number, str(exc))


def iter_records(
    lines: Iterable[str], *, source: str = ""
) -> Iterator[AuditRecord | MalformedLine]:
    """Parse lines as iterating a text file yields them (each ending in a newline).

    Yields one item per line, numbered from 1, and never raises for bad content. A final
    line without its newline is torn and reported as malformed (unless it is only spaces,
    see ``_blanked``); pass ``text.splitlines(keepends=True)`` rather than
    ``text.splitlines()``.
    """
    pending: tuple[int, str] | None = None
    for number, line in enumerate(lines, start=1):
        if pending is not None:
            # Not the last line after all: only the final line can be a torn tail.
            yield _parse_line(pending[1], source, pending[0])
            pending = None
        if line.endswith("\n"):
            yield _parse_line(line, source, number)
        else:
            pending = (number, line)
    if pending is not None and not _blanked(pending[1]):
        yield MalformedLine(source, pending[0], _TORN)


class _LineReader(Protocol):
    def readline(self, size: int = -1, /) -> bytes: ...


def _bounded_lines(stream: _LineReader) -> Iterator[bytes | None]:
    """Yield each line with its newline, or None for one of MAX_LINE_BYTES or more (skipped)."""
    while line := stream.readline(MAX_LINE_BYTES):
        if len(line) < MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while (rest := stream.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
            pass
        yield None


def _decode_line(raw: bytes | None, source: str, number: int) -> AuditRecord | MalformedLine:
    if raw is None:
        return MalformedLine(source, number, f"line longer than {MAX_LINE_BYTES} bytes")
    if not raw.endswith(b"\n"):
        return MalformedLine(source, number, _TORN)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return MalformedLine(source, number, f"not valid UTF-8: {exc.reason} at byte {exc.start}")
    return _parse_line(text, source, number)


# Lines between two progress reports: often enough for a smooth bar, rare enough that the
# tell() it costs (one lseek) is lost in the noise.
_PROGRESS_EVERY: Final = 4096

Progress = Callable[[int], None]


class _Peekable(_LineReader, Protocol):
    def peek(self, size: int = 0, /) -> bytes: ...

    def read(self, size: int = -1, /) -> bytes: ...

    def seek(self, offset: int, whence: int = 0, /) -> int: ...


def _records_from(
    stream: _LineReader, source: str, tick: Callable[[], None] | None = None
) -> Iterator[AuditRecord | MalformedLine]:
    number = 0
    try:
        for number, raw in enumerate(_bounded_lines(stream), start=1):
            if raw is not None and not raw.endswith(b"\n") and _blanked(raw):
                break  # the final line, blanked: nothing to report
            yield _decode_line(raw, source, number)
            if tick is not None and number % _PROGRESS_EVERY == 0:
                tick()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        # A truncated or damaged .gz: report where the readable part ended, keep the rest.
        yield MalformedLine(source, number + 1, f"compressed data is damaged: {exc}")
    except OSError as exc:
        raise _chained(AuditError(f"cannot read audit log {source}: {exc}"), exc) from exc
    if tick is not None:
        tick()


def _read_opened(
    raw: _Peekable, source: str, tick: Callable[[], None] | None
) -> Iterator[AuditRecord | MalformedLine]:
    # peek, unlike read + seek, also works on a pipe such as <(zcat ...).
    if raw.peek(len(_GZIP_MAGIC))[: len(_GZIP_MAGIC)] == _GZIP_MAGIC:
        with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
            yield from _records_from(unzipped, source, tick)
    else:
        yield from _records_from(raw, source, tick)


def read_records(
    path: str | os.PathLike[str], *, progress: Progress | None = None
) -> Iterator[AuditRecord | MalformedLine]:
    """Stream the records of an audit log, plain or gzip-compressed (detected by magic).

    Memory stays bounded by MAX_LINE_BYTES however large the file. The file is opened on
    the first ``next()``; a file that cannot be opened or read raises AuditError.
    ``progress`` is called now and then with the bytes of the file consumed so far (the
    compressed bytes for a .gz), for a progress bar; never for a pipe.
    """
    source = os.fspath(path)
    try:
        raw = open(source, "rb")  # noqa: SIM115 - closed by the with below, in the generator
    except OSError as exc:
        raise _chained(AuditError(f"cannot read audit log {source}: {exc.strerror}"), exc) from exc
    with raw:
        tick = None
        if progress is not None and raw.seekable():
            report = progress  # bound here so that mypy sees it as not None

            def tick() -> None:
                report(raw.tell())

        yield from _read_opened(raw, source, tick)


def read_stream(
    stream: _Peekable, source: str = "<stdin>"
) -> Iterator[AuditRecord | MalformedLine]:
    """Like read_records, for an open binary stream with peek() such as sys.stdin.buffer."""
    return _read_opened(stream, source, None)


# --------------------------------------------------------------------------- follow

# How often --follow looks for new lines, a rotation or a truncation: a quarter second
# feels live on a terminal and costs one stat and one read per poll.
FOLLOW_POLL_SECONDS: Final = 0.25
_FOLLOW_CHUNK: Final = 64 * 1024


class _Tail:
    """Reads the complete lines appended to one open file; the follow loop's state."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.info = os.fstat(fd)
        self.offset = 0
        self.line = 0
        self.pending = b""
        self.skipping = False  # inside a line already reported as too long

    @classmethod
    def open(cls, path: str) -> _Tail:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise _chained(
                AuditError(f"cannot read audit log {path}: {exc.strerror}"), exc
            ) from exc
        return cls(path, fd)

    def close(self) -> None:
        os.close(self.fd)

    def drain(self) -> Iterator[AuditRecord | MalformedLine]:
        """Everything complete that is in the file now."""
        while chunk := os.read(self.fd, _FOLLOW_CHUNK):
            self.offset += len(chunk)
            yield from self._lines(chunk)

    def _lines(self, chunk: bytes) -> Iterator[AuditRecord | MalformedLine]:
        *complete, rest = (self.pending + chunk).split(b"\n")
        for raw in complete:
            self.line += 1
            if self.skipping:
                self.skipping = False
                yield _decode_line(None, self.path, self.line)
            else:
                yield _decode_line(raw + b"\n", self.path, self.line)
        self.pending = rest
        if len(rest) >= MAX_LINE_BYTES:
            # Bounded memory: drop the over-long line, report it when it ends.
            self.pending, self.skipping = b"", True

    def flush(self) -> Iterator[AuditRecord | MalformedLine]:
        """The file is done with (rotated away, truncated): a leftover fragment is torn."""
        if self.skipping or (self.pending and not _blanked(self.pending)):
            self.line += 1
            yield MalformedLine(self.path, self.line, _TORN)
        self.pending, self.skipping = b"", False

    def state(self) -> str:
        """'same', 'rotated' (the path names another file now) or 'truncated'."""
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            return "same"  # renamed, its successor not created yet: keep reading this one
        if not _same_inode(named, self.info):
            return "rotated"
        return "truncated" if os.fstat(self.fd).st_size < self.offset else "same"

    def restart(self) -> None:
        """Read the same file again from its start (it was truncated, e.g. copytruncate)."""
        os.lseek(self.fd, 0, os.SEEK_SET)
        self.offset = self.line = 0


def _same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _newer_generations(path: str, old: os.stat_result, new: os.stat_result) -> list[str]:
    """Rotated files written after ``old`` and before ``new``, oldest first.

    When the log rotated more than once between two polls, the generations in between
    already sit at ``path.1`` ... and would be missed; they are found by the old file's
    inode among the rotated siblings. If the old file is gone (deleted, renamed elsewhere)
    nothing can be found.
    """
    names = [name for name in rotated_files(path) if name != path]
    stats: list[os.stat_result | None] = []
    for name in names:
        try:
            stats.append(os.stat(name))
        except OSError:
            stats.append(None)
    found = [i for i, info in enumerate(stats) if info is not None and _same_inode(info, old)]
    if not found:
        return []
    between: list[str] = []
    for name, info in zip(names[found[0] + 1 :], stats[found[0] + 1 :], strict=True):
        if info is not None and _same_inode(info, new):
            break
        between.append(name)
    return between


def _read_generation(name: str) -> Iterator[AuditRecord | MalformedLine]:
    try:
        yield from read_records(name)
    except AuditError as exc:
        yield MalformedLine(name, 0, f"rotated file not followed: {exc}")


def follow_records(
    path: str | os.PathLike[str],
    *,
    poll_interval: float = FOLLOW_POLL_SECONDS,
    should_stop: Callable[[], bool] = lambda: False,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[AuditRecord | MalformedLine]:
    """Yield the records in the file, then new ones as they are appended, like ``tail -F``.

    Polls (no inotify). When the path names a new file (rotated by the sink or logrotate)
    the rest of the old file is read, then any generations rotated in between (found by
    inode among ``path.N``), then the new file from its start. When the file shrinks
    (copytruncate) it is read again from its start. Line numbers count from 1 in each file;
    memory is bounded by MAX_LINE_BYTES. Stops when ``should_stop()`` is true at a poll (or
    on KeyboardInterrupt in the caller). A missing file raises AuditError at once.
    """
    tail = _Tail.open(os.fspath(path))
    try:
        while True:
            yield from tail.drain()
            if should_stop():
                return
            state = tail.state()
            if state == "rotated":
                tail = yield from _next_generation(tail)
            elif state == "truncated":
                yield from tail.flush()
                tail.restart()
            else:
                sleep(poll_interval)
    finally:
        tail.close()


def _next_generation(
    tail: _Tail,
) -> Generator[AuditRecord | MalformedLine, None, _Tail]:
    """Finish ``tail``'s file, catch up on skipped generations, open the live file."""
    yield from tail.drain()
    try:
        new = _Tail.open(tail.path)
    except AuditError:
        return tail  # the path vanished again meanwhile: look once more at the next poll
    yield from tail.flush()
    for name in _newer_generations(tail.path, tail.info, new.info):
        yield from _read_generation(name)
    tail.close()
    return new


# --------------------------------------------------------------------------- filter, summary


@dataclass(frozen=True, slots=True)
class RecordFilter:
    """Selects records; unset criteria match everything. ``since <= ts < until``.

    ``host`` is an fnmatch glob (``*.example.com``) matched against the normalized host,
    so it is lowercased here. ``since`` and ``until`` must be timezone-aware.
    """

    decision: Verdict | None = None
    host: str | None = None
    port: int | None = None
    protocol: AuditProtocol | None = None
    reason: Reason | None = None
    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            value = getattr(self, name)
            if value is not None and value.utcoffset() is None:
                raise ValueError(f"{name} must be timezone-aware; audit times are UTC")
        if self.host is not None:
            object.__setattr__(self, "host", self.host.lower())

    def __reduce__(self) -> tuple[type[RecordFilter], tuple[object, ...]]:
        return RecordFilter, (  # see AuditRecord's
            self.decision,
            self.host,
            self.port,
            self.protocol,
            self.reason,
            self.since,
            self.until,
        )

    def matches(self, record: AuditRecord) -> bool:
        return (
            (self.decision is None or record.decision == self.decision)
            and (self.port is None or record.port == self.port)
            and (self.protocol is None or record.protocol == self.protocol)
            and (self.reason is None or record.reason == self.reason)
            and (self.since is None or record.ts >= self.since)
            and (self.until is None or record.ts < self.until)
            and (self.host is None or fnmatch.fnmatchcase(record.host, self.host))
        )


@dataclass(frozen=True, slots=True)
class SummaryRow:
    """Totals for one host:port; counts are listed in enum order and omit zeros."""

    host: str
    port: int
    total: int
    decisions: Mapping[Verdict, int]
    reasons: Mapping[Reason, int]
    first_ts: datetime
    last_ts: datetime

    def __reduce__(self) -> tuple[type[SummaryRow], tuple[object, ...]]:
        return SummaryRow, (  # see AuditRecord's
            self.host,
            self.port,
            self.total,
            self.decisions,
            self.reasons,
            self.first_ts,
            self.last_ts,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, for ``egressbox audit --summary --json``."""
        return {
            "host": self.host,
            "port": self.port,
            "total": self.total,
            "decisions": {verdict.value: n for verdict, n in self.decisions.items()},
            "reasons": {reason.value: n for reason, n in self.reasons.items()},
            "first_ts": format_ts(self.first_ts),
            "last_ts": format_ts(self.last_ts),
        }


@dataclass(slots=True)
class _Tally:
    first_ts: datetime
    last_ts: datetime
    decisions: Counter[Verdict] = field(default_factory=Counter)
    reasons: Counter[Reason] = field(default_factory=Counter)

    def add(self, record: AuditRecord) -> None:
        # min/max, not first/last seen: concurrent writers may append slightly out of order.
        self.first_ts = min(self.first_ts, record.ts)
        self.last_ts = max(self.last_ts, record.ts)
        self.decisions[record.decision] += 1
        self.reasons[record.reason] += 1


@functools.cache
def _enum_index(kind: type[_E]) -> dict[_E, int]:
    return {member: index for index, member in enumerate(kind)}


def _in_enum_order(kind: type[_E], counts: Counter[_E]) -> dict[_E, int]:
    # Sorting the one or two members present beats walking the whole enum per row.
    index = _enum_index(kind)
    return {
        member: counts[member] for member in sorted(counts, key=index.__getitem__) if counts[member]
    }


def summarize(records: Iterable[AuditRecord]) -> list[SummaryRow]:
    """Per host:port totals, most frequent first (ties by host, then port).

    Memory is one small tally per distinct host:port, whatever the number of records.
    """
    tallies: dict[tuple[str, int], _Tally] = {}
    for record in records:
        key = (record.host, record.port)
        tally = tallies.get(key)
        if tally is None:
            tally = tallies[key] = _Tally(record.ts, record.ts)
        tally.add(record)
    rows = [
        SummaryRow(
            host=host,
            port=port,
            total=tally.decisions.total(),
            decisions=_in_enum_order(Verdict, tally.decisions),
            reasons=_in_enum_order(Reason, tally.reasons),
            first_ts=tally.first_ts,
            last_ts=tally.last_ts,
        )
        for (host, port), tally in tallies.items()
    ]
    rows.sort(key=lambda row: (-row.total, row.host, row.port))
    return rows
