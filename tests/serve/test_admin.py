"""The admin listener (`serve --admin`): what it answers and refuses, its token, its metrics
(counted where the audit record is written), readiness through a drain, and workers."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dnsserver import DnsServer
from egressbox.audit.record import JsonlFileSink
from egressbox.net.resolve import DnsResolver
from egressbox.serve.admin import (
    ADMIN_HEAD_BYTES,
    TOKEN_ENV,
    AdminServer,
    parse_admin_address,
    read_token,
)
from egressbox.serve.metrics import DNS_BUCKETS, Exposition, Metrics, Snapshot, build_info
from proxy_fixtures import Curl, HttpOrigin, Origins, StartProxy
from serving import (
    EchoServer,
    admin_get,
    audit_lines,
    connect_through,
    metric_samples,
    policy_text,
    serving,
    total,
    wait_until,
    write_atomically,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="serve is tested on Linux")


class FixedStatus:
    def __init__(self, ready: bool = True, why: str = "") -> None:
        self.answer = (ready, why)

    def ready(self) -> tuple[bool, str]:
        return self.answer

    def metrics(self, accept: str) -> tuple[bytes, str]:
        return b"egressbox_x 1\n", "text/plain; version=0.0.4; charset=utf-8"


def admin(status: FixedStatus | None = None, token: str | None = None) -> AdminServer:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = AdminServer(sock, status or FixedStatus(), token=token)
    sock.close()
    return server


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def body_of(response: bytes) -> bytes:
    return response.split(b"\r\n\r\n", 1)[1]


# -- one request -------------------------------------------------------------------------


def test_health_readiness_and_metrics_paths() -> None:
    server = admin()
    assert status_of(server.respond(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
    assert body_of(server.respond(b"GET /readyz HTTP/1.1\r\n\r\n")) == b"ready\n"
    metrics = server.respond(b"GET /metrics?x=1 HTTP/1.0\r\nAccept: */*\r\n\r\n")
    assert status_of(metrics) == 200 and body_of(metrics) == b"egressbox_x 1\n"
    assert b"Connection: close\r\n" in metrics
    head = server.respond(b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert status_of(head) == 200 and body_of(head) == b""
    assert b"Content-Length: 14\r\n" in head


def test_not_ready_is_503_with_the_reason() -> None:
    server = admin(FixedStatus(False, "draining"))
    response = server.respond(b"GET /readyz HTTP/1.1\r\n\r\n")
    assert status_of(response) == 503
    assert body_of(response) == b"not ready: draining\n"
    # Liveness is not readiness: a draining process is still alive.
    assert status_of(server.respond(b"GET /healthz HTTP/1.1\r\n\r\n")) == 200


@pytest.mark.parametrize(
    ("head", "status"),
    [
        # Never a proxy: CONNECT, absolute-form, anything but three paths.
        (b"CONNECT example.com:443 HTTP/1.1\r\n\r\n", 400),
        (b"GET http://example.com/ HTTP/1.1\r\n\r\n", 400),
        (b"GET http://127.0.0.1/metrics HTTP/1.1\r\n\r\n", 400),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 405),
        (b"DELETE /readyz HTTP/1.1\r\n\r\n", 405),
        (b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET /other HTTP/1.1\r\n\r\n", 404),
        (b"GET / HTTP/1.1\r\n\r\n", 404),
        (b"GET /metrics HTTP/2.0\r\n\r\n", 400),
        (b"GET  /metrics HTTP/1.1\r\n\r\n", 400),
        (b"get /metrics HTTP/1.1\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nBad Field: x\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\nX: \x00\r\n\r\n", 400),
        (b"", 431),
    ],
)
def test_everything_else_is_refused(head: bytes, status: int) -> None:
    assert status_of(admin().respond(head)) == status


def test_the_token_guards_metrics_only() -> None:
    server = admin(token="s3cret-token")
    request = b"GET /metrics HTTP/1.1\r\n%s\r\n"
    refused = server.respond(request % b"")
    assert status_of(refused) == 401
    assert b'WWW-Authenticate: Bearer realm="egressbox"' in refused
    assert status_of(server.respond(request % b"Authorization: Bearer wrong\r\n")) == 401
    assert status_of(server.respond(request % b"Authorization: Basic s3cret-token\r\n")) == 401
    twice = b"Authorization: Bearer s3cret-token\r\nAuthorization: Bearer s3cret-token\r\n"
    assert status_of(server.respond(request % twice)) == 400
    assert status_of(server.respond(request % b"Authorization: Bearer s3cret-token\r\n")) == 200
    assert status_of(server.respond(request % b"authorization: bearer s3cret-token\r\n")) == 200
    assert status_of(server.respond(b"GET /healthz HTTP/1.1\r\n\r\n")) == 200
    assert status_of(server.respond(b"GET /readyz HTTP/1.1\r\n\r\n")) == 200


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("[::1]:0", ("::1", 0)),
        ("0.0.0.0:9464", ("0.0.0.0", 9464)),
    ],
)
def test_admin_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_admin_address(text) == expected


@pytest.mark.parametrize(
    "text", ["9464", "localhost:9464", "::1:9464", "127.0.0.1:", "127.0.0.1:70000", ":9464"]
)
def test_bad_admin_addresses(text: str) -> None:
    with pytest.raises(ValueError, match=r"."):
        parse_admin_address(text)


def test_token_sources(tmp_path: Path) -> None:
    env = {TOKEN_ENV: "from-env"}
    assert read_token(None, env) == "from-env"
    assert TOKEN_ENV not in env  # nothing serve starts inherits it
    path = tmp_path / "token"
    path.write_text("from-file\n")
    assert read_token(str(path), {}) == "from-file"
    with pytest.raises(ValueError, match="give one"):
        read_token(str(path), {TOKEN_ENV: "x"})
    for bad in ("", "two words", "line\nbreak", "x" * 5000):
        path.write_text(bad)
        with pytest.raises(ValueError, match=r"token"):
            read_token(str(path), {})
    with pytest.raises(ValueError, match="cannot read"):
        read_token(str(tmp_path / "missing"), {})
    assert read_token(None, {}) is None


# -- the listener, live ------------------------------------------------------------------


async def test_a_flood_of_slow_clients_is_bounded_and_the_listener_still_answers() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = AdminServer(sock, FixedStatus())
    await server.start()
    host, port = sock.getsockname()
    try:
        # Clients that send half a head and wait: each is cut off by the head deadline or
        # evicted by a newer connection, and at most ADMIN_MAX_CONNECTIONS are held at once.
        slow = [await asyncio.open_connection(host, port) for _ in range(40)]
        for _, writer in slow:
            writer.write(b"GET /metrics HTTP/1.1\r\n")
        await asyncio.sleep(0.2)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        # A bigger head than the limit is answered 431 and closed.
        big_reader, big_writer = await asyncio.open_connection(host, port)
        big_writer.write(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * ADMIN_HEAD_BYTES + b"\r\n\r\n")
        cut = 0
        for slow_reader, _ in slow:
            cut += await _read_all(slow_reader) == b""
        assert cut == len(slow)  # nobody was answered without a whole head
        answer = await _read_all(reader)
        # Answered, though every slot was taken: an idle connection made room for it.
        assert answer.startswith(b"HTTP/1.1 200 ")
        big = await _read_all(big_reader)
        assert big.startswith(b"HTTP/1.1 431 ")
        for _, slow_writer in slow:
            slow_writer.close()
        writer.close()
        big_writer.close()
        reader2, writer2 = await asyncio.open_connection(host, port)
        writer2.write(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert (await _read_all(reader2)).startswith(b"HTTP/1.1 200 ")
        writer2.close()
    finally:
        await server.close()


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the end; b"" for a connection reset (aborted) before any byte."""
    try:
        return await asyncio.wait_for(reader.read(), 15)
    except ConnectionResetError:
        return b""


