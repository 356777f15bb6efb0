"""Budgets (device_agents/budgets): what budget accounting costs a request, and whether the agent
keeps within its memory and power budgets under load.

- Per request: the admission stage at degradation level 0 and at level 1 (a request that is not
  droppable passes), against a stage that does nothing, timed in process, interleaved rounds,
  median over repeats (the memory budget costs a request nothing: it acts when models load).
- Memory: one agent, two models of 36 MB of weights (a MatMul), a ``[budgets] memory_mb`` that
  holds one model's load (its peak, measured in a learning run) and what the process holds
  besides, not both, ``when_full = "unload_idle"``;
  4 clients (2 per model) for a while. The agent's RSS is sampled every 0.1 s (its
  ``/proc/<pid>/status`` VmRSS) and its peak compared with the budget; LRU swaps are the
  agent's ``edgekit_budget_unloads_total``.
- Power: one agent with ``[budgets] power_w`` over a window, reading a powercap (RAPL) fixture
  tree that this benchmark advances as a board would: an idle draw plus a fixed energy per
  answered request (the work done). Clients send as fast as answers come (pausing 50 ms on a
  503); the average power over a 30 s window after the first bucket is spent is compared with
  the budget; level changes are the agent's ``edgekit_degradation_changes_total``.
- Variants: the same power budget over a variant set (a MatMul and a scaling of one interface)
  with ``degrade = ["variant", "shed"]``: each answer feeds the counter its variant's energy. A
  paced load (an offered rate) at which the big variant is over the budget and the small one
  under it, then a light load at which the big one fits: the average power under the heavy load,
  the switches down and back up (answers, and ``edgekit_degradation_level`` and each variant's
  infer count as ``/metrics`` shows them), and how long after the load drops the big one answers.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import threading
import time
import timeit
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from bench.registry import BenchContext, BenchError, Measurement

N = 3072  # the memory models' MatMul: N x N float32 weights, 36 MB
IDLE_W = 0.5  # the fixture board's draw with no work
JOULES_PER_REQUEST = 0.02
POWER_BUDGET_W = 2.0
POWER_WINDOW_S = 5.0
MEASURE_S = 30.0
MEMORY_LOAD_S = 12.0


def run(ctx: BenchContext, *, name: str) -> list[Measurement]:
    rows = _accounting(ctx, name)
    rows += _memory(ctx, name)
    rows += _power(ctx, name)
    rows += _variants(ctx, name)
    return rows


# -- per-request cost -----------------------------------------------------------------------------
class _Nothing:
    name = "nothing"

    def process(self, request: Any) -> None:
        return None


def _accounting(ctx: BenchContext, name: str) -> list[Measurement]:
    from device_agents.budgets.stage import Admission
    from device_agents.budgets.state import Budgets
    from device_agents.config import BudgetsConfig
    from device_agents.pipeline.stage import Request

    root = ctx.workdir / "budgets-empty-sysfs"
    root.mkdir(parents=True, exist_ok=True)
    budgets = Budgets(BudgetsConfig(power_w=5.0, sysfs_root=root), ctx.workdir / "budgets-store", rss=lambda: 0)
    stage, nothing = Admission("m", budgets), _Nothing()
    request = Request("m", {"x": np.zeros((1, 4), np.float32)}, parameters={"priority": 1})
    calls = 200_000
    ctx.progress(f"{name}: admission stage vs a stage doing nothing, {calls} calls a round, interleaved")
    times: dict[str, list[float]] = {"nothing": [], "level 0": [], "level 1": []}
    for _ in range(max(5, ctx.repeats)):
        for label in times:
            budgets.level = 1 if label == "level 1" else 0
            process = nothing.process if label == "nothing" else stage.process
            seconds = timeit.timeit(lambda p=process: p(request), number=calls)  # type: ignore[misc]  # bound now
            times[label].append(seconds / calls * 1e6)
    budgets.level = 0
    base = statistics.median(times["nothing"])
    rows = []
    for label in ("level 0", "level 1"):
        cost = statistics.median(times[label])
        rows.append(
            Measurement(
                name,
                f"admission at {label} vs none",
                "per-request cost",
                "us",
                "no stage",
                "admission",
                base,
                cost,
                f"in process, median of {len(times[label])} rounds of {calls} calls; "
                f"the stage's own cost {cost - base:.3f} us (goal <= 5 us)",
            )
        )
    return rows


# -- memory ---------------------------------------------------------------------------------------
def _weighty(path: Path, seed: int) -> tuple[Path, np.ndarray]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(seed).standard_normal((N, N)) * 0.01).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
        "weighty",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path, w


def _bundle(ctx: BenchContext, onnx_path: Path, model_name: str, x: np.ndarray, out: Path) -> Path:
    import edgekit

    # the gate is judged on held-out data (50 samples): rows of x with noise added
    rows = np.resize(x, (50, *x.shape[1:]))
    held_out = rows + np.random.default_rng(7).standard_normal(rows.shape, dtype=np.float32) * 0.1
    result = edgekit.package(
        onnx_path,
        targets=["cpu"],
        precision="fp32",
        calib={"x": x},
        eval={"x": held_out},
        key=ctx.key,
        name=model_name,
        out_dir=out,
    )
    return Path(result.bundles["cpu"])


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    if m is None:
        raise BenchError(f"{series} is not in the agent's /metrics")
    return float(m.group(1))


def _infer(url: str, model: str, x: np.ndarray) -> int:
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    ).encode()
    request = urllib.request.Request(f"{url}/v2/models/{model}/infer", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code)


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return int(m.group(1)) * 1024 if m else 0


def _memory(ctx: BenchContext, name: str) -> list[Measurement]:
    from examples.agent_process import RunningAgent

    work = ctx.workdir / "budgets-memory"
    work.mkdir(parents=True, exist_ok=True)
    x = np.random.default_rng(3).standard_normal((1, N)).astype(np.float32)
    ctx.progress(f"{name}: packaging two models of {N}x{N} float32 weights")
    bundles = {}
    for seed, model in enumerate(("a", "b")):
        onnx_path, _ = _weighty(work / f"{model}.onnx", seed)
        bundles[model] = _bundle(ctx, onnx_path, model, np.repeat(x, 8, axis=0), work / f"bundles-{model}")
    # 1. Learn each model's footprint on this machine (kept in the store): both loaded, then swapped.
    agent = RunningAgent(work / "agent", [ctx.pub], threads=1, extra_config="[budgets]\nmemory_mb = 100000\n")
    with agent:
        for bundle in bundles.values():
            agent.install(bundle)
        both = _value(_metrics(agent.url), "edgekit_rss_bytes")
    agent.extra_config = f'[budgets]\nmemory_mb = {int(both / 2**20) - 10}\nwhen_full = "unload_idle"\n'
    with agent:
        for model in "abab":
            _infer(agent.url, model, x)
        text = _metrics(agent.url)
        baseline = _value(text, "edgekit_budget_baseline_bytes")
        held = sum(float(v) for v in re.findall(r"^edgekit_budget_model_memory_bytes\{[^}]*\} (\S+)$", text, re.M))
        other = max(0.0, _value(text, "edgekit_rss_bytes") - baseline - held)
    footprints = json.loads((agent.store / "footprints.json").read_text())
    load_peak = max(v for k, v in footprints.items() if k.endswith(" peak"))
    kept = min(v for k, v in footprints.items() if not k.endswith(" peak"))
    budget_mb = int((baseline + load_peak + other + kept / 2) / 2**20)  # one model's load and more, not two
    # 2. Under load: 2 clients per model.
    agent.extra_config = f'[budgets]\nmemory_mb = {budget_mb}\nwhen_full = "unload_idle"\n'
    codes: list[int] = []
    peak = [0]
    with agent:
        pid = agent.pid
        if pid is None:
            raise BenchError("the agent is not running")
        stop = threading.Event()

        def client(model: str) -> None:
            while not stop.is_set():
                codes.append(_infer(agent.url, model, x))

        def sampler() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_bytes(pid))
                time.sleep(0.1)

        ctx.progress(f"{name}: budget {budget_mb} MB (room for one model); 4 clients for {MEMORY_LOAD_S:.0f} s")
        threads = [threading.Thread(target=client, args=(m,)) for m in "abab"] + [threading.Thread(target=sampler)]
        for t in threads:
            t.start()
        time.sleep(MEMORY_LOAD_S)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        text = _metrics(agent.url)
    unloads = _value(text, "edgekit_budget_unloads_total")
    served, refused = codes.count(200), len(codes) - codes.count(200)
    bad = [c for c in codes if c not in (200, 503)]
    if bad:
        raise BenchError(f"requests answered {sorted(set(bad))} under the memory budget (only 200 and 503 expected)")
    note = (
        f"peak VmRSS sampled every 0.1 s; {unloads:.0f} LRU swaps; {served} served, {refused} refused (503 "
        f"memory) of {len(codes)}; a model keeps {kept / 2**20:.0f} MB, its load peaks at {load_peak / 2**20:.0f} MB; "
        f"agent {baseline / 2**20:.0f} MB"
    )
    return [
        Measurement(
            name,
            "two models that do not both fit",
            "peak RSS under load",
            "MB",
            "budget",
            "agent RSS",
            float(budget_mb),
            peak[0] / 2**20,
            note,
        ),
    ]


# -- power ----------------------------------------------------------------------------------------
class _RaplCounter:
    """A RAPL package zone under ``work/sysfs`` whose energy counter advances (with wraparound) by
    the joules ``spend`` is given: the agent's power reader reads it as a real meter."""

    RANGE_UJ = 262143328850

    def __init__(self, work: Path) -> None:
        zone = work / "sysfs/sys/class/powercap/intel-rapl:0"
        zone.mkdir(parents=True, exist_ok=True)
        (zone / "name").write_text("package-0\n")
        (zone / "max_energy_range_uj").write_text(f"{self.RANGE_UJ}\n")
        self._counter = zone / "energy_uj"
        self._used_uj = 0
        self._lock = threading.Lock()
        self.spend(0.0)

    def spend(self, joules: float) -> None:
        with self._lock:
            self._used_uj += int(joules * 1e6)
            # written whole and renamed over: a sysfs read never sees a half-written (or empty) file
            part = self._counter.with_name("energy_uj.part")
            part.write_text(f"{self._used_uj % self.RANGE_UJ}\n")
            os.replace(part, self._counter)

    def used_uj(self) -> int:
        with self._lock:
            return self._used_uj


