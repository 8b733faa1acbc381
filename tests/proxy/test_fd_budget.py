"""The proxy refuses (503, audited) before it could run out of descriptors."""

from __future__ import annotations

import asyncio
import resource

import pytest

from egressbox.core.errors import Reason
from egressbox.core.policy import parse_policy
from egressbox.proxy.server import FD_RESERVE, EgressProxy, fd_capacity


def test_fd_capacity() -> None:
    assert fd_capacity(20_000) == (20_000 - FD_RESERVE) // 2
    assert fd_capacity(FD_RESERVE + 10) == 5
    assert fd_capacity(10) == 1


async def test_connections_beyond_the_fd_budget_get_503(monkeypatch: pytest.MonkeyPatch) -> None:
    # A soft limit that leaves room for exactly two connections.
    limit = FD_RESERVE + 4
    real = resource.getrlimit

    def fake(which: int) -> tuple[int, int]:
        if which == resource.RLIMIT_NOFILE:
            return limit, real(which)[1]
        return real(which)

    monkeypatch.setattr(resource, "getrlimit", fake)
    policy = parse_policy({"egress": {"allow": []}}, env={})
    async with EgressProxy(policy, socks_port=None, keep_records=True) as proxy:
        assert proxy.state.fd_capacity == 2
        assert proxy.http_address is not None
        host, port = proxy.http_address
        held = [await asyncio.open_connection(host, port) for _ in range(2)]
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"CONNECT example.test:443 HTTP/1.1\r\nHost: example.test:443\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(4096), 10)
        assert reply.startswith(b"HTTP/1.1 503 ")
        assert b"X-Egressbox-Reason: too_many_connections" in reply
        writer.close()
        for _, w in held:
            w.close()
        assert [r.reason for r in proxy.records] == [Reason.TOO_MANY_CONNECTIONS]
