"""The one search loop: build every candidate a target describes, measure them side by side,
prune what is dominated, rescue with mixed precision, choose by objective, record everything.

Order of work:

1. FP32 reference outputs on the selection samples (never the final gate's samples);
2. first wave: build each candidate in its own folder; a build or run that raises is a failed
   candidate with its reason, and the search goes on; accuracy on the selection samples;
3. a quick side-by-side latency round of everything built (batch 1, the device's thread count,
   the ONNX Runtime FP32 source model timed in the same loop as the common reference);
4. refinements (other calibration methods, a more accurate preset) only for a candidate that
   missed the budget; under ``auto`` also only one that measured faster than the target's FP32:
   calibration does not change a layout's speed, so refining a layout slower than FP32 is
   skipped (FP32 already beats it), and the record says so;
5. mixed precision, when the fastest quantized candidate missed the budget (``auto``, or with
   ``mixed_precision``): rank its layers by sensitivity and keep the fewest in float that meet
   the budget (1, 2, 4, ... layers, then the smallest count in between that passes); where it
   failed on a task measure (detection F1, mask IoU, the worst channel alone), the most sensitive
   groups are first re-ranked by that measure, each kept in float alone (``optimize.aimed``);
   then, under ``auto`` and only when still nothing met the budget, the plan's fallbacks (a
   float artifact of an integer target), so what ships meets the gate and says what it is;
6. a final side-by-side round with full repeats of every candidate the choice may pick, the
   target's FP32 baseline and the reference;
7. under the latency objective, the finalists: the passing candidates within ``FINALIST_MARGIN``
   of the final round's fastest (noise on a busy 2-core host is larger than the gap between two
   layouts of one model), timed again alone with the baseline and the reference, with more
   repeats; the choice is then among them. The chosen's p50, the baseline's and the reference's
   (what the table, the manifest and the report print) all come from one round (the finalists',
   else the final one); a candidate left out of it keeps its earlier p50, and its ratio is to the
   reference's p50 in that round (``Outcome.timed_in``, ``Outcome.reference_p50_ms``).

8. the fallback chain (``SearchResult.chain``): the passing candidates in the objective's order,
   the ones that passed selection within its sampling error (``optimize.margin``) behind the
   ones clear of it; under ``auto`` the target's FP32 (its float fallbacks where it has no FP32 of
   its own, built only then: ``pending``) is the last resort. The packager's final gate runs
   down it (``optimize.run.fall_back``) until one passes.

With a device profile (``edgekit.optimize.profile``) for the target, every candidate's latency is
the device's (host timings are dropped for that target, never mixed with device ones); where
nothing is timed, the target's ``device_rank`` orders the candidates (mixed precision rescues the
best-ranked one).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import Precision, Signature, Tolerance
from edgekit.errors import ConfigError, EdgekitError
from edgekit.optimize.aimed import MAX_MEASURED_GROUPS, AimedRanking, aim_of, aimed_ranking
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan, RunFn
from edgekit.optimize.choose import SPEED_TIE, choose
from edgekit.optimize.data import SearchData
from edgekit.optimize.margin import selection_margin
from edgekit.optimize.memory import REFUSAL, MemoryModel, gb, peak_rss_bytes, release_memory
from edgekit.optimize.profile import DeviceLatency
from edgekit.optimize.search_state import CandidateState, Outcome, SearchResult, SearchState
from edgekit.optimize.timing import (
    HEAD_TO_HEAD,
    REFERENCE,
    beyond_noise,
    device_times,
    head_to_head,
    prescreen_ms,
    time_round,
)
from edgekit.validate.calib import fixed_batch, pad_samples, sample_count, take
from edgekit.validate.metrics import Comparison, Kind, compare, run_all


class OptimizationError(EdgekitError):
    """No candidate of the requested precision could be built; the message lists why."""


MAX_MIXED_TRIES = 6
# under ``auto`` and the latency objective, a first-wave candidate or refinement whose first calls
# are this many times slower than the target's FP32 baseline (the ONNX Runtime FP32 source where
# the target has none) is dominated: auto ships nothing slower than FP32, so its accuracy run (on
# the selection samples) and its timing rounds are skipped. YOLOv8n at 320 on coral: 16x8
# (LiteRT's reference int16 kernels) measured 663 ms, 0.03x the source, and its accuracy run and
# timing rounds took ~120 s of the 293 s search.
DOMINATED_FACTOR = 5.0
# ... and only a candidate this slow per call: a faster one's accuracy run costs seconds, and on
# tiny models per-call overheads (another runtime's, ~0.05 ms) differ by more than the factor
DOMINATED_MIN_MS = 50.0
PRESCREEN_CALLS = 2  # timed calls of a candidate (after one warm-up) for the prescreen
# final-round candidates this close to its fastest are timed again, alone with the baseline
FINALIST_MARGIN = 0.10
MAX_FINALISTS = 4


def search(
    plan: CandidatePlan,
    *,
    target: str,
    work_dir: Path,
    data: SearchData,
    served: Signature,
    reference: RunFn,
    reference_open: Callable[[int], RunFn],
    kind: Kind,
    tolerance: Tolerance,
    precision: str,
    objective: str = "latency",
    mixed_precision: bool = False,
    threads: int = 2,
    calib_batch: int = 1,
    latency_budget_s: float = 6.0,
    progress: Callable[[str], None] = print,
    shared: dict[tuple[str, ...], tuple[Path, Built]] | None = None,
    time_budget_s: float | None = None,
    device_latency: DeviceLatency | None = None,
    dominated_factor: float | None = DOMINATED_FACTOR,
    clock: Callable[[], float] = time.perf_counter,
    tasks: Mapping[str, str] | None = None,
    post: Any = None,
    memory: MemoryModel | None = None,
) -> SearchResult:
    """Run the search for one target. ``precision``: ``auto`` or the CLI precision requested
    (then only candidates of that precision are chosen; the baseline is measured for comparison).
    ``reference``: the FP32 source model (served inputs -> outputs) the accuracy is compared with.
    ``shared``: builds of this ``package`` call's other targets by candidate identity (runtime,
    name, settings): the same candidate (OpenVINO FP32 / NNCF INT8 IR on CPU for cpu and intel)
    is built once and measured again for each target. ``time_budget_s``: once the search has run
    this long, refinements and mixed-precision tries not started yet are skipped (and recorded).
    ``device_latency``: this target's timings from a device profile, used instead of the host's.
    ``dominated_factor``: under ``auto`` with the latency objective and host timings, a first-wave
    candidate or refinement (never the baseline, a fallback or a mixed-precision try) whose first
    calls measure more than this many times the target's FP32 baseline's (the FP32 source's where
    it has none) and more than ``DOMINATED_MIN_MS`` is recorded as skipped (dominated) before its
    accuracy run; None: never. ``clock``: what the timing rounds read (seconds). ``tasks``: each
    output's task (``validate.metrics.output_tasks``), how ``compare`` judges it; ``post``: the
    bundle's post-processing (a boxes one judges the detections). ``memory``: the run's memory
    bound (``optimize.memory``); a candidate whose estimate exceeds it is skipped with its reason
    before it is built."""
    t0 = time.perf_counter()
    batch = fixed_batch(served) or 16
    state = SearchState(
        plan=plan, target=target, work_dir=work_dir, data=data, served=served, reference_open=reference_open,
        kind=kind, tolerance=tolerance, precision=precision, objective=objective, mixed_precision=mixed_precision,
        threads=threads, calib_batch=calib_batch, latency_budget_s=latency_budget_s, say=progress, shared=shared,
        time_budget_s=time_budget_s, device_latency=device_latency, dominated_factor=dominated_factor, clock=clock,
        tasks=tasks, post=post, t0=t0, batch=batch,
        ref_out=run_all(reference, data.selection, batch, pad=fixed_batch(served) is not None),
        one=pad_samples(take(data.selection, 0, fixed_batch(served) or 1), fixed_batch(served) or 1),
    )  # fmt: skip
    # a session keeps its arena at the largest call's size (16 samples: 0.6 GB for a 512x512 conv
    # model); the timing rounds open their own
    del reference
    if memory is not None:  # the reference's selection outputs are held too, and a candidate's while measured
        state.memory = dataclasses.replace(
            memory, held_bytes=memory.held_bytes + 2 * sum(int(np.asarray(v).nbytes) for v in state.ref_out.values())
        )
    state.notes.append(f"selection on {data.selection_source}")
    if kind == "classifier":
        state.notes.append(
            "classifier selection also gates the top-1 agreement predicted from each candidate's gap shrink on the "
            f"selection samples and the fp32 top-1 margins of {data.margins_source or 'the selection samples'}"
        )
    _first_wave(state)
    _quick_round(state)
    _release_failed(state)
    _refine(state)
    _release_failed(state)
    _rescue(state)
    _release_failed(state)
    _fallbacks(state)
    _final_rounds(state)
    if state.memory is not None:
        state.notes.append(
            f"memory: peak RSS of this process {gb(peak_rss_bytes())} so far, bound {gb(state.memory.bound_bytes)} "
            "(--max-memory-gb)"
        )
    return _choice(state)


# -- the phases, in order ------------------------------------------------------------------------


def _first_wave(state: SearchState) -> None:
    """Every first-wave candidate built and measured on the selection samples (prescreened)."""
    for cand in state.plan.first:
        _attempt(state, cand, screen=True)
    state.skipped = [_skipped(name, why) for name, why in state.plan.skipped]
    state.baseline = next((s for s in state.states if s.candidate.baseline), None)


def _quick_round(state: SearchState) -> None:
    """A quick side-by-side latency round of everything built: what dominates what."""
    time_round(
        state.states, state.reference_open, state.one, state.threads, "quick", repeats=6,
        budget_s=state.latency_budget_s / 2, say=state.say, target=state.target, clock=state.clock,
    )  # fmt: skip
    if state.device_latency is not None:
        device_times(state.states, state.device_latency)
    state.base_p50 = _p50(state.baseline)


def _release_failed(state: SearchState) -> None:
    """Close the sessions of the candidates that failed the gate, once their speed is recorded (the
    quick round) and a choosable candidate passed: they are never timed or chosen again, and each
    open session holds its runtime's arena (ten of U^2-Net-p 320²'s held ~3 GB)."""
    auto, precision = state.auto, state.precision
    if not any(
        s.outcome is not None and s.outcome.status == "passed" and (auto or s.candidate.precision == precision)
        for s in state.states
    ):
        return
    closed = 0
    for s in state.states:
        o = s.outcome
        if s.run is not None and o is not None and o.status in ("failed", "error") and not s.candidate.baseline:
            s.run = None
            closed += 1
    if closed:
        release_memory()


def _refine(state: SearchState) -> None:
    """Refinements of the candidates that missed the budget, within the plan's bound and the time budget."""
    auto, baseline, plan = state.auto, state.baseline, state.plan
    refined = 0
    rescued: dict[str, str] = {}  # refined candidate -> the refinement that met the budget
    for ref in plan.refinements:
        of = next((s for s in state.states if s.candidate.name == ref.of), None)
        why = _refine_skip(of, state.base_p50 if auto else None, baseline) or (
            _ranked_skip(of, state.states) if auto else ""
        )
        if not why and ref.of in rescued:
            why = f"{rescued[ref.of]} (a refinement of {ref.of}) already meets the budget"
        if not why and plan.max_refinements is not None and refined >= plan.max_refinements:
            why = f"over the bound on refinements ({plan.bound_name or plan.max_refinements})"
        if not why and state.over_time_budget():
            why = f"over the search time budget ({state.time_budget_s:.0f} s)"
        if not why:
            why = _too_long(state, ref.candidate)
        if why:
            state.skipped.append(_skipped(ref.candidate.name, why, ref.candidate))
            continue
        refined += 1
        st = _attempt(state, ref.candidate, screen=True)  # timed in the final round if it passes
        if st.outcome is not None and st.outcome.status == "passed":
            rescued[ref.of] = ref.candidate.name


