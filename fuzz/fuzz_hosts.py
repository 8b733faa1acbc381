"""Fuzz host and port normalization (`hosts`): the one spelling everything compares.

The bytes are read as text twice: as Latin-1 (how HTTP fields reach it) and as UTF-8
with surrogate escapes (how a command-line argument does). Checked:

- the only exception is HostError;
- a normalized host is a fixed point (normalizing its text gives it back), is ASCII
  lower case, and its labels are letters, digits, '-' and '_';
- the C library never reads a normalized name as an address (`inet_aton`, which takes
  `127.1`, `0x7f.1`, `2130706433`, `0177.0.0.1`...): every numeric spelling it accepts
  is either refused or the same address;
- Python's `ipaddress` agrees on every address it parses strictly;
- split in two at the data's point, `host:port` parses as the two halves do, and
  `split_authority` gives back exactly the text it was given.
"""

from __future__ import annotations

import ipaddress
import socket

import atheris

import harness

with atheris.instrument_imports(include=["egressbox", "idna"]):
    import idna

    from egressbox.core import hosts
    from egressbox.core.errors import HostError

harness.check_pure([hosts])

_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")


def normalized(text: str) -> hosts.Host | None:
    try:
        return hosts.normalize_host(text)
    except HostError as exc:
        assert exc.reason == "bad_host", exc.reason
        return None


def c_library_address(text: str) -> ipaddress.IPv4Address | None:
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except (OSError, ValueError, UnicodeError):
        return None


def strict_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `ipaddress` reads (canonical dotted quad, RFC 4291 text), or None."""
    v6 = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    for candidate, kind in ((text, ipaddress.IPv4Address), (v6, ipaddress.IPv6Address)):
        try:
            address = kind(candidate)
        except ValueError:
            continue
        if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
            return None  # a zone id: refused on purpose
        return address
    return None


def check_host(text: str, host: hosts.Host | None) -> None:
    numeric = c_library_address(text)
    strict = strict_address(text)
    if host is None:
        assert strict is None, f"{text!r} is the address {strict}, refused"
        return
    assert host.text and host.text.isascii() and host.text == host.text.lower(), host
    assert hosts.normalize_host(host.text) == host, "not a fixed point"
    if strict is not None:
        assert host.ip == strict, (text, host, strict)
    if host.ip is not None:
        assert host.text == hosts.canonical_ip_text(host.ip)
        assert ipaddress.ip_address(host.text) == host.ip
        if numeric is not None:
            assert host.ip == numeric, (text, host, numeric)
        return
    assert numeric is None, f"the C library reads the name {host.text!r} as {numeric}"
    assert c_library_address(host.text) is None, host.text
    assert len(host.text) <= hosts.MAX_NAME_LENGTH
    for label in host.text.split("."):
        assert label and set(label) <= _LABEL_CHARS, label
        assert len(label) <= hosts.MAX_LABEL_LENGTH
        assert not label.startswith("-") and not label.endswith("-")
        if label.startswith("xn--"):
            assert idna.alabel(idna.ulabel(label)).decode("ascii") == label


def check_authority(text: str, host_part: str, port_part: str) -> None:
    try:
        raw_host, raw_port = hosts.split_authority(text)
    except HostError:
        pass
    else:
        rebuilt = raw_host if raw_port is None else f"{raw_host}:{raw_port}"
        assert rebuilt == text, (rebuilt, text)
    try:
        port: int | None = hosts.parse_port(port_part)
    except HostError as exc:
        assert exc.reason == "bad_port"
        port = None
    host = normalized(host_part)
    if host is not None and port is not None:
        assert hosts.parse_authority(host.authority(port)) == (host, port)
        if not any(c in host_part for c in ":@["):
            assert hosts.parse_authority(f"{host_part}:{port_part}") == (host, port)
    try:
        ip, ip_port = hosts.parse_ip_endpoint(text, 53)
    except HostError:
        return
    assert 1 <= ip_port <= 65535
    assert hosts.normalize_host(hosts.canonical_ip_text(ip)).ip == ip


def test_one_input(data: bytes) -> None:
    cut = harness.split_point(data)
    for encoding, errors in (("latin-1", "strict"), ("utf-8", "surrogateescape")):
        text = data.decode(encoding, errors)
        check_host(text, normalized(text))
        head, tail = data[:cut].decode(encoding, errors), data[cut:].decode(encoding, errors)
        check_authority(text, head, tail)


if __name__ == "__main__":
    harness.main(test_one_input)
