/* Q6_K, Q2_K, Q3_K and IQ4_XS against the per-256 activation view (act_row.qk, st_type_q8k), on 256-bit
 * vectors; compiled into the AVX2 and the AVX-512 variant alike (the same instructions). Q4_K keeps
 * the per-32 kernels (gemm_int8.h): on the Zen 3 VM it gained nothing from this view at one token and
 * lost 22% at 16-64 tokens (docs/benchmarks.md, "Per-256 activations for the k-quants").
 *
 * One row's super-block at a time, as llama.cpp's vec_dot: the codes against the int8
 * activations with maddubs (u8 x s8 -> s16 pairs), the 16-bit pairs times the sub-block scale
 * with madd into int32 lanes, summed over the whole super-block in integers. Q2_K's minimums and
 * the offsets of Q6_K (32) and Q3_K (4) come from the activation's int16 sums (one madd per row and
 * super-block; IQ4_XS has neither: its signed table values are multiplied as |v| times sign(a, v)).
 * The eight rows' lane vectors are then reduced with a hadd tree into one
 * vector (lane r = row r) and the float step of the reference (quants.c, quants_lowbit.c) runs once
 * per super-block for all eight rows:
 *   Q2_K        acc += dk * (d * isum - dmin * msum)
 *   Q6_K, Q3_K  acc += dk * (d * (isum - off * msum))   (codes kept unsigned: off 32, 4)
 *   IQ4_XS      acc += dk * (d * isum)                  (isum = sum_j (ls_j - 32) * sum(v a))
 * The integer sums are exact and the float operations are the reference's, in its order (no
 * FMA), so every token count and row count gives the reference's bits.
 *
 * Tokens go in groups of eight (then four, then the rest): each row's super-block is unpacked
 * into registers once per group. Bounds: the maddubs pairs (codes <= 63 against |a| <= 127) fit int16; the
 * super-block sums (< 2^28) fit int32. */
#ifndef STRATA_GEMM_KQ8_H
#define STRATA_GEMM_KQ8_H

#include <immintrin.h>

#include "internal.h"
#include "quants_lowbit.h"

#define KQ8_TP 8 /* most tokens per pass */

/* Lane r of the result = the sum of the 8 lanes of v[r] (integers: exact in any order). */
static inline __m256i kq8_reduce8(const __m256i *v) {
    const __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The eight rows' f16 at byte offset off of their super-block i, as floats. */
static inline __m256 kq8_f16x8(const uint8_t *const *rows, int64_t i, size_t bs, size_t off) {
    uint16_t h[8];
    for (int r = 0; r < 8; r++) memcpy(&h[r], rows[r] + (size_t)i * bs + off, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

/* Q6_K, Q2_K, Q3_K: byte shuffles of eight int16 scales (in both 128-bit lanes) putting scale 2k in
 * the low lane and 2k + 1 in the high lane (k = 0..3: the 32-element chunk of a half super-block):
 * the scales are widened once per super-block and each chunk's pair is one in-lane shuffle. */
static const uint8_t kq8_sc16[4][32] __attribute__((aligned(32))) = {
#define KQ8_S(k) {4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, \
                  4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, \
                  4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, \
                  4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3}
    KQ8_S(0), KQ8_S(1), KQ8_S(2), KQ8_S(3)
#undef KQ8_S
};

/* ---- Q6_K: one row's super-block against NT tokens; msum = sum_g sc_g * bsum_g ---- */
static inline __attribute__((always_inline)) void kq8_q6k_sb(const blk_q6_k *b, int64_t i, int NT,
                                                             const act_row *a, __m256i *isum, __m256i *msum) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i *)b->scales);
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    for (int t = 0; t < NT; t++) {
        msum[t] = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a[t].bk + 16 * i)));
        isum[t] = _mm256_setzero_si256();
    }
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
        /* scales 8h..8h + 7 as int16 in both 128-bit lanes */
        const __m256i sh = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
        for (int k = 0; k < 4; k++) {
            const __m256i s = _mm256_shuffle_epi8(sh, _mm256_load_si256((const __m256i *)kq8_sc16[k]));
            for (int t = 0; t < NT; t++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a[t].qk + QK_K * i + 128 * h + 32 * k));
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, _mm256_maddubs_epi16(q[k], x)));
            }
        }
    }
}

