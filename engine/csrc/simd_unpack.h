/* Shared x86 building blocks for the AVX2 and AVX-512 kernels. Included after a
 * `#pragma GCC target(...)`, so each kernel file compiles these for its own ISA.
 *
 * Every quantised weight type is expanded, 32 elements (one "sub-block") at a time,
 * to unsigned bytes q in [0, 2^bits); the caller multiplies them with the int8
 * activations and applies the per-sub-block float scale and integer offset exactly
 * like the reference kernels in quants.c. */
#ifndef STRATA_SIMD_UNPACK_H
#define STRATA_SIMD_UNPACK_H

#include <immintrin.h>

#include "internal.h"

/* 16 packed bytes -> 32 nibbles: low nibbles first (elements 0..15), then high. */
static inline __m256i unpack_nibbles16(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* 32 bits -> 32 bytes of 0x10 where bit i is set (the 5th bit of q5 types). */
static inline __m256i expand_bits32(uint32_t bits) {
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                          3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* F16C: one instruction instead of the portable bit-twiddling conversion. */
static inline float h2f(f16_t h) { return _cvtsh_ss(h); }

static inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q4_K / Q5_K: sub-block j of a super-block (32 bytes of qs hold sub-blocks 2c, 2c+1). */
static inline __m256i unpack_k4(const uint8_t *qs, int j) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
    const __m256i m = _mm256_set1_epi8(0x0F);
    return (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m) : _mm256_and_si256(v, m);
}

static inline __m256i unpack_k5_high(const uint8_t *qh, int j) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    return _mm256_slli_epi16(bit, 4);
}

/* Q6_K: sub-block j (elements 32j..32j+31), unsigned values 0..63 (offset 32). */
static inline __m256i unpack_q6k(const blk_q6_k *b, int j) {
    const int h = j / 4, g = j % 4;
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32 * (g & 1)));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    const __m256i low4 = g < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
    const __m256i high2 = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * g)), m2);
    return _mm256_or_si256(low4, _mm256_slli_epi16(high2, 4));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t asum32(const int32_t *s16, int64_t blk) { return s16[2 * blk] + s16[2 * blk + 1]; }

/* One 32-element weight sub-block: unsigned values u and w = s * (u - off) + m, where
 * s is s_lo for the first 16 elements and s_hi for the second (equal except Q6_K). */
typedef struct {
    __m256i u;
    float s_lo, s_hi, off, m;
} subblk;

/* Sub-block `sb` of a row (legacy types: sb = block index; k-quants: sb = 8*block + j). */
static inline subblk load_sub(int32_t type, const void *w, int64_t sb) {
    subblk r;
    r.off = 0.0f, r.m = 0.0f;
    switch (type) {
    case ST_TYPE_Q4_0: {
        const blk_q4_0 *b = (const blk_q4_0 *)w + sb;
        r.u = unpack_nibbles16(b->qs);
        r.s_lo = r.s_hi = h2f(b->d);
        r.off = 8.0f;
        break;
    }
    case ST_TYPE_Q4_1: {
        const blk_q4_1 *b = (const blk_q4_1 *)w + sb;
        r.u = unpack_nibbles16(b->qs);
        r.s_lo = r.s_hi = h2f(b->d);
        r.m = h2f(b->m);
        break;
    }
    case ST_TYPE_Q5_0: {
        const blk_q5_0 *b = (const blk_q5_0 *)w + sb;
        r.u = _mm256_or_si256(unpack_nibbles16(b->qs), expand_bits32(ld32(b->qh)));
        r.s_lo = r.s_hi = h2f(b->d);
        r.off = 16.0f;
        break;
    }
    case ST_TYPE_Q5_1: {
        const blk_q5_1 *b = (const blk_q5_1 *)w + sb;
        r.u = _mm256_or_si256(unpack_nibbles16(b->qs), expand_bits32(ld32(b->qh)));
        r.s_lo = r.s_hi = h2f(b->d);
        r.m = h2f(b->m);
        break;
    }
    case ST_TYPE_Q8_0: { /* signed -> unsigned by flipping the sign bit (VNNI path only) */
        const blk_q8_0 *b = (const blk_q8_0 *)w + sb;
        r.u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b->qs), _mm256_set1_epi8((char)0x80));
        r.s_lo = r.s_hi = h2f(b->d);
        r.off = 128.0f;
        break;
    }
    case ST_TYPE_Q4_K:
    case ST_TYPE_Q5_K: {
        const int j = (int)(sb % 8);
        uint8_t sc, mv;
        const uint8_t *scales;
        float d, dmin;
        if (type == ST_TYPE_Q4_K) {
            const blk_q4_k *b = (const blk_q4_k *)w + sb / 8;
            scales = b->scales, d = h2f(b->d), dmin = h2f(b->dmin);
            r.u = unpack_k4(b->qs, j);
        } else {
            const blk_q5_k *b = (const blk_q5_k *)w + sb / 8;
            scales = b->scales, d = h2f(b->d), dmin = h2f(b->dmin);
            r.u = _mm256_or_si256(unpack_k4(b->qs, j), unpack_k5_high(b->qh, j));
        }
        get_scale_min_k4(j, scales, &sc, &mv);
        r.s_lo = r.s_hi = d * (float)sc;
        r.m = -dmin * (float)mv;
        break;
    }
    case ST_TYPE_Q6_K: {
        const blk_q6_k *b = (const blk_q6_k *)w + sb / 8;
        const int j = (int)(sb % 8);
        const float d = h2f(b->d);
        r.u = unpack_q6k(b, j);
        r.s_lo = d * (float)b->scales[2 * j];
        r.s_hi = d * (float)b->scales[2 * j + 1];
        r.off = 32.0f;
        break;
    }
    default:
        r.u = _mm256_setzero_si256();
        r.s_lo = r.s_hi = 0.0f;
    }
    return r;
}

static inline int64_t n_subblocks(int64_t n) { return n / QK; }

/* Unpack a whole weight row once: u[n] unsigned values, sw[n/4] the scale of each
 * group of 4 elements, c[n/16] the correction coefficient of each 16-element sum
 * (m - off * s). Per token, a dot is then sum(u * q * sw * dx4) + sum(c * xs). */
#define UNPACK_ROW(TYPE, w, n, u, sw, c)                                                                   \
    for (int64_t sb_ = 0; sb_ < n_subblocks(n); sb_++) {                                                 \
        const subblk r_ = load_sub(TYPE, w, sb_);                                                        \
        _mm256_storeu_si256((__m256i *)((u) + sb_ * QK), r_.u);                                         \
        _mm256_storeu_ps((sw) + sb_ * 8, _mm256_setr_m128(_mm_set1_ps(r_.s_lo), _mm_set1_ps(r_.s_hi))); \
        (c)[2 * sb_] = r_.m - r_.off * r_.s_lo;                                                          \
        (c)[2 * sb_ + 1] = r_.m - r_.off * r_.s_hi;                                                      \
    }

#endif
