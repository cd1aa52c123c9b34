/* The IQ types' SIMD kernel on 256-bit vectors (quants_iq.h has the integer form of a weight).
 * Included by kernels_avx2.c and kernels_avx512.c after gemm_int8.h, under each file's
 * `#pragma GCC target`, so each variant gets its own static copy compiled for its ISA.
 *
 * Per weight row and 32-element block the codebook is looked up once into two registers:
 *   g   32 unsigned grid magnitudes (<= 62): each group's 8 (IQ2: one 64-bit entry) or 4 (IQ3:
 *       one 32-bit entry) bytes, loaded by index from the generated tables (scalar loads: AVX2
 *       gathers measured slower at one token on the Zen 4 box, and on the Zen 3 one for IQ2_S,
 *       a third slower);
 *   sg  32 signs as bytes +1 / -1, from the block's four sign bytes by one shuffle and compare;
 *       IQ2_S and IQ3_S store those bytes, the ksigns types (IQ2_XXS, IQ2_XS, IQ3_XXS) a 7-bit
 *       index per byte whose 8th bit is the parity, computed for a whole super-block at once
 *       (iq_sign_bytes) instead of a table load per group.
 * The activations are the per-256 view (act_row.qk, one scale dk per super-block, st_type_q8k), as
 * llama.cpp's IQ vec_dots take Q8_K. Per token the activations take the signs (sign_epi8) and are
 * multiplied with g into 32-bit sums of 4 (maddubs + madd; vpdpbusd on the VNNI variant):
 * |g * a| <= 62 * 127, a pair < 2^15, so the sums are exact. Four rows' sums are reduced to one
 * vector of (row, half) lanes - lanes 0..3 rows 0..3 elements 0..15, lanes 4..7 the same rows'
 * elements 16..31 - multiplied by the lane's integer sub-scale k (iq_scales4, once per
 * super-block) and summed in integers over the super-block (|sum| < 2^26); then each row's two
 * halves are added and the reference's one float step per super-block taken,
 * acc += dk * ((d * F) * isum). The operations on a lane depend only on its row and token, so any
 * number of rows or tokens gives the reference's bits (the harness checks it). IQ2_S, IQ3_XXS and
 * IQ2_XXS at one token on AVX2 take their own paths with the same integers (iq2s_rows4_1,
 * iq_xxs_rows4_1). */
#ifndef STRATA_GEMM_IQ_H
#define STRATA_GEMM_IQ_H

#include "gemm_int8.h"
#include "iq_grids.h"
#include "quants_iq.h"

#define IQ_MR 4

/* 32 sign bits -> 32 bytes: -1 where the bit is set, 0 where not (a blendv mask). */
static inline __m256i iq_sign_mask(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                          3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

/* 32 sign bits -> 32 bytes: -1 where the bit is set, +1 where not. */
static inline __m256i iq_signs_from_bits(uint32_t bits) {
    return _mm256_or_si256(iq_sign_mask(bits), _mm256_set1_epi8(1));
}

/* Types whose signs are 7-bit indices into ksigns. */
static inline int iq_ksign_type(int32_t type) {
    return type == ST_TYPE_IQ2_XXS || type == ST_TYPE_IQ2_XS || type == ST_TYPE_IQ3_XXS;
}

/* The 32 sign bytes of super-block x of a ksigns type (byte j: group j of 8 elements, bit k set =
 * element k negated), all at once: the 7-bit indices gathered into bytes, the 8th bit their
 * parity (what ksigns holds). Per block the kernel then expands 4 of them as IQ2_S / IQ3_S do. */
static inline __attribute__((always_inline)) void iq_sign_bytes(int32_t type, const uint8_t *x, uint8_t *sb) {
    __m256i v;
    if (type == ST_TYPE_IQ2_XS) { /* index = word >> 9 */
        const __m256i a = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(x + 2)), 9);
        const __m256i b = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(x + 34)), 9);
        v = _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8);
    } else { /* four indices of 7 bits per 32-bit word, one word per block */
        __m256i aux;
        if (type == ST_TYPE_IQ3_XXS) {
            aux = _mm256_loadu_si256((const __m256i *)(x + 2 + QK_K / 4));
        } else { /* IQ2_XXS: the odd words of the 64 code bytes */
            const __m256 a0 = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(x + 2)));
            const __m256 a1 = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(x + 34)));
            aux = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a0, a1, 0xDD)), 0xD8);
        }
        const __m256i m7 = _mm256_set1_epi32(127);
        const __m256i s0 = _mm256_and_si256(aux, m7);
        const __m256i s1 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(aux, 7), m7), 8);
        const __m256i s2 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(aux, 14), m7), 16);
        const __m256i s3 = _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(aux, 21), m7), 24);
        v = _mm256_or_si256(_mm256_or_si256(s0, s1), _mm256_or_si256(s2, s3));
    }
    __m256i t = _mm256_xor_si256(v, _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)));
    t = _mm256_xor_si256(t, _mm256_and_si256(_mm256_srli_epi16(t, 2), _mm256_set1_epi8(0x03)));
    t = _mm256_xor_si256(t, _mm256_and_si256(_mm256_srli_epi16(t, 1), _mm256_set1_epi8(0x01)));
    v = _mm256_or_si256(v, _mm256_slli_epi16(_mm256_and_si256(t, _mm256_set1_epi8(0x01)), 7));
    _mm256_storeu_si256((__m256i *)sb, v);
}

