"""SOCKS5 handshake state machine (RFC 1928/1929): exact bytes, any chunking, hostile input.

Every scenario is fed whole, byte by byte and at random cut points, with and
without payload pipelined behind the request. A real client (python-socks)
then talks to the machine over loopback. The test may use socket/threading;
the module under test must not.
"""

from __future__ import annotations

import ast
import contextlib
import hmac
import ipaddress
import itertools
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from python_socks import ProxyError, ProxyType
from python_socks.sync import Proxy

from egressbox.core.errors import EgressboxError, Reason
from egressbox.core.hosts import canonical_ip_text
from egressbox.protocols import socks5
from egressbox.protocols.socks5 import (
    HTTP_ON_SOCKS_PORT,
    MAX_HANDSHAKE_BUFFER,
    AddressType,
    Authenticated,
    AuthMethod,
    ConnectRequest,
    Event,
    MethodSelected,
    Rejected,
    ReplyCode,
    Socks5Error,
    Socks5Server,
    looks_like_http,
)
from sources import source_of, state_of

USER = "alice"
PASSWORD = "s3cret-pässword"
PAYLOAD = b"\x16\x03\x01 pipelined client bytes \x00\xff"
BANNED_IMPORTS = {"asyncio", "socket", "ssl", "selectors", "threading"}


def check_credentials(username: str, password: str) -> bool:
    user_ok = hmac.compare_digest(username.encode(), USER.encode())
    return hmac.compare_digest(password.encode(), PASSWORD.encode()) and user_ok


def any_user_with_password(username: str, password: str) -> bool:
    return hmac.compare_digest(password.encode(), PASSWORD.encode())


def make_server(auth: bool, check: Callable[[str, str], bool] = check_credentials) -> Socks5Server:
    return Socks5Server(check if auth else None)


# --- wire builders -------------------------------------------------------------------


def greeting(*methods: int) -> bytes:
    return bytes([5, len(methods), *methods])


def auth_message(username: bytes, password: bytes, version: int = 1) -> bytes:
    return bytes([version, len(username)]) + username + bytes([len(password)]) + password


def request(atyp: int, address: bytes, port: int, cmd: int = 1, rsv: int = 0) -> bytes:
    return bytes([5, cmd, rsv, atyp]) + address + port.to_bytes(2, "big")


def domain(name: bytes) -> bytes:
    return bytes([len(name)]) + name


def reply(code: int, address: bytes = bytes(4), port: int = 0, atyp: int = 1) -> bytes:
    return bytes([5, code, 0, atyp]) + address + port.to_bytes(2, "big")


NO_AUTH = greeting(0)
USER_AUTH = greeting(0, 2) + auth_message(USER.encode(), PASSWORD.encode())
EXAMPLE = request(3, domain(b"example.com"), 443)
AUTH_OK = b"\x05\x02\x01\x00"
AUTH_FAILED = b"\x05\x02\x01\x01"


# --- driving the machine -------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    events: tuple[Event, ...]
    sent: bytes
    trailing: bytes
    closed: bool


def drive(server: Socks5Server, chunks: Sequence[bytes]) -> Outcome:
    """Feed chunks as a glue would: stop reading once the handshake is over.

    Bytes not yet read when the request completes count as trailing, so
    every chunking of the same stream must give the same Outcome.
    """
    events: list[Event] = []
    sent = b""
    for index, chunk in enumerate(chunks):
        events += server.feed(chunk)
        sent += server.outgoing()
        if server.closed:
            return Outcome(tuple(events), sent, b"", closed=True)
        if any(isinstance(event, ConnectRequest) for event in events):
            unread = b"".join(chunks[index + 1 :])
            return Outcome(tuple(events), sent, server.trailing + unread, closed=False)
    return Outcome(tuple(events), sent, b"", closed=False)


def whole(data: bytes) -> list[bytes]:
    return [data]


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


def split_at(data: bytes, cuts: set[int]) -> list[bytes]:
    edges = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


CHUNKERS: dict[str, Callable[[bytes], list[bytes]]] = {"whole": whole, "bytewise": bytewise}


