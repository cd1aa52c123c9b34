/* The forward pass of one batch, in one C call.
 *
 * A batch is any mix of prefill chunks and decode tokens from many sequences
 * (st_batch). Per layer: RMSNorm -> q/k/v -> (q/k norm) -> RoPE -> write K/V into the
 * paged F16 cache -> attention over each token's own sequence -> output projection;
 * then RMSNorm -> router -> experts grouped per expert over all tokens routed to
 * them (gate+up fused) -> weighted sum in top-k slot order (so a token's result does
 * not depend on what else is in the batch) -> shared expert.
 *
 * Parallel regions go through the pool; every region writes disjoint outputs. */
#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"

struct st_kv {
    int32_t n_blocks, block_size, n_layer, kv_dim;
    int32_t n_kv, head_dim;
    f16_t *k; /* [n_layer][n_blocks][n_kv][head_dim][block_size]: slots contiguous */
    f16_t *v; /* [n_layer][n_blocks][block_size][kv_dim] */
};

/* Activations entering a linear layer: float rows and, for quantised weights, the
 * same rows as 8-bit blocks. Row stride = K. */
typedef struct {
    const float *x;
    const int8_t *q;
    const float *d;
    const int32_t *s;
    const float *dx4, *xs; /* derived views for the SIMD kernels (see internal.h) */
    int64_t K;
} acts;

typedef struct {
    size_t cap_tokens, cap_pairs, cap_ctx, cap_threads;
    float *x, *xn, *q, *k, *v, *att, *tmp, *router, *topk_w, *scores, *gate_shexp;
    int8_t *aq;
    float *ad, *ad4, *axs;
    int32_t *as, *topk_id;
    float *h, *pair_out;
    int8_t *hq;
    float *hd, *hd4, *hxs;
    int32_t *hs, *pair_tok, *pairs_by_expert, *expert_start, *tiles;
} scratch;

