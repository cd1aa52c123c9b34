"""glm4moe (GLM-4.5 / 4.6 / Air) on the CPU engine against llama.cpp and a NumPy forward pass.

Small random glm4moe GGUFs written by tests/engine/gguf_factory.make_glm4moe_gguf carry the real
layout: head_dim * heads != n_embd, partial rotary, q/k/v biases, a leading dense layer, MoE layers
with sigmoid routing, the score-correction bias exp_probs_b, the routed scaling factor and an
ungated shared expert, and a NextN layer at the end that the forward pass must skip. Each variant
is checked three ways on a 32-token prompt:

* logits against llama.cpp (llama-cpp-python, whose bundled llama.cpp implements glm4moe; F32 KV
  cache) within the tolerance of the HF parity tests (max|delta| / max|ref| <= 1e-3; the engine's
  F16 KV cache is most of the measured 2.5e-4 to 5.3e-4);
* logits against the NumPy float64 forward pass below (written from llama.cpp's graph for the
  architecture: src/models/glm4-moe.cpp and build_moe_ffn), which also measures the router's
  margins so that a failure cannot come from float noise flipping an expert choice;
* 64 greedy tokens: each is llama.cpp's argmax given the tokens before it, judged up to the first
  near-tie in llama.cpp's logits (as tests/engine/test_hf_parity.py does against HF).

st_route (the router alone) is checked against the NumPy router on random logits for every gating
function, with and without group-limited top-k (DeepSeek-V3's rule, which deepseek2 uses too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine
from engine.gguf_model import GGUFError, UnsupportedModelError, create_native_model, open_model
from engine.native import ffi, lib, ptr
from tests.engine.arch_checks import (
    check_batched_equals_alone,
    check_cuda_open_reaches_the_device,
    check_greedy_matches_llama,
)
from tests.engine.gguf_factory import GLM_VOCAB, make_glm4moe_gguf
from tests.engine.parity import (
    TOL,
    llama_logits,
    read_gguf_f64,
    rel_err,
    rms,
    route_ref,
    shared_and_routed_ffn,
    swiglu,
)

PROMPT_LEN = 32
N_GREEDY = 64

# name -> make_glm4moe_gguf arguments: GLM-4.5 (q/k norms, scale 2.5); GLM-4.5-Air-like without
# q/k norms and with group-limited top-k switched on (4 groups, best 2); softmax gating with
# 8 groups and the scale / norm keys absent (llama.cpp's defaults: no renormalisation, scale 1).
VARIANTS: dict[str, dict[str, Any]] = {
    "qk_norm": dict(qk_norm=True, seed=3),
    "groups": dict(qk_norm=False, n_group=4, n_group_used=2, weights_scale=1.0, seed=2),
    "softmax_defaults": dict(n_group=8, n_group_used=3, gating=1, weights_scale=None, weights_norm=None, seed=1),
}


# ---------------------------------------------------------------------------------------------- the NumPy model


class RefModel:
    """The glm4moe forward pass in float64, from the GGUF's own tensors and metadata."""

    def __init__(self, path: Path) -> None:
        self.t, kv = read_gguf_f64(path, "glm4moe")
        self.n_layer = kv("block_count") - kv("nextn_predict_layers", 0)
        self.n_head, self.n_head_kv = kv("attention.head_count"), kv("attention.head_count_kv")
        self.hd, self.rope_dim = kv("attention.key_length"), kv("rope.dimension_count")
        self.base, self.eps = kv("rope.freq_base"), kv("attention.layer_norm_rms_epsilon")
        self.k, self.dense = kv("expert_used_count"), kv("leading_dense_block_count", 0)
        self.gating = kv("expert_gating_func", 0) or 2
        self.norm, self.scale = bool(kv("expert_weights_norm", False)), kv("expert_weights_scale", 0.0) or 1.0
        self.n_group, self.n_group_used = kv("expert_group_count", 0), kv("expert_group_used_count", 0)
        self.margin = np.inf

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """NEOX rotation of the first rope_dim dimensions of every head: pairs (i, i + rope_dim / 2)."""
        half = self.rope_dim // 2
        theta = pos[:, None] * self.base ** (-np.arange(half) * 2.0 / self.rope_dim)  # [T, half]
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        a, b = x[..., :half].copy(), x[..., half : 2 * half].copy()
        out = x.copy()
        out[..., :half] = a * c - b * s
        out[..., half : 2 * half] = a * s + b * c
        return out

    def logits(self, ids: list[int]) -> np.ndarray:
        t, T = self.t, len(ids)
        x = t["token_embd.weight"][ids]
        pos = np.arange(T, dtype=np.float64)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for il in range(self.n_layer):
            p = f"blk.{il}."
            h = rms(x, t[p + "attn_norm.weight"], self.eps)
            q = (h @ t[p + "attn_q.weight"].T + t[p + "attn_q.bias"]).reshape(T, self.n_head, self.hd)
            k = (h @ t[p + "attn_k.weight"].T + t[p + "attn_k.bias"]).reshape(T, self.n_head_kv, self.hd)
            v = (h @ t[p + "attn_v.weight"].T + t[p + "attn_v.bias"]).reshape(T, self.n_head_kv, self.hd)
            if p + "attn_q_norm.weight" in t:
                q = rms(q, t[p + "attn_q_norm.weight"], self.eps)
                k = rms(k, t[p + "attn_k_norm.weight"], self.eps)
            q, k = self._rope(q, pos), self._rope(k, pos)
            rep = self.n_head // self.n_head_kv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(self.hd) + mask
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            x = x + np.einsum("hts,shd->thd", a, v).reshape(T, -1) @ t[p + "attn_output.weight"].T
            h = rms(x, t[p + "post_attention_norm.weight"], self.eps)
            if il < self.dense:
                x = x + swiglu(h, t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"], t[p + "ffn_down.weight"])
                continue
            out, margin = shared_and_routed_ffn(h, t, p, self.k, self.gating, self.n_group, self.n_group_used,
                                                self.norm, self.scale)
            self.margin = min(self.margin, margin)
            x = x + out
        return rms(x, t["output_norm.weight"], self.eps) @ t["output.weight"].T


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = request.param
    return name, make_glm4moe_gguf(tmp_path_factory.mktemp("glm4moe") / f"{name}.gguf", **VARIANTS[name])


# ---------------------------------------------------------------------------------------------- parity


def test_metadata_and_layout(variant: tuple[str, Path]) -> None:
    name, path = variant
    hp = open_model(path).hparams
    assert (hp.arch, hp.n_layer, hp.n_nextn, hp.n_dense_lead) == ("glm4moe", 3, 1, 1)
    assert (hp.head_dim, hp.rope_dim, hp.n_head * hp.head_dim != hp.n_embd) == (32, 16, True)
    assert (hp.n_expert, hp.n_expert_used, hp.n_expert_shared, hp.n_ff_shexp, hp.exp_probs_b) == (16, 4, 1, 32, True)
    want = {"qk_norm": (2, 2.5, True, 0, 0), "groups": (2, 1.0, True, 4, 2), "softmax_defaults": (1, 1.0, False, 8, 3)}
    assert (hp.gating, hp.expert_weights_scale, hp.expert_norm, hp.n_expert_group, hp.n_group_used) == want[name]


def test_logits_match_llama_cpp_and_numpy(variant: tuple[str, Path], llama: Any) -> None:
    _, path = variant
    prompt = [int(t) for t in np.random.default_rng(1234).integers(0, GLM_VOCAB, PROMPT_LEN)]
    ref_model = RefModel(path)
    ref = ref_model.logits(prompt)
    # The oracle must be decisive: a near-tie in any routing decision would let float noise
    # change an expert choice, and a failure would then say nothing about the engine.
    assert ref_model.margin > 1e-3, ref_model.margin
    theirs = llama_logits(llama, prompt)
    # the two oracles agree to float32 rounding (measured 2e-7 to 6e-7): the NumPy pass is llama.cpp's graph
    assert rel_err(theirs, ref) <= 1e-5, f"llama.cpp vs NumPy: {rel_err(theirs, ref):.2e}"
    with Engine.open(path, threads=2, kv_tokens=256) as eng:
        ours = np.asarray(eng.logits_for(prompt), dtype=np.float32)
    assert ours.shape == (PROMPT_LEN, GLM_VOCAB)
    assert rel_err(ours, theirs) <= TOL, f"engine vs llama.cpp: {rel_err(ours, theirs):.2e}"
    assert rel_err(ours, ref) <= TOL, f"engine vs NumPy: {rel_err(ours, ref):.2e}"


def test_greedy_matches_llama_cpp(variant: tuple[str, Path], llama: Any) -> None:
    prompt = [int(t) for t in np.random.default_rng(99).integers(0, GLM_VOCAB, 16)]
    check_greedy_matches_llama(variant[1], llama, prompt, N_GREEDY)


def test_batched_sequences_equal_alone(variant: tuple[str, Path]) -> None:
    """Dense lead, routed layers and the router's rule give every sequence in a mixed step the
    logits it gets alone, bit for bit (as tests/engine/test_batching.py checks for the others)."""
    check_batched_equals_alone(variant[1], GLM_VOCAB)


def test_nextn_layer_is_kept_not_run(variant: tuple[str, Path]) -> None:
    """The NextN layer is validated and held by the C model; the forward pass (and its KV cache)
    covers only the first block_count - nextn_predict_layers layers (the NumPy reference runs
    those alone and matches above)."""
    _, path = variant
    mf = open_model(path)
    assert mf.hparams.n_layer == 3 and "blk.3.nextn.eh_proj.weight" in mf.tensors
    model, _desc, _keep = create_native_model(mf)
    try:
        assert lib.st_model_nextn_layers(model) == 1
    finally:
        lib.st_model_destroy(model)
    with Engine.open(path, threads=1, kv_tokens=64) as eng:
        assert eng.hparams.n_layer == 3


def test_inspect_shows_the_glm_fields(variant: tuple[str, Path]) -> None:
    from engine.inspect_model import analyse, render

    name, path = variant
    mf = open_model(path)
    out = render(mf, None, None, None)
    assert "architecture    glm4moe: 3 layers" in out
    assert "q/k/v biases" in out and ("q/k norms" in out) == (name == "qk_norm")
    assert "NEOX rotary on 16 of 32 dims (partial)" in out
    assert "16 routed, top-4, FFN width 32, 1 shared (width 32); first layer dense (FFN width 96)" in out
    routing = {"qk_norm": "sigmoid + score bias, top-4 of 16, weights renormalised x 2.5",
               "groups": "sigmoid + score bias, top-4 of 16, groups: best 2 of 4, weights renormalised",
               "softmax_defaults": "softmax + score bias, top-4 of 16, groups: best 3 of 8"}[name]
    assert f"routing         {routing}\n" in out
    r = analyse(mf)
    nextn = sum(t.n_bytes for n, t in mf.tensors.items() if n.startswith("blk.3."))
    assert r.nextn_bytes == nextn > 0
    assert "NextN layers    1 after the 3 (multi-token prediction: kept for speculative decoding, not run)" in out
    # the NextN layer is in no per-token figure: the KV cache covers the 3 forward layers
    assert r.kv_bytes_per_token == 2 * 2 * 3 * 2 * 32
    assert r.file_bytes > r.dense_bytes + r.expert_bytes + nextn


# ---------------------------------------------------------------------------------------------- the router alone


@pytest.mark.parametrize("gating", [1, 2, 3])
@pytest.mark.parametrize(("n_expert", "k", "n_group", "n_group_used"),
                         [(16, 4, 0, 0), (64, 8, 8, 4), (32, 6, 4, 3), (12, 2, 6, 1), (8, 2, 4, 1)])
def test_route_matches_numpy(gating: int, n_expert: int, k: int, n_group: int, n_group_used: int) -> None:
    rng = np.random.default_rng(n_expert * 10 + gating)
    T = 200
    logits = (rng.standard_normal((T, n_expert)) * 2).astype(np.float32)
    bias = (rng.standard_normal(n_expert) * 0.3).astype(np.float32)
    for b, norm, scale in ((bias, True, 2.5), (None, False, 1.0), (bias, False, 0.0)):
        ids = np.zeros((T, k), np.int32)
        w = np.zeros((T, k), np.float32)
        rc = lib.st_route(n_expert, k, gating, n_group, n_group_used, int(norm), scale,
                          ptr(b, "float *") if b is not None else ffi.NULL, ptr(logits, "float *"), T,
                          ptr(ids, "int32_t *"), ptr(w, "float *"))
        assert rc == 0, ffi.string(lib.st_last_error())
        checked = 0
        for t in range(T):
            want_ids, want_w, margin = route_ref(logits[t], b, k, gating, n_group, n_group_used, norm, scale or 1.0)
            if margin < 1e-5:  # a float32 near-tie: either choice is right
                continue
            checked += 1
            assert ids[t].tolist() == want_ids.tolist(), (t, ids[t], want_ids)
            np.testing.assert_allclose(w[t], want_w, rtol=2e-6, atol=1e-7)
        assert checked > T * 0.9
        if n_group > 1:  # every choice lies in n_group_used groups
            per = n_expert // n_group
            assert all(len(set((ids[t] // per).tolist())) <= n_group_used for t in range(T))


def test_group_limit_changes_the_choice() -> None:
    """The best experts overall sit in two groups; with one group allowed, the top-k comes from
    the better group alone (its two best scores sum highest), not from the overall best."""
    logits = np.full((1, 8), -4.0, np.float32)
    logits[0, [0, 1]] = [3.0, -1.0]  # group 0: one strong, one weak (sum of top two: lower)
    logits[0, [4, 5]] = [2.0, 1.5]  # group 2: two good (higher sum)
    ids, w = np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float32)
    for n_group, want in ((0, [0, 4]), (4, [4, 5])):
        assert lib.st_route(8, 2, 2, n_group, 1, 1, 1.0, ffi.NULL, ptr(logits, "float *"), 1, ptr(ids, "int32_t *"),
                            ptr(w, "float *")) == 0
        assert ids[0].tolist() == want
    assert w.sum() == pytest.approx(1.0)


@pytest.mark.parametrize(("args", "match"), [
    ((16, 4, 7, 2, 2, 1, 1.0), "expert groups"),  # 7 groups do not divide 16 experts
    ((16, 4, 4, 4, 2, 1, 1.0), "expert groups"),  # all groups used
    ((16, 8, 4, 1, 2, 1, 1.0), "expert groups"),  # one group of 4 cannot hold top-8
    ((16, 4, 0, 0, 4, 1, 1.0), "gating"),
    ((16, 4, 0, 0, 2, 1, -1.0), "scale"),
])
def test_route_refuses_bad_arguments(args: tuple, match: str) -> None:
    n_expert, k, n_group, n_group_used, gating, norm, scale = args
    logits = np.zeros((1, n_expert), np.float32)
    ids, w = np.zeros((1, k), np.int32), np.zeros((1, k), np.float32)
    rc = lib.st_route(n_expert, k, gating, n_group, n_group_used, norm, scale, ffi.NULL, ptr(logits, "float *"), 1,
                      ptr(ids, "int32_t *"), ptr(w, "float *"))
    assert rc != 0 and match in ffi.string(lib.st_last_error()).decode()


# ---------------------------------------------------------------------------------------------- bad input

REQUIRED = ["expert_count", "expert_used_count", "expert_shared_count", "expert_feed_forward_length",
            "attention.layer_norm_rms_epsilon", "block_count", "embedding_length", "attention.head_count"]


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_required_metadata_is_a_typed_error(key: str, tmp_path: Path) -> None:
    path = make_glm4moe_gguf(tmp_path / "m.gguf", drop_keys=(key,), n_moe=1)
    with pytest.raises(GGUFError, match=f"missing metadata key 'glm4moe.{key}'") as ei:
        Engine.open(path, threads=1, kv_tokens=64)
    assert ei.value.path == str(path)


@pytest.mark.parametrize(("kw", "cls", "match"), [
    (dict(gating=4), UnsupportedModelError, "gating function 4"),
    (dict(n_group=3, n_group_used=1), GGUFError, "expert_group_count = 3"),
    (dict(n_group=4, n_group_used=4), GGUFError, "expert_group_count = 4"),
    (dict(omit=("blk.1.ffn_gate_shexp.weight",)), GGUFError, "expert_shared_count"),
    (dict(extra_keys={"expert_feed_forward_length": 64}), GGUFError,
     "expert_feed_forward_length' says 64"),
    (dict(omit=("blk.2.nextn.eh_proj.weight",)), GGUFError, "layer 2: tensor nextn.eh_proj is missing"),
    (dict(omit=("blk.1.post_attention_norm.weight",)), GGUFError, "blk.1.post_attention_norm.weight"),
    (dict(omit=("blk.0.ffn_gate.weight",)), GGUFError, "layer 0: tensor ffn_gate is missing"),
])
def test_bad_glm4moe_files_are_typed_errors(kw: dict, cls: type, match: str, tmp_path: Path) -> None:
    path = make_glm4moe_gguf(tmp_path / "m.gguf", n_moe=1, **kw)
    with pytest.raises(cls, match=match):
        Engine.open(path, threads=1, kv_tokens=64)


def test_nextn_count_must_leave_a_layer(tmp_path: Path) -> None:
    path = make_glm4moe_gguf(tmp_path / "m.gguf", n_dense_lead=0, n_moe=0, n_nextn=1)
    with pytest.raises(GGUFError, match="nextn_predict_layers' = 1 is out of range"):
        open_model(path)



def test_gpu_devices(variant: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """glm4moe runs on the GPU engine (engine.engine.GPU_ARCHES; its parity with this engine is
    tests/engine/gpu/test_gpu_glm4moe.py): an explicit cuda:N passes the architecture check and goes to the
    device, whose absence (simulated here) is the typed DeviceUnavailableError, not the CPU-only refusal."""
    check_cuda_open_reaches_the_device(variant[1], monkeypatch)
