/* deepseek2's multi-head latent attention on the GPU: the CPU engine's form (mla.c), step for step.
 *
 * The cache holds one row per token and layer, [c, k_pe] (ck = kv_lora_rank + rope_dim values, F16): the
 * RMSNormed latent and the rotated key part every head shares. kv->k holds the rows slot-major
 * ([block][slot][ck], a row contiguous); no V is allocated. Each head's query is absorbed into the latent space:
 *   q_abs_h = [W_UK_h^T (q_nope_h * s), q_pe_h * s]     (s = 1 / sqrt(head_dim), folded into the query)
 *   o_h     = sum_j softmax_j(q_abs_h . row_j) c_j         (k_mla_attention: the latent attended as one KV head)
 *   out_h   = W_UV_h o_h, then wo over the heads' outputs  (residual add)
 * The per-head products (W_UK_h^T, W_UV_h) are linear() launches with a group per head (group h: pairs
 * t * n_head + h, expert h at the head's byte stride), so they take the matvec / GEMM kernels of routed experts,
 * any weight type. Prefill and decode take the same kernels; no query tiles, no split-KV decode, no fused q / k / v
 * prep (step.cu leaves them off for this architecture). */
#include "model.cuh"

#define MLA_CH 64      /* keys per chunk of k_mla_attention's online softmax */
#define MLA_THREADS 128
#define MLA_VMAX 8     /* latent dimensions per thread: kv_lora_rank <= MLA_THREADS * MLA_VMAX */
#define MLA_MAX_KL (MLA_THREADS * MLA_VMAX)
#define MLA_PREP_WARPS 4
#define MLA_SMEM_MAX ((size_t)48 * 1024) /* k_mla_attention's dynamic shared memory without an opt-in */

/* the absorbed queries' shared memory: G heads of ck floats (k_mla_attention) within the default 48 KiB */
static inline size_t mla_att_smem(int G, int ck) { return (size_t)G * (size_t)ck * sizeof(float); }

/* Group h of the per-head linears: pairs h * T .. h * T + T - 1 listed as t * n_head + h (the row of token t, head
 * h in [T, n_head, width] buffers). */
__global__ void k_mla_groups(int32_t T, int32_t H, int32_t *gexp, int32_t *gstart, int32_t *gcount, int32_t *list) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < H) gexp[i] = (int32_t)i, gstart[i] = (int32_t)(i * T), gcount[i] = T;
    if (i < (int64_t)T * H) {
        const int32_t h = (int32_t)(i / T), t = (int32_t)(i % T);
        list[i] = t * H + h;
    }
}

struct mla_prep_args {
    const float *mq;       /* [T, H * hd] the queries (rotary part last in each head) */
    const float *mkv;      /* [T, ck] the new rows (latent, then the rotary key) */
    const float *kv_norm;  /* [kl] */
    const float *inv_freq; /* [rd / 2] */
    const int32_t *pos, *seq, *block_tables;
    __half *kc;            /* this layer's rows [block][slot][ck] */
    float *mg;             /* [T * H, nope] the scaled non-rotary query parts */
    float *qa;             /* [T, H, ck]: the scaled rotary query part written at kl .. ck of each head */
    int32_t H, hd, nope, rd, kl, ck, rope_type, max_blocks, block_size;
    float eps, scale, mscale;
};

/* RoPE on rd dimensions at v (one warp), st_rope_row's rotation (qkv_head's cos / sin). */
__device__ __forceinline__ void mla_rope(float *v, int32_t p, const mla_prep_args &a, int lane) {
    for (int i = lane; i < a.rd / 2; i += 32) {
        const float theta = __fmul_rn((float)p, a.inv_freq[i]);
        rope_pair(v, i, a.rd, a.rope_type, __fmul_rn((float)cos((double)theta), a.mscale),
                  __fmul_rn((float)sin((double)theta), a.mscale));
    }
    __syncwarp();
}

