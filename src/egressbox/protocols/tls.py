"""A TLS ClientHello reader (RFC 8446 §4.1.2, RFC 6066 §3) as a sans-IO machine.

Bytes in, one result out: the first bytes a client sends into a tunnel are fed
as they arrive, and `ClientHelloReader.feed` answers

- `NEED_MORE`: a ClientHello has begun and is not complete yet;
- `NOT_TLS`: the stream does not start with a TLS record (the tunnel carries
  something else, and is none of our business);
- `ClientHello`: the first handshake message is complete; its `server_name`
  (the SNI host_name, None without one) and whether an ECH extension
  (encrypted_client_hello, 0xfe0d) is present;
- `Malformed`: a TLS stream whose first message is not a well-formed
  ClientHello, or one larger than the bounds below (the glue refuses it).

Once it has said anything but NEED_MORE it says the same thing forever. It
never raises on client bytes: every length field is checked against what is
left before it is used, and anything a TLS server would read differently from
us (two server_name extensions, two host names, bytes after the extensions)
is `Malformed`, so that the name we judge is the only name a server can see.
Nothing here may import asyncio, socket, ssl, selectors or threading.

The reader holds at most one record header and the ClientHello message itself
(bounded by `max_hello`); the glue that keeps the raw bytes to forward them is
bounded by the same limits (`MAX_INPUT` bytes of records, then one read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from egressbox.errors import EgressboxError

# -- limits (where each value came from) -------------------------------------------

RECORD_HEADER: Final = 5  # ContentType, ProtocolVersion, uint16 length (RFC 8446 §5.1)
# A plaintext record carries at most 2^14 bytes (RFC 8446 §5.1: record_overflow).
MAX_RECORD: Final = 1 << 14
# The ClientHello message with its 4-byte handshake header. Real ones are
# 200-600 bytes, ~1.8 KiB with a post-quantum key share (X25519MLKEM768) and
# up to a few KiB with many PSK identities; 16 KiB is one full record.
MAX_HELLO = 16 * 1024
# Records a ClientHello may be split into. One is the rule; tools that split
# the first bytes on purpose (to get past middleboxes) use a handful.
MAX_RECORDS = 64
# The most input the reader consumes before it answers (records' headers too).
MAX_INPUT = MAX_HELLO + MAX_RECORDS * RECORD_HEADER

# Record content types (RFC 8446 §5.1; 24 is heartbeat, RFC 6520).
CHANGE_CIPHER_SPEC: Final = 20
ALERT = 21
HANDSHAKE: Final = 22
APPLICATION_DATA = 23
HEARTBEAT: Final = 24
TLS_MAJOR: Final = 3  # every TLS and SSL 3 record version is 0x03xx
CLIENT_HELLO: Final = 1  # HandshakeType
EXT_SERVER_NAME = 0  # RFC 6066 §3
EXT_ENCRYPTED_CLIENT_HELLO = 0xFE0D  # RFC 9849 (draft-ietf-tls-esni)
NAME_TYPE_HOST_NAME = 0
MAX_SESSION_ID = 32
HANDSHAKE_HEADER: Final = 4  # HandshakeType, uint24 length
RANDOM_SIZE = 32


class TlsError(EgressboxError):
    """A TLS stream we refuse: its first message is not a readable ClientHello.

    Messages are fixed texts: they never echo the client's bytes.
    """


@dataclass(frozen=True, slots=True)
class NeedMore:
    """A ClientHello has begun; feed more bytes."""


@dataclass(frozen=True, slots=True)
class NotTls:
    """The first bytes are not a TLS record."""


@dataclass(frozen=True, slots=True)
class Malformed:
    """A TLS stream that does not start with a well-formed ClientHello."""

    error: TlsError


@dataclass(frozen=True, slots=True)
class ClientHello:
    """The first ClientHello: its SNI host_name (ASCII, as sent) and whether ECH is offered.

    With ECH this is the outer ClientHello: `server_name` is the public name the
    client lets the network see; the name it really asks for is encrypted.
    """

    server_name: str | None
    ech: bool


Result = NeedMore | NotTls | Malformed | ClientHello

NEED_MORE: Final = NeedMore()
NOT_TLS: Final = NotTls()


def may_be_tls(first: int) -> bool:
    """False when a stream starting with this byte is certainly not TLS (the fast path)."""
    return CHANGE_CIPHER_SPEC <= first <= HEARTBEAT


class ClientHelloReader:
    """Reads the first ClientHello of a client's stream, fed in any chunking."""

    __slots__ = (
        "_header",
        "_left",
        "_max_hello",
        "_max_records",
        "_message",
        "_need",
        "_records",
        "_result",
    )

    def __init__(self, max_hello: int = MAX_HELLO, max_records: int = MAX_RECORDS) -> None:
        self._max_hello = max_hello
        self._max_records = max_records
        self._header = bytearray()  # the record header being read (< RECORD_HEADER bytes)
        self._left = 0  # bytes of the current record's body still to come
        self._records = 0  # records started
        self._message = bytearray()  # the handshake message so far (<= _need bytes)
        self._need = 0  # the whole message's size once its header is in; 0 before
        self._result: Result = NEED_MORE

    @property
    def result(self) -> Result:
        return self._result

    def feed(self, data: bytes) -> Result:
        """Take the next bytes of the stream; the answer so far (see the module doc)."""
        if self._result is not NEED_MORE or not data:
            return self._result
        try:
            self._result = self._consume(data)
        except TlsError as exc:
            self._result = Malformed(exc)
        return self._result

    def _consume(self, data: bytes) -> Result:
        size = len(data)
        at = 0
        while at < size:
            if self._left == 0:
                take = min(RECORD_HEADER - len(self._header), size - at)
                self._header += data[at : at + take]
                at += take
                verdict = self._check_header()
                if verdict is not None:
                    return verdict
                if len(self._header) < RECORD_HEADER:
                    return NEED_MORE
                self._left = int.from_bytes(self._header[3:5], "big")
                self._header.clear()
                continue
            room = (self._need or HANDSHAKE_HEADER) - len(self._message)
            take = min(self._left, size - at, room)
            self._message += data[at : at + take]
            at += take
            self._left -= take
            if self._need == 0 and len(self._message) == HANDSHAKE_HEADER:
                self._need = self._message_size()
            if self._need and len(self._message) == self._need:
                return parse_client_hello(bytes(self._message[HANDSHAKE_HEADER:]))
        return NEED_MORE

    def _check_header(self) -> Result | None:
        """Judge the record header as far as it has arrived (byte by byte)."""
        header = self._header
        first = self._records == 0
        kind = header[0]
        if first and not may_be_tls(kind):
            return NOT_TLS
        if len(header) < 2:
            return None
        if header[1] != TLS_MAJOR:
            if first:
                return NOT_TLS  # 0x16 0x00...: some other protocol; no TLS server reads it
            raise TlsError("a record of the ClientHello has a version that is not TLS")
        if kind != HANDSHAKE:
            # A TLS stream must start with its ClientHello, and no other record may
            # come between the pieces of one (RFC 8446 §5.1).
            raise TlsError("the TLS stream does not start with a ClientHello")
        if len(header) < RECORD_HEADER:
            return None
        length = int.from_bytes(header[3:5], "big")
        if length == 0:
            raise TlsError("an empty handshake record")  # RFC 8446 §5.1 forbids them
        if length > MAX_RECORD:
            raise TlsError("a TLS record longer than 16384 bytes")
        self._records += 1
        if self._records > self._max_records:
            raise TlsError(f"the ClientHello is split into more than {self._max_records} records")
        return None

    def _message_size(self) -> int:
        message = self._message
        if message[0] != CLIENT_HELLO:
            raise TlsError("the first handshake message is not a ClientHello")
        size = HANDSHAKE_HEADER + int.from_bytes(message[1:4], "big")
        if size > self._max_hello:
            raise TlsError(f"the ClientHello is larger than {self._max_hello} bytes")
        if size == HANDSHAKE_HEADER:
            raise TlsError("an empty ClientHello")
        return size


