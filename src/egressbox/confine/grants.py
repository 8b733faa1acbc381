"""The pure confinement plan: profile, roots and host support in, what to enforce out.

No system calls here (reading directories for root expansion is the only
I/O, in `expand_excluding`). The launcher applies a plan; `doctor` and
`run --report` show one. A profile that requires a mechanism the host lacks
yields a Refusal that names the mechanism, its availability, the profile and
what would admit it, so `run` can fail closed (exit 126).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NamedTuple


class Profile(StrEnum):
    """Ordered from least to most confined; nesting picks the strictest.

    Harn's ladder under Harn's names, none meaning something else. egressbox's network boundary
    (the proxy decides every connection) holds under every profile; the ladder sets how the
    command's files and processes are confined:
    - unrestricted: no filesystem rules (said on stderr at every run);
    - worktree (the default): the constructed world, Landlock, seccomp and namespaces, best
      effort; EGRESSBOX_SANDBOX=off|warn|enforce picks what a missing mechanism means, and
      `off` drops the filesystem rules as unrestricted does;
    - os_hardened: every mechanism required; a missing one refuses the run.
    Harn's `workspace_paths` means a command whose own file access is unconfined, guarded only
    by checks in Harn's process, which egressbox does not have: the name was egressbox's
    default once and stays a deprecated alias of worktree (it warns), so that a policy written
    for the old default never loses confinement. Harn's `wasi` (its testbench, which never
    spawns on the host) has no counterpart.
    """

    UNRESTRICTED = "unrestricted"
    WORKTREE = "worktree"
    OS_HARDENED = "os_hardened"

    @classmethod
    def _missing_(cls, value: object) -> Profile | None:
        return DEPRECATED_PROFILES.get(str(value))

    @property
    def rank(self) -> int:
        return list(Profile).index(self)


# Old names still read (flags, policy files, an outer run's EGRESSBOX_PROFILE): name -> profile.
DEPRECATED_PROFILES: dict[str, Profile] = {"workspace_paths": Profile.WORKTREE}
DEFAULT_PROFILE = Profile.WORKTREE
# Every name a profile may be given by, current names first.
PROFILE_NAMES = (*(p.value for p in Profile), *DEPRECATED_PROFILES)


def strictest(*profiles: Profile | None) -> Profile:
    given = [p for p in profiles if p is not None]
    return max(given, key=lambda p: p.rank) if given else DEFAULT_PROFILE


def profile_note(name: str, where: str) -> str:
    """The warning for a deprecated profile name, or "" for a current one."""
    if name not in DEPRECATED_PROFILES:
        return ""
    meant = DEPRECATED_PROFILES[name].value
    return (
        f"{where}: profile {name} is a deprecated name of {meant} here (the command stays "
        f"confined); in Harn it means a command whose file access is unconfined, which "
        f"egressbox calls unrestricted: write {meant} or unrestricted"
    )


def parse_profile(name: str) -> Profile:
    """A profile by its name (deprecated names too); Harn's `wasi` says why it is refused."""
    try:
        return Profile(name)
    except ValueError:
        pass
    if name == "wasi":
        raise ValueError(
            "profile wasi is Harn's testbench mode (recorded WASI modules, never a spawn on "
            "the host); egressbox runs real commands: choose worktree or os_hardened"
        )
    raise ValueError(f"unknown profile {name!r}; one of {', '.join(p.value for p in Profile)}")


class Mechanism(StrEnum):
    NETWORK_NAMESPACE = "network_namespace"
    MOUNT_NAMESPACE = "mount_namespace"
    PID_NAMESPACE = "pid_namespace"
    LANDLOCK_FS = "landlock_fs"
    LANDLOCK_NET = "landlock_net"
    LANDLOCK_SCOPE = "landlock_scope"
    SECCOMP = "seccomp"
    CAPABILITIES = "capabilities"


