"""HTTPS for the agent's front-end, and mutual TLS as the other way (besides the bearer token)
for clients off loopback to prove who they are.

``[server] tls_cert_file`` / ``tls_key_file`` (PEM) turn every connection into TLS (1.2 or newer);
``client_ca_file`` asks clients for a certificate and checks it against that CA. The request is
optional in the handshake (``CERT_OPTIONAL``): a certificate that does not verify ends the
handshake, while a client without one gets through it, so that tools on the device itself
(``edgekit-agent install``, the supervisor's health probe) need none; the front-end then refuses
a client off loopback without a verified certificate (or the bearer token) before any route
runs (``serving.transport``).
"""

from __future__ import annotations

import ssl

from device_agents.config import ServerConfig
from edgekit.bundle.errors import ConfigError


def server_context(limits: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context from ``limits``; None when TLS is not configured."""
    if limits.tls_cert_file is None or limits.tls_key_file is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(limits.tls_cert_file, limits.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"server.tls_cert_file {limits.tls_cert_file} / tls_key_file {limits.tls_key_file}: cannot load them "
            f"({_reason(exc)}); give a PEM certificate chain and its unencrypted PEM key"
        ) from None
    if limits.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=str(limits.client_ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"server.client_ca_file {limits.client_ca_file}: cannot load it ({_reason(exc)}); give the PEM "
                "certificate of the CA that signs the clients' certificates"
            ) from None
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


def local_client_context() -> ssl.SSLContext:
    """For the device's own tools talking to the daemon at the address it published in the store
    (``daemon.json``): the connection does not leave this machine, and the certificate names the
    device's network name, not that address; so it is not verified."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def local_context_for(url: str) -> ssl.SSLContext | None:
    """``local_client_context()`` for an https daemon URL, None for plain http."""
    return local_client_context() if url.startswith("https:") else None


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc)
