"""The admission stage (``STAGE_FACTORIES["admission"]``): the first stage of an endpoint's chain,
refusing requests while the power budget or the temperature has the agent degraded.

At degradation level ``k`` the first ``k`` steps of ``[budgets] degrade`` are on: ``drop``
refuses requests whose v2 parameters say ``"droppable": true`` (frames a client can lose), ``shed``
refuses every request; both with a 503 and a Retry-After of when the energy bucket is expected
back above the level's exit point. Memory admission happens where models load (the registry's
lease, ``budgets.memory``), before any stage runs: a request for a model that does not fit gets
the memory budget's 503 there.

Per request this reads two integers; the level itself is set by the budgets' sampler thread.
The stage is built only where ``[budgets]`` sets a power budget or a temperature limit.
"""

from __future__ import annotations

from device_agents.budgets.state import Budgets, budgets_for
from device_agents.errors import UnavailableError
from device_agents.pipeline.stage import Request, StageContext

DROPPABLE = "droppable"


class Admission:
    name = "admission"

    def __init__(self, endpoint: str, budgets: Budgets) -> None:
        self.endpoint = endpoint
        self.budgets = budgets
        self.drop_at = budgets.step("drop") or 1_000_000  # the level at which each step is on
        self.shed_at = budgets.step("shed") or 1_000_000

    def process(self, request: Request) -> None:
        level = self.budgets.level
        if not level:
            return
        if level >= self.shed_at:
            raise UnavailableError(
                f"{self.endpoint}: shedding load to keep within the power/thermal budget "
                f"(degradation level {level}: {self.budgets.reason}); retry later",
                reason="power",
                retry_after_s=self.budgets.retry_after(),
            )
        if level >= self.drop_at and request.parameters.get(DROPPABLE) is True:
            raise UnavailableError(
                f"{self.endpoint}: droppable request dropped to keep within the power/thermal budget "
                f"(degradation level {level}: {self.budgets.reason})",
                reason="dropped",
                retry_after_s=self.budgets.retry_after(),
            )


def admission(context: StageContext) -> Admission | None:
    """Stage factory: an ``Admission`` where ``[budgets]`` degrades (a power budget, a temperature limit)."""
    if not context.agent.budgets.degrades:
        return None
    budgets = budgets_for(context.agent.store)
    if budgets is None:  # no agent (lifecycle) owns budgets for this store in this process
        return None
    return Admission(context.name, budgets)
