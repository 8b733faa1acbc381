"""Developer workflows inside `egressbox run`, with real tools, judged from the host side.

A build run from a subdirectory writes its project's output directory (the workspace is the
project root); a working directory outside every root is refused with the flag that admits
it; a read-only workspace refuses a write while the build's caches work; Go, Cargo and npm
builds keep their caches in the run's scratch space (never under the home directory); `git
status` and `git commit` work in a linked worktree whose hooks stay the host's; widened roots
are announced; a command killed by SIGSYS is a seccomp refusal; a refused cache names its
variable. Every build is offline: modules come from a file proxy, packages from tarballs
made here, crates have no dependencies. Each test runs as the invoking user (root here) and,
where the tool is reachable for it, as an unprivileged user (tests/unprivileged.py).
Nothing leaves loopback; every wait is bounded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from dev_fixtures import (
    CARGO,
    FOREIGN,
    GIT,
    GO,
    IDENTITY,
    MAKE,
    NPM,
    Dev,
    _explain,
    _needs,
    dev,
)

__all__ = ["dev"]  # the fixture (tests/dev_fixtures.py), used by pytest by name

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(900),
]


def _listing(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under root with its mode and mtime, as the host sees it."""
    found = {}
    for path in (root, *root.rglob("*")):
        st = os.lstat(path)
        found[str(path.relative_to(root))] = (st.st_mode, st.st_mtime_ns)
    return found


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the project root -----------------------------------------------------------------------


def test_a_build_from_a_subdirectory_writes_its_projects_output_dir(dev: Dev) -> None:
    _needs(GIT, "git")
    _needs(MAKE, "make")
    root = dev.project("app")
    (root / "Makefile").write_text(
        "target/app: src/main.c\n\tmkdir -p target && cp src/main.c target/app\n",
        encoding="utf-8",
    )
    (root / "src").mkdir()
    (root / "src" / "main.c").write_text("int main(void) { return 0; }\n", encoding="utf-8")
    dev.own_tree(root)
    done = dev.egressbox(root / "src", "--report", "--", "make", "-C", "..")
    assert done.returncode == 0, _explain(done)
    built = root / "target" / "app"
    assert built.read_text(encoding="utf-8").startswith("int main"), _explain(done)
    assert os.stat(built).st_uid == dev.actor.uid
    assert (root / ".egressbox" / ".gitignore").exists()  # the scratch space is at the root
    assert not (root / "src" / ".egressbox").exists()
    assert f"root: workspace: {root} (" in done.stderr, _explain(done)
    assert "the project root: it holds .git" in done.stderr, _explain(done)
    # The default workspace is not a widening: nothing is announced.
    assert "sandbox active" not in done.stderr, _explain(done)


def test_a_cwd_outside_every_root_is_refused_with_the_flag_that_admits_it(dev: Dev) -> None:
    _needs(GIT, "git")
    root = dev.project("app")
    (root / "docs").mkdir()
    out = dev.actor.make_dir(dev.base, "out-")
    dev.own_tree(root)
    done = dev.egressbox(root / "docs", "--write-root", str(out), "--", "true")
    assert done.returncode == 122, _explain(done)  # EXIT_CWD_UNAVAILABLE
    assert f"the working directory {root}/docs is outside every root" in done.stderr
    assert f"--write-root {root} (its project root: it holds .git)" in done.stderr
    plain = dev.actor.make_dir(dev.base, "plain-")
    done = dev.egressbox(plain, "--write-root", str(out), "--", "true")
    assert done.returncode == 122, _explain(done)
    assert f"add --write-root {plain} (or --read-root {plain})" in done.stderr, _explain(done)
    assert not (plain / ".egressbox").exists() and not (root / ".egressbox").exists()


def test_a_project_root_that_is_home_is_refused(dev: Dev) -> None:
    _needs(GIT, "git")
    dev.git(dev.home, "init", "-q")  # a dotfiles repository
    sub = dev.actor.make_dir(dev.home, "proj-")
    done = dev.egressbox(sub, "--", "true")
    assert done.returncode == 122, _explain(done)
    assert f"the workspace would be {dev.home} (the project root: it holds .git)" in done.stderr
    assert f"--write-root {sub} for the current directory only" in done.stderr, _explain(done)
    done = dev.egressbox(sub, "--write-root", str(sub), "--", "true")
    assert done.returncode == 0, _explain(done)


