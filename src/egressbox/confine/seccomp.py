"""The seccomp filter for confined children (DESIGN section 7, "seccomp").

An allow list: the system calls in confine/syscall_table.py (measured from real tools, each
with its reason) run; every other call this kernel table knows gets EPERM; a call newer than
the table, or a number no kernel has, gets ENOSYS, the answer of a kernel without it, so that
callers fall back (as they do from io_uring and clone3, which the table sends there on purpose).

Within the list, argument rules close what the network namespace and Landlock do not see:
socket families and protocols that never pass Landlock's TCP hooks (UDP, raw, packet, netlink,
vsock, MPTCP, SCTP), TCP Fast Open sends (landlock-lsm/linux#41), new namespaces (unshare and
clone with CLONE_NEW*), typing into the user's terminal (TIOCSTI), and personality flags. Each
such call has refusal rules (an errno a program already handles) and allow rules for exactly
the other argument values: libseccomp lets an unconditional rule override conditional ones, so
"refuse these values, allow the rest" has to be spelt out as both halves.

Only a syscall made through a non-native ABI (i386 ``int 0x80``, x32) kills the process: the
rules describe native syscall numbers only.

Integer arguments reach seccomp as the full 64-bit register, while the kernel truncates most of
them to ``int`` (FIELD-NOTES): an equality on the value alone is evaded by
``socket(0x1_00000011, ...)``. Each comparison is therefore either masked to the bits the kernel
reads, or an unsigned range over all 64 bits in which any stray high bit refuses.

Two steps, because ``import pyseccomp`` runs ``ctypes.util.find_library``, which may spawn
ldconfig and needs a temporary directory::

    prepared = prepare(SeccompOptions())  # early, before Landlock restricts the filesystem
    ...                                   # Landlock, capabilities, close_range
    report = prepared.load()              # the last step before exec; sets no_new_privs

Importing this module never imports pyseccomp, so it works (and reports "none") without it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import termios
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Protocol, cast

from egressbox.confine.syscall_table import (
    ALLOWED,
    ARGUMENT_CHECKED,
    FALLBACK,
    NEWER_NUMBERS,
    summary,
)
from egressbox.core.errors import EgressboxError

# libseccomp's public ABI (seccomp.h): actions and filter attributes. Defined here so that
# planning needs no pyseccomp; libseccomp cannot change these values without breaking every user.
ACT_ALLOW = 0x7FFF0000
ACT_KILL_PROCESS = 0x80000000
ACT_KILL_THREAD = 0x00000000
_ACT_ERRNO = 0x00050000
_ATTR_ACT_BADARCH = 2
_ATTR_CTL_TSYNC = 4
_ATTR_CTL_OPTIMIZE = 8

# The sign libseccomp gives a name it does not know at all (__NR_SCMP_ERROR); other negative
# numbers are pseudo-syscalls: names it knows that do not exist on this architecture.
_NR_UNKNOWN = -1

# Socket constants (<sys/socket.h>, <netinet/in.h>, <linux/tcp.h>).
SOCK_TYPE_MASK = 0xF  # the kernel masks the type with this; the rest are SOCK_NONBLOCK/CLOEXEC
IPPROTO_TCP = 6
IPPROTO_UDP = 17
MSG_FASTOPEN = 0x20000000
TCP_FASTOPEN_CONNECT = 30

# Namespace flags (<linux/sched.h>).
CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# clone(2) keeps its exit signal in the low byte, so CLONE_NEWTIME (0x80) is only reachable
# through unshare(2) and clone3(2): the kernel discards those bits of a clone() flags word.
CLONE_NEW_FLAGS = (
    CLONE_NEWNS,
    CLONE_NEWCGROUP,
    CLONE_NEWUTS,
    CLONE_NEWIPC,
    CLONE_NEWUSER,
    CLONE_NEWPID,
    CLONE_NEWNET,
)
UNSHARE_NEW_FLAGS = (*CLONE_NEW_FLAGS, CLONE_NEWTIME)

# personality(2): the default persona and the query value (both harmless).
PER_LINUX = 0
PERSONALITY_QUERY = 0xFFFFFFFF

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF

# Syscalls newer than the installed libseccomp may know only by number. Since Linux 5.1 every
# new syscall has one number on all architectures but alpha and mips, so the number is safe to
# use where the native ABI is one of these (AUDIT_ARCH_* values).
_UNIFIED_TABLE_ARCHES = frozenset(
    {
        0xC000003E,  # x86_64
        0x40000003,  # i386
        0xC00000B7,  # aarch64
        0x40000028,  # arm
        0xC00000F3,  # riscv64
        0xC0000102,  # loongarch64
        0xC0000015,  # ppc64le
        0x80000015,  # ppc64
        0x80000016,  # s390x
    }
)
# Every number a native syscall of the supported architectures can have (x32's start at 512
# and belong to another ABI, which the bad-arch action handles): scanned for names to refuse.
_SCAN_LIMIT = 1024


class SeccompUnavailableError(EgressboxError):
    """pyseccomp or libseccomp cannot be used in this process (the message says why)."""


class Status(StrEnum):
    """How much of the filter is in force (stable values: they appear in run reports)."""

    FULL = "full"
    PARTIAL = "partial"
    NONE = "none"


class CmpOp(IntEnum):
    """libseccomp comparison operators (enum scmp_compare); only these three are needed."""

    EQ = 4
    GT = 6
    MASKED_EQ = 7


@dataclass(frozen=True)
class SeccompOptions:
    """What the filter allows beyond TCP to the proxy.

    There is deliberately no option for bind/listen: the filter never restricts them (Landlock
    rules TCP bind ports, and the network namespace decides what a listener can be reached from).
    """

    # Unix sockets: build servers, ssh-agent and dbus clients need them; pathname sockets of the
    # host are hidden by the mount namespace and abstract ones by Landlock's scope.
    allow_unix_sockets: bool = True
    # A syscall through a non-native ABI kills the process; False makes it fail with ENOSYS
    # instead. Either way it never runs, since the rules only know native syscall numbers.
    kill_on_bad_arch: bool = True
    # UDP sockets (SOCK_DGRAM, protocol 0 or UDP) for IPv4 and IPv6: only for a child whose
    # network namespace is captured (confine/capture.py), where a datagram reaches nothing but
    # egressbox's DNS socket; glibc's resolver needs them. Raw, ICMP, UDP-Lite stay refused.
    allow_udp: bool = False


@dataclass(frozen=True)
class ArgCmp:
    """One comparison of a syscall argument (libseccomp's struct scmp_arg_cmp).

    EQ and GT compare the whole 64-bit register, unsigned. MASKED_EQ tests
    ``arg & datum_a == datum_b``.
    """

    index: int
    op: CmpOp
    datum_a: int
    datum_b: int = 0


@dataclass(frozen=True)
class Rule:
    """Return ``errno`` from ``syscall`` when every comparison holds (or always, without any)."""

    syscall: str
    errno: int
    args: tuple[ArgCmp, ...] = ()


@dataclass(frozen=True)
class RuleGroup:
    """Rules that close one hole, with the reason they exist."""

    name: str
    why: str
    rules: tuple[Rule, ...]

    @property
    def syscalls(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(rule.syscall for rule in self.rules))

    @property
    def actions(self) -> tuple[str, ...]:
        """The answers these rules give, e.g. ("EPERM",)."""
        return tuple(dict.fromkeys(_errno_name(rule.errno) for rule in self.rules))


@dataclass(frozen=True)
class SeccompReport:
    """What a loaded filter enforces, or why nothing is enforced."""

    status: Status
    reason: str
    # The rules in force, grouped by the hole each closes.
    groups: tuple[RuleGroup, ...] = ()
    # Syscalls this architecture does not have: nothing to enforce, so no gap.
    skipped: tuple[str, ...] = ()
    # Syscalls whose rules could not be added: a gap, so the status is "partial".
    failed: tuple[str, ...] = ()
    # What a syscall through a non-native ABI gets: KILL_PROCESS, KILL_THREAD or ERRNO(ENOSYS).
    bad_arch_action: str = ""
    notes: tuple[str, ...] = ()
    # The allow list in force on this architecture (argument-checked calls included).
    allowed: tuple[str, ...] = ()
    # Calls this architecture's table knows that are refused with EPERM; anything else: ENOSYS.
    refused: tuple[str, ...] = ()

    @property
    def enforced(self) -> bool:
        return self.status is not Status.NONE

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (keys are stable)."""
        return {
            "status": str(self.status),
            "reason": self.reason,
            "groups": [
                {
                    "name": group.name,
                    "why": group.why,
                    "syscalls": list(group.syscalls),
                    "actions": list(group.actions),
                }
                for group in self.groups
            ],
            "skipped": list(self.skipped),
            "failed": list(self.failed),
            "bad_arch_action": self.bad_arch_action,
            "notes": list(self.notes),
            "allowed": list(self.allowed),
            "refused": list(self.refused),
        }


# The rules (pure: no pyseccomp needed)


def plan(options: SeccompOptions | None = None) -> tuple[RuleGroup, ...]:
    """The argument rules (refusals) for ``options``, grouped; architecture-neutral names.

    Every syscall they name is in syscall_table.ARGUMENT_CHECKED; allowances() holds the other
    half of each (the argument values that run).
    """
    options = options or SeccompOptions()
    return (
        _socket_families(options),
        _inet_socket_types(options),
        _inet_protocols(options),
        _fast_open(),
        _namespaces(),
        _terminal(),
        _personality(),
    )


def _socket_families(options: SeccompOptions) -> RuleGroup:
    allowed = [socket.AF_INET, socket.AF_INET6]
    if options.allow_unix_sockets:
        allowed.append(socket.AF_UNIX)
    # Refused over all 64 bits: a family with any high bit set is refused, even though the
    # kernel would read 0x1_00000002 as AF_INET (no real program passes one).
    rules = [
        Rule("socket", errno.EAFNOSUPPORT, (cmp,))
        for cmp in _outside(0, [int(family) for family in allowed])
    ]
    if options.allow_unix_sockets:
        # socketpair() only makes sense for AF_UNIX; any other family is refused the same way.
        rules += [
            Rule("socketpair", errno.EAFNOSUPPORT, (cmp,))
            for cmp in _outside(0, [int(socket.AF_UNIX)])
        ]
    else:
        rules.append(Rule("socketpair", errno.EAFNOSUPPORT))
    return RuleGroup(
        "socket families",
        "only unix, IPv4 and IPv6 sockets: packet, netlink, vsock, alg, xdp, bluetooth and the "
        "rest bypass Landlock's TCP rules and reach the kernel's least-audited code",
        tuple(rules),
    )


def _inet_socket_types(options: SeccompOptions) -> RuleGroup:
    # The kernel reads the type as (int)arg & 0xf; the other bits may only be SOCK_NONBLOCK and
    # SOCK_CLOEXEC (anything else is EINVAL), so a 4-bit masked test sees exactly its choice.
    # The family is compared exactly: a family with high bits was refused above.
    kinds = [int(socket.SOCK_STREAM)] + ([int(socket.SOCK_DGRAM)] if options.allow_udp else [])
    not_allowed = _outside(1, kinds, bits=4)
    rules = tuple(
        Rule("socket", errno.EPERM, (ArgCmp(0, CmpOp.EQ, int(family)), cmp))
        for family in (socket.AF_INET, socket.AF_INET6)
        for cmp in not_allowed
    )
    if options.allow_udp:
        why = (
            "IP sockets must be SOCK_STREAM or SOCK_DGRAM: raw and seqpacket sockets would reach "
            "whatever the namespace routes; datagrams are allowed only because every one of "
            "them ends at egressbox's DNS socket or nowhere (capture)"
        )
    else:
        why = (
            "IP sockets must be SOCK_STREAM: Landlock's rules cover TCP only, so UDP (DNS, QUIC), "
            "raw and seqpacket sockets would reach anything the namespace routes"
        )
    return RuleGroup("inet socket types", why, rules)


def _inet_protocols(options: SeccompOptions) -> RuleGroup:
    # Protocol 0 and IPPROTO_TCP both mean TCP for a stream socket. MPTCP (262), SCTP (132) and
    # SMC (IPPROTO_SMC, 256) are stream sockets too but skip Landlock's TCP hooks.
    # EPROTONOSUPPORT is what a kernel without them answers, so MPTCP-aware clients (Go's net
    # package, mptcpize) fall back to plain TCP. Compared over 64 bits, like the family.
    # With UDP allowed, a datagram socket must be UDP (0 or IPPROTO_UDP): not ICMP ("ping"
    # sockets), UDP-Lite or SCTP.
    kinds = [(int(socket.SOCK_STREAM), (0, IPPROTO_TCP))]
    if options.allow_udp:
        kinds.append((int(socket.SOCK_DGRAM), (0, IPPROTO_UDP)))
    rules = tuple(
        Rule(
            "socket",
            errno.EPROTONOSUPPORT,
            (
                ArgCmp(0, CmpOp.EQ, int(family)),
                ArgCmp(1, CmpOp.MASKED_EQ, SOCK_TYPE_MASK, kind),
                cmp,
            ),
        )
        for kind, protocols in kinds
        for family in (socket.AF_INET, socket.AF_INET6)
        for cmp in _outside(2, protocols)
    )
    why = "IP stream sockets must be TCP: MPTCP, SCTP and SMC bypass Landlock's TCP connect rule"
    if options.allow_udp:
        why += "; IP datagram sockets must be UDP (no ICMP, UDP-Lite or SCTP)"
    return RuleGroup("inet protocols", why, rules)


def _fast_open() -> RuleGroup:
    fastopen = (MSG_FASTOPEN, MSG_FASTOPEN)
    return RuleGroup(
        "TCP Fast Open",
        "a MSG_FASTOPEN send connects without passing Landlock's connect hook "
        "(landlock-lsm/linux#41), so it could reach any port",
        (
            # The flags are unsigned int in each call; testing the one bit is exact. EOPNOTSUPP
            # is what the kernel answers when Fast Open is off, so clients already handle it.
            Rule("sendto", errno.EOPNOTSUPP, (ArgCmp(3, CmpOp.MASKED_EQ, *fastopen),)),
            Rule("sendmsg", errno.EOPNOTSUPP, (ArgCmp(2, CmpOp.MASKED_EQ, *fastopen),)),
            Rule("sendmmsg", errno.EOPNOTSUPP, (ArgCmp(3, CmpOp.MASKED_EQ, *fastopen),)),
            # TCP_FASTOPEN_CONNECT turns connect() + write() into a Fast Open send. connect()
            # still passes Landlock's hook, so this is defence in depth: no Fast Open path at
            # all. ENOPROTOOPT is a kernel without the option: clients (curl) carry on without.
            Rule(
                "setsockopt",
                errno.ENOPROTOOPT,
                (
                    ArgCmp(1, CmpOp.MASKED_EQ, _U32, IPPROTO_TCP),
                    ArgCmp(2, CmpOp.MASKED_EQ, _U32, TCP_FASTOPEN_CONNECT),
                ),
            ),
        ),
    )


def _namespaces() -> RuleGroup:
    clone_flags = _clone_flags_index()
    rules = [
        Rule("clone", errno.EPERM, (ArgCmp(clone_flags, CmpOp.MASKED_EQ, flag, flag),))
        for flag in CLONE_NEW_FLAGS
    ]
    # unshare takes unsigned long, but every namespace bit is in the low 32; one rule per bit.
    rules += [
        Rule("unshare", errno.EPERM, (ArgCmp(0, CmpOp.MASKED_EQ, flag, flag),))
        for flag in UNSHARE_NEW_FLAGS
    ]
    # clone3 keeps its flags in memory, where seccomp cannot look: it is not in the allow list,
    # so it gets ENOSYS and glibc, Rust and the rest fall back to clone(), checked here.
    return RuleGroup(
        "new namespaces",
        "a new user namespace gives the child every capability inside it (and the kernel code "
        "that needs them); a new network namespace is an escape from the pinned one",
        tuple(rules),
    )


def _terminal() -> RuleGroup:
    # The command is an unsigned int: masked, so high bits cannot hide it.
    return RuleGroup(
        "terminal injection",
        "TIOCSTI types into an inherited terminal (dev.tty.legacy_tiocsti=1 measured here): "
        "commands would run in the user's shell after the child exits; TIOCLINUX can paste "
        "the console selection the same way",
        tuple(
            Rule("ioctl", errno.EPERM, (ArgCmp(1, CmpOp.MASKED_EQ, _U32, command),))
            for command in _terminal_commands()
        ),
    )


def _terminal_commands() -> tuple[int, int]:
    # Values from termios, which match the running kernel's architecture (they differ on mips,
    # ppc, sparc).
    return int(termios.TIOCSTI), int(getattr(termios, "TIOCLINUX", 0x541C))


def _personality() -> RuleGroup:
    return RuleGroup(
        "personality",
        "only the default persona or a query: the flags disable ASLR for what the child execs "
        "(ADDR_NO_RANDOMIZE), make data executable (READ_IMPLIES_EXEC) or map page zero",
        tuple(Rule("personality", errno.EPERM, (cmp,)) for cmp in _not_uniform_u32(0)),
    )


# The other half of each argument rule: the values that run


@dataclass(frozen=True)
class Allowance:
    """Allow ``syscall`` when every comparison holds (one of several per checked call)."""

    syscall: str
    args: tuple[ArgCmp, ...]


def allowances(options: SeccompOptions | None = None) -> tuple[Allowance, ...]:
    """For each call plan() checks, the argument values that run: exactly the complement of its
    refusals (tests/confine/test_seccomp.py checks both halves against one model)."""
    options = options or SeccompOptions()
    return (
        *_socket_allowances(options),
        *(
            Allowance(name, (ArgCmp(index, CmpOp.MASKED_EQ, MSG_FASTOPEN, 0),))
            for name, index in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3))
        ),
        *_setsockopt_allowances(),
        *(Allowance("ioctl", (cmp,)) for cmp in _outside(1, _terminal_commands(), bits=32)),
        Allowance(
            "clone", (ArgCmp(_clone_flags_index(), CmpOp.MASKED_EQ, _mask(CLONE_NEW_FLAGS), 0),)
        ),
        Allowance("unshare", (ArgCmp(0, CmpOp.MASKED_EQ, _mask(UNSHARE_NEW_FLAGS), 0),)),
        Allowance("personality", (ArgCmp(0, CmpOp.MASKED_EQ, _U32, PER_LINUX),)),
        Allowance("personality", (ArgCmp(0, CmpOp.MASKED_EQ, _U32, PERSONALITY_QUERY),)),
    )


