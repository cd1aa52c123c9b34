"""`strata model inspect`: what a GGUF holds and whether it fits a machine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf_model import SUPPORTED_TYPES, HParams, ModelFile

GIB = 1024**3
EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


@dataclass
class ModelReport:
    arch: str
    n_params: int
    n_active_params: int
    file_bytes: int
    quant_mix: dict[str, int]
    expert_bytes: int  # all routed experts
    expert_bytes_per_token: int  # routed experts read for one token (top-k of every layer)
    dense_bytes: int  # everything but routed experts and the embedding table
    kv_bytes_per_token: int  # F16 K and V over all layers
    n_ctx_train: int
    nextn_bytes: int = 0  # NextN (MTP) layers: loaded and kept, not read by the forward pass


def _n_elems(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layer_of(name: str) -> int:
    """The block index of a "blk.N." tensor, else -1."""
    parts = name.split(".", 2)
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else -1


def analyse(mf: ModelFile) -> ModelReport:
    hp = mf.hparams
    n_params = expert_params = expert_bytes = dense_bytes = nextn_params = nextn_bytes = 0
    for name, t in mf.tensors.items():
        n = _n_elems(t.shape)
        n_params += n
        if _layer_of(name) >= hp.n_layer:  # a NextN layer: not part of a token's forward pass
            nextn_params += n
            nextn_bytes += t.n_bytes
        elif name.endswith(EXPERT_SUFFIXES):
            expert_params += n
            expert_bytes += t.n_bytes
        elif name != "token_embd.weight" or "output.weight" not in mf.tensors:
            dense_bytes += t.n_bytes
    k_frac = hp.n_expert_used / hp.n_expert if hp.n_expert else 0.0
    return ModelReport(
        arch=hp.arch,
        n_params=n_params,
        n_active_params=int(n_params - nextn_params - expert_params + expert_params * k_frac),
        file_bytes=mf.size_bytes,
        quant_mix=mf.quant_mix(),
        expert_bytes=expert_bytes,
        expert_bytes_per_token=int(expert_bytes * k_frac),
        dense_bytes=dense_bytes,
        kv_bytes_per_token=hp.kv_bytes_per_token,
        n_ctx_train=hp.n_ctx_train,
        nextn_bytes=nextn_bytes,
    )


def _attention_line(mf: ModelFile) -> str:
    hp = mf.hparams
    t = mf.tensors
    if hp.kv_lora_rank:
        q = f"q rank {hp.q_lora_rank}" if hp.q_lora_rank else "q full rank"
        parts = [f"latent (MLA): KV rank {hp.kv_lora_rank}, {q}, value dims {hp.head_dim_v or hp.head_dim} per head, "
                 f"one cached row of {hp.kv_lora_rank} + {hp.rope_dim} per token "
                 f"({'attn_k_b / attn_v_b' if hp.mla_split else 'attn_kv_b'})"]
    else:
        parts = [("q/k/v/o biases" if "blk.0.attn_output.bias" in t else "q/k/v biases")
                 if "blk.0.attn_q.bias" in t else "no biases"]
    if "blk.0.attn_q_norm.weight" in t:
        parts.append("q/k norms")
    if hp.attn_sinks:
        parts.append("a learned sink per head")
    if hp.sliding_layers():
        slide = hp.sliding_layers()
        which = "every other layer from 0" if hp.swa_pattern == 2 else f"{len(slide)} of {hp.n_layer} layers"
        parts.append(f"sliding window {hp.n_swa} on {which} (the rest full)")
    rotary = "NEOX" if hp.rope_type == 2 else "NORM"
    parts.append(f"{rotary} rotary on {hp.rope_dim} of {hp.head_dim} dims"
                 + ((" (the last)" if hp.kv_lora_rank else " (partial)") if hp.rope_dim < hp.head_dim else "")
                 + f", base {hp.rope_base:g}")
    return "attention       " + ", ".join(parts)


def _rope_line(hp: HParams) -> str:
    rp = hp.rope
    if not rp.active:
        return "rope scaling    none"
    line = f"rope scaling    {rp.describe()}, window {rp.window(hp.n_ctx_train)}"
    return line + " (CPU engine only: the GPU engine refuses it)"


def _expert_line(hp: HParams) -> str:
    if not hp.n_expert:
        return f"experts         none (dense FFN width {hp.n_ff})"
    line = f"experts         {hp.n_expert} routed, top-{hp.n_expert_used}, FFN width {hp.n_ff_exp}"
    if hp.n_ff_shexp:
        line += (f", {hp.n_expert_shared} shared" if hp.n_expert_shared else ", shared expert") + \
            f" (width {hp.n_ff_shexp})"
    if hp.arch == "gpt-oss":
        line += ", biases on gate/up/down, clamped SwiGLU (alpha 1.702, limit 7)"
    if hp.n_dense_lead:
        lead = "first layer" if hp.n_dense_lead == 1 else f"first {hp.n_dense_lead} layers"
        line += f"; {lead} dense (FFN width {hp.n_ff})"
    return line


def gpu_bytes(mf: ModelFile, kv_bytes: int, step_tokens: int = 512, logit_rows: int = 64) -> int:
    """VRAM for the whole model on the GPU (engine/csrc/cuda): every weight once (a tied output
    shares the embedding), the KV cache, and the step buffers for `step_tokens` tokens."""
    weights = sum((t.n_bytes + 255) // 256 * 256 for t in mf.tensors.values())
    return int(weights + kv_bytes + step_buffer_bytes(mf.hparams, step_tokens, logit_rows))


def step_buffer_bytes(hp: HParams, step_tokens: int = 512, logit_rows: int = 64) -> int:
    """The GPU engine's step buffers for steps of up to `step_tokens` tokens and `logit_rows` logit rows."""
    k = hp.n_expert_used if hp.n_expert else 1
    ff = max(hp.n_ff, hp.n_ff_exp, hp.n_ff_shexp, 32)
    q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    k_max = max(hp.n_embd, q_dim, hp.n_ff, hp.n_ff_shexp)
    per_token = 4 * (2 * hp.n_embd + 2 * q_dim + 2 * kv_dim + 2 * max(hp.n_expert, 1) + 2 * k) + k_max * 1.5
    per_pair = ff * (4 + 4 + 1.5) + 4 * hp.n_embd + 8
    return int(step_tokens * (per_token + (k + 1) * per_pair) + logit_rows * 4 * (hp.n_vocab + hp.n_embd)
               + split_partial_bytes(hp))


