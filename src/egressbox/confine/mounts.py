"""Mount-namespace confinement: hide socket directories, re-expose grants, protect the kernel.

Runs in the single-threaded launcher after it has unshared a mount namespace (plus a user
namespace when not root, plus PID and network namespaces). Every step changes only this
process's copy of the mount table, and the first step makes all of it private so that nothing
propagates back to the host (on systemd hosts mounts are shared by default).

Order of the steps and why:

1. ``/`` recursively private.
2. ``O_PATH`` descriptors to every path that must reappear later (granted roots under a hidden
   directory, the host's device nodes), opened while they are still reachable by name.
3. An empty tmpfs over each hidden directory (host pathname sockets live there).
4. Granted paths bound back from those descriptors, read-only when not writable.
5. Read-only self-binds (a read-only root nested in a writable one).
6. Masks over credential paths.
7. A fresh ``/proc`` (before 8, which would otherwise protect the old proc that 7 covers).
8. ``/proc/sys``, ``/proc/sysrq-trigger``, ``/proc/irq``, ``/proc/bus`` and ``/sys`` read-only:
   uid 0 without capabilities can still write ``/proc/sys/kernel/core_pattern``.
9. A minimal ``/dev``.
10. The working directory is entered again by name: the kernel keeps it pinned to the old mount,
    where relative paths would still reach hidden files and ignore read-only binds.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from egressbox.confine import syscalls
from egressbox.confine.syscalls import (
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_REMOUNT,
)

DEFAULT_HIDE = ("/tmp", "/var/tmp", "/run", "/dev/shm")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_SYMLINKS = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
)
KERNEL_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/sys")

# Mounted over for a moment while the empty file used by file masks is created; any directory
# that is sure to exist will do, as long as no masked file lives under it.
_STAGING_DIRS = ("/dev", "/proc", "/sys")
# Flags the kernel locks on mounts inherited from a more privileged user namespace: a remount
# that leaves one out fails with EPERM, so every remount repeats the ones already set.
_LOCKABLE_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
)
_O_PATH = os.O_PATH | os.O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_SAFE = MS_NOSUID | MS_NODEV | MS_NOEXEC
# A private devpts instance whose ptmx anyone may open (the host's may be mode 000).
_PTS_OPTIONS = "newinstance,ptmxmode=0666,mode=0620"


@dataclass(frozen=True)
class MountSpec:
    """What the child's mount namespace should look like. Every path must be absolute."""

    # Covered by an empty private tmpfs: host pathname unix sockets (a docker socket, a session
    # bus) live here.
    hide: tuple[str, ...] = DEFAULT_HIDE
    # (path, writable): granted roots, the executable, interpreter, venv, cwd. Only paths under a
    # hidden directory need it; others are left alone.
    bind_back: tuple[tuple[str, bool], ...] = ()
    # Bound read-only onto themselves after bind_back (a read-only root inside a writable root).
    read_only: tuple[str, ...] = ()
    # Credential paths made unreadable: directories by an empty read-only tmpfs (mode 000), other
    # files by a read-only bind of an empty mode-000 file. Missing paths are skipped.
    mask: tuple[str, ...] = ()
    # /proc/sys, /proc/sysrq-trigger, /proc/irq, /proc/bus and /sys read-only.
    protect_kernel: bool = True
    # A tmpfs /dev with null, zero, full, random, urandom, tty, ptmx, pts, shm, fd, std*.
    minimal_dev: bool = True
    # A fresh proc on /proc; this process must be inside the new PID namespace (its pid 1).
    new_proc: bool = True


@dataclass(frozen=True)
class MountReport:
    """What apply_mounts did, and each step it could not do with the reason."""

    steps: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]


class _Log:
    def __init__(self) -> None:
        self.steps: list[str] = []
        self.skipped: list[tuple[str, str]] = []

    def did(self, what: str) -> None:
        self.steps.append(what)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append((what, why))

    def report(self) -> MountReport:
        return MountReport(tuple(self.steps), tuple(self.skipped))


