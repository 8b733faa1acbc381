"""Where a redirected TCP connection was going (nftables `redirect`), read from its socket.

The kernel keeps a captured connection's original destination on the accepted socket
(SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST). Pure over the socket's own methods, so that the proxy
(net/original.py, proxy/listeners.py) and the capture self-test (confine/capture.py) read it
with one function and neither floor imports the other.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Final, Protocol

# <linux/socket.h>, <linux/netfilter_ipv4.h> SO_ORIGINAL_DST and
# <linux/netfilter_ipv6/ip6_tables.h> IP6T_SO_ORIGINAL_DST; sizes of struct sockaddr_in(6).
AF_INET: Final = 2
SOL_IP: Final = 0
SOL_IPV6: Final = 41
SO_ORIGINAL_DST: Final = 80
IP6T_SO_ORIGINAL_DST: Final = 80
_SOCKADDR_IN: Final = 16
_SOCKADDR_IN6: Final = 28


class Accepted(Protocol):
    """What is read of an accepted socket (a socket.socket has it)."""

    @property
    def family(self) -> int: ...

    def getsockname(self) -> Any: ...

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...


def original_destination(conn: Accepted) -> tuple[str, int]:
    """(address, port) a redirected connection was made to, read from its accepted socket.

    A dual-stack listener accepts IPv4 connections as IPv4-mapped IPv6 ones: their original
    destination is still IPv4's (SOL_IP), and the address returned is plain IPv4 text.
    """
    local = conn.getsockname()[0]
    if conn.family == AF_INET or str(local).startswith("::ffff:"):
        raw = conn.getsockopt(SOL_IP, SO_ORIGINAL_DST, _SOCKADDR_IN)
        return str(ipaddress.IPv4Address(raw[4:8])), int.from_bytes(raw[2:4], "big")
    raw = conn.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, _SOCKADDR_IN6)
    return _v6_text(raw[8:24]), int.from_bytes(raw[2:4], "big")


def _v6_text(packed: bytes) -> str:
    """inet_ntop's text: an IPv4-mapped address keeps its dotted IPv4 tail."""
    address = ipaddress.IPv6Address(packed)
    mapped = address.ipv4_mapped
    return f"::ffff:{mapped}" if mapped is not None else str(address)
