/* The SIMD kernels of Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 (layouts: quants_lowbit.h), on
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
 *     acc = fma(float(msum), M * dx, acc)         (Q2_K: the mins, M = -dmin)
 *     acc = fma(M, xs, acc)                       (codes with an offset: M = -offset * S, xs = dx * sum(a))
 * with dx the token's activation scale of the block. A lane depends only on its row and
 * token, so any row or token count gives the same bits (the harness checks batch invariance).
 *
 * Integer sums per type:
 *   Q2_K   codes u in 0..3 (unsigned), a 4-bit scale per 16: the 16-element halves are summed in
 *          16 bits (|sum| <= 8 * 3 * 127) and multiplied by their scales in one madd each; the
 *          mins by one more madd of the row's [m_lo, m_hi] with the token's [sum16_lo, sum16_hi].
 *   Q3_K   codes u = q + 4 in 0..7, scales sc - 32: as Q2_K, minus 4 * sc_h * sum16_h in the same
 *          madd form, so the sum is that of the signed codes.
 *   IQ4_NL, IQ4_XS  table values v in -127..113: AVX2 multiplies |v| by sign(a, v) (maddubs
 *          pairs < 2^15, widened per pair); VNNI takes v + 128 unsigned, the offset corrected in
 *          float. IQ4_XS's 6-bit scale goes into S = d * (ls - 32).
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
    __m256i sc_lo, sc_hi; /* Q2_K / Q3_K: each row's scale of the low / high half, in both int16 of its dword */
    __m256i pair;         /* Q2_K: [m_lo, m_hi] per row; Q3_K: [4 (sc_lo - 32), 4 (sc_hi - 32)] */
    __m256 S, M;          /* M: Q2_K -dmin; MXFP4, IQ4 on VNNI: -off * S, the offset's correction */
} lb8;

/* What a super-block of the eight rows shares between its sub-blocks. */
typedef struct {
    __m256i P[8];       /* Q2_K / Q3_K: the transposed 32-byte code chunk of sub-blocks 4c..4c+3 */
    __m256i H[8];       /* Q3_K: the transposed hmask */
    __m256i T[8], Tm[8]; /* Q2_K / Q3_K: [sc_2j, sc_2j+1] per row for sub-block j; Tm: lb8.pair */
    __m256 S[8];        /* IQ4_XS: the scale of each sub-block; Q2_K / Q3_K: d in S[0], -dmin in S[1] */
} lbstate;

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

/* The 32 bytes at offset `off` of each row, transposed: v[k] dword r = bytes 4k..4k+3 of row r. */
static inline void rows8_32(const uint8_t *const *rows, size_t off, __m256i *v) {
    for (int r = 0; r < 8; r++) v[r] = _mm256_loadu_si256((const __m256i *)(rows[r] + off));
    transpose8x8_epi32(v);
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

/* Q2_K / Q3_K: per-half int16 scales of sub-block j from T[j] = [sc_lo, sc_hi] per dword. */
static inline void k_halves(const lbstate *st, int j, lb8 *k) {
    const __m256i dup_lo = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5,
                                            8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i dup_hi = _mm256_add_epi8(dup_lo, _mm256_set1_epi8(2));
    k->sc_lo = _mm256_shuffle_epi8(st->T[j], dup_lo);
    k->sc_hi = _mm256_shuffle_epi8(st->T[j], dup_hi);
    k->pair = st->Tm[j];
}

/* Q2_K super-block i of the eight rows: scales and mins transposed, d and -dmin. The 16 scale
 * bytes of the eight rows are transposed packed (rows8_16: p[k] dword r = scale bytes 4k..4k+3
 * of row r), then one byte shuffle per sub-block widens its two bytes to the int16 pair
 * [sc_2j, sc_2j+1] of T[j] (before: each row widened to 16-bit and two 8x8 transposes, about
 * twice the shuffles); d and dmin, adjacent f16, come in one dword per row. */
static inline void q2k_super(const uint8_t *const *rows, int64_t i, lbstate *st) {
    const size_t o = (size_t)i * sizeof(blk_q2_k);
    __m256i p[4];
    rows8_16(rows, o, p);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i even = _mm256_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1, 0, -1, 1, -1, 4, -1,
                                          5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
    const __m256i odd = _mm256_add_epi8(even, _mm256_setr_epi8(2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                                               0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0));
    for (int k = 0; k < 4; k++) {
        const __m256i sc = _mm256_and_si256(p[k], m4), mn = _mm256_and_si256(_mm256_srli_epi16(p[k], 4), m4);
        st->T[2 * k] = _mm256_shuffle_epi8(sc, even), st->T[2 * k + 1] = _mm256_shuffle_epi8(sc, odd);
        st->Tm[2 * k] = _mm256_shuffle_epi8(mn, even), st->Tm[2 * k + 1] = _mm256_shuffle_epi8(mn, odd);
    }
    const size_t od = o + offsetof(blk_q2_k, d); /* dmin follows d */
    const __m256i h = _mm256_setr_epi32((int)ld32(rows[0] + od), (int)ld32(rows[1] + od), (int)ld32(rows[2] + od),
                                        (int)ld32(rows[3] + od), (int)ld32(rows[4] + od), (int)ld32(rows[5] + od),
                                        (int)ld32(rows[6] + od), (int)ld32(rows[7] + od));
    /* [d0..d3 dmin0..dmin3 | d4..d7 dmin4..dmin7] as 16-bit words, then [d0..d7 | dmin0..dmin7] */
    const __m256i dm = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(h, 16)), 0xD8);
    st->S[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    st->S[1] = _mm256_xor_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1)), _mm256_set1_ps(-0.0f));
}

