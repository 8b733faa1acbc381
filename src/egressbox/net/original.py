"""The original destination of a redirected TCP connection (nftables `redirect`).

A captured connection arrives at the capture listener; the kernel keeps where the child
meant to go (SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST), read here from the accepted socket.
"""

from __future__ import annotations

import socket

SO_ORIGINAL_DST = 80
IP6T_SO_ORIGINAL_DST = 80
SOL_IP = 0
SOL_IPV6 = 41
_SOCKADDR_IN = 16
_SOCKADDR_IN6 = 28


def original_destination(conn: socket.socket) -> tuple[str, int]:
    """(address, port) a redirected connection was made to, read from its accepted socket.

    A dual-stack listener accepts IPv4 connections as IPv4-mapped IPv6 ones: their original
    destination is still IPv4's (SOL_IP), and the address returned is plain IPv4 text.
    """
    local = conn.getsockname()[0]
    if conn.family == socket.AF_INET or str(local).startswith("::ffff:"):
        raw = conn.getsockopt(SOL_IP, SO_ORIGINAL_DST, _SOCKADDR_IN)
        port = int.from_bytes(raw[2:4], "big")
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    raw = conn.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, _SOCKADDR_IN6)
    port = int.from_bytes(raw[2:4], "big")
    return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port
