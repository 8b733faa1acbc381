"""The library's way in: run(), run_sync(), spawn_confined() and ConfinedProcess."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from egressbox.confine.executable import CommandNotFoundError
from egressbox.confine.grants import (
    HostFacts,
)
from egressbox.core.exitcodes import EXIT_CANNOT_CONFINE, EXIT_NOT_FOUND
from egressbox.runner.assemble import Prepared, prepare
from egressbox.runner.facts import host_facts
from egressbox.runner.gate import abandon
from egressbox.runner.options import (
    RunOptions,
    RunRefusedError,
    RunResult,
    options_for,
    write_err,
)
from egressbox.runner.spawn import Launched, confirm, spawn
from egressbox.runner.supervise import (
    _exit_before_first_connection,
    _Hold,
    _make_proxy,
    _result,
    _supervise,
    clean_up,
    supervise,
)

if TYPE_CHECKING:
    from egressbox.audit.record import AuditSink
    from egressbox.core.policy import Policy
    from egressbox.proxy.server import EgressProxy


def _warn(prepared: Prepared) -> None:
    """A best-effort profile running with less than it wants says so, once, before the command;
    so does each root the run adds beyond its workspace."""
    for text in prepared.announcements:
        write_err(text)
    for text in prepared.warnings:
        write_err(f"warning: {text}")


def _never_ran(prepared: Prepared) -> None:
    """The command never started: its layer goes, the snapshot's descriptors close."""
    stage, prepared.stage = prepared.stage, None
    abandon(stage)
    clean_up(prepared)


def _start(
    options: RunOptions, facts: HostFacts | None, capture_output: bool
) -> tuple[Prepared, Launched]:
    prepared = prepare(options, facts or host_facts())
    _warn(prepared)
    try:
        launched = spawn(prepared, capture_output=capture_output)
    except BaseException:
        _never_ran(prepared)
        raise
    _read_secrets(prepared, launched, options)
    launched.go()
    launched.start_timer(options.timeout)
    confirm(prepared, launched, options)
    return prepared, launched


def _read_secrets(prepared: Prepared, launched: Launched, options: RunOptions) -> None:
    """The [[secret]] values, read now: after the fork (the launcher's memory never held
    them) and before the command starts, so that a value that cannot be had (SecretError)
    ends the run before it begins, whether or not the command would have connected."""
    if prepared.brokering is None:
        return
    try:
        prepared.broker = prepared.brokering.loaded(options.policy, options.secrets)
    except BaseException:
        launched.abandon()
        _never_ran(prepared)
        raise


def run_options_sync(
    options: RunOptions,
    *,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    log: Any = None,
    facts: HostFacts | None = None,
    policy_loader: Callable[[], Policy | None] | None = None,
) -> RunResult:
    """Plan, fork the launcher, serve until the command exits (blocking).

    With `policy_loader`, the policy is loaded while the launcher sets the
    sandbox up (start-up time); if loading raises, the command never starts.
    """
    prepared = prepare(options, facts or host_facts())
    _warn(prepared)
    try:
        launched = spawn(prepared, capture_output=capture_output)
    except BaseException:
        _never_ran(prepared)
        raise
    if policy_loader is not None:
        try:
            options = options._replace(policy=policy_loader())
        except BaseException:
            launched.abandon()
            _never_ran(prepared)
            raise
    _read_secrets(prepared, launched, options)
    launched.go()
    launched.start_timer(options.timeout)
    confirm(prepared, launched, options)
    if not capture_output:
        early = _exit_before_first_connection(launched)
        if early is not None:
            return _result(early, [], prepared, launched, launched.stderr_tail())
    from egressbox.net.eventloop import run_loop

    holder: list[RunResult] = []

    async def main() -> int:
        holder.append(await supervise(launched, options, prepared, audit=audit, log=log))
        return 0

    run_loop(main)
    return holder[0]


