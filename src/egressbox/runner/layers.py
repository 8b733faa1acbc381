"""A run's staged layer in egressbox's state directory: made before the child starts, applied
through the gate (confine/staging.py) after it exits, kept for `egressbox changes|apply|discard`.

    STATE/layers/RUN/     (STATE: egressbox's state directory, runner/own_state.py; 0700)
        meta.json   the roots (path, device, inode, rules), the command, the working directory
        state       running | pending | applying | held | failed
        journal     the temporary copy in flight during an apply (confine/staging.py)
        lock        flock'd by whoever applies or discards
        u0/ w0/...  the overlay's upper and work directories, one pair per root

The state directory is walked with O_NOFOLLOW from the user's state home, and a run refuses
to stage when it would lie inside one of its writable roots (the child would reach it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from egressbox.confine import face, staging
from egressbox.confine.grants import is_under
from egressbox.core.errors import EgressboxError
from egressbox.runner import own_state

LAYERS = "layers"
META = "meta.json"
STATE = "state"
LOCK = "lock"
RUNNING, PENDING, APPLYING, HELD, FAILED = "running", "pending", "applying", "held", "failed"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Runs one process may start within one second (a library caller's loop): each gets its own
# layer directory, named by a serial after the first.
_MAX_RUNS_PER_SECOND = 1000


class LayerError(EgressboxError):
    """A layer cannot be made, found or applied; the message says why and what to do."""


def state_home(env: Mapping[str, str] | None = None) -> str:
    """egressbox's state directory (runner/own_state.py decides where), which holds layers/."""
    return own_state.directory(env)


class Root(NamedTuple):
    """One staged root as recorded: its real path, identity and gate rules."""

    path: str
    dev: int
    ino: int
    rules: staging.Rules