class Enforcement(StrEnum):
    FULL = "full"
    PARTIAL = "partial"
    NONE = "none"


# What each profile wants. `required`: missing -> refuse (exit 126).
# `wanted`: applied when the host has it, reported honestly when not.
# The network boundary alone: what every profile keeps, and all that unrestricted (or worktree
# under EGRESSBOX_SANDBOX=off) applies.
NETWORK_ONLY = frozenset({Mechanism.NETWORK_NAMESPACE, Mechanism.LANDLOCK_NET, Mechanism.SECCOMP})
_WANTED: dict[Profile, frozenset[Mechanism]] = {
    Profile.UNRESTRICTED: NETWORK_ONLY,
    Profile.WORKTREE: frozenset(Mechanism),
    Profile.OS_HARDENED: frozenset(Mechanism),
}
_REQUIRED: dict[Profile, frozenset[Mechanism]] = {
    Profile.UNRESTRICTED: frozenset(),
    Profile.WORKTREE: frozenset(),
    Profile.OS_HARDENED: frozenset(Mechanism),
}
# Which host capability (confine.probe mechanism name) each one needs.
HOST_NEEDS: dict[Mechanism, str] = {
    Mechanism.NETWORK_NAMESPACE: "network_namespace",
    Mechanism.MOUNT_NAMESPACE: "mount_namespace",
    Mechanism.PID_NAMESPACE: "pid_namespace",
    Mechanism.LANDLOCK_FS: "landlock",
    Mechanism.LANDLOCK_NET: "landlock",
    Mechanism.LANDLOCK_SCOPE: "landlock",
    Mechanism.SECCOMP: "seccomp",
    Mechanism.CAPABILITIES: "no_new_privs",
}
_MIN_ABI = {Mechanism.LANDLOCK_FS: 1, Mechanism.LANDLOCK_NET: 4, Mechanism.LANDLOCK_SCOPE: 6}
ADMIT_HINT: dict[Mechanism, str] = {
    Mechanism.NETWORK_NAMESPACE: "run as root or allow unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0)",
    Mechanism.MOUNT_NAMESPACE: "run as root or allow unprivileged user namespaces",
    Mechanism.PID_NAMESPACE: "run as root or allow unprivileged user namespaces",
    Mechanism.LANDLOCK_FS: "boot a kernel >= 5.13 with lsm=...,landlock",
    Mechanism.LANDLOCK_NET: "a kernel >= 6.7 (Landlock ABI 4) with Landlock enabled",
    Mechanism.LANDLOCK_SCOPE: "a kernel >= 6.12 (Landlock ABI 6) with Landlock enabled",
    Mechanism.SECCOMP: "a kernel with CONFIG_SECCOMP_FILTER and libseccomp2 installed",
    Mechanism.CAPABILITIES: "a kernel with prctl(PR_SET_NO_NEW_PRIVS)",
}


class HostFacts(NamedTuple):
    """What the host supports (from confine.probe), reduced to what planning needs."""

    available: frozenset[str]  # probe mechanism names whose status is "available"
    status: Mapping[str, str] = MappingProxyType({})  # name -> availability text
    landlock_abi: int = 0
    euid: int = 0


def host_has(facts: HostFacts, mechanism: Mechanism) -> bool:
    if HOST_NEEDS[mechanism] not in facts.available:
        return False
    return facts.landlock_abi >= _MIN_ABI.get(mechanism, 0)


# Which requirement a refusal enforces (Harn's `requirement`): the profile's own (os_hardened
# requires every mechanism; every profile requires a network boundary), or the fallback
# selector's (EGRESSBOX_SANDBOX=enforce made a best-effort profile's gap a refusal).
REQUIREMENT_PROFILE = "profile"
REQUIREMENT_FALLBACK = "fallback"


