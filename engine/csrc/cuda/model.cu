/* Model upload and memory: devices, settings, shape checks, the weight arena, the KV cache, the step's
 * scratch and pinned host memory. */
#include "model.cuh"
#include "../rope_table.h" /* the rope table, model.c's own */

/* ------------------------------------------------------------------ devices */

extern "C" int32_t stg_device_count(void) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorNoDevice) {
        fail(ST_EUNSUPPORTED, "no CUDA device is visible (CUDA_VISIBLE_DEVICES=%s)",
             getenv("CUDA_VISIBLE_DEVICES") ? getenv("CUDA_VISIBLE_DEVICES") : "<unset>");
        return 0;
    }
    if (e != cudaSuccess) {
        fail(ST_EUNSUPPORTED, "no usable NVIDIA driver: %s (CUDA error %d)", cudaGetErrorString(e), (int)e);
        return -1;
    }
    return n;
}

extern "C" stg_status stg_device_info(int32_t device, char *name, int32_t name_len, int64_t *total_mem,
                                      int64_t *free_mem, int32_t *cc_major, int32_t *cc_minor) {
    const int n = stg_device_count();
    if (n < 0) return ST_EUNSUPPORTED;
    if (device < 0 || device >= n) return fail(ST_ERANGE, "CUDA device %d does not exist (%d visible)", device, n);
    cudaDeviceProp p;
    CU(cudaGetDeviceProperties(&p, device), "device_info");
    if (name && name_len > 0) snprintf(name, (size_t)name_len, "%s", p.name);
    if (cc_major) *cc_major = p.major;
    if (cc_minor) *cc_minor = p.minor;
    CU(cudaSetDevice(device), "device_info");
    size_t fr = 0, tot = 0;
    CU(cudaMemGetInfo(&fr, &tot), "device_info");
    if (total_mem) *total_mem = (int64_t)tot;
    if (free_mem) *free_mem = (int64_t)fr;
    return ST_OK;
}

/* ------------------------------------------------------------------ settings */

extern "C" void stg_settings_default(stg_settings *s) {
    if (!s) return;
    s->graphs = 1;
    s->pdl = 1;
    s->layer_events = -1;
    s->gemm_min = 2;
    s->gemm_min_tokens = 8;
    s->gemm_dense_min = 32;
    s->gemm_wide_min = 256;
    s->dense_split = 16;
    s->routed_split_max = 16;
    s->routed_mv_max = 4;
    s->routed_mv_groups = 8;
    s->gemm_fast_min = 64;
    s->att_mma = 2;
    s->att_mma_min = 64;
    s->att_split_min = 512;
    s->hybrid_overlap = 1;
    s->hybrid_stage = 64; /* gpu_settings.HYBRID_STAGE_DEFAULT */
    s->kv_stream = -1;
    s->kv_host_attn = 0;
    s->kv_host_share = -1;
    s->hybrid_stage_skip = 50; /* gpu_settings' table: expected hits >= 0.05 */
}

