"""The golden self-test every candidate passes before it is served, run in a child process.

A crashing, hanging or memory-hungry runtime cannot take the daemon down: the parent
(``run_selftest``) starts ``python -m device_agents.selftest``, kills it after
``selftest.timeout_s`` or when its RSS goes over ``selftest.memory_mb`` (watched with psutil:
``RLIMIT_AS`` breaks ONNX Runtime, OpenVINO and TensorFlow, which reserve address space), and
reads its JSON report. The child leads its own session and is contained so that no process it
starts outlives it (``device_agents.containment``: a cgroup v2 of its own where the agent may
make one, else the child is a subreaper of its orphans): on any end (report, crash, timeout,
memory) the cgroup, or the child's whole tree (stopped first), its process group and every
descendant seen are SIGKILLed, and of its output only the last ``LOG_CAP_BYTES`` are kept, in
memory (nothing on disk grows); RSS is summed over the child and its descendants. The child
loads the model with its runtime, runs the golden vectors (``manifest.golden``: cosine,
atol/rtol, top-1 agreement) and measures p50 latency on one sample (one static batch): side by
side with the serving version (both loaded, timed interleaved, so that load on the device weighs
on both alike) when memory allows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from device_agents import containment as contain
from device_agents.errors import SelfTestError
from device_agents.faults import PID_FILE_ENV, fault_active, fault_point
from device_agents.processing.golden import check_golden_image
from device_agents.runtimes.options import RuntimesConfig
from edgekit.bundle.codec import from_data, to_data
from edgekit.bundle.manifest import Golden, Manifest

REPORT_NAME = "selftest.json"  # written next to the model's files by the lifecycle
_POLL_S = 0.02
_LATENCY_RUNS = 50
_LATENCY_BUDGET_S = 1.0
_SIDE_BY_SIDE_RUNS = 100  # per model
_BOTH_MEMORY_FRACTION = 0.8  # of selftest.memory_mb the child may plan to use with both loaded
LOG_CAP_BYTES = 1 << 20  # of the child's output kept (the tail)
REPORT_LOG_BYTES = 4096  # of that tail recorded in a failed report
_LOG_READ_PER_TICK = 256 * 1024  # per poll: a child writing faster waits on the pipe
_SCAN_EVERY = 10  # polls between looks for new descendants (a /proc scan)
_KILL_WAIT_S = 2.0


@dataclass(frozen=True)
class OutputCheck:
    name: str
    cosine: float
    max_abs_error: float
    within_tolerance: float  # fraction of elements within atol + rtol * |expected|
    top1_agreement: float | None = None
    passed: bool = False


@dataclass(frozen=True)
class SelfTestReport:
    passed: bool
    reason: str = ""  # why it failed, in one line
    latency_p50_ms: float | None = None
    baseline_p50_ms: float | None = None  # what the latency gate compared with
    # Where that came from: "side_by_side" (the serving version, timed interleaved in the child),
    # "live" (the serving version's own requests over latency_window_s), "recorded" (its self-test
    # at install), "host" (the manifest's host latency), "" (nothing to compare with).
    baseline_source: str = ""
    baseline_note: str = ""  # why not side by side, where it was asked for
    latency_window_s: tuple[float, float] | None = None  # CLOCK_MONOTONIC span of the candidate's timing
    outputs: tuple[OutputCheck, ...] = ()
    runtime: dict[str, Any] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    duration_s: float = 0.0
    log_tail: str = ""  # the end of the child's output, when it failed

    def to_json(self) -> bytes:
        return json.dumps(to_data(self), indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes) -> SelfTestReport:
        return from_data(cls, json.loads(raw), "selftest", SelfTestError)


def run_selftest(
    model_dir: Path,
    *,
    timeout_s: float,
    memory_mb: int,
    options: RuntimesConfig,
    work_dir: Path,
    baseline_dir: Path | None = None,
    containment: str = "auto",
) -> SelfTestReport:
    """Self-test the extracted bundle in ``model_dir`` in a child process; never raises for a bad model.

    ``baseline_dir``: the serving version's extracted bundle, timed side by side with the
    candidate in the child when both fit in ``memory_mb`` (``baseline_source`` "side_by_side");
    otherwise the report carries ``latency_window_s`` for a comparison with live traffic and
    leaves the verdict on latency to the caller.

    The child runs in its own session (process group), contained as ``containment`` says
    (``device_agents.containment``); whatever happens, every process it started is SIGKILLed
    before this returns, and only the last ``LOG_CAP_BYTES`` of its output are kept (in memory;
    a flooding child blocks on the pipe)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    result_path = work_dir / f"selftest-{uuid.uuid4().hex[:12]}.json"
    cmd = [
        sys.executable,
        "-m",
        "device_agents.selftest",
        str(model_dir),
        json.dumps(to_data(options)),
        str(result_path),
        json.dumps(to_data(ChildPlan(str(baseline_dir) if baseline_dir else "", memory_mb))),
    ]
    start = time.monotonic()
    try:
        child = ContainedChild(cmd, containment)
    except OSError as exc:
        raise SelfTestError(f"cannot start the self-test process: {exc}") from exc
    try:
        while child.poll() is None:
            elapsed = time.monotonic() - start
            if child.peak_rss > memory_mb * 1024 * 1024:
                used = child.peak_rss / 2**20
                return child.failed(f"used {used:.0f} MB, over selftest.memory_mb = {memory_mb}", elapsed)
            if elapsed > timeout_s:
                return child.failed(f"did not finish within selftest.timeout_s = {timeout_s:g} s", elapsed)
            time.sleep(_POLL_S)
        child.kill_all()  # helpers the runtime left behind
        elapsed = time.monotonic() - start
        try:
            report = SelfTestReport.from_json(result_path.read_bytes())
        except (OSError, ValueError, SelfTestError):
            code = child.returncode
            how = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
            return child.failed(f"the self-test process {how} without a report", elapsed)
        return replace(report, peak_rss_mb=round(child.peak_rss / 2**20, 1), duration_s=round(elapsed, 3))
    finally:
        child.kill_all()
        child.close()
        result_path.unlink(missing_ok=True)
        result_path.with_name(result_path.name + ".tmp").unlink(missing_ok=True)


