"""What `serve` makes for credential brokering before it serves: the operator's CA and the
broker holding the [[secret]] values.

Unlike `run`, `serve` has no child whose trust store it builds: its clients must already
trust the CA it signs with, so the operator gives one (`[tls] ca_cert` / `ca_key`, or
`--ca-cert` / `--ca-key`, the flags winning as `--upstream` and `--nameserver` do over
their policy keys). Everything is checked at start, before a port is opened or a worker
forked: a policy that needs termination without a CA, a CA that cannot be used, a value
that cannot be had and an `origin_ca` that does not load each end serve with exit 2 and a
message that says what to do, never at a client's first request.

The broker is made once per serve: a reload (SIGHUP, --watch-policy) changes the [egress]
decisions, not the bindings, the CA or the budgets' counters.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from egressbox.core.errors import EgressboxError
from egressbox.core.policy import Policy
from egressbox.core.secrets import PLACEHOLDER_PREFIX, RequestRule, SecretError

if TYPE_CHECKING:
    from egressbox.proxy.broker import Broker
    from egressbox.proxy.ca import CertificateAuthority

# How to make a CA an operator can give serve (said when none is given).
MAKE_CA: Final = (
    "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 "
    "-subj '/CN=egressbox proxy CA' -keyout ca.key -out ca.pem "
    "-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign"
)


class ServeTlsError(EgressboxError):
    """serve cannot terminate what its policy asks it to (a usage error: exit 2)."""


def ca_paths(policy: Policy, ca_cert: str | None, ca_key: str | None) -> tuple[str, str] | None:
    """The operator's CA files: the flags when given (both: checked by usage_problem), else
    the policy's [tls] ca_cert and ca_key; None when neither names one."""
    if ca_cert is not None and ca_key is not None:
        return ca_cert, ca_key
    tls = policy.tls
    if tls.ca_cert is not None and tls.ca_key is not None:
        return tls.ca_cert, tls.ca_key
    return None


def serve_broker(
    policy: Policy, paths: tuple[str, str] | None, rules: Sequence[RequestRule]
) -> Broker | None:
    """The broker serve's proxies share (None when the policy terminates nothing), its
    values read and its CA and origin CAs loaded; ServeTlsError says why it cannot be.
    `rules`: the policy's request rules as one process enforces them (workers.share_rules)."""
    if not policy.secrets and not policy.request_rules:
        return None
    if paths is None:
        raise ServeTlsError(_needs_ca(policy))
    from egressbox.proxy.broker import Broker
    from egressbox.proxy.ca import CaError, CertificateAuthority

    try:
        ca = CertificateAuthority.load(*paths)
    except CaError as exc:
        raise ServeTlsError(f"[tls] CA: {exc}") from None
    broker = Broker(
        policy.secrets,
        rules,
        ca=ca,
        origin_ca=policy.tls.origin_ca,
        placeholders={spec.name: stable_placeholder(ca, spec.name) for spec in policy.secrets},
    )
    try:
        broker.load()
    except SecretError as exc:
        raise ServeTlsError(str(exc)) from None
    try:
        broker.origin_context()
    except (OSError, ssl.SSLError) as exc:
        raise ServeTlsError(
            f"[tls] origin_ca {policy.tls.origin_ca}: cannot load it as PEM CA certificates: "
            f"{exc.strerror or exc}"
        ) from None
    return broker


def stable_placeholder(ca: CertificateAuthority, name: str) -> str:
    """serve's placeholder for `name`: the same on every restart and on every instance that
    shares the operator's CA (clients are configured with it once), and unguessable without
    the CA's key. The shape of `run`'s, so the proxy recognises it the same way."""
    return f"{PLACEHOLDER_PREFIX}{name}-{ca.derived_hex('egressbox placeholder ' + name)}"


def _needs_ca(policy: Policy) -> str:
    what = [
        f"[[secret]] {', '.join(s.name for s in policy.secrets)}" if policy.secrets else "",
        "[[request_rule]]" if policy.request_rules else "",
    ]
    return (
        f"{' and '.join(w for w in what if w)}: serve terminates TLS to these hosts and signs "
        "their certificates with a CA your clients trust, which it does not make up: give it "
        "as [tls] ca_cert and ca_key (or --ca-cert and --ca-key), the key readable by its "
        f"owner only. One can be made with: {MAKE_CA}"
    )


def unchanged_on_reload(old: Policy | None, new: Policy) -> str:
    """A warning when a reloaded policy changes what is fixed at start ("" when not)."""
    if old is None:
        return ""
    changed = [
        key
        for key, before, after in (
            ("[[secret]]", old.secrets, new.secrets),
            ("[[request_rule]]", old.request_rules, new.request_rules),
            ("[tls]", old.tls, new.tls),
        )
        if before != after
    ]
    if not changed:
        return ""
    return (
        f"warning: the reloaded policy changes {', '.join(changed)}, which serve reads at "
        "start only: the bindings, budgets and CA stay as they were until a restart"
    )
