"""What a confined run is asked to do: options, results, and the defaults they come from."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from egressbox.confine.env import (
    EnvPolicy,
)
from egressbox.confine.grants import (
    DEFAULT_PRESETS,
    DEFAULT_PROFILE,
    Enforcement,
    Profile,
    Refusal,
    parse_profile,
    profile_note,
    strictest,
)
from egressbox.core.errors import EgressboxError

if TYPE_CHECKING:
    from egressbox.audit.record import AuditRecord
    from egressbox.confine.refusal import RefusalRecord
    from egressbox.confine.staging import Change
    from egressbox.core.policy import Policy, RunSettings
    from egressbox.proxy.approval import Approved, Decider


# How long the launcher may take to bind its listeners (measured: 34-50 ms).
LAUNCHER_TIMEOUT = 10.0


SCRATCH_DIR = ".egressbox"


ENV_SANDBOX = "EGRESSBOX_SANDBOX"
# Its values (Harn's HARN_HANDLER_SANDBOX's), read for the worktree profile only: off drops the
# filesystem rules (the network boundary stays), warn runs without a missing mechanism and
# says so, enforce refuses instead. os_hardened ignores it: it requires every mechanism.
SANDBOX_MODES = ("off", "warn", "enforce")

# run --workspace: writes staged in a layer and applied through the gate, or direct (live).
WORKSPACE_MODES = ("staged", "direct")


ENV_PROFILE = "EGRESSBOX_PROFILE"
# What an outer run granted, for a nested run to check its roots against before it starts:
# JSON {"write": [...], "read": [...]} of real paths (runner/assemble.py). Advisory: the outer
# run's world is the wall; a command that edits the variable only loses the early message.
ENV_ROOTS = "EGRESSBOX_ROOTS"


# --timeout: the run's exit code when it expires (as coreutils timeout), and
# how long the command has after SIGTERM before it is killed.
KILL_GRACE = 5.0


# Tasks (processes and threads) in the child's PID namespace: a fork bomb stops there, and a
# parallel build (cargo -j, a test runner's workers) stays far below it.
DEFAULT_MAX_PROCESSES = 4096


class RunRefusedError(EgressboxError):
    """`run` refused to start the command: `cause` says why (core/exitcodes.py CAUSE_CODES),
    `code` is its exit code (126 when confinement the profile requires is unavailable).

    `refusals` are the mechanism refusals with Harn's fields (confine/grants.py Refusal);
    `messages` the lines to say: each refusal's facts, then its remedy.
    """

    def __init__(
        self,
        refusals: Sequence[Refusal],
        *,
        message: str = "",
        cause: str = "confinement_unavailable",
    ) -> None:
        from egressbox.core.exitcodes import CAUSE_CODES

        self.refusals = list(refusals)
        self.cause = cause
        self.code = CAUSE_CODES[cause]
        self.messages = [line for r in self.refusals for line in (r.message(), r.remedy())]
        self.messages += [message] if message else []
        super().__init__("; ".join(self.messages))


class RunOptions(NamedTuple):
    """What a confined run is asked to do (options_for() makes one from keywords)."""

    argv: tuple[str, ...]
    policy: Policy | None
    profile: Profile = DEFAULT_PROFILE
    write_roots: tuple[str, ...] = ()
    read_roots: tuple[str, ...] = ()
    env_policy: EnvPolicy = EnvPolicy.INHERITED
    grants: Mapping[str, str | None] = MappingProxyType({})
    # Variables of the caller's environment the command does not get (--env-remove NAME).
    env_remove: tuple[str, ...] = ()
    allow_loopback: bool = False
    pass_fds: tuple[int, ...] = ()
    cwd: str | None = None
    base_env: Mapping[str, str] | None = None
    nameservers: tuple[tuple[str, int], ...] = ()
    timeout: float | None = None  # seconds; then SIGTERM, SIGKILL after KILL_GRACE, exit 124
    presets: tuple[str, ...] = DEFAULT_PRESETS
    deny: tuple[str, ...] = ()  # read-denied paths beyond CREDENTIALS (`~` allowed)
    rlimit_nofile: int | None = None
    rlimit_as: int | None = None
    # Granted to the command's tools (caches, state), never treated as workspaces.
    process_read_roots: tuple[str, ...] = ()
    process_write_roots: tuple[str, ...] = ()
    # Directories whose unix sockets exist for the child (read-only binds).
    unix_socket_roots: tuple[str, ...] = ()
    # Files the host trusts (the policy file, the audit log): read-only or absent for the child.
    trusted_files: tuple[str, ...] = ()
    # Host-trusted paths in a writable root (HOST_TRUSTED) the child may write after all.
    writable_trusted: tuple[str, ...] = ()
    max_processes: int | None = DEFAULT_MAX_PROCESSES
    # The run's memory budget in bytes (confine/cgroup.py): None: half the host's memory.
    max_memory: int | None = None
    # Files passed as they are (--grant-file): no clean copy, credentials and all.
    grant_files: tuple[str, ...] = ()
    # A run whose network boundary would be `none` refuses unless this is set.
    allow_direct_network: bool = False
    # One stderr line per allowed connection too (refusals are always said).
    log_allowed: bool = False
    # Transparent capture (DESIGN 7a): every TCP connection the command makes reaches the
    # proxy and its DNS questions are answered inside its namespace, proxy variables or not.
    # On wherever the host allows it (a network namespace and nftables); off with --no-capture.
    # A host without it runs the command without capture, and the report says so.
    capture: bool = True
    # The workspace readable only (--read-only-workspace, [filesystem] workspace = "read-only"):
    # the scratch space then lives outside it, in the child's private /tmp.
    read_only_workspace: bool = False
    # Where the toolchains' caches go (confine/toolchains.py): "scratch" or "real".
    toolchain_cache: str = "scratch"
    # One stderr line per root the run adds beyond its workspace (like Harn's
    # "sandbox active; extra write root: PATH"); the CLI turns it off with --quiet.
    announce: bool = True
    # Approval on a miss (proxy/approval.py): asked about a destination no allow entry
    # admits (a callback, runner.ask.TerminalPrompt, approval.CommandDecider); None: denied.
    on_miss: Decider | None = None
    ask_timeout: float | None = None  # seconds; None: approval.DEFAULT_TIMEOUT
    # How the command's writes reach the host (confine/staging.py): "staged" in a layer applied
    # through a gate when it exits (host-trusted names held back), or "direct" (live).
    workspace: str = "staged"
    # Whether the caller named the workspace mode (a staged one asked for by name is refused
    # where it cannot be built; the default falls back to direct and says so).
    workspace_asked: bool = False
    # Staged: keep the whole layer for `egressbox changes|apply|discard`, apply nothing.
    review: bool = False
    # --user NAME: started as root, the command runs as NAME (runner/account.py).
    user: str | None = None
    # Said once on stderr before the command (a deprecated profile name; a profile asked for
    # that the policy's stricter one overrode).
    notes: tuple[str, ...] = ()
    # Credential brokering (runner/brokering.py): the [[secret]] names whose placeholders the
    # child gets, whether the proxy terminates any host, and values given by the library
    # (egressbox.run(secrets={NAME: VALUE})) instead of each entry's source.
    secret_names: tuple[str, ...] = ()
    terminate: bool = False
    secrets: Mapping[str, str] | None = None
    secret_env: tuple[str, ...] = ()  # from_env variables: held back from the child


class MechanismReport(NamedTuple):
    """One row of a run's enforcement report: a mechanism and how fully it held."""

    mechanism: str
    enforcement: Enforcement
    detail: str


