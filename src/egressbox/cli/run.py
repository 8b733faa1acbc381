"""`egressbox run`: the command line's front of the library (no asyncio before the fork)."""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from egressbox.confine.env import parse_grant
from egressbox.confine.executable import CommandNotFoundError
from egressbox.core.errors import AuditError, EgressboxError, PolicyError, print_policy_error
from egressbox.core.exitcodes import EXIT_CANNOT_CONFINE, EXIT_NOT_FOUND, EXIT_USAGE
from egressbox.fs.held import HeldFile
from egressbox.runner.api import run_options_sync
from egressbox.runner.gate import report_lines
from egressbox.runner.options import (
    RunOptions,
    RunRefusedError,
    RunResult,
    options_for,
    write_err,
)
from egressbox.runner.project import PROJECT_POLICY, find_project_root, is_trusted, remember
from egressbox.runner.spawn import LaunchFailedError
from egressbox.runner.supervise import unix_refused_line

if TYPE_CHECKING:
    from egressbox.audit.record import AuditSink
    from egressbox.core.policy import Policy, RunSettings


def run_command(args: Any, argv: list[str]) -> int:
    """`egressbox run`: the CLI front of run_sync (no asyncio imported before the fork)."""
    if _project_policy(args) is not None:
        return EXIT_USAGE
    settings = _cli_run_settings(args)
    if isinstance(settings, int):
        return settings
    options = _cli_options(args, argv, settings)
    if options is None:
        return EXIT_USAGE
    audit: AuditSink | None = None
    try:
        if args.audit_log:
            from egressbox.audit.record import JsonlFileSink  # only then: it costs ~5 ms

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
        _print_report(args, result)
    _end_lines(args, result)
    _save_approved(args, result)
    if result.refusal is not None:
        write_err(result.refusal.line(result.exit_code))
    return result.exit_code


def _end_lines(args: Any, result: RunResult) -> None:
    """What the run's end says on stderr: trusted files put right, its way back, and (not
    with --quiet) the unix socket connects refused outside the grants."""
    for line in result.created_trusted:
        write_err(f"warning: {line}")
    lines = report_lines(result)
    if not args.quiet:
        lines.append(unix_refused_line(result))
    for line in filter(None, lines):
        write_err(line)


def _print_report(args: Any, result: RunResult) -> None:
    if result.profile:
        write_err(f"profile: {result.profile} (the one the command was confined under)")
    for row in result.report:
        write_err(f"enforcement: {row.mechanism}: {row.enforcement.value} ({row.detail})")
    for root in result.roots:
        write_err(f"root: {root.kind}: {root.path} ({root.detail})")
    if result.terminal_dropped:
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(result.terminal_dropped.items()))
        write_err(f"terminal: dropped escape sequences that reach beyond the screen: {kinds}")
    if getattr(args, "project_policy", False):
        write_err(f"policy: {args.policy} (the project root's, trusted: you ran with it)")


def _cli_policy(args: Any) -> Policy | None:
    """The command line's policy (loaded while the launcher starts)."""
    from egressbox.core.policy import load_policy_or_environment

    policy = load_policy_or_environment(args.policy)
    own = args.policy and not getattr(args, "project_policy", False)
    if own and os.path.basename(args.policy) == PROJECT_POLICY:
        remember(args.policy)  # runs without --policy may now use this version
    if policy is None:
        write_err(
            "warning: no policy: every destination is denied "
            "(pass --policy FILE, or set EGRESSBOX_ALLOW=host:port,...)"
        )
    if policy is not None and args.report_only:
        from egressbox.audit.suggest import with_mode
        from egressbox.core.policy import Mode

        policy = with_mode(policy, Mode.REPORT)
        write_err("warning: report mode lets names outside the allow list through")
    upstream = getattr(args, "chain_to", None)
    if policy is not None and upstream is not None:
        from egressbox.core.policy import with_upstream

        policy = with_upstream(policy, upstream)
    if policy is not None and policy.upstream is not None and policy.upstream.pinning != "full":
        write_err(f"warning: chaining through {policy.upstream.url} by name: pinning: partial")
    return policy


