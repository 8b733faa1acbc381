"""A small typed ctypes binding of the three Landlock syscalls.

The PyPI ``landlock`` package handles filesystem rights only, treats a stale errno as failure and
never closes its ruleset fd, so egressbox binds the syscalls itself. Distribution headers may
predate the network, scope and logging constants, so every constant is defined here from the UAPI.

Typical use, always in a child process (restrict_self cannot be undone)::

    with Ruleset.create(fs=AccessFs.READ_FILE, net=AccessNet.CONNECT_TCP) as ruleset:
        ruleset.add_path_rule("/usr", AccessFs.READ_FILE)
        ruleset.add_net_port_rule(8080, AccessNet.CONNECT_TCP)
        ruleset.restrict_self()
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass
from enum import IntFlag
from types import TracebackType
from typing import Self

# Syscall numbers: Landlock arrived after the syscall tables were unified, so they are the same on
# every architecture.
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446

# landlock_create_ruleset() flags (used with a NULL attr and size 0).
CREATE_RULESET_VERSION = 1 << 0
CREATE_RULESET_ERRATA = 1 << 1

# landlock_add_rule() rule types.
RULE_PATH_BENEATH = 1
RULE_NET_PORT = 2

# prctl(2) option: Landlock refuses restrict_self without it unless the caller has CAP_SYS_ADMIN.
PR_SET_NO_NEW_PRIVS = 38

# The first ABI that knows each feature.
MIN_ABI_NET = 4
MIN_ABI_SCOPE = 6
MIN_ABI_LOG = 7


class AccessFs(IntFlag):
    """Filesystem access rights (LANDLOCK_ACCESS_FS_*)."""

    EXECUTE = 1 << 0
    WRITE_FILE = 1 << 1
    READ_FILE = 1 << 2
    READ_DIR = 1 << 3
    REMOVE_DIR = 1 << 4
    REMOVE_FILE = 1 << 5
    MAKE_CHAR = 1 << 6
    MAKE_DIR = 1 << 7
    MAKE_REG = 1 << 8
    MAKE_SOCK = 1 << 9
    MAKE_FIFO = 1 << 10
    MAKE_BLOCK = 1 << 11
    MAKE_SYM = 1 << 12
    REFER = 1 << 13  # ABI 2
    TRUNCATE = 1 << 14  # ABI 3
    IOCTL_DEV = 1 << 15  # ABI 5


class AccessNet(IntFlag):
    """Network access rights (LANDLOCK_ACCESS_NET_*), ABI 4 and later."""

    BIND_TCP = 1 << 0
    CONNECT_TCP = 1 << 1


class Scope(IntFlag):
    """IPC scoping (LANDLOCK_SCOPE_*), ABI 6 and later."""

    ABSTRACT_UNIX_SOCKET = 1 << 0
    SIGNAL = 1 << 1


class RestrictFlags(IntFlag):
    """landlock_restrict_self() flags (LANDLOCK_RESTRICT_SELF_*), ABI 7 and later."""

    LOG_SAME_EXEC_OFF = 1 << 0
    LOG_NEW_EXEC_ON = 1 << 1
    LOG_SUBDOMAINS_OFF = 1 << 2


# Empty sets, usable as defaults.
NO_FS = AccessFs(0)
NO_NET = AccessNet(0)
NO_SCOPE = Scope(0)
NO_RESTRICT_FLAGS = RestrictFlags(0)

# The kernel rejects a path rule on a non-directory that carries any directory-only right (EINVAL).
FILE_ACCESS = (
    AccessFs.EXECUTE
    | AccessFs.WRITE_FILE
    | AccessFs.READ_FILE
    | AccessFs.TRUNCATE
    | AccessFs.IOCTL_DEV
)

_FS_ABI1 = AccessFs((1 << 13) - 1)
# Filesystem rights added by each ABI after the first.
_FS_ADDED_BY_ABI = {2: AccessFs.REFER, 3: AccessFs.TRUNCATE, 5: AccessFs.IOCTL_DEV}


class RulesetAttr(ctypes.Structure):
    """struct landlock_ruleset_attr; older kernels read only a prefix (see ruleset_attr_size)."""

    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class PathBeneathAttr(ctypes.Structure):
    """struct landlock_path_beneath_attr: packed in the UAPI, so 12 bytes, not 16."""

    _pack_ = 1
    _fields_ = (
        ("allowed_access", ctypes.c_uint64),
        ("parent_fd", ctypes.c_int32),
    )


class NetPortAttr(ctypes.Structure):
    """struct landlock_net_port_attr."""

    _fields_ = (
        ("allowed_access", ctypes.c_uint64),
        ("port", ctypes.c_uint64),
    )


class LandlockError(OSError):
    """A Landlock syscall failed; ``errno`` holds the kernel's reason."""

    def __init__(self, err: int, call: str) -> None:
        super().__init__(err, f"{call}: {os.strerror(err)}")
        self.call = call