class RootReport(NamedTuple):
    """One granted root and its kind, as the launcher applies it."""

    kind: str  # workspace | read | process_read | process_write | executable
    path: str
    detail: str


ROOT_DETAIL = {
    "workspace": "read+write; TMPDIR and tool caches live in the first one",
    "read": "read-only",
    "process_read": "read-only, for the command's tools; not a workspace",
    "process_write": "read+write, for the command's tools; not a workspace (no TMPDIR, "
    "caches or scratch directory)",
    "executable": "read+execute: the command, its interpreter or venv",
    "unix_socket": "its unix sockets may be connected to and made (bind), its other files "
    "read-only; inside the private /tmp or /var/tmp: connect only",
    "git": "read+write: the repository's git directory outside the workspace (a linked "
    "worktree's); hooks and config read-only",
    "git_objects": "read-only: objects borrowed through objects/info/alternates",
    "toolchain_cache": "read+write: a toolchain's own cache (--toolchain-cache real)",
}


@dataclass
class RunResult:
    """What a confined run did: its exit code, audit records, report and refusal."""

    exit_code: int
    records: list[AuditRecord]
    report: list[MechanismReport]
    refusal: RefusalRecord | None = None
    stdout: bytes | None = None
    stderr: bytes | None = None
    warnings: list[str] = field(default_factory=list)
    roots: list[RootReport] = field(default_factory=list)
    created_trusted: list[str] = field(default_factory=list)
    # What the run's on_miss allowed (for --save-approved: approval.save_approved).
    approved: list[Approved] = field(default_factory=list)
    # Escape sequences the terminal relay kept from the caller's terminal, by kind
    # (runner/vtfilter.py: clipboard, title, query...); counts only, never their contents.
    terminal_dropped: dict[str, int] = field(default_factory=dict)
    # Without a network namespace: the command's unix socket connects the connect supervisor
    # refused outside the grants (runner/notify.py), and the first one's path, printable.
    unix_refused: int = 0
    unix_refused_first: str = ""
    # "staged" or "direct", and why when staging was asked for and not built.
    workspace: str = "direct"
    workspace_detail: str = ""
    # The staged run's id (its layer in egressbox's state directory), while anything of it is
    # kept: held-back entries, entries that failed to apply, or the whole layer (--review).
    layer: str = ""
    applied: list[Change] = field(default_factory=list)
    held: list[Change] = field(default_factory=list)
    apply_failed: list[tuple[str, str]] = field(default_factory=list)
    apply_skipped: list[Change] = field(default_factory=list)
    # The profile the run was confined under: the strictest of the one asked for, the
    # policy's and an outer run's (EGRESSBOX_PROFILE).
    profile: str = ""


