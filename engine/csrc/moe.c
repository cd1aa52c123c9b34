/* Feed-forward blocks: the router, grouping of tokens by expert, the grouped SwiGLU
 * expert FFN, the weighted combination and the shared expert. A dense FFN is the
 * grouped FFN with one group holding every token.
 *
 * Grouping lets one expert's weight rows be unpacked once for all tokens routed to it
 * (gate and up fused in one pass), and work items are sized so that a hot expert is
 * cut into thin row slices while a cold one gets a few wide ones. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* One group = one expert's weights and the (token, slot) pairs routed to it. */
typedef struct {
    const uint8_t *wg, *wu, *wd;
    const int32_t *pairs;
    int32_t n_pairs;
    const float *bg, *bu, *bd; /* this expert's biases on gate / up / down, or NULL (gpt-oss has them) */
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
    int oai;             /* gpt-oss's clamped SwiGLU instead of silu(g) * u */
    int32_t n_gu;        /* items [0, n_gu) are gate / up, the rest down */
    act_buf hbuf;        /* where h's rows are quantised (hin's buffers) */
    _Atomic int32_t *left;  /* [group]: gate / up items not yet done */
    _Atomic int32_t *ready; /* [group]: 1 once the group's h rows are whole (and quantised) */
} ffn_ctx;

/* gpt-oss's activation (llama.cpp's swiglu_oai with alpha 1.702, limit 7): the gate clamped
 * above at the limit, the up projection to [-limit, limit], then g * sigmoid(alpha g) * (u + 1). */
#define OAI_ALPHA 1.702f
#define OAI_LIMIT 7.0f
static void swiglu_oai(const float *g, const float *u, float *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i] < OAI_LIMIT ? g[i] : OAI_LIMIT;
        const float y = u[i] < -OAI_LIMIT ? -OAI_LIMIT : (u[i] > OAI_LIMIT ? OAI_LIMIT : u[i]);
        h[i] = x / (1.0f + expf(-OAI_ALPHA * x)) * (y + 1.0f);
    }
}

/* Rows whose gate and up results are gathered before one silu_mul call per token: called per
 * 8-row block, its per-call cost was ~4% of a 16-sequence step (1 thread, rdtsc). */
#define SILU_SPAN (4 * ST_ROW_BLOCK)

/* dot_tile with the results at out[t * ldo + r] (ldo >= nr). */
static inline void dot_tile_ld(int32_t type, dot_q_fn fq, dot_f_fn ff, const uint8_t *wrow, size_t row_bytes, int nr,
                               const acts *a, const act_tile *tl, float *out, int64_t ldo) {
    if (st_type_is_float(type)) {
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < tl->nt; i++)
                ff(wrow + (size_t)r * row_bytes, a->x + (tl->idx ? tl->idx[i] : tl->base + i) * a->K, a->K,
                   &out[i * ldo + r]);
    } else {
        fq(wrow, row_bytes, nr, a->K, tl->nt, tl->rows, out, ldo);
    }
}

