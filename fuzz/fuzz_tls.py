"""Fuzz the TLS ClientHello reader (protocols/tls.py) against OpenSSL's own server.

The bytes are the first bytes a client sends into a tunnel. Checked on every input:

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

import atheris

import harness

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


def test_one_input(data: bytes) -> None:
    whole = read([data])
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
