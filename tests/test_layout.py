"""The package layout holds: every module imports on its own, no import cycle, the command
line imported by nothing, the public names are what the README shows whatever loads first, and
the tests mirror the source tree."""

from __future__ import annotations

import ast
import importlib.util
import os
import runpy
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest


def _package_dir() -> Path:
    spec = importlib.util.find_spec("egressbox")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def _modules() -> dict[str, Path]:
    root = _package_dir()
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts).removesuffix(".__init__")
        found[name] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The egressbox modules a file imports (at module level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            found |= {s for s in subs if s in modules}
            if len([s for s in subs if s in modules]) < len(subs):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_command_line_is_imported_by_nothing() -> None:
    importers = sorted(
        name
        for name, deps in _graph().items()
        if any(d == "egressbox.cli" or d.startswith("egressbox.cli.") for d in deps)
        and not (name == "egressbox.cli" or name.startswith("egressbox.cli."))
        and name != "egressbox.__main__"
    )
    assert importers == []


# __main__ runs the command line when imported.
@pytest.mark.parametrize("module", sorted(set(_modules()) - {"egressbox.__main__"}))
def test_every_module_imports_on_its_own(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]


README_WAY = """
import asyncio, inspect
{first}
from egressbox import EgressProxy, load_policy, run, run_sync, spawn_confined, RunResult
assert inspect.iscoroutinefunction(run), run
assert inspect.iscoroutinefunction(spawn_confined), spawn_confined
assert callable(run_sync) and not inspect.iscoroutinefunction(run_sync)
import egressbox
assert egressbox.run is run and callable(egressbox.run)
"""


@pytest.mark.parametrize(
    "first",
    ["pass", "import egressbox.runner.api", "import egressbox.cli.run", "import egressbox.runner"],
)
def test_the_readme_names_are_the_functions_whatever_loads_first(first: str) -> None:
    code = README_WAY.format(first=first)
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]


TESTS = Path(__file__).resolve().parent


def test_the_test_tree_mirrors_the_source_tree() -> None:
    """tests/<package>/ holds the tests of egressbox.<package>: a test directory
    names a package of the source, and no test sits in a directory of its own."""
    packages = {p.name for p in _package_dir().iterdir() if (p / "__init__.py").exists()}
    test_dirs = {
        p.name
        for p in TESTS.iterdir()
        if p.is_dir() and p.name != "__pycache__" and any(p.glob("test_*.py"))
    }
    assert test_dirs <= packages, f"test directories with no package: {test_dirs - packages}"
    stray = [p for p in TESTS.rglob("test_*.py") if p.parent != TESTS and p.parent.parent != TESTS]
    assert not stray, f"tests nested deeper than tests/<package>/: {stray}"


# The floor plan: which package may import which. A package imports its own modules and those
# of the floors below it; the command line may import anything and nothing imports it. fs (the
# files the host writes or trusts, opened from held directories) sits beside core: it is I/O,
# so not in the pure core, and the audit sink, the caches and the approvals file all use it.
FLOORS: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "fs": frozenset({"core"}),
    "protocols": frozenset({"core"}),
    "net": frozenset({"core"}),
    "audit": frozenset({"core", "fs"}),
    "confine": frozenset({"core", "fs"}),
    "proxy": frozenset({"core", "fs", "protocols", "net", "audit"}),
    "serve": frozenset({"core", "fs", "protocols", "net", "audit", "confine", "proxy"}),
    "runner": frozenset({"core", "fs", "protocols", "net", "audit", "confine", "proxy"}),
    "cli": frozenset(
        {"core", "fs", "protocols", "net", "audit", "confine", "proxy", "serve", "runner"}
    ),
}
TOP = frozenset({"egressbox", "egressbox.__main__"})