static void ffn_gate_up_task(void *vctx, int64_t item, int thread) {
    (void)thread;
    const ffn_ctx *c = vctx;
    const ffn_item it = c->items[item];
    const ffn_group *g = &c->groups[it.group];
    const dot_q_fn fqg = st_dot_q(c->tg), fqu = st_dot_q(c->tu);
    const dot_f_fn ffg = st_dot_f(c->tg), ffu = st_dot_f(c->tu);
    const silu_mul_fn silu_mul = st_silu_mul();
    int32_t tok[ST_MAX_NT];
    float gv[ST_MAX_NT * SILU_SPAN], uv[ST_MAX_NT * SILU_SPAN]; /* [token][row in span] */
    act_tile tl;
    for (int32_t tile = 0; tile < g->n_pairs; tile += TOKEN_TILE) {
        const int nt = g->n_pairs - tile < TOKEN_TILE ? g->n_pairs - tile : TOKEN_TILE;
        for (int j = 0; j < nt; j++) tok[j] = c->pair_tok[g->pairs[tile + j]];
        make_tile(&tl, &c->in, tok, 0, nt);
        for (int32_t r0 = it.r0; r0 < it.r1; r0 += SILU_SPAN) {
            const int ns = it.r1 - r0 < SILU_SPAN ? it.r1 - r0 : SILU_SPAN;
            for (int rb = 0; rb < ns; rb += ST_ROW_BLOCK) { /* the same 8-row kernel calls as before */
                const int nr = ns - rb < ST_ROW_BLOCK ? ns - rb : ST_ROW_BLOCK;
                const size_t r = (size_t)(r0 + rb);
                dot_tile_ld(c->tg, fqg, ffg, g->wg + r * c->rbg, c->rbg, nr, &c->in, &tl, gv + rb, SILU_SPAN);
                dot_tile_ld(c->tu, fqu, ffu, g->wu + r * c->rbu, c->rbu, nr, &c->in, &tl, uv + rb, SILU_SPAN);
            }
            if (g->bg || g->bu) /* the expert's biases, before the activation */
                for (int j = 0; j < nt; j++)
                    for (int i = 0; i < ns; i++) {
                        if (g->bg) gv[j * SILU_SPAN + i] += g->bg[r0 + i];
                        if (g->bu) uv[j * SILU_SPAN + i] += g->bu[r0 + i];
                    }
            for (int j = 0; j < nt; j++) { /* elementwise: the same bits as per row block */
                float *h = c->h + (size_t)g->pairs[tile + j] * c->n_ff + r0;
                if (c->oai) swiglu_oai(gv + j * SILU_SPAN, uv + j * SILU_SPAN, h, ns);
                else silu_mul(gv + j * SILU_SPAN, uv + j * SILU_SPAN, h, ns);
            }
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
    float res[ST_MAX_NT * ST_ROW_BLOCK];
    act_tile tl;
    for (int32_t tile = 0; tile < g->n_pairs; tile += TOKEN_TILE) {
        const int nt = g->n_pairs - tile < TOKEN_TILE ? g->n_pairs - tile : TOKEN_TILE;
        make_tile(&tl, &c->hin, g->pairs + tile, 0, nt);
        for (int32_t r = it.r0; r < it.r1; r += ST_ROW_BLOCK) {
            const int nr = it.r1 - r < ST_ROW_BLOCK ? it.r1 - r : ST_ROW_BLOCK;
            dot_tile(c->td, fq, ff, g->wd + (size_t)r * c->rbd, c->rbd, nr, &c->hin, &tl, res);
            for (int j = 0; j < nt; j++) {
                float *o = c->pair_out + (size_t)g->pairs[tile + j] * c->E + r;
                for (int i = 0; i < nr; i++) o[i] = res[j * ST_ROW_BLOCK + i] + (g->bd ? g->bd[r + i] : 0.0f);
            }
        }
    }
}

/* Both halves in one pool region: gate / up items first, then down items. A group's down items wait for its h
 * rows: the thread that finishes the group's last gate / up item quantises them (when down reads 8-bit rows) and
 * publishes the group. The pool hands items out in order, so every gate / up item is taken before any down item
 * and a waiting thread only waits on work in progress; meanwhile the others go on with the next groups' down rows,
 * where two regions made every thread wait at a barrier for the slowest gate / up item (and for a region of the
 * quantisation between them). Each row is computed by the same calls as in two regions: the same bits. */
static void ffn_fused_task(void *vctx, int64_t item, int thread) {
    const ffn_ctx *c = vctx;
    const int32_t g = c->items[item].group;
    if (item < c->n_gu) {
        ffn_gate_up_task(vctx, item, thread);
        if (atomic_fetch_sub_explicit(&c->left[g], 1, memory_order_acq_rel) == 1) { /* the group's last */
            if (c->hin.q) {
                const ffn_group *gr = &c->groups[g];
                for (int32_t i = 0; i < gr->n_pairs; i++) st_quant_act_row(c->h, c->n_ff, c->hbuf, gr->pairs[i]);
            }
            atomic_store_explicit(&c->ready[g], 1, memory_order_release);
        }
    } else {
        while (!atomic_load_explicit(&c->ready[g], memory_order_acquire)) CPU_RELAX();
        ffn_down_task(vctx, item, thread);
    }
}

/* Build (group, row-range) tiles: each carries about the same rows x pairs of work, and its
 * weights (bytes_per_row per row) fit in half of L2 (st_tile_rows). Workers take them one
 * at a time from the pool's atomic counter, so whoever finishes early steals the next. */
static int32_t build_items(const ffn_group *groups, int32_t n_groups, int64_t rows, int n_threads,
                           size_t bytes_per_row, ffn_item *items) {
    /* ~8 items per thread in all: a hot expert gets thin row slices, a cold one wide ones. */
    int64_t total_pairs = 0;
    for (int32_t g = 0; g < n_groups; g++) total_pairs += groups[g].n_pairs;
    int32_t n = 0;
    for (int32_t g = 0; g < n_groups; g++) {
        if (!groups[g].n_pairs) continue;
        const int64_t chunk = st_tile_rows(
            rows, rows * total_pairs / (8 * (int64_t)n_threads * (int64_t)groups[g].n_pairs), bytes_per_row);
        for (int64_t r = 0; r < rows; r += chunk)
            items[n++] = (ffn_item){g, (int32_t)r, (int32_t)(r + chunk < rows ? r + chunk : rows)};
    }
    return n;
}

/* The grouped FFN: for every group, h = silu(x Wg) * (x Wu) over its pairs, then
 * pair_out = h Wd (ffn_fused_task: one pool region). Pair p reads token row pair_tok[p] of `in`; h and
 * pair_out are indexed by pair; rows of pairs in no group are left as they are. */
static st_status ffn_grouped(st_model *m, st_pool *pool, const ffn_group *groups, int32_t n_groups,
                             const st_tensor *tg, const st_tensor *tu, const st_tensor *td, const acts *in,
                             float *pair_out, int oai) {
    scratch *s = &m->s;
    const int64_t n_ff = tg->ne[1], E = m->d.n_embd;
    const int nt = st_pool_threads(pool);
    const int64_t widest = n_ff > E ? n_ff : E;
    const size_t per_phase = (size_t)n_groups * (size_t)(widest / 8 + 2);
    ffn_item *items = malloc(sizeof(ffn_item) * 2 * per_phase);
    _Atomic int32_t *flags = malloc(sizeof(_Atomic int32_t) * 2 * (size_t)n_groups);
    if (!items || !flags) {
        free(items), free(flags);
        return st_fail(ST_ENOMEM, "forward: out of memory (expert items)");
    }
    const act_buf hb = hidden_buf(s);
    ffn_ctx c = {groups, items, tg->type, tu->type, td->type, st_row_bytes(tg->type, tg->ne[0]),
                 st_row_bytes(tu->type, tu->ne[0]), st_row_bytes(td->type, td->ne[0]), n_ff, E, *in, s->pair_tok,
                 s->h, st_acts_view(s->h, n_ff, !st_type_is_float(td->type), hb), pair_out, oai, 0, hb,
                 flags, flags + n_groups};
    c.n_gu = build_items(groups, n_groups, n_ff, nt, c.rbg + c.rbu, items);
    const int32_t n_down = build_items(groups, n_groups, E, nt, c.rbd, items + c.n_gu);
    for (int32_t g = 0; g < n_groups; g++) atomic_init(&c.left[g], 0), atomic_init(&c.ready[g], 0);
    for (int32_t i = 0; i < c.n_gu; i++) atomic_fetch_add_explicit(&c.left[items[i].group], 1, memory_order_relaxed);
    st_pool_run(pool, ffn_fused_task, &c, (int64_t)c.n_gu + n_down);
    free(items), free(flags);
    return ST_OK;
}

st_status st_ffn_all_tokens(st_model *m, st_pool *pool, const st_tensor *gate, const st_tensor *up,
                            const st_tensor *down, int64_t T) {
    scratch *s = &m->s;
    for (int64_t t = 0; t < T; t++) s->pair_tok[t] = (int32_t)t, s->pairs_by_expert[t] = (int32_t)t;
    const int need_q = !st_type_is_float(gate->type) || !st_type_is_float(up->type); /* types may differ */
    const acts in = st_make_acts(pool, s->xn, T, m->d.n_embd, need_q, layer_buf(s));
    const ffn_group g = {gate->data, up->data, down->data, s->pairs_by_expert, (int32_t)T, NULL, NULL, NULL};
    return ffn_grouped(m, pool, &g, 1, gate, up, down, &in, s->pair_out, 0);
}

/* The top k of c[0..n) into ids[0..k) (largest first, lowest index on ties; -inf entries are
 * never taken while a finite one is left). k <= n. */
static void top_k(const float *c, int n, int k, int32_t *ids) {
    uint8_t taken[ST_MAX_EXPERTS]; /* O(k n), not O(k^2 n): 256 experts, top-8, 58 layers per token */
    memset(taken, 0, (size_t)n);
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++)
            if (!taken[e] && (best < 0 || c[e] > c[best])) best = e;
        ids[j] = best;
        taken[best] = 1;
    }
}

