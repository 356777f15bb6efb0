"""A cascade: an endpoint of its own name that asks its members in order, smallest first, and goes
on to the next only when the answer is not confident enough (``[models.<name>.route]``).

Confidence of an answer: the best ``scores`` value where the member post-processes (top-1 of a
classifier's top-k, the best box of a detector; 0 when a detector found nothing), else the largest
value of its first output's first row (a classifier's top-1 probability). An answer whose
confidence is at least ``threshold`` is the cascade's; the last member's answer always is. When
a later member cannot answer (overloaded, failing, timed out) the earlier confident-or-not answer
is kept: a cascade never answers worse than its first member. Each answer says which member gave
it (``response_parameters["member"]``) and whether it was escalated (``"escalated"``). A request
whose deadline (``timeout``) leaves less time than the next member is expected to take (its
runtime p50 here, its ``timeout_ms`` on a remote server) is not escalated (``"escalation":
"skipped: deadline"``).

Members are served models with their own pipelines (batching, cache, processing) and stay
addressable under their own names; their signatures as clients see them must agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np

from device_agents.errors import ModelNotFoundError, ServingError
from device_agents.metrics import AgentMetrics
from device_agents.pipeline import Request
from device_agents.runtimes import ServedModel
from edgekit.bundle.errors import ConfigError

T = TypeVar("T")


class Member(Protocol):
    """What the cascade needs of a member endpoint (``endpoints.ModelEndpoint``)."""

    name: str

    def model(self, version: int | None = None) -> ServedModel: ...

    def infer(
        self, version: int | None, decode: Callable[[ServedModel], Request], encode: Callable[[Request], T]
    ) -> T: ...

    def depth(self) -> tuple[int, int]: ...

    def expected_s(self) -> float:
        """What an answer of this member is expected to take (0: unknown)."""
        ...


def confidence(outputs: dict[str, np.ndarray]) -> float:
    """How sure an answer is (see the module docstring)."""
    scores = outputs.get("scores")
    if scores is not None:
        return float(scores.max()) if scores.size else 0.0
    first = next(iter(outputs.values()))
    return float(np.asarray(first).reshape(first.shape[0], -1)[0].max()) if first.size else 0.0


class CascadeEndpoint:
    """``name`` answered by ``members`` in order, escalating below ``threshold``."""

    def __init__(self, name: str, members: Sequence[Member], threshold: float, metrics: AgentMetrics) -> None:
        if len(members) < 2:
            raise ConfigError(f"agent.models.{name}.route: members lists {len(members)}; a cascade needs two or more")
        self.name = name
        self.members = tuple(members)
        self.threshold = threshold
        self.metrics = metrics
        self.check()

    def check(self) -> None:
        """``ConfigError`` when the members' signatures (as clients see them) differ."""
        first = self.members[0].model()
        want = ([s.name for s in first.wire_inputs], [s.name for s in first.wire_outputs])
        for member in self.members[1:]:
            m = member.model()
            got = ([s.name for s in m.wire_inputs], [s.name for s in m.wire_outputs])
            if got != want:
                raise ConfigError(
                    f"agent.models.{self.name}.route: member {member.name!r} takes {got[0]} and answers {got[1]}, "
                    f"{self.members[0].name!r} takes {want[0]} and answers {want[1]}; a cascade's members must agree"
                )

    def model(self, version: int | None = None) -> ServedModel:
        if version is not None:
            raise ModelNotFoundError(f"{self.name} is a cascade: it has no versions (its members do)")
        return self.members[0].model()

    def infer(self, version: int | None, decode: Callable[[ServedModel], Request], encode: Callable[[Request], T]) -> T:
        if version is not None:
            raise ModelNotFoundError(f"{self.name} is a cascade: it has no versions (its members do)")
        answer: Request | None = None
        escalated = False
        for i, member in enumerate(self.members):
            try:
                got = member.infer(None, decode, _keep)
            except ServingError:
                if answer is None:
                    raise
                break  # a later member could not answer: the earlier answer stands
            answer, escalated = got, i > 0
            answer.response_parameters["member"] = member.name
            if i == len(self.members) - 1 or answer.outputs is None or confidence(answer.outputs) >= self.threshold:
                break
            if answer.deadline and answer.deadline - time.monotonic() < self.members[i + 1].expected_s():
                answer.response_parameters["escalation"] = "skipped: deadline"  # the next one could not make it
                break
            self._record(answer)  # escalating: its stage times now, before the next member's replace them
        if answer is None:  # (members is never empty)
            raise ModelNotFoundError(f"{self.name}: no member answered")
        answer.response_parameters["escalated"] = escalated
        return encode(answer)

    def _record(self, request: Request) -> None:
        timing = request.timing
        if timing is not None:
            stages, rows = timing.take()
            if stages:
                self.metrics.observe_stages(timing.model, stages)
            if rows:
                self.metrics.observe_batch(timing.model, rows)

    def depth(self) -> tuple[int, int]:
        return (0, 0)  # its members' queues are theirs (each is an endpoint of its own)

    def stop(self, timeout_s: float) -> bool:
        return True  # the members drain as endpoints of their own


def _keep(request: Request) -> Request:
    return request
