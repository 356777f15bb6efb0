"""The runtime interface: one small class per device runtime, behind one adapter.

A runtime module implements ``ArtifactRunner``: it opens the artifact files of an extracted,
verified bundle and runs them with the *artifact's* tensor names, dtypes and layout.
``ServedModel`` wraps any runner and presents the *source* model's interface, as the manifest
records it: it checks requests against the served signature, renames tensors, transposes layout
(NCHW served, NHWC artifact) and quantizes/dequantizes int8 tensors with the manifest's scale
and zero point. Runtime modules therefore contain only SDK calls.

SDK imports happen inside the runtime modules, never here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from device_agents.processing.signature import wire_signature
from device_agents.runtimes.latency import LatencyWindow
from edgekit.bundle.errors import InferenceInputError
from edgekit.bundle.manifest import Manifest, QuantParams, TensorMapping, TensorSpec

_NP_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
}


# At most this many (input, shape) pairs are remembered as accepted; past it, shapes are checked every time.
_ACCEPTED_SHAPES = 256

# The threads inside a runtime call now, in this process (every model): what a stopping daemon
# must not finalize the interpreter under (a runtime's C++ threads then abort the process).
_IN_RUNTIME: set[int] = set()


def calls_in_runtime() -> int:
    """How many runtime calls (``ArtifactRunner.run``) are running now, in all models."""
    return len(_IN_RUNTIME)


def np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(_NP_DTYPES[name])


class ArtifactRunner(Protocol):
    """What a runtime module provides. ``name`` matches ``Compatibility.runtime``; its
    ``__init__(model_dir, manifest, options)`` takes that runtime's options class
    (``device_agents.runtimes.options.OPTIONS[name]``)."""

    name: ClassVar[str]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run with artifact tensor names/dtypes/layout; return every artifact output."""
        ...

    def describe(self) -> dict[str, Any]:
        """Runtime version, device/provider actually used, for /v2 metadata and reports."""
        ...

    def close(self) -> None: ...

    # Optional: ``terminate(thread_id) -> bool`` stops the call running in that thread (it then
    # raises) and says whether there was one; a runtime without it cannot stop a call
    # (``ServedModel.terminate``).