def test_the_projects_policy_is_used_once_trusted_and_never_when_a_command_wrote_it(
    dev: Dev,
) -> None:
    root = dev.project("app", marker="egressbox.toml")
    policy = root / "egressbox.toml"
    policy.write_text("[egress]\nallow = []\n[process]\ntimeout = 77\n", encoding="utf-8")
    dev.own_tree(root)
    (root / "sub").mkdir()
    dev.own_tree(root)
    done = dev.egressbox(root / "sub", "--", "true")
    assert done.returncode == 2, _explain(done)
    assert f"review it, then run once with --policy {policy}" in done.stderr, _explain(done)
    done = dev.egressbox(root / "sub", "--policy", str(policy), "--", "true")
    assert done.returncode == 0, _explain(done)
    done = dev.egressbox(root / "sub", "--report", "--", "true")
    assert done.returncode == 0, _explain(done)
    assert f"policy: {policy} (the project root's" in done.stderr, _explain(done)
    assert "no policy" not in done.stderr, _explain(done)
    # A command plants a policy of its own deeper down. Staged (the default), the gate holds
    # it back; written live (direct), the next run from there refuses it.
    planted = root / "sub" / "egressbox.toml"
    plant = f"printf '[egress]\\nallow = [\"*.example\"]\\n' > {planted}"
    done = dev.egressbox(root / "sub", "--", "sh", "-c", plant)
    assert done.returncode == 0 and not planted.exists(), _explain(done)
    assert "(egressbox_own)" in done.stderr, _explain(done)
    done = dev.egressbox(root / "sub", "--workspace", "direct", "--", "sh", "-c", plant)
    assert done.returncode == 0 and planted.exists(), _explain(done)
    done = dev.egressbox(root / "sub", "--", "true")
    assert done.returncode == 2, _explain(done)
    assert f"{planted} is the project's policy, but egressbox has not run with" in done.stderr


# -- a read-only workspace -------------------------------------------------------------------


def _npm_tarball(where: Path, name: str = "dep") -> Path:
    """A package tarball as `npm pack` makes it (package/package.json), built here."""
    meta = json.dumps({"name": name, "version": "1.0.0", "main": "index.js"}).encode()
    code = b"module.exports = 42;\n"
    path = where / f"{name}-1.0.0.tgz"
    with tarfile.open(path, "w:gz") as tar:
        for member, data in (("package/package.json", meta), ("package/index.js", code)):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


NPM_OFFLINE = ("--offline", "--no-audit", "--no-fund", "--no-update-notifier")


@pytest.mark.parametrize("how", ["flag", "policy"])
def test_a_read_only_workspace_refuses_a_write_while_the_caches_work(dev: Dev, how: str) -> None:
    _needs(NPM, "npm")
    root = dev.project("review", marker="")
    tarball = _npm_tarball(root)
    (root / "package.json").write_text('{"name": "review", "version": "1.0.0"}', encoding="utf-8")
    dev.own_tree(root)
    args: list[str] = ["--read-only-workspace"]
    if how == "policy":
        policy = dev.home / "ro.toml"
        policy.write_text('[egress]\nallow = []\n[filesystem]\nworkspace = "read-only"\n')
        dev.actor.own(policy)
        args = ["--policy", str(policy)]
    before = _listing(root)
    script = (
        f"npm cache add {' '.join(NPM_OFFLINE)} {tarball} && "
        'ls "$npm_config_cache/_cacache" && echo "caches: $npm_config_cache" && '
        "touch ../review/notes.txt"
    )
    done = dev.egressbox(root, *args, "--", "sh", "-c", script)
    assert done.returncode == 1, _explain(done)
    assert "index-v5" in done.stdout, _explain(done)  # the cache was written, outside it
    assert "caches: /tmp/egressbox-scratch/cache/npm" in done.stdout, _explain(done)
    assert f"refused by write: {root}/notes.txt" in done.stderr, _explain(done)
    assert "the workspace is read-only (--read-only-workspace)" in done.stderr, _explain(done)
    # From the host: nothing in the project changed, not even a scratch directory.
    assert _listing(root) == before
    assert not (dev.home / ".npm").exists()


def test_a_read_only_workspace_with_profile_unrestricted_is_refused(dev: Dev) -> None:
    root = dev.project("review", marker="")
    done = dev.egressbox(
        root, "--profile", "unrestricted", "--read-only-workspace", "--", "touch", "x"
    )
    assert done.returncode == 126, _explain(done)
    assert "a read-only workspace" in done.stderr and "cannot be applied" in done.stderr
    assert not (root / "x").exists()


