"""``edgekit export MODULE:FACTORY --example-shape 1x3x224x224 -o model.onnx``: a PyTorch module to ONNX.

``FACTORY`` is a function (or class) in ``MODULE`` (importable from the current folder, or a
``path/to/file.py``) that returns the ``torch.nn.Module`` to export, called without arguments. The
export uses PyTorch's TorchScript-based exporter (``dynamo=False``): the torch.export-based one
needs ``onnxscript``, which the environment does not carry. Axis 0 of every input and output is a
dynamic batch axis unless ``--static-batch``. Like every conversion here, the result is checked
numerically: ONNX Runtime runs the exported model on the example input and must match PyTorch.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edgekit.bundle.errors import ConfigError, MissingSDKError
from edgekit.errors import ModelFormatError

DEFAULT_OPSET = 17
_ORT_TYPES = {"tensor(float)": "float32", "tensor(int64)": "int64", "tensor(float16)": "float16"}
_ATOL = 1e-4  # float32 through two runtimes; a real mismatch is orders of magnitude larger


def register(sub: Any) -> None:
    """Add ``edgekit export`` to the CLI's subparsers."""
    p = sub.add_parser(
        "export",
        help="export a PyTorch module to ONNX (then `edgekit package` it)",
        description="Import MODULE, call FACTORY() for the torch.nn.Module, export it to ONNX with a dynamic batch "
        "axis, and check that ONNX Runtime gives PyTorch's outputs on the example input.",
    )
    p.add_argument("factory", metavar="MODULE:FACTORY", help="e.g. mymodels:make_net or path/to/net.py:Net")
    p.add_argument(
        "--example-shape",
        action="append",
        required=True,
        metavar="1x3x224x224",
        help="the shape of one example input (repeat for each input, in order); float32",
    )
    p.add_argument("--input-names", metavar="A,B", help="input names (default input, or input0, input1, ...)")
    p.add_argument("--output-names", metavar="A,B", help="output names (default output, or output0, ...)")
    p.add_argument("--static-batch", action="store_true", help="keep axis 0 fixed at the example's size")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset (default {DEFAULT_OPSET})")
    p.add_argument("-o", "--out", type=Path, default=Path("model.onnx"), metavar="MODEL.onnx")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    shapes = [_shape(s) for s in args.example_shape]
    module = load_factory(args.factory)()
    inputs = _names(args.input_names, "input", len(shapes), "--input-names")
    batch = not args.static_batch
    result = export_onnx(
        module, shapes, args.out, input_names=inputs, output_names=args.output_names, dynamic_batch=batch,
        opset=args.opset,
    )  # fmt: skip
    print(f"wrote {args.out}: " + "; ".join(result["tensors"]))
    print(f"ONNX Runtime matches PyTorch on the example input (max abs error {result['max_abs_error']:.2g})")
    print(f"next: edgekit package {args.out} --calib DATA.npz")
    return 0


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ConfigError(f"--example-shape {text!r}: expected DIMxDIMx... such as 1x3x224x224")
    return shape


def _names(text: str | None, stem: str, count: int, flag: str) -> list[str]:
    if text is None:
        return [stem] if count == 1 else [f"{stem}{i}" for i in range(count)]
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) != count:
        raise ConfigError(f"{flag} {text!r}: {len(names)} names for {count} tensors")
    return names


