"""Audit records: the six-key JSON Lines contract, the sinks that write it, and a reader.

One record per decision, exactly ``ts, protocol, host, port, decision, reason`` in that
order (DESIGN.md section 6). Nothing else ever enters a record: the host guard below is a
last line of defence so that a caller bug cannot smuggle a path, header or credential in.

Writers emit each record as ONE ``write(2)`` of a whole line on an ``O_APPEND`` descriptor.
The kernel then appends it at the current end of file as a unit, so writers in several
threads or processes never interleave, and a writer killed between records leaves only whole
lines. Two caveats, both handled here: a short write (disk full, RLIMIT_FSIZE) leaves a
fragment, and Linux checks for a fatal signal between page-cache pages, so a SIGKILL can cut
a record that straddles a page boundary. In both cases the next write (or the next sink
opened on the file) starts with a newline, which keeps the fragment on a line of its own:
the reader reports it as malformed and every other record stays whole.
"""

from __future__ import annotations

import errno
import fnmatch
import gzip
import json
import os
import re
import stat
import unicodedata
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from types import TracebackType
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

from egressbox.errors import AuditError, Reason, Verdict

__all__ = [
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
    "format_ts",
    "iter_records",
    "parse_ts",
    "read_records",
    "summarize",
]

# The contract: these keys, in this order, and no others.
KEYS = ("ts", "protocol", "host", "port", "decision", "reason")

# DNS names are at most 253 bytes; 255 leaves room for bracketed IPv6 text.
MAX_HOST_CHARS = 255
MAX_PORT = 65535

# The longest valid record is under 4 KiB (255 host characters, each escaped by ensure_ascii
# as a 12-byte surrogate pair, plus about 120 bytes for the rest), so anything longer is not a
# record; the limit bounds the reader's memory on a file that is not an audit log at all.
MAX_LINE_BYTES = 64 * 1024

# Characters that never occur in a normalized host or IP text. Separators and controls would
# let a caller forge lines or fields; '/', '?', '#', '@' and '\\' are how a path, query,
# fragment or userinfo (a credential) would ride along if a raw URL were passed by mistake.
_FORBIDDEN_HOST_CHARS = frozenset("/?#@\\")
_FORBIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zs", "Zl", "Zp"})

_GZIP_MAGIC = b"\x1f\x8b"
_SKIP_CHUNK = 64 * 1024

_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(?:[Zz]|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)

_E = TypeVar("_E", bound=StrEnum)


class AuditProtocol(StrEnum):
    """The listener protocol a decision was made for."""

    HTTP = "http"
    CONNECT = "connect"
    SOCKS5 = "socks5"


class InvalidRecordError(AuditError, ValueError):
    """A record (built in code or read from a line) that breaks the contract."""


