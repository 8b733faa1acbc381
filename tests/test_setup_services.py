"""scripts/setup installs the test packages without starting or enabling a service.

The install step (install_without_services) runs for real with a recording apt-get in place
of Debian's and its policy-rc.d at a path of the test's (POLICY_RC_D; the script's is
/usr/sbin/policy-rc.d): during the install it must answer 101 ("action forbidden") to
invoke-rc.d's question, and afterwards it must be gone again, or left untouched when the
host had one. Judged from the files, not from the script's output.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_APT_GET = """#!/bin/sh
# What invoke-rc.d does before starting a service: ask policy-rc.d.
if [ -x "$POLICY_RC_D" ]; then "$POLICY_RC_D" ssh start; echo "$?" >"$RECORD"
else echo none >"$RECORD"; fi
echo "$@" >>"$RECORD"
"""


def _function() -> str:
    text = (ROOT / "scripts" / "setup").read_text()
    found = re.search(r"^SERVICE_UNITS=.*?^}\n", text, re.S | re.M)
    assert found, "scripts/setup has no install_without_services"
    return found.group(0)


def test_the_install_runs_with_services_forbidden_and_leaves_nothing(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text(FAKE_APT_GET)
    apt.chmod(0o755)
    record = tmp_path / "record"
    script = 'as_root() { "$@"; }\n' + _function() + "install_without_services openssh-server\n"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "POLICY_RC_D": str(policy)}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answer, argv = record.read_text().splitlines()
    assert answer == "101"  # invoke-rc.d would start nothing
    assert "--no-install-recommends openssh-server" in argv
    assert not policy.exists()  # nothing left to stop later starts


def test_a_policy_rc_d_of_the_host_is_left_as_it_is(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 0\n")
    policy.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(FAKE_APT_GET)
    (bin_dir / "apt-get").chmod(0o755)
    record = tmp_path / "record"
    script = 'as_root() { "$@"; }\n' + _function() + "install_without_services squid\n"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), "POLICY_RC_D": str(policy)}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert record.read_text().splitlines()[0] == "0"  # the host's own answer
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"


def test_a_failed_install_leaves_no_policy_rc_d(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text("#!/bin/sh\nexit 100\n")
    apt.chmod(0o755)
    script = 'as_root() { "$@"; }\n' + _function() + "install_without_services haproxy\n"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "POLICY_RC_D": str(policy)},
        timeout=60,
        check=False,
    )
    assert done.returncode == 100
    assert not policy.exists()