/* Routing of one token (llama.cpp's build_moe_ffn; see st_model_desc):
 *   r[ne]: the router logits on entry, the probabilities p on return;
 *   c[ne], gs[n_group]: scratch for the choice scores and group scores;
 *   ids[k], w[k]: the chosen experts and their weights before normalisation (p, or for
 *   ST_GATING_SOFTMAX_WEIGHT the softmax of the chosen logits). */
void st_route_token(const st_model_desc *d, const float *bias, float *r, float *c, float *gs, int32_t *ids, float *w) {
    const int ne = d->n_expert, k = d->n_expert_used;
    const int gating = d->gating ? d->gating : ST_GATING_SOFTMAX;
    if (gating == ST_GATING_SOFTMAX) {
        float mx = -INFINITY, sum = 0.0f;
        for (int e = 0; e < ne; e++) mx = r[e] > mx ? r[e] : mx;
        for (int e = 0; e < ne; e++) sum += (r[e] = st_expf_cr(r[e] - mx));
        for (int e = 0; e < ne; e++) r[e] /= sum;
    } else if (gating == ST_GATING_SIGMOID) {
        for (int e = 0; e < ne; e++) r[e] = 1.0f / (1.0f + st_expf_cr(-r[e]));
    }
    for (int e = 0; e < ne; e++) c[e] = bias ? r[e] + bias[e] : r[e];
    if (d->n_expert_group > 1) {
        /* a group's score is the sum of its two best choice scores (DeepSeek-V3's rule, as in
         * llama.cpp); experts outside the n_group_used best groups are not eligible */
        const int ng = d->n_expert_group, per = ne / ng, two = per < 2 ? per : 2;
        int32_t best[2], keep[ST_MAX_EXPERTS];
        for (int g = 0; g < ng; g++) {
            top_k(c + g * per, per, two, best);
            gs[g] = 0.0f;
            for (int j = 0; j < two; j++) gs[g] += c[g * per + best[j]];
        }
        top_k(gs, ng, d->n_group_used, keep);
        for (int g = 0; g < ng; g++) {
            int kept = 0;
            for (int u = 0; u < d->n_group_used; u++) kept |= keep[u] == g;
            if (!kept)
                for (int e = 0; e < per; e++) c[g * per + e] = -INFINITY;
        }
    }
    top_k(c, ne, k, ids);
    for (int j = 0; j < k; j++) w[j] = r[ids[j]];
    if (gating == ST_GATING_SOFTMAX_WEIGHT) {
        float mx = -INFINITY, sum = 0.0f;
        for (int j = 0; j < k; j++) mx = w[j] > mx ? w[j] : mx;
        for (int j = 0; j < k; j++) sum += (w[j] = st_expf_cr(w[j] - mx));
        for (int j = 0; j < k; j++) w[j] /= sum;
    }
}

