"""Host and port normalization: the one spelling every other part compares.

Pure (no I/O): requests, policy entries and DNS answers all pass through the
same functions, so a name can never match in one place and differ in another.

Why so strict: the C library and many HTTP stacks read `127.1`, `2130706433`,
`0x7f.1` and `0177.0.0.1` as IP addresses. If such a spelling reached DNS or
the OS, a policy written for names could be bypassed, so every numeric
spelling other than canonical dotted-quad or RFC 4291 text is `bad_host`.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

from egressbox.core.errors import HostError, Reason
from egressbox.core.ip import IPAddress

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_BAD_HOST: Final = Reason.BAD_HOST
_BAD_PORT: Final = Reason.BAD_PORT


# RFC 1035 §2.3.4: 255 octets on the wire, i.e. 253 characters of text
# without the trailing dot; 63 octets per label.
MAX_NAME_LENGTH: Final = 253
MAX_LABEL_LENGTH: Final = 63
# Longest text we even look at: a bound on work for hostile input.
MAX_INPUT_LENGTH: Final = 1024

# Letters, digits, hyphen, and underscore (used by real service names such as
# `_dmarc` or `foo_bar.s3.amazonaws.com`, though STD3 forbids it).
_LABEL_RE: Final = re.compile(r"[a-z0-9_-]+")
# A label the C library would read as a number: decimal, octal or hex.
_NUMERIC_LABEL_RE: Final = re.compile(r"(?:[0-9]+|0[xX][0-9a-fA-F]*)")
_DECIMAL_OCTET_RE: Final = re.compile(r"(?:0|[1-9][0-9]{0,2})")

INVALID_HOST_TEXT = "(invalid)"


@dataclass(frozen=True, slots=True)
class Host:
    """A normalized host: a DNS name (ASCII, lowercase) or an IP address."""

    text: str
    ip: IPAddress | None = None

    @property
    def is_ip(self) -> bool:
        return self.ip is not None

    def authority(self, port: int) -> str:
        """`host:port`, with brackets around an IPv6 address."""
        return format_authority(self.text, port)


def format_authority(host: str, port: int | None) -> str:
    """`host:port`, an IPv6 address always in brackets (as written in a policy)."""
    text = f"[{host}]" if ":" in host else host
    return text if port is None else f"{text}:{port}"


def _bad(raw: str, why: str) -> HostError:
    # The raw text is never echoed: it could carry a credential or a path.
    del raw
    return HostError(_BAD_HOST, f"bad host: {why}")


def normalize_host(raw: str) -> Host:
    """Return the canonical form of a host, or raise HostError(bad_host)."""
    if not raw:
        raise _bad(raw, "empty host")
    if len(raw) > MAX_INPUT_LENGTH:
        raise _bad(raw, "host is too long")
    if raw.startswith("[") or raw.endswith("]"):
        return Host(*_bracketed_ipv6(raw))
    if ":" in raw:
        return Host(*_bare_ipv6(raw))
    return _name_or_ipv4(raw)


def _bracketed_ipv6(raw: str) -> tuple[str, IPAddress]:
    if not (raw.startswith("[") and raw.endswith("]") and len(raw) > 2):
        raise _bad(raw, "unbalanced brackets")
    return _bare_ipv6(raw[1:-1])


def _bare_ipv6(text: str) -> tuple[str, IPAddress]:
    if "%" in text:
        raise _bad(text, "an IPv6 zone id (%) is not allowed")
    if not text.isascii():
        raise _bad(text, "not an IPv6 address")
    try:
        ip = ipaddress.IPv6Address(text)
    except ValueError:
        raise _bad(text, "not an IPv6 address") from None
    return canonical_ip_text(ip), ip


def canonical_ip_text(ip: IPAddress) -> str:
    """RFC 5952 text; IPv4-mapped addresses in mixed notation (§5)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}"
    return ip.compressed


def _name_or_ipv4(raw: str) -> Host:
    text = raw
    if not text.isascii():
        import idna  # only for a name that is not ASCII: loading it costs ~5 ms

        try:
            # UTS 46 mapping, non-transitional (so "straße" stays itself),
            # without STD3 so that "_" survives; our own label check below
            # refuses the ASCII that STD3 would (space, "/", "@", "%" ...).
            text = idna.uts46_remap(text, std3_rules=False, transitional=False)
        except (idna.IDNAError, UnicodeError, ValueError):
            raise _bad(raw, "not a valid internationalized name") from None
    text = text.removesuffix(".")
    labels = text.split(".")
    if _NUMERIC_LABEL_RE.fullmatch(labels[-1]):
        return _dotted_quad(labels)
    ascii_labels = [_ascii_label(label) for label in labels]
    name = ".".join(ascii_labels)
    if len(name) > MAX_NAME_LENGTH:
        raise _bad(raw, f"name is longer than {MAX_NAME_LENGTH} characters")
    return Host(name)