class Refusal(NamedTuple):
    """A profile's required mechanism is missing: run must not start the command.

    `selector_honored` is False when the profile requires the mechanism outright, so no
    EGRESSBOX_SANDBOX value could lift the refusal (Harn's field of the same name).
    """

    mechanism: Mechanism
    availability: str  # as the probe says: absent_on_host | cannot_attach
    profile: Profile
    admit: str  # the remedy, kept apart from the facts (Harn's message states facts only)
    requirement: str = REQUIREMENT_PROFILE
    selector_honored: bool = False

    @property
    def source(self) -> str:
        return MECHANISM_SOURCE

    @property
    def harn_mechanism(self) -> str:
        """Harn's `mechanism` value: linux_landlock for every Landlock part."""
        return HARN_MECHANISM.get(self.mechanism, f"linux_{self.mechanism.value}")

    @property
    def harn_availability(self) -> str:
        """Harn's `availability` value: absent_on_host or entry_point_cannot_attach."""
        return HARN_AVAILABILITY.get(self.availability, self.availability)

    def fields(self) -> dict[str, Any]:
        """The refusal as Harn's tool_rejected dict: `source`, the `sandbox_mechanism` facts
        under Harn's names, and the remedy in a field of its own."""
        return {
            "source": self.source,
            "sandbox_mechanism": {
                "mechanism": self.harn_mechanism,
                "egressbox_mechanism": self.mechanism.value,
                "availability": self.harn_availability,
                "profile": self.profile.value,
                "requirement": self.requirement,
                "selector_honored": self.selector_honored,
            },
            "remedy": self.remedy(),
        }

    def message(self) -> str:
        """The facts, and nothing else."""
        if self.requirement == REQUIREMENT_FALLBACK:
            why = "EGRESSBOX_SANDBOX=enforce made the missing mechanism a refusal"
        else:
            why = "the profile requires it; EGRESSBOX_SANDBOX cannot lift that"
        return (
            f"refused: profile {self.profile.value} requires {self.mechanism.value} "
            f"({self.harn_mechanism}), which is {self.harn_availability} here ({why})"
        )

    def remedy(self) -> str:
        """What would admit it, apart from the facts."""
        other = " (or EGRESSBOX_SANDBOX=warn runs without it)" if self.selector_honored else ""
        return f"to admit {self.mechanism.value}: {self.admit}{other}"


# Harn's `source` of a mechanism refusal, and its names for our mechanisms and availabilities
# (its page, "Reading a mechanism refusal"): Landlock is linux_landlock; a mechanism Harn has no
# name for keeps ours behind linux_.
MECHANISM_SOURCE = "sandbox_mechanism"
HARN_MECHANISM: dict[Mechanism, str] = {
    Mechanism.LANDLOCK_FS: "linux_landlock",
    Mechanism.LANDLOCK_NET: "linux_landlock",
    Mechanism.LANDLOCK_SCOPE: "linux_landlock",
}
HARN_AVAILABILITY = {"cannot_attach": "entry_point_cannot_attach"}


def choose_mechanisms(
    profile: Profile, facts: HostFacts
) -> tuple[frozenset[Mechanism], list[Refusal]]:
    """The mechanisms to apply, and refusals for required ones that are missing."""
    chosen = frozenset(m for m in _WANTED[profile] if host_has(facts, m))
    refusals = [
        Refusal(m, _availability(facts, m), profile, ADMIT_HINT[m])
        for m in sorted(_REQUIRED[profile] - chosen)
    ]
    return chosen, refusals


def _availability(facts: HostFacts, mechanism: Mechanism) -> str:
    status = facts.status.get(HOST_NEEDS[mechanism], "absent_on_host")
    if status == "available":  # present, but the Landlock ABI is too old
        return "absent_on_host"
    return status


def wanted(profile: Profile) -> frozenset[Mechanism]:
    return _WANTED[profile]


# -- filesystem ----------------------------------------------------------------------

