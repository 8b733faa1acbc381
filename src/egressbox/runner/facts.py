"""What this host supports for this process, probed and cached where no child can write
(runner/own_state.py).

Two processes of one boot can get different answers from the probe: one under a container's
seccomp filter that refuses namespaces, one in a user namespace without capabilities, one
before and one after `apt install libnftables1`. So a cached probe is keyed by everything its
answer depends on (probe_key), and it is believed only one way: a mechanism the cache calls
available is used (and if applying it fails, confirm() in runner/spawn.py forgets the cache);
a mechanism it calls missing, or a Landlock ABI below what planning can use, is probed again
before the run does without it. A cache can therefore add a mechanism, never take one away.
`egressbox doctor` stores what it probed, so `doctor` and `run` agree.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from egressbox.confine.grants import PROBED_MECHANISMS, HostFacts
from egressbox.core.version import __version__

if TYPE_CHECKING:
    from egressbox.confine.probe import HostSupport, Mechanism

# Every mechanism confine/probe.py probes (read here without loading the probe).
MECHANISMS = PROBED_MECHANISMS
LANDLOCK = "landlock"
# The highest Landlock ABI a planned mechanism needs (confine/grants.py _MIN_ABI: the scopes of
# ABI 6); a cached ABI below it is asked again.
PLANNED_ABI = 6
# The libraries the probe loads (confine/seccomp.py _SONAMES, confine/capture.py LIBRARY):
# installing or removing one changes the answer.
LIBRARIES = ("libseccomp.so.2", "libnftables.so.1")
# Where the dynamic loader finds them without LD_LIBRARY_PATH (Debian's multiarch layout and
# the classic directories); /etc/ld.so.cache changes whenever ldconfig runs (a package install).
_MULTIARCH = getattr(sys.implementation, "_multiarch", "")
LIBRARY_DIRS = (
    f"/lib/{_MULTIARCH}",
    f"/usr/lib/{_MULTIARCH}",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
    "/usr/local/lib",
)
LOADER_CACHE = "/etc/ld.so.cache"
# The sysctls that decide whether namespaces can be made (read by the kernel when the probe
# unshares, and by the probe's hints).
SYSCTLS = (
    "user/max_user_namespaces",
    "user/max_net_namespaces",
    "user/max_mnt_namespaces",
    "user/max_pid_namespaces",
    "kernel/unprivileged_userns_clone",
    "kernel/apparmor_restrict_unprivileged_userns",
)
# /proc/self/status lines that differ between processes of one boot: a seccomp filter (a
# container's refuses unshare), capabilities (a user namespace without them), no_new_privs.
STATUS_FIELDS = ("Seccomp", "Seccomp_filters", "NoNewPrivs", "CapEff", "CapBnd")
# Probe results kept for different keys (a host and a container, root and a user...).
MAX_PROBES = 8
_PROBE_PREFIX = "probe-"


def host_facts() -> HostFacts:
    """What this process may use: the cache for what it says is there, a probe for the rest."""
    key = probe_key()
    cached = _load_facts(key) if key is not None else None
    if cached is None:
        facts = _probed(MECHANISMS, HostFacts(frozenset(), {}, 0, os.geteuid()))
    else:
        doubted = _doubted(cached)
        if not doubted:
            return cached
        facts = _probed(doubted, cached)
    if key is not None and facts != cached:
        _store_facts(facts, key)
    return facts


def remember_probe(support: HostSupport) -> None:
    """Store a full probe made by `egressbox doctor`: the next run believes what it said."""
    key = probe_key()
    if key is not None:
        empty = HostFacts(frozenset(), {}, 0, os.geteuid())
        _store_facts(_merged(empty, support.mechanisms()), key)


def forget_facts() -> None:
    """A mechanism the cache called available failed at run time: probe afresh next time."""
    from egressbox.runner import own_state

    key = probe_key()
    if key is not None:
        own_state.remove(_facts_path(key))


def _doubted(facts: HostFacts) -> tuple[str, ...]:
    """What the cache says is missing (or a Landlock ABI below what planning uses)."""
    doubted = [name for name in MECHANISMS if name not in facts.available]
    if LANDLOCK in facts.available and facts.landlock_abi < PLANNED_ABI:
        doubted.append(LANDLOCK)
    return tuple(doubted)


def _probed(names: tuple[str, ...], known: HostFacts) -> HostFacts:
    from egressbox.confine import face

    return _merged(known, face.probe(names))


def _merged(known: HostFacts, fresh: Iterable[Mechanism]) -> HostFacts:
    """`known` with the fresh probe results in place of its own."""
    available, status, abi = set(known.available), dict(known.status), known.landlock_abi
    for mechanism in fresh:
        status[mechanism.name] = mechanism.status.value
        if mechanism.available:
            available.add(mechanism.name)
        else:
            available.discard(mechanism.name)
        if mechanism.name == LANDLOCK:
            abi = mechanism.abi or 0
    return HostFacts(frozenset(available), status, abi, os.geteuid())


# -- the key --------------------------------------------------------------------------------


def probe_key() -> dict[str, str] | None:
    """Everything the probe's answer depends on, as cheap reads (~0.1 ms); None without a
    boot id (no /proc: nothing cached)."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    if not boot:
        return None

    key = {
        "boot": boot,
        "release": os.uname().release,
        "euid": str(os.geteuid()),
        "user_namespace": _readlink("/proc/self/ns/user"),
        "egressbox": f"{__version__} {_mtime(_source('confine', 'probe.py'))}",
    }
    key |= _status_fields()
    key |= {sysctl: _read(f"/proc/sys/{sysctl}") or "-" for sysctl in SYSCTLS}
    key |= _libraries()
    return key