# -- metrics: counted where the audit record is written ----------------------------------


def test_snapshots_round_trip_and_render_per_worker() -> None:
    from egressbox.audit.record import AuditProtocol
    from egressbox.core.errors import Reason, Verdict

    metrics = Metrics(3)
    metrics.decided(AuditProtocol.CONNECT, Verdict.ALLOW, Reason.ALLOWED)
    metrics.decided(AuditProtocol.CONNECT, Verdict.ALLOW, Reason.ALLOWED)
    metrics.decided(AuditProtocol.SOCKS5, Verdict.DENY, Reason.NO_ALLOW_RULE)
    metrics.dns_query(0.003, "answer")
    metrics.dns_query(99.0, "dns_timeout")
    metrics.relayed(10, 20)
    metrics.reloaded(False)
    shot = metrics.snapshot(connections=1, tunnels=2, internal_errors=0, ready=True)
    again = Snapshot.from_json(shot.to_json())
    assert again == shot
    with pytest.raises((ValueError, TypeError, KeyError)):
        Snapshot.from_json({**shot.to_json(), "audit_failures": -1})
    body, content_type = Exposition(lambda: [shot, Snapshot(worker=0)], build_info()).render("")
    assert content_type.startswith("text/plain")
    samples = metric_samples(body.decode())
    key = frozenset(
        {"worker": "3", "protocol": "connect", "decision": "allow", "reason": "allowed"}.items()
    )
    assert samples[("egressbox_decisions_total", key)] == 2
    assert total(samples, "egressbox_decisions_total") == 3
    assert samples[("egressbox_tunnels_open", frozenset({("worker", "3")}))] == 2
    inf = frozenset({("worker", "3"), ("le", "+Inf")})
    assert samples[("egressbox_dns_query_duration_seconds_bucket", inf)] == 2
    first = frozenset({("worker", "3"), ("le", repr(DNS_BUCKETS[0]))})
    assert samples[("egressbox_dns_query_duration_seconds_bucket", first)] == 0
    refused = frozenset({("worker", "3"), ("outcome", "refused")})
    assert samples[("egressbox_reloads_total", refused)] == 1
    # OpenMetrics when the scraper asks for it (Prometheus does).
    body, content_type = Exposition(lambda: [shot], build_info()).render(
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    )
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


