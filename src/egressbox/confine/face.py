"""Confinement's one face: plan(request, facts) -> Plan, pure, and launch(plan) -> Launched.

`plan` decides the child's world and what the launcher applies from a Request that holds
what was read of the host already (the live unix sockets to cover, the memory budget and its
cgroup, the ids, the directory): it reads and changes nothing. `launch` forks the launcher
(confine/launcher.py) with the plan and returns its pid, the channel to it and the pipe its
report of what it applied arrives on.

Before the Request, the caller asks the face's other pure planning steps: `choose` (the
profile's mechanisms on this host, and its refusals) and `filesystem` (the grants, narrowed to
what holds without a mount namespace). What reads the host for a Request (`live_sockets`,
`clean_copies`, `probe_cgroup`, `connects_off`) and the set-up with I/O a plan needs before
the fork (the scratch space, the proxy's listeners on the host's loopback without a network
namespace) are here too, named as such, never inside `plan`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from egressbox.confine import netns
from egressbox.confine.env import Scratch
from egressbox.confine.grants import (
    ADMIT_HINT,
    CAPTURE_FILES,
    CREDENTIALS,
    DEFAULT_PRESETS,
    HOST_NEEDS,
    PACKAGE_MANAGER_CONFIG,
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
    host_has,
    is_under,
    plan_filesystem,
    socket_bind_roots,
    sockets_to_hide,
    tmpfs_sizes,
    wanted,
)
from egressbox.confine.launcher import LaunchPlan, give_directories
from egressbox.core.errors import EgressboxError

if TYPE_CHECKING:
    from egressbox.confine.cgroup import CgroupPlan
    from egressbox.confine.staging import StagingSpec

Plan = LaunchPlan


class Request(NamedTuple):
    """What a confined command is to get, with what was read of the host for it."""

    argv: tuple[str, ...]
    executable: str  # the command resolved on the child's PATH
    cwd: str  # real path
    env: dict[str, str]
    env_ports: Mapping[str, str]  # NAME -> template with {http}/{socks}
    mechanisms: frozenset[Mechanism]  # chosen for the profile on this host
    profile: Profile
    fs: FsPlan
    workspaces: tuple[str, ...]  # the writable workspace roots
    process_write: tuple[str, ...]  # the tools' writable roots
    socket_roots: tuple[str, ...]
    read_only_scratch: str  # a read-only workspace's scratch ("": a writable workspace)
    scratch: Scratch | None
    # The host's live unix sockets under a grant and not under a socket root (what the world
    # covers): read by the caller, from the grants granted_paths() gives.
    hidden_sockets: tuple[str, ...]
    allow_loopback: bool
    pass_fds: tuple[int, ...]
    rlimit_nofile: int | None
    rlimit_as: int | None
    max_processes: int | None
    memory: int | None  # the run's memory budget in bytes (None: unknown)
    cgroup: CgroupPlan | None
    cgroup_off: str
    host_ports: tuple[int, ...]  # without a namespace: the proxy's listeners on the host
    uid: int
    gid: int
    parent_pid: int
    capture: bool
    copies: tuple[tuple[str, str], ...] = ()  # files the view holds: (path, contents)
    # The staged workspace's overlays (confine/staging.py), and the host-trusted paths its
    # gate holds back at the run's end (not bound read-only then: the command may write
    # them in its layer, and what it wrote is named, not applied). None: direct.
    staged: StagingSpec | None = None
    trusted: tuple[str, ...] = ()
    seccomp_program: bytes = b""  # compiled (and cached) by the caller; b"": no seccomp
    # No network namespace: the connect supervisor's filter (connect_filter()): the child's
    # connects are held and the supervisor connects them itself. b"": none.
    connect_filter: bytes = b""
    run_as: tuple[int, int, tuple[int, ...]] | None = None  # --user NAME's ids


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
    """What the launcher applies: the child's world and its walls (pure). A mechanism the
    host lacks (facts) is never planned."""
    r = request
    chosen = frozenset(m for m in r.mechanisms if host_has(facts, m))
    mounts = Mechanism.MOUNT_NAMESPACE in chosen
    readable, writable = granted_paths(r.fs, r.workspaces, r.process_write, r.socket_roots)
    # Only socket roots admit a socket: a bind there (read-write bind, Landlock admitting the
    # making of a socket and no other write) and a connect; a live socket under any other
    # grant is covered (grants.py sockets_to_hide). Without Landlock's filesystem rules a
    # read-write bind would make the socket root writable: it stays read-only (connect only).
    landlock = Mechanism.LANDLOCK_FS in chosen
    socket_bind = socket_bind_roots(r.socket_roots, r.fs.write, writable) if landlock else ()
    # The private file systems together fit in the run's memory budget.
    tmp_size, shm_size = tmpfs_sizes(r.memory)
    # Staged: host-trusted names are held back by the gate, not bound read-only; read-only
    # roots nested in writable ones stay read-only binds.
    held = set(r.trusted) if r.staged is not None else set()
    world = WorldSpec(
        grants=(*((p, False) for p in readable), *((p, True) for p in writable)),
        read_only=tuple(p for p in r.fs.read_only_inside_write if p not in held),
        mask=(*r.fs.deny, *(r.hidden_sockets if mounts else ())),
        socket_roots=r.socket_roots,
        socket_bind=socket_bind if mounts else (),
        scratch=(r.scratch.tmp, r.scratch.cache) if r.scratch is not None and mounts else (),
        cwd=r.cwd,
        protect_kernel=r.uid == 0,
        max_processes=r.max_processes,
        tmp_size=str(tmp_size),
        shm_size=str(shm_size),
        # Captured: the child's resolver asks egressbox's DNS inside the namespace.
        # and the tools' configuration files as clean copies (confine/clean.py).
        files=(*(CAPTURE_FILES if r.capture else ()), *r.copies),
    )
    # The read-only workspace's scratch is in the view's private /tmp: Landlock must let the
    # command write there whatever the presets say (it is never bound from the host).
    scratch = (r.read_only_scratch,) if r.read_only_scratch and mounts else ()
    return LaunchPlan(
        argv=r.argv,
        executable=r.executable,
        cwd=world.cwd,
        env=r.env,
        mechanisms=tuple(sorted(m.value for m in chosen)),
        uid=r.uid,
        gid=r.gid,
        host_ports=r.host_ports,
        read=(*r.fs.read, *r.socket_roots),
        write=(*r.fs.write, *scratch),
        deny=r.fs.deny,
        read_only_inside_write=r.fs.read_only_inside_write,
        sockets=socket_bind,
        allow_loopback=r.allow_loopback,
        pass_fds=r.pass_fds,
        rlimit_nofile=r.rlimit_nofile,
        rlimit_as=r.rlimit_as,
        rlimit_nproc=r.max_processes,
        rlimit_data=r.memory,
        cgroup=r.cgroup,
        cgroup_off=r.cgroup_off,
        best_effort=r.profile is not Profile.OS_HARDENED,
        env_ports=r.env_ports,
        parent_pid=r.parent_pid,
        world=world if mounts else None,
        # Supervised, the connect filter sends every connect to the supervisor, which
        # connects it to the proxy or the capture listener: no capture in the launcher.
        capture=r.capture and not r.connect_filter,
        seccomp_program=r.seccomp_program if Mechanism.SECCOMP in chosen else b"",
        connect_filter=r.connect_filter,
        staged=r.staged if r.staged is not None and mounts else None,
        run_as=r.run_as,
    )


class Launched(NamedTuple):
    """A launcher forked with its plan (runner/spawn.py's Launched is built from it)."""

    pid: int
    chan: socket.socket  # to the launcher: its listeners and its word come over it
    report_fd: int  # what it applied arrives here just before the command's exec


# A launcher forked ahead of time (runner/zygote.py): given the plan, the launcher's end of
# the channel and the descriptors to dup2, its pid; None when there is none (fork then).
Forker = Callable[[Plan, socket.socket, dict[int, int]], "int | None"]


def launch(
    plan: Plan,
    *,
    child_fds: Mapping[int, int] | None = None,
    in_child: Callable[[], None] | None = None,
    forker: Forker | None = None,
) -> Launched:
    """Fork the launcher with `plan`: `child_fds` are dup2()ed onto its std fds (target:
    source), then `in_child` runs in it. On failure nothing of the launch stays open."""
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


def _launcher(  # noqa: PLR0917 (the launch's own ends, in the child)
    plan: Plan,
    parent_chan: socket.socket,
    child_chan: socket.socket,
    report_r: int,
    fds: Mapping[int, int],
    in_child: Callable[[], None] | None,
) -> NoReturn:
    from egressbox.confine.launcher import launcher_main

    parent_chan.close()
    os.close(report_r)
    for target, source in fds.items():
        os.dup2(source, target)
    if in_child is not None:
        in_child()
    launcher_main(plan, child_chan.detach())


# -- planning before the Request (pure) -----------------------------------------------------


class Choice(NamedTuple):
    """The mechanisms a profile gets on this host (`choose`)."""

    chosen: frozenset[Mechanism]
    # Required mechanisms the host lacks: the command must not start (exit 126).
    refusals: list[Refusal]
    # What a best-effort profile runs without (said, not refused): worktree's gaps.
    gaps: tuple[Mechanism, ...]
    lacking: frozenset[Mechanism]  # everything the profile wants and the host lacks


def choose(profile: Profile, facts: HostFacts, *, files_off: bool, enforce: bool) -> Choice:
    """The mechanisms this host gives `profile`, and its refusals.

    `files_off` (profile unrestricted, or worktree under EGRESSBOX_SANDBOX=off): the network
    boundary alone. worktree is best effort: a missing mechanism is a gap, or a refusal when
    `enforce` (EGRESSBOX_SANDBOX=enforce) says so; os_hardened requires every mechanism."""
    chosen, refusals = choose_mechanisms(Profile.UNRESTRICTED if files_off else profile, facts)
    lacking = wanted(profile) - chosen
    missing = () if files_off or profile is not Profile.WORKTREE else tuple(sorted(lacking))
    if enforce and missing:
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
    return Choice(chosen, refusals, missing, lacking)


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
    from egressbox.confine.grants import PRESETS

    return tuple(expand_user(p, home) for name in presets for p in PRESETS.get(name, ()))


def filesystem(
    *,
    home: str,
    write_roots: Sequence[str],
    read_roots: Sequence[str],
    executables: Sequence[str],
    presets: Sequence[str] = DEFAULT_PRESETS,
    deny: Sequence[str] = CREDENTIALS,
    protected_files: Sequence[str] = (),
    process_read_roots: Sequence[str] = (),
    process_write_roots: Sequence[str] = (),
    mounts: bool = True,
    host_scratch: Sequence[str] = (),
) -> FsPlan:
    """The run's filesystem grants (grants.py plan_filesystem), as they can hold on this host:
    without a mount namespace (`mounts` False) see host_view."""
    fs = plan_filesystem(
        home=home,
        write_roots=write_roots,
        read_roots=read_roots,
        executables=executables,
        presets=presets,
        deny=deny,
        protected_files=protected_files,
        process_read_roots=process_read_roots,
        process_write_roots=process_write_roots,
    )
    return fs if mounts else host_view(fs, protected_files, host_scratch)


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


# -- reading the host for a Request -----------------------------------------------------------


def live_sockets(granted: Sequence[str], socket_roots: Sequence[str]) -> tuple[str, ...]:
    """The host's bound unix sockets under a grant but not under a socket root, as real paths
    (what the world covers); /proc/net/unix lists the sockets of this network namespace."""
    try:
        with open(PROC_NET_UNIX, encoding="utf-8", errors="surrogateescape") as f:
            table = f.read()
    except OSError:
        return ()
    found = [os.path.realpath(p) for p in bound_socket_paths(table)]
    live = [p for p in dict.fromkeys(found) if _is_socket(p)]
    grants = {os.path.realpath(p) for p in granted}
    return sockets_to_hide(live, grants, [os.path.realpath(p) for p in socket_roots])


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


class CleanCopies(NamedTuple):
    fs: FsPlan  # the grants with the originals denied (and a copy's include read)
    files: tuple[tuple[str, str], ...]  # (path, contents) the view holds
    warnings: list[str]
    notes: list[str]  # what a copy left out, said like a widened root


def clean_copies(fs: FsPlan, home: str, passed: Sequence[str], mounts: bool) -> CleanCopies:
    """The tools' configuration files in view, as clean copies (confine/clean.py).

    Each copy is bound over its original's path (the launcher refuses to start the command
    when one cannot be); an original with no copy joins the deny list (masked in the world).
    Without a mount namespace nothing can be bound: the originals are left out of Landlock's
    rules, so the files are not granted at all, and said so.
    """
    from egressbox.confine import clean

    presets = (*(expand_user(p, home) for p in PACKAGE_MANAGER_CONFIG), *clean.SYSTEM_TOOL_CONFIG)
    in_view = (*fs.read, *fs.write)
    entries = [p for p in presets if any(is_under(p, r) for r in in_view) and os.path.lexists(p)]
    if not entries:
        return CleanCopies(fs, (), [], [])
    copies = clean.gather(entries, home=home, deny=fs.deny, passed=passed)
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
        return CleanCopies(fs, (), warnings, [])
    # What a copy left out is said like a widened root: before the command, not under --quiet
    # (a credential helper in /etc/gitconfig is common and needs no action).
    notes = [f"granted as a clean copy: {what}" for what in copies.cleaned]
    return CleanCopies(fs, copies.files, warnings, notes)


def probe_cgroup(budget: int | None, max_processes: int | None) -> tuple[CgroupPlan | None, str]:
    """The run's memory budget as a cgroup where the host delegates one, or why not."""
    if budget is None:
        return None, "the host's memory size is unknown"
    from egressbox.confine import cgroup

    return cgroup.probe(budget, max_processes, f"{cgroup.PREFIX}{os.getpid()}")


def connects_off(chosen: frozenset[Mechanism]) -> str:
    """Why this run's connects cannot be supervised without a namespace ("" when they can)."""
    from egressbox.confine import notify

    if Mechanism.SECCOMP not in chosen:
        return "the profile applies no seccomp filter"
    return notify.support()


def connect_filter() -> bytes:
    """The connect supervisor's seccomp filter for this machine (Request.connect_filter)."""
    from egressbox.confine import notify

    return notify.program()


def namespace_blocker() -> str:
    """What blocks namespaces here and the fix, in a line ("" when nothing is found): a test
    unshare in a child and a few /proc reads."""
    from egressbox.confine.probe import namespace_blocker as find

    found = find()
    return found.line() if found is not None else ""


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


# The scratch space (TMPDIR, tool caches) of a run: `tmp` and `cache` in a directory of the
# first writable workspace (made inside the child's view), or made on the host before the fork.


def scratch_paths(root: str, name: str) -> Scratch:
    """The scratch space in directory `name` of `root`."""
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