/* A block per (token, MLA_PREP_WARPS heads) and one more per token for its cache row (grid (T, mla_prep_ny(H))):
 * block y < ny - 1 gives warp w head h = y * MLA_PREP_WARPS + w: rotates q_pe and writes the scaled parts; block
 * ny - 1's warp 0 normalises the latent (kv_a_norm), rotates k_pe and writes the row to the cache (mla.c's loop, each
 * head's and the row's arithmetic as one warp of one block per token did it: the same bits, spread over H / 4 + 1
 * blocks instead of one). */
static inline unsigned mla_prep_ny(int64_t H) { return (unsigned)((H + MLA_PREP_WARPS - 1) / MLA_PREP_WARPS + 1); }
__global__ void __launch_bounds__(MLA_PREP_WARPS * 32) k_mla_prep(mla_prep_args a) {
    PDL_ENTER();
    extern __shared__ float mla_prep_s[]; /* the row [ck] (the last block) or [MLA_PREP_WARPS][hd] */
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t p = a.pos[t];
    if (blockIdx.y == gridDim.y - 1) {
        if (warp) return;
        float *row = mla_prep_s;
        for (int i = lane; i < a.ck; i += 32) row[i] = a.mkv[(int64_t)t * a.ck + i];
        __syncwarp();
        head_rmsnorm(row, a.kv_norm, a.kl, a.eps, lane);
        mla_rope(row + a.kl, p, a, lane);
        const int32_t blk = a.block_tables[(int64_t)a.seq[t] * a.max_blocks + p / a.block_size];
        __half *dst = a.kc + ((int64_t)blk * a.block_size + p % a.block_size) * a.ck;
        for (int i = lane; i < a.ck; i += 32) dst[i] = __float2half_rn(row[i]);
        return;
    }
    const int h = blockIdx.y * MLA_PREP_WARPS + warp;
    if (h >= a.H) return;
    float *v = mla_prep_s + warp * a.hd;
    const float *src = a.mq + (int64_t)t * a.H * a.hd + (int64_t)h * a.hd;
    for (int i = lane; i < a.hd; i += 32) v[i] = src[i];
    __syncwarp();
    mla_rope(v + a.nope, p, a, lane);
    const int64_t r = (int64_t)t * a.H + h;
    for (int i = lane; i < a.nope; i += 32) a.mg[r * a.nope + i] = __fmul_rn(v[i], a.scale);
    for (int i = lane; i < a.rd; i += 32) a.qa[r * a.ck + a.kl + i] = __fmul_rn(v[a.nope + i], a.scale);
}
/* k_mla_prep's dynamic shared memory: the row or a block's heads, whichever is larger */
static inline size_t mla_prep_smem(int64_t ck, int64_t hd) {
    return sizeof(float) * (size_t)std::max(ck, (int64_t)MLA_PREP_WARPS * hd);
}

struct mla_att_args {
    const float *q;  /* [T, H, ck] the absorbed queries, pre-scaled */
    float *out;      /* [T * H, kl] the heads' latent outputs */
    const __half *kc; /* this layer's rows [block][slot][ck] */
    const int32_t *pos, *seq, *block_tables;
    int32_t max_blocks, H, ck, kl, block_size;
};

/* The reference of k_mla_attention (the harness's, stg_test_mla_attention): the same arithmetic in the plainest
 * order of loads. Attention over the latent rows: a block per (token, G heads), keys 0 .. pos[t] of the token's
 * sequence in chunks of MLA_CH. Per chunk, each warp scores keys warp, warp + 4, ... for the G heads (lanes over the
 * row's dimensions, one load of each key value for all G queries, a fixed warp_sum tree); warp 0 then runs the online softmax per
 * head (the chunk's max, the rescale, exp, the sum over the chunk's keys by one fixed tree) and leaves the chunk's
 * probabilities in shared memory; every thread adds them times the latent values of its dimensions (key order).
 * The arithmetic of a (token, head) depends only on its own sequence's keys: the batch around it changes no bit. */
