"""Apply a plan's Landlock part in the command process: fs roots, TCP ports, scopes.

Best effort per ABI: rights the kernel does not know are not handled, and
the enforcement report says so. Missing roots are skipped (a preset lists
directories that many hosts lack).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from egressbox.confine import landlock as ll

READ_RIGHTS = ll.AccessFs.EXECUTE | ll.AccessFs.READ_FILE | ll.AccessFs.READ_DIR


@dataclass(frozen=True)
class LandlockReport:
    """What Landlock enforced, by kind of rule."""

    abi: int
    fs: bool
    net: bool
    scopes: bool
    skipped: tuple[str, ...] = ()


def apply(
    *,
    read: Sequence[str] | None,
    write: Sequence[str],
    connect_ports: Sequence[int] | None,
    allow_loopback: bool,
    scopes: bool,
    connect_any: bool = False,
    sockets: Sequence[str] = (),
) -> LandlockReport:
    """Restrict this process: fs when `read` is given, TCP when `connect_ports` is.

    TCP: connect only to the proxy's ports and no bind at all. With
    `allow_loopback` the child may bind and connect freely: only sensible
    inside a private network namespace (the caller checks that). With
    `connect_any` (a captured namespace, where every connection ends at
    egressbox) only binds are refused. `sockets` (unix socket roots) may be read, and a
    unix socket made there (bind); nothing else is written.
    """
    abi = ll.abi_version()
    if abi == 0:
        return LandlockReport(0, False, False, False)
    fs = ll.fs_access_for_abi(abi) if read is not None else ll.NO_FS
    use_net = connect_ports is not None and not allow_loopback and abi >= ll.MIN_ABI_NET
    net = ll.net_access_for_abi(abi) if use_net else ll.NO_NET
    if net and connect_any:
        net = ll.AccessNet.BIND_TCP
    scoped = ll.scopes_for_abi(abi) if scopes else ll.NO_SCOPE
    if not (fs or net or scoped):
        return LandlockReport(abi, False, False, False)
    skipped: list[str] = []
    with ll.Ruleset.create(fs=fs, net=net, scoped=scoped, abi=abi) as ruleset:
        if fs:
            skipped += _paths(ruleset, read or (), READ_RIGHTS & fs)
            skipped += _paths(ruleset, write, fs)
            skipped += _paths(ruleset, sockets, (READ_RIGHTS | ll.AccessFs.MAKE_SOCK) & fs)
        for port in connect_ports or () if net & ll.AccessNet.CONNECT_TCP else ():
            ruleset.add_net_port_rule(port, ll.AccessNet.CONNECT_TCP)
        ruleset.restrict_self()
    return LandlockReport(abi, bool(fs), bool(net), bool(scoped), tuple(skipped))


def _paths(ruleset: ll.Ruleset, paths: Sequence[str], access: ll.AccessFs) -> list[str]:
    skipped = []
    for path in paths:
        if not os.path.exists(path):
            skipped.append(path)
            continue
        ruleset.add_path_rule(path, access)
    return skipped
