"""The coarse deadlines (egressbox.net.deadlines) on real event loops: asyncio's and uvloop's."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import pytest
import uvloop

from egressbox.net import deadlines
from egressbox.net.deadlines import TICK, wheel

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    def runner(coro: Coroutine[Any, Any, Any]) -> Any:
        loop = LOOPS[request.param]()
        try:
            return loop.run_until_complete(coro)
        finally:
            loop.close()

    return runner


def test_a_deadline_fires_no_sooner_than_asked_and_at_most_a_tick_later(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        fired: dict[float, float] = {}
        done = loop.create_future()
        delays = [0.01, 0.05, 0.12, 0.2]
        start = loop.time()
        for delay in delays:

            def note(delay: float = delay) -> None:
                fired[delay] = loop.time() - start
                if len(fired) == len(delays):
                    done.set_result(None)

            wheel(loop).call_later(delay, note)
        await asyncio.wait_for(done, 5)
        return [fired[delay] - delay for delay in delays]

    lateness = run(main())
    # Never early (the loop's clock may round to a millisecond), and late by at most a
    # tick plus the loop's own latency on a loaded machine.
    assert all(-0.002 <= late < TICK + 0.25 for late in lateness), lateness


def test_a_cancelled_deadline_never_runs_and_the_others_in_its_tick_do(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        ran: list[str] = []
        handles = {name: wheel(loop).call_later(0.05, partial(ran.append, name)) for name in "abc"}
        handles["b"].cancel()
        handles["b"].cancel()  # twice is harmless
        assert handles["b"].cancelled() and not handles["a"].cancelled()
        await asyncio.sleep(0.05 + 3 * TICK)
        assert handles["a"].cancelled()  # run: nothing left to cancel
        return sorted(ran)

    assert run(main()) == ["a", "c"]


def test_a_deadline_cancelled_by_a_callback_of_its_own_tick_does_not_run(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    """Both in one tick: whichever runs first cancels the other, which then never runs."""

    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        ran: list[str] = []
        handles: dict[str, deadlines.Deadline] = {}

        def first(name: str, other: str) -> None:
            ran.append(name)
            handles[other].cancel()

        when = loop.time() + 0.05
        handles["a"] = wheel(loop).call_at(when, partial(first, "a", "b"))
        handles["b"] = wheel(loop).call_at(when, partial(first, "b", "a"))
        await asyncio.sleep(0.05 + 3 * TICK)
        return ran

    assert len(run(main())) == 1


def test_a_spent_deadline_lets_go_of_its_callback(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    """An owner holding its deadline, whose callback is the owner's method: once the
    deadline is cancelled or has run, the owner is freed by its reference count alone,
    with the cycle collector off (nothing is left for it)."""

    class Owner:
        def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
            self.deadline = wheel(loop).call_later(delay, self.expire)

        def expire(self) -> None:
            pass

    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        cancelled, expired = Owner(loop, 5.0), Owner(loop, 0.01)
        cancelled.deadline.cancel()
        await asyncio.sleep(0.01 + 3 * TICK)
        gone = [weakref.ref(cancelled), weakref.ref(expired)]
        del cancelled, expired
        return gone[0]() is None, gone[1]() is None

    gc.disable()
    try:
        assert run(main()) == (True, True)
    finally:
        gc.enable()


def test_a_later_earlier_deadline_rearms_the_loop_timer(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        wheel(loop).call_later(30, lambda: None).cancel()
        far = wheel(loop).call_later(30, lambda: None)
        start = loop.time()
        wheel(loop).call_later(0.05, lambda: done.set_result(loop.time() - start))
        took = await asyncio.wait_for(done, 5)
        far.cancel()
        return float(took)

    assert run(main()) < 1


def test_a_callback_may_arm_deadlines_sooner_and_later(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        ran: list[str] = []
        done = loop.create_future()

        def last(name: str) -> None:
            ran.append(name)
            done.set_result(None)

        def first() -> None:
            ran.append("first")
            wheel(loop).call_later(0.3, partial(last, "late"))
            wheel(loop).call_later(0.0, lambda: ran.append("now"))

        wheel(loop).call_later(0.02, first)
        await asyncio.wait_for(done, 5)
        return ran

    assert run(main()) == ["first", "now", "late"]


def test_a_failing_callback_is_reported_to_the_loop_and_the_rest_still_run(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    async def main() -> tuple[list[dict[str, Any]], list[str]]:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        ran: list[str] = []

        def boom() -> None:
            raise RuntimeError("boom")

        wheel(loop).call_later(0.02, boom)
        wheel(loop).call_later(0.02, lambda: ran.append("after"))
        await asyncio.sleep(0.02 + 3 * TICK)
        return reported, ran

    reported, ran = run(main())
    assert ran == ["after"]
    assert [type(context["exception"]) for context in reported] == [RuntimeError]


def test_the_wheel_lets_go_of_its_loop_once_nothing_waits(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        wheel(loop).call_later(0.02, lambda: None)
        held = loop in deadlines._WHEELS
        await asyncio.sleep(0.02 + 3 * TICK)
        return held, loop in deadlines._WHEELS

    assert run(main()) == (True, False)


def test_a_loop_closed_with_deadlines_waiting_is_dropped_with_the_next_wheel() -> None:
    closed = asyncio.new_event_loop()
    wheel(closed).call_later(60, lambda: None)
    closed.close()
    assert closed in deadlines._WHEELS
    other = asyncio.new_event_loop()
    try:
        wheel(other)
        assert closed not in deadlines._WHEELS
    finally:
        deadlines._WHEELS.pop(other, None)
        other.close()


def test_cancelled_deadlines_leave_nothing_to_fire_or_hold(
    run: Callable[[Coroutine[Any, Any, Any]], Any],
) -> None:
    """Ten thousand armed over several seconds' ticks, all but one cancelled: the one runs,
    and then the wheel (with the empty ticks the others left) is gone."""

    async def main() -> tuple[list[int], bool]:
        loop = asyncio.get_running_loop()
        ran: list[int] = []
        handles = [
            wheel(loop).call_later(0.05 + i % 7, partial(ran.append, i)) for i in range(10_000)
        ]
        for handle in handles[1:]:
            handle.cancel()
        await asyncio.sleep(0.05 + 3 * TICK)
        return ran, loop in deadlines._WHEELS

    assert run(main()) == ([0], False)