template <int G>
__global__ void __launch_bounds__(MLA_THREADS) k_mla_attention_ref(mla_att_args a) {
    PDL_ENTER();
    extern __shared__ float mla_qs[]; /* [G][ck] */
    __shared__ float pr[G][MLA_CH];
    __shared__ float corr_s[G], l_s[G];
    const int t = blockIdx.x, h0 = blockIdx.y * G, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int ck = a.ck, kl = a.kl, bs = a.block_size;
    for (int i = tid; i < G * ck; i += MLA_THREADS) mla_qs[i] = a.q[((int64_t)t * a.H + h0) * ck + i];
    const int32_t n_keys = a.pos[t] + 1;
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t] * a.max_blocks;
    float acc[G][MLA_VMAX];
    float M[G], L[G]; /* warp 0's running max and sum per head */
#pragma unroll
    for (int g = 0; g < G; g++) {
        M[g] = -INFINITY, L[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_VMAX; i++) acc[g][i] = 0.0f;
    }
    __syncthreads();
    for (int32_t k0 = 0; k0 < n_keys; k0 += MLA_CH) {
        const int nk = min(MLA_CH, n_keys - k0);
        for (int j = warp; j < nk; j += MLA_THREADS / 32) {
            const int32_t p = k0 + j;
            const __half *row = a.kc + ((int64_t)bt[p / bs] * bs + p % bs) * ck;
            float d[G];
#pragma unroll
            for (int g = 0; g < G; g++) d[g] = 0.0f;
            for (int c = lane; c < ck; c += 32) {
                const float kv = __half2float(row[c]);
#pragma unroll
                for (int g = 0; g < G; g++) d[g] = fmaf(mla_qs[g * ck + c], kv, d[g]);
            }
#pragma unroll
            for (int g = 0; g < G; g++) {
                d[g] = warp_sum(d[g]);
                if (lane == 0) pr[g][j] = d[g];
            }
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float s0 = lane < nk ? pr[g][lane] : -INFINITY, s1 = lane + 32 < nk ? pr[g][lane + 32] : -INFINITY;
                const float mn = fmaxf(M[g], warp_max(fmaxf(s0, s1)));
                const float corr = expf(M[g] - mn); /* 0 on the first chunk (M = -inf, mn finite) */
                const float p0 = lane < nk ? expf(s0 - mn) : 0.0f, p1 = lane + 32 < nk ? expf(s1 - mn) : 0.0f;
                pr[g][lane] = p0, pr[g][lane + 32] = p1;
                L[g] = __fmaf_rn(L[g], corr, warp_sum(p0 + p1));
                M[g] = mn;
                if (lane == 0) corr_s[g] = corr;
            }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float corr = corr_s[g];
#pragma unroll
            for (int i = 0; i < MLA_VMAX; i++) acc[g][i] *= corr;
        }
        for (int j = 0; j < nk; j++) {
            const int32_t p = k0 + j;
            const __half *row = a.kc + ((int64_t)bt[p / bs] * bs + p % bs) * ck;
#pragma unroll
            for (int i = 0; i < MLA_VMAX; i++) {
                const int c = tid + MLA_THREADS * i;
                if (c < kl) {
                    const float v = __half2float(row[c]);
#pragma unroll
                    for (int g = 0; g < G; g++) acc[g][i] = fmaf(pr[g][j], v, acc[g][i]);
                }
            }
        }
        __syncthreads(); /* pr is refilled by the next chunk */
    }
    if (warp == 0 && lane == 0) {
#pragma unroll
        for (int g = 0; g < G; g++) l_s[g] = L[g];
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int i = 0; i < MLA_VMAX; i++) {
            const int c = tid + MLA_THREADS * i;
            if (c < kl) a.out[((int64_t)t * a.H + h0 + g) * kl + c] = __fdiv_rn(acc[g][i], l_s[g]);
        }
    }
}

/* k_mla_attention_ref's arithmetic, every (token, head) bit for bit, with the loads issued ahead of their use (the
 * reference waits on one global load per latent dimension and key): the chunk's row offsets (block table looked up
 * once per key) in shared memory; each warp scores two keys at a time (j and j + 4), a lane's MLA_SU values of both
 * rows loaded before their FMAs (the same c = lane + 32 i order); the weighted sum over the chunk's values four keys
 * at a time, every value loaded before the FMAs (key order kept). A (token, head)'s bits depend on neither G nor the
 * batch, so mla_block picks G for the grid's size (mla_att_g). */
