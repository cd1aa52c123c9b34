/* One step: the forward pass of a batch, in one C call.
 *
 * A batch is any mix of prefill chunks and decode tokens from many sequences
 * (st_batch). Per layer: RMSNorm -> q/k/v -> (q/k norm) -> RoPE -> write K/V into the
 * paged F16 cache -> attention over each token's own sequence -> output projection;
 * then RMSNorm -> FFN (dense, or routed experts plus a shared expert: moe.c). Then the
 * final norm and the output projection for the tokens that want logits.
 *
 * Parallel regions go through the pool; every region writes disjoint outputs. */
#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ attention */

/* Attention works on tiles: up to ST_ATTN_TILE consecutive tokens of one sequence (a
 * prefill chunk) share every K/V row they read; one work item per (tile, head). A decode token
 * with many keys is split instead (attention.c, st_attn_split_chunk): one work item per (KV
 * head, chunk of keys) computes the partials of the query heads sharing that KV head, and the
 * item that finishes a (token, KV head) last merges its chunks, so a long sequence spreads over
 * the whole pool within one parallel region. Split items come first (they are the long ones). */
typedef struct {
    int32_t n_rtiles, n_split; /* tiles left to the per-head kernels; tokens on the grouped path */
    int64_t n_split_items;
} attn_plan;

typedef struct {
    const st_model *m;
    const st_kv *kv;
    const st_batch *b;
    int layer;
    const int32_t *tiles; /* [n_tiles, 2]: first batch index, count */
    float *scratch;       /* per thread: per_thread floats */
    size_t per_thread;
    attn_fn fn;
    const split_tok *split; /* [n_split] */
    int32_t n_split;
    int64_t n_split_items;
    attn_part_fn part;
    float *parts;
    _Atomic int32_t *left; /* [n_split, n_kv] */
} attn_ctx;

/* KV head kvh of layer c->layer as batch token t's sequence sees it (the heads as cached: st_model.c_*). */
static kv_view layer_view(const attn_ctx *c, int32_t t, int kvh) {
    const st_kv *kv = c->kv;
    const int tiered = kv->n_cold > 0, q8 = kv->type == ST_KV_Q8_0;
    const size_t layer_elems = (size_t)c->layer * (size_t)kv->n_blocks * (size_t)kv->block_size;
    return (kv_view){q8 ? NULL : kv_k_block(kv, c->layer, 0), q8 ? NULL : kv_v_row(kv, c->layer, 0, 0),
                     c->b->block_tables + (size_t)c->b->seq[t] * (size_t)c->b->max_blocks, kv->block_size,
                     c->m->c_hd_k, c->m->c_hd_v, kv->n_kv, kv->v_dim, kvh, tiered ? kv->n_hot : INT32_MAX,
                     tiered ? kv_k_block(kv, c->layer, kv->n_hot) : NULL,
                     tiered ? kv_v_row(kv, c->layer, kv->n_hot, 0) : NULL,
                     q8 ? kv->k8 + layer_elems * (size_t)kv->k_dim : NULL,
                     q8 ? kv->v8 + layer_elems * (size_t)kv->v_dim : NULL,
                     q8 ? kv->ks + layer_elems * (size_t)(kv->k_dim / 32) : NULL,
                     q8 ? kv->vs + layer_elems * (size_t)(kv->v_dim / 32) : NULL};
}

