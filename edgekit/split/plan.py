"""The end-to-end cost of each way to run a model, and the best one per bandwidth.

Ways: ``local`` (the whole model on the device), ``remote`` (the input goes to the server, which
runs the whole model) and every cut (head on the device, the cut tensors over the link, the
tail on the server). One request costs::

    device_ms + (up_bytes + down_bytes) * 8 / bandwidth + rtt_ms + server_ms      (local: device_ms)

with the same bandwidth both ways. ``device_ms`` comes from a device profile, else from this
host; ``server_ms`` from a server profile, else this host's time divided by ``server_speedup``
(an assumption the plan states).

With the ``energy`` objective the best option is the one that costs the device the fewest
millijoules per request (W x ms = mJ)::

    device_power_w * device_ms + radio_power_w * transfer_ms + idle_power_w * (rtt_ms + server_ms)

(local: ``device_power_w * device_ms``): computing, then sending and receiving, then waiting for
the server. ``device_power_w`` comes from ``--device-power-w`` or the device profile
(``edgekit-agent profile`` measures it where the device has an energy meter); the radio and idle
powers are given or assumed, and the plan says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from edgekit.bundle.manifest import SplitCut, SplitPlan
from edgekit.errors import ConfigError
from edgekit.split import compression
from edgekit.split.measure import CutMeasurement, Measurements
from edgekit.split.profile import Profile

LOCAL = "local"
REMOTE = "remote"
OBJECTIVES = ("latency", "energy")
DEFAULT_RADIO_POWER_W = 1.0  # a Wi-Fi or LTE radio while sending (assumed where not given)
DEFAULT_IDLE_POWER_W = 0.2  # the device waiting for the server's answer (assumed where not given)


@dataclass(frozen=True)
class Power:
    """Watts the device draws computing, with its radio sending/receiving, and waiting."""

    device_w: float
    radio_w: float = DEFAULT_RADIO_POWER_W
    idle_w: float = DEFAULT_IDLE_POWER_W


@dataclass(frozen=True)
class Option:
    id: str  # LOCAL, REMOTE or a cut id
    tensors: tuple[str, ...]
    device_ms: float
    server_ms: float
    up_bytes: int  # per sample, device -> server
    down_bytes: int  # per sample, server -> device

    def latency_ms(self, bandwidth_mbps: float, rtt_ms: float) -> float:
        if self.id == LOCAL:
            return self.device_ms
        return self.device_ms + transfer_ms(self.up_bytes + self.down_bytes, bandwidth_mbps) + rtt_ms + self.server_ms

    def energy_mj(self, bandwidth_mbps: float, rtt_ms: float, power: Power) -> float:
        """Millijoules the device spends on one request (see the module docstring)."""
        compute = power.device_w * self.device_ms
        if self.id == LOCAL:
            return compute
        link = power.radio_w * transfer_ms(self.up_bytes + self.down_bytes, bandwidth_mbps)
        return compute + link + power.idle_w * (rtt_ms + self.server_ms)


@dataclass(frozen=True)
class Choice:
    bandwidth_mbps: float
    rtt_ms: float
    best: str  # the option with the lowest latency
    best_ms: float
    local_ms: float
    remote_ms: float
    best_cut: str | None  # the best of the cuts alone (None when the model has none)
    best_cut_ms: float | None
    # the energy objective: the device's millijoules per request (None under the latency objective)
    best_mj: float | None = None
    local_mj: float | None = None
    remote_mj: float | None = None
    best_cut_mj: float | None = None


@dataclass(frozen=True)
class Plan:
    options: tuple[Option, ...]  # local, remote, then the cuts in graph order
    choices: tuple[Choice, ...]
    compress: compression.Mode
    assumptions: tuple[str, ...]
    objective: str = "latency"
    power: Power | None = None

    def option(self, option_id: str) -> Option:
        for o in self.options:
            if o.id == option_id:
                return o
        raise KeyError(option_id)

    @property
    def cuts(self) -> tuple[Option, ...]:
        return tuple(o for o in self.options if o.id not in (LOCAL, REMOTE))


def transfer_ms(size_bytes: int, bandwidth_mbps: float) -> float:
    return size_bytes * 8.0 / (bandwidth_mbps * 1000.0)


def parse_bandwidths(text: str) -> tuple[float, ...]:
    """``"1,10,100"`` -> (1.0, 10.0, 100.0) Mbit/s."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--bandwidth-mbps {text!r}: expected positive Mbit/s separated by commas, such as 1,10,100")
    return values