class ContainedChild:
    """A child process in its own session (and cgroup, or a subreaper of its orphans: see
    ``device_agents.containment``), its output's tail, and the descendants it starts.

    ``poll`` reads at most ``_LOG_READ_PER_TICK`` bytes of output per call (the child blocks on
    the full pipe beyond that), keeps the last ``LOG_CAP_BYTES``, samples RSS summed over the
    child and its descendants, and every ``_SCAN_EVERY`` calls looks for new descendants.
    ``kill_all`` kills the cgroup, then (the child still running) its whole tree, stopped first,
    then the process group and every descendant seen (one that left the group with ``setsid``
    too), and reaps the child; ``close`` removes the cgroup."""

    def __init__(self, cmd: list[str], containment: str = "auto") -> None:
        import psutil

        self.cgroup: contain.Cgroup | None = None
        env = None
        if containment == "subreaper":
            _note_containment("subreaper", "the child is a subreaper of its helpers (selftest.containment)")
        else:
            self.cgroup, why = contain.Cgroup.create()
            if self.cgroup is None:
                if containment == "cgroup":
                    raise OSError(f'selftest.containment = "cgroup": {why}')
                _note_containment("subreaper", f"no cgroup of its own ({why}): the child is a subreaper of its helpers")
            else:
                env = {**os.environ, contain.CGROUP_ENV: str(self.cgroup.path)}
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd, start_new_session=True, env=env
            )
        except OSError:
            os.close(read_fd)
            if self.cgroup is not None:
                self.cgroup.remove()
            raise
        finally:
            os.close(write_fd)
        if self.cgroup is not None:
            self.cgroup = self._join_cgroup(self.cgroup, containment)
        os.set_blocking(read_fd, False)
        self._fd: int | None = read_fd
        self._root = psutil.Process(self.proc.pid)
        self._seen: dict[int, Any] = {self.proc.pid: self._root}
        self._ticks = 0
        self.log = bytearray()
        self.log_bytes = 0  # everything read, kept or not
        self.peak_rss = 0

    def _join_cgroup(self, cgroup: contain.Cgroup, containment: str) -> contain.Cgroup | None:
        """Move the child into ``cgroup`` (it moves itself too, first thing: nothing it starts is
        born outside); where the kernel refuses (not delegated, controllers on), go on without."""
        try:
            cgroup.add(self.proc.pid)
        except OSError as exc:
            if self.proc.pid in cgroup.pids():
                return cgroup  # it moved itself meanwhile
            cgroup.remove()
            if containment == "cgroup":
                self.proc.kill()
                self.proc.wait()
                raise OSError(
                    f'selftest.containment = "cgroup": cannot move the child into its cgroup ({exc})'
                ) from exc
            why = f"its cgroup refused it ({exc.strerror or exc})"
            _note_containment("subreaper", f"{why}: the child is a subreaper of its helpers")
            return None
        _note_containment("cgroup", f"each child runs in a cgroup of its own under {cgroup.path.parent}")
        return cgroup

    @property
    def returncode(self) -> int:
        return self.proc.returncode if self.proc.returncode is not None else 0

    def poll(self) -> int | None:
        import psutil

        self._pump(_LOG_READ_PER_TICK)
        if self._ticks % _SCAN_EVERY == 0:
            try:
                for p in self._root.children(recursive=True):
                    self._seen.setdefault(p.pid, p)
            except psutil.Error:
                pass  # the child exited between two reads
        self._ticks += 1
        rss = 0
        for p in list(self._seen.values()):
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass  # exited
        self.peak_rss = max(self.peak_rss, rss)
        return self.proc.poll()

    def kill_all(self) -> None:
        import psutil

        if self.cgroup is not None:
            self.cgroup.kill()  # everything the child started, wherever it went
        if self.proc.poll() is None:  # a subreaper: its orphans are still in its tree
            contain.kill_all(contain.stop_tree(self._root))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # pgid == pid: start_new_session
        with contextlib.suppress(psutil.Error):
            for p in self._root.children(recursive=True):
                self._seen.setdefault(p.pid, p)
        others = [p for pid, p in self._seen.items() if pid != self.proc.pid]
        for p in others:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the pid was not reused
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        # SIGKILL lands asynchronously; wait (briefly) until the others are gone or zombies.
        deadline = time.monotonic() + _KILL_WAIT_S
        while others and time.monotonic() < deadline:
            others = [p for p in others if _running(p)]
            if others:
                time.sleep(0.01)

    def failed(self, reason: str, elapsed: float) -> SelfTestReport:
        """A failed report for ``reason`` plus the last lines of output."""
        self.kill_all()
        self._pump(LOG_CAP_BYTES)
        return SelfTestReport(
            passed=False,
            reason=reason + self.tail_lines(),
            peak_rss_mb=round(self.peak_rss / 2**20, 1),
            duration_s=round(elapsed, 3),
            log_tail=bytes(self.log[-REPORT_LOG_BYTES:]).decode(errors="replace"),
        )

    def tail_lines(self, lines: int = 3, width: int = 200) -> str:
        text = bytes(self.log[-8 * width :]).decode(errors="replace").strip().splitlines()
        return (": " + " | ".join(t[:width] for t in text[-lines:])) if text else ""

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None

    def _pump(self, budget: int) -> None:
        while budget > 0 and self._fd is not None:
            try:
                block = os.read(self._fd, min(65536, budget))
            except BlockingIOError:
                return
            if not block:
                return  # EOF: every writer is gone
            budget -= len(block)
            self.log_bytes += len(block)
            self.log += block
            if len(self.log) > LOG_CAP_BYTES:
                del self.log[: len(self.log) - LOG_CAP_BYTES]


