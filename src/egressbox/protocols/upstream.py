"""An upstream proxy to chain to: its URL, its credentials, and the client side of the two
handshakes that open a connection through it (HTTP CONNECT, SOCKS5). Sans-IO and pure.

egressbox decides every request by its own policy first (the gate), exactly as without an
upstream; only the last hop changes: instead of dialing a checked address itself, the
proxy asks the upstream for a connection to it. `UpstreamTarget.ADDRESS` (the default)
asks for the checked IP literal (`CONNECT 203.0.113.7:443`, SOCKS5 ATYP 1/4), so the
upstream connects where egressbox decided and pinning holds. `NAME` asks for the name
(`CONNECT pypi.org:443`, SOCKS5 ATYP 3) for upstreams that refuse IP literals or decide
by name themselves; the upstream then resolves the name on its own, so pinning holds
only as far as both resolvers agree: it is `partial`.

Credentials never come from the URL (a command line is visible in the process list, a
policy file is shared); `credentials_from_env` reads EGRESSBOX_UPSTREAM_USER and
EGRESSBOX_UPSTREAM_PASSWORD. Neither appears in any message or repr.

The handshakes: `start()` gives the first bytes to send, `feed()` takes what the
upstream answered and returns more bytes to send (possibly none); `done` says the
tunnel is open, and `trailing` holds the upstream's bytes after its reply (a server that
speaks first). A refusal raises `UpstreamRefusedError` with a failure code that the proxy
turns into its reply (egressbox.net.dial.DialFailure values). The CONNECT reply is read up
to the end of its head and judged by its status line only: a 2xx answer to CONNECT has
no body (RFC 9110 §9.3.6) and any other answer ends the connection, so nothing is
framed, and the one HTTP grammar (protocols/http1) stays the one that frames messages.
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from egressbox.core.errors import EgressboxError
from egressbox.core.ip import IPAddress
from egressbox.core.upstream import (
    ENV_PASSWORD,
    ENV_USER,
    UpstreamKind,
    UpstreamProxy,
)

# The upstream's reply to CONNECT: squid's and tinyproxy's heads are a few hundred bytes;
# 16 KiB bounds what a broken upstream can make us hold before we give up.
MAX_CONNECT_REPLY_HEAD = 16 * 1024
# RFC 1929: the username and the password are each 1-255 bytes.
MAX_SOCKS_CREDENTIAL = 255
# RFC 1928 §5: a domain name is one length byte and 1-255 bytes.
MAX_SOCKS_NAME = 255

# Failure codes (egressbox.net.dial.DialFailure values; the proxy maps them to replies).
UPSTREAM_FAILED = "upstream_failed"  # no tunnel through the upstream (unreachable, broken)
UPSTREAM_DENIED = "upstream_denied"  # the upstream refused the destination itself
CONNECT_REFUSED = "connect_refused"
CONNECT_TIMEOUT = "connect_timeout"
NETWORK_UNREACHABLE = "network_unreachable"

_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?")


@dataclass(frozen=True, slots=True)
class UpstreamCredentials:
    """Basic (HTTP) or RFC 1929 (SOCKS5) credentials; never shown, not even the user."""

    user: str = field(repr=False)
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return "UpstreamCredentials(<hidden>)"


@dataclass(frozen=True, slots=True)
class Upstream:
    """An upstream proxy with the credentials to use there (what the proxy dials through)."""

    proxy: UpstreamProxy
    credentials: UpstreamCredentials | None = None


class UpstreamRefusedError(EgressboxError):
    """No tunnel through the upstream. `failure` is a failure code (above); `retry` says
    the upstream could not reach that one address, so another checked address may work."""

    def __init__(self, failure: str, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.failure = failure
        self.retry = retry


# -- configuration ------------------------------------------------------------------------


def credentials_from_env(env: Mapping[str, str]) -> UpstreamCredentials | None:
    """EGRESSBOX_UPSTREAM_USER and EGRESSBOX_UPSTREAM_PASSWORD, both or neither."""
    user, password = env.get(ENV_USER), env.get(ENV_PASSWORD)
    if user is None and password is None:
        return None
    if not user or not password:
        raise ValueError(f"set both {ENV_USER} and {ENV_PASSWORD}, or neither")
    if ":" in user:
        raise ValueError(f"{ENV_USER} may not contain ':' (Basic credentials split there)")
    for name, value in ((ENV_USER, user), (ENV_PASSWORD, password)):
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
            raise ValueError(f"{name} holds a control character")
        if len(value.encode()) > MAX_SOCKS_CREDENTIAL:
            raise ValueError(f"{name} is longer than {MAX_SOCKS_CREDENTIAL} bytes")
    return UpstreamCredentials(user, password)


# -- HTTP CONNECT -------------------------------------------------------------------------


def connect_authority(host: str | IPAddress, port: int) -> str:
    """`host:port` for a CONNECT line; an IPv6 address in brackets."""
    text = str(host)
    return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"


class HttpConnectHandshake:
    """`CONNECT host:port` to an HTTP upstream, and its reply."""

    def __init__(
        self, host: str | IPAddress, port: int, credentials: UpstreamCredentials | None
    ) -> None:
        self.authority = connect_authority(host, port)
        self._credentials = credentials
        self._buffer = b""
        self.done = False
        self.trailing = b""

    def start(self) -> bytes:
        lines = [f"CONNECT {self.authority} HTTP/1.1", f"Host: {self.authority}"]
        if self._credentials is not None:
            pair = f"{self._credentials.user}:{self._credentials.password}".encode()
            lines.append(f"Proxy-Authorization: Basic {base64.b64encode(pair).decode()}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.trailing += data
            return b""
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n", 0, MAX_CONNECT_REPLY_HEAD)
        if end < 0:
            if len(self._buffer) >= MAX_CONNECT_REPLY_HEAD:
                raise UpstreamRefusedError(
                    UPSTREAM_FAILED, "the upstream proxy's reply head is too long"
                )
            return b""
        status_line = self._buffer[: self._buffer.find(b"\r\n")]
        match = _STATUS_LINE.fullmatch(status_line)
        if match is None:
            raise UpstreamRefusedError(
                UPSTREAM_FAILED, "the upstream proxy's reply is not HTTP/1.x"
            )
        self._judge(int(match.group(1)))
        self.done = True
        self.trailing = self._buffer[end + 4 :]
        self._buffer = b""
        return b""

    def _judge(self, status: int) -> None:
        if 200 <= status < 300:
            return
        where = f"CONNECT {self.authority}"
        if status == 407:
            wanted = "refused the credentials" if self._credentials else "wants credentials"
            hint = "" if self._credentials else f" (set {ENV_USER} and {ENV_PASSWORD})"
            raise UpstreamRefusedError(UPSTREAM_FAILED, f"the upstream proxy {wanted}{hint}")
        if status in (403, 405):
            raise UpstreamRefusedError(
                UPSTREAM_DENIED, f"the upstream proxy refused {where} ({status})"
            )
        if status == 504:
            message = f"the upstream proxy timed out on {where} ({status})"
            raise UpstreamRefusedError(CONNECT_TIMEOUT, message, retry=True)
        if status in (502, 503):
            message = f"the upstream proxy could not connect for {where} ({status})"
            raise UpstreamRefusedError(UPSTREAM_FAILED, message, retry=True)
        raise UpstreamRefusedError(
            UPSTREAM_FAILED, f"the upstream proxy answered {where} with {status}"
        )


# -- SOCKS5 (RFC 1928, RFC 1929) ------------------------------------------------------------

_SOCKS_VERSION = 5
_NO_AUTH = 0x00
_USER_PASSWORD = 0x02
_NO_ACCEPTABLE = 0xFF
_AUTH_VERSION = 1
_CMD_CONNECT = 1
_ATYP_IPV4, _ATYP_DOMAIN, _ATYP_IPV6 = 1, 3, 4
# RFC 1928 §6 reply codes -> (failure code, a few words, may another address work).
_SOCKS_REPLIES: dict[int, tuple[str, str, bool]] = {
    0x01: (UPSTREAM_FAILED, "general failure", True),
    0x02: (UPSTREAM_DENIED, "connection not allowed by its ruleset", False),
    0x03: (NETWORK_UNREACHABLE, "network unreachable", True),
    0x04: (NETWORK_UNREACHABLE, "host unreachable", True),
    0x05: (CONNECT_REFUSED, "connection refused", True),
    0x06: (CONNECT_TIMEOUT, "TTL expired", True),
    0x07: (UPSTREAM_FAILED, "command not supported", False),
    0x08: (UPSTREAM_FAILED, "address type not supported", False),
}


class Socks5Handshake:
    """Greeting, optional username/password, CONNECT; then the upstream's reply."""

    def __init__(
        self, host: str | IPAddress, port: int, credentials: UpstreamCredentials | None
    ) -> None:
        self._request = _socks_request(host, port)
        self._credentials = credentials
        self._where = connect_authority(host, port)
        self._buffer = b""
        self._step = "method"
        self.done = False
        self.trailing = b""

    def start(self) -> bytes:
        methods = [_NO_AUTH] if self._credentials is None else [_NO_AUTH, _USER_PASSWORD]
        return bytes([_SOCKS_VERSION, len(methods), *methods])

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.trailing += data
            return b""
        self._buffer += data
        out = b""
        while not self.done:
            step = self._advance()
            if step is None:
                break
            out += step
        return out

    def _take(self, size: int) -> bytes | None:
        if len(self._buffer) < size:
            return None
        taken, self._buffer = self._buffer[:size], self._buffer[size:]
        return taken

    def _advance(self) -> bytes | None:
        if self._step == "method":
            return self._method()
        if self._step == "auth":
            return self._auth()
        return self._reply()

    def _method(self) -> bytes | None:
        reply = self._take(2)
        if reply is None:
            return None
        if reply[0] != _SOCKS_VERSION:
            raise UpstreamRefusedError(UPSTREAM_FAILED, "the upstream proxy does not speak SOCKS5")
        if reply[1] == _NO_AUTH:
            self._step = "reply"
            return self._request
        if reply[1] == _USER_PASSWORD and self._credentials is not None:
            self._step = "auth"
            user = self._credentials.user.encode()
            password = self._credentials.password.encode()
            return bytes([_AUTH_VERSION, len(user)]) + user + bytes([len(password)]) + password
        if reply[1] == _USER_PASSWORD or reply[1] == _NO_ACCEPTABLE:
            hint = "" if self._credentials else f" (set {ENV_USER} and {ENV_PASSWORD})"
            raise UpstreamRefusedError(
                UPSTREAM_FAILED, f"the upstream SOCKS5 proxy accepts none of our methods{hint}"
            )
        raise UpstreamRefusedError(
            UPSTREAM_FAILED, "the upstream SOCKS5 proxy chose a method not offered"
        )

    def _auth(self) -> bytes | None:
        reply = self._take(2)
        if reply is None:
            return None
        if reply[0] != _AUTH_VERSION or reply[1] != 0:
            raise UpstreamRefusedError(
                UPSTREAM_FAILED, "the upstream SOCKS5 proxy refused the credentials"
            )
        self._step = "reply"
        return self._request

    def _reply(self) -> bytes | None:
        buf = self._buffer
        if len(buf) < 5:
            return None
        if buf[0] != _SOCKS_VERSION or buf[2] != 0:
            raise UpstreamRefusedError(
                UPSTREAM_FAILED, "the upstream SOCKS5 proxy's reply is malformed"
            )
        size = _reply_size(buf[3], buf[4])
        if len(buf) < size:
            return None
        code = buf[1]
        if code != 0:
            failure, words, retry = _SOCKS_REPLIES.get(
                code, (UPSTREAM_FAILED, f"reply code {code:#04x}", False)
            )
            message = f"the upstream SOCKS5 proxy could not connect to {self._where}: {words}"
            raise UpstreamRefusedError(failure, message, retry=retry)
        self.done = True
        self.trailing = buf[size:]
        self._buffer = b""
        return b""