struct st_model {
    st_model_desc d;
    st_layer *layers;
    int32_t q_dim, kv_dim, n_ff_exp, n_ff, n_ff_shexp, max_k;
    float *inv_freq; /* [rope_dim / 2] */
    scratch s;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ validation */

static st_status check_tensor(const st_tensor *t, const char *what, int layer, int required, int n_dims, int64_t ne0,
                              int64_t ne1, int64_t ne2, int float_only) {
    if (!t->data) {
        if (required) return st_fail(ST_EINVAL, "layer %d: tensor %s is missing", layer, what);
        return ST_OK;
    }
    if (!st_type_supported(t->type))
        return st_fail(ST_EUNSUPPORTED, "layer %d: tensor %s has unsupported quant type %d", layer, what, t->type);
    if (float_only && t->type != ST_TYPE_F32)
        return st_fail(ST_EUNSUPPORTED, "layer %d: tensor %s must be F32 (got type %d)", layer, what, t->type);
    const int64_t want[3] = {ne0, ne1, ne2};
    for (int i = 0; i < n_dims; i++) {
        if (t->ne[i] != want[i])
            return st_fail(ST_EINVAL, "layer %d: tensor %s has ne[%d]=%lld, expected %lld", layer, what, i,
                           (long long)t->ne[i], (long long)want[i]);
    }
    for (int i = n_dims; i < 4; i++) {
        if (t->ne[i] > 1 && i < t->n_dims)
            return st_fail(ST_EINVAL, "layer %d: tensor %s has %d dims, expected %d", layer, what, t->n_dims, n_dims);
    }
    if (t->ne[0] % st_type_block_elems(t->type))
        return st_fail(ST_EINVAL, "layer %d: tensor %s row length %lld is not a multiple of its block size %d", layer,
                       what, (long long)t->ne[0], st_type_block_elems(t->type));
    if (t->ne[0] > ST_MAX_ROW)
        return st_fail(ST_EUNSUPPORTED, "layer %d: tensor %s row length %lld exceeds %d", layer, what,
                       (long long)t->ne[0], ST_MAX_ROW);
    if (!st_type_is_float(t->type) && t->ne[0] % QK)
        return st_fail(ST_EINVAL, "layer %d: tensor %s row length %lld is not a multiple of 32", layer, what,
                       (long long)t->ne[0]);
    return ST_OK;
}

#define CHECK(expr)                      \
    do {                                 \
        const st_status rc_ = (expr);    \
        if (rc_ != ST_OK) return rc_;    \
    } while (0)

static st_status validate(st_model *m) {
    const st_model_desc *d = &m->d;
    if (d->n_layer < 1 || d->n_embd < 1 || d->n_head < 1 || d->n_head_kv < 1 || d->head_dim < 2 || d->n_vocab < 1)
        return st_fail(ST_EINVAL, "model: bad hyper-parameters (layers=%d embd=%d heads=%d/%d head_dim=%d vocab=%d)",
                       d->n_layer, d->n_embd, d->n_head, d->n_head_kv, d->head_dim, d->n_vocab);
    if (d->n_head % d->n_head_kv)
        return st_fail(ST_EINVAL, "model: head count %d is not a multiple of kv head count %d", d->n_head, d->n_head_kv);
    if (d->head_dim % 16)
        return st_fail(ST_EUNSUPPORTED, "model: head_dim %d is not a multiple of 16", d->head_dim);
    if (d->rope_dim < 2 || d->rope_dim > d->head_dim || d->rope_dim % 2)
        return st_fail(ST_EINVAL, "model: rope dimension %d invalid for head_dim %d", d->rope_dim, d->head_dim);
    if (d->rope_type != ST_ROPE_NORM && d->rope_type != ST_ROPE_NEOX)
        return st_fail(ST_EUNSUPPORTED, "model: rope type %d unsupported", d->rope_type);
    if (d->n_expert < 0 || d->n_expert_used < 0 || (d->n_expert > 0 && (d->n_expert_used < 1 || d->n_expert_used > d->n_expert)))
        return st_fail(ST_EINVAL, "model: expert_used_count %d invalid for expert_count %d", d->n_expert_used, d->n_expert);
    if (d->arch < ST_ARCH_LLAMA || d->arch > ST_ARCH_QWEN2MOE) return st_fail(ST_EUNSUPPORTED, "model: arch %d", d->arch);
    const int64_t E = d->n_embd;
    CHECK(check_tensor(&d->token_embd, "token_embd", -1, 1, 2, E, d->n_vocab, 1, 0));
    CHECK(check_tensor(&d->output_norm, "output_norm", -1, 1, 1, E, 1, 1, 1));
    CHECK(check_tensor(&d->output, "output", -1, 1, 2, E, d->n_vocab, 1, 0));
    m->n_ff = m->n_ff_exp = m->n_ff_shexp = 0;
    for (int il = 0; il < d->n_layer; il++) {
        const st_layer *L = &m->layers[il];
        CHECK(check_tensor(&L->attn_norm, "attn_norm", il, 1, 1, E, 1, 1, 1));
        CHECK(check_tensor(&L->wq, "attn_q", il, 1, 2, E, m->q_dim, 1, 0));
        CHECK(check_tensor(&L->wk, "attn_k", il, 1, 2, E, m->kv_dim, 1, 0));
        CHECK(check_tensor(&L->wv, "attn_v", il, 1, 2, E, m->kv_dim, 1, 0));
        CHECK(check_tensor(&L->wo, "attn_output", il, 1, 2, m->q_dim, E, 1, 0));
        CHECK(check_tensor(&L->bq, "attn_q.bias", il, 0, 1, m->q_dim, 1, 1, 1));
        CHECK(check_tensor(&L->bk, "attn_k.bias", il, 0, 1, m->kv_dim, 1, 1, 1));
        CHECK(check_tensor(&L->bv, "attn_v.bias", il, 0, 1, m->kv_dim, 1, 1, 1));
        CHECK(check_tensor(&L->q_norm, "attn_q_norm", il, d->arch == ST_ARCH_QWEN3MOE, 1, d->head_dim, 1, 1, 1));
        CHECK(check_tensor(&L->k_norm, "attn_k_norm", il, d->arch == ST_ARCH_QWEN3MOE, 1, d->head_dim, 1, 1, 1));
        CHECK(check_tensor(&L->ffn_norm, "ffn_norm", il, 1, 1, E, 1, 1, 1));
        if (d->n_expert > 0) {
            const int64_t ff = L->gate_exps.ne[1];
            if (il == 0) m->n_ff_exp = (int32_t)ff;
            if (ff != m->n_ff_exp || ff < 1) return st_fail(ST_EINVAL, "layer %d: expert FFN width differs", il);
            CHECK(check_tensor(&L->gate_inp, "ffn_gate_inp", il, 1, 2, E, d->n_expert, 1, 0));
            CHECK(check_tensor(&L->gate_exps, "ffn_gate_exps", il, 1, 3, E, ff, d->n_expert, 0));
            CHECK(check_tensor(&L->up_exps, "ffn_up_exps", il, 1, 3, E, ff, d->n_expert, 0));
            CHECK(check_tensor(&L->down_exps, "ffn_down_exps", il, 1, 3, ff, E, d->n_expert, 0));
            if (L->gate_shexp.data) {
                const int64_t sf = L->gate_shexp.ne[1];
                if (il == 0) m->n_ff_shexp = (int32_t)sf;
                if (sf != m->n_ff_shexp || sf < 1) return st_fail(ST_EINVAL, "layer %d: shared expert width differs", il);
                CHECK(check_tensor(&L->gate_shexp, "ffn_gate_shexp", il, 1, 2, E, sf, 1, 0));
                CHECK(check_tensor(&L->up_shexp, "ffn_up_shexp", il, 1, 2, E, sf, 1, 0));
                CHECK(check_tensor(&L->down_shexp, "ffn_down_shexp", il, 1, 2, sf, E, 1, 0));
                CHECK(check_tensor(&L->gate_inp_shexp, "ffn_gate_inp_shexp", il, 0, 1, E, 1, 1, 1));
            } else if (m->n_ff_shexp) {
                return st_fail(ST_EINVAL, "layer %d: shared expert missing", il);
            }
        } else {
            const int64_t ff = L->ffn_gate.ne[1];
            if (il == 0) m->n_ff = (int32_t)ff;
            if (ff != m->n_ff || ff < 1) return st_fail(ST_EINVAL, "layer %d: FFN width differs", il);
            CHECK(check_tensor(&L->ffn_gate, "ffn_gate", il, 1, 2, E, ff, 1, 0));
            CHECK(check_tensor(&L->ffn_up, "ffn_up", il, 1, 2, E, ff, 1, 0));
            CHECK(check_tensor(&L->ffn_down, "ffn_down", il, 1, 2, ff, E, 1, 0));
        }
    }
    return ST_OK;
}

st_status st_model_create(const st_model_desc *desc, st_model **out) {
    if (!desc || !out || !desc->layers) return st_fail(ST_EINVAL, "model_create: NULL argument");
    *out = NULL;
    st_model *m = calloc(1, sizeof *m);
    if (!m) return st_fail(ST_ENOMEM, "model_create: out of memory");
    m->d = *desc;
    m->layers = calloc((size_t)(desc->n_layer > 0 ? desc->n_layer : 1), sizeof *m->layers);
    if (!m->layers) {
        free(m);
        return st_fail(ST_ENOMEM, "model_create: out of memory");
    }
    if (desc->n_layer > 0) memcpy(m->layers, desc->layers, (size_t)desc->n_layer * sizeof *m->layers);
    m->d.layers = m->layers;
    m->q_dim = desc->n_head * desc->head_dim;
    m->kv_dim = desc->n_head_kv * desc->head_dim;
    const st_status rc = validate(m);
    if (rc != ST_OK) {
        st_model_destroy(m);
        return rc;
    }
    m->max_k = m->d.n_embd;
    if (m->q_dim > m->max_k) m->max_k = m->q_dim;
    if (m->n_ff > m->max_k) m->max_k = m->n_ff;
    if (m->n_ff_shexp > m->max_k) m->max_k = m->n_ff_shexp;
    m->inv_freq = malloc(sizeof(float) * (size_t)(m->d.rope_dim / 2));
    if (!m->inv_freq) {
        st_model_destroy(m);
        return st_fail(ST_ENOMEM, "model_create: out of memory");
    }
    for (int i = 0; i < m->d.rope_dim / 2; i++)
        m->inv_freq[i] = (float)(1.0 / pow((double)m->d.rope_base, (double)(2 * i) / (double)m->d.rope_dim));
    *out = m;
    return ST_OK;
}

static void scratch_free(scratch *s) {
    void *ptrs[] = {s->x, s->xn, s->q, s->k, s->v, s->att, s->tmp, s->router, s->topk_w, s->scores, s->gate_shexp,
                    s->aq, s->ad, s->ad4, s->axs, s->as, s->topk_id, s->h, s->pair_out, s->hq, s->hd, s->hd4,
                    s->hxs, s->hs, s->pair_tok,
                    s->pairs_by_expert, s->expert_start, s->tiles};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) free(ptrs[i]);
    memset(s, 0, sizeof *s);
}

