"""What one client can hold of the running agent, over real sockets on loopback: a slow body holds
the buffer budget for the bytes it sent, not for the length it declared, and is due by a deadline
(a minimum rate), not by a silence timeout per read; headers are due by a deadline too, their
block is capped before it is kept, and connections reading headers give way to new clients."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import select
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.agent.conftest import Bundles, RunningAgent, agent_cli, start_agent, write_config
from tests.factories import sample_inputs

# the default budget (64 MiB as received), a short deadline for a 1 MiB body: 5 s + 1 MiB at 1 MiB/s
LIMITS = """
[server]
idle_timeout_s = 5.0
min_body_rate_kib_s = 1024
header_timeout_s = 1.0
max_connections = 4
allowed_hosts = ["Edge.local"]
[models.tiny]
max_request_rows = 4
"""
_MIB = 1 << 20


def _infer_body(x: np.ndarray) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    ).encode()


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], bundles: Bundles
) -> Iterator[RunningAgent]:
    config = write_config(tmp_path_factory.mktemp("client-held"), keypair[1], LIMITS)
    done = agent_cli("install", str(bundles.v1), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    running = start_agent(config)
    yield running
    assert running.stop() == 0


def _slow_sender(agent: RunningAgent, declared: int) -> socket.socket:
    host, port = agent.address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        f"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: {agent.address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {declared}\r\n\r\n{{".encode()
    )
    return sock


def _closed_within(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closed ``sock`` within ``wait_s`` (readable at EOF, or reset)."""
    readable, _, _ = select.select([sock], [], [], wait_s)
    if not readable:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_body_budget_is_taken_as_bytes_arrive_when_a_slow_sender_declares_64_mib(agent: RunningAgent) -> None:
    slow = _slow_sender(agent, 64 * _MIB)  # the whole default budget, declared
    try:
        host, port = agent.address.split(":")
        for _ in range(3):
            slow.sendall(b" ")  # trickling: a byte between requests of a fresh client
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn.request("POST", "/v2/models/tiny/infer", _infer_body(sample_inputs(1)))
                resp = conn.getresponse()
                raw = resp.read()
            finally:
                conn.close()
            assert resp.status == 200, raw  # before: 503 (the declared 64 MiB held the budget)
            assert json.loads(raw)["outputs"]
    finally:
        slow.close()


def test_body_deadline_closes_a_sender_below_the_minimum_rate_when_each_read_is_in_time(agent: RunningAgent) -> None:
    slow = _slow_sender(agent, _MIB)  # due 5 s + 1 s after its request line
    try:
        closed = False
        for _ in range(150):  # a byte every 0.2 s (well within idle_timeout_s), 30 s at most
            try:
                slow.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_within(slow, 0.2):
                closed = True
                break
        assert closed  # before: each read came in time, and the body was never due
    finally:
        slow.close()


def _connect(agent: RunningAgent) -> socket.socket:
    host, port = agent.address.split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _get_live(agent: RunningAgent, extra: bytes = b"") -> bytes:
    """The status line of GET /v2/health/live on a new connection, with ``extra`` header lines."""
    sock = _connect(agent)
    try:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
        answer = b""
        while b"\r\n" not in answer:
            got = sock.recv(65536)
            if not got:
                break
            answer += got
        return answer.split(b"\r\n", 1)[0]
    finally:
        sock.close()


