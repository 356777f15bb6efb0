"""``edgekit-agent profile BUNDLE``: the split bundle's segment latencies measured on this device,
with the agent's own runtime, as the profile ``edgekit split plan --device-profile`` reads::

    {"format": "edgekit-split-profile/1", "machine": "...", "runtime": "onnxruntime 1.22.0",
     "full_ms": 12.5, "cuts": {"cut7": {"tensors": ["r2"], "head_ms": 3.1}},
     "device_power_w": 4.2, "power_source": "rapl (package-0)"}

The bundle is verified with the agent's trusted keys, extracted to a temporary directory and
opened as the agent opens it: the full model through the served interface (what a request that
stays local costs), each head with the bundle's runtime (``device_agents.split.stage.load_head``,
what the split stage runs). They are timed interleaved: every round calls each one a block of
times in a shuffled order and keeps the block's median, so that whatever else loads the device in
those seconds weighs on all alike; a segment's time is the median of its rounds' medians,
per sample. The inputs are the bundle's golden inputs (one row), else seeded standard-normal ones.

``device_power_w``: the power drawn while the full model runs, from the device's own energy
meter (``device_agents.budgets.energy``: RAPL, hwmon, NVML) when it has one, else the value given
with ``--device-power-w`` (stated, not measured), else left out.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle import TrustStore, extract, read_verified_manifest
from edgekit.bundle.errors import ConfigError
from edgekit.bundle.manifest import Manifest

FORMAT = "edgekit-split-profile/1"  # edgekit.split.profile.FORMAT (the host reads it)
Call = Callable[[], object]


def profile_bundle(
    bundle: Path,
    trust: TrustStore,
    options_for: Callable[[str, str], Any],
    *,
    budget_s: float = 10.0,
    min_rounds: int = 5,
    block: int = 5,
    device_power_w: float | None = None,
    meter_root: Path | str = "/",
) -> dict[str, Any]:
    """The profile of ``bundle`` (a verified split bundle) on this device, as a JSON-ready dict.
    ``options_for(name, runtime)``: the runtime options the agent would load the model with."""
    from device_agents.runtimes import load_model
    from device_agents.split.stage import load_head

    verified = read_verified_manifest(bundle, trust)
    m = verified.manifest
    if m.split is None or not m.split.cuts:
        raise ConfigError(
            f"{bundle}: {m.name} v{m.version} has no split heads to profile; package it with "
            "`edgekit package --split` (--cuts all: every cut, for a profile to plan with)"
        )
    options = options_for(m.name, m.compatibility.runtime)
    with tempfile.TemporaryDirectory(prefix="edgekit-profile-") as tmp:
        model_dir = extract(bundle, verified, Path(tmp) / "bundle")
        full = load_model(model_dir, m, options)
        heads = {cut.id: load_head(model_dir, m, cut, options) for cut in m.split.cuts}
        try:
            one = full.check_inputs(sample_inputs(model_dir, m))
            calls: dict[str, Call] = {"full": _bind(full.infer, one)}
            for cut_id, head in heads.items():
                calls[cut_id] = _bind(head.run, one)
            times = time_interleaved(calls, budget_s=budget_s, min_rounds=min_rounds, block=block)
            power = _power(calls["full"], device_power_w, meter_root)
            runtime = full.runner.describe()
        finally:
            for head in heads.values():
                head.close()
            full.runner.close()
    doc: dict[str, Any] = {
        "format": FORMAT,
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or platform.system()}".strip(),
        "runtime": _runtime_text(m, runtime),
        "full_ms": round(times["full"], 4),
        "cuts": {c.id: {"tensors": list(c.tensors), "head_ms": round(times[c.id], 4)} for c in m.split.cuts},
    }
    if power is not None:
        doc["device_power_w"], doc["power_source"] = round(power[0], 4), power[1]
    return doc


def write_profile(path: Path, doc: Mapping[str, Any]) -> Path:
    path = Path(path)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def sample_inputs(model_dir: Path, manifest: Manifest) -> dict[str, np.ndarray]:
    """One row of the bundle's golden inputs; seeded standard-normal ones where it has none."""
    if manifest.golden is not None and (model_dir / manifest.golden.file).is_file():
        with np.load(model_dir / manifest.golden.file, allow_pickle=False) as golden:
            if all(f"in_{s.name}" in golden for s in manifest.signature.inputs):
                return {s.name: np.ascontiguousarray(golden[f"in_{s.name}"][:1]) for s in manifest.signature.inputs}
    rng = np.random.default_rng(0)
    out = {}
    for s in manifest.signature.inputs:
        shape = tuple(d if isinstance(d, int) else 1 for d in s.shape)
        out[s.name] = rng.standard_normal(shape).astype(s.dtype)
    return out


