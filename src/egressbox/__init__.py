"""egressbox: a network sandbox for programs that must not talk to the world freely.

Public API re-exports only. They are loaded lazily: the confinement launcher
imports this package before it may import asyncio or dnspython, so importing
`egressbox` itself must stay cheap.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from egressbox.core.version import __version__

# The proxy core may be compiled by mypyc (setup.py): extension modules that
# sit beside their sources and win the import. EGRESSBOX_PURE=1 loads every
# egressbox module from its source instead: to rule the compiled core out, or
# to test an edited source without rebuilding.
PURE_ENV = "EGRESSBOX_PURE"


class _SourceFirst:
    """Finds egressbox.* modules as source (or bytecode) files, never extensions.

    A meta path finder needs only `find_spec`; importlib.abc is not imported for
    its base class because it pulls in importlib.resources, pathlib and tempfile
    (about 5 ms of every start-up)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("egressbox.") or path is None:
            return None
        loaders = [
            (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
            (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES),
        ]
        for entry in path:
            spec = importlib.machinery.FileFinder(entry, *loaders).find_spec(fullname, target)
            if spec is not None:
                return spec
        return None


if os.environ.get(PURE_ENV) == "1" and not any(
    isinstance(finder, _SourceFirst) for finder in sys.meta_path
):
    sys.meta_path.insert(0, _SourceFirst())


def compiled_core() -> bool:
    """True when the proxy core runs compiled (mypyc), False when interpreted."""
    from egressbox.protocols import http1

    return not (http1.__file__ or "").endswith(".py")


_EXPORTS = {
    "AuditRecord": "egressbox.audit.record",
    "JsonlFileSink": "egressbox.audit.record",
    "Decision": "egressbox.core.decide",
    "SelfEndpoints": "egressbox.core.decide",
    "check": "egressbox.proxy.check",
    "Reason": "egressbox.core.errors",
    "Verdict": "egressbox.core.errors",
    "EgressboxError": "egressbox.core.errors",
    "PolicyError": "egressbox.core.errors",
    "Policy": "egressbox.core.policy",
    "Mode": "egressbox.core.policy",
    "load_policy": "egressbox.core.policy",
    "parse_policy": "egressbox.core.policy",
    "DnsResolver": "egressbox.net.resolve",
    "EgressProxy": "egressbox.proxy.server",
    "ProxyOptions": "egressbox.proxy.options",
    "run": "egressbox.runner.api",
    "run_sync": "egressbox.runner.api",
    "spawn_confined": "egressbox.runner.api",
    "ConfinedProcess": "egressbox.runner.api",
    "RunResult": "egressbox.runner.options",
    "RunRefusedError": "egressbox.runner.options",
    "RefusalRecord": "egressbox.confine.refusal",
    "Resolver": "egressbox.net.resolve",
}

__all__ = [
    "AuditRecord",
    "ConfinedProcess",
    "Decision",
    "DnsResolver",
    "EgressProxy",
    "EgressboxError",
    "JsonlFileSink",
    "Mode",
    "Policy",
    "PolicyError",
    "ProxyOptions",
    "Reason",
    "RefusalRecord",
    "Resolver",
    "RunRefusedError",
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
    from egressbox.audit.record import AuditRecord, JsonlFileSink
    from egressbox.confine.refusal import RefusalRecord
    from egressbox.core.decide import Decision, SelfEndpoints
    from egressbox.core.errors import EgressboxError, PolicyError, Reason, Verdict
    from egressbox.core.policy import Mode, Policy, load_policy, parse_policy
    from egressbox.net.resolve import DnsResolver, Resolver
    from egressbox.proxy.check import check
    from egressbox.proxy.options import ProxyOptions
    from egressbox.proxy.server import EgressProxy
    from egressbox.runner.api import ConfinedProcess, run, run_sync, spawn_confined
    from egressbox.runner.options import RunRefusedError, RunResult


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'egressbox' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
