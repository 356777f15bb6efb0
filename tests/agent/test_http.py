"""The v2 REST API of a real `edgekit-agent run` process, driven by tritonclient unchanged.

One agent serves ``tiny`` v2 and ``reshape`` v1 for the whole module; every bad request is
followed by a good one, which must still be answered.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.agent.conftest import Bundles, RunningAgent, agent_cli, start_agent, write_config


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], bundles: Bundles
) -> Iterator[RunningAgent]:
    config = write_config(tmp_path_factory.mktemp("http-agent"), keypair[1], "", listen="127.0.0.1:0")
    text = config.read_text().replace("[runtimes.onnxruntime]", "[server]\nmax_request_mb = 1\n[runtimes.onnxruntime]")
    config.write_text(text)
    for b in (bundles.v1, bundles.v2, bundles.reshape):
        done = agent_cli("install", str(b), "--config", str(config))
        assert done.returncode == 0, done.stderr
    running = start_agent(config)
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def client(agent: RunningAgent) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(agent.address)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(tiny_model), providers=["CPUExecutionProvider"])


def _infer(client: triton.InferenceServerClient, x: np.ndarray, *, binary: bool = True, **kw: object) -> np.ndarray:
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = triton.InferRequestedOutput("probs", binary_data=binary)
    return client.infer("tiny", [inp], outputs=[out], **kw).as_numpy("probs")  # type: ignore[no-any-return]  # numpy array


def _assert_still_serving(client: triton.InferenceServerClient, reference: ort.InferenceSession) -> None:
    x = np.ones((1, 3, 16, 16), np.float32)
    np.testing.assert_allclose(_infer(client, x), reference.run(None, {"input": x})[0], rtol=1e-5, atol=1e-6)


def _post(agent: RunningAgent, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(agent.address.split(":")[0], int(agent.address.split(":")[1]), timeout=30)
    conn.request("POST", path, body, headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}


def test_server_and_model_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["extensions"] == [
        "binary_tensor_data",
        "model_configuration",
        "statistics",
        "model_repository",
    ]
    meta = client.get_model_metadata("tiny")
    assert meta == {
        "name": "tiny",
        "versions": ["2"],
        "platform": "onnxruntime",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 16, 16]}],
        "outputs": [{"name": "probs", "datatype": "FP32", "shape": [-1, 10]}],
    }
    assert client.get_model_metadata("tiny", model_version="2") == meta
    assert client.is_model_ready("tiny") and client.is_model_ready("tiny", "2")
    assert not client.is_model_ready("tiny", "1") and not client.is_model_ready("nope")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_matches_onnxruntime(
    client: triton.InferenceServerClient, reference: ort.InferenceSession, good_input: np.ndarray, binary: bool
) -> None:
    got = _infer(client, good_input, binary=binary, request_id="req-42")
    np.testing.assert_allclose(got, reference.run(None, {"input": good_input})[0], rtol=1e-5, atol=1e-6)


def test_request_id_is_echoed_and_version_route_works(
    client: triton.InferenceServerClient, good_input: np.ndarray
) -> None:
    inp = triton.InferInput("input", list(good_input.shape), "FP32")
    inp.set_data_from_numpy(good_input)
    result = client.infer("tiny", [inp], model_version="2", request_id="req-7")  # all outputs, binary
    assert result.get_response()["id"] == "req-7"
    assert result.get_response()["model_version"] == "2"
    assert result.as_numpy("probs").shape == (2, 10)


def test_infer_json_nested_data_without_tritonclient(agent: RunningAgent, reference: ort.InferenceSession) -> None:
    x = np.arange(2 * 3 * 16 * 16, dtype=np.float32).reshape(2, 3, 16, 16) / 1000
    body = {"inputs": [{"name": "input", "shape": [2, 3, 16, 16], "datatype": "FP32", "data": x.tolist()}]}
    status, doc = _post(agent, "/v2/models/tiny/infer", json.dumps(body).encode())
    assert status == 200
    out = doc["outputs"][0]
    assert (out["name"], out["datatype"], out["shape"]) == ("probs", "FP32", [2, 10])
    np.testing.assert_allclose(np.array(out["data"]).reshape(2, 10), reference.run(None, {"input": x})[0], rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "shape", "datatype", "message"),
    [
        ("input", [2, 3, 8, 8], "FP32", "input 'input': shape [2, 3, 8, 8] does not match [-1, 3, 16, 16]"),
        ("input", [2, 3, 16, 16], "INT32", "input 'input': datatype 'INT32' given, the model takes FP32"),
        ("image", [2, 3, 16, 16], "FP32", "unknown input 'image'; the model takes input"),
    ],
    ids=["shape", "dtype", "name"],
)
def test_bad_input_is_400_with_the_reason(
    client: triton.InferenceServerClient,
    reference: ort.InferenceSession,
    name: str,
    shape: list[int],
    datatype: str,
    message: str,
) -> None:
    arr = np.zeros(shape, np.float32 if datatype == "FP32" else np.int32)
    inp = triton.InferInput(name, shape, datatype)
    inp.set_data_from_numpy(arr)
    with pytest.raises(InferenceServerException) as err:
        client.infer("tiny", [inp])
    assert err.value.status() == "400"
    assert message in err.value.message()
    _assert_still_serving(client, reference)


def test_unknown_model_and_version_are_404(
    client: triton.InferenceServerClient, reference: ort.InferenceSession, good_input: np.ndarray
) -> None:
    inp = triton.InferInput("input", list(good_input.shape), "FP32")
    inp.set_data_from_numpy(good_input)
    for model, version, message in (
        ("nope", "", "no model named 'nope' is served here (served: reshape, tiny)"),
        ("tiny", "1", "model 'tiny' version 1 is not served (serving version 2)"),
    ):
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, [inp], model_version=version)
        assert err.value.status() == "404"
        assert message in err.value.message()
    _assert_still_serving(client, reference)


def test_body_over_max_request_mb_is_413_before_it_is_read(
    agent: RunningAgent, client: triton.InferenceServerClient, reference: ort.InferenceSession
) -> None:
    host, port = agent.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/v2/models/tiny/infer")
    conn.putheader("Content-Length", str(2 * 2**20))  # the cap is 1 MB; no byte of the body is sent
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413
    assert "over server.max_request_mb" in json.loads(resp.read())["error"]
    conn.close()
    _assert_still_serving(client, reference)


def test_malformed_bodies_are_400(
    agent: RunningAgent, client: triton.InferenceServerClient, reference: ort.InferenceSession
) -> None:
    cases = [
        (b"{not json", {}, "request header is not valid JSON"),
        (b'{"inputs": 3}', {}, 'a JSON object with an "inputs" list'),
        (
            b'{"inputs":[{"name":"input","shape":[1,3,16,16],"datatype":"FP32","parameters":{"binary_data_size":8}}]}',
            {"Inference-Header-Content-Length": "9999"},
            "Inference-Header-Content-Length 9999 is outside",
        ),
        (
            b'{"inputs":[{"name":"input","shape":[1,3,16,16],"datatype":"FP32","data":[1,2,3]}]}',
            {},
            "3 values given for shape [1, 3, 16, 16]",
        ),
    ]
    for body, headers, message in cases:
        status, doc = _post(agent, "/v2/models/tiny/infer", body, headers)
        assert status == 400, doc
        assert message in doc["error"]
    _assert_still_serving(client, reference)


def test_runtime_failure_is_500_and_the_server_goes_on(
    client: triton.InferenceServerClient, reference: ort.InferenceSession
) -> None:
    x = np.ones((2, 4), np.float32)  # the reshape model declares a dynamic batch but fails for batch 2
    inp = triton.InferInput("x", [2, 4], "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as err:
        client.infer("reshape", [inp])
    assert err.value.status() == "500"
    assert "model reshape v1 failed to run" in err.value.message()
    one = triton.InferInput("x", [1, 4], "FP32")
    one.set_data_from_numpy(x[:1])
    np.testing.assert_array_equal(client.infer("reshape", [one]).as_numpy("y"), x[:1])
    _assert_still_serving(client, reference)


def test_metrics_count_requests_by_model_and_code(agent: RunningAgent, client: triton.InferenceServerClient) -> None:
    def count(code: str, model: str = "tiny") -> float:
        for line in _metrics_text(agent.url).splitlines():
            if line.startswith(f'edgekit_requests_total{{code="{code}",model="{model}"}}'):
                return float(line.split()[-1])
        return 0.0

    ok, bad, missing = count("200"), count("400"), count("404", "")
    _infer(client, np.ones((1, 3, 16, 16), np.float32))
    inp = triton.InferInput("input", [1, 3, 4, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 3, 4, 4), np.float32))
    with pytest.raises(InferenceServerException):
        client.infer("tiny", [inp])
    with pytest.raises(InferenceServerException):
        client.infer("nope", [inp])
    assert (count("200"), count("400"), count("404", "")) == (ok + 1, bad + 1, missing + 1)
    text = _metrics_text(agent.url)
    assert 'edgekit_model_version{model="tiny"} 2.0' in text
    assert "edgekit_request_duration_seconds_bucket" in text


def _metrics_text(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


@pytest.mark.parametrize(
    ("path", "code"),
    [("/v2/models/tiny/versions/x/infer", 404), ("/v2/models/tiny/ready/infer", 404)],
    ids=["bad-version", "bad-route"],
)
def test_error_before_the_body_is_read_keeps_the_connection_in_step(agent: RunningAgent, path: str, code: int) -> None:
    """A keep-alive client (tritonclient's) sends its next request on the same connection: the
    refused request's body must not be read as the next request line."""
    host, port = agent.address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1], "datatype": "FP32", "data": [1.0]}]}).encode()
    conn.request("POST", path, body)
    resp = conn.getresponse()
    assert resp.status == code
    resp.read()
    conn.request("GET", "/v2/health/live")  # reconnects by itself if the server closed the connection
    follow = conn.getresponse()
    assert follow.status == 200
    follow.read()
    conn.close()


