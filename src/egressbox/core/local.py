"""Local destinations: which allow_cidrs entry a loopback or private host needs, and why.

The decision checks every address a connection goes to (core/decide.py): a loopback,
private or link-local one stays denied, whatever allow entry names the host, unless
`egress.allow_cidrs` covers it (`allow_private` lifts RFC 1918 / ULA / CGNAT ranges but
never loopback). So an entry learned for a local registry (`localhost:5000`,
`127.0.0.1:8080`, `10.0.0.5:5432`) works only with its grant. One place answers what that
grant is, for `audit --suggest-policy`, `run --save-approved` and `egressbox check`.

Pure: no DNS. A name is local only when it is local by definition: `localhost` and names
under `.localhost` (RFC 6761 §6.3), which the sandbox's /etc/hosts (confine/grants.py
CAPTURE_HOSTS) and every stock resolver map to 127.0.0.1 and ::1.
"""

from __future__ import annotations

import ipaddress
from typing import Final, NamedTuple

from egressbox.core.addresses import Category, lookup
from egressbox.core.hosts import format_authority
from egressbox.core.ip import IPAddress, IPNetwork

LOOPBACK_NAME: Final = "localhost"
# The addresses `localhost` has in the sandbox's /etc/hosts (confine/grants.py CAPTURE_HOSTS).
LOOPBACK_ADDRESSES: Final[tuple[IPAddress, ...]] = (
    ipaddress.ip_address("127.0.0.1"),
    ipaddress.ip_address("::1"),
)
# Categories an allow_cidrs entry for one address opens on purpose for a local service.
# Metadata endpoints (credentials) and special ranges (documentation, multicast ...) are
# never granted this way: a learned entry must not open them.
GRANTABLE: Final = frozenset(
    {
        Category.LOOPBACK,
        Category.PRIVATE,
        Category.SHARED,
        Category.SITE_LOCAL,
        Category.LINK_LOCAL,
    }
)


class Grant(NamedTuple):
    """One allow_cidrs entry a destination needs, with the reason to write beside it."""

    network: IPNetwork
    why: str


def is_loopback_name(name: str) -> bool:
    """`localhost` or a name under it (normalized: lower case, no trailing dot)."""
    return name == LOOPBACK_NAME or name.endswith("." + LOOPBACK_NAME)


def _host_network(ip: IPAddress) -> IPNetwork:
    return ipaddress.ip_network(ip)  # /32 or /128: that address only


def local_category(ip: IPAddress) -> Category | None:
    """The address's category when a one-address grant may open it, else None."""
    category = lookup(ip).category
    return category if category in GRANTABLE else None


def grants_needed(host: str, port: int) -> tuple[Grant, ...]:
    """The allow_cidrs entries `host:port` cannot work without ( () for a public host, a
    name that is not local by definition, or an address no grant should open)."""
    authority = format_authority(host, port)
    if is_loopback_name(host):
        return tuple(
            Grant(
                _host_network(ip),
                f"{authority} resolves to loopback ({ip}); every address is checked, and "
                "loopback is denied unless allow_cidrs covers it",
            )
            for ip in LOOPBACK_ADDRESSES
        )
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return ()
    category = local_category(ip)
    if category is None:
        return ()
    what = category.value.replace("_", "-")
    return (
        Grant(
            _host_network(ip),
            f"{authority} is a {what} address, denied unless allow_cidrs covers it",
        ),
    )
