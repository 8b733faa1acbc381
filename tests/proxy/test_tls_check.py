"""The TLS name check's judgement (sni.name_check): which ClientHello may open a tunnel.

Pure: a policy, the decision that admitted the tunnel and what the reader made of
its first bytes in; None (go ahead) or an `sni_mismatch` decision out. The proxy
around it is tested in tests/proxy/test_tls_name_check.py.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from egressbox.core.decide import Decision
from egressbox.core.errors import PolicyError, Reason, Verdict
from egressbox.core.policy import Mode, Policy, TlsNameCheck, parse_policy
from egressbox.protocols.tls import ClientHello, Malformed, TlsError
from egressbox.proxy.tls_check import checks_names, host_check, name_check

POLICY = parse_policy(
    {
        "egress": {
            "allow": ["cdn.example:443", "*.ok.example", "203.0.113.7", "[2001:db8::7]"],
            "deny": ["blocked.ok.example"],
        }
    },
    env={},
)
REPORT = parse_policy(
    {"egress": {"allow": ["cdn.example:443", "203.0.113.7"], "mode": "report"}}, env={}
)


def admitted(host: str, port: int = 443) -> Decision:
    ip = ipaddress.ip_address("203.0.113.7")
    return Decision(Verdict.ALLOW, Reason.ALLOWED, host, port, (ip,), "rule", "allowed")


def hello(name: str | None, ech: bool = False) -> ClientHello:
    return ClientHello(name, ech)


@pytest.mark.parametrize(
    "sni",
    [
        "cdn.example",
        "CDN.Example",  # case
        "cdn.example.",  # one trailing dot
        None,  # no SNI: the server's default name
    ],
)
def test_the_target_or_no_name_goes_ahead(sni: str | None) -> None:
    assert name_check(POLICY, admitted("cdn.example"), hello(sni)) is None


def test_an_idn_target_matches_its_a_label() -> None:
    # The CONNECT target is normalized when it is decided; the SNI exactly the same way.
    assert (
        name_check(POLICY, admitted("xn--bcher-kva.ok.example"), hello("XN--BCHER-KVA.ok.example"))
        is None
    )


@pytest.mark.parametrize(
    "sni",
    [
        "other.example",
        "sub.cdn.example",
        "ok.example",
        "x.ok.example",  # allowed too, but not the target: still another host
        "203.0.113.7",  # an IP literal in the SNI is not the name either
    ],
)
def test_another_name_is_a_mismatch(sni: str) -> None:
    refusal = name_check(POLICY, admitted("cdn.example"), hello(sni))
    assert refusal is not None
    assert (refusal.verdict, refusal.reason) == (Verdict.DENY, Reason.SNI_MISMATCH)
    # The record is about the target as decided, with its checked addresses.
    assert (refusal.host, refusal.port) == ("cdn.example", 443)
    assert refusal.addresses == admitted("cdn.example").addresses
    assert not refusal.allowed


@pytest.mark.parametrize("sni", ["a b", "x/y", "127.1", "-bad.example", "a" * 300, "xn--zz"])
def test_a_server_name_that_is_no_host_name_is_a_mismatch(sni: str) -> None:
    refusal = name_check(POLICY, admitted("cdn.example"), hello(sni))
    assert refusal is not None and refusal.reason is Reason.SNI_MISMATCH


def test_ech_outer_name_must_be_the_target_too() -> None:
    assert name_check(POLICY, admitted("cdn.example"), hello("cdn.example", ech=True)) is None
    refusal = name_check(POLICY, admitted("cdn.example"), hello("public.example", ech=True))
    assert refusal is not None and refusal.reason is Reason.SNI_MISMATCH
    assert "ECH" in refusal.detail


def test_ech_without_any_outer_name_is_a_mismatch() -> None:
    refusal = name_check(POLICY, admitted("cdn.example"), hello(None, ech=True))
    assert refusal is not None and refusal.reason is Reason.SNI_MISMATCH


def test_a_malformed_hello_is_refused() -> None:
    refusal = name_check(POLICY, admitted("cdn.example"), Malformed(TlsError("an empty record")))
    assert refusal is not None
    assert (refusal.verdict, refusal.reason) == (Verdict.DENY, Reason.SNI_MISMATCH)
    assert "an empty record" in refusal.detail


@pytest.mark.parametrize("target", ["203.0.113.7", "2001:db8::7"])
@pytest.mark.parametrize(
    ("sni", "passes"),
    [
        ("x.ok.example", True),  # a name the rules admit (on this port)
        ("cdn.example", True),  # cdn.example:443 admits port 443
        ("blocked.ok.example", False),  # a deny entry beats the wildcard
        ("unlisted.example", False),  # no allow entry
        (None, True),
    ],
)
def test_an_ip_literal_target_takes_a_name_the_rules_admit(
    target: str, sni: str | None, passes: bool
) -> None:
    result = name_check(POLICY, admitted(target), hello(sni))
    if passes:
        assert result is None
    else:
        assert result is not None and result.reason is Reason.SNI_MISMATCH
        assert result.host == target


def test_an_ip_literal_target_and_a_name_allowed_on_another_port() -> None:
    refusal = name_check(POLICY, admitted("203.0.113.7", 8443), hello("cdn.example"))
    assert refusal is not None and refusal.reason is Reason.SNI_MISMATCH


def test_report_mode_audits_would_deny_and_lets_it_through() -> None:
    refusal = name_check(REPORT, admitted("cdn.example"), hello("other.example"))
    assert refusal is not None
    assert (refusal.verdict, refusal.reason) == (Verdict.WOULD_DENY, Reason.SNI_MISMATCH)
    assert refusal.allowed
    assert name_check(REPORT, admitted("203.0.113.7"), hello("unlisted.example")) is not None


def test_the_policy_key() -> None:
    assert POLICY.tls_name_check is TlsNameCheck.ENFORCE
    assert Policy().tls_name_check is TlsNameCheck.ENFORCE
    assert checks_names(POLICY)
    off = parse_policy({"egress": {"allow": ["a.example"], "tls_name_check": "off"}}, env={})
    assert off.tls_name_check is TlsNameCheck.OFF
    assert not checks_names(off)
    assert any("tls_name_check" in warning for warning in off.warnings)
    assert not any("tls_name_check" in warning for warning in POLICY.warnings)
    assert REPORT.mode is Mode.REPORT


@pytest.mark.parametrize("value", ["on", "OFF", "", 1, True, ["off"]])
def test_an_unknown_value_is_an_error_with_its_key_path(value: object) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy({"egress": {"allow": ["a.example"], "tls_name_check": value}}, env={})
    assert caught.value.problems == [
        f'egress.tls_name_check: must be "enforce" or "off", got {value!r}'
    ]


def test_check_warns_when_the_check_is_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from egressbox.cli import main

    path = tmp_path / "off.toml"
    path.write_text('[egress]\nallow = ["pypi.org:443"]\ntls_name_check = "off"\n')
    assert main(["check", str(path)]) == 0
    assert '  warning: tls_name_check = "off": ' in capsys.readouterr().out
    path.write_text('[egress]\nallow = ["pypi.org:443"]\n')
    assert main(["check", str(path)]) == 0
    assert "tls_name_check" not in capsys.readouterr().out
    path.write_text('[egress]\nallow = ["pypi.org:443"]\ntls_name_check = "of"\n')
    assert main(["check", str(path)]) == 2
    assert "egress.tls_name_check: must be" in capsys.readouterr().out


# -- the Host header of a captured plain-HTTP connection ------------------------------------


def _admitted(host: str, port: int = 80) -> Decision:
    from egressbox.core.decide import parse_target

    target = parse_target(host, port)
    return Decision(Verdict.ALLOW, Reason.ALLOWED, target.host.text, port, (), None, "")


@pytest.mark.parametrize(
    ("head", "passes"),
    [
        (b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n", True),
        (b"GET / HTTP/1.1\r\nhost: ORIGIN.test:80\r\n\r\n", True),
        (b"GET / HTTP/1.0\r\n\r\n", True),  # no Host: the origin's default, the same address
        (b"GET / HTTP/1.1\r\nHost: other.example\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: origin.test\r\nHost: other.example\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: origin.test\r\n", False),  # never ends within the bound
    ],
)
def test_a_captured_requests_host_must_be_the_name_it_was_decided_for(
    head: bytes, passes: bool
) -> None:
    policy = parse_policy({"egress": {"allow": ["origin.test"]}}, env={})
    refusal = host_check(policy, _admitted("origin.test"), head)
    assert (refusal is None) is passes
    if refusal is not None:
        assert refusal.reason.value == "host_mismatch" and not refusal.allowed


def _admitted_at(host: str, port: int, addresses: tuple[str, ...]) -> Decision:
    from egressbox.core.decide import parse_target

    target = parse_target(host, port)
    ips = tuple(ipaddress.ip_address(a) for a in addresses)
    return Decision(Verdict.ALLOW, Reason.ALLOWED, target.host.text, port, ips, None, "")


@pytest.mark.parametrize(
    ("decided", "host", "passes"),
    [
        # Decided as localhost (a synthetic address, or 127.0.0.1 under a localhost entry).
        ("localhost", "localhost:5000", True),
        ("localhost", "LOCALHOST.:5000", True),
        ("localhost", "127.0.0.1:5000", True),  # an address the connection was dialled to
        ("localhost", "[::1]:5000", False),  # not among the dialled addresses
        ("localhost", "127.0.0.2:5000", False),
        ("localhost", "evil.example", False),
        ("localhost", "registry.localhost:5000", False),
        # Decided as the address 127.0.0.1 (an IP entry): localhost is what the child's
        # hosts file calls it; any other name must be admitted by the policy itself.
        ("127.0.0.1", "localhost:5000", True),
        ("127.0.0.1", "Localhost", True),
        ("127.0.0.1", "127.0.0.1:5000", True),
        ("127.0.0.1", "evil.example:5000", False),
        ("127.0.0.1", "foo.localhost:5000", False),
        ("10.0.0.5", "localhost:5000", False),  # not a loopback address
    ],
)
def test_a_captured_hosts_other_spelling_of_the_same_host_passes(
    decided: str, host: str, passes: bool
) -> None:
    policy = parse_policy({"egress": {"allow": [f"{decided}:5000"]}}, env={})
    admitted = _admitted_at(decided, 5000, ("127.0.0.1",) if decided == "localhost" else ())
    head = f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    refusal = host_check(policy, admitted, head)
    assert (refusal is None) is passes, refusal
    if refusal is not None:
        assert refusal.reason is Reason.HOST_MISMATCH
