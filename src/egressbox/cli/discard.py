"""`egressbox discard [RUN]`: drop a staged run's layer, applying nothing."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from egressbox.core.exitcodes import EXIT_OK, EXIT_RUNTIME

EXAMPLES = """\
examples:
  egressbox discard                      # the latest staged run of this workspace
  egressbox discard 20250101-120000-4242
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "discard",
        help="drop a staged run's changes (nothing of it reaches the host)",
        description="Remove RUN's layer (default: the latest staged run of the current "
        "directory's workspace), held-back entries included; the host's files stay as they "
        "are.",
        epilog=EXAMPLES,
    )
    p.add_argument("run", nargs="?", metavar="RUN", help="the run's id (default: the latest)")


def main(args: argparse.Namespace) -> int:
    from egressbox.runner import gate, layers

    cwd = os.path.realpath(os.getcwd())
    try:
        layer = gate.find_run(args.run, cwd)
    except layers.LayerError as exc:
        print(f"egressbox discard: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    run = layer.run
    try:
        with layers.locked(layer):
            layers.discard(layer)
    except OSError as exc:
        print(f"egressbox discard: run {run}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_RUNTIME
    print(f"egressbox: discarded run {run}", file=sys.stderr)
    return EXIT_OK