def test_roots_are_announced_one_line_each_also_with_profile_unrestricted(dev: Dev) -> None:
    root = dev.project("app", marker="")
    extra = dev.actor.make_dir(dev.base, "extra-")
    data = dev.actor.make_dir(dev.base, "data-")
    for profile in ("workspace_paths", "unrestricted"):
        done = dev.egressbox(
            root,
            "--profile",
            profile,
            "--write-root",
            str(root),
            "--write-root",
            str(extra),
            "--read-root",
            str(data),
            "--",
            "sh",
            "-c",
            f"echo x > {extra}/made",
        )
        assert done.returncode == 0, _explain(done)
        lines = [line for line in done.stderr.splitlines() if "sandbox active" in line]
        assert any(f"sandbox active; extra write root: {extra}" in line for line in lines)
        assert any(f"sandbox active; extra read root: {data}" in line for line in lines)
        said = "profile unrestricted applies no filesystem rules"
        assert all((said in line) == (profile == "unrestricted") for line in lines), lines
        assert (extra / "made").read_text() == "x\n"
    done = dev.egressbox(root, "--quiet", "--write-root", str(extra), "--", "true")
    assert "sandbox active" not in done.stderr, _explain(done)


# -- toolchains: caches in the scratch space ---------------------------------------------------


def _go_module_proxy(where: Path) -> Path:
    """A GOPROXY directory (file://) serving example.com/dep v1.0.0, made here."""
    module, version = "example.com/dep", "v1.0.0"
    base = where / "goproxy" / module / "@v"
    base.mkdir(parents=True)
    mod = f"module {module}\n\ngo 1.19\n"
    code = "package dep\n\nfunc Answer() int { return 42 }\n"
    (base / "list").write_text(f"{version}\n", encoding="utf-8")
    (base / f"{version}.info").write_text(
        json.dumps({"Version": version, "Time": "2024-01-01T00:00:00Z"}), encoding="utf-8"
    )
    (base / f"{version}.mod").write_text(mod, encoding="utf-8")
    with zipfile.ZipFile(base / f"{version}.zip", "w") as archive:
        archive.writestr(f"{module}@{version}/go.mod", mod)
        archive.writestr(f"{module}@{version}/dep.go", code)
    return where / "goproxy"


def test_a_go_build_keeps_its_caches_in_the_scratch_space(dev: Dev) -> None:
    _needs(GO, "go")
    root = dev.project("gohello")
    proxy = _go_module_proxy(dev.base)
    (root / "go.mod").write_text(
        "module example.com/hello\n\ngo 1.19\n\nrequire example.com/dep v1.0.0\n", encoding="utf-8"
    )
    (root / "main.go").write_text(
        textwrap.dedent(
            """\
            package main

            import (
            \t"fmt"

            \t"example.com/dep"
            )

            func main() { fmt.Println("answer", dep.Answer()) }
            """
        ),
        encoding="utf-8",
    )
    (root / "cmd").mkdir()
    dev.own_tree(root)
    dev.own_tree(proxy.parent)
    env = dev.env(GOPROXY=f"file://{proxy}", GOSUMDB="off", GOTOOLCHAIN="local")
    # Run from a subdirectory, as a developer would: the module is the project root.
    script = (
        "cd .. && go mod tidy && go build -o app . && ./app && go env GOMODCACHE GOCACHE GOPATH"
    )
    done = dev.egressbox(root / "cmd", "--read-root", str(proxy), "--", "sh", "-c", script, env=env)
    assert done.returncode == 0, _explain(done)
    assert "answer 42" in done.stdout, _explain(done)
    cache = root / ".egressbox" / "cache"
    assert done.stdout.split()[2:] == [
        str(cache / "go-mod"),
        str(cache / "go-build"),
        str(cache / "go-path"),
    ], _explain(done)
    # From the host: the module landed in the scratch space, writable (so `rm -rf` works),
    # the build cache too; nothing under the home directory.
    source = cache / "go-mod" / "example.com" / "dep@v1.0.0" / "dep.go"
    assert source.is_file(), _explain(done)
    assert os.stat(source.parent).st_mode & stat.S_IWUSR, oct(os.stat(source.parent).st_mode)
    assert os.stat(source).st_uid == dev.actor.uid
    assert any((cache / "go-build").iterdir())
    assert not (dev.home / "go").exists() and not (dev.home / ".cache" / "go-build").exists()
    assert (root / "go.sum").is_file()  # the project's own files are written where they belong


