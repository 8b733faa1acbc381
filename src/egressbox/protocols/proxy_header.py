"""Sans-IO reader of the PROXY protocol header (HAProxy's proxy-protocol.txt, v1 and v2).

A load balancer in TCP mode (HAProxy `send-proxy` / `send-proxy-v2`, a cloud NLB) opens
each connection to the proxy with one header that names the client it accepted. Feed
the connection's first bytes to `ProxyHeaderReader.feed` until it returns a
`ProxyHeader`; `trailing` then holds the bytes after the header (the client's request).
Anything that is not exactly one valid header raises `ProxyHeaderError`, whose `cause`
is a stable snake_case code: the listener closes the connection and counts the cause.

What is accepted (and why the rest is refused):

- v1: `PROXY TCP4|TCP6 SRC DST SPORT DPORT\\r\\n`, at most 107 bytes (the spec's bound),
  canonical dotted quads, IPv6 text without a zone, ports in plain decimal 0-65535 with
  no sign, underscore or leading zero. `PROXY UNKNOWN ...\\r\\n` is the sender's "no
  address" (the spec says to use the connection's own): `local` is then True.
- v2: the 12-byte signature, version 2, command LOCAL (a health check of the balancer
  itself: its address block is ignored, `local` True) or PROXY with TCP over IPv4 or
  IPv6; PROXY with AF_UNSPEC is treated as LOCAL, as the spec asks. UDP and UNIX
  families are refused (this is a TCP proxy; a UNIX-socket source has no IP to count).
  The address block is followed by TLVs, which are walked (each must fit inside the
  declared length) and skipped: none changes a decision here. PP2_TYPE_CRC32C is not
  verified (TCP already checksums the bytes; the header comes from a trusted hop).
  The declared length may not exceed MAX_V2_PAYLOAD.

Why not a library: PyPI's `proxy-protocol` (the one maintained package) reads from an
awaited StreamReader, accepts v1 ports like `+80` and `8_0` (Python's int()), has no
bound on a v1 line, and lets `struct.error` escape on a short v2 address block; our
listeners are asyncio Protocols that must not start a Task per connection.

No I/O here, no asyncio, no socket (DESIGN §10): bytes in, a value or an error out.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

from egressbox.core.errors import EgressboxError
from egressbox.core.ip import IPAddress, IPNetwork

# proxy-protocol.txt §2.1: "the maximum line length is 107 bytes including the CRLF"
# (the longest TCP6 line with both addresses and ports at their longest).
V1_MAX_LINE = 107
V1_PREFIX = b"PROXY "
# §2.2: the 12-byte signature, then version/command, family/protocol, a 16-bit length.
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_HEADER_BYTES = 16
# Largest v2 address block plus TLVs accepted. Balancers send far less: HAProxy's TLVs
# (ALPN, authority, unique id up to 128 bytes, SSL fields with the client CN) and AWS's
# VPC endpoint id fit in a few hundred bytes, so 4 KiB leaves room without letting a
# connection make the proxy hold the 64 KiB the 16-bit length allows.
MAX_V2_PAYLOAD = 4096
MAX_HEADER_BYTES = V2_HEADER_BYTES + MAX_V2_PAYLOAD

_V2_VERSION = 0x2
_V2_LOCAL = 0x0
_V2_PROXY = 0x1
_AF_UNSPEC = 0x0
_AF_INET = 0x1
_AF_INET6 = 0x2
_AF_UNIX = 0x3
_STREAM = 0x1
_DGRAM = 0x2
# Address block sizes (§2.2): two addresses and two 16-bit ports.
_INET_BLOCK = 12
_INET6_BLOCK = 36
_TLV_HEAD = 3  # type (1 byte), length (2 bytes, big-endian)

_PORT = rb"(0|[1-9][0-9]{0,4})"
_OCTET = rb"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_V4 = rb"(" + _OCTET + rb"(?:\." + _OCTET + rb"){3})"
_V6 = rb"([0-9A-Fa-f:.]{2,45})"
_V1_TCP4 = re.compile(rb"PROXY TCP4 " + _V4 + b" " + _V4 + b" " + _PORT + b" " + _PORT)
_V1_TCP6 = re.compile(rb"PROXY TCP6 " + _V6 + b" " + _V6 + b" " + _PORT + b" " + _PORT)
# UNKNOWN: the rest of the line is ignored, but it is still a line of printable text.
_V1_UNKNOWN = re.compile(rb"PROXY UNKNOWN(?: [\x20-\x7e]*)?")


class Cause:
    """Why a connection was refused before its request (stable: counted, said, documented)."""

    NOT_PROXY_PROTOCOL = "not_proxy_protocol"  # the first bytes are no PROXY header at all
    MALFORMED = "malformed_header"  # a header that breaks the grammar
    TOO_LONG = "header_too_long"  # longer than V1_MAX_LINE or MAX_V2_PAYLOAD
    UNSUPPORTED = "unsupported_header"  # a UDP or UNIX-socket source


class ProxyHeaderError(EgressboxError):
    """Not one valid PROXY header; `cause` is a Cause value. The message never echoes
    the bytes (they are the client's)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """One parsed header. `local`: the sender named no client (v2 LOCAL, v2 PROXY with
    AF_UNSPEC, v1 UNKNOWN): use the connection's own peer. Otherwise `source` is the
    client the balancer accepted and `destination` the address it was accepted on."""

    version: int
    local: bool
    source: tuple[IPAddress, int] | None = None
    destination: tuple[IPAddress, int] | None = None
    length: int = 0  # bytes the header took


class ProxyHeaderReader:
    """Feed the connection's first bytes; one header, then `trailing`."""

    def __init__(self) -> None:
        self._buffer = b""
        self._header: ProxyHeader | None = None

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def trailing(self) -> bytes:
        """After the header: the bytes that followed it (the client's own)."""
        return self._buffer if self._header is not None else b""

    def feed(self, data: bytes) -> ProxyHeader | None:
        """The header once it is complete (None until then); ProxyHeaderError if the
        bytes cannot become one. Feeding after the header is a caller's bug."""
        if self._header is not None:
            raise RuntimeError("the header is already read; the rest is `trailing`")
        self._buffer += data
        header = self._parse()
        if header is not None:
            self._header = header
            self._buffer = self._buffer[header.length :]
        return header

    def _parse(self) -> ProxyHeader | None:
        buf = self._buffer
        if not buf:
            return None
        if buf[0] == V1_PREFIX[0]:
            return _v1(buf)
        if buf[0] == V2_SIGNATURE[0]:
            return _v2(buf)
        raise _not_a_header()


