/* Internal declarations shared by the C sources (not part of the cffi API). */
#ifndef STRATA_INTERNAL_H
#define STRATA_INTERNAL_H

#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "strata.h"

/* one step of a spin-wait (the pool's workers, a grouped FFN's down items): the x86 pause hint */
#if defined(__x86_64__)
#define CPU_RELAX() __builtin_ia32_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

st_status st_fail(st_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define QK 32    /* block size of the legacy quants and of the activation blocks */
#define QK_K 256 /* super-block size of the k-quants */
#define ST_R8_ROWS 8 /* rows per group of ST_TYPE_Q4_1_R8 (strata.h) */

/* ---- block layouts (exactly as in GGUF files) ---- */
typedef uint16_t f16_t;
typedef struct { f16_t d; uint8_t qs[QK / 2]; } blk_q4_0;
typedef struct { f16_t d, m; uint8_t qs[QK / 2]; } blk_q4_1;
typedef struct { f16_t d; uint8_t qh[4]; uint8_t qs[QK / 2]; } blk_q5_0;
typedef struct { f16_t d, m; uint8_t qh[4]; uint8_t qs[QK / 2]; } blk_q5_1;
typedef struct { f16_t d; int8_t qs[QK]; } blk_q8_0;
typedef struct { f16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } blk_q4_k;
typedef struct { f16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } blk_q5_k;
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; f16_t d; } blk_q6_k;

_Static_assert(sizeof(blk_q4_0) == 18, "q4_0");
_Static_assert(sizeof(blk_q4_1) == 20, "q4_1");
_Static_assert(sizeof(blk_q5_0) == 22, "q5_0");
_Static_assert(sizeof(blk_q5_1) == 24, "q5_1");
_Static_assert(sizeof(blk_q8_0) == 34, "q8_0");
_Static_assert(sizeof(blk_q4_k) == 144, "q4_k");
_Static_assert(sizeof(blk_q5_k) == 176, "q5_k");
_Static_assert(sizeof(blk_q6_k) == 210, "q6_k");

/* ---- half / bfloat conversions (exact, portable) ---- */
static inline float f16_to_f32(f16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline f16_t f32_to_f16(float f) { /* round to nearest even */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return (f16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    if (absx >= 0x477ff000u) return (f16_t)(sign | 0x7c00); /* overflow -> inf */
    if (absx < 0x38800000u) { /* half subnormal: unit 2^-24, hm = m >> (126 - e) */
        if (absx < 0x33000000u) return (f16_t)sign;
        uint32_t e = absx >> 23, m = (absx & 0x7fffff) | 0x800000;
        uint32_t shift = 126 - e;
        uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (hm & 1))) hm++;
        return (f16_t)(sign | hm);
    }
    uint32_t h = ((absx - 0x38000000u) >> 13);
    uint32_t rem = absx & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return (f16_t)(sign | h);
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- kernel table ----
 * One token's 8-bit activations: q[n], d[n/32] (scale), s[n/16] (sums of 16). The SIMD
 * kernels also read two derived views, made once per activation row by the quantiser:
 *   xs[n/32]  = d * (s0 + s1), the float weight of each 32-sum in the offset/minimum
 *               correction (the one-lane kernels of Q4_0/Q4_1/Q4_K),
 *   xs8[n/4]  = d * s per 16-sum, laid out for the (row, half) lanes of the other types: per
 *               32-block, that of its first 16 elements four times, then of its second 16.
 * dot_q: nr weight rows (row r at w + r * row_bytes, n elements each) against nt <= ST_MAX_NT
 *        tokens: out[t * ldo + r]. Rows are taken in register blocks and each block is
 *        unpacked once for all tokens. A (row, token) result never depends on nr, nt or the
 *        other rows and tokens (batch invariance: the harness checks it bit for bit).
 * dot_f: one weight row against float activations (F32/F16/BF16 weights). */
#define ST_MAX_NT 64
#define ST_MAX_ROW 65536 /* longest weight row the kernels accept (stack buffers) */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    const float *xs8;
    const float *xs;
    /* The same row quantised per 256 (llama.cpp's Q8_K): qk[n], one scale dk[n/256], int16 sums
     * bk[n/16]; NULL where n % 256. The k-quant kernels of st_type_q8k read this view only: with one
     * scale per super-block their integer sums run over the whole super-block and the float step
     * comes once per 256 weights instead of once per 32. */
    const int8_t *qk;
    const float *dk;
    const int16_t *bk;
} act_row;
/* Whether the kernels of `type` read the per-256 view (act_row.qk) instead of the per-32 one. */
static inline int st_type_q8k(int32_t type) {
    return type == ST_TYPE_Q6_K || type == ST_TYPE_Q2_K || type == ST_TYPE_Q3_K || type == ST_TYPE_IQ4_XS ||
           type == ST_TYPE_IQ2_XXS || type == ST_TYPE_IQ2_XS || type == ST_TYPE_IQ2_S || type == ST_TYPE_IQ3_XXS ||
           type == ST_TYPE_IQ3_S;
}
typedef void (*dot_q_fn)(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, float *out,
                         int64_t ldo);

