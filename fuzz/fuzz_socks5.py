"""Fuzz the SOCKS5 handshake (RFC 1928, RFC 1929): greeting, username/password, request.

The bytes are what a client sends on the SOCKS5 port. Each input is fed to a server
without authentication and to one that needs username/password. Checked:

- `feed` never raises on client bytes (its contract: refusals are `Rejected` events);
- fed whole and fed in two pieces (the glue stops feeding after a request or a
  refusal, so the second piece then joins the pipelined bytes): the same events,
  replies, state and pipelined bytes;
- a one-pass reading of the same bytes from the RFCs (`reference`, below) gives the
  same events and replies: the incremental machine and the grammar agree;
- a request's host is canonical IP text or printable ASCII; the replies are well formed.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass

import atheris

import harness

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.core import hosts
    from egressbox.core.errors import HostError, Reason
    from egressbox.protocols import socks5

harness.check_pure([socks5, hosts])

USER, PASSWORD = "alice", "s3cret"
ReplyCode = socks5.ReplyCode


def check_credentials(username: str, password: str) -> bool:
    return username == USER and password == PASSWORD


@dataclass(frozen=True)
class Handshake:
    """What the machine made of the bytes; `Rejected` compared without its message."""

    events: tuple[object, ...]
    outgoing: bytes
    closed: bool
    pipelined: bytes  # after a request: what goes into the tunnel once it is open


def _comparable(event: socks5.Event) -> object:
    if isinstance(event, socks5.Rejected):
        return ("rejected", event.reply_code, event.reason)
    return event


def handshake(
    chunks: list[bytes], credentials: Callable[[str, str], bool] | None
) -> tuple[Handshake, socks5.Socks5Server]:
    server = socks5.Socks5Server(credentials)
    events: list[socks5.Event] = []
    unfed = bytearray()
    outgoing = bytearray()
    for chunk in chunks:
        if server.closed or any(isinstance(e, socks5.ConnectRequest) for e in events):
            unfed += chunk  # the glue stops reading here
            continue
        events += server.feed(chunk)
        outgoing += server.outgoing()
    assert server.buffered <= socks5.MAX_HANDSHAKE_BUFFER or not _handshaking(server, events)
    pipelined = server.trailing + bytes(unfed) if not server.closed else b""
    result = Handshake(
        tuple(_comparable(e) for e in events), bytes(outgoing), server.closed, pipelined
    )
    return result, server


def _handshaking(server: socks5.Socks5Server, events: list[socks5.Event]) -> bool:
    return not server.closed and not any(isinstance(e, socks5.ConnectRequest) for e in events)


def _reply(code: ReplyCode) -> bytes:
    return bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])


def reference(data: bytes, credentials: Callable[[str, str], bool] | None) -> Handshake:
    """The handshake read in one pass, message by message, from RFC 1928 and RFC 1929."""
    events: list[object] = []
    out = bytearray()

    def refuse(
        reply: bytes, code: ReplyCode | None = None, reason: Reason | None = None
    ) -> Handshake:
        out.extend(reply)
        events.append(("rejected", code, reason))
        return Handshake(tuple(events), bytes(out), True, b"")

    def waiting() -> Handshake:
        return Handshake(tuple(events), bytes(out), False, b"")

    # Greeting: VER NMETHODS METHODS.
    if not data:
        return waiting()
    if data[0] != 5:
        return refuse(b"")
    if len(data) < 2:
        return waiting()
    if data[1] == 0:
        return refuse(b"\x05\xff")
    if len(data) < 2 + data[1]:
        return waiting()
    method = (
        socks5.AuthMethod.NO_AUTH if credentials is None else socks5.AuthMethod.USERNAME_PASSWORD
    )
    if method not in data[2 : 2 + data[1]]:
        return refuse(b"\x05\xff")
    out += bytes([5, method])
    events.append(socks5.MethodSelected(method))
    rest = data[2 + data[1] :]
    if credentials is not None:
        # VER ULEN UNAME PLEN PASSWD, each check as soon as its byte is there.
        if rest and rest[0] != 1:
            return refuse(b"\x01\x01")
        if len(rest) >= 2 and rest[1] == 0:
            return refuse(b"\x01\x01")
        if len(rest) < 3 or len(rest) < 3 + rest[1]:
            return waiting()
        ulen = rest[1]
        plen = rest[2 + ulen]
        if plen == 0:
            return refuse(b"\x01\x01")
        if len(rest) < 3 + ulen + plen:
            return waiting()
        try:
            username = rest[2 : 2 + ulen].decode("utf-8")
            password = rest[3 + ulen : 3 + ulen + plen].decode("utf-8")
        except UnicodeDecodeError:
            return refuse(b"\x01\x01")
        if not credentials(username, password):
            return refuse(b"\x01\x01")
        out += b"\x01\x00"
        events.append(socks5.Authenticated(username))
        rest = rest[3 + ulen + plen :]
    # Request: VER CMD RSV ATYP DST.ADDR DST.PORT.
    if rest and rest[0] != 5:
        return refuse(_reply(ReplyCode.GENERAL_FAILURE), ReplyCode.GENERAL_FAILURE)
    if len(rest) >= 2 and rest[1] != 1:
        return refuse(_reply(ReplyCode.COMMAND_NOT_SUPPORTED), ReplyCode.COMMAND_NOT_SUPPORTED)
    if len(rest) >= 3 and rest[2] != 0:
        return refuse(_reply(ReplyCode.GENERAL_FAILURE), ReplyCode.GENERAL_FAILURE)
    if len(rest) < 4:
        return waiting()
    atyp = rest[3]
    bad_host = (_reply(ReplyCode.GENERAL_FAILURE), ReplyCode.GENERAL_FAILURE, Reason.BAD_HOST)
    if atyp == 1:
        end = 10
    elif atyp == 4:
        end = 22
    elif atyp == 3:
        if len(rest) < 5:
            return waiting()
        if rest[4] == 0:
            return refuse(*bad_host)
        end = 7 + rest[4]
    else:
        return refuse(
            _reply(ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED), ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED
        )
    if len(rest) < end:
        return waiting()
    address = rest[4 : end - 2]
    if atyp == 3:
        name = address[1:]
        if any(b < 0x20 or b > 0x7E for b in name):
            return refuse(*bad_host)
        host = name.decode("ascii")
    else:
        host = hosts.canonical_ip_text(ipaddress.ip_address(address))
    port = int.from_bytes(rest[end - 2 : end], "big")
    events.append(socks5.ConnectRequest(host, port, socks5.AddressType(atyp)))
    return Handshake(tuple(events), bytes(out), False, rest[end:])


def check_request(server: socks5.Socks5Server, events: tuple[object, ...]) -> None:
    """A request's host is what the decision expects, and the replies are RFC 1928's."""
    requests = [e for e in events if isinstance(e, socks5.ConnectRequest)]
    if not requests:
        assert not any(isinstance(e, socks5.ConnectRequest) for e in events)
        return
    (request,) = requests
    if request.atyp is socks5.AddressType.DOMAIN:
        assert request.host and all(" " <= c <= "~" for c in request.host), request.host
    else:
        assert hosts.normalize_host(request.host).text == request.host
    with contextlib.suppress(HostError):
        hosts.normalize_host(request.host)  # what the decision does next
    reply = server.reply_success("::1", request.port)
    assert reply == b"\x05\x00\x00\x04" + bytes(15) + b"\x01" + request.port.to_bytes(2, "big")
    try:
        server.feed(b"x")
    except socks5.Socks5Error:
        pass
    else:
        raise AssertionError("feed() after the reply was accepted")


def test_one_input(data: bytes) -> None:
    parts = harness.pieces(data)
    for credentials in (None, check_credentials):
        whole, server = handshake([data], credentials)
        split, _ = handshake(parts, credentials)
        assert split == whole, (credentials, split, whole)
        expected = reference(data, credentials)
        assert whole == expected, (credentials, whole, expected)
        check_request(server, whole.events)


if __name__ == "__main__":
    harness.main(test_one_input)
