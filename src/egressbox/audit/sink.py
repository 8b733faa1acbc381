"""The audit sink protocol, interpreted: egressbox.audit.record re-exports it as ``AuditSink``.

It is a class of its own module because ``isinstance(obj, AuditSink)`` needs a real
``typing.Protocol`` class, and a module compiled by mypyc (egressbox.audit.record is) turns a
protocol into a native trait that ``runtime_checkable`` refuses. egressbox.audit.record imports
this module, so it imports nothing of egressbox.audit.record (no import cycle): the record
parameter is typed ``Any`` here, the records being ``egressbox.audit.record.AuditRecord``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["AuditSink"]


@runtime_checkable
class AuditSink(Protocol):
    """Where records go. write() raises AuditError on failure and never swallows it."""

    def write(self, record: Any) -> None: ...  # an egressbox.audit.record.AuditRecord

    def close(self) -> None: ...
