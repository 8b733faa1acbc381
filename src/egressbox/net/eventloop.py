"""uvloop, with a compiled table of its transports in place of an interpreted one.

uvloop keeps every transport it makes in a `weakref.WeakValueDictionary` keyed by the
transport's descriptor, for one check: add_reader and add_writer refuse a descriptor
that a live transport owns. That class is interpreted Python (a `KeyedRef` made by a
Python `__new__` and `__init__` per entry, a removal callback per death): two entries a
tunnel (the client's and the upstream's) cost about 10,000 instructions under callgrind,
7% of a short CONNECT tunnel. `TransportTable` answers the same two questions (store a
transport under its descriptor; look a descriptor up) in compiled code, with one plain
weak reference per descriptor.

uvloop binds the name `weakref.WeakValueDictionary` once, when its C module is first
imported, and calls it once per loop. `import_uvloop` therefore puts `TransportTable`
there only around that first import, with the modules uvloop imports already loaded
and no other thread running, and restores it at once: nothing else ever sees it. A
process that imported uvloop before keeps uvloop's own table (correct, only slower).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any, Final

# What uvloop's C module imports at its top (uvloop/includes/stdlib.pxi), loaded before
# the swap so that none of their module bodies runs while it is in place.
_UVLOOP_IMPORTS: Final = (
    "asyncio",
    "collections",
    "concurrent.futures",
    "errno",
    "functools",
    "inspect",
    "itertools",
    "os",
    "signal",
    "socket",
    "ssl",
    "subprocess",
    "threading",
    "time",
    "traceback",
    "warnings",
)


class TransportTable:
    """Descriptor -> live transport, the lookups uvloop makes of its table.

    A dead entry (its transport collected) reads as missing and is overwritten when the
    kernel hands the number out again, so the table never holds more entries than the
    highest descriptor the process has had open: the same bound as the descriptor
    table itself, with no callback when a transport dies.
    """

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[object, weakref.ref[object]] = {}

    def __setitem__(self, key: object, value: object) -> None:
        self._refs[key] = weakref.ref(value)

    def __getitem__(self, key: object) -> object:
        value = self._refs[key]()
        if value is None:
            del self._refs[key]
            raise KeyError(key)
        return value

    def __delitem__(self, key: object) -> None:
        if self._refs.pop(key)() is None:  # a dead entry is missing, as a collected value is
            raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        ref = self._refs.get(key)
        return ref is not None and ref() is not None

    def __len__(self) -> int:
        return sum(1 for ref in self._refs.values() if ref() is not None)

    def get(self, key: object, default: object = None) -> object:
        ref = self._refs.get(key)
        value = None if ref is None else ref()
        return default if value is None else value


def import_uvloop() -> ModuleType | None:
    """The uvloop module (None when it is not installed), its loops built with a
    `TransportTable` when this is its first import in a single-threaded process."""
    if "uvloop" in sys.modules or threading.active_count() > 1:
        return _plain_import()
    for name in _UVLOOP_IMPORTS:
        __import__(name)
    original = weakref.WeakValueDictionary
    setattr(weakref, "WeakValueDictionary", TransportTable)  # noqa: B010 - a module, not a type's
    try:
        return _plain_import()
    finally:
        setattr(weakref, "WeakValueDictionary", original)  # noqa: B010


def _plain_import() -> ModuleType | None:
    try:
        import uvloop  # optional; imported here, around the swap
    except ImportError:
        return None
    return uvloop


def run_loop(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run `main` on uvloop when it is installed (faster relay), else asyncio's loop."""
    import asyncio

    uvloop = import_uvloop()
    if uvloop is None:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())
