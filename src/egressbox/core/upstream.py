"""Where to chain to: an upstream proxy's URL, parsed into a value (`[egress] upstream`).

The policy reads it, the proxy dials through it (protocols/upstream.py holds the handshakes).
Credentials never come from the URL (a command line is visible in the process list, a policy
file is shared): they are read from the environment variables named here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from egressbox.core.errors import HostError

ENV_USER = "EGRESSBOX_UPSTREAM_USER"
ENV_PASSWORD = "EGRESSBOX_UPSTREAM_PASSWORD"  # noqa: S105 (a variable's name, not a secret)


class UpstreamKind(StrEnum):
    HTTP = "http"  # an HTTP proxy, asked with CONNECT
    SOCKS5 = "socks5"


class UpstreamTarget(StrEnum):
    """What the upstream is asked for (`[egress] upstream_target`, `--upstream-target`)."""

    ADDRESS = "address"  # the checked IP address: pinning holds
    NAME = "name"  # the requested name: the upstream resolves it (pinning: partial)


@dataclass(frozen=True, slots=True)
class UpstreamProxy:
    """Where to chain to (no credentials: see UpstreamCredentials)."""

    kind: UpstreamKind
    host: str  # a normalized name or canonical IP text
    port: int
    target: UpstreamTarget = UpstreamTarget.ADDRESS

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.kind.value}://{host}:{self.port}"

    @property
    def pinning(self) -> str:
        """`full` when the upstream is asked for the checked address, else `partial`."""
        return "full" if self.target is UpstreamTarget.ADDRESS else "partial"


def parse_upstream(url: str, target: str = UpstreamTarget.ADDRESS) -> UpstreamProxy:
    """`http://HOST:PORT` or `socks5://HOST:PORT` (a name or an IP, `[v6]` in brackets).

    ValueError says what is wrong without echoing the URL (it could carry a password)."""
    try:
        chosen = UpstreamTarget(target)
    except ValueError:
        raise ValueError(
            f'the upstream target must be "address" or "name", got {target!r}'
        ) from None
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError("an upstream is a URL: http://HOST:PORT or socks5://HOST:PORT")
    kind = _kind(scheme.lower())
    authority = rest[:-1] if rest.endswith("/") else rest
    if "@" in authority:
        raise ValueError(
            f"credentials do not belong in the upstream URL (a command line and a policy "
            f"file are readable by others): set {ENV_USER} and {ENV_PASSWORD}"
        )
    if any(c in authority for c in "/?#"):
        raise ValueError("an upstream URL has no path, query or fragment: scheme://HOST:PORT")
    from egressbox.core.hosts import parse_authority

    try:
        host, port = parse_authority(authority)
    except HostError as exc:
        raise ValueError(f"the upstream URL's host:port is not usable ({exc})") from None
    return UpstreamProxy(kind, host.text, port, chosen)


def _kind(scheme: str) -> UpstreamKind:
    if scheme == "http":
        return UpstreamKind.HTTP
    if scheme == "socks5":
        return UpstreamKind.SOCKS5
    if scheme == "socks5h":
        raise ValueError(
            "use socks5://HOST:PORT; whether the upstream gets the name or the checked address "
            'is upstream_target ("address" or "name")'
        )
    if scheme == "https":
        raise ValueError("a TLS connection to the upstream proxy (https://) is not supported")
    raise ValueError("the upstream URL's scheme must be http or socks5")
