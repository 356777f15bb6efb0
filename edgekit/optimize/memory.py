"""The packaging run's memory bound: what a candidate needs before it is built, and a refusal
(with its reason) where that exceeds ``--max-memory-gb``.

The estimate is deterministic (ONNX shape inference and array sizes, never a reading of the
process's memory), so the same request refuses the same candidates on every host:

    held        the arrays the search holds whatever the candidate (calibration subset,
                selection samples, the FP32 reference outputs on them, the held-out reference),
                and the candidate's own outputs on the selection samples
  + model       ``MODEL_COPIES`` x the model file (the runtime's copy, the converter's, the quantizer's)
  + running     samples per call x the largest node's inputs and outputs on one sample x
                ``ARENA_FACTOR`` (the runtimes' arenas grow by powers of two, and hold more
                than the one node)
  + calibrating (static int8 only) samples per calibration call x every tensor of one sample: the
                calibrators keep each tensor's values for the call (ONNX Runtime's histograms
                held 2.46 GB for YOLOv8n 320² entropy on 32 samples; ``CALIB_CALL_SAMPLES``,
                or the candidate's own ``Candidate.calib_call_samples``: NNCF's one)
  + every sample (a calibration that keeps a layer's tensors for many samples at once,
                ``Candidate.holds_every_sample``: NNCF's full bias correction, on a fifth of the
                subset, keeping more than one tensor per layer) calibration samples x half the
                largest node's inputs and outputs on one sample: an empirical fit (U^2-Net-p 320²,
                96 samples: 5.0 GB; measured 5.1 GB over the run's other peaks)
  + ``RUNTIME_BYTES``, the runtimes' libraries and the interpreter.

The constants are set from a measured run (a 512x512 conv model, 16 to 3 channels, cpu auto with
50 and 200 calibration and evaluation samples): 1.25-1.5 GB resident beyond the data before the
first candidate, and an accuracy pass of 16 samples per call 2.0-2.2 GB over that, ~3.5x its
largest node's tensors; the estimate came within 10-15 % under the measured peak RSS.

  + sessions   the sessions of candidates already built, which the search keeps open for its
                side-by-side timing rounds: each x every tensor of one sample (a runtime's arena
                after one call: ONNX Runtime's held ~0.55 GB each for U^2-Net-p 320², whose
                tensors sum to 0.6 GB). Where one accuracy pass's working set is large
                (``REOPEN_ABOVE_BYTES``) such a session is opened again after that pass, so it
                holds one sample's arena, not the pass's; the sessions of candidates that failed
                the gate are closed once the quick round has timed them.

Mixed precision's layer ranking runs the float and the quantized model side by side with every
tensor kept and compares them in float64: ``RANKING_TENSOR_COPIES`` x every tensor of one sample
over the search's base (LiteRT on U^2-Net-p 320²: +5 GB over 3.5 GB, 0.6 GB of tensors); over the
bound it is not tried (``ranking_refusal``).

``SearchResult.notes`` records the run's measured peak RSS next to the bound, so what is left of
the gap shows.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GB = 1024**3
MODEL_COPIES = 3
ARENA_FACTOR = 3.0
RUNTIME_BYTES = 1280 * 1024**2
# samples per calibration call: ONNX Runtime's (``compress.ort_quant.CALIB_CHUNK_SAMPLES``);
# NNCF's statistics collection runs one subset sample at a time, so this bounds it too
CALIB_CALL_SAMPLES = 16
REFUSAL = "needs ~"  # how a refusal's reason starts
RANKING_TENSOR_COPIES = 8  # mixed precision's ranking, in tensors of one sample (module docstring)
# an accuracy pass whose working set is over this: the candidate's session is opened again for
# the timing rounds (a second open costs ~0.3 s for ONNX Runtime; below this it is not worth it)
REOPEN_ABOVE_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class MemoryModel:
    """What the estimate needs of one model and one search, worked out once per target."""

    bound_bytes: int  # --max-memory-gb
    held_bytes: int  # arrays held whatever the candidate
    model_bytes: int
    node_peak_bytes: int  # the largest node's inputs + outputs on one sample
    all_tensors_bytes: int  # every tensor of one sample (what a calibrator keeps)
    run_samples: int  # samples per accuracy call
    calib_samples: int = CALIB_CALL_SAMPLES  # the search's calibration subset

    def session_bytes(self) -> int:
        """What one open session of a measured candidate holds between calls (its arena)."""
        return self.all_tensors_bytes + self.model_bytes

    def needs(
        self, calibrates: bool, every_sample: bool = False, call_samples: int | None = None, open_sessions: int = 0
    ) -> int:
        """Bytes a candidate needs to be built and measured (``calibrates``: static int8;
        ``every_sample``: its calibration holds every sample's activations at once;
        ``call_samples``: its calibrator's samples per call, default ``CALIB_CALL_SAMPLES``;
        ``open_sessions``: the sessions of candidates measured before it, still open)."""
        running = int(self.run_samples * self.node_peak_bytes * ARENA_FACTOR) + open_sessions * self.session_bytes()
        per_call = CALIB_CALL_SAMPLES if call_samples is None else call_samples
        calibrating = per_call * self.all_tensors_bytes if calibrates else 0
        if calibrates and every_sample:
            calibrating += self.calib_samples * self.node_peak_bytes // 2
        return self.held_bytes + MODEL_COPIES * self.model_bytes + running + calibrating + RUNTIME_BYTES

    def ranking_refusal(self, open_sessions: int = 0) -> str:
        """Why mixed precision's layer ranking is not run under the bound, or "" when it fits."""
        need = (
            self.held_bytes
            + MODEL_COPIES * self.model_bytes
            + RUNTIME_BYTES
            + open_sessions * self.session_bytes()
            + RANKING_TENSOR_COPIES * self.all_tensors_bytes
        )
        if need <= self.bound_bytes:
            return ""
        return (
            f"{REFUSAL}{gb(need)} to rank the layers (every tensor of both models on one sample, compared; "
            f"{open_sessions} open sessions), over the bound of {gb(self.bound_bytes)}: raise --max-memory-gb"
        )

    def reopen_after_accuracy(self) -> bool:
        """Whether a candidate's session is opened again after its accuracy pass: where that pass's
        working set (``run_samples`` per call) is over ``REOPEN_ABOVE_BYTES``, a session kept open
        for the timing rounds (one sample per call) would keep it."""
        return self.run_samples > 1 and self.run_samples * self.node_peak_bytes * ARENA_FACTOR > REOPEN_ABOVE_BYTES

    def refusal(
        self, precision: str, every_sample: bool = False, call_samples: int | None = None, open_sessions: int = 0
    ) -> str:
        """Why a candidate of CLI ``precision`` is not built under the bound, or "" when it fits
        (``every_sample``, ``call_samples``: the candidate's ``holds_every_sample``,
        ``calib_call_samples``; ``open_sessions``: see ``needs``)."""
        calibrates = precision == "int8"
        per_call = CALIB_CALL_SAMPLES if call_samples is None else call_samples
        need = self.needs(calibrates, every_sample, per_call, open_sessions)
        if need <= self.bound_bytes:
            return ""
        what = "calibrate" if calibrates else "build and measure"
        held = (
            f"a layer's activations of all {self.calib_samples} calibration samples at once"
            if calibrates and every_sample
            else f"activations of {per_call if calibrates else self.run_samples} samples per call"
        )
        sessions = f", {open_sessions} open sessions of candidates measured before it" if open_sessions else ""
        return (
            f"{REFUSAL}{gb(need)} to {what} (model {gb(MODEL_COPIES * self.model_bytes)}, data held "
            f"{gb(self.held_bytes)}, {held}{sessions}), over the bound of {gb(self.bound_bytes)}: raise "
            "--max-memory-gb, or give fewer --calib samples (--calib-samples) or a smaller input shape"
        )


