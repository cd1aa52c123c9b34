"""The logits oracle: the engine on converted GGUFs vs Hugging Face transformers (CPU torch, F32).

For each MoE arch a small random HF model is converted to an F32 GGUF; on a 32-token random
prompt the engine's logits at every position must match ``model(input_ids).logits`` to
max|delta| / max|ref| <= 1e-3, and 16 greedy steps must pick HF's argmax each time, with the
logits behind every step within the same tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests.engine.parity import TOL, judge_greedy, rel_err

try:
    import hf_models as H  # tests/engine is on sys.path (rootdir-relative import mode)
except ImportError:  # pragma: no cover - package-style test layout
    from tests.engine import hf_models as H

ARCHES = ["mixtral", "qwen3moe", "qwen2moe"]
PROMPT_LEN = 32
N_GREEDY = 16


@pytest.fixture(scope="session")
def parity_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """arch -> (F32 GGUF, live HF model)."""
    root = tmp_path_factory.mktemp("hf_parity")
    out = {}
    for arch in ARCHES:
        hf_dir, model = H.MAKERS[arch](root / arch)
        out[arch] = (H.to_gguf(hf_dir, root / f"{arch}.f32.gguf", "f32"), model)
    return out


def _eos_id(path: Path) -> int | None:
    f = gguf.GGUFReader(path).get_field("tokenizer.ggml.eos_token_id")
    return None if f is None else int(f.contents())


@pytest.mark.parametrize("arch", ARCHES)
def test_engine_matches_hf(parity_models: dict, arch: str) -> None:
    from engine.engine import Engine

    path, model = parity_models[arch]
    vocab = model.config.vocab_size
    prompt = [int(t) for t in np.random.default_rng(1234).integers(0, vocab, PROMPT_LEN)]
    # The oracle must be decisive: a near-tie between the k-th and (k+1)-th expert would let
    # float noise change routing, and a failure would then say nothing about the engine.
    assert H.router_margin(model, prompt) > 1e-4
    ref = H.hf_logits(model, prompt)

    eng = Engine.open(str(path), threads=2, kv_tokens=256)
    try:
        got = np.asarray(eng.logits_for(prompt), dtype=np.float32)
        assert got.shape == (PROMPT_LEN, vocab)
        assert rel_err(got, ref) <= TOL, f"prefill logits: rel err {rel_err(got, ref):.2e}"

        gen = [int(t) for t in eng.generate(prompt, max_tokens=N_GREEDY).token_ids]
        assert 0 < len(gen) <= N_GREEDY
        if len(gen) < N_GREEDY:  # only an end-of-sequence token may stop greedy decoding early
            assert gen[-1] == _eos_id(path), f"stopped after {len(gen)} tokens on {gen[-1]}"

        # Logits behind every greedy step: HF and engine on the engine's own continuation.
        seq = prompt + gen[:-1]
        ref_seq = H.hf_logits(model, seq)
        got_seq = np.asarray(eng.logits_for(seq), dtype=np.float32)
        assert got_seq.shape == ref_seq.shape
        err = rel_err(got_seq[PROMPT_LEN - 1:], ref_seq[PROMPT_LEN - 1:])
        assert err <= TOL, f"logits of the greedy steps: rel err {err:.2e}"
    finally:
        eng.close()

    # Each generated token is HF's argmax given the tokens before it. A different pick is only
    # acceptable where HF itself has a tie within tolerance; the sequences may diverge from there.
    if judge_greedy(gen, ref_seq, PROMPT_LEN - 1, TOL, "HF"):
        # No tie met: the whole continuation must equal HF's own greedy decoding.
        assert gen == H.hf_greedy(model, prompt, len(gen))
