"""TLS with client certificates and the per-device ACL of packaging/mosquitto, on a real broker."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.fleet.acl import GroupsFile, render_acl
from edgekit.fleet.session import BrokerError, FleetSession
from tests.updates.conftest import FLEET, AgentFactory, Keys, edgekit, publish, require_mosquitto
from tests.updates.pki import Identity, TestCA
from tests.updates.services import FileServer, Mosquitto, Watcher, fleet_broker, wait_for


@dataclass(frozen=True)
class Fleet:
    broker: Mosquitto
    ca: TestCA
    publisher: Identity
    dev_a: Identity
    dev_b: Identity
    revoked: Identity
    rogue_a: Identity  # CN dev-a, but issued by another CA
    rogue_ca: Path

    def address(self, who: Identity | None, ca: Path | None = None) -> BrokerAddress:
        return BrokerAddress(
            True,
            "127.0.0.1",
            self.broker.port,
            ca or self.ca.cert_path,
            who.cert if who else None,
            who.key if who else None,
        )

    def tls_args(self, who: Identity) -> tuple[Path, Path, Path]:
        return (self.ca.cert_path, who.cert, who.key)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    require_mosquitto()
    ca = TestCA(tmp_path / "ca")
    server = ca.issue("localhost", server=True)
    revoked = ca.issue("dev-r")
    ca.write_crl((revoked,))
    rogue = TestCA(tmp_path / "rogue", "rogue CA")
    acl = render_acl(FLEET, GroupsFile({"cams": ("dev-a",), "lobby": ("dev-b",)}))
    broker = fleet_broker(tmp_path / "broker", ca, server, acl).start()
    yield Fleet(
        broker, ca, ca.issue("edgekit-publisher"), ca.issue("dev-a"), ca.issue("dev-b"), revoked,
        rogue.issue("dev-a"), rogue.cert_path,
    )  # fmt: skip
    broker.kill()


def _topic(device: str, kind: str) -> str:
    return f"edgekit/{FLEET}/{device}/{kind}"


def test_device_reads_only_its_own_desired_topic_and_writes_only_its_own_reported(fleet: Fleet) -> None:
    group = f"edgekit/{FLEET}/group/cams/desired"
    with FleetSession(fleet.address(fleet.publisher)) as pub:
        for topic in (_topic("dev-a", "desired"), _topic("dev-b", "desired"), group):
            pub.publish_retained(topic, f"for {topic}".encode())
    reports = Watcher(fleet.broker.port, [f"edgekit/{FLEET}/+/reported"], tls=(fleet.ca.cert_path, fleet.publisher))
    dev_a = Watcher(
        fleet.broker.port,
        [_topic("dev-a", "desired"), _topic("dev-b", "desired"), group, "edgekit/#"],
        tls=(fleet.ca.cert_path, fleet.dev_a),
    )
    try:
        # The broker handles one client's messages in order: once dev-a's own report arrives, the
        # two messages it sent before have been accepted or dropped, and the retained messages of
        # its subscriptions (sent in the order subscribed) have been delivered.
        dev_a.client.publish(_topic("dev-a", "desired"), b"dev-a rewriting its own desired state", qos=1)
        dev_a.client.publish(_topic("dev-b", "reported"), b"written by dev-a as dev-b", qos=1)
        dev_a.client.publish(_topic("dev-a", "reported"), b"written by dev-a as dev-a", qos=1)
        wait_for(lambda: reports.messages, 10, "dev-a's own report")
        wait_for(lambda: any(t == group for _, t, _ in dev_a.messages), 10, "the retained messages")
        seen_by_a = {(t, p) for _, t, p in dev_a.messages}
        reported = {(t, p) for _, t, p in reports.messages}
    finally:
        dev_a.close()
        reports.close()
    assert (_topic("dev-a", "desired"), f"for {_topic('dev-a', 'desired')}".encode()) in seen_by_a
    assert (group, f"for {group}".encode()) in seen_by_a
    assert not [t for t, _ in seen_by_a if "dev-b" in t], seen_by_a
    assert reported == {(_topic("dev-a", "reported"), b"written by dev-a as dev-a")}
    with FleetSession(fleet.address(fleet.publisher)) as pub:
        retained = pub.collect_retained(_topic("dev-a", "desired"), 0.3)
    assert retained == {_topic("dev-a", "desired"): f"for {_topic('dev-a', 'desired')}".encode()}


@pytest.mark.parametrize(
    ("who", "why"),
    [
        ("rogue_a", "a client certificate from another CA"),
        ("revoked", "a revoked client certificate (crlfile)"),
        (None, "no client certificate"),
        ("wrong_server_ca", "a client that does not trust the broker's CA"),
    ],
)
def test_broker_refuses_clients_without_a_valid_certificate(fleet: Fleet, who: str | None, why: str) -> None:
    with FleetSession(fleet.address(fleet.dev_a), timeout_s=5):  # the same broker takes a valid certificate
        pass
    if who == "wrong_server_ca":
        address = fleet.address(fleet.dev_a, ca=fleet.rogue_ca)
    else:
        address = fleet.address(getattr(fleet, who) if who else None)
    with pytest.raises(BrokerError):
        with FleetSession(address, timeout_s=5):
            pass


def test_update_over_mqtts_with_client_certificates_and_acl(
    fleet: Fleet, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(fleet.broker.url(tls=True), "dev-a", tls=fleet.dev_a, ca=fleet.ca.cert_path).start()
    publish(
        tiny_bundles[2], fleet.broker.url(tls=True), files, keys.public, "--device", "dev-a",
        tls=fleet.tls_args(fleet.publisher),
    )  # fmt: skip
    agent.wait_version("tiny", 2)
    ca, cert, key = fleet.tls_args(fleet.publisher)

    def status_row() -> list[list[str]]:
        table = edgekit(
            "fleet", "status", "--broker", fleet.broker.url(tls=True), "--fleet", FLEET, "--wait-s", "0.3",
            "--ca", str(ca), "--cert", str(cert), "--tls-key", str(key),
        )  # fmt: skip
        return [line.split()[:5] for line in table.strip().splitlines()[1:]]

    wait_for(lambda: status_row() == [["dev-a", "tiny", "2", "2", "serving"]], 20, "fleet status to show dev-a on v2")


class _Client:
    """A paho client that records its disconnects and confirms QoS 1 round trips."""

    def __init__(self, fleet: Fleet, who: Identity, client_id: str) -> None:
        import threading

        from edgekit.bundle.fleet_connection import new_client

        self.disconnects: list[str] = []
        self.connected = threading.Event()
        self.acked = threading.Event()
        self.client = new_client(fleet.address(who), client_id)
        self.client.on_connect = lambda c, u, f, rc, p: self.connected.set()
        self.client.on_disconnect = lambda c, u, f, rc, p: self.disconnects.append(str(rc))
        self.client.on_publish = lambda c, u, mid, rc, p: self.acked.set()
        self.client.connect("127.0.0.1", fleet.broker.port, 30)
        self.client.loop_start()
        if not self.connected.wait(10):
            raise TimeoutError(f"{client_id} did not connect")

    def round_trip(self, topic: str) -> bool:
        """Whether a QoS 1 publish on ``topic`` is acknowledged (a live session), within 5 s."""
        self.acked.clear()
        self.client.publish(topic, b"ping", qos=1)
        return self.acked.wait(5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_certificate_cannot_take_over_another_devices_client_id(fleet: Fleet) -> None:
    dev_a = _Client(fleet, fleet.dev_a, "dev-a")
    try:
        # dev-b's certificate asks for dev-a's client id: the broker names the session after the
        # certificate (use_username_as_clientid), so dev-a is not kicked off. The takeover, if any,
        # happens before the CONNACK that _Client waits for.
        impostor = _Client(fleet, fleet.dev_b, "dev-a")
        try:
            assert dev_a.round_trip(_topic("dev-a", "reported")), "dev-a's session was taken over"
            assert dev_a.disconnects == []
            assert impostor.round_trip(_topic("dev-b", "reported"))
        finally:
            impostor.close()
        log = fleet.broker.log()
        assert "as dev-b " in log or "as dev-b\n" in log or "u'dev-b'" in log, log[-2000:]
    finally:
        dev_a.close()


def test_group_desired_state_is_readable_only_by_the_groups_members(fleet: Fleet) -> None:
    cams, lobby = f"edgekit/{FLEET}/group/cams/desired", f"edgekit/{FLEET}/group/lobby/desired"
    keys = f"edgekit/{FLEET}/keys"
    with FleetSession(fleet.address(fleet.publisher)) as pub:
        pub.publish_retained(keys, b"the keys document")
        pub.publish_retained(cams, b"for cams")
        pub.publish_retained(lobby, b"for lobby, with a presigned URL")
    # dev-a is in cams only. Retained messages come in the order subscribed: once the cams one
    # (subscribed last) has arrived, a lobby one would have arrived before it.
    dev_a = Watcher(fleet.broker.port, [lobby, f"edgekit/{FLEET}/group/+/desired", keys, cams],
                    tls=(fleet.ca.cert_path, fleet.dev_a))  # fmt: skip
    dev_b = Watcher(fleet.broker.port, [cams, lobby], tls=(fleet.ca.cert_path, fleet.dev_b))
    try:
        wait_for(lambda: any(t == cams for _, t, _ in dev_a.messages), 10, "dev-a to get its group's state")
        wait_for(lambda: any(t == lobby for _, t, _ in dev_b.messages), 10, "dev-b to get its group's state")
        assert {t for _, t, _ in dev_a.messages} == {cams, keys}  # and every device reads the keys document
        assert {t for _, t, _ in dev_b.messages} == {lobby}
    finally:
        dev_a.close()
        dev_b.close()


def test_fleet_acl_command_writes_the_packaged_example(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[2] / "packaging" / "mosquitto"
    out = edgekit("fleet", "acl", "--fleet", "shop-floor", "--groups", str(example / "groups.example.toml"))
    assert out == (example / "edgekit.acl").read_text()
    bad = tmp_path / "groups.toml"
    bad.write_text('[groups]\ncams = ["cam/07"]\n')
    with pytest.raises(AssertionError, match="must be letters, digits"):
        edgekit("fleet", "acl", "--fleet", "f", "--groups", str(bad))
