"""EgressProxy's options: one declaration (ProxyOptions), taken as keywords or as one value."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from egressbox import EgressProxy, ProxyOptions, parse_policy
from egressbox.proxy.options import ProxyKeywords

POLICY = parse_policy({"egress": {"allow": ["localhost:1"]}})


def test_the_keywords_are_the_options_fields() -> None:
    proxy = EgressProxy(POLICY, listen="127.0.0.1", http_port=None, keep_records=True)
    assert proxy.options == ProxyOptions(listen="127.0.0.1", http_port=None, keep_records=True)


def test_keywords_override_a_given_options_value() -> None:
    base = ProxyOptions(http_port=None, log_allowed=False)
    proxy = EgressProxy(POLICY, base, log_allowed=True)
    assert proxy.options == dataclasses.replace(base, log_allowed=True)
    assert proxy.state.log_allowed is True


def test_an_unknown_keyword_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="listen_on"):
        EgressProxy(POLICY, listen_on="127.0.0.1")  # type: ignore[call-arg]  # a type checker
        # refuses it too (ProxyKeywords); this is the untyped caller's TypeError


def test_the_state_is_whole_when_constructed() -> None:
    proxy = EgressProxy(POLICY, http_port=None, socks_port=None)
    assert proxy.state.upstream is None and proxy.state.broker is None
    assert proxy.state.limits == POLICY.limits


def test_an_options_value_serves_on_loopback() -> None:
    async def main() -> tuple[str | None, str | None]:
        options = ProxyOptions(http_port=None, socks_port=0)
        async with EgressProxy(POLICY, options) as proxy:
            assert proxy.socks_address is not None
            _, writer = await asyncio.open_connection(*proxy.socks_address)
            writer.close()
            await writer.wait_closed()
            return proxy.http_url, proxy.socks_url

    http_url, socks_url = asyncio.run(main())
    assert http_url is None
    assert socks_url is not None and socks_url.startswith("socks5h://127.0.0.1:")


def test_the_typed_keywords_are_the_options_fields() -> None:
    """ProxyKeywords (what a caller's type checker sees) and ProxyOptions (what the proxy
    reads) are one declaration in two forms: the same names, with the same types."""
    fields = {f.name: f.type for f in dataclasses.fields(ProxyOptions)}
    typed = {name: hint.__forward_arg__ for name, hint in ProxyKeywords.__annotations__.items()}
    assert typed == fields
    assert not ProxyKeywords.__required_keys__  # each has the options' default
