"""The child's filesystem: a new root built from the plan's grants, then pivot_root.

For the child only what it is granted exists. Runs in the launcher's pid 1 (single-threaded,
inside new user, mount, PID, network, IPC and UTS namespaces), before the command is forked.

Order of the steps and why:

1. ``/`` recursively private, so nothing below propagates back to the host.
2. ``O_PATH`` descriptors to every granted path and host device node, opened by name while the
   host's tree is still in view; ``/etc`` is walked for entries that are not world-readable.
3. An empty tmpfs becomes the new root (mounted over ``/tmp`` of this private namespace: the
   grants under the host's ``/tmp`` are already held by descriptor).
4. Private, size-limited tmpfs for ``/tmp``, ``/var/tmp`` and ``/run``.
5. Symlinks along granted paths (``/bin -> usr/bin``) recreated, then each grant bound from its
   descriptor at its real path: read-only ones with ``MOUNT_ATTR_RDONLY`` over the whole tree,
   every bind ``nosuid,nodev``. Read-only binds make every metadata change fail (chmod, chown,
   utimes, xattrs), which Landlock cannot refuse up to ABI 7.
6. Every directory between a writable grant and a host-trusted path inside it bound onto
   itself (a mount point cannot be renamed or removed: ``mv .git .git.old`` fails with EBUSY),
   then the host-trusted paths (``.git/hooks``, the policy, the audit log, egressbox's caches)
   bound read-only onto themselves.
7. Masks: credential paths inside grants, and the ``/etc`` entries only their owner or group may
   read (shadow, SSH host keys, sudoers), covered by an empty placeholder of mode 000: a root
   child owns every root-owned file, so permissions alone would not keep them out.
   Then the spec's own files (with capture: ``/etc/resolv.conf`` naming egressbox's DNS address,
   ``/etc/hosts`` with localhost only) are bound read-only over what the host has there.
8. A fresh ``/proc`` (its ``pid_max`` capping the namespace's tasks), its kernel knobs
   read-only; a fresh read-only ``/sys`` of the child's network namespace; a minimal ``/dev``.
9. ``pivot_root`` and detach the old root; the new root's own tmpfs becomes read-only.
10. Scratch directories are made inside the new view, where a symlink the previous child left can
    only point at what this child may write anyway; then the working directory is entered.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from egressbox.confine import staging, syscalls
from egressbox.confine.grants import WorldSpec, is_under
from egressbox.confine.staging import StagingSpec
from egressbox.confine.syscalls import (
    MNT_DETACH,
    MOUNT_ATTR_NODEV,
    MOUNT_ATTR_NOSUID,
    MOUNT_ATTR_RDONLY,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
)

# Mount points the world makes itself; a grant at or below them is not bound from the host
# (a workspace under the host's /tmp is: see _constructed_here).
CONSTRUCTED = ("/proc", "/sys", "/dev")
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/run")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_SYMLINKS = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
)
KERNEL_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus")
# Sizes of the private tmpfs: the new root holds only mount points and symlinks; /dev only
# nodes. /tmp and /var/tmp get what a build's temporary files need without letting one run
# fill the host's memory (tmpfs pages are memory).
ROOT_SIZE = "4m"
DEV_SIZE = "64k"
RUN_SIZE = "16m"
# The kernel refuses a pid_max below this in any PID namespace (PID_MAX_MIN).
PID_MAX_MIN = 301
# Where the new root is assembled: any directory of this private namespace that is sure to
# exist; grants below it are held by descriptor before it is covered.
STAGING = "/tmp"
# A private devpts instance whose ptmx anyone may open (the host's may be mode 000).
_PTS_OPTIONS = "newinstance,ptmxmode=0666,mode=0620"
_O_PATH = os.O_PATH | os.O_CLOEXEC
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_SAFE = MS_NOSUID | MS_NODEV | MS_NOEXEC
_BIND_ATTRS = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV
# Symlinks followed along one granted path, at most (as the kernel's MAXSYMLINKS).
_MAX_LINKS = 40
_EMPTY_FILE = "/.egressbox-empty-file"
_EMPTY_DIR = "/.egressbox-empty-dir"


@dataclass(frozen=True)
class WorldReport:
    """What apply_world did, and each step it could not do with the reason."""

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


@dataclass(frozen=True)
class _Source:
    """A granted path held by descriptor until it is bound in the new root."""

    path: str  # the real path: where it is bound in the new root
    writable: bool
    fd: int
    is_dir: bool


class WorldError(OSError):
    """An essential step failed: the command must not run in a half-built world."""


def apply_world(
    spec: WorldSpec, etc_hidden: list[str] | None = None, staged: StagingSpec | None = None
) -> WorldReport:
    """Build the new root and pivot into it; see the module docstring for the steps.

    `etc_hidden` is unreadable_to_others("/etc") when the caller has walked it already (the
    launcher does while the proxy loads its policy). With `staged`, each of its directories is
    an overlay whose upper is the run's layer (confine/staging.py), not a read-write bind.
    """
    _check_absolute(spec)
    if not is_new_mount_namespace():
        raise WorldError(errno.EPERM, "the world needs its own mount namespace: unshare first")
    _essential("make / private", lambda: syscalls.mount(None, "/", None, MS_REC | MS_PRIVATE))
    log = _Log()
    fds: list[int] = []
    try:
        links = _symlinks_along(p for p, _ in spec.grants)
        sources = _open_sources(spec, fds)
        devices = _open_devices(fds)
        layers, direct = _open_staging(staged, fds)
        if etc_hidden is None:
            etc_hidden = unreadable_to_others("/etc") if _granted("/etc", spec) else []
        _build(spec, _Held(links, sources, devices, etc_hidden, layers, direct), log)
    finally:
        for fd in fds:
            os.close(fd)
    _pivot(log)
    _make_scratch(spec.scratch, log)
    _enter(spec.cwd)
    return WorldReport(tuple(log.steps), tuple(log.skipped))


@dataclass(frozen=True)
class _Held:
    """What was taken from the host's tree before the new root covered it."""

    links: list[tuple[str, str]]
    sources: list[_Source]
    devices: dict[str, int]
    etc_hidden: list[str]
    # Staged directories: host path -> (upper fd, work fd); then what is bound directly on
    # top of them (the scratch space), as writable sources.
    layers: dict[str, tuple[int, int]]
    direct: list[_Source]


