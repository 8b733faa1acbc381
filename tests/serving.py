"""Helpers for the tests that run `egressbox serve` as a process for its production features
(admin listener, watched policy, socket activation, the fleet): start it with its output in
files, read its ready line, ask its admin listener, read its audit log.

Every wait is bounded (READY_TIMEOUT, IO_TIMEOUT); every address is on loopback.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

READY_TIMEOUT = 30.0
EXIT_TIMEOUT = 30.0
IO_TIMEOUT = 10.0
POLL = 0.05
RECORD_KEYS = {"ts", "protocol", "host", "port", "decision", "reason"}


def split_authority(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without EGRESSBOX_*, systemd's or proxy variables."""
    drop = ("LISTEN_", "NOTIFY_SOCKET", "EGRESSBOX_")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(drop) and "proxy" not in k.lower() and k != "EGRESSBOX_PURE"
    }
    if "EGRESSBOX_PURE" in os.environ:
        env["EGRESSBOX_PURE"] = os.environ["EGRESSBOX_PURE"]
    env.update(extra or {})
    return env


class ServeProcess:
    """One `egressbox serve` process with stdout and stderr in files."""

    def __init__(
        self,
        args: Sequence[str],
        workdir: Path,
        *,
        env: Mapping[str, str] | None = None,
        pass_fds: Sequence[int] = (),
        launcher: Sequence[str] = (),
    ) -> None:
        """`launcher` runs first and is given serve's argv (it must exec it)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = workdir / "serve.stdout"
        self.stderr_path = workdir / "serve.stderr"
        argv = [*launcher, sys.executable, "-m", "egressbox", "serve", *args]
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=clean_env(env),
                pass_fds=tuple(pass_fds),
            )
        self.ready: dict[str, str] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def wait_ready(self) -> dict[str, str]:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            text = self.stdout()
            if "\n" in text:
                loaded = json.loads(text.split("\n", 1)[0])
                self.ready = {str(k): str(v) for k, v in loaded.items()}
                return self.ready
            code = self.proc.poll()
            if code is not None:
                pytest.fail(f"serve exited with {code} before its ready line:\n{self.stderr()}")
            time.sleep(POLL)
        pytest.fail(f"no ready line within {READY_TIMEOUT} s:\n{self.stderr()}")

    def address(self, kind: str) -> tuple[str, int]:
        return split_authority(self.ready[kind])

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.send(signal.SIGTERM)
        return self.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(EXIT_TIMEOUT)

    def wait_stderr(self, text: str, count: int = 1, timeout: float = IO_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            err = self.stderr()
            if err.count(text) >= count:
                return err
            time.sleep(POLL)
        pytest.fail(f"{text!r} not seen {count}x on stderr:\n{self.stderr()}")


@contextlib.contextmanager
def serving(workdir: Path, *args: str, ready: bool = True, **kwargs: Any) -> Iterator[ServeProcess]:
    process = ServeProcess(args, workdir, **kwargs)
    try:
        if ready:
            process.wait_ready()
        yield process
    finally:
        process.kill()


def admin_get(
    authority: str, path: str, headers: Mapping[str, str] | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-cased headers, body) of one request to an admin listener."""
    host, port = split_authority(authority)
    conn = http.client.HTTPConnection(host, port, timeout=IO_TIMEOUT)
    try:
        conn.request(method, path, headers=dict(headers or {}))
        response = conn.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        conn.close()


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a text exposition, by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def total(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def audit_lines(path: Path) -> list[dict[str, Any]]:
    """The records of an audit log: every line whole, exactly the six keys."""
    records: list[dict[str, Any]] = []
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        assert set(record) == RECORD_KEYS, line
        records.append(record)
    return records


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def wait_until(what: str, check: Callable[[], bool], timeout: float = IO_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(POLL)
    pytest.fail(f"not within {timeout} s: {what}")


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


class EchoServer:
    """A threaded TCP echo server on 127.0.0.1."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(IO_TIMEOUT)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


def connect_through(proxy: tuple[str, int], target: str) -> tuple[socket.socket, int]:
    """CONNECT through an HTTP proxy: (the socket, the status)."""
    sock = socket.create_connection(proxy, timeout=IO_TIMEOUT)
    try:
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                raise EOFError(f"closed inside the response head: {data!r}")
            data += chunk
    except BaseException:
        sock.close()
        raise
    return sock, int(data.split(b" ", 2)[1])


def policy_text(allow: Sequence[str], *, limits: Mapping[str, float] | None = None) -> str:
    lines = ["[egress]", f"allow = {json.dumps(list(allow))}", 'allow_cidrs = ["127.0.0.0/8"]']
    if limits:
        lines.append("[limits]")
        lines += [f"{key} = {value}" for key, value in limits.items()]
    return "\n".join(lines) + "\n"
