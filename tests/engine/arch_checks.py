"""The checks the architecture test modules (test_glm4moe, test_gptoss, test_deepseek2, test_rope_scaling) make
the same way on their own files: greedy decoding against llama.cpp, a mixed step against each sequence alone, and
the GPU engine's refusals on a machine without a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine
from tests.engine.parity import TOL, judge_greedy, llama_greedy, llama_logits, rel_err
from tests.engine.sched_helpers import prefill_together, release_tables


def check_greedy_matches_llama(path: Path, llm: Any, prompt: list[int], n: int, kv_tokens: int = 256) -> None:
    """The engine's greedy decoding of ``n`` tokens after ``prompt`` against llama.cpp (``llm``, on the same
    file): llama.cpp's logits behind every step, on the engine's own continuation, within TOL; every pick
    llama.cpp's argmax up to the first near-tie (judge_greedy); with no tie met, llama.cpp's own greedy run
    (its KV cache, one token at a time) gives the same tokens."""
    with Engine.open(path, threads=2, kv_tokens=kv_tokens) as eng:
        gen = [int(t) for t in eng.generate(prompt, max_tokens=n, ignore_eos=True).token_ids]
        assert len(gen) == n
        seq = prompt + gen[:-1]
        ours = np.asarray(eng.logits_for(seq), dtype=np.float32)
    theirs = llama_logits(llm, seq)
    assert rel_err(ours[len(prompt) - 1:], theirs[len(prompt) - 1:]) <= TOL
    if judge_greedy(gen, theirs, len(prompt) - 1, TOL):
        assert gen == llama_greedy(llm, prompt, n)


def check_batched_equals_alone(path: Path, n_vocab: int) -> None:
    """Three prompts (3, 21 and 9 random ids below ``n_vocab``) prefilled in one forward step: every row's logits
    are the ones its sequence gets alone, bit for bit."""
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(0, n_vocab, n)] for n in (3, 21, 9)]
    with Engine.open(path, threads=2, kv_tokens=512) as eng:
        alone = [eng.logits_for(p) for p in prompts]
        batched, tables = prefill_together(eng, prompts)
        release_tables(eng, tables)
    assert np.array_equal(batched, np.concatenate(alone))


def check_cuda_open_reaches_the_device(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An architecture the GPU engine runs (engine.engine.GPU_ARCHES): an explicit cuda:N passes the architecture
    check and goes to the device, whose absence (simulated here) is the typed DeviceUnavailableError, not the
    CPU-only refusal."""
    import engine.engine as engine_mod
    from engine.cuda_backend import DeviceUnavailableError

    def no_device(device: str | None) -> None:
        raise DeviceUnavailableError(f"{device}: no CUDA device (test)", "device")

    monkeypatch.setattr(engine_mod, "resolve_device", no_device)
    with pytest.raises(DeviceUnavailableError, match="no CUDA device"):
        Engine.open(path, threads=1, kv_tokens=64, device="cuda:0")


def check_hybrid_placement_refused(path: Path, monkeypatch: pytest.MonkeyPatch, layer: int) -> None:
    """An architecture the GPU engine runs with every expert on the device only (engine.engine.GPU_WHOLE_ONLY): a
    budget whose plan leaves a routed expert (expert 0 of layer ``layer``, a MoE layer) on the CPU is refused with
    HybridArchError before any GPU is touched (cuda:0 resolves without one here)."""
    import engine.engine as engine_mod
    import engine.placement as placement_mod
    from engine.cuda_backend import DeviceSpec
    from engine.engine import HybridArchError

    real = engine_mod.resolve_device
    monkeypatch.setattr(engine_mod, "resolve_device", lambda d: DeviceSpec("cuda", 0) if d == "cuda:0" else real(d))
    whole = placement_mod.resident_mask

    def partial(mf: Any, plan: Any) -> np.ndarray:
        mask = whole(mf, plan).copy()
        mask[layer, 0] = 0
        return mask

    monkeypatch.setattr(placement_mod, "resident_mask", partial)
    with pytest.raises(HybridArchError, match="every expert on the device"):
        Engine.open(path, threads=1, kv_tokens=64, device="cuda:0", gpu_budget_gb=1000.0)
