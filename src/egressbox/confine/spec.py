"""What the launcher applies (`LaunchPlan`), decided before the fork: a value, made by
confine/planning.py `finish`, completed by confine/host.py `set_up`, carried to the launcher
(confine/launcher.py) whole."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from egressbox.confine.cgroup import CgroupPlan
from egressbox.confine.grants import Mechanism, WorldSpec
from egressbox.confine.staging import StagingSpec


class LaunchPlan(NamedTuple):
    """Everything the launcher applies, decided before the fork (runner/assemble.py)."""

    argv: tuple[str, ...]
    executable: str
    cwd: str
    env: dict[str, str]
    mechanisms: tuple[str, ...]  # Mechanism values to apply
    uid: int
    gid: int
    # Without a network namespace the parent binds the listeners on the
    # host's loopback and the ports are known up front.
    host_ports: tuple[int, ...] = ()
    proxy_host: str = "127.0.0.1"
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    read_only_inside_write: tuple[str, ...] = ()
    # Unix socket roots: read, and the making of a socket (bind); nothing else written.
    sockets: tuple[str, ...] = ()
    allow_loopback: bool = False
    pass_fds: tuple[int, ...] = ()
    rlimit_nofile: int | None = None
    rlimit_as: int | None = None
    best_effort: bool = True
    env_ports: Mapping[str, str] = MappingProxyType({})  # NAME -> template with {http}/{socks}
    # A seccomp filter compiled (and cached) by the parent: loaded with one
    # prctl, so the launcher never imports pyseccomp. Empty: build it here.
    seccomp_program: bytes = b""
    parent_pid: int = 0  # the proxy's pid: the launcher dies with it
    # The child's filesystem, built when the mount namespace is applied.
    world: WorldSpec | None = None
    # Close-on-exec pipe to the parent: what was applied, written just before exec.
    report_fd: int = -1
    rlimit_nproc: int | None = None
    rlimit_data: int | None = None
    # The std fds that are terminals are a new pty of the run's: the command makes it its
    # controlling terminal in a session of its own (never the caller's terminal on /dev/tty).
    controlling_tty: bool = False
    # Transparent capture in the network namespace (confine/capture.py): every TCP connection
    # to the capture listener, DNS to egressbox's DNS sockets. Only with a network namespace.
    capture: bool = False
    # The run's memory budget as a cgroup of its own (confine/cgroup.py); None: no cgroup, for
    # the reason in cgroup_off (the tmpfs sizes and RLIMIT_DATA then bound what they can).
    cgroup: CgroupPlan | None = None
    cgroup_off: str = ""
    # The staged workspace (confine/staging.py): each of its directories is an overlay whose
    # upper is the run's layer; None: writable grants are bound read-write (direct).
    staged: StagingSpec | None = None
    # Without a network namespace: the connect filter (confine/notify.py) loaded just before the
    # main seccomp filter; its notification fd goes to the parent, whose supervisor connects
    # the command's sockets (runner/notify.py). Empty: no supervisor.
    connect_filter: bytes = b""
    # ...which admits a unix socket connect in the host's view (no mount namespace) only under
    # these roots, the write roots and socket roots (None: no filesystem rules, every path),
    # and not to the host's sockets live under a write root at the start (only a socket root
    # admits what is already there), as the constructed world would (runner/notify.py).
    unix_roots: tuple[str, ...] | None = None
    unix_hidden: tuple[str, ...] = ()
    # --user NAME (runner/account.py): (uid, gid, supplementary groups) the command becomes,
    # from a launcher started as root, after the namespaces and the view are made.
    run_as: tuple[int, int, tuple[int, ...]] | None = None

    def has(self, mechanism: Mechanism) -> bool:
        return mechanism.value in self.mechanisms