@dataclass(frozen=True)
class _Hidden:
    path: str
    mode: int  # the host directory's permission bits, given to the tmpfs root


@dataclass(frozen=True)
class _Source:
    path: str
    writable: bool
    fd: int  # O_PATH, opened before hiding
    is_dir: bool
    parents: tuple[tuple[str, int], ...]  # directories between the hidden root and path, modes


def apply_mounts(spec: MountSpec) -> MountReport:
    """Shape this process's (already unshared) mount namespace as ``spec`` says.

    Raises OSError naming the path when an essential step fails (making ``/`` private, hiding a
    directory, binding a grant back, a read-only bind), so the caller can refuse to run the
    command rather than run it less confined than reported. ValueError for a relative path.
    """
    _check_absolute(spec)
    if not is_new_mount_namespace():
        raise OSError(errno.EPERM, "apply_mounts needs its own mount namespace: unshare first")
    try:
        syscalls.mount(None, "/", None, MS_REC | MS_PRIVATE)
    except OSError as exc:
        raise _fail("make private", "/", exc) from exc
    log = _Log()
    log.did("/ private (recursive)")
    hidden = _plan_hidden(spec.hide, log)
    fds: list[int] = []
    try:
        sources = _open_sources(spec.bind_back, hidden, fds)
        devices = _open_devices(fds) if spec.minimal_dev else {}
        for entry in hidden:
            _hide(entry, log)
        _bind_back_all(sources, log)
        for path in spec.read_only:
            _bind_read_only(path, log)
        _mask_all(spec.mask, log)
        if spec.new_proc:
            _mount_new_proc(log)
        if spec.protect_kernel:
            _protect_kernel(log)
        if spec.minimal_dev:
            _build_dev(devices, any(h.path == "/dev/shm" for h in hidden), log)
    finally:
        for fd in fds:
            os.close(fd)
    _reenter_cwd(log)
    return log.report()


def is_new_mount_namespace() -> bool:
    """False when this process visibly shares the mount namespace of whoever started it.

    A safety net against changing the host's mounts when the caller forgot to unshare. The
    launcher's pid 1 shares its namespace with the launcher, so pid 1 is compared with the
    launcher's parent. When a process cannot be read (another user's), the answer is True: an
    unprivileged caller cannot change a namespace it did not create anyway.
    """
    try:
        ours = os.readlink("/proc/self/ns/mnt")
        parent = _parent_pid("self")
        if os.getpid() == 1 and parent and os.readlink(f"/proc/{parent}/ns/mnt") == ours:
            parent = _parent_pid(str(parent))
        return parent == 0 or os.readlink(f"/proc/{parent}/ns/mnt") != ours
    except OSError:
        return True