def _power(ctx: BenchContext, name: str) -> list[Measurement]:
    from bench.agent_roundtrip import FEATURES, tiny_model
    from examples.agent_process import RunningAgent

    work = ctx.workdir / "budgets-power"
    work.mkdir(parents=True, exist_ok=True)
    meter = _RaplCounter(work)
    spend = meter.spend
    x = np.random.default_rng(1).standard_normal((1, FEATURES)).astype(np.float32)
    bundle = _bundle(ctx, tiny_model(work / "m.onnx"), "m", np.repeat(x, 8, axis=0), work / "bundles")
    config = (
        f"[budgets]\npower_w = {POWER_BUDGET_W}\npower_window_s = {POWER_WINDOW_S}\n"
        f'sample_interval_s = 0.1\nsysfs_root = "{work / "sysfs"}"\n'
    )
    with RunningAgent(work / "agent", [ctx.pub], threads=1, extra_config=config) as agent:
        agent.install(bundle)
        stop = threading.Event()
        codes: list[int] = []

        def idle() -> None:
            last = time.monotonic()
            while not stop.wait(0.05):
                now = time.monotonic()
                spend(IDLE_W * (now - last))
                last = now

        def client() -> None:
            while not stop.is_set():
                code = _infer(agent.url, "m", x)
                codes.append(code)
                if code == 200:
                    spend(JOULES_PER_REQUEST)
                else:
                    time.sleep(0.05)

        threads = [threading.Thread(target=idle)] + [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        warmup_s = 2 * POWER_WINDOW_S
        ctx.progress(
            f"{name}: {POWER_BUDGET_W} W budget over {POWER_WINDOW_S:.0f} s; {warmup_s:.0f} s to spend the "
            f"first bucket, then {MEASURE_S:.0f} s measured"
        )
        time.sleep(warmup_s)
        e0, t0, n0 = meter.used_uj(), time.monotonic(), len(codes)
        changes0 = _value(_metrics(agent.url), "edgekit_degradation_changes_total")
        time.sleep(MEASURE_S)
        e1, t1, n1 = meter.used_uj(), time.monotonic(), len(codes)
        changes = _value(_metrics(agent.url), "edgekit_degradation_changes_total") - changes0
        stop.set()
        for t in threads:
            t.join(timeout=60)
    window = codes[n0:n1]
    avg_w = (e1 - e0) / 1e6 / (t1 - t0)
    note = (
        f"fixture RAPL counter: {IDLE_W} W idle + {JOULES_PER_REQUEST} J per answered request; "
        f"{window.count(200)} answered, {len(window) - window.count(200)} refused (503) in the window; "
        f"{changes:.0f} degradation level changes; goal within +-10% of the budget"
    )
    return [
        Measurement(
            name,
            f"power budget held over {MEASURE_S:.0f} s",
            "average power",
            "W",
            "budget",
            "measured",
            POWER_BUDGET_W,
            avg_w,
            note,
        ),
    ]


# -- variants under a power budget -------------------------------------------------------------
VARIANT_N = 1024
# The fixture board's energy per answer of each variant. The load is paced (an offered rate, not
# clients sending as fast as answers come): with closed-loop clients the small variant's answers
# come as fast as the machine serves them, and on a quiet machine (> 500 a second at 3 mJ each)
# the small variant alone was over the budget, so the agent rightly shed instead of going back up.
VARIANT_J = {"v-big": 0.08, "v-small": 0.005}
HEAVY_RPS = 60.0  # v-big 0.5 + 4.8 W, v-small 0.5 + 0.3 W: over and under the 2 W budget
LIGHT_RPS = 8.0  # v-big 0.5 + 0.64 W: under it, so the big variant serves again and stays
HEAVY_S = 2 * POWER_WINDOW_S + MEASURE_S
LIGHT_S = 15.0
VARIANT_CLIENTS = 4


def _variant_model(path: Path, *, big: bool) -> Path:
    """``y = x @ w`` ([N, N] weights) or ``y = x * 0.5``: the same [batch, N] interface."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if big:
        w = (np.random.default_rng(0).standard_normal((VARIANT_N, VARIANT_N)) * 0.01).astype(np.float32)
        node, init = helper.make_node("MatMul", ["x", "w"], ["y"]), numpy_helper.from_array(w, "w")
    else:
        node, init = helper.make_node("Mul", ["x", "w"], ["y"]), numpy_helper.from_array(np.array(0.5, np.float32), "w")
    graph = helper.make_graph(
        [node],
        "variant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", VARIANT_N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", VARIANT_N])],
        [init],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _infer_variant(url: str, x: np.ndarray) -> tuple[int, str]:
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    ).encode()
    request = urllib.request.Request(f"{url}/v2/models/det/infer", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return int(r.status), str(json.loads(r.read()).get("parameters", {}).get("variant", ""))
    except urllib.error.HTTPError as exc:
        exc.read()
        return int(exc.code), ""


class _Pacer:
    """Hands out request slots at ``rate`` a second (shared by the clients): an offered load that
    does not grow when answers get cheaper. A slot missed while every client was busy is dropped."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self, stop: threading.Event) -> bool:
        with self._lock:
            now = time.monotonic()
            self._next = max(self._next + 1.0 / self.rate, now - 1.0 / self.rate)
            due = self._next
        return not stop.wait(max(0.0, due - time.monotonic()))


def _variant_counts(url: str) -> dict[str, float]:
    text = _metrics(url)
    return {
        v: _value(text, f'edgekit_stage_seconds_count{{model="{v}",stage="infer"}}') if v in text else 0.0
        for v in VARIANT_J
    }


def _variants(ctx: BenchContext, name: str) -> list[Measurement]:
    from examples.agent_process import RunningAgent

    work = ctx.workdir / "budgets-variants"
    work.mkdir(parents=True, exist_ok=True)
    meter = _RaplCounter(work)
    spend = meter.spend
    x = np.random.default_rng(1).standard_normal((1, VARIANT_N)).astype(np.float32)
    bundles = [
        _bundle(ctx, _variant_model(work / f"{v}.onnx", big=v == "v-big"), v, np.repeat(x, 8, axis=0), work / v)
        for v in VARIANT_J
    ]
    config = (
        '[models.det]\nvariants = ["v-big", "v-small"]\n'
        f"[budgets]\npower_w = {POWER_BUDGET_W}\npower_window_s = {POWER_WINDOW_S}\nsample_interval_s = 0.1\n"
        f'degrade = ["variant", "shed"]\nsysfs_root = "{work / "sysfs"}"\n'
    )
    answers: list[tuple[float, int, str]] = []
    levels: list[tuple[float, float]] = []  # (time, edgekit_degradation_level) as /metrics said
    with RunningAgent(work / "agent", [ctx.pub], threads=1, extra_config=config) as agent:
        for bundle in bundles:
            agent.install(bundle)
        stop = threading.Event()
        pacer = _Pacer(HEAVY_RPS)

        def idle() -> None:
            last = time.monotonic()
            while not stop.wait(0.05):
                now = time.monotonic()
                spend(IDLE_W * (now - last))
                last = now

        def client() -> None:
            while pacer.wait(stop):
                code, variant = _infer_variant(agent.url, x)
                answers.append((time.monotonic(), code, variant))
                if code == 200:
                    spend(VARIANT_J.get(variant, 0.0))

        def watch() -> None:
            while not stop.wait(0.25):
                levels.append((time.monotonic(), _value(_metrics(agent.url), "edgekit_degradation_level")))

        threads = [threading.Thread(target=idle), threading.Thread(target=watch)]
        threads += [threading.Thread(target=client) for _ in range(VARIANT_CLIENTS)]
        ctx.progress(
            f"{name}: a variant set under {POWER_BUDGET_W} W; {HEAVY_RPS:.0f} requests/s for {HEAVY_S:.0f} s, "
            f"then {LIGHT_RPS:.0f}/s for {LIGHT_S:.0f} s"
        )
        for t in threads:
            t.start()
        time.sleep(2 * POWER_WINDOW_S)  # the first bucket spent
        e0, t0 = meter.used_uj(), time.monotonic()
        changes0 = _value(_metrics(agent.url), "edgekit_degradation_changes_total")
        time.sleep(HEAVY_S - 2 * POWER_WINDOW_S)
        e1, t1 = meter.used_uj(), time.monotonic()
        heavy_counts = _variant_counts(agent.url)
        pacer.rate = LIGHT_RPS  # the load drops
        time.sleep(LIGHT_S)
        t2 = time.monotonic()
        changes = _value(_metrics(agent.url), "edgekit_degradation_changes_total") - changes0
        end_counts = _variant_counts(agent.url)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    ordered = sorted(answers)
    served = [v for _, code, v in ordered if code == 200]
    down = sum(1 for a, b in itertools.pairwise(served) if (a, b) == ("v-big", "v-small"))
    up = sum(1 for a, b in itertools.pairwise(served) if (a, b) == ("v-small", "v-big"))
    light = [(t, code, v) for t, code, v in ordered if t1 < t <= t2]
    light_tail = [v for t, code, v in light if t > t1 + (t2 - t1) / 2]  # its second half: recovered by then
    if not down or not up or not light_tail or any(v != "v-big" for v in light_tail):
        seen = sorted({(code, variant) for _, code, variant in ordered})
        raise BenchError(
            f"the variant did not switch down under load and back up when it dropped ({down} down, {up} up; "
            f"answers (status, variant) seen: {seen[:6]}; in the light load's second half: {sorted(set(light_tail))})"
        )
    # the last small-variant answer after the drop: from then on the big one answered every request
    back_up_s = max((t - t1 for t, code, v in light if v == "v-small"), default=0.0)
    heavy = [(t, code, v) for t, code, v in ordered if t0 <= t <= t1]
    heavy_rps = len(heavy) / (t1 - t0)
    small_w = IDLE_W + heavy_rps * VARIANT_J["v-small"]
    avg_w = (e1 - e0) / 1e6 / (t1 - t0)
    refused = sum(1 for _, c, _ in heavy if c != 200)
    level_path = [int(lv) for _, lv in levels]
    level_path = [lv for i, lv in enumerate(level_path) if i == 0 or lv != level_path[i - 1]]
    note = (
        f"fixture RAPL counter: {IDLE_W} W idle + {VARIANT_J['v-big']} J per v-big answer, {VARIANT_J['v-small']} J "
        f"per v-small; {heavy_rps:.0f} requests/s offered and answered under heavy load (v-small alone "
        f"{small_w:.2f} W), then {LIGHT_RPS:.0f}/s; switched down {down} and up {up} times, {changes:.0f} level "
        f"changes; metrics: infer calls v-big {heavy_counts['v-big']:.0f} -> {end_counts['v-big']:.0f}, v-small "
        f"{heavy_counts['v-small']:.0f} -> {end_counts['v-small']:.0f} over the light load; level path "
        f"{'-'.join(map(str, level_path[:24]))}{'...' if len(level_path) > 24 else ''}; the last v-small "
        f"answer {back_up_s:.1f} s after the load dropped; {refused} refused under heavy load"
    )
    return [
        Measurement(
            name,
            f"variant set, {HEAVY_RPS:.0f} requests/s for {HEAVY_S - 2 * POWER_WINDOW_S:.0f} s",
            "average power",
            "W",
            "budget",
            "measured",
            POWER_BUDGET_W,
            avg_w,
            note,
        ),
        Measurement(
            name,
            f"variant set, {HEAVY_RPS:.0f} then {LIGHT_RPS:.0f} requests/s",
            "answers by the big variant",
            "%",
            "heavy load",
            "light load",
            100 * sum(1 for _, c, v in heavy if v == "v-big") / max(1, len(heavy)),
            100 * sum(1 for _, c, v in light if v == "v-big") / max(1, len(light)),
            f"the rest by v-small (or refused); every answer after {back_up_s:.1f} s into the light load was v-big",
        ),
    ]
