"""A detector's or segmenter's head decode kept in float (``optimize.head_scope``): the decode nodes
found on a torch-exported YOLOv8-style graph and a DBNet-style map, the bound, and the candidate the
cpu (ORT QDQ ``nodes_to_exclude``) and intel (NNCF ``IgnoredScope``) targets offer from the first
wave, only where an output is a recognised or declared head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from edgekit.bundle.manifest import CandidateResult
from edgekit.compress.onnx_prep import prepare_model
from edgekit.optimize.candidates import BuildSpace
from edgekit.optimize.head_scope import MAX_SHARE, head_scope
from edgekit.targets.base import BuildContext
from edgekit.targets.cpu import CpuOptions, CpuTarget
from edgekit.validate.heads import DBNET_TASK, YOLO_TASK, head_outputs
from tests.factories import sample_inputs, tiny_upsampler, tiny_yolo

HEAD = {"output0": YOLO_TASK}
# 96x96: 12*12 + 6*6 + 3*3 = 189 anchors, enough for the YOLO head to be recognised (heads.MIN_ANCHORS)
IMAGES = sample_inputs(40, size=96, seed=8)


@pytest.fixture(scope="module")
def yolo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_yolo(tmp_path_factory.mktemp("head-yolo") / "yolo.onnx")


def _context(tmp_path: Path, model: Path, options: object, heads: dict[str, str]) -> BuildContext:
    prepared = prepare_model(model, tmp_path / "prepared")
    for folder in ("out", "work"):
        (tmp_path / folder).mkdir()
    return BuildContext(
        model_path=prepared.path, served=prepared.served, precision="auto", calib={"images": IMAGES[:8]},
        static_shapes={"images": (1, 3, 96, 96)}, out_dir=tmp_path / "out", work_dir=tmp_path / "work",
        options=options, progress=lambda _msg: None, source_path=model, heads=heads,
    )  # fmt: skip


def test_head_scope_of_a_yolo_head_is_its_decode_and_the_dfl_projection_but_no_learned_conv(yolo: Path) -> None:
    graph = onnx.load(str(yolo)).graph
    ops = {n.name: n.op_type for n in graph.node}
    scope = head_scope(yolo, HEAD)
    assert scope.what == "detect" and scope.why == f"{len(scope.nodes)} decode nodes of the detect head kept in float"
    kept = {ops[n] for n in scope.nodes}
    # class scores, the DFL (Softmax over the box bins, its arange(8) 1x1 Conv), the box arithmetic
    assert {"/head/Sigmoid", "/head/Softmax", "/head/dfl/Conv", "/head/Sub", "/head/Add_8", "/head/Div_1"} <= set(
        scope.nodes
    )
    assert "/head/Concat_27" in scope.nodes  # the output's own Concat of boxes and scores
    assert [n for n in scope.nodes if ops[n] == "Conv"] == ["/head/dfl/Conv"]
    # neither the learned head convolutions nor the run-time shape arithmetic that feeds Reshape/Slice
    assert not kept & {"Shape", "Gather", "Range", "Cast", "MaxPool", "Constant"}
    assert not any(n.startswith(("/head/box.", "/head/cls.")) for n in scope.nodes)
    assert len(scope.nodes) <= MAX_SHARE * len(graph.node)
    order = [n.name for n in graph.node]
    assert list(scope.nodes) == sorted(scope.nodes, key=order.index)  # graph order


def test_head_scope_of_a_dbnet_map_is_its_sigmoid(tmp_path: Path) -> None:
    model = tiny_upsampler(tmp_path / "db.onnx")
    scope = head_scope(model, {"prob": DBNET_TASK})
    assert scope.nodes == ("sigmoid",) and scope.what == "segment"


def test_head_scope_keeps_nothing_when_the_walk_covers_more_than_a_quarter_of_the_graph(tmp_path: Path) -> None:
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Mul", ["c", "c"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "c"], ["a"], name="add"),
        helper.make_node("Sigmoid", ["a"], ["y"], name="sigmoid"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w],
    )  # fmt: skip
    scope = head_scope(helper.make_model(graph), {"y": "segment"})
    assert scope.nodes == ()
    assert scope.why == (
        "3 nodes between the segment outputs and their last compute layers, more than 25% of the graph's 4: "
        "not a head's decode"
    )
    for n in graph.node:
        n.name = ""
    scope = head_scope(helper.make_model(graph), {"y": "segment"})
    assert scope.nodes == () and scope.why.startswith("3 decode node(s) of the segment head have no name")


def test_head_outputs_are_recognised_heads_and_declared_ones_never_a_shape_guess() -> None:
    tasks = {"boxes": "detect", "output0": YOLO_TASK, "maps": "segment", "prob": DBNET_TASK, "logits": "classify"}
    assert head_outputs(tasks, given={}) == {"output0": YOLO_TASK, "prob": DBNET_TASK}
    assert head_outputs(tasks, given={"maps": "segment", "logits": "classify"}) == {
        "output0": YOLO_TASK,
        "maps": "segment",
        "prob": DBNET_TASK,
    }


def test_cpu_auto_offers_int8_with_the_head_in_float_only_where_there_is_a_head(tmp_path: Path, yolo: Path) -> None:
    ctx = _context(tmp_path, yolo, CpuOptions(openvino=False), HEAD)
    name = "ort-static qdq u8s8 per-channel minmax, detect head in float"
    [offered] = [c for c in CpuTarget().candidates(ctx).first if "head in float" in c.name]
    assert offered.name == name and offered.precision == "int8"
    assert offered.settings["exclude"] == list(head_scope(ctx.model_path, HEAD).nodes)  # the prepared graph's
    plain = CpuTarget().candidates(_with(ctx, heads={}))
    assert not [c for c in plain.first if "head in float" in c.name]
    assert not [n for n, _ in plain.skipped if "head in float" in n]
    # no QDQ layout (QOperator cannot exclude nodes): recorded, not silently dropped
    qop = CpuTarget().candidates(_with(ctx, options=CpuOptions(openvino=False, quant_format="qoperator")))
    assert ("int8, detect head in float", "no int8 candidate of this target keeps layers in float") in qop.skipped
    assert not [c for c in qop.first if "head in float" in c.name]
    # an explicit int8 keeps its own candidates
    assert not [c for c in CpuTarget().candidates(_with(ctx, precision="int8")).first if "head in float" in c.name]


def _with(ctx: BuildContext, **changes: object) -> BuildContext:
    import dataclasses

    return dataclasses.replace(ctx, **changes)  # type: ignore[arg-type]  # BuildContext fields


def test_cpu_head_in_float_keeps_mixed_precision_layers_on_top_of_the_head(tmp_path: Path, yolo: Path) -> None:
    ctx = _context(tmp_path, yolo, CpuOptions(openvino=False), HEAD)
    [offered] = [c for c in CpuTarget().candidates(ctx).first if "head in float" in c.name]
    assert offered.exclude is not None and offered.rank_layers is not None
    more = offered.exclude(("/p3/p3.0/conv/Conv",))
    assert more.name == "ort-static qdq u8s8 per-channel minmax, detect head in float + 1 layer(s)"
    assert more.settings["exclude"] == [*offered.settings["exclude"], "/p3/p3.0/conv/Conv"]


def test_intel_auto_head_in_float_leaves_the_decode_unquantized_in_the_ir(tmp_path: Path, yolo: Path) -> None:
    pytest.importorskip("nncf")
    from edgekit.targets.intel import IntelOptions, IntelTarget

    ctx = _context(tmp_path, yolo, IntelOptions(), HEAD)
    first = IntelTarget().candidates(ctx).first
    [head] = [c for c in first if "head in float" in c.name and "bf16" not in c.name]
    assert head.name == "nncf int8 preset=performance bias_correction=fast, detect head in float"
    [plain] = [c for c in first if c.name == "nncf int8 preset=performance bias_correction=fast"]

    def quantized_inputs(cand: object) -> set[str]:
        """Names of the IR ops fed by a FakeQuantize (their inputs are INT8)."""
        import openvino as ov

        folder = tmp_path / cand.name.replace(" ", "_").replace(",", "")  # type: ignore[attr-defined]
        folder.mkdir()
        space = BuildSpace(folder, {"images": IMAGES[:8]}, ctx.served, 1, lambda _msg: None)
        cand.build(space)  # type: ignore[attr-defined]
        fed = set()
        for op in ov.Core().read_model(str(folder / "model.xml")).get_ordered_ops():
            if op.get_type_name() == "FakeQuantize":
                fed |= {t.get_node().get_friendly_name() for t in op.output(0).get_target_inputs()}
        return fed

    decode = {"/head/dfl/Conv", "/head/Add_8", "/head/Sub_1", "/head/Concat_26"}
    assert decode <= quantized_inputs(plain)  # NNCF quantizes the decode arithmetic by default
    kept = quantized_inputs(head)
    assert not kept & decode
    assert any(n.startswith("/head/cls.") for n in kept)  # the learned head convolutions stay INT8


def test_package_auto_lists_the_head_in_float_candidate_with_its_decoded_gate(
    keypair: tuple[Path, Path], tmp_path: Path, yolo: Path
) -> None:
    from tests.factories import package_small_data as package

    result = package(
        yolo, targets=["cpu"], precision="auto", calib={"images": IMAGES[:30]}, eval={"images": IMAGES[30:]},
        key=keypair[0], out_dir=tmp_path / "out", options={"cpu": {"openvino": False, "max_candidates": 1}},
    )  # fmt: skip
    rows = {c.id: c for c in result.manifests["cpu"].candidates.candidates}
    plain = rows["ort-static qdq u8s8 per-channel minmax"]
    head = rows["ort-static qdq u8s8 per-channel minmax, detect head in float"]
    assert head.status in ("passed", "chosen", "failed"), head.reason  # built and gated in the first wave
    assert "/head/dfl/Conv" in head.excluded_nodes and "/head/Sigmoid" in head.excluded_nodes
    assert not plain.excluded_nodes

    def f1(row: CandidateResult) -> float:
        notes = result.manifests["cpu"].validation.notes
        text = row.reason or next(n for n in notes if n.startswith(f"tried {row.id}: "))
        return float(text.split("detections F1 ")[1].split()[0])

    # the random-weight head's scores sit near 0.5, so its detections are fragile; sharing one int8
    # scale with the box pixels in the output Concat loses most of them, the head in float does not
    assert f1(head) > f1(plain)


def test_jetson_auto_head_in_float_leaves_the_decode_without_qdq_and_ranks_it_as_mixed_int8(
    tmp_path: Path, yolo: Path
) -> None:
    from edgekit.targets.jetson import ARTIFACT, DEVICE_RANK, JetsonOptions, JetsonTarget

    ctx = _context(tmp_path, yolo, JetsonOptions(), HEAD)
    plan = JetsonTarget().candidates(ctx)
    [head] = [c for c in plan.first if "head in float" in c.name]
    plain = next(c for c in plan.first if c.name.startswith("tensorrt int8 q/dq") and "head" not in c.name)
    assert head.name.startswith(plain.name) and head.name.endswith(", detect head in float")
    # TensorRT runs the decode in FP16 (int8 + fp16 flags): after plain INT8, before FP16
    assert head.device_rank == DEVICE_RANK["int8-mixed"] and plain.device_rank < head.device_rank
    assert not [c for c in JetsonTarget().candidates(_with(ctx, heads={})).first if "head in float" in c.name]

    def dequantized_inputs(cand: object) -> set[str]:
        """Names of the nodes that read a DequantizeLinear output (their inputs are INT8 on TensorRT)."""
        folder = tmp_path / cand.name.replace(" ", "_").replace(",", "").replace("/", "")  # type: ignore[attr-defined]
        folder.mkdir()
        cand.build(BuildSpace(folder, {"images": IMAGES[:8]}, ctx.served, 1, lambda _msg: None))  # type: ignore[attr-defined]
        graph = onnx.load(str(folder / ARTIFACT)).graph
        dq = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
        return {n.name for n in graph.node if n.op_type != "QuantizeLinear" and dq & set(n.input)}

    scope = set(head_scope(ctx.model_path, HEAD).nodes)
    assert "/head/dfl/Conv" in dequantized_inputs(plain) & scope  # the DFL projection is Q/DQ'd by default
    assert not dequantized_inputs(head) & scope


def test_cpu_auto_offers_the_nncf_int8_with_the_head_in_float_that_intel_builds(tmp_path: Path, yolo: Path) -> None:
    pytest.importorskip("nncf")
    from edgekit.targets.intel import IntelOptions, IntelTarget

    ctx = _context(tmp_path, yolo, CpuOptions(), HEAD)
    name = "nncf int8 preset=performance bias_correction=fast, detect head in float"
    [cpu] = [c for c in CpuTarget().candidates(ctx).first if c.name == name]
    [intel] = [c for c in IntelTarget().candidates(_with(ctx, options=IntelOptions())).first if c.name == name]
    # the engine's build identity (runtime, name, settings): packaging cpu and intel builds it once
    assert (cpu.runtime, cpu.settings) == (intel.runtime, intel.settings)
    assert cpu.runtime == "openvino" and cpu.settings["exclude"] == list(head_scope(yolo, HEAD).nodes)
    # mixed precision on top of it keeps the head in float too
    assert cpu.exclude is not None and "/head/Sigmoid" in cpu.exclude(("/p3/p3.0/conv/Conv",)).settings["exclude"]
    plain = CpuTarget().candidates(_with(ctx, heads={})).first
    assert not [c for c in plain if c.runtime == "openvino" and "head in float" in c.name]
