"""What this host supports, probed once per boot, kernel and user, and cached where no child
can write (confine/cache.py)."""

from __future__ import annotations

import contextlib
import os

from egressbox.confine.plan import (
    HostFacts,
)


def host_facts() -> HostFacts:
    """What this host supports: probed once per boot, kernel and user, then cached."""
    cached = _load_facts()
    if cached is not None:
        return cached
    from egressbox.confine.probe import probe_host

    support = probe_host()
    status = {m.name: m.status.value for m in support.mechanisms()}
    available = frozenset(name for name, value in status.items() if value == "available")
    abi = support.landlock.abi or 0
    facts = HostFacts(available, status, abi, os.geteuid())
    _store_facts(facts)
    return facts


def _cache_dir() -> str:
    from egressbox.confine import cache

    return cache.directory()


def _compiled_seccomp(allow_udp: bool = False) -> bytes:
    """The seccomp filter as a cached BPF program (empty: the launcher builds it).

    `allow_udp` is the variant for a captured child (UDP sockets allowed: they reach only
    egressbox's DNS socket); each variant has a cache file of its own.
    """
    import json

    from egressbox.confine import cache

    # Read the cache without importing the seccomp module (~7 ms with hashlib).
    variant = "seccomp-udp" if allow_udp else "seccomp"
    path = cache.path(f"{variant}-{os.uname().machine}-{os.uname().release}.json")
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        data = json.loads(cache.read(path) or b"{}")
        if data.get("status") == "full":
            return bytes.fromhex(data["program"])
    from egressbox.confine.seccomp import SeccompOptions, Status, compile_filter

    compiled = compile_filter(SeccompOptions(allow_udp=allow_udp))
    if compiled.status is not Status.FULL:
        return b""
    cache.write(path, json.dumps({"status": "full", "program": compiled.program.hex()}).encode())
    return compiled.program


def _facts_path() -> str | None:
    from egressbox.confine import cache

    # Keyed by boot, kernel and euid: any of them changes what is available.
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return cache.path(f"probe-{boot}-{os.uname().release}-{os.geteuid()}.json")


def _load_facts() -> HostFacts | None:
    import json

    from egressbox.confine import cache

    path = _facts_path()
    if path is None:
        return None
    try:
        data = json.loads(cache.read(path) or b"null")
        if "capture" not in data["status"]:
            return None  # probed before capture was a mechanism: probe again
        return HostFacts(
            frozenset(data["available"]), dict(data["status"]), int(data["abi"]), os.geteuid()
        )
    except (ValueError, KeyError, TypeError):
        return None


def _store_facts(facts: HostFacts) -> None:
    import json

    from egressbox.confine import cache

    path = _facts_path()
    if path is None:
        return
    data: dict[str, object] = {
        "available": sorted(facts.available),
        "status": dict(facts.status),
        "abi": facts.landlock_abi,
    }
    cache.write(path, json.dumps(data).encode())
