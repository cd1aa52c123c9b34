"""Strata's CPU engine against llama.cpp, on the same GGUF, threads and token ids, in one run.

Figures (medians of R runs, each engine alternating first):

- decode tok/s at batch 1: a short prompt is prefilled (untimed), then D single-token steps are
  timed, each followed by an argmax over the logits. Both engines are fed the *same* D tokens:
  Strata's greedy continuation, computed once before timing (llama.cpp's own argmax is still
  taken every step and compared, giving a teacher-forced next-token agreement rate).
- prefill tok/s: a P-token prompt of random in-vocab ids (fixed seed) on a fresh sequence, in
  chunks of 512 on both sides (Strata ``prefill_chunk=512``; llama.cpp ``n_batch=n_ubatch=512``),
  including the last token's logits and their argmax.

Before timing, both engines generate 16 greedy tokens from the same prompt; a mismatch prints a
warning (with the logit margins at the first divergent step), not an error.

Strata's per-op profile comes from the StepStats of every timed C step (attention / experts /
dense FFN / output head), plus the share of wall time spent outside C (Python, cffi, argmax).

Then, in the same run: aggregate decode tok/s at 1, 4, 16 and 32 concurrent sequences (Strata
through its scheduler, llama.cpp one token of every sequence per ``llama_decode``), the weight
bytes streamed per second at batch 1 and the int8 multiply-accumulates per second at 16
sequences (from the GGUF's tensor sizes), beside the machine's measured read bandwidth (numpy,
all threads, 1 GiB) and the micro-kernel's rate with its weights in cache (the variant's peak).

Usage: ``python -m bench.engine_cpu [--model PATH | --synthetic | --arch A[,B...]] [--threads N[,M]] [--runs R]
[--quick] [--no-batching] [--json OUT.json] [--markdown] [--llama-flash-attn]``. ``--quick``: 1 run, 32
decode tokens, a 500-token prompt, 16 tokens per sequence when batching. ``--synthetic``: the
8-expert top-2 model ~10x the default (bench/synthetic_moe.py, built under var/bench/ on first
use).

``--arch glm4moe,gpt-oss,deepseek2`` (or ``all``): the synthetic GLM-4.5-Air, gpt-oss-120b and
DeepSeek-V3 of bench/synthetic_arch.py (real layer shapes and quant mixes, fewer layers; built under
var/bench/ on first use), each at 1 thread and at all the process's cores (``--threads`` takes a
list), batch-1 decode and a short prefill, no batching; a summary table of the decode ratios per
architecture and thread count ends the output. Defaults there: 32 decode steps, a 64-token prompt,
3 runs.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from bench.common import (
    affinity_cores,
    emit_report,
    fmt_num,
    machine_info,
    markdown_table,
    median,
    quiet_gc,
    ratio,
    text_table,
)

PROMPT_TEXT = "The history of the printing press begins in"
SEED = 1234
CHUNK = 512
AGREE_TOKENS = 16
OPS = ("attn", "experts", "dense", "output")
OP_LABELS = {"attn": "attention", "experts": "experts (MoE FFN)", "dense": "dense FFN",
             "output": "output (norm + lm head)", "other": "other in C (embed, ...)"}


@dataclass(frozen=True)
class Config:
    model: Path
    threads: int
    runs: int
    decode_tokens: int
    prefill_tokens: int
    quick: bool
    llama_flash_attn: bool
    batching: bool = True
    seed: int = SEED
    chunk: int = CHUNK

    @property
    def n_ctx(self) -> int:
        """KV capacity for both engines: the longest sequence, rounded up to 256."""
        need = max(self.prefill_tokens, 64 + self.decode_tokens + AGREE_TOKENS) + 1
        return -(-need // 256) * 256


class Side(Protocol):
    """One engine under test: fresh-sequence prefill and single-token decode, returning logits."""

    name: str

    def start(self, ids: Sequence[int]) -> np.ndarray: ...

    def step(self, tok: int) -> np.ndarray: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- Strata
class StrataSide:
    name = "strata"

    def __init__(self, path: Path, threads: int, n_ctx: int, chunk: int) -> None:
        from engine.engine import Engine, StepStats

        t0 = time.perf_counter()
        self.eng = Engine.open(path, threads=threads, kv_tokens=n_ctx, prefill_chunk=chunk)
        self.load_s = time.perf_counter() - t0
        # raw steps over blocks held for the whole run (the harness picks the tokens, not a scheduler)
        self.blocks = self.eng.blocks.allocate(self.eng.blocks.n_blocks) or []
        self.n_tokens = 0
        self.recording: list[StepStats] | None = None
        inner = self.eng.forward

        def forward(*args: Any, **kw: Any) -> np.ndarray:  # every C step, also those inside prefill()
            out = inner(*args, **kw)
            if self.recording is not None and self.eng.last_stats is not None:
                self.recording.append(self.eng.last_stats)
            return out

        self.eng.forward = forward  # type: ignore[method-assign]

    @property
    def n_vocab(self) -> int:
        return self.eng.hparams.n_vocab

    def start(self, ids: Sequence[int]) -> np.ndarray:
        out = self.eng.prefill(ids, self.blocks, 0)
        self.n_tokens = len(ids)
        return out

    def step(self, tok: int) -> np.ndarray:
        out = self.eng.prefill([tok], self.blocks, self.n_tokens)
        self.n_tokens += 1
        return out

    def encode(self, text: str) -> list[int]:
        return list(self.eng.tokenizer.encode(text, add_special=True, parse_special=True))

    def close(self) -> None:
        self.eng.blocks.release(self.blocks)
        self.eng.close()


# ---------------------------------------------------------------- llama.cpp
class LlamaSide:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int, chunk: int, flash_attn: bool) -> None:
        import llama_cpp

        self._get_logits_ith = llama_cpp.llama_get_logits_ith
        t0 = time.perf_counter()
        self.llm = llama_cpp.Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   n_batch=chunk, n_ubatch=chunk, verbose=False, logits_all=False,
                                   flash_attn=flash_attn)
        self.load_s = time.perf_counter() - t0
        self.n_vocab = int(self.llm.n_vocab())

    def _logits(self) -> np.ndarray:
        # Llama.eval() with logits_all=False no longer copies logits into llm.scores (0.3.x):
        # read the last token's row straight from the context (a view, valid until the next eval).
        p = self._get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(p, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))

    def start(self, ids: Sequence[int]) -> np.ndarray:
        self.llm.reset()  # n_tokens = 0; eval() then drops every cached position
        self.llm.eval(ids)
        return self._logits()

    def step(self, tok: int) -> np.ndarray:
        self.llm.eval([tok])
        return self._logits()

    def encode(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=True, special=True))

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if callable(close):
            close()


# ---------------------------------------------------------------- measurements
def greedy(side: Side, prompt: Sequence[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """n free-running greedy tokens and the logits each was chosen from."""
    logits = side.start(prompt)
    toks: list[int] = []
    rows: list[np.ndarray] = []
    for i in range(n):
        rows.append(np.array(logits, dtype=np.float32, copy=True))
        toks.append(int(np.argmax(logits)))
        if i + 1 < n:
            logits = side.step(toks[-1])
    return toks, rows


def time_decode(side: Side, prompt: Sequence[int], forced: Sequence[int]) -> tuple[float, int]:
    """Seconds for len(forced) single-token steps fed the forced tokens (argmax taken each step),
    and how many of the step argmaxes equal the next forced token."""
    side.start(prompt)
    agree = 0
    with quiet_gc():
        t0 = time.perf_counter()
        for i, tok in enumerate(forced):
            nxt = int(np.argmax(side.step(tok)))
            if i + 1 < len(forced) and nxt == forced[i + 1]:
                agree += 1
        dt = time.perf_counter() - t0
    return dt, agree


def time_prefill(side: Side, ids: Sequence[int]) -> float:
    with quiet_gc():
        t0 = time.perf_counter()
        int(np.argmax(side.start(ids)))
        return time.perf_counter() - t0


@dataclass
class Samples:
    decode_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    decode_agree: list[int] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)
    prefill_tok_s: list[float] = field(default_factory=list)


@dataclass
class Profile:
    """Strata's C step times summed over timed steps, with the wall time of the same regions."""

    n_steps: int = 0
    n_tokens: int = 0
    wall_s: float = 0.0
    t: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("total", *OPS), 0.0))

    def add(self, stats: Sequence[Any], wall_s: float) -> None:
        self.n_steps += len(stats)
        self.wall_s += wall_s
        for s in stats:
            self.n_tokens += s.n_tokens
            self.t["total"] += s.t_total
            for op in OPS:
                self.t[op] += getattr(s, f"t_{op}")

    def shares(self) -> dict[str, float]:
        """Share of C step time per op (and 'other'), plus 'outside_c': share of wall time not in C."""
        tot = self.t["total"]
        out = {op: self.t[op] / tot if tot else float("nan") for op in OPS}
        out["other"] = max(0.0, 1.0 - sum(out[op] for op in OPS)) if tot else float("nan")
        out["outside_c"] = max(0.0, 1.0 - tot / self.wall_s) if self.wall_s else float("nan")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"n_steps": self.n_steps, "n_tokens": self.n_tokens, "wall_s": self.wall_s,
                "c_seconds": dict(self.t), "shares": self.shares(),
                "c_ms_per_token": 1e3 * self.t["total"] / self.n_tokens if self.n_tokens else None}


