"""Optional mutual TLS for cross-host channels, on a private per-job CA.

The controller makes a CA and one leaf certificate for the job (with the
``cryptography`` package) and hands them to its procs the way it hands the job
secret: over the bootstrap pipe, never argv or environment. Every connection
then requires the peer to present a certificate signed by that CA (both ways),
and the HMAC handshake still runs inside TLS. Hostnames are not checked: the
job's CA *is* the identity.
"""

from __future__ import annotations

import base64
import datetime
import os
import re
import ssl
import tempfile
from dataclasses import dataclass

__all__ = ["JobTLS"]


@dataclass(frozen=True)
class JobTLS:
    """PEM material of one job: CA certificate, leaf certificate and key."""

    ca_pem: str
    cert_pem: str
    key_pem: str

    def __repr__(self) -> str:  # never print key material
        return "JobTLS(<private>)"

    def to_token(self) -> str:
        """The material as one line (base64 of the PEM blocks): for credential files."""
        return base64.b64encode((self.ca_pem + self.cert_pem + self.key_pem).encode()).decode()

    @classmethod
    def from_token(cls, token: str) -> JobTLS:
        """Inverse of :meth:`to_token`; ValueError for anything else."""
        try:
            text = base64.b64decode(token, validate=True).decode()
        except ValueError as exc:
            raise ValueError(f"TLS material is not valid base64: {exc}") from None
        matches = list(re.finditer(r"-----BEGIN ([A-Z ]+)-----.*?-----END \1-----\n?", text, re.S))
        blocks, found = [m.group(1) for m in matches], [m.group(0) for m in matches]
        if len(found) != 3 or blocks[:2] != ["CERTIFICATE", "CERTIFICATE"] or "PRIVATE KEY" not in blocks[2]:
            raise ValueError(f"TLS material must hold a CA certificate, a certificate and a private key, found {blocks}")
        return cls(*found)

    @classmethod
    def generate(cls, common_name: str = "actormesh-job") -> JobTLS:
        """A fresh CA and leaf certificate (EC P-256, valid for 30 days)."""
        try:
            from cryptography import x509
            from cryptography.hazmat.primitives import hashes, serialization
            from cryptography.hazmat.primitives.asymmetric import ec
            from cryptography.x509.oid import NameOID
        except ImportError as exc:
            raise RuntimeError("TLS needs the 'cryptography' package: pip install 'actormesh[tls]'") from exc
        now = datetime.datetime.now(datetime.timezone.utc)
        later = now + datetime.timedelta(days=30)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{common_name} CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(later)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(later)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        return cls(
            ca_pem=ca_cert.public_bytes(pem).decode(),
            cert_pem=cert.public_bytes(pem).decode(),
            key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode(),
        )

    def _context(self, purpose: ssl.Purpose, directory: str) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cadata=self.ca_pem)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        # load_cert_chain only reads files: write them 0600 and remove them at once.
        fd, path = tempfile.mkstemp(prefix="tls-", suffix=".pem", dir=directory)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.cert_pem)
                f.write(self.key_pem)
            ctx.load_cert_chain(path)
        finally:
            os.unlink(path)
        return ctx

    def server_context(self, directory: str) -> ssl.SSLContext:
        """Context for accepting: requires a client certificate from the job CA."""
        return self._context(ssl.Purpose.CLIENT_AUTH, directory)

    def client_context(self, directory: str) -> ssl.SSLContext:
        """Context for dialing: requires a server certificate from the job CA."""
        return self._context(ssl.Purpose.SERVER_AUTH, directory)