/* The reference multi-row, multi-token dot_q_fn of a type whose one-row, one-token kernel is dot_T_one:
 * each (row, token) on its own. */
#define DEF_REF_MULTI(T)                                                                                     \
    static void dot_##T##_ref(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a,  \
                              float *out, int64_t ldo) {                                                     \
        for (int r = 0; r < nr; r++)                                                                         \
            for (int t = 0; t < nt; t++)                                                                     \
                dot_##T##_one((const uint8_t *)w + (size_t)r * row_bytes, a[t].q, a[t].d, a[t].s, n,         \
                              &out[t * ldo + r]);                                                            \
    }
/* The same for a type of st_type_q8k, whose one-row kernel dot_T_k8 reads the per-256 view. */
#define DEF_REF_MULTI_K8(T)                                                                                  \
    static void dot_##T##_ref(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a,  \
                              float *out, int64_t ldo) {                                                     \
        for (int r = 0; r < nr; r++)                                                                         \
            for (int t = 0; t < nt; t++)                                                                     \
                dot_##T##_k8((const uint8_t *)w + (size_t)r * row_bytes, a[t].qk, a[t].dk, a[t].bk, n,      \
                             &out[t * ldo + r]);                                                             \
    }
/* The types whose super-block is 16 groups of 16 codes with an integer scale per group (Q6_K, Q3_K; Q2_K's
 * scale part): code(blk, e) is code e (0..255) of the block, scale(blk, g) the scale of group g. g16_sum is
 * their references' exact integer sum against a[0..255], sum_g scale_g * sum_l code_(16 g + l) a_(16 g + l);
 * g16_dequant writes y[e] = (d * scale_g) * code_e, gguf-py's order. */
typedef int (*g16_fn)(const void *blk, int i);

static inline int32_t g16_sum(const void *blk, g16_fn code, g16_fn scale, const int8_t *a) {
    int32_t isum = 0;
    for (int g = 0; g < QK_K / 16; g++) {
        int32_t part = 0;
        for (int l = 0; l < 16; l++) part += code(blk, 16 * g + l) * a[16 * g + l];
        isum += scale(blk, g) * part;
    }
    return isum;
}

static inline void g16_dequant(const void *blk, g16_fn code, g16_fn scale, float d, float *y) {
    for (int g = 0; g < QK_K / 16; g++) {
        const float dg = d * (float)scale(blk, g);
        for (int l = 0; l < 16; l++) y[16 * g + l] = dg * (float)code(blk, 16 * g + l);
    }
}
typedef void (*dot_f_fn)(const void *w, const float *x, int64_t n, float *out);

dot_q_fn st_dot_q_ref(int32_t type);
dot_f_fn st_dot_f_ref(int32_t type);
dot_q_fn st_dot_q_avx2(int32_t type);
dot_f_fn st_dot_f_avx2(int32_t type);
dot_q_fn st_dot_q_avx512(int32_t type);
dot_f_fn st_dot_f_avx512(int32_t type);

