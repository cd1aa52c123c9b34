/* Strata GPU engine: model upload, paged KV cache in VRAM, and the step (stg_forward),
 * plus the kernel-harness entry points. See strata_cuda.h for the contract and
 * kernels.cuh for the kernels. The forward pass mirrors forward.c operation for
 * operation (same 8-bit activation blocks, same router, same double-precision expert
 * sum), so the CPU path is the oracle for every result. */
#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <vector>

extern "C" {
#include "../strata.h"
#include "strata_cuda.h"
}
#include "kernels.cuh"

/* ------------------------------------------------------------------ errors */

static thread_local char g_err[512];

extern "C" const char *stg_last_error(void) { return g_err; }

static stg_status fail(stg_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static stg_status fail(stg_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return code;
}

static stg_status cuda_fail(cudaError_t e, const char *what) {
    const stg_status code = e == cudaErrorMemoryAllocation ? ST_ENOMEM : ST_EINVAL;
    return fail(code, "%s: CUDA error %d (%s)", what, (int)e, cudaGetErrorString(e));
}

#define CU(call, what)                                 \
    do {                                               \
        const cudaError_t e_ = (call);                 \
        if (e_ != cudaSuccess) return cuda_fail(e_, what); \
    } while (0)
#define CHECK(expr)                      \
    do {                                 \
        const stg_status rc_ = (expr);   \
        if (rc_ != ST_OK) return rc_;    \
    } while (0)
#define LAUNCHED(what) CU(cudaGetLastError(), what)

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

/* ------------------------------------------------------------------ type dispatch */

#define QUANT_CASES(F)       \
    F(STG_Q4_0) F(STG_Q4_1) F(STG_Q5_0) F(STG_Q5_1) F(STG_Q8_0) F(STG_Q4_K) F(STG_Q5_K) F(STG_Q6_K)
#define FLOAT_CASES(F) F(STG_F32) F(STG_F16) F(STG_BF16)

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
    s->gemm_fast_min = 64;
    s->att_mma = 2;
    s->att_mma_min = 64;
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
    RANGE(gemm_fast_min, 0, INT32_MAX)
    RANGE(att_mma, 0, 2)
    RANGE(att_mma_min, 1, INT32_MAX)
#undef RANGE
    if (s->gemm_min_tokens % 8 || s->routed_split_max % 8)
        return fail(ST_EINVAL, "settings: gemm_min_tokens (%d) and routed_split_max (%d) must be multiples of 8",
                    (int)s->gemm_min_tokens, (int)s->routed_split_max);
    return ST_OK;
}

/* ------------------------------------------------------------------ model */

static stg_status attention_setup(void);

struct dtensor {
    const uint8_t *d = nullptr; /* device bytes; NULL = absent */
    int type = 0;
    int64_t ne[4] = {1, 1, 1, 1};
    int64_t row_bytes = 0, expert_stride = 0;
    const float *f() const { return (const float *)d; }
};

struct dlayer {
    dtensor attn_norm, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down, gate_inp,
        gate_exps, up_exps, down_exps, gate_inp_shexp, gate_shexp, up_shexp, down_shexp;
};

struct scratch {
    int64_t cap_t = 0, cap_l = 0, cap_bt = 0;
    float *x, *xn, *q, *k, *v, *att, *router, *topk_w, *h, *h2, *pair_out, *gsh, *logits, *xl;
    int8_t *aq, *hq;
    float *ad, *hd;
    int32_t *as, *hs, *topk_id, *pair_tok, *list, *gexp, *gstart, *gcount, *n_groups, *ints;
    int32_t *gtiles, *n_gtiles; /* the routed GEMM's tiles (group_pairs) */
    float *kpart;      /* the split dense GEMM's parts (g_kpart) */
    int64_t kpart_cap; /* floats */
    int32_t *h_ints; /* pinned host staging for the batch's index arrays: two slots of cap_ints (stg_step_launch's
                      * ticket parity), so that a step's upload may still be queued while the next one is filled */
    int32_t *picks;  /* [cap_l] the step's greedy picks (k_argmax_split), copied back instead of the logits */
    unsigned long long *pick_keys; /* [cap_l] k_argmax_split's per-row maxima, 0 between launches */
    unsigned int *pick_cnt;        /* [cap_l] its per-row tickets, 0 between launches */
    int64_t cap_ints;
    int32_t cur_seq_rows; /* sequences of the step being run (block-table rows) */
    std::vector<void *> step_allocs, ints_allocs; /* replaced (freed) when a step needs more */
};

/* A captured step: its shape. The settings it was captured under are the model's (stg_model_set_settings drops
 * every graph), so they are not part of the key. */
struct graph_entry {
    const stg_kv *kv;
    int32_t T, NL, mb, n_seq_rows;
    bool layer_events, fuse_qkv, greedy;
    bool src; /* step_shape.d_src set (st_batch.token_src) */
    cudaGraphExec_t exec;
};

/* A launched step (stg_step_launch) until its stg_step_wait: two slots, by ticket parity. */
struct inflight {
    bool live = false;
    int64_t ticket = 0;
    int32_t T = 0, NL = 0;
    bool greedy = false, layer_events = false, sampled = false, moe = false;
    int32_t *expert_hist = nullptr; /* the batch's, added to at the wait */
    cudaEvent_t e0 = nullptr, e1 = nullptr; /* the step's start (before its upload) and end (after its copies) */
    int32_t *h_picks = nullptr;             /* pinned [cap_picks]: the picks' copy */
    int64_t cap_picks = 0;
    int32_t *h_hist = nullptr; /* pinned [n_layer * n_expert]: the histogram's copy */
};

struct stg_model {
    int device;
    int cc_major = 0;
    stg_settings set; /* read when the model opens (stg_model_create), replaced by stg_model_set_settings */
    st_model_desc d;
    std::vector<dlayer> L;
    dtensor token_embd, output_norm, output;
    int32_t q_dim, kv_dim, n_ff, n_ff_exp, n_ff_shexp, max_k, ff_max;
    uint8_t *arena = nullptr;
    int64_t arena_bytes = 0;
    float *inv_freq = nullptr;
    int32_t *hist = nullptr; /* [n_layer, n_expert] */
    int32_t *route_counter = nullptr; /* k_router_route's finished-block count (0 between launches) */
    cudaStream_t stream = nullptr;
    std::vector<cudaEvent_t> ev; /* 3 per layer + 3 */
    scratch s;
    std::vector<void *> allocs;
    std::vector<graph_entry> graphs;
    int32_t graph_failures = 0;
    char graph_note[256] = "";
    combine_args pending = {}; /* an expert sum not yet added to the residual (see take_combine) */
    /* per graph-sized step size: steps run, and the attention / experts / dense shares of
     * t_total measured on the last one with per-layer events (see stg_forward) */
    struct split {
        int64_t steps = 0;
        bool have = false;
        double attn = 0.0, experts = 0.0, dense = 0.0;
    };
    std::map<int32_t, split> splits;
    std::vector<int32_t> hist_h; /* the step's expert histogram, copied back with the logits */
    std::vector<char> seq_seen;  /* stg_forward's distinct-sequence check */
    inflight fl[2];              /* launched steps, slot = ticket & 1 */
    int64_t next_ticket = 1;
    int32_t n_live = 0;
    int32_t last_picks = 0; /* greedy picks in s.picks from the last launched step (token_src's bound); 0 none */
};

static void drop_graphs(stg_model *m) {
    for (graph_entry &g : m->graphs) cudaGraphExecDestroy(g.exec);
    m->graphs.clear();
}

struct stg_kv {
    stg_model *m;
    int32_t n_blocks, block_size, n_layer, kv_dim;
    __half *k, *v;
    int64_t layer_elems;
};

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
    if (d->n_expert < 0 || d->n_expert > 1024 || (d->n_expert > 0 && (d->n_expert_used < 1 || d->n_expert_used > d->n_expert)))
        return fail(ST_EINVAL, "model: expert_used_count %d invalid for expert_count %d", d->n_expert_used, d->n_expert);
    if (d->arch < ST_ARCH_LLAMA || d->arch > ST_ARCH_QWEN2MOE) return fail(ST_EUNSUPPORTED, "model: arch %d", d->arch);
    const int64_t E = d->n_embd;
    CHECK(check_t(d->token_embd, "token_embd", -1, true, E, d->n_vocab, 1, false));
    CHECK(check_t(d->output_norm, "output_norm", -1, true, E, 1, 1, true));
    CHECK(check_t(d->output, "output", -1, true, E, d->n_vocab, 1, false));
    m->n_ff = m->n_ff_exp = m->n_ff_shexp = 0;
    for (int il = 0; il < d->n_layer; il++) {
        const st_layer &l = layers[il];
        CHECK(check_t(l.attn_norm, "attn_norm", il, true, E, 1, 1, true));
        CHECK(check_t(l.wq, "attn_q", il, true, E, m->q_dim, 1, false));
        CHECK(check_t(l.wk, "attn_k", il, true, E, m->kv_dim, 1, false));
        CHECK(check_t(l.wv, "attn_v", il, true, E, m->kv_dim, 1, false));
        CHECK(check_t(l.wo, "attn_output", il, true, m->q_dim, E, 1, false));
        CHECK(check_t(l.bq, "attn_q.bias", il, false, m->q_dim, 1, 1, true));
        CHECK(check_t(l.bk, "attn_k.bias", il, false, m->kv_dim, 1, 1, true));
        CHECK(check_t(l.bv, "attn_v.bias", il, false, m->kv_dim, 1, 1, true));
        CHECK(check_t(l.q_norm, "attn_q_norm", il, d->arch == ST_ARCH_QWEN3MOE, d->head_dim, 1, 1, true));
        CHECK(check_t(l.k_norm, "attn_k_norm", il, d->arch == ST_ARCH_QWEN3MOE || l.q_norm.data, d->head_dim, 1, 1, true));
        CHECK(check_t(l.ffn_norm, "ffn_norm", il, true, E, 1, 1, true));
        if (d->n_expert > 0) {
            const int64_t ff = l.gate_exps.ne[1];
            if (il == 0) m->n_ff_exp = (int32_t)ff;
            if (ff != m->n_ff_exp || ff < 1) return fail(ST_EINVAL, "layer %d: expert FFN width differs", il);
            CHECK(check_t(l.gate_inp, "ffn_gate_inp", il, true, E, d->n_expert, 1, false));
            CHECK(check_t(l.gate_exps, "ffn_gate_exps", il, true, E, ff, d->n_expert, false));
            CHECK(check_t(l.up_exps, "ffn_up_exps", il, true, E, ff, d->n_expert, false));
            CHECK(check_t(l.down_exps, "ffn_down_exps", il, true, ff, E, d->n_expert, false));
            if (l.gate_shexp.data) {
                const int64_t sf = l.gate_shexp.ne[1];
                if (il == 0) m->n_ff_shexp = (int32_t)sf;
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
template <typename P> static stg_status dalloc_in(std::vector<void *> &list, P **p, size_t n) {
    void *v = nullptr;
    const cudaError_t e = cudaMalloc(&v, n > 0 ? n : 1);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return fail(ST_ENOMEM, "cannot allocate %zu bytes of GPU memory (%s)", n, cudaGetErrorString(e));
    }
    list.push_back(v);
    *p = (P *)v;
    return ST_OK;
}
template <typename P> static stg_status dalloc(stg_model *m, P **p, size_t n) { return dalloc_in(m->allocs, p, n); }

static void free_list(std::vector<void *> &list) {
    for (void *p : list) cudaFree(p);
    list.clear();
}

/* Every weight in one VRAM arena, each tensor 256-byte aligned; a host tensor shared by
 * two fields (tied output/embedding) is uploaded once. */
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
                                  &s.up_shexp, &s.down_shexp};
        dtensor *dd[] = {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.bq, &l.bk, &l.bv, &l.q_norm,
                         &l.k_norm, &l.ffn_norm, &l.ffn_gate, &l.ffn_up, &l.ffn_down, &l.gate_inp,
                         &l.gate_exps, &l.up_exps, &l.down_exps, &l.gate_inp_shexp, &l.gate_shexp,
                         &l.up_shexp, &l.down_shexp};
        for (size_t i = 0; i < sizeof src / sizeof src[0]; i++) all.push_back(src[i]), dst.push_back(dd[i]);
    }
    std::map<const void *, int64_t> offset; /* host pointer -> arena offset */
    int64_t total = 0;
    for (const st_tensor *t : all) {
        if (!t->data || offset.count(t->data)) continue;
        offset[t->data] = total;
        total += (tensor_bytes(*t) + 255) / 256 * 256;
    }
    CHECK(dalloc(m, &m->arena, (size_t)total));
    m->arena_bytes = total;
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
    free_list(m->s.step_allocs);
    free_list(m->s.ints_allocs);
    for (void *p : m->allocs) cudaFree(p);
    if (m->s.h_ints) cudaFreeHost(m->s.h_ints);
    for (inflight &f : m->fl) {
        if (f.h_picks) cudaFreeHost(f.h_picks);
        if (f.h_hist) cudaFreeHost(f.h_hist);
        if (f.e0) cudaEventDestroy(f.e0);
        if (f.e1) cudaEventDestroy(f.e1);
    }
    for (cudaEvent_t e : m->ev) cudaEventDestroy(e);
    if (m->stream) cudaStreamDestroy(m->stream);
    delete m;
}

extern "C" stg_status stg_model_create(int32_t device, const void *vdesc, const stg_settings *settings,
                                       stg_model **out) {
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
    m->d = *desc;
    m->d.layers = nullptr;
    m->q_dim = desc->n_head * desc->head_dim;
    m->kv_dim = desc->n_head_kv * desc->head_dim;
    stg_status rc = validate(m, desc->layers);
    if (rc == ST_OK) rc = upload(m, desc->layers);
    if (rc == ST_OK) {
        m->max_k = std::max({m->d.n_embd, m->q_dim, m->n_ff, m->n_ff_shexp});
        m->ff_max = std::max({m->n_ff, m->n_ff_exp, m->n_ff_shexp});
        std::vector<float> inv(m->d.rope_dim / 2);
        for (int i = 0; i < m->d.rope_dim / 2; i++)
            inv[i] = (float)(1.0 / pow((double)m->d.rope_base, (double)(2 * i) / (double)m->d.rope_dim));
        rc = dalloc(m, &m->inv_freq, inv.size() * sizeof(float));
        if (rc == ST_OK && cudaMemcpy(m->inv_freq, inv.data(), inv.size() * sizeof(float), cudaMemcpyHostToDevice))
            rc = fail(ST_EINVAL, "model_create: cannot upload rope frequencies");
        const size_t nh = (size_t)m->d.n_layer * (size_t)std::max(1, m->d.n_expert);
        if (rc == ST_OK) rc = dalloc(m, &m->hist, nh * sizeof(int32_t));
        if (rc == ST_OK) rc = dalloc(m, &m->route_counter, sizeof(int32_t));
        if (rc == ST_OK && cudaMemset(m->route_counter, 0, sizeof(int32_t)) != cudaSuccess)
            rc = fail(ST_EINVAL, "model_create: cannot clear the router counter");
    }
    if (rc == ST_OK) rc = attention_setup();
    if (rc == ST_OK && cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking) != cudaSuccess)
        rc = fail(ST_EINVAL, "model_create: cannot create a CUDA stream");
    if (rc == ST_OK) {
        m->ev.resize((size_t)(3 * m->d.n_layer + 3));
        for (auto &e : m->ev)
            if (cudaEventCreate(&e) != cudaSuccess) {
                e = nullptr;
                rc = fail(ST_EINVAL, "model_create: cannot create CUDA events");
            }
    }
    if (rc != ST_OK) {
        stg_model_destroy(m);
        return rc;
    }
    *out = m;
    return ST_OK;
}

