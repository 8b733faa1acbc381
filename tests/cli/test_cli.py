"""The `egressbox` command: check, explain (with real DNS on loopback), doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import egressbox
from dnsserver import AAAA, A, DnsServer
from egressbox.cli import main

GOOD = """\
[egress]
allow = ["pypi.org:443", "*.example.test", "db.test:5432"]
deny = ["bad.example.test"]
deny_cidrs = ["169.254.169.254/32"]
"""

BAD = """\
[egress]
allow = ["*.com", "ok.test", 5]
allow_cidrs = ["10.0.0/8"]
mode = "reprt"
colour = "blue"
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_check_ok_prints_summary_and_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "good.toml", GOOD)
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    assert f"{path}: ok (3 allow, 1 deny, 0 allow_cidrs, 1 deny_cidrs; mode enforce)" in out
    assert "warning: egress.allow[1]" in out  # wildcard reaches the zone's DNS


def test_check_reports_every_problem_with_key_and_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "bad.toml", BAD)
    assert main(["check", path]) == 2
    out = capsys.readouterr().out
    assert f"{path}: 5 problems:" in out
    assert 'egress.allow[0]: "*.com" is too broad' in out
    assert "broad = true" in out
    assert "egress.allow[2]: must be a string or a table, got an integer" in out
    assert 'egress.allow_cidrs[0]: "10.0.0/8" is not a network; use "10.0.0.0/8"' in out
    assert 'egress.mode: must be "enforce" or "report"' in out
    assert "egress.colour: unknown key" in out


def test_check_several_files_fails_if_any_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write(tmp_path, "good.toml", GOOD)
    bad = write(tmp_path, "bad.toml", BAD)
    assert main(["check", good, bad]) == 2
    out = capsys.readouterr().out
    assert f"{good}: ok" in out and f"{bad}: 5 problems" in out


def test_check_toml_syntax_error_names_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "broken.toml", '[egress]\nallow = ["a"\n')
    assert main(["check", path]) == 2
    assert "not valid TOML" in capsys.readouterr().out


def test_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "nope.toml")]) == 2
    assert "cannot read the policy file" in capsys.readouterr().out


def explain_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["explain", "--json", *argv]) == 0
    result = json.loads(capsys.readouterr().out)
    assert isinstance(result, dict)
    return result


def test_explain_resolves_for_real(
    tmp_path: Path, dns_server: DnsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dns_server.set("a.example.test", A("93.184.216.34"), AAAA("2606:2800:220:1::1"))
    path = write(tmp_path, "p.toml", GOOD)
    ns = "{}:{}".format(*dns_server.nameserver)
    got = explain_json(capsys, "--policy", path, "--nameserver", ns, "a.example.test:8443")
    assert got["decision"] == "allow"
    assert got["reason"] == "allowed"
    assert got["rule"] == "*.example.test"
    addresses = got["addresses"]
    assert isinstance(addresses, list)
    assert set(addresses) == {"2606:2800:220:1::1", "93.184.216.34"}
    assert got["host"] == "a.example.test" and got["port"] == 8443


def test_explain_denies_private_answer(
    tmp_path: Path, dns_server: DnsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dns_server.set("db.test", A("10.1.2.3"))
    path = write(tmp_path, "p.toml", GOOD)
    ns = "{}:{}".format(*dns_server.nameserver)
    got = explain_json(capsys, "--policy", path, "--nameserver", ns, "db.test:5432")
    assert (got["decision"], got["reason"], got["addresses"]) == (
        "deny",
        "private_address",
        ["10.1.2.3"],
    )


METADATA_POLICY = """\
[egress]
allow = ["169.254.169.254:80", "imds.test", "100.64.0.0/10"]
allow_cidrs = ["169.254.0.0/16", "100.64.0.0/10"]
allow_private = true
"""


def test_check_warns_that_an_exact_metadata_entry_opens_credentials(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "meta.toml", METADATA_POLICY)
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    assert (
        '  warning: egress.allow[0]: "169.254.169.254:80" names instance metadata service of'
        " AWS, GCP, Azure, OCI..., a cloud metadata endpoint: it opens this instance's"
        " credentials to every client\n"
    ) in out


def test_explain_metadata_decisions(
    tmp_path: Path, dns_server: DnsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    dns_server.set("imds.test", A("169.254.169.254"))
    path = write(tmp_path, "meta.toml", METADATA_POLICY)
    ns = "{}:{}".format(*dns_server.nameserver)
    got = explain_json(capsys, "--policy", path, "--nameserver", ns, "imds.test:80")
    assert (got["decision"], got["reason"], got["addresses"]) == (
        "deny",
        "metadata_address",
        ["169.254.169.254"],
    )
    got = explain_json(capsys, "--policy", path, "100.100.100.200:80")
    assert (got["decision"], got["reason"], got["rule"]) == (
        "deny",
        "metadata_address",
        "100.64.0.0/10",
    )
    got = explain_json(capsys, "--policy", path, "169.254.169.254:80")
    assert (got["decision"], got["reason"]) == ("allow", "allowed")


def test_explain_no_allow_rule_makes_no_query(
    tmp_path: Path, dns_server: DnsServer, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "p.toml", GOOD)
    ns = "{}:{}".format(*dns_server.nameserver)
    got = explain_json(capsys, "--policy", path, "--nameserver", ns, "evil.test")
    assert (got["decision"], got["reason"], got["port"]) == ("deny", "no_allow_rule", 443)
    assert dns_server.queries == []


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("127.1:80", "bad_host"),
        ("0x7f.1", "bad_host"),
        ("user:secret@pypi.org:443", "bad_host"),
        ("pypi.org:99999", "bad_port"),
        ("pypi.org:+443", "bad_port"),
        ("[fe80::1%eth0]:80", "bad_host"),
        ("", "bad_host"),
    ],
)
def test_explain_malformed_targets_are_decisions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, reason: str
) -> None:
    path = write(tmp_path, "p.toml", GOOD)
    got = explain_json(capsys, "--policy", path, target)
    assert (got["decision"], got["reason"]) == ("deny", reason)
    assert "secret" not in json.dumps(got)


