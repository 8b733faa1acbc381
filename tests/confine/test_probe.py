"""Host probing: each result is checked against an independent check made by the test itself.

Nothing here assumes this host has a feature: where the independent check says a feature is
missing, the test asserts the probe agrees and skips with the probe's reason.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import time
from typing import Any

import pytest

from egressbox.confine import landlock, probe
from egressbox.confine.probe import Availability, HostSupport, Mechanism, probe_host
from forking import fork_call as _run_in_child

_TEST_LIBC = ctypes.CDLL(None, use_errno=True)
_TEST_LIBC.syscall.restype = ctypes.c_long
NOBODY = 65534

MECHANISM_NAMES = [
    "landlock",
    "seccomp",
    "no_new_privs",
    "user_namespace",
    "network_namespace",
    "mount_namespace",
    "pid_namespace",
    "close_range",
    "capture",
    "connect_supervisor",
]


@pytest.fixture(scope="module")
def support() -> HostSupport:
    return probe_host()


def _mechanism(support: HostSupport, name: str) -> Mechanism:
    found: Mechanism = getattr(support, name)
    return found


def _agree_or_skip(mechanism: Mechanism, independently_available: bool) -> None:
    """The probe must agree with the test's own check; a missing feature skips the test."""
    if not independently_available:
        assert mechanism.status is not Availability.AVAILABLE, mechanism
        pytest.skip(f"{mechanism.name}: {mechanism.status}: {mechanism.detail}")
    assert mechanism.status is Availability.AVAILABLE, mechanism.detail


def _proc_status() -> dict[str, str]:
    with open("/proc/self/status", encoding="ascii") as handle:
        pairs = (line.split(":", 1) for line in handle if ":" in line)
        return {key: value.strip() for key, value in pairs}


# Shape and speed


def test_probe_is_quick_and_complete(support: HostSupport) -> None:
    started = time.monotonic()
    fresh = probe_host()
    assert time.monotonic() - started < 1.0
    assert [m.name for m in fresh.mechanisms()] == MECHANISM_NAMES
    for mechanism in fresh.mechanisms():
        assert isinstance(mechanism.status, Availability)
        assert mechanism.detail
    assert fresh.euid == os.geteuid()
    assert fresh == support  # elapsed time is not part of equality


def test_probe_leaves_the_calling_process_unchanged() -> None:
    def snapshot() -> dict[str, Any]:
        status = _proc_status()
        return {
            "ns": {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("user", "net", "mnt", "pid")},
            "status": {key: status.get(key) for key in ("NoNewPrivs", "Seccomp", "Uid", "CapEff")},
            "cwd": os.getcwd(),
        }

    before = snapshot()
    probe_host()
    assert snapshot() == before
    # Every probe child has been reaped.
    child_files = glob.glob(f"/proc/{os.getpid()}/task/*/children")
    if child_files:
        for path in child_files:
            with open(path, encoding="ascii") as handle:
                assert handle.read().strip() == ""


# Each mechanism against an independent check


def test_landlock_matches_raw_syscall(support: HostSupport) -> None:
    raw = int(_TEST_LIBC.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1)))
    mechanism = support.landlock
    _agree_or_skip(mechanism, raw > 0)
    assert mechanism.abi == raw >= 1
    assert f"ABI {raw}" in mechanism.detail
    assert "fs" in mechanism.covers
    assert ("tcp_ports" in mechanism.covers) == (raw >= 4)
    assert ("scopes" in mechanism.covers) == (raw >= 6)
    assert ("logging" in mechanism.covers) == (raw >= 7)


def test_seccomp_matches_proc_status(support: HostSupport) -> None:
    has_kernel_seccomp = "Seccomp" in _proc_status()
    has_library = importlib.util.find_spec("pyseccomp") is not None
    _agree_or_skip(support.seccomp, has_kernel_seccomp and has_library)
    mode = _proc_status()["Seccomp"]
    assert f"mode {mode}" in support.seccomp.detail


def test_no_new_privs_matches_proc_status(support: HostSupport) -> None:
    status = _proc_status()
    _agree_or_skip(support.no_new_privs, "NoNewPrivs" in status)
    state = "on" if status["NoNewPrivs"] == "1" else "off"
    assert f"this process: {state}" in support.no_new_privs.detail


def _unshare_tool_works(flags: list[str], user: int | None = None) -> bool:
    tool = shutil.which("unshare")
    if tool is None:
        pytest.skip("no unshare(1) for an independent check")
    if (user if user is not None else os.geteuid()) != 0:
        flags = ["--user", *flags]
    extra: dict[str, Any] = {}
    if user is not None:
        extra = {"user": user, "group": user, "extra_groups": []}
    result = subprocess.run(
        [tool, *flags, "true"], capture_output=True, timeout=10, check=False, **extra
    )
    return result.returncode == 0


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        ("user_namespace", ["--user"]),
        ("network_namespace", ["--net"]),
        ("mount_namespace", ["--mount"]),
        ("pid_namespace", ["--pid", "--fork"]),
    ],
)
def test_namespace_matches_unshare_tool(support: HostSupport, name: str, flags: list[str]) -> None:
    mechanism = _mechanism(support, name)
    _agree_or_skip(mechanism, _unshare_tool_works(flags))
    assert "unshare(" in mechanism.detail
    assert ("CLONE_NEWUSER" in mechanism.detail) == (name == "user_namespace" or os.geteuid() != 0)


