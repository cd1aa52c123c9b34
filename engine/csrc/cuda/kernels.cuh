/* The GPU kernels of one step. Shapes: T tokens, E = n_embd, K = a row length.
 * Activations entering a quantised linear layer are quantised once to 8-bit blocks of
 * 32 (aq[T, K] int8, ad[T, K/32] scale, as[T, K/16] sums), exactly as quants.c does. */
#pragma once
#include <float.h>
#include <math.h>

#include "quant.cuh"

#define WARP 32
#define LIN_WARPS 4 /* rows per block of the matvec kernel */

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* expf / cosf / sinf as the CPU's libm gives them (correctly rounded in practice): through
 * double, so the GPU does not add its own last-bit differences to the 8-bit activation
 * rounding that follows (a one-ulp change can move a value across a rounding boundary). */
__device__ __forceinline__ float exp_cr(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + exp_cr(-x)); }

/* ------------------------------------------------------------ dequantisation */

/* y[n] = dequant(src); one thread per block. */
template <int T> __global__ void k_dequant(const uint8_t *src, float *y, int64_t n_blocks) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_blocks) deq_block<T>(src + i * qt<T>::BB, y + i * qt<T>::BE);
}

/* Embedding rows: x[t, :] = dequant(table[tokens[t], :]); grid (T), block over blocks of the row. */
template <int T> __global__ void k_embed(const uint8_t *table, int64_t row_bytes, const int32_t *tokens, int64_t E,
                                         float *x) {
    const int t = blockIdx.x;
    const uint8_t *row = table + (int64_t)tokens[t] * row_bytes;
    for (int64_t b = threadIdx.x; b < E / qt<T>::BE; b += blockDim.x)
        deq_block<T>(row + b * qt<T>::BB, x + (int64_t)t * E + b * qt<T>::BE);
}

/* ------------------------------------------------------------ activation quantisation */

/* One warp per 32-block: rows x[R, K] (row r at x + rows[r] * K when rows != NULL)
 * -> aq[R, K], ad[R, K/32], as[R, K/16]. Same arithmetic as st_quantize_act_row. */
__global__ void k_quant_act(const float *x, int64_t K, int64_t n_rows, int8_t *aq, float *ad, int32_t *as) {
    const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const int lane = threadIdx.x % WARP;
    const int64_t nb = K / 32;
    if (gw >= n_rows * nb) return;
    const int64_t r = gw / nb, b = gw % nb;
    const float v = x[r * K + b * 32 + lane];
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const int q = (int)roundf(v * id);
    aq[r * K + b * 32 + lane] = (int8_t)q;
    int s = q;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o); /* sums of 16 */
    if (lane == 0) ad[r * nb + b] = d, as[r * (K / 16) + 2 * b] = s;
    if (lane == 16) as[r * (K / 16) + 2 * b + 1] = s;
}

/* ------------------------------------------------------------ linear layers */

/* Rows of an input or output matrix are addressed through groups of "pairs":
 * group g holds pairs list[start[g] .. start[g] + count[g]) (list NULL: start + i) of
 * weight matrix (expert) gexp[g]; pair p reads input row in_map[p] (NULL: p) and writes
 * output row p. A dense layer is one group; routed experts are one group per active
 * expert, so one launch covers every expert of a layer. */
struct lin_groups {
    const int32_t *gexp, *gstart, *gcount; /* NULL: one group (expert 0, start 0, count n_pairs) */
    const int32_t *n_groups;               /* device scalar; NULL: gridDim.y */
    const int32_t *list, *in_map;
    int32_t n_pairs;
};

#define MODE_STORE 0
#define MODE_ADD 1    /* out += result (residual) */
#define MODE_SWIGLU 2 /* out = silu(W . x) * (W2 . x) */

struct lin_args {
    const uint8_t *w, *w2;
    int64_t expert_stride, row_bytes;
    int32_t N, K;
    lin_groups g;
    const int8_t *aq;
    const float *ad;
    const int32_t *as;
    const float *x; /* float activations (float weights) */
    float *out;
    int64_t ldo;
    int mode;
};

