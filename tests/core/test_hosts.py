"""Host and port normalization (DESIGN §3.1): tables of exact outcomes, then properties.

The test may use `socket` (to ask the C library what it would accept); the
module under test must not (see test_imports.py).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import string
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressbox.core.errors import HostError, Reason
from egressbox.core.hosts import (
    MAX_NAME_LENGTH,
    Host,
    canonical_ip_text,
    check_port,
    format_authority,
    normalize_host,
    parse_authority,
    parse_ip_endpoint,
    parse_port,
    split_authority,
)
from egressbox.core.ip import IPAddress

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address

# Characters a normalized name may contain (DESIGN §3.1).
NAME_CHARS = frozenset(string.ascii_lowercase + string.digits + "-_.")
# What the C library (and WHATWG's URL parser) reads as a number when it is
# the last label: decimal digits, or 0x followed by hex digits (maybe none).
NUMERIC_LABEL = re.compile(r"[0-9]+|0[xX][0-9a-fA-F]*")


def _ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def _fw(text: str) -> str:
    """The fullwidth form (U+FF01-U+FF5E) of printable ASCII text."""
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


def _max_name(extra: int = 0) -> str:
    """A name of exactly 253 + extra characters, made of 63-character labels."""
    name = ".".join(["a" * 63] * 3 + ["b" * (61 + extra)])
    assert len(name) == MAX_NAME_LENGTH + extra
    return name


# --------------------------------------------------------------------------
# normalize_host: accepted spellings and their exact canonical form
# --------------------------------------------------------------------------

ACCEPTED_NAMES: list[tuple[str, str]] = [
    ("example.com", "example.com"),
    ("EXAMPLE.Com", "example.com"),
    ("example.com.", "example.com"),  # one trailing dot stripped
    ("localhost", "localhost"),
    ("_dmarc.example.com", "_dmarc.example.com"),
    ("foo_bar.s3.amazonaws.com", "foo_bar.s3.amazonaws.com"),
    ("r3---sn-abc.googlevideo.com", "r3---sn-abc.googlevideo.com"),  # real YouTube host
    ("1e100.net", "1e100.net"),
    ("123.example.com", "123.example.com"),  # numeric labels are fine before the last
    ("example.0xg", "example.0xg"),  # not a number: 'g' is no hex digit
    ("a.b1", "a.b1"),
    # UTS 46, non-transitional: ß and ς stay themselves.
    ("straße", "xn--strae-oqa"),
    ("straße.de", "xn--strae-oqa.de"),
    ("Straße.DE", "xn--strae-oqa.de"),
    ("STRASSE.de", "strasse.de"),
    ("ελλάς.gr", "xn--hxarsa0b.gr"),  # final sigma kept (transitional: xn--hxarsa5b)
    ("ΕΛΛΆΣ.gr", "xn--hxarsa5b.gr"),  # capital sigma maps to the medial sigma
    ("bücher.de", "xn--bcher-kva.de"),
    ("BÜCHER.DE", "xn--bcher-kva.de"),
    ("xn--bcher-kva.de", "xn--bcher-kva.de"),
    ("XN--BCHER-KVA.DE", "xn--bcher-kva.de"),
    ("xn--strae-oqa", "xn--strae-oqa"),
    ("münchen.xn--p1ai", "xn--mnchen-3ya.xn--p1ai"),
    ("ü.com", "xn--tda.com"),
    (_fw("example.com"), "example.com"),  # fullwidth letters and full stop
    ("example。com", "example.com"),  # ideographic full stop
    (_fw("a_b") + ".com", "a_b.com"),  # fullwidth low line maps to "_"
    ("exa\u00admple.com", "example.com"),  # soft hyphen is ignored by UTS 46
    ("x" * 63 + ".com", "x" * 63 + ".com"),  # longest label
    (_max_name(), _max_name()),  # longest name
    (_max_name() + ".", _max_name()),  # ... with its trailing dot
]

ACCEPTED_IPS: list[tuple[str, str]] = [
    ("127.0.0.1", "127.0.0.1"),
    ("127.0.0.1.", "127.0.0.1"),
    ("0.0.0.0", "0.0.0.0"),
    ("255.255.255.255", "255.255.255.255"),
    ("8.8.8.8", "8.8.8.8"),
    # WHATWG does the same: UTS 46 maps fullwidth digits and dots to ASCII,
    # and the result is judged as the address it spells.
    (_fw("127.0.0.1"), "127.0.0.1"),
    ("::1", "::1"),
    ("[::1]", "::1"),
    ("::", "::"),
    ("[::]", "::"),
    ("0:0:0:0:0:0:0:1", "::1"),
    ("2001:DB8::1", "2001:db8::1"),
    ("[2001:0db8:0000:0000:0000:0000:0000:0001]", "2001:db8::1"),
    ("2001:db8:0:0:1:0:0:1", "2001:db8::1:0:0:1"),  # RFC 5952 §4.2.3: first run
    ("2001:0:0:1:0:0:0:1", "2001:0:0:1::1"),  # ... longest run
    ("2001:db8:0:1:1:1:1:1", "2001:db8:0:1:1:1:1:1"),  # §4.2.2: no :: for one field
    ("::ffff:127.0.0.1", "::ffff:127.0.0.1"),  # §5: mapped in mixed notation
    ("::FFFF:7F00:1", "::ffff:127.0.0.1"),
    ("[::ffff:7f00:1]", "::ffff:127.0.0.1"),
    ("::127.0.0.1", "::7f00:1"),  # compatible: plain hex
    ("::ffff:0:127.0.0.1", "::ffff:0:7f00:1"),  # translated: plain hex
    ("64:ff9b::127.0.0.1", "64:ff9b::7f00:1"),
    ("fe80::1", "fe80::1"),
]

REFUSED_HOSTS: list[str] = [
    # structure
    "",
    ".",
    "..",
    ".example.com",
    "example..com",
    "example.com..",
    "-a.com",
    "a-.com",
    "a.-b.com",
    "x" * 64 + ".com",  # label of 64
    _max_name(1),  # name of 254
    _max_name(1) + ".",
    "a" * 1025,
    # ASCII outside letters, digits, '-', '_', '.'
    "a b.com",
    " example.com",
    "example.com ",
    "exa\tmple.com",
    "exa\nmple.com",
    "a\x00b.com",
    "a/b.com",
    "a@b.com",
    "a%b.com",
    "a!b.com",
    "a*b.com",
    "*.example.com",
    "a+b.com",
    "a,b.com",
    "a\\b.com",
    "a'b.com",
    "a:b",
    "example.com:80",  # an authority is not a host
    # numeric spellings the C library reads as addresses
    "127.1",
    "2130706433",
    "0x7f.1",
    "0X7F.1",
    "0177.0.0.1",
    "1.2.3.4.5",
    "01.2.3.4",
    "127.0.0.01",
    "127.00.0.1",
    "0x7f000001",
    "0x7f.0.0.1",
    "127.0.0.0x1",
    "1.0x7f",
    "08.1.2.3",
    "1.2.3",
    "0",
    "00",
    "4294967295",
    "4294967296",
    "256.0.0.1",
    "1.2.3.256",
    "999.1.1.1",
    "127.0.0.1..",
    "127.0.0.1 x",  # glibc's inet_aton stops at a space and accepts this
    "example.123",
    "example.0x",
    "example.0x1f",
    _fw("127.1"),  # fullwidth, maps to 127.1
    # UTS 46 maps these to ASCII punctuation, which we refuse
    "a\uff0fb.com",  # FULLWIDTH SOLIDUS -> "/"
    "a\uff20b.com",  # FULLWIDTH COMMERCIAL AT -> "@"
    "a\uff05b.com",  # FULLWIDTH PERCENT SIGN -> "%"
    "a\uff1ab.com",  # FULLWIDTH COLON -> ":"
    "\u2100.com",  # ACCOUNT OF -> "a/c"
    "\u2474.com",  # PARENTHESIZED DIGIT ONE -> "(1)"
    "a\ufe6bb.com",  # SMALL COMMERCIAL AT -> "@"
    "a\u3000b.com",  # IDEOGRAPHIC SPACE -> " "
    "a\u00a0b.com",  # NO-BREAK SPACE -> " "
    _fw("a/b") + ".com",
    # what Python's built-in idna codec lets through
    "ü b.com",
    "ü/b.com",
    "ü@b.com",
    "ü%b.com",
    "ü:b.com",
    # invalid IDNA labels
    "\u0301a.com",  # leading combining mark
    "a\u200db.com",  # ZWJ out of context
    "\u05d0a.com",  # bidi rule
    "\U0001f600.com",  # emoji
    "ü_x.com",  # "_" is not PVALID inside a U-label
    "\u00ad",  # only an ignored character: empty
    # A-labels that do not round-trip
    "xn--",
    "xn--a",
    "xn---bbk",  # fake A-label (non-canonical punycode)
    "xn--abc-",  # decodes to plain ASCII
    "xn--ss-",
    "xn--wca",  # decodes to "Ü": not a valid U-label (uppercase)
    "xn--tda9921k",  # decodes to fullwidth "ａü": disallowed
    "xn--a-ecp.ru",
    "xn--zca.xn--a",
    # IPv6 text
    "[::1",
    "::1]",
    "[]",
    "[[::1]]",
    "[127.0.0.1]",
    "[example.com]",
    "[::1].",
    "[::1]:80",
    ":::1",
    "1:2:3:4:5:6:7:8:9",
    "2001:db8::g",
    "12345::1",
    "::ffff:127.1",
    "::ffff:0177.0.0.1",
    "::ffff:1.2.3.4.5",
    "::\uff11",  # fullwidth digit one
    # zone ids
    "fe80::1%eth0",
    "fe80::1%25eth0",
    "[fe80::1%eth0]",
    "[fe80::1%25eth0]",
    "[fe80::1%]",
]


@pytest.mark.parametrize(("raw", "expected"), ACCEPTED_NAMES)
def test_normalize_host_accepts_names(raw: str, expected: str) -> None:
    assert normalize_host(raw) == Host(expected)
    assert not normalize_host(raw).is_ip


@pytest.mark.parametrize(("raw", "expected"), ACCEPTED_IPS)
def test_normalize_host_accepts_ip_literals(raw: str, expected: str) -> None:
    host = normalize_host(raw)
    assert host == Host(expected, _ip(expected))
    assert host.is_ip


@pytest.mark.parametrize("raw", REFUSED_HOSTS)
def test_normalize_host_refuses(raw: str) -> None:
    with pytest.raises(HostError) as info:
        normalize_host(raw)
    assert info.value.reason is Reason.BAD_HOST


def test_builtin_idna_codec_is_not_enough() -> None:
    # The reason hosts.py does not use str.encode("idna"): it passes these.
    assert "a b.com".encode("idna") == b"a b.com"
    assert "ü/b@c%d.com".encode("idna").startswith(b"xn--")
    assert "straße.de".encode("idna") == b"strasse.de"


def test_every_compatibility_character_for_ascii_punctuation_is_refused() -> None:
    # Any character whose compatibility form contains ASCII other than letters,
    # digits, '-', '_' and '.' (fullwidth "/", "@", "%", spaces, "a/c", "(1)"...)
    # must never turn into that ASCII inside a name.
    allowed = set(string.ascii_letters + string.digits + "-_.")
    checked = 0
    for code_point in range(0x80, 0x30000):
        char = chr(code_point)
        compat = unicodedata.normalize("NFKC", char)
        if not any(c.isascii() and c not in allowed for c in compat):
            continue
        checked += 1
        with pytest.raises(HostError) as info:
            normalize_host(f"a{char}b.example")
        assert info.value.reason is Reason.BAD_HOST, hex(code_point)
    assert checked > 200  # the scan really found the fullwidth and compatibility forms


@pytest.mark.parametrize(
    "raw",
    [
        "SECRET@example.com",
        "example.com/SECRET",
        "SECRET%41",
        "[SECRET]",
        "xn--SECRET",
        "SECRET" * 50,
    ],
)
def test_refusal_never_echoes_the_raw_text(raw: str) -> None:
    with pytest.raises(HostError) as info:
        normalize_host(raw.replace("SECRET", "s3cr3t pw"))
    assert "s3cr3t" not in str(info.value)


# --------------------------------------------------------------------------
# canonical_ip_text, format_authority
# --------------------------------------------------------------------------

CANONICAL_TEXT: list[tuple[str, str]] = [
    ("192.0.2.1", "192.0.2.1"),
    ("0.0.0.0", "0.0.0.0"),
    ("::", "::"),
    ("::1", "::1"),
    ("1::", "1::"),
    ("2001:0DB8::0001", "2001:db8::1"),
    ("2001:db8:0:0:1:0:0:1", "2001:db8::1:0:0:1"),
    ("2001:0:0:1:0:0:0:1", "2001:0:0:1::1"),
    ("2001:db8:0:1:1:1:1:1", "2001:db8:0:1:1:1:1:1"),
    ("2001:db8:aaaa:bbbb:cccc:dddd:eeee:aaaa", "2001:db8:aaaa:bbbb:cccc:dddd:eeee:aaaa"),
    ("::ffff:192.0.2.1", "::ffff:192.0.2.1"),
    ("::ffff:c000:201", "::ffff:192.0.2.1"),
    ("::ffff:0.0.0.0", "::ffff:0.0.0.0"),
    ("::ffff:0:c000:201", "::ffff:0:c000:201"),
    ("::c000:201", "::c000:201"),
]


@pytest.mark.parametrize(("raw", "expected"), CANONICAL_TEXT)
def test_canonical_ip_text(raw: str, expected: str) -> None:
    assert canonical_ip_text(_ip(raw)) == expected


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("example.com", 443, "example.com:443"),
        ("127.0.0.1", 80, "127.0.0.1:80"),
        ("::1", 8080, "[::1]:8080"),
        ("::ffff:127.0.0.1", 1, "[::ffff:127.0.0.1]:1"),
        ("::1", None, "[::1]"),
        ("example.com", None, "example.com"),
    ],
)
def test_format_authority(host: str, port: int | None, expected: str) -> None:
    assert format_authority(host, port) == expected
    if port is not None:
        assert normalize_host(host).authority(port) == expected


# --------------------------------------------------------------------------
# Ports
# --------------------------------------------------------------------------

ACCEPTED_PORTS: list[tuple[str, int]] = [
    ("1", 1),
    ("80", 80),
    ("443", 443),
    ("65535", 65535),
    ("00080", 80),  # five ASCII digits
    ("00001", 1),
]

REFUSED_PORTS: list[str] = [
    "",
    "0",
    "00000",
    "65536",
    "99999",
    "000080",  # six digits
    "100000",
    "+80",
    "-80",
    "-0",
    " 80",
    "80 ",
    "8 0",
    "80\n",
    "\t80",
    "0x50",
    "0o120",
    "0b1",
    "8_0",
    "80.0",
    "1e3",
    "http",
    "eighty",
    _fw("80"),  # fullwidth digits
    "²",  # superscript two: str.isdigit() says True
    "٨٠",  # Arabic-Indic digits: int() accepts them
    "\U0001d7d6\U0001d7ce",  # mathematical bold digits
    "80:90",
]


@pytest.mark.parametrize(("text", "expected"), ACCEPTED_PORTS)
def test_parse_port_accepts(text: str, expected: int) -> None:
    assert parse_port(text) == expected


@pytest.mark.parametrize("text", REFUSED_PORTS)
def test_parse_port_refuses(text: str) -> None:
    with pytest.raises(HostError) as info:
        parse_port(text)
    assert info.value.reason is Reason.BAD_PORT


@given(st.text(max_size=7) | st.from_regex(r"[0-9]{1,6}", fullmatch=True))
def test_parse_port_takes_one_to_five_ascii_digits_1_to_65535(text: str) -> None:
    wanted = re.fullmatch(r"[0-9]{1,5}", text) is not None and 1 <= int(text) <= 65535
    try:
        port = parse_port(text)
    except HostError as exc:
        assert not wanted
        assert exc.reason is Reason.BAD_PORT
    else:
        assert wanted
        assert port == int(text)


@pytest.mark.parametrize("port", [1, 80, 65535])
def test_check_port_accepts(port: int) -> None:
    assert check_port(port) == port


@pytest.mark.parametrize("port", [0, -1, 65536, 2**32])
def test_check_port_refuses(port: int) -> None:
    with pytest.raises(HostError) as info:
        check_port(port)
    assert info.value.reason is Reason.BAD_PORT


# --------------------------------------------------------------------------
# Authorities
# --------------------------------------------------------------------------

SPLIT_ACCEPTED: list[tuple[str, tuple[str, str | None]]] = [
    ("example.com", ("example.com", None)),
    ("example.com:443", ("example.com", "443")),
    ("1.2.3.4:80", ("1.2.3.4", "80")),
    ("[::1]", ("[::1]", None)),
    ("[::1]:8080", ("[::1]", "8080")),
    ("[2001:db8::1]:443", ("[2001:db8::1]", "443")),
    ("host:", ("host", "")),  # the empty port is refused later, by parse_port
    ("[::1]:", ("[::1]", "")),
    ("[::1]:80:90", ("[::1]", "80:90")),  # refused later, by parse_port
    (":80", ("", "80")),  # refused later, by normalize_host
]

SPLIT_REFUSED: list[str] = [
    "user@example.com",
    "user:password@example.com:443",
    "@example.com",
    "[::1]@example.com",
    "[::1",
    "[::1]x",
    "[::1]]:80",
    "[::1]80",
    "::1",
    "2001:db8::1:443",
    "a:b:c",
    "example.com:80:90",
]


@pytest.mark.parametrize(("text", "expected"), SPLIT_ACCEPTED)
def test_split_authority(text: str, expected: tuple[str, str | None]) -> None:
    assert split_authority(text) == expected


@pytest.mark.parametrize("text", SPLIT_REFUSED)
def test_split_authority_refuses(text: str) -> None:
    with pytest.raises(HostError) as info:
        split_authority(text)
    assert info.value.reason is Reason.BAD_HOST


PARSE_ACCEPTED: list[tuple[str, int | None, Host, int]] = [
    ("example.com:443", None, Host("example.com"), 443),
    ("EXAMPLE.com.:80", None, Host("example.com"), 80),
    ("bücher.de:65535", None, Host("xn--bcher-kva.de"), 65535),
    ("127.0.0.1:1", None, Host("127.0.0.1", V4("127.0.0.1")), 1),
    ("127.0.0.1.:8080", None, Host("127.0.0.1", V4("127.0.0.1")), 8080),
    ("[::1]:8080", None, Host("::1", V6("::1")), 8080),
    ("[::FFFF:127.0.0.1]:443", None, Host("::ffff:127.0.0.1", V6("::ffff:7f00:1")), 443),
    ("example.com", 443, Host("example.com"), 443),
    ("[::1]", 80, Host("::1", V6("::1")), 80),
    ("example.com:8443", 443, Host("example.com"), 8443),  # explicit port wins
]

PARSE_REFUSED: list[tuple[str, int | None, Reason]] = [
    ("example.com", None, Reason.BAD_PORT),
    ("example.com", 0, Reason.BAD_PORT),
    ("example.com", 65536, Reason.BAD_PORT),
    ("example.com:", 443, Reason.BAD_PORT),
    ("example.com:0", None, Reason.BAD_PORT),
    ("example.com:65536", None, Reason.BAD_PORT),
    ("example.com:+80", None, Reason.BAD_PORT),
    ("example.com:-1", None, Reason.BAD_PORT),
    ("example.com: 80", None, Reason.BAD_PORT),
    ("example.com:80 ", None, Reason.BAD_PORT),
    ("example.com:0x50", None, Reason.BAD_PORT),
    ("example.com:http", None, Reason.BAD_PORT),
    ("example.com:" + _fw("80"), None, Reason.BAD_PORT),
    ("example.com:²", None, Reason.BAD_PORT),
    ("[::1]:", None, Reason.BAD_PORT),
    ("[::1]:80:90", None, Reason.BAD_PORT),
    ("127.1:80", None, Reason.BAD_HOST),
    ("0x7f.1:80", None, Reason.BAD_HOST),
    ("user@example.com:80", None, Reason.BAD_HOST),
    ("user:pw@example.com", 80, Reason.BAD_HOST),
    ("[fe80::1%25eth0]:80", None, Reason.BAD_HOST),
    ("[fe80::1%eth0]", 80, Reason.BAD_HOST),
    (":80", None, Reason.BAD_HOST),
    ("::1", 80, Reason.BAD_HOST),
    ("[127.0.0.1]:80", None, Reason.BAD_HOST),
    ("a b.com:80", None, Reason.BAD_HOST),
    ("", 80, Reason.BAD_HOST),
]


@pytest.mark.parametrize(("text", "default", "host", "port"), PARSE_ACCEPTED)
def test_parse_authority(text: str, default: int | None, host: Host, port: int) -> None:
    assert parse_authority(text, default) == (host, port)


@pytest.mark.parametrize(("text", "default", "reason"), PARSE_REFUSED)
def test_parse_authority_refuses(text: str, default: int | None, reason: Reason) -> None:
    with pytest.raises(HostError) as info:
        parse_authority(text, default)
    assert info.value.reason is reason


ENDPOINT_ACCEPTED: list[tuple[str, IPAddress, int]] = [
    ("8.8.8.8", V4("8.8.8.8"), 53),
    ("8.8.8.8:5353", V4("8.8.8.8"), 5353),
    ("2001:db8::1", V6("2001:db8::1"), 53),
    ("2001:DB8:0:0::1", V6("2001:db8::1"), 53),
    ("[2001:db8::1]", V6("2001:db8::1"), 53),
    ("[2001:db8::1]:5353", V6("2001:db8::1"), 5353),
    ("::1", V6("::1"), 53),
    ("::ffff:1.2.3.4", V6("::ffff:102:304"), 53),
]

ENDPOINT_REFUSED: list[tuple[str, Reason]] = [
    ("example.com", Reason.BAD_HOST),
    ("example.com:53", Reason.BAD_HOST),
    ("127.1", Reason.BAD_HOST),
    ("2130706433:53", Reason.BAD_HOST),
    ("fe80::1%eth0", Reason.BAD_HOST),
    ("[fe80::1%25eth0]:53", Reason.BAD_HOST),
    ("", Reason.BAD_HOST),
    ("8.8.8.8:0", Reason.BAD_PORT),
    ("8.8.8.8:x", Reason.BAD_PORT),
    ("8.8.8.8:", Reason.BAD_PORT),
    ("[::1]:65536", Reason.BAD_PORT),
]


@pytest.mark.parametrize(("text", "ip", "port"), ENDPOINT_ACCEPTED)
def test_parse_ip_endpoint(text: str, ip: IPAddress, port: int) -> None:
    assert parse_ip_endpoint(text, 53) == (ip, port)


@pytest.mark.parametrize(("text", "reason"), ENDPOINT_REFUSED)
def test_parse_ip_endpoint_refuses(text: str, reason: Reason) -> None:
    with pytest.raises(HostError) as info:
        parse_ip_endpoint(text, 53)
    assert info.value.reason is reason


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------

_LABEL_ALPHABET = string.ascii_letters + string.digits + "-_"

dns_labels = st.text(alphabet=_LABEL_ALPHABET, min_size=1, max_size=63).filter(
    lambda s: not s.startswith("-") and not s.endswith("-") and not s.lower().startswith("xn--")
)


@st.composite
def dns_names(draw: st.DrawFn) -> str:
    """A valid name: 1-63 character labels of [A-Za-z0-9_-], no leading/trailing
    hyphen, at most 253 characters, last label not a number."""
    labels = draw(st.lists(dns_labels, min_size=1, max_size=8))
    if NUMERIC_LABEL.fullmatch(labels[-1]):
        labels.append(draw(st.sampled_from(["com", "example", "_tcp", "a1", "x-y"])))
    while len(".".join(labels)) > MAX_NAME_LENGTH:
        labels.pop(0)
    name = ".".join(labels)
    return name + draw(st.sampled_from(["", "."]))


_TRICKY = [
    *"abcXYZ019-_.:[]%@/ \t",
    *"ßüÜςΣıİ\uff41\uff11\uff0e。｡\u00ad\u200d\u200c\u0301\uff0f\uff20\u2100\u3000\u05d0ⅷ",
    "xn--",
    "0x",
]
host_like_text = st.lists(st.sampled_from(_TRICKY), max_size=24).map("".join)

ip_texts = st.ip_addresses().flatmap(
    lambda ip: st.sampled_from([str(ip), ip.exploded, ip.exploded.upper(), f"[{ip}]", f"{ip}."])
)

any_host_text = st.one_of(
    st.text(),
    st.binary().map(lambda b: b.decode("latin-1")),
    host_like_text,
    dns_names(),
    ip_texts,
)


def rfc5952(ip: IPAddress) -> str:
    """RFC 5952 text, written independently of ipaddress's own formatting."""
    packed = ip.packed
    if ip.version == 4:
        return ".".join(str(b) for b in packed)
    if packed[:12] == bytes(10) + b"\xff\xff":
        return "::ffff:" + ".".join(str(b) for b in packed[12:])
    fields = [int.from_bytes(packed[i : i + 2], "big") for i in range(0, 16, 2)]
    best_start, best_len = -1, 1  # runs of one zero field are never compressed
    i = 0
    while i < 8:
        if fields[i] == 0:
            j = i
            while j < 8 and fields[j] == 0:
                j += 1
            if j - i > best_len:
                best_start, best_len = i, j - i
            i = j
        else:
            i += 1
    hexes = [format(f, "x") for f in fields]
    if best_start < 0:
        return ":".join(hexes)
    head = ":".join(hexes[:best_start])
    tail = ":".join(hexes[best_start + best_len :])
    return f"{head}::{tail}"