def effective_profile(requested: Profile, env: Mapping[str, str]) -> Profile:
    """Nesting picks the strictest of the requested and the inherited profile."""
    inherited = env.get(ENV_PROFILE)
    try:
        outer = Profile(inherited) if inherited else None
    except ValueError:
        outer = None
    return strictest(requested, outer)


def chosen_profile(asked: Profile | str | None, table: str | None) -> tuple[Profile, list[str]]:
    """The strictest of the caller's profile and the policy's [process] profile (as between
    nested runs: a flag cannot shed what the policy file imposes, nor the policy what the flag
    asks), with the lines to say: deprecated names, and a profile asked for and overridden."""
    notes: list[str] = []
    flag = table_profile = None
    if asked is not None:
        flag = asked if isinstance(asked, Profile) else parse_profile(asked)
        notes.append(profile_note(str(asked), "--profile"))
    if table is not None:
        table_profile = parse_profile(table)
        notes.append(profile_note(table, "[process] profile"))
    profile = strictest(flag, table_profile)
    if flag is not None and profile is not flag:
        notes.append(
            f"profile {flag.value} asked; the policy's [process] profile {profile.value} is "
            "stricter and wins"
        )
    return profile, [n for n in notes if n]


def options_for(
    cmd: Sequence[str],
    *,
    policy: Policy | None,
    profile: Profile | str | None = None,
    write_roots: Sequence[str] = (),
    read_roots: Sequence[str] = (),
    process_read_roots: Sequence[str] = (),
    process_write_roots: Sequence[str] = (),
    env: EnvPolicy | str | None = None,
    grants: Mapping[str, str | None] | None = None,
    env_remove: Sequence[str] = (),
    allow_loopback: bool = False,
    pass_fds: Sequence[int] = (),
    cwd: str | None = None,
    base_env: Mapping[str, str] | None = None,
    nameservers: Sequence[tuple[str, int]] = (),
    timeout: float | None = None,
    allow_direct_network: bool = False,
    unix_socket_roots: Sequence[str] = (),
    capture: bool = True,
    read_only_workspace: bool = False,
    toolchain_cache: str | None = None,
    announce: bool = True,
    on_miss: Decider | None = None,
    ask_timeout: float | None = None,
    workspace: str | None = None,
    review: bool = False,
    secrets: Mapping[str, str] | None = None,
    writable_trusted: Sequence[str] = (),
    grant_files: Sequence[str] = (),
    trusted_files: Sequence[str] = (),
    log_allowed: bool = False,
    user: str | None = None,
    run_settings: RunSettings | None = None,
) -> RunOptions:
    """RunOptions from the keyword arguments of run() / run_sync() / spawn_confined(), and of
    the command line (runner/flags.py names the keyword each `run` flag sets): the one
    constructor of RunOptions.

    The policy's [process], [filesystem] and [env] tables are the defaults:
    `profile`, `env` and `timeout` win over them, roots and grants add to them.
    `run_settings` are those tables when the policy itself comes later (the command line
    reads them before the fork and loads the rest while the launcher starts); by default,
    the policy's.
    """
    if not cmd:
        raise ValueError("cmd must name a program")
    if run_settings is None and policy is not None:
        run_settings = policy.run_settings
    return RunOptions(
        argv=tuple(cmd),
        policy=policy,
        env_remove=tuple(env_remove),
        allow_direct_network=allow_direct_network,
        pass_fds=tuple(pass_fds),
        cwd=cwd,
        base_env=base_env,
        nameservers=tuple(nameservers),
        capture=capture,
        announce=announce,
        on_miss=on_miss,
        ask_timeout=ask_timeout,
        review=review,
        secrets=dict(secrets) if secrets else None,
        grant_files=tuple(grant_files),
        trusted_files=tuple(trusted_files),
        log_allowed=log_allowed,
        user=user,
        **with_settings(
            run_settings,
            profile=profile,
            env=env,
            write_roots=write_roots,
            read_roots=read_roots,
            process_read_roots=process_read_roots,
            process_write_roots=process_write_roots,
            unix_socket_roots=unix_socket_roots,
            grants=grants or {},
            timeout=timeout,
            read_only_workspace=read_only_workspace,
            toolchain_cache=toolchain_cache,
            workspace=workspace,
            allow_loopback=allow_loopback,
            writable_trusted=writable_trusted,
        ),
    )


