"""deepseek2 (DeepSeek-V2 / V3 / R1, Kimi-K2) on the CPU engine against llama.cpp and a NumPy pass.

Small random deepseek2 GGUFs written by tests/engine/gguf_factory.make_deepseek2_gguf carry the real
layout: multi-head latent attention (a compressed KV latent plus a rotary key part shared by the
heads, heads of nope + rope query / key and narrower value dimensions, n_head x head_dim != n_embd),
a leading dense layer, then MoE layers with shared experts and group-limited routing. Variants:

* "v3": DeepSeek-V3 / Kimi-K2 in miniature: low-rank q (attn_q_a / attn_q_b), the expansion split as
  attn_k_b / attn_v_b with the MLA keys (as llama.cpp's converter writes it today), sigmoid gating
  with the score-correction bias exp_probs_b, 4 groups of which the best 2 stay eligible, weights
  renormalised x 2.5, one shared expert;
* "v2": DeepSeek-V2 in miniature, an older file: q straight from attn_q, one attn_kv_b, softmax
  gating (the key absent: llama.cpp's default for deepseek2), 8 groups best 3, no score bias, no
  renormalisation or scale keys, two shared experts;
* "iq3_xxs" / "q2_k": "v3" with its routed experts in IQ3_XXS / Q2_K (random valid blocks, kept
  small: both engines quantise the experts' activations to 8 bits, and that noise must stay inside
  the tolerance, as tests/engine/test_iq_models.py explains).

Each is checked on a 32-token prompt against llama.cpp (llama-cpp-python, F32 KV cache) within the
tolerance of the other architecture tests (max|delta| / max|ref| <= 1e-3) and, for F32 experts,
against the NumPy float64 pass below: the plain per-head (decompressed) attention of llama.cpp's
graph for files without the MLA keys, which agrees with llama.cpp to float32 rounding, so the
engine's latent cache and absorbed queries are checked against the textbook form; with the
engine's F16 rounding applied to the cached latent row, it matches the engine far inside the
tolerance (the cache is the distance). Then 64 greedy tokens, judged up to the first near-tie.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from engine.engine import Engine
from engine.gguf_model import GGUFError, UnsupportedModelError, open_model
from tests.engine.arch_checks import (
    check_batched_equals_alone,
    check_cuda_open_reaches_the_device,
    check_greedy_matches_llama,
    check_hybrid_placement_refused,
)
from tests.engine.gguf_factory import DEEPSEEK_VOCAB, make_deepseek2_gguf
from tests.engine.parity import TOL, llama_logits, read_gguf_f64, rel_err, rms, shared_and_routed_ffn, swiglu

PROMPT_LEN = 32
N_GREEDY = 64
QUANT = {"n_ff_exp": 256, "expert_std": 0.02}  # 256-wide rows for the 256-blocks, small experts
VARIANTS: dict[str, dict[str, Any]] = {
    "v3": dict(seed=2),
    "v2": dict(split=False, q_lora_rank=0, gating=None, weights_scale=None, weights_norm=None, n_group=8,
               n_group_used=3, n_expert_shared=2, exp_probs_b=False, seed=2),
    "iq3_xxs": dict(expert_type=GGMLQuantizationType.IQ3_XXS, seed=11, **QUANT),
    "q2_k": dict(expert_type=GGMLQuantizationType.Q2_K, seed=11, **QUANT),
}


class RefModel:
    """The deepseek2 forward pass in float64 from the GGUF's tensors and metadata, attention in
    llama.cpp's per-head (decompressed) form: head h's key [W_UK_h c, k_pe], value W_UV_h c, softmax
    scale 1 / sqrt(nope + rope). f16_kv rounds the latent row (c, k_pe) to F16 as the engine's cache
    does; zero_experts drops the routed experts (to show they matter)."""

    def __init__(self, path: Path) -> None:
        self.t, kv = read_gguf_f64(path, "deepseek2")
        self.n_layer, self.n_head = kv("block_count"), kv("attention.head_count")
        self.split = kv("attention.key_length_mla") is not None
        self.hd = kv("attention.key_length_mla") or kv("attention.key_length")
        self.vd = kv("attention.value_length_mla") or kv("attention.value_length")
        self.rope, self.kl, self.ql = kv("rope.dimension_count"), kv("attention.kv_lora_rank"), kv("attention.q_lora_rank", 0)
        self.nope = self.hd - self.rope
        self.base, self.eps = kv("rope.freq_base"), kv("attention.layer_norm_rms_epsilon")
        self.k, self.dense = kv("expert_used_count"), kv("leading_dense_block_count", 0)
        self.gating = kv("expert_gating_func", 0) or 1  # llama.cpp's default for deepseek2: softmax
        self.norm, self.scale = bool(kv("expert_weights_norm", False)), kv("expert_weights_scale", 0.0) or 1.0
        self.n_group, self.n_group_used = kv("expert_group_count", 0), kv("expert_group_used_count", 0)
        self.f16_kv = self.zero_experts = False
        self.margin = np.inf

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """llama.cpp's NORM rotation (adjacent pairs) of the last axis (rope dims) at positions pos."""
        theta = pos[:, None] * self.base ** (-np.arange(self.rope // 2) * 2.0 / self.rope)  # [T, rope / 2]
        while theta.ndim < x.ndim:
            theta = theta[:, None, :]
        c, s = np.cos(theta), np.sin(theta)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
        return out

    def _kv_b(self, p: str) -> np.ndarray:
        """The latent's expansion [n_head * (nope + vd), kv_lora_rank], rebuilt from k_b / v_b when split."""
        if not self.split:
            return self.t[p + "attn_kv_b.weight"]
        k_b, v_b = self.t[p + "attn_k_b.weight"], self.t[p + "attn_v_b.weight"]  # [H, kl, nope], [H, vd, kl]
        return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, self.kl)

    def logits(self, ids: list[int]) -> np.ndarray:
        t, T, H = self.t, len(ids), self.n_head
        x = t["token_embd.weight"][ids]
        pos = np.arange(T, dtype=np.float64)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = rms(x, t[p + "attn_norm.weight"], self.eps)
            if self.ql:
                q = rms(h @ t[p + "attn_q_a.weight"].T, t[p + "attn_q_a_norm.weight"], self.eps) @ t[p + "attn_q_b.weight"].T
            else:
                q = h @ t[p + "attn_q.weight"].T
            q = q.reshape(T, H, self.hd)
            q = np.concatenate([q[..., : self.nope], self._rope(q[..., self.nope:], pos)], axis=-1)
            kva = h @ t[p + "attn_kv_a_mqa.weight"].T
            c, k_pe = rms(kva[:, : self.kl], t[p + "attn_kv_a_norm.weight"], self.eps), self._rope(kva[:, self.kl:], pos)
            if self.f16_kv:
                c, k_pe = c.astype(np.float16).astype(np.float64), k_pe.astype(np.float16).astype(np.float64)
            kv = (c @ self._kv_b(p).T).reshape(T, H, self.nope + self.vd)
            k = np.concatenate([kv[..., : self.nope], np.repeat(k_pe[:, None, :], H, axis=1)], axis=-1)
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.hd) + mask
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            x = x + np.einsum("hts,shd->thd", a, kv[..., self.nope:]).reshape(T, -1) @ t[p + "attn_output.weight"].T
            h = rms(x, t[p + "ffn_norm.weight"], self.eps)
            if il < self.dense:
                x = x + swiglu(h, t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"], t[p + "ffn_down.weight"])
                continue
            out, margin = shared_and_routed_ffn(h, t, p, self.k, self.gating, self.n_group, self.n_group_used,
                                                self.norm, self.scale, relative=self.gating == 1,
                                                routed=not self.zero_experts)
            self.margin = min(self.margin, margin)
            x = x + out
        return rms(x, t["output_norm.weight"], self.eps) @ t["output.weight"].T


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, make_deepseek2_gguf(tmp_path_factory.mktemp("deepseek2") / f"{name}.gguf", **VARIANTS[name])


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, DEEPSEEK_VOCAB, n)]