def test_close_range_matches_raw_syscall(support: HostSupport) -> None:
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    args = (ctypes.c_long(436), ctypes.c_long(fd), ctypes.c_long(fd), ctypes.c_long(0))
    closed = int(_TEST_LIBC.syscall(*args)) == 0
    if not closed:
        os.close(fd)
    _agree_or_skip(support.close_range, closed)


# What the capture probe proves, done with the tools: a local default route and an nftables
# nat output chain in a fresh network namespace (a user namespace mapped to root unless root).
_NFT_CHECK = (
    "ip route add local 0.0.0.0/0 dev lo && nft add table inet probe && "
    "nft add chain inet probe out '{ type nat hook output priority -100; }' && "
    "nft add rule inet probe out meta l4proto tcp redirect to :9"
)


def _nft_tools_work(user: int | None = None) -> bool:
    tools = [shutil.which(name) for name in ("unshare", "ip", "nft")]
    if None in tools:
        pytest.skip("no unshare(1), ip(8) or nft(8) for an independent check")
    flags = ["--net"]
    if (user if user is not None else os.geteuid()) != 0:
        flags = ["--user", "--map-root-user", *flags]
    extra: dict[str, Any] = {}
    if user is not None:
        extra = {"user": user, "group": user, "extra_groups": []}
    argv = [str(tools[0]), *flags, "sh", "-c", _NFT_CHECK]
    result = subprocess.run(argv, capture_output=True, timeout=10, check=False, **extra)
    return result.returncode == 0


def test_capture_matches_the_nft_tool(support: HostSupport) -> None:
    _agree_or_skip(support.capture, _nft_tools_work())
    assert "libnftables.so.1 loads" in support.capture.detail


def test_missing_libnftables_is_absent_on_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from egressbox.confine import capture

    monkeypatch.setattr(capture, "LIBRARY", "libegressbox-no-such-nftables.so.1")
    monkeypatch.setattr(capture, "_LOADED", [])
    found = probe_host().capture
    assert found.status is Availability.ABSENT_ON_HOST, found
    assert "install libnftables1" in found.detail


def test_probe_as_unprivileged_user() -> None:
    if os.geteuid() != 0:
        pytest.skip("already unprivileged: the other tests cover this user")

    def body() -> dict[str, Any]:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        return probe.to_json(probe_host())

    report = _run_in_child(body)
    assert report["euid"] == NOBODY
    mechanisms = report["mechanisms"]
    assert list(mechanisms) == MECHANISM_NAMES
    for name, flags in (("user_namespace", []), ("network_namespace", ["--net"])):
        expected = _unshare_tool_works(flags, user=NOBODY)
        assert (mechanisms[name]["status"] == "available") == expected, mechanisms[name]
    if mechanisms["network_namespace"]["status"] == "available":
        assert "CLONE_NEWUSER|CLONE_NEWNET" in mechanisms["network_namespace"]["detail"]
    expected = _nft_tools_work(user=NOBODY)
    assert (mechanisms["capture"]["status"] == "available") == expected, mechanisms["capture"]
    assert mechanisms["landlock"]["abi"] == landlock.abi_version()


# Failure paths, produced for real in a child under a seccomp filter


def _probe_under_seccomp(rules: dict[int | str, int]) -> dict[str, Any]:
    """Probe in a child whose syscalls are answered by ``rules`` (syscall -> seccomp action)."""
    pyseccomp = pytest.importorskip("pyseccomp")

    def body() -> dict[str, Any]:
        jail = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        for syscall, action in rules.items():
            jail.add_rule(action, syscall)
        jail.load()
        return probe.to_json(probe_host())

    mechanisms: dict[str, Any] = _run_in_child(body)["mechanisms"]
    return mechanisms


def test_refused_unshare_is_cannot_attach_with_a_hint() -> None:
    pyseccomp = pytest.importorskip("pyseccomp")
    mechanisms = _probe_under_seccomp({"unshare": pyseccomp.ERRNO(errno.EPERM)})
    for name in ("user_namespace", "network_namespace", "mount_namespace", "pid_namespace"):
        assert mechanisms[name]["status"] == "cannot_attach", mechanisms[name]
        assert "failed: EPERM; " in mechanisms[name]["detail"]
    assert mechanisms["capture"]["status"] == "cannot_attach", mechanisms["capture"]
    assert "unshare(" in mechanisms["capture"]["detail"], mechanisms["capture"]
    assert "failed: EPERM" in mechanisms["capture"]["detail"], mechanisms["capture"]
    assert "unshare(CLONE_NEWUSER) failed: EPERM" in mechanisms["user_namespace"]["detail"]


