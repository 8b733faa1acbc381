"""Transparent capture in the child's network namespace (DESIGN section 7a).

The launcher, while it still holds CAP_NET_ADMIN in the namespace it made (root, or any user
inside its own user namespace), makes every TCP connection of the command reach egressbox:

1. ``local`` routes for ``0.0.0.0/0`` and ``::/0`` on ``lo`` (rtnetlink, in-process: an
   exec'd ``ip`` loses the capabilities the launcher holds in its user namespace). Without a
   route a connect fails with ENETUNREACH before the nat hook ever sees it.
2. An nftables ``nat output`` chain (libnftables through ctypes, in-process too): the proxy's
   own listeners, the capture listener and the DNS address are left alone; every other TCP
   connection, IPv4 and IPv6, is redirected to the capture listener; UDP to port 53 anywhere
   goes to the DNS address. A ``filter output`` chain drops every other datagram: it could
   reach nothing anyway (the namespace has only ``lo``), and dropped, its sendto fails with
   EPERM at once instead of the datagram vanishing.

The parent reads where a captured connection was going with ``original_destination`` on the
accepted socket (``SO_ORIGINAL_DST``, ``IP6T_SO_ORIGINAL_DST``).

Standard library and ctypes only: the launcher imports this before it forks the command.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from egressbox.confine.grants import CAPTURE_DNS_HOST

# Where the child's resolver is pointed (its /etc/resolv.conf says so): inside 127.0.0.0/8,
# which lo holds, apart from 127.0.0.1 where the proxy listens.
DNS_HOST = CAPTURE_DNS_HOST
DNS_PORT = 53
CAPTURE_HOST = "127.0.0.1"
# The capture listener: dual-stack when the kernel has IPv6, so that one socket receives both
# the IPv4 connections redirected to 127.0.0.1 and the IPv6 ones redirected to ::1.
CAPTURE_HOST6 = "::"
TABLE = "egressbox"
LIBRARY = "libnftables.so.1"
# The Debian package that holds LIBRARY (named in what doctor and --report say).
PACKAGE = "libnftables1"

# rtnetlink (<linux/netlink.h>, <linux/rtnetlink.h>).
NETLINK_ROUTE = 0
RTM_NEWROUTE = 24
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
RT_TABLE_MAIN = 254
RTPROT_BOOT = 3
RT_SCOPE_HOST = 254
RTN_LOCAL = 2
RTA_OIF = 4
_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
# struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type; u32 flags
_RTMSG = struct.Struct("=BBBBBBBBI")
_RTATTR_U32 = struct.Struct("=HHI")  # len, type, value
_NLMSGERR = struct.Struct("=i")
_ACK_TIMEOUT = 2.0


class CaptureError(Exception):
    """A step of capture could not be done (the message names it)."""


@dataclass(frozen=True)
class Sockets:
    """What the launcher made for capture, in the order it sends them to the parent."""

    capture: socket.socket  # TCP listener: every redirected connection
    dns_udp: socket.socket  # DNS_HOST:DNS_PORT, UDP
    dns_tcp: socket.socket  # DNS_HOST:DNS_PORT, TCP listener

    @property
    def capture_port(self) -> int:
        return int(self.capture.getsockname()[1])

    @property
    def dual_stack(self) -> bool:
        return self.capture.family == socket.AF_INET6

    def all(self) -> tuple[socket.socket, socket.socket, socket.socket]:
        return self.capture, self.dns_udp, self.dns_tcp

    def close(self) -> None:
        for sock in self.all():
            sock.close()


ROLES = ("capture", "dns_udp", "dns_tcp")


# -- sockets --------------------------------------------------------------------------------


def open_sockets(backlog: int) -> Sockets:
    """The capture listener and the DNS sockets, bound in the current network namespace.

    DNS_PORT is below 1024: the launcher binds it while it still holds CAP_NET_BIND_SERVICE in
    the namespace (root, or the owner of the new user namespace).
    """
    made: list[socket.socket] = []
    try:
        made.append(_capture_listener(backlog))
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        made.append(udp)
        udp.bind((DNS_HOST, DNS_PORT))
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        made.append(tcp)
        tcp.bind((DNS_HOST, DNS_PORT))
        tcp.listen(backlog)
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return Sockets(*made)


def _capture_listener(backlog: int) -> socket.socket:
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        sock = None  # no IPv6 in this kernel: IPv4 only
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((CAPTURE_HOST6, 0))
            sock.listen(backlog)
            return sock
        except OSError:
            sock.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((CAPTURE_HOST, 0))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


# -- routes (rtnetlink) ---------------------------------------------------------------------


def route_message(family: int, ifindex: int, seq: int = 1) -> bytes:
    """RTM_NEWROUTE for a `local` default route of `family` on interface `ifindex`."""
    rtm = _RTMSG.pack(family, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_HOST, RTN_LOCAL, 0)
    oif = _RTATTR_U32.pack(_RTATTR_U32.size, RTA_OIF, ifindex)
    body = rtm + oif
    flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_EXCL | NLM_F_CREATE
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), RTM_NEWROUTE, flags, seq, 0) + body


def parse_ack(data: bytes, seq: int) -> int | None:
    """The error of the NLMSG_ERROR answering `seq` in `data` (0 is success), None if absent."""
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, got_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size:
            break
        if kind == NLMSG_ERROR and got_seq == seq and length >= _NLMSGHDR.size + 4:
            return int(_NLMSGERR.unpack_from(data, offset + _NLMSGHDR.size)[0])
        offset += (length + 3) & ~3
    return None


def add_local_route(family: int, ifindex: int | None = None) -> None:
    """Route every address of `family` to `lo` as local; raises OSError with the kernel's errno.

    An existing identical route (EEXIST) is fine.
    """
    index = ifindex if ifindex is not None else socket.if_nametoindex("lo")
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE) as nl:
        nl.settimeout(_ACK_TIMEOUT)
        nl.bind((0, 0))
        seq = 1
        nl.sendall(route_message(family, index, seq))
        while True:
            error = parse_ack(nl.recv(65536), seq)
            if error is not None:
                break
    if error < 0 and -error != errno.EEXIST:
        name = "IPv4" if family == socket.AF_INET else "IPv6"
        raise OSError(-error, f"adding a local {name} default route on lo")


def add_local_routes() -> tuple[str, ...]:
    """Local default routes on lo: IPv4 always, IPv6 when the kernel has it.

    Returns the families routed ("ipv4", "ipv6"). An IPv4 failure raises; without IPv6 in the
    namespace (no AF_INET6, or it is disabled) IPv6 connections fail before any hook, so
    there is nothing to capture there.
    """
    add_local_route(socket.AF_INET)
    families = ["ipv4"]
    try:
        add_local_route(socket.AF_INET6)
    except OSError:
        pass
    else:
        families.append("ipv6")
    return tuple(families)


# -- the nat rules (libnftables) --------------------------------------------------------------


def ruleset(
    proxy_ports: Sequence[int],
    capture_port: int,
    dns_port: int = DNS_PORT,
    *,
    dns_host: str = DNS_HOST,
    ipv6: bool = True,
    allow_loopback: bool = False,
) -> str:
    """The nftables ruleset for the child's namespace: one table, two output chains.

    nat: left alone are the proxy's own listeners and the capture listener on 127.0.0.1 (and
    ::1 for a dual-stack capture listener), the DNS address, and with `allow_loopback` every
    loopback address (the child's own servers); then UDP to port 53 of any IPv4 address goes to
    the DNS address and every other TCP connection to the capture listener.

    filter: a datagram that is not part of a DNS exchange with the DNS address is dropped, so
    its sendto fails (EPERM) instead of vanishing; the answers the parent sends back from the
    DNS socket belong to those exchanges.
    """
    own = ", ".join(str(p) for p in dict.fromkeys((*proxy_ports, capture_port)))
    lines = [
        f"table inet {TABLE} {{",
        "\tchain output {",
        "\t\ttype nat hook output priority -100; policy accept;",
        f"\t\tip daddr {CAPTURE_HOST} tcp dport {{ {own} }} accept",
    ]
    if ipv6:
        lines.append(f"\t\tip6 daddr ::1 tcp dport {capture_port} accept")
    lines += [
        f"\t\tip daddr {dns_host} tcp dport {dns_port} accept",
        f"\t\tip daddr {dns_host} udp dport {dns_port} accept",
    ]
    if allow_loopback:
        lines += ["\t\tip daddr 127.0.0.0/8 accept", "\t\tip6 daddr ::1 accept"]
    lines += [
        f"\t\tmeta nfproto ipv4 udp dport 53 dnat ip to {dns_host}:{dns_port}",
        f"\t\tmeta l4proto tcp redirect to :{capture_port}",
        "\t}",
        "\tchain udp_output {",
        "\t\ttype filter hook output priority 0; policy accept;",
        f"\t\tmeta l4proto udp ct reply ip saddr {dns_host} ct reply proto-src {dns_port} accept",
        "\t\tmeta l4proto udp drop",
        "\t}",
        "}",
    ]
    return "\n".join(lines) + "\n"


class _Nft:
    """libnftables through ctypes: the three calls a ruleset needs, errors buffered."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = (ctypes.c_uint32,)
        lib.nft_ctx_free.restype = None
        lib.nft_ctx_free.argtypes = (ctypes.c_void_p,)
        lib.nft_ctx_buffer_output.restype = ctypes.c_int
        lib.nft_ctx_buffer_output.argtypes = (ctypes.c_void_p,)
        lib.nft_ctx_buffer_error.restype = ctypes.c_int
        lib.nft_ctx_buffer_error.argtypes = (ctypes.c_void_p,)
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = (ctypes.c_void_p,)
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        lib.nft_run_cmd_from_buffer.argtypes = (ctypes.c_void_p, ctypes.c_char_p)

    def run(self, commands: str) -> None:
        ctx = self.lib.nft_ctx_new(0)
        if not ctx:
            raise CaptureError("nft_ctx_new failed")
        try:
            # Errors come back to us, not on the command's stderr.
            self.lib.nft_ctx_buffer_output(ctx)
            self.lib.nft_ctx_buffer_error(ctx)
            if self.lib.nft_run_cmd_from_buffer(ctx, commands.encode()) != 0:
                raw = self.lib.nft_ctx_get_error_buffer(ctx) or b""
                text = " ".join(raw.decode(errors="replace").split()) or "unknown error"
                raise CaptureError(f"nftables refused the capture rules: {text[:300]}")
        finally:
            self.lib.nft_ctx_free(ctx)


_LOADED: list[_Nft] = []


def load_library() -> None:
    """Load libnftables now (the launcher does before the child's view hides the host's
    libraries). Raises CaptureError naming the package when it is missing."""
    _library()


def _library() -> _Nft:
    if not _LOADED:
        try:
            lib = ctypes.CDLL(LIBRARY)
        except OSError as exc:
            raise CaptureError(f"{LIBRARY} cannot be loaded (install {PACKAGE}): {exc}") from None
        try:
            _LOADED.append(_Nft(lib))
        except AttributeError as exc:
            raise CaptureError(f"{LIBRARY} lacks a needed call: {exc}") from None
    return _LOADED[0]


def install_redirect(
    proxy_ports: Sequence[int],
    capture_port: int,
    dns_port: int = DNS_PORT,
    *,
    ipv6: bool = True,
    allow_loopback: bool = False,
) -> str:
    """Install the ruleset (see `ruleset`) in the current network namespace; returns its text."""
    text = ruleset(proxy_ports, capture_port, dns_port, ipv6=ipv6, allow_loopback=allow_loopback)
    _library().run(text)
    return text


# -- can this host do it ----------------------------------------------------------------------


def available() -> tuple[bool, str]:
    """The cheap part of the check, in this process: libnftables loads. The probe proves the
    rest (nf_tables, nat, local routes) in a throwaway namespace with `self_test`."""
    try:
        _library()
    except CaptureError as exc:
        return False, str(exc)
    return True, f"{LIBRARY} loads"


def self_test() -> str:
    """Meant for a throwaway child: unshare a network namespace (and a user namespace without
    CAP_SYS_ADMIN), route, install the rules, and check that a connect to a documentation address is
    captured with its original destination. Returns a summary; raises OSError (its strerror
    names the step) or CaptureError on a failure.

    No uid map is written: the capabilities of the new user namespace are all it needs (and a
    process that changed its uid without exec may not write its own maps).
    """
    from egressbox.confine import netns
    from egressbox.core.original import original_destination

    libc = ctypes.CDLL(None, use_errno=True)
    from egressbox.confine import caps

    user = not caps.holds_sys_admin()  # root without CAP_SYS_ADMIN needs one too
    flags = _CLONE_NEWNET | (_CLONE_NEWUSER if user else 0)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        what = "CLONE_NEWUSER|CLONE_NEWNET" if user else "CLONE_NEWNET"
        raise OSError(ctypes.get_errno(), f"unshare({what})")
    _step("bringing lo up", netns.loopback_up)
    families = add_local_routes()
    made = _step("binding the capture sockets", lambda: open_sockets(4))
    try:
        install_redirect((), made.capture_port, ipv6=made.dual_stack and "ipv6" in families)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as client:
            client.settimeout(_ACK_TIMEOUT)
            _step("a captured connect", lambda: client.connect(_TEST_TARGET))
            made.capture.settimeout(_ACK_TIMEOUT)
            conn, _ = _step("accepting the captured connection", made.capture.accept)
            with conn:
                found = original_destination(conn)
    finally:
        made.close()
    if found != _TEST_TARGET:
        raise CaptureError(f"the original destination read back as {found}")
    return f"nf_tables nat redirect and local routes work ({', '.join(families)})"


_T = TypeVar("_T")


def _step(what: str, action: Callable[[], _T]) -> _T:
    """Run `action`; an OSError it raises is re-raised with `what` as its strerror."""
    try:
        return action()
    except OSError as exc:
        raise OSError(exc.errno or 0, what) from exc


def describe(exc: BaseException) -> str:
    """One line for a failed capture step: the step and the error."""
    if isinstance(exc, OSError) and exc.strerror:
        if exc.errno:
            return f"{exc.strerror}: {os.strerror(exc.errno)}"
        return exc.strerror
    return str(exc)


_TEST_TARGET = ("192.0.2.1", 443)  # TEST-NET-1: never a real host
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