def load_factory(spec: str) -> Any:
    """``module:factory`` or ``path/file.py:factory`` -> the callable; errors say what to do."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"{spec!r}: expected MODULE:FACTORY such as mymodels:make_net or net.py:Net")
    if where.endswith(".py"):
        path = Path(where)
        loaded = importlib.util.spec_from_file_location(path.stem, path) if path.is_file() else None
        if loaded is None or loaded.loader is None:
            raise ConfigError(f"{where} does not exist or is not a Python file; check the path")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[path.stem] = module
        loaded.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: modules in the current folder
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            raise ConfigError(
                f"cannot import {where!r} ({exc}); run from the folder that holds it or give a path such as "
                f"{where.replace('.', '/')}.py:{attr}"
            ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        near = difflib.get_close_matches(attr, names, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{where} has no function or class {attr!r}{hint}")
    return factory


def export_onnx(
    module: Any,
    shapes: list[tuple[int, ...]],
    out: Path,
    *,
    input_names: list[str],
    output_names: str | None = None,
    dynamic_batch: bool = True,
    opset: int = DEFAULT_OPSET,
    examples: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Export ``module`` on seeded random float32 inputs of ``shapes`` (or on ``examples``, arrays of
    any dtype) to ``out`` and check it with ONNX Runtime on the same inputs."""
    try:
        import torch
    except ImportError as exc:
        raise MissingSDKError("torch", "compress", "exporting a PyTorch module") from exc
    import numpy as np
    import onnxruntime as ort

    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"the factory returned a {type(module).__name__}, not a torch.nn.Module")
    module.eval()
    rng = np.random.default_rng(0)
    if examples is None:
        examples = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    examples = [np.ascontiguousarray(x) for x in examples]
    with torch.no_grad():
        expected = module(*(torch.from_numpy(x) for x in examples))
    expected_list = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    outputs = _names(output_names, "output", len(expected_list), "--output-names")
    axes = {n: {0: "batch"} for n in [*input_names, *outputs]} if dynamic_batch else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter, chosen on purpose (above)
            torch.onnx.export(
                module, tuple(torch.from_numpy(x) for x in examples), str(out), dynamo=False,
                input_names=input_names, output_names=outputs, dynamic_axes=axes, opset_version=opset,
            )  # fmt: skip
    except (RuntimeError, ValueError, TypeError, torch.onnx.errors.OnnxExporterError) as exc:
        raise ModelFormatError(f"PyTorch could not export the module to ONNX: {exc}") from exc
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, dict(zip(input_names, examples, strict=True)))
    error = max(float(np.max(np.abs(g - e.numpy()))) for g, e in zip(got, expected_list, strict=True))
    if not error <= _ATOL:
        raise ModelFormatError(
            f"{out}: ONNX Runtime's outputs differ from PyTorch's on the example input (max abs error {error:.3g}); "
            "the exported graph does not compute what the module does"
        )
    tensors = [
        f"{kind} {t.name!r} {_ORT_TYPES.get(t.type, t.type)} [{', '.join(str(d) for d in t.shape)}]"
        for kind, group in (("input", session.get_inputs()), ("output", session.get_outputs()))
        for t in group
    ]
    return {"tensors": tensors, "max_abs_error": error}


def export_for_package(module: Any, example_inputs: Any, out_dir: Path, name: str | None) -> tuple[Path, str]:
    """``edgekit.package(model=torch_module, example_inputs=...)``: export the module to
    ``OUT_DIR/NAME.onnx`` (replaced on each call; NAME defaults to the module's class name,
    lower-cased) with a dynamic batch axis, checked like ``edgekit export``. ``example_inputs``:
    a tensor or array, a sequence of them (inputs ``input0``, ``input1``, ...), or a mapping
    input name -> tensor. Returns (the ONNX path, the bundle name)."""
    if example_inputs is None:
        raise ConfigError(
            f"model is a {type(module).__name__}, not an ONNX file: give example_inputs (a tensor, a tuple of "
            "tensors or a mapping input name -> tensor) to export it with"
        )
    if isinstance(example_inputs, Mapping):
        names, values = [str(k) for k in example_inputs], list(example_inputs.values())
    else:
        values = list(example_inputs) if isinstance(example_inputs, (list, tuple)) else [example_inputs]
        names = _names(None, "input", len(values), "example_inputs")
    arrays = [_as_array(v) for v in values]
    name = name or type(module).__name__.lower()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.onnx"
    export_onnx(module, [a.shape for a in arrays], out, input_names=names, examples=arrays)
    return out, name


def _as_array(value: Any) -> Any:
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor
        return value.detach().cpu().numpy()
    return np.asarray(value)