static void split_task(const attn_ctx *c, int64_t item, int thread) {
    const st_model *m = c->m;
    int32_t lo = 0, hi = c->n_split - 1; /* the split token holding this item */
    while (lo < hi) {
        const int32_t mid = (lo + hi + 1) / 2;
        if (c->split[mid].item0 <= item) lo = mid;
        else hi = mid - 1;
    }
    const split_tok *sp = &c->split[lo];
    const int64_t local = item - sp->item0;
    const int kvh = (int)(local / sp->n_chunks), ch = (int)(local % sp->n_chunks);
    const int hd = m->c_hd_k, vd = m->c_hd_v, group = m->d.n_head / m->c_n_kv;
    const int32_t n_keys = c->b->pos[sp->t] + 1, j0 = ch * sp->chunk;
    const int32_t j1 = n_keys - j0 < sp->chunk ? n_keys : j0 + sp->chunk;
    const kv_view view = layer_view(c, sp->t, kvh);
    const size_t stride = (size_t)group * (size_t)(vd + 2);
    float *parts = c->parts + sp->part0 + (size_t)kvh * (size_t)sp->n_chunks * stride;
    const float *q = m->s.q + (int64_t)sp->t * m->c_q_dim + (int64_t)kvh * group * hd;
    c->part(&view, q, hd, group, j0, j1, parts + (size_t)ch * stride, c->scratch + (size_t)thread * c->per_thread);
    /* the last chunk of this (token, KV head) to finish merges them; acq_rel makes the others' partials visible */
    if (atomic_fetch_sub_explicit(&c->left[(size_t)lo * (size_t)m->c_n_kv + (size_t)kvh], 1,
                                  memory_order_acq_rel) == 1) {
        const st_layer *L = &m->layers[c->layer];
        const float *sink = L->sinks.data ? (const float *)L->sinks.data + kvh * group : NULL;
        st_attn_combine(parts, sp->n_chunks, stride, group, vd, sink,
                        m->s.att + (int64_t)sp->t * m->c_o_dim + (int64_t)kvh * group * vd, vd);
    }
}

static void attn_task(void *vctx, int64_t item, int thread) {
    const attn_ctx *c = vctx;
    if (item < c->n_split_items) {
        split_task(c, item, thread);
        return;
    }
    item -= c->n_split_items;
    const st_model *m = c->m;
    const int n_head = m->d.n_head, group = n_head / m->c_n_kv, hd = m->c_hd_k, vd = m->c_hd_v;
    const int64_t tile = item / n_head;
    const int h = (int)(item % n_head);
    const int32_t t0 = c->tiles[2 * tile], nq = c->tiles[2 * tile + 1];
    const kv_view view = layer_view(c, t0, h / group);
    const st_layer *L = &m->layers[c->layer];
    const int32_t n_swa = st_layer_swa(&m->d, c->layer) ? m->d.n_swa : 0;
    const float *q = m->s.q + t0 * m->c_q_dim + (int64_t)h * hd;
    float *out = m->s.att + t0 * m->c_o_dim + (int64_t)h * vd;
    if (n_swa > 0 || L->sinks.data) { /* gpt-oss: window and sink through the generic path */
        st_attn_ext(&view, q, m->c_q_dim, nq, c->b->pos[t0], out, m->c_o_dim,
                    c->scratch + (size_t)thread * c->per_thread, n_swa,
                    L->sinks.data ? (const float *)L->sinks.data + h : NULL);
        return;
    }
    c->fn(&view, q, m->c_q_dim, nq, c->b->pos[t0], out, m->c_o_dim, c->scratch + (size_t)thread * c->per_thread);
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

/* Which lone tokens (tiles of one: decode, or a chunk's odd last token) take the grouped path in
 * layer il: with split mode ST_SPLIT_OFF none; otherwise every one, in chunks by
 * st_attn_split_chunk (a single chunk below its threshold gives the per-head kernel's bits), by
 * their keys and the pool's size only, so a sequence gets the same bits alone or in any batch.
 * A layer with a sliding window keeps every tile on the per-head path; one with sinks takes the
 * grouped path only for tokens that really split (below that st_attn_ext keeps a token's bits
 * equal in a tile and alone). Sets p and fills s->split and s->rtiles for a layer with(out) a
 * sliding window and sinks. */
static void plan_layer(const st_model *m, const st_batch *b, int sliding, int sinks, int n_threads, int32_t n_tiles,
                       attn_plan *p) {
    const scratch *s = &m->s;
    const int n_kv = m->c_n_kv, n_head = m->d.n_head, vd = m->c_hd_v;
    p->n_rtiles = p->n_split = 0;
    p->n_split_items = 0;
    size_t n_parts = 0;
    for (int32_t i = 0; i < n_tiles; i++) {
        const int32_t t0 = s->tiles[2 * i], nq = s->tiles[2 * i + 1];
        const int32_t chunk = nq == 1 && !sliding ? st_attn_split_chunk(b->pos[t0] + 1, n_threads, n_kv) : 0;
        const int32_t n_chunks = chunk > 0 ? (int32_t)(((int64_t)b->pos[t0] + chunk) / chunk) : 0;
        if (n_chunks > 1 || (n_chunks == 1 && !sinks)) {
            s->split[p->n_split++] = (split_tok){t0, chunk, n_chunks, p->n_split_items, n_parts};
            p->n_split_items += (int64_t)n_kv * n_chunks;
            n_parts += (size_t)n_chunks * (size_t)n_head * (size_t)(vd + 2);
        } else {
            s->rtiles[2 * p->n_rtiles] = t0, s->rtiles[2 * p->n_rtiles + 1] = nq;
            p->n_rtiles++;
        }
    }
}

/* The step's tiles, and room for the partials of its lone tokens in any layer. */
static st_status plan_attention(st_model *m, const st_batch *b, int n_threads, int32_t *n_tiles) {
    scratch *s = &m->s;
    *n_tiles = build_tiles(b, s->tiles);
    attn_plan p;
    size_t n_parts = 0;
    plan_layer(m, b, 0, 0, n_threads, *n_tiles, &p); /* no window, no sinks: the most that splits */
    for (int32_t i = 0; i < p.n_split; i++)
        n_parts += (size_t)s->split[i].n_chunks * (size_t)m->d.n_head * (size_t)(m->c_hd_v + 2);
    return p.n_split ? st_scratch_split(s, n_parts, (size_t)p.n_split * (size_t)m->c_n_kv) : ST_OK;
}

void st_rope_row(float *x, int n_heads, int hd, int off, int rope_dim, int rope_type, const float *inv_freq,
                 float mscale, int32_t pos) {
    for (int i = 0; i < rope_dim / 2; i++) {
        const float theta = (float)pos * inv_freq[i];
        const float cs = cosf(theta) * mscale, sn = sinf(theta) * mscale;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + h * hd + off;
            const int a = rope_type == ST_ROPE_NEOX ? i : 2 * i;
            const int b = rope_type == ST_ROPE_NEOX ? i + rope_dim / 2 : 2 * i + 1;
            const float x0 = v[a], x1 = v[b];
            v[a] = x0 * cs - x1 * sn;
            v[b] = x0 * sn + x1 * cs;
        }
    }
}

