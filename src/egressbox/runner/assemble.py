"""The launch plan of a run, assembled from its options and the host's facts.

Everything decided before the fork: confinement's face plans the profile's mechanisms on this
host (confine/face.py `plan`); on them the runner reads the host (paths, the command on PATH,
the environment) and builds the Run, from which the face decides the rest (`finish`: the
filesystem grants, the child's world, the launcher's plan). What is made on the host for the
run is made by named set-up steps, never by a planning step: the face's (scratch space, the
proxy's listeners without a network namespace) and the staged workspace's layer
(runner/gate.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from egressbox.confine import face
from egressbox.confine.env import Scratch
from egressbox.confine.executable import Executable
from egressbox.confine.grants import (
    DEFAULT_PROFILE,
    Enforcement,
    FsPlan,
    HostFacts,
    Mechanism,
    Profile,
    expand_user,
    host_trusted,
    is_under,
)
from egressbox.confine.spec import LaunchPlan
from egressbox.confine.toolchains import CacheMode, CachePlan, CacheRoot
from egressbox.core.errors import EgressboxError
from egressbox.runner.account import Account
from egressbox.runner.account import environment as user_environment
from egressbox.runner.account import lookup as lookup_account
from egressbox.runner.facts import _cache_dir, _compiled_seccomp
from egressbox.runner.gate import (
    DIRECT,
    NO_MOUNTS,
    STAGED,
    Stage,
    abandon,
    recover,
    staged_roots,
)
from egressbox.runner.gate import stage as gate_stage
from egressbox.runner.layers import state_home
from egressbox.runner.options import (
    ENV_ROOTS,
    ENV_SANDBOX,
    ROOT_DETAIL,
    SANDBOX_MODES,
    SCRATCH_DIR,
    MechanismReport,
    RootReport,
    RunOptions,
    RunRefusedError,
    effective_profile,
)
from egressbox.runner.verify import Guard, snapshot

if TYPE_CHECKING:
    from egressbox.proxy.broker import Broker
    from egressbox.runner.brokering import RunBrokering
import json

from egressbox.runner.own_state import STATE_ENV
from egressbox.runner.report import enforcement_report, network_boundary
from egressbox.runner.workspace import (
    READ_ONLY_SCRATCH,
    Layout,
    announce_lines,
    cache_check,
    expand,
    lay_out,
    refuse_cwd_outside,
    refuse_private_roots,
)


# Mutable state of one run, compared by identity. A plain class, not a dataclass: the
# decorator compiles its __init__ at import, on the start-up path (and dataclasses itself
# would be imported before the fork for it).
class Prepared:
    """Everything decided before the fork."""

    plan: LaunchPlan
    report: list[MechanismReport]
    host_listeners: list[socket.socket]
    network_boundary: Enforcement
    warnings: list[str]
    homes: tuple[str, ...]  # the caller's home and the child's, for refusal records
    roots: list[RootReport]
    profile: Profile
    # Host-trusted paths absent before the run: one that appears was made by the command.
    created_watch: tuple[str, ...]
    # Host-trusted paths as they were before the child started (runner/verify.py): judged
    # and put right after the run.
    guard: Guard | None
    # Why the run does not capture ("" when the launcher is asked to).
    capture_off: str
    host_capture: socket.socket | None
    brokering: RunBrokering | None
    # One line per root added beyond the workspace (said before the command starts).
    announcements: list[str]
    # Toolchain cache locations a refusal may name (confine/toolchains.py).
    caches: tuple[CacheRoot, ...]
    cache_mode: CacheMode
    # The child's message locale when it is not English (LC_ALL/LC_MESSAGES the caller set).
    foreign_locale: str
    started: float  # time.time() when the run was planned (kernel records after it)
    # Made on the host for this run only (a read-only workspace's scratch without a mount
    # namespace): removed when the run ends.
    cleanup: list[str]
    read_only_workspaces: tuple[str, ...]  # --read-only-workspace, for refusal hints
    # The staged workspace's layer and root handles (runner/gate.py), until the run's end.
    stage: Stage | None
    workspace: str  # "staged" or "direct"
    workspace_detail: str

    def __init__(
        self,
        plan: LaunchPlan,
        report: list[MechanismReport],
        host_listeners: list[socket.socket],
        network_boundary: Enforcement,
        *,
        warnings: list[str] | None = None,
        homes: tuple[str, ...] = (),
        roots: list[RootReport] | None = None,
        profile: Profile = DEFAULT_PROFILE,
        created_watch: tuple[str, ...] = (),
        guard: Guard | None = None,
        capture_off: str = "",
        host_capture: socket.socket | None = None,
        announcements: list[str] | None = None,
        caches: tuple[CacheRoot, ...] = (),
        cache_mode: CacheMode = CacheMode.SCRATCH,
        foreign_locale: str = "",
        brokering: RunBrokering | None = None,
        started: float = 0.0,
        cleanup: list[str] | None = None,
        read_only_workspaces: tuple[str, ...] = (),
        stage: Stage | None = None,
        workspace: str = "direct",
        workspace_detail: str = "",
    ) -> None:
        self.plan = plan
        self.report = report
        self.host_listeners = host_listeners
        self.network_boundary = network_boundary
        self.warnings = [] if warnings is None else warnings
        self.homes = homes
        self.roots = [] if roots is None else roots
        self.profile = profile
        self.created_watch = created_watch
        self.guard = guard
        self.capture_off = capture_off
        # Without a namespace, with the connect supervisor: the capture listener on the host's
        # loopback (runner/spawn.py gives it to the proxy).
        self.host_capture = host_capture
        self.announcements = [] if announcements is None else announcements
        self.caches = caches
        self.cache_mode = cache_mode
        self.foreign_locale = foreign_locale
        # The run's placeholders and CA (runner/brokering.py), for the proxy; None: none.
        self.brokering = brokering
        # Its broker, once the values are read (api._read_secrets, after the fork and before
        # the command starts): the one field filled after construction, as it is I/O.
        self.broker: Broker | None = None
        self.started = started
        self.cleanup = [] if cleanup is None else cleanup
        self.read_only_workspaces = read_only_workspaces
        self.stage = stage
        self.workspace = workspace
        self.workspace_detail = workspace_detail


class _Roots(NamedTuple):
    """The roots of a run as real paths, before the filesystem plan."""

    layout: Layout
    read: tuple[str, ...]
    process_read: tuple[str, ...]
    process_write: tuple[str, ...]  # with the real toolchain caches
    sockets: tuple[str, ...]
    caches: tuple[tuple[str, str], ...] = ()  # real toolchain caches granted: (path, tool)
    warnings: tuple[str, ...] = ()


def prepare(options: RunOptions, facts: HostFacts) -> Prepared:
    base = dict(os.environ if options.base_env is None else options.base_env)
    account = _account(options)
    if account is not None:
        base = user_environment(base, account)
    planned, warnings = _mechanisms(options, facts, base)
    home = base.get("HOME", os.path.expanduser("~"))
    cwd = os.path.realpath(options.cwd or os.getcwd())
    files, mounts = planned.files, planned.mounts
    layout = lay_out(
        expand(options.write_roots, home),
        cwd=cwd,
        home=home,
        read_only=options.read_only_workspace,
        git=files,
    )
    executable = face.resolve_command(options.argv[0], base, cwd)
    _check_cwd(cwd, layout, options, executables=executable.grants, files=files)
    if files:
        refuse_outside_parent(base.get(ENV_ROOTS), layout, options, home)
    owner = (account.uid, account.gid) if account is not None else None
    scratch, cleanup = _scratch(layout, mounts, owner)
    brokering = _brokering(options, mounts, warnings)
    start = _Start(base, home, planned, warnings, layout, executable, scratch, cleanup, brokering)
    try:
        return _prepare(options, facts, start)
    except BaseException:
        import shutil  # only on this path: shutil and tempfile cost ~4 ms of every start

        for made in cleanup:
            shutil.rmtree(made, ignore_errors=True)
        raise


class _Start(NamedTuple):
    """What prepare() decided before it made anything for the run."""

    base: dict[str, str]
    home: str
    planned: face.Plan  # the profile's mechanisms on this host (confinement's face)
    warnings: list[str]
    layout: Layout
    executable: Executable
    scratch: Scratch | None
    cleanup: list[str]
    brokering: RunBrokering | None = None


def _prepare(options: RunOptions, facts: HostFacts, start: _Start) -> Prepared:
    base, home, chosen = start.base, start.home, start.planned.mechanisms
    warnings, layout, executable = start.warnings, start.layout, start.executable
    scratch, files = start.scratch, start.planned.files
    env, templates, held = _environment(options, base, start.planned, scratch, layout.writable)
    warnings += [line for line in (held.notice(),) if line]
    deny = face.credential_paths(home, env.get("HOME")) + tuple(
        os.path.normpath(expand_user(p, home)) for p in options.deny
    )
    passed = _granted_files(options, home, deny, warnings)
    deny = tuple(d for d in deny if d not in passed)
    check = cache_check(env.get("HOME") or home, deny) if files else None
    caches = _toolchain_env(
        env, options, home=env.get("HOME") or home, scratch=scratch, layout=layout, check=check
    )
    roots = _collect_roots(options, layout, caches, home=home, files=files)
    warnings += [*roots.warnings, *layout.notes]
    trusted = (
        *_trusted_paths(options, layout.writable, roots.process_write, home),
        *layout.protect,
    )
    grants = face.Grants(
        home=home,
        write_roots=layout.writable,
        read_roots=(*roots.read, *layout.readable, *_outside(passed, layout.writable)),
        executables=tuple(executable.grants),
        presets=tuple(options.presets),
        deny=deny,
        protected_files=trusted,
        process_read_roots=roots.process_read,
        process_write_roots=roots.process_write,
        socket_roots=roots.sockets,
        host_scratch=tuple(start.cleanup) if layout.read_only else (),
        passed=passed,
    )
    # One memory figure for the run: a cgroup where the host delegates one; the private file
    # systems' sizes fit in it either way (confine/grants.py tmpfs_sizes).
    budget = options.max_memory or _half_the_memory()
    host = face.read_host(start.planned, grants, budget=budget, max_processes=options.max_processes)
    capture_off = _capture_off(options, chosen, facts, host.connects_off)
    planned = face.finish(
        start.planned, _run(options, start, env, templates, grants, host, capture_off, budget)
    )
    warnings += _denied_roots(roots, planned.fs)
    warnings += planned.warnings
    _refuse_own_state(planned.fs.write, chosen, files=files, own=_own_files(options, home))
    made: face.SetUp | None = None
    staged = _Staged(None, DIRECT, "")
    try:
        staged = _stage(options, start, roots, warnings)
        stage = staged.stage
        made = face.set_up(planned, staged=stage.layer.spec(staged.direct) if stage else None)
        return _finish(
            options,
            start,
            made.launcher,
            staged,
            roots=roots,
            trusted=trusted,
            caches=caches,
            capture_off=capture_off,
            listeners=made.listeners,
            env=env,
            notes=list(planned.notes),
            host_capture=made.host_capture,
        )
    except BaseException:
        if made is not None:
            for sock in (*made.listeners, *([made.host_capture] if made.host_capture else [])):
                sock.close()
        abandon(staged.stage)
        raise


def _brokering(options: RunOptions, mounts: bool, warnings: list[str]) -> RunBrokering | None:
    """The run's placeholders and CA when its policy terminates a host: the child gets the
    placeholders in the [[secret]] variables' place (the real ones held back even when
    granted) and trusts the CA through its view (_launch_plan)."""
    if not options.terminate and not options.secret_names:
        # Most runs: nothing to broker, and the brokering modules (cryptography, which runs
        # inspect through its dataclasses, ssl, the proxy's broker) stay unloaded before the fork.
        return None
    from egressbox.runner.brokering import for_run

    brokering = for_run(options.secret_names, options.terminate, options.secret_env)
    if brokering is not None and not mounts:
        warnings.append(
            "without a mount namespace the child's view cannot hold the run's CA: TLS to "
            "the hosts a [[secret]] or [[request_rule]] names will fail verification"
        )
    return brokering


def _finish(
    options: RunOptions,
    start: _Start,
    plan: LaunchPlan,
    staged: _Staged,
    *,
    roots: _Roots,
    trusted: tuple[str, ...],
    caches: CachePlan,
    capture_off: str,
    listeners: list[socket.socket],
    env: dict[str, str],
    notes: list[str],
    host_capture: socket.socket | None,
) -> Prepared:
    profile, chosen, warnings, executable = (
        start.planned.profile,
        start.planned.mechanisms,
        start.warnings,
        start.executable,
    )
    home, files = start.home, start.planned.files
    report, network = enforcement_report(profile, chosen, capture_off=capture_off)
    homes = tuple(dict.fromkeys(h for h in (home, env.get("HOME")) if h and os.path.isabs(h)))
    layout = roots.layout
    announcements = (
        [*_announcements(options, roots, files, home), *notes] if options.announce else []
    )
    return Prepared(
        plan,
        report,
        listeners,
        network,
        warnings=warnings,
        homes=homes,
        roots=_root_report(roots, executable.grants),
        profile=profile,
        created_watch=tuple(p for p in trusted if not os.path.lexists(p)),
        capture_off=capture_off,
        host_capture=host_capture,
        announcements=announcements,
        caches=caches.roots,
        cache_mode=CacheMode(options.toolchain_cache),
        foreign_locale=_message_locale(env),
        brokering=start.brokering,
        started=time.time(),
        cleanup=start.cleanup,
        read_only_workspaces=layout.workspaces if layout.read_only else (),
        guard=_guard(options, layout, roots, trusted, home, staged=staged),  # after the rest
        stage=staged.stage,
        workspace=staged.mode,
        workspace_detail=staged.detail,
    )


class _Staged(NamedTuple):
    stage: Stage | None
    mode: str
    detail: str
    direct: tuple[str, ...] = ()


def _stage(options: RunOptions, start: _Start, roots: _Roots, warnings: list[str]) -> _Staged:
    """The run's layer when its workspace is staged (runner/gate.py); an earlier apply of this
    workspace that was interrupted is finished first."""
    layout, home = roots.layout, start.home
    state = state_home(dict(start.base))
    writable = staged_roots((*layout.writable, *roots.process_write))
    if writable:
        warnings += recover(state, writable[0])
    if options.review and (options.workspace != STAGED or not start.planned.mounts):
        why = "its layer needs a mount namespace, which this run cannot make"
        if options.workspace != STAGED:
            why = "--workspace direct was asked"
        raise EgressboxError(f"--review needs a staged workspace: {why}")
    if options.workspace != STAGED:
        return _Staged(None, DIRECT, "--workspace direct: the command writes the host's files")
    if not start.planned.mounts:
        return _Staged(None, DIRECT, _unstaged(options, warnings))
    if not writable:
        return _Staged(None, STAGED, "nothing writable to stage")
    direct: tuple[str, ...] = ()
    if start.scratch is not None and not layout.read_only:
        # on the host, never through a link
        made = face.make_scratch(layout.workspaces[0], SCRATCH_DIR, _owner(options))
        if made is not None:
            direct = (os.path.dirname(made.tmp),)
    own = [*options.trusted_files, _cache_dir(), *direct]
    own += [r for f in options.trusted_files for r in _rotated_siblings(os.path.realpath(f))]
    lifted = [os.path.realpath(expand_user(p, home)) for p in options.writable_trusted]
    stage = gate_stage(
        writable,
        own=own,
        lifted=lifted,
        git_dirs=[os.path.realpath(p) for p, _ in layout.git_write],
        argv=options.argv,
        cwd=os.path.realpath(options.cwd or os.getcwd()),
        review=options.review,
        home=state,
        owner=_owner(options),
    )
    detail = f"writes go to run {stage.layer.run}'s layer, applied through the gate at exit"
    return _Staged(stage, STAGED, detail, direct)


def _unstaged(options: RunOptions, warnings: list[str]) -> str:
    """A staged workspace without a mount namespace (its layer is an overlay mounted in one):
    refused when asked for by name, said once when it was only the default."""
    if options.workspace_asked:
        raise RunRefusedError(
            [],
            message="refused: --workspace staged needs a mount namespace for its "
            "copy-on-write layer, which this run cannot make; --workspace direct writes "
            "the host's files live (host-trusted files checked and put back after the run)",
            cause="confinement_unavailable",
        )
    warnings.append(f"workspace: direct ({NO_MOUNTS})")
    return NO_MOUNTS


def _mechanisms(
    options: RunOptions, facts: HostFacts, base: Mapping[str, str]
) -> tuple[face.Plan, list[str]]:
    """The plan of the profile's mechanisms on this host, and the warnings; or a refusal."""
    profile = effective_profile(options.profile, base)
    warnings = list(options.notes)
    if profile is not options.profile:
        warnings.append(
            f"profile {options.profile.value} asked; the enclosing egressbox run's profile "
            f"{profile.value} is stricter and wins"
        )
    mode = _sandbox_mode(base, warnings)
    # EGRESSBOX_SANDBOX=off: worktree applies what unrestricted does (the network boundary).
    planned = face.plan(face.Request(profile, sandbox=mode), facts)
    if planned.refusals:
        raise RunRefusedError(list(planned.refusals))
    chosen = planned.mechanisms
    if planned.gaps:
        names = ", ".join(m.value for m in planned.gaps)
        warnings.append(
            f"profile worktree runs without {names} (unavailable here; "
            f"{ENV_SANDBOX}=enforce refuses instead)"
        )
    if planned.files_off:
        warnings.append(_files_off_line(profile, mode))
    _refuse_open_network(chosen, options)
    warnings += _refuse_unconfinable(options, chosen)
    if Mechanism.NETWORK_NAMESPACE in planned.lacking and (blocker := face.namespace_blocker()):
        warnings.append(blocker)
    if options.allow_loopback and Mechanism.NETWORK_NAMESPACE not in chosen:
        raise EgressboxError("--allow-loopback needs a network namespace, which is unavailable")
    return planned, warnings


