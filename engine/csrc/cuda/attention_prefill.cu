/* Attention at prefill: query tiles on fp32 (k_attention_tile, bitwise k_attention's rows) and the
 * tile lists of a step; the tensor-core kernel is attention_mma.cu. attention_setup opts every attention and GEMM
 * kernel into its dynamic shared memory. */
#include "attention.cuh"

/* Prefill attention with query tiles: one block per (tile, kv head), where a tile is a run of
 * at most ATT_TR / G consecutive tokens of one sequence in the step (G = query heads per kv
 * head), so its ATT_TR rows (token, query head of the kv group) share every K/V chunk copy
 * (k_attention copies each chunk once per row). Each row's arithmetic is k_attention's,
 * operation for operation: chunk ci belongs to stream ci % ATT_WARPS (here: warp), the score
 * of a key is the same eight fma chains (four over even, four over odd dimensions, in order)
 * added the same way, the online softmax per chunk uses the same max, expf and the warp_sum
 * tree, the values the same fma chain over the chunk's keys, and the streams are merged in
 * the same order. So a token's output does not depend on which kernel its step used (bitwise;
 * test_attention_tile_bitwise_equals_k_attention). Rows of a tile whose keys end before a
 * chunk leave that chunk out, as k_attention's block for that token never sees it.
 *
 * Lanes: scores with lane = (row, half) (16 keys per lane, all in registers), values with
 * lane = HD / 32 dimensions of every row (the accumulators of 16 rows in registers).
 * Dynamic shared memory: as k_attention's (per-warp K/V chunk stages), reused for the merge. */
#define ATT_TR 16

/* 16 consecutive halves (32-byte aligned, shared memory) as floats: two 16-byte loads. */
__device__ __forceinline__ void load_keys16(const __half *p, float (&f)[ATT_CK]) {
    const uint4 u0 = ((const uint4 *)p)[0], u1 = ((const uint4 *)p)[1];
    const unsigned w[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float2 v = __half22float2(*(const __half2 *)&w[i]);
        f[2 * i] = v.x, f[2 * i + 1] = v.y;
    }
}
/* N (1, 2 or 4) consecutive halves, N-aligned, as floats in one load. */
template <int N> __device__ __forceinline__ void load_dims(const __half *p, float (&f)[N]) {
    if constexpr (N == 4) {
        const uint2 u = *(const uint2 *)p;
        const float2 a = __half22float2(*(const __half2 *)&u.x), b = __half22float2(*(const __half2 *)&u.y);
        f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
    } else if constexpr (N == 2) {
        const float2 a = __half22float2(*(const __half2 *)p);
        f[0] = a.x, f[1] = a.y;
    } else {
        f[0] = __half2float(p[0]);
    }
}
/* The rows of one tile (first_token * 32 + count) over its chunks: the body of k_attention_tile. */
template <int HD> __device__ __forceinline__ void att_tile_rows(const attn_args &a, int32_t tile) {
    constexpr int DPL = HD / 32, QP = HD + 2; /* dimensions per lane (values); q row padded: rows r and r + 8 in other banks */
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ __align__(16) float qs[ATT_TR][QP];
    __shared__ __align__(16) float ps[ATT_WARPS][ATT_TR][ATT_CK];
    __shared__ float cs[ATT_WARPS][ATT_TR], ms[ATT_WARPS][ATT_TR], ls[ATT_WARPS][ATT_TR];
    __shared__ int nks[ATT_WARPS][ATT_TR];
    __shared__ int32_t rn[ATT_TR];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int G = a.n_head / a.n_kv, kvh = blockIdx.y, kd = a.n_kv * HD, bs = a.block_size;
    const int32_t t0 = tile >> 5, nrows = (tile & 31) * G;
    for (int i = threadIdx.x; i < ATT_TR * HD; i += blockDim.x) {
        const int r = i / HD, d = i % HD;
        float v = 0.0f;
        if (r < nrows) v = a.q[(int64_t)(t0 + r / G) * a.n_head * HD + (kvh * G + r % G) * HD + d];
        qs[r][d] = v;
    }
    if (threadIdx.x < ATT_TR) rn[threadIdx.x] = threadIdx.x < nrows ? a.pos[t0 + threadIdx.x / G] + 1 : 0;
    __syncthreads();
    int32_t max_keys = 0;
    for (int r = 0; r < ATT_TR; r++) max_keys = max(max_keys, rn[r]);
    const int32_t n_chunks = (max_keys + ATT_CK - 1) / ATT_CK;
    const int32_t c_hi = n_chunks;
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t0] * a.max_blocks;
    __half *wbuf = (__half *)att_dyn + (size_t)warp * 2 * 2 * ATT_CK * HD; /* [2][K HD x 16 | V 16 x HD] */
    auto issue = [&](int ci, int st, int32_t blk) {
        const int slot0 = (ci * ATT_CK) % bs;
        __half *ks = wbuf + (size_t)st * 2 * ATT_CK * HD, *vs = ks + ATT_CK * HD;
        const int64_t per = (int64_t)kd * bs;
        const __half *kg = kv_blk(a.kc, a.ht.kc, blk, a.ht.n_dev, per) + (int64_t)kvh * HD * bs + slot0;
        const __half *vg = kv_blk(a.vc, a.ht.vc, blk, a.ht.n_dev, per) + (int64_t)slot0 * kd + (int64_t)kvh * HD;
        constexpr int vp = HD / 8;
        for (int it = lane; it < 2 * HD; it += 32) {
            const int d = it >> 1, pc = it & 1;
            cp_async16(ks + d * ATT_CK + 8 * pc, kg + (int64_t)d * bs + 8 * pc);
            const int jj = it / vp, pv = it % vp;
            cp_async16(vs + jj * HD + 8 * pv, vg + (int64_t)jj * kd + 8 * pv);
        }
        cp_async_commit();
    };
    const int row = lane >> 1, half = lane & 1; /* scores */
    const unsigned pair = 3u << (lane & ~1);    /* the two lanes of a row: they branch together */
    float m = -INFINITY, l = 0.0f;              /* this lane's row (both lanes of a row agree) */
    float acc[ATT_TR][DPL];