def time_interleaved(calls: Mapping[str, Call], **options: Any) -> dict[str, float]:
    """Milliseconds per call of each function: the median of its rounds' block medians
    (``interleaved_rounds``, which takes the same ``options``)."""
    return {n: statistics.median(v) for n, v in interleaved_rounds(calls, **options).items()}


def interleaved_rounds(
    calls: Mapping[str, Call],
    *,
    budget_s: float = 10.0,
    min_rounds: int = 5,
    max_rounds: int = 200,
    block: int = 5,
    block_ms: float | None = None,
    max_block: int = 64,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Per function, the median milliseconds of each round's block of calls. Each round
    calls every function once untimed (the previous one's threads settle) then a block of times
    timed, in a shuffled order (fixed seed); rounds go on until ``budget_s`` is spent, at least
    ``min_rounds`` and at most ``max_rounds``. The block is ``block`` calls, or with ``block_ms``
    as many calls as take about that long by the second warm-up call (1 to ``max_block``): a
    0.1 ms tail then gets as many timed calls per round as a 100 ms head gets time, and the
    rounds (the samples the median is taken over) are not spent on repeating the slow ones."""
    if not calls:
        return {}
    names = list(calls)
    blocks = {}
    for name in names:  # warm-up: the first call allocates; the second says how long one takes
        calls[name]()
        t0 = clock()
        calls[name]()
        one_ms = (clock() - t0) * 1000.0
        blocks[name] = block if block_ms is None else max(1, min(max_block, round(block_ms / max(one_ms, 1e-6))))
    rounds: dict[str, list[float]] = {n: [] for n in names}
    shuffle = random.Random(0).shuffle
    start = clock()
    for r in range(max_rounds):
        order = list(names)
        shuffle(order)
        for name in order:
            fn = calls[name]
            fn()
            block_ms_taken = []
            for _ in range(blocks[name]):
                t0 = clock()
                fn()
                block_ms_taken.append((clock() - t0) * 1000.0)
            rounds[name].append(statistics.median(block_ms_taken))
        if r + 1 >= min_rounds and clock() - start >= budget_s:
            break
    return rounds


def _power(run: Call, given_w: float | None, root: Path | str, seconds: float = 1.0) -> tuple[float, str] | None:
    """Watts while ``run`` runs back to back for about ``seconds``, from a real meter; else ``given_w``."""
    from device_agents.budgets.energy import pick_meter

    meter = pick_meter(root, nvml=False)
    if meter is not None and not meter.modelled:
        t0 = time.monotonic()
        meter.sample(t0)
        while time.monotonic() - t0 < seconds:
            run()
        t1 = time.monotonic()
        joules = meter.sample(t1)
        if joules is not None and joules > 0:
            return joules / (t1 - t0), f"measured: {meter.describe()}"
    if given_w is not None:
        if given_w <= 0:
            raise ConfigError(f"--device-power-w {given_w}: must be > 0 watts")
        return given_w, "stated with --device-power-w, not measured"
    return None


def _runtime_text(m: Manifest, describe: Mapping[str, Any]) -> str:
    version = describe.get("version") or describe.get("runtime_version") or ""
    return f"{m.compatibility.runtime} {version}".strip()


def _bind(fn: Callable[[Any], object], arg: Any) -> Call:
    return lambda: fn(arg)
