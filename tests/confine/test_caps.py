"""drop_all_capabilities in forked children: the sets end empty and privilege stays gone.

Dropping is irreversible, so it only ever happens in a forked child that reports through a pipe;
the pytest process keeps its capabilities.
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from egressbox.confine import caps, syscalls
from egressbox.confine.caps import CapSets
from forking import attempt, fork_call

NOBODY = 65534
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")

STATUS = """Name:\tcat
CapInh:\t0000000000000000
CapPrm:\t000001ffffffffff
CapEff:\t000001fffeffffff
CapBnd:\t000001ffffffffff
CapAmb:\t0000000000000004
NoNewPrivs:\t0
"""


def exec_status() -> dict[str, int]:
    """The capability sets of a freshly exec'd program (an execve is where root regains them)."""
    output = subprocess.run(
        ["cat", "/proc/self/status"], check=True, capture_output=True, text=True
    ).stdout
    sets = caps.parse_capability_sets(output)
    return {"effective": sets.effective, "permitted": sets.permitted, "bounding": sets.bounding}


def private_mount_namespace() -> None:
    syscalls.unshare(syscalls.CLONE_NEWNS)
    syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)


def user_namespace_as_root() -> None:
    """Become an unprivileged user (when root), then uid 0 of a new user and mount namespace."""
    uid, gid = (NOBODY, NOBODY) if os.geteuid() == 0 else (os.getuid(), os.getgid())
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 1)  # else /proc/self/uid_map stays root's
    syscalls.unshare(syscalls.CLONE_NEWUSER | syscalls.CLONE_NEWNS)
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"0 {uid} 1")
    Path("/proc/self/gid_map").write_text(f"0 {gid} 1")
    syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)


# -- pure parts --------------------------------------------------------------------------------


def test_parse_capability_sets() -> None:
    assert caps.parse_capability_sets(STATUS) == CapSets(
        inheritable=0,
        permitted=0x1FFFFFFFFFF,
        effective=0x1FFFEFFFFFF,
        bounding=0x1FFFFFFFFFF,
        ambient=4,
    )
    assert not caps.parse_capability_sets(STATUS).all_clear


def test_parse_tolerates_only_a_missing_ambient_line() -> None:
    old_kernel = STATUS.replace("CapAmb:\t0000000000000004\n", "")
    assert caps.parse_capability_sets(old_kernel).ambient == 0
    with pytest.raises(ValueError, match="CapEff"):
        caps.parse_capability_sets(STATUS.replace("CapEff", "Other"))


def test_last_cap_agrees_with_the_kernel() -> None:
    # PR_CAPBSET_READ only reads: safe in the test process.
    assert caps.read_last_cap() == caps._probe_last_cap()
    assert caps.read_last_cap() >= 37  # CAP_AUDIT_READ, Linux 3.16


def test_prctl_raises_with_errno() -> None:
    with pytest.raises(OSError) as info:
        syscalls.prctl(syscalls.PR_CAPBSET_READ, 1000)  # no such capability
    assert info.value.errno == errno.EINVAL


def test_capget_reads_this_process() -> None:
    effective, permitted, _ = syscalls.capget()
    sets = caps.read_capability_sets()
    assert (effective, permitted) == (sets.effective, sets.permitted)


# -- a root child ------------------------------------------------------------------------------


@requires_root
def test_drop_clears_every_set_and_locks_securebits() -> None:
    def body() -> dict[str, Any]:
        report = caps.drop_all_capabilities()
        return {
            "report_clear": report.sets.all_clear,
            "status": caps.read_capability_sets().__dict__,
            "securebits": syscalls.prctl(syscalls.PR_GET_SECUREBITS),
            "uid": os.getuid(),
        }

    result = fork_call(body)
    assert result["report_clear"] is True
    assert set(result["status"].values()) == {0}
    assert result["securebits"] & caps.LOCKED_SECUREBITS == caps.LOCKED_SECUREBITS
    assert not result["securebits"] & caps.SECBIT_KEEP_CAPS
    assert result["uid"] == 0


@requires_root
@pytest.mark.parametrize("drop", [False, True], ids=["with_caps", "dropped"])
def test_privileged_operations(drop: bool, tmp_path: Path) -> None:
    victim = tmp_path / "file"
    victim.write_text("x")
    target = tmp_path / "mnt"
    target.mkdir()

    def body() -> dict[str, Any]:
        private_mount_namespace()  # so a mount that works stays in the child
        if drop:
            caps.drop_all_capabilities()
        return {
            "chown": attempt(lambda: os.chown(victim, NOBODY, NOBODY)),
            "mount": attempt(lambda: syscalls.mount("tmpfs", str(target), "tmpfs", 0)),
            "setuid0": attempt(lambda: os.setuid(0)),  # already uid 0: allowed either way
            "exec": exec_status(),
        }

    result = fork_call(body)
    if drop:
        assert result["chown"] == result["mount"] == "EPERM"
        assert result["exec"] == {"effective": 0, "permitted": 0, "bounding": 0}
    else:
        assert result["chown"] == result["mount"] == "ok"
        assert result["exec"]["effective"] != 0
    assert result["setuid0"] == "ok"


# -- uid 0 inside a user namespace -------------------------------------------------------------


def test_drop_inside_a_user_namespace() -> None:
    # Not tmp_path: its parents are closed to the unprivileged child.
    target = tempfile.mkdtemp(prefix="egressbox-caps-")
    os.chmod(target, 0o755)

    def mount_tmpfs() -> None:
        syscalls.mount("tmpfs", target, "tmpfs", 0)

    def body() -> dict[str, Any]:
        try:
            user_namespace_as_root()
        except OSError as exc:
            return {"unavailable": str(exc)}
        before = attempt(mount_tmpfs)
        report = caps.drop_all_capabilities()
        return {
            "uid": os.getuid(),
            "before": before,
            "after": attempt(mount_tmpfs),
            "clear": report.sets.all_clear,
            "exec": exec_status(),
        }

    try:
        result = fork_call(body)
    finally:
        os.rmdir(target)
    if "unavailable" in result:
        pytest.skip(f"user namespaces unavailable: {result['unavailable']}")
    assert result == {
        "uid": 0,
        "before": "ok",
        "after": "EPERM",
        "clear": True,
        "exec": {"effective": 0, "permitted": 0, "bounding": 0},
    }


def test_sys_admin_is_read_from_the_effective_set_not_the_uid() -> None:
    """Root without CAP_SYS_ADMIN (Docker's default capabilities) does not hold it: the probe
    and the launcher then make a user namespace first, as for an unprivileged user."""
    if os.geteuid() != 0 or not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("needs root and setpriv to drop CAP_SYS_ADMIN for real")
    import sys

    code = (
        "from egressbox.confine import caps; import os; print(os.geteuid(), caps.holds_sys_admin())"
    )
    drop = ["setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin", "--"]
    for prefix, expected in (([], "0 True"), (drop, "0 False")):
        done = subprocess.run(
            [*prefix, sys.executable, "-c", code], capture_output=True, text=True, check=True,
            timeout=60,
        )  # fmt: skip
        assert done.stdout.strip() == expected, (prefix, done.stdout, done.stderr)
