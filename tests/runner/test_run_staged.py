"""The staged workspace: a confined command's writes come back only through the gate.

Each test runs `egressbox run` for real (as the invoking user and as an unprivileged user,
tests/unprivileged.py) and judges the host's files afterwards: what the command wrote lands,
what the host trusts (git control files, any new .git, shell start-up files, ...) is held
back, named and kept in the run's layer; the host's `git status` runs nothing the command
wrote; a symlink on the host never leads an apply outside the root; --review keeps the layer
for `egressbox changes|apply|discard`; an apply killed midway is finished by the next call.
Nothing leaves loopback; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dev_fixtures import GIT, Dev, _explain, _needs, dev

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(900),
]
__all__ = ["dev"]  # the fixture (tests/dev_fixtures.py), used by pytest by name

GIT_ID = "git -c user.email=t@example.invalid -c user.name=t"


def _repo(dev: Dev, name: str = "proj") -> Path:
    _needs(GIT, "git")
    root = dev.project(name)
    (root / "keep.txt").write_text("keep\n", encoding="utf-8")
    (root / "gone.txt").write_text("gone\n", encoding="utf-8")
    (root / "old-name.txt").write_text("renamed\n", encoding="utf-8")
    (root / "dir").mkdir()
    (root / "dir" / "inner.txt").write_text("inner\n", encoding="utf-8")
    dev.own_tree(root)
    dev.git(root, "add", "-A")
    dev.git(root, "commit", "-q", "-m", "first")
    return root


def _state(dev: Dev) -> dict[str, str]:
    """Where the actor's egressbox keeps its layers (a state home of its own per test)."""
    state = dev.home / "state"
    if not state.exists():
        state.mkdir()
        dev.actor.own(state, 0o700)
    env = {"XDG_STATE_HOME": str(state), "EGRESSBOX_STATE_DIR": str(state / "egressbox")}
    if os.environ.get("EGRESSBOX_TEST_PYTHONPATH"):  # a copy of the sources under test
        env["PYTHONPATH"] = os.environ["EGRESSBOX_TEST_PYTHONPATH"]
    return env


