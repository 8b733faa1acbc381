"""Looking into egressbox modules the same way whether they run compiled or not."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType


def source_of(module: ModuleType) -> str:
    """The module's source text; a compiled module's .py sits beside its extension."""
    assert module.__file__ is not None
    path = Path(module.__file__)
    if path.suffix != ".py":
        path = path.with_name(path.name.split(".", 1)[0] + ".py")
    return path.read_text(encoding="utf-8")


def state_of(obj: object) -> dict[str, object]:
    """The data attributes of an object (compiled classes keep them in slots, not __dict__)."""
    if hasattr(obj, "__dict__"):
        return dict(vars(obj))
    names = (name for name in dir(obj) if not name.startswith("__"))
    values = {name: getattr(obj, name, None) for name in names}
    return {name: value for name, value in values.items() if not callable(value)}
