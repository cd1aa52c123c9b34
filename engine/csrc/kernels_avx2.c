/* AVX2 + FMA + F16C kernels. Integer sums per 32-element sub-block with
 * maddubs (u8 x s8 -> s16 pairs; weights here are <= 63, so no saturation) and the
 * float scale applied per sub-block; the same math as the reference kernels. */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include "simd_unpack.h"

static inline __m256i dot_u8s8_256(__m256i u, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1));
}

/* The correction term sum(c * xs): 8-lane chunks, then a scalar tail. */
static inline float corr256(const float *c, const float *xs, int64_t nc) {
    __m256 cacc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= nc; j += 8) cacc = _mm256_fmadd_ps(_mm256_loadu_ps(c + j), _mm256_loadu_ps(xs + j), cacc);
    float corr = hsum256(cacc);
    for (; j < nc; j++) corr += c[j] * xs[j];
    return corr;
}

/* One scaled 32-weight step of a token's accumulator. */
#define STEP32(acc, uv, swv, ar, i)                                                                      \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8_256(uv, _mm256_loadu_si256((const __m256i *)((ar).q + (i))))), \
                          _mm256_mul_ps(swv, _mm256_loadu_ps((ar).dx4 + (i) / 4)), acc)

/* Up to 4 tokens straight from the packed row (decode, small expert groups). */
#define FUSED_BODY2(TYPE, NT)                                                                            \
    {                                                                                                  \
        __m256 acc[NT];                                                                                \
        for (int k = 0; k < NT; k++) acc[k] = _mm256_setzero_ps();                                     \
        for (int64_t i = 0; i < n; i += QK) {                                                          \
            const subblk r = load_sub(TYPE, w, i / QK);                                                \
            c[i / 16] = r.m - r.off * r.s_lo, c[i / 16 + 1] = r.m - r.off * r.s_hi;                    \
            const __m256 swv = _mm256_setr_m128(_mm_set1_ps(r.s_lo), _mm_set1_ps(r.s_hi));            \
            for (int k = 0; k < NT; k++) STEP32(acc[k], r.u, swv, a[k], i);                            \
        }                                                                                              \
        for (int k = 0; k < NT; k++) out[k] = hsum256(acc[k]) + corr256(c, a[k].xs, n / 16);           \
        return;                                                                                        \
    }

/* One weight row against nt tokens: up to 4 from registers, more from the row unpacked
 * once (UNPACK_ROW) with four chains per pass; the same arithmetic per token on every path. */
#define DEF_DOT_Q_AVX2(NAME, TYPE)                                                                       \
    static void NAME(const void *w, int64_t n, int nt, const act_row *a, float *out) {                 \
        float c[n / 16];                                                                               \
        switch (nt) {                                                                                  \
        case 1: FUSED_BODY2(TYPE, 1)                                                                   \
        case 2: FUSED_BODY2(TYPE, 2)                                                                   \
        case 3: FUSED_BODY2(TYPE, 3)                                                                   \
        case 4: FUSED_BODY2(TYPE, 4)                                                                   \
        default: break;                                                                                \
        }                                                                                              \
        uint8_t u[n];                                                                                  \
        float sw[n / 4];                                                                               \
        UNPACK_ROW(TYPE, w, n, u, sw, c)                                                               \
        int t = 0;                                                                                     \
        for (; t + 4 <= nt; t += 4) {                                                                  \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                \
            for (int64_t i = 0; i < n; i += QK) {                                                      \
                const __m256i uv = _mm256_loadu_si256((const __m256i *)(u + i));                       \
                const __m256 swv = _mm256_loadu_ps(sw + i / 4);                                        \
                STEP32(a0, uv, swv, a[t], i);                                                          \
                STEP32(a1, uv, swv, a[t + 1], i);                                                      \
                STEP32(a2, uv, swv, a[t + 2], i);                                                      \
                STEP32(a3, uv, swv, a[t + 3], i);                                                      \
            }                                                                                          \
            const __m256 accs[4] = {a0, a1, a2, a3};                                                   \
            for (int k = 0; k < 4; k++) out[t + k] = hsum256(accs[k]) + corr256(c, a[t + k].xs, n / 16); \
        }                                                                                              \
        for (; t < nt; t++) {                                                                          \
            __m256 acc = _mm256_setzero_ps();                                                          \
            for (int64_t i = 0; i < n; i += QK)                                                        \
                STEP32(acc, _mm256_loadu_si256((const __m256i *)(u + i)), _mm256_loadu_ps(sw + i / 4), a[t], i); \
            out[t] = hsum256(acc) + corr256(c, a[t].xs, n / 16);                                       \
        }                                                                                              \
    }

DEF_DOT_Q_AVX2(dot_q4_0_avx2, ST_TYPE_Q4_0)
DEF_DOT_Q_AVX2(dot_q4_1_avx2, ST_TYPE_Q4_1)
DEF_DOT_Q_AVX2(dot_q5_0_avx2, ST_TYPE_Q5_0)
DEF_DOT_Q_AVX2(dot_q5_1_avx2, ST_TYPE_Q5_1)
DEF_DOT_Q_AVX2(dot_q4_k_avx2, ST_TYPE_Q4_K)
DEF_DOT_Q_AVX2(dot_q5_k_avx2, ST_TYPE_Q5_K)
DEF_DOT_Q_AVX2(dot_q6_k_avx2, ST_TYPE_Q6_K)

/* Q8_0 weights are signed: |w| (unsigned) times sign(w)*a keeps maddubs exact. */
static void dot_q8_0_avx2(const void *w, int64_t n, int nt, const act_row *a, float *out) {
    const blk_q8_0 *b = w;
    for (int t = 0; t < nt; t++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n / QK; i++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)b[i].qs);
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a[t].q + i * QK));
            const __m256i p = dot_u8s8_256(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(h2f(b[i].d) * a[t].d[i]), acc);
        }
        out[t] = hsum256(acc);
    }
}

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