def _cli_upstream(args: Any) -> str | None:
    """--upstream/--upstream-target parsed (into args.chain_to) before the fork; the
    credentials' variables checked too. A problem is said and returned."""
    args.chain_to = None
    if not (
        getattr(args, "upstream", None) is not None
        or getattr(args, "upstream_target", None) is not None
        or any(name.startswith("EGRESSBOX_UPSTREAM_") for name in os.environ)
    ):
        return None  # nothing to check: the parser is not even loaded (~1.5 ms)
    from egressbox.core.upstream import parse_upstream
    from egressbox.protocols.upstream import credentials_from_env

    try:
        if getattr(args, "upstream", None) is not None:
            target = args.upstream_target or "address"
            args.chain_to = parse_upstream(args.upstream, target)
        elif getattr(args, "upstream_target", None) is not None:
            raise ValueError("--upstream-target needs --upstream")
        credentials_from_env(os.environ)
    except ValueError as exc:
        problem = f"--upstream: {exc}"
        write_err(problem)
        return problem
    return None


def _project_policy(args: Any) -> int | None:
    """Without --policy: the project root's egressbox.toml, if the user trusted this version
    (ran with it as --policy before); an untrusted one refuses the run (a cloned repository,
    or a command run here earlier, could have written it). None: go on."""
    if args.policy:
        return None

    found = find_project_root(os.path.realpath(os.getcwd())).policy
    if found is None:
        return None
    if not is_trusted(found):
        write_err(
            f"{found} is the project's policy, but egressbox has not run with this version "
            "of it before: a cloned repository or a command run here could have written it; "
            f"review it, then run once with --policy {found} to trust it"
        )
        return 1
    args.policy = found
    args.project_policy = True
    return None


def _cli_run_settings(args: Any) -> RunSettings | int | None:
    """--policy's [process], [filesystem] and [env], read before the fork (they shape
    the sandbox); the rest of the policy loads while the launcher starts."""
    if not args.policy:
        return None
    from egressbox.core.policy import load_run_settings

    try:
        return load_run_settings(args.policy)
    except PolicyError as exc:
        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE


def _cli_options(
    args: Any, argv: list[str], settings: RunSettings | None = None
) -> RunOptions | None:
    """The parsed `run` flags as RunOptions, through options_for() as the library's own are;
    None after a usage error (said on stderr)."""
    if _cli_upstream(args) is not None:
        return None
    own = (args.policy, args.audit_log, getattr(args, "save_approved", None))
    try:
        options = options_for(
            argv,
            policy=None,  # loaded while the launcher starts (run_options_sync's policy_loader)
            run_settings=settings,
            trusted_files=tuple(p for p in own if p and p != "-"),
            **_keywords(args),
        )
    except ValueError as exc:
        write_err(str(exc))
        return None
    for path in options.writable_trusted:
        write_err(f"warning: {path} is host-trusted; the command may write it (--writable-trusted)")
    asking = _asking(args)
    if asking is None:
        return None
    # The question on a miss is made once the rest is known to be good: making it holds
    # --save-approved's directory.
    return options._replace(**asking) if asking else options


def _asking(args: Any) -> dict[str, Any] | None:
    """--ask / --ask-command as RunOptions fields ({} for neither); None after a usage error."""
    if args.save_approved and not _hold_save_approved(args):
        return None
    if not (args.ask or args.ask_command):
        return {}
    if args.ask:
        if not os.isatty(0):
            write_err("--ask asks at the terminal, and stdin is not one: use --ask-command CMD")
            return None
        from egressbox.runner.ask import TerminalPrompt

        return {"on_miss": TerminalPrompt(args.ask_timeout), "ask_timeout": args.ask_timeout}
    # Loads asyncio before the fork (a few ms more start-up, for this flag only).
    from egressbox.proxy.approval import CommandDecider, command_argv

    try:
        argv = command_argv(args.ask_command)
    except ValueError as exc:
        write_err(f"--ask-command: {exc}")
        return None
    return {"on_miss": CommandDecider(argv), "ask_timeout": args.ask_timeout}


