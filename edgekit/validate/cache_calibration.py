"""The approximate result cache's distance threshold, calibrated on the evaluation data.

``calibrate(fn, arrays, budget)`` replays the evaluation set as the device would see it: each
sample, in order, is looked up among the earlier ones and then cached (a stream), and perturbed
copies of every sample (a shift of a pixel or two, sensor noise, a brightness change:
``perturb``) are looked up among all of them. Every look-up gives a pair (the distance to the
nearest cached signature, whether that cached answer agrees with a fresh one). A threshold
answers the look-ups at or under it from the cache; of those hits, the share whose answer
disagrees is the false-hit rate. The chosen threshold is the largest one whose one-sided 95%
upper bound on that rate (Wilson score, ``scene_bound``) is at or under the budget.

The look-ups of one evaluation sample (its own in the stream and its perturbed copies') are not
independent: a scene near a class boundary gives several false hits at once, and one far from
any gives none. So the bound counts at most one observation per scene (the evaluation samples
with a hit), not one per hit: counting every hit, a threshold calibrated on 150 digit scans at a
1% budget (rate 0.3%, bound 0.9% over 661 hits) let 2.1% of hits be wrong on 300 other scans.

The signature, the distance and the agreement test are the agent's own
(``device_agents.cache.approximate``: ``signature``, cosine distance, ``agrees``: the same top-1
for class scores, else the dense gate's cosine), so what is measured here is what the agent
does with the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from device_agents.cache.approximate import agrees, signature, wilson
from edgekit.bundle.manifest import ApproximateCache, CachePolicy
from edgekit.errors import CalibrationDataError, ConfigError
from edgekit.validate.calib import sample_count, take
from edgekit.validate.metrics import RunFn, run_all

Z_ONE_SIDED_95 = 1.6449  # one-sided 95%: the rate is under the bound with 95% confidence
BOUND_METHOD = "wilson one-sided 95%, one observation per evaluation sample"
DEFAULT_COPIES = 4  # perturbed copies per evaluation sample
MIN_DISTANCE = 1e-6  # the smallest threshold written (the agent takes 0 < max_distance <= 2)


class CalibrationError(CalibrationDataError):
    """No distance threshold holds the false-hit budget on the evaluation data."""


@dataclass(frozen=True)
class Calibration:
    """The chosen threshold and what was measured at it."""

    threshold: float
    false_hit_rate: float  # false hits / hits at the threshold
    bound: float  # one-sided 95% upper bound of that rate
    budget: float
    hits: int  # look-ups answered from the cache at the threshold
    samples: int  # look-ups replayed (stream + perturbed copies)
    scenes: int = 0  # evaluation samples with a hit among their look-ups (the bound's observations)


@dataclass(frozen=True)
class Pairs:
    """Every look-up of a replay: the distance to the nearest cached signature, and whether that
    cached answer agrees with the look-up's fresh answer."""

    distance: np.ndarray  # float64 [n]
    agreed: np.ndarray  # bool [n]
    # int [n]: the evaluation sample each look-up replays (the sample itself or a perturbed copy of
    # it); None: every look-up its own (the bound then counts hits)
    scene: np.ndarray | None = None

    def at(self, threshold: float) -> tuple[int, int]:
        """(hits, false hits) when look-ups at or under ``threshold`` are answered from the cache."""
        hit = self.distance <= threshold
        return int(hit.sum()), int((hit & ~self.agreed).sum())

    def scenes_at(self, threshold: float) -> int:
        """How many scenes have a hit at ``threshold`` (every hit counts without ``scene``)."""
        hit = self.distance <= threshold
        return int(hit.sum()) if self.scene is None else int(np.unique(self.scene[hit]).size)


def scene_bound(false: int, hits: int, scenes: int) -> float:
    """The one-sided 95% upper bound of a false-hit rate of ``false`` in ``hits`` that came from
    ``scenes`` evaluation samples: the Wilson score interval of that rate with
    ``min(hits, scenes)`` observations (``upper_bound`` when every hit is its own scene)."""
    n = min(hits, scenes)
    if n <= 0:
        return 1.0
    p, z = false / hits, Z_ONE_SIDED_95
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))


