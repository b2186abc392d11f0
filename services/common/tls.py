"""TLS and mutual TLS (mTLS) for every gRPC link, and HTTPS for the OpenAI-compatible API.

Each service takes the same three flags (vLLM's HTTP names):

- ``--ssl-certfile`` / ``--ssl-keyfile``: this service's certificate chain and private key (PEM).
  Its server uses them, and its outgoing channels present them as the client certificate.
- ``--ssl-ca-certs``: a PEM CA bundle. Outgoing channels verify their peer against it; a server
  given it requires and verifies client certificates (mTLS).

Without any of them everything is plaintext, as before. An outgoing channel uses TLS as soon as
this service has a certificate or a CA bundle; it verifies the peer against ``--ssl-ca-certs``
or, without it, against the system's trust store (grpc's default roots).

NOTE: a service's settings apply to both of its sides, so in one deployment every service gets
the same three flags (``pagedserve serve`` forwards them to all). TLS without mTLS on the
internal links therefore needs the CA in the system trust store (or grpc's
``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``); with a private CA use mTLS on the internal links.
"""

from __future__ import annotations

import argparse
import dataclasses
import ssl
from pathlib import Path

import grpc

from services.common.config import add_flag


@dataclasses.dataclass(frozen=True, slots=True)
class TLSConfig:
    """PEM bytes of one service's TLS settings (see the module docstring).

    Attributes:
        certificate_chain / private_key: this service's certificate and key, or None.
        root_certificates: the CA bundle that verifies peers (and requires client
            certificates on the server), or None.
    """

    certificate_chain: bytes | None = None
    private_key: bytes | None = dataclasses.field(default=None, repr=False)  # never logged
    root_certificates: bytes | None = None
    # the file paths, for the HTTPS context (ssl wants files)
    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None

    @property
    def mtls(self) -> bool:
        """Whether this service's server requires client certificates."""
        return self.root_certificates is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``server.add_secure_port``.

        Raises:
            ValueError: no certificate/key (a TLS server needs both).
        """
        if self.certificate_chain is None or self.private_key is None:
            raise ValueError("a TLS server needs --ssl-certfile and --ssl-keyfile")
        return grpc.ssl_server_credentials(
            [(self.private_key, self.certificate_chain)],
            root_certificates=self.root_certificates, require_client_auth=self.mtls)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for ``grpc.aio.secure_channel``: verify the peer against the CA bundle
        (system roots without it) and present this service's certificate, if any."""
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates,
                                            private_key=self.private_key,
                                            certificate_chain=self.certificate_chain)

    def http_ssl_context(self) -> ssl.SSLContext:
        """An ``ssl.SSLContext`` for the HTTPS server: this certificate, and with a CA bundle
        client certificates required (as on the gRPC port).

        Raises:
            ValueError: no certificate/key.
        """
        if self.certfile is None or self.keyfile is None:
            raise ValueError("HTTPS needs --ssl-certfile and --ssl-keyfile")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.certfile, self.keyfile)
        if self.ca_certs is not None:
            ctx.load_verify_locations(self.ca_certs)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    """``--ssl-certfile``, ``--ssl-keyfile``, ``--ssl-ca-certs`` (env ``PAGEDSERVE_SSL_*``)."""
    add_flag(p, "--ssl-certfile", default=None,
             help="PEM certificate (chain) of this service: its server serves TLS with it and "
                  "presents it as client certificate on outgoing links (needs --ssl-keyfile)")
    add_flag(p, "--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")
    add_flag(p, "--ssl-ca-certs", default=None,
             help="PEM CA bundle that verifies peers; on a server it also requires and "
                  "verifies client certificates (mTLS)")


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise FileNotFoundError(f"{flag} {path}: {e.strerror or e}") from None


def load_tls(certfile: str | None = None, keyfile: str | None = None,
             ca_certs: str | None = None) -> TLSConfig | None:
    """Read the PEM files; None when none is given (plaintext).

    Raises:
        ValueError: only one of certfile / keyfile given.
        FileNotFoundError: a file cannot be read (names the flag).
    """
    if certfile is None and keyfile is None and ca_certs is None:
        return None
    if (certfile is None) != (keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile must be given together")
    return TLSConfig(certificate_chain=_read(certfile, "--ssl-certfile"),
                     private_key=_read(keyfile, "--ssl-keyfile"),
                     root_certificates=_read(ca_certs, "--ssl-ca-certs"),
                     certfile=certfile, keyfile=keyfile, ca_certs=ca_certs)


def tls_from_args(args) -> TLSConfig | None:
    """``load_tls`` from a namespace with the ``add_tls_flags`` flags.

    Raises:
        ValueError / FileNotFoundError: as ``load_tls``.
    """
    return load_tls(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)


def client_credentials(tls: TLSConfig | None) -> grpc.ChannelCredentials | None:
    """The outgoing-channel credentials of a service (None: plaintext)."""
    return None if tls is None else tls.channel_credentials()


def aio_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                options=None) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: TLS with ``credentials``, else plaintext."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)