static stg_status check_settings(const stg_settings *s) {
#define RANGE(f, lo, hi)                                                                                   \
    if (s->f < (lo) || s->f > (hi))                                                                        \
        return fail(ST_EINVAL, "settings: " #f " = %d outside [%d, %d]", (int)s->f, (int)(lo), (int)(hi));
    RANGE(graphs, 0, 1)
    RANGE(pdl, 0, 1)
    RANGE(layer_events, -1, 1)
    RANGE(gemm_min, 1, INT32_MAX)
    RANGE(gemm_min_tokens, 0, 24)
    RANGE(gemm_dense_min, 1, INT32_MAX)
    RANGE(gemm_wide_min, 1, INT32_MAX)
    RANGE(dense_split, 0, INT32_MAX)
    RANGE(routed_split_max, 0, 64)
    RANGE(routed_mv_max, 0, 64)
    RANGE(routed_mv_groups, 0, 1024)
    RANGE(gemm_fast_min, 0, INT32_MAX)
    RANGE(att_mma, 0, 2)
    RANGE(att_mma_min, 1, INT32_MAX)
    RANGE(att_split_min, 0, INT32_MAX)
    RANGE(hybrid_overlap, 0, 1)
    RANGE(hybrid_stage, 0, INT32_MAX)
    RANGE(kv_stream, -1, 1)
    RANGE(kv_host_attn, 0, 1)
    RANGE(kv_host_share, -1, 100)
    RANGE(hybrid_stage_skip, 0, 1000000)
#undef RANGE
    if (s->gemm_min_tokens % 8 || s->routed_split_max % 8)
        return fail(ST_EINVAL, "settings: gemm_min_tokens (%d) and routed_split_max (%d) must be multiples of 8",
                    (int)s->gemm_min_tokens, (int)s->routed_split_max);
    return ST_OK;
}

static int64_t tensor_bytes(const st_tensor &t) {
    const int be = stg_block_elems(t.type);
    if (!be) return -1;
    int64_t rows = 1;
    for (int i = 1; i < 4; i++) rows *= t.ne[i] > 0 ? t.ne[i] : 1;
    return stg_row_bytes(t.type, t.ne[0]) * rows;
}

/* Shape checks: what the kernels rely on (forward.c's validate is the full check and runs
 * first from Python; these keep the C API safe on its own). */
static stg_status check_t(const st_tensor &t, const char *what, int layer, bool required, int64_t ne0, int64_t ne1,
                          int64_t ne2, bool f32_only) {
    if (!t.data) return required ? fail(ST_EINVAL, "layer %d: tensor %s is missing", layer, what) : ST_OK;
    if (!stg_block_elems(t.type))
        return fail(ST_EUNSUPPORTED, "layer %d: tensor %s has unsupported quant type %d", layer, what, t.type);
    if (f32_only && t.type != STG_F32)
        return fail(ST_EUNSUPPORTED, "layer %d: tensor %s must be F32 (got type %d)", layer, what, t.type);
    const int64_t want[3] = {ne0, ne1, ne2};
    for (int i = 0; i < 3; i++)
        if (t.ne[i] != want[i])
            return fail(ST_EINVAL, "layer %d: tensor %s has ne[%d]=%lld, expected %lld", layer, what, i,
                        (long long)t.ne[i], (long long)want[i]);
    if (t.ne[3] != 1) return fail(ST_EINVAL, "layer %d: tensor %s has a 4th dimension", layer, what);
    if (!stg_is_float(t.type) && t.ne[0] % 32)
        return fail(ST_EINVAL, "layer %d: tensor %s row length %lld is not a multiple of its block", layer, what,
                    (long long)t.ne[0]);
    if (t.ne[0] % stg_block_elems(t.type))
        return fail(ST_EINVAL, "layer %d: tensor %s row length %lld is not a multiple of its block size", layer,
                    what, (long long)t.ne[0]);
    return ST_OK;
}

static stg_status validate(stg_model *m, const st_layer *layers) {
    const st_model_desc *d = &m->d;
    if (d->n_layer < 1 || d->n_embd < 32 || d->n_head < 1 || d->n_head_kv < 1 || d->n_vocab < 1 ||
        d->n_head % d->n_head_kv)
        return fail(ST_EINVAL, "model: bad hyper-parameters (layers=%d embd=%d heads=%d/%d vocab=%d)", d->n_layer,
                    d->n_embd, d->n_head, d->n_head_kv, d->n_vocab);
    if (d->head_dim < 16 || d->head_dim % 16 || d->head_dim > 256)
        return fail(ST_EUNSUPPORTED, "model: head_dim %d unsupported on the GPU (a multiple of 16, at most 256)",
                    d->head_dim);
    if (d->rope_dim < 2 || d->rope_dim > d->head_dim || d->rope_dim % 2 ||
        (d->rope_type != ST_ROPE_NORM && d->rope_type != ST_ROPE_NEOX))
        return fail(ST_EINVAL, "model: rope dimension %d / type %d invalid", d->rope_dim, d->rope_type);
    if (!std::isfinite(d->rope_base) || d->rope_base <= 0.0f)
        return fail(ST_EINVAL, "model: rope base %g invalid", (double)d->rope_base);
    { /* rope scaling: the ranges model.c accepts (0 reads as 1 for freq_scale and attn_factor) */
        const float fs = d->rope_freq_scale, ext = d->rope_ext_factor, att = d->rope_attn_factor;
        if (!std::isfinite(fs) || fs < 0.0f || fs > 1e6f || !std::isfinite(ext) || ext < 0.0f || ext > 1e3f ||
            !std::isfinite(att) || att < 0.0f || att > 1e3f || !std::isfinite(d->rope_beta_fast) ||
            !std::isfinite(d->rope_beta_slow))
            return fail(ST_EINVAL, "model: rope scaling invalid (freq_scale %g, ext_factor %g, attn_factor %g, beta %g/%g)",
                        (double)fs, (double)ext, (double)att, (double)d->rope_beta_fast, (double)d->rope_beta_slow);
        if (ext != 0.0f && (d->rope_n_ctx_orig < 1 || d->rope_beta_fast <= 0.0f || d->rope_beta_slow <= 0.0f))
            return fail(ST_EINVAL, "model: YaRN needs an original context (%d) and positive betas (%g/%g)",
                        d->rope_n_ctx_orig, (double)d->rope_beta_fast, (double)d->rope_beta_slow);
    }
    if (d->n_expert < 0 || d->n_expert > 1024 || (d->n_expert > 0 && (d->n_expert_used < 1 || d->n_expert_used > d->n_expert)))
        return fail(ST_EINVAL, "model: expert_used_count %d invalid for expert_count %d", d->n_expert_used, d->n_expert);
    if (d->arch < ST_ARCH_LLAMA || d->arch > ST_ARCH_DEEPSEEK2) return fail(ST_EUNSUPPORTED, "model: arch %d", d->arch);
    if ((d->arch == ST_ARCH_DEEPSEEK2) != (d->kv_lora_rank > 0))
        return fail(ST_EINVAL, "model: latent attention (kv_lora_rank %d) is deepseek2's alone", d->kv_lora_rank);
    /* routing (moe.c's rules; router_sigmoid.cu runs them): softmax or sigmoid gating, expert groups */
    if (d->arch != ST_ARCH_GPT_OSS && (d->gating < 0 || d->gating > ST_GATING_SIGMOID)) /* gpt-oss: gptoss.cu */
        return fail(ST_EUNSUPPORTED, "model: gating function %d runs on the CPU only", d->gating);
    if (d->n_expert_group > 1 && (d->n_expert < 1 || d->n_expert % d->n_expert_group || d->n_group_used < 1 ||
                                  d->n_group_used > d->n_expert_group))
        return fail(ST_EINVAL, "model: %d expert groups with %d used invalid for %d experts", d->n_expert_group,
                    d->n_group_used, d->n_expert);
    if (!(d->expert_weights_scale >= 0.0f && d->expert_weights_scale < 1e6f))
        return fail(ST_EINVAL, "model: routed scaling factor %g invalid", (double)d->expert_weights_scale);
    if (d->n_dense_lead < 0 || d->n_dense_lead > d->n_layer)
        return fail(ST_EINVAL, "model: %d leading dense layers out of range [0, %d]", d->n_dense_lead, d->n_layer);
    const int64_t E = d->n_embd;
    CHECK(check_t(d->token_embd, "token_embd", -1, true, E, d->n_vocab, 1, false));
    CHECK(check_t(d->output_norm, "output_norm", -1, true, E, 1, 1, true));
    CHECK(check_t(d->output, "output", -1, true, E, d->n_vocab, 1, false));
    m->n_ff = m->n_ff_exp = m->n_ff_shexp = 0;
    for (int il = 0; il < d->n_layer; il++) {
        const st_layer &l = layers[il];
        CHECK(check_t(l.attn_norm, "attn_norm", il, true, E, 1, 1, true));
        CHECK(check_t(l.ffn_norm, "ffn_norm", il, true, E, 1, 1, true));
        if (d->kv_lora_rank == 0) { /* latent attention: its tensors are mla_validate's */
            CHECK(check_t(l.wq, "attn_q", il, true, E, m->q_dim, 1, false));
            CHECK(check_t(l.wk, "attn_k", il, true, E, m->kv_dim, 1, false));
            CHECK(check_t(l.wv, "attn_v", il, true, E, m->kv_dim, 1, false));
            CHECK(check_t(l.wo, "attn_output", il, true, m->q_dim, E, 1, false));
            CHECK(check_t(l.bq, "attn_q.bias", il, false, m->q_dim, 1, 1, true));
            CHECK(check_t(l.bk, "attn_k.bias", il, false, m->kv_dim, 1, 1, true));
            CHECK(check_t(l.bv, "attn_v.bias", il, false, m->kv_dim, 1, 1, true));
            CHECK(check_t(l.q_norm, "attn_q_norm", il, d->arch == ST_ARCH_QWEN3MOE, d->head_dim, 1, 1, true));
            CHECK(check_t(l.k_norm, "attn_k_norm", il, d->arch == ST_ARCH_QWEN3MOE || l.q_norm.data, d->head_dim, 1, 1, true));
        }
        const int first_moe = d->n_dense_lead; /* the first routed layer sets the expert widths */
        if (d->n_expert > 0 && il >= first_moe) {
            const int64_t ff = l.gate_exps.ne[1];
            if (il == first_moe) m->n_ff_exp = (int32_t)ff;
            CHECK(check_t(l.exp_probs_b, "exp_probs_b", il, false, d->n_expert, 1, 1, true));
            if (ff != m->n_ff_exp || ff < 1) return fail(ST_EINVAL, "layer %d: expert FFN width differs", il);
            CHECK(check_t(l.gate_inp, "ffn_gate_inp", il, true, E, d->n_expert, 1, false));
            CHECK(check_t(l.gate_exps, "ffn_gate_exps", il, true, E, ff, d->n_expert, false));
            CHECK(check_t(l.up_exps, "ffn_up_exps", il, true, E, ff, d->n_expert, false));
            CHECK(check_t(l.down_exps, "ffn_down_exps", il, true, ff, E, d->n_expert, false));
            if (l.gate_shexp.data) {
                const int64_t sf = l.gate_shexp.ne[1];
                if (il == first_moe) m->n_ff_shexp = (int32_t)sf;
                if (sf != m->n_ff_shexp || sf < 1) return fail(ST_EINVAL, "layer %d: shared expert width differs", il);
                CHECK(check_t(l.gate_shexp, "ffn_gate_shexp", il, true, E, sf, 1, false));
                CHECK(check_t(l.up_shexp, "ffn_up_shexp", il, true, E, sf, 1, false));
                CHECK(check_t(l.down_shexp, "ffn_down_shexp", il, true, sf, E, 1, false));
                CHECK(check_t(l.gate_inp_shexp, "ffn_gate_inp_shexp", il, false, E, 1, 1, true));
            } else if (m->n_ff_shexp) {
                return fail(ST_EINVAL, "layer %d: shared expert missing", il);
            }
        } else {
            const int64_t ff = l.ffn_gate.ne[1];
            if (il == 0) m->n_ff = (int32_t)ff;
            if (ff != m->n_ff || ff < 1) return fail(ST_EINVAL, "layer %d: FFN width differs", il);
            CHECK(check_t(l.ffn_gate, "ffn_gate", il, true, E, ff, 1, false));
            CHECK(check_t(l.ffn_up, "ffn_up", il, true, E, ff, 1, false));
            CHECK(check_t(l.ffn_down, "ffn_down", il, true, ff, E, 1, false));
        }
    }
    return ST_OK;
}


/* A device allocation recorded in `list` (freed with it). */
template <typename P> static stg_status dalloc_in(dlist &list, P **p, size_t n) {
    void *v = nullptr;
    const cudaError_t e = cudaMalloc(&v, n > 0 ? n : 1);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fail(ST_ENOMEM, "cannot allocate %zu bytes of GPU memory (%s)", n, cudaGetErrorString(e));
    }
    list.push_back(v);
    list.bytes += (int64_t)n;
    *p = (P *)v;
    return ST_OK;
}
template <typename P> static stg_status dalloc(stg_model *m, P **p, size_t n) { return dalloc_in(m->allocs, p, n); }