/* ---- Q2_K: msum = sum_g m_g * bsum_g ---- */
static inline __attribute__((always_inline)) void kq8_q2k_sb(const blk_q2_k *b, int64_t i, int NT,
                                                             const act_row *a, __m256i *isum, __m256i *msum) {
    const __m128i sm8 = _mm_loadu_si128((const __m128i *)b->scales);
    const __m128i sc8 = _mm_and_si128(sm8, _mm_set1_epi8(0xF));
    const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm8, 4), _mm_set1_epi8(0xF)));
    for (int t = 0; t < NT; t++) {
        msum[t] = _mm256_madd_epi16(m16, _mm256_loadu_si256((const __m256i *)(a[t].bk + 16 * i)));
        isum[t] = _mm256_setzero_si256();
    }
    const __m256i m3 = _mm256_set1_epi8(3), sc16 = _mm256_cvtepu8_epi16(sc8);
    for (int h = 0; h < 2; h++) {
        const __m256i qb = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
        /* scales 8h..8h + 7 as int16 in both 128-bit lanes */
        const __m256i sh = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
        for (int k = 0; k < 4; k++) { /* elements 128h + 32k + l: bits 2k of qs[32h + l], groups 8h + 2k (+1) */
            const __m256i q = k ? _mm256_and_si256(_mm256_srli_epi16(qb, 2 * k), m3) : _mm256_and_si256(qb, m3);
            const __m256i s = _mm256_shuffle_epi8(sh, _mm256_load_si256((const __m256i *)kq8_sc16[k]));
            for (int t = 0; t < NT; t++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a[t].qk + QK_K * i + 128 * h + 32 * k));
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, _mm256_maddubs_epi16(q, x)));
            }
        }
    }
}

/* Q3_K: the 16 signed 6-bit scales (sc - 32, q3k_scale) of a block as int8, decoded in one vector:
 * 32-bit lane j (scales 4j..4j+3) takes its low nibbles from word j & 1 of the 12 bytes shifted by
 * 4 (j / 2) and its two high bits from word 2 shifted by 2j. The 16 bytes loaded end at the block's
 * d (scales lie at bytes 2..13 of them), so the load stays inside the block. */
static inline __m128i kq8_q3k_scales(const blk_q3_k *b) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(b->scales + 14 - 16));
    const __m128i lo = _mm_shuffle_epi8(v, _mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9));
    const __m128i hi = _mm_shuffle_epi8(v, _mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13));
    const __m128i l = _mm_and_si128(_mm_srlv_epi32(lo, _mm_setr_epi32(0, 0, 4, 4)), _mm_set1_epi8(0x0f));
    const __m128i h = _mm_and_si128(_mm_slli_epi32(_mm_srlv_epi32(hi, _mm_setr_epi32(0, 2, 4, 6)), 4),
                                    _mm_set1_epi8(0x30));
    return _mm_sub_epi8(_mm_or_si128(l, h), _mm_set1_epi8(32));
}

/* hmask bit c moved to bit 2 of each byte (one shift; the mask drops what crosses bytes). */
static inline __m256i kq8_q3k_hi(__m256i hb, int c) {
    const __m256i four = _mm256_set1_epi8(4);
    if (c < 2) return _mm256_and_si256(_mm256_slli_epi16(hb, 2 - c), four);
    if (c == 2) return _mm256_and_si256(hb, four);
    return _mm256_and_si256(_mm256_srli_epi16(hb, c - 2), four);
}

/* ---- Q3_K: codes kept unsigned (low two bits + 4 * high bit, 0..7; the value is that - 4),
 * msum = sum_g (sc_g - 32) * bsum_g ---- */
static inline __attribute__((always_inline)) void kq8_q3k_sb(const blk_q3_k *b, int64_t i, int NT,
                                                             const act_row *a, __m256i *isum, __m256i *msum) {
    const __m128i sc8 = kq8_q3k_scales(b);
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    for (int t = 0; t < NT; t++) {
        msum[t] = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(a[t].bk + 16 * i)));
        isum[t] = _mm256_setzero_si256();
    }
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i hb = _mm256_loadu_si256((const __m256i *)b->hmask);
    for (int h = 0; h < 2; h++) {
        const __m256i qb = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
        /* scales 8h..8h + 7 as int16 in both 128-bit lanes */
        const __m256i sh = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
        for (int k = 0; k < 4; k++) { /* high bit of element 128h + 32k + l: bit 4h + k of hmask[l] */
            const __m256i lo = k ? _mm256_and_si256(_mm256_srli_epi16(qb, 2 * k), m3) : _mm256_and_si256(qb, m3);
            const __m256i q = _mm256_or_si256(lo, kq8_q3k_hi(hb, 4 * h + k));
            const __m256i s = _mm256_shuffle_epi8(sh, _mm256_load_si256((const __m256i *)kq8_sc16[k]));
            for (int t = 0; t < NT; t++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a[t].qk + QK_K * i + 128 * h + 32 * k));
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, _mm256_maddubs_epi16(q, x)));
            }
        }
    }
}

