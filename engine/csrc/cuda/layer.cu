/* One layer of the forward pass: the embedding, the attention block (norm, q / k / v, attention, output
 * projection) and the FFN block (dense, or router + routed experts + shared expert). */
#include "model.cuh"

static stg_status embed(stg_model *m, const int32_t *tokens, const int32_t *src, int32_t T) {
    const dtensor &t = m->token_embd;
    const int64_t E = m->d.n_embd;
    cudaStream_t st = m->stream;
    const size_t smem = sizeof(float) * (size_t)E <= 48 * 1024 ? sizeof(float) * (size_t)E : 0; /* k_embed's staged */
    switch (t.type) {
#define CASE_E(TY)                                                                                         \
    case TY:                                                                                               \
        launch_k(k_embed<TY>, T, 128, smem, st, t.d, t.row_bytes, tokens, src, (const int32_t *)m->s.picks, E, m->s.x, \
                 smem ? 1 : 0);                                                                            \
        break;
        QUANT_CASES(CASE_E)
        FLOAT_CASES(CASE_E)
#undef CASE_E
    default: return fail(ST_EUNSUPPORTED, "embedding type %d", t.type);
    }
    LAUNCHED("embedding");
    return ST_OK;
}

static acts_d layer_acts(stg_model *m, const float *x, int64_t T, int64_t K, bool need_q, stg_status *rc) {
    scratch &s = m->s;
    *rc = need_q ? quantize(m->stream, x, T, K, s.aq, s.ad, s.as) : ST_OK;
    return acts_d{s.aq, s.ad, s.as, x};
}

/* The routed experts' weighted sum waits in pair_out for the next RMSNorm (which adds it to
 * the residual first); take_combine hands it over once. */
static combine_args take_combine(stg_model *m) {
    const combine_args c = m->pending;
    m->pending = combine_args{};
    return c;
}

static stg_status mla_block(stg_model *m, stg_kv *kv, int il, int32_t T, const int32_t *d_pos, const int32_t *d_seq,
                            const int32_t *d_bt, int32_t max_blocks); /* mla.cu */

