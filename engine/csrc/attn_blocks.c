/* Decode attention over listed blocks (the GPU engine's host tier, stg_settings.kv_host_attn): each token's keys
 * laid out in a list of blocks of one layer's paged cache (F16 or the 8-bit cache, kv.c's layouts), its query
 * heads' partials (max, sum, unnormalised output) written for a caller that merges them with partials of its
 * other keys (the GPU's split-KV combine takes them as one more split).
 *
 * The work: items (token, KV head, chunk of keys) across the pool, each one of the variant's split-decode part
 * kernels (st_attn_part / st_attn_part_q8: the kernels st_forward's split decode runs) over the chunk, then items
 * (token, KV head) merging their chunks' partials in chunk order into one partial per query head. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define AB_CHUNK_MAX 1024 /* keys a chunk at most (its K and V stay in the core's L2 while the group reads them) */
#define AB_CHUNK_MIN 64
#define AB_ITEMS_PER_THREAD 4

typedef struct {
    int32_t type, bs, hd, n_head, n_kv, G, n_tok, chunk;
    const void *k, *v;
    const f16_t *ks, *vs;
    const float *q;
    const int32_t *blk_off, *blocks, *n_keys;
    const int64_t *item0; /* [n_tok + 1]: token t's first item (its KV heads' chunks, head-major) */
    const int32_t *n_chunks; /* [n_tok] */
    float *cparts;        /* [items][G][hd + 2] the chunks' partials */
    float *scratch;       /* [n_threads][scratch_floats] */
    size_t scratch_floats;
    float *part_ml, *part_acc;
    attn_part_fn part;
} ab_ctx;

static kv_view ab_view(const ab_ctx *c, int32_t t, int32_t kvh) {
    kv_view v;
    memset(&v, 0, sizeof v);
    v.bt = c->blocks + c->blk_off[t];
    v.bs = c->bs, v.hd = c->hd, v.vd = c->hd, v.n_kv = c->n_kv, v.v_dim = c->n_kv * c->hd, v.kvh = kvh;
    v.n_hot = INT32_MAX;
    if (c->type == ST_KV_Q8_0) v.k8 = (const int8_t *)c->k, v.v8 = (const int8_t *)c->v, v.ks = c->ks, v.vs = c->vs;
    else v.k = (const f16_t *)c->k, v.v = (const f16_t *)c->v;
    return v;
}