# ---------------------------------------------------------------------------------------------- parity


def test_metadata_and_layout(variant: tuple[str, Path]) -> None:
    name, path = variant
    hp = open_model(path).hparams
    assert (hp.arch, hp.n_layer, hp.n_dense_lead, hp.n_head, hp.n_head_kv) == ("deepseek2", 3, 1, 4, 1)
    assert (hp.head_dim, hp.head_dim_v, hp.rope_dim, hp.rope_type, hp.kv_lora_rank) == (48, 32, 16, 0, 64)
    assert hp.n_head * hp.head_dim != hp.n_embd
    assert (hp.q_lora_rank, hp.mla_split) == ((0, False) if name == "v2" else (96, True))
    want = {"v2": (1, False, 1.0, 8, 3, 2, False)}.get(name, (2, True, 2.5, 4, 2, 1, True))
    assert (hp.gating, hp.expert_norm, hp.expert_weights_scale, hp.n_expert_group, hp.n_group_used,
            hp.n_expert_shared, hp.exp_probs_b) == want
    assert hp.n_ff_shexp == hp.n_ff_exp * hp.n_expert_shared
    # the cache: one latent row per token and layer (K: latent + rotary key, V: latent), F16
    assert hp.kv_bytes_per_token == 2 * 3 * (2 * 64 + 16)


