"""`egressbox apply [RUN] [PATH...] [--include-held]`: a staged run's layer through the gate."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from egressbox.core.exitcodes import EXIT_OK, EXIT_RUNTIME

EXAMPLES = """\
examples:
  egressbox apply                        # the latest staged run of this workspace
  egressbox apply 20250101-120000-4242 src/ build/output.bin
  egressbox apply 20250101-120000-4242 .git/hooks/pre-commit   # one held path, on purpose
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "apply",
        help="apply a staged run's changes to the host (held-back paths only when named)",
        description="Apply RUN's layer (default: the latest staged run of the current "
        "directory's workspace) to the host through the same gate as at a run's end: files "
        "renamed into place, directories made, deletions done, never through a symlink on "
        "the host. Paths held back as host-trusted are applied only when named as PATH or "
        "with --include-held, with a warning. PATH limits the apply to what lies at or below "
        "it. An apply interrupted earlier is finished first.",
        epilog=EXAMPLES,
    )
    p.add_argument("run", nargs="?", metavar="RUN", help="the run's id (default: the latest)")
    p.add_argument("paths", nargs="*", metavar="PATH", help="apply only these (and below)")
    p.add_argument(
        "--include-held",
        action="store_true",
        help="apply the held-back paths too (git hooks and config, shell start-up files...)",
    )


def main(args: argparse.Namespace) -> int:
    from egressbox.runner import gate, layers

    cwd = os.path.realpath(os.getcwd())
    home = layers.state_home()
    run, paths = args.run, list(args.paths)
    if run and ("/" in run or os.path.lexists(run)):
        run, paths = None, [run, *paths]  # a PATH, not a run id
    for line in gate.recover(home, cwd):
        _say(line)
    try:
        layer = gate.find_run(run, cwd, home)
    except layers.LayerError as exc:
        _say(f"apply: {exc}")
        return EXIT_RUNTIME
    try:
        selections = gate.selection_for(layer, paths, cwd, include_held=args.include_held)
        targets = layers.open_roots(layer)
        try:
            outcome = layers.apply(layer, targets, selections)
        finally:
            layers.close_roots(targets)
    except (OSError, layers.LayerError) as exc:
        _say(f"apply: run {layer.run}: {exc}")
        layer.close()
        return EXIT_RUNTIME
    gone = layer.fd < 0
    layer.close()
    for change in outcome.applied:
        if change.held:
            _say(f"warning: applied a host-trusted path on request: {change.path} ({change.held})")
    for change in outcome.held:
        _say(f"held back: {change.path} ({change.held})")
    for path, why in outcome.failed:
        _say(f"not applied: {path}: {why}")
    left = "; the layer is gone" if gone else f"; what is left stays in run {layer.run}"
    _say(f"applied {len(outcome.applied)} change(s) from run {layer.run}{left}")
    return EXIT_RUNTIME if outcome.failed else EXIT_OK


def _say(line: str) -> None:
    print(f"egressbox: {line}", file=sys.stderr)
