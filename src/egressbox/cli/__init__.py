"""The `egressbox` command: a thin shell over the library (same names, same defaults).

Exit codes (README "Exit codes"): 0 ok; 1 runtime error; 2 usage or bad policy;
3 a server that could not start; for `run`, the child's code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from egressbox.cli import startup
from egressbox.core.errors import EgressboxError, HostError, PolicyError, print_policy_error
from egressbox.core.exitcodes import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from egressbox.core.version import __version__

startup.prepare()

if TYPE_CHECKING:
    from egressbox.core.decide import Decision
    from egressbox.core.policy import Policy

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

# The policy module (and idna, tomllib) is imported only where a command
# needs it: `egressbox run` loads the policy while the launcher starts.
ENV_ALLOW = "EGRESSBOX_ALLOW"
EXPLAIN_DEFAULT_PORT = 443

DESCRIPTION = """\
egressbox decides which network destinations a program may reach.

A policy file (TOML) lists the hosts a program may talk to; egressbox
resolves names itself, checks every address and refuses the rest.
Start with `egressbox check POLICY` and `egressbox explain --policy POLICY HOST`.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter, sized like it but without importing shutil (and with it
    bz2 and lzma: ~1.3 ms of every `run`'s start, since each add_argument builds one)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24) -> None:
        super().__init__(prog, indent_increment, max_help_position, _terminal_columns() - 2)


def _terminal_columns() -> int:
    # shutil.get_terminal_size(): $COLUMNS, else the terminal on stdout, else 80.
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno() if sys.__stdout__ else 1)[0]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from egressbox.cli.examples import epilog

        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("epilog", epilog(kwargs.get("prog")))  # `--help` ends with examples
        super().__init__(*args, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; `command` (when known) lets other commands skip
    importing the audit reader, which `run`'s start-up time would pay for."""
    parser = _Parser(prog="egressbox", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"egressbox {__version__}")
    parser_class: type[argparse.ArgumentParser] = _Parser
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=parser_class
    )
    for name, add in (
        ("serve", _add_serve),
        ("run", _add_run),
        ("check", _add_check),
        ("explain", _add_explain),
        ("doctor", _add_doctor),
        ("connect", _add_connect),
    ):
        if command in (None, name):
            add(sub)
        else:
            sub.add_parser(name)  # another command is parsed: only its name is needed
    for name in LAYER_COMMANDS:
        if command in (None, name):
            _layer_command(name).add_parser(sub)
        else:
            sub.add_parser(name)
    if command in (None, "audit"):
        from egressbox.cli import audit as audit_cli

        audit_cli.add_parser(sub)
    else:
        sub.add_parser("audit", help="read audit logs, summarize them, suggest a policy")
    return parser


# A staged run's layer: listed, applied or dropped (src/egressbox/cli/<name>.py each).
LAYER_COMMANDS = ("changes", "apply", "discard")


def _layer_command(name: str) -> Any:
    import importlib

    return importlib.import_module(f"egressbox.cli.{name}")


def _cmd_layer(args: argparse.Namespace) -> int:
    return int(_layer_command(args.command).main(args))


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand when argv starts with it (no top-level option before it, such as
    --help, could then list the other commands)."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def _add_serve(sub: Subparsers) -> None:
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
    _add_ask_common(p)
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
    _add_upstream(p)
    _add_nameserver(p)
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


def _add_upstream(p: argparse.ArgumentParser, *, doctor: bool = False) -> None:
    what = "describe chaining through" if doctor else "reach allowed destinations through"
    p.add_argument(
        "--upstream",
        metavar="URL",
        help=f"{what} this proxy: http://HOST:PORT (CONNECT) or socks5://HOST:PORT; every "
        "request is still decided by the policy first (overrides [egress] upstream). "
        "Credentials: EGRESSBOX_UPSTREAM_USER and EGRESSBOX_UPSTREAM_PASSWORD",
    )
    p.add_argument(
        "--upstream-target",
        choices=["address", "name"],
        help="ask the upstream for the checked address (default; pinning holds) or for the "
        "name (the upstream resolves it: pinning: partial)",
    )