/* Q3_K: the 16 scales (sc - 32) of one row's block as int16, from the 16 bytes at offset 94
 * (the last two code bytes, the 12 scale bytes, d: nothing past the block is read). */
static inline __m256i q3k_scales_row(const uint8_t *blk) {
    const __m128i x = _mm_loadu_si128((const __m128i *)(blk + 94));
    const __m128i m4 = _mm_set1_epi8(0x0F), m2 = _mm_set1_epi8(0x03);
    const __m128i b = _mm_srli_si128(x, 2); /* bytes 0..7: scale bytes 0..7 */
    const __m128i lo4 = _mm_unpacklo_epi64(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
    const __m128i h = _mm_shuffle_epi8(x, _mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13));
    __m128i hi2 = _mm_and_si128(h, m2);
    hi2 = _mm_blend_epi32(hi2, _mm_and_si128(_mm_srli_epi16(h, 2), m2), 0x2);
    hi2 = _mm_blend_epi32(hi2, _mm_and_si128(_mm_srli_epi16(h, 4), m2), 0x4);
    hi2 = _mm_blend_epi32(hi2, _mm_and_si128(_mm_srli_epi16(h, 6), m2), 0x8);
    const __m128i s6 = _mm_or_si128(lo4, _mm_slli_epi16(hi2, 4));
    return _mm256_sub_epi16(_mm256_cvtepu8_epi16(s6), _mm256_set1_epi16(32));
}

static inline void q3k_super(const uint8_t *const *rows, int64_t i, lbstate *st) {
    const size_t o = (size_t)i * sizeof(blk_q3_k);
    for (int r = 0; r < 8; r++) st->T[r] = q3k_scales_row(rows[r] + o);
    transpose8x8_epi32(st->T);
    for (int j = 0; j < 8; j++) st->Tm[j] = _mm256_slli_epi16(st->T[j], 2);
    rows8_32(rows, o + offsetof(blk_q3_k, hmask), st->H);
    st->S[0] = f16_rows8(rows, o + offsetof(blk_q3_k, d));
    st->S[1] = _mm256_setzero_ps(); /* no mins */
}

/* IQ4_XS: S[ib] = d * (ls - 32) of each row, from [d, scales_h] and scales_l as dwords. */
static inline void iq4xs_super(const uint8_t *const *rows, int64_t i, lbstate *st) {
    const size_t o = (size_t)i * sizeof(blk_iq4_xs);
    const __m256i h = _mm256_setr_epi32((int)ld32(rows[0] + o), (int)ld32(rows[1] + o), (int)ld32(rows[2] + o),
                          (int)ld32(rows[3] + o), (int)ld32(rows[4] + o), (int)ld32(rows[5] + o),
                          (int)ld32(rows[6] + o), (int)ld32(rows[7] + o));
    const __m256i l = _mm256_setr_epi32((int)ld32(rows[0] + o + 4), (int)ld32(rows[1] + o + 4), (int)ld32(rows[2] + o + 4),
                          (int)ld32(rows[3] + o + 4), (int)ld32(rows[4] + o + 4), (int)ld32(rows[5] + o + 4),
                          (int)ld32(rows[6] + o + 4), (int)ld32(rows[7] + o + 4));
    const __m256 d = f16_rows8(rows, o);
    const __m256i sh = _mm256_srli_epi32(h, 16);
    for (int ib = 0; ib < 8; ib++) {
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(l, _mm_cvtsi32_si128(4 * ib)), _mm256_set1_epi32(0xF));
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi32(sh, _mm_cvtsi32_si128(2 * ib)), _mm256_set1_epi32(3));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        st->S[ib] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(ls));
    }
}

