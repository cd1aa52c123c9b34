"""Models whose routed experts are in the IQ quant types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S):
the engine against llama.cpp (the pinned llama-cpp-python) on the same file.

gguf-py cannot quantise to the IQ types, so the experts are random valid blocks (random grid
indices, signs and sub-scales; legal files). Everything else is F32. Both engines quantise the
activations of these matmuls to 8 bits per 256 values (Strata's IQ kernels read the per-256 view,
as llama.cpp's take Q8_K: 3e-4 apart on these files, 6e-4 when Strata read per 32), so the
experts are kept small enough that this noise stays inside the F32 parity tolerance (1e-3,
max|delta| / max|ref|, as in test_hf_parity.py), and the test checks that the experts still move
the logits by far more than that tolerance, so a wrong kernel cannot hide inside it. Greedy
decoding is judged as in test_hf_parity.py: every token is llama.cpp's argmax up to the first
near-tie.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from engine.engine import Engine
from engine.gguf_model import GGUFError, build_desc, open_model
from engine.native import ffi, lib
from tests.engine.parity import TOL, judge_greedy, llama_file_logits, rel_err

try:
    from gguf_factory import make_random_gguf, random_quant_blob  # tests/engine on sys.path
except ImportError:  # pragma: no cover - package-style test layout
    from tests.engine.gguf_factory import make_random_gguf, random_quant_blob

IQ_TYPES = ["IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_S"]
EXPERT_STD = 0.02
PROMPT_LEN = 32
N_GREEDY = 64
SHAPE = {"n_embd": 256, "n_ff": 256, "n_head": 4, "n_head_kv": 2, "n_expert": 4, "n_expert_used": 2, "n_vocab": 128}


def _model(path: Path, experts: dict[str, tuple[np.ndarray, tuple[int, ...], GGMLQuantizationType]] | None = None,
           zero_experts: bool = False) -> Path:
    over = None
    if zero_experts:
        over = {f"blk.{i}.ffn_{m}_exps.weight": np.zeros((SHAPE["n_expert"], SHAPE["n_ff"], SHAPE["n_embd"])
                                                            if m != "down" else
                                                            (SHAPE["n_expert"], SHAPE["n_embd"], SHAPE["n_ff"]),
                                                            np.float32)
                for i in range(2) for m in ("gate", "up", "down")}
    return make_random_gguf(path, arch="qwen3moe", qk_norm=True, n_layer=2, vocab=True, seed=3,
                            raw_overrides=experts, overrides=over, **SHAPE)


def _iq_experts(name: str, seed: int) -> dict[str, tuple[np.ndarray, tuple[int, ...], GGMLQuantizationType]]:
    qt = GGMLQuantizationType[name]
    rng = np.random.default_rng(seed)
    x, e, f = SHAPE["n_expert"], SHAPE["n_embd"], SHAPE["n_ff"]
    out = {}
    for i in range(2):
        for m, shape in (("gate", (x, f, e)), ("up", (x, f, e)), ("down", (x, e, f))):
            blob = random_quant_blob(qt, shape, EXPERT_STD, rng)
            out[f"blk.{i}.ffn_{m}_exps.weight"] = (blob, blob.shape, qt)
    return out


@pytest.fixture(scope="module")
def no_expert_logits(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The same model with its experts zeroed: how far the experts move the logits."""
    path = _model(tmp_path_factory.mktemp("iq_zero") / "zero.gguf", zero_experts=True)
    with Engine.open(str(path), threads=2, kv_tokens=256) as eng:
        return np.asarray(eng.logits_for(_prompt()), dtype=np.float32)


def _prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(1234).integers(3, SHAPE["n_vocab"], PROMPT_LEN)]


@pytest.mark.parametrize("name", IQ_TYPES)
def test_iq_experts_match_llama_cpp(name: str, tmp_path: Path, no_expert_logits: np.ndarray) -> None:
    path = _model(tmp_path / f"{name}.gguf", _iq_experts(name, seed=IQ_TYPES.index(name)))
    prompt = _prompt()
    with Engine.open(str(path), threads=2, kv_tokens=256) as eng:
        got = np.asarray(eng.logits_for(prompt), dtype=np.float32)
        gen = [int(t) for t in eng.generate(prompt, max_tokens=N_GREEDY).token_ids]
        seq = prompt + gen[:-1]
        got_seq = np.asarray(eng.logits_for(seq), dtype=np.float32)
    ref = llama_file_logits(path, prompt)  # F32 KV cache: the comparison is about weights and activations
    assert rel_err(got, ref) <= TOL, f"prefill logits: rel err {rel_err(got, ref):.2e}"
    # the experts matter far beyond the tolerance: a wrong expert kernel cannot pass
    assert rel_err(no_expert_logits, got) >= 10 * TOL

    assert len(gen) == N_GREEDY  # the placeholder vocabulary has no end-of-sequence token in reach
    ref_seq = llama_file_logits(path, seq)
    err = rel_err(got_seq[PROMPT_LEN - 1:], ref_seq[PROMPT_LEN - 1:])
    assert err <= TOL, f"logits of the greedy steps: rel err {err:.2e}"
    judge_greedy(gen, ref_seq, PROMPT_LEN - 1, TOL)


def test_iq_tensor_of_the_wrong_byte_size_is_a_typed_error(tmp_path: Path) -> None:
    """An IQ tensor whose byte length does not match its type and shape is refused with the C
    engine's typed error, as for every other type; so is a file cut inside an IQ tensor."""
    path = _model(tmp_path / "iq3.gguf", _iq_experts("IQ3_XXS", seed=9))
    mf = open_model(path)
    desc, keep = build_desc(mf)
    t = desc.layers[1].down_exps
    assert t.type == lib.ST_TYPE_IQ3_XXS
    t.n_bytes -= 98  # one block short
    pm = ffi.new("st_model **")
    rc = lib.st_model_create(desc, pm)
    assert rc == lib.ST_EINVAL, rc
    msg = ffi.string(lib.st_last_error()).decode()
    assert "layer 1: tensor ffn_down_exps holds" in msg and "need" in msg
    del keep, mf

    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])  # the last tensor (an IQ3_XXS expert) now runs past the end
    with pytest.raises(GGUFError, match="truncated or corrupt GGUF"):
        Engine.open(str(cut), threads=1, kv_tokens=64)
