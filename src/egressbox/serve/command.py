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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from egressbox.audit.record import (
    DEFAULT_WRITERS,
    AuditSink,
    JsonlFileSink,
    StreamSink,
    end_torn_tail,
)
from egressbox.audit.suggest import with_mode
from egressbox.core.errors import AuditError, PolicyError, print_policy_error
from egressbox.core.exitcodes import EXIT_OK, EXIT_RUNTIME, EXIT_START, EXIT_USAGE
from egressbox.core.limits import MAX_PORT
from egressbox.core.policy import REPORT_MODE_WARNING, Mode, Policy, load_policy
from egressbox.core.upstream import parse_upstream
from egressbox.net.eventloop import run_loop
from egressbox.net.resolve import parse_nameserver, resolver_for
from egressbox.protocols.proxy_header import parse_trusted
from egressbox.protocols.upstream import credentials_from_env
from egressbox.proxy.approval import DEFAULT_TIMEOUT as DEFAULT_ASK_TIMEOUT
from egressbox.proxy.approval import Answer, CommandDecider, command_argv, save_approved
from egressbox.proxy.gate import Meter, stderr_log
from egressbox.proxy.server import EgressProxy
from egressbox.serve.brokering import (
    ServeTlsError,
    ca_paths,
    serve_broker,
    unchanged_on_reload,
)
from egressbox.serve.fleet import Prepared, ServingProcess
from egressbox.serve.systemd import ActivationError, Notifier, listen_fds
from egressbox.serve.watch import PolicyWatch

if TYPE_CHECKING:
    from egressbox.proxy.broker import Broker

# --drain-delay beyond this is a typo (a Kubernetes pod gets 30 s to stop by default).
MAX_DRAIN_DELAY = 300.0


