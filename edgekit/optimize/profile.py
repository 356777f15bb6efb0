"""Latency measured on the device, fed back into the host's choice.

Where the target's runtime cannot run on the packaging host (TensorRT on a Jetson, Core ML, the
Edge TPU) or the host is not the device (a build server packaging for an ARM box), ``auto``
cannot time candidates here. The round trip:

1. ``edgekit package ... --keep-candidates DIR`` writes every candidate that met the budget (and
   the target's FP32 baseline) as an opened-bundle folder ``DIR/<target>/<NN-name>/`` (the
   artifact files as the target ships them, an unsigned ``manifest.json`` marked "not validated:
   for timing only", ``golden.npz`` with one input) plus ``DIR/candidates.json`` (the index:
   model, source sha256, and per candidate its target, name, settings hash and folder);
2. ``edgekit bench --profile DIR --out profile.json`` on the device opens each with the device
   runtime the agent serves with (TensorRT on a Jetson, ONNX Runtime / OpenVINO / LiteRT where
   those run) and writes the p50/p90 per candidate; one that cannot open there is recorded with
   the runtime's reason;
3. ``edgekit package ... --device-profile profile.json`` uses those latencies in the choice
   instead of the host's (or instead of the device class's documented order): matched by target,
   candidate name and settings hash; a profile for another model (source sha256) or for none of
   the targets being packaged is refused; the report and manifest say which latencies came from
   the profile and from which device.

The settings hash is over the candidate's runtime, precision and settings: a candidate whose
recipe changed (another calibration, other excluded layers) does not pick up an old timing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError
from edgekit.validate.latency import LatencyStats

INDEX_NAME = "candidates.json"
INDEX_VERSION = 1
PROFILE_VERSION = 1
NOT_VALIDATED = "not validated: a candidate kept for on-device timing (edgekit bench --profile); never install it"


def candidate_key(runtime: str, precision: str, settings: Mapping[str, Any]) -> str:
    """sha256 over runtime, precision and settings (values as text, keys sorted)."""
    doc = {"runtime": runtime, "precision": precision, "settings": {k: _text(v) for k, v in sorted(settings.items())}}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class DeviceLatency:
    """One target's device timings, by (candidate name, settings hash)."""

    label: str  # "device profile profile.json (aarch64 orin-1, tensorrt 10.3)"
    timings: Mapping[tuple[str, str], LatencyStats]

    def lookup(self, name: str, key: str) -> LatencyStats | None:
        return self.timings.get((name, key))


@dataclass(frozen=True)
class ProfileEntry:
    target: str
    candidate: str
    key: str
    runtime: str
    status: str  # "timed" or "error"
    reason: str = ""
    p50_ms: float | None = None
    p90_ms: float | None = None
    p25_ms: float | None = None
    p75_ms: float | None = None
    calls: int = 0


@dataclass(frozen=True)
class DeviceProfile:
    """A ``profile.json`` written by ``edgekit bench --profile``."""

    path: Path
    model: str
    source_sha256: str
    measured_on: str
    entries: tuple[ProfileEntry, ...]

    @classmethod
    def load(cls, path: str | Path) -> DeviceProfile:
        path = Path(path)
        where = f"--device-profile {path}"
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read it ({exc.strerror or exc})") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{where}: not JSON ({exc}); give the file `edgekit bench --profile --out` wrote"
            ) from exc
        if not isinstance(data, dict) or data.get("device_profile_version") != PROFILE_VERSION:
            raise ConfigError(
                f"{where}: not a device profile (device_profile_version {PROFILE_VERSION} expected); "
                "write one with `edgekit bench --profile DIR --out profile.json` on the device"
            )
        try:
            entries = tuple(
                ProfileEntry(
                    target=str(e["target"]),
                    candidate=str(e["candidate"]),
                    key=str(e["key"]),
                    runtime=str(e["runtime"]),
                    status=str(e["status"]),
                    reason=str(e.get("reason", "")),
                    p50_ms=_float(e.get("p50_ms")),
                    p90_ms=_float(e.get("p90_ms")),
                    p25_ms=_float(e.get("p25_ms")),
                    p75_ms=_float(e.get("p75_ms")),
                    calls=int(e.get("calls", 0)),
                )
                for e in data["candidates"]
            )
            return cls(path, str(data["model"]), str(data["source_sha256"]), str(data["measured_on"]), entries)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: malformed device profile ({type(exc).__name__}: {exc})") from exc

    def check(self, source_sha256: str, model_name: str, targets: Sequence[str]) -> None:
        """Refuse a profile measured for another model, or for none of ``targets``."""
        where = f"--device-profile {self.path}"
        if self.source_sha256 != source_sha256:
            raise ConfigError(
                f"{where} was measured for model {self.model!r} (source sha256 {self.source_sha256[:16]}...), not "
                f"{model_name} (sha256 {source_sha256[:16]}...); package this model with --keep-candidates DIR and "
                "run `edgekit bench --profile DIR --out profile.json` on the device"
            )
        timed = sorted({e.target for e in self.entries if e.status == "timed"})
        if not set(timed) & set(targets):
            raise ConfigError(
                f"{where} has device timings for {', '.join(timed) or 'no target'}, not for "
                f"{', '.join(targets)} (being packaged); profile this target's candidates on its device"
            )

    def for_target(self, target: str) -> DeviceLatency | None:
        timings = {
            (e.candidate, e.key): LatencyStats(
                p50_ms=e.p50_ms,
                p90_ms=e.p90_ms if e.p90_ms is not None else e.p50_ms,
                iqr_ms=(e.p75_ms - e.p25_ms) if e.p75_ms is not None and e.p25_ms is not None else 0.0,
                calls=e.calls,
                p25_ms=e.p25_ms or 0.0,
                p75_ms=e.p75_ms or 0.0,
            )
            for e in self.entries
            if e.target == target and e.status == "timed" and e.p50_ms is not None
        }
        if not timings:
            return None
        return DeviceLatency(label=f"device profile {self.path.name} ({self.measured_on})", timings=timings)


def keep_candidates(
    root: Path,
    target: str,
    kept: Sequence[tuple[str, str, str, str, Path]],
    describe: Callable[[str, Path], None],
) -> list[dict[str, Any]]:
    """Write each kept candidate under ``root/target``. ``kept``: (name, key, runtime, precision,
    folder name) per candidate; ``describe(name, folder)`` writes that candidate's artifact files,
    ``golden.npz`` and ``manifest.json`` into ``folder``. Returns the index rows."""
    rows = []
    for name, key, runtime, precision, folder in kept:
        dest = root / target / folder
        dest.mkdir(parents=True)
        describe(name, dest)
        rows.append(
            {
                "target": target,
                "candidate": name,
                "key": key,
                "runtime": runtime,
                "precision": precision,
                "dir": str(dest.relative_to(root)),
            }
        )
    return rows


def write_index(root: Path, model: str, source_sha256: str, rows: Sequence[Mapping[str, Any]], created: str) -> Path:
    path = root / INDEX_NAME
    doc = {
        "candidates_index_version": INDEX_VERSION,
        "model": model,
        "source_sha256": source_sha256,
        "created": created,
        "candidates": list(rows),
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_index(root: Path) -> dict[str, Any]:
    path = Path(root) / INDEX_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--profile {root}: no {INDEX_NAME} there; write the folder with "
            "`edgekit package ... --keep-candidates DIR`"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--profile {root}: {INDEX_NAME} is not readable JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("candidates_index_version") != INDEX_VERSION:
        raise ConfigError(f"--profile {root}: {INDEX_NAME} is not a candidates index (version {INDEX_VERSION})")
    return data


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
