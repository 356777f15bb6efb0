"""What each cut costs here: head and tail latency under ONNX Runtime (interleaved, medians),
bytes per sample on the link, and what compressing the cut tensor costs in accuracy.

The full model, every head and every tail are timed as they run, each its own ONNX Runtime
session, with the timer the device's ``edgekit-agent profile`` uses
(``device_agents.split.profile.interleaved_rounds``): interleaved rounds in a shuffled order, one
untimed call before each block (the previous session's pool settles), a block sized to about
``BLOCK_MS`` so a 0.1 ms tail is timed over many calls while a 100 ms head is not repeated
needlessly, the median of the rounds' block medians. Host and device times are thus measured
the same way.

``timing``: ``cpu`` (the default) runs every session with one intra-op thread and times the
calling thread's CPU time (``time.thread_time``): what the segment costs one core that has it to
itself, whatever else this host runs meanwhile (two runs on a 2-core host under a load average of
8 agreed within about 1%, where wall-clock medians differed by 12-30%); ``wall`` uses ONNX
Runtime's default thread pool and wall-clock time, as this host runs it under its current load.

Head and tail composed must give the full model's outputs: checked on every sample before
anything is timed (``SplitCompositionError`` otherwise).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgekit.errors import ValidationFailedError
from edgekit.split import compression
from edgekit.split.graph import CutPoint
from edgekit.validate.ort_runner import ort_open

Feed = dict[str, np.ndarray]
Runner = Callable[[Feed], dict[str, np.ndarray]]
# head∘tail against the full model: FP32 re-association inside ONNX Runtime's fused kernels only
COMPOSE_RTOL = 1e-3
COMPOSE_ATOL = 1e-4
BLOCK_MS = 20.0  # timed calls per block: about this long (1 to 64 calls)
TIMINGS = ("cpu", "wall")


TIMING_NOTES = {
    "cpu": "host times: CPU time of one-thread ONNX Runtime sessions (a core to itself; this host's other load "
    "left out; --timing wall for wall-clock with the default thread pool)",
    "wall": "host times: wall-clock with ONNX Runtime's default thread pool, under this host's current load",
}


class SplitCompositionError(ValidationFailedError):
    """A head and its tail composed do not reproduce the full model's outputs."""


@dataclass(frozen=True)
class CompressionCost:
    """One compression mode of a cut tensor, over the samples: mean bytes on the link per sample,
    and the model outputs computed from the decoded tensor against the full model's."""

    mode: compression.Mode
    bytes_per_sample: int
    max_abs_error: float
    mean_cosine: float
    top1_agreement: float | None  # for a 2-D (batch, scores) first output


@dataclass(frozen=True)
class CutMeasurement:
    cut: CutPoint
    head_path: Path
    tail_path: Path
    bytes_per_sample: int  # raw tensors as the head returns them
    max_abs_error: float  # head∘tail vs the full model
    head_ms: float
    tail_ms: float
    compression: tuple[CompressionCost, ...] = ()


@dataclass(frozen=True)
class Measurements:
    full_ms: float
    input_bytes_per_sample: int
    output_bytes_per_sample: int
    cuts: tuple[CutMeasurement, ...]
    samples: int
    calls_per_function: int  # rounds: block medians each time is the median of
    notes: tuple[str, ...] = field(default_factory=tuple)
    spread: Mapping[str, float] = field(default_factory=dict)  # "full" / "head:<cut>" / "tail:<cut>": IQR / median


def rows(feed: Mapping[str, np.ndarray]) -> int:
    first = next(iter(feed.values()))
    return int(first.shape[0]) if first.ndim else 1


def per_sample_bytes(tensors: Mapping[str, np.ndarray], samples: int) -> int:
    return round(sum(t.nbytes for t in tensors.values()) / max(1, samples))


