"""The broker's values and budgets (src/egressbox/proxy/broker.py), and the operator's CA
(src/egressbox/proxy/ca.py), without a proxy in between.

A from_command that hangs is killed with everything it started (judged from /proc after);
its messages name the secret and the command, never a value. A budget with a `window`
starts again once the window has passed (a clock the test moves); `serve --workers`
divides the budgets. The operator's CA: an RSA key is accepted, a certificate that is no CA
is refused, and leaves are made anew before they run out.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from egressbox.core.errors import PolicyError, Reason
from egressbox.core.policy import parse_policy
from egressbox.core.secrets import RequestRule, SecretError
from egressbox.proxy import broker as broker_module
from egressbox.proxy import ca as ca_module
from egressbox.proxy.broker import Broker, read_value
from egressbox.proxy.ca import CaError, CertificateAuthority
from egressbox.serve.workers import share_rules

VALUE = "real-value-7d1c"


def _policy(**rule: Any) -> Any:
    data = {
        "egress": {"allow": ["api.example:443"]},
        "secret": [{"name": "TOK", "from_command": ["echo", VALUE], "hosts": ["api.example:443"]}],
        "request_rule": [{"hosts": ["api.example:443"], **rule}],
    }
    return parse_policy(data, env={})


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie awaiting its reaper
    except FileNotFoundError:
        return True


def test_a_hanging_from_command_is_killed_with_what_it_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(broker_module, "COMMAND_TIMEOUT", 0.5)
    pidfile = tmp_path / "pid"
    script = f"sleep 30 & echo $! > {pidfile}; wait"
    spec = _policy().secrets[0]._replace(where=("sh", "-c", script))
    started = time.monotonic()
    with pytest.raises(SecretError) as caught:
        read_value(spec, {})
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert message.startswith("[[secret]] TOK: from_command sh -c ")
    assert message.endswith("took longer than 0.5s")
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the command's own child outlived the timeout"


def test_a_value_is_read_and_never_shown() -> None:
    broker = Broker.for_policy(_policy())
    assert broker is not None
    broker.load()
    assert VALUE not in repr(broker)
    _, fields = broker.rewrite("api.example", 443, "/", [("X", broker.placeholders["TOK"])])
    assert fields == [("X", VALUE)]


def test_a_windowed_budget_starts_again() -> None:
    broker = Broker.for_policy(_policy(max_requests=2, max_request_bytes=1000, window=60))
    assert broker is not None
    now = [1000.0]
    broker.clock = lambda: now[0]
    judge = broker.judge
    assert judge("api.example", 443, "GET", "/", 100) is None
    assert judge("api.example", 443, "GET", "/", 100) is None
    refused = judge("api.example", 443, "GET", "/", 100)
    assert refused == (Reason.BUDGET_EXCEEDED, "max_requests (2) reached in this 60s window")
    now[0] += 59.0
    assert judge("api.example", 443, "GET", "/", 100) is not None
    now[0] += 1.0  # the window has passed
    assert judge("api.example", 443, "GET", "/", 100) is None
    # Bytes too: a chunked body over the budget in this window.
    assert broker.more_bytes("api.example", 443, 901) is not None
    now[0] += 60.0
    assert judge("api.example", 443, "GET", "/", 900) is None


def test_without_a_window_the_budget_is_for_the_run() -> None:
    broker = Broker.for_policy(_policy(max_requests=1))
    assert broker is not None
    now = [0.0]
    broker.clock = lambda: now[0]
    assert broker.judge("api.example", 443, "GET", "/", 10) is None
    now[0] += 10 * 365 * 86400.0
    assert broker.judge("api.example", 443, "GET", "/", 10) is not None


@pytest.mark.parametrize(
    ("rule", "problem"),
    [
        ({"window": 0, "max_requests": 1}, "request_rule[0].window"),
        ({"window": "1h", "max_requests": 1}, "request_rule[0].window"),
        ({"window": 60}, "needs max_requests or max_request_bytes"),
    ],
)
def test_bad_windows_are_reported_with_their_key(rule: dict[str, Any], problem: str) -> None:
    with pytest.raises(PolicyError) as caught:
        _policy(**rule)
    assert problem in str(caught.value)


def test_workers_divide_the_budgets() -> None:
    rule = RequestRule(hosts=(), max_requests=1000, max_request_bytes=10, window=60)
    (shared,) = share_rules([rule], 3)
    assert (shared.max_requests, shared.max_request_bytes, shared.window) == (334, 4, 60)
    assert share_rules([rule], 1) == (rule,)


def _write_ca(tmp: Path, *, ca: bool, bits: int = 2048) -> tuple[str, str]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "operator")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "ca.pem", tmp / "ca.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return str(cert_path), str(key_path)


def test_an_rsa_operator_ca_signs_leaves(tmp_path: Path) -> None:
    paths = _write_ca(tmp_path, ca=True)
    ca, again = CertificateAuthority.load(*paths), CertificateAuthority.load(*paths)
    assert ca.server_context("api.example") is ca.server_context("api.example")
    # serve's placeholders: the same for every process that loads this CA, per name.
    assert ca.derived_hex("a") == again.derived_hex("a") != ca.derived_hex("b")


def test_a_certificate_that_is_no_ca_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CaError, match="not a CA certificate"):
        CertificateAuthority.load(*_write_ca(tmp_path, ca=False))


def test_a_leaf_is_made_anew_before_it_runs_out() -> None:
    ca = CertificateAuthority.generate()
    now = [0.0]
    ca.clock = lambda: now[0]
    first = ca.server_context("api.example")
    now[0] += ca_module.LEAF_RENEW_S - 1
    assert ca.server_context("api.example") is first
    now[0] += 2
    assert ca.server_context("api.example") is not first


def test_a_from_command_that_writes_endlessly_is_cut_and_killed(tmp_path: Path) -> None:
    """Reading stops just past 64 KiB: the command (and what it started) is killed and the
    entry named, long before the time limit, and the output never filled our memory."""
    pidfile = tmp_path / "pid"
    script = f"yes 0123456789abcdef & echo $! > {pidfile}; wait"
    spec = _policy().secrets[0]._replace(where=("sh", "-c", script))
    started = time.monotonic()
    with pytest.raises(SecretError) as caught:
        read_value(spec, {})
    assert time.monotonic() - started < broker_module.COMMAND_TIMEOUT / 3
    message = str(caught.value)
    assert message.startswith("[[secret]] TOK: from_command sh -c "), message
    assert message.endswith("printed more than 64 KiB"), message
    assert "\n" not in message
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the writing command outlived the cut"


def test_a_value_of_exactly_64_kib_and_its_line_end_is_read() -> None:
    spec = (
        _policy()
        .secrets[0]
        ._replace(where=("sh", "-c", "head -c 65536 /dev/zero | tr '\\0' x; echo"))
    )
    assert read_value(spec, {}) == "x" * 65536
    longer = spec._replace(where=("sh", "-c", "head -c 65537 /dev/zero | tr '\\0' x; echo"))
    with pytest.raises(SecretError, match="printed more than 64 KiB"):
        read_value(longer, {})