async def test_counts_add_up_to_the_audit_records(
    start_proxy: StartProxy,
    zone: DnsServer,
    origins: Origins,
    origin: HttpOrigin,
    curl: Curl,
    tmp_path: Path,
) -> None:
    metrics = Metrics()
    sink = JsonlFileSink(tmp_path / "audit.jsonl")
    echo = await origins.echo()
    # A resolver the caller passes is the caller's: it is given the meter itself.
    resolver = DnsResolver([zone.nameserver], meter=metrics)
    proxy = await start_proxy(audit=sink, meter=metrics, keep_records=False, resolver=resolver)
    url = proxy.http_url
    assert url is not None
    for _ in range(2):  # the second look is answered from the cache
        result = await curl("-x", url, f"http://origin.test:{origin.port}/hello")
        assert result.stdout
    await curl("-x", url, "http://unlisted.test/", check=False)
    await curl(
        "--socks5-hostname",
        str(proxy.socks_url).removeprefix("socks5h://"),
        "http://blocked.ok.test/",
        check=False,
    )
    assert proxy.http_address is not None
    echoed = await asyncio.to_thread(_tunnel_ping, proxy.http_address, echo.port)
    assert echoed == b"ping"
    await _until(lambda: metrics.bytes_up >= 4)
    sink.close()
    records = audit_lines(tmp_path / "audit.jsonl")
    counted: dict[tuple[str, str, str], int] = {}
    for record in records:
        key = (record["protocol"], record["decision"], record["reason"])
        counted[key] = counted.get(key, 0) + 1
    assert {(p.value, v.value, r.value): n for (p, v, r), n in metrics.decisions.items()} == counted
    assert sum(counted.values()) == 5
    assert metrics.dns_queries == {"answer": 1}
    assert metrics.dns_cache_hits >= 1
    assert metrics.bytes_up == 4 and metrics.bytes_down == 4
    assert sum(metrics.dns_buckets) == 1


def _tunnel_ping(proxy: tuple[str, int], port: int) -> bytes:
    """A tunnel to the echo origin that moves four bytes each way (off the loop's thread)."""
    sock, status = connect_through(proxy, f"127.0.0.1:{port}")
    with sock:
        assert status == 200
        sock.sendall(b"ping")
        return sock.recv(4)


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not reached")


def test_an_audit_failure_is_counted_not_the_decision(tmp_path: Path) -> None:
    from egressbox.audit.record import AuditProtocol
    from egressbox.core.decide import Decision
    from egressbox.core.errors import AuditError, Reason, Verdict
    from egressbox.core.limits import Limits
    from egressbox.proxy.gate import ProxyState

    class Failing:
        def write(self, record: object) -> None:
            raise AuditError("disk full")

    metrics = Metrics()
    state = ProxyState(
        policy=None,
        resolver=DnsResolver([("127.0.0.1", 53)]),
        limits=Limits(),
        audit=Failing(),  # type: ignore[arg-type]
        on_record=None,
        log=None,
        socks_credentials=None,
        meter=metrics,
    )
    decision = Decision(Verdict.DENY, Reason.NO_POLICY, "x.test", 443)
    with pytest.raises(AuditError):
        state.emit_decision(AuditProtocol.CONNECT, decision)
    assert metrics.decisions == {} and metrics.audit_failures == 1