def gb(n: float) -> str:
    """``n`` bytes for a reason: ``4.32 GB``, ``310 MB`` below a tenth of a GB."""
    return f"{n / GB:.3g} GB" if n >= GB / 10 else f"{n / 1024**2:.3g} MB"


def bound_bytes(max_memory_gb: float) -> int:
    return int(max_memory_gb * GB)


def memory_model(
    model: Path,
    per_sample: Mapping[str, tuple[int, ...]],
    held: Iterable[Mapping[str, np.ndarray] | None],
    bound: int,
    run_samples: int,
    calib_samples: int = CALIB_CALL_SAMPLES,
) -> MemoryModel:
    """The ``MemoryModel`` of ``model`` fed one sample of ``per_sample`` shapes (an input's shape
    without its sample axis), holding the arrays of ``held``, calibrating on ``calib_samples``."""
    import onnx

    proto = onnx.load(str(model), load_external_data=False)  # shapes only: no weights read
    node_peak, all_tensors = activation_bytes(proto, per_sample)
    unique = {id(a): int(a.nbytes) for arrays in held if arrays is not None for a in arrays.values()}
    held_bytes = sum(unique.values())  # an array held under two names counts once
    return MemoryModel(
        bound_bytes=bound,
        held_bytes=held_bytes,
        model_bytes=_model_file_bytes(model, proto),
        node_peak_bytes=node_peak,
        all_tensors_bytes=all_tensors,
        run_samples=run_samples,
        calib_samples=calib_samples,
    )