# --- the scenario table --------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    data: bytes
    events: tuple[Event, ...]
    sent: bytes
    auth: bool = False
    # A case that ends in a ConnectRequest keeps pipelined payload as trailing.
    connects: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "connects", isinstance(self.events[-1], ConnectRequest))


NO_AUTH_SELECTED = MethodSelected(AuthMethod.NO_AUTH)
USER_SELECTED = MethodSelected(AuthMethod.USERNAME_PASSWORD)


def rejected(code: ReplyCode | None, message: str, reason: Reason | None = None) -> Rejected:
    return Rejected(code, message, reason)


def bad_host(message: str) -> Rejected:
    return Rejected(ReplyCode.GENERAL_FAILURE, f"bad host: {message}", Reason.BAD_HOST)


BAD_NAME_BYTE = "domain name has a control, NUL or non-ASCII byte"

CASES = [
    Case(
        "ipv4",
        NO_AUTH + request(1, bytes([93, 184, 216, 34]), 80),
        (NO_AUTH_SELECTED, ConnectRequest("93.184.216.34", 80, AddressType.IPV4)),
        b"\x05\x00",
    ),
    Case(
        "domain",
        NO_AUTH + EXAMPLE,
        (NO_AUTH_SELECTED, ConnectRequest("example.com", 443, AddressType.DOMAIN)),
        b"\x05\x00",
    ),
    Case(
        "ipv6",
        NO_AUTH + request(4, ipaddress.IPv6Address("2001:db8::1").packed, 8443),
        (NO_AUTH_SELECTED, ConnectRequest("2001:db8::1", 8443, AddressType.IPV6)),
        b"\x05\x00",
    ),
    Case(
        "ipv6_mapped_canonical",
        NO_AUTH + request(4, ipaddress.IPv6Address("::ffff:10.0.0.1").packed, 22),
        (NO_AUTH_SELECTED, ConnectRequest("::ffff:10.0.0.1", 22, AddressType.IPV6)),
        b"\x05\x00",
    ),
    Case(
        # Passed on so the decision module says bad_port and the audit has a record.
        "port_zero_passed_to_glue",
        NO_AUTH + request(3, domain(b"example.com"), 0),
        (NO_AUTH_SELECTED, ConnectRequest("example.com", 0, AddressType.DOMAIN)),
        b"\x05\x00",
    ),
    Case(
        # Printable ASCII is for hosts.normalize_host to judge, not this layer.
        "printable_junk_passed_to_glue",
        NO_AUTH + request(3, domain(b"a b/@%"), 443),
        (NO_AUTH_SELECTED, ConnectRequest("a b/@%", 443, AddressType.DOMAIN)),
        b"\x05\x00",
    ),
    Case(
        "many_methods_offered",
        greeting(*range(1, 255), 0) + EXAMPLE,
        (NO_AUTH_SELECTED, ConnectRequest("example.com", 443, AddressType.DOMAIN)),
        b"\x05\x00",
    ),
    Case(
        "userpass_right",
        USER_AUTH + EXAMPLE,
        (
            USER_SELECTED,
            Authenticated(USER),
            ConnectRequest("example.com", 443, AddressType.DOMAIN),
        ),
        AUTH_OK,
        auth=True,
    ),
    Case(
        "userpass_wrong_password",
        greeting(2) + auth_message(USER.encode(), b"guess") + EXAMPLE,
        (USER_SELECTED, rejected(None, "username/password rejected")),
        AUTH_FAILED,
        auth=True,
    ),
    Case(
        "userpass_wrong_user",
        greeting(2) + auth_message(b"mallory", PASSWORD.encode()) + EXAMPLE,
        (USER_SELECTED, rejected(None, "username/password rejected")),
        AUTH_FAILED,
        auth=True,
    ),
    Case(
        "userpass_not_utf8",
        greeting(2) + auth_message(b"\xff\xfe", PASSWORD.encode()) + EXAMPLE,
        (USER_SELECTED, rejected(None, "username/password rejected")),
        AUTH_FAILED,
        auth=True,
    ),
    Case(
        "userpass_empty_username",
        greeting(2) + auth_message(b"", PASSWORD.encode()),
        (USER_SELECTED, rejected(None, "empty username")),
        AUTH_FAILED,
        auth=True,
    ),
    Case(
        "userpass_empty_password",
        greeting(2) + auth_message(USER.encode(), b""),
        (USER_SELECTED, rejected(None, "empty password")),
        AUTH_FAILED,
        auth=True,
    ),
    Case(
        "userpass_bad_version",
        greeting(2) + auth_message(USER.encode(), PASSWORD.encode(), version=5),
        (USER_SELECTED, rejected(None, "unsupported username/password version")),
        AUTH_FAILED,
        auth=True,
    ),
    Case(
        "no_acceptable_method_noauth_port",
        greeting(2) + EXAMPLE,
        (rejected(None, "no acceptable method (this port needs no authentication)"),),
        b"\x05\xff",
    ),
    Case(
        "no_acceptable_method_auth_port",
        greeting(0) + EXAMPLE,
        (rejected(None, "no acceptable method (this port needs username/password)"),),
        b"\x05\xff",
        auth=True,
    ),
    Case(
        "zero_methods",
        b"\x05\x00" + EXAMPLE,
        (rejected(None, "greeting offers no authentication method"),),
        b"\x05\xff",
    ),
    Case(
        "bind",
        NO_AUTH + request(1, bytes(4), 0, cmd=2),
        (NO_AUTH_SELECTED, rejected(ReplyCode.COMMAND_NOT_SUPPORTED, socks5._command_message(2))),
        b"\x05\x00" + reply(7),
    ),
    Case(
        "udp_associate",
        NO_AUTH + request(1, bytes(4), 0, cmd=3),
        (NO_AUTH_SELECTED, rejected(ReplyCode.COMMAND_NOT_SUPPORTED, socks5._command_message(3))),
        b"\x05\x00" + reply(7),
    ),
    Case(
        "unknown_command",
        NO_AUTH + request(1, bytes(4), 80, cmd=9),
        (
            NO_AUTH_SELECTED,
            rejected(ReplyCode.COMMAND_NOT_SUPPORTED, "unknown command 0x09; only CONNECT"),
        ),
        b"\x05\x00" + reply(7),
    ),
    Case(
        "reserved_not_zero",
        NO_AUTH + request(1, bytes(4), 80, rsv=1),
        (NO_AUTH_SELECTED, rejected(ReplyCode.GENERAL_FAILURE, "reserved byte is not 0")),
        b"\x05\x00" + reply(1),
    ),
    Case(
        "request_version_4",
        NO_AUTH + b"\x04" + EXAMPLE[1:],
        (NO_AUTH_SELECTED, rejected(ReplyCode.GENERAL_FAILURE, "request version is not 5")),
        b"\x05\x00" + reply(1),
    ),
    Case(
        "unknown_atyp",
        NO_AUTH + request(2, bytes(4), 80),
        (
            NO_AUTH_SELECTED,
            rejected(ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED, "unknown address type 0x02"),
        ),
        b"\x05\x00" + reply(8),
    ),
    Case(
        "empty_domain",
        NO_AUTH + request(3, domain(b""), 443),
        (NO_AUTH_SELECTED, bad_host("empty domain name")),
        b"\x05\x00" + reply(1),
    ),
    Case(
        "nul_in_domain",
        NO_AUTH + request(3, domain(b"allowed.example\x00.evil.test"), 443),
        (NO_AUTH_SELECTED, bad_host(BAD_NAME_BYTE)),
        b"\x05\x00" + reply(1),
    ),
    Case(
        "control_in_domain",
        NO_AUTH + request(3, domain(b"example.com\r\nX: y"), 443),
        (NO_AUTH_SELECTED, bad_host(BAD_NAME_BYTE)),
        b"\x05\x00" + reply(1),
    ),
    Case(
        "non_ascii_domain",
        NO_AUTH + request(3, domain("bücher.example".encode()), 443),
        (NO_AUTH_SELECTED, bad_host(BAD_NAME_BYTE)),
        b"\x05\x00" + reply(1),
    ),
    Case(
        "socks4",
        b"\x04\x01\x00\x50\x7f\x00\x00\x01user\x00",
        (rejected(None, "SOCKS4 is not supported; use SOCKS5 (socks5h://)"),),
        b"",
    ),
    Case(
        "http_get",
        b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n",
        (rejected(None, HTTP_ON_SOCKS_PORT),),
        b"",
    ),
    Case(
        "http_connect",
        b"CONNECT example.com:443 HTTP/1.1\r\n\r\n",
        (rejected(None, HTTP_ON_SOCKS_PORT),),
        b"",
        auth=True,
    ),
    Case(
        "tls_client_hello",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        (rejected(None, "not a SOCKS5 greeting (first byte 0x16)"),),
        b"",
    ),
]


