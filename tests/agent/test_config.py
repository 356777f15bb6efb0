"""agent.toml: strict, versioned, paths relative to the file."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from device_agents import config as config_module
from device_agents.config import AgentConfig, load_config
from edgekit.bundle.errors import ConfigError

BASE = 'store = "store"\ntrusted_keys = ["keys/a.pub"]\n'
UPDATES = '[updates]\nbroker = "mqtt://127.0.0.1:1883"\nfleet = "lab"\ndevice_id = "dev-1"\n'


def _load(tmp_path: Path, text: str) -> AgentConfig:
    path = tmp_path / "conf" / "agent.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return load_config(path)


def test_config_defaults_and_paths_relative_to_the_file(tmp_path: Path) -> None:
    cfg = _load(tmp_path, BASE + '[runtime]\nthreads = 2\ncache_dir = "cache"\n' + UPDATES + 'ca = "/etc/ca.pem"\n')
    conf = tmp_path / "conf"
    assert cfg.store == conf / "store"
    assert cfg.trusted_keys == (conf / "keys/a.pub",)
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 8500)
    assert cfg.max_bundle_bytes == 512 * 2**20 and cfg.max_request_bytes == 64 * 2**20
    assert cfg.runtime.threads == 2 and cfg.runtime.cache_dir == conf / "cache"
    assert (cfg.selftest.timeout_s, cfg.selftest.memory_mb, cfg.selftest.latency_slack) == (60.0, 2048, 3.0)
    assert cfg.config_version == 1
    u = cfg.updates
    assert u is not None
    assert (u.broker_tls, u.broker_host, u.broker_port) == (False, "127.0.0.1", 1883)
    assert u.ca == Path("/etc/ca.pem")
    assert u.download_dir == conf / "store" / "downloads"  # default: survives the cleanup of store/tmp
    assert (u.groups, u.keepalive_s, u.crash_loop_boots, u.defer_on_battery) == ((), 30, 3, True)


def test_config_without_updates_table_has_none(tmp_path: Path) -> None:
    assert _load(tmp_path, BASE).updates is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (BASE + "colour = 1\n", "agent: unknown key 'colour'"),
        (BASE + UPDATES + 'brokr = "x"\n', "agent.updates: unknown key 'brokr'"),
        (BASE + "[selftest]\ntimeout = 3\n", "agent.selftest: unknown key 'timeout'"),
        (BASE + 'max_request_mb = "big"\n', "agent.max_request_mb: expected an integer"),
        ('store = "s"\n', "agent: missing required key 'trusted_keys'"),
        ('store = "s"\ntrusted_keys = []\n', "trusted_keys is empty"),
        (BASE + 'listen = "localhost"\n', "listen 'localhost' must be HOST:PORT"),
        (BASE + UPDATES.replace("mqtt://", "http://"), "must be mqtt://HOST:PORT or mqtts://HOST:PORT"),
        (BASE + UPDATES + 'maintenance_window = "2am-4am"\n', "must be HH:MM-HH:MM"),
        (BASE + UPDATES + 'cert = "c.pem"\n', "cert and key go together"),
        (BASE + UPDATES.replace('"lab"', '"lab/+"'), "fleet 'lab/+' must be letters"),
        (BASE + "config_version = 9\n", "newer than this agent understands"),
        ("store = [", "is not valid TOML"),
    ],
)
def test_config_errors_name_the_path(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, text)
    assert message in str(err.value)
    assert err.value.exit_code == 2


def test_config_missing_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; pass --config"):
        load_config(tmp_path / "nope.toml")


def test_config_migration_hook_upgrades_old_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def v1_to_v2(data: dict[str, object]) -> dict[str, object]:
        data = dict(data)
        data["listen"] = data.pop("address")  # pretend v1 called it "address"
        data["config_version"] = 2
        return data

    monkeypatch.setattr(config_module, "CONFIG_VERSION", 2)
    monkeypatch.setitem(config_module.MIGRATIONS, 1, v1_to_v2)
    cfg = _load(tmp_path, BASE + 'config_version = 1\naddress = "127.0.0.1:9000"\n')
    assert cfg.listen_port == 9000 and cfg.config_version == 2


@pytest.mark.parametrize(
    ("window", "hhmm", "inside"),
    [
        ("02:00-04:00", "03:00", True),
        ("02:00-04:00", "04:00", False),
        ("22:00-02:00", "23:30", True),
        ("22:00-02:00", "01:59", True),
        ("22:00-02:00", "12:00", False),
    ],
)
def test_maintenance_window_wraps_midnight(tmp_path: Path, window: str, hhmm: str, inside: bool) -> None:
    cfg = _load(tmp_path, BASE + UPDATES + f'maintenance_window = "{window}"\n')
    assert cfg.updates is not None
    now = datetime.fromisoformat(f"2025-01-01T{hhmm}:00")
    assert cfg.updates.in_maintenance_window(now) is inside
