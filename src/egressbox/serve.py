"""`egressbox serve`: the proxy as a long-running command.

Owns what only a process has: the event loop (uvloop where installed), the
ready line on stdout, signals (SIGHUP reload, SIGINT/SIGTERM drain), the
audit file and the descriptor limit. Everything else is EgressProxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import resource
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from egressbox.audit import (
    DEFAULT_WRITERS,
    AuditSink,
    JsonlFileSink,
    StreamSink,
    end_torn_tail,
)
from egressbox.errors import AuditError, PolicyError, print_policy_error
from egressbox.exitcodes import EXIT_OK, EXIT_START, EXIT_USAGE
from egressbox.policy import REPORT_MODE_WARNING, Mode, Policy, load_policy
from egressbox.proxy.gate import stderr_log
from egressbox.proxy.server import EgressProxy
from egressbox.resolve import parse_nameserver, resolver_for
from egressbox.suggest import with_mode

# Largest TCP port number.
MAX_PORT = 65535


@dataclass(frozen=True)
class ServeOptions:
    policy_path: str
    listen: str = "127.0.0.1"
    http_port: int | None = 0
    socks_port: int | None = 0
    audit_log: str | None = None
    quiet: bool = False
    nameservers: tuple[str, ...] = ()
    audit_max_bytes: int | None = None
    audit_keep: int = 5
    report_only: bool = False
    # --workers: processes sharing the listening ports (SO_REUSEPORT); 1 = no fork.
    workers: int = 1


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (each tunnel holds two fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def run_loop(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run `main` on uvloop when it is installed (faster relay), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def _fail(message: str, code: int) -> int:
    # stderr only: stdout carries nothing but the ready line (and records on request).
    stderr_log(message)
    return code


def serve(options: ServeOptions) -> int:
    try:
        policy = load_policy(options.policy_path)
    except PolicyError as exc:
        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE
    try:
        servers = [parse_nameserver(text) for text in options.nameservers]
    except ValueError as exc:
        return _fail(f"--nameserver: {exc}", EXIT_USAGE)
    usage = usage_problem(options)
    if usage:
        return _fail(usage, EXIT_USAGE)
    if _wildcard(options.listen):
        stderr_log(
            f"warning: --listen {options.listen} accepts connections from other hosts: "
            "anyone who can reach this machine may use it as a proxy under this policy "
            "(listen on 127.0.0.1 or a private address, or firewall the ports)"
        )
    if options.report_only:
        policy = with_mode(policy, Mode.REPORT)
    if policy.mode is Mode.REPORT:
        stderr_log(f"warning: {REPORT_MODE_WARNING}")
    raise_nofile_limit()
    if options.workers > 1:
        return serve_workers(options, policy, servers)
    try:
        audit = open_audit(options)
    except (AuditError, ValueError) as exc:
        return _fail(f"--audit-log: {exc}", EXIT_START)
    try:
        return run_loop(lambda: _serve(options, policy, servers, audit))
    finally:
        if audit is not None:
            audit.close()


def _wildcard(listen: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(listen).is_unspecified
    return False


def usage_problem(options: ServeOptions) -> str:
    """A bad --listen or port is a usage error (exit 2), not a failure to start (3)."""
    try:
        ipaddress.ip_address(options.listen)
    except ValueError:
        return f"--listen: {options.listen!r} is not an IP address (e.g. 127.0.0.1 or ::1)"
    for flag, port in (("--http-port", options.http_port), ("--socks-port", options.socks_port)):
        if port is not None and not 0 <= port <= MAX_PORT:
            return f"{flag}: {port} is not a TCP port; use 0-{MAX_PORT} (0 picks a free one)"
    if options.workers > 1 and options.audit_max_bytes is not None:
        # Rotation by size is safe with one writer only: another process appending to
        # the same path would go on writing into the renamed file.
        return (
            "--audit-max-bytes cannot be combined with --workers above 1 (several processes "
            "cannot rotate one file safely); rotate externally and send SIGUSR1 to reopen"
        )
    return ""


def open_audit(options: ServeOptions) -> AuditSink | None:
    path = options.audit_log
    if path is None:
        return None
    if path == "-":
        if options.audit_max_bytes is not None:
            raise ValueError("--audit-max-bytes needs a file, not stdout")
        return StreamSink(sys.stdout.fileno())
    # Each worker appends with a sink of its own: the reserve ahead is sized for all of them.
    writers = max(DEFAULT_WRITERS, options.workers)
    return JsonlFileSink(
        path, max_bytes=options.audit_max_bytes, keep=options.audit_keep, writers=writers
    )


async def _started_proxy(
    options: ServeOptions,
    policy: Policy,
    servers: list[tuple[str, int]],
    audit: AuditSink | None,
    sockets: dict[str, socket.socket] | None = None,
) -> EgressProxy | None:
    """The proxy on the options' ports, or on `sockets` (a worker's), started;
    None when it cannot start (said on stderr)."""
    # --nameserver overrides [dns] nameservers (keeping its timeout and cache);
    # without it the proxy builds the resolver from [dns] itself, so that a
    # SIGHUP reload with changed [dns] settings takes effect.
    resolver = resolver_for(policy, servers) if servers else None
    ports: dict[str, Any] = {"http_port": options.http_port, "socks_port": options.socks_port}
    if sockets is not None:
        http, socks = sockets.get("http"), sockets.get("socks5")
        ports = {
            "http_port": None,
            "socks_port": None,
            "http_sockets": [http] if http is not None else (),
            "socks_sockets": [socks] if socks is not None else (),
        }
    proxy = EgressProxy(
        policy,
        listen=options.listen,
        resolver=resolver,
        audit=audit,
        log=None if options.quiet else stderr_log,
        **ports,
    )
    try:
        await proxy.start()
    except (OSError, ValueError) as exc:
        _fail(f"cannot start the proxy: {exc}", EXIT_START)
        return None
    return proxy


async def _serve(
    options: ServeOptions,
    policy: Policy,
    servers: list[tuple[str, int]],
    audit: AuditSink | None,
) -> int:
    proxy = await _started_proxy(options, policy, servers, audit)
    if proxy is None:
        return EXIT_START
    # Signal handlers before the ready line: a supervisor may send SIGHUP or
    # SIGTERM as soon as it reads the line, and SIGHUP's default action kills.
    stop = asyncio.Event()
    _install_signals(proxy, options, stop, audit)
    # The ready line: one JSON object, then nothing else on stdout (records
    # go there only with --audit-log -).
    os.write(sys.stdout.fileno(), (json.dumps(proxy.ready_line()) + "\n").encode())
    await stop.wait()
    await proxy.close()
    return EXIT_OK


# -- --workers N --------------------------------------------------------------------------


def serve_workers(options: ServeOptions, policy: Policy, servers: list[tuple[str, int]]) -> int:
    """`serve --workers N` (N > 1): bind in the parent, fork, supervise (see workers.py)."""
    from egressbox.workers import bind_listeners, run_workers, share_limits

    count = options.workers
    if options.audit_log is not None and options.audit_log != "-":
        # Check (before any fork) that the log can be opened, and end a torn tail
        # here, once, rather than in every worker.
        try:
            open_audit(options).close()  # type: ignore[union-attr]
            end_torn_tail(options.audit_log)
        except (AuditError, ValueError) as exc:
            return _fail(f"--audit-log: {exc}", EXIT_START)
    try:
        groups = bind_listeners(
            options.listen, {"http": options.http_port, "socks5": options.socks_port}, count
        )
    except (OSError, ValueError) as exc:
        return _fail(f"cannot start the proxy: {exc}", EXIT_START)
    shared = share_limits(policy, count)

    def worker_main(index: int, sockets: dict[str, socket.socket], report_fd: int, go: int) -> int:
        return _worker(
            options, policy=shared, servers=servers, sockets=sockets, report_fd=report_fd, go=go
        )

    return run_workers(count, groups, worker_main)


def _worker(
    options: ServeOptions,
    *,
    policy: Policy,
    servers: list[tuple[str, int]],
    sockets: dict[str, socket.socket],
    report_fd: int,
    go: int,
) -> int:
    """One worker process: its own audit descriptor, loop, resolver and proxy."""
    try:
        audit = open_audit(options)
    except (AuditError, ValueError) as exc:
        return _fail(f"--audit-log: {exc}", EXIT_START)
    try:
        return run_loop(
            lambda: _serve_worker(
                options,
                policy=policy,
                servers=servers,
                sockets=sockets,
                audit=audit,
                report_fd=report_fd,
                go=go,
            )
        )
    finally:
        if audit is not None:
            audit.close()


async def _serve_worker(
    options: ServeOptions,
    *,
    policy: Policy,
    servers: list[tuple[str, int]],
    sockets: dict[str, socket.socket],
    audit: AuditSink | None,
    report_fd: int,
    go: int,
) -> int:
    from egressbox.workers import report, share_limits, wait_for_go

    proxy = await _started_proxy(options, policy, servers, audit, sockets)
    if proxy is None:
        return EXIT_START
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def reload() -> None:
        try:
            fresh = load_policy(options.policy_path)
        except PolicyError as exc:
            report(report_fd, "reload", message=f"reload refused, keeping the old policy: {exc}")
            return
        if options.report_only:
            fresh = with_mode(fresh, Mode.REPORT)
        proxy.set_policy(share_limits(fresh, options.workers))
        report(report_fd, "reload", message=f"policy reloaded from {options.policy_path}")

    loop.add_signal_handler(signal.SIGHUP, reload)
    if isinstance(audit, JsonlFileSink):
        file_sink = audit

        def reopen() -> None:
            try:
                file_sink.reopen()
            except AuditError as exc:
                report(
                    report_fd,
                    "reopen",
                    message=f"audit log reopen failed, still writing the old file: {exc}",
                )

        loop.add_signal_handler(signal.SIGUSR1, reopen)
    report(report_fd, "ready", line=proxy.ready_line())
    # Nothing is accepted until the parent has printed the ready line.
    if not wait_for_go(go):
        stop.set()  # the parent went away instead
    await stop.wait()
    await proxy.close()
    return EXIT_OK


def _install_signals(
    proxy: EgressProxy, options: ServeOptions, stop: asyncio.Event, audit: AuditSink | None
) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(
        signal.SIGHUP, lambda: reload_policy(proxy, options.policy_path, options.report_only)
    )
    if isinstance(audit, JsonlFileSink):
        # SIGUSR1: reopen the audit log after an external logrotate moved it.
        loop.add_signal_handler(signal.SIGUSR1, lambda: _reopen(audit))


def _reopen(audit: JsonlFileSink) -> None:
    try:
        audit.reopen()
    except AuditError as exc:
        stderr_log(f"audit log reopen failed, still writing the old file: {exc}")


def reload_policy(proxy: EgressProxy, path: str, report_only: bool = False) -> bool:
    """SIGHUP: load the file anew; a bad file keeps the old policy and says why."""
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        stderr_log(f"reload refused, keeping the old policy: {exc}")
        return False
    if report_only:
        policy = with_mode(policy, Mode.REPORT)
    proxy.set_policy(policy)
    stderr_log(f"policy reloaded from {path}")
    return True
