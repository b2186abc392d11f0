"""Fixtures: a throw-away PKI (CA, server and client certificates) made with ``cryptography``,
and the flags that turn TLS / mTLS on in a service."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

import pytest

from tests.helpers import make_servable_tiny_llama


@dataclasses.dataclass(frozen=True)
class PKI:
    """PEM file paths: ``ca`` signs ``server`` (SAN 127.0.0.1, localhost; server and client
    auth, so the services use it on both sides) and ``client`` (client auth only);
    ``rogue_client`` is signed by another CA."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_client_cert: Path
    rogue_client_key: Path

    def service_flags(self, mtls: bool = True) -> list[str]:
        """The --ssl-* flags of a service (with ``mtls`` also the CA: client certs required)."""
        flags = ["--ssl-certfile", str(self.server_cert), "--ssl-keyfile", str(self.server_key)]
        return flags + (["--ssl-ca-certs", str(self.ca)] if mtls else [])

    def read(self, name: str) -> bytes:
        """The PEM bytes of field ``name`` (e.g. "ca", "client_key")."""
        return getattr(self, name).read_bytes()


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject_key, subject: str, issuer_key, issuer: str, *, ca: bool,
          san: list | None = None, usages: list | None = None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(subject_key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usages:
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, name: str, cert, key) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random-weight Llama with SmolLM2's tokenizer (as in ``tests/stack``)."""
    return make_servable_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


TINY_WORKER = ["--dtype", "float32", "--kv-cache-memory", "64MiB"]
TINY_SCHEDULER = ["--max-num-batched-tokens", "256"]


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> PKI:
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate, and a client
    certificate from an unrelated CA."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID as EKU
    folder = tmp_path_factory.mktemp("pki")
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert(ca_key, "pagedserve test CA", ca_key, "pagedserve test CA", ca=True)
    ca_path, _ = _write(folder, "ca", ca, ca_key)
    server_key = _key()
    server = _cert(server_key, "pagedserve", ca_key, "pagedserve test CA", ca=False,
                   san=[x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                   usages=[EKU.SERVER_AUTH, EKU.CLIENT_AUTH])
    client_key = _key()
    client = _cert(client_key, "client", ca_key, "pagedserve test CA", ca=False,
                   usages=[EKU.CLIENT_AUTH])
    rogue_key = _key()
    rogue = _cert(rogue_key, "rogue", rogue_ca_key, "rogue CA", ca=False,
                  usages=[EKU.CLIENT_AUTH])
    server_paths = _write(folder, "server", server, server_key)
    client_paths = _write(folder, "client", client, client_key)
    rogue_paths = _write(folder, "rogue", rogue, rogue_key)
    return PKI(ca_path, *server_paths, *client_paths, *rogue_paths)