typedef struct {
    __m256i g;
#if GEMM_VNNI
    uint32_t sbits; /* the 32 sign bits: AVX-512 negates the activations under this mask */
#else
    __m256i sg; /* the signs as bytes +1 / -1 (iq_signs_from_bits), for sign_epi8 */
#endif
} iq_sub;

static inline __attribute__((always_inline)) void iq_set_signs(iq_sub *s, uint32_t bits) {
#if GEMM_VNNI
    s->sbits = bits;
#else
    s->sg = iq_signs_from_bits(bits);
#endif
}

/* The activations av with the signs of s applied: -a where the sign bit is set. The masked
 * subtraction (AVX-512) and sign_epi8 by +1 / -1 give the same bytes (0 - (-128) wraps as
 * sign_epi8 does). */
static inline __attribute__((always_inline)) __m256i iq_signed(const iq_sub *s, __m256i av) {
#if GEMM_VNNI
    return _mm256_mask_sub_epi8(av, (__mmask32)s->sbits, _mm256_setzero_si256(), av);
#else
    return _mm256_sign_epi8(av, s->sg);
#endif
}

/* The grid indices of super-block x of a type whose indices are not plain bytes (IQ2_XS: 32 of
 * 9 bits in 16-bit words; IQ2_S: 32 of 10 bits, IQ3_S: 64 of 9 bits, high bits from qh), all at
 * once into ix. */
static inline __attribute__((always_inline)) void iq_indices(int32_t type, const uint8_t *x, uint16_t *ix) {
    if (type == ST_TYPE_IQ3_S) { /* index g: qs[g] | bit g of qh << 8 */
        const blk_iq3_s *b = (const blk_iq3_s *)x;
        const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                              (short)-32768);
        for (int k = 0; k < 4; k++) {
            const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b->qs + 16 * k)));
            const __m256i h = _mm256_set1_epi16((short)(b->qh[2 * k] | (b->qh[2 * k + 1] << 8)));
            const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(h, bit), bit);
            _mm256_storeu_si256((__m256i *)(ix + 16 * k), _mm256_or_si256(lo, _mm256_and_si256(set, _mm256_set1_epi16(256))));
        }
        return;
    }
    if (type == ST_TYPE_IQ2_XS) { /* index g: the low 9 bits of word g */
        const __m256i m9 = _mm256_set1_epi16(511);
        for (int k = 0; k < 2; k++)
            _mm256_storeu_si256((__m256i *)(ix + 16 * k),
                                _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + 2 + 32 * k)), m9));
        return;
    }
    /* IQ2_S, index g: qs[g] | (qh[g / 4] >> 2 (g % 4) & 3) << 8. Word g takes byte qh[g / 4] (one
     * shuffle of the eight qh bytes), times 2^(8 - 2 (g % 4)) its two bits sit at bits 8..9. */
    const blk_iq2_s *b = (const blk_iq2_s *)x;
    const __m256i qh = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)b->qh));
    const __m256i mul = _mm256_setr_epi16(256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4, 256, 64, 16, 4);
    const __m256i m = _mm256_set1_epi16(0x300);
    for (int k = 0; k < 2; k++) {
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b->qs + 16 * k)));
        const __m256i sel = _mm256_setr_epi8(4 * k, -1, 4 * k, -1, 4 * k, -1, 4 * k, -1, 4 * k + 1, -1, 4 * k + 1, -1,
                                             4 * k + 1, -1, 4 * k + 1, -1, 4 * k + 2, -1, 4 * k + 2, -1, 4 * k + 2, -1,
                                             4 * k + 2, -1, 4 * k + 3, -1, 4 * k + 3, -1, 4 * k + 3, -1, 4 * k + 3, -1);
        const __m256i h = _mm256_and_si256(_mm256_mullo_epi16(_mm256_shuffle_epi8(qh, sel), mul), m);
        _mm256_storeu_si256((__m256i *)(ix + 16 * k), _mm256_or_si256(lo, h));
    }
}