def _account(options: RunOptions) -> Account | None:
    """--user NAME: NAME's account (refused unless started as root); None without it."""
    return lookup_account(options.user) if options.user else None


def _owner(options: RunOptions) -> tuple[int, int] | None:
    account = _account(options)
    return (account.uid, account.gid) if account is not None else None


# Said once per run whose command's files are unconfined: what is dropped, and what stays.
UNCONFINED_FILES = (
    "no filesystem rules: the command may read and write every file you may (~/.ssh "
    "included); the network boundary stays (the proxy decides every connection)"
)


def _files_off_line(profile: Profile, mode: str) -> str:
    if profile is Profile.UNRESTRICTED:
        return f"profile unrestricted (--no-sandbox): {UNCONFINED_FILES}"
    return f"{ENV_SANDBOX}={mode}: profile {profile.value} runs with {UNCONFINED_FILES}"


def _sandbox_mode(env: Mapping[str, str], warnings: list[str]) -> str:
    """EGRESSBOX_SANDBOX's value; an unknown one is said and read as warn (the default)."""
    mode = env.get(ENV_SANDBOX, "") or "warn"
    if mode not in SANDBOX_MODES:
        warnings.append(
            f"{ENV_SANDBOX}={mode} is not one of {', '.join(SANDBOX_MODES)}: read as warn"
        )
        return "warn"
    return mode


