"""The lane's Prometheus metrics (lanes/metrics.py) from the engine loop's step reports, no engine needed: a GPU
step's frame profile lands in one histogram per part, the resident hit rate and the PCIe bytes beside it; a CPU
step leaves them untouched."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.scheduler import StepReport
from engine.step import StepStats
from lanes.metrics import FRAME_PARTS, LaneMetrics


def samples(m: LaneMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def report(st: StepStats) -> StepReport:
    return StepReport(stats=st, n_decode=st.n_tokens, n_prefill=0, n_running=st.n_tokens, n_waiting=0,
                      n_preempted=0, kv_usage=0.1, wall=st.t_total + 0.0005)


def gpu_stats() -> StepStats:
    # a hybrid decode step's figures (seconds): total = gpu + pcie + gpu_wait
    return StepStats(n_tokens=1, t_total=0.0170, t_attn=0.0, t_experts=0.0, t_dense=0.0, t_output=0.0,
                     n_expert_tokens=384, n_active_experts=384, t_gpu=0.0032, t_cpu_experts=0.0131,
                     t_gpu_wait=0.0133, t_pcie=0.0005, t_cpu_wait=0.0030, resident_hit_rate=0.25,
                     pcie_bytes=4_000_000, on_gpu=True)


def test_gpu_frame_profile_is_exported_by_part() -> None:
    m = LaneMetrics("A")
    before = samples(m)
    for part, _ in FRAME_PARTS:  # every part's series exists, empty, before the first step
        assert before[("strata_frame_seconds_count", (("part", part),))] == 0
    st = gpu_stats()
    m.on_step(report(st))
    m.on_step(report(st))
    got = samples(m)
    for part, field in FRAME_PARTS:
        key = (("part", part),)
        assert got[("strata_frame_seconds_count", key)] == 2
        assert abs(got[("strata_frame_seconds_sum", key)] - 2 * getattr(st, field)) < 1e-12
    # the device's parts add up to its total (the account the histograms carry)
    parts = sum(got[("strata_frame_seconds_sum", (("part", p),))] for p in ("gpu", "pcie", "gpu_wait"))
    assert abs(parts - got[("strata_frame_seconds_sum", (("part", "total"),))]) < 1e-12
    # 13.3 ms of waiting falls in the 15 ms bucket, not the 10 ms one
    assert got[("strata_frame_seconds_bucket", (("le", "0.01"), ("part", "gpu_wait")))] == 0
    assert got[("strata_frame_seconds_bucket", (("le", "0.015"), ("part", "gpu_wait")))] == 2
    assert got[("strata_resident_hit_ratio", ())] == 0.25
    assert got[("strata_expert_work_share", (("device", "gpu"),))] == 0.25
    assert got[("strata_expert_work_share", (("device", "cpu"),))] == 0.75
    assert got[("strata_pcie_bytes_total", ())] == 8_000_000
    assert got[("strata_last_step_seconds", (("part", "gpu_wait"),))] == st.t_gpu_wait


def test_estimated_frame_parts_stay_out_of_the_histograms() -> None:
    # a decode-sized hybrid step between two sampled ones estimates its compute / PCIe split; the histograms count
    # those two parts from measured steps only, the clock-measured parts from every step
    m = LaneMetrics("A")
    measured, estimated = gpu_stats(), gpu_stats()
    estimated.frame_measured = False
    estimated.t_gpu, estimated.t_pcie = 0.0030, 0.0007
    m.on_step(report(measured))
    m.on_step(report(estimated))
    got = samples(m)
    for part, field in FRAME_PARTS:
        key = (("part", part),)
        if part in ("gpu", "pcie"):
            assert got[("strata_frame_seconds_count", key)] == 1
            assert abs(got[("strata_frame_seconds_sum", key)] - getattr(measured, field)) < 1e-12
        else:
            assert got[("strata_frame_seconds_count", key)] == 2
    assert got[("strata_last_step_seconds", (("part", "gpu"),))] == 0.0030  # the gauge: the last step as reported


def test_cpu_step_leaves_the_frame_profile_alone() -> None:
    m = LaneMetrics("A")
    st = StepStats(n_tokens=4, t_total=0.02, t_attn=0.005, t_experts=0.012, t_dense=0.0, t_output=0.003,
                   n_expert_tokens=8, n_active_experts=6)
    m.on_step(report(st))
    got = samples(m)
    assert got[("strata_step_seconds_count", ())] == 1
    for part, _ in FRAME_PARTS:
        assert got[("strata_frame_seconds_count", (("part", part),))] == 0
    assert got[("strata_expert_work_share", (("device", "cpu"),))] == 1.0
    assert got[("strata_pcie_bytes_total", ())] == 0
