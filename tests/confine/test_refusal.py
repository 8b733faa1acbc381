"""Refusal records from a command's error output (confine/refusal.py): scanning, path
extraction, judging against a plan, and the one-line summary. Pure: the host's
filesystem is a dictionary here."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressbox.confine.refusal import (
    TAIL_BYTES,
    Boundary,
    HostPath,
    PathPlan,
    RefusalRecord,
    classify_output,
    error_lines,
    extract_paths,
)

HOME = "/home/alice"
WORK = "/home/alice/project"
PLAN = PathPlan(
    homes=(HOME,),
    read=("/usr", "/etc", "/proc", f"{HOME}/.pyenv", "/srv/granted"),
    write=(WORK, "/tmp", "/var/tmp", "/dev", "/tmp/ws"),
    deny=(f"{HOME}/.ssh", f"{HOME}/.aws", f"{HOME}/.netrc"),
    read_only=(f"{WORK}/vendor",),
    always_read_only=("/proc/sys", "/sys"),
    hidden=("/tmp", "/var/tmp", "/run", "/dev/shm"),
    bound_back=(("/tmp/ws", True), ("/tmp/ro", False)),
    landlock_fs=True,
    abstract_isolated=True,
)
FILE = HostPath(True, parent_exists=True)
DIR = HostPath(True, is_dir=True, parent_exists=True)
SOCKET = HostPath(True, is_socket=True, parent_exists=True)
NEW = HostPath(False, parent_exists=True)  # absent, but its directory exists
HOST: dict[str, HostPath] = {
    f"{HOME}/.ssh/id_rsa": FILE,
    f"{HOME}/.aws/credentials": FILE,
    f"{HOME}/.bashrc": FILE,
    f"{HOME}/notes": DIR,
    "/etc/hosts": FILE,
    "/etc/shadow": HostPath(True, parent_exists=True, readable=False),
    "/run/docker.sock": SOCKET,
    "/tmp/ws/app.sock": SOCKET,
    "/tmp/host-only/data.txt": FILE,
    "/tmp/ro/file": FILE,
    f"{WORK}/vendor/lib.py": FILE,
    f"{WORK}/src": DIR,
    "/srv/private/data": FILE,
    "/proc/sys/kernel/core_pattern": FILE,
}


def lookup(path: str) -> HostPath:
    if path in HOST:
        return HOST[path]
    parent = path.rsplit("/", 1)[0] or "/"
    known_dirs = {"/", "/etc", "/tmp/ws", "/tmp/ro", WORK, HOME, "/srv", "/root", "/tmp/host-only"}
    return HostPath(False, parent_exists=parent in known_dirs or parent in HOST)


# The plan with a mount namespace: nothing of the host exists in the child but the grants.
ROOTED = replace(PLAN, hidden=("/",))


def classify(text: str, plan: PathPlan = PLAN) -> RefusalRecord | None:
    return classify_output(text, plan, lookup)


# -- scanning and extraction ------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "errno", "paths", "writes"),
    [
        ("cat: /etc/x: Permission denied", "EACCES", ("/etc/x",), False),
        ("touch: cannot touch '/etc/x': Permission denied", "EACCES", ("/etc/x",), True),
        (
            "PermissionError: [Errno 13] Permission denied: '/x/y'",
            "EACCES",
            ("/x/y",),
            False,
        ),
        ("OSError: [Errno 30] Read-only file system: '/a b/c'", "EROFS", ("/a b/c",), False),
        ("open /etc/x: permission denied", "EACCES", ("/etc/x",), False),  # Go
        (
            "Error: EACCES: permission denied, open '/usr/lib/node_modules/x'",  # Node
            "EACCES",
            ("/usr/lib/node_modules/x",),
            False,
        ),
        (
            "mkdir: cannot create directory \u2018/srv/x\u2019: Permission denied",
            "EACCES",
            ("/srv/x",),
            True,
        ),
        (
            'Load key "~/.ssh/id_ed25519": Permission denied',
            "EACCES",
            ("~/.ssh/id_ed25519",),
            False,
        ),
        (
            "error: could not lock config file /root/.gitconfig: Operation not permitted",
            "EPERM",
            ("/root/.gitconfig",),
            True,
        ),
        ("nc: /run/x.sock: No such file or directory", "ENOENT", ("/run/x.sock",), False),
        (
            'socat E connect(5, AF=1 "/run/a.sock", 13): Connection refused',
            "ECONNREFUSED",
            ("/run/a.sock",),
            False,
        ),
        (
            "ConnectionRefusedError: [Errno 111] Connection refused: '\\x00abstract'",
            "ECONNREFUSED",
            ("@abstract",),
            False,
        ),
        ("mv: cannot move '/a/b' to '/c/d': Permission denied", "EACCES", ("/a/b", "/c/d"), True),
        ("\x1b[31merror\x1b[0m: /etc/x: Permission denied", "EACCES", ("/etc/x",), False),
        ("Permission denied (os error 13): /var/lib/x", "EACCES", ("/var/lib/x",), False),
    ],
)
def test_error_lines_find_errno_paths_and_writes(
    line: str, errno: str, paths: tuple[str, ...], writes: bool
) -> None:
    found = error_lines(f"noise before\n{line}\nnoise after /etc/passwd\n")
    assert len(found) == 1
    assert found[0].errno == errno
    assert found[0].paths == paths
    assert found[0].writes is writes


@pytest.mark.parametrize(
    "line",
    [
        "git@github.com: Permission denied (publickey).",  # authentication, no path
        "fatal: Could not read from remote repository.",
        "curl: (7) Failed to connect to example.com port 443: Connection refused",
        "see https://example.com/docs/permission: Permission denied",  # a URL is no path
        "Permission denied",
        "open x.txt: permission denied",  # relative: the cwd is unknown here
    ],
)
def test_lines_without_a_path_are_not_evidence(line: str) -> None:
    assert error_lines(line) == []


def test_carriage_returns_split_lines() -> None:
    found = error_lines("progress 10%\rcat: /etc/x: Permission denied\r\n")
    assert [f.paths for f in found] == [("/etc/x",)]


def test_bare_paths_lose_trailing_punctuation() -> None:
    assert extract_paths("cannot open /etc/x.conf: Permission denied.") == ("/etc/x.conf",)
    assert extract_paths("(/var/lib/x) Permission denied") == ("/var/lib/x",)


# -- judging against the plan -----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "boundary", "path"),
    [
        # the credential deny list: any errno, as long as the file is really there
        (f"cat: {HOME}/.ssh/id_rsa: Permission denied", "home_read", f"{HOME}/.ssh/id_rsa"),
        (f"cat: {HOME}/.ssh/id_rsa: No such file or directory", "home_read", f"{HOME}/.ssh/id_rsa"),
        (
            'Load key "~/.aws/credentials": Permission denied',
            "home_read",
            f"{HOME}/.aws/credentials",
        ),
        # the home directory outside the read roots
        (f"cat: {HOME}/.bashrc: Permission denied", "home_read", f"{HOME}/.bashrc"),
        (
            f"ls: cannot open directory '{HOME}/notes': Permission denied",
            "home_read",
            f"{HOME}/notes",
        ),
        # writes outside the write roots
        ("touch: cannot touch '/etc/egressbox-x': Permission denied", "write", "/etc/egressbox-x"),
        ("PermissionError: [Errno 13] Permission denied: '/etc/new'", "write", "/etc/new"),
        ("PermissionError: [Errno 13] Permission denied: '/etc/hosts'", "write", "/etc/hosts"),
        (f"touch: cannot touch '{HOME}/x': Permission denied", "write", f"{HOME}/x"),
        (
            f"OSError: [Errno 30] Read-only file system: '{WORK}/vendor/lib.py'",
            "write",
            f"{WORK}/vendor/lib.py",
        ),
        ("touch: cannot touch '/tmp/ro/file': Read-only file system", "write", "/tmp/ro/file"),
        (
            "sh: 1: cannot create /proc/sys/kernel/core_pattern: Read-only file system",
            "write",
            "/proc/sys/kernel/core_pattern",
        ),
        (
            "touch: cannot touch '/tmp/host-only/new': No such file or directory",
            "write",
            "/tmp/host-only/new",
        ),
        # host unix sockets hidden by the mount namespace; abstract names
        ("nc: /run/docker.sock: No such file or directory", "local_socket", "/run/docker.sock"),
        ("connect '/run/docker.sock': Connection refused", "local_socket", "/run/docker.sock"),
        (
            "ConnectionRefusedError: [Errno 111] Connection refused: '\\x00dbus'",
            "local_socket",
            "@dbus",
        ),
    ],
)
def test_refused_paths_name_their_boundary(text: str, boundary: str, path: str) -> None:
    record = classify(text)
    assert record is not None
    assert record.boundary == boundary
    assert record.paths == (path,)
    assert record.source == "from the command's error output"
    assert record.evidence == (text,)


@pytest.mark.parametrize(
    "text",
    [
        f"ls: cannot access '{WORK}/nonexistent': No such file or directory",  # granted, missing
        f"cat: {WORK}/src: Permission denied",  # granted: the command's own business
        "cat: /etc/shadow: Permission denied",  # the host's own permissions refuse it
        "cat: /etc/missing: No such file or directory",
        f"cat: {HOME}/.ssh/missing_key: No such file or directory",  # denied, but absent
        "nc: /tmp/ws/app.sock: Connection refused",  # a granted socket: the server is down
        "touch: cannot touch '/tmp/ws/new': Permission denied",  # writable root
        "cat: /nonexistent/dir/file: Permission denied",  # neither it nor its directory exist
        "something: /tmp/scratch.txt: No such file or directory",  # the child's own /tmp
    ],
)
def test_granted_or_absent_paths_are_not_blamed(text: str) -> None:
    assert classify(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "cat: /nonexistent.txt: No such file or directory",
        "FileNotFoundError: [Errno 2] No such file or directory: '/nothere'",
        "ls: cannot access '/srv/nothere': No such file or directory",
        "sh: 1: nosuchcmd: not found",
        "sh: 1: /opt/missing-tool: not found",
        "FAILED tests/test_x.py::test_y - AssertionError: assert 1 == 2",
    ],
)
def test_a_path_the_host_lacks_too_is_not_found_not_a_boundary(text: str) -> None:
    record = classify(text, ROOTED)
    if record is not None:  # its directory exists on the host only: said as not found
        assert record.boundary == "unknown", record
        assert record.line(1).startswith("command exited 1; not found: "), record.line(1)
        assert "if the command was creating it, --write-root /srv admits it" in record.hint


@pytest.mark.parametrize(
    ("text", "path", "hint"),
    [
        # a program the host has, outside every root: the shell cannot find it
        (
            "sh: 1: /srv/private/data: not found",
            "/srv/private/data",
            "--read-root /srv/private/data",
        ),
        # an existing file: exactly that file
        (
            "touch: cannot touch '/etc/hosts': Permission denied",
            "/etc/hosts",
            "--write-root /etc/hosts",
        ),
        # a new file: its directory
        (
            "touch: cannot touch '/etc/new': Permission denied",
            "/etc/new",
            "--write-root /etc admits",
        ),
        # a new file directly in / or in the home directory: no grant suggested
        ("touch: cannot touch '/newfile': Permission denied", "/newfile", "no grant is suggested"),
        (
            f"touch: cannot touch '{HOME}/x': Permission denied",
            f"{HOME}/x",
            "no grant is suggested",
        ),
    ],
)
def test_hints_admit_exactly_the_path_never_root_or_home(text: str, path: str, hint: str) -> None:
    record = classify(text, ROOTED)
    assert record is not None and record.paths == (path,), record
    assert hint in record.hint, record.hint
    assert "--write-root / " not in record.hint and f"--write-root {HOME} " not in record.hint
    assert "--read-root / " not in record.hint and "--read-root /home " not in record.hint


def test_a_namespace_refused_under_seccomp_is_seccomp() -> None:
    from egressbox.confine.refusal import classify_namespace

    text = "unshare: unshare failed: Operation not permitted\n"
    record = classify_namespace(text, PathPlan(seccomp=True))
    assert record is not None and record.boundary == "seccomp"
    assert record.evidence == ("unshare: unshare failed: Operation not permitted",)
    assert classify_namespace(text, PathPlan(seccomp=False)) is None
    assert classify_namespace("touch: /x: Operation not permitted", PathPlan(seccomp=True)) is None


def test_python_file_not_found_is_no_failed_lookup() -> None:
    from egressbox.confine.refusal import classify_direct

    text = "FileNotFoundError: [Errno 2] No such file or directory: '/nothere'"
    assert classify_direct(text, "127.0.0.1:1") is None
    assert classify_direct("Error: getaddrinfo ENOTFOUND pypi.org", "127.0.0.1:1") is not None


def test_read_refused_outside_home_is_read_with_a_hint_for_that_path() -> None:
    record = classify("cat: /srv/private/data: Permission denied")
    assert record is not None
    assert record.boundary == "read"
    assert record.paths == ("/srv/private/data",)
    assert record.hint.endswith("--read-root /srv/private/data admits it")


def test_without_landlock_or_mounts_nothing_on_the_filesystem_is_blamed() -> None:
    open_plan = PathPlan(homes=(HOME,), abstract_isolated=True)
    for text in (
        "touch: cannot touch '/etc/egressbox-x': Permission denied",
        f"cat: {HOME}/.bashrc: Permission denied",
        "nc: /run/docker.sock: Connection refused",
    ):
        assert classify(text, open_plan) is None, text
    record = classify("Connection refused: '@bus'", open_plan)
    assert record is not None and record.boundary == "local_socket"


def test_the_last_refusal_decides_and_its_paths_are_gathered() -> None:
    text = "\n".join(
        [
            "touch: cannot touch '/etc/a': Permission denied",
            f"cat: {HOME}/.ssh/id_rsa: Permission denied",
            "touch: cannot touch '/etc/b': Permission denied",
            "touch: cannot touch '/etc/a': Permission denied",
        ]
    )
    record = classify(text)
    assert record is not None
    assert record.boundary == "write"
    assert record.paths == ("/etc/a", "/etc/b")


def test_a_named_boundary_beats_an_unknown_read() -> None:
    text = f"cat: {HOME}/.bashrc: Permission denied\ncat: /srv/private/data: Permission denied\n"
    record = classify(text)
    assert record is not None and record.boundary == "home_read"


def test_only_the_tail_is_scanned() -> None:
    early = "touch: cannot touch '/etc/early': Permission denied\n"
    assert classify(early + "x" * TAIL_BYTES) is None


def test_each_path_is_looked_up_once() -> None:
    calls: list[str] = []

    def counting(path: str) -> HostPath:
        calls.append(path)
        return lookup(path)

    text = "touch: cannot touch '/etc/a': Permission denied\n" * 50
    classify_output(text, PLAN, counting)
    assert calls == ["/etc/a"]


# -- the one line -----------------------------------------------------------------------


def test_line_keeps_the_egress_unknown_and_timeout_forms() -> None:
    egress = RefusalRecord(Boundary.EGRESS, ("a.test:443 (no_allow_rule)",))
    assert egress.line(22) == "command exited 22; refused by egress: a.test:443 (no_allow_rule)"
    # Never "refused by" without evidence.
    unknown = RefusalRecord(Boundary.UNKNOWN).line(3)
    assert unknown == "command exited 3; egressbox cannot tell whether a boundary refused it"
    timeout = RefusalRecord(Boundary.TIMEOUT, timeout=1.5)
    assert timeout.line(124) == "command exited 124; the timeout of 1.5 s expired"


def test_line_names_boundary_path_source_and_hint() -> None:
    record = classify("touch: cannot touch '/etc/egressbox-x': Permission denied")
    assert record is not None
    assert record.line(1) == (
        "command exited 1; refused by write: /etc/egressbox-x "
        "(from the command's error output; --write-root /etc admits it)"
    )
    denied = classify(f"cat: {HOME}/.ssh/id_rsa: Permission denied")
    assert denied is not None
    assert "the deny list always wins" in denied.line(1)


def test_line_shortens_many_paths() -> None:
    record = RefusalRecord(Boundary.WRITE, paths=tuple(f"/etc/{n}" for n in "abcde"))
    assert record.line(1).endswith("refused by write: /etc/a, /etc/b, /etc/c and 2 more")


# -- robustness ---------------------------------------------------------------------------


def _any_host(path: str) -> HostPath:
    # Deterministic but varied answers from the path's characters.
    code = sum(map(ord, path))
    return HostPath(bool(code & 1), bool(code & 2), bool(code & 4), bool(code & 8), bool(code & 16))


FRAGMENTS = st.sampled_from(
    [
        "Permission denied",
        "permission denied",
        "EACCES",
        "Read-only file system",
        "No such file or directory",
        "Connection refused",
        "Operation not permitted",
        "'",
        '"',
        "`",
        "\u2018",
        "\u2019",
        ":",
        "/",
        "~/",
        "~",
        "@",
        "\\x00",
        "\x00",
        "\x1b[",
        "\x1b]",
        "\r",
        "\n",
        "/etc/x",
        "/home/alice/.ssh/id_rsa",
        "/run/docker.sock",
        "touch",
        " ",
        "..",
        "//",
    ]
)
TEXTS = st.one_of(st.text(), st.lists(st.one_of(FRAGMENTS, st.text(max_size=5))).map("".join))


@settings(max_examples=400, deadline=None)
@given(TEXTS)
def test_random_text_never_raises(text: str) -> None:
    for line in error_lines(text):
        assert line.errno in {"EACCES", "EROFS", "EPERM", "ENOENT", "ECONNREFUSED"}
        assert line.paths or line.relative
    record = classify_output(text, PLAN, _any_host)
    if record is not None:
        assert record.boundary in {
            "local_socket",
            "home_read",
            "read",
            "write",
            "toolchain_cache",
            "unknown",
        }
        assert record.paths
        record.line(1)


@given(st.binary(max_size=2048))
def test_random_bytes_never_raise(data: bytes) -> None:
    classify_output(data.decode("utf-8", "replace"), PLAN, _any_host)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "curl: (7) Failed to connect to 1.2.3.4 port 80: Couldn't connect to server\n",
            "direct connection refused",
        ),
        ("curl: (6) Could not resolve host: example.com\n", "no name resolution inside run"),
        (
            "socket.gaierror: [Errno -3] Temporary failure in name resolution\n",
            "no name resolution inside run",
        ),
        (
            "    sock.connect(sa)\nPermissionError: [Errno 13] Permission denied\n",
            "direct connection refused",
        ),
        ("Error: connect ECONNREFUSED 10.0.0.1:443\n", "direct connection refused"),
    ],
)
def test_a_connection_made_without_the_proxy_names_the_proxy(text: str, expected: str) -> None:
    from egressbox.confine.refusal import classify_direct

    record = classify_direct(text, "127.0.0.1:1 (HTTP) and :2 (SOCKS5)")
    assert record is not None and record.boundary == "egress"
    assert expected in record.hint and "127.0.0.1:1" in record.hint


def test_a_file_permission_error_is_no_direct_connection() -> None:
    from egressbox.confine.refusal import classify_direct

    assert classify_direct("cat: /etc/x: Permission denied\n", "p") is None
    assert classify_direct("all good\n", "p") is None


# -- toolchain caches, relative paths, a read-only workspace --------------------------------


def _cache_plan(env: dict[str, str]) -> PathPlan:
    import dataclasses

    from egressbox.confine.toolchains import CacheMode, plan_caches

    caches = plan_caches(env, home=HOME, scratch=f"{WORK}/.egressbox/cache", mode=CacheMode.SCRATCH)
    return dataclasses.replace(PLAN, caches=caches.roots, cwd=f"{WORK}/src")


def test_a_refused_cache_the_caller_set_is_a_toolchain_gap() -> None:
    plan = _cache_plan({"GOMODCACHE": "/srv/gomod"})
    text = "go: could not create module cache: mkdir /srv/gomod: permission denied\n"
    record = classify_output(text, plan, lambda p: HostPath(False, parent_exists=True))
    assert record is not None and record.boundary == Boundary.TOOLCHAIN_CACHE
    assert record.variable == "GOMODCACHE" and record.paths == ("/srv/gomod",)
    assert "--process-write-root /srv/gomod" in record.hint
    assert "refused by toolchain_cache: /srv/gomod" in record.line(1)


def test_a_tools_default_cache_under_home_is_a_toolchain_gap() -> None:
    plan = _cache_plan({})
    text = "npm error Error: EACCES: permission denied, mkdir '/home/alice/.npm/_cacache'\n"
    record = classify_output(text, plan, lambda p: HostPath(False, parent_exists=True))
    assert record is not None and record.boundary == Boundary.TOOLCHAIN_CACHE
    assert record.variable == "npm_config_cache"
    assert "--toolchain-cache real" in record.hint


def test_a_credential_under_a_cache_stays_a_credential() -> None:
    import dataclasses

    plan = dataclasses.replace(_cache_plan({}), deny=(*PLAN.deny, f"{HOME}/.cache/hf/token"))
    text = f"cat: {HOME}/.cache/hf/token: Permission denied\n"
    record = classify_output(text, plan, lambda p: FILE)
    assert record is not None and record.boundary == Boundary.HOME_READ


def test_a_quoted_relative_path_is_judged_from_the_working_directory() -> None:
    import dataclasses

    plan = dataclasses.replace(PLAN, cwd=f"{WORK}/src", read_only_workspaces=(WORK,), write=())
    text = "touch: cannot touch '../out/x': Read-only file system\n"
    record = classify_output(text, plan, lambda p: NEW)
    assert record is not None and record.boundary == Boundary.WRITE
    assert record.paths == (f"{WORK}/out/x",)
    assert "the workspace is read-only (--read-only-workspace)" in record.hint
    # Without a working directory, a relative path names nothing.
    assert classify_output(text, PLAN, lambda p: NEW) is None


def test_relative_paths_are_words_not_options_or_urls() -> None:
    from egressbox.confine.refusal import relative_paths

    line = "x: 'a/b' '-f' 'http://h/x' 'EACCES' 'two words' 'c': Permission denied"
    assert relative_paths(line) == ("a/b", "c")


# -- requirement and selector_honored ----------------------------------------------------------


@pytest.mark.parametrize(
    ("boundary", "profile", "requirement", "honored"),
    [
        ("write", "os_hardened", "profile", False),
        ("write", "worktree", "fallback", True),
        ("write", "workspace_paths", "fallback", False),
        ("egress", "workspace_paths", "profile", False),
        ("egress", "worktree", "profile", True),
        ("unknown", "os_hardened", "", False),
        ("timeout", "worktree", "", True),
    ],
)
def test_requirement_and_selector(
    boundary: str, profile: str, requirement: str, honored: bool
) -> None:
    from egressbox.confine.refusal import with_requirement

    record = with_requirement(RefusalRecord(boundary), profile)
    assert (record.requirement, record.selector_honored) == (requirement, honored)


def test_a_mechanism_refusal_carries_requirement_and_selector() -> None:
    from egressbox.confine.grants import Mechanism, Profile, Refusal

    hard = Refusal(Mechanism.SECCOMP, "absent_on_host", Profile.OS_HARDENED, "x")
    assert (hard.requirement, hard.selector_honored) == ("profile", False)
    assert "EGRESSBOX_SANDBOX cannot lift that" in hard.message()
    soft = Refusal(
        Mechanism.SECCOMP,
        "absent_on_host",
        Profile.WORKTREE,
        "x",
        requirement="fallback",
        selector_honored=True,
    )
    assert "EGRESSBOX_SANDBOX=enforce" in soft.message()


# -- seccomp: killed by SIGSYS ----------------------------------------------------------------

KILL = (
    "audit: type=1326 audit(1796170362.332:13): auid=4294967295 uid=0 gid=0 ses=4294967295 "
    'pid=17661 comm="python 3" exe="/usr/bin/python3.11" sig=31 arch=40000003 syscall=20 '
    "compat=1 ip=0x7f9f4c6af007 code=0x80000000"
)


def test_a_kernel_kill_record_is_read() -> None:
    from egressbox.confine.refusal import seccomp_kills

    (kill,) = seccomp_kills(["noise", KILL], since=1796170362.0, uid=0)
    assert (kill.pid, kill.comm, kill.arch, kill.syscall) == (17661, "python 3", "40000003", 20)
    assert kill.exe == "/usr/bin/python3.11"
    assert seccomp_kills([KILL], since=1796170363.0, uid=0) == []  # before the run
    assert seccomp_kills([KILL], since=0, uid=1000) == []  # another user's process
    errno_action = KILL.replace("sig=31", "sig=0")
    assert seccomp_kills([errno_action], since=0, uid=0) == []


def test_a_seccomp_record_names_the_call_or_says_why_not() -> None:
    from egressbox.confine.refusal import SOURCE_STATUS, seccomp_kills, seccomp_record

    kills = seccomp_kills([KILL], since=0, uid=0)
    record = seccomp_record(kills, lambda k: f"getpid (x86 system call {k.syscall})")
    assert record.boundary == Boundary.SECCOMP
    assert record.system_call == "getpid (x86 system call 20)"
    assert "refused by seccomp: getpid (x86 system call 20)" in record.line(159)
    assert "non-native ABI" in record.hint
    blind = seccomp_record([], str)
    assert blind.boundary == Boundary.SECCOMP and blind.source == SOURCE_STATUS
    assert "refused by seccomp (from the exit status" in blind.line(159)
