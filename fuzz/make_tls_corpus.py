"""Write the seeds of fuzz/fuzz_tls.py: real first flights and the variants lenient servers take.

usage: .venv/bin/python fuzz/make_tls_corpus.py

First flights of Python's ssl (TLS 1.3 and 1.2), Go's crypto/tls (tests/go/tlsorigin,
with `go run`) and OpenSSL's s_client (its bytes taken by a loopback listener), each as
sent and in every `tls_hellos.lenient_variants` form (other record versions, a warning
alert and CCS first, split with an alert between), into fuzz/corpus/fuzz_tls/. A client
whose tool is missing is left out with a note. Seeds are overwritten by name; files
already there (merged by `fuzz/run --merge`) are kept.
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tls_hellos import lenient_variants, openssl_flight, real_hello  # noqa: E402

CORPUS = ROOT / "fuzz" / "corpus" / "fuzz_tls"
# Hand-built starts the variants do not cover: an SSL 2.0 compatible ClientHello (OpenSSL
# reads it, Go refuses it), a record version Go refuses (0x1000), a fatal alert first.
HAND_BUILT = {
    "ssl2_client_hello": bytes.fromhex("801f010303000300000010c02f") + bytes(16),
    "version_1000": bytes.fromhex("1610000005") + b"hello",
    "fatal_alert_first": bytes.fromhex("150303000202281603010000"),
}
TIMEOUT = 60.0  # seconds for one client to send its first flight (go run compiles first)


def go_flight(name: str) -> bytes | None:
    go = shutil.which("go")
    if go is None:
        return None
    env = {**os.environ, "GO111MODULE": "off", "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}
    done = subprocess.run(
        [go, "run", ".", "hello", name],
        cwd=ROOT / "tests" / "go" / "tlsorigin",
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    return bytes.fromhex(done.stdout.strip())


def main() -> int:
    flights = {
        "python_tls13": real_hello("python.example"),
        "python_tls12": real_hello("python12.example", maximum=ssl.TLSVersion.TLSv1_2),
        "go": go_flight("go.example"),
        "openssl": openssl_flight("openssl.example", TIMEOUT),
    }
    CORPUS.mkdir(parents=True, exist_ok=True)
    for name, data in HAND_BUILT.items():
        (CORPUS / name).write_bytes(data)
    for client, flight in flights.items():
        if flight is None:
            print(f"{client}: its tool is not installed, left out")
            continue
        (CORPUS / client).write_bytes(flight)
        for variant, data in lenient_variants(flight).items():
            (CORPUS / f"{client}_{variant}").write_bytes(data)
        print(f"{client}: {len(flight)} bytes, {len(lenient_variants(flight))} variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
