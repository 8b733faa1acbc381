"""The Landlock binding: layouts, errno handling, and real enforcement in forked children.

restrict_self is irreversible, so every test that restricts does it in a forked child that reports
through a pipe; the test process itself is never restricted.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egressbox.confine import landlock
from egressbox.confine.landlock import (
    AccessFs,
    AccessNet,
    LandlockError,
    NetPortAttr,
    PathBeneathAttr,
    RestrictFlags,
    Ruleset,
    RulesetAttr,
    Scope,
)
from forking import attempt as _attempt
from forking import fork_call as run_in_child

# The test's own libc handle: an independent check of what the binding reports.
_TEST_LIBC = ctypes.CDLL(None, use_errno=True)
_TEST_LIBC.syscall.restype = ctypes.c_long
_PR_GET_NO_NEW_PRIVS = 39


def _raw_create_ruleset_query(flags: int) -> tuple[int, int]:
    """landlock_create_ruleset(NULL, 0, flags) called directly: (result, errno)."""
    result = int(
        _TEST_LIBC.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(flags))
    )
    return result, ctypes.get_errno() if result == -1 else 0


def _require_abi(minimum: int) -> int:
    info = landlock.query_abi()
    if info.version == 0:
        pytest.skip(f"Landlock unavailable: {info.reason}")
    if info.version < minimum:
        pytest.skip(f"needs Landlock ABI >= {minimum}, host has {info.version}")
    return info.version


@pytest.fixture
def abi() -> int:
    return _require_abi(1)


def _read(path: Path) -> None:
    with open(path, "rb") as handle:
        handle.read()


def _connect(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(("127.0.0.1", port))


@pytest.fixture
def listeners() -> Iterator[tuple[int, int]]:
    """Two loopback TCP listeners: (allowed port, denied port)."""
    socks = [socket.create_server(("127.0.0.1", 0), backlog=16) for _ in range(2)]
    try:
        yield socks[0].getsockname()[1], socks[1].getsockname()[1]
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(allowed dir, file inside it, file outside it)."""
    allowed = tmp_path / "allowed"
    outside = tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    inside_file = allowed / "inside.txt"
    outside_file = outside / "secret.txt"
    inside_file.write_text("in")
    outside_file.write_text("out")
    return allowed, inside_file, outside_file


# Layouts and constants


def test_struct_layouts() -> None:
    assert ctypes.sizeof(RulesetAttr) == 24
    assert [RulesetAttr.handled_access_fs.offset, RulesetAttr.handled_access_net.offset] == [0, 8]
    assert RulesetAttr.scoped.offset == 16
    # Packed in the UAPI: a natural layout would be 16 bytes and the kernel would misread it.
    assert ctypes.sizeof(PathBeneathAttr) == 12
    assert PathBeneathAttr.parent_fd.offset == 8
    assert bytes(PathBeneathAttr(allowed_access=5, parent_fd=-1)) == struct.pack("=Qi", 5, -1)
    assert ctypes.sizeof(NetPortAttr) == 16
    assert bytes(NetPortAttr(allowed_access=2, port=443)) == struct.pack("=QQ", 2, 443)


@pytest.mark.parametrize(
    ("abi_version", "size"), [(1, 8), (3, 8), (4, 16), (5, 16), (6, 24), (7, 24), (9, 24)]
)
def test_ruleset_attr_size_by_abi(abi_version: int, size: int) -> None:
    assert landlock.ruleset_attr_size(abi_version) == size


def test_constants_match_uapi() -> None:
    assert (landlock.SYS_LANDLOCK_CREATE_RULESET, landlock.SYS_LANDLOCK_ADD_RULE) == (444, 445)
    assert landlock.SYS_LANDLOCK_RESTRICT_SELF == 446
    assert (landlock.RULE_PATH_BENEATH, landlock.RULE_NET_PORT) == (1, 2)
    assert (AccessNet.BIND_TCP, AccessNet.CONNECT_TCP) == (1, 2)
    assert (Scope.ABSTRACT_UNIX_SOCKET, Scope.SIGNAL) == (1, 2)
    flags = RestrictFlags
    assert (flags.LOG_SAME_EXEC_OFF, flags.LOG_NEW_EXEC_ON, flags.LOG_SUBDOMAINS_OFF) == (1, 2, 4)
    assert (AccessFs.MAKE_SYM, AccessFs.REFER, AccessFs.IOCTL_DEV) == (1 << 12, 1 << 13, 1 << 15)


