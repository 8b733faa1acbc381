"""Synthetic addresses for names answered inside a child's namespace (pure).

With capture on, egressbox's DNS answers a name that the policy could admit with an address
of its own: unique per name for the run, from ranges nobody else uses there (IPv4 198.18.0.0/15,
RFC 2544's benchmarking block; an IPv6 ULA /96). A captured connection to such an address is
mapped back to its name and decided as `name:port`, so the child never learns, and never dials,
a real address: the proxy dials the addresses it checked. Names outside every allow entry never
get one (they are answered NXDOMAIN without any upstream query).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from egressbox.core.ip import IPAddress

V4_NETWORK = ipaddress.IPv4Network("198.18.0.0/15")
# "egb" in the global ID of a ULA: fd65:6762:0::/48, one /96 of it.
V6_NETWORK = ipaddress.IPv6Network("fd65:6762::/96")
# Addresses handed out per run, at most: the IPv4 block's size less its first and last.
CAPACITY = V4_NETWORK.num_addresses - 2
# How long a resolver may keep an answer: short, so a policy change is seen soon; the
# mapping itself lasts the whole run.
TTL = 10


class ExhaustedError(Exception):
    """Every synthetic address of the run is in use."""


@dataclass
class SyntheticNames:
    """The run's name <-> address map; addresses are never reused within a run."""

    _by_name: dict[str, int] = field(default_factory=dict)
    _by_index: dict[int, str] = field(default_factory=dict)

    def addresses(self, name: str) -> tuple[ipaddress.IPv4Address, ipaddress.IPv6Address]:
        """The name's addresses (allocated on first use)."""
        index = self._by_name.get(name)
        if index is None:
            index = len(self._by_name) + 1
            if index > CAPACITY:
                raise ExhaustedError(f"more than {CAPACITY} names in one run")
            self._by_name[name] = index
            self._by_index[index] = name
        v4 = V4_NETWORK.network_address + index
        v6 = V6_NETWORK.network_address + index
        return ipaddress.IPv4Address(v4), ipaddress.IPv6Address(v6)

    def name_for(self, ip: IPAddress) -> str | None:
        """The name a synthetic address was given to, or None (not one of ours)."""
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        network = V4_NETWORK if isinstance(ip, ipaddress.IPv4Address) else V6_NETWORK
        if ip not in network:
            return None
        return self._by_index.get(int(ip) - int(network.network_address))

    def __len__(self) -> int:
        return len(self._by_name)


def is_synthetic(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip in (V4_NETWORK if isinstance(ip, ipaddress.IPv4Address) else V6_NETWORK)


def reverse_name(ip: IPAddress) -> str:
    """The PTR query name for an address (without the trailing dot)."""
    return ip.reverse_pointer


def address_of_reverse(name: str) -> IPAddress | None:
    """The address a PTR query name asks about, or None when it is not a full one."""
    labels = name.lower().rstrip(".").split(".")
    if labels[-2:] == ["in-addr", "arpa"] and len(labels) == 6:
        try:
            return ipaddress.IPv4Address(".".join(reversed(labels[:4])))
        except ValueError:
            return None
    if labels[-2:] == ["ip6", "arpa"] and len(labels) == 34:
        nibbles = "".join(reversed(labels[:32]))
        try:
            return ipaddress.IPv6Address(int(nibbles, 16))
        except ValueError:
            return None
    return None
