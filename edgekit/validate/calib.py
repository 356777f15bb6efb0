"""Calibration and evaluation data: load ``.npz`` / ``.npy`` files, folders or globs of images
(``edgekit.validate.preprocess``) or dicts, check them against the served signature, split a
held-out evaluation part off the calibration data, and iterate samples. ``write_npz`` writes a
reproducible ``.npz`` (same arrays, same bytes: ``edgekit calib make``).

Arrays hold one entry per input name with samples on axis 0, in the model input's rank: a model
input ``[batch, 3, 32, 32]`` takes ``(N, 3, 32, 32)``. Errors quote the bad value.
"""

from __future__ import annotations

import hashlib
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import CalibrationData, Signature, TensorSpec
from edgekit.errors import CalibrationDataError
from edgekit.validate.preprocess import Preprocess, image_files

ArraysLike = str | Path | Mapping[str, Any]
LABELS_KEY = "labels"  # an evaluation .npz may hold the class index of each sample under this name


def load_data(
    source: ArraysLike,
    served: Signature,
    what: str = "calibration data",
    preprocess: Preprocess | None = None,
) -> dict[str, np.ndarray]:
    """Arrays for ``served``'s inputs from an ``.npz``, an ``.npy`` (one-input models), a folder or
    glob of images (one-input models, read with ``preprocess``) or a mapping. Not yet checked:
    pass the result to ``check_arrays``."""
    if isinstance(source, Mapping):
        return load_arrays(source, what)
    files = image_files(source)
    if files is not None:
        spec = _only_input(served, what, f"{source} (images)")
        if not files:
            raise CalibrationDataError(f"{what} {source}: no image files found ({', '.join(_SUFFIX_HINT)}, ...)")
        return {spec.name: (preprocess or Preprocess()).apply(files, spec)}
    path = Path(source)
    if path.suffix.lower() == ".npy" and path.is_file():
        spec = _only_input(served, what, str(path))
        try:
            return {spec.name: np.load(path, allow_pickle=False)}
        except (ValueError, OSError, EOFError) as exc:
            raise CalibrationDataError(f"{what} {path} is not a readable .npy file ({exc})") from exc
    # an .npz holds model inputs already: a --preprocess given with it is for the agent's image requests
    return load_arrays(path, what)


_SUFFIX_HINT = (".png", ".jpg", ".bmp")


def _only_input(served: Signature, what: str, source: str) -> TensorSpec:
    if len(served.inputs) != 1:
        raise CalibrationDataError(
            f"{what} {source} feeds one input, but the model has {len(served.inputs)} "
            f"({', '.join(s.name for s in served.inputs)}); give an .npz with one array per input name"
        )
    return served.inputs[0]


def pop_labels(arrays: dict[str, np.ndarray], served: Signature) -> np.ndarray | None:
    """Remove and return a ``labels`` array (not a model input) from loaded evaluation arrays."""
    if LABELS_KEY in arrays and LABELS_KEY not in {s.name for s in served.inputs}:
        return arrays.pop(LABELS_KEY)
    return None


