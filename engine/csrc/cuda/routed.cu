/* Routed experts: the single-pair matvec forms of decode (rows per warp for down, gate/up quantising
 * its own output), and the routed split GEMM's combine. */
#include "linear.cuh"

/* The routed Q4_K gate/up GEMMs over the tile list in steps of at most routed_split_max tokens run their k loop
 * over ROUTED_SPLIT blocks per tile (grid z; k_linear_gemm's RS form), each one subtree of the butterfly into
 * kpart[z][weight][pair][N]; k_ksplit_routed adds the parts as the tree's top levels, then the SWIGLU and the
 * down projection's 8-bit input (k_quant_act's launch fewer). Same bits. Why: the routed GEMMs' few busy
 * experts give few blocks of 16 serial stages. The down projection is not split (no faster). */
#define ROUTED_SPLIT 2

/* The routed gate/up matvec of single-pair passes (decode steps whose gate/up takes the matvec with one pair per
 * pass: 1-7 tokens at Qwen3-30B's shapes) also makes the down projection's 8-bit input without k_quant_act's
 * launch: the 32 rows of one chunk of one expert finish inside one block, so a barrier orders their h values
 * before quant_block32 makes the chunk's block exactly as k_quant_act does (same values, same places in hq / hd /
 * hs). Each row's sum is k_linear_q<T, 1, true>'s (lanes over sub-blocks j = lane + 32 i in order, the same
 * unpack, sub_dot chain and butterfly) and h = silu(g) * u is stored where it stores it, so the bits are the
 * same. Needs N % 32 == 0, ldo == N, no row segments, a routed launch. One block per (chunk, group) of
 * GU_CHUNK_WARPS warps with RW = 2 consecutive rows each (512 threads, two blocks per SM); per pass the rows' h
 * go to shared memory, one __syncthreads, then warp 0 quantises. Double-buffered: one barrier per pass. */
#define GU_CHUNK_WARPS 16
template <int T> __global__ void __launch_bounds__(GU_CHUNK_WARPS * WARP, 2) k_linear_q_chunk(lin_args a) {
    constexpr int RW = 32 / GU_CHUNK_WARPS;
    __shared__ float hb[2][32];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    int e, start, count;
    pdl_trigger();
    pdl_wait(); /* routed: the expert ids come from the predecessor */
    if (!group_of(a.g, blockIdx.y, e, start, count)) return; /* the whole block: no barrier below is skipped */
    const int c = blockIdx.x, rc = warp * RW; /* chunk; this warp's first row inside it */
    /* the warp's first rows of gate and up; row i is i * row_bytes further (two pointers live, not 2 * RW) */
    const int64_t off = e * a.expert_stride + (int64_t)(32 * c + rc) * a.row_bytes;
    const uint8_t *wrow = a.w + off, *wrow2 = a.w2 + off;
    const int nsb = a.K / 32;
    for (int p0 = 0; p0 < count; p0++) {
        const int64_t p = pair_at(a.g, start, p0), base = (int64_t)in_row(a.g, (int)p) * a.K;
        float acc[RW], acc2[RW];
#pragma unroll
        for (int i = 0; i < RW; i++) acc[i] = acc2[i] = 0.0f;
#pragma unroll 1 /* its two rows are the loads in flight (64 registers) */
        for (int j = lane; j < nsb; j += WARP) {
#pragma unroll
            for (int i = 0; i < RW; i++) {
                sub_w s, s2;
                unpack_sub<T>(wrow + i * a.row_bytes, j, s);
                unpack_sub<T>(wrow2 + i * a.row_bytes, j, s2);
                const int8_t *q = a.aq + base + 32 * j;
                const float d = a.ad[base / 32 + j];
                const int32_t *sm = a.as + base / 16 + 2 * j;
                acc[i] = sub_dot(acc[i], s, q, d, sm);
                acc2[i] = sub_dot(acc2[i], s2, q, d, sm);
            }
        }
        float *h = hb[p0 & 1];
#pragma unroll
        for (int i = 0; i < RW; i++) {
            acc[i] = warp_sum(acc[i]);
            acc2[i] = warp_sum(acc2[i]);
            if (lane == 0) {
                const float v = silu_f(acc[i]) * acc2[i]; /* store_at's MODE_SWIGLU value */
                a.out[p * a.ldo + 32 * c + rc + i] = v;
                h[rc + i] = v;
            }
        }
        __syncthreads();
        if (warp == 0)
            quant_block32(h[lane], lane, a.hq + p * a.N + 32 * c, a.hd + p * (a.N / 32) + c,
                          a.hs + p * (a.N / 16) + 2 * c);
    }
}

