"""A fleet on one machine: HAProxy (TCP mode, PROXY protocol v2) in front of three `serve`
instances, a real Prometheus scraping their admin listeners every second, bounded load
through HAProxy, and one instance drained with SIGTERM in the middle.

What must hold: no request HAProxy accepted fails (every one gets its right answer), the
decisions Prometheus scraped add up to the audit records each instance wrote, and the audit
logs hold exactly one whole record per request: none lost, none torn.

The drain is the production one: HAProxy checks /readyz on each admin listener; SIGTERM turns
it 503 at once while `--drain-delay` keeps the proxy accepting, so HAProxy takes the instance
out before its listeners close. A tunnel held open to the drained instance keeps it in its
drain until Prometheus has scraped its last numbers (a process that exits takes its counters
with it; the audit log is the record that stays).

Everything listens on 127.0.0.1. Skips when Debian's haproxy or prometheus is not installed.
"""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from egressbox.cli import build_parser
from serving import (
    IO_TIMEOUT,
    EchoServer,
    ServeProcess,
    admin_get,
    audit_lines,
    free_port,
    policy_text,
    split_authority,
    wait_until,
    write_atomically,
)

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sys.platform != "linux", reason="serve is tested on Linux"),
]

INSTANCES = 3
CLIENTS = 6
# Bounds of the load: requests in all, and seconds; and each client's pause between two
# requests (at most about CLIENTS / PAUSE requests a second, whatever the machine's speed).
MAX_REQUESTS = 20000
MAX_LOAD_SECONDS = 60.0
PAUSE = 0.01
# Requests each instance serves before one is drained, and after it is gone.
BEFORE_DRAIN = 30
AFTER_DRAIN = 60
# --drain-delay: HAProxy's check (every 200 ms, down after one failure) notices the 503 well
# within it. [limits] drain_timeout bounds how long the held tunnel keeps the drain going.
DRAIN_DELAY = 2
DRAIN_TIMEOUT = 60
SCRAPE_TIMEOUT = 30.0
PROXY_V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"


def _need(program: str, package: str) -> str:
    path = shutil.which(program) or (
        f"/usr/sbin/{program}" if Path(f"/usr/sbin/{program}").exists() else None
    )
    if path is None:
        pytest.skip(
            f"{program} is not installed (Debian's {package} package; scripts/setup --test)"
        )
    return path


def _need_proxy_protocol() -> None:
    try:
        build_parser("serve").parse_args(["serve", "--policy", "x", "--proxy-protocol"])
    except SystemExit:
        pytest.skip("serve --proxy-protocol is not available")


# -- the pieces ----------------------------------------------------------------------------