extern "C" int64_t stg_model_weight_bytes(const stg_model *m) { return m ? m->arena_bytes : 0; }

extern "C" stg_status stg_model_set_settings(stg_model *m, const stg_settings *settings) {
    if (!m || !settings) return fail(ST_EINVAL, "set_settings: NULL argument");
    CHECK(check_settings(settings));
    if (m->n_live > 0) return fail(ST_EINVAL, "set_settings: %d launched step(s) in flight", m->n_live);
    CU(cudaSetDevice(m->device), "set_settings");
    CU(cudaStreamSynchronize(m->stream), "set_settings");
    drop_graphs(m); /* captured under the old settings */
    m->set = *settings;
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

/* ------------------------------------------------------------------ KV cache */

extern "C" stg_status stg_kv_create(stg_model *m, int32_t n_blocks, int32_t block_size, stg_kv **out) {
    if (!m || !out) return fail(ST_EINVAL, "kv_create: NULL argument");
    *out = nullptr;
    if (n_blocks < 1 || block_size < 16 || block_size > 4096 || block_size % 16)
        return fail(ST_EINVAL, "kv_create: n_blocks=%d block_size=%d invalid (block size: a multiple of 16)", n_blocks,
                    block_size);
    CU(cudaSetDevice(m->device), "kv_create");
    stg_kv *kv = new stg_kv();
    kv->m = m;
    kv->n_blocks = n_blocks, kv->block_size = block_size, kv->n_layer = m->d.n_layer, kv->kv_dim = m->kv_dim;
    kv->layer_elems = (int64_t)n_blocks * block_size * m->kv_dim;
    const size_t bytes = (size_t)kv->layer_elems * (size_t)kv->n_layer * sizeof(__half);
    if (cudaMalloc(&kv->k, bytes) != cudaSuccess || cudaMalloc(&kv->v, bytes) != cudaSuccess) {
        cudaGetLastError();
        cudaFree(kv->k);
        delete kv;
        return fail(ST_ENOMEM, "kv_create: cannot allocate %zu bytes of KV cache in VRAM", 2 * bytes);
    }
    /* zeroed so a stray read of an unwritten slot is finite, as on the CPU (calloc) */
    if (cudaMemset(kv->k, 0, bytes) != cudaSuccess || cudaMemset(kv->v, 0, bytes) != cudaSuccess) {
        cudaFree(kv->k);
        cudaFree(kv->v);
        delete kv;
        return fail(ST_EINVAL, "kv_create: cannot clear the KV cache");
    }
    *out = kv;
    return ST_OK;
}

extern "C" void stg_kv_destroy(stg_kv *kv) {
    if (!kv) return;
    cudaSetDevice(kv->m->device);
    cudaStreamSynchronize(kv->m->stream);
    drop_graphs(kv->m); /* they point into this cache */
    cudaFree(kv->k);
    cudaFree(kv->v);
    delete kv;
}

extern "C" int64_t stg_kv_bytes(const stg_kv *kv) {
    return kv ? 2 * kv->layer_elems * kv->n_layer * (int64_t)sizeof(__half) : 0;
}

/* ------------------------------------------------------------------ launches */

/* Kernels of a step are launched with programmatic dependent launch where the device has
 * it (sm_90; g_pdl set per step, STRATA_GPU_PDL=0 turns it off): each may be scheduled
 * while its predecessor finishes, prefetching weights, and waits (griddepcontrol.wait)
 * before touching activations. Errors surface through cudaGetLastError (LAUNCHED). */
static thread_local bool g_pdl = false;
/* cluster_x > 1: thread-block clusters of that many blocks along x (sm_90; GU_CHUNK's form 3) */
template <typename... KArgs, typename... Args>
static void launch_kx(unsigned cluster_x, void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                      Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = st;
    cudaLaunchAttribute at[2];
    unsigned n = 0;
    if (g_pdl) {
        at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster_x > 1) {
        at[n].id = cudaLaunchAttributeClusterDimension;
        at[n].val.clusterDim.x = cluster_x, at[n].val.clusterDim.y = 1, at[n].val.clusterDim.z = 1;
        n++;
    }
    cfg.attrs = at, cfg.numAttrs = n;
    (void)cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...);
}
template <typename... KArgs, typename... Args>
static void launch_k(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args... args) {
    launch_kx(1u, kern, grid, block, smem, st, args...);
}

struct acts_d {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    const float *x;
};

/* The settings of the step being queued (stg_model's, or the harness's): copied in per step, read by the
 * launchers below; graphs are keyed by the fields that change what is captured (graph_entry). */
static thread_local stg_settings g_set = {};

/* A dense quantised layer too small for the GEMM's grid (use_gemm: fewer than 256 tiles, e.g. q / k / v / o
 * at 16-64 tokens) runs the GEMM with its k loop split over KSPLIT blocks per tile (lin_args.ksplit;
 * k_ksplit_combine adds the parts as the butterfly's top levels do, so the result is the matvec's bit for
 * bit) instead of the matvec, which unpacks each weight row once per 8 pairs: from dense_split tokens. */
#define KSPLIT 4
#define KSPLIT_MAX_T 64
/* the split GEMM's parts: KSPLIT x KSPLIT_MAX_T x the widest dense layer (scratch), set per step */
static thread_local float *g_kpart = nullptr;
static thread_local int64_t g_kpart_cap = 0; /* floats */
/* At 16-64 tokens the split GEMMs of q / k / v (one segmented launch, decode steps whose q/k/v
 * post-processing runs inside attention) and of the output projection leave their 4 parts to their
 * consumers, which add them as k_ksplit_combine does (the fused attention's head prep; the FFN's RMSNorm,
 * then the residual add): two launches per layer fewer, the same bits. g_defer_combine asks launch_q to
 * skip the combine; g_deferred says it did. */
static thread_local bool g_defer_combine = false, g_deferred = false;
/* The output head's Q6_K single-pair matvec (at least Q6_ROWS_MIN_N rows: batch 1) on k_q6_stage, or where
 * its weight is not 16-byte aligned on k_linear_q_rows with 2 rows per warp. */
#define Q6_ROWS_MIN_N 65536
/* The routed Q4_K gate/up GEMMs over the tile list in steps of at most routed_split_max tokens run their k loop
 * over ROUTED_SPLIT blocks per tile (grid z; k_linear_gemm's RS form), each one subtree of the butterfly into
 * kpart[z][weight][pair][N]; k_ksplit_routed adds the parts as the tree's top levels, then the SWIGLU and the
 * down projection's 8-bit input (k_quant_act's launch fewer). Same bits. Why: the routed GEMMs' few busy
 * experts give few blocks of 16 serial stages. The down projection is not split (no faster). */
#define ROUTED_SPLIT 2
/* The prefill form of the Q4_K GEMM (k_linear_gemm's FAST: one float sum per output in the walk order
 * instead of the matvec's butterfly tree, so tiles of 32 or 64 pairs fit the registers; within rounding
 * of the matvec, not bitwise). An eager step takes it for every Q4_K layer but the output head (row
 * lengths with C = 1, 2 or 4 sub-blocks per residue, whatever the launch's size) when each of its tokens
 * belongs to a run of at least gemm_fast_min consecutive tokens of one sequence: a long prompt's tokens
 * then get the same bits whether it is prefilled whole or in chunks of at least that many tokens; a step
 * that also holds short runs (decode tokens) keeps the bitwise kernels for all its tokens. Such steps
 * also run the F32 routers on k_router_gemm, k and v as one row-segmented launch (k and v alone are 8 row
 * tiles each), and no programmatic dependent launch: each GEMM's next launch would put its blocks on the
 * SMs early, where they wait on the current launch and hold the registers and shared memory its later
 * blocks would use. */
static thread_local bool g_gemm_fast = false; /* set per step (stg_forward); graph steps: false */
/* whether every token of a step (seq[T], runs of consecutive equal ids) is in a run of >= min_run */
static bool all_runs_long(const int32_t *seq, int32_t T, int32_t min_run) {
    if (min_run < 1 || T < min_run) return false;
    for (int32_t i = 0; i < T;) {
        int32_t j = i + 1;
        while (j < T && seq[j] == seq[i]) j++;
        if (j - i < min_run) return false;
        i = j;
    }
    return true;
}
/* the harness: the prefill form when gemm_fast_min >= 1 and its n_tok tokens, taken as one run, reach it */
static bool harness_fast(int64_t n_tok) { return g_set.gemm_fast_min >= 1 && n_tok >= g_set.gemm_fast_min; }
static bool gemm_fast_layer(const dtensor &W) {
    if (W.type != STG_Q4_K) return false;
    const int64_t C = (W.ne[0] / 32 + 31) / 32;
    return C == 1 || C == 2 || C == 4;
}

/* The GEMM for a launch of `groups` groups of about `expected` pairs over N weight rows:
 * from gemm_min pairs per group, only with enough tiles to fill the GPU (a dense q or o
 * projection at 8-32 tokens has 64-128 tiles of 64 rows, each a serial pass over K: the
 * matvec's thousands of warps finish first there), and for a single group (a dense layer,
 * the output head) only from gemm_dense pairs (32: the 151,936-row Q6_K head at 8 tokens is
 * faster on the matvec, at 32 on the GEMM). Same results either way. */
static bool use_gemm(int64_t N, int groups, int expected) {
    const int64_t tiles = (N + MM_BM - 1) / MM_BM * groups * ((expected + MM_BN - 1) / MM_BN);
    if (groups == 1 && expected < g_set.gemm_dense_min) return false;
    return expected >= g_set.gemm_min && tiles >= 256;
}

/* Quantise rows x[R, K] into (q, d, s). */
static stg_status quantize(cudaStream_t st, const float *x, int64_t R, int64_t K, int8_t *q, float *d, int32_t *s) {
    const int64_t warps = R * (K / 32);
    if (warps == 0) return ST_OK;
    launch_k(k_quant_act, (unsigned)((warps * 32 + 255) / 256), 256, 0, st, x, K, R, q, d, s);
    LAUNCHED("quantize activations");
    return ST_OK;
}

/* k_linear_gemm's variant for a row of K: Q4_K with C = 1, 2 or 4 sub-blocks per residue (K/32 up
 * to 128) runs the stage-aligned k loop (CS = C), anything else the general one. Same results. */
using gemm_fn = void (*)(lin_args);
template <int T, bool SW, int BN> static gemm_fn gemm_kernel(int K) {
    if constexpr (gemm_raw<T>()) {
        const int C = (K / 32 + 31) / 32;
        if (C == 1) return k_linear_gemm<T, SW, BN, 1>;
        if (C == 2) return k_linear_gemm<T, SW, BN, 2>;
        if (C == 4) return k_linear_gemm<T, SW, BN, 4>;
    }
    return k_linear_gemm<T, SW, BN, 0>;
}
/* the routed split form of gate/up (Q4_K, C = 1, 2 or 4 only; NULL: no split for this K) */
template <int T> static gemm_fn gemm_rs_kernel(int K) {
    if constexpr (gemm_raw<T>()) {
        const int C = (K / 32 + 31) / 32;
        if (C == 1) return k_linear_gemm<T, true, MM_BN, 1, false, true>;
        if (C == 2) return k_linear_gemm<T, true, MM_BN, 2, false, true>;
        if (C == 4) return k_linear_gemm<T, true, MM_BN, 4, false, true>;
    }
    return nullptr;
}
template <bool SW, int BN> static gemm_fn gemm_fast_kernel(int K) {
    const int C = (K / 32 + 31) / 32;
    if (C == 1) return k_linear_gemm<STG_Q4_K, SW, BN, 1, true>;
    if (C == 2) return k_linear_gemm<STG_Q4_K, SW, BN, 2, true>;
    return k_linear_gemm<STG_Q4_K, SW, BN, 4, true>;
}
/* The prefill form (g_gemm_fast): routed launches over group_pairs' tile list (64 pairs from 32
 * expected per group), dense ones over a grid of 64-pair tiles where that still gives gemm_wide_min
 * blocks, else 32. */
template <bool SW> static void launch_fast(const lin_args &a, int max_groups, int max_count, int expected,
                                           cudaStream_t st) {
    const unsigned mt = (unsigned)((a.N + MM_BM - 1) / MM_BM);
    const bool listed = a.g.gexp && a.g.tiles;
    int bn;
    if (a.g.gexp) bn = expected >= MM_BN_WIDE ? MM_BN_FAST : MM_BN_WIDE;
    else bn = (int64_t)mt * ((max_count + MM_BN_FAST - 1) / MM_BN_FAST) >= g_set.gemm_wide_min ? MM_BN_FAST : MM_BN_WIDE;
    lin_args b = a;
    b.kpart = nullptr, b.ksplit = 0;
    dim3 grid(mt, (unsigned)((a.g.n_pairs + MM_BN - 1) / MM_BN + max_groups), 1); /* the list's entries */
    if (!listed) {
        b.g.tiles = b.g.n_tiles = nullptr;
        grid = dim3(mt, (unsigned)((max_count + bn - 1) / bn), (unsigned)max_groups);
    }
    if (bn == MM_BN_FAST)
        launch_k(gemm_fast_kernel<SW, MM_BN_FAST>(a.K), grid, 128, gemm_raw_bytes<STG_Q4_K, SW, MM_BN_FAST>(), st, b);
    else launch_k(gemm_fast_kernel<SW, MM_BN_WIDE>(a.K), grid, 128, gemm_raw_bytes<STG_Q4_K, SW, MM_BN_WIDE>(), st, b);
}

/* The output head's launch on k_q6_stage (a dense single group): false (nothing launched) when the weight or its
 * rows are not 16-byte aligned or the block's copies would need more than 48 KB of shared memory */