/* Block b (32 elements) of the eight rows into k; st carries what a super-block shares. */
static inline __attribute__((always_inline)) void lb_unpack(int32_t type, const uint8_t *const *rows, int64_t b,
                                                            lbstate *st, lb8 *k) {
    const int j = (int)(b % 8);
    const int64_t i = b / 8;
    switch (type) {
    case ST_TYPE_Q2_K:
    case ST_TYPE_Q3_K: {
        const int q3 = type == ST_TYPE_Q3_K;
        if (j == 0) {
            if (q3) q3k_super(rows, i, st);
            else q2k_super(rows, i, st);
        }
        if (j % 4 == 0) {
            const size_t qo = q3 ? offsetof(blk_q3_k, qs) : offsetof(blk_q2_k, qs);
            rows8_32(rows, (size_t)i * (q3 ? sizeof(blk_q3_k) : sizeof(blk_q2_k)) + qo + 32 * (size_t)(j / 4), st->P);
        }
        const __m128i sh = _mm_cvtsi32_si128(2 * (j % 4));
        const __m256i m2 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
        for (int c = 0; c < 8; c++) {
            __m256i u = _mm256_and_si256(_mm256_srl_epi16(st->P[c], sh), m2);
            if (q3) {
                const __m256i hb = j >= 2 ? _mm256_srl_epi16(st->H[c], _mm_cvtsi32_si128(j - 2))
                                          : _mm256_sll_epi16(st->H[c], _mm_cvtsi32_si128(2 - j));
                u = _mm256_or_si256(u, _mm256_and_si256(hb, bit2));
            }
            k->w[c] = u;
        }
        k_halves(st, j, k);
        k->S = st->S[0];
        k->M = st->S[1];
        return;
    }
    case ST_TYPE_IQ4_NL:
    case ST_TYPE_IQ4_XS: {
        size_t off;
        if (type == ST_TYPE_IQ4_NL) {
            off = (size_t)b * sizeof(blk_iq4_nl);
            k->S = f16_rows8(rows, off);
            off += offsetof(blk_iq4_nl, qs);
        } else {
            if (j == 0) iq4xs_super(rows, i, st);
            off = (size_t)i * sizeof(blk_iq4_xs) + offsetof(blk_iq4_xs, qs) + 16 * (size_t)j;
            k->S = st->S[j];
        }
        nibbles8(rows, off, iq4_table(), k->w);
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
    if (type == ST_TYPE_Q2_K || type == ST_TYPE_Q3_K) {
        __m256i lo = _mm256_maddubs_epi16(k->w[0], av[0]), hi = _mm256_maddubs_epi16(k->w[4], av[4]);
        for (int j = 1; j < 4; j++) {
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(k->w[j], av[j]));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(k->w[4 + j], av[4 + j]));
        }
        isum = _mm256_add_epi32(_mm256_madd_epi16(lo, k->sc_lo), _mm256_madd_epi16(hi, k->sc_hi));
        const int32_t s0 = a->s[2 * b], s1 = a->s[2 * b + 1];
        const __m256i ap = _mm256_set1_epi32((int)((uint32_t)(uint16_t)s0 | ((uint32_t)(uint16_t)s1 << 16)));
        const __m256i pm = _mm256_madd_epi16(k->pair, ap);
        if (type == ST_TYPE_Q3_K) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum, pm)), _mm256_mul_ps(k->S, dx), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(k->S, dx), acc);
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(pm), _mm256_mul_ps(k->M, dx), acc);
    }
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
    lbstate st;
    memset(&st, 0, sizeof st); /* every field is set at its super-block start; this keeps the compiler sure of it */
    lb8 k;
    const int cnt = NT ? NT : nt;
    __m256 v[4];
    for (int t = 0; t < NT; t++) v[t] = _mm256_setzero_ps();
    for (int t = 0; !NT && t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_slice(next, b, step);
        lb_unpack(type, rows, b, &st, &k);
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
        const size_t step = 8 * row_bytes / (size_t)nb; /* bytes of one 32-block of 8 rows (Q2_K: 84) */
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

DEF_GEMM_LOWBIT(gemm_q2_k, ST_TYPE_Q2_K)
DEF_GEMM_LOWBIT(gemm_q3_k, ST_TYPE_Q3_K)
DEF_GEMM_LOWBIT(gemm_iq4_nl, ST_TYPE_IQ4_NL)
DEF_GEMM_LOWBIT(gemm_iq4_xs, ST_TYPE_IQ4_XS)
DEF_GEMM_LOWBIT(gemm_mxfp4, ST_TYPE_MXFP4)

static dot_q_fn gemm_pick_lowbit(int32_t type) {
    switch (type) {
    case ST_TYPE_Q2_K: return gemm_q2_k;
    case ST_TYPE_Q3_K: return gemm_q3_k;
    case ST_TYPE_IQ4_NL: return gemm_iq4_nl;
    case ST_TYPE_IQ4_XS: return gemm_iq4_xs;
    case ST_TYPE_MXFP4: return gemm_mxfp4;
    default: return NULL;
    }
}

#endif