# A private handle on the C library, so our argtypes/restype settings touch no other module's.
_LIBC = ctypes.CDLL(None, use_errno=True)
_SYSCALL = _LIBC.syscall
_SYSCALL.restype = ctypes.c_long
_PRCTL = _LIBC.prctl
_PRCTL.restype = ctypes.c_int


def _syscall(call: str, number: int, *args: int) -> int:
    """Run a syscall; raise LandlockError with its errno only when it returns -1.

    syscall(2) is variadic, so every argument is passed as a C long (pointers as their address):
    passing a plain int would give the kernel an int-sized value with undefined upper bits.
    errno is read only on failure: a successful call leaves whatever stale value was there.
    """
    result = int(_SYSCALL(ctypes.c_long(number), *(ctypes.c_long(arg) for arg in args)))
    if result == -1:
        raise LandlockError(ctypes.get_errno(), call)
    return result


def create_ruleset(attr: RulesetAttr | None, size: int, flags: int = 0) -> int:
    """landlock_create_ruleset(2): a new ruleset fd (close-on-exec), or a version/errata query."""
    address = ctypes.addressof(attr) if attr is not None else 0
    return _syscall("landlock_create_ruleset", SYS_LANDLOCK_CREATE_RULESET, address, size, flags)


def add_rule(ruleset_fd: int, rule_type: int, attr: PathBeneathAttr | NetPortAttr) -> None:
    """landlock_add_rule(2)."""
    address = ctypes.addressof(attr)
    _syscall("landlock_add_rule", SYS_LANDLOCK_ADD_RULE, ruleset_fd, rule_type, address, 0)


def restrict_self(ruleset_fd: int, flags: int = 0) -> None:
    """landlock_restrict_self(2): irreversible for this thread; call it in a child only."""
    _syscall("landlock_restrict_self", SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, flags)


def set_no_new_privs() -> None:
    """prctl(PR_SET_NO_NEW_PRIVS, 1): required by restrict_self without CAP_SYS_ADMIN."""
    zero = ctypes.c_ulong(0)
    if _PRCTL(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), zero, zero, zero) == -1:
        raise LandlockError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 when unsupported (query_abi() keeps the reason)."""
    return query_abi().version


def errata() -> int:
    """The kernel's Landlock errata bitmask; 0 when unknown (kernels before the errata query)."""
    try:
        return create_ruleset(None, 0, CREATE_RULESET_ERRATA)
    except LandlockError:
        return 0


@dataclass(frozen=True)
class AbiInfo:
    """The result of asking the kernel for its Landlock ABI."""

    version: int
    errata: int
    # Why version is 0 (ENOSYS, EOPNOTSUPP, ...); 0 when Landlock is supported.
    errno: int = 0

    @property
    def reason(self) -> str:
        """A short sentence on why Landlock is unavailable; empty when it is available."""
        if self.version > 0:
            return ""
        return _UNSUPPORTED_REASONS.get(
            self.errno, f"Landlock query failed: {_errno_name(self.errno)}"
        )


_UNSUPPORTED_REASONS = {
    errno.ENOSYS: "the kernel has no Landlock syscalls (older than 5.13 or built without Landlock)",
    errno.EOPNOTSUPP: "Landlock is built in but not enabled at boot (add landlock to lsm=)",
}


def query_abi() -> AbiInfo:
    """Ask the kernel for its ABI version and errata; never raises for an unsupported kernel."""
    try:
        version = create_ruleset(None, 0, CREATE_RULESET_VERSION)
    except LandlockError as exc:
        return AbiInfo(version=0, errata=0, errno=exc.errno or 0)
    return AbiInfo(version=version, errata=errata())


def _errno_name(err: int) -> str:
    return errno.errorcode.get(err, f"errno {err}")


def fs_access_for_abi(abi: int) -> AccessFs:
    """Every filesystem right the given ABI knows."""
    if abi < 1:
        return AccessFs(0)
    rights = _FS_ABI1
    for added_in, right in _FS_ADDED_BY_ABI.items():
        if abi >= added_in:
            rights |= right
    return rights


def net_access_for_abi(abi: int) -> AccessNet:
    """Every network right the given ABI knows."""
    return AccessNet.BIND_TCP | AccessNet.CONNECT_TCP if abi >= MIN_ABI_NET else AccessNet(0)


def scopes_for_abi(abi: int) -> Scope:
    """Every scope the given ABI knows."""
    return Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL if abi >= MIN_ABI_SCOPE else Scope(0)


def restrict_flags_for_abi(abi: int) -> RestrictFlags:
    """Every restrict_self flag the given ABI knows."""
    all_flags = (
        RestrictFlags.LOG_SAME_EXEC_OFF
        | RestrictFlags.LOG_NEW_EXEC_ON
        | RestrictFlags.LOG_SUBDOMAINS_OFF
    )
    return all_flags if abi >= MIN_ABI_LOG else RestrictFlags(0)


