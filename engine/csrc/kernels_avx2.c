/* AVX2 + FMA + F16C kernels. Integer sums per 32-element sub-block with
 * maddubs (u8 x s8 -> s16 pairs; weights here are <= 63, so no saturation; Q8_0 uses
 * |w| x sign(a, w)) and the float scale applied per half sub-block; the same math as the
 * reference kernels. */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#define GEMM_VNNI 0
#include "gemm_int8.h"
#include "gemm_iq.h"
#include "gemm_lowbit.h"
#include "gemm_kq8.h"

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
    if (st_type_is_iq(type)) return gemm_iq_pick(type);
    if (st_type_q8k(type)) return gemm_kq8_pick(type);
    return gemm_pick(type) ? gemm_pick(type) : gemm_pick_lowbit(type);
}

/* Activation quantisation, the scalar definition (quants.c) vectorised with the same float
 * operations: amax / 127, 1 / d, x * id rounded half away from zero (roundf: truncate, then
 * step away from zero when the exact remainder is >= 0.5), integer sums. Same bytes and
 * floats as st_quantize_act_row; the harness compares the two. */
static void quant_act_avx2(const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums, float *xs8, float *xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k), mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float db = _mm_cvtss_f32(m4) / 127.0f, id = db != 0.0f ? 1.0f / db : 0.0f;
        d[b] = db;
        __m256i q[4];
        for (int k = 0; k < 4; k++) {
            const __m256 s = _mm256_mul_ps(v[k], _mm256_set1_ps(id));
            const __m256 t = _mm256_round_ps(s, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(s, t)), half, _CMP_GE_OQ);
            q[k] = _mm256_cvtps_epi32(_mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(sign, s)))));
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(qs + b * QK), _mm256_permutevar8x32_epi32(p, order));
        int32_t s2[2];
        for (int h = 0; h < 2; h++) {
            const __m256i a = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
            __m128i r = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
            r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0x4e));
            r = _mm_add_epi32(r, _mm_shuffle_epi32(r, 0xb1));
            s2[h] = _mm_cvtsi128_si32(r);
        }
        sums[2 * b] = s2[0], sums[2 * b + 1] = s2[1];
        const float x0 = db * (float)s2[0], x1 = db * (float)s2[1];
        if (xs8) _mm256_storeu_ps(xs8 + b * 8, _mm256_setr_m128(_mm_set1_ps(x0), _mm_set1_ps(x1)));
        if (xs) xs[b] = db * (float)(s2[0] + s2[1]);
    }
}

quant_act_fn st_quant_act_avx2(void) { return quant_act_avx2; }

static void quant_act_k_avx2(const float *x, int64_t n, int8_t *qs, float *d, int16_t *bsums) {
    quant_act_k_avx2_impl(x, n, qs, d, bsums);
}

quant_act_k_fn st_quant_act_k_avx2(void) { return quant_act_k_avx2; }

/* exp(x) for x in [-87.3, 88.3] (clamped): x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in
 * two so n ln2 is exact), exp(r) by its Taylor series to r^7 (truncation < 1e-8 relative),
 * times 2^n built in the exponent field. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* libm's expf per element was ~2% of a 16-sequence step (perf, 1 thread). A tail shorter than
 * 8 goes through the same vector code (zero-padded), so an element's result never depends
 * on where it sits. */
static void silu_mul_avx2(const float *g, const float *u, float *h, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(h + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {
        float gt[8] = {0}, ut[8] = {0}, ht[8];
        memcpy(gt, g + i, sizeof(float) * (size_t)(n - i));
        memcpy(ut, u + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(ht, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
        memcpy(h + i, ht, sizeof(float) * (size_t)(n - i));
    }
}

silu_mul_fn st_silu_mul_avx2(void) { return silu_mul_avx2; }

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
quant_act_fn st_quant_act_avx2(void) { return NULL; }
quant_act_k_fn st_quant_act_k_avx2(void) { return NULL; }
silu_mul_fn st_silu_mul_avx2(void) { return NULL; }
dot_f_fn st_dot_f_avx2(int32_t type) { (void)type; return NULL; }
#endif
