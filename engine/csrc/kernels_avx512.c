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

#define DEF_DOT_Q_AVX512(NAME, TYPE)                                                                              \
    static void NAME(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) { \
        __m512 acc = _mm512_setzero_ps();                                                                      \
        float corr = 0.0f;                                                                                     \
        const int64_t nsb = n_subblocks(n);                                                                    \
        int64_t sb = 0;                                                                                        \
        for (; sb + 2 <= nsb; sb += 2) {                                                                       \
            const subblk r0 = load_sub(TYPE, w, sb, d[sb], s);                                                 \
            const subblk r1 = load_sub(TYPE, w, sb + 1, d[sb + 1], s);                                         \
            const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(r0.u), r1.u, 1);                     \
            const __m512i av = _mm512_loadu_si512((const void *)(a + sb * QK));                                \
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, av);                             \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scales4(r0.s_lo, r0.s_hi, r1.s_lo, r1.s_hi), acc);  \
            corr += r0.corr + r1.corr;                                                                         \
        }                                                                                                      \
        float tail = 0.0f;                                                                                     \
        if (sb < nsb) {                                                                                        \
            const subblk r = load_sub(TYPE, w, sb, d[sb], s);                                                  \
            const __m256i av = _mm256_loadu_si256((const __m256i *)(a + sb * QK));                             \
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), r.u, av);                           \
            tail = hsum256(_mm256_mul_ps(_mm256_cvtepi32_ps(p),                                                \
                                         _mm256_setr_m128(_mm_set1_ps(r.s_lo), _mm_set1_ps(r.s_hi)))) + r.corr; \
        }                                                                                                      \
        *out = hsum512(acc) + corr + tail;                                                                     \
    }

DEF_DOT_Q_AVX512(dot_q4_0_avx512, ST_TYPE_Q4_0)
DEF_DOT_Q_AVX512(dot_q4_1_avx512, ST_TYPE_Q4_1)
DEF_DOT_Q_AVX512(dot_q5_0_avx512, ST_TYPE_Q5_0)
DEF_DOT_Q_AVX512(dot_q5_1_avx512, ST_TYPE_Q5_1)
DEF_DOT_Q_AVX512(dot_q4_k_avx512, ST_TYPE_Q4_K)
DEF_DOT_Q_AVX512(dot_q5_k_avx512, ST_TYPE_Q5_K)
DEF_DOT_Q_AVX512(dot_q6_k_avx512, ST_TYPE_Q6_K)

/* Q8_0: w + 128 as unsigned bytes (w ^ 0x80), then subtract 128 * sum(a). */
static void dot_q8_0_avx512(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_q8_0 *b = w;
    const int64_t nb = n / QK;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    float corr = 0.0f;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b[i].qs), flip);
        const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b[i + 1].qs), flip);
        const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
        const __m512i av = _mm512_loadu_si512((const void *)(a + i * QK));
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, av);
        const float s0 = f16_to_f32(b[i].d) * d[i], s1 = f16_to_f32(b[i + 1].d) * d[i + 1];
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scales4(s0, s0, s1, s1), acc);
        corr -= 128.0f * (s0 * (float)asum32(s, i) + s1 * (float)asum32(s, i + 1));
    }
    float tail = 0.0f;
    for (; i < nb; i++) {
        int32_t isum = 0;
        for (int l = 0; l < QK; l++) isum += b[i].qs[l] * a[i * QK + l];
        tail += f16_to_f32(b[i].d) * d[i] * (float)isum;
    }
    *out = hsum512(acc) + corr + tail;
}

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