def case_params() -> Iterator[object]:
    for case in CASES:
        for name in CHUNKERS:
            for tail in (b"", PAYLOAD):
                suffix = "+payload" if tail else ""
                yield pytest.param(case, name, tail, id=f"{case.id}-{name}{suffix}")


@pytest.mark.parametrize(("case", "chunker", "tail"), list(case_params()))
def test_scenario(case: Case, chunker: str, tail: bytes) -> None:
    server = make_server(case.auth)
    outcome = drive(server, CHUNKERS[chunker](case.data + tail))
    assert outcome.events == case.events
    assert outcome.sent == case.sent
    assert outcome.closed == (not case.connects)
    assert outcome.trailing == (tail if case.connects else b"")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_password_never_leaks(case: Case) -> None:
    server = make_server(case.auth)
    events = server.feed(case.data + PAYLOAD)
    seen = repr(events) + repr(state_of(server)) + server.outgoing().hex()
    for secret in (PASSWORD, PASSWORD.encode().hex(), repr(PASSWORD.encode())):
        assert secret not in seen


def test_userpass_username_in_event_only() -> None:
    server = make_server(auth=True)
    events = server.feed(USER_AUTH)
    assert repr(events) == (
        "[MethodSelected(method=<AuthMethod.USERNAME_PASSWORD: 2>), "
        "Authenticated(username='alice')]"
    )


