"""The run's enforcement report: each mechanism's row as planned before the fork, and as the
launcher says it applied them (its report, sent just before exec). What `--report` prints and
`RunResult.report` holds says what was applied, never what was only planned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from egressbox.confine import face
from egressbox.confine.grants import Enforcement, Mechanism, Profile, wanted
from egressbox.runner.options import MechanismReport


def enforcement_report(
    profile: Profile, chosen: frozenset[Mechanism], *, capture_off: str = ""
) -> tuple[list[MechanismReport], Enforcement]:
    rows = []
    for mechanism in sorted(wanted(profile) | chosen):
        on = mechanism in chosen
        rows.append(
            MechanismReport(
                mechanism.value,
                Enforcement.FULL if on else Enforcement.NONE,
                "applied" if on else "unavailable on this host",
            )
        )
    connects = {} if Mechanism.NETWORK_NAMESPACE in chosen else _planned_connects(chosen)
    row = _network_row(chosen, connects)
    network = row.enforcement
    rows.append(row)
    rows.append(_filesystem_row(chosen))
    if capture_off:
        rows.append(MechanismReport(CAPTURE_ROW, Enforcement.NONE, capture_off))
    else:
        rows.append(MechanismReport(CAPTURE_ROW, Enforcement.FULL, "planned"))
    return rows, network


# The report's row for capture: not a confinement mechanism (no profile requires it, and a run
# without it is no less confined), so never a gap.
CAPTURE_ROW = "capture"
# Said when the launcher captured but this run's proxy does not serve the capture sockets.
CAPTURE_UNSERVED = (
    "this run's proxy does not serve them yet: a captured connection is refused and a DNS "
    "question goes unanswered"
)


def _planned_connects(chosen: frozenset[Mechanism]) -> dict[str, str]:
    why = face.connects_off(chosen)
    return {"status": "none", "reason": why} if why else {"status": "full"}


def _network_row(held: frozenset[Mechanism], connects: Mapping[str, Any]) -> MechanismReport:
    """The network boundary: a namespace, or the connect supervisor (`connects` is what the
    launcher said of it, {} with a namespace), or Landlock's ports alone and why."""
    supervised = connects.get("status") == "full"
    network = network_boundary(held, supervised=supervised)
    detail = _NETWORK_DETAIL[network]
    if supervised and Mechanism.NETWORK_NAMESPACE not in held:
        detail = _SUPERVISED
    elif network is Enforcement.PARTIAL and connects.get("reason"):
        detail += f"; no connect supervisor: {connects['reason']}"
    return MechanismReport("network_boundary", network, detail)


_SUPERVISED = (
    "no network namespace; every connect is held by egressbox's connect supervisor (seccomp "
    "user notification), which connects the socket itself: to the proxy, or to the capture "
    "listener; inet sockets are TCP only: the proxy is the only endpoint"
)
_SUPERVISED_CAPTURE = (
    "every TCP connection not made to the proxy is connected by the connect supervisor to the "
    "capture listener and decided as tcp with its destination; no DNS capture without a "
    "namespace: names resolve from the host's files only (UDP sockets are refused)"
)

_NETWORK_DETAIL = {
    Enforcement.FULL: "a private network namespace: the proxy is the only endpoint",
    Enforcement.PARTIAL: "no network namespace: TCP only, to the proxy's port numbers, "
    "but on any address",
    Enforcement.NONE: "the child could reach the network directly",
}


# The host probe's name for the connect supervisor (confine/probe.py), also the name `doctor`
# lists among what a profile would enforce when it stands in for the network namespace.
SUPERVISOR = "connect_supervisor"


