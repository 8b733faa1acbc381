"""Coarse deadlines for the proxy's timeouts: a head, a dial, the first bytes, an idle tunnel.

Every connection arms three or four timeouts in its life and almost always cancels them.
An event loop timer is the wrong tool for that at thousands of connections a second:
uvloop's costs a handle, a libuv timer started and stopped, and a close callback (about
5,000 instructions from `call_later` to the handle's release, measured with callgrind),
for a deadline that is seconds away and nearly never reached.

Here a deadline is one small object in a bucket: the loop's time is cut into ticks of
`TICK` seconds, a deadline waits in the set of the first tick at or after its time, and
one loop timer per loop, armed only while some deadline waits, wakes at the next tick
that has one. Arming and cancelling cost a set insert and a set discard. A deadline never
fires early and fires at most one tick late (plus the loop's own latency): right for
timeouts of a tenth of a second and up, not for precise scheduling (the dialer's
Happy Eyeballs stagger stays on the loop).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable
from typing import Final

TICK: Final = 0.05  # seconds: how late a deadline may fire


def _nothing() -> None:
    """A spent deadline's callback."""


class Deadline:
    """One armed deadline; `cancel()` removes it (safe to call more than once)."""

    __slots__ = ("_bucket", "_callback", "_slot")

    def __init__(self, slot: int, bucket: set[Deadline], callback: Callable[[], object]) -> None:
        self._slot = slot
        # Its tick's set, while armed: a cancel is one set discard, with no lookup.
        self._bucket: set[Deadline] | None = bucket
        self._callback = callback

    def cancel(self) -> None:
        bucket, self._bucket = self._bucket, None
        # The callback is most often a bound method of the deadline's owner, which holds
        # the deadline: dropped, the pair is freed by its reference counts, not left to
        # the cycle collector (~8,000 instructions a short tunnel, under callgrind). And
        # a deadline cancelled by another's callback in the same tick does not run.
        self._callback = _nothing
        if bucket is not None:
            bucket.discard(self)

    def cancelled(self) -> bool:
        """True once cancelled or run."""
        return self._bucket is None

    def when(self) -> float:
        """The loop time of the tick it fires at."""
        return self._slot * TICK

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._bucket = None
        callback, self._callback = self._callback, _nothing
        try:
            callback()
        except Exception as exc:  # as the loop treats a failing callback: report, go on
            loop.call_exception_handler(
                {"message": "exception in a deadline's callback", "exception": exc}
            )


class Wheel:
    """The deadlines of one event loop, by tick; see `wheel()`."""

    __slots__ = ("_armed", "_loop", "_order", "_slots", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._slots: dict[int, set[Deadline]] = {}
        self._order: list[int] = []  # a heap of the keys of _slots
        self._timer: asyncio.TimerHandle | None = None
        self._armed = 0  # the slot the loop timer wakes for, while _timer is set

    def call_later(self, delay: float, callback: Callable[[], object]) -> Deadline:
        """Run `callback` no sooner than `delay` seconds from now, at most a tick later."""
        return self.call_at(self._loop.time() + delay, callback)

    def call_at(self, when: float, callback: Callable[[], object]) -> Deadline:
        """Run `callback` no sooner than loop time `when`, at most a tick later."""
        slot = math.ceil(when / TICK)
        bucket = self._slots.get(slot)
        if bucket is None:
            bucket = self._slots[slot] = set()
            heapq.heappush(self._order, slot)
        deadline = Deadline(slot, bucket, callback)
        bucket.add(deadline)
        if self._timer is None or slot < self._armed:
            self._arm(slot)
        return deadline

    def _arm(self, slot: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed = slot
        self._timer = self._loop.call_at(slot * TICK, self._fire)

    def _fire(self) -> None:
        self._timer = None
        loop, slots, order = self._loop, self._slots, self._order
        due = math.floor(loop.time() / TICK)
        while order and order[0] <= due:
            # A copy: a callback may cancel a deadline of the same tick (rare: nearly
            # every deadline is cancelled before its tick).
            for deadline in tuple(slots.pop(heapq.heappop(order))):
                deadline._run(loop)
        # Skip ticks whose deadlines were all cancelled: no wake-up for nothing.
        while order and not slots[order[0]]:
            del slots[heapq.heappop(order)]
        if order:
            # A callback may have armed the timer already, for a later tick.
            if self._timer is None or order[0] < self._armed:
                self._arm(order[0])
        else:
            _WHEELS.pop(loop, None)  # nothing waits: the loop is not kept alive by us


# One wheel per loop, dropped when it empties (and, for a loop closed with deadlines
# still waiting, when the next wheel is made).
_WHEELS: Final[dict[asyncio.AbstractEventLoop, Wheel]] = {}


def wheel(loop: asyncio.AbstractEventLoop) -> Wheel:
    """The deadline wheel of `loop` (made on first use)."""
    found = _WHEELS.get(loop)
    if found is None:
        for closed in [other for other in _WHEELS if other.is_closed()]:
            del _WHEELS[closed]
        found = _WHEELS[loop] = Wheel(loop)
    return found
