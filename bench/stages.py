"""``serving.stages``: what the stage chain costs per request, in process (no HTTP, no client).

The roundtrip benchmark's tiny model (1 KB in) is installed in a lifecycle, and three pipelines of
it run side by side, in interleaved rounds: one with an empty stage list (what a model that
configures no admission, cache or processing runs), one with one pass-through stage and one with
four. Each request is timed by the calling thread's CPU clock (``time.thread_time``: another
process on a busy machine does not count; a request runs inline in the calling thread, runtime
call included), and compared with the model call alone (``ServedModel.infer`` on a lease): so the
empty chain's row is the whole pipeline's cost per request (decode slot, lease, Request, inline
call slot, stage times, cleanups), and the stages' row is what each stage adds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from bench.registry import BenchContext, Measurement

_REQUESTS = 2000  # per pipeline per round


class _PassThrough:
    name = "pass"

    def process(self, request: object) -> None:
        return None


def run(ctx: BenchContext, *, name: str) -> list[Measurement]:
    from bench.agent_roundtrip import FEATURES, MODEL_NAME, tiny_model
    from bench.serving import _package
    from device_agents.config import load_config
    from device_agents.lifecycle import Lifecycle
    from device_agents.pipeline import Pipeline, Request, stage, trace
    from device_agents.pipeline.slots import Slots

    work = ctx.workdir / "serving-stages"
    work.mkdir(parents=True, exist_ok=True)
    calib = {"x": np.random.default_rng(1).standard_normal((32, FEATURES)).astype(np.float32)}
    bundle = _package(ctx, tiny_model(work / "roundtrip.onnx"), MODEL_NAME, calib, work / "bundles")
    (work / "agent").mkdir(exist_ok=True)
    config = work / "agent" / "agent.toml"
    config.write_text(f'store = "store"\ntrusted_keys = ["{ctx.pub}"]\nverify_interval_s = 0\n')
    lifecycle = Lifecycle(load_config(config))
    lifecycle.start()
    table = dict(stage.STAGE_FACTORIES)
    pipelines: dict[int, Pipeline] = {}
    try:
        lifecycle.install(bundle)
        for count in (0, 1, 4):  # each pipeline's chain is built from the table as it is then
            stage.STAGE_FACTORIES = {
                **{f"pass{i}": (lambda context: _PassThrough()) for i in range(count)},
                stage.INFER: None,
            }
            pipelines[count] = Pipeline(MODEL_NAME, lifecycle.registry, lifecycle.config, lifecycle.metrics, Slots(4))
        stage.STAGE_FACTORIES = table
        x = {"x": calib["x"][:1].copy()}

        def answer(exc: object) -> None:
            return None

        def request(model: object) -> Request:
            return Request(MODEL_NAME, dict(x), None, None, None, answer)

        def through(pipeline: Pipeline) -> Callable[[], object]:
            return lambda: pipeline.run(None, request, lambda r: r.outputs)

        def call_alone() -> object:
            with lifecycle.registry.lease(MODEL_NAME) as lease:
                return lease.model.infer(dict(x))

        sides: dict[str, Callable[[], object]] = {"call": call_alone}
        sides.update({f"stages={n}": through(p) for n, p in pipelines.items()})
        sides["traced"] = through(pipelines[0])  # the empty chain while a trace records
        ctx.progress(f"{name}: the model call vs pipelines of 0, 1 and 4 stages, interleaved, CPU time")
        cpu_us: dict[str, list[float]] = {k: [] for k in sides}
        for fn in sides.values():
            for _ in range(200):
                fn()
        for _ in range(max(5, ctx.repeats)):
            for key, fn in sides.items():
                trace.ACTIVE.recording = trace.Recording() if key == "traced" else None
                start = time.thread_time()
                for _ in range(_REQUESTS):
                    fn()
                cpu_us[key].append((time.thread_time() - start) / _REQUESTS * 1e6)
                trace.ACTIVE.recording = None
    finally:
        trace.ACTIVE.recording = None
        stage.STAGE_FACTORIES = table
        for p in pipelines.values():
            p.stop(5)
        lifecycle.stop()
    med = {k: statistics.median(v) for k, v in cpu_us.items()}
    spread = {k: (float(np.percentile(v, 25)), float(np.percentile(v, 75))) for k, v in cpu_us.items()}
    per_stage = (med["stages=4"] - med["stages=0"]) / 4
    rounds = len(cpu_us["call"])
    return [
        Measurement(
            name, "pipeline with an empty stage list vs the model call alone", "CPU per request", "us",
            "ServedModel.infer on a lease", "Pipeline.run, no stages", med["call"], med["stages=0"],
            note=f"medians of {rounds} interleaved rounds of {_REQUESTS} requests; the difference "
            f"{med['stages=0'] - med['call']:.1f} us is the whole pipeline (decode slot, lease, Request, inline "
            "call slot, stage times, cleanups)",
            a_spread=spread["call"], b_spread=spread["stages=0"],
        ),
        Measurement(
            name, "4 pass-through stages vs an empty stage list", "CPU per request", "us",
            "no stages", "4 stages", med["stages=0"], med["stages=4"],
            note=f"{per_stage:.2f} us per stage (1 stage: {med['stages=1'] - med['stages=0']:+.2f} us); medians of "
            f"{rounds} interleaved rounds",
            a_spread=spread["stages=0"], b_spread=spread["stages=4"],
        ),
        Measurement(
            name, "an empty stage list while `edgekit-agent trace` records vs not", "CPU per request", "us",
            "not tracing", "tracing", med["stages=0"], med["traced"],
            note=f"{med['traced'] - med['stages=0']:+.2f} us per request to record its stages; off, the pipeline "
            f"reads one attribute (in the no-stages row); medians of {rounds} interleaved rounds",
            a_spread=spread["stages=0"], b_spread=spread["traced"],
        ),
    ]  # fmt: skip