void st_attention_tiles(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, int il) {
    scratch *s = &m->s;
    const st_layer *L = &m->layers[il];
    attn_plan plan;
    plan_layer(m, b, st_layer_swa(&m->d, il), L->sinks.data != NULL, st_pool_threads(pool), s->n_tiles, &plan);
    const int q8 = kv->type == ST_KV_Q8_0; /* the 8-bit cache: its own (generic) kernels */
    attn_ctx ac = {m, kv, b, il, s->rtiles, s->scores, s->cap_ctx, q8 ? st_attn_q8() : st_attn(), s->split,
                   plan.n_split, plan.n_split_items, q8 ? st_attn_part_q8() : st_attn_part(), s->parts, s->left};
    for (int32_t i = 0; i < plan.n_split; i++)
        for (int h = 0; h < m->c_n_kv; h++)
            atomic_store_explicit(&s->left[(size_t)i * (size_t)m->c_n_kv + (size_t)h], s->split[i].n_chunks,
                                  memory_order_relaxed); /* published to the workers by the pool's start */
    st_pool_run(pool, attn_task, &ac, plan.n_split_items + (int64_t)plan.n_rtiles * m->d.n_head);
}

static void attention_block(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, int il, int64_t T) {
    if (m->d.kv_lora_rank > 0) {
        st_mla_block(m, kv, pool, b, il, T);
        return;
    }
    const st_layer *L = &m->layers[il];
    scratch *s = &m->s;
    const st_model_desc *d = &m->d;
    const int64_t E = d->n_embd;
    for (int64_t t = 0; t < T; t++) st_rmsnorm_row(s->x + t * E, L->attn_norm.data, s->xn + t * E, E, d->norm_eps);
    const int need_q = !st_type_is_float(L->wq.type) || !st_type_is_float(L->wk.type) || !st_type_is_float(L->wv.type);
    const acts in = st_make_acts(pool, s->xn, T, E, need_q, layer_buf(s));
    st_linear(pool, &L->wq, &in, NULL, T, s->q, m->q_dim);   /* [T, n_head * hd] */
    st_linear(pool, &L->wk, &in, NULL, T, s->k, m->kv_dim);  /* [T, n_kv * hd] */
    st_linear(pool, &L->wv, &in, NULL, T, s->v, m->kv_dim);  /* [T, n_kv * hd] */
    st_add_bias(s->q, &L->bq, T, m->q_dim);
    st_add_bias(s->k, &L->bk, T, m->kv_dim);
    st_add_bias(s->v, &L->bv, T, m->kv_dim);
    const int hd = d->head_dim;
    for (int64_t t = 0; t < T; t++) {
        float *q = s->q + t * m->q_dim, *k = s->k + t * m->kv_dim;
        if (L->q_norm.data) {
            for (int h = 0; h < d->n_head; h++) st_rmsnorm_row(q + h * hd, L->q_norm.data, q + h * hd, hd, d->norm_eps);
            for (int h = 0; h < d->n_head_kv; h++) st_rmsnorm_row(k + h * hd, L->k_norm.data, k + h * hd, hd, d->norm_eps);
        }
        st_rope_row(q, d->n_head, hd, 0, d->rope_dim, d->rope_type, m->inv_freq, m->rope_mscale, b->pos[t]);
        st_rope_row(k, d->n_head_kv, hd, 0, d->rope_dim, d->rope_type, m->inv_freq, m->rope_mscale, b->pos[t]);
        const float scale = 1.0f / sqrtf((float)hd); /* folded into q once */
        for (int i = 0; i < m->q_dim; i++) q[i] *= scale;
        /* write this token's K (slot-minor) and V into its sequence's block */
        const int32_t *bt = b->block_tables + (size_t)b->seq[t] * (size_t)b->max_blocks;
        st_kv_store(kv, il, bt[b->pos[t] / kv->block_size], b->pos[t] % kv->block_size, k, s->v + t * m->kv_dim);
    }
    st_attention_tiles(m, kv, pool, b, il);
    const acts ain = st_make_acts(pool, s->att, T, m->q_dim, !st_type_is_float(L->wo.type), layer_buf(s));
    st_linear(pool, &L->wo, &ain, NULL, T, s->tmp, E);
    st_add_bias(s->tmp, &L->bo, T, E);
    for (int64_t i = 0; i < T * E; i++) s->x[i] += s->tmp[i];
}

