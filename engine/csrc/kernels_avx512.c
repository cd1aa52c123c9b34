/* AVX-512 (F/BW/VL) + VNNI kernels: two 32-element sub-blocks per 512-bit register,
 * vpdpbusd for the u8 x s8 sums, float scales applied per sub-block half. */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#define GEMM_VNNI 1
#include "gemm_int8.h"
#include "gemm_iq.h"
#include "gemm_lowbit.h"
#include "gemm_kq8.h"

static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

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
    if (st_type_is_iq(type)) return gemm_iq_pick(type);
    if (st_type_q8k(type)) return gemm_kq8_pick(type);
    return gemm_pick(type) ? gemm_pick(type) : gemm_pick_lowbit(type);
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