/* A routed plain matvec of single-pair passes (the down projection at decode: each group one pair, or a
 * few) with R consecutive weight rows per warp (8 for Q4_K): each lane's sub-blocks of all R rows are
 * loaded together and the pair's activations once for them, so the launch is one wave with more loads in
 * flight per warp (down at batch 1: 4,096 blocks of one row per warp would take 3.45 waves). Every row's
 * sum is k_linear_q's (lanes over sub-blocks j = lane + 32 i in order, the same sub_dot chain, the same
 * butterfly), so the bits are too. Also the dense output head's Q6_K matvec at one pair where k_q6_stage
 * cannot take it (2 rows per warp; one group, e = 0). */
template <int T, int R> __global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_q_rows(lin_args a) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int rb = (blockIdx.x * LIN_WARPS + warp) * R; /* this warp's first row */
    int e, start, count;
    PDL_ENTER(); /* routed: the expert ids come from the predecessor */
    if (rb >= a.N || !group_of(a.g, blockIdx.y, e, start, count)) return;
    const uint8_t *w0 = a.w + e * a.expert_stride + (int64_t)rb * a.row_bytes;
    const int nsb = a.K / 32;
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
                if (rb + rr < a.N) unpack_sub<T>(w0 + rr * a.row_bytes, j, s[rr]);
            const int8_t *q = a.aq + base + 32 * j;
            const float d = a.ad[base / 32 + j];
            const int32_t *sm = a.as + base / 16 + 2 * j;
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                if (rb + rr < a.N) acc[rr] = sub_dot(acc[rr], s[rr], q, d, sm);
        }
#pragma unroll
        for (int rr = 0; rr < R; rr++) acc[rr] = warp_sum(acc[rr]);
        if (lane == 0) {
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                if (rb + rr < a.N) store_at(a, a.out + (int64_t)p * a.ldo + rb + rr, acc[rr], 0.0f);
        }
    }
}

/* The parts of a routed split GEMM, kpart[z][w][pair][N] for S = 2 or 4 blocks z per tile and NW weights
 * (k_linear_gemm with a.ksplit and a.g.gexp), added as k_ksplit_combine does, then stored as the unsplit
 * launch stores: NW = 2 silu(gate) * up (MODE_SWIGLU), NW = 1 the value (MODE_STORE); with hq also the
 * 8-bit blocks of each output row exactly as k_quant_act makes them (N % 32 == 0: a warp is one block).
 * skip (lin_groups.pair_mv): pairs of another launch, left alone. */
__global__ void k_ksplit_routed(const float *part, int32_t S, int32_t NW, int32_t P, int32_t N, float *out, int64_t ldo,
                                int8_t *hq, float *hd, int32_t *hs, const int32_t *skip) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, plane = (int64_t)P * N, zs = NW * plane;
    if (i >= plane || (skip && skip[i / N])) return; /* a warp is 32 columns of one pair (N % 32 == 0) */
    float v = part[i] + part[zs + i];
    if (S == 4) v = v + (part[2 * zs + i] + part[3 * zs + i]);
    if (NW == 2) {
        const float *u = part + plane;
        float v2 = u[i] + u[zs + i];
        if (S == 4) v2 = v2 + (u[2 * zs + i] + u[3 * zs + i]);
        v = silu_f(v) * v2;
    }
    const int64_t p = i / N;
    const int32_t r = (int32_t)(i - p * N);
    out[p * ldo + r] = v;
    if (hq)
        quant_block32(v, threadIdx.x % WARP, hq + p * N + (r & ~31), hd + p * (N / 32) + r / 32, hs + p * (N / 16) + 2 * (r / 32));
}