def test_credentials_callback_sees_decoded_text() -> None:
    calls: list[tuple[str, str]] = []

    def record(username: str, password: str) -> bool:
        calls.append((username, password))
        return True

    Socks5Server(record).feed(USER_AUTH)
    assert calls == [(USER, PASSWORD)]


def test_undecodable_credentials_never_reach_callback() -> None:
    def fail(username: str, password: str) -> bool:
        raise AssertionError("callback called")

    server = Socks5Server(fail)
    events = server.feed(greeting(2) + auth_message(USER.encode(), b"\xc3"))
    assert events[-1] == rejected(None, "username/password rejected")


# --- fast refusals from the first byte ---------------------------------------------


@pytest.mark.parametrize("first", list(b"GPCHODTgpchodt"))
def test_http_refused_from_first_byte(first: int) -> None:
    assert looks_like_http(bytes([first]))
    server = Socks5Server()
    assert server.feed(bytes([first])) == [rejected(None, HTTP_ON_SOCKS_PORT)]
    assert server.closed
    assert server.outgoing() == b""


@pytest.mark.parametrize("first", [b"", b"\x05", b"\x04", b"\x16", b"\x00", b"1", b" "])
def test_not_http(first: bytes) -> None:
    assert not looks_like_http(first)


def test_socks4_refused_from_first_byte_without_reply() -> None:
    server = Socks5Server()
    [event] = server.feed(b"\x04")
    assert isinstance(event, Rejected)
    assert "SOCKS4" in event.message
    assert server.closed
    assert server.outgoing() == b""


def test_incomplete_handshake_waits() -> None:
    server = Socks5Server()
    assert server.feed(NO_AUTH + EXAMPLE[:-1]) == [NO_AUTH_SELECTED]
    assert not server.closed
    assert server.trailing == b""
    assert server.feed(EXAMPLE[-1:]) == [ConnectRequest("example.com", 443, AddressType.DOMAIN)]