def _socket_allowances(options: SeccompOptions) -> tuple[Allowance, ...]:
    allowed: list[Allowance] = []
    if options.allow_unix_sockets:
        unix = (ArgCmp(0, CmpOp.EQ, int(socket.AF_UNIX)),)
        allowed += [Allowance("socket", unix), Allowance("socketpair", unix)]
    kinds = [(int(socket.SOCK_STREAM), (0, IPPROTO_TCP))]
    if options.allow_udp:
        kinds.append((int(socket.SOCK_DGRAM), (0, IPPROTO_UDP)))
    allowed += [
        Allowance(
            "socket",
            (
                ArgCmp(0, CmpOp.EQ, int(family)),
                ArgCmp(1, CmpOp.MASKED_EQ, SOCK_TYPE_MASK, kind),
                ArgCmp(2, CmpOp.EQ, protocol),
            ),
        )
        for family in (socket.AF_INET, socket.AF_INET6)
        for kind, protocols in kinds
        for protocol in protocols
    ]
    return tuple(allowed)


def _setsockopt_allowances() -> tuple[Allowance, ...]:
    # Refused: level TCP and option TCP_FASTOPEN_CONNECT (each masked to 32 bits). Allowed: any
    # other level, or level TCP with any other option (two disjoint sets).
    other_level = tuple(
        Allowance("setsockopt", (cmp,)) for cmp in _outside(1, [IPPROTO_TCP], bits=32)
    )
    tcp = ArgCmp(1, CmpOp.MASKED_EQ, _U32, IPPROTO_TCP)
    other_option = tuple(
        Allowance("setsockopt", (tcp, cmp)) for cmp in _outside(2, [TCP_FASTOPEN_CONNECT], bits=32)
    )
    return other_level + other_option


