"""The data a packaging run gates on: calibration and evaluation arrays read and checked, labels,
the held-out split, and the ``--compress`` steps that run on the model before it is packaged."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import CompressionStep, Signature, Tolerance
from edgekit.errors import CalibrationDataError, ConfigError
from edgekit.package_checks import shape_flags
from edgekit.validate.calib import (
    ArraysLike,
    check_arrays,
    fixed_batch,
    load_data,
    load_labels,
    pop_labels,
    sample_count,
    split_holdout,
)
from edgekit.validate.preprocess import Preprocess, image_files


def load_calib_and_eval(
    served: Signature,
    calib: ArraysLike,
    eval_data: ArraysLike | None,
    labels: Any,
    input_shapes: Mapping[str, Sequence[int]] | None,
    say: Callable[[str], None],
    preprocess: Preprocess | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray | None]:
    """Checked calibration and evaluation arrays, and the evaluation labels (``labels``, else a
    ``labels`` array inside the evaluation data). ``eval_data is calib``: the same data does both
    (fp32/fp16 without calibration), nothing is held out.

    Calibration and evaluation files are read the same way (``load_data`` + ``pop_labels``): a
    ``labels`` array (``edgekit calib make --labels-from-folders``) is the samples' classes in
    either. In the calibration data it labels the samples held out for validation when no
    ``--eval`` is given, and is not needed (said so) when ``--eval`` is."""
    check_against = _with_static_inputs(served, input_shapes) if input_shapes else served
    set_by = shape_flags(served, input_shapes)
    same = eval_data is calib
    calib_raw = load_data(calib, served, "evaluation data" if same else "calibration data", preprocess)
    inline = pop_labels(calib_raw, served)
    if inline is not None and eval_data is not None and not same:
        say("calibration data: its 'labels' array is not used (the evaluation data, --eval, is what is gated)")
    calib_arrays = check_arrays(calib_raw, check_against, "calibration data", set_by)
    if same:
        eval_arrays = calib_arrays
        eval_labels = _labels(labels, inline, sample_count(eval_arrays))
    elif eval_data is not None:
        eval_raw = load_data(eval_data, served, "evaluation data", preprocess)
        inline = pop_labels(eval_raw, served)
        eval_arrays = check_arrays(eval_raw, check_against, "evaluation data", set_by)
        eval_labels = _labels(labels, inline, sample_count(eval_arrays))
    else:
        all_labels = _labels(labels, inline, sample_count(calib_arrays), "calibration data")
        calib_arrays, eval_arrays, eval_labels = split_holdout(calib_arrays, all_labels)
        say(
            f"no evaluation data given: holding out {sample_count(eval_arrays)} of "
            f"{sample_count(eval_arrays) + sample_count(calib_arrays)} calibration samples for validation"
        )
    batch = fixed_batch(served)
    for what, arrays in (("calibration data", calib_arrays), ("evaluation data", eval_arrays)):
        if batch and sample_count(arrays) % batch:
            raise CalibrationDataError(
                f"{what}: {sample_count(arrays)} samples is not a multiple of the model's fixed batch {batch}"
            )
    return calib_arrays, eval_arrays, eval_labels


def _labels(given: Any, inline: np.ndarray | None, count: int, what: str = "evaluation data") -> np.ndarray | None:
    if given is not None and inline is not None:
        raise CalibrationDataError(f"{what} holds a 'labels' array and --labels was given too; keep one of them")
    source = given if given is not None else inline
    return None if source is None else load_labels(source, count)


def _with_static_inputs(served: Signature, shapes: Mapping[str, Sequence[int]] | None) -> Signature:
    """``served`` with the given input shapes fixed (axis 0, the samples axis, stays as it was)."""
    shapes = shapes or {}
    inputs = []
    for spec in served.inputs:
        if spec.name in shapes and len(shapes[spec.name]) == len(spec.shape):
            dims = (spec.shape[0], *(int(d) for d in shapes[spec.name][1:]))
            spec = dataclasses.replace(spec, shape=dims)
        inputs.append(spec)
    return dataclasses.replace(served, inputs=tuple(inputs))


def compress_first(
    model: Path,
    steps: Sequence[str],
    work: Path,
    calib: ArraysLike | None,
    eval: ArraysLike | None,
    labels: str | Path | np.ndarray | Sequence[int] | None,
    train: ArraysLike | None,
    train_labels: str | Path | np.ndarray | Sequence[int] | None,
    say: Callable[[str], None],
    objective: str = "latency",
    tolerance: Tolerance | None = None,
    agreement_given: bool = False,
) -> tuple[Path, tuple[CompressionStep, ...]]:
    """Run the ``--compress`` steps on ``model``; (the compressed model, its provenance).
    ``--compress auto``: the variant that beats the quantized original, or the original
    (``edgekit.compress.auto``). Labels (``labels``, else a ``labels`` array in ``eval``) make a
    classifier's steps judged by top-1 accuracy against the original's (``compressed_gate``;
    ``agreement_given``: the user set ``min_top1_agreement``, which then gates too)."""
    from edgekit.compress.auto import is_auto
    from edgekit.compress.steps import Data, compress, parse_step
    from edgekit.validate.calib import load_arrays, load_labels, sample_count

    auto = is_auto(steps)
    parsed = [] if auto else [parse_step(s) for s in steps]
    source = eval if eval is not None else calib
    if source is None or (isinstance(source, (str, Path)) and Path(source).is_dir()):
        raise CalibrationDataError(
            "--compress measures every step against the original on data: give --eval (or --calib) as an .npz"
        )
    evaluation = load_arrays(source, "--eval data" if eval is not None else "--calib data")
    inline = evaluation.pop("labels", None)
    eval_labels = None
    if eval is not None and (labels is not None or inline is not None):
        given, what = (labels, "--labels") if labels is not None else (inline, "--eval data's labels")
        eval_labels = load_labels(given, sample_count(evaluation), what)
    training = None if train is None else load_arrays(train, "--train data")
    train_y = None
    if train_labels is not None and training is not None:
        train_y = load_labels(train_labels, sample_count(training), "--train-labels")
    if auto:
        from edgekit.compress.auto import choose

        usable = calib is not None and not (isinstance(calib, (str, Path)) and Path(calib).is_dir())
        calib_arrays = load_arrays(calib, "--calib data") if usable else dict(evaluation)  # type: ignore[arg-type]
        calib_arrays.pop("labels", None)
        data = Data(evaluation, eval_labels, training, train_y)
        chosen = choose(
            model, work / "auto", data, calib_arrays, objective=objective, tolerance=tolerance,
            agreement_given=agreement_given, progress=say,
        )  # fmt: skip
        return chosen.model, chosen.provenance
    out = work / "compressed" / f"{model.stem}.onnx"
    result = compress(
        model, parsed, out, Data(evaluation, eval_labels, training, train_y), tolerance=tolerance,
        agreement_given=agreement_given, progress=say,
    )  # fmt: skip
    for o in result.outcomes:
        say(f"{o.step}: {o.size_bytes:,} bytes, {o.speedup:.2f}x the original's speed here, {o.comparison.summary()}")
    return out, tuple(o.provenance for o in result.outcomes)


def check_same_interface(original: Path, served: Signature) -> None:
    import onnx

    from edgekit.compress.signature import served_signature

    want = served_signature(onnx.load(str(original), load_external_data=False))
    names = ([s.name for s in want.inputs], [s.name for s in want.outputs])
    got = ([s.name for s in served.inputs], [s.name for s in served.outputs])
    if names != got:
        raise ConfigError(
            f"--reference {original.name} has inputs {names[0]} and outputs {names[1]}; the model has {got[0]} and "
            f"{got[1]}: the reference must be the model this one was compressed from"
        )


def first_image(source: ArraysLike | None) -> Path | None:
    """The first image file of a folder or glob of images, else None."""
    if source is None or isinstance(source, Mapping):
        return None
    files = image_files(source)
    return files[0] if files else None


def check_static_fit(target: str, arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Evaluation samples must have the static shape a static artifact takes (axis 0 aside)."""
    for name, shape in shapes.items():
        got = tuple(arrays[name].shape[1:])
        if got != tuple(shape[1:]):
            raise ConfigError(
                f"evaluation data: input {name!r} has samples of shape {list(got)}, but the {target} artifact takes "
                f"the static shape {list(shape)} (from --input-shape, else the calibration data); give --eval data "
                f"of shape [N, {', '.join(map(str, shape[1:]))}] or --input-shape {name}=... matching both"
            )