_noted: set[str] = set()


def _note_containment(kind: str, how: str) -> None:
    """Say once per agent how self-test children are contained (``kind``: cgroup or subreaper)."""
    if kind not in _noted:
        _noted.add(kind)
        logging.getLogger("edgekit.agent").info("self-test containment: %s", how)


def _running(p: Any) -> bool:
    import psutil

    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def latency_verdict(p50_ms: float | None, baseline_ms: float | None, slack: float, floor_ms: float) -> str:
    """Why ``p50_ms`` is too slow against ``baseline_ms``, or "" when it is acceptable."""
    if p50_ms is None or baseline_ms is None or slack <= 0 or p50_ms < floor_ms:
        return ""
    limit = slack * baseline_ms
    if p50_ms > limit:
        return (
            f"p50 latency {p50_ms:.3f} ms is over selftest.latency_slack ({slack:g}) x the baseline "
            f"{baseline_ms:.3f} ms = {limit:.3f} ms"
        )
    return ""


def compare_outputs(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], golden: Golden) -> list[OutputCheck]:
    checks = []
    for name, want in expected.items():
        have = got[name]
        if have.shape != want.shape:
            checks.append(OutputCheck(name, 0.0, float("inf"), 0.0, None, False))
            continue
        a, b = have.astype(np.float64).ravel(), want.astype(np.float64).ravel()
        na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
        cosine = 1.0 if na == 0 and nb == 0 else float(a @ b / (na * nb)) if na and nb else 0.0
        err = np.abs(a - b)
        within = float(np.mean(err <= golden.atol + golden.rtol * np.abs(b))) if b.size else 1.0
        top1 = None
        if golden.min_top1_agreement is not None and want.ndim >= 2:
            top1 = float(np.mean(np.argmax(have, axis=-1) == np.argmax(want, axis=-1)))
        passed = (
            cosine >= golden.min_cosine and within == 1.0 and (top1 is None or top1 >= golden.min_top1_agreement)  # type: ignore[operator]  # not None when top1 is set
        )
        checks.append(OutputCheck(name, cosine, float(err.max()) if err.size else 0.0, within, top1, passed))
    return checks


