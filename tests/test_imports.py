"""The pure modules stay pure: no event loop, sockets, threads or processes (DESIGN §2).

Checked twice: statically, by reading every import statement of the source
(including imports inside functions), and at runtime, by importing each module
in a fresh interpreter and looking at sys.modules.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

FORBIDDEN = frozenset({"asyncio", "socket", "selectors", "ssl", "subprocess", "threading"})
# Their C halves count too: `import _socket` is `import socket` in disguise.
FORBIDDEN_ALIASES = frozenset(
    {"_asyncio", "_socket", "_ssl", "_posixsubprocess", "_thread", "_overlapped"}
)


def _package_dir() -> Path:
    # find_spec does not execute the package; it finds what `import` would load.
    spec = importlib.util.find_spec("egressbox")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def _declares_pure(init: Path) -> bool:
    """Whether a package's __init__.py says `PURE = True` (read, not imported)."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "PURE" for t in node.targets)
            and isinstance(node.value, ast.Constant)
        ):
            return node.value.value is True
    return False


# The pure floors, whole, as their packages declare them (the core and the sans-IO
# protocol parsers). Plus, of confine: the refusal classifier, and the planning of a run's
# confinement with the launcher's plan it makes (confine/face.py's pure half: it reads and
# makes nothing, and must not even load what could).
PURE_PACKAGES = tuple(
    sorted(p.parent.name for p in _package_dir().glob("*/__init__.py") if _declares_pure(p))
)
PURE_EXTRA = ("confine.planning", "confine.refusal", "confine.spec")


def _pure_files() -> list[Path]:
    package = _package_dir()
    files = [package / f"{name.replace('.', '/')}.py" for name in PURE_EXTRA]
    for floor in PURE_PACKAGES:
        files += sorted((package / floor).rglob("*.py"))
    # Importing any of them first runs the package's __init__.
    files.append(package / "__init__.py")
    return files


def _file_id(path: Path) -> str:
    return path.relative_to(_package_dir()).as_posix()


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every absolute module name an import statement (or a literal
    importlib.import_module / __import__ call) names, with its line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            first = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                found.append((node.lineno, first.value))
    return found


def _is_forbidden(module: str) -> bool:
    # `asyncio`, `asyncio.events`, `_socket`: the top-level package decides.
    return module.split(".", maxsplit=1)[0] in FORBIDDEN | FORBIDDEN_ALIASES


@pytest.mark.parametrize("path", _pure_files(), ids=_file_id)
def test_pure_module_imports_no_io_machinery(path: Path) -> None:
    assert path.is_file(), f"{path} is missing"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    bad = [
        f"line {line}: {module}"
        for line, module in _imported_modules(tree)
        if _is_forbidden(module)
    ]
    assert not bad, f"{_file_id(path)} imports I/O machinery: {bad}"


def test_the_scanner_sees_every_spelling() -> None:
    source = "\n".join(
        [
            "import asyncio",
            "import os, socket as s",
            "import asyncio.events",
            "from selectors import DefaultSelector",
            "from ssl import create_default_context",
            "def f():",
            "    import subprocess",
            "    from threading import Thread",
            "    import _socket",
            "    importlib.import_module('asyncio')",
            "    __import__('ssl')",
            "import os.path",
            "from collections import abc",
        ]
    )
    modules = [m for _, m in _imported_modules(ast.parse(source))]
    forbidden = sorted({m.split(".")[0] for m in modules if _is_forbidden(m)})
    assert forbidden == [
        "_socket",
        "asyncio",
        "selectors",
        "socket",
        "ssl",
        "subprocess",
        "threading",
    ]
    assert not _is_forbidden("os.path")
    assert not _is_forbidden("collections.abc")


def _runtime_modules() -> list[str]:
    package = _package_dir()
    names = [f"egressbox.{name}" for name in PURE_EXTRA]
    paths = [p for floor in PURE_PACKAGES for p in sorted((package / floor).rglob("*.py"))]
    for path in paths:
        relative = path.relative_to(package).with_suffix("")
        parts = [p for p in relative.parts if p != "__init__"]
        names.append(".".join(["egressbox", *parts]))
    return names


# Checked in a fresh interpreter. `threading` is left out on purpose: the
# harmless `logging` imports it, and the static scan above already forbids
# importing it directly.
RUNTIME_FORBIDDEN = ("asyncio", "socket", "selectors", "ssl", "subprocess")

_PROBE = """
import importlib, json, sys
before = set(sys.modules)
importlib.import_module(sys.argv[1])
print(json.dumps({"before": sorted(before), "after": sorted(sys.modules)}))
"""


@pytest.mark.parametrize("module", _runtime_modules())
def test_importing_a_pure_module_loads_no_io_machinery(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, module],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    before, after = set(loaded["before"]), set(loaded["after"])
    # If the interpreter itself started with one of them, this test would be blind.
    assert not before & set(RUNTIME_FORBIDDEN), sorted(before & set(RUNTIME_FORBIDDEN))
    leaked = sorted(after & set(RUNTIME_FORBIDDEN))
    assert not leaked, f"importing {module} loads {leaked}"
    assert module in after


def test_decide_leaves_asyncio_and_socket_unloaded() -> None:
    # DESIGN §2 in its plainest form, for the module that pulls in all the others.
    code = (
        "import sys, egressbox.core.decide; "
        "print(','.join(m for m in ('asyncio', 'socket') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
