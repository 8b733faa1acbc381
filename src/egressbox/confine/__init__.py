"""Confinement of child processes: host probing, Landlock, seccomp and namespaces.

Its face (confine/face.py): `confine.plan(request, facts) -> Plan`, pure (the profile's
mechanisms on this host and its refusals), `confine.finish(plan, run) -> Confinement`, pure
(the grants, the world and the walls, from the Run the caller builds on the Plan with what
`confine.read_host` read of the host), and `confine.launch(plan) -> Launched`;
`confine.set_up` makes on the host what a planned run needs before its launch (the proxy's
listeners without a network namespace). The face is a list of names: planning is
confine/planning.py (pure), reading and making on the host confine/host.py, the launcher's
parent side confine/launching.py, judging a failed run confine/judging.py. The plan's
vocabulary and tables (profiles, mechanisms, refusals, presets, the world's spec) are
confine/grants.py; the launcher's plan is confine/spec.py.

Irreversible steps (restrict_self, loading a seccomp filter, unshare) only ever run in a child
process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from egressbox.confine.face import (
        Confinement,
        Grants,
        HostReads,
        Launched,
        Plan,
        Request,
        Run,
        finish,
        launch,
        plan,
        read_host,
        set_up,
    )

__all__ = [
    "Confinement",
    "Grants",
    "HostReads",
    "Launched",
    "Plan",
    "Request",
    "Run",
    "finish",
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