def _rescue(state: SearchState) -> None:
    """Mixed precision, when nothing within the budget is as fast as the fastest quantized candidate."""
    auto, precision, notes = state.auto, state.precision, state.notes
    over = state.over_time_budget()
    passing = any(
        s.outcome is not None and s.outcome.status == "passed" and (auto or s.candidate.precision == precision)
        for s in state.states
    )
    ranking_refused = ""
    if state.memory is not None:
        ranking_refused = state.memory.ranking_refusal(_open_sessions(state))
    if (auto or state.mixed_precision) and over and passing:
        notes.append(f"mixed precision not tried: over the search time budget ({state.time_budget_s:.0f} s)")
    elif (auto or state.mixed_precision) and ranking_refused:
        notes.append(f"mixed precision not tried: {ranking_refused}")
        state.say(f"[{state.target}] mixed precision not tried: {ranking_refused}")
    elif auto or state.mixed_precision:
        # nothing within the budget yet: the rescue runs even over the time budget (else the target
        # ships nothing; YOLOv8n on coral: conversion and 16x8 took 526 s of the 420)
        if over:
            notes.append(f"over the search time budget ({state.time_budget_s:.0f} s) with nothing within the budget: "
                         "mixed precision tried anyway")  # fmt: skip
        before = len(state.states)
        aimed = _mixed(
            state.states, lambda cand: _attempt(state, cand), lambda folder: _space(state, folder), auto, precision,
            state.base_p50, notes, state.say, state.target, measure=lambda cand: _measure(state, cand),
        )  # fmt: skip
        if aimed is not None:  # what the manifest says of the layers each mixed try keeps in float
            for s in state.states[before:]:
                state.excluded_by[s.candidate.name] = aimed.reason()