def _mask(flags: Iterable[int]) -> int:
    mask = 0
    for flag in flags:
        mask |= flag
    return mask


def _clone_flags_index() -> int:
    # s390 swaps clone()'s first two arguments (stack first); every other architecture has the
    # flags first.
    return 1 if os.uname().machine.startswith("s390") else 0


def _outside(index: int, allowed: Iterable[int], *, bits: int = 64) -> tuple[ArgCmp, ...]:
    """Comparisons that, one per rule, match every value of argument ``index`` not in ``allowed``.

    The argument is read as an unsigned ``bits``-wide number (the low bits of the register).
    Each gap between allowed values becomes aligned power-of-two blocks, one masked equality per
    block; above the largest allowed value a single GT covers all 64 bits (high bits included).
    """
    width = (1 << bits) - 1
    cmps: list[ArgCmp] = []
    low = 0
    for value in sorted(set(allowed)):
        cmps += [_block(index, start, size, width) for start, size in _aligned(low, value - 1)]
        low = value + 1
    if bits == 64:
        if low <= width:
            cmps.append(ArgCmp(index, CmpOp.GT, low - 1))
    else:
        cmps += [_block(index, start, size, width) for start, size in _aligned(low, width)]
    return tuple(cmps)


def _aligned(low: int, high: int) -> Iterator[tuple[int, int]]:
    """Split [low, high] into the fewest aligned blocks (start, size), size a power of two."""
    while low <= high:
        size = low & -low if low else 1 << 64
        while size > high - low + 1:
            size >>= 1
        yield low, size
        low += size