#pragma unroll
    for (int r = 0; r < ATT_TR; r++)
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[r][i] = 0.0f;
    int ci = warp;
    int32_t blk_next = ci < c_hi ? bt[ci * ATT_CK / bs] : 0;
    if (ci < c_hi) att_issue_chunk(issue, ci, 0, blk_next, bt, c_hi, bs);
    for (int it = 0; ci < c_hi; it++, ci += ATT_WARPS) {
        const int st = it & 1;
        att_next_stage(issue, ci, st, true, blk_next, bt, c_hi, bs);
        __syncwarp();
        const __half *ks = wbuf + (size_t)st * 2 * ATT_CK * HD, *vs = ks + ATT_CK * HD;
        /* scores of this lane's row over the chunk's 16 keys, half = even / odd dimensions */
        const int nk = min(ATT_CK, rn[row] - ci * ATT_CK); /* <= 0: the row has no key here */
        if (nk > 0) {
            float c0[ATT_CK], c1[ATT_CK], c2[ATT_CK], c3[ATT_CK];
#pragma unroll
            for (int k = 0; k < ATT_CK; k++) c0[k] = c1[k] = c2[k] = c3[k] = 0.0f;
#pragma unroll 2
            for (int d = half; d < HD; d += 8) {
                const float q0 = qs[row][d], q1 = qs[row][d + 2], q2 = qs[row][d + 4], q3 = qs[row][d + 6];
                float k0[ATT_CK], k1[ATT_CK], k2[ATT_CK], k3[ATT_CK];
                load_keys16(ks + d * ATT_CK, k0);
                load_keys16(ks + (d + 2) * ATT_CK, k1);
                load_keys16(ks + (d + 4) * ATT_CK, k2);
                load_keys16(ks + (d + 6) * ATT_CK, k3);
#pragma unroll
                for (int k = 0; k < ATT_CK; k++) {
                    c0[k] = fmaf(q0, k0[k], c0[k]);
                    c1[k] = fmaf(q1, k1[k], c1[k]);
                    c2[k] = fmaf(q2, k2[k], c2[k]);
                    c3[k] = fmaf(q3, k3[k], c3[k]);
                }
            }
            float s[ATT_CK], mx = -INFINITY;
#pragma unroll
            for (int k = 0; k < ATT_CK; k++) {
                const float sv = (c0[k] + c1[k]) + (c2[k] + c3[k]);
                const float so = __shfl_xor_sync(pair, sv, 1); /* the row's other half */
                s[k] = k < nk ? (half ? so + sv : sv + so) : -INFINITY;
                mx = fmaxf(mx, s[k]);
            }
            const float mn = fmaxf(m, mx);
            const float corr = expf(m - mn);
            float p[ATT_CK];
#pragma unroll
            for (int k = 0; k < ATT_CK; k++) p[k] = k < nk ? expf(s[k] - mn) : 0.0f;
            /* warp_sum's tree over lanes 0-15 holding p[key] and 16-31 holding 0 */
            float a8[8];
#pragma unroll
            for (int i = 0; i < 8; i++) a8[i] = __fadd_rn(p[i], p[i + 8]);
            const float b0 = __fadd_rn(a8[0], a8[4]), b1 = __fadd_rn(a8[1], a8[5]), b2 = __fadd_rn(a8[2], a8[6]),
                        b3 = __fadd_rn(a8[3], a8[7]);
            const float S = __fadd_rn(__fadd_rn(b0, b2), __fadd_rn(b1, b3));
            l = __fmaf_rn(l, corr, S);
            m = mn;
            if (!half) {
                cs[warp][row] = corr;
#pragma unroll
                for (int k = 0; k < ATT_CK; k++) ps[warp][row][k] = p[k];
            }
        }
        if (!half) nks[warp][row] = nk > 0 ? nk : 0;
        __syncwarp();
        /* values: this lane's DPL dimensions of every row, keys in order */
#pragma unroll
        for (int r = 0; r < ATT_TR; r++) {
            if (nks[warp][r] > 0) {
                const float c = cs[warp][r];
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[r][i] *= c;
            }
        }
#pragma unroll
        for (int j0 = 0; j0 < ATT_CK; j0 += 4) {
            float vv[4][DPL];
#pragma unroll
            for (int u = 0; u < 4; u++) load_dims<DPL>(vs + (j0 + u) * HD + DPL * lane, vv[u]);
#pragma unroll
            for (int r = 0; r < ATT_TR; r++) {
                const int nkr = nks[warp][r];
                if (nkr <= j0) continue;
                const float4 p4 = *(const float4 *)&ps[warp][r][j0];
                const float pu[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                for (int u = 0; u < 4; u++)
                    if (j0 + u < nkr)
#pragma unroll
                        for (int i = 0; i < DPL; i++) acc[r][i] = fmaf(pu[u], vv[u][i], acc[r][i]);
            }
        }
        __syncwarp(); /* the stage, ps and nks are rewritten next chunk */
    }
    if (!half) ms[warp][row] = m, ls[warp][row] = l;
    __syncthreads(); /* every warp's copies done: the stages become the merge buffer */
    float *part = (float *)att_dyn; /* [ATT_WARPS][ATT_TR][HD] */
#pragma unroll
    for (int r = 0; r < ATT_TR; r++)
#pragma unroll
        for (int i = 0; i < DPL; i++) part[((size_t)warp * ATT_TR + r) * HD + DPL * lane + i] = acc[r][i];
    __syncthreads();
    for (int r = warp; r < nrows; r += ATT_WARPS) {
        float M = -INFINITY;
        for (int wi = 0; wi < ATT_WARPS; wi++) M = fmaxf(M, ms[wi][r]);
        float L = 0.0f, sc[ATT_WARPS];
        for (int wi = 0; wi < ATT_WARPS; wi++) {
            sc[wi] = ls[wi][r] > 0.0f ? expf(ms[wi][r] - M) : 0.0f;
            L = __fmaf_rn(ls[wi][r], sc[wi], L);
        }
        const int t = t0 + r / G, h = kvh * G + r % G;
        const int64_t row0 = (int64_t)t * a.n_head * HD + h * HD;
        for (int d0 = 0; d0 < HD; d0 += 32) {
            const int d = d0 + lane;
            float v = 0.0f;
            for (int wi = 0; wi < ATT_WARPS; wi++) v = __fmaf_rn(part[((size_t)wi * ATT_TR + r) * HD + d], sc[wi], v);
            v = __fdiv_rn(v, L);
            a.out[row0 + d] = v;
            if (a.aq) quant_block32(v, lane, a.aq + row0 + d0, a.ad + (row0 + d0) / 32, a.as + (row0 + d0) / 16);
        }
    }
}
template <int HD> __global__ void __launch_bounds__(ATT_WARPS * 32) k_attention_tile(attn_args a, const int32_t *tiles) {
    PDL_ENTER();
    att_tile_rows<HD>(a, tiles[blockIdx.x]);
}

/* Query tiles (k_attention_tile) for a model: head_dim 32, 64 or 128 and G = n_head / n_kv
 * dividing ATT_TR; 0 otherwise. Tokens per tile. */
static int att_tile_tokens(int32_t n_head, int32_t n_kv, int32_t hd) {
    if (n_kv < 1 || n_head % n_kv || (hd != 32 && hd != 64 && hd != 128)) return 0;
    const int G = n_head / n_kv;
    return G <= ATT_TR && ATT_TR % G == 0 ? ATT_TR / G : 0;
}
/* This step's mma tiles (attention_mma.cu), after its n_tiles query tiles in d_tiles, and their q mode
 * (stg_settings.att_mma: 1 or 2); set per step by stg_forward (0 tiles for graph steps). */
static thread_local int32_t g_att_mma_tiles = 0;
static thread_local int g_att_mma_mode = 2;
/* Tiles of a step: runs of consecutive tokens of one sequence, at most tq tokens each, packed
 * as first_token * 32 + count. Returns how many were written to out (at most T). */
static int32_t att_tiles(const int32_t *seq, int32_t T, int tq, int32_t *out) {
    int32_t n = 0;
    for (int32_t i = 0; i < T;) {
        int32_t j = i + 1;
        while (j < T && j - i < tq && seq[j] == seq[i]) j++;
        out[n++] = i * 32 + (j - i);
        i = j;
    }
    return n;
}
static stg_status launch_attention_tile(const attn_args &aa, const int32_t *d_tiles, int32_t n_tiles, cudaStream_t st) {
    const size_t smem = att_smem_bytes(aa.hd, 2);
    const dim3 grid((unsigned)n_tiles, (unsigned)aa.n_kv);
    if (aa.hd == 128) launch_k(k_attention_tile<128>, grid, ATT_WARPS * 32, smem, st, aa, d_tiles);
    else if (aa.hd == 64) launch_k(k_attention_tile<64>, grid, ATT_WARPS * 32, smem, st, aa, d_tiles);
    else if (aa.hd == 32) launch_k(k_attention_tile<32>, grid, ATT_WARPS * 32, smem, st, aa, d_tiles);
    else return fail(ST_EUNSUPPORTED, "attention tiles: head_dim %d", aa.hd);
    LAUNCHED("attention (query tiles)");
    return ST_OK;
}

static stg_status attention_split_setup(int smem_optin); /* attention_split.cu */
/* Once per model (outside any capture), the GEMMs' too; smem_optin: the bytes of shared memory a block of the device
 * may opt in to (stg_model.smem_optin): the forms above it are neither opted in nor launched. */
static stg_status attention_setup(int smem_optin) {
    CHECK(gemm_setup());
    void (*const att_forms[])(attn_args) = {k_attention<false, 0>, k_attention<true, 0>, k_attention<true, 128>,
                                            k_attention<true, 128, true>};
    for (auto f : att_forms)
        CU(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM_MAX), "attention setup");
    CU(cudaFuncSetAttribute(k_attention_tile<32>, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM_MAX),
       "attention setup");
    CU(cudaFuncSetAttribute(k_attention_tile<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM_MAX),
       "attention setup");
    CU(cudaFuncSetAttribute(k_attention_tile<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, ATT_SMEM_MAX),
       "attention setup");
    CHECK(attention_mma_setup(smem_optin));
    return attention_split_setup(smem_optin);
}
