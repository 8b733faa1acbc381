"""confine/face.py: plan(request, facts) reads and changes nothing of the host, and plans no
mechanism the host lacks; launch(plan) forks a launcher that takes its descriptors."""

from __future__ import annotations

import builtins
import os
import signal
import socket
import time
from typing import Any

import pytest

from egressbox.confine import face
from egressbox.confine.env import Scratch
from egressbox.confine.grants import HOST_NEEDS, FsPlan, HostFacts, Mechanism, Profile

ALL = frozenset(Mechanism)
EVERYTHING = HostFacts(frozenset(HOST_NEEDS.values()), landlock_abi=7)


def _request(**changes: Any) -> face.Request:
    fs = FsPlan(read=("/usr", "/w/venv"), write=("/w",), deny=("/home/u/.ssh",))
    request = face.Request(
        argv=("true",),
        executable="/usr/bin/true",
        cwd="/w",
        env={"PATH": "/usr/bin"},
        env_ports={},
        mechanisms=ALL,
        profile=Profile.WORKTREE,
        fs=fs,
        workspaces=("/w",),
        process_write=(),
        socket_roots=("/run/app",),
        read_only_scratch="",
        scratch=Scratch("/w/.egressbox/tmp", "/w/.egressbox/cache"),
        hidden_sockets=("/usr/sock",),
        allow_loopback=False,
        pass_fds=(),
        rlimit_nofile=None,
        rlimit_as=None,
        max_processes=4096,
        memory=1 << 30,
        tmp_size=1 << 29,
        shm_size=1 << 28,
        cgroup=None,
        cgroup_off="no cgroup here",
        host_ports=(),
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
    plan = face.plan(_request(), EVERYTHING)
    monkeypatch.undo()
    assert plan == face.plan(_request(), EVERYTHING)  # the same request, the same plan
    assert plan.world is not None
    # A read grant inside the workspace adds nothing; the live socket is covered.
    assert ("/w/venv", False) not in plan.world.grants and ("/w", True) in plan.world.grants
    assert "/usr/sock" in plan.world.mask
    assert plan.sockets == ("/run/app",)  # Landlock's filesystem rules admit its binds


def test_a_mechanism_the_host_lacks_is_never_planned() -> None:
    no_mounts = HostFacts(EVERYTHING.available - {"mount_namespace"}, landlock_abi=7)
    plan = face.plan(_request(), no_mounts)
    assert Mechanism.MOUNT_NAMESPACE.value not in plan.mechanisms
    assert plan.world is None  # no view without a mount namespace
    old_abi = face.plan(_request(), EVERYTHING._replace(landlock_abi=3))
    assert Mechanism.LANDLOCK_NET.value not in old_abi.mechanisms
    assert Mechanism.LANDLOCK_FS.value in old_abi.mechanisms


def test_launch_forks_a_launcher_that_holds_its_ends(tmp_path: Any) -> None:
    """launch() forks (no forker has one ready) and keeps its ends: the channel and the report
    pipe. The launcher waits for the word on its channel; closed from here, it ends, judged
    from here by its exit within a bound."""
    plan = face.plan(_request(cwd=str(tmp_path), parent_pid=os.getpid()), HostFacts(frozenset()))
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
