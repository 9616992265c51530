"""TLS for the rank -> driver channel when Spark's own encryption is on.

Each run makes a fresh self-signed certificate on the driver; its SHA-256 fingerprint travels
with the run plan (to barrier tasks inside the Spark task, which Spark encrypts, and to ranks in
their environment: a fingerprint is not a secret). Clients pin that fingerprint instead of
checking a CA or a host name, so no PKI is needed and a man in the middle cannot present its own
certificate. The driver makes the certificate (:mod:`sparktorch_ops.driver.certificate`, the
one place ``cryptography`` is imported); this module holds what both ends need, on ``ssl``
alone.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
import tempfile
from dataclasses import dataclass, field

from sparktorch_ops.errors import ChannelError


@dataclass(frozen=True)
class ChannelCertificate:
    """One run's certificate (PEM) and private key; the key never leaves the driver.

    Attributes:
        cert_pem: the certificate.
        key_pem: its private key (kept out of the repr).
        fingerprint: SHA-256 of the DER certificate, lowercase hex (what clients pin).
    """

    cert_pem: bytes
    key_pem: bytes = field(repr=False)
    fingerprint: str

    def server_context(self) -> ssl.SSLContext:
        """A TLS 1.2+ server context holding this certificate."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # load_cert_chain reads files only: a private directory, removed at once.
        with tempfile.TemporaryDirectory(prefix="sparktorch-tls-") as directory:
            cert_path = os.path.join(directory, "cert.pem")
            key_path = os.path.join(directory, "key.pem")
            for path, data in ((cert_path, self.cert_pem), (key_path, self.key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
            context.load_cert_chain(cert_path, key_path)
        return context


def client_context() -> ssl.SSLContext:
    """A TLS 1.2+ client context that leaves the server's identity to :func:`check_pinned`."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # no CA: the fingerprint below is the check
    return context


def check_pinned(sock: ssl.SSLSocket, fingerprint: str, address: str) -> None:
    """Refuse a server whose certificate is not the run's.

    Raises:
        ChannelError: the certificate's fingerprint differs (someone else answered).
    """
    der = sock.getpeercert(binary_form=True) or b""
    actual = hashlib.sha256(der).hexdigest()
    if not hmac.compare_digest(actual, fingerprint.lower()):
        raise ChannelError(
            f"the channel at {address} presented a certificate that is not this run's "
            f"(fingerprint {actual[:16]}..., expected {fingerprint[:16]}...); refusing it"
        )
