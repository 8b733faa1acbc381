"""The proxy's CPU per request through a terminated connection against a plain tunnel.

    .venv/bin/python benchmarks/terminate.py [--requests 100] [--connections 4] [--rounds 5]
                                             [--pause SECONDS]

`egressbox serve` runs as its own process with an operator CA (made here, in memory, written
0600 to a temporary directory) and a policy binding a [[secret]] to one loopback HTTPS origin;
a second origin is allowed but unbound (a plain tunnel). A client makes --connections
kept-alive CONNECT connections of --requests GETs each to one origin, then to the other; the
proxy's CPU (utime + stime from /proc/PID/stat, so neither the client nor the origins count)
is divided by the requests made (the leaf certificate is made once, in a warm-up). --rounds
times, the median reported: microseconds of proxy CPU per request for each, and the
difference (what a terminated request adds: the TLS layer towards the client, parsing each
head with the one grammar, putting the value in, TLS to the origin).

Every socket is on 127.0.0.1; every loop is bounded by the counts above; serve is stopped at
the end.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from egressbox.proxy.ca import CertificateAuthority

HOST = "127.0.0.1"
TOKEN = "benchmark-token"
READY_TIMEOUT = 30.0
IO_TIMEOUT = 20.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _origin(context: ssl.SSLContext) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # The head and the body go in two writes: without this, Nagle and the client's
        # delayed ACK hold each answer ~40 ms (wall time only; the CPU is the same).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            body = b"ok\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((HOST, 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _operator_ca(where: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    ca = CertificateAuthority.generate()
    cert, key = where / "ca.pem", where / "ca.key"
    cert.write_text(ca.cert_pem)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            ca._key.private_bytes(  # the benchmark plays the operator
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert, key


@contextlib.contextmanager
def _serve(policy: Path) -> Iterator[tuple[int, int]]:
    """serve's (pid, HTTP port)."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["EGRESSBOX_BENCH_TOKEN"] = TOKEN
    proc = subprocess.Popen(
        [sys.executable, "-m", "egressbox", "serve", "--policy", str(policy), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline() or "{}")
        if "http" not in line:
            raise SystemExit("serve did not start")
        yield proc.pid, int(line["http"].rsplit(":", 1)[1])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(READY_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _requests(proxy: int, port: int, trust: ssl.SSLContext, count: int, pause: float = 0.0) -> None:
    conn = http.client.HTTPSConnection(HOST, proxy, context=trust, timeout=IO_TIMEOUT)
    conn.set_tunnel(HOST, port)
    try:
        for _ in range(count):
            time.sleep(pause)
            conn.request("GET", "/bench")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise SystemExit(f"status {response.status}")
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    # /proc counts CPU in clock ticks (10 ms): 400 requests of ~0.5 ms make ~20 of them.
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    # Seconds between two requests: 0 is back to back (the proxy's caches and the CPU's stay
    # warm); a client that works between its requests makes each one pay for cold ones.
    parser.add_argument("--pause", type=float, default=0.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="egressbox-bench-") as tmp:
        where = Path(tmp)
        test_ca = CertificateAuthority.generate()
        origin_ca = where / "origin-ca.pem"
        origin_ca.write_text(test_ca.cert_pem)
        bound_server, bound = _origin(test_ca.server_context(HOST))
        plain_server, plain = _origin(test_ca.server_context(HOST))
        cert, key = _operator_ca(where)
        policy = where / "policy.toml"
        policy.write_text(
            f'[egress]\nallow = ["{HOST}:{bound}", "{HOST}:{plain}"]\n'
            f'allow_cidrs = ["{HOST}/32"]\n\n'
            f'[[secret]]\nname = "T"\nfrom_env = "EGRESSBOX_BENCH_TOKEN"\n'
            f'hosts = ["{HOST}:{bound}"]\nheader = "Authorization"\n'
            f'format = "Bearer {{value}}"\n\n'
            f'[tls]\norigin_ca = "{origin_ca}"\nca_cert = "{cert}"\nca_key = "{key}"\n'
        )
        trust_proxy = ssl.create_default_context(cafile=str(cert))
        trust_origin = ssl.create_default_context(cafile=str(origin_ca))
        results: dict[str, list[float]] = {"tunnel": [], "terminated": []}
        total = args.requests * args.connections
        with _serve(policy) as (pid, proxy):
            _requests(proxy, bound, trust_proxy, 5)  # warm-up: the leaf is made once
            _requests(proxy, plain, trust_origin, 5)
            for _ in range(args.rounds):
                for name, port, trust in (
                    ("tunnel", plain, trust_origin),
                    ("terminated", bound, trust_proxy),
                ):
                    before = _cpu(pid)
                    for _ in range(args.connections):
                        _requests(proxy, port, trust, args.requests, args.pause)
                    results[name].append((_cpu(pid) - before) / total * 1e6)
        for server in (bound_server, plain_server):
            server.shutdown()
            server.server_close()
    tunnel = statistics.median(results["tunnel"])
    terminated = statistics.median(results["terminated"])
    print(
        json.dumps(
            {
                "requests_per_round": total,
                "pause_s": args.pause,
                "rounds": args.rounds,
                "proxy_cpu_us_per_request": {
                    "tunnel": round(tunnel),
                    "terminated": round(terminated),
                    "added": round(terminated - tunnel),
                },
                "all_rounds_us": {k: [round(v) for v in vs] for k, vs in results.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
