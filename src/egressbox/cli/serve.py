"""`egressbox serve`: the egress proxy as a process (serve/command.py does the work)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from egressbox.cli.options import add_ask_common, add_nameserver, add_upstream

if TYPE_CHECKING:
    from egressbox.cli.options import Subparsers
    from egressbox.serve.command import ServeOptions


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "serve",
        help="run the egress proxy (HTTP CONNECT, plain HTTP, SOCKS5)",
        description="Run the egress proxy. Prints one JSON line to stdout when ready: "
        '{"event": "ready", "http": "127.0.0.1:PORT", "socks5": "127.0.0.1:PORT"}. '
        "SIGHUP reloads the policy (a bad file keeps the old one); SIGINT/SIGTERM stop "
        "accepting, let open connections finish for [limits] drain_timeout, then exit 0. "
        "Exit 2 on a bad policy, 3 when the proxy cannot start (port in use).",
    )
    p.add_argument("--policy", required=True, metavar="FILE", help="policy file (TOML)")
    p.add_argument(
        "--listen",
        default="127.0.0.1",
        metavar="ADDR",
        help="IP address to listen on (default 127.0.0.1; a wildcard makes an open proxy)",
    )
    p.add_argument("--http-port", type=int, default=0, metavar="N", help="0 picks a free port")
    p.add_argument("--socks-port", type=int, default=0, metavar="N", help="0 picks a free port")
    p.add_argument(
        "--audit-log",
        metavar="FILE",
        help="append audit records (JSON Lines) to FILE; '-' writes them to stdout",
    )
    p.add_argument(
        "--audit-max-bytes",
        type=int,
        metavar="N",
        help="rotate the audit log before it grows past N bytes (FILE -> FILE.1 ...)",
    )
    p.add_argument(
        "--audit-keep", type=int, default=5, metavar="N", help="rotated logs to keep (default 5)"
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="report mode: let names outside the allow list through, audited as would_deny "
        "(private/special addresses, deny entries and bad hosts stay refused)",
    )
    p.add_argument(
        "--workers",
        type=_workers,
        default=1,
        metavar="N|auto",
        help="worker processes sharing the ports (SO_REUSEPORT), 1-256; auto: one per usable "
        "CPU (default 1: one process, no fork); [limits] max_connections is split among them",
    )
    _add_serve_operations(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no per-connection line on stderr")
    p.add_argument(
        "--ask-command",
        metavar="CMD",
        help="ask CMD (shell words, no shell) about a destination no allow entry admits: it "
        'reads {"protocol", "host", "port"} as JSON on stdin (also EGRESSBOX_PROTOCOL, '
        "EGRESSBOX_HOST, EGRESSBOX_PORT; nothing else but PATH in its environment) and "
        "answers deny, once or session on stdout; a non-zero exit denies. Deny entries, "
        "deny_cidrs and the private/special ranges are never lifted. Not with --workers",
    )
    add_ask_common(p)
    p.add_argument(
        "--proxy-protocol",
        action="store_true",
        help="every connection must begin with a PROXY protocol header (v1 or v2, as HAProxy's "
        "send-proxy[-v2] or a cloud load balancer send it) from a trusted sender; others are "
        "closed. The client it names counts for max_connections_per_client. Trusted: "
        "--proxy-protocol-from, else loopback only",
    )
    p.add_argument(
        "--proxy-protocol-from",
        action="append",
        metavar="CIDR[,CIDR...]",
        help="the balancers trusted to send the header (repeatable; implies --proxy-protocol)",
    )
    add_upstream(p)
    add_nameserver(p)
    p.add_argument(
        "--ca-cert",
        metavar="PATH",
        help="the CA certificate (PEM) serve signs the certificates of the hosts a [[secret]] "
        "or [[request_rule]] names with; your clients must trust it (overrides [tls] ca_cert)",
    )
    p.add_argument(
        "--ca-key",
        metavar="PATH",
        help="its key (PEM, unencrypted, EC P-256 or RSA 2048+), mode 0600 or stricter: refused "
        "when group or others may open it (overrides [tls] ca_key)",
    )


def _add_serve_operations(p: argparse.ArgumentParser) -> None:
    """serve's flags for running in production (README "Running in production")."""
    p.add_argument(
        "--admin",
        metavar="ADDR:PORT",
        help="serve /metrics (Prometheus), /healthz and /readyz on ADDR:PORT, apart from the "
        "proxy ports (off by default; warned about when not loopback)",
    )
    p.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help="/metrics wants 'Authorization: Bearer TOKEN', TOKEN read from FILE "
        "(or from $EGRESSBOX_ADMIN_TOKEN; never on the command line)",
    )
    p.add_argument(
        "--watch-policy",
        action="store_true",
        help="reload the policy when its file changes (polled each second; a ConfigMap "
        "update too), as SIGHUP does: a bad file keeps the old policy",
    )
    p.add_argument(
        "--keep-open-on-reload",
        action="store_true",
        help="a reload (SIGHUP, --watch-policy) decides new connections only; by default "
        "open tunnels, kept-alive and WebSocket connections and requests held for an "
        "--ask-command answer that the new policy denies are closed (audited policy_reloaded)",
    )
    p.add_argument(
        "--drain-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="after SIGTERM/SIGINT keep accepting for SECONDS while /readyz says 503, so a "
        "load balancer stops sending before the listeners close (default 0)",
    )


def _workers(text: str) -> int:
    from egressbox.serve.workers import worker_count

    try:
        return worker_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(args: argparse.Namespace) -> int:
    from egressbox.serve.command import serve

    return serve(serve_options(args))


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The ServeOptions the parsed command line asks for."""
    from egressbox.serve.command import ServeOptions

    return ServeOptions(
        policy_path=args.policy,
        listen=args.listen,
        http_port=args.http_port,
        socks_port=args.socks_port,
        audit_log=args.audit_log,
        quiet=args.quiet,
        nameservers=tuple(args.nameserver),
        audit_max_bytes=args.audit_max_bytes,
        audit_keep=args.audit_keep,
        report_only=args.report_only,
        workers=args.workers,
        ask_command=args.ask_command,
        ask_timeout=args.ask_timeout,
        save_approved=args.save_approved,
        admin=args.admin,
        admin_token_file=args.admin_token_file,
        watch_policy=args.watch_policy,
        keep_open_on_reload=args.keep_open_on_reload,
        drain_delay=args.drain_delay,
        proxy_protocol_from=_proxy_protocol_from(args),
        upstream=args.upstream,
        upstream_target=args.upstream_target,
        ca_cert=args.ca_cert,
        ca_key=args.ca_key,
    )


def _proxy_protocol_from(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--proxy-protocol-from's senders; --proxy-protocol alone trusts loopback only."""
    if args.proxy_protocol_from:
        return tuple(args.proxy_protocol_from)
    if args.proxy_protocol:
        from egressbox.protocols.proxy_header import DEFAULT_TRUSTED

        return DEFAULT_TRUSTED
    return None