def _not_a_header() -> ProxyHeaderError:
    return ProxyHeaderError(
        Cause.NOT_PROXY_PROTOCOL, "the connection did not begin with a PROXY protocol header"
    )


def _malformed(what: str) -> ProxyHeaderError:
    return ProxyHeaderError(Cause.MALFORMED, f"malformed PROXY protocol header: {what}")


# -- v1 ---------------------------------------------------------------------------------


def _v1(buf: bytes) -> ProxyHeader | None:
    head = buf[: len(V1_PREFIX)]
    if not V1_PREFIX.startswith(head):
        raise _not_a_header()
    end = buf.find(b"\r\n", 0, V1_MAX_LINE)
    if end < 0:
        if b"\n" in buf[:V1_MAX_LINE]:
            raise _malformed("v1 line not ended by CRLF")
        if len(buf) >= V1_MAX_LINE:
            raise ProxyHeaderError(
                Cause.TOO_LONG, f"PROXY protocol v1 line longer than {V1_MAX_LINE} bytes"
            )
        return None
    return _v1_line(buf[:end], end + 2)


def _v1_line(line: bytes, length: int) -> ProxyHeader:
    if _V1_UNKNOWN.fullmatch(line):
        return ProxyHeader(1, True, length=length)
    match = _V1_TCP4.fullmatch(line)
    version = 4
    if match is None:
        match = _V1_TCP6.fullmatch(line)
        version = 6
    if match is None:
        raise _malformed("v1 line is not PROXY TCP4|TCP6 SRC DST SPORT DPORT or UNKNOWN")
    source = _v1_address(match.group(1), version)
    destination = _v1_address(match.group(2), version)
    ports = _v1_port(match.group(3)), _v1_port(match.group(4))
    return ProxyHeader(1, False, (source, ports[0]), (destination, ports[1]), length)


def _v1_address(text: bytes, version: int) -> IPAddress:
    try:
        ip = ipaddress.ip_address(text.decode("ascii"))
    except ValueError:
        raise _malformed("v1 address is not an IP address") from None
    if ip.version != version:
        raise _malformed("v1 address does not match its family")
    return ip


def _v1_port(text: bytes) -> int:
    port = int(text)
    if port > 0xFFFF:
        raise _malformed("v1 port is larger than 65535")
    return port


# -- v2 ---------------------------------------------------------------------------------


def _v2(buf: bytes) -> ProxyHeader | None:
    head = buf[: len(V2_SIGNATURE)]
    if not V2_SIGNATURE.startswith(head):
        # "\r\n..." that is not the signature: not a header (an HTTP client's stray CRLF).
        raise _not_a_header()
    if len(buf) < V2_HEADER_BYTES:
        return None
    version, command = buf[12] >> 4, buf[12] & 0x0F
    if version != _V2_VERSION:
        raise _malformed("v2 version is not 2")
    if command not in (_V2_LOCAL, _V2_PROXY):
        raise _malformed("v2 command is neither LOCAL nor PROXY")
    size = int.from_bytes(buf[14:16], "big")
    if size > MAX_V2_PAYLOAD:
        raise ProxyHeaderError(
            Cause.TOO_LONG, f"PROXY protocol v2 header longer than {MAX_V2_PAYLOAD} bytes"
        )
    length = V2_HEADER_BYTES + size
    if len(buf) < length:
        return None
    family, transport = buf[13] >> 4, buf[13] & 0x0F
    if command == _V2_LOCAL or family == _AF_UNSPEC:
        # LOCAL: the balancer's own connection (health check); its block means nothing.
        return ProxyHeader(2, True, length=length)
    return _v2_proxy(buf[V2_HEADER_BYTES:length], family, transport, length)


