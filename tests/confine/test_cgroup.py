"""The run's memory budget: the cgroup probe (confine/cgroup.py) and the tmpfs sizes
(confine/grants.py tmpfs_sizes), on fake cgroup trees and as pure arithmetic."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressbox.confine import cgroup, world
from egressbox.confine.grants import FIXED_TMPFS_BYTES, tmpfs_sizes, tmpfs_total
from egressbox.core.policy import MIN_MAX_MEMORY

MOUNTINFO = "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"


def _tree(tmp: Path, here: str, controllers: str, subtree: str) -> Path:
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/self/mountinfo").write_text("22 1 0:5 / /proc rw - proc proc rw\n" + MOUNTINFO)
    (tmp / "proc/self/cgroup").write_text(f"0::{here}\n")
    directory = tmp / "sys/fs/cgroup" / here.lstrip("/")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cgroup.controllers").write_text(controllers + "\n")
    (directory / "cgroup.subtree_control").write_text(subtree + "\n")
    return directory


def test_a_delegated_cgroup_with_memory_enabled_is_used(tmp_path: Path) -> None:
    directory = _tree(tmp_path, "/user.slice/run", "cpu memory pids", "memory pids")
    plan, why = cgroup.probe(1 << 30, 500, "egressbox-1", root=str(tmp_path))
    assert why == "" and plan is not None
    assert plan.path == str(directory / "egressbox-1")
    assert (plan.memory_max, plan.pids_max, plan.enable) == (1 << 30, 500, ())


def test_the_root_cgroup_may_enable_the_controllers(tmp_path: Path) -> None:
    _tree(tmp_path, "/", "memory pids", "")
    plan, _ = cgroup.probe(1 << 30, None, "egressbox-1", root=str(tmp_path))
    assert plan is not None and plan.enable == ("memory", "pids")


@pytest.mark.parametrize(
    ("here", "controllers", "subtree", "reason"),
    [
        ("/session.scope", "memory pids", "", "no-internal-process rule"),
        ("/", "cpu hugetlb", "", "memory controller is not available"),
    ],
)
def test_no_cgroup_and_why(
    tmp_path: Path, here: str, controllers: str, subtree: str, reason: str
) -> None:
    _tree(tmp_path, here, controllers, subtree)
    plan, why = cgroup.probe(1 << 30, None, "egressbox-1", root=str(tmp_path))
    assert plan is None and reason in why


def test_no_cgroup_v2_mounted(tmp_path: Path) -> None:
    _tree(tmp_path, "/", "memory", "memory")
    (tmp_path / "proc/self/mountinfo").write_text("22 1 0:5 / /proc rw - proc proc rw\n")
    assert cgroup.probe(1, None, "x", root=str(tmp_path)) == (
        None,
        "no cgroup v2 hierarchy is mounted",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_an_undelegated_cgroup_is_not_used(tmp_path: Path) -> None:
    directory = _tree(tmp_path, "/user.slice/run", "memory", "memory")
    directory.chmod(0o555)
    plan, why = cgroup.probe(1 << 30, None, "egressbox-1", root=str(tmp_path))
    assert plan is None and "not delegated" in why


def test_the_fixed_part_is_the_worlds_own_tmpfs() -> None:
    sizes = {"4m": 4 << 20, "16m": 16 << 20, "64k": 64 << 10}
    assert (
        sum(sizes[s] for s in (world.ROOT_SIZE, world.RUN_SIZE, world.DEV_SIZE))
        == FIXED_TMPFS_BYTES
    )


@given(st.integers(min_value=MIN_MAX_MEMORY, max_value=1 << 42))
def test_the_private_file_systems_fit_in_any_budget(budget: int) -> None:
    tmp, shm = tmpfs_sizes(budget)
    assert tmpfs_total(tmp, shm) <= budget
    assert tmp >= 4 << 20 and shm >= 1 << 20
    assert (tmp, shm) <= tmpfs_sizes(None)  # never larger than the defaults