def split_partial_bytes(hp: HParams) -> int:
    """The most the GPU's split-KV decode partials hold (engine/csrc/cuda/attention_split.cu): 64 tokens x 64
    splits x query heads, each head_dim + 2 floats, allocated by the first step that splits; 0 for heads the
    split path does not take (head_dim other than 32 / 64 / 128, or query heads per KV head not dividing 16)."""
    g = hp.n_head // hp.n_head_kv if hp.n_head_kv else 0
    if hp.head_dim not in (32, 64, 128) or not g or 16 % g:
        return 0
    return 64 * 64 * hp.n_head * (hp.head_dim + 2) * 4


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def tier_tokens(mf: ModelFile, ram_gib: float | None, vram_gib: float | None,
                kv_bytes_per_token: int | None = None, step_tokens: int = 512) -> tuple[int | None, int | None]:
    """KV tokens each tier holds for the budgets (None where no budget is given): the hot tier, VRAM less the
    dense weights and the step buffers for `step_tokens` (the hybrid layout: routed experts in RAM); the cold tier, RAM less the
    whole file (the mapped weights). A lane's window is bounded by their sum (admission counts both tiers)."""
    r = analyse(mf)
    per = kv_bytes_per_token or r.kv_bytes_per_token
    steps = step_buffer_bytes(mf.hparams, step_tokens)
    hot = None if vram_gib is None else max(0, int(vram_gib * GIB) - r.dense_bytes - steps) // per
    cold = None if ram_gib is None else max(0, int(ram_gib * GIB) - r.file_bytes) // per
    return hot, cold


