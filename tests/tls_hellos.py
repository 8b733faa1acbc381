"""TLS ClientHellos for the tests: real ones from Python's ssl (no socket), hand-built ones."""

from __future__ import annotations

import itertools
import ssl
import struct
from collections.abc import Iterable, Sequence

HANDSHAKE = 22
EXT_ENCRYPTED_CLIENT_HELLO = 0xFE0D


def real_hello(
    server_hostname: str | None,
    *,
    maximum: ssl.TLSVersion = ssl.TLSVersion.MAXIMUM_SUPPORTED,
    alpn: Sequence[str] = (),
) -> bytes:
    """The first flight of a Python ssl client (one record holding its ClientHello)."""
    context = ssl.create_default_context()
    if server_hostname is None:
        context.check_hostname = False
    context.maximum_version = maximum
    if alpn:
        context.set_alpn_protocols(list(alpn))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    try:
        client.do_handshake()
    except ssl.SSLWantReadError:
        return outgoing.read()
    raise AssertionError("a TLS client handshake finished without a server")


def handshake_message(flight: bytes) -> bytes:
    """The handshake bytes of a flight of handshake records (headers dropped)."""
    message = b""
    at = 0
    while at < len(flight):
        assert flight[at] == HANDSHAKE
        (size,) = struct.unpack("!H", flight[at + 3 : at + 5])
        message += flight[at + 5 : at + 5 + size]
        at += 5 + size
    return message


def records(message: bytes, cuts: Iterable[int], version: bytes = b"\x03\x01") -> bytes:
    """`message` re-framed as handshake records split at the sorted offsets `cuts`."""
    points = [0, *sorted({c for c in cuts if 0 < c < len(message)}), len(message)]
    out = b""
    for start, end in itertools.pairwise(points):
        out += bytes([HANDSHAKE]) + version + struct.pack("!H", end - start)
        out += message[start:end]
    return out


def vec(size: int, data: bytes) -> bytes:
    return len(data).to_bytes(size, "big") + data


def sni_extension(*entries: tuple[int, bytes]) -> bytes:
    return vec(2, b"".join(bytes([kind]) + vec(2, name) for kind, name in entries))


def extension(kind: int, data: bytes) -> bytes:
    return struct.pack("!H", kind) + vec(2, data)


def hello_body(
    extensions: Sequence[bytes] | None = (),
    *,
    version: bytes = b"\x03\x03",
    session_id: bytes = bytes(32),
    suites: bytes = b"\x13\x01\x13\x02",
    compression: bytes = b"\x00",
) -> bytes:
    body = version + bytes(32) + vec(1, session_id) + vec(2, suites) + vec(1, compression)
    if extensions is not None:
        body += vec(2, b"".join(extensions))
    return body


def wrap(body: bytes, handshake_type: int = 1) -> bytes:
    """A handshake message in one record."""
    message = bytes([handshake_type]) + len(body).to_bytes(3, "big") + body
    return records(message, [])


# An outer ClientHello's encrypted_client_hello (RFC 9849 §5): type outer (0),
# HPKE suite (KDF HKDF-SHA256, AEAD AES-128-GCM), config id, enc, payload.
ECH_OUTER = b"\x00" + b"\x00\x01\x00\x01" + b"\x2a" + vec(2, bytes(32)) + vec(2, bytes(144))


def ech_hello(public_name: bytes | None) -> bytes:
    """An outer ClientHello offering ECH, with `public_name` as its SNI (None: none)."""
    extensions = []
    if public_name is not None:
        extensions.append(extension(0, sni_extension((0, public_name))))
    extensions.append(extension(0x002B, b"\x02\x03\x04"))  # supported_versions: TLS 1.3
    extensions.append(extension(EXT_ENCRYPTED_CLIENT_HELLO, ECH_OUTER))
    return wrap(hello_body(extensions))