def test_header_deadline_closes_a_connection_trickling_header_lines_when_each_read_is_in_time(
    agent: RunningAgent,
) -> None:
    sock = _connect(agent)
    try:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
        closed = False
        for i in range(150):  # a header line every 0.2 s (well within idle_timeout_s), 30 s at most
            try:
                sock.sendall(f"X-Slow-{i}: 1\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            if _closed_within(sock, 0.2):
                closed = True
                break
        assert closed  # before: each header line came in time, and the headers were never due
    finally:
        sock.close()


def test_header_block_over_max_header_kib_is_431_when_each_line_is_short_enough(agent: RunningAgent) -> None:
    lines = [b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(40)]  # 40 KiB, over 32 KiB
    assert _get_live(agent, b"".join(lines)).startswith(b"HTTP/1.1 431 ")  # before: 200
    assert _get_live(agent, b"".join(lines[:20])) == b"HTTP/1.1 200 OK"


def test_connections_reading_headers_give_way_to_a_new_client_at_the_connection_cap(agent: RunningAgent) -> None:
    held = [_connect(agent) for _ in range(4)]  # the cap: every one in the middle of its headers
    try:
        for s in held:
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nX-Half: 1\r\n")
        # a header line each while the new client comes: each is reading headers, none is idle
        assert _get_live(agent) == b"HTTP/1.1 200 OK"  # before: 503 (all four counted busy)
    finally:
        for s in held:
            s.close()


def _state_post(agent: RunningAgent, path: str, doc: dict[str, str], headers: dict[str, str]) -> tuple[int, str]:
    host, port = agent.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, json.dumps(doc), {"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize(
    "path",
    ["/edgekit/v1/install", "/v2/repository/models/tiny/unload", "/edgekit/v1/models/tiny/uninstall"],
)
def test_state_changing_routes_refuse_a_host_or_origin_of_another_site_when_on_loopback(
    agent: RunningAgent, path: str, tmp_path: Path
) -> None:
    port = agent.address.split(":")[1]
    doc = {"bundle": str(tmp_path / "missing.ekb")}
    for headers in (
        {"Host": f"evil.example:{port}"},  # a rebound name: before, the route ran
        {"Host": agent.address, "Origin": f"http://evil.example:{port}"},
        {"Host": f"127.0.0.1:{int(port) + 1}"},
    ):
        status, text = _state_post(agent, path, doc, headers)
        assert status == 403, (headers, text)
    assert _get_live(agent) == b"HTTP/1.1 200 OK"
    with urllib.request.urlopen(agent.url + "/v2/models/tiny/ready", timeout=10) as resp:
        assert resp.status == 200  # nothing was unloaded or uninstalled


def test_install_route_takes_the_listen_address_localhost_and_allowed_hosts(
    agent: RunningAgent, tmp_path: Path
) -> None:
    port = agent.address.split(":")[1]
    doc = {"bundle": str(tmp_path / "missing.ekb")}
    for headers in (
        {"Host": agent.address},
        {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
        {"Host": f"edge.LOCAL:{port}"},
    ):
        status, text = _state_post(agent, "/edgekit/v1/install", doc, headers)
        assert status == 400, (headers, text)  # past the checks: the bundle is missing


def test_install_route_refuses_a_named_pipe_at_once_and_takes_a_bundle_after_it(
    agent: RunningAgent, tmp_path: Path, bundles: Bundles
) -> None:
    fifo = tmp_path / "pipe.ekb"
    os.mkfifo(fifo)
    status, text = _state_post(agent, "/edgekit/v1/install", {"bundle": str(fifo)}, {"Host": agent.address})
    assert status == 400 and "not a regular file" in text  # before: the install blocked, the store locked
    doc = {"bundle": str(bundles.v2), "origin": "cli\nFORGED log line"}
    status, text = _state_post(agent, "/edgekit/v1/install", doc, {"Host": agent.address})
    assert status == 200, text
    log = agent.log.read_text()
    assert "cli\\nFORGED log line" in log  # escaped where it is logged
    assert not any(line.startswith("FORGED") for line in log.splitlines())


def test_install_route_errors_quote_nothing_of_another_file_when_it_is_no_bundle(
    agent: RunningAgent, tmp_path: Path
) -> None:
    secret = tmp_path / "shadow"
    secret.write_bytes(b"QZsecret-hash:19000:0:99999:7:::\n")
    status, text = _state_post(agent, "/edgekit/v1/install", {"bundle": str(secret)}, {"Host": agent.address})
    assert status == 400 and "not an edgekit bundle" in text
    assert "QZ" not in text  # before: "b'QZ'", the file's first bytes
    status, text = _state_post(agent, "/edgekit/v1/install", {"bundle": str(tmp_path)}, {"Host": agent.address})
    assert status == 400 and "not a regular file" in text  # before: the connection was dropped


def _off_loopback_address() -> str:
    """An address of this machine that is not loopback (a client there is not on loopback)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing address
        address = str(probe.getsockname()[0])
    except OSError:
        address = "127.0.0.1"
    finally:
        probe.close()
    if address.startswith("127."):
        pytest.skip("no address off loopback on this machine")
    return address


def test_non_loopback_listen_without_auth_token_file_refuses_to_start(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    config = write_config(tmp_path / "open", keypair[1], listen="0.0.0.0:0")
    done = agent_cli("run", "--config", str(config), timeout=60)
    assert done.returncode != 0
    said = (done.stdout + done.stderr).strip().splitlines()
    assert any("auth_token_file" in line and "0.0.0.0:0" in line for line in said), said


def test_non_loopback_client_needs_the_bearer_token_and_metrics_stay_on_loopback(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    address = _off_loopback_address()
    token = "t0ken-" + "x" * 26
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "token").write_text(token + "\n")
    extra = '[server]\nauth_token_file = "token"\nmetrics_loopback_only = true\n'
    running = start_agent(write_config(tmp_path / "agent", keypair[1], extra, listen=f"{address}:0"))
    try:
        port = int(running.address.rsplit(":", 1)[1])

        def get(path: str, auth: str | None) -> int:
            conn = http.client.HTTPConnection(address, port, timeout=30)
            try:
                conn.request("GET", path, headers={"Authorization": auth} if auth else {})
                resp = conn.getresponse()
                resp.read()
                return resp.status
            finally:
                conn.close()

        assert get("/v2", None) == 401  # before: 200 to anyone on the network
        assert get("/v2", "Bearer wrong-token-of-the-same-size!") == 401
        assert get("/v2", f"Bearer {token}") == 200
        assert get("/v2/health/ready", None) == 200  # probes need no token
        assert get("/metrics", f"Bearer {token}") == 403  # before: 200
    finally:
        assert running.stop() == 0


def test_request_over_max_request_rows_is_413_before_its_tensors_are_decoded(agent: RunningAgent) -> None:
    host, port = agent.address.split(":")
    x = sample_inputs(5)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ]
        }
    ).encode()
    for body, headers, status in (
        (_infer_body(x), {}, 413),  # before: 200, however many rows
        (header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}, 413),
        (_infer_body(x[:4]), {}, 200),
    ):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", "/v2/models/tiny/infer", body, headers)
            resp = conn.getresponse()
            text = resp.read().decode(errors="replace")
        finally:
            conn.close()
        assert resp.status == status, text
        if status == 413:
            assert "max_request_rows" in text


def test_json_body_whose_values_outgrow_the_buffer_budget_is_413_before_it_is_parsed(agent: RunningAgent) -> None:
    values = 4_000_000  # 8 MB of JSON, 128 MB as Python floats: over the 64 MiB budget
    body = (
        b'{"inputs":[{"name":"input","shape":[1,%d],"datatype":"FP32","data":[' % values
        + b"0," * (values - 1)
        + b"0]}]}"
    )
    host, port = agent.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", "/v2/models/tiny/infer", gzip.compress(body, 1), {"Content-Encoding": "gzip"})
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    assert resp.status == 413, text  # before: 400, once all of it was Python objects
    assert "binary" in text


def test_fresh_client_is_answered_under_a_slow_64_mib_sender_and_512_trickling_connections(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    config = write_config(tmp_path / "crowd", keypair[1], "[server]\nheader_timeout_s = 60.0\n")
    done = agent_cli("install", str(bundles.v1), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    running = start_agent(config)
    crowd: list[socket.socket] = []
    try:
        slow = _slow_sender(running, 64 * _MIB)
        crowd.append(slow)
        for _ in range(511):  # every other slot of the 512 held by a connection in its headers
            s = _connect(running)
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nX-Slow: 1\r\n")
            crowd.append(s)
        host, port = running.address.split(":")
        for _ in range(3):
            slow.sendall(b" ")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                conn.request("POST", "/v2/models/tiny/infer", _infer_body(sample_inputs(1)))
                resp = conn.getresponse()
                raw = resp.read()
            finally:
                conn.close()
            assert resp.status == 200, raw
    finally:
        for s in crowd:
            s.close()
        assert running.stop() == 0