# -- serve --admin, as a process ---------------------------------------------------------


def test_serve_admin_metrics_match_the_audit_log(tmp_path: Path) -> None:
    echo = EchoServer()
    try:
        policy = tmp_path / "policy.toml"
        # Every port of 127.0.0.1, so that only the self-connection rule keeps the proxy
        # from its own admin listener.
        write_atomically(policy, policy_text(["127.0.0.1"]))
        log = tmp_path / "audit.jsonl"
        with serving(
            tmp_path / "serve",
            "--policy",
            str(policy),
            "--admin",
            "127.0.0.1:0",
            "--audit-log",
            str(log),
        ) as proc:
            admin_at = proc.ready["admin"]
            assert set(proc.ready) == {"event", "http", "socks5", "admin"}
            for target in (f"127.0.0.1:{echo.port}", "denied.test:443", "127.0.0.1:1"):
                sock, _ = connect_through(proc.address("http"), target)
                sock.close()
            # The admin listener is one of the proxy's own endpoints: never proxied to.
            host, port = admin_at.rsplit(":", 1)
            sock, status = connect_through(proc.address("http"), f"{host}:{port}")
            sock.close()
            assert status == 403
            wait_until("four records", lambda: len(audit_lines(log)) == 4)
            status, headers, body = admin_get(admin_at, "/metrics")
            assert status == 200 and headers["content-type"].startswith("text/plain")
            samples = metric_samples(body.decode())
            assert total(samples, "egressbox_decisions_total") == 4
            reasons = {r["reason"] for r in audit_lines(log)}
            assert "self_connection" in reasons
            assert admin_get(admin_at, "/readyz")[0] == 200
            assert proc.stop() == 0
    finally:
        echo.close()