def _fallbacks(state: SearchState) -> None:
    """Under ``auto``, when nothing met the budget: the plan's fallbacks (a float artifact)."""
    auto, precision = state.auto, state.precision
    for cand in state.plan.fallback:
        met = next((s.candidate.name for s in state.states if s.outcome is not None and s.outcome.status == "passed"
                    and (auto or s.candidate.precision == precision)), None)  # fmt: skip
        if not auto:
            state.skipped.append(
                _skipped(cand.name, f"a fallback of --precision auto; --precision {precision} asked", cand)
            )
        elif met is not None:
            state.skipped.append(_skipped(cand.name, f"{met} already meets the budget (a fallback is built only when "
                                          "nothing does)", cand))  # fmt: skip
        else:
            state.say(f"[{state.target}] nothing met the budget; fallback: {cand.name}")
            _attempt(state, cand)


def _final_rounds(state: SearchState) -> None:
    """The final side-by-side round with full repeats, then the finalists' round (latency objective)."""
    # final round, with full repeats: everything the choice may pick (what passed; when nothing
    # choosable passed, every choosable built one: the most accurate is picked) and the baseline,
    # so the chosen's p50, the baseline's and the reference's come from this one measurement
    states, baseline, auto, precision = state.states, state.baseline, state.auto, state.precision
    final_states = _final_round(states, baseline, auto, precision)
    final = time_round(
        final_states, state.reference_open, state.one, state.threads, "final", repeats=20,
        budget_s=state.latency_budget_s, say=state.say, target=state.target, clock=state.clock,
    )  # fmt: skip
    state.rounds = {"final": final}
    state.reference_latency = final.get(REFERENCE)
    state.finalists = (
        _finalists(states, baseline, auto, precision)
        if state.objective == "latency" and state.device_latency is None
        else []
    )
    if state.finalists:
        # the candidates the final round could not tell apart, and the baseline, alone in one more
        # round: fewer functions per round is more calls each and no other runtime's threads in
        # between (digits: per-tensor and per-channel QDQ 0.27 vs 0.23 ms among 14 candidates,
        # 0.212 vs 0.214 ms alone)
        again = time_round(
            state.finalists, state.reference_open, state.one, state.threads, "finalists", repeats=60,
            budget_s=state.latency_budget_s, say=state.say, target=state.target, discard=2, clock=state.clock,
        )  # fmt: skip
        state.rounds["finalists"] = again
        state.reference_latency = again.get(REFERENCE, state.reference_latency)
        names = ", ".join(s.candidate.name for s in state.finalists)
        state.notes.append(f"finalists timed again side by side with {REFERENCE}: {names}")
    device_latency = state.device_latency
    if state.auto and state.objective == "latency" and device_latency is None and baseline is not None:
        finalists = state.finalists
        settled = head_to_head(
            states, baseline, state.rounds, state.one,
            eligible=lambda o: not finalists or o.timed_in == "finalists",
            budget_s=2 * state.latency_budget_s, say=state.say, target=state.target, clock=state.clock,
        )  # fmt: skip
        if settled is not None:
            state.rounds[HEAD_TO_HEAD] = settled[1]
            state.head_to_head = settled[0]
    if device_latency is not None:
        device_times(states, device_latency)
        timed = [s.candidate.name for s in states if s.outcome is not None and s.outcome.latency is not None]
        untimed = [s.candidate.name for s in states if s.outcome is not None and s.outcome.comparison is not None
                   and s.outcome.latency is None]  # fmt: skip
        state.notes.append(
            f"latency of {len(timed)} candidate(s) from the {device_latency.label}"
            + (f"; not in the profile (not timed on the device): {', '.join(untimed)}" if untimed else "")
        )
        # the reference is the target's own FP32 on the device (the host's ORT FP32 is not comparable)
        state.reference_latency = baseline.outcome.latency if baseline is not None and baseline.outcome else None