@dataclass(frozen=True)
class ServeOptions:
    """What `egressbox serve` was asked to do (the command line's options)."""

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
    # --ask-command: a program asked about a destination no allow entry admits
    # (proxy/approval.py), as a command line (split like a shell would, never run by one).
    ask_command: str | None = None
    ask_timeout: float = DEFAULT_ASK_TIMEOUT
    # --save-approved: the approved destinations, written as a policy file at exit.
    save_approved: str | None = None
    # --admin ADDR:PORT: the admin listener (/metrics, /healthz, /readyz; admin.py); None: off.
    admin: str | None = None
    # --admin-token-file: the bearer token /metrics wants (else $EGRESSBOX_ADMIN_TOKEN).
    admin_token_file: str | None = None
    # --watch-policy: reload when the policy file changes (watch.py), as SIGHUP does.
    watch_policy: bool = False
    # --keep-open-on-reload: a reload decides new connections only; open ones (and requests
    # held for an approval answer) are not judged again. Default: closed when it denies them.
    keep_open_on_reload: bool = False
    # --drain-delay: seconds to keep accepting after SIGTERM while /readyz says 503.
    drain_delay: float = 0.0
    # --proxy-protocol[-from]: a PROXY protocol header first, from these senders only
    # (CIDR texts); None: off.
    proxy_protocol_from: tuple[str, ...] | None = None
    # --upstream / --upstream-target: chain to this proxy (else [egress] upstream, if any).
    upstream: str | None = None
    upstream_target: str | None = None
    # --ca-cert / --ca-key: the CA that signs terminated hosts' certificates (else [tls]).
    ca_cert: str | None = None
    ca_key: str | None = None


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (each tunnel holds two fds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _fail(message: str, code: int) -> int:
    # stderr only: stdout carries nothing but the ready line (and records on request).
    stderr_log(message)
    return code


def serve(options: ServeOptions) -> int:
    # Before the first load: a change made while serve starts is then seen.
    watch = PolicyWatch(options.policy_path) if options.watch_policy else None
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
    _say_upstream(options, policy)
    raise_nofile_limit()
    prepared, code = prepare(options, watch, policy)
    if prepared is None:
        return code
    if options.workers > 1:
        return serve_workers(options, policy, servers, prepared)
    return _serve_one(options, policy, servers, prepared)


def _broker(options: ServeOptions, policy: Policy) -> Broker | None:
    """The broker of the policy's [[secret]] and [[request_rule]] entries with the
    operator's CA (ServeTlsError: exit 2), its budgets shared among the workers."""
    from egressbox.serve.workers import share_rules

    paths = ca_paths(policy, options.ca_cert, options.ca_key)
    if paths is not None and not policy.secrets and not policy.request_rules:
        stderr_log(
            "warning: a CA is given but the policy has no [[secret]] or [[request_rule]]: "
            "no host is terminated (they are read at start only, not on reload)"
        )
    broker = serve_broker(policy, paths, share_rules(policy.request_rules, options.workers))
    for name, token in broker.placeholders.items() if broker is not None else ():
        # Not a secret: what clients send in the value's place (stable: brokering.py).
        stderr_log(f"[[secret]] {name}: clients send {token} in its place")
    return broker


def _say_upstream(options: ServeOptions, policy: Policy) -> None:
    """One stderr line when chaining, and whether pinning holds through the upstream."""
    upstream = chain_arguments(options).get("upstream") or policy.upstream
    if upstream is None:
        return
    if upstream.pinning == "full":
        stderr_log(f"chaining through {upstream.url}: it is asked for the checked addresses")
    else:
        stderr_log(
            f"warning: chaining through {upstream.url} by name: the upstream resolves names "
            "itself, so it may reach other addresses than egressbox checked (pinning: partial)"
        )


def _serve_one(
    options: ServeOptions, policy: Policy, servers: list[tuple[str, int]], prepared: Prepared
) -> int:
    """serve in this process (no --workers)."""
    try:
        audit = open_audit(options)
    except (AuditError, ValueError) as exc:
        return _fail(f"--audit-log: {exc}", EXIT_START)
    try:
        return run_loop(lambda: _serve(options, policy, servers, audit, prepared))
    finally:
        if audit is not None:
            audit.close()


def prepare(
    options: ServeOptions, watch: PolicyWatch | None, policy: Policy | None = None
) -> tuple[Prepared | None, int]:
    """The broker of `policy` (its CA and values), the admin listener (bound here, before
    any fork), its token, the sockets systemd passed and its notify socket: (prepared, 0),
    or (None, exit code) said on stderr."""
    from egressbox.serve.admin import bind_admin, is_loopback, parse_admin_address, read_token

    try:
        broker = _broker(options, policy) if policy is not None else None
    except ServeTlsError as exc:
        return None, _fail(str(exc), EXIT_USAGE)
    try:
        token = read_token(options.admin_token_file, os.environ)
    except ValueError as exc:
        return None, _fail(f"--admin-token-file: {exc}", EXIT_USAGE)
    try:
        inherited = listen_fds()
    except (ActivationError, OSError) as exc:
        return None, _fail(f"socket activation: {exc}", EXIT_START)
    prepared = Prepared(
        admin_token=token,
        notifier=Notifier.from_environ(),
        watch=watch,
        drain_delay=options.drain_delay,
        workers=options.workers,
        broker=broker,
    )
    admin_socket = inherited.pop("admin", None)
    prepared.inherited = inherited
    if admin_socket is None and options.admin is not None:
        host, port = parse_admin_address(options.admin)  # checked by usage_problem
        if not is_loopback(host):
            stderr_log(
                f"warning: --admin {options.admin} is reachable from other hosts: /metrics "
                "shows every destination's decision counts"
                + ("" if token else " (set --admin-token-file to require a bearer token)")
            )
        try:
            admin_socket = bind_admin(host, port)
        except OSError as exc:
            return None, _fail(f"cannot start the admin listener: {exc}", EXIT_START)
    if admin_socket is not None:
        prepared.set_admin(admin_socket)
    return prepared, EXIT_OK


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
    asking = ask_problem(options)
    if asking:
        return asking
    operating = admin_problem(options) or chain_problem(options) or ca_problem(options)
    if operating:
        return operating
    if options.workers > 1 and options.audit_max_bytes is not None:
        # Rotation by size is safe with one writer only: another process appending to
        # the same path would go on writing into the renamed file.
        return (
            "--audit-max-bytes cannot be combined with --workers above 1 (several processes "
            "cannot rotate one file safely); rotate externally and send SIGUSR1 to reopen"
        )
    return ""


def ca_problem(options: ServeOptions) -> str:
    """--ca-cert without --ca-key, or the other way round (exit 2)."""
    if (options.ca_cert is None) != (options.ca_key is None):
        return "--ca-cert and --ca-key go together (the CA certificate and its key, PEM)"
    return ""


def chain_problem(options: ServeOptions) -> str:
    """--proxy-protocol-from, --upstream and the upstream credentials that cannot work."""
    try:
        chain_arguments(options)
    except ValueError as exc:
        return str(exc)
    return ""


def chain_arguments(options: ServeOptions) -> dict[str, Any]:
    """EgressProxy's proxy_protocol_from and upstream (ValueError: a usage error). The
    credentials are checked here too (they are read again when the proxy starts)."""
    found: dict[str, Any] = {}
    if options.proxy_protocol_from is not None:
        try:
            parse_trusted(options.proxy_protocol_from)
        except ValueError as exc:
            raise ValueError(f"--proxy-protocol-from: {exc}") from None
        found["proxy_protocol_from"] = options.proxy_protocol_from
    if options.upstream is not None:
        try:
            target = options.upstream_target or "address"
            found["upstream"] = parse_upstream(options.upstream, target)
        except ValueError as exc:
            raise ValueError(f"--upstream: {exc}") from None
    elif options.upstream_target is not None:
        raise ValueError("--upstream-target needs --upstream (the policy has upstream_target)")
    credentials_from_env(os.environ)
    return found


def admin_problem(options: ServeOptions) -> str:
    """--admin, --admin-token-file and --drain-delay that cannot work (exit 2)."""
    from egressbox.serve.admin import parse_admin_address

    if not 0 <= options.drain_delay <= MAX_DRAIN_DELAY:
        return f"--drain-delay: use 0-{MAX_DRAIN_DELAY:g} seconds, not {options.drain_delay:g}"
    if options.admin is None:
        if options.admin_token_file is not None:
            return "--admin-token-file needs --admin ADDR:PORT"
        return ""
    try:
        _, port = parse_admin_address(options.admin)
    except ValueError as exc:
        return f"--admin: {exc}"
    if port and port in (options.http_port, options.socks_port):
        # The proxy's ports serve nothing but proxying (DESIGN §3).
        return f"--admin: port {port} is a proxy port; give the admin listener a port of its own"
    return ""


def ask_command(options: ServeOptions) -> list[str]:
    """--ask-command as argv (checked by ask_problem first); [] without one."""
    return command_argv(options.ask_command) if options.ask_command is not None else []


def ask_problem(options: ServeOptions) -> str:
    """--ask-command, --ask-timeout and --save-approved that cannot work (exit 2)."""
    if options.ask_command is None:
        return "--save-approved needs --ask-command" if options.save_approved else ""
    if not options.ask_timeout > 0:
        return f"--ask-timeout: must be more than 0 seconds, got {options.ask_timeout:g}"
    if options.workers > 1:
        # Each worker would ask on its own and remember its own session answers: a client's
        # next connection, landing in another worker, would be asked again.
        return (
            "--ask-command cannot be combined with --workers above 1 (each worker would ask "
            "and remember its answers on its own); run one process"
        )
    try:
        command_argv(options.ask_command)
    except ValueError as exc:
        return f"--ask-command: {exc}"
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
    *,
    sockets: dict[str, socket.socket] | None = None,
    meter: Meter | None = None,
    broker: Broker | None = None,
) -> EgressProxy | None:
    """The proxy on the options' ports, or on `sockets` (a worker's, or systemd's), started;
    None when it cannot start (said on stderr). `meter` counts for the admin listener."""
    # --nameserver overrides [dns] nameservers (keeping its timeout and cache);
    # without it the proxy builds the resolver from [dns] itself, so that a
    # SIGHUP reload with changed [dns] settings takes effect.
    resolver = resolver_for(policy, servers, meter) if servers else None
    ports: dict[str, Any] = {"http_port": options.http_port, "socks_port": options.socks_port}
    if sockets is not None:
        http, socks = sockets.get("http"), sockets.get("socks5")
        ports = {
            "http_port": None,
            "socks_port": None,
            "http_sockets": [http] if http is not None else (),
            "socks_sockets": [socks] if socks is not None else (),
        }
    argv = ask_command(options)
    proxy = EgressProxy(
        policy,
        broker=broker,
        listen=options.listen,
        resolver=resolver,
        audit=audit,
        log=None if options.quiet else stderr_log,
        on_miss=CommandDecider(argv) if argv else None,
        ask_timeout=options.ask_timeout,
        meter=meter,
        **chain_arguments(options),
        **ports,
    )
    try:
        await proxy.start()
    except (OSError, ValueError) as exc:
        _fail(f"cannot start the proxy: {exc}", EXIT_START)
        return None
    return proxy


