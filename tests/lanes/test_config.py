"""Lane configuration: TOML, STRATA_LANE_* overrides, presets, one-line errors naming key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from lanes.config import ConfigError, LaneConfig, load_config, parse_cpu_list


def test_defaults() -> None:
    cfg = load_config(None, {})
    assert (cfg.name, cfg.host, cfg.port, cfg.model, cfg.served_model_name) == ("a", "127.0.0.1", 8101, None,
                                                                                "strata-default")
    assert cfg.kv_tokens == 8192 and cfg.max_body_bytes == 4 * 1024 * 1024 and cfg.drain_timeout_s == 30
    assert cfg.cores is None and cfg.resolved_cores() is None and cfg.engine_threads(None) is None


def test_file_then_env_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "lane.toml"
    f.write_text('port = 9000\ncores = "0-1"\nkv_tokens = 4096\n[scheduler]\nmax_num_seqs = 8\nmax_waiting = 4\n')
    env = {"STRATA_LANE_PORT": "9001", "STRATA_LANE_SCHEDULER__MAX_NUM_SEQS": "32", "STRATA_LANE_LOG_LEVEL": "debug",
           "STRATA_LANE_SERVED_MODEL_NAME": "big-moe", "OTHER": "x"}
    cfg = load_config(f, env, {"host": "127.0.0.2"})
    assert cfg.port == 9001 and cfg.host == "127.0.0.2" and cfg.kv_tokens == 4096
    assert cfg.cores == [0, 1] and cfg.engine_threads(cfg.resolved_cores()) == 2
    assert cfg.scheduler.max_num_seqs == 32 and cfg.scheduler.max_waiting == 4
    assert cfg.log_level == "DEBUG" and cfg.served_model_name == "big-moe"


def test_one_cpu_from_the_environment_is_a_list() -> None:
    """STRATA_LANE_CORES=0 decodes as the number 0 (environment values are JSON when they parse): one CPU."""
    assert load_config(None, {"STRATA_LANE_CORES": "0"}, {}).cores == [0]
    assert load_config(None, {"STRATA_LANE_CORES": "0"}, {}).engine_threads([0]) == 1
    with pytest.raises(ConfigError, match="CPU ids must be >= 0"):
        load_config(None, {"STRATA_LANE_CORES": "-1"}, {})


def test_lane_presets() -> None:
    assert load_config(None, {}, {"name": "b"}).port == 8102
    assert load_config(None, {"STRATA_LANE_PORT": "9100"}, {"name": "b"}).port == 9100


@pytest.mark.parametrize(("allowed", "a", "b"), [
    ([0, 1, 2, 3], [0, 1], [2, 3]),
    (list(range(32)), list(range(16)), list(range(16, 32))),
    ([4, 5, 6], [4], [5, 6]),
    ([7], [7], [7]),  # one CPU: both lanes share it
])
def test_auto_cores(allowed: list[int], a: list[int], b: list[int]) -> None:
    assert LaneConfig(name="a", cores="auto").resolved_cores(allowed) == a
    assert LaneConfig(name="b", cores="auto").resolved_cores(allowed) == b


def test_cpu_list() -> None:
    assert parse_cpu_list("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    for bad in ("", "a", "3-1", "1,,2", "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


@pytest.mark.parametrize(("env", "needle"), [
    ({"STRATA_LANE_PORT": "abc"}, "port='abc' (from environment STRATA_LANE_PORT)"),
    ({"STRATA_LANE_PORT": "70000"}, "port=70000"),
    ({"STRATA_LANE_KV_TOKENS": "-5"}, "kv_tokens=-5"),
    ({"STRATA_LANE_SCHEDULER__MAX_NUM_SEQS": "0"}, "scheduler.max_num_seqs=0 (from environment "
                                                   "STRATA_LANE_SCHEDULER__MAX_NUM_SEQS)"),
    ({"STRATA_LANE_SCHEDULER__MAX_SEQS": "3"}, "unknown scheduler key(s) ['max_seqs']"),
    ({"STRATA_LANE_TYPO": "1"}, "typo=1 (from environment STRATA_LANE_TYPO): unknown key"),
    ({"STRATA_LANE_CORES": "1-x"}, "cores='1-x'"),
    ({"STRATA_LANE_CORES": "[1, 1]"}, "duplicate CPU ids"),
    ({"STRATA_LANE_CORES": "auto", "STRATA_LANE_NAME": "c"}, "needs lane name 'a' or 'b'"),
    ({"STRATA_LANE_LOG_LEVEL": "loud"}, "log_level='loud'"),
    ({"STRATA_LANE_MODEL": "/no/such/model.gguf"}, "model='/no/such/model.gguf'"),
    ({"STRATA_LANE_NAME": "Lane A"}, "name='Lane A'"),
    ({"STRATA_LANE_GPU_BUDGET_GB": "0"}, "gpu_budget_gb=0 (from environment STRATA_LANE_GPU_BUDGET_GB)"),
    ({"STRATA_LANE_GPU_BUDGET_GB": "-3"}, "gpu_budget_gb=-3"),
    ({"STRATA_LANE_GPU_BUDGET_GB": "lots"}, "gpu_budget_gb='lots'"),
    ({"STRATA_LANE_CORES": "[0, 100000]"}, "CPU ids [100000] are outside this machine's CPUs"),
])
def test_errors_name_key_and_value(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, env)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


@pytest.mark.parametrize(("text", "needle"), [
    ("port = \n", "not valid TOML"),
    ("[scheduler]\nmax_waiting = -1\n", "scheduler.max_waiting=-1 (from file"),
    ("drain_timeout_s = 'long'\n", "drain_timeout_s='long' (from file"),
])
def test_file_errors(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "lane.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f, {})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such/lane.toml", {})


def test_gpu_budget_and_cores_reach_the_engine(tmp_path: Path) -> None:
    """gpu_budget_gb and cores go to Engine.open as they are configured (lanes.server.open_engine)."""
    from lanes.server import open_engine

    f = tmp_path / "lane.toml"
    f.write_text('device = "cpu"\ngpu_budget_gb = 24.5\ncores = "0"\n')
    cfg = load_config(f, {})
    assert cfg.gpu_budget_gb == 24.5 and cfg.cores == [0]
    assert load_config(None, {"STRATA_LANE_GPU_BUDGET_GB": "12"}).gpu_budget_gb == 12.0
    assert load_config(None, {}).gpu_budget_gb is None
    with open_engine(cfg.model_copy(update={"kv_tokens": 64}), [0]) as eng:  # the default model, on the CPU
        assert eng.gpu_budget_gb == 24.5 and eng.cores == [0] and eng.threads == 1


def test_rope_overrides_are_validated_and_reach_the_engine_form() -> None:
    assert load_config(None, {}).rope_overrides() is None
    cfg = load_config(None, {"STRATA_LANE_ROPE_SCALING_FACTOR": "4", "STRATA_LANE_ROPE_SCALING_TYPE": "yarn"},
                      {"yarn_beta_fast": 16})
    o = cfg.rope_overrides()
    assert o is not None and (o.rope_scaling_type, o.rope_scaling_factor, o.yarn_beta_fast) == ("yarn", 4.0, 16.0)
    for bad in ({"rope_scaling_factor": 0}, {"rope_scaling_type": "dynamic"}, {"yarn_ext_factor": -1},
                {"yarn_orig_ctx": 0}, {"rope_scaling_factor": float("inf")}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            load_config(None, {}, bad)


def test_placement_reaches_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`placement` (hybrid placement's routing frequencies) goes to Engine.open with the budget."""
    from lanes import server

    f = tmp_path / "lane.toml"
    f.write_text('device = "cuda"\ngpu_budget_gb = 20\nplacement = "/srv/m.gguf.placement.json"\n')
    cfg = load_config(f, {})
    assert cfg.placement == Path("/srv/m.gguf.placement.json")
    assert load_config(None, {"STRATA_LANE_PLACEMENT": "/x.json"}).placement == Path("/x.json")
    assert load_config(None, {}).placement is None
    seen: dict[str, object] = {}
    monkeypatch.setattr(server.Engine, "open", lambda *a, **kw: seen.update(kw) or "engine")
    assert server.open_engine(cfg, None) == "engine"
    assert seen["placement"] == Path("/srv/m.gguf.placement.json") and seen["gpu_budget_gb"] == 20
    assert seen["device"] == "cuda:0"
    assert seen["prefill_chunk"] == 2048 and seen["step_tokens"] == 2048  # a GPU lane's step sizes


