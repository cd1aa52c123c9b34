/* Quant types: type table, dequantisation, activation quantisation and the
 * generic reference dot kernels every SIMD variant is checked against.
 *
 * Dequantisation reproduces gguf-py's numpy reference bit for bit, which is why the
 * operation order below (e.g. (d*q)+m, and d*sc computed first for k-quants)
 * matters and why the library is built with -ffp-contract=off. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"
#include "quants_iq.h"
#include "quants_lowbit.h"

/* ---- errors ---- */
static _Thread_local char g_err[512];

const char *st_last_error(void) { return g_err; }

st_status st_fail(st_status code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return code;
}

/* ---- type table ---- */
int32_t st_type_block_elems(int32_t type) {
    switch (type) {
    case ST_TYPE_F32: case ST_TYPE_F16: case ST_TYPE_BF16: return 1;
    case ST_TYPE_Q4_0: case ST_TYPE_Q4_1: case ST_TYPE_Q5_0: case ST_TYPE_Q5_1: case ST_TYPE_Q8_0: return QK;
    case ST_TYPE_Q4_1_R8: case ST_TYPE_Q8_0_R8: return QK;
    case ST_TYPE_Q4_K: case ST_TYPE_Q5_K: case ST_TYPE_Q6_K: return QK_K;
    default: return st_type_is_iq(type) ? QK_K : st_lowbit_block_elems(type);
    }
}

int32_t st_type_block_bytes(int32_t type) {
    switch (type) {
    case ST_TYPE_F32: return 4;
    case ST_TYPE_F16: case ST_TYPE_BF16: return 2;
    case ST_TYPE_Q4_0: return sizeof(blk_q4_0);
    case ST_TYPE_Q4_1: case ST_TYPE_Q4_1_R8: return sizeof(blk_q4_1);
    case ST_TYPE_Q5_0: return sizeof(blk_q5_0);
    case ST_TYPE_Q5_1: return sizeof(blk_q5_1);
    case ST_TYPE_Q8_0: case ST_TYPE_Q8_0_R8: return sizeof(blk_q8_0);
    case ST_TYPE_Q4_K: return sizeof(blk_q4_k);
    case ST_TYPE_Q5_K: return sizeof(blk_q5_k);
    case ST_TYPE_Q6_K: return sizeof(blk_q6_k);
    default: return st_type_is_iq(type) ? st_iq_block_bytes(type) : st_lowbit_block_bytes(type);
    }
}

/* The file types; the repacked ST_TYPE_*_R8 exist only after repacking. */
int32_t st_type_supported(int32_t type) {
    return type != ST_TYPE_Q4_1_R8 && type != ST_TYPE_Q8_0_R8 && st_type_block_elems(type) > 0;
}

int st_type_is_float(int32_t type) {
    return type == ST_TYPE_F32 || type == ST_TYPE_F16 || type == ST_TYPE_BF16;
}

size_t st_row_bytes(int32_t type, int64_t n) {
    return (size_t)(n / st_type_block_elems(type)) * (size_t)st_type_block_bytes(type);
}

/* ---- dequantisation (reference; the only implementation) ---- */

/* Code l (0..31) of a 32-block of 4-bit codes (Q4_0, Q4_1): the low nibble of qs[l], from 16 on the high
 * nibble of qs[l - 16]. */
static inline int q4_code(const uint8_t *qs, int l) { return l < 16 ? qs[l] & 0xF : qs[l - 16] >> 4; }