def _block(index: int, start: int, size: int, width: int) -> ArgCmp:
    mask = width & ~(size - 1)
    if mask == _U64:
        return ArgCmp(index, CmpOp.EQ, start)
    return ArgCmp(index, CmpOp.MASKED_EQ, mask, start)


def _not_uniform_u32(index: int) -> tuple[ArgCmp, ...]:
    """Comparisons matching every low-32-bit value except 0 and 0xffffffff (high bits ignored).

    A value that is neither all zeros nor all ones has, going round its 32 bits, some set bit
    whose next bit is clear: one masked test per position finds it.
    """
    cmps = []
    for bit in range(32):
        here, after = 1 << bit, 1 << ((bit + 1) % 32)
        cmps.append(ArgCmp(index, CmpOp.MASKED_EQ, here | after, here))
    return tuple(cmps)


# The thin typed face of pyseccomp (it has no type information): the one place Any appears.


class SyscallFilter(Protocol):
    """The part of ``pyseccomp.SyscallFilter`` used here (build_filter returns one)."""

    def add_rule(self, action: int, syscall: int | str, *args: object) -> None: ...

    def set_attr(self, attr: int, value: int) -> None: ...

    def get_attr(self, attr: int) -> int: ...

    def load(self) -> None: ...

    def export_bpf(self, file: Any) -> None: ...


