"""apply_mounts in real namespaces, as root and as an unprivileged user in a user namespace.

Every test that mounts does it in a forked child that unshares its own namespaces (and forks
again to be pid 1 of the new PID namespace, as the launcher does), reporting through a pipe; the
pytest process never changes its own namespaces, mounts or credentials.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from egressbox.confine import caps, mounts, syscalls
from egressbox.confine.mounts import MountReport, MountSpec, apply_mounts
from forking import attempt, fork_call

Body = Callable[[], dict[str, Any]]

NOBODY = 65534
# The test's workspaces live in the temp directory, which is hidden like /tmp.
HIDE = (*mounts.DEFAULT_HIDE, tempfile.gettempdir())
MINIMAL_DEV = {
    *mounts.DEV_NODES,
    *(name for name, _ in mounts.DEV_SYMLINKS),
    "ptmx",
    "pts",
    "shm",
}
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


# -- children ----------------------------------------------------------------------------------


def child_ids(user: bool) -> tuple[int, int]:
    """(uid, gid) a child runs as: nobody when root drops to a user namespace, else our own."""
    if user and os.geteuid() == 0:
        return NOBODY, NOBODY
    return os.getuid(), os.getgid()


def enter_user_namespace(flags: int, inside_uid: int | None = None) -> None:
    """Become the unprivileged user (when root), then unshare a user namespace plus ``flags``.

    The ids are mapped onto themselves (``U U 1``), or the uid onto ``inside_uid``.
    """
    uid, gid = child_ids(True)
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        # Changing uid made us non-dumpable, which leaves /proc/self/*_map owned by root.
        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 1)
    syscalls.unshare(syscalls.CLONE_NEWUSER | flags)
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid if inside_uid is None else inside_uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def run_confined(body: Body, *, user: bool) -> dict[str, Any]:
    """Run ``body`` as pid 1 of new mount, PID and network namespaces (plus a user namespace)."""

    def launcher() -> dict[str, Any]:
        flags = syscalls.CLONE_NEWNS | syscalls.CLONE_NEWPID | syscalls.CLONE_NEWNET
        if user:
            enter_user_namespace(flags)
        else:
            syscalls.unshare(flags)
        return fork_call(body)

    return fork_call(launcher)


def write(path: str | Path, text: str = "x", mode: str = "w") -> None:
    with open(path, mode, encoding="utf-8") as handle:
        handle.write(text)


def report_dict(report: MountReport) -> dict[str, Any]:
    return {"steps": list(report.steps), "skipped": [list(s) for s in report.skipped]}


def _probe_user_namespace() -> str:
    def body() -> dict[str, Any]:
        try:
            enter_user_namespace(syscalls.CLONE_NEWNS | syscalls.CLONE_NEWPID)
        except OSError as exc:
            return {"error": str(exc)}
        return {"error": ""}

    return str(fork_call(body)["error"])


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(params=["root", "userns"])
def user(request: pytest.FixtureRequest) -> bool:
    """False: the child is root. True: an unprivileged user in a user namespace."""
    if request.param == "root":
        if os.geteuid() != 0:
            pytest.skip("needs root")
        return False
    problem = _probe_user_namespace()
    if problem:
        pytest.skip(f"user namespaces unavailable: {problem}")
    return True


@pytest.fixture
def workdir(user: bool) -> Iterator[Path]:
    """A directory in the (hidden) temp directory, owned by the uid the child runs as.

    Not tmp_path: its parents are mode 0700, closed to the unprivileged child.
    """
    path = Path(tempfile.mkdtemp(prefix="egressbox-mounts-"))
    path.chmod(0o755)
    os.chown(path, *child_ids(user))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def make_dirs(user: bool, *paths: Path) -> None:
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, *child_ids(user))


# -- safety and plumbing -----------------------------------------------------------------------


@requires_root
def test_refuses_to_run_in_the_hosts_mount_namespace() -> None:
    spec = MountSpec(hide=(), protect_kernel=False, minimal_dev=False, new_proc=False)

    def body() -> dict[str, Any]:
        before = mounts.is_new_mount_namespace()
        # Only asked while the guard says "not new": apply_mounts then refuses before mounting.
        refused = attempt(lambda: apply_mounts(spec)) if not before else "not checked"
        syscalls.unshare(syscalls.CLONE_NEWNS)
        return {"before": before, "refused": refused, "after": mounts.is_new_mount_namespace()}

    assert fork_call(body) == {"before": False, "refused": "EPERM", "after": True}


def test_relative_paths_are_rejected() -> None:
    def body() -> dict[str, Any]:
        if os.geteuid() == 0:
            syscalls.unshare(syscalls.CLONE_NEWNS)  # in case the check ever came too late
        try:
            apply_mounts(MountSpec(hide=("tmp",)))
        except ValueError as exc:
            return {"error": str(exc)}
        return {"error": ""}

    assert "'tmp'" in fork_call(body)["error"]


def test_syscall_errors_carry_errno(tmp_path: Path) -> None:
    def body() -> dict[str, Any]:
        if os.geteuid() == 0:
            syscalls.unshare(syscalls.CLONE_NEWNS)
        else:
            enter_user_namespace(syscalls.CLONE_NEWNS)
        missing = str(tmp_path / "missing")
        return {
            "mount": attempt(lambda: syscalls.mount("none", missing, "tmpfs", 0)),
            "umount": attempt(lambda: syscalls.umount2(str(tmp_path))),
        }

    assert fork_call(body) == {"mount": "ENOENT", "umount": "EINVAL"}


@requires_root
def test_mounts_do_not_propagate_to_the_parent(tmp_path: Path) -> None:
    """A stand-in "host" namespace shares a mount with the child, so propagation is real."""
    shared = str(tmp_path)
    # A mount that did propagate stays in the stand-in's namespace: one target per run.
    without, with_ = tmp_path / "without", tmp_path / "with"
    without.mkdir()
    with_.mkdir()

    def host() -> dict[str, Any]:
        syscalls.unshare(syscalls.CLONE_NEWNS)
        syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)
        syscalls.mount(shared, shared, None, syscalls.MS_BIND)
        syscalls.mount(None, shared, None, syscalls.MS_SHARED)
        return {
            "without": _seen_by_parent(str(without), apply=False),
            "with": _seen_by_parent(str(with_), apply=True),
        }

    assert fork_call(host) == {"without": True, "with": False}


def _seen_by_parent(target: str, *, apply: bool) -> bool:
    """Whether a tmpfs a child mounts on ``target`` (in its own mount ns) shows up here."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            syscalls.unshare(syscalls.CLONE_NEWNS)
            if apply:
                apply_mounts(
                    MountSpec(hide=(), protect_kernel=False, minimal_dev=False, new_proc=False)
                )
            syscalls.mount("tmpfs", target, "tmpfs", 0)
            os.write(ready_w, b"1")
            os.read(done_r, 1)  # keep the mount alive while the parent looks
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
        with open("/proc/self/mountinfo", encoding="utf-8") as handle:
            seen = any(line.split()[4] == target for line in handle)
    finally:
        os.write(done_w, b"1")
        os.waitpid(pid, 0)
        for fd in (ready_r, done_r, done_w):
            os.close(fd)
    return seen


