"""Confinement of child processes: host probing, Landlock, seccomp and namespaces.

Its face (confine/face.py): `confine.plan(request, facts) -> Plan`, pure, and
`confine.launch(plan) -> Launched`, with the Request the caller builds from what
`confine.read_host` read of the host; `confine.set_up` makes on the host what a planned run
needs before its launch (the proxy's listeners without a network namespace). The plan's
vocabulary and tables (profiles, mechanisms, refusals, presets, the world's spec) are
confine/grants.py.

Irreversible steps (restrict_self, loading a seccomp filter, unshare) only ever run in a child
process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from egressbox.confine.face import (
        Grants,
        HostReads,
        Launched,
        Plan,
        Request,
        launch,
        plan,
        read_host,
        set_up,
    )

__all__ = [
    "Grants",
    "HostReads",
    "Launched",
    "Plan",
    "Request",
    "launch",
    "plan",
    "read_host",
    "set_up",
]

# Loaded on first use: every confine module imports this package first (the probe, the cache,
# the launcher's preloads), and the face pulls in the launcher's module.
_FACE = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name in _FACE:
        from egressbox.confine import face

        return getattr(face, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