#define MLA_SU 9 /* a lane's values of a row loaded at a time: 576 (DeepSeek-V3's kl + rd) in two */
template <int G>
__global__ void __launch_bounds__(MLA_THREADS) k_mla_attention(mla_att_args a) {
    PDL_ENTER();
    extern __shared__ float mla_qs[]; /* [G][ck] */
    __shared__ float pr[G][MLA_CH];
    __shared__ float corr_s[G], l_s[G];
    __shared__ int64_t roff[MLA_CH];
    constexpr int NW = MLA_THREADS / 32;
    const int t = blockIdx.x, h0 = blockIdx.y * G, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int ck = a.ck, kl = a.kl, bs = a.block_size;
    const float *qg = a.q + ((int64_t)t * a.H + h0) * ck;
#pragma unroll 4
    for (int i = tid; i < G * ck; i += MLA_THREADS) mla_qs[i] = qg[i];
    const int32_t n_keys = a.pos[t] + 1;
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t] * a.max_blocks;
    float acc[G][MLA_VMAX];
    float M[G], L[G]; /* warp 0's running max and sum per head */
#pragma unroll
    for (int g = 0; g < G; g++) {
        M[g] = -INFINITY, L[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < MLA_VMAX; i++) acc[g][i] = 0.0f;
    }
    for (int32_t k0 = 0; k0 < n_keys; k0 += MLA_CH) {
        const int nk = min(MLA_CH, n_keys - k0);
        for (int j = tid; j < nk; j += MLA_THREADS) {
            const int32_t p = k0 + j;
            roff[j] = ((int64_t)bt[p / bs] * bs + p % bs) * ck;
        }
        __syncthreads(); /* roff and (the first chunk) mla_qs written */
        for (int j = warp; j < nk; j += 2 * NW) {
            const int j2 = j + NW;
            const bool two = j2 < nk;
            const __half *r1 = a.kc + roff[j], *r2 = a.kc + roff[two ? j2 : j];
            float d1[G], d2[G];
#pragma unroll
            for (int g = 0; g < G; g++) d1[g] = d2[g] = 0.0f;
            for (int c0 = lane; c0 < ck; c0 += 32 * MLA_SU) {
                float k1[MLA_SU], k2[MLA_SU];
#pragma unroll
                for (int u = 0; u < MLA_SU; u++) {
                    const int c = c0 + 32 * u;
                    k1[u] = c < ck ? __half2float(r1[c]) : 0.0f;
                    k2[u] = c < ck ? __half2float(r2[c]) : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < MLA_SU; u++) {
                    const int c = c0 + 32 * u;
                    if (c < ck) {
#pragma unroll
                        for (int g = 0; g < G; g++) {
                            const float qv = mla_qs[g * ck + c];
                            d1[g] = fmaf(qv, k1[u], d1[g]);
                            d2[g] = fmaf(qv, k2[u], d2[g]);
                        }
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; g++) {
                d1[g] = warp_sum(d1[g]);
                d2[g] = warp_sum(d2[g]);
                if (lane == 0) {
                    pr[g][j] = d1[g];
                    if (two) pr[g][j2] = d2[g];
                }
            }
        }
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float s0 = lane < nk ? pr[g][lane] : -INFINITY, s1 = lane + 32 < nk ? pr[g][lane + 32] : -INFINITY;
                const float mn = fmaxf(M[g], warp_max(fmaxf(s0, s1)));
                const float corr = expf(M[g] - mn); /* 0 on the first chunk (M = -inf, mn finite) */
                const float p0 = lane < nk ? expf(s0 - mn) : 0.0f, p1 = lane + 32 < nk ? expf(s1 - mn) : 0.0f;
                pr[g][lane] = p0, pr[g][lane + 32] = p1;
                L[g] = __fmaf_rn(L[g], corr, warp_sum(p0 + p1));
                M[g] = mn;
                if (lane == 0) corr_s[g] = corr;
            }
        }
        __syncthreads();
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float corr = corr_s[g];
#pragma unroll
            for (int i = 0; i < MLA_VMAX; i++) acc[g][i] *= corr;
        }
        for (int j0 = 0; j0 < nk; j0 += 4) {
            float v[4][MLA_VMAX];
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                const __half *row = a.kc + roff[min(j0 + jj, nk - 1)];
#pragma unroll
                for (int i = 0; i < MLA_VMAX; i++) {
                    const int c = tid + MLA_THREADS * i;
                    v[jj][i] = c < kl ? __half2float(row[c]) : 0.0f;
                }
            }
