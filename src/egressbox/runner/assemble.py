"""The launch plan of a run, assembled from its options and the host's facts.

Everything decided before the fork: the profile's mechanisms, the roots, the child's world
(confine/world.py), its environment and the refusals a plan needs. The only I/O here reads the
host (paths, the command on PATH); nothing is created or changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from egressbox.confine import netns
from egressbox.confine.env import (
    PORT_TEMPLATES,
    Scratch,
    child_environment,
    proxy_variables,
)
from egressbox.confine.executable import resolve_command
from egressbox.confine.launcher import LaunchPlan
from egressbox.confine.plan import (
    ADMIT_HINT,
    CAPTURE_FILES,
    CREDENTIALS,
    HOST_NEEDS,
    Enforcement,
    HostFacts,
    Mechanism,
    Profile,
    Refusal,
    WorldSpec,
    choose_mechanisms,
    expand_user,
    host_trusted,
    is_under,
    plan_filesystem,
    wanted,
)
from egressbox.errors import EgressboxError
from egressbox.runner.facts import _cache_dir, _compiled_seccomp
from egressbox.runner.options import (
    ENV_SANDBOX,
    ROOT_DETAIL,
    SCRATCH_DIR,
    MechanismReport,
    RootReport,
    RunOptions,
    RunRefusedError,
    effective_profile,
)


@dataclass
class Prepared:
    """Everything decided before the fork."""

    plan: LaunchPlan
    report: list[MechanismReport]
    host_listeners: list[socket.socket]
    network_boundary: Enforcement
    warnings: list[str] = field(default_factory=list)
    homes: tuple[str, ...] = ()  # the caller's home and the child's, for refusal records
    roots: list[RootReport] = field(default_factory=list)
    profile: Profile = Profile.WORKSPACE_PATHS
    # Host-trusted paths absent before the run: one that appears was made by the command.
    created_watch: tuple[str, ...] = ()
    # Why the run does not capture ("" when the launcher is asked to).
    capture_off: str = ""


def prepare(options: RunOptions, facts: HostFacts) -> Prepared:
    base = dict(os.environ if options.base_env is None else options.base_env)
    profile = effective_profile(options.profile, base)
    chosen, refusals = choose_mechanisms(profile, facts)
    extra, warnings = _sandbox_fallback(profile, chosen, facts, base)
    if refusals or extra:
        raise RunRefusedError(refusals + extra)
    _refuse_open_network(chosen, options)
    home = base.get("HOME", os.path.expanduser("~"))
    cwd = os.path.realpath(options.cwd or os.getcwd())
    write_roots = _real_roots(options.write_roots, home)
    if not write_roots:
        _refuse_wide_workspace(cwd, home)
        write_roots = (cwd,)
    read_roots = _real_roots(options.read_roots, home)
    process_read = _real_roots(options.process_read_roots, home)
    process_write = _real_roots(options.process_write_roots, home)
    socket_roots = _real_roots(options.unix_socket_roots, home)
    _refuse_cwd_outside(cwd, (*write_roots, *read_roots, *process_read, *process_write))
    executable = resolve_command(options.argv[0], base, cwd)
    mounts = Mechanism.MOUNT_NAMESPACE in chosen
    scratch = scratch_paths(write_roots[0]) if mounts else make_scratch(write_roots[0])
    env = child_environment(
        base,
        policy=options.env_policy,
        grants=options.grants,
        proxy=PORT_TEMPLATES,
        scratch=scratch,
        profile=profile.value,
    )
    templates = {name: env.pop(name) for name in proxy_variables(PORT_TEMPLATES)}
    if options.allow_loopback and not {"NO_PROXY", "no_proxy"} & set(options.grants):
        # The child's own servers on its private lo are reached directly.
        env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    extra_deny = tuple(os.path.normpath(expand_user(p, home)) for p in options.deny)
    trusted = _trusted_paths(options, write_roots, process_write, home)
    fs = plan_filesystem(
        home=home,
        write_roots=write_roots,
        read_roots=read_roots,
        executables=executable.grants,
        presets=options.presets,
        deny=_credential_paths(home, env.get("HOME")) + extra_deny,
        protected_files=trusted,
        process_read_roots=process_read,
        process_write_roots=process_write,
    )
    granted = (*write_roots, *read_roots, *process_read, *process_write)
    warnings += [
        f"{root} is on the credential deny list: it stays unreadable whatever is granted"
        for root in granted
        if any(is_under(root, denied) for denied in fs.deny)
    ]
    if options.allow_loopback and Mechanism.NETWORK_NAMESPACE not in chosen:
        raise EgressboxError("--allow-loopback needs a network namespace, which is unavailable")
    capture_off = _capture_off(options, chosen, facts)
    capture = not capture_off
    listeners = [] if Mechanism.NETWORK_NAMESPACE in chosen else _host_listeners()
    writable = (*write_roots, *process_write)
    # A read grant inside a writable root adds nothing (a venv in the workspace stays
    # writable); read-only roots nested in writable ones are fs.read_only_inside_write.
    readable = [p for p in (*fs.read, *socket_roots) if not any(is_under(p, w) for w in writable)]
    world = WorldSpec(
        grants=(*((p, False) for p in readable), *((p, True) for p in writable)),
        read_only=fs.read_only_inside_write,
        mask=fs.deny,
        socket_roots=socket_roots,
        scratch=(scratch.tmp, scratch.cache) if scratch is not None and mounts else (),
        cwd=cwd,
        protect_kernel=os.getuid() == 0,
        max_processes=options.max_processes,
        # Captured: the child's resolver asks egressbox's DNS inside the namespace.
        files=CAPTURE_FILES if capture else (),
    )
    plan = LaunchPlan(
        argv=options.argv,
        executable=executable.path,
        cwd=cwd,
        env=env,
        mechanisms=tuple(sorted(m.value for m in chosen)),
        uid=os.getuid(),
        gid=os.getgid(),
        host_ports=tuple(s.getsockname()[1] for s in listeners),
        read=(*fs.read, *socket_roots),
        write=fs.write,
        deny=fs.deny,
        read_only_inside_write=fs.read_only_inside_write,
        allow_loopback=options.allow_loopback,
        pass_fds=options.pass_fds,
        rlimit_nofile=options.rlimit_nofile,
        rlimit_as=options.rlimit_as,
        rlimit_nproc=options.max_processes,
        rlimit_data=options.max_memory or _half_the_memory(),
        best_effort=profile is not Profile.OS_HARDENED,
        env_ports=templates,
        parent_pid=os.getpid(),
        world=world if mounts else None,
        capture=capture,
    )
    if Mechanism.SECCOMP in chosen:
        plan = dataclasses.replace(plan, seccomp_program=_compiled_seccomp(allow_udp=capture))
    report, network = enforcement_report(profile, chosen, capture_off=capture_off)
    homes = tuple(dict.fromkeys(h for h in (home, env.get("HOME")) if h and os.path.isabs(h)))
    roots = [
        RootReport(kind, path, ROOT_DETAIL[kind])
        for kind, paths in (
            ("workspace", write_roots),
            ("read", read_roots),
            ("process_read", process_read),
            ("process_write", process_write),
            ("unix_socket", socket_roots),
            ("executable", executable.grants),
        )
        for path in dict.fromkeys(paths)
    ]
    prepared = Prepared(plan, report, listeners, network, warnings, homes, roots)
    prepared.profile = profile
    prepared.created_watch = tuple(p for p in trusted if not os.path.lexists(p))
    prepared.capture_off = capture_off
    return prepared


CAPTURE_HOST_FACT = "capture"  # confine.probe's mechanism name


def _capture_off(options: RunOptions, chosen: frozenset[Mechanism], facts: HostFacts) -> str:
    """Why this run does not capture, or "" when it does (never a refusal)."""
    if not options.capture:
        return "turned off (--no-capture)"
    if Mechanism.NETWORK_NAMESPACE not in chosen:
        return "needs a network namespace, which this run does not have"
    if CAPTURE_HOST_FACT not in facts.available:
        status = facts.status.get(CAPTURE_HOST_FACT, "absent_on_host")
        return f"unavailable on this host ({status}; egressbox doctor says why)"
    return ""


def _real_roots(paths: Sequence[str], home: str) -> tuple[str, ...]:
    return tuple(os.path.realpath(expand_user(p, home)) for p in paths)


def _half_the_memory() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (OSError, ValueError):
        return None


def _refuse_open_network(chosen: frozenset[Mechanism], options: RunOptions) -> None:
    """No network namespace and no Landlock TCP rules: the child would reach the world."""
    if _network_boundary(chosen) is not Enforcement.NONE or options.allow_direct_network:
        return
    raise RunRefusedError(
        [],
        message="refused: this host offers neither a network namespace nor Landlock TCP "
        "rules with seccomp, so the command could reach the network directly; "
        "run as root or allow user namespaces, or pass --allow-direct-network to run it "
        "with its network unconfined",
    )


def _refuse_wide_workspace(cwd: str, home: str) -> None:
    """The current directory as the workspace, when it is `/` or the home directory itself."""
    wide = {"/", os.path.realpath(home)} if home else {"/"}
    if cwd in wide:
        what = "the whole file system" if cwd == "/" else "your whole home directory"
        raise EgressboxError(
            f"the workspace would be {cwd} ({what}): every file there would be writable by "
            "the command; run it from a project directory, or pass --write-root "
            f"{cwd} to mean it"
        )


def _refuse_cwd_outside(cwd: str, roots: Sequence[str]) -> None:
    if any(is_under(cwd, root) for root in roots):
        return
    raise EgressboxError(
        f"the working directory {cwd} is outside every root, so it would not exist for the "
        f"command; run from inside a root, or add --read-root {cwd} (or --write-root {cwd})"
    )


def _trusted_paths(
    options: RunOptions, write_roots: Sequence[str], process_write: Sequence[str], home: str
) -> tuple[str, ...]:
    """What the host trusts that a writable root may hold: read-only for the child."""
    trusted = list(host_trusted((*write_roots, *process_write)))
    policy_source = options.policy.source if options.policy is not None else ""
    files = [*options.trusted_files, *([policy_source] if policy_source else [])]
    for path in files:
        real = os.path.realpath(expand_user(path, home))
        trusted.append(real)
        trusted += _rotated_siblings(real)
    trusted.append(os.path.realpath(_cache_dir()))
    lifted = {os.path.realpath(expand_user(p, home)) for p in options.writable_trusted}
    return tuple(p for p in dict.fromkeys(trusted) if p not in lifted)


def _rotated_siblings(path: str) -> list[str]:
    """An audit log's rotated generations (log.1, log.2.gz...) beside it."""
    folder, name = os.path.split(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.startswith(name + ".")]


