"""The PROXY protocol header reader (v1 text, v2 binary): exact values, any chunking,
bounds, and hostile input. Every valid header is fed whole, byte by byte and with the
client's bytes behind it; anything else must raise ProxyHeaderError with a stable cause
and nothing else."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressbox.core.ip import IPAddress
from egressbox.protocols.proxy_header import (
    MAX_V2_PAYLOAD,
    V1_MAX_LINE,
    V2_SIGNATURE,
    Cause,
    ProxyHeader,
    ProxyHeaderError,
    ProxyHeaderReader,
    build_v1,
    build_v2,
    is_trusted,
    parse_trusted,
)

CLIENT_BYTES = b"CONNECT origin.test:443 HTTP/1.1\r\n\r\n\x00\xff"
V4A, V4B = ipaddress.ip_address("198.51.100.7"), ipaddress.ip_address("192.0.2.1")
V6A, V6B = ipaddress.ip_address("2001:db8::7"), ipaddress.ip_address("2001:db8::1")


def feed_in(chunks: Iterator[bytes] | list[bytes]) -> tuple[ProxyHeader | None, bytes]:
    reader = ProxyHeaderReader()
    header = None
    rest = b""
    for chunk in chunks:
        if header is not None:
            rest += chunk
            continue
        header = reader.feed(chunk)
    return header, (reader.trailing + rest if header is not None else b"")


def every_way(data: bytes) -> list[tuple[ProxyHeader | None, bytes]]:
    """Whole, byte by byte, and cut at every offset into two."""
    ways = [feed_in([data]), feed_in(data[i : i + 1] for i in range(len(data)))]
    ways += [feed_in([data[:cut], data[cut:]]) for cut in range(len(data) + 1)]
    return ways


def the_error(data: bytes) -> ProxyHeaderError:
    with pytest.raises(ProxyHeaderError) as info:
        ProxyHeaderReader().feed(data)
    return info.value


# -- valid headers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            b"PROXY TCP4 198.51.100.7 192.0.2.1 56324 443\r\n",
            ProxyHeader(1, False, (V4A, 56324), (V4B, 443), 45),
        ),
        (
            b"PROXY TCP6 2001:db8::7 2001:db8::1 0 65535\r\n",
            ProxyHeader(1, False, (V6A, 0), (V6B, 65535), 44),
        ),
        (b"PROXY UNKNOWN\r\n", ProxyHeader(1, True, None, None, 15)),
        (
            b"PROXY UNKNOWN ffff:f...f:ffff ffff:f...f:ffff 65535 65535\r\n",
            ProxyHeader(1, True, None, None, 59),
        ),
        (build_v2((V4A, 1), (V4B, 2)), ProxyHeader(2, False, (V4A, 1), (V4B, 2), 28)),
        (build_v2((V6A, 3), (V6B, 4)), ProxyHeader(2, False, (V6A, 3), (V6B, 4), 52)),
        (build_v2(None), ProxyHeader(2, True, None, None, 16)),
    ],
)
def test_valid_headers_any_chunking_with_client_bytes_behind(
    data: bytes, expected: ProxyHeader
) -> None:
    for header, rest in every_way(data + CLIENT_BYTES):
        assert header == expected
        assert rest == CLIENT_BYTES
    for header, rest in every_way(data):
        assert (header, rest) == (expected, b"")


def test_v2_tlvs_are_walked_and_skipped() -> None:
    tlvs = ((0x01, b"h2"), (0x02, b"origin.test"), (0x05, b"u" * 128), (0x04, b""), (0xEE, b"x"))
    data = build_v2((V4A, 9), (V4B, 10), tlvs)
    for header, rest in every_way(data + b"GET"):
        assert header is not None and header.source == (V4A, 9) and rest == b"GET"


def test_v2_local_ignores_its_block_and_proxy_unspec_is_local() -> None:
    garbage = b"\x99" * 40
    local = V2_SIGNATURE + bytes([0x20, 0x77]) + len(garbage).to_bytes(2, "big") + garbage
    header, rest = feed_in([local + b"x"])
    assert header == ProxyHeader(2, True, None, None, 56) and rest == b"x"
    unspec = V2_SIGNATURE + bytes([0x21, 0x00, 0, 4]) + b"abcd"
    assert feed_in([unspec])[0] == ProxyHeader(2, True, None, None, 20)


def test_haproxy_v1_example_line() -> None:
    # proxy-protocol.txt §2.1's own example.
    line = b"PROXY TCP4 255.255.255.255 255.255.255.255 65535 65535\r\n"
    header, _ = feed_in([line])
    assert header is not None and header.source == (ipaddress.ip_address("255.255.255.255"), 65535)


# -- refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\n",
        b"CONNECT a:1 HTTP/1.1\r\n\r\n",
        b"\x05\x01\x00",
        b"\x16\x03\x01\x00",
        b"PROXZ",
        b"\r\n\r\n\x00\r\nQUIX",
        b"\r\nGET",
    ],
)
def test_not_a_header(data: bytes) -> None:
    assert the_error(data).cause == Cause.NOT_PROXY_PROTOCOL


@pytest.mark.parametrize(
    "line",
    [
        b"PROXY TCP4 198.51.100.7 192.0.2.1 +80 443\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 8_0 443\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 080 443\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 65536 443\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 80\r\n",
        b"PROXY TCP4 198.051.100.7 192.0.2.1 80 443\r\n",
        b"PROXY TCP4 2001:db8::7 192.0.2.1 80 443\r\n",
        b"PROXY TCP6 198.51.100.7 2001:db8::1 80 443\r\n",
        b"PROXY TCP6 fe80::1%eth0 2001:db8::1 80 443\r\n",
        b"PROXY TCP6 2001:db8:::7 2001:db8::1 80 443\r\n",
        b"PROXY TCP4  198.51.100.7 192.0.2.1 80 443\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 80 443 \r\n",
        b"PROXY tcp4 198.51.100.7 192.0.2.1 80 443\r\n",
        b"PROXY UDP4 198.51.100.7 192.0.2.1 80 443\r\n",
        b"PROXY UNKNOWN\x00\r\n",
        b"PROXY TCP4 198.51.100.7 192.0.2.1 80 443\n",
        b"PROXY \r\n",
    ],
)
def test_malformed_v1(line: bytes) -> None:
    assert the_error(line).cause == Cause.MALFORMED


def test_v1_longer_than_107_bytes() -> None:
    line = b"PROXY UNKNOWN " + b"x" * (V1_MAX_LINE - 15) + b"\r\n"
    assert len(line) == V1_MAX_LINE + 1
    assert the_error(line).cause == Cause.TOO_LONG
    # The bound is the spec's: 107 bytes with the CRLF still pass.
    assert feed_in([line[:-3] + b"\r\n"])[0] is not None
    # And it is enforced before a CRLF arrives, so a connection cannot make us wait for more.
    assert the_error(b"PROXY UNKNOWN " + b"x" * V1_MAX_LINE).cause == Cause.TOO_LONG


def _v2(ver_cmd: int, fam: int, block: bytes) -> bytes:
    return V2_SIGNATURE + bytes([ver_cmd, fam]) + len(block).to_bytes(2, "big") + block


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (_v2(0x11, 0x11, bytes(12)), Cause.MALFORMED),  # version 1 in a v2 header
        (_v2(0x22, 0x11, bytes(12)), Cause.MALFORMED),  # command 2
        (_v2(0x21, 0x11, bytes(11)), Cause.MALFORMED),  # address block too short
        (_v2(0x21, 0x21, bytes(35)), Cause.MALFORMED),
        (_v2(0x21, 0x41, bytes(12)), Cause.MALFORMED),  # family 4
        (_v2(0x21, 0x13, bytes(12)), Cause.MALFORMED),  # transport 3
        (_v2(0x21, 0x11, bytes(12) + b"\x01\x00"), Cause.MALFORMED),  # TLV head cut
        (_v2(0x21, 0x11, bytes(12) + b"\x01\x00\x05abc"), Cause.MALFORMED),  # TLV overruns
        (_v2(0x21, 0x12, bytes(12)), Cause.UNSUPPORTED),  # UDP over IPv4
        (_v2(0x21, 0x22, bytes(36)), Cause.UNSUPPORTED),  # UDP over IPv6
        (_v2(0x21, 0x31, bytes(216)), Cause.UNSUPPORTED),  # UNIX stream
    ],
)
def test_refused_v2(data: bytes, cause: str) -> None:
    assert the_error(data).cause == cause


def test_v2_length_bound_is_checked_from_the_fixed_part() -> None:
    head = V2_SIGNATURE + bytes([0x21, 0x11]) + (MAX_V2_PAYLOAD + 1).to_bytes(2, "big")
    assert the_error(head).cause == Cause.TOO_LONG
    value = bytes(MAX_V2_PAYLOAD - 15)
    fits = _v2(0x21, 0x11, bytes(12) + b"\x04" + len(value).to_bytes(2, "big") + value)
    assert feed_in([fits])[0] is not None


def test_messages_never_echo_the_bytes() -> None:
    secret = b"Proxy-Authorization: Basic c2VjcmV0"
    for data in (secret, b"PROXY TCP4 " + secret + b"\r\n"):
        assert "c2VjcmV0" not in str(the_error(data))


def test_feeding_after_the_header_is_a_bug() -> None:
    reader = ProxyHeaderReader()
    assert reader.feed(b"PROXY UNKNOWN\r\n") is not None
    with pytest.raises(RuntimeError):
        reader.feed(b"x")


# -- trusted senders -------------------------------------------------------------------------


def test_trusted_lists() -> None:
    trusted = parse_trusted(["127.0.0.1, 10.0.0.0/24", "::1"])
    assert [str(n) for n in trusted] == ["127.0.0.1/32", "10.0.0.0/24", "::1/128"]
    assert is_trusted(ipaddress.ip_address("10.0.0.77"), trusted)
    assert is_trusted(ipaddress.ip_address("::ffff:10.0.0.77"), trusted)  # a dual-stack view
    assert not is_trusted(ipaddress.ip_address("10.0.1.1"), trusted)
    assert not is_trusted(ipaddress.ip_address("::2"), trusted)
    for bad in (["10.0.0.1/24"], ["host.example"], [""], [","]):
        with pytest.raises(ValueError):
            parse_trusted(bad)


# -- properties ------------------------------------------------------------------------------

ipv4: st.SearchStrategy[IPAddress] = st.builds(ipaddress.IPv4Address, st.integers(0, 2**32 - 1))
ipv6: st.SearchStrategy[IPAddress] = st.builds(ipaddress.IPv6Address, st.integers(0, 2**128 - 1))
ports = st.integers(0, 65535)
tlvs = st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=64)), max_size=6)


@st.composite
def endpoints(draw: st.DrawFn) -> tuple[tuple[IPAddress, int], tuple[IPAddress, int]]:
    family: st.SearchStrategy[IPAddress] = draw(st.sampled_from([ipv4, ipv6]))
    return (draw(family), draw(ports)), (draw(family), draw(ports))


@settings(max_examples=300, deadline=None)
@given(endpoints(), tlvs, st.binary(max_size=64), st.data())
def test_built_headers_read_back_at_any_cut(
    ends: tuple[tuple[IPAddress, int], tuple[IPAddress, int]],
    extra: list[tuple[int, bytes]],
    behind: bytes,
    data: st.DataObject,
) -> None:
    source, destination = ends
    for built, version in ((build_v1(source, destination), 1), (build_v2(*ends, tuple(extra)), 2)):
        if version == 1 and len(built) > V1_MAX_LINE:
            continue  # only IPv6 can exceed it, and no canonical text does
        whole = built + behind
        cut = data.draw(st.integers(0, len(whole)))
        header, rest = feed_in([whole[:cut], whole[cut:]])
        assert header == ProxyHeader(version, False, source, destination, len(built))
        assert rest == behind


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300), st.data())
def test_any_bytes_give_a_header_or_a_cause_at_any_cut(blob: bytes, data: st.DataObject) -> None:
    starts = [b"", b"PROXY ", b"PROXY TCP4 ", V2_SIGNATURE, V2_SIGNATURE + b"\x21\x11"]
    whole = data.draw(st.sampled_from(starts)) + blob
    outcomes = []
    for cut in (0, data.draw(st.integers(0, len(whole))), len(whole)):
        try:
            outcomes.append(feed_in([whole[:cut], whole[cut:]]))
        except ProxyHeaderError as exc:
            assert exc.cause in {
                Cause.NOT_PROXY_PROTOCOL,
                Cause.MALFORMED,
                Cause.TOO_LONG,
                Cause.UNSUPPORTED,
            }
            outcomes.append(("error", exc.cause))  # type: ignore[arg-type]
    assert all(outcome == outcomes[0] for outcome in outcomes), outcomes