#pragma unroll
            for (int jj = 0; jj < 4; jj++) {
                if (j0 + jj >= nk) break;
#pragma unroll
                for (int i = 0; i < MLA_VMAX; i++) {
                    const int c = tid + MLA_THREADS * i;
                    if (c < kl) {
#pragma unroll
                        for (int g = 0; g < G; g++) acc[g][i] = fmaf(pr[g][j0 + jj], v[jj][i], acc[g][i]);
                    }
                }
            }
        }
        __syncthreads(); /* pr and roff are refilled by the next chunk */
    }
    if (warp == 0 && lane == 0) {
#pragma unroll
        for (int g = 0; g < G; g++) l_s[g] = L[g];
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; g++) {
#pragma unroll
        for (int i = 0; i < MLA_VMAX; i++) {
            const int c = tid + MLA_THREADS * i;
            if (c < kl) a.out[((int64_t)t * a.H + h0 + g) * kl + c] = __fdiv_rn(acc[g][i], l_s[g]);
        }
    }
}

/* k_mla_attention's heads per block for T tokens of H heads: the most of 8, 4, 2, 1 that divides H, fits the default
 * shared memory and still gives the grid MLA_ATT_BLOCKS blocks (a block reads each key row once for its G heads, so
 * more heads per block read less, but at batch 1 DeepSeek-V3's 128 heads in blocks of 8 are 16 blocks: 16 of the
 * GPU's SMs, each a serial pass over the keys); 1 where none gives that many. */
#define MLA_ATT_BLOCKS 128
static int mla_att_g(int64_t T, int64_t H, int64_t ck) {
    for (int G = 8; G > 1; G /= 2)
        if (H % G == 0 && mla_att_smem(G, (int)ck) <= MLA_SMEM_MAX && T * (H / G) >= MLA_ATT_BLOCKS) return G;
    return 1;
}

/* k_mla_attention (ref false) or k_mla_attention_ref (true) with G heads per block over T tokens */
static stg_status mla_attention(cudaStream_t st, const mla_att_args &aa, int32_t T, int G, bool ref) {
    const dim3 grid((unsigned)T, (unsigned)(aa.H / G));
    const size_t smem = mla_att_smem(G, aa.ck);
    switch (G * 2 + (ref ? 1 : 0)) {
    case 16: launch_k(k_mla_attention<8>, grid, MLA_THREADS, smem, st, aa); break;
    case 8: launch_k(k_mla_attention<4>, grid, MLA_THREADS, smem, st, aa); break;
    case 4: launch_k(k_mla_attention<2>, grid, MLA_THREADS, smem, st, aa); break;
    case 2: launch_k(k_mla_attention<1>, grid, MLA_THREADS, smem, st, aa); break;
    case 17: launch_k(k_mla_attention_ref<8>, grid, MLA_THREADS, smem, st, aa); break;
    case 9: launch_k(k_mla_attention_ref<4>, grid, MLA_THREADS, smem, st, aa); break;
    case 5: launch_k(k_mla_attention_ref<2>, grid, MLA_THREADS, smem, st, aa); break;
    case 3: launch_k(k_mla_attention_ref<1>, grid, MLA_THREADS, smem, st, aa); break;
    default: return fail(ST_EINVAL, "latent attention: %d heads per block", G);
    }
    LAUNCHED("latent attention");
    return ST_OK;
}

/* The absorption matrix of a layer with wkv_b: kb[h][r][j] = W_UK_h[j][r], W_UK_h's rows being wkv_b's rows
 * h * (nope + vd) + j, j < nope (st_mla_prepare's transposed F32 copy; deq_block is the CPU's dequantisation bit for
 * bit). A block per (head, j). */
