/* The register-blocked int8 micro-kernel on 256-bit vectors, shared by the AVX2 variant
 * (maddubs + madd) and the AVX-512 VNNI variant (vpdpbusd on 256-bit registers, AVX512VL).
 * Included after a `#pragma GCC target(...)` with GEMM_VNNI set to 0 or 1; each including
 * file gets its own static copy compiled for its ISA. The integer sums are exact on both
 * paths and the float operations are the same, so the two variants give the same bits. */
#ifndef STRATA_GEMM_INT8_H
#define STRATA_GEMM_INT8_H

#include "simd_unpack.h"

/* ---- the register-blocked int8 micro-kernel ----
 * MR = 4 weight rows x up to 4 tokens per pass. For one 32-element block b the four rows'
 * unsigned codes sit in four registers (blk4); per token, four maddubs+madd products are
 * reduced by two hadd levels to one vector whose lanes are (row, half-block):
 *   lanes 0..3 = rows 0..3, elements 0..15;  lanes 4..7 = rows 0..3, elements 16..31,
 * converted once, scaled by s(row, half) * d(token, b) and accumulated, then the offset /
 * minimum correction c(row, half) * xs8(token, b) is added to the same lanes. A (row,
 * token) result is lane r + lane 4+r at the end. The operations on one lane depend only on
 * that row and that token, so any number of rows or tokens gives the same bits. */
#define MR 4
/* Token count from which the (row, half) lane types (Q5_0, Q5_1, Q5_K, Q8_0, Q6_K) unpack
 * 8-row blocks once and share them (buffered8); they unpack row by row, which pays from 5. The
 * Q4 types take the one-lane path further down, with its own switch point. */
#define BUF_MIN 5

/* Software prefetch of the next register block of rows. A work tile's rows are consecutive
 * in memory, so the rows after the current block are the next bytes of one linear stream;
 * each pass over a block asks for the matching slice of the next one (`step` bytes per
 * 32-element block), one request per cache line. Rows are short here (360-960 bytes for the
 * default model's experts), too short for a prefetch along each row to run ahead of the
 * hardware: on a 144 MB Q4_1 stream this took one thread from 9.5 to 13.4 GMAC/s at one
 * token (Xeon; 7.0 -> 7.6 GB/s on the Zen 3 VM under load). Prefetches never fault, so
 * running past the tile or the tensor is harmless. */
static inline __attribute__((always_inline)) void prefetch_slice(const uint8_t *next, int64_t b, size_t step) {
    const uintptr_t lo = (uintptr_t)(next + (size_t)b * step), hi = lo + step;
    for (uintptr_t p = (lo + 63) & ~(uintptr_t)63; p < hi; p += 64) _mm_prefetch((const char *)p, _MM_HINT_T0);
}

typedef struct {
    __m256i u[MR]; /* unsigned codes (Q8_0: |w|) */
    __m256i sg[MR]; /* Q8_0 only: the signed weights, for sign(a, w) */
    __m256 s, c;   /* scale and correction per (row, half) lane */
} blk4;

/* Scale (s) and correction (c = m - off * s) lanes of the four rows' sub-blocks of one
 * K-quant super-block, unpacked once per row block and super-block: [j][lane]. */
typedef struct {
    float s[8][8], c[8][8];
} kscales;