/* Code l of a Q5_0 / Q5_1 block: q4_code with bit l of qh as the fifth bit. */
static inline int q5_code(const uint8_t *qs, uint32_t qh, int l) {
    return q4_code(qs, l) | (int)((qh >> l) & 1) << 4;
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void deq_q4_0(const blk_q4_0 *b, float *y) {
    const float d = f16_to_f32(b->d);
    for (int l = 0; l < QK; l++) y[l] = d * (float)(q4_code(b->qs, l) - 8);
}

static void deq_q4_1(const blk_q4_1 *b, float *y) {
    const float d = f16_to_f32(b->d), m = f16_to_f32(b->m);
    for (int l = 0; l < QK; l++) y[l] = d * (float)q4_code(b->qs, l) + m;
}

static void deq_q5_0(const blk_q5_0 *b, float *y) {
    const float d = f16_to_f32(b->d);
    const uint32_t qh = load_u32(b->qh);
    for (int l = 0; l < QK; l++) y[l] = d * (float)(q5_code(b->qs, qh, l) - 16);
}

static void deq_q5_1(const blk_q5_1 *b, float *y) {
    const float d = f16_to_f32(b->d), m = f16_to_f32(b->m);
    const uint32_t qh = load_u32(b->qh);
    for (int l = 0; l < QK; l++) y[l] = d * (float)q5_code(b->qs, qh, l) + m;
}

static void deq_q8_0(const blk_q8_0 *b, float *y) {
    const float d = f16_to_f32(b->d);
    for (int l = 0; l < QK; l++) y[l] = (float)b->qs[l] * d;
}

/* Q4_K / Q5_K super-blocks: 8 sub-blocks j of 32 codes, sub-block j in nibble j % 2 of qs[32 * (j / 2) ..]
 * (Q5_K: bit j of qh[l] is code l's fifth bit; qh NULL for Q4_K), each with the scale d * sc_j and the minimum
 * dmin * m_j (k45_scale: the reference's products, the dequantisation's and the dot kernels' alike). */
static inline int k45_code(const uint8_t *qs, const uint8_t *qh, int j, int l) {
    const int q = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF;
    return qh ? q | (((qh[l] >> j) & 1) << 4) : q;
}

static inline void k45_scale(const uint8_t *scales, int j, float d, float dmin, float *dj, float *mj) {
    uint8_t sc, m;
    get_scale_min_k4(j, scales, &sc, &m);
    *dj = d * (float)sc, *mj = dmin * (float)m;
}

static void deq_k45(f16_t d16, f16_t dmin16, const uint8_t *scales, const uint8_t *qs, const uint8_t *qh, float *y) {
    const float d = f16_to_f32(d16), dmin = f16_to_f32(dmin16);
    for (int j = 0; j < 8; j++) {
        float dj, mj;
        k45_scale(scales, j, d, dmin, &dj, &mj);
        for (int l = 0; l < 32; l++) y[32 * j + l] = dj * (float)k45_code(qs, qh, j, l) - mj;
    }
}

static void deq_q4_k(const blk_q4_k *b, float *y) { deq_k45(b->d, b->dmin, b->scales, b->qs, NULL, y); }
static void deq_q5_k(const blk_q5_k *b, float *y) { deq_k45(b->d, b->dmin, b->scales, b->qs, b->qh, y); }

/* Q6_K code e (g16_fn): in its 128-element half, low 4 bits from ql, high 2 bits from qh; and group g's scale. */
static inline int q6k_value(const void *blk, int e) {
    const blk_q6_k *b = blk;
    const int h = e / 128, r = e % 128, g = r / 32, l = r % 32;
    const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
    const int lo = (g & 1) ? ql[32 + l] : ql[l];
    const int low4 = (g < 2) ? (lo & 0xF) : (lo >> 4);
    const int high2 = (qh[l] >> (2 * g)) & 3;
    return (low4 | (high2 << 4)) - 32;
}

static inline int q6k_scale(const void *blk, int g) { return ((const blk_q6_k *)blk)->scales[g]; }

static void deq_q6_k(const blk_q6_k *b, float *y) { g16_dequant(b, q6k_value, q6k_scale, f16_to_f32(b->d), y); }

st_status st_dequantize(int32_t type, const void *src, float *dst, int64_t n) {
    const int32_t be = st_type_block_elems(type);
    if (!be) return st_fail(ST_EUNSUPPORTED, "dequantize: unsupported quant type %d", type);
    if (!src || !dst || n < 0 || n % be)
        return st_fail(ST_EINVAL, "dequantize: n=%lld is not a multiple of the block size %d", (long long)n, be);
    const int64_t nb = n / be;
    const uint8_t *p = src;
    const size_t bb = (size_t)st_type_block_bytes(type);
    for (int64_t i = 0; i < nb; i++, p += bb) {
        float *y = dst + i * be;
        switch (type) {
        case ST_TYPE_F32: memcpy(y, p, 4); break;
        case ST_TYPE_F16: { f16_t h; memcpy(&h, p, 2); *y = f16_to_f32(h); } break;
        case ST_TYPE_BF16: { uint16_t h; memcpy(&h, p, 2); *y = bf16_to_f32(h); } break;
        case ST_TYPE_Q4_0: deq_q4_0((const blk_q4_0 *)p, y); break;
        case ST_TYPE_Q4_1: deq_q4_1((const blk_q4_1 *)p, y); break;
        case ST_TYPE_Q5_0: deq_q5_0((const blk_q5_0 *)p, y); break;
        case ST_TYPE_Q5_1: deq_q5_1((const blk_q5_1 *)p, y); break;
        case ST_TYPE_Q8_0: deq_q8_0((const blk_q8_0 *)p, y); break;
        case ST_TYPE_Q4_K: deq_q4_k((const blk_q4_k *)p, y); break;
        case ST_TYPE_Q5_K: deq_q5_k((const blk_q5_k *)p, y); break;
        case ST_TYPE_Q6_K: deq_q6_k((const blk_q6_k *)p, y); break;
        default:
            if (st_type_is_iq(type)) st_iq_dequant_block(type, p, y);
            else st_lowbit_dequantize_block(type, p, y);
            break;
        }
    }
    return ST_OK;
}

/* ---- activation quantisation: int8 per 32-block, float scale, int sums per 16 ---- */

/* The int8 scale of a block of n activations, max|x| / 127, stored to *d; returns its inverse (0 for an
 * all-zero block), which the codes round(x * inverse) use. */
static inline float act_scale(const float *x, int n, float *d) {
    float amax = 0.0f;
    for (int l = 0; l < n; l++) amax = fmaxf(amax, fabsf(x[l]));
    const float db = amax / 127.0f;
    *d = db;
    return db != 0.0f ? 1.0f / db : 0.0f;
}

void st_quantize_act_row(const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums, float *xs8, float *xs) {
    for (int64_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        const float id = act_scale(xb, QK, &d[b]), db = d[b];
        int32_t s0 = 0, s1 = 0;
        for (int l = 0; l < QK; l++) {
            const int8_t q = (int8_t)roundf(xb[l] * id);
            qs[b * QK + l] = q;
            if (l < 16) s0 += q; else s1 += q;
        }
        sums[2 * b] = s0;
        sums[2 * b + 1] = s1;
        const float x0 = db * (float)s0, x1 = db * (float)s1;
        if (xs8)
            for (int l = 0; l < 4; l++) xs8[b * 8 + l] = x0, xs8[b * 8 + 4 + l] = x1;
        if (xs) xs[b] = db * (float)(s0 + s1);
    }
}

void st_quantize_act_k_row(const float *x, int64_t n, int8_t *qs, float *d, int16_t *bsums) {
    for (int64_t b = 0; b < n / QK_K; b++) {
        const float *xb = x + b * QK_K;
        const float id = act_scale(xb, QK_K, &d[b]);
        for (int g = 0; g < QK_K / 16; g++) {
            int32_t sum = 0;
            for (int l = 0; l < 16; l++) {
                const int8_t q = (int8_t)roundf(xb[16 * g + l] * id);
                qs[b * QK_K + 16 * g + l] = q;
                sum += q;
            }
            bsums[b * (QK_K / 16) + g] = (int16_t)sum;
        }
    }
}

st_status st_quantize_act(const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums) {
    if (!x || !qs || !d || !sums || n <= 0 || n % QK)
        return st_fail(ST_EINVAL, "quantize_act: n=%lld must be a positive multiple of %d", (long long)n, QK);
    st_quantize_act_row(x, n, qs, d, sums, NULL, NULL);
    return ST_OK;
}

/* ---- reference dot kernels ----
 * Every quantised type is written as unsigned q in [0, 2^bits) with an integer
 * offset OFF, so w = S * (q - OFF) (+ M for types with a minimum). With 8-bit
 * activations a = dx * qa:  dot = sum_sub dx * (S * (sum q*qa - OFF * sum qa) + M * sum qa).
 * The SIMD variants compute exactly these integer sums, only faster. */
static inline int32_t sum32(const int32_t *s16, int64_t blk) { return s16[2 * blk] + s16[2 * blk + 1]; }

/* The integer sums of one 32-block of Q4_0 / Q4_1 codes and of Q5_0 / Q5_1 codes against a[0..31]. */
static inline int32_t q4_sum(const uint8_t *qs, const int8_t *a) {
    int32_t isum = 0;
    for (int l = 0; l < QK; l++) isum += q4_code(qs, l) * a[l];
    return isum;
}

static inline int32_t q5_sum(const uint8_t *qs, const uint8_t *qh, const int8_t *a) {
    const uint32_t h = load_u32(qh);
    int32_t isum = 0;
    for (int l = 0; l < QK; l++) isum += q5_code(qs, h, l) * a[l];
    return isum;
}

static void dot_q4_0_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_q4_0 *b = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK; i++)
        acc += f16_to_f32(b[i].d) * d[i] * (float)(q4_sum(b[i].qs, a + i * QK) - 8 * sum32(s, i));
    *out = acc;
}