def test_gpu_lanes_take_gpu_step_sizes(tmp_path: Path) -> None:
    """A device naming a GPU takes prefill_chunk and scheduler.max_batch_tokens 2048 where the configuration
    does not set them; a CPU lane keeps 512 and 256; explicit values (file, environment, override) win."""
    cpu = load_config(None, {})
    assert (cpu.prefill_chunk, cpu.scheduler.max_batch_tokens, cpu.step_tokens()) == (512, 256, 512)
    for dev in ("cuda", "cuda:1"):
        gpu = load_config(None, {"STRATA_LANE_DEVICE": dev})
        assert (gpu.prefill_chunk, gpu.scheduler.max_batch_tokens, gpu.step_tokens()) == (2048, 2048, 2048)
        assert {"prefill_chunk", "scheduler"}.isdisjoint(gpu.model_fields_set)  # still defaults, not set
    auto = load_config(None, {"STRATA_LANE_DEVICE": "auto"})  # resolved where the engine opens
    assert (auto.prefill_chunk, auto.scheduler.max_batch_tokens) == (512, 256)
    f = tmp_path / "lane.toml"
    f.write_text('device = "cuda"\nprefill_chunk = 512\n[scheduler]\nmax_num_seqs = 8\n')
    cfg = load_config(f, {})
    assert (cfg.prefill_chunk, cfg.scheduler.max_batch_tokens, cfg.scheduler.max_num_seqs) == (512, 2048, 8)
    f.write_text('device = "cuda"\n[scheduler]\nmax_batch_tokens = 256\n')
    cfg = load_config(f, {})
    assert (cfg.prefill_chunk, cfg.scheduler.max_batch_tokens, cfg.step_tokens()) == (2048, 256, 2048)
    cfg = load_config(None, {"STRATA_LANE_DEVICE": "cuda", "STRATA_LANE_SCHEDULER__MAX_BATCH_TOKENS": "4096"},
                      {"prefill_chunk": 1024})
    assert (cfg.prefill_chunk, cfg.scheduler.max_batch_tokens, cfg.step_tokens()) == (1024, 4096, 4096)
    # explicit CPU values stay on a CPU lane too, and the defaults there are untouched by a GPU's
    cfg = load_config(None, {"STRATA_LANE_PREFILL_CHUNK": "128"})
    assert (cfg.prefill_chunk, cfg.scheduler.max_batch_tokens) == (128, 256)