st_status st_route(int32_t n_expert, int32_t k, int32_t gating, int32_t n_expert_group, int32_t n_group_used,
                   int32_t norm, float scale, const float *bias, const float *logits, int32_t T, int32_t *ids,
                   float *weights) {
    if (n_expert < 1 || n_expert > ST_MAX_EXPERTS || k < 1 || k > n_expert || k > ST_MAX_EXPERTS_USED || T < 0)
        return st_fail(ST_EINVAL, "route: top-%d of %d experts over %d rows invalid", k, n_expert, T);
    if (T > 0 && (!logits || !ids || !weights)) return st_fail(ST_EINVAL, "route: NULL buffer");
    st_model_desc d = {0};
    d.n_expert = n_expert, d.n_expert_used = k, d.gating = gating, d.n_expert_group = n_expert_group;
    d.n_group_used = n_group_used, d.expert_norm = norm, d.expert_weights_scale = scale;
    CHECK(st_check_routing(&d));
    float *buf = malloc(sizeof(float) * 3 * (size_t)n_expert);
    if (!buf) return st_fail(ST_ENOMEM, "route: out of memory");
    const double sc = scale != 0.0f ? (double)scale : 1.0;
    for (int32_t t = 0; t < T; t++) {
        float *r = buf, *w = weights + (size_t)t * (size_t)k;
        for (int e = 0; e < n_expert; e++) r[e] = logits[(size_t)t * (size_t)n_expert + (size_t)e];
        st_route_token(&d, bias, r, buf + n_expert, buf + 2 * n_expert, ids + (size_t)t * (size_t)k, w);
        double den = 0.0; /* as combine applies them */
        for (int j = 0; j < k; j++) den += (double)w[j];
        if (den < 6.103515625e-5) den = 6.103515625e-5;
        if (!norm) den = 1.0;
        for (int j = 0; j < k; j++) w[j] = (float)((double)w[j] / den * sc);
    }
    free(buf);
    return ST_OK;
}

