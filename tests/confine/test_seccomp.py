"""The seccomp filter: its rules as data, and real enforcement in forked children.

A filter can never be unloaded, so every load happens in a forked child that reports through a
pipe; the pytest process only builds filters. Every enforcement case runs its probe twice, in an
unconfined child and in a confined one. The unconfined run proves the probe reaches the kernel:
it succeeds, or gets the kernel's own answer, which differs from the filter's (when the host
answers exactly like the filter would, the case skips: the two cannot be told apart).

Syscall numbers come from libseccomp's tables for this architecture, never from this file.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import os
import platform
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressbox.confine import seccomp, syscall_table
from egressbox.confine.seccomp import (
    Allowance,
    ArgCmp,
    CmpOp,
    PreparedFilter,
    Rule,
    RuleGroup,
    SeccompOptions,
    SeccompReport,
    SeccompUnavailableError,
    Status,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="seccomp is Linux only")

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_HIGH = 1 << 32  # a bit the kernel drops when it truncates an argument to int

AF_VSOCK = 40
AF_ALG = 38
AF_XDP = 44
AF_KEY = 15
AF_BLUETOOTH = 31
IPPROTO_SCTP = 132
IPPROTO_SMC = 256
IPPROTO_MPTCP = 262
TCP_FASTOPEN_CONNECT = 30
PTRACE_ATTACH = 16
PTRACE_DETACH = 17
WAIT_ALL = 0x40000000  # __WALL: also wait for a tracee that is not our child
KEYCTL_GET_KEYRING_ID = 0
KEY_SPEC_THREAD_KEYRING = -1
BPF_MAP_CREATE = 0
BPF_MAP_TYPE_ARRAY = 2
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
ADDR_NO_RANDOMIZE = 0x0040000
MMAP_PAGE_ZERO = 0x0100000
READ_IMPLIES_EXEC = 0x0400000
PER_LINUX32 = 0x0008

# A probe takes milliseconds; this only reaps a child stuck by a bug.
CHILD_TIMEOUT_S = 60

# Memory the test process owns before any fork, so a child finds it at the same address in its
# parent (the pytest process).
_PARENT_SECRET = ctypes.create_string_buffer(b"egressbox: the parent's secret", 64)


# Raw syscalls (arguments go through untouched, high bits included)


# Syscalls newer than libseccomp 2.5's tables (numbered alike on these architectures): the
# table's numbers, which tests/confine/test_syscall_table.py checks against libseccomp.
_NEWER_SYSCALLS = syscall_table.NEWER_NUMBERS
_UNIFIED_MACHINES = ("x86_64", "aarch64", "riscv64")


def _resolve(name: str) -> int | None:
    """This architecture's number for ``name``, or None when it has no such syscall."""
    pyseccomp = pytest.importorskip("pyseccomp")
    number = int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name))
    if number == -1 and platform.machine() in _UNIFIED_MACHINES:
        return _NEWER_SYSCALLS.get(name)
    return number if number >= 0 else None


def _syscall(name: str, *args: int | bytes) -> int:
    number = _resolve(name)
    if number is None:
        raise LookupError(f"{name} does not exist on {platform.machine()}")
    converted = [
        ctypes.c_char_p(arg) if isinstance(arg, bytes) else ctypes.c_ulong(arg & _U64)
        for arg in args
    ]
    result = int(_LIBC.syscall(ctypes.c_long(number), *converted))
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _ename(err: int) -> str:
    return errno.errorcode.get(err, str(err))


# Children


@dataclass(frozen=True)
class Outcome:
    """What a probe did in a child: a JSON value, an errno, a fatal signal, or a setup failure."""

    value: Any = None
    errno: int = 0
    signal: int = 0
    setup_error: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not (self.errno or self.signal or self.setup_error or self.error)

    def __str__(self) -> str:
        if self.signal:
            return f"killed by {signal.Signals(self.signal).name}"
        if self.errno:
            return f"errno {_ename(self.errno)}"
        return self.error or self.setup_error or f"ok: {self.value!r}"


Probe = Callable[[], object]
Setup = Callable[[], None]


