"""The result cache's semantic mode: the key is the output vector of another model served by the
same agent (``embed_with``), looked up by cosine distance, so that requests the encoder maps to
the same vector share an answer even where their bytes and their input signatures differ."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from device_agents.cache.approximate import signature
from device_agents.cache.stage import policy
from device_agents.config import load_config
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Pipeline, Request
from edgekit.bundle.errors import ConfigError
from tests.agent.bundles import read_manifest
from tests.agent.conftest import Bundles, write_config
from tests.agent.test_cache_approximate import _scene
from tests.factories import _save, make_cpu_bundle

SIZE = 16


def quadrant_encoder(path: Path, *, size: int = SIZE) -> Path:
    """An image encoder: ``input`` [batch, 3, size, size] -> the mean colour of each quarter,
    ``embedding`` [batch, 12]."""
    from onnx import TensorProto, helper

    half = [size // 2, size // 2]
    graph = helper.make_graph(
        [
            helper.make_node("AveragePool", ["input"], ["pooled"], kernel_shape=half, strides=half),
            helper.make_node("Flatten", ["pooled"], ["embedding"]),
        ],
        "encoder",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", 12])],
    )
    return _save(graph, path, 13)


def _config(tmp_path: Path, pub: Path, extra: str) -> Path:
    return write_config(tmp_path, pub, extra)


def test_semantic_config_needs_embed_with_and_a_threshold_and_another_model(tmp_path: Path, bundles: Bundles) -> None:
    path = tmp_path / "agent.toml"
    base = 'store = "s"\ntrusted_keys = ["k.pub"]\n[models.tiny.cache]\nmode = "semantic"\n'
    path.write_text(base + 'embed_with = "emb"\n')
    with pytest.raises(ConfigError, match=r'agent.models.tiny.cache: mode = "semantic" needs max_distance'):
        load_config(path)
    path.write_text(base + 'embed_with = "tiny"\nmax_distance = 0.05\n')
    with pytest.raises(ConfigError, match="embed_with names the model itself"):
        policy("tiny", load_config(path), read_manifest(bundles.v1))
    path.write_text(base + 'embed_with = "emb"\nmax_distance = 0.05\n')
    got = policy("tiny", load_config(path), read_manifest(bundles.v1))
    assert got is not None and (got.mode, got.embed_with, got.max_distance) == ("semantic", "emb", 0.05)


def test_semantic_cache_is_keyed_by_an_embedding_model_served_by_the_agent(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    encoder = make_cpu_bundle(tmp_path / "emb-1.ekb", quadrant_encoder(tmp_path / "emb.onnx"), keypair[0], name="emb")
    extra = '[models.tiny.cache]\nmode = "semantic"\nembed_with = "emb"\nmax_distance = 0.001\n'
    lc = Lifecycle(load_config(_config(tmp_path, keypair[1], extra)))
    lc.start()
    try:
        lc.install(encoder)
        lc.install(bundles.v1)
        pipeline = Pipeline("tiny", lc.registry, lc.config, lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps

        def ask(x: np.ndarray) -> Request:
            return pipeline.run(None, lambda model: Request("tiny", {"input": x}), lambda r: r)

        x = _scene(40, SIZE)
        assert ask(x).response_parameters["cache"] == "miss"
        # each quarter mirrored: the encoder's vector is the same, the bytes and the input signature are not
        mirrored = x.copy()
        h = SIZE // 2
        for r in (slice(0, h), slice(h, SIZE)):
            for c in (slice(0, h), slice(h, SIZE)):
                mirrored[..., r, c] = mirrored[..., r, c][..., ::-1]
        a, b = signature({"input": x}), signature({"input": mirrored})
        assert a is not None and b is not None and 1.0 - float(a @ b) > 0.01  # the approximate mode would miss
        hit = ask(mirrored)
        assert hit.response_parameters["cache"] == "hit" and hit.response_parameters["distance"] <= 0.001
        fresh = lc.registry.get("tiny").infer({"input": x})
        assert hit.outputs is not None and all(np.array_equal(hit.outputs[k], v) for k, v in fresh.items())
        assert ask(_scene(41, SIZE)).response_parameters["cache"] == "miss"  # another scene, another vector
    finally:
        lc.stop()


def test_semantic_cache_never_compares_vectors_of_another_encoder_version(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    model = quadrant_encoder(tmp_path / "emb.onnx")
    encoders = [make_cpu_bundle(tmp_path / f"emb-{v}.ekb", model, keypair[0], name="emb", version=v) for v in (1, 2)]
    extra = '[models.tiny.cache]\nmode = "semantic"\nembed_with = "emb"\nmax_distance = 0.001\n'
    lc = Lifecycle(load_config(_config(tmp_path, keypair[1], extra)))
    lc.start()
    try:
        lc.install(encoders[0])
        lc.install(bundles.v1)
        pipeline = Pipeline("tiny", lc.registry, lc.config, lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps

        def ask(x: np.ndarray) -> str:
            request = pipeline.run(None, lambda model: Request("tiny", {"input": x}), lambda r: r)
            return str(request.response_parameters["cache"])

        x = _scene(43, SIZE)
        assert ask(x) == "miss" and ask(x * np.float32(1.001)) == "hit"  # v1's vectors: near
        lc.install(encoders[1])  # another encoder version: the vectors stored under v1 are not its own
        assert ask(x * np.float32(1.002)) == "miss"
        assert ask(x) == "hit"  # the exact entry does not depend on the encoder
        assert ask(x * np.float32(1.003)) == "hit"  # v2's own vector, stored by the miss above
    finally:
        lc.stop()


def test_semantic_cache_without_its_encoder_serves_exact_hits_and_says_so_once(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, caplog: pytest.LogCaptureFixture
) -> None:
    extra = '[models.tiny.cache]\nmode = "semantic"\nembed_with = "absent"\nmax_distance = 0.05\n'
    lc = Lifecycle(load_config(_config(tmp_path, keypair[1], extra)))
    lc.start()
    caplog.set_level(logging.DEBUG, logger="edgekit.agent")
    try:
        lc.install(bundles.v1)
        pipeline = Pipeline("tiny", lc.registry, lc.config, lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps
        x = _scene(42, SIZE)
        asked = [pipeline.run(None, lambda model: Request("tiny", {"input": x}), lambda r: r) for _ in range(3)]
        assert [r.response_parameters["cache"] for r in asked] == ["miss", "hit", "hit"]
        near = pipeline.run(None, lambda model: Request("tiny", {"input": x * np.float32(1.01)}), lambda r: r)
        assert near.response_parameters["cache"] == "miss"  # no vector: exact look-ups only
        said = [r for r in caplog.records if "could not embed" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG]  # two misses looked for a vector
    finally:
        lc.stop()
