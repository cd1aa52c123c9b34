"""The GPU-against-CPU model checks the GPU model tests share: logits within a tolerance of max|ref|,
greedy tokens identical up to the oracle's first near-tie, 16 sequences batched == each alone
(the rules are explained in test_gpu_models.py's docstring)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, collect_text
from tests.engine.gguf_factory import make_random_gguf
from tests.engine.gpu._env import rel_err

N_GREEDY = 64


def greedy(n: int) -> SamplingParams:
    return SamplingParams.parse(temperature=0.0, max_tokens=n, ignore_eos=True)


def tokens_of(eng: Engine, ids: list[int], n: int) -> list[int]:
    return eng.generate(ids, max_tokens=n, ignore_eos=True).token_ids


def decode_steps(eng: Engine, ids: list[int], n_pre: int) -> np.ndarray:
    """ids[:n_pre] prefilled, then one decode step per remaining token: their logits [len - n_pre, n_vocab]."""
    blocks = eng.blocks.allocate(-(-len(ids) // eng.block_size))
    assert blocks is not None
    try:
        eng.prefill(ids[:n_pre], blocks)
        return np.stack([eng.prefill([ids[p]], blocks, start=p) for p in range(n_pre, len(ids))])
    finally:
        eng.blocks.release(blocks)


def check_greedy(
    cpu: Engine, gpu: Engine, prompt: list[int], exact: bool, note: str = "", bound: float = 1e-2
) -> None:
    """Greedy tokens identical for N_GREEDY steps, or until they first part at a near-tie of the
    oracle (cpu): there the GPU's token is within `bound` of max|logit| below the oracle's (so the
    oracle's own top-2 margin is too). Nothing is compared after it: a near-tie's continuations
    diverge legitimately."""
    a, b = tokens_of(cpu, prompt, N_GREEDY), tokens_of(gpu, prompt, N_GREEDY)
    assert len(a) == len(b) == N_GREEDY
    if a == b:
        return
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    assert not exact, f"greedy tokens differ at step {i} on an F32 model"
    lg = cpu.logits_for(prompt + a[:i])[-1]  # a fresh sequence: no prefix-cache reuse
    gap, scale = float(lg[a[i]] - lg[b[i]]), float(np.abs(lg).max())
    print(
        f"greedy identical for {i} steps; there the GPU's token is {gap / scale:.3e} of max|logit| below the CPU's"
    )
    assert 0 <= gap <= bound * scale, (
        f"step {i}: GPU chose {b[i]}, CPU {a[i]} by a margin of {gap} (max|logit| {scale}, bound {bound:.3e}){note}"
    )


def check_batched(gpu: Engine, prompts: list[list[int]]) -> None:
    """16 sequences in one scheduler on the GPU == each alone on the GPU."""
    alone = []
    for p in prompts:
        s = Scheduler(gpu, SchedulerConfig(prefix_cache=False))
        rid = s.add(p, greedy(24))
        alone.append(collect_text(s.run_to_completion()[rid])[0])
    sched = Scheduler(gpu)
    rids = [sched.add(p, greedy(24)) for p in prompts]
    out = sched.run_to_completion()
    assert [collect_text(out[r])[0] for r in rids] == alone
    assert gpu.blocks.num_free == gpu.blocks.n_blocks
    st = gpu.last_stats
    assert st is not None and st.t_total > 0 and st.n_tokens >= 1


def check_model(
    path: Path,
    prompts: list[list[int]],
    kv_tokens: int = 4096,
    exact: bool = False,
    tol: float = 1e-2,
    rows: np.ndarray | None = None,
    tie: float = 1e-2,
) -> None:
    """rows: a mask of prompts[0]'s positions whose logits are judged (None: all); the others are the oracle's
    own near-ties (decisive_rows). tie: check_greedy's near-tie bound (a 2-bit type's logits rule is wider)."""
    with (
        Engine.open(path, threads=2, kv_tokens=kv_tokens) as cpu,
        Engine.open(path, device="cuda:0", kv_tokens=kv_tokens) as gpu,
    ):
        assert gpu.device.kind == "cuda"
        ref = cpu.logits_for(prompts[0])
        got = gpu.logits_for(prompts[0])
        assert got.shape == ref.shape
        per_row = np.abs(got - ref).max(axis=-1) / np.abs(ref).max()
        print("GPU vs CPU per position (of max|ref|):", " ".join(f"{e:.1e}" for e in per_row))
        if rows is not None:
            print("judged positions:", np.nonzero(rows)[0].tolist())
            got, ref = got[rows], ref[rows]
        assert rel_err(got, ref) <= tol, rel_err(got, ref)
        check_greedy(cpu, gpu, prompts[0], exact, bound=tie)
        check_batched(gpu, prompts)


def write_hd128_moe(path: Path, n_ctx: int, n_vocab: int = 300) -> Path:
    """A small MoE model at head_dim 128 with 4 query heads on 1 kv head: the 8-bit cache's split and tensor-core
    kernels take it, as do the KV tiers' (test_gpu_kv_q8, test_gpu_kv_tiers)."""
    return make_random_gguf(path, n_vocab=n_vocab, n_layer=2, n_embd=512, n_head=4, n_head_kv=1, n_ff=128,
                            n_expert=8, n_expert_used=2, n_ctx=n_ctx)
