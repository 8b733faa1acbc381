"""Approval on a miss, as clients meet it: curl through a real proxy on loopback whose
`on_miss` decider answers deny, once or session (or nothing), with the audit log read back
from its file.

Every case checks what the client got, what the decider was asked (and how often), and the
records in the log: one per request, with the approval's reason code. The destinations the
ban, deny entries and deny_cidrs refuse are never offered, and an approved name that resolves
into them is still refused before any dial (the dial guard and tripwires say so).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from dnsserver import A
from egressbox.audit.record import JsonlFileSink
from egressbox.proxy.approval import Answer, Approved, MissRequest
from proxy_fixtures import BASE_POLICY

if TYPE_CHECKING:
    from dnsserver import DnsServer
    from egressbox.proxy.server import EgressProxy
    from proxy_fixtures import Curl, CurlResult, DialGuard, HttpOrigin, Origins, StartProxy, Wire

pytestmark = pytest.mark.usefixtures("dials")

IO_TIMEOUT = 15.0
POLL = 0.01
# A question nobody answers ends this fast in the timeout cases.
SHORT_ASK_TIMEOUT = 0.5
UNLISTED = "unlisted.test"  # resolves to 127.0.0.1; no allow entry names it


@dataclass
class Asker:
    """A decider: answers in order (the last one repeats); with `gate`, only once it is set."""

    answers: Sequence[str]
    asked: list[MissRequest] = field(default_factory=list)
    gate: asyncio.Event | None = None

    async def __call__(self, request: MissRequest) -> str:
        self.asked.append(request)
        if self.gate is not None:
            await self.gate.wait()
        return self.answers[min(len(self.asked), len(self.answers)) - 1]


@dataclass
class Setup:
    proxy: EgressProxy
    asker: Asker
    log: Path

    def records(self) -> list[tuple[str, str, int, str, str]]:
        """The audit log as written (from the file, not the proxy's memory)."""
        lines = self.log.read_text().splitlines()
        found = []
        for line in lines:
            item = json.loads(line)
            found.append(
                (item["protocol"], item["host"], item["port"], item["decision"], item["reason"])
            )
        return found


@pytest.fixture
def start(start_proxy: StartProxy, tmp_path: Path) -> Any:
    async def started(answers: Sequence[str], **kwargs: Any) -> Setup:
        asker = Asker(answers, gate=kwargs.pop("gate", None))
        log = tmp_path / "audit.jsonl"
        proxy = await start_proxy(
            kwargs.pop("policy", None) or _base(),
            on_miss=asker,
            audit=JsonlFileSink(str(log)),
            **kwargs,
        )
        return Setup(proxy, asker, log)

    return started


def _base() -> dict[str, Any]:
    return BASE_POLICY


def _via(proxy: EgressProxy, listener: str) -> list[str]:
    """curl's options to reach a plain http:// URL through `listener`."""
    if listener == "socks5":
        assert proxy.socks_address is not None
        host, port = proxy.socks_address
        return ["--socks5-hostname", f"{host}:{port}"]
    assert proxy.http_url is not None
    tunnel = ["--proxytunnel"] if listener == "connect" else []
    return [*tunnel, "--proxy", proxy.http_url]


async def _fetch(curl: Curl, proxy: EgressProxy, listener: str, url: str) -> CurlResult:
    return await curl("--dump-header", "-", *_via(proxy, listener), url, check=False)


def _reason(result: CurlResult) -> str | None:
    for line in result.stdout.decode("latin-1").splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() == "x-egressbox-reason":
            return value.strip()
    return None


@pytest.mark.parametrize("listener", ["http", "connect", "socks5"])
async def test_once_admits_one_request_and_the_next_asks_again(
    start: Any, origin: HttpOrigin, curl: Curl, listener: str
) -> None:
    setup = await start(["once"])
    url = origin.url(UNLISTED)
    for _ in range(2):
        result = await _fetch(curl, setup.proxy, listener, url)
        assert result.returncode == 0, result
        assert b"hello from v4" in result.stdout
    asked = MissRequest(listener, UNLISTED, origin.port)
    assert setup.asker.asked == [asked, asked]
    assert setup.records() == [(listener, UNLISTED, origin.port, "allow", "approved")] * 2
    assert setup.proxy.approvals is not None
    assert setup.proxy.approvals.approved() == [Approved(UNLISTED, origin.port, Answer.ONCE)]


async def test_once_on_a_kept_alive_connection_asks_for_each_request(
    start: Any, origin: HttpOrigin, curl: Curl
) -> None:
    setup = await start(["once"])
    url = origin.url(UNLISTED)
    # One curl, two URLs: the second request goes on the same client connection.
    result = await curl(*_via(setup.proxy, "http"), url, url)
    assert result.stdout.count(b"hello from v4") == 2
    assert len(setup.asker.asked) == 2
    assert setup.records() == [("http", UNLISTED, origin.port, "allow", "approved")] * 2


@pytest.mark.parametrize("listener", ["http", "connect", "socks5"])
async def test_a_deny_answer_refuses_and_is_audited(
    start: Any, origins: Origins, curl: Curl, dials: DialGuard, wire: Wire, listener: str
) -> None:
    setup = await start(["deny"])
    tripwire = origins.tripwire()
    if listener == "socks5":
        code, closed = await wire.socks_exchange(
            setup.proxy.socks_address, UNLISTED, tripwire.port, as_domain=True
        )
        assert (code, closed) == (0x02, True)
    else:
        result = await _fetch(curl, setup.proxy, listener, f"http://{UNLISTED}:{tripwire.port}/")
        assert b" 403 " in result.stdout.split(b"\r\n", 1)[0]
        assert _reason(result) == "approval_denied"
    assert len(setup.asker.asked) == 1
    assert setup.records() == [(listener, UNLISTED, tripwire.port, "deny", "approval_denied")]
    assert dials.calls == []
    assert tripwire.connections() == 0


@pytest.mark.parametrize("listener", ["http", "connect"])
async def test_no_answer_in_time_denies(
    start: Any, origins: Origins, curl: Curl, dials: DialGuard, listener: str
) -> None:
    # The decider never answers: the question's own timer ends the held request.
    setup = await start(["once"], gate=asyncio.Event(), ask_timeout=SHORT_ASK_TIMEOUT)
    tripwire = origins.tripwire()
    result = await _fetch(curl, setup.proxy, listener, f"http://{UNLISTED}:{tripwire.port}/")
    assert _reason(result) == "approval_timeout"
    assert setup.records() == [(listener, UNLISTED, tripwire.port, "deny", "approval_timeout")]
    assert dials.calls == []
    await _until_idle(setup.proxy)


async def test_a_session_answer_admits_later_requests_without_asking(
    start: Any, origin: HttpOrigin, curl: Curl
) -> None:
    setup = await start(["session", "deny"])
    url = origin.url(UNLISTED)
    for listener in ("connect", "http", "socks5"):
        result = await _fetch(curl, setup.proxy, listener, url)
        assert b"hello from v4" in result.stdout, result
    assert setup.asker.asked == [MissRequest("connect", UNLISTED, origin.port)]
    assert setup.records() == [
        (listener, UNLISTED, origin.port, "allow", "approved_session")
        for listener in ("connect", "http", "socks5")
    ]
    # The session answer is for that port only.
    other = await _fetch(curl, setup.proxy, "connect", f"http://{UNLISTED}:{origin.port + 1}/")
    assert _reason(other) == "approval_denied"
    assert setup.proxy.approvals is not None
    assert setup.proxy.approvals.approved() == [Approved(UNLISTED, origin.port, Answer.SESSION)]


@pytest.mark.parametrize(
    ("name", "address", "reason"),
    [
        ("ten.test", "10.0.0.1", "private_address"),
        ("loop2.test", "127.0.0.2", "private_address"),
        ("cidr.test", "127.0.0.9", "deny_cidr"),
        ("meta.test", "169.254.169.254", "metadata_address"),
    ],
)
async def test_an_approved_name_still_passes_the_address_checks(
    start: Any,
    origins: Origins,
    zone: DnsServer,
    curl: Curl,
    dials: DialGuard,
    name: str,
    address: str,
    reason: str,
) -> None:
    zone.set(name, A(address))
    setup = await start(["session"])
    tripwire = origins.tripwire(address) if address.startswith("127.") else None
    port = tripwire.port if tripwire is not None else 80
    result = await _fetch(curl, setup.proxy, "connect", f"http://{name}:{port}/")
    assert _reason(result) == reason
    assert len(setup.asker.asked) == 1  # asked about the name, refused for its address
    assert setup.records() == [("connect", name, port, "deny", reason)]
    assert dials.calls == []
    if tripwire is not None:
        assert tripwire.connections() == 0


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("blocked.ok.test", "deny_rule"),  # a deny entry beats any answer
        ("127.0.0.2", "no_allow_rule"),  # an IP literal in a banned range
        ("127.0.0.9", "no_allow_rule"),  # an IP literal inside deny_cidrs
        ("169.254.169.254", "no_allow_rule"),  # a cloud metadata endpoint
    ],
)
async def test_what_no_answer_could_admit_is_never_asked_about(
    start: Any, origins: Origins, curl: Curl, dials: DialGuard, target: str, reason: str
) -> None:
    setup = await start(["session"])
    tripwire = origins.tripwire(target) if target.startswith("127.") else None
    port = tripwire.port if tripwire is not None else 80
    result = await _fetch(curl, setup.proxy, "connect", f"http://{target}:{port}/")
    assert _reason(result) == reason
    assert setup.asker.asked == []
    assert [r[3:] for r in setup.records()] == [("deny", reason)]
    assert dials.calls == []