def test_a_cargo_build_keeps_cargo_home_in_the_scratch_space(dev: Dev) -> None:
    _needs(CARGO, "cargo")
    assert CARGO is not None
    if dev.actor.runuser:
        pytest.skip(
            f"{CARGO} (a rustup install in the invoker's home) is out of the test user's reach"
        )
    real_home = Path(os.path.expanduser("~"))
    cargo_home = real_home / ".cargo"
    root = dev.project("crate")
    (root / "Cargo.toml").write_text(
        '[package]\nname = "hello"\nversion = "0.1.0"\nedition = "2021"\n', encoding="utf-8"
    )
    (root / "src").mkdir()
    (root / "src" / "main.rs").write_text('fn main() { println!("hi"); }\n', encoding="utf-8")
    before = sorted(p.name for p in cargo_home.iterdir()) if cargo_home.is_dir() else []
    # rustup's toolchains are found under the real home (read-only in the view).
    env = dev.env(
        HOME=str(real_home), PATH=f"{Path(CARGO).parent}:{os.environ.get('PATH', '/usr/bin')}"
    )
    done = dev.egressbox(
        root / "src", "--", "sh", "-c", "cargo build --offline && echo $CARGO_HOME", env=env
    )
    assert done.returncode == 0, _explain(done)
    scratch = root / ".egressbox" / "cache" / "cargo"
    assert done.stdout.strip().splitlines()[-1] == str(scratch), _explain(done)
    assert (root / "target" / "debug" / "hello").is_file()  # target/ stays in the project
    assert (scratch / ".package-cache").exists(), sorted(p.name for p in scratch.iterdir())
    if before:  # nothing was made in the host's ~/.cargo
        assert sorted(p.name for p in cargo_home.iterdir()) == before


def test_an_npm_install_keeps_its_cache_in_the_scratch_space(dev: Dev) -> None:
    _needs(NPM, "npm")
    root = dev.project("web")
    (root / "package.json").write_text('{"name": "web", "version": "1.0.0"}', encoding="utf-8")
    (root / "vendor").mkdir()
    tarball = _npm_tarball(root / "vendor")
    (root / "lib").mkdir()
    dev.own_tree(root)
    done = dev.egressbox(
        root / "lib",
        "--",
        "sh",
        "-c",
        f"cd .. && npm install {' '.join(NPM_OFFLINE)} {tarball} && "
        "node -e 'console.log(require(\"dep\"))'",
    )
    assert done.returncode == 0, _explain(done)
    assert done.stdout.strip().endswith("42"), _explain(done)
    cache = root / ".egressbox" / "cache" / "npm" / "_cacache"
    assert (cache / "index-v5").is_dir(), _explain(done)
    assert os.stat(cache).st_uid == dev.actor.uid
    assert (root / "node_modules" / "dep" / "index.js").is_file()
    assert not (dev.home / ".npm").exists()


def test_a_refused_cache_the_caller_set_names_its_variable(dev: Dev) -> None:
    _needs(NPM, "npm")
    root = dev.project("web")
    tarball = _npm_tarball(root)
    dev.own_tree(root)
    mine = dev.home / ".npm-mine"
    env = dev.env(npm_config_cache=str(mine))
    done = dev.egressbox(root, "--", "npm", "cache", "add", *NPM_OFFLINE, str(tarball), env=env)
    assert done.returncode != 0, _explain(done)
    # npm's `mkdir -p` fails at the first directory the view lacks, on the way to the cache.
    assert "refused by toolchain_cache: " in done.stderr, _explain(done)
    assert f"npm_config_cache points at {mine}" in done.stderr, _explain(done)
    assert f"mkdir -p {mine}, then --process-write-root {mine} grants it" in done.stderr
    assert not mine.exists()
    # The flag the hint names grants that cache, and nothing else.
    done = dev.egressbox(
        root,
        "--process-write-root",
        str(mine),
        "--",
        "npm",
        "cache",
        "add",
        *NPM_OFFLINE,
        str(tarball),
        env=env,
    )
    # A directory missing on the host is not granted (the view has nothing to bind).
    assert done.returncode != 0, _explain(done)
    mine.mkdir()
    dev.actor.own(mine)
    done = dev.egressbox(
        root,
        "--process-write-root",
        str(mine),
        "--",
        "npm",
        "cache",
        "add",
        *NPM_OFFLINE,
        str(tarball),
        env=env,
    )
    assert done.returncode == 0, _explain(done)
    assert (mine / "_cacache" / "index-v5").is_dir()
    assert f"sandbox active; extra write root: {mine} (for tools)" in done.stderr