def _run(dev: Dev, root: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return dev.egressbox(root, *args, "--", "sh", "-c", script, env=dev.env(**_state(dev)))


def _eb(dev: Dev, root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return dev.run([*dev.actor.egressbox, *args], root, dev.env(**_state(dev), **env))


def _fsmonitor(marker: Path) -> str:
    return f'[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "touch {marker}"\n'


def _host_git_status_runs_nothing(dev: Dev, root: Path, marker: Path) -> None:
    for where in (root, root / "sub"):
        if where.is_dir():
            dev.run([GIT or "git", "status", "--short"], where)
    assert not marker.exists(), "the host's git status ran a command the child wrote"


def test_a_renamed_git_with_fsmonitor_is_held_and_host_git_runs_nothing(dev: Dev) -> None:
    root = _repo(dev)
    config = (root / ".git" / "config").read_bytes()
    marker = dev.base / "MARKER"
    attack = (
        "mv .git .git.old && mkdir .git && cp -a .git.old/objects .git.old/refs .git.old/HEAD "
        f".git/ && printf '{_fsmonitor(marker)}' > .git/config; "
        # git's other doors: a commondir to a config of the child's, and a nested repository
        f"mkdir -p evil/objects evil/refs && printf '{_fsmonitor(marker)}' > evil/config; "
        "echo ../evil > .git.old/commondir; "
        f"git init -q sub && printf '#!/bin/sh\\ntouch {marker}\\n' > sub/.git/hooks/post-checkout"
        f" && printf '{_fsmonitor(marker)}' > sub/.git/config; true"
    )
    done = _run(dev, root, attack)
    assert done.returncode == 0, _explain(done)
    assert (root / ".git" / "config").read_bytes() == config
    assert not (root / ".git" / "commondir").exists()
    # The nested repository lands as data: what git would run or follow in it is held.
    assert (root / "sub" / ".git" / "HEAD").is_file()
    assert not (root / "sub" / ".git" / "config").exists()
    assert not (root / "sub" / ".git" / "hooks").exists()
    _host_git_status_runs_nothing(dev, root, marker)  # in the nested repository too
    assert f"held back: {root}/.git (git_replaced)" in done.stderr, _explain(done)
    assert f"held back: {root}/sub/.git/config (git_control)" in done.stderr, _explain(done)
    assert f"held back: {root}/sub/.git/hooks (git_control)" in done.stderr, _explain(done)
    assert "egressbox apply " in done.stderr
    # The layer keeps what was held; discard drops it.
    listed = _eb(dev, root, "changes", "--json")
    assert listed.returncode == 0, _explain(listed)
    held = {c["path"]: c["held"] for c in json.loads(listed.stdout)["changes"] if "held" in c}
    assert held == {
        f"{root}/.git": "git_replaced",
        f"{root}/sub/.git/config": "git_control",
        f"{root}/sub/.git/hooks": "git_control",
        f"{root}/sub/.git/info": "git_control",
    }
    assert _eb(dev, root, "discard").returncode == 0
    assert _eb(dev, root, "changes").returncode != 0


def test_a_new_commondir_and_config_inside_git_are_held(dev: Dev) -> None:
    root = _repo(dev)
    marker = dev.base / "MARKER"
    script = (
        f"mkdir -p evil && printf '{_fsmonitor(marker)}' > evil/config && "
        "echo ../evil > .git/commondir && "
        f"printf '{_fsmonitor(marker)}' > .git/config && "
        f"printf '#!/bin/sh\\ntouch {marker}\\n' > .git/hooks/pre-commit && "
        "chmod +x .git/hooks/pre-commit && echo 'export X=1' > .envrc && "
        "mkdir -p deep/.vscode && echo '{}' > deep/.vscode/tasks.json"
    )
    done = _run(dev, root, script)
    assert done.returncode == 0, _explain(done)
    for path, reason in (
        (".git/commondir", "git_control"),
        (".git/config", "git_control"),
        (".git/hooks/pre-commit", "git_control"),
        (".envrc", "direnv"),
        ("deep/.vscode", "editor_tasks"),
    ):
        assert f"held back: {root}/{path} ({reason})" in done.stderr, _explain(done)
    assert not (root / ".git" / "commondir").exists()
    assert not (root / ".git" / "hooks" / "pre-commit").exists()
    assert not (root / ".envrc").exists()
    assert (root / "evil" / "config").exists()  # an ordinary file: nothing reads it
    _host_git_status_runs_nothing(dev, root, marker)


def test_ordinary_changes_and_a_commit_land_while_a_hook_is_held(dev: Dev) -> None:
    root = _repo(dev)
    script = (
        "echo new > new.txt && echo more >> keep.txt && rm gone.txt && "
        "mv old-name.txt new-name.txt && mkdir -p a/b && echo deep > a/b/c.txt && "
        "mv dir moved-dir && ln -s keep.txt link && chmod 4755 new.txt && "
        "printf '#!/bin/sh\\nexit 0\\n' > .git/hooks/post-commit && "
        f"{GIT_ID} add -A && {GIT_ID} commit -q -m 'from the run'"
    )
    done = _run(dev, root, script)
    assert done.returncode == 0, _explain(done)
    assert (root / "new.txt").read_text() == "new\n"
    assert os.stat(root / "new.txt").st_mode & 0o7777 == 0o755  # setuid stripped
    assert (root / "keep.txt").read_text() == "keep\nmore\n"
    assert not (root / "gone.txt").exists()
    assert not (root / "old-name.txt").exists()
    assert (root / "new-name.txt").read_text() == "renamed\n"
    assert (root / "a" / "b" / "c.txt").read_text() == "deep\n"
    assert not (root / "dir").exists()
    assert (root / "moved-dir" / "inner.txt").read_text() == "inner\n"
    assert os.readlink(root / "link") == "keep.txt"
    log = dev.git(root, "log", "--format=%s").stdout.split("\n")
    assert log[0] == "from the run", log
    assert dev.git(root, "status", "--porcelain").stdout.strip() == ""
    assert not (root / ".git" / "hooks" / "post-commit").exists()
    assert f"held back: {root}/.git/hooks/post-commit (git_control)" in done.stderr


def test_a_symlink_on_the_host_never_leads_an_apply_outside_the_root(dev: Dev) -> None:
    root = _repo(dev)
    outside = dev.base / "outside"
    outside.mkdir()
    dev.actor.own(outside)
    # In the child: a directory replaced by a symlink to outside, then written through.
    done = _run(dev, root, f"rm -rf dir && ln -s {outside} dir; echo x > dir/planted; true")
    assert done.returncode == 0, _explain(done)
    assert os.readlink(root / "dir") == str(outside)
    assert list(outside.iterdir()) == []
    # On the host, during a review: the directory the layer writes into becomes a symlink.
    (root / "d2").mkdir()
    dev.own_tree(root)
    done = _run(
        dev, root, "echo x > d2/planted && mkdir -p d2/sub && echo y > d2/sub/f", "--review"
    )
    assert done.returncode == 0, _explain(done)
    assert not (root / "d2" / "planted").exists()
    (root / "d2").rmdir()
    (root / "d2").symlink_to(outside)
    applied = _eb(dev, root, "apply")
    assert list(outside.iterdir()) == [], _explain(applied)
    # The host's symlink is replaced by the directory the layer holds, never followed.
    assert applied.returncode == 0, _explain(applied)
    assert not (root / "d2").is_symlink()
    assert (root / "d2" / "sub" / "f").read_text() == "y\n"


def test_review_then_changes_apply_and_discard(dev: Dev) -> None:
    root = _repo(dev)
    done = _run(dev, root, "echo one > one.txt && rm gone.txt && echo 2 >> keep.txt", "--review")
    assert done.returncode == 0, _explain(done)
    assert not (root / "one.txt").exists() and (root / "gone.txt").exists()
    assert "egressbox changes " in done.stderr, _explain(done)
    listed = json.loads(_eb(dev, root, "changes", "--json").stdout)
    actions = {c["path"]: c["action"] for c in listed["changes"]}
    assert actions == {
        f"{root}/one.txt": "added",
        f"{root}/gone.txt": "deleted",
        f"{root}/keep.txt": "modified",
    }
    first = _eb(dev, root, "apply", listed["run"], str(root / "one.txt"))
    assert first.returncode == 0, _explain(first)
    assert (root / "one.txt").read_text() == "one\n" and (root / "gone.txt").exists()
    rest = _eb(dev, root, "apply")
    assert rest.returncode == 0, _explain(rest)
    assert not (root / "gone.txt").exists()
    assert (root / "keep.txt").read_text() == "keep\n2\n"
    assert "the layer is gone" in rest.stderr
    # Discarded: nothing reaches the host.
    done = _run(dev, root, "echo never > never.txt", "--review")
    assert done.returncode == 0, _explain(done)
    assert _eb(dev, root, "discard").returncode == 0
    assert not (root / "never.txt").exists()
    assert _eb(dev, root, "apply").returncode != 0


def test_an_apply_killed_midway_is_finished_by_the_next_call(dev: Dev) -> None:
    root = _repo(dev)
    files = 40
    script = (
        f"mkdir tree && for i in $(seq {files}); do head -c 65536 /dev/urandom > tree/f$i; done"
        " && rm gone.txt"
    )
    done = _run(dev, root, script, "--review")
    assert done.returncode == 0, _explain(done)
    killed = _eb(dev, root, "apply", EGRESSBOX_TEST_APPLY_KILL_AFTER="7")
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), _explain(killed)
    landed = sorted((root / "tree").iterdir()) if (root / "tree").exists() else []
    assert 0 < len(landed) < files
    # Never a half-written file: each one that landed is whole, no temporary name is left.
    assert all(p.stat().st_size == 65536 for p in landed)
    assert not [p for p in root.rglob(".egressbox-apply-*")]
    listed = _eb(dev, root, "changes")
    assert listed.returncode != 0 or "interrupted" in listed.stderr, _explain(listed)
    assert len(list((root / "tree").iterdir())) == files
    assert not (root / "gone.txt").exists()


def test_pip_install_into_a_venv_in_the_project_lands(dev: Dev, tmp_path: Path) -> None:
    root = _repo(dev)
    wheel = _wheel(root)
    dev.own_tree(root)
    python = "/usr/bin/python3"
    script = (
        f"{python} -m venv .venv && .venv/bin/python -m pip install --no-index -q {wheel} && "
        ".venv/bin/python -c 'import stagedpkg; print(stagedpkg.VALUE)'"
    )
    done = _run(dev, root, script)
    assert done.returncode == 0, _explain(done)
    assert done.stdout.strip().endswith("42")
    host = subprocess.run(
        [str(root / ".venv" / "bin" / "python"), "-c", "import stagedpkg; print(stagedpkg.VALUE)"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert host.stdout.strip() == "42", host.stderr


def _wheel(where: Path) -> Path:
    """A pure-Python wheel made here (no index, no network)."""
    import zipfile

    path = where / "stagedpkg-1.0-py3-none-any.whl"
    files = {
        "stagedpkg/__init__.py": "VALUE = 42\n",
        "stagedpkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: stagedpkg\n"
        "Version: 1.0\n",
        "stagedpkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "stagedpkg-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr("stagedpkg-1.0.dist-info/RECORD", record)
    return path
