/* Output head and greedy picks: the head's staged Q6_K matvec at batch 1 and the device argmax
 * (st_batch.out_tokens). */
#include "linear.cuh"

/* The output head's Q6_K single-pair matvec (at least Q6_ROWS_MIN_N rows: batch 1) on k_q6_stage, or where
 * its weight is not 16-byte aligned on k_linear_q_rows with 2 rows per warp. */
#define Q6_ROWS_MIN_N 65536

/* The output head at batch 1 (a dense single-pair Q6_K matvec of at least Q6_ROWS_MIN_N rows: 255 MB a step at
 * Qwen3-30B's vocabulary, 760 MB at DeepSeek-V3's) with each warp's R consecutive rows first copied into the block's
 * shared memory by 16-byte cp.async (the span of 16-byte granules holding them, so that every byte keeps its address
 * mod 16), then k_linear_q_rows<STG_Q6_KW, R>'s loop run on the shared copy (unpack_q6k_wide<true>: its five 8-byte
 * loads per 32-byte chunk as ld.shared). Why: a lane's 8-byte global loads of a 2-byte aligned block touch ~7-8 L1
 * lines per warp instruction for ~210 distinct bytes, ~168 L1 wavefronts per 1,680-byte row (~107 us of the L1's data
 * path over the head, about what the head takes, if a wavefront is a line): the copy reads each line once, 512
 * contiguous bytes per instruction, and the shared loads cost 1-2 wavefronts each. The same bytes and the same
 * unpack, sub_dot chain and butterfly: the same bits. R: Q6S_ROWS where the block's copies fit 48 KB, else fewer (the
 * largest of 4, 2, 1 that fits: K 4,096 and 7,168 take 2). Rows need no 16-byte alignment (a row of K 7,168 is
 * 5,880 bytes): the granule span keeps each byte's address mod 16, and the one granule that would reach past the
 * weight's last byte is copied byte by byte (nothing past the weight is read). Shared memory:
 * LIN_WARPS * q6s_span16(R) * 16. */
#define Q6S_ROWS 4
__host__ __device__ __forceinline__ int64_t q6s_span16(int R, int64_t row_bytes) { return (R * row_bytes + 47) / 16; }
template <int R> __global__ void __launch_bounds__(LIN_WARPS * WARP) k_q6_stage(lin_args a) {
    extern __shared__ uint4 q6s[];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int rb = (blockIdx.x * LIN_WARPS + warp) * R; /* this warp's first row */
    const int nr = rb < a.N ? min(R, a.N - rb) : 0;
    const uintptr_t g0 = (uintptr_t)(a.w + (int64_t)rb * a.row_bytes), ga = g0 & ~(uintptr_t)15;
    const uintptr_t wend = (uintptr_t)(a.w + (int64_t)a.N * a.row_bytes); /* past the weight's last byte */
    const int n16 = nr ? (int)((g0 + nr * a.row_bytes + 15 - ga) / 16) : 0;
    uint4 *sw = q6s + warp * q6s_span16(R, a.row_bytes);
    pdl_trigger();
    pdl_wait();
    for (int i = lane; i < n16; i += WARP) {
        const uintptr_t src = ga + 16 * (uintptr_t)i;
        if (src + 16 <= wend) {
            cp_async16(sw + i, (const void *)src);
        } else { /* the weight's last, partial granule */
            uint8_t *d = (uint8_t *)(sw + i);
            for (int b = 0; b < 16 && src + b < wend; b++) d[b] = *(const uint8_t *)(src + b);
        }
    }
    cp_async_commit();
    int e, start, count;
    if (!nr || !group_of(a.g, blockIdx.y, e, start, count)) {
        cp_async_wait<0>();
        return;
    }
    const uint8_t *w0 = (const uint8_t *)sw + (g0 - ga); /* row rb in shared memory, its address mod 16 kept */
    const int nsb = a.K / 32;
    cp_async_wait<0>();
    __syncwarp();
    for (int pi = 0; pi < count; pi++) {
        const int p = pair_at(a.g, start, pi);
        const int64_t base = (int64_t)in_row(a.g, p) * a.K;
        float acc[R];
#pragma unroll
        for (int rr = 0; rr < R; rr++) acc[rr] = 0.0f;
        for (int j = lane; j < nsb; j += WARP) {
            sub_w s[R];
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                if (rr < nr) unpack_q6k_wide<true>(w0 + rr * a.row_bytes, j, s[rr]);
            const int8_t *q = a.aq + base + 32 * j;
            const float d = a.ad[base / 32 + j];
            const int32_t *sm = a.as + base / 16 + 2 * j;
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                if (rr < nr) acc[rr] = sub_dot(acc[rr], s[rr], q, d, sm);
        }
#pragma unroll
        for (int rr = 0; rr < R; rr++) acc[rr] = warp_sum(acc[rr]);
        if (lane == 0) {
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                if (rr < nr) store_at(a, a.out + (int64_t)p * a.ldo + rb + rr, acc[rr], 0.0f);
        }
    }
}

/* The shared memory of k_q6_stage<R>'s block (LIN_WARPS warps of R rows each) */
static inline int64_t q6s_smem(int R, int64_t row_bytes) { return (int64_t)LIN_WARPS * q6s_span16(R, row_bytes) * 16; }

/* The output head's launch on k_q6_stage (a dense single group) with the most rows per warp (Q6S_ROWS, 2, 1) whose
 * copies fit 48 KB of shared memory: false (nothing launched) when the weight is not 16-byte aligned (the first
 * granule would start before it) or not even one row per warp fits */
