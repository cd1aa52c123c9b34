/* AVX-512 (F/BW/VL) + VNNI kernels: two 32-element sub-blocks per 512-bit register,
 * vpdpbusd for the u8 x s8 sums, float scales applied per sub-block half. */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include "simd_unpack.h"

static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

/* One weight row against nt tokens: the row is unpacked once (UNPACK_ROW), then each
 * token costs a load, a vpdpbusd and one scaled FMA per 64 weights. */
/* The correction term sum(c * xs) as a vector, in 16-lane chunks with a masked tail. */
static inline __m512 corr512(const float *c, const float *xs, int64_t nc) {
    __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps(); /* two chains: half the FMA latency */
    int64_t j = 0;
    for (; j + 32 <= nc; j += 32) {
        c0 = _mm512_fmadd_ps(_mm512_loadu_ps(c + j), _mm512_loadu_ps(xs + j), c0);
        c1 = _mm512_fmadd_ps(_mm512_loadu_ps(c + j + 16), _mm512_loadu_ps(xs + j + 16), c1);
    }
    for (; j + 16 <= nc; j += 16) c0 = _mm512_fmadd_ps(_mm512_loadu_ps(c + j), _mm512_loadu_ps(xs + j), c0);
    if (j < nc) {
        const __mmask16 m = (__mmask16)((1u << (nc - j)) - 1);
        c1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, c + j), _mm512_maskz_loadu_ps(m, xs + j), c1);
    }
    return _mm512_add_ps(c0, c1);
}

/* The odd trailing 32-element sub-block, if any (256-bit). */
static inline float tail256(const uint8_t *u, const int8_t *q, const float *sw, const float *dx4) {
    const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i *)u),
                                          _mm256_loadu_si256((const __m256i *)q));
    return hsum256(_mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(_mm256_loadu_ps(sw), _mm256_loadu_ps(dx4))));
}

/* One scaled 64-weight step of a token's accumulator. */
#define STEP64(acc, uv, swv, ar, i) \
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), uv, _mm512_loadu_si512((ar).q + (i)))), \
                          _mm512_mul_ps(swv, _mm512_loadu_ps((ar).dx4 + (i) / 4)), acc)

static inline __m256 lane_scales(const subblk *r) { return _mm256_setr_m128(_mm_set1_ps(r->s_lo), _mm_set1_ps(r->s_hi)); }

/* One weight row against nt tokens. nt == 1 (decode): unpack in registers as we go.
 * nt > 1: unpack the row once (UNPACK_ROW), then each token costs a load, a vpdpbusd
 * and one scaled FMA per 64 weights. Both paths do the same arithmetic per token, so
 * results are bit-identical (batch invariance). */
/* Up to 4 tokens straight from the packed row: unpack into registers as we go (decode
 * and small expert groups). Per token the arithmetic equals the unpacked path below. */
#define FUSED_BODY(TYPE, NT)                                                                             \
    {                                                                                                  \
        __m512 acc[NT];                                                                                \
        for (int k = 0; k < NT; k++) acc[k] = _mm512_setzero_ps();                                     \
        for (int64_t i = 0; i < n64; i += 64) {                                                        \
            const subblk r0 = load_sub(TYPE, w, i / QK), r1 = load_sub(TYPE, w, i / QK + 1);           \
            c[i / 16] = r0.m - r0.off * r0.s_lo, c[i / 16 + 1] = r0.m - r0.off * r0.s_hi;              \
            c[i / 16 + 2] = r1.m - r1.off * r1.s_lo, c[i / 16 + 3] = r1.m - r1.off * r1.s_hi;          \
            const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(r0.u), r1.u, 1);               \
            const __m512 swv = _mm512_insertf32x8(_mm512_castps256_ps512(lane_scales(&r0)), lane_scales(&r1), 1); \
            for (int k = 0; k < NT; k++) STEP64(acc[k], u, swv, a[k], i);                              \
        }                                                                                              \
        uint8_t ut[32];                                                                                \
        float st[8];                                                                                   \
        if (n64 < n) {                                                                                 \
            const subblk r = load_sub(TYPE, w, n64 / QK);                                              \
            c[n64 / 16] = r.m - r.off * r.s_lo, c[n64 / 16 + 1] = r.m - r.off * r.s_hi;                \
            _mm256_storeu_si256((__m256i *)ut, r.u);                                                   \
            _mm256_storeu_ps(st, lane_scales(&r));                                                     \
        }                                                                                              \
        for (int k = 0; k < NT; k++)                                                                   \
            out[k] = hsum512(_mm512_add_ps(acc[k], corr512(c, a[k].xs, nc))) +                         \
                     (n64 < n ? tail256(ut, a[k].q + n64, st, a[k].dx4 + n64 / 4) : 0.0f);             \
        return;                                                                                        \
    }

/* One weight row against nt tokens. nt <= 4: FUSED_BODY. More: unpack the row once
 * (UNPACK_ROW), then four tokens per pass share each weight load. Every path does the
 * same arithmetic per token, so results are bit-identical (batch invariance). */
#define DEF_DOT_Q_AVX512(NAME, TYPE)                                                                     \
    static void NAME(const void *w, int64_t n, int nt, const act_row *a, float *out) {                 \
        const int64_t n64 = n / 64 * 64, nc = n / 16;                                                  \
        float c[n / 16];                                                                               \
        switch (nt) {                                                                                  \
        case 1: FUSED_BODY(TYPE, 1)                                                                    \
        case 2: FUSED_BODY(TYPE, 2)                                                                    \
        case 3: FUSED_BODY(TYPE, 3)                                                                    \
        case 4: FUSED_BODY(TYPE, 4)                                                                    \
        default: break;                                                                                \
        }                                                                                              \
        uint8_t u[n];                                                                                  \
        float sw[n / 4];                                                                               \
        UNPACK_ROW(TYPE, w, n, u, sw, c)                                                               \
        int t = 0;                                                                                     \
        for (; t + 4 <= nt; t += 4) { /* four independent chains share each weight load */            \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                \
            for (int64_t i = 0; i < n64; i += 64) {                                                    \
                const __m512i uv = _mm512_loadu_si512(u + i);                                          \
                const __m512 swv = _mm512_loadu_ps(sw + i / 4);                                        \
                STEP64(a0, uv, swv, a[t], i);                                                          \
                STEP64(a1, uv, swv, a[t + 1], i);                                                      \
                STEP64(a2, uv, swv, a[t + 2], i);                                                      \
                STEP64(a3, uv, swv, a[t + 3], i);                                                      \
            }                                                                                          \
            const __m512 accs[4] = {a0, a1, a2, a3};                                                   \
            for (int k = 0; k < 4; k++)                                                                \
                out[t + k] = hsum512(_mm512_add_ps(accs[k], corr512(c, a[t + k].xs, nc))) +           \
                             (n64 < n ? tail256(u + n64, a[t + k].q + n64, sw + n64 / 4, a[t + k].dx4 + n64 / 4) : 0.0f); \
        }                                                                                              \
        for (; t < nt; t++) {                                                                          \
            __m512 acc = _mm512_setzero_ps();                                                          \
            for (int64_t i = 0; i < n64; i += 64)                                                      \
                STEP64(acc, _mm512_loadu_si512(u + i), _mm512_loadu_ps(sw + i / 4), a[t], i);          \
            out[t] = hsum512(_mm512_add_ps(acc, corr512(c, a[t].xs, nc))) +                            \
                     (n64 < n ? tail256(u + n64, a[t].q + n64, sw + n64 / 4, a[t].dx4 + n64 / 4) : 0.0f); \
        }                                                                                              \
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
