"""The system call allow list inside `egressbox run` (the launcher loads the cached program).

The report names the list and its measurement; a command gets EPERM for a call the table
knows and does not list, ENOSYS for io_uring and for a number no table has, and keeps the
argument rules; headless Chromium (when Debian's package is installed) renders a page. Each
runs as the invoking user and as an unprivileged one. Nothing leaves loopback.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap

import pytest

from dev_fixtures import Dev, _explain, dev
from egressbox.confine import syscall_table

__all__ = ["dev"]  # the fixture (tests/dev_fixtures.py), used by pytest by name

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.timeout(600),
]

REPORT_LINE = re.compile(r"^egressbox: enforcement: (\w+): (full|partial|none) \((.*)\)$")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Each probe is a raw syscall(2) by this machine's number, made by the confined command; it
# prints the errno name it got (or "ok"). Numbers come from libseccomp in the test process.
PROBE = textwrap.dedent(
    """
    import ctypes, errno, json, os, socket, sys
    libc = ctypes.CDLL(None, use_errno=True)
    def call(number, *args):
        result = libc.syscall(ctypes.c_long(number), *(ctypes.c_ulong(a) for a in args))
        return "ok" if result != -1 else errno.errorcode[ctypes.get_errno()]
    def sock(*args):
        try:
            socket.socket(*args).close()
            return "ok"
        except OSError as exc:
            return errno.errorcode[exc.errno]
    numbers = json.loads(sys.argv[1])
    print(json.dumps({
        "swapon": call(numbers["swapon"], 0, 0),
        "pivot_root": call(numbers["pivot_root"], 0, 0),
        "acct": call(numbers["acct"], 0),
        "io_uring_setup": call(numbers["io_uring_setup"], 1, 0),
        "made_up": call(1000),
        "unshare_newuser": call(numbers["unshare"], 0x10000000),
        "packet": sock(17, socket.SOCK_RAW, 0),
        "mptcp": sock(socket.AF_INET, socket.SOCK_STREAM, 262),
        "tcp": sock(socket.AF_INET, socket.SOCK_STREAM, 0),
        "unix": sock(socket.AF_UNIX, socket.SOCK_STREAM, 0),
    }))
    """
)


def _numbers() -> dict[str, int]:
    pyseccomp = pytest.importorskip("pyseccomp")
    names = ("swapon", "pivot_root", "acct", "io_uring_setup", "unshare")
    return {name: int(pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)) for name in names}


def test_the_report_names_the_allow_list_and_its_measurement(dev: Dev) -> None:
    root = dev.project("app", marker="")
    done = dev.egressbox(root, "--report", "--", "true")
    assert done.returncode == 0, _explain(done)
    rows = {
        match[1]: (match[2], match[3])
        for line in done.stderr.splitlines()
        if (match := REPORT_LINE.match(line))
    }
    state, detail = rows["seccomp"]
    assert state == "full", _explain(done)
    assert detail.startswith(f"allow list of {len(syscall_table.ALLOWED)} system calls"), detail
    assert f"(measured: {syscall_table.MEASURED})" in detail, detail


def test_unlisted_calls_and_argument_rules_hold_in_a_confined_command(dev: Dev) -> None:
    root = dev.project("app", marker="")
    numbers = json.dumps(_numbers())
    done = dev.egressbox(root, "--", dev.actor.python, "-c", PROBE, numbers)
    assert done.returncode == 0, _explain(done)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {
        "swapon": "EPERM",
        "pivot_root": "EPERM",
        "acct": "EPERM",
        "io_uring_setup": "ENOSYS",
        "made_up": "ENOSYS",
        "unshare_newuser": "EPERM",
        "packet": "EAFNOSUPPORT",
        "mptcp": "EPROTONOSUPPORT",
        "tcp": "ok",
        "unix": "ok",
    }


def test_headless_chromium_renders_a_page_under_the_allow_list(dev: Dev) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian's chromium package)")
    root = dev.project("site", marker="")
    page = root / "page.html"
    page.write_text("<html><body><p id=x>rendered-by-chromium</p></body></html>\n")
    dev.own_tree(root)
    # Chromium's own sandbox needs a user namespace, which the filter refuses (clone and
    # unshare with CLONE_NEWUSER): under egressbox it runs with --no-sandbox.
    # Its profile goes in the workspace: the home directory is not a write root.
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    profile = f"--user-data-dir={root / 'profile'}"
    done = dev.egressbox(root, "--", *command, profile, "--dump-dom", page.as_uri())
    assert done.returncode == 0, _explain(done)
    assert '<p id="x">rendered-by-chromium</p>' in done.stdout, _explain(done)
