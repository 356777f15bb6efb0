"""``edgekit bench BUNDLE``: latency and throughput of a bundle through the device runtime, on this
machine (a device or the host): the ``trtexec`` / ``benchmark_app`` of every target.

The bundle is verified (with keys) or at least hash-checked, extracted and opened with the same
``device_agents.runtimes.load_model`` the agent serves with. Inputs are the bundle's golden
vectors, repeated to each batch size; a batch size the artifact cannot take (a static batch)
is skipped with the reason. Per batch size: ``warmup`` untimed calls, then calls until
``repeats`` or ``budget_s`` per batch size; p50, p90, p99 in ms per call and samples per second
from the median. A measurement, never a test assertion.

``edgekit bench --profile DIR --out profile.json`` (``bench_profile``) times every candidate that
``edgekit package --keep-candidates DIR`` kept, the same way, for ``package --device-profile``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import ConfigError


@dataclass(frozen=True)
class BatchTiming:
    batch: int
    calls: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    samples_per_s: float


@dataclass(frozen=True)
class BenchResult:
    bundle: str
    name: str
    version: int
    target: str
    runtime: str
    measured_on: str
    warmup: int
    timings: tuple[BatchTiming, ...]
    skipped: tuple[str, ...] = ()  # "batch 8: the artifact takes batch 1 only"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        head = (
            f"{self.name} v{self.version} ({self.target}, {self.runtime}) on {self.measured_on}, {self.warmup} warm-up"
        )
        rows = [("batch", "calls", "p50", "p90", "p99", "throughput")]
        rows += [
            (
                str(t.batch),
                str(t.calls),
                f"{t.p50_ms:.3f} ms",
                f"{t.p90_ms:.3f} ms",
                f"{t.p99_ms:.3f} ms",
                f"{t.samples_per_s:.1f}/s",
            )
            for t in self.timings
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head, *("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)]
        return "\n".join([*lines, *(f"skipped {s}" for s in self.skipped)])


def bench_bundle(
    bundle: Path,
    pubkeys: Sequence[Path] = (),
    batch_sizes: Sequence[int] = (1, 8, 32),
    warmup: int = 5,
    repeats: int = 200,
    budget_s: float = 3.0,
    threads: int | None = None,
) -> BenchResult:
    """Time ``bundle`` at each of ``batch_sizes`` (see the module docstring)."""
    import dataclasses
    import platform

    from device_agents.runtimes import load_model
    from device_agents.runtimes.options import OPTIONS
    from edgekit.bundle import TrustStore, VerifiedManifest, extract, read_verified_manifest
    from edgekit.bundle.archive import read_unverified_manifest

    if any(b < 1 for b in batch_sizes) or not batch_sizes:
        raise ConfigError(f"--batch: expected sizes >= 1 such as 1,8,32, got {list(batch_sizes)}")
    if warmup < 0 or repeats < 1 or budget_s <= 0:
        raise ConfigError("--warmup must be >= 0, --repeats >= 1 and --budget-s > 0")
    if pubkeys:
        verified = read_verified_manifest(bundle, TrustStore.from_files(list(pubkeys)))
    else:
        manifest, kid = read_unverified_manifest(bundle)
        verified = VerifiedManifest(manifest, manifest.to_json(), kid)
    m = verified.manifest
    options = None
    if threads is not None:
        options_cls = OPTIONS.get(m.compatibility.runtime)
        if options_cls is None or "threads" not in {f.name for f in dataclasses.fields(options_cls)}:
            raise ConfigError(f"--threads: the {m.compatibility.runtime} runtime takes no thread count here")
        options = options_cls(threads=threads)  # type: ignore[call-arg]  # checked above: this class has `threads`
    timings: list[BatchTiming] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="edgekit-bench-") as tmp:
        model_dir = extract(bundle, verified, Path(tmp) / "bundle")
        with np.load(model_dir / m.golden.file, allow_pickle=False) as golden:
            samples = {k[3:]: golden[k] for k in golden.files if k.startswith("in_")}
        fixed = m.signature.inputs[0].shape[0] if m.signature.inputs[0].shape else 1
        served = load_model(model_dir, m, options)
        try:
            runtime = served.runner.describe()
            sizes = list(dict.fromkeys(batch_sizes))
            if isinstance(fixed, int):  # a static batch: time that one, say why the others are not
                skipped += [f"batch {b}: the artifact takes batch {fixed} only" for b in sizes if b != fixed]
                sizes = [fixed]
            for batch in sizes:
                feed = {k: _repeat(v, batch) for k, v in samples.items()}
                timings.append(_time(lambda feed=feed: served.infer(feed), batch, warmup, repeats, budget_s))
        finally:
            served.close()
    return BenchResult(
        bundle=str(bundle),
        name=m.name,
        version=m.version,
        target=m.target,
        runtime=f"{runtime.get('runtime', m.compatibility.runtime)} {runtime.get('version', '')}".strip(),
        measured_on=f"{platform.machine()} {platform.node()}".strip(),
        warmup=warmup,
        timings=tuple(timings),
        skipped=tuple(skipped),
    )


def _repeat(v: np.ndarray, batch: int) -> np.ndarray:
    reps = -(-batch // v.shape[0])
    return np.ascontiguousarray(np.concatenate([v] * reps, axis=0)[:batch])


def _time(fn: Any, batch: int, warmup: int, repeats: int, budget_s: float) -> BatchTiming:
    t, _ = _time_quartiles(fn, warmup, repeats, budget_s)
    return BatchTiming(
        batch, t.calls, t.p50_ms, t.p90_ms, t.p99_ms, batch / (t.p50_ms / 1000.0) if t.p50_ms > 0 else float("inf")
    )


def bench_profile(
    root: Path, warmup: int = 5, repeats: int = 200, budget_s: float = 3.0, threads: int | None = None
) -> dict[str, Any]:
    """Time every candidate of a ``--keep-candidates`` folder on this machine (batch 1, or the
    artifact's static batch) with the device runtime the agent serves with; the device profile
    ``edgekit package --device-profile`` reads (``edgekit.optimize.profile``). A candidate whose
    runtime cannot open here is recorded with the runtime's reason."""
    import platform

    from device_agents.runtimes import load_model
    from edgekit.bundle.manifest import MANIFEST_NAME, Manifest, utc_now
    from edgekit.errors import EdgekitError
    from edgekit.optimize.profile import PROFILE_VERSION, read_index

    if warmup < 0 or repeats < 1 or budget_s <= 0:
        raise ConfigError("--warmup must be >= 0, --repeats >= 1 and --budget-s > 0")
    root = Path(root)
    index = read_index(root)
    rows: list[dict[str, Any]] = []
    runtimes: dict[str, str] = {}
    for entry in index["candidates"]:
        row = {k: entry[k] for k in ("target", "candidate", "key", "runtime")}
        folder = root / entry["dir"]
        try:
            manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes())
            with np.load(folder / manifest.golden.file, allow_pickle=False) as golden:
                feed = {k[3:]: golden[k] for k in golden.files if k.startswith("in_")}
            served = load_model(folder, manifest, _runtime_options(manifest.compatibility.runtime, threads))
        except EdgekitError as exc:  # the runtime is absent or refuses this device: say which and why
            rows.append(row | {"status": "error", "reason": str(exc).splitlines()[0]})
            continue
        try:
            described = served.runner.describe()
            runtimes[entry["runtime"]] = f"{described.get('runtime', entry['runtime'])} {described.get('version', '')}"
            timing, quartiles = _time_quartiles(lambda s=served, f=feed: s.infer(f), warmup, repeats, budget_s)
        finally:
            served.close()
        batch = next(iter(feed.values())).shape[0]
        rows.append(row | {"status": "timed", "batch": batch, "calls": timing.calls, "p50_ms": timing.p50_ms,
                           "p90_ms": timing.p90_ms, "p99_ms": timing.p99_ms, "p25_ms": quartiles[0],
                           "p75_ms": quartiles[1]})  # fmt: skip
    machine = f"{platform.machine()} {platform.node()}".strip()
    return {
        "device_profile_version": PROFILE_VERSION,
        "model": index["model"],
        "source_sha256": index["source_sha256"],
        "measured_on": ", ".join([machine, *(v.strip() for v in runtimes.values())]),
        "created": utc_now(),
        "warmup": warmup,
        "candidates": rows,
    }


