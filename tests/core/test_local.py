"""Local destinations: the one-address grants core/local.py names, the policy's check
warnings for an entry that cannot work without one, and EGRESSBOX_ALLOW_CIDRS."""

from __future__ import annotations

import ipaddress
import tomllib

import pytest

from egressbox.confine.grants import CAPTURE_HOSTS
from egressbox.core.errors import PolicyError
from egressbox.core.local import LOOPBACK_ADDRESSES, LOOPBACK_NAME, grants_needed
from egressbox.core.policy import ENV_ALLOW_CIDRS, parse_policy
from egressbox.proxy.approval import Answer, Approved, approved_policy


def test_the_loopback_addresses_are_the_sandbox_hosts_files() -> None:
    # The captured-connection judgement maps these to `localhost` because the child's
    # /etc/hosts does: the two must agree.
    named = {
        ipaddress.ip_address(line.split()[0])
        for line in CAPTURE_HOSTS.splitlines()
        if LOOPBACK_NAME in line.split()[1:]
    }
    assert named == set(LOOPBACK_ADDRESSES)


@pytest.mark.parametrize(
    ("host", "networks"),
    [
        ("localhost", ["127.0.0.1/32", "::1/128"]),
        ("registry.localhost", ["127.0.0.1/32", "::1/128"]),
        ("127.0.0.1", ["127.0.0.1/32"]),
        ("127.0.0.9", ["127.0.0.9/32"]),
        ("::1", ["::1/128"]),
        ("10.1.2.3", ["10.1.2.3/32"]),
        ("192.168.0.7", ["192.168.0.7/32"]),
        ("fd00::5", ["fd00::5/128"]),
        ("169.254.3.4", ["169.254.3.4/32"]),
        # Never granted this way: public, special, metadata, names not local by definition.
        ("93.184.216.34", []),
        ("192.0.2.1", []),
        ("169.254.169.254", []),
        ("fd00:ec2::254", []),
        ("::ffff:127.0.0.1", []),
        ("notlocalhost", []),
        ("localhost.example.com", []),
        ("registry.internal", []),
    ],
)
def test_grants_needed(host: str, networks: list[str]) -> None:
    assert [str(g.network) for g in grants_needed(host, 5000)] == networks
    assert all(g.why for g in grants_needed(host, 5000))


def _warnings(text: str, env: dict[str, str] | None = None) -> tuple[str, ...]:
    return parse_policy(tomllib.loads(text), env=env or {}).warnings


@pytest.mark.parametrize(
    ("cidrs", "warned"),
    [
        ("[]", ['"127.0.0.1/32", "::1/128"']),
        ('["127.0.0.1/32"]', ['"::1/128"']),
        ('["127.0.0.0/8", "::1/128"]', []),
    ],
)
def test_check_warns_for_localhost_without_its_grant(cidrs: str, warned: list[str]) -> None:
    found = [
        w
        for w in _warnings(f'[egress]\nallow = ["localhost:5000"]\nallow_cidrs = {cidrs}\n')
        if "localhost:5000" in w
    ]
    assert len(found) == len(warned)
    for text, wanted in zip(found, warned, strict=True):
        assert text.startswith('egress.allow[0]: "localhost:5000" resolves to')
        assert wanted in text and "egress.allow_cidrs" in text


@pytest.mark.parametrize("entry", ["127.0.0.1:8080", "10.0.0.5:5432", "[::1]:8080"])
def test_check_warns_for_a_local_ip_literal_without_its_grant(entry: str) -> None:
    assert any(
        "stays denied unless egress.allow_cidrs covers it" in w
        for w in _warnings(f'[egress]\nallow = ["{entry}"]\n')
    )


def test_check_is_quiet_for_public_names_and_granted_literals() -> None:
    text = '[egress]\nallow = ["pypi.org:443", "10.0.0.5:5432"]\nallow_cidrs = ["10.0.0.5"]\n'
    assert _warnings(text) == ()


def test_env_allow_cidrs_appends_validated_networks() -> None:
    env = {ENV_ALLOW_CIDRS: " 127.0.0.1 , ::1/128,,10.0.0.0/24"}
    policy = parse_policy({"egress": {"allow": ["localhost:5000"]}}, env=env)
    assert [str(n) for n in policy.allow_cidrs] == ["127.0.0.1/32", "::1/128", "10.0.0.0/24"]
    assert policy.warnings == ()  # the grant the warning asks for came from the environment
    with pytest.raises(PolicyError) as raised:
        parse_policy({}, env={ENV_ALLOW_CIDRS: "0.0.0.0/0,bogus,10.0.0/8"})
    problems = str(raised.value)
    for index in range(3):
        assert f"{ENV_ALLOW_CIDRS}[{index}]" in problems
    assert "too broad" in problems and "not an IP address" in problems


def test_save_approved_writes_the_grants_local_entries_need() -> None:
    approved = [
        Approved("localhost", 5000, Answer.SESSION),
        Approved("10.0.0.5", 5432, Answer.ONCE),
        Approved("pypi.org", 443, Answer.SESSION),
    ]
    text = approved_policy(approved)
    policy = parse_policy(tomllib.loads(text), env={})
    assert [r.text for r in policy.allow.rules] == ["localhost:5000", "pypi.org:443"]
    assert [str(n) for n in policy.allow_cidrs] == ["127.0.0.1/32", "::1/128"]
    assert policy.warnings == ()
    assert '    # "10.0.0.5/32",  # for an entry allowed once' in text
    assert "resolves to loopback" in text  # the why, above each grant
    # Uncommenting the once entry and its grant makes it work too.
    opened = text.replace('# "10.0.0.5:5432",', '"10.0.0.5:5432",').replace(
        '# "10.0.0.5/32",', '"10.0.0.5/32",'
    )
    assert parse_policy(tomllib.loads(opened), env={}).warnings == ()


def test_save_approved_without_local_entries_has_no_allow_cidrs() -> None:
    text = approved_policy([Approved("pypi.org", 443, Answer.SESSION)])
    assert "allow_cidrs" not in text
