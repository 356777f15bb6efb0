"""The agent's HTTP round trip vs a raw in-process ONNX Runtime call, for a 1 KB tensor.

A tiny model (``x`` [batch, 256] float32 -> MatMul -> ``y`` [batch, 16]) is packaged as an FP32
``cpu`` bundle and installed into a real ``edgekit-agent`` on loopback. A is
``onnxruntime.InferenceSession.run`` on the same model in this process; B is
``tritonclient.http`` ``infer`` against the agent with the binary tensor extension (and, as a
second case, with plain JSON tensors). Interleaved; the overhead is B's p50 minus A's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.registry import BenchContext, BenchError, Measurement

FEATURES = 256  # 256 float32 = 1 KB per request
OUTPUTS = 16
MODEL_NAME = "roundtrip"


def tiny_model(path: Path, features: int = FEATURES, outputs: int = OUTPUTS) -> Path:
    """``y = x @ w``: [batch, features] -> [batch, outputs], random weights (4 bytes each)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((features, outputs)) * 0.1).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
        "roundtrip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", outputs])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="edgekit-bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def run(ctx: BenchContext, *, name: str) -> list[Measurement]:
    import onnxruntime as ort
    import tritonclient.http as httpclient

    import edgekit
    from edgekit.validate.latency import p50_side_by_side
    from examples.agent_process import RunningAgent

    work = ctx.workdir / "roundtrip"
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_model(work / "roundtrip.onnx")
    calib = {"x": np.random.default_rng(1).standard_normal((32, FEATURES)).astype(np.float32)}
    ctx.progress(f"{name}: packaging an fp32 cpu bundle of a [batch, {FEATURES}] model")
    result = edgekit.package(
        model, targets=["cpu"], precision="fp32", calib=calib, key=ctx.key, name=MODEL_NAME, out_dir=work / "bundles",
        allow_small_eval=True,  # the benchmark times the round trip, not the gate
    )  # fmt: skip
    x = calib["x"][:1].copy()
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    with RunningAgent(work / "agent", [ctx.pub]) as agent:
        agent.install(result.bundles["cpu"])
        agent.wait_model_ready(MODEL_NAME)
        ctx.progress(f"{name}: agent on {agent.url}; timing infer interleaved with session.run")
        client = httpclient.InferenceServerClient(url=agent.host_port)
        try:

            def over_http(binary: bool) -> object:
                inp = httpclient.InferInput("x", list(x.shape), "FP32")
                inp.set_data_from_numpy(x, binary_data=binary)
                out = httpclient.InferRequestedOutput("y", binary_data=binary)
                return client.infer(MODEL_NAME, [inp], outputs=[out]).as_numpy("y")

            expected = session.run(["y"], {"x": x})[0]
            got = over_http(True)
            if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):  # type: ignore[arg-type]  # ndarray from as_numpy
                raise BenchError("the agent's answer differs from onnxruntime's for the same fp32 model")
            p50 = p50_side_by_side(
                {
                    "session.run": lambda: session.run(["y"], {"x": x}),
                    "v2 binary": lambda: over_http(True),
                    "v2 json": lambda: over_http(False),
                },
                repeats=ctx.repeats * 5,
                budget_s=ctx.budget_s,
                warmup=10,
            )
        finally:
            client.close()
    a = p50["session.run"]
    note = f"1x{FEATURES} float32 (1 KB) in, 1x{OUTPUTS} out; overhead = B - A"
    return [
        Measurement(name, "v2 binary vs in-process", "p50 latency", "ms", "session.run", "agent v2 binary", a,
                    p50["v2 binary"], f"{note}: {p50['v2 binary'] - a:.3f} ms"),
        Measurement(name, "v2 json vs in-process", "p50 latency", "ms", "session.run", "agent v2 json", a,
                    p50["v2 json"], f"{note}: {p50['v2 json'] - a:.3f} ms"),
    ]  # fmt: skip