def test_real_toolchain_caches_are_granted_only_where_they_exist(dev: Dev) -> None:
    _needs(NPM, "npm")
    root = dev.project("web")
    tarball = _npm_tarball(root)
    dev.own_tree(root)
    npm_cache = dev.home / ".npm"
    npm_cache.mkdir()
    dev.actor.own(npm_cache)
    (dev.home / ".cache").mkdir()
    dev.actor.own(dev.home / ".cache")
    bin_dir = dev.actor.make_dir(dev.base, "bin-")
    (dev.home / ".cache" / "pip").symlink_to(bin_dir)  # a link a command could have left
    done = dev.egressbox(
        root,
        "--toolchain-cache",
        "real",
        "--",
        "sh",
        "-c",
        f"npm cache add {' '.join(NPM_OFFLINE)} {tarball} && echo pip=$PIP_CACHE_DIR",
    )
    assert done.returncode == 0, _explain(done)
    assert (npm_cache / "_cacache" / "index-v5").is_dir()  # the real cache, reused
    assert f"extra write root: {npm_cache} (npm's own cache, --toolchain-cache real)" in done.stderr
    assert f"pip's cache {dev.home}/.cache/pip is not granted" in done.stderr, _explain(done)
    assert f"pip={root}/.egressbox/cache/pip" in done.stdout, _explain(done)
    # Nothing was made under the home directory for the tools this run did not find there.
    assert sorted(p.name for p in dev.home.iterdir()) == [".cache", ".npm"]
    assert not any(bin_dir.iterdir())


# -- git -------------------------------------------------------------------------------------


def test_git_status_and_commit_in_a_linked_worktree(dev: Dev) -> None:
    _needs(GIT, "git")
    main = dev.project("main")
    (main / "README").write_text("main\n", encoding="utf-8")
    dev.own_tree(main)
    dev.git(main, "add", "README")
    dev.git(main, "commit", "-q", "-m", "init")
    worktree = dev.base / "feature-wt"
    dev.git(main, "worktree", "add", "-q", str(worktree), "-b", "feature")
    (worktree / "change.txt").write_text("from the worktree\n", encoding="utf-8")
    dev.own_tree(worktree)
    common = main / ".git"
    hooks, config = common / "hooks", common / "config"
    config_before = _digest(config)
    script = (
        "git status --short && git add change.txt && "
        f"git {' '.join(IDENTITY)} commit -q -m 'in the sandbox' && git log --oneline -1; "
        f"echo 'echo pwned' > {hooks}/post-commit; "
        f"git config --file {config} core.fsmonitor 'touch /tmp/pwned'; exit 0"
    )
    done = dev.egressbox(worktree, "--", "sh", "-c", script)
    assert done.returncode == 0, _explain(done)
    assert "?? change.txt" in done.stdout and "in the sandbox" in done.stdout, _explain(done)
    announced = (
        f"sandbox active; extra write root: {common} "
        f"(the git common directory of the worktree {worktree})"
    )
    assert announced in done.stderr, _explain(done)
    # From the host: the commit is in the repository, the hooks and config are not changed.
    log = dev.git(main, "log", "--format=%s", "-1", "feature").stdout
    assert log.strip() == "in the sandbox"
    assert not (hooks / "post-commit").exists()
    assert _digest(config) == config_before
    # The objects the commit made live in the common directory, owned by the actor.
    head = dev.git(main, "rev-parse", "feature").stdout.strip()
    obj = common / "objects" / head[:2] / head[2:]
    assert obj.is_file() and os.stat(obj).st_uid == dev.actor.uid


