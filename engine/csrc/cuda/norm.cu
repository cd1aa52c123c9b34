/* Norms, RoPE and small fused ops: RMSNorm (with the pending expert sum), q / k / v post-processing
 * (biases, head norms, RoPE, the KV cache write), the embedding, the expert combine and the SWIGLU
 * product. */
#include "linear.cuh"

/* Embedding rows: x[t, :] = dequant(table[tokens[t], :]); grid (T), block over blocks of the row. */
/* src (optional, st_batch.token_src): token t's id is picks[src[t]] where src[t] >= 0 (the previous
 * step's greedy pick, still in the picks buffer in stream order), else tokens[t]. */
/* staged (E floats of dynamic shared memory, the launch's choice where they fit 48 KB): each block dequantised into
 * shared memory, then the row copied out. Why: deq_block's byte loads from the table and its float stores to x may
 * alias as far as the compiler knows, so into x every load waits for the stores before it (a 256-element Q4_K block
 * per thread, 28 threads at DeepSeek-V3's 7,168: ~20 us a token); into shared memory they are two address spaces.
 * The same values. */
template <int T> __global__ void k_embed(const uint8_t *table, int64_t row_bytes, const int32_t *tokens,
                                         const int32_t *src, const int32_t *picks, int64_t E, float *x, int staged) {
    PDL_ENTER();
    extern __shared__ float emb_s[];
    const int t = blockIdx.x;
    const int32_t j = src ? src[t] : -1;
    const uint8_t *row = table + (int64_t)(j >= 0 ? picks[j] : tokens[t]) * row_bytes;
    if (staged) {
        for (int64_t b = threadIdx.x; b < E / qt<T>::BE; b += blockDim.x)
            deq_block<T>(row + b * qt<T>::BB, emb_s + b * qt<T>::BE);
        __syncthreads();
        for (int64_t i = threadIdx.x; i < E; i += blockDim.x) x[(int64_t)t * E + i] = emb_s[i];
        return;
    }
    for (int64_t b = threadIdx.x; b < E / qt<T>::BE; b += blockDim.x)
        deq_block<T>(row + b * qt<T>::BB, x + (int64_t)t * E + b * qt<T>::BE);
}

/* ------------------------------------------------------------ norms, rope, KV */

/* The expert sum of a token folded into the next RMSNorm (saves a launch per layer):
 * x[r] += scale * sum_j w_j o_j / max(sum_j w_j, 2^-14) (or / 1), in double with one final rounding, as the CPU. */
struct combine_args {
    const float *pair_out, *w; /* NULL: nothing pending */
    int32_t k, norm;
    /* the output projection's 4 split-GEMM parts [4][kp_t][E] not yet added to the residual (its
     * k_ksplit_combine left to this norm: g_defer_combine); NULL: none */
    const float *kpart;
    int32_t kp_t;
    float scale = 1.0f; /* the routed scaling factor (st_model_desc.expert_weights_scale; 1: none) */
};

__device__ __forceinline__ float combined(const combine_args &c, float x, int64_t r, int64_t i, int64_t E) {
    if (c.kpart) { /* k_ksplit_combine's additions, then its residual add */
        const int64_t pl = (int64_t)c.kp_t * E, ix = r * E + i;
        x = x + ((c.kpart[ix] + c.kpart[pl + ix]) + (c.kpart[2 * pl + ix] + c.kpart[3 * pl + ix]));
    }
    if (!c.pair_out) return x;
    const float *wt = c.w + r * c.k;
    if (c.k <= 8) { /* every load issued before the first use (the loop below waits on each in turn), same sums */
        float wv[8], pv[8];
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < c.k) wv[j] = wt[j], pv[j] = c.pair_out[(r * c.k + j) * E + i];
        double den = 0.0, num = 0.0;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < c.k) den += (double)wv[j];
        if (den < 6.103515625e-5) den = 6.103515625e-5; /* moe.c's clamp (2^-14) */
        if (!c.norm) den = 1.0;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < c.k) num += (double)wv[j] * (double)pv[j];
        return x + (float)(num / den * (double)c.scale);
    }
    double den = 0.0, num = 0.0;
    for (int j = 0; j < c.k; j++) den += (double)wt[j];
    if (den < 6.103515625e-5) den = 6.103515625e-5;
    if (!c.norm) den = 1.0;
    for (int j = 0; j < c.k; j++) num += (double)wt[j] * (double)c.pair_out[(r * c.k + j) * E + i];
    return x + (float)(num / den * (double)c.scale);
}