template <int T>
__global__ void k_mla_absorb(const uint8_t *w, int64_t row_bytes, int32_t nope, int32_t vd, int32_t kl, float *kb) {
    __shared__ float row[MLA_MAX_KL];
    const int h = blockIdx.x / nope, j = blockIdx.x % nope;
    const uint8_t *src = w + ((int64_t)h * (nope + vd) + j) * row_bytes;
    for (int b = threadIdx.x; b < kl / qt<T>::BE; b += blockDim.x) deq_block<T>(src + (int64_t)b * qt<T>::BB, row + b * qt<T>::BE);
    __syncthreads();
    for (int r = threadIdx.x; r < kl; r += blockDim.x) kb[((int64_t)h * kl + r) * nope + j] = row[r];
}

/* The checks of the latent attention's tensors and sizes (after validate's; the CPU's validate runs first from
 * Python): what mla.cu's kernels rely on. */
static stg_status mla_validate(const stg_model *m, const st_layer *layers) {
    const st_model_desc &d = m->d;
    const int64_t E = d.n_embd, H = d.n_head, kl = d.kv_lora_rank, ql = d.q_lora_rank, rd = d.rope_dim;
    const int64_t hd = d.head_dim, nope = hd - rd, vd = d.head_dim_v > 0 ? d.head_dim_v : hd, ck = kl + rd;
    if (d.n_head_kv != 1) return fail(ST_EINVAL, "model: latent attention caches one row (n_head_kv %d)", d.n_head_kv);
    if (nope < 1 || kl % 32 || kl > MLA_MAX_KL || mla_att_smem(1, (int)ck) > MLA_SMEM_MAX)
        return fail(ST_EUNSUPPORTED, "model: latent attention with kv_lora_rank %lld (a multiple of 32, at most %d) and "
                                     "rope_dim %lld / head_dim %lld unsupported on the GPU",
                    (long long)kl, MLA_MAX_KL, (long long)rd, (long long)hd);
    if (ql < 0 || (ql > 0 && ql % 32)) return fail(ST_EINVAL, "model: q_lora_rank %lld invalid", (long long)ql);
    for (int il = 0; il < d.n_layer; il++) {
        const st_layer &l = layers[il];
        if (ql > 0) {
            CHECK(check_t(l.wq_a, "attn_q_a", il, true, E, ql, 1, false));
            CHECK(check_t(l.q_a_norm, "attn_q_a_norm", il, true, ql, 1, 1, true));
            CHECK(check_t(l.wq_b, "attn_q_b", il, true, ql, H * hd, 1, false));
        } else {
            CHECK(check_t(l.wq, "attn_q", il, true, E, H * hd, 1, false));
        }
        CHECK(check_t(l.wkv_a, "attn_kv_a_mqa", il, true, E, ck, 1, false));
        CHECK(check_t(l.kv_a_norm, "attn_kv_a_norm", il, true, kl, 1, 1, true));
        if (l.wkv_b.data) {
            CHECK(check_t(l.wkv_b, "attn_kv_b", il, true, kl, H * (nope + vd), 1, false));
        } else {
            CHECK(check_t(l.wk_b, "attn_k_b", il, true, nope, kl, H, false));
            CHECK(check_t(l.wv_b, "attn_v_b", il, true, kl, vd, H, false));
        }
        CHECK(check_t(l.wo, "attn_output", il, true, H * vd, E, 1, false));
    }
    return ST_OK;
}

/* At upload (the arena written): each layer's absorption matrix, wk_b as it is or wkv_b's key rows transposed into
 * an F32 copy (in the model's allocations). */
