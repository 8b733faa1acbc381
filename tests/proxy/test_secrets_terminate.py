"""Credential brokering and request rules on the library's proxy (src/egressbox/proxy/terminate.py).

Real clients (curl, requests, httpx) through a real EgressProxy on loopback to real HTTPS
origins (Python's ssl server with a certificate from a test CA given as [tls] origin_ca) that
accept only the real token. Judged from the host: what the origins saw, the audit records
and every line the proxy logged; the real value is searched for in all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from egressbox.core.policy import Policy, parse_policy
from egressbox.proxy.ca import CertificateAuthority
from egressbox.proxy.server import EgressProxy

pytestmark = [
    pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl"),
    pytest.mark.timeout(120),
]

TOKEN = "real-token-5f1e0c9a77d2"  # what only the origin and the proxy may ever see


@dataclass
class Origin:
    """An HTTPS origin on 127.0.0.1: 200 only with the real token, logs every request."""

    port: int = 0
    seen: list[tuple[str, str, str]] = field(default_factory=list)  # method, path, auth

    def authorized(self) -> list[str]:
        return [path for _, path, auth in self.seen if TOKEN in auth or TOKEN in path]


def _serve(context: ssl.SSLContext) -> tuple[Origin, http.server.ThreadingHTTPServer]:
    found = Origin()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            if not self._read_body():
                return  # cut short: a request the origin never received whole
            auth = self.headers.get("Authorization") or ""
            found.seen.append((self.command, self.path, auth))
            ok = TOKEN in auth or TOKEN in self.path
            body = b"welcome\n" if ok else b"who are you\n"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _answer  # noqa: N815 - http.server's names

        def _read_body(self) -> bool:
            try:
                if self.headers.get("Transfer-Encoding") != "chunked":
                    length = int(self.headers.get("Content-Length") or 0)
                    return len(self.rfile.read(length)) == length
                while size := int(self.rfile.readline().strip() or b"-1", 16):
                    if size < 0 or len(self.rfile.read(size + 2)) != size + 2:
                        return False
                return self.rfile.readline() == b"\r\n"
            except (OSError, ValueError):
                return False

        def handle(self) -> None:
            with contextlib.suppress(OSError):  # a connection the proxy cut: nothing to say
                super().handle()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    found.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return found, server


@dataclass
class World:
    tmp: Path
    bound: Origin  # the origin the secret is bound to
    other: Origin  # another allowed origin
    forged: Origin  # an allowed origin whose certificate no trusted CA signed
    origin_ca: Path

    def policy(self, *, terminate_other: bool = False, **rule: Any) -> Policy:
        ports = [self.bound.port, self.other.port, self.forged.port]
        data: dict[str, Any] = {
            "egress": {
                "allow": [f"127.0.0.1:{p}" for p in ports],
                "allow_cidrs": ["127.0.0.1/32"],
            },
            "secret": [
                {
                    "name": "API_TOKEN",
                    "from_env": "EGRESSBOX_TEST_TOKEN",
                    "hosts": [f"127.0.0.1:{self.bound.port}", f"127.0.0.1:{self.forged.port}"],
                    "header": "Authorization",
                    "format": "Bearer {value}",
                }
            ],
            "tls": {"origin_ca": str(self.origin_ca)},
        }
        rules = [{"hosts": [f"127.0.0.1:{self.bound.port}"], **rule}] if rule else []
        if terminate_other:  # an entry without limits: the host is terminated, nothing else
            rules.append({"hosts": [f"127.0.0.1:{self.other.port}"]})
        if rules:
            data["request_rule"] = rules
        return parse_policy(data, env={})


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    monkeypatch.setenv("EGRESSBOX_TEST_TOKEN", TOKEN)
    trusted, rogue = CertificateAuthority.generate(), CertificateAuthority.generate()
    origin_ca = tmp_path / "origin-ca.pem"
    origin_ca.write_text(trusted.cert_pem)
    servers = []
    bound, server = _serve(trusted.server_context("127.0.0.1"))
    servers.append(server)
    other, server = _serve(trusted.server_context("127.0.0.1"))
    servers.append(server)
    forged, server = _serve(rogue.server_context("127.0.0.1"))
    servers.append(server)
    try:
        yield World(tmp_path, bound, other, forged, origin_ca)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


class Proxy:
    """An EgressProxy on its own loop thread, its records and log lines kept."""

    def __init__(self, policy: Policy, tmp: Path) -> None:
        self.lines: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.proxy = EgressProxy(policy, keep_records=True, log=self.lines.append)
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        self.ca = tmp / "run-ca.pem"
        self.ca.write_text(self.proxy.ca_pem or "")
        self.placeholder = self.proxy.placeholders["API_TOKEN"]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def records(self) -> list[tuple[str, int, str, str]]:
        return [
            (r.protocol.value, r.port, r.decision.value, r.reason.value) for r in self.proxy.records
        ]

    def curl(self, url: str, *options: str) -> tuple[str, str]:
        """(status, X-Egressbox-Reason) of one curl through the proxy."""
        done = subprocess.run(
            [
                "curl",
                "-sS",
                "-D",
                "-",
                "-o",
                "/dev/null",
                "--max-time",
                "20",
                "--cacert",
                str(self.ca),
                "-x",
                _http_url(self.proxy),
                *options,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        status, reason = "000", ""
        for line in done.stdout.splitlines():
            if line.startswith("HTTP/") and " 200 Connection" not in line:
                status = line.split()[1]
            if line.lower().startswith("x-egressbox-reason:"):
                reason = line.split(":", 1)[1].strip()
        assert TOKEN not in done.stdout + done.stderr
        return status, reason


@pytest.fixture
def proxies(world: World) -> Iterator[list[Proxy]]:
    made: list[Proxy] = []
    yield made
    for proxy in made:
        proxy.close()
    for proxy in made:
        text = json.dumps([proxy.lines, [str(r) for r in proxy.proxy.records]])
        assert TOKEN not in text  # never in a record, a diagnostic line or a repr
        assert TOKEN not in repr(proxy.proxy.broker)


def _http_url(proxy: EgressProxy) -> str:
    """The proxy's HTTP URL (it listens on HTTP in every test here)."""
    url = proxy.http_url
    assert url is not None
    return url


