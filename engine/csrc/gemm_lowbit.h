/* The SIMD kernels of IQ4_NL and MXFP4 (layouts: quants_lowbit.h; Q2_K, Q3_K and IQ4_XS read the
 * per-256 activations, gemm_kq8.h), on
 * 256-bit vectors with 8-bit activations. Included by kernels_avx2.c (GEMM_VNNI 0: maddubs +
 * madd) and kernels_avx512.c (GEMM_VNNI 1: vpdpbusd where it pays) after gemm_int8.h, whose
 * helpers (8x8 dword transpose, prefetch, lane stores) it reuses.
 *
 * Layout: one vector lane per weight row, eight rows per register block. A 32-element block b
 * of the eight rows is unpacked once (lb8) into eight vectors w[j] holding elements 4j..4j+3 of
 * rows 0..7 (one dword per row), then each token's int8 bytes 4j..4j+3, broadcast to every
 * dword, multiply all eight rows at once. Per (row, token) and block the integer sum isum of
 * the block is exact, and the float work is, in this order,
 *     acc = fma(float(isum), S * dx, acc)         (S: the row's float scale of the block)
 *     acc = fma(M, xs, acc)                       (codes with an offset: M = -offset * S, xs = dx * sum(a))
 * with dx the token's activation scale of the block. A lane depends only on its row and
 * token, so any row or token count gives the same bits (the harness checks batch invariance).
 *
 * Integer sums per type:
 *   IQ4_NL  table values v in -127..113: AVX2 multiplies |v| by sign(a, v) (maddubs pairs < 2^15,
 *          widened per pair); VNNI takes v + 128 unsigned, the offset corrected in float.
 *   MXFP4  values v in -12..12 as v + 12 (unsigned; per half 16-bit sums, |sum| <= 8 * 24 * 127),
 *          the offset corrected in float. */
#ifndef STRATA_GEMM_LOWBIT_H
#define STRATA_GEMM_LOWBIT_H

#include <stddef.h>

#include "gemm_int8.h"
#include "quants_lowbit.h"

typedef struct {
    __m256i w[8];         /* chunk j of rows 0..7: codes (IQ4 on AVX2: the signed values) */
    __m256i u[8];         /* IQ4 on AVX2: |w| */
    __m256 S, M;          /* M: MXFP4, IQ4 on VNNI: -off * S, the offset's correction */
} lb8;

static inline uint16_t ld16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* The f16 at byte offset `off` of each of the eight rows, as floats. */
static inline __m256 f16_rows8(const uint8_t *const *rows, size_t off) {
    return _mm256_cvtph_ps(_mm_setr_epi16((short)ld16(rows[0] + off), (short)ld16(rows[1] + off),
                                          (short)ld16(rows[2] + off), (short)ld16(rows[3] + off),
                                          (short)ld16(rows[4] + off), (short)ld16(rows[5] + off),
                                          (short)ld16(rows[6] + off), (short)ld16(rows[7] + off)));
}

/* The 16 bytes at offset `off` of each row: p[k] dword r = bytes 4k..4k+3 of row r (k = 0..3). */
static inline void rows8_16(const uint8_t *const *rows, size_t off, __m256i *p) {
    __m256i v[4];
    for (int r = 0; r < 4; r++)
        v[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rows[r] + off))),
                                       _mm_loadu_si128((const __m128i *)(rows[r + 4] + off)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    p[0] = _mm256_unpacklo_epi64(t0, t2), p[1] = _mm256_unpackhi_epi64(t0, t2);
    p[2] = _mm256_unpacklo_epi64(t1, t3), p[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* 16 bytes of 4-bit indices of each row (offset `off`) through a 16-entry byte table:
 * w[j] = elements 4j..4j+3 (low nibbles of bytes 4j..), w[4 + j] = elements 16 + 4j.. (high). */
static inline void nibbles8(const uint8_t *const *rows, size_t off, __m256i table, __m256i *w) {
    __m256i p[4];
    rows8_16(rows, off, p);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        w[j] = _mm256_shuffle_epi8(table, _mm256_and_si256(p[j], m4));
        w[4 + j] = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(p[j], 4), m4));
    }
}

