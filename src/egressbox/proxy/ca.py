"""The CA a terminating proxy signs its per-host certificates with (proxy/terminate.py).

`run` makes a fresh CA per run: its key exists only in this process's memory (never a file;
the ssl module is handed the PEM through an anonymous memfd that is closed at once). `serve`
loads the operator's CA (`[tls] ca_cert` / `ca_key`). A leaf certificate per host is signed
on demand and its server context kept in a bounded cache.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import os
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Server contexts kept per host: a run talks to a handful of bound hosts; a `serve` fleet
# with wildcard bindings could see many names, and each context holds a key (~2 KiB).
LEAF_CACHE_SIZE: Final = 256
# Validity: a CA for one run (a day covers the longest runs we expect; `serve` brings its
# own CA), and leaves a little shorter than the CA. Backdated for clocks slightly behind.
CA_VALIDITY: Final = datetime.timedelta(days=1)
LEAF_VALIDITY: Final = datetime.timedelta(hours=23)
# A cached leaf is made anew after this long (a `serve` runs for weeks; its leaves must not
# run out under a client): half its validity, so a client's clock a few hours off still fits.
LEAF_RENEW_S: Final = LEAF_VALIDITY.total_seconds() / 2
BACKDATE: Final = datetime.timedelta(minutes=5)
# ALPN towards the child: HTTP/1.1 only (the one grammar reads each request).
ALPN: Final = ["http/1.1"]
CA_NAME: Final = "egressbox per-run CA"
# The operator's CA key: EC (P-256 and up) or RSA of at least this size (NIST SP 800-57: 2048
# bits is the floor for signatures made today).
MIN_RSA_BITS: Final = 2048
# Group and other permission bits: the CA key file must have none (it signs certificates
# every client of the proxy trusts for the bound hosts).
KEY_MODE_OPEN: Final = 0o077

SigningKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


class CaError(Exception):
    """The operator's CA cannot be used (the message says why)."""


def _key() -> ec.EllipticCurvePrivateKey:
    # P-256: what every TLS client accepts, and ~50x faster to make than RSA-2048.
    return ec.generate_private_key(ec.SECP256R1())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class CertificateAuthority:
    """A CA certificate and its key (in memory), signing leaf certificates per host."""

    def __init__(self, cert: x509.Certificate, key: SigningKey) -> None:
        self._cert = cert
        self._key = key
        # host -> (its server context, when it is to be made anew: time.monotonic())
        self._contexts: OrderedDict[str, tuple[ssl.SSLContext, float]] = OrderedDict()
        self.clock: Callable[[], float] = time.monotonic
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM).decode("ascii")

    def __repr__(self) -> str:
        return f"CertificateAuthority({self._cert.subject.rfc4514_string()!r})"

    @classmethod
    def generate(cls) -> CertificateAuthority:
        key = _key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, cert_path: str, key_path: str) -> CertificateAuthority:
        """The operator's CA from PEM files (`serve`: [tls] ca_cert / ca_key, or --ca-cert /
        --ca-key). CaError says what is wrong: a key file open to group or others, a key
        that is not the certificate's, a certificate that is no CA or is not valid now."""
        key = _load_key(key_path)
        try:
            with open(cert_path, "rb") as f:
                cert = x509.load_pem_x509_certificate(f.read())
        except (OSError, ValueError) as exc:
            raise CaError(f"{cert_path}: cannot load the CA certificate: {_why(exc)}") from None
        if cert.public_key() != key.public_key():
            raise CaError(f"{key_path} is not the key of the certificate {cert_path}")
        _check_ca(cert, cert_path)
        return cls(cert, key)

    def derived_hex(self, label: str, length: int = 32) -> str:
        """`length` hex digits only this CA's key holder can compute for `label` (HMAC-SHA256
        keyed by the key): `serve` derives its placeholders so that every instance of a fleet
        sharing the operator's CA, and every restart, gives clients the same ones."""
        secret = self._key.private_bytes(
            serialization.Encoding.DER,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return hmac.new(secret, label.encode(), hashlib.sha256).hexdigest()[:length]

    def server_context(self, host: str) -> ssl.SSLContext:
        """A server context presenting a certificate for `host` signed by this CA."""
        cached = self._contexts.get(host)
        now = self.clock()
        if cached is not None and now < cached[1]:
            self._contexts.move_to_end(host)
            return cached[0]
        context = self._make_context(host)
        self._contexts[host] = (context, now + LEAF_RENEW_S)
        self._contexts.move_to_end(host)
        while len(self._contexts) > LEAF_CACHE_SIZE:
            self._contexts.popitem(last=False)
        return context

    def _make_context(self, host: str) -> ssl.SSLContext:
        key = _key()
        cert = self._leaf(host, key)
        pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(ALPN)
        context.sni_callback = _remember_sni
        _load_chain_from_memory(context, pem)
        return context

    def _leaf(self, host: str, key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
        try:
            names: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(host))]
        except ValueError:
            names = [x509.DNSName(host)]
        now = _now()
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(min(now + LEAF_VALIDITY, self._cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), False
            )
            .sign(self._key, hashes.SHA256())
        )


def _why(exc: Exception) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _load_key(path: str) -> SigningKey:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise CaError(f"{path}: cannot open the CA key: {_why(exc)}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if mode & KEY_MODE_OPEN:
            raise CaError(
                f"{path}: the CA key is open to group or others (mode {mode & 0o777:04o}); "
                "whoever reads it can sign certificates every client of the proxy trusts: "
                f"chmod 600 {path}"
            )
        data = f.read()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise CaError(f"{path}: cannot load the CA key (PEM, unencrypted): {exc}") from None
    if isinstance(key, rsa.RSAPrivateKey) and key.key_size < MIN_RSA_BITS:
        raise CaError(f"{path}: an RSA CA key needs at least {MIN_RSA_BITS} bits")
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise CaError(f"{path}: the CA key must be an EC (P-256) or RSA key")
    return key


def _check_ca(cert: x509.Certificate, path: str) -> None:
    """A certificate that may sign others, valid now."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise CaError(f"{path}: not a CA certificate (basicConstraints CA:TRUE is missing)")
    with _suppress_missing():
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        if not usage.key_cert_sign:
            raise CaError(f"{path}: its keyUsage does not allow keyCertSign")
    now = _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise CaError(
            f"{path}: not valid now (valid from {cert.not_valid_before_utc:%Y-%m-%d} "
            f"to {cert.not_valid_after_utc:%Y-%m-%d})"
        )


def _suppress_missing() -> contextlib.AbstractContextManager[None]:
    return contextlib.suppress(x509.ExtensionNotFound)


def _remember_sni(tls: object, name: str | None, _context: ssl.SSLContext) -> None:
    """Keep the name the ClientHello asked for on the TLS object: the terminating session
    checks it against the decided target (sni_mismatch) once the handshake is done."""
    tls.egressbox_sni = name  # type: ignore[attr-defined]


def _load_chain_from_memory(context: ssl.SSLContext, pem: bytes) -> None:
    """load_cert_chain takes a path only: give it an anonymous memfd (no file on any disk),
    closed as soon as it is read."""
    fd = os.memfd_create("egressbox-leaf", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def origin_context(origin_ca: str | None) -> ssl.SSLContext:
    """The client context towards origins: full verification against the system's CAs
    (plus `origin_ca`), the bound name checked, HTTP/1.1 only."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if origin_ca is not None:
        context.load_verify_locations(cafile=origin_ca)
    context.set_alpn_protocols(ALPN)
    return context
