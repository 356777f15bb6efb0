"""The agent's config file (``agent.toml``): frozen dataclasses, versioned, strict.

Unknown keys and wrong types are ``ConfigError`` naming their path (``agent.updates.broker``).
Relative paths are resolved against the directory of the config file. A format change bumps
``CONFIG_VERSION`` and adds a step to ``MIGRATIONS`` (house rule: versioned config)::

    config_version = 1
    store = "/var/lib/edgekit"
    listen = "127.0.0.1:8500"
    trusted_keys = ["keys/release.pub"]

    [runtime]            # device_agents.runtimes.base.RuntimeOptions
    threads = 2

    [selftest]
    timeout_s = 60

    [updates]            # optional: pull updates over MQTT
    broker = "mqtts://broker.example:8883"
    fleet = "shop-floor"
    device_id = "cam-07"
"""

from __future__ import annotations

import dataclasses
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

from device_agents.runtimes.base import RuntimeOptions
from edgekit.bundle.codec import from_data, upgrade
from edgekit.bundle.errors import ConfigError

CONFIG_VERSION = 1

# config_version -> function upgrading a config dict of that version by one step.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}

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
    # The candidate's p50 may be at most latency_slack x the previous version's p50 on this
    # device (or, for a first install, the host p50 in the manifest). 0 turns the gate off.
    latency_slack: float = 3.0
    # p50 values below this are never refused: timer noise dominates such small numbers.
    latency_floor_ms: float = 1.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb <= 0:
            raise ValueError(f"memory_mb must be > 0, got {self.memory_mb}")
        if self.latency_slack < 0 or self.latency_floor_ms < 0:
            raise ValueError("latency_slack and latency_floor_ms must be >= 0")


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
    # None in the file = <store>/downloads after loading. Not <store>/tmp: the manager empties that at
    # start, and a partial download must survive a restart to be resumed.
    download_dir: Path | None = None
    max_bundle_mb: int = 512
    maintenance_window: str | None = None  # "HH:MM-HH:MM", local time; may wrap midnight
    defer_on_battery: bool = True
    keepalive_s: int = 30
    reconnect_max_s: float = 60.0
    health_window_s: float = DEFAULT_HEALTH_WINDOW_S  # a switched-to version must run this long to count as healthy
    crash_loop_boots: int = DEFAULT_CRASH_LOOP_BOOTS  # starts within the health window before a rollback

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
            ("health_window_s", self.health_window_s),
            ("crash_loop_boots", self.crash_loop_boots),
        ):
            if number <= 0:
                raise ValueError(f"{label} must be > 0, got {number}")

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
class AgentConfig:
    store: Path
    trusted_keys: tuple[Path, ...]
    config_version: int = CONFIG_VERSION
    listen: str = "127.0.0.1:8500"
    revoked_key_ids: tuple[str, ...] = ()
    max_bundle_mb: int = 512
    max_request_mb: int = 64
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    selftest: SelfTestConfig = field(default_factory=SelfTestConfig)
    updates: UpdatesConfig | None = None

    def __post_init__(self) -> None:
        if not self.trusted_keys:
            raise ValueError("trusted_keys is empty: list the .pub file(s) whose bundles this device accepts")
        parse_listen(self.listen)
        if self.max_bundle_mb <= 0 or self.max_request_mb <= 0:
            raise ValueError("max_bundle_mb and max_request_mb must be > 0")

    @property
    def listen_host(self) -> str:
        return parse_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return parse_listen(self.listen)[1]

    @property
    def max_bundle_bytes(self) -> int:
        return self.max_bundle_mb * _MB

    @property
    def max_request_bytes(self) -> int:
        return self.max_request_mb * _MB


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
    return config


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Bring a config dict up to ``CONFIG_VERSION`` (a file without the key is version 1)."""
    data.setdefault("config_version", 1)
    return upgrade(data, "config_version", CONFIG_VERSION, MIGRATIONS, "agent", ConfigError, "upgrade edgekit-agent")


def parse_listen(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:8500"`` / ``"[::1]:8500"`` -> (host, port); port 0 = any free port."""
    host, sep, port = listen.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen {listen!r} must be HOST:PORT, e.g. '127.0.0.1:8500'")
    return host, int(port)


def parse_broker(url: str) -> tuple[bool, str, int]:
    """``"mqtts://host:8883"`` -> (tls, host, port)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname or port is None or parts.path not in ("", "/"):
        raise ValueError(f"broker {url!r} must be mqtt://HOST:PORT or mqtts://HOST:PORT")
    return parts.scheme == "mqtts", parts.hostname, port


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
