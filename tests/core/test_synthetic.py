"""The synthetic address map of a run: unique per name, stable, reversible, bounded."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from egressbox.core.synthetic import (
    V4_NETWORK,
    V6_NETWORK,
    SyntheticNames,
    address_of_reverse,
    is_synthetic,
    reverse_name,
)

NAMES = st.lists(
    st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z][a-z0-9-]{0,10}){1,3}", fullmatch=True),
    min_size=1,
    max_size=50,
    unique=True,
)


@given(NAMES)
def test_every_name_gets_its_own_addresses_and_keeps_them(names: list[str]) -> None:
    synthetic = SyntheticNames()
    given_out = {name: synthetic.addresses(name) for name in names}
    assert len({v4 for v4, _ in given_out.values()}) == len(names)
    for name, (v4, v6) in given_out.items():
        assert synthetic.addresses(name) == (v4, v6)
        assert v4 in V4_NETWORK and v6 in V6_NETWORK
        assert synthetic.name_for(v4) == name and synthetic.name_for(v6) == name
        mapped = ipaddress.IPv6Address(f"::ffff:{v4}")
        assert synthetic.name_for(mapped) == name
        assert address_of_reverse(reverse_name(v4)) == v4
        assert address_of_reverse(reverse_name(v6)) == v6


def test_addresses_not_handed_out_map_to_nothing() -> None:
    synthetic = SyntheticNames()
    v4, _ = synthetic.addresses("a.example")
    assert synthetic.name_for(v4 + 1) is None
    assert synthetic.name_for(ipaddress.IPv4Address("1.2.3.4")) is None
    assert is_synthetic(v4 + 1) and not is_synthetic(ipaddress.IPv4Address("198.20.0.1"))


def test_partial_or_foreign_reverse_names_are_no_address() -> None:
    assert address_of_reverse("18.198.in-addr.arpa") is None
    assert address_of_reverse("example.com") is None
    assert address_of_reverse("x.0.18.198.in-addr.arpa") is None