/* Attention of one head over the paged KV cache (attention.c). */
typedef struct {
    const f16_t *k, *v;  /* this layer's K ([block][n_kv][hd][bs]) and V ([block][bs][v_dim]): the hot pool */
    const int32_t *bt;   /* the sequence's block table (physical blocks) */
    int32_t bs, hd, vd;  /* block size, key and value dimensions per head (vd <= hd, both multiples of 16) */
    int32_t n_kv, v_dim, kvh; /* v_dim = n_kv * vd: a V row */
    int32_t n_hot;            /* blocks below n_hot are in k/v; block p >= n_hot is block p - n_hot of kc/vc */
    const f16_t *kc, *vc;     /* this layer's cold pool (NULL when untiered, n_hot then INT32_MAX) */
    /* an 8-bit cache (ST_KV_Q8_0; k, v NULL): this layer's int8 values and F16 group scales (struct st_kv) */
    const int8_t *k8, *v8;
    const f16_t *ks, *vs;
} kv_view;
/* nq consecutive queries (rows of q, pre-scaled by 1/sqrt(hd)) at positions p0..p0+nq-1;
 * query i sees keys 0..p0+i; out rows hold vd values. scratch: st_attn_scratch_floats(hd, p0 + nq)
 * floats. */
typedef void (*attn_fn)(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                        int64_t o_stride, float *scratch);
#define ST_ATTN_TILE 16
/* The variants, defined in attention.c (which depends on nothing else). */
attn_fn st_attn_ref(void);
attn_fn st_attn_avx2(void);
attn_fn st_attn_avx512(void);
size_t st_attn_scratch_floats(int hd, int32_t max_keys);
/* Split decode attention (attention.c). The partial of nq query heads (rows of q, pre-scaled)
 * at one position over keys [j0, j1) of one KV head, j0 a multiple of 16: for query i,
 * part[i * (vd + 2) ..] = {m, l, acc[vd]}: the largest score, the sum of exp(s - m) and the
 * sum of exp(s - m) * v (not divided; vd the view's value dimensions). scratch: st_attn_scratch_floats(hd, j1 - j0) floats. */
typedef void (*attn_part_fn)(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t j0, int32_t j1,
                             float *part, float *scratch);
attn_part_fn st_attn_part_ref(void);
/* The same two over an 8-bit cache (kv_view.k8): the generic reference and an AVX2 version (NULL
 * without x86-64), which AVX-512 CPUs run too (no AVX-512 version is written: no machine to test it on). */
attn_fn st_attn_q8_ref(void);
attn_part_fn st_attn_part_q8_ref(void);
attn_fn st_attn_q8_avx2(void);
attn_part_fn st_attn_part_q8_avx2(void);
attn_part_fn st_attn_part_avx2(void);
attn_part_fn st_attn_part_avx512(void);
/* Merges n_chunks partials of nq queries (chunk c's at parts + c * chunk_stride) in chunk
 * order into out rows (o_stride apart); sink: NULL or [nq] logits joining each denominator. */
void st_attn_combine(const float *parts, int32_t n_chunks, size_t chunk_stride, int nq, int vd, const float *sink,
                     float *out, int64_t o_stride);
/* Keys per chunk for a decode query seeing n_keys keys with a pool of n_threads and n_kv KV
 * heads: 0 = not split (the per-head kernels). Follows the mode st_set_attn_split chose. */
int32_t st_attn_split_chunk(int32_t n_keys, int32_t n_threads, int32_t n_kv);
void st_attn_split_set_mode(int32_t mode);
int32_t st_attn_split_mode(void);

/* The kernels for the current variant, chosen in variants.c (falls back to ref per type). */
dot_q_fn st_dot_q(int32_t type);
dot_f_fn st_dot_f(int32_t type);
/* Attention of one head with an optional sliding window (n_swa > 0: query at position p sees
 * keys p - n_swa + 1 .. p) and an optional sink logit (joins the softmax denominator only):
 * the generic C path every variant uses for such layers (gpt-oss). */
