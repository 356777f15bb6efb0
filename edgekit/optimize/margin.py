"""How far a candidate passed selection, compared with the sampling error of the gate's measures.

A candidate measured on n selection samples passes with measures that are themselves estimates:
the held-out gate draws other samples, and a candidate that cleared a threshold by less than the
estimate's sampling error fails there about as often as it passes (YOLOv8n on jetson: an INT8 Q/DQ
passed selection at worst-channel cosine 0.926 against 0.9 and missed the held-out gate). Each
measure the gate thresholds gets a 95 % bound on the side that fails:

- top-1 agreement (k of n agree): the Wilson score interval's lower bound,
  ``(p + z²/2n - z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)``, for a candidate that disagrees on at
  least one sample (with none, the bound depends on n alone: the same for every such candidate);
- mean cosine (the mean of per-sample cosines): ``mean - z·sd/sqrt(n)``;
- relative error (a ratio of per-sample sums) and the worst live channel's cosine (per-channel sums
  over samples and positions): percentile bootstrap over samples (``BOOTSTRAP_RESAMPLES``
  resamples with a fixed seed), the 97.5th percentile of the error and the 2.5th of the worst
  channel's cosine (the minimum over the channels live in the reference, per resample);
- detections F1 (``2 matched / (fp32's + the candidate's)``, sums over samples): the same
  bootstrap over samples, its 2.5th percentile (YOLOv8n on coral: F1 0.969 on the 32 detections of
  the selection samples, 0.884 on the held-out gate's 23).

A candidate whose bound lies on the failing side of its threshold is *marginal*: the engine ranks
it behind the candidates that passed clear of their sampling error (``engine.search``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from edgekit.validate.detections import DETECTION_MIN_F1
from edgekit.validate.metrics import SAMPLE_CHUNK as CHUNK
from edgekit.validate.metrics import Comparison, channel_axis, live_channels, per_sample

Z_95 = 1.959964  # two-sided 95 %
BOOTSTRAP_RESAMPLES = 200


def wilson_lower(successes: int, n: int, z: float = Z_95) -> float:
    """The Wilson score interval's lower bound for ``successes`` of ``n`` (0 for n = 0)."""
    if n <= 0:
        return 0.0
    p = successes / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n)


def selection_margin(
    reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], comparison: Comparison
) -> str:
    """Why ``comparison`` (a pass on ``reference``/``candidate``, the selection outputs) is within
    the sampling error of a threshold, else "" (clear of it, or failed anyway)."""
    if not comparison.passed:
        return ""
    t = comparison.tolerance
    n = comparison.samples
    names = list(reference)
    if comparison.kind == "classifier":
        if t.min_top1_agreement is None or comparison.top1_agreement is None:
            return ""
        agree = round(comparison.top1_agreement * n)
        if agree >= n:  # no disagreement: its bound depends on n alone, the same for every such candidate
            return ""
        low = wilson_lower(agree, n)
        if low < t.min_top1_agreement:
            return (
                f"top-1 agreement {comparison.top1_agreement:.4g} on {n} samples: its 95 % Wilson lower bound "
                f"{low:.4g} is below {t.min_top1_agreement:.4g}"
            )
        return ""
    why: list[str] = []
    rng = np.random.default_rng(0)
    draws = rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n)) if n > 1 else np.zeros((0, n), dtype=np.int64)
    for name, counts in comparison.detection_counts:
        low_f1 = _f1_lower(counts, draws)
        if low_f1 is not None and low_f1 < DETECTION_MIN_F1:
            matched, ref_n = sum(m for m, _, _ in counts), sum(r for _, r, _ in counts)
            why.append(
                f"output {name!r} detections F1 on {ref_n} fp32 detections ({matched} matched): 95 % bootstrap "
                f"lower bound {low_f1:.4g} < {DETECTION_MIN_F1:g}"
            )
    for name in names:
        r, c = np.asarray(reference[name]), np.asarray(candidate[name])
        cos, err, ref_abs, _ = per_sample(r, c)
        if t.min_cosine is not None and n > 1:
            low = float(cos.mean() - Z_95 * cos.std(ddof=1) / math.sqrt(n))
            if low < t.min_cosine:
                why.append(
                    f"output {name!r} mean cosine {cos.mean():.4g}: 95 % lower bound {low:.4g} < {t.min_cosine:.4g}"
                )
        if t.max_relative_error is not None and len(draws):
            boot = err[draws].sum(axis=1) / np.maximum(ref_abs[draws].sum(axis=1), 1e-12)
            high = float(np.percentile(boot, 97.5))
            if high > t.max_relative_error:
                why.append(
                    f"output {name!r} relative error: 95 % bootstrap upper bound {high:.4g} "
                    f"> {t.max_relative_error:.4g}"
                )
        axis = dict(comparison.channel_axes).get(name, channel_axis(tuple(r.shape)))
        if t.min_channel_cosine is not None and axis is not None and len(draws) and name not in comparison.decoded:
            worst = _channel_lower(r, c, axis, draws)
            if worst is not None and worst < t.min_channel_cosine:
                why.append(
                    f"output {name!r} worst live channel cosine: 95 % bootstrap lower bound {worst:.4g} "
                    f"< {t.min_channel_cosine:.4g}"
                )
    if not why:
        return ""
    return f"within the sampling error of the gate on {n} selection samples: " + "; ".join(why)


def _f1_lower(counts: tuple[tuple[int, int, int], ...], draws: np.ndarray) -> float | None:
    """The 2.5th percentile over bootstrap resamples of samples of the detections F1 (None: no
    resamples, or counts for other samples than the draws index)."""
    if not len(draws) or len(counts) != draws.shape[1]:
        return None
    arr = np.asarray(counts, dtype=np.float64)  # [n, (matched, fp32's, candidate's)]
    matched, total = arr[draws, 0].sum(axis=1), arr[draws, 1].sum(axis=1) + arr[draws, 2].sum(axis=1)
    f1 = np.where(total > 0, 2 * matched / np.maximum(total, 1.0), 1.0)
    return float(np.percentile(f1, 2.5))


def _channel_lower(r: np.ndarray, c: np.ndarray, axis: int, draws: np.ndarray) -> float | None:
    """The 2.5th percentile over bootstrap resamples of samples of the worst live channel's cosine."""
    n = r.shape[0]
    channels = r.shape[axis]
    live = live_channels(r, axis)
    if not live.any():
        return None
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for start in range(0, n, CHUNK):  # a few samples at a time: a detector's outputs are large
        rm = np.moveaxis(r[start : start + CHUNK], axis, -1).reshape(min(CHUNK, n - start), -1, channels)
        cm = np.moveaxis(c[start : start + CHUNK], axis, -1).reshape(rm.shape)
        rm, cm = rm[..., live].astype(np.float64), cm[..., live].astype(np.float64)
        parts.append(
            (np.einsum("spc,spc->sc", rm, rm), np.einsum("spc,spc->sc", cm, cm), np.einsum("spc,spc->sc", rm, cm))
        )
    rr = np.concatenate([p[0] for p in parts])  # per sample, per live channel
    cc = np.concatenate([p[1] for p in parts])
    rc = np.concatenate([p[2] for p in parts])
    a, b, ab = rr[draws].sum(axis=1), cc[draws].sum(axis=1), rc[draws].sum(axis=1)
    na, nb = np.sqrt(a), np.sqrt(b)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = ab / (na * nb)
    cos = np.where((na == 0) & (nb == 0), 1.0, np.nan_to_num(cos, nan=0.0))
    return float(np.percentile(cos.min(axis=1), 2.5))