class _Cursor:
    """Reads a bounded byte string; every read checks what is left first."""

    __slots__ = ("_at", "_data", "_end")

    def __init__(self, data: bytes, start: int = 0, end: int | None = None) -> None:
        self._data = data
        self._at = start
        self._end = len(data) if end is None else end

    @property
    def done(self) -> bool:
        return self._at >= self._end

    def _take(self, size: int, what: str) -> int:
        start = self._at
        if size > self._end - start:
            raise TlsError(f"the ClientHello ends inside its {what}")
        self._at = start + size
        return start

    def skip(self, size: int, what: str) -> None:
        self._take(size, what)

    def u8(self, what: str) -> int:
        return self._data[self._take(1, what)]

    def u16(self, what: str) -> int:
        start = self._take(2, what)
        return (self._data[start] << 8) | self._data[start + 1]

    def vector(self, length_size: int, what: str) -> _Cursor:
        """A length-prefixed vector (`length_size` is 1 or 2 bytes) as its own cursor."""
        size = self.u8(what) if length_size == 1 else self.u16(what)
        start = self._take(size, what)
        return _Cursor(self._data, start, start + size)

    def size(self) -> int:
        return self._end - self._at

    def rest(self) -> bytes:
        return self._data[self._at : self._end]


def parse_client_hello(body: bytes) -> ClientHello:
    """The ClientHello message body (after its 4-byte header); raises TlsError."""
    cursor = _Cursor(body)
    if cursor.u8("version") != TLS_MAJOR:
        raise TlsError("the ClientHello's version is not TLS")
    cursor.skip(1, "version")
    cursor.skip(RANDOM_SIZE, "random")
    if cursor.vector(1, "session id").size() > MAX_SESSION_ID:
        raise TlsError("the ClientHello's session id is longer than 32 bytes")
    suites = cursor.vector(2, "cipher suites").size()
    if suites == 0 or suites % 2:
        raise TlsError("the ClientHello's cipher suites are not a list of pairs")
    if cursor.vector(1, "compression methods").size() == 0:
        raise TlsError("the ClientHello has no compression method")
    if cursor.done:
        return ClientHello(None, False)  # no extensions at all (TLS 1.2 and older may)
    extensions = cursor.vector(2, "extensions")
    if not cursor.done:
        raise TlsError("bytes follow the ClientHello's extensions")
    seen: set[int] = set()
    name: str | None = None
    ech = False
    while not extensions.done:
        kind = extensions.u16("extensions")
        data = extensions.vector(2, "extensions")
        if kind in seen:
            raise TlsError("the ClientHello repeats an extension")  # RFC 8446 §4.2
        seen.add(kind)
        if kind == EXT_SERVER_NAME:
            name = _server_name(data)
        elif kind == EXT_ENCRYPTED_CLIENT_HELLO:
            ech = True
    return ClientHello(name, ech)


def _server_name(data: _Cursor) -> str:
    """RFC 6066 §3: a ServerNameList of exactly one host_name, as every server reads it.

    OpenSSL accepts nothing else; a list with more entries (other name types,
    which no one defines, or a second host name, which the RFC forbids) could
    be read differently by another server, so it is refused.
    """
    names = data.vector(2, "server name list")
    if not data.done:
        raise TlsError("bytes follow the ClientHello's server name list")
    if names.u8("server name") != NAME_TYPE_HOST_NAME:
        raise TlsError("the ClientHello's server name is not a host name")
    host = names.vector(2, "server name")
    if not names.done:
        raise TlsError("the ClientHello names more than one server")
    raw = host.rest()
    if not raw:
        raise TlsError("the ClientHello's server name is empty")
    if not raw.isascii():
        raise TlsError("the ClientHello's server name is not ASCII")  # RFC 6066 §3
    return raw.decode("ascii")
