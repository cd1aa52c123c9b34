/* Multi-head latent attention (deepseek2: DeepSeek-V2 / V3 / R1, Kimi-K2).
 *
 * Each token's keys and values come from one compressed latent c (kv_lora_rank values, after
 * its RMSNorm) and one rotary key part k_pe (rope_dim values) shared by every head: head h's key
 * is [W_UK_h c, k_pe] and its value W_UV_h c. The cache holds only the row [c, k_pe] per token
 * and layer (st_model.c_*: one "head" of kv_lora_rank + rope_dim, values its first
 * kv_lora_rank), and attention runs on it directly:
 *
 *   score_h(i, j) = q_nope_h(i) . W_UK_h c_j + q_pe_h(i) . k_pe_j = [W_UK_h^T q_nope_h(i), q_pe_h(i)] . [c_j, k_pe_j]
 *   out_h(i)      = sum_j p_h(i, j) W_UV_h c_j = W_UV_h (sum_j p_h(i, j) c_j)
 *
 * so each head's query is absorbed into the latent space (the absorption matrix per head:
 * kv_lora_rank rows of nope, wk_b in the file, or the key rows of wkv_b transposed once at
 * load), the latent is attended as a single shared KV head (GQA with one group), and each
 * head's latent output is expanded by W_UV_h (wv_b, or wkv_b's value rows) before wo. The
 * per-head products run as one parallel region each over (head, row range) items with the
 * step's kernels, so a token's result does not depend on the batch around it. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ------------------------------------------------------------------ per-head linears */

/* out[t * ldo + h * hstride + r] = W_h[r, :] . in[t * n_head + h, :] for r < rows, h < n_head,
 * t < T; W_h is `rows` rows of row_bytes at base + h * head_bytes. */
typedef struct {
    const uint8_t *base;
    int32_t type;
    size_t row_bytes, head_bytes;
    int64_t rows, chunk, per_head, T, ldo, hstride;
    int n_head;
    acts in;
    float *out;
    dot_q_fn fq;
    dot_f_fn ff;
} head_ctx;

static void head_task(void *vctx, int64_t item, int thread) {
    (void)thread;
    const head_ctx *c = vctx;
    const int h = (int)(item / c->per_head);
    const int64_t r0 = item % c->per_head * c->chunk, r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
    const uint8_t *w = c->base + (size_t)h * c->head_bytes;
    float res[ST_MAX_NT * ST_ROW_BLOCK];
    int32_t idx[ST_MAX_NT];
    act_tile tl;
    for (int64_t tile = 0; tile < c->T; tile += TOKEN_TILE) {
        const int nt = (int)(c->T - tile < TOKEN_TILE ? c->T - tile : TOKEN_TILE);
        for (int i = 0; i < nt; i++) idx[i] = (int32_t)((tile + i) * c->n_head + h);
        make_tile(&tl, &c->in, idx, 0, nt);
        for (int64_t r = r0; r < r1; r += ST_ROW_BLOCK) {
            const int nr = (int)(r1 - r < ST_ROW_BLOCK ? r1 - r : ST_ROW_BLOCK);
            dot_tile(c->type, c->fq, c->ff, w + (size_t)r * c->row_bytes, c->row_bytes, nr, &c->in, &tl, res);
            for (int i = 0; i < nt; i++)
                for (int j = 0; j < nr; j++)
                    c->out[(tile + i) * c->ldo + (int64_t)h * c->hstride + r + j] = res[i * ST_ROW_BLOCK + j];
        }
    }
}

static void head_linear(st_pool *pool, const uint8_t *base, int32_t type, int64_t n_in, int64_t rows,
                        size_t head_bytes, int n_head, const acts *in, int64_t T, float *out, int64_t ldo,
                        int64_t hstride) {
    head_ctx c = {base, type, st_row_bytes(type, n_in), head_bytes, rows, rows < 64 ? rows : 64, 0, T, ldo, hstride,
                  n_head, *in, out, st_dot_q(type), st_dot_f(type)};
    c.per_head = (rows + c.chunk - 1) / c.chunk;
    st_pool_run(pool, head_task, &c, (int64_t)n_head * c.per_head);
}

/* ------------------------------------------------------------------ load */

st_status st_mla_prepare(st_model *m) {
    const st_model_desc *d = &m->d;
    const int64_t H = d->n_head, kl = d->kv_lora_rank, nope = d->head_dim - d->rope_dim, vd = d->head_dim_v;
    m->mla_kb = calloc((size_t)d->n_layer, sizeof *m->mla_kb);
    if (!m->mla_kb) return st_fail(ST_ENOMEM, "model_create: out of memory");
    int64_t n_kvb = 0;
    for (int il = 0; il < d->n_layer; il++) n_kvb += m->layers[il].wkv_b.data != NULL;
    const size_t per_layer = (size_t)H * (size_t)kl * (size_t)nope; /* < 2^30: all three bounded by 1024 */
    float *row = NULL;
    if (n_kvb) {
        m->mla_kb_buf = malloc(sizeof(float) * per_layer * (size_t)n_kvb);
        row = malloc(sizeof(float) * (size_t)kl);
        if (!m->mla_kb_buf || !row) {
            free(row);
            return st_fail(ST_ENOMEM, "model_create: out of memory for the latent attention's %lld absorption "
                                      "matrices (%zu bytes each)", (long long)n_kvb, sizeof(float) * per_layer);
        }
    }
    float *kb = m->mla_kb_buf;
    for (int il = 0; il < d->n_layer; il++) {
        const st_layer *L = &m->layers[il];
        if (!L->wkv_b.data) {
            m->mla_kb[il] = L->wk_b;
            continue;
        }
        /* wkv_b's rows h * (nope + vd) + j, j < nope, are W_UK_h's rows (kv_lora_rank values each);
         * the absorption needs its columns as rows: kb[h][r][j] = W_UK_h[j][r] */
        const size_t rb = st_row_bytes(L->wkv_b.type, kl);
        for (int64_t h = 0; h < H; h++)
            for (int64_t j = 0; j < nope; j++) {
                st_dequantize(L->wkv_b.type, (const uint8_t *)L->wkv_b.data + (size_t)(h * (nope + vd) + j) * rb, row,
                              kl);
                for (int64_t r = 0; r < kl; r++) kb[((size_t)h * (size_t)kl + (size_t)r) * (size_t)nope + (size_t)j] = row[r];
            }
        m->mla_kb[il] = (st_tensor){kb, ST_TYPE_F32, 3, {nope, kl, H, 1}, (int64_t)(sizeof(float) * per_layer)};
        kb += per_layer;
    }
    free(row);
    return ST_OK;
}