def upper_bound(false: int, n: int) -> float:
    """The one-sided 95% upper bound of a rate of ``false`` in ``n`` (the agent's Wilson score
    interval at ``Z_ONE_SIDED_95``; 1.0 with no samples)."""
    return wilson(false, n, Z_ONE_SIDED_95)[1]


def perturb(arrays: Mapping[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A perturbed copy of every sample: image-like float inputs ([N, C, H, W] or [N, H, W, C])
    shifted by up to 1/32 of their side (at least a pixel), with Gaussian noise of 2% of the
    data's spread and a brightness change of up to 5%; other float inputs get the noise and the
    scale change. Integer inputs (token ids, indices) are copied unchanged."""
    out: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        arr = np.asarray(arr)
        if arr.dtype.kind != "f":
            out[name] = arr.copy()
            continue
        x = arr.astype(np.float64)
        n = x.shape[0]
        spread = float(x.std()) or 1.0
        if x.ndim == 4:
            hw = (2, 3) if x.shape[1] <= 4 else (1, 2)  # channels first unless the second axis is large
            most = max(1, round(min(x.shape[hw[0]], x.shape[hw[1]]) / 32))
            for i in range(n):
                dy, dx = (int(v) for v in rng.integers(-most, most + 1, size=2))
                x[i] = np.roll(x[i], (dy, dx), axis=(hw[0] - 1, hw[1] - 1))
        x = x + rng.normal(0.0, 0.02 * spread, size=x.shape)
        scale = rng.uniform(0.95, 1.05, size=(n,) + (1,) * (x.ndim - 1))
        x = x * scale
        out[name] = x.astype(arr.dtype)
    return out


def replay(
    fn: RunFn,
    arrays: Mapping[str, np.ndarray],
    copies: int = DEFAULT_COPIES,
    seed: int = 0,
    batch: int = 1,
    answers: Mapping[str, np.ndarray] | None = None,
) -> Pairs:
    """The look-ups of one replay of ``arrays`` (``seed`` draws the perturbations). ``answers``:
    ``fn``'s outputs on ``arrays`` where already computed."""
    n = sample_count(arrays)
    if n < 2:
        raise CalibrationError("cache calibration needs at least 2 evaluation samples; pass more with --eval")
    cached = dict(answers) if answers is not None else run_all(fn, arrays, batch)
    sigs = _signatures(arrays, n)
    distances: list[float] = []
    agreed: list[bool] = []
    scene: list[int] = []
    for i in range(1, n):  # the stream: sample i against the samples before it
        j, d = _nearest(sigs[:i], sigs[i])
        distances.append(d)
        agreed.append(agrees(take(cached, j, j + 1), take(cached, i, i + 1)))
        scene.append(i)
    rng = np.random.default_rng(seed)
    for _ in range(copies):  # perturbed copies against the whole replayed set
        copy = perturb(arrays, rng)
        fresh = run_all(fn, copy, batch)
        for i, sig in enumerate(_signatures(copy, n)):
            j, d = _nearest(sigs, sig)
            distances.append(d)
            agreed.append(agrees(take(cached, j, j + 1), take(fresh, i, i + 1)))
            scene.append(i)
    return Pairs(np.asarray(distances, np.float64), np.asarray(agreed, bool), np.asarray(scene, np.int64))


def choose(pairs: Pairs, budget: float) -> Calibration:
    """The largest threshold among the measured distances whose bound is at or under ``budget``."""
    if not 0 < budget < 1:
        raise CalibrationError(f"the false-hit budget must be between 0 and 1, got {budget}")
    order = np.argsort(pairs.distance, kind="stable")
    dist, ok = pairs.distance[order], pairs.agreed[order]
    false_so_far = np.cumsum(~ok)
    if pairs.scene is None:
        scenes_so_far = np.arange(1, dist.size + 1)
    else:  # how many distinct scenes the first k+1 hits came from
        scene = pairs.scene[order]
        first = np.zeros(dist.size, bool)
        first[np.unique(scene, return_index=True)[1]] = True
        scenes_so_far = np.cumsum(first)
    best: Calibration | None = None
    samples = int(dist.size)
    for k in range(dist.size):
        if k + 1 < dist.size and dist[k + 1] == dist[k]:
            continue  # a threshold takes every look-up at its distance
        hits, false, scenes = k + 1, int(false_so_far[k]), int(scenes_so_far[k])
        bound = scene_bound(false, hits, scenes)
        if bound <= budget:
            threshold = float(min(2.0, max(MIN_DISTANCE, dist[k])))
            best = Calibration(threshold, false / hits, bound, budget, hits, samples, scenes)
    if best is None:
        need = math.ceil(Z_ONE_SIDED_95**2 * (1 - budget) / budget)
        unit = "hits" if pairs.scene is None else "evaluation samples with a hit (a sample and its copies count once)"
        raise CalibrationError(
            f"no distance threshold keeps the cache's false-hit rate under {budget:g} with 95% confidence on "
            f"{samples} look-ups (even with no false hit that takes about {need} {unit}): give more evaluation "
            "data (--eval), raise --false-hit-budget, or use --cache exact"
        )
    return best


def calibrate(
    fn: RunFn,
    arrays: Mapping[str, np.ndarray],
    budget: float,
    copies: int = DEFAULT_COPIES,
    seed: int = 0,
    batch: int = 1,
    answers: Mapping[str, np.ndarray] | None = None,
) -> Calibration:
    """Replay ``arrays`` (``replay``) and choose the threshold (``choose``)."""
    return choose(replay(fn, arrays, copies, seed, batch, answers), budget)


def _signatures(arrays: Mapping[str, np.ndarray], n: int) -> np.ndarray:
    rows = []
    for i in range(n):
        sig = signature(take(arrays, i, i + 1))
        if sig is None:
            raise CalibrationError("the approximate cache needs a numeric input; use --cache exact for this model")
        rows.append(sig)
    return np.stack(rows)


def _nearest(rows: np.ndarray, sig: np.ndarray) -> tuple[int, float]:
    sims = rows @ sig
    j = int(np.argmax(sims))
    return j, float(1.0 - sims[j])


CACHE_MODES = ("exact", "approximate")


def cache_policy(
    mode: str,
    budget: float,
    fn: RunFn,
    arrays: Mapping[str, np.ndarray],
    answers: Mapping[str, np.ndarray] | None = None,
    batch: int = 1,
    say: Callable[[str], None] = lambda _: None,
) -> CachePolicy:
    """The manifest's cache policy for ``edgekit package --cache MODE --false-hit-budget B``:
    ``approximate`` is calibrated on ``arrays`` (``calibrate``) with ``fn``."""
    if mode not in CACHE_MODES:
        raise ConfigError(f"--cache must be one of {', '.join(CACHE_MODES)}, got {mode!r}")
    if mode == "exact":
        return CachePolicy(mode="exact")
    if not 0 < budget < 1:
        raise ConfigError(f"--false-hit-budget must be between 0 and 1 (0.01 = 1% of hits), got {budget}")
    found = calibrate(fn, arrays, budget, batch=batch, answers=answers)
    say(
        f"cache: approximate, distance threshold {found.threshold:.4g}: {found.hits} of {found.samples} look-ups hit, "
        f"false-hit rate {found.false_hit_rate:.4f} (95% upper bound {found.bound:.4f}, budget {budget:g})"
    )
    approximate = ApproximateCache(
        embedding="input",
        max_distance=found.threshold,
        agreement=1.0 - found.false_hit_rate,
        samples=found.samples,
        false_hit_rate=found.false_hit_rate,
        false_hit_bound=found.bound,
        false_hit_budget=budget,
        hits=found.hits,
        bound_method=BOUND_METHOD,
    )
    return CachePolicy(mode="approximate", approximate=approximate)
