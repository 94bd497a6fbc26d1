"""Transport security: grpc server and channel credentials from a service's
config, and the identities of a verified client certificate.

Every service's config carries the same four fields (tls_cert_file,
tls_key_file, tls_ca_file, tls_require_client_cert); a service that calls
others also has upstream_tls. Its certificate is both what it serves and
what it presents to the services it calls (`make certs` issues each for
server and client use), and one CA file verifies peers either way.
"""

from __future__ import annotations

import os

import grpc

from services.common.config import require

TLS_HELP = {
    "tls_cert_file": "PEM certificate (chain) this service serves and presents to the services it calls; "
    "empty: plaintext",
    "tls_key_file": "PEM private key of tls_cert_file",
    "tls_ca_file": "PEM CA bundle that verifies client certificates and, with upstream_tls, the servers called",
    "tls_require_client_cert": "refuse, at the handshake, a client without a certificate from tls_ca_file",
    "upstream_tls": "call the internal services over TLS, verified by tls_ca_file (presenting tls_cert_file when set)",
}


def check(config) -> None:
    """Config check of the TLS fields of any service's config; raises ValueError naming the field."""
    cert, key, ca = config.tls_cert_file, config.tls_key_file, config.tls_ca_file
    require(
        bool(cert) == bool(key),
        f"tls_cert_file and tls_key_file go together, got tls_cert_file={cert!r} and tls_key_file={key!r}",
    )
    require(
        not config.tls_require_client_cert or bool(cert and ca),
        "tls_require_client_cert needs tls_cert_file, tls_key_file and tls_ca_file, got "
        f"tls_cert_file={cert!r}, tls_ca_file={ca!r}",
    )
    require(
        not getattr(config, "upstream_tls", False) or bool(ca),
        "upstream_tls needs tls_ca_file to verify the servers called, got tls_ca_file=''",
    )
    for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
        path = getattr(config, name)
        require(
            not path or (os.access(path, os.R_OK) and os.path.isfile(path)), f"{name} {path!r} is not a readable file"
        )


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def server_credentials(config) -> grpc.ServerCredentials | None:
    """The server's credentials, or None for plaintext (no tls_cert_file)."""
    if not config.tls_cert_file:
        return None
    # Without require_client_cert no certificate is asked for, so none is ever
    # seen unverified: peer_identities() then finds none.
    return grpc.ssl_server_credentials(
        [(_read(config.tls_key_file), _read(config.tls_cert_file))],
        root_certificates=_read(config.tls_ca_file) if config.tls_require_client_cert else None,
        require_client_auth=config.tls_require_client_cert,
    )


def channel_credentials(ca_file: str, cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """Credentials that verify the server by `ca_file` and present `cert_file` when given."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file),
        private_key=_read(key_file) if cert_file else None,
        certificate_chain=_read(cert_file) if cert_file else None,
    )


def upstream_credentials(config) -> grpc.ChannelCredentials | None:
    """What a service's clients of the internal services use: None (plaintext) unless upstream_tls."""
    if not config.upstream_tls:
        return None
    return channel_credentials(config.tls_ca_file, config.tls_cert_file, config.tls_key_file)


def bind(server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds `address` with TLS when there are credentials; returns the bound port."""
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


def aio_channel(address: str, credentials: grpc.ChannelCredentials | None, options=None) -> grpc.aio.Channel:
    """A grpc.aio channel, over TLS when there are credentials."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def channel(address: str, credentials: grpc.ChannelCredentials | None, options=None) -> grpc.Channel:
    """A blocking channel, over TLS when there are credentials."""
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


# Properties grpc sets from a peer certificate that the handshake verified.
_IDENTITY_PROPERTIES = ("x509_common_name", "x509_subject_alternative_name")


def peer_identities(context) -> tuple[str, ...]:
    """The verified client certificate's common name, then its subject
    alternative names (DNS, URI, IP), each once; () for a caller without one
    (plaintext, or a server that does not ask for certificates)."""
    auth = context.auth_context() or {}
    if auth.get("transport_security_type") != [b"ssl"]:
        return ()
    found: list[str] = []
    for name in _IDENTITY_PROPERTIES:
        for value in auth.get(name, ()):
            text = value.decode("utf-8", "replace")
            if text not in found:
                found.append(text)
    return tuple(found)