static bool launch_q6_stage(const lin_args &a, cudaStream_t st) {
    if ((uintptr_t)a.w & 15) return false;
    const int R = q6s_smem(Q6S_ROWS, a.row_bytes) <= 48 * 1024 ? Q6S_ROWS
                  : q6s_smem(2, a.row_bytes) <= 48 * 1024       ? 2
                  : q6s_smem(1, a.row_bytes) <= 48 * 1024       ? 1
                                                                : 0;
    if (!R) return false;
    const dim3 g((unsigned)((a.N + LIN_WARPS * R - 1) / (LIN_WARPS * R)), 1u);
    const size_t smem = (size_t)q6s_smem(R, a.row_bytes);
    if (R == Q6S_ROWS) launch_k(k_q6_stage<Q6S_ROWS>, g, LIN_WARPS * 32, smem, st, a);
    else if (R == 2) launch_k(k_q6_stage<2>, g, LIN_WARPS * 32, smem, st, a);
    else launch_k(k_q6_stage<1>, g, LIN_WARPS * 32, smem, st, a);
    return true;
}

/* ------------------------------------------------------------ greedy pick */

/* A float's place in the greedy pick's order (st_batch.out_tokens: numpy argmax's rule) as an
 * unsigned key: every NaN above +inf, -0.0 equal to +0.0, otherwise the values' order; every
 * key is at least 0x007fffff (-inf), so 0 means "nothing seen". */
__device__ __forceinline__ uint32_t pick_key(float v) {
    if (v != v) return 0xffffffffu;
    const uint32_t u = __float_as_uint(v) == 0x80000000u ? 0u : __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#define ARGMAX_SPLIT_THREADS 256
/* The block's largest (key << 32 | ~index) over elements [b, e) of a row (in thread 0): each thread keeps the first
 * of its largest keys over its elements in increasing index order (vec: float4 loads, four in flight; b and e then
 * multiples of 4 and the row 16-byte aligned), then the block takes the largest pair: the largest key, then the
 * lowest index. 0 when the range is empty. */
__device__ __forceinline__ unsigned long long pick_block(const float *row, int64_t b, int64_t e, bool vec) {
    const int bt = blockDim.x;
    uint32_t kb = 0, ib = 0;
    auto see = [&](float v, int64_t i) {
        const uint32_t k = pick_key(v);
        if (k > kb) kb = k, ib = (uint32_t)i;
    };
    if (vec) {
        const float4 *r4 = (const float4 *)row;
        const int64_t e4 = e >> 2;
        int64_t j = (b >> 2) + threadIdx.x;
        for (; j + 3 * bt < e4; j += 4 * bt) {
            float4 a[4];
#pragma unroll
            for (int u = 0; u < 4; u++) a[u] = r4[j + u * bt];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const int64_t i = 4 * (j + u * bt);
                see(a[u].x, i), see(a[u].y, i + 1), see(a[u].z, i + 2), see(a[u].w, i + 3);
            }
        }
        for (; j < e4; j += bt) {
            const float4 a = r4[j];
            see(a.x, 4 * j), see(a.y, 4 * j + 1), see(a.z, 4 * j + 2), see(a.w, 4 * j + 3);
        }
    } else {
        for (int64_t i = b + threadIdx.x; i < e; i += bt) see(row[i], i);
    }
    unsigned long long key = kb ? ((unsigned long long)kb << 32) | (unsigned long long)(~ib) : 0ull;
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    __shared__ unsigned long long part[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) part[warp] = key;
    __syncthreads();
    if (warp == 0) {
        key = lane < bt / 32 ? part[lane] : 0ull;
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
            key = other > key ? other : key;
        }
    }
    return key;
}

__device__ __forceinline__ bool pick_vec(const float *row, int64_t n) { return (n & 3) == 0 && ((uintptr_t)row & 15) == 0; }

/* out[r] = the first index of the maximum of row r of x[rows, n] (the greedy pick; st_argmax_rows' picks on the same
 * floats) with gridDim.x blocks per row (more SMs for a few rows): block (s, r)
 * takes the s-th slice of row r, puts its pair into keys[r] by atomicMax, and the row's last block to take a
 * ticket from cnt[r] writes out[r] and zeroes keys[r] and cnt[r] for the next launch (both zero between launches).
 * The largest pair does not depend on where the row is cut. */
__global__ void __launch_bounds__(ARGMAX_SPLIT_THREADS) k_argmax_split(const float *x, int64_t n, int32_t *out,
                                                                       unsigned long long *keys, unsigned int *cnt) {
    PDL_ENTER();
    const int r = blockIdx.y, S = gridDim.x;
    const float *row = x + (int64_t)r * n;
    const bool vec = pick_vec(row, n);
    int64_t chunk = (n + S - 1) / S;
    if (vec) chunk = (chunk + 3) & ~(int64_t)3;
    const int64_t b0 = (int64_t)blockIdx.x * chunk, b = b0 < n ? b0 : n, e = b + chunk < n ? b + chunk : n;
    const unsigned long long key = pick_block(row, b, e, vec);
    if (threadIdx.x == 0) {
        if (key) atomicMax(&keys[r], key);
        __threadfence();
        if (atomicAdd(&cnt[r], 1u) == (unsigned)S - 1) {
            const unsigned long long k = atomicExch(&keys[r], 0ull);
            out[r] = (int32_t)~(uint32_t)k;
            cnt[r] = 0;
        }
    }
}

/* The step's greedy pick runs k_argmax_split with ARGMAX_SPLIT blocks of 256 threads per row: more SMs for the
 * few rows of a decode step than one block per row. */
#define ARGMAX_SPLIT 16