static stg_status attention_block(stg_model *m, stg_kv *kv, int il, int32_t T, const int32_t *d_pos,
                                  const int32_t *d_seq, const int32_t *d_bt, int32_t max_blocks, bool fuse_qkv,
                                  const int32_t *d_tiles, int32_t n_tiles, int32_t att_split) {
    if (m->d.kv_lora_rank > 0) return mla_block(m, kv, il, T, d_pos, d_seq, d_bt, max_blocks); /* deepseek2: mla.cu */
    const dlayer &L = m->L[(size_t)il];
    scratch &s = m->s;
    const st_model_desc &d = m->d;
    cudaStream_t st = m->stream;
    const int64_t E = d.n_embd;
    const bool nq = stg_reads_q32(L.wq.type) || stg_reads_q32(L.wk.type) || stg_reads_q32(L.wv.type);
    /* a decode step that splits its attention (attention_split.cu) prepares q / k / v with k_qkv_post; so does every
     * step on the 8-bit cache, whose decode always takes the split kernel (att_split >= 1 there) */
    const bool q8 = kv->type == STG_KV_Q8_0;
    const bool fuse = fuse_qkv && att_split <= 1 && !q8;
    launch_k(k_rmsnorm, T, RMS_THREADS, 0, st, s.x, nullptr, L.attn_norm.f(), s.xn, E, d.norm_eps, nq ? s.aq : nullptr, s.ad, s.as,
                                  take_combine(m));
    LAUNCHED("rmsnorm");
    const acts_d in{s.aq, s.ad, s.as, s.xn};
    lin_groups g = {};
    g.n_pairs = T;
    bool qkv_parts = false; /* q / k / v left in the split GEMM's parts (g_defer_combine) */
    if (L.wq.type == L.wk.type && L.wq.type == L.wv.type && !stg_is_float(L.wq.type) && !use_gemm(m->q_dim, 1, T) &&
        !(g_gemm_fast && gemm_fast_layer(L.wq))) {
        /* q, k and v in one matvec launch (same type and row length), or one split GEMM launch (a step on
         * the prefill form takes the next branch) */
        lin_seg sg = {};
        sg.n_seg = 3;
        sg.seg_row[0] = 0, sg.seg_row[1] = m->q_dim, sg.seg_row[2] = m->q_dim + m->kv_dim;
        sg.seg_row[3] = m->q_dim + 2 * m->kv_dim;
        sg.seg_w[0] = L.wq.d, sg.seg_w[1] = L.wk.d, sg.seg_w[2] = L.wv.d;
        sg.seg_out[0] = s.q, sg.seg_out[1] = s.k, sg.seg_out[2] = s.v;
        sg.seg_ldo[0] = m->q_dim, sg.seg_ldo[1] = sg.seg_ldo[2] = m->kv_dim;
        g_defer_combine = fuse, g_deferred = false; /* only the fused attention reads q/k/v */
        const stg_status lrc = linear(st, L.wq, nullptr, g, 1, T, T, in, s.q, m->q_dim, MODE_STORE, STG_PATH_AUTO, &sg);
        g_defer_combine = false;
        CHECK(lrc);
        qkv_parts = g_deferred;
    } else if (g_gemm_fast && L.wq.type == L.wk.type && L.wq.type == L.wv.type && gemm_fast_layer(L.wq) &&
               m->q_dim % MM_BM == 0 && m->kv_dim % MM_BM == 0) {
        /* a prefill-form step: q, then k and v as one launch over their rows (k and v alone are few row tiles) */
        lin_seg sg = {};
        sg.n_seg = 2;
        sg.seg_row[1] = m->kv_dim, sg.seg_row[2] = 2 * m->kv_dim;
        sg.seg_w[0] = L.wk.d, sg.seg_w[1] = L.wv.d;
        sg.seg_out[0] = s.k, sg.seg_out[1] = s.v;
        sg.seg_ldo[0] = sg.seg_ldo[1] = m->kv_dim;
        CHECK(linear(st, L.wq, nullptr, g, 1, T, T, in, s.q, m->q_dim, MODE_STORE));
        CHECK(linear(st, L.wk, nullptr, g, 1, T, T, in, s.k, m->kv_dim, MODE_STORE, STG_PATH_AUTO, &sg));
    } else {
        CHECK(linear(st, L.wq, nullptr, g, 1, T, T, in, s.q, m->q_dim, MODE_STORE));
        CHECK(linear(st, L.wk, nullptr, g, 1, T, T, in, s.k, m->kv_dim, MODE_STORE));
        CHECK(linear(st, L.wv, nullptr, g, 1, T, T, in, s.v, m->kv_dim, MODE_STORE));
    }
    qkv_args qa;
    qa.q = s.q, qa.k = s.k, qa.v = s.v;
    qa.bq = L.bq.f(), qa.bk = L.bk.f(), qa.bv = L.bv.f(), qa.q_norm = L.q_norm.f(), qa.k_norm = L.k_norm.f();
    qa.inv_freq = m->inv_freq, qa.mscale = m->rope_mscale;
    qa.pos = d_pos, qa.seq = d_seq, qa.block_tables = d_bt, qa.max_blocks = max_blocks;
    qa.n_head = d.n_head, qa.n_kv = d.n_head_kv, qa.hd = d.head_dim, qa.rope_dim = d.rope_dim;
    qa.rope_type = d.rope_type, qa.block_size = kv->block_size, qa.eps = d.norm_eps;
    qa.scale = 1.0f / sqrtf((float)d.head_dim);
    if (q8) {
        qa.kc = qa.vc = nullptr;
        qa.k8 = kv->k8 + (int64_t)il * kv->layer_elems, qa.v8 = kv->v8 + (int64_t)il * kv->layer_elems;
        qa.ks = kv->ks + (int64_t)il * (kv->layer_elems / 32), qa.vs = kv->vs + (int64_t)il * (kv->layer_elems / 32);
    } else {
        qa.kc = kv->k + (int64_t)il * kv->layer_elems, qa.vc = kv->v + (int64_t)il * kv->layer_elems;
    }
    if (kv->n_host > 0) { /* the host tier's arrays of this layer: physical blocks from n_dev on (kv_blk) */
        const int64_t he = (int64_t)il * kv->host_elems;
        qa.ht.n_dev = kv->n_dev;
        if (q8) {
            qa.ht.k8 = kv->hk8 + he, qa.ht.v8 = kv->hv8 + he;
            qa.ht.ks = kv->hks + he / 32, qa.ht.vs = kv->hvs + he / 32;
        } else {
            qa.ht.kc = kv->hk + he, qa.ht.vc = kv->hv + he;
        }
        if (kv->st_n > 0) { /* a staged step (step.cu): this layer's host blocks into their VRAM slots, read there */
            if (!m->ha.now) CHECK(kv_stage_layer(kv, il, 0, st)); /* kv_host_attn's: after k_to_host, below */
            unsigned char *sg = kv->stage;
            if (q8) {
                qa.ht.k8 = (int8_t *)(sg + kv->stage_off[0]), qa.ht.v8 = (int8_t *)(sg + kv->stage_off[1]);
                qa.ht.ks = (__half *)(sg + kv->stage_off[2]), qa.ht.vs = (__half *)(sg + kv->stage_off[3]);
            } else {
                qa.ht.kc = (__half *)(sg + kv->stage_off[0]), qa.ht.vc = (__half *)(sg + kv->stage_off[1]);
            }
        }
    }
    qa.kpart = qkv_parts ? g_kpart : nullptr, qa.kp_n = m->q_dim + 2 * m->kv_dim, qa.kp_t = T;
    if (!fuse) {
        launch_k(k_qkv_post, dim3((unsigned)T, (unsigned)((d.n_head + 2 * d.n_head_kv + QKV_WARPS - 1) / QKV_WARPS)),
                 QKV_WARPS * 32, 0, st, qa);
        LAUNCHED("qkv");
    }
    const bool hx = m->ha.now; /* kv_host_attn (host_sync.cu): the CPU attends the host-tier blocks */
    if (hx) { /* the device's share of the host blocks staged (kv_stream 0) while the CPU attends its own */
        CHECK(host_attn_send(m, il, T, st));
        CHECK(host_attn_mark(m, il, 0, st));
        CHECK(kv_stage_layer(kv, il, 0, st));
    }
    /* the output projection's 8-bit input comes out of the attention kernel itself */
    const bool oq = stg_reads_q32(L.wo.type);
    const bool fused_q = oq && d.head_dim % 32 == 0;
    attn_args aa = {};
    aa.q = s.q, aa.out = s.att, aa.kc = qa.kc, aa.vc = qa.vc, aa.pos = d_pos, aa.seq = d_seq, aa.block_tables = d_bt;
    aa.max_blocks = max_blocks, aa.n_head = d.n_head, aa.n_kv = d.n_head_kv, aa.hd = d.head_dim;
    aa.block_size = kv->block_size;
    aa.k8 = qa.k8, aa.v8 = qa.v8, aa.ks = qa.ks, aa.vs = qa.vs, aa.ht = qa.ht;
    aa.aq = fused_q ? s.aq : nullptr, aa.ad = s.ad, aa.as = s.as;
    aa.fused = fuse ? 1 : 0, aa.qa = qa;
    aa.sinks = L.sinks.d ? L.sinks.f() : nullptr, aa.n_swa = oss_window(d, il); /* gpt-oss (step.cu: k_attention) */
    aa.pre = fuse ? 1 : 0;
    if (il + 1 < kv->n_layer && !q8) /* the fused head prep's warp 3 prefetches the next layer's K / V into L2 */
        aa.kc_next = kv->k + (int64_t)(il + 1) * kv->layer_elems, aa.vc_next = kv->v + (int64_t)(il + 1) * kv->layer_elems;
    if (att_split > 1 || (q8 && fuse_qkv)) {
        aa.part_acc = s.apart, aa.part_ml = s.aml;
        /* att_split_min 0 ("never split") keeps every sequence of the 8-bit cache in one split */
        aa.split_min = q8 && g_set.att_split_min < 1 ? INT32_MAX : g_set.att_split_min;
        aa.split_chunks = ATT_SPLIT_CHUNKS, aa.split_max = hx ? m->ha.zmax : m->att_zmax;
        if (hx) { /* the device's VRAM blocks (compacted tables, key counts as positions), then the CPU's split */
            aa.pos = m->ha.d_pos, aa.block_tables = m->ha.d_bt, aa.split_x = 1;
            CHECK(launch_attention_split(aa, T, att_split, m->smem_optin, st, false));
            CHECK(host_attn_mark(m, il, 1, st));
            CHECK(host_attn_join(m, il, aa, T, st));
            CHECK(launch_attention_combine(aa, T, st));
        } else {
            CHECK(launch_attention_split(aa, T, att_split, m->smem_optin, st));
        }
    } else if ((n_tiles > 0 || g_att_mma_tiles > 0) && !fuse_qkv) {
        aa.stages = 2;
        if (n_tiles > 0) CHECK(launch_attention_tile(aa, d_tiles, n_tiles, st));
        if (g_att_mma_tiles > 0)
            CHECK(launch_attention_mma(aa, d_tiles + n_tiles, g_att_mma_tiles, g_att_mma_mode, m->smem_optin, st));
    } else if (q8) {
        return fail(ST_EUNSUPPORTED, "attention (8-bit KV): a step with neither the split kernel nor prefill tiles");
    } else {
        CHECK(launch_attention(aa, T, st));
    }
    CHECK(kv_stage_layer(kv, il, 1, st)); /* a staged step: the slots it wrote back to their host blocks */
    stg_status rc = ST_OK;
    const acts_d ain = fused_q ? acts_d{s.aq, s.ad, s.as, s.att} : layer_acts(m, s.att, T, m->q_dim, oq, &rc);
    CHECK(rc);
    if (L.bo.d) return oss_out_proj(m, L, T, ain); /* gpt-oss: x += (wo . att + bo) */
    /* the FFN block's RMSNorm (next on the stream) adds the parts to the residual (take_combine) */
    g_defer_combine = !m->pending.pair_out && !m->pending.kpart, g_deferred = false;
    const stg_status lrc = linear(st, L.wo, nullptr, g, 1, T, T, ain, s.x, E, MODE_ADD);
    g_defer_combine = false;
    if (g_deferred) m->pending.kpart = g_kpart, m->pending.kp_t = T;
    return lrc;
}