def test_logits_match_llama_cpp_and_numpy(variant: tuple[str, Path], llama: Any) -> None:
    name, path = variant
    prompt = _prompt(1234, PROMPT_LEN)
    ref_model = RefModel(path)
    ref = ref_model.logits(prompt)
    # The oracle must be decisive: a near-tie in any routing decision would let float noise change an
    # expert choice, and a failure would then say nothing about the engine.
    assert ref_model.margin > 1e-3, ref_model.margin
    theirs = llama_logits(llama, prompt)
    with Engine.open(path, threads=2, kv_tokens=256) as eng:
        ours = np.asarray(eng.logits_for(prompt), dtype=np.float32)
    assert ours.shape == (PROMPT_LEN, DEEPSEEK_VOCAB)
    assert rel_err(ours, theirs) <= TOL, f"engine vs llama.cpp: {rel_err(ours, theirs):.2e}"
    if name in ("v3", "v2"):  # quantised experts: both engines quantise the activations, NumPy does not
        # the decompressed per-head pass is llama.cpp's graph (to float32 rounding) ...
        assert rel_err(theirs, ref) <= 1e-5, f"llama.cpp vs NumPy: {rel_err(theirs, ref):.2e}"
        assert rel_err(ours, ref) <= TOL, f"engine vs NumPy: {rel_err(ours, ref):.2e}"
        # ... and with the engine's F16 latent row, the engine's absorbed attention is that pass
        ref_model.f16_kv = True
        assert rel_err(ours, ref_model.logits(prompt)) <= 1e-4
    else:  # the quantised experts move the logits far beyond the tolerance: a wrong kernel cannot hide
        ref_model.zero_experts = True
        assert rel_err(ref_model.logits(prompt), theirs) > 10 * TOL


def test_greedy_matches_llama_cpp(variant: tuple[str, Path], llama: Any) -> None:
    check_greedy_matches_llama(variant[1], llama, _prompt(99, 16), N_GREEDY)


def test_batched_sequences_equal_alone(variant: tuple[str, Path]) -> None:
    """The latent cache, the per-head absorption and expansion and the routing give every sequence in a
    mixed step the logits it gets alone, bit for bit."""
    name, path = variant
    if name not in ("v3", "v2"):
        pytest.skip("the two attention forms are enough")
    check_batched_equals_alone(path, DEEPSEEK_VOCAB)


def test_split_and_unsplit_files_give_the_same_logits(tmp_path: Path) -> None:
    """The same weights as attn_k_b / attn_v_b (with the MLA keys) and as one attn_kv_b: the engine
    absorbs through wk_b or through wkv_b's key rows transposed at load, and gives the same bits."""
    kw = dict(q_lora_rank=0, seed=7)
    split = make_deepseek2_gguf(tmp_path / "split.gguf", split=True, **kw)
    whole = make_deepseek2_gguf(tmp_path / "whole.gguf", split=False, **kw)
    prompt = _prompt(3, 24)
    out = []
    for path in (split, whole):
        with Engine.open(path, threads=2, kv_tokens=64) as eng:
            out.append(np.asarray(eng.logits_for(prompt), dtype=np.float32))
    assert np.array_equal(out[0], out[1])


def test_inspect_shows_the_mla_fields(variant: tuple[str, Path]) -> None:
    from engine.inspect_model import analyse, render

    name, path = variant
    mf = open_model(path)
    out = render(mf, None, None, None)
    assert "architecture    deepseek2: 3 layers, d_model 256, heads 4/1 (head_dim 48)" in out
    q = "q full rank" if name == "v2" else "q rank 96"
    form = "attn_kv_b" if name == "v2" else "attn_k_b / attn_v_b"
    assert (f"attention       latent (MLA): KV rank 64, {q}, value dims 32 per head, one cached row of 64 + 16 "
            f"per token ({form}), NORM rotary on 16 of 48 dims (the last), base 10000") in out
    routing = {"v2": "softmax, top-4 of 16, groups: best 3 of 8"}.get(
        name, "sigmoid + score bias, top-4 of 16, groups: best 2 of 4, weights renormalised x 2.5")
    assert f"routing         {routing}\n" in out
    assert analyse(mf).kv_bytes_per_token == 2 * 3 * (64 + 16 + 64)