static bool launch_q6_stage(const lin_args &a, cudaStream_t st) {
    const int64_t smem = (int64_t)LIN_WARPS * q6s_span16(Q6S_ROWS, a.row_bytes) * 16;
    if (((uintptr_t)a.w & 15) || (a.row_bytes & 15) || smem > 48 * 1024) return false;
    const dim3 g((unsigned)((a.N + LIN_WARPS * Q6S_ROWS - 1) / (LIN_WARPS * Q6S_ROWS)), 1u);
    launch_k(k_q6_stage, g, LIN_WARPS * 32, (size_t)smem, st, a);
    return true;
}
template <int T, bool SW> static void launch_mv(const lin_args &a, int nt, dim3 grid, cudaStream_t st) {
    if (nt >= 8) launch_k(k_linear_q<T, 8, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else if (nt >= 4) launch_k(k_linear_q<T, 4, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else if (nt >= 2) launch_k(k_linear_q<T, 2, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else launch_k(k_linear_q<T, 1, SW>, grid, LIN_WARPS * 32, 0, st, a);
}
template <int T, bool SW, int TG = T>
static void launch_q(const lin_args &a, int path, int nt, int max_groups, int max_count, cudaStream_t st) {
    if constexpr (T == STG_Q6_K && TG == T) { /* the GEMM unpacks through unpack_q6k_wide (STG_Q6_KW) */
        if (path == STG_PATH_GEMM) {
            launch_q<T, SW, STG_Q6_KW>(a, path, nt, max_groups, max_count, st);
            return;
        }
    }
    if (path == STG_PATH_REF) {
        launch_k(k_linear_ref<T>, dim3((unsigned)((a.N + 127) / 128), (unsigned)max_groups), 128, 0, st, a);
    } else if (path == STG_PATH_GEMM) {
        const unsigned mt = (unsigned)((a.N + MM_BM - 1) / MM_BM);
        const int64_t per_group = (int64_t)((max_count + MM_BN - 1) / MM_BN) * max_groups;
        const int64_t listed = a.g.gexp && a.g.tiles ? (a.g.n_pairs + MM_BN - 1) / MM_BN + max_groups
                                                                       : INT64_MAX;
        const int64_t wide = (max_count + MM_BN_WIDE - 1) / MM_BN_WIDE;
        if constexpr (SW) {
            if (a.ksplit > 1) { /* routed gate/up over the tile list, its k loop split over grid z */
                const unsigned nl = (unsigned)((a.g.n_pairs + MM_BN - 1) / MM_BN + max_groups);
                launch_k(gemm_rs_kernel<T>(a.K), dim3(mt, nl, (unsigned)a.ksplit), 128, gemm_raw_bytes<T, SW>(), st, a);
                const int64_t n = (int64_t)a.g.n_pairs * a.N;
                launch_k(k_ksplit_routed, (unsigned)((n + 255) / 256), 256, 0, st, (const float *)a.kpart, a.ksplit,
                         2, a.g.n_pairs, a.N, a.out, a.ldo, a.hq, a.hd, a.hs);
                return;
            }
        }
        if (a.ksplit > 1) { /* a dense plain layer, its k loop split over grid z (lin_args.ksplit) */
            const bool wide = max_count > MM_BN;
            const int bn = wide ? MM_BN_WIDE : MM_BN;
            const dim3 grid(mt, (unsigned)((max_count + bn - 1) / bn), (unsigned)a.ksplit);
            if (wide)
                launch_k(gemm_kernel<TG, false, MM_BN_WIDE>(a.K), grid, 128, gemm_raw_bytes<TG, false, MM_BN_WIDE>(),
                         st, a);
            else launch_k(gemm_kernel<TG, false, MM_BN>(a.K), grid, 128, gemm_raw_bytes<TG, false>(), st, a);
            const int64_t n = (int64_t)max_count * a.N;
            if (g_defer_combine && a.ksplit == KSPLIT) g_deferred = true; /* the consumer adds the parts */
            else
                launch_k(k_ksplit_combine, (unsigned)((n + 255) / 256), 256, 0, st, (const float *)a.kpart, a.ksplit,
                         max_count, a.N, a.out, a.ldo, a.mode, a.seg);
        } else if (listed < per_group) { /* a block per tile of group_pairs' list */
            launch_k(gemm_kernel<TG, SW, MM_BN>(a.K), dim3(mt, (unsigned)listed, 1), 128, gemm_raw_bytes<TG, SW>(),
                     st, a);
        } else if (!SW && !a.g.gexp && mt * wide >= g_set.gemm_wide_min) {
            /* a dense layer with enough tiles of 32 pairs: half the weight unpacking per mma */
            lin_args b = a;
            b.g.tiles = b.g.n_tiles = nullptr;
            launch_k(gemm_kernel<TG, false, MM_BN_WIDE>(a.K), dim3(mt, (unsigned)wide, 1), 128,
                     gemm_raw_bytes<TG, false, MM_BN_WIDE>(), st, b);
        } else {
            lin_args b = a;
            b.g.tiles = b.g.n_tiles = nullptr;
            launch_k(gemm_kernel<TG, SW, MM_BN>(a.K), dim3(mt, (unsigned)((max_count + MM_BN - 1) / MM_BN),
                     (unsigned)max_groups), 128, gemm_raw_bytes<TG, SW>(), st, b);
        }
    } else {
        const dim3 grid((unsigned)((a.N + LIN_WARPS - 1) / LIN_WARPS), (unsigned)max_groups);
        if constexpr (SW && (T == STG_Q4_K || T == STG_Q8_0)) {
            if (a.hq) { /* the routed gate/up of single-pair passes quantising its chunks in-block (linear()) */
                launch_k(k_linear_q_chunk<T>, dim3((unsigned)(a.N / 32), (unsigned)max_groups), GU_CHUNK_WARPS * 32, 0,
                         st, a);
                return;
            }
        }
        if constexpr (T == STG_Q4_K && !SW) {
            if (nt == 1 && a.g.gexp && a.seg.n_seg < 2) { /* routed single pairs: 8 rows per warp */
                const dim3 g((unsigned)((a.N + LIN_WARPS * 8 - 1) / (LIN_WARPS * 8)), grid.y);
                launch_k(k_linear_q_rows<T, 8>, g, LIN_WARPS * 32, 0, st, a);
                return;
            }
        }
        if constexpr (T == STG_Q6_K && !SW) {
            if (nt == 1 && !a.g.gexp && a.seg.n_seg < 2 && a.N >= Q6_ROWS_MIN_N) { /* the output head at one pair */
                if (grid.y == 1 && launch_q6_stage(a, st)) return;
                const dim3 g((unsigned)((a.N + LIN_WARPS * 2 - 1) / (LIN_WARPS * 2)), grid.y);
                launch_k(k_linear_q_rows<STG_Q6_KW, 2>, g, LIN_WARPS * 32, 0, st, a);
                return;
            }
        }
        if constexpr (T == STG_Q6_K) {
            launch_mv<STG_Q6_KW, SW>(a, nt, grid, st); /* five 8-byte loads per 32-byte chunk (unpack_q6k_wide) */
            return;
        }
        launch_mv<T, SW>(a, nt, grid, st);
    }
}
template <int T, bool SW> static void launch_f(const lin_args &a, int path, int nt, int max_groups, int max_count,
                                               cudaStream_t st) {
    if (path == STG_PATH_REF) {
        launch_k(k_linear_ref<T>, dim3((unsigned)((a.N + 127) / 128), (unsigned)max_groups), 128, 0, st, a);
        return;
    }
    if (!SW && a.N <= 1024 && nt == 8 && max_count > 8 && max_count <= 64 && max_groups == 1 &&
        !a.g.gexp && a.K <= ROUTER_PRE * LIN_WARPS * WARP) {
        /* 9-64 pairs of a router: weights before the wait, a pass's activations all in flight (same bits) */
        const dim3 grid((unsigned)a.N, 1u, (unsigned)((max_count + 7) / 8));
        launch_k(k_linear_f_rows_mlp<T, 8>, grid, LIN_WARPS * 32, 0, st, a);
        return;
    }
    if (!SW && a.N <= 1024) { /* few rows (a router): a block per row and pass of nt pairs keeps the GPU busy */
        const dim3 grid((unsigned)a.N, (unsigned)max_groups, (unsigned)std::min((max_count + nt - 1) / nt, 65535));
        if (nt >= 8) launch_k(k_linear_f_rows<T, 8>, grid, LIN_WARPS * 32, 0, st, a);
        else if (nt >= 4) launch_k(k_linear_f_rows<T, 4>, grid, LIN_WARPS * 32, 0, st, a);
        else if (nt >= 2) launch_k(k_linear_f_rows<T, 2>, grid, LIN_WARPS * 32, 0, st, a);
        else launch_k(k_linear_f_rows<T, 1>, grid, LIN_WARPS * 32, 0, st, a);
        return;
    }
    const dim3 grid((unsigned)((a.N + LIN_WARPS - 1) / LIN_WARPS), (unsigned)max_groups);
    if (nt >= 8) launch_k(k_linear_f<T, 8, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else if (nt >= 4) launch_k(k_linear_f<T, 4, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else if (nt >= 2) launch_k(k_linear_f<T, 2, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else launch_k(k_linear_f<T, 1, SW>, grid, LIN_WARPS * 32, 0, st, a);
}

/* One linear layer over groups of pairs. W2 (optional, same type) makes it SWIGLU.
 * expected: pairs a group is expected to hold (picks the kernel); max_count: an upper
 * bound on any group's pairs (sizes the GEMM grid). */
/* Where a SWIGLU launch may also quantise its output for the down projection (lin_args.hq); `done` says
 * whether it did. */
struct fused_quant {
    int8_t *q;
    float *d;
    int32_t *s;
    bool *done;
};

static stg_status linear(cudaStream_t st, const dtensor &W, const dtensor *W2, const lin_groups &g, int max_groups,
                         int expected, int max_count, const acts_d &in, float *out, int64_t ldo, int mode,
                         int path = STG_PATH_AUTO, const lin_seg *seg = nullptr, const fused_quant *fq = nullptr) {
    lin_args a;
    a.w = W.d, a.w2 = W2 ? W2->d : nullptr;
    a.expert_stride = W.expert_stride, a.row_bytes = W.row_bytes;
    a.N = (int32_t)W.ne[1], a.K = (int32_t)W.ne[0];
    a.seg = {};
    if (seg) a.seg = *seg, a.N = seg->seg_row[seg->n_seg];
    a.g = g;
    a.aq = in.q, a.ad = in.d, a.as = in.s, a.x = in.x;
    a.out = out, a.ldo = ldo, a.mode = W2 ? MODE_SWIGLU : mode;
    a.hq = nullptr, a.hd = nullptr, a.hs = nullptr;
    a.kpart = nullptr, a.ksplit = 0;
    if (fq) *fq->done = false;
    if (max_groups < 1 || max_count < 1) return ST_OK;
    const bool q = !stg_is_float(W.type);
    if (g_gemm_fast && !W2 && !seg && W.type == STG_F32 && !g.gexp && max_groups == 1 &&
        a.N <= 1024 && a.K % RG_BK == 0 && (uintptr_t)W.d % 16 == 0 && (uintptr_t)in.x % 16 == 0 &&
        (path == STG_PATH_AUTO || path == STG_PATH_GEMM)) {
        /* a router in a prefill-form step: activations read once per RG_BM rows instead of once per row */
        launch_k(k_router_gemm, dim3((unsigned)((a.N + RG_BM - 1) / RG_BM), (unsigned)((max_count + RG_BT - 1) / RG_BT)),
                 RG_BM * 32, 0, st, a);
        LAUNCHED("linear (router, prefill form)");
        return ST_OK;
    }
    /* the prefill form takes row segments (q / k / v in one launch) whose every boundary is a whole tile */
    const auto whole_tiles = [&] {
        for (int i = 0; seg && i <= seg->n_seg; i++)
            if (seg->seg_row[i] % MM_BM) return false;
        return true;
    };
    if (g_gemm_fast && gemm_fast_layer(W) && whole_tiles() && (path == STG_PATH_AUTO || path == STG_PATH_GEMM)) {
        if (W2) launch_fast<true>(a, max_groups, max_count, expected, st);
        else launch_fast<false>(a, max_groups, max_count, expected, st);
        LAUNCHED("linear (prefill form)");
        return ST_OK;
    }
    /* routed layers from gemm_min_tokens tokens: the GEMM at 1 expected pair per expert too (with the split) */
    const int min_tok = g_set.gemm_min_tokens;
    const bool gemm = q && !seg && (use_gemm(a.N, max_groups, expected) || (g.gexp && min_tok > 0 && max_count >= min_tok));
    /* row segments on the split GEMM: each segment whole tiles of MM_BM rows */
    const bool seg_split = seg && seg->n_seg >= 2 && seg->n_seg <= 3 && [&] {
        for (int i = 0; i <= seg->n_seg; i++)
            if (seg->seg_row[i] % MM_BM) return false;
        return true;
    }();
    /* a dense plain layer the GEMM's grid would not fill: the GEMM with its k loop split (see KSPLIT) */
    const bool split = q && !gemm && !W2 && (!seg || seg_split) && !g.gexp && max_groups == 1 && g_set.dense_split > 0 &&
                       expected >= g_set.dense_split && max_count <= KSPLIT_MAX_T && g_kpart &&
                       (int64_t)KSPLIT * max_count * a.N <= g_kpart_cap && (path == STG_PATH_AUTO || path == STG_PATH_GEMM);
    if (split) path = STG_PATH_GEMM, a.kpart = g_kpart, a.ksplit = KSPLIT;
    if (path == STG_PATH_AUTO) path = gemm ? STG_PATH_GEMM : STG_PATH_MATVEC;
    if (path == STG_PATH_GEMM && !q) path = STG_PATH_MATVEC;
    /* a routed gate/up launch over the tile list at decode: the split GEMM (ROUTED_SPLIT), its combine also
     * quantising the output for the down projection */
    const int rs = ROUTED_SPLIT;
    const bool rs_form = W.type == STG_Q4_K && gemm_rs_kernel<STG_Q4_K>((int)a.K) != nullptr;
    if (path == STG_PATH_GEMM && q && rs_form && W2 && !seg && !split && g.gexp && g.tiles &&
        max_count <= g_set.routed_split_max && g_kpart && (int64_t)rs * 2 * g.n_pairs * a.N <= g_kpart_cap &&
        mode == MODE_STORE) {
        a.kpart = g_kpart, a.ksplit = rs;
        if (fq && W2 && a.N % 32 == 0 && ldo == a.N) {
            a.hq = fq->q, a.hd = fq->d, a.hs = fq->s;
            *fq->done = true;
        }
    }
    /* a routed gate/up matvec of one pair per pass quantises its chunks in-block (k_linear_q_chunk) */
    const bool gu_chunk = fq && W2 && path == STG_PATH_MATVEC && !seg && g.gexp && expected <= 1 &&
                          a.N % 32 == 0 && ldo == a.N && (W.type == STG_Q4_K || W.type == STG_Q8_0);
    if (gu_chunk) {
        a.hq = fq->q, a.hd = fq->d, a.hs = fq->s;
        *fq->done = true;
    }
    if (seg && !split && (path != STG_PATH_MATVEC || !q))
        return fail(ST_EINVAL, "linear: row segments need the matvec path or the split GEMM");
    int nt = 1;
    while (nt < expected && nt < 8) nt *= 2;
    switch (W.type) {
#define CASE_Q(T)                                                         \
    case T:                                                               \
        if (W2) launch_q<T, true>(a, path, nt, max_groups, max_count, st); \
        else launch_q<T, false>(a, path, nt, max_groups, max_count, st);  \
        break;
        QUANT_CASES(CASE_Q)
#undef CASE_Q
#define CASE_F(T)                                           \
    case T:                                                 \
        if (W2) launch_f<T, true>(a, path, nt, max_groups, max_count, st); \
        else launch_f<T, false>(a, path, nt, max_groups, max_count, st);   \
        break;
        FLOAT_CASES(CASE_F)
#undef CASE_F
    default: return fail(ST_EUNSUPPORTED, "linear: quant type %d", W.type);
    }
    LAUNCHED("linear");
    return ST_OK;
}

/* h = silu(Wg . x) * (Wu . x): one fused launch, or three when the two weights have
 * different quant types (gate into tmp, up into h, then the product). */
static stg_status swiglu(cudaStream_t st, const dtensor &Wg, const dtensor &Wu, const lin_groups &g, int max_groups,
                         int expected, int max_count, const acts_d &in, float *h, int64_t ldo, float *tmp,
                         int64_t n_rows, const fused_quant *fq = nullptr) {
    if (fq) *fq->done = false;
    if (Wg.type == Wu.type)
        return linear(st, Wg, &Wu, g, max_groups, expected, max_count, in, h, ldo, MODE_STORE, STG_PATH_AUTO, nullptr, fq);
    CHECK(linear(st, Wg, nullptr, g, max_groups, expected, max_count, in, tmp, ldo, MODE_STORE));
    CHECK(linear(st, Wu, nullptr, g, max_groups, expected, max_count, in, h, ldo, MODE_STORE));
    const int64_t n = n_rows * ldo;
    launch_k(k_silu_mul, (unsigned)((n + 255) / 256), 256, 0, st, h, tmp, n);
    LAUNCHED("silu");
    return ST_OK;
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

/* ------------------------------------------------------------------ the step */

static stg_status validate_batch(const stg_model *m, const stg_kv *kv, const st_batch *b) {
    if (b->n_tokens < 1) return fail(ST_EINVAL, "forward: empty batch");
    if (!b->tokens || !b->pos || !b->seq || !b->block_tables || b->n_seqs < 1 || b->max_blocks < 1)
        return fail(ST_EINVAL, "forward: batch is missing arrays");
    if (b->n_logits < 0 || (b->n_logits > 0 && (!b->logit_idx || (!b->logits && !b->out_tokens))))
        return fail(ST_EINVAL, "forward: logits requested without buffers (logits or out_tokens)");
    for (int32_t i = 0; i < b->n_tokens; i++) {
        const int32_t src = b->token_src ? b->token_src[i] : -1;
        if (src >= 0 && m->last_picks < 1)
            return fail(ST_EINVAL, "forward: token_src[%d] = %d but the previous step left no greedy picks", i, src);
        if (src < -1 || src >= m->last_picks)
            return fail(ST_ERANGE, "forward: token_src[%d] = %d outside [-1, %d)", i, src, m->last_picks);
        if (src < 0 && (b->tokens[i] < 0 || b->tokens[i] >= m->d.n_vocab))
            return fail(ST_ERANGE, "forward: token id %d out of range [0, %d)", b->tokens[i], m->d.n_vocab);
        if (b->seq[i] < 0 || b->seq[i] >= b->n_seqs)
            return fail(ST_ERANGE, "forward: sequence index %d out of range", b->seq[i]);
        if (b->pos[i] < 0 || b->pos[i] / kv->block_size >= b->max_blocks)
            return fail(ST_ERANGE, "forward: position %d exceeds the sequence's KV capacity (%d tokens)", b->pos[i],
                        b->max_blocks * kv->block_size);
        const int32_t *bt = b->block_tables + (size_t)b->seq[i] * (size_t)b->max_blocks;
        for (int32_t j = 0; j <= b->pos[i] / kv->block_size; j++)
            if (bt[j] < 0 || bt[j] >= kv->n_blocks)
                return fail(ST_ERANGE, "forward: block %d of sequence %d is %d, outside [0, %d)", j, b->seq[i], bt[j],
                            kv->n_blocks);
    }
    for (int32_t i = 0; i < b->n_logits; i++)
        if (b->logit_idx[i] < 0 || b->logit_idx[i] >= b->n_tokens)
            return fail(ST_ERANGE, "forward: logit index %d out of range", b->logit_idx[i]);
    return ST_OK;
}

static stg_status embed(stg_model *m, const int32_t *tokens, const int32_t *src, int32_t T) {
    const dtensor &t = m->token_embd;
    const int64_t E = m->d.n_embd;
    cudaStream_t st = m->stream;
    switch (t.type) {
#define CASE_E(TY)                                                                         \
    case TY: launch_k(k_embed<TY>, T, 128, 0, st, t.d, t.row_bytes, tokens, src, (const int32_t *)m->s.picks, E, m->s.x); break;
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

/* k_attention with its dynamic shared memory (two chunk stages up to head_dim 128, one above:
 * at most 64 KiB, within every targeted GPU's limit once opted in). */
#define ATT_SMEM_MAX 65536
#include "attention_mma.cuh" /* tensor-core prefill attention; here because its host side launches with launch_k */
/* The GEMMs that stage bytes in dynamic shared memory (gemm_raw): their size opted in (with the
 * static arrays over 48 KiB) and the largest shared-memory carve-out, so that 3 blocks fit an SM. */
template <int T, bool SW, int BN> static stg_status gemm_setup_one(void) {
    if constexpr (gemm_raw_bytes<T, SW, BN>() > 0) {
        for (const int K : {1024, 2048, 4096, 3072}) { /* CS = 1, 2, 4 and the general loop (C = 3) */
            const gemm_fn f = gemm_kernel<T, SW, BN>(K);
            CU(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, gemm_raw_bytes<T, SW, BN>()),
               "gemm setup");
            CU(cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
               "gemm setup");
        }
    }
    return ST_OK;
}
static stg_status gemm_setup(void) {
#define SETUP_GEMM(T)                                  \
    CHECK((gemm_setup_one<T, false, MM_BN>()));        \
    CHECK((gemm_setup_one<T, false, MM_BN_WIDE>()));   \
    CHECK((gemm_setup_one<T, true, MM_BN>()));
    QUANT_CASES(SETUP_GEMM)
#undef SETUP_GEMM
    for (const int K : {1024, 2048, 4096}) { /* the routed split form: CS = 1, 2, 4 */
        const gemm_fn f = gemm_rs_kernel<STG_Q4_K>(K);
        CU(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, gemm_raw_bytes<STG_Q4_K, true>()),
           "gemm setup");
        CU(cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
           "gemm setup");
    }
    for (const int K : {1024, 2048, 4096}) { /* the prefill form: CS = 1, 2, 4 */
        const gemm_fn fs[4] = {gemm_fast_kernel<false, MM_BN_WIDE>(K), gemm_fast_kernel<false, MM_BN_FAST>(K),
                               gemm_fast_kernel<true, MM_BN_WIDE>(K), gemm_fast_kernel<true, MM_BN_FAST>(K)};
        const int bytes[4] = {gemm_raw_bytes<STG_Q4_K, false, MM_BN_WIDE>(), gemm_raw_bytes<STG_Q4_K, false, MM_BN_FAST>(),
                              gemm_raw_bytes<STG_Q4_K, true, MM_BN_WIDE>(), gemm_raw_bytes<STG_Q4_K, true, MM_BN_FAST>()};
        for (int i = 0; i < 4; i++) {
            CU(cudaFuncSetAttribute(fs[i], cudaFuncAttributeMaxDynamicSharedMemorySize, bytes[i]), "gemm setup");
            CU(cudaFuncSetAttribute(fs[i], cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
               "gemm setup");
        }
    }
    return ST_OK;
}

static stg_status attention_setup(void) { /* once per device, outside any capture; the GEMMs' too */
    CHECK(gemm_setup());
    void (*const att_forms[])(attn_args) = {k_attention<false, 0>, k_attention<true, 0>, k_attention<true, 128>,
                                            k_attention<true, 128, true>};
    for (auto f : att_forms)
        CU(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM_MAX), "attention setup");
    CU(cudaFuncSetAttribute(k_attention_tile<32>, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM_MAX),
       "attention setup");
    CU(cudaFuncSetAttribute(k_attention_tile<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM_MAX),
       "attention setup");
    CU(cudaFuncSetAttribute(k_attention_tile<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM_MAX),
       "attention setup");
    CHECK(attention_mma_setup());
    return ST_OK;
}

/* Query tiles (k_attention_tile) for a model: head_dim 32, 64 or 128 and G = n_head / n_kv
 * dividing ATT_TR; 0 otherwise. Tokens per tile. */
static int att_tile_tokens(int32_t n_head, int32_t n_kv, int32_t hd) {
    if (n_kv < 1 || n_head % n_kv || (hd != 32 && hd != 64 && hd != 128)) return 0;
    const int G = n_head / n_kv;
    return G <= ATT_TR && ATT_TR % G == 0 ? ATT_TR / G : 0;
}
/* This step's mma tiles (attention_mma.cuh), after its n_tiles query tiles in d_tiles, and their q
 * mode; set per step by stg_forward (0 for graph steps). */
static thread_local int32_t g_att_mma_tiles = 0;
static thread_local int g_att_mma_mode = 2;
/* Tiles of a step: runs of consecutive tokens of one sequence, at most tq tokens each, packed
 * as first_token * 32 + count. Returns how many were written to out (at most T). */
static int32_t att_tiles(const int32_t *seq, int32_t T, int tq, int32_t *out) {
    int32_t n = 0;
    for (int32_t i = 0; i < T;) {
        int32_t j = i + 1;
        while (j < T && j - i < tq && seq[j] == seq[i]) j++;
        out[n++] = i * 32 + (j - i);
        i = j;
    }
    return n;
}
static stg_status launch_attention_tile(const attn_args &aa, const int32_t *d_tiles, int32_t n_tiles, cudaStream_t st) {
    const size_t smem = att_smem_bytes(aa.hd, 2);
    const dim3 grid((unsigned)n_tiles, (unsigned)aa.n_kv);
    if (aa.hd == 128) launch_k(k_attention_tile<128>, grid, ATT_WARPS * 32, smem, st, aa, d_tiles);
    else if (aa.hd == 64) launch_k(k_attention_tile<64>, grid, ATT_WARPS * 32, smem, st, aa, d_tiles);
    else if (aa.hd == 32) launch_k(k_attention_tile<32>, grid, ATT_WARPS * 32, smem, st, aa, d_tiles);
    else return fail(ST_EUNSUPPORTED, "attention tiles: head_dim %d", aa.hd);
    LAUNCHED("attention (query tiles)");
    return ST_OK;
}

/* k_attention's default at decode: one chunk stage (half the shared memory, more blocks per SM) from
 * ATT_ONE_STAGE_MIN tokens, two below. 1,024 blocks at 32 sequences: one stage -0.2 / -0.29 / -0.35 to
 * -0.47 ms a step (runs 42, 48, 53), 16 sequences -0.05 to -0.08 (run 53), 8 sequences +0.06 (run 53).
 * The stages change when copies are issued, not the arithmetic: same bits. */
#define ATT_ONE_STAGE_MIN 16
static stg_status launch_attention(attn_args &aa, int32_t n_tok, cudaStream_t st) {
    aa.stages = aa.hd <= 128 ? (n_tok >= ATT_ONE_STAGE_MIN ? 1 : 2) : 1;
    const size_t smem = att_smem_bytes(aa.hd, aa.stages);
    if (smem > ATT_SMEM_MAX) return fail(ST_EUNSUPPORTED, "attention: head_dim %d needs too much shared memory", aa.hd);
    const dim3 grid((unsigned)n_tok, (unsigned)aa.n_head);
    const bool half2 = aa.hd % 64 == 0;
    if (half2 && aa.hd == 128 && aa.fused && aa.qa.rope_dim <= 128)
        launch_k(k_attention<true, 128, true>, grid, ATT_WARPS * 32, smem, st, aa);
    else if (half2 && aa.hd == 128) launch_k(k_attention<true, 128>, grid, ATT_WARPS * 32, smem, st, aa);
    else if (half2) launch_k(k_attention<true, 0>, grid, ATT_WARPS * 32, smem, st, aa);
    else launch_k(k_attention<false, 0>, grid, ATT_WARPS * 32, smem, st, aa);
    LAUNCHED("attention");
    return ST_OK;
}

/* The routed experts' weighted sum waits in pair_out for the next RMSNorm (which adds it to
 * the residual first); take_combine hands it over once. */
static combine_args take_combine(stg_model *m) {
    const combine_args c = m->pending;
    m->pending = combine_args{};
    return c;
}

static stg_status attention_block(stg_model *m, stg_kv *kv, int il, int32_t T, const int32_t *d_pos,
                                  const int32_t *d_seq, const int32_t *d_bt, int32_t max_blocks, bool fuse_qkv,
                                  const int32_t *d_tiles, int32_t n_tiles) {
    const dlayer &L = m->L[(size_t)il];
    scratch &s = m->s;
    const st_model_desc &d = m->d;
    cudaStream_t st = m->stream;
    const int64_t E = d.n_embd;
    const bool nq = !stg_is_float(L.wq.type) || !stg_is_float(L.wk.type) || !stg_is_float(L.wv.type);
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
        g_defer_combine = fuse_qkv, g_deferred = false; /* only the fused attention reads q/k/v */
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
    qa.inv_freq = m->inv_freq;
    qa.pos = d_pos, qa.seq = d_seq, qa.block_tables = d_bt, qa.max_blocks = max_blocks;
    qa.n_head = d.n_head, qa.n_kv = d.n_head_kv, qa.hd = d.head_dim, qa.rope_dim = d.rope_dim;
    qa.rope_type = d.rope_type, qa.block_size = kv->block_size, qa.eps = d.norm_eps;
    qa.scale = 1.0f / sqrtf((float)d.head_dim);
    qa.kc = kv->k + (int64_t)il * kv->layer_elems, qa.vc = kv->v + (int64_t)il * kv->layer_elems;
    qa.kpart = qkv_parts ? g_kpart : nullptr, qa.kp_n = m->q_dim + 2 * m->kv_dim, qa.kp_t = T;
    if (!fuse_qkv) {
        launch_k(k_qkv_post, dim3((unsigned)T, (unsigned)((d.n_head + 2 * d.n_head_kv + QKV_WARPS - 1) / QKV_WARPS)),
                 QKV_WARPS * 32, 0, st, qa);
        LAUNCHED("qkv");
    }
    /* the output projection's 8-bit input comes out of the attention kernel itself */
    const bool oq = !stg_is_float(L.wo.type);
    const bool fused_q = oq && d.head_dim % 32 == 0;
    attn_args aa = {};
    aa.q = s.q, aa.out = s.att, aa.kc = qa.kc, aa.vc = qa.vc, aa.pos = d_pos, aa.seq = d_seq, aa.block_tables = d_bt;
    aa.max_blocks = max_blocks, aa.n_head = d.n_head, aa.n_kv = d.n_head_kv, aa.hd = d.head_dim;
    aa.block_size = kv->block_size;
    aa.aq = fused_q ? s.aq : nullptr, aa.ad = s.ad, aa.as = s.as;
    aa.fused = fuse_qkv ? 1 : 0, aa.qa = qa;
    aa.pre = fuse_qkv ? 1 : 0;
    if (il + 1 < kv->n_layer) /* the fused head prep's warp 3 prefetches the next layer's K / V into L2 */
        aa.kc_next = kv->k + (int64_t)(il + 1) * kv->layer_elems, aa.vc_next = kv->v + (int64_t)(il + 1) * kv->layer_elems;
    if ((n_tiles > 0 || g_att_mma_tiles > 0) && !fuse_qkv) {
        aa.stages = 2;
        if (n_tiles > 0) CHECK(launch_attention_tile(aa, d_tiles, n_tiles, st));
        if (g_att_mma_tiles > 0)
            CHECK(launch_attention_mma(aa, d_tiles + n_tiles, g_att_mma_tiles, g_att_mma_mode, st));
    } else {
        CHECK(launch_attention(aa, T, st));
    }
    stg_status rc = ST_OK;
    const acts_d ain = fused_q ? acts_d{s.aq, s.ad, s.as, s.att} : layer_acts(m, s.att, T, m->q_dim, oq, &rc);
    CHECK(rc);
    /* the FFN block's RMSNorm (next on the stream) adds the parts to the residual (take_combine) */
    g_defer_combine = !m->pending.pair_out && !m->pending.kpart, g_deferred = false;
    const stg_status lrc = linear(st, L.wo, nullptr, g, 1, T, T, ain, s.x, E, MODE_ADD);
    g_defer_combine = false;
    if (g_deferred) m->pending.kpart = g_kpart, m->pending.kp_t = T;
    return lrc;
}

/* Dense FFN (or a shared expert) over all T tokens of xn (quantised in aq by the norm):
 * result into pair_out[T, E]. */
static stg_status dense_ffn(stg_model *m, int32_t T, const dtensor &Wg, const dtensor &Wu, const dtensor &Wd) {
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
    if (!stg_is_float(Wd.type) && !fused) CHECK(quantize(st, s.h, T, F, s.hq, s.hd, s.hs));
    return linear(st, Wd, nullptr, g, 1, T, T, acts_d{s.hq, s.hd, s.hs, s.h}, s.pair_out, E, MODE_STORE);
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
    if (d.n_expert == 0) { /* dense FFN: x += ffn(xn) */
        CHECK(dense_ffn(m, T, L.ffn_gate, L.ffn_up, L.ffn_down));
        launch_k(k_add_scaled, (unsigned)((T * E + 255) / 256), 256, 0, st, s.x, s.pair_out, nullptr, T, E);
        LAUNCHED("residual");
        return ST_OK;
    }
    const int ne = d.n_expert, k = d.n_expert_used;
    const acts_d rin{s.aq, s.ad, s.as, s.xn};
    lin_groups g1 = {};
    g1.n_pairs = T;
    const int32_t P = T * k;
    const size_t rr_smem = (size_t)(LIN_WARPS + 2 + T) * ne * sizeof(float);
    if (T <= 8 && stg_is_float(L.gate_inp.type) && ne <= 1024 && rr_smem <= 48 * 1024) {
        /* decode: router logits, routing and grouping in one launch */
        lin_args a = {};
        a.w = L.gate_inp.d, a.row_bytes = L.gate_inp.row_bytes, a.expert_stride = L.gate_inp.expert_stride;
        a.N = ne, a.K = (int32_t)L.gate_inp.ne[0], a.g = g1, a.x = s.xn, a.out = s.router, a.ldo = ne;
        a.mode = MODE_STORE;
        route_args ra = {m->route_counter, T, ne, k, s.topk_id, s.gexp, s.gstart, s.gcount, s.n_groups, s.list,
                         s.pair_tok, m->hist + (int64_t)il * ne, s.topk_w, s.gtiles, s.n_gtiles, 0};
        int nt = 1;
        while (nt < T) nt *= 2;
        ra.pre = nt <= 2 && a.K <= ROUTER_PRE * LIN_WARPS * WARP ? 1 : 0;
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
        launch_k(k_route, 1, ROUTE_WARPS * 32, route_smem, st, s.router, T, ne, k, s.topk_id, s.topk_w, s.gexp, s.gstart,
                                                         s.gcount, s.n_groups, s.list, s.pair_tok,
                                                         m->hist + (int64_t)il * ne, s.gtiles, s.n_gtiles);
        LAUNCHED("route");
    } else {
        launch_k(k_router, (T + ROUTER_WARPS - 1) / ROUTER_WARPS, ROUTER_WARPS * 32, ROUTER_WARPS * ne * sizeof(float), st, 
            s.router, T, ne, k, s.topk_id, s.topk_w, 0);
        LAUNCHED("router");
        launch_k(k_group, 1, 1024, 2 * ne * sizeof(int32_t), st, s.topk_id, P, k, ne, s.gexp, s.gstart, s.gcount,
                                                           s.n_groups, s.list, s.pair_tok, m->hist + (int64_t)il * ne,
                                                           s.gtiles, s.n_gtiles, 0);
        LAUNCHED("group");
    }
    }
    /* gate+up over every (token, expert) pair, grouped by expert: one launch */
    lin_groups ge = {};
    ge.gexp = s.gexp, ge.gstart = s.gstart, ge.gcount = s.gcount, ge.n_groups = s.n_groups;
    ge.list = s.list, ge.in_map = s.pair_tok;
    ge.n_pairs = P, ge.tiles = s.gtiles, ge.n_tiles = s.n_gtiles;
    const int max_groups = std::min(ne, P), expected = (P + ne - 1) / ne;
    const int64_t F = m->n_ff_exp;
    const acts_d ein = rin;
    bool fused = false;
    const fused_quant fq{s.hq, s.hd, s.hs, &fused};
    CHECK(swiglu(st, L.gate_exps, L.up_exps, ge, max_groups, expected, T, ein, s.h, F, s.h2, P,
                 stg_is_float(L.down_exps.type) ? nullptr : &fq));
    if (!stg_is_float(L.down_exps.type) && !fused) CHECK(quantize(st, s.h, P, F, s.hq, s.hd, s.hs));
    lin_groups gd = ge;
    gd.in_map = nullptr; /* down reads the pair's own hidden row */
    CHECK(linear(st, L.down_exps, nullptr, gd, max_groups, expected, T, acts_d{s.hq, s.hd, s.hs, s.h}, s.pair_out, E,
                 MODE_STORE));
    if (!L.gate_shexp.d) { /* added by the next RMSNorm (this order of additions is the CPU's) */
        m->pending = combine_args{s.pair_out, s.topk_w, k, d.expert_norm, nullptr, 0};
        return ST_OK;
    }
    launch_k(k_combine, (unsigned)((T * E + 255) / 256), 256, 0, st, s.x, s.pair_out, s.topk_w, T, k, E, d.expert_norm);
    LAUNCHED("combine");
    launch_k(k_shexp_gate, (T + 3) / 4, 128, 0, st, s.xn, L.gate_inp_shexp.d ? L.gate_inp_shexp.f() : nullptr, T, E, s.gsh);
    LAUNCHED("shared expert gate");
    CHECK(dense_ffn(m, T, L.gate_shexp, L.up_shexp, L.down_shexp));
    launch_k(k_add_scaled, (unsigned)((T * E + 255) / 256), 256, 0, st, s.x, s.pair_out, s.gsh, T, E);
    LAUNCHED("shared expert add");
    return ST_OK;
}

/* The step's greedy pick runs k_argmax_split with ARGMAX_SPLIT blocks of 256 threads per row: more SMs for the
 * few rows of a decode step than one block per row. */
#define ARGMAX_SPLIT 16

/* The device work of one step (everything between the batch upload and the logits
 * download): captured once per shape as a CUDA graph for small batches. */
struct step_shape {
    int32_t T, NL, mb;
    const int32_t *d_tok, *d_pos, *d_seq, *d_lidx, *d_bt;
    bool capturing;    /* inside a graph capture: events become record nodes */
    bool layer_events; /* per-layer attention / FFN times (stg_settings.layer_events) */
    bool fuse_qkv;     /* every token of another sequence: q/k/v post-processing inside attention */
    const int32_t *d_tiles; /* query tiles of prefill attention (eager steps only; n_tiles 0: none) */
    int32_t n_tiles;
    bool greedy; /* the logit rows' greedy picks into s.picks after the head (k_argmax_split) */
    const int32_t *d_src; /* st_batch.token_src uploaded, or NULL: the embedding reads the previous picks */
};

/* An event record that also works inside a capture (there a plain record would only
 * express a dependency; the External flag makes it a node that records at each replay). */
static cudaError_t record(cudaEvent_t e, cudaStream_t st, bool capturing) {
    return cudaEventRecordWithFlags(e, st, capturing ? cudaEventRecordExternal : cudaEventRecordDefault);
}

static stg_status run_step(stg_model *m, stg_kv *kv, const step_shape &sh) {
    scratch &s = m->s;
    cudaStream_t st = m->stream;
    cudaEvent_t *ev = m->ev.data();
    const int nL = m->d.n_layer;
    const int64_t E = m->d.n_embd;
    if (m->d.n_expert > 0) CU(cudaMemsetAsync(m->hist, 0, sizeof(int32_t) * nL * m->d.n_expert, st), "forward");
    m->pending = combine_args{};
    const bool pdl = g_pdl;
    g_pdl = false; /* the first kernel follows a copy, not a kernel */
    const stg_status erc = embed(m, sh.d_tok, sh.d_src, sh.T);
    g_pdl = pdl;
    CHECK(erc);
    for (int il = 0; il < nL; il++) {
        if (sh.layer_events) CU(record(ev[3 * il], st, sh.capturing), "forward");
        CHECK(attention_block(m, kv, il, sh.T, sh.d_pos, sh.d_seq, sh.d_bt, sh.mb, sh.fuse_qkv, sh.d_tiles,
                              sh.n_tiles));
        if (sh.layer_events) CU(record(ev[3 * il + 1], st, sh.capturing), "forward");
        CHECK(ffn_block(m, il, sh.T));
        if (sh.layer_events) CU(record(ev[3 * il + 2], st, sh.capturing), "forward");
    }
    CU(record(ev[3 * nL + 1], st, sh.capturing), "forward");
    if (sh.NL > 0) {
        const bool nq = !stg_is_float(m->output.type);
        launch_k(k_rmsnorm, sh.NL, RMS_THREADS, 0, st, s.x, sh.d_lidx, m->output_norm.f(), s.xl, E, m->d.norm_eps,
                                          nq ? s.aq : nullptr, s.ad, s.as, take_combine(m));
        LAUNCHED("output norm");
        const acts_d in{s.aq, s.ad, s.as, s.xl};
        lin_groups g = {};
        g.n_pairs = sh.NL;
        const bool fast = g_gemm_fast;
        g_gemm_fast = false; /* the head keeps the bitwise kernels (a few rows of logits: the matvec) */
        const stg_status hrc = linear(st, m->output, nullptr, g, 1, sh.NL, sh.NL, in, s.logits, m->d.n_vocab, MODE_STORE);
        g_gemm_fast = fast;
        CHECK(hrc);
        if (sh.greedy) {
            launch_k(k_argmax_split, dim3((unsigned)ARGMAX_SPLIT, (unsigned)sh.NL), ARGMAX_SPLIT_THREADS, 0, st,
                     (const float *)s.logits, (int64_t)m->d.n_vocab, s.picks, s.pick_keys, s.pick_cnt);
            LAUNCHED("greedy pick");
        }
    }
    m->pending = combine_args{}; /* no logits: the last layer's sum is never needed */
    return ST_OK;
}

#define GRAPH_MAX_TOKENS 64 /* decode-sized steps: launch-bound, so replayed as graphs */
#define LAYER_EVENT_PERIOD 64 /* graph-sized steps: per-layer events on one step in 64 (each such step +0.2 ms at batch 1) */
#define GRAPH_CACHE 64

static bool graphs_enabled(const stg_model *m, int32_t T) { return T <= GRAPH_MAX_TOKENS && m->set.graphs; }

/* Replay the graph of this shape, capturing it first; a shape that cannot be captured
 * runs eagerly. Graphs hold scratch pointers: ensure_scratch drops them on growth. */
static stg_status run_step_graph(stg_model *m, stg_kv *kv, const step_shape &sh) {
    cudaStream_t st = m->stream;
    for (const graph_entry &g : m->graphs)
        if (g.kv == kv && g.T == sh.T && g.NL == sh.NL && g.mb == sh.mb && g.n_seq_rows == m->s.cur_seq_rows &&
            g.layer_events == sh.layer_events && g.fuse_qkv == sh.fuse_qkv && g.greedy == sh.greedy &&
            g.src == (sh.d_src != nullptr)) {
            CU(cudaGraphLaunch(g.exec, st), "forward: graph launch");
            return ST_OK;
        }
    if (m->graphs.size() >= GRAPH_CACHE) {
        CU(cudaStreamSynchronize(st), "forward: graph cache"); /* a launched step may be running one of them */
        drop_graphs(m);
    }
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "forward: capture");
    step_shape cap = sh;
    cap.capturing = true;
    const stg_status rc = run_step(m, kv, cap);
    cudaGraph_t graph = nullptr;
    const cudaError_t ce = cudaStreamEndCapture(st, &graph);
    cudaGraphExec_t exec = nullptr;
    if (rc == ST_OK && ce == cudaSuccess && graph && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
        cudaGraphDestroy(graph);
        m->graphs.push_back(graph_entry{kv, sh.T, sh.NL, sh.mb, m->s.cur_seq_rows, sh.layer_events, sh.fuse_qkv, sh.greedy,
                                        sh.d_src != nullptr, exec});
        CU(cudaGraphLaunch(exec, st), "forward: graph launch");
        return ST_OK;
    }
    if (graph) cudaGraphDestroy(graph);
    m->graph_failures++;
    snprintf(m->graph_note, sizeof m->graph_note, "capture of a %d-token step failed: %.200s", sh.T,
             rc != ST_OK ? g_err : cudaGetErrorString(ce != cudaSuccess ? ce : cudaGetLastError()));
    cudaGetLastError();
    if (rc != ST_OK) return rc;
    return run_step(m, kv, sh); /* not capturable here: run it as is */
}

/* The step in two halves. step_launch validates, uploads (from the ticket's staging slot), queues
 * the step and its copies back (picks and histogram into the slot's pinned buffers) and the slot's
 * end event; it returns without waiting. step_wait synchronises on that event and fills the outputs.
 * stg_forward is the two back to back (and alone may copy logits). */
static stg_status step_launch(stg_model *m, stg_kv *kv, const st_batch *b, int64_t *ticket) {
    if (m->n_live >= 2)
        return fail(ST_EINVAL, "step_launch: two launched steps are in flight already (wait for the older first)");
    CHECK(validate_batch(m, kv, b));
    CU(cudaSetDevice(m->device), "forward");
    cudaGetLastError(); /* a failed call elsewhere must not be reported by this step's first check */
    const int32_t T = b->n_tokens, NL = b->n_logits;
    const int64_t tk = m->next_ticket;
    inflight &f = m->fl[tk & 1];
    const inflight &other = m->fl[(tk + 1) & 1];
    /* block tables padded to a multiple of 16 columns (-1), so a graph serves a range of lengths */
    const int32_t mb = (b->max_blocks + 15) / 16 * 16;
    const int64_t n_bt = (int64_t)b->n_seqs * mb;
    CHECK(ensure_scratch(m, T, NL, n_bt));
    scratch &s = m->s;
    s.cur_seq_rows = b->n_seqs;
    cudaStream_t st = m->stream;
    const int nL = m->d.n_layer;
    const bool moe = m->d.n_expert > 0;
    if (!f.e0) CU(cudaEventCreate(&f.e0), "forward: events");
    if (!f.e1) CU(cudaEventCreate(&f.e1), "forward: events");
    const bool greedy = NL > 0 && b->out_tokens;
    if (greedy && NL > f.cap_picks) { /* the slot is free: nothing queued writes into it */
        if (f.h_picks) cudaFreeHost(f.h_picks);
        f.h_picks = nullptr, f.cap_picks = 0;
        const int64_t want = std::max<int64_t>(NL, 64);
        CU(cudaMallocHost(&f.h_picks, sizeof(int32_t) * (size_t)want), "pinned picks");
        f.cap_picks = want;
    }
    if (moe && !f.h_hist)
        CU(cudaMallocHost(&f.h_hist, sizeof(int32_t) * (size_t)nL * (size_t)m->d.n_expert), "pinned histogram");
    CU(cudaEventRecord(f.e0, st), "forward");
    /* one upload of the batch's index arrays, from this ticket's staging slot (the other slot's upload
     * may still be queued behind the step in flight) */
    int32_t *hi = s.h_ints + (tk & 1) * s.cap_ints;
    memcpy(hi, b->tokens, sizeof(int32_t) * T);
    memcpy(hi + T, b->pos, sizeof(int32_t) * T);
    memcpy(hi + 2 * T, b->seq, sizeof(int32_t) * T);
    if (NL) memcpy(hi + 3 * T, b->logit_idx, sizeof(int32_t) * NL);
    int32_t *hbt = hi + 3 * T + NL;
    for (int32_t r = 0; r < b->n_seqs; r++) {
        memcpy(hbt + (int64_t)r * mb, b->block_tables + (int64_t)r * b->max_blocks, sizeof(int32_t) * b->max_blocks);
        for (int32_t c = b->max_blocks; c < mb; c++) hbt[(int64_t)r * mb + c] = -1;
    }
    /* query tiles for prefill attention: eager steps only (a graph's grid could not follow
     * the tile count), after the block tables (ensure_scratch leaves room for T more ints) */
    const int tq = att_tile_tokens(m->d.n_head, m->d.n_head_kv, m->d.head_dim);
    int32_t n_tiles = 0, n_mma = 0;
    const bool tiles_wanted = tq > 0 && !graphs_enabled(m, T);
    /* runs of at least att_mma_min tokens on the tensor cores (attention_mma.cuh) */
    const int mma_mode = m->set.att_mma, tqm = mma_mode ? att_mma_tokens(m->d.n_head, m->d.n_head_kv, m->d.head_dim) : 0;
    if (tiles_wanted && tqm) att_split_tiles(b->seq, T, tq, tqm, m->set.att_mma_min, hi + 3 * T + NL + n_bt, &n_tiles, &n_mma);
    else if (tiles_wanted) n_tiles = att_tiles(b->seq, T, tq, hi + 3 * T + NL + n_bt);
    int64_t n_ints = 3 * T + NL + n_bt + n_tiles + n_mma;
    /* token_src after them (ensure_scratch leaves room for T more ints): only when a row uses it */
    bool use_src = false;
    for (int32_t i = 0; b->token_src && i < T && !use_src; i++) use_src = b->token_src[i] >= 0;
    const int64_t src_off = n_ints;
    if (use_src) {
        memcpy(hi + n_ints, b->token_src, sizeof(int32_t) * T);
        n_ints += T;
    }
    CU(cudaMemcpyAsync(s.ints, hi, sizeof(int32_t) * n_ints, cudaMemcpyHostToDevice, st), "forward: upload batch");
    /* Per-layer events cost about 7% of a batch-1 decode step (runs 12-18: 96 record nodes in
     * a 3.3 ms graph), so graph-sized steps record them on the first step of each size and then
     * every LAYER_EVENT_PERIOD-th; the others report t_total (always measured) split by the
     * shares of the last measured step of their size. layer_events 1: every step; 0: never
     * (then t_attn / t_experts / t_dense stay 0). Eager steps always record them.
     * A step launched while one that records them is in flight records none (the events are
     * shared: it would overwrite them before that step's wait reads them). */
    const int32_t le = m->set.layer_events;
    bool layer_events = true;
    const bool sampled = le < 0 && graphs_enabled(m, T);
    if (le >= 0) layer_events = le != 0;
    else if (sampled) {
        stg_model::split &sp = m->splits[T];
        layer_events = !sp.have || sp.steps % LAYER_EVENT_PERIOD == 0;
        sp.steps++;
    }
    if (other.live && other.layer_events) layer_events = false;
    /* q/k/v post-processing inside attention when no token reads another's new K/V of this
     * step: every token of a different sequence (decode). */
    bool fuse_qkv = m->d.head_dim <= 256;
    if (fuse_qkv) {
        std::vector<char> &seen = m->seq_seen;
        seen.assign((size_t)b->n_seqs, 0);
        for (int32_t i = 0; i < T && fuse_qkv; i++) {
            if (seen[(size_t)b->seq[i]]) fuse_qkv = false;
            seen[(size_t)b->seq[i]] = 1;
        }
    }
    const step_shape sh{T,     NL, mb, s.ints, s.ints + T, s.ints + 2 * T, s.ints + 3 * T, s.ints + 3 * T + NL,
                        false, layer_events, fuse_qkv, s.ints + 3 * T + NL + n_bt, fuse_qkv ? 0 : n_tiles, greedy,
                        use_src ? s.ints + src_off : nullptr};
    g_att_mma_tiles = fuse_qkv ? 0 : n_mma, g_att_mma_mode = mma_mode;
    g_set = m->set;
    g_defer_combine = g_deferred = false;
    g_gemm_fast = !graphs_enabled(m, T) && all_runs_long(b->seq, T, m->set.gemm_fast_min);
    g_pdl = m->cc_major >= 9 && m->set.pdl && !g_gemm_fast; /* see g_gemm_fast */
    g_kpart = s.kpart, g_kpart_cap = s.kpart_cap;
    m->last_picks = 0; /* s.picks is this step's from here on */
    const stg_status src = graphs_enabled(m, T) ? run_step_graph(m, kv, sh) : run_step(m, kv, sh);
    g_pdl = false;
    CHECK(src);
    if (NL > 0 && b->logits)
        CU(cudaMemcpyAsync(b->logits, s.logits, sizeof(float) * (size_t)NL * m->d.n_vocab, cudaMemcpyDeviceToHost, st),
           "forward: logits");
    if (greedy)
        CU(cudaMemcpyAsync(f.h_picks, s.picks, sizeof(int32_t) * (size_t)NL, cudaMemcpyDeviceToHost, st),
           "forward: greedy picks");
    if (moe) /* always: the stats count pairs and active experts */
        CU(cudaMemcpyAsync(f.h_hist, m->hist, sizeof(int32_t) * (size_t)nL * m->d.n_expert, cudaMemcpyDeviceToHost, st),
           "forward: histogram");
    CU(cudaEventRecord(f.e1, st), "forward");
    f.live = true, f.ticket = tk, f.T = T, f.NL = NL, f.greedy = greedy;
    f.layer_events = layer_events, f.sampled = sampled, f.moe = moe, f.expert_hist = b->expert_hist;
    m->next_ticket++;
    m->n_live++;
    m->last_picks = greedy ? NL : 0;
    *ticket = tk;
    return ST_OK;
}

static stg_status step_wait(stg_model *m, int64_t ticket, int32_t *out_tokens, st_step_stats *stt) {
    const int64_t oldest = m->fl[0].live && (!m->fl[1].live || m->fl[0].ticket < m->fl[1].ticket) ? m->fl[0].ticket
                           : m->fl[1].live ? m->fl[1].ticket : 0;
    if (!oldest) return fail(ST_EINVAL, "step_wait: no launched step is in flight");
    if (ticket != oldest)
        return fail(ST_EINVAL, "step_wait: ticket %lld is not the oldest step in flight (%lld): wait in launch order",
                    (long long)ticket, (long long)oldest);
    inflight &f = m->fl[ticket & 1];
    const bool later = m->fl[(ticket + 1) & 1].live; /* a step launched after this one */
    if (f.greedy && !out_tokens) return fail(ST_EINVAL, "step_wait: the step has picks but out_tokens is NULL");
    f.live = false; /* from here on the ticket is spent, whatever happens */
    m->n_live--;
    memset(stt, 0, sizeof *stt);
    CU(cudaSetDevice(m->device), "forward");
    CU(cudaEventSynchronize(f.e1), "forward");
    CU(cudaGetLastError(), "forward");
    if (f.greedy) memcpy(out_tokens, f.h_picks, sizeof(int32_t) * (size_t)f.NL);
    const int nL = m->d.n_layer;
    cudaEvent_t *ev = m->ev.data();
    int64_t pairs = 0;
    int32_t active = 0;
    if (f.moe) {
        const size_t nh = (size_t)nL * m->d.n_expert;
        for (size_t i = 0; i < nh; i++) {
            pairs += f.h_hist[i], active += f.h_hist[i] > 0;
            if (f.expert_hist) f.expert_hist[i] += f.h_hist[i];
        }
    }
    auto elapsed = [](cudaEvent_t a, cudaEvent_t b) -> double {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess) {
            cudaGetLastError();
            return 0.0;
        }
        return 1e-3 * ms;
    };
    for (int il = 0; il < nL && f.layer_events; il++) {
        stt->t_attn += elapsed(ev[3 * il], ev[3 * il + 1]);
        if (f.moe) stt->t_experts += elapsed(ev[3 * il + 1], ev[3 * il + 2]);
        else stt->t_dense += elapsed(ev[3 * il + 1], ev[3 * il + 2]);
    }
    /* the head's start event is recorded by every step: a later launch re-records it */
    stt->t_output = later ? 0.0 : elapsed(ev[3 * nL + 1], f.e1);
    stt->t_total = elapsed(f.e0, f.e1);
    if (f.sampled && stt->t_total > 0.0) {
        const auto it = m->splits.find(f.T);
        if (it != m->splits.end()) {
            stg_model::split &sp = it->second;
            if (f.layer_events) {
                sp.attn = stt->t_attn / stt->t_total, sp.experts = stt->t_experts / stt->t_total;
                sp.dense = stt->t_dense / stt->t_total, sp.have = true;
            } else if (sp.have) {
                stt->t_attn = sp.attn * stt->t_total, stt->t_experts = sp.experts * stt->t_total;
                stt->t_dense = sp.dense * stt->t_total;
            }
        }
    }
    stt->n_tokens = f.T;
    stt->n_expert_tokens = pairs;
    stt->n_active_experts = active;
    return ST_OK;
}

static stg_status check_model(stg_model *m, stg_kv *kv) {
    if (kv->m != m || kv->n_layer != m->d.n_layer || kv->kv_dim != m->kv_dim)
        return fail(ST_EINVAL, "forward: KV cache was created for another model");
    return ST_OK;
}

extern "C" stg_status stg_forward(stg_model *m, stg_kv *kv, const void *vbatch, void *vstats) {
    const st_batch *b = (const st_batch *)vbatch;
    if (!m || !kv || !b) return fail(ST_EINVAL, "forward: NULL argument");
    CHECK(check_model(m, kv));
    if (m->n_live > 0)
        return fail(ST_EINVAL, "forward: %d launched step(s) in flight (stg_step_wait them first)", m->n_live);
    st_step_stats local;
    st_step_stats *stt = vstats ? (st_step_stats *)vstats : &local;
    memset(stt, 0, sizeof *stt);
    int64_t ticket = 0;
    CHECK(step_launch(m, kv, b, &ticket));
    return step_wait(m, ticket, b->out_tokens, stt);
}

extern "C" stg_status stg_step_launch(stg_model *m, stg_kv *kv, const void *vbatch, int64_t *ticket) {
    const st_batch *b = (const st_batch *)vbatch;
    if (!m || !kv || !b || !ticket) return fail(ST_EINVAL, "step_launch: NULL argument");
    *ticket = 0;
    CHECK(check_model(m, kv));
    if (b->logits)
        return fail(ST_EINVAL, "step_launch: a launched step returns greedy picks only (logits must be NULL; "
                               "use stg_forward for logits)");
    return step_launch(m, kv, b, ticket);
}

extern "C" stg_status stg_step_wait(stg_model *m, int64_t ticket, int32_t *out_tokens, void *vstats) {
    if (!m) return fail(ST_EINVAL, "step_wait: NULL model");
    st_step_stats local;
    return step_wait(m, ticket, out_tokens, vstats ? (st_step_stats *)vstats : &local);
}

extern "C" int32_t stg_step_in_flight(const stg_model *m) { return m ? m->n_live : 0; }

/* ------------------------------------------------------------------ kernel harness */

/* A device buffer freed at scope exit (harness only). */
struct dbuf {
    void *p = nullptr;
    ~dbuf() {
        if (p) cudaFree(p);
    }
    template <typename P> P *as() const { return (P *)p; }
};

/* The harness's settings (stg_test_set_settings): stg_settings_default's, but without the prefill form
 * (gemm_fast_min 0), so that the kernels the tests compare are the bitwise ones unless a test asks. */
static stg_settings g_test_set;
static bool g_test_set_init = false;

extern "C" stg_status stg_test_set_settings(const stg_settings *s) {
    if (s) CHECK(check_settings(s));
    if (s) g_test_set = *s;
    else stg_settings_default(&g_test_set), g_test_set.gemm_fast_min = 0;
    g_test_set_init = true;
    return ST_OK;
}

static stg_status harness_device(void) {
    if (!g_test_set_init) stg_test_set_settings(nullptr);
    g_pdl = false;
    g_set = g_test_set;
    g_defer_combine = g_deferred = false;
    g_gemm_fast = false;
    g_kpart = nullptr, g_kpart_cap = 0; /* a harness call that wants the split GEMM sets its own */
    const int n = stg_device_count();
    if (n < 0) return ST_EUNSUPPORTED;
    if (n == 0) return fail(ST_EUNSUPPORTED, "no CUDA device");
    CU(cudaSetDevice(0), "harness");
    return gemm_setup();
}

static stg_status up(dbuf &b, const void *src, size_t n) {
    CU(cudaMalloc(&b.p, n ? n : 1), "harness alloc");
    if (src && n) CU(cudaMemcpy(b.p, src, n, cudaMemcpyHostToDevice), "harness upload");
    return ST_OK;
}

/* A harness call's activations x [n_tok, k] on the device, with room for their 8-bit form
 * (quantize's qs [n_tok, k], d [n_tok, k / 32], sums [n_tok, k / 16]). */
static stg_status up_acts(dbuf &bx, dbuf &bq, dbuf &bd, dbuf &bs, const float *x, int64_t n_tok, int64_t k) {
    const size_t n = (size_t)n_tok * (size_t)k;
    CHECK(up(bx, x, sizeof(float) * n));
    CHECK(up(bq, nullptr, n));
    CHECK(up(bd, nullptr, sizeof(float) * n / 32));
    return up(bs, nullptr, sizeof(int32_t) * n / 16);
}
static stg_status down(void *dst, const dbuf &b, size_t n) {
    CU(cudaDeviceSynchronize(), "harness kernel");
    CU(cudaMemcpy(dst, b.p, n, cudaMemcpyDeviceToHost), "harness download");
    return ST_OK;
}

extern "C" stg_status stg_test_dequantize(int32_t type, const void *src, float *dst, int64_t n) {
    const int be = stg_block_elems(type);
    if (!be) return fail(ST_EUNSUPPORTED, "dequantize: unsupported quant type %d", type);
    if (!src || !dst || n <= 0 || n % be) return fail(ST_EINVAL, "dequantize: n=%lld invalid", (long long)n);
    CHECK(harness_device());
    const int64_t nb = n / be;
    dbuf s, d;
    CHECK(up(s, src, (size_t)(nb * stg_block_bytes(type))));
    CHECK(up(d, nullptr, sizeof(float) * (size_t)n));
    const unsigned grid = (unsigned)((nb + 127) / 128);
    switch (type) {
#define CASE_D(T) case T: k_dequant<T><<<grid, 128>>>(s.as<uint8_t>(), d.as<float>(), nb); break;
        QUANT_CASES(CASE_D)
        FLOAT_CASES(CASE_D)
#undef CASE_D
    }
    LAUNCHED("dequantize");
    return down(dst, d, sizeof(float) * (size_t)n);
}

extern "C" stg_status stg_test_quantize_act(const float *x, int64_t n_tok, int64_t k, int8_t *qs, float *d,
                                            int32_t *sums) {
    if (!x || !qs || !d || !sums || n_tok < 1 || k < 32 || k % 32) return fail(ST_EINVAL, "quantize_act: bad shape");
    CHECK(harness_device());
    dbuf bx, bq, bd, bs;
    const size_t n = (size_t)(n_tok * k);
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(quantize(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    CHECK(down(qs, bq, n));
    CHECK(down(d, bd, sizeof(float) * n / 32));
    return down(sums, bs, sizeof(int32_t) * n / 16);
}

extern "C" stg_status stg_test_linear(int32_t type, int32_t path, const void *w, const void *w2, int64_t n_rows,
                                      int64_t k, const float *x, int64_t n_tok, float *out) {
    const int be = stg_block_elems(type);
    if (!be) return fail(ST_EUNSUPPORTED, "linear: unsupported quant type %d", type);
    if (!w || !x || !out || n_rows < 1 || n_tok < 1 || k < 32 || k % 32 || k % be || path < 0 || path > 3)
        return fail(ST_EINVAL, "linear: bad arguments (rows=%lld k=%lld tokens=%lld path=%d)", (long long)n_rows,
                    (long long)k, (long long)n_tok, path);
    CHECK(harness_device());
    dtensor W;
    W.type = type, W.ne[0] = k, W.ne[1] = n_rows, W.row_bytes = stg_row_bytes(type, k);
    W.expert_stride = W.row_bytes * n_rows;
    dbuf bw, bw2, bx, bq, bd, bs, bo;
    CHECK(up(bw, w, (size_t)W.expert_stride));
    W.d = bw.as<uint8_t>();
    dtensor W2 = W;
    if (w2) {
        CHECK(up(bw2, w2, (size_t)W.expert_stride));
        W2.d = bw2.as<uint8_t>();
    }
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(up(bo, nullptr, sizeof(float) * (size_t)(n_tok * n_rows)));
    if (!stg_is_float(type)) CHECK(quantize(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    lin_groups g = {};
    g.n_pairs = (int32_t)n_tok;
    const acts_d in{bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>(), bx.as<float>()};
    dbuf bp; /* the split GEMM's parts (STRATA_GPU_DENSE_SPLIT decides whether the GEMM path splits) */
    CHECK(up(bp, nullptr, sizeof(float) * KSPLIT * (size_t)(n_tok * n_rows)));
    g_kpart = bp.as<float>(), g_kpart_cap = KSPLIT * n_tok * n_rows;
    g_gemm_fast = harness_fast(n_tok);
    const stg_status rc = linear(0, W, w2 ? &W2 : nullptr, g, 1, (int)n_tok, (int)n_tok, in, bo.as<float>(), n_rows,
                                 MODE_STORE, path);
    g_kpart = nullptr, g_kpart_cap = 0;
    CHECK(rc);
    return down(out, bo, sizeof(float) * (size_t)(n_tok * n_rows));
}

/* q / k / v as the attention block runs them: n_seg (2 or 3) weights of rows[i] rows each (w: their
 * rows stacked; uploaded as separate buffers) in one row-segmented launch: path STG_PATH_MATVEC (the
 * fused matvec) or STG_PATH_GEMM (the split GEMM, where STRATA_GPU_DENSE_SPLIT allows n_tok and
 * every segment is whole tiles of 64 rows; else ST_EINVAL). out: each segment's [n_tok, rows[i]]. */
extern "C" stg_status stg_test_linear_seg(int32_t type, int32_t path, const void *w, int32_t n_seg,
                                          const int64_t *rows, int64_t k, const float *x, int64_t n_tok, float *out) {
    const int be = stg_block_elems(type);
    if (!be || stg_is_float(type)) return fail(ST_EUNSUPPORTED, "linear_seg: unsupported quant type %d", type);
    if (!w || !rows || !x || !out || n_seg < 2 || n_seg > 3 || n_tok < 1 || n_tok > KSPLIT_MAX_T || k < 32 ||
        k % 32 || k % be || (path != STG_PATH_MATVEC && path != STG_PATH_GEMM))
        return fail(ST_EINVAL, "linear_seg: bad arguments");
    int64_t total = 0;
    for (int i = 0; i < n_seg; i++) {
        if (rows[i] < 1) return fail(ST_EINVAL, "linear_seg: segment %d has %lld rows", i, (long long)rows[i]);
        total += rows[i];
    }
    CHECK(harness_device());
    const int64_t rb = stg_row_bytes(type, k);
    dbuf bw[3], bo[3], bx, bq, bd, bs, bp;
    lin_seg sg = {};
    sg.n_seg = n_seg;
    for (int i = 0, r0 = 0; i < n_seg; r0 += (int)rows[i], i++) {
        CHECK(up(bw[i], (const uint8_t *)w + r0 * rb, (size_t)(rb * rows[i])));
        CHECK(up(bo[i], nullptr, sizeof(float) * (size_t)(n_tok * rows[i])));
        sg.seg_row[i] = r0, sg.seg_w[i] = bw[i].as<uint8_t>(), sg.seg_out[i] = bo[i].as<float>(), sg.seg_ldo[i] = rows[i];
    }
    sg.seg_row[n_seg] = (int32_t)total;
    dtensor W;
    W.type = type, W.ne[0] = k, W.ne[1] = rows[0], W.row_bytes = rb, W.expert_stride = rb * rows[0];
    W.d = bw[0].as<uint8_t>();
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(quantize(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    lin_groups g = {};
    g.n_pairs = (int32_t)n_tok;
    const acts_d in{bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>(), bx.as<float>()};
    CHECK(up(bp, nullptr, sizeof(float) * KSPLIT * (size_t)(n_tok * total)));
    g_kpart = bp.as<float>(), g_kpart_cap = KSPLIT * n_tok * total;
    g_gemm_fast = harness_fast(n_tok);
    const stg_status rc = linear(0, W, nullptr, g, 1, (int)n_tok, (int)n_tok, in, bo[0].as<float>(), rows[0],
                                 MODE_STORE, path, &sg);
    g_kpart = nullptr, g_kpart_cap = 0;
    CHECK(rc);
    for (int i = 0; i < n_seg; out += n_tok * rows[i], i++)
        CHECK(down(out, bo[i], sizeof(float) * (size_t)(n_tok * rows[i])));
    return ST_OK;
}

/* Routed experts as a MoE layer runs them: the n_tok * k_used pairs (ids[p]: pair p's expert,
 * p / k_used its token) grouped by k_group, then one grouped launch over the stacked experts
 * w[n_expert][n_rows] (w2: the gate/up form); out[pair, n_rows]. path: STG_PATH_MATVEC or
 * STG_PATH_GEMM; tiles 1: the GEMM's block per tile of group_pairs' list, 0: its grid of
 * (largest group's tiles) x (groups). */
/* stg_test_routed_linear and stg_test_routed_quant: hq / hd / hs (all or none) ask gate/up's launch to quantise
 * its output for the down projection as the step does (the routed split's k_ksplit_routed), and require that
 * it did. */
static stg_status routed_linear(int32_t type, int32_t path, const void *w, const void *w2,
                                int32_t n_expert, int64_t n_rows, int64_t k, const float *x, int32_t n_tok,
                                const int32_t *ids, int32_t k_used, float *out, int8_t *hq, float *hd, int32_t *hs) {
    const int be = stg_block_elems(type);
    if (!be || stg_is_float(type)) return fail(ST_EUNSUPPORTED, "routed linear: unsupported quant type %d", type);
    if (!w || !x || !ids || !out || n_expert < 1 || n_rows < 1 || n_tok < 1 || k_used < 1 || k_used > n_expert ||
        k < 32 || k % 32 || k % be || (path != STG_PATH_MATVEC && path != STG_PATH_GEMM))
        return fail(ST_EINVAL, "routed linear: bad arguments");
    const int32_t P = n_tok * k_used;
    for (int32_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= n_expert) return fail(ST_ERANGE, "routed linear: expert id %d", ids[p]);
    CHECK(harness_device());
    dtensor W;
    W.type = type, W.ne[0] = k, W.ne[1] = n_rows, W.row_bytes = stg_row_bytes(type, k);
    W.expert_stride = W.row_bytes * n_rows;
    const size_t wb = (size_t)(W.expert_stride * n_expert);
    dbuf bw, bw2, bx, bq, bd, bs, bo, bids, bg;
    CHECK(up(bw, w, wb));
    W.d = bw.as<uint8_t>();
    dtensor W2 = W;
    if (w2) {
        CHECK(up(bw2, w2, wb));
        W2.d = bw2.as<uint8_t>();
    }
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(up(bo, nullptr, sizeof(float) * (size_t)P * (size_t)n_rows));
    CHECK(up(bids, ids, sizeof(int32_t) * (size_t)P));
    /* gexp, gstart, gcount [ne]; n_groups; list, pair_tok [P]; hist [ne]; tiles [P / MM_BN + ne]; n_tiles */
    const int64_t nt_max = (P + MM_BN - 1) / MM_BN + n_expert;
    CHECK(up(bg, nullptr, sizeof(int32_t) * (size_t)(4 * n_expert + 2 * P + nt_max + 2)));
    int32_t *gexp = bg.as<int32_t>(), *gstart = gexp + n_expert, *gcount = gstart + n_expert,
            *n_groups = gcount + n_expert, *list = n_groups + 1, *pair_tok = list + P, *hist = pair_tok + P,
            *gtiles = hist + n_expert, *n_gtiles = gtiles + nt_max;
    CU(cudaMemset(hist, 0, sizeof(int32_t) * (size_t)n_expert), "routed linear");
    CHECK(quantize(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    k_group<<<1, 1024, 2 * n_expert * sizeof(int32_t)>>>(bids.as<int32_t>(), P, k_used, n_expert, gexp, gstart, gcount,
                                                         n_groups, list, pair_tok, hist, gtiles, n_gtiles,
                                                         1); /* the decode router's one-warp grouping */
    LAUNCHED("routed linear: group");
    lin_groups g = {};
    g.gexp = gexp, g.gstart = gstart, g.gcount = gcount, g.n_groups = n_groups, g.list = list, g.in_map = pair_tok;
    g.n_pairs = P;
    g.tiles = gtiles, g.n_tiles = n_gtiles;
    g_gemm_fast = harness_fast(n_tok);
    const int max_groups = std::min(n_expert, P), expected = (P + n_expert - 1) / n_expert;
    const acts_d in{bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>(), bx.as<float>()};
    dbuf bp; /* a routed split's parts (routed_split_max decides whether the gate/up GEMM splits) */
    CHECK(up(bp, nullptr, sizeof(float) * KSPLIT * 2 * (size_t)P * (size_t)n_rows));
    g_kpart = bp.as<float>(), g_kpart_cap = KSPLIT * 2 * (int64_t)P * n_rows;
    const size_t no = (size_t)P * (size_t)n_rows;
    dbuf bhq, bhd, bhs;
    bool done = false;
    fused_quant fq{nullptr, nullptr, nullptr, &done};
    if (hq) {
        CHECK(up(bhq, nullptr, no));
        CHECK(up(bhd, nullptr, sizeof(float) * no / 32));
        CHECK(up(bhs, nullptr, sizeof(int32_t) * no / 16));
        CU(cudaMemset(bhq.p, 0x7f, no), "routed linear");
        fq.q = bhq.as<int8_t>(), fq.d = bhd.as<float>(), fq.s = bhs.as<int32_t>();
    }
    const stg_status rc = linear(0, W, w2 ? &W2 : nullptr, g, max_groups, expected, n_tok, in, bo.as<float>(), n_rows,
                                 MODE_STORE, path, nullptr, hq ? &fq : nullptr);
    g_kpart = nullptr, g_kpart_cap = 0;
    CHECK(rc);
    if (hq && !done) return fail(ST_EINVAL, "routed linear: the launch did not quantise its output");
    CHECK(down(out, bo, sizeof(float) * no));
    if (!hq) return ST_OK;
    CHECK(down(hq, bhq, no));
    CHECK(down(hd, bhd, sizeof(float) * no / 32));
    return down(hs, bhs, sizeof(int32_t) * no / 16);
}
extern "C" stg_status stg_test_routed_linear(int32_t type, int32_t path, const void *w, const void *w2,
                                             int32_t n_expert, int64_t n_rows, int64_t k, const float *x, int32_t n_tok,
                                             const int32_t *ids, int32_t k_used, float *out) {
    return routed_linear(type, path, w, w2, n_expert, n_rows, k, x, n_tok, ids, k_used, out, nullptr, nullptr,
                         nullptr);
}
extern "C" stg_status stg_test_routed_quant(int32_t type, const void *w, const void *w2, int32_t n_expert,
                                            int64_t n_rows, int64_t k, const float *x, int32_t n_tok, const int32_t *ids,
                                            int32_t k_used, float *out, int8_t *hq, float *hd, int32_t *hs) {
    if (!w2 || !hq || !hd || !hs || n_rows % 32) return fail(ST_EINVAL, "routed quant: bad arguments");
    return routed_linear(type, STG_PATH_GEMM, w, w2, n_expert, n_rows, k, x, n_tok, ids, k_used, out, hq, hd, hs);
}

extern "C" stg_status stg_test_routed_chunk_quant(int32_t type, const void *w, const void *w2, int32_t n_expert,
                                                  int64_t n_rows, int64_t k, const float *x, int32_t n_tok,
                                                  const int32_t *ids, int32_t k_used, float *out, int8_t *hq, float *hd,
                                                  int32_t *hs) {
    if (!w2 || !hq || !hd || !hs || n_rows % 32) return fail(ST_EINVAL, "routed chunk quant: bad arguments");
    return routed_linear(type, STG_PATH_MATVEC, w, w2, n_expert, n_rows, k, x, n_tok, ids, k_used, out, hq, hd, hs);
}

extern "C" stg_status stg_test_attention(int32_t path, const uint16_t *k, const uint16_t *v, int32_t n_blocks,
                                         const int32_t *block_table, int32_t n_table, int32_t block_size,
                                         int32_t head_dim, int32_t n_kv, int32_t kv_head, const float *q, int32_t nq,
                                         int32_t p0, float *out) {
    if (!k || !v || !block_table || !q || !out || n_blocks < 1 || block_size < 16 || block_size % 16 ||
        head_dim < 16 || head_dim % 16 || head_dim > 256 || n_kv < 1 || kv_head < 0 || kv_head >= n_kv || nq < 1 ||
        p0 < 0 || (p0 + nq - 1) / block_size >= n_table)
        return fail(ST_EINVAL, "attention: bad arguments");
    for (int32_t j = 0; j <= (p0 + nq - 1) / block_size; j++)
        if (block_table[j] < 0 || block_table[j] >= n_blocks) return fail(ST_ERANGE, "attention: block out of range");
    CHECK(harness_device());
    const int64_t kd = (int64_t)n_kv * head_dim, cache = (int64_t)n_blocks * block_size * kd;
    /* the heads of every kv group but kv_head's first get zero queries */
    std::vector<float> qf((size_t)(nq * kd), 0.0f);
    std::vector<int32_t> ints((size_t)(2 * nq + n_table));
    for (int i = 0; i < nq; i++) {
        memcpy(&qf[(size_t)(i * kd + kv_head * head_dim)], q + (int64_t)i * head_dim, sizeof(float) * head_dim);
        ints[(size_t)i] = p0 + i;
        ints[(size_t)(nq + i)] = 0;
    }
    memcpy(&ints[(size_t)(2 * nq)], block_table, sizeof(int32_t) * n_table);
    dbuf bk, bv, bq, bo, bi, bsc;
    CHECK(up(bk, k, sizeof(uint16_t) * cache));
    CHECK(up(bv, v, sizeof(uint16_t) * cache));
    CHECK(up(bq, qf.data(), sizeof(float) * qf.size()));
    CHECK(up(bo, nullptr, sizeof(float) * qf.size()));
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    attn_args a = {};
    a.q = bq.as<float>(), a.out = bo.as<float>(), a.kc = bk.as<__half>(), a.vc = bv.as<__half>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + nq, a.block_tables = bi.as<int32_t>() + 2 * nq;
    a.max_blocks = n_table, a.n_head = n_kv, a.n_kv = n_kv, a.hd = head_dim, a.block_size = block_size;
    if (path == STG_PATH_REF) {
        CHECK(up(bsc, nullptr, sizeof(float) * (size_t)(nq * n_kv) * (size_t)(p0 + nq)));
        k_attention_ref<<<nq, n_kv>>>(a, bsc.as<float>(), p0 + nq);
        LAUNCHED("attention");
    } else {
        CHECK(attention_setup());
        CHECK(launch_attention(a, nq, 0));
    }
    std::vector<float> o(qf.size());
    CHECK(down(o.data(), bo, sizeof(float) * o.size()));
    for (int i = 0; i < nq; i++)
        memcpy(out + (int64_t)i * head_dim, &o[(size_t)(i * kd + kv_head * head_dim)], sizeof(float) * head_dim);
    return ST_OK;
}

/* Every query head of one sequence's nq tokens at positions p0.. (q[nq, n_head * hd], pre-scaled)
 * through k_attention (tile 0) or k_attention_tile (tile 1, as an eager prefill step would run
 * it), out[nq, n_head * hd]; with aq/ad/as also the output's 8-bit blocks (hd % 32 == 0). */
extern "C" stg_status stg_test_attention_heads(int32_t tile, const uint16_t *k, const uint16_t *v, int32_t n_blocks,
                                               const int32_t *block_table, int32_t n_table, int32_t block_size,
                                               int32_t head_dim, int32_t n_head, int32_t n_kv, const float *q,
                                               int32_t nq, int32_t p0, float *out, int8_t *aq, float *ad, int32_t *as) {
    if (!k || !v || !block_table || !q || !out || tile < 0 || tile > 3 || n_blocks < 1 || block_size < 16 ||
        block_size % 16 || head_dim < 16 || head_dim % 16 || head_dim > 256 || n_kv < 1 || n_head < n_kv || n_head % n_kv || nq < 1 ||
        p0 < 0 || (p0 + nq - 1) / block_size >= n_table || ((aq || ad || as) && (!aq || !ad || !as || head_dim % 32)))
        return fail(ST_EINVAL, "attention heads: bad arguments");
    for (int32_t j = 0; j <= (p0 + nq - 1) / block_size; j++)
        if (block_table[j] < 0 || block_table[j] >= n_blocks) return fail(ST_ERANGE, "attention: block out of range");
    const int tq = att_tile_tokens(n_head, n_kv, head_dim);
    if (tile && !tq) return fail(ST_EUNSUPPORTED, "attention tiles: n_head %d / n_kv %d / head_dim %d", n_head, n_kv,
                                 head_dim);
    CHECK(harness_device());
    const int64_t kd = (int64_t)n_kv * head_dim, cache = (int64_t)n_blocks * block_size * kd;
    const int64_t qd = (int64_t)n_head * head_dim, nout = (int64_t)nq * qd;
    std::vector<int32_t> ints((size_t)(3 * nq + n_table));
    for (int i = 0; i < nq; i++) ints[(size_t)i] = p0 + i, ints[(size_t)(nq + i)] = 0;
    memcpy(&ints[(size_t)(2 * nq)], block_table, sizeof(int32_t) * n_table);
    int32_t n_tiles = 0, n_mma = 0;
    if (tile >= 2) att_split_tiles(&ints[(size_t)nq], nq, tq, att_mma_tokens(n_head, n_kv, head_dim), 1,
                                   &ints[(size_t)(2 * nq + n_table)], &n_tiles, &n_mma);
    else if (tile) n_tiles = att_tiles(&ints[(size_t)nq], nq, tq, &ints[(size_t)(2 * nq + n_table)]);
    dbuf bk, bv, bq, bo, bi, baq, bad, bas;
    CHECK(up(bk, k, sizeof(uint16_t) * cache));
    CHECK(up(bv, v, sizeof(uint16_t) * cache));
    CHECK(up(bq, q, sizeof(float) * nout));
    CHECK(up(bo, nullptr, sizeof(float) * nout));
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    attn_args a = {};
    a.q = bq.as<float>(), a.out = bo.as<float>(), a.kc = bk.as<__half>(), a.vc = bv.as<__half>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + nq, a.block_tables = bi.as<int32_t>() + 2 * nq;
    a.max_blocks = n_table, a.n_head = n_head, a.n_kv = n_kv, a.hd = head_dim, a.block_size = block_size;
    if (aq) {
        CHECK(up(baq, nullptr, (size_t)nout));
        CHECK(up(bad, nullptr, sizeof(float) * (size_t)nout / 32));
        CHECK(up(bas, nullptr, sizeof(int32_t) * (size_t)nout / 16));
        a.aq = baq.as<int8_t>(), a.ad = bad.as<float>(), a.as = bas.as<int32_t>();
    }
    CHECK(attention_setup());
    if (tile >= 2) {
        CHECK(launch_attention_mma(a, bi.as<int32_t>() + 2 * nq + n_table, n_mma, tile == 2 ? 2 : 1, 0));
    } else if (tile) {
        a.stages = 2;
        CHECK(launch_attention_tile(a, bi.as<int32_t>() + 2 * nq + n_table, n_tiles, 0));
    } else {
        CHECK(launch_attention(a, nq, 0));
    }
    CHECK(down(out, bo, sizeof(float) * nout));
    if (aq) {
        CHECK(down(aq, baq, (size_t)nout));
        CHECK(down(ad, bad, sizeof(float) * (size_t)nout / 32));
        CHECK(down(as, bas, sizeof(int32_t) * (size_t)nout / 16));
    }
    return ST_OK;
}

extern "C" stg_status stg_test_rmsnorm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y) {
    if (!x || !w || !y || n_rows < 1 || n < 1) return fail(ST_EINVAL, "rmsnorm: bad arguments");
    CHECK(harness_device());
    dbuf bx, bw, by;
    CHECK(up(bx, x, sizeof(float) * (size_t)(n_rows * n)));
    CHECK(up(bw, w, sizeof(float) * (size_t)n));
    CHECK(up(by, nullptr, sizeof(float) * (size_t)(n_rows * n)));
    k_rmsnorm<<<(unsigned)n_rows, RMS_THREADS>>>(bx.as<float>(), nullptr, bw.as<float>(), by.as<float>(), n, eps, nullptr,
                                          nullptr, nullptr, combine_args{});
    LAUNCHED("rmsnorm");
    return down(y, by, sizeof(float) * (size_t)(n_rows * n));
}

/* RoPE alone: k_qkv_post with no norms or biases and a q scale of 1 (its K/V go to a
 * scratch cache: token i owns blocks i*nb .. i*nb+nb-1). */
extern "C" stg_status stg_test_rope(float *x, const int32_t *pos, int32_t n_tok, int32_t n_heads, int32_t head_dim,
                                    int32_t rope_dim, int32_t rope_type, float rope_base) {
    if (!x || !pos || n_tok < 1 || n_heads < 1 || head_dim < 2 || rope_dim < 2 || rope_dim > head_dim ||
        rope_dim % 2 || (rope_type != ST_ROPE_NORM && rope_type != ST_ROPE_NEOX))
        return fail(ST_EINVAL, "rope: bad arguments");
    int32_t max_pos = 0;
    for (int i = 0; i < n_tok; i++) {
        if (pos[i] < 0 || pos[i] > (1 << 20)) return fail(ST_ERANGE, "rope: position %d out of range", pos[i]);
        max_pos = std::max(max_pos, pos[i]);
    }
    CHECK(harness_device());
    const int bs = 16, nb = max_pos / bs + 1;
    std::vector<float> inv((size_t)rope_dim / 2);
    for (int i = 0; i < rope_dim / 2; i++)
        inv[(size_t)i] = (float)(1.0 / pow((double)rope_base, (double)(2 * i) / (double)rope_dim));
    const int64_t qd = (int64_t)n_heads * head_dim;
    std::vector<int32_t> ints((size_t)(2 * n_tok + n_tok * nb));
    for (int i = 0; i < n_tok; i++) {
        ints[(size_t)i] = pos[i], ints[(size_t)(n_tok + i)] = i;
        for (int j = 0; j < nb; j++) ints[(size_t)(2 * n_tok + i * nb + j)] = i * nb + j;
    }
    const size_t cache = sizeof(__half) * (size_t)n_tok * nb * bs * head_dim;
    dbuf bq, bk, bv, bi, bf, bkc, bvc;
    CHECK(up(bq, x, sizeof(float) * (size_t)(n_tok * qd)));
    CHECK(up(bk, nullptr, sizeof(float) * (size_t)(n_tok * head_dim)));
    CHECK(up(bv, nullptr, sizeof(float) * (size_t)(n_tok * head_dim)));
    CU(cudaMemset(bk.p, 0, sizeof(float) * (size_t)(n_tok * head_dim)), "rope");
    CU(cudaMemset(bv.p, 0, sizeof(float) * (size_t)(n_tok * head_dim)), "rope");
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    CHECK(up(bf, inv.data(), sizeof(float) * inv.size()));
    CHECK(up(bkc, nullptr, cache));
    CHECK(up(bvc, nullptr, cache));
    qkv_args a = {};
    a.q = bq.as<float>(), a.k = bk.as<float>(), a.v = bv.as<float>(), a.inv_freq = bf.as<float>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + n_tok, a.block_tables = bi.as<int32_t>() + 2 * n_tok;
    a.max_blocks = nb, a.n_head = n_heads, a.n_kv = 1, a.hd = head_dim, a.rope_dim = rope_dim, a.rope_type = rope_type;
    a.block_size = bs, a.eps = 1e-6f, a.scale = 1.0f, a.kc = bkc.as<__half>(), a.vc = bvc.as<__half>();
    k_qkv_post<<<dim3((unsigned)n_tok, (unsigned)((n_heads + 2 + QKV_WARPS - 1) / QKV_WARPS)), QKV_WARPS * 32>>>(a);
    LAUNCHED("rope");
    return down(x, bq, sizeof(float) * (size_t)(n_tok * qd));
}

extern "C" stg_status stg_test_router(const float *logits, int32_t n_tok, int32_t n_expert, int32_t k, int32_t *ids,
                                      float *w) {
    if (!logits || !ids || !w || n_tok < 1 || n_expert < 1 || k < 1 || k > n_expert)
        return fail(ST_EINVAL, "router: bad arguments");
    CHECK(harness_device());
    dbuf bl, bi, bw, bp;
    CHECK(up(bl, logits, sizeof(float) * (size_t)n_tok * n_expert));
    CHECK(up(bi, nullptr, sizeof(int32_t) * (size_t)n_tok * k));
    CHECK(up(bw, nullptr, sizeof(float) * (size_t)n_tok * k));
    CHECK(up(bp, nullptr, sizeof(float) * (size_t)n_tok * n_expert));
    k_router<<<(n_tok + ROUTER_WARPS - 1) / ROUTER_WARPS, ROUTER_WARPS * 32, ROUTER_WARPS * n_expert * sizeof(float)>>>(
        bl.as<float>(), n_tok, n_expert, k, bi.as<int32_t>(), bw.as<float>(), 1);
    LAUNCHED("router");
    CHECK(down(ids, bi, sizeof(int32_t) * (size_t)n_tok * k));
    return down(w, bw, sizeof(float) * (size_t)n_tok * k);
}

extern "C" stg_status stg_test_argmax(const float *x, int32_t rows, int64_t n, int32_t misalign, int32_t *out) {
    if (!x || !out || rows < 1 || n < 1 || n > INT32_MAX || misalign < 0 || misalign > 3)
        return fail(ST_EINVAL, "argmax: bad arguments");
    CHECK(harness_device());
    dbuf bx, bo;
    CHECK(up(bx, nullptr, sizeof(float) * ((size_t)rows * n + 3)));
    CU(cudaMemcpy(bx.as<float>() + misalign, x, sizeof(float) * (size_t)rows * n, cudaMemcpyHostToDevice), "harness upload");
    CHECK(up(bo, nullptr, sizeof(int32_t) * (size_t)rows));
    dbuf bk, bc;
    CHECK(up(bk, nullptr, sizeof(unsigned long long) * (size_t)rows));
    CHECK(up(bc, nullptr, sizeof(unsigned int) * (size_t)rows));
    CU(cudaMemset(bk.p, 0, sizeof(unsigned long long) * (size_t)rows), "harness");
    CU(cudaMemset(bc.p, 0, sizeof(unsigned int) * (size_t)rows), "harness");
    for (int rep = 0; rep < 2; rep++) { /* twice: the first launch must leave its counters at 0 */
        CU(cudaMemset(bo.p, 0xff, sizeof(int32_t) * (size_t)rows), "harness");
        k_argmax_split<<<dim3((unsigned)ARGMAX_SPLIT, (unsigned)rows), ARGMAX_SPLIT_THREADS>>>(
            bx.as<float>() + misalign, n, bo.as<int32_t>(), bk.as<unsigned long long>(), bc.as<unsigned int>());
    }
    LAUNCHED("greedy pick");
    return down(out, bo, sizeof(int32_t) * (size_t)rows);
}