# Read (and execute) for every confined program: the system's runtime.
# /nix/store: Nix and NixOS keep every program and library there (Harn's system_read_roots
# list it too); a host without it simply has no such grant.
SYSTEM_RUNTIME = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/opt",
    "/nix/store",
)
# /proc and /sys are made fresh for the child; /var/lib and /var/cache are not granted (they
# hold services' state, much of it readable only by root, and a root child is root).
SYSTEM_READ_ONLY_EXTRA = ("/proc", "/sys", "/snap")
# Written by nearly every program: the null device and terminals.
DEVICE_WRITE = ("/dev",)
# Per-user toolchains often installed under the home directory (pyenv, rustup...).
DEVELOPER_TOOLCHAINS = (
    "~/.pyenv",
    "~/.local/bin",
    "~/.local/lib",
    "~/.local/share/uv",
    "~/.cargo",
    "~/.rustup",
    "~/.nvm",
    "~/.volta",
    "~/.bun",
    "~/.deno",
    "~/go",
    "~/.sdkman",
    "~/.rbenv",
    "/usr/local/go",
)
# The tools' configuration: granted as clean copies, credentials removed (confine/clean.py),
# wherever the child would see them (under ~/.cargo, a toolchain, too); never the originals.
PACKAGE_MANAGER_CONFIG = (
    "~/.config/pip",
    "~/.pip",
    "~/.config/uv",
    "~/.gitconfig",
    "~/.config/git",
    "~/.cargo/config.toml",
    "~/.cargo/config",
    "~/.condarc",
    "~/.config/conda",
    "~/.conda/.condarc",
    "~/.conda/condarc",
)
USER_TEMP = ("/tmp", "/var/tmp")
# Never readable, whatever is granted: credentials.
CREDENTIALS = (
    "~/.ssh",
    "~/.aws",
    "~/.azure",
    "~/.config/gcloud",
    "~/.config/gh",
    "~/.config/hub",
    "~/.config/glab-cli",
    "~/.netrc",
    "~/.git-credentials",
    "~/.config/git/credentials",
    "~/.docker/config.json",
    "~/.docker/run",
    "~/.kube",
    "~/.gnupg",
    "~/.password-store",
    "~/.local/share/keyrings",
    "~/.pypirc",
    "~/.config/pypoetry/auth.toml",
    "~/.local/share/uv/credentials",
    "~/.config/uv/credentials",
    "~/.cargo/credentials",
    "~/.cargo/credentials.toml",
    "~/.npmrc",
    "~/.yarnrc",
    "~/.yarnrc.yml",
    "~/.config/pnpm/rc",
    "~/.gem/credentials",
    "~/.local/share/gem/credentials",
    "~/.config/composer/auth.json",
    "~/.composer/auth.json",
    "~/.terraform.d/credentials.tfrc.json",
    "~/.vault-token",
    "~/.config/op",
    "~/.op",
    "~/.oci",
    "~/.config/doctl",
    "~/.config/heroku",
    "~/.netlify",
    "~/.config/netlify",
    "~/.fly",
    "~/.config/hcloud",
    "~/.s3cfg",
    "~/.boto",
    "~/.m2/settings.xml",
    "~/.gradle/gradle.properties",
    "~/.nuget/NuGet/NuGet.Config",
    "~/.mozilla",
    "~/.config/google-chrome",
    "~/.config/chromium",
    "~/.config/BraveSoftware",
    "~/.config/microsoft-edge",
    "~/.claude.json",
    "~/.claude/.credentials.json",
    "~/.codex/auth.json",
    "~/.config/openai",
    "~/.config/github-copilot",
    "~/.aider.conf.yml",
    "~/.huggingface/token",
    "~/.cache/huggingface/token",
    "~/.config/gcloud-legacy",
    "~/.wrangler",
    "~/.config/.wrangler",
)
PRESETS: dict[str, tuple[str, ...]] = {
    "system_runtime": SYSTEM_RUNTIME,
    "developer_toolchains": DEVELOPER_TOOLCHAINS,
    "package_manager_config": PACKAGE_MANAGER_CONFIG,
    "user_temp": USER_TEMP,
}
DEFAULT_PRESETS = ("system_runtime", "developer_toolchains", "package_manager_config", "user_temp")


