"""The agent's split stage against real tail servers on 127.0.0.1: ``edgekit serve-tail`` (killed
mid-stream: nothing lost), a server answering garbage (the agent goes local), and the choice of
cut following the link estimate."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from device_agents.config import AgentConfig, config_from_data
from device_agents.service import AgentService
from device_agents.serving.http import AgentServer
from device_agents.split.stage import SplitMetrics, SplitStage
from edgekit.bundle.archive import read_unverified_manifest
from tests.split.conftest import SplitBuild
from tests.split.servers import DelayProxy, kserve_tail, serve_tail


def _config(root: Path, pub: Path, tail_url: str, **split: Any) -> AgentConfig:
    data = {
        "store": str(root / "store"),
        "trusted_keys": [str(pub)],
        "listen": "127.0.0.1:0",
        "runtimes": {"onnxruntime": {"threads": 1}},
        "split": {"tail_url": tail_url, "deadline_ms": 2000, "probe_interval_s": 0.3, "retry_after_s": 0.5, **split},
    }
    return config_from_data(data, base=root)


@contextmanager
def _agent(config: AgentConfig, bundle: Path) -> Iterator[str]:
    service = AgentService(config)
    service.start()
    service.install(bundle)
    server = AgentServer("127.0.0.1", 0, service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()
        service.stop()


def _infer(url: str, x: np.ndarray) -> np.ndarray:
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    )
    req = urllib.request.Request(f"{url}/v2/models/m/infer", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        out = json.loads(r.read())["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def _metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_split_bundle_carries_heads_and_the_plan(split_build: SplitBuild) -> None:
    manifest, _ = read_unverified_manifest(split_build.bundles.device)
    assert manifest.split is not None
    ids = [c.id for c in manifest.split.cuts]
    assert ids == sorted(ids, key=lambda c: int(c.removeprefix("cut")))  # in graph order
    assert set(split_build.bundles.tails) == set(ids)
    roles = {f.path: f.role for f in manifest.files}
    for cut in manifest.split.cuts:
        assert roles[cut.head_file] == "split_head"
        assert cut.tail_model == f"m-tail-{cut.id}"
        assert cut.tail_latency_ms == pytest.approx(1.0)
    assert manifest.split.local_latency_ms == pytest.approx(100.0)


def test_agent_splits_and_loses_nothing_when_the_tail_is_killed_mid_stream(
    tmp_path: Path, split_build: SplitBuild
) -> None:
    tails = list(split_build.bundles.tails.values())
    with serve_tail(tails, trust=split_build.public_key) as (tail_url, proc):
        config = _config(tmp_path, split_build.public_key, tail_url)
        with _agent(config, split_build.bundles.device) as url:
            answers = []
            for k in range(40):
                if k == 15:
                    assert _metric(url, "edgekit_split_requests_total") >= 10  # the tail answered before
                    proc.kill()  # the link drops mid-stream
                    proc.wait()
                answers.append(_infer(url, split_build.x))
            assert len(answers) == 40
            for a in answers:
                np.testing.assert_allclose(a, split_build.want, rtol=1e-4, atol=1e-5)
            # seen first by a request or by a probe, whichever came first
            unreachable = _metric(url, "edgekit_split_fallbacks_total", reason="unreachable")
            unreachable += _metric(url, "edgekit_split_fallbacks_total", reason="probe_unreachable")
            assert unreachable >= 1
            assert _metric(url, "edgekit_split_chosen", model="m", cut="local") == 1
            assert _metric(url, "edgekit_split_link_rtt_ms", model="m") > 0


class _GarbageTail(BaseHTTPRequestHandler):
    """A v2 server whose answers are wrong: a wrong shape, or NaN."""

    protocol_version = "HTTP/1.1"
    kind = "shape"

    def do_GET(self) -> None:  # stdlib naming
        self._send(b"")

    def do_POST(self) -> None:  # stdlib naming
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.kind == "shape":
            out = {"name": "probs", "datatype": "FP32", "shape": [1, 3], "data": [0.1, 0.2, 0.7]}
        else:
            out = {"name": "probs", "datatype": "FP32", "shape": [1, 10], "data": [0.1] * 9 + ["NaN"]}
        self._send(json.dumps({"model_name": "x", "outputs": [out]}).replace('"NaN"', "NaN").encode())

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        pass


@pytest.mark.parametrize("kind", ["shape", "nan"])
def test_agent_goes_local_when_the_tail_answers_garbage(tmp_path: Path, split_build: SplitBuild, kind: str) -> None:
    handler = type("Garbage", (_GarbageTail,), {"kind": kind})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = _config(
            tmp_path, split_build.public_key, f"http://127.0.0.1:{server.server_address[1]}", retry_after_s=60
        )
        with _agent(config, split_build.bundles.device) as url:
            for _ in range(5):
                np.testing.assert_allclose(_infer(url, split_build.x), split_build.want, rtol=1e-4, atol=1e-5)
            assert _metric(url, "edgekit_split_fallbacks_total", reason="garbage") == 1  # then local for retry_after_s
            assert _metric(url, "edgekit_split_requests_total") == 0
    finally:
        server.shutdown()
        server.server_close()


def test_split_stage_choice_follows_the_bandwidth_estimate(tmp_path: Path, split_build: SplitBuild) -> None:
    from prometheus_client import CollectorRegistry

    manifest, _ = read_unverified_manifest(split_build.bundles.device)
    assert manifest.split is not None
    config = _config(tmp_path, split_build.public_key, "http://127.0.0.1:9", probe_interval_s=3600)
    assert config.split is not None
    stage = SplitStage("m", config.split, config, manifest, SplitMetrics.of(CollectorRegistry()))
    try:
        stage.link.observe_rtt(5.0)
        chosen = []
        for mbps in (0.1, 1.0, 10.0):
            stage.link.bandwidth_mbps = mbps
            cut = stage.choose(manifest.split)
            chosen.append(cut.tensors[0] if cut else "local")
        # the plan's own choices at these bandwidths: local, the 4.6 KB cut, the cheaper 9.2 KB head
        assert chosen[0] == "local" and chosen[1] in ("c2", "r2") and chosen[2] in ("c1", "r1")
        stage.down_until = time.monotonic() + 60  # after a failure: local whatever the link
        assert stage.choose(manifest.split) is None
    finally:
        stage.close()


def test_agent_splits_against_kserves_own_model_server(tmp_path: Path, split_build: SplitBuild) -> None:
    from edgekit.split.export import export_kserve

    manifest, _ = read_unverified_manifest(split_build.bundles.device)
    assert manifest.split is not None
    tails = {m.cut.id: m.tail_path for m in split_build.run.measured.cuts}
    export_kserve([(c.tail_model, tails[c.id]) for c in manifest.split.cuts], tmp_path / "kserve")
    with kserve_tail(tmp_path / "kserve") as (tail_url, _):
        config = _config(tmp_path, split_build.public_key, tail_url)
        with _agent(config, split_build.bundles.device) as url:
            for _ in range(10):
                np.testing.assert_allclose(_infer(url, split_build.x), split_build.want, rtol=1e-4, atol=1e-5)
            assert _metric(url, "edgekit_split_requests_total") == 10
            assert _metric(url, "edgekit_split_fallbacks_total") == 0


class _TokenTail(BaseHTTPRequestHandler):
    """A v2 tail that answers only requests bearing its token (401 otherwise): ONNX Runtime runs
    the real tail of whichever cut is asked for."""

    protocol_version = "HTTP/1.1"
    token = "s3cret"
    tails: ClassVar[dict[str, Any]] = {}

    def do_GET(self) -> None:  # stdlib naming
        self._answer(200 if self._authorized() else 401, b"")

    def do_POST(self) -> None:  # stdlib naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if not self._authorized():
            self._answer(401, b'{"error":"no token"}')
            return
        header_len = int(self.headers["Inference-Header-Content-Length"])
        doc = json.loads(body[:header_len])
        model = self.path.split("/")[3]
        session = self.tails[model]
        feeds, offset = {}, header_len
        for t in doc["inputs"]:
            size = t["parameters"]["binary_data_size"]
            feeds[t["name"]] = np.frombuffer(body[offset : offset + size], np.float32).reshape(t["shape"])
            offset += size
        (probs,) = session.run(None, feeds)
        out = {"name": "probs", "datatype": "FP32", "shape": list(probs.shape), "data": probs.ravel().tolist()}
        self._answer(200, json.dumps({"model_name": model, "outputs": [out]}).encode())

    def _authorized(self) -> bool:
        return self.headers.get("Authorization") == f"Bearer {self.token}"

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # stdlib signature
        pass


@pytest.mark.parametrize("with_token", [True, False])
def test_agent_sends_its_bearer_token_to_the_tail(tmp_path: Path, split_build: SplitBuild, with_token: bool) -> None:
    import onnxruntime as ort

    manifest, _ = read_unverified_manifest(split_build.bundles.device)
    assert manifest.split is not None
    tails = {m.cut.id: m.tail_path for m in split_build.run.measured.cuts}
    sessions = {c.tail_model: ort.InferenceSession(str(tails[c.id])) for c in manifest.split.cuts}
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Tail", (_TokenTail,), {"tails": sessions}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("s3cret\n" if with_token else "wrong\n")
    try:
        tail_url = f"http://127.0.0.1:{server.server_address[1]}"
        config = _config(tmp_path, split_build.public_key, tail_url, auth_token_file=str(token), retry_after_s=60)
        with _agent(config, split_build.bundles.device) as url:
            for _ in range(4):
                np.testing.assert_allclose(_infer(url, split_build.x), split_build.want, rtol=1e-4, atol=1e-5)
            if with_token:
                assert _metric(url, "edgekit_split_requests_total") == 4
            else:  # refused: answered locally, one fallback, then local for retry_after_s
                assert _metric(url, "edgekit_split_requests_total") == 0
                refused = _metric(url, "edgekit_split_fallbacks_total", reason="status")
                assert refused + _metric(url, "edgekit_split_fallbacks_total", reason="probe_status") == 1
    finally:
        server.shutdown()
        server.server_close()


def test_agent_starting_local_finds_a_faster_link_with_its_probes(tmp_path: Path, split_build: SplitBuild) -> None:
    tails = list(split_build.bundles.tails.values())
    with serve_tail(tails, trust=split_build.public_key) as (tail_url, _):
        # a first guess of 0.01 Mbit/s: every cut looks slower than local, so no request would ever
        # go through the tail; the probes (with a cut tensor made from a request) measure the link
        config = _config(tmp_path, split_build.public_key, tail_url, bandwidth_mbps=0.01, probe_interval_s=0.2)
        with _agent(config, split_build.bundles.device) as url:
            np.testing.assert_allclose(_infer(url, split_build.x), split_build.want, rtol=1e-4, atol=1e-5)
            assert _metric(url, "edgekit_split_chosen", model="m", cut="local") == 1
            deadline = time.monotonic() + 60
            while _metric(url, "edgekit_split_requests_total") == 0 and time.monotonic() < deadline:
                np.testing.assert_allclose(_infer(url, split_build.x), split_build.want, rtol=1e-4, atol=1e-5)
                time.sleep(0.1)
            assert _metric(url, "edgekit_split_requests_total") > 0
            assert _metric(url, "edgekit_split_link_bandwidth_mbps", model="m") > 1


def test_agent_goes_local_when_the_rtt_grows_and_splits_again_when_it_shrinks(
    tmp_path: Path, split_build: SplitBuild
) -> None:
    tails = list(split_build.bundles.tails.values())
    with serve_tail(tails, trust=split_build.public_key) as (tail_url, _):
        host, port = tail_url.removeprefix("http://").rsplit(":", 1)
        proxy = DelayProxy((host, int(port)))
        try:
            config = _config(tmp_path, split_build.public_key, proxy.url, probe_interval_s=0.2)
            with _agent(config, split_build.bundles.device) as url:

                def settle(split: bool) -> None:
                    """Requests until a cut (``split``) or local was chosen 3 times in a row (60 s at most)."""
                    streak, deadline = 0, time.monotonic() + 60
                    while streak < 3:
                        assert time.monotonic() < deadline, (
                            f"never {'split' if split else 'local'}: rtt {_metric(url, 'edgekit_split_link_rtt_ms')} "
                            f"ms, bandwidth {_metric(url, 'edgekit_split_link_bandwidth_mbps')} Mbit/s"
                        )
                        np.testing.assert_allclose(_infer(url, split_build.x), split_build.want, rtol=1e-4, atol=1e-5)
                        local = _metric(url, "edgekit_split_chosen", model="m", cut="local") == 1
                        streak = streak + 1 if local != split else 0
                        time.sleep(0.1)

                settle(split=True)  # loopback: a head here, the tail there
                proxy.delay_s = 0.1  # 200 ms more each round trip: more than the 100 ms local run
                settle(split=False)
                assert _metric(url, "edgekit_split_link_rtt_ms", model="m") > 100
                proxy.delay_s = 0.0
                settle(split=True)
                assert _metric(url, "edgekit_split_fallbacks_total") == 0  # chosen, not forced
        finally:
            proxy.close()
