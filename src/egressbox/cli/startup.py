"""Start-up of the `egressbox` process: stdlib work that no command needs, avoided.

Called once by egressbox.cli before it imports anything else of ours. Both changes are
invisible to what runs: a module loads when it is first used, and argparse's messages are
what gettext would have returned.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any

# Loaded on first use, not when imported. dataclasses imports inspect (and with it ast, dis,
# tokenize and linecache: ~4 ms here) only to write the docstring of a class that has none;
# the confinement code imports dataclasses before its fork.
DEFERRED = ("inspect",)


def prepare() -> None:
    for name in DEFERRED:
        defer_import(name)
    untranslated_argparse()


class _LoadedOnFirstUse(types.ModuleType):
    """A module whose code runs when one of its attributes is first looked up. Unlike with
    importlib's LazyLoader, an `import` statement (which reads `__spec__`, set from the start)
    is not a use; the module object stays the same one for everybody."""

    def __getattr__(self, attr: str) -> Any:
        spec = self.__spec__
        self.__class__ = types.ModuleType  # type: ignore[assignment]  # a plain module again
        if spec is None or spec.loader is None:
            raise AttributeError(attr)
        spec.loader.exec_module(self)
        return getattr(self, attr)


def defer_import(name: str) -> None:
    """Make `import name` cheap until an attribute of the module is used."""
    if name in sys.modules:
        return
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _LoadedOnFirstUse
    sys.modules[name] = module


def untranslated_argparse() -> None:
    """argparse passes every message through gettext, which looks for a catalog on disk at
    each call (eight stat calls): about 25 calls while the parser is built. When there is no
    catalog (Debian's Python ships none for argparse) the translation is the text itself, so
    look once and pass the text through."""
    import gettext

    domain = gettext.textdomain()
    if gettext.find(domain, gettext.bindtextdomain(domain)) is not None:
        return
    vars(argparse).update(_=_same, ngettext=_singular_or_plural)


def _same(message: str) -> str:
    return message


def _singular_or_plural(singular: str, plural: str, count: int) -> str:
    return singular if count == 1 else plural