def test_step_defaults_follow_the_engines_device() -> None:
    """with_step_defaults: the unset step sizes of the device the engine runs on, either way; set ones stay;
    the caller's SchedulerConfig is not changed."""
    from engine.scheduler import SchedulerConfig

    auto = LaneConfig(device="auto")
    gpu = auto.with_step_defaults(True)
    assert (gpu.prefill_chunk, gpu.scheduler.max_batch_tokens) == (2048, 2048)
    assert (auto.prefill_chunk, auto.scheduler.max_batch_tokens) == (512, 256)
    back = gpu.with_step_defaults(False)  # "auto" on a model only the CPU runs
    assert (back.prefill_chunk, back.scheduler.max_batch_tokens) == (512, 256)
    sched = SchedulerConfig(max_num_seqs=4)
    cfg = LaneConfig(device="cuda", prefill_chunk=300, scheduler=sched)
    assert (cfg.prefill_chunk, cfg.scheduler.max_batch_tokens, cfg.scheduler.max_num_seqs) == (300, 2048, 4)
    assert sched.max_batch_tokens == 256
    cpu = cfg.with_step_defaults(False)
    assert (cpu.prefill_chunk, cpu.scheduler.max_batch_tokens) == (300, 256)
    fixed = LaneConfig(device="cuda", scheduler=SchedulerConfig(max_batch_tokens=64))
    assert fixed.with_step_defaults(False).scheduler.max_batch_tokens == 64
    assert fixed.with_step_defaults(True).scheduler.max_batch_tokens == 64


def test_open_engine_resolves_auto_step_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """device "auto": open_engine resolves the device as Engine.open does and plans the GPU's step sizes; the
    step buffers cover max(prefill_chunk, max_batch_tokens)."""
    from engine import cuda_backend
    from engine.cuda_backend import DeviceSpec
    from lanes import server

    seen: dict[str, object] = {}
    monkeypatch.setattr(server.Engine, "open", lambda *a, **kw: seen.update(kw) or "engine")
    for kind, want in (("cuda", (2048, 2048)), ("cpu", (512, 512))):
        monkeypatch.setattr(cuda_backend, "resolve_device",
                            lambda d, kind=kind: DeviceSpec("cuda", 0) if kind == "cuda" else DeviceSpec("cpu"))
        server.open_engine(LaneConfig(device="auto"), None)
        assert (seen["prefill_chunk"], seen["step_tokens"], seen["device"]) == (*want, "auto")
    cfg = LaneConfig(prefill_chunk=256, scheduler={"max_batch_tokens": 1024})  # a CPU lane that set them
    server.open_engine(cfg, None)
    assert (seen["prefill_chunk"], seen["step_tokens"]) == (256, 1024)