def _kv_q8_line(mf: ModelFile, f16_per_token: int, ctx: int) -> str:
    """The 8-bit cache's figures (kv_type "q8_0": a byte a value and an F16 scale per 32 values) beside F16's."""
    per = mf.hparams.kv_bytes_per_token_of("q8_0")
    return (f"KV cache q8_0   {_fmt_bytes(per)} per token, {_fmt_bytes(per * ctx)} at context {ctx} (kv_type q8_0: "
            f"{GIB // max(per, 1):,} tokens a GiB, F16 {GIB // max(f16_per_token, 1):,})")


def render(mf: ModelFile, ram_gib: float | None, vram_gib: float | None, ctx: int | None,
           step_tokens: int = 512) -> str:
    """The model's report; the VRAM lines count the GPU engine's step buffers for steps of `step_tokens`."""
    r = analyse(mf)
    hp = mf.hparams
    ctx = ctx or hp.rope.window(hp.n_ctx_train)  # the scaled window under rope scaling
    kv = r.kv_bytes_per_token * ctx
    lines = [
        f"file            {mf.path} ({_fmt_bytes(r.file_bytes)})",
        f"architecture    {r.arch}: {hp.n_layer} layers, d_model {hp.n_embd}, heads {hp.n_head}/{hp.n_head_kv} "
        f"(head_dim {hp.head_dim}), vocab {hp.n_vocab}, trained context {hp.n_ctx_train}",
        _attention_line(mf),
        _rope_line(hp),
        _expert_line(hp),
        *([f"routing         {hp.routing}" + (", router bias" if "blk.0.ffn_gate_inp.bias" in mf.tensors else "")]
          if hp.n_expert else []),
        *([f"NextN layers    {hp.n_nextn} after the {hp.n_layer} (multi-token prediction: kept for speculative "
           f"decoding, not run), {_fmt_bytes(r.nextn_bytes)}"] if hp.n_nextn else []),
        f"parameters      {r.n_params / 1e6:.1f} M total, {r.n_active_params / 1e6:.1f} M active per token",
        "quant mix       " + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in sorted(r.quant_mix.items(), key=lambda kv: -kv[1])),
        f"routed experts  {_fmt_bytes(r.expert_bytes)} in all, {_fmt_bytes(r.expert_bytes_per_token)} read per token",
        f"dense weights   {_fmt_bytes(r.dense_bytes)} (attention, norms, router, shared experts, dense layers, "
        "output)",
        f"KV cache        {_fmt_bytes(r.kv_bytes_per_token)} per token, {_fmt_bytes(kv)} at context {ctx}",
        _kv_q8_line(mf, r.kv_bytes_per_token, ctx),
    ]
    if ram_gib is not None:
        need = r.file_bytes + kv
        verdict = "fits" if need <= ram_gib * GIB else "does NOT fit"
        lines.append(f"RAM {ram_gib:g} GiB     {verdict}: weights + KV = {_fmt_bytes(need)} (CPU-only serving)")
    if vram_gib is not None:
        need = r.dense_bytes + kv
        verdict = "fits" if need <= vram_gib * GIB else "does NOT fit"
        spare = vram_gib * GIB - need
        lines.append(f"VRAM {vram_gib:g} GiB    {verdict}: dense weights + KV = {_fmt_bytes(need)} (hybrid: experts in RAM)"
                     + (f"; {_fmt_bytes(spare)} left for resident experts" if spare > 0 else ""))
    if vram_gib is not None:
        need = gpu_bytes(mf, kv, step_tokens)
        verdict = "fits" if need <= vram_gib * GIB else "does NOT fit"
        lines.append(f"VRAM {vram_gib:g} GiB    {verdict}: all weights + KV + step buffers = {_fmt_bytes(need)} "
                     f"(device cuda: the whole model on the GPU)")
    if ram_gib is not None or vram_gib is not None:
        hot, cold = tier_tokens(mf, ram_gib, vram_gib, step_tokens=step_tokens)
        parts = ([f"hot (VRAM {vram_gib:g} GiB after dense weights and step buffers) {hot:,} tokens"]
                 if hot is not None else [])
        parts += [f"cold (RAM {ram_gib:g} GiB after the weights) {cold:,} tokens"] if cold is not None else []
        total = (hot or 0) + (cold or 0)
        lines.append(f"KV tiers        {_fmt_bytes(r.kv_bytes_per_token)} per token: " + "; ".join(parts)
                     + f"; {total:,} tokens in all = {total // ctx:,} sequences at context {ctx}")
        if vram_gib is not None:
            hot8, _ = tier_tokens(mf, None, vram_gib, mf.hparams.kv_bytes_per_token_of("q8_0"), step_tokens)
            lines.append(f"KV tiers q8_0   hot (VRAM {vram_gib:g} GiB) {hot8:,} tokens with kv_type q8_0")
    lines.append("supported types " + ", ".join(SUPPORTED_TYPES.values()))
    return "\n".join(lines)


