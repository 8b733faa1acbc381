"""The ClientHello reader (protocols/tls.py): real hellos from Python's ssl, hand-built ones.

"Not TLS" is judged by the most lenient receiver (Go's record layer, modelled by
`tls_hellos.go_record_layer` and checked against the real Go in
tests/proxy/test_tls_lenient.py): whatever it would read a ClientHello from, the
reader reads to the same hello or refuses, never calls not TLS.

Real ClientHellos come from `ssl` through a MemoryBIO (no socket): fed whole, byte
by byte, at every cut point, with bytes after them, and re-framed into several
records. Hand-built hellos cover what no stack sends on its own (ECH, bad lengths,
repeated extensions). Whatever the input and its chunking, the answer is one of
the four results, never an exception, and the same however the bytes were cut.
"""

from __future__ import annotations

import itertools
import ssl
import struct
from collections.abc import Iterable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from egressbox.core.errors import EgressboxError
from egressbox.protocols import tls
from egressbox.protocols.tls import (
    MAX_HELLO,
    MAX_INPUT,
    MAX_RECORD,
    MAX_RECORDS,
    NEED_MORE,
    NOT_TLS,
    ClientHello,
    ClientHelloReader,
    Malformed,
    Result,
    TlsError,
    may_be_tls,
    parse_client_hello,
    starts_tls_record,
)
from tls_hellos import (
    ECH_OUTER,
    extension,
    go_record_layer,
    handshake_message,
    hello_body,
    lenient_variants,
    real_hello,
    records,
    sni_extension,
    vec,
    wrap,
)

# -- real ClientHellos -------------------------------------------------------------------


def feed_all(chunks: Iterable[bytes]) -> Result:
    reader = ClientHelloReader()
    result: Result = NEED_MORE
    for chunk in chunks:
        result = reader.feed(chunk)
    return result


def byte_by_byte(data: bytes) -> list[Result]:
    reader = ClientHelloReader()
    return [reader.feed(data[i : i + 1]) for i in range(len(data))]


def summary(result: Result) -> object:
    """A comparable form (two TlsError instances never compare equal)."""
    if isinstance(result, Malformed):
        return ("malformed", str(result.error))
    return result


NAMES = ["example.com", "tls.ok.test", "xn--bcher-kva.example", "a.b.c.d.e.example.org"]


@pytest.fixture(scope="module")
def hellos() -> dict[str, bytes]:
    found = {name: real_hello(name) for name in NAMES}
    found["tls12"] = real_hello("example.com", maximum=ssl.TLSVersion.TLSv1_2)
    found["alpn"] = real_hello("example.com", alpn=["h2", "http/1.1"])
    return found


@pytest.mark.parametrize("name", NAMES)
def test_a_real_hello_fed_whole_names_its_server(name: str) -> None:
    assert ClientHelloReader().feed(real_hello(name)) == ClientHello(name, ech=False)


@pytest.mark.parametrize("name", NAMES)
def test_a_real_hello_fed_byte_by_byte_needs_more_until_its_last_byte(name: str) -> None:
    data = real_hello(name)
    results = byte_by_byte(data)
    assert all(r is NEED_MORE for r in results[:-1])
    assert results[-1] == ClientHello(name, ech=False)


def test_every_cut_point_gives_the_same_hello(hellos: dict[str, bytes]) -> None:
    data = hellos["tls12"]
    for cut in range(len(data) + 1):
        assert feed_all([data[:cut], data[cut:]]) == ClientHello("example.com", ech=False)


def test_bytes_after_the_hello_change_nothing(hellos: dict[str, bytes]) -> None:
    data = hellos["alpn"]
    trailing = b"\x17\x03\x03\x00\x05hello" + bytes(range(256))
    assert ClientHelloReader().feed(data + trailing) == ClientHello("example.com", ech=False)
    assert byte_by_byte(data + trailing)[-1] == ClientHello("example.com", ech=False)


def test_the_answer_is_sticky(hellos: dict[str, bytes]) -> None:
    reader = ClientHelloReader()
    first = reader.feed(hellos["example.com"])
    assert reader.feed(b"GET / HTTP/1.1\r\n") is first
    assert reader.result is first
    other = ClientHelloReader()
    assert other.feed(b"G") is NOT_TLS
    assert other.feed(hellos["example.com"]) is NOT_TLS