# -- the child ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildPlan:
    """What the parent asks of the child beyond the candidate: the serving version to time
    side by side (its extracted dir) and the memory bound both must fit in."""

    baseline_dir: str = ""
    memory_mb: int = 0


def _child(model_dir: Path, options: RuntimesConfig, plan: ChildPlan) -> SelfTestReport:
    manifest = Manifest.from_json((model_dir / "manifest.json").read_bytes())
    fault_point("selftest_child")
    if fault_active("selftest_flood"):
        _flood()
    if fault_active("selftest_double_fork"):
        _double_fork()
    rss_before = _rss_bytes()
    model = _load(model_dir, manifest, options)
    model_cost = max(0, _rss_bytes() - rss_before)
    try:
        inputs, expected = _golden(model_dir, manifest)
        checks = compare_outputs(_infer_batches(model, manifest, inputs), expected, manifest.golden)
        # a bundle that pre- and post-processes also carries an image and the host's whole-pipeline answer
        image = check_golden_image(manifest, model_dir, model.infer)
        if image is not None:
            checks.append(OutputCheck("golden image", float(image[0]), 0.0, float(image[0]), None, image[0]))
        failed = [c for c in checks if not c.passed]
        reason = ""
        if image is not None and not image[0]:
            reason = image[1]
        elif failed:
            c = failed[0]
            reason = (
                f"output {c.name!r} does not match the golden vectors: cosine {c.cosine:.4f} "
                f"(min {manifest.golden.min_cosine}), {c.within_tolerance:.1%} within atol {manifest.golden.atol:g} "
                f"+ rtol {manifest.golden.rtol:g}"
                + (f", top-1 agreement {c.top1_agreement:.1%}" if c.top1_agreement is not None else "")
            )
        report = SelfTestReport(
            passed=not failed,
            reason=reason,
            outputs=tuple(checks),
            runtime={str(k): v for k, v in model.runner.describe().items()},
        )
        return replace(report, **_latency(model, _one_batch(manifest, inputs), options, plan, model_cost))
    finally:
        model.close()


