"""The connect filter: a network boundary by address without a network namespace.

Without a namespace, Landlock admits the proxy's port numbers on *any* address. This filter
holds every `connect(2)` of the command for a supervisor in the unconfined parent (seccomp user
notification, Linux 5.0; runner/notify.py), which copies the address once, takes the socket
with `pidfd_getfd(2)` (Linux 5.6) and connects its own copy: to the proxy when the command
asked for the proxy, to the capture listener otherwise. What the command writes into its memory
after that cannot change what was connected.

The same filter keeps every other way out inert, so that `connect` is the only door:
- inet sockets are TCP only (SOCK_STREAM, protocol 0 or IPPROTO_TCP: no UDP, raw, ICMP, MPTCP,
  SCTP); families beyond unix, inet, inet6 and netlink are refused (vsock, packet, ...);
- MSG_FASTOPEN on sendto/sendmsg/sendmmsg is refused (it would connect from a send);
- io_uring answers ENOSYS (its connect would bypass seccomp; libraries fall back).
A TCP socket ignores the address of a send once connected and refuses one before, so
sendto/sendmsg with an address need no supervisor (and holding every sendmsg would cost each
write of every program a round trip).

The program is classic BPF written out here (a dozen instructions, no pyseccomp import, nothing
to cache); the launcher loads it with seccomp(2) and SECCOMP_FILTER_FLAG_NEW_LISTENER, which
returns the notification descriptor it hands to the parent before exec. The parent's side of
that descriptor (receive, check, answer, take the socket, read the address) is `Notifications`,
reached through the face (`face.supervisor`); what to connect where stays runner/notify.py's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import socket
import struct
from typing import Final, NamedTuple

from egressbox.confine import staging

# <linux/seccomp.h>
SECCOMP_SET_MODE_FILTER: Final = 1
SECCOMP_GET_NOTIF_SIZES: Final = 3
SECCOMP_FILTER_FLAG_NEW_LISTENER: Final = 1 << 3
RET_KILL_PROCESS: Final = 0x80000000
RET_USER_NOTIF: Final = 0x7FC00000
RET_ALLOW: Final = 0x7FFF0000
RET_ERRNO: Final = 0x00050000
# struct seccomp_notif (80 bytes) and struct seccomp_notif_resp (24 bytes).
NOTIF: Final = struct.Struct("=QII iIQ6Q")
NOTIF_RESP: Final = struct.Struct("=QqiI")
# _IOWR('!', 0, seccomp_notif), _IOWR('!', 1, seccomp_notif_resp), _IOW('!', 2, __u64).
IOCTL_NOTIF_RECV: Final = 0xC0502100
IOCTL_NOTIF_SEND: Final = 0xC0182101
IOCTL_NOTIF_ID_VALID: Final = 0x40082102
MSG_FASTOPEN: Final = 0x20000000
AF_NETLINK: Final = 16

# Per architecture: AUDIT_ARCH_*, then the numbers of the system calls the filter names.
_ARCHES: Final = {
    "x86_64": (0xC000003E, {"seccomp": 317, "socket": 41, "connect": 42, "sendto": 44,
                            "sendmsg": 46, "sendmmsg": 307}),
    "aarch64": (0xC00000B7, {"seccomp": 277, "socket": 198, "connect": 203, "sendto": 206,
                             "sendmsg": 211, "sendmmsg": 269}),
}  # fmt: skip
# The same on every architecture (the unified table since Linux 5.1).
NR_IO_URING: Final = (425, 426, 427)
NR_PIDFD_GETFD: Final = 438
X32_SYSCALL_BIT: Final = 0x40000000  # x86-64's x32 ABI: never used by our commands

# struct seccomp_data offsets: nr, arch, then the low 32 bits of args[i] (little-endian; the
# kernel truncates these int arguments to 32 bits itself, so the high half does not matter).
_NR_OFFSET, _ARCH_OFFSET = 0, 4


def _arg(index: int) -> int:
    return 16 + 8 * index


class NotifyUnavailableError(OSError):
    """The kernel (or a filter above us) refuses user notification or pidfd_getfd."""


def _table() -> tuple[int, dict[str, int]]:
    machine = os.uname().machine
    found = _ARCHES.get(machine)
    if found is None:
        raise NotifyUnavailableError(errno.ENOSYS, f"no connect filter for {machine}")
    return found


# -- the program ---------------------------------------------------------------------


def program() -> bytes:
    """The connect filter as struct sock_filter[] for this machine."""
    arch, nr = _table()
    asm = _Assembler()
    asm.load(_ARCH_OFFSET)
    asm.jump_unless(arch, "kill")
    asm.load(_NR_OFFSET)
    if arch == _ARCHES["x86_64"][0]:
        asm.jump_if_at_least(X32_SYSCALL_BIT, "kill")
    asm.jump_if(nr["connect"], "notify")
    asm.jump_if(nr["socket"], "socket")
    for name, flags_arg in (("sendto", 3), ("sendmsg", 2), ("sendmmsg", 3)):
        asm.jump_if(nr[name], f"fastopen{flags_arg}")
    for number in NR_IO_URING:
        asm.jump_if(number, "enosys")
    asm.ret(RET_ALLOW)
    # socket(family, type, protocol)
    asm.label("socket")
    asm.load(_arg(0))
    for family in (socket.AF_UNIX, AF_NETLINK):
        asm.jump_if(family, "allow")
    asm.jump_if(socket.AF_INET, "inet")
    asm.jump_if(socket.AF_INET6, "inet")
    asm.ret(RET_ERRNO | errno.EAFNOSUPPORT)
    asm.label("inet")
    asm.load(_arg(1))
    asm.and_(0xF)  # SOCK_NONBLOCK and SOCK_CLOEXEC do not matter
    asm.jump_unless(socket.SOCK_STREAM, "eperm")
    asm.load(_arg(2))
    asm.jump_if(0, "allow")
    asm.jump_if(socket.IPPROTO_TCP, "allow")
    asm.ret(RET_ERRNO | errno.EPERM)
    for flags_arg in (2, 3):
        asm.label(f"fastopen{flags_arg}")
        asm.load(_arg(flags_arg))
        asm.jump_if_set(MSG_FASTOPEN, "eperm")
        asm.ret(RET_ALLOW)
    for name, action in (
        ("notify", RET_USER_NOTIF),
        ("allow", RET_ALLOW),
        ("eperm", RET_ERRNO | errno.EPERM),
        ("enosys", RET_ERRNO | errno.ENOSYS),
        ("kill", RET_KILL_PROCESS),
    ):
        asm.label(name)
        asm.ret(action)
    return asm.assemble()


_LD_W_ABS: Final = 0x20
_JEQ: Final = 0x15
_JGE: Final = 0x35
_JSET: Final = 0x45
_AND: Final = 0x54
_RET: Final = 0x06
_INSN: Final = struct.Struct("=HBBI")
_MAX_JUMP: Final = 255  # jt/jf are one byte


class _Assembler:
    """Classic BPF with named targets: conditional jumps go forward to a label."""

    def __init__(self) -> None:
        self._code: list[tuple[int, int, str, str, int]] = []  # code, -, jt, jf, k
        self._labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self._code.append((_LD_W_ABS, 0, "", "", offset))

    def and_(self, mask: int) -> None:
        self._code.append((_AND, 0, "", "", mask))

    def jump_if(self, value: int, target: str) -> None:
        self._code.append((_JEQ, 0, target, "", value))

    def jump_unless(self, value: int, target: str) -> None:
        self._code.append((_JEQ, 0, "", target, value))

    def jump_if_at_least(self, value: int, target: str) -> None:
        self._code.append((_JGE, 0, target, "", value))

    def jump_if_set(self, mask: int, target: str) -> None:
        self._code.append((_JSET, 0, target, "", mask))

    def ret(self, action: int) -> None:
        self._code.append((_RET, 0, "", "", action))

    def label(self, name: str) -> None:
        self._labels[name] = len(self._code)

    def assemble(self) -> bytes:
        out = bytearray()
        for here, (code, _, jt, jf, k) in enumerate(self._code):
            out += _INSN.pack(code, self._offset(here, jt), self._offset(here, jf), k)
        return bytes(out)

    def _offset(self, here: int, target: str) -> int:
        if not target:
            return 0
        offset = self._labels[target] - here - 1
        if not 0 <= offset <= _MAX_JUMP:
            raise ValueError(f"jump to {target} out of reach ({offset})")
        return offset


# -- system calls ---------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


class _IoVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def load(code: bytes) -> int:
    """Load the filter into this thread (no_new_privs first); returns the notification fd
    (close-on-exec, set by the kernel). Raises OSError."""
    _, nr = _table()
    buffer = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // _INSN.size, ctypes.cast(buffer, ctypes.c_void_p))
    PR_SET_NO_NEW_PRIVS = 38  # noqa: N806 (a kernel constant)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    result = _libc.syscall(
        ctypes.c_long(nr["seccomp"]),
        ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
        ctypes.c_uint(SECCOMP_FILTER_FLAG_NEW_LISTENER),
        ctypes.byref(prog),
    )
    return _check(result, "seccomp(SECCOMP_FILTER_FLAG_NEW_LISTENER)")


def pidfd_getfd(pidfd: int, target_fd: int) -> int:
    """A duplicate of another process's descriptor (close-on-exec); raises OSError."""
    result = _libc.syscall(
        ctypes.c_long(NR_PIDFD_GETFD),
        ctypes.c_int(pidfd),
        ctypes.c_int(target_fd),
        ctypes.c_uint(0),
    )
    return _check(result, "pidfd_getfd")