def test_explain_without_policy_denies_everything(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EGRESSBOX_ALLOW", raising=False)
    monkeypatch.delenv("EGRESSBOX_DENY", raising=False)
    got = explain_json(capsys, "pypi.org")
    assert (got["decision"], got["reason"]) == ("deny", "no_policy")


def test_explain_text_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "p.toml", GOOD)
    assert main(["explain", "--policy", path, "bad.example.test:443"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "deny  bad.example.test:443"
    assert out[1].split() == ["reason:", "deny_rule"]
    assert out[2].split() == ["rule:", "bad.example.test"]


def test_explain_bare_ipv6_and_bad_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "p.toml", GOOD)
    got = explain_json(capsys, "--policy", path, "::1")
    assert (got["host"], got["port"], got["reason"]) == ("::1", 443, "no_allow_rule")
    bad = write(tmp_path, "bad.toml", BAD)
    assert main(["explain", "--policy", bad, "pypi.org"]) == 2
    assert "5 problems" in capsys.readouterr().err


def test_explain_bad_nameserver_is_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "p.toml", GOOD)
    assert main(["explain", "--policy", path, "--nameserver", "dns.google", "pypi.org"]) == 2
    assert "--nameserver" in capsys.readouterr().err


def test_doctor_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    table = capsys.readouterr().out
    for name in ("landlock", "seccomp", "user_namespace", "network_namespace"):
        assert name in table
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["mechanisms"]) >= {"landlock", "seccomp", "network_namespace"}
    profiles = data["profiles"]
    assert list(profiles) == ["unrestricted", "worktree", "os_hardened"]
    for row in profiles.values():
        assert set(row) == {"enforced", "missing", "refuses", "network_boundary"}
        assert row["network_boundary"] in {"full", "partial", "none"}
    assert "connect_supervisor" in data["mechanisms"]
    # os_hardened either enforces everything it wants or names what it refuses.
    hardened = profiles["os_hardened"]
    assert bool(hardened["missing"]) == bool(hardened["refuses"])
    compiled = egressbox.compiled_core()
    assert data["proxy_core"].startswith("compiled" if compiled else "interpreted")


def test_doctor_says_how_the_core_runs_from_sources(capsys: pytest.CaptureFixture[str]) -> None:
    env = {**os.environ, egressbox.PURE_ENV: "1"}
    out = subprocess.run(
        [sys.executable, "-m", "egressbox", "doctor", "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    assert json.loads(out)["proxy_core"] == f"interpreted ({egressbox.PURE_ENV}=1)"


def test_module_entry_point_and_help() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "egressbox", "--help"], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0
    for command in ("check", "explain", "doctor"):
        assert command in run.stdout
    usage = subprocess.run(
        [sys.executable, "-m", "egressbox", "explain"], capture_output=True, text=True, check=False
    )
    assert usage.returncode == 2
    assert "HOST[:PORT]" in usage.stderr


SECRET = """\
[egress]
allow = ["api.example.test:443"]

[[secret]]
name = "API_TOKEN"
from_env = "API_TOKEN"
hosts = ["api.example.test:443"]
"""

RULE_ONLY = """\
[egress]
allow = ["api.example.test:443"]

[[request_rule]]
hosts = ["api.example.test:443"]
methods = ["GET"]
"""


def test_check_warns_that_serve_needs_a_ca_for_secrets_and_request_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """serve refuses to start on these without a CA (run makes its own): check says so in
    one warning line, and the policy is still valid (exit 0)."""
    for name, text in (("secret.toml", SECRET), ("rule.toml", RULE_ONLY)):
        path = write(tmp_path, name, text)
        assert main(["check", path]) == 0
        out = capsys.readouterr().out
        warned = [line for line in out.splitlines() if "serve needs a CA" in line]
        assert len(warned) == 1, out
        assert warned[0].startswith("  warning: ") and "[tls] ca_cert and ca_key" in warned[0]
        assert "--ca-cert and --ca-key" in warned[0]
    (tmp_path / "ca.pem").write_text("")
    (tmp_path / "ca.key").write_text("")
    tls = f'\n[tls]\nca_cert = "{tmp_path / "ca.pem"}"\nca_key = "{tmp_path / "ca.key"}"\n'
    with_ca = write(tmp_path, "with-ca.toml", SECRET + tls)
    assert main(["check", with_ca]) == 0
    assert "serve needs a CA" not in capsys.readouterr().out
    assert main(["check", write(tmp_path, "good.toml", GOOD)]) == 0
    assert "serve needs a CA" not in capsys.readouterr().out
