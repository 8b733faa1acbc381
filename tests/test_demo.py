"""README's first command, `scripts/demo`, does what it says on this checkout: one step
allowed, four refused as the policy says, and `demo OK` as its last line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_demo_runs_and_says_ok() -> None:
    if os.geteuid() != 0 and not Path("/proc/self/ns/net").exists():
        pytest.skip("no network namespaces to confine the demo's children in")
    env = {**os.environ, "EGRESSBOX_SKIP_SETUP": "1"}
    done = subprocess.run(
        [str(ROOT / "scripts" / "demo")],
        capture_output=True,
        text=True,
        env=env,
        timeout=100,
        check=False,
    )
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert last == "demo: 1 allowed, 4 refused as the policy says: demo OK"