void st_attn_ext(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out, int64_t o_stride,
                 float *scratch, int32_t n_swa, const float *sink);
/* Whether layer il of the model attends through a sliding window. */
static inline int st_layer_swa(const st_model_desc *d, int il) {
    return d->n_swa > 0 && d->swa_pattern > 0 && il % d->swa_pattern < d->swa_pattern - 1;
}
attn_fn st_attn(void);
attn_part_fn st_attn_part(void);
attn_fn st_attn_q8(void);
attn_part_fn st_attn_part_q8(void);
int st_type_is_float(int32_t type);
size_t st_row_bytes(int32_t type, int64_t n);

/* Activation quantisation; xs8/xs (the derived views above) are filled when not NULL.
 * st_quantize_act_row is the scalar definition; st_quant_act() gives the current variant's
 * version (AVX2 where it runs), which produces the same bytes and floats. */
void st_quantize_act_row(const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums, float *xs8, float *xs);
/* The per-256 view (act_row.qk): per 256 values d = amax / 127 and q = round(x / d) (half away from
 * zero, as above), bsums the sums of each 16 q. st_quant_act_k() is the variant's version (same
 * bytes and floats). n % 256 == 0. */
void st_quantize_act_k_row(const float *x, int64_t n, int8_t *qs, float *d, int16_t *bsums);
typedef void (*quant_act_k_fn)(const float *x, int64_t n, int8_t *qs, float *d, int16_t *bsums);
quant_act_k_fn st_quant_act_k_avx2(void);
quant_act_k_fn st_quant_act_k(void);
typedef void (*quant_act_fn)(const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums, float *xs8, float *xs);
quant_act_fn st_quant_act_avx2(void);
quant_act_fn st_quant_act(void);

/* h[i] = silu(g[i]) * u[i], the expert FFN's gate. st_silu_mul_ref is the definition (libm
 * expf); st_silu_mul() gives the variant's version (AVX2: a vectorised exp within ~2 ulp,
 * each element independent of its position, so batch invariance holds per variant). */
typedef void (*silu_mul_fn)(const float *g, const float *u, float *h, int64_t n);
void st_silu_mul_ref(const float *g, const float *u, float *h, int64_t n);
silu_mul_fn st_silu_mul_avx2(void);
silu_mul_fn st_silu_mul(void);

/* Helpers for the k-quant 6-bit scale packing. */
static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* ---- thread pool ---- */
typedef void (*st_task_fn)(void *ctx, int64_t item, int thread);
/* Runs fn(ctx, i, thread) for i in [0, n_items) across the pool; items are handed
 * out one at a time from an atomic counter so a slow item never stalls the rest. */
void st_pool_run(st_pool *pool, st_task_fn fn, void *ctx, int64_t n_items);
/* Cumulative thread time of the pool's parallel regions (seconds): *busy = time workers
 * spent draining items, *total = region wall time x n_threads. Read before and after a
 * step; the difference gives the step's idle share. */
void st_pool_times(const st_pool *pool, double *busy, double *total);

/* ======================================================================= the CPU step
 * Shared by model.c (descriptor validation, scratch), kv.c (paged KV cache), linear.c
 * (norms, activation quantisation, linear layers), moe.c (router and experts) and
 * forward.c (the step). A GPU backend keeps its own state and reuses only strata.h
 * and the validation in model.c. */

#define CHECK(expr)                   \
    do {                              \
        const st_status rc_ = (expr); \
        if (rc_ != ST_OK) return rc_; \
    } while (0)

/* Bounds on hyper-parameters: far above any real model, low enough that every size
 * derived from them fits in 64 bits and nothing is allocated from an absurd value. */
#define ST_MAX_LAYERS 4096
#define ST_MAX_HEADS 1024
#define ST_MAX_HEAD_DIM 1024
#define ST_MAX_VOCAB (1 << 24)
#define ST_MAX_EXPERTS 4096
#define ST_MAX_EXPERTS_USED 64
#define ST_MAX_BLOCK_SIZE 4096
#define ST_MAX_DIM ((int64_t)1 << 40) /* any single tensor extent */

