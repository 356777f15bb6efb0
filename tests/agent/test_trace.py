"""``edgekit-agent trace``: a Chrome trace of the requests a real agent serves (Trace Event Format,
checked here event by event: the Perfetto trace processor fetches its binary at run time)."""

from __future__ import annotations

import functools
import itertools
import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Pipeline, Request, stage
from device_agents.pipeline.slots import Slots
from device_agents.pipeline.trace import ACTIVE, Recording
from tests.agent.conftest import AgentFactory, Bundles, write_config
from tests.agent.test_limits import _body, _install, _post
from tests.factories import sample_inputs

STAGES = ["decode", "queue", "infer", "encode"]


def _round(address: str, x: np.ndarray) -> list[int]:
    codes: list[int] = []

    def send(i: int) -> None:
        codes.append(_post(address, "/v2/models/tiny/infer", _body(x[i : i + 1]))[0])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(x))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return codes


def test_trace_records_each_request_stages_and_shared_batches(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    batching = "[models.tiny.batching]\nmax_batch_size = 16\nmax_wait_ms = 20.0\n[server]\nworkers = 1\n"
    config = write_config(tmp_path / "a", keypair[1], batching)
    _install(config, bundles.v1)
    # every call takes 0.2 s: while one runs, the next requests queue up and share a call
    agent = agent_factory(config, {"EDGEKIT_FAULT": "infer_stall", "EDGEKIT_FAULT_STALL_S": "0.2"})
    out = tmp_path / "trace.json"
    cli = [
        sys.executable,
        "-m",
        "device_agents.cli",
        "trace",
        "--seconds",
        "3",
        "-o",
        str(out),
        "--config",
        str(config),
    ]
    tracer = subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    x = sample_inputs(6, seed=3)
    while tracer.poll() is None:  # rounds of concurrent requests until the trace ends
        assert set(_round(agent.address, x)) == {200}
    stdout, stderr = tracer.communicate()
    assert tracer.returncode == 0, stdout + stderr
    assert "requests in" in stdout

    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    for e in slices:  # Trace Event Format: complete events in microseconds
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert isinstance(e["ts"], float | int) and e["dur"] >= 0
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in events)
    spans = {e["args"]["request"]: e for e in slices if e["name"] == "request"}
    assert len(spans) >= 6 and trace["otherData"]["requests"] == len(spans)
    by_request: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in slices:
        if e["name"] != "request":
            by_request[e["args"]["request"]].append(e)
    batches: dict[int, list[int]] = defaultdict(list)
    for n, span in spans.items():
        assert span["args"]["model"] == "tiny" and span["args"]["endpoint"] == "tiny"
        stages = by_request[n]
        assert [s["name"] for s in stages] == STAGES  # every stage, in chain order
        end = span["ts"] + span["dur"]
        at = span["ts"]
        for s in stages:  # nested in the request's span, on its thread, one after the other
            assert (s["pid"], s["tid"]) == (span["pid"], span["tid"])
            assert at - 1e-3 <= s["ts"] and s["ts"] + s["dur"] <= end + 1e-3, (span, stages)
            at = s["ts"] + s["dur"]
        infer = stages[2]
        batches[infer["args"]["batch_id"]].append(infer["args"]["batch_rows"])
        assert infer["dur"] >= 0.2e6 * 0.9  # the stalled call, where it ran
    # requests of one runtime call share its batch id, and the call had as many rows as them
    # (a call at either end of the trace may have requests answered outside it)
    assert any(rows == [len(rows)] * len(rows) and len(rows) > 1 for rows in batches.values()), batches
    for rows in batches.values():
        assert rows == [rows[0]] * len(rows) and len(rows) <= rows[0]
    # slices of one thread nest (Perfetto refuses overlapping slices that do not)
    by_thread: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for span in spans.values():
        by_thread[span["tid"]].append(span)
    for spans_of in by_thread.values():
        spans_of.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(spans_of):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3


def test_trace_route_refuses_a_second_trace_and_bad_requests(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    config = write_config(tmp_path / "a", keypair[1])
    _install(config, bundles.v1)
    agent = agent_factory(config)
    json_type = {"Content-Type": "application/json"}
    assert _post(agent.address, "/edgekit/v1/trace?seconds=0.2", b"{}")[0] == 403  # not application/json
    assert _post(agent.address, "/edgekit/v1/trace?seconds=500", b"{}", json_type)[0] == 400
    first: list[int] = []

    def record() -> None:
        first.append(_post(agent.address, "/edgekit/v1/trace?seconds=1.5", b"{}", json_type)[0])

    t = threading.Thread(target=record)
    t.start()
    time.sleep(0.5)  # the first one is recording
    assert _post(agent.address, "/edgekit/v1/trace?seconds=0.2", b"{}", json_type)[0] == 409
    t.join(10)
    assert first == [200]


class _Memo:
    """A stage that answers a request early when it asks for it (as a cache hit does)."""

    name = "memo"

    def process(self, request: Request) -> None:
        if request.parameters.get("memo"):
            request.outputs = {"output": np.zeros((1, 10), np.float32)}
            request.response_parameters["cache"] = "hit"


def _memo_request(x: np.ndarray, memo: bool, model: object) -> Request:
    return Request("tiny", {"input": x}, parameters={"memo": memo})


def test_trace_shows_configured_stages_and_an_early_answer_s_cache_result(
    installed: Lifecycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stage, "STAGE_FACTORIES", {"memo": lambda context: _Memo(), stage.INFER: None})
    pipeline = Pipeline("tiny", installed.registry, installed.config, installed.metrics, Slots(2))
    x = sample_inputs(1, seed=1)
    recording = Recording()
    monkeypatch.setattr(ACTIVE, "recording", recording)
    try:
        for memo in (False, True):
            pipeline.run(None, functools.partial(_memo_request, x, memo), lambda r: r.outputs)
    finally:
        pipeline.stop(5)
    slices = [e for e in recording.events()["traceEvents"] if e["ph"] == "X"]
    names = {n: [e["name"] for e in slices if e["args"]["request"] == n and e["name"] != "request"] for n in (0, 1)}
    assert names == {0: ["decode", "memo", "queue", "infer", "encode"], 1: ["decode", "memo", "encode"]}
    spans = [e for e in slices if e["name"] == "request"]
    assert "cache" not in spans[0]["args"] and spans[1]["args"]["cache"] == "hit"