def test_tls12_and_alpn_hellos(hellos: dict[str, bytes]) -> None:
    assert ClientHelloReader().feed(hellos["tls12"]) == ClientHello("example.com", ech=False)
    assert ClientHelloReader().feed(hellos["alpn"]) == ClientHello("example.com", ech=False)


@pytest.mark.parametrize("server_hostname", [None, "127.0.0.1", "::1"])
def test_no_sni(server_hostname: str | None) -> None:
    # Python's ssl sends no server_name for an IP literal (RFC 6066 forbids it).
    assert ClientHelloReader().feed(real_hello(server_hostname)) == ClientHello(None, ech=False)


def test_no_extensions_at_all() -> None:
    # A TLS 1.2 and older ClientHello may end after its compression methods.
    body = b"\x03\x03" + bytes(32) + b"\x00" + b"\x00\x02\x00\x2f" + b"\x01\x00"
    assert feed_all([wrap(body)]) == ClientHello(None, ech=False)


@pytest.mark.parametrize("pieces", [2, 3, 7, 64])
@pytest.mark.parametrize("version", [b"\x03\x01", b"\x03\x03", b"\x03\x00"])
def test_a_hello_split_across_records(
    hellos: dict[str, bytes], pieces: int, version: bytes
) -> None:
    message = handshake_message(hellos["xn--bcher-kva.example"])
    step = max(1, len(message) // pieces)
    data = records(message, range(step, len(message), step)[: pieces - 1], version)
    expected = ClientHello("xn--bcher-kva.example", ech=False)
    assert feed_all([data]) == expected
    assert byte_by_byte(data)[-1] == expected


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cuts=st.lists(st.integers(min_value=1, max_value=600), max_size=MAX_RECORDS - 1), data=st.data()
)
def test_records_and_chunks_at_random(
    hellos: dict[str, bytes], cuts: list[int], data: st.DataObject
) -> None:
    message = handshake_message(hellos["a.b.c.d.e.example.org"])
    stream = records(message, cuts)
    chunk_cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=20))
    points = [0, *sorted(chunk_cuts), len(stream)]
    chunks = [stream[a:b] for a, b in itertools.pairwise(points)]
    assert feed_all(chunks) == ClientHello("a.b.c.d.e.example.org", ech=False)


LABEL = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=20).filter(
    lambda s: not s.startswith("-") and not s.endswith("-")
)


@settings(max_examples=50, deadline=None)
@given(labels=st.lists(LABEL, min_size=2, max_size=6))
def test_any_dns_name_comes_back_as_sent(labels: list[str]) -> None:
    name = ".".join(labels)
    if name.replace(".", "").isdigit():
        return  # an all-numeric name is an IPv4 literal to ssl: no SNI at all
    assert ClientHelloReader().feed(real_hello(name)) == ClientHello(name, ech=False)


# -- not TLS ------------------------------------------------------------------------------

NOT_TLS_STARTS = [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"SSH-2.0-OpenSSH_9.6\r\n",
    b"\x00\x00\x00\x08\x04\xd2\x16\x2f",  # PostgreSQL SSLRequest
    b"\x13\x03\x03",
    b"\x19\x03\x03",
    b"\x80\x2e\x02\x03\x01",  # an SSL 2.0 header, but not a CLIENT-HELLO (type 1)
    b"\xff\xfe\x00",
]


@pytest.mark.parametrize("start", NOT_TLS_STARTS)
def test_not_tls(start: bytes) -> None:
    assert ClientHelloReader().feed(start) is NOT_TLS
    assert byte_by_byte(start)[-1] is NOT_TLS


def test_the_first_byte_alone_decides_for_most_protocols() -> None:
    # The record content types, and the high bit of an SSL 2.0 record header.
    assert [b for b in range(256) if may_be_tls(b)] == [20, 21, 22, 23, 24, *range(128, 256)]
    for first in range(256):
        if not may_be_tls(first):
            assert ClientHelloReader().feed(bytes([first])) is NOT_TLS


@pytest.mark.parametrize("first", [20, 21, 22, 23, 24])
@pytest.mark.parametrize("second", [0x00, 0x02, 0x03, 0x0F, 0x10, 0xFF])
def test_a_record_type_first_is_never_not_tls_whatever_the_version(first: int, second: int) -> None:
    # Go takes any version below 0x1000; what no server takes is refused, never relayed.
    start = bytes([first, second, 0x01])
    assert ClientHelloReader().feed(start) is not NOT_TLS
    assert all(result is not NOT_TLS for result in byte_by_byte(start + b"\x00\x05hello"))


# -- what lenient receivers take -----------------------------------------------------------