# -- hiding and binding back -------------------------------------------------------------------


def test_hidden_temp_dir_cuts_off_host_unix_sockets(user: bool, workdir: Path) -> None:
    path = str(workdir / "host.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen()

        def body() -> dict[str, Any]:
            unconfined = attempt(lambda: _connect(path))
            os.chdir(workdir)  # not granted: must not stay reachable through the cwd
            report = apply_mounts(MountSpec(hide=HIDE))
            return {
                "unconfined": unconfined,
                "by_path": attempt(lambda: _connect(path)),
                "by_cwd": attempt(lambda: _connect("host.sock")),
                "cwd": os.getcwd(),
                **report_dict(report),
            }

        result = run_confined(body, user=user)
    assert result["unconfined"] == "ok"
    assert result["by_path"] in {"ENOENT", "ECONNREFUSED"}
    assert result["by_cwd"] in {"ENOENT", "ECONNREFUSED"}
    assert result["cwd"] == "/"
    assert any(what.startswith("working directory") for what, _ in result["skipped"])


def _connect(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(5)
        client.connect(path)


def test_workspace_under_temp_is_bound_back_writable(user: bool, workdir: Path) -> None:
    workspace = workdir / "work"
    make_dirs(user, workspace)
    write(workdir / "sibling.txt", "not granted")

    def body() -> dict[str, Any]:
        os.chdir(workspace)
        report = apply_mounts(MountSpec(hide=HIDE, bind_back=((str(workspace), True),)))
        write(workspace / "out.txt", "from inside")
        write("relative.txt", "via the cwd")
        return {
            "cwd": os.getcwd(),
            "sibling": os.path.exists(workdir / "sibling.txt"),
            "temp_entries": os.listdir(workdir),
            **report_dict(report),
        }

    result = run_confined(body, user=user)
    assert result["cwd"] == str(workspace)
    assert result["sibling"] is False
    assert result["temp_entries"] == ["work"]
    assert f"bind back {workspace} (rw)" in result["steps"]
    assert (workspace / "out.txt").read_text() == "from inside"
    assert (workspace / "relative.txt").read_text() == "via the cwd"


def test_read_only_paths_inside_a_writable_root(user: bool, workdir: Path) -> None:
    workspace, nested, tools = workdir / "work", workdir / "work" / "read only", workdir / "tools"
    make_dirs(user, workspace, nested, tools)
    audit = workspace / "audit.log"
    write(audit, "entry\n")
    os.chown(audit, *child_ids(user))
    spec = MountSpec(
        hide=HIDE,
        bind_back=((str(workspace), True), (str(tools), False)),
        read_only=(str(nested), str(audit)),
    )

    def body() -> dict[str, Any]:
        apply_mounts(spec)
        return {
            "parent": attempt(lambda: write(workspace / "ok.txt")),
            "nested": attempt(lambda: write(nested / "x")),
            "audit": attempt(lambda: write(audit, "forged\n", "a")),
            "tools": attempt(lambda: write(tools / "x")),
            "nested_readable": os.listdir(nested) == [],
        }

    assert run_confined(body, user=user) == {
        "parent": "ok",
        "nested": "EROFS",
        "audit": "EROFS",
        "tools": "EROFS",
        "nested_readable": True,
    }
    assert audit.read_text() == "entry\n"


def test_bind_back_of_a_missing_path_refuses(user: bool, workdir: Path) -> None:
    missing = workdir / "gone"

    def body() -> dict[str, Any]:
        try:
            apply_mounts(MountSpec(hide=HIDE, bind_back=((str(missing), True),)))
        except OSError as exc:
            return {"errno": exc.errno, "message": str(exc)}
        return {"errno": 0, "message": ""}

    result = run_confined(body, user=user)
    assert result["errno"] == errno.ENOENT
    assert str(missing) in result["message"]


# -- masks -------------------------------------------------------------------------------------


def test_masked_credentials_are_unreadable(user: bool, workdir: Path) -> None:
    home = workdir / "home"
    make_dirs(user, home / ".ssh", home / ".aws")
    key, aws = home / ".ssh" / "id_rsa", home / ".aws" / "credentials"
    write(key, "PRIVATE KEY")
    write(aws, "aws_secret_access_key = x")
    spec = MountSpec(
        hide=HIDE,
        bind_back=((str(home), True),),
        mask=(str(key), str(home / ".aws"), str(home / ".netrc")),
    )

    def body() -> dict[str, Any]:
        outside = [Path(key).read_text(), Path(aws).read_text()]
        report = apply_mounts(spec)
        caps.drop_all_capabilities()  # as the launcher does: uid 0 keeps no DAC override
        return {
            "outside": outside,
            "key": _read_or_errno(key),
            "aws_file": _read_or_errno(aws),
            "aws_dir": attempt(lambda: os.listdir(home / ".aws")),
            "aws_write": attempt(lambda: write(home / ".aws" / "new")),
            **report_dict(report),
        }

    result = run_confined(body, user=user)
    assert result["outside"] == ["PRIVATE KEY", "aws_secret_access_key = x"]
    assert result["key"] in {"EACCES", ""}
    assert result["aws_file"] in {"EACCES", "ENOENT"}
    assert result["aws_dir"] == "EACCES"
    assert result["aws_write"] in {"EACCES", "EROFS"}
    assert [str(home / ".netrc"), "missing"] in [
        [what.removeprefix("mask "), why] for what, why in result["skipped"]
    ]
    assert key.read_text() == "PRIVATE KEY"  # the host file is untouched


def _read_or_errno(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        return errno.errorcode[exc.errno or 0]


# -- /proc, /sys, /dev -------------------------------------------------------------------------


def test_kernel_interfaces_are_read_only(user: bool) -> None:
    def body() -> dict[str, Any]:
        report = apply_mounts(MountSpec(hide=HIDE))
        with open("/proc/self/mountinfo", encoding="utf-8") as handle:
            points = [line.split()[4] for line in handle]
        kernel = [p for p in points if p in {"/proc/sys", "/sys"} or p.startswith("/sys/")]
        writable = [p for p in kernel if not os.statvfs(p).f_flag & os.ST_RDONLY]
        return {"kernel": kernel, "writable": writable, **report_dict(report)}

    result = run_confined(body, user=user)
    assert {"/proc/sys", "/sys"} <= set(result["kernel"])
    assert result["writable"] == []


@requires_root
def test_root_without_capabilities_still_needs_read_only_proc_sys() -> None:
    """The measured fact behind protect_kernel, then the fix. Nothing is ever written."""
    core_pattern = "/proc/sys/kernel/core_pattern"

    def open_for_writing() -> None:
        os.close(os.open(core_pattern, os.O_WRONLY))  # closed at once, without a write

    def unconfined() -> dict[str, Any]:
        caps.drop_all_capabilities()
        return {"open": attempt(open_for_writing)}

    def confined() -> dict[str, Any]:
        apply_mounts(MountSpec(hide=HIDE))
        caps.drop_all_capabilities()
        return {"open": attempt(open_for_writing)}

    assert fork_call(unconfined) == {"open": "ok"}
    assert run_confined(confined, user=False) == {"open": "EROFS"}


def test_minimal_dev(user: bool) -> None:
    block_devices = [
        entry.name
        for entry in os.scandir("/dev")
        if stat.S_ISBLK(entry.stat(follow_symlinks=False).st_mode)
    ]

    def body() -> dict[str, Any]:
        report = apply_mounts(MountSpec(hide=HIDE))
        with open("/dev/urandom", "rb") as urandom:
            random_bytes = len(urandom.read(16))
        primary, replica = os.openpty()
        pty = os.ttyname(replica)
        os.close(primary)
        os.close(replica)
        return {
            "entries": sorted(os.listdir("/dev")),
            "null": attempt(lambda: write("/dev/null")),
            "urandom": random_bytes,
            "pty": pty,
            "block": [name for name in block_devices if os.path.lexists(f"/dev/{name}")],
            "create": attempt(lambda: write("/dev/new")),
            "shm": attempt(lambda: write("/dev/shm/segment")),
            "fd": os.path.isdir("/dev/fd"),
            **report_dict(report),
        }

    result = run_confined(body, user=user)
    assert set(result["entries"]) == MINIMAL_DEV
    assert result["null"] == "ok"
    assert result["urandom"] == 16
    assert result["pty"].startswith("/dev/pts/")
    assert result["block"] == []
    assert result["create"] == "EROFS"
    assert result["shm"] == "ok"
    assert result["fd"] is True
    assert "minimal /dev" in result["steps"]


def test_bound_back_dev_shm_grant_survives_the_new_dev(user: bool) -> None:
    """A grant under /dev/shm is bound back into the hidden tmpfs, which /dev carries over."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    grant = Path(tempfile.mkdtemp(prefix="egressbox-shm-", dir="/dev/shm"))
    os.chown(grant, *child_ids(user))
    try:

        def body() -> dict[str, Any]:
            apply_mounts(MountSpec(hide=HIDE, bind_back=((str(grant), True),)))
            return {"write": attempt(lambda: write(grant / "seg")), "shm": os.listdir("/dev/shm")}

        result = run_confined(body, user=user)
        assert result == {"write": "ok", "shm": [grant.name]}
        assert (grant / "seg").exists()
    finally:
        shutil.rmtree(grant, ignore_errors=True)


def test_new_proc_shows_only_the_new_pid_namespace(user: bool) -> None:
    test_pid = os.getpid()

    def body() -> dict[str, Any]:
        report = apply_mounts(MountSpec(hide=HIDE))
        return {
            "pid": os.getpid(),
            "self": os.readlink("/proc/self"),
            "pids": sorted(name for name in os.listdir("/proc") if name.isdigit()),
            "test_pid_visible": os.path.exists(f"/proc/{test_pid}"),
            **report_dict(report),
        }

    result = run_confined(body, user=user)
    assert result["pid"] == 1
    assert result["self"] == "1"
    assert result["pids"] == ["1"]
    assert result["test_pid_visible"] is False
    assert "fresh proc on /proc" in result["steps"]


def test_new_proc_is_skipped_outside_the_new_pid_namespace() -> None:
    """Mounting proc before the fork would show the old namespace: reported, not done."""

    def body() -> dict[str, Any]:
        flags = syscalls.CLONE_NEWNS | syscalls.CLONE_NEWPID
        if os.geteuid() == 0:
            syscalls.unshare(flags)
        else:
            enter_user_namespace(flags)
        spec = MountSpec(hide=(), protect_kernel=False, minimal_dev=False)
        return report_dict(apply_mounts(spec))

    result = fork_call(body)
    assert [what for what, _ in result["skipped"]] == ["proc /proc"]


@requires_root
def test_read_only_grant_keeps_flags_locked_by_the_parent_namespace() -> None:
    """A remount in a user namespace must repeat nosuid/nodev/noexec the host set, or EPERM."""
    problem = _probe_user_namespace()
    if problem:
        pytest.skip(f"user namespaces unavailable: {problem}")
    base = Path(tempfile.mkdtemp(prefix="egressbox-locked-"))
    base.chmod(0o755)
    grant = base / "locked" / "tools"
    safe = syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_NOEXEC

    def body() -> dict[str, Any]:
        apply_mounts(MountSpec(hide=HIDE, bind_back=((str(grant), False),)))
        bare = syscalls.MS_REMOUNT | syscalls.MS_BIND | syscalls.MS_RDONLY
        return {
            "write": attempt(lambda: write(grant / "x")),
            "flags": os.statvfs(grant).f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC),
            "bare_remount": attempt(lambda: syscalls.mount(None, str(grant), None, bare)),
        }

    def host() -> dict[str, Any]:
        # A stand-in host namespace with a nosuid,nodev,noexec mount holding the grant.
        syscalls.unshare(syscalls.CLONE_NEWNS)
        syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)
        syscalls.mount("tmpfs", str(base / "locked"), "tmpfs", safe, "mode=755")
        grant.mkdir()
        os.chown(grant, NOBODY, NOBODY)
        return run_confined(body, user=True)

    (base / "locked").mkdir()
    try:
        result = fork_call(host)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert result == {
        "write": "EROFS",
        "flags": os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC,
        "bare_remount": "EPERM",
    }
