"""The small member of the digits cascade: softmax regression on 8x8 average-pooled digits.

Trained here (scikit-learn's ``LogisticRegression`` on the training split of
``examples/digits/train.py``: the same images, upsampled to 32x32, pooled back to 8x8) and
exported as ONNX that takes the large example's input ``image`` [batch, 1, 32, 32] and answers
``logits`` [batch, 10] as softmax probabilities: AveragePool 4x4 -> Flatten -> Gemm -> Softmax,
about 650 parameters against the large CNN's 0.8M. Seeded and deterministic.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from examples.digits import INPUT_NAME, OUTPUT_NAME


def train_small(path: Path, c: float = 1.0) -> tuple[Path, float]:
    """Write the small model to ``path``; returns it and its held-out top-1."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from sklearn.linear_model import LogisticRegression

    from examples.digits.train import TrainConfig, prepare_data

    split = prepare_data(TrainConfig())

    def pooled(x: np.ndarray) -> np.ndarray:
        out: np.ndarray = x.reshape(len(x), 1, 8, 4, 8, 4).mean(axis=(3, 5)).reshape(len(x), 64)
        return out

    clf = LogisticRegression(C=c, max_iter=2000, random_state=0).fit(pooled(split.train_x), split.train_y)
    accuracy = float((clf.predict(pooled(split.eval_x)) == split.eval_y).mean())
    graph = helper.make_graph(
        [
            helper.make_node("AveragePool", [INPUT_NAME], ["pooled"], kernel_shape=[4, 4], strides=[4, 4]),
            helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
            helper.make_node("Gemm", ["flat", "w", "b"], ["scores"], transB=1),
            helper.make_node("Softmax", ["scores"], [OUTPUT_NAME], axis=1),
        ],
        "digits_small",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 1, 32, 32])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", 10])],
        [
            numpy_helper.from_array(clf.coef_.astype(np.float32), "w"),
            numpy_helper.from_array(clf.intercept_.astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="edgekit-examples")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path, accuracy