@pytest.mark.parametrize("variant", list(lenient_variants(real_hello("example.com"))))
@pytest.mark.parametrize("name", ["example.com", "xn--bcher-kva.example"])
def test_lenient_record_layers_are_read_to_their_server_name(variant: str, name: str) -> None:
    flight = real_hello(name)
    data = lenient_variants(flight)[variant]
    if variant != "alert_and_ccs":  # Go refuses a CCS before its hello; we read past it
        assert go_record_layer(data) == handshake_message(flight)
    assert feed_all([data]) == ClientHello(name, ech=False)
    assert byte_by_byte(data)[-1] == ClientHello(name, ech=False)
    for cut in range(len(data) + 1):
        assert feed_all([data[:cut], data[cut:]]) == ClientHello(name, ech=False)


WARNING = b"\x15\x03\x01\x00\x02\x01\x70"  # warning unrecognized_name
CCS = b"\x14\x03\x01\x00\x01\x01"


def test_skipped_records_are_bounded() -> None:
    hello = real_hello("example.com")
    assert feed_all([WARNING * 8 + CCS * 8 + hello]) == ClientHello("example.com", ech=False)
    result = feed_all([WARNING * 9 + CCS * 8 + hello])
    assert isinstance(result, Malformed)
    assert "alert or change_cipher_spec" in str(result.error)
    assert go_record_layer(WARNING * 16 + hello) is not None  # Go's own bound: 16
    assert go_record_layer(WARNING * 17 + hello) is None


def test_an_ssl2_compatible_hello_is_refused() -> None:
    # Type 1, version 3.3, 3 bytes of cipher specs, no session id, 16 bytes of challenge:
    # OpenSSL 3.0 reads it (with no server name), Go refuses it, RFC 8446 D.5 says do not.
    body = b"\x01\x03\x03\x00\x03\x00\x00\x00\x10\x00\xc0\x2f" + bytes(16)
    data = bytes([0x80, len(body)]) + body
    result = feed_all([data])
    assert isinstance(result, Malformed)
    assert "SSL 2.0" in str(result.error)
    assert isinstance(byte_by_byte(data)[-1], Malformed)
    assert byte_by_byte(data)[1] is NEED_MORE  # the third byte decides


# -- hand-built ClientHellos ------------------------------------------------------------------


def test_a_hand_built_ech_hello() -> None:
    body = hello_body(
        [
            extension(0, sni_extension((0, b"public.example"))),
            extension(0x002B, b"\x02\x03\x04"),  # supported_versions: TLS 1.3
            extension(tls.EXT_ENCRYPTED_CLIENT_HELLO, ECH_OUTER),
        ]
    )
    data = wrap(body)
    assert feed_all([data]) == ClientHello("public.example", ech=True)
    assert byte_by_byte(data)[-1] == ClientHello("public.example", ech=True)


def test_ech_without_a_server_name() -> None:
    body = hello_body([extension(tls.EXT_ENCRYPTED_CLIENT_HELLO, ECH_OUTER)])
    assert feed_all([wrap(body)]) == ClientHello(None, ech=True)


def test_a_hello_of_exactly_the_largest_size_is_read() -> None:
    base = hello_body([extension(0, sni_extension((0, b"big.example")))])
    padding = MAX_HELLO - 4 - len(base) - 4  # the padding extension's own header: 4 bytes
    body = hello_body(
        [extension(0, sni_extension((0, b"big.example"))), extension(21, bytes(padding))]
    )
    assert len(body) + 4 == MAX_HELLO
    message = wrap(body)[5:]
    data = records(message, range(MAX_RECORD, len(message), MAX_RECORD))
    assert len(data) <= MAX_INPUT
    assert feed_all([data]) == ClientHello("big.example", ech=False)


