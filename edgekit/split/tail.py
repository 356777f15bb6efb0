"""``edgekit serve-tail``: serve split tails over Open Inference Protocol v2 with the agent's own
front-end, service layer and pipeline.

A tail given as ``.ekb`` is installed as it is (its signer's public key given with ``--trust``);
a tail given as ``.onnx`` is first packaged into an FP32 ``cpu`` bundle (``edgekit.packaging``:
validated, with golden vectors) signed by a key made for this run and trusted by it alone. The
bundles go through the agent's install path (signature, hashes, self-test) into a store in a
temporary directory, removed at exit: the tail server keeps nothing between runs.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edgekit.errors import ConfigError

log = logging.getLogger("edgekit.split.tail")


def tail_name(path: Path, prefix: str | None) -> str:
    return f"{prefix}-{path.stem}" if prefix else path.stem


def package_tail(onnx_path: Path, out_dir: Path, key: Path, name: str, *, samples: int = 64) -> Path:
    """An FP32 ``cpu`` bundle of ``onnx_path`` (golden vectors and validation on seeded
    standard-normal inputs of its shapes; a dynamic leading axis is taken as 1 per sample)."""
    import onnxruntime as ort

    from edgekit import package

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    calib: dict[str, np.ndarray] = {}
    for i in session.get_inputs():
        dims = [d for d in i.shape[1:] if isinstance(d, int)]
        if len(dims) != len(i.shape) - 1:
            raise ConfigError(
                f"{onnx_path}: input {i.name} has dynamic axes {i.shape}; export the tail with fixed shapes"
            )
        if i.type not in _ORT_TYPES:
            raise ConfigError(f"{onnx_path}: input {i.name} is {i.type}; tails take {', '.join(_ORT_TYPES)}")
        # non-negative: most cut tensors follow a ReLU
        calib[i.name] = np.abs(rng.standard_normal((samples, *dims))).astype(_ORT_TYPES[i.type])
    result = package(
        onnx_path, targets="cpu", precision="fp32", calib=calib, key=key, name=name, out_dir=out_dir, overwrite=True
    )
    bundle = result.bundles.get("cpu")
    if bundle is None:
        raise ConfigError(f"{onnx_path}: packaging the tail failed: {result.errors}")
    return bundle


_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}


def serve_tail(
    sources: Sequence[Path],
    listen: str,
    *,
    trusted_keys: Sequence[Path] = (),
    name_prefix: str | None = None,
    on_ready: Callable[[str, dict[str, int]], None] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Install every tail and serve until ``stop`` is set (SIGTERM / Ctrl-C in the CLI)."""
    from device_agents.config import AgentConfig, parse_listen
    from device_agents.service import AgentService
    from device_agents.serving.http import AgentServer
    from edgekit.bundle.signing import generate_keypair

    if not sources:
        raise ConfigError("serve-tail: give at least one tail (.onnx or .ekb)")
    host, port = parse_listen(listen)
    bundles = [s for s in sources if s.suffix == ".ekb"]
    if bundles and not trusted_keys:
        raise ConfigError("serve-tail: .ekb tails need --trust PUBLIC_KEY (the key their signer's .pub)")
    for s in sources:
        if s.suffix not in (".ekb", ".onnx"):
            raise ConfigError(f"serve-tail: {s}: expected a .onnx tail or an .ekb tail bundle")
    stop = stop or threading.Event()
    with tempfile.TemporaryDirectory(prefix="edgekit-tail-") as tmp:
        root = Path(tmp)
        keys = list(trusted_keys)
        onnx = [s for s in sources if s.suffix == ".onnx"]
        if onnx:
            private, public = generate_keypair(root / "keys", "serve-tail")
            keys.append(public)
            for s in onnx:
                bundles.append(package_tail(s, root / "bundles", private, tail_name(s, name_prefix)))
        config = AgentConfig(store=root / "store", trusted_keys=tuple(keys), listen=listen, verify_interval_s=0)
        service = AgentService(config)
        service.start()
        try:
            for b in bundles:
                result = service.install(b, origin="serve-tail")
                log.info("tail %s v%s installed", result.name, result.version)
            server = AgentServer(host, port, service)
            try:
                thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
                thread.start()
                if on_ready is not None:
                    on_ready(server.url, service.models())
                stop.wait()
            finally:
                server.shutdown()
                server.server_close()
        finally:
            service.stop()
    return 0
