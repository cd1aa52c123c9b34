"""RoPE scaling (linear, YaRN) on the GPU against the CPU engine (the oracle; the CPU's own scaling is
checked against llama.cpp and transformers in tests/engine/test_rope_scaling.py).

Small random llama (Mixtral-style, 4 experts) and qwen3moe models state a trained context of 64 with
factor 4 (rope.scaling.original_context_length 64), as the CPU tests write them, in two head shapes:
head_dim 128 (the fused decode attention's unrolled head prep, whose cos / sin table is its own code)
and head_dim 64 (the generic prep). Prompts of 200 tokens put most positions beyond the original
context. Checked on the GPU: the logits of a prompt prefilled in chunks of 64 (the later chunks attend
to a cached prefix: prefill at depth), the logits of decode steps one token at a time, split-KV decode
(att_split_min lowered so these depths split), greedy tokens and 16 sequences batched == each alone.
F32 weights: the devices agree to float rounding, so logits are held to 1e-3 of max|ref| (measured
expectation ~1e-6), and the same GPU model without the scaling is far off beyond the original context
(the comparison sees the rotation)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.engine import Engine
from engine.rope import RopeOverrides
from tests.engine.gguf_factory import make_random_gguf
from tests.engine.gpu._env import rel_err, requires_gpu
from tests.engine.gpu._model_checks import check_batched, check_greedy, decode_steps

pytestmark = requires_gpu

# GPU against CPU: the GPU's prefill attention runs on tensor cores (K and V as f16 in both engines; the scores in
# f16 products), 1.1-2.6e-3 of max|ref| at head_dim 128 on the H200; the GPU model rule of _model_checks is 1e-2
TOL = 5e-3
# a comparison that sees the scaling: the unscaled (or file-only) model is further from the reference than this
SEEN = 2e-2
ORIG = 64
FACTOR = 4.0
PROMPT_LEN = 200
VARIANTS = [
    ("llama", "linear", 128),
    ("llama", "yarn", 128),
    ("qwen3moe", "linear", 64),
    ("qwen3moe", "yarn", 128),
    ("llama", "yarn", 64),
]


def _scaling(arch: str, kind: str) -> dict[str, object]:
    return {
        f"{arch}.rope.scaling.type": kind,
        f"{arch}.rope.scaling.factor": FACTOR,
        f"{arch}.rope.scaling.original_context_length": ORIG,
    }


def _model(path: Path, arch: str, kind: str, head_dim: int) -> Path:
    extra = {"qk_norm": True} if arch == "qwen3moe" else {}
    n_head = 256 // head_dim
    return make_random_gguf(
        path,
        arch=arch,
        vocab=True,
        seed=3,
        n_ctx=ORIG,
        n_embd=256,
        n_head=n_head,
        n_head_kv=max(1, n_head // 2),
        n_ff=128,
        metadata=_scaling(arch, kind),
        **extra,
    )


def _prompt(n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 128, n)]


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{a}-{k}-hd{h}" for a, k, h in VARIANTS])
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch, kind, hd = request.param
    return kind, _model(tmp_path_factory.mktemp("rope_gpu") / f"{arch}-{kind}-{hd}.gguf", arch, kind, hd)


def test_scaled_model_gpu_matches_cpu_beyond_the_original_context(variant: tuple[str, Path]) -> None:
    kind, path = variant
    prompt = _prompt()
    with (
        Engine.open(path, threads=2, kv_tokens=4096, prefill_chunk=64) as cpu,
        Engine.open(path, device="cuda:0", kv_tokens=4096, prefill_chunk=64) as gpu,
    ):
        assert gpu.device.kind == "cuda" and gpu.rope.active and gpu.rope.type == kind
        ref = np.asarray(cpu.logits_for(prompt), np.float32)
        got = np.asarray(gpu.logits_for(prompt), np.float32)
        err = rel_err(got, ref)
        print(
            f"{path.name}: prefill logits GPU vs CPU {err:.3e}, beyond {ORIG}: {rel_err(got[ORIG:], ref[ORIG:]):.3e}"
        )
        assert err <= TOL and rel_err(got[ORIG:], ref[ORIG:]) <= TOL
        dec = decode_steps(gpu, prompt, 120)
        derr = rel_err(dec, ref[120:])
        print(f"{path.name}: decode logits GPU vs CPU {derr:.3e}")
        assert derr <= TOL
        check_greedy(cpu, gpu, prompt[:100], exact=False, bound=TOL)
        rng = np.random.default_rng(5)
        check_batched(
            gpu, [[int(t) for t in rng.integers(3, 128, int(n))] for n in rng.integers(60, 180, 16)]
        )
    with Engine.open(
        path, device="cuda:0", kv_tokens=512, rope=RopeOverrides(rope_scaling_type="none")
    ) as plain:
        off = np.asarray(plain.logits_for(prompt), np.float32)
    assert rel_err(off[ORIG:], ref[ORIG:]) > SEEN  # the comparison sees the scaling


def test_split_decode_of_a_scaled_model_matches_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Split-KV decode (k_qkv_post's rotation, the split grid) with YaRN: att_split_min 32 splits these depths."""
    path = _model(tmp_path / "yarn.gguf", "qwen3moe", "yarn", 128)
    prompt = _prompt(260, seed=3)
    monkeypatch.setenv("STRATA_GPU_ATT_SPLIT_MIN", "32")
    with (
        Engine.open(path, threads=2, kv_tokens=512) as cpu,
        Engine.open(path, device="cuda:0", kv_tokens=512) as gpu,
    ):
        ref = np.asarray(cpu.logits_for(prompt), np.float32)
        dec = decode_steps(gpu, prompt, 180)
        err = rel_err(dec, ref[180:])
        print(f"split decode logits GPU vs CPU {err:.3e}")
        assert err <= TOL


def test_lane_overrides_run_the_same_on_both_devices(tmp_path: Path) -> None:
    """A lane's overrides (factor 8, beta_fast 16, original context 32) reach the GPU's rotation as the CPU's."""
    path = _model(tmp_path / "yarn.gguf", "llama", "yarn", 128)
    rope = RopeOverrides(rope_scaling_factor=8.0, yarn_beta_fast=16.0, yarn_orig_ctx=32)
    prompt = _prompt(160, seed=4)
    with (
        Engine.open(path, threads=2, kv_tokens=512, rope=rope) as cpu,
        Engine.open(path, device="cuda:0", kv_tokens=512, rope=rope) as gpu,
    ):
        assert gpu.rope == cpu.rope and gpu.rope.factor == 8.0
        ref = np.asarray(cpu.logits_for(prompt), np.float32)
        got = np.asarray(gpu.logits_for(prompt), np.float32)
    with Engine.open(path, device="cuda:0", kv_tokens=512) as file_only:
        base = np.asarray(file_only.logits_for(prompt), np.float32)
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)
    assert rel_err(base[32:], ref[32:]) > SEEN / 2  # the override did change the model