/* Router: logits = xn . gate_inp, then st_route_token per token: topk_id[T, k], topk_w[T, k]. */
static st_status route(st_model *m, st_pool *pool, const st_layer *L, int64_t T) {
    scratch *s = &m->s;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    const acts rin = st_make_acts(pool, s->xn, T, m->d.n_embd, !st_type_is_float(L->gate_inp.type), layer_buf(s));
    st_linear(pool, &L->gate_inp, &rin, NULL, T, s->router, ne); /* [T, n_expert] */
    st_add_bias(s->router, &L->gate_inp_b, T, ne);
    float *c = malloc(sizeof(float) * 2 * (size_t)ne); /* choice scores, group scores (n_group < ne) */
    if (!c) return st_fail(ST_ENOMEM, "forward: out of memory (routing)");
    const float *bias = L->exp_probs_b.data;
    for (int64_t t = 0; t < T; t++)
        st_route_token(&m->d, bias, s->router + t * ne, c, c + ne, s->topk_id + t * k, s->topk_w + t * k);
    free(c);
    return ST_OK;
}

static inline const uint8_t *expert_ptr(const st_tensor *t, int e) {
    return (const uint8_t *)t->data + (size_t)e * (size_t)t->ne[1] * st_row_bytes(t->type, t->ne[0]);
}

/* Expert e's row of a [width, n_expert] F32 bias, or NULL when the layer has none. */
static inline const float *expert_bias(const st_tensor *t, int e) {
    return t->data ? (const float *)t->data + (size_t)e * (size_t)t->ne[0] : NULL;
}

