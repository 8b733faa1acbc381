"""A tiny typed ctypes layer over the namespace, mount and capability syscalls.

The standard library has ``os.unshare`` (3.12+) but nothing for mount, umount2, capset or most
prctl options, and the launcher must stay light, so these are bound directly through libc.

Errors: libc signals failure with a return of -1 and sets errno; only then is errno read (a
successful call may leave a stale errno behind) and ``OSError(errno, message)`` raised.
"""

from __future__ import annotations

import ctypes
import os

# unshare(2) flags.
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# mount(2) flags.
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MS_SHARED = 1 << 20

# umount2(2) flags.
MNT_DETACH = 2

# prctl(2) options.
PR_SET_PDEATHSIG = 1  # the signal a child gets when its parent dies
PR_SET_DUMPABLE = 4
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_GET_SECUREBITS = 27
PR_SET_SECUREBITS = 28
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_IS_SET = 1
PR_CAP_AMBIENT_CLEAR_ALL = 4

# capset(2): version 3 carries two 32-bit words per set (64 capabilities).
LINUX_CAPABILITY_VERSION_3 = 0x20080522


class CapUserHeader(ctypes.Structure):
    """struct __user_cap_header_struct."""

    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class CapUserData(ctypes.Structure):
    """struct __user_cap_data_struct (one 32-bit word of each set)."""

    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


_libc = ctypes.CDLL(None, use_errno=True)

_libc.unshare.argtypes = (ctypes.c_int,)
_libc.unshare.restype = ctypes.c_int
_libc.mount.argtypes = (
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
)
_libc.mount.restype = ctypes.c_int
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.umount2.restype = ctypes.c_int
# prctl is variadic; passing every argument as unsigned long matches what the kernel reads.
_libc.prctl.argtypes = (ctypes.c_int,) + (ctypes.c_ulong,) * 4
_libc.prctl.restype = ctypes.c_int
_libc.capset.argtypes = (ctypes.POINTER(CapUserHeader), ctypes.POINTER(CapUserData))
_libc.capset.restype = ctypes.c_int
_libc.capget.argtypes = (ctypes.POINTER(CapUserHeader), ctypes.POINTER(CapUserData))
_libc.capget.restype = ctypes.c_int


def _check(result: int, what: str) -> int:
    """Return ``result``, or raise OSError from errno when it is -1 (and only then)."""
    if result == -1:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return result


def _path(value: str | None) -> bytes | None:
    return None if value is None else os.fsencode(value)


def unshare(flags: int) -> None:
    """unshare(2): move this process into new namespaces."""
    _check(_libc.unshare(flags), f"unshare(0x{flags:x})")


def mount(
    source: str | None,
    target: str,
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    """mount(2). ``source``, ``fstype`` and ``data`` may be None (NULL)."""
    result = _libc.mount(_path(source), _path(target), _path(fstype), flags, _path(data))
    _check(result, f"mount({source!r}, {target!r}, {fstype!r}, 0x{flags:x}, {data!r})")


def umount2(target: str, flags: int = 0) -> None:
    """umount2(2)."""
    _check(_libc.umount2(_path(target), flags), f"umount2({target!r}, {flags})")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    """prctl(2); returns the (non-negative) result, which some options use as their answer."""
    result = _libc.prctl(option, arg2, arg3, arg4, arg5)
    return _check(result, f"prctl({option}, {arg2}, {arg3})")


def capset(effective: int, permitted: int, inheritable: int) -> None:
    """capset(2) (version 3) for this thread; each set is a 64-bit mask."""
    header = CapUserHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (CapUserData * 2)()
    for word in range(2):
        shift = 32 * word
        data[word].effective = (effective >> shift) & 0xFFFFFFFF
        data[word].permitted = (permitted >> shift) & 0xFFFFFFFF
        data[word].inheritable = (inheritable >> shift) & 0xFFFFFFFF
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def capget() -> tuple[int, int, int]:
    """capget(2) (version 3) for this thread: (effective, permitted, inheritable)."""
    header = CapUserHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (CapUserData * 2)()
    _check(_libc.capget(ctypes.byref(header), data), "capget")
    effective = data[0].effective | (data[1].effective << 32)
    permitted = data[0].permitted | (data[1].permitted << 32)
    inheritable = data[0].inheritable | (data[1].inheritable << 32)
    return effective, permitted, inheritable


# seccomp(2) through prctl: enough for the single-threaded command process,
# and it keeps the launcher's last step free of the seccomp module's imports.
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
_SOCK_FILTER_SIZE = 8  # struct sock_filter: u16 code, u8 jt, u8 jf, u32 k


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def load_seccomp_program(program: bytes) -> None:
    """Set no_new_privs, then load a classic-BPF seccomp program; raises OSError."""
    if not program or len(program) % _SOCK_FILTER_SIZE:
        raise OSError(22, "not a seccomp BPF program")
    buffer = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // _SOCK_FILTER_SIZE, ctypes.cast(buffer, ctypes.c_void_p))
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog))


# -- the constructed root ---------------------------------------------------------------
# pivot_root(2) has no libc wrapper; mount_setattr(2) (Linux 5.12) changes the flags of a
# whole mount tree in one call, where remounting would take one call per mount below.
_NR = {
    "x86_64": {"pivot_root": 155, "mount_setattr": 442},
    "aarch64": {"pivot_root": 41, "mount_setattr": 442},
}
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
AT_RECURSIVE = 0x8000
AT_FDCWD = -100
_MOUNT_ATTR_SIZE_VER0 = 32


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


_libc.syscall.restype = ctypes.c_long


def _syscall_number(name: str) -> int:
    numbers = _NR.get(os.uname().machine)
    if numbers is None:
        raise OSError(38, f"{name}: unsupported architecture {os.uname().machine}")
    return numbers[name]


def pivot_root(new_root: str, put_old: str) -> None:
    """pivot_root(2)."""
    number = _syscall_number("pivot_root")
    result = _libc.syscall(number, _path(new_root), _path(put_old))
    _check(result, f"pivot_root({new_root!r}, {put_old!r})")


def mount_setattr(path: str, attr_set: int, *, recursive: bool = True) -> None:
    """mount_setattr(2): set mount attributes on `path` (and every mount below it)."""
    attr = _MountAttr(attr_set, 0, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    number = _syscall_number("mount_setattr")
    result = _libc.syscall(
        number,
        ctypes.c_int(AT_FDCWD),
        _path(path),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(_MOUNT_ATTR_SIZE_VER0),
    )
    _check(result, f"mount_setattr({path!r}, 0x{attr_set:x})")
