"""What the parity tests of the architectures and quant types share: the relative error logits are
judged by, llama.cpp (the pinned llama-cpp-python) as the oracle, greedy decoding judged up to the
first near-tie, and the NumPy pieces of the float64 reference passes (a GGUF's tensors and metadata,
RMSNorm, SwiGLU, llama.cpp's router, the MoE FFN with a shared expert).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

TOL = 1e-3  # max|delta| / max|ref|: the F32 parity tolerance of the architecture tests


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """max|got - ref| / max|ref|."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def open_llama(path: Path, n_ctx: int = 256, *, f32_kv: bool = True, **kw: Any) -> Any:
    """llama.cpp on a GGUF, every row's logits kept, 2 threads. An F32 KV cache by default: llama.cpp's
    own rounding then stays well inside the tolerance (its F16 cache alone costs up to ~9e-4 against a
    float64 reference); f32_kv=False keeps its default F16 cache. ``kw``: more llama_cpp.Llama arguments
    (e.g. rope overrides)."""
    import llama_cpp

    kv = {"type_k": 0, "type_v": 0} if f32_kv else {}
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
                           n_threads=2, **kv, **kw)


def llama_logits(llm: Any, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position of `ids` from a fresh context (a copy: the next eval
    reuses its buffer)."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def llama_file_logits(path: Path, ids: list[int], n_ctx: int = 128, *, f32_kv: bool = True) -> np.ndarray:
    """llama_logits on a model opened for this call alone."""
    llm = open_llama(path, n_ctx, f32_kv=f32_kv)
    try:
        return llama_logits(llm, ids)
    finally:
        llm.close()


def llama_greedy(llm: Any, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's own greedy decoding: its KV cache, one token at a time."""
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return out


def judge_greedy(gen: list[int], ref_seq: np.ndarray, start: int, tol: float, what: str = "llama.cpp") -> bool:
    """Greedy picks against reference logits: ref_seq[start + i] are the logits behind gen[i] (the
    reference run on the engine's own continuation). Each pick must be the reference's argmax; where
    it is not, the reference itself must be within 2 * tol * max|ref_seq| of a tie there, and judging
    stops (the sequences may part from there). True when every pick is the argmax (no tie met), False
    when judging stopped at a near-tie; an AssertionError for a pick that no near-tie explains."""
    tie_ok = 2 * tol * float(np.abs(ref_seq).max())
    for step, tok in enumerate(gen):
        row = ref_seq[start + step]
        best = int(row.argmax())
        if tok != best:
            gap = float(row[best] - row[tok])
            assert gap <= tie_ok, f"greedy step {step}: engine chose {tok}, {what} {best} (gap {gap:.3e})"
            return False
    return True


# ---------------------------------------------------------------------------------------------- NumPy pieces


def read_gguf_f64(path: Path, arch: str) -> tuple[dict[str, np.ndarray], Callable[..., Any]]:
    """What a NumPy reference model reads from a GGUF: every tensor dequantised to float64 in its logical shape
    (NumPy order, [rows, cols]), and kv(key, default=None), the value of metadata key ``arch.key`` (``default``
    where the file lacks it)."""
    r = gguf.GGUFReader(path)

    def kv(key: str, default: Any = None) -> Any:
        f = r.get_field(f"{arch}.{key}")
        return default if f is None else f.contents()

    t = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
         .reshape(tuple(reversed([int(d) for d in t.shape]))) for t in r.tensors}
    return t, kv


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, times the gain w."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def swiglu(x: np.ndarray, g: np.ndarray, u: np.ndarray, d: np.ndarray) -> np.ndarray:
    """The SwiGLU FFN of rows x: down(silu(gate x) * up x)."""
    h = x @ g.T
    return (h / (1.0 + np.exp(-h)) * (x @ u.T)) @ d.T


def route_ref(logits: np.ndarray, bias: np.ndarray | None, k: int, gating: int, n_group: int, n_group_used: int,
              norm: bool, scale: float, *, relative: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """llama.cpp's build_moe_ffn routing of one token: (chosen ids, their weights, decision margin).
    gating 1 softmax, 2 sigmoid, 3 softmax over the chosen logits. The margin is the smallest gap that
    decided anything (the k-th vs the (k+1)-th eligible choice score, and the last kept vs the first
    dropped group score); `relative` divides each gap by the larger of the two scores (softmax
    probabilities: a small logit error moves them in proportion, whatever their size)."""

    def gap(a: float, b: float) -> float:
        return (a - b) / max(abs(a), abs(b)) if relative else a - b

    logits = logits.astype(np.float64)
    if gating == 1:
        p = np.exp(logits - logits.max())
        p /= p.sum()
    elif gating == 2:
        p = 1.0 / (1.0 + np.exp(-logits))
    else:
        p = logits.copy()
    c = p + bias if bias is not None else p.copy()
    margin = np.inf
    if n_group > 1:
        g = c.reshape(n_group, -1)
        top2 = np.sort(g, axis=1)[:, ::-1][:, : min(2, g.shape[1])].sum(axis=1)
        order = np.argsort(-top2, kind="stable")
        margin = min(margin, gap(top2[order[n_group_used - 1]], top2[order[n_group_used]]))
        dropped = np.ones(n_group, bool)
        dropped[order[:n_group_used]] = False
        c = np.where(np.repeat(dropped, g.shape[1]), -np.inf, c)
    order = np.argsort(-c, kind="stable")
    ids = order[:k]
    if np.isfinite(c[order[k]]):
        margin = min(margin, gap(c[order[k - 1]], c[order[k]]))
    w = p[ids]
    if gating == 3:
        w = np.exp(w - w.max())
        w /= w.sum()
    if norm:
        w = w / max(w.sum(), 6.103515625e-5)
    return ids, w * scale, float(margin)


def shared_and_routed_ffn(h: np.ndarray, t: dict[str, np.ndarray], p: str, k: int, gating: int, n_group: int,
                          n_group_used: int, norm: bool, scale: float, *, relative: bool = False,
                          routed: bool = True) -> tuple[np.ndarray, float]:
    """The FFN of a MoE layer with a shared expert (glm4moe, deepseek2) on rows h [T, n_embd]: the shared
    expert, plus per token the routed experts route_ref chooses (router ``p + ffn_gate_inp``, score-correction
    bias ``p + exp_probs_b`` where the file has one) times their weights, added in choice order; ``routed``
    False leaves them out (to show they matter). Returns (the FFN's output [T, n_embd], the smallest decision
    margin of the tokens' routing)."""
    out = swiglu(h, t[p + "ffn_gate_shexp.weight"], t[p + "ffn_up_shexp.weight"], t[p + "ffn_down_shexp.weight"])
    router = h @ t[p + "ffn_gate_inp.weight"].T
    margin = np.inf
    for i in range(len(h)):
        sel, w, m = route_ref(router[i], t.get(p + "exp_probs_b.bias"), k, gating, n_group, n_group_used, norm,
                              scale, relative=relative)
        margin = min(margin, m)
        if not routed:
            continue
        for e, we in zip(sel, w, strict=True):
            out[i] += we * swiglu(h[i], t[p + "ffn_gate_exps.weight"][e], t[p + "ffn_up_exps.weight"][e],
                                  t[p + "ffn_down_exps.weight"][e])
    return out, float(margin)