void st_model_destroy(st_model *m) {
    if (!m) return;
    scratch_free(&m->s);
    free(m->inv_freq);
    free(m->layers);
    free(m);
}

/* Grow the scratch buffers to hold T tokens (and their expert pairs). */
static st_status ensure_scratch(st_model *m, size_t T, size_t n_threads, size_t ctx) {
    scratch *s = &m->s;
    const st_model_desc *d = &m->d;
    const size_t k = d->n_expert > 0 ? (size_t)d->n_expert_used : 1;
    const size_t P = T * k + T; /* routed pairs + one shared/dense pair per token */
    const size_t ffw = (size_t)(m->n_ff_exp > m->n_ff ? m->n_ff_exp : m->n_ff);
    const size_t ffmax = ffw > (size_t)m->n_ff_shexp ? ffw : (size_t)m->n_ff_shexp;
    if (T > s->cap_tokens) {
        scratch_free(s);
        const size_t E = (size_t)d->n_embd, K = (size_t)m->max_k, ne = d->n_expert > 0 ? (size_t)d->n_expert : 1;
        s->x = malloc(sizeof(float) * T * E);
        s->xn = malloc(sizeof(float) * T * E);
        s->q = malloc(sizeof(float) * T * (size_t)m->q_dim);
        s->k = malloc(sizeof(float) * T * (size_t)m->kv_dim);
        s->v = malloc(sizeof(float) * T * (size_t)m->kv_dim);
        s->att = malloc(sizeof(float) * T * (size_t)m->q_dim);
        s->tmp = malloc(sizeof(float) * T * (E > (size_t)m->q_dim ? E : (size_t)m->q_dim));
        s->router = malloc(sizeof(float) * T * ne);
        s->topk_w = malloc(sizeof(float) * T * k);
        s->topk_id = malloc(sizeof(int32_t) * T * k);
        s->gate_shexp = malloc(sizeof(float) * T);
        s->aq = malloc(T * K);
        s->ad = malloc(sizeof(float) * T * (K / QK + 1));
        s->ad4 = malloc(sizeof(float) * T * (K / 4 + 1));
        s->axs = malloc(sizeof(float) * T * (K / 16 + 1));
        s->as = malloc(sizeof(int32_t) * T * (K / 16 + 1));
        s->h = malloc(sizeof(float) * P * ffmax);
        s->hq = malloc(P * ffmax);
        s->hd = malloc(sizeof(float) * P * (ffmax / QK + 1));
        s->hd4 = malloc(sizeof(float) * P * (ffmax / 4 + 1));
        s->hxs = malloc(sizeof(float) * P * (ffmax / 16 + 1));
        s->hs = malloc(sizeof(int32_t) * P * (ffmax / 16 + 1));
        s->pair_out = malloc(sizeof(float) * P * E);
        s->pair_tok = malloc(sizeof(int32_t) * P);
        s->pairs_by_expert = malloc(sizeof(int32_t) * P);
        s->expert_start = malloc(sizeof(int32_t) * (ne + 1));
        s->tiles = malloc(sizeof(int32_t) * 2 * T);
        s->cap_tokens = T;
        s->cap_pairs = P;
        if (!s->x || !s->xn || !s->q || !s->k || !s->v || !s->att || !s->tmp || !s->router || !s->topk_w ||
            !s->topk_id || !s->gate_shexp || !s->aq || !s->ad || !s->as || !s->h || !s->hq || !s->hd || !s->hs ||
            !s->ad4 || !s->axs || !s->hd4 || !s->hxs ||
            !s->pair_out || !s->pair_tok || !s->pairs_by_expert || !s->expert_start || !s->tiles) {
            scratch_free(s);
            return st_fail(ST_ENOMEM, "forward: out of memory for a batch of %zu tokens", T);
        }
    }
    if (n_threads > s->cap_threads || ctx > s->cap_ctx) { /* per-thread attention score rows */
        free(s->scores);
        s->scores = malloc(sizeof(float) * n_threads * ctx);
        s->cap_ctx = s->scores ? ctx : 0;
        s->cap_threads = s->scores ? n_threads : 0;
        if (!s->scores) return st_fail(ST_ENOMEM, "forward: out of memory for attention scores (ctx %zu)", ctx);
    }
    return ST_OK;
}

/* ------------------------------------------------------------------ KV cache */

st_status st_kv_create(const st_model *m, int32_t n_blocks, int32_t block_size, st_kv **out) {
    if (!m || !out) return st_fail(ST_EINVAL, "kv_create: NULL argument");
    *out = NULL;
    if (n_blocks < 1 || block_size < ST_ATTN_TILE || block_size > 4096 || block_size % ST_ATTN_TILE)
        return st_fail(ST_EINVAL, "kv_create: n_blocks=%d block_size=%d invalid (block size: a multiple of %d)",
                       n_blocks, block_size, ST_ATTN_TILE);
    st_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return st_fail(ST_ENOMEM, "kv_create: out of memory");
    kv->n_blocks = n_blocks;
    kv->block_size = block_size;
    kv->n_layer = m->d.n_layer;
    kv->kv_dim = m->kv_dim;
    kv->n_kv = m->d.n_head_kv;
    kv->head_dim = m->d.head_dim;
    const size_t n = (size_t)kv->n_layer * (size_t)n_blocks * (size_t)block_size * (size_t)kv->kv_dim;
    kv->k = calloc(n, sizeof(f16_t));
    kv->v = calloc(n, sizeof(f16_t));
    if (!kv->k || !kv->v) {
        st_kv_destroy(kv);
        return st_fail(ST_ENOMEM, "kv_create: cannot allocate %zu bytes of KV cache", 2 * n * sizeof(f16_t));
    }
    *out = kv;
    return ST_OK;
}