/* IQ4_XS: the 8 signed sub-block scales (ls_j - 32) of a block as int16 lanes j: the low nibbles of
 * scales_l (lane j: byte j / 2 times 16 or 1, then >> 4) and two bits of scales_h (its copy in lane
 * j times 2^(14 - 2j), then >> 14). */
static inline __m128i kq8_iq4xs_scales(const blk_iq4_xs *b) {
    const __m128i l8 = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)ld32(b->scales_l)),
                                        _mm_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1));
    const __m128i lo = _mm_and_si128(_mm_srli_epi16(_mm_mullo_epi16(l8, _mm_setr_epi16(16, 1, 16, 1, 16, 1, 16, 1)), 4),
                                     _mm_set1_epi16(0xF));
    const __m128i hi = _mm_srli_epi16(_mm_mullo_epi16(_mm_set1_epi16((short)b->scales_h),
                                                      _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4,
                                                                     1 << 2, 1)), 14);
    return _mm_sub_epi16(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi16(32));
}

/* IQ4_XS: byte shuffles putting int16 lane 2h of a 128-bit lane in bytes 0..15 and lane 2h + 1 in 16..31
 * (h = 0..3: a sub-block pair). */
static const uint8_t kq8_w16[4][32] __attribute__((aligned(32))) = {
#define KQ8_W(j) 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, \
                 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1, 2 * (j), 2 * (j) + 1
    {KQ8_W(0), KQ8_W(1)}, {KQ8_W(2), KQ8_W(3)}, {KQ8_W(4), KQ8_W(5)}, {KQ8_W(6), KQ8_W(7)}
#undef KQ8_W
};

/* The IQ4 table in both 128-bit lanes. */
static inline __m256i kq8_iq4_values(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4nl));
}

/* A super-block's activations x in the order kq8_iq4xs_sb multiplies them: xr[2h + k] = bytes
 * 64h + 16k .. + 15 (low 128-bit lane) and 64h + 32 + 16k .. + 15 (high). Built once per token and
 * super-block for the eight rows (the 16-byte pair loads had cost an insert per row). */
static inline __attribute__((always_inline)) void kq8_iq4xs_acts(const int8_t *x, __m256i *xr) {
    for (int h = 0; h < 4; h++)
        for (int k = 0; k < 2; k++)
            xr[2 * h + k] = _mm256_loadu2_m128i((const __m128i *)(x + 64 * h + 32 + 16 * k), (const __m128i *)(x + 64 * h + 16 * k));
}

/* ---- IQ4_XS: the table values v (-127..113) against the activations as |v| times sign(a, v)
 * (maddubs pairs <= 2 * 127 * 127 < 2^15), madd by the sub-block's scale; no offset. The 32 code
 * bytes of sub-blocks 2h, 2h + 1 are taken as they lie: their low nibbles are elements 0..15 of
 * both sub-blocks (one per 128-bit lane), the high nibbles elements 16..31, so the activations are
 * taken as the matching 16-byte pairs (kq8_iq4xs_acts) and one scale vector (lane halves 2h, 2h + 1)
 * serves both. ---- */
static inline __attribute__((always_inline)) void kq8_iq4xs_sb(const blk_iq4_xs *b, int NT, const __m256i (*xr)[8],
                                                               __m256i *isum) {
    const __m256i sc = _mm256_broadcastsi128_si256(kq8_iq4xs_scales(b));
    const __m256i values = kq8_iq4_values(), m4 = _mm256_set1_epi8(0xF);
    for (int t = 0; t < NT; t++) isum[t] = _mm256_setzero_si256();
    for (int h = 0; h < 4; h++) {
        const __m256i qb = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
        const __m256i v[2] = {_mm256_shuffle_epi8(values, _mm256_and_si256(qb, m4)),
                              _mm256_shuffle_epi8(values, _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4))};
        const __m256i s = _mm256_shuffle_epi8(sc, _mm256_load_si256((const __m256i *)kq8_w16[h]));
        for (int k = 0; k < 2; k++) {
            const __m256i u = _mm256_sign_epi8(v[k], v[k]);
            for (int t = 0; t < NT; t++)
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, _mm256_maddubs_epi16(u, _mm256_sign_epi8(xr[t][2 * h + k], v[k]))));
        }
    }
}

