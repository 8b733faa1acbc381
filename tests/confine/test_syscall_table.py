"""The allow list's table (src/egressbox/confine/syscall_table.py) as data, and its measurement.

Every entry names a real call with a reason; what the tools measured by scripts/measure-syscalls
is allowed or sent to ENOSYS on purpose; the script still measures the same way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from egressbox.confine import seccomp, syscall_table

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "benchmarks" / "syscalls-measured.json"
SCRIPT = ROOT / "scripts" / "measure-syscalls"
# libseccomp's sign for a name it does not know at all (__NR_SCMP_ERROR).
NR_UNKNOWN = -1

TABLES = {
    "allowed": syscall_table.ALLOWED,
    "fallback": syscall_table.FALLBACK,
    "refused": syscall_table.REFUSED,
}


def _number(arch: str, name: str) -> int | None:
    pyseccomp = pytest.importorskip("pyseccomp")
    try:
        number = int(pyseccomp.resolve_syscall(getattr(pyseccomp.Arch, arch), name))
    except ValueError:
        number = NR_UNKNOWN
    if number == NR_UNKNOWN:
        return syscall_table.NEWER_NUMBERS.get(name)
    return number if number >= 0 else None


@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_entry_has_a_one_line_reason(table: str) -> None:
    for name, reason in TABLES[table].items():
        assert reason.strip() and "\n" not in reason, name
        assert name == name.strip().lower(), name


def test_the_tables_do_not_overlap() -> None:
    allowed, fallback, refused = (set(TABLES[name]) for name in ("allowed", "fallback", "refused"))
    assert not allowed & fallback
    assert not allowed & refused
    assert not fallback & refused
    assert allowed >= syscall_table.ARGUMENT_CHECKED


@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_entry_resolves_on_x86_64(table: str) -> None:
    missing = [name for name in TABLES[table] if _number("X86_64", name) is None]
    assert missing == []


def test_the_names_aarch64_lacks_are_the_ones_the_table_says() -> None:
    names = {name for table in TABLES.values() for name in table}
    absent = {name for name in names if _number("AARCH64", name) is None}
    assert absent == syscall_table.NOT_ON_AARCH64
    # Each missing name has a generic form in the list that does the same work.
    for old, new in [("open", "openat"), ("fork", "clone"), ("stat", "newfstatat")]:
        assert old in absent and new in syscall_table.ALLOWED


def test_newer_numbers_are_past_libseccomps_names() -> None:
    pyseccomp = pytest.importorskip("pyseccomp")
    for name, number in syscall_table.NEWER_NUMBERS.items():
        with pytest.raises(ValueError):
            pyseccomp.resolve_syscall(pyseccomp.Arch.X86_64, number)
        assert _number("X86_64", name) == number
    assert max(syscall_table.NEWER_NUMBERS.values()) < seccomp._SCAN_LIMIT


def test_the_measured_calls_are_all_allowed_or_fall_back() -> None:
    measured = json.loads(MEASURED.read_text())
    union = set(measured["union"])
    assert union, "the measurement is empty"
    assert union <= set(syscall_table.ALLOWED) | set(syscall_table.FALLBACK)
    # What the measurement saw and was sent to ENOSYS: only calls with a fallback in the list.
    assert union & set(syscall_table.FALLBACK) <= {"clone3", "io_uring_setup"}
    assert syscall_table.MEASURED.startswith(
        f"{len(union)} distinct calls from {len(measured['per_tool'])} tools"
    )


def test_the_measurement_script_still_measures(tmp_path: Path) -> None:
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    out = tmp_path / "measured.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--only", "shell", "curl"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode and "ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert {"execve", "openat", "read"} <= set(result["per_tool"]["shell"])
    assert set(result["union"]) <= set(syscall_table.ALLOWED) | set(syscall_table.FALLBACK)