def _dotted_quad(labels: list[str]) -> Host:
    # A name ending in a numeric label is an address to the C library
    # (WHATWG's URL parser has the same rule); only the canonical four
    # decimal octets are accepted, everything else is ambiguous.
    if len(labels) != 4 or not all(_DECIMAL_OCTET_RE.fullmatch(p) for p in labels):
        raise _bad("", "numeric host is not a canonical dotted-quad IPv4 address")
    if any(int(p) > 255 for p in labels):
        raise _bad("", "IPv4 octet out of range")
    ip = ipaddress.IPv4Address(".".join(labels))
    return Host(str(ip), ip)


def _ascii_label(label: str) -> str:
    if not label:
        raise _bad(label, "empty label")
    if not label.isascii():
        import idna

        try:
            label = idna.alabel(label).decode("ascii")
        except (idna.IDNAError, UnicodeError, ValueError):
            raise _bad(label, "not a valid internationalized label") from None
    label = label.lower()
    if len(label) > MAX_LABEL_LENGTH:
        raise _bad(label, f"label longer than {MAX_LABEL_LENGTH} characters")
    if not _LABEL_RE.fullmatch(label):
        raise _bad(label, "only letters, digits, '-', '_' and '.' are allowed")
    if label.startswith("-") or label.endswith("-"):
        raise _bad(label, "a label cannot start or end with '-'")
    if label.startswith("xn--"):
        _check_round_trip(label)
    return label


def _check_round_trip(label: str) -> None:
    # An A-label must decode to a valid U-label that encodes back to itself;
    # otherwise two spellings could name one host.
    import idna

    try:
        if idna.alabel(idna.ulabel(label)).decode("ascii") != label:
            raise _bad(label, "punycode label does not round-trip")
    except (idna.IDNAError, UnicodeError, ValueError):
        raise _bad(label, "invalid punycode label") from None


def parse_port(text: str) -> int:
    """Return a port 1-65535 from plain ASCII digits, or raise HostError(bad_port)."""
    # One to five ASCII digits (int() alone would take "+1", " 1", "1_0" or other scripts'
    # digits); two str predicates cost a third of a regex match, once per request.
    if not (0 < len(text) <= 5 and text.isascii() and text.isdigit()):
        raise HostError(_BAD_PORT, "bad port: use a decimal number from 1 to 65535")
    port = int(text)
    if not 1 <= port <= 65535:
        raise HostError(_BAD_PORT, "bad port: use a decimal number from 1 to 65535")
    return port


def check_port(port: int) -> int:
    """Validate a numeric port (from SOCKS or a library call)."""
    if not 1 <= port <= 65535:
        raise HostError(_BAD_PORT, "bad port: use a number from 1 to 65535")
    return port


def split_authority(text: str) -> tuple[str, str | None]:
    """Split `host[:port]` / `[v6][:port]` into raw host and raw port text.

    Userinfo (`user@host`) is refused: it would carry a credential.
    """
    if "@" in text:
        raise _bad(text, "userinfo (user@) is not allowed in an authority")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _bad(text, "unbalanced brackets")
        rest = text[end + 1 :]
        if not rest:
            return text[: end + 1], None
        if not rest.startswith(":"):
            raise _bad(text, "unexpected text after ']'")
        return text[: end + 1], rest[1:]
    if text.count(":") > 1:
        raise _bad(text, "an IPv6 address must be written in brackets: [v6]:port")
    host, sep, port = text.partition(":")
    return host, (port if sep else None)


def parse_authority(text: str, default_port: int | None = None) -> tuple[Host, int]:
    """Parse `host:port` (or `[v6]:port`) into a normalized host and a port."""
    raw_host, raw_port = split_authority(text)
    host = normalize_host(raw_host)
    if raw_port is None:
        if default_port is None:
            raise HostError(_BAD_PORT, "bad port: a port is required (host:port)")
        return host, check_port(default_port)
    return host, parse_port(raw_port)


def parse_ip_endpoint(text: str, default_port: int) -> tuple[IPAddress, int]:
    """Parse `IP`, `IP:PORT`, `[v6]` or `[v6]:PORT` (e.g. a DNS server)."""
    if text.count(":") > 1 and not text.startswith("["):
        text = f"[{text}]"
    host, port = parse_authority(text, default_port)
    if host.ip is None:
        raise _bad(text, "an IP address is required here, not a name")
    return host.ip, port