static inline size_t kq8_block_bytes(int32_t type) {
    return type == ST_TYPE_Q6_K ? sizeof(blk_q6_k) : type == ST_TYPE_Q2_K ? sizeof(blk_q2_k)
         : type == ST_TYPE_Q3_K ? sizeof(blk_q3_k) : sizeof(blk_iq4_xs);
}

static inline size_t kq8_d_offset(int32_t type) {
    return type == ST_TYPE_Q6_K ? offsetof(blk_q6_k, d) : type == ST_TYPE_Q2_K ? offsetof(blk_q2_k, d)
         : type == ST_TYPE_Q3_K ? offsetof(blk_q3_k, d) : offsetof(blk_iq4_xs, d);
}

/* NT tokens against eight rows (rows[r]; rows past nr repeat a valid row): acc[t] lane r. Super-blocks
 * go in chunks of KQ8_ENTRIES / NT: each row runs through the chunk on its own (one stream at a time,
 * as llama.cpp's vec_dot reads a row), its lane sums kept per (super-block, token); then per
 * super-block, in order, the eight rows' sums are reduced and the float step taken. */
#define KQ8_ENTRIES 32
/* Super-blocks of prefetch distance along a row, running on past the row's end: a tile's rows are
 * consecutive bytes and at one token a pass reads each row whole (up to KQ8_ENTRIES super-blocks), so
 * the eight rows are one stream and the next row's head is the stream's next bytes. Stopping at the
 * row's end (and 6 ahead) read a 151552x4096 Q6_K head from DRAM at 14.2 GMAC/s, 17.2 running on,
 * 17.8-18.6 at 12 ahead (llama.cpp's vec_dot 15.3-16.0; Zen 3, 1 thread). Prefetches never fault. */
#define KQ8_AHEAD 12
static inline __attribute__((always_inline)) void kq8_pass(int32_t type, const uint8_t *const *rows, int64_t nb,
                                                           int NT, const act_row *a, __m256 *acc) {
    const int CH = KQ8_ENTRIES / NT;
    const size_t bs = kq8_block_bytes(type);
    __m256i iv[KQ8_ENTRIES][8], mv[KQ8_ENTRIES][8], xr[KQ8_ENTRIES][8];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i0 = 0; i0 < nb; i0 += CH) {
        const int ni = nb - i0 < CH ? (int)(nb - i0) : CH;
        if (type == ST_TYPE_IQ4_XS)
            for (int c = 0; c < ni; c++)
                for (int t = 0; t < NT; t++) kq8_iq4xs_acts(a[t].qk + QK_K * (i0 + c), xr[c * NT + t]);
        for (int r = 0; r < 8; r++) {
            const uint8_t *row = rows[r] + (size_t)i0 * bs;
            for (int c = 0; c < ni; c++) {
                const int64_t i = i0 + c;
                /* the bytes KQ8_AHEAD super-blocks on, one line per 64 bytes: from DRAM the hardware
                 * prefetcher alone does not keep the stream fed */
                for (size_t o = 0; o < bs; o += 64) _mm_prefetch((const char *)(row + (c + KQ8_AHEAD) * bs + o), _MM_HINT_T0);
                __m256i is[KQ8_TP], ms[KQ8_TP];
                if (type == ST_TYPE_Q6_K) kq8_q6k_sb((const blk_q6_k *)row + c, i, NT, a, is, ms);
                else if (type == ST_TYPE_Q2_K) kq8_q2k_sb((const blk_q2_k *)row + c, i, NT, a, is, ms);
                else if (type == ST_TYPE_Q3_K) kq8_q3k_sb((const blk_q3_k *)row + c, i, NT, a, is, ms);
                else kq8_iq4xs_sb((const blk_iq4_xs *)row + c, NT, (const __m256i (*)[8])xr[c * NT], is);
                if (type == ST_TYPE_IQ4_XS)
                    for (int t = 0; t < NT; t++) iv[c * NT + t][r] = is[t];
                else if (type == ST_TYPE_Q2_K)
                    for (int t = 0; t < NT; t++) iv[c * NT + t][r] = is[t], mv[c * NT + t][r] = ms[t];
                else /* the offset term folded in per lane (exact integers): one reduction, not two */
                    for (int t = 0; t < NT; t++)
                        iv[c * NT + t][r] = _mm256_sub_epi32(is[t], _mm256_slli_epi32(ms[t], type == ST_TYPE_Q6_K ? 5 : 2));
            }
        }
        for (int c = 0; c < ni; c++) {
            const int64_t i = i0 + c;
            if (type == ST_TYPE_Q2_K) {
                const __m256 d = kq8_f16x8(rows, i, bs, offsetof(blk_q2_k, d));
                const __m256 m = kq8_f16x8(rows, i, bs, offsetof(blk_q2_k, dmin));
                for (int t = 0; t < NT; t++) {
                    const __m256 fi = _mm256_cvtepi32_ps(kq8_reduce8(iv[c * NT + t]));
                    const __m256 fm = _mm256_cvtepi32_ps(kq8_reduce8(mv[c * NT + t]));
                    const __m256 x = _mm256_sub_ps(_mm256_mul_ps(d, fi), _mm256_mul_ps(m, fm));
                    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_set1_ps(a[t].dk[i]), x));
                }
            } else { /* Q6_K (offset 32), Q3_K (offset 4), IQ4_XS (none): d * (isum - offset * msum) */
                const __m256 d = kq8_f16x8(rows, i, bs, kq8_d_offset(type));
                for (int t = 0; t < NT; t++) {
                    const __m256i tot = kq8_reduce8(iv[c * NT + t]); /* isum - offset * msum, folded above */
                    const __m256 x = _mm256_mul_ps(d, _mm256_cvtepi32_ps(tot));
                    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_set1_ps(a[t].dk[i]), x));
                }
            }
        }
    }
}

