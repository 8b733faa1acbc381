"""A full disk under the audit log: every record whole or absent, and recovery.

The audit log lives on a small tmpfs mounted in a private mount namespace (root only:
`unshare -m`). A holder process keeps that namespace (and the tmpfs) alive; the proxy runs
in it through `nsenter`, and the test reaches the tmpfs from the host as
/proc/HOLDER/root/DIR, so it can fill it, free it and read the log after the proxy exits.

1. `egressbox serve` (one process, and `--workers 2`): clients make CONNECT requests on
   loopback while the tmpfs is filled to the last byte; the proxy must go on answering from
   its reserve, then refuse (503 audit_unavailable) once that runs out, never tear a
   record; when space is freed it must admit connections again. Judged from the log: every
   line is a whole six-key record in record_line's own spelling, and there is exactly one
   record per answered (200/403) request and none for a refused one.
2. The fallback without fallocate (the reserve disabled in the writers): several processes
   with their own sinks write until the file system is full, twice; short writes happen for
   real, and every fragment they leave must be blanked, so that every line still parses.

Every loop is bounded by a count and a deadline; traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from egressbox.audit.record import KEYS, AuditRecord, parse_record

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(sys.platform != "linux", reason="mount namespaces and tmpfs are Linux's"),
]

TMPFS_SIZE = "4m"
READY_TIMEOUT = 20.0
IO_TIMEOUT = 10.0
EXIT_TIMEOUT = 20.0
CLIENTS = 4  # concurrent client threads (far below max_connections: no 503 of that kind)
MAX_REQUESTS = 20_000  # per phase: the bound on any request loop
PHASE_SECONDS = 60.0  # per phase: the other bound
# A long name no policy allows: denied by the name rules (no DNS), and a big record, so the
# proxy's reserve (up to 1 MiB) runs out after a few thousand requests.
LONG_DENIED = ".".join(["a" * 60, "b" * 60, "c" * 60, "d" * 50, "denied", "test"])
RECORD_KEYS = set(KEYS)


# -- the namespace holder ---------------------------------------------------------------------


@dataclass
class Tmpfs:
    """A tmpfs at `mountpoint` inside the holder's private mount namespace."""

    holder: subprocess.Popen[bytes]
    mountpoint: Path

    def host_path(self, name: str) -> Path:
        """`name` on the tmpfs, as the host reaches it (through the holder's root)."""
        return Path(f"/proc/{self.holder.pid}/root{self.mountpoint}") / name

    def inside(self, *argv: str) -> list[str]:
        """argv run inside the holder's mount namespace."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--", *argv]

    def fill(self, name: str = "filler") -> int:
        """Write a file until the file system is full; returns its size."""
        chunk = b"\0" * 65536
        size = 0
        with open(self.host_path(name), "wb", buffering=0) as f:
            for _ in range(10_000):  # bounded: far more than the tmpfs holds
                try:
                    size += f.write(chunk)
                except OSError:
                    break
            for _ in range(4096):  # then byte by byte what a partial chunk left
                try:
                    f.write(b"\0" * 512)
                    size += 512
                except OSError:
                    break
        return size

    def free(self, name: str = "filler") -> None:
        self.host_path(name).unlink()


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root: a private mount namespace (unshare -m) and a tmpfs mount"
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux) is not installed"
    return None


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    why = _unavailable()
    if why is not None:
        pytest.skip(why)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    script = 'mount -t tmpfs -o size="$1" tmpfs "$0" && echo mounted && exec sleep 600'
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", script]
    holder = subprocess.Popen(
        [*argv, str(mountpoint), TMPFS_SIZE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if line != b"mounted\n":
            holder.wait(EXIT_TIMEOUT)
            assert holder.stderr is not None
            reason = holder.stderr.read().decode(errors="replace").strip()
            pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {reason}")
        yield Tmpfs(holder, mountpoint)
    finally:
        holder.kill()
        holder.wait(EXIT_TIMEOUT)
        for stream in (holder.stdout, holder.stderr):
            if stream is not None:
                stream.close()


# -- an echo origin and the clients ------------------------------------------------------------


class EchoOrigin:
    """Accepts and echoes on 127.0.0.1 (threads; every connection closed at the end)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(IO_TIMEOUT)
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(IO_TIMEOUT)


@pytest.fixture
def origin() -> Iterator[EchoOrigin]:
    server = EchoOrigin()
    try:
        yield server
    finally:
        server.close()


def connect(proxy: tuple[str, int], target: str) -> tuple[int, str]:
    """One CONNECT: (status, X-Egressbox-Reason or "") after the reply head."""
    with socket.create_connection(proxy, timeout=IO_TIMEOUT) as sock:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise EOFError(f"closed inside the reply head: {data!r}")
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    reason = ""
    for field in head[1:]:
        name, _, value = field.partition(":")
        if name.strip().lower() == "x-egressbox-reason":
            reason = value.strip()
    return int(head[0].split()[1]), reason


