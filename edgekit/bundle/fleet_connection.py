"""How edgekit talks to an MQTT broker: MQTT 5 over TCP, or TLS with a client certificate.

One place for the paho-mqtt settings that device and host share. ``mqtts://`` verifies the
broker's certificate against ``ca`` (the system's CAs when ``ca`` is None) and presents
``cert``/``key`` when given; brokers set up with ``packaging/mosquitto`` take the identity of a
device from its certificate's common name, so the device id and the CN must be the same.
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from edgekit.bundle.errors import ConfigError

if TYPE_CHECKING:
    import paho.mqtt.client as mqtt
    from paho.mqtt.properties import Properties

# A persistent session outlives a disconnect by this long on the broker (MQTT 5 session expiry).
SESSION_EXPIRY_S = 7 * 24 * 3600


@dataclass(frozen=True)
class BrokerAddress:
    tls: bool
    host: str
    port: int
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    @classmethod
    def parse(
        cls, url: str, *, ca: Path | None = None, cert: Path | None = None, key: Path | None = None
    ) -> BrokerAddress:
        """``mqtt://HOST:PORT`` or ``mqtts://HOST:PORT`` plus the TLS files, checked."""
        try:
            tls, host, port = parse_broker(url)
        except ValueError as exc:
            raise ConfigError(f"--broker: {exc}") from exc
        if (cert is None) != (key is None):
            raise ConfigError("--cert and --key go together: give both for client-certificate auth, or neither")
        if not tls and (ca or cert):
            raise ConfigError(f"{url} is plain MQTT: use mqtts://{host}:{port} with --ca/--cert/--key")
        for label, path in (("ca", ca), ("cert", cert), ("key", key)):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{label} file {path} does not exist")
        return cls(tls, host, port, ca, cert, key)

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def parse_broker(url: str) -> tuple[bool, str, int]:
    """``"mqtts://host:8883"`` -> (tls, host, port)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"broker {url!r} must be mqtt://HOST:PORT or mqtts://HOST:PORT")
    return parts.scheme == "mqtts", parts.hostname, port


def new_client(
    address: BrokerAddress,
    client_id: str,
    *,
    max_packet_bytes: int = 0,
    on_oversize: Callable[[int], None] | None = None,
) -> mqtt.Client:
    """A paho client (MQTT 5, callback API 2) set up for ``address``; not connected yet.

    paho's own reconnect loop is off: callers reconnect with jittered backoff themselves.

    ``max_packet_bytes`` (0: no limit): a packet from the broker whose announced size is over it
    ends the connection before its first payload byte is read (MQTT 5 3.1.2.11.4: "Packet too
    large"), so its bytes are never kept; ``on_oversize(size)`` is called first. Pair it with
    ``session_properties(..., max_packet_bytes=...)``, which asks the broker not to send one: a
    broker that honours MQTT 5's Maximum Packet Size (Mosquitto does) drops it itself.
    """
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    cls = _capped_client_class() if max_packet_bytes > 0 else mqtt.Client
    client = cls(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=MQTTProtocolVersion.MQTTv5,
        reconnect_on_failure=False,
    )
    if max_packet_bytes > 0:
        client.max_packet_bytes = max_packet_bytes  # type: ignore[attr-defined]  # the capped subclass's
        client.on_oversize = on_oversize  # type: ignore[attr-defined]  # the capped subclass's
    if address.tls:
        context = ssl.create_default_context(cafile=str(address.ca) if address.ca else None)
        if address.cert is not None and address.key is not None:
            context.load_cert_chain(str(address.cert), str(address.key))
        client.tls_set_context(context)
    return client


@functools.cache
def _capped_client_class() -> type[mqtt.Client]:
    """paho's Client refusing packets over ``max_packet_bytes`` on the receive path.

    paho reads a packet's remaining length, then the whole packet into one buffer, with no
    limit of its own; the check sits in ``_sock_recv``, which paho calls for every read: once
    the length is known and over the limit, it answers as a closed socket would (paho then
    closes the connection without a word, and its buffer holds no payload byte). Written
    against paho-mqtt 2.x's ``_in_packet`` (its reader's state)."""
    import paho.mqtt.client as mqtt

    class CappedClient(mqtt.Client):
        max_packet_bytes = 0
        on_oversize: Callable[[int], None] | None = None

        def _sock_recv(self, bufsize: int) -> bytes:
            packet: Any = self._in_packet
            if packet["have_remaining"]:
                # the whole packet: fixed header byte + length bytes + what follows them
                size = 1 + len(packet["remaining_count"]) + int(packet["remaining_length"])
                if size > self.max_packet_bytes:
                    if self.on_oversize is not None:
                        self.on_oversize(size)
                    return b""
            return super()._sock_recv(bufsize)

    return CappedClient


def session_properties(persistent: bool, *, max_packet_bytes: int = 0) -> Properties:
    """CONNECT properties: a session that survives disconnects (device) or none (host tools);
    with ``max_packet_bytes``, MQTT 5's Maximum Packet Size: the broker must not send a bigger
    packet (it drops the message for this client instead)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]  # paho's Properties is unannotated
    props.SessionExpiryInterval = SESSION_EXPIRY_S if persistent else 0
    if max_packet_bytes > 0:
        props.MaximumPacketSize = max_packet_bytes
    return props