def _choice(state: SearchState) -> SearchResult:
    """The choice by objective, beyond the measured noise, and the fallback chain after it."""
    states, baseline, auto, precision, notes = state.states, state.baseline, state.auto, state.precision, state.notes
    objective, plan = state.objective, state.plan
    outcomes = [s.outcome for s in states if s.outcome is not None]
    choosable = [o for o in outcomes if auto or o.precision == precision]
    if not any(o.comparison is not None for o in choosable):
        _raise_none_built(states, precision, state.target)
    if state.finalists:  # latencies of one round only: the passing non-finalists lost the final round by a margin
        choosable = [
            o for o in choosable if o.timed_in == "finalists" or o.comparison is None or not o.comparison.passed
        ]
    base_out = baseline.outcome if baseline is not None else None
    chosen, why = choose(choosable, objective, auto, base_out)
    everything = [o for o in outcomes if auto or o.precision == precision]
    chain = _chain(chosen, everything, objective, auto, base_out)
    noise: dict[str, str] = {}  # name -> its speed-up over the baseline with the interval, where measured
    if auto and objective == "latency" and state.device_latency is None and base_out is not None:
        decided = {state.head_to_head: HEAD_TO_HEAD} if state.head_to_head else None
        chain, noise, dropped = beyond_noise(chain, base_out, state.rounds, decided)
        if state.head_to_head and state.head_to_head in noise:
            notes.append(f"{state.head_to_head} timed again alone with {base_out.name}: {noise[state.head_to_head]}")
        if dropped:
            notes.append(f"not faster than {base_out.name} beyond the measured noise, left out: " + "; ".join(dropped))
    if chain and chain[0] is not chosen:  # within the sampling error of selection, or of the timing
        behind = chosen.marginal or f"its speed-up is within the measured noise ({noise.get(chosen.name, '')})"
        why = (
            f"first of the candidates that passed selection clear of its sampling error and beat "
            f"{base_out.name if base_out else 'fp32'} beyond the timing noise; {chosen.name} "
            f"({why.split(' (')[0]}) ranks behind it, {behind}"
        )
        chosen = chain[0]
    elif not chain and auto and base_out is not None and chosen is not base_out and chosen.comparison is not None \
            and chosen.comparison.passed and baseline is not None and baseline.built is not None:  # fmt: skip
        why = (
            f"no candidate beat {base_out.name} beyond the measured noise (the fastest within the budget, "
            f"{chosen.name}: {noise.get(chosen.name, '')}); the plain fp32 artifact ships"
        )
        chosen = base_out
    if chosen.name in noise:
        why += f"; {noise[chosen.name]}"
    pending: tuple[Candidate, ...] = ()
    if auto:
        built_names = {s.candidate.name for s in states}
        pending = tuple(c for c in plan.fallback if c.name not in built_names)
        if baseline is not None and baseline.built is not None and base_out is not None and _absent(base_out, chain):
            chain.append(base_out)  # the target's fp32: always the last resort
        elif baseline is None:  # no fp32 of its own: its float fallbacks are the last resort
            chain += [o for o in outcomes if o.name in {c.name for c in plan.fallback} and o.comparison is not None
                      and _absent(o, chain)]  # fmt: skip
    chosen_state = next(s for s in states if s.outcome is chosen)
    if chosen_state.built is None:
        raise ValueError(f"{chosen.name} was chosen but has no build")  # choose() only returns built ones
    slower = bool(
        base_out is not None
        and base_out.p50_ms is not None
        and chosen.p50_ms is not None
        and chosen is not base_out
        and chosen.p50_ms > base_out.p50_ms
    )
    records = tuple(dataclasses.replace(o, status="chosen") if o is chosen else o for o in (*outcomes, *state.skipped))
    return SearchResult(
        chosen=dataclasses.replace(chosen, status="chosen"),
        built=chosen_state.built,
        built_dir=chosen_state.folder,
        why=why,
        outcomes=records,
        reference_latency=state.reference_latency,
        baseline=base_out,
        slower_than_fp32=slower,
        objective=objective,
        data=state.data,
        threads=state.threads,
        notes=tuple(notes),
        elapsed_s=time.perf_counter() - state.t0,
        kept={
            s.candidate.name: (s.built, s.folder)
            for s in states
            if s.built is not None
            and s.outcome is not None
            and (s.outcome.status == "passed" or s.outcome is chosen or s is baseline or not _absent(s.outcome, chain))
        },
        chain=tuple(o.name for o in chain if o is not chosen),
        pending=pending,
        excluded_by=dict(state.excluded_by),
        build_late=functools.partial(_build_late, state),
    )


# -- one candidate ---------------------------------------------------------------------------------