def planned_network_boundary(
    chosen: frozenset[Mechanism], available: frozenset[str]
) -> tuple[Enforcement, bool]:
    """The network boundary a run with `chosen` would get on a host whose probe found
    `available`, and whether the connect supervisor holds it (no namespace; its filter rides
    on the seccomp one)."""
    supervised = (
        Mechanism.NETWORK_NAMESPACE not in chosen
        and Mechanism.SECCOMP in chosen
        and SUPERVISOR in available
    )
    return network_boundary(chosen, supervised=supervised), supervised


def network_boundary(chosen: frozenset[Mechanism], *, supervised: bool = False) -> Enforcement:
    if Mechanism.NETWORK_NAMESPACE in chosen or supervised:
        return Enforcement.FULL
    if Mechanism.LANDLOCK_NET in chosen and Mechanism.SECCOMP in chosen:
        return Enforcement.PARTIAL
    return Enforcement.NONE


def applied_report(
    profile: Profile,
    chosen: frozenset[Mechanism],
    applied: Mapping[str, Any] | None,
    *,
    capture_off: str = "",
    capture_served: bool = True,
) -> tuple[list[MechanismReport], Enforcement]:
    """The report from what the launcher says it applied, never from the plan.

    No word from the launcher (it failed before exec): nothing is reported as applied.
    `capture_off` is why capture was not planned; `capture_served` whether this run's proxy
    serves the capture and DNS sockets the launcher made.
    """
    held = _held(applied or {})
    rows = []
    for mechanism in sorted(wanted(profile) | chosen):
        state, detail = held.get(mechanism, (Enforcement.NONE, ""))
        if mechanism not in chosen:
            detail = "unavailable on this host"
        elif state is Enforcement.NONE:
            detail = detail or "planned, but not applied"
        rows.append(MechanismReport(mechanism.value, state, detail or "applied"))
    applied_set = frozenset(m for m, (state, _) in held.items() if state is Enforcement.FULL)
    connects = (applied or {}).get("connect_supervisor") or {}
    if not connects and Mechanism.NETWORK_NAMESPACE not in applied_set:
        connects = {"status": "none", "reason": face.connects_off(chosen) or "not applied"}
    row = _network_row(applied_set, connects)
    network = row.enforcement
    rows.append(row)
    rows.append(_filesystem_row(applied_set))
    if connects.get("status") == "full" and not capture_off:
        rows.append(MechanismReport(CAPTURE_ROW, Enforcement.FULL, _SUPERVISED_CAPTURE))
    else:
        rows.append(_capture_row(applied or {}, capture_off, capture_served))
    rows.append(_memory_row(applied or {}))
    return rows, network


# The report's row for the file system as a whole: which wall holds it (the mechanisms' own rows
# say whether each was applied, so this row is never a gap of its own).
FILESYSTEM_ROW = "filesystem"
_LANDLOCK_ONLY = (
    "Landlock is the only wall: the host's view, limited to the granted roots; of /dev only "
    + ", ".join(face.HOST_DEVICE_NODES)
    + " (no other device opens, so no other device ioctl); metadata changes (chmod, chown, "
    "utimes) under readable roots are not stopped (Landlock has no right for them up to ABI 7); "
    "the workspace is written directly; the host's /tmp and /var/tmp are not granted (shared "
    "with every user: TMPDIR is the scratch space)"
)


def _filesystem_row(held: frozenset[Mechanism]) -> MechanismReport:
    if Mechanism.MOUNT_NAMESPACE in held:
        walls = "; Landlock as a second wall" if Mechanism.LANDLOCK_FS in held else ""
        detail = f"a constructed root: only what is granted exists{walls}"
        return MechanismReport(FILESYSTEM_ROW, Enforcement.FULL, detail)
    if Mechanism.LANDLOCK_FS in held:
        return MechanismReport(FILESYSTEM_ROW, Enforcement.PARTIAL, _LANDLOCK_ONLY)
    return MechanismReport(FILESYSTEM_ROW, Enforcement.NONE, "no filesystem rules")


# The report's row for the run's memory budget: what bounds it, never a confinement gap.
MEMORY_ROW = "memory"