# Inside a writable root, files and directories that the host runs or trusts later are
# read-only for the child (a hook runs at the user's next commit, core.fsmonitor and
# core.sshCommand at the next git command, a shell rc at the next login, .envrc at the next
# cd, editor task files when the project is opened).
# Shell start-up files: a login or a new shell runs them (the staged workspace's gate holds
# them back at any depth too: confine/staging.py).
SHELL_STARTUP = (
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".bash_logout",
    ".profile",
    ".zshrc",
    ".zshenv",
    ".zprofile",
    ".zlogin",
)
HOST_TRUSTED = (
    ".git/hooks",
    ".git/config",
    ".envrc",
    ".vscode",
    ".idea",
    "egressbox.toml",
    *SHELL_STARTUP,
    ".config/fish",
)
# Every mechanism the host probe (confine/probe.py) probes, in its report's order; the
# probe cache (runner/facts.py) keeps the same names.
PROBED_MECHANISMS = (
    "landlock",
    "seccomp",
    "no_new_privs",
    "user_namespace",
    "network_namespace",
    "mount_namespace",
    "pid_namespace",
    "close_range",
    "capture",
    "connect_supervisor",
)


def host_trusted(write_roots: Sequence[str], listdir: object = os.listdir) -> tuple[str, ...]:
    """Host-trusted paths in each writable root, the submodules' git hooks and config too."""
    assert callable(listdir)
    found: list[str] = []
    for root in write_roots:
        found += [os.path.join(root, name) for name in HOST_TRUSTED]
        modules = os.path.join(root, ".git", "modules")
        try:
            names = sorted(listdir(modules))
        except OSError:
            continue
        for name in names:
            found += [os.path.join(modules, name, "hooks"), os.path.join(modules, name, "config")]
    return tuple(dict.fromkeys(found))


def expand_user(path: str, home: str) -> str:
    if path == "~" or path.startswith("~/"):
        return home + path[1:]
    return path


def is_under(path: str, root: str) -> bool:
    """`path` is `root` or below it, by name (both normalised, neither resolved): the one
    prefix test of confinement and the runner (a root "/a" holds "/a/b", never "/ab")."""
    return path == root or path.startswith(root.rstrip("/") + "/")


class FsPlan(NamedTuple):
    """The filesystem grants of a plan, as Landlock and the world apply them."""

    read: tuple[str, ...]  # read + execute
    write: tuple[str, ...]  # read + write + execute (workspace, temp)
    deny: tuple[str, ...]  # credential paths: beat every grant
    read_only_inside_write: tuple[str, ...] = ()  # ro roots nested in rw roots (bind ro)


def plan_filesystem(
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
) -> FsPlan:
    """Roots as absolute paths; credential paths beat grants (see expand_excluding).

    Process roots (tool caches and state) are granted like the other roots;
    what sets them apart (no scratch space, TMPDIR or caches) is decided by
    the caller, which never treats them as workspaces.
    """
    denied = tuple(_norm(expand_user(p, home)) for p in deny)
    read: list[str] = []
    for name in presets:
        if name == "user_temp":
            continue
        read += [expand_user(p, home) for p in PRESETS[name]]
    read += list(SYSTEM_READ_ONLY_EXTRA) + list(read_roots) + list(process_read_roots)
    read += list(executables)
    writable = (*write_roots, *process_write_roots)
    write = [_norm(p) for p in writable]
    if "user_temp" in presets:
        write += list(USER_TEMP)
    write += list(DEVICE_WRITE)
    nested = tuple(
        p
        for p in (*read_roots, *process_read_roots, *protected_files)
        if any(is_under(p, w) for w in writable)
    )
    return FsPlan(
        read=_dedupe(_norm(p) for p in read),
        write=_dedupe(write),
        deny=denied,
        read_only_inside_write=_dedupe(_norm(p) for p in nested),
    )


