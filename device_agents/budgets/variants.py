"""A variant set (``[models.<name>] variants = ["det-fp16", "det-int8"]``): an endpoint of its own
name over separate served models, best first, that answers each request with the first variant
that fits, and says which one did (v2 response parameter ``variant``).

A variant fits when:
- power: the ``variant`` step of ``[budgets] degrade`` is not on (when it is, the last variant
  answers every request until the level falls again);
- memory: it is loaded, or the memory budget has room to load it without unloading another;
- deadline: the request's own ``timeout`` leaves at least the variant's runtime p50 on this device
  (unknown before its first answer: it fits).
When none fits, the last variant answers. Variants keep their own pipelines (batching, cache,
processing) and stay addressable under their own names; their served signatures must agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from device_agents.budgets.state import Budgets
from device_agents.errors import ModelNotFoundError
from device_agents.pipeline.stage import Request
from device_agents.registry import Registry
from device_agents.runtimes import ServedModel
from edgekit.bundle.errors import ConfigError
from edgekit.bundle.manifest import Manifest

T = TypeVar("T")


class Variant(Protocol):
    """What the set needs of a variant's endpoint (``endpoints.ModelEndpoint``)."""

    name: str

    def model(self, version: int | None = None) -> ServedModel: ...

    def infer(
        self, version: int | None, decode: Callable[[ServedModel], Request], encode: Callable[[Request], T]
    ) -> T: ...

    def expected_s(self) -> float: ...


class VariantEndpoint:
    def __init__(self, name: str, variants: Sequence[Variant], registry: Registry, budgets: Budgets | None) -> None:
        self.name = name
        self.variants = tuple(variants)
        self.registry = registry
        self.budgets = budgets
        first = self._manifest(self.variants[0].name)
        want = ([s.name for s in first.signature.inputs], [s.name for s in first.signature.outputs])
        for v in self.variants[1:]:
            m = self._manifest(v.name)
            got = ([s.name for s in m.signature.inputs], [s.name for s in m.signature.outputs])
            if got != want:
                raise ConfigError(
                    f"agent.models.{name}.variants: {v.name!r} takes {got[0]} and answers {got[1]}, "
                    f"{self.variants[0].name!r} takes {want[0]} and answers {want[1]}; a variant set's models "
                    "must agree"
                )

    def _manifest(self, name: str) -> Manifest:
        """The manifest of variant ``name``'s served version, without loading it."""
        entry = self.registry.peek(name)
        if entry is not None:
            return entry.model.manifest
        active = self.registry.store.model_state(name).active
        if active is None:
            raise ModelNotFoundError(f"{self.name}: variant {name!r} is not installed")
        return self.registry.store.manifest_of(active)

    def model(self, version: int | None = None) -> ServedModel:
        if version is not None:
            raise ModelNotFoundError(f"{self.name} is a variant set: it has no versions (its variants do)")
        return self.variants[0].model()

    def choose(self, timeout_s: float | None) -> Variant:
        """The first variant that fits (see the module docstring), else the last."""
        budgets = self.budgets
        if budgets is not None:
            step = budgets.step("variant")
            if step and budgets.level >= step:
                return self.variants[-1]
        loaded = self.registry.models()
        memory = budgets.memory if budgets is not None else None
        for variant in self.variants[:-1]:
            if memory is not None and variant.name not in loaded and not memory.fits_now(self._manifest(variant.name)):
                continue
            if timeout_s is not None and variant.name in loaded and variant.expected_s() > timeout_s:
                continue
            return variant
        return self.variants[-1]

    def infer(self, version: int | None, decode: Callable[[ServedModel], Request], encode: Callable[[Request], T]) -> T:
        if version is not None:
            raise ModelNotFoundError(f"{self.name} is a variant set: it has no versions (its variants do)")
        # decoded once, with a loaded variant's model where there is one (the signatures agree):
        # decoding must not load a variant the choice may not take
        for candidate in self.variants:
            entry = self.registry.peek(candidate.name)
            if entry is not None:
                request = decode(entry.model)
                break
        else:
            request = decode(self.variants[-1].model())
        variant = self.choose(request.timeout_s)

        def answered(r: Request) -> T:
            r.response_parameters["variant"] = variant.name
            return encode(r)

        return variant.infer(None, lambda _model: request, answered)

    def depth(self) -> tuple[int, int]:
        return (0, 0)  # its variants' queues are theirs (each is an endpoint of its own)

    def stop(self, timeout_s: float) -> bool:
        return True  # the variants drain as endpoints of their own