static inline __attribute__((always_inline)) void unpack_kscales(int32_t type, const uint8_t *const *rows, int64_t i,
                                                                 kscales *ks) {
    if (type == ST_TYPE_Q4_K || type == ST_TYPE_Q5_K) {
        /* The four rows at once (the scalar loop had cost as much as the dot itself at one
         * token; one row at a time, still ~40% of it): each row's 16-byte header (d, dmin,
         * 12 scale bytes) is one register, a 4x4 dword transpose gives [d|dmin], u0, u1, u2
         * of the four rows, get_scale_min_k4 runs on those words, and one byte shuffle per
         * sub-block pair then yields [rows 0..3 of sub-block j | of sub-block j + 4]. Per
         * value the same float operations as before: d * sv, -dmin * mv, m - 0 * s. */
        const size_t bsz = type == ST_TYPE_Q4_K ? sizeof(blk_q4_k) : sizeof(blk_q5_k);
        __m128i h[MR];
        for (int r = 0; r < MR; r++) h[r] = _mm_loadu_si128((const __m128i *)(rows[r] + (size_t)i * bsz));
        const __m128i t0 = _mm_unpacklo_epi32(h[0], h[1]), t1 = _mm_unpackhi_epi32(h[0], h[1]);
        const __m128i t2 = _mm_unpacklo_epi32(h[2], h[3]), t3 = _mm_unpackhi_epi32(h[2], h[3]);
        const __m128i dd = _mm_unpacklo_epi64(t0, t2), u0 = _mm_unpackhi_epi64(t0, t2);
        const __m128i u1 = _mm_unpacklo_epi64(t1, t3), u2 = _mm_unpackhi_epi64(t1, t3);
        const __m128i m6 = _mm_set1_epi8(0x3f), m4 = _mm_set1_epi8(0x0f), m2 = _mm_set1_epi8(0x03);
        const __m128i s_lo = _mm_and_si128(u0, m6), m_lo = _mm_and_si128(u1, m6);
        const __m128i s_hi = _mm_or_si128(_mm_and_si128(u2, m4), _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(u0, 6), m2), 4));
        const __m128i m_hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(u2, 4), m4),
                                          _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(u1, 6), m2), 4));
        const __m128i pick_d = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
        const __m128i pick_m = _mm_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
        const __m128 d4 = _mm_cvtph_ps(_mm_shuffle_epi8(dd, pick_d));
        const __m128 nm4 = _mm_xor_ps(_mm_cvtph_ps(_mm_shuffle_epi8(dd, pick_m)), _mm_set1_ps(-0.0f)); /* -dmin */
        const __m256 d8 = _mm256_set_m128(d4, d4), nm8 = _mm256_set_m128(nm4, nm4);
        const __m256i sv = _mm256_set_m128i(s_hi, s_lo), mv = _mm256_set_m128i(m_hi, m_lo);
        for (int j = 0; j < 4; j++) {
            const __m256i pick = _mm256_setr_epi8(j, -1, -1, -1, 4 + j, -1, -1, -1, 8 + j, -1, -1, -1, 12 + j, -1, -1, -1,
                                                  j, -1, -1, -1, 4 + j, -1, -1, -1, 8 + j, -1, -1, -1, 12 + j, -1, -1, -1);
            const __m256 S = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(sv, pick)));
            const __m256 M = _mm256_mul_ps(nm8, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(mv, pick)));
            const __m256 C = _mm256_sub_ps(M, _mm256_mul_ps(_mm256_setzero_ps(), S)); /* m - 0 * s, as the other types */
            /* S, C = rows 0..3 of sub-block j | of sub-block j + 4; whole 256-bit stores, which
             * the kernel's 256-bit loads right after can forward from. */
            _mm256_storeu_ps(ks->s[j], _mm256_permute2f128_ps(S, S, 0x00));
            _mm256_storeu_ps(ks->s[j + 4], _mm256_permute2f128_ps(S, S, 0x11));
            _mm256_storeu_ps(ks->c[j], _mm256_permute2f128_ps(C, C, 0x00));
            _mm256_storeu_ps(ks->c[j + 4], _mm256_permute2f128_ps(C, C, 0x11));
        }
        return;
    }
    if (type == ST_TYPE_Q6_K) {
        /* The four rows at once (the scalar loop stored 64 floats one by one, which the
         * kernel's vector loads then waited on, about as long as the dot itself at one token):
         * row r's scale pairs (2j, 2j + 1) are 16-bit word j of its 16 scale bytes; a 4x8 word
         * transpose puts word j of rows 0..3 in one 64-bit half, one byte shuffle orders it
         * [rows 0..3 of 2j | of 2j + 1], sign-extended and converted. Per value the scalar
         * loop's float operations: d * sc, then 0 - 32 * s. */
        __m128i h[MR];
        for (int r = 0; r < MR; r++) h[r] = _mm_loadu_si128((const __m128i *)((const blk_q6_k *)rows[r] + i)->scales);
        const __m128i a01 = _mm_unpacklo_epi16(h[0], h[1]), b01 = _mm_unpackhi_epi16(h[0], h[1]);
        const __m128i a23 = _mm_unpacklo_epi16(h[2], h[3]), b23 = _mm_unpackhi_epi16(h[2], h[3]);
        /* w[k]: words 2k, 2k + 1 of rows 0..3 (low, high 64 bits) */
        const __m128i w[4] = {_mm_unpacklo_epi32(a01, a23), _mm_unpackhi_epi32(a01, a23), _mm_unpacklo_epi32(b01, b23),
                              _mm_unpackhi_epi32(b01, b23)};
        const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
        const __m128 d4 = _mm_setr_ps(h2f(((const blk_q6_k *)rows[0] + i)->d), h2f(((const blk_q6_k *)rows[1] + i)->d),
                                      h2f(((const blk_q6_k *)rows[2] + i)->d), h2f(((const blk_q6_k *)rows[3] + i)->d));
        const __m256 d8 = _mm256_set_m128(d4, d4);
        for (int k = 0; k < 4; k++) {
            const __m128i o = _mm_shuffle_epi8(w[k], order);
            for (int half = 0; half < 2; half++) {
                const __m128i bytes = half ? _mm_unpackhi_epi64(o, o) : o;
                const __m256 S = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
                _mm256_storeu_ps(ks->s[2 * k + half], S);
                _mm256_storeu_ps(ks->c[2 * k + half], _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(32.0f), S)));
            }
        }
        return;
    }
    for (int r = 0; r < MR; r++) {
        if (type == ST_TYPE_Q6_K) {
            const blk_q6_k *q = (const blk_q6_k *)rows[r] + i;
            const float d = h2f(q->d);
            for (int j = 0; j < 8; j++) {
                const float lo = d * (float)q->scales[2 * j], hi = d * (float)q->scales[2 * j + 1];
                ks->s[j][r] = lo, ks->s[j][MR + r] = hi;
                ks->c[j][r] = 0.0f - 32.0f * lo, ks->c[j][MR + r] = 0.0f - 32.0f * hi;
            }
        } else { /* Q4_K, Q5_K: same header layout up to the scales */
            const blk_q4_k *q = type == ST_TYPE_Q4_K ? (const blk_q4_k *)rows[r] + i : NULL;
            const blk_q5_k *q5 = type == ST_TYPE_Q5_K ? (const blk_q5_k *)rows[r] + i : NULL;
            const float d = h2f(q ? q->d : q5->d), dmin = h2f(q ? q->dmin : q5->dmin);
            const uint8_t *sc = q ? q->scales : q5->scales;
            for (int j = 0; j < 8; j++) {
                uint8_t sv, mv;
                get_scale_min_k4(j, sc, &sv, &mv);
                const float sf = d * (float)sv, m = -dmin * (float)mv;
                ks->s[j][r] = ks->s[j][MR + r] = sf;
                ks->c[j][r] = ks->c[j][MR + r] = m - 0.0f * sf;
            }
        }
    }
}

/* Q4_K, eight rows at once for the one-lane kernels: ks->s[j], ks->c[j] = lanes rows 0..7 of
 * sub-block j, so the kernel takes each as one 256-bit load (the two 4-row unpacks it replaces
 * cost a quarter of the one-token rate: twice the shuffles, and two 128-bit loads and an insert
 * per vector). unpack_kscales' Q4_K steps on 256-bit registers whose 128-bit halves hold rows
 * 0..3 and 4..7; per value the same float operations: d * sv, -dmin * mv, m - 0 * s. */
static inline __attribute__((always_inline)) void unpack_kscales8_q4k(const uint8_t *const *rows, int64_t i,
                                                                      kscales *ks) {
    __m256i h[MR];
    for (int r = 0; r < MR; r++)
        h[r] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(rows[MR + r] + (size_t)i * sizeof(blk_q4_k))),
                                _mm_loadu_si128((const __m128i *)(rows[r] + (size_t)i * sizeof(blk_q4_k))));
    const __m256i t0 = _mm256_unpacklo_epi32(h[0], h[1]), t1 = _mm256_unpackhi_epi32(h[0], h[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(h[2], h[3]), t3 = _mm256_unpackhi_epi32(h[2], h[3]);
    const __m256i dd = _mm256_unpacklo_epi64(t0, t2), u0 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u1 = _mm256_unpacklo_epi64(t1, t3), u2 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i m6 = _mm256_set1_epi8(0x3f), m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x03);
    const __m256i s_lo = _mm256_and_si256(u0, m6), m_lo = _mm256_and_si256(u1, m6);
    const __m256i s_hi = _mm256_or_si256(_mm256_and_si256(u2, m4),
                                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), m2), 4));
    const __m256i m_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4),
                                         _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m2), 4));
    /* [d0 d1 d2 d3 | d4 d5 d6 d7] in the low 64 bits of each half, then both halves' in 128 bits */
    const __m256i pick_dm = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                             0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dd, pick_dm), 0xD8); /* [d0..7 | dmin0..7] */
    const __m256 d8 = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    const __m256 nm8 = _mm256_xor_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1)), _mm256_set1_ps(-0.0f)); /* -dmin */
    for (int j = 0; j < 4; j++) {
        const __m256i pick = _mm256_setr_epi8(j, -1, -1, -1, 4 + j, -1, -1, -1, 8 + j, -1, -1, -1, 12 + j, -1, -1, -1,
                                              j, -1, -1, -1, 4 + j, -1, -1, -1, 8 + j, -1, -1, -1, 12 + j, -1, -1, -1);
        for (int half = 0; half < 2; half++) { /* sub-blocks j and j + 4 */
            const __m256 S = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(half ? s_hi : s_lo, pick)));
            const __m256 M = _mm256_mul_ps(nm8, _mm256_cvtepi32_ps(_mm256_shuffle_epi8(half ? m_hi : m_lo, pick)));
            _mm256_storeu_ps(ks->s[j + 4 * half], S);
            _mm256_storeu_ps(ks->c[j + 4 * half], _mm256_sub_ps(M, _mm256_mul_ps(_mm256_setzero_ps(), S)));
        }
    }
}

