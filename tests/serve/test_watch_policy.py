"""`serve --watch-policy`: a changed policy file is reloaded by the SIGHUP path (a bad one keeps
the old policy), including a Kubernetes ConfigMap update (a `..data` symlink swap)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from egressbox.serve.watch import PolicyWatch
from serving import (
    EchoServer,
    admin_get,
    connect_through,
    metric_samples,
    policy_text,
    serving,
    wait_until,
    write_atomically,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="serve is tested on Linux")

# How long a reload may take to be seen: two polls of a second, on a loaded machine.
RELOAD_TIMEOUT = 20.0


class ConfigMapVolume:
    """A directory laid out as the kubelet lays out a mounted ConfigMap: the file is a
    symlink through `..data`, which points at a timestamped directory and is swapped
    atomically (rename of a new symlink) on every update."""

    def __init__(self, root: Path, name: str = "policy.toml") -> None:
        self.root = root
        self.name = name
        self.version = 0
        root.mkdir()
        (root / name).symlink_to(f"..data/{name}")

    @property
    def path(self) -> Path:
        return self.root / self.name

    def update(self, text: str) -> None:
        self.version += 1
        target = self.root / f"..2024_01_01_00_00_0{self.version}.000"
        target.mkdir()
        (target / self.name).write_text(text)
        link = self.root / "..data_tmp"
        link.symlink_to(target.name)
        link.replace(self.root / "..data")


def test_a_change_is_reported_once_it_holds_still(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("a")
    watch = PolicyWatch(str(path))
    assert not watch.poll()
    path.write_text("bb")  # in place: size and mtime change, same inode
    assert not watch.poll()  # seen once; a writer may still be writing
    assert watch.poll()  # held still for a poll: reload
    assert not watch.poll()
    write_atomically(path, "bb")  # a rename: a new inode, same size
    assert not watch.poll()
    assert watch.poll()
    path.write_text("ccc")
    assert not watch.poll()
    path.write_text("dddd")  # still being written: wait again
    assert not watch.poll()
    assert watch.poll()


def test_a_file_that_goes_and_comes_back(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text("a")
    watch = PolicyWatch(str(path))
    path.unlink()
    assert not watch.poll()
    assert watch.poll()  # tried once (the load fails and keeps the old policy)
    assert not watch.poll()
    path.write_text("a")
    assert not watch.poll()
    assert watch.poll()


def test_a_configmap_symlink_swap_is_a_change(tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "config")
    volume.update("one")
    watch = PolicyWatch(str(volume.path))
    assert not watch.poll()
    volume.update("one")  # the same bytes in a new directory: still a new file
    assert not watch.poll()
    assert watch.poll()
    assert os.readlink(tmp_path / "config" / "..data").endswith("2.000")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_reloads_a_configmap_update_and_keeps_the_old_policy_on_a_bad_one(
    tmp_path: Path, workers: str
) -> None:
    echo = EchoServer()
    target = f"127.0.0.1:{echo.port}"
    volume = ConfigMapVolume(tmp_path / "config")
    volume.update(policy_text([]))
    try:
        with serving(
            tmp_path / "serve",
            "--policy",
            str(volume.path),
            "--watch-policy",
            "--admin",
            "127.0.0.1:0",
            "--workers",
            workers,
        ) as proc:
            http = proc.address("http")

            def status() -> int:
                sock, code = connect_through(http, target)
                sock.close()
                return code

            assert status() == 403
            volume.update(policy_text([target]))
            proc.wait_stderr("policy reloaded", timeout=RELOAD_TIMEOUT)
            # Every worker has the new policy once the reload was said (it is said after
            # every worker answered).
            assert all(status() == 200 for _ in range(8))
            volume.update("[egress]\nallow = [\n")  # broken TOML
            proc.wait_stderr("reload refused, keeping the old policy", timeout=RELOAD_TIMEOUT)
            assert all(status() == 200 for _ in range(8))
            err = proc.stderr()
            assert err.count("policy reloaded") == 1, err

            def reloads() -> dict[str, float]:
                samples = metric_samples(admin_get(proc.ready["admin"], "/metrics")[2].decode())
                found: dict[str, float] = {}
                for (name, labels), value in samples.items():
                    if name == "egressbox_reloads_total":
                        outcome = dict(labels)["outcome"]
                        found[outcome] = found.get(outcome, 0) + value
                return found

            count = int(workers)
            wait_until(
                "every worker's reloads counted",
                lambda: reloads() == {"ok": count, "refused": count},
            )
            assert proc.stop() == 0
    finally:
        echo.close()
