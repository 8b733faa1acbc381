"""The example policies in policies/: they load cleanly and decide what they say."""

from __future__ import annotations

import importlib.util
import ipaddress
import subprocess
import sys
from pathlib import Path

import pytest

from egressbox.core.decide import SelfEndpoints
from egressbox.core.errors import Reason, Verdict
from egressbox.core.policy import Mode, Policy, load_policy
from egressbox.proxy.check import check
from fakes import FakeResolver, ip

POLICIES = Path(__file__).resolve().parent.parent / "policies"
EXAMPLES = sorted(POLICIES.glob("*.toml"))
EXPECTED = {
    "crates-io.toml",
    "deny-all.toml",
    "github.toml",
    "local-development.toml",
    "npm.toml",
    "pypi.toml",
}
METADATA = (
    ipaddress.ip_network("169.254.169.254/32"),
    ipaddress.ip_network("fd00:ec2::254/128"),
)
PUBLIC = ["151.101.0.223", "2a04:4e42::223"]


def load(name: str) -> Policy:
    return load_policy(str(POLICIES / name), env={})


def test_every_example_is_present() -> None:
    assert {path.name for path in EXAMPLES} >= EXPECTED


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_loads_cleanly(path: Path) -> None:
    policy = load_policy(str(path), env={})
    assert policy.mode is Mode.ENFORCE
    assert policy.deny_cidrs == METADATA
    assert policy.allow_private is False
    expected_warnings: tuple[str, ...] = ()
    if path.name == "deny-all.toml":
        expected_warnings = ("egress.allow is empty: every destination is denied",)
    assert policy.warnings == expected_warnings


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_has_a_header_comment(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith(f"# {path.name}: "), "the first line names the file and its use"
    header = [line for line in lines[: lines.index("[egress]")] if line.startswith("#")]
    assert len(header) >= 3, "the header explains what the policy admits and why"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted_by_the_check_command(path: Path) -> None:
    if importlib.util.find_spec("egressbox.cli") is None:
        pytest.skip("egressbox.cli is not available")
    done = subprocess.run(
        [sys.executable, "-m", "egressbox", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


# (policy, host, port, answer for the host or None, reason, queried)
CASES: list[tuple[str, str, int | str, list[str] | None, Reason, bool]] = [
    # every example: a stranger is denied without DNS
    *[(name, "evil.example", 443, PUBLIC, Reason.NO_ALLOW_RULE, False) for name in EXPECTED],
    *[(name, "8.8.8.8", 53, None, Reason.NO_ALLOW_RULE, False) for name in EXPECTED],
    ("deny-all.toml", "pypi.org", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("deny-all.toml", "localhost", 8000, ["127.0.0.1"], Reason.NO_ALLOW_RULE, False),
    ("pypi.toml", "pypi.org", 443, PUBLIC, Reason.ALLOWED, True),
    ("pypi.toml", "PyPI.org.", "443", PUBLIC, Reason.ALLOWED, True),
    ("pypi.toml", "files.pythonhosted.org", 443, PUBLIC, Reason.ALLOWED, True),
    ("pypi.toml", "pypi.org", 80, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("pypi.toml", "test.pypi.org", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("pypi.toml", "x.pythonhosted.org", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("pypi.toml", "pypi.org", 443, ["169.254.169.254"], Reason.DENY_CIDR, True),
    ("pypi.toml", "pypi.org", 443, ["64:ff9b::a9fe:a9fe"], Reason.DENY_CIDR, True),
    ("pypi.toml", "pypi.org", 443, ["fd00:ec2::254"], Reason.DENY_CIDR, True),
    ("pypi.toml", "pypi.org", 443, ["10.0.0.1"], Reason.PRIVATE_ADDRESS, True),
    ("pypi.toml", "pypi.org", 443, [PUBLIC[0], "127.0.0.1"], Reason.PRIVATE_ADDRESS, True),
    ("pypi.toml", "pypi.org", 443, None, Reason.DNS_FAILURE, True),
    ("npm.toml", "registry.npmjs.org", 443, PUBLIC, Reason.ALLOWED, True),
    ("npm.toml", "registry.npmjs.org", 80, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("npm.toml", "registry.yarnpkg.com", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("npm.toml", "npmjs.org", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("github.toml", "github.com", 443, PUBLIC, Reason.ALLOWED, True),
    ("github.toml", "github.com", 22, PUBLIC, Reason.ALLOWED, True),
    ("github.toml", "api.github.com", 443, PUBLIC, Reason.ALLOWED, True),
    ("github.toml", "codeload.github.com", 443, PUBLIC, Reason.ALLOWED, True),
    ("github.toml", "objects.githubusercontent.com", 443, PUBLIC, Reason.ALLOWED, True),
    ("github.toml", "raw.githubusercontent.com", 443, PUBLIC, Reason.ALLOWED, True),
    ("github.toml", "ssh.github.com", 443, PUBLIC, Reason.ALLOWED, True),
    ("github.toml", "api.github.com", 22, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("github.toml", "github.com", 80, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("github.toml", "gist.github.com", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("github.toml", "evil.githubusercontent.com", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("github.toml", "github.com", 22, ["169.254.169.254"], Reason.DENY_CIDR, True),
    ("crates-io.toml", "index.crates.io", 443, PUBLIC, Reason.ALLOWED, True),
    ("crates-io.toml", "static.crates.io", 443, PUBLIC, Reason.ALLOWED, True),
    ("crates-io.toml", "crates.io", 443, PUBLIC, Reason.ALLOWED, True),
    ("crates-io.toml", "crates.io", 80, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("crates-io.toml", "evil.crates.io", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
    ("local-development.toml", "localhost", 5432, ["127.0.0.1", "::1"], Reason.ALLOWED, True),
    ("local-development.toml", "127.0.0.1", 8000, None, Reason.ALLOWED, False),
    ("local-development.toml", "[::1]", 3000, None, Reason.ALLOWED, False),
    ("local-development.toml", "localhost", 5432, ["10.0.0.1"], Reason.PRIVATE_ADDRESS, True),
    ("local-development.toml", "localhost", 80, ["169.254.169.254"], Reason.DENY_CIDR, True),
    ("local-development.toml", "localhost", 80, ["::ffff:127.0.0.1"], Reason.SPECIAL_ADDRESS, True),
    ("local-development.toml", "127.0.0.2", 80, None, Reason.NO_ALLOW_RULE, False),
    ("local-development.toml", "192.168.1.1", 80, None, Reason.NO_ALLOW_RULE, False),
    ("local-development.toml", "pypi.org", 443, PUBLIC, Reason.NO_ALLOW_RULE, False),
]


@pytest.mark.parametrize(
    ("name", "host", "port", "answer", "reason", "queried"),
    CASES,
    ids=[f"{c[0]}-{c[1]}:{c[2]}-{c[4]}" for c in CASES],
)
async def test_example_decisions(
    name: str,
    host: str,
    port: int | str,
    answer: list[str] | None,
    reason: Reason,
    queried: bool,
) -> None:
    lookups = {} if answer is None else {parse_host(host): answer}
    resolver = FakeResolver(lookups)
    decision = await check(load(name), resolver, host, port)
    assert decision.reason is reason, decision.detail
    assert decision.verdict is (Verdict.ALLOW if reason is Reason.ALLOWED else Verdict.DENY)
    assert bool(resolver.queries) is queried
    if reason is Reason.ALLOWED:
        assert decision.addresses
        assert decision.rule is not None


def parse_host(host: str) -> str:
    return host.lower().rstrip(".")


async def test_local_development_still_denies_the_proxy_itself() -> None:
    listeners = SelfEndpoints(
        endpoints=frozenset({(ip("127.0.0.1"), 8080), (ip("127.0.0.1"), 1080)})
    )
    resolver = FakeResolver({"localhost": ["127.0.0.1", "::1"]})
    policy = load("local-development.toml")
    for host, port, reason in [
        ("localhost", 8080, Reason.SELF_CONNECTION),
        ("127.0.0.1", 1080, Reason.SELF_CONNECTION),
        ("127.0.0.1", 8080, Reason.SELF_CONNECTION),
        ("[::ffff:127.0.0.1]", 8080, Reason.NO_ALLOW_RULE),  # no entry admits this spelling
        ("localhost", 8081, Reason.ALLOWED),
        ("127.0.0.1", 1081, Reason.ALLOWED),
    ]:
        decision = await check(policy, resolver, host, port, self_endpoints=listeners)
        assert decision.reason is reason, (host, port, decision.detail)
