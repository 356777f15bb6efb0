"""Low-rank factorisation of Linear and Conv layers by truncated SVD.

A Linear layer ``W [out, in]`` becomes two: ``in -> r`` and ``r -> out`` (``W ~ U_r S_r V_r^T``,
the singular values split evenly between the two). A ``k x k`` convolution becomes a ``k x k``
convolution to ``r`` channels (same stride, padding, dilation) followed by a pointwise one to the
original output channels. The rank is chosen per layer from the fraction of parameters to keep
(``--low-rank 0.5``) or the fraction of spectral energy to keep (``--low-rank energy=0.95``).

A layer is factorised only where it pays: fewer parameters, and measured faster with ONNX Runtime
on the layer's real input shape (the two forms timed side by side). Grouped and depthwise
convolutions are left alone (already cheap; SVD across groups would mix them).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import ConfigError


@dataclass(frozen=True)
class LayerDecision:
    layer: str
    shape: str  # e.g. "Conv 64->128 3x3" / "Linear 2048->256"
    rank: int
    params_before: int
    params_after: int
    ms_before: float | None
    ms_after: float | None
    factorised: bool
    reason: str


@dataclass(frozen=True)
class LowRankSpec:
    keep_params: float | None = None  # fraction of each layer's parameters to keep
    keep_energy: float | None = None  # fraction of the squared singular values to keep

    @classmethod
    def parse(cls, text: str) -> LowRankSpec:
        try:
            if text.startswith("energy="):
                value = float(text.split("=", 1)[1])
                spec = cls(keep_energy=value)
            else:
                value = float(text)
                spec = cls(keep_params=value)
        except ValueError:
            raise ConfigError(
                f"--low-rank {text!r}: give the fraction of parameters to keep (e.g. 0.5) or energy=0.95"
            ) from None
        if not 0.0 < value < 1.0:
            raise ConfigError(f"--low-rank {text!r}: the fraction must be between 0 and 1")
        return spec

    def rank(self, singular: np.ndarray, rows: int, cols: int) -> int:
        if self.keep_energy is not None:
            energy = np.cumsum(singular**2) / max(float(np.sum(singular**2)), 1e-30)
            return int(np.searchsorted(energy, self.keep_energy) + 1)
        return int((self.keep_params or 0.5) * rows * cols / (rows + cols))


def _layer_input_shapes(module: Any, example: tuple[Any, ...], layers: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    import torch

    shapes: dict[str, tuple[int, ...]] = {}

    def recorder(name: str) -> Any:
        def hook(_module: Any, inputs: Any, _output: Any) -> None:  # returns None: the output stays as it is
            shapes.setdefault(name, tuple(inputs[0].shape))

        return hook

    hooks = [layer.register_forward_hook(recorder(name)) for name, layer in layers.items()]
    try:
        with torch.no_grad():
            module(*example)
    finally:
        for h in hooks:
            h.remove()
    return shapes


def _factorise(layer: Any, rank: int) -> Any:
    import torch

    w = layer.weight.detach().to(torch.float64)
    rows = w.shape[0]
    u, s, vt = torch.linalg.svd(w.reshape(rows, -1), full_matrices=False)
    root = torch.sqrt(s[:rank])
    first_w = (root[:, None] * vt[:rank]).to(torch.float32)
    second_w = (u[:, :rank] * root[None, :]).to(torch.float32)
    bias = layer.bias is not None
    first: Any
    second: Any
    if isinstance(layer, torch.nn.Linear):
        first = torch.nn.Linear(layer.in_features, rank, bias=False)
        second = torch.nn.Linear(rank, layer.out_features, bias=bias)
        first.weight.data.copy_(first_w)
        second.weight.data.copy_(second_w)
    else:
        first = torch.nn.Conv2d(
            layer.in_channels,
            rank,
            layer.kernel_size,
            stride=layer.stride,
            padding=layer.padding,
            dilation=layer.dilation,
            bias=False,
            padding_mode=layer.padding_mode,
        )
        second = torch.nn.Conv2d(rank, layer.out_channels, 1, bias=bias)
        first.weight.data.copy_(first_w.reshape(rank, *layer.weight.shape[1:]))
        second.weight.data.copy_(second_w.reshape(layer.out_channels, rank, 1, 1))
    if bias:
        second.bias.data.copy_(layer.bias.detach())
    return torch.nn.Sequential(first, second)


def _time_pair(before: Any, after: Any, shape: tuple[int, ...]) -> tuple[float, float]:
    """ONNX Runtime milliseconds per call of the two layer forms, side by side."""
    import onnxruntime as ort
    import torch

    from edgekit.validate.latency import stats_side_by_side

    x = torch.zeros(shape)
    with tempfile.TemporaryDirectory(prefix="edgekit-lowrank-") as tmp:
        fns = {}
        for key, layer in (("before", before), ("after", after)):
            path = Path(tmp) / f"{key}.onnx"
            with torch.no_grad():
                torch.onnx.export(layer.eval(), (x,), str(path), input_names=["x"], opset_version=17, dynamo=False)
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            feed = {"x": x.numpy()}
            fns[key] = lambda s=session, f=feed: s.run(None, f)
        stats = stats_side_by_side(fns, repeats=9, warmup=3, budget_s=1.5, block=5)
    return stats["before"].p50_ms, stats["after"].p50_ms


def factorise(module: Any, example: tuple[Any, ...], spec: LowRankSpec, *, measure: bool = True) -> list[LayerDecision]:
    """Replace the layers of ``module`` that pay for it, in place; one decision per candidate layer."""
    import torch

    layers = {
        name: m
        for name, m in module.named_modules()
        if isinstance(m, torch.nn.Linear) or (isinstance(m, torch.nn.Conv2d) and m.groups == 1)
    }
    shapes = _layer_input_shapes(module, example, layers)
    decisions: list[LayerDecision] = []
    for name, layer in layers.items():
        if name not in shapes:
            continue
        w = layer.weight.detach()
        rows, cols = int(w.shape[0]), int(w[0].numel())
        before = int(w.numel())
        singular = torch.linalg.svdvals(w.reshape(rows, -1).to(torch.float64)).numpy()
        rank = min(spec.rank(singular, rows, cols), len(singular))
        after = rank * (rows + cols)
        kind = (
            f"Linear {cols}->{rows}"
            if isinstance(layer, torch.nn.Linear)
            else f"Conv {layer.in_channels}->{rows} {'x'.join(map(str, layer.kernel_size))}"
        )
        if rank < 1 or after >= before:
            decisions.append(
                LayerDecision(name, kind, rank, before, before, None, None, False, "no fewer parameters at this rank")
            )
            continue
        replacement = _factorise(layer, rank)
        ms_before = ms_after = None
        if measure:
            ms_before, ms_after = _time_pair(layer, replacement, shapes[name])
            if ms_after >= ms_before:
                decisions.append(
                    LayerDecision(
                        name, kind, rank, before, before, ms_before, ms_after, False, "measured no faster here"
                    )
                )
                continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, replacement)
        decisions.append(LayerDecision(name, kind, rank, before, after, ms_before, ms_after, True, "factorised"))
    return decisions


__all__ = ["LayerDecision", "LowRankSpec", "factorise"]