class Origin:
    """An HTTP origin on 127.0.0.1: GET /N answers `N` (threads, one per connection)."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                body = self.path.lstrip("/").encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port: int = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(IO_TIMEOUT)


@dataclass
class Instance:
    name: str
    process: ServeProcess
    log: Path

    @property
    def http(self) -> tuple[str, int]:
        return self.process.address("http")

    @property
    def admin(self) -> str:
        return self.process.ready["admin"]


class HAProxy:
    def __init__(self, binary: str, workdir: Path, instances: list[Instance]) -> None:
        self.port = free_port()
        self.stats = workdir / "haproxy.sock"
        servers = []
        for item in instances:
            host, port = item.http
            admin_port = split_authority(item.admin)[1]
            servers.append(
                f"    server {item.name} {host}:{port} send-proxy-v2 check port {admin_port}"
            )
        config = workdir / "haproxy.cfg"
        config.write_text(
            "\n".join(
                [
                    "global",
                    "    maxconn 2000",
                    f"    stats socket {self.stats} mode 600 level admin",
                    "defaults",
                    "    mode tcp",
                    "    timeout connect 2s",
                    "    timeout client 30s",
                    "    timeout server 30s",
                    "    timeout check 1s",
                    "    retries 3",
                    "    option redispatch",
                    "frontend proxy",
                    f"    bind 127.0.0.1:{self.port}",
                    "    default_backend egressbox",
                    "backend egressbox",
                    "    balance roundrobin",
                    "    option httpchk GET /readyz",
                    "    http-check expect status 200",
                    "    default-server inter 200ms fall 1 rise 2",
                    *servers,
                    "",
                ]
            )
        )
        self.output = (workdir / "haproxy.out").open("wb")
        self.proc = subprocess.Popen(
            [binary, "-db", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=self.output,
            stderr=subprocess.STDOUT,
        )

    def states(self) -> dict[str, str]:
        """Each server's status (UP, DOWN, ...) from the stats socket."""
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(IO_TIMEOUT)
                sock.connect(str(self.stats))
                sock.sendall(b"show stat\n")
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
        except OSError:
            return {}
        lines = data.decode().splitlines()
        if not lines or not lines[0].startswith("# "):
            return {}
        header = lines[0][2:].split(",")
        found = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(","), strict=False))
            if row.get("pxname") == "egressbox" and row.get("svname", "").startswith("s"):
                found[row["svname"]] = row.get("status", "")
        return found

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(IO_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(IO_TIMEOUT)
        self.output.close()


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: list[str]) -> None:
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
                    "scrape_configs": [
                        {"job_name": "egressbox", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        storage = workdir / "tsdb"
        storage.mkdir()
        self.output = (workdir / "prometheus.out").open("wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={storage}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self.output,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=IO_TIMEOUT) as response:
            return json.loads(response.read())

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/-/ready", timeout=IO_TIMEOUT
            ) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def by_instance(self, query: str) -> dict[str, float]:
        answer = self.get("/api/v1/query", query=query)
        assert answer["status"] == "success", answer
        return {
            item["metric"].get("instance", ""): float(item["value"][1])
            for item in answer["data"]["result"]
        }

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(IO_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(IO_TIMEOUT)
        self.output.close()


def proxy_v2_header(source: tuple[str, int], destination: tuple[str, int]) -> bytes:
    """A PROXY protocol v2 header for a TCP over IPv4 connection (as HAProxy sends it)."""
    addresses = (
        ipaddress.IPv4Address(source[0]).packed
        + ipaddress.IPv4Address(destination[0]).packed
        + source[1].to_bytes(2, "big")
        + destination[1].to_bytes(2, "big")
    )
    return PROXY_V2_SIGNATURE + bytes([0x21, 0x11]) + len(addresses).to_bytes(2, "big") + addresses


def held_tunnel(instance: Instance, echo_port: int) -> socket.socket:
    """A tunnel straight to `instance` (with the header a trusted balancer would send)."""
    sock = socket.create_connection(instance.http, timeout=IO_TIMEOUT)
    local = sock.getsockname()
    sock.sendall(proxy_v2_header(local, instance.http))
    target = f"127.0.0.1:{echo_port}"
    sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, f"closed: {head!r}"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200 "), head
    return sock


# -- the load ---------------------------------------------------------------------------------


@dataclass
class Load:
    """Clients sending one request per connection through HAProxy: allowed GETs (200 and the
    body) and denied ones (403); anything else is a failure."""

    frontend: tuple[str, int]
    origin_port: int
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: int = 0
    allowed: int = 0
    failures: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        deadline = time.monotonic() + MAX_LOAD_SECONDS
        for client in range(CLIENTS):
            thread = threading.Thread(target=self._client, args=(client, deadline), daemon=True)
            self.threads.append(thread)
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(MAX_LOAD_SECONDS)

    def _client(self, client: int, deadline: float) -> None:
        sequence = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            with self.lock:
                if self.done >= MAX_REQUESTS:
                    return
            sequence += 1
            allowed = sequence % 4 != 0
            outcome = self._request(f"{client}-{sequence}", allowed)
            with self.lock:
                self.done += 1
                self.allowed += allowed
                if outcome:
                    self.failures.append(outcome)
            time.sleep(PAUSE)

    def _request(self, token: str, allowed: bool) -> str:
        host = f"127.0.0.1:{self.origin_port}" if allowed else "denied.test"
        request = f"GET http://{host}/{token} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
        try:
            with socket.create_connection(self.frontend, timeout=IO_TIMEOUT) as sock:
                sock.sendall(request.encode())
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
        except OSError as exc:
            return f"{token}: {exc!r}"
        head, _, body = data.partition(b"\r\n\r\n")
        status = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b"?"
        if allowed and (status != b"200" or body != token.encode()):
            return f"{token}: {head[:80]!r} {body[:40]!r}"
        if not allowed and status != b"403":
            return f"{token}: {head[:80]!r}"
        return ""


# -- the test -------------------------------------------------------------------------------


@pytest.fixture
def fleet_binaries() -> tuple[str, str]:
    _need_proxy_protocol()
    return _need("haproxy", "haproxy"), _need("prometheus", "prometheus")


@contextlib.contextmanager
def started(tmp_path: Path, origin: Origin, echo: EchoServer) -> Iterator[list[Instance]]:
    policy = tmp_path / "policy.toml"
    allow = [f"127.0.0.1:{origin.port}", f"127.0.0.1:{echo.port}"]
    write_atomically(policy, policy_text(allow, limits={"drain_timeout": DRAIN_TIMEOUT}))
    instances: list[Instance] = []
    try:
        for index in range(INSTANCES):
            name = f"s{index + 1}"
            log = tmp_path / f"{name}.audit.jsonl"
            process = ServeProcess(
                [
                    "--policy", str(policy),
                    "--proxy-protocol",
                    "--admin", "127.0.0.1:0",
                    "--audit-log", str(log),
                    "--drain-delay", str(DRAIN_DELAY),
                    "--quiet",
                ],
                tmp_path / name,
            )  # fmt: skip
            instances.append(Instance(name, process, log))
        for item in instances:
            item.process.wait_ready()
        yield instances
    finally:
        for item in instances:
            item.process.kill()


def test_fleet_behind_haproxy_drains_one_instance_and_prometheus_adds_up(
    tmp_path: Path, fleet_binaries: tuple[str, str]
) -> None:
    haproxy_bin, prometheus_bin = fleet_binaries
    origin, echo = Origin(), EchoServer()
    with contextlib.ExitStack() as stack:
        stack.callback(origin.close)
        stack.callback(echo.close)
        instances = stack.enter_context(started(tmp_path, origin, echo))
        balancer = HAProxy(haproxy_bin, tmp_path, instances)
        stack.callback(balancer.close)
        prometheus = Prometheus(prometheus_bin, tmp_path, [i.admin for i in instances])
        stack.callback(prometheus.close)
        names = {i.name for i in instances}
        wait_until(
            "HAProxy sees every instance up",
            lambda: balancer.states() == dict.fromkeys(names, "UP"),
            timeout=30,
        )
        wait_until("Prometheus is ready", prometheus.ready, timeout=60)
        wait_until(
            "Prometheus scrapes every instance",
            lambda: prometheus.by_instance("up") == {i.admin: 1.0 for i in instances},
            timeout=SCRAPE_TIMEOUT,
        )
        drained = instances[1]
        tunnel = held_tunnel(drained, echo.port)
        stack.callback(tunnel.close)

        load = Load(("127.0.0.1", balancer.port), origin.port)
        load.start()
        try:
            wait_until(
                "load reaches every instance",
                lambda: all(len(audit_lines(i.log)) >= BEFORE_DRAIN for i in instances),
                timeout=MAX_LOAD_SECONDS,
            )
            drained.process.send(signal.SIGTERM)
            # /readyz said 503: HAProxy takes it out (within the drain delay).
            wait_until(
                "HAProxy takes the drained instance out",
                lambda: balancer.states().get(drained.name) == "DOWN",
                timeout=DRAIN_DELAY,
            )
            assert admin_get(drained.admin, "/readyz")[0] == 503
            wait_until(
                "the drained instance closes its listener",
                lambda: _refuses(drained.http),
                timeout=DRAIN_DELAY + IO_TIMEOUT,
            )
            at_close = {i.name: len(audit_lines(i.log)) for i in instances}
            wait_until(
                "load goes on through the others",
                lambda: all(
                    len(audit_lines(i.log)) >= at_close[i.name] + AFTER_DRAIN
                    for i in instances
                    if i is not drained
                ),
                timeout=MAX_LOAD_SECONDS,
            )
        finally:
            load.finish()
        assert load.failures == [], load.failures[:10]
        assert load.done > INSTANCES * BEFORE_DRAIN

        # Every decision Prometheus scraped is a record in the instance's own log, and
        # every record is one decision: per instance, and by decision.
        def scraped() -> dict[str, float]:
            return prometheus.by_instance(
                "sum by (instance) (last_over_time(egressbox_decisions_total[10m]))"
            )

        def written() -> dict[str, float]:
            return {i.admin: float(len(audit_lines(i.log))) for i in instances}

        wait_until("Prometheus has every instance's last numbers",
                   lambda: scraped() == written(), timeout=SCRAPE_TIMEOUT)  # fmt: skip
        # The drained instance is still draining (the tunnel): it still relays, then ends.
        tunnel.sendall(b"ping")
        assert tunnel.recv(4) == b"ping"
        tunnel.close()
        assert drained.process.wait() == 0
        for item in instances:
            if item is not drained:
                assert item.process.stop() == 0

        # The logs: one whole record per request and one for the held tunnel, none torn.
        records = []
        for item in instances:
            text = item.log.read_text()
            assert text.endswith("\n")
            records += audit_lines(item.log)
        assert len(records) == load.done + 1
        allowed = sum(1 for r in records if r["decision"] == "allow")
        assert allowed == load.allowed + 1
        assert {r["reason"] for r in records} == {"allowed", "no_allow_rule"}
        assert len(audit_lines(drained.log)) >= BEFORE_DRAIN
        by_decision = prometheus.by_instance(
            'sum(last_over_time(egressbox_decisions_total{decision="allow"}[10m]))'
        )
        assert list(by_decision.values()) == [float(allowed)]


def _refuses(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=IO_TIMEOUT).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        # The listener is closing as the SYN arrives; the next poll is refused.
        return False
    return False