def _floor(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and module not in TOP else None


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up or sideways against FLOORS, as "importer -> imported"."""
    found = []
    for name, deps in sorted(graph.items()):
        floor = _floor(name)
        if floor is None:
            continue
        for dep in sorted(deps):
            other = _floor(dep)
            if dep == "egressbox" and floor == "cli":
                continue  # the command line is a shell over the library's public names
            if other is None or (other != floor and other not in FLOORS[floor]):
                found.append(f"{name} -> {dep}")
    return found


def test_every_module_lives_on_a_floor() -> None:
    loose = sorted(n for n in _modules() if n not in TOP and _floor(n) not in FLOORS)
    assert loose == [], f"modules outside the floors of FLOORS: {loose}"


def test_imports_follow_the_floor_plan() -> None:
    assert wrong_way(_graph()) == []


def test_the_floor_plan_test_catches_a_wrong_way_import() -> None:
    graph = {k: set(v) for k, v in _graph().items()}
    graph["egressbox.core.hosts"].add("egressbox.proxy.gate")
    graph["egressbox.net.dial"].add("egressbox.confine.grants")
    assert wrong_way(graph) == [
        "egressbox.core.hosts -> egressbox.proxy.gate",
        "egressbox.net.dial -> egressbox.confine.grants",
    ]


# The compiled set and the pure set are named by package: each package's __init__.py
# declares COMPILED (its modules mypyc builds) and, for a pure floor, PURE = True.
SETUP = TESTS.parent / "setup.py"


def _setup_compiled_modules() -> list[str]:
    """setup.py's own list, run under another name than __main__ (so setup() is not called),
    the way scripts/setup reads it."""
    found = runpy.run_path(str(SETUP), run_name="egressbox_setup")["COMPILED"]
    assert isinstance(found, list)
    return [str(path) for path in found]


def _packages() -> list[str]:
    return sorted(p.name for p in _package_dir().iterdir() if (p / "__init__.py").exists())


def _declared_compiled() -> set[str]:
    """egressbox.<package>.<module> for every module a package's COMPILED names."""
    import importlib

    found = set()
    for package in _packages():
        names = getattr(importlib.import_module(f"egressbox.{package}"), "COMPILED", ())
        found |= {f"egressbox.{package}.{name}" for name in names}
    return found


def test_setup_compiles_what_the_packages_declare() -> None:
    built = {".".join(Path(path).with_suffix("").parts[1:]) for path in _setup_compiled_modules()}
    assert built == _declared_compiled()
    assert built, "setup.py found no declaration: the compiled core would be empty"


def test_every_compiled_module_exists_below_the_command_line() -> None:
    modules = _modules()
    missing = sorted(name for name in _declared_compiled() if name not in modules)
    assert missing == [], f"COMPILED names modules that do not exist: {missing}"
    # The per-connection path: the floors the proxy stands on, and the proxy itself.
    allowed = FLOORS["proxy"] | {"proxy"}
    assert sorted(n for n in _declared_compiled() if _floor(n) not in allowed) == []


def test_the_compiled_modules_are_the_ones_built() -> None:
    """With the core compiled, exactly the declared modules are extensions."""
    import egressbox

    if not egressbox.compiled_core() or os.environ.get(egressbox.PURE_ENV) == "1":
        pytest.skip("the proxy core runs interpreted here")
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    module = importlib.import_module(name)\n"
        "    if not (module.__file__ or '').endswith('.py'): print(name)\n"
    )
    # egressbox.__main__ runs the command line when imported: never compiled, never imported.
    names = sorted(name for name in _modules() if name != "egressbox.__main__")
    done = subprocess.run(
        [sys.executable, "-c", code, *names],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert set(done.stdout.split()) == _declared_compiled()


def _declared_pure() -> set[str]:
    import importlib

    return {
        p for p in _packages() if getattr(importlib.import_module(f"egressbox.{p}"), "PURE", False)
    }


def test_the_pure_set_is_named_by_package_and_stands_on_pure_floors() -> None:
    from test_imports import PURE_PACKAGES

    pure = _declared_pure()
    assert set(PURE_PACKAGES) == pure
    # A pure floor may import only pure floors: else its purity would depend on luck.
    assert sorted(p for p in pure if not FLOORS[p] <= pure) == []


# Module-level mutable state of the compiled (per-connection) modules: what each connection
# owns lives on the connection; these are process-wide by nature, each with why.
PROCESS_WIDE = {
    "egressbox.audit.record._host_json": "a host's JSON text, for the names met over and over",
    "egressbox.audit.record._last_second": "the clock's current second as text, one per process",
    "egressbox.audit.record._line_tails": "an audit line's tail for the same few destinations",
    "egressbox.net.deadlines._WHEELS": "one timer wheel per event loop",
    "egressbox.net.dial._IP_TEXTS": "an address's text, for the few addresses dialled again",
    "egressbox.net.relay._default_pool": "the pipes splice() borrows, one pool per process",
    "egressbox.protocols.socks5._BIND_TEXTS": "the packed form of the server's own addresses",
    "egressbox.proxy.check._memo": "decisions keyed by policy, endpoints and DNS entry",
}
_MUTATORS = frozenset(
    {"append", "add", "update", "pop", "clear", "setdefault", "remove", "discard", "extend"}
)


def _mutated_globals(path: Path) -> set[str]:
    """The top-level names of a module that its code mutates in place (item assignment,
    deletion, a mutating method) or rebinds through `global`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set()
    for statement in tree.body:
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if isinstance(statement, ast.AnnAssign):
            targets = [statement.target]
        top |= {t.id for t in targets if isinstance(t, ast.Name)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found |= set(node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if isinstance(owner, ast.Name) and node.func.attr in _MUTATORS:
                found.add(owner.id)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = [node.target] if isinstance(node, ast.AugAssign) else node.targets
            found |= {
                t.value.id
                for t in targets
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
            }
    return found & top


def test_the_compiled_modules_keep_no_per_connection_state_at_module_level() -> None:
    modules = _modules()
    found = {
        f"{name}.{binding}"
        for name in _declared_compiled()
        for binding in _mutated_globals(modules[name])
    }
    assert sorted(found - set(PROCESS_WIDE)) == []
    assert sorted(set(PROCESS_WIDE) - found) == [], "PROCESS_WIDE names state that is gone"


# -- an import inside a function defers a load, or it is at the top -------------------------
# A function-level import is a start-up trick (a module the common path never needs, loaded
# when first used) or keeps a forked launcher light; one of a module that its own module-level
# imports load anyway defers nothing, and only hides what the module depends on.


def _names_loaded(node: ast.Import | ast.ImportFrom, modules: Iterable[str]) -> set[str]:
    """The modules an import statement loads: each named one with its parent packages."""
    named = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    if isinstance(node, ast.ImportFrom):
        named += [f"{node.module}.{a.name}" for a in node.names]
    loaded = set()
    for name in named:
        if isinstance(node, ast.ImportFrom) and name != node.module and name not in modules:
            continue  # a name from the module, not a submodule
        parts = name.split(".")
        loaded |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return loaded


def _top_imports(tree: ast.Module, modules: Iterable[str]) -> set[str]:
    """What a module's own import loads, by its unconditional module-level imports (a try
    block's body counts; `if TYPE_CHECKING` and other conditions do not)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for statement in body:
            if isinstance(statement, ast.Import | ast.ImportFrom) and not getattr(
                statement, "level", 0
            ):
                found.update(_names_loaded(statement, modules))
            elif isinstance(statement, ast.Try):
                visit(statement.body)

    visit(tree.body)
    return found


def pointless_lazy_imports(sources: dict[str, str]) -> list[str]:
    """`module:line target` for each import inside a function of a module already loaded
    when that module is imported (its own top-level imports, followed through ours)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    tops = {name: _top_imports(tree, sources) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        parts = name.split(".")
        loaded = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        todo = list(loaded)
        while todo:
            for target in tops.get(todo.pop(), ()):
                if target not in loaded:
                    loaded.add(target)
                    todo.append(target)
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                    wanted = _names_loaded(node, sources)
                    if wanted <= loaded:
                        found.append(f"{name}:{node.lineno} {max(wanted, key=len)}")
    return sorted(found)


def test_an_import_inside_a_function_defers_a_load() -> None:
    sources = {name: path.read_text(encoding="utf-8") for name, path in _modules().items()}
    assert pointless_lazy_imports(sources) == []


def test_a_lazy_import_that_defers_nothing_is_found() -> None:
    sources = {
        "egressbox": "",
        "egressbox.a": "import json\nfrom egressbox import b\n",
        "egressbox.b": "import re\n",
        "egressbox.c": "",
        "egressbox.d": "if TYPE_CHECKING:\n    import zlib\n",
    }
    sources["egressbox.a"] += (
        "def f():\n    import json\n    import re\n    from egressbox import c\n"
        "    from egressbox.b import X\n    import zlib\n"
    )
    assert pointless_lazy_imports(sources) == [
        "egressbox.a:4 json",
        "egressbox.a:5 re",
        "egressbox.a:7 egressbox.b",
    ]
