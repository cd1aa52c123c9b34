"""GPU engine benchmark (issue 9): a synthetic Qwen3-30B-A3B-shaped model built on the machine.

    python -m bench.engine_gpu [--layers 48] [--skew 1.0] [--quick] [--json out.json]
    python -m bench.engine_gpu --depth 0,8192,32768,131072 [--llama-bin DIR]   # decode at depth
    python -m bench.engine_gpu --depth 131072 --depth-batch 2 --kv-budget-gb 4 --depth-steps 32   # KV tiers
    python -m bench.engine_gpu --arch gpt-oss [--llama-bin DIR]   # the synthetic gpt-oss-120b (2 of 36 layers)
    python -m bench.engine_gpu --arch glm4moe [--llama-bin DIR]   # the synthetic GLM-4.5-Air instead

``--arch`` benches bench/synthetic_arch.py's model of that architecture (real layer shapes and published quant
mix, fewer layers; written under --model-dir on first use) through the same measurements, beside llama.cpp on
the same file with ``--llama-bin``.

Builds a ``qwen3moe`` GGUF of the real shapes (48 layers, hidden 2048, 32 query / 4 KV heads
of 128, 128 experts top-8, expert FFN 768, vocabulary 151,936 fed as token ids): Q4_K
attention and experts, Q6_K output head, F16 embedding, F32 norms and router, random but
well-conditioned (weights ~ N(0, 1/K) in distribution). Routing skew: expert popularity
follows a Zipf law of exponent --skew (0 = uniform), produced by a shared direction in the
embeddings that the router rows weigh by log-popularity; the measured share of the 8 most
used experts is printed.

It prints Strata's decode tok/s at batch 1 (128 tokens), aggregate decode tok/s at 8 and 32
concurrent distinct sequences (greedy: each next token is the engine's own pick on the GPU, only
the ids copied back, and on a GPU whose library has stg_step_launch step N+1 launched before step
N is waited, its ids read from N's picks on the device, as the scheduler runs greedy requests by
default (``decode_headline_pick``); the ``*_sync`` rows wait for each step before the next, the
``*_host_argmax`` rows copy the logits back and take the argmax on the host instead), prefill tok/s for 512- and 4,096-token prompts, and the HBM
floor for batch-1 decode (weight bytes read per token / measured device copy bandwidth); the
median GPU time of a decode step (st_step_stats.t_total) beside each wall-clock rate; and, for
comparison, batch 1 without graphs, per-layer events (and with them on every step) or PDL, prefill
with the matvec kernel only, 32 sequences without the split dense GEMM, and 8 / 32 sequences at
other GEMM thresholds (--gemm-min). Each comparison row replaces the open model's settings
(engine/gpu_settings.py's overrides, CudaModel.set_settings) and restores them after.
With ``--llama-bin DIR`` (llama.cpp's llama-bench and llama-batched-bench built with CUDA from the
llama-cpp-python source distribution: tools/gpu/build_llama_cuda.sh) it then measures
llama.cpp on the same file (all layers on the GPU, flash attention on) and prints both columns
with the ratios against the issue's targets. ``--depth`` measures batch-1 decode after that many tokens of
context instead (bench/engine_gpu_depth.py), beside ``llama-bench -p 0 -n 128 -d D``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

from engine import gpu_settings

# The window the file declares: decode at depth reaches 131,072 tokens and more (Strata's KV is sized by the
# benchmark, llama-bench's context by the depth; neither reads this but as the trained context).
CONTEXT_LENGTH = 262144
SHAPE = dict(
    n_layer=48,
    n_embd=2048,
    n_head=32,
    n_head_kv=4,
    head_dim=128,
    n_expert=128,
    n_expert_used=8,
    n_ff_exp=768,
    n_vocab=151936,
)
QUICK = dict(
    n_layer=4,
    n_embd=1024,
    n_head=16,
    n_head_kv=4,
    head_dim=64,
    n_expert=32,
    n_expert_used=4,
    n_ff_exp=512,
    n_vocab=8192,
)


def _q4k(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Random Q4_K rows [rows, k/256*144] with scales giving weights of std ~ 1/sqrt(k), mean ~ 0."""
    nb = rows * (k // 256)
    raw = np.frombuffer(rng.bytes(nb * 144), np.uint8).reshape(nb, 144).copy()
    d = np.float16(0.0069 / np.sqrt(k))  # std(w) ~ d * E[sc] * std(q) ~ 145 d
    raw[:, 0:2] = np.array([d], np.float16).view(np.uint8)
    raw[:, 2:4] = np.array([d * 7.5], np.float16).view(np.uint8)  # mins cancel the mean of q
    return raw.reshape(rows, (k // 256) * 144)


def _q8_0(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Random Q8_0 rows [rows, k/32*34]: int8 quants (std ~74) under one scale giving weights of std ~ 1/sqrt(k)."""
    nb = rows * (k // 32)
    raw = np.frombuffer(rng.bytes(nb * 34), np.uint8).reshape(nb, 34).copy()
    raw[:, 0:2] = np.array([np.float16(1.0 / (74.0 * np.sqrt(k)))], np.float16).view(np.uint8)
    return raw.reshape(rows, (k // 32) * 34)


def _q6k(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    nb = rows * (k // 256)
    raw = np.frombuffer(rng.bytes(nb * 210), np.uint8).reshape(nb, 210).copy()
    raw[:, 192:208] = rng.integers(16, 48, size=(nb, 16), dtype=np.uint8)
    raw[:, 208:210] = np.array([np.float16(0.0017 / np.sqrt(k))], np.float16).view(np.uint8)
    return raw.reshape(rows, (k // 256) * 210)


def build_model(path: Path, shape: dict, skew: float, seed: int = 0, experts: str = "q4_k") -> Path:
    """The synthetic Qwen3-MoE-shaped file: Q4_K attention, Q6_K head, routed experts in ``experts`` (q4_k, or
    q8_0 for the model that does not fit a 24 GB budget at all: ~32 GB at the Qwen3-30B-A3B shape)."""
    if experts not in ("q4_k", "q8_0"):
        raise ValueError(f"experts: q4_k or q8_0, not {experts!r}")
    ex, ex_t = (_q4k, QT.Q4_K) if experts == "q4_k" else (_q8_0, QT.Q8_0)
    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".tmp")
    L, E, H, KV, hd = (
        shape["n_layer"],
        shape["n_embd"],
        shape["n_head"],
        shape["n_head_kv"],
        shape["head_dim"],
    )
    ne, k, ff, V = shape["n_expert"], shape["n_expert_used"], shape["n_ff_exp"], shape["n_vocab"]
    w = GGUFWriter(str(tmp), "qwen3moe")
    w.add_block_count(L)
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(E)
    w.add_feed_forward_length(6144)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(ne)
    w.add_expert_used_count(k)
    w.add_expert_feed_forward_length(ff)
    # no tokenizer, but a vocabulary size: llama.cpp then loads the file with V dummy tokens (its
    # benchmarks feed random ids, as this one does); Strata reads no tokenizer unless asked to
    w.add_tokenizer_model("no_vocab")
    w.add_vocab_size(V)

    def raw(name: str, blob: np.ndarray, qt: QT) -> None:
        w.add_tensor(name, blob, raw_shape=blob.shape, raw_dtype=qt)

    c = np.ones(E, np.float32) / np.sqrt(E)  # the shared direction the router reads popularity from
    emb = rng.standard_normal((V, E), dtype=np.float32)
    emb += (2.0 * np.sqrt(E)) * c if skew > 0 else 0.0
    w.add_tensor("token_embd.weight", emb.astype(np.float16))
    del emb
    w.add_tensor("output_norm.weight", np.ones(E, np.float32))
    raw("output.weight", _q6k(rng, V, E), QT.Q6_K)
    pop = 1.0 / np.arange(1, ne + 1) ** skew if skew > 0 else np.ones(ne)
    pop = pop[rng.permutation(ne)]
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(E, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(E, np.float32))
        w.add_tensor(p + "attn_q_norm.weight", np.ones(hd, np.float32))
        w.add_tensor(p + "attn_k_norm.weight", np.ones(hd, np.float32))
        raw(p + "attn_q.weight", _q4k(rng, H * hd, E), QT.Q4_K)
        raw(p + "attn_k.weight", _q4k(rng, KV * hd, E), QT.Q4_K)
        raw(p + "attn_v.weight", _q4k(rng, KV * hd, E), QT.Q4_K)
        raw(p + "attn_output.weight", _q4k(rng, E, H * hd), QT.Q4_K)
        router = rng.standard_normal((ne, E)).astype(np.float32) * (1.0 / np.sqrt(E))
        # xn . c is ~0.9 sqrt(E) (the embeddings' shared part over their RMS), so this adds about
        # log(popularity) to each expert's logit on top of unit-variance noise
        router += (np.log(pop)[:, None] * c[None, :] / (0.9 * np.sqrt(E))).astype(np.float32)
        w.add_tensor(p + "ffn_gate_inp.weight", router.astype(np.float32))
        raw(p + "ffn_gate_exps.weight", ex(rng, ne * ff, E).reshape(ne, ff, -1), ex_t)
        raw(p + "ffn_up_exps.weight", ex(rng, ne * ff, E).reshape(ne, ff, -1), ex_t)
        raw(p + "ffn_down_exps.weight", ex(rng, ne * E, ff).reshape(ne, E, -1), ex_t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), via torch."""
    import torch

    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / float(np.median(times))


def bytes_per_token(mf: object) -> int:
    from engine.inspect_model import analyse

    r = analyse(mf)  # type: ignore[arg-type]
    emb_row = mf.tensors["token_embd.weight"].n_bytes // mf.hparams.n_vocab  # type: ignore[attr-defined]
    return r.dense_bytes + r.expert_bytes_per_token + emb_row


def _shape(args: argparse.Namespace) -> dict:
    return QUICK if args.quick else dict(SHAPE, n_layer=args.layers)


def _model_path(args: argparse.Namespace) -> Path:
    if args.arch:  # bench/synthetic_arch.py's file, under --model-dir
        from bench.synthetic_arch import default_path

        return Path(args.model_dir) / default_path(args.arch).name
    return Path(args.model_dir) / (
        f"qwen3moe-synth-{_shape(args)['n_layer']}L-skew{args.skew:g}{'-quick' if args.quick else ''}.gguf"
    )


def _build(args: argparse.Namespace, path: Path) -> Path:
    """Write the benchmark's model at `path`: the synthetic architecture of --arch (real layer shapes and quant
    mix, fewer layers: bench/synthetic_arch.py), else the Qwen3-30B-A3B-shaped model of --layers / --skew."""
    if args.arch:
        from bench.synthetic_arch import ARCHS, write_arch

        return write_arch(ARCHS[args.arch](), path)
    return build_model(path, _shape(args), args.skew)


class _ProfilerRange:
    """cudaProfilerStart / Stop around a region (for ncu --profile-from-start off), the device synchronised
    at both ends so that only the region's kernels fall inside."""

    def start(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()

    def stop(self) -> None:
        import torch

        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def run(args: argparse.Namespace) -> dict:
    from engine.engine import Engine

    path = _model_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not path.exists():
        _build(args, path)
    t_build = time.perf_counter() - t0
    bw = copy_bandwidth() if args.device != "cpu" else float("nan")
    t0 = time.perf_counter()
    eng = Engine.open(path, device=args.device, kv_tokens=40 * 1024, block_size=16, prefill_chunk=512)
    t_load = time.perf_counter() - t0
    V, bs = eng.hparams.n_vocab, eng.block_size
    rng = np.random.default_rng(1)
    res: dict = {
        "model": str(path),
        "file_gib": path.stat().st_size / 2**30,
        "build_s": t_build,
        "load_s": t_load,
        "copy_bw_gbs": bw / 1e9,
    }
    hist = np.zeros((eng.hparams.n_layer, eng.hparams.n_expert), np.int32)

    @contextlib.contextmanager
    def settings(**env: str) -> Iterator[None]:
        """The rows inside run with the overrides ``env`` (gpu_settings names) on top of the process's own;
        the process's settings again afterwards (on the CPU: nothing to set)."""
        if eng._gpu is not None:
            eng._gpu.set_settings({**os.environ, **env})
        try:
            yield
        finally:
            if eng._gpu is not None:
                eng._gpu.set_settings()

    def blocks(n_tok: int) -> list[int]:
        got = eng.blocks.allocate(-(-n_tok // bs))
        assert got is not None
        return got

    def prefill(n: int, prof: object = None) -> float:
        ids = [int(t) for t in rng.integers(0, V, size=n)]
        eng.warm_up(n)  # a step of the timed run's size first, on blocks of its own (step buffers grown, kernels loaded)
        b = blocks(n)
        try:
            if prof is not None:
                prof.start()  # type: ignore[attr-defined]
            t = time.perf_counter()
            eng.prefill(ids, b)
            rate = n / (time.perf_counter() - t)
            if prof is not None:
                prof.stop()  # type: ignore[attr-defined]
            return rate
        finally:
            eng.blocks.release(b)

    gpu_ms: dict[str, float] = {}  # median device time of a timed decode step (st_step_stats.t_total)

    def decode(
        n_seq: int, steps: int, prompt: int = 32, tag: str = "", prof: object = None, pick: str = "device"
    ) -> tuple[float, object]:
        """Aggregate decode tok/s of n_seq sequences, greedy: pick "device" takes each next token
        from the engine's own greedy pick (Engine.forward(greedy=True): the argmax on the GPU, only
        the ids copied back: what the scheduler does for greedy requests), "host" copies the logits
        back and takes np.argmax here (the scheduler's path for rows that need logits), "random" feeds random ids after copying the logits, as llama-batched-bench
        does. "overlap": the device pick with step N+1 launched before step N is waited
        (Engine.launch / Engine.wait, each id read on the device from the previous step's pick by
        st_batch.token_src: the host's work of a step runs while the GPU computes the one before).
        prof: a torch profiler started after the prompts' prefill and stopped after the last
        step."""
        if pick not in ("device", "host", "random", "overlap"):
            raise ValueError(f"pick: {pick!r}")
        tabs = [blocks(prompt + steps + 1) for _ in range(n_seq)]
        try:
            last = []
            for tb in tabs:
                ids = [int(t) for t in rng.integers(0, V, size=prompt)]
                last.append(int(np.argmax(eng.prefill(ids, tb))))
            pos = prompt
            step_t = []
            if pick == "overlap":
                seqs, rows, zeros = list(range(n_seq)), list(range(n_seq)), [0] * n_seq
                ticket = None
                for s in range(steps + 2):  # two warm-up steps
                    if s == 2:
                        if ticket is not None:  # the timed steps start with nothing in flight
                            eng.wait(ticket)
                            ticket = None
                        if prof is not None:
                            prof.start()  # type: ignore[attr-defined]
                        t = time.perf_counter()
                    # the first step's ids are the prefill's; then each from the step before, on the device
                    nxt = eng.launch(
                        last if s == 0 else zeros,
                        [pos] * n_seq,
                        seqs,
                        tabs,
                        rows,
                        token_src=None if s == 0 else rows,
                        expert_hist=hist,
                    )
                    if ticket is not None:
                        eng.wait(ticket)
                        if s >= 3:
                            step_t.append(eng.last_stats.t_total)
                    ticket = nxt
                    pos += 1
                eng.wait(ticket)
                step_t.append(eng.last_stats.t_total)
            else:
                for s in range(steps + 2):  # two warm-up steps
                    if s == 2:
                        if prof is not None:
                            prof.start()  # type: ignore[attr-defined]
                        t = time.perf_counter()
                    out = eng.forward(
                        last,
                        [pos] * n_seq,
                        list(range(n_seq)),
                        tabs,
                        list(range(n_seq)),
                        expert_hist=hist,
                        greedy=pick == "device",
                    )
                    if s >= 2:
                        step_t.append(eng.last_stats.t_total)
                    last = (
                        out.tolist()
                        if pick == "device"
                        else [int(x) for x in out.argmax(axis=1)]
                        if pick == "host"
                        else [int(x) for x in rng.integers(0, V, size=n_seq)]
                    )
                    pos += 1
            rate = n_seq * steps / (time.perf_counter() - t)
            if prof is not None:
                prof.stop()  # type: ignore[attr-defined]
            if tag:
                gpu_ms[tag] = 1e3 * float(np.median(step_t))
            return rate, eng.last_stats
        finally:
            for tb in tabs:
                eng.blocks.release(tb)

    def sched_decode(n_seq: int, steps: int, overlap: bool, prompt: int = 32) -> float:
        """Decode tok/s of n_seq greedy requests through the serving scheduler (Scheduler.step, the
        engine's greedy pick), STRATA_OVERLAP on or off: the prompts' prefill and two steps untimed, then
        `steps` steps timed (the bench model has no tokenizer: no detokenisation, unlike a lane)."""
        from engine.sampling import SamplingParams
        from engine.scheduler import OVERLAP_ENV, Scheduler, SchedulerConfig

        sched = Scheduler(
            eng,
            SchedulerConfig(
                max_num_seqs=max(n_seq, 1), max_batch_tokens=max(2048, n_seq * prompt), prefix_cache=False
            ),
            environ={OVERLAP_ENV: "1" if overlap else "0"},
        )
        sp = SamplingParams.parse(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for _ in range(n_seq):
            sched.add([int(x) for x in rng.integers(0, V, size=prompt)], sp)
        for _ in range(3):
            sched.step()
        n = 0
        t = time.perf_counter()
        for _ in range(steps):
            n += sum(len(o.token_ids) for o in sched.step())
        rate = n / (time.perf_counter() - t)
        while sched.has_work():
            sched.step()
        return rate

    # The headline decode rows take the product's path, the scheduler's rule (engine/scheduler.py): on a GPU engine
    # whose library has stg_step_launch, greedy decode steps overlap the host (step N+1 launched before step N is
    # waited; STRATA_OVERLAP=0 turns it off there too); on the CPU (a launch is the whole step) the device pick.
    from engine.scheduler import OVERLAP_ENV

    head = (
        "overlap"
        if (eng.device.kind == "cuda" and os.environ.get(OVERLAP_ENV, "1").strip() == "1")
        else "device"
    )
    res["decode_headline_pick"] = head
    print(
        f"decode headline rows (decode_b1/b8/b32_tok_s): pick={head!r}"
        + (
            " (launch N+1 before wait N, as the scheduler); decode_bN_sync_tok_s: the device pick, each step waited"
            if head == "overlap"
            else ""
        )
    )

    def split_layers(tag: str, n_seq: int) -> None:
        """The layers that kept the routed split after a decode row (the device's own decision)."""
        if eng._gpu is not None and n_seq > 1:
            res[f"routed_split_layers_{tag}"] = eng._gpu.routed_split_layers(n_seq)

    def decode_rows(n_seq: int, steps: int) -> object:
        """decode_b{n_seq}_tok_s on the headline path and, when that is the overlap, decode_b{n_seq}_sync_tok_s
        (the device pick, each step waited before the next) after
        it. Returns the last step's stats of the device-pick run (the headline's without an overlap): the
        stats rows split one step's GPU time, the same work either way, and an overlapped step may record
        no per-layer events (one in flight does) or t_output (a later launch re-records it)."""
        res[f"decode_b{n_seq}_tok_s"], st = decode(n_seq, steps, tag=f"b{n_seq}", pick=head)
        split_layers(f"b{n_seq}", n_seq)
        if head == "overlap":
            res[f"decode_b{n_seq}_sync_tok_s"], st = decode(n_seq, steps, tag=f"b{n_seq}_sync")
        return st

    def decode_tables(rows: int, width: int) -> list[str]:
        """Kernel times of 16 decode steps at 1 and 32 sequences, by CUPTI through torch's profiler (the
        caller turns graphs and PDL off: with PDL a kernel's span includes its wait for the predecessor)."""
        import torch.profiler as tp

        tables = []
        for n_seq in (1, 32):
            decode(n_seq, 4)
            prof = tp.profile(activities=[tp.ProfilerActivity.CUDA])
            decode(n_seq, 16, prof=prof)
            tables.append(
                f"== {n_seq} sequence(s), 16 decode steps, graphs and PDL off\n"
                + prof.key_averages().table(
                    sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=width
                )
            )
        return tables

    if (
        args.ncu_step
    ):  # one decode step of N sequences inside cudaProfilerStart / Stop (ncu --profile-from-start off)
        decode(args.ncu_step, 1, prof=_ProfilerRange())
        eng.close()
        return res
    if args.profile_decode or args.decode_only:  # decode only: kernel times (profile) and rates
        tables = []
        if args.profile_decode:
            with settings(STRATA_GPU_GRAPHS="0", STRATA_GPU_PDL="0"):  # as --profile
                tables = decode_tables(40, 70)
        for n_seq, steps in ((1, 128), (8, 64), (32, 64)):  # the defaults (graphs, PDL), the headline's path
            decode_rows(n_seq, steps)
        for n_seq, steps in ((1, 128), (8, 64), (32, 64)):  # the logits copied back, the argmax on the host
            res[f"decode_b{n_seq}_host_argmax_tok_s"], _ = decode(
                n_seq, steps, tag=f"b{n_seq}_host_argmax", pick="host"
            )
        if (
            head != "overlap"
        ):  # launch N+1 before wait N beside the headline's device pick (the CPU, STRATA_OVERLAP=0)
            for n_seq, steps in ((1, 128), (8, 64), (32, 64)):
                res[f"decode_b{n_seq}_overlap_tok_s"], _ = decode(
                    n_seq, steps, tag=f"b{n_seq}_overlap", pick="overlap"
                )
        res["decode_b1_repeat_tok_s"], _ = decode(
            1, 128, tag="b1_repeat"
        )  # the device pick again, after them
        for k, (n_seq, steps) in enumerate(((1, 128), (8, 64), (32, 64), (1, 128))):  # the scheduler
            for m in ("sync", "overlap", "sync2"):  # STRATA_OVERLAP off / on / off again
                res[f"sched_b{n_seq}_{m}{'_again' if k == 3 else ''}"] = sched_decode(
                    n_seq, steps, m == "overlap"
                )
        print(
            "scheduler decode tok/s: "
            + ", ".join(f"{k} {v:.1f}" for k, v in res.items() if k.startswith("sched_"))
        )
        if (
            args.lean
        ):  # one row per --knob "N:ENV=V" (N sequences with the override ENV=V), e.g. another threshold
            names = {o.env for o in gpu_settings.OVERRIDES}
            for spec in args.knob or ["32:STRATA_GPU_GEMM_DENSE_MIN=64", "8:STRATA_GPU_ROUTED_SPLIT_MAX=0"]:
                n_s, _, kv = spec.partition(":")
                env, _, v = kv.partition("=")
                if not n_s.isdigit() or env not in names or not v:
                    raise SystemExit(
                        f"--knob: expected N:ENV=VALUE with ENV one of {sorted(names)}, got {spec!r}"
                    )
                tag = f"b{n_s}_{env.removeprefix('STRATA_GPU_').lower()}_{v}"
                with settings(**{env: v}):
                    res[f"decode_{tag}_tok_s"], _ = decode(int(n_s), 128 if n_s == "1" else 64, tag=tag)
                    split_layers(tag, int(n_s))
        else:
            res["decode_b32_random_next_tok_s"], _ = decode(32, 64, tag="b32_random_next", pick="random")
        if args.decode_only and not args.lean:  # the split dense GEMM off, and from 8 tokens, for comparison
            with settings(STRATA_GPU_DENSE_SPLIT="0"):
                res["decode_b8_no_dense_split_tok_s"], _ = decode(8, 64, tag="b8_no_dense_split")
                res["decode_b32_no_dense_split_tok_s"], _ = decode(32, 64, tag="b32_no_dense_split")
            with settings(STRATA_GPU_DENSE_SPLIT="8"):  # 8 sequences' dense layers on the split GEMM too
                res["decode_b8_dense_split8_tok_s"], _ = decode(8, 64, tag="b8_dense_split8")
        print(
            "routed split layers: "
            + ", ".join(f"{k[20:]} {v}" for k, v in res.items() if k.startswith("routed_split_layers_"))
        )
        res["decode_step_gpu_ms"] = gpu_ms
        lib = eng._gpu.library.name if eng._gpu else "cpu"
        print(
            f"decode ({lib}): "
            + ", ".join(
                f"{k[7:-6]} {v:.1f} tok/s ({gpu_ms.get(k[7:-6], float('nan')):.2f} ms)"
                for k, v in res.items()
                if k.startswith("decode_b")
            )
        )
        if tables:
            table = "\n".join(tables)
            print(table)
            if args.json:
                Path(args.json).with_suffix(".profile.txt").write_text(table)
        eng.close()
        return res
    with settings(STRATA_GPU_GEMM_MIN="1000000"):  # the bitwise layers on the matvec kernel only
        res["prefill_512_matvec_tok_s"] = prefill(512)
    if args.profile:  # kernel times of decode at 1 and 32 sequences, by CUPTI through torch's profiler
        import torch.profiler as tp

        # graphs and PDL off: each kernel's time is its own (with PDL a kernel's span includes
        # its wait for the predecessor), the decode steps only (not the prompts' prefill)
        with settings(STRATA_GPU_GRAPHS="0", STRATA_GPU_PDL="0"):
            tables = decode_tables(18, 60)
            for n_tok in (512, 4096):  # prefill: one timed prompt each (warmed first)
                prefill(n_tok)
                prof = tp.profile(activities=[tp.ProfilerActivity.CUDA])
                prefill(n_tok, prof=prof)
                tables.append(
                    f"== prefill of {n_tok} tokens, graphs and PDL off\n"
                    + prof.key_averages().table(
                        sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60
                    )
                )
        table = "\n".join(tables)
        print(table)
        if args.json:
            Path(args.json).with_suffix(".profile.txt").write_text(table)
    res["prefill_512_tok_s"] = prefill(512)  # the defaults
    if not args.quick:
        res["prefill_4096_tok_s"] = prefill(4096)
    hist[:] = 0
    st1 = decode_rows(1, 128)
    res["decode_b1_stats_ms"] = {
        k: 1e3 * getattr(st1, k) for k in ("t_total", "t_attn", "t_experts", "t_output")
    }
    top = np.sort(hist.sum(axis=0))[::-1]
    res["top8_expert_share"] = float(top[:8].sum() / max(top.sum(), 1))
    res["graphs_cached_failed_note"] = eng._gpu.graph_status() if eng._gpu else None
    with settings(STRATA_GPU_GRAPHS="0"):  # plain launches, for comparison
        res["decode_b1_no_graphs_tok_s"], _ = decode(1, 64)
    with settings(STRATA_GPU_LAYER_EVENTS="0"):  # what the per-layer timing events cost
        res["decode_b1_no_layer_events_tok_s"], _ = decode(1, 128, tag="b1_no_events")
    with settings(STRATA_GPU_LAYER_EVENTS="1"):  # on every step (the default samples one step in 64)
        res["decode_b1_all_layer_events_tok_s"], _ = decode(1, 128, tag="b1_all_events")
    with settings(STRATA_GPU_PDL="0"):  # without programmatic dependent launch, for comparison
        res["decode_b1_no_pdl_tok_s"], _ = decode(1, 128, tag="b1_no_pdl")
    st8 = decode_rows(8, 64)
    res["decode_b8_stats_ms"] = {
        k: 1e3 * getattr(st8, k) for k in ("t_total", "t_attn", "t_experts", "t_output")
    }
    st32 = decode_rows(32, 64)
    # the logits copied back and the argmax on the host, and random next tokens after the logits copy, as
    # llama-batched-bench feeds them
    res["decode_b32_host_argmax_tok_s"], _ = decode(32, 64, tag="b32_host_argmax", pick="host")
    res["decode_b32_random_next_tok_s"], _ = decode(32, 64, tag="b32_random_next", pick="random")
    with settings(STRATA_GPU_DENSE_SPLIT="0"):  # small dense layers on the matvec
        res["decode_b32_no_dense_split_tok_s"], _ = decode(32, 64, tag="b32_no_dense_split")
    res["decode_b1_host_argmax_tok_s"], _ = decode(1, 128, tag="b1_host_argmax", pick="host")
    res["decode_b1_random_next_tok_s"], _ = decode(1, 128, tag="b1_random_next", pick="random")
    for gm in args.gemm_min.split(","):  # other GEMM thresholds (pairs per group), same results, other speed
        with settings(STRATA_GPU_GEMM_MIN=gm):
            res[f"decode_b8_gemm_min{gm}_tok_s"], _ = decode(8, 32, tag=f"b8_gemm_min{gm}")
            res[f"decode_b32_gemm_min{gm}_tok_s"], _ = decode(32, 32, tag=f"b32_gemm_min{gm}")
    # single-group launches (the output head) through the GEMM from 8 pairs: same results, other speed
    with settings(STRATA_GPU_GEMM_DENSE_MIN="8"):
        res["decode_b8_dense_gemm_tok_s"], _ = decode(8, 32, tag="b8_dense_gemm")
        res["decode_b32_dense_gemm_tok_s"], _ = decode(32, 32, tag="b32_dense_gemm")
    res["decode_b32_stats_ms"] = {
        k: 1e3 * getattr(st32, k) for k in ("t_total", "t_attn", "t_experts", "t_output")
    }
    res["decode_step_gpu_ms"] = gpu_ms
    bpt = bytes_per_token(eng.model_file)
    res["bytes_per_token_mib"] = bpt / 2**20
    res["hbm_floor_tok_s"] = bw / bpt
    res["floor_share_b1"] = res["decode_b1_tok_s"] / res["hbm_floor_tok_s"]
    res["gpu_weight_gib"] = eng._gpu.weight_bytes / 2**30 if eng._gpu else 0.0
    eng.close()
    return res


# The targets: Strata over llama.cpp on the same file, same machine, same run.
TARGETS = {"decode_b1": 1.25, "decode_b8": None, "decode_b32": 1.0, "prefill_512": 0.7, "prefill_4096": 0.7}


def llama_env(bin_dir: Path) -> dict:
    """The environment of a llama.cpp binary from bin_dir (its shared libraries beside it)."""
    return dict(os.environ, LD_LIBRARY_PATH=f"{bin_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}")


def parse_llama_bench(stdout: str) -> dict:
    """llama-bench's ``-o json`` rows as tok/s by Strata's keys: prefill_N_tok_s (pp rows), decode_b1_tok_s
    (tg rows), and the build it reports."""
    out: dict = {}
    for r in json.loads(stdout):
        if r["n_gen"] == 0:
            out[f"prefill_{r['n_prompt']}_tok_s"] = float(r["avg_ts"])
        elif r["n_prompt"] == 0:
            out["decode_b1_tok_s"] = float(r["avg_ts"])
        out.setdefault(
            "build",
            f"{r.get('build_commit', '?')} ({r.get('build_number', '?')}), "
            f"{r.get('gpu_info', '?')}, backends {r.get('backends', '?')}",
        )
    return out


def parse_batched_bench(text: str) -> dict:
    """llama-batched-bench's jsonl rows (stdout and stderr together) as decode_b{N}_tok_s."""
    out: dict = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            out[f"decode_b{r['pl']}_tok_s"] = float(r["speed_tg"])
    return out


def run_llama(bin_dir: Path, model: Path, timeout_s: float = 420.0) -> dict:
    """llama.cpp with CUDA on the same GGUF: all layers on the GPU, flash attention on.

    llama-bench gives prefill 512 / 4,096 (pp, n_batch 2048, n_ubatch 512: its defaults) and
    decode at batch 1 (tg128 from an empty context); llama-batched-bench gives aggregate decode
    at 8 and 32 sequences of distinct random 32-token prompts, 64 tokens each (as Strata's).
    Returns tok/s by the same keys as Strata's results, plus the raw outputs' paths' content.
    """
    env = llama_env(bin_dir)
    out: dict = {}
    cmd = [
        str(bin_dir / "llama-bench"),
        "-m",
        str(model),
        "-ngl",
        "99",
        "-fa",
        "1",
        "-p",
        "512,4096",
        "-n",
        "128",
        "-r",
        "3",
        "-o",
        "json",
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    out["llama_bench_s"] = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({p.returncode}): {p.stderr[-2000:]}")
    out.update(parse_llama_bench(p.stdout))
    cmd = [
        str(bin_dir / "llama-batched-bench"),
        "-m",
        str(model),
        "-ngl",
        "99",
        "-fa",
        "on",
        "-c",
        "8192",
        "-b",
        "2048",
        "-ub",
        "512",
        "-npp",
        "32",
        "-ntg",
        "64",
        "-npl",
        "8,32",
        "--output-format",
        "jsonl",
    ]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    out["llama_batched_bench_s"] = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({p.returncode}): {p.stderr[-2000:]}")
    out.update(parse_batched_bench(p.stdout + "\n" + p.stderr))
    return out


def print_table(res: dict, peer: dict | None) -> None:
    """The headline: Strata, llama.cpp, the ratio and the issue's target for each figure."""
    print(f"{'metric (tok/s)':<22}{'Strata GPU':>12}{'llama.cpp':>12}{'ratio':>8}{'target':>8}")
    for k, tgt in TARGETS.items():
        s = res.get(f"{k}_tok_s")
        p = (peer or {}).get(f"{k}_tok_s")
        ratio = f"{s / p:.2f}x" if s and p else "-"
        print(
            f"{k:<22}{s if s else float('nan'):>12.1f}{p if p else float('nan'):>12.1f}{ratio:>8}"
            f"{(f'{tgt:.2f}x' if tgt else '-'):>8}"
        )
    print(
        f"{'hbm_floor_b1':<22}{res.get('hbm_floor_tok_s', float('nan')):>12.1f}"
        f"   (Strata reaches {100 * res.get('floor_share_b1', float('nan')):.1f}%"
        + (
            f", llama.cpp {100 * peer['decode_b1_tok_s'] / res['hbm_floor_tok_s']:.1f}%)"
            if peer and "decode_b1_tok_s" in peer and "hbm_floor_tok_s" in res
            else ")"
        )
    )


def prefill_once(args: argparse.Namespace, n: int) -> int:
    """One n-token prefill after a 16-token warm-up (so that a profiler wrapped around the process
    sees the 512-token step's kernels after the small step's), on the file the benchmark builds; with --repeat R,
    R of them. Each --prefill-knob adds a row of R prefills under its settings in the same process (one model load),
    the rows taking turns prefill by prefill so that a drift of the machine spreads over all of them."""
    from bench.engine_gpu_depth import parse_knobs
    from engine.engine import Engine

    path = _model_path(args)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        _build(args, path)
    rows = [("default", None)] + [
        (label, {**os.environ, **knobs}) for label, knobs in parse_knobs(args.prefill_knob)
    ]
    with Engine.open(
        path, device=args.device, kv_tokens=max(8192, n + 16), block_size=16, prefill_chunk=args.prefill_chunk,
        kv_type=args.kv_type,
    ) as eng:
        ids = [int(t) for t in np.random.default_rng(1).integers(0, eng.hparams.n_vocab, size=n)]
        rates: dict[str, list[float]] = {label: [] for label, _ in rows}
        for _ in range(max(1, args.repeat)):
            for label, environ in rows:
                if len(rows) > 1 and eng._gpu:
                    eng._gpu.set_settings(environ)  # None: the process environment's, as at open
                b = eng.blocks.allocate(-(-n // eng.block_size))  # each on fresh blocks (no prefix reuse)
                assert b is not None
                eng.prefill(ids[:16], b)
                t = time.perf_counter()
                eng.prefill(ids, b)
                rates[label].append(n / (time.perf_counter() - t))
                eng.blocks.release(b)
        lib = eng._gpu.library.name if eng._gpu else "cpu"
        base = float(np.median(rates["default"]))
        for label, _ in rows:
            r = rates[label]
            med = float(np.median(r))
            vs = f", {med / base:.3f}x default" if label != "default" else ""
            print(
                f"prefill of {n} tokens in chunks of {args.prefill_chunk} ({lib}, {args.kv_type} KV, {label}): median {med:.0f} tok/s over {len(r)} "
                f"({', '.join(f'{x:.0f}' for x in r)}){vs}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU engine benchmark on a synthetic Qwen3-30B-A3B-shaped model")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument(
        "--arch",
        default=None,
        choices=["glm4moe", "gpt-oss", "deepseek2"],
        help="bench bench/synthetic_arch.py's model of this architecture (real layer shapes and quant mix, "
        "fewer layers; built under --model-dir on first use) instead of the Qwen3-30B-A3B-shaped one",
    )
    ap.add_argument(
        "--skew", type=float, default=1.0, help="Zipf exponent of expert popularity (0 = uniform)"
    )
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model-dir", default="/tmp/strata-bench")
    ap.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print the kernel times of decode at 1 and 32 sequences and of prefill at 512 and 4,096 tokens",
    )
    ap.add_argument(
        "--profile-decode",
        action="store_true",
        help="only the kernel times of decode at 1 and 32 sequences (graphs and PDL off) and the "
        "decode rates at 1, 8 and 32 sequences (no prefill figures)",
    )
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="only the decode rates at 1, 8 and 32 sequences, also without the split dense GEMM "
        "(a before/after of a decode change; STRATA_CUDA_LIB)",
    )
    ap.add_argument(
        "--lean",
        action="store_true",
        help="with --decode-only: only 1, 8 and 32 sequences (the headline's path, the device's "
        "greedy pick each step waited when that is the overlap, then the host's argmax over "
        "copied logits), then one row per --knob (default: 32 "
        "sequences with the head on the GEMM from 64 pairs, and 8 without the routed split GEMM)",
    )
    ap.add_argument(
        "--knob",
        action="append",
        metavar="N:ENV=VALUE",
        help="with --lean: also decode N sequences with the override ENV (engine/gpu_settings.py) "
        "set to VALUE (repeatable)",
    )
    ap.add_argument(
        "--gemm-min",
        default="2,4,1000000",
        help="STRATA_GPU_GEMM_MIN values to also time decode at 8 and 32 sequences with",
    )
    ap.add_argument(
        "--llama-bin",
        default=None,
        help="folder with llama.cpp's llama-bench and llama-batched-bench built with CUDA "
        "(tools/gpu/build_llama_cuda.sh): measured on the same file after Strata",
    )
    ap.add_argument("--llama-only", action="store_true", help="build the model and measure llama.cpp only")
    ap.add_argument(
        "--build-only", action="store_true", help="only write the model file (if missing) and exit"
    )
    ap.add_argument(
        "--prefill-only",
        type=int,
        default=0,
        metavar="N",
        help="load the model, warm up with 16 tokens, run one N-token prefill and exit (a target for ncu)",
    )
    ap.add_argument(
        "--ncu-step",
        type=int,
        default=0,
        metavar="N",
        help="load the model, prefill N prompts, run two decode steps of N sequences, then one more "
        "inside cudaProfilerStart / Stop and exit (a target for ncu --profile-from-start off)",
    )
    ap.add_argument(
        "--prefill-knob",
        action="append",
        default=[],
        metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
        help="with --prefill-only: also R prefills under these settings in the same process, taking turns "
        "with the default's (repeatable; e.g. q16:STRATA_GPU_ATT_MMA=1)",
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=512,
        metavar="C",
        help="with --prefill-only: the engine's prefill_chunk (tokens a step; llama.cpp's -ub is 512 by default)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="R",
        help="with --prefill-only: R prefills (each after its 16-token warm-up), the median printed; "
        "STRATA_CUDA_LIB=other.so times another build the same way",
    )
    ap.add_argument(
        "--depth",
        default=None,
        metavar="D1,D2,...",
        help="decode at depth only: batch-1 decode tok/s after each number of tokens of context "
        "(e.g. 0,8192,32768,131072), Strata with and without the split-KV attention, and with "
        "--llama-bin llama-bench -p 0 -n 128 -d D beside it (bench/engine_gpu_depth.py)",
    )
    ap.add_argument(
        "--depth-steps", type=int, default=128, help="with --depth: decode steps timed at each depth"
    )
    ap.add_argument(
        "--unsplit-steps",
        type=int,
        default=32,
        help="with --depth: steps timed with the split-KV attention off (0: skip that row)",
    )
    ap.add_argument("--depth-reps", type=int, default=2, help="with --depth: llama-bench repetitions (-r)")
    ap.add_argument(
        "--depth-ubatch",
        type=int,
        default=512,
        metavar="N",
        help="with --depth: the prefill's step size to each depth, Strata's prefill_chunk and llama.cpp's -ub "
        "(the decode rows do not depend on it; 2048 fills a hybrid model's cache to 128k about 4x sooner)",
    )
    ap.add_argument(
        "--depth-batch",
        type=int,
        default=1,
        metavar="N",
        help="with --depth: decode N sequences at each depth (aggregate tok/s; llama.cpp: "
        "llama-batched-bench -npl N)",
    )
    ap.add_argument(
        "--kv-type",
        default="f16",
        choices=["f16", "q8_0"],
        help="with --depth or --prefill-only: Strata's KV cache values (Engine.open's kv_type); with --depth "
        "llama.cpp's the same (-ctk / -ctv)",
    )
    ap.add_argument(
        "--depth-experts-cpu",
        action="store_true",
        help="with --depth: hybrid placement, every routed expert on the CPU (the fixed parts' budget); "
        "llama.cpp -ot exps=CPU",
    )
    ap.add_argument(
        "--depth-profile",
        action="store_true",
        help="with --depth: a kernel-time table (graphs and PDL off, torch's profiler) at each depth "
        "for the default and each --depth-knob",
    )
    ap.add_argument(
        "--depth-ncu",
        action="store_true",
        help="with --depth: at each depth one decode step (graphs and PDL off) inside cudaProfilerStart / Stop, "
        "a target for ncu --profile-from-start off (tools/gpu/ncu_depth.sh)",
    )
    ap.add_argument(
        "--depth-knob",
        action="append",
        default=[],
        metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
        help="with --depth: one more decode row at each depth with these STRATA_GPU_* overrides "
        "(repeatable; e.g. min1k:STRATA_GPU_ATT_SPLIT_MIN=1024); with --kv-budget-gb the tiered row again "
        "under them (e.g. cpu:STRATA_GPU_KV_HOST_ATTN=1)",
    )
    ap.add_argument(
        "--kv-budget-gb",
        type=float,
        default=None,
        metavar="G",
        help="with --depth D (one depth) and --depth-batch N: the KV tiers' row instead: N concurrent "
        "requests of D-token prompts served by the scheduler with G GiB of VRAM KV (the rest in "
        "pinned host RAM), --depth-steps tokens each, against an unlimited budget: same tokens, "
        "decode tok/s, bytes read from the host tier and moved between tiers per token",
    )
    args = ap.parse_args(argv)
    if args.arch:  # the synthetic file first: every mode below reads it
        from bench.synthetic_arch import describe

        path = _model_path(args)
        print(f"{describe(args.arch)}: {path}", flush=True)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _build(args, path)
    if args.depth is not None:
        from bench import engine_gpu_depth

        if (
            args.depth_steps < 1
            or args.unsplit_steps < 0
            or args.depth_reps < 1
            or args.depth_ubatch < 1
            or not 1 <= args.depth_batch <= 64
        ):
            raise SystemExit(
                "--depth-steps, --depth-reps and --depth-ubatch must be >= 1, --unsplit-steps >= 0, "
                "--depth-batch 1..64"
            )
        args.depth_knobs = engine_gpu_depth.parse_knobs(args.depth_knob)
        if args.kv_budget_gb is not None:
            return engine_gpu_depth.main_tiers(args, _model_path(args), lambda p: _build(args, p))
        return engine_gpu_depth.main(args, _model_path(args), lambda p: _build(args, p))
    if args.prefill_only:
        return prefill_once(args, args.prefill_only)
    if args.build_only:
        path = _model_path(args)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            _build(args, path)
        print(f"model: {path} ({path.stat().st_size / 2**30:.2f} GiB)")
        return 0
    res = run(args) if not args.llama_only else {"model": str(_model_path(args))}
    peer = None
    if args.llama_bin:
        if args.llama_only and not Path(res["model"]).exists():
            Path(res["model"]).parent.mkdir(parents=True, exist_ok=True)
            _build(args, Path(res["model"]))
        try:
            peer = run_llama(Path(args.llama_bin), Path(res["model"]))
        except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
            print(f"llama.cpp not measured: {type(e).__name__}: {e}")
        res["llama_cpp"] = peer
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    print(f"{'metric':<36}{'Strata GPU':>14}")
    for k, v in res.items():
        if isinstance(v, float) and k not in ("file_gib", "build_s", "load_s"):
            print(f"{k:<36}{v:>14.3f}")
    print_table(res, peer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
