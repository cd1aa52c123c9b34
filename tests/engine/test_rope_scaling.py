"""RoPE scaling (linear, YaRN) from GGUF metadata and from a lane's overrides, against llama.cpp
and transformers.

Small random llama and qwen3moe models state a trained context of 64 with factor 4
(rope.scaling.original_context_length 64); prompts of 200 tokens put most positions beyond the
original context, where scaling changes the rotation most. The oracle is llama.cpp (the pinned
llama-cpp-python) on the same file, which reads the same keys; its KV cache is F32 so that its own
rounding stays well inside the F32 parity tolerance (1e-3, as in test_hf_parity.py). Against
transformers: small random Llama / Qwen3-MoE models with rope_parameters linear or YaRN (factor 4,
YaRN's original context 64, max_position_embeddings 256), converted by engine.convert_hf.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.engine import Engine
from engine.gguf_model import GGUFError, UnsupportedModelError, build_desc, open_model
from engine.native import ffi, lib
from engine.rope import RopeOverrides
from lanes.config import LaneConfig
from tests.engine.arch_checks import check_greedy_matches_llama
from tests.engine.gguf_factory import make_random_gguf
from tests.engine.parity import llama_logits, open_llama, rel_err

TOL = 1e-3  # max|delta| / max|ref|
ORIG = 64
FACTOR = 4.0
PROMPT_LEN = 200
N_GREEDY = 32
VARIANTS = [("llama", "linear"), ("llama", "yarn"), ("qwen3moe", "yarn")]


def _scaling(arch: str, kind: str, factor: float = FACTOR) -> dict[str, object]:
    return {f"{arch}.rope.scaling.type": kind, f"{arch}.rope.scaling.factor": factor,
            f"{arch}.rope.scaling.original_context_length": ORIG}


def _model(path: Path, arch: str, metadata: dict[str, object]) -> Path:
    extra = {"qk_norm": True} if arch == "qwen3moe" else {}
    return make_random_gguf(path, arch=arch, vocab=True, seed=3, n_ctx=ORIG, metadata=metadata, **extra)


def _prompt(n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 128, n)]


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{a}-{k}" for a, k in VARIANTS])
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    arch, kind = request.param
    path = _model(tmp_path_factory.mktemp("rope") / f"{arch}-{kind}.gguf", arch, _scaling(arch, kind))
    return arch, kind, path


def test_logits_match_llama_cpp_beyond_the_original_context(variant: tuple[str, str, Path], llama: Any) -> None:
    _, kind, path = variant
    prompt = _prompt()
    with Engine.open(path, threads=2, kv_tokens=512) as eng:
        assert eng.rope.type == kind and eng.rope.freq_scale == 1 / FACTOR
        assert eng.rope.ext_factor == (1.0 if kind == "yarn" else 0.0)
        ours = np.asarray(eng.logits_for(prompt), dtype=np.float32)
    with Engine.open(path, threads=2, kv_tokens=512, rope=RopeOverrides(rope_scaling_type="none")) as eng:
        plain = np.asarray(eng.logits_for(prompt), dtype=np.float32)
    theirs = llama_logits(llama, prompt)
    assert rel_err(ours, theirs) <= TOL, f"engine vs llama.cpp: {rel_err(ours, theirs):.2e}"
    beyond = rel_err(ours[ORIG:], theirs[ORIG:])
    assert beyond <= TOL, f"beyond the original context: {beyond:.2e}"
    # the comparison sees the scaling: without it the same positions are far off
    assert rel_err(plain[ORIG:], theirs[ORIG:]) > 20 * TOL


def test_greedy_matchesopen_llama(variant: tuple[str, str, Path], llama: Any) -> None:
    check_greedy_matches_llama(variant[2], llama, _prompt(PROMPT_LEN - N_GREEDY, seed=2), N_GREEDY, kv_tokens=512)


@pytest.mark.parametrize(("lane", "llama_kw"), [
    ({"rope_scaling_type": "linear", "rope_scaling_factor": 2.0}, {"rope_scaling_type": 1, "rope_freq_scale": 0.5}),
    ({"rope_scaling_factor": 8.0, "yarn_beta_fast": 16.0, "yarn_orig_ctx": 32},
     {"rope_freq_scale": 0.125, "yarn_beta_fast": 16.0, "yarn_orig_ctx": 32}),
    ({"yarn_ext_factor": 0.5, "yarn_beta_slow": 2.0}, {"yarn_ext_factor": 0.5, "yarn_beta_slow": 2.0}),
], ids=["linear-x2", "yarn-x8-beta-orig", "yarn-ext-beta-slow"])
def test_lane_override_matches_llama_cpp_parameter(tmp_path: Path, lane: dict[str, Any],
                                                   llama_kw: dict[str, Any]) -> None:
    """A lane's overrides change the logits as llama.cpp's context parameters of the same meaning do."""
    path = _model(tmp_path / "yarn.gguf", "llama", _scaling("llama", "yarn"))
    overrides = LaneConfig(**lane).rope_overrides()
    assert overrides is not None
    prompt = _prompt(160, seed=4)
    with Engine.open(path, threads=2, kv_tokens=512, rope=overrides) as eng:
        ours = np.asarray(eng.logits_for(prompt), dtype=np.float32)
    with Engine.open(path, threads=2, kv_tokens=512) as eng:
        file_only = np.asarray(eng.logits_for(prompt), dtype=np.float32)
    llm = open_llama(path, **llama_kw)
    try:
        theirs = llama_logits(llm, prompt)
    finally:
        llm.close()
    assert rel_err(ours, theirs) <= TOL, f"override vs llama.cpp: {rel_err(ours, theirs):.2e}"
    assert rel_err(file_only[ORIG:], theirs[ORIG:]) > 10 * TOL  # the override did change the model


def test_unknown_or_malformed_scaling_is_a_typed_error(tmp_path: Path) -> None:
    for kind in ("longrope", "dynamic"):
        path = _model(tmp_path / f"{kind}.gguf", "llama", _scaling("llama", kind))
        with pytest.raises(UnsupportedModelError, match="rope scaling type"):
            open_model(path)
    path = _model(tmp_path / "neg.gguf", "llama", {"llama.rope.scaling.factor": -2.0})
    with pytest.raises(GGUFError, match="rope.scaling.factor"):
        open_model(path)
    path = _model(tmp_path / "num.gguf", "llama", {"llama.rope.scaling.type": 7})
    with pytest.raises(GGUFError, match="rope.scaling.type"):
        open_model(path)


def test_c_descriptor_checks_the_rope_fields(tmp_path: Path) -> None:
    mf = open_model(_model(tmp_path / "m.gguf", "llama", _scaling("llama", "yarn")))
    for field, value in (("rope_freq_scale", -1.0), ("rope_ext_factor", float("nan")), ("rope_n_ctx_orig", 0)):
        desc, keep = build_desc(mf)
        setattr(desc, field, value)
        pm = ffi.new("st_model **")
        assert lib.st_model_create(desc, pm) == lib.ST_EINVAL, field
        msg = ffi.string(lib.st_last_error()).decode().lower()
        assert "rope" in msg or "yarn" in msg, msg
        del keep


def test_window_follows_the_scaled_context_within_the_configured_one(tmp_path: Path) -> None:
    path = _model(tmp_path / "lin.gguf", "llama", _scaling("llama", "linear"))
    with Engine.open(path, threads=1, kv_tokens=1024) as eng:
        assert eng.n_ctx == int(ORIG * FACTOR)  # the scaled window, the KV cache allows more
    with Engine.open(path, threads=1, kv_tokens=128) as eng:
        assert eng.n_ctx == 128  # the KV capacity bounds it
    with Engine.open(path, threads=1, kv_tokens=1024, max_model_len=100) as eng:
        assert eng.n_ctx == 100  # the configured window bounds it
    with Engine.open(path, threads=1, kv_tokens=1024, rope=RopeOverrides(rope_scaling_factor=8.0)) as eng:
        assert eng.n_ctx == 512
    with Engine.open(path, threads=1, kv_tokens=1024, rope=RopeOverrides(rope_scaling_type="none")) as eng:
        assert eng.n_ctx == ORIG
    # a file stating the stretched context already keeps it
    path = make_random_gguf(tmp_path / "big.gguf", vocab=True, n_ctx=512, metadata=_scaling("llama", "yarn"))
    with Engine.open(path, threads=1, kv_tokens=4096) as eng:
        assert eng.n_ctx == 512


def test_inspect_shows_the_scaling_and_sizes_kv_at_the_scaled_window(tmp_path: Path) -> None:
    from engine.inspect_model import render

    text = render(open_model(_model(tmp_path / "y.gguf", "qwen3moe", _scaling("qwen3moe", "yarn"))), None, None, None)
    assert "rope scaling    yarn x4 of 64 (ext 1, beta 32/1, mscale 1.139), window 256" in text
    assert "at context 256" in text
    plain = render(open_model(make_random_gguf(tmp_path / "p.gguf", n_ctx=64)), None, None, None)
    assert "rope scaling    none" in plain and "at context 64" in plain


@pytest.mark.parametrize("kind", ["linear", "yarn"])
@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_engine_matches_transformers(tmp_path: Path, arch: str, kind: str) -> None:
    from tests.engine.hf_models import MAKERS, hf_logits, router_margin, to_gguf

    rope: dict[str, Any] = {"rope_type": kind, "factor": FACTOR}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = ORIG
    # qwen3moe: a seed whose router keeps its top-8 of 32 apart by more than float rounding over all
    # 200 positions (a near-tie flips one expert and moves that position's logits by ~1e-2)
    hf_dir, model = MAKERS[arch](tmp_path / f"{arch}-{kind}", rope=rope, **({"seed": 4} if arch == "qwen3moe" else {}))
    path = to_gguf(hf_dir)
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 280, PROMPT_LEN)]
    if arch == "qwen3moe":
        assert router_margin(model, prompt) > 3e-4  # the flips met here were at margins <= 2.5e-4
    ref = hf_logits(model, prompt)
    with Engine.open(path, threads=2, kv_tokens=512) as eng:
        assert (eng.rope.type, eng.rope.factor) == (kind, FACTOR)
        ours = np.asarray(eng.logits_for(prompt), dtype=np.float32)
    with Engine.open(path, threads=2, kv_tokens=512, rope=RopeOverrides(rope_scaling_type="none")) as eng:
        plain = np.asarray(eng.logits_for(prompt), dtype=np.float32)
    assert rel_err(ours, ref) <= TOL, f"engine vs transformers: {rel_err(ours, ref):.2e}"
    assert rel_err(ours[ORIG:], ref[ORIG:]) <= TOL
    assert rel_err(plain[ORIG:], ref[ORIG:]) > 20 * TOL


def test_converter_reads_linear_and_yarn_and_refuses_what_it_cannot_carry() -> None:
    from engine.convert_hf import ConversionError, _rope_scaling, _rope_theta

    assert _rope_scaling({"rope_theta": 1e4}) == {}
    assert _rope_scaling({"rope_scaling": {"type": "linear", "factor": 2}}) == {"type": "linear", "factor": 2.0}
    yarn = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                "original_max_position_embeddings": 32768}}
    assert _rope_scaling(yarn) == {"type": "yarn", "factor": 4.0, "original_context_length": 32768}
    assert _rope_theta(yarn) == 1e6
    for bad in ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 16}, {"rope_type": "linear", "factor": 0},
                {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8}):
        with pytest.raises(ConversionError):
            _rope_scaling({"rope_parameters": {"rope_theta": 1e4, **bad}})
    with pytest.raises(ConversionError, match="dynamic"):
        _rope_theta({"rope_scaling": {"type": "dynamic", "factor": 2.0}})
