"""What this host offers for confinement: the facts behind ``egressbox doctor`` and the profiles.

Every probe is cheap and never raises. Anything that changes process state irreversibly (unshare,
restrict_self, loading a seccomp filter) runs in a forked child that reports back through a pipe
and exits, so the calling process is never altered. The children only make a few syscalls and
exit: they import nothing and never return into the caller's code.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from egressbox.confine import caps, capture, landlock, notify
from egressbox.confine.blockers import (
    DEFAULT_ENTRY_POINT,
    LIMITED_NAMESPACES,
    Blocker,
    NamespaceFacts,
    blocker,
)
from egressbox.confine.grants import PROBED_MECHANISMS

# Namespace flags for unshare(2) (<sched.h>); Python 3.11 has no os.unshare.
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

PR_GET_SECCOMP = 21
PR_GET_NO_NEW_PRIVS = 39

# Bringing lo up in a fresh network namespace (<linux/sockios.h>, <net/if.h>).
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_IFREQ = "16sH22x"

MS_REC = 0x4000
MS_PRIVATE = 1 << 18

# close_range(2) is one of the unified syscall numbers, the same on every architecture.
SYS_CLOSE_RANGE = 436

# A probe child makes a handful of syscalls (a few milliseconds); this only guards against a hang.
CHILD_TIMEOUT_S = 2.0

_FLAG_NAMES = {
    CLONE_NEWUSER: "CLONE_NEWUSER",
    CLONE_NEWNET: "CLONE_NEWNET",
    CLONE_NEWNS: "CLONE_NEWNS",
    CLONE_NEWPID: "CLONE_NEWPID",
}

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.unshare.argtypes = (ctypes.c_int,)
_LIBC.unshare.restype = ctypes.c_int
_LIBC.mount.argtypes = (
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
)
_LIBC.mount.restype = ctypes.c_int
_LIBC.prctl.restype = ctypes.c_int
_LIBC.syscall.restype = ctypes.c_long


class Availability(StrEnum):
    """Whether a mechanism can be used here (stable values: they appear in ``doctor --json``)."""

    AVAILABLE = "available"
    # The kernel or a library lacks the mechanism: nothing this process could do would change that.
    ABSENT_ON_HOST = "absent_on_host"
    # The mechanism exists but this process may not use it (privilege, sysctl, container policy).
    CANNOT_ATTACH = "cannot_attach"


@dataclass(frozen=True)
class Mechanism:
    """One confinement mechanism as probed on this host."""

    name: str
    status: Availability
    detail: str
    # The Landlock ABI version (None for other mechanisms).
    abi: int | None = None
    # Coarse capabilities, e.g. Landlock's ("fs", "tcp_ports", "scopes", "logging").
    covers: tuple[str, ...] = ()

    @property
    def available(self) -> bool:
        return self.status is Availability.AVAILABLE


_NOT_PROBED = Mechanism("capture", Availability.CANNOT_ATTACH, "not probed")
_SUPERVISOR_NOT_PROBED = Mechanism("connect_supervisor", Availability.CANNOT_ATTACH, "not probed")


@dataclass(frozen=True)
class HostSupport:
    """Every mechanism egressbox can use, as seen by the process that probed."""

    euid: int
    landlock: Mechanism
    seccomp: Mechanism
    no_new_privs: Mechanism
    user_namespace: Mechanism
    network_namespace: Mechanism
    mount_namespace: Mechanism
    pid_namespace: Mechanism
    close_range: Mechanism
    # Transparent capture in the child's network namespace (local routes + nftables nat):
    # `run` captures every TCP connection and answers DNS there when this is available.
    capture: Mechanism = _NOT_PROBED
    # Without a network namespace, `run` holds the command's connects for the proxy with a
    # seccomp user-notification supervisor (confine/notify.py) when this is available.
    connect_supervisor: Mechanism = _SUPERVISOR_NOT_PROBED
    elapsed_s: float = field(default=0.0, compare=False)

    def mechanisms(self) -> tuple[Mechanism, ...]:
        """All mechanisms in a stable order."""
        return tuple(
            value for f in fields(self) if isinstance(value := getattr(self, f.name), Mechanism)
        )


class _StepError(Exception):
    """A named step failed with an errno (raised in probe children and in-process probes)."""

    def __init__(self, step: str, err: int) -> None:
        super().__init__(f"{step} failed: {_errno_name(err)}")
        self.step = step
        self.errno = err


@dataclass(frozen=True)
class _Outcome:
    """What a probe child reported; step and errno are set when it failed."""

    ok: bool
    step: str = ""
    errno: int = 0
    text: str = ""


# Every mechanism, in HostSupport's order.
MECHANISMS = PROBED_MECHANISMS


def _probes() -> dict[str, Callable[[], Mechanism]]:
    # Built per call, so that the functions are looked up when probed (tests replace some).
    return {
        "landlock": _probe_landlock,
        "seccomp": _probe_seccomp,
        "no_new_privs": _probe_no_new_privs,
        "user_namespace": lambda: _probe_namespace("user_namespace", 0),
        "network_namespace": lambda: _probe_namespace("network_namespace", CLONE_NEWNET),
        "mount_namespace": lambda: _probe_namespace("mount_namespace", CLONE_NEWNS),
        "pid_namespace": lambda: _probe_namespace("pid_namespace", CLONE_NEWPID),
        "close_range": _probe_close_range,
        "capture": _probe_capture,
        "connect_supervisor": _probe_connect_supervisor,
    }


def probe_host() -> HostSupport:
    """Probe every mechanism for the calling process; quick, side-effect free, never raises."""
    started = time.monotonic()
    results = {m.name: m for m in probe_mechanisms(MECHANISMS)}
    return HostSupport(euid=os.geteuid(), elapsed_s=time.monotonic() - started, **results)


def probe_mechanisms(names: Iterable[str]) -> tuple[Mechanism, ...]:
    """Probe only these mechanisms (names from MECHANISMS; others are ignored)."""
    probes = _probes()
    return tuple(_guarded(name, probes[name]) for name in names if name in probes)


def format_table(support: HostSupport) -> str:
    """A fixed-width table (mechanism, status, detail) for ``egressbox doctor``."""
    rows = [("MECHANISM", "STATUS", "DETAIL")]
    rows += [(m.name, str(m.status), m.detail) for m in support.mechanisms()]
    name_width = max(len(row[0]) for row in rows)
    status_width = max(len(row[1]) for row in rows)
    lines = [f"{n:<{name_width}}  {s:<{status_width}}  {d}".rstrip() for n, s, d in rows]
    return "\n".join(lines)


def to_json(support: HostSupport) -> dict[str, Any]:
    """A JSON-ready dict for ``egressbox doctor --json`` (keys are stable)."""
    return {
        "euid": support.euid,
        "mechanisms": {
            m.name: {
                "status": str(m.status),
                "detail": m.detail,
                "abi": m.abi,
                "covers": list(m.covers),
            }
            for m in support.mechanisms()
        },
    }


def _guarded(name: str, probe: Callable[[], Mechanism]) -> Mechanism:
    # A doctor that crashes on an odd host is useless: any surprise becomes a reported failure.
    try:
        return probe()
    except Exception as exc:
        return Mechanism(name, Availability.CANNOT_ATTACH, f"probe failed: {exc!r}")


# Landlock


def _probe_landlock() -> Mechanism:
    info = landlock.query_abi()
    if info.version == 0:
        status = Availability.ABSENT_ON_HOST
        if info.errno not in (errno.ENOSYS, errno.EOPNOTSUPP):
            # EPERM here is typically a container's seccomp policy: the kernel has Landlock, but
            # this process may not use it.
            status = Availability.CANNOT_ATTACH
        return Mechanism("landlock", status, info.reason, abi=0)
    covers = landlock.abi_features(info.version)
    detail = f"Landlock ABI {info.version} (errata {info.errata:#x}): {', '.join(covers)}"
    outcome = _run_in_child(lambda: _landlock_child(info.version))
    if not outcome.ok:
        reason = _outcome_text(outcome)
        failed = f"{detail}; restricting a test process failed: {reason}"
        return Mechanism("landlock", Availability.CANNOT_ATTACH, failed, abi=info.version)
    return Mechanism("landlock", Availability.AVAILABLE, detail, abi=info.version, covers=covers)


def _landlock_child(abi: int) -> None:
    # Proves restrict_self works for this process (no_new_privs included), not just that the
    # syscall exists.
    try:
        with landlock.Ruleset.create(fs=landlock.AccessFs.READ_FILE, abi=abi) as ruleset:
            ruleset.restrict_self()
    except landlock.LandlockError as exc:
        raise _StepError(exc.call, exc.errno or 0) from exc


# seccomp


def _probe_seccomp() -> Mechanism:
    mode = _prctl(PR_GET_SECCOMP)
    if mode == -1:
        err = ctypes.get_errno()
        reason = f"prctl(PR_GET_SECCOMP) failed: {_errno_name(err)}"
        status = Availability.ABSENT_ON_HOST if err == errno.EINVAL else Availability.CANNOT_ATTACH
        return Mechanism("seccomp", status, f"{reason}; the kernel has no seccomp")
    try:
        from egressbox.confine.seccomp import _known_sonames

        with _known_sonames():
            import pyseccomp
    except (ImportError, OSError, RuntimeError) as exc:
        reason = f"pyseccomp/libseccomp not usable: {exc}"
        return Mechanism("seccomp", Availability.ABSENT_ON_HOST, reason)
    seccomp_filter = _build_test_filter(pyseccomp)
    outcome = _run_in_child(lambda: _seccomp_child(seccomp_filter))
    if not outcome.ok:
        status = Availability.CANNOT_ATTACH
        if outcome.errno == errno.EINVAL:
            status = Availability.ABSENT_ON_HOST  # seccomp strict mode only: no filter mode
        reason = f"loading a test filter failed: {_outcome_text(outcome)}"
        return Mechanism("seccomp", status, reason)
    detail = f"seccomp filter mode (this process: mode {mode}); {_libseccomp_api(pyseccomp)}"
    return Mechanism("seccomp", Availability.AVAILABLE, detail)


def _libseccomp_api(pyseccomp: Any) -> str:
    # The API level says which kernel features libseccomp found (e.g. 4: KILL_PROCESS).
    try:
        return f"libseccomp API level {pyseccomp.get_api()}; a test filter loads"
    except NotImplementedError:
        return "a test filter loads"


def _build_test_filter(pyseccomp: Any) -> Any:
    # Built here, in the caller, because that is where the real filter will be built (before
    # Landlock); masked like the real filter, since the kernel truncates the argument to int.
    seccomp_filter = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    packet = pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0xFFFFFFFF, socket.AF_PACKET)
    seccomp_filter.add_rule(pyseccomp.ERRNO(errno.EPERM), "socket", packet)
    return seccomp_filter


def _seccomp_child(seccomp_filter: Any) -> None:
    try:
        seccomp_filter.load()
    except OSError as exc:
        raise _StepError("seccomp_load", exc.errno or 0) from exc


# no_new_privs


def _probe_no_new_privs() -> Mechanism:
    state = _prctl(PR_GET_NO_NEW_PRIVS)
    if state == -1:
        err = ctypes.get_errno()
        reason = f"prctl(PR_GET_NO_NEW_PRIVS) failed: {_errno_name(err)}"
        status = Availability.ABSENT_ON_HOST if err == errno.EINVAL else Availability.CANNOT_ATTACH
        return Mechanism("no_new_privs", status, reason)
    current = "on" if state else "off"
    detail = f"prctl(PR_SET_NO_NEW_PRIVS) supported (this process: {current})"
    return Mechanism("no_new_privs", Availability.AVAILABLE, detail)


# Namespaces


_NS_PROC_NAMES = {0: "user", CLONE_NEWNET: "net", CLONE_NEWNS: "mnt", CLONE_NEWPID: "pid"}
_NS_CHECKS = {
    CLONE_NEWNET: "lo can be brought up",
    CLONE_NEWNS: "/ can be made private",
    CLONE_NEWPID: "its first process is pid 1",
}


def _probe_namespace(name: str, flag: int) -> Mechanism:
    """Probe one namespace type; ``flag`` 0 means the user namespace alone."""
    if not os.path.exists(f"/proc/self/ns/{_NS_PROC_NAMES[flag]}"):
        return Mechanism(name, Availability.ABSENT_ON_HOST, "the kernel lacks this namespace type")
    flags = flag or CLONE_NEWUSER
    if not caps.holds_sys_admin():
        # Without CAP_SYS_ADMIN (root or not), only a new user namespace grants the right to
        # create the others.
        flags |= CLONE_NEWUSER
    outcome = _run_in_child(lambda: _namespace_child(flags))
    call = f"unshare({_flag_text(flags)})"
    if outcome.ok:
        check = _NS_CHECKS.get(flag)
        return Mechanism(
            name, Availability.AVAILABLE, f"{call} works" + (f"; {check}" if check else "")
        )
    return _namespace_failure(name, flags, outcome)


def _namespace_child(flags: int) -> None:
    ids = (os.geteuid(), os.getegid())  # the overflow id once unshared, until mapped
    if _LIBC.unshare(flags) == -1:
        raise _StepError(f"unshare({_flag_text(flags)})", ctypes.get_errno())
    if flags & CLONE_NEWUSER:
        _map_ids(*ids)
    if flags & CLONE_NEWNET:
        _bring_lo_up()
    if flags & CLONE_NEWNS:
        _make_root_private()
    if flags & CLONE_NEWPID:
        _check_pid_one()


def _map_ids(uid: int, gid: int) -> None:
    # What the launcher does next: its own ids, 1:1. Mapping uid 0 needs CAP_SETFCAP when the
    # namespace was made (Linux 5.12): uid 0 of a capability-less sandbox cannot.
    from egressbox.confine import netns

    try:
        netns.write_id_maps(uid, gid)
    except OSError as exc:
        raise _StepError("writing the new user namespace's id maps", exc.errno or 0) from exc


def _bring_lo_up() -> None:
    # One ioctl pair on any socket; an exec'd `ip link` would need a uid map first.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0))
            flags = struct.unpack(_IFREQ, raw)[1]
            fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))
        except OSError as exc:
            raise _StepError("bringing lo up (SIOCSIFFLAGS)", exc.errno or 0) from exc


def _make_root_private() -> None:
    # The launcher's first step in a mount namespace: without it mounts propagate to the host.
    if _LIBC.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == -1:
        raise _StepError("mount(/, MS_REC|MS_PRIVATE)", ctypes.get_errno())


def _check_pid_one() -> None:
    # unshare(CLONE_NEWPID) moves only the caller's future children into the new namespace.
    pid = os.fork()
    if pid == 0:
        os._exit(0 if os.getpid() == 1 else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise _StepError("first process in the new pid namespace is not pid 1", 0)


def _namespace_failure(name: str, flags: int, outcome: _Outcome) -> Mechanism:
    text = _outcome_text(outcome)
    if outcome.errno == errno.EINVAL and outcome.step.startswith("unshare"):
        detail = f"{text}; the kernel does not support this namespace type"
        return Mechanism(name, Availability.ABSENT_ON_HOST, detail)
    return Mechanism(name, Availability.CANNOT_ATTACH, text + _namespace_hint(flags, outcome.errno))


def _namespace_hint(flags: int, err: int) -> str:
    if err == errno.ENOSPC:
        return "; a namespace limit (/proc/sys/user/max_*_namespaces) is 0 or reached"
    if err != errno.EPERM:
        return ""
    status = _status_numbers()
    if status.get("Seccomp") == 2 and status.get("Seccomp_filters", 0) > 0:
        # A container's seccomp profile: capabilities and sysctls would not change the answer.
        return "; a seccomp filter on this process may refuse it (a container's profile?)"
    return _eperm_hint(flags)


def _eperm_hint(flags: int) -> str:
    if not flags & CLONE_NEWUSER:
        return "; this process lacks CAP_SYS_ADMIN (a container without privileges?)"
    if caps.holds_sys_admin():
        return "; user namespaces are refused even with CAP_SYS_ADMIN (a security policy?)"
    if _read_sysctl("kernel/apparmor_restrict_unprivileged_userns") == "1":  # Ubuntu 23.10+
        sysctl = "kernel.apparmor_restrict_unprivileged_userns"
        return f"; AppArmor restricts unprivileged user namespaces ({sysctl}=1)"
    return "; enable kernel.unprivileged_userns_clone or run as root"


# -- what blocks namespaces (confine/blockers.py tells the cause from these facts) --------------

APPARMOR_PATHS = ("/sys/kernel/security/apparmor", "/sys/module/apparmor")


def blocker_facts() -> NamespaceFacts:
    """The facts behind "what blocks namespaces here": a test unshare of the network namespace
    (with a user namespace without CAP_SYS_ADMIN) in a child, /proc/self/status, the uid map,
    the sysctls and whether AppArmor is loaded. A few milliseconds; never raises."""
    flags = CLONE_NEWNET | (0 if caps.holds_sys_admin() else CLONE_NEWUSER)
    try:
        outcome = _run_in_child(lambda: _namespace_child(flags))
    except OSError as exc:
        outcome = _Outcome(ok=False, step="fork", errno=exc.errno or 0)
    status = _status_numbers()
    return NamespaceFacts(
        euid=os.geteuid(),
        failed_step="" if outcome.ok else (outcome.step or outcome.text or "probe"),
        failed_errno=0 if outcome.ok else outcome.errno,
        seccomp_mode=status.get("Seccomp", 0),
        seccomp_filters=status.get("Seccomp_filters", 0),
        cap_eff=status.get("CapEff", 0),
        uid_map=_uid_map(),
        max_user_namespaces=_sysctl_int("user/max_user_namespaces"),
        unprivileged_userns_clone=_sysctl_int("kernel/unprivileged_userns_clone"),
        apparmor_restrict=_sysctl_int("kernel/apparmor_restrict_unprivileged_userns"),
        apparmor_loaded=any(os.path.exists(p) for p in APPARMOR_PATHS),
        kubernetes=bool(os.environ.get("KUBERNETES_SERVICE_HOST")),
        entry_point=entry_point(),
        namespace_limits=tuple(
            (name, _sysctl_int(f"user/max_{name}_namespaces"))
            for name in LIMITED_NAMESPACES
            if name != "user"
        ),
    )


def namespace_blocker() -> Blocker | None:
    """What keeps this process from creating namespaces, with the fix; None when nothing does."""
    return blocker(blocker_facts())


def entry_point() -> str:
    """The installed `egressbox` script this process runs as, links resolved (what an AppArmor
    profile must name), else the one on PATH, else where packages put it."""
    import shutil

    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "egressbox" and os.path.isfile(argv0):
        return os.path.realpath(argv0)
    found = shutil.which("egressbox")
    return os.path.realpath(found) if found else DEFAULT_ENTRY_POINT


# /proc/self/status fields read as numbers (CapEff is hexadecimal).
_STATUS_BASES = {"Seccomp": 10, "Seccomp_filters": 10, "CapEff": 16}


def _status_numbers() -> dict[str, int]:
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name in _STATUS_BASES:
                    with contextlib.suppress(ValueError):
                        found[name] = int(value.strip(), _STATUS_BASES[name])
    except OSError:
        pass
    return found


def _uid_map() -> tuple[tuple[int, int, int], ...]:
    try:
        with open("/proc/self/uid_map", encoding="ascii") as handle:
            rows = [line.split() for line in handle]
    except OSError:
        return ()
    try:
        return tuple((int(a), int(b), int(c)) for a, b, c in rows)
    except ValueError:
        return ()


def _sysctl_int(name: str) -> int | None:
    text = _read_sysctl(name)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _read_sysctl(name: str) -> str | None:
    try:
        with open(f"/proc/sys/{name}", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return None


# close_range


def _probe_close_range() -> Mechanism:
    # Close a descriptor we own: the raw syscall avoids depending on the C library's version.
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    result = int(
        _LIBC.syscall(
            ctypes.c_long(SYS_CLOSE_RANGE), ctypes.c_long(fd), ctypes.c_long(fd), ctypes.c_long(0)
        )
    )
    if result == -1:
        err = ctypes.get_errno()
        os.close(fd)
        status = Availability.ABSENT_ON_HOST if err == errno.ENOSYS else Availability.CANNOT_ATTACH
        return Mechanism("close_range", status, f"close_range(2) failed: {_errno_name(err)}")
    return Mechanism("close_range", Availability.AVAILABLE, "close_range(2) works")


# Capture (nftables nat + local routes in a throwaway namespace)


def _probe_capture() -> Mechanism:
    loads, why = capture.available()
    if not loads:
        return Mechanism("capture", Availability.ABSENT_ON_HOST, why)
    outcome = _run_in_child(_capture_child)
    if not outcome.ok:
        text = _outcome_text(outcome)
        return Mechanism("capture", Availability.CANNOT_ATTACH, f"a test namespace failed: {text}")
    detail = f"{why}; a test namespace redirected a connect and read its destination back"
    return Mechanism("capture", Availability.AVAILABLE, detail)


def _capture_child() -> None:
    try:
        capture.self_test()
    except OSError as exc:
        raise _StepError(exc.strerror or str(exc), exc.errno or 0) from exc
    except capture.CaptureError as exc:
        raise _StepError(str(exc), 0) from exc


# The connect supervisor (seccomp user notification + pidfd_getfd, no namespace needed)

SUPERVISOR_WORKS = (
    "seccomp user notification and pidfd_getfd work: without a network namespace, connects "
    "are held for the proxy"
)


def _probe_connect_supervisor() -> Mechanism:
    name = "connect_supervisor"
    why = notify.support()
    if why:
        # pidfd_open/pidfd_getfd refused: a filter or security module above us; anything
        # else: the kernel (or this architecture) lacks the mechanism.
        refused = why.startswith(("pidfd_open", "pidfd_getfd"))
        status = Availability.CANNOT_ATTACH if refused else Availability.ABSENT_ON_HOST
        return Mechanism(name, status, why)
    # The in-process checks say the kernel has both calls; loading the real filter with a
    # listener proves a filter above us allows it (one listener per filter chain: EBUSY
    # inside another supervised run).
    outcome = _run_in_child(_connect_filter_child)
    if not outcome.ok:
        text = _outcome_text(outcome)
        return Mechanism(name, Availability.CANNOT_ATTACH, f"loading the connect filter: {text}")
    return Mechanism(name, Availability.AVAILABLE, SUPERVISOR_WORKS)


def _connect_filter_child() -> None:
    try:
        notify.load(notify.program())
    except OSError as exc:
        raise _StepError("seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)", exc.errno or 0) from exc


# Child processes


def _run_in_child(action: Callable[[], None]) -> _Outcome:
    """Run ``action`` in a forked child; the outcome comes back through a pipe."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:
        os.close(read_fd)
        _child_main(action, write_fd)
    os.close(write_fd)
    try:
        payload = _read_until_eof(read_fd, CHILD_TIMEOUT_S)
    finally:
        os.close(read_fd)
    return _reap(pid, payload)


