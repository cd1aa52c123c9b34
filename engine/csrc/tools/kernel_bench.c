/* Single-thread throughput of the int8 micro-kernel (thread CPU time, best of R, so a busy
 * machine perturbs it less than wall time):
 *   gcc -O3 -std=gnu11 -ffp-contract=off -fno-math-errno -pthread -Iengine/csrc \
 *       engine/csrc/tools/kernel_bench.c engine/csrc/{quants,quants_iq,quants_lowbit,kernels_avx2,kernels_avx512,variants,attention}.c -lm
 *   ./a.out VARIANT TYPE K N NT [R]     e.g. ./a.out 2 3 576 1536 16   (avx2, Q4_1, 1536x576, 16 tokens)
 * Variants: 1 ref, 2 avx2, 3 avx512; types: GGML numbering (2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K,
 * 10 Q2_K, 11 Q3_K, 16 IQ2_XXS, 17 IQ2_XS, 18 IQ3_XXS, 20 IQ4_NL, 21 IQ3_S, 22 IQ2_S, 23 IQ4_XS, 39 MXFP4). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"
#include "quants_lowbit.h"

static double cpu_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s VARIANT TYPE K N NT [REPS]\n", argv[0]);
        return 2;
    }
    const int variant = atoi(argv[1]), type = atoi(argv[2]), K = atoi(argv[3]), N = atoi(argv[4]), nt = atoi(argv[5]);
    const int reps = argc > 6 ? atoi(argv[6]) : 20;
    if (st_set_variant(variant) != ST_OK || !st_type_supported(type) || st_type_is_float(type) || K <= 0 ||
        K % st_type_block_elems(type) || N <= 0 || nt < 1 || nt > ST_MAX_NT) {
        fprintf(stderr, "bad arguments: %s\n", st_last_error());
        return 2;
    }
    const size_t rb = st_row_bytes(type, K);
    uint8_t *w = malloc(rb * (size_t)N);
    srand(1);
    for (size_t i = 0; i < rb * (size_t)N; i++) w[i] = (uint8_t)rand();
    for (size_t i = 1; i < rb * (size_t)N; i += 2) w[i] &= 0x3b; /* keep f16 fields finite wherever they fall */
    if (type == ST_TYPE_MXFP4) /* E8M0 exponents near 2^-5: random ones overflow or go subnormal, which is slow */
        for (size_t i = 0; i < rb * (size_t)N; i += sizeof(blk_mxfp4)) w[i] = (uint8_t)(119 + i % 7);
    float *x = malloc(sizeof(float) * (size_t)K), *xs8 = malloc(sizeof(float) * (size_t)K / 4 * (size_t)nt);
    float *xs = malloc(sizeof(float) * (size_t)K / 32 * (size_t)nt), *d = malloc(sizeof(float) * (size_t)K / 32 * (size_t)nt);
    int8_t *q = malloc((size_t)K * (size_t)nt);
    int32_t *s = malloc(sizeof(int32_t) * (size_t)K / 16 * (size_t)nt);
    int8_t *qk = malloc((size_t)K * (size_t)nt);
    float *dk = malloc(sizeof(float) * ((size_t)K / 256 + 1) * (size_t)nt);
    int16_t *bk = malloc(sizeof(int16_t) * (size_t)K / 16 * (size_t)nt);
    act_row a[ST_MAX_NT];
    for (int t = 0; t < nt; t++) {
        for (int i = 0; i < K; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
        st_quantize_act_row(x, K, q + (size_t)t * K, d + (size_t)t * (K / 32), s + (size_t)t * (K / 16),
                            xs8 + (size_t)t * (K / 4), xs + (size_t)t * (K / 32));
        a[t] = (act_row){q + (size_t)t * K, d + (size_t)t * (K / 32), s + (size_t)t * (K / 16), xs8 + (size_t)t * (K / 4),
                         xs + (size_t)t * (K / 32), NULL, NULL, NULL};
        if (K % 256 == 0) {
            st_quantize_act_k_row(x, K, qk + (size_t)t * K, dk + (size_t)t * (K / 256), bk + (size_t)t * (K / 16));
            a[t].qk = qk + (size_t)t * K, a[t].dk = dk + (size_t)t * (K / 256), a[t].bk = bk + (size_t)t * (K / 16);
        }
    }
    float out[ST_MAX_NT * ST_ROW_BLOCK];
    const dot_q_fn f = st_dot_q(type);
    /* A run repeats the whole matrix until it covers ~16M multiply-adds (once for matrices that
     * size or larger): reading the thread CPU clock is a system call of 1.3-1.6 us on the Zen 3 VM,
     * as long as one 8 x 8192 one-token call, so timing a single small call mostly timed the clock. */
    const double once = (double)N * K * nt;
    const int inner = once >= 16e6 ? 1 : (int)(16e6 / once);
    double best = 1e30, sink = 0.0;
    for (int r = 0; r < reps; r++) {
        const double t0 = cpu_s();
        for (int m = 0; m < inner; m++)
            for (int i = 0; i < N; i += ST_ROW_BLOCK) {
                f(w + (size_t)i * rb, rb, N - i < ST_ROW_BLOCK ? N - i : ST_ROW_BLOCK, K, nt, a, out, ST_ROW_BLOCK);
                sink += out[0];
            }
        const double dt = (cpu_s() - t0) / inner;
        best = dt < best ? dt : best;
    }
    const double macs = once;
    printf("variant %d type %d K %d N %d nt %2d: %8.3f ms  %6.1f GMAC/s  %6.2f GB/s of weights%s\n", variant, type, K, N,
           nt, best * 1e3, macs / best * 1e-9, (double)rb * N / best * 1e-9, sink == 12345.0 ? " " : "");
    return 0;
}