def _status_fields() -> dict[str, str]:
    found = dict.fromkeys(STATUS_FIELDS, "-")
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in found:
                found[name] = value.strip()
    return found


def _libraries() -> dict[str, str]:
    """Where each library the probe loads is found, and which file it is; the loader's cache
    and the Python binding of libseccomp too."""
    found = {LOADER_CACHE: _mtime(LOADER_CACHE)}
    found |= {name: _library(name) for name in LIBRARIES}
    found["pyseccomp"] = _module_file("pyseccomp")
    return found


def _library(name: str) -> str:
    """The first file named `name` where the loader looks, and its identity; "-" if none."""
    extra = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for folder in (*extra, *LIBRARY_DIRS):
        stamp = _mtime(f"{folder}/{name}")
        if stamp != "-":
            return f"{folder}/{name} {stamp}"
    return "-"


def _module_file(name: str) -> str:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return "-"
    origin = spec.origin if spec is not None else None
    return f"{origin} {_mtime(origin)}" if origin else "-"


def _source(*parts: str) -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), *parts)


def _mtime(path: str) -> str:
    """The file's identity (inode, size, modification time; links followed), or "-"."""
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _read(path: str) -> str:
    # os.open, not open(): a text file object costs ~30 us, and there are eight of these.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 256).decode("ascii", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "-"


def _key_name(key: dict[str, str]) -> str:
    import json
    import zlib

    # The full key is stored in the file and compared; the name only spreads keys over files.
    return f"{zlib.crc32(json.dumps(key, sort_keys=True).encode()):08x}"


# -- the files ------------------------------------------------------------------------------


def _cache_dir() -> str:
    from egressbox.runner import own_state

    return own_state.directory()


def _facts_path(key: dict[str, str]) -> str:
    from egressbox.runner import own_state

    return own_state.path(f"{_PROBE_PREFIX}{_key_name(key)}.json")


def _load_facts(key: dict[str, str]) -> HostFacts | None:
    import json

    from egressbox.runner import own_state

    try:
        data = json.loads(own_state.read(_facts_path(key)) or b"null")
        if data["key"] != key:
            return None  # another process's answer (a different key with the same name)
        return HostFacts(
            frozenset(map(str, data["available"])),
            {str(k): str(v) for k, v in data["status"].items()},
            int(data["abi"]),
            os.geteuid(),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _store_facts(facts: HostFacts, key: dict[str, str]) -> None:
    import json

    from egressbox.runner import own_state

    data: dict[str, object] = {
        "key": key,
        "available": sorted(facts.available),
        "status": dict(facts.status),
        "abi": facts.landlock_abi,
    }
    own_state.write(_facts_path(key), json.dumps(data).encode())
    own_state.prune(_PROBE_PREFIX, MAX_PROBES)


def _compiled_seccomp(allow_udp: bool = False) -> bytes:
    """The seccomp filter as a cached BPF program (empty: the launcher builds it).

    `allow_udp` is the variant for a captured child (UDP sockets allowed: they reach only
    egressbox's DNS socket); each variant has a cache file of its own, keyed by the machine,
    kernel, libseccomp and egressbox's filter (its rules and its allow list's table).
    """
    import json

    from egressbox.runner import own_state

    # Read the cache without importing the seccomp module (~7 ms with hashlib).
    variant = "seccomp-udp" if allow_udp else "seccomp-plain"
    key = {
        "machine": os.uname().machine,
        "release": os.uname().release,
        "table": _mtime(_source("confine", "seccomp.py")),
        "allow_list": _mtime(_source("confine", "syscall_table.py")),
        "libseccomp": _library(LIBRARIES[0]),
    }
    path = own_state.path(f"{variant}-{_key_name(key)}.json")
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        data = json.loads(own_state.read(path) or b"{}")
        if data.get("status") == "full" and data.get("key") == key:
            return bytes.fromhex(data["program"])
    from egressbox.confine import face

    program = face.compile_seccomp(allow_udp=allow_udp)
    if not program:
        return b""
    stored = {"status": "full", "key": key, "program": program.hex()}
    own_state.write(path, json.dumps(stored).encode())
    own_state.prune(variant + "-", MAX_PROBES)
    return program