static inline int is_kquant(int32_t type) { return type == ST_TYPE_Q4_K || type == ST_TYPE_Q5_K || type == ST_TYPE_Q6_K; }

/* The f16 pair at the head of each row's block b (d, and m or padding): [d0 m0 d1 m1 ...]. */
static inline __m256 head4(const uint8_t *const *rows, int64_t b, size_t bs) {
    const __m128i h = _mm_setr_epi32((int)ld32(rows[0] + b * bs), (int)ld32(rows[1] + b * bs),
                                     (int)ld32(rows[2] + b * bs), (int)ld32(rows[3] + b * bs));
    return _mm256_cvtph_ps(h);
}

static inline __attribute__((always_inline)) void load_blk4(int32_t type, const uint8_t *const *rows, int64_t b,
                                                            kscales *ks, blk4 *k) {
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6), odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);
    if (type == ST_TYPE_Q8_0) {
        for (int r = 0; r < MR; r++) {
            const blk_q8_0 *q = (const blk_q8_0 *)rows[r] + b;
            k->sg[r] = _mm256_loadu_si256((const __m256i *)q->qs);
            k->u[r] = _mm256_sign_epi8(k->sg[r], k->sg[r]);
        }
        k->s = _mm256_permutevar8x32_ps(head4(rows, b, sizeof(blk_q8_0)), even);
        k->c = _mm256_setzero_ps();
        return;
    }
    for (int r = 0; r < MR; r++) k->u[r] = load_sub(type, rows[r], b).u; /* only the codes: the rest is dead */
    if (is_kquant(type)) {
        if (b % 8 == 0) unpack_kscales(type, rows, b / 8, ks);
        k->s = _mm256_loadu_ps(ks->s[b % 8]);
        k->c = _mm256_loadu_ps(ks->c[b % 8]);
        return;
    }
    const size_t bs = type == ST_TYPE_Q4_0 ? sizeof(blk_q4_0) : type == ST_TYPE_Q4_1 ? sizeof(blk_q4_1)
                      : type == ST_TYPE_Q5_0 ? sizeof(blk_q5_0) : sizeof(blk_q5_1);
    const __m256 dm = head4(rows, b, bs);
    k->s = _mm256_permutevar8x32_ps(dm, even);
    if (type == ST_TYPE_Q4_1 || type == ST_TYPE_Q5_1) {
        k->c = _mm256_permutevar8x32_ps(dm, odd); /* m - 0 * s */
    } else { /* offset 8 (Q4_0) or 16 (Q5_0) */
        k->c = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(type == ST_TYPE_Q4_0 ? 8.0f : 16.0f), k->s));
    }
}

static inline __m256i madd_ones(__m256i x) { return _mm256_madd_epi16(x, _mm256_set1_epi16(1)); }

/* Sums of 4 adjacent u8 x s8 products per int32 lane: vpdpbusd where VNNI exists, else
 * maddubs + madd (exact here: no pair of products reaches the int16 limit). */
static inline __m256i dot4(__m256i u, __m256i a) {
#if GEMM_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a);
#else
    return madd_ones(_mm256_maddubs_epi16(u, a));
#endif
}

/* One block of four rows against one token: the lane layout described above. */
static inline __attribute__((always_inline)) __m256 step4(int32_t type, const blk4 *k, const act_row *a, int64_t b,
                                                          __m256 acc) {
    const __m256i av = _mm256_loadu_si256((const __m256i *)(a->q + b * QK));
    __m256i p[MR];
#if !GEMM_VNNI
    if (type != ST_TYPE_Q8_0 && type != ST_TYPE_Q6_K) {
        /* Codes <= 31: the four rows' maddubs pairs are reduced across rows in 16 bits (each
         * sum holds 8 products, |sum| <= 8 * 31 * 127 < 2^15) and widened by one madd at the
         * end, instead of one madd per row: the same exact sums, 3 fewer multiplies. */
        for (int r = 0; r < MR; r++) p[r] = _mm256_maddubs_epi16(k->u[r], av);
        const __m256i x01 = _mm256_add_epi16(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));
        const __m256i x23 = _mm256_add_epi16(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));
        const __m256i red =
            madd_ones(_mm256_add_epi16(_mm256_unpacklo_epi64(x01, x23), _mm256_unpackhi_epi64(x01, x23)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(red), _mm256_mul_ps(k->s, _mm256_broadcast_ss(a->d + b)), acc);
        return _mm256_fmadd_ps(k->c, _mm256_loadu_ps(a->xs8 + b * 8), acc);
    }
#endif
#if !GEMM_VNNI
    if (type == ST_TYPE_Q6_K) {
        /* Codes <= 63: a maddubs pair is <= 2 * 63 * 127, so two rows' pairs are added in 16 bits
         * (4 products, < 2^15) before one madd per two rows: the same exact sums, 2 fewer madds. */
        for (int r = 0; r < MR; r++) p[r] = _mm256_maddubs_epi16(k->u[r], av);
        const __m256i x01 = madd_ones(_mm256_add_epi16(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1])));
        const __m256i x23 = madd_ones(_mm256_add_epi16(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3])));
        const __m256i red = _mm256_add_epi32(_mm256_unpacklo_epi64(x01, x23), _mm256_unpackhi_epi64(x01, x23));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(red), _mm256_mul_ps(k->s, _mm256_broadcast_ss(a->d + b)), acc);
        return _mm256_fmadd_ps(k->c, _mm256_loadu_ps(a->xs8 + b * 8), acc);
    }
#endif
    for (int r = 0; r < MR; r++)
        p[r] = dot4(k->u[r], type == ST_TYPE_Q8_0 ? _mm256_sign_epi8(av, k->sg[r]) : av);
#ifdef USE_HADD
    const __m256i red = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
#else
    const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[0], p[1]), _mm256_unpackhi_epi32(p[0], p[1]));
    const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2], p[3]), _mm256_unpackhi_epi32(p[2], p[3]));
    const __m256i red = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
#endif
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(red), _mm256_mul_ps(k->s, _mm256_broadcast_ss(a->d + b)), acc);
    if (type != ST_TYPE_Q8_0) acc = _mm256_fmadd_ps(k->c, _mm256_loadu_ps(a->xs8 + b * 8), acc);
    return acc;
}

static inline void finish4(const __m256 *acc, int nt, int nr, float *out, int64_t ldo) {
    for (int t = 0; t < nt; t++) {
        float v[8];
        _mm256_storeu_ps(v, acc[t]);
        for (int r = 0; r < nr; r++) out[t * ldo + r] = v[r] + v[MR + r];
    }
}

