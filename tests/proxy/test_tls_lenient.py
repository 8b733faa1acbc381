"""The TLS name check fails closed: judged against Go's crypto/tls, the most lenient server.

Go's server takes a first record of any version below 0x1000 and drops warning alerts
before the ClientHello (FIELD-NOTES; crypto/tls/conn.go). A real handshake to a denied
name in such a variant must be refused by the proxy, over CONNECT, SOCKS5 and a captured
connection; the same variant to the target's own name must work end to end.

Real peers on loopback: the Go origin is built at test time from tests/go/tlsorigin
(skipped, with the reason, when `go` is missing) and logs, per connection, the server
name of a completed handshake or how many bytes reached it. The client is Python's ssl
with its first flight rewritten (tests/tls_variant_client.py). Everything is judged from
the host side: the Go origin's log and the proxy's audit records.

The Go origin is also the oracle of the agreement test: first flights of Python's ssl,
Go and OpenSSL clients, in every variant and mutated at random, are fed to Go's own
server; whatever Go reads a ClientHello from, the reader must read to the same name or
refuse, and `tls_hellos.go_record_layer` (the fuzz target's model of Go) must read too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dnsserver import A, DnsServer
from egressbox.protocols.tls import (
    NOT_TLS,
    ClientHello,
    ClientHelloReader,
    Malformed,
    TlsError,
    parse_client_hello,
    starts_tls_record,
)
from proxy_fixtures import IO_TIMEOUT, Wire
from tls_hellos import (
    go_record_layer,
    handshake_message,
    lenient_variants,
    openssl_flight,
    real_hello,
)
from tls_variant_client import Outcome, handshake
from unprivileged import invoking_actor

if TYPE_CHECKING:
    from egressbox.proxy.server import EgressProxy
    from proxy_fixtures import TlsFiles

pytestmark = pytest.mark.usefixtures("dials")

TESTS = Path(__file__).resolve().parents[1]
GO_SOURCE = TESTS / "go" / "tlsorigin"
BUILD_TIMEOUT = 300  # seconds: Go compiles crypto/tls from source on a cold cache
NAME = "tls.ok.test"  # the certificate's name; BASE_POLICY admits *.ok.test
DENIED = "denied.example"  # no allow entry admits it
VARIANTS = list(lenient_variants(real_hello("example.com")))
GO_REFUSES = {"alert_and_ccs"}  # Go refuses a CCS before its hello; the proxy reads past it
MUTATIONS = 120  # random record-layer mutations per first flight in the agreement test
RUN_TIMEOUT = 180.0  # one `egressbox run` with every variant inside


# -- the Go origin ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tlsorigin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/go/tlsorigin built into a temporary directory (its own Go cache)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed: no Go crypto/tls origin to judge against")
    folder = tmp_path_factory.mktemp("go")
    binary = folder / "tlsorigin"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(folder),
        "GOCACHE": str(folder / "cache"),
        "GOPATH": str(folder / "gopath"),
        "GO111MODULE": "off",  # one file, the standard library only
        "CGO_ENABLED": "0",
        "GOTOOLCHAIN": "local",  # never download a toolchain
    }
    done = subprocess.run(
        [go, "build", "-o", str(binary), "."],
        cwd=GO_SOURCE,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, f"go build failed: {done.stderr[-2000:]}"
    return binary


@dataclass
class GoOrigin:
    """`tlsorigin serve`: its port, and one event per connection it has finished."""

    process: subprocess.Popen[str]
    port: int = 0
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    events: list[dict[str, Any]] = field(default_factory=list)

    def wait_events(self, count: int) -> list[dict[str, Any]]:
        """Until `count` connections have ended (bounded by IO_TIMEOUT each)."""
        while len(self.events) < count:
            self.events.append(json.loads(self.lines.get(timeout=IO_TIMEOUT)))
        return self.events


@pytest.fixture
def go_origin(tlsorigin: Path, tls_files: TlsFiles) -> Iterator[GoOrigin]:
    process = subprocess.Popen(
        [str(tlsorigin), "serve", str(tls_files.cert), str(tls_files.key)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    origin = GoOrigin(process)
    assert process.stdout is not None
    stdout = process.stdout

    def pump() -> None:
        for line in stdout:
            origin.lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        first = origin.lines.get(timeout=IO_TIMEOUT)
        assert first.startswith("port "), first
        origin.port = int(first.split()[1])
        yield origin
    finally:
        process.terminate()
        try:
            process.wait(timeout=IO_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- clients ----------------------------------------------------------------------------------


def via_connect(address: tuple[str, int], port: int) -> socket.socket:
    sock = socket.create_connection(address, timeout=IO_TIMEOUT)
    authority = f"{NAME}:{port}"
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(1)  # byte by byte: nothing after the head may be taken
        assert data, head
        head += data
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, data
        data += chunk
    return data


def via_socks5(address: tuple[str, int], port: int) -> socket.socket:
    sock = socket.create_connection(address, timeout=IO_TIMEOUT)
    sock.sendall(Wire.socks_hello(NAME, port, as_domain=True))
    assert recv_exactly(sock, 2) == b"\x05\x00"  # no authentication
    head = recv_exactly(sock, 4)
    assert head[:3] == b"\x05\x00\x00", head  # succeeded
    size = {1: 4, 4: 16}.get(head[3]) or recv_exactly(sock, 1)[0]
    recv_exactly(sock, size + 2)  # the bound address and port
    return sock


ROUTES = {"connect": via_connect, "socks5": via_socks5}


async def through(
    proxy: EgressProxy, route: str, port: int, sni: str, variant: str, cafile: str | None
) -> Outcome:
    """One variant handshake through the proxy (the blocking client in a thread)."""
    address = proxy.http_address if route == "connect" else proxy.socks_address
    assert address is not None

    def run() -> Outcome:
        with ROUTES[route](address, port) as sock:
            return handshake(sock, sni, variant, cafile)

    return await asyncio.wait_for(asyncio.to_thread(run), IO_TIMEOUT * 2)


# -- Go takes every variant: the attack is real ---------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_go_completes_each_variant_for_any_name_without_the_proxy(
    go_origin: GoOrigin, variant: str
) -> None:
    with socket.create_connection(("127.0.0.1", go_origin.port), timeout=IO_TIMEOUT) as sock:
        outcome = handshake(sock, DENIED, variant)
    [event] = go_origin.wait_events(1)
    if variant in GO_REFUSES:
        assert outcome.error and event["event"] == "failed", (outcome, event)
        assert "does not look like a TLS handshake" in event["error"]
        return
    assert outcome.answer == f"hello from go {DENIED}\n", outcome
    assert (event["event"], event["sni"], event["answered"]) == ("handshake", DENIED, True)


# -- through the proxy --------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["connect", "socks5"])
@pytest.mark.parametrize("variant", VARIANTS)
async def test_a_denied_name_in_each_variant_is_refused(
    proxy: EgressProxy, go_origin: GoOrigin, wire: Wire, route: str, variant: str
) -> None:
    outcome = await through(proxy, route, go_origin.port, DENIED, variant, None)
    assert outcome.error and not outcome.answer, outcome
    await wire.wait_for_records(proxy, 2)
    assert wire.summary(proxy.records) == [
        (route, NAME, go_origin.port, "allow", "allowed"),
        (route, NAME, go_origin.port, "deny", "sni_mismatch"),
    ]
    # The proxy dialled the origin, then closed it without sending a byte.
    [event] = await asyncio.to_thread(go_origin.wait_events, 1)
    assert (event["event"], event["bytes"]) == ("failed", 0), event


@pytest.mark.parametrize("route", ["connect", "socks5"])
@pytest.mark.parametrize("variant", VARIANTS)
async def test_the_target_name_in_each_variant_works_end_to_end(
    proxy: EgressProxy,
    go_origin: GoOrigin,
    tls_files: TlsFiles,
    wire: Wire,
    route: str,
    variant: str,
) -> None:
    outcome = await through(proxy, route, go_origin.port, NAME, variant, str(tls_files.cert))
    [event] = await asyncio.to_thread(go_origin.wait_events, 1)
    assert wire.summary(proxy.records) == [(route, NAME, go_origin.port, "allow", "allowed")]
    if variant in GO_REFUSES:  # relayed unchanged; Go itself refuses the CCS
        assert outcome.error and event["event"] == "failed" and event["bytes"] > 0, event
        return
    assert outcome.answer == f"hello from go {NAME}\n", outcome
    assert (event["event"], event["sni"], event["answered"]) == ("handshake", NAME, True)


# -- a captured connection (egressbox run, no proxy variables) -------------------------------


@pytest.fixture
def capture_box(go_origin: GoOrigin, tmp_path: Path) -> Iterator[Path]:
    """A workspace with the client, for `egressbox run` whose policy admits the origin."""
    actor = invoking_actor()  # the check is the proxy's: the child's user changes nothing
    home = actor.make_dir("/tmp", "egressbox-tls-home-")
    workspace = actor.make_dir(home, "ws-")
    for helper in ("tls_variant_client.py", "tls_hellos.py"):
        shutil.copyfile(TESTS / helper, workspace / helper)
    (home / "policy.toml").write_text(
        f'[egress]\nallow = ["{NAME}:{go_origin.port}"]\nallow_cidrs = ["127.0.0.1/32"]\n',
        encoding="utf-8",
    )
    (home / "audit.jsonl").touch()
    try:
        yield workspace
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run_captured(workspace: Path, dns: DnsServer, port: int, requests: list[dict[str, str]]) -> str:
    """The client in a confined child, every proxy variable unset; its stdout."""
    (workspace / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    probe = run_confined(workspace, dns, ["/bin/cat", "/etc/resolv.conf"], subprocess.DEVNULL)
    if "127.0.0.53" not in probe.stdout:  # capture's resolver is not in the child's world
        pytest.skip(f"capture is not available here: {probe.stderr.strip()[-300:]}")
    (workspace.parent / "audit.jsonl").write_text("")
    with (workspace / "requests.jsonl").open("rb") as stdin:
        client = ["/usr/bin/python3", "tls_variant_client.py", NAME, str(port)]
        done = run_confined(workspace, dns, client, stdin)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def run_confined(
    workspace: Path, dns: DnsServer, command: list[str], stdin: Any
) -> subprocess.CompletedProcess[str]:
    actor = invoking_actor()
    host, dns_port = dns.nameserver
    argv = [
        *actor.egressbox,
        "run",
        "--quiet",
        "--policy",
        str(workspace.parent / "policy.toml"),
        "--audit-log",
        str(workspace.parent / "audit.jsonl"),
        "--nameserver",
        f"{host}:{dns_port}",
        "--",
        *command,
    ]
    env = actor.base_env(workspace.parent)
    if "EGRESSBOX_PURE" in os.environ:  # the pass under test: interpreted or compiled
        env["EGRESSBOX_PURE"] = os.environ["EGRESSBOX_PURE"]
    return subprocess.run(
        argv,
        env=env,
        cwd=workspace,
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )


@pytest.mark.skipif(sys.platform != "linux", reason="capture is Linux only")
@pytest.mark.timeout(600)
def test_each_variant_over_a_captured_connection(capture_box: Path, go_origin: GoOrigin) -> None:
    requests = [{"sni": sni, "variant": v} for v in VARIANTS for sni in (DENIED, NAME)]
    with DnsServer({NAME: [A("127.0.0.1")]}) as dns:
        stdout = run_captured(capture_box, dns, go_origin.port, requests)
    outcomes = [json.loads(line) for line in stdout.splitlines()]
    assert len(outcomes) == len(requests), stdout
    records = [
        json.loads(line) for line in (capture_box.parent / "audit.jsonl").read_text().splitlines()
    ]
    tcp = [
        (r["host"], r["port"], r["decision"], r["reason"])
        for r in records
        if r["protocol"] == "tcp"
    ]
    events = go_origin.wait_events(len(requests))
    # Judged from the host: Go completed handshakes for the target's name only...
    names = sorted(e["sni"] for e in events if e["event"] == "handshake")
    assert names == [NAME] * (len(VARIANTS) - len(GO_REFUSES)), events
    # ...the denied name never reached it (one connection per denial, not a byte)...
    empty = [e for e in events if e["event"] == "failed" and e["bytes"] == 0]
    assert len(empty) == len(VARIANTS), events
    # ...and each denial has its record.
    denials = [r for r in tcp if r[3] == "sni_mismatch"]
    assert denials == [(NAME, go_origin.port, "deny", "sni_mismatch")] * len(VARIANTS), tcp
    for outcome in outcomes:
        if outcome["sni"] == NAME and outcome["variant"] not in GO_REFUSES:
            assert outcome["answer"] == f"hello from go {NAME}\n", outcome
        elif outcome["sni"] == DENIED:
            assert outcome["error"] and not outcome["answer"], outcome


# -- agreement with the real Go -----------------------------------------------------------------


def go_flight(tlsorigin: Path, name: str) -> bytes:
    done = subprocess.run(
        [str(tlsorigin), "hello", name],
        capture_output=True,
        text=True,
        timeout=IO_TIMEOUT,
        check=True,
    )
    return bytes.fromhex(done.stdout.strip())


def mutate(flight: bytes, rng: random.Random) -> bytes:
    """A record-layer mutation: cut into records at random versions, with alerts, CCS and
    stray bytes between them, or one byte of the whole changed."""
    if rng.random() < 0.3:
        data = bytearray(flight)
        data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    message = handshake_message(flight)
    cuts = sorted(rng.sample(range(1, len(message)), rng.randrange(0, 5)))
    extras = [
        b"\x15\x03\x01\x00\x02\x01\x70",
        b"\x15\x00\x00\x00\x02\x01\x00",  # close_notify: Go stops
        b"\x15\x03\x03\x00\x02\x02\x28",  # fatal
        b"\x14\x03\x03\x00\x01\x01",
        b"\x17\x03\x03\x00\x01\x00",
        b"\x16\x03\x01\x00\x00",  # empty handshake record
    ]
    out = b""
    for start, end in zip([0, *cuts], [*cuts, len(message)], strict=True):
        if rng.random() < 0.3:
            out += rng.choice(extras)
        version = rng.choice([0x0301, 0x0303, 0x0201, 0x0000, 0x0F03, 0x0FFF, 0x1000, 0xFFFF])
        piece = message[start:end]
        out += bytes([22]) + version.to_bytes(2, "big") + len(piece).to_bytes(2, "big") + piece
    return out


def test_the_reader_and_the_model_agree_with_go(tlsorigin: Path, tmp_path: Path) -> None:
    flights = {
        "python": real_hello(NAME),
        "python_tls12": real_hello("a.example.org"),
        "go": go_flight(tlsorigin, NAME),
    }
    openssl = openssl_flight("openssl.example", IO_TIMEOUT)
    if openssl is not None:
        flights["openssl"] = openssl
    rng = random.Random(2026)
    vectors: dict[str, bytes] = {}
    for origin, flight in flights.items():
        vectors[origin] = flight
        for variant, data in lenient_variants(flight).items():
            vectors[f"{origin}-{variant}"] = data
        for index in range(MUTATIONS):
            vectors[f"{origin}-mutated-{index}"] = mutate(flight, rng)
    for key, data in vectors.items():
        (tmp_path / key).write_bytes(data)
    done = subprocess.run(
        [str(tlsorigin), "judge", *(str(tmp_path / key) for key in vectors)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        check=True,
    )
    judged = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(judged) == len(vectors)
    read_by_go = 0
    for verdict in judged:
        data = vectors[Path(verdict["file"]).name]
        ours = ClientHelloReader().feed(data)
        if starts_tls_record(data[0]):
            assert ours is not NOT_TLS, verdict
        if not verdict["hello"]:
            continue
        read_by_go += 1
        # What Go reads a ClientHello from: the model reads the same message...
        message = go_record_layer(data)
        assert message is not None and message[0] == 1, verdict
        with contextlib.suppress(TlsError):  # (we refuse more than Go: non-ASCII names)
            assert parse_client_hello(message[4:]).server_name == (verdict["sni"] or None)
        # ...and the reader the same name, or refuses; never "not TLS", never waits.
        assert isinstance(ours, ClientHello | Malformed), (verdict, ours)
        if isinstance(ours, ClientHello):
            assert ours.server_name == (verdict["sni"] or None), (verdict, ours)
    # Not a vacuous run: every unmutated flight and most variants were read by Go.
    assert read_by_go >= len(flights) * (len(VARIANTS) - len(GO_REFUSES) + 1)
