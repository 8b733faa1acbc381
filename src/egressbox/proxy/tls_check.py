"""The TLS name check on a tunnel's first client bytes (DESIGN §3, "TLS name check").

A CONNECT or SOCKS5 tunnel to an allowed name could otherwise carry a TLS
ClientHello for any host served at the same addresses (domain fronting under
an allowed CDN). So, when `[egress] tls_name_check = "enforce"` (the default):

1. The upstream is dialled to the checked addresses and the tunnel's reply
   (200, or the SOCKS5 success) goes out as before; then `FirstBytes` holds
   the client's transport, with no Task, until the client's first bytes say
   what they are. Nothing goes upstream meanwhile. (`protocols/tls.py` says
   what counts as a ClientHello and which ones are refused as unreadable.)
2. A first byte that no TLS server takes for the start of a handshake (not a
   record content type, 0x14-0x18, nor the high bit of an SSL 2.0 header) is
   the whole cost of the check for other protocols: the relay starts at once,
   those bytes first. So it does when the upstream speaks, ends or fails
   before the client has sent a byte (a server-first protocol such as SSH or
   SMTP: TLS clients always speak first).
3. Otherwise `protocols.tls.ClientHelloReader` reads the ClientHello (bounded;
   the TLS session is never terminated) as the most lenient server would: any
   record version, warning alerts and change_cipher_spec records skipped, a
   hello split across records reassembled (the module says which streams are
   refused as unreadable). It fails closed: whatever starts like TLS is read
   to its server name or refused, never relayed unread. `name_check` judges
   the SNI, normalized exactly like a request host: it must be the target
   itself, or, for an IP-literal target, a name the policy's name rules admit.
   No SNI passes (the server picks its default name); an outer ClientHello
   with ECH must carry the target as its public name, like any other. A
   ClientHello that cannot be read is refused too: the name a server would
   see is unknown.
4. A refusal is one audit record (`sni_mismatch`, decision `deny`; in report
   mode `would_deny`, and the tunnel goes on), written before a TLS alert
   (unrecognized_name; decode_error for a ClientHello that cannot be read) and
   the close; the upstream is closed without having been sent a byte. A match
   starts the relay with the bytes read so far, unchanged.

The client must send its first bytes within `[limits] head_timeout`, like a
request head. Later ClientHellos on the same tunnel (after a non-TLS start,
a STARTTLS upgrade, or a TLS 1.3 HelloRetryRequest) are not read.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Final, Protocol

from egressbox.core.decide import Decision, NamePass, Target, decide_name, parse_target
from egressbox.core.errors import AuditError, HostError, Reason, Verdict
from egressbox.core.hosts import format_authority, split_authority
from egressbox.core.local import LOOPBACK_ADDRESSES, LOOPBACK_NAME
from egressbox.core.policy import Mode, Policy, TlsNameCheck
from egressbox.net.deadlines import Deadline, wheel
from egressbox.net.relay import Tunnel
from egressbox.protocols.tls import (
    ClientHello,
    ClientHelloReader,
    Malformed,
    NeedMore,
    NotTls,
    may_be_tls,
)

# Enum members bound once (docs/development.md, "The compiled core's speed rules").
_DENY: Final = Verdict.DENY
_ENFORCE: Final = TlsNameCheck.ENFORCE
_HOST_MISMATCH: Final = Reason.HOST_MISMATCH
_REPORT: Final = Mode.REPORT
_SNI_MISMATCH: Final = Reason.SNI_MISMATCH
_WOULD_DENY: Final = Verdict.WOULD_DENY

# A fatal TLS alert sent before the close, so that the client's TLS stack says
# why instead of "unexpected EOF": unrecognized_name (RFC 8446 §6.2: 112) for
# another name, decode_error (50) for a ClientHello we cannot read. Record
# version 0x0303, as TLS 1.3 servers send it before their ServerHello.
UNRECOGNIZED_NAME_ALERT = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 112])
DECODE_ERROR_ALERT = bytes([0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 50])


def checks_names(policy: Policy) -> bool:
    """Whether tunnels admitted under `policy` get the TLS name check."""
    return policy.tls_name_check is _ENFORCE


def name_check(
    policy: Policy, admitted: Decision, hello: ClientHello | Malformed
) -> Decision | None:
    """The sni_mismatch decision for the ClientHello of a tunnel that `admitted`
    opened, or None when the ClientHello may go to the upstream."""
    why = _mismatch(policy, admitted, hello)
    if why is None:
        return None
    verdict = _WOULD_DENY if policy.mode is _REPORT else _DENY
    return Decision(
        verdict, _SNI_MISMATCH, admitted.host, admitted.port, admitted.addresses, None, why
    )


def _mismatch(policy: Policy, admitted: Decision, hello: ClientHello | Malformed) -> str | None:
    if isinstance(hello, Malformed):
        return f"not a readable TLS ClientHello: {hello.error}"
    if hello.server_name is None:
        return "an ECH ClientHello without a public server name" if hello.ech else None
    try:
        sni = parse_target(hello.server_name, admitted.port)
        target = parse_target(admitted.host, admitted.port)
    except HostError:
        return "the ClientHello's server name is not a valid host name"
    return _other_name(policy, sni, target, hello.ech)


def _other_name(policy: Policy, sni: Target, target: Target, ech_offered: bool) -> str | None:
    if sni.host.text == target.host.text:
        return None
    ech = " (outer ClientHello of ECH)" if ech_offered else ""
    if target.host.is_ip and not sni.host.is_ip:
        named = decide_name(policy, sni)
        if isinstance(named, NamePass) and named.would_deny is None:
            return None
        why = named.detail if isinstance(named, Decision) else "no allow entry admits it"
        return f"the ClientHello names {sni.host.text}{ech}, not this IP address: {why}"
    return f"the ClientHello names {sni.host.text}{ech}, not {target.host.text}"


# The first request head of a captured plain-HTTP connection is read this far for its Host.
MAX_HTTP_HEAD: Final = 16 * 1024
# A request line starts with its method and a space (an SSH banner, SMTP's EHLO after the
# server's greeting and the like do not).
_HTTP_METHODS: Final = (
    b"GET ",
    b"HEAD ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"OPTIONS ",
    b"PATCH ",
    b"TRACE ",
)


def host_check(policy: Policy, admitted: Decision, head: bytes) -> Decision | None:
    """The host_mismatch decision for the first request head of a captured connection that
    `admitted` opened (None: it may go upstream). A head without Host (HTTP/1.0) passes."""
    why = _host_mismatch(policy, admitted, head)
    if why is None:
        return None
    verdict = _WOULD_DENY if policy.mode is _REPORT else _DENY
    return Decision(
        verdict, _HOST_MISMATCH, admitted.host, admitted.port, admitted.addresses, None, why
    )


def _host_mismatch(policy: Policy, admitted: Decision, head: bytes) -> str | None:
    if b"\r\n\r\n" not in head:
        return f"no complete request head within {MAX_HTTP_HEAD} bytes"
    hosts = [
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
        if line[:5].lower() == b"host:"
    ]
    if not hosts:
        return None
    if len(hosts) > 1:
        return "more than one Host header"
    try:
        value = hosts[0].decode("ascii")
        host, _port = split_authority(value)
        named = parse_target(host, admitted.port)
        target = parse_target(admitted.host, admitted.port)
    except (HostError, UnicodeDecodeError):
        return "the Host header is not a valid host"
    if _same_host(admitted, named, target):
        return None
    why = _other_name(policy, named, target, False)
    return why.replace("the ClientHello names", "the Host header names") if why else None


def _same_host(admitted: Decision, named: Target, target: Target) -> bool:
    """A Host that spells the decided host another way names no other host: an IP literal
    among the addresses the connection was checked and dialled to, or `localhost` for a
    decided loopback address (the child's /etc/hosts maps it there: confine/grants.py
    CAPTURE_HOSTS). A name that is neither is judged by the policy (_other_name)."""
    if named.host.ip is not None:
        return named.host.ip in admitted.addresses
    ip = target.host.ip
    return ip is not None and ip in LOOPBACK_ADDRESSES and named.host.text == LOOPBACK_NAME


class Owner(Protocol):
    """What FirstBytes needs of the connection that opened the tunnel (server.Connection)."""

    def record(self, decision: Decision) -> None: ...

    def left(self) -> None: ...

    def start_relay(
        self,
        tunnel: Tunnel,
        decision: Decision,
        upstream: asyncio.Transport,
        to_upstream: bytes,
        *,
        to_client: bytes = b"",
        client_eof: bool = False,
    ) -> None: ...

    def failed(self, exc: Exception) -> None: ...


class FirstBytes(asyncio.Protocol):
    """A tunnel's client transport from its reply until its first bytes are judged."""

    __slots__ = (
        "check_host",
        "chunks",
        "client",
        "decision",
        "done",
        "http",
        "log",
        "owner",
        "policy",
        "protocol",
        "reader",
        "timer",
        "tunnel",
        "upstream",
    )

    def __init__(
        self,
        owner: Owner,
        tunnel: Tunnel,
        decision: Decision,
        client: asyncio.Transport,
        upstream: asyncio.Transport,
        *,
        policy: Policy,
        timeout: float,
        loop: asyncio.AbstractEventLoop,
        protocol: str,
        log: Callable[[str], None] | None,
        check_host: bool = False,
    ) -> None:
        """`log` takes the diagnostic lines (None: none wanted); `protocol` starts them.
        `check_host`: a plain-HTTP first request must name the target in its Host header
        (a captured connection, whose target is the name the child looked up)."""
        self.check_host = check_host
        self.http: bytearray | None = None  # the first request head, while it is read
        self.owner = owner
        self.protocol = protocol
        self.log = log
        self.tunnel = tunnel
        self.decision = decision
        self.client = client
        self.upstream = upstream
        self.policy = policy
        self.chunks: list[bytes] = []  # every byte read, to forward unchanged
        self.reader: ClientHelloReader | None = None  # made at the first TLS-like byte
        self.done = False
        self.timer: Deadline | None = wheel(loop).call_later(timeout, self._timed_out)

    def start(self, reply: bytes, first: bytes) -> None:
        """Take the client transport, answer, and judge `first` (bytes the client sent
        with its request) or wait for the first bytes."""
        self.client.set_protocol(self)
        self.client.write(reply)
        if first:
            self.data_received(first)
        if not self.done:  # the relay holds what the upstream sends, and tells us
            self.tunnel.on_upstream_first(self._upstream_first)
        if not self.done:
            self.upstream.resume_reading()
            self.client.resume_reading()

    # -- the client's transport ------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.done:
            return
        try:
            self._judge(data)
        except Exception as exc:  # a bug must not kill the server
            self._failed(exc)

    def eof_received(self) -> bool:
        if self.done:
            return False
        if not self.chunks:  # EOF before any byte: nothing to judge, pass it on
            self._pass(client_eof=True)
            return True
        self._close("the client ended inside its TLS ClientHello")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done:
            self._stop()
            self.upstream.abort()
        self.owner.left()

    # -- the steps -------------------------------------------------------------------

    def _judge(self, data: bytes) -> None:
        self.chunks.append(data)
        if self.http is not None:
            self._judge_http(data)
            return
        reader = self.reader
        if reader is None:
            if not may_be_tls(data[0]):
                if self.check_host and data.startswith(_HTTP_METHODS):
                    self.http = bytearray()
                    self._judge_http(data)
                    return
                self._pass()  # the fast path: not TLS
                return
            reader = self.reader = ClientHelloReader()
        result = reader.feed(data)
        if isinstance(result, NeedMore):
            return
        if isinstance(result, NotTls):
            self._pass()
            return
        self._verdict(name_check(self.policy, self.decision, result), result)

    def _judge_http(self, data: bytes) -> None:
        assert self.http is not None
        self.http += data
        if b"\r\n\r\n" not in self.http and len(self.http) < MAX_HTTP_HEAD:
            return
        self._verdict(host_check(self.policy, self.decision, bytes(self.http)), None)

    def _verdict(self, refusal: Decision | None, result: object) -> None:
        """Pass, or record the refusal (before anything else) and close."""
        if refusal is None:
            self._pass()
            return
        try:
            self.owner.record(refusal)
        except AuditError:  # nothing goes through without its record
            self._refuse(refusal)
            return
        if refusal.allowed:  # report mode: audited as would_deny, let through
            self._note(refusal)
            self._pass()
        else:
            self._refuse(refusal, isinstance(result, Malformed))

    def _upstream_first(self) -> None:
        if self.done or self.chunks:
            return  # a partial ClientHello is still judged when it is complete
        try:
            self._pass()  # the server spoke first: not TLS from the client's side
        except Exception as exc:  # a bug must not kill the server
            self._failed(exc)

    def _pass(self, *, client_eof: bool = False) -> None:
        self._stop()
        chunks, self.chunks = self.chunks, []
        first = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if not client_eof:
            self.client.pause_reading()
        self.owner.start_relay(
            self.tunnel, self.decision, self.upstream, first, client_eof=client_eof
        )

    def _refuse(self, refusal: Decision, unreadable: bool = False) -> None:
        self._stop()
        self._note(refusal)
        self.upstream.abort()
        self.chunks = []
        if self.http is None:  # a TLS client: say why in its own words
            alert = DECODE_ERROR_ALERT if unreadable else UNRECOGNIZED_NAME_ALERT
            with contextlib.suppress(OSError, RuntimeError):  # the client may be gone already
                self.client.write(alert)
        self.client.close()

    def _timed_out(self) -> None:
        self.timer = None
        if not self.done:
            self._close("no first bytes (TLS ClientHello or other) within the head timeout")

    def _close(self, why: str) -> None:
        """End both sides without a decision (no record: like a request head never sent)."""
        self._stop()
        if self.log is not None:
            self.log(f"{self._where()}: closed: {why}")
        self.upstream.abort()
        self.chunks = []
        self.client.close()

    def _failed(self, exc: Exception) -> None:
        self._stop()
        self.upstream.abort()
        self.owner.failed(exc)

    def _note(self, decision: Decision) -> None:
        if self.log is not None:
            self.log(
                f"{self._where()} {decision.verdict.value} {decision.reason.value}"
                f" ({decision.detail})"
            )

    def _where(self) -> str:
        return f"{self.protocol} {format_authority(self.decision.host, self.decision.port)}"

    def _stop(self) -> None:
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.tunnel.on_upstream_first(None)