static void free_list(dlist &list) {
    for (void *p : list) cudaFree(p);
    list.clear();
    list.bytes = 0;
}

/* A layer some of whose routed experts stay on the host (hybrid placement). */
static bool partial_layer(const stg_model *m, int il) {
    return m->hy.on && il >= m->d.n_dense_lead && m->hy.n_slots[(size_t)il] < m->d.n_expert;
}

/* Every weight in one VRAM arena, each tensor 256-byte aligned; a host tensor shared by
 * two fields (tied output/embedding) is uploaded once. The routed tensors of a partial layer hold its
 * resident experts only, one after another in ascending expert id (slot i: the i-th resident). */
static stg_status upload(stg_model *m, const st_layer *layers) {
    std::vector<const st_tensor *> all = {&m->d.token_embd, &m->d.output_norm, &m->d.output};
    std::vector<dtensor *> dst = {&m->token_embd, &m->output_norm, &m->output};
    m->L.resize((size_t)m->d.n_layer);
    for (int il = 0; il < m->d.n_layer; il++) {
        const st_layer &s = layers[il];
        dlayer &l = m->L[(size_t)il];
        const st_tensor *src[] = {&s.attn_norm, &s.wq, &s.wk, &s.wv, &s.wo, &s.bq, &s.bk, &s.bv, &s.q_norm,
                                  &s.k_norm, &s.ffn_norm, &s.ffn_gate, &s.ffn_up, &s.ffn_down, &s.gate_inp,
                                  &s.gate_exps, &s.up_exps, &s.down_exps, &s.gate_inp_shexp, &s.gate_shexp,
                                  &s.up_shexp, &s.down_shexp, &s.bo, &s.sinks, &s.gate_inp_b, &s.gate_exps_b,
                                  &s.up_exps_b, &s.down_exps_b, &s.exp_probs_b, &s.wq_a, &s.q_a_norm, &s.wq_b,
                                  &s.wkv_a, &s.kv_a_norm, &s.wkv_b, &s.wk_b, &s.wv_b};
        dtensor *dd[] = {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.bq, &l.bk, &l.bv, &l.q_norm,
                         &l.k_norm, &l.ffn_norm, &l.ffn_gate, &l.ffn_up, &l.ffn_down, &l.gate_inp,
                         &l.gate_exps, &l.up_exps, &l.down_exps, &l.gate_inp_shexp, &l.gate_shexp,
                         &l.up_shexp, &l.down_shexp, &l.bo, &l.sinks, &l.gate_inp_b, &l.gate_exps_b,
                         &l.up_exps_b, &l.down_exps_b, &l.exp_probs_b, &l.wq_a, &l.q_a_norm, &l.wq_b,
                         &l.wkv_a, &l.kv_a_norm, &l.wkv_b, &l.wk_b, &l.wv_b};
        for (size_t i = 0; i < sizeof src / sizeof src[0]; i++) {
            if (partial_layer(m, il) && (dd[i] == &l.gate_exps || dd[i] == &l.up_exps || dd[i] == &l.down_exps))
                continue; /* below */
            all.push_back(src[i]), dst.push_back(dd[i]);
        }
    }
    std::map<const void *, int64_t> offset; /* host pointer -> arena offset */
    int64_t total = 0;
    for (const st_tensor *t : all) {
        if (!t->data || offset.count(t->data)) continue;
        offset[t->data] = total;
        total += (tensor_bytes(*t) + 255) / 256 * 256;
    }
    struct slotted {
        const st_tensor *t;
        dtensor *o;
        int il;
        int64_t off;
    };
    std::vector<slotted> parts; /* the routed tensors of partial layers */
    for (int il = 0; il < m->d.n_layer; il++) {
        if (!partial_layer(m, il)) continue;
        const st_layer &s = layers[il];
        dlayer &l = m->L[(size_t)il];
        const st_tensor *src[] = {&s.gate_exps, &s.up_exps, &s.down_exps};
        dtensor *dd[] = {&l.gate_exps, &l.up_exps, &l.down_exps};
        for (int i = 0; i < 3; i++) {
            m->hy.host[(size_t)il * 3 + i] = (const uint8_t *)src[i]->data; /* staging, re-placement */
            parts.push_back(slotted{src[i], dd[i], il, total});
            total += (tensor_bytes(*src[i]) / m->d.n_expert * m->hy.n_slots[(size_t)il] + 255) / 256 * 256;
        }
    }
    CHECK(dalloc(m, &m->arena, (size_t)(total + STG_WEIGHT_TAIL)));
    m->arena_bytes = total;
    for (const slotted &p : parts) {
        const st_tensor *t = p.t;
        dtensor *o = p.o;
        const int32_t n_slots = m->hy.n_slots[(size_t)p.il];
        if (t->n_bytes != tensor_bytes(*t))
            return fail(ST_EINVAL, "tensor of type %d holds %lld bytes, its shape needs %lld", t->type,
                        (long long)t->n_bytes, (long long)tensor_bytes(*t));
        o->d = n_slots > 0 ? m->arena + p.off : nullptr; /* no resident expert: the layer launches no expert kernel */
        o->type = t->type;
        for (int k = 0; k < 4; k++) o->ne[k] = t->ne[k] > 0 ? t->ne[k] : 1;
        o->ne[2] = n_slots;
        o->row_bytes = stg_row_bytes(t->type, t->ne[0]);
        o->expert_stride = o->row_bytes * o->ne[1];
        const uint8_t *host = (const uint8_t *)t->data;
        const uint8_t *mask = m->hy.resident.data() + (size_t)p.il * m->d.n_expert;
        for (int e = 0, slot = 0; e < m->d.n_expert; e++)
            if (mask[e]) {
                CU(cudaMemcpy((void *)(o->d + slot * o->expert_stride), host + e * o->expert_stride,
                              (size_t)o->expert_stride, cudaMemcpyHostToDevice),
                   "upload resident experts");
                slot++;
            }
    }
    std::map<const void *, bool> done;
    for (size_t i = 0; i < all.size(); i++) {
        const st_tensor *t = all[i];
        if (!t->data) continue;
        dtensor *o = dst[i];
        o->d = m->arena + offset[t->data];
        o->type = t->type;
        for (int k = 0; k < 4; k++) o->ne[k] = t->ne[k] > 0 ? t->ne[k] : 1;
        o->row_bytes = stg_row_bytes(t->type, t->ne[0]);
        o->expert_stride = o->row_bytes * o->ne[1];
        if (t->n_bytes != tensor_bytes(*t))
            return fail(ST_EINVAL, "tensor of type %d holds %lld bytes, its shape needs %lld", t->type,
                        (long long)t->n_bytes, (long long)tensor_bytes(*t));
        if (done[t->data]) continue;
        done[t->data] = true;
        CU(cudaMemcpy((void *)o->d, t->data, (size_t)tensor_bytes(*t), cudaMemcpyHostToDevice), "upload weights");
    }
    return ST_OK;
}

