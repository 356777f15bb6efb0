"""Packaging the embedded example twice gives the same validation numbers on every target.

Accuracy, agreement, cosine and error are the same to the last bit for the same recipe (latency
is excluded: it is measured). cpu, intel and coral choose their recipe by measured latency, so when
two recipes are within noise of each other two runs may ship different ones; then every
candidate both runs built must have the same accuracy numbers in the two candidate reports.
Artifacts are byte-identical where the toolchain allows it; where it does not, the
reason is the toolchain's own and is stated here:

- intel: OpenVINO names the nodes it creates from a process-wide counter (``Constant_54609`` in
  one run, ``Constant_129124`` in the next), so ``model.xml`` differs by names only; ``model.bin``
  (the weights) is byte-identical.
- coral: the TensorFlow graph onnx2tf builds is named from TensorFlow's own per-process counters
  and the names end up in the ``.tflite`` flatbuffer, so its size differs by a few bytes.
- apple: coremltools writes a fresh UUID per item into ``model.mlpackage/Manifest.json``; the
  model and its weights are byte-identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from edgekit.bundle.manifest import Manifest
from examples.digits import INPUT_NAME, load

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # five conversions, twice

TARGETS = ("cpu", "intel", "coral", "jetson", "apple")
PRECISION = {"*": "int8", "apple": "palettize4"}
NUMBERS = ("passed", "samples", "top1_agreement", "top1_accuracy", "cosine", "relative_error")
CHOSEN_BY_LATENCY = ("cpu", "intel", "coral")  # the engine may pick either of two recipes within noise
# files whose bytes differ between runs, and why (see the module docstring)
NOT_BYTE_IDENTICAL = {
    ("intel", "model.xml"): "OpenVINO's process-wide node-name counter",
    ("coral", "model.tflite"): "TensorFlow's per-process graph-name counters",
    ("apple", "model.mlpackage/Manifest.json"): "coremltools' random item UUIDs",
}


def _package(out: Path, key: Path) -> dict[str, Manifest]:
    import edgekit

    example = load()
    result = edgekit.package(
        example.model,
        targets=list(TARGETS),
        precision=PRECISION,
        calib=example.calib,
        eval={INPUT_NAME: example.eval_inputs},
        labels=example.eval_labels,
        key=key,
        name="digits",
        version=1,
        out_dir=out,
    )
    return dict(result.manifests)


def test_packaging_the_example_twice_gives_the_same_numbers_and_the_stated_bytes(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    first = _package(tmp_path / "a", keypair[0])
    second = _package(tmp_path / "b", keypair[0])
    assert sorted(first) == sorted(second) == sorted(TARGETS)
    for target in TARGETS:
        a, b = first[target], second[target]
        if target not in CHOSEN_BY_LATENCY:
            assert a.precision == b.precision, target
        if a.precision == b.precision:
            for field in NUMBERS:
                got_a, got_b = getattr(a.validation, field), getattr(b.validation, field)
                assert got_a == got_b, f"{target}: {field} {got_a} != {got_b}"
        else:  # two recipes within noise: the candidates' own numbers must still agree
            assert a.candidates is not None and b.candidates is not None, f"{target}: no candidate report"
            numbers_a = {c.id: (c.status != "error", c.top1_agreement, c.cosine) for c in a.candidates.candidates}
            numbers_b = {c.id: (c.status != "error", c.top1_agreement, c.cosine) for c in b.candidates.candidates}
            common = sorted(set(numbers_a) & set(numbers_b))
            assert common, target
            for cid in common:
                assert numbers_a[cid] == numbers_b[cid], f"{target}: candidate {cid}"
        files_a = {f.path: f.sha256 for f in a.files}
        files_b = {f.path: f.sha256 for f in b.files}
        assert sorted(files_a) == sorted(files_b), target
        for path, digest in files_a.items():
            if (target, path) in NOT_BYTE_IDENTICAL or a.precision != b.precision:
                continue
            assert digest == files_b[path], f"{target}: {path} differs between two runs"