def recorded(strata: StrataSide, fn: Callable[[], Any]) -> tuple[Any, list[Any]]:
    strata.recording = []
    try:
        out = fn()
        return out, strata.recording
    finally:
        strata.recording = None


def agreement(strata: StrataSide, llama: LlamaSide, prompt: Sequence[int]) -> dict[str, Any]:
    s_toks, s_rows = greedy(strata, prompt, AGREE_TOKENS)
    l_toks, l_rows = greedy(llama, prompt, AGREE_TOKENS)
    first = next((i for i, (a, b) in enumerate(zip(s_toks, l_toks, strict=True)) if a != b), None)
    out: dict[str, Any] = {"n": AGREE_TOKENS, "identical": first is None, "strata": s_toks,
                           "llama_cpp": l_toks, "first_divergence": first}
    if first is not None:
        a, b = s_toks[first], l_toks[first]
        out["strata_margin"] = float(s_rows[first][a] - s_rows[first][b])
        out["llama_cpp_margin"] = float(l_rows[first][b] - l_rows[first][a])
    return out


def model_label(strata: StrataSide, path: Path) -> tuple[str, dict[str, Any]]:
    hp = strata.eng.hparams
    size = path.stat().st_size
    moe = f"{hp.n_expert} experts top-{hp.n_expert_used}" if hp.n_expert else "dense"
    label = f"{path.name} ({hp.arch}, {hp.n_layer} layers, {moe}, {size / 2**30:.2f} GiB)"
    info = {"path": str(path), "file_bytes": size, **hp.model_dump()}
    return label, info