# ---------------------------------------------------------------------------------------------- bad input

REQUIRED = ["expert_count", "expert_used_count", "expert_shared_count", "expert_feed_forward_length",
            "attention.layer_norm_rms_epsilon", "attention.kv_lora_rank", "block_count", "embedding_length",
            "attention.head_count"]


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_required_metadata_is_a_typed_error(key: str, tmp_path: Path) -> None:
    path = make_deepseek2_gguf(tmp_path / "m.gguf", n_moe=1, drop_keys=(key,))
    with pytest.raises(GGUFError, match=f"missing metadata key 'deepseek2.{key}'") as ei:
        Engine.open(path, threads=1, kv_tokens=64)
    assert ei.value.path == str(path)


YARN = {"deepseek2.rope.scaling.type": "yarn", "deepseek2.rope.scaling.factor": 40.0,
        "deepseek2.rope.scaling.original_context_length": 64, "deepseek2.rope.scaling.yarn_log_multiplier": 0.1}


@pytest.mark.parametrize(("kw", "cls", "match"), [
    (dict(extra_md=YARN), UnsupportedModelError, "rope scaling 'yarn'"),
    (dict(extra_md={"deepseek2.nextn_predict_layers": 1}), UnsupportedModelError, "NextN"),
    (dict(extra_md={"deepseek2.attention.temperature_scale": 0.5}), UnsupportedModelError, "temperature"),
    (dict(drop_keys=("attention.value_length_mla",)), GGUFError, "both or neither"),
    (dict(extra_md={"deepseek2.rope.dimension_count": 48}), GGUFError, "no non-rotary key dimensions"),
    (dict(omit=("blk.0.attn_k_b.weight",)), GGUFError, "missing tensor 'blk.0.attn_k_b.weight'"),
    (dict(split=False, omit=("blk.0.attn_kv_b.weight",)), GGUFError, "missing tensor 'blk.0.attn_kv_b.weight'"),
    (dict(omit=("blk.1.attn_v_b.weight",)), GGUFError, "layer 1: tensor attn_v_b is missing"),
    (dict(omit=("blk.1.attn_q_a_norm.weight",)), GGUFError, "layer 1: tensor attn_q_a_norm is missing"),
    (dict(omit=("blk.0.attn_kv_a_norm.weight",)), GGUFError, "layer 0: tensor attn_kv_a_norm is missing"),
    (dict(omit=("blk.1.attn_kv_a_mqa.weight",)), GGUFError, "layer 1: tensor attn_kv_a_mqa is missing"),
    (dict(omit=("blk.1.ffn_up_shexp.weight",)), GGUFError, "ffn_up_shexp"),
    (dict(n_expert_shared=0), GGUFError, "route experts beside shared ones"),
    (dict(kv_lora_rank=40), UnsupportedModelError, "latent rank 40"),
])
def test_bad_deepseek2_files_are_typed_errors(kw: dict, cls: type, match: str, tmp_path: Path) -> None:
    path = make_deepseek2_gguf(tmp_path / "m.gguf", n_moe=1, **kw)
    with pytest.raises(cls, match=match):
        Engine.open(path, threads=1, kv_tokens=64)


def test_gpu_devices(variant: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """deepseek2 runs on the GPU engine (engine.engine.GPU_ARCHES; its parity with this engine is
    tests/engine/gpu/test_gpu_deepseek2.py): an explicit cuda:N passes the architecture check and goes to the
    device, whose absence (simulated here) is the typed DeviceUnavailableError, not the CPU-only refusal."""
    if variant[0] != "v3":
        pytest.skip("one file is enough")
    check_cuda_open_reaches_the_device(variant[1], monkeypatch)


def test_gpu_hybrid_placement_is_a_typed_error(variant: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU engine runs deepseek2 with every expert on the device only (engine.engine.GPU_WHOLE_ONLY): a budget
    whose plan leaves a routed expert on the CPU is refused with a typed error before any GPU is touched."""
    if variant[0] != "v3":
        pytest.skip("one file is enough")
    # one expert of the first MoE layer left on the CPU
    check_hybrid_placement_refused(variant[1], monkeypatch, open_model(variant[1]).hparams.n_dense_lead)
