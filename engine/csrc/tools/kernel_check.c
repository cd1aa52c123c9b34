/* Stand-alone check of the int8 micro-kernels, for machines without the Python test stack
 * (e.g. to try the AVX-512 variant on another CPU):
 *   gcc -O2 -std=gnu11 -ffp-contract=off -fno-math-errno -pthread -Iengine/csrc \
 *       engine/csrc/tools/kernel_check.c engine/csrc/{quants,quants_iq,quants_lowbit,kernels_avx2,kernels_avx512,variants,attention}.c -lm
 * For every quantised type and every variant this CPU runs: each (row, token) of an nr x nt
 * micro-kernel pass (nr 1..8, nt 1..64) equals that row and token alone bit for bit, and is
 * within 1e-4 of the reference kernel relative to sum |w * a| (the Python harness's rules);
 * Q4_1 and Q8_0 rows repacked in groups of 8 (ST_TYPE_*_R8) give the plain rows' bits.
 * Exit status 0 when everything passes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static uint64_t rng_state = 88172645463325252ull;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return rng_state;
}
static float frand(void) { return (float)((double)(rnd() >> 11) / 9007199254740992.0) * 2.0f - 1.0f; }

/* Random blocks with finite small f16 scales at the type's scale fields. */
static void random_row(int32_t type, int64_t n, uint8_t *w) {
    const size_t rb = st_row_bytes(type, n), bs = st_row_bytes(type, st_type_block_elems(type));
    for (size_t i = 0; i < rb; i++) w[i] = (uint8_t)rnd();
    int offs[2] = {0, -1};
    if (type == ST_TYPE_Q4_1 || type == ST_TYPE_Q5_1 || type == ST_TYPE_Q4_K || type == ST_TYPE_Q5_K) offs[1] = 2;
    if (type == ST_TYPE_Q6_K) offs[0] = 208;
    if (type == ST_TYPE_Q2_K) offs[0] = 80, offs[1] = 82;
    if (type == ST_TYPE_Q3_K) offs[0] = 108;
    if (type == ST_TYPE_MXFP4) offs[0] = -1;
    for (size_t b = 0; b < rb / bs; b++)
        for (int k = 0; k < 2; k++)
            if (offs[k] >= 0) {
                const f16_t h = f32_to_f16(frand() * 0.05f);
                memcpy(w + b * bs + (size_t)offs[k], &h, 2);
            }
    if (type == ST_TYPE_MXFP4) /* E8M0 exponents near 2^-5, the size of the f16 scales above */
        for (size_t b = 0; b < rb / bs; b++) w[b * bs] = (uint8_t)(119 + rnd() % 7);
}