def _latency(
    model: Any, one: dict[str, np.ndarray], options: RuntimesConfig, plan: ChildPlan, cost: int
) -> dict[str, Any]:
    """The latency fields of the report: side by side with the serving version when it loads
    here within the memory bound, else the candidate alone with the window it was timed in."""
    baseline, note = None, ""
    if plan.baseline_dir:
        base_dir = Path(plan.baseline_dir)
        limit = plan.memory_mb * 2**20 * _BOTH_MEMORY_FRACTION
        need = _rss_bytes() + max(cost, _artifact_bytes(base_dir))
        if plan.memory_mb and need > limit:
            note = (
                f"the serving version is not loaded beside the candidate: about {need / 2**20:.0f} MB "
                f"needed, over {_BOTH_MEMORY_FRACTION:.0%} of selftest.memory_mb = {plan.memory_mb}"
            )
        else:
            try:
                base_manifest = Manifest.from_json((base_dir / "manifest.json").read_bytes())
                baseline = _load(base_dir, base_manifest, options)
                base_one = _one_batch(base_manifest, _golden(base_dir, base_manifest)[0])
            except Exception as exc:  # the serving version's trouble is never the candidate's
                note = f"the serving version does not load beside the candidate ({type(exc).__name__}: {exc})"
                if baseline is not None:
                    baseline.close()
                baseline = None
    if baseline is None:
        p50, window = _p50_ms(model, one)
        return {"latency_p50_ms": p50, "latency_window_s": window, "baseline_note": note}
    try:
        p50, base_p50 = _p50_side_by_side(model, one, baseline, base_one)
    finally:
        baseline.close()
    return {"latency_p50_ms": p50, "baseline_p50_ms": base_p50, "baseline_source": "side_by_side"}


def _load(model_dir: Path, manifest: Manifest, options: RuntimesConfig) -> Any:
    from device_agents.runtimes import load_model

    return load_model(model_dir, manifest, options.options_for(manifest.compatibility.runtime))


def _golden(model_dir: Path, manifest: Manifest) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    with np.load(model_dir / manifest.golden.file, allow_pickle=False) as golden:
        inputs = {s.name: golden[f"in_{s.name}"] for s in manifest.signature.inputs}
        expected = {s.name: golden[f"out_{s.name}"] for s in manifest.signature.outputs}
    return inputs, expected