async def test_an_ip_literal_whose_address_passes_is_asked_about(
    start: Any, origin: HttpOrigin, curl: Curl
) -> None:
    # 127.0.0.1 is granted by allow_cidrs, but no allow entry names it: a miss to ask about.
    policy = {"egress": {"allow": ["origin.test"], "allow_cidrs": ["127.0.0.1/32"]}}
    setup = await start(["once"], policy=policy)
    result = await _fetch(curl, setup.proxy, "connect", origin.url("127.0.0.1"))
    assert b"hello from v4" in result.stdout, result
    assert setup.asker.asked == [MissRequest("connect", "127.0.0.1", origin.port)]
    assert setup.records() == [("connect", "127.0.0.1", origin.port, "allow", "approved")]


async def test_report_mode_asks_nothing(start: Any, origin: HttpOrigin, curl: Curl) -> None:
    policy = {**_base(), "egress": {**_base()["egress"], "mode": "report"}}
    setup = await start(["deny"], policy=policy)
    result = await _fetch(curl, setup.proxy, "connect", origin.url(UNLISTED))
    assert b"hello from v4" in result.stdout, result
    assert setup.asker.asked == []
    assert setup.records() == [("connect", UNLISTED, origin.port, "would_deny", "no_allow_rule")]


async def test_concurrent_misses_share_one_question(
    start: Any, origin: HttpOrigin, curl: Curl, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = asyncio.Event()
    setup = await start(["once"], gate=gate)
    approvals = setup.proxy.approvals
    assert approvals is not None
    waiting: list[MissRequest] = []
    ask = approvals.ask

    async def counted(request: MissRequest, **kwargs: Any) -> Any:
        waiting.append(request)
        return await ask(request, **kwargs)

    monkeypatch.setattr(approvals, "ask", counted)
    url = origin.url(UNLISTED)
    fetches = [
        asyncio.create_task(_fetch(curl, setup.proxy, listener, url))
        for listener in ("connect", "connect")
    ]
    async with asyncio.timeout(IO_TIMEOUT):
        while len(waiting) < len(fetches) or not setup.asker.asked:
            await asyncio.sleep(POLL)
    # A plain request joins the question already put about CONNECT.
    fetches.append(asyncio.create_task(_fetch(curl, setup.proxy, "http", url)))
    async with asyncio.timeout(IO_TIMEOUT):
        while len(waiting) < len(fetches):
            await asyncio.sleep(POLL)
    # Held without a reply, and counted as open connections meanwhile.
    assert len(setup.proxy.state.connections) + len(setup.proxy.state.forwarders) >= len(fetches)
    assert setup.asker.asked == [MissRequest("connect", UNLISTED, origin.port)]
    gate.set()
    results = await asyncio.gather(*fetches)
    assert all(b"hello from v4" in r.stdout for r in results), results
    # The once answer about CONNECT admitted both tunnels; the plain request was asked
    # about on its own (a once answer admits the protocols it was asked about only).
    assert setup.asker.asked == [
        MissRequest("connect", UNLISTED, origin.port),
        MissRequest("http", UNLISTED, origin.port),
    ]
    assert sorted(r[4] for r in setup.records()) == ["approved"] * 3
    await _until_idle(setup.proxy)


async def test_stopping_the_proxy_refuses_held_requests(
    start: Any, origins: Origins, wire: Wire
) -> None:
    setup = await start(["once"], gate=asyncio.Event())
    tripwire = origins.tripwire()
    reader, writer = await wire.open(setup.proxy.http_address)
    try:
        target = f"{UNLISTED}:{tripwire.port}"
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(IO_TIMEOUT):
            while not setup.asker.asked:
                await asyncio.sleep(POLL)
        closing = asyncio.create_task(setup.proxy.close(0))
        reply = await wire.read_reply(reader)
        await closing
    finally:
        await wire.close(writer)
    assert reply.status == 403
    assert reply.header("X-Egressbox-Reason") == "approval_denied"
    assert setup.records() == [("connect", UNLISTED, tripwire.port, "deny", "approval_denied")]
    assert tripwire.connections() == 0


async def test_a_failing_or_wrong_decider_denies(
    start_proxy: StartProxy, origins: Origins, curl: Curl
) -> None:
    def broken(request: MissRequest) -> str:
        raise RuntimeError("decider bug")

    tripwire = origins.tripwire()
    url = f"http://{UNLISTED}:{tripwire.port}/"
    for decider in (broken, lambda request: "yes please", lambda request: Answer.DENY):
        lines: list[str] = []
        proxy = await start_proxy(on_miss=decider, log=lines.append)
        result = await _fetch(curl, proxy, "connect", url)
        assert _reason(result) == "approval_denied"
        assert [r.reason.value for r in proxy.records] == ["approval_denied"]
    assert tripwire.connections() == 0


async def test_close_denied_keeps_what_a_session_answer_admits(
    start: Any, origins: Origins, wire: Wire
) -> None:
    from egressbox.core.policy import parse_policy

    setup = await start(["session"])
    echo = await origins.echo()
    reader, writer = await wire.open(setup.proxy.http_address)
    try:
        target = f"{UNLISTED}:{echo.port}"
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        await writer.drain()
        status, _, _ = await wire.read_head(reader)
        assert status == 200
        writer.write(b"ping")
        await writer.drain()
        assert await wire.read_exactly(reader, 4) == b"ping"
        same = parse_policy(_base(), env={})
        assert setup.proxy.set_policy(same, close_denied=True) == 0
        writer.write(b"pong")
        await writer.drain()
        assert await wire.read_exactly(reader, 4) == b"pong"
        # deny_cidrs over its address: no answer lifts that.
        banned = {"egress": {**_base()["egress"], "deny_cidrs": ["127.0.0.1/32"]}}
        assert setup.proxy.set_policy(parse_policy(banned, env={}), close_denied=True) == 1
        assert await wire.read_to_eof(reader) == b""
    finally:
        await wire.close(writer)


async def _until_idle(proxy: EgressProxy) -> None:
    """Every held or relayed connection has let go of its slot (bounded)."""
    state = proxy.state
    async with asyncio.timeout(IO_TIMEOUT):
        while state.connections or state.tunnels or state.forwarders or state.per_client:
            await asyncio.sleep(POLL)
