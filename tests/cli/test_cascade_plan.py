"""``edgekit cascade plan``: the threshold that keeps a two-model cascade within the accuracy budget
of the large model with the fewest escalations, checked against a brute-force search over every
threshold, on two real ONNX classifiers."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from edgekit.cascade import choose_threshold, top1_scores
from tests.factories import tiny_classifier


def _brute(conf: np.ndarray, small_right: np.ndarray, large_right: np.ndarray, max_drop: float) -> tuple[float, float]:
    """The lowest escalation rate over every cut between sorted confidences, and its accuracy."""
    best = (1.0, float(large_right.mean()))
    cuts = sorted(set(conf.tolist()))
    for t in [0.0, *[(a + b) / 2 for a, b in itertools.pairwise(cuts)], 1.0]:
        up = conf < t
        acc = float(np.where(up, large_right, small_right).mean())
        if acc >= large_right.mean() - max_drop - 1e-12 and up.mean() < best[0]:
            best = (float(up.mean()), acc)
    return best


@pytest.mark.parametrize("max_drop", [0.0, 0.005, 0.05, 0.2])
def test_choose_threshold_escalates_as_little_as_the_budget_allows(max_drop: float) -> None:
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.3, 1.0, 400).round(2)  # ties included
    small_right = rng.uniform(0, 1, 400) < conf  # surer answers are right more often
    large_right = rng.uniform(0, 1, 400) < 0.93
    threshold, rate, acc = choose_threshold(conf, small_right, large_right, max_drop)
    assert (rate, acc) == pytest.approx(_brute(conf, small_right, large_right, max_drop))
    up = conf < threshold
    assert up.mean() == pytest.approx(rate) and np.where(up, large_right, small_right).mean() == pytest.approx(acc)


def test_cli_cascade_plan_prints_the_threshold_rate_and_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import onnxruntime as ort

    from edgekit.cli import main

    small = tiny_classifier(tmp_path / "small.onnx", classes=4, seed=0)
    large = tiny_classifier(tmp_path / "large.onnx", classes=4, seed=1)
    x = (np.random.default_rng(3).standard_normal((200, 3, 16, 16)) * 3).astype(np.float32)
    truth = ort.InferenceSession(str(large)).run(None, {"input": x})[0].argmax(1)
    truth[::10] = (truth[::10] + 1) % 4  # the large model is right on 90%
    np.savez(tmp_path / "eval.npz", input=x, labels=truth)
    code = main(["cascade", "plan", str(small), str(large), "--eval", str(tmp_path / "eval.npz"), "--max-drop", "0.02",
                 "--name", "digits"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    small_pred, conf = top1_scores(ort.InferenceSession(str(small)).run(None, {"input": x})[0])
    large_pred = ort.InferenceSession(str(large)).run(None, {"input": x})[0].argmax(1)
    rate, acc = _brute(conf, small_pred == truth, large_pred == truth, 0.02)
    assert out[0].startswith(f"200 samples: small top-1 {np.mean(small_pred == truth):.1%}, large top-1 90.0%, ")
    assert f"cascade top-1 {acc:.1%}" in out[0]
    assert out[1].endswith(f": {rate:.1%} of requests escalate to large")
    assert out[3:5] == ["[models.digits.route]", 'members = ["small", "large"]']
    assert 0 < rate < 1  # the small model is not always enough, nor never
