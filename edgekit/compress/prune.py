"""Pruning: structured (whole channels out, the model really shrinks) and unstructured (zeros).

Structured channel pruning uses Torch-Pruning (DepGraph): it traces which layers must shrink
together when one convolution loses output channels (the BatchNorm after it, the next layer's
input channels, both sides of a residual add or a concat, depthwise groups) and rewires them, so
the pruned model is a smaller dense model that runs faster on any runtime. Importance: L1 or L2
magnitude of each channel's weights, or first-order Taylor (|weight x gradient|, needs data; the
gradient comes from the distillation loss against the original model, so no labels are needed).
The layers that produce the model's outputs are never pruned: their channels are the outputs.

Per-layer ratios by measured sensitivity (when data is given): each prunable layer is pruned
alone, at the requested ratio, on a copy of the model, and the divergence of the copy's outputs
from the unpruned model's is measured on a batch of inputs (KL divergence of class scores, else
relative squared error). With ``d_l`` that divergence and ``c_l`` the multiply-adds per sample the
layer's cut removes (what latency follows; parameters would spare the early, high-resolution
layers where most of the compute is: 50 % of the digits example's parameters cut that way removed
16 % of its multiply-adds and ran 1.3x faster, a uniform cut 3.0x), and a divergence growing with
the square of a layer's ratio, the ratios that remove as much compute as a uniform cut at the
least total divergence are ``r_l = min(r_max, mu * c_l / d_l)`` (``mu`` found by bisection):
layers that cost much accuracy per multiply-add keep more channels, cheap ones give more (up to
``r_max``).

Mean compensation (when data is given): a channel with small weights may still carry a large
constant (a bias, or a BatchNorm folded into the convolution), which the next layers rely on as
part of their own bias; cutting it shifts every activation after it (PP-OCR's orientation
classifier answered one class for everything after 10 % of its channels went). After the cut,
each Conv/Linear layer's bias is moved, in execution order on one batch, so that the mean of each
of its kept output channels equals that channel's mean in the unpruned model (the bias
correction that post-training quantization uses for its rounding shift).

Channel multiples: every pruned layer keeps a multiple of ``CHANNEL_MULTIPLE`` channels (a layer
of fewer than 16 channels a multiple of 4, one of fewer than 8 any count). CPU runtimes block
channels for their SIMD width (ONNX Runtime's NCHWc layout, OpenVINO's blocked layouts), and a
layer whose channels fit no block takes a slower path: the digits example pruned by sensitivity
to 31/63/126 channels ran 1.4x slower than the unpruned model on ONNX Runtime (AVX-512).
Uniform 50 % cuts kept at multiples of 1, 4, 8 and 16 ran 2.9x, 3.0x, 3.1x and 3.0x faster; 25 %
cuts at multiples of 8 (24/48/96 channels) as fast as at 16, so 8, which keeps a 25 % cut of a
32-channel layer possible. Each layer's ratio is rounded to the nearest such count (at least one
multiple) before the cut, per layer, so a model with small squeeze-excitation layers still has
its wide layers rounded.

Unstructured magnitude pruning zeroes the smallest weights of each Conv/Gemm/MatMul weight
tensor in the ONNX graph to a target sparsity. Dense CPU runtimes do not run faster on it: what
it buys is a smaller compressed download (measured) and, for 2:4 sparsity, TensorRT's sparse
tensor cores on Ampere and later (not measured here: no GPU).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgekit.errors import ConfigError, UnsupportedOpError

Criterion = Literal["l1", "l2", "taylor"]
CRITERIA: tuple[Criterion, ...] = ("l1", "l2", "taylor")
CHANNEL_MULTIPLE = 8  # pruned layers keep a multiple of this many channels (the module doc)


@dataclass(frozen=True)
class PruneReport:
    criterion: str
    ratio: float
    params_before: int
    params_after: int
    macs_before: int
    macs_after: int
    kept_layers: tuple[str, ...]  # layers left whole, each "name (why)"
    layer_ratios: tuple[tuple[str, float], ...] = ()  # per-layer ratios by sensitivity; empty when uniform
    channel_multiple: int = 1  # pruned layers keep a multiple of this many channels (narrow ones: ``layer_multiple``)
    refitted_layers: int = 0  # layers refitted to the unpruned outputs by least squares (``reconstruct``)
    bias_moved_layers: int = 0  # layers whose bias alone was moved (too few values for their weights)


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


@dataclass(frozen=True)
class LayerSensitivity:
    layer: str
    macs_removed: int  # multiply-adds per sample removed by cutting this layer alone at the probe ratio
    divergence: float  # of the outputs from the unpruned model's, with this layer alone cut


def _importance(criterion: Criterion) -> Any:
    import torch_pruning as tp

    if criterion == "taylor":
        return tp.importance.TaylorImportance()
    return tp.importance.MagnitudeImportance(p=1 if criterion == "l1" else 2)


def _divergence(reference: Any, got: Any) -> float:
    """KL(reference || got) per sample for class scores (probabilities or logits), else the
    squared error relative to the reference's mean square."""
    import torch

    ref, out = reference.float(), got.float().reshape(reference.shape)
    if ref.ndim == 2 and ref.shape[1] > 1:
        probabilities = bool(ref.min() >= 0) and bool(torch.allclose(ref.sum(-1), torch.ones(len(ref)), atol=1e-3))
        lr = torch.log(ref.clamp_min(1e-8)) if probabilities else torch.log_softmax(ref, -1)
        lo = torch.log(out.clamp_min(1e-8)) if probabilities else torch.log_softmax(out, -1)
        return float((lr.exp() * (lr - lo)).sum(-1).mean())
    return float(((out - ref) ** 2).mean() / (ref**2).mean().clamp_min(1e-12))