static void dot_q4_1_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_q4_1 *b = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK; i++)
        acc += d[i] * (f16_to_f32(b[i].d) * (float)q4_sum(b[i].qs, a + i * QK) +
                       f16_to_f32(b[i].m) * (float)sum32(s, i));
    *out = acc;
}

static void dot_q5_0_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_q5_0 *b = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK; i++)
        acc += f16_to_f32(b[i].d) * d[i] * (float)(q5_sum(b[i].qs, b[i].qh, a + i * QK) - 16 * sum32(s, i));
    *out = acc;
}

static void dot_q5_1_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_q5_1 *b = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK; i++)
        acc += d[i] * (f16_to_f32(b[i].d) * (float)q5_sum(b[i].qs, b[i].qh, a + i * QK) +
                       f16_to_f32(b[i].m) * (float)sum32(s, i));
    *out = acc;
}

static void dot_q8_0_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_q8_0 *b = w;
    (void)s;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK; i++) {
        int32_t isum = 0;
        for (int l = 0; l < QK; l++) isum += b[i].qs[l] * a[i * QK + l];
        acc += f16_to_f32(b[i].d) * d[i] * (float)isum;
    }
    *out = acc;
}

/* One Q4_K / Q5_K super-block (k45_code's layout) against activation blocks ab0 .. ab0 + 7 (sub-block j against
 * block ab0 + j): acc plus its 8 terms, added in sub-block order. */
