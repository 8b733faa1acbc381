"""The upstream proxy's configuration and the client side of its handshakes (HTTP CONNECT,
SOCKS5), sans-IO: exact bytes out, any chunking of the replies in, refusals mapped to
failure codes, and credentials that never show in a message or a repr."""

from __future__ import annotations

import base64
import ipaddress

import pytest

from egressbox.confine.env import EnvPolicy, ProxyEndpoints, child_environment
from egressbox.core.errors import PolicyError
from egressbox.core.policy import UPSTREAM_BY_NAME_WARNING, parse_policy, with_upstream
from egressbox.core.upstream import (
    ENV_PASSWORD,
    ENV_USER,
    UpstreamKind,
    UpstreamProxy,
    UpstreamTarget,
    parse_upstream,
)
from egressbox.protocols.upstream import (
    MAX_CONNECT_REPLY_HEAD,
    HttpConnectHandshake,
    Socks5Handshake,
    Upstream,
    UpstreamCredentials,
    UpstreamRefusedError,
    credentials_from_env,
    describe_upstream,
    handshake,
)

CREDENTIALS = UpstreamCredentials("alice", "s3cret:with colon")
IP = ipaddress.ip_address("203.0.113.7")
IP6 = ipaddress.ip_address("2001:db8::7")


def chunkings(data: bytes) -> list[list[bytes]]:
    return [[data], [data[i : i + 1] for i in range(len(data))]] + [
        [data[:cut], data[cut:]] for cut in range(len(data) + 1)
    ]


# -- the URL --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "http://proxy.corp.example:3128",
            UpstreamProxy(UpstreamKind.HTTP, "proxy.corp.example", 3128),
        ),
        (
            "HTTP://Proxy.Corp.Example.:3128/",
            UpstreamProxy(UpstreamKind.HTTP, "proxy.corp.example", 3128),
        ),
        ("socks5://10.1.2.3:1080", UpstreamProxy(UpstreamKind.SOCKS5, "10.1.2.3", 1080)),
        ("socks5://[2001:DB8::1]:1080", UpstreamProxy(UpstreamKind.SOCKS5, "2001:db8::1", 1080)),
    ],
)
def test_upstream_urls(url: str, expected: UpstreamProxy) -> None:
    assert parse_upstream(url) == expected
    assert parse_upstream(url, "name").target is UpstreamTarget.NAME


def test_urls_print_back_and_say_their_pinning() -> None:
    assert parse_upstream("socks5://[::1]:1080").url == "socks5://[::1]:1080"
    assert parse_upstream("http://p.example:8080").pinning == "full"
    assert parse_upstream("http://p.example:8080", "name").pinning == "partial"


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://bob:hunter2@proxy.example:3128", ENV_USER),
        ("http://hunter2@proxy.example:3128", ENV_PASSWORD),
        ("https://proxy.example:3128", "not supported"),
        ("socks5h://proxy.example:1080", "upstream_target"),
        ("ftp://proxy.example:21", "http or socks5"),
        ("proxy.example:3128", "a URL"),
        ("http://proxy.example", "port"),
        ("http://proxy.example:0", "port"),
        ("http://proxy.example:3128/path", "no path"),
        ("http://proxy.example:3128?q", "no path"),
        ("http://127.1:3128", "host"),
        ("http://exa mple:3128", "host"),
    ],
)
def test_bad_urls_say_why_without_echoing_them(url: str, words: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_upstream(url)
    assert words in str(info.value)
    assert "hunter2" not in str(info.value) and url not in str(info.value)
    with pytest.raises(ValueError, match="address"):
        parse_upstream("http://p.example:1", "ip")


# -- credentials ----------------------------------------------------------------------------


def test_credentials_from_the_environment() -> None:
    assert credentials_from_env({}) is None
    found = credentials_from_env({ENV_USER: "alice", ENV_PASSWORD: "s3cret"})
    assert found == UpstreamCredentials("alice", "s3cret")
    assert "alice" not in repr(found) and "s3cret" not in repr(found)
    assert "s3cret" not in repr(Upstream(parse_upstream("http://p.example:1"), found))
    for env in (
        {ENV_USER: "alice"},
        {ENV_PASSWORD: "s3cret"},
        {ENV_USER: "", ENV_PASSWORD: "x"},
        {ENV_USER: "a:b", ENV_PASSWORD: "x"},
        {ENV_USER: "a", ENV_PASSWORD: "x\r\nInjected: 1"},
        {ENV_USER: "a", ENV_PASSWORD: "x" * 256},
    ):
        with pytest.raises(ValueError) as info:
            credentials_from_env(env)
        assert "s3cret" not in str(info.value) and "Injected" not in str(info.value)


def test_the_credentials_never_reach_a_confined_child() -> None:
    base = {"PATH": "/usr/bin", ENV_USER: "alice", ENV_PASSWORD: "s3cret", "KEEP": "1"}
    env = child_environment(
        base,
        policy=EnvPolicy.INHERITED,
        grants={},
        proxy=ProxyEndpoints("127.0.0.1", 1, "127.0.0.1", 2),
        scratch=None,
        profile="workspace_paths",
    )
    assert env["KEEP"] == "1" and ENV_USER not in env and ENV_PASSWORD not in env


# -- HTTP CONNECT ---------------------------------------------------------------------------


def test_connect_request_bytes() -> None:
    plain = HttpConnectHandshake(IP, 443, None).start()
    assert plain == b"CONNECT 203.0.113.7:443 HTTP/1.1\r\nHost: 203.0.113.7:443\r\n\r\n"
    six = HttpConnectHandshake(IP6, 443, None).start()
    assert six.startswith(b"CONNECT [2001:db8::7]:443 HTTP/1.1\r\nHost: [2001:db8::7]:443\r\n")
    named = HttpConnectHandshake("pypi.org", 443, CREDENTIALS).start()
    token = base64.b64encode(b"alice:s3cret:with colon").decode()
    assert (
        named
        == (
            "CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n"
            f"Proxy-Authorization: Basic {token}\r\n\r\n"
        ).encode()
    )


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 Connection established\r\n\r\n",
        b"HTTP/1.0 200\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nVia: 1.1 squid\r\nContent-Length: 10\r\n\r\n",
    ],
)
def test_connect_success_at_any_chunking_keeps_what_follows(reply: bytes) -> None:
    for chunks in chunkings(reply + b"SSH-2.0-banner\r\n"):
        shake = HttpConnectHandshake(IP, 22, None)
        for chunk in chunks:
            assert shake.feed(chunk) == b""
        assert shake.done and shake.trailing == b"SSH-2.0-banner\r\n"


