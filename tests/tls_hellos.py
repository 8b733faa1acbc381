"""TLS ClientHellos for the tests: real ones from Python's ssl (no socket), hand-built ones."""

from __future__ import annotations

import itertools
import shutil
import socket
import ssl
import struct
import subprocess
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


# -- the most lenient receiver: Go's crypto/tls record layer, as a model ------------------------
#
# Go's server (crypto/tls/conn.go, readRecordOrCCS, before a version is negotiated) takes
# every record whose type is alert or handshake and whose version is below 0x1000, drops
# warning alerts (at most maxUselessRecords = 16 in a row), and reassembles a handshake
# message from any number of records. tests/proxy/test_tls_lenient.py checks this model
# against the real Go; the reader's tests and fuzz/fuzz_tls.py use it as their oracle.

GO_MAX_USELESS = 16  # maxUselessRecords, crypto/tls/common.go
GO_MAX_CIPHERTEXT = 16384 + 2048  # maxCiphertext: a record header's length above is refused
GO_MAX_PLAINTEXT = 16384
GO_MAX_HANDSHAKE = 65536  # maxHandshake
GO_FIRST_VERSION_LIMIT = 0x1000  # "the current max version is 3.3 so if >= 16.0 it's not real"
ALERT = 21
ALERT_WARNING = 1
CLOSE_NOTIFY = 0


def go_record_layer(data: bytes) -> bytes | None:
    """The first handshake message (with its 4-byte header) Go's server assembles from
    these first bytes; None when it stops before one is complete (refused, or too few)."""
    hand = b""
    at = 0
    useless = 0
    while True:
        if len(hand) >= 4:
            size = int.from_bytes(hand[1:4], "big")
            if size > GO_MAX_HANDSHAKE:
                return None
            if len(hand) >= 4 + size:
                return hand[: 4 + size]
        if len(data) - at < 5:
            return None
        kind = data[at]
        version = int.from_bytes(data[at + 1 : at + 3], "big")
        size = int.from_bytes(data[at + 3 : at + 5], "big")
        if kind not in (ALERT, HANDSHAKE) or version >= GO_FIRST_VERSION_LIMIT:
            return None  # includes 0x80, Go's SSL 2.0 test
        if size > GO_MAX_CIPHERTEXT or len(data) - at - 5 < size:
            return None
        body = data[at + 5 : at + 5 + size]
        at += 5 + size
        if size > GO_MAX_PLAINTEXT:
            return None
        if kind == HANDSHAKE:
            if not body:
                return None
            hand += body
            useless = 0
            continue
        if size != 2 or body[1] == CLOSE_NOTIFY or body[0] != ALERT_WARNING:
            return None
        useless += 1
        if useless > GO_MAX_USELESS:
            return None


def lenient_variants(flight: bytes) -> dict[str, bytes]:
    """A real first flight rewritten as lenient receivers take it: other record versions,
    warning alerts and CCS before it, split across records with an alert in between."""
    message = handshake_message(flight)
    warning = bytes([ALERT, 3, 1, 0, 2, ALERT_WARNING, 112])  # unrecognized_name, warning
    ccs = bytes([20, 3, 1, 0, 1, 1])
    half = len(message) // 2
    return {
        "version_0201": records(message, [], b"\x02\x01"),
        "version_0000": records(message, [], b"\x00\x00"),
        "version_0f03": records(message, [], b"\x0f\x03"),
        "warning_alert": warning + flight,
        "alert_and_ccs": warning + ccs + flight,
        "split_alert_between": records(message[:half], [], b"\x00\x00")
        + warning
        + records(message[half:], [], b"\x0f\x03"),
    }


def openssl_flight(name: str, timeout: float) -> bytes | None:
    """The first flight of `openssl s_client` naming `name` (a loopback listener takes it),
    or None without openssl or when it sends nothing within `timeout` seconds."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(timeout)
        port = listener.getsockname()[1]
        client = subprocess.Popen(
            [openssl, "s_client", "-connect", f"127.0.0.1:{port}", "-servername", name],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(timeout)
                data = b""
                while len(data) < 5 or len(data) < 5 + int.from_bytes(data[3:5], "big"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        return None
                    data += chunk
            return data
        finally:
            client.kill()
            client.wait()