/* Block ib (0..7) of super-block x of an IQ type; sb: its sign bytes (iq_sign_bytes) for the
 * ksigns types, ix: its grid indices (iq_indices) for IQ2_S and IQ3_S. */
static inline __attribute__((always_inline)) void iq_load_sub(int32_t type, const uint8_t *x, const uint8_t *sb,
                                                              const uint16_t *ix, int ib, iq_sub *s) {
    switch (type) {
    case ST_TYPE_IQ2_XXS: {
        const uint8_t *q = x + 2 + 8 * ib;
        s->g = _mm256_set_epi64x((long long)iq2xxs_grid[q[3]], (long long)iq2xxs_grid[q[2]],
                                 (long long)iq2xxs_grid[q[1]], (long long)iq2xxs_grid[q[0]]);
        iq_set_signs(s, ld32(sb + 4 * ib));
        break;
    }
    case ST_TYPE_IQ2_XS: {
        const uint16_t *q = ix + 4 * ib;
        s->g = _mm256_set_epi64x((long long)iq2xs_grid[q[3]], (long long)iq2xs_grid[q[2]], (long long)iq2xs_grid[q[1]],
                                 (long long)iq2xs_grid[q[0]]);
        iq_set_signs(s, ld32(sb + 4 * ib));
        break;
    }
    case ST_TYPE_IQ2_S: {
        const blk_iq2_s *b = (const blk_iq2_s *)x;
        const uint16_t *q = ix + 4 * ib;
        s->g = _mm256_set_epi64x((long long)iq2s_grid[q[3]], (long long)iq2s_grid[q[2]], (long long)iq2s_grid[q[1]],
                                 (long long)iq2s_grid[q[0]]);
        iq_set_signs(s, ld32(b->qs + QK_K / 8 + 4 * ib));
        break;
    }
    case ST_TYPE_IQ3_XXS: {
        /* the eight entries paired into four 64-bit words in general registers, then four
         * inserts (eight 32-bit inserts had kept the shuffle ports busiest at one token) */
        const uint8_t *q = x + 2 + 8 * ib;
        const uint64_t g01 = iq3xxs_grid[q[0]] | (uint64_t)iq3xxs_grid[q[1]] << 32;
        const uint64_t g23 = iq3xxs_grid[q[2]] | (uint64_t)iq3xxs_grid[q[3]] << 32;
        const uint64_t g45 = iq3xxs_grid[q[4]] | (uint64_t)iq3xxs_grid[q[5]] << 32;
        const uint64_t g67 = iq3xxs_grid[q[6]] | (uint64_t)iq3xxs_grid[q[7]] << 32;
        s->g = _mm256_set_epi64x((long long)g67, (long long)g45, (long long)g23, (long long)g01);
        iq_set_signs(s, ld32(sb + 4 * ib));
        break;
    }
    default: { /* ST_TYPE_IQ3_S */
        const blk_iq3_s *b = (const blk_iq3_s *)x;
        const uint16_t *q = ix + 8 * ib;
        s->g = _mm256_set_epi32((int)iq3s_grid[q[7]], (int)iq3s_grid[q[6]], (int)iq3s_grid[q[5]], (int)iq3s_grid[q[4]],
                                (int)iq3s_grid[q[3]], (int)iq3s_grid[q[2]], (int)iq3s_grid[q[1]], (int)iq3s_grid[q[0]]);
        iq_set_signs(s, ld32(b->signs + 4 * ib));
        break;
    }
    }
}