def refuse_outside_parent(text: str | None, layout: Layout, options: RunOptions, home: str) -> None:
    """A nested run (its environment holds the outer run's EGRESSBOX_ROOTS) refuses, before it
    starts, a root its parent did not grant: the outer world would hide or refuse it anyway,
    and the command would fail later for a reason it cannot see."""
    parent = _parent_roots(text)
    if parent is None:
        return
    write, read = parent
    process_write = expand(options.process_write_roots, home)
    held = options.read_only_workspace  # process write roots are then read-only
    asked_write = (*layout.writable, *(() if held else process_write))
    asked_read = (
        *layout.readable,
        *(process_write if held else ()),
        *expand(options.read_roots, home),
        *expand(options.process_read_roots, home),
        *expand(options.unix_socket_roots, home),
    )
    for path in asked_write:
        if not any(is_under(path, w) for w in write):
            raise EgressboxError(_outside_parent(path, "write", write))
    for path in asked_read:
        if not any(is_under(path, r) for r in (*write, *read)):
            raise EgressboxError(_outside_parent(path, "read", (*write, *read)))


def _parent_roots(text: str | None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    if not text:
        return None

    try:
        data = json.loads(text)
        write = tuple(str(p) for p in data["write"])
        read = tuple(str(p) for p in data["read"])
    except (ValueError, KeyError, TypeError):
        return None  # not an outer run's: its world, if any, still holds
    return write, read


def _outside_parent(path: str, access: str, granted: Sequence[str]) -> str:
    shown = ", ".join(list(granted)[:_PARENT_ROOTS_SHOWN])
    more = len(granted) - _PARENT_ROOTS_SHOWN
    if more > 0:
        shown += f" and {more} more"
    return (
        f"refused: this run is nested in another egressbox run, which does not let its "
        f"command {access} {path} (it grants {access} under: {shown or 'nothing'}); a nested "
        f"run can grant only what its parent granted: grant {path} to the outer run, or "
        f"choose a root inside the parent's"
    )


# Roots of the parent named in a refusal (the presets make dozens; the first are the user's).
_PARENT_ROOTS_SHOWN = 6


def _environment(
    options: RunOptions,
    base: Mapping[str, str],
    planned: face.Plan,
    scratch: Scratch | None,
    writable: tuple[str, ...] = (),
) -> face.ChildEnvironment:
    """The child's environment, the proxy variables the launcher fills in, and what was
    held back of the caller's."""
    made = face.environment(
        planned,
        base,
        policy=options.env_policy,
        grants=options.grants,
        remove=options.env_remove,
        scratch=scratch,
        writable=writable,
    )
    if options.allow_loopback and not {"NO_PROXY", "no_proxy"} & set(options.grants):
        # The child's own servers on its private lo are reached directly.
        made.env["NO_PROXY"] = made.env["no_proxy"] = "localhost,127.0.0.1,::1"
    return made


def _collect_roots(
    options: RunOptions,
    layout: Layout,
    caches: CachePlan,
    *,
    home: str,
    files: bool,
) -> _Roots:
    granted = list(caches.grants) if files else []
    warnings = list(caches.notes)
    process_read = expand(options.process_read_roots, home)
    process_write = expand(options.process_write_roots, home)
    if options.read_only_workspace:
        # Harn's process write roots are gated by the workspace-write capability: a read-only
        # workspace makes them read-only too (a toolchain cache, --toolchain-cache real, is a
        # choice of its own and stays writable).
        process_read, process_write = (*process_read, *process_write), ()
    return _Roots(
        layout,
        read=expand(options.read_roots, home),
        process_read=process_read,
        process_write=(*process_write, *(p for p, _ in granted)),
        sockets=expand(options.unix_socket_roots, home),
        caches=tuple(granted),
        warnings=tuple(warnings),
    )


def _denied_roots(roots: _Roots, fs: FsPlan) -> list[str]:
    granted = (*roots.layout.writable, *roots.read, *roots.process_read, *roots.process_write)
    return [
        f"{root} is on the credential deny list: it stays unreadable whatever is granted"
        for root in granted
        if any(is_under(root, denied) for denied in fs.deny)
    ]


def _run(  # noqa: PLR0917 (the run's parts, each read once before)
    options: RunOptions,
    start: _Start,
    env: dict[str, str],
    templates: dict[str, str],
    grants: face.Grants,
    host: face.HostReads,
    capture_off: str,
    budget: int | None,
) -> face.Run:
    """What the run asks of confinement under its plan, with what was read of the host."""
    chosen, layout = start.planned.mechanisms, start.layout
    capture = not capture_off
    # Supervised, UDP is refused (no namespace): the main filter's plain variant.
    program = b""
    if Mechanism.SECCOMP in chosen:
        program = _compiled_seccomp(allow_udp=capture and not host.supervised)
    brokering = start.brokering
    return face.Run(
        argv=options.argv,
        executable=start.executable.path,
        cwd=os.path.realpath(options.cwd or os.getcwd()),
        env=brokering.child_env(env) if brokering else env,
        env_ports=templates,
        grants=grants,
        host=host,
        read_only_scratch=READ_ONLY_SCRATCH if layout.read_only else "",
        scratch=start.scratch,
        allow_loopback=options.allow_loopback,
        pass_fds=options.pass_fds,
        rlimit_nofile=options.rlimit_nofile,
        rlimit_as=options.rlimit_as,
        max_processes=options.max_processes,
        memory=budget,
        uid=os.getuid(),
        gid=os.getgid(),
        parent_pid=os.getpid(),
        capture=capture,
        copies=brokering.files() if brokering else (),
        trusted=grants.protected_files,
        seccomp_program=program,
        run_as=account.ids if (account := _account(options)) is not None else None,
        roots_variable=ENV_ROOTS,
    )


def _refuse_unconfinable(options: RunOptions, chosen: frozenset[Mechanism]) -> list[str]:
    """What narrows file access cannot be applied without filesystem rules.

    A read-only workspace would be silently writable: refused. Extra deny entries (often in a
    policy file shared by runs of several profiles) are said in a warning. Roots (grants) are
    applied whatever the profile, and announced.
    """
    if Mechanism.MOUNT_NAMESPACE in chosen or Mechanism.LANDLOCK_FS in chosen:
        return []
    why = (
        "this run has no filesystem rules (profile unrestricted, or a host without a mount "
        "namespace and Landlock)"
    )
    if options.read_only_workspace:
        raise EgressboxError(
            "refused: a read-only workspace (--read-only-workspace, [filesystem] workspace) "
            f"cannot be applied: {why}; choose --profile worktree"
        )
    if options.deny:
        return [f"[filesystem] deny entries are not applied: {why}"]
    return []


def _scratch(
    layout: Layout, mounts: bool, owner: tuple[int, int] | None
) -> tuple[Scratch | None, list[str]]:
    """The scratch space: in the first writable workspace, or outside a read-only one (made
    on the host, `owner`'s under --user, when there is no mount namespace to make it in)."""
    if not layout.read_only:
        root = layout.workspaces[0]
        if mounts:
            return face.scratch_paths(root, SCRATCH_DIR), []
        return face.make_scratch(root, SCRATCH_DIR, owner), []
    if mounts:
        base = READ_ONLY_SCRATCH
        return Scratch(os.path.join(base, "tmp"), os.path.join(base, "cache")), []
    # No mount namespace: a private directory of the host's, for this run only.
    made = face.private_scratch(owner)
    return made, [os.path.dirname(made.tmp)]


def _toolchain_env(
    env: dict[str, str],
    options: RunOptions,
    *,
    home: str,
    scratch: Scratch | None,
    layout: Layout,
    check: Callable[[str], str] | None,
) -> CachePlan:
    """Point the toolchains' caches into the scratch space (or at the real ones).

    Without filesystem rules (`check` None) every path is writable already: real caches are
    simply used, and granted as nothing.
    """
    mode = CacheMode(options.toolchain_cache)
    caches = face.plan_caches(
        env,
        home=home,
        scratch=scratch.cache if scratch else None,
        mode=mode,
        check=check or (lambda _path: ""),
    )
    env |= caches.env
    if layout.read_only and scratch is not None and not env.get(CARGO_TARGET_DIR):
        # A review task's `cargo check` / `cargo test` would write target/ in the project.
        env[CARGO_TARGET_DIR] = f"{scratch.cache}/cargo-target"
    if not {"LC_ALL", "LC_MESSAGES"} & set(env):
        # Error texts in English, so refusals are recognised (LANG's other parts stay).
        env["LC_MESSAGES"] = "C"
    return caches


CARGO_TARGET_DIR = "CARGO_TARGET_DIR"
_ENGLISH = ("", "C", "POSIX")


def _message_locale(env: Mapping[str, str]) -> str:
    """The child's message locale when the caller chose one that may not be English."""
    chosen = env.get("LC_ALL") or env.get("LC_MESSAGES") or ""
    language = chosen.split(".")[0]
    if language in _ENGLISH or language.startswith("en_") or language == "en":
        return ""
    return chosen


def _check_cwd(
    cwd: str,
    layout: Layout,
    options: RunOptions,
    *,
    executables: Sequence[str],
    files: bool,
) -> None:
    """The working directory must exist for the command (in a root or a preset), checked
    before anything is made for the run."""
    base = os.environ if options.base_env is None else options.base_env
    home = base.get("HOME", os.path.expanduser("~"))
    roots = (
        *layout.workspaces,
        *expand(options.read_roots, home),
        *expand(options.process_read_roots, home),
        *expand(options.process_write_roots, home),
        *expand(options.unix_socket_roots, home),
    )
    granted: tuple[str, ...] = roots
    hidden: tuple[str, ...] = ()
    if files:
        # Presets count too, except what the world makes fresh (its /tmp is not the host's).
        presets = face.preset_paths(options.presets, home)
        granted += tuple(p for p in (*presets, *executables) if p not in CONSTRUCTED_PATHS)
        if not any(is_under(cwd, r) for r in roots):
            deny = (*face.credential_paths(home), *expand(options.deny, home))
            hidden = (*deny, *CONSTRUCTED_PATHS)
        refuse_private_roots(roots, cwd)
    refuse_cwd_outside(cwd, granted, hidden, layout.project)


# Made fresh in the child's view, never the host's (confine/world.py CONSTRUCTED and its
# private tmpfs): a host directory below them does not exist for the command.
CONSTRUCTED_PATHS = ("/proc", "/sys", "/dev", "/tmp", "/var/tmp", "/run")


def _root_report(roots: _Roots, executables: Sequence[str]) -> list[RootReport]:
    layout = roots.layout
    found: list[RootReport] = []
    for path in layout.workspaces:
        found.append(RootReport("workspace", path, _workspace_detail(layout)))
    cache_paths = {p for p, _ in roots.caches}
    for kind, paths in (
        ("git", [p for p, _ in layout.git_write]),
        ("git_objects", [p for p, _ in layout.git_read]),
        ("read", roots.read),
        ("process_read", roots.process_read),
        ("process_write", [p for p in roots.process_write if p not in cache_paths]),
        ("toolchain_cache", [p for p, _ in roots.caches]),
        ("unix_socket", roots.sockets),
        ("executable", executables),
    ):
        found += [RootReport(kind, p, ROOT_DETAIL[kind]) for p in dict.fromkeys(paths)]
    return found


def _workspace_detail(layout: Layout) -> str:
    if layout.read_only:
        detail = "read-only (--read-only-workspace); TMPDIR and tool caches live outside it"
    else:
        detail = ROOT_DETAIL["workspace"]
    if layout.project is not None:
        detail += f"; {layout.project.reason}"
    else:
        detail += "; named by --write-root or [filesystem] write_roots"
    return detail


def _announcements(options: RunOptions, roots: _Roots, files: bool, home: str) -> list[str]:
    layout = roots.layout
    tools = dict(roots.caches)
    write = [(p, "") for p in layout.workspaces if options.write_roots]
    write += [(p, why) for p, why in layout.git_write if not layout.read_only]
    write += [
        (p, f"{tools[p]}'s own cache, --toolchain-cache real" if p in tools else "for tools")
        for p in roots.process_write
    ]
    read = [(p, "") for p in roots.read]
    held = set(expand(options.process_write_roots, home)) if layout.read_only else set()
    read += [
        (p, "for tools; read-only: --read-only-workspace" if p in held else "for tools")
        for p in roots.process_read
    ]
    read += [(p, why) for p, why in layout.git_read]
    if layout.read_only:
        read += [(p, why) for p, why in layout.git_write]
    return announce_lines(write=write, read=read, sockets=roots.sockets, unconfined_files=not files)


CAPTURE_HOST_FACT = "capture"  # confine.probe's mechanism name


def _capture_off(
    options: RunOptions, chosen: frozenset[Mechanism], facts: HostFacts, connects_off: str
) -> str:
    """Why this run does not capture, or "" when it does (never a refusal); `connects_off`
    is why the connects cannot be supervised (face.read_host)."""
    if not options.capture:
        return "turned off (--no-capture)"
    if Mechanism.NETWORK_NAMESPACE not in chosen:
        why = connects_off
        if why:
            return f"needs a network namespace or the connect supervisor ({why})"
        return ""
    if CAPTURE_HOST_FACT not in facts.available:
        status = facts.status.get(CAPTURE_HOST_FACT, "absent_on_host")
        return f"unavailable on this host ({status}; egressbox doctor says why)"
    return ""


def _half_the_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (OSError, ValueError):
        return None


def _refuse_open_network(chosen: frozenset[Mechanism], options: RunOptions) -> None:
    """No network namespace and no Landlock TCP rules: the child would reach the world."""
    if network_boundary(chosen) is not Enforcement.NONE or options.allow_direct_network:
        return
    raise RunRefusedError(
        [],
        message="refused: this host offers neither a network namespace nor Landlock TCP "
        "rules with seccomp, so the command could reach the network directly (every profile "
        "requires a network boundary; EGRESSBOX_SANDBOX cannot lift that); "
        "run as root or allow user namespaces, or pass --allow-direct-network to run it "
        "with its network unconfined",
        cause="network_boundary_unavailable",
    )


def _trusted_paths(
    options: RunOptions, write_roots: Sequence[str], process_write: Sequence[str], home: str
) -> tuple[str, ...]:
    """What the host trusts that a writable root may hold: read-only for the child."""
    trusted = list(host_trusted((*write_roots, *process_write)))
    trusted += [os.path.join(root, name) for root in write_roots for name in GIT_CONTROL_FILES]
    policy_source = options.policy.source if options.policy is not None else ""
    files = [*options.trusted_files, *([policy_source] if policy_source else [])]
    for path in files:
        real = os.path.realpath(expand_user(path, home))
        trusted.append(real)
        trusted += _rotated_siblings(real)
    trusted.append(os.path.realpath(_cache_dir()))
    lifted = {os.path.realpath(expand_user(p, home)) for p in options.writable_trusted}
    return tuple(p for p in dict.fromkeys(trusted) if p not in lifted)


# Inside a repository's git directory, files git reads if present (another config, another
# git directory); bound read-only when they exist, moved aside after the run when made.
GIT_CONTROL_FILES = (".git/commondir", ".git/config.worktree")


def _guard(
    options: RunOptions,
    layout: Layout,
    roots: _Roots,
    trusted: Sequence[str],
    home: str,
    *,
    staged: _Staged,
) -> Guard:
    """The snapshot of what the host trusts in the writable roots the command writes live,
    taken before the child. A staged root needs none: its changes pass the gate at exit."""
    writable = tuple(os.path.realpath(p) for p in (*layout.writable, *roots.process_write))
    if staged.stage is not None:
        done = {target.path for target in staged.stage.targets}
        writable = tuple(w for w in writable if w not in done)
        trusted = [t for t in trusted if not any(is_under(t, d) for d in done)]
        layout_workspaces: tuple[str, ...] = ()
    else:
        layout_workspaces = () if layout.read_only else layout.workspaces
    files = (*options.trusted_files, *([options.policy.source] if options.policy else []))
    host_files = [os.path.realpath(expand_user(p, home)) for p in files if p]
    return snapshot(
        writable,
        trusted,
        workspaces=layout_workspaces,
        grows=_appended_by_us(
            (*host_files, *(s for f in host_files for s in _rotated_siblings(f)))
        ),
    )


def _appended_by_us(paths: Sequence[str]) -> list[str]:
    """The paths this process holds open (the audit log, appended during the run): they are
    judged by growth, the others (the policy) by content."""
    held: set[tuple[int, int]] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                st = os.fstat(int(name))
                held.add((st.st_dev, st.st_ino))
    found = []
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) in held:
                found.append(path)
    return found