def test_rights_by_abi() -> None:
    assert landlock.fs_access_for_abi(0) == 0
    assert landlock.fs_access_for_abi(1) == (1 << 13) - 1
    assert landlock.fs_access_for_abi(2) == (1 << 14) - 1
    assert landlock.fs_access_for_abi(4) == (1 << 15) - 1
    assert landlock.fs_access_for_abi(5) == (1 << 16) - 1
    assert landlock.net_access_for_abi(3) == 0
    assert landlock.net_access_for_abi(4) == AccessNet.BIND_TCP | AccessNet.CONNECT_TCP
    assert landlock.scopes_for_abi(5) == 0
    assert landlock.scopes_for_abi(6) == Scope.ABSTRACT_UNIX_SOCKET | Scope.SIGNAL
    assert landlock.restrict_flags_for_abi(6) == 0
    assert landlock.restrict_flags_for_abi(7) == 7
    assert landlock.abi_features(3) == ("fs",)
    assert landlock.abi_features(7) == ("fs", "tcp_ports", "scopes", "logging")


# The kernel interface


def test_abi_and_errata_match_raw_syscall() -> None:
    raw_abi, raw_errno = _raw_create_ruleset_query(landlock.CREATE_RULESET_VERSION)
    info = landlock.query_abi()
    if raw_abi == -1:
        assert (info.version, info.errno) == (0, raw_errno)
        assert landlock.abi_version() == 0
        pytest.skip(f"Landlock unavailable: {info.reason}")
    assert landlock.abi_version() == info.version == raw_abi
    raw_errata, _ = _raw_create_ruleset_query(landlock.CREATE_RULESET_ERRATA)
    assert landlock.errata() == info.errata == max(raw_errata, 0)


def test_unsupported_reason_is_kept() -> None:
    info = landlock.AbiInfo(version=0, errata=0, errno=errno.EOPNOTSUPP)
    assert "not enabled at boot" in info.reason
    assert "ENOSYS" not in landlock.AbiInfo(0, 0, errno.ENOSYS).reason
    assert "EPERM" in landlock.AbiInfo(0, 0, errno.EPERM).reason
    assert landlock.AbiInfo(7, 0).reason == ""


def test_empty_handled_set_is_enomsg(abi: int) -> None:
    with pytest.raises(LandlockError) as caught:
        Ruleset.create()
    assert caught.value.errno == errno.ENOMSG
    assert caught.value.call == "landlock_create_ruleset"


def test_net_bits_cut_off_by_size_8_are_enomsg(abi: int) -> None:
    attr = RulesetAttr(handled_access_net=AccessNet.CONNECT_TCP)
    with pytest.raises(LandlockError) as caught:
        landlock.create_ruleset(attr, 8)
    assert caught.value.errno == errno.ENOMSG


def test_unknown_bit_is_einval(abi: int) -> None:
    with pytest.raises(LandlockError) as caught:
        landlock.create_ruleset(RulesetAttr(handled_access_fs=1 << 62), 8)
    assert caught.value.errno == errno.EINVAL


def test_stale_errno_is_not_failure(abi: int, tmp_path: Path) -> None:
    ctypes.set_errno(errno.EPERM)
    assert landlock.abi_version() == abi
    with Ruleset.create(fs=AccessFs.READ_FILE | AccessFs.READ_DIR) as ruleset:
        assert ruleset.add_path_rule(tmp_path, AccessFs.READ_DIR) == AccessFs.READ_DIR
    # The successful calls left the stale value in place: only the -1 return must be trusted.
    assert ctypes.get_errno() == errno.EPERM


def test_real_failure_reports_its_own_errno(abi: int) -> None:
    ctypes.set_errno(errno.EPERM)
    with pytest.raises(LandlockError) as caught:
        Ruleset.create()
    assert caught.value.errno == errno.ENOMSG


def test_ruleset_fd_is_cloexec_and_closed(abi: int) -> None:
    with Ruleset.create(fs=AccessFs.READ_FILE) as ruleset:
        fd = ruleset.fileno()
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    assert ruleset.closed
    with pytest.raises(OSError) as caught:
        os.fstat(fd)
    assert caught.value.errno == errno.EBADF
    with pytest.raises(ValueError, match="closed"):
        ruleset.fileno()
    ruleset.close()  # idempotent


def test_path_rule_on_a_file_keeps_file_rights_only(abi: int, tmp_path: Path) -> None:
    file_path = tmp_path / "f"
    file_path.write_text("x")
    read = AccessFs.READ_FILE | AccessFs.READ_DIR
    with Ruleset.create(fs=read) as ruleset:
        assert ruleset.add_path_rule(file_path, read) == AccessFs.READ_FILE
        assert ruleset.add_path_rule(file_path, AccessFs.READ_DIR) == AccessFs(0)
        assert ruleset.add_path_rule(tmp_path, read) == read
        with pytest.raises(FileNotFoundError):
            ruleset.add_path_rule(tmp_path / "missing", read)


