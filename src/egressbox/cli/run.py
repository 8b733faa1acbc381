"""`egressbox run`: the command line's front of the library (no asyncio before the fork)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from egressbox.confine.executable import CommandNotFoundError
from egressbox.errors import EgressboxError
from egressbox.exitcodes import EXIT_CANNOT_CONFINE, EXIT_NOT_FOUND
from egressbox.runner.api import run_options_sync
from egressbox.runner.options import (
    RunOptions,
    RunRefusedError,
    RunResult,
    with_settings,
    write_err,
)

if TYPE_CHECKING:
    from egressbox.audit import AuditSink
    from egressbox.policy import Policy, RunSettings


def run_command(args: Any, argv: list[str]) -> int:
    """`egressbox run`: the CLI front of run_sync (no asyncio imported before the fork)."""
    from egressbox.errors import AuditError
    from egressbox.exitcodes import EXIT_USAGE

    settings = _cli_run_settings(args)
    if isinstance(settings, int):
        return settings
    options = _cli_options(args, argv, settings)
    if options is None:
        return EXIT_USAGE
    audit: AuditSink | None = None
    try:
        if args.audit_log:
            from egressbox.audit import JsonlFileSink  # only then: it costs ~5 ms

            audit = JsonlFileSink(args.audit_log)
    except AuditError as exc:
        write_err(f"--audit-log: {exc}")
        return EXIT_USAGE
    try:
        result = _run_reporting_errors(options, audit, args)
    finally:
        if audit is not None:
            audit.close()
    if isinstance(result, int):
        return result
    if args.report:
        for row in result.report:
            write_err(f"enforcement: {row.mechanism}: {row.enforcement.value} ({row.detail})")
        for root in result.roots:
            write_err(f"root: {root.kind}: {root.path} ({root.detail})")
    for line in result.created_trusted:
        write_err(f"warning: {line}")
    if result.refusal is not None:
        write_err(result.refusal.line(result.exit_code))
    return result.exit_code


def _cli_policy(args: Any) -> Policy | None:
    """The command line's policy (loaded while the launcher starts)."""
    from egressbox.policy import load_policy_or_environment

    policy = load_policy_or_environment(args.policy)
    if policy is None:
        write_err(
            "warning: no policy: every destination is denied "
            "(pass --policy FILE, or set EGRESSBOX_ALLOW=host:port,...)"
        )
    if policy is not None and args.report_only:
        from egressbox.policy import Mode
        from egressbox.suggest import with_mode

        policy = with_mode(policy, Mode.REPORT)
        write_err("warning: report mode lets names outside the allow list through")
    return policy


def _cli_run_settings(args: Any) -> RunSettings | int | None:
    """--policy's [process], [filesystem] and [env], read before the fork (they shape
    the sandbox); the rest of the policy loads while the launcher starts."""
    if not args.policy:
        return None
    from egressbox.errors import PolicyError
    from egressbox.policy import load_run_settings

    try:
        return load_run_settings(args.policy)
    except PolicyError as exc:
        from egressbox.errors import print_policy_error
        from egressbox.exitcodes import EXIT_USAGE

        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE


def _cli_options(
    args: Any, argv: list[str], settings: RunSettings | None = None
) -> RunOptions | None:
    from egressbox.confine.env import parse_grant

    try:
        grants = dict(parse_grant(text) for text in args.grant)
        servers = _nameservers(args.nameserver)
        chosen = with_settings(
            settings,
            profile=args.profile,
            env=args.env_policy,
            write_roots=args.write_root,
            read_roots=args.read_root,
            process_read_roots=args.process_read_root,
            process_write_roots=args.process_write_root,
            unix_socket_roots=args.unix_socket_root,
            writable_trusted=args.writable_trusted,
            grants=grants,
            timeout=args.timeout,
        )
    except ValueError as exc:
        write_err(str(exc))
        return None
    for path in chosen["writable_trusted"]:
        write_err(f"warning: {path} is host-trusted; the command may write it (--writable-trusted)")
    trusted = tuple(p for p in (args.policy, args.audit_log) if p and p != "-")
    return RunOptions(
        argv=tuple(argv),
        policy=None,
        allow_loopback=args.allow_loopback,
        allow_direct_network=args.allow_direct_network,
        pass_fds=tuple(args.pass_fd),
        nameservers=servers,
        trusted_files=trusted,
        log_allowed=getattr(args, "verbose", False),
        capture=not getattr(args, "no_capture", False),
        **chosen,
    )


def _nameservers(texts: Sequence[str]) -> tuple[tuple[str, int], ...]:
    if not texts:
        return ()
    # Imported only when asked for: it loads dnspython (~45 ms).
    from egressbox.resolve import parse_nameserver

    return tuple(parse_nameserver(text) for text in texts)


def _diagnostic(line: str) -> None:
    write_err(line)


def _run_reporting_errors(
    options: RunOptions, audit: AuditSink | None, args: Any
) -> RunResult | int:
    from egressbox.errors import PolicyError

    try:
        return run_options_sync(
            options,
            audit=audit,
            log=None if args.quiet else _diagnostic,
            policy_loader=lambda: _cli_policy(args),
        )
    except PolicyError as exc:
        from egressbox.errors import print_policy_error
        from egressbox.exitcodes import EXIT_USAGE

        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE
    except RunRefusedError as exc:
        for message in exc.messages:
            write_err(message)
        return EXIT_CANNOT_CONFINE
    except CommandNotFoundError as exc:
        write_err(str(exc))
        return EXIT_NOT_FOUND
    except EgressboxError as exc:
        write_err(str(exc))
        return EXIT_CANNOT_CONFINE