def _space(state: SearchState, folder: Path) -> BuildSpace:
    return BuildSpace(
        work_dir=folder, calib=state.data.calib, served=state.served, calib_batch=state.calib_batch, progress=state.say
    )


def _dominated(state: SearchState, run: RunFn) -> str:
    """Why ``run`` is dominated on its first calls (slower than the target's FP32 baseline, or
    the FP32 source where the target has none, by more than ``dominated_factor`` and slower
    than ``DOMINATED_MIN_MS``), else ""."""
    cand_ms = prescreen_ms(run, state.one, PRESCREEN_CALLS, statistic="min", clock=state.clock)
    if cand_ms <= DOMINATED_MIN_MS:
        return ""
    base = next((s for s in state.states if s.candidate.baseline and s.run is not None), None)
    name = base.candidate.name if base is not None else REFERENCE
    against = state.against
    if name not in against:
        fn = base.run if base is not None and base.run is not None else state.reference_open(state.threads)
        against[name] = prescreen_ms(fn, state.one, 5, statistic="median", clock=state.clock)  # once: a steadier median
    factor = state.dominated_factor or 0.0
    if cand_ms <= factor * against[name]:
        return ""
    return (
        f"dominated on its first calls: {cand_ms:.1f} ms, {cand_ms / max(against[name], 1e-9):.1f}x {name} "
        f"({against[name]:.1f} ms; over {factor:g}x), and auto ships nothing slower than fp32: "
        "its accuracy run and timing rounds were skipped"
    )


def _attempt(state: SearchState, cand: Candidate, screen: bool = False) -> CandidateState:
    """Build ``cand`` in its own folder (or reuse another target's identical build), prescreen it,
    measure it on the selection samples; a build or run that raises is recorded as an error."""
    states, target, say, shared = state.states, state.target, state.say, state.shared
    folder = state.work_dir / f"{len(states):02d}-{_slug(cand.name)}"
    folder.mkdir(parents=True)
    st = CandidateState(cand, folder)
    states.append(st)
    say(f"[{target}] candidate {len(states)}: {cand.name}")
    refused = _refusal(state, cand)
    if refused:  # refused before it is built: the process would go over the bound, or be killed
        say(f"[{target}]   skipped: {refused}")
        st.outcome = _skipped(cand.name, refused, cand)
        return st
    started = time.perf_counter()
    key = (cand.runtime, cand.name, *(f"{k}={v}" for k, v in sorted(cand.settings.items())))
    try:
        if shared is not None and key in shared:
            st.folder, st.built = shared[key]
            say(f"[{target}]   same build as another target's (reused)")
        else:
            st.built = cand.build(_space(state, folder))
            if shared is not None:
                shared[key] = (folder, st.built)
        st.run = st.built.open(state.threads) if st.built.open is not None else st.built.intermediate
        if st.run is None:
            raise ValueError("the candidate can neither run here nor gave an intermediate to measure")
        prescreened = screen and state.prescreen and st.built.open is not None and not cand.baseline
        slow = _dominated(state, st.run) if prescreened else ""
        if slow:
            st.run = None  # never timed again, never chosen
            say(f"[{target}]   skipped: {slow}")
            st.outcome = _skipped(cand.name, slow, cand)
            return st
        served = state.served
        outputs = run_all(st.run, state.data.selection, state.batch, pad=fixed_batch(served) is not None)
        comparison = compare(state.ref_out, outputs, state.kind, state.tolerance, tasks=state.tasks, post=state.post)
        if state.kind == "classifier":
            comparison = flip_gate(comparison, state.ref_out, outputs, state.data, state.tolerance)
        marginal = selection_margin(state.ref_out, outputs, comparison)
        if st.built.open is not None and state.memory is not None and state.memory.reopen_after_accuracy():
            # the session keeps its arena at the accuracy pass's size (16 samples per call: 0.6 GB for
            # a 512x512 conv model), and the search keeps every candidate's open for its timing
            # rounds, one sample per call: those get a fresh session (the old one freed first)
            del outputs
            st.run = None
            st.run = st.built.open(state.threads)
    # A candidate's SDK may raise anything (ORT's quantizer raised ValueError from numpy on an
    # int32-input model): that candidate failed, the search goes on.
    except Exception as exc:
        st.run = None
        st.error = exc
        reason = _reason(exc)
        say(f"[{target}]   failed: {reason}")
        st.outcome = _outcome(cand, "error", reason, None, st, time.perf_counter() - started)
        return st
    status = "passed" if comparison.passed else "failed"
    reason = "" if comparison.passed else "; ".join(comparison.failures)
    say(f"[{target}]   {comparison.summary()} ({status})" + (f"; {marginal}" if marginal else ""))
    st.outcome = _outcome(cand, status, reason, comparison, st, time.perf_counter() - started)
    st.outcome = dataclasses.replace(st.outcome, marginal=marginal)
    return st


def _refusal(state: SearchState, cand: Candidate) -> str:
    """Why ``cand`` is not built under the memory bound (``MemoryModel.refusal``), or ""."""
    if state.memory is None:
        return ""
    per_call = cand.calib_call_samples
    if per_call is not None:  # a calibrator sees one batch at least: a fixed batch of B is B samples
        per_call = max(per_call, fixed_batch(state.served) or 1)
    return str(state.memory.refusal(cand.precision, cand.holds_every_sample, per_call, _open_sessions(state)))


def _open_sessions(state: SearchState) -> int:
    """The measured candidates whose sessions are still open (kept for the timing rounds)."""
    return sum(1 for s in state.states if s.run is not None and s.built is not None and s.built.open is not None)