/* NT (1..4) tokens straight from the packed rows: each block unpacked into registers. */
static inline __attribute__((always_inline)) void fused4(int32_t type, const uint8_t *const *rows, int64_t nb, int NT,
                                                         const act_row *a, float *out, int nr, int64_t ldo,
                                                         const uint8_t *next) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    kscales ks;
    const size_t bs = st_row_bytes(type, QK_K) / (QK_K / QK); /* bytes per 32 weights */
    if (type == ST_TYPE_Q6_K || type == ST_TYPE_Q5_K) {
        /* A super-block's eight sub-blocks unrolled: the sub-block index is then a constant, so
         * the code unpacking takes fixed shifts and shares its loads between sub-blocks (the
         * same operations per lane, in the same order). */
        for (int64_t b0 = 0; b0 < nb; b0 += 8) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const int64_t b = (b0 & ~(int64_t)7) + j; /* b0 is a multiple of 8: b % 8 == j, known */
                blk4 k;
                prefetch_slice(next, b, MR * bs);
                load_blk4(type, rows, b, &ks, &k);
                for (int t = 0; t < NT; t++) acc[t] = step4(type, &k, &a[t], b, acc[t]);
            }
        }
        finish4(acc, NT, nr, out, ldo);
        return;
    }
    for (int64_t b = 0; b < nb; b++) {
        blk4 k;
        prefetch_slice(next, b, MR * bs); /* few tokens are memory-bound */
        load_blk4(type, rows, b, &ks, &k);
        for (int t = 0; t < NT; t++) acc[t] = step4(type, &k, &a[t], b, acc[t]);
    }
    finish4(acc, NT, nr, out, ldo);
}

/* ---- many tokens: eight rows interleaved by 4-byte groups ----
 * With more than 4 tokens an 8-row block is unpacked once into blk8: for each 32-element
 * block, eight vectors w[j] holding elements 4j..4j+3 of rows 0..7 (one dword per row, an
 * 8x8 dword transpose of the unpacked rows). A token's four bytes 4j..4j+3, broadcast to
 * every dword, then multiply all eight rows in one maddubs, and the partial sums of a
 * half-block are added in 16 bits before one madd (no overflow: |a| <= 127, codes <= 31 for
 * four terms, <= 63 for two, Q8_0 one), so the integer work per 32 weights drops from a
 * maddubs, a madd and a share of the lane reduction to a maddubs and an add. The float work
 * per lane - fma(float(isum), s * d), then fma(c, xs), per block in order, lo + hi at the
 * end - is the 4-row path's, so both give the same bits. */
typedef struct {
    __m256i w[8];               /* chunk j of the eight rows (Q8_0: signed weights) */
    __m256 s_lo, s_hi, c_lo, c_hi; /* per-row scale and correction of each half-block */
} blk8;

static inline void transpose8x8_epi32(__m256i *v) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
    const __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    v[0] = _mm256_permute2x128_si256(u0, u4, 0x20), v[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    v[2] = _mm256_permute2x128_si256(u2, u6, 0x20), v[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    v[4] = _mm256_permute2x128_si256(u0, u4, 0x31), v[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    v[6] = _mm256_permute2x128_si256(u2, u6, 0x31), v[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

static inline __attribute__((always_inline)) void load_blk8(int32_t type, const uint8_t *const *rows, int64_t b,
                                                            kscales *ks, blk8 *k) {
    blk4 lo, hi;
    load_blk4(type, rows, b, &ks[0], &lo);
    load_blk4(type, rows + MR, b, &ks[1], &hi);
    for (int r = 0; r < MR; r++) {
        k->w[r] = type == ST_TYPE_Q8_0 ? lo.sg[r] : lo.u[r];
        k->w[MR + r] = type == ST_TYPE_Q8_0 ? hi.sg[r] : hi.u[r];
    }
    transpose8x8_epi32(k->w);
    k->s_lo = _mm256_permute2f128_ps(lo.s, hi.s, 0x20), k->s_hi = _mm256_permute2f128_ps(lo.s, hi.s, 0x31);
    k->c_lo = _mm256_permute2f128_ps(lo.c, hi.c, 0x20), k->c_hi = _mm256_permute2f128_ps(lo.c, hi.c, 0x31);
}

/* Q4_0 / Q4_1: the 8-row block from the packed nibbles. Byte i of a block holds elements i
 * (low nibble) and 16 + i (high nibble), so dword j of the 16 packed bytes carries chunk j of
 * both halves: a 4x4 dword transpose of the packed rows (rows r and r + 4 share a register)
 * followed by a mask and a shift gives w[j] and w[4 + j], about half the shuffles of
 * unpacking each row and transposing 8x8. Scales: the eight (d, m) f16 pairs in one
 * register, split into d and m words, converted once. Same codes and floats as load_blk8. */
static inline __attribute__((always_inline)) void load_blk8_q4(int32_t type, const uint8_t *const *rows, int64_t b,
                                                               blk8 *k) {
    if (type == ST_TYPE_Q4_1_R8) { /* repacked at load: the same registers by plain loads (internal.h) */
        const uint8_t *g = rows[0] + (size_t)b * ST_R8_ROWS * sizeof(blk_q4_1);
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        for (int j = 0; j < 4; j++) {
            const __m256i p = _mm256_loadu_si256((const __m256i *)(g + 32 + 32 * j));
            k->w[j] = _mm256_and_si256(p, m4), k->w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
        }
        k->s_lo = k->s_hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        k->c_lo = k->c_hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
        return;
    }
    const size_t bs = type == ST_TYPE_Q4_0 ? sizeof(blk_q4_0) : sizeof(blk_q4_1);
    const size_t qo = type == ST_TYPE_Q4_0 ? offsetof(blk_q4_0, qs) : offsetof(blk_q4_1, qs);
    const size_t o = (size_t)b * bs;
    __m256i v[MR];
    for (int r = 0; r < MR; r++)
        v[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(rows[r] + o + qo))),
                                       _mm_loadu_si128((const __m128i *)(rows[r + MR] + o + qo)), 1);
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    const __m256i p[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                          _mm256_unpackhi_epi64(t1, t3)};
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++)
        k->w[j] = _mm256_and_si256(p[j], m4), k->w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(p[j], 4), m4);
    const __m256i h = _mm256_setr_epi32((int)ld32(rows[0] + o), (int)ld32(rows[1] + o), (int)ld32(rows[2] + o),
                                        (int)ld32(rows[3] + o), (int)ld32(rows[4] + o), (int)ld32(rows[5] + o),
                                        (int)ld32(rows[6] + o), (int)ld32(rows[7] + o));
    /* [d0..d3 m0..m3 | d4..d7 m4..m7] as 16-bit words, then [d0..d7 | m0..m7] */
    const __m256i dm = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(h, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(h, 16)), 0xD8);
    const __m256 sv = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    k->s_lo = k->s_hi = sv;
    k->c_lo = k->c_hi = type == ST_TYPE_Q4_1 ? _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1))
                                             : _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(8.0f), sv));
}

/* Q4_K: the 32 packed bytes of sub-blocks j and j + 1 (j even) hold sub-block j in the low
 * nibbles and j + 1 in the high ones, element e at byte e; one 8x8 dword transpose of the
 * packed rows gives both sub-blocks' blk8 (kb[0], kb[1]). Scales from unpack_kscales8_q4k. */