/* Dense FFN (or a shared expert) over all T tokens of xn (quantised in aq by the norm):
 * result into out[T, E] (pair_out, or a hybrid layer's shared-expert rows). */
static stg_status dense_ffn(stg_model *m, int32_t T, const dtensor &Wg, const dtensor &Wu, const dtensor &Wd,
                            float *out) {
    scratch &s = m->s;
    cudaStream_t st = m->stream;
    const int64_t E = m->d.n_embd, F = Wg.ne[1];
    const acts_d in{s.aq, s.ad, s.as, s.xn};
    (void)E;
    lin_groups g = {};
    g.n_pairs = T;
    bool fused = false;
    const fused_quant fq{s.hq, s.hd, s.hs, &fused};
    CHECK(swiglu(st, Wg, Wu, g, 1, T, T, in, s.h, F, s.h2, T, stg_is_float(Wd.type) ? nullptr : &fq));
    if (stg_reads_q32(Wd.type) && !fused) CHECK(quantize(st, s.h, T, F, s.hq, s.hd, s.hs));
    return linear(st, Wd, nullptr, g, 1, T, T, acts_d{s.hq, s.hd, s.hs, s.h}, out, E, MODE_STORE);
}

/* The routed experts of a step that takes the GEMM (gemm_min_tokens) split by size: groups of at most
 * routed_mv_max pairs run on the matvec, the rest on the GEMM, both launched, the split made on the device by
 * the grouping (group_out). Why: with a load-balanced router most of a decode batch's experts hold one or two
 * pairs, which the GEMM pads to a tile of MM_BN and reads at a fraction of the matvec's bandwidth, while a
 * skewed router's busy experts want the GEMM. The two shares run side by side (two streams, two branches
 * of the step's graph), so each hides the other's latency. Both kernels give the same bits, so the split
 * changes no result. The branch itself costs about 10 us a layer (two more launches and the join, which ends
 * the next kernel's early launch), so a layer keeps it only while its recent steps of this size had enough
 * small experts (routed_mv_groups, decided on the host from the step's histogram: mv_update). 0: no split
 * (no GEMM this step, the prefill form, float or mixed-type experts, or the layer's decision). */