def _add_ask_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ask-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="a question not answered within SECONDS denies (default 30)",
    )
    p.add_argument(
        "--save-approved",
        metavar="FILE",
        help="at exit, write the destinations approved when asked as a policy file (allowed "
        "for the session: entries; allowed once: commented out)",
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


def _add_run(sub: Subparsers) -> None:
    from egressbox.runner.flags import RUN_FLAGS

    p = sub.add_parser(
        "run",
        help="run a command confined behind a managed proxy",
        description="Run CMD behind a managed proxy on ephemeral loopback ports, confined so "
        "that the proxy is the only endpoint it can reach (network namespace, Landlock, "
        "seccomp, no new privileges). stdin/stdout/stderr pass through; the exit code is "
        "CMD's (128+N when it dies from signal N), 126 when the profile's required "
        "confinement is unavailable, 127 when CMD is not found.",
    )
    shared = {"ask_common": _add_ask_common, "upstream": _add_upstream}
    shared["nameserver"] = _add_nameserver
    groups: dict[str, Any] = {}
    for flag in RUN_FLAGS:  # declared once, with the keyword each sets (runner/flags.py)
        if flag.shared:
            add = shared.pop(flag.shared, None)  # a helper adds its flags once
            if add is not None:
                add(p)
            continue
        target: Any = p
        if flag.group:
            if flag.group not in groups:
                groups[flag.group] = p.add_mutually_exclusive_group()
            target = groups[flag.group]
        kwargs = dict(flag.argparse)
        if "type" in kwargs:
            kwargs["type"] = _ARG_TYPES[kwargs["type"]]
        target.add_argument(*flag.names, **kwargs)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


# The converters runner/flags.py names by "type".
_ARG_TYPES: dict[str, Any] = {"seconds": _seconds, "int": int}


def _add_check(sub: Subparsers) -> None:
    p = sub.add_parser(
        "check",
        help="validate policy files and report every problem",
        description="Validate policy files. Prints every problem with its key and the fix, "
        "then warnings. Exit 0 when all files are valid, 2 otherwise.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="policy file (TOML)")
    p.add_argument("--quiet", "-q", action="store_true", help="print errors only")


def _add_explain(sub: Subparsers) -> None:
    p = sub.add_parser(
        "explain",
        help="show what a policy decides for a destination (resolving it for real)",
        description="Decide HOST[:PORT] as the proxy would: name rules, real DNS resolution, "
        "every address checked. Prints the decision, the reason code, the matching rule and "
        f"the addresses. The port defaults to {EXPLAIN_DEFAULT_PORT}. A malformed target is "
        "a deny with bad_host or bad_port (exit 0).",
    )
    p.add_argument("target", metavar="HOST[:PORT]", help="e.g. pypi.org:443 or [2001:db8::1]:80")
    p.add_argument(
        "--policy",
        metavar="FILE",
        help=f"policy file (TOML); without it and without {ENV_ALLOW}, everything is denied",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_nameserver(p)


def _add_nameserver(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nameserver",
        action="append",
        default=[],
        metavar="IP[:PORT]",
        help="use only this DNS server (repeatable); the hosts file and the system "
        "configuration are then not consulted",
    )


def _add_doctor(sub: Subparsers) -> None:
    p = sub.add_parser(
        "doctor",
        help="show which confinement mechanisms this host supports",
        description="Probe this host: Landlock ABI, seccomp, no_new_privs, user, network, "
        "mount and PID namespaces. Nothing is changed.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--policy", metavar="FILE", help="also say how its [egress] upstream would be used"
    )
    p.add_argument(
        "--apparmor-profile",
        action="store_true",
        help="print an AppArmor profile that lets this egressbox create user namespaces "
        "where Ubuntu restricts them, and exit (install it under /etc/apparmor.d/)",
    )
    _add_upstream(p, doctor=True)


def _add_connect(sub: Subparsers) -> None:
    p = sub.add_parser(
        "connect",
        help="relay stdin/stdout to HOST PORT through a running proxy (ssh's ProxyCommand)",
        description="Open HOST:PORT through a running egressbox proxy (it decides and audits "
        "it like any request) and relay standard input and output: "
        "ssh -o ProxyCommand='egressbox connect %%h %%p' HOST. The proxy comes from --proxy or "
        "from https_proxy/http_proxy/ALL_PROXY.",
    )
    p.add_argument("host", metavar="HOST")
    p.add_argument("port", metavar="PORT", type=int)
    p.add_argument(
        "--proxy", metavar="URL", help="http://HOST:PORT (CONNECT) or socks5://HOST:PORT"
    )


def cmd_connect(args: argparse.Namespace) -> int:
    from egressbox.cli import connect

    return connect.main(args.host, args.port, args.proxy)


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_of(words)).parse_args(words)
    handlers = {
        "serve": cmd_serve,
        "run": cmd_run,
        "check": cmd_check,
        "explain": cmd_explain,
        "doctor": cmd_doctor,
        "connect": cmd_connect,
        "audit": _cmd_audit,
        **dict.fromkeys(LAYER_COMMANDS, _cmd_layer),
    }
    try:
        code = handlers[args.command](args)
        if argv is None and args.command == "run":
            # The command has finished and every record is written: skip the
            # interpreter's teardown of the proxy's modules (~7 ms per run).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    except PolicyError as exc:
        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE
    except EgressboxError as exc:
        print(f"egressbox: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `egressbox ... | head`: the reader left; exit quietly like coreutils.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_RUNTIME


def _cmd_audit(args: argparse.Namespace) -> int:
    from egressbox.cli import audit as audit_cli

    return audit_cli.run(args)


# -- check ---------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            from egressbox.core.policy import load_policy

            policy = load_policy(path, env={})
        except PolicyError as exc:
            print_policy_error(exc, sys.stdout)
            status = EXIT_USAGE
            continue
        print(f"{path}: ok ({_summary(policy)})")
        if not args.quiet:
            from egressbox.core.secrets import serve_needs_ca

            ca = serve_needs_ca(policy.secrets, policy.request_rules, policy.tls)
            for warning in (*policy.warnings, *([ca] if ca else [])):
                print(f"  warning: {warning}")
    return status


def _summary(policy: Policy) -> str:
    allow, deny = len(policy.allow.rules), len(policy.deny.rules)
    return (
        f"{allow} allow, {deny} deny, {len(policy.allow_cidrs)} allow_cidrs, "
        f"{len(policy.deny_cidrs)} deny_cidrs; mode {policy.mode.value}"
    )


# -- explain -------------------------------------------------------------------------


# explain takes a URL too: its port defaults by scheme.
URL_DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443, "ftp": 21, "ssh": 22}


def split_target(text: str) -> tuple[str, str | int]:
    """`HOST[:PORT]` or a URL for explain; a bare IPv6 address is accepted without brackets."""
    scheme, sep, rest = text.partition("://")
    if sep and scheme.isalpha():
        authority = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
        url_host, url_port = split_target(authority)
        default = URL_DEFAULT_PORTS.get(scheme.lower(), EXPLAIN_DEFAULT_PORT)
        has_port = authority.rsplit("]", 1)[-1].count(":") == 1
        return url_host, url_port if has_port else default
    try:
        from egressbox.core.hosts import split_authority

        host, port = split_authority(text)
    except HostError:
        # A bare IPv6 address (no port), or garbage that check() will call bad_host.
        return text, EXPLAIN_DEFAULT_PORT
    return host, EXPLAIN_DEFAULT_PORT if port is None else port


def cmd_explain(args: argparse.Namespace) -> int:
    from egressbox.core.policy import load_policy_or_environment
    from egressbox.net.resolve import parse_nameserver, resolver_for
    from egressbox.proxy.check import check

    policy = load_policy_or_environment(args.policy)
    from egressbox.core.policy import Mode

    if policy is not None and policy.mode is Mode.REPORT:
        print("egressbox: warning: report mode lets denied names through", file=sys.stderr)
    try:
        servers = [parse_nameserver(text) for text in args.nameserver]
    except ValueError as exc:
        print(f"egressbox: --nameserver: {exc}", file=sys.stderr)
        return EXIT_USAGE
    resolver = resolver_for(policy, servers)
    host, port = split_target(args.target)
    import asyncio

    decision = asyncio.run(check(policy, resolver, host, port))
    print(_explain_json(decision) if args.json else _explain_text(decision))
    return EXIT_OK


def _ip_texts(decision: Decision) -> list[str]:
    from egressbox.core.hosts import canonical_ip_text

    return [canonical_ip_text(ip) for ip in decision.addresses]


def decision_dict(decision: Decision) -> dict[str, object]:
    return {
        "decision": decision.verdict.value,
        "reason": decision.reason.value,
        "host": decision.host,
        "port": decision.port,
        "addresses": _ip_texts(decision),
        "rule": decision.rule,
        "detail": decision.detail,
    }


def _explain_json(decision: Decision) -> str:
    return json.dumps(decision_dict(decision))


def _explain_text(decision: Decision) -> str:
    d = decision_dict(decision)
    addresses = ", ".join(_ip_texts(decision)) or "-"
    target = f"{decision.host}:{decision.port}" if decision.port else decision.host
    return "\n".join(
        [
            f"{d['decision']}  {target}",
            f"  reason:    {d['reason']}",
            f"  rule:      {d['rule'] or '-'}",
            f"  addresses: {addresses}",
            f"  detail:    {d['detail']}",
        ]
    )


# -- serve ---------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from egressbox.serve.command import ServeOptions, serve

    options = ServeOptions(
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
    return serve(options)


def _proxy_protocol_from(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--proxy-protocol-from's senders; --proxy-protocol alone trusts loopback only."""
    if args.proxy_protocol_from:
        return tuple(args.proxy_protocol_from)
    if args.proxy_protocol:
        from egressbox.protocols.proxy_header import DEFAULT_TRUSTED

        return DEFAULT_TRUSTED
    return None


# -- run -----------------------------------------------------------------------------


# Harn's flags and the root flags --no-sandbox refuses (Harn: "rejected alongside
# --no-sandbox, which would make them meaningless"): (dest, the flag as Harn names it).
_ROOT_FLAGS = (
    ("write_root", "--write-root"),
    ("read_root", "--read-root/--read-only-root"),
    ("process_write_root", "--process-write-root/--sandbox-write-root"),
    ("process_read_root", "--process-read-root/--sandbox-read-root"),
)


def no_sandbox(args: argparse.Namespace) -> str:
    """--no-sandbox as --profile unrestricted; a problem with it ("" when none)."""
    if not getattr(args, "no_sandbox", False):
        return ""
    given = [flag for dest, flag in _ROOT_FLAGS if getattr(args, dest, None)]
    if given:
        return f"--no-sandbox refuses {', '.join(given)}: without a sandbox a root means nothing"
    if args.profile not in (None, "unrestricted"):
        return f"--no-sandbox is --profile unrestricted; --profile {args.profile} contradicts it"
    args.profile = "unrestricted"
    return ""


def cmd_run(args: argparse.Namespace) -> int:
    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print(
            "egressbox run: give the command after --, e.g. egressbox run -- curl URL",
            file=sys.stderr,
        )
        return EXIT_USAGE
    problem = no_sandbox(args)
    if problem:
        print(f"egressbox run: {problem}", file=sys.stderr)
        return EXIT_USAGE
    from egressbox.runner import zygote

    # The launcher's imports run in the zygote while this process plans the run.
    zygote.start()
    try:
        from egressbox.cli.run import run_command

        return run_command(args, argv)
    finally:
        zygote.discard()


# -- doctor --------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    from egressbox.confine.probe import format_table, namespace_blocker, probe_host, to_json

    if args.apparmor_profile:
        from egressbox.confine.blockers import apparmor_profile
        from egressbox.confine.probe import entry_point

        print(apparmor_profile(entry_point()), end="")
        return EXIT_OK
    try:
        chaining = _doctor_upstream(args)
    except ValueError as exc:
        print(f"egressbox doctor: --upstream: {exc}", file=sys.stderr)
        return EXIT_USAGE
    support = probe_host()
    from egressbox.runner.facts import remember_probe

    remember_probe(support)  # what `run` believes next is what doctor says now
    profiles = profile_support(support)
    core = _core_line()
    blocked = namespace_blocker()
    if args.json:
        data = to_json(support)
        data["namespace_blocker"] = (
            None
            if blocked is None
            else {"cause": blocked.cause, "why": blocked.why, "fix": blocked.fix}
        )
        data["profiles"] = profiles
        data["proxy_core"] = core
        data["upstream"] = chaining
        print(json.dumps(data))
        return EXIT_OK
    print(format_table(support))
    print()
    if blocked is not None:
        print(f"namespaces: blocked ({blocked.cause}): {blocked.why}")
        print(f"  to lift it: {blocked.fix}")
        print()
    print(_profiles_table(profiles))
    print()
    print(f"proxy core: {core}")
    print(f"upstream: {chaining['line']}")
    return EXIT_OK


def _doctor_upstream(args: argparse.Namespace) -> dict[str, Any]:
    """The upstream `serve`/`run` would chain through (--upstream, else --policy's), and
    whether pinning holds through it."""
    from egressbox.core.upstream import parse_upstream
    from egressbox.protocols.upstream import describe_upstream

    upstream = None
    if args.upstream is not None:
        upstream = parse_upstream(args.upstream, args.upstream_target or "address")
    elif args.policy is not None:
        from egressbox.core.policy import load_policy

        upstream = load_policy(args.policy, env={}).upstream
    return describe_upstream(upstream)


def _core_line() -> str:
    """Whether the proxy core runs compiled, and how to get it if not."""
    import egressbox

    if egressbox.compiled_core():
        return "compiled (mypyc)"
    if os.environ.get(egressbox.PURE_ENV) == "1":
        return f"interpreted ({egressbox.PURE_ENV}=1)"
    return (
        "interpreted: with gcc and the Python headers (Debian: python3-dev) a reinstall"
        " compiles it, for less CPU per connection"
    )


def profile_support(support: object) -> dict[str, dict[str, object]]:
    """What each `run` profile would enforce on this host, and what it would refuse."""
    from egressbox.confine.grants import HostFacts, Profile, choose_mechanisms, wanted
    from egressbox.confine.probe import HostSupport
    from egressbox.runner.assemble import SUPERVISOR, planned_network_boundary

    assert isinstance(support, HostSupport)
    status = {m.name: m.status.value for m in support.mechanisms()}
    available = frozenset(n for n, v in status.items() if v == "available")
    facts = HostFacts(available, status, support.landlock.abi or 0, support.euid)
    result: dict[str, dict[str, object]] = {}
    for profile in Profile:
        chosen, refusals = choose_mechanisms(profile, facts)
        enforced = [m.value for m in chosen]
        boundary, supervised = planned_network_boundary(chosen, available)
        if supervised:
            enforced.append(SUPERVISOR)  # holds the boundary by address in place of a namespace
        result[profile.value] = {
            "enforced": sorted(enforced),
            "missing": sorted(m.value for m in wanted(profile) - chosen),
            "refuses": [r.message() for r in refusals],
            "network_boundary": boundary.value,
        }
    return result


def _profiles_table(profiles: dict[str, dict[str, object]], width: int = 0) -> str:
    """PROFILE, WOULD ENFORCE HERE, MISSING, sized to their contents and to the terminal
    (or `width`): a list too long for its column wraps between items, a refusal under its row."""
    import itertools
    import textwrap

    width = width or _terminal_columns()
    rows = [(name, _texts(r["enforced"]), _texts(r["missing"])) for name, r in profiles.items()]
    name_w = max(len(name) for name in ["PROFILE", *profiles])
    # The widest a column needs (all on one line), and the least (its longest item).
    most = [max(len(", ".join(r[i])) for r in rows) for i in (1, 2)]
    least = [max((len(item) + 1 for r in rows for item in r[i]), default=1) for i in (1, 2)]
    missing_w = max(most[1], len("MISSING"))
    room = width - name_w - 4
    if max(most[0], len("WOULD ENFORCE HERE")) + missing_w > room:
        missing_w = max(len("MISSING"), least[1], min(missing_w, room // 3))
    enforced_w = max(len("WOULD ENFORCE HERE"), least[0], min(most[0], room - missing_w))
    lines = [f"{'PROFILE':<{name_w}}  {'WOULD ENFORCE HERE':<{enforced_w}}  MISSING"]
    for name, enforced, missing in rows:
        cells = (_pack(enforced, enforced_w), _pack(missing, missing_w))
        for first, (left, right) in enumerate(itertools.zip_longest(*cells, fillvalue="")):
            label = "" if first else name
            lines.append(f"{label:<{name_w}}  {left:<{enforced_w}}  {right}".rstrip())
        indent = " " * (name_w + 2)
        for refusal in _texts(profiles[name]["refuses"]):
            wrapped = textwrap.wrap(refusal, max(width - len(indent), 20))
            lines += [indent + line for line in wrapped]
    return "\n".join(lines)


def _texts(value: object) -> list[str]:
    return [str(item) for item in value] if isinstance(value, list) else []


def _pack(items: list[str], width: int) -> list[str]:
    """A comma-separated list in lines of at most `width`, broken only between items."""
    lines = [""]
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if lines[-1] and len(lines[-1]) + 1 + len(piece) > width:
            lines.append(piece)
        else:
            lines[-1] = f"{lines[-1]} {piece}".lstrip()
    return lines if items else ["-"]


if __name__ == "__main__":
    sys.exit(main())