@pytest.mark.parametrize(
    ("reply", "failure", "retry", "words"),
    [
        (
            b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n",
            "upstream_failed",
            False,
            "wants credentials",
        ),
        (b"HTTP/1.1 403 Forbidden\r\n\r\n", "upstream_denied", False, "refused CONNECT"),
        (b"HTTP/1.1 405 Not Allowed\r\n\r\n", "upstream_denied", False, "refused"),
        (b"HTTP/1.1 503 Service Unavailable\r\n\r\n", "upstream_failed", True, "could not"),
        (b"HTTP/1.1 502 Bad Gateway\r\n\r\n", "upstream_failed", True, "could not"),
        (b"HTTP/1.1 504 Gateway Timeout\r\n\r\n", "connect_timeout", True, "timed out"),
        (b"HTTP/1.1 101 Switching\r\n\r\n", "upstream_failed", False, "101"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "upstream_failed", False, "400"),
        (b"HTTP/2 200\r\n\r\n", "upstream_failed", False, "not HTTP/1.x"),
        (b"SSH-2.0-x\r\n\r\n", "upstream_failed", False, "not HTTP/1.x"),
        (b"HTTP/1.1 200 OK\n\n\r\n\r\n", "upstream_failed", False, "not HTTP/1.x"),
    ],
)
def test_connect_refusals(reply: bytes, failure: str, retry: bool, words: str) -> None:
    shake = HttpConnectHandshake(IP, 443, None)
    with pytest.raises(UpstreamRefusedError) as info:
        shake.feed(reply)
    assert (info.value.failure, info.value.retry) == (failure, retry)
    assert words in str(info.value)