# Libraries pyseccomp looks up with ctypes.util.find_library, by their
# stable sonames: find_library runs `ldconfig -p` (twice, ~20 ms each) and
# needs a temp dir, which the launcher may not have.
_SONAMES = {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}


@contextlib.contextmanager
def _known_sonames() -> Iterator[None]:
    import ctypes
    import ctypes.util

    original = ctypes.util.find_library

    def find(name: str) -> str | None:
        soname = _SONAMES.get(name)
        if soname is not None:
            try:
                ctypes.CDLL(soname)
            except OSError:
                return original(name)
            return soname
        return original(name)

    ctypes.util.find_library = find
    try:
        yield
    finally:
        ctypes.util.find_library = original


class _Libseccomp:
    """pyseccomp, imported on demand (the import may spawn ldconfig: see the module docstring)."""

    def __init__(self) -> None:
        try:
            with _known_sonames():
                import pyseccomp
        except (ImportError, OSError, RuntimeError, AttributeError) as exc:
            # ImportError: not installed; RuntimeError/OSError: libseccomp missing or unloadable;
            # AttributeError: a libseccomp too old for pyseccomp's bindings.
            raise SeccompUnavailableError(f"pyseccomp/libseccomp not usable: {exc}") from exc
        self._module: Any = pyseccomp

    def new_filter(self, default_action: int) -> SyscallFilter:
        return cast(SyscallFilter, self._module.SyscallFilter(default_action))

    def arg(self, cmp: ArgCmp) -> object:
        return cast(object, self._module.Arg(cmp.index, int(cmp.op), cmp.datum_a, cmp.datum_b))

    def resolve(self, name: str) -> int:
        """The native number of ``name``; negative when this architecture lacks it."""
        return int(self._module.resolve_syscall(self._module.Arch.NATIVE, name))

    def name(self, number: int) -> str | None:
        """The native name of syscall ``number``, or None when libseccomp knows none."""
        try:
            name = self._module.resolve_syscall(self._module.Arch.NATIVE, number)
        except ValueError:
            return None
        return bytes(name).decode("ascii")

    def native_arch(self) -> int:
        return int(self._module.system_arch())


