"""Confinement's one face: the names the runner reaches confinement through, and nothing else.

    plan(request, facts) -> Plan        which mechanisms the profile gets on this host (pure)
    environment(plan, base, ...)        the child's environment on the Plan (pure)
    read_host(plan, grants, ...)        what the run needs of the host (reads only)
    finish(plan, run) -> Confinement    the grants, the world and the walls (pure)
    set_up(confinement) -> SetUp        what the launch needs made on the host
    launch(launch_plan) -> Launched     the launcher forked with its plan

and, around them, the way back (`apply_layer`, `layer_changes`: a staged layer applied to the
host through the gate), the connect supervisor's kernel side (`supervisor`), the host's facts
(`probe`, `compile_seccomp`), and the judging of a failed run (`refusal_view`,
`judge_output`). Each lives in the module that owns it: confine/planning.py (pure: planning
reads and makes nothing, and tests/test_imports.py holds it to that), confine/host.py
(reading and making on the host before the fork), confine/launching.py (the parent's side of
the launcher), confine/judging.py (after a run). A runner module that imports confinement
past this face fails tests/confine/test_face.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from egressbox.confine.executable import resolve_command
from egressbox.confine.host import (
    SetUp,
    bind_host_capture,
    bind_host_listeners,
    compile_seccomp,
    connect_filter,
    connects_off,
    give_scratch,
    make_scratch,
    namespace_blocker,
    private_scratch,
    probe,
    probe_cgroup,
    read_host,
    set_up,
)
from egressbox.confine.judging import (
    judge_output,
    refusal_view,
    seccomp_refusal,
    seccomp_row,
    with_requirement,
)
from egressbox.confine.launching import (
    Forker,
    Launched,
    become_launcher,
    die_with_parent,
    launch,
    launcher_word,
    on_host_network,
    preload_launcher,
    supervisor,
    walk_etc_early,
)
from egressbox.confine.planning import (
    HOST_DEVICE_NODES,
    ChildEnvironment,
    Confinement,
    Grants,
    HostReads,
    Plan,
    Request,
    Run,
    credential_paths,
    environment,
    finish,
    granted_paths,
    host_devices,
    host_view,
    plan,
    preset_paths,
    private_paths,
    roots_json,
    scratch_paths,
)
from egressbox.confine.staging import apply_layer, layer_changes
from egressbox.confine.toolchains import plan_caches

if TYPE_CHECKING:
    from egressbox.confine.notify import Notifications as Notifications  # noqa: PLC0414 (a type the runner names)

__all__ = [
    "HOST_DEVICE_NODES",
    "ChildEnvironment",
    "Confinement",
    "Forker",
    "Grants",
    "HostReads",
    "Launched",
    "Plan",
    "Request",
    "Run",
    "SetUp",
    "apply_layer",
    "become_launcher",
    "bind_host_capture",
    "bind_host_listeners",
    "compile_seccomp",
    "connect_filter",
    "connects_off",
    "credential_paths",
    "die_with_parent",
    "environment",
    "finish",
    "give_scratch",
    "granted_paths",
    "host_devices",
    "host_view",
    "judge_output",
    "launch",
    "launcher_word",
    "layer_changes",
    "make_scratch",
    "namespace_blocker",
    "on_host_network",
    "plan",
    "plan_caches",
    "preload_launcher",
    "preset_paths",
    "private_paths",
    "private_scratch",
    "probe",
    "probe_cgroup",
    "read_host",
    "refusal_view",
    "resolve_command",
    "roots_json",
    "scratch_paths",
    "seccomp_refusal",
    "seccomp_row",
    "set_up",
    "supervisor",
    "walk_etc_early",
    "with_requirement",
]