static inline float iq_factor(int32_t type) {
    return type == ST_TYPE_IQ3_S ? 1.0f : type == ST_TYPE_IQ3_XXS ? 0.25f : 0.125f;
}

/* The integer sub-scales k = 2 ls + 1 of each (row, half) lane of the four rows' blocks ib = 0..7
 * of super-block i (k[ib] lane r: elements 0..15 of row r, lane 4 + r: 16..31), and d * F of each
 * row (lanes r and 4 + r; exact: d has 11 significant bits, F is a power of two). Taken once per
 * super-block, so the blocks themselves unpack only codes and signs. */
typedef struct {
    __m256i k[8];
    __m256 df;
} iq_scales;

/* The integer sub-scales k of blocks ib = 0..7 of one row's super-block x as int32 lanes ib: lo
 * for elements 0..15 of each block, hi for 16..31. */
static inline __attribute__((always_inline)) void iq_kvals(int32_t type, const uint8_t *x, __m256i *lo, __m256i *hi) {
    switch (type) {
    case ST_TYPE_IQ2_XXS: { /* the top 4 bits of the odd words of the 64 code bytes */
        const __m256 a0 = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(x + 2)));
        const __m256 a1 = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(x + 34)));
        *lo = *hi = _mm256_srli_epi32(_mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a0, a1, 0xDD)), 0xD8), 28);
        return;
    }
    case ST_TYPE_IQ3_XXS: /* the top 4 bits of each block's sign word */
        *lo = *hi = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(x + 2 + QK_K / 4)), 28);
        return;
    case ST_TYPE_IQ2_XS:
    case ST_TYPE_IQ2_S: { /* one byte per block: low nibble, high nibble */
        const size_t off = type == ST_TYPE_IQ2_XS ? offsetof(blk_iq2_xs, scales) : offsetof(blk_iq2_s, scales);
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(x + off)));
        *lo = _mm256_and_si256(v, _mm256_set1_epi32(0xF)), *hi = _mm256_srli_epi32(v, 4);
        return;
    }
    default: { /* IQ3_S: nibble ib % 2 of byte ib / 2, both halves */
        const __m256i v = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)ld32(x + offsetof(blk_iq3_s, scales))),
                                                                _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1)));
        *lo = *hi = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)), _mm256_set1_epi32(0xF));
        return;
    }
    }
}

static inline __attribute__((always_inline)) void iq_scales4(int32_t type, const uint8_t *const *rows, int64_t i,
                                                             size_t bb, iq_scales *S) {
    /* The four rows at once: each row's k of blocks 0..7 as int32 lanes, an 8x8 dword transpose of
     * [lo rows 0..3, hi rows 0..3] gives block ib's (row, half) lanes. */
    const float f = iq_factor(type);
    __m256i v[8];
    float df[IQ_MR];
    for (int r = 0; r < IQ_MR; r++) {
        const uint8_t *x = rows[r] + (size_t)i * bb;
        df[r] = h2f((f16_t)(x[0] | (x[1] << 8))) * f;
        iq_kvals(type, x, &v[r], &v[IQ_MR + r]);
    }
    transpose8x8_epi32(v);
    S->df = _mm256_setr_ps(df[0], df[1], df[2], df[3], df[0], df[1], df[2], df[3]);
    const __m256i one = _mm256_set1_epi32(1);
    for (int ib = 0; ib < 8; ib++) S->k[ib] = _mm256_add_epi32(_mm256_slli_epi32(v[ib], 1), one);
}

/* The four rows' k * g * sign * qa sums of one block against one token, as (row, half) lanes. */
static inline __attribute__((always_inline)) __m256i iq_sums4(const iq_sub *s, const int8_t *q) {
    const __m256i av = _mm256_loadu_si256((const __m256i *)q);
    __m256i p[IQ_MR];
    for (int r = 0; r < IQ_MR; r++) p[r] = dot4(s[r].g, iq_signed(&s[r], av));
    const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));
    const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
}