def test_connect_407_with_credentials_and_a_bounded_reply_head() -> None:
    shake = HttpConnectHandshake(IP, 443, CREDENTIALS)
    with pytest.raises(UpstreamRefusedError, match="refused the credentials") as info:
        shake.feed(b"HTTP/1.1 407 No\r\n\r\n")
    assert "s3cret" not in str(info.value)
    endless = HttpConnectHandshake(IP, 443, None)
    endless.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(UpstreamRefusedError, match="too long"):
        for _ in range(MAX_CONNECT_REPLY_HEAD // 16 + 1):
            endless.feed(b"X-Pad: 1234567\r\n")  # 16 bytes


# -- SOCKS5 ---------------------------------------------------------------------------------


def _drive(shake: Socks5Handshake, chunks: list[bytes]) -> bytes:
    """Everything the handshake sends while the upstream's reply arrives in `chunks`."""
    sent = shake.start()
    for chunk in chunks:
        sent += shake.feed(chunk)
    return sent


def test_socks5_without_credentials_by_address_and_by_name() -> None:
    reply = b"\x05\x00" + b"\x05\x00\x00\x01" + bytes(6) + b"early"
    for host, request in (
        (IP, b"\x05\x01\x00\x01" + IP.packed + b"\x01\xbb"),
        (IP6, b"\x05\x01\x00\x04" + IP6.packed + b"\x01\xbb"),
        ("pypi.org", b"\x05\x01\x00\x03\x08pypi.org\x01\xbb"),
    ):
        for chunks in chunkings(reply):
            shake = Socks5Handshake(host, 443, None)
            sent = _drive(shake, chunks)
            assert sent == b"\x05\x01\x00" + request
            assert shake.done and shake.trailing == b"early"


def test_socks5_with_credentials_and_a_domain_bound_address() -> None:
    reply = b"\x05\x02" + b"\x01\x00" + b"\x05\x00\x00\x03\x04bind\x00\x50"
    for chunks in chunkings(reply):
        shake = Socks5Handshake(IP, 80, CREDENTIALS)
        sent = _drive(shake, chunks)
        auth = b"\x01\x05alice\x11s3cret:with colon"
        assert sent == b"\x05\x02\x00\x02" + auth + b"\x05\x01\x00\x01" + IP.packed + b"\x00\x50"
        assert shake.done and shake.trailing == b""


@pytest.mark.parametrize(
    ("credentials", "reply", "failure", "retry"),
    [
        (None, b"\x05\xff", "upstream_failed", False),
        (None, b"\x05\x02", "upstream_failed", False),  # wants credentials we have not
        (CREDENTIALS, b"\x05\x02\x01\x01", "upstream_failed", False),  # refused them
        (None, b"\x04\x00", "upstream_failed", False),
        (None, b"\x05\x00\x05\x02\x00\x01" + bytes(6), "upstream_denied", False),
        (None, b"\x05\x00\x05\x03\x00\x01" + bytes(6), "network_unreachable", True),
        (None, b"\x05\x00\x05\x04\x00\x01" + bytes(6), "network_unreachable", True),
        (None, b"\x05\x00\x05\x05\x00\x01" + bytes(6), "connect_refused", True),
        (None, b"\x05\x00\x05\x06\x00\x01" + bytes(6), "connect_timeout", True),
        (None, b"\x05\x00\x05\x07\x00\x01" + bytes(6), "upstream_failed", False),
        (None, b"\x05\x00\x05\x09\x00\x01" + bytes(6), "upstream_failed", False),
        (None, b"\x05\x00\x05\x00\x01\x01" + bytes(6), "upstream_failed", False),
        (None, b"\x05\x00\x05\x00\x00\x07" + bytes(6), "upstream_failed", False),
    ],
)
def test_socks5_refusals(
    credentials: UpstreamCredentials | None, reply: bytes, failure: str, retry: bool
) -> None:
    shake = Socks5Handshake(IP, 443, credentials)
    shake.start()
    with pytest.raises(UpstreamRefusedError) as info:
        shake.feed(reply)
    assert (info.value.failure, info.value.retry) == (failure, retry)
    assert "s3cret" not in str(info.value)


def test_handshake_picks_the_kind() -> None:
    http = Upstream(parse_upstream("http://p.example:1"))
    socks = Upstream(parse_upstream("socks5://p.example:1"), CREDENTIALS)
    assert isinstance(handshake(http, IP, 1), HttpConnectHandshake)
    assert isinstance(handshake(socks, IP, 1), Socks5Handshake)


def test_describe_upstream_for_doctor() -> None:
    assert describe_upstream(None)["pinning"] == "full"
    by_name = describe_upstream(parse_upstream("http://p.example:3128", "name"))
    assert by_name["pinning"] == "partial" and "pinning: partial" in str(by_name["line"])
    assert describe_upstream(parse_upstream("socks5://p.example:1"))["target"] == "address"


# -- the policy keys --------------------------------------------------------------------------


def test_policy_keys_and_run_override() -> None:
    data = {"egress": {"allow": ["pypi.org"], "upstream": "http://p.example:3128"}}
    policy = parse_policy(data, env={})
    assert policy.upstream == UpstreamProxy(UpstreamKind.HTTP, "p.example", 3128)
    assert policy.warnings == ()
    by_name = parse_policy({"egress": {**data["egress"], "upstream_target": "name"}}, env={})
    assert UPSTREAM_BY_NAME_WARNING in by_name.warnings
    other = with_upstream(policy, parse_upstream("socks5://q.example:1", "name"))
    assert other.upstream is not None and other.upstream.host == "q.example"
    assert UPSTREAM_BY_NAME_WARNING in other.warnings
    assert policy.upstream.host == "p.example" and other.allow.rules == policy.allow.rules


@pytest.mark.parametrize(
    ("egress", "words"),
    [
        ({"upstream": "http://a:hunter2@p.example:1"}, "egress.upstream: credentials"),
        ({"upstream": 3128}, "egress.upstream: must be a URL string"),
        ({"upstream": "http://p.example:1", "upstream_target": "ip"}, "egress.upstream_target"),
        ({"upstream_target": "name"}, "egress.upstream_target: needs egress.upstream"),
        ({"upstreams": "http://p.example:1"}, 'did you mean "upstream"'),
    ],
)
def test_policy_key_problems(egress: dict[str, object], words: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy({"egress": {"allow": ["pypi.org"], **egress}}, env={})
    assert words in str(info.value) and "hunter2" not in str(info.value)