def _first_output(out: Any) -> Any:
    return out[0] if isinstance(out, tuple | list) else out


def layer_sensitivity(
    module: Any, example: tuple[Any, ...], inputs: tuple[Any, ...], ratio: float, criterion: Criterion = "l1"
) -> list[LayerSensitivity]:
    """Each prunable layer cut alone at ``ratio`` on a copy of ``module``: what it removes and how far
    the outputs on ``inputs`` move from the unpruned model's."""
    import copy

    import torch
    import torch_pruning as tp

    fixed = fixed_layers(module)
    module.eval()
    with torch.no_grad():
        reference = _first_output(module(*inputs))
    graph = tp.DependencyGraph().build_dependency(module, example_inputs=example)
    names = {id(m): n for n, m in module.named_modules()}
    keep = [module.get_submodule(n) for n in fixed]
    roots = [
        names[id(group[0].dep.target.module)]
        for group in graph.get_all_groups(ignored_layers=keep, root_module_types=[torch.nn.Conv2d, torch.nn.Linear])
    ]
    total, _ = tp.utils.count_ops_and_params(module, example)
    found = []
    for name in dict.fromkeys(roots):
        trial = copy.deepcopy(module)
        pruner = tp.pruner.MagnitudePruner(
            trial,
            example,
            importance=_importance("l2" if criterion == "taylor" else criterion),
            pruning_ratio=0.0,
            pruning_ratio_dict={trial.get_submodule(name): ratio},
            ignored_layers=[trial.get_submodule(n) for n in fixed],
        )
        pruner.step()
        trial.eval()
        with torch.no_grad():
            moved = _divergence(reference, _first_output(trial(*inputs)))
        removed = total - tp.utils.count_ops_and_params(trial, example)[0]
        if removed > 0:
            found.append(LayerSensitivity(name, int(removed), moved))
    return found


def allocate(sensitivities: list[LayerSensitivity], ratio: float, max_ratio: float | None = None) -> dict[str, float]:
    """Per-layer ratios removing as many multiply-adds as ``ratio`` everywhere, at the least total
    divergence under a quadratic model (the module doc): ``r_l = min(r_max, mu * c_l / d_l)``."""
    if not sensitivities:
        return {}
    cap = max_ratio if max_ratio is not None else min(0.85, 1.75 * ratio)
    floor = max(max(s.divergence for s in sensitivities) * 1e-6, 1e-12)
    worth = {s.layer: s.macs_removed / max(s.divergence, floor) for s in sensitivities}
    goal = sum(s.macs_removed for s in sensitivities)  # what a uniform cut removes (at ratio)

    def removed(mu: float) -> float:
        return sum(s.macs_removed * min(cap, mu * worth[s.layer]) / ratio for s in sensitivities)

    low, high = 0.0, 1.0
    while removed(high) < goal and high < 1e30:
        high *= 4.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if removed(mid) < goal else (low, mid)
    return {s.layer: min(cap, high * worth[s.layer]) for s in sensitivities}