def build_options(
    measured: Measurements,
    *,
    device: Profile | None = None,
    server: Profile | None = None,
    server_speedup: float = 10.0,
    compress: compression.Mode = "none",
) -> tuple[tuple[Option, ...], tuple[str, ...]]:
    """Every option with its device and server milliseconds and bytes; and the assumptions made."""
    if server_speedup <= 0:
        raise ConfigError(f"--server-speedup {server_speedup}: must be > 0")
    notes: list[str] = []
    if device is None:
        notes.append("device times: measured on this host with ONNX Runtime (no --device-profile)")
    else:
        notes.append(f"device times: {device.source}")
    notes.extend(measured.notes)
    if server is None:
        notes.append(
            f"server times: ASSUMED {server_speedup:g}x faster than this host (no --server-profile; "
            "record one on the server with `edgekit split plan --save-profile`)"
        )
    else:
        notes.append(f"server times: {server.source}")
    if compress != "none":
        notes.append(f"cut tensors sent as {compress} + {compression.CODEC}")

    # a cut the device profile lacks (the bundle profiled shipped other heads): this host's time
    # scaled by the device's full model against this host's
    scale = device.full_ms / measured.full_ms if device is not None and measured.full_ms > 0 else 1.0
    missing = [m.cut.id for m in measured.cuts if device is not None and device.head_ms(m.cut) is None]
    if missing:
        notes.append(
            f"device times of {', '.join(missing)} (not in the device profile): this host's x {scale:.3g} "
            "(the device's full model against this host's); profile a bundle with those heads "
            "(`edgekit package --split --cuts all`) to measure them"
        )

    def device_ms(host_ms: float, profiled: float | None) -> float:
        return profiled if profiled is not None else host_ms * scale

    def server_ms(host_ms: float, profiled: float | None) -> float:
        return profiled if profiled is not None else host_ms / server_speedup

    down = measured.output_bytes_per_sample
    options = [
        Option(LOCAL, (), device.full_ms if device else measured.full_ms, 0.0, 0, 0),
        Option(
            REMOTE,
            (),
            0.0,
            server.full_ms if server else measured.full_ms / server_speedup,
            measured.input_bytes_per_sample,
            down,
        ),
    ]
    for m in measured.cuts:
        options.append(
            Option(
                m.cut.id,
                m.cut.tensors,
                device_ms(m.head_ms, device.head_ms(m.cut) if device else None),
                server_ms(m.tail_ms, server.tail_ms(m.cut) if server else None),
                _sent_bytes(m, compress),
                down,
            )
        )
    return tuple(options), tuple(notes)