def _refuse_own_state(
    writable: Sequence[str],
    chosen: frozenset[Mechanism],
    *,
    files: bool,
    own: Sequence[str] = (),
) -> None:
    """egressbox's state directory (runner/own_state.py: the host probe, the seccomp program,
    trusted policies) is never writable in a child's view: a command that rewrote it would
    steer the next run. Nor may the path to one of egressbox's own files (`own`: policy,
    audit log, --save-approved's output) lead through a symbolic link inside a writable root:
    the command could point the link elsewhere, and the next run would follow it. Without
    filesystem confinement the child may write whatever the invoker may; nothing to refuse."""
    if not files:
        return

    # With a mount namespace /tmp and /var/tmp are the child's own, not the host's.
    private = face.private_paths(Mechanism.MOUNT_NAMESPACE in chosen)
    roots = [(w, os.path.realpath(w)) for w in writable if w not in private]
    state = os.path.realpath(_cache_dir())
    for root, real in roots:
        if is_under(state, real):
            raise RunRefusedError(
                [],
                message=f"refused: the writable root {root} contains egressbox's state "
                f"directory {state} (its host probe, seccomp program and trusted policies), "
                "which the command could rewrite to weaken the next run; grant a narrower "
                f"root, or set {STATE_ENV} to a directory outside every writable root",
                cause="unsafe_grant",
            )
    for path in own:
        for link in _links_on_the_way(path):
            holder = next((r for r, real in roots if is_under(link, real)), None)
            if holder is not None:
                raise RunRefusedError(
                    [],
                    message=f"refused: {path} leads through the symbolic link {link} inside "
                    f"the writable root {holder}; the command could point it elsewhere and "
                    "move the file egressbox writes or trusts there; name the real path "
                    f"{os.path.realpath(path)} instead",
                    cause="unsafe_grant",
                )