static inline __attribute__((always_inline)) void load_blk8_q4k_pair(const uint8_t *const *rows, int64_t b,
                                                                     kscales *ks, blk8 *kb) {
    const int j = (int)(b % 8);
    if (j == 0) unpack_kscales8_q4k(rows, b / 8, ks);
    __m256i v[2 * MR];
    for (int r = 0; r < 2 * MR; r++)
        v[r] = _mm256_loadu_si256((const __m256i *)(((const blk_q4_k *)rows[r] + b / 8)->qs + 32 * (j / 2)));
    transpose8x8_epi32(v);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 8; c++)
        kb[0].w[c] = _mm256_and_si256(v[c], m4), kb[1].w[c] = _mm256_and_si256(_mm256_srli_epi16(v[c], 4), m4);
    for (int i = 0; i < 2; i++) { /* one lane per row: the _hi halves equal the _lo ones */
        blk8 *k = &kb[i];
        k->s_lo = k->s_hi = _mm256_loadu_ps(ks->s[j + i]);
        k->c_lo = k->c_hi = _mm256_loadu_ps(ks->c[j + i]);
    }
}

/* Integer sums of one half-block (elements 16h..16h+15) of the eight rows against one token. */
static inline __attribute__((always_inline)) __m256i half8(int32_t type, const __m256i *w, const int8_t *q) {
    __m256i av[4];
    for (int j = 0; j < 4; j++) {
        av[j] = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(q + 4 * j)));
        if (type == ST_TYPE_Q8_0) av[j] = _mm256_sign_epi8(av[j], w[j]);
    }
    const __m256i u0 = type == ST_TYPE_Q8_0 ? _mm256_sign_epi8(w[0], w[0]) : w[0];
    const __m256i u1 = type == ST_TYPE_Q8_0 ? _mm256_sign_epi8(w[1], w[1]) : w[1];
    const __m256i u2 = type == ST_TYPE_Q8_0 ? _mm256_sign_epi8(w[2], w[2]) : w[2];
    const __m256i u3 = type == ST_TYPE_Q8_0 ? _mm256_sign_epi8(w[3], w[3]) : w[3];
#if GEMM_VNNI
    __m256i acc = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, av[0]);
    acc = _mm256_dpbusd_epi32(acc, u1, av[1]);
    acc = _mm256_dpbusd_epi32(acc, u2, av[2]);
    return _mm256_dpbusd_epi32(acc, u3, av[3]);
#else
    const __m256i m0 = _mm256_maddubs_epi16(u0, av[0]), m1 = _mm256_maddubs_epi16(u1, av[1]);
    const __m256i m2 = _mm256_maddubs_epi16(u2, av[2]), m3 = _mm256_maddubs_epi16(u3, av[3]);
    if (type == ST_TYPE_Q8_0)
        return _mm256_add_epi32(_mm256_add_epi32(madd_ones(m0), madd_ones(m1)), _mm256_add_epi32(madd_ones(m2), madd_ones(m3)));
    if (type == ST_TYPE_Q6_K)
        return _mm256_add_epi32(madd_ones(_mm256_add_epi16(m0, m1)), madd_ones(_mm256_add_epi16(m2, m3)));
    return madd_ones(_mm256_add_epi16(_mm256_add_epi16(m0, m1), _mm256_add_epi16(m2, m3)));
#endif
}

/* Per-lane results of 8-row blocks kept as (low half, high half) pairs, acc[2 * t] and acc[2 * t + 1]
 * for token t: row r's result is the sum of the two halves' lane r. */
static inline void halves_store(const __m256 *acc, int nt, int nr, float *out, int64_t ldo) {
    for (int t = 0; t < nt; t++) {
        float vl[8], vh[8];
        _mm256_storeu_ps(vl, acc[2 * t]);
        _mm256_storeu_ps(vh, acc[2 * t + 1]);
        for (int r = 0; r < nr; r++) out[t * ldo + r] = vl[r] + vh[r];
    }
}

/* NT tokens against blocks [b0, b1) of an 8-row block unpacked into kb[b - b0]. With acc
 * NULL the row block is taken in one pass (b0 = 0, b1 = nb) and the results are written to
 * out; otherwise the per-lane accumulators (low and high half per token) live in acc[2 * t],
 * acc[2 * t + 1] between calls, so a row block can be taken in K chunks with every lane
 * still summed over its blocks in order (the same bits as one pass). */
static inline __attribute__((always_inline)) void buffered8(int32_t type, const blk8 *kb, int64_t b0, int64_t b1,
                                                            int NT, const act_row *a, __m256 *acc, float *out,
                                                            int nr, int64_t ldo) {
    __m256 lo[4], hi[4];
    for (int t = 0; t < NT; t++) lo[t] = acc ? acc[2 * t] : _mm256_setzero_ps(), hi[t] = acc ? acc[2 * t + 1] : lo[t];
    for (int64_t b = b0; b < b1; b++) {
        const blk8 *k = &kb[b - b0];
        for (int t = 0; t < NT; t++) {
            const int8_t *q = a[t].q + b * QK;
            const __m256 d = _mm256_broadcast_ss(a[t].d + b);
            lo[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half8(type, k->w, q)), _mm256_mul_ps(k->s_lo, d), lo[t]);
            hi[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half8(type, k->w + 4, q + 16)), _mm256_mul_ps(k->s_hi, d), hi[t]);
            if (type != ST_TYPE_Q8_0) {
                lo[t] = _mm256_fmadd_ps(k->c_lo, _mm256_broadcast_ss(a[t].xs8 + b * 8), lo[t]);
                hi[t] = _mm256_fmadd_ps(k->c_hi, _mm256_broadcast_ss(a[t].xs8 + b * 8 + 4), hi[t]);
            }
        }
    }
    __m256 pairs[2 * 4];
    __m256 *dst = acc ? acc : pairs; /* acc: carried to the next K chunk; else summed into out now */
    for (int t = 0; t < NT; t++) dst[2 * t] = lo[t], dst[2 * t + 1] = hi[t];
    if (!acc) halves_store(pairs, NT, nr, out, ldo);
}

/* Unpack blocks [b0, b1) of an 8-row block into kb[b - b0], prefetching the next block's rows. */
static inline __attribute__((always_inline)) void unpack8(int32_t type, const uint8_t *const *rows, int64_t b0,
                                                          int64_t b1, kscales *ks, blk8 *kb, const uint8_t *next,
                                                          size_t step) {
    for (int64_t b = b0; b < b1; b++) {
        prefetch_slice(next, b, step); /* lands while the tokens run */
        if (type == ST_TYPE_Q4_0 || type == ST_TYPE_Q4_1 || type == ST_TYPE_Q4_1_R8) {
            load_blk8_q4(type, rows, b, &kb[b - b0]);
        } else if (type == ST_TYPE_Q4_K) { /* sub-blocks in pairs: b0, b1 even */
            prefetch_slice(next, b + 1, step);
            load_blk8_q4k_pair(rows, b, ks, &kb[b - b0]);
            b++;
        } else {
            load_blk8(type, rows, b, ks, &kb[b - b0]);
        }
    }
}