#if !GEMM_VNNI
/* IQ2_S at one token (AVX2). There the kernel is bound by load-port and dispatch slots, not by
 * the multiplies (Zen 3), so per row and block it spends as few of both as it can:
 *  - each row keeps its own int32 sums over the super-block: its maddubs pairs are widened by one
 *    madd whose operand is the block's sub-scales [k(lo) x 8 | k(hi) x 8] as int16 lanes, read
 *    from iq2s_kpair by the block's scale byte with the madd, so neither iq_rows4's reduction
 *    across rows and multiply per block nor its sub-scale transpose per super-block is needed;
 *    the four rows' sums are reduced once per super-block;
 *  - the signs are one blend between the token's activations and their negation (computed once
 *    per block for the four rows; 0 - (-128) wraps as sign_epi8 does), by a mask of the sign bits;
 *  - the grid indices (iq_indices, per super-block) are read two per 32-bit load.
 * A madd lane is k times four products (|.| <= 31 * 4 * 62 * 127 < 2^20) and a super-block sums
 * eight (< 2^23): exact, the integers iq_rows4 sums, so the same bits. */
#define IQ2S_K8(v) v, v, v, v, v, v, v, v
#define IQ2S_KE(s) {IQ2S_K8(2 * ((s) & 15) + 1), IQ2S_K8(2 * ((s) >> 4) + 1)}
#define IQ2S_KE4(s) IQ2S_KE(s), IQ2S_KE((s) + 1), IQ2S_KE((s) + 2), IQ2S_KE((s) + 3)
#define IQ2S_KE16(s) IQ2S_KE4(s), IQ2S_KE4((s) + 4), IQ2S_KE4((s) + 8), IQ2S_KE4((s) + 12)
#define IQ2S_KE64(s) IQ2S_KE16(s), IQ2S_KE16((s) + 16), IQ2S_KE16((s) + 32), IQ2S_KE16((s) + 48)
static const int16_t iq2s_kpair[256][16] __attribute__((aligned(32))) = {IQ2S_KE64(0), IQ2S_KE64(64), IQ2S_KE64(128),
                                                                          IQ2S_KE64(192)};

/* The one-token loops' end of a super-block: the four rows' int32 lanes summed per row (lanes 0-3 and
 * again 4-7 hold rows 0-3), scaled by each row's super-block scale and the token's, added to acc. */
static inline __attribute__((always_inline)) __m256 iq_rows4_add_superblock(__m256 acc, const __m256i s[IQ_MR],
                                                                           const float df[IQ_MR], float dk) {
    const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(s[0], s[1]), _mm256_unpackhi_epi32(s[0], s[1]));
    const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(s[2], s[3]), _mm256_unpackhi_epi32(s[2], s[3]));
    const __m256i h = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
    const __m256i tot = _mm256_add_epi32(h, _mm256_permute2x128_si256(h, h, 0x01));
    const __m256 dfv = _mm256_setr_ps(df[0], df[1], df[2], df[3], df[0], df[1], df[2], df[3]);
    const __m256 xv = _mm256_mul_ps(dfv, _mm256_cvtepi32_ps(tot));
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_set1_ps(dk), xv));
}