/* ------------------------------------------------------------------ the block */

void st_mla_block(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, int il, int64_t T) {
    const st_layer *L = &m->layers[il];
    scratch *s = &m->s;
    const st_model_desc *d = &m->d;
    const int64_t E = d->n_embd, H = d->n_head, kl = d->kv_lora_rank, rd = d->rope_dim, hd = d->head_dim;
    const int64_t nope = hd - rd, ck = m->c_hd_k, ql = d->q_lora_rank, vd = d->head_dim_v;
    for (int64_t t = 0; t < T; t++) st_rmsnorm_row(s->x + t * E, L->attn_norm.data, s->xn + t * E, E, d->norm_eps);
    const st_tensor *wq = ql > 0 ? &L->wq_a : &L->wq;
    const acts in = st_make_acts(pool, s->xn, T, E, !st_type_is_float(wq->type) || !st_type_is_float(L->wkv_a.type),
                                 layer_buf(s));
    st_linear(pool, wq, &in, NULL, T, ql > 0 ? s->mqa : s->mq, ql > 0 ? ql : m->q_dim);
    st_linear(pool, &L->wkv_a, &in, NULL, T, s->mkv, ck); /* [T, kv_lora_rank + rope_dim] */
    if (ql > 0) {
        for (int64_t t = 0; t < T; t++) st_rmsnorm_row(s->mqa + t * ql, L->q_a_norm.data, s->mqa + t * ql, ql, d->norm_eps);
        const acts qa = st_make_acts(pool, s->mqa, T, ql, !st_type_is_float(L->wq_b.type), layer_buf(s));
        st_linear(pool, &L->wq_b, &qa, NULL, T, s->mq, m->q_dim); /* [T, n_head * head_dim] */
    }
    /* softmax scale 1/sqrt(head_dim) (the key's full nope + rope width) folded into each query */
    const float scale = 1.0f / sqrtf((float)hd);
    for (int64_t t = 0; t < T; t++) {
        float *row = s->mkv + t * ck, *q = s->mq + t * m->q_dim, *qa = s->q + t * m->c_q_dim;
        st_rmsnorm_row(row, L->kv_a_norm.data, row, kl, d->norm_eps);
        st_rope_row(row, 1, (int)ck, (int)kl, (int)rd, d->rope_type, m->inv_freq, m->rope_mscale, b->pos[t]);
        st_rope_row(q, (int)H, (int)hd, (int)nope, (int)rd, d->rope_type, m->inv_freq, m->rope_mscale, b->pos[t]);
        for (int64_t h = 0; h < H; h++) {
            float *g = s->mg + (t * H + h) * nope;
            for (int64_t i = 0; i < nope; i++) g[i] = q[h * hd + i] * scale;
            for (int64_t i = 0; i < rd; i++) qa[h * ck + kl + i] = q[h * hd + nope + i] * scale;
        }
        const int32_t *bt = b->block_tables + (size_t)b->seq[t] * (size_t)b->max_blocks;
        st_kv_store(kv, il, bt[b->pos[t] / kv->block_size], b->pos[t] % kv->block_size, row, row);
    }
    /* each head's q_nope into the latent space: s->q[t, h, 0 .. kv_lora_rank) */
    const st_tensor *kb = &m->mla_kb[il];
    const acts qn = st_make_acts(pool, s->mg, T * H, nope, !st_type_is_float(kb->type), layer_buf(s));
    head_linear(pool, kb->data, kb->type, nope, kl, (size_t)kl * st_row_bytes(kb->type, nope), (int)H, &qn, T, s->q,
                m->c_q_dim, ck);
    st_attention_tiles(m, kv, pool, b, il); /* s->att: [T, n_head, kv_lora_rank] */
    /* each head's latent output expanded to its value space: s->mo[T, n_head * head_dim_v] */
    const st_tensor *wv = L->wkv_b.data ? &L->wkv_b : &L->wv_b;
    const size_t rb = st_row_bytes(wv->type, kl);
    const acts lat = st_make_acts(pool, s->att, T * H, kl, !st_type_is_float(wv->type), layer_buf(s));
    if (L->wkv_b.data) /* head h's value rows follow its nope key rows */
        head_linear(pool, (const uint8_t *)wv->data + (size_t)nope * rb, wv->type, kl, vd, (size_t)(nope + vd) * rb,
                    (int)H, &lat, T, s->mo, m->o_in, vd);
    else
        head_linear(pool, wv->data, wv->type, kl, vd, (size_t)vd * rb, (int)H, &lat, T, s->mo, m->o_in, vd);
    const acts o = st_make_acts(pool, s->mo, T, m->o_in, !st_type_is_float(L->wo.type), layer_buf(s));
    st_linear(pool, &L->wo, &o, NULL, T, s->tmp, E);
    for (int64_t i = 0; i < T * E; i++) s->x[i] += s->tmp[i];
}