def read_memory(pid: int, address: int, size: int) -> bytes:
    """`size` bytes of another process's memory, read once (process_vm_readv, else
    /proc/PID/mem); raises OSError (EFAULT for a bad address)."""
    buffer = ctypes.create_string_buffer(size)
    local = _IoVec(ctypes.cast(buffer, ctypes.c_void_p), size)
    remote = _IoVec(ctypes.c_void_p(address), size)
    got = _libc.process_vm_readv(
        ctypes.c_int(pid), ctypes.byref(local), ctypes.c_ulong(1), ctypes.byref(remote),
        ctypes.c_ulong(1), ctypes.c_ulong(0),
    )  # fmt: skip
    if got >= 0:
        return buffer.raw[:got]
    err = ctypes.get_errno()
    if err not in {errno.EPERM, errno.ENOSYS}:
        raise OSError(err, os.strerror(err))
    fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, size, address)
    finally:
        os.close(fd)


def support() -> str:
    """Why this process cannot supervise a child's connects ("" when it can), from two cheap
    in-process checks: the kernel knows user notification (SECCOMP_GET_NOTIF_SIZES, 5.0) and
    pidfd_getfd works on our own descriptor (5.6, and not refused by a filter above us)."""
    try:
        _, nr = _table()
    except OSError as exc:
        return str(exc.strerror)
    sizes = (ctypes.c_uint16 * 3)()
    result = _libc.syscall(
        ctypes.c_long(nr["seccomp"]), ctypes.c_uint(SECCOMP_GET_NOTIF_SIZES), ctypes.c_uint(0),
        ctypes.byref(sizes),
    )  # fmt: skip
    if result < 0:
        return f"the kernel has no seccomp user notification ({os.strerror(ctypes.get_errno())})"
    if sizes[0] < NOTIF.size or sizes[1] < NOTIF_RESP.size:
        return f"unexpected seccomp notification sizes {tuple(sizes)}"
    try:
        pidfd = os.pidfd_open(os.getpid())
    except OSError as exc:
        return f"pidfd_open(2) fails: {exc.strerror}"
    try:
        os.close(pidfd_getfd(pidfd, 0 if _is_open(0) else pidfd))
    except OSError as exc:
        return f"pidfd_getfd(2) fails: {os.strerror(exc.errno or 0)}"
    finally:
        os.close(pidfd)
    return ""


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# -- the supervisor's side: the notification descriptor's kernel calls -----------------------