static inline __attribute__((always_inline)) void iq2s_rows4_1(const uint8_t *const *rows, size_t bb, int64_t nb,
                                                               const act_row *a, float *out, int nr,
                                                               const uint8_t *next) {
    __m256 acc = _mm256_setzero_ps();
    uint16_t ix[IQ_MR][32];
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *x[IQ_MR];
        float df[IQ_MR];
        for (int r = 0; r < IQ_MR; r++) {
            x[r] = rows[r] + (size_t)i * bb;
            df[r] = h2f((f16_t)(x[r][0] | (x[r][1] << 8))) * 0.125f;
            iq_indices(ST_TYPE_IQ2_S, x[r], ix[r]);
        }
        __m256i s[IQ_MR];
        for (int r = 0; r < IQ_MR; r++) s[r] = _mm256_setzero_si256();
        prefetch_slice(next, i, IQ_MR * bb);
        for (int ib = 0; ib < 8; ib++) {
            const int64_t b = 8 * i + ib;
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a->qk + b * QK));
            const __m256i nav = _mm256_sub_epi8(_mm256_setzero_si256(), av);
            for (int r = 0; r < IQ_MR; r++) { /* one 32-bit load per two indices: a load each had cost more */
                uint32_t q01, q23;
                memcpy(&q01, ix[r] + 4 * ib, 4);
                memcpy(&q23, ix[r] + 4 * ib + 2, 4);
                const __m256i g = _mm256_set_epi64x((long long)iq2s_grid[q23 >> 16], (long long)iq2s_grid[q23 & 0xFFFF],
                                                    (long long)iq2s_grid[q01 >> 16], (long long)iq2s_grid[q01 & 0xFFFF]);
                const __m256i neg = iq_sign_mask(ld32(x[r] + offsetof(blk_iq2_s, qs) + QK_K / 8 + 4 * ib));
                const __m256i p = _mm256_maddubs_epi16(g, _mm256_blendv_epi8(av, nav, neg));
                const __m256i k = _mm256_load_si256((const __m256i *)iq2s_kpair[x[r][offsetof(blk_iq2_s, scales) + ib]]);
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, k));
            }
        }
        acc = iq_rows4_add_superblock(acc, s, df, a->dk[i]);
    }
    float v[8];
    _mm256_storeu_ps(v, acc);
    for (int r = 0; r < nr; r++) out[r] = v[r];
}

/* IQ3_XXS and IQ2_XXS at one token (AVX2), the same plan as iq2s_rows4_1: per-row int32 sums, each
 * block's maddubs pairs widened by one madd with its sub-scale k = 2 ls + 1 as int16 lanes (iq3xxs_k,
 * read by the top nibble of the block's sign word), signs by blendv against the once-negated
 * activations (the sign bytes from iq_sign_bytes once per super-block), a block's grid indices read by
 * one load (IQ3_XXS: 8 in 64 bits, IQ2_XXS: 4 in 32) and their entries put together by unpacks
 * (iq3xxs_grid4; on IQ3_XXS iq_load_sub's pairs in general registers measured slower here, as did a
 * load per index or sub-scales by pshufb from a register), one prefetch pass per super-block. A madd
 * lane is k times four products (|.| <= 31 * 4 * 62 * 127 < 2^20) and a super-block sums eight:
 * exact, iq_rows4's integers. */
#define IQ3XXS_K16(v) {v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}
static const int16_t iq3xxs_k[16][16] __attribute__((aligned(32))) = {
    IQ3XXS_K16(1),  IQ3XXS_K16(3),  IQ3XXS_K16(5),  IQ3XXS_K16(7),  IQ3XXS_K16(9),  IQ3XXS_K16(11),
    IQ3XXS_K16(13), IQ3XXS_K16(15), IQ3XXS_K16(17), IQ3XXS_K16(19), IQ3XXS_K16(21), IQ3XXS_K16(23),
    IQ3XXS_K16(25), IQ3XXS_K16(27), IQ3XXS_K16(29), IQ3XXS_K16(31)};

/* The four grid entries of the indices in the bytes of w, one 32-bit load each, as one vector. */
static inline __attribute__((always_inline)) __m128i iq3xxs_grid4(uint32_t w) {
    const __m128i g0 = _mm_cvtsi32_si128((int)iq3xxs_grid[w & 0xFF]), g1 = _mm_cvtsi32_si128((int)iq3xxs_grid[(w >> 8) & 0xFF]);
    const __m128i g2 = _mm_cvtsi32_si128((int)iq3xxs_grid[(w >> 16) & 0xFF]), g3 = _mm_cvtsi32_si128((int)iq3xxs_grid[w >> 24]);
    return _mm_unpacklo_epi64(_mm_unpacklo_epi32(g0, g1), _mm_unpacklo_epi32(g2, g3));
}

