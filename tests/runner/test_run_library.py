"""The library's lifecycle of a confined run: cancelling it (or closing its event loop)
kills and reaps the launcher and releases every descriptor, and a policy swapped under a
running command decides new connections at once and (unless close_denied=False) closes the
open ones it no longer admits.

The runs use the real library in the pytest process (the launcher is forked from here),
in a network namespace, against origins on 127.0.0.1 that the child reaches only through
the run's proxy (EGRESSBOX_HTTP_PROXY). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

import descriptors
from egressbox.core.policy import Policy, parse_policy
from egressbox.proxy.server import EgressProxy
from egressbox.runner.api import ConfinedProcess, run, spawn_confined
from egressbox.runner.facts import host_facts
from egressbox.runner.options import RunResult

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(180),
]

LOOPBACK = "127.0.0.1"
# Longest one step may take (a connection, a reply, the run's start or end).
IO_TIMEOUT = 20.0
# A cancelled run must be gone about this fast (killing a PID namespace takes milliseconds).
PROMPTLY = 5.0
POLL = 0.02


@pytest.fixture
def namespaces() -> None:
    """The child reaches loopback origins only through the proxy (a network namespace),
    and killing the launcher ends its PID namespace."""
    missing = {"network_namespace", "pid_namespace"} - host_facts().available
    if missing:
        pytest.skip(f"this host lacks {sorted(missing)}")


confined = pytest.mark.usefixtures("namespaces")


def _children(pid: int | str = "self") -> set[int]:
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                found.update(int(p) for p in f.read().split())
    return found


def _descendants(pid: int) -> set[int]:
    found = _children(pid)
    for child in list(found):
        found |= _descendants(child)
    return found


async def _new_child(known: set[int]) -> int:
    """The launcher: the child of ours that was not there before (polled, bounded)."""
    async with asyncio.timeout(IO_TIMEOUT):
        while not (_children() - known):
            await asyncio.sleep(POLL)
    (pid,) = _children() - known
    return pid


def _running(pid: int) -> bool:
    """Not exited: a zombie reparented to init (the reaper) is init's to reap."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _assert_gone(launcher: int, inside: set[int]) -> None:
    """Reaped by the library (no zombie left to us), and nothing of the command running."""
    with pytest.raises(ChildProcessError):
        os.waitpid(launcher, os.WNOHANG)
    assert not os.path.exists(f"/proc/{launcher}")
    assert not [pid for pid in inside if _running(pid)]


def _where(root: Path) -> dict[str, Any]:
    return {"write_roots": [str(root)], "cwd": str(root)}


# -- cancellation and a closing loop -----------------------------------------------------


@confined
@pytest.mark.parametrize("capture_output", [False, True], ids=["tee", "captured"])
async def test_cancelling_a_run_kills_and_reaps_it_and_releases_its_descriptors(
    tmp_path: Path, capture_output: bool
) -> None:
    before, known = descriptors.snapshot(), _children()
    command = run(["sleep", "60"], policy=None, capture_output=capture_output, **_where(tmp_path))
    task = asyncio.create_task(command)
    launcher = await _new_child(known)
    async with asyncio.timeout(IO_TIMEOUT):
        while not _descendants(launcher):  # the command is on its way
            await asyncio.sleep(POLL)
    inside = _descendants(launcher)
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(IO_TIMEOUT):
            await task
    assert time.monotonic() - started < PROMPTLY
    _assert_gone(launcher, inside)
    assert not descriptors.opened_since(before)


@confined
async def test_cancelling_wait_cancels_the_run(tmp_path: Path) -> None:
    before = descriptors.snapshot()
    handle = await spawn_confined(["sleep", "60"], policy=None, **_where(tmp_path))
    waiting = asyncio.create_task(handle.wait())
    await asyncio.sleep(0.2)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(IO_TIMEOUT):
            await waiting
    _assert_gone(handle.pid, set())
    handle.kill()  # the pid is reaped: nothing is sent to whoever has it now
    assert not descriptors.opened_since(before)


@confined
async def test_a_run_cancelled_before_its_task_ever_ran_is_torn_down(tmp_path: Path) -> None:
    before = descriptors.snapshot()
    handle = await spawn_confined(
        ["sleep", "60"], policy=None, capture_output=True, **_where(tmp_path)
    )
    handle._task.cancel()  # before its first step: the coroutine never starts
    with pytest.raises(asyncio.CancelledError):
        await _wait_result(handle)
    _assert_gone(handle.pid, set())
    assert not descriptors.opened_since(before)