/* ---- many tokens: the eight rows interleaved by 4-code groups ----
 * A super-block of the eight rows is unpacked once for all tokens: unsigned codes in element order
 * per row, transposed so that w[k] holds codes 4k..4k+3 of rows 0..7 (one 32-bit lane per row), and
 * per 16-element group g the scale vector s[g] (each row's lane: its scale twice, int16) and per
 * group pair the offset/minimum vector m[p] (each row's lane: its value of groups 2p, 2p + 1). Per
 * token, maddubs against the four activation bytes broadcast, madd by s[g]: the lanes accumulate
 * each row's exact isum, and madd of m[p] with the token's two int16 sums its msum, the integers
 * of the paths above; the float step is theirs. */
/* Tokens from which a call takes this path (kernel_bench, AVX2, best of 300: at 16 tokens Q2_K, Q3_K and
 * Q6_K gain 45%, 82%, 48% over the fused passes above). */
#define KQ8_MANY_MIN 16
/* IQ4_XS from 8 (kernel_bench, 8 x 8192, AVX2: 8 / 12 tokens 35.5 / 36.9 GMAC/s fused, 39.7 / 44.6 here) */
#define KQ8_MANY_MIN_IQ4 8

/* Row r's super-block: codes[256] (unsigned, element order), sc[16] and mn[16] per 16-group (Q2_K:
 * scale and minimum; Q6_K / Q3_K: the signed scale twice, the offset term's factor). */
