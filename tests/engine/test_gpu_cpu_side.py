"""The GPU engine seen from a machine without a GPU (CI): its CUDA sources compile wherever
nvcc exists, and asking for a GPU that cannot be used is a clear, typed error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from engine import cuda_backend
from engine._build_cuda import find_nvcc
from engine.cuda_backend import DeviceSpec, DeviceUnavailableError, parse_device
from engine.engine import Engine
from engine.native import EngineError
from tests.engine.gguf_factory import make_random_gguf
from tests.engine.gpu._env import NO_GPU

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc is not installed: the CUDA sources cannot be compiled here")
def test_cuda_sources_compile_without_warnings() -> None:
    r = subprocess.run([sys.executable, "-m", "engine._build_cuda", "--check"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warning" not in (r.stdout + r.stderr).lower()


def test_build_without_nvcc_prints_one_line_and_succeeds(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from engine import _build_cuda

    monkeypatch.setattr(_build_cuda, "find_nvcc", lambda: None)
    assert _build_cuda.main([]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "nvcc not found" in out


@pytest.mark.parametrize(("text", "spec"), [("cpu", DeviceSpec("cpu")), (None, DeviceSpec("cpu")),
                                            ("cuda", DeviceSpec("cuda", 0)), ("CUDA:1", DeviceSpec("cuda", 1)),
                                            ("gpu:2", DeviceSpec("cuda", 2)), ("auto", DeviceSpec("auto"))])
def test_parse_device(text: str | None, spec: DeviceSpec) -> None:
    assert parse_device(text) == spec


@pytest.mark.parametrize("bad", ["cuda:x", "tpu", "cpu:0", "cuda:-1", ""])
def test_parse_device_rejects_nonsense(bad: str) -> None:
    if bad == "":
        assert parse_device(bad) == DeviceSpec("cpu")  # empty = the default
        return
    with pytest.raises(ValueError, match="expected 'cpu', 'auto', 'cuda' or 'cuda:N'"):
        parse_device(bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_gguf(tmp_path_factory.mktemp("gpu_cpu_side") / "tiny.gguf", n_vocab=64,
                            weight_type=GGMLQuantizationType.Q8_0)


@pytest.mark.skipif(NO_GPU is None, reason="this machine has a usable GPU")
def test_asking_for_a_gpu_without_one_is_a_typed_error(tiny: Path) -> None:
    with pytest.raises(DeviceUnavailableError) as ei:
        Engine.open(tiny, device="cuda:0", kv_tokens=64)
    assert ei.value.missing in ("build", "driver", "device")
    words = {"build": "not built", "driver": "driver", "device": "device"}[ei.value.missing]
    assert words in str(ei.value)


def test_missing_library_names_the_build(tiny: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cuda_backend, "LIB_PATH", tmp_path / "_strata_cuda.so")
    monkeypatch.setattr(cuda_backend, "_loaded", None)
    with pytest.raises(DeviceUnavailableError, match="GPU engine is not built") as ei:
        Engine.open(tiny, device="cuda:0", kv_tokens=64)
    assert ei.value.missing == "build"
    with Engine.open(tiny, device="auto", kv_tokens=64) as eng:  # auto falls back to the CPU
        assert str(eng.device) == "cpu"
        assert eng.generate([1, 2, 3], max_tokens=2, ignore_eos=True).token_ids


@pytest.mark.skipif(NO_GPU is None, reason="this machine has a usable GPU")
def test_cli_device_without_gpu_is_one_line_error(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli.main import main

    assert main(["generate", "--model", str(tiny), "--device", "cuda:0", "--prompt", "hi", "--kv-tokens", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("strata: error:") and "\n" not in err
    assert any(w in err for w in ("not built", "driver", "device"))


def test_lane_config_device_fields() -> None:
    from pydantic import ValidationError

    from lanes.config import ConfigError, LaneConfig

    assert LaneConfig().engine_device() == "cpu"
    assert LaneConfig(device="cuda").engine_device() == "cuda:0"
    assert LaneConfig(device="cuda", gpu=1).engine_device() == "cuda:1"
    assert LaneConfig(device="cuda:2").engine_device() == "cuda:2"
    assert LaneConfig(device="auto").engine_device() == "auto"
    with pytest.raises(ValidationError):
        LaneConfig(device="tpu")
    with pytest.raises(ConfigError, match="name different GPUs"):
        LaneConfig(device="cuda:0", gpu=1).engine_device()


def test_inspect_reports_whole_model_vram_fit(tiny: Path) -> None:
    from engine.gguf_model import open_model
    from engine.inspect_model import gpu_bytes, render

    mf = open_model(tiny)
    need = gpu_bytes(mf, 0)
    assert need > sum(t.n_bytes for t in mf.tensors.values())  # weights plus step buffers
    fits = render(mf, None, need / 2**30 * 1.01, 16)
    assert "fits: all weights + KV + step buffers" in fits
    assert "does NOT fit: all weights + KV + step buffers" in render(mf, None, need / 2**30 / 100, 16)


def test_gpu_budget_is_planned_before_any_device_is_touched(tiny: Path) -> None:
    """A GPU budget is planned first (engine.placement.engine_plan_params): below the parts every step needs (the
    non-routed weights, KV cache, step buffers, the context reserve) it is a GpuBudgetError before any device
    is touched (so it reads the same with or without a GPU); above them the plan goes on to the device (here:
    DeviceUnavailableError without one); the CPU stores and ignores it."""
    from engine.engine import GpuBudgetError, _gpu_plan
    from engine.gguf_model import open_model
    from engine.native import UnsupportedError
    from engine.placement import engine_plan_params, plan

    mf = open_model(tiny)
    base = plan(mf, engine_plan_params(0, 64, 16, 512))
    fixed, routed = base.fixed_bytes, base.routed_bytes
    with pytest.raises(GpuBudgetError, match="raise the budget") as e:
        Engine.open(tiny, device="cuda:0", gpu_budget_gb=fixed / 2**30 * 0.5, kv_tokens=64)
    assert isinstance(e.value, UnsupportedError) and f"{fixed / 2**30:.2f} GiB" in str(e.value)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gpu_budget_gb"):
            Engine.open(tiny, device="cuda:0", gpu_budget_gb=bad, kv_tokens=64)
    half = (fixed + routed // 2 + 64) / 2**30
    got = _gpu_plan(mf, half, 64, 16, 512, None)
    assert got is not None
    p, source = got
    assert 0 < p.n_resident < p.n_routed and p.gpu_bytes <= half * 2**30 and "uniform" in source
    if NO_GPU is not None:  # a hybrid plan goes on to the device, which is missing here
        with pytest.raises(DeviceUnavailableError):
            Engine.open(tiny, device="cuda:0", gpu_budget_gb=half, kv_tokens=64)
    with Engine.open(tiny, gpu_budget_gb=fixed / 2**30 * 0.5, kv_tokens=64, threads=1) as eng:  # the CPU stores it
        assert eng.gpu_budget_gb == fixed / 2**30 * 0.5 and eng.device.kind == "cpu" and eng.plan is None
        with pytest.raises(EngineError, match="runs on the CPU"):
            eng.gpu_memory()
        eng.forward([1, 2, 3], [0, 1, 2], [0, 0, 0], [list(eng.blocks.allocate(1))], [2])
        st = eng.last_stats
        assert st is not None and st.t_gpu == st.t_gpu_wait == st.t_cpu_experts == 0 and st.staged_bytes == 0
        assert not st.on_gpu and st.t_pcie == st.t_cpu_wait == 0 and st.pcie_bytes == st.staged_layers == 0


def test_gpu_budget_counts_the_largest_step(tiny: Path) -> None:
    """Engine.open's step_tokens (a lane's scheduler.max_batch_tokens): the plan's step buffers hold
    max(prefill_chunk, step_tokens) tokens, so a budget that fits 512-token steps but not 4096-token ones
    refuses a caller that sends 4096-token steps."""
    from engine.engine import GpuBudgetError
    from engine.gguf_model import open_model
    from engine.placement import engine_plan_params, plan

    mf = open_model(tiny)
    small = plan(mf, engine_plan_params(0, 64, 16, 512)).fixed_bytes
    large = plan(mf, engine_plan_params(0, 64, 16, 4096)).fixed_bytes
    assert large > small
    between = (small + large) / 2 / 2**30
    with pytest.raises(GpuBudgetError, match="raise the budget"):
        Engine.open(tiny, device="cuda:0", gpu_budget_gb=between, kv_tokens=64, step_tokens=4096)
    with pytest.raises(GpuBudgetError, match="raise the budget"):
        Engine.open(tiny, device="cuda:0", gpu_budget_gb=between, kv_tokens=64, prefill_chunk=4096, step_tokens=64)
    with pytest.raises(ValueError, match="step_tokens"):
        Engine.open(tiny, device="cuda:0", gpu_budget_gb=between, kv_tokens=64, step_tokens=0)
    if NO_GPU is not None:  # 512-token steps fit: the plan goes on to the device, which is missing here
        with pytest.raises(DeviceUnavailableError):
            Engine.open(tiny, device="cuda:0", gpu_budget_gb=between, kv_tokens=64, step_tokens=256)


def test_staging_reserves_its_ring_in_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hybrid_stage = N >= 1 (steps of at least N tokens may stage; 64 by default): the hybrid plan holds the
    staging ring (two whole layers' routed experts, 2 x n_expert x the largest expert) among its fixed parts, so
    fewer experts are resident under one budget; 0, no ring; a budget that holds the rest but not the ring gets a
    plan without it (the engine then turns staging off) rather than a refusal."""
    from engine.engine import _gpu_plan
    from engine.gguf_model import open_model
    from engine.placement import engine_plan_params, expert_bytes, plan

    # six layers: the ring (two layers' experts) leaves room for resident experts under a budget short of all
    mf = open_model(make_random_gguf(tmp_path / "six.gguf", n_vocab=64, n_layer=6,
                                     weight_type=GGMLQuantizationType.Q8_0))
    base = plan(mf, engine_plan_params(0, 64, 16, 512))
    ring = 2 * mf.hparams.n_expert * int(expert_bytes(mf).max())
    assert base.routed_bytes > ring + int(expert_bytes(mf).max())  # room for experts beside the ring
    budget = (base.fixed_bytes + base.routed_bytes - int(expert_bytes(mf).max())) / 2**30  # all experts but one
    monkeypatch.setenv("STRATA_GPU_HYBRID_STAGE", "0")
    off = _gpu_plan(mf, budget, 64, 16, 512, None)
    assert off is not None and "staging slots" not in off[0].fixed
    for floor in ("", "1", "64"):  # "": the default
        monkeypatch.setenv("STRATA_GPU_HYBRID_STAGE", floor)
        staged = _gpu_plan(mf, budget, 64, 16, 512, None)
        assert staged is not None
        assert staged[0].fixed["staging slots"] == ring and staged[0].n_resident < off[0].n_resident
    monkeypatch.delenv("STRATA_GPU_HYBRID_STAGE")
    tight = _gpu_plan(mf, (base.fixed_bytes + ring // 2) / 2**30, 64, 16, 512, None)
    assert tight is not None and tight[0].params.staging_slots == 0 and "staging slots" not in tight[0].fixed
    whole = _gpu_plan(mf, (base.fixed_bytes + base.routed_bytes + 64) / 2**30, 64, 16, 512, None)
    assert whole is not None and whole[0].params.staging_slots == 0  # every expert resident: nothing to stage
    assert whole[0].n_resident == whole[0].n_routed


@pytest.mark.parametrize(("threads", "env", "want"), [
    (16, {}, 15), (16, {"STRATA_GPU_HYBRID_OVERLAP": "1"}, 15), (16, {"STRATA_GPU_HYBRID_OVERLAP": "0"}, 16),
    (2, {}, 2), (1, {}, 1), (3, {}, 2),
])
def test_hybrid_pool_leaves_a_core_to_the_queueing_thread(threads: int, env: dict[str, str], want: int) -> None:
    """The overlapped hybrid step (the default) queues the whole step on the calling thread while the pool
    computes the CPU's experts: the pool takes one core less (above two), none less with the overlap off."""
    from engine.engine import hybrid_pool_threads

    assert hybrid_pool_threads(threads, env) == want


def test_gpu_header_declares_the_hybrid_entry_points() -> None:
    """The GPU engine's C API as cffi reads it (no library needed): the hybrid placement's create call, the CPU
    engine's function pointers, the memory account and the frame profile."""
    from cffi import FFI

    f = FFI()
    f.cdef(cuda_backend.cdef_text())
    ce = f.new("stg_cpu_experts *")
    assert f.typeof(ce.moe_pairs).cname.startswith("int32_t(*)(void *, void *, int32_t")
    p = f.new("stg_profile *")
    assert {"t_total", "t_gpu", "t_cpu_experts", "t_gpu_wait", "pairs_gpu", "pairs_cpu", "staged_bytes", "t_pcie",
            "t_cpu_wait", "pcie_bytes", "staged_layers", "stage_pcie_gbs", "stage_gpu_gbs", "stage_cpu_pairs_s"} <= \
        {name for name, _ in f.typeof(p[0]).fields}
    text = cuda_backend.cdef_text()
    for fn in ("stg_model_create_hybrid", "stg_model_memory", "stg_model_resident_experts", "stg_step_profile",
               "stg_model_set_stage_rate", "stg_model_stage_info", "stg_model_set_cpu_attn"):
        assert f"{fn}(" in text


def test_gpu_cpu_attn_matches_the_c_engine_entry() -> None:
    """kv_host_attn's function pointer (stg_cpu_attn.attn_blocks) has the C engine's st_attn_blocks_part's
    parameters, so the address cuda_backend casts is called as declared; the profile reports its bytes and time
    and the settings carry the field."""
    from cffi import FFI

    from engine.native import ffi as cpu_ffi
    from engine.native import lib as cpu_lib

    f = FFI()
    f.cdef(cuda_backend.cdef_text())
    ca = f.new("stg_cpu_attn *")
    gpu_args = [t.cname for t in f.typeof(ca.attn_blocks).args]
    cpu_args = [t.cname for t in cpu_ffi.typeof(cpu_lib.st_attn_blocks_part).args]
    assert len(gpu_args) == len(cpu_args) == 18
    assert gpu_args[0] == "void *" and cpu_args[0] == "struct st_pool *"
    assert gpu_args[1:] == [a.replace("struct st_pool *", "void *") for a in cpu_args[1:]]
    assert cpu_lib.ST_KV_F16 == 0 and cpu_lib.ST_KV_Q8_0 == 1  # STG_KV_F16 / STG_KV_Q8_0
    assert {"kv_cpu_bytes", "t_cpu_attn", "kv_cpu_share", "kv_cpu_gbs", "kv_pcie_gbs"} <= \
        {name for name, _ in f.typeof("stg_profile").fields}
    assert {"kv_host_attn", "kv_host_share"} <= {name for name, _ in f.typeof("stg_settings").fields}


@pytest.mark.parametrize(("env", "want"), [({}, None), ({"STRATA_GPU_KV_HOST_SHARE": "-1"}, -1),
                                           ({"STRATA_GPU_KV_HOST_SHARE": "0"}, 0),
                                           ({"STRATA_GPU_KV_HOST_SHARE": "40"}, 40)])
def test_kv_host_share_override(env: dict[str, str], want: int | None) -> None:
    """kv_host_attn's mixed form: STRATA_GPU_KV_HOST_SHARE sets kv_host_share (the CPU's %, -1 measured)."""
    from engine import gpu_settings

    assert gpu_settings.env_override("kv_host_share", env) == want


@pytest.mark.parametrize(("env", "want"), [({}, False), ({"STRATA_GPU_KV_HOST_ATTN": "0"}, False),
                                           ({"STRATA_GPU_KV_HOST_ATTN": "1"}, True)])
def test_kv_host_attn_gives_the_pool_the_lane_cores(env: dict[str, str], want: bool) -> None:
    from engine.engine import kv_host_attn_on

    assert kv_host_attn_on(env) is want


def test_cores_outside_the_machine_are_refused(tiny: Path) -> None:
    import os

    n = os.cpu_count() or 1
    for bad, msg in (([n], "outside this machine"), ([0, 0], "duplicate"), ([], "empty")):
        with pytest.raises(ValueError, match=msg):
            Engine.open(tiny, cores=bad, kv_tokens=64)
    with Engine.open(tiny, cores=[0], kv_tokens=64) as eng:
        assert eng.cores == [0] and eng.threads == 1


def test_hybrid_steps_take_pdl_with_cuts_after_copies() -> None:
    """Programmatic dependent launch in hybrid steps (hybrid.cu's top comment): step.cu does not exclude hybrid
    steps, and every copy or event wait that the hybrid step queues on the compute stream is followed by pdl_cut
    before the next launch (the kernel after it goes without the attribute)."""
    import re

    from cffi import FFI

    from engine import gpu_settings

    f = FFI()
    f.cdef(cuda_backend.cdef_text())
    assert "hybrid_pdl" not in {name for name, _ in f.typeof("stg_settings").fields}
    assert gpu_settings.env_override("hybrid_pdl", {"STRATA_GPU_HYBRID_PDL": "1"}) is None
    csrc = Path(cuda_backend.__file__).parent / "csrc" / "cuda"
    step_cu = (csrc / "step.cu").read_text()
    g_pdl = re.search(r"\n\s*g_pdl = (m->cc_major[^;]*);", step_cu).group(1)
    assert "m->set.pdl" in g_pdl and "hy.on" not in g_pdl, g_pdl
    for name, fns, op in (("hybrid.cu", ("hybrid_send", "hybrid_receive"), r"cudaMemcpyAsync\("),
                          ("staging.cu", ("staging_queue",), r"cudaStreamWaitEvent\(m->stream")):
        text = (csrc / name).read_text()
        for fn in fns:
            start = text.index(f"static stg_status {fn}(")
            body = text[start:text.index("\n}\n", start)]
            ops = [m.end() for m in re.finditer(op, body)]
            assert ops, (name, fn)
            for at in ops:
                rest = body[at:]
                cut, launch = rest.find("pdl_cut("), rest.find("launch_k(")
                assert cut >= 0 and (launch < 0 or cut < launch), f"{name} {fn}: a launch after {op} without pdl_cut"