def _measure(state: SearchState, cand: Candidate) -> Comparison:
    """``cand`` built in a scratch folder and judged as ``_attempt`` judges it (the gate's
    ``compare`` on the selection samples), without a record: what keeping a layer group in float
    does, for the mixed-precision ranking. The folder is removed afterwards; it sits beside the
    candidates' folders, where the calibration ranges are cached."""
    refused = _refusal(state, cand)
    if refused:
        raise ValueError(refused)
    folder = state.work_dir / f"measure-{_slug(cand.name)}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        built = cand.build(_space(state, folder))
        run = built.open(state.threads) if built.open is not None else built.intermediate
        if run is None:
            raise ValueError("the candidate can neither run here nor gave an intermediate to measure")
        outputs = run_all(run, state.data.selection, state.batch, pad=fixed_batch(state.served) is not None)
        del run
        comparison = compare(state.ref_out, outputs, state.kind, state.tolerance, tasks=state.tasks, post=state.post)
        if state.kind == "classifier":
            comparison = flip_gate(comparison, state.ref_out, outputs, state.data, state.tolerance)
        return comparison
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _build_late(state: SearchState, cand: Candidate) -> tuple[Built, Path]:
    """Build a float candidate the search did not (the final gate failed what it chose)."""
    folder = state.work_dir / f"{len(state.states):02d}-{_slug(cand.name)}"
    folder.mkdir(parents=True)
    state.states.append(CandidateState(cand, folder))
    return cand.build(_space(state, folder)), folder


def _absent(o: Outcome, among: list[Outcome]) -> bool:
    return not any(x is o for x in among)


def _chain(
    chosen: Outcome, outcomes: list[Outcome], objective: str, auto: bool, baseline: Outcome | None
) -> list[Outcome]:
    """The passing candidates in the order the final gate tries them: ``chosen`` first, the rest
    ranked by the objective (``choose`` again on what is left), the ones that passed selection
    within its sampling error (``Outcome.marginal``) behind those clear of it. Under ``auto`` the
    ranking stops at the target's FP32 (``baseline``): what ranks after it is slower than it,
    and it is the last resort (the caller appends it)."""
    pool = [o for o in outcomes if o.comparison is not None and o.comparison.passed and o is not chosen]
    order = [chosen] if chosen.comparison is not None and chosen.comparison.passed else []
    while pool:
        base = baseline if any(o is baseline for o in pool) else None
        pick, _ = choose(pool, objective, auto, base)
        order.append(pick)
        pool = [o for o in pool if o is not pick]
    if auto and baseline is not None and any(o is baseline for o in order):
        order = order[: next(i for i, o in enumerate(order) if o is baseline)]
    return [o for o in order if not o.marginal] + [o for o in order if o.marginal]


# -- steps -----------------------------------------------------------------------------------


def flip_gate(
    comparison: Comparison,
    reference: Mapping[str, np.ndarray],
    outputs: Mapping[str, np.ndarray],
    data: SearchData,
    tolerance: Tolerance,
) -> Comparison:
    """``comparison`` with the predicted top-1 agreement (``optimize.flip_risk``) recorded and, below
    ``min_top1_agreement``, a failure: agreement on easy selection samples saturates at 1.0 and
    does not tell the candidates that will flip the gate's close decisions apart."""
    from edgekit.optimize.flip_risk import predicted_agreement, top1_margins

    first = next(iter(reference))
    ref, got = reference[first], outputs[first]
    margins = data.margins if data.margins is not None else top1_margins(ref)
    predicted = predicted_agreement(ref, got, margins)
    failures = comparison.failures
    floor = tolerance.min_top1_agreement
    if floor is not None and predicted < floor and comparison.passed:
        failures = (
            f"predicted top-1 agreement {predicted:.4g} on inputs as close to the decision boundary as "
            f"{data.margins_source or 'the selection samples'}, needs >= {floor:.4g} (off by {floor - predicted:.4g}): "
            "the selection samples agree but leave too little margin",
        )
    return dataclasses.replace(comparison, predicted_top1_agreement=predicted, failures=failures)


def _final_round(
    states: list[CandidateState], baseline: CandidateState | None, auto: bool, precision: str
) -> list[CandidateState]:
    """The states timed in the final round: every one ``choose`` may return, and the baseline."""
    choosable = [s for s in states if s.outcome is not None and (auto or s.candidate.precision == precision)]
    picked = [s for s in states if s.outcome is not None and s.outcome.status == "passed"]
    if not any(s.outcome is not None and s.outcome.status == "passed" for s in choosable):
        picked += [s for s in choosable if s.outcome is not None and s.outcome.comparison is not None]
    if baseline is not None and baseline.run is not None:
        picked.append(baseline)
    return [s for s in states if any(s is p for p in picked)]  # each once, in build order


def _finalists(
    states: list[CandidateState], baseline: CandidateState | None, auto: bool, precision: str
) -> list[CandidateState]:
    """The passing choosable candidates of the final round within ``FINALIST_MARGIN`` of its
    fastest (at most ``MAX_FINALISTS``), with the baseline; empty when only one is that close."""
    pool = [
        s
        for s in states
        if s.outcome is not None
        and s.outcome.status == "passed"
        and s.outcome.timed_in == "final"
        and s.outcome.p50_ms is not None
        and s.run is not None
        and (auto or s.candidate.precision == precision or s is baseline)
    ]
    if not pool:
        return []
    fastest = min(_p50(s) or 0.0 for s in pool)
    close = sorted(
        (s for s in pool if (_p50(s) or 0.0) <= fastest * (1 + FINALIST_MARGIN)), key=lambda s: _p50(s) or 0.0
    )
    close = close[:MAX_FINALISTS]
    if baseline is not None and baseline.run is not None and not any(s is baseline for s in close):
        if len(close) < 2:  # one clear winner, well ahead of the baseline: nothing to separate
            return []
        close.append(baseline)
    if len(close) < 2:
        return []
    return [s for s in states if any(s is c for c in close)]


