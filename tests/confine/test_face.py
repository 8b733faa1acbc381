"""confine/face.py: plan(request, facts) reads and changes nothing of the host, and plans no
mechanism the host lacks; launch(plan) forks a launcher that takes its descriptors."""

from __future__ import annotations

import builtins
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

from egressbox.confine import face
from egressbox.confine.env import Scratch
from egressbox.confine.grants import HOST_NEEDS, FsPlan, HostFacts, Mechanism, Profile

ALL = frozenset(Mechanism)
EVERYTHING = HostFacts(frozenset(HOST_NEEDS.values()), landlock_abi=7)


def _request(**changes: Any) -> face.Request:
    grants = face.Grants(
        home="/home/u",
        write_roots=("/w",),
        read_roots=("/usr", "/w/venv"),
        executables=(),
        presets=(),
        deny=("/home/u/.ssh",),
        socket_roots=("/run/app",),
    )
    request = face.Request(
        argv=("true",),
        executable="/usr/bin/true",
        cwd="/w",
        env={"PATH": "/usr/bin"},
        env_ports={},
        mechanisms=ALL,
        profile=Profile.WORKTREE,
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
    return request._replace(**changes)


def test_plan_touches_nothing_of_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("plan() did I/O")

    for name in ("stat", "lstat", "listdir", "getcwd", "getuid", "getpid", "readlink"):
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(os.path, "realpath", refuse)
    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(socket, "socket", refuse)
    whole = face.plan(_request(), EVERYTHING)
    monkeypatch.undo()
    assert whole == face.plan(_request(), EVERYTHING)  # the same request, the same plan
    plan = whole.launcher
    assert plan.world is not None
    # A read grant inside the workspace adds nothing; the live socket is covered.
    assert ("/w/venv", False) not in plan.world.grants and ("/w", True) in plan.world.grants
    assert "/usr/sock" in plan.world.mask
    assert plan.sockets == ("/run/app",)  # Landlock's filesystem rules admit its binds
    assert whole.mechanisms == ALL and "/w" in whole.fs.write


def test_a_mechanism_the_host_lacks_is_never_planned() -> None:
    no_mounts = HostFacts(EVERYTHING.available - {"mount_namespace"}, landlock_abi=7)
    plan = face.plan(_request(), no_mounts).launcher
    assert Mechanism.MOUNT_NAMESPACE.value not in plan.mechanisms
    assert plan.world is None  # no view without a mount namespace
    old_abi = face.plan(_request(), EVERYTHING._replace(landlock_abi=3)).launcher
    assert Mechanism.LANDLOCK_NET.value not in old_abi.mechanisms
    assert Mechanism.LANDLOCK_FS.value in old_abi.mechanisms


def test_launch_forks_a_launcher_that_holds_its_ends(tmp_path: Any) -> None:
    """launch() forks (no forker has one ready) and keeps its ends: the channel and the report
    pipe. The launcher waits for the word on its channel; closed from here, it ends, judged
    from here by its exit within a bound."""
    request = _request(cwd=str(tmp_path), parent_pid=os.getpid())
    plan = face.plan(request, HostFacts(frozenset())).launcher
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
        "assert c.Request is face.Request\n"
        "try:\n    c.nothing\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit(1)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_worktree_gaps_are_said_or_refused_and_os_hardened_refuses() -> None:
    no_landlock = HostFacts(EVERYTHING.available - {"landlock"}, landlock_abi=0)
    warn = face.choose(Profile.WORKTREE, no_landlock, files_off=False, enforce=False)
    assert warn.refusals == [] and Mechanism.LANDLOCK_FS in warn.gaps
    enforce = face.choose(Profile.WORKTREE, no_landlock, files_off=False, enforce=True)
    assert {r.mechanism for r in enforce.refusals} == set(warn.gaps)
    assert all(r.selector_honored for r in enforce.refusals) and enforce.gaps == ()
    hardened = face.choose(Profile.OS_HARDENED, no_landlock, files_off=False, enforce=False)
    assert hardened.refusals and not any(r.selector_honored for r in hardened.refusals)
    off = face.choose(Profile.WORKTREE, no_landlock, files_off=True, enforce=True)
    assert off.refusals == [] and off.gaps == () and Mechanism.MOUNT_NAMESPACE not in off.chosen