def _check_host_shape(host: Host) -> None:
    """Every accepted host: canonical IP text, or a plain ASCII name."""
    if host.ip is not None:
        assert host.text == rfc5952(host.ip)
        return
    assert 1 <= len(host.text) <= MAX_NAME_LENGTH
    assert set(host.text) <= NAME_CHARS
    labels = host.text.split(".")
    assert all(1 <= len(label) <= 63 for label in labels)
    assert all(not label.startswith("-") and not label.endswith("-") for label in labels)
    assert not NUMERIC_LABEL.fullmatch(labels[-1])


@settings(max_examples=1000)
@given(any_host_text)
def test_normalize_is_idempotent(raw: str) -> None:
    try:
        host = normalize_host(raw)
    except HostError:
        return
    assert normalize_host(host.text) == host


@settings(max_examples=1000)
@given(st.one_of(st.text(), st.binary().map(lambda b: b.decode("latin-1")), host_like_text))
def test_random_text_gives_a_host_or_a_host_error(raw: str) -> None:
    try:
        host = normalize_host(raw)
    except HostError as error:
        assert error.reason is Reason.BAD_HOST
        return
    _check_host_shape(host)


@settings(max_examples=500)
@given(st.one_of(st.text(), host_like_text, st.binary().map(lambda b: b.decode("latin-1"))))
def test_random_authority_gives_a_result_or_a_host_error(raw: str) -> None:
    for call in (
        lambda: parse_authority(raw, None),
        lambda: parse_authority(raw, 443),
        lambda: parse_ip_endpoint(raw, 53),
    ):
        try:
            call()
        except HostError as error:
            assert error.reason in (Reason.BAD_HOST, Reason.BAD_PORT)