/* ---- paged KV cache (kv.c) ---- */
/* The cache's heads are the model's attention heads as cached (st_model.c_*): n_head_kv heads of
 * head_dim for K and V, or MLA's one latent row (K: kv_lora_rank + rope_dim, V: kv_lora_rank). */
struct st_kv {
    int32_t n_blocks, block_size, n_layer; /* n_blocks = n_hot + n_cold: the logical block ids */
    int32_t n_kv, head_dim, head_dim_v; /* cached heads, K and V dimensions per head */
    int32_t k_dim, v_dim;               /* n_kv * head_dim, n_kv * head_dim_v */
    /* Two tiers, two allocations: physical block p < n_hot lives in the hot pool (k, v), p >= n_hot in
     * the cold pool (k_cold, v_cold) at p - n_hot. Untiered: n_cold = 0, map NULL (logical = physical). */
    int32_t n_hot, n_cold;
    f16_t *k; /* hot: [n_layer][n_hot][n_kv][head_dim][block_size]: slots contiguous */
    f16_t *v; /* hot: [n_layer][n_hot][block_size][v_dim] */
    f16_t *k_cold, *v_cold; /* cold: the same with n_cold blocks */
    int32_t *map;           /* [n_blocks]: logical block -> physical block (a permutation), or NULL */
    int32_t *bt_phys;       /* a step's block tables translated through map (st_forward), cap_bt entries */
    size_t cap_bt;
    /* ST_KV_Q8_0 (untiered only): k/v are NULL and each element is an int8 of k8/v8 at the F16 layout's
     * index, times the F16 scale of its group of 32: K's groups run along one token's head dimensions
     * (ks [n_layer][n_blocks][n_kv][head_dim/32][block_size]), V's along its row (vs [..][block_size][v_dim/32]). */
    int32_t type;
    int8_t *k8, *v8;
    f16_t *ks, *vs;
};

/* Pointers to (layer, physical block)'s K block start (K is slot-minor) and to its V row `slot`. */
static inline f16_t *kv_k_block(const st_kv *kv, int layer, int32_t block) {
    const int hot = block < kv->n_hot;
    const size_t n = (size_t)(hot ? kv->n_hot : kv->n_cold), i = (size_t)(hot ? block : block - kv->n_hot);
    return (hot ? kv->k : kv->k_cold) + ((size_t)layer * n + i) * (size_t)kv->block_size * (size_t)kv->k_dim;
}
static inline f16_t *kv_v_row(const st_kv *kv, int layer, int32_t block, int32_t slot) {
    const int hot = block < kv->n_hot;
    const size_t n = (size_t)(hot ? kv->n_hot : kv->n_cold), i = (size_t)(hot ? block : block - kv->n_hot);
    return (hot ? kv->v : kv->v_cold) + (((size_t)layer * n + i) * (size_t)kv->block_size + (size_t)slot) * (size_t)kv->v_dim;
}

/* Write one token's k[k_dim] and v[v_dim] (float) into slot `slot` of `block`. */
void st_kv_store(st_kv *kv, int layer, int32_t block, int32_t slot, const float *k, const float *v);

/* ---- the model and its scratch buffers (model.c) ---- */

/* Activations entering a linear layer: float rows and, for quantised weights, the
 * same rows as 8-bit blocks. Row stride = K. */
typedef struct {
    const float *x;
    const int8_t *q;
    const float *d;
    const int32_t *s;
    const float *xs8, *xs; /* derived views for the SIMD kernels (see above) */
    const int8_t *qk;      /* the per-256 view (act_row.qk; NULL where K % 256) */
    const float *dk;
    const int16_t *bk;
    int64_t K;
} acts;

/* A decode token whose attention is split (forward.c): its chunks are work items item0.. of
 * a layer's attention run, (KV head, chunk) in that order. */
