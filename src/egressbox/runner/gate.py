"""A run's way back: its staged layer made before the child starts and applied after it exits.

prepare() (runner/assemble.py) calls stage() once the roots are known: it makes the layer
(runner/layers.py), takes handles on the host's roots, and gives the launcher the overlay
spec. The run's end (runner/supervise.py) calls finish(): the layer is applied through the gate
(confine/staging.py), or kept whole with --review. A layer that an earlier apply left half
done (killed) is finished first, by recover().
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Protocol

from egressbox.confine import staging
from egressbox.confine.grants import Enforcement, is_under
from egressbox.runner import layers
from egressbox.runner.options import MechanismReport, RunResult

STAGED, DIRECT = "staged", "direct"
NO_MOUNTS = (
    "no mount namespace for a staged layer: the command writes the host's files live; "
    "host-trusted files are checked after the run and put back"
)


class Stage:
    """What stage() made for a run: its layer and the host roots' handles."""

    def __init__(self, layer: layers.Layer, targets: list[staging.Target], review: bool) -> None:
        self.layer = layer
        self.targets = targets
        self.review = review

    def close(self) -> None:
        layers.close_roots(self.targets)
        self.targets = []
        self.layer.close()


def staged_roots(writable: Sequence[str]) -> list[str]:
    """The writable directories to stage: each existing directory not inside another one."""
    real = [os.path.realpath(p) for p in writable]
    dirs = [p for p in dict.fromkeys(real) if os.path.isdir(p)]
    return [p for p in dirs if not any(o != p and is_under(p, o) for o in dirs)]


def rules_for(
    root: str, *, own: Sequence[str], lifted: Sequence[str], git_dirs: Sequence[str]
) -> staging.Rules:
    def rel(paths: Sequence[str]) -> tuple[tuple[str, ...], ...]:
        found = []
        for path in paths:
            real = os.path.realpath(path)
            if is_under(real, root) and real != root:
                found.append(tuple(os.path.relpath(real, root).split("/")))
        return tuple(dict.fromkeys(found))

    return staging.Rules(rel(own), rel(lifted), root in git_dirs)


def stage(
    roots: Sequence[str],
    *,
    own: Sequence[str],
    lifted: Sequence[str],
    git_dirs: Sequence[str],
    argv: Sequence[str],
    cwd: str,
    review: bool,
    home: str,
    owner: tuple[int, int] | None = None,
) -> Stage:
    """The run's layer and handles on its roots (taken now, before the child starts);
    `owner` (run --user) gets what the apply creates."""
    chosen = [(r, rules_for(r, own=own, lifted=lifted, git_dirs=git_dirs)) for r in roots]
    layer = layers.create(chosen, home=home, argv=argv, cwd=cwd, review=review, writable=roots)
    try:
        targets = [t._replace(owner=owner) for t in layers.open_roots(layer)]
        if owner is not None:
            _give_uppers(layer, targets, owner)
    except BaseException:
        layers.discard(layer)
        raise
    return Stage(layer, targets, review)


def _give_uppers(
    layer: layers.Layer, targets: Sequence[staging.Target], owner: tuple[int, int]
) -> None:
    """run --user: overlayfs shows each upper's top directory as the root's own, so it is
    NAME's (the command writes there as NAME; the layer's directory stays root's, 0700)."""
    for target in targets:
        fd = layer.open_upper(target.number)
        try:
            os.fchown(fd, *owner)
        finally:
            os.close(fd)


def abandon(stage_: Stage | None) -> None:
    """The run never started: its layer goes."""
    if stage_ is not None:
        layers.close_roots(stage_.targets)
        layers.discard(stage_.layer)


class Staging(Protocol):
    """What finish() reads of a prepared run (runner/assemble.py's Prepared has it)."""

    workspace: str
    workspace_detail: str
    stage: Stage | None


def finish(prepared: Staging, result: RunResult) -> None:
    """Apply the run's layer to the host (or keep it, --review) and record what happened."""
    result.workspace, result.workspace_detail = prepared.workspace, prepared.workspace_detail
    stage_ = prepared.stage
    try:
        if stage_ is not None:
            prepared.stage = None
            _apply(stage_, result)
    finally:
        full = Enforcement.FULL if result.workspace == STAGED else Enforcement.NONE
        row = MechanismReport("workspace", full, f"{result.workspace}: {result.workspace_detail}")
        result.report = [*result.report, row]