static inline __m256i table16(const int8_t *t, int add) {
    int8_t v[16];
    for (int i = 0; i < 16; i++) v[i] = (int8_t)(t[i] + add);
    const __m128i x = _mm_loadu_si128((const __m128i *)v);
    return _mm256_set_m128i(x, x);
}

/* The IQ4 table as the kernel multiplies it: signed (AVX2) or + 128 (VNNI). */
static inline __m256i iq4_table(void) { return table16(kvalues_iq4nl, GEMM_VNNI ? 128 : 0); }

/* Block b (32 elements) of the eight rows into k. */
static inline __attribute__((always_inline)) void lb_unpack(int32_t type, const uint8_t *const *rows, int64_t b,
                                                            lb8 *k) {
    switch (type) {
    case ST_TYPE_IQ4_NL: {
        const size_t off = (size_t)b * sizeof(blk_iq4_nl);
        k->S = f16_rows8(rows, off);
        nibbles8(rows, off + offsetof(blk_iq4_nl, qs), iq4_table(), k->w);
#if GEMM_VNNI
        k->M = _mm256_mul_ps(_mm256_set1_ps(-128.0f), k->S);
#else
        for (int c = 0; c < 8; c++) k->u[c] = _mm256_abs_epi8(k->w[c]);
#endif
        return;
    }
    case ST_TYPE_MXFP4: {
        const size_t off = (size_t)b * sizeof(blk_mxfp4);
        /* e8m0_half on the eight exponents: (e - 1) << 23, or 0x00200000 << e below 2 */
        const __m256i e = _mm256_setr_epi32(rows[0][off], rows[1][off], rows[2][off], rows[3][off], rows[4][off],
                                            rows[5][off], rows[6][off], rows[7][off]);
        const __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        k->S = _mm256_castsi256_ps(_mm256_blendv_epi8(norm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
        k->M = _mm256_mul_ps(_mm256_set1_ps(-12.0f), k->S);
        nibbles8(rows, off + offsetof(blk_mxfp4, qs), table16(kvalues_mxfp4, 12), k->w);
        return;
    }
    default: return;
    }
}

/* One token against block b of the eight rows (the lane operations in the header comment). */
static inline __attribute__((always_inline)) __m256 lb_step(int32_t type, const lb8 *k, const act_row *a, int64_t b,
                                                            __m256 acc) {
    const int8_t *q = a->q + b * QK;
    __m256i av[8];
    for (int j = 0; j < 8; j++) av[j] = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(q + 4 * j)));
    const __m256 dx = _mm256_broadcast_ss(a->d + b);
    __m256i isum;
    int offset = type == ST_TYPE_MXFP4; /* the codes carry an offset, corrected through M below */
#if GEMM_VNNI
    __m256i x = _mm256_dpbusd_epi32(_mm256_setzero_si256(), k->w[0], av[0]);
    __m256i y = _mm256_dpbusd_epi32(_mm256_setzero_si256(), k->w[4], av[4]);
    for (int j = 1; j < 4; j++) x = _mm256_dpbusd_epi32(x, k->w[j], av[j]), y = _mm256_dpbusd_epi32(y, k->w[4 + j], av[4 + j]);
    isum = _mm256_add_epi32(x, y);
    offset = 1;
#else
    if (type == ST_TYPE_MXFP4) {
        __m256i lo = _mm256_maddubs_epi16(k->w[0], av[0]), hi = _mm256_maddubs_epi16(k->w[4], av[4]);
        for (int j = 1; j < 4; j++) {
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(k->w[j], av[j]));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(k->w[4 + j], av[4 + j]));
        }
        isum = _mm256_add_epi32(madd_ones(lo), madd_ones(hi)); /* lo + hi could pass 2^15 */
    } else {
        __m256i p[8];
        for (int j = 0; j < 8; j++) p[j] = madd_ones(_mm256_maddubs_epi16(k->u[j], _mm256_sign_epi8(av[j], k->w[j])));
        isum = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])),
                                _mm256_add_epi32(_mm256_add_epi32(p[4], p[5]), _mm256_add_epi32(p[6], p[7])));
    }
