/* gpt-oss (ST_ARCH_GPT_OSS) on the GPU: what it has that the other architectures do not, as forward.c and
 * moe.c compute it (the CPU engine is the oracle).
 *
 * - Attention: q / k / v biases take qkv_head's path (as qwen2moe's); each layer's sinks (one logit per head
 *   joining the softmax's denominator) and the sliding window of every other layer (st_model_desc.n_swa /
 *   swa_pattern) are attn_args.sinks / n_swa of the decode kernel (attention_decode.cu), which runs every
 *   gpt-oss step, prefill included (its chunks read K / V that k_qkv_post wrote); the split, query-tile and
 *   tensor-core attention kernels are not taken (step.cu). The output projection's bias: oss_out_bias.
 * - The FFN (oss_ffn): router logits plus the router's bias, top-k of them then the softmax of the k chosen
 *   (ST_GATING_SOFTMAX_WEIGHT, no renormalisation), experts grouped as every routed layer's, gate and up
 *   projections with their experts' biases, the clamped SwiGLU, the down projection plus its bias; the weighted
 *   sum is left pending to the next RMSNorm as for the other routed layers.
 * - RoPE: YaRN through the model's rope table (model.cu), as every architecture's.
 * - Hybrid placement (experts on the CPU) is refused at model creation (ST_EUNSUPPORTED). */
#include "model.cuh"

/* llama.cpp's swiglu_oai with moe.c's constants: alpha 1.702, limit 7; the gate clamped above at the limit,
 * the up projection to [-limit, limit], then g * sigmoid(alpha g) * (u + 1), in moe.c's operation order. */
#define OAI_ALPHA 1.702f
#define OAI_LIMIT 7.0f
__device__ __forceinline__ float swiglu_oai(float g, float u) {
    const float x = g < OAI_LIMIT ? g : OAI_LIMIT;
    const float y = u < -OAI_LIMIT ? -OAI_LIMIT : (u > OAI_LIMIT ? OAI_LIMIT : u);
    return __fmul_rn(__fdiv_rn(x, __fadd_rn(1.0f, exp_cr(__fmul_rn(-OAI_ALPHA, x)))), __fadd_rn(y, 1.0f));
}

/* h[p, i] = swiglu_oai(g[p, i] + bg[e, i], h[p, i] + bu[e, i]) for every pair p (e = ids[p], its expert);
 * bg / bu NULL: no bias. */
__global__ void k_oss_glu(float *h, const float *g, const int32_t *ids, const float *bg, const float *bu, int32_t P,
                          int64_t F) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)P * F) return;
    const int64_t e = ids[i / F], c = i % F;
    const float gv = bg ? __fadd_rn(g[i], bg[e * F + c]) : g[i];
    const float uv = bu ? __fadd_rn(h[i], bu[e * F + c]) : h[i];
    h[i] = swiglu_oai(gv, uv);
}

/* out[p, i] += b[ids[p], i] (b: [n_expert][E]): the down projection's bias of each pair's expert. */
__global__ void k_oss_pair_bias(float *out, const int32_t *ids, const float *b, int32_t P, int64_t E) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)P * E) return;
    out[i] = __fadd_rn(out[i], b[(int64_t)ids[i / E] * E + i % E]);
}

/* x[t, i] += y[t, i] + b[i]: the attention output's bias added to the projection before the residual, as
 * forward.c adds them (x += (wo . att + bo)). */
__global__ void k_oss_out_bias(float *x, const float *y, const float *b, int32_t T, int64_t E) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (int64_t)T * E) x[i] = __fadd_rn(x[i], __fadd_rn(y[i], b[i % E]));
}

/* gpt-oss's routing of each token, st_route_token's ST_GATING_SOFTMAX_WEIGHT (a warp per token, lane l holding
 * experts l, l + 32, ...): the router's bias added to the logits (written back, as the CPU's), the k largest taken
 * in turn (lowest index on ties: each lane offers its first largest not yet taken, the warp keeps the
 * larger, or on equal values the lower index), their weights the softmax of the chosen logits in slot order. */