__device__ __forceinline__ bool group_of(const lin_groups &g, int gi, int &e, int &start, int &count) {
    if (g.gexp) {
        if (g.n_groups && gi >= *g.n_groups) return false;
        e = g.gexp[gi], start = g.gstart[gi], count = g.gcount[gi];
    } else {
        if (gi > 0) return false;
        e = 0, start = 0, count = g.n_pairs;
    }
    return true;
}
__device__ __forceinline__ int pair_at(const lin_groups &g, int start, int i) { return g.list ? g.list[start + i] : start + i; }
__device__ __forceinline__ int in_row(const lin_groups &g, int p) { return g.in_map ? g.in_map[p] : p; }

__device__ __forceinline__ void store_out(const lin_args &a, int p, int r, float v, float v2) {
    float *o = a.out + (int64_t)p * a.ldo + r;
    if (a.mode == MODE_ADD) *o += v;
    else if (a.mode == MODE_SWIGLU) *o = silu_f(v) * v2;
    else *o = v;
}

__device__ __forceinline__ float sub_dot(const sub_w &s, const int8_t *aq, float ad, const int32_t *as) {
    const int4 a0 = ((const int4 *)aq)[0], a1 = ((const int4 *)aq)[1];
    int lo = __dp4a(s.q[0], a0.x, 0);
    lo = __dp4a(s.q[1], a0.y, lo);
    lo = __dp4a(s.q[2], a0.z, lo);
    lo = __dp4a(s.q[3], a0.w, lo);
    int hi = __dp4a(s.q[4], a1.x, 0);
    hi = __dp4a(s.q[5], a1.y, hi);
    hi = __dp4a(s.q[6], a1.z, hi);
    hi = __dp4a(s.q[7], a1.w, hi);
    return ad * (s.A * (float)(s.c0 * lo + s.c1 * hi) + s.B * (float)(as[0] + as[1]));
}

/* Matvec path: one warp per weight row, NT pairs per pass, lanes over 32-sub-blocks. */
template <int T, int NT, bool SW>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_q(lin_args a) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int r = blockIdx.x * LIN_WARPS + warp;
    int e, start, count;
    if (r >= a.N || !group_of(a.g, blockIdx.y, e, start, count)) return;
    const uint8_t *wrow = a.w + e * a.expert_stride + (int64_t)r * a.row_bytes;
    const uint8_t *wrow2 = SW ? a.w2 + e * a.expert_stride + (int64_t)r * a.row_bytes : nullptr;
    const int nsb = a.K / 32;
    for (int p0 = 0; p0 < count; p0 += NT) {
        int rows[NT];
        float acc[NT], acc2[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            rows[t] = p0 + t < count ? in_row(a.g, pair_at(a.g, start, p0 + t)) : -1;
            acc[t] = acc2[t] = 0.0f;
        }
#pragma unroll 2
        for (int j = lane; j < nsb; j += WARP) {
            sub_w s, s2;
            unpack_sub<T>(wrow, j, s);
            if (SW) unpack_sub<T>(wrow2, j, s2);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (rows[t] < 0) continue;
                const int64_t base = (int64_t)rows[t] * a.K;
                const int8_t *q = a.aq + base + 32 * j;
                const float d = a.ad[base / 32 + j];
                const int32_t *sm = a.as + base / 16 + 2 * j;
                acc[t] += sub_dot(s, q, d, sm);
                if (SW) acc2[t] += sub_dot(s2, q, d, sm);
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            acc[t] = warp_sum(acc[t]);
            if (SW) acc2[t] = warp_sum(acc2[t]);
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (rows[t] >= 0) store_out(a, pair_at(a.g, start, p0 + t), r, acc[t], acc2[t]);
        }
    }
}

/* Float weights (F32/F16/BF16) against float activations: warp per row, lanes over elements. */
template <int T, int NT, bool SW>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_f(lin_args a) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int r = blockIdx.x * LIN_WARPS + warp;
    int e, start, count;
    if (r >= a.N || !group_of(a.g, blockIdx.y, e, start, count)) return;
    const uint8_t *wrow = a.w + e * a.expert_stride + (int64_t)r * a.row_bytes;
    const uint8_t *wrow2 = SW ? a.w2 + e * a.expert_stride + (int64_t)r * a.row_bytes : nullptr;
    for (int p0 = 0; p0 < count; p0 += NT) {
        int rows[NT];
        float acc[NT], acc2[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            rows[t] = p0 + t < count ? in_row(a.g, pair_at(a.g, start, p0 + t)) : -1;
            acc[t] = acc2[t] = 0.0f;
        }
#pragma unroll 4
        for (int i = lane; i < a.K; i += WARP) {
            const float w = wf<T>(wrow, i), w2 = SW ? wf<T>(wrow2, i) : 0.0f;
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (rows[t] < 0) continue;
                const float xv = a.x[(int64_t)rows[t] * a.K + i];
                acc[t] = fmaf(w, xv, acc[t]);
                if (SW) acc2[t] = fmaf(w2, xv, acc2[t]);
            }
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            acc[t] = warp_sum(acc[t]);
            if (SW) acc2[t] = warp_sum(acc2[t]);
        }
        if (lane == 0) {
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (rows[t] >= 0) store_out(a, pair_at(a.g, start, p0 + t), r, acc[t], acc2[t]);
        }
    }
}

