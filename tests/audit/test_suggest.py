"""Tests for egressbox.audit.suggest: with_mode, and policies suggested from audit records.

Every suggested text is loaded back with the real policy parser (and `egressbox check`),
and the decisions of the loaded policy are checked against what was observed.
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from egressbox.audit.record import AuditProtocol, AuditRecord
from egressbox.audit.suggest import (
    METADATA_DENY_CIDRS,
    MIN_SIBLINGS,
    plan_suggestion,
    suggest_policy,
    with_mode,
)
from egressbox.cli import main as cli_main
from egressbox.core.decide import NamePass, decide_name, parse_target
from egressbox.core.errors import Reason, Verdict
from egressbox.core.policy import REPORT_MODE_WARNING, Mode, Policy, load_policy, parse_policy
from egressbox.core.rules import RuleKind

T0 = datetime(2026, 11, 30, 11, 0, tzinfo=UTC)

ALLOWED = (Verdict.ALLOW, Reason.ALLOWED)
WOULD = (Verdict.WOULD_DENY, Reason.NO_ALLOW_RULE)
NO_RULE = (Verdict.DENY, Reason.NO_ALLOW_RULE)


def rec(
    host: str,
    port: int,
    outcome: tuple[Verdict, Reason] = WOULD,
    seconds: int = 0,
    protocol: AuditProtocol = AuditProtocol.CONNECT,
) -> AuditRecord:
    verdict, reason = outcome
    ts = T0 + timedelta(seconds=seconds)
    return AuditRecord(ts, protocol, host, port, verdict, reason)


def lookup(name: str, outcome: tuple[Verdict, Reason] = ALLOWED) -> AuditRecord:
    """A dns record: a name question, port 0."""
    return rec(name, 0, outcome, protocol=AuditProtocol.DNS)


def denied(host: str, port: int, reason: Reason) -> AuditRecord:
    return rec(host, port, (Verdict.DENY, reason))


def suggest(records: Iterable[AuditRecord], **kwargs: object) -> str:
    return suggest_policy(records, **kwargs)  # type: ignore[arg-type]


def load(text: str) -> Policy:
    return parse_policy(tomllib.loads(text), env={})


def allow_texts(text: str) -> list[str]:
    return [rule.text for rule in load(text).allow.rules]


def admits(policy: Policy, host: str, port: int) -> bool:
    return isinstance(decide_name(policy, parse_target(host, port)), NamePass)


# --------------------------------------------------------------------------- with_mode


def test_with_mode_switches_to_report_and_leaves_the_original_alone() -> None:
    policy = parse_policy(
        {"egress": {"allow": ["a.test:443"], "allow_cidrs": ["10.0.0.0/8"]}}, env={}
    )
    report = with_mode(policy, Mode.REPORT)
    assert (policy.mode, report.mode) == (Mode.ENFORCE, Mode.REPORT)
    assert REPORT_MODE_WARNING in report.warnings
    assert REPORT_MODE_WARNING not in policy.warnings
    # Name rules relaxed in the copy only.
    target = parse_target("other.test", 443)
    assert isinstance(decide_name(report, target), NamePass)
    assert not isinstance(decide_name(policy, target), NamePass)
    assert report.allow is policy.allow and report.source == policy.source


def test_with_mode_rebuilds_the_cidr_indexes_instead_of_sharing_them() -> None:
    policy = parse_policy(
        {"egress": {"allow_cidrs": ["10.0.0.0/8"], "deny_cidrs": ["192.0.2.0/24"]}}, env={}
    )
    ip = ipaddress.ip_address("10.1.2.3")
    report = with_mode(policy, Mode.REPORT)
    assert report._allow_cidr_index is not policy._allow_cidr_index
    assert report.allow_cidr_for(ip) == ipaddress.ip_network("10.0.0.0/8")
    assert report.deny_cidr_for(ipaddress.ip_address("192.0.2.9")) is not None
    # The original's index was not filled a second time.
    assert policy._allow_cidr_index.lookup_all(ip) == [[ipaddress.ip_network("10.0.0.0/8")]]


def test_with_mode_back_to_enforce_drops_the_report_warning() -> None:
    report = parse_policy({"egress": {"allow": ["a.test"], "mode": "report"}}, env={})
    enforced = with_mode(report, Mode.ENFORCE)
    assert enforced.mode is Mode.ENFORCE
    assert REPORT_MODE_WARNING not in enforced.warnings
    assert (
        with_mode(with_mode(report, Mode.REPORT), Mode.REPORT).warnings.count(REPORT_MODE_WARNING)
        == 1
    )


# --------------------------------------------------------------------------- what is admitted


def test_exact_names_with_their_ports_from_allow_and_would_deny_only() -> None:
    text = suggest(
        [
            rec("pypi.org", 443, ALLOWED),
            rec("files.pythonhosted.org", 443, WOULD),
            rec("github.com", 22, NO_RULE),
            rec("github.com", 443, WOULD),
        ]
    )
    assert sorted(allow_texts(text)) == [
        "files.pythonhosted.org:443",
        "github.com:443",
        "pypi.org:443",
    ]
    assert '    # "github.com:22",  # denied in the log: no_allow_rule' in text
    policy = load(text)
    assert policy.mode is Mode.ENFORCE
    assert admits(policy, "github.com", 443)
    assert not admits(policy, "github.com", 22)
    assert not admits(policy, "github.com", 80)
    assert not admits(policy, "www.pypi.org", 443)


def test_ip_literals_become_single_address_entries() -> None:
    text = suggest([rec("93.184.216.34", 80), rec("2606:4700::1111", 443, ALLOWED)])
    assert sorted(allow_texts(text)) == ["93.184.216.34:80", "[2606:4700::1111]:443"]
    kinds = {rule.kind for rule in load(text).allow.rules}
    assert kinds == {RuleKind.IP}


def test_three_siblings_collapse_to_a_wildcard_two_do_not() -> None:
    names = [f"shard{i}.cdn.example.com" for i in range(MIN_SIBLINGS)]
    text = suggest(
        [rec(name, 443) for name in names] + [rec("a.two.test", 443), rec("b.two.test", 443)]
    )
    assert sorted(allow_texts(text)) == [
        "*.cdn.example.com:443",
        "a.two.test:443",
        "b.two.test:443",
    ]
    assert "stands for 3 names seen: shard0.cdn.example.com" in text
    policy = load(text)
    assert admits(policy, "shard9.cdn.example.com", 443)
    assert not admits(policy, "cdn.example.com", 443)  # *.x never matches the apex
    assert not admits(policy, "shard0.cdn.example.com", 80)


def test_siblings_on_different_ports_are_not_grouped() -> None:
    text = suggest([rec("a.x.test", 443), rec("b.x.test", 443), rec("c.x.test", 8443)])
    assert sorted(allow_texts(text)) == ["a.x.test:443", "b.x.test:443", "c.x.test:8443"]


def test_never_a_one_label_or_public_suffix_wildcard() -> None:
    records = [rec(f"site{i}.com", 443) for i in range(5)]
    records += [rec(f"shop{i}.co.uk", 443) for i in range(5)]
    text = suggest(records)
    rules = load(text).allow.rules
    assert all(rule.kind is RuleKind.NAME for rule in rules)
    assert len(rules) == 10


def test_deeper_names_fold_into_the_outermost_wildcard() -> None:
    records = [rec(f"{x}.cdn.example.com", 443) for x in ("a", "b", "c")]
    records += [rec(f"{x}.eu.cdn.example.com", 443) for x in ("a", "b", "c")]
    records += [rec("cdn.example.com", 443)]
    text = suggest(records)
    assert allow_texts(text) == ["cdn.example.com:443", "*.cdn.example.com:443"]
    assert "stands for 6 names" in text
    assert '"*.cdn.example.com:443",  # 6 connections' in text


def test_lines_carry_connection_counts_and_order_groups_related_names() -> None:
    records = [rec("b.example.com", 443)] * 3 + [rec("example.com", 443), rec("a.example.org", 80)]
    text = suggest(records)
    assert '"b.example.com:443",  # 3 connections' in text
    assert '"example.com:443",  # 1 connection' in text
    assert allow_texts(text) == ["example.com:443", "b.example.com:443", "a.example.org:80"]


# --------------------------------------------------------------------------- never silently


@pytest.mark.parametrize(
    ("reason", "phrase"),
    [
        (Reason.PRIVATE_ADDRESS, "private address"),
        (Reason.SPECIAL_ADDRESS, "special-purpose address"),
        (Reason.METADATA_ADDRESS, "cloud metadata endpoint"),
        (Reason.DENY_CIDR, "egress.deny_cidrs"),
        (Reason.SELF_CONNECTION, "own listener"),
    ],
)
def test_refused_addresses_appear_commented_out_with_a_warning(reason: Reason, phrase: str) -> None:
    text = suggest([denied("db.corp.test", 5432, reason), rec("pypi.org", 443)])
    assert allow_texts(text) == ["pypi.org:443"]
    lines = text.splitlines()
    entry = lines.index(f'    # "db.corp.test:5432",  # denied in the log: {reason.value}')
    warning = next(i for i, line in enumerate(lines) if "# WARNING: db.corp.test:5432" in line)
    assert warning < entry
    block = " ".join(line.strip("# ") for line in lines[warning:entry])
    assert reason.value in block and phrase in block


@pytest.mark.parametrize("address", ["192.0.2.7", "::ffff:10.0.0.1", "224.0.0.5"])
def test_special_ip_literals_seen_allowed_are_still_withheld(address: str) -> None:
    # Report mode under an allow_cidrs grant lets these through; the suggestion must not.
    text = suggest([rec(address, 8080), rec(address, 8081, ALLOWED)])
    assert allow_texts(text) == []
    assert "# WARNING:" in text
    plan = plan_suggestion([rec(address, 8080)])
    assert next(w.reason for w in plan.withheld) in (
        Reason.PRIVATE_ADDRESS,
        Reason.SPECIAL_ADDRESS,
    )


@pytest.mark.parametrize(
    ("address", "network", "category"),
    [
        ("10.0.0.5", "10.0.0.5/32", "private"),
        ("127.0.0.1", "127.0.0.1/32", "loopback"),
        ("::1", "::1/128", "loopback"),
        ("fd12::7", "fd12::7/128", "private"),
        ("169.254.10.1", "169.254.10.1/32", "link-local"),
        ("100.64.0.1", "100.64.0.1/32", "shared"),
    ],
)
def test_local_ip_literals_let_through_are_admitted_with_their_one_address_grant(
    address: str, network: str, category: str
) -> None:
    # A local registry learned in report mode (would_deny private_address) or allowed.
    records = [
        rec(address, 8080, (Verdict.WOULD_DENY, Reason.PRIVATE_ADDRESS)),
        rec(address, 8081, ALLOWED),
    ]
    text = suggest(records)
    policy = load(text)
    assert [str(net) for net in policy.allow_cidrs] == [network]
    assert policy.warnings == ()  # the grant is what `check` would otherwise ask for
    ip = ipaddress.ip_address(address)
    assert policy.allow_cidr_for(ip) == ipaddress.ip_network(network)
    assert not policy.allow_cidr_for(ip + 1)  # one address, not its range
    assert admits(policy, address, 8080) and admits(policy, address, 8081)
    lines = text.splitlines()
    entry = lines.index(f'    "{network}",')
    assert f"is a {category} address" in lines[entry - 1] + lines[entry - 2]
    assert "NOTE" not in text  # the grant lifts what report mode said of them


def test_localhost_learned_gets_both_loopback_grants_and_the_check_is_quiet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [rec("localhost", 5000), rec("localhost", 5001, ALLOWED), rec("pypi.org", 443)]
    text = suggest(records)
    policy = load(text)
    assert allow_texts(text) == ["localhost:5000", "localhost:5001", "pypi.org:443"]
    assert [str(net) for net in policy.allow_cidrs] == ["127.0.0.1/32", "::1/128"]
    assert "resolves to loopback" in text
    out = checked(tmp_path, text, capsys)
    assert "warning" not in out and "(3 allow, 0 deny, 2 allow_cidrs" in out


def test_local_destination_refused_for_its_address_is_learned_with_its_grant() -> None:
    # Report mode lets no local address through: the log says deny private_address.
    records = [denied("localhost", 5000, Reason.PRIVATE_ADDRESS)]
    records += [denied("10.0.0.5", 5432, Reason.PRIVATE_ADDRESS)]
    text = suggest(records)
    policy = load(text)
    assert allow_texts(text) == ["localhost:5000", "10.0.0.5:5432"]
    assert [str(n) for n in policy.allow_cidrs] == ["10.0.0.5/32", "127.0.0.1/32", "::1/128"]
    assert policy.warnings == ()
    flat = " ".join(line.strip("# ") for line in text.splitlines())
    assert "localhost:5000 was refused 1 time for private_address" in flat
    assert "below is what admits it" in flat


def test_local_destination_refused_for_other_reasons_stays_withheld() -> None:
    text = suggest([denied("10.0.0.5", 5432, Reason.NO_ALLOW_RULE)])
    assert allow_texts(text) == [] and load(text).allow_cidrs == ()
    assert '    # "10.0.0.5:5432",  # denied in the log: no_allow_rule' in text
    # A name not local by definition: its address is unknown, so no grant is written.
    text = suggest([denied("registry.internal", 5000, Reason.PRIVATE_ADDRESS)])
    assert allow_texts(text) == [] and load(text).allow_cidrs == ()


@pytest.mark.parametrize(
    "address", ["169.254.169.254", "100.100.100.200", "168.63.129.16", "::ffff:169.254.169.254"]
)
def test_metadata_ip_literals_seen_allowed_are_withheld_whatever_the_base(address: str) -> None:
    # An older log (or one from another tool) can show these admitted; the suggested
    # entry would be the one grant that opens them, so it is never written uncommented.
    base = parse_policy(
        {"egress": {"allow_private": True, "allow_cidrs": ["169.254.0.0/16", "100.64.0.0/10"]}},
        env={},
        source="base.toml",
    )
    for kwargs in ({}, {"base": base}):
        text = suggest([rec(address, 80, ALLOWED)], **kwargs)
        assert allow_texts(text) == []
        assert "metadata_address" in text and "# WARNING:" in text
    plan = plan_suggestion([rec(address, 80, ALLOWED)], base=base)
    assert [w.reason for w in plan.withheld] == [Reason.METADATA_ADDRESS]


def test_local_ip_literal_under_a_base_grant_needs_no_second_grant() -> None:
    base = parse_policy({"egress": {"allow_cidrs": ["10.0.0.0/24"]}}, env={}, source="base.toml")
    text = suggest([rec("10.0.0.5", 5432), rec("10.0.1.5", 5432)], base=base)
    assert allow_texts(text) == ["10.0.0.5:5432", "10.0.1.5:5432"]
    # 10.0.0.5 is covered by the kept base entry; 10.0.1.5 gets its own.
    assert [str(n) for n in load(text).allow_cidrs] == ["10.0.0.0/24", "10.0.1.5/32"]


def test_a_name_both_admitted_and_refused_gets_a_note_not_a_second_entry() -> None:
    text = suggest([rec("api.test", 443, ALLOWED), denied("api.test", 443, Reason.PRIVATE_ADDRESS)])
    assert allow_texts(text) == ["api.test:443"]
    assert "# NOTE: api.test:443 was also refused 1 time for private_address" in text
    assert '# "api.test:443"' not in text


def test_other_refusals_are_listed_but_not_admitted() -> None:
    text = suggest(
        [
            denied("nx.test", 443, Reason.DNS_FAILURE),
            denied("evil.test", 443, Reason.DENY_RULE),
            denied("evil.test", 443, Reason.DENY_RULE),
            denied("(invalid)", 0, Reason.BAD_HOST),
        ]
    )
    assert allow_texts(text) == []
    assert "#   nx.test:443: dns_failure x1" in text
    assert "#   evil.test:443: deny_rule x2" in text
    assert "'(invalid)' port 0: not a host:port: bad_host x1" in text


@pytest.mark.parametrize("host", ["*", "*.example.com", "a b"])
def test_crafted_hosts_never_become_wildcards(host: str) -> None:
    # The reader accepts these hosts (no forbidden character); an entry must not follow.
    try:
        record = rec(host, 443, ALLOWED)
    except ValueError:
        return
    text = suggest([record])
    assert allow_texts(text) == []


# --------------------------------------------------------------------------- the file


def test_header_names_sources_and_time_range_safely() -> None:
    records = [rec("a.test", 443, seconds=0), rec("b.test", 443, seconds=90)]
    text = suggest(records, sources=["logs/audit.jsonl.1", "evil\nname"])
    assert "# Sources: logs/audit.jsonl.1, evil\\nname" in text
    assert "# Records: 2, 2026-11-30T11:00:00.000Z .. 2026-11-30T11:01:30.000Z (UTC)" in text
    load(text)  # the newline in a source name did not break out of the comment


def test_metadata_deny_cidrs_are_always_kept() -> None:
    policy = load(suggest([rec("a.test", 443)]))
    assert tuple(str(net) for net in policy.deny_cidrs) == METADATA_DENY_CIDRS
    assert policy.allow_cidrs == () and policy.deny.rules == ()


def test_base_policy_keeps_deny_rules_and_cidrs() -> None:
    base = parse_policy(
        {
            "egress": {
                "allow": ["ignored.test"],
                "deny": ["*.internal.test", "[2001:db8::/32]:443"],
                "allow_cidrs": ["127.0.0.0/8", {"cidr": "10.0.0.0/7", "broad": True}],
                "deny_cidrs": ["192.0.2.0/24", "169.254.169.254/32"],
                "allow_private": True,
                "mode": "report",
            }
        },
        env={},
        source="report.toml",
    )
    text = suggest([rec("a.test", 443)], base=base)
    policy = load(text)
    assert [rule.text for rule in policy.deny.rules] == ["*.internal.test", "[2001:db8::/32]:443"]
    assert [str(net) for net in policy.allow_cidrs] == ["127.0.0.0/8", "10.0.0.0/7"]
    assert [str(net) for net in policy.deny_cidrs] == [*METADATA_DENY_CIDRS, "192.0.2.0/24"]
    assert policy.allow_private and policy.mode is Mode.ENFORCE
    assert allow_texts(text) == ["a.test:443"]
    assert "kept from report.toml" in text


def test_no_records_gives_a_valid_deny_everything_policy() -> None:
    text = suggest([])
    assert "# Records: 0, no records" in text
    assert load(text).allow.rules == ()


def checked(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `egressbox check` on the text; its stdout (the test fails unless it is ok)."""
    path = tmp_path / "suggested.toml"
    path.write_text(text)
    assert cli_main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: ok (" in out
    return out


def test_egressbox_check_accepts_the_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [rec(f"n{i}.pool.example.net", 443) for i in range(4)]
    records += [
        rec("pypi.org", 443, ALLOWED),
        rec("10.9.9.9", 22),
        denied("m.test", 80, Reason.DENY_CIDR),
    ]
    path = tmp_path / "suggested.toml"
    path.write_text(suggest(records, sources=["audit.jsonl"]))
    assert cli_main(["check", str(path)]) == 0
    assert f"{path}: ok (3 allow, 0 deny, 1 allow_cidrs, 2 deny_cidrs; mode enforce)" in (
        capsys.readouterr().out
    )
    assert load_policy(str(path), env={}).mode is Mode.ENFORCE


# --------------------------------------------------------------------------- properties

_label = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=6)
_tld = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=3)
# A name whose last label is numeric reads as an IP address and is refused as bad_host.
_name = st.tuples(st.lists(_label, max_size=3), _tld).map(lambda p: ".".join([*p[0], p[1]]))
_port = st.sampled_from([22, 80, 443, 8443])
_observed = st.lists(st.tuples(_name, _port), min_size=0, max_size=25)