void st_kv_destroy(st_kv *kv) {
    if (!kv) return;
    free(kv->k);
    free(kv->v);
    free(kv);
}

static inline size_t kv_offset(const st_kv *kv, int layer, int32_t block, int32_t slot) {
    return (((size_t)layer * (size_t)kv->n_blocks + (size_t)block) * (size_t)kv->block_size + (size_t)slot) *
           (size_t)kv->kv_dim;
}

st_status st_kv_copy_block(st_kv *kv, int32_t src, int32_t dst, int32_t n_tokens) {
    if (!kv) return st_fail(ST_EINVAL, "kv_copy_block: NULL cache");
    if (src < 0 || src >= kv->n_blocks || dst < 0 || dst >= kv->n_blocks || n_tokens < 0 || n_tokens > kv->block_size)
        return st_fail(ST_ERANGE, "kv_copy_block: src=%d dst=%d n=%d out of range", src, dst, n_tokens);
    /* K is slot-minor inside a block, so its whole block is copied; V only the rows used */
    const size_t kbytes = (size_t)kv->block_size * (size_t)kv->kv_dim * sizeof(f16_t);
    const size_t vbytes = (size_t)n_tokens * (size_t)kv->kv_dim * sizeof(f16_t);
    for (int l = 0; l < kv->n_layer; l++) {
        memcpy(kv->k + kv_offset(kv, l, dst, 0), kv->k + kv_offset(kv, l, src, 0), kbytes);
        memcpy(kv->v + kv_offset(kv, l, dst, 0), kv->v + kv_offset(kv, l, src, 0), vbytes);
    }
    return ST_OK;
}

/* ------------------------------------------------------------------ primitives */

static void rmsnorm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float scale = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * scale);
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* Where quantised activation rows go: the shared layer-input buffers or the expert
 * hidden-state buffers. */
typedef struct {
    int8_t *q;
    float *d, *dx4, *xs;
    int32_t *s;
} act_buf;

typedef struct {
    const float *x;
    int64_t K;
    act_buf o;
} quant_ctx;

static void quant_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const quant_ctx *c = ctx;
    const int64_t K = c->K;
    st_quantize_act_row(c->x + t * K, K, c->o.q + t * K, c->o.d + t * (K / QK), c->o.s + t * (K / 16),
                        c->o.dx4 + t * (K / 4), c->o.xs + t * (K / 16));
}

/* Float rows x[T, K] -> activations; quantised into `o` when the weights need it. */
static acts make_acts(st_pool *pool, const float *x, int64_t T, int64_t K, int need_q, act_buf o) {
    acts a = {x, NULL, NULL, NULL, NULL, NULL, K};
    if (need_q) {
        quant_ctx c = {x, K, o};
        st_pool_run(pool, quant_task, &c, T);
        a.q = o.q, a.d = o.d, a.s = o.s, a.dx4 = o.dx4, a.xs = o.xs;
    }
    return a;
}

static act_buf layer_buf(scratch *s) { return (act_buf){s->aq, s->ad, s->ad4, s->axs, s->as}; }
static act_buf hidden_buf(scratch *s) { return (act_buf){s->hq, s->hd, s->hd4, s->hxs, s->hs}; }

/* A tile of up to ST_MAX_NT activation rows: idx[i] (or base + i when idx is NULL).
 * Built once per tile, then dotted with every weight row of a work item. */
typedef struct {
    int nt;
    const int32_t *idx;
    int64_t base;
    act_row rows[ST_MAX_NT]; /* quantised views (unused for float weights) */
} act_tile;

static inline void make_tile(act_tile *tl, const acts *a, const int32_t *idx, int64_t base, int nt) {
    tl->nt = nt, tl->idx = idx, tl->base = base;
    if (!a->q) return;
    const int64_t K = a->K;
    for (int i = 0; i < nt; i++) {
        const int64_t t = idx ? idx[i] : base + i;
        tl->rows[i] = (act_row){a->q + t * K, a->d + t * (K / QK), a->s + t * (K / 16), a->dx4 + t * (K / 4),
                                a->xs + t * (K / 16)};
    }
}

/* Dot one weight row with every row of the tile; a quantised row is unpacked once. */
static inline void dot_tile(int32_t type, dot_q_fn fq, dot_f_fn ff, const uint8_t *wrow, const acts *a,
                            const act_tile *tl, float *res) {
    if (st_type_is_float(type)) {
        for (int i = 0; i < tl->nt; i++) ff(wrow, a->x + (tl->idx ? tl->idx[i] : tl->base + i) * a->K, a->K, &res[i]);
    } else {
        fq(wrow, a->K, tl->nt, tl->rows, res);
    }
}

#define TOKEN_TILE ST_MAX_NT /* activation rows per unpacked weight row; they stay hot in cache */

/* out[t, r] (stride ldo) = W[r, :] . in[rows[t], :] for r in [0, N), t in [0, T). */
typedef struct {
    const uint8_t *w;
    int32_t type;
    size_t row_bytes;
    int64_t N, T, chunk, ldo;
    const int32_t *rows; /* NULL: identity */
    acts in;
    float *out;
    dot_q_fn fq;
    dot_f_fn ff;
} linear_ctx;

static void linear_task(void *ctx, int64_t item, int thread) {
    (void)thread;
    const linear_ctx *c = ctx;
    const int64_t r0 = item * c->chunk, r1 = r0 + c->chunk < c->N ? r0 + c->chunk : c->N;
    float res[ST_MAX_NT];
    act_tile tl;
    for (int64_t tile = 0; tile < c->T; tile += TOKEN_TILE) {
        const int nt = (int)(c->T - tile < TOKEN_TILE ? c->T - tile : TOKEN_TILE);
        make_tile(&tl, &c->in, c->rows ? c->rows + tile : NULL, tile, nt);
        for (int64_t r = r0; r < r1; r++) {
            dot_tile(c->type, c->fq, c->ff, c->w + (size_t)r * c->row_bytes, &c->in, &tl, res);
            for (int i = 0; i < nt; i++) c->out[(tile + i) * c->ldo + r] = res[i];
        }
    }
}