def _build(spec: WorldSpec, held: _Held, log: _Log) -> None:
    root = STAGING
    devices = held.devices
    _essential("new root", lambda: _tmpfs(root, "0755", ROOT_SIZE))
    log.did(f"new root (tmpfs, {ROOT_SIZE})")
    for path in PRIVATE_TMPFS:
        mode, size = ("0755", RUN_SIZE) if path == "/run" else ("1777", spec.tmp_size)
        _essential(f"private {path}", lambda p=path, m=mode, s=size: _private_tmpfs(root, p, m, s))
        log.did(f"private {path} (tmpfs, {size})")
    for link, target in held.links:
        _mirror_link(root, link, target)
    _bind_all(root, held.sources, log, held.layers)
    _bind_direct(root, held.direct, log)
    _pin_ancestors(root, spec, log)
    for path in spec.read_only:
        _protect(root, os.path.realpath(path), log)
    _mask_all(root, (*spec.mask, *held.etc_hidden), log)
    _write_files(root, spec.files, log)
    if spec.new_proc:
        _proc(root, spec, log)
    else:
        _host_proc(root, devices.get("proc"), spec, log)
    _sys(root, log)
    _dev(root, devices, spec.shm_size, log)


def _essential(what: str, step: object) -> None:
    assert callable(step)
    try:
        step()
    except OSError as exc:
        raise WorldError(exc.errno or errno.EIO, f"{what}: {exc.strerror or exc}") from None


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


# -- paths ---------------------------------------------------------------------------------


def _check_absolute(spec: WorldSpec) -> None:
    paths = (
        *(p for p, _ in spec.grants),
        *spec.read_only,
        *spec.mask,
        *spec.socket_roots,
        *spec.scratch,
        *(path for path, _ in spec.files),
        spec.cwd,
    )
    relative = [p for p in paths if not os.path.isabs(p)]
    if relative:
        raise ValueError(f"world paths must be absolute: {relative}")


def _depth(path: str) -> int:
    return path.rstrip("/").count("/")


def _granted(path: str, spec: WorldSpec) -> bool:
    return any(is_under(path, os.path.realpath(p)) for p, _ in spec.grants)