class Layer:
    """A run's layer directory, held by descriptor."""

    def __init__(self, path: str, fd: int, run: str, meta: dict[str, Any]) -> None:
        self.path = path
        self.fd = fd
        self.run = run
        self.meta = meta

    @property
    def roots(self) -> list[Root]:
        return [
            Root(
                r["path"],
                r["dev"],
                r["ino"],
                staging.Rules(
                    tuple(tuple(p) for p in r.get("own", ())),
                    tuple(tuple(p) for p in r.get("lifted", ())),
                    bool(r.get("git_dir")),
                ),
            )
            for r in self.meta.get("roots", ())
        ]

    def open_upper(self, number: int) -> int:
        """Root `number`'s upper directory (what the command wrote there), never through a link."""
        return os.open(f"u{number}", _DIR, dir_fd=self.fd)

    def spec(self, direct: Sequence[str]) -> staging.StagingSpec:
        layers = tuple(
            (root.path, f"{self.path}/u{i}", f"{self.path}/w{i}")
            for i, root in enumerate(self.roots)
        )
        return staging.StagingSpec(layers, tuple(direct))

    @property
    def state(self) -> str:
        try:
            fd = os.open(STATE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return FAILED
        try:
            return os.read(fd, 64).decode("ascii", "replace").strip()
        finally:
            os.close(fd)

    def set_state(self, state: str) -> None:
        _write(self.fd, STATE, state + "\n")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write(dir_fd: int, name: str, text: str) -> None:
    tmp = f"{name}.new"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _new_run(top: int) -> tuple[str, int]:
    """A fresh run directory: its name sorts by time and is unique even for several runs of
    one process in the same second (the library), since mkdir refuses a name that exists."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    for serial in range(_MAX_RUNS_PER_SECOND):
        run = stamp if serial == 0 else f"{stamp}-{serial}"
        try:
            os.mkdir(run, 0o700, dir_fd=top)
        except FileExistsError:
            continue
        return run, _subdir(top, run)
    raise LayerError(f"more than {_MAX_RUNS_PER_SECOND} runs of one process in one second")


def _subdir(parent: int, name: str) -> int:
    """parent/name, made 0700 if missing, never through a symlink, ours and private."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, _DIR, dir_fd=parent)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise LayerError(f"{name} in egressbox's state directory is not private to you")
    return fd


def layers_dir(home: str, *, create: bool) -> tuple[str, int] | None:
    """The layers directory (path, fd); None when it does not exist and `create` is False."""
    base = os.path.realpath(os.path.dirname(home))
    try:
        if create:
            os.makedirs(base, 0o700, exist_ok=True)
        top = os.open(base, _DIR)
    except OSError as exc:
        if not create:
            return None
        raise LayerError(
            f"cannot make egressbox's state directory {base}: {exc.strerror}"
        ) from None
    try:
        if not create and not _exists(top, os.path.basename(home)):
            return None
        own = _subdir(top, os.path.basename(home))
        try:
            if not create and not _exists(own, LAYERS):
                return None
            return os.path.join(base, os.path.basename(home), LAYERS), _subdir(own, LAYERS)
        finally:
            os.close(own)
    except OSError as exc:
        raise LayerError(f"egressbox's state directory {home}: {exc.strerror}") from None
    finally:
        os.close(top)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def create(
    roots: Sequence[tuple[str, staging.Rules]],
    *,
    home: str,
    argv: Sequence[str],
    cwd: str,
    review: bool,
    writable: Sequence[str],
) -> Layer:
    """A new layer for `roots` (real directory paths), before the child starts."""
    found = layers_dir(home, create=True)
    assert found is not None
    path, top = found
    inside = [w for w in writable if is_under(path, w)]
    try:
        if inside:
            raise LayerError(
                f"egressbox's state directory {path} is inside the write root {inside[0]}, "
                "where the command could reach its layers: set EGRESSBOX_STATE_DIR to a directory "
                "outside every root, or pass --workspace direct"
            )
        run, fd = _new_run(top)
    finally:
        os.close(top)
    recorded = []
    for index, (root, rules) in enumerate(roots):
        st = os.stat(root)
        recorded.append(
            {
                "path": root,
                "dev": st.st_dev,
                "ino": st.st_ino,
                "own": [list(p) for p in rules.own],
                "lifted": [list(p) for p in rules.lifted],
                "git_dir": rules.git_dir,
            }
        )
        for prefix in ("u", "w"):
            os.mkdir(f"{prefix}{index}", 0o700, dir_fd=fd)
        # The upper's root carries the host directory's mode (overlayfs shows the upper's).
        os.chmod(f"u{index}", stat.S_IMODE(st.st_mode), dir_fd=fd)
    meta = {"run": run, "roots": recorded, "argv": list(argv), "cwd": cwd, "review": review}
    _write(fd, META, json.dumps(meta))
    layer = Layer(os.path.join(path, run), fd, run, meta)
    layer.set_state(RUNNING)
    return layer


def open_layer(path: str, run: str, top: int) -> Layer | None:
    try:
        fd = os.open(run, _DIR, dir_fd=top)
    except OSError:
        return None
    try:
        mfd = os.open(META, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        try:
            meta = json.loads(os.read(mfd, 1 << 20))
        finally:
            os.close(mfd)
    except (OSError, ValueError):
        os.close(fd)
        return None
    return Layer(os.path.join(path, run), fd, run, meta if isinstance(meta, dict) else {})


def all_layers(home: str) -> list[Layer]:
    """Every layer, oldest first (the run id starts with its UTC time)."""
    found = layers_dir(home, create=False)
    if found is None:
        return []
    path, top = found
    try:
        layers = [open_layer(path, name, top) for name in sorted(os.listdir(top))]
    finally:
        os.close(top)
    return [layer for layer in layers if layer is not None]


def for_workspace(home: str, cwd: str) -> list[Layer]:
    """Layers with a root that holds `cwd` (or lies below it), oldest first; others closed."""
    keep = []
    for layer in all_layers(home):
        if any(is_under(cwd, r.path) or is_under(r.path, cwd) for r in layer.roots):
            keep.append(layer)
        else:
            layer.close()
    return keep


@contextlib.contextmanager
def locked(layer: Layer) -> Iterator[None]:
    fd = os.open(
        LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=layer.fd
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def open_roots(layer: Layer) -> list[staging.Target]:
    """Handles on the host roots, checked against the identity recorded at the run."""
    targets = []
    try:
        for index, root in enumerate(layer.roots):
            try:
                fd = os.open(root.path, _DIR)
            except OSError as exc:
                raise LayerError(f"{root.path}: {exc.strerror}") from None
            st = os.fstat(fd)
            targets.append(staging.Target(index, fd, root.path, root.rules))
            if (st.st_dev, st.st_ino) != (root.dev, root.ino):
                raise LayerError(
                    f"{root.path} is not the directory the run staged (replaced since)"
                )
    except BaseException:
        close_roots(targets)
        raise
    return targets


def close_roots(targets: Sequence[staging.Target]) -> None:
    for target in targets:
        with contextlib.suppress(OSError):
            os.close(target.root_fd)


def apply(
    layer: Layer,
    targets: Sequence[staging.Target],
    selections: dict[int, staging.Selection] | None = None,
) -> staging.Outcome:
    """Apply the layer to `targets` (handles taken before the child started, for a run), under
    the layer's lock; a copy left in flight by a killed apply is removed first."""
    with locked(layer):
        layer.set_state(APPLYING)
        total = face.apply_layer(layer.fd, targets, layer.open_upper, selections)
        _settle(layer)
    return total


def changes(layer: Layer, targets: Sequence[staging.Target]) -> staging.Outcome:
    return face.layer_changes(targets, layer.open_upper)


def _settle(layer: Layer) -> None:
    """Nothing left in any upper: the layer goes; else it stays, held (or pending)."""
    if all(_empty(layer.fd, f"u{i}") for i in range(len(layer.roots))):
        discard(layer)
    else:
        layer.set_state(HELD)


def _empty(dir_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, _DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    try:
        return not os.listdir(fd)
    finally:
        os.close(fd)


def discard(layer: Layer) -> None:
    """Remove the layer's directory (its upper may hold directories the child made 000)."""

    def unlock(_func: object, path: str, _exc: object) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(path), 0o700)
            if os.path.isdir(path) and not os.path.islink(path):
                os.chmod(path, 0o700)
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)

    path = layer.path
    if _remove_empty(layer):
        return
    import shutil

    layer.close()
    shutil.rmtree(path, onerror=unlock)


def _remove_empty(layer: Layer) -> bool:
    """The usual end of a layer applied whole: its few entries removed by name, without
    loading shutil (~2.5 ms of a run's end); False when anything else is left."""
    try:
        for index in range(len(layer.roots)):
            os.rmdir(f"u{index}", dir_fd=layer.fd)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(f"w{index}/work", dir_fd=layer.fd)  # overlayfs's own
            os.rmdir(f"w{index}", dir_fd=layer.fd)
        for name in (META, STATE, LOCK, staging.JOURNAL):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=layer.fd)
        layer.close()
        os.rmdir(layer.path)
    except OSError:
        return False
    return True
