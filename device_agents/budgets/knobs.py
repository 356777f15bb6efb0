"""Runtime settings that follow the memory budget: what a model loads with under ``[budgets] memory_mb``.

``follow_budget(options, room)`` takes the runtime's options as configured and the room the budget
leaves for this load (``MemoryBudget.room``), and fills in what the user left to the runtime:

- under any memory budget: ONNX Runtime's CPU memory arena and memory pattern off (the arena
  keeps a large batch's activations resident for good; measured here on a chain of six 1024 x 1024
  MatMuls, one batch of 2048 rows left RSS +16 MB with the arena and +0 MB without it, given
  glibc's fixed mmap threshold that ``MemoryBudget`` sets), OpenVINO's CPU runtime cache off
  (``CPU_RUNTIME_CACHE_CAPACITY`` 0: compiled kernels per input shape; 199 batch sizes left RSS
  +176 MB with the default, +138 MB without), and TensorRT's workspace bounded by the room
  (``memory_budget_mb``);
- when the room is tight (less than ``TIGHT_RATIO`` x what the model needs): one intra-op thread
  (ONNX Runtime, OpenVINO, LiteRT, the TensorRT fallback's session), one inter-op thread, and one
  OpenVINO stream with the ``LATENCY`` hint: each thread and stream holds scratch buffers of its
  own. Memory over speed, as the budget asks.

What the user set explicitly (``threads = 4``, ``cpu_mem_arena = true``) is kept: a knob is filled
in only where its value is the runtime's default (0, None, ""). OpenVINO's compiled-model cache
(``cache_dir``) is left as configured: a load from it peaked lower here (70 MB vs 79 MB), not higher.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from device_agents.runtimes.options import (
    LiteRtOptions,
    OnnxRuntimeOptions,
    OpenVinoOptions,
    RuntimeOptions,
    TensorRtOptions,
)

log = logging.getLogger("edgekit.agent")

_MB = 1024 * 1024
TIGHT_RATIO = 2.0  # a load is tight when the budget leaves it less than this many times its need


@dataclass(frozen=True)
class Room:
    """What the memory budget leaves for one model's load, and what the model needs (0: unknown)."""

    free_bytes: int
    need_bytes: int

    @property
    def tight(self) -> bool:
        return self.need_bytes > 0 and self.free_bytes < TIGHT_RATIO * self.need_bytes

    def describe(self) -> str:
        need = f"needs ~{self.need_bytes / _MB:.0f} MB" if self.need_bytes else "needs an unknown amount"
        return f"{self.free_bytes / _MB:.0f} MB of the memory budget free, {need}"


def follow_budget(options: RuntimeOptions, room: Room) -> RuntimeOptions:
    """``options`` with the knobs the user left to the runtime set for ``room`` (module docstring)."""
    tight = room.tight
    changes: dict[str, object] = {}
    if isinstance(options, OnnxRuntimeOptions):
        if options.cpu_mem_arena is None:
            changes["cpu_mem_arena"] = False
        if options.mem_pattern is None:
            changes["mem_pattern"] = False
        if tight and not options.threads:
            changes["threads"] = 1
        if tight and not options.inter_op_threads:
            changes["inter_op_threads"] = 1
    elif isinstance(options, OpenVinoOptions):
        if options.runtime_cache_capacity is None:
            changes["runtime_cache_capacity"] = 0
        if tight and not options.threads:
            changes["threads"] = 1
        if tight and not options.num_streams:
            changes["num_streams"] = 1
        if tight and not options.performance_hint:
            changes["performance_hint"] = "LATENCY"
    elif isinstance(options, LiteRtOptions):
        if tight and not options.threads:
            changes["threads"] = 1
    elif isinstance(options, TensorRtOptions):
        free_mb = max(1, room.free_bytes // _MB)
        if not options.memory_budget_mb:
            changes["memory_budget_mb"] = free_mb
        if tight and not options.threads:
            changes["threads"] = 1
    return dataclasses.replace(options, **changes) if changes else options  # type: ignore[arg-type]  # the union's member matched above takes these fields


def changed(before: RuntimeOptions, after: RuntimeOptions) -> str:
    """What ``follow_budget`` set, as ``name=value`` pairs (for the load's log line); "" if nothing."""
    return ", ".join(
        f"{f.name}={getattr(after, f.name)!r}"
        for f in dataclasses.fields(after)
        if getattr(before, f.name) != getattr(after, f.name)
    )


def options_for_load(options: RuntimeOptions, room: Room, model: str) -> RuntimeOptions:
    """``follow_budget``, saying in the log what it set for ``model``'s load."""
    after = follow_budget(options, room)
    what = changed(options, after)
    if what:
        log.info("%s: %s%s: loads with %s", model, room.describe(), " (tight)" if room.tight else "", what)
    return after