def _leave_running(root: Path, pids: list[int]) -> Callable[[], Coroutine[Any, Any, None]]:
    """A main() that starts a run and returns while it is still going."""

    async def main() -> None:
        known = _children()
        handle = await spawn_confined(["sleep", "60"], policy=None, **_where(root))
        pids.append(await _new_child(known))
        assert pids[0] == handle.pid

    return main


@confined
def test_a_run_left_behind_by_asyncio_run_is_killed_when_the_loop_ends(tmp_path: Path) -> None:
    before = descriptors.snapshot()
    pids: list[int] = []
    # asyncio.run cancels what main() left running before it closes the loop.
    asyncio.run(_leave_running(tmp_path, pids)())
    _assert_gone(pids[0], set())
    assert not descriptors.opened_since(before)


@confined
def test_a_run_whose_loop_is_closed_under_it_is_killed_when_its_task_goes(
    tmp_path: Path,
) -> None:
    before = descriptors.snapshot()
    pids: list[int] = []
    loop = asyncio.new_event_loop()
    loop.run_until_complete(_leave_running(tmp_path, pids)())
    # Closed with the run's task pending: the task is destroyed when collected, and its
    # coroutine tears the run down then, without awaiting.
    loop.close()
    deadline = time.monotonic() + PROMPTLY
    while os.path.exists(f"/proc/{pids[0]}") and time.monotonic() < deadline:
        gc.collect()
        time.sleep(POLL)
    _assert_gone(pids[0], set())
    assert not descriptors.opened_since(before)


# -- set_policy under a running command ------------------------------------------------------