async def _serving_proxy(  # noqa: PLR0917 (what _started_proxy takes, and the process)
    options: ServeOptions,
    policy: Policy,
    servers: list[tuple[str, int]],
    audit: AuditSink | None,
    process: ServingProcess,
    sockets: dict[str, socket.socket] | None,
) -> EgressProxy | None:
    """The proxy started, then this process's admin listener (one serve or a worker); None
    when either cannot start (said on stderr; the proxy is closed again)."""
    proxy = await _started_proxy(
        options,
        policy,
        servers,
        audit,
        sockets=sockets,
        meter=process.metrics,
        broker=process.prepared.broker,
    )
    if proxy is None:
        return None
    try:
        await process.start(proxy)
    except OSError as exc:
        await proxy.close(0)
        _fail(f"cannot start the admin listener: {exc}", EXIT_START)
        return None
    return proxy


async def _serve(
    options: ServeOptions,
    policy: Policy,
    servers: list[tuple[str, int]],
    audit: AuditSink | None,
    prepared: Prepared,
) -> int:
    process = ServingProcess(prepared, admin_socket=prepared.admin_socket)
    # Sockets systemd passed replace the flags' listeners (a kind it passed none of is off).
    inherited = prepared.inherited or None
    proxy = await _serving_proxy(options, policy, servers, audit, process, inherited)
    if proxy is None:
        return EXIT_START
    # Signal handlers before the ready line: a supervisor may send SIGHUP or
    # SIGTERM as soon as it reads the line, and SIGHUP's default action kills.
    _install_signals(proxy, options, process, audit)
    # The ready line: one JSON object, then nothing else on stdout (records
    # go there only with --audit-log -).
    line = process.ready_line(proxy.ready_line())
    os.write(sys.stdout.fileno(), (json.dumps(line) + "\n").encode())
    process.serving(lambda: _reload(proxy, options, process))
    await process.stop.wait()
    await process.drain(proxy)
    return _save_approved(options, proxy)