/* y[r] = w * (x[r] * 1/sqrt(mean(x^2) + eps)), the sum of squares in double like rmsnorm_row.
 * Rows r = rows[i] when rows != NULL (output row i). One block per row. With aq != NULL
 * (n a multiple of 32) the normalised row is also quantised to 8-bit blocks, exactly as
 * k_quant_act would (one launch instead of two). With c.pair_out the pending expert sum
 * is first added to x[r] (written back when rows == NULL; the output head's rows only
 * read it, so a row listed twice is safe). Thread tid handles elements tid + k * blockDim;
 * up to RMS_RN of them (rows up to 2,048 elements) stay in registers between the two
 * passes, so the second reloads nothing but w (loaded before the barrier), and a warp's
 * elements of one pass are one 32-block for the quantisation; longer rows go through y. The
 * block's sum: each warp's by shuffles, then every warp adds the warps' partials the same way
 * (one barrier, no serial loop by one thread). */
#ifndef RMS_THREADS
#define RMS_THREADS 1024 /* the block of every k_rmsnorm launch */
#endif
#define RMS_RN (2048 / RMS_THREADS) /* register slots: rows up to 2,048 elements */
#define RMS_CH 4                    /* longer rows: elements (blocks) of a thread (warp) loaded at a time */
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__global__ void __launch_bounds__(RMS_THREADS) k_rmsnorm(float *x, const int32_t *rows, const float *w, float *y, int64_t n,
                                                  float eps, int8_t *aq, float *ad, int32_t *as, combine_args c) {
    PDL_ENTER();
    __shared__ double red[32];
    const int64_t r = rows ? rows[blockIdx.x] : blockIdx.x;
    float *xr = x + r * n;
    float *yr = y + (int64_t)blockIdx.x * n;
    const int bd = blockDim.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = bd / 32;
    const bool inreg = n <= (int64_t)RMS_RN * bd;
    float vr[RMS_RN], wr[RMS_RN];
    double ss = 0.0;
    if (inreg) {
#pragma unroll
        for (int k = 0; k < RMS_RN; k++) {
            const int64_t i = threadIdx.x + (int64_t)k * bd;
            float v = 0.0f;
            wr[k] = 0.0f;
            if (i < n) {
                v = xr[i];
                wr[k] = w[i];
                if (c.pair_out || c.kpart) {
                    v = combined(c, v, r, i, n);
                    if (!rows) xr[i] = v;
                }
                ss += (double)v * (double)v;
            }
            vr[k] = v;
        }
    } else { /* RMS_CH elements of a thread at a time, every load of them before the first store (x and y may be
              * one buffer, so loads after a store wait for it); the same values, ss in the same order */
        for (int64_t i0 = threadIdx.x; i0 < n; i0 += (int64_t)RMS_CH * bd) {
            float v[RMS_CH];
#pragma unroll
            for (int u = 0; u < RMS_CH; u++) {
                const int64_t i = i0 + (int64_t)u * bd;
                v[u] = 0.0f;
                if (i < n) v[u] = c.pair_out || c.kpart ? combined(c, xr[i], r, i, n) : xr[i];
            }
#pragma unroll
            for (int u = 0; u < RMS_CH; u++) {
                const int64_t i = i0 + (int64_t)u * bd;
                if (i < n) {
                    if ((c.pair_out || c.kpart) && !rows) xr[i] = v[u];
                    yr[i] = v[u];
                    ss += (double)v[u] * (double)v[u];
                }
            }
        }
    }
    ss = warp_sum_d(ss);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    const double tot = warp_sum_d(lane < nw ? red[lane] : 0.0);
    const float scale = (float)(1.0 / sqrt(tot / (double)n + (double)eps));
    const int64_t nb = n / 32, row = blockIdx.x;
    if (inreg) {
#pragma unroll
        for (int k = 0; k < RMS_RN; k++) {
            const int64_t i = threadIdx.x + (int64_t)k * bd;
            if (i >= n) continue; /* warp-uniform when n % 32 == 0 (always with aq) */
            const float v = __fmul_rn(wr[k], __fmul_rn(vr[k], scale));
            yr[i] = v;
            if (aq) {
                const int64_t b = i / 32;
                quant_block32(v, lane, aq + row * n + 32 * b, ad + row * nb + b, as + row * (n / 16) + 2 * b);
            }
        }
        return;
    }
    if (!aq) {
        for (int64_t i0 = threadIdx.x; i0 < n; i0 += (int64_t)RMS_CH * bd) {
            float wv[RMS_CH] = {}, yv[RMS_CH] = {};
#pragma unroll
            for (int u = 0; u < RMS_CH; u++) {
                const int64_t i = i0 + (int64_t)u * bd;
                if (i < n) wv[u] = w[i], yv[u] = yr[i];
            }
#pragma unroll
            for (int u = 0; u < RMS_CH; u++) {
                const int64_t i = i0 + (int64_t)u * bd;
                if (i < n) yr[i] = __fmul_rn(wv[u], __fmul_rn(yv[u], scale));
            }
        }
        return;
    }
    for (int64_t b0 = warp; b0 < nb; b0 += (int64_t)RMS_CH * nw) { /* RMS_CH blocks of a warp, loads first */
        float wv[RMS_CH] = {}, yv[RMS_CH] = {};
#pragma unroll
        for (int u = 0; u < RMS_CH; u++) {
            const int64_t b = b0 + (int64_t)u * nw, i = 32 * b + lane; /* == threadIdx.x + k * blockDim.x, as above */
            if (b < nb) wv[u] = w[i], yv[u] = yr[i];
        }
#pragma unroll
        for (int u = 0; u < RMS_CH; u++) {
            const int64_t b = b0 + (int64_t)u * nw, i = 32 * b + lane;
            if (b >= nb) break; /* warp-uniform */
            const float v = __fmul_rn(wv[u], __fmul_rn(yv[u], scale));
            yr[i] = v;
            quant_block32(v, lane, aq + row * n + 32 * b, ad + row * nb + b, as + row * (n / 16) + 2 * b);
        }
    }
}