def _reply_size(atyp: int, first: int) -> int:
    """Bytes of a whole reply: VER REP RSV ATYP BND.ADDR BND.PORT."""
    if atyp == _ATYP_IPV4:
        return 4 + 4 + 2
    if atyp == _ATYP_IPV6:
        return 4 + 16 + 2
    if atyp == _ATYP_DOMAIN:
        return 4 + 1 + first + 2
    raise UpstreamRefusedError(UPSTREAM_FAILED, "the upstream SOCKS5 proxy's reply is malformed")


def _socks_request(host: str | IPAddress, port: int) -> bytes:
    head = bytes([_SOCKS_VERSION, _CMD_CONNECT, 0])
    ip = _as_ip(host)
    if ip is None:
        name = str(host).encode("ascii")
        if not 0 < len(name) <= MAX_SOCKS_NAME:
            raise ValueError("a SOCKS5 domain name is 1-255 bytes")
        return head + bytes([_ATYP_DOMAIN, len(name)]) + name + port.to_bytes(2, "big")
    atyp = _ATYP_IPV4 if ip.version == 4 else _ATYP_IPV6
    return head + bytes([atyp]) + ip.packed + port.to_bytes(2, "big")


def _as_ip(host: str | IPAddress) -> IPAddress | None:
    if not isinstance(host, str):
        return host
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


Handshake = HttpConnectHandshake | Socks5Handshake


def handshake(upstream: Upstream, host: str | IPAddress, port: int) -> Handshake:
    """The handshake that asks `upstream` for a connection to host:port."""
    if upstream.proxy.kind is UpstreamKind.HTTP:
        return HttpConnectHandshake(host, port, upstream.credentials)
    return Socks5Handshake(host, port, upstream.credentials)


def describe_upstream(upstream: UpstreamProxy | None) -> dict[str, object]:
    """What `doctor` says about chaining: url, target, pinning, and one line for a person."""
    if upstream is None:
        line = "none: egressbox dials the checked addresses itself (pinning: full)"
        return {"url": None, "target": None, "pinning": "full", "line": line}
    if upstream.pinning == "full":
        line = (
            f"{upstream.url}, asked for the checked address (pinning: full; the upstream's "
            "own address is the one hop the policy does not check)"
        )
    else:
        line = (
            f"{upstream.url}, asked for the name (pinning: partial: the upstream resolves "
            "names itself and may reach other addresses than egressbox checked)"
        )
    return {
        "url": upstream.url,
        "target": upstream.target.value,
        "pinning": upstream.pinning,
        "line": line,
    }
