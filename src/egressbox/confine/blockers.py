"""What keeps this process from creating namespaces, and the exact change that would lift it.

Pure: the host probe (confine/probe.py ``blocker_facts``) reads the facts; this module turns them
into one cause with its fix, for ``egressbox doctor`` and the one line ``run`` prints when it
falls back to a run without a network namespace. The causes, in the order they are told apart:

- ``max_user_namespaces``: ``user.max_user_namespaces = 0`` (unshare says ENOSPC); likewise
  ``max_net_namespaces``, ``max_mnt_namespaces``... for the other limits, and
  ``namespace_limit`` for one reached that is not 0;
- ``unprivileged_userns_clone``: Debian's ``kernel.unprivileged_userns_clone = 0``;
- ``apparmor_userns``: Ubuntu's ``kernel.apparmor_restrict_unprivileged_userns = 1`` (23.10 and
  later, GitHub's 24.04 runners): unshare succeeds but the new namespace has no capabilities;
- ``nested_sandbox``: this process already runs in a user namespace of another sandbox, without
  capabilities (its uid map is not the identity);
- ``seccomp_profile``: a container's seccomp filter refuses unshare while every sysctl allows it
  (Docker's and containerd's default profiles do this to an unprivileged container);
- ``unknown``: refused for a reason none of these facts explains.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

# Where a package manager or pipx puts the entry point; the shipped profile
# (deploy/apparmor/egressbox) names it, and `egressbox doctor --apparmor-profile` prints one
# naming the entry point actually running.
DEFAULT_ENTRY_POINT = "/usr/local/bin/egressbox"
APPARMOR_FILE = "/etc/apparmor.d/egressbox"
# The uid map of the initial user namespace: every id maps to itself (user_namespaces(7)).
IDENTITY_UID_MAP = ((0, 0, 4294967295),)
# A limit that lets a busy host run many sandboxes (Debian's and Ubuntu's default is the
# kernel's: a fraction of the memory, typically tens of thousands).
SUGGESTED_MAX_USER_NAMESPACES = 15000
CAP_SYS_ADMIN = 21  # <linux/capability.h>
# The namespaces `run` makes, in the order their limits are checked (user only without
# CAP_SYS_ADMIN), each with its sysctl user.max_NAME_namespaces.
LIMITED_NAMESPACES = ("user", "net", "mnt", "pid", "ipc", "uts")


@dataclass(frozen=True)
class NamespaceFacts:
    """What the probe saw; ``None`` for a sysctl file that does not exist on this kernel."""

    euid: int
    # The step of a test unshare (user + network namespace, or network alone as root) that
    # failed, and its errno; empty and 0 when namespaces work.
    failed_step: str
    failed_errno: int
    # /proc/self/status: "Seccomp" (0 none, 1 strict, 2 filter), "Seccomp_filters", "CapEff".
    seccomp_mode: int
    seccomp_filters: int
    cap_eff: int
    # /proc/self/uid_map as (inside, outside, count) triples.
    uid_map: tuple[tuple[int, int, int], ...]
    max_user_namespaces: int | None
    unprivileged_userns_clone: int | None
    apparmor_restrict: int | None
    apparmor_loaded: bool  # /sys/kernel/security/apparmor or /sys/module/apparmor exists
    kubernetes: bool = False  # KUBERNETES_SERVICE_HOST set: the fix is a securityContext
    entry_point: str = DEFAULT_ENTRY_POINT  # the installed egressbox, for the profile
    # The other user.max_*_namespaces sysctls, by namespace (net, mnt, pid, ipc, uts): a 0
    # there refuses that namespace even to a process that may make it (ENOSPC).
    namespace_limits: tuple[tuple[str, int | None], ...] = ()

    @property
    def privileged(self) -> bool:
        """Holds CAP_SYS_ADMIN in its user namespace: makes namespaces without a user one
        (uid 0 alone does not: a container's root often lacks it)."""
        return bool(self.cap_eff & (1 << CAP_SYS_ADMIN))

    @property
    def nested(self) -> bool:
        """Inside a user namespace of someone else's, without capabilities in it."""
        return bool(self.uid_map) and self.uid_map != IDENTITY_UID_MAP and self.cap_eff == 0


@dataclass(frozen=True)
class Blocker:
    """Why namespaces cannot be made here (a stable snake_case cause) and what would lift it."""

    cause: str
    why: str
    fix: str

    def line(self) -> str:
        """One line for `run`: the cause and the fix."""
        return f"no namespaces here: {self.why}; to get them: {self.fix}"


def blocker(facts: NamespaceFacts) -> Blocker | None:
    """The cause that keeps namespaces from this process, or None when they work."""
    if not facts.failed_step and not facts.failed_errno:
        return None
    for cause in (
        _max_user_namespaces,
        _userns_clone,
        _apparmor,
        _nested,
        _seccomp,
    ):
        found = cause(facts)
        if found is not None:
            return found
    return _unknown(facts)


def _max_user_namespaces(facts: NamespaceFacts) -> Blocker | None:
    """A user.max_*_namespaces sysctl at 0 (named: the one that blocks), or a limit reached."""
    limits = dict(facts.namespace_limits) | {"user": facts.max_user_namespaces}
    needed = [n for n in LIMITED_NAMESPACES if n != "user" or not facts.privileged]
    zero = next((n for n in needed if limits.get(n) == 0), None)
    if zero is None and facts.failed_errno != errno.ENOSPC:
        return None
    keep = "(and the same line in /etc/sysctl.d/90-egressbox.conf to keep it)"
    if zero is not None:
        name = f"user.max_{zero}_namespaces"
        why = f"{name} is 0 ({zero} namespaces are disabled)"
        fix = f"sudo sysctl -w {name}={SUGGESTED_MAX_USER_NAMESPACES} {keep}"
        cause = f"max_{zero}_namespaces"
    else:
        names = ", ".join(f"user.max_{n}_namespaces" for n in needed)
        why = f"a namespace limit is reached (one of {names})"
        fix = f"raise the one that is reached: sudo sysctl -w user.max_NAME_namespaces=N {keep}"
        cause = "namespace_limit"
    return Blocker(cause, why, fix + _as_root(facts))


def _userns_clone(facts: NamespaceFacts) -> Blocker | None:
    if facts.unprivileged_userns_clone != 0 or facts.privileged:
        return None
    why = "kernel.unprivileged_userns_clone is 0 (Debian's switch for unprivileged users)"
    fix = (
        "sudo sysctl -w kernel.unprivileged_userns_clone=1 (and the same line in "
        "/etc/sysctl.d/90-egressbox.conf to keep it)"
    )
    return Blocker("unprivileged_userns_clone", why, fix + _as_root(facts))


def _apparmor(facts: NamespaceFacts) -> Blocker | None:
    if facts.apparmor_restrict != 1 or not facts.apparmor_loaded or facts.privileged:
        return None
    why = (
        "AppArmor restricts unprivileged user namespaces "
        "(kernel.apparmor_restrict_unprivileged_userns = 1, Ubuntu 23.10 and later)"
    )
    return Blocker("apparmor_userns", why, apparmor_fix(facts.entry_point) + _as_root(facts))


def apparmor_fix(entry_point: str) -> str:
    """The one-line install of a profile that lets `entry_point` create user namespaces."""
    install = (
        f"sudo install -m644 deploy/apparmor/egressbox /etc/apparmor.d/ && "
        f"sudo apparmor_parser -r {APPARMOR_FILE}"
    )
    if entry_point == DEFAULT_ENTRY_POINT:
        return f"allow egressbox user namespaces with its AppArmor profile: {install}"
    return (
        "allow egressbox user namespaces with an AppArmor profile naming "
        f"{entry_point}: egressbox doctor --apparmor-profile | sudo tee {APPARMOR_FILE} "
        f"&& sudo apparmor_parser -r {APPARMOR_FILE} (deploy/apparmor/egressbox names "
        f"{DEFAULT_ENTRY_POINT})"
    )


def apparmor_profile(entry_point: str) -> str:
    """Ubuntu 24.04's shape for letting one program create user namespaces: unconfined
    otherwise, so nothing else about the program changes."""
    return (
        "# Lets egressbox create user namespaces where Ubuntu restricts them\n"
        "# (kernel.apparmor_restrict_unprivileged_userns = 1). The path must be the installed\n"
        "# entry point, links resolved (egressbox doctor --apparmor-profile prints this file\n"
        "# for the one that runs). Install:\n"
        f"#   sudo install -m644 deploy/apparmor/egressbox /etc/apparmor.d/ && "
        f"sudo apparmor_parser -r {APPARMOR_FILE}\n"
        "abi <abi/4.0>,\n"
        "include <tunables/global>\n"
        "\n"
        f"profile egressbox {entry_point} flags=(unconfined) {{\n"
        "  userns,\n"
        "\n"
        "  # Site-specific additions and overrides.\n"
        "  include if exists <local/egressbox>\n"
        "}\n"
    )


def _nested(facts: NamespaceFacts) -> Blocker | None:
    if not facts.nested:
        return None
    inside, outside, count = facts.uid_map[0]
    why = (
        "this process runs inside another sandbox: a user namespace of its own (uid map "
        f"{inside} {outside} {count}) without capabilities, whose owner does not let it "
        "create namespaces"
    )
    fix = (
        "run egressbox outside that sandbox (it is then the outer one), or have the outer "
        "sandbox allow nested user namespaces"
    )
    return Blocker("nested_sandbox", why, fix)


def _seccomp(facts: NamespaceFacts) -> Blocker | None:
    refused = facts.failed_errno == errno.EPERM and facts.failed_step.startswith("unshare")
    if not (refused and facts.seccomp_mode == 2 and facts.seccomp_filters > 0):
        return None
    why = (
        f"a seccomp filter refuses unshare ({facts.seccomp_filters} filter(s) on this process, "
        "and no sysctl forbids it): a container's seccomp profile"
    )
    if facts.kubernetes:
        fix = (
            "in the pod's securityContext, seccompProfile: {type: Unconfined} (or a "
            "Localhost profile that allows unshare and clone with CLONE_NEWUSER)"
        )
    else:
        fix = (
            "start the container with --security-opt seccomp=unconfined (or a seccomp "
            "profile that allows unshare and clone with CLONE_NEWUSER)"
        )
    return Blocker("seccomp_profile", why, fix)


def _unknown(facts: NamespaceFacts) -> Blocker:
    err = errno.errorcode.get(facts.failed_errno, str(facts.failed_errno))
    step = facts.failed_step or "creating a namespace"
    why = f"{step} failed ({err}) for a reason egressbox cannot see (a security module?)"
    fix = "check the host's security policy (audit log, dmesg)" + _as_root(facts)
    return Blocker("unknown", why, fix)


def _as_root(facts: NamespaceFacts) -> str:
    """Root makes namespaces without a user namespace, whatever AppArmor or the userns
    sysctls say: the way out for an unprivileged user with sudo."""
    if facts.euid == 0:
        return ""
    return "; or start it as root: sudo egressbox run --user $USER -- CMD"