static int routed_mv_max(const stg_model *m, int il, int32_t T) {
    const dlayer &L = m->L[(size_t)il];
    const int min_tok = g_set.gemm_min_tokens;
    const int t = L.gate_exps.type;
    if (g_set.routed_mv_max <= 0 || min_tok <= 0 || T < min_tok || g_gemm_fast) return 0;
    if (m->mv_step && !m->mv_step[il]) return 0; /* the layer's recent steps had too few small experts */
    if (t != L.up_exps.type || (t != STG_Q4_K && t != STG_Q8_0) || stg_is_float(L.down_exps.type)) return 0;
    if (L.gate_exps.ne[1] % 32) return 0; /* the matvec share quantises its output in-block (k_linear_q_chunk) */
    return g_set.routed_mv_max;
}

/* The routed experts of a layer over the grouping's pairs (s.gexp ...: experts, or a hybrid layer's slots):
 * pair_out rows of every grouped pair. */
static stg_status routed_experts(stg_model *m, const dlayer &L, int32_t T, int mv_max) {
    scratch &s = m->s;
    cudaStream_t st = m->stream;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    const int32_t P = T * k;
    const int64_t E = m->d.n_embd;
    const acts_d rin{s.aq, s.ad, s.as, s.xn, T};
    /* gate+up over every (token, expert) pair, grouped by expert: one launch (the GEMM's groups), and with
     * mv_max a second one, the matvec of the groups of at most mv_max pairs (routed_mv_max) */
    lin_groups ge = {};
    ge.gexp = s.gexp, ge.gstart = s.gstart, ge.gcount = s.gcount, ge.n_groups = s.n_groups;
    ge.list = s.list, ge.in_map = s.pair_tok;
    ge.n_pairs = P, ge.tiles = s.gtiles, ge.n_tiles = s.n_gtiles;
    ge.pair_mv = mv_max ? s.pair_mv : nullptr;
    lin_groups gm = ge;
    gm.gexp = s.mexp, gm.gstart = s.mstart, gm.gcount = s.mcount, gm.n_groups = s.n_mgroups;
    gm.tiles = gm.n_tiles = gm.pair_mv = nullptr;
    const int max_groups = std::min(ne, P), expected = (P + ne - 1) / ne;
    const int64_t F = m->n_ff_exp;
    const acts_d ein = rin;
    const bool down_q = !stg_is_float(L.down_exps.type);
    /* the down projection's input: with mv_max each stream makes the per-256 view (a per-256 type) of its own
     * pairs' rows of h only (pair_mv 1: the matvec share's), the other stream still writing the rest */
    const acts_d hin{s.hq, s.hd, s.hs, s.h, P, mv_max ? s.pair_mv : nullptr, 1};
    const acts_d hin_mv{s.hq, s.hd, s.hs, s.h, P, s.pair_mv, 0};
    lin_groups gd = ge, gdm = gm;
    gd.in_map = gdm.in_map = nullptr; /* down reads the pair's own hidden row */
    if (mv_max) { /* the matvec share on the side stream, beside the GEMM's: disjoint rows of h, hq, pair_out */
        CU(cudaEventRecord(m->fork, st), "experts: fork");
        CU(cudaStreamWaitEvent(m->side, m->fork, 0), "experts: fork");
        bool fused_mv = false;
        const fused_quant fq_mv{s.hq, s.hd, s.hs, &fused_mv};
        CHECK(swiglu(m->side, L.gate_exps, L.up_exps, gm, max_groups, 1, T, ein, s.h, F, s.h2, P, &fq_mv,
                     STG_PATH_MATVEC));
        if (!fused_mv) return fail(ST_EINVAL, "experts: the matvec share did not quantise its output");
        CHECK(linear(m->side, L.down_exps, nullptr, gdm, max_groups, 1, T, hin_mv, s.pair_out, E, MODE_STORE,
                     STG_PATH_MATVEC));
        CU(cudaEventRecord(m->join, m->side), "experts: join");
    }
    bool fused = false;
    const fused_quant fq{s.hq, s.hd, s.hs, &fused};
    CHECK(swiglu(st, L.gate_exps, L.up_exps, ge, max_groups, expected, T, ein, s.h, F, s.h2, P, down_q ? &fq : nullptr));
    if (stg_reads_q32(L.down_exps.type) && !fused) CHECK(quantize(st, s.h, P, F, s.hq, s.hd, s.hs, ge.pair_mv));
    CHECK(linear(st, L.down_exps, nullptr, gd, max_groups, expected, T, hin, s.pair_out, E, MODE_STORE));
    if (mv_max) CU(cudaStreamWaitEvent(st, m->join, 0), "experts: join");
    return ST_OK;
}