def _run(probe: Probe, confine: PreparedFilter | None, setup: Setup | None = None) -> Outcome:
    """Run ``probe`` in a forked child, after ``setup`` and (if given) loading the filter."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_fd)
        # A stuck probe must not outlive the test run. The default action, not
        # an inherited Python handler (pytest-timeout installs one): a handler
        # never runs while the main thread is stuck in a lock after fork().
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(CHILD_TIMEOUT_S)
        report: dict[str, Any]
        try:
            if setup is not None:
                setup()
        except BaseException:
            report = {"setup_error": traceback.format_exc()}
        else:
            report = _probe_report(probe, confine)
        try:
            os.write(write_fd, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        payload = reader.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return Outcome(signal=os.WTERMSIG(status))
    return Outcome(**json.loads(payload))


def _probe_report(probe: Probe, confine: PreparedFilter | None) -> dict[str, Any]:
    try:
        if confine is not None:
            loaded = confine.load()
            if loaded.status is not Status.FULL:
                return {"error": f"filter not loaded: {loaded.status}: {loaded.reason}"}
        try:
            return {"value": probe()}
        except OSError as exc:
            return {"errno": exc.errno}
    except BaseException:
        return {"error": traceback.format_exc()}


def _require_reached(unconfined: Outcome, refused_with: int) -> None:
    """The unconfined run must show the probe reaches the kernel, or the case cannot prove much."""
    if unconfined.setup_error:
        pytest.skip(
            f"cannot set the case up here: {unconfined.setup_error.strip().splitlines()[-1]}"
        )
    assert not unconfined.error and not unconfined.signal, f"unconfined: {unconfined}"
    if unconfined.errno == refused_with:
        pytest.skip(
            f"this host answers {_ename(unconfined.errno)} too: the filter is indistinguishable"
        )


def _assert_refused(
    prepared: PreparedFilter, probe: Probe, expected: int, setup: Setup | None = None
) -> Outcome:
    unconfined = _run(probe, None, setup)
    _require_reached(unconfined, expected)
    confined = _run(probe, prepared, setup)
    assert confined.errno == expected, f"confined: {confined} (unconfined: {unconfined})"
    return unconfined


def _assert_allowed(prepared: PreparedFilter, probe: Probe, setup: Setup | None = None) -> Any:
    unconfined = _run(probe, None, setup)
    assert unconfined.ok, f"unconfined: {unconfined}"
    confined = _run(probe, prepared, setup)
    assert confined.ok, f"confined: {confined}"
    assert confined.value == unconfined.value
    return confined.value


@pytest.fixture(scope="module")
def prepared() -> PreparedFilter:
    return _loadable(SeccompOptions())


@pytest.fixture(scope="module")
def prepared_no_unix() -> PreparedFilter:
    return _loadable(SeccompOptions(allow_unix_sockets=False))


def _loadable(options: SeccompOptions) -> PreparedFilter:
    ready = seccomp.prepare(options)
    if not ready.available:
        pytest.skip(f"seccomp unavailable: {ready.reason}")
    trial = _run(lambda: "loaded", ready)
    if not trial.ok:
        pytest.skip(f"a seccomp filter does not load here: {trial}")
    return ready


# Sockets


def _socket_probe(family: int, kind: int, protocol: int) -> Probe:
    def probe() -> object:
        os.close(_syscall("socket", family, kind, protocol))
        return "created"

    return probe


SOCK_STREAM = int(socket.SOCK_STREAM)
SOCK_DGRAM = int(socket.SOCK_DGRAM)
SOCK_RAW = int(socket.SOCK_RAW)
SOCK_SEQPACKET = int(socket.SOCK_SEQPACKET)
AF_INET = int(socket.AF_INET)
AF_INET6 = int(socket.AF_INET6)
AF_UNIX = int(socket.AF_UNIX)
AF_PACKET = 17
AF_NETLINK = 16
SOCK_FLAGS = int(socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)

REFUSED_SOCKETS = [
    pytest.param(AF_INET, SOCK_DGRAM, 0, errno.EPERM, id="udp"),
    pytest.param(AF_INET6, SOCK_DGRAM, 0, errno.EPERM, id="udp6"),
    pytest.param(AF_INET, SOCK_DGRAM | SOCK_FLAGS, 17, errno.EPERM, id="udp-with-flags"),
    pytest.param(AF_INET, SOCK_DGRAM, 1, errno.EPERM, id="icmp-ping"),
    pytest.param(AF_INET, SOCK_RAW, 1, errno.EPERM, id="raw"),
    pytest.param(AF_INET6, SOCK_RAW, 58, errno.EPERM, id="raw6"),
    pytest.param(AF_INET, SOCK_SEQPACKET, 0, errno.EPERM, id="inet-seqpacket"),
    pytest.param(AF_INET, SOCK_SEQPACKET, IPPROTO_SCTP, errno.EPERM, id="sctp-seqpacket"),
    pytest.param(AF_INET, SOCK_STREAM, IPPROTO_SCTP, errno.EPROTONOSUPPORT, id="sctp-stream"),
    pytest.param(AF_INET, SOCK_STREAM, IPPROTO_MPTCP, errno.EPROTONOSUPPORT, id="mptcp"),
    pytest.param(AF_INET6, SOCK_STREAM, IPPROTO_MPTCP, errno.EPROTONOSUPPORT, id="mptcp6"),
    pytest.param(AF_INET, SOCK_STREAM, IPPROTO_SMC, errno.EPROTONOSUPPORT, id="smc"),
    pytest.param(AF_PACKET, SOCK_RAW, 0, errno.EAFNOSUPPORT, id="packet"),
    pytest.param(AF_NETLINK, SOCK_RAW, 0, errno.EAFNOSUPPORT, id="netlink"),
    pytest.param(AF_VSOCK, SOCK_STREAM, 0, errno.EAFNOSUPPORT, id="vsock"),
    pytest.param(AF_ALG, SOCK_SEQPACKET, 0, errno.EAFNOSUPPORT, id="alg"),
    pytest.param(AF_XDP, SOCK_RAW, 0, errno.EAFNOSUPPORT, id="xdp"),
    pytest.param(AF_KEY, SOCK_RAW, 2, errno.EAFNOSUPPORT, id="pfkey"),
    pytest.param(AF_BLUETOOTH, SOCK_STREAM, 3, errno.EAFNOSUPPORT, id="bluetooth"),
    # The kernel truncates each of these arguments to int; seccomp sees all 64 bits.
    pytest.param(_HIGH | AF_INET, SOCK_STREAM, 0, errno.EAFNOSUPPORT, id="family-high-bits"),
    pytest.param(_HIGH | AF_PACKET, SOCK_RAW, 0, errno.EAFNOSUPPORT, id="packet-high-bits"),
    pytest.param(
        (_U64 ^ _U32) | AF_NETLINK, SOCK_RAW, 0, errno.EAFNOSUPPORT, id="netlink-all-high-bits"
    ),
    pytest.param(AF_INET, _HIGH | SOCK_DGRAM, 0, errno.EPERM, id="type-high-bits"),
    pytest.param(
        AF_INET, SOCK_STREAM, _HIGH | IPPROTO_MPTCP, errno.EPROTONOSUPPORT, id="mptcp-high-bits"
    ),
    pytest.param(AF_INET, SOCK_STREAM, _HIGH | 6, errno.EPROTONOSUPPORT, id="tcp-high-bits"),
]


@pytest.mark.parametrize(("family", "kind", "protocol", "expected"), REFUSED_SOCKETS)
def test_socket_refused(
    prepared: PreparedFilter, family: int, kind: int, protocol: int, expected: int
) -> None:
    _assert_refused(prepared, _socket_probe(family, kind, protocol), expected)


@pytest.mark.parametrize(
    ("family", "kind", "protocol"),
    [
        pytest.param(AF_INET, SOCK_STREAM, 0, id="tcp"),
        pytest.param(AF_INET, SOCK_STREAM | SOCK_FLAGS, 6, id="tcp-ipproto-with-flags"),
        pytest.param(AF_INET6, SOCK_STREAM, 0, id="tcp6"),
        pytest.param(AF_INET6, SOCK_STREAM | SOCK_FLAGS, 6, id="tcp6-ipproto-with-flags"),
        pytest.param(AF_UNIX, SOCK_STREAM, 0, id="unix-stream"),
        pytest.param(AF_UNIX, SOCK_DGRAM | SOCK_FLAGS, 0, id="unix-dgram"),
        pytest.param(AF_UNIX, SOCK_SEQPACKET, 0, id="unix-seqpacket"),
    ],
)
def test_socket_allowed(prepared: PreparedFilter, family: int, kind: int, protocol: int) -> None:
    _assert_allowed(prepared, _socket_probe(family, kind, protocol))


def _tcp_round_trip() -> object:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as client:
            server, _ = listener.accept()
            with server:
                client.sendall(b"ping")
                server.sendall(server.recv(4)[::-1])
                return client.recv(4).decode()


def test_tcp_still_works(prepared: PreparedFilter) -> None:
    assert _assert_allowed(prepared, _tcp_round_trip) == "gnip"


def _unix_round_trip() -> object:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"pair")
        received = [right.recv(4).decode()]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind("\0egressbox-test-seccomp-" + str(os.getpid()))
        listener.listen()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(listener.getsockname())
            server, _ = listener.accept()
            with server:
                client.sendall(b"unix")
                received.append(server.recv(4).decode())
    return received


def test_unix_sockets_and_socketpair_work(prepared: PreparedFilter) -> None:
    assert _assert_allowed(prepared, _unix_round_trip) == ["pair", "unix"]


def _socketpair_probe(family: int) -> Probe:
    def probe() -> object:
        fds = (ctypes.c_int * 2)()
        _syscall("socketpair", family, SOCK_STREAM, 0, ctypes.addressof(fds))
        os.close(fds[0])
        os.close(fds[1])
        return "created"

    return probe


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(AF_INET, id="inet"),
        pytest.param(AF_NETLINK, id="netlink"),
        pytest.param(_HIGH | AF_UNIX, id="unix-high-bits"),
    ],
)
def test_socketpair_other_families_refused(prepared: PreparedFilter, family: int) -> None:
    _assert_refused(prepared, _socketpair_probe(family), errno.EAFNOSUPPORT)


def test_without_unix_sockets(prepared_no_unix: PreparedFilter) -> None:
    _assert_refused(prepared_no_unix, _socket_probe(AF_UNIX, SOCK_STREAM, 0), errno.EAFNOSUPPORT)
    _assert_refused(prepared_no_unix, _socketpair_probe(AF_UNIX), errno.EAFNOSUPPORT)
    assert _assert_allowed(prepared_no_unix, _tcp_round_trip) == "gnip"


# TCP Fast Open


class _IoVec(ctypes.Structure):
    _fields_ = (("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t))


class _MsgHdr(ctypes.Structure):
    _fields_ = (
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.POINTER(_IoVec)),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    )


class _MMsgHdr(ctypes.Structure):
    _fields_ = (("msg_hdr", _MsgHdr), ("msg_len", ctypes.c_uint))


def _sendmmsg(sock: socket.socket, data: bytes, address: tuple[str, int], flags: int) -> int:
    name = ctypes.create_string_buffer(
        struct.pack("=H", socket.AF_INET)
        + struct.pack("!H", address[1])
        + socket.inet_aton(address[0])
        + bytes(8)
    )
    payload = ctypes.create_string_buffer(data, len(data))
    iov = _IoVec(ctypes.addressof(payload), len(data))
    message = _MMsgHdr()
    message.msg_hdr.msg_name = ctypes.addressof(name)
    message.msg_hdr.msg_namelen = 16
    message.msg_hdr.msg_iov = ctypes.pointer(iov)
    message.msg_hdr.msg_iovlen = 1
    return _syscall("sendmmsg", sock.fileno(), ctypes.addressof(message), 1, flags)


_FAST_OPEN_SENDS: dict[str, Callable[[socket.socket, tuple[str, int]], int]] = {
    "sendto": lambda sock, address: sock.sendto(b"x", socket.MSG_FASTOPEN, address),
    "sendmsg": lambda sock, address: sock.sendmsg([b"x"], [], socket.MSG_FASTOPEN, address),
    "sendmmsg": lambda sock, address: _sendmmsg(sock, b"x", address, socket.MSG_FASTOPEN),
}


@pytest.mark.parametrize("call", sorted(_FAST_OPEN_SENDS))
def test_fast_open_send_refused(prepared: PreparedFilter, call: str) -> None:
    send = _FAST_OPEN_SENDS[call]

    def probe() -> object:
        with socket.socket() as listener, socket.socket() as client:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            return send(client, listener.getsockname())

    unconfined = _assert_refused(prepared, probe, errno.EOPNOTSUPP)
    assert unconfined.ok, f"the unconfined Fast Open send should connect and send: {unconfined}"


def _tcp_fastopen_connect(level: int) -> Probe:
    def probe() -> object:
        one = ctypes.c_int(1)
        with socket.socket() as sock:
            args = (sock.fileno(), level, TCP_FASTOPEN_CONNECT, ctypes.addressof(one), 4)
            return _syscall("setsockopt", *args)

    return probe


@pytest.mark.parametrize("level", [6, _HIGH | 6], ids=["ipproto-tcp", "level-high-bits"])
def test_tcp_fastopen_connect_refused(prepared: PreparedFilter, level: int) -> None:
    _assert_refused(prepared, _tcp_fastopen_connect(level), errno.ENOPROTOOPT)


def test_other_socket_options_still_work(prepared: PreparedFilter) -> None:
    def probe() -> object:
        with socket.socket() as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)

    assert _assert_allowed(prepared, probe) == 1


# io_uring, other processes, kernel interfaces


def test_io_uring_setup_is_enosys(prepared: PreparedFilter) -> None:
    def probe() -> object:
        params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
        os.close(_syscall("io_uring_setup", 1, ctypes.addressof(params)))
        return "ring"

    _assert_refused(prepared, probe, errno.ENOSYS)


def _ptrace_attach_parent() -> object:
    # The probe process forks an attacker that attaches to it, its parent, and detaches again.
    attacker = os.fork()
    if attacker == 0:  # pragma: no cover - runs in the attacker
        code = 0
        parent = os.getppid()
        try:
            _syscall("ptrace", PTRACE_ATTACH, parent, 0, 0)
            os.waitpid(parent, WAIT_ALL)
            _syscall("ptrace", PTRACE_DETACH, parent, 0, 0)
        except OSError as exc:
            code = exc.errno or 1
        os._exit(code)
    _, status = os.waitpid(attacker, 0)
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise OSError(code, os.strerror(code))
    return "attached"


def test_ptrace_attach_to_parent_refused(prepared: PreparedFilter) -> None:
    _assert_refused(prepared, _ptrace_attach_parent, errno.EPERM)


def test_process_vm_readv_refused(prepared: PreparedFilter) -> None:
    def probe() -> object:
        size = len(_PARENT_SECRET.value)
        local = ctypes.create_string_buffer(size)
        local_iov = _IoVec(ctypes.addressof(local), size)
        remote_iov = _IoVec(ctypes.addressof(_PARENT_SECRET), size)
        args = (ctypes.addressof(local_iov), 1, ctypes.addressof(remote_iov), 1, 0)
        _syscall("process_vm_readv", os.getppid(), *args)
        return local.value.decode()

    unconfined = _assert_refused(prepared, probe, errno.EPERM)
    assert unconfined.value == _PARENT_SECRET.value.decode()


def test_bpf_refused(prepared: PreparedFilter) -> None:
    def probe() -> object:
        attr = (ctypes.c_uint32 * 32)(BPF_MAP_TYPE_ARRAY, 4, 4, 1)
        os.close(_syscall("bpf", BPF_MAP_CREATE, ctypes.addressof(attr), ctypes.sizeof(attr)))
        return "map"

    _assert_refused(prepared, probe, errno.EPERM)


def test_keyctl_refused(prepared: PreparedFilter) -> None:
    def probe() -> object:
        return _syscall("keyctl", KEYCTL_GET_KEYRING_ID, KEY_SPEC_THREAD_KEYRING, 1) > 0

    _assert_refused(prepared, probe, errno.EPERM)


# The allow list: what it does not name is refused


def test_a_call_the_table_knows_but_does_not_list_is_eperm(prepared: PreparedFilter) -> None:
    # mq_unlink has no entry of its own: it falls under "every other known call".
    assert "mq_unlink" not in {**syscall_table.ALLOWED, **syscall_table.REFUSED}
    probe = lambda: _syscall("mq_unlink", b"egressbox-no-such-queue")  # noqa: E731
    unconfined = _assert_refused(prepared, probe, errno.EPERM)
    assert unconfined.errno == errno.ENOENT


@pytest.mark.parametrize("name", ["listmount", "statmount"])
def test_a_call_newer_than_libseccomp_falls_back_with_enosys(
    prepared: PreparedFilter, name: str
) -> None:
    # Linux 6.8's mount listing: the kernel here has it (EFAULT for a NULL request), the filter
    # answers like a kernel without it, and callers read /proc/self/mountinfo instead.
    if _resolve(name) is None:
        pytest.skip(f"{name} has no number on {platform.machine()}")
    _assert_refused(prepared, lambda: _syscall(name, 0, 0, 0, 0), errno.ENOSYS)


@pytest.mark.parametrize("number", [1000, 0x7FFF, 423], ids=["high", "higher", "x86_64-gap"])
def test_a_number_no_table_knows_gets_enosys(prepared: PreparedFilter, number: int) -> None:
    # The kernel answers ENOSYS too, so the two cannot be told apart by the errno: the point is
    # that the child is neither killed nor let through, and a newer kernel's call would be
    # refused the same way. The made-up call is made through syscall(2), by number.
    def probe() -> object:
        result = int(_LIBC.syscall(ctypes.c_long(number), 0, 0, 0, 0, 0, 0))
        if result == -1:
            raise OSError(ctypes.get_errno(), "")
        return result

    confined = _run(probe, prepared)
    assert confined.errno == errno.ENOSYS, confined


def test_a_new_syscall_the_table_allows_by_number_runs(prepared: PreparedFilter) -> None:
    # mseal (Linux 6.10) is past libseccomp 2.5's names: allowed through NEWER_NUMBERS. A zero
    # length seals nothing.
    if _resolve("mseal") is None:
        pytest.skip(f"mseal has no number on {platform.machine()}")
    unconfined = _run(lambda: _syscall("mseal", 0, 0, 0), None)
    if unconfined.errno == errno.ENOSYS:
        pytest.skip("this kernel has no mseal")
    confined = _run(lambda: _syscall("mseal", 0, 0, 0), prepared)
    assert (confined.value, confined.errno) == (unconfined.value, unconfined.errno)


def test_every_argument_checked_call_has_rules_and_allowances() -> None:
    for options in (SeccompOptions(), SeccompOptions(allow_udp=True)):
        refused = {rule.syscall for group in seccomp.plan(options) for rule in group.rules}
        allowed = {allowance.syscall for allowance in seccomp.allowances(options)}
        assert refused == set(syscall_table.ARGUMENT_CHECKED)
        assert allowed == set(syscall_table.ARGUMENT_CHECKED)


# Namespaces


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(seccomp.CLONE_NEWNET, id="newnet"),
        pytest.param(seccomp.CLONE_NEWUSER, id="newuser"),
        pytest.param(seccomp.CLONE_NEWUSER | seccomp.CLONE_NEWNS, id="newuser-newns"),
        pytest.param(_HIGH | seccomp.CLONE_NEWUSER, id="newuser-high-bits"),
    ],
)
def test_unshare_new_namespace_refused(prepared: PreparedFilter, flags: int) -> None:
    _assert_refused(prepared, lambda: _syscall("unshare", flags), errno.EPERM)


def test_unshare_without_namespaces_still_works(prepared: PreparedFilter) -> None:
    # CLONE_FILES / CLONE_FS only unshare this process's own tables.
    _assert_allowed(prepared, lambda: _syscall("unshare", 0x400 | 0x200))


def _clone_probe(flags: int) -> Probe:
    def probe() -> object:
        # Stack 0: the new process runs on a copy of this stack, like fork().
        child = _syscall("clone", flags | int(signal.SIGCHLD), 0, 0, 0, 0)
        if child == 0:  # pragma: no cover - runs in the new process
            os._exit(0)
        _, status = os.waitpid(child, 0)
        return os.waitstatus_to_exitcode(status)

    return probe


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(seccomp.CLONE_NEWUSER, id="newuser"),
        pytest.param(seccomp.CLONE_NEWNET, id="newnet"),
        pytest.param(seccomp.CLONE_NEWPID, id="newpid"),
    ],
)
def test_clone_new_namespace_refused(prepared: PreparedFilter, flags: int) -> None:
    if platform.machine().startswith("s390"):
        pytest.skip("clone() takes the stack first on s390")
    _assert_refused(prepared, _clone_probe(flags), errno.EPERM)


def test_clone3_is_enosys(prepared: PreparedFilter) -> None:
    def probe() -> object:
        # struct clone_args (88 bytes): flags 0 and exit_signal SIGCHLD make it a fork().
        args = (ctypes.c_uint64 * 11)(0, 0, 0, 0, int(signal.SIGCHLD))
        child = _syscall("clone3", ctypes.addressof(args), ctypes.sizeof(args))
        if child == 0:  # pragma: no cover - runs in the new process
            os._exit(0)
        os.waitpid(child, 0)
        return "forked"

    _assert_refused(prepared, probe, errno.ENOSYS)


def test_fork_threads_and_exec_still_work(prepared: PreparedFilter) -> None:
    def probe() -> object:
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the new process
            os._exit(7)
        _, status = os.waitpid(child, 0)
        ran: list[str] = []
        thread = threading.Thread(target=lambda: ran.append("thread"))
        thread.start()
        thread.join()
        program = [sys.executable, "-c", "import socket; socket.socket().close()"]
        done = subprocess.run(program, check=False, timeout=60)
        return [os.waitstatus_to_exitcode(status), ran, done.returncode]

    assert _assert_allowed(prepared, probe) == [7, ["thread"], 0]


def test_setns_refused(prepared: PreparedFilter) -> None:
    def probe() -> object:
        fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return _syscall("setns", fd, seccomp.CLONE_NEWNET)
        finally:
            os.close(fd)

    _assert_refused(prepared, probe, errno.EPERM)


def test_mount_refused(prepared: PreparedFilter, tmp_path: Path) -> None:
    def setup() -> None:
        # A private mount namespace (before the filter), so the unconfined mount stays there.
        flags = seccomp.CLONE_NEWNS | (seccomp.CLONE_NEWUSER if os.geteuid() else 0)
        _syscall("unshare", flags)
        _syscall("mount", 0, b"/", 0, MS_REC | MS_PRIVATE, 0)

    def probe() -> object:
        return _syscall("mount", b"egressbox", os.fsencode(tmp_path), b"tmpfs", 0, 0)

    _assert_refused(prepared, probe, errno.EPERM, setup)


# Terminal


def _controlling_pty_on_stdin() -> None:
    _, follower = os.openpty()
    os.setsid()
    fcntl.ioctl(follower, termios.TIOCSCTTY, 0)
    os.dup2(follower, 0)


@pytest.mark.parametrize("high", [0, _HIGH], ids=["tiocsti", "tiocsti-high-bits"])
def test_tiocsti_refused(prepared: PreparedFilter, high: int) -> None:
    def probe() -> object:
        char = ctypes.c_char(b"x")
        return _syscall("ioctl", 0, high | termios.TIOCSTI, ctypes.addressof(char))

    _assert_refused(prepared, probe, errno.EPERM, _controlling_pty_on_stdin)


def test_tioclinux_refused(prepared: PreparedFilter) -> None:
    # Only a virtual console implements TIOCLINUX: on a pty the kernel's own answer differs.
    def probe() -> object:
        subcode = ctypes.c_char(b"\x07")
        return _syscall("ioctl", 0, termios.TIOCLINUX, ctypes.addressof(subcode))

    _assert_refused(prepared, probe, errno.EPERM, _controlling_pty_on_stdin)


def test_other_terminal_ioctls_still_work(prepared: PreparedFilter) -> None:
    def probe() -> object:
        return len(fcntl.ioctl(0, termios.TIOCGWINSZ, bytes(8)))

    assert _assert_allowed(prepared, probe, _controlling_pty_on_stdin) == 8


# personality


@pytest.mark.parametrize(
    "persona",
    [
        pytest.param(ADDR_NO_RANDOMIZE, id="addr-no-randomize"),
        pytest.param(READ_IMPLIES_EXEC, id="read-implies-exec"),
        pytest.param(MMAP_PAGE_ZERO, id="mmap-page-zero"),
        pytest.param(PER_LINUX32, id="linux32"),
        pytest.param(0xFFFFFFFE, id="all-but-one"),
        pytest.param(_HIGH | READ_IMPLIES_EXEC, id="high-bits"),
    ],
)
def test_personality_refused(prepared: PreparedFilter, persona: int) -> None:
    _assert_refused(prepared, lambda: _syscall("personality", persona), errno.EPERM)


@pytest.mark.parametrize("persona", [0, 0xFFFFFFFF, _U64], ids=["per-linux", "query", "minus-1"])
def test_personality_default_and_query_allowed(prepared: PreparedFilter, persona: int) -> None:
    _assert_allowed(prepared, lambda: _syscall("personality", persona))


# Architectures


def _int80_getpid() -> object:
    """getpid through the i386 ABI (``mov eax, 20; int 0x80; ret``) from 64-bit code."""
    code = b"\xb8\x14\x00\x00\x00\xcd\x80\xc3"
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    function = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    return [function(), os.getpid()]


@pytest.fixture
def i386_abi() -> None:
    if platform.machine() != "x86_64":
        pytest.skip(f"the i386 int 0x80 probe is x86_64 machine code; this is {platform.machine()}")
    unconfined = _run(_int80_getpid, None)
    if not unconfined.ok:
        pytest.skip(f"this kernel does not run i386 syscalls ({unconfined}): nothing to refuse")
    assert unconfined.value[0] == unconfined.value[1]


@pytest.mark.usefixtures("i386_abi")
def test_i386_syscall_kills_the_process(prepared: PreparedFilter) -> None:
    confined = _run(_int80_getpid, prepared)
    assert confined.signal == signal.SIGSYS, confined


@pytest.mark.usefixtures("i386_abi")
def test_i386_syscall_in_a_thread_kills_the_whole_process(prepared: PreparedFilter) -> None:
    # KILL_THREAD (libseccomp's default) would end only the calling thread.
    def probe() -> object:
        thread = threading.Thread(target=_int80_getpid, daemon=True)
        thread.start()
        thread.join(timeout=10)  # a killed thread never reports that it finished
        return "survived"

    assert _run(probe, None).value == "survived"
    confined = _run(probe, prepared)
    assert confined.signal == signal.SIGSYS, confined


@pytest.mark.usefixtures("i386_abi")
def test_i386_syscall_fails_without_kill_on_bad_arch() -> None:
    ready = _loadable(SeccompOptions(kill_on_bad_arch=False))
    confined = _run(_int80_getpid, ready)
    assert confined.ok, confined
    assert confined.value[0] == -errno.ENOSYS


# Inheritance


def test_grandchild_inherits_the_filter(prepared: PreparedFilter) -> None:
    def probe() -> object:
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the grandchild
            code = 0
            try:
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
            except OSError as exc:
                code = exc.errno or 1
            os._exit(code)
        _, status = os.waitpid(child, 0)
        code = os.waitstatus_to_exitcode(status)
        if code:
            raise OSError(code, os.strerror(code))
        return "udp socket"

    _assert_refused(prepared, probe, errno.EPERM)


def test_exec_keeps_the_filter_and_no_new_privs(prepared: PreparedFilter) -> None:
    script = (
        "import socket\n"
        "status = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)\n"
        "try:\n"
        "    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()\n"
        "    udp = 'created'\n"
        "except OSError as exc:\n"
        "    udp = exc.errno\n"
        "print(status['Seccomp'].strip(), status['NoNewPrivs'].strip(), udp)\n"
    )

    def probe() -> object:
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True)
        return run.stdout.decode().split()

    unconfined = _run(probe, None)
    assert unconfined.ok, unconfined
    assert unconfined.value[2] == "created"
    confined = _run(probe, prepared)
    assert confined.value == ["2", "1", str(errno.EPERM)], confined


# Every unconditional rule, called with harmless arguments


# For each syscall refused outright: arguments that make the real call fail (or do nothing)
# even unconfined as root, so the unconfined run is safe and shows the call reaches the kernel.
_NO_SUCH_PATH = b"/proc/self/egressbox-no-such-entry"  # /proc/self never gains entries
_BAD = 0xFFFFFFFF  # invalid flags, checked before anything is done
# "self" stands for the calling process's pid.
HARMLESS_CALLS: dict[str, tuple[int, tuple[int | bytes | str, ...]]] = {
    "io_uring_setup": (errno.ENOSYS, (0, 0)),
    "io_uring_enter": (errno.ENOSYS, (_U64, 0, 0, 0, 0, 0)),
    "io_uring_register": (errno.ENOSYS, (_U64, 0, 0, 0)),
    "clone3": (errno.ENOSYS, (0, 0)),  # size 0: EINVAL before anything is created
    "ptrace": (errno.EPERM, (2, 0, 0, 0)),  # PEEKDATA from pid 0: ESRCH
    "process_vm_readv": (errno.EPERM, ("self", 0, 0, 0, 0, 0)),
    "process_vm_writev": (errno.EPERM, ("self", 0, 0, 0, 0, 0)),
    "pidfd_getfd": (errno.EPERM, (_U64, 0, 0)),
    "kcmp": (errno.EPERM, ("self", "self", 0xFF, 0, 0)),
    "bpf": (errno.EPERM, (0x7FFF, 0, 0)),
    "perf_event_open": (errno.EPERM, (0, 0, _U64, _U64, 0)),
    "userfaultfd": (errno.EPERM, (_BAD,)),
    "keyctl": (errno.EPERM, (0xFFFF,)),
    "add_key": (errno.EPERM, (0, 0, 0, 0, 0)),
    "request_key": (errno.EPERM, (0, 0, 0, 0)),
    "lookup_dcookie": (errno.EPERM, (0, 0, 0)),
    "iopl": (errno.EPERM, (4,)),
    "ioperm": (errno.EPERM, (0x10000, 1, 1)),
    "mount": (errno.EPERM, (0, _NO_SUCH_PATH, 0, 0, 0)),
    "umount": (errno.EPERM, (_NO_SUCH_PATH,)),
    "umount2": (errno.EPERM, (_NO_SUCH_PATH, _BAD)),
    "pivot_root": (errno.EPERM, (_NO_SUCH_PATH, _NO_SUCH_PATH)),
    "move_mount": (errno.EPERM, (_U64, b"", _U64, b"", _BAD)),
    "open_tree": (errno.EPERM, (_U64, b"", _BAD)),
    "open_tree_attr": (errno.EPERM, (_U64, b"", _BAD, 0, 0)),
    "fsopen": (errno.EPERM, (0, _BAD)),
    "fsconfig": (errno.EPERM, (_U64, 0xFFFF, 0, 0, 0)),
    "fsmount": (errno.EPERM, (_U64, _BAD, 0)),
    "fspick": (errno.EPERM, (_U64, 0, _BAD)),
    "mount_setattr": (errno.EPERM, (_U64, 0, _BAD, 0, 0)),
    "setns": (errno.EPERM, (_U64, 0)),
    "open_by_handle_at": (errno.EPERM, (_U64, 0, 0)),
    "init_module": (errno.EPERM, (0, 0, 0)),
    "finit_module": (errno.EPERM, (_U64, b"", 0)),
    "delete_module": (errno.EPERM, (b"egressbox_no_such_module", os.O_NONBLOCK)),
    "kexec_load": (errno.EPERM, (0, 0xFFFF, 0, 0xFFFF0000)),  # too many segments, no such arch
    "kexec_file_load": (errno.EPERM, (_U64, _U64, 0, 0, _BAD)),
    "swapon": (errno.EPERM, (0, _BAD)),
    "swapoff": (errno.EPERM, (0,)),
    "reboot": (errno.EPERM, (0, 0, 0, 0)),  # no magic numbers: EINVAL
    "acct": (errno.EPERM, (_NO_SUCH_PATH,)),
    "quotactl": (errno.EPERM, (0, 0, 0, 0)),
    "quotactl_fd": (errno.EPERM, (_U64, 0, 0, 0)),
}


def _harmless_calls() -> object:
    results: dict[str, dict[str, int]] = {}
    for name, (_, raw_args) in HARMLESS_CALLS.items():
        args = [os.getpid() if isinstance(arg, str) else arg for arg in raw_args]
        if _resolve(name) is None:
            results[name] = {"absent": 1}
            continue
        try:
            results[name] = {"value": _syscall(name, *args)}
        except OSError as exc:
            results[name] = {"errno": exc.errno or 0}
    return results


@pytest.fixture(scope="module")
def harmless_outcomes(prepared: PreparedFilter) -> tuple[dict[str, Any], dict[str, Any]]:
    unconfined = _run(_harmless_calls, None)
    confined = _run(_harmless_calls, prepared)
    assert unconfined.ok, unconfined
    assert confined.ok, confined
    return unconfined.value, confined.value


def test_harmless_calls_cover_what_the_old_deny_list_refused() -> None:
    # Each call of the old deny list is out of the allow list: EPERM, or ENOSYS where the table
    # sends it on purpose (callers fall back).
    for name, (err, _) in HARMLESS_CALLS.items():
        assert name not in syscall_table.ALLOWED, name
        assert err == (errno.ENOSYS if name in syscall_table.FALLBACK else errno.EPERM), name
    named = set(syscall_table.REFUSED) | set(syscall_table.FALLBACK)
    assert named >= set(HARMLESS_CALLS) - {"umount"}  # umount: no such call on x86_64/aarch64


@pytest.mark.parametrize("name", sorted(HARMLESS_CALLS))
def test_refused_outright(
    harmless_outcomes: tuple[dict[str, Any], dict[str, Any]], name: str
) -> None:
    unconfined, confined = (outcomes[name] for outcomes in harmless_outcomes)
    expected = HARMLESS_CALLS[name][0]
    if "absent" in unconfined:
        pytest.skip(f"{name} does not exist on {platform.machine()}")
    if unconfined.get("errno") == expected:
        pytest.skip(f"this host answers {_ename(expected)} too: the filter is indistinguishable")
    assert confined == {"errno": expected}, f"unconfined: {unconfined}"


# The report


def test_loaded_report(prepared: PreparedFilter) -> None:
    def probe() -> object:
        return seccomp.apply().to_dict()

    loaded = _run(probe, None)
    assert loaded.ok, loaded
    report = loaded.value
    assert report["status"] == "full"
    assert report["failed"] == []
    assert report["bad_arch_action"] == "KILL_PROCESS"
    names = [group["name"] for group in report["groups"]]
    assert names == [group.name for group in seccomp.plan()]
    enforced = {name for group in report["groups"] for name in group["syscalls"]}
    planned = {rule.syscall for group in seccomp.plan() for rule in group.rules}
    assert enforced | set(report["skipped"]) == planned
    assert not enforced & set(report["skipped"])
    for name in report["skipped"]:
        assert _resolve(name) is None, f"{name} exists here but was skipped"
    assert prepared.reason == report["reason"]
    allowed = [name for name in syscall_table.ALLOWED if _resolve(name) is not None]
    assert report["allowed"] == allowed
    assert report["reason"].startswith(f"allow list of {len(allowed)} system calls (measured")
    assert not set(report["refused"]) & (set(syscall_table.ALLOWED) | set(syscall_table.FALLBACK))
    assert set(syscall_table.REFUSED) - set(report["skipped"]) <= set(report["refused"])


def test_report_status_values_are_stable() -> None:
    assert [str(status) for status in Status] == ["full", "partial", "none"]


@pytest.fixture
def without_pyseccomp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # makes `import pyseccomp` fail


@pytest.mark.usefixtures("without_pyseccomp")
def test_missing_pyseccomp_reports_none() -> None:
    ready = seccomp.prepare()
    assert not ready.available
    report = ready.load()  # nothing to load: safe in this process
    assert report.status is Status.NONE
    assert not report.enforced
    assert "pyseccomp" in report.reason
    assert seccomp.apply().status is Status.NONE
    with pytest.raises(SeccompUnavailableError, match="pyseccomp"):
        seccomp.build_filter()


def test_importing_the_module_does_not_import_pyseccomp() -> None:
    code = "import sys, egressbox.confine.seccomp; print('pyseccomp' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    assert run.stdout.strip() == b"False"


def test_unknown_syscall_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = RuleGroup("test", "a name no architecture has", (Rule("egressbox_nope", 1),))
    real_plan = seccomp.plan
    monkeypatch.setattr(seccomp, "plan", lambda options=None: (*real_plan(options), extra))
    ready = seccomp.prepare()
    if not ready.available:
        pytest.skip(ready.reason)
    report = _run(lambda: ready.load().to_dict(), None).value
    assert report["status"] == "full"
    assert "egressbox_nope" in report["skipped"]
    assert "test" not in [group["name"] for group in report["groups"]]


def test_rule_libseccomp_rejects_makes_it_partial(monkeypatch: pytest.MonkeyPatch) -> None:
    # Argument index 6 does not exist: libseccomp refuses the rule (EINVAL).
    broken = RuleGroup("test", "a bad rule", (Rule("kill", 1, (ArgCmp(6, CmpOp.EQ, 0),)),))
    real_plan = seccomp.plan
    monkeypatch.setattr(seccomp, "plan", lambda options=None: (*real_plan(options), broken))
    ready = seccomp.prepare()
    if not ready.available:
        pytest.skip(ready.reason)
    report = _run(lambda: ready.load().to_dict(), None).value
    assert report["status"] == "partial"
    assert report["failed"] == ["kill"]
    assert "kill" in report["reason"]


def test_report_to_dict_is_json() -> None:
    report = SeccompReport(Status.NONE, "because", skipped=("x",))
    assert json.loads(json.dumps(report.to_dict()))["skipped"] == ["x"]


# The rules as data: an independent model of what each syscall's arguments should get


def _holds(cmp: ArgCmp, args: Sequence[int]) -> bool:
    value = args[cmp.index] & _U64
    if cmp.op is CmpOp.EQ:
        return value == cmp.datum_a
    if cmp.op is CmpOp.GT:
        return value > cmp.datum_a
    return value & cmp.datum_a == cmp.datum_b


def _answer(
    groups: Sequence[RuleGroup],
    syscall: str,
    args: Sequence[int],
    allowed: Sequence[Allowance] | None = None,
) -> int | None:
    """The errno the refusals give, or None when the call runs: then exactly one allowance must
    hold (libseccomp's default, ENOSYS, would answer a value no rule describes)."""
    answers = {
        rule.errno
        for group in groups
        for rule in group.rules
        if rule.syscall == syscall and all(_holds(cmp, args) for cmp in rule.args)
    }
    assert len(answers) <= 1, f"overlapping rules disagree for {syscall}{tuple(args)}"
    allowed = seccomp.allowances() if allowed is None else allowed
    allowing = [
        allowance
        for allowance in allowed
        if allowance.syscall == syscall and all(_holds(cmp, args) for cmp in allowance.args)
    ]
    if answers:
        assert not allowing, f"{syscall}{tuple(args)} both refused and allowed: {allowing}"
        return answers.pop()
    assert len(allowing) == 1, f"{syscall}{tuple(args)}: {len(allowing)} allowances hold"
    return None


def _expected_socket(args: Sequence[int], unix: bool, udp: bool = False) -> int | None:
    family, kind, protocol = (arg & _U64 for arg in args[:3])
    if family not in ({1, 2, 10} if unix else {2, 10}):
        return errno.EAFNOSUPPORT
    if family == 1:
        return None
    if kind & 0xF == 2 and udp:
        return None if protocol in (0, 17) else errno.EPROTONOSUPPORT
    if kind & 0xF != 1:
        return errno.EPERM
    return None if protocol in (0, 6) else errno.EPROTONOSUPPORT


_INTERESTING = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 15, 16, 17, 40, 132, 256, 262, 0x7FFFFFFF]
_args = st.one_of(
    st.sampled_from(_INTERESTING),
    st.sampled_from(_INTERESTING).map(lambda value: value | _HIGH),
    st.sampled_from(_INTERESTING).map(lambda value: value | (_U64 ^ _U32)),
    st.integers(0, _U64),
)