static stg_status mla_prepare(stg_model *m) {
    const st_model_desc &d = m->d;
    const int64_t H = d.n_head, kl = d.kv_lora_rank, nope = d.head_dim - d.rope_dim;
    const int64_t vd = d.head_dim_v > 0 ? d.head_dim_v : d.head_dim;
    for (int il = 0; il < d.n_layer; il++) {
        dlayer &l = m->L[(size_t)il];
        if (!l.wkv_b.d) {
            l.mla_kb = l.wk_b;
            continue;
        }
        float *kb = nullptr;
        CHECK(dalloc(m, &kb, sizeof(float) * (size_t)(H * kl * nope)));
        switch (l.wkv_b.type) {
#define CASE_K(TY)                                                                                                  \
    case TY:                                                                                                        \
        k_mla_absorb<TY><<<(unsigned)(H * nope), 128>>>(l.wkv_b.d, l.wkv_b.row_bytes, (int32_t)nope, (int32_t)vd,    \
                                                         (int32_t)kl, kb);                                          \
        break;
            QUANT_CASES(CASE_K)
            FLOAT_CASES(CASE_K)
#undef CASE_K
        default: return fail(ST_EUNSUPPORTED, "layer %d: attn_kv_b of type %d", il, l.wkv_b.type);
        }
        LAUNCHED("latent attention: absorption matrix");
        dtensor &t = l.mla_kb;
        t.d = (const uint8_t *)kb, t.type = STG_F32;
        t.ne[0] = nope, t.ne[1] = kl, t.ne[2] = H, t.ne[3] = 1;
        t.row_bytes = (int64_t)sizeof(float) * nope, t.expert_stride = t.row_bytes * kl;
    }
    CU(cudaDeviceSynchronize(), "latent attention: absorption matrices");
    return ST_OK;
}

/* out[t, h, :rows] (leading dimension ldo per (t, h) row) = W_h . x[t * H + h, :n_in] for every head: W_h is `rows`
 * rows at base + h * head_bytes. x quantised into s.aq first when W is. */
static stg_status mla_heads(stg_model *m, const dtensor &W, const uint8_t *base, int64_t head_bytes, int64_t n_in,
                            int64_t rows, int32_t T, const float *x, float *out, int64_t ldo) {
    scratch &s = m->s;
    const int32_t H = m->d.n_head;
    if (stg_reads_q32(W.type)) CHECK(quantize(m->stream, x, (int64_t)T * H, n_in, s.aq, s.ad, s.as));
    dtensor v = W;
    v.d = base, v.ne[0] = n_in, v.ne[1] = rows, v.ne[2] = H, v.ne[3] = 1;
    v.row_bytes = stg_row_bytes(W.type, n_in), v.expert_stride = head_bytes;
    lin_groups g = {};
    g.gexp = s.mla_gexp, g.gstart = s.mla_gstart, g.gcount = s.mla_gcount, g.list = s.mla_list;
    g.n_pairs = T * H;
    return linear(m->stream, v, nullptr, g, H, T, T, acts_d{s.aq, s.ad, s.as, x}, out, ldo, MODE_STORE);
}

/* deepseek2's attention block of layer il: RMSNorm (adding the pending expert sum), q and the new cache rows, the
 * absorbed queries, attention over the latent, each head's expansion, wo added to the residual (mla.c's order). */
