"""The run's TLS certificate, made on the driver when Spark's encryption is on (what the
channel's two ends do with it: :mod:`sparktorch_ops.wire.tls`). ``cryptography`` is imported
only here, only when encryption is on.
"""

from __future__ import annotations

import datetime
import hashlib

from sparktorch_ops.wire.tls import ChannelCertificate

_VALIDITY = datetime.timedelta(days=365)  # pinned by fingerprint, so expiry protects nothing


def make_certificate() -> ChannelCertificate:
    """A fresh self-signed P-256 certificate for one run."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sparktorch-ops channel")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + _VALIDITY)
        .sign(key, hashes.SHA256())
    )
    der = cert.public_bytes(serialization.Encoding.DER)
    return ChannelCertificate(
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        fingerprint=hashlib.sha256(der).hexdigest(),
    )