typedef struct {
    int32_t t, chunk, n_chunks; /* batch index, keys per chunk, chunks */
    int64_t item0;
    size_t part0; /* its partials: [n_kv][n_chunks][group][head_dim_v + 2] floats from parts + part0 */
} split_tok;

typedef struct {
    size_t cap_tokens, cap_pairs, cap_ctx, cap_threads;
    float *x, *xn;             /* [T, E] residual stream, normalised copy */
    float *q, *k, *v, *att;    /* [T, q_dim], [T, kv_dim] x2, [T, q_dim] */
    float *tmp;                /* [T, max(E, q_dim)] */
    float *router;             /* [T, n_expert] */
    float *topk_w;             /* [T, k] */
    float *scores;             /* [n_threads, cap_ctx] attention scratch */
    float *gate_shexp;         /* [T] */
    int8_t *aq;                /* layer input, quantised: [T, max_k] */
    float *ad, *ad4, *axs;     /* ad4: the xs8 view [T, max_k/4] */
    int32_t *as, *topk_id;     /* topk_id: [T, k] */
    float *h, *pair_out;       /* [P, ff] hidden, [P, E] expert output per pair */
    int8_t *akq, *hkq;         /* the per-256 views of aq and hq (act_row.qk) */
    float *akd, *hkd;
    int16_t *akb, *hkb;
    int8_t *hq;                /* hidden, quantised: [P, ff] */
    float *hd, *hd4, *hxs;
    int32_t *hs, *pair_tok;    /* pair_tok: [P] token of each pair */
    int32_t *pairs_by_expert;  /* [P] */
    int32_t *expert_start;     /* [n_expert + 1] */
    int32_t *tiles;            /* [T, 2] attention tiles */
    int32_t n_tiles;           /* the step's tiles (plan_attention) */
    int32_t *rtiles;           /* [T, 2] the tiles left to the per-head kernels where decode splits */
    split_tok *split;          /* [T] decode tokens whose attention is split */
    float *parts;              /* [cap_parts] the split tokens' partials */
    _Atomic int32_t *left;     /* [cap_left] chunks not yet done per (split token, KV head) */
    size_t cap_parts, cap_left;
    float *logits;             /* [cap_logits] a step's logits when only its greedy picks are wanted */
    size_t cap_logits;
    /* multi-head latent attention (NULL without): */
    float *mqa;                /* [T, q_lora_rank] the low-rank q */
    float *mq;                 /* [T, q_dim] each head's query (nope, then rope) */
    float *mkv;                /* [T, kv_lora_rank + rope_dim] the latent and the rotary key: the cached row */
    float *mg;                 /* [T * n_head, nope] the queries' non-rotary parts, row t * n_head + h */
    float *mo;                 /* [T, n_head * head_dim_v] the heads' outputs expanded from the latent */
} scratch;

struct st_model {
    st_model_desc d;
    st_layer *layers;
    st_layer *nextn_layers; /* [d.n_nextn] copies of the NextN blocks and heads (kept, not run) */
    st_nextn *nextn;
    int32_t q_dim, kv_dim, n_ff_exp, n_ff, n_ff_shexp, max_k; /* all <= ST_MAX_ROW after validation */
    /* Attention as cached and computed (attn_task, st_kv): c_n_kv heads with c_hd_k / c_hd_v
     * dimensions; queries [T, n_head * c_hd_k] (s->q), outputs [T, n_head * c_hd_v] (s->att); wo
     * reads o_in = n_head * (head_dim_v or head_dim). MLA: one latent head (kv_lora_rank + rope_dim,
     * kv_lora_rank); else the model's own heads. */
    int32_t c_n_kv, c_hd_k, c_hd_v, o_in;
    int64_t c_q_dim, c_o_dim;
    st_tensor *mla_kb; /* [n_layer] each layer's absorption matrix: wk_b, or wkv_b's key rows transposed (F32, below) */
    float *mla_kb_buf; /* the transposed copies for layers that have wkv_b */
    float *inv_freq; /* [rope_dim / 2] each pair's angle per position, rope scaling included */
    float rope_mscale; /* the factor both rotated values take (YaRN's magnitude scaling; 1 without) */
    scratch s;
    int repack_done;      /* st_model_repack ran (whatever it decided) */
    void *repack;         /* anonymous mapping holding the repacked tensors, or NULL */
    size_t repack_bytes;
    /* the last step's greedy picks (st_batch.token_src reads them): n_picks 0 = none */
    int32_t *picks, *tok_buf; /* tok_buf: a step's ids resolved through token_src */
    int32_t n_picks, cap_picks;
    int64_t cap_tok_buf;
};