# openat2(2)'s resolution inside a directory taken as the root (Linux 5.6, <linux/openat2.h>).
RESOLVE_IN_ROOT: Final = 0x10
# pidfd_open(2)'s flag for a thread's own pidfd (Linux 6.9; the value of O_EXCL).
PIDFD_THREAD: Final = os.O_EXCL
_ID: Final = struct.Struct("=Q")


class Notification(NamedTuple):
    """One held system call: its notification id, the task that made it, its six arguments."""

    id: int
    pid: int
    args: tuple[int, ...]


class Notifications:
    """The kernel's side of one notification descriptor (the supervisor owns the policy):
    receive a held call, check it is still pending, answer it, and reach into the task that
    made it (its memory, its descriptors). Owns `fd` until close()."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def receive(self) -> Notification | None:
        """The next held call; None when it went away first (ENOENT: the task died, or its
        call was interrupted, between the poll and here)."""
        buffer = bytearray(NOTIF.size)
        try:
            fcntl.ioctl(self.fd, IOCTL_NOTIF_RECV, buffer)
        except OSError:
            return None
        ident, pid, _flags, _nr, _arch, _ip, *args = NOTIF.unpack(buffer)
        return Notification(ident, pid, tuple(args))

    def still_valid(self, ident: int) -> bool:
        """Whether the call is still held: the task that made it is alive and waits, so a pid
        read from it (or a pidfd opened before this) is still that task's."""
        try:
            fcntl.ioctl(self.fd, IOCTL_NOTIF_ID_VALID, bytearray(_ID.pack(ident)))
        except OSError:
            return False
        return True

    def answer(self, ident: int, error: int = 0, value: int = 0) -> None:
        """The held call returns `value`, or fails with errno `error` when it is not 0. A
        task gone meanwhile (ENOENT) has nobody to answer: ignored."""
        response = bytearray(NOTIF_RESP.pack(ident, value, -error, 0))
        with contextlib.suppress(OSError):
            fcntl.ioctl(self.fd, IOCTL_NOTIF_SEND, response)

    def take_socket(self, ident: int, pid: int, target_fd: int) -> int | None:
        """Our copy of descriptor `target_fd` of the task that made call `ident`; -errno when
        it has no such descriptor; None when the call went away (the pid may be reused)."""
        try:
            pidfd = _pidfd_of(pid)
        except OSError:
            return None
        try:
            # Checked after pidfd_open: the pid is still the task that asked, not a reuse.
            if not self.still_valid(ident):
                return None
            return pidfd_getfd(pidfd, target_fd)
        except OSError as exc:
            return -(exc.errno or errno.EBADF)
        finally:
            os.close(pidfd)

    @staticmethod
    def read_address(pid: int, pointer: int, length: int) -> bytes:
        """`length` bytes at `pointer` in task `pid`'s memory, read once; raises OSError."""
        return read_memory(pid, pointer, length)

    @staticmethod
    def open_beneath(root_fd: int, path: bytes, *, in_root: bool) -> int:
        """An O_PATH descriptor of `path` from directory `root_fd`, never through a /proc magic
        link (it would resolve to the supervisor's own); `in_root`: `root_fd` is the root (symlinks
        and `..` stay inside it). Raises OSError (ENOENT, ELOOP, EXDEV...)."""
        resolve = staging.RESOLVE_NO_MAGICLINKS | (RESOLVE_IN_ROOT if in_root else 0)
        return staging.openat2(root_fd, os.fsdecode(path.lstrip(b"/") or b"."), os.O_PATH, resolve)

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _pidfd_of(tid: int) -> int:
    """A pidfd for the task that asked: the notification names a thread, which need not lead
    its thread group (a connect from any thread but the first). PIDFD_THREAD (Linux 6.9) opens
    the thread itself; before it, the group leader's pidfd serves, since threads share their
    descriptor table. Raises OSError."""
    try:
        return os.pidfd_open(tid, PIDFD_THREAD)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    try:
        return os.pidfd_open(tid)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    return os.pidfd_open(_thread_group(tid))


def _thread_group(tid: int) -> int:
    """The thread group (process) id of a thread, from /proc/TID/status; raises OSError."""
    with open(f"/proc/{tid}/status", "rb") as status:
        for line in status:
            if line.startswith(b"Tgid:"):
                return int(line.split()[1])
    raise OSError(errno.ESRCH, f"no Tgid for task {tid}")