static inline ffn_group expert_group(const st_layer *L, int e, const int32_t *pairs, int32_t cnt) {
    return (ffn_group){expert_ptr(&L->gate_exps, e), expert_ptr(&L->up_exps, e), expert_ptr(&L->down_exps, e), pairs,
                       cnt, expert_bias(&L->gate_exps_b, e), expert_bias(&L->up_exps_b, e),
                       expert_bias(&L->down_exps_b, e)};
}

/* Group the pairs p = t * k + j by expert, in token order inside each expert: fills
 * pair_tok, pairs_by_expert, expert_start and one ffn_group per active expert;
 * returns the number of groups. Counts tokens per expert into hist[n_expert] if given. */
static int32_t group_by_expert(st_model *m, const st_layer *L, int64_t T, int32_t *fill, ffn_group *groups,
                               int32_t *hist) {
    scratch *s = &m->s;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    int32_t *start = s->expert_start;
    memset(start, 0, sizeof(int32_t) * (size_t)(ne + 1));
    for (int64_t p = 0; p < T * k; p++) start[s->topk_id[p] + 1]++, s->pair_tok[p] = (int32_t)(p / k);
    for (int e = 0; e < ne; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int32_t) * (size_t)ne);
    for (int64_t p = 0; p < T * k; p++) s->pairs_by_expert[fill[s->topk_id[p]]++] = (int32_t)p;
    int32_t n_groups = 0;
    for (int e = 0; e < ne; e++) {
        const int32_t cnt = start[e + 1] - start[e];
        if (hist) hist[e] += cnt;
        if (!cnt) continue;
        groups[n_groups++] = expert_group(L, e, s->pairs_by_expert + start[e], cnt);
    }
    return n_groups;
}

/* Weighted sum in slot order (independent of the batch), in double with one final
 * rounding: sum_j p_j o_j / sum_j p_j (the sum clamped below at 2^-14 as llama.cpp does),
 * times the routed scaling factor. The products and sums are exact in double, so experts
 * with identical outputs (an upcycled dense model) give that output bit for bit, and the
 * routed model reproduces its dense origin exactly. */
static void combine(st_model *m, int64_t T) {
    scratch *s = &m->s;
    const int64_t E = m->d.n_embd;
    const int k = m->d.n_expert_used;
    const double scale = m->d.expert_weights_scale != 0.0f ? (double)m->d.expert_weights_scale : 1.0;
    for (int64_t t = 0; t < T; t++) {
        float *x = s->x + t * E;
        const float *w = s->topk_w + t * k;
        double den = 0.0;
        for (int j = 0; j < k; j++) den += (double)w[j];
        if (den < 6.103515625e-5) den = 6.103515625e-5;
        if (!m->d.expert_norm) den = 1.0;
        for (int64_t i = 0; i < E; i++) {
            double num = 0.0;
            for (int j = 0; j < k; j++) num += (double)w[j] * (double)s->pair_out[(size_t)(t * k + j) * E + i];
            x[i] += (float)(num / den * scale);
        }
    }
}

/* The shared expert, over every token, gated by sigmoid(xn . w) when a gate exists. */
static st_status shared_expert(st_model *m, st_pool *pool, const st_layer *L, int64_t T) {
    scratch *s = &m->s;
    const int64_t E = m->d.n_embd;
    for (int64_t t = 0; t < T; t++) {
        float g = 1.0f;
        if (L->gate_inp_shexp.data) {
            st_dot_f(ST_TYPE_F32)(L->gate_inp_shexp.data, s->xn + t * E, E, &g);
            g = 1.0f / (1.0f + expf(-g));
        }
        s->gate_shexp[t] = g;
    }
    CHECK(st_ffn_all_tokens(m, pool, &L->gate_shexp, &L->up_shexp, &L->down_shexp, T));
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < E; i++) s->x[t * E + i] += s->gate_shexp[t] * s->pair_out[t * E + i];
    return ST_OK;
}

/* The routed experts of layer il over s->xn [T, E]: route, group, the grouped FFN, and the
 * weighted sum added into s->x. The step's routed block and st_moe_layer both run this. */