int main(void) {
    const int32_t types[] = {ST_TYPE_Q4_0, ST_TYPE_Q4_1, ST_TYPE_Q5_0, ST_TYPE_Q5_1,
                             ST_TYPE_Q8_0, ST_TYPE_Q4_K, ST_TYPE_Q5_K, ST_TYPE_Q6_K,
                             ST_TYPE_IQ2_XXS, ST_TYPE_IQ2_XS, ST_TYPE_IQ2_S, ST_TYPE_IQ3_XXS, ST_TYPE_IQ3_S,
                             ST_TYPE_Q2_K, ST_TYPE_Q3_K, ST_TYPE_IQ4_NL, ST_TYPE_IQ4_XS, ST_TYPE_MXFP4};
    const int64_t lens[] = {256 * 3, 256 * 11 + 32 * 3};
    const int nrs[] = {1, 2, 3, 4, 5, 8}, nts[] = {1, 2, 3, 4, 5, 8, 13, 64};
    const int32_t mask = st_cpu_variants();
    int fails = 0, checked = 0;
    for (int32_t v = ST_VARIANT_REF; v <= ST_VARIANT_AVX512; v++) {
        if (!(mask & (1 << v))) continue;
        for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++)
            for (size_t li = 0; li < 2; li++) {
                const int32_t type = types[ti];
                int64_t n = lens[li];
                if (n % st_type_block_elems(type)) n = 256 * 3;
                const size_t rb = st_row_bytes(type, n);
                uint8_t *w = malloc(rb * 8);
                float *wf = malloc(sizeof(float) * (size_t)n * 8);
                int8_t *q = malloc((size_t)n * 64);
                float *d = malloc(sizeof(float) * (size_t)n / 32 * 64), *x = malloc(sizeof(float) * (size_t)n);
                int32_t *s = malloc(sizeof(int32_t) * (size_t)n / 16 * 64);
                float alone[64][8], blocked[64 * 8];
                for (int r = 0; r < 8; r++) {
                    random_row(type, n, w + (size_t)r * rb);
                    st_dequantize(type, w + (size_t)r * rb, wf + (size_t)r * (size_t)n, n);
                }
                for (int t = 0; t < 64; t++) {
                    for (int64_t i = 0; i < n; i++) x[i] = frand() * (t == 1 ? 1e-3f : 1.0f);
                    st_quantize_act(x, n, q + (size_t)t * (size_t)n, d + (size_t)t * (size_t)(n / 32),
                                    s + (size_t)t * (size_t)(n / 16));
                }
                for (int t = 0; t < 64; t++)
                    for (int r = 0; r < 8; r++) {
                        const int8_t *qt = q + (size_t)t * (size_t)n;
                        const float *dt = d + (size_t)t * (size_t)(n / 32);
                        const int32_t *st = s + (size_t)t * (size_t)(n / 16);
                        float rf;
                        st_vec_dot_q(type, v, w + (size_t)r * rb, qt, dt, st, n, &alone[t][r]);
                        st_vec_dot_q(type, ST_VARIANT_REF, w + (size_t)r * rb, qt, dt, st, n, &rf);
                        double sc = 0.0;
                        for (int64_t i = 0; i < n; i++)
                            sc += fabs((double)wf[(size_t)r * (size_t)n + (size_t)i] * (double)qt[i] * (double)dt[i / 32]);
                        if (!(fabs((double)alone[t][r] - rf) <= 1e-4 * sc)) {
                            if (fails++ < 20)
                                printf("FAIL vs ref: variant %d type %d n %lld row %d tok %d: %g vs %g\n", v, type,
                                       (long long)n, r, t, alone[t][r], rf);
                        }
                    }
                for (size_t a = 0; a < sizeof nrs / sizeof *nrs; a++)
                    for (size_t b = 0; b < sizeof nts / sizeof *nts; b++) {
                        const int nr = nrs[a], nt = nts[b];
                        st_vec_dot_q_rows(type, v, w, nr, nt, q, d, s, n, blocked);
                        checked++;
                        for (int t = 0; t < nt; t++)
                            for (int r = 0; r < nr; r++)
                                if (memcmp(&blocked[t * nr + r], &alone[t][r], 4)) {
                                    if (fails++ < 20)
                                        printf("FAIL blocked != alone: variant %d type %d n %lld nr %d nt %d (r %d t %d): "
                                               "%.9g vs %.9g\n", v, type, (long long)n, nr, nt, r, t,
                                               blocked[t * nr + r], alone[t][r]);
                                }
                    }
                if (type == ST_TYPE_Q4_1 || type == ST_TYPE_Q8_0) { /* repacked at load: the same bits as alone */
                    uint8_t *w8 = malloc(rb * 8);
                    if (type == ST_TYPE_Q4_1) st_repack_q4_1(w, w8, 8, n);
                    else st_repack_q8_0(w, w8, 8, n);
                    for (size_t a = 0; a < sizeof nrs / sizeof *nrs; a++)
                        for (size_t b = 0; b < sizeof nts / sizeof *nts; b++) {
                            const int nr = nrs[a], nt = nts[b];
                            st_vec_dot_q_rows(type == ST_TYPE_Q4_1 ? ST_TYPE_Q4_1_R8 : ST_TYPE_Q8_0_R8, v, w8, nr, nt, q,
                                              d, s, n, blocked);
                            checked++;
                            for (int t = 0; t < nt; t++)
                                for (int r = 0; r < nr; r++)
                                    if (memcmp(&blocked[t * nr + r], &alone[t][r], 4) && fails++ < 20)
                                        printf("FAIL repacked != alone: variant %d n %lld nr %d nt %d (r %d t %d)\n", v,
                                               (long long)n, nr, nt, r, t);
                        }
                    free(w8);
                }
                free(w), free(wf), free(q), free(d), free(x), free(s);
            }
        printf("variant %d checked\n", v);
    }
    printf("%d blocked passes checked, %d failures\n", checked, fails);
    return fails != 0;
}