def _start(
    world: World, proxies: list[Proxy], *, terminate_other: bool = False, **rule: Any
) -> Proxy:
    proxy = Proxy(world.policy(terminate_other=terminate_other, **rule), world.tmp)
    proxies.append(proxy)
    return proxy


def test_curl_requests_httpx_reach_the_origin_with_the_real_token(
    world: World, proxies: list[Proxy]
) -> None:
    import httpx
    import requests

    proxy = _start(world, proxies)
    url = f"https://127.0.0.1:{world.bound.port}"
    assert proxy.curl(f"{url}/curl-added") == ("200", "")  # the header added in its format
    assert proxy.curl(f"{url}/curl-sent", "-H", f"Authorization: token {proxy.placeholder}") == (
        "200",
        "",
    )
    via = {"https": _http_url(proxy.proxy)}
    got = requests.get(
        f"{url}/requests?key={proxy.placeholder}", proxies=via, verify=str(proxy.ca), timeout=20
    )
    assert got.status_code == 200
    with httpx.Client(proxy=_http_url(proxy.proxy), verify=str(proxy.ca), timeout=20) as client:
        assert client.post(f"{url}/httpx", content=b"x" * 1000).status_code == 200
    assert [p.split("?")[0] for p in world.bound.authorized()] == [
        "/curl-added",
        "/curl-sent",
        "/requests",
        "/httpx",
    ]
    # Each connection was decided (and audited) once, as any tunnel.
    assert set(proxy.records()) == {("connect", world.bound.port, "allow", "allowed")}