def _constructed_here(path: str) -> bool:
    """Paths the world makes itself, never bound from the host."""
    return any(is_under(path, c) for c in CONSTRUCTED) or path in PRIVATE_TMPFS


def unreadable_to_others(top: str) -> list[str]:
    """Entries under `top` that not every user may read (directories: read and search).

    The child gets what any user of the host could read, never what only an owner or a group
    may: a root child is uid 0 and owns every root-owned file it can see.
    """
    hidden: list[str] = []
    try:
        entries = list(os.scandir(top))
    except OSError:
        return [top]
    for entry in entries:
        try:
            mode = entry.stat(follow_symlinks=False).st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            continue  # its target is judged where it lives
        if stat.S_ISDIR(mode):
            if mode & 0o005 != 0o005:
                hidden.append(entry.path)
            else:
                hidden += unreadable_to_others(entry.path)
        elif not mode & 0o004:
            hidden.append(entry.path)
    return hidden


def _symlinks_along(paths: Iterable[str]) -> list[tuple[str, str]]:
    """(link, target) for every symlink met while resolving the granted paths.

    The child reaches a grant by the name it was given (``/bin/sh`` on a merged-/usr host,
    ``/home/u`` when /home is a link), so each link on the way is recreated in the new root.
    """
    found: dict[str, str] = {}
    for path in paths:
        _walk_links(path, found, 0)
    return sorted(found.items(), key=lambda item: _depth(item[0]))


def _walk_links(path: str, found: dict[str, str], hops: int) -> None:
    parts = [p for p in path.split("/") if p]
    current = "/"
    for index, part in enumerate(parts):
        current = os.path.join(current, part)
        if not os.path.islink(current):
            continue
        if hops >= _MAX_LINKS:
            return
        try:
            target = os.readlink(current)
        except OSError:
            return
        found.setdefault(current, target)
        rest = "/".join(parts[index + 1 :])
        resolved = os.path.normpath(os.path.join(os.path.dirname(current), target, rest))
        _walk_links(resolved, found, hops + 1)
        return


def _open_sources(spec: WorldSpec, fds: list[int]) -> list[_Source]:
    wanted: dict[str, bool] = {}
    for raw, writable in spec.grants:
        path = os.path.realpath(raw)
        if _constructed_here(path) or path == "/":
            continue
        wanted[path] = wanted.get(path, False) or writable
    for raw in spec.socket_roots:
        path = os.path.realpath(raw)
        # Read-write only where Landlock admits the making of a socket and no other write
        # (spec.socket_bind); a read-only bind still admits connect.
        wanted[path] = wanted.get(path, False) or raw in spec.socket_bind
    sources: list[_Source] = []
    for path, writable in wanted.items():
        try:
            fd = os.open(path, _O_PATH)
        except OSError:
            continue  # missing on the host: it does not exist for the child either
        fds.append(fd)
        is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        sources.append(_Source(path, writable, fd, is_dir))
    # Parents before children; a read-only grant nested in a writable one goes on top.
    return sorted(sources, key=lambda s: (_depth(s.path), not s.writable))


def _open_devices(fds: list[int]) -> dict[str, int]:
    """O_PATH descriptors to the host's device nodes: mknod is refused in a user namespace."""
    devices: dict[str, int] = {}
    for name, path in (*((n, f"/dev/{n}") for n in DEV_NODES), ("proc", "/proc")):
        try:
            fd = os.open(path, _O_PATH)
        except OSError:
            continue  # reported when /dev is built
        fds.append(fd)
        devices[name] = fd
    return devices


# -- building ------------------------------------------------------------------------------