static inline float dot_k45(float acc, f16_t d16, f16_t dmin16, const uint8_t *scales, const uint8_t *qs,
                            const uint8_t *qh, const int8_t *a, const float *d, const int32_t *s, int64_t ab0) {
    const float dd = f16_to_f32(d16), dm = f16_to_f32(dmin16);
    for (int j = 0; j < 8; j++) {
        float dj, mj;
        k45_scale(scales, j, dd, dm, &dj, &mj);
        const int64_t ab = ab0 + j;
        int32_t isum = 0;
        for (int l = 0; l < 32; l++) isum += k45_code(qs, qh, j, l) * a[ab * QK + l];
        acc += d[ab] * (dj * (float)isum - mj * (float)sum32(s, ab));
    }
    return acc;
}

static void dot_q4_k_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_q4_k *b = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++)
        acc = dot_k45(acc, b[i].d, b[i].dmin, b[i].scales, b[i].qs, NULL, a, d, s, 8 * i);
    *out = acc;
}

static void dot_q5_k_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_q5_k *b = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++)
        acc = dot_k45(acc, b[i].d, b[i].dmin, b[i].scales, b[i].qs, b[i].qh, a, d, s, 8 * i);
    *out = acc;
}

/* Q6_K on the per-256 view (act_row.qk): the exact integer sums of a whole super-block, then one
 * float step per 256 weights:
 *   Q6_K:  dk * (d * sum_g sc_g * sum((q - 32) a))
 * The SIMD variants compute the same integers and the same float operations in this order. */
