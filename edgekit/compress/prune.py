"""Pruning: structured (whole channels out, the model really shrinks) and unstructured (zeros).

Structured channel pruning uses Torch-Pruning (DepGraph): it traces which layers must shrink
together when one convolution loses output channels (the BatchNorm after it, the next layer's
input channels, both sides of a residual add or a concat, depthwise groups) and rewires them, so
the pruned model is a smaller dense model that runs faster on any runtime. Importance: L1 or L2
magnitude of each channel's weights, or first-order Taylor (|weight x gradient|, needs data; the
gradient comes from the distillation loss against the original model, so no labels are needed).
The layers that produce the model's outputs are never pruned: their channels are the outputs.

Unstructured magnitude pruning zeroes the smallest weights of each Conv/Gemm/MatMul weight
tensor in the ONNX graph to a target sparsity. Dense CPU runtimes do not run faster on it: what
it buys is a smaller compressed download (measured) and, for 2:4 sparsity, TensorRT's sparse
tensor cores on Ampere and later (not measured here: no GPU).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgekit.errors import ConfigError, UnsupportedOpError

Criterion = Literal["l1", "l2", "taylor"]
CRITERIA: tuple[Criterion, ...] = ("l1", "l2", "taylor")


@dataclass(frozen=True)
class PruneReport:
    criterion: str
    ratio: float
    params_before: int
    params_after: int
    macs_before: int
    macs_after: int
    kept_layers: tuple[str, ...]  # layers left whole, each "name (why)"


_WEIGHTED = ("Conv1d", "Conv2d", "Conv3d", "Linear", "ConvTranspose2d")


def fixed_layers(module: Any) -> dict[str, str]:
    """Layer name -> why its output channels must stay as they are: it produces a model output
    (its channels are the outputs), or its result reaches a Reshape to a constant shape (as
    exported graphs write flattens: ``[-1, 200]`` no longer fits once channels go), in both
    cases through weight-free ops only."""
    import torch

    weighted = tuple(getattr(torch.nn, n) for n in _WEIGHTED)
    names = {id(m): n for n, m in module.named_modules()}
    graph = getattr(module, "graph", None)
    if graph is None:  # not an fx graph: the last weighted layer is the classifier
        last = [m for m in module.modules() if isinstance(m, weighted)]
        return {names[id(m)]: "produces an output" for m in last[-1:]}
    modules = dict(module.named_modules())
    found: dict[str, str] = {}

    def walk(starts: list[Any], reason: str) -> None:
        seen: set[Any] = set()
        stack = list(starts)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if node.op == "call_module" and isinstance(modules.get(node.target), weighted):
                found.setdefault(str(node.target), reason)
                continue  # stop at the first weighted layer on this path
            stack.extend(node.all_input_nodes)

    walk([n for n in graph.nodes if n.op == "output"], "produces an output")
    for node in graph.nodes:
        reshape = node.op == "call_module" and type(modules.get(node.target)).__name__ == "OnnxReshape"
        if reshape and len(node.args) > 1 and getattr(node.args[1], "op", "") == "get_attr":
            walk([node.args[0]], "feeds a Reshape to a fixed shape")
    return found


def prune_channels(
    module: Any,
    example: tuple[Any, ...],
    ratio: float,
    *,
    criterion: Criterion = "l1",
    gradient_batches: list[tuple[tuple[Any, ...], Any]] | None = None,
) -> PruneReport:
    """Remove ``ratio`` of the prunable channels of ``module`` in place.

    ``gradient_batches`` ((inputs, teacher outputs) pairs) are required for ``taylor``."""
    import torch
    import torch.nn.functional as F
    import torch_pruning as tp

    if not 0.0 < ratio < 1.0:
        raise ConfigError(
            f"--prune-channels {ratio}: give the fraction of channels to remove, between 0 and 1 (e.g. 0.5)"
        )
    if criterion not in CRITERIA:
        raise ConfigError(f"pruning criterion {criterion!r}: choose one of {', '.join(CRITERIA)}")
    if criterion == "taylor" and not gradient_batches:
        raise ConfigError("taylor importance needs data: give --train (inputs; labels are not needed)")
    fixed = fixed_layers(module)
    keep = [module.get_submodule(name) for name in fixed]
    importance = {
        "l1": lambda: tp.importance.MagnitudeImportance(p=1),
        "l2": lambda: tp.importance.MagnitudeImportance(p=2),
        "taylor": lambda: tp.importance.TaylorImportance(),
    }[criterion]()
    macs_before, params_before = tp.utils.count_ops_and_params(module, example)
    try:
        pruner = tp.pruner.MagnitudePruner(
            module, example, importance=importance, pruning_ratio=ratio, ignored_layers=keep, global_pruning=False
        )
    except Exception as exc:  # DepGraph raises plain errors on graphs it cannot trace
        raise UnsupportedOpError(
            f"structured pruning cannot trace this model's channel dependencies ({type(exc).__name__}: {exc}); "
            "try --sparsity (unstructured) or --low-rank instead"
        ) from exc
    if criterion == "taylor":
        module.train()
        module.zero_grad()
        for xs, target in gradient_batches or []:
            out = module(*xs)
            out = out[0] if isinstance(out, tuple | list) else out
            loss: Any = F.mse_loss(out.float(), target.float())
            loss.backward()
    pruner.step()
    module.zero_grad(set_to_none=True)
    module.eval()
    with torch.no_grad():
        module(*example)  # the rewired graph still runs at the traced shape
    macs_after, params_after = tp.utils.count_ops_and_params(module, example)
    return PruneReport(
        criterion=criterion,
        ratio=ratio,
        params_before=int(params_before),
        params_after=int(params_after),
        macs_before=int(macs_before),
        macs_after=int(macs_after),
        kept_layers=tuple(f"{name} ({why})" for name, why in sorted(fixed.items())),
    )


@dataclass(frozen=True)
class SparsityReport:
    pattern: str  # "unstructured 0.80" or "2:4"
    tensors: int
    sparsity: float  # zeros / weights over the pruned tensors
    compressed_bytes_before: int
    compressed_bytes_after: int


def weight_initializers(model: Any) -> dict[str, int]:
    """Initializer name -> its reduction (input-channel) axis, for every Conv/ConvTranspose/Gemm/MatMul
    weight held as an initializer."""
    from onnx import helper

    names = {i.name for i in model.graph.initializer}
    found: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose", "Gemm", "MatMul") or len(node.input) < 2:
            continue
        if node.input[1] not in names:
            continue
        if node.op_type == "Gemm":
            trans_b = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "transB"), 0)
            found[node.input[1]] = 1 if trans_b else 0
        elif node.op_type == "MatMul":
            found[node.input[1]] = 0
        else:  # Conv [out, in/groups, ...]; ConvTranspose [in, out/groups, ...]
            found[node.input[1]] = 1 if node.op_type == "Conv" else 0
    return found


Pattern = float | Literal["2:4"]


def parse_pattern(text: str) -> Pattern:
    if text == "2:4":
        return "2:4"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value < 1.0:
        raise ConfigError(f"--sparsity {text}: give a fraction between 0 and 1 (e.g. 0.8) or 2:4")
    return value


def sparsity_mask(w: np.ndarray, pattern: Pattern, axis: int) -> np.ndarray:
    """Which weights to keep: all but the smallest-magnitude ``pattern`` fraction, or the 2 largest
    of every 4 consecutive weights along the reduction ``axis`` (TensorRT's 2:4 pattern)."""
    magnitude = np.abs(w)
    if pattern != "2:4":
        k = int(w.size * pattern)
        if not k:
            return np.ones(w.shape, dtype=bool)
        threshold = np.partition(magnitude.ravel(), k - 1)[k - 1]
        keep: np.ndarray = magnitude > threshold
        return keep
    moved = np.moveaxis(magnitude, axis, -1)
    n = moved.shape[-1]
    if n % 4:
        raise UnsupportedOpError(f"2:4 sparsity needs input channels divisible by 4; a weight has {n}")
    groups = moved.reshape(*moved.shape[:-1], n // 4, 4)
    order = np.argsort(groups, axis=-1)
    kept = np.ones(groups.shape, dtype=bool)
    np.put_along_axis(kept, order[..., :2], False, axis=-1)
    result: np.ndarray = np.moveaxis(kept.reshape(moved.shape), -1, axis)
    return result


def sparsify(source: Path, out: Path, pattern: Pattern) -> SparsityReport:
    """Zero the smallest-magnitude weights of every Conv/Gemm/MatMul weight tensor; write ``out``."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    targets = weight_initializers(model)
    if not targets:
        raise UnsupportedOpError("the model has no Conv/Gemm/MatMul weight initializers to sparsify")
    zeros = total = 0
    for init in model.graph.initializer:
        if init.name not in targets:
            continue
        w = numpy_helper.to_array(init)
        pruned = np.where(sparsity_mask(w, pattern, targets[init.name]), w, 0).astype(w.dtype)
        zeros += int(np.count_nonzero(pruned == 0))
        total += int(pruned.size)
        init.CopyFrom(numpy_helper.from_array(pruned, init.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return SparsityReport(
        pattern=describe_pattern(pattern),
        tensors=len(targets),
        sparsity=zeros / max(total, 1),
        compressed_bytes_before=compressed_size(source),
        compressed_bytes_after=compressed_size(out),
    )


def describe_pattern(pattern: Pattern) -> str:
    return "2:4" if pattern == "2:4" else f"unstructured {pattern:.2f}"


def sparsify_module(module: Any, pattern: Pattern) -> Any:
    """Zero ``module``'s Conv/Linear weights by ``pattern`` in place; returns the function that
    re-applies the masks (after every fine-tuning step, so pruned weights stay zero)."""
    import torch

    masks = []
    for layer in module.modules():
        if isinstance(layer, torch.nn.Conv1d | torch.nn.Conv2d | torch.nn.Conv3d | torch.nn.Linear):
            w = layer.weight.detach().cpu().numpy()
            mask = torch.from_numpy(sparsity_mask(w, pattern, 1)).to(layer.weight.dtype)
            masks.append((layer, mask))
    if not masks:
        raise UnsupportedOpError("the model has no Conv/Linear layers to sparsify")

    def apply() -> None:
        with torch.no_grad():
            for layer, mask in masks:
                layer.weight.mul_(mask)

    apply()
    return apply


def compressed_size(path: Path) -> int:
    """Bytes of the file after zlib (level 6): what a compressed download of it costs."""
    return len(zlib.compress(Path(path).read_bytes(), 6))


__all__ = [
    "CRITERIA",
    "PruneReport",
    "SparsityReport",
    "compressed_size",
    "fixed_layers",
    "parse_pattern",
    "prune_channels",
    "sparsify",
    "sparsify_module",
    "sparsity_mask",
]
