"""The static call path from an entry point: how often it changes file, comes back, climbs.

    python benchmarks/walk.py [--src SRC] [--depth N] [--show] ENTRY...

ENTRY is a function by its dotted path (``egressbox.runner.api.run_options_sync``, or a method
as ``egressbox.proxy.tunnel.Tunnel.start``; a module whose name moved may be given by its old
or new name when the tree has it). The walk reads the sources with `ast` (nothing is imported)
and follows, depth first, every call it can resolve by name: a function of the same module, a
name imported from another egressbox module, ``module.name`` through an imported module (a
name that module only re-exports, as confine/face.py does, is followed to where it is
defined: no frame of the face's runs between), and ``self.method`` inside a class. Calls it
cannot resolve (methods of objects, callbacks) are not followed: the walk is a lower bound of
the real path, the same rule for every tree.

Figures, over the sequence of files the walk is in (each call enters a file, each return goes
back to the caller's):
  stays     maximal runs of steps in one file (a file entered, left, entered again: 2 stays)
  files     distinct files
  returns   stays in a file that had a stay before (coming back to a file)
  climbs    calls from a package to one above it in the floor plan (tests/test_layout.py
            FLOORS; the top floor is cli), i.e. against the direction imports should go
  borders   calls that cross from one package to another
Run it on two trees (``--src``) to compare a restructuring.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

# Lowest floor first (tests/test_layout.py FLOORS, flattened); unknown packages rank by name.
FLOOR_ORDER = ("core", "fs", "protocols", "net", "audit", "confine", "proxy", "serve", "runner")
TOP = "cli"
# Re-exports followed to a definition, at most (a face re-exports a module's name once).
REEXPORT_HOPS = 4


class Function:
    def __init__(self, module: str, qual: str, node: ast.AST, cls: str | None) -> None:
        self.module = module
        self.qual = qual
        self.node = node
        self.cls = cls


class Tree:
    """Every module of one source tree: its functions and what its names refer to."""

    def __init__(self, src: Path) -> None:
        self.functions: dict[str, Function] = {}
        self.names: dict[str, dict[str, str]] = {}  # module -> local name -> dotted target
        self.files: dict[str, str] = {}
        root = src / "egressbox"
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            module = ".".join(parts).removesuffix(".__init__")
            self.files[module] = str(path.relative_to(src))
            self._read(module, ast.parse(path.read_text(encoding="utf-8")))

    def _read(self, module: str, tree: ast.Module) -> None:
        names: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    names[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0]
                    )
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self._add(module, node.name, node, None)
                names.setdefault(node.name, f"{module}.{node.name}")
            elif isinstance(node, ast.ClassDef):
                names.setdefault(node.name, f"{module}.{node.name}")
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        self._add(module, f"{node.name}.{item.name}", item, node.name)
        self.names[module] = names

    def _add(self, module: str, qual: str, node: ast.AST, cls: str | None) -> None:
        self.functions[f"{module}.{qual}"] = Function(module, qual, node, cls)

    def resolve(self, fn: Function, call: ast.Call) -> str | None:
        names = self.names[fn.module]
        target = call.func
        if isinstance(target, ast.Name):
            dotted = names.get(target.id)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            base = target.value.id
            if base == "self" and fn.cls is not None:
                dotted = f"{fn.module}.{fn.cls}.{target.attr}"
            else:
                module = names.get(base)
                dotted = f"{module}.{target.attr}" if module else None
        else:
            dotted = None
        if dotted is None:
            return None
        dotted = self._defined(dotted)
        if dotted in self.functions:
            return dotted
        init = f"{dotted}.__init__"  # a class called: its constructor
        return init if init in self.functions else None

    def _defined(self, dotted: str) -> str:
        """Where a name a module only imports (a face's re-export) is defined: the call runs
        there, no frame of the re-exporting module between."""
        for _ in range(REEXPORT_HOPS):
            if dotted in self.functions or f"{dotted}.__init__" in self.functions:
                break
            module, _, attr = dotted.rpartition(".")
            target = self.names.get(module, {}).get(attr)
            if target is None or target == dotted:
                break
            dotted = target
        return dotted

    def calls(self, fn: Function) -> Iterator[str]:
        for node in ast.walk(fn.node):
            if isinstance(node, ast.Call):
                found = self.resolve(fn, node)
                if found is not None:
                    yield found


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "(top)"


def rank(pkg: str) -> int:
    if pkg == TOP:
        return len(FLOOR_ORDER) + 1
    return FLOOR_ORDER.index(pkg) if pkg in FLOOR_ORDER else len(FLOOR_ORDER)


def walk(tree: Tree, entry: str, depth: int) -> tuple[list[str], int, int]:
    """The files in order as the walk enters and leaves them; climbs; border crossings."""
    seen: set[str] = set()
    steps: list[str] = []
    climbs = borders = 0

    def visit(name: str, level: int) -> None:
        nonlocal climbs, borders
        fn = tree.functions[name]
        seen.add(name)
        steps.append(tree.files[fn.module])
        if level >= depth:
            return
        for callee in tree.calls(fn):
            if callee in seen:
                continue
            other = tree.functions[callee].module
            if package(other) != package(fn.module):
                borders += 1
                if rank(package(other)) > rank(package(fn.module)):
                    climbs += 1
            visit(callee, level + 1)
            steps.append(tree.files[fn.module])  # back in the caller's file

    visit(entry, 0)
    return steps, climbs, borders


def figures(steps: list[str]) -> dict[str, int]:
    stays: list[str] = []
    for file in steps:
        if not stays or stays[-1] != file:
            stays.append(file)
    returns = len(stays) - len(set(stays))
    return {"stays": len(stays), "files": len(set(stays)), "returns": returns}


def find(tree: Tree, entry: str) -> str:
    if entry in tree.functions:
        return entry
    tail = entry.split(".")[-2:]
    matches = [n for n in tree.functions if n.split(".")[-len(tail) :] == tail]
    if len(matches) == 1:
        return matches[0]
    raise SystemExit(f"walk: {entry} not found (candidates: {matches[:5]})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("entries", nargs="+", metavar="ENTRY")
    parser.add_argument("--src", action="append", default=None, help="a tree's src/ (repeat)")
    parser.add_argument("--depth", type=int, default=12, help="calls deep, at most (12)")
    parser.add_argument("--show", action="store_true", help="print the stays in order")
    args = parser.parse_args()
    sources = args.src or [str(Path(__file__).resolve().parents[1] / "src")]
    for src in sources:
        tree = Tree(Path(src))
        for entry in args.entries:
            name = find(tree, entry)
            steps, climbs, borders = walk(tree, name, args.depth)
            row = figures(steps) | {"climbs": climbs, "borders": borders}
            cells = "  ".join(f"{k} {v}" for k, v in row.items())
            print(f"{src}: {name}: {cells}")
            if args.show:
                last = ""
                for file in steps:
                    if file != last:
                        print(f"    {file}")
                    last = file
    return 0


if __name__ == "__main__":
    sys.exit(main())
