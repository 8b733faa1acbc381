"""confine/face.py: plan(request, facts) and finish(plan, run) (confine/planning.py) read and
change nothing of the host, and plan no mechanism the host lacks; launch(plan) forks a
launcher that takes its descriptors; the runner reaches confinement through the face alone."""

from __future__ import annotations

import ast
import builtins
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from egressbox.confine import face
from egressbox.confine.env import Scratch
from egressbox.confine.grants import HOST_NEEDS, HostFacts, Mechanism, Profile

ALL = frozenset(Mechanism)
EVERYTHING = HostFacts(frozenset(HOST_NEEDS.values()), landlock_abi=7)


def _run(**changes: Any) -> face.Run:
    grants = face.Grants(
        home="/home/u",
        write_roots=("/w",),
        read_roots=("/usr", "/w/venv"),
        executables=(),
        presets=(),
        deny=("/home/u/.ssh",),
        socket_roots=("/run/app",),
    )
    run = face.Run(
        argv=("true",),
        executable="/usr/bin/true",
        cwd="/w",
        env={"PATH": "/usr/bin"},
        env_ports={},
        grants=grants,
        # A live socket under a read grant: covered in the world.
        host=face.HostReads(live_sockets=("/usr/sock",), cgroup_off="no cgroup here"),
        read_only_scratch="",
        scratch=Scratch("/w/.egressbox/tmp", "/w/.egressbox/cache"),
        allow_loopback=False,
        pass_fds=(),
        rlimit_nofile=None,
        rlimit_as=None,
        max_processes=4096,
        memory=1 << 30,
        uid=1000,
        gid=1000,
        parent_pid=1,
        capture=True,
    )
    return run._replace(**changes)


def _confine(facts: HostFacts, run: face.Run | None = None) -> face.Confinement:
    """A worktree run's whole confinement on a host with `facts`: planned, then finished."""
    return face.finish(face.plan(face.Request(Profile.WORKTREE), facts), run or _run())


def test_plan_touches_nothing_of_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("plan() did I/O")

    for name in ("stat", "lstat", "listdir", "getcwd", "getuid", "getpid", "readlink"):
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(os.path, "realpath", refuse)
    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(socket, "socket", refuse)
    whole = _confine(EVERYTHING)
    monkeypatch.undo()
    assert whole == _confine(EVERYTHING)  # the same request, the same plan
    plan = whole.launcher
    assert plan.world is not None
    # A read grant inside the workspace adds nothing; the live socket is covered.
    assert ("/w/venv", False) not in plan.world.grants and ("/w", True) in plan.world.grants
    assert "/usr/sock" in plan.world.mask
    assert plan.sockets == ("/run/app",)  # Landlock's filesystem rules admit its binds
    assert whole.mechanisms == ALL and "/w" in whole.fs.write


def test_a_mechanism_the_host_lacks_is_never_planned() -> None:
    no_mounts = HostFacts(EVERYTHING.available - {"mount_namespace"}, landlock_abi=7)
    plan = _confine(no_mounts).launcher
    assert Mechanism.MOUNT_NAMESPACE.value not in plan.mechanisms
    assert plan.world is None  # no view without a mount namespace
    old_abi = _confine(EVERYTHING._replace(landlock_abi=3)).launcher
    assert Mechanism.LANDLOCK_NET.value not in old_abi.mechanisms
    assert Mechanism.LANDLOCK_FS.value in old_abi.mechanisms


def test_launch_forks_a_launcher_that_holds_its_ends(tmp_path: Any) -> None:
    """launch() forks (no forker has one ready) and keeps its ends: the channel and the report
    pipe. The launcher waits for the word on its channel; closed from here, it ends, judged
    from here by its exit within a bound."""
    run = _run(cwd=str(tmp_path), parent_pid=os.getpid())
    plan = _confine(HostFacts(frozenset()), run).launcher
    launched = face.launch(plan, child_fds={}, forker=lambda *_: None)
    assert launched.pid > 0 and launched.pid != os.getpid()
    launched.chan.close()
    os.close(launched.report_fd)
    deadline = time.monotonic() + LAUNCHER_BOUND
    while time.monotonic() < deadline:
        pid, _ = os.waitpid(launched.pid, os.WNOHANG)
        if pid:
            return
        time.sleep(0.01)
    os.kill(launched.pid, signal.SIGKILL)
    os.waitpid(launched.pid, 0)
    pytest.fail("the launcher outlived its channel")


# How long a launcher whose channel closed may take to end (it imports its modules first).
LAUNCHER_BOUND = 10.0