def _credential_paths(home: str, child_home: str | None) -> tuple[str, ...]:
    """The credential list under the caller's home and, when --grant moves it, the child's.

    Tools in the child look for keys under the child's $HOME: a granted
    HOME=/home/alice must not make /home/alice/.ssh readable.
    """
    paths = tuple(expand_user(p, home) for p in CREDENTIALS)
    if child_home and os.path.isabs(child_home) and os.path.normpath(child_home) != home:
        paths += tuple(expand_user(p, os.path.normpath(child_home)) for p in CREDENTIALS)
    return paths


def _sandbox_fallback(
    profile: Profile,
    chosen: frozenset[Mechanism],
    facts: HostFacts,
    env: Mapping[str, str],
) -> tuple[list[Refusal], list[str]]:
    """worktree is best effort; EGRESSBOX_SANDBOX=off|warn|enforce picks what a gap means."""
    missing = sorted(wanted(profile) - chosen)
    if profile is not Profile.WORKTREE or not missing:
        return [], []
    mode = env.get(ENV_SANDBOX, "warn")
    if mode == "enforce":
        return [
            Refusal(m, facts.status.get(HOST_NEEDS[m], "absent_on_host"), profile, ADMIT_HINT[m])
            for m in missing
        ], []
    if mode == "off":
        return [], []
    names = ", ".join(m.value for m in missing)
    return [], [
        (
            f"profile worktree runs without {names} (unavailable here; "
            f"{ENV_SANDBOX}=enforce refuses instead)"
        )
    ]