#define OSS_ROUTE_MAX 32 /* experts per lane: 1,024 in all */
__global__ void k_oss_route(float *logits, const float *bias, int32_t T, int32_t ne, int32_t k, int32_t *ids, float *w) {
    PDL_ENTER();
    const int t = (int)((blockIdx.x * blockDim.x + threadIdx.x) / 32), lane = threadIdx.x % 32;
    if (t >= T) return;
    float *r = logits + (int64_t)t * ne;
    float v[OSS_ROUTE_MAX];
    uint32_t taken = 0;
    const int nl = (ne - lane + 31) / 32; /* this lane's experts */
    for (int i = 0; i < nl; i++) {
        const int e = lane + 32 * i;
        v[i] = bias ? __fadd_rn(r[e], bias[e]) : r[e];
        if (bias) r[e] = v[i];
    }
    float wt = 0.0f; /* lane j: slot j's logit, then its weight */
    for (int j = 0; j < k; j++) {
        int best = -1;
        float bv = 0.0f;
        for (int i = 0; i < nl; i++)
            if (!(taken >> i & 1u) && (best < 0 || v[i] > bv)) best = i, bv = v[i];
        int be = best < 0 ? -1 : lane + 32 * best;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) bv = ov, be = oe;
        }
        if (be % 32 == lane) taken |= 1u << (be / 32);
        if (lane == j) wt = bv;
        if (lane == 0) ids[(int64_t)t * k + j] = be;
    }
    /* the softmax over the k chosen, in slot order on every lane (k <= 32, checked at model creation) */
    float mx = -INFINITY, sum = 0.0f;
    for (int j = 0; j < k; j++) mx = fmaxf(mx, __shfl_sync(0xffffffffu, wt, j));
    for (int j = 0; j < k; j++) sum = __fadd_rn(sum, exp_cr(__fsub_rn(__shfl_sync(0xffffffffu, wt, j), mx)));
    if (lane < k) w[(int64_t)t * k + lane] = __fdiv_rn(exp_cr(__fsub_rn(wt, mx)), sum);
}

/* The checks of what gpt-oss adds to a layer (validate's, after the common ones): biases and sinks F32 of
 * their shapes (llama.cpp requires them all), the routing gpt-oss's, every layer routed. */
static stg_status oss_validate(const stg_model *m, const st_layer *layers) {
    const st_model_desc *d = &m->d;
    if (d->arch != ST_ARCH_GPT_OSS) return ST_OK;
    if (d->n_expert < 1 || d->n_expert > 32 * OSS_ROUTE_MAX || d->n_expert_used > 32 ||
        d->gating != ST_GATING_SOFTMAX_WEIGHT || d->n_expert_group > 1 || d->n_dense_lead > 0)
        return fail(ST_EINVAL, "model: gpt-oss needs routed experts (at most %d, top-k at most 32) in every layer with "
                               "top-k-then-softmax routing (experts %d, top-%d, gating %d, groups %d, dense lead %d)",
                    32 * OSS_ROUTE_MAX, d->n_expert, d->n_expert_used, d->gating, d->n_expert_group, d->n_dense_lead);
    if (d->n_swa < 0 || d->swa_pattern < 0)
        return fail(ST_EINVAL, "model: sliding window %d / pattern %d invalid", d->n_swa, d->swa_pattern);
    const int64_t E = d->n_embd, ff = m->n_ff_exp;
    for (int il = 0; il < d->n_layer; il++) {
        const st_layer &l = layers[il];
        CHECK(check_t(l.bq, "attn_q.bias", il, true, m->q_dim, 1, 1, true));
        CHECK(check_t(l.bk, "attn_k.bias", il, true, m->kv_dim, 1, 1, true));
        CHECK(check_t(l.bv, "attn_v.bias", il, true, m->kv_dim, 1, 1, true));
        CHECK(check_t(l.bo, "attn_output.bias", il, true, E, 1, 1, true));
        CHECK(check_t(l.sinks, "attn_sinks", il, true, d->n_head, 1, 1, true));
        CHECK(check_t(l.gate_inp_b, "ffn_gate_inp.bias", il, true, d->n_expert, 1, 1, true));
        CHECK(check_t(l.gate_exps_b, "ffn_gate_exps.bias", il, true, ff, d->n_expert, 1, true));
        CHECK(check_t(l.up_exps_b, "ffn_up_exps.bias", il, true, ff, d->n_expert, 1, true));
        CHECK(check_t(l.down_exps_b, "ffn_down_exps.bias", il, true, E, d->n_expert, 1, true));
        if (l.gate_shexp.data || l.exp_probs_b.data)
            return fail(ST_EINVAL, "layer %d: gpt-oss has no shared expert or routing score bias", il);
    }
    return ST_OK;
}

/* Whether layer il slides (internal.h's st_layer_swa rule): its window in keys, else 0. */
static int32_t oss_window(const st_model_desc &d, int il) {
    return d.n_swa > 0 && d.swa_pattern > 0 && il % d.swa_pattern < d.swa_pattern - 1 ? d.n_swa : 0;
}