# --- replies ----------------------------------------------------------------------------


def connected(auth: bool = False, tail: bytes = b"") -> Socks5Server:
    server = make_server(auth)
    events = server.feed((USER_AUTH if auth else NO_AUTH) + EXAMPLE + tail)
    assert isinstance(events[-1], ConnectRequest)
    server.outgoing()
    return server


@pytest.mark.parametrize(
    ("bind", "expected"),
    [
        (("0.0.0.0", 0), reply(0)),
        (("10.0.0.1", 5555), reply(0, bytes([10, 0, 0, 1]), 5555)),
        ((ipaddress.IPv4Address("192.0.2.7"), 65535), reply(0, bytes([192, 0, 2, 7]), 65535)),
        (("2001:db8::2", 443), reply(0, ipaddress.IPv6Address("2001:db8::2").packed, 443, 4)),
        (("::", 0), reply(0, bytes(16), 0, 4)),
    ],
)
def test_reply_success_bytes(bind: tuple[str, int], expected: bytes) -> None:
    server = connected(tail=PAYLOAD)
    assert server.reply_success(*bind) == expected
    assert not server.closed
    assert server.trailing == PAYLOAD


def test_reply_success_defaults_to_unspecified() -> None:
    assert connected().reply_success() == b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00"


@pytest.mark.parametrize("code", [c for c in ReplyCode if c is not ReplyCode.SUCCEEDED])
def test_reply_failure_bytes(code: ReplyCode) -> None:
    server = connected(tail=PAYLOAD)
    assert server.reply_failure(code) == bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0])
    assert server.closed
    assert server.trailing == b""


def test_reply_codes_match_rfc1928() -> None:
    assert [int(c) for c in ReplyCode] == list(range(9))
    assert int(ReplyCode.NOT_ALLOWED) == 0x02


@pytest.mark.parametrize(
    "misuse",
    [
        lambda s: s.reply_success("localhost", 80),
        lambda s: s.reply_success("10.0.0.1", 65536),
        lambda s: s.reply_success("10.0.0.1", -1),
        lambda s: s.reply_failure(ReplyCode.SUCCEEDED),
        lambda s: s.feed(b"more"),
    ],
)
def test_misuse_after_request_raises(misuse: Callable[[Socks5Server], object]) -> None:
    with pytest.raises(Socks5Error):
        misuse(connected())


def test_reply_before_request_raises() -> None:
    server = Socks5Server()
    server.feed(NO_AUTH)
    with pytest.raises(Socks5Error):
        server.reply_success()
    with pytest.raises(Socks5Error):
        server.reply_failure(ReplyCode.NOT_ALLOWED)


def test_second_reply_and_feed_after_close_raise() -> None:
    server = connected()
    server.reply_success()
    with pytest.raises(Socks5Error):
        server.reply_failure(ReplyCode.GENERAL_FAILURE)
    with pytest.raises(Socks5Error):
        server.feed(b"x")
    rejected_server = Socks5Server()
    rejected_server.feed(b"G")
    with pytest.raises(Socks5Error):
        rejected_server.feed(b"ET /")


def test_error_is_part_of_the_tree() -> None:
    assert issubclass(Socks5Error, EgressboxError)
    error = Socks5Error("x", ReplyCode.NOT_ALLOWED, Reason.BAD_HOST)
    assert (error.reply_code, error.reason, str(error)) == (
        ReplyCode.NOT_ALLOWED,
        Reason.BAD_HOST,
        "x",
    )


# --- bounds and purity ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("auth", "partial"),
    [
        (False, greeting(*range(255))[:-1]),
        (True, greeting(2) + auth_message(b"u" * 255, b"p" * 255)[:-1]),
        (False, NO_AUTH + request(3, domain(b"n" * 255), 443)[:-1]),
    ],
)
def test_longest_partial_messages_stay_bounded(auth: bool, partial: bytes) -> None:
    server = make_server(auth)
    server.feed(partial)
    assert not server.closed
    assert server.buffered <= MAX_HANDSHAKE_BUFFER < 600