static inline __attribute__((always_inline)) void kq8_unpack_row(int32_t type, const uint8_t *blk, uint8_t *codes,
                                                                 int16_t *sc, int16_t *mn) {
    if (type == ST_TYPE_Q6_K) {
        const blk_q6_k *b = (const blk_q6_k *)blk;
        const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            uint8_t *c = codes + 128 * h;
            _mm256_storeu_si256((__m256i *)c, _mm256_or_si256(_mm256_and_si256(l0, m4),
                                                              _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30)));
            _mm256_storeu_si256((__m256i *)(c + 32), _mm256_or_si256(_mm256_and_si256(l1, m4),
                                                                     _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30)));
            _mm256_storeu_si256((__m256i *)(c + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                                                     _mm256_and_si256(hb, m30)));
            _mm256_storeu_si256((__m256i *)(c + 96),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30)));
        }
        for (int g = 0; g < 16; g++) sc[g] = mn[g] = b->scales[g];
    } else if (type == ST_TYPE_Q2_K) {
        const blk_q2_k *b = (const blk_q2_k *)blk;
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int h = 0; h < 2; h++) {
            const __m256i qb = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
            for (int k = 0; k < 4; k++)
                _mm256_storeu_si256((__m256i *)(codes + 128 * h + 32 * k),
                                    _mm256_and_si256(_mm256_srli_epi16(qb, 2 * k), m3));
        }
        for (int g = 0; g < 16; g++) sc[g] = b->scales[g] & 0xF, mn[g] = b->scales[g] >> 4;
    } else if (type == ST_TYPE_IQ4_XS) { /* the signed table values; sc = ls - 32 per 16-group, no offset */
        const blk_iq4_xs *b = (const blk_iq4_xs *)blk;
        const __m256i values = kq8_iq4_values(), m4 = _mm256_set1_epi8(0xF);
        for (int h = 0; h < 4; h++) {
            const __m256i qb = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
            const __m256i lo = _mm256_shuffle_epi8(values, _mm256_and_si256(qb, m4));
            const __m256i hi = _mm256_shuffle_epi8(values, _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4));
            _mm256_storeu_si256((__m256i *)(codes + 64 * h), _mm256_permute2x128_si256(lo, hi, 0x20));
            _mm256_storeu_si256((__m256i *)(codes + 64 * h + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
        }
        const __m128i s8 = kq8_iq4xs_scales(b);
        _mm256_storeu_si256((__m256i *)sc, _mm256_setr_m128i(_mm_unpacklo_epi16(s8, s8), _mm_unpackhi_epi16(s8, s8)));
        (void)mn;
    } else {
        const blk_q3_k *b = (const blk_q3_k *)blk;
        const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
        const __m256i hb = _mm256_loadu_si256((const __m256i *)b->hmask);
        for (int h = 0; h < 2; h++) {
            const __m256i qb = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
            for (int k = 0; k < 4; k++) {
                const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hb, 4 * h + k), 2), four);
                _mm256_storeu_si256((__m256i *)(codes + 128 * h + 32 * k),
                                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 2 * k), m3), hi));
            }
        }
        const __m256i s16 = _mm256_cvtepi8_epi16(kq8_q3k_scales(b));
        _mm256_storeu_si256((__m256i *)sc, s16);
        _mm256_storeu_si256((__m256i *)mn, s16);
    }
}

/* U (1..4) tokens against one unpacked super-block i of the eight rows (kq8_many): each w[k] and
 * s[g] loaded once for the U tokens. */
static inline __attribute__((always_inline)) void kq8_many_tokens(const __m256i *w, const __m256i *uw, const __m256i *s,
                                                                  const __m256i *m, __m256 d, __m256 dm, int with_min,
                                                                  int sh, int64_t i, int U, const act_row *a, __m256 *acc) {
    __m256i is[4], ms[4];
    for (int u = 0; u < U; u++) is[u] = _mm256_setzero_si256(), ms[u] = _mm256_setzero_si256();
    for (int k = 0; k < 64; k++) {
        const __m256i wk = _mm256_load_si256(w + k), sk = _mm256_load_si256(s + k / 4);
        const __m256i uk = uw ? _mm256_load_si256(uw + k) : wk;
        for (int u = 0; u < U; u++) {
            int32_t x;
            memcpy(&x, a[u].qk + QK_K * i + 4 * k, 4);
            const __m256i xv = uw ? _mm256_sign_epi8(_mm256_set1_epi32(x), wk) : _mm256_set1_epi32(x);
            is[u] = _mm256_add_epi32(is[u], _mm256_madd_epi16(sk, _mm256_maddubs_epi16(uk, xv)));
        }
    }
    for (int p = 0; m && p < 8; p++)
        for (int u = 0; u < U; u++) {
            int32_t b2;
            memcpy(&b2, a[u].bk + 16 * i + 2 * p, 4);
            ms[u] = _mm256_add_epi32(ms[u], _mm256_madd_epi16(m[p], _mm256_set1_epi32(b2)));
        }
    for (int u = 0; u < U; u++) {
        __m256 xf;
        if (with_min)
            xf = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(is[u])), _mm256_mul_ps(dm, _mm256_cvtepi32_ps(ms[u])));
        else
            xf = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(is[u], _mm256_slli_epi32(ms[u], sh))));
        acc[u] = _mm256_add_ps(acc[u], _mm256_mul_ps(_mm256_set1_ps(a[u].dk[i]), xf));
    }
}