/* The shared expert of a layer: its gate into s.gsh, its FFN of xn into out[T, E]. */
static stg_status shared_expert(stg_model *m, const dlayer &L, int32_t T, float *out) {
    scratch &s = m->s;
    launch_k(k_shexp_gate, (T + 3) / 4, 128, 0, m->stream, s.xn, L.gate_inp_shexp.d ? L.gate_inp_shexp.f() : nullptr,
             T, m->d.n_embd, s.gsh);
    LAUNCHED("shared expert gate");
    return dense_ffn(m, T, L.gate_shexp, L.up_shexp, L.down_shexp, out);
}

static stg_status ffn_block(stg_model *m, int il, int32_t T) {
    const dlayer &L = m->L[(size_t)il];
    scratch &s = m->s;
    const st_model_desc &d = m->d;
    cudaStream_t st = m->stream;
    const int64_t E = d.n_embd;
    /* xn quantised once for every quantised weight that reads it (router, experts, shared, dense) */
    const bool nq = !stg_is_float(L.ffn_gate.d ? L.ffn_gate.type : L.gate_exps.type) ||
                    (L.gate_inp.d && !stg_is_float(L.gate_inp.type)) || (L.gate_shexp.d && !stg_is_float(L.gate_shexp.type));
    launch_k(k_rmsnorm, T, RMS_THREADS, 0, st, s.x, nullptr, L.ffn_norm.f(), s.xn, E, d.norm_eps, nq ? s.aq : nullptr, s.ad, s.as,
                                  take_combine(m));
    LAUNCHED("rmsnorm");
    if (d.arch == ST_ARCH_GPT_OSS) return oss_ffn(m, il, T); /* gptoss.cu */
    if (d.n_expert == 0 || il < d.n_dense_lead) { /* dense FFN (a dense model, a leading dense layer): x += ffn(xn) */
        CHECK(dense_ffn(m, T, L.ffn_gate, L.ffn_up, L.ffn_down, s.pair_out));
        launch_k(k_add_scaled, (unsigned)((T * E + 255) / 256), 256, 0, st, s.x, s.pair_out, nullptr, T, E);
        LAUNCHED("residual");
        return ST_OK;
    }
    const int ne = d.n_expert, k = d.n_expert_used;
    const acts_d rin{s.aq, s.ad, s.as, s.xn, T};
    lin_groups g1 = {};
    g1.n_pairs = T;
    const int32_t P = T * k;
    const int mv_max = routed_mv_max(m, il, T);
    const group_out go = {s.gexp, s.gstart, s.gcount, s.n_groups, s.list, s.pair_tok, m->hist + (int64_t)il * ne,
                          s.gtiles, s.n_gtiles, s.mexp, s.mstart, s.mcount, s.n_mgroups, s.pair_mv, mv_max};
    const size_t rr_smem = (size_t)(LIN_WARPS + 2 + T) * ne * sizeof(float);
    if (rule_routing(m, L)) { /* sigmoid gating, a score-correction bias or expert groups (router_sigmoid.cu) */
        CHECK(route_by_rule(m, L, T, go));
    } else if (T <= 8 && stg_is_float(L.gate_inp.type) && ne <= 1024 && rr_smem <= 48 * 1024) {
        /* decode: router logits, routing and grouping in one launch */
        lin_args a = {};
        a.w = L.gate_inp.d, a.row_bytes = L.gate_inp.row_bytes, a.expert_stride = L.gate_inp.expert_stride;
        a.N = ne, a.K = (int32_t)L.gate_inp.ne[0], a.g = g1, a.x = s.xn, a.out = s.router, a.ldo = ne;
        a.mode = MODE_STORE;
        route_args ra = {m->route_counter, T, ne, k, s.topk_id, s.topk_w, go, 0};
        int nt = 1;
        while (nt < T) nt *= 2;
        ra.pre = nt > 2 ? 0 : a.K <= ROUTER_PRE * LIN_WARPS * WARP ? 1 : a.K <= ROUTER_PRE_WIDE * LIN_WARPS * WARP ? 2 : 0;
        switch (L.gate_inp.type) {
#define CASE_RR(TY)                                                                                   \
    case TY:                                                                                          \
        if (nt == 8) launch_k(k_router_route<TY, 8>, ne, LIN_WARPS * 32, rr_smem, st, a, ra);          \
        else if (nt == 4) launch_k(k_router_route<TY, 4>, ne, LIN_WARPS * 32, rr_smem, st, a, ra);     \
        else if (nt == 2) launch_k(k_router_route<TY, 2>, ne, LIN_WARPS * 32, rr_smem, st, a, ra);     \
        else launch_k(k_router_route<TY, 1>, ne, LIN_WARPS * 32, rr_smem, st, a, ra);                  \
        break;
            FLOAT_CASES(CASE_RR)
#undef CASE_RR
        }
        LAUNCHED("router + route");
    } else {
    CHECK(linear(st, L.gate_inp, nullptr, g1, 1, T, T, rin, s.router, ne, MODE_STORE));
    const size_t route_smem = (size_t)ROUTE_WARPS * ne * sizeof(float) + 2 * (size_t)ne * sizeof(int32_t);
    if (T <= 2 * ROUTE_WARPS && route_smem <= 48 * 1024) { /* small steps: one launch for both */
        launch_k(k_route, 1, ROUTE_WARPS * 32, route_smem, st, s.router, T, ne, k, s.topk_id, s.topk_w, go);
        LAUNCHED("route");
    } else {
        launch_k(k_router, (T + ROUTER_WARPS - 1) / ROUTER_WARPS, ROUTER_WARPS * 32, ROUTER_WARPS * ne * sizeof(float), st, 
            s.router, T, ne, k, s.topk_id, s.topk_w, 0);
        LAUNCHED("router");
        launch_k(k_group, 1, 1024, 2 * ne * sizeof(int32_t), st, s.topk_id, P, k, ne, go, 0);
        LAUNCHED("group");
    }
    }
    /* with experts off the device (hybrid.cu): xn and the routing to the host, the resident pairs regrouped by
     * slot; the shared expert (into its own rows) and the resident experts run while the host computes the
     * others, whose rows land in pair_out next. The additions to x keep their order: experts, then shared. */
    const bool cpu_share = hybrid_layer(m, il);
    const bool shexp = L.gate_shexp.d != nullptr;
    float *shx = cpu_share ? m->hy.d_shx : s.pair_out;
    if (cpu_share) CHECK(hybrid_send(m, il, T, mv_max));
    if (cpu_share && shexp) CHECK(shared_expert(m, L, T, shx));
    if (staged_layer(m, il)) { /* every expert from the staging ring's slot (staging.cu), no CPU share */
        dlayer Ls;
        CHECK(staging_queue(m, il, &Ls));
        CHECK(routed_experts(m, Ls, T, mv_max));
        CHECK(staging_release(m));
    } else if (!cpu_share || m->hy.n_slots[(size_t)il] > 0) {
        CHECK(routed_experts(m, L, T, mv_max));
    }
    if (cpu_share) CHECK(hybrid_receive(m, il, T));
    if (!shexp) { /* added by the next RMSNorm (this order of additions is the CPU's) */
        m->pending = combine_args{s.pair_out, s.topk_w, k, d.expert_norm, nullptr, 0, route_scale(d)};
        return ST_OK;
    }
    launch_k(k_combine, (unsigned)((T * E + 255) / 256), 256, 0, st, s.x, s.pair_out, s.topk_w, T, k, E, d.expert_norm,
             route_scale(d));
    LAUNCHED("combine");
    if (!cpu_share) CHECK(shared_expert(m, L, T, shx));
    launch_k(k_add_scaled, (unsigned)((T * E + 255) / 256), 256, 0, st, s.x, (const float *)shx, s.gsh, T, E);
    LAUNCHED("shared expert add");
    return ST_OK;
}