def test_install_route_refuses_a_non_json_post_that_a_web_page_could_send(
    agent: RunningAgent, client: triton.InferenceServerClient, reference: ort.InferenceSession, bundles: Bundles
) -> None:
    body = json.dumps({"bundle": str(bundles.v2)}).encode()
    req = urllib.request.Request(
        f"http://{agent.address}/edgekit/v1/install", data=body, headers={"Content-Type": "text/plain"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 403 and "application/json" in err.value.read().decode()
    _assert_still_serving(client, reference)


def test_metrics_have_stage_histograms_batch_sizes_queues_and_process_numbers(
    agent: RunningAgent, client: triton.InferenceServerClient
) -> None:
    _infer(client, np.ones((3, 3, 16, 16), np.float32))
    text = _metrics_text(agent.url)
    for stage in ("decode", "queue", "infer", "encode"):
        assert f'edgekit_stage_seconds_count{{model="tiny",stage="{stage}"}}' in text, stage
    assert 'edgekit_batch_size_bucket{le="4.0",model="tiny"}' in text
    assert 'edgekit_queue_depth{model="tiny"} 0.0' in text and 'edgekit_inflight{model="tiny"}' in text
    assert "process_resident_memory_bytes" in text and "process_open_fds" in text


def test_stats_prints_a_table_of_the_running_daemon(agent: RunningAgent, client: triton.InferenceServerClient) -> None:
    _infer(client, np.ones((1, 3, 16, 16), np.float32))
    done = agent_cli("stats", "--config", str(agent.config), "--count", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:5] == ["MODEL", "REQ/S", "REQS", "ERR", "P50"]
    row = next(line.split() for line in lines if line.startswith("tiny "))
    assert int(row[2]) >= 1 and float(row[4]) > 0  # requests served, a p50 in ms
    live = agent_cli("stats", "--config", str(agent.config), "--count", "2", "--interval", "0.2")
    assert live.returncode == 0 and "last 0." in live.stdout, live.stderr
    if sys.platform.startswith("linux"):  # the daemon's CPU by thread name, from /proc
        assert re.search(r"^agent \d+\.\d\d CPU s by thread: \S+ \d+\.\d\d", done.stdout, re.M), done.stdout
        assert re.search(r"^agent \d+\.\d\d cores by thread: ", live.stdout, re.M), live.stdout


def test_malformed_json_outputs_are_never_written_as_invalid_json() -> None:
    from device_agents.serving.codec import InferRequest, encode_response
    from edgekit.bundle.manifest import TensorSpec

    out, json_len = encode_response(
        "m",
        1,
        InferRequest(None, {}, None, False),
        {"y": np.array([1.0, np.nan, np.inf], np.float32)},
        (TensorSpec("y", "float32", (3,)),),
    )
    assert json_len is None and json.loads(out)["outputs"][0]["data"] == [1.0, None, None]


def _exchange(agent: RunningAgent, *chunks: bytes) -> bytes:
    """Send ``chunks`` as separate writes on one connection; what the server answers until it closes."""
    import socket
    import time

    host, port = agent.address.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, chunk in enumerate(chunks):
            if i:
                time.sleep(0.05)  # another segment: the server may have parsed what came so far
            sock.sendall(chunk)
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


@pytest.mark.parametrize(
    "chunks",
    [
        (b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",),  # all buffered at once
        (b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\n", b"Connection: close\r\n\r\n"),  # headers in two parts
        (b"GET /v2/health/live HTTP/1.1\nHost: a\nConnection: close\n\n",),  # bare-LF lines
        (b"GET /v2/health/live HTTP/1.0\r\n\r\n",),  # no headers at all
    ],
    ids=["one-write", "split", "bare-lf", "no-headers"],
)
def test_request_headers_parse_however_they_arrive(agent: RunningAgent, chunks: tuple[bytes, ...]) -> None:
    answer = _exchange(agent, *chunks)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1


def test_a_header_block_seen_before_is_answered_as_the_first_time(agent: RunningAgent) -> None:
    """Header blocks that parsed are remembered (a look-up instead of a parse): a repeated one
    answers the same, a repeated bad one is refused every time, and what one request's block
    parsed to does not leak into another's (``Connection: close`` here)."""
    good = b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\nX-Seen: 1\r\n\r\n"
    closing = b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\nX-Seen: 1\r\nConnection: close\r\n\r\n"
    for _ in range(2):  # keep-alive: the server answers both requests, then the closing one, then closes
        answer = _exchange(agent, good + good + closing)
        assert answer.count(b"HTTP/1.1 200 ") == 3, answer[:600]
    smuggled = b"POST /v2/health/live HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"
    for _ in range(2):
        assert _exchange(agent, smuggled).startswith(b"HTTP/1.1 400 ")


def test_bad_header_blocks_are_4xx(agent: RunningAgent) -> None:
    smuggled = b"POST /v2/health/live HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"
    assert _exchange(agent, smuggled).startswith(b"HTTP/1.1 400 ")
    no_colon = b"GET /v2/health/live HTTP/1.1\r\nHost a\r\n\r\n"
    assert _exchange(agent, no_colon).startswith(b"HTTP/1.1 400 ")
    many = b"GET /v2/health/live HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n"
    assert _exchange(agent, many).startswith(b"HTTP/1.1 431 ")
