"""Op placement reported by ONNX Runtime itself: which execution provider ran each node.

Read from ORT's own session profile (one profiled run), so it reflects the graph after ORT's
optimisations (fused and layout-transformed nodes included), never a hand-written op list.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from edgekit.bundle.manifest import OpPlacement, OpPlacementEntry

_KERNEL_SUFFIX = "_kernel_time"


def ort_op_placement(
    model_path: Path,
    feed: Mapping[str, np.ndarray],
    providers: Sequence[str] = ("CPUExecutionProvider",),
    accelerated_on: Sequence[str] = ("CPUExecutionProvider",),
) -> OpPlacement:
    """Profile one run of ``model_path`` and count nodes per provider.

    ``accelerated_on``: providers that count as the target's own device; nodes on any other
    provider count as fallback.
    """
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="edgekit-prof-") as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "ort")
        session = ort.InferenceSession(str(model_path), so, providers=list(providers))
        session.run(None, dict(feed))
        profile = Path(session.end_profiling())
        events = json.loads(profile.read_text())
    entries: dict[str, OpPlacementEntry] = {}
    for event in events:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith(_KERNEL_SUFFIX):
            continue
        args = event.get("args", {})
        node = event["name"][: -len(_KERNEL_SUFFIX)]
        entries.setdefault(
            node, OpPlacementEntry(op=str(args.get("op_name", "")), node=node, device=str(args.get("provider", "")))
        )
    accelerated = sum(1 for e in entries.values() if e.device in accelerated_on)
    return OpPlacement(
        tool=f"onnxruntime {ort.__version__} session profile",
        accelerated=accelerated,
        fallback=len(entries) - accelerated,
        entries=tuple(entries.values()),
    )