@given(st.lists(_args, min_size=6, max_size=6), st.booleans(), st.booleans())
@settings(max_examples=2000)
def test_socket_rules_model(args: list[int], unix: bool, udp: bool) -> None:
    options = SeccompOptions(allow_unix_sockets=unix, allow_udp=udp)
    groups, allowed = seccomp.plan(options), seccomp.allowances(options)
    assert _answer(groups, "socket", args, allowed) == _expected_socket(args, unix, udp)
    pair = None if args[0] == 1 and unix else errno.EAFNOSUPPORT
    assert _answer(groups, "socketpair", args, allowed) == pair


@given(st.lists(_args, min_size=6, max_size=6))
@settings(max_examples=1000)
def test_flag_rules_model(args: list[int]) -> None:
    groups = seccomp.plan()
    low = args[0] & _U32
    assert _answer(groups, "personality", args) == (None if low in (0, 0xFFFFFFFF) else errno.EPERM)
    namespaces = 0x7E020000
    index = 1 if platform.machine().startswith("s390") else 0
    assert _answer(groups, "clone", args) == (errno.EPERM if args[index] & namespaces else None)
    assert _answer(groups, "unshare", args) == (
        errno.EPERM if args[0] & (namespaces | 0x80) else None
    )
    fastopen = errno.EOPNOTSUPP
    assert _answer(groups, "sendto", args) == (fastopen if args[3] & 0x20000000 else None)
    assert _answer(groups, "sendmsg", args) == (fastopen if args[2] & 0x20000000 else None)
    assert _answer(groups, "sendmmsg", args) == (fastopen if args[3] & 0x20000000 else None)
    tfo_connect = (args[1] & _U32, args[2] & _U32) == (6, 30)
    assert _answer(groups, "setsockopt", args) == (errno.ENOPROTOOPT if tfo_connect else None)
    terminal = (args[1] & _U32) in (termios.TIOCSTI, termios.TIOCLINUX)
    assert _answer(groups, "ioctl", args) == (errno.EPERM if terminal else None)