/* All tokens against blocks [b0, b1), four per pass (acc, out: as buffered8). */
static inline __attribute__((always_inline)) void tokens8(int32_t type, const blk8 *kb, int64_t b0, int64_t b1, int nt,
                                                          const act_row *a, __m256 *acc, float *out, int nr,
                                                          int64_t ldo) {
    int t = 0;
    for (; t + 4 <= nt; t += 4)
        buffered8(type, kb, b0, b1, 4, a + t, acc ? acc + 2 * t : NULL, out + t * ldo, nr, ldo);
    __m256 *at = acc ? acc + 2 * t : NULL;
    switch (nt - t) {
    case 1: buffered8(type, kb, b0, b1, 1, a + t, at, out + t * ldo, nr, ldo); break;
    case 2: buffered8(type, kb, b0, b1, 2, a + t, at, out + t * ldo, nr, ldo); break;
    case 3: buffered8(type, kb, b0, b1, 3, a + t, at, out + t * ldo, nr, ldo); break;
    default: break;
    }
}

/* K chunking of the buffered path. With long rows (> 32 blocks) and few tokens the row block
 * is unpacked and consumed 8 blocks (3 KiB of blk8) at a time: the next rows' prefetches are
 * then spread over the whole pass instead of issued in one burst before it, and buffer,
 * activations and prefetched lines stay within L1. On 1536-wide Q4_1 rows streamed from DRAM
 * (1 thread) 3/4/5/8 tokens went 26/30/33/41 -> 32/36/39/43 GMAC/s; with 576-wide rows, or 16+
 * tokens, or weights in cache, one chunk (the whole row) was as fast or faster. */
static inline int64_t kchunk(int64_t nb, int nt) { return nb > 32 && nt < 16 ? 8 : nb; }

/* The K-chunked pass over one 8-row block (kchunk): accumulators in memory between chunks. */
static inline __attribute__((always_inline)) void chunked8(int32_t type, const uint8_t *const *rows, int64_t nb,
                                                           int64_t ch, int nt, const act_row *a, kscales *ks, blk8 *kb,
                                                           const uint8_t *next, size_t step, float *o, int nrr,
                                                           int64_t ldo) {
    __m256 acc[2 * ST_MAX_NT];
    for (int t = 0; t < 2 * nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += ch) {
        const int64_t b1 = nb - b0 < ch ? nb : b0 + ch;
        unpack8(type, rows, b0, b1, ks, kb, next, step);
        tokens8(type, kb, b0, b1, nt, a, acc, o, nrr, ldo);
    }
    halves_store(acc, nt, nrr, o, ldo);
}

/* ---- one lane per row: Q4_0, Q4_1, Q4_K ----
 * These types have one scale s and one correction c per 32-element block and codes <= 15, so
 * the two half-blocks need not be separate lanes: the block's exact integer sum is taken
 * whole (in 16 bits until one widening madd: 16 products per pair, |sum| <= 30480) and a
 * vector lane holds one row. Per (row, token) and block, in order:
 *     acc = fma(float(isum), s * d, acc);  acc = fma(c, xs, acc)
 * with xs = d * (s0 + s1), the activation block's 32-sum weight; the result is acc. Against
 * the (row, half) lanes that halves the float work and the widening madds per block. Both
 * paths use the 8-row interleaved block (blk8, from the packed nibbles), so a (row, token)
 * result is the same bits at any token count (batch invariance):
 *  - fused (1-2 tokens): each block built in registers and used at once;
 *  - buffered (3+ tokens): built once per row block (or K chunk) and read by every token,
 *    LANE_TP per pass, each weight vector loaded once per pass (AVX2).
 * Single-thread A/B of the two builds in one process (rows in L2, Zen 3, loaded box): Q4_1
 * 576-wide rows 1 / 2 / 8 / 16 tokens +8-10 / +18 / +5 / +5-10%, Q4_K 1536-wide rows 1 / 2
 * tokens +20 / +20%, 4 tokens within noise. Q5_0/Q5_1/Q5_K (codes <= 31) and Q8_0 (no
 * correction term, |w| * a pairs that cannot be added in 16 bits) measured slower this way at
 * 1-4 tokens, and Q6_K has a scale per half: they keep the (row, half) lanes below. */
#define LANE_TP 4      /* tokens per buffered pass */
#define LANE_FUSED_MAX 2 /* tokens up to which the fused path runs (3 tokens: a tie) */

static inline int one_lane(int32_t type) {
    return type == ST_TYPE_Q4_0 || type == ST_TYPE_Q4_1 || type == ST_TYPE_Q4_K || type == ST_TYPE_Q4_1_R8;
}

/* Exact integer sums of one 32-element block of the eight rows (blk8 chunks w[0..7]) against
 * one token: lanes = rows 0..7. */
static inline __attribute__((always_inline)) __m256i sum8(const __m256i *w, const int8_t *q) {
    __m256i av[8];
    for (int j = 0; j < 8; j++) av[j] = _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(q + 4 * j)));
#if GEMM_VNNI
    __m256i x = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], av[0]);
    __m256i y = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[4], av[4]);
    for (int j = 1; j < 4; j++) x = _mm256_dpbusd_epi32(x, w[j], av[j]), y = _mm256_dpbusd_epi32(y, w[4 + j], av[4 + j]);
    return _mm256_add_epi32(x, y);
#else
    __m256i m[8];
    for (int j = 0; j < 8; j++) m[j] = _mm256_maddubs_epi16(w[j], av[j]);
    const __m256i lo = _mm256_add_epi16(_mm256_add_epi16(m[0], m[1]), _mm256_add_epi16(m[2], m[3]));
    const __m256i hi = _mm256_add_epi16(_mm256_add_epi16(m[4], m[5]), _mm256_add_epi16(m[6], m[7]));
    return madd_ones(_mm256_add_epi16(lo, hi));
#endif
}

/* The float step of one lane vector: the block's sums isum, scales s and corrections c. */
static inline __attribute__((always_inline)) __m256 lane_fma(__m256i isum, __m256 s, __m256 c, const act_row *a,
                                                             int64_t b, __m256 acc) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(s, _mm256_broadcast_ss(a->d + b)), acc);
    return _mm256_fmadd_ps(c, _mm256_broadcast_ss(a->xs + b), acc);
}

static inline void lane_store(const __m256 *acc, int nt, int nr, float *out, int64_t ldo) {
    for (int t = 0; t < nt; t++) {
        float v[8];
        _mm256_storeu_ps(v, acc[t]);
        for (int r = 0; r < nr; r++) out[t * ldo + r] = v[r];
    }
}

/* NT <= LANE_TP tokens against blocks [b0, b1) of a buffered row block (kb[b - b0]); the
 * accumulators acc[t] carry over K chunks. */