static void dot_q6_k_k8(const void *w, const int8_t *a, const float *dk, const int16_t *bk, int64_t n, float *out) {
    const blk_q6_k *b = w;
    (void)bk;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++)
        acc += dk[i] * (f16_to_f32(b[i].d) * (float)g16_sum(&b[i], q6k_value, q6k_scale, a + i * QK_K));
    *out = acc;
}

DEF_REF_MULTI(q4_0)
DEF_REF_MULTI(q4_1)
DEF_REF_MULTI(q5_0)
DEF_REF_MULTI(q5_1)
DEF_REF_MULTI(q8_0)
DEF_REF_MULTI(q4_k)
DEF_REF_MULTI(q5_k)
DEF_REF_MULTI_K8(q6_k)

static void dot_f32_ref(const void *w, const float *x, int64_t n, float *out) {
    const float *v = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += v[i] * x[i];
    *out = acc;
}

static void dot_f16_ref(const void *w, const float *x, int64_t n, float *out) {
    const f16_t *v = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += f16_to_f32(v[i]) * x[i];
    *out = acc;
}

static void dot_bf16_ref(const void *w, const float *x, int64_t n, float *out) {
    const uint16_t *v = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += bf16_to_f32(v[i]) * x[i];
    *out = acc;
}

/* One tensor's rows in groups of 8, block by block (the layout in strata.h): per 32-column block, each of the
 * block's `halves` f16 fields (d; for Q4_1 also m) of the eight rows side by side, then for each 4-byte word j
 * of the codes the eight rows' word j. */
static void repack_rows8(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t n, int type, size_t bs,
                         int halves) {
    const size_t rb = st_row_bytes(type, n);
    const int words = (int)(bs - 2 * (size_t)halves) / 4;
    for (int64_t g = 0; g < rows; g += ST_R8_ROWS) {
        const uint8_t *in = src + (size_t)g * rb;
        uint8_t *out = dst + (size_t)g * rb;
        for (int64_t b = 0; b < n / QK; b++) {
            uint8_t *o = out + (size_t)b * ST_R8_ROWS * bs;
            uint8_t *codes = o + 2 * ST_R8_ROWS * halves;
            for (int r = 0; r < ST_R8_ROWS; r++) {
                const uint8_t *blk = in + (size_t)r * rb + (size_t)b * bs;
                for (int h = 0; h < halves; h++) memcpy(o + 2 * ST_R8_ROWS * h + 2 * r, blk + 2 * h, 2);
                for (int j = 0; j < words; j++) memcpy(codes + 32 * j + 4 * r, blk + 2 * halves + 4 * j, 4);
            }
        }
    }
}

static st_status repack_checked(const char *what, const void *src, void *dst, int64_t rows, int64_t n, int type,
                                size_t bs, int halves) {
    if (!src || !dst || rows < ST_R8_ROWS || rows % ST_R8_ROWS || n < QK || n % QK || n > ST_MAX_ROW)
        return st_fail(ST_EINVAL, "%s: bad arguments (rows=%lld n=%lld)", what, (long long)rows, (long long)n);
    repack_rows8(src, dst, rows, n, type, bs, halves);
    return ST_OK;
}

st_status st_repack_q4_1(const void *src, void *dst, int64_t rows, int64_t n) {
    return repack_checked("repack_q4_1", src, dst, rows, n, ST_TYPE_Q4_1, sizeof(blk_q4_1), 2);
}

st_status st_repack_q8_0(const void *src, void *dst, int64_t rows, int64_t n) {
    return repack_checked("repack_q8_0", src, dst, rows, n, ST_TYPE_Q8_0, sizeof(blk_q8_0), 1);
}

int32_t st_r8_of(int32_t type) {
    switch (type) {
    case ST_TYPE_Q4_1: return ST_TYPE_Q4_1_R8;
    case ST_TYPE_Q8_0: return ST_TYPE_Q8_0_R8;
    default: return -1;
    }
}