@dataclass
class Tally:
    """What the clients saw: records the proxy must have written, and refusals."""

    answered: int = 0  # 200 or 403: each one a record
    refused: int = 0  # 503 audit_unavailable: no record
    other: Counter[tuple[int, str]] | None = None

    def add(self, outcome: tuple[int, str]) -> None:
        status, reason = outcome
        if status in (200, 403):
            self.answered += 1
        elif (status, reason) == (503, "audit_unavailable"):
            self.refused += 1
        else:
            self.other = self.other or Counter()
            self.other[outcome] += 1


def requests_until(
    proxy: tuple[str, int],
    targets: list[str],
    tally: Tally,
    done: Callable[[list[tuple[int, str]]], bool],
) -> list[tuple[int, str]]:
    """CONNECTs from CLIENTS threads, in rounds, until done(outcomes so far) or a bound."""
    outcomes: list[tuple[int, str]] = []
    deadline = time.monotonic() + PHASE_SECONDS
    with ThreadPoolExecutor(CLIENTS) as pool:
        while len(outcomes) < MAX_REQUESTS and time.monotonic() < deadline:
            batch = [targets[(len(outcomes) + i) % len(targets)] for i in range(CLIENTS * 8)]
            for outcome in pool.map(lambda target: connect(proxy, target), batch):
                tally.add(outcome)
                outcomes.append(outcome)
            if done(outcomes):
                return outcomes
            if last_are(outcomes, len(batch), refused=True):
                time.sleep(0.02)  # refused while the proxy waits to look again: no hurry
    runs: list[list[object]] = []
    for outcome in outcomes[-400:]:
        if runs and runs[-1][0] == outcome:
            runs[-1][1] = int(str(runs[-1][1])) + 1
        else:
            runs.append([outcome, 1])
    pytest.fail(f"bound reached after {len(outcomes)} requests: {Counter(outcomes)}; last: {runs}")


def last_are(outcomes: list[tuple[int, str]], count: int, refused: bool) -> bool:
    tail = outcomes[-count:]
    return len(tail) == count and all(
        ((status, reason) == (503, "audit_unavailable")) == refused for status, reason in tail
    )


# -- the serve process ---------------------------------------------------------------------------


