/* AVX2 + FMA + F16C kernels. Integer sums per 32-element sub-block with
 * maddubs (u8 x s8 -> s16 pairs; weights here are <= 63, so no saturation; Q8_0 uses
 * |w| x sign(a, w)) and the float scale applied per half sub-block; the same math as the
 * reference kernels. */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
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

/* One block of four rows against one token: the lane layout described above. */
static inline __attribute__((always_inline)) __m256 step4(int32_t type, const blk4 *k, const act_row *a, int64_t b,
                                                          __m256 acc) {
    const __m256i av = _mm256_loadu_si256((const __m256i *)(a->q + b * QK));
    __m256i p[MR];
    for (int r = 0; r < MR; r++)
        p[r] = madd_ones(_mm256_maddubs_epi16(k->u[r], type == ST_TYPE_Q8_0 ? _mm256_sign_epi8(av, k->sg[r]) : av));
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
                                                         const act_row *a, float *out, int nr, int64_t ldo) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    kscales ks;
    for (int64_t b = 0; b < nb; b++) {
        blk4 k;
        load_blk4(type, rows, b, &ks, &k);
        for (int t = 0; t < NT; t++) acc[t] = step4(type, &k, &a[t], b, acc[t]);
    }
    finish4(acc, NT, nr, out, ldo);
}

/* NT tokens against four rows unpacked once into kb[nb] (the many-token path). */
static inline __attribute__((always_inline)) void buffered4(int32_t type, const blk4 *kb, int64_t nb, int NT,
                                                            const act_row *a, float *out, int nr, int64_t ldo) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++)
        for (int t = 0; t < NT; t++) acc[t] = step4(type, &kb[b], &a[t], b, acc[t]);
    finish4(acc, NT, nr, out, ldo);
}

static inline __attribute__((always_inline)) void gemm_avx2(int32_t type, const void *w, size_t row_bytes, int nr,
                                                            int64_t n, int nt, const act_row *a, float *out,
                                                            int64_t ldo) {
    const int64_t nb = n / QK;
    for (int r0 = 0; r0 < nr; r0 += MR) {
        const int nrr = nr - r0 < MR ? nr - r0 : MR;
        const uint8_t *rows[MR]; /* a short row block repeats its last row (results dropped) */
        for (int r = 0; r < MR; r++) rows[r] = (const uint8_t *)w + (size_t)(r0 + (r < nrr ? r : nrr - 1)) * row_bytes;
        float *o = out + r0;
        switch (nt) {
        case 1: fused4(type, rows, nb, 1, a, o, nrr, ldo); continue;
        case 2: fused4(type, rows, nb, 2, a, o, nrr, ldo); continue;
        case 3: fused4(type, rows, nb, 3, a, o, nrr, ldo); continue;
        case 4: fused4(type, rows, nb, 4, a, o, nrr, ldo); continue;
        default: break;
        }
        blk4 kb[nb]; /* the row block unpacked once: ~192 bytes per block, reused by every token */
        kscales ks;
        for (int64_t b = 0; b < nb; b++) load_blk4(type, rows, b, &ks, &kb[b]);
        int t = 0;
        for (; t + 4 <= nt; t += 4) buffered4(type, kb, nb, 4, a + t, o + t * ldo, nrr, ldo);
        switch (nt - t) {
        case 1: buffered4(type, kb, nb, 1, a + t, o + t * ldo, nrr, ldo); break;
        case 2: buffered4(type, kb, nb, 2, a + t, o + t * ldo, nrr, ldo); break;
        case 3: buffered4(type, kb, nb, 3, a + t, o + t * ldo, nrr, ldo); break;
        default: break;
        }
    }
}

#define DEF_GEMM_AVX2(NAME, TYPE)                                                                      \
    static void NAME(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, float *out, \
                     int64_t ldo) {                                                                    \
        gemm_avx2(TYPE, w, row_bytes, nr, n, nt, a, out, ldo);                                         \
    }

DEF_GEMM_AVX2(dot_q4_0_avx2, ST_TYPE_Q4_0)
DEF_GEMM_AVX2(dot_q4_1_avx2, ST_TYPE_Q4_1)
DEF_GEMM_AVX2(dot_q5_0_avx2, ST_TYPE_Q5_0)
DEF_GEMM_AVX2(dot_q5_1_avx2, ST_TYPE_Q5_1)
DEF_GEMM_AVX2(dot_q8_0_avx2, ST_TYPE_Q8_0)
DEF_GEMM_AVX2(dot_q4_k_avx2, ST_TYPE_Q4_K)
DEF_GEMM_AVX2(dot_q5_k_avx2, ST_TYPE_Q5_K)
DEF_GEMM_AVX2(dot_q6_k_avx2, ST_TYPE_Q6_K)

/* Float weights: 4 independent 8-wide accumulators, scalar tail. */
#define DEF_DOT_F_AVX2(NAME, ELEM_T, LOAD8, CONV1)                                   \
    static void NAME(const void *w, const float *x, int64_t n, float *out) {        \
        const ELEM_T *v = w;                                                        \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                 \
        int64_t i = 0;                                                              \
        for (; i + 32 <= n; i += 32) {                                              \
            a0 = _mm256_fmadd_ps(LOAD8(v + i), _mm256_loadu_ps(x + i), a0);         \
            a1 = _mm256_fmadd_ps(LOAD8(v + i + 8), _mm256_loadu_ps(x + i + 8), a1); \
            a2 = _mm256_fmadd_ps(LOAD8(v + i + 16), _mm256_loadu_ps(x + i + 16), a2); \
            a3 = _mm256_fmadd_ps(LOAD8(v + i + 24), _mm256_loadu_ps(x + i + 24), a3); \
        }                                                                           \
        for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(LOAD8(v + i), _mm256_loadu_ps(x + i), a0); \
        float acc = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));          \
        for (; i < n; i++) acc += CONV1(v[i]) * x[i];                               \
        *out = acc;                                                                 \
    }

#define LD_F32(p) _mm256_loadu_ps(p)
#define LD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define ID_F32(x) (x)

DEF_DOT_F_AVX2(dot_f32_avx2, float, LD_F32, ID_F32)
DEF_DOT_F_AVX2(dot_f16_avx2, f16_t, LD_F16, f16_to_f32)
DEF_DOT_F_AVX2(dot_bf16_avx2, uint16_t, LD_BF16, bf16_to_f32)

dot_q_fn st_dot_q_avx2(int32_t type) {
    switch (type) {
    case ST_TYPE_Q4_0: return dot_q4_0_avx2;
    case ST_TYPE_Q4_1: return dot_q4_1_avx2;
    case ST_TYPE_Q5_0: return dot_q5_0_avx2;
    case ST_TYPE_Q5_1: return dot_q5_1_avx2;
    case ST_TYPE_Q8_0: return dot_q8_0_avx2;
    case ST_TYPE_Q4_K: return dot_q4_k_avx2;
    case ST_TYPE_Q5_K: return dot_q5_k_avx2;
    case ST_TYPE_Q6_K: return dot_q6_k_avx2;
    default: return NULL;
    }
}

dot_f_fn st_dot_f_avx2(int32_t type) {
    switch (type) {
    case ST_TYPE_F32: return dot_f32_avx2;
    case ST_TYPE_F16: return dot_f16_avx2;
    case ST_TYPE_BF16: return dot_bf16_avx2;
    default: return NULL;
    }
}
#else
#include "internal.h"
dot_q_fn st_dot_q_avx2(int32_t type) { (void)type; return NULL; }
dot_f_fn st_dot_f_avx2(int32_t type) { (void)type; return NULL; }
#endif