static stg_status mla_block(stg_model *m, stg_kv *kv, int il, int32_t T, const int32_t *d_pos, const int32_t *d_seq,
                            const int32_t *d_bt, int32_t max_blocks) {
    const dlayer &L = m->L[(size_t)il];
    scratch &s = m->s;
    const st_model_desc &d = m->d;
    cudaStream_t st = m->stream;
    const int64_t E = d.n_embd, H = d.n_head, kl = d.kv_lora_rank, rd = d.rope_dim, hd = d.head_dim;
    const int64_t nope = hd - rd, ck = kl + rd, ql = d.q_lora_rank, vd = d.head_dim_v > 0 ? d.head_dim_v : hd;
    const dtensor &wq = ql > 0 ? L.wq_a : L.wq;
    const bool nq = !stg_is_float(wq.type) || !stg_is_float(L.wkv_a.type);
    launch_k(k_rmsnorm, T, RMS_THREADS, 0, st, s.x, nullptr, L.attn_norm.f(), s.xn, E, d.norm_eps, nq ? s.aq : nullptr,
             s.ad, s.as, take_combine(m));
    LAUNCHED("rmsnorm");
    const acts_d in{s.aq, s.ad, s.as, s.xn};
    lin_groups g = {};
    g.n_pairs = T;
    CHECK(linear(st, wq, nullptr, g, 1, T, T, in, ql > 0 ? s.mqa : s.mq, ql > 0 ? ql : H * hd, MODE_STORE));
    CHECK(linear(st, L.wkv_a, nullptr, g, 1, T, T, in, s.mkv, ck, MODE_STORE));
    if (ql > 0) {
        const bool bq = !stg_is_float(L.wq_b.type);
        launch_k(k_rmsnorm, T, RMS_THREADS, 0, st, s.mqa, nullptr, L.q_a_norm.f(), s.mqa, ql, d.norm_eps,
                 bq ? s.aq : nullptr, s.ad, s.as, combine_args{});
        LAUNCHED("rmsnorm (q_a)");
        CHECK(linear(st, L.wq_b, nullptr, g, 1, T, T, acts_d{s.aq, s.ad, s.as, s.mqa}, s.mq, H * hd, MODE_STORE));
    }
    launch_k(k_mla_groups, (unsigned)((T * H + 255) / 256), 256, 0, st, T, (int32_t)H, s.mla_gexp, s.mla_gstart,
             s.mla_gcount, s.mla_list);
    LAUNCHED("latent attention: head groups");
    mla_prep_args pa;
    pa.mq = s.mq, pa.mkv = s.mkv, pa.kv_norm = L.kv_a_norm.f(), pa.inv_freq = m->inv_freq;
    pa.pos = d_pos, pa.seq = d_seq, pa.block_tables = d_bt;
    pa.kc = kv->k + (int64_t)il * kv->layer_elems;
    pa.mg = s.mg, pa.qa = s.q;
    pa.H = (int32_t)H, pa.hd = (int32_t)hd, pa.nope = (int32_t)nope, pa.rd = (int32_t)rd, pa.kl = (int32_t)kl;
    pa.ck = (int32_t)ck, pa.rope_type = d.rope_type, pa.max_blocks = max_blocks, pa.block_size = kv->block_size;
    pa.eps = d.norm_eps, pa.scale = 1.0f / sqrtf((float)hd), pa.mscale = m->rope_mscale;
    launch_k(k_mla_prep, dim3((unsigned)T, mla_prep_ny(H)), MLA_PREP_WARPS * 32, mla_prep_smem(ck, hd), st, pa);
    LAUNCHED("latent attention: prep");
    /* each head's q_nope into the latent space: s.q[t, h, 0 .. kl) */
    const dtensor &kb = L.mla_kb;
    CHECK(mla_heads(m, kb, kb.d, kb.expert_stride, nope, kl, T, s.mg, s.q, ck));
    mla_att_args aa;
    aa.q = s.q, aa.out = s.att, aa.kc = pa.kc, aa.pos = d_pos, aa.seq = d_seq, aa.block_tables = d_bt;
    aa.max_blocks = max_blocks, aa.H = (int32_t)H, aa.ck = (int32_t)ck, aa.kl = (int32_t)kl;
    aa.block_size = kv->block_size;
    CHECK(mla_attention(st, aa, T, mla_att_g(T, H, ck), false));
    /* each head's latent output expanded to its value space: s.mo[T, H * vd] */
    if (L.wkv_b.d) { /* head h's value rows follow its nope key rows */
        const int64_t rb = L.wkv_b.row_bytes;
        CHECK(mla_heads(m, L.wkv_b, L.wkv_b.d + nope * rb, (nope + vd) * rb, kl, vd, T, s.att, s.mo, vd));
    } else {
        CHECK(mla_heads(m, L.wv_b, L.wv_b.d, L.wv_b.expert_stride, kl, vd, T, s.att, s.mo, vd));
    }
    stg_status rc = ST_OK;
    const acts_d ain = layer_acts(m, s.mo, T, H * vd, stg_reads_q32(L.wo.type), &rc);
    CHECK(rc);
    return linear(st, L.wo, nullptr, g, 1, T, T, ain, s.x, E, MODE_ADD);
}