@settings(max_examples=150, deadline=None)
@given(_observed)
def test_suggestion_parses_and_admits_every_observed_destination(
    observed: list[tuple[str, int]],
) -> None:
    text = suggest(rec(host, port) for host, port in observed)
    policy = load(text)
    for host, port in observed:
        assert admits(policy, host, port), (host, port, text)
    for rule in policy.allow.rules:
        assert not rule.is_too_broad()
        assert rule.port is not None
        if rule.kind is RuleKind.WILDCARD:
            assert "." in rule.value
    # An unseen port is never admitted for a seen name.
    for host, _ in observed:
        assert not admits(policy, host, 9)


# --------------------------------------------------------------------------- learning from logs


def test_learning_from_an_enforce_mode_log_admits_only_what_was_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [
        rec("pypi.org", 443, ALLOWED),
        rec("pypi.org", 443, ALLOWED),
        rec("example.com", 80, NO_RULE),
        rec("example.com", 80, NO_RULE),
        rec("tracker.test", 443, NO_RULE, protocol=AuditProtocol.HTTP),
        denied("evil.test", 443, Reason.DENY_RULE),
        denied("nx.test", 443, Reason.DNS_FAILURE),
        denied("intranet.test", 80, Reason.PRIVATE_ADDRESS),
        rec("93.184.216.34", 8080, NO_RULE, protocol=AuditProtocol.SOCKS5),
    ]
    text = suggest(records)
    assert allow_texts(text) == ["pypi.org:443"]
    assert '    # "example.com:80",  # denied in the log: no_allow_rule x2' in text
    assert '    # "tracker.test:443",  # denied in the log: no_allow_rule' in text
    assert '    # "93.184.216.34:8080",  # denied in the log: no_allow_rule' in text
    assert '    # "intranet.test:80",  # denied in the log: private_address' in text
    assert "#   evil.test:443: deny_rule x1" in text and "#   nx.test:443: dns_failure x1" in text
    policy = load(text)
    for host, port in (("example.com", 80), ("tracker.test", 443), ("evil.test", 443)):
        assert not admits(policy, host, port)
    assert "(1 allow, 0 deny, 0 allow_cidrs, 2 deny_cidrs; mode enforce)" in checked(
        tmp_path, text, capsys
    )


