"""`egressbox connect HOST PORT` relays a pipe through a running proxy, decided and audited."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

TIMEOUT = 60.0


@pytest.fixture
def echo() -> Iterator[int]:
    """A loopback TCP server that sends back what it gets, upper-cased."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(TIMEOUT)

    def serve() -> None:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data.upper())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.fixture
def serve(tmp_path: Path, echo: int) -> Iterator[tuple[dict[str, str], Path]]:
    policy = tmp_path / "p.toml"
    policy.write_text(
        f'[egress]\nallow = ["127.0.0.1:{echo}"]\nallow_cidrs = ["127.0.0.1/32"]\n',
        encoding="utf-8",
    )
    log = tmp_path / "audit.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "egressbox",
            "serve",
            "--policy",
            str(policy),
            "--quiet",
            "--audit-log",
            str(log),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        yield ready, log
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)


def _connect(*args: str, data: bytes, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "egressbox", "connect", *args],
        input=data,
        capture_output=True,
        timeout=TIMEOUT,
        env={"PATH": os.environ.get("PATH", "")} | env,
        check=False,
    )


@pytest.mark.parametrize("scheme", ["http", "socks5"])
def test_bytes_flow_both_ways_through_the_proxy(
    serve: tuple[dict[str, str], Path], echo: int, scheme: str
) -> None:
    ready, log = serve
    address = ready["http"] if scheme == "http" else ready["socks5"]
    done = _connect(
        "127.0.0.1", str(echo), data=b"hello\n", env={"ALL_PROXY": f"{scheme}://{address}"}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"HELLO\n"
    record = json.loads(log.read_text(encoding="utf-8").splitlines()[-1])
    assert (record["host"], record["port"], record["decision"]) == ("127.0.0.1", echo, "allow")


def test_a_refused_destination_says_why(serve: tuple[dict[str, str], Path]) -> None:
    ready, _ = serve
    done = _connect("127.0.0.1", "9", data=b"", env={"https_proxy": f"http://{ready['http']}"})
    assert done.returncode == 1
    assert b"the proxy refused 127.0.0.1:9" in done.stderr and b"no_allow_rule" in done.stderr


def test_without_a_proxy_it_says_how_to_name_one() -> None:
    done = _connect("example.com", "22", data=b"", env={})
    assert done.returncode == 1 and b"pass --proxy URL" in done.stderr