static inline __attribute__((always_inline)) void kq8_many(int32_t type, const uint8_t *const *rows, int64_t nb,
                                                           int nt, const act_row *a, float *out, int64_t ldo, int rn,
                                                           const uint8_t *next) {
    const size_t bs = kq8_block_bytes(type), doff = kq8_d_offset(type);
    const int sgn = type == ST_TYPE_IQ4_XS; /* signed codes (|w| times sign(a, w)) and no offset term */
    const size_t moff = offsetof(blk_q2_k, dmin);
    const int with_min = type == ST_TYPE_Q2_K, sh = type == ST_TYPE_Q6_K ? 5 : 2;
    __m256 acc[ST_MAX_NT];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        /* the next row block's matching slice, as the per-32 kernels do (gemm_int8.h's prefetch_slice:
         * a work tile's rows are one linear stream) */
        prefetch_slice(next, i, 8 * bs);
        uint8_t codes[8][QK_K] __attribute__((aligned(32)));
        int16_t sc[8][16], mn[8][16];
        for (int r = 0; r < 8; r++) kq8_unpack_row(type, rows[r] + (size_t)i * bs, codes[r], sc[r], mn[r]);
        __m256i w[64] __attribute__((aligned(32))), uw[64] __attribute__((aligned(32))), s[16] __attribute__((aligned(32))), m[8];
        for (int c = 0; c < 8; c++) {
            __m256i v[8];
            for (int r = 0; r < 8; r++) v[r] = _mm256_load_si256((const __m256i *)(codes[r] + 32 * c));
            transpose8x8_epi32(v);
            for (int q = 0; q < 8; q++) w[8 * c + q] = v[q];
            if (sgn)
                for (int q = 0; q < 8; q++) uw[8 * c + q] = _mm256_sign_epi8(v[q], v[q]);
        }
        for (int g = 0; g < 16; g++) {
            int32_t l[8];
            for (int r = 0; r < 8; r++) l[r] = (int32_t)(uint16_t)sc[r][g] * 0x10001;
            s[g] = _mm256_loadu_si256((const __m256i *)l);
        }
        for (int p = 0; !sgn && p < 8; p++) {
            int32_t l[8];
            for (int r = 0; r < 8; r++) l[r] = (int32_t)((uint32_t)(uint16_t)mn[r][2 * p] | ((uint32_t)(uint16_t)mn[r][2 * p + 1] << 16));
            m[p] = _mm256_loadu_si256((const __m256i *)l);
        }
        const __m256 d = kq8_f16x8(rows, i, bs, doff);
        const __m256 dm = with_min ? kq8_f16x8(rows, i, bs, moff) : _mm256_setzero_ps();
        for (int t0 = 0; t0 < nt; t0 += 4) {
            const int U = nt - t0 < 4 ? nt - t0 : 4;
            switch (U) {
            case 4: kq8_many_tokens(w, sgn ? uw : NULL, s, sgn ? NULL : m, d, dm, with_min, sh, i, 4, a + t0, acc + t0); break;
            case 3: kq8_many_tokens(w, sgn ? uw : NULL, s, sgn ? NULL : m, d, dm, with_min, sh, i, 3, a + t0, acc + t0); break;
            case 2: kq8_many_tokens(w, sgn ? uw : NULL, s, sgn ? NULL : m, d, dm, with_min, sh, i, 2, a + t0, acc + t0); break;
            default: kq8_many_tokens(w, sgn ? uw : NULL, s, sgn ? NULL : m, d, dm, with_min, sh, i, 1, a + t0, acc + t0); break;
            }
        }
    }
    for (int t = 0; t < nt; t++) {
        float v[8];
        _mm256_storeu_ps(v, acc[t]);
        for (int r = 0; r < rn; r++) out[t * ldo + r] = v[r];
    }
}

