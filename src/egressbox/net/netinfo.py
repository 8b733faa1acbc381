"""This host's own addresses, for the self-connection check of wildcard listeners.

Read from /proc (Linux) without netlink: the proxy may itself run under a
seccomp filter that refuses netlink sockets. Elsewhere only loopback is known.
"""

from __future__ import annotations

import contextlib
import ipaddress

from egressbox.core.ip import IPAddress

FIB_TRIE = "/proc/net/fib_trie"
IF_INET6 = "/proc/net/if_inet6"


def local_addresses() -> set[IPAddress]:
    """Every address assigned to an interface of this network namespace."""
    found: set[IPAddress] = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}
    found |= _ipv4_local(_read(FIB_TRIE))
    found |= _ipv6_local(_read(IF_INET6))
    return found


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _ipv4_local(text: str) -> set[IPAddress]:
    # fib_trie lists "|-- ADDRESS" followed by "/32 host LOCAL" for each
    # address the kernel delivers locally.
    found: set[IPAddress] = set()
    previous = ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("/32 host LOCAL") and previous:
            with contextlib.suppress(ValueError):
                found.add(ipaddress.ip_address(previous))
        if line.startswith("|--"):
            previous = line[3:].strip()
    return found


def _ipv6_local(text: str) -> set[IPAddress]:
    found: set[IPAddress] = set()
    for line in text.splitlines():
        fields = line.split()
        if fields and len(fields[0]) == 32:
            with contextlib.suppress(ValueError):
                found.add(ipaddress.IPv6Address(int(fields[0], 16)))
    return found
