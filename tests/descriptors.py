"""This process's open descriptors, for tests that check nothing leaked.

A count is not enough: a socket some earlier test left to the cycle collector may close
while a test runs, and the count then hides a leak or shows one that is not there. Each
descriptor is taken with what it names (a socket's or pipe's inode is unique while it is
open), so a leak is a pair that was not there before.
"""

from __future__ import annotations

import os

Snapshot = frozenset[tuple[str, str]]


def snapshot() -> Snapshot:
    found: set[tuple[str, str]] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            continue
    return frozenset(found)


def opened_since(before: Snapshot) -> list[tuple[str, str]]:
    """The descriptors open now that were not open in `before` (sorted, for messages)."""
    return sorted(snapshot() - before)
