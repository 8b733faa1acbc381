"""Confinement's one face: plan(request, facts) -> Plan, pure, and launch(plan) -> Launched.

`plan` decides which mechanisms the Request's profile gets on this host, and its refusals: the
caller's own inputs (its layout, the scratch space, the environment) depend on them, so they
come first. `finish` (pure too) decides the rest of the child's confinement from the Plan and
the Run the caller built on it: the filesystem grants (asked for as `Grants`, narrowed to what
holds without a mount namespace, with the tools' configuration files as clean copies), the
world, the walls the launcher applies, and what the caller is told (warnings, notes). Neither
reads nor changes anything: what `finish` needs of the host is in the Run already, read by
`read_host` (the live unix sockets, real paths, the clean copies' sources, the cgroup, whether
connects can be supervised). `set_up` makes what the launch needs on the host after planning
(the proxy's listeners on the host's loopback without a network namespace, the connect
supervisor's capture listener) and completes the launcher's plan with it and the staged
workspace's layer. `launch` forks the launcher (confine/launcher.py) with it.

The mechanisms are chosen once, here: `finish` takes them from the Plan, never from the caller.
The scratch space itself is made by named set-up steps (`make_scratch`, `private_scratch`).
The Run's inputs are built on the Plan through the face too (`environment`, `resolve_command`,
`plan_caches`), and so is the way back: `apply_layer` and `layer_changes` walk what a run left
in its staged layer and apply it to the host through the gate (confine/staging.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from egressbox.confine import cgroup, launcher, netns
from egressbox.confine.executable import resolve_command as resolve_command  # noqa: PLC0414
from egressbox.confine.grants import (
    ADMIT_HINT,
    CAPTURE_FILES,
    CREDENTIALS,
    DEFAULT_PRESETS,
    HOST_NEEDS,
    PACKAGE_MANAGER_CONFIG,
    PRESETS,
    PROC_NET_UNIX,
    REQUIREMENT_FALLBACK,
    USER_TEMP,
    FsPlan,
    HostFacts,
    Mechanism,
    Profile,
    Refusal,
    WorldSpec,
    bound_socket_paths,
    choose_mechanisms,
    expand_user,
    is_under,
    plan_filesystem,
    socket_bind_roots,
    sockets_to_hide,
    tmpfs_sizes,
    wanted,
)
from egressbox.confine.launcher import LaunchPlan, give_directories, launcher_main
from egressbox.confine.staging import apply_layer as apply_layer  # noqa: PLC0414
from egressbox.confine.staging import layer_changes as layer_changes  # noqa: PLC0414
from egressbox.confine.toolchains import plan_caches as plan_caches  # noqa: PLC0414
from egressbox.core.errors import EgressboxError

# Re-exported above as the face's own (`X as X`; light modules the launcher or the runner
# loads anyway): the command on the child's PATH and what it needs (confine/executable.py),
# the toolchains' caches of a child's environment (confine/toolchains.py), and the way back
# (runner/layers.py): what a run left in its staged layer, applied to the host through the
# gate (confine/staging.py), or listed.

if TYPE_CHECKING:
    # Types only: a launcher forked ahead of time (runner/zygote.py) loads this module, and
    # the environment's module (~3 ms) is nothing it needs.
    from egressbox.confine.cgroup import CgroupPlan
    from egressbox.confine.clean import CleanCopies
    from egressbox.confine.env import EnvPolicy, HeldBack, Scratch
    from egressbox.confine.notify import Notifications as Notifications  # noqa: PLC0414 (used as face.Notifications)
    from egressbox.confine.probe import Mechanism as HostMechanism
    from egressbox.confine.refusal import HostPath, PathPlan, RefusalRecord, SeccompKill
    from egressbox.confine.staging import StagingSpec
    from egressbox.confine.toolchains import CacheMode, CacheRoot


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
    fs = _filesystem(r.grants, mounts)
    no_copies: tuple[FsPlan, tuple[tuple[str, str], ...], list[str], list[str]] = (fs, (), [], [])
    fs, copies, warnings, notes = _with_copies(fs, r.host, mounts) if files else no_copies
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


class Launched(NamedTuple):
    """A launcher forked with its plan (runner/spawn.py's Launched is built from it)."""

    pid: int
    chan: socket.socket  # to the launcher: its listeners and its word come over it
    report_fd: int  # what it applied arrives here just before the command's exec


# A launcher forked ahead of time (runner/zygote.py): given the plan, the launcher's end of
# the channel and the descriptors to dup2, its pid; None when there is none (fork then).
Forker = Callable[[LaunchPlan, socket.socket, dict[int, int]], "int | None"]


def launch(
    plan: LaunchPlan,
    *,
    child_fds: Mapping[int, int] | None = None,
    in_child: Callable[[], None] | None = None,
    forker: Forker | None = None,
) -> Launched:
    """Fork the launcher with `plan` (a Confinement's launcher plan, as `set_up` completed it):
    `child_fds` are dup2()ed onto its std fds (target: source), then `in_child` runs in it.
    On failure nothing of the launch stays open."""
    fds = dict(child_fds or {})
    parent_chan, child_chan = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # What the launcher applied arrives on this pipe just before exec, which closes it.
    report_r, report_w = os.pipe()
    plan = plan._replace(report_fd=report_w)
    try:
        pid = (forker(plan, child_chan, fds) if forker is not None else None) or os.fork()
    except BaseException:
        for end in (parent_chan, child_chan):
            end.close()
        os.close(report_r)
        os.close(report_w)
        raise
    if pid == 0:  # the launcher
        _launcher(plan, parent_chan, child_chan, report_r, fds, in_child)
    child_chan.close()
    os.close(report_w)
    return Launched(pid, parent_chan, report_r)


def launcher_word(chan: socket.socket) -> tuple[dict[str, object], list[int]]:
    """The launcher's next message on `chan` (Launched.chan) and the descriptors it sent with
    it (its listeners); ({}, []) when it closed its end."""
    return netns.recv_message(chan)


def on_host_network(sockets: Sequence[socket.socket]) -> bool:
    """Whether any of these sockets lives in this process's network namespace (the launcher's
    listeners must not: the command's namespace is private)."""
    own = netns.own_namespace_inode()
    return any(netns.namespace_inode(s) == own for s in sockets)


def _launcher(  # noqa: PLR0917 (the launch's own ends, in the child)
    plan: LaunchPlan,
    parent_chan: socket.socket,
    child_chan: socket.socket,
    report_r: int,
    fds: Mapping[int, int],
    in_child: Callable[[], None] | None,
) -> NoReturn:
    parent_chan.close()
    os.close(report_r)
    for target, source in fds.items():
        os.dup2(source, target)
    if in_child is not None:
        in_child()
    launcher_main(plan, child_chan.detach())


# -- the grants' parts the caller names (pure) ----------------------------------------------


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


def _filesystem(g: Grants, mounts: bool) -> FsPlan:
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


# -- reading the host for a Run ---------------------------------------------------------------


def read_host(
    planned: Plan,
    grants: Grants,
    *,
    budget: int | None,
    max_processes: int | None,
) -> HostReads:
    """What `finish` needs of the host for these grants under `planned` (reads only): the
    grants themselves are planned here as `finish` will, to know which paths to read."""
    mechanisms = planned.mechanisms
    mounts = Mechanism.MOUNT_NAMESPACE in mechanisms
    files = mounts or Mechanism.LANDLOCK_FS in mechanisms
    connects = "" if Mechanism.NETWORK_NAMESPACE in mechanisms else connects_off(mechanisms)
    supervised = Mechanism.NETWORK_NAMESPACE not in mechanisms and not connects
    fs = _filesystem(grants, mounts)
    copies = _gather_copies(fs, grants) if files else None
    reads = HostReads(copies=copies, connects_off=connects, supervised=supervised)
    if copies is not None:
        fs = _with_copies(fs, reads, mounts)[0]
    if mounts or supervised:
        # The paths the world or the supervisor holds the live sockets against.
        _, writable = granted_paths(
            fs, grants.write_roots, grants.process_write_roots, grants.socket_roots
        )
        paths = (*fs.read, *fs.write, *writable, *grants.socket_roots)
        reads = reads._replace(
            live_sockets=_live_sockets(),
            real={p: os.path.realpath(p) for p in dict.fromkeys(paths)},
        )
    group, group_off = probe_cgroup(budget, max_processes)
    return reads._replace(
        cgroup=group,
        cgroup_off=group_off,
        connect_filter=connect_filter() if supervised else b"",
    )


def _live_sockets() -> tuple[str, ...]:
    """The host's bound unix sockets, as real paths; /proc/net/unix lists the sockets of this
    network namespace."""
    try:
        with open(PROC_NET_UNIX, encoding="utf-8", errors="surrogateescape") as f:
            table = f.read()
    except OSError:
        return ()
    found = [os.path.realpath(p) for p in bound_socket_paths(table)]
    return tuple(p for p in dict.fromkeys(found) if _is_socket(p))


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


def _gather_copies(fs: FsPlan, g: Grants) -> CleanCopies | None:
    """The tools' configuration files in view, read and cleaned (confine/clean.py); None when
    none is in view."""
    from egressbox.confine import clean

    presets = (
        *(expand_user(p, g.home) for p in PACKAGE_MANAGER_CONFIG),
        *clean.SYSTEM_TOOL_CONFIG,
    )
    in_view = (*fs.read, *fs.write)
    entries = [p for p in presets if any(is_under(p, r) for r in in_view) and os.path.lexists(p)]
    if not entries:
        return None
    return clean.gather(entries, home=g.home, deny=fs.deny, passed=g.passed)


def _with_copies(
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


def probe_cgroup(budget: int | None, max_processes: int | None) -> tuple[CgroupPlan | None, str]:
    """The run's memory budget as a cgroup where the host delegates one, or why not."""
    if budget is None:
        return None, "the host's memory size is unknown"

    return cgroup.probe(budget, max_processes, f"{cgroup.PREFIX}{os.getpid()}")


def connects_off(chosen: frozenset[Mechanism]) -> str:
    """Why this run's connects cannot be supervised without a namespace ("" when they can)."""
    from egressbox.confine import notify

    if Mechanism.SECCOMP not in chosen:
        return "the profile applies no seccomp filter"
    return notify.support()


def connect_filter() -> bytes:
    """The connect supervisor's seccomp filter for this machine (Plan's launcher plan)."""
    from egressbox.confine import notify

    return notify.program()


def supervisor(fd: int) -> Notifications:
    """The kernel's side of a connect supervisor's notification descriptor `fd` (the one the
    launcher sends before exec): receiving, checking, answering the held connects and reaching
    into the task that made them. The policy of what to connect where is the caller's."""
    from egressbox.confine import notify

    return notify.Notifications(fd)


def namespace_blocker() -> str:
    """What blocks namespaces here and the fix, in a line ("" when nothing is found): a test
    unshare in a child and a few /proc reads."""
    from egressbox.confine.probe import namespace_blocker as find

    found = find()
    return found.line() if found is not None else ""


# -- the child's inputs, built on the Plan before `finish` ---------------------------------


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

    env = child_environment(
        base,
        policy=policy,
        grants=grants,
        proxy=PORT_TEMPLATES,
        scratch=scratch,
        profile=planned.profile.value,
        remove=remove,
        writable=writable,
    )
    templates = {name: env.pop(name) for name in proxy_variables(PORT_TEMPLATES)}
    return ChildEnvironment(
        env, templates, held_back(base, policy=policy, grants=grants, remove=remove)
    )


def seccomp_row() -> str:
    """The run report's seccomp detail: the allow list's size and the measurement behind it
    (loaded only for a report)."""
    from egressbox.confine.syscall_table import report_row

    return report_row()


# -- set-up with I/O before the fork --------------------------------------------------------


def bind_host_listeners() -> list[socket.socket]:
    """No network namespace: the proxy listens on the host's loopback and Landlock ports plus
    seccomp hold the child to those port numbers."""
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


def bind_host_capture() -> socket.socket:
    """The capture listener on the host's loopback: the connect supervisor connects every
    command socket bound elsewhere to it (the proxy learns the destination from its table)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


class SetUp(NamedTuple):
    """What `set_up` made for a planned run, and the launcher's plan completed with it."""

    launcher: LaunchPlan
    listeners: list[socket.socket]  # the proxy's, on the host's loopback (no namespace)
    host_capture: socket.socket | None  # the connect supervisor's capture listener


def set_up(plan: Confinement, *, staged: StagingSpec | None = None) -> SetUp:
    """Make on the host what the planned run needs before its launch: without a network
    namespace the proxy's listeners (and, supervised with capture, the capture listener);
    `staged` is the staged workspace's layer (made by the caller), which holds the host-trusted
    paths back at the run's end instead of binding them read-only. On failure nothing made
    stays open."""
    launcher = plan.launcher
    if staged is not None and launcher.world is not None:
        held = set(plan.trusted)
        world = launcher.world._replace(
            read_only=tuple(p for p in launcher.world.read_only if p not in held)
        )
        launcher = launcher._replace(world=world, staged=staged)
    if Mechanism.NETWORK_NAMESPACE in plan.mechanisms:
        return SetUp(launcher, [], None)
    listeners = bind_host_listeners()
    launcher = launcher._replace(host_ports=tuple(s.getsockname()[1] for s in listeners))
    try:
        capture = bind_host_capture() if plan.supervised and plan.captures else None
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    return SetUp(launcher, listeners, capture)


# The scratch space (TMPDIR, tool caches) of a run: `tmp` and `cache` in a directory of the
# first writable workspace (made inside the child's view), or made on the host before the fork.


def scratch_paths(root: str, name: str) -> Scratch:
    """The scratch space in directory `name` of `root`."""
    from egressbox.confine.env import Scratch

    base = os.path.join(root, name)
    return Scratch(os.path.join(base, "tmp"), os.path.join(base, "cache"))


def make_scratch(root: str, name: str, owner: tuple[int, int] | None = None) -> Scratch | None:
    """Without a mount namespace: the scratch space made on the host, never through a link;
    `owner` (--user) is given it. None when it cannot be made.

    An earlier child could have left `name` (or `tmp` in it) as a symlink to any directory of
    the invoker's: every step opens the next name with O_NOFOLLOW.
    """
    try:
        top = os.open(root, os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        base = _subdir(top, name)
        try:
            for sub in ("tmp", "cache"):
                os.close(_subdir(base, sub))
            _write_ignore(base)
        finally:
            os.close(base)
    except OSError:
        return None
    finally:
        os.close(top)
    made = scratch_paths(root, name)
    if owner is not None:
        give_scratch(made, owner)
    return made


def private_scratch(owner: tuple[int, int] | None = None) -> Scratch:
    """A read-only workspace's scratch space without a mount namespace: a private directory of
    the host's, for this run only (the caller removes its parent at the end)."""
    import tempfile

    from egressbox.confine.env import Scratch

    made = tempfile.mkdtemp(prefix="egressbox-scratch-")
    for name in ("tmp", "cache"):
        os.mkdir(os.path.join(made, name), 0o700)
    scratch = Scratch(os.path.join(made, "tmp"), os.path.join(made, "cache"))
    if owner is not None:
        give_scratch(scratch, owner)
    return scratch


def give_scratch(scratch: Scratch, owner: tuple[int, int]) -> None:
    """--user: the scratch space made on the host (TMPDIR, caches) is NAME's."""
    give_directories((os.path.dirname(scratch.tmp), scratch.tmp, scratch.cache), owner)


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


# -- the host's facts and the launcher forked ahead of time (runner/facts.py, runner/zygote.py)


def probe(names: Sequence[str]) -> list[HostMechanism]:
    """Probe these mechanisms on this host (confine/probe.py; a child for each namespace)."""
    from egressbox.confine.probe import probe_mechanisms

    return list(probe_mechanisms(tuple(names)))


def compile_seccomp(*, allow_udp: bool) -> bytes:
    """The command's seccomp filter as a BPF program (b"": the launcher builds it itself)."""
    from egressbox.confine.seccomp import SeccompOptions, Status, compile_filter

    compiled = compile_filter(SeccompOptions(allow_udp=allow_udp))
    return compiled.program if compiled.status is Status.FULL else b""


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (a launcher forked ahead of time)."""
    from egressbox.confine import syscalls

    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)


def preload_launcher() -> None:
    """What the launcher imports first (confine/launcher.py _preload), now; a library that
    fails to load is found again, and reported, by the launcher."""
    import resource

    from egressbox.confine import caps, capture, landlock, landlock_apply, launcher, world

    del resource, caps, landlock, landlock_apply, launcher, world
    with contextlib.suppress(capture.CaptureError):
        capture.load_library()


def walk_etc_early() -> None:
    """The launcher's walk of /etc (the entries only their owner may read), done ahead."""
    launcher.walk_etc_early()


def become_launcher(plan: LaunchPlan, chan_fd: int) -> NoReturn:
    """This process becomes the launcher of `plan` (its channel to the parent: `chan_fd`)."""
    launcher_main(plan, chan_fd)


# -- judging a failed run (runner/supervise.py): what its plan meant for paths ----------------


def refusal_view(
    launcher: LaunchPlan,
    *,
    homes: tuple[str, ...],
    caches: tuple[CacheRoot, ...],
    cache_mode: CacheMode,
    read_only_workspaces: tuple[str, ...],
) -> PathPlan:
    """The filesystem side of the plan the launcher applied, for judging refusals (reads the
    host: /etc's entries the view covers, the grants' real paths; only after a failed run)."""
    from egressbox.confine.refusal import PathPlan

    mounts = launcher.has(Mechanism.MOUNT_NAMESPACE)
    landlock = launcher.has(Mechanism.LANDLOCK_FS)
    kernel: tuple[str, ...] = ()
    if mounts and launcher.uid == 0:
        from egressbox.confine.world import KERNEL_READ_ONLY

        kernel = KERNEL_READ_ONLY
    deny = launcher.deny if landlock else ()
    return PathPlan(
        homes=homes,
        read=launcher.read,
        write=launcher.write,
        # Masks and nested read-only roots are mounts, or (without a mount
        # namespace) Landlock grants that leave them out.
        deny=(*launcher.deny, *_etc_hidden()) if mounts else deny,
        read_only=launcher.read_only_inside_write if mounts or landlock else (),
        always_read_only=kernel,
        # The constructed root: nothing of the host exists but the grants.
        hidden=("/",) if mounts else (),
        bound_back=_visible(launcher) if mounts else (),
        landlock_fs=landlock,
        abstract_isolated=launcher.has(Mechanism.NETWORK_NAMESPACE)
        or launcher.has(Mechanism.LANDLOCK_SCOPE),
        caches=caches,
        cache_mode=cache_mode,
        cwd=launcher.cwd,
        read_only_workspaces=read_only_workspaces,
        seccomp=launcher.has(Mechanism.SECCOMP),
    )


def _etc_hidden() -> list[str]:
    """The /etc entries the child's view covers (walked again only when a run failed)."""
    from egressbox.confine.world import unreadable_to_others

    return unreadable_to_others("/etc")


def _visible(launcher: LaunchPlan) -> tuple[tuple[str, bool], ...]:
    """What exists in the child's view, and whether it may be written there."""
    from egressbox.confine.world import CONSTRUCTED

    # The private /tmp, /var/tmp and /run are not the host's: a host path there is absent.
    grants = launcher.world.grants if launcher.world is not None else ()
    made = tuple((p, p not in ("/proc", "/sys")) for p in CONSTRUCTED)
    return (*made, *((os.path.realpath(p), w) for p, w in grants))


def judge_output(
    text: str, view: PathPlan, lookup: Callable[[str], HostPath], proxy: str = ""
) -> RefusalRecord | None:
    """Which boundary the command's error output shows refused it (confine/refusal.py): a
    path refused outside the grants, a namespace refused by the seccomp filter, or (`proxy`:
    a private network namespace, where the proxy is all there is) a connection made without
    the proxy; None when it shows none."""
    from egressbox.confine.refusal import classify_direct, classify_namespace, classify_output

    found = classify_output(text, view, lookup) or classify_namespace(text, view)
    if found is None and proxy:
        found = classify_direct(text, proxy)
    return found


def seccomp_refusal(
    kernel_log: Sequence[str], *, since: float, uid: int, name: Callable[[SeccompKill], str]
) -> RefusalRecord:
    """The record of a command killed by SIGSYS, naming the call from the kernel's audit
    record of the kill when `kernel_log` holds one."""
    from egressbox.confine.refusal import seccomp_kills, seccomp_record

    return seccomp_record(seccomp_kills(kernel_log, since=since, uid=uid), name)


def with_requirement(record: RefusalRecord, profile: str) -> RefusalRecord:
    """A refusal record with Harn's `requirement` and `selector_honored` for `profile`."""
    from egressbox.confine import refusal

    return refusal.with_requirement(record, profile)