@pytest.mark.parametrize(
    ("syscall", "args", "expected"),
    [
        ("socket", (2, 1, 0), None),
        ("socket", (10, 1 | 0x80800, 6), None),
        ("socket", (_HIGH | 2, 1, 0), errno.EAFNOSUPPORT),
        ("socket", (_HIGH | 17, 3, 0), errno.EAFNOSUPPORT),
        ("socket", (2, 2, 17), errno.EPERM),
        ("socket", (2, 1, 262), errno.EPROTONOSUPPORT),
        ("socket", (1, 2, 0), None),
        ("personality", (0xFFFFFFFF,), None),
        ("personality", (0x0040000,), errno.EPERM),
        ("unshare", (0x10000000,), errno.EPERM),
        ("unshare", (0x400,), None),
        ("ioctl", (0, _HIGH | 0x5412), errno.EPERM),
    ],
)
def test_rule_examples(syscall: str, args: tuple[int, ...], expected: int | None) -> None:
    padded = (*args, 0, 0, 0, 0, 0, 0)[:6]
    if syscall == "clone" and platform.machine().startswith("s390"):
        pytest.skip("clone's flags are its second argument on s390")
    assert _answer(seccomp.plan(), syscall, padded) == expected


def _matched(cmps: Sequence[ArgCmp], values: Sequence[int]) -> list[int]:
    return [value for value in values if any(_holds(cmp, [value]) for cmp in cmps)]


