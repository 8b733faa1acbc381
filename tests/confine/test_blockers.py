"""What blocks namespaces, and the fix: the pure table (confine/blockers.py), the shipped
AppArmor profile, and `egressbox doctor` in environments reproduced for real on this machine (a
container's seccomp filter, user.max_user_namespaces = 0 in a user namespace, a nested sandbox)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from egressbox.confine.blockers import (
    CAP_SYS_ADMIN,
    DEFAULT_ENTRY_POINT,
    IDENTITY_UID_MAP,
    NamespaceFacts,
    apparmor_profile,
    blocker,
)

REPO = Path(__file__).resolve().parents[2]
WRAPPER = REPO / "tests" / "no_namespaces.py"
DOCTOR_TIMEOUT = 60

HOST = NamespaceFacts(
    euid=1000,
    failed_step="",
    failed_errno=0,
    seccomp_mode=0,
    seccomp_filters=0,
    cap_eff=0,
    uid_map=IDENTITY_UID_MAP,
    max_user_namespaces=63000,
    unprivileged_userns_clone=None,
    apparmor_restrict=None,
    apparmor_loaded=False,
)
UNSHARE = "unshare(CLONE_NEWUSER|CLONE_NEWNET)"
LO_UP = "bringing lo up (SIOCSIFFLAGS)"


def _with(**changes: object) -> NamespaceFacts:
    return dataclasses.replace(HOST, **changes)  # type: ignore[arg-type]


# (facts, cause, words the fix must hold)
TABLE = [
    (_with(), None, ()),
    (
        _with(failed_step=UNSHARE, failed_errno=errno.ENOSPC, max_user_namespaces=0),
        "max_user_namespaces",
        ("sudo sysctl -w user.max_user_namespaces=", "sudo egressbox run --user"),
    ),
    (
        _with(failed_step=UNSHARE, failed_errno=errno.EPERM, unprivileged_userns_clone=0),
        "unprivileged_userns_clone",
        ("sudo sysctl -w kernel.unprivileged_userns_clone=1",),
    ),
    (
        # Ubuntu: unshare succeeds, the namespace has no capabilities, lo cannot go up.
        _with(
            failed_step=LO_UP, failed_errno=errno.EPERM, apparmor_restrict=1, apparmor_loaded=True
        ),
        "apparmor_userns",
        ("sudo install -m644 deploy/apparmor/egressbox /etc/apparmor.d/", "apparmor_parser -r"),
    ),
    (
        _with(
            failed_step=LO_UP,
            failed_errno=errno.EPERM,
            apparmor_restrict=1,
            apparmor_loaded=True,
            entry_point="/home/u/.local/bin/egressbox",
        ),
        "apparmor_userns",
        ("egressbox doctor --apparmor-profile | sudo tee /etc/apparmor.d/egressbox",),
    ),
    (
        # The sysctl file without AppArmor loaded restricts nothing.
        _with(failed_step=UNSHARE, failed_errno=errno.EPERM, apparmor_restrict=1),
        "unknown",
        ("sudo egressbox run --user",),
    ),
    (
        _with(
            failed_step=UNSHARE,
            failed_errno=errno.EPERM,
            seccomp_mode=2,
            seccomp_filters=1,
            uid_map=((0, 1000, 1),),
            cap_eff=0,
        ),
        "nested_sandbox",
        ("outside that sandbox",),
    ),
    (
        _with(failed_step=UNSHARE, failed_errno=errno.EPERM, seccomp_mode=2, seccomp_filters=1),
        "seccomp_profile",
        ("--security-opt seccomp=unconfined", "CLONE_NEWUSER"),
    ),
    (
        _with(
            failed_step=UNSHARE,
            failed_errno=errno.EPERM,
            seccomp_mode=2,
            seccomp_filters=2,
            kubernetes=True,
        ),
        "seccomp_profile",
        ("securityContext", "Unconfined"),
    ),
    (
        # Root in a container: the same filter, no `sudo` advice.
        _with(
            euid=0,
            cap_eff=0x1FF,
            failed_step="unshare(CLONE_NEWNET)",
            failed_errno=errno.EPERM,
            seccomp_mode=2,
            seccomp_filters=1,
        ),
        "seccomp_profile",
        ("--security-opt seccomp=unconfined",),
    ),
    (
        # Every namespace kind but the network one allowed: that sysctl is named, not
        # user.max_user_namespaces (root with CAP_SYS_ADMIN needs no user namespace).
        _with(
            euid=0,
            cap_eff=1 << CAP_SYS_ADMIN,
            failed_step="unshare(CLONE_NEWNET)",
            failed_errno=errno.ENOSPC,
            namespace_limits=(("net", 0), ("mnt", 15000)),
        ),
        "max_net_namespaces",
        ("sudo sysctl -w user.max_net_namespaces=",),
    ),
    (
        _with(failed_step=UNSHARE, failed_errno=errno.ENOSPC, namespace_limits=(("net", 9),)),
        "namespace_limit",
        ("user.max_user_namespaces, user.max_net_namespaces", "sudo egressbox run --user"),
    ),
    (
        # Root without CAP_SYS_ADMIN makes a user namespace first: Debian's switch applies.
        _with(
            euid=0,
            cap_eff=0x1FF,
            failed_step=UNSHARE,
            failed_errno=errno.EPERM,
            unprivileged_userns_clone=0,
        ),
        "unprivileged_userns_clone",
        ("sudo sysctl -w kernel.unprivileged_userns_clone=1",),
    ),
    (
        _with(failed_step=UNSHARE, failed_errno=errno.EACCES),
        "unknown",
        ("EACCES", "sudo egressbox run --user"),
    ),
]


@pytest.mark.parametrize(("facts", "cause", "words"), TABLE)
def test_cause_and_fix(facts: NamespaceFacts, cause: str | None, words: tuple[str, ...]) -> None:
    found = blocker(facts)
    if cause is None:
        assert found is None
        return
    assert found is not None
    assert found.cause == cause
    line = found.line()
    assert "\n" not in line
    for word in words:
        assert word in line, (word, line)
    if facts.euid == 0:
        assert "sudo egressbox run --user" not in line


def test_the_shipped_profile_is_the_generated_one() -> None:
    shipped = (REPO / "deploy" / "apparmor" / "egressbox").read_text(encoding="utf-8")
    assert shipped == apparmor_profile(DEFAULT_ENTRY_POINT)
    assert "abi <abi/4.0>," in shipped
    assert f"profile egressbox {DEFAULT_ENTRY_POINT} flags=(unconfined) {{" in shipped
    assert "  userns,\n" in shipped


@pytest.mark.skipif(shutil.which("apparmor_parser") is None, reason="apparmor_parser absent")
def test_the_profile_parses() -> None:  # pragma: no cover - only where AppArmor's tools are
    result = subprocess.run(
        ["apparmor_parser", "-Q", "-K", str(REPO / "deploy" / "apparmor" / "egressbox")],
        capture_output=True,
        text=True,
        check=False,
        timeout=DOCTOR_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr


def test_doctor_prints_a_profile_naming_the_running_entry_point() -> None:
    script = Path(sys.executable).parent / "egressbox"
    if not script.is_file():
        pytest.skip("no egressbox entry point next to this interpreter")
    out = subprocess.run(
        [str(script), "doctor", "--apparmor-profile"],
        capture_output=True,
        text=True,
        check=True,
        timeout=DOCTOR_TIMEOUT,
    ).stdout
    assert f"profile egressbox {os.path.realpath(script)} flags=(unconfined) {{" in out


# -- doctor in reproduced environments ----------------------------------------------------------


def _doctor(prefix: list[str], state: Path) -> dict[str, object]:
    env = {**os.environ, "EGRESSBOX_STATE_DIR": str(state)}
    argv = [*prefix, sys.executable, str(WRAPPER), sys.executable, "-m", "egressbox", "doctor"]
    result = subprocess.run(
        [*argv, "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=DOCTOR_TIMEOUT,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert isinstance(data, dict)
    return data


def _needs_root_userns() -> None:
    if os.geteuid() != 0:
        pytest.skip("reproducing these environments needs root (a user namespace mapped to 0)")
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip("util-linux unshare/setpriv absent")


def test_doctor_names_a_containers_seccomp_profile(tmp_path: Path) -> None:
    data = _doctor([], tmp_path)
    found = data["namespace_blocker"]
    assert isinstance(found, dict)
    assert found["cause"] == "seccomp_profile"
    assert "--security-opt seccomp=unconfined" in found["fix"]


def test_doctor_names_max_user_namespaces_zero(tmp_path: Path) -> None:
    _needs_root_userns()
    # In a user namespace of our own the limit is ours to set; setpriv then drops every
    # capability, so creating a network namespace needs a user namespace, which the limit denies.
    prefix = [
        "unshare",
        "-Ur",
        "sh",
        "-c",
        'echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --bounding-set=-all "$@"',
        "sh",
    ]
    data = _doctor(prefix, tmp_path)
    found = data["namespace_blocker"]
    assert isinstance(found, dict)
    assert found["cause"] == "max_user_namespaces"
    assert "sudo sysctl -w user.max_user_namespaces=" in found["fix"]


def test_doctor_names_a_nested_sandbox(tmp_path: Path) -> None:
    _needs_root_userns()
    data = _doctor(["unshare", "-Ur", "setpriv", "--bounding-set=-all"], tmp_path)
    found = data["namespace_blocker"]
    assert isinstance(found, dict)
    assert found["cause"] == "nested_sandbox"
    assert "uid map 0 0 1" in found["why"]
