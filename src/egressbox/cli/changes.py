"""`egressbox changes [RUN]`: what a staged run left in its layer, held entries marked."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from egressbox.core.exitcodes import EXIT_OK, EXIT_RUNTIME

EXAMPLES = """\
examples:
  egressbox run --review -- make         # stage everything, apply nothing
  egressbox changes                      # the latest staged run of this workspace
  egressbox changes 20250101-120000-4242 --json
"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "changes",
        help="list a staged run's changes (added, modified, deleted; held back marked)",
        description="List the staged runs of the current directory's workspace, then the "
        "changes of RUN (default: the latest): added, modified, replaced and deleted paths, "
        "and those held back (host-trusted: git control files, in a new repository too, a "
        "replaced .git, shell start-up "
        "files, .envrc, .vscode, .idea, egressbox's own) with the reason. Nothing is changed, "
        "except that an apply interrupted earlier is finished first.",
        epilog=EXAMPLES,
    )
    p.add_argument("run", nargs="?", metavar="RUN", help="the run's id (default: the latest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    from egressbox.runner import gate, layers

    cwd = os.path.realpath(os.getcwd())
    home = layers.state_home()
    for line in gate.recover(home, cwd):
        print(f"egressbox: {line}", file=sys.stderr)
    try:
        layer = gate.find_run(args.run, cwd, home)
    except layers.LayerError as exc:
        print(f"egressbox changes: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    try:
        targets = layers.open_roots(layer)
        try:
            outcome = layers.changes(layer, targets)
        finally:
            layers.close_roots(targets)
        state = layer.state
    except (OSError, layers.LayerError) as exc:
        print(f"egressbox changes: run {layer.run}: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        layer.close()
    entries = [
        *({"path": c.path, "action": c.action, "kind": c.kind} for c in outcome.applied),
        *(
            {"path": c.path, "action": c.action, "kind": c.kind, "held": c.held}
            for c in outcome.held
        ),
        *({"path": c.path, "action": "skipped", "kind": c.kind} for c in outcome.skipped),
    ]
    entries.sort(key=lambda e: e["path"])
    if args.json:
        data = {
            "run": layer.run,
            "state": state,
            "argv": layer.meta.get("argv", []),
            "changes": entries,
        }
        print(json.dumps(data))
        return EXIT_OK
    argv = " ".join(layer.meta.get("argv", []))
    print(f"run {layer.run} ({state}): {argv}")
    for entry in entries:
        held = f"  [held: {entry['held']}]" if "held" in entry else ""
        print(f"  {entry['action']:<9} {entry['path']}{held}")
    if not entries:
        print("  (no changes)")
    return EXIT_OK
