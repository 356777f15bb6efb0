"""ONNX Runtime quantization: static INT8 (QDQ / QOperator) calibrated on arrays, dynamic INT8
and 4-bit block-wise (MatMulNBits) weight quantization of MatMul weights.

Calibration follows ORT's ``CalibrationDataReader.get_next`` protocol. Calibrated ranges are
cached per method in a JSON file (ORT's ``calibration_cache_path``), so trying several
quantization settings calibrates once per method. ORT's histogram calibrators (entropy,
percentile) keep every calibrated tensor of every sample of one ``collect_data`` call before
building histograms (YOLOv8n at 320x320, entropy on 32 samples: 2.46 GB peak RSS in one call,
1.39 GB in 16-sample calls; about 61 MB more per sample in one call); ranges are collected
``CALIB_CHUNK_SAMPLES`` samples per call, each call merging into the histograms of the calls
before (ORT's own strided calibration), so thresholds can move slightly (the sum of YOLOv8n's
entropy thresholds moved 0.3 %). MinMax reduces inside the graph (ReduceMin/ReduceMax outputs),
its ranges are the same either way. (ORT's ``CalibMaxIntermediateOutputs`` drops the outputs it
caps instead of reducing them: not used.)
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgekit.errors import UnsupportedOpError
from edgekit.validate.calib import iter_batches, sample_count

CALIB_CHUNK_SAMPLES = 16  # samples per calibrator.collect_data call (bounds the calibrator's memory)
CalibrationName = Literal["minmax", "percentile", "entropy"]
ActivationName = Literal["uint8", "int8"]
FormatName = Literal["qdq", "qoperator"]
# ORT's entropy calibrator defaults to 128 histogram bins and 128 quantized bins: the KL search then
# has a single threshold to try, the full range, so "entropy" ranges came out identical to MinMax
# (and ``quantize_static`` forwards no bin counts). TensorRT's entropy calibration (Migacz, "8-bit
# Inference with TensorRT", GTC 2017) histograms 2048 bins for 128 quantized bins; ORT's KL search is a
# Python loop over every threshold, which took 220 s for one MobileNetV3-small calibration on this
# 2-core host at 2048 bins. 512 bins search thresholds from a quarter of the range up, in 1/256 steps.
ENTROPY_HISTOGRAM: dict[str, int] = {"num_bins": 512, "num_quantized_bins": 128}


@dataclass(frozen=True)
class StaticQuantConfig:
    """One static INT8 configuration; weights are always signed int8."""

    activations: ActivationName = "uint8"
    per_channel: bool = True
    quant_format: FormatName = "qdq"
    calibration: CalibrationName = "minmax"
    reduce_range: bool = False
    percentile: float = 99.999
    exclude: tuple[str, ...] = ()  # node names kept in float (mixed precision: ORT nodes_to_exclude)

    @property
    def layout(self) -> str:
        """The kernel layout: what decides speed (calibration only moves ranges)."""
        act = "u8s8" if self.activations == "uint8" else "s8s8"
        gran = "per-channel" if self.per_channel else "per-tensor"
        rr = " reduce-range" if self.reduce_range else ""
        return f"ort-static {self.quant_format} {act} {gran}{rr}"

    @property
    def label(self) -> str:
        act = "u8s8" if self.activations == "uint8" else "s8s8"
        gran = "per-channel" if self.per_channel else "per-tensor"
        calib = f"percentile {self.percentile}" if self.calibration == "percentile" else self.calibration
        rr = " reduce-range" if self.reduce_range else ""
        kept = f", {len(self.exclude)} layer(s) in float" if self.exclude else ""
        return f"ort-static {self.quant_format} {act} {gran} {calib}{rr}{kept}"


class ArrayCalibrationReader:
    """ORT ``CalibrationDataReader``: ``get_next()`` returns one feed dict, then ``None``."""

    def __init__(self, arrays: Mapping[str, np.ndarray], batch: int = 1) -> None:
        self.arrays = arrays
        self.batch = batch
        self.rewind()

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter_batches(self.arrays, self.batch)

    def set_range(self, start_index: int, end_index: int) -> None:
        """Serve batches ``start_index`` to ``end_index`` (ORT's strided calibration calls this)."""
        lo, hi = start_index * self.batch, end_index * self.batch
        self._it = iter_batches({k: v[lo:hi] for k, v in self.arrays.items()}, self.batch)

    def __len__(self) -> int:
        n = sample_count(self.arrays)
        return (n + self.batch - 1) // self.batch

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        feed = self.get_next()
        if feed is None:
            raise StopIteration
        return feed


def quantize_static_int8(
    model_path: Path,
    out_path: Path,
    calib: Mapping[str, np.ndarray],
    config: StaticQuantConfig,
    cache_dir: Path,
    batch: int = 1,
    chunk_samples: int = CALIB_CHUNK_SAMPLES,
) -> Path:
    """Static INT8 quantization of ``model_path`` (prepared FP32, opset >= 13) to ``out_path``;
    the calibrator sees at most ``chunk_samples`` samples per call (at least one batch)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }
    extra: dict[str, Any] = {}
    if config.calibration == "percentile":
        extra["CalibPercentile"] = config.percentile
    suffix = f"-{config.percentile}" if config.calibration == "percentile" else ""
    cache = Path(cache_dir) / f"ranges-{config.calibration}{suffix}.json"
    if config.calibration != "minmax":
        # ORT's histogram collector stacks per-batch outputs with np.asarray and fails on a
        # shorter last batch ("inhomogeneous shape"); one sample per call keeps shapes equal.
        batch = 1
    reader = None if cache.is_file() else ArrayCalibrationReader(calib, batch)
    if reader is not None and config.calibration == "entropy":
        with contextlib.redirect_stdout(io.StringIO()):
            calibrate_to_cache(Path(model_path), calib, batch, "entropy", cache, {}, Path(cache_dir), chunk_samples)
        reader = None  # quantize_static reads the entropy ranges back from the cache
    if reader is not None:
        extra["CalibStridedMinMax"] = chunk_batches(len(reader), batch, chunk_samples)  # ORT's name; every method
    # ORT's calibrators print progress to stdout, which belongs to the CLI's table; keep it out.
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_static(
            str(model_path),
            str(out_path),
            calibration_data_reader=reader,  # duck-typed: ORT only calls get_next()
            quant_format=QuantFormat.QDQ if config.quant_format == "qdq" else QuantFormat.QOperator,
            per_channel=config.per_channel,
            reduce_range=config.reduce_range,
            activation_type=QuantType.QUInt8 if config.activations == "uint8" else QuantType.QInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=methods[config.calibration],
            calibration_providers=["CPUExecutionProvider"],
            extra_options=extra,
            calibration_cache_path=str(cache),
            nodes_to_exclude=list(config.exclude),
        )
    return Path(out_path)


def chunk_batches(batches: int, batch: int, samples: int = CALIB_CHUNK_SAMPLES) -> int:
    """Batches per ``collect_data`` call: the largest divisor of ``batches`` (ORT's strided
    calibration needs one) holding at most ``samples`` samples, at least one batch."""
    most = max(1, samples // max(1, batch))
    return max(d for d in range(1, min(most, batches) + 1) if batches % d == 0)


def collect_in_chunks(
    calibrator: Any, calib: Mapping[str, np.ndarray], batch: int, samples: int = CALIB_CHUNK_SAMPLES
) -> None:
    """``calibrator.collect_data`` over ``calib`` at most ``samples`` samples per call (each call
    reduces what it saw into the calibrator's ranges or histograms)."""
    reader = ArrayCalibrationReader(calib, batch)
    total = len(reader)
    step = chunk_batches(total, batch, samples)
    for start in range(0, total, step):
        reader.set_range(start, start + step)
        calibrator.collect_data(reader)


def calibrate_to_cache(
    model_path: Path,
    calib: Mapping[str, np.ndarray],
    batch: int,
    method: CalibrationName,
    cache: Path,
    options: Mapping[str, Any],
    work_dir: Path,
    chunk_samples: int = CALIB_CHUNK_SAMPLES,
) -> Any:
    """Run ORT's calibrator for ``method`` over ``calib`` (in chunks, ``collect_in_chunks``) and save its ranges where
    ``quantize_static(calibration_cache_path=cache)`` reads them; entropy with ``ENTROPY_HISTOGRAM``.
    ``options``: the calibrator's own options (``symmetric``, ``percentile``). Returns ORT's ranges."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }
    extra = dict(options) | (ENTROPY_HISTOGRAM if method == "entropy" else {})
    calibrator = create_calibrator(
        Path(model_path),
        None,  # every op: the cache covers the whole graph
        augmented_model_path=str(Path(work_dir) / f"augmented-{method}.onnx"),
        calibrate_method=methods[method],
        providers=["CPUExecutionProvider"],
        extra_options=extra,
    )
    collect_in_chunks(calibrator, calib, batch, chunk_samples)  # ORT keeps every tensor of a call
    tensors = calibrator.compute_data()
    save_tensors_data(tensors, cache)
    return tensors


def optimize_offline(model_path: Path, out_path: Path) -> Path:
    """ONNX Runtime's offline graph optimisation at the *extended* level, saved as ``.onnx``.

    Extended, not ``all``: the ``all`` level adds layout transformations (NCHWc) specific to the
    CPU it ran on, which ORT documents as not portable; the artifact must run on other devices.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out_path)
    from device_agents.runtimes.onnxruntime import DISABLED_OPTIMIZERS

    # the same optimisers as the device's sessions: none that would quantize a float layer
    ort.InferenceSession(
        str(model_path), so, providers=["CPUExecutionProvider"], disabled_optimizers=list(DISABLED_OPTIMIZERS)
    )
    return Path(out_path)


# ``auto`` tries weight-only precisions when MatMul/Gemm hold at least this share of the weights
WEIGHT_ONLY_SHARE = 0.5


def matmul_weight_share(model_path: Path) -> float:
    """The share of the model's weight values (Conv, ConvTranspose, MatMul, Gemm initializers)
    held by MatMul/Gemm: weight-only quantization pays on graphs where it is most of them."""
    import onnx

    model = onnx.load(str(model_path))
    sizes = {i.name: int(np.prod(i.dims)) if i.dims else 1 for i in model.graph.initializer}
    matmul = conv = 0
    for n in model.graph.node:
        if len(n.input) > 1 and n.input[1] in sizes:
            if n.op_type in ("MatMul", "Gemm"):
                matmul += sizes[n.input[1]]
            elif n.op_type in ("Conv", "ConvTranspose"):
                conv += sizes[n.input[1]]
    return matmul / (matmul + conv) if matmul + conv else 0.0


def op_types(model: Any) -> set[str]:
    return {n.op_type for n in model.graph.node}


def gemm_to_matmul(model: Any) -> tuple[Any, int]:
    """Rewrite ``Gemm`` nodes with a constant B as ``MatMul`` (+ ``Add``), which ORT's weight
    quantizers take (they do not take Gemm). Numerically the same. Returns (model, count)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    inits = {i.name: i for i in model.graph.initializer}
    new_nodes, count = [], 0
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else ""
        beta = float(attrs.get("beta", 1.0))
        if (
            node.op_type != "Gemm"
            or node.input[1] not in inits
            or attrs.get("transA", 0)
            or (bias and beta != 1.0 and bias not in inits)  # a scaled computed bias: leave this Gemm alone
        ):
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(inits[node.input[1]])
        if attrs.get("transB", 0):
            w = w.T
        w = (w * float(attrs.get("alpha", 1.0))).astype(w.dtype)
        base = node.name or node.output[0]
        w_name = f"{base}_matmul_weight"
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), w_name))
        mm_out = f"{base}_matmul_out" if bias else node.output[0]
        new_nodes.append(helper.make_node("MatMul", [node.input[0], w_name], [mm_out], name=f"{base}_matmul"))
        if bias:
            if beta != 1.0:
                scaled = (numpy_helper.to_array(inits[bias]) * beta).astype(np.float32)
                bias = f"{base}_bias_scaled"
                model.graph.initializer.append(numpy_helper.from_array(scaled, bias))
            new_nodes.append(helper.make_node("Add", [mm_out, bias], [node.output[0]], name=f"{base}_bias"))
        count += 1
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    used = _used_names(model.graph) | {o.name for o in model.graph.output}
    kept = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model, count


def _used_names(graph: Any) -> set[str]:
    """Tensor names read by the nodes of ``graph`` and of its subgraphs (If/Loop/Scan bodies)."""
    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                names |= _used_names(sub)
    return names


def _matmul_model(model_path: Path, precision: str) -> Any:
    """The prepared model with Gemm rewritten; refuses a model with no MatMul weights."""
    import onnx

    model, _ = gemm_to_matmul(onnx.load(str(model_path)))
    inits = {i.name for i in model.graph.initializer}
    if not any(n.op_type == "MatMul" and n.input[1] in inits for n in model.graph.node):
        ops = ", ".join(sorted(op_types(model)))
        raise UnsupportedOpError(
            f"--precision {precision} quantizes MatMul/Gemm weights, and this model has no MatMul or Gemm with "
            f"constant weights (ops: {ops}); use --precision int8 (static, quantizes Conv too) or fp16"
        )
    return model


def quantize_weights_int8(
    model_path: Path, out_path: Path, per_channel: bool = False, reduce_range: bool = False
) -> Path:
    """Dynamic INT8: MatMul (and fused Attention) weights int8 (per output channel with
    ``per_channel``; 7-bit with ``reduce_range``, which avoids the int16 saturation of u8s8 dot
    products on x86 CPUs without VNNI), activations quantized per call (uint8) by ORT. Models
    with contrib ops (a graph the transformer optimizer fused) keep float as the type of tensors
    shape inference cannot type."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = _matmul_model(model_path, "int8-weights")
    staged = Path(out_path).with_suffix(".matmul.onnx")
    onnx.save(model, str(staged))
    # a graph the transformer optimizer fused keeps the attention projections inside Attention
    # nodes: ORT's dynamic quantizer turns those into QAttention (int8 weights, as for MatMul)
    fused_attention = any(n.op_type == "Attention" and n.domain == "com.microsoft" for n in model.graph.node)
    quantize_dynamic(
        str(staged),
        str(out_path),
        op_types_to_quantize=["MatMul", "Attention"] if fused_attention else ["MatMul"],
        weight_type=QuantType.QInt8,
        per_channel=per_channel,
        reduce_range=reduce_range,
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    staged.unlink()
    return Path(out_path)


def fuse_transformer(model_path: Path, out_path: Path) -> dict[str, int]:
    """ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer``, BERT-style
    fusions: attention, SkipLayerNormalization, Gelu/BiasGelu) on ``model_path``, saved to
    ``out_path`` as ``.onnx`` with contrib ops the ORT CPU provider runs. Returns the fused
    operator counts (empty: nothing matched, nothing written). Graph fusions only (opt_level 0):
    ORT's own session optimisations stay the device runtime's."""
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    def contrib(model: Any) -> Counter[str]:
        return Counter(n.op_type for n in model.graph.node if n.domain == "com.microsoft")

    before = contrib(onnx.load(str(model_path), load_external_data=False))
    optimized = optimize_model(str(model_path), model_type="bert", num_heads=0, hidden_size=0, opt_level=0)
    # the optimizer's own statistics count ops that were there before (LayerNormalization): count
    # the contrib ops it added instead
    fused = dict(contrib(optimized.model) - before)
    if fused:
        optimized.save_model_to_file(str(out_path))
    return fused


def quantize_weights_int4(
    model_path: Path, out_path: Path, block_size: int = 32, symmetric: bool = True, accuracy_level: int | None = None
) -> Path:
    """4-bit block-wise MatMul weights (``MatMulNBits``), activations stay FP32."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = _matmul_model(model_path, "int4-weights")
    quant = MatMulNBitsQuantizer(
        model, bits=4, block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level
    )
    quant.process()
    onnx.save(quant.model.model, str(out_path))
    if "MatMulNBits" not in op_types(quant.model.model):
        raise UnsupportedOpError(
            "--precision int4-weights: ONNX Runtime quantized no MatMul (weights too small or of an unsupported "
            "shape for 4-bit blocks); use --precision int8-weights"
        )
    return Path(out_path)
