"""Drop every capability for good, so that a root child keeps uid 0 but no privilege.

Order matters: securebits and the bounding set need CAP_SETPCAP, so they go first and capset,
which gives CAP_SETPCAP away, goes last. Locked securebits stop a later execve from handing root
its capabilities back (SECBIT_NOROOT), stop uid changes from adjusting them (NO_SETUID_FIXUP) and
stop ambient raises; the empty bounding set means not even a setuid-root or file-capability
binary can gain one. Works as real root and as uid 0 (or any uid) inside a user namespace, where
the process holds these capabilities over its own namespace.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from egressbox.confine import syscalls
from egressbox.confine.syscalls import (
    PR_CAP_AMBIENT,
    PR_CAP_AMBIENT_CLEAR_ALL,
    PR_CAPBSET_DROP,
    PR_CAPBSET_READ,
    PR_GET_SECUREBITS,
    PR_SET_SECUREBITS,
)

SECBIT_NOROOT = 1 << 0
SECBIT_NOROOT_LOCKED = 1 << 1
SECBIT_NO_SETUID_FIXUP = 1 << 2
SECBIT_NO_SETUID_FIXUP_LOCKED = 1 << 3
SECBIT_KEEP_CAPS = 1 << 4
SECBIT_NO_CAP_AMBIENT_RAISE = 1 << 6
SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED = 1 << 7
LOCKED_SECUREBITS = (
    SECBIT_NOROOT
    | SECBIT_NOROOT_LOCKED
    | SECBIT_NO_SETUID_FIXUP
    | SECBIT_NO_SETUID_FIXUP_LOCKED
    | SECBIT_NO_CAP_AMBIENT_RAISE
    | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED
)
# The capability lines of /proc/self/status, as CapReport fields.
STATUS_FIELDS = {
    "CapInh": "inheritable",
    "CapPrm": "permitted",
    "CapEff": "effective",
    "CapBnd": "bounding",
    "CapAmb": "ambient",
}
_HIGHEST_POSSIBLE_CAP = 63  # capset v3 carries 64 bits per set
# <linux/capability.h>: what creating a network, mount or PID namespace takes without a new
# user namespace (uid 0 alone does not: a container's root often lacks it).
CAP_SYS_ADMIN = 21


class CapabilityError(OSError):
    """A capability set was not empty after the drop: the caller must not run the command."""


@dataclass(frozen=True)
class CapSets:
    """The five capability sets of a process, as 64-bit masks."""

    inheritable: int
    permitted: int
    effective: int
    bounding: int
    ambient: int

    @property
    def all_clear(self) -> bool:
        return not (
            self.inheritable | self.permitted | self.effective | self.bounding | self.ambient
        )


@dataclass(frozen=True)
class CapReport:
    """The verified state after drop_all_capabilities."""

    last_cap: int  # the highest capability number this kernel knows
    securebits: int
    sets: CapSets


def drop_all_capabilities() -> CapReport:
    """Lock securebits, empty the bounding and ambient sets, then empty the rest with capset.

    Verified from /proc/self/status; raises CapabilityError when any set is left non-empty and
    OSError when a step is refused (e.g. without CAP_SETPCAP). Affects the calling thread only:
    call it in the single-threaded launcher.
    """
    last_cap = read_last_cap()
    current = syscalls.prctl(PR_GET_SECUREBITS)
    syscalls.prctl(PR_SET_SECUREBITS, (current | LOCKED_SECUREBITS) & ~SECBIT_KEEP_CAPS)
    for cap in range(last_cap + 1):
        syscalls.prctl(PR_CAPBSET_DROP, cap)
    _clear_ambient()
    syscalls.capset(0, 0, 0)
    sets = read_capability_sets()
    if not sets.all_clear:
        raise CapabilityError(errno.EPERM, f"capabilities left after the drop: {sets}")
    return CapReport(last_cap, syscalls.prctl(PR_GET_SECUREBITS), sets)


def _clear_ambient() -> None:
    try:
        syscalls.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError as exc:
        # Kernels before 4.3 have no ambient set, hence nothing to clear.
        if exc.errno != errno.EINVAL:
            raise


def read_last_cap() -> int:
    """The highest capability number the running kernel knows."""
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return _probe_last_cap()


def _probe_last_cap() -> int:
    # Without /proc: PR_CAPBSET_READ answers EINVAL for a number the kernel does not know.
    for cap in range(_HIGHEST_POSSIBLE_CAP + 1):
        try:
            syscalls.prctl(PR_CAPBSET_READ, cap)
        except OSError:
            return cap - 1
    return _HIGHEST_POSSIBLE_CAP


def read_capability_sets(status_path: str = "/proc/self/status") -> CapSets:
    """The capability sets from a /proc/<pid>/status file."""
    with open(status_path, encoding="utf-8") as handle:
        return parse_capability_sets(handle.read())


def parse_capability_sets(status: str) -> CapSets:
    """CapSets from the text of a /proc/<pid>/status file (CapAmb is absent before Linux 4.3)."""
    values = {"ambient": 0}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            values[STATUS_FIELDS[key]] = int(value.strip(), 16)
    # An unparsable file must never read as "all clear".
    missing = [key for key, name in STATUS_FIELDS.items() if name not in values]
    if missing:
        raise ValueError(f"no {', '.join(missing)} in the status text")
    return CapSets(**values)


def holds_sys_admin(status_path: str = "/proc/self/status") -> bool:
    """Whether this process holds CAP_SYS_ADMIN in its effective set (in its own user
    namespace): then it makes namespaces directly; otherwise, root or not, only a new user
    namespace gives it the right. False when /proc cannot be read."""
    try:
        return bool(read_capability_sets(status_path).effective & (1 << CAP_SYS_ADMIN))
    except (OSError, ValueError):
        return False