/* Per-head RMSNorm over hd elements held in shared memory, in place (q/k norms). One warp. */
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

/* The host tier of a tiered KV cache (stg_kv_create_tiered): one layer's arrays in pinned, mapped host memory, which
 * the device reads and writes through their UVA addresses (over PCIe, as a kernel touches them). A block table entry
 * is a physical block: below n_dev it lives in the device arrays (the attention arguments' kc / vc / k8 / ...), from
 * n_dev on in these, at index blk - n_dev. An untiered cache keeps the defaults (every block on the device). */
struct kv_host {
    int32_t n_dev = INT32_MAX;
    __half *kc = nullptr, *vc = nullptr;
    int8_t *k8 = nullptr, *v8 = nullptr;
    __half *ks = nullptr, *vs = nullptr;
};
/* The one address function of the KV tiers: the start of physical block blk (per elements a block) of an array whose
 * device pool is dev and host pool host. Every kernel that reads or writes the cache goes through it. */
template <class T, class U>
__device__ __forceinline__ T *kv_blk(T *dev, U *host, int64_t blk, int32_t n_dev, int64_t per) {
    T *h = host;
    return blk < n_dev ? dev + blk * per : h + (blk - n_dev) * per;
}

struct qkv_args {
    float *q, *k, *v; /* [T, q_dim], [T, kv_dim] x2 */
    const float *bq, *bk, *bv, *q_norm, *k_norm, *inv_freq;
    const int32_t *pos, *seq, *block_tables;
    int32_t max_blocks, n_head, n_kv, hd, rope_dim, rope_type, block_size;
    float eps, scale;
    float mscale; /* RoPE's magnitude factor (YaRN; 1 without scaling): cos and sin are scaled by it, as the CPU's */
    __half *kc, *vc; /* this layer's K / V arena (the F16 cache) */
    /* the 8-bit cache (STG_KV_Q8_0): this layer's values and F16 scales, kv.c's layout (kv_store_q8); NULL: F16 */
    int8_t *k8 = nullptr, *v8 = nullptr;
    __half *ks = nullptr, *vs = nullptr;
    kv_host ht; /* the host tier's arrays of this layer (a tiered cache) */
    /* q / k / v still as the split GEMM's 4 parts [4][kp_t][kp_n] over their stacked rows (the fused
     * decode attention adds them as k_ksplit_combine would: g_defer_combine); NULL: q, k, v */
    const float *kpart;
    int32_t kp_n, kp_t;
};

