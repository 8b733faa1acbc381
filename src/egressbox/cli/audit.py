"""`egressbox audit`: read, filter, summarize and follow audit logs; suggest a policy.

Wired into the main parser by cli/__init__.py (``add_parser(sub)``, then ``run(args)``); also
runnable alone as ``python -m egressbox.cli.audit FILE...``.

Which files are read (one rule, applied to each FILE argument in order):
  ``-``                 standard input (plain or gzip);
  an existing file      exactly that file;
  an existing directory every ``*.jsonl`` log in it with its rotated siblings;
  a pattern (``*?[``)   the files it matches (quote it so the shell leaves it to us);
  ``--rotated``         adds FILE's rotated siblings (FILE.N, FILE.N.gz) to FILE.
Files found by a directory, pattern or ``--rotated`` are read oldest first: for each log,
``.N.gz``/``.N`` from the highest N down, then the live file. A file named twice is read
once. gzip is recognized by content, not by name.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, TextIO, cast

from egressbox.audit.record import (
    AuditProtocol,
    AuditRecord,
    MalformedLine,
    RecordFilter,
    SummaryRow,
    follow_records,
    format_ts,
    read_records,
    read_stream,
    rotated_files,
    rotation_index,
    summarize,
)
from egressbox.core.errors import AuditError, PolicyError, Reason, Verdict

if TYPE_CHECKING:
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

from egressbox.core.exitcodes import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE

STDIN = "-"
# Malformed lines reported one by one on stderr; the rest are only counted, so that a
# file that is not an audit log at all cannot flood the terminal.
MAX_REPORTED_MALFORMED = 20
# Progress bar: first drawn only once reading has taken this long (seconds), so that a
# small log never flashes one; then redrawn at most every PROGRESS_INTERVAL; this wide.
PROGRESS_DELAY = 1.5
PROGRESS_INTERVAL = 0.1
PROGRESS_WIDTH = 30
# Files named in the line saying that no record matched; the rest are counted.
_SHOW_SOURCES = 3

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_RELATIVE = re.compile(r"(?:\d+[smhdw])+", re.ASCII)
_RELATIVE_PART = re.compile(r"(\d+)([smhdw])", re.ASCII)
_LOG_NAME = re.compile(r".*\.jsonl(?:\.[1-9][0-9]*)?(?:\.gz)?", re.ASCII)
_ROTATED_TAIL = re.compile(r"\.[1-9][0-9]*(?:\.gz)?\Z", re.ASCII)

DESCRIPTION = """\
Read egressbox audit logs (JSON Lines, one record per decision: ts, protocol, host,
port, decision, reason). Shows a table on a terminal and JSON lines otherwise.

FILE is a log, '-' for standard input, a directory (its *.jsonl logs) or a quoted
glob. Rotated files (audit.jsonl.1, audit.jsonl.2.gz ...) and gzip are read too;
--rotated adds FILE's rotated siblings, oldest first. Malformed lines are reported
on stderr as FILE:LINE and skipped.
"""

# The end of `egressbox audit --help` (tests/cli/test_help_examples.py parses each line).
EXAMPLES = """\
examples:
  egressbox audit audit.jsonl --decision deny --since 2h
  egressbox audit --rotated audit.jsonl --summary
  egressbox audit audit.jsonl --follow --host '*.example.com'
  egressbox audit --suggest-policy audit.jsonl > policy.toml && egressbox check policy.toml