def _tmpfs(target: str, mode: str, size: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    syscalls.mount("tmpfs", target, "tmpfs", flags, f"mode={mode},size={size}")


def _private_tmpfs(root: str, path: str, mode: str, size: str) -> None:
    target = root + path
    _make_dirs(root, path)
    _tmpfs(target, mode, size)
    os.chmod(target, int(mode, 8))


def _make_dirs(root: str, path: str, *, last: bool = True) -> None:
    """mkdir -p of `path` in the new root, each directory with the host's permission bits.

    Only ever inside the new root's own tmpfs: a missing directory below a bound grant would
    mean creating it on the host, which this refuses.
    """
    parts = [p for p in path.split("/") if p]
    if not last:
        parts = parts[:-1]
    own = _own_devices(root)
    current = ""
    for part in parts:
        parent = root + (current or "/")
        current += "/" + part
        target = root + current
        if os.path.lexists(target):
            continue
        if os.stat(parent).st_dev not in own:
            raise WorldError(errno.ENOENT, f"{current} is missing below a bound grant")
        os.mkdir(target, 0o700)
        with contextlib.suppress(OSError):
            os.chmod(target, stat.S_IMODE(os.stat(current).st_mode))


def _own_devices(root: str) -> set[int]:
    """The new root's own tmpfs and the private ones on it: the only places it may write."""
    own = {os.stat(root).st_dev}
    for path in PRIVATE_TMPFS:
        with contextlib.suppress(OSError):
            own.add(os.stat(root + path).st_dev)
    return own


def _mirror_link(root: str, link: str, target: str) -> None:
    with contextlib.suppress(OSError):
        _make_dirs(root, link, last=False)
        if not os.path.lexists(root + link):
            os.symlink(target, root + link)


def _bind_all(
    root: str, sources: list[_Source], log: _Log, layers: dict[str, tuple[int, int]]
) -> None:
    bound: list[_Source] = []
    for source in sources:
        cover = next((b for b in reversed(bound) if is_under(source.path, b.path)), None)
        if cover is not None and cover.writable == source.writable:
            continue  # already there, with the same access, through cover's recursive bind
        layer = layers.get(source.path) if source.writable and source.is_dir else None
        if layer is not None:
            _overlay(root, source, layer, log)
            bound.append(source)
            continue
        try:
            _mount_point(root, source)
            target = root + source.path
            syscalls.mount(f"/proc/self/fd/{source.fd}", target, None, MS_BIND | MS_REC)
            attrs = _BIND_ATTRS | (0 if source.writable else MOUNT_ATTR_RDONLY)
            syscalls.mount_setattr(target, attrs)
        except OSError as exc:
            log.skip(f"bind {source.path}", exc.strerror or str(exc))
            continue
        bound.append(source)
        log.did(f"bind {source.path} ({'rw' if source.writable else 'ro'})")


def _open_staging(
    staged: StagingSpec | None, fds: list[int]
) -> tuple[dict[str, tuple[int, int]], list[_Source]]:
    """O_PATH handles on the layers' upper and work directories (egressbox's own state, never
    granted) and on the directories bound directly on top, while the host's tree is in view."""
    if staged is None:
        return {}, []
    layers: dict[str, tuple[int, int]] = {}
    for host, upper, work in staged.layers:
        try:
            pair = [os.open(p, _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW) for p in (upper, work)]
        except OSError as exc:
            raise WorldError(exc.errno or errno.EIO, f"layer of {host}: {exc.strerror}") from None
        fds.extend(pair)
        layers[os.path.realpath(host)] = (pair[0], pair[1])
    direct: list[_Source] = []
    for path in staged.direct:
        try:
            fd = os.open(path, _O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # the command's scratch space is then made inside the layer
        fds.append(fd)
        direct.append(_Source(path, True, fd, True))
    return layers, direct


def _overlay(root: str, source: _Source, layer: tuple[int, int], log: _Log) -> None:
    """The writable directory as an overlay: the host's directory below, the layer above.

    A staged directory that cannot be mounted is an error, never a silent read-write bind.
    """
    upper, work = layer
    options = staging.overlay_options(
        f"/proc/self/fd/{source.fd}",
        f"/proc/self/fd/{upper}",
        f"/proc/self/fd/{work}",
        user_namespace=os.getuid() != 0 or _in_user_namespace(),
    )
    try:
        _mount_point(root, source)
        syscalls.mount("overlay", root + source.path, "overlay", MS_NOSUID | MS_NODEV, options)
    except OSError as exc:
        raise WorldError(
            exc.errno or errno.EIO, f"staged {source.path} (overlayfs): {exc.strerror or exc}"
        ) from None
    log.did(f"staged {source.path} (overlay; writes go to the run's layer)")


def _in_user_namespace() -> bool:
    """Whether this process is in a user namespace other than the initial one (uid 0 there
    maps to another uid outside): overlayfs then needs userxattr."""
    try:
        with open("/proc/self/uid_map", encoding="ascii") as handle:
            first = handle.read().split()
    except OSError:
        return True
    return first[:3] != ["0", "0", "4294967295"]


def _bind_direct(root: str, sources: list[_Source], log: _Log) -> None:
    """The scratch space read-write from the host, on top of its staged workspace: temp files
    and tool caches are not part of what a run hands back."""
    for source in sources:
        target = root + source.path
        try:
            if not os.path.isdir(target) or os.path.islink(target):
                raise OSError(errno.ENOENT, "not a directory in the view")
            syscalls.mount(f"/proc/self/fd/{source.fd}", target, None, MS_BIND)
            syscalls.mount_setattr(target, _BIND_ATTRS, recursive=False)
        except OSError as exc:
            log.skip(f"scratch {source.path}", exc.strerror or str(exc))
            continue
        log.did(f"bind {source.path} (rw, not staged: scratch space)")


def _mount_point(root: str, source: _Source) -> None:
    target = root + source.path
    if os.path.lexists(target):
        if os.path.islink(target):
            raise WorldError(errno.ELOOP, f"{source.path} is a symlink in the new root")
        return
    _make_dirs(root, source.path, last=False)
    if source.is_dir:
        os.mkdir(target, 0o700)
        os.chmod(target, stat.S_IMODE(os.fstat(source.fd).st_mode))
    else:
        os.close(os.open(target, _O_CREATE, 0o600))


def _protect(root: str, path: str, log: _Log) -> None:
    """Bind `path` of the new root read-only onto itself; absent (not granted): nothing to do."""
    target = root + path
    if not os.path.lexists(target):
        return
    try:
        # /proc/sys is no mount point of its own, nor is a file in a workspace: bind first.
        syscalls.mount(target, target, None, MS_BIND | MS_REC)
        syscalls.mount_setattr(target, _BIND_ATTRS | MOUNT_ATTR_RDONLY)
    except OSError as exc:
        raise WorldError(exc.errno or errno.EIO, f"read-only {path}: {exc.strerror}") from None
    log.did(f"read-only {path}")


def _pin_ancestors(root: str, spec: WorldSpec, log: _Log) -> None:
    """Bind each directory between a writable grant and a protected path onto itself.

    Linux renames a directory that *contains* mount points, so a read-only bind on
    ``.git/config`` alone lets the child ``mv .git .git.old; mkdir .git`` and write a new
    config the host reads next; a directory that *is* a mount point cannot be renamed or
    removed (EBUSY: FIELD-NOTES, third round). Shallowest first, before the read-only binds,
    which then sit on top. A directory missing in the view ends its chain: nothing below it
    exists yet (what the command creates there is judged after the run, runner/verify.py).
    """
    writable = [os.path.realpath(p) for p, w in spec.grants if w]
    pinned: dict[str, None] = {}
    for raw in spec.read_only:
        for directory in ancestors_within(os.path.realpath(raw), writable):
            target = root + directory
            if not os.path.isdir(target) or os.path.islink(target):
                break
            if directory in pinned:
                continue
            try:
                syscalls.mount(target, target, None, MS_BIND | MS_REC)
                syscalls.mount_setattr(target, _BIND_ATTRS, recursive=False)
            except OSError as exc:
                raise WorldError(
                    exc.errno or errno.EIO, f"pin {directory}: {exc.strerror}"
                ) from None
            pinned[directory] = None
    if pinned:
        log.did(f"pinned {len(pinned)} directories above host-trusted paths")


def ancestors_within(path: str, writable: Iterable[str]) -> list[str]:
    """The directories from the outermost writable root holding `path` down to its parent."""
    holders = [w for w in writable if is_under(path, w) and path != w]
    if not holders:
        return []
    top = min(holders, key=_depth).rstrip("/") or "/"
    chain = [top]
    rest = path[len(top) :].strip("/").split("/")[:-1]
    for part in rest:
        chain.append(os.path.join(chain[-1], part))
    return chain


def _mask_all(root: str, paths: Iterable[str], log: _Log) -> None:
    empty_file, empty_dir = root + _EMPTY_FILE, root + _EMPTY_DIR
    os.close(os.open(empty_file, _O_CREATE, 0))
    os.mkdir(empty_dir, 0)
    os.chmod(empty_dir, 0)
    try:
        for raw in dict.fromkeys(paths):
            _mask(root, raw, empty_file, empty_dir, log)
    finally:
        # The binds keep the placeholders alive; their names go with the root's last write.
        os.unlink(empty_file)
        os.rmdir(empty_dir)


def _mask(root: str, raw: str, empty_file: str, empty_dir: str, log: _Log) -> None:
    target = root + os.path.realpath(raw)
    try:
        st = os.lstat(target)
    except OSError:
        return  # outside every grant: it does not exist for the child
    placeholder = empty_dir if stat.S_ISDIR(st.st_mode) else empty_file
    try:
        syscalls.mount(placeholder, target, None, MS_BIND)
        syscalls.mount_setattr(target, _BIND_ATTRS | MOUNT_ATTR_RDONLY, recursive=False)
    except OSError as exc:
        raise WorldError(exc.errno or errno.EIO, f"mask {raw}: {exc.strerror}") from None
    log.did(f"mask {raw}")


def _write_files(root: str, files: Iterable[tuple[str, str]], log: _Log) -> None:
    """Each file of the spec holds its text in the view, read-only (step 7, after the masks).

    The text is written to the new root's own tmpfs and bound over the path as the view
    resolves it: a host symlink (``/etc/resolv.conf -> ../run/systemd/resolve/...``) is
    followed inside the new root, where its target may be missing (the private /run), and is
    then made there; never on the host.
    """
    for index, (path, text) in enumerate(files):
        source = f"{root}/.egressbox-file-{index}"
        try:
            fd = os.open(source, _O_CREATE, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.chmod(source, 0o644)
            where = _view_path(root, path)
            _file_mount_point(root, where)
            syscalls.mount(source, root + where, None, MS_BIND)
            syscalls.mount_setattr(root + where, _BIND_ATTRS | MOUNT_ATTR_RDONLY, recursive=False)
        except OSError as exc:
            log.skip(f"file {path}", exc.strerror or str(exc))
            continue
        finally:
            with contextlib.suppress(OSError):
                os.unlink(source)  # the bind keeps the file; its name goes
        log.did(f"file {path}" + (f" (at {where})" if where != path else ""))


def _view_path(root: str, path: str) -> str:
    """`path` as the child will resolve it: every symlink met is followed inside the new root."""
    pending = [p for p in path.split("/") if p]
    current = "/"
    hops = 0
    while pending:
        part = pending.pop(0)
        if part == ".":
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        candidate = os.path.join(current, part)
        if not os.path.islink(root + candidate):
            current = candidate
            continue
        hops += 1
        if hops > _MAX_LINKS:
            raise WorldError(errno.ELOOP, f"too many symlinks resolving {path}")
        target = os.readlink(root + candidate)
        if target.startswith("/"):
            current = "/"
        pending[:0] = [p for p in target.split("/") if p]
    return current


def _file_mount_point(root: str, path: str) -> None:
    """An existing file to bind over, or an empty one made in the new root's own tmpfs."""
    target = root + path
    if os.path.lexists(target):
        if os.path.isdir(target):
            raise WorldError(errno.EISDIR, f"{path} is a directory")
        return
    _make_dirs(root, path, last=False)
    if os.stat(os.path.dirname(target)).st_dev not in _own_devices(root):
        raise WorldError(errno.ENOENT, f"{path} is missing below a bound grant")
    os.close(os.open(target, _O_CREATE, 0o644))


def _proc(root: str, spec: WorldSpec, log: _Log) -> None:
    target = root + "/proc"
    os.mkdir(target, 0o555)
    try:
        syscalls.mount("proc", target, "proc", _SAFE)
    except OSError as exc:
        raise WorldError(exc.errno or errno.EIO, f"fresh /proc: {exc.strerror}") from None
    log.did("fresh /proc")
    if spec.max_processes is not None:
        _limit_tasks(target, spec.max_processes, log)
    if spec.protect_kernel:
        for path in KERNEL_READ_ONLY:
            _protect(root, path, log)


def _host_proc(root: str, fd: int | None, spec: WorldSpec, log: _Log) -> None:
    """Without a PID namespace a fresh proc would show the host's processes all the same, and
    a user namespace may not mount one: the host's is bound, its kernel knobs read-only."""
    target = root + "/proc"
    os.mkdir(target, 0o555)
    if fd is None:
        log.skip("/proc", "absent on the host")
        return
    source = f"/proc/self/fd/{fd}"
    _essential("bind /proc", lambda: syscalls.mount(source, target, None, MS_BIND | MS_REC))
    log.did("the host's /proc (no PID namespace)")
    if spec.protect_kernel:
        for path in KERNEL_READ_ONLY:
            _protect(root, path, log)


def _limit_tasks(proc: str, max_processes: int, log: _Log) -> None:
    # pid_max is per PID namespace (Linux 6.14): tasks beyond it cannot be created in here.
    value = max(max_processes + 1, PID_MAX_MIN)
    try:
        with open(f"{proc}/sys/kernel/pid_max", "w", encoding="ascii") as handle:
            handle.write(str(value))
    except OSError as exc:
        log.skip("max_processes", f"pid_max per PID namespace: {exc.strerror or exc}")
        return
    log.did(f"max_processes {value - 1} (pid_max of the PID namespace)")


def _sys(root: str, log: _Log) -> None:
    target = root + "/sys"
    os.mkdir(target, 0o555)
    try:
        # A fresh sysfs shows the child's network namespace (lo only), nothing mounted below.
        syscalls.mount("sysfs", target, "sysfs", _SAFE | MS_RDONLY)
    except OSError as exc:
        log.skip("/sys", f"absent: {exc.strerror or exc}")
        return
    log.did("fresh /sys (read-only)")


def _dev(root: str, devices: dict[str, int], shm_size: str, log: _Log) -> None:
    target = root + "/dev"
    os.mkdir(target, 0o755)
    _essential("/dev", lambda: _tmpfs(target, "0755", DEV_SIZE, MS_NOSUID | MS_NOEXEC))
    for name in DEV_NODES:
        node = f"{target}/{name}"
        fd = devices.get(name)
        if fd is None:
            log.skip(f"/dev/{name}", "missing on the host")
            continue
        os.close(os.open(node, _O_CREATE, 0o666))
        _essential(f"/dev/{name}", lambda n=node, f=fd: _bind_node(f, n))
    os.mkdir(f"{target}/pts", 0o755)
    # A private instance: the child cannot reach the host's terminals.
    _essential(
        "private devpts",
        lambda: syscalls.mount(
            "devpts", f"{target}/pts", "devpts", MS_NOSUID | MS_NOEXEC, _PTS_OPTIONS
        ),
    )
    os.mkdir(f"{target}/shm", 0o755)
    _essential("private /dev/shm", lambda: _tmpfs(f"{target}/shm", "1777", shm_size))
    for name, link in DEV_SYMLINKS:
        os.symlink(link, f"{target}/{name}")
    _essential(
        "/dev read-only",
        lambda: syscalls.mount_setattr(target, MOUNT_ATTR_RDONLY, recursive=False),
    )
    log.did(f"minimal /dev (private devpts, /dev/shm {shm_size})")


def _bind_node(fd: int, node: str) -> None:
    syscalls.mount(f"/proc/self/fd/{fd}", node, None, MS_BIND)


# -- the switch ----------------------------------------------------------------------------


def _pivot(log: _Log) -> None:
    os.chdir(STAGING)
    # pivot_root(".", "."): the old root ends up stacked on the new one, and detaching "."
    # removes it without a directory for it in the new root (pivot_root(2), NOTES).
    _essential("pivot_root", lambda: syscalls.pivot_root(".", "."))
    _essential("detach the old root", lambda: syscalls.umount2(".", MNT_DETACH))
    os.chdir("/")
    _essential(
        "read-only new root",
        lambda: syscalls.mount_setattr("/", MOUNT_ATTR_RDONLY | _BIND_ATTRS, recursive=False),
    )
    log.did("pivot_root; old root detached")


def _make_scratch(dirs: tuple[str, ...], log: _Log) -> None:
    """The scratch space, made inside the view: a link planted there by an earlier child
    resolves among this child's own grants, never on the host."""
    for path in dirs:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            log.skip(f"scratch {path}", exc.strerror or str(exc))
            continue
    if dirs:
        ignore = os.path.join(os.path.dirname(dirs[0]), ".gitignore")
        with contextlib.suppress(OSError):
            fd = os.open(ignore, _O_CREATE | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w", encoding="ascii") as handle:
                handle.write("# egressbox scratch space (temp files and caches)\n*\n")


def _enter(cwd: str) -> None:
    try:
        os.chdir(cwd)
    except OSError as exc:
        raise WorldError(
            exc.errno or errno.ENOENT, f"working directory {cwd}: {exc.strerror}"
        ) from None