def _show(value: object, limit: int = 40) -> str:
    """A short, escaped rendering of a bad value for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_ts(ts: datetime) -> str:
    """RFC 3339 UTC with milliseconds and 'Z', e.g. 2026-11-30T11:08:16.123Z."""
    # isoformat pads the year to four digits, which strftime("%Y") does not on glibc.
    utc = ts.astimezone(UTC).replace(tzinfo=None)
    return utc.isoformat(timespec="milliseconds") + "Z"


def parse_ts(text: object) -> datetime:
    """Parse an RFC 3339 UTC timestamp ('Z' or a zero offset) into an aware datetime."""
    if not isinstance(text, str):
        raise InvalidRecordError(f"ts must be a string, got {type(text).__name__}")
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
        raise InvalidRecordError(f"ts {_show(text)} is not a valid date and time: {exc}") from None


def _check_ts(value: object) -> datetime:
    if not isinstance(value, datetime):
        raise InvalidRecordError(f"ts must be a datetime, got {type(value).__name__}")
    if value.utcoffset() is None:
        raise InvalidRecordError("ts must be timezone-aware (UTC)")
    try:
        utc = value.astimezone(UTC)
    except OverflowError as exc:
        raise InvalidRecordError(f"ts {value} cannot be expressed in UTC") from exc
    # The line carries milliseconds; truncating here makes a record equal its re-read self.
    return utc.replace(microsecond=utc.microsecond // 1000 * 1000)


def _forbidden_in_host(char: str) -> bool:
    return (
        char in _FORBIDDEN_HOST_CHARS
        or char.isspace()
        or unicodedata.category(char) in _FORBIDDEN_CATEGORIES
    )


def _check_host(value: object) -> None:
    if not isinstance(value, str):
        raise InvalidRecordError(f"host must be a string, got {type(value).__name__}")
    if len(value) > MAX_HOST_CHARS:
        raise InvalidRecordError(f"host is {len(value)} characters long (max {MAX_HOST_CHARS})")
    for index, char in enumerate(value):
        if _forbidden_in_host(char):
            raise InvalidRecordError(
                f"host {_show(value)} has forbidden character {char!r} at index {index}: "
                "audit hosts must be normalized names or IP text"
            )


def _check_port(value: object) -> None:
    # bool is an int subclass; True is not a port.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRecordError(f"port must be an integer, got {type(value).__name__}")
    if not 0 <= value <= MAX_PORT:
        raise InvalidRecordError(f"port {value} is out of range 0..{MAX_PORT}")


def _coerce(kind: type[_E], value: object, name: str) -> _E:
    if not isinstance(value, str):
        raise InvalidRecordError(f"{name} must be a string, got {type(value).__name__}")
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise InvalidRecordError(f"{name} {_show(value)} is not one of: {choices}") from None


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
    except _DuplicateKeyError as exc:
        raise InvalidRecordError(str(exc)) from None
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and over-long integer literals.
        raise InvalidRecordError(f"not valid JSON: {exc}") from None
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


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One decision. Fields are validated (and enum strings coerced) on construction."""

    ts: datetime
    protocol: AuditProtocol
    host: str
    port: int
    decision: Verdict
    reason: Reason

    def __post_init__(self) -> None:
        # Frozen: normalized values go in through object.__setattr__, once, here.
        object.__setattr__(self, "ts", _check_ts(self.ts))
        object.__setattr__(self, "protocol", _coerce(AuditProtocol, self.protocol, "protocol"))
        _check_host(self.host)
        _check_port(self.port)
        object.__setattr__(self, "decision", _coerce(Verdict, self.decision, "decision"))
        object.__setattr__(self, "reason", _coerce(Reason, self.reason, "reason"))

    @classmethod
    def create(
        cls,
        protocol: AuditProtocol,
        host: str,
        port: int,
        decision: Verdict,
        reason: Reason,
        *,
        now: Callable[[], datetime] | None = None,
    ) -> AuditRecord:
        """A record stamped with the current UTC time (``now`` is the clock seam for tests)."""
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
        """One compact, ASCII-only JSON object without a trailing newline."""
        return json.dumps(self.to_dict(), ensure_ascii=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> AuditRecord:
        """Parse one line strictly; raises InvalidRecordError (an AuditError) on any flaw."""
        data = _load_object(line)
        _check_keys(data)
        return cls(
            ts=parse_ts(data["ts"]),
            protocol=data["protocol"],
            host=data["host"],
            port=data["port"],
            decision=data["decision"],
            reason=data["reason"],
        )


# --------------------------------------------------------------------------- sinks


@runtime_checkable
class AuditSink(Protocol):
    """Where records go. write() raises AuditError on failure and never swallows it."""

    def write(self, record: AuditRecord) -> None: ...

    def close(self) -> None: ...


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
        fd = self.fileno()
        data = (b"\n" if self._torn else b"") + record.to_json().encode("ascii") + b"\n"
        try:
            written = os.write(fd, data)
        except OSError as exc:
            raise AuditError(f"cannot write audit record to {self._name}: {exc}") from exc
        if written != len(data):
            self._torn = not _end_line(fd)
            raise AuditError(
                f"short write of audit record to {self._name}: {written} of {len(data)} "
                "bytes (disk full, file size limit or an interrupted terminal write)"
            )
        self._torn = False

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None or not self._owns_fd:
            return
        try:
            os.close(fd)
        except OSError as exc:
            # close() can report a deferred write error (NFS); records may be lost.
            raise AuditError(f"closing audit log {self._name} failed: {exc}") from exc

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _end_line(fd: int) -> bool:
    """Best effort: terminate a fragment left by a short write. True if it worked."""
    try:
        return os.write(fd, b"\n") == 1
    except OSError:
        return False


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


_SYMLINK_WHY = (
    "is a symbolic link; refusing to follow it (O_NOFOLLOW) so that a planted link "
    "cannot redirect the audit log"
)


def _refuse_special(path: str, mode: int) -> None:
    if stat.S_ISLNK(mode):
        raise AuditError(f"audit log {path} {_SYMLINK_WHY}")
    if not stat.S_ISREG(mode):
        raise AuditError(f"audit log {path} is {_kind(mode)}; it must be a regular file")


def _open_append(path: str, mode: int) -> tuple[int, os.stat_result]:
    """Open (creating) a regular file for appending, refusing links and special files."""
    # lstat first so that a device or FIFO is refused without opening it (opening some
    # devices has side effects); the fstat below is the check that cannot race.
    try:
        _refuse_special(path, os.lstat(path).st_mode)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise AuditError(f"cannot open audit log {path}: {exc.strerror}") from exc
    # O_NOFOLLOW covers the last path component only, which is the one a planted link would
    # replace. O_NONBLOCK keeps a FIFO swapped in after the lstat from blocking the open;
    # O_NOCTTY keeps a terminal from becoming our controlling one.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        raise _describe_open_error(path, exc) from exc
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


def _ends_in_fragment(path: str, info: os.stat_result) -> bool:
    """True if the existing file's last byte is not a newline (a writer died mid-record)."""
    if info.st_size == 0:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False  # unreadable (write-only permissions): skip the repair, not the log
    try:
        again = os.fstat(fd)
        if (again.st_dev, again.st_ino) != (info.st_dev, info.st_ino):
            return False  # the path was replaced meanwhile; it is not our file
        return os.pread(fd, 1, info.st_size - 1) != b"\n"
    except OSError:
        return False
    finally:
        os.close(fd)


class JsonlFileSink(_FdSink):
    """Appends records to a regular file (created with ``mode``) as JSON Lines.

    Safe to share between threads, and between processes that each open the same path.
    """

    def __init__(self, path: str | os.PathLike[str], *, mode: int = 0o600) -> None:
        self.path = os.fspath(path)
        fd, info = _open_append(self.path, mode)
        super().__init__(fd, self.path, owns_fd=True)
        self._torn = _ends_in_fragment(self.path, info)


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
            raise AuditError(f"audit callback failed: {exc!r}") from exc


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
            raise AuditError(message + detail) from failures[0]


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True, slots=True)
class MalformedLine:
    """A line that is not a valid record; report it as ``SOURCE:LINE: error`` and go on."""

    source: str
    line_number: int
    error: str

    def __str__(self) -> str:
        return f"{self.source or '<input>'}:{self.line_number}: {self.error}"


