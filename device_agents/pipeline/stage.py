"""The request every front-end hands the pipeline, the ``Stage`` protocol, and the stage table.

An endpoint's pipeline is a chain of stages in this order (only the configured ones present)::

    decode -> admission (budgets) -> cache lookup -> pre-processing -> [queue + infer] ->
    post-processing -> cache store -> encode

``decode`` and ``encode`` are the front-end's (its wire format, under the pipeline's decode
slots); ``queue`` and ``infer`` are the batcher's (``device_agents.pipeline.batching``), in the
place the ``"infer"`` entry of ``STAGE_FACTORIES`` holds. Every other stage is built from the
table below.

Adding a stage
--------------
1. A module under ``device_agents/`` with a class that has a ``name`` (its label in
   ``edgekit_stage_seconds{model,stage}``) and a ``process(request)`` method. It imports no other
   stage module; what it needs from the model comes from the ``StageContext``.
2. One entry in ``STAGE_FACTORIES``, at its place in the chain: ``"<name>": "module:factory"``
   (imported when the first pipeline is built: a stage's SDK never loads with ``import
   device_agents``, and no import cycle runs through this module) or the factory itself, where
   ``factory(context)`` returns the stage, or None when ``[models.<name>]`` config and the
   manifest do not ask for it (the chain then has no such member: it costs nothing).
3. Its config section under ``[models.<name>]`` (a frozen dataclass in ``device_agents/config.py``),
   read by the factory from ``context.model``.

Nothing in ``Pipeline`` changes. A factory is called once per endpoint, when its pipeline is
built (on the endpoint's first request), with the manifest of the version serving then.

What a stage may do in ``process``
----------------------------------
- pass the request on: return;
- answer it early (a cache hit): set ``request.outputs`` and ``request.served_version``; the rest
  of the chain, queue and infer included, is skipped (encode still runs), so a stage that answers
  early must answer with what the end of the chain would have produced;
- refuse it: raise a typed ``device_agents.errors.ServingError`` (or
  ``edgekit.bundle.errors.InferenceInputError`` for a bad input: a 400 that never counts against
  the model's health); the front-end maps it to one status;
- register a cleanup in ``request.on_done`` (e.g. give back a budget reservation): the pipeline
  calls each once, in reverse order, whatever ends the request.

The pipeline times each stage (``Pipeline.run``, the one place): a stage records no time and no
trace itself, only its own domain counters (e.g. cache hits) through ``context.metrics``.
A stage object serves every request of its endpoint, from many threads at once: it keeps no
per-request state on itself (put it on the request).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from edgekit.bundle.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from device_agents.config import AgentConfig, ModelConfig
    from device_agents.metrics import AgentMetrics
    from device_agents.runtimes import ServedModel
    from edgekit.bundle.errors import EdgekitError
    from edgekit.bundle.manifest import Manifest


class Request:
    """One inference request as every front-end hands it to the pipeline (HTTP, serial console,
    split tail server): nothing HTTP-shaped. Built by the front-end's decode, once per request (a
    plain ``__slots__`` class: ~1 us to build; a dataclass's generated ``__init__`` costs more).

    Set by the front-end: ``endpoint``, ``inputs``, and what it knows of ``version``,
    ``parameters``, ``requested_outputs``, ``raw``, ``timeout_s``; its own decoded object in
    ``wire`` (read back by its encode, never by a stage); ``answer`` if it can be answered from
    another thread (the hung-call watchdog's: an idle model then runs the request inline) and
    ``timing`` if it records the request's stage metrics itself after its answer is written
    (``pipeline.RequestTiming``).

    Set by the pipeline: ``model`` (the leased model whose signature applies), ``deadline``,
    and, by the infer stage or a stage answering early, ``outputs`` and ``served_version``.
    """

    __slots__ = (
        "answer",
        "deadline",
        "endpoint",
        "inputs",
        "model",
        "on_done",
        "outputs",
        "parameters",
        "raw",
        "requested_outputs",
        "response_parameters",
        "served_version",
        "timeout_s",
        "timing",
        "version",
        "wire",
    )

    def __init__(
        self,
        endpoint: str,
        inputs: dict[str, np.ndarray],
        version: int | None = None,
        wire: Any = None,
        timeout_s: float | None = None,
        answer: Callable[[EdgekitError], None] | None = None,
        timing: RequestTiming | None = None,
        parameters: dict[str, Any] | None = None,
        requested_outputs: tuple[str, ...] | None = None,
        raw: dict[str, Any] | None = None,
    ) -> None:
        self.endpoint = endpoint  # the served name
        self.inputs = inputs  # the model's input tensors (after pre-processing, once it ran)
        self.version = version  # the version asked for; None: the active one
        self.wire = wire  # the front-end's own decoded request, for its encode
        self.timeout_s = timeout_s  # the request's own time limit, if it sets one
        self.answer = answer
        self.timing = timing
        # v2 "parameters" (e.g. {"cache": "bypass"}, "priority", "deadline_ms", "droppable")
        self.parameters: dict[str, Any] = {} if parameters is None else parameters
        self.requested_outputs = requested_outputs  # None: every output
        # inputs as sent where they are not model tensors yet (e.g. BYTES tensors of encoded images)
        self.raw: dict[str, Any] = {} if raw is None else raw
        self.deadline = 0.0  # time.monotonic() by which it must be answered (set by the pipeline)
        self.model: ServedModel | None = None  # the leased model whose signature applies (pipeline)
        self.outputs: dict[str, np.ndarray] | None = None  # set by infer, or by a stage answering early
        self.served_version = 0  # the model version that produced ``outputs``
        self.response_parameters: dict[str, Any] = {}  # e.g. {"cache": "hit", "distance": 0.01}
        self.on_done: list[Callable[[], None]] = []  # cleanups: called once, in reverse order, at the end


class RequestTiming:
    """Filled in by the pipeline for the front-end: what a request's runtime call took (the
    front-end subtracts it from received -> written to get the server-side overhead), and what
    is left for the front-end to record once its response is written: the request's stage times
    (``stages``, of pipeline ``model``) and, when it ran in its own thread, the size of that call
    (``batch_rows``). Recording them is metrics work, not serving: done after the write, it stays
    out of the request's received -> written time. The front-end records them exactly once,
    whatever ends the request (``AgentMetrics.observe_request(..., stages, model, batch_rows)``,
    or ``observe_stages`` when no answer was written); ``take`` hands them over and clears them."""

    __slots__ = ("batch_rows", "model", "runtime_s", "stages")

    def __init__(self) -> None:
        self.runtime_s = 0.0
        self.model = ""
        self.stages: list[tuple[str, float]] | None = None
        self.batch_rows = 0

    def take(self) -> tuple[list[tuple[str, float]] | None, int]:
        """The stages and batch size left to record (None, 0 once taken)."""
        stages, rows = self.stages, self.batch_rows
        self.stages, self.batch_rows = None, 0
        return stages, rows


class Stage(Protocol):
    """One step of an endpoint's request path (see the module docstring for what it may do)."""

    name: str  # the label in edgekit_stage_seconds{model,stage}

    def process(self, request: Request) -> None:
        """Pass the request on (return), answer it early (set ``outputs``), or refuse it (raise a
        typed ``ServingError`` / ``InferenceInputError``)."""
        ...