def test_outside_is_exact_near_the_allowed_values() -> None:
    near = [*range(64), _HIGH | 1, _HIGH | 2, _U64 - 1, _U64]
    wide = seccomp._outside(0, [10, 1, 2])
    assert _matched(wide, near) == [value for value in near if value not in (1, 2, 10)]
    narrow = seccomp._outside(0, [1], bits=4)
    assert _matched(narrow, near) == [value for value in near if value & 0xF != 1]


# The variant for a captured child: UDP sockets, and nothing else more


@pytest.fixture(scope="module")
def prepared_udp() -> PreparedFilter:
    return _loadable(SeccompOptions(allow_udp=True))


@pytest.mark.parametrize(
    ("family", "kind", "protocol"),
    [
        pytest.param(AF_INET, SOCK_DGRAM, 0, id="udp"),
        pytest.param(AF_INET, SOCK_DGRAM | SOCK_FLAGS, 17, id="udp-ipproto-with-flags"),
        pytest.param(AF_INET6, SOCK_DGRAM, 0, id="udp6"),
        pytest.param(AF_INET6, SOCK_DGRAM, 17, id="udp6-ipproto"),
        pytest.param(AF_INET, SOCK_STREAM, 0, id="tcp"),
        pytest.param(AF_INET6, SOCK_STREAM | SOCK_FLAGS, 6, id="tcp6"),
    ],
)
def test_udp_variant_allows(
    prepared_udp: PreparedFilter, family: int, kind: int, protocol: int
) -> None:
    _assert_allowed(prepared_udp, _socket_probe(family, kind, protocol))


