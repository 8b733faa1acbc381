"""What `run` makes for credential brokering before it forks: the child's placeholders and
the run's CA, and what the child's view holds of them.

The child gets a placeholder in each [[secret]] variable's place (the real variable is held
back even when granted) and trusts the run's CA through its constructed view: a bundle of
the system's CAs plus ours, bound read-only over /etc/ssl/certs/ca-certificates.crt (the
host's trust store is never touched), and the variables the usual clients read. The values
themselves are read later, by the proxy only (proxy/broker.py, in supervise._make_proxy).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Final, NamedTuple

from egressbox.core.policy import Policy
from egressbox.proxy.broker import Broker, placeholder
from egressbox.proxy.ca import CertificateAuthority

# Where the child's view holds the bundle: Debian's and Ubuntu's system bundle, the file
# OpenSSL, curl, git and Python read by default there (Fedora's path is a symlink to the
# same kind of file; the variables below cover the clients that look elsewhere).
CA_BUNDLE_PATH: Final = "/etc/ssl/certs/ca-certificates.crt"
# The variables each client reads for its CA bundle: OpenSSL (and httpx), requests, curl,
# git, pip; Node adds NODE_EXTRA_CA_CERTS to its own built-in list.
CA_VARIABLES: Final = (
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "PIP_CERT",
    "NODE_EXTRA_CA_CERTS",
)


class RunBrokering(NamedTuple):
    """The placeholders (name -> placeholder) and CA of one run."""

    placeholders: Mapping[str, str]
    ca: CertificateAuthority
    held: tuple[str, ...] = ()  # the from_env variables the values come from

    def child_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """`env` without the variables the values come from, with the placeholders in the
        [[secret]] variables' place (even when granted) and the CA variables."""
        out = {name: value for name, value in env.items() if name not in self.held}
        out.update(self.placeholders)
        out.update(dict.fromkeys(CA_VARIABLES, CA_BUNDLE_PATH))
        return out

    def files(self) -> tuple[tuple[str, str], ...]:
        """The bundle the child's view holds at CA_BUNDLE_PATH (WorldSpec.files)."""
        return ((CA_BUNDLE_PATH, system_bundle() + self.ca.cert_pem),)

    def broker(self, policy: Policy | None) -> Broker | None:
        """The proxy's broker for the policy loaded since (same file: same names)."""
        if policy is None or (not policy.secrets and not policy.request_rules):
            return None
        return Broker(
            policy.secrets,
            policy.request_rules,
            ca=self.ca,
            origin_ca=policy.tls.origin_ca,
            placeholders=self.placeholders,
        )

    def loaded(self, policy: Policy | None, given: Mapping[str, str] | None) -> Broker | None:
        """broker() with every value read now (`given`: the library's values by name).
        SecretError names an entry whose value cannot be had; ValueError an unknown name."""
        broker = self.broker(policy)
        if broker is None:
            return None
        given = dict(given or {})
        unknown = sorted(set(given) - {spec.name for spec in broker.secrets})
        if unknown:
            raise ValueError(
                f"secrets= names no [[secret]] entry of the policy: {', '.join(unknown)}"
            )
        for name, value in given.items():
            broker.set_value(name, value)
        broker.load(skip=given)
        return broker


def for_run(
    names: tuple[str, ...], terminate: bool, held: tuple[str, ...] = ()
) -> RunBrokering | None:
    """Placeholders for `names` and a fresh CA, when the policy terminates anything."""
    if not terminate and not names:
        return None
    ca = CertificateAuthority.generate()
    return RunBrokering({name: placeholder(name) for name in names}, ca, held)


def system_bundle() -> str:
    """The host's CA bundle as text ("" when it has none), ending with a newline."""
    paths = ssl.get_default_verify_paths()
    for path in (paths.cafile, paths.openssl_cafile, CA_BUNDLE_PATH):
        if not path:
            continue
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        return text if text.endswith("\n") else text + "\n"
    return ""