class Serve:
    def __init__(self, argv: list[str], workdir: Path) -> None:
        self.stdout_path = workdir / "serve.stdout"
        self.stderr_path = workdir / "serve.stderr"
        # EGRESSBOX_PURE passes through: the proxy runs the same core as the test run.
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def ready(self) -> tuple[str, int]:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            text = self.stdout_path.read_text()
            if "\n" in text:
                host, _, port = json.loads(text.split("\n", 1)[0])["http"].rpartition(":")
                return host, int(port)
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode}:\n{self.stderr()}")
            time.sleep(0.02)
        pytest.fail(f"no ready line within {READY_TIMEOUT} s:\n{self.stderr()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(EXIT_TIMEOUT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(EXIT_TIMEOUT)


def check_log(data: bytes) -> list[AuditRecord]:
    """Every line a whole six-key record in record_line's spelling; torn lines fail."""
    assert data.endswith(b"\n"), f"the log ends in a fragment: {data[-200:]!r}"
    records = []
    for number, raw in enumerate(data.split(b"\n")[:-1], start=1):
        line = raw.decode("ascii")
        loaded = json.loads(line)
        assert set(loaded) == RECORD_KEYS, f"line {number}: {line!r}"
        record = parse_record(line)
        assert record.to_json() == line, f"line {number} is not as written: {line!r}"
        records.append(record)
    return records


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_through_a_full_disk(
    tmpfs: Tmpfs, origin: EchoOrigin, tmp_path: Path, workers: int
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[egress]\nallow = ["127.0.0.1:{origin.port}"]\nallow_cidrs = ["127.0.0.0/8"]\n'
        "[limits]\ndrain_timeout = 2\n"
    )
    log = tmpfs.mountpoint / "audit.jsonl"
    argv = [sys.executable, "-m", "egressbox", "serve", "--policy", str(policy), "--quiet"]
    argv += ["--audit-log", str(log), "--workers", str(workers)]
    serve = Serve(tmpfs.inside(*argv), tmp_path)
    try:
        proxy = serve.ready()
        targets = [f"127.0.0.1:{origin.port}", f"{LONG_DENIED}:443", f"{LONG_DENIED}:443"]
        tally = Tally()

        # 1. Space: every request answered.
        before = requests_until(proxy, targets, tally, lambda seen: len(seen) >= 100)
        assert tally.refused == 0

        # 2. The disk fills up while clients keep coming: the reserve carries on a while,
        #    then every request is refused (and no record torn).
        filling = threading.Thread(target=tmpfs.fill)
        filling.start()
        during = requests_until(
            proxy, targets, tally, lambda seen: not filling.is_alive() and last_are(seen, 64, True)
        )
        filling.join()
        refused = tally.refused
        assert refused >= 64
        answered_while_full = tally.answered - sum(1 for s, _ in before if s in (200, 403))

        # 3. Space again: admission resumes (each worker asks its sink within a second).
        tmpfs.free()
        after = requests_until(proxy, targets, tally, lambda seen: last_are(seen, 100, False))
        recovered = sum(1 for status, _ in after if status in (200, 403))
        assert serve.stop() == 0
    finally:
        serve.kill()

    assert tally.other is None, tally.other
    err = serve.stderr()
    assert "audit log cannot be written" in err, err
    assert "audit log can be written again" in err, err
    data = tmpfs.host_path("audit.jsonl").read_bytes()
    records = check_log(data)
    torn = data.count(b"\n") - len(records)
    # One record per answered request, none for a refused one.
    assert len(records) == tally.answered
    assert sum(1 for r in records if r.port == origin.port) == sum(
        1 for outcome in before + during + after if outcome[0] == 200
    )
    print(
        f"\nworkers={workers}: {len(before) + len(during) + len(after)} requests, "
        f"{len(records)} records written ({answered_while_full} after the disk filled, "
        f"{recovered} after space returned), {tally.refused} refused with 503 "
        f"audit_unavailable ({refused} while full, the rest until the retry found space), "
        f"{torn} torn"
    )


# -- the fallback: no fallocate, several writers --------------------------------------------------

WRITERS = 3
FALLBACK_CHILD = r"""
import errno, json, multiprocessing, os, sys, time
from datetime import datetime, UTC
from egressbox.audit import record as audit
from egressbox.audit.record import AuditProtocol, AuditRecord, JsonlFileSink
from egressbox.core.errors import AuditError, Reason, Verdict

directory, writers = sys.argv[1], int(sys.argv[2])
log, filler = os.path.join(directory, "audit.jsonl"), os.path.join(directory, "filler")
audit._allocate = lambda fd, offset, length: errno.EOPNOTSUPP  # as without fallocate
with open(filler, "wb") as f:
    f.write(b"\0" * (512 * 1024))  # freed later: the space that comes back
ctx = multiprocessing.get_context("fork")
ok, short, failed, streak = (ctx.Array("q", writers) for _ in range(4))
rounds = ctx.Value("i", 0)
deadline = time.monotonic() + 60

def writer(index):
    sink = JsonlFileSink(log)
    n = 0
    while rounds.value < 2 and time.monotonic() < deadline and n < 2_000_000:
        n += 1
        # Varying lengths: the file system runs out at every offset within a record.
        host = f"w{index}-" + "x" * (n % 61) + ".example"
        record = AuditRecord(datetime.now(UTC), AuditProtocol.SOCKS5, host, n % 65536,
                             Verdict.DENY, Reason.NO_ALLOW_RULE)
        try:
            sink.write(record)
            ok[index] += 1
            streak[index] = 0
        except AuditError as exc:
            (short if "short write" in str(exc) else failed)[index] += 1
            streak[index] += 1
            time.sleep(0.001)
    sink.close()

procs = [ctx.Process(target=writer, args=(i,)) for i in range(writers)]
for p in procs:
    p.start()
for round_ in range(2):  # full, space freed, full again
    while time.monotonic() < deadline and min(streak[:]) < 20:  # every writer sees it full
        time.sleep(0.01)
    if round_ == 0:
        written = sum(ok[:])
        os.unlink(filler)
        while time.monotonic() < deadline and sum(ok[:]) < written + 100:
            time.sleep(0.001)
rounds.value = 2
for p in procs:
    p.join(30)
print(json.dumps({"ok": sum(ok[:]), "short": sum(short[:]), "failed": sum(failed[:]),
                  "timed_out": time.monotonic() >= deadline}))
"""


def test_without_fallocate_fragments_are_blanked(tmpfs: Tmpfs) -> None:
    done = subprocess.run(
        tmpfs.inside(sys.executable, "-c", FALLBACK_CHILD, str(tmpfs.mountpoint), str(WRITERS)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout)
    assert not counts["timed_out"], counts
    data = tmpfs.host_path("audit.jsonl").read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: nothing, or a blanked fragment
    assert tail.strip(b" ") == b"", f"torn tail: {tail[-200:]!r}"
    records = []
    blanked = 0
    for number, raw in enumerate(lines, start=1):
        line = raw.decode("ascii")
        assert set(json.loads(line)) == RECORD_KEYS, f"line {number}: {line!r}"
        record = parse_record(line)
        blanked += line != record.to_json()  # leading spaces: a fragment blanked there
        assert line.lstrip(" ") == record.to_json(), f"line {number}: {line!r}"
        records.append(record)
    assert len(records) == counts["ok"]  # every write that succeeded, none that failed
    assert counts["short"] >= 1  # the file system really ran out in mid-record
    print(
        f"\nno fallocate, {WRITERS} writers: {counts['ok']} records written, "
        f"{counts['short']} short writes blanked ({blanked} lines start with spaces, "
        f"{len(tail)} trailing), {counts['failed']} refused with ENOSPC, 0 torn"
    )