# Building and loading


@dataclass(frozen=True)
class _Built:
    """A filter built (not loaded) and the report of what it holds."""

    seccomp_filter: SyscallFilter
    report: SeccompReport


def build_filter(options: SeccompOptions | None = None) -> SyscallFilter:
    """The filter for ``options``, built but not loaded (a ``pyseccomp.SyscallFilter``).

    Raises SeccompUnavailableError without pyseccomp/libseccomp. Rules that could not be added
    are left out silently here: use prepare() to learn about them.
    """
    return _build(_Libseccomp(), options or SeccompOptions()).seccomp_filter


def _build(lib: _Libseccomp, options: SeccompOptions) -> _Built:
    # Anything no rule names gets ENOSYS: a call newer than the table, or no call at all.
    seccomp_filter = lib.new_filter(_ACT_ERRNO | errno.ENOSYS)
    notes: list[str] = []
    bad_arch_action = _set_bad_arch_action(seccomp_filter, options, notes)
    try:
        # The launcher is meant to be single-threaded, but TSYNC puts every thread under the
        # filter, not just the caller: a stray thread (a library's helper) stays covered.
        seccomp_filter.set_attr(_ATTR_CTL_TSYNC, 1)
    except OSError as exc:
        notes.append(f"TSYNC unavailable ({_errno_name(exc.errno)}): only the loading thread")
    # A binary search over the listed syscall numbers instead of a linear scan: every syscall
    # the child makes pays for the filter, and the allow list names hundreds. libseccomp < 2.5
    # lacks it; the linear filter is just as strict.
    with contextlib.suppress(OSError):
        seccomp_filter.set_attr(_ATTR_CTL_OPTIMIZE, 2)
    adder = _Adder(lib, seccomp_filter, notes)
    groups = _add_argument_rules(adder, options)
    allowed = _add_allow_list(adder, options)
    refused = _add_refusals(adder)
    skipped = list(dict.fromkeys(adder.skipped))
    failed = list(dict.fromkeys(adder.failed))
    if failed:
        status = Status.PARTIAL
        reason = f"{summary(len(allowed))}, but rules not added for: {', '.join(failed)}"
    else:
        status = Status.FULL
        reason = f"{summary(len(allowed))}; non-native ABIs: {bad_arch_action}"
    report = SeccompReport(
        status=status,
        reason=reason,
        groups=tuple(groups),
        skipped=tuple(skipped),
        failed=tuple(failed),
        bad_arch_action=bad_arch_action,
        notes=tuple(notes),
        allowed=tuple(allowed),
        refused=tuple(refused),
    )
    return _Built(seccomp_filter, report)