def test_a_destination_both_allowed_and_denied_is_admitted_with_a_note() -> None:
    # Logs of an enforcing run and a later one with the entry, read together.
    text = suggest([rec("api.test", 443, NO_RULE), rec("api.test", 443, ALLOWED)])
    assert allow_texts(text) == ["api.test:443"]
    assert '"api.test:443",  # 1 connection' in text
    assert "# NOTE: api.test:443 was also denied in the log (no_allow_rule)" in text


def test_learning_from_a_report_mode_log_admits_would_deny(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [
        rec("files.pythonhosted.org", 443, WOULD),
        rec("pypi.org", 443, WOULD, protocol=AuditProtocol.TCP),  # captured: counts like connect
        rec("github.com", 443, WOULD),
        rec("github.com", 443, (Verdict.WOULD_DENY, Reason.SNI_MISMATCH)),
        denied("nx.test", 443, Reason.DNS_FAILURE),
    ]
    text = suggest(records)
    assert allow_texts(text) == ["github.com:443", "pypi.org:443", "files.pythonhosted.org:443"]
    assert '"github.com:443",  # 2 connections' in text
    flat = " ".join(line.strip("# ") for line in text.splitlines())
    assert "although sni_mismatch closes such a connection in enforce mode" in flat
    assert "nx.test" not in " ".join(allow_texts(text))
    assert "(3 allow, 0 deny" in checked(tmp_path, text, capsys)


def test_base_policy_never_makes_the_own_listener_an_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = parse_policy(
        {"egress": {"allow_cidrs": ["127.0.0.0/8"], "allow_private": True}},
        env={},
        source="base.toml",
    )
    records = [
        rec("127.0.0.1", 22, NO_RULE),
        rec("127.0.0.1", 22, ALLOWED),
        denied("127.0.0.1", 3128, Reason.SELF_CONNECTION),
        rec("proxy.local.test", 3128, ALLOWED),
        denied("proxy.local.test", 3128, Reason.SELF_CONNECTION),
        rec("pypi.org", 443, ALLOWED),
    ]
    text = suggest(records, base=base)
    assert allow_texts(text) == ["pypi.org:443", "127.0.0.1:22"]  # let through once
    assert '    # "127.0.0.1:3128",  # denied in the log: self_connection' in text
    assert '    # "proxy.local.test:3128",  # 1 connection let through in the log; denied' in text
    plan = plan_suggestion(records, base=base)
    assert {(w.pattern, w.reason) for w in plan.withheld} == {
        ("127.0.0.1:3128", Reason.SELF_CONNECTION),
        ("proxy.local.test:3128", Reason.SELF_CONNECTION),
    }
    policy = load(text)
    assert admits(policy, "127.0.0.1", 22) and not admits(policy, "127.0.0.1", 3128)
    assert "(2 allow, 0 deny, 1 allow_cidrs, 2 deny_cidrs; mode enforce)" in checked(
        tmp_path, text, capsys
    )


def test_dns_records_support_an_entry_or_stay_a_hint_never_a_port_0_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = [
        rec("pypi.org", 443, ALLOWED),
        lookup("pypi.org"),
        lookup("pypi.org"),
        lookup("only-asked.test"),
        lookup("only-asked.test", WOULD),
        lookup("refused.test", NO_RULE),
        lookup("denied-too.test"),
        rec("denied-too.test", 443, NO_RULE),
    ]
    text = suggest(records)
    assert allow_texts(text) == ["pypi.org:443"]
    assert '"pypi.org:443",  # 1 connection, 2 lookups' in text
    assert not any(":0" in line for line in text.splitlines() if "(UTC)" not in line)
    assert "#   only-asked.test: allow, would_deny no_allow_rule" in text
    assert "#   refused.test: deny no_allow_rule" in text
    assert "#   denied-too.test: allow" in text
    assert '    # "denied-too.test:443",  # denied in the log: no_allow_rule' in text
    plan = plan_suggestion(records)
    assert [hint.name for hint in plan.lookups] == [
        "denied-too.test",
        "only-asked.test",
        "refused.test",
    ]
    assert plan.records == len(records) and plan.commented == 4
    policy = load(text)
    assert not admits(policy, "only-asked.test", 443)
    assert not admits(policy, "only-asked.test", 80)
    checked(tmp_path, text, capsys)


def test_dns_lookups_count_on_the_wildcard_that_admits_the_names() -> None:
    names = [f"s{i}.cdn.test" for i in range(3)]
    text = suggest([rec(name, 443) for name in names] + [lookup(name) for name in names])
    assert '"*.cdn.test:443",  # 3 connections, 3 lookups' in text
    assert "Names only asked" not in text


_verdict_reason = st.sampled_from(
    [
        ALLOWED,
        WOULD,
        NO_RULE,
        (Verdict.WOULD_DENY, Reason.SNI_MISMATCH),
        (Verdict.DENY, Reason.DNS_FAILURE),
        (Verdict.DENY, Reason.PRIVATE_ADDRESS),
        (Verdict.DENY, Reason.SELF_CONNECTION),
        (Verdict.DENY, Reason.DENY_RULE),
    ]
)
_host = st.one_of(_name, st.sampled_from(["10.0.0.5", "127.0.0.1", "93.184.216.34", "::1"]))
_logged = st.lists(
    st.tuples(_host, _port, _verdict_reason, st.sampled_from(list(AuditProtocol))), max_size=25
)


@settings(max_examples=150, deadline=None)
@given(_logged)
def test_every_entry_is_backed_by_a_let_through_record_with_a_port(
    logged: list[tuple[str, int, tuple[Verdict, Reason], AuditProtocol]],
) -> None:
    records = [
        rec(host, 0 if protocol is AuditProtocol.DNS else port, outcome, protocol=protocol)
        for host, port, outcome, protocol in logged
    ]
    policy = load(suggest(records))
    backed = {
        (r.host, r.port)
        for r in records
        if r.protocol is not AuditProtocol.DNS
        and (
            r.decision is not Verdict.DENY
            # a local destination held back only by its address class: learned with its grant
            or (r.reason is Reason.PRIVATE_ADDRESS and r.host in ("10.0.0.5", "127.0.0.1", "::1"))
        )
    }
    refused_self = {(r.host, r.port) for r in records if r.reason is Reason.SELF_CONNECTION}
    for host, port, _, _ in logged:  # a dns record's name on the port drawn with it too
        if admits(policy, host, port):
            assert (host, port) in backed and (host, port) not in refused_self
            if host in ("10.0.0.5", "127.0.0.1", "::1"):  # local: with its one-address grant
                assert policy.allow_cidr_for(ipaddress.ip_address(host)) is not None
    assert all(rule.port for rule in policy.allow.rules)
