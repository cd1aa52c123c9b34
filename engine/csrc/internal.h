/* Internal declarations shared by the C sources (not part of the cffi API). */
#ifndef STRATA_INTERNAL_H
#define STRATA_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "strata.h"

st_status st_fail(st_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define QK 32    /* block size of the legacy quants and of the activation blocks */
#define QK_K 256 /* super-block size of the k-quants */

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
 * kernels also read two derived views, made once per activation row:
 *   dx4[n/4] = d of the block each group of 4 elements belongs to (lane-aligned scales),
 *   xs[n/16] = d * s (the float weight of each 16-sum in the offset/minimum correction).
 * dot_q: one weight row (n elements) against nt <= ST_MAX_NT tokens; the row is unpacked
 *        once for all of them. A token's result never depends on nt or on the other
 *        tokens (batch invariance).
 * dot_f: one weight row against float activations (F32/F16/BF16 weights). */
#define ST_MAX_NT 64
#define ST_MAX_ROW 65536 /* longest weight row the kernels accept (stack buffers) */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    const float *dx4;
    const float *xs;
} act_row;
typedef void (*dot_q_fn)(const void *w, int64_t n, int nt, const act_row *a, float *out);
typedef void (*dot_f_fn)(const void *w, const float *x, int64_t n, float *out);

dot_q_fn st_dot_q_ref(int32_t type);
dot_f_fn st_dot_f_ref(int32_t type);
dot_q_fn st_dot_q_avx2(int32_t type);
dot_f_fn st_dot_f_avx2(int32_t type);
dot_q_fn st_dot_q_avx512(int32_t type);
dot_f_fn st_dot_f_avx512(int32_t type);

/* Attention helpers: F16 row -> float, and y += a * x. */
typedef void (*cvt_f16_fn)(const f16_t *src, float *dst, int64_t n);
typedef void (*axpy_fn)(float *y, const float *x, float a, int64_t n);
cvt_f16_fn st_cvt_f16_ref(void);
cvt_f16_fn st_cvt_f16_avx2(void);
cvt_f16_fn st_cvt_f16(void);
axpy_fn st_axpy_ref(void);
axpy_fn st_axpy_avx2(void);
axpy_fn st_axpy(void);

/* Attention of one head over the paged KV cache (attention.c). */
typedef struct {
    const f16_t *k, *v;  /* this layer's K ([block][n_kv][hd][bs]) and V ([block][bs][kv_dim]) */
    const int32_t *bt;   /* the sequence's block table */
    int32_t bs, hd, n_kv, kv_dim, kvh;
} kv_view;
/* nq consecutive queries (rows of q, pre-scaled by 1/sqrt(hd)) at positions p0..p0+nq-1;
 * query i sees keys 0..p0+i. scratch: st_attn_scratch_floats(hd, p0 + nq) floats. */
typedef void (*attn_fn)(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                        int64_t o_stride, float *scratch);
#define ST_ATTN_TILE 16
attn_fn st_attn_ref(void);
attn_fn st_attn_avx2(void);
attn_fn st_attn_avx512(void);
attn_fn st_attn(void);
attn_fn st_attn_variant(int32_t variant);
st_status st_check_variant(int32_t variant);
size_t st_attn_scratch_floats(int hd, int32_t max_keys);

/* The kernels for the current variant (falls back to ref per type). */
dot_q_fn st_dot_q(int32_t type);
dot_f_fn st_dot_f(int32_t type);
int st_type_is_float(int32_t type);
size_t st_row_bytes(int32_t type, int64_t n);

/* Activation quantisation; dx4/xs (the derived views above) are filled when not NULL. */
void st_quantize_act_row(const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums, float *dx4, float *xs);

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

#endif