class ServedModel:
    """A loaded model presenting the source model's interface (thread-safe ``infer``)."""

    def __init__(self, runner: ArtifactRunner, manifest: Manifest) -> None:
        self.runner = runner
        self.manifest = manifest
        # The served signature (plain attributes, not properties: read on every request)
        self.inputs: tuple[TensorSpec, ...] = manifest.signature.inputs
        self.outputs: tuple[TensorSpec, ...] = manifest.signature.outputs
        # What clients send and receive: the same, or an image in and labels / boxes out where the
        # manifest pre- or post-processes (device_agents.processing applies it as pipeline stages)
        self.wire_inputs, self.wire_outputs = wire_signature(manifest)
        self.model_dir: Path | None = None  # the extracted bundle (its labels file), where loaded from one
        self._in_map = {m.served: m for m in manifest.mapping}
        self._out_map = {m.served: m for m in manifest.mapping}
        self._artifact_specs = {
            s.name: s for s in (*manifest.artifact_signature.inputs, *manifest.artifact_signature.outputs)
        }
        # Some runtimes (LiteRT interpreters) are not re-entrant; one lock per model keeps all safe.
        self._lock = threading.Lock() if getattr(runner, "serialize", False) else None
        self.latency = LatencyWindow()  # runtime time of each successful ``infer`` (self-test baseline)
        # Called once after the runtime is closed (the memory budget gives back what the model held).
        self.on_close: Callable[[], None] | None = None
        # Whether an exception of the runtime says "this input is wrong" (a 400, not a model failure).
        self._rejects_input = getattr(runner, "rejects_input", None)
        # What check_inputs compares, built once: (name, dtype, shape with None for dynamic axes)
        self._expected = tuple(
            (s.name, np_dtype(s.dtype), tuple(d if isinstance(d, int) else None for d in s.shape))
            for s in manifest.signature.inputs
        )
        # served name -> artifact name for tensors that go across as they are (no transpose, no
        # quantization, the same dtype): most bundles; None if any tensor needs converting
        self._direct_in = self._direct(manifest.signature.inputs)
        self._direct_out = self._direct(manifest.signature.outputs)
        self._out_dtypes = {s.name: np_dtype(s.dtype) for s in manifest.signature.outputs}
        # (input name, shape) pairs check_inputs found to match the signature: a client sends the
        # same few shapes, and a set look-up costs less than comparing every axis again
        self._accepted: set[tuple[str, tuple[int, ...]]] = set()

    def _direct(self, specs: tuple[TensorSpec, ...]) -> dict[str, str] | None:
        names = {}
        for spec in specs:
            m = self._in_map.get(spec.name)
            art_name = m.artifact if m else spec.name
            art = self._artifact_specs.get(art_name)
            if (m is not None and m.transpose) or art is None or art.quant is not None or art.dtype != spec.dtype:
                return None
            names[spec.name] = art_name
        return names

    def rejects_input(self, exc: Exception) -> bool:
        return bool(self._rejects_input is not None and self._rejects_input(exc))

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Validate names, dtypes and shapes against the served signature; return cast copies."""
        if len(inputs) == len(self._expected):  # the common case: every input as served, checked in one pass
            fast: dict[str, np.ndarray] = {}
            accepted = self._accepted
            for name, dtype, shape in self._expected:
                arr = inputs.get(name)
                if not isinstance(arr, np.ndarray) or arr.dtype != dtype:
                    break
                if (name, arr.shape) not in accepted:  # a shape not seen yet: check it against the signature
                    if arr.ndim != len(shape) or any(
                        want is not None and got != want for got, want in zip(arr.shape, shape, strict=True)
                    ):
                        break
                    if len(accepted) < _ACCEPTED_SHAPES:
                        accepted.add((name, arr.shape))
                fast[name] = arr
            else:
                return fast
        expected = {s.name: s for s in self.inputs}
        unknown = sorted(set(inputs) - set(expected))
        if unknown:
            raise InferenceInputError(
                f"unknown input {unknown[0]!r}; model {self.manifest.name} takes {', '.join(expected)}"
            )
        missing = sorted(set(expected) - set(inputs))
        if missing:
            raise InferenceInputError(f"missing input {missing[0]!r}")
        out = {}
        batch = None
        for name, spec in expected.items():
            arr = np.asarray(inputs[name])
            want = np_dtype(spec.dtype)
            if arr.dtype != want:
                if not np.can_cast(arr.dtype, want, casting="same_kind"):
                    raise InferenceInputError(f"input {name!r}: dtype {arr.dtype} given, {spec.dtype} expected")
                arr = arr.astype(want)
            if arr.ndim != len(spec.shape):
                raise InferenceInputError(
                    f"input {name!r}: shape {list(arr.shape)} has {arr.ndim} dims, expected {spec.v2_shape}"
                )
            for axis, (got, dim) in enumerate(zip(arr.shape, spec.shape, strict=True)):
                if isinstance(dim, int) and got != dim:
                    raise InferenceInputError(
                        f"input {name!r}: shape {list(arr.shape)} does not match {spec.v2_shape} (axis {axis})"
                    )
            if arr.ndim and batch is None:
                batch = arr.shape[0]
            out[name] = arr
        return out

    def infer(self, inputs: Mapping[str, np.ndarray], *, checked: bool = False) -> dict[str, np.ndarray]:
        """Run with served tensors; ``checked=True``: ``inputs`` came from ``check_inputs`` already."""
        return self.infer_timed(inputs, checked=checked)[0]

    def infer_timed(
        self, inputs: Mapping[str, np.ndarray], *, checked: bool = False
    ) -> tuple[dict[str, np.ndarray], float]:
        """``infer``, and the seconds the runtime call itself took (``runner.run``: what the
        server-side overhead of a request is measured without)."""
        if not checked:
            inputs = self.check_inputs(inputs)
        direct = self._direct_in
        feed = {}
        if direct is not None:
            for name, arr in inputs.items():
                feed[direct[name]] = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
        else:
            for name, arr in inputs.items():
                m = self._in_map.get(name)
                art_name = m.artifact if m else name
                feed[art_name] = _to_artifact(arr, m, self._artifact_specs.get(art_name))
        me = threading.get_ident()
        _IN_RUNTIME.add(me)
        t0 = time.monotonic()
        try:
            if self._lock is not None:
                with self._lock:
                    raw = self.runner.run(feed)
            else:
                raw = self.runner.run(feed)
        finally:
            _IN_RUNTIME.discard(me)
        t1 = time.monotonic()
        run_s = t1 - t0
        self.latency.record(t1, run_s * 1000)
        result = {}
        direct_out = self._direct_out
        if direct_out is not None:
            for spec_name, art_name in direct_out.items():
                got = raw.get(art_name)
                if got is None:
                    raise RuntimeError(f"runtime returned no {art_name!r} (outputs: {', '.join(raw)})")
                want = self._out_dtypes[spec_name]
                result[spec_name] = np.ascontiguousarray(got if got.dtype == want else got.astype(want))
            return result, run_s
        for spec in self.outputs:
            m = self._out_map.get(spec.name)
            art_name = m.artifact if m else spec.name
            if art_name not in raw:
                raise RuntimeError(f"runtime returned no {art_name!r} (outputs: {', '.join(raw)})")
            result[spec.name] = _to_served(raw[art_name], m, self._artifact_specs.get(art_name), spec)
        return result, run_s

    def terminate(self, thread_id: int) -> bool:
        """Ask the runtime to stop the call running in thread ``thread_id`` (it then raises in
        that thread); False when the runtime cannot stop a call (no ``terminate``: its thread
        runs on until the call ends) or none of this model runs there."""
        stop = getattr(self.runner, "terminate", None)
        return bool(stop is not None and stop(thread_id))

    def close(self) -> None:
        try:
            self.runner.close()
        finally:
            on_close, self.on_close = self.on_close, None
            if on_close is not None:
                on_close()


def _to_artifact(arr: np.ndarray, m: TensorMapping | None, spec: TensorSpec | None) -> np.ndarray:
    if m is not None and m.transpose:
        arr = np.transpose(arr, m.transpose)
    if spec is None:
        return np.ascontiguousarray(arr)
    if spec.quant is not None:
        return quantize(arr, spec.quant)
    want = np_dtype(spec.dtype)
    return np.ascontiguousarray(arr.astype(want, copy=False))


def _to_served(arr: np.ndarray, m: TensorMapping | None, spec: TensorSpec | None, served: TensorSpec) -> np.ndarray:
    if spec is not None and spec.quant is not None:
        arr = dequantize(arr, spec.quant)
    if m is not None and m.transpose:
        inverse = np.argsort(m.transpose)
        arr = np.transpose(arr, inverse)
    return np.ascontiguousarray(arr.astype(np_dtype(served.dtype), copy=False))


def quantize(x: np.ndarray, q: QuantParams) -> np.ndarray:
    info = np.iinfo(np_dtype(q.dtype))
    return np.clip(np.round(x / q.scale) + q.zero_point, info.min, info.max).astype(np_dtype(q.dtype))


def dequantize(x: np.ndarray, q: QuantParams) -> np.ndarray:
    return ((x.astype(np.float32) - q.zero_point) * q.scale).astype(np.float32)
