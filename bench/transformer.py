"""Weight-only precisions on a transformer-class graph built here (MatMul-heavy encoder blocks):
cpu ``int8-weights`` (ORT dynamic INT8) and ``int4-weights`` (``MatMulNBits``) vs FP32, packaged by
``edgekit.package`` and opened through the device runtime; size and p50 latency side by side.

The graph: ``x [1, 128, 256]`` -> 4 blocks of (QKV MatMul 256x768, scaled-dot-product attention
with MatMul + Softmax, output MatMul 256x256, residual, MLP MatMul 256x1024 -> Relu -> MatMul
1024x256, residual) -> ``y``; seeded random weights, so accuracy is agreement with FP32 only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from bench.registry import BenchContext, Measurement

SEQ, DIM, HIDDEN, BLOCKS = 128, 256, 1024, 4


def build_encoder(path: Path, seed: int = 0) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def weight(name: str, shape: tuple[int, ...]) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name))
        return name

    def const(name: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name))
        return name

    const("qkv_shape", np.array([0, 0, 3, DIM], np.int64))  # 0: keep that dim (batch, sequence)
    const("scale", np.array(1.0 / np.sqrt(DIM), np.float32))
    x = "x"
    for b in range(BLOCKS):
        p = f"b{b}_"
        nodes += [
            helper.make_node("MatMul", [x, weight(p + "wqkv", (DIM, 3 * DIM))], [p + "qkv"], name=p + "qkv"),
            helper.make_node("Reshape", [p + "qkv", "qkv_shape"], [p + "qkv4"], name=p + "reshape"),
            helper.make_node(
                "Split", [p + "qkv4"], [p + "q4", p + "k4", p + "v4"], axis=2, num_outputs=3, name=p + "split"
            ),
        ]
        for t in ("q", "k", "v"):
            nodes.append(helper.make_node("Squeeze", [p + t + "4", const(p + t + "ax", np.array([2], np.int64))],
                                          [p + t], name=p + "sq" + t))  # fmt: skip
        nodes += [
            helper.make_node("Transpose", [p + "k"], [p + "kt"], perm=[0, 2, 1], name=p + "kt"),
            helper.make_node("MatMul", [p + "q", p + "kt"], [p + "s"], name=p + "scores"),
            helper.make_node("Mul", [p + "s", "scale"], [p + "ss"], name=p + "scaled"),
            helper.make_node("Softmax", [p + "ss"], [p + "a"], axis=-1, name=p + "softmax"),
            helper.make_node("MatMul", [p + "a", p + "v"], [p + "ctx"], name=p + "context"),
            helper.make_node("MatMul", [p + "ctx", weight(p + "wo", (DIM, DIM))], [p + "o"], name=p + "out"),
            helper.make_node("Add", [x, p + "o"], [p + "r1"], name=p + "res1"),
            helper.make_node("MatMul", [p + "r1", weight(p + "w1", (DIM, HIDDEN))], [p + "h"], name=p + "mlp1"),
            helper.make_node("Relu", [p + "h"], [p + "hr"], name=p + "relu"),
            helper.make_node("MatMul", [p + "hr", weight(p + "w2", (HIDDEN, DIM))], [p + "m"], name=p + "mlp2"),
            helper.make_node("Add", [p + "r1", p + "m"], [p + "r2"], name=p + "res2"),
        ]
        x = p + "r2"
    nodes.append(helper.make_node("Identity", [x], ["y"], name="output"))
    graph = helper.make_graph(
        nodes, "encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", SEQ, DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", SEQ, DIM])],
        inits,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="edgekit-bench")
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def run(ctx: BenchContext, *, name: str) -> list[Measurement]:
    import edgekit
    from bench.bundles import served_bundle
    from edgekit.validate.latency import call_with, stats_side_by_side

    work = ctx.workdir / "transformer"
    work.mkdir(parents=True, exist_ok=True)
    model = build_encoder(work / "encoder.onnx")
    rng = np.random.default_rng(1)
    calib = {"x": rng.standard_normal((24, SEQ, DIM)).astype(np.float32)}
    rows: list[Measurement] = []
    with contextlib.ExitStack() as stack:
        served, sizes, notes = {}, {}, {}
        for precision in ("fp32", "int8-weights", "int4-weights"):
            ctx.progress(f"{name}: packaging cpu {precision}")
            result = edgekit.package(model, ["cpu"], precision, calib=calib, key=ctx.key, name="encoder",
                                     out_dir=work / precision, overwrite=True, allow_failed=True)  # fmt: skip
            m = result.manifests["cpu"]
            served[precision] = stack.enter_context(
                served_bundle(result.bundles["cpu"], ctx.pub, work / f"x-{precision}")
            )
            sizes[precision] = m.validation.size_bytes
            notes[precision] = (
                f"cosine {m.validation.cosine:.4f} to fp32 ({'passed' if m.validation.passed else 'FAILED'})"
            )
        one = {"x": calib["x"][:1]}
        ctx.progress(f"{name}: p50 latency, batch 1, fp32 / int8-weights / int4-weights interleaved")
        stats = stats_side_by_side({p: call_with(s.infer, one) for p, s in served.items()},
                                     repeats=ctx.repeats, budget_s=ctx.budget_s, warmup=3, discard=1)  # fmt: skip
        for precision in ("int8-weights", "int4-weights"):
            case = f"cpu {precision} vs fp32 (transformer-class encoder)"
            rows.append(Measurement(name, case, "artifact size", "bytes", "fp32", precision, sizes["fp32"],
                                    sizes[precision], notes[precision]))  # fmt: skip
            st = stats[precision]
            spread = f"p90 {st.p90_ms:.3f} ms, IQR {st.iqr_ms:.3f} ms"
            rows.append(Measurement(name, case, "p50 latency, batch 1", "ms", "fp32", precision,
                                    stats["fp32"].p50_ms, st.p50_ms, spread))  # fmt: skip
    return rows