static inline __attribute__((always_inline)) void iq_xxs_rows4_1(int32_t type, const uint8_t *const *rows, size_t bb,
                                                                 int64_t nb, const act_row *a, float *out, int nr,
                                                                 const uint8_t *next) {
    const int iq3 = type == ST_TYPE_IQ3_XXS;
    __m256 acc = _mm256_setzero_ps();
    uint8_t sb[IQ_MR][32];
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *x[IQ_MR];
        float df[IQ_MR];
        for (int r = 0; r < IQ_MR; r++) {
            x[r] = rows[r] + (size_t)i * bb;
            df[r] = h2f((f16_t)(x[r][0] | (x[r][1] << 8))) * (iq3 ? 0.25f : 0.125f);
            iq_sign_bytes(type, x[r], sb[r]);
        }
        __m256i s[IQ_MR];
        for (int r = 0; r < IQ_MR; r++) s[r] = _mm256_setzero_si256();
        prefetch_slice(next, i, IQ_MR * bb);
        for (int ib = 0; ib < 8; ib++) {
            const int64_t b = 8 * i + ib;
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a->qk + b * QK));
            const __m256i nav = _mm256_sub_epi8(_mm256_setzero_si256(), av);
            for (int r = 0; r < IQ_MR; r++) {
                __m256i g;
                if (iq3) {
                    uint64_t w;
                    memcpy(&w, x[r] + 2 + 8 * ib, 8);
                    g = _mm256_inserti128_si256(_mm256_castsi128_si256(iq3xxs_grid4((uint32_t)w)),
                                                iq3xxs_grid4((uint32_t)(w >> 32)), 1);
                } else {
                    const uint32_t w = ld32(x[r] + 2 + 8 * ib);
                    const __m128i lo = _mm_unpacklo_epi64(_mm_cvtsi64_si128((long long)iq2xxs_grid[w & 0xFF]),
                                                          _mm_cvtsi64_si128((long long)iq2xxs_grid[(w >> 8) & 0xFF]));
                    const __m128i hi = _mm_unpacklo_epi64(_mm_cvtsi64_si128((long long)iq2xxs_grid[(w >> 16) & 0xFF]),
                                                          _mm_cvtsi64_si128((long long)iq2xxs_grid[w >> 24]));
                    g = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
                }
                const __m256i neg = iq_sign_mask(ld32(sb[r] + 4 * ib));
                const __m256i p = _mm256_maddubs_epi16(g, _mm256_blendv_epi8(av, nav, neg));
                /* entry ls sits at byte 32 ls = 2 (scale byte & 0xF0): one and, no shifts */
                const __m256i k = _mm256_load_si256(
                    (const __m256i *)((const uint8_t *)iq3xxs_k + 2 * (x[r][iq3 ? 2 + QK_K / 4 + 4 * ib + 3 : 2 + 8 * ib + 7] & 0xF0)));
                s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, k));
            }
        }
        acc = iq_rows4_add_superblock(acc, s, df, a->dk[i]);
    }
    float v[8];
    _mm256_storeu_ps(v, acc);
    for (int r = 0; r < nr; r++) out[r] = v[r];
}
#endif

/* Four rows (a short block repeats its last row; its results are dropped) against nt tokens;
 * NT > 0 fixes the token count at compile time (the accumulators then stay in registers). Per
 * token the (row, half) lanes of a block, times k, are summed in integers over the super-block;
 * then the two halves of each row are added and the reference's float step taken once:
 * acc += dk * (d * F * isum). */