def abi_features(abi: int) -> tuple[str, ...]:
    """What an ABI can enforce, coarsely: fs, tcp_ports (4), scopes (6), logging (7)."""
    thresholds = (("fs", 1), ("tcp_ports", MIN_ABI_NET), ("scopes", MIN_ABI_SCOPE))
    features = [name for name, first in thresholds if abi >= first]
    if abi >= MIN_ABI_LOG:
        features.append("logging")
    return tuple(features)


def ruleset_attr_size(abi: int) -> int:
    """How many bytes of RulesetAttr to pass: a kernel rejects a size it does not know (E2BIG)."""
    if abi >= MIN_ABI_SCOPE:
        return 24
    if abi >= MIN_ABI_NET:
        return 16
    return 8


class Ruleset:
    """An open Landlock ruleset: add rules, then restrict_self; the fd is closed by close().

    Rights are checked against what the ruleset handles and what its ABI knows before any syscall,
    so a mistake raises ValueError with a clear message instead of a bare EINVAL.
    """

    def __init__(self, fd: int, *, abi: int, fs: AccessFs, net: AccessNet, scoped: Scope) -> None:
        self._fd = fd
        self.abi = abi
        self.handled_fs = fs
        self.handled_net = net
        self.scoped = scoped

    @classmethod
    def create(
        cls,
        *,
        fs: AccessFs = NO_FS,
        net: AccessNet = NO_NET,
        scoped: Scope = NO_SCOPE,
        abi: int | None = None,
    ) -> Self:
        """Create a ruleset handling these rights; abi defaults to the kernel's.

        Raises ValueError for a right the ABI does not know (silently dropping it would leave it
        unrestricted) and LandlockError from the kernel (ENOMSG when nothing is handled).
        """
        if abi is None:
            info = query_abi()
            if info.version == 0:
                raise LandlockError(info.errno, "landlock_create_ruleset")
            abi = info.version
        _check_known(fs, fs_access_for_abi(abi), abi)
        _check_known(net, net_access_for_abi(abi), abi)
        _check_known(scoped, scopes_for_abi(abi), abi)
        attr = RulesetAttr(handled_access_fs=fs, handled_access_net=net, scoped=scoped)
        fd = create_ruleset(attr, ruleset_attr_size(abi))
        return cls(fd, abi=abi, fs=fs, net=net, scoped=scoped)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError("ruleset is closed")
        return self._fd

    def add_path_rule(self, path: str | os.PathLike[str], access: AccessFs) -> AccessFs:
        """Allow ``access`` beneath ``path``; returns the rights actually granted.

        On a non-directory only file rights apply (the kernel refuses the rest), so directory-only
        rights are dropped; when nothing is left no rule is added.
        """
        _check_subset(access, self.handled_fs, "filesystem")
        parent_fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            if not stat.S_ISDIR(os.fstat(parent_fd).st_mode):
                access &= FILE_ACCESS
            if access:
                attr = PathBeneathAttr(allowed_access=access, parent_fd=parent_fd)
                add_rule(self.fileno(), RULE_PATH_BENEATH, attr)
        finally:
            os.close(parent_fd)
        return access

    def add_net_port_rule(self, port: int, access: AccessNet) -> None:
        """Allow ``access`` (connect and/or bind) on a TCP port, for any address."""
        if not 0 <= port <= 0xFFFF:
            raise ValueError(f"TCP port out of range: {port}")
        _check_subset(access, self.handled_net, "network")
        if not access:
            raise ValueError("a port rule needs at least one network right")
        add_rule(self.fileno(), RULE_NET_PORT, NetPortAttr(allowed_access=access, port=port))

    def restrict_self(
        self, flags: RestrictFlags = NO_RESTRICT_FLAGS, *, no_new_privs: bool = True
    ) -> None:
        """Enforce the ruleset on the calling thread and its future children. Irreversible."""
        _check_known(flags, restrict_flags_for_abi(self.abi), self.abi)
        if no_new_privs:
            set_no_new_privs()
        restrict_self(self.fileno(), flags)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # A safety net only: an fd leaked into an exec'd child would let it add rules to a ruleset.
        self.close()


def _check_known(requested: IntFlag, known: IntFlag, abi: int) -> None:
    unknown = int(requested) & ~int(known)
    if unknown:
        kind = type(requested).__name__
        raise ValueError(f"{kind} bits {unknown:#x} are not supported by Landlock ABI {abi}")


def _check_subset(requested: IntFlag, handled: IntFlag, kind: str) -> None:
    extra = int(requested) & ~int(handled)
    if extra:
        raise ValueError(f"{kind} rights {extra:#x} are not handled by this ruleset")