def choose(
    options: Sequence[Option],
    bandwidths_mbps: Sequence[float],
    rtt_ms: float,
    *,
    objective: str = "latency",
    power: Power | None = None,
) -> tuple[Choice, ...]:
    """Per bandwidth, the option with the lowest latency (or, ``energy``, device millijoules)."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
    if objective == "energy" and power is None:
        raise ConfigError("--objective energy needs the device's power: --device-power-w W or a device profile with it")
    out = []
    local = next(o for o in options if o.id == LOCAL)
    remote = next(o for o in options if o.id == REMOTE)
    cuts = [o for o in options if o.id not in (LOCAL, REMOTE)]
    for bw in bandwidths_mbps:

        def cost(o: Option, bw: float = bw) -> float:
            if objective == "energy" and power is not None:
                return o.energy_mj(bw, rtt_ms, power)
            return o.latency_ms(bw, rtt_ms)

        def mj(o: Option | None, bw: float = bw) -> float | None:
            return o.energy_mj(bw, rtt_ms, power) if o is not None and power is not None else None

        best = min(options, key=cost)
        best_cut = min(cuts, key=cost) if cuts else None
        out.append(
            Choice(
                bandwidth_mbps=bw,
                rtt_ms=rtt_ms,
                best=best.id,
                best_ms=best.latency_ms(bw, rtt_ms),
                local_ms=local.latency_ms(bw, rtt_ms),
                remote_ms=remote.latency_ms(bw, rtt_ms),
                best_cut=best_cut.id if best_cut else None,
                best_cut_ms=best_cut.latency_ms(bw, rtt_ms) if best_cut else None,
                best_mj=mj(best),
                local_mj=mj(local),
                remote_mj=mj(remote),
                best_cut_mj=mj(best_cut),
            )
        )
    return tuple(out)


def make_plan(
    measured: Measurements,
    bandwidths_mbps: Sequence[float],
    rtt_ms: float = 20.0,
    *,
    device: Profile | None = None,
    server: Profile | None = None,
    server_speedup: float = 10.0,
    compress: compression.Mode = "none",
    objective: str = "latency",
    device_power_w: float | None = None,
    radio_power_w: float | None = None,
    idle_power_w: float | None = None,
) -> Plan:
    """``device_power_w``: watts while computing (else the device profile's, when it has one);
    ``radio_power_w`` / ``idle_power_w``: None = the defaults, stated as assumed."""
    if rtt_ms < 0:
        raise ConfigError(f"--rtt-ms {rtt_ms}: must be >= 0")
    options, notes = build_options(
        measured, device=device, server=server, server_speedup=server_speedup, compress=compress
    )
    power, power_notes = _power(objective, device, device_power_w, radio_power_w, idle_power_w)
    chosen = choose(options, bandwidths_mbps, rtt_ms, objective=objective, power=power)
    return Plan(options, chosen, compress, (*notes, *power_notes), objective, power)


def _power(
    objective: str,
    device: Profile | None,
    device_w: float | None,
    radio_w: float | None,
    idle_w: float | None,
) -> tuple[Power | None, tuple[str, ...]]:
    for flag, value in (("--device-power-w", device_w), ("--radio-power-w", radio_w), ("--idle-power-w", idle_w)):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} {value}: must be >= 0 watts")
    if objective != "energy":
        return None, ()
    notes = ["objective: the device's energy per request (mJ), not latency"]
    if device_w is not None:
        notes.append(f"device power {device_w:g} W while computing (--device-power-w)")
    elif device is not None and device.device_power_w is not None:
        device_w = device.device_power_w
        notes.append(f"device power {device_w:g} W while computing ({device.source}: {device.power_source})")
    else:
        raise ConfigError(
            "--objective energy needs the device's power while computing: give --device-power-w W, or a "
            "--device-profile recorded by `edgekit-agent profile` on a device with an energy meter"
        )
    if radio_w is None:
        radio_w = DEFAULT_RADIO_POWER_W
        notes.append(f"radio power ASSUMED {radio_w:g} W while sending/receiving (give --radio-power-w)")
    else:
        notes.append(f"radio power {radio_w:g} W while sending/receiving (--radio-power-w)")
    if idle_w is None:
        idle_w = DEFAULT_IDLE_POWER_W
        notes.append(f"idle power ASSUMED {idle_w:g} W while waiting for the server (give --idle-power-w)")
    else:
        notes.append(f"idle power {idle_w:g} W while waiting for the server (--idle-power-w)")
    return Power(device_w, radio_w, idle_w), tuple(notes)


def useful_cuts(plan: Plan) -> list[str]:
    """The cuts chosen at one of the planned bandwidths, in graph order."""
    chosen = {c.best for c in plan.choices}
    return [o.id for o in plan.cuts if o.id in chosen]


def why_no_cut(plan: Plan) -> str:
    """Why no cut was chosen: per planned bandwidth, what won and what the best cut would cost."""
    parts = []
    for c in plan.choices:
        if c.best_cut is None or c.best_cut_ms is None:
            parts.append(f"at {c.bandwidth_mbps:g} Mbit/s {c.best} ({c.best_ms:.2f} ms); the model has no cut")
            continue
        cut = plan.option(c.best_cut)
        link = transfer_ms(cut.up_bytes + cut.down_bytes, c.bandwidth_mbps)
        parts.append(
            f"at {c.bandwidth_mbps:g} Mbit/s {c.best} {c.best_ms:.2f} ms beats the best cut {c.best_cut} "
            f"{c.best_cut_ms:.2f} ms (head {cut.device_ms:.2f} + link {link:.2f} for {cut.up_bytes} B + rtt "
            f"{c.rtt_ms:g} + tail {cut.server_ms:.2f})"
        )
    local = sum(1 for c in plan.choices if c.best == LOCAL)
    head = "no cut beats both local and remote at any planned bandwidth"
    if not plan.cuts:
        head = "the model has no cut where few enough tensors cross"
    elif local == len(plan.choices):
        head += " (the device runs the whole model sooner than any head plus the link)"
    return f"{head}: " + "; ".join(parts)


def to_manifest(plan: Plan, cut_ids: Sequence[str], head_files: dict[str, str], tail_model: str) -> SplitPlan | None:
    """The manifest's ``split`` for ``cut_ids`` (None when empty); tails are served as
    ``<tail_model>-<cut id>``; the default cut is the one chosen most often among them."""
    if not cut_ids:
        return None
    cuts = []
    for cut_id in cut_ids:
        o = plan.option(cut_id)
        cuts.append(
            SplitCut(
                id=cut_id,
                tensors=o.tensors,
                head_file=head_files[cut_id],
                tail_model=f"{tail_model}-{cut_id}",
                cut_bytes_per_sample=o.up_bytes,
                head_latency_ms=round(o.device_ms, 4),
                tail_latency_ms=round(o.server_ms, 4),
            )
        )
    counts = {cut_id: sum(1 for c in plan.choices if c.best == cut_id) for cut_id in cut_ids}
    return SplitPlan(
        cuts=tuple(cuts),
        default_cut=max(cut_ids, key=lambda c: counts[c]),
        local_latency_ms=round(plan.option(LOCAL).device_ms, 4),
        output_bytes_per_sample=plan.option(LOCAL).down_bytes or plan.option(REMOTE).down_bytes,
    )


def table(plan: Plan, measured: Measurements) -> str:
    """The cuts (times, bytes, compression cost) and the choice per bandwidth, as text."""
    by_id = {m.cut.id: m for m in measured.cuts}
    lines = [*(f"# {n}" for n in plan.assumptions)]
    lines.append(
        f"{'option':<10} {'tensors':<24} {'device ms':>10} {'server ms':>10} {'bytes/sample':>13} "
        f"{'zlib B':>9} {'fp16+zlib B':>12} {'int8+zlib B (cos)':>20}"
    )
    for o in plan.options:
        m = by_id.get(o.id)
        raw = m.bytes_per_sample if m else o.up_bytes
        comp = {c.mode: c for c in m.compression} if m else {}
        z = f"{comp['none'].bytes_per_sample}" if "none" in comp else "-"
        f16 = f"{comp['fp16'].bytes_per_sample}" if "fp16" in comp else "-"
        i8 = f"{comp['int8'].bytes_per_sample} ({comp['int8'].mean_cosine:.4f})" if "int8" in comp else "-"
        tensors = ",".join(o.tensors) if o.tensors else ("(input)" if o.id == REMOTE else "-")
        lines.append(
            f"{o.id:<10} {tensors[:24]:<24} {o.device_ms:>10.3f} {o.server_ms:>10.3f} {raw:>13} "
            f"{z:>9} {f16:>12} {i8:>20}"
        )
    lines.append("")
    energy = plan.objective == "energy"
    lines.append(
        f"{'Mbit/s':>9} {'rtt ms':>7} {'local ms':>10} {'remote ms':>10} {'best cut ms':>12} {'chosen':<10} {'ms':>9}"
        + (f" {'local mJ':>10} {'remote mJ':>10} {'best cut mJ':>14} {'mJ':>9}" if energy else "")
    )
    for c in plan.choices:
        cut = f"{c.best_cut_ms:.2f} {c.best_cut}" if c.best_cut_ms is not None else "-"
        line = (
            f"{c.bandwidth_mbps:>9g} {c.rtt_ms:>7g} {c.local_ms:>10.2f} {c.remote_ms:>10.2f} {cut:>12} "
            f"{c.best:<10} {c.best_ms:>9.2f}"
        )
        if energy:
            cut_mj = f"{c.best_cut_mj:.2f} {c.best_cut}" if c.best_cut_mj is not None else "-"
            line += f" {c.local_mj or 0:>10.2f} {c.remote_mj or 0:>10.2f} {cut_mj:>14} {c.best_mj or 0:>9.2f}"
        lines.append(line)
    return "\n".join(lines)


def _sent_bytes(m: CutMeasurement, compress: compression.Mode) -> int:
    if compress == "none":
        return m.bytes_per_sample
    for c in m.compression:
        if c.mode == compress:
            return c.bytes_per_sample
    raise ConfigError(f"--compress {compress}: not measured for {m.cut.id}")
