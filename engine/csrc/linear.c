/* Step primitives shared by the attention and FFN blocks: RMSNorm, quantisation of
 * activation rows for the integer kernels, and a linear layer spread over the pool.
 * The tile helpers (make_tile, dot_tile) are inline in internal.h so that every
 * parallel task inlines them. */
#include <math.h>
#include <unistd.h>

#include "internal.h"

void st_rmsnorm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    const float scale = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * scale);
}

typedef struct {
    const float *x;
    int64_t K;
    act_buf o;
    quant_act_fn fn;
    quant_act_k_fn fk; /* NULL: no per-256 view (K % 256) */
} quant_ctx;

static void quant_task(void *ctx, int64_t t, int thread) {
    (void)thread;
    const quant_ctx *c = ctx;
    const int64_t K = c->K;
    c->fn(c->x + t * K, K, c->o.q + t * K, c->o.d + t * (K / QK), c->o.s + t * (K / 16),
          c->o.xs8 + t * (K / 4), c->o.xs + t * (K / QK));
    if (c->fk) c->fk(c->x + t * K, K, c->o.qk + t * K, c->o.dk + t * (K / QK_K), c->o.bk + t * (K / 16));
}

acts st_acts_view(const float *x, int64_t K, int need_q, act_buf o) {
    acts a = {.x = x, .K = K};
    if (need_q) {
        a.q = o.q, a.d = o.d, a.s = o.s, a.xs8 = o.xs8, a.xs = o.xs;
        if (K % QK_K == 0 && o.qk) a.qk = o.qk, a.dk = o.dk, a.bk = o.bk;
    }
    return a;
}

/* the quantisation of rows of x into o: the per-256 view too where K allows it and o has room */
static quant_ctx quant_ctx_of(const float *x, int64_t K, act_buf o) {
    return (quant_ctx){x, K, o, st_quant_act(), K % QK_K == 0 && o.qk ? st_quant_act_k() : NULL};
}

void st_quant_act_row(const float *x, int64_t K, act_buf o, int64_t t) {
    quant_ctx c = quant_ctx_of(x, K, o);
    quant_task(&c, t, 0);
}

acts st_make_acts(st_pool *pool, const float *x, int64_t T, int64_t K, int need_q, act_buf o) {
    if (need_q) {
        quant_ctx c = quant_ctx_of(x, K, o);
        st_pool_run(pool, quant_task, &c, T);
    }
    return st_acts_view(x, K, need_q, o);
}

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
    float res[ST_MAX_NT * ST_ROW_BLOCK];
    act_tile tl;
    for (int64_t tile = 0; tile < c->T; tile += TOKEN_TILE) {
        const int nt = (int)(c->T - tile < TOKEN_TILE ? c->T - tile : TOKEN_TILE);
        make_tile(&tl, &c->in, c->rows ? c->rows + tile : NULL, tile, nt);
        for (int64_t r = r0; r < r1; r += ST_ROW_BLOCK) {
            const int nr = (int)(r1 - r < ST_ROW_BLOCK ? r1 - r : ST_ROW_BLOCK);
            dot_tile(c->type, c->fq, c->ff, c->w + (size_t)r * c->row_bytes, c->row_bytes, nr, &c->in, &tl, res);
            for (int i = 0; i < nt; i++)
                for (int j = 0; j < nr; j++) c->out[(tile + i) * c->ldo + r + j] = res[i * ST_ROW_BLOCK + j];
        }
    }
}

size_t st_l2_bytes(void) {
    static size_t cached;
    if (!cached) {
        const long v = sysconf(_SC_LEVEL2_CACHE_SIZE); /* per core; 0 or -1 where unknown */
        cached = v >= (64 << 10) && v <= (64L << 20) ? (size_t)v : (size_t)512 << 10;
    }
    return cached;
}

int64_t st_tile_rows(int64_t rows, int64_t want, size_t bytes_per_row) {
    /* At most half the L2 of weights per tile: with more than TOKEN_TILE tokens the tile's
     * rows are read once per token tile, and the second pass must still find them there. */
    int64_t cap = (int64_t)(st_l2_bytes() / 2 / (bytes_per_row ? bytes_per_row : 1));
    if (want > cap) want = cap;
    want = (want + ST_ROW_BLOCK - 1) / ST_ROW_BLOCK * ST_ROW_BLOCK; /* whole register row blocks */
    if (want < ST_ROW_BLOCK) want = ST_ROW_BLOCK;
    return want < rows ? want : rows;
}

static int64_t pick_chunk(int64_t N, int64_t T, int n_threads, size_t row_bytes) {
    /* Enough items to balance (>= 8 per thread) but each large enough to amortise. */
    int64_t chunk = N / (8 * (int64_t)n_threads);
    const int64_t min_chunk = T >= 16 ? ST_ROW_BLOCK : 16;
    if (chunk < min_chunk) chunk = min_chunk;
    if (chunk > 256) chunk = 256;
    return st_tile_rows(N, chunk, row_bytes);
}

void st_linear(st_pool *pool, const st_tensor *W, const acts *in, const int32_t *rows, int64_t T, float *out,
               int64_t ldo) {
    linear_ctx c = {W->data, W->type, st_row_bytes(W->type, W->ne[0]), W->ne[1], T, 0, ldo, rows, *in, out,
                    st_dot_q(W->type), st_dot_f(W->type)};
    c.chunk = pick_chunk(c.N, T, st_pool_threads(pool), c.row_bytes);
    st_pool_run(pool, linear_task, &c, (c.N + c.chunk - 1) / c.chunk);
}

void st_add_bias(float *y, const st_tensor *b, int64_t T, int64_t n) {
    if (!b->data) return;
    const float *bv = b->data;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < n; i++) y[t * n + i] += bv[i];
}
