/* AVX2 + FMA + F16C kernels. Integer sums per 32-element sub-block with
 * maddubs (u8 x s8 -> s16 pairs; weights here are <= 63, so no saturation; Q8_0 uses
 * |w| x sign(a, w)) and the float scale applied per half sub-block; the same math as the
 * reference kernels. */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#define GEMM_VNNI 0
#include "gemm_int8.h"

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

dot_q_fn st_dot_q_avx2(int32_t type) { return gemm_pick(type); }

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