@settings(max_examples=1000)
@given(dns_names())
def test_valid_dns_names_normalize_to_themselves_lowercased(name: str) -> None:
    host = normalize_host(name)
    assert host == Host(name.removesuffix(".").lower())


@settings(max_examples=1000)
@given(st.ip_addresses())
def test_ip_addresses_normalize_to_themselves(ip: IPAddress) -> None:
    expected = rfc5952(ip)
    assert canonical_ip_text(ip) == expected
    spellings = [str(ip), ip.exploded, ip.exploded.upper(), expected]
    if ip.version == 6:
        spellings += [f"[{s}]" for s in spellings]
    else:
        spellings.append(f"{ip}.")
    for spelling in spellings:
        host = normalize_host(spelling)
        assert host == Host(expected, ip)
        assert type(host.ip) is type(ip)


@settings(max_examples=500)
@given(st.ip_addresses(), st.integers(1, 65535))
def test_authority_round_trips(ip: IPAddress, port: int) -> None:
    host = normalize_host(str(ip))
    assert parse_authority(host.authority(port)) == (host, port)
    assert parse_ip_endpoint(host.authority(port), 53) == (ip, port)


@settings(max_examples=500)
@given(dns_names(), st.integers(1, 65535))
def test_name_authority_round_trips(name: str, port: int) -> None:
    host = normalize_host(name)
    assert parse_authority(f"{name}:{port}") == (host, port)


