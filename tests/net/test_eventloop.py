"""uvloop with egressbox's transport table (egressbox.net.eventloop): the table's answers, and
uvloop's own check (a live transport's descriptor is refused to add_reader) still holding
on a real loop, with real sockets on loopback, in a fresh interpreter each."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

from egressbox.net.eventloop import TransportTable


class _Value:
    """Something a weak reference can point at (as uvloop's transports can)."""


def test_the_table_answers_as_a_weak_value_mapping() -> None:
    table = TransportTable()
    first, second = _Value(), _Value()
    table[5] = first
    table[6] = second
    assert table[5] is first and table.get(6) is second
    assert 5 in table and 7 not in table and len(table) == 2
    with pytest.raises(KeyError):
        table[7]
    del table[6]
    assert 6 not in table and table.get(6, "none") == "none"
    with pytest.raises(KeyError):
        del table[6]


def test_a_collected_value_reads_as_missing_and_its_number_is_reused() -> None:
    table = TransportTable()
    value = _Value()
    table[9] = value
    del value
    gc.collect()
    assert 9 not in table and len(table) == 0 and table.get(9) is None
    with pytest.raises(KeyError):
        table[9]
    with pytest.raises(KeyError):
        del table[9]
    again = _Value()
    table[9] = again  # the kernel hands the descriptor number out again
    assert table[9] is again and len(table) == 1


def _in_a_fresh_interpreter(body: str) -> str:
    """Run `body` in a new interpreter (uvloop not yet imported there); its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


_LOOP_CHECK = """
    import asyncio, gc, socket, weakref
    original = weakref.WeakValueDictionary
    from egressbox.net.eventloop import TransportTable, import_uvloop
    {before}
    uvloop = import_uvloop()
    assert weakref.WeakValueDictionary is original, "the swap was not undone"

    async def main():
        loop = asyncio.get_running_loop()
        tables = [o for o in gc.get_referents(loop) if isinstance(o, (TransportTable, original))]
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        fd = transport.get_extra_info("socket").fileno()
        try:
            loop.add_reader(fd, lambda: None)
            refused = "accepted"
        except RuntimeError as exc:
            refused = "refused" if "used by transport" in str(exc) else repr(exc)
        transport.close()
        await asyncio.sleep(0.05)
        del transport
        gc.collect()
        spare = socket.socket()
        spare_fd = spare.fileno()
        loop.add_reader(spare_fd, lambda: None)  # no live transport owns it now
        loop.remove_reader(spare_fd)
        spare.close()
        server.close()
        await server.wait_closed()
        print(type(tables[0]).__name__, refused)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())
"""


def test_uvloop_imported_first_here_builds_its_loops_with_the_table() -> None:
    out = _in_a_fresh_interpreter(_LOOP_CHECK.format(before="import ssl  # loaded first"))
    assert out == "TransportTable refused"


def test_uvloop_imported_before_keeps_its_own_table() -> None:
    out = _in_a_fresh_interpreter(_LOOP_CHECK.format(before="import uvloop"))
    assert out == "WeakValueDictionary refused"


def test_with_another_thread_running_uvloop_is_imported_as_it_is() -> None:
    before = (
        "import threading; stop = threading.Event();"
        " threading.Thread(target=stop.wait, daemon=True).start()"
    )
    out = _in_a_fresh_interpreter(_LOOP_CHECK.format(before=before))
    assert out == "WeakValueDictionary refused"
