"""Weight-only precisions on a transformer-class graph built here (MatMul-heavy encoder blocks):
cpu ``int8-weights`` (ORT dynamic INT8) and ``int4-weights`` (``MatMulNBits``) vs FP32, packaged by
``edgekit.package`` and opened through the device runtime; size and p50 latency side by side.

The graph: ``x [1, 128, 768]`` -> 2 post-norm encoder blocks in BERT's layout at BERT-base width,
as transformers exports BERT (hidden 768, 12 heads of 64, MLP 3072, sequence 128, batch 1):
query/key/value MatMul 768x768 + bias, each split into heads (Reshape + Transpose), scores MatMul
scaled by 1/sqrt(64), Softmax, context MatMul, heads merged (Transpose + Reshape), output MatMul
768x768 + bias, residual, LayerNormalization, MLP MatMul 768x3072 + bias -> GELU (the erf form
exporters write) -> MatMul 3072x768 + bias, residual, LayerNormalization -> ``y``; seeded random weights, so
accuracy is agreement with FP32 only. ONNX Runtime's transformer optimizer fuses all of it
(Attention, SkipLayerNormalization, BiasGelu): the engine's transformer-fused ``int8-weights``
form, whose dynamic quantization turns Attention into QAttention and MatMul + bias into
DynamicQuantizeMatMul. (Before 2026-12-01 the graph had one head and a fused QKV projection, which
the optimizer did not fuse into Attention; until the evening of that day it was 4 blocks at hidden
256, MLP 1024, where on a quiet 2-core AVX-512 host ORT's FP32 MatMuls were as fast as dynamic INT8:
0.98-1.16x, against 2.17x at BERT-base width in the same minutes.)
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np

from bench.registry import BenchContext, Measurement

SEQ, DIM, HIDDEN, BLOCKS, HEADS = 128, 768, 3072, 2, 12  # BERT-base width, 2 of its 12 layers


def build_encoder(
    path: Path,
    seed: int = 0,
    seq: int = SEQ,
    dim: int = DIM,
    hidden: int = HIDDEN,
    blocks: int = BLOCKS,
    heads: int = HEADS,
) -> Path:
    """The encoder above at the given sizes (the tests build a small one)."""
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

    def linear(p: str, x: str, name: str, shape: tuple[int, int]) -> tuple[str, list]:
        bias = const(p + name + "_b", (rng.standard_normal(shape[1]) * 0.02).astype(np.float32))
        return p + name + "_y", [
            helper.make_node("MatMul", [x, weight(p + name, shape)], [p + name + "_mm"], name=p + name),
            helper.make_node("Add", [p + name + "_mm", bias], [p + name + "_y"], name=p + name + "_bias"),
        ]

    def layer_norm(p: str, x: str, name: str) -> tuple[str, list]:
        gamma = const(p + name + "_g", np.ones(dim, np.float32))
        beta = const(p + name + "_beta", np.zeros(dim, np.float32))
        return p + name, [
            helper.make_node("LayerNormalization", [x, gamma, beta], [p + name], axis=-1, epsilon=1e-5, name=p + name)
        ]

    def gelu(p: str, x: str) -> tuple[str, list]:  # x * 0.5 * (1 + erf(x / sqrt(2))), as exporters write it
        return p + "gelu", [
            helper.make_node("Div", [x, "sqrt2"], [p + "gd"], name=p + "gelu_div"),
            helper.make_node("Erf", [p + "gd"], [p + "ge"], name=p + "gelu_erf"),
            helper.make_node("Add", [p + "ge", "one"], [p + "ga"], name=p + "gelu_add"),
            helper.make_node("Mul", [x, p + "ga"], [p + "gm"], name=p + "gelu_mul"),
            helper.make_node("Mul", [p + "gm", "half"], [p + "gelu"], name=p + "gelu_half"),
        ]

    if dim % heads:
        raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
    head = dim // heads
    const("heads_shape", np.array([0, 0, heads, head], np.int64))  # 0: keep that dim (batch, sequence)
    const("merge_shape", np.array([0, 0, dim], np.int64))
    const("sqrt_head", np.array(np.sqrt(head), np.float32))
    for n, v in (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5)):
        const(n, np.array(v, np.float32))
    x = "x"
    for b in range(blocks):
        p = f"b{b}_"
        # BERT's self-attention as transformers exports it: query/key/value linears, split into
        # heads (Reshape + Transpose), scores scaled, softmax, context merged back
        for t, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
            y, t_nodes = linear(p, x, "w" + t, (dim, dim))
            nodes += [
                *t_nodes,
                helper.make_node("Reshape", [y, "heads_shape"], [p + t + "4"], name=p + t + "_heads"),
                helper.make_node("Transpose", [p + t + "4"], [p + t], perm=perm, name=p + t + "_t"),
            ]
        nodes += [
            helper.make_node("MatMul", [p + "q", p + "k"], [p + "s"], name=p + "scores"),
            helper.make_node("Div", [p + "s", "sqrt_head"], [p + "ss"], name=p + "scaled"),
            helper.make_node("Softmax", [p + "ss"], [p + "a"], axis=-1, name=p + "softmax"),
            helper.make_node("MatMul", [p + "a", p + "v"], [p + "c4"], name=p + "context"),
            helper.make_node("Transpose", [p + "c4"], [p + "ct"], perm=[0, 2, 1, 3], name=p + "context_t"),
            helper.make_node("Reshape", [p + "ct", "merge_shape"], [p + "ctx"], name=p + "merge"),
        ]
        o, o_nodes = linear(p, p + "ctx", "wo", (dim, dim))
        nodes += [*o_nodes, helper.make_node("Add", [x, o], [p + "r1"], name=p + "res1")]
        n1, ln1 = layer_norm(p, p + "r1", "ln1")
        h, mlp1 = linear(p, n1, "w1", (dim, hidden))
        g, act = gelu(p, h)
        m, mlp2 = linear(p, g, "w2", (hidden, dim))
        nodes += [*ln1, *mlp1, *act, *mlp2, helper.make_node("Add", [n1, m], [p + "r2"], name=p + "res2")]
        x, ln2 = layer_norm(p, p + "r2", "ln2")
        nodes += ln2
    nodes.append(helper.make_node("Identity", [x], ["y"], name="output"))
    graph = helper.make_graph(
        nodes, "encoder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", seq, dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq, dim])],
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
            result = edgekit.package(
                model,
                targets=["cpu"],
                precision=precision,
                calib=calib,
                key=ctx.key,
                name="encoder",
                out_dir=work / precision,
                overwrite=True,
                allow_failed=True,
            )
            m = result.manifests["cpu"]
            served[precision] = stack.enter_context(
                served_bundle(result.bundles["cpu"], ctx.pub, work / f"x-{precision}")
            )
            sizes[precision] = m.validation.size_bytes
            chosen = f", the engine chose {m.candidates.chosen}" if m.candidates is not None else ""
            notes[precision] = (
                f"cosine {m.validation.cosine:.4f} to fp32 ({'passed' if m.validation.passed else 'FAILED'}){chosen}"
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