extern "C" void stg_model_destroy(stg_model *m) {
    if (!m) return;
    cudaSetDevice(m->device);
    if (m->stream) cudaStreamSynchronize(m->stream);
    drop_graphs(m);
    staging_destroy(m);
    free_list(m->s.step_allocs);
    free_list(m->s.ints_allocs);
    free_list(m->s.part_allocs);
    for (void *p : m->allocs) cudaFree(p);
    if (m->s.h_ints) cudaFreeHost(m->s.h_ints);
    for (void *p : m->hy.pinned) cudaFreeHost(p);
    host_sync_free(m->hy.sync);
    host_attn_destroy(m);
    for (inflight &f : m->fl) {
        if (f.h_picks) cudaFreeHost(f.h_picks);
        if (f.h_hist) cudaFreeHost(f.h_hist);
        if (f.e0) cudaEventDestroy(f.e0);
        if (f.e1) cudaEventDestroy(f.e1);
        for (std::vector<cudaEvent_t> *v : {&f.hy.s0, &f.hy.s1, &f.hy.a, &f.hy.b, &f.hy.c})
            for (cudaEvent_t e : *v) cudaEventDestroy(e);
        if (f.hy.ts) cudaFreeHost(f.hy.ts);
    }
    for (cudaEvent_t e : m->ev) cudaEventDestroy(e);
    if (m->fork) cudaEventDestroy(m->fork);
    if (m->join) cudaEventDestroy(m->join);
    if (m->side) cudaStreamDestroy(m->side);
    if (m->stream) cudaStreamDestroy(m->stream);
    delete m;
}