/* ------------------------------------------------------------------ FFN */

static st_status ffn_block(st_model *m, st_pool *pool, const st_batch *b, int il, int64_t T, st_step_stats *stats) {
    const st_layer *L = &m->layers[il];
    scratch *s = &m->s;
    const int64_t E = m->d.n_embd;
    for (int64_t t = 0; t < T; t++) st_rmsnorm_row(s->x + t * E, L->ffn_norm.data, s->xn + t * E, E, m->d.norm_eps);
    if (st_layer_is_moe(m, il)) return st_moe_block(m, pool, b, il, T, stats);
    CHECK(st_ffn_all_tokens(m, pool, &L->ffn_gate, &L->ffn_up, &L->ffn_down, T)); /* pair_out: [T, E] */
    for (int64_t i = 0; i < T * E; i++) s->x[i] += s->pair_out[i];
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
    /* (token, expert) pairs are indexed in 32 bits: T * (k + 1) must fit */
    if ((int64_t)b->n_tokens * (int64_t)(m->d.n_expert_used + 1) > INT32_MAX)
        return st_fail(ST_ERANGE, "forward: %d tokens x %d experts exceed the step's pair index range", b->n_tokens,
                       m->d.n_expert_used + 1);
    /* latent attention's per-head rows are indexed t * n_head + h in 32 bits */
    if (m->d.kv_lora_rank > 0 && (int64_t)b->n_tokens * m->d.n_head > INT32_MAX)
        return st_fail(ST_ERANGE, "forward: %d tokens x %d heads exceed the step's row index range", b->n_tokens,
                       m->d.n_head);
    if (!b->tokens || !b->pos || !b->seq || !b->block_tables || b->n_seqs < 1 || b->max_blocks < 1)
        return st_fail(ST_EINVAL, "forward: batch is missing arrays");
    if (b->n_logits < 0 || (b->n_logits > 0 && (!b->logit_idx || (!b->logits && !b->out_tokens))))
        return st_fail(ST_EINVAL, "forward: logits requested without buffers (logits or out_tokens)");
    const int64_t capacity = (int64_t)b->max_blocks * kv->block_size; /* tokens per sequence */
    if (capacity > INT32_MAX)
        return st_fail(ST_ERANGE, "forward: %d blocks of %d tokens per sequence exceed 2^31 positions", b->max_blocks,
                       kv->block_size);
    for (int32_t i = 0; i < b->n_tokens; i++) {
        const int32_t src = b->token_src ? b->token_src[i] : -1;
        if (src >= 0 && m->n_picks < 1)
            return st_fail(ST_EINVAL, "forward: token_src[%d] = %d but the previous step left no greedy picks", i, src);
        if (src < -1 || src >= m->n_picks)
            return st_fail(ST_ERANGE, "forward: token_src[%d] = %d outside [-1, %d)", i, src, m->n_picks);
        if (src < 0 && (b->tokens[i] < 0 || b->tokens[i] >= m->d.n_vocab))
            return st_fail(ST_ERANGE, "forward: token id %d out of range [0, %d)", b->tokens[i], m->d.n_vocab);
        if (b->seq[i] < 0 || b->seq[i] >= b->n_seqs)
            return st_fail(ST_ERANGE, "forward: sequence index %d out of range", b->seq[i]);
        if (b->pos[i] < 0 || b->pos[i] / kv->block_size >= b->max_blocks)
            return st_fail(ST_ERANGE, "forward: position %d exceeds the sequence's KV capacity (%lld tokens)",
                           b->pos[i], (long long)capacity);
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

/* ------------------------------------------------------------------ greedy pick */

/* The first index of the row's maximum; a NaN is larger than any number (numpy argmax). */
static int32_t argmax_row(const float *x, int64_t n) {
    float v = x[0];
    int64_t best = 0;
    if (v != v) return 0;
    for (int64_t i = 1; i < n; i++) {
        const float y = x[i];
        if (y > v) v = y, best = i;
        else if (y != y) return (int32_t)i;
    }
    return (int32_t)best;
}

st_status st_argmax_rows(const float *x, int32_t rows, int64_t n, int32_t *out) {
    if (rows < 0 || (rows > 0 && (!x || !out))) return st_fail(ST_EINVAL, "argmax: NULL buffer or negative row count");
    if (n < 1 || n > INT32_MAX) return st_fail(ST_ERANGE, "argmax: row length %lld outside [1, 2^31)", (long long)n);
    for (int32_t r = 0; r < rows; r++) out[r] = argmax_row(x + (int64_t)r * n, n);
    return ST_OK;
}

/* The step's logits when the caller wants only the picks (b->logits NULL): a buffer kept in
 * the scratch, grown as needed. */
static float *logits_buffer(scratch *s, size_t n) {
    if (n > s->cap_logits) {
        free(s->logits);
        s->logits = malloc(sizeof(float) * n);
        s->cap_logits = s->logits ? n : 0;
    }
    return s->logits;
}

st_status st_forward(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, st_step_stats *stats) {
    if (!m || !kv || !b || !pool) return st_fail(ST_EINVAL, "forward: NULL argument");
    if (kv->n_layer != m->d.n_layer || kv->n_kv != m->c_n_kv || kv->head_dim != m->c_hd_k ||
        kv->head_dim_v != m->c_hd_v)
        return st_fail(ST_EINVAL, "forward: KV cache was created for another model");
    CHECK(validate_batch(m, kv, b));
    st_batch phys;
    if (kv->map) { /* a tiered cache: the step reads the tables through the logical -> physical map */
        const size_t n = (size_t)b->n_seqs * (size_t)b->max_blocks;
        if (n > kv->cap_bt) {
            int32_t *nb = realloc(kv->bt_phys, sizeof(int32_t) * n);
            if (!nb) return st_fail(ST_ENOMEM, "forward: out of memory for %zu block table entries", n);
            kv->bt_phys = nb, kv->cap_bt = n;
        }
        for (size_t i = 0; i < n; i++) {
            const int32_t id = b->block_tables[i];
            kv->bt_phys[i] = id >= 0 && id < kv->n_blocks ? kv->map[id] : id;
        }
        phys = *b;
        phys.block_tables = kv->bt_phys;
        b = &phys;
    }
    st_model_repack(m); /* first step only; a CPU step, so a model that only validated a file for the GPU never repacks */
    st_step_stats local = {0};
    st_step_stats *st = stats ? stats : &local;
    memset(st, 0, sizeof *st);
    double busy0, total0;
    st_pool_times(pool, &busy0, &total0);
    const double t_start = now_s();
    const int64_t T = b->n_tokens, E = m->d.n_embd;
    const int nt = st_pool_threads(pool);
    const size_t ctx = (size_t)b->max_blocks * (size_t)kv->block_size;
    CHECK(st_scratch_ensure(m, (size_t)(T > b->n_logits ? T : b->n_logits), (size_t)nt,
                            st_attn_scratch_floats(m->c_hd_k, (int32_t)ctx)));
    scratch *s = &m->s;
    const int32_t *ids = b->tokens;
    if (b->token_src) { /* the previous step's picks, before this step replaces them */
        if (T > m->cap_tok_buf) {
            int32_t *nb = realloc(m->tok_buf, sizeof(int32_t) * (size_t)T);
            if (!nb) return st_fail(ST_ENOMEM, "forward: out of memory for %lld token ids", (long long)T);
            m->tok_buf = nb, m->cap_tok_buf = T;
        }
        for (int64_t i = 0; i < T; i++) m->tok_buf[i] = b->token_src[i] < 0 ? b->tokens[i] : m->picks[b->token_src[i]];
        ids = m->tok_buf;
    }
    m->n_picks = 0; /* this step's picks (if any) replace them */
    CHECK(plan_attention(m, b, nt, &s->n_tiles));
    embed_ctx ec = {&m->d.token_embd, ids, s->x, E};
    st_pool_run(pool, embed_task, &ec, T);
    for (int il = 0; il < m->d.n_layer; il++) {
        const double t0 = now_s();
        attention_block(m, kv, pool, b, il, T);
        const double t1 = now_s();
        CHECK(ffn_block(m, pool, b, il, T, st));
        const double t2 = now_s();
        st->t_attn += t1 - t0;
        if (st_layer_is_moe(m, il)) st->t_experts += t2 - t1;
        else st->t_dense += t2 - t1;
    }
    const double t_out = now_s();
    if (b->n_logits > 0) {
        for (int32_t i = 0; i < b->n_logits; i++)
            st_rmsnorm_row(s->x + (int64_t)b->logit_idx[i] * E, m->d.output_norm.data, s->xn + (int64_t)i * E, E,
                           m->d.norm_eps);
        const acts in = st_make_acts(pool, s->xn, b->n_logits, E, !st_type_is_float(m->d.output.type), layer_buf(s));
        float *logits = b->logits ? b->logits : logits_buffer(s, (size_t)b->n_logits * (size_t)m->d.n_vocab);
        if (!logits) return st_fail(ST_ENOMEM, "forward: out of memory for %d rows of logits", b->n_logits);
        st_linear(pool, &m->d.output, &in, NULL, b->n_logits, logits, m->d.n_vocab); /* [n_logits, n_vocab] */
        if (b->out_tokens) {
            CHECK(st_argmax_rows(logits, b->n_logits, m->d.n_vocab, b->out_tokens));
            if (b->n_logits > m->cap_picks) {
                int32_t *np = realloc(m->picks, sizeof(int32_t) * (size_t)b->n_logits);
                if (!np) return st_fail(ST_ENOMEM, "forward: out of memory for %d picks", b->n_logits);
                m->picks = np, m->cap_picks = b->n_logits;
            }
            memcpy(m->picks, b->out_tokens, sizeof(int32_t) * (size_t)b->n_logits);
            m->n_picks = b->n_logits;
        }
    }
    const double t_end = now_s();
    st->t_output = t_end - t_out;
    st->t_total = t_end - t_start;
    st->n_tokens = T;
    double busy1, total1;
    st_pool_times(pool, &busy1, &total1);
    st->pool_idle_share = total1 > total0 ? 1.0 - (busy1 - busy0) / (total1 - total0) : 0.0;
    if (st->pool_idle_share < 0.0) st->pool_idle_share = 0.0; /* clock granularity */
    return ST_OK;
}