@dataclass(frozen=True, slots=True)
class StageContext:
    """What a stage factory builds from: the endpoint's name, its ``[models.<name>]`` config
    (``model``), the whole agent config (``agent``: store path, budgets), the manifest of the
    version serving when the pipeline is built, and the metrics object for the stage's own
    domain counters."""

    name: str
    model: ModelConfig
    agent: AgentConfig
    manifest: Manifest
    metrics: AgentMetrics
    # the agent's models (``device_agents.registry.Registry``): a stage that runs another served model
    registry: Any = None


StageFactory = Callable[[StageContext], "Stage | None"]
# A factory, or where to import it from: "package.module:function"
StageFactoryRef = StageFactory | str

# The batcher's place in the chain (queue + infer): built by the pipeline, not by a factory.
INFER = "infer"

# name -> factory, in chain order (``INFER``, whose value is None: the batcher's place; the stages
# listed before it run before the queue, those after it on its outputs). A factory returns None when
# its stage is not configured for that model. Read when a pipeline is built, so an entry added
# at run time (a test's) applies to pipelines built after it.
STAGE_FACTORIES: dict[str, StageFactoryRef | None] = {
    "admission": "device_agents.budgets.stage:admission",
    "cache_lookup": "device_agents.cache.stage:lookup",
    "preprocess": "device_agents.processing.stage:preprocess",
    "split": "device_agents.split.stage:factory",
    INFER: None,
    "postprocess": "device_agents.processing.stage:postprocess",
    "cache_store": "device_agents.cache.stage:store",
}


def build_stages(context: StageContext) -> tuple[tuple[Stage, ...], tuple[Stage, ...]]:
    """The configured stages of one endpoint: (those before queue + infer, those after)."""
    before: list[Stage] = []
    after: list[Stage] = []
    into = before
    for name, factory in STAGE_FACTORIES.items():
        if name == INFER or factory is None:
            into = after
            continue
        stage = resolve(name, factory)(context)
        if stage is not None:
            into.append(stage)
    return tuple(before), tuple(after)


def resolve(name: str, factory: StageFactoryRef) -> StageFactory:
    """The factory of table entry ``name``: imported when given as "package.module:function"."""
    if not isinstance(factory, str):
        return factory
    module, _, attr = factory.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"stage {name!r}: cannot load its factory {factory!r}: {exc}") from exc
    if not callable(found):
        raise ConfigError(f"stage {name!r}: {factory!r} is not a factory (a function of a StageContext)")
    return cast(StageFactory, found)