def _apply(stage_: Stage, result: RunResult) -> None:
    layer = stage_.layer
    result.layer = layer.run
    try:
        if stage_.review:
            layer.set_state(layers.PENDING)
            result.workspace_detail = "kept for review (--review): nothing applied"
            return
        outcome = layers.apply(layer, stage_.targets)
        result.applied, result.held = outcome.applied, outcome.held
        result.apply_failed, result.apply_skipped = outcome.failed, outcome.skipped
        if layer.fd < 0:
            result.layer = ""  # applied whole: the layer is gone
    except (OSError, layers.LayerError) as exc:
        result.apply_failed.append((layer.path, str(exc)))
        with contextlib.suppress(OSError):
            layer.set_state(layers.FAILED)
    finally:
        stage_.close()


def recover(home: str, cwd: str) -> list[str]:
    """Finish what an earlier apply of this workspace left half done; say so in the returned
    lines. Runs whose `run` died before applying stay pending and are named."""
    lines: list[str] = []
    try:
        found = layers.for_workspace(home, cwd)
    except layers.LayerError:
        return lines
    for layer in found:
        try:
            state = layer.state
            if state == layers.APPLYING:
                targets = layers.open_roots(layer)
                try:
                    layers.apply(layer, targets)
                finally:
                    layers.close_roots(targets)
                lines.append(f"finished applying run {layer.run}, which was interrupted")
            elif state == layers.RUNNING and not _alive(layer.run):
                layer.set_state(layers.PENDING)
                lines.append(
                    f"run {layer.run} ended before its changes were applied: "
                    f"egressbox changes {layer.run}, then apply or discard"
                )
        except (OSError, layers.LayerError) as exc:
            lines.append(f"run {layer.run}: {exc}")
        finally:
            layer.close()
    return lines


def _alive(run: str) -> bool:
    """Whether the `run` process that made the layer may still be running (its pid)."""
    pid = run.rsplit("-", 1)[-1]
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


def report_lines(result: RunResult) -> list[str]:
    """What the run's stderr says about its way back (held entries, failures, the command)."""
    lines = [f"held back: {c.path} ({c.held})" for c in result.held]
    lines += [f"not applied: {path}: {why}" for path, why in result.apply_failed]
    lines += [f"not applied: {c.path} (a {c.kind}: never applied)" for c in result.apply_skipped]
    if result.layer and result.workspace_detail.startswith("kept for review"):
        lines.append(
            f"the command's changes are staged in run {result.layer}: egressbox changes "
            f"{result.layer}, then egressbox apply {result.layer} or egressbox discard "
            f"{result.layer}"
        )
    elif result.held:
        lines.append(
            f"{len(result.held)} held back in run {result.layer} (kept, not applied): apply one "
            f"on purpose with egressbox apply {result.layer} PATH; egressbox changes "
            f"{result.layer} lists them, egressbox discard {result.layer} drops them"
        )
    return lines


def find_run(run: str | None, cwd: str, home: str | None = None) -> layers.Layer:
    """The run named, else the latest staged run of the workspace that holds `cwd`."""
    home = home or layers.state_home()
    if run:
        for layer in layers.all_layers(home):
            if layer.run == run:
                return layer
            layer.close()
        raise layers.LayerError(f"no staged run {run} (egressbox changes lists them)")
    found = layers.for_workspace(home, cwd)
    if not found:
        raise layers.LayerError(f"no staged run for {cwd} (egressbox changes lists them)")
    for layer in found[:-1]:
        layer.close()
    return found[-1]


def selection_for(
    layer: layers.Layer, paths: Sequence[str], cwd: str, *, include_held: bool
) -> dict[int, staging.Selection] | None:
    """PATH arguments (absolute, or relative to `cwd`) as parts below each of the layer's
    roots, by root number; None: every entry (held ones with `include_held`)."""
    if not paths:
        return dict.fromkeys(range(len(layer.roots)), staging.Selection((), include_held))
    chosen: dict[int, list[tuple[str, ...]]] = {}
    roots = [r.path for r in layer.roots]
    for text in paths:
        path = os.path.normpath(os.path.join(cwd, text))
        number = next((i for i, r in enumerate(roots) if is_under(path, r)), None)
        if number is None:
            raise layers.LayerError(f"{text} is outside the roots of run {layer.run}")
        rel = os.path.relpath(path, roots[number])
        chosen.setdefault(number, []).append(() if rel == "." else tuple(rel.split("/")))
    return {i: staging.Selection(tuple(p), include_held) for i, p in chosen.items()}
