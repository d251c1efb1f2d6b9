"""Configuration layers: defaults < TOML file < environment < -o; refusals name the key."""

from __future__ import annotations

import pytest

from dbr_service.common.config import AGGRESSIVE, Config, ConfigSources, load_config
from dbr_service.common.errors import ConfigError


def test_defaults_and_precedence(tmp_path):
    f = tmp_path / "dbr.toml"
    f.write_text('snapshot_interval_s = 2.0\nhot_threshold = 0.05\nmax_workers = 3\n'
                 'allowed_uids = [0, 1000]\n')
    env = {"DBR_HOT_THRESHOLD": "0.07", "DBR_MAX_WORKERS": "4", "DBR_UNRELATED_THING": "x"}
    cfg = load_config(f, ["max_workers=5"], env=env)
    assert cfg.snapshot_interval_s == 2.0          # file over default
    assert cfg.hot_threshold == 0.07               # environment over file
    assert cfg.max_workers == 5                    # -o over environment
    assert cfg.allowed_uids == (0, 1000)
    assert cfg.sample_period_us == Config().sample_period_us   # default kept
    assert load_config(None, [], env={}).allowed_uids is None


def test_aggressive_preset_is_under_file_env_and_o(tmp_path):
    cfg = load_config(None, [], aggressive=True, env={})
    for k, v in AGGRESSIVE.items():
        assert getattr(cfg, k) == v
    assert cfg.snapshot_interval_s <= 0.2
    cfg = load_config(None, ["snapshot_interval_s=0.5"], aggressive=True, env={})
    assert cfg.snapshot_interval_s == 0.5


@pytest.mark.parametrize("override, key", [
    ("no_such_key=1", "no_such_key"),
    ("hot_threshold=abc", "hot_threshold"),
    ("max_workers=1.5", "max_workers"),
    ("sampling_source=dtrace", "sampling_source"),
    ("continuous_sampling=maybe", "continuous_sampling"),
    ("sample_period_us=1", "sample_period_us"),
    ("allowed_uids=0,x", "allowed_uids"),
    ("on_shutdown=explode", "on_shutdown"),
])
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override], env={})


def test_bad_file_and_env_are_refused(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("snapshot_windowz = 1\n")
    with pytest.raises(ConfigError, match="snapshot_windowz"):
        load_config(f, env={})
    f.write_text("snapshot_interval_s = [")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError, match="map_wait_ms"):
        load_config(None, env={"DBR_MAP_WAIT_MS": "-3"})
    f.write_text("snapshot_interval_s = true\n")
    with pytest.raises(ConfigError, match="snapshot_interval_s"):
        load_config(f, env={})


def test_cross_field_and_replace():
    with pytest.raises(ConfigError, match="snapshot_window_s"):
        load_config(None, ["snapshot_interval_s=0.1", "snapshot_window_s=0.5"], env={})
    cfg = Config()
    new = cfg.replace_value("allowed_uids", "")
    assert new.allowed_uids == () and new.effective_allowed_uids() == frozenset()
    assert cfg.replace_value("continuous_sampling", "yes").continuous_sampling is True
    with pytest.raises(ConfigError, match="agent_ring_entries"):
        cfg.replace_value("agent_ring_entries", "1000")


def test_sources_reload_reads_the_file_again(tmp_path):
    f = tmp_path / "dbr.toml"
    f.write_text("hot_threshold = 0.1\n")
    src = ConfigSources(file=str(f), overrides=("max_workers=2",), env={})
    assert src.load().hot_threshold == 0.1
    f.write_text("hot_threshold = 0.2\n")
    cfg = src.load()
    assert cfg.hot_threshold == 0.2 and cfg.max_workers == 2
