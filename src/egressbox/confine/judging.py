"""After a run that failed: what its plan meant for paths (`refusal_view`, which reads the
host then and only then), and which boundary the command's output or the kernel's audit log
shows refused it (confine/refusal.py); the report's seccomp row.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from egressbox.confine.grants import (
    Mechanism,
)
from egressbox.confine.spec import LaunchPlan

if TYPE_CHECKING:
    # Types only: the refusal classifier loads after a failed run, never before.
    from egressbox.confine.refusal import HostPath, PathPlan, RefusalRecord, SeccompKill
    from egressbox.confine.toolchains import CacheMode, CacheRoot


def seccomp_row() -> str:
    """The run report's seccomp detail: the allow list's size and the measurement behind it
    (loaded only for a report)."""
    from egressbox.confine.syscall_table import report_row

    return report_row()


def refusal_view(
    launcher: LaunchPlan,
    *,
    homes: tuple[str, ...],
    caches: tuple[CacheRoot, ...],
    cache_mode: CacheMode,
    read_only_workspaces: tuple[str, ...],
) -> PathPlan:
    """The filesystem side of the plan the launcher applied, for judging refusals (reads the
    host: /etc's entries the view covers, the grants' real paths; only after a failed run)."""
    from egressbox.confine.refusal import PathPlan

    mounts = launcher.has(Mechanism.MOUNT_NAMESPACE)
    landlock = launcher.has(Mechanism.LANDLOCK_FS)
    kernel: tuple[str, ...] = ()
    if mounts and launcher.uid == 0:
        from egressbox.confine.world import KERNEL_READ_ONLY

        kernel = KERNEL_READ_ONLY
    deny = launcher.deny if landlock else ()
    return PathPlan(
        homes=homes,
        read=launcher.read,
        write=launcher.write,
        # Masks and nested read-only roots are mounts, or (without a mount
        # namespace) Landlock grants that leave them out.
        deny=(*launcher.deny, *_etc_hidden()) if mounts else deny,
        read_only=launcher.read_only_inside_write if mounts or landlock else (),
        always_read_only=kernel,
        # The constructed root: nothing of the host exists but the grants.
        hidden=("/",) if mounts else (),
        bound_back=_visible(launcher) if mounts else (),
        landlock_fs=landlock,
        abstract_isolated=launcher.has(Mechanism.NETWORK_NAMESPACE)
        or launcher.has(Mechanism.LANDLOCK_SCOPE),
        caches=caches,
        cache_mode=cache_mode,
        cwd=launcher.cwd,
        read_only_workspaces=read_only_workspaces,
        seccomp=launcher.has(Mechanism.SECCOMP),
    )


def _etc_hidden() -> list[str]:
    """The /etc entries the child's view covers (walked again only when a run failed)."""
    from egressbox.confine.world import unreadable_to_others

    return unreadable_to_others("/etc")


def _visible(launcher: LaunchPlan) -> tuple[tuple[str, bool], ...]:
    """What exists in the child's view, and whether it may be written there."""
    from egressbox.confine.world import CONSTRUCTED

    # The private /tmp, /var/tmp and /run are not the host's: a host path there is absent.
    grants = launcher.world.grants if launcher.world is not None else ()
    made = tuple((p, p not in ("/proc", "/sys")) for p in CONSTRUCTED)
    return (*made, *((os.path.realpath(p), w) for p, w in grants))


def judge_output(
    text: str, view: PathPlan, lookup: Callable[[str], HostPath], proxy: str = ""
) -> RefusalRecord | None:
    """Which boundary the command's error output shows refused it (confine/refusal.py): a
    path refused outside the grants, a namespace refused by the seccomp filter, or (`proxy`:
    a private network namespace, where the proxy is all there is) a connection made without
    the proxy; None when it shows none."""
    from egressbox.confine.refusal import classify_direct, classify_namespace, classify_output

    found = classify_output(text, view, lookup) or classify_namespace(text, view)
    if found is None and proxy:
        found = classify_direct(text, proxy)
    return found


def seccomp_refusal(
    kernel_log: Sequence[str], *, since: float, uid: int, name: Callable[[SeccompKill], str]
) -> RefusalRecord:
    """The record of a command killed by SIGSYS, naming the call from the kernel's audit
    record of the kill when `kernel_log` holds one."""
    from egressbox.confine.refusal import seccomp_kills, seccomp_record

    return seccomp_record(seccomp_kills(kernel_log, since=since, uid=uid), name)


def with_requirement(record: RefusalRecord, profile: str) -> RefusalRecord:
    """A refusal record with Harn's `requirement` and `selector_honored` for `profile`."""
    from egressbox.confine import refusal

    return refusal.with_requirement(record, profile)