static int64_t pick_chunk(int64_t N, int64_t T, int n_threads) {
    /* Enough items to balance (>= 8 per thread) but each large enough to amortise. */
    int64_t chunk = N / (8 * (int64_t)n_threads);
    const int64_t min_chunk = T >= 16 ? 4 : 16;
    if (chunk < min_chunk) chunk = min_chunk;
    if (chunk > 256) chunk = 256;
    return chunk;
}

static void linear(st_pool *pool, const st_tensor *W, const acts *in, const int32_t *rows, int64_t T, float *out,
                   int64_t ldo) {
    linear_ctx c = {W->data, W->type, st_row_bytes(W->type, W->ne[0]), W->ne[1], T, 0, ldo, rows, *in, out,
                    st_dot_q(W->type), st_dot_f(W->type)};
    c.chunk = pick_chunk(c.N, T, st_pool_threads(pool));
    st_pool_run(pool, linear_task, &c, (c.N + c.chunk - 1) / c.chunk);
}

static void add_bias(float *y, const st_tensor *b, int64_t T, int64_t n) {
    if (!b->data) return;
    const float *bv = b->data;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < n; i++) y[t * n + i] += bv[i];
}

/* ------------------------------------------------------------------ attention */

/* Attention works on tiles: up to ST_ATTN_TILE consecutive tokens of one sequence (a
 * prefill chunk) share every K/V row they read; one work item per (tile, head). */
typedef struct {
    const st_model *m;
    const st_kv *kv;
    const st_batch *b;
    int layer;
    const int32_t *tiles; /* [n_tiles, 2]: first batch index, count */
    float *scratch;       /* per thread: per_thread floats */
    size_t per_thread;
    attn_fn fn;
} attn_ctx;

static void attn_task(void *vctx, int64_t item, int thread) {
    const attn_ctx *c = vctx;
    const st_model *m = c->m;
    const st_kv *kv = c->kv;
    const int n_head = m->d.n_head, group = n_head / m->d.n_head_kv, hd = m->d.head_dim;
    const int64_t tile = item / n_head;
    const int h = (int)(item % n_head);
    const int32_t t0 = c->tiles[2 * tile], nq = c->tiles[2 * tile + 1];
    const size_t layer_elems = (size_t)kv->n_blocks * (size_t)kv->block_size * (size_t)kv->kv_dim;
    const kv_view view = {kv->k + (size_t)c->layer * layer_elems, kv->v + (size_t)c->layer * layer_elems,
                          c->b->block_tables + (size_t)c->b->seq[t0] * (size_t)c->b->max_blocks, kv->block_size, hd,
                          kv->n_kv, kv->kv_dim, h / group};
    c->fn(&view, m->s.q + (int64_t)t0 * m->q_dim + h * hd, m->q_dim, nq, c->b->pos[t0],
          m->s.att + (int64_t)t0 * m->q_dim + h * hd, m->q_dim, c->scratch + (size_t)thread * c->per_thread);
}

/* Split the batch into attention tiles: runs of one sequence at consecutive positions. */
static int32_t build_tiles(const st_batch *b, int32_t *tiles) {
    int32_t n = 0;
    for (int32_t t = 0; t < b->n_tokens;) {
        int32_t len = 1;
        while (t + len < b->n_tokens && len < ST_ATTN_TILE && b->seq[t + len] == b->seq[t] && b->pos[t + len] == b->pos[t] + len)
            len++;
        tiles[2 * n] = t, tiles[2 * n + 1] = len;
        n++;
        t += len;
    }
    return n;
}

static void rope_row(float *x, int n_heads, int hd, int rope_dim, int rope_type, const float *inv_freq, int32_t pos) {
    for (int i = 0; i < rope_dim / 2; i++) {
        const float theta = (float)pos * inv_freq[i];
        const float cs = cosf(theta), sn = sinf(theta);
        for (int h = 0; h < n_heads; h++) {
            float *v = x + h * hd;
            const int a = rope_type == ST_ROPE_NEOX ? i : 2 * i;
            const int b = rope_type == ST_ROPE_NEOX ? i + rope_dim / 2 : 2 * i + 1;
            const float x0 = v[a], x1 = v[b];
            v[a] = x0 * cs - x1 * sn;
            v[b] = x0 * sn + x1 * cs;
        }
    }
}

static void attention_block(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, int il, int64_t T) {
    const st_layer *L = &m->layers[il];
    scratch *s = &m->s;
    const st_model_desc *d = &m->d;
    const int64_t E = d->n_embd;
    for (int64_t t = 0; t < T; t++) rmsnorm_row(s->x + t * E, L->attn_norm.data, s->xn + t * E, E, d->norm_eps);
    const int need_q = !st_type_is_float(L->wq.type) || !st_type_is_float(L->wk.type) || !st_type_is_float(L->wv.type);
    const acts in = make_acts(pool, s->xn, T, E, need_q, layer_buf(s));
    linear(pool, &L->wq, &in, NULL, T, s->q, m->q_dim);   /* [T, n_head * hd] */
    linear(pool, &L->wk, &in, NULL, T, s->k, m->kv_dim);  /* [T, n_kv * hd] */
    linear(pool, &L->wv, &in, NULL, T, s->v, m->kv_dim);  /* [T, n_kv * hd] */
    add_bias(s->q, &L->bq, T, m->q_dim);
    add_bias(s->k, &L->bk, T, m->kv_dim);
    add_bias(s->v, &L->bv, T, m->kv_dim);
    const int hd = d->head_dim;
    for (int64_t t = 0; t < T; t++) {
        float *q = s->q + t * m->q_dim, *k = s->k + t * m->kv_dim;
        if (L->q_norm.data) {
            for (int h = 0; h < d->n_head; h++) rmsnorm_row(q + h * hd, L->q_norm.data, q + h * hd, hd, d->norm_eps);
            for (int h = 0; h < d->n_head_kv; h++) rmsnorm_row(k + h * hd, L->k_norm.data, k + h * hd, hd, d->norm_eps);
        }
        rope_row(q, d->n_head, hd, d->rope_dim, d->rope_type, m->inv_freq, b->pos[t]);
        rope_row(k, d->n_head_kv, hd, d->rope_dim, d->rope_type, m->inv_freq, b->pos[t]);
        const float scale = 1.0f / sqrtf((float)hd); /* folded into q once */
        for (int i = 0; i < m->q_dim; i++) q[i] *= scale;
        /* write this token's K (slot-minor) and V into its sequence's block */
        const int32_t *bt = b->block_tables + (size_t)b->seq[t] * (size_t)b->max_blocks;
        const int32_t blk = bt[b->pos[t] / kv->block_size], slot = b->pos[t] % kv->block_size;
        const size_t off = kv_offset(kv, il, blk, slot), kbase = kv_offset(kv, il, blk, 0);
        for (int i = 0; i < m->kv_dim; i++) {
            kv->k[kbase + (size_t)i * (size_t)kv->block_size + (size_t)slot] = f32_to_f16(k[i]);
            kv->v[off + i] = f32_to_f16(s->v[t * m->kv_dim + i]);
        }
    }
    const int32_t n_tiles = build_tiles(b, s->tiles);
    attn_ctx ac = {m, kv, b, il, s->tiles, s->scores, s->cap_ctx, st_attn()};
    st_pool_run(pool, attn_task, &ac, (int64_t)n_tiles * d->n_head);
    const acts ain = make_acts(pool, s->att, T, m->q_dim, !st_type_is_float(L->wo.type), layer_buf(s));
    linear(pool, &L->wo, &ain, NULL, T, s->tmp, E);
    for (int64_t i = 0; i < T * E; i++) s->x[i] += s->tmp[i];
}

