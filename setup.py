"""Build egressbox, with its proxy core compiled by mypyc when it can be.

The modules below are plain, typed Python (mypy --strict) that mypyc turns
into C extensions: the same code, about a fifth less CPU per short tunnel and
half as much per plain-HTTP request (benchmarks/README.md). Everything else
stays interpreted. Set EGRESSBOX_COMPILE=0 for a pure-Python build; without a
C compiler or the Python headers the build falls back to pure Python and says
so (`egressbox doctor` shows which one is installed).

The compile takes about two minutes on 2 cores, during which pip shows nothing of
a build's output unless it fails (or with `pip install -v`): so the two steps say
so on the terminal itself (/dev/tty) when there is one, as well as on stderr.
"""

from __future__ import annotations

import ast
import contextlib
import os
import sys
import time
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The per-connection path (parsers, decisions, dialling, relay, server), named by each
# package of src/egressbox in its __init__.py: `COMPILED = ("http1", ...)`. Read from the
# source, because the package cannot be imported while it is being built.
PACKAGES = Path(__file__).resolve().parent / "src" / "egressbox"


def declared(init: Path, name: str) -> object:
    """The literal value of a module-level `name = ...` in `init`, or None."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == name:
            return ast.literal_eval(value)
    return None


def compiled_modules() -> list[str]:
    """The paths mypyc compiles: each package's COMPILED modules, package by package."""
    found = []
    for init in sorted(PACKAGES.glob("*/__init__.py")):
        names = declared(init, "COMPILED") or ()
        assert isinstance(names, tuple), f"{init}: COMPILED is a tuple of module names"
        found += [f"src/egressbox/{init.parent.name}/{name}.py" for name in names]
    return found


COMPILED = compiled_modules()


# Measured on 2 cores (Debian 12, CPython 3.11): mypyc's translation about 40 s, gcc on
# the generated C about 90 s. Said to the user before each step (docs/install.md).
MYPYC_SECONDS = 40
GCC_SECONDS = 90


def _progress(message: str) -> None:
    """One line on stderr, and on the terminal when pip hides stderr (not a tty then)."""
    line = f"egressbox: {message}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    if sys.stderr.isatty() or os.environ.get("EGRESSBOX_BUILD_QUIET") == "1":
        return
    with contextlib.suppress(OSError), open("/dev/tty", "w", encoding="utf-8") as tty:
        tty.write(line)


class OptionalBuildExt(build_ext):
    """A failed compile leaves a working pure-Python install, with one warning."""

    def run(self) -> None:
        if self.extensions:
            _progress(
                f"compiling the proxy core's C with gcc ({len(COMPILED)} modules), about "
                f"{GCC_SECONDS} s on 2 cores; EGRESSBOX_COMPILE=0 skips it (pure Python)"
            )
        started = time.monotonic()
        try:
            super().run()
            if self.extensions:
                _progress(f"compiled the proxy core in {time.monotonic() - started:.0f} s")
        except Exception as exc:  # any compiler failure
            # All or nothing: a module's stub cannot load without the group library.
            for path in self.get_outputs():
                with contextlib.suppress(OSError):
                    os.remove(path)
            _warn(exc)


def _warn(exc: BaseException, *, mypyc: bool = False) -> None:
    if mypyc:  # mypy's own errors, printed above, say why
        fix = "mypyc refused the code (its errors are above); fix them and reinstall for it."
    else:
        fix = "Install gcc and the Python headers (Debian: python3-dev) and reinstall for it."
    sys.stderr.write(
        f"egressbox: the compiled core was not built ({exc}); installing pure Python. {fix}\n"
    )


# Commands that build the extensions. setuptools' build backend also runs this file for
# metadata alone (egg_info, dist_info: get_requires_for_build_wheel, prepare_metadata...):
# mypyc's translation (tens of seconds) is skipped for those.
BUILD_COMMANDS = frozenset(
    {"build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop", "bdist_egg"}
)


def ext_modules() -> list[object]:
    if os.environ.get("EGRESSBOX_COMPILE", "1") == "0":
        return []
    if not BUILD_COMMANDS.intersection(sys.argv[1:]):
        return []
    try:
        from mypyc.build import mypycify

        _progress(
            f"translating the proxy core ({len(COMPILED)} modules) to C with mypyc, about "
            f"{MYPYC_SECONDS} s on 2 cores, then gcc compiles it"
        )
        return list(mypycify(COMPILED, opt_level="3", group_name="egressbox"))
    except ImportError as exc:  # no mypyc
        _warn(exc)
        return []
    except (SystemExit, Exception) as exc:  # mypyc refused the code (type errors)
        _warn(exc, mypyc=True)
        return []


# setuptools runs this file as __main__; scripts/setup reads COMPILED from it under another
# name (runpy), so the rule above is the only statement of the compiled set.
if __name__ == "__main__":
    setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
