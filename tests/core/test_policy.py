"""The policy file: every key, every error shape, env overrides and warnings."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from egressbox.core import limits as lim
from egressbox.core.errors import PolicyError
from egressbox.core.policy import (
    ENV_ALLOW,
    ENV_DENY,
    REPORT_MODE_WARNING,
    DnsSettings,
    Mode,
    Policy,
    load_policy,
    parse_policy,
)
from egressbox.core.rules import RuleKind

NO_ENV: Mapping[str, str] = {}


def parse(data: Mapping[str, Any], env: Mapping[str, str] = NO_ENV) -> Policy:
    return parse_policy(data, env=env)


def problems(data: Mapping[str, Any], env: Mapping[str, str] = NO_ENV) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(data, env=env)
    return info.value.problems


def one_problem(data: Mapping[str, Any], env: Mapping[str, str] = NO_ENV) -> str:
    found = problems(data, env)
    assert len(found) == 1, found
    return found[0]


def egress(**keys: Any) -> dict[str, Any]:
    return {"egress": keys}


def texts(policy: Policy, which: str = "allow") -> list[str]:
    ruleset = policy.allow if which == "allow" else policy.deny
    return [rule.text for rule in ruleset.rules]


# -- defaults and every key ----------------------------------------------------------


def test_empty_policy_defaults() -> None:
    policy = parse({})
    assert policy.allow.rules == ()
    assert policy.deny.rules == ()
    assert policy.allow_cidrs == ()
    assert policy.deny_cidrs == ()
    assert policy.allow_private is False
    assert policy.mode is Mode.ENFORCE
    assert policy.dns == DnsSettings()
    assert policy.dns.nameservers == ()
    assert policy.dns.timeout == lim.DNS_TIMEOUT
    assert policy.dns.cache_size == lim.DNS_CACHE_SIZE
    assert policy.dns.max_ttl == lim.DNS_MAX_TTL
    assert policy.limits == lim.Limits()
    assert policy.source == ""


def test_full_policy() -> None:
    policy = parse_policy(
        {
            "egress": {
                "allow": [
                    "pypi.org:443",
                    "*.pythonhosted.org:443",
                    "github.com",
                    "10.1.2.3:5432",
                    "10.8.0.0/16:443",
                    {"host": "db.corp:5432", "private": True},
                    {"host": "*.com", "broad": True},
                ],
                "deny": ["*.internal", "evil.example.com"],
                "allow_cidrs": [
                    "10.0.0.0/8",
                    "fd12:3456:789a::/48",
                    {"cidr": "0.0.0.0/0", "broad": True},
                ],
                "deny_cidrs": ["169.254.169.254/32", "fd00:ec2::254/128"],
                "allow_private": True,
                "mode": "report",
            },
            "dns": {
                "nameservers": ["1.1.1.1", "[2606:4700::1111]:5353"],
                "timeout": 2,
                "cache_size": 10,
                "max_ttl": 60.5,
            },
            "limits": {
                "drain_timeout": 1,
                "connect_timeout": 2.5,
                "head_timeout": 3,
                "idle_timeout": 4,
                "max_connections": 5,
                "max_head_bytes": 2048,
            },
        },
        source="full.toml",
        env=NO_ENV,
    )
    assert texts(policy) == [
        "pypi.org:443",
        "*.pythonhosted.org:443",
        "github.com",
        "10.1.2.3:5432",
        "10.8.0.0/16:443",
        "db.corp:5432",
        "*.com",
    ]
    assert policy.allow.rules[5].private is True
    assert policy.allow.rules[6].broad is True
    assert texts(policy, "deny") == ["*.internal", "evil.example.com"]
    assert policy.allow_cidrs == (
        ipaddress.ip_network("10.0.0.0/8"),
        ipaddress.ip_network("fd12:3456:789a::/48"),
        ipaddress.ip_network("0.0.0.0/0"),
    )
    assert policy.deny_cidrs == (
        ipaddress.ip_network("169.254.169.254/32"),
        ipaddress.ip_network("fd00:ec2::254/128"),
    )
    assert policy.allow_private is True
    assert policy.mode is Mode.REPORT
    assert policy.dns.nameservers == (
        (ipaddress.ip_address("1.1.1.1"), 53),
        (ipaddress.ip_address("2606:4700::1111"), 5353),
    )
    assert policy.dns.timeout == 2.0
    assert isinstance(policy.dns.timeout, float)
    assert policy.dns.cache_size == 10
    assert policy.dns.max_ttl == 60.5
    assert policy.limits == lim.Limits(1.0, 2.5, 3.0, 4.0, 5, 2048)
    assert isinstance(policy.limits.drain_timeout, float)
    assert policy.source == "full.toml"


def test_policy_is_frozen() -> None:
    policy = parse({})
    with pytest.raises(AttributeError):
        policy.mode = Mode.REPORT  # type: ignore[misc]


def test_entries_normalized_like_requests() -> None:
    policy = parse(egress(allow=["Pypi.ORG.", "straße.de:443", "*.EXAMPLE.com", "[2001:DB8::1]"]))
    assert texts(policy) == ["pypi.org", "xn--strae-oqa.de:443", "*.example.com", "[2001:db8::1]"]
    assert policy.allow.match_name("pypi.org", 443) is not None
    assert policy.allow.match_name("xn--strae-oqa.de", 443) is not None


def test_deny_is_not_checked_for_breadth() -> None:
    policy = parse(egress(deny=["*", "*.com", "0.0.0.0/0", "::/0"]))
    assert [r.kind for r in policy.deny.rules] == [
        RuleKind.ANY_NAME,
        RuleKind.WILDCARD,
        RuleKind.CIDR,
        RuleKind.CIDR,
    ]


def test_deny_cidrs_are_not_checked_for_breadth() -> None:
    policy = parse(egress(deny_cidrs=["0.0.0.0/0", "::/0"]))
    assert len(policy.deny_cidrs) == 2


def test_bare_addresses_in_cidr_lists_are_host_networks() -> None:
    policy = parse(egress(allow_cidrs=["10.1.2.3", "::1"], deny_cidrs=["169.254.169.254"]))
    assert policy.allow_cidrs == (
        ipaddress.ip_network("10.1.2.3/32"),
        ipaddress.ip_network("::1/128"),
    )
    assert policy.deny_cidrs == (ipaddress.ip_network("169.254.169.254/32"),)


def test_cidr_lookups() -> None:
    policy = parse(
        egress(allow_cidrs=["10.0.0.0/8", "10.1.0.0/16"], deny_cidrs=["169.254.169.254/32"])
    )
    assert policy.allow_cidr_for(ipaddress.ip_address("10.1.2.3")) == ipaddress.ip_network(
        "10.1.0.0/16"
    )
    assert policy.allow_cidr_for(ipaddress.ip_address("10.2.0.1")) == ipaddress.ip_network(
        "10.0.0.0/8"
    )
    assert policy.allow_cidr_for(ipaddress.ip_address("11.0.0.1")) is None
    # An IPv4 entry never covers the IPv6 form of the address.
    assert policy.allow_cidr_for(ipaddress.ip_address("::ffff:10.1.2.3")) is None
    assert policy.deny_cidr_for(ipaddress.ip_address("169.254.169.254")) is not None
    assert policy.deny_cidr_for(ipaddress.ip_address("169.254.169.253")) is None


@pytest.mark.parametrize("mode", ["enforce", "report"])
def test_mode(mode: str) -> None:
    assert parse(egress(mode=mode)).mode is Mode(mode)


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("1.1.1.1", ("1.1.1.1", 53)),
        ("1.1.1.1:5353", ("1.1.1.1", 5353)),
        ("2606:4700::1111", ("2606:4700::1111", 53)),
        ("[2606:4700::1111]", ("2606:4700::1111", 53)),
        ("[2606:4700::1111]:54", ("2606:4700::1111", 54)),
        (" 127.0.0.1:53 ", ("127.0.0.1", 53)),
    ],
)
def test_nameservers(entry: str, expected: tuple[str, int]) -> None:
    policy = parse({"dns": {"nameservers": [entry]}})
    assert policy.dns.nameservers == ((ipaddress.ip_address(expected[0]), expected[1]),)


# -- error messages: key path and fix ------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            egress(allow=["pypi.org", "github.com", "*.com"]),
            'egress.allow[2]: "*.com" is too broad (a one-label suffix admits a whole top-level'
            ' domain); list the hosts you need, or write { host = "*.com", broad = true } if you'
            " mean it",
        ),
        (
            egress(allow=["*"]),
            'egress.allow[0]: "*" is too broad (it admits every name); list the hosts you need,'
            ' or write { host = "*", broad = true } if you mean it',
        ),
        (
            egress(allow=["*:443"]),
            'egress.allow[0]: "*:443" is too broad (it admits every name)',
        ),
        (
            egress(allow=["0.0.0.0/0"]),
            'egress.allow[0]: "0.0.0.0/0" is too broad (it admits a large part of the Internet);'
            ' list the hosts you need, or write { host = "0.0.0.0/0", broad = true } if you mean'
            " it",
        ),
        (egress(allow=["8.0.0.0/7:443"]), 'egress.allow[0]: "8.0.0.0/7:443" is too broad'),
        (egress(allow=["2000::/3"]), 'egress.allow[0]: "2000::/3" is too broad'),
        (
            egress(allow_cidrs=["10.0.0/8"]),
            'egress.allow_cidrs[0]: "10.0.0/8" is not a network; use "10.0.0.0/8"',
        ),
        (
            egress(allow_cidrs=["10.0.0.1/8"]),
            'egress.allow_cidrs[0]: "10.0.0.1/8" has host bits set; use "10.0.0.0/8"',
        ),
        (
            egress(deny_cidrs=["169.254.169.254/16"]),
            'egress.deny_cidrs[0]: "169.254.169.254/16" has host bits set; use "169.254.0.0/16"',
        ),
        (
            egress(allow_cidrs=["garbage"]),
            'egress.allow_cidrs[0]: "garbage" is not an IP address or network; write it as'
            " ADDRESS/LENGTH, e.g. 10.0.0.0/8 or 2001:db8::/32",
        ),
        (
            egress(allow_cidrs=["0.0.0.0/0"]),
            'egress.allow_cidrs[0]: "0.0.0.0/0" is too broad: it would lift the private-address'
            " ban for a huge range; list narrower networks, or write"
            ' { cidr = "0.0.0.0/0", broad = true } if you mean it',
        ),
        (egress(allow_cidrs=["::/8"]), 'egress.allow_cidrs[0]: "::/8" is too broad'),
        (
            egress(allow_cidrs=[{"broad": True}]),
            'egress.allow_cidrs[0]: a table entry needs cidr = "NETWORK", e.g.'
            ' { cidr = "0.0.0.0/0", broad = true }',
        ),
        (
            egress(allow_cidrs=[7]),
            'egress.allow_cidrs[0]: must be a CIDR string such as "10.0.0.0/8", got an integer',
        ),
        (
            egress(deny_cidrs=[{"cidr": "10.0.0.0/8"}]),
            'egress.deny_cidrs[0]: must be a CIDR string such as "10.0.0.0/8", got a table',
        ),
        (
            egress(allow="pypi.org"),
            'egress.allow: must be a list, got a string; e.g. allow = ["pypi.org:443"]',
        ),
        (
            egress(deny={"a": 1}),
            'egress.deny: must be a list, got a table; e.g. deny = ["pypi.org:443"]',
        ),
        (
            egress(allow_cidrs="10.0.0.0/8"),
            'egress.allow_cidrs: must be a list, got a string; e.g. allow_cidrs = ["10.0.0.0/8"]',
        ),
        (
            egress(deny_cidrs=5),
            'egress.deny_cidrs: must be a list, got an integer; e.g. deny_cidrs = ["10.0.0.0/8"]',
        ),
        (egress(allow=[443]), "egress.allow[0]: must be a string or a table, got an integer"),
        (egress(deny=[True]), "egress.deny[0]: must be a string or a table, got a boolean"),
        (egress(allow=[["a.com"]]), "egress.allow[0]: must be a string or a table, got a list"),
        (
            egress(allow=[{"private": True}]),
            'egress.allow[0]: a table entry needs host = "PATTERN", e.g.'
            ' { host = "db.corp", private = true }',
        ),
        (
            egress(allow=[{"host": "a.com", "private": "yes"}]),
            "egress.allow[0].private: must be true or false, got a string",
        ),
        (
            egress(allow=[{"host": "*.com", "broad": 1}]),
            "egress.allow[0].broad: must be true or false, got an integer",
        ),
        (
            egress(allow_cidrs=[{"cidr": "0.0.0.0/0", "broad": "yes"}]),
            "egress.allow_cidrs[0].broad: must be true or false, got a string",
        ),
        (
            egress(allow=["pypi.org:0"]),
            'egress.allow[0]: "pypi.org:0": the port must be a number from 1 to 65535',
        ),
        (
            egress(allow=["a b.com"]),
            'egress.allow[0]: "a b.com" is not a valid host (bad host: only letters, digits,'
            " '-', '_' and '.' are allowed)",
        ),
        (
            egress(deny=["foo*.com"]),
            'egress.deny[0]: "foo*.com": "*" may only be the whole first label, as in'
            ' "*.example.com"',
        ),
        (
            egress(allow=["127.1"]),
            'egress.allow[0]: "127.1" is not a valid host (bad host: numeric host is not a'
            " canonical dotted-quad IPv4 address)",
        ),
        (
            egress(allow=["[pypi.org]:443"]),
            'egress.allow[0]: "[pypi.org]:443": brackets are only for IPv6 addresses, as in'
            ' "[2001:db8::1]:443"',
        ),
        (egress(allow_private="yes"), "egress.allow_private: must be true or false, got a string"),
        (egress(allow_private=1), "egress.allow_private: must be true or false, got an integer"),
        (egress(mode="audit"), 'egress.mode: must be "enforce" or "report", got \'audit\''),
        (egress(mode="Report"), 'egress.mode: must be "enforce" or "report", got \'Report\''),
        (egress(mode=1), 'egress.mode: must be "enforce" or "report", got 1'),
        (egress(mode=[]), 'egress.mode: must be "enforce" or "report", got []'),
        ({"egress": ["pypi.org"]}, "egress: must be a table ([egress]), got a list"),
        ({"dns": "1.1.1.1"}, "dns: must be a table ([dns]), got a string"),
        ({"limits": 5}, "limits: must be a table ([limits]), got an integer"),
        (
            {"dns": {"nameservers": "1.1.1.1"}},
            'dns.nameservers: must be a list such as ["127.0.0.1:53"]',
        ),
        (
            {"dns": {"nameservers": ["dns.google"]}},
            'dns.nameservers[0]: "dns.google" is not IP[:PORT]; e.g. "1.1.1.1",'
            ' "[2606:4700::1111]:53"',
        ),
        (
            {"dns": {"nameservers": ["1.1.1.1:0"]}},
            'dns.nameservers[0]: "1.1.1.1:0" is not IP[:PORT]',
        ),
        (
            {"dns": {"nameservers": [53]}},
            'dns.nameservers[0]: must be a string "IP[:PORT]", got an integer',
        ),
        ({"dns": {"timeout": 0}}, "dns.timeout: must be between 0.05 and 60, got 0"),
        ({"dns": {"timeout": 61}}, "dns.timeout: must be between 0.05 and 60, got 61"),
        ({"dns": {"timeout": "5"}}, "dns.timeout: must be a number, got a string"),
        ({"dns": {"timeout": True}}, "dns.timeout: must be a number, got a boolean"),
        ({"dns": {"cache_size": 5.5}}, "dns.cache_size: must be a whole number, got 5.5"),
        ({"dns": {"cache_size": -1}}, "dns.cache_size: must be between 0 and 10000000, got -1"),
        ({"dns": {"max_ttl": -1}}, "dns.max_ttl: must be between 0 and 86400, got -1"),
        (
            {"limits": {"max_connections": 0}},
            "limits.max_connections: must be between 1 and 1000000, got 0",
        ),
        (
            {"limits": {"max_head_bytes": 10**9}},
            "limits.max_head_bytes: must be between 1024 and 1048576, got 1000000000",
        ),
        (
            {"limits": {"max_head_bytes": 4096.0}},
            "limits.max_head_bytes: must be a whole number, got 4096.0",
        ),
        (
            {"limits": {"connect_timeout": 0.01}},
            "limits.connect_timeout: must be between 0.1 and 600, got 0.01",
        ),
        ({"limits": {"idle_timeout": "5m"}}, "limits.idle_timeout: must be a number, got a string"),
        (
            {"limits": {"drain_timeout": -1}},
            "limits.drain_timeout: must be between 0 and 3600, got -1",
        ),
        (
            {"limits": {"head_timeout": 601}},
            "limits.head_timeout: must be between 0.1 and 600, got 601",
        ),
    ],
)
def test_error_messages(data: Mapping[str, Any], expected: str) -> None:
    found = problems(data)
    assert found[0].startswith(expected), found
    # A bad "broad" flag also leaves the entry too broad; nothing else adds problems.
    assert len(found) == 1 or (".broad:" in found[0] and "is too broad" in found[1]), found


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (
            {"egres": {}},
            'egres: unknown key; did you mean "egress"? known keys: egress, dns, limits',
        ),
        ({"proxy": {}}, "proxy: unknown key; known keys: egress, dns, limits"),
        (
            egress(alow=[]),
            'egress.alow: unknown key; did you mean "allow"? known keys: allow, deny,'
            " allow_cidrs, deny_cidrs, allow_private, mode",
        ),
        (egress(allow_cidr=[]), 'egress.allow_cidr: unknown key; did you mean "allow_cidrs"?'),
        (egress(private=True), 'egress.private: unknown key; did you mean "allow_private"?'),
        (egress(xyzzy=1), "egress.xyzzy: unknown key; known keys: allow, deny,"),
        (
            {"dns": {"timeot": 1}},
            'dns.timeot: unknown key; did you mean "timeout"? known keys: nameservers, timeout,'
            " cache_size, max_ttl",
        ),
        (
            {"dns": {"nameserver": []}},
            'dns.nameserver: unknown key; did you mean "nameservers"?',
        ),
        (
            {"limits": {"idle_timout": 1}},
            'limits.idle_timout: unknown key; did you mean "idle_timeout"? known keys:'
            " drain_timeout, connect_timeout, head_timeout, idle_timeout, max_connections,"
            " max_head_bytes",
        ),
        (
            egress(allow=[{"host": "a.com", "privat": True}]),
            'egress.allow[0].privat: unknown key; did you mean "private"? known keys: host,'
            " private, broad",
        ),
        (
            egress(deny=[{"host": "a.com", "port": 22}]),
            "egress.deny[0].port: unknown key; known keys: host, private, broad",
        ),
        (
            egress(allow_cidrs=[{"cidr": "10.0.0.0/8", "brod": True}]),
            'egress.allow_cidrs[0].brod: unknown key; did you mean "broad"? known keys: cidr,'
            " broad",
        ),
    ],
)
def test_unknown_keys(data: Mapping[str, Any], expected: str) -> None:
    found = one_problem(data)
    assert found.startswith(expected), found


def test_long_forms_admit_broad_entries() -> None:
    policy = parse(
        egress(
            allow=[
                {"host": "*", "broad": True},
                {"host": "*.com:443", "broad": True},
                {"host": "0.0.0.0/0", "broad": True},
                {"host": "[::/0]:443", "broad": True},
            ],
            allow_cidrs=[{"cidr": "0.0.0.0/0", "broad": True}, {"cidr": "::/0", "broad": True}],
        )
    )
    assert texts(policy) == ["*", "*.com:443", "0.0.0.0/0", "[::/0]:443"]
    assert all(rule.broad for rule in policy.allow.rules)
    assert len(policy.allow_cidrs) == 2


def test_broad_false_is_still_refused() -> None:
    found = one_problem(egress(allow=[{"host": "*.com", "broad": False}]))
    assert found.startswith('egress.allow[0]: "*.com" is too broad')


def test_table_entries_private() -> None:
    policy = parse(egress(allow=[{"host": "db.corp:5432", "private": True}, "pypi.org"]))
    db, pypi = policy.allow.rules
    assert (db.text, db.private, db.broad) == ("db.corp:5432", True, False)
    assert (pypi.private, pypi.broad) == (False, False)


def test_table_entry_private_in_deny_is_accepted() -> None:
    policy = parse(egress(deny=[{"host": "*.internal"}]))
    assert texts(policy, "deny") == ["*.internal"]


def test_all_errors_are_reported_together() -> None:
    data = {
        "egres": {},
        "egress": {
            "allow": ["pypi.org", "*.com", 5, "a.com:99999", {"hots": "x"}],
            "deny": ["**"],
            "allow_cidrs": ["10.0.0/8", "0.0.0.0/0"],
            "deny_cidrs": ["nonsense/8"],
            "allow_private": "no",
            "mode": "loud",
            "colour": "blue",
        },
        "dns": {"timeout": 0, "nameservers": ["x"], "ttl": 1},
        "limits": {"max_connections": 0, "bogus": 1},
    }
    found = problems(data)
    paths = [p.split(":", 1)[0] for p in found]
    assert paths == [
        "egres",
        "egress.colour",
        "egress.allow[1]",
        "egress.allow[2]",
        "egress.allow[3]",
        "egress.allow[4].hots",
        "egress.allow[4]",
        "egress.deny[0]",
        "egress.allow_cidrs[0]",
        "egress.allow_cidrs[1]",
        "egress.deny_cidrs[0]",
        "egress.allow_private",
        "egress.mode",
        "dns.ttl",
        "dns.nameservers[0]",
        "dns.timeout",
        "limits.bogus",
        "limits.max_connections",
    ]


def test_policy_error_text_names_the_source() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(egress(allow=["*.com"], mode="x"), source="p.toml", env=NO_ENV)
    error = info.value
    assert error.source == "p.toml"
    assert len(error.problems) == 2
    lines = str(error).splitlines()
    assert len(lines) == 2
    assert all(line.startswith("p.toml: egress.") for line in lines)


# -- load_policy ----------------------------------------------------------------------


def test_load_policy(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(
        "# a comment\n"
        "[egress]\n"
        'allow = ["pypi.org:443", { host = "db.corp:5432", private = true }]\n'
        'deny_cidrs = ["169.254.169.254/32"]\n'
        'mode = "enforce"\n'
        "[dns]\n"
        "timeout = 2.5\n"
        "[limits]\n"
        "max_connections = 10\n",
        encoding="utf-8",
    )
    policy = load_policy(str(path), env=NO_ENV)
    assert texts(policy) == ["pypi.org:443", "db.corp:5432"]
    assert policy.allow.rules[1].private is True
    assert policy.dns.timeout == 2.5
    assert policy.limits.max_connections == 10
    assert policy.source == str(path)


def test_load_policy_utf8_names(tmp_path: Path) -> None:
    path = tmp_path / "idn.toml"
    path.write_text('[egress]\nallow = ["straße.de"]\n', encoding="utf-8")
    assert texts(load_policy(str(path), env=NO_ENV)) == ["xn--strae-oqa.de"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('[egress]\nallow = ["a.com"\n', "not valid TOML: "),
        ('[egress]\nallow = ["a.com"]\nallow = ["b.com"]\n', "(at line 3, column"),
        ("[egress\n", "(at line 1, column"),
        ("[egress]\nmode = report\n", "(at line 2, column"),
    ],
)
def test_load_policy_toml_syntax_errors(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError) as info:
        load_policy(str(path), env=NO_ENV)
    assert info.value.source == str(path)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith("not valid TOML: ")
    assert fragment in info.value.problems[0]
    assert str(info.value).startswith(f"{path}: not valid TOML: ")


def test_load_policy_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[egress]\nallow = ["stra\xdfe.de"]\n')
    with pytest.raises(PolicyError) as info:
        load_policy(str(path), env=NO_ENV)
    assert info.value.problems == [
        "not valid TOML: the file is not UTF-8 text (byte 0xdf at offset 23); save it as UTF-8"
    ]


def test_load_policy_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    with pytest.raises(PolicyError) as info:
        load_policy(str(path), env=NO_ENV)
    assert info.value.problems == ["cannot read the policy file: No such file or directory"]
    assert info.value.source == str(path)


def test_load_policy_directory(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(str(tmp_path), env=NO_ENV)
    assert info.value.problems[0].startswith("cannot read the policy file: ")


def test_load_policy_reports_every_problem(tmp_path: Path) -> None:
    path = tmp_path / "many.toml"
    path.write_text(
        '[egress]\nallow = ["*.com", "*"]\nallow_cidrs = ["10.0.0/8"]\nmoed = "report"\n',
        encoding="utf-8",
    )
    with pytest.raises(PolicyError) as info:
        load_policy(str(path), env=NO_ENV)
    assert [p.split(":", 1)[0] for p in info.value.problems] == [
        "egress.moed",
        "egress.allow[0]",
        "egress.allow[1]",
        "egress.allow_cidrs[0]",
    ]


# -- environment overrides ------------------------------------------------------------


def test_env_overrides_append() -> None:
    env = {ENV_ALLOW: " b.com , ,*.c.com:443,", ENV_DENY: "x.b.com,*.internal"}
    policy = parse(egress(allow=["a.com"], deny=["evil.com"]), env)
    assert texts(policy) == ["a.com", "b.com", "*.c.com:443"]
    assert texts(policy, "deny") == ["evil.com", "x.b.com", "*.internal"]


def test_env_overrides_without_a_file_section() -> None:
    policy = parse({}, {ENV_ALLOW: "pypi.org:443"})
    assert texts(policy) == ["pypi.org:443"]
    assert policy.allow.match_name("pypi.org", 443) is not None


def test_env_empty_values_change_nothing() -> None:
    policy = parse(egress(allow=["a.com"]), {ENV_ALLOW: "", ENV_DENY: " , "})
    assert texts(policy) == ["a.com"]
    assert texts(policy, "deny") == []


def test_env_errors_name_the_variable() -> None:
    found = problems(egress(allow=["a.com"]), {ENV_ALLOW: "b.com,*.com,c.com:0", ENV_DENY: "x*"})
    assert [p.split(":", 1)[0] for p in found] == [
        "EGRESSBOX_ALLOW[1]",
        "EGRESSBOX_ALLOW[2]",
        "EGRESSBOX_DENY[0]",
    ]
    assert found[0].startswith('EGRESSBOX_ALLOW[1]: "*.com" is too broad')


def test_env_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ALLOW, "from-env.example.com")
    monkeypatch.setenv(ENV_DENY, "bad.example.com")
    policy = parse_policy(egress(allow=["a.com"]))
    assert texts(policy) == ["a.com", "from-env.example.com"]
    assert texts(policy, "deny") == ["bad.example.com"]
    # An explicit env mapping replaces the process environment.
    assert texts(parse_policy(egress(allow=["a.com"]), env={})) == ["a.com"]


def test_unrelated_env_is_ignored() -> None:
    assert texts(parse(egress(allow=["a.com"]), {"HTTP_PROXY": "x", "EGRESSBOX_X": "y"})) == [
        "a.com"
    ]


# -- warnings -------------------------------------------------------------------------


def test_no_warnings_for_a_plain_policy() -> None:
    policy = parse(egress(allow=["pypi.org:443", "151.101.0.223", "[2a04:4e42::223]:443"]))
    assert policy.warnings == ()


def test_wildcard_dns_warning() -> None:
    policy = parse(egress(allow=["pypi.org", "*.pythonhosted.org:443"]))
    assert policy.warnings == (
        'egress.allow[1]: "*.pythonhosted.org:443" lets a client choose names that the proxy'
        " resolves, so a client can send DNS queries to that zone's servers",
    )


def test_any_name_dns_warning() -> None:
    policy = parse(egress(allow=[{"host": "*", "broad": True}]))
    assert len(policy.warnings) == 1
    assert policy.warnings[0].startswith('egress.allow[0]: "*" lets a client choose names')


def test_private_ip_literal_warning() -> None:
    policy = parse(egress(allow=["10.1.2.3:5432", "10.8.0.0/16:443"]))
    assert policy.warnings == (
        'egress.allow[0]: "10.1.2.3:5432" is a private address and stays denied unless'
        ' egress.allow_cidrs covers it or the entry is written { host = "...", private = true }',
        'egress.allow[1]: "10.8.0.0/16:443" is a private address and stays denied unless'
        ' egress.allow_cidrs covers it or the entry is written { host = "...", private = true }',
    )


@pytest.mark.parametrize(
    ("entry", "category"),
    [
        ("127.0.0.1:8080", "loopback"),
        ("[::1]", "loopback"),
        ("169.254.1.1", "link-local"),
        ("[fe80::1]", "link-local"),
        ("192.0.2.1", "documentation"),
        ("224.0.0.1", "multicast"),
        ("[::ffff:8.8.8.8]", "ipv4-embedding"),
    ],
)
def test_special_ip_literal_warning(entry: str, category: str) -> None:
    (warning,) = parse(egress(allow=[entry])).warnings
    assert warning.startswith("egress.allow[0]: ")
    assert warning.endswith(
        f"is a {category} address and stays denied unless egress.allow_cidrs covers it"
    )


@pytest.mark.parametrize("entry", ["100.64.0.1", "[fd00::1]", "[fec0::1]", "192.168.1.1"])
def test_private_like_literal_warning_mentions_private(entry: str) -> None:
    (warning,) = parse(egress(allow=[entry])).warnings
    assert warning.endswith('or the entry is written { host = "...", private = true }')


def test_private_literal_warning_lifted() -> None:
    assert parse(egress(allow=[{"host": "10.1.2.3", "private": True}])).warnings == ()
    assert parse(egress(allow=["10.1.2.3"], allow_private=True)).warnings == ()
    assert parse(egress(allow=["10.1.2.3"], allow_cidrs=["10.0.0.0/8"])).warnings == ()
    assert parse(egress(allow=["127.0.0.1"], allow_cidrs=["127.0.0.0/8"])).warnings == ()
    assert parse(egress(allow=["[::1]:22"], allow_cidrs=["::1/128"])).warnings == ()


def test_private_flag_does_not_lift_loopback_warning() -> None:
    (warning,) = parse(egress(allow=[{"host": "127.0.0.1", "private": True}])).warnings
    assert "is a loopback address" in warning
    (warning,) = parse(egress(allow=["169.254.1.1"], allow_private=True)).warnings
    assert "is a link-local address" in warning


@pytest.mark.parametrize(
    "entry", ["169.254.169.254:80", "100.100.100.200", "168.63.129.16", "[fd00:ec2::254]"]
)
def test_exact_metadata_entry_warns_that_it_opens_credentials(entry: str) -> None:
    # However the policy grants ranges, naming a metadata endpoint is what opens it.
    for extra in ({}, {"allow_private": True}, {"allow_cidrs": ["169.254.0.0/16"]}):
        (warning,) = parse(egress(allow=[entry], **extra)).warnings
        assert warning.startswith(f'egress.allow[0]: "{entry}" names ')
        assert warning.endswith(
            "a cloud metadata endpoint: it opens this instance's credentials to every client"
        )


def test_cidr_entry_naming_a_metadata_endpoint_warns_that_it_stays_denied() -> None:
    (warning,) = parse(egress(allow=["169.254.169.254/32"], allow_private=True)).warnings
    assert warning.startswith('egress.allow[0]: "169.254.169.254/32" covers instance metadata')
    assert warning.endswith("metadata endpoint that stays denied unless an entry names it exactly")


def test_report_mode_warning() -> None:
    policy = parse(egress(allow=["pypi.org"], mode="report"))
    assert policy.warnings == (REPORT_MODE_WARNING,)
    assert "would_deny" in REPORT_MODE_WARNING
    assert "never to confine an untrusted one" in REPORT_MODE_WARNING


def test_empty_allow_warning() -> None:
    assert parse({}).warnings == ("egress.allow is empty: every destination is denied",)
    assert parse(egress(allow=[], deny=["a.com"])).warnings == (
        "egress.allow is empty: every destination is denied",
    )


def test_empty_allow_in_report_mode_warning() -> None:
    assert parse(egress(mode="report")).warnings == (
        "egress.allow is empty: in report mode every destination is only audited",
        REPORT_MODE_WARNING,
    )


def test_env_entries_warn_under_their_own_name() -> None:
    policy = parse(egress(allow=["a.com", "*.b.com"]), {ENV_ALLOW: "*.c.com,10.0.0.1"})
    assert [w.split(":", 1)[0] for w in policy.warnings] == [
        "egress.allow[1]",
        "EGRESSBOX_ALLOW[0]",
        "EGRESSBOX_ALLOW[1]",
    ]


def test_warnings_keep_file_indexes() -> None:
    policy = parse(egress(allow=["a.com", "b.com", "*.c.com"]))
    assert [w.split(":", 1)[0] for w in policy.warnings] == ["egress.allow[2]"]


def test_several_warnings_in_order() -> None:
    policy = parse(egress(allow=["*.a.com", "127.0.0.1"], mode="report"))
    assert len(policy.warnings) == 3
    assert policy.warnings[0].startswith('egress.allow[0]: "*.a.com" lets a client')
    assert policy.warnings[1].startswith('egress.allow[1]: "127.0.0.1" is a loopback address')
    assert policy.warnings[2] == REPORT_MODE_WARNING