extern "C" stg_status stg_model_create_hybrid(int32_t device, const void *vdesc, const stg_settings *settings,
                                              const uint8_t *resident, const stg_cpu_experts *cpu, stg_model **out) {
    const st_model_desc *desc = (const st_model_desc *)vdesc;
    if (!desc || !out || !desc->layers) return fail(ST_EINVAL, "model_create: NULL argument");
    *out = nullptr;
    stg_settings set;
    stg_settings_default(&set);
    if (settings) {
        CHECK(check_settings(settings));
        set = *settings;
    }
    const int n = stg_device_count();
    if (n < 0) return ST_EUNSUPPORTED;
    if (device < 0 || device >= n) return fail(ST_ERANGE, "CUDA device %d does not exist (%d visible)", device, n);
    CU(cudaSetDevice(device), "model_create");
    stg_model *m = new stg_model();
    m->device = device;
    m->set = set;
    cudaDeviceGetAttribute(&m->cc_major, cudaDevAttrComputeCapabilityMajor, device);
    m->smem_optin = device_smem_optin(device);
    int n_sm = 0;
    cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, device);
    m->d = *desc;
    m->d.layers = nullptr;
    m->q_dim = desc->n_head * desc->head_dim;
    m->kv_dim = desc->n_head_kv * desc->head_dim;
    if (desc->kv_lora_rank > 0) { /* latent attention: model.cuh's q_dim / kv_dim */
        const int32_t ck = desc->kv_lora_rank + desc->rope_dim;
        m->q_dim = desc->n_head * std::max({ck, desc->head_dim, desc->head_dim_v});
        m->kv_dim = ck;
    }
    stg_status rc = validate(m, desc->layers);
    if (rc == ST_OK) rc = oss_validate(m, desc->layers);
    if (rc == ST_OK && desc->kv_lora_rank > 0) rc = mla_validate(m, desc->layers);
    if (rc == ST_OK) m->att_zmax = att_split_zmax(n_sm, desc->n_head_kv);
    if (rc == ST_OK) rc = hybrid_setup(m, resident, cpu);
    if (rc == ST_OK && m->hy.on && desc->arch == ST_ARCH_GPT_OSS)
        rc = fail(ST_EUNSUPPORTED, "model_create: gpt-oss with experts left on the CPU (hybrid placement) is not "
                                   "supported on the GPU; place every expert on the device");
    if (rc == ST_OK && m->hy.on && desc->arch == ST_ARCH_DEEPSEEK2)
        rc = fail(ST_EUNSUPPORTED, "model_create: deepseek2 with experts left on the CPU (hybrid placement) is not "
                                   "supported on the GPU yet; place every expert on the device");
    if (rc == ST_OK) rc = upload(m, desc->layers);
    if (rc == ST_OK && desc->kv_lora_rank > 0) rc = mla_prepare(m);
    if (rc == ST_OK) {
        m->max_k = std::max({m->d.n_embd, m->q_dim, m->n_ff, m->n_ff_shexp, m->d.q_lora_rank});
        m->ff_max = std::max({m->n_ff, m->n_ff_exp, m->n_ff_shexp});
        std::vector<float> inv(m->d.rope_dim / 2);
        rope_table(&m->d, inv.data(), &m->rope_mscale);
        rc = dalloc(m, &m->inv_freq, inv.size() * sizeof(float));
        if (rc == ST_OK && cudaMemcpy(m->inv_freq, inv.data(), inv.size() * sizeof(float), cudaMemcpyHostToDevice))
            rc = fail(ST_EINVAL, "model_create: cannot upload rope frequencies");
        const size_t nh = (size_t)m->d.n_layer * (size_t)std::max(1, m->d.n_expert);
        if (rc == ST_OK) rc = dalloc(m, &m->hist, nh * sizeof(int32_t));
        if (rc == ST_OK) rc = dalloc(m, &m->route_counter, sizeof(int32_t));
        if (rc == ST_OK && cudaMemset(m->route_counter, 0, sizeof(int32_t)) != cudaSuccess)
            rc = fail(ST_EINVAL, "model_create: cannot clear the router counter");
    }
    if (rc == ST_OK) rc = attention_setup(m->smem_optin);
    if (rc == ST_OK && (cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking) != cudaSuccess ||
                        cudaStreamCreateWithFlags(&m->side, cudaStreamNonBlocking) != cudaSuccess))
        rc = fail(ST_EINVAL, "model_create: cannot create a CUDA stream");
    if (rc == ST_OK && (cudaEventCreateWithFlags(&m->fork, cudaEventDisableTiming) != cudaSuccess ||
                        cudaEventCreateWithFlags(&m->join, cudaEventDisableTiming) != cudaSuccess))
        rc = fail(ST_EINVAL, "model_create: cannot create CUDA events");
    if (rc == ST_OK) {
        m->ev.resize((size_t)(3 * m->d.n_layer + 3));
        for (auto &e : m->ev)
            if (cudaEventCreate(&e) != cudaSuccess) {
                e = nullptr;
                rc = fail(ST_EINVAL, "model_create: cannot create CUDA events");
            }
    }
    if (rc == ST_OK) rc = staging_setup(m, desc->layers);
    if (rc != ST_OK) {
        stg_model_destroy(m);
        return rc;
    }
    *out = m;
    return ST_OK;
}