def scratch_paths(root: str) -> Scratch:
    """The scratch space inside the first writable root (made inside the child's view)."""
    base = os.path.join(root, SCRATCH_DIR)
    return Scratch(os.path.join(base, "tmp"), os.path.join(base, "cache"))


def make_scratch(root: str) -> Scratch | None:
    """Without a mount namespace: the scratch space made on the host, never through a link.

    An earlier child could have left `.egressbox` (or `tmp` in it) as a symlink to any
    directory of the invoker's: every step opens the next name with O_NOFOLLOW.
    """
    try:
        top = os.open(root, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        base = _subdir(top, SCRATCH_DIR)
        try:
            for name in ("tmp", "cache"):
                os.close(_subdir(base, name))
            _write_ignore(base)
        finally:
            os.close(base)
    except OSError:
        return None
    finally:
        os.close(top)
    return scratch_paths(root)


def _subdir(parent: int, name: str) -> int:
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o755, dir_fd=parent)
    return os.open(name, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)


def _write_ignore(base: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(".gitignore", flags, 0o644, dir_fd=base)
    except FileExistsError:
        return
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write("# egressbox scratch space (temp files and caches)\n*\n")


def _host_listeners() -> list[socket.socket]:
    # No network namespace: the proxy listens on the host's loopback and
    # Landlock ports plus seccomp hold the child to those port numbers.
    listeners: list[socket.socket] = []
    try:
        for _ in range(2):
            listeners.append(netns.bind_listener("127.0.0.1", 0))
    except OSError as exc:
        for sock in listeners:
            sock.close()
        # e.g. inside another run's Landlock domain, which refuses every bind
        raise EgressboxError(
            f"cannot listen on 127.0.0.1 for the proxy: {exc.strerror or exc}"
        ) from None
    return listeners


def enforcement_report(
    profile: Profile, chosen: frozenset[Mechanism], *, capture_off: str = ""
) -> tuple[list[MechanismReport], Enforcement]:
    rows = []
    for mechanism in sorted(wanted(profile) | chosen):
        on = mechanism in chosen
        rows.append(
            MechanismReport(
                mechanism.value,
                Enforcement.FULL if on else Enforcement.NONE,
                "applied" if on else "unavailable on this host",
            )
        )
    network = _network_boundary(chosen)
    rows.append(MechanismReport("network_boundary", network, _NETWORK_DETAIL[network]))
    if capture_off:
        rows.append(MechanismReport(CAPTURE_ROW, Enforcement.NONE, capture_off))
    else:
        rows.append(MechanismReport(CAPTURE_ROW, Enforcement.FULL, "planned"))
    return rows, network


# The report's row for capture: not a confinement mechanism (no profile requires it, and a run
# without it is no less confined), so never a gap.
CAPTURE_ROW = "capture"
# Said when the launcher captured but this run's proxy does not serve the capture sockets.
CAPTURE_UNSERVED = (
    "this run's proxy does not serve them yet: a captured connection is refused and a DNS "
    "question goes unanswered"
)

_NETWORK_DETAIL = {
    Enforcement.FULL: "a private network namespace: the proxy is the only endpoint",
    Enforcement.PARTIAL: "no network namespace: TCP only, to the proxy's port numbers, "
    "but on any address",
    Enforcement.NONE: "the child could reach the network directly",
}


def _network_boundary(chosen: frozenset[Mechanism]) -> Enforcement:
    if Mechanism.NETWORK_NAMESPACE in chosen:
        return Enforcement.FULL
    if Mechanism.LANDLOCK_NET in chosen and Mechanism.SECCOMP in chosen:
        return Enforcement.PARTIAL
    return Enforcement.NONE


def applied_report(
    profile: Profile,
    chosen: frozenset[Mechanism],
    applied: Mapping[str, Any] | None,
    *,
    capture_off: str = "",
    capture_served: bool = True,
) -> tuple[list[MechanismReport], Enforcement]:
    """The report from what the launcher says it applied, never from the plan.

    No word from the launcher (it failed before exec): nothing is reported as applied.
    `capture_off` is why capture was not planned; `capture_served` whether this run's proxy
    serves the capture and DNS sockets the launcher made.
    """
    held = _held(applied or {})
    rows = []
    for mechanism in sorted(wanted(profile) | chosen):
        state, detail = held.get(mechanism, (Enforcement.NONE, ""))
        if mechanism not in chosen:
            detail = "unavailable on this host"
        elif state is Enforcement.NONE:
            detail = detail or "planned, but not applied"
        rows.append(MechanismReport(mechanism.value, state, detail or "applied"))
    applied_set = frozenset(m for m, (state, _) in held.items() if state is Enforcement.FULL)
    network = _network_boundary(applied_set)
    rows.append(MechanismReport("network_boundary", network, _NETWORK_DETAIL[network]))
    rows.append(_capture_row(applied or {}, capture_off, capture_served))
    return rows, network


def _capture_row(applied: Mapping[str, Any], off: str, served: bool) -> MechanismReport:
    if off:
        return MechanismReport(CAPTURE_ROW, Enforcement.NONE, off)
    done = applied.get("capture") or {}
    if done.get("status") != "full":
        why = str(done.get("reason") or "planned, but not applied")
        return MechanismReport(CAPTURE_ROW, Enforcement.NONE, f"not applied: {why}")
    families = " and ".join(f.replace("ip", "IP") for f in done.get("families") or ["ipv4"])
    detail = (
        f"every {families} TCP connection goes to the proxy (capture listener port "
        f"{done.get('capture_port')}); DNS is answered at {done.get('dns')}, where the view's "
        "/etc/resolv.conf points; other UDP reaches nothing"
    )
    if not served:
        detail += f"; {CAPTURE_UNSERVED}"
    return MechanismReport(CAPTURE_ROW, Enforcement.FULL, detail)


def _held(applied: Mapping[str, Any]) -> dict[Mechanism, tuple[Enforcement, str]]:
    full, none = Enforcement.FULL, Enforcement.NONE
    ns = set(applied.get("namespaces") or ())
    ll = applied.get("landlock") or {}
    world = applied.get("world") or {}
    skipped = "; ".join(f"{what}: {why}" for what, why in world.get("skipped") or ())
    seccomp = str(applied.get("seccomp", "none"))
    captured = (applied.get("capture") or {}).get("status") == "full"
    udp = "UDP sockets allowed: captured, they reach only the DNS address" if captured else ""
    detail = f"constructed root ({len(world.get('steps') or ())} steps)"
    return {
        Mechanism.NETWORK_NAMESPACE: (full if "net" in ns else none, ""),
        Mechanism.MOUNT_NAMESPACE: (
            full if "mnt" in ns and world else none,
            f"{detail}; not done: {skipped}" if skipped else detail,
        ),
        Mechanism.PID_NAMESPACE: (full if "pid" in ns else none, ""),
        Mechanism.LANDLOCK_FS: (full if ll.get("fs") else none, f"ABI {ll.get('abi', 0)}"),
        Mechanism.LANDLOCK_NET: (
            full if ll.get("net") else none,
            f"no TCP bind; connect to {ll['connect']}" if ll.get("connect") else "",
        ),
        Mechanism.LANDLOCK_SCOPE: (full if ll.get("scopes") else none, ""),
        Mechanism.SECCOMP: (Enforcement(seccomp) if seccomp in {"full", "partial"} else none, udp),
        Mechanism.CAPABILITIES: (full if applied.get("capabilities") else none, ""),
    }