/* The attention output projection of a layer with a bias (gpt-oss): wo . att into a scratch row set, then
 * x += (that + bo). pair_out is free here: the previous layer's expert sum went into this layer's RMSNorm. */
static stg_status oss_out_proj(stg_model *m, const dlayer &L, int32_t T, const acts_d &ain) {
    scratch &s = m->s;
    const int64_t E = m->d.n_embd;
    lin_groups g = {};
    g.n_pairs = T;
    CHECK(linear(m->stream, L.wo, nullptr, g, 1, T, T, ain, s.pair_out, E, MODE_STORE));
    launch_k(k_oss_out_bias, (unsigned)((T * E + 255) / 256), 256, 0, m->stream, s.x, (const float *)s.pair_out,
             L.bo.f(), T, E);
    LAUNCHED("attention output bias");
    return ST_OK;
}

/* gpt-oss's FFN block after its RMSNorm (xn, and aq when a weight is quantised): see the top of the file. */
static stg_status oss_ffn(stg_model *m, int il, int32_t T) {
    const dlayer &L = m->L[(size_t)il];
    scratch &s = m->s;
    const st_model_desc &d = m->d;
    cudaStream_t st = m->stream;
    const int ne = d.n_expert, k = d.n_expert_used;
    const int32_t P = T * k;
    const int64_t E = d.n_embd, F = m->n_ff_exp;
    const acts_d rin{s.aq, s.ad, s.as, s.xn, T};
    lin_groups g1 = {};
    g1.n_pairs = T;
    CHECK(linear(st, L.gate_inp, nullptr, g1, 1, T, T, rin, s.router, ne, MODE_STORE));
    launch_k(k_oss_route, (unsigned)((T + 3) / 4), 128, 0, st, s.router, L.gate_inp_b.f(), T, ne, k, s.topk_id,
             s.topk_w); /* a warp per token */
    LAUNCHED("gpt-oss routing");
    const group_out go = {s.gexp, s.gstart, s.gcount, s.n_groups, s.list, s.pair_tok, m->hist + (int64_t)il * ne,
                          s.gtiles, s.n_gtiles, s.mexp, s.mstart, s.mcount, s.n_mgroups, s.pair_mv, 0};
    launch_k(k_group, 1, 1024, 2 * ne * sizeof(int32_t), st, (const int32_t *)s.topk_id, P, k, ne, go, 0);
    LAUNCHED("group");
    lin_groups ge = {};
    ge.gexp = s.gexp, ge.gstart = s.gstart, ge.gcount = s.gcount, ge.n_groups = s.n_groups;
    ge.list = s.list, ge.in_map = s.pair_tok;
    ge.n_pairs = P, ge.tiles = s.gtiles, ge.n_tiles = s.n_gtiles;
    const int max_groups = std::min(ne, P), expected = (P + ne - 1) / ne;
    /* gate into h2, up into h, then the biased, clamped product into h */
    CHECK(linear(st, L.gate_exps, nullptr, ge, max_groups, expected, T, rin, s.h2, F, MODE_STORE));
    CHECK(linear(st, L.up_exps, nullptr, ge, max_groups, expected, T, rin, s.h, F, MODE_STORE));
    launch_k(k_oss_glu, (unsigned)((P * F + 255) / 256), 256, 0, st, s.h, (const float *)s.h2,
             (const int32_t *)s.topk_id, L.gate_exps_b.f(), L.up_exps_b.f(), P, F);
    LAUNCHED("gpt-oss swiglu");
    if (stg_reads_q32(L.down_exps.type)) CHECK(quantize(st, s.h, P, F, s.hq, s.hd, s.hs));
    lin_groups gd = ge;
    gd.in_map = nullptr; /* down reads the pair's own hidden row */
    CHECK(linear(st, L.down_exps, nullptr, gd, max_groups, expected, T, acts_d{s.hq, s.hd, s.hs, s.h}, s.pair_out, E,
                 MODE_STORE));
    if (L.down_exps_b.d) {
        launch_k(k_oss_pair_bias, (unsigned)((P * E + 255) / 256), 256, 0, st, s.pair_out, (const int32_t *)s.topk_id,
                 L.down_exps_b.f(), P, E);
        LAUNCHED("expert down bias");
    }
    /* added by the next RMSNorm: weights as routed (expert_norm off: gpt-oss's), in slot order */
    m->pending = combine_args{s.pair_out, s.topk_w, k, d.expert_norm, nullptr, 0};
    return ST_OK;
}