extern "C" stg_status stg_model_create(int32_t device, const void *desc, const stg_settings *settings,
                                       stg_model **out) {
    return stg_model_create_hybrid(device, desc, settings, nullptr, nullptr, out);
}

extern "C" int64_t stg_model_weight_bytes(const stg_model *m) { return m ? m->arena_bytes : 0; }

extern "C" stg_status stg_model_memory(const stg_model *m, int64_t *weights, int64_t *scratch) {
    if (!m || !weights || !scratch) return fail(ST_EINVAL, "model_memory: NULL argument");
    *weights = m->arena_bytes;
    *scratch = m->allocs.bytes - m->arena_bytes + m->s.step_allocs.bytes + m->s.ints_allocs.bytes + m->s.part_allocs.bytes;
    return ST_OK;
}

extern "C" int64_t stg_model_resident_experts(const stg_model *m) {
    if (!m) return 0;
    if (!m->hy.on) return (int64_t)(m->d.n_layer - m->d.n_dense_lead) * m->d.n_expert; /* dense layers: none */
    int64_t n = 0;
    for (int32_t c : m->hy.n_slots) n += c;
    return n;
}

extern "C" stg_status stg_model_set_settings(stg_model *m, const stg_settings *settings) {
    if (!m || !settings) return fail(ST_EINVAL, "set_settings: NULL argument");
    CHECK(check_settings(settings));
    if (m->n_live > 0) return fail(ST_EINVAL, "set_settings: %d launched step(s) in flight", m->n_live);
    CU(cudaSetDevice(m->device), "set_settings");
    CU(cudaStreamSynchronize(m->stream), "set_settings");
    drop_graphs(m); /* captured under the old settings */
    m->set = *settings;
    m->mv_mean.clear(), m->mv_on.clear(), m->mv_seen.clear(); /* measured under the old ones */
    m->kv_forms.clear();
    return ST_OK;
}

extern "C" int32_t stg_model_graphs(const stg_model *m, int32_t *n_failed, char *note, int32_t note_len) {
    if (!m) return 0;
    if (n_failed) *n_failed = m->graph_failures;
    if (note && note_len > 0) snprintf(note, (size_t)note_len, "%s", m->graph_note);
    return (int32_t)m->graphs.size();
}

extern "C" stg_status stg_host_alloc(int64_t bytes, void **out) {
    if (!out || bytes < 1) return fail(ST_EINVAL, "host alloc: bad arguments (%lld bytes)", (long long)bytes);
    *out = nullptr;
    CU(cudaHostAlloc(out, (size_t)bytes, cudaHostAllocPortable), "host alloc");
    return ST_OK;
}

extern "C" void stg_host_free(void *p) {
    if (p && cudaFreeHost(p) != cudaSuccess) cudaGetLastError();
}

/* ------------------------------------------------------------------ scratch */