def _norm(path: str) -> str:
    return os.path.normpath(path) if path else path


def _dedupe(paths: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(paths))


def expand_excluding(
    root: str,
    denied: Sequence[str],
    listdir: object = os.listdir,
    is_link: object = os.path.islink,
) -> list[str]:
    """Grant `root` minus denied paths: Landlock is allow-only, so grant siblings.

    `root` is replaced by its children, recursively along each denied path,
    so that everything but the denied paths stays granted. A child that is a
    symlink is left out: a rule on it would grant its target, which may be
    the denied path or a directory above it (a `current -> run-42` link next
    to `run-42`); its target keeps whatever the other rules grant it.
    """
    inside = [d for d in denied if is_under(d, root)]
    if not inside:
        return [root]
    if root in inside:
        return []
    assert callable(listdir) and callable(is_link)
    try:
        names = sorted(listdir(root))
    except OSError:
        return []
    granted: list[str] = []
    for name in names:
        child = os.path.join(root, name)
        if not is_link(child):
            granted += expand_excluding(child, inside, listdir, is_link)
    return granted


# -- the child's world (applied by confine/world.py) --------------------------------------

# Private tmpfs sizes: /tmp and /var/tmp get what a build's temporary files need without
# letting one run fill the host's memory (tmpfs pages are memory).
DEFAULT_TMP_SIZE = "2g"
DEFAULT_SHM_SIZE = "256m"
_MIB = 1 << 20
DEFAULT_TMP_BYTES = 2048 * _MIB
DEFAULT_SHM_BYTES = 256 * _MIB
# The world's own fixed-size tmpfs (confine/world.py ROOT_SIZE 4m, RUN_SIZE 16m, DEV_SIZE
# 64k): part of every run's file systems, whatever the budget.
FIXED_TMPFS_BYTES = 4 * _MIB + 16 * _MIB + 64 * 1024
# The smallest /tmp and /dev/shm worth mounting; policy.MIN_MAX_MEMORY (64 MiB) leaves room
# for both above the fixed part.
MIN_TMP_BYTES = 4 * _MIB
MIN_SHM_BYTES = 1 * _MIB