async def run_options(
    options: RunOptions,
    *,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    log: Any = None,
    facts: HostFacts | None = None,
) -> RunResult:
    """The async twin of run_options_sync (forks from the running loop's thread)."""
    prepared, launched = _start(options, facts, capture_output)
    return await supervise(launched, options, prepared, audit=audit, log=log)


async def run(
    cmd: Sequence[str],
    *,
    policy: Policy | None,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    **kwargs: Any,
) -> RunResult:
    """Run `cmd` confined behind a managed proxy; see options_for() for the keywords.

    result = await egressbox.run(["curl", "https://pypi.org"], policy=policy)
    result.exit_code, result.records, result.report, result.refusal
    """
    options = options_for(cmd, policy=policy, **kwargs)
    return await run_options(options, audit=audit, capture_output=capture_output)


def run_sync(
    cmd: Sequence[str],
    *,
    policy: Policy | None,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    **kwargs: Any,
) -> RunResult:
    """The blocking twin of run() (starts its own event loop)."""
    options = options_for(cmd, policy=policy, **kwargs)
    return run_options_sync(options, audit=audit, capture_output=capture_output)


class ConfinedProcess:
    """A Popen-like handle on a confined command that is running now (spawn_confined)."""

    def __init__(self, hold: _Hold, task: Any, proxy: EgressProxy) -> None:
        self._hold = hold
        self._task = task
        self._proxy = proxy

    @property
    def pid(self) -> int:
        """The launcher's pid: signals sent here reach the command."""
        return self._hold.launched.pid

    def send_signal(self, signum: int) -> None:
        # Not once the launcher is reaped: its pid may be someone else's by then.
        if not self._hold.reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._hold.launched.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def policy(self) -> Policy | None:
        """The policy the run's proxy decides with now."""
        return self._proxy.policy

    def set_policy(self, policy: Policy, *, close_denied: bool = True) -> int:
        """Change the running command's egress policy: decisions from now on use it.

        Open tunnels, forwarding connections and held questions that the new
        policy would not admit are closed too, each audited `policy_reloaded`
        (EgressProxy.close_denied; `close_denied=False` leaves them open);
        returns how many. Only the [egress], [dns] and [limits] tables can
        change under a running command: its sandbox stays as it started.
        """
        return self._proxy.set_policy(policy, close_denied=close_denied)

    async def wait(self) -> RunResult:
        """The run's result, once the command has exited.

        Cancelling wait() cancels the run (the command is killed); wrap it in
        asyncio.shield() to wait with a timeout and leave the command running.
        """
        result: RunResult = await self._task
        return result


async def spawn_confined(
    cmd: Sequence[str],
    *,
    policy: Policy | None,
    audit: AuditSink | None = None,
    capture_output: bool = False,
    **kwargs: Any,
) -> ConfinedProcess:
    """Start `cmd` confined and return its handle as soon as the command is started.

    A coroutine, to await on the event loop that is to serve the run: the
    proxy runs there, in a Task, until the command exits (`await
    handle.wait()` for the RunResult). The keywords are options_for()'s.
    """
    import asyncio

    options = options_for(cmd, policy=policy, **kwargs)
    loop = asyncio.get_running_loop()  # before the fork: no loop, no run
    prepared, launched = _start(options, None, capture_output)
    hold = _Hold(launched, prepared=prepared)
    try:
        proxy = _make_proxy(launched, options, audit=audit, broker=prepared.broker)
    except BaseException:
        hold.abandon()
        raise
    hold.proxy = proxy
    task = loop.create_task(_supervise(hold, prepared))
    task.add_done_callback(hold.after)
    return ConfinedProcess(hold, task, proxy)


def exit_code_for(error: BaseException) -> int:
    if isinstance(error, CommandNotFoundError):
        return EXIT_NOT_FOUND
    if isinstance(error, RunRefusedError):
        return error.code
    return EXIT_CANNOT_CONFINE
