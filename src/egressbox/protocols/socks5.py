"""SOCKS5 server handshake (RFC 1928, RFC 1929) as a sans-IO state machine.

Bytes in, events and reply bytes out; the asyncio server is glue (DESIGN §10).
This module must never import asyncio, socket, ssl, selectors or threading.

How the glue drives it::

    server = Socks5Server(credentials=check)   # or Socks5Server() for no auth
    events = server.feed(data)                 # any chunking, never raises on client bytes
    send(server.outgoing())                    # method/auth replies and refusals
    for event in events:
        Rejected:       audit if event.reason is set, then close (server.closed is True)
        ConnectRequest: decide, then send(server.reply_success(ip, port)) and forward
                        server.trailing first, or send(server.reply_failure(code)) and close

The glue must stop reading after a ConnectRequest until it has replied: any
bytes the client pipelined behind the request are already in `trailing`.

Choices the tests pin:
- A domain that cannot be a host name at all (empty, NUL, control character,
  non-ASCII) is refused here with reply 0x01 and `Rejected.reason ==
  Reason.BAD_HOST` so the glue audits it. Printable ASCII passes through so
  that hosts.normalize_host gives the single bad_host verdict for the rest.
- Port 0 is passed to the glue in a ConnectRequest, so the decision module
  produces bad_port and the audit has a record.
- Credentials are decoded as strict UTF-8; bytes that are not UTF-8 fail the
  check without calling the callback. The password is never stored.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, IntEnum, auto
from typing import Final

from egressbox.core.errors import EgressboxError, Reason
from egressbox.core.hosts import canonical_ip_text
from egressbox.core.ip import IPAddress

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_BAD_HOST: Final = Reason.BAD_HOST

SOCKS_VERSION = 0x05
SOCKS4_VERSION = 0x04
AUTH_VERSION = 0x01  # RFC 1929 sub-negotiation version

# Longest message of each phase, from the RFC field sizes: a greeting is
# VER NMETHODS + 255 methods; RFC 1929 is VER ULEN UNAME(255) PLEN PASSWD(255);
# a request is VER CMD RSV ATYP + LEN + 255-byte name + 2-byte port. Every
# message is self-delimiting, so the buffer never holds more than one
# incomplete message: at most MAX_HANDSHAKE_BUFFER bytes before the request.
MAX_GREETING = 2 + 255
MAX_AUTH = 3 + 255 + 255
MAX_REQUEST = 4 + 1 + 255 + 2
MAX_HANDSHAKE_BUFFER = max(MAX_GREETING, MAX_AUTH, MAX_REQUEST) - 1

HTTP_ON_SOCKS_PORT = "this is the SOCKS5 port; use the HTTP proxy port"


class AuthMethod(IntEnum):
    NO_AUTH = 0x00
    USERNAME_PASSWORD = 0x02
    NO_ACCEPTABLE = 0xFF


class Command(IntEnum):
    CONNECT = 0x01
    BIND = 0x02
    UDP_ASSOCIATE = 0x03


class AddressType(IntEnum):
    IPV4 = 0x01
    DOMAIN = 0x03
    IPV6 = 0x04


class ReplyCode(IntEnum):
    SUCCEEDED = 0x00
    GENERAL_FAILURE = 0x01
    NOT_ALLOWED = 0x02  # policy denial (DESIGN §3.6)
    NETWORK_UNREACHABLE = 0x03
    HOST_UNREACHABLE = 0x04
    CONNECTION_REFUSED = 0x05
    TTL_EXPIRED = 0x06
    COMMAND_NOT_SUPPORTED = 0x07
    ADDRESS_TYPE_NOT_SUPPORTED = 0x08


# A malformed domain is a malformed request, not a ruleset verdict; RFC 1928
# has no "bad request" code, so it gets the general failure.
BAD_HOST_REPLY = ReplyCode.GENERAL_FAILURE

_METHOD_REFUSED = bytes([SOCKS_VERSION, AuthMethod.NO_ACCEPTABLE])
_AUTH_OK = bytes([AUTH_VERSION, 0x00])
_AUTH_FAILED = bytes([AUTH_VERSION, 0x01])
_UNSPECIFIED = bytes([AddressType.IPV4]) + bytes(4)  # ATYP and 0.0.0.0


class Socks5Error(EgressboxError):
    """A SOCKS5 protocol violation, or the glue using the machine out of order."""

    def __init__(
        self,
        message: str,
        reply_code: ReplyCode | None = None,
        reason: Reason | None = None,
    ) -> None:
        super().__init__(message)
        self.reply_code = reply_code
        self.reason = reason


@dataclass(frozen=True, slots=True, init=False)
class MethodSelected:
    """The greeting is done: the server chose this authentication method."""

    method: AuthMethod

    def __init__(self, method: AuthMethod) -> None:
        # Written out: a frozen dataclass's generated __init__ is interpreted; compiled,
        # this is a store (an event of every connection).
        object.__setattr__(self, "method", method)


@dataclass(frozen=True, slots=True)
class Authenticated:
    """The username/password exchange succeeded."""

    username: str


@dataclass(frozen=True, slots=True, init=False)
class ConnectRequest:
    """host: domain text as sent (ASCII), or canonical IP text for IP types."""

    host: str
    port: int
    atyp: AddressType

    def __init__(self, host: str, port: int, atyp: AddressType) -> None:
        object.__setattr__(self, "host", host)  # compiled stores (see MethodSelected)
        object.__setattr__(self, "port", port)
        object.__setattr__(self, "atyp", atyp)


@dataclass(frozen=True, slots=True)
class Rejected:
    """The machine refused; the connection must be closed after `outgoing()`.

    reply_code is the RFC 1928 reply sent, or None when the refusal happened
    before a request (no reply, `05 FF` or the RFC 1929 failure instead).
    reason is set when the refusal is an audited decision (bad_host).
    """

    reply_code: ReplyCode | None
    message: str
    reason: Reason | None = None


Event = MethodSelected | Authenticated | ConnectRequest | Rejected


class _State(Enum):
    GREETING = auto()
    AUTH = auto()
    REQUEST = auto()
    AWAIT_REPLY = auto()
    ESTABLISHED = auto()
    CLOSED = auto()


_HANDSHAKE = (_State.GREETING, _State.AUTH, _State.REQUEST)


def looks_like_http(first_bytes: bytes) -> bool:
    """True when a connection opens like an HTTP request (`GET`, `CONNECT`...).

    One byte is enough: SOCKS starts with 0x04/0x05, every HTTP method with a letter.
    """
    return first_bytes[:1].isalpha()


class Socks5Server:
    """Server side of one SOCKS5 connection, from greeting to the CONNECT reply.

    `feed` returns events and queues reply bytes, which `outgoing` drains.
    With `credentials`, only username/password (0x02) is accepted and the
    callback decides (it should compare in constant time); otherwise only
    no-auth (0x00).
    """

    def __init__(self, credentials: Callable[[str, str], bool] | None = None) -> None:
        self._credentials = credentials
        self._method = AuthMethod.NO_AUTH if credentials is None else AuthMethod.USERNAME_PASSWORD
        self._state = _State.GREETING
        self._buf = bytearray()
        self._out = bytearray()

    @property
    def closed(self) -> bool:
        """True once the machine refused or a failure reply was produced."""
        return self._state is _State.CLOSED

    @property
    def trailing(self) -> bytes:
        """Bytes the client sent after its request; forward them once the tunnel is up."""
        if self._state in (_State.AWAIT_REPLY, _State.ESTABLISHED):
            return bytes(self._buf)
        return b""

    @property
    def buffered(self) -> int:
        """Bytes held while a handshake message is incomplete (or as trailing)."""
        return len(self._buf)

    def outgoing(self) -> bytes:
        """Reply bytes queued by `feed`, drained."""
        data = bytes(self._out)
        self._out.clear()
        return data

    def feed(self, data: bytes) -> list[Event]:
        """Consume client bytes; raises Socks5Error only if called after the handshake."""
        if self._state not in _HANDSHAKE:
            raise Socks5Error(f"feed() after the handshake ({self._state.name.lower()})")
        self._buf += data
        events: list[Event] = []
        try:
            while self._state in _HANDSHAKE:
                event = self._step()
                if event is None:
                    break
                events.append(event)
        except Socks5Error as exc:
            events.append(self._reject(exc))
        return events

    def reply_success(self, bind_host: str | IPAddress = "0.0.0.0", bind_port: int = 0) -> bytes:
        """The reply that opens the tunnel; BND is the local end of the upstream socket."""
        self._expect_reply()
        address = _bind_address(bind_host)
        if not 0 <= bind_port <= 0xFFFF:
            raise Socks5Error("bind port out of range")
        self._state = _State.ESTABLISHED
        return _reply(ReplyCode.SUCCEEDED, address, bind_port)

    def reply_failure(self, code: ReplyCode) -> bytes:
        """The refusal reply; the glue closes after sending it."""
        self._expect_reply()
        if code is ReplyCode.SUCCEEDED:
            raise Socks5Error("reply_failure() needs a failure code")
        self._close()
        return _reply(code)

    def _expect_reply(self) -> None:
        if self._state is not _State.AWAIT_REPLY:
            raise Socks5Error(f"no request awaits a reply ({self._state.name.lower()})")

    def _close(self) -> None:
        self._state = _State.CLOSED
        self._buf.clear()

    def _reject(self, exc: Socks5Error) -> Rejected:
        self._close()
        return Rejected(exc.reply_code, str(exc), exc.reason)

    def _consume(self, n: int) -> bytes:
        taken = bytes(self._buf[:n])
        del self._buf[:n]
        return taken

    def _step(self) -> Event | None:
        """Parse one message of the current phase, or None until more bytes arrive."""
        if self._state is _State.GREETING:
            return self._read_greeting()
        if self._state is _State.AUTH:
            return self._read_auth()
        return self._read_request()

    # Each reader checks bytes in wire order as soon as they are present, so a
    # refusal (and its reply) is the same under any chunking.

    def _refuse(
        self,
        reply: bytes,
        message: str,
        code: ReplyCode | None = None,
        reason: Reason | None = None,
    ) -> Socks5Error:
        """Queue the refusal bytes; feed() turns the returned error into Rejected."""
        self._out += reply
        return Socks5Error(message, code, reason)

    def _read_greeting(self) -> Event | None:
        buf = self._buf
        if not buf:
            return None
        _check_greeting_version(buf[0])
        if len(buf) < 2:
            return None
        if buf[1] == 0:
            raise self._refuse(_METHOD_REFUSED, "greeting offers no authentication method")
        if len(buf) < 2 + buf[1]:
            return None
        methods = self._consume(2 + buf[1])[2:]
        if self._method not in methods:
            wanted = "username/password" if self._credentials else "no authentication"
            raise self._refuse(_METHOD_REFUSED, f"no acceptable method (this port needs {wanted})")
        self._out += bytes([SOCKS_VERSION, self._method])
        self._state = _State.AUTH if self._credentials else _State.REQUEST
        return MethodSelected(self._method)

    def _read_auth(self) -> Event | None:
        buf = self._buf
        if buf and buf[0] != AUTH_VERSION:
            raise self._refuse(_AUTH_FAILED, "unsupported username/password version")
        if len(buf) >= 2 and buf[1] == 0:
            raise self._refuse(_AUTH_FAILED, "empty username")
        if len(buf) < 3 or len(buf) < 3 + buf[1]:
            return None
        ulen = buf[1]
        plen = buf[2 + ulen]
        if plen == 0:
            raise self._refuse(_AUTH_FAILED, "empty password")
        if len(buf) < 3 + ulen + plen:
            return None
        message = self._consume(3 + ulen + plen)
        username = _decode_credential(message[2 : 2 + ulen])
        if username is None or not self._check_password(username, message[3 + ulen :]):
            raise self._refuse(_AUTH_FAILED, "username/password rejected")
        self._out += _AUTH_OK
        self._state = _State.REQUEST
        return Authenticated(username)

    def _check_password(self, username: str, raw_password: bytes) -> bool:
        # Kept in a local only: the password must not outlive the check.
        password = _decode_credential(raw_password)
        assert self._credentials is not None
        return password is not None and self._credentials(username, password)

    def _read_request(self) -> Event | None:
        buf = self._buf
        self._check_request_header(buf)
        if len(buf) < 4:
            return None
        end = self._request_end(buf)
        if end is None or len(buf) < end:
            return None
        request = self._consume(end)
        atyp = AddressType(request[3])
        host = self._request_host(atyp, request[4:-2])
        port = int.from_bytes(request[-2:], "big")
        self._state = _State.AWAIT_REPLY
        return ConnectRequest(host, port, atyp)

    def _check_request_header(self, buf: bytearray) -> None:
        if buf and buf[0] != SOCKS_VERSION:
            raise self._refuse_request(ReplyCode.GENERAL_FAILURE, "request version is not 5")
        if len(buf) >= 2 and buf[1] != Command.CONNECT:
            raise self._refuse_request(ReplyCode.COMMAND_NOT_SUPPORTED, _command_message(buf[1]))
        if len(buf) >= 3 and buf[2] != 0:
            raise self._refuse_request(ReplyCode.GENERAL_FAILURE, "reserved byte is not 0")

    def _request_end(self, buf: bytearray) -> int | None:
        """Total request length once it is known from ATYP (and the name length)."""
        atyp = buf[3]
        if atyp == AddressType.IPV4:
            return 4 + 4 + 2
        if atyp == AddressType.IPV6:
            return 4 + 16 + 2
        if atyp != AddressType.DOMAIN:
            raise self._refuse_request(
                ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED, f"unknown address type 0x{atyp:02x}"
            )
        if len(buf) < 5:
            return None
        if buf[4] == 0:
            raise self._refuse_bad_host("empty domain name")
        return 4 + 1 + buf[4] + 2

    def _request_host(self, atyp: AddressType, field: bytes) -> str:
        if atyp is AddressType.IPV4:
            return canonical_ip_text(ipaddress.IPv4Address(field))
        if atyp is AddressType.IPV6:
            return canonical_ip_text(ipaddress.IPv6Address(field))
        name = field[1:]
        # Only bytes that cannot be in any host name are refused here; the message
        # does not echo them (they would reach logs). normalize_host judges the rest.
        if not all(0x20 <= b < 0x7F for b in name):
            raise self._refuse_bad_host("domain name has a control, NUL or non-ASCII byte")
        return name.decode("ascii")

    def _refuse_request(self, code: ReplyCode, message: str) -> Socks5Error:
        return self._refuse(_reply(code), message, code)

    def _refuse_bad_host(self, message: str) -> Socks5Error:
        reply = _reply(BAD_HOST_REPLY)
        return self._refuse(reply, f"bad host: {message}", BAD_HOST_REPLY, _BAD_HOST)


def _check_greeting_version(first: int) -> None:
    """Refuse non-SOCKS5 openers from the first byte, without replying."""
    if first == SOCKS_VERSION:
        return
    if first == SOCKS4_VERSION:
        raise Socks5Error("SOCKS4 is not supported; use SOCKS5 (socks5h://)")
    if looks_like_http(bytes([first])):
        raise Socks5Error(HTTP_ON_SOCKS_PORT)
    raise Socks5Error(f"not a SOCKS5 greeting (first byte 0x{first:02x})")


def _command_message(command: int) -> str:
    if command == Command.BIND:
        return "BIND is not supported; only CONNECT"
    if command == Command.UDP_ASSOCIATE:
        return "UDP ASSOCIATE is not supported; only CONNECT"
    return f"unknown command 0x{command:02x}; only CONNECT"


def _decode_credential(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _reply(code: ReplyCode, address: bytes = _UNSPECIFIED, port: int = 0) -> bytes:
    """`address`: ATYP and BND.ADDR (see _bind_address)."""
    return bytes([SOCKS_VERSION, code, 0x00]) + address + port.to_bytes(2, "big")


def _bind_address(host: str | IPAddress) -> bytes:
    """ATYP and BND.ADDR of an IP address, given as text (a socket's name) or an address."""
    if not isinstance(host, str):
        return _packed(host)
    found = _BIND_TEXTS.get(host)
    if found is None:
        try:
            found = _packed(ipaddress.ip_address(host))
        except ValueError:
            raise Socks5Error("bind address must be an IP address") from None
        if len(_BIND_TEXTS) < _BIND_TEXTS_SIZE:
            _BIND_TEXTS[host] = found
    return found


def _packed(address: IPAddress) -> bytes:
    atyp = AddressType.IPV4 if address.version == 4 else AddressType.IPV6
    return bytes([atyp]) + address.packed


# The packed form of each bind address text seen: a server's sockets have few local
# addresses, and ipaddress's parser is interpreted (~17,000 instructions, every tunnel's
# reply). Bounded: past it, texts are parsed each time.
_BIND_TEXTS_SIZE: Final = 256
_BIND_TEXTS: Final[dict[str, bytes]] = {}