class HeldOrigin:
    """A loopback TCP origin that keeps each connection open and hands it to the test;
    with `http`, it answers one keep-alive request on each first."""

    HTTP_REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"

    def __init__(self, *, http: bool = False) -> None:
        self.http = http
        self.port = 0
        self.arrived: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]]
        self.arrived = asyncio.Queue()
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    async def start(self) -> HeldOrigin:
        self.server = await asyncio.start_server(self._accept, LOOPBACK, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        if self.http:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(self.HTTP_REPLY)
            await writer.drain()
        await self.arrived.put((reader, writer))

    async def connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with asyncio.timeout(IO_TIMEOUT):
            return await self.arrived.get()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.transport.abort()


@pytest.fixture
async def held() -> AsyncIterator[Callable[..., Coroutine[Any, Any, HeldOrigin]]]:
    started: list[HeldOrigin] = []

    async def start(*, http: bool = False) -> HeldOrigin:
        origin = await HeldOrigin(http=http).start()
        started.append(origin)
        return origin

    try:
        yield start
    finally:
        for origin in started:
            await origin.close()


async def _sees_close(reader: asyncio.StreamReader) -> bool:
    """The peer ended the connection (EOF or reset), within IO_TIMEOUT."""
    try:
        async with asyncio.timeout(IO_TIMEOUT):
            return await reader.read(1) == b""
    except ConnectionError:
        return True


def _policy(*ports: int) -> Policy:
    allow = [f"{LOOPBACK}:{port}" for port in ports]
    return parse_policy({"egress": {"allow": allow, "allow_cidrs": [f"{LOOPBACK}/32"]}}, env={})


# The confined child: two CONNECT tunnels (to A and B) and one kept-alive forwarding
# connection (to C), all through the run's proxy, then a line to B to say so; once the
# test has swapped the policy, it answers B's ping, sees A and C closed, and asks for A
# once more.
CHILD = r"""
import os, socket, sys

proxy = os.environ["EGRESSBOX_HTTP_PROXY"].rsplit("/", 1)[1]
host, port = proxy.rsplit(":", 1)
a, b, c = sys.argv[1:4]


def dial():
    return socket.create_connection((host, int(port)), timeout=20)


def head(sock, body=0):
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + body:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def tunnel(target):
    sock = dial()
    authority = f"127.0.0.1:{target}"
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    return sock, int(head(sock).split(b" ", 2)[1])


def closed(sock):
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


ta, status_a = tunnel(a)
tb, status_b = tunnel(b)
print("tunnels", status_a, status_b, flush=True)
ta.sendall(b"A\n")
fc = dial()
fc.sendall(f"GET http://127.0.0.1:{c}/ HTTP/1.1\r\nHost: 127.0.0.1:{c}\r\n\r\n".encode())
reply = head(fc, body=2)
print("forwarded", reply.split(b" ", 2)[1].decode(), reply.endswith(b"\r\n\r\nok"))
tb.sendall(b"B\n")  # the last step: now the test may swap the policy
assert tb.recv(5) == b"ping\n"
tb.sendall(b"pong\n")
print("a closed", closed(ta))
print("c closed", closed(fc))
_, again = tunnel(a)
print("a again", again)
"""


async def _wait_result(handle: ConfinedProcess) -> RunResult:
    async with asyncio.timeout(IO_TIMEOUT * 2):
        return await handle.wait()


@confined
async def test_set_policy_closes_what_it_no_longer_admits_and_decides_anew(
    tmp_path: Path, held: Callable[..., Coroutine[Any, Any, HeldOrigin]]
) -> None:
    a, b, c = await held(), await held(), await held(http=True)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    argv = [sys.executable, str(script), str(a.port), str(b.port), str(c.port)]
    first = _policy(a.port, b.port, c.port)
    handle = await spawn_confined(argv, policy=first, capture_output=True, **_where(tmp_path))
    try:
        (a_in, _), (b_in, b_out), (c_in, _) = [await origin.connection() for origin in (a, b, c)]
        async with asyncio.timeout(IO_TIMEOUT):
            assert await a_in.readexactly(2) == b"A\n"
            assert await b_in.readexactly(2) == b"B\n"
        second = _policy(b.port)
        assert handle.set_policy(second) == 2  # closing what it denies is the default
        assert handle.policy is second
        # Seen from the origins: A's tunnel and C's kept connection are closed...
        assert await _sees_close(a_in)
        assert await _sees_close(c_in)
        # ...and B's tunnel, still admitted, carries bytes both ways.
        b_out.write(b"ping\n")
        async with asyncio.timeout(IO_TIMEOUT):
            assert await b_in.readexactly(5) == b"pong\n"
        result = await _wait_result(handle)
    except BaseException:
        handle.kill()
        with contextlib.suppress(BaseException):
            await _wait_result(handle)
        raise
    out = (result.stdout or b"").decode()
    assert result.exit_code == 0, (out, result.stderr)
    assert out.splitlines() == [
        "tunnels 200 200",
        "forwarded 200 True",
        "a closed True",
        "c closed True",
        "a again 403",  # decided by the new policy
    ]
    seen = [(r.protocol.value, r.port, r.decision.value, r.reason.value) for r in result.records]
    assert seen[:3] == [
        ("connect", a.port, "allow", "allowed"),
        ("connect", b.port, "allow", "allowed"),
        ("http", c.port, "allow", "allowed"),
    ]
    # Each closure has its own record, then the new decision.
    assert sorted(seen[3:5]) == [
        ("connect", a.port, "deny", "policy_reloaded"),
        ("http", c.port, "deny", "policy_reloaded"),
    ]
    assert seen[5:] == [("connect", a.port, "deny", "no_allow_rule")]


@pytest.mark.usefixtures("dials")
async def test_set_policy_with_close_denied_false_leaves_open_tunnels_alone(
    held: Callable[..., Coroutine[Any, Any, HeldOrigin]],
) -> None:
    origin = await held()
    proxy = EgressProxy(_policy(origin.port), keep_records=True)
    await proxy.start()
    try:
        assert proxy.http_address is not None
        reader, writer = await asyncio.open_connection(*proxy.http_address)
        target = f"{LOOPBACK}:{origin.port}"
        writer.write(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        async with asyncio.timeout(IO_TIMEOUT):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        inside, outside = await origin.connection()
        assert proxy.set_policy(_policy(), close_denied=False) == 0
        # Still open: a reload alone decides new connections only.
        outside.write(b"still\n")
        async with asyncio.timeout(IO_TIMEOUT):
            assert await reader.readexactly(6) == b"still\n"
        # Asked later, the proxy closes it under the policy it has now.
        assert proxy.close_denied() == 1
        assert await _sees_close(inside)
        writer.close()
    finally:
        await proxy.close(0)