def measure(
    full_path: Path,
    cuts: Sequence[tuple[CutPoint, Path, Path]],
    feeds: Sequence[Feed],
    *,
    min_rounds: int = 5,
    budget_s: float = 20.0,
    compress: bool = True,
    timing: str = "cpu",
) -> Measurements:
    """Check every head∘tail against the full model on ``feeds``, then time the full model and
    every head and tail side by side on the first feed."""
    import time

    from edgekit.errors import ConfigError

    if timing not in TIMINGS:
        raise ConfigError(f"--timing {timing!r}: expected one of {', '.join(TIMINGS)}")
    threads = 1 if timing == "cpu" else 0  # 0: ONNX Runtime's default pool

    def open_(path: Path) -> Runner:
        return ort_open(path)(threads)

    full = open_(full_path)
    references = [full(f) for f in feeds]
    n = sum(rows(f) for f in feeds)
    runners: list[tuple[CutPoint, Runner, Runner]] = []
    checked: list[tuple[int, float, tuple[CompressionCost, ...]]] = []
    for cut, head_path, tail_path in cuts:
        head, tail = open_(head_path), open_(tail_path)
        runners.append((cut, head, tail))
        worst, sent = 0.0, 0
        mids: list[dict[str, np.ndarray]] = []
        for feed, ref in zip(feeds, references, strict=True):
            mid = head(feed)
            mids.append(mid)
            sent += sum(t.nbytes for t in mid.values())
            out = tail(mid)
            for name, want in ref.items():
                got = out[name]
                if got.shape != want.shape or not np.allclose(got, want, rtol=COMPOSE_RTOL, atol=COMPOSE_ATOL):
                    raise SplitCompositionError(
                        f"{cut.id} ({', '.join(cut.tensors)}): head and tail composed give {name} off by "
                        f"{_max_abs(got, want):.3g} from the full model; this cut cannot be used"
                    )
                worst = max(worst, _max_abs(got, want))
        costs = _compression_costs(tail, mids, references, n) if compress else ()
        checked.append((round(sent / max(1, n)), worst, costs))
    fns: dict[str, Callable[[], object]] = {"full": _bind(full, feeds[0])}
    for cut, head, tail in runners:
        mid = head(feeds[0])
        fns[f"head:{cut.id}"] = _bind(head, feeds[0])
        fns[f"tail:{cut.id}"] = _bind(tail, mid)
    from device_agents.split.profile import interleaved_rounds

    clock = time.thread_time if timing == "cpu" else time.perf_counter
    rounds = interleaved_rounds(fns, budget_s=budget_s, min_rounds=min_rounds, block_ms=BLOCK_MS, clock=clock)
    ms = {name: statistics.median(v) for name, v in rounds.items()}
    per_call = rows(feeds[0])
    cut_rows = tuple(
        CutMeasurement(
            cut=cut,
            head_path=head_path,
            tail_path=tail_path,
            bytes_per_sample=sent,
            max_abs_error=worst,
            head_ms=ms[f"head:{cut.id}"] / per_call,
            tail_ms=ms[f"tail:{cut.id}"] / per_call,
            compression=costs,
        )
        for (cut, head_path, tail_path), (sent, worst, costs) in zip(cuts, checked, strict=True)
    )
    return Measurements(
        full_ms=ms["full"] / per_call,
        input_bytes_per_sample=sum(per_sample_bytes(f, rows(f)) for f in feeds[:1]),
        output_bytes_per_sample=per_sample_bytes(references[0], rows(feeds[0])),
        cuts=cut_rows,
        samples=n,
        calls_per_function=len(rounds["full"]),
        spread={name: _relative_iqr(v) for name, v in rounds.items()},
        notes=(TIMING_NOTES[timing],),
    )


def _compression_costs(
    tail: Runner, mids: Sequence[dict[str, np.ndarray]], references: Sequence[dict[str, np.ndarray]], n: int
) -> tuple[CompressionCost, ...]:
    out: list[CompressionCost] = []
    for mode in compression.MODES:
        size, worst, cosines, agree, total = 0, 0.0, [], 0, 0
        for mid, ref in zip(mids, references, strict=True):
            decoded = {}
            for name, t in mid.items():
                data = compression.encode(t, mode)
                size += len(data)
                decoded[name] = compression.decode(data, mode, t.shape, t.dtype)
            got = tail(decoded)
            name = next(iter(ref))
            want = ref[name]
            worst = max(worst, _max_abs(got[name], want))
            for g, w in zip(got[name].reshape(len(want), -1), want.reshape(len(want), -1), strict=True):
                cosines.append(_cosine(g, w))
            if want.ndim == 2:
                agree += int((got[name].argmax(axis=1) == want.argmax(axis=1)).sum())
                total += want.shape[0]
        out.append(
            CompressionCost(
                mode=mode,
                bytes_per_sample=round(size / max(1, n)),
                max_abs_error=worst,
                mean_cosine=float(np.mean(cosines)) if cosines else 1.0,
                top1_agreement=agree / total if total else None,
            )
        )
    return tuple(out)


def _relative_iqr(values: Sequence[float]) -> float:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    mid = statistics.median(values)
    return (q3 - q1) / mid if mid > 0 else 0.0


def _bind(fn: Runner, feed: Feed) -> Callable[[], object]:
    return lambda: fn(feed)


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    denom = float(np.linalg.norm(a64) * np.linalg.norm(b64))
    return float(a64 @ b64 / denom) if denom else float(np.array_equal(a64, b64))