/* Layer il runs the routed experts (not the dense FFN): an MoE model past its dense lead. */
static inline int st_layer_is_moe(const st_model *m, int il) { return m->d.n_expert > 0 && il >= m->d.n_dense_lead; }

/* Repack the Q4_1 and Q8_0 weight tensors whose row count is a multiple of 8 into
 * ST_TYPE_Q4_1_R8 / ST_TYPE_Q8_0_R8 (once; STRATA_REPACK=0 disables it). Failure keeps the
 * file's tensors. */
void st_model_repack(st_model *m);
/* The repacked form of a plain type (-1: none), the plain type of a repacked one (any other type:
 * itself), and the repack of plain rows of `type` (st_repack_q4_1 / _q8_0). */
int32_t st_r8_of(int32_t type);
int32_t st_r8_plain(int32_t type);
st_status st_repack_rows(int32_t type, const void *src, void *dst, int64_t rows, int64_t n);

/* Grow the scratch buffers to hold T tokens (and their expert pairs), n_threads
 * attention rows of ctx floats. */
st_status st_scratch_ensure(st_model *m, size_t T, size_t n_threads, size_t ctx);
/* Grow the split attention's partials to n_parts floats and its counters to n_left. */
st_status st_scratch_split(scratch *s, size_t n_parts, size_t n_left);

/* ---- step primitives (linear.c) ---- */
void st_rmsnorm_row(const float *x, const float *w, float *y, int64_t n, float eps);
static inline float silu(float x) { return x / (1.0f + expf(-x)); }
/* exp(x) rounded once to float (through double): libm's expf is within 0.502 ulp, not correctly rounded, and
 * differs from the correctly rounded value for about one argument in a thousand. The routers use this one, as the
 * GPU's exp_cr does, so that both devices give the same router weights bit for bit. */
static inline float st_expf_cr(float x) { return (float)exp((double)x); }

/* Where quantised activation rows go: the layer-input buffers or the expert hidden-state
 * buffers. */
typedef struct {
    int8_t *q;
    float *d, *xs8, *xs;
    int32_t *s;
    int8_t *qk;
    float *dk;
    int16_t *bk;
} act_buf;

static inline act_buf layer_buf(scratch *s) {
    return (act_buf){s->aq, s->ad, s->ad4, s->axs, s->as, s->akq, s->akd, s->akb};
}
static inline act_buf hidden_buf(scratch *s) {
    return (act_buf){s->hq, s->hd, s->hd4, s->hxs, s->hs, s->hkq, s->hkd, s->hkb};
}

/* Float rows x[T, K] -> activations; quantised into `o` when the weights need it. */
acts st_make_acts(st_pool *pool, const float *x, int64_t T, int64_t K, int need_q, act_buf o);
/* st_make_acts's result without the quantisation, which st_quant_act_row then does a row at a time (row t of x into
 * row t of o: the same bits as st_make_acts) */
acts st_acts_view(const float *x, int64_t K, int need_q, act_buf o);
void st_quant_act_row(const float *x, int64_t K, act_buf o, int64_t t);

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
        tl->rows[i] = (act_row){a->q + t * K, a->d + t * (K / QK), a->s + t * (K / 16), a->xs8 + t * (K / 4),
                                a->xs + t * (K / QK), a->qk ? a->qk + t * K : NULL,
                                a->qk ? a->dk + t * (K / QK_K) : NULL, a->qk ? a->bk + t * (K / 16) : NULL};
    }
}