static stg_status ensure_scratch(stg_model *m, int64_t T, int64_t L, int64_t n_bt) {
    scratch &s = m->s;
    const st_model_desc &d = m->d;
    const int64_t E = d.n_embd, k = d.n_expert > 0 ? d.n_expert_used : 1, ne = std::max(1, d.n_expert);
    if (T > s.cap_t || L > s.cap_l) {
        /* the old buffers go (nothing is in flight: steps end synchronised, and the graphs
         * that point at them are dropped); sizes at least double up to 512 tokens, so a
         * batch growing one sequence at a time reallocates a few times, not every step */
        CU(cudaStreamSynchronize(m->stream), "scratch"); /* also every launched step (stg_step_launch) */
        drop_graphs(m);
        /* the last step's picks, which the next step's token_src may read, survive the growth */
        std::vector<int32_t> keep((size_t)(s.picks ? m->last_picks : 0));
        if (!keep.empty())
            CU(cudaMemcpy(keep.data(), s.picks, sizeof(int32_t) * keep.size(), cudaMemcpyDeviceToHost), "scratch");
        free_list(s.step_allocs);
        const int64_t old_t = s.cap_t, old_l = s.cap_l;
        s.cap_t = s.cap_l = 0; /* until the new set is complete */
        T = std::max({T, old_t, std::min<int64_t>(2 * old_t, 512)});
        L = std::max({L, old_l, std::min<int64_t>(2 * old_l, 512)});
        const int64_t P = T * k + T, K = m->max_k, F = std::max<int64_t>(m->ff_max, 32);
        CHECK(dalloc_in(s.step_allocs, &s.x, sizeof(float) * T * E));
        CHECK(dalloc_in(s.step_allocs, &s.xn, sizeof(float) * T * E));
        CHECK(dalloc_in(s.step_allocs, &s.q, sizeof(float) * T * m->q_dim));
        CHECK(dalloc_in(s.step_allocs, &s.k, sizeof(float) * T * m->kv_dim));
        CHECK(dalloc_in(s.step_allocs, &s.v, sizeof(float) * T * m->kv_dim));
        CHECK(dalloc_in(s.step_allocs, &s.att, sizeof(float) * T * m->q_dim));
        CHECK(dalloc_in(s.step_allocs, &s.router, sizeof(float) * T * ne));
        CHECK(dalloc_in(s.step_allocs, &s.topk_w, sizeof(float) * T * k));
        CHECK(dalloc_in(s.step_allocs, &s.topk_id, sizeof(int32_t) * T * k));
        CHECK(dalloc_in(s.step_allocs, &s.pair_tok, sizeof(int32_t) * P));
        CHECK(dalloc_in(s.step_allocs, &s.list, sizeof(int32_t) * P));
        CHECK(dalloc_in(s.step_allocs, &s.gexp, sizeof(int32_t) * ne));
        CHECK(dalloc_in(s.step_allocs, &s.gstart, sizeof(int32_t) * ne));
        CHECK(dalloc_in(s.step_allocs, &s.gcount, sizeof(int32_t) * ne));
        CHECK(dalloc_in(s.step_allocs, &s.n_groups, sizeof(int32_t)));
        CHECK(dalloc_in(s.step_allocs, &s.mexp, sizeof(int32_t) * ne));
        CHECK(dalloc_in(s.step_allocs, &s.mstart, sizeof(int32_t) * ne));
        CHECK(dalloc_in(s.step_allocs, &s.mcount, sizeof(int32_t) * ne));
        CHECK(dalloc_in(s.step_allocs, &s.n_mgroups, sizeof(int32_t)));
        CHECK(dalloc_in(s.step_allocs, &s.pair_mv, sizeof(int32_t) * P));
        CHECK(dalloc_in(s.step_allocs, &s.gtiles, sizeof(int32_t) * ((P + MM_BN - 1) / MM_BN + ne)));
        CHECK(dalloc_in(s.step_allocs, &s.n_gtiles, sizeof(int32_t)));
        CHECK(dalloc_in(s.step_allocs, &s.aq, (size_t)(T * K)));
        CHECK(dalloc_in(s.step_allocs, &s.ad, sizeof(float) * T * K / 32));
        CHECK(dalloc_in(s.step_allocs, &s.as, sizeof(int32_t) * T * K / 16));
        CHECK(dalloc_in(s.step_allocs, &s.h, sizeof(float) * P * F));
        CHECK(dalloc_in(s.step_allocs, &s.h2, sizeof(float) * P * F));
        CHECK(dalloc_in(s.step_allocs, &s.hq, (size_t)(P * F)));
        CHECK(dalloc_in(s.step_allocs, &s.hd, sizeof(float) * P * F / 32));
        CHECK(dalloc_in(s.step_allocs, &s.hs, sizeof(int32_t) * P * F / 16));
        s.k_cap = std::max<int64_t>({T * K, P * F, L * E}); /* every launch input: xn / att / mo, h, the head's xl */
        CHECK(dalloc_in(s.step_allocs, &s.kq, (size_t)s.k_cap));
        CHECK(dalloc_in(s.step_allocs, &s.kd, sizeof(float) * s.k_cap / 32));
        CHECK(dalloc_in(s.step_allocs, &s.ks, sizeof(int32_t) * s.k_cap / 16));
        CHECK(dalloc_in(s.step_allocs, &s.pair_out, sizeof(float) * P * E));
        CHECK(dalloc_in(s.step_allocs, &s.gsh, sizeof(float) * T));
        CHECK(dalloc_in(s.step_allocs, &s.xl, sizeof(float) * L * E));
        CHECK(dalloc_in(s.step_allocs, &s.logits, sizeof(float) * std::max<int64_t>(L, 1) * d.n_vocab));
        CHECK(dalloc_in(s.step_allocs, &s.picks, sizeof(int32_t) * std::max<int64_t>(L, 1)));
        CHECK(dalloc_in(s.step_allocs, &s.pick_keys, sizeof(unsigned long long) * std::max<int64_t>(L, 1)));
        CHECK(dalloc_in(s.step_allocs, &s.pick_cnt, sizeof(unsigned int) * std::max<int64_t>(L, 1)));
        CU(cudaMemset(s.pick_keys, 0, sizeof(unsigned long long) * std::max<int64_t>(L, 1)), "scratch");
        CU(cudaMemset(s.pick_cnt, 0, sizeof(unsigned int) * std::max<int64_t>(L, 1)), "scratch");
        /* the dense splits' parts, or a routed split's (2 weights of n_ff_exp or one of E rows per pair) */
        s.kpart_cap = KSPLIT * std::min<int64_t>(T, KSPLIT_MAX_T) *
                      std::max<int64_t>({m->q_dim + 2 * m->kv_dim, E,
                                         d.n_expert ? (int64_t)d.n_expert_used * std::max<int64_t>(2 * m->n_ff_exp, E) : 0});
        CHECK(dalloc_in(s.step_allocs, &s.kpart, sizeof(float) * s.kpart_cap));
        { /* latent attention's buffers (model.cuh); a byte each for the other architectures */
            const bool mla = d.kv_lora_rank > 0;
            const int64_t H = d.n_head, hd = d.head_dim, nope = hd - d.rope_dim;
            const int64_t vd = d.head_dim_v > 0 ? d.head_dim_v : hd, ck = (int64_t)d.kv_lora_rank + d.rope_dim;
            const int64_t ql = std::max(1, d.q_lora_rank);
            CHECK(dalloc_in(s.step_allocs, &s.mq, mla ? sizeof(float) * T * H * hd : 0));
            CHECK(dalloc_in(s.step_allocs, &s.mkv, mla ? sizeof(float) * T * ck : 0));
            CHECK(dalloc_in(s.step_allocs, &s.mqa, mla ? sizeof(float) * T * ql : 0));
            CHECK(dalloc_in(s.step_allocs, &s.mg, mla ? sizeof(float) * T * H * nope : 0));
            CHECK(dalloc_in(s.step_allocs, &s.mo, mla ? sizeof(float) * T * H * vd : 0));
            CHECK(dalloc_in(s.step_allocs, &s.mla_gexp, mla ? sizeof(int32_t) * H : 0));
            CHECK(dalloc_in(s.step_allocs, &s.mla_gstart, mla ? sizeof(int32_t) * H : 0));
            CHECK(dalloc_in(s.step_allocs, &s.mla_gcount, mla ? sizeof(int32_t) * H : 0));
            CHECK(dalloc_in(s.step_allocs, &s.mla_list, mla ? sizeof(int32_t) * T * H : 0));
        }
        CHECK(hybrid_scratch(m, T));
        if (!keep.empty())
            CU(cudaMemcpy(s.picks, keep.data(), sizeof(int32_t) * keep.size(), cudaMemcpyHostToDevice), "scratch");
        s.cap_t = T, s.cap_l = L;
    }
    const int64_t n_ints = 5 * s.cap_t + 2 * s.cap_l + n_bt; /* tokens, pos, seq, tiles, token_src; logit rows */
    if (n_ints > s.cap_ints) {
        CU(cudaStreamSynchronize(m->stream), "scratch"); /* also every launched step's upload */
        drop_graphs(m);
        if (s.h_ints) cudaFreeHost(s.h_ints);
        s.h_ints = nullptr;
        free_list(s.ints_allocs);
        s.cap_ints = 0;
        const int64_t want = std::max(n_ints, 2 * s.cap_t + n_ints / 2); /* headroom for longer tables */
        CU(cudaMallocHost(&s.h_ints, 2 * sizeof(int32_t) * (size_t)want), "pinned staging"); /* two slots */
        CHECK(dalloc_in(s.ints_allocs, &s.ints, sizeof(int32_t) * (size_t)want));
        s.cap_ints = want;
    }
    return ST_OK;
}

/* Room for `rows` split-KV partials (attention_split.cu: tokens x heads x splits of a step), growing by
 * doubling up to the most a step can need (ATT_SPLIT_MAX_T tokens x att_zmax splits x heads). The old
 * buffers go as in ensure_scratch: the stream synchronised (every launched step too), the graphs that point
 * at them dropped. */
static stg_status ensure_att_parts(stg_model *m, int64_t rows) {
    scratch &s = m->s;
    if (rows <= s.cap_parts) return ST_OK;
    CU(cudaStreamSynchronize(m->stream), "scratch");
    drop_graphs(m);
    free_list(s.part_allocs);
    const int64_t most = (int64_t)ATT_SPLIT_MAX_T * m->att_zmax * m->d.n_head;
    const int64_t want = std::max(rows, std::min(2 * s.cap_parts, most));
    s.cap_parts = 0;
    s.apart = s.aml = nullptr;
    CHECK(dalloc_in(s.part_allocs, &s.apart, sizeof(float) * (size_t)want * (size_t)m->d.head_dim));
    CHECK(dalloc_in(s.part_allocs, &s.aml, sizeof(float) * (size_t)want * 2));
    s.cap_parts = want;
    return ST_OK;
}