def profile_table(profile: dict[str, Any]) -> str:
    lines = [f"{profile['model']} candidates on {profile['measured_on']}"]
    for r in profile["candidates"]:
        what = f"p50 {r['p50_ms']:.3f} ms, p90 {r['p90_ms']:.3f} ms" if r["status"] == "timed" else r["reason"]
        lines.append(f"  {r['target']}: {r['candidate']}: {what}")
    return "\n".join(lines)


def _runtime_options(runtime: str, threads: int | None) -> Any:
    import dataclasses

    from device_agents.runtimes.options import OPTIONS

    cls = OPTIONS.get(runtime)
    if threads is None or cls is None or "threads" not in {f.name for f in dataclasses.fields(cls)}:
        return None
    return cls(threads=threads)  # type: ignore[call-arg]  # checked above: this class has `threads`


def _time_quartiles(fn: Any, warmup: int, repeats: int, budget_s: float) -> tuple[BatchTiming, tuple[float, float]]:
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (time.perf_counter() - start < budget_s or len(times) < 5):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    ms = np.asarray(times) * 1000.0
    p25, p50, p75, p90, p99 = (float(np.percentile(ms, q)) for q in (25, 50, 75, 90, 99))
    return BatchTiming(1, len(times), p50, p90, p99, 1000.0 / p50 if p50 > 0 else float("inf")), (p25, p75)