def _v2_proxy(block: bytes, family: int, transport: int, length: int) -> ProxyHeader:
    if family not in (_AF_INET, _AF_INET6, _AF_UNIX):
        raise _malformed("v2 address family is unknown")
    if transport not in (_STREAM, _DGRAM):
        raise _malformed("v2 transport protocol is unknown")
    if family == _AF_UNIX or transport == _DGRAM:
        raise ProxyHeaderError(
            Cause.UNSUPPORTED, "PROXY protocol v2 header names a UDP or UNIX-socket source"
        )
    size = _INET_BLOCK if family == _AF_INET else _INET6_BLOCK
    if len(block) < size:
        raise _malformed("v2 address block is shorter than its family needs")
    width = (size - 4) // 2
    source_ip = ipaddress.ip_address(block[:width])
    destination_ip = ipaddress.ip_address(block[width : 2 * width])
    ports = block[2 * width : size]
    _check_tlvs(block[size:])
    source = (source_ip, int.from_bytes(ports[:2], "big"))
    destination = (destination_ip, int.from_bytes(ports[2:], "big"))
    return ProxyHeader(2, False, source, destination, length)


def _check_tlvs(data: bytes) -> None:
    """Walk the TLVs after the address block: each must fit; their values are skipped."""
    at = 0
    while at < len(data):
        if len(data) - at < _TLV_HEAD:
            raise _malformed("v2 TLV cut short")
        size = int.from_bytes(data[at + 1 : at + 3], "big")
        at += _TLV_HEAD + size
        if at > len(data):
            raise _malformed("v2 TLV longer than the header")


# -- building (tests, fuzzing, and anyone who needs to send one) ------------------------


def build_v1(source: tuple[IPAddress, int] | None, destination: tuple[IPAddress, int]) -> bytes:
    """A v1 line; `source` None builds `PROXY UNKNOWN`."""
    if source is None:
        return b"PROXY UNKNOWN\r\n"
    family = b"TCP4" if source[0].version == 4 else b"TCP6"
    return b"PROXY %b %b %b %d %d\r\n" % (
        family,
        str(source[0]).encode(),
        str(destination[0]).encode(),
        source[1],
        destination[1],
    )


def build_v2(
    source: tuple[IPAddress, int] | None,
    destination: tuple[IPAddress, int] | None = None,
    tlvs: tuple[tuple[int, bytes], ...] = (),
) -> bytes:
    """A v2 header: PROXY over TCP from `source` to `destination`, or LOCAL when
    `source` is None; `tlvs` are (type, value) pairs appended after the addresses."""
    extra = b"".join(bytes([kind]) + len(value).to_bytes(2, "big") + value for kind, value in tlvs)
    if source is None:
        return V2_SIGNATURE + bytes([0x20, 0x00]) + len(extra).to_bytes(2, "big") + extra
    assert destination is not None
    family = _AF_INET if source[0].version == 4 else _AF_INET6
    block = source[0].packed + destination[0].packed
    block += source[1].to_bytes(2, "big") + destination[1].to_bytes(2, "big") + extra
    head = bytes([0x21, (family << 4) | _STREAM]) + len(block).to_bytes(2, "big")
    return V2_SIGNATURE + head + block


# -- trusted senders ----------------------------------------------------------------------


# `--proxy-protocol` without `--proxy-protocol-from`: a balancer on this host.
DEFAULT_TRUSTED = ("127.0.0.0/8", "::1/128")


def parse_trusted(texts: Sequence[str]) -> tuple[IPNetwork, ...]:
    """Trusted senders from `CIDR[,CIDR...]` texts (an address alone is its /32 or /128).
    ValueError names the entry that is not a network."""
    networks: list[IPNetwork] = []
    for text in texts:
        for item in text.split(","):
            entry = item.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=True))
            except ValueError:
                raise ValueError(
                    f"{entry!r} is not an address or a network (e.g. 10.0.0.0/24 or ::1)"
                ) from None
    if not networks:
        raise ValueError("no trusted address given (e.g. 10.0.0.0/24,127.0.0.1)")
    return tuple(dict.fromkeys(networks))


def unmapped(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (a dual-stack listener's view of an IPv4 peer) as IPv4."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_trusted(ip: IPAddress, trusted: Sequence[IPNetwork]) -> bool:
    ip = unmapped(ip)
    return any(ip.version == net.version and ip in net for net in trusted)