/* Biases, q/k norms, RoPE, q scaling, K/V written to the cache: one warp per head of one
 * token (q heads, then k heads, then v heads), QKV_WARPS heads per block, grid (T, heads
 * / QKV_WARPS). The head is staged in shared memory so the norm and the rotation (whose
 * pairs cross lanes) never go back to global memory in between. */
#define QKV_WARPS 4

/* An output of the split GEMM's 4 parts (pl floats apart): (P0 + P1) + (P2 + P3), as k_ksplit_combine adds them */
__device__ __forceinline__ float kpart_sum(const float *pp, int64_t pl) {
    return (pp[0] + pp[pl]) + (pp[2 * pl] + pp[3 * pl]);
}

/* Head hh of kind 0 (q), 1 (k) or 2 (v) of token t: bias, then for q and k the head norm and
 * RoPE, into v[hd] (shared memory, one warp). The one definition k_qkv_post and the fused
 * decode attention both use, so either gives the same bits. */
__device__ __forceinline__ void qkv_head(const qkv_args &a, int t, int kind, int hh, float *v, int lane) {
    const int qd = a.n_head * a.hd, kd = a.n_kv * a.hd, hd = a.hd;
    const float *src = (kind == 0 ? a.q + (int64_t)t * qd : kind == 1 ? a.k + (int64_t)t * kd : a.v + (int64_t)t * kd) +
                       hh * hd;
    const float *bias = kind == 0 ? a.bq : kind == 1 ? a.bk : a.bv;
    const int64_t pl = (int64_t)a.kp_t * a.kp_n, base = (int64_t)t * a.kp_n + (kind == 0 ? 0 : kind == 1 ? qd : qd + kd) + hh * hd;
    for (int i = lane; i < hd; i += 32) {
        float x;
        if (a.kpart) {
            x = kpart_sum(a.kpart + base + i, pl);
        } else {
            x = src[i];
        }
        v[i] = bias ? x + bias[hh * hd + i] : x;
    }
    __syncwarp();
    if (kind < 2) {
        const int32_t p = a.pos[t];
        if (a.q_norm) head_rmsnorm(v, kind == 0 ? a.q_norm : a.k_norm, hd, a.eps, lane);
        for (int i = lane; i < a.rope_dim / 2; i += 32) {
            const float theta = __fmul_rn((float)p, a.inv_freq[i]);
            rope_pair(v, i, a.rope_dim, a.rope_type, __fmul_rn((float)cos((double)theta), a.mscale),
                      __fmul_rn((float)sin((double)theta), a.mscale));
        }
        __syncwarp();
    }
}

/* Q8_0's rule on the warp's 32 values x (one a lane), as kv.c's q8_group: d = max|x| / 127, q = round(x * (1 / d))
 * (0 where d is 0), d kept as F16 (round to nearest even), so the cache holds the CPU's bytes for the same values. */
__device__ __forceinline__ int8_t kv_q8_lane(float x, __half *d_out) {
    const float amax = warp_max(fabsf(x));
    const float d = __fdiv_rn(amax, 127.0f), id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    *d_out = __float2half_rn(d);
    return (int8_t)roundf(__fmul_rn(x, id));
}

