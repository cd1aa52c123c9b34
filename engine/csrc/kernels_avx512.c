/* AVX-512 (F/BW/VL) + VNNI kernels: two 32-element sub-blocks per 512-bit register,
 * vpdpbusd for the u8 x s8 sums, float scales applied per sub-block half. */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include "simd_unpack.h"

static inline __m512 scales4(float a, float b, float c, float d) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_setr_m128(_mm_set1_ps(a), _mm_set1_ps(b))),
                              _mm256_setr_m128(_mm_set1_ps(c), _mm_set1_ps(d)), 1);
}

static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

/* One weight row against nt tokens: each pair of sub-blocks is unpacked once. */
#define DEF_DOT_Q_AVX512(NAME, TYPE)                                                                         \
    static void NAME(const void *w, int64_t n, int nt, const int8_t *const *qs, const float *const *d,     \
                     const int32_t *const *s, float *out) {                                              \
        __m512 acc[ST_MAX_NT];                                                                            \
        float corr[ST_MAX_NT];                                                                            \
        for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps(), corr[t] = 0.0f;                        \
        const int64_t nsb = n_subblocks(n);                                                               \
        int64_t sb = 0;                                                                                   \
        for (; sb + 2 <= nsb; sb += 2) {                                                                  \
            const subblk r0 = load_sub(TYPE, w, sb), r1 = load_sub(TYPE, w, sb + 1);                     \
            const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(r0.u), r1.u, 1);                \
            for (int t = 0; t < nt; t++) {                                                                \
                const float dx0 = d[t][sb], dx1 = d[t][sb + 1];                                           \
                const __m512i av = _mm512_loadu_si512((const void *)(qs[t] + sb * QK));                   \
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, av);                    \
                const __m512 sc = scales4(r0.s_lo * dx0, r0.s_hi * dx0, r1.s_lo * dx1, r1.s_hi * dx1);   \
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[t]);                              \
                corr[t] += sub_corr(&r0, dx0, s[t], sb) + sub_corr(&r1, dx1, s[t], sb + 1);               \
            }                                                                                             \
        }                                                                                                 \
        for (int t = 0; t < nt; t++) {                                                                    \
            float tail = 0.0f;                                                                            \
            if (sb < nsb) { /* odd sub-block count: one 256-bit step */                                  \
                const subblk r = load_sub(TYPE, w, sb);                                                   \
                const float dx = d[t][sb];                                                                \
                const __m256i av = _mm256_loadu_si256((const __m256i *)(qs[t] + sb * QK));                \
                const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), r.u, av);                  \
                const __m256 sc = _mm256_setr_m128(_mm_set1_ps(r.s_lo * dx), _mm_set1_ps(r.s_hi * dx));  \
                tail = hsum256(_mm256_mul_ps(_mm256_cvtepi32_ps(p), sc)) + sub_corr(&r, dx, s[t], sb);    \
            }                                                                                             \
            out[t] = hsum512(acc[t]) + corr[t] + tail;                                                    \
        }                                                                                                 \
    }

DEF_DOT_Q_AVX512(dot_q4_0_avx512, ST_TYPE_Q4_0)
DEF_DOT_Q_AVX512(dot_q4_1_avx512, ST_TYPE_Q4_1)
DEF_DOT_Q_AVX512(dot_q5_0_avx512, ST_TYPE_Q5_0)
DEF_DOT_Q_AVX512(dot_q5_1_avx512, ST_TYPE_Q5_1)
DEF_DOT_Q_AVX512(dot_q8_0_avx512, ST_TYPE_Q8_0)
DEF_DOT_Q_AVX512(dot_q4_k_avx512, ST_TYPE_Q4_K)
DEF_DOT_Q_AVX512(dot_q5_k_avx512, ST_TYPE_Q5_K)
DEF_DOT_Q_AVX512(dot_q6_k_avx512, ST_TYPE_Q6_K)

#define DEF_DOT_F_AVX512(NAME, ELEM_T, LOAD16, CONV1)                                     \
    static void NAME(const void *w, const float *x, int64_t n, float *out) {             \
        const ELEM_T *v = w;                                                             \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;                                        \
        int64_t i = 0;                                                                   \
        for (; i + 32 <= n; i += 32) {                                                   \
            a0 = _mm512_fmadd_ps(LOAD16(v + i), _mm512_loadu_ps(x + i), a0);             \
            a1 = _mm512_fmadd_ps(LOAD16(v + i + 16), _mm512_loadu_ps(x + i + 16), a1);   \
        }                                                                                \
        for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(LOAD16(v + i), _mm512_loadu_ps(x + i), a0); \
        float acc = hsum512(_mm512_add_ps(a0, a1));                                      \
        for (; i < n; i++) acc += CONV1(v[i]) * x[i];                                    \
        *out = acc;                                                                      \
    }

#define LD16_F32(p) _mm512_loadu_ps(p)
#define LD16_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LD16_BF16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define ID_F32(x) (x)

DEF_DOT_F_AVX512(dot_f32_avx512, float, LD16_F32, ID_F32)
DEF_DOT_F_AVX512(dot_f16_avx512, f16_t, LD16_F16, f16_to_f32)
DEF_DOT_F_AVX512(dot_bf16_avx512, uint16_t, LD16_BF16, bf16_to_f32)

dot_q_fn st_dot_q_avx512(int32_t type) {
    switch (type) {
    case ST_TYPE_Q4_0: return dot_q4_0_avx512;
    case ST_TYPE_Q4_1: return dot_q4_1_avx512;
    case ST_TYPE_Q5_0: return dot_q5_0_avx512;
    case ST_TYPE_Q5_1: return dot_q5_1_avx512;
    case ST_TYPE_Q8_0: return dot_q8_0_avx512;
    case ST_TYPE_Q4_K: return dot_q4_k_avx512;
    case ST_TYPE_Q5_K: return dot_q5_k_avx512;
    case ST_TYPE_Q6_K: return dot_q6_k_avx512;
    default: return NULL;
    }
}

dot_f_fn st_dot_f_avx512(int32_t type) {
    switch (type) {
    case ST_TYPE_F32: return dot_f32_avx512;
    case ST_TYPE_F16: return dot_f16_avx512;
    case ST_TYPE_BF16: return dot_bf16_avx512;
    default: return NULL;
    }
}
#else
#include "internal.h"
dot_q_fn st_dot_q_avx512(int32_t type) { (void)type; return NULL; }
dot_f_fn st_dot_f_avx512(int32_t type) { (void)type; return NULL; }
#endif
