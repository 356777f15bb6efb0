"""Weight sharing: each weight tensor's values replaced by the nearest of ``k`` shared values.

A k-means codebook per Conv/Gemm/MatMul weight tensor (1-D Lloyd iterations from quantile
starts: deterministic). Where the format stores it as such (Core ML palettization, the apple
target's ``palettized-4bit``/``6bit`` precisions) the download shrinks by the index width; for
other formats the model written here holds the DE-QUANTISED weights (the same floats, so it runs
everywhere and is validated as it will behave), and the report states what codebook + indices
would take: ``k`` float32 values plus ``ceil(log2 k)`` bits per weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.compress.prune import constants_to_initializers, weight_initializers
from edgekit.errors import ConfigError, UnsupportedOpError


@dataclass(frozen=True)
class ShareReport:
    clusters: int
    tensors: int
    weights: int
    float_bytes: int  # the shared tensors as float32
    codebook_bytes: int  # codebooks + packed indices of the same tensors
    other_bytes: int  # every other initializer, unchanged

    @property
    def size_ratio(self) -> float:
        """(codebook form of the whole model) / (float32 form of the whole model)."""
        return (self.codebook_bytes + self.other_bytes) / max(self.float_bytes + self.other_bytes, 1)


def kmeans_1d(values: np.ndarray, k: int, iterations: int = 30) -> tuple[np.ndarray, np.ndarray]:
    """(centroids [k], index of each value's centroid); deterministic."""
    flat = values.astype(np.float64).ravel()
    distinct = np.unique(flat)
    if distinct.size <= k:
        centroids = distinct
    else:
        centroids = np.quantile(flat, (np.arange(k) + 0.5) / k)
        for _ in range(iterations):
            edges = (centroids[1:] + centroids[:-1]) / 2
            idx = np.searchsorted(edges, flat)
            sums = np.bincount(idx, weights=flat, minlength=k)
            counts = np.bincount(idx, minlength=k)
            moved = np.where(counts > 0, sums / np.maximum(counts, 1), centroids)
            moved.sort()
            if np.allclose(moved, centroids):
                break
            centroids = moved
    edges = (centroids[1:] + centroids[:-1]) / 2
    return centroids, np.searchsorted(edges, flat)


def share_weights(source: Path, out: Path, clusters: int) -> ShareReport:
    """Write ``out`` with every Conv/Gemm/MatMul weight tensor snapped to ``clusters`` shared values."""
    import onnx
    from onnx import numpy_helper

    if clusters < 2 or clusters > 65536:
        raise ConfigError(
            f"--share-weights {clusters}: give the number of shared values per tensor, 2..65536 (e.g. 16)"
        )
    model = onnx.load(str(source))
    constants_to_initializers(model)
    targets = weight_initializers(model)
    if not targets:
        raise UnsupportedOpError("the model has no Conv/Gemm/MatMul weight initializers to share")
    bits = max(1, math.ceil(math.log2(clusters)))
    tensors = weights = float_bytes = codebook_bytes = other_bytes = 0
    for init in model.graph.initializer:
        array = numpy_helper.to_array(init)
        if init.name not in targets or not np.issubdtype(array.dtype, np.floating):
            other_bytes += array.nbytes
            continue
        centroids, index = kmeans_1d(array, clusters)
        shared = centroids[index].reshape(array.shape).astype(array.dtype)
        init.CopyFrom(numpy_helper.from_array(shared, init.name))
        tensors += 1
        weights += array.size
        float_bytes += array.size * 4
        codebook_bytes += len(centroids) * 4 + math.ceil(array.size * bits / 8)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return ShareReport(clusters, tensors, weights, float_bytes, codebook_bytes, other_bytes)


__all__ = ["ShareReport", "kmeans_1d", "share_weights"]