/* ------------------------------------------------------------------ experts */

/* One group = one expert's weights and the (token, slot) pairs routed to it. */
typedef struct {
    const uint8_t *wg, *wu, *wd;
    const int32_t *pairs;
    int32_t n_pairs;
} ffn_group;

typedef struct {
    int32_t group, r0, r1;
} ffn_item;

typedef struct {
    const ffn_group *groups;
    const ffn_item *items;
    int32_t tg, tu, td;
    size_t rbg, rbu, rbd;
    int64_t n_ff, E;
    acts in;             /* token rows */
    const int32_t *pair_tok;
    float *h;            /* [P, n_ff] */
    acts hin;            /* h rows, quantised */
    float *pair_out;     /* [P, E] */
} ffn_ctx;

static void ffn_gate_up_task(void *vctx, int64_t item, int thread) {
    (void)thread;
    const ffn_ctx *c = vctx;
    const ffn_item it = c->items[item];
    const ffn_group *g = &c->groups[it.group];
    const dot_q_fn fqg = st_dot_q(c->tg), fqu = st_dot_q(c->tu);
    const dot_f_fn ffg = st_dot_f(c->tg), ffu = st_dot_f(c->tu);
    int32_t tok[ST_MAX_NT];
    float gv[ST_MAX_NT], uv[ST_MAX_NT];
    act_tile tl;
    for (int32_t tile = 0; tile < g->n_pairs; tile += TOKEN_TILE) {
        const int nt = g->n_pairs - tile < TOKEN_TILE ? g->n_pairs - tile : TOKEN_TILE;
        for (int j = 0; j < nt; j++) tok[j] = c->pair_tok[g->pairs[tile + j]];
        make_tile(&tl, &c->in, tok, 0, nt);
        for (int32_t r = it.r0; r < it.r1; r++) {
            dot_tile(c->tg, fqg, ffg, g->wg + (size_t)r * c->rbg, &c->in, &tl, gv);
            dot_tile(c->tu, fqu, ffu, g->wu + (size_t)r * c->rbu, &c->in, &tl, uv);
            for (int j = 0; j < nt; j++) c->h[(size_t)g->pairs[tile + j] * c->n_ff + r] = silu(gv[j]) * uv[j];
        }
    }
}

static void ffn_down_task(void *vctx, int64_t item, int thread) {
    (void)thread;
    const ffn_ctx *c = vctx;
    const ffn_item it = c->items[item];
    const ffn_group *g = &c->groups[it.group];
    const dot_q_fn fq = st_dot_q(c->td);
    const dot_f_fn ff = st_dot_f(c->td);
    float res[ST_MAX_NT];
    act_tile tl;
    for (int32_t tile = 0; tile < g->n_pairs; tile += TOKEN_TILE) {
        const int nt = g->n_pairs - tile < TOKEN_TILE ? g->n_pairs - tile : TOKEN_TILE;
        make_tile(&tl, &c->hin, g->pairs + tile, 0, nt);
        for (int32_t r = it.r0; r < it.r1; r++) {
            dot_tile(c->td, fq, ff, g->wd + (size_t)r * c->rbd, &c->hin, &tl, res);
            for (int j = 0; j < nt; j++) c->pair_out[(size_t)g->pairs[tile + j] * c->E + r] = res[j];
        }
    }
}

/* Build (group, row-range) items: chunks sized so that items carry similar work. */
static int32_t build_items(const ffn_group *groups, int32_t n_groups, int64_t rows, int n_threads, ffn_item *items) {
    /* ~8 items per thread in all, each carrying about the same rows x pairs of work:
     * a hot expert gets thin row slices, a cold one a few wide ones. */
    int64_t total_pairs = 0;
    for (int32_t g = 0; g < n_groups; g++) total_pairs += groups[g].n_pairs;
    int32_t n = 0;
    for (int32_t g = 0; g < n_groups; g++) {
        if (!groups[g].n_pairs) continue;
        int64_t chunk = rows * total_pairs / (8 * (int64_t)n_threads * (int64_t)groups[g].n_pairs);
        if (chunk < 8) chunk = 8;
        if (chunk > rows) chunk = rows;
        for (int64_t r = 0; r < rows; r += chunk)
            items[n++] = (ffn_item){g, (int32_t)r, (int32_t)(r + chunk < rows ? r + chunk : rows)};
    }
    return n;
}