def _save_approved(options: ServeOptions, proxy: EgressProxy) -> int:
    """--save-approved at exit: what was approved, as a policy file (said on stderr)."""
    path, approvals = options.save_approved, proxy.approvals
    if path is None or approvals is None:
        return EXIT_OK
    approved = approvals.approved()
    try:
        save_approved(path, approved)
    except OSError as exc:
        return _fail(f"--save-approved: cannot write {path}: {exc}", EXIT_RUNTIME)
    kept = sum(1 for item in approved if item.answer is Answer.SESSION)
    stderr_log(
        f"--save-approved: wrote {path} ({kept} allowed for the session, "
        f"{len(approved) - kept} allowed once and commented out)"
    )
    return EXIT_OK


# -- --workers N --------------------------------------------------------------------------


def serve_workers(
    options: ServeOptions,
    policy: Policy,
    servers: list[tuple[str, int]],
    prepared: Prepared | None = None,
) -> int:
    """`serve --workers N` (N > 1): bind in the parent, fork, supervise (see workers.py)."""
    from egressbox.serve.workers import bind_listeners, run_workers, share_limits

    count = options.workers
    if options.audit_log is not None and options.audit_log != "-":
        # Check (before any fork) that the log can be opened, and end a torn tail
        # here, once, rather than in every worker.
        try:
            open_audit(options).close()  # type: ignore[union-attr]
            end_torn_tail(options.audit_log)
        except (AuditError, ValueError) as exc:
            return _fail(f"--audit-log: {exc}", EXIT_START)
    prepared = prepared or Prepared(workers=count)
    if prepared.inherited:
        # systemd's sockets: every worker accepts on the same one (no SO_REUSEPORT group).
        groups = {kind: [sock] for kind, sock in prepared.inherited.items()}
    else:
        try:
            groups = bind_listeners(
                options.listen, {"http": options.http_port, "socks5": options.socks_port}, count
            )
        except (OSError, ValueError) as exc:
            return _fail(f"cannot start the proxy: {exc}", EXIT_START)
    shared = share_limits(policy, count)
    own = _worker_sockets(prepared, count)

    def worker_main(index: int, sockets: dict[str, socket.socket], report_fd: int, go: int) -> int:
        return _worker(
            options,
            policy=shared,
            servers=servers,
            sockets=sockets,
            report_fd=report_fd,
            go=go,
            process=(prepared, index),
        )

    authority = prepared.admin_authority()
    return run_workers(
        count,
        groups,
        worker_main,
        own=own,
        ready_extra={"admin": authority} if authority is not None else {},
        notifier=prepared.notifier,
        watch=prepared.watch,
    )


