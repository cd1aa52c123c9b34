/* AVX-512 (F/BW/VL) + VNNI kernels: two 32-element sub-blocks per 512-bit register,
 * vpdpbusd for the u8 x s8 sums, float scales applied per sub-block half. */
#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include "simd_unpack.h"

static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

/* ---- the register-blocked int8 micro-kernel ----
 * MR = 4 weight rows x up to 4 tokens per pass over pairs of 32-element blocks (64 weights
 * per register). For blocks b, b+1 the four rows' unsigned codes sit in four registers
 * (blk4); per token, four vpdpbusd products are reduced by unpack/add to one vector whose
 * 128-bit lanes are the quarters (b lo, b hi, b+1 lo, b+1 hi) and whose four elements in a
 * lane are the rows; it is converted once, scaled by s(row, quarter) * d(token, block) and
 * accumulated, then the offset / minimum correction c * xs8 is added to the same lanes. A
 * (row, token) result is the sum of its four quarter lanes. An odd last block goes through
 * the same step with its upper half zero. The operations on one lane depend only on that row
 * and that token, so any number of rows or tokens gives the same bits. */
#define MR 4

typedef struct {
    __m512i u[MR];
    __m512 s, c;
} blk4;

static inline __attribute__((always_inline)) void load_blk4(int32_t type, const uint8_t *const *rows, int64_t b,
                                                            int two, blk4 *k) {
    float sv[16], cv[16];
    for (int r = 0; r < MR; r++) {
        const subblk x0 = load_sub(type, rows[r], b);
        sv[r] = x0.s_lo, sv[4 + r] = x0.s_hi;
        cv[r] = x0.m - x0.off * x0.s_lo, cv[4 + r] = x0.m - x0.off * x0.s_hi;
        __m256i hi = _mm256_setzero_si256();
        if (two) {
            const subblk x1 = load_sub(type, rows[r], b + 1);
            hi = x1.u;
            sv[8 + r] = x1.s_lo, sv[12 + r] = x1.s_hi;
            cv[8 + r] = x1.m - x1.off * x1.s_lo, cv[12 + r] = x1.m - x1.off * x1.s_hi;
        } else {
            sv[8 + r] = sv[12 + r] = cv[8 + r] = cv[12 + r] = 0.0f;
        }
        k->u[r] = _mm512_inserti64x4(_mm512_castsi256_si512(x0.u), hi, 1);
    }
    k->s = _mm512_loadu_ps(sv);
    k->c = _mm512_loadu_ps(cv);
}

/* Four rows' 16-lane products -> one vector: per 128-bit lane, the four rows' sums. */
static inline __m512i red4(__m512i p0, __m512i p1, __m512i p2, __m512i p3) {
    const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
    const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

/* Blocks b (and b+1 when two) of four rows against one token. */
static inline __attribute__((always_inline)) __m512 step4(const blk4 *k, const act_row *a, int64_t b, int two,
                                                          __m512 acc) {
    const __mmask64 m8 = two ? ~(__mmask64)0 : (__mmask64)0xffffffffu;
    const __mmask16 m32 = two ? (__mmask16)0xffff : (__mmask16)0x00ff;
    const __m512i av = _mm512_maskz_loadu_epi8(m8, a->q + b * QK);
    const __m512i z = _mm512_setzero_si512();
    const __m512i red = red4(_mm512_dpbusd_epi32(z, k->u[0], av), _mm512_dpbusd_epi32(z, k->u[1], av),
                             _mm512_dpbusd_epi32(z, k->u[2], av), _mm512_dpbusd_epi32(z, k->u[3], av));
    const __m256 d0 = _mm256_broadcast_ss(a->d + b);
    const __m256 d1 = two ? _mm256_broadcast_ss(a->d + b + 1) : _mm256_setzero_ps();
    const __m512 dv = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(red), _mm512_mul_ps(k->s, dv), acc);
    return _mm512_fmadd_ps(k->c, _mm512_maskz_loadu_ps(m32, a->xs8 + b * 8), acc);
}

static inline void finish4(const __m512 *acc, int nt, int nr, float *out, int64_t ldo) {
    for (int t = 0; t < nt; t++) {
        float v[16];
        _mm512_storeu_ps(v, acc[t]);
        for (int r = 0; r < nr; r++) out[t * ldo + r] = (v[r] + v[4 + r]) + (v[8 + r] + v[12 + r]);
    }
}

static inline __attribute__((always_inline)) void fused4(int32_t type, const uint8_t *const *rows, int64_t nb, int NT,
                                                         const act_row *a, float *out, int nr, int64_t ldo) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; b += 2) {
        const int two = b + 1 < nb;
        blk4 k;
        load_blk4(type, rows, b, two, &k);
        for (int t = 0; t < NT; t++) acc[t] = step4(&k, &a[t], b, two, acc[t]);
    }
    finish4(acc, NT, nr, out, ldo);
}

static inline __attribute__((always_inline)) void buffered4(const blk4 *kb, int64_t nb, int NT, const act_row *a,
                                                            float *out, int nr, int64_t ldo) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < nb; b += 2)
        for (int t = 0; t < NT; t++) acc[t] = step4(&kb[b / 2], &a[t], b, b + 1 < nb, acc[t]);
    finish4(acc, NT, nr, out, ldo);
}

static inline __attribute__((always_inline)) void gemm_avx512(int32_t type, const void *w, size_t row_bytes, int nr,
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
        blk4 kb[(nb + 1) / 2]; /* the row block unpacked once (~384 bytes per 64 weights) */
        for (int64_t b = 0; b < nb; b += 2) load_blk4(type, rows, b, b + 1 < nb, &kb[b / 2]);
        int t = 0;
        for (; t + 4 <= nt; t += 4) buffered4(kb, nb, 4, a + t, o + t * ldo, nrr, ldo);
        switch (nt - t) {
        case 1: buffered4(kb, nb, 1, a + t, o + t * ldo, nrr, ldo); break;
        case 2: buffered4(kb, nb, 2, a + t, o + t * ldo, nrr, ldo); break;
        case 3: buffered4(kb, nb, 3, a + t, o + t * ldo, nrr, ldo); break;
        default: break;
        }
    }
}

#define DEF_GEMM_AVX512(NAME, TYPE)                                                                    \
    static void NAME(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, float *out, \
                     int64_t ldo) {                                                                    \
        gemm_avx512(TYPE, w, row_bytes, nr, n, nt, a, out, ldo);                                       \
    }

DEF_GEMM_AVX512(dot_q4_0_avx512, ST_TYPE_Q4_0)
DEF_GEMM_AVX512(dot_q4_1_avx512, ST_TYPE_Q4_1)
DEF_GEMM_AVX512(dot_q5_0_avx512, ST_TYPE_Q5_0)
DEF_GEMM_AVX512(dot_q5_1_avx512, ST_TYPE_Q5_1)
DEF_GEMM_AVX512(dot_q8_0_avx512, ST_TYPE_Q8_0)
DEF_GEMM_AVX512(dot_q4_k_avx512, ST_TYPE_Q4_K)
DEF_GEMM_AVX512(dot_q5_k_avx512, ST_TYPE_Q5_K)
DEF_GEMM_AVX512(dot_q6_k_avx512, ST_TYPE_Q6_K)

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
