"""Fixtures shared by every test module, and the compiled-core checks."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import egressbox
from dnsserver import dns_server

__all__ = ["dns_server"]

# Property tests assert behaviour, never speed: no per-example deadline, and no
# failure when a loaded machine draws inputs slowly (a test's own settings add to these).
settings.register_profile("behaviour", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("behaviour")

# The proxy fixtures (loopback origins, test DNS, an in-process proxy, curl) serve
# tests in several packages of the tree, so they are a plugin, not a conftest.
pytest_plugins = ["proxy_fixtures"]

# The proxy core may be compiled (setup.py). Its modules call each other
# directly, so a test that monkeypatches an egressbox internal to spy or inject
# a fault sees nothing there: such tests are marked `pure_only` and run in the
# pure-Python pass (EGRESSBOX_PURE=1 scripts/test; CI runs both passes).
COMPILED = egressbox.compiled_core()
PURE_ONLY_REASON = (
    "monkeypatches egressbox internals, which the compiled core calls directly;"
    " runs in the pure-Python pass (EGRESSBOX_PURE=1)"
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"pure_only: {PURE_ONLY_REASON}")
    if COMPILED:
        _refuse_a_stale_build()


def pytest_report_header() -> str:
    return f"egressbox core: {'compiled (mypyc)' if COMPILED else 'interpreted'}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not COMPILED:
        return
    skip = pytest.mark.skip(reason=PURE_ONLY_REASON)
    for item in items:
        if "pure_only" in item.keywords:
            item.add_marker(skip)


def _refuse_a_stale_build() -> None:
    """An edited source beside an older extension would test the old code."""
    package = Path(egressbox.__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for built in package.rglob(f"*{suffix}"):
            source = built.with_name(built.name[: -len(suffix)] + ".py")
            if source.exists() and source.stat().st_mtime > built.stat().st_mtime:
                pytest.exit(
                    f"{source.relative_to(package.parent)} is newer than its compiled module:"
                    " rebuild (scripts/setup) or test the sources (EGRESSBOX_PURE=1 scripts/test)",
                    returncode=2,
                )
