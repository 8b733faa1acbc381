"""egressbox: a network sandbox for programs that must not talk to the world freely.

Public API re-exports only. They are loaded lazily: the confinement launcher
imports this package before it may import asyncio or dnspython, so importing
`egressbox` itself must stay cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AuditRecord": "egressbox.audit",
    "JsonlFileSink": "egressbox.audit",
    "Decision": "egressbox.decide",
    "SelfEndpoints": "egressbox.decide",
    "check": "egressbox.egress",
    "Reason": "egressbox.errors",
    "Verdict": "egressbox.errors",
    "EgressboxError": "egressbox.errors",
    "PolicyError": "egressbox.errors",
    "Policy": "egressbox.policy",
    "Mode": "egressbox.policy",
    "load_policy": "egressbox.policy",
    "parse_policy": "egressbox.policy",
    "DnsResolver": "egressbox.resolve",
    "EgressProxy": "egressbox.server",
    "run": "egressbox.run",
    "run_sync": "egressbox.run",
    "spawn_confined": "egressbox.run",
    "RunResult": "egressbox.run",
    "Resolver": "egressbox.resolve",
}

__all__ = [
    "AuditRecord",
    "Decision",
    "DnsResolver",
    "EgressProxy",
    "EgressboxError",
    "JsonlFileSink",
    "Mode",
    "Policy",
    "PolicyError",
    "Reason",
    "Resolver",
    "RunResult",
    "SelfEndpoints",
    "Verdict",
    "__version__",
    "check",
    "load_policy",
    "parse_policy",
    "run",
    "run_sync",
    "spawn_confined",
]

if TYPE_CHECKING:
    from egressbox.audit import AuditRecord, JsonlFileSink
    from egressbox.decide import Decision, SelfEndpoints
    from egressbox.egress import check
    from egressbox.errors import EgressboxError, PolicyError, Reason, Verdict
    from egressbox.policy import Mode, Policy, load_policy, parse_policy
    from egressbox.resolve import DnsResolver, Resolver
    from egressbox.run import RunResult, run, run_sync, spawn_confined
    from egressbox.server import EgressProxy


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'egressbox' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