def write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> str:
    """Write ``arrays`` as an ``.npz`` that ``np.load`` reads, byte for byte the same for the same
    arrays (fixed member times, sorted names, no compression); returns its sha256."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arrays[name]), allow_pickle=False)
    tmp.replace(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over the arrays in name order: each name, dtype, shape, then the C-order bytes."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def data_manifest_fields(
    calib: Mapping[str, np.ndarray], source: ArraysLike, served: Signature, preprocess: Preprocess | None
) -> dict[str, Any]:
    """Manifest fields that the data decides: ``calibration`` (identity of the arrays calibration
    used) and, for images read with ``preprocess``, the ``preprocess`` steps a client must apply."""
    given = "arrays" if isinstance(source, Mapping) else str(source)
    fields: dict[str, Any] = {
        "calibration": CalibrationData(sha256=arrays_sha256(calib), samples=sample_count(calib), source=given)
    }
    if not isinstance(source, Mapping) and image_files(source) is not None:
        fields["preprocess"] = (preprocess or Preprocess()).to_steps(served.inputs[0])
    return fields


def folder_labels(files: list[Path], root: Path) -> tuple[np.ndarray, list[str]]:
    """Class index per file from its first folder under ``root`` (sorted folder names = classes)."""
    classes = []
    for f in files:
        rel = f.relative_to(root)
        if len(rel.parts) < 2:
            raise CalibrationDataError(
                f"{f}: labels from folders need every image in a class folder (ROOT/CLASS/IMAGE); this one is not"
            )
        classes.append(rel.parts[0])
    names = sorted(set(classes))
    index = {n: i for i, n in enumerate(names)}
    return np.asarray([index[c] for c in classes], dtype=np.int64), names


def load_arrays(source: ArraysLike, what: str = "calibration data") -> dict[str, np.ndarray]:
    """Arrays from an ``.npz`` path or a mapping name -> array-like."""
    if isinstance(source, Mapping):
        return {str(k): np.asarray(v) for k, v in source.items()}
    path = Path(source)
    if not path.is_file():
        raise CalibrationDataError(f"{what} {path} does not exist")
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):  # an .npy: one bare array, no input name
            raise CalibrationDataError(
                f"{what} {path} holds a single array without an input name; save one array per input "
                "name with np.savez(PATH, INPUT_NAME=array) (package takes an .npy for a one-input model)"
            )
        with data:
            return {k: data[k] for k in data.files}
    except (ValueError, OSError, EOFError) as exc:
        raise CalibrationDataError(f"{what} {path} is not a readable .npz file ({exc})") from exc


def load_labels(source: str | Path | Any, count: int, what: str = "labels") -> np.ndarray:
    """Integer class labels, one per evaluation sample."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            labels = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise CalibrationDataError(f"{what} {path} is not a readable .npy file ({exc})") from exc
    else:
        labels = np.asarray(source)
    if hasattr(labels, "files"):  # an .npz was given
        raise CalibrationDataError(f"{what}: expected one integer array (.npy), got an .npz archive")
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise CalibrationDataError(
            f"{what}: expected a 1-D integer array of class indices, got {labels.dtype} {list(labels.shape)}"
        )
    if len(labels) != count:
        raise CalibrationDataError(f"{what}: {len(labels)} labels for {count} evaluation samples; give one per sample")
    return labels.astype(np.int64)


def check_arrays(
    arrays: Mapping[str, np.ndarray],
    served: Signature,
    what: str = "calibration data",
    set_by: Mapping[str, tuple[str, TensorSpec]] | None = None,
) -> dict[str, np.ndarray]:
    """Check names, ranks, fixed dims and dtypes against the served inputs; same-kind dtypes
    (float64 for float32) are converted, others refused. Returns the arrays to use.

    ``set_by``: input name -> (the flag that fixed its dims, the model's own spec), so that a
    mismatch on a dim the flag set blames the flag, not the model."""
    expected = {s.name: s for s in served.inputs}
    unknown = sorted(set(arrays) - set(expected))
    if unknown:
        raise CalibrationDataError(f"{what}: array {unknown[0]!r} is not a model input (inputs: {', '.join(expected)})")
    missing = [n for n in expected if n not in arrays]
    if missing:
        raise CalibrationDataError(
            f"{what}: no array for input {missing[0]!r} (given: {', '.join(sorted(arrays)) or 'none'})"
        )
    out = {}
    counts = {}
    for name, spec in expected.items():
        arr = np.asarray(arrays[name])
        out[name] = _check_one(arr, spec, what, (set_by or {}).get(name))
        counts[name] = arr.shape[0]
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise CalibrationDataError(f"{what}: inputs have different sample counts ({listing})")
    return out