static inline __attribute__((always_inline)) void lane_tokens(const blk8 *kb, int64_t b0, int64_t b1, int NT,
                                                              const act_row *a, __m256 *acc) {
    __m256 v[LANE_TP];
    for (int t = 0; t < NT; t++) v[t] = acc[t];
    for (int64_t b = b0; b < b1; b++) {
        const blk8 *k = &kb[b - b0];
#if GEMM_VNNI
        for (int t = 0; t < NT; t++) v[t] = lane_fma(sum8(k->w, a[t].q + b * QK), k->s_lo, k->c_lo, &a[t], b, v[t]);
#else
        /* Weight vector j outermost: loaded once per pass and multiplied with every token's
         * bytes 4j..4j+3; each token's products summed in 16 bits (the same exact sums as sum8). */
        __m256i m[LANE_TP];
        for (int j = 0; j < 8; j++) {
            const __m256i wj = _mm256_load_si256(&k->w[j]);
            for (int t = 0; t < NT; t++) {
                const __m256i av =
                    _mm256_castps_si256(_mm256_broadcast_ss((const float *)(const void *)(a[t].q + b * QK + 4 * j)));
                const __m256i pr = _mm256_maddubs_epi16(wj, av);
                m[t] = j ? _mm256_add_epi16(m[t], pr) : pr;
            }
        }
        for (int t = 0; t < NT; t++) v[t] = lane_fma(madd_ones(m[t]), k->s_lo, k->c_lo, &a[t], b, v[t]);
#endif
    }
    for (int t = 0; t < NT; t++) acc[t] = v[t];
}

static inline __attribute__((always_inline)) void lane_all(const blk8 *kb, int64_t b0, int64_t b1, int nt,
                                                           const act_row *a, __m256 *acc) {
    int t = 0;
    for (; t + LANE_TP <= nt; t += LANE_TP) lane_tokens(kb, b0, b1, LANE_TP, a + t, acc + t);
    switch (nt - t) {
    case 1: lane_tokens(kb, b0, b1, 1, a + t, acc + t); break;
    case 2: lane_tokens(kb, b0, b1, 2, a + t, acc + t); break;
    case 3: lane_tokens(kb, b0, b1, 3, a + t, acc + t); break;
    default: break;
    }
}

/* Few tokens: each block of the eight rows built in registers and used at once. */
static inline __attribute__((always_inline)) void lane_fused(int32_t type, const uint8_t *const *rows, int64_t nb,
                                                             int NT, const act_row *a, float *out, int nr, int64_t ldo,
                                                             const uint8_t *next, size_t step) {
    __m256 acc[LANE_FUSED_MAX];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    kscales ks[2];
    for (int64_t b = 0; b < nb; b++) {
        blk8 k[2];
        if (type == ST_TYPE_Q4_K) { /* sub-blocks in pairs */
            /* the pair's slice of the next row block, 2 * step = 288 bytes: five fixed line
             * requests cover it wherever it starts (prefetch_slice's loop, twice, cost 7% of the
             * one-token rate with the rows in cache) */
            const uint8_t *p = next + (size_t)b * step;
            for (int l = 0; l < 5; l++) _mm_prefetch((const char *)(p + 64 * l), _MM_HINT_T0);
            load_blk8_q4k_pair(rows, b, ks, k);
            for (int i = 0; i < 2; i++)
                for (int t = 0; t < NT; t++)
                    acc[t] = lane_fma(sum8(k[i].w, a[t].q + (b + i) * QK), k[i].s_lo, k[i].c_lo, &a[t], b + i, acc[t]);
            b++;
            continue;
        }
        prefetch_slice(next, b, step);
        load_blk8_q4(type, rows, b, &k[0]);
        for (int t = 0; t < NT; t++) acc[t] = lane_fma(sum8(k[0].w, a[t].q + b * QK), k[0].s_lo, k[0].c_lo, &a[t], b, acc[t]);
    }
    lane_store(acc, NT, nr, out, ldo);
}

static inline __attribute__((always_inline)) void gemm_lane(int32_t type, const void *w, size_t row_bytes, int nr,
                                                            int64_t n, int nt, const act_row *a, float *out,
                                                            int64_t ldo) {
    const int64_t nb = n / QK;
    for (int r0 = 0; r0 < nr; r0 += 2 * MR) {
        const int nrr = nr - r0 < 2 * MR ? nr - r0 : 2 * MR;
        const uint8_t *rows[2 * MR]; /* a short row block repeats its last row (results dropped) */
        for (int r = 0; r < 2 * MR; r++) rows[r] = (const uint8_t *)w + (size_t)(r0 + (r < nrr ? r : nrr - 1)) * row_bytes;
        const uint8_t *next = (const uint8_t *)w + (size_t)(r0 + 2 * MR) * row_bytes;
        const size_t step = 2 * MR * (row_bytes / (size_t)nb);
        float *o = out + r0;
        if (nt <= LANE_FUSED_MAX) {
            if (nt == 1) lane_fused(type, rows, nb, 1, a, o, nrr, ldo, next, step);
            else lane_fused(type, rows, nb, 2, a, o, nrr, ldo, next, step);
            continue;
        }
        const int64_t ch = kchunk(nb, nt);
        blk8 kb[ch]; /* one K chunk of the row block, unpacked once: 384 bytes per block */
        kscales ks[2];
        __m256 acc[ST_MAX_NT];
        for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += ch) {
            const int64_t b1 = nb - b0 < ch ? nb : b0 + ch;
            unpack8(type, rows, b0, b1, ks, kb, next, step);
            lane_all(kb, b0, b1, nt, a, acc);
        }
        lane_store(acc, nt, nrr, o, ldo);
    }
}

/* Repacked Q8_0 (ST_TYPE_Q8_0_R8): blk8 of block b of the group at g by plain loads, the
 * registers load_blk8 builds from eight plain rows (signed codes, d per row, no correction). */
static inline __attribute__((always_inline)) void load_blk8_q8r8(const uint8_t *g, int64_t b, blk8 *k) {
    const uint8_t *p = g + (size_t)b * ST_R8_ROWS * sizeof(blk_q8_0);
    for (int j = 0; j < 8; j++) k->w[j] = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * j));
    k->s_lo = k->s_hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    k->c_lo = k->c_hi = _mm256_setzero_ps();
}

/* 1..4 tokens of a repacked Q8_0 group: each block loaded into registers and used at once
 * (buffering it, as more tokens do, cost a third of the rate at one token on a 600 MB output
 * head streamed from DRAM: the stores and reloads of blk8 sat between the loads and the dots).
 * Per lane the float operations of buffered8 in one pass, so the same bits. */
static inline __attribute__((always_inline)) void fused8_q8r8(const uint8_t *g, int64_t nb, int NT, const act_row *a,
                                                              float *out, int nr, int64_t ldo, const uint8_t *next,
                                                              size_t step) {
    __m256 lo[4], hi[4];
    for (int t = 0; t < NT; t++) lo[t] = hi[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_slice(next, b, step);
        blk8 k;
        load_blk8_q8r8(g, b, &k);
        for (int t = 0; t < NT; t++) {
            const int8_t *q = a[t].q + b * QK;
            const __m256 d = _mm256_broadcast_ss(a[t].d + b);
            lo[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half8(ST_TYPE_Q8_0, k.w, q)), _mm256_mul_ps(k.s_lo, d), lo[t]);
            hi[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half8(ST_TYPE_Q8_0, k.w + 4, q + 16)), _mm256_mul_ps(k.s_hi, d),
                                    hi[t]);
        }
    }
    __m256 pairs[2 * 4];
    for (int t = 0; t < NT; t++) pairs[2 * t] = lo[t], pairs[2 * t + 1] = hi[t];
    halves_store(pairs, NT, nr, out, ldo);
}