/* Dot nr <= ST_ROW_BLOCK consecutive weight rows (stride row_bytes) with every row of the
 * tile: res[t * ST_ROW_BLOCK + r]. A quantised row block is unpacked once for all tokens. */
#define ST_ROW_BLOCK 8
static inline void dot_tile(int32_t type, dot_q_fn fq, dot_f_fn ff, const uint8_t *wrow, size_t row_bytes, int nr,
                            const acts *a, const act_tile *tl, float *res) {
    if (st_type_is_float(type)) {
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < tl->nt; i++)
                ff(wrow + (size_t)r * row_bytes, a->x + (tl->idx ? tl->idx[i] : tl->base + i) * a->K, a->K,
                   &res[i * ST_ROW_BLOCK + r]);
    } else {
        fq(wrow, row_bytes, nr, a->K, tl->nt, tl->rows, res, ST_ROW_BLOCK);
    }
}

#define TOKEN_TILE ST_MAX_NT /* activation rows per unpacked weight row; they stay hot in cache */

/* The L2 size of one core (sysconf; 512 KiB when unknown), and the row count of a work tile:
 * `want` capped so the tile's weights (bytes_per_row each) fit in half of it, rounded to
 * whole ST_ROW_BLOCKs, at most `rows`. */
size_t st_l2_bytes(void);
int64_t st_tile_rows(int64_t rows, int64_t want, size_t bytes_per_row);

/* out[t, r] (stride ldo) = W[r, :] . in[rows[t], :] for r in [0, W->ne[1]), t in [0, T). */
void st_linear(st_pool *pool, const st_tensor *W, const acts *in, const int32_t *rows, int64_t T, float *out,
               int64_t ldo);
/* y[T, n] += bias[n] when the bias exists. */
void st_add_bias(float *y, const st_tensor *b, int64_t T, int64_t n);

/* ---- feed-forward blocks (moe.c); input: s->xn [T, E] (normalised) ---- */
/* One SwiGLU FFN over every token (a dense FFN or a shared expert): s->pair_out[T, E]. */
st_status st_ffn_all_tokens(st_model *m, st_pool *pool, const st_tensor *gate, const st_tensor *up,
                            const st_tensor *down, int64_t T);
/* Checks a descriptor's routing fields (gating, scale, expert groups) against its experts. */
st_status st_check_routing(const st_model_desc *d);
/* One token's routing (the rule in st_model_desc): r[n_expert] the router logits on entry,
 * the probabilities on return; c[n_expert] and gs[n_expert_group] scratch; ids[k] the chosen
 * experts, w[k] their weights before normalisation and scaling. bias: exp_probs_b or NULL. */
void st_route_token(const st_model_desc *d, const float *bias, float *r, float *c, float *gs, int32_t *ids, float *w);
/* The routed-expert block of layer il, added into s->x. */
st_status st_moe_block(st_model *m, st_pool *pool, const st_batch *b, int il, int64_t T, st_step_stats *stats);

/* ---- attention (forward.c, mla.c) ---- */
/* Rotate rope_dim dimensions starting at `off` of each of n_heads heads (stride hd) of one row,
 * at position pos (ST_ROPE_NORM: adjacent pairs; NEOX: halves); the rotated values scale by mscale. */
void st_rope_row(float *x, int n_heads, int hd, int off, int rope_dim, int rope_type, const float *inv_freq,
                 float mscale, int32_t pos);
/* Attention of the step's tiles (s->tiles, s->n_tiles) over layer il's cache: s->q -> s->att (see
 * st_model.c_*); lone tokens with many keys split across the pool (plan_layer). */
void st_attention_tiles(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, int il);
/* deepseek2's attention block of layer il (RMSNorm to residual), into s->x. */
void st_mla_block(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, int il, int64_t T);
/* At model creation: the absorption matrices of the layers that have wkv_b (transposed F32 copies). */
st_status st_mla_prepare(st_model *m);

#endif