def _parent_pid(pid: str) -> int:
    """The parent's pid as the mounted /proc numbers it (getppid() says 0 to a pid 1)."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        fields = handle.read().rsplit(b")", 1)[1].split()  # the name may hold ")" and spaces
    return int(fields[1])


# -- paths -------------------------------------------------------------------------------------


def _check_absolute(spec: MountSpec) -> None:
    paths = (*spec.hide, *(p for p, _ in spec.bind_back), *spec.read_only, *spec.mask)
    relative = [p for p in paths if not os.path.isabs(p)]
    if relative:
        raise ValueError(f"mount paths must be absolute: {relative}")


def _resolve(path: str) -> str:
    return os.path.realpath(path)


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _depth(path: str) -> int:
    return path.rstrip("/").count("/")


def _fail(what: str, path: str, exc: OSError) -> OSError:
    return OSError(exc.errno, f"{what} {path}: {exc.strerror}", path)


def _mount_points_under(path: str) -> list[str]:
    """Mount points at or below ``path``, shallowest first, from /proc/self/mountinfo."""
    with open("/proc/self/mountinfo", "rb") as handle:
        lines = handle.read().splitlines()
    points = {_unescape(os.fsdecode(line.split()[4])) for line in lines}
    return sorted((p for p in points if _is_under(p, path)), key=_depth)


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash as \ooo (backslash itself as \134).
    head, *rest = field.split("\\")
    return head + "".join(chr(int(piece[:3], 8)) + piece[3:] for piece in rest)


def _locked_flags(path: str) -> int:
    f_flag = os.statvfs(path).f_flag
    return sum(ms for st, ms in _LOCKABLE_FLAGS if f_flag & st)


def _remount_tree_read_only(path: str) -> None:
    """Make the mount at ``path`` and every mount below it read-only (per mount, not per fs)."""
    for point in _mount_points_under(path):
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(point)
        syscalls.mount(None, point, None, flags)


# -- hiding and binding back -------------------------------------------------------------------


def _plan_hidden(hide: tuple[str, ...], log: _Log) -> list[_Hidden]:
    planned: list[_Hidden] = []
    for path in sorted({_resolve(p) for p in hide}, key=lambda p: (_depth(p), p)):
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            log.skip(f"hide {path}", "missing")
            continue
        outer = next((h.path for h in planned if _is_under(path, h.path)), None)
        if not stat.S_ISDIR(mode) or outer is not None:
            log.skip(f"hide {path}", f"inside hidden {outer}" if outer else "not a directory")
            continue
        planned.append(_Hidden(path, stat.S_IMODE(mode)))
    return planned


def _open_sources(
    bind_back: tuple[tuple[str, bool], ...], hidden: list[_Hidden], fds: list[int]
) -> list[_Source]:
    sources: list[_Source] = []
    for raw, writable in bind_back:
        path = _resolve(raw)
        root = next((h.path for h in hidden if _is_under(path, h.path)), None)
        if root is None:
            continue  # stays visible where it is
        try:
            fd = os.open(path, _O_PATH)
            fds.append(fd)
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            parents = _parent_modes(path, root)
        except OSError as exc:
            raise _fail("bind back", raw, exc) from exc
        sources.append(_Source(path, writable, fd, is_dir, parents))
    # Parents before children; on the same path the read-only grant goes on top.
    return sorted(sources, key=lambda s: (_depth(s.path), not s.writable))


def _parent_modes(path: str, root: str) -> tuple[tuple[str, int], ...]:
    modes: list[tuple[str, int]] = []
    parent = os.path.dirname(path)
    while parent != root and _is_under(parent, root):
        modes.append((parent, stat.S_IMODE(os.stat(parent).st_mode)))
        parent = os.path.dirname(parent)
    return tuple(reversed(modes))


def _hide(entry: _Hidden, log: _Log) -> None:
    try:
        syscalls.mount("tmpfs", entry.path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={entry.mode:o}")
    except OSError as exc:
        raise _fail("hide", entry.path, exc) from exc
    log.did(f"hide {entry.path} (empty tmpfs, mode {entry.mode:o})")


def _bind_back_all(sources: list[_Source], log: _Log) -> None:
    bound: list[_Source] = []
    for source in sources:
        cover = next((b for b in reversed(bound) if _is_under(source.path, b.path)), None)
        if cover is not None and cover.writable == source.writable:
            continue  # already visible, with the same access, through cover's recursive bind
        try:
            _make_mount_point(source)
            syscalls.mount(f"/proc/self/fd/{source.fd}", source.path, None, MS_BIND | MS_REC)
            if not source.writable:
                _remount_tree_read_only(source.path)
        except OSError as exc:
            raise _fail("bind back", source.path, exc) from exc
        bound.append(source)
        log.did(f"bind back {source.path} ({'rw' if source.writable else 'ro'})")


def _make_mount_point(source: _Source) -> None:
    # The skeleton keeps the host's modes, so a private 0700 parent stays private.
    for parent, mode in source.parents:
        if not os.path.isdir(parent):
            os.mkdir(parent)
            os.chmod(parent, mode)
    if os.path.lexists(source.path):
        return
    if source.is_dir:
        os.mkdir(source.path, 0o700)
    else:
        os.close(os.open(source.path, _O_CREATE, 0o600))


def _bind_read_only(raw: str, log: _Log) -> None:
    path = _resolve(raw)
    if not os.path.lexists(path):
        log.skip(f"read-only {path}", "missing")
        return
    try:
        syscalls.mount(path, path, None, MS_BIND | MS_REC)
        _remount_tree_read_only(path)
    except OSError as exc:
        raise _fail("read-only", path, exc) from exc
    log.did(f"read-only {path}")


# -- masks -------------------------------------------------------------------------------------


def _mask_all(paths: tuple[str, ...], log: _Log) -> None:
    files: list[str] = []
    for raw in paths:
        path = _resolve(raw)
        try:
            is_dir = stat.S_ISDIR(os.stat(path).st_mode)
        except OSError as exc:
            log.skip(f"mask {path}", "missing" if exc.errno == errno.ENOENT else exc.strerror or "")
            continue
        if is_dir:
            _mask_dir(path, log)
        else:
            files.append(path)
    if files:
        _mask_files(files, log)


def _mask_dir(path: str, log: _Log) -> None:
    try:
        syscalls.mount("tmpfs", path, "tmpfs", MS_RDONLY | _SAFE, "mode=000,size=4k")
    except OSError as exc:
        log.skip(f"mask {path}", exc.strerror or str(exc))
        return
    log.did(f"mask {path} (empty read-only tmpfs)")


def _mask_files(files: list[str], log: _Log) -> None:
    """Bind one empty mode-000 file over each path.

    The file lives on a small tmpfs mounted over a staging directory for a moment: the binds keep
    it alive after the tmpfs is detached, so the child sees no trace of it. (A bind from an
    unlinked file or a memfd is refused by the kernel.)
    """
    staging = next((d for d in _STAGING_DIRS if not any(_is_under(f, d) for f in files)), None)
    try:
        if staging is None:
            raise OSError(errno.EBUSY, "no staging directory outside the masked paths")
        syscalls.mount("tmpfs", staging, "tmpfs", _SAFE, "mode=700,size=4k")
    except OSError as exc:
        for path in files:
            log.skip(f"mask {path}", exc.strerror or str(exc))
        return
    try:
        empty = os.path.join(staging, "empty")
        os.close(os.open(empty, _O_CREATE, 0))
        for path in files:
            _mask_file(empty, path, log)
    finally:
        syscalls.umount2(staging, MNT_DETACH)


def _mask_file(empty: str, path: str, log: _Log) -> None:
    try:
        syscalls.mount(empty, path, None, MS_BIND)
        syscalls.mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked_flags(path))
    except OSError as exc:
        log.skip(f"mask {path}", exc.strerror or str(exc))
        return
    log.did(f"mask {path} (empty read-only file)")


# -- /proc and /sys ----------------------------------------------------------------------------


def _mount_new_proc(log: _Log) -> None:
    if _outside_new_pid_namespace():
        # A proc mounted now would show the old PID namespace (or be refused in a user ns).
        log.skip("proc /proc", "this process is outside its new PID namespace: fork first")
        return
    try:
        syscalls.mount("proc", "/proc", "proc", _SAFE)
    except OSError as exc:
        log.skip("proc /proc", exc.strerror or str(exc))
        return
    log.did("fresh proc on /proc")


def _outside_new_pid_namespace() -> bool:
    """True after unshare(CLONE_NEWPID) in this very process (its children go in, not it)."""
    try:
        return os.readlink("/proc/self/ns/pid") != os.readlink("/proc/self/ns/pid_for_children")
    except FileNotFoundError:
        # The kernel answers ENOENT for pid_for_children until the new namespace has its pid 1;
        # kernels before 4.12 have no such entry at all.
        return "pid_for_children" in os.listdir("/proc/self/ns")
    except OSError:
        return False


def _protect_kernel(log: _Log) -> None:
    for path in KERNEL_READ_ONLY:
        if not os.path.lexists(path):
            log.skip(f"read-only {path}", "missing")
            continue
        try:
            # /proc/sys is no mount point of its own: bind it onto itself first.
            syscalls.mount(path, path, None, MS_BIND | MS_REC)
            _remount_tree_read_only(path)
        except OSError as exc:
            log.skip(f"read-only {path}", exc.strerror or str(exc))
            continue
        log.did(f"read-only {path}")


# -- /dev --------------------------------------------------------------------------------------


def _open_devices(fds: list[int]) -> dict[str, int]:
    """O_PATH descriptors to the host's device nodes: mknod is refused in a user namespace."""
    devices: dict[str, int] = {}
    for name in (*DEV_NODES, "pts", "ptmx"):
        try:
            fd = os.open(f"/dev/{name}", _O_PATH)
        except OSError:
            continue  # reported when /dev is built
        fds.append(fd)
        devices[name] = fd
    return devices