static st_status routed_ffn(st_model *m, st_pool *pool, int il, int64_t T, int32_t *hist, st_step_stats *stats) {
    const st_layer *L = &m->layers[il];
    scratch *s = &m->s;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    CHECK(route(m, pool, L, T));
    int32_t *fill = malloc(sizeof(int32_t) * (size_t)ne);
    ffn_group *groups = malloc(sizeof(ffn_group) * (size_t)ne);
    if (!fill || !groups) {
        free(fill);
        free(groups);
        return st_fail(ST_ENOMEM, "forward: out of memory (expert groups)");
    }
    const int32_t n_groups = group_by_expert(m, L, T, fill, groups, hist);
    stats->n_expert_tokens += T * k;
    stats->n_active_experts += n_groups;
    const int need_q = !st_type_is_float(L->gate_exps.type) || !st_type_is_float(L->up_exps.type);
    const acts in = st_make_acts(pool, s->xn, T, m->d.n_embd, need_q, layer_buf(s));
    const st_status rc =
        ffn_grouped(m, pool, groups, n_groups, &L->gate_exps, &L->up_exps, &L->down_exps, &in, s->pair_out,
                    m->d.arch == ST_ARCH_GPT_OSS);
    free(fill);
    free(groups);
    if (rc != ST_OK) return rc;
    combine(m, T);
    return ST_OK;
}

st_status st_moe_block(st_model *m, st_pool *pool, const st_batch *b, int il, int64_t T, st_step_stats *stats) {
    const st_layer *L = &m->layers[il];
    const int ne = m->d.n_expert;
    CHECK(routed_ffn(m, pool, il, T, b->expert_hist ? b->expert_hist + (size_t)il * (size_t)ne : NULL, stats));
    if (L->gate_shexp.data) CHECK(shared_expert(m, pool, L, T));
    return ST_OK;
}

/* ---- entry points for a caller that owns the rest of the layer (the hybrid GPU engine) ---- */

/* The checks shared by st_moe_layer and st_moe_pairs; grows the scratch for T tokens and
 * n_pairs pairs (its pair capacity is tokens x (k + 1)). */
static st_status moe_entry_check(const char *what, st_model *m, st_pool *pool, int32_t layer, int32_t T,
                                 const float *x, int64_t n_pairs) {
    if (!m || !pool) return st_fail(ST_EINVAL, "%s: model and pool are required", what);
    if (m->d.n_expert <= 0) return st_fail(ST_EINVAL, "%s: the model has no routed experts", what);
    if (layer < 0 || layer >= m->d.n_layer)
        return st_fail(ST_ERANGE, "%s: layer %d outside [0, %d)", what, layer, m->d.n_layer);
    if (!m->layers[layer].gate_exps.data)
        return st_fail(ST_EINVAL, "%s: layer %d has no routed experts", what, layer);
    if (T < 1 || T > ST_MOE_MAX_TOKENS)
        return st_fail(ST_EINVAL, "%s: T = %d tokens outside [1, %d]", what, T, ST_MOE_MAX_TOKENS);
    if (!x) return st_fail(ST_EINVAL, "%s: x is NULL", what);
    st_model_repack(m); /* the weights the step reads (repacked once, at the first CPU call) */
    const int64_t k1 = (int64_t)m->d.n_expert_used + 1;
    int64_t rows = (n_pairs + k1 - 1) / k1;
    if (rows < T) rows = T;
    return st_scratch_ensure(m, (size_t)rows, 1, 1);
}

