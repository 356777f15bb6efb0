"""The largest MQTT packet a device takes (``updates.max_packet_kb``), against a real agent: a
broker that honours MQTT 5's Maximum Packet Size (Mosquitto) drops a bigger message for the
device; one that ignores it has the connection ended before the payload is read. Either way the
agent's memory does not grow by the message."""

from __future__ import annotations

import re
import socket
import threading
from pathlib import Path

from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.bundle.fleet_protocol import device_desired_topic
from edgekit.fleet.session import FleetSession
from tests.updates.conftest import FLEET, AgentFactory
from tests.updates.services import Agent, Mosquitto, free_port, wait_for

DESIRED = device_desired_topic(FLEET, "dev-1")
_MB = 1024 * 1024


def _send(broker: Mosquitto, topic: str, payload: bytes) -> None:
    with FleetSession(BrokerAddress(False, "127.0.0.1", broker.port)) as session:
        session.publish_retained(topic, payload)


def _reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (proc(5), since Linux 4.0)


def _peak_rss_bytes(pid: int) -> int:
    found = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    assert found
    return int(found.group(1)) * 1024


def _rss_bytes(pid: int) -> int:
    found = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    assert found
    return int(found.group(1)) * 1024


def _agent_pid(agent: Agent) -> int:
    assert agent.proc is not None
    return agent.proc.pid


def test_agent_memory_does_not_grow_by_a_big_message_a_broker_drops_for_it(
    broker: Mosquitto, agents: AgentFactory
) -> None:
    agent = agents(broker.url(), "dev-1").start()  # the default limit: 128 KiB
    wait_for(lambda: "updates: connected to" in agent.log(), 30, "the agent to connect")
    pid = _agent_pid(agent)
    _reset_peak_rss(pid)
    before = _rss_bytes(pid)
    _send(broker, DESIRED, b"x" * (64 * _MB))  # retained: it would come again at every start
    _send(broker, DESIRED, b"a marker behind it")  # delivered after it, on the same topic
    refused = wait_for(lambda: re.findall(r"refused the message on .*", agent.log()), 60, "the marker's refusal")
    assert len(refused) == 1 and "marker" not in refused[0], refused  # the big message never reached the agent
    grown = _peak_rss_bytes(pid) - before
    assert grown < 16 * _MB, f"peak RSS grew by {grown / _MB:.1f} MiB for a 64 MiB message"
    assert "Dropping too large outgoing PUBLISH for dev-1" in broker.log()  # the broker honoured the limit
    assert agent.running


class _OversizeBroker:
    """A broker that ignores the device's Maximum Packet Size: it answers the first CONNECT, then
    announces a 200 MiB PUBLISH and streams its payload (up to 64 MiB) until the device hangs up.
    Later connections get a CONNACK and nothing else."""

    ANNOUNCED = 200 * _MB
    STREAMED_AT_MOST = 64 * _MB

    def __init__(self) -> None:
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self.connect_packets: list[bytes] = []
        self.sent = 0  # payload bytes the device took before it hung up
        self.hung_up = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._listener.close()

    def _serve(self) -> None:
        conns = []
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                break
            conns.append(conn)
            self.connect_packets.append(_read_packet(conn))
            conn.sendall(b"\x20\x03\x00\x00\x00")  # CONNACK: no session, success, no properties
            if len(self.connect_packets) == 1:
                self._stream_oversize(conn)
        for conn in conns:
            conn.close()

    def _stream_oversize(self, conn: socket.socket) -> None:
        topic = DESIRED.encode()
        head = b"\x31" + _varint(self.ANNOUNCED) + len(topic).to_bytes(2, "big") + topic + b"\x00"
        conn.sendall(head)
        chunk = b"x" * _MB
        try:
            while self.sent < self.STREAMED_AT_MOST:
                conn.sendall(chunk)
                self.sent += len(chunk)
        except OSError:
            self.hung_up.set()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, byte = divmod(n, 128)
        out.append(byte | (128 if n else 0))
        if not n:
            return bytes(out)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        block = conn.recv(n - len(out))
        if not block:
            raise ConnectionError("the client hung up mid-packet")
        out += block
    return bytes(out)


def _read_packet(conn: socket.socket) -> bytes:
    """One whole MQTT packet: fixed header, remaining length, the rest."""
    raw = bytearray(_recv_exactly(conn, 1))
    length, mult = 0, 1
    while True:
        byte = _recv_exactly(conn, 1)
        raw += byte
        length += (byte[0] & 127) * mult
        mult *= 128
        if not byte[0] & 128:
            break
    return bytes(raw + _recv_exactly(conn, length))


def test_agent_hangs_up_on_an_oversized_packet_before_reading_it(tmp_path: Path, agents: AgentFactory) -> None:
    fake = _OversizeBroker()
    try:
        agent = agents(f"mqtt://127.0.0.1:{fake.port}", "dev-1").start()
        pid = _agent_pid(agent)
        wait_for(lambda: fake.connect_packets, 30, "the agent to connect")
        # the limit is asked of the broker at CONNECT: Maximum Packet Size (0x27) = 128 KiB
        assert b"\x27" + (128 * 1024).to_bytes(4, "big") in fake.connect_packets[0]
        _reset_peak_rss(pid)
        before = _rss_bytes(pid)
        assert fake.hung_up.wait(60), f"the agent took {fake.sent / _MB:.0f} MiB of a 200 MiB packet"
        lines = wait_for(lambda: re.findall(r".*over updates\.max_packet_kb.*", agent.log()), 20, "the log line")
        assert len(lines) == 1, lines
        assert f"a packet of {fake.ANNOUNCED + 1 + 4} bytes" in lines[0] and "reconnecting" in lines[0], lines[0]
        assert fake.sent < 32 * _MB  # what loopback's socket buffers absorbed, at most
        grown = _peak_rss_bytes(pid) - before
        assert grown < 16 * _MB, f"peak RSS grew by {grown / _MB:.1f} MiB"
        wait_for(lambda: len(fake.connect_packets) >= 2, 30, "the agent to reconnect")
        assert agent.running
    finally:
        fake.close()


def test_a_packet_cap_below_a_signed_documents_size_is_refused(tmp_path: Path) -> None:
    import pytest

    from device_agents.config import config_from_data
    from edgekit.bundle.errors import ConfigError

    base = {"store": "s", "trusted_keys": ["release.pub"]}
    updates = {"broker": "mqtt://127.0.0.1:1883", "fleet": "f", "device_id": "d", "notice_keys": ["fleet.pub"]}
    with pytest.raises(ConfigError, match=r"agent\.updates: max_packet_kb must be >= 66, got 32: a signed desired"):
        config_from_data({**base, "updates": {**updates, "max_packet_kb": 32}}, base=tmp_path)
    assert config_from_data({**base, "updates": updates}, base=tmp_path).updates.max_packet_kb == 128  # type: ignore[union-attr]  # set above