def _child_main(action: Callable[[], None], write_fd: int) -> None:
    # Never return: the child must not run the caller's code, atexit handlers or buffered flushes.
    report: dict[str, Any] = {}
    try:
        action()
    except _StepError as exc:
        report = {"step": exc.step, "errno": exc.errno}
    except BaseException as exc:
        report = {"text": repr(exc)}
    try:
        os.write(write_fd, json.dumps(report).encode())
    finally:
        os._exit(0)


def _read_until_eof(fd: int, timeout_s: float) -> bytes | None:
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    while (remaining := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    return None


def _reap(pid: int, payload: bytes | None) -> _Outcome:
    if payload is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return _Outcome(ok=False, text=f"probe child timed out after {CHILD_TIMEOUT_S} s")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return _Outcome(
            ok=False, text=f"probe child killed by {signal.Signals(os.WTERMSIG(status)).name}"
        )
    try:
        report = json.loads(payload) if payload else {"text": "probe child reported nothing"}
    except ValueError:
        report = {"text": f"unreadable probe report {payload[:80]!r}"}
    if not report:
        return _Outcome(ok=True)
    return _Outcome(
        ok=False,
        step=str(report.get("step", "")),
        errno=int(report.get("errno", 0)),
        text=str(report.get("text", "")),
    )


# Helpers


def _prctl(option: int) -> int:
    zero = ctypes.c_ulong(0)
    return int(_LIBC.prctl(ctypes.c_int(option), zero, zero, zero, zero))


def _outcome_text(outcome: _Outcome) -> str:
    if outcome.step and outcome.errno:
        return f"{outcome.step} failed: {_errno_name(outcome.errno)}"
    return outcome.step or outcome.text or "unknown failure"


def _flag_text(flags: int) -> str:
    return "|".join(name for bit, name in _FLAG_NAMES.items() if flags & bit)


def _errno_name(err: int) -> str:
    return errno.errorcode.get(err, f"errno {err}")