def with_settings(
    settings: RunSettings | None,
    *,
    profile: Profile | str | None,
    env: EnvPolicy | str | None,
    write_roots: Sequence[str],
    read_roots: Sequence[str],
    grants: Mapping[str, str | None],
    timeout: float | None,
    process_read_roots: Sequence[str] = (),
    process_write_roots: Sequence[str] = (),
    unix_socket_roots: Sequence[str] = (),
    writable_trusted: Sequence[str] = (),
    read_only_workspace: bool = False,
    toolchain_cache: str | None = None,
    workspace: str | None = None,
    allow_loopback: bool = False,
) -> dict[str, Any]:
    """RunOptions fields from the policy's run tables and the caller's choices.

    The caller's environment policy and timeout win; the stricter of its profile and the
    table's wins; its roots come first (the first writable root holds the scratch space) and
    its grants override the table's for the same name. A read-only workspace, asked by
    either, is read-only; so is loopback, granted by either (--allow-loopback, [process]
    allow_tcp_loopback).
    """
    if settings is None:
        from egressbox.core.policy import RunSettings

        settings = RunSettings()
    process, fs, table_env = settings.process, settings.filesystem, settings.env
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be more than 0 seconds, got {timeout}")
    caches = toolchain_cache or fs.toolchain_cache or "scratch"
    if caches not in ("scratch", "real"):
        raise ValueError(f"toolchain_cache must be 'scratch' or 'real', got {caches!r}")
    mode = workspace or getattr(fs, "workspace_mode", None) or "staged"
    if mode not in WORKSPACE_MODES:
        raise ValueError(f"workspace must be 'staged' or 'direct', got {mode!r}")
    chosen, notes = chosen_profile(profile, process.profile)
    return {
        "profile": chosen,
        "notes": tuple(notes),
        "allow_loopback": allow_loopback or process.allow_tcp_loopback,
        "env_policy": EnvPolicy(env or table_env.policy or EnvPolicy.INHERITED),
        "write_roots": tuple(dict.fromkeys((*write_roots, *fs.write_roots))),
        "read_roots": tuple(dict.fromkeys((*read_roots, *fs.read_roots))),
        "process_read_roots": tuple(dict.fromkeys((*process_read_roots, *fs.process_read_roots))),
        "process_write_roots": tuple(
            dict.fromkeys((*process_write_roots, *fs.process_write_roots))
        ),
        "grants": dict(table_env.grant) | dict(grants),
        "timeout": timeout if timeout is not None else process.timeout,
        "presets": fs.presets,
        "deny": fs.deny,
        "rlimit_nofile": process.rlimit_nofile,
        "rlimit_as": process.rlimit_as,
        "unix_socket_roots": tuple(dict.fromkeys((*unix_socket_roots, *fs.unix_socket_roots))),
        "writable_trusted": tuple(dict.fromkeys((*writable_trusted, *fs.writable_trusted))),
        "max_processes": process.max_processes or DEFAULT_MAX_PROCESSES,
        "max_memory": process.max_memory,
        "read_only_workspace": read_only_workspace or fs.workspace == "read-only",
        "toolchain_cache": caches,
        "workspace": mode,
        "workspace_asked": bool(workspace or getattr(fs, "workspace_mode", None)),
        "secret_names": settings.secret_names,
        "terminate": settings.terminate,
        "secret_env": settings.secret_env,
    }


def write_err(line: str) -> None:
    """One line of ours on stderr: control characters shown, never acted on (a path or a
    name in it may come from the command); CR LF while the terminal is raw (stderr_tee)."""
    from egressbox.runner.terminal import terminal_line

    sys.stderr.write(terminal_line(f"egressbox: {line}", sys.stderr))
    sys.stderr.flush()