static st_status run_ffn(st_model *m, st_pool *pool, const ffn_group *groups, int32_t n_groups, const st_tensor *tg,
                         const st_tensor *tu, const st_tensor *td, const acts *in, int64_t n_pairs) {
    scratch *s = &m->s;
    const int64_t n_ff = tg->ne[1], E = m->d.n_embd;
    const int nt = st_pool_threads(pool);
    const int64_t widest = n_ff > E ? n_ff : E;
    ffn_item *items = malloc(sizeof(ffn_item) * (size_t)n_groups * (size_t)(widest / 8 + 2));
    if (!items) return st_fail(ST_ENOMEM, "forward: out of memory (expert items)");
    ffn_ctx c = {groups, items, tg->type, tu->type, td->type, st_row_bytes(tg->type, tg->ne[0]),
                 st_row_bytes(tu->type, tu->ne[0]), st_row_bytes(td->type, td->ne[0]), n_ff, E, *in, s->pair_tok,
                 s->h, {0}, s->pair_out};
    int32_t n = build_items(groups, n_groups, n_ff, nt, items);
    st_pool_run(pool, ffn_gate_up_task, &c, n);
    c.hin = make_acts(pool, s->h, n_pairs, n_ff, !st_type_is_float(td->type), hidden_buf(s));
    n = build_items(groups, n_groups, E, nt, items);
    st_pool_run(pool, ffn_down_task, &c, n);
    free(items);
    return ST_OK;
}

static inline const uint8_t *expert_ptr(const st_tensor *t, int e) {
    return (const uint8_t *)t->data + (size_t)e * (size_t)t->ne[1] * st_row_bytes(t->type, t->ne[0]);
}

static st_status ffn_block(st_model *m, st_pool *pool, const st_batch *b, int il, int64_t T, st_step_stats *stats) {
    const st_layer *L = &m->layers[il];
    scratch *s = &m->s;
    const st_model_desc *d = &m->d;
    const int64_t E = d->n_embd;
    for (int64_t t = 0; t < T; t++) rmsnorm_row(s->x + t * E, L->ffn_norm.data, s->xn + t * E, E, d->norm_eps);
    if (d->n_expert == 0) { /* dense FFN = one group holding every token */
        for (int64_t t = 0; t < T; t++) s->pair_tok[t] = (int32_t)t, s->pairs_by_expert[t] = (int32_t)t;
        const acts in = make_acts(pool, s->xn, T, E, !st_type_is_float(L->ffn_gate.type), layer_buf(s));
        const ffn_group g = {L->ffn_gate.data, L->ffn_up.data, L->ffn_down.data, s->pairs_by_expert, (int32_t)T};
        CHECK(run_ffn(m, pool, &g, 1, &L->ffn_gate, &L->ffn_up, &L->ffn_down, &in, T));
        for (int64_t i = 0; i < T * E; i++) s->x[i] += s->pair_out[i];
        return ST_OK;
    }
    const int ne = d->n_expert, k = d->n_expert_used;
    /* router: softmax over all experts, top-k, optional renormalisation */
    const acts rin = make_acts(pool, s->xn, T, E, !st_type_is_float(L->gate_inp.type), layer_buf(s));
    linear(pool, &L->gate_inp, &rin, NULL, T, s->router, ne); /* [T, n_expert] */
    for (int64_t t = 0; t < T; t++) {
        float *r = s->router + t * ne;
        float mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < ne; e++) mx = r[e] > mx ? r[e] : mx;
        for (int e = 0; e < ne; e++) sum += (r[e] = expf(r[e] - mx));
        for (int e = 0; e < ne; e++) r[e] /= sum;
        int32_t *ids = s->topk_id + t * k;
        float *w = s->topk_w + t * k; /* raw top-k probabilities */
        for (int j = 0; j < k; j++) { /* selection: highest prob, lowest index on ties */
            int best = -1;
            for (int e = 0; e < ne; e++) {
                int used = 0;
                for (int u = 0; u < j; u++) used |= ids[u] == e;
                if (!used && (best < 0 || r[e] > r[best])) best = e;
            }
            ids[j] = best;
            w[j] = r[best];
        }
    }
    /* group pairs (t * k + j) by expert, in token order inside each expert */
    int32_t *start = s->expert_start;
    memset(start, 0, sizeof(int32_t) * (size_t)(ne + 1));
    for (int64_t p = 0; p < T * k; p++) start[s->topk_id[p] + 1]++, s->pair_tok[p] = (int32_t)(p / k);
    for (int e = 0; e < ne; e++) start[e + 1] += start[e];
    int32_t *fill = malloc(sizeof(int32_t) * (size_t)ne);
    ffn_group *groups = malloc(sizeof(ffn_group) * (size_t)ne);
    if (!fill || !groups) {
        free(fill);
        free(groups);
        return st_fail(ST_ENOMEM, "forward: out of memory (expert groups)");
    }
    memcpy(fill, start, sizeof(int32_t) * (size_t)ne);
    for (int64_t p = 0; p < T * k; p++) s->pairs_by_expert[fill[s->topk_id[p]]++] = (int32_t)p;
    int32_t n_groups = 0;
    for (int e = 0; e < ne; e++) {
        const int32_t cnt = start[e + 1] - start[e];
        if (b->expert_hist) b->expert_hist[(size_t)il * ne + e] += cnt;
        if (!cnt) continue;
        groups[n_groups++] = (ffn_group){expert_ptr(&L->gate_exps, e), expert_ptr(&L->up_exps, e),
                                         expert_ptr(&L->down_exps, e), s->pairs_by_expert + start[e], cnt};
    }
    stats->n_expert_tokens += T * k;
    stats->n_active_experts += n_groups;
    const acts in = make_acts(pool, s->xn, T, E, !st_type_is_float(L->gate_exps.type), layer_buf(s));
    st_status rc = run_ffn(m, pool, groups, n_groups, &L->gate_exps, &L->up_exps, &L->down_exps, &in, T * k);
    free(fill);
    free(groups);
    if (rc != ST_OK) return rc;
    /* Weighted sum in slot order (independent of the batch), in double with one final
     * rounding: sum_j p_j o_j / sum_j p_j. The products and sums are exact in double,
     * so experts with identical outputs (an upcycled dense model) give that output
     * bit for bit, and the routed model reproduces its dense origin exactly. */
    for (int64_t t = 0; t < T; t++) {
        float *x = s->x + t * E;
        const float *w = s->topk_w + t * k;
        double den = 0.0;
        for (int j = 0; j < k; j++) den += (double)w[j];
        if (!d->expert_norm) den = 1.0;
        for (int64_t i = 0; i < E; i++) {
            double num = 0.0;
            for (int j = 0; j < k; j++) num += (double)w[j] * (double)s->pair_out[(size_t)(t * k + j) * E + i];
            x[i] += (float)(num / den);
        }
    }
    if (L->gate_shexp.data) { /* shared expert, gated by sigmoid(x . w) when a gate exists */
        for (int64_t t = 0; t < T; t++) {
            float g = 1.0f;
            if (L->gate_inp_shexp.data) {
                st_dot_f(ST_TYPE_F32)(L->gate_inp_shexp.data, s->xn + t * E, E, &g);
                g = 1.0f / (1.0f + expf(-g));
            }
            s->gate_shexp[t] = g;
            s->pair_tok[t] = (int32_t)t, s->pairs_by_expert[t] = (int32_t)t;
        }
        const acts sin = make_acts(pool, s->xn, T, E, !st_type_is_float(L->gate_shexp.type), layer_buf(s));
        const ffn_group g = {L->gate_shexp.data, L->up_shexp.data, L->down_shexp.data, s->pairs_by_expert, (int32_t)T};
        CHECK(run_ffn(m, pool, &g, 1, &L->gate_shexp, &L->up_shexp, &L->down_shexp, &sin, T));
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < E; i++) s->x[t * E + i] += s->gate_shexp[t] * s->pair_out[t * E + i];
    }
    return ST_OK;
}