def test_the_placeholder_sent_to_another_allowed_host_is_refused_and_audited(
    world: World, proxies: list[Proxy]
) -> None:
    proxy = _start(world, proxies, terminate_other=True)
    port = world.other.port
    # A plain HTTP request (the proxy reads it) to another allowed host: refused.
    plain = f"http://127.0.0.1:{port}/leak?t={proxy.placeholder}"
    assert proxy.curl(plain) == ("403", "secret_misdirected")
    assert ("http", port, "deny", "secret_misdirected") in proxy.records()
    # A terminated host it is not bound to: in a header, or inside a Basic credential.
    url = f"https://127.0.0.1:{port}/leak"
    sent = proxy.curl(url, "-H", f"X-Token: {proxy.placeholder}")
    assert sent == ("403", "secret_misdirected")
    assert proxy.curl(url, "-u", f"x:{proxy.placeholder}") == ("403", "secret_misdirected")
    refused = [r for r in proxy.records() if r[2] == "deny"]
    assert refused[1:] == [("connect", port, "deny", "secret_misdirected")] * 2
    assert world.other.seen == []  # not one byte of it reached the origin


def test_method_path_and_budget_rules(world: World, proxies: list[Proxy]) -> None:
    proxy = _start(world, proxies, methods=["GET"], paths=["/repos/"], max_requests=2)
    url = f"https://127.0.0.1:{world.bound.port}"
    assert proxy.curl(f"{url}/repos/a") == ("200", "")
    assert proxy.curl(f"{url}/repos/a", "-X", "DELETE") == ("403", "method_denied")
    assert proxy.curl(f"{url}/admin") == ("403", "path_denied")
    assert proxy.curl(f"{url}/repos/b") == ("200", "")
    assert proxy.curl(f"{url}/repos/c") == ("403", "budget_exceeded")
    port = world.bound.port
    denied = [r for r in proxy.records() if r[2] == "deny"]
    assert denied == [
        ("connect", port, "deny", "method_denied"),
        ("connect", port, "deny", "path_denied"),
        ("connect", port, "deny", "budget_exceeded"),
    ]
    assert [path for _, path, _ in world.bound.seen] == ["/repos/a", "/repos/b"]


def test_request_bytes_budget_stops_an_upload(world: World, proxies: list[Proxy]) -> None:
    proxy = _start(world, proxies, max_request_bytes=10_000)
    url = f"https://127.0.0.1:{world.bound.port}/upload"
    body = world.tmp / "body"
    body.write_bytes(b"y" * 4000)
    assert proxy.curl(url, "--data-binary", f"@{body}") == ("200", "")
    body.write_bytes(b"y" * 20_000)
    # Declared length over the budget: refused before a byte goes up.
    assert proxy.curl(url, "--data-binary", f"@{body}") == ("403", "budget_exceeded")
    # Chunked (no declared length): cut off once over it.
    chunked = proxy.curl(url, "-H", "Transfer-Encoding: chunked", "--data-binary", f"@{body}")
    assert chunked == ("403", "budget_exceeded")
    assert [m for m, _, _ in world.bound.seen] == ["POST"]


def test_an_origin_with_a_certificate_no_trusted_ca_signed_is_refused(
    world: World, proxies: list[Proxy]
) -> None:
    proxy = _start(world, proxies)
    assert proxy.curl(f"https://127.0.0.1:{world.forged.port}/x") == ("502", "origin_tls_failed")
    assert world.forged.seen == []  # the token never went to it


def test_unbound_hosts_stay_untouched_tunnels(world: World, proxies: list[Proxy]) -> None:
    proxy = _start(world, proxies)
    # The other origin is not bound: curl sees the origin's own certificate (not ours), so it
    # verifies only against the origin's CA, and the placeholder goes through as it is.
    done = subprocess.run(
        [
            "curl",
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--cacert",
            str(world.origin_ca),
            "-x",
            _http_url(proxy.proxy),
            f"https://127.0.0.1:{world.other.port}/t",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.stdout == "401"
    assert world.other.seen == [("GET", "/t", "")]
