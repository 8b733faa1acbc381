"""Fuzz the TLS ClientHello reader (protocols/tls.py) against Go's record layer and OpenSSL.

The bytes are the first bytes a client sends into a tunnel. The oracle is the most
lenient receiver: Go's crypto/tls server (modelled by tests/tls_hellos.go_record_layer,
which tests/proxy/test_tls_lenient.py checks against the real Go), which takes any
record version below 0x1000 and skips warning alerts before its ClientHello. Checked on
every input:

- a stream whose first byte is a record content type (20-24) is never NOT_TLS: it is
  read to a ClientHello or refused, whatever its record version;
- whatever Go would assemble into a ClientHello, the reader reads completely (never
  NOT_TLS, never NEED_MORE) to the same ClientHello, or refuses (Malformed); and OpenSSL,
  fed that ClientHello in a plain record, sees the server name the reader saw;

- nothing escapes `ClientHelloReader.feed` but the project's protocol error
  (TlsError; feed should not let even that out), and the answer is one of the four
  results;
- fed whole, in two pieces (harness.pieces) and byte by byte (the first 4 KiB), the
  reader gives the same answer;
- a ClientHello's server name is non-empty ASCII;
- OpenSSL, as a TLS server fed the same bytes (ssl.MemoryBIO, no socket), never
  sees a server name that we did not: when its SNI callback runs, our answer is that
  ClientHello with that very name (None when it saw none), or Malformed (refusing
  more than OpenSSL does is safe; seeing another name, or no TLS, would let a
  client name one host to us and another to the server).
"""

from __future__ import annotations

import contextlib
import ssl
import sys
from pathlib import Path

import atheris

import harness

# The model of Go's record layer is the tests' own (one model, checked against Go there).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tls_hellos import go_record_layer, records

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.protocols import tls

harness.check_pure([tls])

# Byte-by-byte feeding costs a call per byte: enough to cover every header and
# length field of a ClientHello that fits a few records.
BYTEWISE_LIMIT = 4096
RESULTS = (tls.NeedMore, tls.NotTls, tls.Malformed, tls.ClientHello)

# A server context without a certificate: OpenSSL reads the whole ClientHello
# and calls the SNI callback before it needs one.
_SERVER = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
_SERVER.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
_seen: list[str | None] = []


def _on_server_name(_obj: ssl.SSLObject, name: str | None, _context: ssl.SSLContext) -> None:
    _seen.append(name)


_SERVER.sni_callback = _on_server_name


def read(chunks: list[bytes]) -> object:
    reader = tls.ClientHelloReader()
    result: tls.Result = tls.NEED_MORE
    for chunk in chunks:
        try:
            result = reader.feed(chunk)
        except tls.TlsError as exc:  # the only exception allowed; feed keeps even it in
            return ("raised", str(exc))
        assert isinstance(result, RESULTS), result
    if isinstance(result, tls.Malformed):
        assert isinstance(result.error, tls.TlsError)
        return ("malformed", str(result.error))
    return result


def openssl_names(data: bytes) -> list[str | None]:
    """The server names OpenSSL's SNI callback saw for this ClientHello ([] if not called)."""
    _seen.clear()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    server = _SERVER.wrap_bio(incoming, outgoing, server_side=True)
    incoming.write(data)
    with contextlib.suppress(ssl.SSLError, ValueError):
        server.do_handshake()
    return list(_seen)


def check_lenient_oracle(data: bytes, whole: object) -> None:
    """The reader against what Go's server would read from the same bytes."""
    if data and tls.starts_tls_record(data[0]):
        assert not isinstance(whole, tls.NotTls), f"starts like TLS, the reader says {whole!r}"
    message = go_record_layer(data)
    if message is None or message[0] != tls.CLIENT_HELLO:
        return  # Go reads no ClientHello from these bytes
    if isinstance(whole, tuple):
        return  # Malformed: we refuse what Go reads, which is safe
    assert isinstance(whole, tls.ClientHello), f"Go reads a ClientHello, the reader {whole!r}"
    try:
        expected = tls.parse_client_hello(message[4:])
    except tls.TlsError:
        raise AssertionError(f"the reader reads {whole!r} where its parser refuses") from None
    assert whole == expected, (whole, expected)
    names = openssl_names(records(message, range(tls.MAX_RECORD, len(message), tls.MAX_RECORD)))
    if names:
        assert names == [whole.server_name], f"OpenSSL sees {names!r}, the reader {whole!r}"


def test_one_input(data: bytes) -> None:
    whole = read([data])
    check_lenient_oracle(data, whole)
    assert read(harness.pieces(data)) == whole, (whole, data[:64])
    prefix = data[:BYTEWISE_LIMIT]
    if len(prefix) == len(data):
        bytewise = read([data[i : i + 1] for i in range(len(data))])
        assert bytewise == whole, (bytewise, whole)
    if isinstance(whole, tls.ClientHello) and whole.server_name is not None:
        assert whole.server_name and whole.server_name.isascii(), whole
    names = openssl_names(data)
    if not names:
        return  # OpenSSL did not get as far as a ClientHello's extensions
    assert len(names) == 1, names
    name = names[0]
    if isinstance(whole, tuple):
        return  # Malformed: we refuse what OpenSSL reads, which is safe
    said = whole.server_name if isinstance(whole, tls.ClientHello) else None
    if name is None:
        assert said is None, f"OpenSSL sees no server name, the reader says {whole!r}"
        return
    assert isinstance(whole, tls.ClientHello), f"OpenSSL sees {name!r}, the reader {whole!r}"
    assert said == name, f"OpenSSL sees server name {name!r}, the reader says {said!r}"


TestOneInput = test_one_input  # atheris's customary name

if __name__ == "__main__":
    harness.main(test_one_input)
