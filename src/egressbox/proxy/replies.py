"""Errors and decisions mapped to replies, in one place (HTTP status, SOCKS5 code).

Pure. Every denial answers with the same reason code the audit record and
the diagnostic line carry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from egressbox.core.errors import Reason

if TYPE_CHECKING:
    import asyncio

# After a refusal, read and drop what the client still sends for this long (and at
# most this much) before closing: closing with unread data would reset the connection
# under the reply (nginx's lingering_close does the same). Literal Finals: the compiled
# modules that read them get the numbers, not a lookup.
LINGER_SECONDS: Final = 2.0
LINGER_BYTES: Final = 262_144  # 256 KiB

# Reasons that are not policy denials of the destination.
_HTTP_STATUS = {
    Reason.DNS_FAILURE: 502,
    Reason.DNS_TIMEOUT: 504,
    Reason.TOO_MANY_CONNECTIONS: 503,
    Reason.AUDIT_UNAVAILABLE: 503,
}
# SOCKS5 reply codes (RFC 1928 §6).
SOCKS_GENERAL_FAILURE = 0x01
SOCKS_NOT_ALLOWED = 0x02
SOCKS_NETWORK_UNREACHABLE = 0x03
SOCKS_HOST_UNREACHABLE = 0x04
SOCKS_CONNECTION_REFUSED = 0x05
_SOCKS_CODE = {
    Reason.DNS_FAILURE: SOCKS_HOST_UNREACHABLE,
    Reason.DNS_TIMEOUT: SOCKS_HOST_UNREACHABLE,
    Reason.TOO_MANY_CONNECTIONS: SOCKS_GENERAL_FAILURE,
    Reason.AUDIT_UNAVAILABLE: SOCKS_GENERAL_FAILURE,
}

# Upstream connect failures (dial.DialFailure values) after an allow decision.
_DIAL_HTTP = {
    "connect_refused": 502,
    "connect_timeout": 504,
    "network_unreachable": 502,
    "connect_failed": 502,
}
_DIAL_SOCKS = {
    "connect_refused": SOCKS_CONNECTION_REFUSED,
    "connect_timeout": SOCKS_HOST_UNREACHABLE,
    "network_unreachable": SOCKS_NETWORK_UNREACHABLE,
    "connect_failed": SOCKS_GENERAL_FAILURE,
}


def http_status(reason: Reason) -> int:
    """403 for a policy denial; 502/504 for DNS; 503 when the proxy cannot serve."""
    return _HTTP_STATUS.get(reason, 403)


def socks_code(reason: Reason) -> int:
    """0x02 (not allowed by ruleset) for a policy denial; see RFC 1928 §6."""
    return _SOCKS_CODE.get(reason, SOCKS_NOT_ALLOWED)


def dial_http_status(failure: str) -> int:
    return _DIAL_HTTP.get(failure, 502)


def dial_socks_code(failure: str) -> int:
    return _DIAL_SOCKS.get(failure, SOCKS_GENERAL_FAILURE)


def send_final(transport: asyncio.Transport, reply: bytes) -> bool:
    """Write the last reply and half-close, the start of a lingering close (both the
    listeners' refusals and plain HTTP forwarding's). False when the client is already
    gone: over loopback its reset can arrive within the write (ENOTCONN on write_eof)."""
    transport.write(reply)
    if transport.can_write_eof():
        try:
            transport.write_eof()
        except OSError:
            return False
    return True