static inline __attribute__((always_inline)) void gemm_kq8(int32_t type, const void *w, size_t row_bytes, int nr,
                                                           int64_t n, int nt, const act_row *a, float *out,
                                                           int64_t ldo) {
    const int64_t nb = n / QK_K;
    for (int r0 = 0; r0 < nr; r0 += 8) {
        const int rn = nr - r0 < 8 ? nr - r0 : 8;
        const uint8_t *rows[8];
        for (int r = 0; r < 8; r++) rows[r] = (const uint8_t *)w + (size_t)(r0 + (r < rn ? r : 0)) * row_bytes;
        if (nt >= (type == ST_TYPE_IQ4_XS ? KQ8_MANY_MIN_IQ4 : KQ8_MANY_MIN)) {
            kq8_many(type, rows, nb, nt, a, out + r0, ldo, rn, (const uint8_t *)w + (size_t)(r0 + 8) * row_bytes);
            continue;
        }
        for (int t0 = 0, NT; t0 < nt; t0 += NT) {
            NT = nt - t0 >= 8 ? 8 : nt - t0 >= 4 ? 4 : nt - t0;
            __m256 acc[KQ8_TP];
            switch (NT) {
            case 1: kq8_pass(type, rows, nb, 1, a + t0, acc); break;
            case 2: kq8_pass(type, rows, nb, 2, a + t0, acc); break;
            case 3: kq8_pass(type, rows, nb, 3, a + t0, acc); break;
            case 4: kq8_pass(type, rows, nb, 4, a + t0, acc); break;
            default: kq8_pass(type, rows, nb, 8, a + t0, acc); break;
            }
            for (int t = 0; t < NT; t++) {
                float v[8];
                _mm256_storeu_ps(v, acc[t]);
                for (int r = 0; r < rn; r++) out[(t0 + t) * ldo + r0 + r] = v[r];
            }
        }
    }
}

/* One dot_q_fn per type: the type a constant, so each instance folds its branches. */
#define DEF_GEMM_KQ8(name, TYPE)                                                                             \
    static void name(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, float *out, \
                     int64_t ldo) {                                                                          \
        gemm_kq8(TYPE, w, row_bytes, nr, n, nt, a, out, ldo);                                                \
    }
DEF_GEMM_KQ8(gemm_kq8_q6_k, ST_TYPE_Q6_K)
DEF_GEMM_KQ8(gemm_kq8_q2_k, ST_TYPE_Q2_K)
DEF_GEMM_KQ8(gemm_kq8_q3_k, ST_TYPE_Q3_K)
DEF_GEMM_KQ8(gemm_kq8_iq4_xs, ST_TYPE_IQ4_XS)

static dot_q_fn gemm_kq8_pick(int32_t type) {
    switch (type) {
    case ST_TYPE_Q6_K: return gemm_kq8_q6_k;
    case ST_TYPE_Q2_K: return gemm_kq8_q2_k;
    case ST_TYPE_Q3_K: return gemm_kq8_q3_k;
    case ST_TYPE_IQ4_XS: return gemm_kq8_iq4_xs;
    default: return NULL;
    }
}

/* The per-256 quantiser (st_quantize_act_k_row) with the per-32 one's vector operations: the same
 * bytes and floats. */
static inline void quant_act_k_avx2_impl(const float *x, int64_t n, int8_t *qs, float *d, int16_t *bsums) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < n / QK_K; b++) {
        const float *xb = x + b * QK_K;
        __m256 mx = _mm256_setzero_ps();
        for (int k = 0; k < 32; k++) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * k)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float db = _mm_cvtss_f32(m4) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        for (int c = 0; c < 8; c++) { /* 32 values: two 16-sums */
            __m256i q[4];
            for (int k = 0; k < 4; k++) {
                const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xb + 32 * c + 8 * k), _mm256_set1_ps(id));
                const __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
                const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(s, t)), half, _CMP_GE_OQ);
                q[k] = _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(sign, s)))));
            }
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(qs + b * QK_K + 32 * c), _mm256_permutevar8x32_epi32(p, order));
            const __m256i h0 = _mm256_add_epi32(q[0], q[1]), h1 = _mm256_add_epi32(q[2], q[3]);
            /* lanes: [h0 sums of 0..3 | 4..7] -> the two 16-sums */
            const __m256i hh = _mm256_hadd_epi32(h0, h1); /* [h0 01, h0 23, h1 01, h1 23 | h0 45, h0 67, ...] */
            const __m256i h2 = _mm256_hadd_epi32(hh, hh); /* [h0 0123, h1 0123, .. | h0 4567, h1 4567, ..] */
            const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(h2), _mm256_extracti128_si256(h2, 1));
            bsums[b * 16 + 2 * c] = (int16_t)_mm_cvtsi128_si32(sums);
            bsums[b * 16 + 2 * c + 1] = (int16_t)_mm_extract_epi32(sums, 1);
        }
    }
}

#endif