def _worker_sockets(prepared: Prepared, count: int) -> list[dict[str, socket.socket]]:
    """Per worker, the sockets only it gets: worker 0 the admin listener and the end of the
    snapshot channel it reads, every other worker the end it sends on (fleet.py)."""
    if prepared.admin_socket is None:
        return []
    collect, send = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    first = {"admin": prepared.admin_socket, "metrics": collect}
    return [first] + [{"metrics": send} for _ in range(count - 1)]


def _worker(
    options: ServeOptions,
    *,
    policy: Policy,
    servers: list[tuple[str, int]],
    sockets: dict[str, socket.socket],
    report_fd: int,
    go: int,
    process: tuple[Prepared, int],
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
                process=process,
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
    process: tuple[Prepared, int],
) -> int:
    from egressbox.serve.workers import report, share_limits, wait_for_go

    prepared, index = process
    serving = ServingProcess(
        prepared,
        index=index,
        channel=sockets.pop("metrics", None),
        admin_socket=sockets.pop("admin", None),
    )
    proxy = await _serving_proxy(options, policy, servers, audit, serving, sockets)
    if proxy is None:
        return EXIT_START
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, serving.on_stop_signal)
    loop.add_signal_handler(signal.SIGTERM, serving.on_stop_signal)

    def reload() -> None:
        try:
            fresh = load_policy(options.policy_path)
        except PolicyError as exc:
            serving.reloaded(False)
            report(report_fd, "reload", message=f"reload refused, keeping the old policy: {exc}")
            return
        if options.report_only:
            fresh = with_mode(fresh, Mode.REPORT)
        closing = not options.keep_open_on_reload
        fixed = unchanged_on_reload(proxy.state.policy, fresh)
        proxy.set_policy(share_limits(fresh, options.workers), close_denied=closing)
        serving.reloaded(True)
        # One answer per worker (the parent says each distinct one once).
        said = f"policy reloaded from {options.policy_path}"
        report(report_fd, "reload", message=f"{said}; {fixed}" if fixed else said)

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
        serving.on_stop_signal()  # the parent went away instead
    serving.serving(reload)
    await serving.stop.wait()
    await serving.drain(proxy)
    return EXIT_OK


def _install_signals(
    proxy: EgressProxy, options: ServeOptions, process: ServingProcess, audit: AuditSink | None
) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, process.on_stop_signal)
    loop.add_signal_handler(signal.SIGTERM, process.on_stop_signal)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(proxy, options, process))
    if isinstance(audit, JsonlFileSink):
        # SIGUSR1: reopen the audit log after an external logrotate moved it.
        loop.add_signal_handler(signal.SIGUSR1, lambda: _reopen(audit))


def _reopen(audit: JsonlFileSink) -> None:
    try:
        audit.reopen()
    except AuditError as exc:
        stderr_log(f"audit log reopen failed, still writing the old file: {exc}")


def _reload(proxy: EgressProxy, options: ServeOptions, process: ServingProcess) -> None:
    """SIGHUP and --watch-policy: one path."""
    closing = not options.keep_open_on_reload
    process.reloaded(
        reload_policy(proxy, options.policy_path, options.report_only, close_denied=closing)
    )


def reload_policy(
    proxy: EgressProxy, path: str, report_only: bool = False, *, close_denied: bool = True
) -> bool:
    """SIGHUP: load the file anew; a bad file keeps the old policy and says why. With
    `close_denied` what is open is judged again and closed when the new policy denies it
    (each closure audited and logged: EgressProxy.close_denied)."""
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        stderr_log(f"reload refused, keeping the old policy: {exc}")
        return False
    if report_only:
        policy = with_mode(policy, Mode.REPORT)
    fixed = unchanged_on_reload(proxy.state.policy, policy)
    proxy.set_policy(policy, close_denied=close_denied)
    stderr_log(f"policy reloaded from {path}")
    if fixed:
        stderr_log(fixed)
    return True