def test_a_worktree_whose_git_file_was_rewritten_gets_nothing_more(dev: Dev) -> None:
    _needs(GIT, "git")
    main = dev.project("main")
    dev.git(main, "commit", "-q", "--allow-empty", "-m", "init")
    worktree = dev.base / "wt"
    dev.git(main, "worktree", "add", "-q", str(worktree))
    target = dev.actor.make_dir(dev.base, "precious-")
    # The .git file is host-trusted: a command cannot point the next run elsewhere. Staged,
    # its change is held back at the gate; direct, the file is read-only.
    script = f"echo 'gitdir: {target}' > .git; cat .git"
    done = dev.egressbox(worktree, "--", "sh", "-c", script)
    assert "(git_replaced)" in done.stderr, _explain(done)
    done = dev.egressbox(worktree, "--workspace", "direct", "--", "sh", "-c", script)
    assert "Read-only file system" in done.stderr, _explain(done)
    assert (worktree / ".git").read_text().startswith("gitdir: ") and str(target) not in (
        worktree / ".git"
    ).read_text()
    # Rewritten on the host (as a command of an unconfined run could): no grant follows it.
    (worktree / ".git").write_text(f"gitdir: {target}\n", encoding="utf-8")
    done = dev.egressbox(worktree, "--", "sh", "-c", f"touch {target}/x")
    assert done.returncode != 0 and not (target / "x").exists(), _explain(done)
    assert "sandbox active" not in done.stderr


# -- seccomp and the child's locale -------------------------------------------------------------

INT80 = textwrap.dedent(
    """
    import ctypes, mmap
    code = bytes([0xB8, 0x14, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20; int 0x80; ret
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    print("returned", ctypes.CFUNCTYPE(ctypes.c_int)(address)())
    """
)


def test_a_command_killed_by_sigsys_is_a_seccomp_refusal(dev: Dev) -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the i386 system call is made with x86_64 code")
    root = dev.project("app", marker="")
    done = dev.egressbox(root, "--", dev.actor.python, "-c", INT80)
    assert done.returncode == 128 + 31, _explain(done)
    assert "returned" not in done.stdout
    assert "command exited 159; refused by seccomp" in done.stderr, _explain(done)
    if dev.actor.uid == 0:
        # The kernel's audit record of the kill names the call.
        assert "refused by seccomp: getpid (x86 system call 20)" in done.stderr, _explain(done)
    else:
        # dmesg_restrict keeps the kernel log from an unprivileged user: the status says it.
        assert "from the exit status (128+SIGSYS)" in done.stderr or "getpid" in done.stderr


def test_the_childs_messages_are_english_unless_the_caller_chose_a_locale(dev: Dev) -> None:
    root = dev.project("app", marker="")
    # A failure that says something egressbox cannot read (no English error text in it).
    said = 'echo "msg=$LC_MESSAGES all=$LC_ALL"; echo "Zugriff verweigert" >&2; exit 3'
    done = dev.egressbox(root, "--", "sh", "-c", said)
    assert done.stdout.strip() == "msg=C all=", _explain(done)
    assert "messages are in" not in done.stderr, _explain(done)
    done = dev.egressbox(root, "--", "sh", "-c", said, env=dev.env(LC_ALL=FOREIGN))
    assert done.stdout.strip() == f"msg= all={FOREIGN}", _explain(done)
    assert f"the command's messages are in {FOREIGN}" in done.stderr, _explain(done)
    # The way to English messages it names works whichever variable chose the locale.
    assert "with LC_MESSAGES=C and no LC_ALL" in done.stderr, _explain(done)
    # A failure that says nothing: no text egressbox failed to read, so no line about one
    # (refusals only with evidence: the exit status says the rest).
    silent = dev.egressbox(root, "--", "sh", "-c", "exit 3", env=dev.env(LC_ALL=FOREIGN))
    assert silent.returncode == 3, _explain(silent)
    assert "messages are in" not in silent.stderr, _explain(silent)


# -- widening is said, and what is said is true -------------------------------------------------


def test_an_alternates_object_store_is_readable_not_writable(dev: Dev) -> None:
    _needs(GIT, "git")
    origin = dev.project("origin")
    (origin / "f").write_text("origin\n", encoding="utf-8")
    dev.own_tree(origin)
    dev.git(origin, "add", "f")
    dev.git(origin, "commit", "-q", "-m", "one")
    clone = dev.base / "clone"
    dev.git(dev.base, "clone", "-q", "--shared", str(origin), str(clone))
    store = origin / ".git" / "objects"
    before = _listing(store)
    script = f"git log --oneline -1 && cat f && touch {store}/x; exit 0"
    done = dev.egressbox(clone, "--", "sh", "-c", script)
    assert "one" in done.stdout and "origin" in done.stdout, _explain(done)
    assert f"sandbox active; extra read root: {store} (git alternates of {clone})" in done.stderr
    assert _listing(store) == before