def render_hybrid(mf: ModelFile, vram_gib: float, *, ctx: int | None = None, seqs: int = 1,
                  placement: str | None = None, cpu_gbs: float | None = None, gpu_gbs: float | None = None,
                  gpu: str | None = None, threads: int | None = None, step_tokens: int = 512,
                  staging_slots: int = 0, ram_gib: float | None = None) -> str:
    """The hybrid plan for a GPU budget of `vram_gib` GiB (engine/placement.py): what sits where, expert bytes
    per token read from RAM and the predicted batch-1 decode rate. The RAM read rate is measured here on
    `threads` threads unless given."""
    from engine import placement as pl

    if seqs < 1 or step_tokens < 1 or staging_slots < 0 or vram_gib <= 0:
        raise ValueError("--vram must be > 0, --seqs and --step-tokens >= 1, --staging-slots >= 0")
    freqs, source = None, "uniform routing (no placement file)"
    if placement is not None:
        pf = pl.PlacementFile.load(placement, model=mf)
        freqs, source = pf.stats.frequencies(), f"{placement} ({pf.stats.total_tokens:.0f} tokens)"
    note_cpu = "given" if cpu_gbs is not None else f"measured now, {threads or 'all allowed'} threads"
    note_gpu = "given" if gpu_gbs is not None else f"{gpu or pl.DEFAULT_GPU}'s from the table"
    if cpu_gbs is None:
        cpu_gbs = pl.measure_cpu_read_gbs(threads)
    if gpu_gbs is None:
        gpu_gbs = pl.gpu_read_gbs(gpu or pl.DEFAULT_GPU)
    params = pl.PlanParams(budget_bytes=int(vram_gib * GIB), n_ctx=ctx or mf.hparams.rope.window(mf.hparams.n_ctx_train), n_seqs=seqs,
                           step_tokens=step_tokens, staging_slots=staging_slots, cpu_read_gbs=cpu_gbs,
                           gpu_read_gbs=gpu_gbs)
    text = pl.render_plan(pl.plan(mf, params, freqs), mf.hparams.n_expert, source)
    if ram_gib is not None:  # hybrid: the KV cache is on the GPU; RAM holds the mapped file the CPU experts read
        need = mf.size_bytes
        text += (f"\n  RAM           {'fits' if need <= ram_gib * GIB else 'does NOT fit'}: the mapped file "
                 f"{_fmt_bytes(need)} of {ram_gib:g} GiB (the page cache every lane on the box shares)")
    return text + f"\n  (CPU bandwidth {note_cpu}; GPU bandwidth {note_gpu})"