def _ranked_skip(of: CandidateState | None, states: list[CandidateState]) -> str:
    """Where nothing is timed: a refinement cannot beat a passing candidate ranked at least as
    fast on the device (a calibration change does not change the rank)."""
    if of is None or of.outcome is None or of.outcome.p50_ms is not None or of.candidate.device_rank is None:
        return ""
    rank = of.candidate.device_rank
    for s in states:
        o = s.outcome
        if o is not None and o.status == "passed" and o.p50_ms is None and _rank(s) <= rank:
            return (
                f"{o.name} (device rank {s.candidate.device_rank}) already meets the budget; "
                f"{of.candidate.name} ranks {rank}"
            )
    return ""


def _too_long(state: SearchState, cand: Candidate) -> str:
    """Why ``cand`` is not built: its expected build time (``Candidate.cost_s`` at the baseline's
    p50) is over what is left of the search time budget; "" where it fits or cannot be told."""
    if cand.cost_s is None or state.base_p50 is None or state.time_budget_s is None:
        return ""
    # the baseline's p50 is one call (a fixed batch of B is B samples): what the estimate counts
    calls = sample_count(state.data.calib) // (fixed_batch(state.served) or 1)
    seconds, how = cand.cost_s(state.base_p50, max(1, calls))
    left = state.time_budget_s - (time.perf_counter() - state.t0)
    if seconds <= left:
        return ""
    return (
        f"would take up to ~{seconds:.0f} s ({how}), over the {max(left, 0):.0f} s left of the search time budget "
        f"({state.time_budget_s:.0f} s); mixed precision keeps layers in float within its own bound instead"
    )


def _refine_skip(of: CandidateState | None, base_p50: float | None, baseline: CandidateState | None) -> str:
    if of is None or of.outcome is None:
        return "the candidate it refines was not built"
    o = of.outcome
    if o.status == "error":
        return f"{o.name} failed to build; a calibration change does not fix that"
    if o.status == "skipped":
        return f"{o.name} was skipped ({o.reason.split(':')[0]}); a calibration change does not change its speed"
    if o.status == "passed":
        return f"{o.name} is already within the budget"
    if _only_channels_failed(o.comparison):
        return (
            f"{o.name} missed on its worst channel only (one output scale for channels of different value "
            "scales): a calibration method moves that range, it does not split it; mixed precision keeps the "
            "tail in float instead"
        )
    if base_p50 is not None and o.p50_ms is not None and o.p50_ms > base_p50 * (1 + SPEED_TIE) and baseline:
        return (
            f"dominated: {o.name} measured {o.p50_ms:.3f} ms, slower than {baseline.candidate.name} "
            f"({base_p50:.3f} ms); calibration changes accuracy, not speed"
        )
    return ""


def _only_channels_failed(c: Comparison | None) -> bool:
    """The dense gate passed on cosine and relative error and failed on the worst channel alone."""
    if c is None or c.kind != "dense" or len(c.failures) != 1:
        return False
    t = c.tolerance
    return bool(
        t.min_channel_cosine is not None and c.channel_cosine is not None and c.channel_cosine < t.min_channel_cosine
    )


