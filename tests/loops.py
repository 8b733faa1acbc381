"""The event loops the relay and dial tests run on: asyncio's and uvloop's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

Scenario = Callable[[], Coroutine[Any, Any, None]]
Runner = Callable[[Scenario], None]

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}
