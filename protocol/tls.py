"""TLS on the direct gRPC path: each server's own certificate, pinned through its signed records.

There is no certificate authority in a volunteer swarm. A peer serving gRPC with TLS makes a
fresh self-signed certificate (EC P-256) when it starts and puts its PEM into the holdings records
it signs with its DHT key; a fetcher trusts exactly that certificate for that endpoint and
nothing else (it is the only root of the channel). So whoever can forge the record can forge the
certificate, and whoever cannot (everyone without the peer's key) cannot read or alter the bytes
in between. The certificate names ``TLS_NAME``, not a host: peers are reached by address, and
the record, not DNS, says whose address it is.

TLS is on whenever the swarm is private (``--swarm-key``) or when asked (``--grpc-tls``). A
fetcher in a private swarm dials only TLS endpoints over gRPC (libp2p is encrypted by its own
handshake); in a public one it follows what the holder's record says.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["TLS_NAME", "ServerCertificate", "channel_credentials", "channel_options"]

TLS_NAME = "cgad-node"
VALID_FOR = datetime.timedelta(days=365)  # outlives any run; a restart makes a new one anyway


@dataclass(frozen=True)
class ServerCertificate:
    """A private key and its self-signed certificate, both PEM."""

    key_pem: bytes
    certificate_pem: str

    @classmethod
    def create(cls) -> ServerCertificate:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, TLS_NAME)])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))  # clocks of volunteers disagree
            .not_valid_after(now + VALID_FOR)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cls(key_pem, certificate.public_bytes(serialization.Encoding.PEM).decode("ascii"))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.certificate_pem.encode("ascii"))])


def channel_credentials(certificate_pem: str) -> grpc.ChannelCredentials:
    """Credentials that trust ``certificate_pem`` alone: the holder's, from its signed record."""
    return grpc.ssl_channel_credentials(root_certificates=certificate_pem.encode("ascii"))


def channel_options() -> list[tuple[str, str]]:
    """The name every peer's certificate carries, checked instead of the dialled address."""
    return [("grpc.ssl_target_name_override", TLS_NAME), ("grpc.default_authority", TLS_NAME)]