UDP_VARIANT_REFUSED = [
    pytest.param(AF_INET, SOCK_DGRAM, 1, errno.EPROTONOSUPPORT, id="icmp-ping"),
    pytest.param(AF_INET6, SOCK_DGRAM, 58, errno.EPROTONOSUPPORT, id="icmp6-ping"),
    pytest.param(AF_INET, SOCK_DGRAM, 136, errno.EPROTONOSUPPORT, id="udplite"),
    pytest.param(AF_INET, SOCK_DGRAM, _HIGH | 17, errno.EPROTONOSUPPORT, id="udp-high-bits"),
    pytest.param(AF_INET, SOCK_RAW, 1, errno.EPERM, id="raw"),
    pytest.param(AF_INET6, SOCK_RAW, 58, errno.EPERM, id="raw6"),
    pytest.param(AF_INET, SOCK_SEQPACKET, IPPROTO_SCTP, errno.EPERM, id="sctp-seqpacket"),
    pytest.param(AF_INET, SOCK_STREAM, IPPROTO_MPTCP, errno.EPROTONOSUPPORT, id="mptcp"),
    pytest.param(AF_INET6, SOCK_STREAM, IPPROTO_MPTCP, errno.EPROTONOSUPPORT, id="mptcp6"),
    pytest.param(AF_INET, SOCK_STREAM, IPPROTO_SCTP, errno.EPROTONOSUPPORT, id="sctp-stream"),
    pytest.param(AF_PACKET, SOCK_DGRAM, 0, errno.EAFNOSUPPORT, id="packet"),
    pytest.param(AF_NETLINK, SOCK_DGRAM, 0, errno.EAFNOSUPPORT, id="netlink"),
    pytest.param(AF_VSOCK, SOCK_DGRAM, 0, errno.EAFNOSUPPORT, id="vsock"),
]


