"""The cached host probe follows the process: keyed by what its answer depends on, and
believed only where it adds a mechanism (runner/facts.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from egressbox.confine import capture, grants, probe
from egressbox.confine.grants import HostFacts
from egressbox.runner import facts, own_state

CHILD_TIMEOUT = 60


@pytest.fixture(autouse=True)
def state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    place = tmp_path / "state"
    monkeypatch.setenv(own_state.STATE_ENV, str(place))
    return place


def _fresh() -> HostFacts:
    support = probe.probe_host()
    return facts._merged(HostFacts(frozenset(), {}, 0, os.geteuid()), support.mechanisms())


def _forge(key: dict[str, str], available: frozenset[str], abi: int = 0) -> HostFacts:
    status = {
        name: "available" if name in available else "cannot_attach" for name in facts.MECHANISMS
    }
    forged = HostFacts(available, status, abi, os.geteuid())
    facts._store_facts(forged, key)
    return forged


def test_the_lists_match_the_modules_they_mirror() -> None:
    assert facts.MECHANISMS == probe.MECHANISMS
    assert tuple(m.name for m in probe.probe_host().mechanisms()) == facts.MECHANISMS
    assert max(grants._MIN_ABI.values()) == facts.PLANNED_ABI
    from egressbox.confine.seccomp import _SONAMES

    assert set(facts.LIBRARIES) == {_SONAMES["seccomp"], capture.LIBRARY}


def test_a_cache_saying_nothing_is_available_takes_nothing_away() -> None:
    # A forged entry under the right key (what a child able to write the state would make):
    # every mechanism it calls missing is probed again, so the run loses nothing.
    key = facts.probe_key()
    assert key is not None
    _forge(key, frozenset())
    assert facts._load_facts(key) is not None  # it is read...
    got = facts.host_facts()  # ...and not believed where it takes away
    fresh = _fresh()
    assert got.available == fresh.available
    if {"pid_namespace", "landlock"} <= fresh.available:
        assert {"pid_namespace", "landlock"} <= got.available
    assert facts._load_facts(key) == got  # corrected in the cache too


def test_a_low_cached_landlock_abi_is_asked_again() -> None:
    key = facts.probe_key()
    assert key is not None
    _forge(key, frozenset(facts.MECHANISMS), abi=1)
    got = facts.host_facts()
    assert got.landlock_abi == (probe.probe_host().landlock.abi or 0)


def test_an_entry_under_another_key_is_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    key = facts.probe_key()
    assert key is not None
    other = key | {"Seccomp": "2", "Seccomp_filters": "1"}
    path = facts._facts_path(other)
    _forge(other, frozenset())
    assert facts._load_facts(key) is None
    # Even a name collision cannot mix them up: the full key is stored and compared.
    monkeypatch.setattr(facts, "_key_name", lambda _key: "same")
    _forge(other, frozenset())
    assert facts._load_facts(key) is None
    assert os.path.exists(path)


def test_a_library_installed_after_the_probe_is_seen_and_doctor_agrees(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The stale probe of a host without libnftables1: the key then had no such library, and
    # capture was absent. Installing the package changes where the library is found.
    loaded, why = capture.available()
    if not loaded:
        pytest.skip(f"capture is unavailable here: {why}")
    empty = tmp_path / "no-libraries"
    empty.mkdir()
    monkeypatch.setattr(facts, "LIBRARY_DIRS", (str(empty),))
    before = facts.probe_key()
    assert before is not None and before[capture.LIBRARY] == "-"
    everything = frozenset(facts.MECHANISMS) - {"capture"}
    _forge(before, everything, abi=facts.PLANNED_ABI)
    monkeypatch.undo()
    monkeypatch.setenv(own_state.STATE_ENV, str(tmp_path / "state"))
    now = facts.probe_key()
    assert now is not None and now != before and now[capture.LIBRARY] != "-"
    got = facts.host_facts()
    doctor = probe.to_json(probe.probe_host())["mechanisms"]
    assert got.status == {name: row["status"] for name, row in doctor.items()}
    assert ("capture" in got.available) == (doctor["capture"]["status"] == "available")


def test_a_cached_unavailable_capture_is_probed_again_even_under_the_same_key() -> None:
    key = facts.probe_key()
    assert key is not None
    _forge(key, frozenset(facts.MECHANISMS) - {"capture"}, abi=facts.PLANNED_ABI)
    got = facts.host_facts()
    assert got.status["capture"] == probe.probe_host().capture.status.value


def test_doctor_stores_what_it_probed_and_run_believes_it() -> None:
    support = probe.probe_host()
    facts.remember_probe(support)
    key = facts.probe_key()
    assert key is not None
    stored = facts._load_facts(key)
    assert stored is not None
    assert stored.status == {m.name: m.status.value for m in support.mechanisms()}
    assert facts.host_facts().status == stored.status


def test_forget_drops_the_entry_so_the_next_run_probes(state: Path) -> None:
    facts.host_facts()
    key = facts.probe_key()
    assert key is not None and facts._load_facts(key) is not None
    facts.forget_facts()
    assert facts._load_facts(key) is None


# A container's seccomp rules (Docker's default for an unprivileged container): unshare and
# clone with CLONE_NEWUSER refused. The child loads them, then asks host_facts() with the
# parent's state directory, where the parent's unfiltered probe says namespaces work.
FILTERED_CHILD = """
import errno, json, sys
import pyseccomp
f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
f.add_rule(pyseccomp.ERRNO(errno.EPERM), "unshare")
f.add_rule(pyseccomp.ERRNO(errno.EPERM), "clone",
           pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0x10000000, 0x10000000))
f.add_rule(pyseccomp.ERRNO(errno.EPERM), "setns")
f.load()
from egressbox.runner import facts
got = facts.host_facts()
print(json.dumps({"key": facts.probe_key(), "available": sorted(got.available)}))
"""


def test_a_process_under_a_seccomp_filter_does_not_believe_the_hosts_probe(state: Path) -> None:
    outside = facts.host_facts()
    if "user_namespace" not in outside.available:
        pytest.skip("user namespaces are unavailable here to begin with")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FILTERED_CHILD)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT,
        env={**os.environ, own_state.STATE_ENV: str(state)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    inside = json.loads(done.stdout.strip().splitlines()[-1])
    assert inside["key"]["Seccomp"] == "2"
    assert "user_namespace" not in inside["available"]
    # The host's own entry is still there and still the host's.
    key = facts.probe_key()
    assert key is not None and facts._load_facts(key) == outside