#endif
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(k->S, dx), acc);
    return offset ? _mm256_fmadd_ps(k->M, _mm256_broadcast_ss(a->xs + b), acc) : acc;
}

/* NT tokens (a compile-time count for the few-token passes; 0 = nt at run time, accumulators in
 * memory) against every block of the eight rows. */
static inline __attribute__((always_inline)) void lb_pass(int32_t type, const uint8_t *const *rows, int64_t nb, int NT,
                                                          int nt, const act_row *a, __m256 *acc, const uint8_t *next,
                                                          size_t step) {
    lb8 k;
    const int cnt = NT ? NT : nt;
    __m256 v[4];
    for (int t = 0; t < NT; t++) v[t] = _mm256_setzero_ps();
    for (int t = 0; !NT && t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_slice(next, b, step);
        lb_unpack(type, rows, b, &k);
        if (NT)
            for (int t = 0; t < NT; t++) v[t] = lb_step(type, &k, &a[t], b, v[t]);
        else
            for (int t = 0; t < cnt; t++) acc[t] = lb_step(type, &k, &a[t], b, acc[t]);
    }
    for (int t = 0; t < NT; t++) acc[t] = v[t];
}

static inline __attribute__((always_inline)) void gemm_lowbit(int32_t type, const void *w, size_t row_bytes, int nr,
                                                              int64_t n, int nt, const act_row *a, float *out,
                                                              int64_t ldo) {
    const int64_t nb = n / QK;
    for (int r0 = 0; r0 < nr; r0 += 8) {
        const int nrr = nr - r0 < 8 ? nr - r0 : 8;
        const uint8_t *rows[8]; /* a short row block repeats its last row (results dropped) */
        for (int r = 0; r < 8; r++) rows[r] = (const uint8_t *)w + (size_t)(r0 + (r < nrr ? r : nrr - 1)) * row_bytes;
        const uint8_t *next = (const uint8_t *)w + (size_t)(r0 + 8) * row_bytes;
        const size_t step = 8 * row_bytes / (size_t)nb; /* bytes of one 32-block of 8 rows (MXFP4: 136) */
        __m256 acc[ST_MAX_NT];
        switch (nt) {
        case 1: lb_pass(type, rows, nb, 1, nt, a, acc, next, step); break;
        case 2: lb_pass(type, rows, nb, 2, nt, a, acc, next, step); break;
        case 3: lb_pass(type, rows, nb, 3, nt, a, acc, next, step); break;
        case 4: lb_pass(type, rows, nb, 4, nt, a, acc, next, step); break;
        default: lb_pass(type, rows, nb, 0, nt, a, acc, next, step); break;
        }
        lane_store(acc, nt, nrr, out + r0, ldo);
    }
}

#define DEF_GEMM_LOWBIT(NAME, TYPE)                                                                             \
    static void NAME(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, float *out, \
                     int64_t ldo) {                                                                            \
        gemm_lowbit(TYPE, w, row_bytes, nr, n, nt, a, out, ldo);                                               \
    }

DEF_GEMM_LOWBIT(gemm_iq4_nl, ST_TYPE_IQ4_NL)
DEF_GEMM_LOWBIT(gemm_mxfp4, ST_TYPE_MXFP4)

static dot_q_fn gemm_pick_lowbit(int32_t type) {
    switch (type) {
    case ST_TYPE_IQ4_NL: return gemm_iq4_nl;
    case ST_TYPE_MXFP4: return gemm_mxfp4;
    default: return NULL;
    }
}

#endif