class _Adder:
    """Adds rules to one filter, resolving names once and recording what was skipped or failed."""

    def __init__(self, lib: _Libseccomp, seccomp_filter: SyscallFilter, notes: list[str]) -> None:
        self.lib = lib
        self.filter = seccomp_filter
        self.arch = lib.native_arch()
        self.notes = notes
        self.skipped: list[str] = []
        self.failed: list[str] = []
        self._numbers: dict[str, int | None] = {}

    def number(self, name: str) -> int | None:
        if name not in self._numbers:
            self._numbers[name] = _number(self.lib, self.arch, name)
        return self._numbers[name]

    def add(self, action: int, name: str, args: tuple[ArgCmp, ...] = ()) -> bool:
        """True when the rule is in the filter; False when skipped (no such call) or failed."""
        number = self.number(name)
        if number is None:
            self.skipped.append(name)
            return False
        try:
            self.filter.add_rule(action, number, *(self.lib.arg(cmp) for cmp in args))
        except OSError as exc:
            self.failed.append(name)
            self.notes.append(f"{name}: rule not added: {_errno_name(exc.errno)}")
            return False
        return True


def _add_argument_rules(adder: _Adder, options: SeccompOptions) -> list[RuleGroup]:
    """The refusals of plan() and their complement, allowances(); returns the groups in force."""
    groups: list[RuleGroup] = []
    for group in plan(options):
        added = tuple(
            rule
            for rule in group.rules
            if adder.add(_ACT_ERRNO | (rule.errno & 0xFFFF), rule.syscall, rule.args)
        )
        if added:
            groups.append(RuleGroup(group.name, group.why, added))
    for allowance in allowances(options):
        adder.add(ACT_ALLOW, allowance.syscall, allowance.args)
    return groups


def _add_allow_list(adder: _Adder, options: SeccompOptions) -> list[str]:
    allowed = []
    for name in ALLOWED:
        if name in ARGUMENT_CHECKED:
            # Its allowances were added with the argument rules; an unconditional ALLOW here
            # would override them. socketpair without unix sockets has none: refused outright.
            present = adder.number(name) is not None
            if present and (name != "socketpair" or options.allow_unix_sockets):
                allowed.append(name)
            elif not present:
                adder.skipped.append(name)
        elif adder.add(ACT_ALLOW, name):
            allowed.append(name)
    return allowed


def _add_refusals(adder: _Adder) -> list[str]:
    """EPERM for every call this architecture's table knows that is neither allowed nor sent to
    ENOSYS (the default) on purpose. Returns their names."""
    refused = []
    for name in _known_names(adder):
        if name in ALLOWED or name in FALLBACK:
            continue
        if adder.add(_ACT_ERRNO | errno.EPERM, name):
            refused.append(name)
    return refused


def _known_names(adder: _Adder) -> list[str]:
    names = [name for number in range(_SCAN_LIMIT) if (name := adder.lib.name(number))]
    names += [
        name for name in NEWER_NUMBERS if name not in names and adder.number(name) is not None
    ]
    return names


