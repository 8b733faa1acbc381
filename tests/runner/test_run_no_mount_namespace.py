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

from unprivileged import BASE_DIR, Actor, UnavailableError, invoking_actor, unprivileged_actor

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


# -- the workspace without a mount namespace: writable, and nothing outside it ---------------

WRITES = (
    "mkdir -p made/deeper && touch made/deeper/touched && echo data > written.txt && "
    "/usr/bin/python3 -c \"open('by-python.txt', 'w').write('py')\"; "
    # Outside every grant: each must fail, and nothing may appear on the host.
    'for p in "$HOME/outside-{tag}" /etc/outside-{tag} /tmp/outside-{tag} '
    '/var/tmp/outside-{tag}; do echo x > "$p" 2>/dev/null && echo "WROTE $p"; done; true'
)


@pytest.fixture(params=["root", "unprivileged"])
def actor(request: pytest.FixtureRequest) -> Actor:
    if request.param == "root":
        if os.geteuid() != 0:
            pytest.skip("the root case needs root")
        return invoking_actor()
    try:
        return unprivileged_actor()
    except UnavailableError as exc:
        pytest.skip(str(exc))


def _run_as(
    actor: Actor, workspace: Path, home: Path, state: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """`egressbox run ARGS` as `actor` under the refusing filter, the wrapper copied where the
    actor can read it."""
    wrapper = state / WRAPPER.name
    shutil.copy(WRAPPER, wrapper)
    os.chmod(wrapper, 0o644)
    env = actor.base_env(home) | {"EGRESSBOX_STATE_DIR": str(state / "egressbox")}
    if not actor.runuser:
        env |= {k: os.environ[k] for k in ("PYTHONPATH", "EGRESSBOX_PURE") if k in os.environ}
    argv, env = actor.command([actor.python, str(wrapper), *actor.egressbox, "run", *args], env)
    return subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=workspace,
        stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("where", ["tmp", "home"])
def test_the_workspace_is_writable_and_nothing_outside_it(actor: Actor, where: str) -> None:
    """The command's own tree is written (directories, files, by a shell and by Python), on
    the host and owned by the one who ran it; the home directory around the workspace, /etc,
    the host's /tmp and /var/tmp stay unwritten."""
    top = actor.make_dir(BASE_DIR if actor.runuser else Path.home(), ".egressbox-nomnt-")
    tag = secrets.token_hex(6)
    outside = [Path(p.format(tag=tag)) for p in ("/etc/outside-{tag}", "/tmp/outside-{tag}")]
    outside += [Path(f"/var/tmp/outside-{tag}"), top / f"outside-{tag}"]
    try:
        state = actor.make_dir(top, "state-", 0o700)
        parent = top if where == "home" else Path("/tmp")
        workspace = actor.make_dir(parent, "ws-")
        try:
            done = _run_as(actor, workspace, top, state, "--report", "--", "sh", "-c",
                           WRITES.format(tag=tag))  # fmt: skip
        finally:
            found = [p for p in outside if p.exists()]
            for path in found:
                path.unlink()
        assert done.returncode == 0, done.stderr
        assert "WROTE" not in done.stdout, done.stdout
        assert found == [], f"written outside the grants: {found}"
        for name in ("made", "made/deeper", "made/deeper/touched", "written.txt"):
            assert (workspace / name).lstat().st_uid == actor.uid, name
        assert (workspace / "written.txt").read_text() == "data\n"
        assert (workspace / "by-python.txt").read_text() == "py"
        # The report says what applies: no staged layer, and why.
        assert "workspace: none (direct: no mount namespace for a staged layer" in done.stderr
        assert "warning: workspace: direct (no mount namespace for a staged layer" in done.stderr
        assert "/tmp and /var/tmp are not granted" in done.stderr
    finally:
        shutil.rmtree(top, ignore_errors=True)
        if where == "tmp":
            shutil.rmtree(workspace, ignore_errors=True)


def test_a_staged_workspace_asked_by_name_is_refused(tmp_path: Path, state: Path) -> None:
    """--workspace staged cannot be built without a mount namespace: refused (126) with the
    reason, the command never ran; the default falls back to direct (above)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_")}
    env |= {"EGRESSBOX_STATE_DIR": str(state), "EGRESSBOX_PURE": "1"}
    argv = [sys.executable, str(WRAPPER), sys.executable, "-m", "egressbox", "run"]
    done = subprocess.run(
        [*argv, "--workspace", "staged", "--", "touch", "ran"], capture_output=True, text=True,
        env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 126, done.stderr
    assert "--workspace staged needs a mount namespace" in done.stderr
    assert not (tmp_path / "ran").exists()