def _channels(layer: Any) -> int:
    return int(getattr(layer, "out_channels", 0) or getattr(layer, "out_features", 0) or 0)


def layer_multiple(channels: int) -> int:
    """The multiple a pruned layer of ``channels`` output channels keeps (the module doc)."""
    return CHANNEL_MULTIPLE if channels >= 2 * CHANNEL_MULTIPLE else 4 if channels >= 8 else 1


def _rounded_ratio(layer: Any, ratio: float) -> float:
    """``ratio`` moved so that the layer keeps the nearest multiple of its ``layer_multiple``
    channels (at least one multiple); a hair under the exact ratio, as Torch-Pruning keeps
    ``int(channels x (1 - ratio))``."""
    channels = _channels(layer)
    multiple = layer_multiple(channels)
    if multiple <= 1 or ratio <= 0.0:
        return ratio
    kept = max(multiple, round(channels * (1.0 - ratio) / multiple) * multiple)
    return max(0.0, (channels - kept) / channels - 1e-6)


def _weighted_layers(module: Any) -> dict[str, Any]:
    import torch

    return {
        n: m
        for n, m in module.named_modules()
        if isinstance(m, torch.nn.Conv1d | torch.nn.Conv2d | torch.nn.Conv3d | torch.nn.Linear)
    }


