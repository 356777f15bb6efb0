"""The agent's config file (``agent.toml``): frozen dataclasses, versioned, strict.

Unknown keys and wrong types are ``ConfigError`` naming their path (``agent.updates.broker``),
with the nearest known key where there is one. Relative paths are resolved against the
directory of the config file. A format change bumps ``CONFIG_VERSION`` and adds a step to
``MIGRATIONS`` (an older file still loads); an additive optional field does not. Version 2::

    config_version = 2
    store = "/var/lib/edgekit"
    listen = "127.0.0.1:8500"
    trusted_keys = ["keys/release.pub"]

    [server]                       # ServerConfig: limits of the HTTP front-end and the pipeline
    max_request_mb = 64
    idle_timeout_s = 30

    [runtimes.onnxruntime]         # one typed table per runtime (device_agents.runtimes.options)
    threads = 2
    [runtimes.openvino]
    device = "GPU"

    [models.classifier]            # per served model name (ModelConfig)
    threads = 1                    # overrides its runtime's threads
    [models.classifier.batching]   # dynamic batching (BatchingConfig)
    max_batch_size = 32
    max_wait_ms = 2.0

    [selftest]
    timeout_s = 60

    [[trusted]]                    # optional: a bundle key limited to model names
    key = "keys/detectors.pub"
    names = ["det-*"]

    [updates]                      # optional: pull updates over MQTT
    broker = "mqtts://broker.example:8883"
    fleet = "shop-floor"
    device_id = "cam-07"
    notice_keys = ["keys/fleet.pub"]   # required: who signs the desired state
    root_keys = ["keys/root.pub"]      # optional: who may add and revoke keys over MQTT

    [console]                      # optional: the serial console (ConsoleConfig)
    device = "/dev/ttyGS0"

A version 1 file (no ``config_version``) migrates: ``[runtime]`` spreads over the
``[runtimes.*]`` tables it applied to, ``max_request_mb`` moves to ``[server]``, and tables new in
version 2 (``[models]``, ``[budgets]``, ``[server]``) are kept. Planned settings (the ``batch``
step of ``[budgets] degrade``) are
documented and refused with a clear error: nothing in the file is silently ignored. ``[budgets]``
(memory, power and thermal) is described on ``BudgetsConfig``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI (the `agent` extra installs it)
    import tomli as tomllib

from device_agents.containment import CONTAINMENTS
from device_agents.runtimes.options import COMPUTE_UNITS, OPTIONS, RuntimeOptions, RuntimesConfig
from edgekit.bundle.codec import from_data, upgrade
from edgekit.bundle.errors import ConfigError
from edgekit.bundle.fleet_connection import parse_broker
from edgekit.bundle.manifest import Manifest

CONFIG_VERSION = 2

DEFAULT_HEALTH_WINDOW_S = 30.0
DEFAULT_CRASH_LOOP_BOOTS = 3
_MB = 1024 * 1024
_TOPIC_SEGMENT = re.compile(r"^[A-Za-z0-9_.-]+$")
_WINDOW = re.compile(r"^(\d\d):(\d\d)-(\d\d):(\d\d)$")


@dataclass(frozen=True)
class SelfTestConfig:
    """Limits of the child-process self-test that every candidate model must pass."""

    timeout_s: float = 60.0
    memory_mb: int = 2048  # the child is killed when its RSS goes over this
    # The candidate's p50 may be at most latency_slack x the serving version's p50 on this device,
    # timed side by side in the self-test child (else its live or recorded p50:
    # SelfTestReport.baseline_source). The manifest's host p50 is reported, never enforced (the
    # host is another machine), so a first install is not latency-gated. 0 turns the gate off.
    latency_slack: float = 3.0
    # p50 values below this are never refused: timer noise dominates such small numbers.
    latency_floor_ms: float = 1.0
    # How no process the child starts outlives it (device_agents.containment): "auto" = a cgroup v2
    # of its own where the agent may make one (root, a delegated subtree), else "subreaper"; "cgroup"
    # = only that (a self-test without it fails); "subreaper" = never a cgroup.
    containment: str = "auto"

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb <= 0:
            raise ValueError(f"memory_mb must be > 0, got {self.memory_mb}")
        if self.latency_slack < 0 or self.latency_floor_ms < 0:
            raise ValueError("latency_slack and latency_floor_ms must be >= 0")
        if self.containment not in CONTAINMENTS:
            raise ValueError(f"containment {self.containment!r} must be one of {', '.join(CONTAINMENTS)}")


@dataclass(frozen=True)
class UpdatesConfig:
    """Over-the-air updates: MQTT desired-state topics, HTTP(S) downloads (device_agents.updates)."""

    broker: str  # mqtt://host:port or mqtts://host:port
    fleet: str
    device_id: str
    groups: tuple[str, ...] = ()
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    # None in the file = <store>/downloads after loading. Not <store>/tmp: the lifecycle empties that at
    # start, and a partial download must survive a restart to be resumed.
    download_dir: Path | None = None
    max_bundle_mb: int = 512
    maintenance_window: str | None = None  # "HH:MM-HH:MM", local time; may wrap midnight
    defer_on_battery: bool = True
    keepalive_s: int = 30
    reconnect_max_s: float = 60.0
    # The largest MQTT packet taken from the broker: asked of it at CONNECT (MQTT 5 Maximum Packet
    # Size: a compliant broker drops a bigger message for this device), and one that arrives anyway
    # ends the connection before its payload is read. Desired states and keys documents are at most
    # 64 KiB (updates.protocol.MAX_PAYLOAD_BYTES); packaging/mosquitto's broker caps packets at 128 KiB too.
    max_packet_kb: int = 128
    health_window_s: float = DEFAULT_HEALTH_WINDOW_S  # a switched-to version must run this long to count as healthy
    crash_loop_boots: int = DEFAULT_CRASH_LOOP_BOOTS  # starts within the health window before a rollback
    # Fleet trust (device_agents.updates.trust): keys of the notice role (sign desired states) and of
    # the root role (sign the keys document that adds and revokes keys; root_threshold of them).
    notice_keys: tuple[Path, ...] = ()
    root_keys: tuple[Path, ...] = ()
    root_threshold: int = 1
    clock_skew_s: float = 300.0  # a desired state issued further in the future than this is refused
    # Downloads: given up (and retried later) after download_deadline_s in all, or when fewer than
    # download_min_bytes_per_s arrive over any download_stall_s.
    download_deadline_s: float = 1800.0
    download_min_bytes_per_s: int = 1024
    download_stall_s: float = 30.0
    allow_http: bool = True  # plain http:// bundle URLs (the bundle is signed either way); https:// always

    def __post_init__(self) -> None:
        parse_broker(self.broker)
        for label, value in (
            ("fleet", self.fleet),
            ("device_id", self.device_id),
            *(("groups", g) for g in self.groups),
        ):
            if not _TOPIC_SEGMENT.match(value):
                raise ValueError(
                    f"{label} {value!r} must be letters, digits, '-', '_' or '.' (it is an MQTT topic level)"
                )
        if (self.cert is None) != (self.key is None):
            raise ValueError("cert and key go together: give both for client-certificate auth, or neither")
        if self.maintenance_window is not None:
            parse_window(self.maintenance_window)
        for label, number in (
            ("max_bundle_mb", self.max_bundle_mb),
            ("keepalive_s", self.keepalive_s),
            ("reconnect_max_s", self.reconnect_max_s),
            ("max_packet_kb", self.max_packet_kb),
            ("health_window_s", self.health_window_s),
            ("crash_loop_boots", self.crash_loop_boots),
            ("download_deadline_s", self.download_deadline_s),
            ("download_stall_s", self.download_stall_s),
            ("root_threshold", self.root_threshold),
        ):
            if number <= 0:
                raise ValueError(f"{label} must be > 0, got {number}")
        if self.max_packet_kb < 66:
            raise ValueError(
                f"max_packet_kb must be >= 66, got {self.max_packet_kb}: a signed desired state may be 64 KiB, plus "
                "its topic and packet headers"
            )
        if self.download_min_bytes_per_s < 0 or self.clock_skew_s < 0:
            raise ValueError("download_min_bytes_per_s and clock_skew_s must be >= 0")
        if not self.notice_keys:
            raise ValueError(
                "notice_keys is empty: list the public key that signs this fleet's desired state; make one with "
                '`edgekit keygen --out keys --name fleet`, set notice_keys = ["keys/fleet.pub"] and publish with '
                "`edgekit publish ... --notice-key keys/fleet.key`"
            )
        if self.root_keys and self.root_threshold > len(self.root_keys):
            raise ValueError(f"root_threshold {self.root_threshold} is more than the {len(self.root_keys)} root_keys")

    @property
    def broker_tls(self) -> bool:
        return parse_broker(self.broker)[0]

    @property
    def broker_host(self) -> str:
        return parse_broker(self.broker)[1]

    @property
    def broker_port(self) -> int:
        return parse_broker(self.broker)[2]

    @property
    def max_bundle_bytes(self) -> int:
        return self.max_bundle_mb * _MB

    def in_maintenance_window(self, now: datetime) -> bool:
        """True when updates may be applied at local time ``now`` (always, without a window)."""
        if self.maintenance_window is None:
            return True
        start, end = parse_window(self.maintenance_window)
        t = now.time().replace(tzinfo=None)
        return start <= t < end if start <= end else (t >= start or t < end)


@dataclass(frozen=True)
class ConsoleConfig:
    """``[console]``: the serial console (device_agents.serving.console), a second front-end over the
    same service as the loopback API: status, stats, infer, install, logs, restart."""

    device: Path  # any tty: a USB gadget serial port (/dev/ttyGS0), a UART (/dev/ttyS0, /dev/ttyAMA0), a pty
    baud: int = 115200  # ignored by ttys without a baud rate (USB gadgets, ptys)
    # Chunks of a bundle sent over the console; None in the file = <store>/uploads after loading. Not
    # <store>/tmp (the lifecycle empties it at start): a partial upload resumes after a restart.
    upload_dir: Path | None = None
    log_lines: int = 500  # recent log lines kept for the `logs` message

    def __post_init__(self) -> None:
        if self.baud <= 0 or self.log_lines <= 0:
            raise ValueError(f"baud and log_lines must be > 0, got {self.baud} and {self.log_lines}")


@dataclass(frozen=True)
class SplitConfig:
    """``[split]``: split inference for the models whose bundle carries a split plan (the manifest's
    ``split``): the head of the cut chosen for the current link runs here, the tail on the v2 server
    at ``tail_url`` (edgekit serve-tail, Triton, KServe), as model ``<cut's tail_model>``. The
    request runs locally (the full model in the bundle) when the tail is unreachable, slower than
    ``deadline_ms``, answers garbage, or no cut beats local for the link measured
    (device_agents.split)."""

    tail_url: str  # http(s)://host:port of the v2 server
    deadline_ms: float = 500.0  # the tail's answer must arrive within this (and the request's own deadline)
    auth_token_file: Path | None = None  # sent as "Authorization: Bearer <its first line>"
    client_cert_file: Path | None = None  # https: the device's certificate (PEM), with client_key_file
    client_key_file: Path | None = None
    ca_file: Path | None = None  # https: the CA that signed the server's certificate (else the system's)
    probe_interval_s: float = 5.0  # a light probe of the link (GET /v2/health/ready) this often
    retry_after_s: float = 10.0  # after a failed or garbage answer, local only this long (probes may end it)
    ewma_alpha: float = 0.3  # weight of the newest sample in the RTT and bandwidth estimates
    bandwidth_mbps: float = 10.0  # the estimate before the first measurement
    models: tuple[str, ...] = ()  # split only these models; empty: every model with a split plan

    def __post_init__(self) -> None:
        parts = urlsplit(self.tail_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"tail_url must be http(s)://HOST:PORT, got {self.tail_url!r}")
        for name in ("deadline_ms", "probe_interval_s", "retry_after_s", "bandwidth_mbps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {self.ewma_alpha}")
        if (self.client_cert_file is None) != (self.client_key_file is None):
            raise ValueError("client_cert_file and client_key_file go together")


@dataclass(frozen=True)
class BatchingConfig:
    """``[models.<name>.batching]``: coalesce concurrent requests into one runtime call.

    Only for a model whose batch axis (axis 0 of every input) is dynamic. A batch is run when it
    holds ``max_batch_size`` samples or one of ``preferred_batch_sizes``, or when waiting for
    more is over: ``max_wait_ms`` is the longest its first request waits for companions (from
    when the model could take it), and it waits only while the model is busy or requests are
    coming: being decoded, or returning (clients of the recent peak not here now); then no
    longer than a call's measured fixed cost: see ``pipeline/batching.py``. A batch below
    ``min_batch_size`` waits until its oldest request's deadline nears.
    """

    max_batch_size: int = 8
    max_wait_ms: float = 2.0
    min_batch_size: int = 1
    preferred_batch_sizes: tuple[int, ...] = ()
    # the longest wait for companions while the ``batch`` step of ``[budgets] degrade`` is on
    # (None: 4 x max_wait_ms): fuller batches, fewer calls, less energy per request
    budget_max_wait_ms: float | None = None
    # the batch size cap while the ``batch`` step is on (None: max_batch_size): smaller batches,
    # lower peak power and memory
    budget_max_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.budget_max_batch_size is not None and not 1 <= self.budget_max_batch_size <= self.max_batch_size:
            raise ValueError(
                f"budget_max_batch_size must be between 1 and max_batch_size ({self.max_batch_size}), "
                f"got {self.budget_max_batch_size}"
            )
        if self.budget_max_wait_ms is not None and (
            not 0 <= self.budget_max_wait_ms <= 10_000 or math.isnan(self.budget_max_wait_ms)
        ):
            raise ValueError(f"budget_max_wait_ms must be between 0 and 10000, got {self.budget_max_wait_ms}")
        if not (0 <= self.max_wait_ms <= 10_000) or math.isnan(self.max_wait_ms):
            raise ValueError(f"max_wait_ms must be between 0 and 10000, got {self.max_wait_ms}")
        if not 1 <= self.min_batch_size <= self.max_batch_size:
            raise ValueError(
                f"min_batch_size must be between 1 and max_batch_size ({self.max_batch_size}), "
                f"got {self.min_batch_size}"
            )
        bad = [b for b in self.preferred_batch_sizes if not 1 <= b <= self.max_batch_size]
        if bad:
            raise ValueError(
                f"preferred_batch_sizes: {bad[0]} is not between 1 and max_batch_size ({self.max_batch_size})"
            )

    def degraded(self) -> BatchingConfig:
        """These settings while the ``batch`` step of ``[budgets] degrade`` is on."""
        size = self.max_batch_size if self.budget_max_batch_size is None else self.budget_max_batch_size
        wait = min(10_000.0, 4 * self.max_wait_ms) if self.budget_max_wait_ms is None else self.budget_max_wait_ms
        return dataclasses.replace(
            self,
            max_batch_size=size,
            max_wait_ms=wait,
            min_batch_size=min(self.min_batch_size, size),
            preferred_batch_sizes=tuple(b for b in self.preferred_batch_sizes if b <= size),
            budget_max_wait_ms=None,
            budget_max_batch_size=None,
        )


CACHE_MODES = ("exact", "approximate", "semantic")
CACHE_ADMIT = ("first", "second")  # device_agents.cache.admission


@dataclass(frozen=True)
class ModelCacheConfig:
    """``[models.<name>.cache]``: the result cache for one served name (``device_agents.cache``).

    Without the table, the manifest's cache policy applies (if it has one); with it, the fields set
    here override the manifest's (``ttl_s``), and ``enabled = false`` turns a manifest's policy off.
    ``exact`` answers a request whose inputs and answer-changing parameters are byte for byte
    those of a cached one. ``approximate`` (near-duplicate sensor input) also answers one whose
    inputs' signature is within ``max_distance`` (cosine distance of downsampled, normalised
    copies: ``device_agents.cache.approximate``) of a cached one's (without it, the threshold the
    packager calibrated into the manifest: ``edgekit package --cache approximate``);
    ``recheck_fraction`` of those hits are re-run through the model in the background, and when
    their false-hit rate is over ``false_hit_budget`` with 95% confidence the threshold is halved.
    ``semantic``: the key is the output vector of ``embed_with``, another model served by this
    agent (given the request's inputs), and a request whose vector is within ``max_distance``
    (cosine distance) of a cached one's is answered from it, with the same recheck. ``max_mb``:
    this model's share of the disk tier (None: only ``[cache] max_mb`` bounds it). ``admit``: which
    missed answers the memory tier takes once it is full: ``"second"`` (the exact mode's default)
    stores an answer at its key's second sighting (the first is remembered by a 64-bit hash), so
    inputs that never repeat cost no copy; ``"first"`` stores every answer (the approximate and
    semantic modes' only choice: their hits are never byte-identical repeats). Refused for a
    stateful model."""

    mode: str = "exact"
    enabled: bool = True
    max_mb: int | None = None
    ttl_s: float | None = None  # None: the manifest's ttl_s, else DEFAULT_CACHE_TTL_S
    embed_with: str | None = None
    recheck_fraction: float = 0.0
    max_distance: float | None = None  # approximate: the distance threshold (None: the manifest's calibrated one)
    false_hit_budget: float = 0.01  # approximate: the false-hit rate the run-time recheck holds
    admit: str | None = None  # "first" | "second"; None: "second" for exact, else "first"

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise ValueError(f"mode {self.mode!r} must be one of {', '.join(CACHE_MODES)}")
        if self.admit is not None and self.admit not in CACHE_ADMIT:
            raise ValueError(f"admit {self.admit!r} must be one of {', '.join(CACHE_ADMIT)}")
        if self.admit == "second" and self.mode != "exact":
            raise ValueError(
                f'admit = "second" goes with mode = "exact": {self.mode} hits are near, never byte-identical, '
                'repeats; remove admit or set it to "first"'
            )
        if (self.mode == "semantic") != (self.embed_with is not None):
            raise ValueError(
                'mode = "semantic" goes with embed_with (the served name of the model whose output keys the '
                "cache), and embed_with with it only"
            )
        if self.mode == "semantic" and self.max_distance is None:
            raise ValueError('mode = "semantic" needs max_distance (the cosine distance of two embeddings, e.g. 0.05)')
        if self.max_mb is not None and self.max_mb <= 0:
            raise ValueError(f"max_mb must be > 0, got {self.max_mb}")
        if self.ttl_s is not None and not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        if not 0.0 <= self.recheck_fraction <= 1.0:
            raise ValueError(f"recheck_fraction must be between 0 and 1, got {self.recheck_fraction}")
        if self.recheck_fraction and self.mode == "exact":
            raise ValueError("recheck_fraction applies to approximate and semantic hits; an exact hit is exact")
        if self.max_distance is not None and (self.mode == "exact" or not 0 < self.max_distance <= 2):
            raise ValueError(
                f'max_distance goes with mode = "approximate" or "semantic", between 0 and 2; got {self.max_distance}'
            )
        if not 0 < self.false_hit_budget < 1:
            raise ValueError(f"false_hit_budget must be between 0 and 1, got {self.false_hit_budget}")


DEFAULT_CACHE_TTL_S = 3600.0


@dataclass(frozen=True)
class CacheConfig:
    """``[cache]``: the agent's result cache, shared by every model that caches (``<store>/cache/``).

    ``max_mb`` bounds the disk tier (oldest entries evicted first), ``memory_mb`` the in-memory
    tier in front of it; ``enabled = false`` turns caching off for every model."""

    enabled: bool = True
    max_mb: int = 256
    memory_mb: int = 64

    def __post_init__(self) -> None:
        if self.max_mb <= 0 or self.memory_mb <= 0:
            raise ValueError(f"max_mb and memory_mb must be > 0, got {self.max_mb} and {self.memory_mb}")


@dataclass(frozen=True)
class RouteConfig:
    """``[models.<name>.route]``: ``<name>`` is a cascade (``device_agents.pipeline.cascade``), not a
    model: ``members`` (served model names, smallest first) are asked in order, and the next one
    only while the answer's confidence (best score, or top-1 probability) is below ``threshold``.
    Each member stays addressable under its own name. With ``url`` the last member is not served
    here but by the v2 server at ``url`` (``http://HOST:PORT``), which must answer within
    ``timeout_ms``; when it does not, the earlier member's answer stands."""

    members: tuple[str, ...]
    threshold: float
    url: str | None = None
    timeout_ms: float = 500.0

    def __post_init__(self) -> None:
        if len(self.members) < 2 or len(set(self.members)) != len(self.members):
            raise ValueError(f"members must name two or more different models, got {list(self.members)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be between 0 and 1, got {self.threshold}")
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"url must be http://HOST:PORT, got {self.url!r}")
        if not self.timeout_ms > 0:
            raise ValueError(f"timeout_ms must be > 0, got {self.timeout_ms}")


@dataclass(frozen=True)
class ModelConfig:
    """``[models.<served name>]``: how one served name is run.

    ``cache`` is the result cache (``ModelCacheConfig``); ``route`` makes the name a cascade of
    other models (``RouteConfig``); ``variants`` makes it a variant set: served models (separate
    bundles, best first) of which each request is answered by the first that fits the memory
    budget, the power state and the request's deadline (``device_agents.budgets.variants``).
    """

    threads: int = 0  # overrides [runtimes.<runtime>] threads for this model; 0 = the runtime's setting
    workers: int = 0  # runtime calls of this model at once; 0 = server.workers
    batching: BatchingConfig | None = None
    cache: ModelCacheConfig | None = None  # None: the manifest's cache policy, if it has one
    route: RouteConfig | None = None
    variants: tuple[str, ...] | None = None  # served model names, best first
    # a request with more rows (axis 0) is refused (413) before its tensors are decoded;
    # None: batching's max_batch_size when batching is set, else any
    max_request_rows: int | None = None

    def __post_init__(self) -> None:
        if self.threads < 0 or self.workers < 0:
            raise ValueError(f"threads and workers must be >= 0, got {self.threads} and {self.workers}")
        if self.max_request_rows is not None and self.max_request_rows < 1:
            raise ValueError(f"max_request_rows must be >= 1, got {self.max_request_rows}")
        if self.variants is not None:
            if len(self.variants) < 2 or len(set(self.variants)) != len(self.variants):
                raise ValueError(f"variants lists {list(self.variants)}: name two or more different served models")
            if self.route is not None:
                raise ValueError("variants and route are two kinds of endpoint: set one of them")

    def check(self, name: str, manifest: Manifest) -> None:
        """``ConfigError`` when this table cannot serve ``manifest`` (batching a static batch axis, a
        stateful model or one whose rows are not independent; caching a stateful model)."""
        if self.cache is not None and self.cache.enabled and manifest.stateful:
            raise ConfigError(
                f"agent.models.{name}.cache: model {manifest.name} v{manifest.version} is stateful (its answer "
                f"depends on earlier calls), so a cached answer would be wrong; remove [models.{name}.cache] "
                f"or set enabled = false"
            )
        if self.batching is None:
            return
        if manifest.stateful:
            raise ConfigError(
                f"agent.models.{name}.batching: model {manifest.name} v{manifest.version} is stateful (it keeps "
                f"state between calls), so requests of different clients must not share a batch; remove "
                f"[models.{name}.batching]"
            )
        if manifest.rows_independent is False:
            raise ConfigError(
                f"agent.models.{name}.batching: model {manifest.name} v{manifest.version} mixes rows (its packager "
                f"found a row's outputs change when another row shares its batch: rows_independent is false), so "
                f"requests of different clients must not share a batch; remove [models.{name}.batching]"
            )
        for spec in manifest.signature.inputs:
            if not spec.shape or isinstance(spec.shape[0], int):
                raise ConfigError(
                    f"agent.models.{name}.batching: model {manifest.name} v{manifest.version} has a static batch "
                    f"(input {spec.name!r} shape {spec.v2_shape}); dynamic batching needs axis 0 dynamic (-1). "
                    f"{_static_batch_cause(manifest)}; or remove [models.{name}.batching]"
                )


def _static_batch_cause(manifest: Manifest) -> str:
    """Why a bundle's batch axis is static, by its target, and how to get one that batches."""
    if manifest.target == "jetson":
        return (
            "This jetson bundle pins its TensorRT engine to one shape (no optimization profile): package it again "
            "with --batch MIN,OPT,MAX (e.g. 1,4,8) to record a profile the engine is built with"
        )
    if manifest.target in ("coral", "apple"):
        runtime = "LiteRT and the Edge TPU take" if manifest.target == "coral" else "this Core ML model takes"
        return (
            f"The {manifest.target} target builds static shapes ({runtime} one input shape): its batch axis was "
            "frozen when it was packaged; batch on the client, or package the cpu target for batched serving"
        )
    return (
        "The packaged model's own batch axis is fixed: export it with a dynamic batch axis (edgekit export without "
        "--static-batch, or torch.onnx.export dynamic_axes) and package it again"
    )


BUDGET_WHEN_FULL = ("refuse", "unload_idle")
BUDGET_RELOAD = ("on_request", "retry_after")
BUDGET_DEGRADE = ("drop", "shed")  # the default steps, in order
# "variant": a variant set answers with its last variant; "batch": batched models take their
# budget_max_wait_ms / budget_max_batch_size
BUDGET_DEGRADE_STEPS = ("variant", "batch", "drop", "shed")


@dataclass(frozen=True)
class BudgetsConfig:
    """``[budgets]``: memory, power and thermal budgets (``device_agents.budgets``); all off by default.

    ``memory_mb`` bounds the agent's whole RSS (its own baseline included): a model load that does
    not fit is refused, or (``when_full = "unload_idle"``) the least recently used model is
    unloaded for it (an idle one first, else a busy one once its running calls end); an unloaded
    model's next request loads it again (``reload = "on_request"``) or, unless it fits without
    unloading another, gets a 503 + Retry-After (``"retry_after"``).

    ``power_w`` (average watts over ``power_window_s``) or ``energy_j`` (joules per window) is the
    power budget; over it, the agent degrades through ``degrade`` in order (``variant``: a variant
    set answers with its last variant; ``batch``: batched models wait longer for fuller batches, or
    take smaller ones, as their ``budget_max_wait_ms`` / ``budget_max_batch_size`` say (models
    without ``[models.<name>.batching]`` are not changed by it); ``drop``: refuse requests whose parameters say
    ``droppable``; ``shed``: refuse every request with 503 + Retry-After), and it backs off the
    same way ``thermal_margin_c`` before a thermal zone's trip point (or ``thermal_c``). Energy is
    read from the board's sensors; where there is none, ``device_power_w`` models it (busy time x
    that power) and a power budget without either is a warning at start, not a failed start.
    ``nvpmodel_mode`` sets a Jetson's power mode at start (read-only otherwise). ``sysfs_root`` is
    where the sensors are read (``/``).
    """

    memory_mb: int | None = None
    when_full: str = "refuse"
    reload: str = "on_request"
    power_w: float | None = None
    energy_j: float | None = None
    power_window_s: float = 30.0
    device_power_w: float | None = None
    thermal_c: float | None = None
    thermal_margin_c: float = 5.0
    degrade: tuple[str, ...] = BUDGET_DEGRADE
    hysteresis: float = 0.15  # of the bucket (or of thermal_margin_c): how far past a level's threshold to leave it
    min_dwell_s: float = 2.0  # how long past it before stepping one level down
    sample_interval_s: float = 1.0  # how often the sensors are read
    nvpmodel_mode: int | None = None
    sysfs_root: Path = Path("/")

    def __post_init__(self) -> None:
        if self.memory_mb is not None and self.memory_mb <= 0:
            raise ValueError(f"memory_mb must be > 0, got {self.memory_mb}")
        if self.when_full not in BUDGET_WHEN_FULL:
            raise ValueError(f"when_full {self.when_full!r} must be one of {', '.join(BUDGET_WHEN_FULL)}")
        if self.reload not in BUDGET_RELOAD:
            raise ValueError(f"reload {self.reload!r} must be one of {', '.join(BUDGET_RELOAD)}")
        if self.power_w is not None and self.energy_j is not None:
            raise ValueError("power_w and energy_j are two ways to say one budget: set one of them")
        for label, number in (
            ("power_w", self.power_w),
            ("energy_j", self.energy_j),
            ("power_window_s", self.power_window_s),
            ("device_power_w", self.device_power_w),
            ("thermal_margin_c", self.thermal_margin_c),
            ("sample_interval_s", self.sample_interval_s),
        ):
            if number is not None and not number > 0:
                raise ValueError(f"{label} must be > 0, got {number}")
        if not 0 < self.hysteresis < 1 or self.min_dwell_s < 0:
            raise ValueError("hysteresis must be between 0 and 1, and min_dwell_s >= 0")
        if not self.degrade:
            raise ValueError(f"degrade is empty: list the steps, in order, from {', '.join(BUDGET_DEGRADE_STEPS)}")
        for step in self.degrade:
            if step not in BUDGET_DEGRADE_STEPS or self.degrade.count(step) > 1:
                raise ValueError(f"degrade: {step!r} must be one of {', '.join(BUDGET_DEGRADE_STEPS)}, each once")

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory_mb is None else self.memory_mb * _MB

    @property
    def budget_w(self) -> float | None:
        """The power budget as average watts over ``power_window_s`` (from ``energy_j`` if given so)."""
        if self.energy_j is not None:
            return self.energy_j / self.power_window_s
        return self.power_w

    @property
    def degrades(self) -> bool:
        """Whether anything drives a degradation level (a power budget or a temperature limit)."""
        return self.budget_w is not None or self.thermal_c is not None


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: the limits of the HTTP front-end and of the serving pipeline."""

    max_request_mb: int = 64  # a body (after gzip/deflate inflation) over this is a 413
    max_connections: int = 512  # at the cap the oldest idle one (else one of half reading headers) is closed
    idle_timeout_s: float = 30.0  # a connection with no complete request for this long is closed
    header_timeout_s: float = 10.0  # a request's headers are due this long after its request line, else it is closed
    max_header_kib: int = 32  # a header block over this is a 431 (at most 100 header lines, each counted)
    max_buffered_mb: int = 64  # body bytes held at once as received (and again as inflated); more wait, then 503
    # a body gets idle_timeout_s plus its Content-Length at this rate to arrive, then the connection is closed
    min_body_rate_kib_s: int = 64
    max_concurrent_decodes: int = 4  # request bodies parsed at once; more wait (1 s), then 503
    workers: int = 2  # inference threads per model (batches run one per worker)
    queue_size: int = 64  # requests waiting per model before a 429
    request_timeout_s: float = 30.0  # a request's deadline unless it asks for less (parameters.timeout, us)
    hung_call_s: float = 60.0  # a runtime call running longer than this is hung: the model is reloaded
    drain_timeout_s: float = 10.0  # on SIGTERM, in-flight requests get this long to finish
    retry_after_s: int = 1  # the Retry-After of a 429/503
    # names (besides the listen address, localhost and loopback addresses) that the Host and Origin
    # of install, uninstall, rollback and repository load/unload requests may give; others are 403
    allowed_hosts: tuple[str, ...] = ()
    # the install route takes bundle paths only under these directories (empty: any regular file)
    install_dirs: tuple[Path, ...] = ()
    # a file holding the bearer token (Authorization: Bearer ...) that clients not on loopback must
    # send; required when listen is not a loopback address
    auth_token_file: Path | None = None
    metrics_loopback_only: bool = False  # /metrics and the stats routes answer loopback clients only
    # HTTPS: this certificate chain and its key (PEM); with client_ca_file, mutual TLS: clients not
    # on loopback must present a certificate that CA signed (the other way off loopback, besides the token)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    client_ca_file: Path | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            number = getattr(self, f.name)
            if isinstance(number, int | float) and not isinstance(number, bool) and number <= 0:
                raise ValueError(f"{f.name} must be > 0, got {number}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both (PEM) or neither")
        if self.client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("client_ca_file needs tls_cert_file and tls_key_file: client certificates come with TLS")

    @property
    def mutual_tls(self) -> bool:
        """Clients not on loopback may prove who they are with a certificate (``client_ca_file``)."""
        return self.client_ca_file is not None

    @property
    def max_request_bytes(self) -> int:
        return self.max_request_mb * _MB

    @property
    def max_buffered_bytes(self) -> int:
        return max(self.max_buffered_mb, self.max_request_mb) * _MB

    def body_deadline_s(self, length: int) -> float:
        """How long a body of ``length`` bytes may take to arrive, from its request line."""
        return self.idle_timeout_s + length / (self.min_body_rate_kib_s * 1024)


@dataclass(frozen=True)
class TrustedKey:
    """``[[trusted]]``: a bundle-signing key that may sign only models whose name matches ``names``."""

    key: Path
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.names or not all(self.names):
            raise ValueError(f'names of {self.key} is empty: list name patterns such as "det-*"')


@dataclass(frozen=True)
class AgentConfig:
    store: Path
    trusted_keys: tuple[Path, ...] = ()  # may sign any model name
    config_version: int = CONFIG_VERSION
    listen: str = "127.0.0.1:8500"
    revoked_key_ids: tuple[str, ...] = ()
    max_bundle_mb: int = 512
    server: ServerConfig = field(default_factory=ServerConfig)
    runtimes: RuntimesConfig = field(default_factory=RuntimesConfig)
    models: dict[str, ModelConfig] = field(default_factory=dict)
    budgets: BudgetsConfig = field(default_factory=BudgetsConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)  # the result cache (per model: [models.<name>.cache])
    # take bundles marked failed by `edgekit package --allow-failed` (validation.passed = false)
    allow_failed_validation: bool = False
    selftest: SelfTestConfig = field(default_factory=SelfTestConfig)
    updates: UpdatesConfig | None = None
    console: ConsoleConfig | None = None  # the serial console, off unless configured
    split: SplitConfig | None = None  # split inference (head here, tail on a v2 server), off unless configured
    trusted: tuple[TrustedKey, ...] = ()  # keys limited to model name patterns
    # Installed models are verified at rest (signature with today's keys, every file's hash) at
    # start and every verify_interval_s while serving; 0 checks only at start.
    verify_interval_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.trusted_keys and not self.trusted:
            raise ValueError("trusted_keys is empty: list the .pub file(s) whose bundles this device accepts")
        parse_listen(self.listen)
        if self.max_bundle_mb <= 0:
            raise ValueError("max_bundle_mb must be > 0")
        if self.verify_interval_s < 0:
            raise ValueError(f"verify_interval_s must be >= 0 (0: only at start), got {self.verify_interval_s}")

    @property
    def listen_host(self) -> str:
        return parse_listen(self.listen)[0]

    def check_exposure(self) -> None:
        """``ConfigError`` (one line saying how) when ``listen`` is off loopback without a bearer token
        or mutual TLS: the agent daemon does not serve the network unauthenticated."""
        exposed = not _is_loopback_host(self.listen_host)
        if exposed and self.server.auth_token_file is None and not self.server.mutual_tls:
            raise ConfigError(
                f"listen {self.listen!r} is not loopback: set [server] auth_token_file (a file holding the token "
                "clients send as Authorization: Bearer ...), or tls_cert_file, tls_key_file and client_ca_file "
                "(mutual TLS: clients present a certificate that CA signed), or listen on 127.0.0.1"
            )

    @property
    def listen_port(self) -> int:
        return parse_listen(self.listen)[1]

    @property
    def max_bundle_bytes(self) -> int:
        return self.max_bundle_mb * _MB

    def model(self, name: str) -> ModelConfig:
        """The ``[models.<name>]`` table, or the defaults."""
        return self.models.get(name) or ModelConfig()

    def max_request_rows(self) -> dict[str, int]:
        """The most rows one request may give, by served name (names without a cap are absent)."""
        rows = {}
        for name, cfg in self.models.items():
            cap = cfg.max_request_rows or (cfg.batching.max_batch_size if cfg.batching is not None else None)
            if cap is not None:
                rows[name] = cap
        return rows

    def runtime_options(self, name: str, runtime: str) -> RuntimeOptions:
        """``[runtimes.<runtime>]`` with ``[models.<name>] threads`` applied: what model ``name`` loads with."""
        options = self.runtimes.options_for(runtime)
        threads = self.model(name).threads
        if threads and hasattr(options, "threads"):
            options = dataclasses.replace(options, threads=threads)  # type: ignore[arg-type]  # mypy cannot narrow the union by hasattr; every class with threads takes it
        return options

    def runtimes_for(self, name: str) -> RuntimesConfig:
        """``runtimes`` with model ``name``'s threads applied to every runtime (for its self-test child)."""
        threads = self.model(name).threads
        if not threads:
            return self.runtimes
        changes = {
            runtime: dataclasses.replace(getattr(self.runtimes, runtime), threads=threads)
            for runtime, cls in OPTIONS.items()
            if "threads" in {f.name for f in dataclasses.fields(cls)}
        }
        return dataclasses.replace(self.runtimes, **changes)


def load_config(path: Path) -> AgentConfig:
    """Read, migrate and check ``path``; relative paths become relative to its directory."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist; pass --config PATH") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc
    return config_from_data(data, base=path.resolve().parent)


def config_from_data(data: dict[str, Any], base: Path) -> AgentConfig:
    config: AgentConfig = from_data(AgentConfig, migrate(dict(data)), "agent", ConfigError)
    config = _resolve_paths(config, base)
    if config.updates is not None and config.updates.download_dir is None:
        config = dataclasses.replace(
            config, updates=dataclasses.replace(config.updates, download_dir=config.store / "downloads")
        )
    if config.console is not None and config.console.upload_dir is None:
        config = dataclasses.replace(
            config, console=dataclasses.replace(config.console, upload_dir=config.store / "uploads")
        )
    return config


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Bring a config dict up to ``CONFIG_VERSION`` (a file without the key is version 1)."""
    data.setdefault("config_version", 1)
    return upgrade(data, "config_version", CONFIG_VERSION, MIGRATIONS, "agent", ConfigError, "upgrade edgekit-agent")


# v1 [runtime] extra keys that became typed options: extra key -> (runtime, field, converter)
_V1_EXTRA: dict[str, tuple[str, str, Callable[[str], Any]]] = {
    "PERFORMANCE_HINT": ("openvino", "performance_hint", str),
    "NUM_STREAMS": ("openvino", "num_streams", int),
    "INFERENCE_PRECISION_HINT": ("openvino", "inference_precision", str),
    "INFERENCE_NUM_THREADS": ("openvino", "threads", int),
    "CACHE_DIR": ("openvino", "cache_dir", str),
    "edgetpu_library": ("litert", "edgetpu_library", str),
    "fallback": ("tensorrt", "fallback", str),
    "memory_budget_mb": ("tensorrt", "memory_budget_mb", int),
}
# v1 [runtime] key -> the runtimes it applied to
_V1_RUNTIME_KEYS: dict[str, tuple[str, ...]] = {
    "threads": ("onnxruntime", "openvino", "litert", "tensorrt"),
    "cache_dir": ("openvino", "tensorrt"),
    "workspace_mb": ("tensorrt",),
    "providers": ("onnxruntime",),
}


def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """``[runtime]`` (one shared table + a free-form ``extra``) -> ``[runtimes.<runtime>]``;
    ``max_request_mb`` -> ``[server]``. Everything else, new v2 tables included, is kept."""
    data = dict(data)
    runtime = data.pop("runtime", {})
    if not isinstance(runtime, dict):
        raise ConfigError(f"agent.runtime: expected a table, got {type(runtime).__name__}")
    runtimes: dict[str, dict[str, Any]] = {}
    for key, value in runtime.items():
        if key == "device":  # OpenVINO's device, or Core ML's compute units (v1 shared one field)
            target = ("coreml", "compute_units") if value in COMPUTE_UNITS else ("openvino", "device")
            runtimes.setdefault(target[0], {})[target[1]] = value
        elif key == "extra":
            if not isinstance(value, dict):
                raise ConfigError(f"agent.runtime.extra: expected a table, got {type(value).__name__}")
            for name, raw in value.items():
                if name not in _V1_EXTRA:
                    raise ConfigError(
                        f"agent.runtime.extra.{name}: config v2 has no free-form runtime options; the typed ones "
                        f"are {', '.join(sorted(_V1_EXTRA))} (see [runtimes.<runtime>])"
                    )
                target_runtime, target_field, convert = _V1_EXTRA[name]
                try:
                    converted = convert(raw)
                except ValueError as exc:
                    raise ConfigError(f"agent.runtime.extra.{name}: {raw!r} is not valid ({exc})") from exc
                runtimes.setdefault(target_runtime, {})[target_field] = converted
        elif key in _V1_RUNTIME_KEYS:
            for target_runtime in _V1_RUNTIME_KEYS[key]:
                runtimes.setdefault(target_runtime, {}).setdefault(key, value)
        else:
            known = ", ".join(sorted([*_V1_RUNTIME_KEYS, "device", "extra"]))
            raise ConfigError(f"agent.runtime: unknown key {key!r} (known keys: {known})")
    if runtimes:
        merged = dict(data.get("runtimes", {}))
        for name, table in runtimes.items():
            merged[name] = {**table, **merged.get(name, {})}  # a v2 table already in the file wins
        data["runtimes"] = merged
    if "max_request_mb" in data:
        data["server"] = {"max_request_mb": data.pop("max_request_mb"), **data.get("server", {})}
    data["config_version"] = 2
    return data


# config_version -> function upgrading a config dict of that version by one step.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}


def parse_listen(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:8500"`` / ``"[::1]:8500"`` -> (host, port); port 0 = any free port."""
    host, sep, port = listen.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen {listen!r} must be HOST:PORT, e.g. '127.0.0.1:8500'")
    return host, int(port)


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def parse_window(window: str) -> tuple[time, time]:
    """``"02:00-04:30"`` -> (02:00, 04:30)."""
    m = _WINDOW.match(window)
    if m is None:
        raise ValueError(f"maintenance_window {window!r} must be HH:MM-HH:MM, e.g. '02:00-04:00'")
    h1, m1, h2, m2 = (int(g) for g in m.groups())
    if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59:
        raise ValueError(f"maintenance_window {window!r}: hours 00-23, minutes 00-59")
    return time(h1, m1), time(h2, m2)


def _resolve_paths(obj: Any, base: Path) -> Any:
    """A copy of the dataclass tree ``obj`` with every relative ``Path`` made absolute."""
    if isinstance(obj, Path):
        return obj if obj.is_absolute() else base / obj.expanduser()
    if isinstance(obj, tuple):
        return tuple(_resolve_paths(v, base) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _resolve_paths(getattr(obj, f.name), base) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj
