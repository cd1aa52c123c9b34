/* Quant family: dequantisation, the activations' 8-bit blocks, and the sub-block dot product every
 * integer kernel shares (the unpack of each weight type is quant.cuh). */
#include "common.cuh"
#include "../iq_grids.h" /* the IQ codebooks (host tables, copied to the device by iq_tables_setup) */

/* ------------------------------------------------------------ dequantisation */

/* y[n] = dequant(src); one thread per block. */
template <int T> __global__ void k_dequant(const uint8_t *src, float *y, int64_t n_blocks) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_blocks) deq_block<T>(src + i * qt<T>::BB, y + i * qt<T>::BE);
}

/* The IQ codebooks into this device's copies (quant.cuh g_iq*): once per device, before any kernel reads them
 * (gemm_setup, which the model and the harness run on their device). */
static stg_status iq_tables_setup(void) {
    CU(cudaMemcpyToSymbol(g_iq2xxs_grid, iq2xxs_grid, sizeof iq2xxs_grid), "iq tables");
    CU(cudaMemcpyToSymbol(g_iq2xs_grid, iq2xs_grid, sizeof iq2xs_grid), "iq tables");
    CU(cudaMemcpyToSymbol(g_iq2s_grid, iq2s_grid, sizeof iq2s_grid), "iq tables");
    CU(cudaMemcpyToSymbol(g_iq3xxs_grid, iq3xxs_grid, sizeof iq3xxs_grid), "iq tables");
    CU(cudaMemcpyToSymbol(g_iq3s_grid, iq3s_grid, sizeof iq3s_grid), "iq tables");
    CU(cudaMemcpyToSymbol(g_iq_ksigns, iq_ksigns, sizeof iq_ksigns), "iq tables");
    return ST_OK;
}

/* ------------------------------------------------------------ activation quantisation */

/* One 32-block of 8-bit activations from the warp's 32 values (lane i holds element i):
 * q = round(v / (amax / 127)), the scale, and the two sums of 16, exactly as
 * st_quantize_act_row. Shared by every kernel that quantises its output. */
__device__ __forceinline__ void quant_block32(float v, int lane, int8_t *aq, float *ad, int32_t *as2) {
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = (int)roundf(v * id);
    aq[lane] = (int8_t)q;
    int s = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o); /* sums of 16 */
    if (lane == 0) *ad = d, as2[0] = s;
    if (lane == 16) as2[1] = s;
}

/* One warp per 32-block: rows x[R, K] -> aq[R, K], ad[R, K/32], as[R, K/16]; rows flagged in skip (NULL:
 * none) are another launch's and left alone. */
__global__ void k_quant_act(const float *x, int64_t K, int64_t n_rows, int8_t *aq, float *ad, int32_t *as,
                            const int32_t *skip) {
    PDL_ENTER();
    const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const int lane = threadIdx.x % WARP;
    const int64_t nb = K / 32;
    if (gw >= n_rows * nb) return;
    const int64_t r = gw / nb, b = gw % nb;
    if (skip && skip[r]) return;
    quant_block32(x[r * K + b * 32 + lane], lane, aq + r * K + b * 32, ad + r * nb + b, as + r * (K / 16) + 2 * b);
}

/* The per-256 view (the CPU's st_quantize_act_k_row: one scale d = amax / 127 per 256 values, q = round(x / d))
 * written in the per-32 layout every integer kernel reads: aq[R, K] the codes, ad[R, K/32] the group's scale
 * repeated for its 8 blocks, as[R, K/16] the sums of 16. A kernel of a per-256 type (stg_type_k256) then
 * computes sum_b A_b * d * isum_b, the CPU's per-256 product up to the order of the float additions. One warp
 * per 256-group, lane l holding elements 8l .. 8l+7 (a sum of 16 is two lanes). Rows with skip[r] == skip_val
 * (skip NULL: none) are another launch's and left alone. K % 256 == 0. */
