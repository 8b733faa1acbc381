"""A TLS ClientHello reader (RFC 8446 §4.1.2, §5.1, RFC 6066 §3) as a sans-IO machine.

Bytes in, one result out: the first bytes a client sends into a tunnel are fed
as they arrive, and `ClientHelloReader.feed` answers

- `NEED_MORE`: a ClientHello has begun and is not complete yet;
- `NOT_TLS`: no TLS server would take the stream for a handshake (the tunnel
  carries something else, and is none of our business);
- `ClientHello`: the first handshake message is complete; its `server_name`
  (the SNI host_name, None without one) and whether an ECH extension
  (encrypted_client_hello, 0xfe0d) is present;
- `Malformed`: a stream a TLS server could take for a handshake whose
  ClientHello we cannot read to its server name, or one larger than the
  bounds below (the glue refuses it).

"Not TLS" is judged by the most lenient receiver, never by what a well-behaved
client sends, so that a stream is relayed unread only when no server could
find a server name in it:

- A first byte that is a record content type (20 change_cipher_spec,
  21 alert, 22 handshake, 23 application_data, 24 heartbeat) starts TLS,
  whatever follows. The record version is never judged: Go's crypto/tls
  server takes any version below 0x1000 on every record before it has read
  the ClientHello (`02 01`, `00 00` and `0f 03` complete a handshake), and
  other stacks differ in what they accept.
- Warning alerts and change_cipher_spec records before the ClientHello, or
  between its records, are skipped, as Go skips warning alerts (up to
  `MAX_SKIPPED` of them: Go's maxUselessRecords). A fatal alert, a
  close_notify, an alert or CCS of another size, and application data or
  heartbeat records are `Malformed`: a server sees no ClientHello there.
- An SSL 2.0 compatible ClientHello (a first byte with its high bit set and a
  third byte of 1, OpenSSL's own test) is `Malformed`: it carries no
  extensions, so no server name, and RFC 8446 Appendix D.5 says servers
  should not accept it. Go refuses it; OpenSSL 3.0 still parses it (its SNI
  callback sees no name) and negotiates TLS 1.2 with it when its security
  level allows; no current client sends one.
- A ClientHello split across records (up to `MAX_RECORDS`) is reassembled.

Once it has said anything but NEED_MORE it says the same thing forever. It
never raises on client bytes: every length field is checked against what is
left before it is used, and anything a TLS server would read differently from
us (two server_name extensions, two host names, bytes after the extensions)
is `Malformed`, so that the name we judge is the only name a server can see.
Nothing here may import asyncio, socket, ssl, selectors or threading.

The reader holds at most one record header, one alert or CCS body and the
ClientHello message itself (bounded by `max_hello`); the glue that keeps the
raw bytes to forward them is bounded by the same limits (`MAX_INPUT` bytes of
records, then one read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from egressbox.core.errors import EgressboxError

# -- limits (where each value came from) -------------------------------------------

RECORD_HEADER: Final = 5  # ContentType, ProtocolVersion, uint16 length (RFC 8446 §5.1)
# A plaintext record carries at most 2^14 bytes (RFC 8446 §5.1: record_overflow).
MAX_RECORD: Final = 1 << 14
# The ClientHello message with its 4-byte handshake header. Real ones are
# 200-600 bytes, ~1.8 KiB with a post-quantum key share (X25519MLKEM768) and
# up to a few KiB with many PSK identities; 16 KiB is one full record.
MAX_HELLO: Final = 16 * 1024
# Records a ClientHello may be split into. One is the rule; tools that split
# the first bytes on purpose (to get past middleboxes) use a handful.
MAX_RECORDS: Final = 64
# Warning alerts and change_cipher_spec records skipped before the ClientHello is
# complete: Go's crypto/tls drops at most 16 such records in a row
# (maxUselessRecords in crypto/tls/common.go) before it gives up.
MAX_SKIPPED: Final = 16
ALERT_SIZE: Final = 2  # AlertLevel, AlertDescription (RFC 8446 §6)
CCS_SIZE: Final = 1  # the one byte 0x01 (RFC 5246 §7.1; RFC 8446 Appendix D.4)
# The most input the reader consumes before it answers (records' headers too).
MAX_INPUT: Final = (
    MAX_HELLO + MAX_RECORDS * RECORD_HEADER + MAX_SKIPPED * (RECORD_HEADER + ALERT_SIZE)
)

# Record content types (RFC 8446 §5.1; 24 is heartbeat, RFC 6520).
CHANGE_CIPHER_SPEC: Final = 20
ALERT: Final = 21
HANDSHAKE: Final = 22
APPLICATION_DATA: Final = 23
HEARTBEAT: Final = 24
ALERT_WARNING: Final = 1  # AlertLevel warning; 2 is fatal
ALERT_CLOSE_NOTIFY: Final = 0  # AlertDescription: the end of the stream
TLS_MAJOR: Final = 3  # every TLS and SSL 3 ClientHello version is 0x03xx
CLIENT_HELLO: Final = 1  # HandshakeType
# An SSL 2.0 record header's first byte has its high bit set (a 2-byte length); its
# third byte is the message type, 1 for CLIENT-HELLO (RFC 6101 Appendix E.2).
SSL2_LENGTH_BIT: Final = 0x80
SSL2_CLIENT_HELLO: Final = 1
SSL2_TYPE_AT: Final = 2
EXT_SERVER_NAME: Final = 0  # RFC 6066 §3
EXT_ENCRYPTED_CLIENT_HELLO: Final = 0xFE0D  # RFC 9849 (draft-ietf-tls-esni)
NAME_TYPE_HOST_NAME: Final = 0
MAX_SESSION_ID: Final = 32
HANDSHAKE_HEADER: Final = 4  # HandshakeType, uint24 length
RANDOM_SIZE: Final = 32


class TlsError(EgressboxError):
    """A TLS stream we refuse: its first message is not a readable ClientHello.

    Messages are fixed texts: they never echo the client's bytes.
    """


@dataclass(frozen=True, slots=True)
class NeedMore:
    """A ClientHello has begun; feed more bytes."""


@dataclass(frozen=True, slots=True)
class NotTls:
    """No TLS server would take the first bytes for a handshake."""


@dataclass(frozen=True, slots=True)
class Malformed:
    """A stream that starts like TLS without a readable ClientHello."""

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


def starts_tls_record(first: int) -> bool:
    """Whether a stream starting with this byte starts like a TLS record (any content type)."""
    return CHANGE_CIPHER_SPEC <= first <= HEARTBEAT


def may_be_tls(first: int) -> bool:
    """False when no TLS server takes a stream starting with this byte for a handshake
    (the fast path): neither a TLS record nor an SSL 2.0 compatible ClientHello."""
    return starts_tls_record(first) or first >= SSL2_LENGTH_BIT


class ClientHelloReader:
    """Reads the first ClientHello of a client's stream, fed in any chunking."""

    __slots__ = (
        "_body",
        "_header",
        "_kind",
        "_left",
        "_max_hello",
        "_max_records",
        "_message",
        "_need",
        "_records",
        "_result",
        "_skipped",
    )

    def __init__(self, max_hello: int = MAX_HELLO, max_records: int = MAX_RECORDS) -> None:
        self._max_hello = max_hello
        self._max_records = max_records
        self._header = bytearray()  # the record header being read (< RECORD_HEADER bytes)
        self._kind = HANDSHAKE  # the current record's content type
        self._left = 0  # bytes of the current record's body still to come
        self._records = 0  # handshake records started
        self._skipped = 0  # alert and change_cipher_spec records started
        self._body = bytearray()  # an alert's or CCS's body so far (<= ALERT_SIZE bytes)
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
                self._kind = self._header[0]
                self._left = int.from_bytes(self._header[3:5], "big")
                self._header.clear()
                continue
            if self._kind != HANDSHAKE:
                take = min(self._left, size - at)
                self._body += data[at : at + take]
                at += take
                self._left -= take
                if self._left == 0:
                    self._skip_record()
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
        kind = header[0]
        if self._records == 0 and self._skipped == 0:  # the stream's first record
            if kind >= SSL2_LENGTH_BIT:
                return self._check_ssl2()
            if not starts_tls_record(kind):
                return NOT_TLS
        if kind in (APPLICATION_DATA, HEARTBEAT):
            raise TlsError("a TLS stream sends application data or a heartbeat before its hello")
        if kind not in (HANDSHAKE, ALERT, CHANGE_CIPHER_SPEC):
            raise TlsError("a record of the ClientHello has a type that is not TLS")
        if len(header) < RECORD_HEADER:
            return None  # the version (never judged: see the module doc) and the length
        length = int.from_bytes(header[3:5], "big")
        if kind == HANDSHAKE:
            self._count_handshake_record(length)
        elif length != (ALERT_SIZE if kind == ALERT else CCS_SIZE):
            raise TlsError("an alert or change_cipher_spec record of the wrong size")
        else:
            self._skipped += 1
            if self._skipped > MAX_SKIPPED:
                raise TlsError(
                    f"more than {MAX_SKIPPED} alert or change_cipher_spec records"
                    " before the ClientHello"
                )
        return None

    def _check_ssl2(self) -> Result | None:
        """An SSL 2.0 record header: its CLIENT-HELLO is refused, anything else is not TLS."""
        if len(self._header) <= SSL2_TYPE_AT:
            return None
        if self._header[SSL2_TYPE_AT] != SSL2_CLIENT_HELLO:
            return NOT_TLS
        raise TlsError("an SSL 2.0 compatible ClientHello, which carries no server name")

    def _count_handshake_record(self, length: int) -> None:
        if length == 0:
            raise TlsError("an empty handshake record")  # RFC 8446 §5.1 forbids them
        if length > MAX_RECORD:
            raise TlsError("a TLS record longer than 16384 bytes")
        self._records += 1
        if self._records > self._max_records:
            raise TlsError(f"the ClientHello is split into more than {self._max_records} records")

    def _skip_record(self) -> None:
        """A complete alert or change_cipher_spec record: dropped if a server drops it."""
        body = bytes(self._body)
        self._body.clear()
        if self._kind == CHANGE_CIPHER_SPEC:
            if body != b"\x01":
                raise TlsError("a change_cipher_spec record whose byte is not 1")
        elif body[0] != ALERT_WARNING or body[1] == ALERT_CLOSE_NOTIFY:
            raise TlsError("a fatal alert or close_notify before the ClientHello")

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