/* Float weights with few rows (routers: n_expert rows): a block of LIN_WARPS warps per row,
 * the warps splitting the row, their sums added in warp order. The order depends only on
 * the weight's shape, so results stay batch invariant. */
template <int T, int NT>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_f_rows(lin_args a) {
    __shared__ float part[LIN_WARPS][NT];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int r = blockIdx.x;
    int e, start, count;
    if (!group_of(a.g, blockIdx.y, e, start, count)) return;
    const uint8_t *wrow = a.w + e * a.expert_stride + (int64_t)r * a.row_bytes;
    for (int p0 = 0; p0 < count; p0 += NT) {
        int rows[NT];
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            rows[t] = p0 + t < count ? in_row(a.g, pair_at(a.g, start, p0 + t)) : -1;
            acc[t] = 0.0f;
        }
#pragma unroll 4
        for (int i = warp * WARP + lane; i < a.K; i += LIN_WARPS * WARP) {
            const float w = wf<T>(wrow, i);
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (rows[t] >= 0) acc[t] = fmaf(w, a.x[(int64_t)rows[t] * a.K + i], acc[t]);
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            acc[t] = warp_sum(acc[t]);
            if (lane == 0) part[warp][t] = acc[t];
        }
        __syncthreads();
        if (threadIdx.x < NT && rows[threadIdx.x] >= 0) {
            float v = 0.0f;
            for (int wi = 0; wi < LIN_WARPS; wi++) v += part[wi][threadIdx.x];
            store_out(a, pair_at(a.g, start, p0 + threadIdx.x), r, v, 0.0f);
        }
        __syncthreads();
    }
}

/* Tiled matrix-matrix path for quantised weights: a block computes a tile of GM weight
 * rows x GN pairs of one group. Per 32-sub-block step, the weight sub-blocks are unpacked
 * to int8 in shared memory (with their A, B, c0, c1) and the pairs' activation blocks
 * are staged next to them; each thread then forms 4 x 4 outputs with dp4a. */
#define GM 64
#define GN 64
#define GKS 4 /* sub-blocks per shared-memory stage (128 elements) */
template <int T, bool SW>
__global__ void __launch_bounds__(256) k_linear_gemm(lin_args a) {
    __shared__ int ws[SW ? 2 : 1][GKS][GM][9]; /* 8 ints + pad */
    __shared__ float wA[SW ? 2 : 1][GKS][GM], wB[SW ? 2 : 1][GKS][GM];
    __shared__ int wc[SW ? 2 : 1][GKS][GM][2];
    __shared__ int xs[GKS][GN][9];
    __shared__ float xd[GKS][GN];
    __shared__ int xsum[GKS][GN];
    __shared__ int prow[GN];
    int e, start, count;
    if (!group_of(a.g, blockIdx.z, e, start, count)) return;
    const int m0 = blockIdx.x * GM, n0 = blockIdx.y * GN;
    if (n0 >= count) return;
    const int tid = threadIdx.x;
    const int tm = tid % 16, tn = tid / 16; /* thread's rows tm + 16*i, pairs tn + 16*j */
    if (tid < GN) prow[tid] = n0 + tid < count ? in_row(a.g, pair_at(a.g, start, n0 + tid)) : -1;
    const uint8_t *wbase = a.w + e * a.expert_stride;
    const uint8_t *wbase2 = SW ? a.w2 + e * a.expert_stride : nullptr;
    float acc[4][4], acc2[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = acc2[i][j] = 0.0f;
    const int nsb = a.K / 32;
    __syncthreads();
    for (int j0 = 0; j0 < nsb; j0 += GKS) {
        /* stage: GKS x GM weight sub-blocks (x2 for SWIGLU) and GKS x GN activation blocks */
        for (int it = tid; it < GKS * GM * (SW ? 2 : 1); it += 256) {
            const int which = it / (GKS * GM), rem = it % (GKS * GM), ks = rem / GM, m = rem % GM;
            const int j = j0 + ks, r = m0 + m;
            sub_w s;
            if (j < nsb && r < a.N) {
                unpack_sub<T>((which ? wbase2 : wbase) + (int64_t)r * a.row_bytes, j, s);
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) s.q[i] = 0;
                s.A = s.B = 0.0f, s.c0 = s.c1 = 0;
            }
#pragma unroll
            for (int i = 0; i < 8; i++) ws[which][ks][m][i] = s.q[i];
            wA[which][ks][m] = s.A, wB[which][ks][m] = s.B, wc[which][ks][m][0] = s.c0, wc[which][ks][m][1] = s.c1;
        }
        for (int it = tid; it < GKS * GN * 8; it += 256) {
            const int ks = it / (GN * 8), rem = it % (GN * 8), n = rem / 8, i = rem % 8;
            const int j = j0 + ks, row = prow[n];
            const bool ok = j < nsb && row >= 0;
            xs[ks][n][i] = ok ? ((const int *)(a.aq + (int64_t)row * a.K + 32 * j))[i] : 0;
            if (i == 0) {
                xd[ks][n] = ok ? a.ad[(int64_t)row * (a.K / 32) + j] : 0.0f;
                xsum[ks][n] = ok ? a.as[(int64_t)row * (a.K / 16) + 2 * j] + a.as[(int64_t)row * (a.K / 16) + 2 * j + 1] : 0;
            }
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < GKS; ks++) {
            int xv[4][8];
#pragma unroll
            for (int jn = 0; jn < 4; jn++)
#pragma unroll
                for (int i = 0; i < 8; i++) xv[jn][i] = xs[ks][tn + 16 * jn][i];
#pragma unroll
            for (int w2i = 0; w2i < (SW ? 2 : 1); w2i++) {
#pragma unroll
                for (int im = 0; im < 4; im++) {
                    const int m = tm + 16 * im;
                    int wv[8];
#pragma unroll
                    for (int i = 0; i < 8; i++) wv[i] = ws[w2i][ks][m][i];
                    const float A = wA[w2i][ks][m], B = wB[w2i][ks][m];
                    const int c0 = wc[w2i][ks][m][0], c1 = wc[w2i][ks][m][1];
#pragma unroll
                    for (int jn = 0; jn < 4; jn++) {
                        int lo = 0, hi = 0;
#pragma unroll
                        for (int i = 0; i < 4; i++) lo = __dp4a(wv[i], xv[jn][i], lo);
#pragma unroll
                        for (int i = 4; i < 8; i++) hi = __dp4a(wv[i], xv[jn][i], hi);
                        const int n = tn + 16 * jn;
                        const float v = xd[ks][n] * (A * (float)(c0 * lo + c1 * hi) + B * (float)xsum[ks][n]);
                        if (w2i == 0) acc[im][jn] += v;
                        else acc2[im][jn] += v;
                    }
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int im = 0; im < 4; im++)
#pragma unroll
        for (int jn = 0; jn < 4; jn++) {
            const int r = m0 + tm + 16 * im, n = n0 + tn + 16 * jn;
            if (r < a.N && n < count) store_out(a, pair_at(a.g, start, n), r, acc[im][jn], acc2[im][jn]);
        }
}

/* Reference linear kernel: one thread per (output row, pair), sub-blocks in order; the
 * gate/up form computes the second dot the same way. */
template <int T>
__device__ float ref_dot(const lin_args &a, const uint8_t *wrow, int64_t base) {
    float acc = 0.0f;
    if constexpr (T == STG_F32 || T == STG_F16 || T == STG_BF16) {
        for (int k = 0; k < a.K; k++) acc = fmaf(wf<T>(wrow, k), a.x[base + k], acc);
    } else {
        for (int j = 0; j < a.K / 32; j++) {
            sub_w s;
            unpack_sub<T>(wrow, j, s);
            acc += sub_dot(s, a.aq + base + 32 * j, a.ad[base / 32 + j], a.as + base / 16 + 2 * j);
        }
    }
    return acc;
}

template <int T>
__global__ void k_linear_ref(lin_args a) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    int e, start, count;
    if (r >= a.N || !group_of(a.g, blockIdx.y, e, start, count)) return;
    const int64_t off = e * a.expert_stride + (int64_t)r * a.row_bytes;
    for (int i = 0; i < count; i++) {
        const int p = pair_at(a.g, start, i);
        const int64_t base = (int64_t)in_row(a.g, p) * a.K;
        const float v = ref_dot<T>(a, a.w + off, base), v2 = a.w2 ? ref_dot<T>(a, a.w2 + off, base) : 0.0f;
        store_out(a, p, r, v, v2);
    }
}

/* ------------------------------------------------------------ norms, rope, KV */

/* y[r] = w * (x[r] * 1/sqrt(mean(x^2) + eps)), the sum of squares in double like rmsnorm_row.
 * Rows r = rows[i] when rows != NULL (output row i). One block per row. With aq != NULL
 * (n a multiple of 32) the normalised row is also quantised to 8-bit blocks, exactly as
 * k_quant_act would (one launch instead of two). */
__global__ void k_rmsnorm(const float *x, const int32_t *rows, const float *w, float *y, int64_t n, float eps,
                          int8_t *aq, float *ad, int32_t *as) {
    __shared__ double red[32];
    const int64_t r = rows ? rows[blockIdx.x] : blockIdx.x;
    const float *xr = x + r * n;
    double ss = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int i = 0; i < (int)(blockDim.x / 32); i++) t += red[i];
        red[0] = t;
    }
    __syncthreads();
    const float scale = (float)(1.0 / sqrt(red[0] / (double)n + (double)eps));
    float *yr = y + (int64_t)blockIdx.x * n;
    if (!aq) {
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) yr[i] = __fmul_rn(w[i], __fmul_rn(xr[i], scale));
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    const int64_t nb = n / 32, row = blockIdx.x;
    for (int64_t b = warp; b < nb; b += nw) {
        const int64_t i = 32 * b + lane;
        const float v = __fmul_rn(w[i], __fmul_rn(xr[i], scale));
        yr[i] = v;
        const float amax = warp_max(fabsf(v));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const int q = (int)roundf(v * id);
        aq[row * n + i] = (int8_t)q;
        int sm = q;
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) sm += __shfl_xor_sync(0xffffffffu, sm, o);
        if (lane == 0) ad[row * nb + b] = d, as[row * (n / 16) + 2 * b] = sm;
        if (lane == 16) as[row * (n / 16) + 2 * b + 1] = sm;
    }
}

/* Per-head RMSNorm over hd elements of a row, in place (q/k norms). One warp per head. */
__device__ void head_rmsnorm(float *v, const float *w, int hd, float eps, int lane) {
    double ss = 0.0;
    for (int i = lane; i < hd; i += 32) ss += (double)v[i] * (double)v[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float scale = (float)(1.0 / sqrt(ss / (double)hd + (double)eps));
    __syncwarp();
    for (int i = lane; i < hd; i += 32) v[i] = __fmul_rn(w[i], __fmul_rn(v[i], scale));
    __syncwarp();
}

__device__ __forceinline__ void rope_pair(float *v, int i, int rope_dim, int rope_type, float cs, float sn) {
    const int a = rope_type == 2 ? i : 2 * i, b = rope_type == 2 ? i + rope_dim / 2 : 2 * i + 1;
    const float x0 = v[a], x1 = v[b];
    v[a] = __fsub_rn(__fmul_rn(x0, cs), __fmul_rn(x1, sn));
    v[b] = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, cs));
}

struct qkv_args {
    float *q, *k, *v; /* [T, q_dim], [T, kv_dim] x2 */
    const float *bq, *bk, *bv, *q_norm, *k_norm, *inv_freq;
    const int32_t *pos, *seq, *block_tables;
    int32_t max_blocks, n_head, n_kv, hd, rope_dim, rope_type, block_size;
    float eps, scale;
    __half *kc, *vc; /* this layer's K / V arena */
};

/* One block per token: biases, q/k norms, RoPE, q scaling, K/V written to the cache. */
__global__ void k_qkv_post(qkv_args a) {
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    const int qd = a.n_head * a.hd, kd = a.n_kv * a.hd;
    float *q = a.q + (int64_t)t * qd, *k = a.k + (int64_t)t * kd, *v = a.v + (int64_t)t * kd;
    if (a.bq) for (int i = threadIdx.x; i < qd; i += blockDim.x) q[i] += a.bq[i];
    if (a.bk) for (int i = threadIdx.x; i < kd; i += blockDim.x) k[i] += a.bk[i];
    if (a.bv) for (int i = threadIdx.x; i < kd; i += blockDim.x) v[i] += a.bv[i];
    __syncthreads();
    const int32_t p = a.pos[t];
    for (int h = warp; h < a.n_head + a.n_kv; h += nw) {
        const bool isq = h < a.n_head;
        float *hv = isq ? q + h * a.hd : k + (h - a.n_head) * a.hd;
        if (a.q_norm) head_rmsnorm(hv, isq ? a.q_norm : a.k_norm, a.hd, a.eps, lane);
        for (int i = lane; i < a.rope_dim / 2; i += 32) {
            const float theta = __fmul_rn((float)p, a.inv_freq[i]);
            rope_pair(hv, i, a.rope_dim, a.rope_type, (float)cos((double)theta), (float)sin((double)theta));
        }
        __syncwarp();
        if (isq)
            for (int i = lane; i < a.hd; i += 32) hv[i] = __fmul_rn(hv[i], a.scale);
    }
    __syncthreads();
    const int32_t blk = a.block_tables[(int64_t)a.seq[t] * a.max_blocks + p / a.block_size], slot = p % a.block_size;
    const int64_t kbase = (int64_t)blk * kd * a.block_size;
    for (int i = threadIdx.x; i < kd; i += blockDim.x) {
        a.kc[kbase + (int64_t)i * a.block_size + slot] = __float2half_rn(k[i]);
        a.vc[kbase + (int64_t)slot * kd + i] = __float2half_rn(v[i]);
    }
}

/* ------------------------------------------------------------ attention */

struct attn_args {
    const float *q; /* [T, n_head * hd], pre-scaled */
    float *out;     /* [T, n_head * hd] */
    const __half *kc, *vc;
    const int32_t *pos, *seq, *block_tables;
    int32_t max_blocks, n_head, n_kv, hd, block_size;
};

/* Flash-decoding style: one block per (token, head); its ATT_WARPS warps take interleaved
 * passes of 32 keys each with an online softmax (lane = key for the scores: K is
 * slot-contiguous, so one dimension of 32 keys is one coalesced read; lane = dimension for
 * the values), and the warps' partial (max, sum, output) are merged at the end. */
#define ATT_WARPS 4
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attention(attn_args a) {
    __shared__ float qs[256];
    __shared__ float part[ATT_WARPS][256 + 2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x, h = blockIdx.y;
    const int hd = a.hd, kd = a.n_kv * hd, kvh = h / (a.n_head / a.n_kv);
    const float *q = a.q + (int64_t)t * a.n_head * hd + h * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[i];
    __syncthreads();
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t] * a.max_blocks;
    const int32_t n_keys = a.pos[t] + 1;
    float m = -INFINITY, l = 0.0f, acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    for (int32_t j0 = 32 * warp; j0 < n_keys; j0 += 32 * ATT_WARPS) {
        const int32_t j = j0 + lane;
        const bool ok = j < n_keys;
        int64_t voff = 0;
        float s = -INFINITY;
        if (ok) {
            const int64_t blk = bt[j / a.block_size];
            const int slot = j % a.block_size;
            const int64_t koff = (blk * kd + (int64_t)kvh * hd) * a.block_size + slot;
            voff = (blk * a.block_size + slot) * kd + (int64_t)kvh * hd;
            const __half *kp = a.kc + koff;
            float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f; /* four chains */
            for (int c = 0; c < hd; c += 16) { /* 16 loads issued before the first use */
                float kf[16];
#pragma unroll
                for (int u = 0; u < 16; u++) kf[u] = __half2float(kp[(int64_t)(c + u) * a.block_size]);
#pragma unroll
                for (int u = 0; u < 16; u += 4) {
                    d0 = fmaf(qs[c + u], kf[u], d0);
                    d1 = fmaf(qs[c + u + 1], kf[u + 1], d1);
                    d2 = fmaf(qs[c + u + 2], kf[u + 2], d2);
                    d3 = fmaf(qs[c + u + 3], kf[u + 3], d3);
                }
            }
            s = (d0 + d1) + (d2 + d3);
        }
        const float mn = fmaxf(m, warp_max(s));
        const float corr = expf(m - mn); /* 0 on the warp's first pass (m = -inf) */
        const float pj = ok ? expf(s - mn) : 0.0f;
        l = l * corr + warp_sum(pj);
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] *= corr;
        const int nk = n_keys - j0 < 32 ? n_keys - j0 : 32;
        for (int jj0 = 0; jj0 < nk; jj0 += 4) { /* 4 keys' values loaded before use */
            float pb[4], vv[4][8];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int jj = jj0 + u < nk ? jj0 + u : nk - 1; /* past the end: weight 0 below */
                pb[u] = __shfl_sync(0xffffffffu, pj, jj);
                if (jj0 + u >= nk) pb[u] = 0.0f;
                const __half *vp = a.vc + __shfl_sync(0xffffffffu, voff, jj);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int d = lane + 32 * i;
                    vv[u][i] = d < hd ? __half2float(vp[d]) : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < 4; u++)
#pragma unroll
                for (int i = 0; i < 8; i++) acc[i] = fmaf(pb[u], vv[u][i], acc[i]);
        }
        m = mn;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int d = lane + 32 * i;
        if (d < hd) part[warp][d] = acc[i];
    }
    if (lane == 0) part[warp][256] = m, part[warp][257] = l;
    __syncthreads();
    float M = -INFINITY;
    for (int wi = 0; wi < ATT_WARPS; wi++) M = fmaxf(M, part[wi][256]);
    float L = 0.0f, sc[ATT_WARPS];
    for (int wi = 0; wi < ATT_WARPS; wi++) {
        sc[wi] = part[wi][257] > 0.0f ? expf(part[wi][256] - M) : 0.0f; /* a warp with no keys adds nothing */
        L += part[wi][257] * sc[wi];
    }
    float *o = a.out + (int64_t)t * a.n_head * hd + h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float v = 0.0f;
        for (int wi = 0; wi < ATT_WARPS; wi++) v += part[wi][d] * sc[wi];
        o[d] = v / L;
    }
}

/* Reference attention: one thread per (token, head), two passes exactly like attn_ref in
 * attention.c (scores, max, exp and sum in key order, fma chain over keys per dimension). */
__global__ void k_attention_ref(attn_args a, float *scratch, int32_t max_keys) {
    const int t = blockIdx.x, h = threadIdx.x;
    if (h >= a.n_head) return;
    const int hd = a.hd, kd = a.n_kv * hd, kvh = h / (a.n_head / a.n_kv);
    const float *q = a.q + (int64_t)t * a.n_head * hd + h * hd;
    float *s = scratch + ((int64_t)t * a.n_head + h) * max_keys;
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t] * a.max_blocks;
    const int32_t nk = a.pos[t] + 1;
    float mx = -INFINITY;
    for (int32_t j = 0; j < nk; j++) {
        const __half *kp = a.kc + ((int64_t)bt[j / a.block_size] * kd + (int64_t)kvh * hd) * a.block_size + j % a.block_size;
        float acc = 0.0f;
        for (int d = 0; d < hd; d++) acc = fmaf(q[d], __half2float(kp[(int64_t)d * a.block_size]), acc);
        s[j] = acc;
        mx = fmaxf(mx, acc);
    }
    float sum = 0.0f;
    for (int32_t j = 0; j < nk; j++) sum += (s[j] = expf(s[j] - mx));
    float *o = a.out + (int64_t)t * a.n_head * hd + h * hd;
    for (int d = 0; d < hd; d++) {
        float acc = 0.0f;
        for (int32_t j = 0; j < nk; j++) {
            const __half *vp = a.vc + ((int64_t)bt[j / a.block_size] * a.block_size + j % a.block_size) * kd + (int64_t)kvh * hd;
            acc = fmaf(s[j], __half2float(vp[d]), acc);
        }
        o[d] = acc / sum;
    }
}

/* ------------------------------------------------------------ routing */

/* One warp per token: softmax over the experts (the sum taken in expert order by one lane,
 * as the CPU does), then top-k by warp argmax (highest probability, lowest index on ties:
 * the CPU's rule). Shared memory: ne floats per warp. */
