"""Gateway config (TOML + STRATA_GATEWAY_* + overrides) and the admin key sources."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.auth import resolve_admin_key
from gateway.config import REPO_ROOT, ConfigError, GatewayConfig, load_config


def test_defaults() -> None:
    cfg = load_config(env={})
    assert (cfg.host, cfg.port) == ("0.0.0.0", 8080)
    assert [(lane.name, lane.url, lane.weight) for lane in cfg.lanes] == [
        ("a", "http://127.0.0.1:8101", 1.0), ("b", "http://127.0.0.1:8102", 1.0)]
    assert cfg.db_url == f"sqlite:///{REPO_ROOT / 'var' / 'gateway.db'}"
    assert (cfg.max_body_bytes, cfg.min_clamp_tokens, cfg.eject_after_failures, cfg.eject_cooldown_s) == \
        (1024 * 1024, 16, 3, 10.0)
    assert cfg.log_prompts_default is False and cfg.retention_days == 30 and cfg.health_interval_s == 1.0


def test_file_then_env_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "gw.toml"
    f.write_text('port = 9000\nmax_tokens_cap = 100\n[[lanes]]\nname = "a"\nurl = "http://127.0.0.1:8101/"\n'
                 'weight = 3\n')
    cfg = load_config(f, env={"STRATA_GATEWAY_MAX_TOKENS_CAP": "200", "STRATA_GATEWAY_LOG_PROMPTS_DEFAULT": "true",
                              "OTHER": "x"}, overrides={"port": 9100, "host": None})
    assert cfg.port == 9100 and cfg.max_tokens_cap == 200 and cfg.log_prompts_default is True
    assert cfg.lanes[0].url == "http://127.0.0.1:8101" and cfg.lanes[0].weight == 3
    cfg = load_config(env={"STRATA_GATEWAY_LANES": '[{"name": "x", "url": "http://10.0.0.2:9000"}]'})
    assert [lane.name for lane in cfg.lanes] == ["x"]


@pytest.mark.parametrize("env, needle", [
    ({"STRATA_GATEWAY_PORT": "lots"}, "port='lots' (from environment STRATA_GATEWAY_PORT)"),
    ({"STRATA_GATEWAY_COLOUR": "red"}, "colour='red' (from environment STRATA_GATEWAY_COLOUR): unknown key"),
    ({"STRATA_GATEWAY_LANES": '[{"name": "a", "url": "ftp://x"}]'}, "lanes.0.url"),
    ({"STRATA_GATEWAY_LANES": '[{"name": "a", "url": "http://x:1"}, {"name": "a", "url": "http://y:1"}]'},
     "duplicate lane name"),
    ({"STRATA_GATEWAY_MIN_CLAMP_TOKENS": "0"}, "min_clamp_tokens=0"),
    ({"STRATA_GATEWAY_CORES": "3-1"}, "bad CPU range '3-1'"),
    ({"STRATA_GATEWAY_CORES": "0,0"}, "CPU ids must be distinct"),
    ({"STRATA_GATEWAY_CORES": "4096"}, "outside this machine's CPUs"),
])
def test_errors_are_one_line(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env=env)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_missing_or_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad, env={})


def test_admin_key_sources(tmp_path: Path) -> None:
    f = tmp_path / "admin.key"
    f.write_text("from-the-file-0123456789\n")
    f.chmod(0o600)
    cfg = GatewayConfig(admin_key_file=f)
    assert resolve_admin_key(cfg, {}) == "from-the-file-0123456789"
    assert resolve_admin_key(cfg, {"STRATA_ADMIN_KEY": "from-the-env-0123456789"}) == "from-the-env-0123456789"
    assert resolve_admin_key(GatewayConfig(), {}) is None
    f.chmod(0o640)
    with pytest.raises(ConfigError, match=r"mode 0640.*chmod 600"):
        resolve_admin_key(cfg, {})
    with pytest.raises(ConfigError, match="no such file"):
        resolve_admin_key(GatewayConfig(admin_key_file=tmp_path / "missing"), {})
    with pytest.raises(ConfigError, match="at least 16 characters"):
        resolve_admin_key(GatewayConfig(), {"STRATA_ADMIN_KEY": "short"})