def _build_dev(devices: dict[str, int], carry_shm: bool, log: _Log) -> None:
    # /dev/shm was hidden by us and may hold bound-back grants: carry that tmpfs over.
    shm_fd = _open_or_none("/dev/shm") if carry_shm else None
    try:
        syscalls.mount("tmpfs", "/dev", "tmpfs", _SAFE, "mode=755")
        for name in DEV_NODES:
            _bind_device(name, devices.get(name), log)
        _mount_pts(devices, log)
        _mount_shm(shm_fd, log)
        for name, target in DEV_SYMLINKS:
            os.symlink(target, f"/dev/{name}")
        syscalls.mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | _SAFE)
    except OSError as exc:
        log.skip("minimal /dev", exc.strerror or str(exc))
        return
    finally:
        if shm_fd is not None:
            os.close(shm_fd)
    log.did("minimal /dev")


def _open_or_none(path: str) -> int | None:
    try:
        return os.open(path, _O_PATH)
    except OSError:
        return None


def _bind_device(name: str, fd: int | None, log: _Log) -> None:
    target = f"/dev/{name}"
    try:
        if fd is None:
            raise OSError(errno.ENOENT, "missing on the host")
        os.close(os.open(target, _O_CREATE, 0o666))
        syscalls.mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
    except OSError as exc:
        log.skip(target, exc.strerror or str(exc))