def test_no_io_imports() -> None:
    tree = ast.parse(source_of(socks5))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & BANNED_IMPORTS


# --- properties -------------------------------------------------------------------------


def check_all_chunkings_agree(auth: bool, data: bytes, cuts: set[int]) -> Outcome:
    """Whole, byte-by-byte and cut feeding must give one Outcome, and stay bounded."""
    outcomes = []
    for chunks in (whole(data), bytewise(data), split_at(data, cuts)):
        server = make_server(auth, any_user_with_password)
        outcomes.append(drive(server, chunks))
        handshaking = not server.closed and not server.trailing
        assert not handshaking or server.buffered <= MAX_HANDSHAKE_BUFFER
    assert outcomes[1] == outcomes[0]
    assert outcomes[2] == outcomes[0]
    return outcomes[0]


@settings(max_examples=400)
@given(st.booleans(), st.binary(max_size=700), st.sets(st.integers(1, 700), max_size=20))
def test_random_bytes_never_crash(auth: bool, data: bytes, cuts: set[int]) -> None:
    # Any exception other than Socks5Error fails the test; drive() never
    # misuses the machine, so even Socks5Error must not escape here.
    outcome = check_all_chunkings_agree(auth, data, cuts)
    if outcome.closed:
        assert isinstance(outcome.events[-1], Rejected)


@st.composite
def handshakes(draw: st.DrawFn) -> tuple[bool, bytes, tuple[Event, ...], bytes]:
    """A valid handshake, the events it must produce, and the payload behind it."""
    auth = draw(st.booleans())
    wanted = 2 if auth else 0
    others = draw(st.lists(st.integers(0, 255).filter(lambda m: m != wanted), max_size=10))
    methods = draw(st.permutations([*others, wanted]))
    data = greeting(*methods)
    events: list[Event] = [MethodSelected(AuthMethod(wanted))]
    if auth:
        user = draw(st.text(min_size=1, max_size=60).filter(lambda u: len(u.encode()) <= 255))
        data += auth_message(user.encode(), PASSWORD.encode())
        events.append(Authenticated(user))
    request_bytes, connect = draw(connect_requests())
    events.append(connect)
    payload = draw(st.binary(max_size=100))
    return auth, data + request_bytes + payload, tuple(events), payload


@st.composite
def connect_requests(draw: st.DrawFn) -> tuple[bytes, ConnectRequest]:
    port = draw(st.integers(0, 65535))
    kind = draw(st.sampled_from(AddressType))
    if kind is AddressType.DOMAIN:
        name = draw(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1))
        name = name[:255]
        return request(3, domain(name.encode()), port), ConnectRequest(name, port, kind)
    if kind is AddressType.IPV4:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = draw(st.ip_addresses(v=4))
    else:
        ip = draw(st.ip_addresses(v=6))
    text = canonical_ip_text(ip)
    return request(kind, ip.packed, port), ConnectRequest(text, port, kind)


@settings(max_examples=300)
@given(handshakes(), st.sets(st.integers(1, 1200), max_size=30))
def test_valid_handshakes_agree_under_any_chunking(
    handshake: tuple[bool, bytes, tuple[Event, ...], bytes], cuts: set[int]
) -> None:
    auth, data, events, payload = handshake
    outcome = check_all_chunkings_agree(auth, data, cuts)
    assert outcome.events == events
    assert outcome.trailing == payload
    assert not outcome.closed


@settings(max_examples=400)
@given(handshakes(), st.data())
def test_mutated_handshakes_never_crash(
    handshake: tuple[bool, bytes, tuple[Event, ...], bytes], data: st.DataObject
) -> None:
    """One corrupted byte reaches every state; nothing but Socks5Error may escape.

    The second pass is a careless glue that keeps feeding after the handshake.
    """
    auth, stream, _, _ = handshake
    position = data.draw(st.integers(0, len(stream) - 1))
    mutated = bytearray(stream)
    mutated[position] = data.draw(st.integers(0, 255))
    cuts = data.draw(st.sets(st.integers(1, len(stream)), max_size=30))
    check_all_chunkings_agree(auth, bytes(mutated), cuts)
    server = make_server(auth, any_user_with_password)
    for chunk in split_at(bytes(mutated), cuts):
        with contextlib.suppress(Socks5Error):
            server.feed(chunk)