/* The group is one contiguous stream: 1..4 tokens take the fused path above, more the buffered
 * one (the same bits as the 4-row path, see above), K-chunked as for plain rows. */
static inline __attribute__((always_inline)) void gemm_q8r8(const void *w, size_t row_bytes, int nr, int64_t n, int nt,
                                                            const act_row *a, float *out, int64_t ldo) {
    const int64_t nb = n / QK, ch = kchunk(nb, nt);
    const uint8_t *g = w;
    const uint8_t *next = g + ST_R8_ROWS * row_bytes;
    const size_t step = ST_R8_ROWS * sizeof(blk_q8_0);
    switch (nt) {
    case 1: fused8_q8r8(g, nb, 1, a, out, nr, ldo, next, step); return;
    case 2: fused8_q8r8(g, nb, 2, a, out, nr, ldo, next, step); return;
    case 3: fused8_q8r8(g, nb, 3, a, out, nr, ldo, next, step); return;
    case 4: fused8_q8r8(g, nb, 4, a, out, nr, ldo, next, step); return;
    default: break;
    }
    blk8 kb[ch];
    __m256 acc[2 * ST_MAX_NT];
    for (int t = 0; t < 2 * nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += ch) {
        const int64_t b1 = nb - b0 < ch ? nb : b0 + ch;
        for (int64_t b = b0; b < b1; b++) {
            prefetch_slice(next, b, step);
            load_blk8_q8r8(g, b, &kb[b - b0]);
        }
        if (ch == nb) {
            tokens8(ST_TYPE_Q8_0, kb, 0, nb, nt, a, NULL, out, nr, ldo);
            return;
        }
        tokens8(ST_TYPE_Q8_0, kb, b0, b1, nt, a, acc, out, nr, ldo);
    }
    halves_store(acc, nt, nr, out, ldo);
}

static inline __attribute__((always_inline)) void gemm256(int32_t type, const void *w, size_t row_bytes, int nr,
                                                            int64_t n, int nt, const act_row *a, float *out,
                                                            int64_t ldo) {
    const int64_t nb = n / QK;
    if (one_lane(type)) {
        gemm_lane(type, w, row_bytes, nr, n, nt, a, out, ldo);
        return;
    }
    if (type == ST_TYPE_Q8_0_R8) {
        gemm_q8r8(w, row_bytes, nr, n, nt, a, out, ldo);
        return;
    }
    if (nt >= BUF_MIN) {
        for (int r0 = 0; r0 < nr; r0 += 2 * MR) {
            const int nrr = nr - r0 < 2 * MR ? nr - r0 : 2 * MR;
            const uint8_t *rows[2 * MR]; /* a short row block repeats its last row (results dropped) */
            for (int r = 0; r < 2 * MR; r++)
                rows[r] = (const uint8_t *)w + (size_t)(r0 + (r < nrr ? r : nrr - 1)) * row_bytes;
            const int64_t ch = kchunk(nb, nt);
            blk8 kb[ch]; /* one K chunk of the row block, unpacked once: 384 bytes per block */
            kscales ks[2];
            const uint8_t *next = (const uint8_t *)w + (size_t)(r0 + 2 * MR) * row_bytes;
            const size_t step = 2 * MR * (row_bytes / (size_t)nb);
            float *o = out + r0;
            if (ch == nb) {
                unpack8(type, rows, 0, nb, ks, kb, next, step);
                tokens8(type, kb, 0, nb, nt, a, NULL, o, nrr, ldo);
                continue;
            }
            chunked8(type, rows, nb, ch, nt, a, ks, kb, next, step, o, nrr, ldo);
        }
        return;
    }
    for (int r0 = 0; r0 < nr; r0 += MR) {
        const int nrr = nr - r0 < MR ? nr - r0 : MR;
        const uint8_t *rows[MR]; /* a short row block repeats its last row (results dropped) */
        for (int r = 0; r < MR; r++) rows[r] = (const uint8_t *)w + (size_t)(r0 + (r < nrr ? r : nrr - 1)) * row_bytes;
        const uint8_t *next = (const uint8_t *)w + (size_t)(r0 + MR) * row_bytes;
        float *o = out + r0;
        switch (nt) {
        case 1: fused4(type, rows, nb, 1, a, o, nrr, ldo, next); break;
        case 2: fused4(type, rows, nb, 2, a, o, nrr, ldo, next); break;
        case 3: fused4(type, rows, nb, 3, a, o, nrr, ldo, next); break;
        default: fused4(type, rows, nb, 4, a, o, nrr, ldo, next); break;
        }
    }
}

#define DEF_GEMM(NAME, TYPE)                                                                           \
    static void NAME(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, float *out, \
                     int64_t ldo) {                                                                    \
        gemm256(TYPE, w, row_bytes, nr, n, nt, a, out, ldo);                                           \
    }

DEF_GEMM(gemm_q4_0, ST_TYPE_Q4_0)
DEF_GEMM(gemm_q4_1, ST_TYPE_Q4_1)
DEF_GEMM(gemm_q4_1_r8, ST_TYPE_Q4_1_R8)
DEF_GEMM(gemm_q8_0_r8, ST_TYPE_Q8_0_R8)
DEF_GEMM(gemm_q5_0, ST_TYPE_Q5_0)
DEF_GEMM(gemm_q5_1, ST_TYPE_Q5_1)
DEF_GEMM(gemm_q8_0, ST_TYPE_Q8_0)
DEF_GEMM(gemm_q4_k, ST_TYPE_Q4_K)
DEF_GEMM(gemm_q5_k, ST_TYPE_Q5_K)
DEF_GEMM(gemm_q6_k, ST_TYPE_Q6_K)

static dot_q_fn gemm_pick(int32_t type) {
    switch (type) {
    case ST_TYPE_Q4_0: return gemm_q4_0;
    case ST_TYPE_Q4_1: return gemm_q4_1;
    case ST_TYPE_Q4_1_R8: return gemm_q4_1_r8;
    case ST_TYPE_Q8_0_R8: return gemm_q8_0_r8;
    case ST_TYPE_Q5_0: return gemm_q5_0;
    case ST_TYPE_Q5_1: return gemm_q5_1;
    case ST_TYPE_Q8_0: return gemm_q8_0;
    case ST_TYPE_Q4_K: return gemm_q4_k;
    case ST_TYPE_Q5_K: return gemm_q5_k;
    case ST_TYPE_Q6_K: return gemm_q6_k;
    default: return NULL;
    }
}

#endif