def _check_one(
    arr: np.ndarray, spec: TensorSpec, what: str, set_by: tuple[str, TensorSpec] | None = None
) -> np.ndarray:
    want = np.dtype(spec.dtype)
    expected_shape = "[" + ", ".join("N" if i == 0 else str(d) for i, d in enumerate(spec.shape)) + "]"
    if arr.ndim != len(spec.shape) or arr.ndim == 0:
        raise CalibrationDataError(
            f"{what}: input {spec.name!r} has shape {list(arr.shape)}, expected {expected_shape} "
            f"(samples on axis 0, in the model input's rank {len(spec.shape)})"
        )
    if arr.shape[0] < 1:
        raise CalibrationDataError(f"{what}: input {spec.name!r} has no samples (shape {list(arr.shape)})")
    for axis, (got, dim) in enumerate(zip(arr.shape, spec.shape, strict=True)):
        if axis > 0 and isinstance(dim, int) and got != dim:
            by_flag = set_by is not None and not isinstance(set_by[1].shape[axis], int)
            who = f"{set_by[0]} sets it to" if by_flag and set_by is not None else "the model fixes it to"
            raise CalibrationDataError(
                f"{what}: input {spec.name!r} has shape {list(arr.shape)}, expected {expected_shape} "
                f"(axis {axis} is {got}, {who} {dim})"
            )
    if arr.dtype != want:
        if arr.dtype.kind != want.kind:
            raise CalibrationDataError(
                f"{what}: input {spec.name!r} is {arr.dtype}, expected {spec.dtype}; "
                f"convert it with .astype(np.{spec.dtype})"
            )
        arr = arr.astype(want)
    return arr


def sample_count(arrays: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(arrays.values())).shape[0])


def split_holdout(
    arrays: Mapping[str, np.ndarray], labels: np.ndarray | None = None, every: int = 5
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray | None]:
    """Hold out every ``every``-th sample (at least one) for evaluation when no ``--eval`` is
    given. Deterministic, spread over the whole set. Returns (calib, eval, eval labels)."""
    n = sample_count(arrays)
    if n < 2:
        raise CalibrationDataError(
            f"calibration data has {n} sample; give at least 2 (one is held out for validation) or pass --eval"
        )
    held = np.arange(every - 1, n, every) if n >= every else np.array([n - 1])
    keep = np.setdiff1d(np.arange(n), held)
    calib = {k: v[keep] for k, v in arrays.items()}
    ev = {k: v[held] for k, v in arrays.items()}
    return calib, ev, (labels[held] if labels is not None else None)


def take(arrays: Mapping[str, np.ndarray], start: int, stop: int) -> dict[str, np.ndarray]:
    return {k: v[start:stop] for k, v in arrays.items()}


def pad_samples(arrays: Mapping[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    """``arrays`` with at least ``count`` samples, the last sample repeated: a feed for a model
    whose batch is fixed (callers drop the padding's outputs)."""
    n = sample_count(arrays)
    if n >= count:
        return dict(arrays)
    return {k: np.concatenate([v, np.repeat(v[-1:], count - n, axis=0)]) for k, v in arrays.items()}


def iter_batches(arrays: Mapping[str, np.ndarray], batch: int = 1) -> Iterator[dict[str, np.ndarray]]:
    """Feeds of ``batch`` samples each (the last one may be shorter)."""
    n = sample_count(arrays)
    for start in range(0, n, batch):
        yield take(arrays, start, min(start + batch, n))


def fixed_batch(served: Signature) -> int | None:
    """The batch size the model fixes on axis 0 of its first input, or ``None`` if dynamic."""
    d = served.inputs[0].shape[0] if served.inputs[0].shape else 1
    return d if isinstance(d, int) else None


def even_batch(n: int, most: int = 16) -> int:
    """The largest batch of at most ``most`` that splits ``n`` calibration samples into equal
    calls: ORT's entropy/percentile calibrators stack the per-call outputs and raise
    ("inhomogeneous shape") on a short last batch (43 samples in calls of 16 did)."""
    return next(b for b in range(min(most, max(n, 1)), 0, -1) if n % b == 0 or n == 0)