def tmpfs_sizes(budget: int | None) -> tuple[int, int]:
    """/tmp's (and /var/tmp's) and /dev/shm's sizes in bytes, so that the run's private file
    systems together (/tmp, /var/tmp, /dev/shm, /run, the root and /dev) stay within
    `budget`: the defaults when they fit, scaled down in proportion when they do not."""
    if budget is None:
        return DEFAULT_TMP_BYTES, DEFAULT_SHM_BYTES
    room = budget - FIXED_TMPFS_BYTES
    wanted = 2 * DEFAULT_TMP_BYTES + DEFAULT_SHM_BYTES
    if room >= wanted:
        return DEFAULT_TMP_BYTES, DEFAULT_SHM_BYTES
    tmp = max(room * DEFAULT_TMP_BYTES // wanted, MIN_TMP_BYTES)
    shm = max(room - 2 * tmp, MIN_SHM_BYTES)
    return tmp, shm


def tmpfs_total(tmp: int, shm: int) -> int:
    """What the run's private file systems may hold at most, together."""
    return 2 * tmp + shm + FIXED_TMPFS_BYTES


# With capture (confine/capture.py) the child's resolver asks egressbox's DNS address inside
# its namespace, and its hosts file names nothing but localhost, so every other name is asked
# there. Bound read-only over the host's files in the child's view.
CAPTURE_DNS_HOST = "127.0.0.53"
CAPTURE_RESOLV_CONF = f"""# egressbox: names are answered inside this sandbox
nameserver {CAPTURE_DNS_HOST}
options edns0
"""
CAPTURE_HOSTS = """127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
"""
CAPTURE_FILES = (("/etc/resolv.conf", CAPTURE_RESOLV_CONF), ("/etc/hosts", CAPTURE_HOSTS))


class WorldSpec(NamedTuple):
    """What exists for the child. Every path must be absolute."""

    # (path, writable): system runtime, presets, roots, the command's executable and venv.
    grants: tuple[tuple[str, bool], ...]
    # Inside writable grants, bound read-only onto themselves (host-trusted files).
    read_only: tuple[str, ...] = ()
    # Inside grants, covered by an empty placeholder (credential stores).
    mask: tuple[str, ...] = ()
    # Directories whose unix sockets the child may connect to, bound read-only...
    socket_roots: tuple[str, ...] = ()
    # ...except these, bound read-write, where Landlock admits making a socket (bind) and no
    # other write.
    socket_bind: tuple[str, ...] = ()
    # Made (with a self-ignoring .gitignore in the first one's parent) inside the view.
    scratch: tuple[str, ...] = ()
    cwd: str = "/"
    new_proc: bool = True
    protect_kernel: bool = True
    max_processes: int | None = None
    tmp_size: str = DEFAULT_TMP_SIZE
    shm_size: str = DEFAULT_SHM_SIZE
    # (path, text): files that hold exactly this text in the view, read-only, whatever the
    # host has there (a symlink on the host, /etc/resolv.conf -> ../run/..., is followed
    # inside the view and its target made). CAPTURE_FILES with capture.
    files: tuple[tuple[str, str], ...] = ()


# -- unix sockets ---------------------------------------------------------------------------

# connect(2) to a pathname socket needs only search rights on the way and write permission on
# the socket's inode; a read-only bind mount does not refuse it (measured: a read-only bind
# of a directory refuses bind() with EROFS and admits connect()). Landlock up to ABI 7 has no
# right for it either. So the world covers each live socket under a grant that is not a
# socket root with an empty placeholder (measured: connect then fails, ECONNREFUSED, and the
# listener never sees it). Live sockets are the host's bound ones, /proc/net/unix's paths.
PROC_NET_UNIX = "/proc/net/unix"
# Its columns: Num RefCount Protocol Flags Type St Inode Path (Path absent: unbound).
_UNIX_PATH_COLUMN = 7


def bound_socket_paths(table: str) -> tuple[str, ...]:
    """Absolute paths of the pathname sockets in a /proc/net/unix text (abstract ones, whose
    names start with @, and paths bound relative to another process's directory are not)."""
    found: list[str] = []
    for line in table.splitlines()[1:]:
        fields = line.split(None, _UNIX_PATH_COLUMN)
        if len(fields) > _UNIX_PATH_COLUMN and fields[_UNIX_PATH_COLUMN].startswith("/"):
            found.append(fields[_UNIX_PATH_COLUMN])
    return _dedupe(found)


def socket_bind_roots(
    socket_roots: Iterable[str], write: Iterable[str], host_write: Iterable[str]
) -> tuple[str, ...]:
    """The socket roots that may be bound read-write: Landlock is additive, so one inside a
    broader write grant that is not the host's (the private /tmp, /var/tmp, /dev) would become
    writable through that grant; it stays read-only (connect only). One inside a host write
    root is writable anyway."""
    broad = [w for w in write if w not in set(host_write)]
    return tuple(r for r in socket_roots if not any(is_under(r, w) for w in broad))


def sockets_to_hide(
    sockets: Iterable[str], granted: Iterable[str], socket_roots: Iterable[str]
) -> tuple[str, ...]:
    """The live sockets the child would otherwise reach: under a grant, not under a socket
    root (only socket roots admit connecting to what is already there)."""
    grants, allowed = tuple(granted), tuple(socket_roots)
    return tuple(
        path
        for path in sockets
        if any(is_under(path, g) for g in grants) and not any(is_under(path, r) for r in allowed)
    )