def test_readyz_turns_503_on_sigterm_and_the_proxy_keeps_accepting_for_the_delay(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "policy.toml"
    write_atomically(policy, policy_text([]))
    with serving(
        tmp_path / "serve",
        "--policy",
        str(policy),
        "--admin",
        "127.0.0.1:0",
        "--drain-delay",
        "30",
    ) as proc:
        admin_at = proc.ready["admin"]
        assert admin_get(admin_at, "/readyz")[0] == 200
        proc.send(signal.SIGTERM)
        wait_until("readyz 503", lambda: admin_get(admin_at, "/readyz")[0] == 503)
        status, _, body = admin_get(admin_at, "/readyz")
        assert body == b"not ready: draining\n"
        assert admin_get(admin_at, "/healthz")[0] == 200
        # Still accepting during the delay: a request is decided (denied) as ever.
        sock, status = connect_through(proc.address("http"), "denied.test:443")
        sock.close()
        assert status == 403
        # A second signal cuts the delay short.
        proc.send(signal.SIGTERM)
        assert proc.wait() == 0


def test_admin_refusals_at_start(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    write_atomically(policy, policy_text([]))
    cases = [
        (["--http-port", "18080", "--admin", "127.0.0.1:18080"], 2, "is a proxy port"),
        (["--admin", "localhost:1"], 2, "not an IP address"),
        (["--admin-token-file", str(tmp_path / "t")], 2, "needs --admin"),
        (["--admin", "127.0.0.1:0", "--admin-token-file", str(tmp_path / "t")], 2, "cannot read"),
        (["--drain-delay", "-1"], 2, "--drain-delay"),
        # A non-loopback address is warned about (this one is not on the machine: exit 3).
        (["--admin", "192.0.2.1:0"], 3, "reachable from other hosts"),
    ]
    for index, (args, code, text) in enumerate(cases):
        with serving(tmp_path / f"s{index}", "--policy", str(policy), *args, ready=False) as p:
            assert p.wait() == code, p.stderr()
            assert text in p.stderr()
            assert p.stdout() == ""


def test_admin_token_from_the_environment(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    write_atomically(policy, policy_text([]))
    with serving(
        tmp_path / "serve",
        "--policy",
        str(policy),
        "--admin",
        "127.0.0.1:0",
        env={TOKEN_ENV: "tok-123"},
    ) as proc:
        admin_at = proc.ready["admin"]
        assert admin_get(admin_at, "/metrics")[0] == 401
        assert admin_get(admin_at, "/metrics", {"Authorization": "Bearer tok-123"})[0] == 200
        assert admin_get(admin_at, "/healthz")[0] == 200


def test_workers_one_admin_listener_for_all(tmp_path: Path) -> None:
    echo = EchoServer()
    try:
        policy = tmp_path / "policy.toml"
        write_atomically(policy, policy_text([f"127.0.0.1:{echo.port}"]))
        log = tmp_path / "audit.jsonl"
        with serving(
            tmp_path / "serve",
            "--policy",
            str(policy),
            "--admin",
            "127.0.0.1:0",
            "--workers",
            "2",
            "--audit-log",
            str(log),
        ) as proc:
            admin_at = proc.ready["admin"]
            wait_until("every worker ready", lambda: admin_get(admin_at, "/readyz")[0] == 200)
            count = 40
            for index in range(count):
                target = f"127.0.0.1:{echo.port}" if index % 2 else "denied.test:443"
                sock, _ = connect_through(proc.address("http"), target)
                sock.close()
            wait_until("the records", lambda: len(audit_lines(log)) == count)

            def counted() -> float:
                return total(
                    metric_samples(admin_get(admin_at, "/metrics")[2].decode()),
                    "egressbox_decisions_total",
                )

            wait_until("every worker's numbers", lambda: counted() == count)
            samples = metric_samples(admin_get(admin_at, "/metrics")[2].decode())
            workers = {
                dict(labels)["worker"] for name, labels in samples if name == "egressbox_ready"
            }
            assert workers == {"0", "1"}
            proc.send(signal.SIGHUP)
            proc.wait_stderr("policy reloaded")

            def reloads() -> float:
                found = metric_samples(admin_get(admin_at, "/metrics")[2].decode())
                return sum(
                    v
                    for (n, labels), v in found.items()
                    if n == "egressbox_reloads_total" and ("outcome", "ok") in labels
                )

            wait_until("both reloads counted", lambda: reloads() == 2)
            assert proc.stop() == 0
    finally:
        echo.close()


CHILD_PROBE = """
import socket, sys
try:
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
    sock.sendall(b"GET /healthz HTTP/1.1\\r\\n\\r\\n")
    print(repr(sock.recv(100)))
except OSError as exc:
    print("refused", exc.errno)
"""


def test_a_run_child_does_not_reach_a_serve_admin_listener(tmp_path: Path) -> None:
    """The admin listener is not in a confined child's network namespace: a connection to
    its address is the child's own (captured and decided by run's proxy, or refused)."""
    import subprocess

    policy = tmp_path / "policy.toml"
    write_atomically(policy, policy_text([]))
    with serving(tmp_path / "serve", "--policy", str(policy), "--admin", "127.0.0.1:0") as proc:
        assert admin_get(proc.ready["admin"], "/healthz")[0] == 200
        port = proc.ready["admin"].rsplit(":", 1)[1]
        done = subprocess.run(
            [sys.executable, "-m", "egressbox", "run", "--policy", str(policy), "--",
             sys.executable, "-c", CHILD_PROBE, port],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )  # fmt: skip
        if done.returncode == 126:
            pytest.skip(f"run cannot confine here: {done.stderr.strip()[-300:]}")
        assert done.returncode == 0, done.stderr
        assert "HTTP/1.1" not in done.stdout, done.stdout
        assert done.stdout.strip() in ("b''", "refused 111"), done.stdout


def test_readiness_follows_the_audit_log_and_the_drain() -> None:
    from egressbox.core.limits import Limits
    from egressbox.net.resolve import DnsResolver
    from egressbox.proxy.gate import ProxyState
    from egressbox.serve.fleet import ProcessStatus

    state = ProxyState(
        policy=None,
        resolver=DnsResolver([("127.0.0.1", 53)]),
        limits=Limits(),
        audit=None,
        on_record=None,
        log=None,
        socks_credentials=None,
    )
    status = ProcessStatus(Metrics(), state)
    assert status.ready() == (True, "")
    # A sink that failed and cannot recover (not a file): not ready until restarted.
    state.audit_error = "cannot write audit record: disk full"
    ready, why = status.ready()
    assert not ready and "audit log cannot be written" in why
    state.audit_error = None
    status.draining = True
    assert status.ready() == (False, "draining")
    assert status.snapshot().ready is False