# --- a real client: python-socks over loopback -------------------------------------------

# python-socks sends credentials as ASCII, so the loopback tests use their own pair.
CLIENT_PASSWORD = "s3cret"
Credentials = Callable[[str, str], bool] | None


def check_client_credentials(username: str, password: str) -> bool:
    return hmac.compare_digest(f"{username}:{password}", f"{USER}:{CLIENT_PASSWORD}")


@dataclass
class TunnelLog:
    events: list[Event] = field(default_factory=list)
    received: bytes = b""
    error: BaseException | None = None


def handshake_over(server: Socks5Server, log: TunnelLog) -> bool:
    return server.closed or any(isinstance(e, ConnectRequest) for e in log.events)


def serve_one(
    listener: socket.socket,
    credentials: Credentials,
    answer: Callable[[Socks5Server], bytes],
    log: TunnelLog,
) -> None:
    """Accept one client, run the handshake through the machine, then collect tunnel bytes."""
    try:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            server = Socks5Server(credentials)
            while not handshake_over(server, log) and (data := conn.recv(4096)):
                log.events += server.feed(data)
                conn.sendall(server.outgoing())
            if server.closed or not log.events:
                return
            conn.sendall(answer(server))
            if server.closed:
                return
            log.received = server.trailing
            while data := conn.recv(4096):
                log.received += data
    except BaseException as exc:  # handed to the test thread
        log.error = exc


def run_client(
    proxy_auth: tuple[str, str] | None,
    dest: tuple[str, int],
    answer: Callable[[Socks5Server], bytes],
    message: bytes = b"",
) -> TunnelLog:
    credentials = check_client_credentials if proxy_auth else None
    username, password = proxy_auth or (None, None)
    log = TunnelLog()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(5)
        port = listener.getsockname()[1]
        thread = threading.Thread(target=serve_one, args=(listener, credentials, answer, log))
        thread.start()
        try:
            proxy = Proxy(ProxyType.SOCKS5, "127.0.0.1", port, username, password, rdns=True)
            with proxy.connect(*dest, timeout=5) as sock:
                sock.sendall(message)
        finally:
            thread.join(timeout=10)
    assert not thread.is_alive()
    if log.error is not None:
        raise log.error
    return log


def succeed(server: Socks5Server) -> bytes:
    return server.reply_success("127.0.0.1", 4321)


def deny(server: Socks5Server) -> bytes:
    return server.reply_failure(ReplyCode.NOT_ALLOWED)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("dest", "expected"),
    [
        (("example.com", 443), ConnectRequest("example.com", 443, AddressType.DOMAIN)),
        (("192.0.2.1", 80), ConnectRequest("192.0.2.1", 80, AddressType.IPV4)),
        (("2001:db8::1", 8080), ConnectRequest("2001:db8::1", 8080, AddressType.IPV6)),
    ],
)
@pytest.mark.parametrize("auth", [False, True])
def test_python_socks_client(auth: bool, dest: tuple[str, int], expected: ConnectRequest) -> None:
    proxy_auth = (USER, CLIENT_PASSWORD) if auth else None
    log = run_client(proxy_auth, dest, succeed, message=PAYLOAD * 3)
    assert log.events[-1] == expected
    assert (Authenticated(USER) in log.events) == auth
    assert log.received == PAYLOAD * 3


@pytest.mark.timeout(30)
def test_python_socks_client_sees_policy_denial() -> None:
    with pytest.raises(ProxyError) as caught:
        run_client(None, ("example.com", 443), deny)
    assert caught.value.error_code == ReplyCode.NOT_ALLOWED


@pytest.mark.timeout(30)
def test_python_socks_client_wrong_password() -> None:
    with pytest.raises(ProxyError):
        run_client((USER, "wrong"), ("example.com", 443), succeed)