def _memory_row(applied: Mapping[str, Any]) -> MechanismReport:
    memory = applied.get("memory") or {}
    if memory.get("cgroup"):
        pids = f", pids.max {memory['pids']}" if memory.get("pids") else ""
        return MechanismReport(
            MEMORY_ROW,
            Enforcement.FULL,
            f"cgroup {_mib(memory.get('budget'))} for the whole run (memory.max of "
            f"{memory['cgroup']}: its processes and their tmpfs pages; no swap{pids})",
        )
    parts = [f"tmpfs sizes sum to {_mib(memory['tmpfs'])}"] if memory.get("tmpfs") else []
    if memory.get("rlimit_data"):
        parts.append(f"per-process RLIMIT_DATA {_mib(memory['rlimit_data'])}")
    parts.append(f"no cgroup: {memory.get('why') or 'not reported by the launcher'}")
    return MechanismReport(MEMORY_ROW, Enforcement.PARTIAL, "; ".join(parts))


def _mib(size: object) -> str:
    return f"{int(size) / (1 << 20):.0f} MiB" if isinstance(size, int) else "unknown"


def _capture_row(applied: Mapping[str, Any], off: str, served: bool) -> MechanismReport:
    if off:
        return MechanismReport(CAPTURE_ROW, Enforcement.NONE, off)
    done = applied.get("capture") or {}
    if done.get("status") != "full":
        why = str(done.get("reason") or "planned, but not applied")
        return MechanismReport(CAPTURE_ROW, Enforcement.NONE, f"not applied: {why}")
    families = " and ".join(f.replace("ip", "IP") for f in done.get("families") or ["ipv4"])
    detail = (
        f"every {families} TCP connection goes to the proxy (capture listener port "
        f"{done.get('capture_port')}); DNS is answered at {done.get('dns')}, where the view's "
        "/etc/resolv.conf points; other UDP reaches nothing"
    )
    if not served:
        detail += f"; {CAPTURE_UNSERVED}"
    return MechanismReport(CAPTURE_ROW, Enforcement.FULL, detail)


def _held(applied: Mapping[str, Any]) -> dict[Mechanism, tuple[Enforcement, str]]:
    full, none = Enforcement.FULL, Enforcement.NONE
    ns = set(applied.get("namespaces") or ())
    ll = applied.get("landlock") or {}
    world = applied.get("world") or {}
    skipped = "; ".join(f"{what}: {why}" for what, why in world.get("skipped") or ())
    seccomp = str(applied.get("seccomp", "none"))
    captured = (applied.get("capture") or {}).get("status") == "full"
    udp = "UDP sockets allowed: captured, they reach only the DNS address" if captured else ""
    if seccomp in {"full", "partial"}:
        udp = "; ".join(filter(None, (face.seccomp_row(), udp)))
    detail = f"constructed root ({len(world.get('steps') or ())} steps)"
    return {
        Mechanism.NETWORK_NAMESPACE: (full if "net" in ns else none, ""),
        Mechanism.MOUNT_NAMESPACE: (
            full if "mnt" in ns and world else none,
            f"{detail}; not done: {skipped}" if skipped else detail,
        ),
        Mechanism.PID_NAMESPACE: (full if "pid" in ns else none, ""),
        Mechanism.LANDLOCK_FS: (full if ll.get("fs") else none, f"ABI {ll.get('abi', 0)}"),
        Mechanism.LANDLOCK_NET: (
            full if ll.get("net") else none,
            f"no TCP bind; connect to {ll['connect']}" if ll.get("connect") else "",
        ),
        Mechanism.LANDLOCK_SCOPE: (full if ll.get("scopes") else none, ""),
        Mechanism.SECCOMP: (Enforcement(seccomp) if seccomp in {"full", "partial"} else none, udp),
        Mechanism.CAPABILITIES: (full if applied.get("capabilities") else none, ""),
    }