def _mount_pts(devices: dict[str, int], log: _Log) -> None:
    os.mkdir("/dev/pts", 0o755)
    try:
        # A private instance: the child cannot reach the host's other terminals.
        syscalls.mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, _PTS_OPTIONS)
        os.symlink("pts/ptmx", "/dev/ptmx")
        return
    except OSError as exc:
        log.skip("fresh devpts", exc.strerror or str(exc))
    try:
        pts, ptmx = devices.get("pts"), devices.get("ptmx")
        if pts is None or ptmx is None:
            raise OSError(errno.ENOENT, "host /dev/pts or /dev/ptmx missing")
        syscalls.mount(f"/proc/self/fd/{pts}", "/dev/pts", None, MS_BIND | MS_REC)
        os.close(os.open("/dev/ptmx", _O_CREATE, 0o666))
        syscalls.mount(f"/proc/self/fd/{ptmx}", "/dev/ptmx", None, MS_BIND)
    except OSError as exc:
        log.skip("/dev/pts", exc.strerror or str(exc))
        return
    log.did("/dev/pts bound from the host")


def _mount_shm(shm_fd: int | None, log: _Log) -> None:
    os.mkdir("/dev/shm", 0o755)  # a mount point: what is mounted on it sets the mode
    try:
        if shm_fd is not None:
            syscalls.mount(f"/proc/self/fd/{shm_fd}", "/dev/shm", None, MS_BIND | MS_REC)
        else:
            syscalls.mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    except OSError as exc:
        log.skip("/dev/shm", exc.strerror or str(exc))


# -- working directory -------------------------------------------------------------------------


def _reenter_cwd(log: _Log) -> None:
    cwd = "(deleted)"
    try:
        cwd = os.getcwd()
        os.chdir(cwd)
    except OSError:
        os.chdir("/")
        log.skip(f"working directory {cwd}", "not visible after the new mounts; moved to /")
        return
    log.did(f"working directory {cwd}")
