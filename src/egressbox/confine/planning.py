"""Confinement planned, pure: nothing here reads or changes the host (tests/test_imports.py
holds it to the pure set: no sockets, processes or threads are even loaded).

`plan` decides which mechanisms the Request's profile gets on this host, and its refusals: the
caller's own inputs (its layout, the scratch space, the environment) depend on them, so they
come first. `environment` builds the child's environment on the Plan. `finish` decides the
rest of the child's confinement from the Plan and the Run the caller built on it: the
filesystem grants (asked for as `Grants`, narrowed to what holds without a mount namespace,
with the tools' configuration files as clean copies), the world, the walls the launcher
applies (`LaunchPlan`), and what the caller is told (warnings, notes). What `finish` needs of
the host is in the Run already, read by confine/host.py `read_host`. The mechanisms are chosen
once, here: `finish` takes them from the Plan, never from the caller.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from egressbox.confine.grants import (
    ADMIT_HINT,
    CAPTURE_FILES,
    CREDENTIALS,
    DEFAULT_PRESETS,
    HOST_NEEDS,
    PRESETS,
    REQUIREMENT_FALLBACK,
    USER_TEMP,
    FsPlan,
    HostFacts,
    Mechanism,
    Profile,
    Refusal,
    WorldSpec,
    choose_mechanisms,
    expand_user,
    is_under,
    plan_filesystem,
    socket_bind_roots,
    sockets_to_hide,
    tmpfs_sizes,
    wanted,
)
from egressbox.confine.spec import LaunchPlan

if TYPE_CHECKING:
    # Types only: a launcher forked ahead of time (runner/zygote.py) loads this module, and
    # the environment's module (~3 ms) is nothing it needs.
    from egressbox.confine.cgroup import CgroupPlan
    from egressbox.confine.clean import CleanCopies
    from egressbox.confine.env import EnvPolicy, HeldBack, Scratch


class Grants(NamedTuple):
    """The filesystem grants asked for (grants.py plan_filesystem's inputs)."""

    home: str
    write_roots: tuple[str, ...]
    read_roots: tuple[str, ...]
    executables: tuple[str, ...]
    presets: tuple[str, ...] = DEFAULT_PRESETS
    deny: tuple[str, ...] = CREDENTIALS
    protected_files: tuple[str, ...] = ()
    process_read_roots: tuple[str, ...] = ()
    process_write_roots: tuple[str, ...] = ()
    socket_roots: tuple[str, ...] = ()
    # Without a mount namespace: the scratch space made on the host for a read-only workspace.
    host_scratch: tuple[str, ...] = ()
    passed: tuple[str, ...] = ()  # --grant-file: originals passed as they are


class HostReads(NamedTuple):
    """What `read_host` read of the host for a Run (nothing is made)."""

    # The host's live bound unix sockets (real paths) of this network namespace: read when
    # the world covers them (a mount namespace) or the connect supervisor admits unix paths.
    live_sockets: tuple[str, ...] = ()
    real: Mapping[str, str] = {}  # the real path of each granted path and socket root
    copies: CleanCopies | None = None  # the tools' configuration files (None: not in view)
    cgroup: CgroupPlan | None = None
    cgroup_off: str = "the host's memory size is unknown"
    # Why the connects cannot be supervised without a network namespace ("" when they can,
    # or with a namespace) and, when they are, the supervisor's seccomp filter.
    connects_off: str = ""
    supervised: bool = False
    connect_filter: bytes = b""


class Request(NamedTuple):
    """What a run asks of confinement before anything else: its profile and how a best-effort
    profile falls back where the host lacks a mechanism."""

    profile: Profile
    # EGRESSBOX_SANDBOX, for profile worktree only: "off" applies the network boundary alone,
    # "warn" runs without what the host lacks and says so, "enforce" refuses instead.
    sandbox: str = "warn"


class Plan(NamedTuple):
    """The mechanisms the Request's profile gets on this host, decided (`plan`)."""

    profile: Profile
    mechanisms: frozenset[Mechanism]  # chosen and on this host
    # Required mechanisms the host lacks: the command must not start (exit 126).
    refusals: tuple[Refusal, ...]
    # What a best-effort profile runs without (said, not refused): worktree's gaps.
    gaps: tuple[Mechanism, ...]
    lacking: frozenset[Mechanism]  # everything the profile wants and the host lacks
    files_off: bool  # the network boundary alone (unrestricted, or worktree with sandbox off)

    @property
    def mounts(self) -> bool:
        """A mount namespace: the child's world is constructed."""
        return Mechanism.MOUNT_NAMESPACE in self.mechanisms

    @property
    def files(self) -> bool:
        """Filesystem rules of some kind (the constructed world, or Landlock's rules)."""
        return self.mounts or Mechanism.LANDLOCK_FS in self.mechanisms


class Run(NamedTuple):
    """What a confined command is to get under a Plan, with what was read of the host for it."""

    argv: tuple[str, ...]
    executable: str  # the command resolved on the child's PATH
    cwd: str  # real path
    env: dict[str, str]
    env_ports: Mapping[str, str]  # NAME -> template with {http}/{socks}
    grants: Grants
    host: HostReads
    read_only_scratch: str  # a read-only workspace's scratch ("": a writable workspace)
    scratch: Scratch | None
    allow_loopback: bool
    pass_fds: tuple[int, ...]
    rlimit_nofile: int | None
    rlimit_as: int | None
    max_processes: int | None
    memory: int | None  # the run's memory budget in bytes (None: unknown)
    uid: int
    gid: int
    parent_pid: int
    capture: bool
    copies: tuple[tuple[str, str], ...] = ()  # more files the view holds: (path, contents)
    # The host-trusted paths a staged workspace's gate holds back at the run's end (not bound
    # read-only then: the command may write them in its layer, and what it wrote is named,
    # not applied); `set_up` applies it once the layer is made.
    trusted: tuple[str, ...] = ()
    seccomp_program: bytes = b""  # compiled (and cached) by the caller; b"": no seccomp
    run_as: tuple[int, int, tuple[int, ...]] | None = None  # --user NAME's ids
    # The variable that tells a nested run what this one grants ("": none).
    roots_variable: str = ""


class Confinement(NamedTuple):
    """A run's whole confinement, decided (`finish`)."""

    launcher: LaunchPlan  # what the launcher applies (completed by `set_up`)
    mechanisms: frozenset[Mechanism]  # planned: chosen and on this host
    fs: FsPlan  # the filesystem grants as they hold, with the clean copies' originals denied
    warnings: tuple[str, ...]  # said before the command starts
    notes: tuple[str, ...]  # what a clean copy left out, said like a widened root
    supervised: bool  # no network namespace: the connect supervisor holds the connects
    captures: bool  # asked to capture (in the launcher, or through the supervisor)
    trusted: tuple[str, ...] = ()  # what a staged layer holds back (Run.trusted)


def granted_paths(
    fs: FsPlan, workspaces: Sequence[str], process_write: Sequence[str], socket_roots: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The roots bound read-only and read-write. A read grant inside a writable root adds
    nothing (a venv in the workspace stays writable); read-only roots nested in writable ones
    are fs.read_only_inside_write."""
    writable = (*workspaces, *process_write)
    readable = tuple(
        p for p in (*fs.read, *socket_roots) if not any(is_under(p, w) for w in writable)
    )
    return readable, writable


def plan(request: Request, facts: HostFacts) -> Plan:
    """The mechanisms this host gives the request's profile, and its refusals (pure). A
    mechanism the host lacks (facts) is never planned.

    worktree is best effort: a missing mechanism is a gap, or a refusal when the request's
    `sandbox` is "enforce"; "off" gives it what unrestricted gets (the network boundary
    alone). os_hardened requires every mechanism."""
    profile = request.profile
    files_off = profile is Profile.UNRESTRICTED or (
        profile is Profile.WORKTREE and request.sandbox == "off"
    )
    chosen, refusals = choose_mechanisms(Profile.UNRESTRICTED if files_off else profile, facts)
    lacking = wanted(profile) - chosen
    missing = () if files_off or profile is not Profile.WORKTREE else tuple(sorted(lacking))
    if request.sandbox == "enforce" and missing:
        refusals += [
            Refusal(
                m,
                facts.status.get(HOST_NEEDS[m], "absent_on_host"),
                profile,
                ADMIT_HINT[m],
                requirement=REQUIREMENT_FALLBACK,
                selector_honored=True,
            )
            for m in missing
        ]
        missing = ()
    return Plan(profile, chosen, tuple(refusals), missing, lacking, files_off)


def finish(planned: Plan, run: Run) -> Confinement:
    """The run's confinement under `planned`: its grants, its world and its walls (pure)."""
    r = run
    chosen = planned.mechanisms
    mounts = Mechanism.MOUNT_NAMESPACE in chosen
    landlock = Mechanism.LANDLOCK_FS in chosen
    files = mounts or landlock
    fs = filesystem(r.grants, mounts)
    no_copies: tuple[FsPlan, tuple[tuple[str, str], ...], list[str], list[str]] = (fs, (), [], [])
    fs, copies, warnings, notes = with_copies(fs, r.host, mounts) if files else no_copies
    g = r.grants
    env = dict(r.env)
    if files and r.roots_variable:
        env[r.roots_variable] = roots_json(fs, g.socket_roots)
    if g.socket_roots and files and not landlock:
        warnings.append(
            "unix socket roots admit connect only here: a bind there needs Landlock's "
            "filesystem rules, which keep their other files read-only"
        )
    readable, writable = granted_paths(fs, g.write_roots, g.process_write_roots, g.socket_roots)
    real = r.host.real
    # Only socket roots admit a socket: a bind there (read-write bind, Landlock admitting the
    # making of a socket and no other write) and a connect; a live socket under any other
    # grant is covered (grants.py sockets_to_hide). Without Landlock's filesystem rules a
    # read-write bind would make the socket root writable: it stays read-only (connect only).
    socket_bind = socket_bind_roots(g.socket_roots, fs.write, writable) if landlock else ()
    hidden = (
        sockets_to_hide(
            r.host.live_sockets,
            {real.get(p, p) for p in (*readable, *writable)},
            [real.get(p, p) for p in g.socket_roots],
        )
        if mounts
        else ()
    )
    # The private file systems together fit in the run's memory budget.
    tmp_size, shm_size = tmpfs_sizes(r.memory)
    world = WorldSpec(
        grants=(*((p, False) for p in readable), *((p, True) for p in writable)),
        read_only=fs.read_only_inside_write,
        mask=(*fs.deny, *hidden),
        socket_roots=g.socket_roots,
        socket_bind=socket_bind if mounts else (),
        scratch=(r.scratch.tmp, r.scratch.cache) if r.scratch is not None and mounts else (),
        cwd=r.cwd,
        protect_kernel=r.uid == 0,
        max_processes=r.max_processes,
        tmp_size=str(tmp_size),
        shm_size=str(shm_size),
        # Captured: the child's resolver asks egressbox's DNS inside the namespace.
        # and the tools' configuration files as clean copies (confine/clean.py).
        files=(*(CAPTURE_FILES if r.capture else ()), *copies, *r.copies),
    )
    # The read-only workspace's scratch is in the view's private /tmp: Landlock must let the
    # command write there whatever the presets say (it is never bound from the host).
    scratch = (r.read_only_scratch,) if r.read_only_scratch and mounts else ()
    supervised = Mechanism.NETWORK_NAMESPACE not in chosen and r.host.supervised
    launcher = LaunchPlan(
        argv=r.argv,
        executable=r.executable,
        cwd=world.cwd,
        env=env,
        mechanisms=tuple(sorted(m.value for m in chosen)),
        uid=r.uid,
        gid=r.gid,
        read=(*fs.read, *g.socket_roots),
        write=(*fs.write, *scratch),
        deny=fs.deny,
        read_only_inside_write=fs.read_only_inside_write,
        sockets=socket_bind,
        allow_loopback=r.allow_loopback,
        pass_fds=r.pass_fds,
        rlimit_nofile=r.rlimit_nofile,
        rlimit_as=r.rlimit_as,
        rlimit_nproc=r.max_processes,
        rlimit_data=r.memory,
        cgroup=r.host.cgroup,
        cgroup_off=r.host.cgroup_off,
        best_effort=planned.profile is not Profile.OS_HARDENED,
        env_ports=r.env_ports,
        parent_pid=r.parent_pid,
        world=world if mounts else None,
        # Supervised, the connect filter sends every connect to the supervisor, which
        # connects it to the proxy or the capture listener: no capture in the launcher.
        capture=r.capture and not supervised,
        seccomp_program=r.seccomp_program if Mechanism.SECCOMP in chosen else b"",
        connect_filter=r.host.connect_filter if supervised else b"",
        run_as=r.run_as,
    )
    if supervised:
        launcher = _unix_grants(launcher, g.socket_roots, r.host)
    return Confinement(
        launcher, chosen, fs, tuple(warnings), tuple(notes), supervised, r.capture, r.trusted
    )


def _unix_grants(launcher: LaunchPlan, socket_roots: Sequence[str], host: HostReads) -> LaunchPlan:
    """Where the connect supervisor may connect a unix socket path for the command."""
    if launcher.world is not None or not launcher.has(Mechanism.LANDLOCK_FS):
        return launcher  # a constructed view holds only grants; no filesystem rules: every path
    # The host's view: Landlock does not cover connect(2) to a pathname socket, so the
    # supervisor admits one only where the world would have it (the write roots and the
    # socket roots), and not to a host socket already live under a write root.
    sockets = tuple(host.real.get(p, p) for p in socket_roots)
    write = tuple(host.real.get(p, p) for p in launcher.write)
    hidden = sockets_to_hide(host.live_sockets, set(write), list(sockets))
    return launcher._replace(unix_roots=(*write, *sockets), unix_hidden=hidden)


def roots_json(fs: FsPlan, sockets: Sequence[str]) -> str:
    """What this run grants, for a run nested in it (its EGRESSBOX_ROOTS)."""
    write = list(dict.fromkeys(fs.write))
    read = [p for p in dict.fromkeys((*fs.read, *sockets)) if p not in fs.deny]
    return json.dumps({"write": write, "read": read}, separators=(",", ":"))


def credential_paths(home: str, child_home: str | None = None) -> tuple[str, ...]:
    """The credential list under the caller's home and, when the child's $HOME is another,
    under that one too (tools in the child look for keys under the child's $HOME: a granted
    HOME=/home/alice must not make /home/alice/.ssh readable)."""
    paths = tuple(expand_user(p, home) for p in CREDENTIALS)
    if child_home and os.path.isabs(child_home) and os.path.normpath(child_home) != home:
        paths += tuple(expand_user(p, os.path.normpath(child_home)) for p in CREDENTIALS)
    return paths


def preset_paths(presets: Sequence[str], home: str) -> tuple[str, ...]:
    """The paths the named presets grant, under `home`."""
    return tuple(expand_user(p, home) for name in presets for p in PRESETS.get(name, ()))


def filesystem(g: Grants, mounts: bool) -> FsPlan:
    """The run's filesystem grants (grants.py plan_filesystem), as they can hold on this host:
    without a mount namespace (`mounts` False) see host_view."""
    fs = plan_filesystem(
        home=g.home,
        write_roots=g.write_roots,
        read_roots=g.read_roots,
        executables=g.executables,
        presets=g.presets,
        deny=g.deny,
        protected_files=g.protected_files,
        process_read_roots=g.process_read_roots,
        process_write_roots=g.process_write_roots,
    )
    return fs if mounts else host_view(fs, g.protected_files, g.host_scratch)


# Without a mount namespace the child sees the host's /dev, and Landlock is the only wall: the
# grant of /dev (the constructed view's minimal one) becomes these nodes alone (read, write and,
# from ABI 5, ioctl); every other host device (disks, /dev/kmsg, other users' terminals,
# /dev/shm) cannot be opened. A command's own terminal is an inherited descriptor.
HOST_DEVICE_NODES = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
)


def host_view(fs: FsPlan, trusted: Sequence[str], scratch: Sequence[str]) -> FsPlan:
    """Without a mount namespace the grants are the host's paths, and Landlock alone holds them.

    - /dev narrows to the nodes every program uses (host_devices);
    - /tmp and /var/tmp are the host's, shared with every other process and user: not granted
      (a private one needs a mount namespace); TMPDIR points into the scratch space, which is
      (`scratch`: a read-only workspace's, made outside it for this run);
    - host-trusted names inside a writable root are not split out of its grant: Landlock is
      allow-only, so keeping `.git/config` read-only would take the right to create anything
      in the workspace's top directory and in `.git` (every new file, `git`'s lock files).
      The guard checks them after the run and puts them back (runner/verify.py), as in direct
      mode; read roots nested in writable ones stay split (the user asked for them).
    """
    write = tuple(p for p in host_devices(fs.write) if p not in USER_TEMP)
    protected = set(trusted)
    nested = tuple(p for p in fs.read_only_inside_write if p not in protected)
    return fs._replace(write=(*write, *scratch), read_only_inside_write=nested)


def host_devices(write: Sequence[str]) -> tuple[str, ...]:
    """The write grants with /dev narrowed to the device nodes every program may use."""
    kept = tuple(path for path in write if path != "/dev")
    return (*kept, *HOST_DEVICE_NODES) if len(kept) < len(write) else kept


def private_paths(mounts: bool) -> tuple[str, ...]:
    """The host paths a child's view makes its own (its /tmp and /var/tmp): a grant of one is
    not the host's directory."""
    return USER_TEMP if mounts else ()


def held_paths(fs: FsPlan, grants: Grants, host: HostReads, mounts: bool) -> tuple[str, ...]:
    """The granted paths (`fs`, with the clean copies in `host`) whose real paths, and the live
    sockets under them, the world or the connect supervisor holds: what `read_host` reads."""
    if host.copies is not None:
        fs = with_copies(fs, host, mounts)[0]
    _, writable = granted_paths(
        fs, grants.write_roots, grants.process_write_roots, grants.socket_roots
    )
    return tuple(dict.fromkeys((*fs.read, *fs.write, *writable, *grants.socket_roots)))


def with_copies(
    fs: FsPlan, host: HostReads, mounts: bool
) -> tuple[FsPlan, tuple[tuple[str, str], ...], list[str], list[str]]:
    """The grants with the clean copies: (grants, files the view holds, warnings, notes).

    Each copy is bound over its original's path (the launcher refuses to start the command
    when one cannot be); an original with no copy joins the deny list (masked in the world).
    Without a mount namespace nothing can be bound: the originals are left out of Landlock's
    rules, so the files are not granted at all, and said so.
    """
    copies = host.copies
    if copies is None:
        return fs, (), [], []
    in_view = (*fs.read, *fs.write)
    warnings = list(copies.notes)
    copied = {p for p, _ in copies.files} if mounts else set()
    fs = fs._replace(
        deny=(*fs.deny, *(p for p in copies.originals if p not in copied)),
        # An included file may lie outside every grant: its copy must be readable too.
        read=(*fs.read, *(p for p in copied if not any(is_under(p, r) for r in in_view))),
    )
    if not mounts:
        names = ", ".join(p for p, _ in copies.files)
        if names:
            warnings.append(
                f"not granted (a clean copy needs a mount namespace, which this run does not "
                f"have): {names}; --grant-file PATH passes one as it is"
            )
        return fs, (), warnings, []
    # What a copy left out is said like a widened root: before the command, not under --quiet
    # (a credential helper in /etc/gitconfig is common and needs no action).
    notes = [f"granted as a clean copy: {what}" for what in copies.cleaned]
    return fs, copies.files, warnings, notes


class ChildEnvironment(NamedTuple):
    """The environment a confined command starts with (confine/env.py)."""

    env: dict[str, str]  # without the proxy variables
    # The proxy variables as templates ({http}, {socks}): the launcher fills in the ports.
    templates: dict[str, str]
    held: HeldBack  # what the caller's environment kept back: names, never values


def environment(
    planned: Plan,
    base: Mapping[str, str],
    *,
    policy: EnvPolicy,
    grants: Mapping[str, str | None],
    remove: Sequence[str],
    scratch: Scratch | None,
    writable: Sequence[str],
) -> ChildEnvironment:
    """The child's environment under `planned`'s profile: `base` (the caller's) passed
    through the environment policy, `grants` (--env NAME[=VALUE]) and `remove`, pointed at
    the scratch space and the proxy (pure)."""
    from egressbox.confine.env import PORT_TEMPLATES, child_environment, held_back, proxy_variables

    held = held_back(base, policy=policy, grants=grants, remove=remove)
    env = child_environment(
        base,
        policy=policy,
        grants=grants,
        proxy=PORT_TEMPLATES,
        scratch=scratch,
        profile=planned.profile.value,
        remove=remove,
        writable=writable,
        held=held,
    )
    templates = {name: env.pop(name) for name in proxy_variables(PORT_TEMPLATES)}
    return ChildEnvironment(env, templates, held)


def scratch_paths(root: str, name: str) -> Scratch:
    """The scratch space in directory `name` of `root`."""
    from egressbox.confine.env import Scratch

    base = os.path.join(root, name)
    return Scratch(os.path.join(base, "tmp"), os.path.join(base, "cache"))
