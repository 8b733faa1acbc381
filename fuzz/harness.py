"""What every fuzz target shares: pure-Python egressbox, the split point, the main loop.

A target is `fuzz/fuzz_NAME.py`: it imports this module first, then the egressbox
modules it drives inside `atheris.instrument_imports()`, defines
`test_one_input(data: bytes) -> None` and ends with `harness.main(test_one_input)`.
Its seeds live in `fuzz/corpus/fuzz_NAME/`; `fuzz/run` finds it by its name.

Coverage comes from instrumenting Python bytecode as it is imported, so egressbox
must run from its sources: a compiled (mypyc) module would be invisible. This module
sets EGRESSBOX_PURE=1 before it imports the package, whose `__init__` then puts its
source-first finder on `sys.meta_path`; atheris's finder goes in front of it while a
target imports, and instruments what it returns. Modules a parser imports lazily
(inside a function) are imported after the `with` block and so are not instrumented:
a target names them in its own `with` block.

The split point is chosen by the data: every mutation moves it, so over a run the
parsers are fed in two pieces at every offset, and a seed stays a plain file (no
control bytes in front of a request head) that reads as what it is.
"""

from __future__ import annotations

import os
import shlex
import sys
import zlib
from collections.abc import Callable, Iterable
from types import ModuleType

# Before the imports: the package reads it when it is imported.
os.environ["EGRESSBOX_PURE"] = "1"

import atheris

import egressbox

__all__ = ["check_pure", "main", "pieces", "split_point"]


def split_point(data: bytes) -> int:
    """An offset in 0..len(data), chosen by the data (CRC-32, so any change moves it)."""
    return zlib.crc32(data) % (len(data) + 1)


def pieces(data: bytes) -> list[bytes]:
    """`data` cut in two at `split_point(data)` (either piece may be empty)."""
    cut = split_point(data)
    return [data[:cut], data[cut:]]


def check_pure(modules: Iterable[ModuleType]) -> None:
    """Refuse to fuzz compiled modules: atheris would see no coverage in them."""
    compiled = [m.__name__ for m in modules if not (m.__file__ or "").endswith(".py")]
    if compiled or egressbox.compiled_core():
        sys.exit(f"fuzz: compiled modules loaded, no coverage possible: {compiled or 'core'}")


def main(test_one_input: Callable[[bytes], None]) -> None:
    """libFuzzer's main loop over `test_one_input`, with libFuzzer's command line."""
    # libFuzzer runs `-merge=1` (and `-fork`) work in child processes started through
    # the shell from argv[0]: make that this interpreter and this script.
    script = os.path.abspath(sys.argv[0])
    argv = [f"{shlex.quote(sys.executable)} {shlex.quote(script)}", *sys.argv[1:]]
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