def _own_files(options: RunOptions, home: str) -> list[str]:
    source = options.policy.source if options.policy is not None else ""
    named = [*options.trusted_files, *([source] if source else [])]
    return [os.path.abspath(expand_user(p, home)) for p in named]


def _links_on_the_way(path: str) -> list[str]:
    """The symbolic links met resolving `path`, each named by its resolved parent."""
    links, parent = [], "/"
    for part in [p for p in path.split("/") if p]:
        here = os.path.join(parent, part)
        if os.path.islink(here):
            links.append(here)
        parent = os.path.realpath(here)
    return links


def _rotated_siblings(path: str) -> list[str]:
    """An audit log's rotated generations (log.1, log.2.gz...) beside it."""
    folder, name = os.path.split(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.startswith(name + ".")]


def _granted_files(
    options: RunOptions, home: str, deny: Sequence[str], warnings: list[str]
) -> tuple[str, ...]:
    """--grant-file: originals passed on purpose (a file on the credential list too), said."""
    passed = []
    for raw in options.grant_files:
        path = os.path.normpath(expand_user(raw, home))
        if not os.path.isfile(path):
            raise EgressboxError(f"--grant-file {raw}: not a file")
        inside = [d for d in deny if is_under(path, d) and d != path]
        if inside:
            raise EgressboxError(
                f"--grant-file {raw}: it lies in {inside[0]}, on the credential deny list "
                "(only a file named there itself can be passed)"
            )
        warnings.append(
            f"--grant-file {raw}: the original is in the command's view, with any credential "
            "it holds"
        )
        passed.append(path)
    return tuple(passed)


def _outside(paths: Sequence[str], roots: Sequence[str]) -> tuple[str, ...]:
    return tuple(p for p in paths if not any(is_under(p, r) for r in roots))