def _set_bad_arch_action(
    seccomp_filter: SyscallFilter, options: SeccompOptions, notes: list[str]
) -> str:
    # libseccomp's default kills only the calling thread; the whole process must go, or another
    # thread carries on after an attempt to use the unfiltered ABI.
    if not options.kill_on_bad_arch:
        seccomp_filter.set_attr(_ATTR_ACT_BADARCH, _ACT_ERRNO | errno.ENOSYS)
        return "ERRNO(ENOSYS)"
    try:
        seccomp_filter.set_attr(_ATTR_ACT_BADARCH, ACT_KILL_PROCESS)
    except OSError as exc:
        # Kernels before 4.14 lack SECCOMP_RET_KILL_PROCESS; the call is still never made.
        seccomp_filter.set_attr(_ATTR_ACT_BADARCH, ACT_KILL_THREAD)
        notes.append(f"KILL_PROCESS unavailable ({_errno_name(exc.errno)}): KILL_THREAD instead")
        return "KILL_THREAD"
    return "KILL_PROCESS"


def _number(lib: _Libseccomp, arch: int, name: str) -> int | None:
    number = lib.resolve(name)
    if number >= 0:
        return number
    if number == _NR_UNKNOWN and arch in _UNIFIED_TABLE_ARCHES:
        return NEWER_NUMBERS.get(name)
    return None


class PreparedFilter:
    """A filter built ahead of time; load() is the only step left (see the module docstring)."""

    def __init__(self, seccomp_filter: SyscallFilter | None, report: SeccompReport) -> None:
        self._filter = seccomp_filter
        self._report = report

    @property
    def available(self) -> bool:
        """Whether there is a filter to load."""
        return self._filter is not None

    @property
    def reason(self) -> str:
        """What load() will report if it succeeds (or why there is nothing to load)."""
        return self._report.reason

    def load(self) -> SeccompReport:
        """Load the filter into this process (irreversible; sets no_new_privs). Never raises.

        Meant as the last step before exec: it imports nothing and touches no file.
        """
        if self._filter is None:
            return self._report
        try:
            self._filter.load()
        except OSError as exc:
            reason = f"seccomp_load failed: {_errno_name(exc.errno)}"
            return SeccompReport(Status.NONE, reason, notes=self._report.notes)
        return self._report


def prepare(options: SeccompOptions | None = None) -> PreparedFilter:
    """Import pyseccomp and build the filter now; never raises for a missing library."""
    try:
        built = _build(_Libseccomp(), options or SeccompOptions())
    except SeccompUnavailableError as exc:
        return PreparedFilter(None, SeccompReport(Status.NONE, str(exc)))
    except OSError as exc:  # seccomp_init or an attribute the library refused
        reason = f"building the seccomp filter failed: {_errno_name(exc.errno)}"
        return PreparedFilter(None, SeccompReport(Status.NONE, reason))
    return PreparedFilter(built.seccomp_filter, built.report)


def apply(options: SeccompOptions | None = None) -> SeccompReport:
    """prepare() and load() at once, for a process whose filesystem is not yet restricted."""
    return prepare(options).load()


def _errno_name(err: int | None) -> str:
    if not err:
        return "unknown error"
    if err == errno.EOPNOTSUPP:
        return "EOPNOTSUPP"  # errno.errorcode names it ENOTSUP, its alias on Linux
    return errno.errorcode.get(err, f"errno {err}")


# -- a compiled program, cached ---------------------------------------------------------
#
# Importing pyseccomp and building the filter costs ~15-20 ms, on the critical
# path of every `egressbox run`. The filter depends only on the options, the
# architecture, libseccomp and the kernel, so `run` compiles it once to
# classic BPF, caches the bytes, and the command loads them with one prctl:
# no pyseccomp import in the launcher at all.

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
_SOCK_FILTER_SIZE = 8  # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k


@dataclass(frozen=True)
class CompiledFilter:
    """A filter's BPF program as libseccomp exported it, or why there is none."""

    program: bytes  # struct sock_filter[], as libseccomp exported it
    status: Status
    reason: str


def compile_filter(options: SeccompOptions | None = None) -> CompiledFilter:
    """Build the filter with pyseccomp and export it as a BPF program."""
    import tempfile

    options = options or SeccompOptions()
    try:
        built = _build(_Libseccomp(), options)
    except (SeccompUnavailableError, OSError) as exc:
        return CompiledFilter(b"", Status.NONE, str(exc))
    with tempfile.TemporaryFile() as out:
        built.seccomp_filter.export_bpf(out)
        out.seek(0)
        program = out.read()
    if not program or len(program) % _SOCK_FILTER_SIZE:
        return CompiledFilter(b"", Status.NONE, "libseccomp exported no usable program")
    return CompiledFilter(program, built.report.status, built.report.reason)


def load_program(program: bytes) -> None:
    """Load a compiled filter (see syscalls.load_seccomp_program)."""
    from egressbox.confine.syscalls import load_seccomp_program

    load_seccomp_program(program)