def _spell(value: int, style: str, zeros: int, upper: bool) -> str:
    if style == "dec":
        return str(value)
    if style == "oct":
        return "0" * (zeros + 1) + format(value, "o")
    digits = "0" * zeros + format(value, "X" if upper else "x")
    return ("0X" if upper else "0x") + digits


@st.composite
def numeric_spellings(draw: st.DrawFn) -> tuple[str, int]:
    """inet_aton's grammar: 1-4 parts, each decimal, octal or hex; the last
    part fills the remaining bytes. Returns the text and its 32-bit value."""
    count = draw(st.integers(1, 4))
    head = [draw(st.integers(0, 255)) for _ in range(count - 1)]
    last = draw(st.integers(0, 2 ** (8 * (5 - count)) - 1))
    value = 0
    for part in head:
        value = (value << 8) | part
    value = (value << (8 * (5 - count))) | last
    parts = [
        _spell(
            part,
            draw(st.sampled_from(["dec", "dec", "oct", "hex"])),
            draw(st.integers(0, 2)),
            draw(st.booleans()),
        )
        for part in [*head, last]
    ]
    return ".".join(parts), value


@settings(max_examples=1000)
@given(numeric_spellings())
def test_numeric_spellings_the_c_library_accepts_are_refused(spelling: tuple[str, int]) -> None:
    text, value = spelling
    # The C library reads this text as the address `value`...
    assert socket.inet_aton(text) == value.to_bytes(4, "big")
    canonical = str(ipaddress.IPv4Address(value))
    for candidate in (text, f"{text}."):
        if candidate.removesuffix(".") == canonical:
            # ...and the one canonical dotted quad is simply that address.
            assert normalize_host(candidate) == Host(canonical, ipaddress.IPv4Address(value))
            continue
        # ...every other spelling is refused, never passed on as a name.
        with pytest.raises(HostError) as info:
            normalize_host(candidate)
        assert info.value.reason is Reason.BAD_HOST


def _is_valid_port(text: str) -> bool:
    return 1 <= len(text) <= 5 and all(c in "0123456789" for c in text) and 1 <= int(text) <= 65535


port_like = st.one_of(
    st.text(),
    st.text(alphabet="0123456789", max_size=7),
    st.text(alphabet="0123456789+- \t\n_x.\uff18²٨\U0001d7d6\u0660", max_size=7),
    st.integers(-100, 100_000).map(str),
)


@settings(max_examples=1000)
@given(port_like)
def test_parse_port_accepts_only_short_ascii_decimals_in_range(text: str) -> None:
    if _is_valid_port(text):
        assert parse_port(text) == int(text)
        return
    with pytest.raises(HostError) as info:
        parse_port(text)
    assert info.value.reason is Reason.BAD_PORT