def _mixed(
    states: list[CandidateState],
    attempt: Callable[[Candidate], CandidateState],
    space: Callable[[Path], BuildSpace],
    auto: bool,
    precision: str,
    base_p50: float | None,
    notes: list[str],
    say: Callable[[str], None],
    target: str,
    measure: Callable[[Candidate], Comparison] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> AimedRanking | None:
    """Mixed-precision rescue of the fastest quantized candidate that missed the budget.
    ``measure``: a candidate -> the gate's comparison of it on the selection samples, unrecorded;
    where the candidate failed on a task measure (``optimize.aimed``), the most sensitive layer
    groups are re-ranked by that measure with it, and that ranking is returned (else None)."""

    def eligible(s: CandidateState) -> bool:
        o = s.outcome
        return bool(
            o is not None
            and o.status != "skipped"  # dominated on its first calls: keeping layers in float only slows it
            and s.built is not None
            and s.candidate.exclude is not None
            and s.candidate.rank_layers is not None
            and (auto or s.candidate.precision == precision)
        )

    quantized = [s for s in states if eligible(s) and s.outcome is not None]
    if not quantized:
        return None
    # by latency; where nothing is timed, by the target's device order, then the most accurate
    fastest = min(quantized, key=lambda s: (_p50(s) or float("inf"), _rank(s), _inaccuracy(s)))
    o = fastest.outcome
    if o is None or o.status != "failed":
        return None

    def as_fast(s: CandidateState) -> bool:
        if _p50(fastest) is not None:
            return (_p50(s) or float("inf")) <= (_p50(fastest) or 0)
        return _p50(s) is None and _rank(s) <= _rank(fastest) < float("inf")

    passing_faster = [
        s
        for s in states
        if s.outcome is not None
        and s.outcome.status == "passed"
        and (auto or s.candidate.precision == precision)
        and as_fast(s)
    ]
    if passing_faster:
        return None  # a candidate at least as fast already meets the budget
    if auto and base_p50 is not None and o.p50_ms is not None and o.p50_ms > base_p50 * (1 + SPEED_TIE):
        notes.append(f"mixed precision skipped: {o.name} is slower than fp32, keeping layers in float only slows it")
        return None
    assert fastest.built is not None and fastest.candidate.rank_layers is not None
    say(f"[{target}] {o.name} missed the budget; ranking its layers by sensitivity")
    try:
        ranked = fastest.candidate.rank_layers(space(fastest.folder), fastest.built)
    except Exception as exc:
        notes.append(f"mixed precision: ranking the layers of {o.name} failed ({_reason(exc)})")
        return None
    if not ranked:
        notes.append(f"mixed precision: {o.name} has no quantized layers to keep in float")
        return None
    notes.append(
        "layer sensitivity (most sensitive first): " + ", ".join(f"{'+'.join(g)} {s:.3g}" for g, s in ranked[:8])
    )
    exclude = fastest.candidate.exclude
    if exclude is None:
        return None
    aim = aim_of(o.comparison)
    aimed = None
    if aim is not None and measure is not None and o.comparison is not None:
        count = min(MAX_MEASURED_GROUPS, len(ranked))
        say(f"[{target}] {o.name} missed on {aim.name}: measuring it with each of the {count} most sensitive layer "
            "groups kept in float")  # fmt: skip
        keep = exclude
        aimed = aimed_ranking(ranked, aim, o.comparison, lambda group: measure(keep(group)), clock)
        say(f"[{target}]   layers ranked by {aim.name} ({len(aimed.measured)} groups measured, "
            f"{aimed.elapsed_s:.0f} s)")  # fmt: skip
        notes.append(aimed.text())
        ranked = aimed.ranked

    def top(k: int) -> tuple[str, ...]:  # the union of the k first groups, in rank order
        return tuple(dict.fromkeys(n for group, _ in ranked[:k] for n in group))

    every = set(top(len(ranked)))
    # keeping every quantized layer in float is FP32 under another name: never a candidate
    usable = next((k for k in range(1, len(ranked) + 1) if set(top(k)) >= every), len(ranked) + 1) - 1
    lo, hi, tries = 0, None, 0
    k = 1
    while tries < MAX_MIXED_TRIES and k <= usable:  # 1, 2, 4, ... groups until one passes
        tries += 1
        st = attempt(exclude(top(k)))
        if st.outcome is not None and st.outcome.status == "passed":
            hi = k
            break
        lo = k
        if k == usable:
            break
        k = min(2 * k, usable)
    while hi is not None and hi - lo > 1 and tries < MAX_MIXED_TRIES:  # the fewest that pass
        tries += 1
        mid = (lo + hi) // 2
        st = attempt(exclude(top(mid)))
        if st.outcome is not None and st.outcome.status == "passed":
            hi = mid
        else:
            lo = mid
    if hi is None:
        notes.append(f"mixed precision: keeping up to {len(top(lo))} layers in float did not meet the budget")
    return aimed


def _raise_none_built(states: list[CandidateState], precision: str, target: str) -> None:
    """Every candidate of the requested precision raised: the first one's own error where it is
    ours (it says what to do), else one error listing the reasons."""
    errors = [s for s in states if s.error is not None and (precision == "auto" or s.candidate.precision == precision)]
    for s in errors:
        if isinstance(s.error, EdgekitError):
            raise s.error
    reasons = "; ".join(f"{s.candidate.name}: {_reason(s.error)}" for s in errors if s.error is not None)
    refused = [s for s in states if s.outcome is not None and s.outcome.reason.startswith(REFUSAL)]
    if refused and not reasons:  # the memory bound refused every one, before any build: an argument to change
        raise ConfigError(
            f"{target}: no {precision} candidate fits the memory bound; {refused[0].candidate.name} "
            f"{refused[0].outcome.reason if refused[0].outcome else ''}"
        )
    raise OptimizationError(
        f"{target}: no {precision} candidate could be built ({reasons or 'none described'}); "
        "try another --precision for this target"
    )


def _p50(s: CandidateState | None) -> float | None:
    return None if s is None or s.outcome is None else s.outcome.p50_ms


def _rank(s: CandidateState) -> float:
    r = s.candidate.device_rank
    return float("inf") if r is None else float(r)


def _inaccuracy(s: CandidateState) -> tuple[float, float]:
    from edgekit.optimize.choose import accuracy_key

    if s.outcome is None:
        return (1.0, 1.0)
    a, b = accuracy_key(s.outcome)
    return (-a, -b)


def _outcome(
    cand: Candidate, status: str, reason: str, comparison: Comparison | None, st: CandidateState, build_s: float
) -> Outcome:
    built = st.built
    size = 0
    if built is not None:
        size = sum((st.folder / p).stat().st_size for p, role in built.files.items() if role == "artifact")
    prec: Precision | None = built.precision if built is not None else None
    return Outcome(
        name=cand.name,
        precision=cand.precision,
        runtime=cand.runtime,
        settings=dict(cand.settings),
        status=status,
        reason=reason,
        comparison=comparison,
        size_bytes=size,
        build_s=build_s,
        label=prec.label if prec else "",
        method=prec.method if prec else "",
        excluded_nodes=built.excluded_nodes if built is not None else (),
        baseline=cand.baseline,
        device_rank=cand.device_rank,
    )


def record_of(cand: Candidate, why: str) -> Outcome:
    """A record of ``cand`` that was not measured on the selection samples (status "skipped")."""
    return _skipped(cand.name, why, cand)


def _skipped(name: str, why: str, cand: Candidate | None = None) -> Outcome:
    return Outcome(
        name=name,
        precision=cand.precision if cand else "",
        runtime=cand.runtime if cand else "",
        settings=dict(cand.settings) if cand else {},
        status="skipped",
        reason=why,
    )


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "candidate"