def test_the_face_is_the_package_s_names_and_loads_only_when_asked() -> None:
    """`egressbox.confine.plan(...)` and `.launch(...)` are the face's; importing the package
    (every confine module does) loads neither the face nor the launcher."""
    code = (
        "import sys, egressbox.confine as c\n"
        "assert 'egressbox.confine.face' not in sys.modules\n"
        "assert 'egressbox.confine.launcher' not in sys.modules\n"
        "from egressbox.confine import face\n"
        "assert c.plan is face.plan and c.launch is face.launch\n"
        "assert c.Plan is face.Plan and c.Launched is face.Launched\n"
        "assert c.Request is face.Request and c.finish is face.finish\n"
        "try:\n    c.nothing\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_worktree_gaps_are_said_or_refused_and_os_hardened_refuses() -> None:
    no_landlock = HostFacts(EVERYTHING.available - {"landlock"}, landlock_abi=0)
    warn = face.plan(face.Request(Profile.WORKTREE, sandbox="warn"), no_landlock)
    assert warn.refusals == () and Mechanism.LANDLOCK_FS in warn.gaps
    assert warn.files and Mechanism.LANDLOCK_FS not in warn.mechanisms
    enforce = face.plan(face.Request(Profile.WORKTREE, sandbox="enforce"), no_landlock)
    assert {r.mechanism for r in enforce.refusals} == set(warn.gaps)
    assert all(r.selector_honored for r in enforce.refusals) and enforce.gaps == ()
    hardened = face.plan(face.Request(Profile.OS_HARDENED), no_landlock)
    assert hardened.refusals and not any(r.selector_honored for r in hardened.refusals)
    # EGRESSBOX_SANDBOX=off (worktree) and unrestricted: the network boundary alone.
    off = face.plan(face.Request(Profile.WORKTREE, sandbox="off"), no_landlock)
    assert off.refusals == () and off.gaps == () and off.files_off and not off.files
    assert Mechanism.MOUNT_NAMESPACE not in off.mechanisms
    assert face.plan(face.Request(Profile.UNRESTRICTED, sandbox="enforce"), EVERYTHING).files_off


def test_finish_takes_the_mechanisms_from_the_plan_alone() -> None:
    """The caller cannot hand finish() mechanisms of its own: a profile's plan is all it
    applies (unrestricted on a host with everything: no world, no Landlock rules)."""
    bare = face.plan(face.Request(Profile.UNRESTRICTED), EVERYTHING)
    whole = face.finish(bare, _run())
    assert whole.mechanisms == bare.mechanisms and whole.launcher.world is None
    assert Mechanism.LANDLOCK_FS.value not in whole.launcher.mechanisms
    assert whole.launcher.best_effort  # only os_hardened fails closed


def test_environment_is_built_on_the_plan_and_reads_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The child's environment under a plan: the profile is the plan's, the proxy variables
    are templates for the launcher (never in the environment as given), a credential of the
    caller's is held back by name, and nothing of the host is read to build it."""
    from egressbox.confine.env import EnvPolicy

    base = {"PATH": "/usr/bin", "HOME": "/home/u", "GITHUB_TOKEN": "ghp_x", "HTTPS_PROXY": "h:1"}

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("environment() read the host")

    monkeypatch.setattr(os, "stat", refuse)
    monkeypatch.setattr(os, "getcwd", refuse)
    monkeypatch.setattr(os, "environ", {"LEAK": "from the host"})
    planned = face.plan(face.Request(Profile.WORKTREE), EVERYTHING)
    made = face.environment(
        planned,
        base,
        policy=EnvPolicy.INHERITED,
        grants={},
        remove=(),
        scratch=Scratch("/w/.egressbox/tmp", "/w/.egressbox/cache"),
        writable=("/w",),
    )
    monkeypatch.undo()
    assert made.env["EGRESSBOX_PROFILE"] == Profile.WORKTREE.value
    assert "GITHUB_TOKEN" not in made.env and "GITHUB_TOKEN" in made.held.credentials
    assert "LEAK" not in made.env and made.env["TMPDIR"] == "/w/.egressbox/tmp"
    assert made.templates["HTTPS_PROXY"] == "http://127.0.0.1:{http}"
    assert not {"HTTPS_PROXY", "https_proxy", "ALL_PROXY"} & set(made.env)
    bare = face.plan(face.Request(Profile.UNRESTRICTED), EVERYTHING)
    grants = {"GITHUB_TOKEN": None}  # granted by name: never held back
    given = face.environment(
        bare, base, policy=EnvPolicy.INHERITED, grants=grants, remove=(), scratch=None, writable=()
    )
    assert given.env["EGRESSBOX_PROFILE"] == Profile.UNRESTRICTED.value
    assert given.env["GITHUB_TOKEN"] == "ghp_x" and given.held.credentials == ()


# -- the runner reaches confinement through the face ----------------------------------------

RUNNER = Path(__file__).resolve().parents[2] / "src" / "egressbox" / "runner"
FACE = "egressbox.confine.face"

# What any runner module may take from confinement besides the face: results and vocabulary
# (what a plan or a run's outcome is made of, and the tables naming it).
RESULTS = frozenset(
    {
        "CacheMode",
        "CachePlan",
        "CacheRoot",
        "Change",
        "DEFAULT_PRESETS",
        "DEFAULT_PROFILE",
        "Enforcement",
        "EnvPolicy",
        "Executable",
        "FsPlan",
        "HostFacts",
        "HostSupport",
        "LaunchPlan",
        "Mechanism",
        "PROBED_MECHANISMS",
        "Profile",
        "Refusal",
        "RefusalRecord",
        "Scratch",
        "StagingSpec",
        "CommandNotFoundError",
        "Boundary",
        "HostPath",
        "PathPlan",
        "Outcome",
        "Rules",
        "Selection",
        "Target",
        "Journal",
        "JOURNAL",
        "SOURCE_AUDIT",
        "AUDIT_ARCHES",
        "CONSTRUCTED",
        "KERNEL_READ_ONLY",
        "FORWARDED",
        "MISSING",
        "PRIVATE_TMPFS",
        "PORT_TEMPLATES",
        # pure helpers on the vocabulary: a path under a root, ~ expanded, a profile's parts
        "is_under",
        "expand_user",
        "wanted",
        "host_trusted",
        "parse_profile",
        "profile_note",
        "strictest",
    }
)
# What bypasses the face, module by module: nothing now. A name added here is a step back,
# to be said with why.
STILL_BYPASSING: dict[str, set[str]] = {}


def confine_names(source: str) -> set[str]:
    """The confine names a module uses outside the face: `from egressbox.confine.X import N`
    (X not the face), and `m.N` through a name bound to a confine module other than the face."""
    tree = ast.parse(source)
    names: set[str] = set()
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("egressbox.confine"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full == FACE or node.module == FACE:
                    continue
                if node.module == "egressbox.confine" and alias.name in _FACE_NAMES:
                    continue  # the package's own face names (confine/__init__.py)
                if node.module == "egressbox.confine":
                    modules.add(alias.asname or alias.name)  # an inner module, used as m.N
                else:
                    names.add(alias.name)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("egressbox.confine."))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            names.add(node.attr)
    return names


# The package's face names (confine/__init__.py __all__).
_FACE_NAMES = frozenset({
    "Confinement", "Grants", "HostReads", "Launched", "Plan", "Request", "Run", "finish",
    "launch", "plan", "read_host", "set_up",
})  # fmt: skip


def test_runner_modules_reach_confinement_only_through_its_face() -> None:
    found, gone = {}, {}
    for path in sorted(RUNNER.glob("*.py")):
        used = confine_names(path.read_text())
        extra = used - RESULTS - STILL_BYPASSING.get(path.stem, set())
        if extra:
            found[path.stem] = sorted(extra)
        # A name that moved behind the face leaves the list too: it only ever shrinks.
        if stale := STILL_BYPASSING.get(path.stem, set()) - used:
            gone[path.stem] = sorted(stale)
    assert found == {}, f"runner modules call past confine's face: {found}"
    assert gone == {}, f"no longer bypassing the face, take off STILL_BYPASSING: {gone}"


def test_a_planted_import_past_the_face_is_found() -> None:
    planted = (
        "from egressbox.confine import face, seccomp\n"
        "from egressbox.confine.grants import Mechanism, choose_mechanisms\n"
        "seccomp.compile_filter(None)\nface.plan(None, None)\nface.finish(None, None)\n"
    )
    assert confine_names(planted) - RESULTS == {"choose_mechanisms", "compile_filter"}


def test_plan_holds_the_clean_copies_and_says_what_it_cannot_grant() -> None:
    """The copies read by read_host are bound over their originals in the world; without a
    mount namespace they cannot be, so the originals are denied and the run is told."""
    from egressbox.confine.clean import CleanCopies

    copies = CleanCopies((("/usr/gitconfig", "[user]\n"),), ("/usr/gitconfig",), (), ("x",))
    run = _run(host=face.HostReads(copies=copies))
    whole = _confine(EVERYTHING, run)
    assert whole.launcher.world is not None
    assert ("/usr/gitconfig", "[user]\n") in whole.launcher.world.files
    assert "/usr/gitconfig" not in whole.fs.deny and whole.notes == ("granted as a clean copy: x",)
    no_mounts = HostFacts(EVERYTHING.available - {"mount_namespace"}, landlock_abi=7)
    bare = _confine(no_mounts, run)
    assert "/usr/gitconfig" in bare.fs.deny and "/usr/gitconfig" in bare.launcher.deny
    assert any("not granted" in w and "/usr/gitconfig" in w for w in bare.warnings)


def test_set_up_binds_the_host_listeners_only_without_a_network_namespace() -> None:
    """Without a network namespace set_up listens on the host's loopback for the proxy and
    the launcher's plan names those ports; with one it makes nothing."""
    with_ns = face.set_up(_confine(EVERYTHING))
    assert with_ns.listeners == [] and with_ns.host_capture is None
    no_net = HostFacts(EVERYTHING.available - {"network_namespace"}, landlock_abi=7)
    supervised = _run(host=face.HostReads(supervised=True))
    made = face.set_up(_confine(no_net, supervised))
    try:
        ports = tuple(s.getsockname()[1] for s in made.listeners)
        assert len(ports) == 2 and made.launcher.host_ports == ports
        assert made.host_capture is not None  # capture through the connect supervisor
        for port in (*ports, made.host_capture.getsockname()[1]):
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                pass  # each listens, from the host's side
    finally:
        for sock in (*made.listeners, *([made.host_capture] if made.host_capture else [])):
            sock.close()
