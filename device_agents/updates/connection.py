"""How edgekit talks to an MQTT broker: MQTT 5 over TCP, or TLS with a client certificate.

One place for the paho-mqtt settings that device and host share. ``mqtts://`` verifies the
broker's certificate against ``ca`` (the system's CAs when ``ca`` is None) and presents
``cert``/``key`` when given; brokers set up with ``packaging/mosquitto`` take the identity of a
device from its certificate's common name, so the device id and the CN must be the same.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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
        from device_agents.config import parse_broker

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


def new_client(address: BrokerAddress, client_id: str) -> mqtt.Client:
    """A paho client (MQTT 5, callback API 2) set up for ``address``; not connected yet.

    paho's own reconnect loop is off: callers reconnect with jittered backoff themselves.
    """
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion

    client = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=MQTTProtocolVersion.MQTTv5,
        reconnect_on_failure=False,
    )
    if address.tls:
        context = ssl.create_default_context(cafile=str(address.ca) if address.ca else None)
        if address.cert is not None and address.key is not None:
            context.load_cert_chain(str(address.cert), str(address.key))
        client.tls_set_context(context)
    return client


def session_properties(persistent: bool) -> Properties:
    """CONNECT properties: a session that survives disconnects (device) or none (host tools)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]  # paho's Properties is unannotated
    props.SessionExpiryInterval = SESSION_EXPIRY_S if persistent else 0
    return props