def test_unknown_namespace_flag_is_absent_on_host() -> None:
    pyseccomp = pytest.importorskip("pyseccomp")
    mechanisms = _probe_under_seccomp({"unshare": pyseccomp.ERRNO(errno.EINVAL)})
    assert mechanisms["network_namespace"]["status"] == "absent_on_host"
    assert "does not support" in mechanisms["network_namespace"]["detail"]


def test_missing_landlock_and_close_range_are_absent_on_host() -> None:
    pyseccomp = pytest.importorskip("pyseccomp")
    enosys = pyseccomp.ERRNO(errno.ENOSYS)
    mechanisms = _probe_under_seccomp({444: enosys, 436: enosys})
    assert mechanisms["landlock"]["status"] == "absent_on_host"
    assert mechanisms["landlock"]["abi"] == 0
    assert "no Landlock syscalls" in mechanisms["landlock"]["detail"]
    assert mechanisms["close_range"]["status"] == "absent_on_host"
    assert "ENOSYS" in mechanisms["close_range"]["detail"]


def test_landlock_that_cannot_restrict_is_cannot_attach() -> None:
    pyseccomp = pytest.importorskip("pyseccomp")
    if landlock.abi_version() == 0:
        pytest.skip(f"Landlock unavailable: {landlock.query_abi().reason}")
    mechanisms = _probe_under_seccomp({446: pyseccomp.ERRNO(errno.EPERM)})
    assert mechanisms["landlock"]["status"] == "cannot_attach"
    assert "landlock_restrict_self failed: EPERM" in mechanisms["landlock"]["detail"]


def test_probe_child_killed_by_a_signal_is_reported() -> None:
    pyseccomp = pytest.importorskip("pyseccomp")
    mechanisms = _probe_under_seccomp({"unshare": pyseccomp.KILL_PROCESS})
    assert mechanisms["user_namespace"]["status"] == "cannot_attach"
    assert "SIGSYS" in mechanisms["user_namespace"]["detail"]


def test_unexpected_error_becomes_cannot_attach(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> landlock.AbiInfo:
        raise RuntimeError("boom")

    monkeypatch.setattr(landlock, "query_abi", broken)
    support = probe_host()
    assert support.landlock.status is Availability.CANNOT_ATTACH
    assert "boom" in support.landlock.detail
    assert len(support.mechanisms()) == len(MECHANISM_NAMES)


def test_hung_probe_child_is_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "CHILD_TIMEOUT_S", 0.2)
    started = time.monotonic()
    outcome = probe._run_in_child(lambda: time.sleep(30))
    assert not outcome.ok
    assert "timed out" in outcome.text
    assert time.monotonic() - started < 5


# Output


def test_format_table_aligns_columns(support: HostSupport) -> None:
    lines = probe.format_table(support).splitlines()
    header = lines[0]
    assert header.split() == ["MECHANISM", "STATUS", "DETAIL"]
    status_col, detail_col = header.index("STATUS"), header.index("DETAIL")
    assert len(lines) == 1 + len(MECHANISM_NAMES)
    for line, mechanism in zip(lines[1:], support.mechanisms(), strict=True):
        assert line.startswith(mechanism.name)
        assert line[status_col:].startswith(str(mechanism.status))
        assert line[detail_col:] == mechanism.detail


def test_to_json_is_serializable_and_stable(support: HostSupport) -> None:
    report = json.loads(json.dumps(probe.to_json(support)))
    assert report["euid"] == os.geteuid()
    assert list(report["mechanisms"]) == MECHANISM_NAMES
    for name, entry in report["mechanisms"].items():
        assert set(entry) == {"status", "detail", "abi", "covers"}
        assert entry["status"] in {a.value for a in Availability}
        assert (entry["abi"] is None) == (name != "landlock")


def test_format_table_for_a_failing_host() -> None:
    missing = Mechanism("landlock", Availability.ABSENT_ON_HOST, "no Landlock", abi=0)

    def refused(name: str) -> Mechanism:
        return Mechanism(name, Availability.CANNOT_ATTACH, f"{name} refused")

    support = HostSupport(
        euid=1000,
        landlock=missing,
        seccomp=refused("seccomp"),
        no_new_privs=refused("no_new_privs"),
        user_namespace=refused("user_namespace"),
        network_namespace=refused("network_namespace"),
        mount_namespace=refused("mount_namespace"),
        pid_namespace=refused("pid_namespace"),
        close_range=refused("close_range"),
    )
    table = probe.format_table(support)
    assert "absent_on_host  no Landlock" in table
    assert "cannot_attach   seccomp refused" in table
    assert probe.to_json(support)["mechanisms"]["landlock"]["status"] == "absent_on_host"