static inline __attribute__((always_inline)) void iq_rows4(int32_t type, const uint8_t *const *rows, size_t bb,
                                                           int64_t nb, int NT, int nt, const act_row *a, float *out,
                                                           int nr, int64_t ldo, const uint8_t *next) {
#if !GEMM_VNNI
    if (type == ST_TYPE_IQ2_S && NT == 1) {
        iq2s_rows4_1(rows, bb, nb, a, out, nr, next);
        return;
    }
    if ((type == ST_TYPE_IQ3_XXS || type == ST_TYPE_IQ2_XXS) && NT == 1) {
        iq_xxs_rows4_1(type, rows, bb, nb, a, out, nr, next);
        return;
    }
#endif
    const int n_tok = NT > 0 ? NT : nt;
    __m256 acc[ST_MAX_NT];
    __m256i isum[ST_MAX_NT];
    for (int t = 0; t < n_tok; t++) acc[t] = _mm256_setzero_ps();
    iq_scales S;
    uint8_t sb[IQ_MR][32];
    uint16_t ix[IQ_MR][64];
    for (int64_t i = 0; i < nb; i++) {
        iq_scales4(type, rows, i, bb, &S);
        for (int r = 0; r < IQ_MR; r++) {
            if (iq_ksign_type(type)) iq_sign_bytes(type, rows[r] + (size_t)i * bb, sb[r]);
            if (type == ST_TYPE_IQ2_XS || type == ST_TYPE_IQ2_S || type == ST_TYPE_IQ3_S)
                iq_indices(type, rows[r] + (size_t)i * bb, ix[r]);
        }
        for (int t = 0; t < n_tok; t++) isum[t] = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const int64_t b = 8 * i + ib;
            prefetch_slice(next, b, IQ_MR * bb / 8);
            iq_sub s[IQ_MR];
            for (int r = 0; r < IQ_MR; r++) iq_load_sub(type, rows[r] + (size_t)i * bb, sb[r], ix[r], ib, &s[r]);
            for (int t = 0; t < n_tok; t++)
                isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(iq_sums4(s, a[t].qk + b * QK), S.k[ib]));
        }
        for (int t = 0; t < n_tok; t++) {
            const __m256i tot = _mm256_add_epi32(isum[t], _mm256_permute2x128_si256(isum[t], isum[t], 0x01));
            const __m256 x = _mm256_mul_ps(S.df, _mm256_cvtepi32_ps(tot));
            acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_broadcast_ss(a[t].dk + i), x));
        }
    }
    for (int t = 0; t < n_tok; t++) {
        float v[8];
        _mm256_storeu_ps(v, acc[t]);
        for (int r = 0; r < nr; r++) out[t * ldo + r] = v[r];
    }
}

static inline __attribute__((always_inline)) void gemm_iq(int32_t type, const void *w, size_t row_bytes, int nr,
                                                          int64_t n, int nt, const act_row *a, float *out,
                                                          int64_t ldo) {
    const int64_t nb = n / QK_K;
    const size_t bb = (size_t)st_iq_block_bytes(type);
    for (int r0 = 0; r0 < nr; r0 += IQ_MR) {
        const int nrr = nr - r0 < IQ_MR ? nr - r0 : IQ_MR;
        const uint8_t *rows[IQ_MR];
        for (int r = 0; r < IQ_MR; r++) rows[r] = (const uint8_t *)w + (size_t)(r0 + (r < nrr ? r : nrr - 1)) * row_bytes;
        const uint8_t *next = (const uint8_t *)w + (size_t)(r0 + IQ_MR) * row_bytes;
        float *o = out + r0;
        switch (nt) {
        case 1: iq_rows4(type, rows, bb, nb, 1, 1, a, o, nrr, ldo, next); break;
        case 2: iq_rows4(type, rows, bb, nb, 2, 2, a, o, nrr, ldo, next); break;
        case 3: iq_rows4(type, rows, bb, nb, 3, 3, a, o, nrr, ldo, next); break;
        case 4: iq_rows4(type, rows, bb, nb, 4, 4, a, o, nrr, ldo, next); break;
        default: iq_rows4(type, rows, bb, nb, 0, nt, a, o, nrr, ldo, next); break;
        }
    }
}

#define DEF_GEMM_IQ(NAME, TYPE)                                                                               \
    static void NAME(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, float *out, \
                     int64_t ldo) {                                                                            \
        gemm_iq(TYPE, w, row_bytes, nr, n, nt, a, out, ldo);                                                   \
    }

DEF_GEMM_IQ(gemm_iq2_xxs, ST_TYPE_IQ2_XXS)
DEF_GEMM_IQ(gemm_iq2_xs, ST_TYPE_IQ2_XS)
DEF_GEMM_IQ(gemm_iq2_s, ST_TYPE_IQ2_S)
DEF_GEMM_IQ(gemm_iq3_xxs, ST_TYPE_IQ3_XXS)
DEF_GEMM_IQ(gemm_iq3_s, ST_TYPE_IQ3_S)

static dot_q_fn gemm_iq_pick(int32_t type) {
    switch (type) {
    case ST_TYPE_IQ2_XXS: return gemm_iq2_xxs;
    case ST_TYPE_IQ2_XS: return gemm_iq2_xs;
    case ST_TYPE_IQ2_S: return gemm_iq2_s;
    case ST_TYPE_IQ3_XXS: return gemm_iq3_xxs;
    case ST_TYPE_IQ3_S: return gemm_iq3_s;
    default: return NULL;
    }
}

#endif