def test_rights_are_checked_before_the_kernel(abi: int, tmp_path: Path) -> None:
    with Ruleset.create(fs=AccessFs.READ_FILE, abi=abi) as ruleset:
        with pytest.raises(ValueError, match="not handled"):
            ruleset.add_path_rule(tmp_path, AccessFs.WRITE_FILE)
        with pytest.raises(ValueError, match="not handled"):
            ruleset.add_net_port_rule(80, AccessNet.CONNECT_TCP)
        with pytest.raises(ValueError, match="out of range"):
            ruleset.add_net_port_rule(70000, AccessNet.CONNECT_TCP)
    # Dropping a right the ABI lacks would leave it unrestricted, so asking for it is an error.
    with pytest.raises(ValueError, match="ABI 3"):
        Ruleset.create(net=AccessNet.CONNECT_TCP, abi=3)
    with pytest.raises(ValueError, match="ABI 5"):
        Ruleset.create(fs=AccessFs.READ_FILE, scoped=Scope.SIGNAL, abi=5)


# Enforcement, in children


def _fs_and_net_probes(inside: Path, outside: Path, ports: tuple[int, int]) -> dict[str, str]:
    return {
        "read_inside": _attempt(lambda: _read(inside)),
        "read_outside": _attempt(lambda: _read(outside)),
        "connect_allowed": _attempt(lambda: _connect(ports[0])),
        "connect_denied": _attempt(lambda: _connect(ports[1])),
    }


def test_restrict_fs_and_net_in_child(
    tree: tuple[Path, Path, Path], listeners: tuple[int, int]
) -> None:
    _require_abi(landlock.MIN_ABI_NET)
    allowed, inside, outside = tree
    read = AccessFs.READ_FILE | AccessFs.READ_DIR

    def body() -> dict[str, Any]:
        before = _fs_and_net_probes(inside, outside, listeners)
        with Ruleset.create(fs=read, net=AccessNet.CONNECT_TCP) as ruleset:
            ruleset.add_path_rule(allowed, read)
            ruleset.add_net_port_rule(listeners[0], AccessNet.CONNECT_TCP)
            ruleset.restrict_self()
        after = _fs_and_net_probes(inside, outside, listeners)
        zero = ctypes.c_ulong(0)
        no_new_privs = _TEST_LIBC.prctl(_PR_GET_NO_NEW_PRIVS, zero, zero, zero, zero)
        return {"before": before, "after": after, "no_new_privs": no_new_privs}

    result = run_in_child(body)
    assert set(result["before"].values()) == {"ok"}
    assert result["after"] == {
        "read_inside": "ok",
        "read_outside": "EACCES",
        "connect_allowed": "ok",
        "connect_denied": "EACCES",
    }
    assert result["no_new_privs"] == 1


def test_restrict_fs_only_in_child(abi: int, tree: tuple[Path, Path, Path]) -> None:
    allowed, inside, outside = tree

    def body() -> dict[str, Any]:
        with Ruleset.create(fs=AccessFs.READ_FILE) as ruleset:
            ruleset.add_path_rule(allowed, AccessFs.READ_FILE)
            ruleset.restrict_self()
        return {
            "inside": _attempt(lambda: _read(inside)),
            "outside": _attempt(lambda: _read(outside)),
        }

    assert run_in_child(body) == {"inside": "ok", "outside": "EACCES"}


def test_unrestricted_child_sees_everything(
    tree: tuple[Path, Path, Path], listeners: tuple[int, int]
) -> None:
    _, inside, outside = tree
    result = run_in_child(lambda: _fs_and_net_probes(inside, outside, listeners))
    assert set(result.values()) == {"ok"}


def test_scope_blocks_abstract_unix_socket_in_child() -> None:
    _require_abi(landlock.MIN_ABI_SCOPE)
    name = f"\0egressbox-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(name)
        server.listen(4)

        def connect() -> None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(name)

        def body() -> dict[str, Any]:
            before = _attempt(connect)
            with Ruleset.create(scoped=Scope.ABSTRACT_UNIX_SOCKET) as ruleset:
                ruleset.restrict_self()
            return {"before": before, "after": _attempt(connect)}

        assert run_in_child(body) == {"before": "ok", "after": "EPERM"}


def test_restrict_flags_need_abi_7_in_child() -> None:
    abi = _require_abi(1)

    def body() -> dict[str, Any]:
        ruleset = Ruleset.create(fs=AccessFs.READ_FILE, abi=min(abi, 6))
        try:
            ruleset.restrict_self(RestrictFlags.LOG_NEW_EXEC_ON)
        except ValueError as exc:
            return {"error": str(exc)}
        finally:
            ruleset.close()
        return {"error": ""}

    assert "not supported by Landlock ABI" in run_in_child(body)["error"]


def test_seventeenth_layer_is_e2big_in_child() -> None:
    _require_abi(1)

    def body() -> dict[str, Any]:
        for layer in range(1, 18):
            try:
                with Ruleset.create(fs=AccessFs.EXECUTE) as ruleset:
                    ruleset.restrict_self()
            except LandlockError as exc:
                return {"layer": layer, "errno": exc.errno}
        return {"layer": 0, "errno": 0}

    assert run_in_child(body) == {"layer": 17, "errno": errno.E2BIG}