@pytest.mark.parametrize(("family", "kind", "protocol", "expected"), UDP_VARIANT_REFUSED)
def test_udp_variant_still_refuses(
    prepared_udp: PreparedFilter, family: int, kind: int, protocol: int, expected: int
) -> None:
    _assert_refused(prepared_udp, _socket_probe(family, kind, protocol), expected)


def test_udp_variant_changes_only_the_inet_groups() -> None:
    plain = {group.name: group.rules for group in seccomp.plan()}
    udp = {group.name: group.rules for group in seccomp.plan(SeccompOptions(allow_udp=True))}
    assert list(plain) == list(udp)
    changed = {name for name in plain if plain[name] != udp[name]}
    assert changed == {"inet socket types", "inet protocols"}


def test_compiled_program_is_cached_and_enforces(tmp_path: Path) -> None:
    # `egressbox run` loads the filter as a cached BPF program (no pyseccomp
    # import in the launcher): the cache round-trips and the program enforces.
    from egressbox.confine.seccomp import compile_filter, load_program
    from egressbox.runner import own_state

    first = compile_filter()
    assert first.program and first.status is Status.FULL
    stored = str(tmp_path / "cache" / "program")
    own_state.write(stored, first.program)
    assert own_state.read(stored) == first.program

    def probe() -> object:
        load_program(first.program)
        try:
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
        except PermissionError:
            return "udp refused"
        return "udp allowed"

    assert _run(probe, None).value == "udp refused"
