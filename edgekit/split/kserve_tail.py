"""Serve split tails with KServe's own ``ModelServer`` (a v2 server that is not edgekit's)::

    python -m edgekit.split.kserve_tail DIR [--http_port 8080]

``DIR/<name>/model.onnx`` (``edgekit serve-tail --kserve DIR`` writes it) becomes model
``<name>``, run with ONNX Runtime on the CPU. Outputs go back as binary tensor data when the
request asks for it (``binary_data_output``), as JSON otherwise. Needs ``pip install kserve``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from edgekit.errors import MissingSDKError

_V2_TYPES = {"float32": "FP32", "float16": "FP16", "float64": "FP64", "int64": "INT64", "int32": "INT32"}


def models(root: Path) -> list[Any]:
    try:
        import kserve
    except ImportError as exc:
        raise MissingSDKError("kserve", "kserve", "serving tails with KServe's ModelServer") from exc
    import onnxruntime as ort

    class OnnxTail(kserve.Model):  # type: ignore[misc]  # kserve ships no type stubs
        def __init__(self, name: str, path: Path) -> None:
            super().__init__(name)
            self.path = path
            self.session: Any = None

        def load(self) -> bool:
            self.session = ort.InferenceSession(str(self.path), providers=["CPUExecutionProvider"])
            self.ready = True
            return True

        def predict(self, payload: Any, headers: dict[str, str] | None = None) -> Any:
            feeds = {i.name: i.as_numpy() for i in payload.inputs}
            names = [o.name for o in self.session.get_outputs()]
            binary = bool(payload.use_binary_outputs) if hasattr(payload, "use_binary_outputs") else False
            outputs = []
            for name, value in zip(names, self.session.run(names, feeds), strict=True):
                out = kserve.InferOutput(name, list(value.shape), _V2_TYPES[str(value.dtype)])
                out.set_data_from_numpy(value, binary_data=binary)
                outputs.append(out)
            return kserve.InferResponse(
                response_id=payload.id or "", model_name=self.name, infer_outputs=outputs, use_binary_outputs=binary
            )

    found = []
    for model_dir in sorted(p for p in Path(root).iterdir() if (p / "model.onnx").is_file()):
        m = OnnxTail(model_dir.name, model_dir / "model.onnx")
        m.load()
        found.append(m)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m edgekit.split.kserve_tail", description=__doc__)
    parser.add_argument("root", type=Path, help="DIR/<name>/model.onnx per tail")
    parser.add_argument("--http_port", type=int, default=8080)
    args = parser.parse_args(argv)
    import kserve

    served = models(args.root)
    if not served:
        print(f"no DIR/<name>/model.onnx under {args.root}", file=sys.stderr)
        return 2
    kserve.ModelServer(http_port=args.http_port, enable_grpc=False, workers=1).start(served)
    return 0


if __name__ == "__main__":
    sys.exit(main())
