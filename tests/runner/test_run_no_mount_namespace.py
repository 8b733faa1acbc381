"""`egressbox run` where no mount namespace can be made (a container's seccomp profile, reproduced
for real by tests/no_namespaces.py): Landlock is then the only wall on the file system, the report
says so, and of the host's /dev only the nodes every program uses can be opened. A hostile command
writes into the kernel log, /dev/shm and a disk node; judged on the host afterwards."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WRAPPER = REPO / "tests" / "no_namespaces.py"
RUN_TIMEOUT = 120.0


@pytest.fixture
def state() -> Iterator[Path]:
    # Without a mount namespace /tmp and /var/tmp are the host's and writable for the command:
    # egressbox refuses a state directory there, so it lives under the home directory.
    made = Path(tempfile.mkdtemp(prefix=".egressbox-test-state-", dir=Path.home()))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def _run(workspace: Path, state: Path, script: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}
    env["EGRESSBOX_STATE_DIR"] = str(state)
    for name in ("EGRESSBOX_PURE",):
        if name in os.environ:
            env[name] = os.environ[name]
    argv = [sys.executable, str(WRAPPER), sys.executable, "-m", "egressbox", "run", "--report"]
    return subprocess.run(
        [*argv, "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=workspace,
        stdin=subprocess.DEVNULL,
        timeout=RUN_TIMEOUT,
        check=False,
    )


def _kernel_log() -> str:
    return subprocess.run(
        ["dmesg"], capture_output=True, text=True, check=False, timeout=RUN_TIMEOUT
    ).stdout


def test_landlock_is_the_only_wall_and_host_devices_stay_shut(tmp_path: Path, state: Path) -> None:
    if shutil.which("dmesg") is None or not os.access("/dev/kmsg", os.W_OK):
        pytest.skip("needs root's /dev/kmsg and dmesg to judge a write into the kernel log")
    marker = f"egressbox-test-{secrets.token_hex(6)}"
    shm = Path("/dev/shm") / marker
    disk = next((p for p in ("/dev/loop0", "/dev/sda", "/dev/vda") if os.path.exists(p)), "")
    # Landlock alone grants the workspace's entries, not its top directory (the names the host
    # trusts there must stay uncreatable): the command writes into a directory of it.
    out = tmp_path / "out"
    out.mkdir()
    script = (
        "echo ok > /dev/null && head -c 8 /dev/urandom | wc -c > out/granted.txt; "
        f"echo {marker} > /dev/kmsg; echo x > {shm}; "
        f"{'head -c 1 ' + disk + ' > out/disk.txt;' if disk else ''} true"
    )
    try:
        result = _run(tmp_path, state, script)
    finally:
        leaked = shm.exists()
        shm.unlink(missing_ok=True)
    assert result.returncode == 0, result.stderr
    # The command ran and used the granted nodes...
    assert (out / "granted.txt").read_text().strip() == "8"
    # ...and reached no other device: nothing in the kernel log, no file in the host's /dev/shm,
    # no byte of the disk.
    assert marker not in _kernel_log()
    assert not leaked
    if disk:
        assert (out / "disk.txt").read_bytes() == b""
    report = result.stderr
    assert "mount_namespace: none" in report
    assert "filesystem: partial (Landlock is the only wall" in report
    assert "/dev/null, /dev/zero, /dev/full, /dev/random, /dev/urandom, /dev/tty" in report
    # The one line that says what blocks namespaces and what would lift them.
    assert "no namespaces here: a seccomp filter refuses unshare" in report
    assert "--security-opt seccomp=unconfined" in report