"""


# --------------------------------------------------------------------------- arguments


def parse_time(text: str, *, now: datetime | None = None) -> datetime:
    """``2h``/``30m``/``1d12h`` ago, ``now``, or an ISO 8601 date/time (naive = UTC)."""
    value = text.strip()
    current = now or datetime.now(UTC)
    if value == "now":
        return current
    if _RELATIVE.fullmatch(value):
        seconds = sum(int(n) * _UNITS[unit] for n, unit in _RELATIVE_PART.findall(value))
        try:
            return current - timedelta(seconds=seconds)
        except OverflowError:
            raise ValueError(f"{text!r} reaches before year 1") from None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time: use a relative age such as 30s, 15m, 2h, 7d, 1w "
            "(or 1h30m), 'now', or a UTC date/time such as 2026-11-30 or "
            "2026-11-30T11:08:00Z"
        ) from None
    return moment.replace(tzinfo=UTC) if moment.utcoffset() is None else moment.astimezone(UTC)


def _time_arg(text: str) -> datetime:
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port_arg(text: str) -> int:
    if text.isascii() and text.isdigit() and 0 <= int(text) <= 65535:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)")


def add_parser(sub: Subparsers) -> None:
    """Register ``egressbox audit`` on the main parser's subcommands."""
    p = sub.add_parser(
        "audit",
        help="read, filter, summarize or follow audit logs; suggest a policy from them",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(p)


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of ``audit`` (shared by add_parser and the standalone main)."""
    p.add_argument("files", nargs="+", metavar="FILE", help="audit log, '-', directory or glob")
    p.add_argument(
        "--rotated",
        action="store_true",
        help="also read each FILE's rotated copies (FILE.1, FILE.2.gz ...), oldest first",
    )
    _add_filters(p.add_argument_group("filters (all must match)"))
    _add_outputs(p.add_argument_group("output"))


def _add_filters(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--decision", choices=[v.value for v in Verdict], help="only this decision")
    g.add_argument(
        "--host",
        metavar="PATTERN",
        help="host glob, e.g. '*.example.com' or 'pypi.org' (quote it)",
    )
    g.add_argument("--port", type=_port_arg, metavar="N", help="only this port")
    g.add_argument(
        "--protocol", choices=[p.value for p in AuditProtocol], help="only this protocol"
    )
    g.add_argument(
        "--reason",
        choices=[r.value for r in Reason],
        metavar="CODE",
        help="only this reason code: " + ", ".join(r.value for r in Reason),
    )
    g.add_argument(
        "--since",
        type=_time_arg,
        metavar="T",
        help="records at or after T: an age (30m, 2h, 7d) or a UTC time (2026-11-30T11:00Z)",
    )
    g.add_argument("--until", type=_time_arg, metavar="T", help="records before T (same forms)")


def _add_outputs(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--json", action="store_true", help="JSON lines even on a terminal (the default when piped)"
    )
    g.add_argument(
        "--summary",
        action="store_true",
        help="one row per host:port: counts by decision and reason, first and last seen",
    )
    g.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="after the records so far, keep printing new ones, across rotation (Ctrl-C stops)",
    )
    g.add_argument(
        "--suggest-policy",
        action="store_true",
        help="write a TOML policy admitting what the log shows allowed or would_deny (review it!)",
    )
    g.add_argument(
        "--base-policy",
        metavar="FILE",
        help="with --suggest-policy: keep this policy's deny, allow_cidrs, deny_cidrs",
    )
    g.add_argument(
        "--output", "-o", metavar="FILE", help="with --suggest-policy: write here, not stdout"
    )


def _usage_problem(args: argparse.Namespace) -> str | None:
    modes = [name for name in ("summary", "follow", "suggest_policy") if getattr(args, name)]
    if len(modes) > 1:
        return "choose one of --summary, --follow and --suggest-policy"
    if args.follow and (len(args.files) != 1 or args.files[0] == STDIN or args.rotated):
        return "--follow takes exactly one FILE (not '-', not --rotated)"
    if (args.base_policy or args.output) and not args.suggest_policy:
        return "--base-policy and --output go with --suggest-policy"
    if args.since and args.until and args.since >= args.until:
        return f"--since ({format_ts(args.since)}) must be before --until ({format_ts(args.until)})"
    if args.files.count(STDIN) > 1:
        return "'-' (standard input) can be read only once"
    return None


def record_filter(args: argparse.Namespace) -> RecordFilter:
    return RecordFilter(
        decision=Verdict(args.decision) if args.decision else None,
        host=args.host,
        port=args.port,
        protocol=AuditProtocol(args.protocol) if args.protocol else None,
        reason=Reason(args.reason) if args.reason else None,
        since=args.since,
        until=args.until,
    )


# --------------------------------------------------------------------------- sources


def _rotation_key(path: str) -> tuple[str, int, bool]:
    """Sort key putting rotated copies of one log oldest first, the live file last."""
    base = _ROTATED_TAIL.sub("", path)
    index = rotation_index(path, base)
    return base, -(index or 0), path.endswith(".gz")


def rotation_order(paths: Iterable[str]) -> list[str]:
    return sorted(paths, key=_rotation_key)


def expand(argument: str, *, rotated: bool = False) -> list[str]:
    """The files one FILE argument stands for (see the module docstring)."""
    if argument == STDIN:
        return [STDIN]
    if os.path.isdir(argument):
        names = glob.glob(os.path.join(glob.escape(argument), "*"))
        found = [n for n in names if _LOG_NAME.fullmatch(os.path.basename(n)) and os.path.isfile(n)]
        return rotation_order(found)
    if not os.path.lexists(argument) and glob.has_magic(argument):
        return rotation_order(n for n in glob.glob(argument) if os.path.isfile(n))
    if rotated:
        return rotated_files(argument) or [argument]
    return [argument]


def expand_all(arguments: Sequence[str], *, rotated: bool = False) -> tuple[list[str], list[str]]:
    """(files to read, arguments that matched nothing); duplicates read once."""
    files: list[str] = []
    seen: set[str] = set()
    empty: list[str] = []
    for argument in arguments:
        found = expand(argument, rotated=rotated)
        if not found:
            empty.append(argument)
        for path in found:
            key = path if path == STDIN else os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                files.append(path)
    return files, empty


# --------------------------------------------------------------------------- progress


class ProgressBar:
    """``[#####.....]  45%  450.0 of 1000.0 MiB`` redrawn in place on a terminal.

    Nothing is drawn before ``delay`` seconds have passed since the bar was made: work
    that ends sooner shows no bar at all.
    """

    def __init__(
        self,
        total: int,
        out: TextIO,
        clock: Callable[[], float] = time.monotonic,
        delay: float = PROGRESS_DELAY,
    ):
        self.total = max(total, 1)
        self.out = out
        self.clock = clock
        self.done_before = 0  # bytes of the files already finished
        self.start = clock()
        self.delay = delay
        self.last_draw = -PROGRESS_INTERVAL
        self.drawn = False

    def update(self, position: int) -> None:
        now = self.clock()
        if now - self.start < self.delay or now - self.last_draw < PROGRESS_INTERVAL:
            return
        self.last_draw = now
        self.draw(self.done_before + position)

    def draw(self, done: int) -> None:
        fraction = min(done / self.total, 1.0)
        cells = int(fraction * PROGRESS_WIDTH)
        bar = "#" * cells + "." * (PROGRESS_WIDTH - cells)
        mib = 1024 * 1024
        text = f"\r[{bar}] {fraction:4.0%}  {done / mib:.1f} of {self.total / mib:.1f} MiB"
        self.out.write(text)
        self.out.flush()
        self.drawn = True

    def file_done(self, size: int) -> None:
        self.done_before += size
        if self.drawn or self.clock() - self.start >= self.delay:
            self.draw(self.done_before)

    def clear(self) -> None:
        if self.drawn:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self.drawn = False


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size if path != STDIN else 0
    except OSError:
        return 0


# --------------------------------------------------------------------------- reading


@dataclass
class Reader:
    """Reads the files in order, reporting malformed lines and unreadable files."""

    files: Sequence[str]
    criteria: RecordFilter
    err: TextIO
    progress: ProgressBar | None = None
    read: int = 0  # records read, matching or not
    malformed: int = 0
    failed: list[str] = field(default_factory=list)

    def records(self) -> Iterator[AuditRecord]:
        for path in self.files:
            yield from self._matching(self._items(path))
            if self.progress is not None:
                self.progress.file_done(_file_size(path))
        self._finish()

    def follow(self, path: str) -> Iterator[AuditRecord]:
        yield from self._matching(self._guarded(path, follow_records(path)))

    def _items(self, path: str) -> Iterator[AuditRecord | MalformedLine]:
        if path == STDIN:
            stdin = cast(io.BufferedReader, sys.stdin.buffer)
            return self._guarded(path, read_stream(stdin))
        report = self.progress.update if self.progress is not None else None
        return self._guarded(path, read_records(path, progress=report))

    def _guarded(
        self, path: str, items: Iterator[AuditRecord | MalformedLine]
    ) -> Iterator[AuditRecord | MalformedLine]:
        try:
            yield from items
        except AuditError as exc:
            self.failed.append(path)
            self._say(str(exc))

    def _matching(self, items: Iterable[AuditRecord | MalformedLine]) -> Iterator[AuditRecord]:
        everything = self.criteria == RecordFilter()
        matches = self.criteria.matches
        for item in items:
            if isinstance(item, AuditRecord):
                self.read += 1
                if everything or matches(item):
                    yield item
            else:
                self._malformed(item)

    def _malformed(self, item: MalformedLine) -> None:
        self.malformed += 1
        if self.malformed <= MAX_REPORTED_MALFORMED:
            self._say(f"skipped malformed line {item}")

    def _finish(self) -> None:
        if self.progress is not None:
            self.progress.clear()
        hidden = self.malformed - MAX_REPORTED_MALFORMED
        if hidden > 0:
            self._say(f"{hidden} more malformed lines skipped ({self.malformed} in all)")

    def _say(self, message: str) -> None:
        if self.progress is not None:
            self.progress.clear()
        print(f"egressbox audit: {message}", file=self.err, flush=True)


# --------------------------------------------------------------------------- output

_COLUMNS = ("TS", "PROTOCOL", "HOST", "PORT", "DECISION", "REASON")
_HOST_WIDTH = 40  # streamed rows cannot be measured first; longer hosts just overflow


def _table_row(cells: Sequence[str]) -> str:
    ts, protocol, host, port, decision, reason = cells
    return f"{ts:<24}  {protocol:<8}  {host:<{_HOST_WIDTH}}  {port:>5}  {decision:<10}  {reason}"


def _cells(record: AuditRecord) -> tuple[str, ...]:
    return (
        format_ts(record.ts),
        record.protocol.value,
        record.host,
        str(record.port),
        record.decision.value,
        record.reason.value,
    )


def write_records(records: Iterable[AuditRecord], out: TextIO, *, table: bool, flush: bool) -> int:
    """Print records (a table or JSON lines); returns how many. No record, no header."""
    count = 0
    for record in records:
        if table and count == 0:
            out.write(_table_row(_COLUMNS) + "\n")
        out.write((_table_row(_cells(record)) if table else record.to_json()) + "\n")
        count += 1
        if flush:
            out.flush()
    return count


def _reasons_text(row: SummaryRow) -> str:
    return ", ".join(f"{reason.value}={n}" for reason, n in row.reasons.items())


def summary_table(rows: Sequence[SummaryRow]) -> list[str]:
    """Rows with their columns sized to fit (the summary is small and complete)."""
    targets = [_target(row) for row in rows]
    reasons = [_reasons_text(row) for row in rows]
    tw = max([len("HOST:PORT"), *map(len, targets)])
    rw = max([len("REASONS"), *map(len, reasons)])
    head = (
        f"{'HOST:PORT':<{tw}}  {'TOTAL':>7}  {'ALLOW':>7}  {'DENY':>7}  {'WOULD_DENY':>10}  "
        f"{'REASONS':<{rw}}  {'FIRST SEEN':<24}  LAST SEEN"
    )
    lines = [head]
    for row, target, why in zip(rows, targets, reasons, strict=True):
        d = row.decisions
        lines.append(
            f"{target:<{tw}}  {row.total:>7}  {d.get(Verdict.ALLOW, 0):>7}  "
            f"{d.get(Verdict.DENY, 0):>7}  {d.get(Verdict.WOULD_DENY, 0):>10}  "
            f"{why:<{rw}}  {format_ts(row.first_ts):<24}  {format_ts(row.last_ts)}"
        )
    return lines


def _target(row: SummaryRow) -> str:
    host = f"[{row.host}]" if ":" in row.host else row.host
    return f"{host}:{row.port}"


def write_summary(rows: Sequence[SummaryRow], out: TextIO, *, table: bool) -> None:
    if table:
        out.write("\n".join(summary_table(rows)) + "\n")
        return
    for row in rows:
        out.write(json.dumps(row.to_dict(), separators=(",", ":")) + "\n")


# --------------------------------------------------------------------------- commands


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@dataclass
class Context:
    """What a command needs: parsed args, the streams (parameters, for tests)."""

    args: argparse.Namespace
    out: TextIO
    err: TextIO

    @property
    def table(self) -> bool:
        return not self.args.json and _is_tty(self.out)

    def reader(self, files: Sequence[str], *, progress: bool) -> Reader:
        bar = None
        total = sum(_file_size(path) for path in files)
        if progress and total > 0 and _is_tty(self.err):
            bar = ProgressBar(total, self.err, delay=PROGRESS_DELAY)
        return Reader(files, record_filter(self.args), self.err, bar)


def _status(reader: Reader) -> int:
    return EXIT_RUNTIME if reader.failed else EXIT_OK


def _filters_text(args: argparse.Namespace) -> str:
    """The filters given, as they would be typed (times as UTC timestamps)."""
    given = [
        ("--decision", args.decision),
        ("--host", args.host),
        ("--port", args.port),
        ("--protocol", args.protocol),
        ("--reason", args.reason),
        ("--since", args.since and format_ts(args.since)),
        ("--until", args.until and format_ts(args.until)),
    ]
    return " ".join(
        f"{flag} {shlex.quote(str(value))}" for flag, value in given if value is not None
    )


def _sources_text(files: Sequence[str]) -> str:
    names = ["standard input" if path == STDIN else path for path in files]
    shown = ", ".join(names[:_SHOW_SOURCES])
    more = len(names) - _SHOW_SOURCES
    return shown + (f" and {more} more" if more > 0 else "")


def say_no_match(ctx: Context, reader: Reader) -> None:
    """One line on stderr for an empty result: what was read, and which filters."""
    files = [path for path in reader.files if path not in reader.failed]
    if not files:
        return  # each file's failure was already said
    filters = _filters_text(ctx.args)
    what = f"no record matches {filters}" if filters else "no record found"
    read = _plural(reader.read, "record")
    print(f"egressbox: {what} ({read} read from {_sources_text(files)})", file=ctx.err)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def cmd_list(ctx: Context, files: Sequence[str]) -> int:
    reader = ctx.reader(files, progress=False)
    if write_records(reader.records(), ctx.out, table=ctx.table, flush=False) == 0:
        say_no_match(ctx, reader)
    return _status(reader)


def cmd_summary(ctx: Context, files: Sequence[str]) -> int:
    reader = ctx.reader(files, progress=True)
    rows = summarize(reader.records())
    if rows:
        write_summary(rows, ctx.out, table=ctx.table)
    else:
        say_no_match(ctx, reader)
    return _status(reader)


def cmd_follow(ctx: Context, path: str) -> int:
    reader = ctx.reader([path], progress=False)
    with contextlib.suppress(KeyboardInterrupt):
        write_records(reader.follow(path), ctx.out, table=ctx.table, flush=True)
    return _status(reader)


def cmd_suggest(ctx: Context, files: Sequence[str]) -> int:
    from egressbox.audit.suggest import plan_suggestion, render_policy
    from egressbox.core.policy import load_policy

    base = None
    if ctx.args.base_policy:
        try:
            base = load_policy(ctx.args.base_policy, env={})
        except PolicyError as exc:
            print(f"egressbox audit: --base-policy: {exc}", file=ctx.err)
            return EXIT_USAGE
    reader = ctx.reader(files, progress=True)
    plan = plan_suggestion(reader.records(), base=base)
    if plan.records == 0:
        say_no_match(ctx, reader)
    text = render_policy(plan, sources=files, base=base)
    path = ctx.args.output
    if not path:
        ctx.out.write(text)
        return _status(reader)
    _write_file(path, text)
    print(
        f"egressbox: wrote a policy admitting {_plural(len(plan.allow), 'destination')} to "
        f"{path} ({plan.commented} commented out); check it with egressbox check "
        f"{shlex.quote(path)}",
        file=ctx.err,
    )
    return _status(reader)


def _write_file(path: str, text: str) -> None:
    """Write whole or not at all: a temporary file renamed over the target."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise AuditError(f"cannot write {path}: {exc.strerror}") from exc


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``egressbox audit``: 0 ok, 1 a file could not be read or written, 2 usage."""
    ctx = Context(args, out or sys.stdout, err or sys.stderr)
    problem = _usage_problem(args)
    if problem is not None:
        print(f"egressbox audit: {problem}", file=ctx.err)
        return EXIT_USAGE
    files, empty = expand_all(args.files, rotated=args.rotated)
    for argument in empty:
        print(f"egressbox audit: {argument}: no audit log matches", file=ctx.err)
    if args.follow:
        if len(files) != 1:
            print("egressbox audit: --follow needs exactly one log file", file=ctx.err)
            return EXIT_USAGE
        return cmd_follow(ctx, files[0])
    status = EXIT_RUNTIME if empty else EXIT_OK
    try:
        if args.summary:
            result = cmd_summary(ctx, files)
        elif args.suggest_policy:
            result = cmd_suggest(ctx, files)
        else:
            result = cmd_list(ctx, files)
    except AuditError as exc:
        print(f"egressbox audit: {exc}", file=ctx.err)
        return EXIT_RUNTIME
    return max(status, result)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="egressbox audit",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