#define ROUTER_WARPS 4
__global__ void k_router(const float *logits, int32_t T, int32_t ne, int32_t k, int32_t *ids, float *w) {
    extern __shared__ float rs[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return;
    const float *r = logits + (int64_t)t * ne;
    float *p = rs + warp * ne;
    float mx = -INFINITY;
    for (int e = lane; e < ne; e += 32) mx = fmaxf(mx, r[e]);
    mx = warp_max(mx);
    for (int e = lane; e < ne; e += 32) p[e] = exp_cr(r[e] - mx);
    __syncwarp();
    float sum = 0.0f;
    if (lane == 0)
        for (int e = 0; e < ne; e++) sum += p[e];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int e = lane; e < ne; e += 32) p[e] = p[e] / sum;
    __syncwarp();
    for (int j = 0; j < k; j++) {
        float bv = -1.0f;
        int bi = ne;
        for (int e = lane; e < ne; e += 32)
            if (p[e] > bv) bv = p[e], bi = e; /* ascending e: ties keep the lower index */
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
        }
        if (lane == 0) {
            ids[(int64_t)t * k + j] = bi;
            w[(int64_t)t * k + j] = bv;
            p[bi] = -2.0f; /* taken */
        }
        __syncwarp();
    }
}

/* Group the T*k (token, slot) pairs by expert, on the device (one block): per-expert
 * counts, the compact list of active experts (ascending), pairs listed per expert, each
 * pair's token, and the step's per-layer histogram. */
__global__ void k_group(const int32_t *ids, int32_t n_pairs, int32_t k, int32_t ne, int32_t *gexp, int32_t *gstart,
                        int32_t *gcount, int32_t *n_groups, int32_t *list, int32_t *pair_tok, int32_t *hist) {
    extern __shared__ int32_t sh[]; /* cnt[ne], fill[ne] */
    int32_t *cnt = sh, *fill = sh + ne;
    for (int e = threadIdx.x; e < ne; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        atomicAdd(&cnt[ids[p]], 1);
        pair_tok[p] = p / k;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int32_t s = 0, g = 0;
        for (int e = 0; e < ne; e++) {
            fill[e] = s;
            if (cnt[e]) gexp[g] = e, gstart[g] = s, gcount[g] = cnt[e], g++;
            s += cnt[e];
        }
        *n_groups = g;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < ne; e += blockDim.x) hist[e] += cnt[e];
    /* slots within an expert's list are taken in arrival order; a pair's result does not
     * depend on its place in the list */
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) list[atomicAdd(&fill[ids[p]], 1)] = p;
}

/* x[t] += sum_j w_j o_j / sum_j w_j (or / 1), in double with one final rounding, as the CPU. */
__global__ void k_combine(float *x, const float *pair_out, const float *w, int32_t T, int32_t k, int64_t E, int norm) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)T * E) return;
    const int64_t t = i / E, c = i % E;
    const float *wt = w + t * k;
    double den = 0.0, num = 0.0;
    for (int j = 0; j < k; j++) den += (double)wt[j];
    if (!norm) den = 1.0;
    for (int j = 0; j < k; j++) num += (double)wt[j] * (double)pair_out[(t * k + j) * E + c];
    x[i] += (float)(num / den);
}

/* Shared-expert gate: g[t] = sigmoid(w . xn[t]) (1 without a gate tensor). Warp per token. */
__global__ void k_shexp_gate(const float *xn, const float *w, int32_t T, int64_t E, float *g) {
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (t >= T) return;
    float acc = 0.0f;
    if (w)
        for (int64_t i = lane; i < E; i += 32) acc = fmaf(w[i], xn[(int64_t)t * E + i], acc);
    acc = warp_sum(acc);
    if (lane == 0) g[t] = w ? 1.0f / (1.0f + exp_cr(-acc)) : 1.0f;
}

/* x[t, i] += g[t] * y[t, i] (g NULL: x += y) */
__global__ void k_add_scaled(float *x, const float *y, const float *g, int32_t T, int64_t E) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (int64_t)T * E) x[i] += g ? g[i / E] * y[i] : y[i];
}

/* h = silu(g) * h */
__global__ void k_silu_mul(float *h, const float *g, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] = silu_f(g[i]) * h[i];
}