/* ------------------------------------------------------------------ the step */

typedef struct {
    const st_tensor *emb;
    const int32_t *tokens;
    float *x;
    int64_t E;
} embed_ctx;

static void embed_task(void *vctx, int64_t t, int thread) {
    (void)thread;
    const embed_ctx *c = vctx;
    const size_t rb = st_row_bytes(c->emb->type, c->E);
    st_dequantize(c->emb->type, (const uint8_t *)c->emb->data + (size_t)c->tokens[t] * rb, c->x + t * c->E, c->E);
}

static st_status validate_batch(const st_model *m, const st_kv *kv, const st_batch *b) {
    if (b->n_tokens < 1) return st_fail(ST_EINVAL, "forward: empty batch");
    if (!b->tokens || !b->pos || !b->seq || !b->block_tables || b->n_seqs < 1 || b->max_blocks < 1)
        return st_fail(ST_EINVAL, "forward: batch is missing arrays");
    if (b->n_logits < 0 || (b->n_logits > 0 && (!b->logit_idx || !b->logits)))
        return st_fail(ST_EINVAL, "forward: logits requested without buffers");
    for (int32_t i = 0; i < b->n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= m->d.n_vocab)
            return st_fail(ST_ERANGE, "forward: token id %d out of range [0, %d)", b->tokens[i], m->d.n_vocab);
        if (b->seq[i] < 0 || b->seq[i] >= b->n_seqs)
            return st_fail(ST_ERANGE, "forward: sequence index %d out of range", b->seq[i]);
        if (b->pos[i] < 0 || b->pos[i] / kv->block_size >= b->max_blocks)
            return st_fail(ST_ERANGE, "forward: position %d exceeds the sequence's KV capacity (%d tokens)",
                           b->pos[i], b->max_blocks * kv->block_size);
        const int32_t *bt = b->block_tables + (size_t)b->seq[i] * (size_t)b->max_blocks;
        for (int32_t j = 0; j <= b->pos[i] / kv->block_size; j++)
            if (bt[j] < 0 || bt[j] >= kv->n_blocks)
                return st_fail(ST_ERANGE, "forward: block %d of sequence %d is %d, outside [0, %d)", j, b->seq[i],
                               bt[j], kv->n_blocks);
    }
    for (int32_t i = 0; i < b->n_logits; i++)
        if (b->logit_idx[i] < 0 || b->logit_idx[i] >= b->n_tokens)
            return st_fail(ST_ERANGE, "forward: logit index %d out of range", b->logit_idx[i]);
    return ST_OK;
}

st_status st_forward(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, st_step_stats *stats) {
    if (!m || !kv || !b || !pool) return st_fail(ST_EINVAL, "forward: NULL argument");
    if (kv->n_layer != m->d.n_layer || kv->kv_dim != m->kv_dim)
        return st_fail(ST_EINVAL, "forward: KV cache was created for another model");
    CHECK(validate_batch(m, kv, b));
    st_step_stats local = {0};
    st_step_stats *st = stats ? stats : &local;
    memset(st, 0, sizeof *st);
    const double t_start = now_s();
    const int64_t T = b->n_tokens, E = m->d.n_embd;
    const int nt = st_pool_threads(pool);
    const size_t ctx = (size_t)b->max_blocks * (size_t)kv->block_size;
    CHECK(ensure_scratch(m, (size_t)(T > b->n_logits ? T : b->n_logits), (size_t)nt,
                         st_attn_scratch_floats(m->d.head_dim, (int32_t)ctx)));
    scratch *s = &m->s;
    embed_ctx ec = {&m->d.token_embd, b->tokens, s->x, E};
    st_pool_run(pool, embed_task, &ec, T);
    for (int il = 0; il < m->d.n_layer; il++) {
        const double t0 = now_s();
        attention_block(m, kv, pool, b, il, T);
        const double t1 = now_s();
        CHECK(ffn_block(m, pool, b, il, T, st));
        const double t2 = now_s();
        st->t_attn += t1 - t0;
        if (m->d.n_expert > 0) st->t_experts += t2 - t1;
        else st->t_dense += t2 - t1;
    }
    const double t_out = now_s();
    if (b->n_logits > 0) {
        for (int32_t i = 0; i < b->n_logits; i++)
            rmsnorm_row(s->x + (int64_t)b->logit_idx[i] * E, m->d.output_norm.data, s->xn + (int64_t)i * E, E,
                        m->d.norm_eps);
        const acts in = make_acts(pool, s->xn, b->n_logits, E, !st_type_is_float(m->d.output.type), layer_buf(s));
        linear(pool, &m->d.output, &in, NULL, b->n_logits, b->logits, m->d.n_vocab); /* [n_logits, n_vocab] */
    }
    const double t_end = now_s();
    st->t_output = t_end - t_out;
    st->t_total = t_end - t_start;
    st->n_tokens = T;
    return ST_OK;
}