MALFORMED: dict[str, bytes] = {
    "close_notify first": b"\x15\x03\x03\x00\x02\x01\x00",
    "fatal alert first": b"\x15\x03\x03\x00\x02\x02\x28",
    "alert of another level": b"\x15\x03\x03\x00\x02\x07\x28",
    "alert of three bytes": b"\x15\x03\x03\x00\x03\x01\x28\x00",
    "empty alert": b"\x15\x03\x03\x00\x00",
    "change cipher spec of 2": b"\x14\x03\x03\x00\x01\x02",
    "change cipher spec of two bytes": b"\x14\x03\x03\x00\x02\x01\x01",
    "change cipher spec then not a record": b"\x14\x03\x03\x00\x01\x01GET ",
    "alert then not a record": WARNING + b"SSH-",
    "a version no one takes, not a hello": b"\x16\xff\xff\x00\x05hello",
    "application data first": b"\x17\x03\x03\x00\x01\x00",
    "heartbeat first": b"\x18\x03\x03\x00\x01\x01",
    "empty record": b"\x16\x03\x01\x00\x00",
    "record over 2^14": b"\x16\x03\x01\x40\x01" + bytes(10),
    "not a client hello": wrap(hello_body(), handshake_type=2),
    "empty client hello": b"\x16\x03\x01\x00\x04\x01\x00\x00\x00",
    "too large": b"\x16\x03\x01\x00\x04\x01" + (MAX_HELLO - 3).to_bytes(3, "big"),
    "client hello version not TLS": wrap(hello_body(version=b"\x02\x00")),
    "session id over 32": wrap(hello_body(session_id=bytes(33))),
    "odd cipher suites": wrap(hello_body(suites=b"\x13\x01\x13")),
    "no cipher suite": wrap(hello_body(suites=b"")),
    "no compression": wrap(hello_body(compression=b"")),
    "bytes after the extensions": wrap(hello_body([]) + b"\x00"),
    "extensions overrun": wrap(hello_body(None) + b"\x00\x10\x00\x00"),
    "extension overruns": wrap(hello_body(None) + vec(2, b"\x00\x00\x00\x09\x00")),
    "repeated extension": wrap(
        hello_body(
            [
                extension(0, sni_extension((0, b"a.example"))),
                extension(0, sni_extension((0, b"b.example"))),
            ]
        )
    ),
    "repeated other extension": wrap(hello_body([extension(10, b""), extension(10, b"")])),
    "two host names": wrap(
        hello_body([extension(0, sni_extension((0, b"a.example"), (0, b"b.example")))])
    ),
    "another name type": wrap(hello_body([extension(0, sni_extension((1, b"a.example")))])),
    "host name and another type": wrap(
        hello_body([extension(0, sni_extension((0, b"a.example"), (7, b"b")))])
    ),
    "empty server name list": wrap(hello_body([extension(0, vec(2, b""))])),
    "empty server name extension": wrap(hello_body([extension(0, b"")])),
    "empty host name": wrap(hello_body([extension(0, sni_extension((0, b"")))])),
    "non-ASCII host name": wrap(
        hello_body([extension(0, sni_extension((0, "bücher.example".encode())))])
    ),
    "bytes after the name list": wrap(
        hello_body([extension(0, sni_extension((0, b"a.example")) + b"\x00")])
    ),
    "host name overruns": wrap(hello_body([extension(0, b"\x00\x05\x00\x00\x09abc")])),
    "truncated body": wrap(hello_body()[:20]),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed(data: bytes) -> None:
    whole = ClientHelloReader().feed(data)
    assert isinstance(whole, Malformed), whole
    assert isinstance(whole.error, TlsError)
    assert isinstance(whole.error, EgressboxError)
    assert summary(byte_by_byte(data)[-1]) == summary(whole)


def test_a_record_of_another_type_inside_the_hello() -> None:
    message = handshake_message(real_hello("example.com"))
    data = records(message[:100], []) + b"\x17\x03\x03\x00\x01\x00"
    assert isinstance(feed_all([data]), Malformed)
    heartbeat = records(message[:100], []) + b"\x18\x03\x03\x00\x01\x00"
    assert isinstance(feed_all([heartbeat]), Malformed)
    # The next record's version is not judged (Go takes any below 0x1000).
    other_version = records(message[:100], []) + records(message[100:], [], b"\x02\x00")
    assert feed_all([other_version]) == ClientHello("example.com", ech=False)


def test_too_many_records() -> None:
    message = handshake_message(real_hello("example.com"))
    assert feed_all([records(message, range(1, MAX_RECORDS))]) == ClientHello(
        "example.com", ech=False
    )
    too_many = records(message, range(1, MAX_RECORDS + 1))
    result = feed_all([too_many])
    assert isinstance(result, Malformed)
    assert "records" in str(result.error)


def test_messages_never_echo_the_client_bytes() -> None:
    for data in MALFORMED.values():
        result = feed_all([data])
        assert isinstance(result, Malformed)
        assert "example" not in str(result.error)


def test_every_strict_prefix_of_a_hello_needs_more(hellos: dict[str, bytes]) -> None:
    data = hellos["example.com"]
    for cut in range(1, len(data)):
        assert ClientHelloReader().feed(data[:cut]) is NEED_MORE
    assert ClientHelloReader().feed(b"") is NEED_MORE


def test_parse_client_hello_raises_only_tls_errors() -> None:
    with pytest.raises(TlsError):
        parse_client_hello(b"")
    assert parse_client_hello(hello_body()) == ClientHello(None, ech=False)


# -- anything at all -----------------------------------------------------------------------


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=1000, deadline=None)
@given(data=st.binary(max_size=600), cuts=st.lists(st.integers(0, 1000), max_size=8))
@example(data=b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00", cuts=[3])
def test_any_bytes_any_chunking_one_answer(data: bytes, cuts: list[int]) -> None:
    whole = ClientHelloReader().feed(data)
    assert isinstance(whole, tls.NeedMore | tls.NotTls | Malformed | ClientHello)
    assert summary(feed_all(split(data, cuts))) == summary(whole)


@settings(
    max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    position=st.integers(min_value=0),
    value=st.integers(0, 255),
    cut=st.integers(min_value=0),
    data=st.data(),
)
def test_a_mutated_real_hello_never_raises(
    hellos: dict[str, bytes], position: int, value: int, cut: int, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(hellos)))
    original = bytearray(hellos[name])
    original[position % len(original)] = value
    mutated = bytes(original)
    truncated = mutated[: cut % (len(mutated) + 1)]
    for sample in (mutated, truncated):
        whole = ClientHelloReader().feed(sample)
        assert summary(feed_all(split(sample, [cut, position]))) == summary(whole)
        if isinstance(whole, ClientHello) and whole.server_name is not None:
            assert whole.server_name.isascii()


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.sampled_from([b"\x16\x03\x01", b"\x16\x03\x03", b"\x16\x03\x00"]),
    length=st.integers(0, 0xFFFF),
    handshake=st.binary(max_size=64),
)
def test_tls_looking_garbage(prefix: bytes, length: int, handshake: bytes) -> None:
    data = prefix + struct.pack("!H", length) + handshake
    result = ClientHelloReader().feed(data)
    assert isinstance(result, tls.NeedMore | Malformed | ClientHello)