_TORN = "torn final line (no trailing newline): a writer stopped mid-record"


def _parse_line(text: str, source: str, number: int) -> AuditRecord | MalformedLine:
    if len(text) > MAX_LINE_BYTES:
        return MalformedLine(source, number, f"line longer than {MAX_LINE_BYTES} characters")
    try:
        return AuditRecord.from_json(text)
    except AuditError as exc:
        return MalformedLine(source, number, str(exc))


def iter_records(
    lines: Iterable[str], *, source: str = ""
) -> Iterator[AuditRecord | MalformedLine]:
    """Parse lines as iterating a text file yields them (each ending in a newline).

    Yields one item per line, numbered from 1, and never raises for bad content. A final
    line without its newline is torn and reported as malformed; pass
    ``text.splitlines(keepends=True)`` rather than ``text.splitlines()``.
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
    if pending is not None:
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


def _records_from(stream: _LineReader, source: str) -> Iterator[AuditRecord | MalformedLine]:
    number = 0
    try:
        for number, raw in enumerate(_bounded_lines(stream), start=1):
            yield _decode_line(raw, source, number)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        # A truncated or damaged .gz: report where the readable part ended, keep the rest.
        yield MalformedLine(source, number + 1, f"compressed data is damaged: {exc}")
    except OSError as exc:
        raise AuditError(f"cannot read audit log {source}: {exc}") from exc


def read_records(path: str | os.PathLike[str]) -> Iterator[AuditRecord | MalformedLine]:
    """Stream the records of an audit log, plain or gzip-compressed (detected by magic).

    Memory stays bounded by MAX_LINE_BYTES however large the file. The file is opened on
    the first ``next()``; a file that cannot be opened or read raises AuditError.
    """
    source = os.fspath(path)
    try:
        raw = open(source, "rb")  # noqa: SIM115 - closed by the with below, in the generator
    except OSError as exc:
        raise AuditError(f"cannot read audit log {source}: {exc.strerror}") from exc
    with raw:
        # peek, unlike read + seek, also works on a pipe such as <(zcat ...).
        if raw.peek(len(_GZIP_MAGIC))[: len(_GZIP_MAGIC)] == _GZIP_MAGIC:
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield from _records_from(unzipped, source)
        else:
            yield from _records_from(raw, source)


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


def _in_enum_order(kind: type[_E], counts: Counter[_E]) -> dict[_E, int]:
    return {member: counts[member] for member in kind if counts[member]}


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
