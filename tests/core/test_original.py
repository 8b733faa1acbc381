"""core/original.py reads a redirected connection's original destination as the kernel gives
it: the address as inet_ntop writes it, the port in network order; IPv4 through SOL_IP for an
IPv4 or IPv4-mapped socket, IPv6 through SOL_IPV6 otherwise."""

from __future__ import annotations

import socket
import struct
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from egressbox.core.original import (
    IP6T_SO_ORIGINAL_DST,
    SO_ORIGINAL_DST,
    SOL_IP,
    SOL_IPV6,
    original_destination,
)


class _Accepted:
    """An accepted socket as the kernel would answer for it."""

    def __init__(self, family: int, local: str, answers: dict[tuple[int, int], bytes]) -> None:
        self.family = family
        self.local = local
        self.answers = answers
        self.asked: list[tuple[int, int, int]] = []

    def getsockname(self) -> Any:
        return (self.local, 1234)

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes:
        self.asked.append((level, optname, buflen))
        return self.answers[(level, optname)][:buflen]


def _sockaddr_in(address: str, port: int) -> bytes:
    return struct.pack("!HH4s8x", socket.AF_INET, port, socket.inet_pton(socket.AF_INET, address))


def _sockaddr_in6(packed: bytes, port: int) -> bytes:
    return struct.pack("!HHI16sI", socket.AF_INET6, port, 0, packed, 0)


def test_an_ipv4_socket_reads_sol_ip() -> None:
    answers = {(SOL_IP, SO_ORIGINAL_DST): _sockaddr_in("198.18.0.5", 443)}
    conn = _Accepted(socket.AF_INET, "127.0.0.1", answers)
    assert original_destination(conn) == ("198.18.0.5", 443)
    assert conn.asked == [(SOL_IP, SO_ORIGINAL_DST, 16)]


def test_an_ipv4_mapped_connection_on_a_dual_stack_socket_reads_sol_ip() -> None:
    answers = {(SOL_IP, SO_ORIGINAL_DST): _sockaddr_in("10.1.2.3", 5432)}
    conn = _Accepted(socket.AF_INET6, "::ffff:127.0.0.1", answers)
    assert original_destination(conn) == ("10.1.2.3", 5432)


@given(packed=st.binary(min_size=16, max_size=16), port=st.integers(0, 65535))
def test_an_ipv6_destination_is_inet_ntops_text(packed: bytes, port: int) -> None:
    answers = {(SOL_IPV6, IP6T_SO_ORIGINAL_DST): _sockaddr_in6(packed, port)}
    conn = _Accepted(socket.AF_INET6, "::1", answers)
    assert original_destination(conn) == (socket.inet_ntop(socket.AF_INET6, packed), port)