st_status st_moe_layer(st_model *m, st_pool *pool, int32_t layer, int32_t T, const float *x, float *out,
                       int32_t *topk_id, float *topk_w) {
    CHECK(moe_entry_check("st_moe_layer", m, pool, layer, T, x, 0));
    if (!out) return st_fail(ST_EINVAL, "st_moe_layer: out is NULL");
    scratch *s = &m->s;
    const int64_t E = m->d.n_embd;
    const size_t tk = (size_t)T * (size_t)m->d.n_expert_used;
    memcpy(s->xn, x, sizeof(float) * (size_t)T * (size_t)E);
    memset(s->x, 0, sizeof(float) * (size_t)T * (size_t)E);
    st_step_stats stats = {0};
    CHECK(routed_ffn(m, pool, layer, T, NULL, &stats));
    memcpy(out, s->x, sizeof(float) * (size_t)T * (size_t)E);
    if (topk_id) memcpy(topk_id, s->topk_id, sizeof(int32_t) * tk);
    if (topk_w) memcpy(topk_w, s->topk_w, sizeof(float) * tk);
    return ST_OK;
}

st_status st_moe_pairs(st_model *m, st_pool *pool, int32_t layer, int32_t T, const float *x, int32_t n_pairs,
                       const int32_t *pair_tok, const int32_t *pair_exp, float *out) {
    const char *what = "st_moe_pairs";
    if (n_pairs < 0) return st_fail(ST_EINVAL, "%s: n_pairs = %d is negative", what, n_pairs);
    if (m && m->d.n_expert > 0 && (int64_t)n_pairs > (int64_t)T * m->d.n_expert)
        return st_fail(ST_EINVAL, "%s: %d pairs for %d tokens of %d experts (at most one pair per token and expert)",
                       what, n_pairs, T, m->d.n_expert);
    CHECK(moe_entry_check(what, m, pool, layer, T, x, n_pairs));
    if (n_pairs == 0) return ST_OK;
    if (!pair_tok || !pair_exp || !out) return st_fail(ST_EINVAL, "%s: pair_tok, pair_exp and out are required", what);
    const int ne = m->d.n_expert;
    for (int32_t p = 0; p < n_pairs; p++) {
        if (pair_tok[p] < 0 || pair_tok[p] >= T)
            return st_fail(ST_ERANGE, "%s: pair %d names token %d outside [0, %d)", what, p, pair_tok[p], T);
        if (pair_exp[p] < 0 || pair_exp[p] >= ne)
            return st_fail(ST_ERANGE, "%s: pair %d names expert %d outside [0, %d)", what, p, pair_exp[p], ne);
    }
    const st_layer *L = &m->layers[layer];
    scratch *s = &m->s;
    int32_t *start = s->expert_start;
    int32_t *fill = malloc(sizeof(int32_t) * (size_t)ne);
    ffn_group *groups = malloc(sizeof(ffn_group) * (size_t)ne);
    if (!fill || !groups) {
        free(fill);
        free(groups);
        return st_fail(ST_ENOMEM, "%s: out of memory (expert groups)", what);
    }
    /* grouped by expert, in the caller's pair order inside each expert (as the step groups its
     * pairs in token order): the kernels' results per (row, pair) do not depend on the grouping */
    memset(start, 0, sizeof(int32_t) * (size_t)(ne + 1));
    for (int32_t p = 0; p < n_pairs; p++) start[pair_exp[p] + 1]++, s->pair_tok[p] = pair_tok[p];
    for (int e = 0; e < ne; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int32_t) * (size_t)ne);
    for (int32_t p = 0; p < n_pairs; p++) s->pairs_by_expert[fill[pair_exp[p]]++] = p;
    int32_t n_groups = 0;
    for (int e = 0; e < ne; e++) {
        const int32_t cnt = start[e + 1] - start[e];
        if (!cnt) continue;
        groups[n_groups++] = expert_group(L, e, s->pairs_by_expert + start[e], cnt);
    }
    const int need_q = !st_type_is_float(L->gate_exps.type) || !st_type_is_float(L->up_exps.type);
    const acts in = st_make_acts(pool, x, T, m->d.n_embd, need_q, layer_buf(s));
    const st_status rc =
        ffn_grouped(m, pool, groups, n_groups, &L->gate_exps, &L->up_exps, &L->down_exps, &in, out,
                    m->d.arch == ST_ARCH_GPT_OSS);
    free(fill);
    free(groups);
    return rc;
}