/* K (kind 1) or V (kind 2) head hh of token t from v[hd] into its cache slot. The 8-bit cache (a.k8; hd % 32 == 0)
 * holds kv.c's layout: the values at the F16 layout's indices, K's scale of the 32 dimensions c..c+31 of slot s at
 * [block][c / 32][s], V's at [block][s][c / 32]. */
__device__ __forceinline__ void kv_store(const qkv_args &a, int t, int kind, int hh, const float *v, int lane) {
    const int kd = a.n_kv * a.hd, hd = a.hd;
    const int32_t p = a.pos[t];
    const int32_t blk = a.block_tables[(int64_t)a.seq[t] * a.max_blocks + p / a.block_size], slot = p % a.block_size;
    const int64_t per = (int64_t)kd * a.block_size, nd = a.ht.n_dev;
    if (a.k8) { /* every lane in each pass: a group of 32 */
        const int kd32 = kd / 32;
        int8_t *kb = kv_blk(a.k8, a.ht.k8, blk, nd, per), *vb = kv_blk(a.v8, a.ht.v8, blk, nd, per);
        __half *ksb = kv_blk(a.ks, a.ht.ks, blk, nd, per / 32), *vsb = kv_blk(a.vs, a.ht.vs, blk, nd, per / 32);
        for (int i = lane; i < hd; i += 32) {
            const int c = hh * hd + i;
            __half d;
            const int8_t q = kv_q8_lane(v[i], &d);
            if (kind == 1) {
                kb[(int64_t)c * a.block_size + slot] = q;
                if (lane == 0) ksb[(int64_t)(c / 32) * a.block_size + slot] = d;
            } else {
                vb[(int64_t)slot * kd + c] = q;
                if (lane == 0) vsb[(int64_t)slot * kd32 + c / 32] = d;
            }
        }
        return;
    }
    __half *kb = kv_blk(a.kc, a.ht.kc, blk, nd, per), *vb = kv_blk(a.vc, a.ht.vc, blk, nd, per);
    for (int i = lane; i < hd; i += 32) {
        const int c = hh * hd + i;
        if (kind == 1) kb[(int64_t)c * a.block_size + slot] = __float2half_rn(v[i]);
        else vb[(int64_t)slot * kd + c] = __float2half_rn(v[i]);
    }
}

__global__ void __launch_bounds__(QKV_WARPS * 32) k_qkv_post(qkv_args a) {
    PDL_ENTER();
    __shared__ float hs[QKV_WARPS][256];
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y * QKV_WARPS + warp;
    if (h >= a.n_head + 2 * a.n_kv) return;
    const int kind = h < a.n_head ? 0 : h < a.n_head + a.n_kv ? 1 : 2; /* q, k, v */
    const int hh = kind == 0 ? h : kind == 1 ? h - a.n_head : h - a.n_head - a.n_kv;
    float *v = hs[warp];
    qkv_head(a, t, kind, hh, v, lane);
    if (kind == 0) {
        float *dst = a.q + (int64_t)t * a.n_head * a.hd + hh * a.hd;
        for (int i = lane; i < a.hd; i += 32) dst[i] = __fmul_rn(v[i], a.scale);
        return;
    }
    kv_store(a, t, kind, hh, v, lane);
}

/* x[t] += the expert sum (see combined()), when it cannot wait for the next norm. */
__global__ void k_combine(float *x, const float *pair_out, const float *w, int32_t T, int32_t k, int64_t E, int norm,
                          float scale) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)T * E) return;
    const combine_args c{pair_out, w, k, norm, nullptr, 0, scale};
    x[i] = combined(c, x[i], i / E, i % E, E);
}

/* Shared-expert gate: g[t] = sigmoid(w . xn[t]) (1 without a gate tensor). Warp per token. */
__global__ void k_shexp_gate(const float *xn, const float *w, int32_t T, int64_t E, float *g) {
    PDL_ENTER();
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
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (int64_t)T * E) x[i] += g ? g[i / E] * y[i] : y[i];
}

/* h = silu(g) * h */
__global__ void k_silu_mul(float *h, const float *g, int64_t n) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] = silu_f(g[i]) * h[i];
}