/* The token of item i (binary search over item0) */
static int32_t ab_token(const ab_ctx *c, int64_t i) {
    int32_t lo = 0, hi = c->n_tok - 1;
    while (lo < hi) {
        const int32_t mid = (lo + hi + 1) / 2;
        if (c->item0[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static void ab_chunk_task(void *vctx, int64_t i, int thread) {
    const ab_ctx *c = vctx;
    const int32_t t = ab_token(c, i), nc = c->n_chunks[t];
    const int64_t r = i - c->item0[t];
    const int32_t kvh = (int32_t)(r / nc), ch = (int32_t)(r % nc);
    const int32_t j0 = ch * c->chunk, j1 = c->n_keys[t] - j0 < c->chunk ? c->n_keys[t] : j0 + c->chunk;
    const kv_view v = ab_view(c, t, kvh);
    const float *q = c->q + ((size_t)t * (size_t)c->n_head + (size_t)kvh * (size_t)c->G) * (size_t)c->hd;
    c->part(&v, q, c->hd, c->G, j0, j1, c->cparts + (size_t)i * (size_t)c->G * (size_t)(c->hd + 2),
            c->scratch + (size_t)thread * c->scratch_floats);
}

/* Token t, KV head kvh: its chunks' partials merged in chunk order (st_attn_combine's operations without the
 * division), or {-inf, 0, zeros} for a token without keys. */
static void ab_merge_task(void *vctx, int64_t i, int thread) {
    const ab_ctx *c = vctx;
    (void)thread;
    const int32_t t = (int32_t)(i / c->n_kv), kvh = (int32_t)(i % c->n_kv), nc = c->n_chunks[t], hd = c->hd;
    const size_t ps = (size_t)(hd + 2);
    for (int32_t g = 0; g < c->G; g++) {
        const size_t row = (size_t)t * (size_t)c->n_head + (size_t)kvh * (size_t)c->G + (size_t)g;
        float *ml = c->part_ml + 2 * row, *acc = c->part_acc + row * (size_t)hd;
        float mx = -INFINITY, sum = 0.0f;
        for (int d = 0; d < hd; d++) acc[d] = 0.0f;
        if (nc > 0) {
            const float *p0 = c->cparts + ((size_t)(c->item0[t] + (int64_t)kvh * nc) * (size_t)c->G + (size_t)g) * ps;
            const size_t cs = (size_t)c->G * ps; /* chunk stride */
            for (int32_t k = 0; k < nc; k++) mx = p0[k * cs] > mx ? p0[k * cs] : mx;
            for (int32_t k = 0; k < nc; k++) {
                const float *p = p0 + k * cs;
                const float w = expf(p[0] - mx); /* 1 exactly for the chunk holding the maximum */
                sum = fmaf(w, p[1], sum);
                for (int d = 0; d < hd; d++) acc[d] = fmaf(w, p[2 + d], acc[d]);
            }
        }
        ml[0] = mx, ml[1] = sum;
    }
}

st_status st_attn_blocks_part(st_pool *pool, int32_t type, const void *k, const void *v, const uint16_t *ks,
                              const uint16_t *vs, int32_t n_blocks, int32_t block_size, int32_t head_dim,
                              int32_t n_head, int32_t n_kv, int32_t n_tok, const float *q, const int32_t *blk_off,
                              const int32_t *blocks, const int32_t *n_keys, float *part_ml, float *part_acc) {
    if (!k || !v || !q || !blk_off || !n_keys || !part_ml || !part_acc)
        return st_fail(ST_EINVAL, "attn_blocks_part: NULL argument");
    if (type != ST_KV_F16 && type != ST_KV_Q8_0) return st_fail(ST_EINVAL, "attn_blocks_part: KV type %d", type);
    if (type == ST_KV_Q8_0 && (!ks || !vs)) return st_fail(ST_EINVAL, "attn_blocks_part: the 8-bit cache's scales");
    const int32_t hd_step = type == ST_KV_Q8_0 ? 32 : 16;
    if (n_blocks < 0 || block_size < ST_ATTN_TILE || block_size > ST_MAX_BLOCK_SIZE || block_size % ST_ATTN_TILE ||
        head_dim < hd_step || head_dim > ST_MAX_HEAD_DIM || head_dim % hd_step || n_kv < 1 || n_head < n_kv ||
        n_head > ST_MAX_HEADS || n_head % n_kv || n_tok < 1)
        return st_fail(ST_EINVAL, "attn_blocks_part: bad shape (blocks=%d bs=%d hd=%d n_head=%d n_kv=%d n_tok=%d)",
                       n_blocks, block_size, head_dim, n_head, n_kv, n_tok);
    if (blk_off[0] != 0) return st_fail(ST_EINVAL, "attn_blocks_part: blk_off[0] = %d (0)", blk_off[0]);
    int32_t max_keys = 0;
    for (int32_t t = 0; t < n_tok; t++) {
        const int32_t nb = blk_off[t + 1] - blk_off[t];
        if (nb < 0) return st_fail(ST_EINVAL, "attn_blocks_part: blk_off decreases at token %d", t);
        if (n_keys[t] < 0 || (int64_t)n_keys[t] > (int64_t)nb * block_size)
            return st_fail(ST_EINVAL, "attn_blocks_part: token %d: %d keys in %d blocks of %d", t, n_keys[t], nb,
                           block_size);
        if (nb > 0 && !blocks) return st_fail(ST_EINVAL, "attn_blocks_part: NULL block list");
        for (int32_t j = 0; j < (n_keys[t] + block_size - 1) / block_size; j++) {
            const int32_t b = blocks[blk_off[t] + j];
            if (b < 0 || b >= n_blocks)
                return st_fail(ST_ERANGE, "attn_blocks_part: token %d: block %d outside [0, %d)", t, b, n_blocks);
        }
        max_keys = n_keys[t] > max_keys ? n_keys[t] : max_keys;
    }
    const int32_t n_threads = pool ? st_pool_threads(pool) : 1;
    int64_t total = 0;
    for (int32_t t = 0; t < n_tok; t++) total += n_keys[t];
    /* chunks: enough items for AB_ITEMS_PER_THREAD a thread, within [AB_CHUNK_MIN, AB_CHUNK_MAX] keys, 16 apart */
    int64_t chunk = (total * n_kv + (int64_t)AB_ITEMS_PER_THREAD * n_threads - 1) / ((int64_t)AB_ITEMS_PER_THREAD * n_threads);
    chunk = chunk < AB_CHUNK_MIN ? AB_CHUNK_MIN : chunk > AB_CHUNK_MAX ? AB_CHUNK_MAX : chunk;
    chunk = (chunk + 15) / 16 * 16;
    ab_ctx c;
    memset(&c, 0, sizeof c);
    c.type = type, c.bs = block_size, c.hd = head_dim, c.n_head = n_head, c.n_kv = n_kv, c.G = n_head / n_kv;
    c.n_tok = n_tok, c.chunk = (int32_t)chunk, c.k = k, c.v = v, c.ks = (const f16_t *)ks, c.vs = (const f16_t *)vs;
    c.q = q, c.blk_off = blk_off, c.blocks = blocks, c.n_keys = n_keys, c.part_ml = part_ml, c.part_acc = part_acc;
    c.part = type == ST_KV_Q8_0 ? st_attn_part_q8() : st_attn_part();
    int64_t *item0 = malloc(sizeof(int64_t) * ((size_t)n_tok + 1));
    int32_t *n_chunks = malloc(sizeof(int32_t) * (size_t)n_tok);
    if (!item0 || !n_chunks) {
        free(item0), free(n_chunks);
        return st_fail(ST_ENOMEM, "attn_blocks_part: out of memory");
    }
    item0[0] = 0;
    for (int32_t t = 0; t < n_tok; t++) {
        n_chunks[t] = (int32_t)((n_keys[t] + chunk - 1) / chunk);
        item0[t + 1] = item0[t] + (int64_t)n_chunks[t] * n_kv;
    }
    const int64_t n_items = item0[n_tok];
    const int32_t span = max_keys < (int32_t)chunk ? max_keys : (int32_t)chunk;
    c.scratch_floats = st_attn_scratch_floats(head_dim, span > 0 ? span : 1);
    c.item0 = item0, c.n_chunks = n_chunks;
    c.cparts = n_items > 0 ? malloc(sizeof(float) * (size_t)n_items * (size_t)c.G * (size_t)(head_dim + 2)) : NULL;
    c.scratch = n_items > 0 ? malloc(sizeof(float) * c.scratch_floats * (size_t)n_threads) : NULL;
    if (n_items > 0 && (!c.cparts || !c.scratch)) {
        free(item0), free(n_chunks), free(c.cparts), free(c.scratch);
        return st_fail(ST_ENOMEM, "attn_blocks_part: out of memory");
    }
    if (n_items > 0) {
        if (pool) st_pool_run(pool, ab_chunk_task, &c, n_items);
        else
            for (int64_t i = 0; i < n_items; i++) ab_chunk_task(&c, i, 0);
    }
    const int64_t n_merge = (int64_t)n_tok * n_kv;
    if (pool && n_items > 0) st_pool_run(pool, ab_merge_task, &c, n_merge);
    else
        for (int64_t i = 0; i < n_merge; i++) ab_merge_task(&c, i, 0);
    free(item0), free(n_chunks), free(c.cparts), free(c.scratch);
    return ST_OK;
}

static double ab_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

st_status st_attn_blocks_gbs(st_pool *pool, int32_t type, int32_t block_size, int32_t head_dim, int32_t n_head,
                             int32_t n_kv, int32_t n_tok, int32_t n_keys, double seconds, double *gbs) {
    if (!gbs) return st_fail(ST_EINVAL, "attn_blocks_gbs: NULL argument");
    *gbs = 0.0;
    if (n_tok < 1 || n_tok > 64 || n_keys < 1 || n_keys > (1 << 22) || block_size < ST_ATTN_TILE ||
        block_size > ST_MAX_BLOCK_SIZE || n_kv < 1 || head_dim < 1 || !(seconds > 0.0 && seconds <= 60.0))
        return st_fail(ST_EINVAL, "attn_blocks_gbs: bad arguments (n_tok=%d keys=%d bs=%d seconds=%g)", n_tok, n_keys,
                       block_size, seconds);
    const int32_t nb = (n_keys + block_size - 1) / block_size, n_blocks = nb * n_tok;
    const size_t vals = (size_t)n_blocks * (size_t)block_size * (size_t)n_kv * (size_t)head_dim;
    const int q8 = type == ST_KV_Q8_0;
    const size_t esz = q8 ? 1 : sizeof(f16_t);
    unsigned char *k = malloc(vals * esz), *v = malloc(vals * esz);
    uint16_t *ks = q8 ? malloc(sizeof(uint16_t) * (vals / 32 + 1)) : NULL, *vs = q8 ? malloc(sizeof(uint16_t) * (vals / 32 + 1)) : NULL;
    float *q = malloc(sizeof(float) * (size_t)n_tok * (size_t)n_head * (size_t)(head_dim > 0 ? head_dim : 1));
    float *ml = malloc(sizeof(float) * 2 * (size_t)n_tok * (size_t)n_head);
    float *acc = malloc(sizeof(float) * (size_t)n_tok * (size_t)n_head * (size_t)(head_dim > 0 ? head_dim : 1));
    int32_t *off = malloc(sizeof(int32_t) * ((size_t)n_tok + 1)), *blocks = malloc(sizeof(int32_t) * (size_t)n_blocks);
    int32_t *keys = malloc(sizeof(int32_t) * (size_t)n_tok);
    st_status rc = ST_OK;
    if (!k || !v || (q8 && (!ks || !vs)) || !q || !ml || !acc || !off || !blocks || !keys) {
        rc = st_fail(ST_ENOMEM, "attn_blocks_gbs: out of memory");
        goto done;
    }
    uint32_t r = 12345u;
    for (size_t i = 0; i < vals * esz; i++) {
        r = r * 1664525u + 1013904223u;
        k[i] = (unsigned char)(r >> 24), v[i] = (unsigned char)(r >> 16);
    }
    if (!q8) /* F16 values of magnitude below 2 (exponent bits cleared but the lowest) */
        for (size_t i = 1; i < vals * esz; i += 2) k[i] &= 0x3b, v[i] &= 0x3b;
    for (size_t i = 0; q8 && i < vals / 32 + 1; i++) ks[i] = vs[i] = 0x2000; /* 2^-7 */
    for (size_t i = 0; i < (size_t)n_tok * (size_t)n_head * (size_t)head_dim; i++)
        r = r * 1664525u + 1013904223u, q[i] = ((float)(r >> 8) / 16777216.0f - 0.5f) * 0.1f;
    for (int32_t t = 0; t <= n_tok; t++) off[t] = t * nb;
    for (int32_t b = 0; b < n_blocks; b++) blocks[b] = (int32_t)(((int64_t)b * 7919) % n_blocks); /* scattered */
    for (int32_t t = 0; t < n_tok; t++) keys[t] = n_keys;
    const double bytes = (double)n_tok * (double)n_keys * (double)n_kv * (double)head_dim * 2.0 *
                         (q8 ? 1.0 + 2.0 / 32.0 : 2.0);
    rc = st_attn_blocks_part(pool, type, k, v, ks, vs, n_blocks, block_size, head_dim, n_head, n_kv, n_tok, q, off,
                             blocks, keys, ml, acc); /* a first call: the pool wakes, the pages come in */
    if (rc) goto done;
    int64_t calls = 0;
    const double t0 = ab_now();
    double dt = 0.0;
    do {
        rc = st_attn_blocks_part(pool, type, k, v, ks, vs, n_blocks, block_size, head_dim, n_head, n_kv, n_tok, q, off,
                                 blocks, keys, ml, acc);
        if (rc) goto done;
        calls++;
        dt = ab_now() - t0;
    } while (dt < seconds);
    *gbs = bytes * (double)calls / dt * 1e-9;
done:
    free(k), free(v), free(ks), free(vs), free(q), free(ml), free(acc), free(off), free(blocks), free(keys);
    return rc;
}