__global__ void k_quant_act256(const float *x, int64_t K, int64_t n_rows, int8_t *aq, float *ad, int32_t *as,
                               const int32_t *skip, int32_t skip_val) {
    PDL_ENTER();
    const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const int lane = threadIdx.x % WARP;
    const int64_t ng = K / 256;
    if (gw >= n_rows * ng) return;
    const int64_t r = gw / ng, c = gw % ng;
    if (skip && skip[r] == skip_val) return;
    const int64_t o = r * K + c * 256 + 8 * lane;
    float v[8];
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = x[o + i], m = fmaxf(m, fabsf(v[i]));
    const float amax = warp_max(m); /* a maximum: exact in any order */
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int s = 0;
    uint32_t w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int q = (int)roundf(v[i] * id);
        s += q;
        w[i / 4] |= (uint32_t)(uint8_t)(int8_t)q << (8 * (i % 4));
    }
    *(uint2 *)(aq + o) = make_uint2(w[0], w[1]); /* 8-byte aligned: K % 256 == 0 */
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    if ((lane & 1) == 0) as[r * (K / 16) + c * 16 + lane / 2] = s;
    if (lane < 8) ad[r * (K / 32) + c * 8 + lane] = d;
}

/* A sub-block's contribution added to acc: fma(A, ad * isum, fma(B, ad * asum, acc)), every
 * rounding explicit so that the matvec and the tensor-core GEMM (which must agree bitwise)
 * compile it identically. Two FMAs, one product and the conversion per output and sub-block
 * (the GEMM keeps ad * asum per pair and sub-block in shared memory): the GEMM's epilogue,
 * which runs per mma output, was six float operations as ad * (A * isum + B * asum) + acc. */
__device__ __forceinline__ float sub_acc(float acc, float ad, float A, float B, int isum, float adsum) {
    return __fmaf_rn(A, __fmul_rn(ad, (float)isum), __fmaf_rn(B, adsum, acc));
}

__device__ __forceinline__ float sub_dot(float acc, const sub_w &s, const int8_t *aq, float ad, const int32_t *as) {
    const int4 a0 = ((const int4 *)aq)[0], a1 = ((const int4 *)aq)[1];
    int lo = __dp4a(s.q[0], a0.x, 0);
    lo = __dp4a(s.q[1], a0.y, lo);
    lo = __dp4a(s.q[2], a0.z, lo);
    lo = __dp4a(s.q[3], a0.w, lo);
    int hi = __dp4a(s.q[4], a1.x, 0);
    hi = __dp4a(s.q[5], a1.y, hi);
    hi = __dp4a(s.q[6], a1.z, hi);
    hi = __dp4a(s.q[7], a1.w, hi);
    return sub_acc(acc, ad, s.A, s.B, s.c0 * lo + s.c1 * hi, __fmul_rn(ad, (float)(s.m0 * as[0] + s.m1 * as[1])));
}

/* Quantise rows x[R, K] into (q, d, s). */
static stg_status quantize(cudaStream_t st, const float *x, int64_t R, int64_t K, int8_t *q, float *d, int32_t *s,
                           const int32_t *skip = nullptr) {
    const int64_t warps = R * (K / 32);
    if (warps == 0) return ST_OK;
    launch_k(k_quant_act, (unsigned)((warps * 32 + 255) / 256), 256, 0, st, x, K, R, q, d, s, skip);
    LAUNCHED("quantize activations");
    return ST_OK;
}

/* Rows x[R, K] into the per-256 view of (q, d, s) (k_quant_act256); rows with skip[r] == skip_val left alone. */
static stg_status quantize256(cudaStream_t st, const float *x, int64_t R, int64_t K, int8_t *q, float *d, int32_t *s,
                              const int32_t *skip = nullptr, int32_t skip_val = 1) {
    if (K % 256) return fail(ST_EINVAL, "quantize256: K=%lld is not a multiple of 256", (long long)K);
    const int64_t warps = R * (K / 256);
    if (warps == 0) return ST_OK;
    launch_k(k_quant_act256, (unsigned)((warps * 32 + 255) / 256), 256, 0, st, x, K, R, q, d, s, skip, skip_val);
    LAUNCHED("quantize activations per 256");
    return ST_OK;
}
