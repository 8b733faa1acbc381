"""`egressbox doctor`'s upstream line: whether pinning holds through the upstream that
`serve`/`run` would chain through (--upstream, or --policy's [egress] upstream)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from egressbox import cli


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["doctor", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_doctor_without_an_upstream(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _doctor(capsys)
    assert code == 0
    assert "upstream: none: egressbox dials the checked addresses itself (pinning: full)" in out
    code, out, _ = _doctor(capsys, "--json")
    assert json.loads(out)["upstream"]["pinning"] == "full"


def test_doctor_with_upstreams(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = _doctor(capsys, "--upstream", "http://proxy.example:3128")
    assert code == 0
    assert (
        "upstream: http://proxy.example:3128, asked for the checked address (pinning: full" in out
    )
    policy = tmp_path / "p.toml"
    policy.write_text(
        '[egress]\nallow = ["pypi.org"]\nupstream = "socks5://[::1]:1080"\n'
        'upstream_target = "name"\n'
    )
    code, out, _ = _doctor(capsys, "--policy", str(policy), "--json")
    found = json.loads(out)["upstream"]
    assert (found["url"], found["target"], found["pinning"]) == (
        "socks5://[::1]:1080",
        "name",
        "partial",
    )
    code, out, err = _doctor(capsys, "--upstream", "http://u:hunter2@proxy.example:1")
    assert code == 2 and "EGRESSBOX_UPSTREAM_USER" in err and "hunter2" not in err + out
