"""Fuzz the PROXY protocol header reader (protocols/proxy_header.py), v1 and v2.

The bytes are what a load balancer (or anyone who can reach a listener with
--proxy-protocol) sends first. Checked on every input:

- nothing escapes `ProxyHeaderReader.feed` but ProxyHeaderError, whose cause is one of
  the documented ones;
- fed whole, in two pieces (harness.pieces) and byte by byte, the reader gives the same
  header (or the same cause) and the same bytes after the header;
- a one-pass reading of the same bytes from proxy-protocol.txt (`reference`, below: split
  on spaces and struct, not the module's regular expressions) gives the same answer;
- a header that names a client reads back the same when built again from its values.
"""

from __future__ import annotations

import ipaddress
import struct

import atheris

import harness

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.protocols import proxy_header as ph

harness.check_pure([ph])

CAUSES = {ph.Cause.NOT_PROXY_PROTOCOL, ph.Cause.MALFORMED, ph.Cause.TOO_LONG, ph.Cause.UNSUPPORTED}
Outcome = tuple[object, bytes]


def read(chunks: list[bytes]) -> Outcome:
    reader = ph.ProxyHeaderReader()
    header: ph.ProxyHeader | None = None
    behind = b""
    for chunk in chunks:
        if header is not None:
            behind += chunk
            continue
        try:
            header = reader.feed(chunk)
        except ph.ProxyHeaderError as exc:
            assert exc.cause in CAUSES, exc.cause
            return ("refused", exc.cause), b""
    if header is None:
        return None, b""
    return header, reader.trailing + behind


# -- the reference reading ----------------------------------------------------------------


def _decimal_port(text: bytes) -> int | None:
    if not text or not text.isdigit() or len(text) > 5 or (len(text) > 1 and text[:1] == b"0"):
        return None
    value = int(text)
    return value if value <= 0xFFFF else None


def _ip(text: bytes, version: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not text or any(c not in b"0123456789abcdefABCDEF:." for c in text):
        return None
    try:
        ip = ipaddress.ip_address(text.decode())
    except ValueError:
        return None
    return ip if ip.version == version else None


def reference_v1(data: bytes) -> Outcome:
    refused = ("refused", ph.Cause.MALFORMED)
    crlf = data.find(b"\r\n")
    if crlf < 0 or crlf + 2 > ph.V1_MAX_LINE:
        window = data[: ph.V1_MAX_LINE]
        if b"\n" in window and (crlf < 0 or crlf + 2 > ph.V1_MAX_LINE):
            return refused, b""
        if len(data) >= ph.V1_MAX_LINE:
            return ("refused", ph.Cause.TOO_LONG), b""
        return None, b""
    line, rest = data[:crlf], data[crlf + 2 :]
    words = line.split(b" ")
    if words[:2] == [b"PROXY", b"UNKNOWN"]:
        if all(0x20 <= c <= 0x7E for c in line):
            return ph.ProxyHeader(1, True, length=crlf + 2), rest
        return refused, b""
    if len(words) != 6 or words[0] != b"PROXY" or words[1] not in (b"TCP4", b"TCP6"):
        return refused, b""
    version = 4 if words[1] == b"TCP4" else 6
    src, dst = _ip(words[2], version), _ip(words[3], version)
    sport, dport = _decimal_port(words[4]), _decimal_port(words[5])
    if src is None or dst is None or sport is None or dport is None:
        return refused, b""
    if version == 4 and (str(src).encode() != words[2] or str(dst).encode() != words[3]):
        return refused, b""  # only canonical dotted quads (no leading zeros)
    return ph.ProxyHeader(1, False, (src, sport), (dst, dport), crlf + 2), rest


def reference_v2(data: bytes) -> Outcome:
    if len(data) < 16:
        return None, b""
    ver_cmd, fam, size = struct.unpack_from("!BBH", data, 12)
    if ver_cmd >> 4 != 2 or ver_cmd & 0xF > 1:
        return ("refused", ph.Cause.MALFORMED), b""
    if size > ph.MAX_V2_PAYLOAD:
        return ("refused", ph.Cause.TOO_LONG), b""
    if len(data) < 16 + size:
        return None, b""
    block, rest = data[16 : 16 + size], data[16 + size :]
    if ver_cmd & 0xF == 0 or fam >> 4 == 0:
        return ph.ProxyHeader(2, True, length=16 + size), rest
    if fam >> 4 > 3 or fam & 0xF not in (1, 2):
        return ("refused", ph.Cause.MALFORMED), b""
    if fam >> 4 == 3 or fam & 0xF == 2:
        return ("refused", ph.Cause.UNSUPPORTED), b""
    layout = "!4s4sHH" if fam >> 4 == 1 else "!16s16sHH"
    need = struct.calcsize(layout)
    if len(block) < need:
        return ("refused", ph.Cause.MALFORMED), b""
    src, dst, sport, dport = struct.unpack_from(layout, block)
    tlvs = block[need:]
    while tlvs:
        if len(tlvs) < 3 or 3 + struct.unpack_from("!H", tlvs, 1)[0] > len(tlvs):
            return ("refused", ph.Cause.MALFORMED), b""
        tlvs = tlvs[3 + struct.unpack_from("!H", tlvs, 1)[0] :]
    source = (ipaddress.ip_address(src), sport)
    destination = (ipaddress.ip_address(dst), dport)
    return ph.ProxyHeader(2, False, source, destination, 16 + size), rest


def reference(data: bytes) -> Outcome:
    not_header = ("refused", ph.Cause.NOT_PROXY_PROTOCOL), b""
    if not data:
        return None, b""
    if data[:1] == b"P":
        if not b"PROXY ".startswith(data[:6]):
            return not_header
        return reference_v1(data) if len(data) >= 6 else (None, b"")
    if data[:1] == b"\r":
        if not ph.V2_SIGNATURE.startswith(data[:12]):
            return not_header
        return reference_v2(data)
    return not_header


def rebuilt(header: ph.ProxyHeader) -> None:
    """A header naming a client reads back the same from the bytes built from it."""
    if header.local or header.source is None or header.destination is None:
        return
    build = ph.build_v1 if header.version == 1 else ph.build_v2
    data = build(header.source, header.destination)
    again, behind = read([data])
    assert isinstance(again, ph.ProxyHeader) and behind == b"", (header, again)
    assert (again.source, again.destination) == (header.source, header.destination)


def test_one_input(data: bytes) -> None:
    whole = read([data])
    assert read(harness.pieces(data)) == whole
    assert read([data[i : i + 1] for i in range(len(data))]) == whole
    expected = reference(data)
    assert whole == expected, (whole, expected)
    if isinstance(whole[0], ph.ProxyHeader):
        rebuilt(whole[0])


if __name__ == "__main__":
    harness.main(test_one_input)