def _artifact_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _infer_batches(model: Any, manifest: Manifest, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All golden samples through ``model``: at once where the batch axis is dynamic, else one
    static batch at a time (a batch-1 Edge TPU / Core ML artifact still checks every sample)."""
    first = manifest.signature.inputs[0]
    batch = first.shape[0] if first.shape and isinstance(first.shape[0], int) else None
    total = len(inputs[first.name])
    if batch is None or batch >= total:
        return dict(model.infer(inputs))
    parts: dict[str, list[np.ndarray]] = {}
    for start in range(0, total, batch):
        for name, value in model.infer({k: v[start : start + batch] for k, v in inputs.items()}).items():
            parts.setdefault(name, []).append(value)
    return {name: np.concatenate(values) for name, values in parts.items()}


def _one_batch(manifest: Manifest, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One sample (the first), or one static batch where the batch axis is fixed."""
    return {
        s.name: inputs[s.name][: s.shape[0] if s.shape and isinstance(s.shape[0], int) else 1]
        for s in manifest.signature.inputs
    }


def _p50_ms(model: Any, one: dict[str, np.ndarray]) -> tuple[float, tuple[float, float]]:
    """p50 of the runtime's time on ``one``, and the monotonic window it was measured in."""
    for _ in range(3):
        model.infer(one)
    start = time.monotonic()
    deadline = time.perf_counter() + _LATENCY_BUDGET_S
    runs = 0
    while runs < _LATENCY_RUNS and (runs < 5 or time.perf_counter() < deadline):
        model.infer(one)
        runs += 1
    end = time.monotonic()
    p50, _ = model.latency.p50_between(start, end)
    return float(p50), (start, end)


def _p50_side_by_side(
    a: Any, a_one: dict[str, np.ndarray], b: Any, b_one: dict[str, np.ndarray]
) -> tuple[float, float]:
    """p50 of ``a`` and of ``b``, timed interleaved (ABBA...) so that whatever else loads the
    device in those seconds weighs on both alike."""
    for _ in range(3):
        a.infer(a_one)
        b.infer(b_one)
    ta: list[float] = []
    tb: list[float] = []
    deadline = time.perf_counter() + 2 * _LATENCY_BUDGET_S
    i = 0
    while len(ta) < _SIDE_BY_SIDE_RUNS and (len(ta) < 5 or time.perf_counter() < deadline):
        order = ((a, a_one, ta), (b, b_one, tb)) if i % 2 == 0 else ((b, b_one, tb), (a, a_one, ta))
        for model, one, times in order:
            t0 = time.perf_counter()
            model.infer(one)
            times.append((time.perf_counter() - t0) * 1000)
        i += 1
    return round(statistics.median(ta), 4), round(statistics.median(tb), 4)


def _flood() -> NoReturn:
    """What a runaway runtime might do (fault ``selftest_flood``): start helpers that outlive
    it, one of them in a session of its own, and write without end. Each line names them."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    helpers = [subprocess.Popen(sleeper), subprocess.Popen(sleeper, start_new_session=True)]
    line = (f"flood helpers={','.join(str(h.pid) for h in helpers)} " + "x" * 150 + "\n").encode()
    while True:
        os.write(1, line)
        os.write(2, line)


def _double_fork() -> None:
    """What a runtime's daemonizing helper might do (fault ``selftest_double_fork``): a helper
    starts a sleeper in a session of its own and exits, so the sleeper is an orphan outside our
    process group. Its pid is appended to ``$EDGEKIT_FAULT_PID_FILE``."""
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True,\n"
        "                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write(f'{p.pid}\\n')\n"
    )
    subprocess.run([sys.executable, "-c", code, os.environ.get(PID_FILE_ENV, os.devnull)], check=True)


def _exit_with_parent(parent: int) -> None:
    """Stop, with everything we started, when the daemon that started us dies (we lead our own
    session: nothing else would stop runtime helpers)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            _stop_helpers(parent)


def _stop_helpers(parent: int) -> None:
    """Kill our descendants (those that left the group too; as a subreaper, orphans of our
    helpers are our children) until none is left, reaping them; with the daemon gone, the whole
    cgroup or group, this process included: nobody is left to do it."""
    import psutil

    me = psutil.Process()
    deadline = time.monotonic() + _KILL_WAIT_S
    while time.monotonic() < deadline:
        helpers = [p for p in me.children(recursive=True) if _running(p)]
        if not helpers:
            break
        contain.kill_all(helpers)
        _reap_children()
        time.sleep(0.01)
    _reap_children()
    if os.getppid() != parent:
        if _CGROUP is not None:
            _CGROUP.kill(wait_s=0.0)
        os.killpg(0, signal.SIGKILL)


def _reap_children() -> None:
    """Collect the exit status of every child that ended (orphans re-parented to a subreaper
    become its children: they would stay zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


_CGROUP: contain.Cgroup | None = None  # the child's own cgroup, where the parent made one


def main(argv: list[str]) -> int:
    global _CGROUP
    _CGROUP = contain.join_cgroup_from_env()  # before anything is started
    contain.become_subreaper()  # orphans of our helpers stay ours to kill
    model_dir, options_json, result_path = Path(argv[0]), argv[1], Path(argv[2])
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        options = from_data(RuntimesConfig, json.loads(options_json), "runtimes", SelfTestError)
        plan = from_data(ChildPlan, json.loads(argv[3]), "plan", SelfTestError) if len(argv) > 3 else ChildPlan()
        report = _child(model_dir, options, plan)
    except Exception as exc:  # entry point of the child: any failure becomes the report
        report = SelfTestReport(passed=False, reason=f"{type(exc).__name__}: {exc}")
    try:
        tmp = result_path.with_name(result_path.name + ".tmp")
        tmp.write_bytes(report.to_json())
        os.replace(tmp, result_path)
    finally:
        _stop_helpers(parent)  # the self-test is over: no helper of the runtime is needed
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