def activation_bytes(proto: Any, per_sample: Mapping[str, tuple[int, ...]]) -> tuple[int, int]:
    """(the largest node's inputs + outputs, every tensor) in bytes for one sample of ``proto`` (an
    ``onnx.ModelProto``, changed: its inputs fixed to one sample), from ONNX
    shape inference with each input fixed to one sample; a dimension inference leaves unknown
    counts as 1 (the estimate is then low), an input missing from ``per_sample`` keeps its shape."""
    import onnx
    from onnx import helper

    graph = proto.graph
    initializers = {i.name for i in graph.initializer}
    for inp in graph.input:
        if inp.name in initializers or inp.name not in per_sample:
            continue
        dims = inp.type.tensor_type.shape.dim
        shape = (1, *per_sample[inp.name])
        if len(dims) != len(shape):
            continue
        for d, size in zip(dims, shape, strict=True):
            d.ClearField("dim_param")
            d.dim_value = int(size)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # a model shape inference cannot take: the graph's own annotations
        inferred = proto
    sizes: dict[str, int] = {}
    for info in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        if info.name in initializers or not info.type.HasField("tensor_type"):
            continue
        t = info.type.tensor_type
        try:
            item = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
        except (KeyError, TypeError, ValueError):
            item = 4
        count = 1
        for d in t.shape.dim:
            count *= d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1
        sizes[info.name] = count * item
    node_peak = max(
        (sum(sizes.get(n, 0) for n in (*node.input, *node.output)) for node in inferred.graph.node), default=0
    )
    return node_peak, sum(sizes.values())


def _model_file_bytes(model: Path, proto: Any) -> int:
    """The model file and its external-data files (the same folder's files ``proto`` names)."""
    import onnx

    total = model.stat().st_size
    try:
        names = {
            e.value
            for t in proto.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data
            if e.key == "location"
        }
        total += sum((model.parent / n).stat().st_size for n in names if (model.parent / n).is_file())
    except Exception:  # the size of the file alone: the estimate is then low
        pass
    return total


def release_memory() -> None:
    """Give what was freed back to the system: a garbage collection, then glibc's ``malloc_trim``
    (freed heap pages otherwise stay with the process and count in its RSS, so a later target's
    search starts from the earlier one's peak); only the collection elsewhere."""
    import ctypes
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim this way
            pass


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