def _hold_save_approved(args: Any) -> bool:
    """Hold --save-approved's directory from now, before the child exists (egressbox.fs.held):
    whatever the child does to the path, the file is written where it was meant."""
    if not (args.ask or args.ask_command):
        write_err("--save-approved needs --ask or --ask-command")
        return False

    try:
        args.save_approved_held = HeldFile(args.save_approved)
    except OSError as exc:
        write_err(f"--save-approved: cannot write {args.save_approved}: {exc}")
        return False
    return True


def _save_approved(args: Any, result: RunResult) -> None:
    """--save-approved: what was approved during the run, as a policy file."""
    path = getattr(args, "save_approved", None)
    if not path:
        return
    from egressbox.proxy.approval import Answer, save_approved

    held = getattr(args, "save_approved_held", None)
    try:
        save_approved(held or path, result.approved)
    except OSError as exc:
        write_err(f"--save-approved: cannot write {path}: {exc}")
        return
    finally:
        if held is not None:
            held.close()
    kept = sum(1 for item in result.approved if item.answer is Answer.SESSION)
    write_err(
        f"--save-approved: wrote {path} ({kept} allowed for the session, "
        f"{len(result.approved) - kept} allowed once and commented out)"
    )


def _nameservers(texts: Sequence[str]) -> tuple[tuple[str, int], ...]:
    if not texts:
        return ()
    # Imported only when asked for: it loads dnspython (~45 ms).
    from egressbox.net.resolve import parse_nameserver

    return tuple(parse_nameserver(text) for text in texts)


# Keywords the flags give as other than their parsed value (runner/flags.py names the keyword
# of each flag): --grant's words, --nameserver's addresses, and the flags that say "not".
_CONVERTED: dict[str, Callable[[Any], Any]] = {
    "grants": lambda texts: dict(parse_grant(text) for text in texts),
    "nameservers": _nameservers,
    "capture": operator.not_,  # --no-capture
    "announce": operator.not_,  # --quiet
}
# Set apart from the rest: the command (after --) and the question on a miss (_asking).
_APART = frozenset({"cmd", "on_miss", "ask_timeout"})


def _keywords(args: Any) -> dict[str, Any]:
    """options_for()'s keywords from the parsed flags, each as runner/flags.py maps it; a
    flag the namespace lacks keeps the library's default."""
    from egressbox.runner.flags import RUN_FLAGS, dest

    keywords: dict[str, Any] = {}
    for flag in RUN_FLAGS:
        if not flag.keyword or flag.keyword in _APART or not hasattr(args, dest(flag)):
            continue
        value = getattr(args, dest(flag))
        convert = _CONVERTED.get(flag.keyword)
        keywords[flag.keyword] = convert(value) if convert is not None else value
    return keywords


def _diagnostic(line: str) -> None:
    write_err(line)


def _exit_code(exc: Exception) -> int:
    """The code of a run that ended before its command could (said on stderr)."""
    if isinstance(exc, LaunchFailedError):  # its code says the cause (the proxy's bind: 121)
        return exc.code
    if isinstance(exc, CommandNotFoundError):
        return EXIT_NOT_FOUND
    return EXIT_USAGE  # a [[secret]]'s value cannot be had: the command never ran


def _run_reporting_errors(
    options: RunOptions, audit: AuditSink | None, args: Any
) -> RunResult | int:
    from egressbox.core.secrets import SecretError

    try:
        return run_options_sync(
            options,
            audit=audit,
            log=None if args.quiet else _diagnostic,
            policy_loader=lambda: _cli_policy(args),
        )
    except PolicyError as exc:
        print_policy_error(exc, sys.stderr)
        return EXIT_USAGE
    except RunRefusedError as exc:
        for message in exc.messages:
            write_err(message)
        return exc.code
    except (CommandNotFoundError, LaunchFailedError, SecretError) as exc:
        write_err(str(exc))
        return _exit_code(exc)
    except EgressboxError as exc:
        write_err(str(exc))
        return EXIT_CANNOT_CONFINE