def _layer_outputs(module: Any, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """Each Conv/Linear layer's output on ``inputs``."""

    outputs: dict[str, Any] = {}

    def recorder(name: str, _layer: Any) -> Any:
        def hook(_m: Any, _inputs: Any, output: Any) -> None:  # returns None: the output stays as it is
            outputs.setdefault(name, output.detach().float())

        return hook

    _run_hooked(module, inputs, recorder)
    return outputs


def _run_hooked(module: Any, inputs: tuple[Any, ...], make_hook: Callable[..., Any]) -> None:
    """One forward pass of ``module`` on ``inputs`` with ``make_hook(name, layer)``'s forward hook on
    every Conv/Linear layer (removed after)."""
    import torch

    hooks = [m.register_forward_hook(make_hook(n, m)) for n, m in _weighted_layers(module).items()]
    try:
        module.eval()
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in hooks:
            h.remove()


def _refit(layer: Any, x: Any, target: Any) -> bool:
    """Least-squares weights and bias of ``layer`` (Conv2d or Linear) mapping its input ``x`` to
    ``target`` (ridge-regularised); False (nothing changed) where it cannot be posed or the data
    are too few for the unknowns."""
    import torch
    import torch.nn.functional as F

    if isinstance(layer, torch.nn.Linear):
        groups, cols = 1, x.reshape(-1, x.shape[-1])[None]  # [1, M, d]
        y = target.reshape(-1, target.shape[-1])[None]  # [1, M, out]
    elif isinstance(layer, torch.nn.Conv2d) and layer.padding_mode == "zeros" and not isinstance(layer.padding, str):
        groups = layer.groups
        n = x.shape[0]
        unfolded = F.unfold(x, layer.kernel_size, layer.dilation, layer.padding, layer.stride)  # [N, Cin*k*k, L]
        d = unfolded.shape[1] // groups
        cols = unfolded.reshape(n, groups, d, -1).permute(1, 0, 3, 2).reshape(groups, -1, d)
        y = (
            target.reshape(n, groups, target.shape[1] // groups, -1)
            .permute(1, 0, 3, 2)
            .reshape(groups, cols.shape[1], -1)
        )
    else:
        return False
    samples, unknowns = cols.shape[1], cols.shape[2] + 1
    if samples < 4 * unknowns:
        return False
    a = torch.cat([cols, torch.ones(*cols.shape[:2], 1)], dim=2).double()
    gram = a.transpose(1, 2) @ a
    ridge = 1e-4 * gram.diagonal(dim1=1, dim2=2).mean(1)[:, None, None] * torch.eye(unknowns, dtype=torch.float64)
    solved = torch.linalg.solve(gram + ridge, a.transpose(1, 2) @ y.double())  # [groups, d + 1, out_g]
    weight = solved[:, :-1, :].permute(0, 2, 1).reshape(layer.weight.shape[0], -1)
    layer.weight.copy_(weight.reshape(layer.weight.shape).to(layer.weight.dtype))
    bias = solved[:, -1, :].reshape(-1).to(layer.weight.dtype)
    if layer.bias is None:
        layer.bias = torch.nn.Parameter(bias)
    else:
        layer.bias.copy_(bias)
    return True


def _forward(layer: Any, x: Any) -> Any:
    """``layer``'s computation without its hooks (a hook calling the layer would call itself)."""
    import torch
    import torch.nn.functional as F

    if isinstance(layer, torch.nn.Linear):
        return F.linear(x, layer.weight, layer.bias)
    return layer._conv_forward(x, layer.weight, layer.bias)


def reconstruct(
    module: Any, inputs: tuple[Any, ...], originals: dict[str, Any], removed: dict[str, list[int]]
) -> tuple[int, int]:
    """Fit the pruned ``module``'s layers, in execution order on ``inputs``, to reproduce the unpruned
    model's outputs of their kept channels (``originals``: each layer's unpruned output;
    ``removed``: its cut output channels in the unpruned numbering): the weights by least squares
    where the batch holds enough values for them, else the bias alone (the means). The layers
    after each see its corrected output. (layers refitted, layers whose bias alone moved)."""
    import torch

    refitted = biased = 0

    def corrector(name: str, layer: Any) -> Any:
        linear = isinstance(layer, torch.nn.Linear)

        def hook(_m: Any, inputs_: Any, output: Any) -> Any:
            nonlocal refitted, biased
            want = originals.get(name)
            if want is None:
                return None
            axis = output.ndim - 1 if linear else 1
            cut = set(removed.get(name, ()))
            kept = torch.tensor([c for c in range(want.shape[axis]) if c not in cut], dtype=torch.long)
            if len(kept) != output.shape[axis] or tuple(want.shape[:axis]) != tuple(output.shape[:axis]):
                return None  # the channel bookkeeping does not match this layer: leave it
            target = want.index_select(axis, kept)
            if _refit(layer, inputs_[0].detach().float(), target):
                refitted += 1
                return _forward(layer, inputs_[0])
            if layer.bias is None:
                return None
            got = output.detach().float().transpose(0, axis).reshape(output.shape[axis], -1).mean(1)
            delta = (target.transpose(0, axis).reshape(output.shape[axis], -1).mean(1) - got).to(output.dtype)
            layer.bias.add_(delta)
            biased += 1
            shape = [1] * output.ndim
            shape[axis] = -1
            return output + delta.reshape(shape)

        return hook

    _run_hooked(module, inputs, corrector)
    return refitted, biased


def prune_channels(
    module: Any,
    example: tuple[Any, ...],
    ratio: float,
    *,
    criterion: Criterion = "l1",
    gradient_batches: list[tuple[tuple[Any, ...], Any]] | None = None,
    data: tuple[Any, ...] | None = None,
    by_sensitivity: bool = True,
) -> PruneReport:
    """Remove ``ratio`` of the prunable channels of ``module`` in place.

    ``gradient_batches`` ((inputs, teacher outputs) pairs) are required for ``taylor``.
    ``data``: a batch of inputs; with it the kept layers are refitted to the unpruned outputs
    (``reconstruct``) and, ``by_sensitivity``, the ratio is spread over the layers by each one's
    measured sensitivity (``allocate``: the same parameters removed, less divergence)."""
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
    macs_before, params_before = tp.utils.count_ops_and_params(module, example)
    ratios: dict[str, float] = {}
    try:
        if data is not None and by_sensitivity:
            ratios = allocate(layer_sensitivity(module, example, data, ratio, criterion), ratio)
        uniform = not ratios
        if uniform:
            ratios = {n: ratio for n in _weighted_layers(module) if n not in fixed}
        # every layer's kept count rounded here, per layer and at least one multiple (Torch-Pruning's
        # round_to is one multiple for all layers, and floors a kept count below it to zero channels)
        ratios = {n: _rounded_ratio(module.get_submodule(n), r) for n, r in ratios.items()}
        pruner = tp.pruner.MagnitudePruner(
            module,
            example,
            importance=_importance(criterion),
            pruning_ratio=0.0,
            pruning_ratio_dict={module.get_submodule(n): r for n, r in ratios.items()} or None,
            ignored_layers=keep,
            global_pruning=False,
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
    originals = None if data is None else _layer_outputs(module, data)
    names = {id(m): n for n, m in module.named_modules()}
    removed: dict[str, list[int]] = {}  # layer -> output channels cut, in the original numbering
    for group in pruner.step(interactive=True):
        for dep, idxs in group:
            if "out_channels" in getattr(dep.handler, "__name__", "") and id(dep.target.module) in names:
                removed.setdefault(names[id(dep.target.module)], []).extend(int(i) for i in idxs)
        group.prune()
    module.zero_grad(set_to_none=True)
    module.eval()
    refitted = (0, 0)
    if originals is not None and data is not None:
        refitted = reconstruct(module, data, originals, removed)
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
        layer_ratios=() if uniform else tuple(sorted(ratios.items())),
        channel_multiple=CHANNEL_MULTIPLE,
        refitted_layers=refitted[0],
        bias_moved_layers=refitted[1],
    )


@dataclass(frozen=True)
class SparsityReport:
    pattern: str  # "unstructured 0.80" or "2:4"
    tensors: int  # weight tensors sparsified
    sparsity: float  # zeros / weights over the sparsified tensors
    compressed_bytes_before: int
    compressed_bytes_after: int
    dense: int = 0  # weight tensors left dense (``sparse_eligible``)


def constants_to_initializers(model: Any) -> int:
    """Move the graph's tensor ``Constant`` nodes into initializers, in place (paddle2onnx writes
    every weight as a Constant node: the weight steps look for initializers); how many moved."""
    from edgekit.compress.onnx_nodes import constant_nodes

    moved = []
    for node, tensor in list(constant_nodes(model.graph)):
        tensor.name = node.output[0]
        model.graph.initializer.append(tensor)
        moved.append(node)
    for node in moved:
        model.graph.node.remove(node)
    return len(moved)


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


# a weight tensor smaller than this stays dense: few bytes to save, and the first convolution and
# small projections hold a share of the accuracy out of proportion with their size
SPARSE_MIN_WEIGHTS = 1024


def sparse_eligible(w: np.ndarray, pattern: Pattern, axis: int) -> bool:
    """Whether a weight tensor is sparsified: not a depthwise (one input channel per group)
    convolution, whose few weights per output channel each matter, nor under ``SPARSE_MIN_WEIGHTS``;
    for 2:4, a reduction axis divisible by 4. The same rule on the ONNX and the torch side."""
    if w.size < SPARSE_MIN_WEIGHTS or (w.ndim >= 3 and w.shape[1] == 1):
        return False
    return pattern != "2:4" or w.shape[axis] % 4 == 0


def sparsity_masks(weights: list[tuple[np.ndarray, int]], pattern: Pattern) -> list[np.ndarray | None]:
    """Per (weight, reduction axis): the keep-mask, or None for a tensor left dense. Unstructured:
    one threshold over every eligible tensor together on magnitudes relative to their tensor's RMS
    (a layer whose weights are mostly near zero gives up more of them than one whose weights are
    all alike) so that ``pattern`` of the eligible weights are zero. Relative, not raw: with
    BatchNorm folded into the convolutions each layer has its own scale, and raw global magnitude
    zeroed 99 % of one MobileNetV3 layer and killed the model. 2:4: the pattern in each eligible
    tensor."""
    eligible = [sparse_eligible(w, pattern, axis) for w, axis in weights]
    if pattern == "2:4":
        pairs = zip(weights, eligible, strict=True)
        return [sparsity_mask(w, pattern, axis) if ok else None for (w, axis), ok in pairs]
    relative = [_relative_magnitude(w) if ok else None for (w, _), ok in zip(weights, eligible, strict=True)]
    pooled_parts = [r.ravel() for r in relative if r is not None]
    if not pooled_parts:
        return [None] * len(weights)
    pooled = np.concatenate(pooled_parts)
    k = int(pooled.size * pattern)
    if not k:
        return [None] * len(weights)
    threshold = np.partition(pooled, k - 1)[k - 1]
    return [None if r is None else r > threshold for r in relative]


def _relative_magnitude(w: np.ndarray) -> np.ndarray:
    magnitude = np.abs(w).astype(np.float64)
    rms = float(np.sqrt(np.mean(magnitude**2)))
    relative: np.ndarray = magnitude / rms if rms > 0 else magnitude
    return relative


def sparsify(source: Path, out: Path, pattern: Pattern) -> SparsityReport:
    """Zero the smallest-magnitude weights of the Conv/Gemm/MatMul weight tensors
    (``sparsity_masks``); write ``out``."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(source))
    constants_to_initializers(model)
    targets = weight_initializers(model)
    if not targets:
        raise UnsupportedOpError("the model has no Conv/Gemm/MatMul weight initializers to sparsify")
    inits = [init for init in model.graph.initializer if init.name in targets]
    weights = [(numpy_helper.to_array(init), targets[init.name]) for init in inits]
    masks = sparsity_masks(weights, pattern)
    if all(m is None for m in masks):
        raise UnsupportedOpError(
            f"no weight tensor can take {describe_pattern(pattern)} sparsity: every one is depthwise, under "
            f"{SPARSE_MIN_WEIGHTS} weights" + (" or has input channels not divisible by 4" if pattern == "2:4" else "")
        )
    zeros = total = 0
    for init, (w, _), mask in zip(inits, weights, masks, strict=True):
        if mask is None:
            continue
        pruned = np.where(mask, w, 0).astype(w.dtype)
        zeros += int(np.count_nonzero(pruned == 0))
        total += int(pruned.size)
        init.CopyFrom(numpy_helper.from_array(pruned, init.name))
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    sparse = sum(m is not None for m in masks)
    return SparsityReport(
        pattern=describe_pattern(pattern),
        tensors=sparse,
        sparsity=zeros / max(total, 1),
        compressed_bytes_before=compressed_size(source),
        compressed_bytes_after=compressed_size(out),
        dense=len(masks) - sparse,
    )


def describe_pattern(pattern: Pattern) -> str:
    return "2:4" if pattern == "2:4" else f"unstructured {pattern:.2f}"


def sparsify_module(module: Any, pattern: Pattern) -> Any:
    """Zero ``module``'s Conv/Linear weights by ``pattern`` in place; returns the function that
    re-applies the masks (after every fine-tuning step, so pruned weights stay zero)."""
    import torch

    layers = [
        layer
        for layer in module.modules()
        if isinstance(layer, torch.nn.Conv1d | torch.nn.Conv2d | torch.nn.Conv3d | torch.nn.Linear)
    ]
    if not layers:
        raise UnsupportedOpError("the model has no Conv/Linear layers to sparsify")
    # the reduction axis is 1 for torch's Conv [out, in/groups, ...] and Linear [out, in] alike
    found = sparsity_masks([(layer.weight.detach().cpu().numpy(), 1) for layer in layers], pattern)
    masks = [
        (layer, torch.from_numpy(mask).to(layer.weight.dtype))
        for layer, mask in zip(layers, found, strict=True)
        if mask is not None
    ]
    if not masks:
        raise UnsupportedOpError(f"no Conv/Linear weight can take {describe_pattern(pattern)} sparsity")

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
    "LayerSensitivity",
    "PruneReport",
    "SparsityReport",
    "allocate",
    "compressed_size",
    "constants_to_initializers",
    "fixed_layers",
    "layer_sensitivity",
    "parse_pattern",
    "prune_channels",
    "reconstruct",
    "sparsify",
    "sparsify_module",
    "sparsity_mask",
]