int32_t st_r8_plain(int32_t type) {
    switch (type) {
    case ST_TYPE_Q4_1_R8: return ST_TYPE_Q4_1;
    case ST_TYPE_Q8_0_R8: return ST_TYPE_Q8_0;
    default: return type;
    }
}

st_status st_repack_rows(int32_t type, const void *src, void *dst, int64_t rows, int64_t n) {
    switch (type) {
    case ST_TYPE_Q4_1: return st_repack_q4_1(src, dst, rows, n);
    case ST_TYPE_Q8_0: return st_repack_q8_0(src, dst, rows, n);
    default: return st_fail(ST_EUNSUPPORTED, "repack_rows: type %d has no repacked form", type);
    }
}

/* The inverse of repack_rows8 for row r of a group (g is the group's start): its blocks in the file layout. */
static void row_from_group(const uint8_t *g, int r, int64_t n, size_t bs, int halves, uint8_t *row) {
    const int words = (int)(bs - 2 * (size_t)halves) / 4;
    for (int64_t b = 0; b < n / QK; b++) {
        const uint8_t *p = g + (size_t)b * ST_R8_ROWS * bs;
        const uint8_t *codes = p + 2 * ST_R8_ROWS * halves;
        uint8_t *blk = row + (size_t)b * bs;
        for (int h = 0; h < halves; h++) memcpy(blk + 2 * h, p + 2 * ST_R8_ROWS * h + 2 * r, 2);
        for (int j = 0; j < words; j++) memcpy(blk + 2 * halves + 4 * j, codes + 32 * j + 4 * r, 4);
    }
}

/* The references for repacked rows: each row's blocks rebuilt from its group (w is the start of the group of
 * nr <= 8 rows), then the plain type's reference. */
#define DEF_R8_REF(T, BLK, HALVES)                                                                           \
    static void dot_##T##_r8_ref(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, \
                                 float *out, int64_t ldo) {                                                  \
        BLK row[ST_MAX_ROW / QK];                                                                            \
        for (int r = 0; r < nr; r++) {                                                                       \
            row_from_group(w, r, n, sizeof(BLK), HALVES, (uint8_t *)row);                                    \
            for (int t = 0; t < nt; t++) dot_##T##_one(row, a[t].q, a[t].d, a[t].s, n, &out[t * ldo + r]);    \
        }                                                                                                    \
        (void)row_bytes;                                                                                     \
    }
DEF_R8_REF(q8_0, blk_q8_0, 1)
DEF_R8_REF(q4_1, blk_q4_1, 2)

dot_q_fn st_dot_q_ref(int32_t type) {
    switch (type) {
    case ST_TYPE_Q4_0: return dot_q4_0_ref;
    case ST_TYPE_Q4_1: return dot_q4_1_ref;
    case ST_TYPE_Q4_1_R8: return dot_q4_1_r8_ref;
    case ST_TYPE_Q8_0_R8: return dot_q8_0_r8_ref;
    case ST_TYPE_Q5_0: return dot_q5_0_ref;
    case ST_TYPE_Q5_1: return dot_q5_1_ref;
    case ST_TYPE_Q8_0: return dot_q8_0_ref;
    case ST_TYPE_Q4_K: return dot_q4_k_ref;
    case ST_TYPE_Q5_K: return dot_q5_k_ref;
    case ST_TYPE_Q6_K: return dot_q6_k_ref;
    default: return st_type_is_iq(type) ? st_dot_q_ref_iq(type) : st_dot_q_ref_lowbit(type);
    }
}

dot_f_fn st_dot_f_ref(int32_t type) {
    switch (type) {
    case ST_TYPE_F32: return dot_f32_ref;
    case ST_TYPE_F16: return dot_f16_ref;
    case ST_TYPE_BF16: return dot_bf16_ref;
    default: return NULL;
    }
}

/* The expert gate's definition (internal.h); the variants' versions are checked against it. */
void st_silu_mul_ref(const float *g, const float *u, float *h, int64_t n) {
    for (int64_t i = 0; i < n; i++) h[i] = silu(g[i]) * u[i];
}