# ---------------------------------------------------------------- machine limits and traffic
def weight_traffic(path: Path) -> dict[str, float]:
    """Weight bytes read and multiply-accumulates per decoded token, from the GGUF tensor table:
    every 2-D+ weight once, routed experts at n_expert_used / n_expert of their size, the
    output head (or the tied embedding) once; norms, embedding lookups and attention scores
    are left out (small at these context lengths)."""
    import gguf

    r = gguf.GGUFReader(path)
    arch = r.get_field("general.architecture").contents()
    ne_f, nu_f = r.get_field(f"{arch}.expert_count"), r.get_field(f"{arch}.expert_used_count")
    frac = (int(nu_f.contents()) / int(ne_f.contents())) if ne_f is not None and nu_f is not None else 1.0
    names = {t.name for t in r.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    nbytes = macs = 0.0
    for t in r.tensors:
        if len(t.shape) < 2 or (t.name == "token_embd.weight" and head != t.name):
            continue
        f = frac if "_exps." in t.name else 1.0
        nbytes += f * int(t.n_bytes)
        macs += f * int(t.n_elements)
    return {"bytes_per_token": nbytes, "macs_per_token": macs}


def read_bandwidth_gb_s(threads: int, nbytes: int = 1 << 30, reps: int = 3) -> float:
    """Memory read bandwidth: `threads` threads summing disjoint parts of a 1 GiB array (numpy
    releases the GIL), best of `reps`."""
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(nbytes // 8, np.int64)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(ex.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    del parts, a
    return nbytes / best / 1e9


def kernel_peak_gmac_s(threads: int, seconds: float = 0.5) -> dict[str, Any]:
    """The int8 micro-kernel's rate with weights in cache (st_kernel_rate: 8 rows x 4096 Q4_1
    against 64 tokens, thread CPU time), `threads` threads at once (cffi releases the GIL);
    the sum is the variant's peak on this machine."""
    from concurrent.futures import ThreadPoolExecutor

    from engine.native import VARIANTS, check, ffi, lib

    variant = int(lib.st_get_variant())

    def worker(_: int) -> float:
        out = ffi.new("double *")
        check(lib.st_kernel_rate(3, variant, 4096, 64, seconds, out), "kernel_rate")  # 3 = Q4_1
        return float(out[0])

    with ThreadPoolExecutor(threads) as ex:
        rates = list(ex.map(worker, range(threads)))
    name = next((k for k, v in VARIANTS.items() if v == variant), str(variant))
    return {"variant": name, "gmac_s": float(sum(rates)), "threads": threads, "per_thread": rates}


def batching(path: Path, threads: int, n_tokens: int, counts: Sequence[int], log: Callable[[str], None]
             ) -> dict[int, dict[str, float]]:
    """Aggregate decode tok/s at each count of concurrent sequences: Strata through its scheduler
    (decode-only steps timed), llama.cpp with one token of every sequence per llama_decode."""
    from bench.engine_batching import decode_throughput, llama_decode_throughput
    from engine.engine import Engine

    kv = max(counts) * (32 + n_tokens + 32)
    out: dict[int, dict[str, float]] = {}
    eng = Engine.open(path, threads=threads, kv_tokens=kv, max_model_len=kv)
    try:
        for c in counts:
            r = decode_throughput(eng, c, n_tokens, 256)
            r["llama_tok_s"] = llama_decode_throughput(path, c, n_tokens, threads)
            out[c] = r
            log(f"batching: {c} sequences: {r['tok_s']:.1f} vs {r['llama_tok_s']:.1f} tok/s aggregate")
    finally:
        eng.close()
    return out


# ---------------------------------------------------------------- run
def run(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    rep = run_single(cfg, log)
    traffic = weight_traffic(cfg.model)
    rep["traffic"] = traffic
    rep["machine_limits"] = {"read_gb_s": read_bandwidth_gb_s(cfg.threads), "kernel": kernel_peak_gmac_s(cfg.threads)}
    dec = rep["medians"]["strata"]["decode_tok_s"]
    rep["derived"] = {"decode_gb_s": traffic["bytes_per_token"] * dec / 1e9}
    if cfg.batching:
        counts = (1, 4, 16, 32)
        b = batching(cfg.model, cfg.threads, 16 if cfg.quick else 64, counts, log)
        rep["batching"] = {str(c): v for c, v in b.items()}
        rep["derived"]["gmac_s_16"] = traffic["macs_per_token"] * b[16]["tok_s"] / 1e9
        rep["derived"]["llama_gmac_s_16"] = traffic["macs_per_token"] * b[16]["llama_tok_s"] / 1e9
    return rep


def run_single(cfg: Config, log: Callable[[str], None]) -> dict[str, Any]:
    import llama_cpp

    machine = machine_info()
    busy = machine["busy_cores_before"]
    if busy is not None and busy > 0.25:
        log(f"WARNING: other processes keep {busy:.1f} of {machine['nproc']} cores busy; "
            f"the figures will be noisy (both engines' thread pools suffer from shared cores)")
    log(f"loading {cfg.model} with {cfg.threads} threads (n_ctx {cfg.n_ctx}) ...")
    strata = StrataSide(cfg.model, cfg.threads, cfg.n_ctx, cfg.chunk)
    llama = LlamaSide(cfg.model, cfg.threads, cfg.n_ctx, cfg.chunk, cfg.llama_flash_attn)
    try:
        if strata.n_vocab != llama.n_vocab:
            raise SystemExit(f"vocabulary sizes differ: strata {strata.n_vocab}, llama.cpp {llama.n_vocab}")
        label, model_info = model_label(strata, cfg.model)
        rng = np.random.default_rng(cfg.seed)
        notes: list[str] = []
        try:
            prompt = strata.encode(PROMPT_TEXT)
            if prompt != llama.encode(PROMPT_TEXT):
                notes.append("the two tokenizers split the decode prompt differently; Strata's ids are used")
        except Exception as e:  # a GGUF without tokenizer metadata: random ids
            notes.append(f"no tokenizer ({type(e).__name__}); the decode prompt is 16 random ids")
            prompt = rng.integers(0, strata.n_vocab, size=16).tolist()
        prefill_ids = rng.integers(0, strata.n_vocab, size=cfg.prefill_tokens).tolist()

        # correctness gate (also the warm-up: pages in the weights on both sides)
        agree = agreement(strata, llama, prompt)
        if agree["identical"]:
            log(f"agreement: greedy {AGREE_TOKENS} tokens identical on both engines")
        else:
            log(f"WARNING: greedy tokens diverge at step {agree['first_divergence']} of {AGREE_TOKENS} "
                f"(strata {agree['strata'][agree['first_divergence']]}, margin "
                f"{agree['strata_margin']:.4f}; llama.cpp {agree['llama_cpp'][agree['first_divergence']]}, "
                f"margin {agree['llama_cpp_margin']:.4f}); timing continues")
        forced, _ = greedy(strata, prompt, cfg.decode_tokens)
        warm = prefill_ids[: min(len(prefill_ids), cfg.chunk)]
        for side in (strata, llama):
            time_prefill(side, warm)
            time_decode(side, prompt, forced[: min(8, len(forced))])

        samples = {s.name: Samples() for s in (strata, llama)}
        prof = {"decode": Profile(), "prefill": Profile()}
        for r in range(cfg.runs):
            order: list[StrataSide | LlamaSide] = [strata, llama] if r % 2 == 0 else [llama, strata]
            for side in order:
                if side is strata:
                    (dt, ag), stats = recorded(strata, lambda: time_decode(strata, prompt, forced))
                    n_pre = -(-len(prompt) // cfg.chunk)  # the untimed prompt prefill steps come first
                    prof["decode"].add(stats[n_pre:], dt)
                else:
                    dt, ag = time_decode(side, prompt, forced)
                s = samples[side.name]
                s.decode_s.append(dt)
                s.decode_tok_s.append(len(forced) / dt)
                s.decode_agree.append(ag)
            for side in order:
                if side is strata:
                    dt, stats = recorded(strata, lambda: time_prefill(strata, prefill_ids))
                    prof["prefill"].add(stats, dt)
                else:
                    dt = time_prefill(side, prefill_ids)
                s = samples[side.name]
                s.prefill_s.append(dt)
                s.prefill_tok_s.append(len(prefill_ids) / dt)
            log(f"run {r + 1}/{cfg.runs}: decode {samples['strata'].decode_tok_s[-1]:.1f} vs "
                f"{samples['llama.cpp'].decode_tok_s[-1]:.1f} tok/s, prefill "
                f"{samples['strata'].prefill_tok_s[-1]:.1f} vs {samples['llama.cpp'].prefill_tok_s[-1]:.1f} tok/s")

        medians = {name: {"decode_tok_s": median(s.decode_tok_s), "prefill_tok_s": median(s.prefill_tok_s)}
                   for name, s in samples.items()}
        ratios = {k: ratio(medians["strata"][k], medians["llama.cpp"][k]) for k in ("decode_tok_s", "prefill_tok_s")}
        return {
            "benchmark": "engine_cpu",
            "config": {**asdict(cfg), "model": str(cfg.model), "n_ctx": cfg.n_ctx, "prompt_text": PROMPT_TEXT,
                       "decode_prompt_tokens": len(prompt), "agree_tokens": AGREE_TOKENS},
            "machine": machine,
            "versions": {"llama_cpp_python": llama_cpp.__version__, "numpy": np.__version__},
            "model": {"label": label, **model_info},
            "load_s": {"strata": strata.load_s, "llama.cpp": llama.load_s},
            "agreement": agree,
            "notes": notes,
            "samples": {name: asdict(s) for name, s in samples.items()},
            "medians": medians,
            "ratios": ratios,
            "strata_profile": {k: p.as_dict() for k, p in prof.items()},
        }
    finally:
        strata.close()
        llama.close()


# ---------------------------------------------------------------- report
def metric_rows(rep: dict[str, Any]) -> list[tuple[str, str, float, float, float]]:
    """(key, label, strata, llama.cpp, ratio) per metric."""
    c, m, r = rep["config"], rep["medians"], rep["ratios"]
    runs = f"median of {c['runs']}" if c["runs"] > 1 else "1 run"
    return [
        ("decode_tok_s", f"decode tok/s, batch 1 ({c['decode_tokens']} steps, {runs})",
         m["strata"]["decode_tok_s"], m["llama.cpp"]["decode_tok_s"], r["decode_tok_s"]),
        ("prefill_tok_s", f"prefill tok/s ({c['prefill_tokens']}-token prompt, {runs})",
         m["strata"]["prefill_tok_s"], m["llama.cpp"]["prefill_tok_s"], r["prefill_tok_s"]),
    ] + [
        (f"batch_{k}", f"aggregate decode tok/s, {k} sequences (1 run)", v["tok_s"], v["llama_tok_s"],
         ratio(v["tok_s"], v["llama_tok_s"]))
        for k, v in rep.get("batching", {}).items()
    ]


def limits_lines(rep: dict[str, Any]) -> list[str]:
    """Achieved weight streaming and int8 rates beside the machine's measured limits."""
    if "traffic" not in rep:
        return []
    t, lim, der = rep["traffic"], rep["machine_limits"], rep["derived"]
    k = lim["kernel"]
    out = [f"batch 1: {t['bytes_per_token'] / 1e6:.0f} MB of weights per token -> {der['decode_gb_s']:.1f} GB/s "
           f"(machine read bandwidth {lim['read_gb_s']:.1f} GB/s: numpy, {rep['config']['threads']} threads, 1 GiB)"]
    if "gmac_s_16" in der:
        b = rep["batching"]
        out.append(f"16 sequences: {t['macs_per_token'] / 1e6:.0f} MMAC per token -> {der['gmac_s_16']:.1f} GMAC/s "
                   f"(llama.cpp {der['llama_gmac_s_16']:.1f}); kernel peak {k['gmac_s']:.1f} GMAC/s "
                   f"({k['variant']}, {k['threads']} threads x thread CPU time, weights in cache); "
                   f"16 seqs = {b['16']['tok_s'] / b['1']['tok_s']:.2f}x single stream")
        out.append("per step outside C (scheduler, sampler) / pool idle share, 1 / 16 sequences: " + " / ".join(
            f"{b[k].get('outside_c_ms_median', float('nan')):.1f} ms, {100 * b[k].get('pool_idle_median', float('nan')):.0f}%"
            for k in ("1", "16")))
    else:
        out.append(f"kernel peak {k['gmac_s']:.1f} GMAC/s ({k['variant']}, {k['threads']} threads, weights in cache)")
    return out


def format_report(rep: dict[str, Any]) -> str:
    mach, c = rep["machine"], rep["config"]
    head = [
        f"model:   {rep['model']['label']}",
        f"machine: {mach['cpu_model']}, {c['threads']} threads (nproc {mach['nproc']}, "
        f"affinity {mach['affinity_cores']}), commit {mach['git_commit']}, {mach['date']}",
        f"peer:    llama-cpp-python {rep['versions']['llama_cpp_python']}, n_batch = n_ubatch = {c['chunk']}, "
        f"flash_attn {'on' if c['llama_flash_attn'] else 'off'}",
    ]
    busy = mach.get("busy_cores_before")
    if busy is not None and busy > 0.25:
        head.append(f"note:    {busy:.1f} cores were busy with other work before the run: figures are noisy")
    for note in rep["notes"]:
        head.append(f"note:    {note}")
    rows = [(label, fmt_num(s), fmt_num(p), f"{q:.2f}x" if q == q else "-")
            for _, label, s, p, q in metric_rows(rep)]
    table = text_table(("metric", "strata", "llama.cpp", "ratio"), rows)
    dec = rep["samples"]["llama.cpp"]["decode_agree"]
    steps = max(1, c["decode_tokens"] - 1)
    agree = (f"teacher-forced next-token agreement of llama.cpp with Strata's greedy sequence: "
             f"{median(dec):.0f}/{steps} steps")
    return "\n".join([*head, "", table, "", *limits_lines(rep), "", agree, "", format_profile(rep)])


def format_profile(rep: dict[str, Any]) -> str:
    prof = rep["strata_profile"]
    phases = ("decode", "prefill")
    rows: list[tuple[str, ...]] = []
    for op in (*OPS, "other"):
        rows.append((OP_LABELS[op], *(f"{100 * prof[p]['shares'][op]:.1f}%" for p in phases)))
    rows.append(("C step time, ms/token", *(fmt_num(prof[p]["c_ms_per_token"], 3) for p in phases)))
    rows.append(("outside C (Python, cffi, argmax), % of wall",
                 *(f"{100 * prof[p]['shares']['outside_c']:.1f}%" for p in phases)))
    return "Strata per-op profile (share of C step time, all timed steps)\n" + \
        text_table(("op", *phases), rows)


def format_markdown(rep: dict[str, Any]) -> str:
    mach, c = rep["machine"], rep["config"]
    date = mach["date"][:10]
    cpu = f"{mach['cpu_model']}, {c['threads']} thr"
    model = rep["model"]["label"]
    rows = [(date, mach["git_commit"], cpu, model, label, fmt_num(s), fmt_num(p), f"{q:.2f}x" if q == q else "-")
            for _, label, s, p, q in metric_rows(rep)]
    return markdown_table(("date", "commit", "CPU", "model", "metric", "Strata", "llama.cpp", "Strata / llama.cpp"),
                          rows, n_text_cols=5)


# ---------------------------------------------------------------- CLI
def default_model() -> Path:
    from engine.default_model import build_default_model, default_model_path

    return Path(build_default_model(default_model_path()))


def thread_list(text: str) -> list[int]:
    """'1,2' -> [1, 2] (argparse type of --threads)."""
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("empty thread list")
    return out


def arch_list(text: str) -> list[str]:
    """'all' or a comma list of bench/synthetic_arch.py's keys (argparse type of --arch)."""
    from bench.synthetic_arch import ARCHS

    keys = list(ARCHS) if text.strip() == "all" else [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in keys if k not in ARCHS]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"unknown architecture {', '.join(bad) or text!r} (known: {', '.join(ARCHS)}, all)")
    return keys


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.engine_cpu", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the embedded default model)")
    ap.add_argument("--threads", type=thread_list, default=None,
                    help="threads for both engines, or a comma list (default: all cores of the process affinity; "
                         "--arch: 1 and all cores)")
    ap.add_argument("--runs", type=int, default=None, help="repeats of each measurement (default 3; --quick: 1)")
    ap.add_argument("--quick", action="store_true", help="1 run, 32 decode tokens, 500-token prompt")
    ap.add_argument("--decode-tokens", type=int, default=None, help="decode steps (default 128; --quick: 32)")
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="prefill prompt length (default 2000; --quick: 500)")
    ap.add_argument("--json", type=Path, default=None, metavar="OUT.json",
                    help="write raw samples, medians, profile and machine info")
    ap.add_argument("--markdown", action="store_true", help="also print a markdown block for docs/benchmarks.md")
    ap.add_argument("--synthetic", action="store_true",
                    help="bench the synthetic 8-expert top-2 model ~10x the default (built on first use under "
                         "var/bench/, not committed; see bench/synthetic_moe.py)")
    ap.add_argument("--arch", type=arch_list, default=None,
                    help="comma list of glm4moe, gpt-oss, deepseek2 (or all): the synthetic models of those "
                         "architectures with real layer shapes (bench/synthetic_arch.py), 1 thread and all cores")
    ap.add_argument("--no-batching", action="store_true",
                    help="skip aggregate decode at 1/4/16/32 sequences (and the GMAC/s figure)")
    ap.add_argument("--llama-flash-attn", action="store_true",
                    help="enable flash attention in llama.cpp (llama-cpp-python defaults it off)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.arch:
        return main_arch(a)
    threads = a.threads[0] if a.threads is not None else len(affinity_cores())
    if a.synthetic and a.model is None:
        from bench.synthetic_moe import build_synthetic_model

        print("building the synthetic 10x model (once) ...", file=sys.stderr, flush=True)
        a.model = build_synthetic_model()
    cfg = Config(
        model=(a.model or default_model()).resolve(),
        threads=threads,
        runs=a.runs if a.runs is not None else (1 if a.quick else 3),
        decode_tokens=a.decode_tokens if a.decode_tokens is not None else (32 if a.quick else 128),
        prefill_tokens=a.prefill_tokens if a.prefill_tokens is not None else (500 if a.quick else 2000),
        quick=a.quick,
        llama_flash_attn=a.llama_flash_attn,
        batching=not a.no_batching,
    )
    if (err := config_error(cfg)) is not None:
        print(f"error: {err}", file=sys.stderr)
        return 2

    t0 = time.perf_counter()
    rep = run(cfg, log)
    rep["wall_s"] = time.perf_counter() - t0
    emit_report(rep, format_report(rep), format_markdown(rep) if a.markdown else None, a.json, log)
    log(f"done in {rep['wall_s']:.1f} s")
    return 0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def config_error(cfg: Config) -> str | None:
    for name in ("threads", "runs", "decode_tokens", "prefill_tokens"):
        if getattr(cfg, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if not cfg.model.is_file():
        return f"no such model file: {cfg.model}"
    return None


def main_arch(a: argparse.Namespace) -> int:
    """--arch: each synthetic architecture at each thread count, then the summary of decode ratios."""
    from bench.synthetic_arch import build, describe

    threads = a.threads if a.threads is not None else sorted({1, len(affinity_cores())})
    reports: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for key in a.arch:
        log(f"{describe(key)}: building (once) ...")
        path = build(key).resolve()
        for th in threads:
            cfg = Config(model=path, threads=th, runs=a.runs if a.runs is not None else (1 if a.quick else 3),
                         decode_tokens=a.decode_tokens if a.decode_tokens is not None else (16 if a.quick else 32),
                         prefill_tokens=a.prefill_tokens if a.prefill_tokens is not None else 64, quick=a.quick,
                         llama_flash_attn=a.llama_flash_attn, batching=False)
            if (err := config_error(cfg)) is not None:
                print(f"error: {err}", file=sys.stderr)
                return 2
            rep = run(cfg, log)
            rep["arch"] = {"key": key, "description": describe(key)}
            rep["notes"].insert(0, describe(key))
            reports.append(rep)
            print(format_report(rep) + "\n", flush=True)
    emit_report({"benchmark": "engine_cpu --arch", "reports": reports}, format_arch_summary(reports),
                format_arch_markdown(reports) if a.markdown else None, a.json, log)
    log(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


def arch_rows(reports: Sequence[dict[str, Any]]) -> list[tuple[str, int, float, float, float, float, float]]:
    """(model, threads, strata decode tok/s, llama.cpp, ratio, strata prefill tok/s ratio, output-head
    share of Strata's decode step) per report of an --arch run."""
    rows = []
    for rep in reports:
        m, r = rep["medians"], rep["ratios"]
        shares = rep["strata_profile"]["decode"]["shares"]
        rows.append((rep["model"]["label"].split(" (")[0], int(rep["config"]["threads"]),
                     m["strata"]["decode_tok_s"], m["llama.cpp"]["decode_tok_s"], r["decode_tok_s"],
                     r["prefill_tok_s"], shares["output"]))
    return rows


def format_arch_summary(reports: Sequence[dict[str, Any]]) -> str:
    head = ("model", "threads", "strata decode tok/s", "llama.cpp", "ratio", "prefill ratio", "output head share")
    rows = [(m, str(t), fmt_num(s), fmt_num(p), f"{q:.2f}x", f"{pq:.2f}x", f"{100 * o:.0f}%")
            for m, t, s, p, q, pq, o in arch_rows(reports)]
    return "batch-1 decode, Strata beside llama.cpp on the same file (target >= 1.00x)\n" + text_table(head, rows)


def format_arch_markdown(reports: Sequence[dict[str, Any]]) -> str:
    if not reports:
        return ""
    mach = reports[0]["machine"]
    rows = [(mach["date"][:10], mach["git_commit"], m, str(t), fmt_num(s), fmt_num(p), f"{q:.2f}x", f"{pq:.2f}x")
            for m, t, s, p, q, pq, _ in arch_rows(reports)]
    return markdown_table(("date", "commit", "model", "threads", "Strata decode tok/s", "llama.cpp", "decode ratio",
                           "prefill ratio"), rows, n_text_cols=3)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
