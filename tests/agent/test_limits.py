"""Hard limits of the running agent, over real sockets on loopback: idle timeout, the connection
cap, gzip bombs, malformed and huge shapes, inputs the runtime rejects (400s that never count
against health), back-pressure (429 + Retry-After), a hung runtime call, SIGTERM draining,
and the access log / JSON logs at -v."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.agent.bundles import conv_model
from tests.agent.conftest import AgentFactory, Bundles, RunningAgent, agent_cli, start_agent, write_config
from tests.factories import make_cpu_bundle, sample_inputs

LIMITS = """
[server]
idle_timeout_s = 1.0
max_connections = 4
max_request_mb = 1
max_buffered_mb = 2
retry_after_s = 2
"""


def _body(x: np.ndarray, name: str = "input") -> bytes:
    return json.dumps(
        {"inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    ).encode()


def _post(address: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body, headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else {}, dict(resp.getheaders())
    finally:
        conn.close()


def _metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}}" if labels else f"{name} "):
            return float(line.split()[-1])
    return 0.0


def _install(config: Path, *bundles: Path) -> None:
    for b in bundles:
        done = agent_cli("install", str(b), "--config", str(config))
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def conv_bundle(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]) -> Path:
    d = tmp_path_factory.mktemp("conv")
    return make_cpu_bundle(
        d / "conv-1.ekb",
        conv_model(d / "conv.onnx"),
        keypair[0],
        name="conv",
        golden_inputs=np.ones((2, 1, 8, 8), np.float32),
    )


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], bundles: Bundles, conv_bundle: Path
) -> Iterator[RunningAgent]:
    config = write_config(tmp_path_factory.mktemp("limits-agent"), keypair[1], LIMITS)
    _install(config, bundles.v1, conv_bundle)
    running = start_agent(config)
    yield running
    assert running.stop() == 0


def _connect(agent: RunningAgent) -> socket.socket:
    host, port = agent.address.split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _health(agent: RunningAgent) -> int:
    with urllib.request.urlopen(agent.url + "/v2/health/ready", timeout=10) as resp:
        return resp.status


def test_an_idle_connection_is_closed_after_idle_timeout(agent: RunningAgent) -> None:
    sock = _connect(agent)
    try:
        assert _closed_by_server(sock)  # recv waits up to 10 s; the server closes it after 1 s
    finally:
        sock.close()


def test_at_the_connection_cap_the_oldest_idle_connection_makes_room(agent: RunningAgent) -> None:
    idle = [_connect(agent) for _ in range(4)]
    try:
        time.sleep(0.3)  # thread scheduling: let the four handler threads start waiting for a request
        assert _health(agent) == 200  # a fifth connection is answered
        assert _closed_by_server(idle[0])  # ... and the oldest idle one was closed for it
    finally:
        for s in idle:
            s.close()


def test_at_the_connection_cap_with_every_connection_busy_a_new_one_gets_503(agent: RunningAgent) -> None:
    busy = []
    try:
        for _ in range(4):  # each sent its headers and is waiting for a body that never comes
            s = _connect(agent)
            s.sendall(b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            busy.append(s)
        time.sleep(0.3)  # thread scheduling: let the four handlers start reading their bodies
        s = _connect(agent)
        busy.append(s)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = s.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 503") and "Retry-After: 2" in answer and "max_connections" in answer
    finally:
        for s in busy:
            s.close()
    time.sleep(1.5)  # the stalled bodies hit the idle timeout
    assert _health(agent) == 200


def test_parallel_gzip_bombs_are_refused_and_the_agent_keeps_serving(agent: RunningAgent) -> None:
    bomb = gzip.compress(b"\0" * (120 * 2**20), compresslevel=9)  # ~120 KB that inflate to 120 MB
    codes: list[int] = []

    def send() -> None:
        status, _, _ = _post(
            agent.address,
            "/v2/models/tiny/infer",
            bomb,
            {"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        codes.append(status)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(codes) == 4 and all(c in (413, 503) for c in codes), codes
    assert 413 in codes
    status, doc, _ = _post(agent.address, "/v2/models/tiny/infer", _body(sample_inputs(1)))
    assert status == 200, doc


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (
            "/v2/models/tiny/infer",
            b'{"inputs":[{"name":"input","shape":[0,1e20,16,16],"datatype":"FP32","data":[]}]}',
            400,
            "shape must be a list of non-negative integers",
        ),
        (
            "/v2/models/tiny/infer",
            b'{"inputs":[{"name":"input","shape":[1099511627776,3,16,16],"datatype":"FP32","data":[]}]}',
            400,
            "shape must be a list of non-negative integers",
        ),
        (
            "/v2/models/tiny/infer",
            b'{"inputs":[{"name":"input","shape":[4096,3,16,16],"datatype":"FP32",'
            b'"parameters":{"binary_data_size":12582912}}]}',
            400,
            "over the request cap",
        ),
        (
            "/v2/models/tiny/infer",
            b'{"inputs":[{"name":"input","shape":[1,3,16,16],"datatype":"FP32","data":[NaN]}]}',
            400,
            "NaN is not JSON",
        ),
        ("/v2/models/tiny/versions/%C2%B2/infer", _body(np.ones((1, 3, 16, 16), np.float32)), 404, "no version '²'"),
        ("/v2/models/tiny/versions/%D9%A3/infer", _body(np.ones((1, 3, 16, 16), np.float32)), 404, "no version"),
        ("/v2/models/%FF%FE/infer", _body(np.ones((1, 3, 16, 16), np.float32)), 404, "no model named"),
    ],
    ids=["float-dim", "huge-dim", "over-cap", "nan", "superscript-version", "arabic-digit-version", "bad-utf8-name"],
)
def test_malformed_requests_are_4xx_and_the_agent_keeps_serving(
    agent: RunningAgent, path: str, body: bytes, status: int, message: str
) -> None:
    got, doc, _ = _post(agent.address, path, body)
    assert got == status, doc
    assert message in doc["error"]
    assert _post(agent.address, "/v2/models/tiny/infer", _body(sample_inputs(1)))[0] == 200


def test_an_input_the_runtime_rejects_is_400_and_never_counts_against_health(agent: RunningAgent) -> None:
    before_500 = _metric(agent.url, "edgekit_requests_total", code="500", model="conv")
    for _ in range(5):  # more than the health check's MIN_FAILED_REQUESTS
        status, doc, _ = _post(agent.address, "/v2/models/conv/infer", _body(np.ones((1, 1, 2, 2), np.float32), "x"))
        assert status == 400, doc
        assert "model conv cannot take this input" in doc["error"] and "Invalid input shape" in doc["error"]
    assert _metric(agent.url, "edgekit_requests_total", code="500", model="conv") == before_500
    status, doc, _ = _post(agent.address, "/v2/models/conv/infer", _body(np.ones((1, 1, 8, 8), np.float32), "x"))
    assert status == 200 and doc["model_version"] == "1"


# -- agents whose runtime calls stall (the infer_stall fault point) ------------------------------------


def test_a_full_queue_answers_429_with_retry_after_and_sigterm_drains(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    config = write_config(tmp_path / "a", keypair[1], "[server]\nworkers = 1\nqueue_size = 1\nretry_after_s = 4\n")
    _install(config, bundles.v1)
    slow = agent_factory(config, {"EDGEKIT_FAULT": "infer_stall", "EDGEKIT_FAULT_STALL_S": "1.5"})
    results: list[tuple[int, dict, dict]] = []

    def send() -> None:
        results.append(_post(slow.address, "/v2/models/tiny/infer", _body(sample_inputs(1))))

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    codes = sorted(r[0] for r in results)
    assert codes == [200, 200, 429], results
    refused = next(r for r in results if r[0] == 429)
    assert refused[2]["Retry-After"] == "4" and "server.queue_size" in refused[1]["error"]
    assert _metric(slow.url, "edgekit_rejects_total", model="tiny", reason="queue_full") == 1

    # SIGTERM while a request runs: it is answered, then the agent stops cleanly
    inflight = threading.Thread(target=send)
    inflight.start()
    deadline = time.monotonic() + 10
    while _metric(slow.url, "edgekit_inflight", model="tiny") < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slow.stop() == 0
    inflight.join(30)
    assert results[-1][0] == 200, results[-1]
    assert "draining in-flight requests" in slow.log.read_text()


def test_a_hung_runtime_call_is_a_500_and_the_model_is_reloaded(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    config = write_config(tmp_path / "a", keypair[1], "[server]\nhung_call_s = 1.0\n")
    _install(config, bundles.v1)
    env = {"EDGEKIT_FAULT": "infer_stall", "EDGEKIT_FAULT_STALL_ONCE": "1"}  # the first call hangs for an hour
    hung = agent_factory(config, env, ("-v", "--log-format", "json"))
    status, doc, _ = _post(hung.address, "/v2/models/tiny/infer", _body(sample_inputs(1)))
    assert status == 500 and "hung: its runtime call ran over server.hung_call_s (1 s)" in doc["error"]
    status, doc, _ = _post(hung.address, "/v2/models/tiny/infer", _body(sample_inputs(1)))
    assert status == 200, doc
    assert _metric(hung.url, "edgekit_hung_calls_total", model="tiny") == 1
    assert _health(hung) == 200
    lines = [json.loads(line) for line in hung.log.read_text().splitlines() if line.startswith("{")]
    assert any("loading v1 on demand" in entry["message"] for entry in lines)
    access = [e for e in lines if e["logger"] == "edgekit.agent.access"]
    assert any('"POST /v2/models/tiny/infer" 500' in e["message"] for e in access)
    assert any('"POST /v2/models/tiny/infer" 200' in e["message"] for e in access)


def test_concurrent_requests_are_batched_over_http(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory, tiny_model: Path
) -> None:
    batching = "[models.tiny.batching]\nmax_batch_size = 16\nmax_wait_ms = 20.0\n[server]\nworkers = 1\n"
    config = write_config(tmp_path / "a", keypair[1], batching)
    _install(config, bundles.v1)
    env = {"EDGEKIT_FAULT": "infer_stall", "EDGEKIT_FAULT_STALL_S": "0.5"}  # every call takes 0.5 s
    batched = agent_factory(config, env)
    x = sample_inputs(8, seed=9)
    results: dict[int, tuple[int, dict, dict]] = {}

    def send(i: int) -> None:
        results[i] = _post(batched.address, "/v2/models/tiny/infer", _body(x[i : i + 1]))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r[0] == 200 for r in results.values()), results
    calls = _metric(batched.url, "edgekit_batch_size_count", model="tiny")
    assert _metric(batched.url, "edgekit_batch_size_sum", model="tiny") == 8
    assert calls < 8  # while one call runs, the others queue up and run together
    import onnxruntime as ort

    want = ort.InferenceSession(str(tiny_model), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    for i, (_, doc, _) in results.items():  # each request got its own rows back
        np.testing.assert_allclose(np.array(doc["outputs"][0]["data"]).reshape(1, 10), want[i : i + 1], rtol=1e-5)


def test_health_counts_only_model_failures() -> None:
    from device_agents.health import traffic
    from device_agents.metrics import AgentMetrics

    metrics = AgentMetrics()
    for code in (200, 400, 429, 503, 504, 500):
        metrics.observe_request("m", code, 0.001)
    # 4xx/429/503/504 never count; a 500 counts only once the pipeline counted it against the
    # version (edgekit_model_failures: the replaced version, replayed, did not fail too)
    assert (traffic(metrics, "m").requests, traffic(metrics, "m").failed) == (6, 0)
    metrics.model_failures.labels("m").inc()
    assert (traffic(metrics, "m").requests, traffic(metrics, "m").failed) == (6, 1)
