"""A short MQTT session for host tools: publish retained messages, read retained ones.

``edgekit publish`` and ``edgekit fleet status`` connect, do one thing and disconnect. Errors
say what to check (address, certificates, the broker's ACL) instead of a paho return code.
"""

from __future__ import annotations

import argparse
import ssl
import threading
import time
import uuid
from types import TracebackType
from typing import Any

from edgekit.bundle.fleet_connection import BrokerAddress, new_client, session_properties
from edgekit.errors import EdgekitError


def broker_address(args: argparse.Namespace) -> BrokerAddress:
    """The broker the fleet commands' ``--broker``, ``--ca``, ``--cert`` and ``--key`` name."""
    return BrokerAddress.parse(args.broker, ca=args.ca, cert=args.cert, key=args.key)


class BrokerError(EdgekitError):
    """The broker could not be reached, refused us, or did not confirm a message."""

    exit_code = 5


class FleetSession:
    """``with FleetSession(address) as s: s.publish_retained(topic, payload)``."""

    def __init__(self, address: BrokerAddress, *, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._client = new_client(address, f"edgekit-host-{uuid.uuid4().hex[:12]}")
        self._connected = threading.Event()
        self._connack: Any = None
        self._acks: dict[int, Any] = {}
        self._acked = threading.Condition()
        self._messages: dict[str, bytes] = {}
        self._subscribed = threading.Event()
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_publish = self._on_publish
        self._client.on_message = self._on_message
        self._client.on_subscribe = self._on_subscribe

    # -- paho callbacks (network thread) ----------------------------------------------------
    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self._connack = reason
        self._connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if not self._connected.is_set():
            self._connack = reason
            self._connected.set()

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        with self._acked:
            self._acks[mid] = reason
            self._acked.notify_all()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        self._messages[message.topic] = bytes(message.payload)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        self._subscribed.set()

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> FleetSession:
        where = self.address.url
        try:
            self._client.connect(
                self.address.host,
                self.address.port,
                keepalive=30,
                clean_start=True,
                properties=session_properties(False),
            )
        except ssl.SSLError as exc:
            raise BrokerError(f"TLS to {where} failed ({exc.reason or exc}); check --ca, --cert and --tls-key") from exc
        except OSError as exc:
            raise BrokerError(f"cannot connect to {where}: {exc}; is the broker running?") from exc
        self._client.loop_start()
        if not self._connected.wait(self.timeout_s):
            self.close()
            raise BrokerError(f"{where} did not answer within {self.timeout_s:g} s")
        if self._connack is None or self._connack.is_failure:
            self.close()
            raise BrokerError(
                f"{where} refused the connection ({self._connack}); check the client certificate and the broker's ACL"
            )
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    # -- operations --------------------------------------------------------------------------
    def publish_retained(self, topic: str, payload: bytes) -> None:
        """Publish ``payload`` retained with QoS 1 and wait until the broker has accepted it."""
        info = self._client.publish(topic, payload, qos=1, retain=True)
        deadline = time.monotonic() + self.timeout_s
        with self._acked:
            while info.mid not in self._acks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerError(
                        f"{self.address.url} did not confirm the message on {topic} within {self.timeout_s:g} s"
                    )
                self._acked.wait(left)
            reason = self._acks.pop(info.mid)
        if reason.is_failure:
            raise BrokerError(
                f"{self.address.url} refused the message on {topic} ({reason}); the broker's ACL must let this "
                "client write desired topics"
            )

    def read_retained(self, topic: str, wait_s: float = 0.5) -> bytes:
        """The retained message on one exact ``topic`` (b"" when there is none within ``wait_s``
        after the broker confirmed the subscription)."""
        self._subscribed.clear()
        self._client.subscribe(topic, qos=1)
        if not self._subscribed.wait(self.timeout_s):
            raise BrokerError(f"{self.address.url} did not confirm the subscription to {topic}")
        deadline = time.monotonic() + wait_s
        while topic not in self._messages and time.monotonic() < deadline:
            time.sleep(0.02)
        self._client.unsubscribe(topic)
        return self._messages.pop(topic, b"")

    def collect_retained(self, topic_filter: str, window_s: float) -> dict[str, bytes]:
        """Subscribe to ``topic_filter`` and return what arrives within ``window_s`` (topic -> payload)."""
        self._client.subscribe(topic_filter, qos=1)
        if not self._subscribed.wait(self.timeout_s):
            raise BrokerError(f"{self.address.url} did not confirm the subscription to {topic_filter}")
        time.sleep(window_s)  # retained messages follow the SUBACK; there is no end-of-retained marker
        return dict(self._messages)
