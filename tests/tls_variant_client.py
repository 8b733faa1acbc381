"""A TLS client whose first flight is rewritten the way lenient servers still read it.

A real handshake from Python's ssl (through a MemoryBIO) whose ClientHello flight is
replaced by one of `tls_hellos.lenient_variants` (another record version, a warning
alert and a change_cipher_spec before it, split across records with an alert between);
every later record is sent as ssl wrote it. Blocking sockets, every step bounded by a
timeout. Used by the proxy tests (in a thread) and, run as a script with the system
python3, by a confined child whose connections are captured:

    python3 tls_variant_client.py HOST PORT   (then one JSON request per stdin line)

Standard library only (and tls_hellos.py next to it).
"""

from __future__ import annotations

import json
import socket
import ssl
import sys
from dataclasses import asdict, dataclass

from tls_hellos import lenient_variants

TIMEOUT = 15.0  # seconds for any one socket step
PING = b"ping\n"
MAX_ANSWER = 4096
MAX_STEPS = 64  # handshake round trips: TLS needs two or three


@dataclass
class Outcome:
    """What the client saw: the origin's answer to its ping, or why the handshake failed."""

    variant: str
    sni: str
    answer: str = ""
    error: str = ""


def context(cafile: str | None) -> ssl.SSLContext:
    """Verifying against `cafile`, or not verifying at all (None)."""
    if cafile is None:
        unverified = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        return unverified
    return ssl.create_default_context(cafile=cafile)


def handshake(
    sock: socket.socket, sni: str, variant: str | None, cafile: str | None = None
) -> Outcome:
    """A TLS handshake over the connected `sock`, then a ping and its answer line."""
    sock.settimeout(TIMEOUT)
    outcome = Outcome(variant or "plain", sni)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context(cafile).wrap_bio(incoming, outgoing, server_hostname=sni)
    try:
        _handshake(sock, tls, incoming, outgoing, variant)
        tls.write(PING)
        sock.sendall(outgoing.read())
        outcome.answer = _read_line(sock, tls, incoming)
    except (OSError, ssl.SSLError, EOFError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


def _handshake(
    sock: socket.socket,
    tls: ssl.SSLObject,
    incoming: ssl.MemoryBIO,
    outgoing: ssl.MemoryBIO,
    variant: str | None,
) -> None:
    first = True
    for _ in range(MAX_STEPS):
        try:
            tls.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        flight = outgoing.read()
        if flight:
            if first and variant is not None:
                flight = lenient_variants(flight)[variant]
            first = False
            sock.sendall(flight)
        if done:
            return
        data = sock.recv(65536)
        if not data:
            raise EOFError("the connection closed during the handshake")
        incoming.write(data)
    raise EOFError("the handshake did not finish")


def _read_line(sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO) -> str:
    answer = b""
    while not answer.endswith(b"\n") and len(answer) < MAX_ANSWER:
        try:
            answer += tls.read(MAX_ANSWER)
            continue
        except ssl.SSLWantReadError:
            pass
        data = sock.recv(65536)
        if not data:
            break
        incoming.write(data)
    return answer.decode(errors="replace")


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    for line in sys.stdin:
        request = json.loads(line)
        with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
            outcome = handshake(sock, request["sni"], request["variant"])
        print(json.dumps(asdict(outcome)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