# -- the lenient receiver as the oracle ----------------------------------------------------


def assert_agrees_with_the_lenient_receiver(data: bytes) -> None:
    """What Go would assemble into a ClientHello, the reader reads to the same hello or
    refuses; it never calls it not TLS, nor waits for more."""
    result = ClientHelloReader().feed(data)
    if starts_tls_record(data[:1][0] if data else 0):
        assert result is not NOT_TLS
    message = go_record_layer(data)
    if message is None or message[0] != 1:
        return  # Go reads no ClientHello here: refusing or reading one is both safe
    assert isinstance(result, ClientHello | Malformed), result
    if isinstance(result, ClientHello):
        assert result == parse_client_hello(message[4:])


RECORD_VERSIONS = st.sampled_from([b"\x03\x01", b"\x03\x03", b"\x02\x01", b"\x00\x00", b"\x0f\x03"])
SKIPPABLE = st.sampled_from(
    [WARNING, CCS, b"\x15\x00\x00\x00\x02\x01\x00", b"\x15\x0f\x03\x00\x02\x02\x28"]
)


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_record_layer_variants_agree_with_the_lenient_receiver(
    hellos: dict[str, bytes], data: st.DataObject
) -> None:
    message = handshake_message(hellos[data.draw(st.sampled_from(sorted(hellos)))])
    cuts = data.draw(st.lists(st.integers(1, len(message) - 1), max_size=6))
    points = [0, *sorted(set(cuts)), len(message)]
    stream = b""
    for start, end in itertools.pairwise(points):
        stream += data.draw(st.lists(SKIPPABLE, max_size=3).map(b"".join))
        stream += records(message[start:end], [], data.draw(RECORD_VERSIONS))
    assert_agrees_with_the_lenient_receiver(stream)
    assert summary(feed_all(split(stream, cuts))) == summary(ClientHelloReader().feed(stream))


@settings(max_examples=1000, deadline=None)
@given(
    first=st.integers(20, 24),
    version=st.binary(min_size=2, max_size=2),
    rest=st.binary(max_size=300),
)
def test_anything_that_starts_like_a_record_agrees_with_the_lenient_receiver(
    first: int, version: bytes, rest: bytes
) -> None:
    assert_agrees_with_the_lenient_receiver(bytes([first]) + version + rest)
