"""`egressbox connect HOST PORT`: standard input and output relayed through a running proxy.

For ssh's `ProxyCommand` (`ssh -o ProxyCommand='egressbox connect %h %p' host`) and any other
tool that can talk through a pipe: the proxy decides HOST:PORT (audited like every request)
and, if it allows it, the bytes flow until either side is done. The proxy comes from --proxy or
from the environment (https_proxy, then http_proxy, then ALL_PROXY, upper case too), as an
`http://` URL (CONNECT) or a `socks5://` / `socks5h://` one.

Stdlib only, blocking, two threads (one per direction): no event loop for a pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from egressbox.core.exitcodes import EXIT_OK, EXIT_RUNTIME, EXIT_USAGE

if TYPE_CHECKING:
    from egressbox.cli.options import Subparsers

PROXY_VARIABLES = (
    "https_proxy",
    "HTTPS_PROXY",
    "http_proxy",
    "HTTP_PROXY",
    "all_proxy",
    "ALL_PROXY",
)
CONNECT_TIMEOUT = 30.0
MAX_REPLY_HEAD = 64 * 1024
CHUNK = 65536


class ConnectError(Exception):
    """The proxy could not be reached, or it refused the destination (the message says why)."""


def proxy_from(env: Mapping[str, str], given: str | None) -> tuple[str, str, int]:
    """(scheme, host, port) of the proxy to use."""
    text = given or next((env[name] for name in PROXY_VARIABLES if env.get(name)), "")
    if not text:
        raise ConnectError(
            "no proxy: pass --proxy URL, or set https_proxy (egressbox run sets it in the child)"
        )
    url = urlsplit(text if "://" in text else f"http://{text}")
    scheme = url.scheme.lower()
    if scheme not in ("http", "socks5", "socks5h") or not url.hostname or url.port is None:
        raise ConnectError(f"--proxy {text!r}: use http://HOST:PORT or socks5://HOST:PORT")
    return scheme, url.hostname, url.port


def open_tunnel(scheme: str, proxy: tuple[str, int], host: str, port: int) -> socket.socket:
    """A connection to HOST:PORT through the proxy, ready for the caller's bytes."""
    try:
        sock = socket.create_connection(proxy, timeout=CONNECT_TIMEOUT)
    except OSError as exc:
        raise ConnectError(f"cannot reach the proxy at {proxy[0]}:{proxy[1]}: {exc}") from None
    try:
        if scheme == "http":
            _http_connect(sock, host, port)
        else:
            _socks5_connect(sock, host, port)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _http_connect(sock: socket.socket, host: str, port: int) -> None:
    authority = _authority(host, port)
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(4096)
        if not data or len(head) > MAX_REPLY_HEAD:
            raise ConnectError("the proxy closed the connection before answering")
        head += data
    head, _, rest = head.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = lines[0].split(" ", 2)
    if len(status) < 2 or status[1] != "200":
        reason = next(
            (
                line.split(":", 1)[1].strip()
                for line in lines[1:]
                if line.lower().startswith("x-egressbox-reason:")
            ),
            "",
        )
        why = f" ({reason})" if reason else ""
        raise ConnectError(f"the proxy refused {authority}: {lines[0]}{why}")
    if rest:
        raise ConnectError("the proxy sent bytes after its reply before the tunnel opened")


def _socks5_connect(sock: socket.socket, host: str, port: int) -> None:
    sock.sendall(b"\x05\x01\x00")
    if _recv_exactly(sock, 2) != b"\x05\x00":
        raise ConnectError("the SOCKS5 proxy wants authentication this command does not send")
    name = host.encode("idna") if not _is_ip(host) else b""
    if name:
        request = b"\x05\x01\x00\x03" + bytes([len(name)]) + name
    elif ":" in host:
        request = b"\x05\x01\x00\x04" + socket.inet_pton(socket.AF_INET6, host)
    else:
        request = b"\x05\x01\x00\x01" + socket.inet_aton(host)
    sock.sendall(request + port.to_bytes(2, "big"))
    reply = _recv_exactly(sock, 4)
    if reply[1] != 0:
        raise ConnectError(f"the SOCKS5 proxy refused {_authority(host, port)} (reply {reply[1]})")
    size = {1: 4, 4: 16}.get(reply[3])
    _recv_exactly(sock, (size if size is not None else _recv_exactly(sock, 1)[0]) + 2)


def _is_ip(host: str) -> bool:
    for family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            socket.inet_pton(family, host)
            return True
    return False


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectError("the proxy closed the connection during the handshake")
        data += chunk
    return data


def relay(sock: socket.socket, read_fd: int = 0, write_fd: int = 1) -> None:
    """stdin -> socket and socket -> stdout until both directions are done."""

    def upward() -> None:
        with contextlib.suppress(OSError):
            while data := os.read(read_fd, CHUNK):
                sock.sendall(data)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=upward, daemon=True)
    thread.start()
    with contextlib.suppress(OSError):
        while data := sock.recv(CHUNK):
            view = memoryview(data)
            while view:
                view = view[os.write(write_fd, view) :]
    # The far side is done; whatever stdin still has goes nowhere (ssh closes it too).


def main(host: str, port: int, proxy: str | None, env: Mapping[str, str] | None = None) -> int:
    if not 1 <= port <= 65535:
        sys.stderr.write("egressbox connect: PORT must be a number from 1 to 65535\n")
        return EXIT_USAGE
    try:
        scheme, proxy_host, proxy_port = proxy_from(os.environ if env is None else env, proxy)
        sock = open_tunnel(scheme, (proxy_host, proxy_port), host, port)
    except ConnectError as exc:
        sys.stderr.write(f"egressbox connect: {exc}\n")
        return EXIT_RUNTIME
    try:
        relay(sock)
    finally:
        sock.close()
    return EXIT_OK


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "connect",
        help="relay stdin/stdout to HOST PORT through a running proxy (ssh's ProxyCommand)",
        description="Open HOST:PORT through a running egressbox proxy (it decides and audits "
        "it like any request) and relay standard input and output: "
        "ssh -o ProxyCommand='egressbox connect %%h %%p' HOST. The proxy comes from --proxy or "
        "from https_proxy/http_proxy/ALL_PROXY.",
    )
    p.add_argument("host", metavar="HOST")
    p.add_argument("port", metavar="PORT", type=int)
    p.add_argument(
        "--proxy", metavar="URL", help="http://HOST:PORT (CONNECT) or socks5://HOST:PORT"
    )


def command(args: argparse.Namespace) -> int:
    return main(args.host, args.port, args.proxy)
