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

/* Programmatic dependent launch (sm_90): a kernel of the step lets the next one be scheduled
 * at once (launch_dependents) and waits for its predecessor's completion and memory before
 * touching anything the predecessor wrote or reads (wait). Before its wait a kernel may
 * only read weights. Without the launch attribute (or before sm_90) both are no-ops. */
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l1(const void *p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }
__device__ __forceinline__ void prefetch_l2_last(const void *p) {
    asm volatile("prefetch.global.L2::evict_last [%0];\n" ::"l"(p));
}

/* Asynchronous global -> shared copies (the attention kernels, the GEMM's staged Q4_K bytes). */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async4(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#define PDL_ENTER() \
    do {            \
        pdl_trigger(); \
        pdl_wait();    \
    } while (0)

/* ------------------------------------------------------------ dequantisation */

/* y[n] = dequant(src); one thread per block. */
template <int T> __global__ void k_dequant(const uint8_t *src, float *y, int64_t n_blocks) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_blocks) deq_block<T>(src + i * qt<T>::BB, y + i * qt<T>::BE);
}

/* Embedding rows: x[t, :] = dequant(table[tokens[t], :]); grid (T), block over blocks of the row. */
/* src (optional, st_batch.token_src): token t's id is picks[src[t]] where src[t] >= 0 (the previous
 * step's greedy pick, still in the picks buffer in stream order), else tokens[t]. */
template <int T> __global__ void k_embed(const uint8_t *table, int64_t row_bytes, const int32_t *tokens,
                                         const int32_t *src, const int32_t *picks, int64_t E, float *x) {
    PDL_ENTER();
    const int t = blockIdx.x;
    const int32_t j = src ? src[t] : -1;
    const uint8_t *row = table + (int64_t)(j >= 0 ? picks[j] : tokens[t]) * row_bytes;
    for (int64_t b = threadIdx.x; b < E / qt<T>::BE; b += blockDim.x)
        deq_block<T>(row + b * qt<T>::BB, x + (int64_t)t * E + b * qt<T>::BE);
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

/* One warp per 32-block: rows x[R, K] -> aq[R, K], ad[R, K/32], as[R, K/16]. */
__global__ void k_quant_act(const float *x, int64_t K, int64_t n_rows, int8_t *aq, float *ad, int32_t *as) {
    PDL_ENTER();
    const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const int lane = threadIdx.x % WARP;
    const int64_t nb = K / 32;
    if (gw >= n_rows * nb) return;
    const int64_t r = gw / nb, b = gw % nb;
    quant_block32(x[r * K + b * 32 + lane], lane, aq + r * K + b * 32, ad + r * nb + b, as + r * (K / 16) + 2 * b);
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
    int32_t n_pairs; /* with gexp: at most this many pairs in all groups together (sizes a tiled GEMM grid) */
    /* with gexp: group_pairs' GEMM tiles (group << 16 | tile) and their device count; the GEMM
     * launch gets them only when it runs a block per tile (gridDim.z == 1), else NULL */
    const int32_t *tiles, *n_tiles;
};

#define MODE_STORE 0
#define MODE_ADD 1    /* out += result (residual) */
#define MODE_SWIGLU 2 /* out = silu(W . x) * (W2 . x) */

/* Up to 3 weights of one type and row length in one launch (q, k, v): rows [seg_row[i],
 * seg_row[i+1]) of the launch read seg_w[i] and write seg_out[i] (leading dimension
 * seg_ldo[i]). n_seg < 2: the single weight w into out. */
struct lin_seg {
    int32_t n_seg;
    int32_t seg_row[4];
    const uint8_t *seg_w[3];
    float *seg_out[3];
    int64_t seg_ldo[3];
};

struct lin_args {
    const uint8_t *w, *w2;
    int64_t expert_stride, row_bytes;
    int32_t N, K;
    lin_seg seg;
    lin_groups g;
    const int8_t *aq;
    const float *ad;
    const int32_t *as;
    const float *x; /* float activations (float weights) */
    float *out;
    int64_t ldo;
    int mode;
    /* routed SWIGLU only (N % 32 == 0, ldo == N): also quantise the output rows to 8-bit blocks for the
     * down projection (hq[P, N], hd[P, N/32], hs[P, N/16], exactly k_quant_act's layout and values), by
     * k_linear_q_chunk or the routed split's k_ksplit_routed. NULL: not fused. */
    int8_t *hq;
    float *hd;
    int32_t *hs;
    /* GEMM plain form of a dense launch only: ksplit 2 or 4 splits the k loop over gridDim.z = ksplit
     * blocks, each writing its part of the butterfly tree to kpart[z][pair][N] (k_ksplit_combine adds
     * them as the tree's top levels do and stores by mode); 0 or 1: no split */
    float *kpart;
    int32_t ksplit;
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

__device__ __forceinline__ void store_at(const lin_args &a, float *o, float v, float v2) {
    if (a.mode == MODE_ADD) *o += v;
    else if (a.mode == MODE_SWIGLU) *o = silu_f(v) * v2;
    else *o = v;
}
__device__ __forceinline__ void store_out(const lin_args &a, int p, int r, float v, float v2) {
    float *o = a.out + (int64_t)p * a.ldo + r;
    store_at(a, o, v, v2);
}
/* The weight row and output column of launch row r (segments: q, k, v in one launch). */
__device__ __forceinline__ void seg_of(const lin_args &a, int r, const uint8_t *&w, float *&out, int64_t &ldo,
                                       int &rr) {
    w = a.w, out = a.out, ldo = a.ldo, rr = r;
    if (a.seg.n_seg > 1) {
        const int i = (r >= a.seg.seg_row[1]) + (a.seg.n_seg > 2 && r >= a.seg.seg_row[2]);
        w = a.seg.seg_w[i], out = a.seg.seg_out[i], ldo = a.seg.seg_ldo[i], rr = r - a.seg.seg_row[i];
    }
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
    return sub_acc(acc, ad, s.A, s.B, s.c0 * lo + s.c1 * hi, __fmul_rn(ad, (float)(as[0] + as[1])));
}

/* Matvec path: one warp per weight row, NT pairs per pass, lanes over 32-sub-blocks. */
template <int T, int NT, bool SW>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_q(lin_args a) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int r0 = blockIdx.x * LIN_WARPS + warp;
    int e, start, count;
    pdl_trigger();
    if (a.g.gexp) pdl_wait(); /* routed: the expert ids come from the predecessor */
    if (r0 >= a.N || !group_of(a.g, blockIdx.y, e, start, count)) return;
    const uint8_t *w0;
    float *out;
    int64_t ldo;
    int r;
    seg_of(a, r0, w0, out, ldo, r);
    const uint8_t *wrow = w0 + e * a.expert_stride + (int64_t)r * a.row_bytes;
    const uint8_t *wrow2 = SW ? a.w2 + e * a.expert_stride + (int64_t)r * a.row_bytes : nullptr;
    const int nsb = a.K / 32;
    if (!a.g.gexp) { /* dense: this warp's weight rows start moving while the predecessor finishes */
        for (int64_t off = (int64_t)lane * 128; off < a.row_bytes; off += 32 * 128) {
            prefetch_l1(wrow + off);
            if (SW) prefetch_l1(wrow2 + off);
        }
        pdl_wait();
    }
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
                acc[t] = sub_dot(acc[t], s, q, d, sm);
                if (SW) acc2[t] = sub_dot(acc2[t], s2, q, d, sm);
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
                if (rows[t] >= 0) store_at(a, out + (int64_t)pair_at(a.g, start, p0 + t) * ldo + r, acc[t], acc2[t]);
        }
    }
}

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

/* The output head at batch 1 (a dense single-pair Q6_K matvec of at least Q6_ROWS_MIN_N rows: 255 MB a step at
 * Qwen3-30B's vocabulary) with each warp's Q6S_ROWS consecutive rows first copied into the block's shared memory by 16-byte cp.async (the span of 16-byte granules holding them, so
 * that every byte keeps its address mod 16), then k_linear_q_rows<STG_Q6_KW, R>'s loop run on the shared copy
 * (unpack_q6k_wide<true>: its five 8-byte loads per 32-byte chunk as ld.shared). Why: a lane's
 * 8-byte global loads of a 2-byte aligned block touch ~7-8 L1 lines per warp instruction for ~210 distinct bytes,
 * ~168 L1 wavefronts per 1,680-byte row (~107 us of the L1's data path over the head, about what the head takes, if
 * a wavefront is a line): the copy reads each line once, 512 contiguous bytes per instruction, and the shared loads
 * cost 1-2 wavefronts each (2-way bank conflicts between superblocks k and k + 2). The same bytes and the same unpack,
 * sub_dot chain and butterfly: the same bits. Shared memory: LIN_WARPS * q6s_span16(Q6S_ROWS) * 16. */
#define Q6S_ROWS 4
__host__ __device__ __forceinline__ int64_t q6s_span16(int R, int64_t row_bytes) { return (R * row_bytes + 47) / 16; }
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_q6_stage(lin_args a) {
    constexpr int R = Q6S_ROWS;
    extern __shared__ uint4 q6s[];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int rb = (blockIdx.x * LIN_WARPS + warp) * R; /* this warp's first row */
    const int nr = rb < a.N ? min(R, a.N - rb) : 0;
    const uintptr_t g0 = (uintptr_t)(a.w + (int64_t)rb * a.row_bytes), ga = g0 & ~(uintptr_t)15;
    const int n16 = nr ? (int)((g0 + nr * a.row_bytes + 15 - ga) / 16) : 0;
    uint4 *sw = q6s + warp * q6s_span16(R, a.row_bytes);
    pdl_trigger();
    pdl_wait();
    for (int i = lane; i < n16; i += WARP) cp_async16(sw + i, (const uint4 *)ga + i);
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

/* Float weights (F32/F16/BF16) against float activations: warp per row, lanes over elements. */
template <int T, int NT, bool SW>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_f(lin_args a) {
    PDL_ENTER();
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

/* The end of one pass of the float-row kernels: each warp's sums, then thread t adds the
 * warps' partials in warp order and stores pair p0 + t's output of row r. */
template <int NT>
__device__ __forceinline__ void rows_sum_store(const lin_args &a, float (&part)[LIN_WARPS][NT], float (&acc)[NT],
                                               const int (&rows)[NT], int start, int p0, int r) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
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

/* Float weights with few rows (routers: n_expert rows): a block of LIN_WARPS warps per row,
 * the warps splitting the row, their sums added in warp order. The order depends only on
 * the weight's shape, so results stay batch invariant. Passes of NT pairs are independent
 * (each starts from zero), so blockIdx.z takes every gridDim.z-th one: a 512-token router
 * is 64 passes, which one block per row (128 blocks) used to walk in turn. */
template <int T, int NT> __device__ __forceinline__ void f_rows_body(const lin_args &a) {
    __shared__ float part[LIN_WARPS][NT];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int r = blockIdx.x;
    int e, start, count;
    if (!group_of(a.g, blockIdx.y, e, start, count)) return;
    const uint8_t *wrow = a.w + e * a.expert_stride + (int64_t)r * a.row_bytes;
    for (int p0 = (int)blockIdx.z * NT; p0 < count; p0 += (int)gridDim.z * NT) {
        int rows[NT];
        float acc[NT];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            rows[t] = p0 + t < count ? in_row(a.g, pair_at(a.g, start, p0 + t)) : -1;
            acc[t] = 0.0f;
        }
        /* one or two tokens (a decode router): 16 weight loads in flight per thread instead of
         * 4 (profile, run 21: the router + routing launch took 10.5 us per layer at batch 1);
         * the order of each thread's sum is the same either way */
        constexpr int UR = NT <= 2 ? 16 : 4;
#pragma unroll UR
        for (int i = warp * WARP + lane; i < a.K; i += LIN_WARPS * WARP) {
            const float w = wf<T>(wrow, i);
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (rows[t] >= 0) acc[t] = fmaf(w, a.x[(int64_t)rows[t] * a.K + i], acc[t]);
        }
        rows_sum_store<NT>(a, part, acc, rows, start, p0, r);
    }
}
/* f_rows_body for one dense group with K <= ROUTER_PRE * LIN_WARPS * WARP (a router): each thread's weights are
 * loaded into registers before the wait for the predecessor (weights only; the group is the launch's single
 * dense one), then the same fmaf chains in the same order. XPRE = false (k_router_route, <= 2 tokens: a decode
 * router): each activation read at its fma; XPRE = true (k_linear_f_rows_mlp, any NT): all NT x ROUTER_PRE of a
 * thread's activations of a pass loaded before the first fma. */
#define ROUTER_PRE 16
template <int T, int NT, bool XPRE = false> __device__ __forceinline__ void f_rows_pre(const lin_args &a) {
    __shared__ float part[LIN_WARPS][NT];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int r = blockIdx.x;
    const uint8_t *wrow = a.w + (int64_t)r * a.row_bytes;
    float wv[ROUTER_PRE];
#pragma unroll
    for (int u = 0; u < ROUTER_PRE; u++) {
        const int i = warp * WARP + lane + u * LIN_WARPS * WARP;
        wv[u] = i < a.K ? wf<T>(wrow, i) : 0.0f;
    }
    pdl_wait();
    for (int p0 = (int)blockIdx.z * NT; p0 < a.g.n_pairs; p0 += (int)gridDim.z * NT) {
        int rows[NT];
        float acc[NT], xv[NT][ROUTER_PRE]; /* xv: XPRE only */
#pragma unroll
        for (int t = 0; t < NT; t++) {
            rows[t] = p0 + t < a.g.n_pairs ? in_row(a.g, pair_at(a.g, 0, p0 + t)) : -1;
            acc[t] = 0.0f;
        }
        if constexpr (XPRE) {
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int u = 0; u < ROUTER_PRE; u++) {
                    const int i = warp * WARP + lane + u * LIN_WARPS * WARP;
                    xv[t][u] = rows[t] >= 0 && i < a.K ? a.x[(int64_t)rows[t] * a.K + i] : 0.0f;
                }
        }
#pragma unroll
        for (int u = 0; u < ROUTER_PRE; u++) {
            const int i = warp * WARP + lane + u * LIN_WARPS * WARP;
            if (i < a.K) {
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (rows[t] >= 0) acc[t] = fmaf(wv[u], XPRE ? xv[t][u] : a.x[(int64_t)rows[t] * a.K + i], acc[t]);
            }
        }
        rows_sum_store<NT>(a, part, acc, rows, 0, p0, r);
    }
}
template <int T, int NT>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_f_rows(lin_args a) {
    PDL_ENTER();
    f_rows_body<T, NT>(a);
}

/* k_linear_f_rows for one dense group with K <= ROUTER_PRE * LIN_WARPS * WARP (a router) at any pass width NT
 * (STRATA_GPU_ROUTER_MLP; steps of 9-64 tokens): each thread's weights loaded into registers before the wait for
 * the predecessor (f_rows_pre, as for <= 2 tokens), then all NT x ROUTER_PRE of its activations of a pass
 * loaded before the first fma: run 67 (b32) measured k_linear_f_rows<8> at 32 tokens 13.8 us a layer with 17
 * cycles of long scoreboard per instruction (its loads are consumed one iteration at a time); this form 9.1 us
 * (run 69, ncu; 167 registers on sm_90). Each output's fmaf chain (increasing i) and the warps' sum are
 * k_linear_f_rows' own: the same bits (test_router_mlp_bitwise_equal_f_rows). */
template <int T, int NT> __global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_f_rows_mlp(lin_args a) {
    pdl_trigger();
    f_rows_pre<T, NT, true>(a);
}

/* F32 weights of a few rows (a router) in a prefill-form step (the host's g_gemm_fast). Run 46's first form
 * (32 rows x 16 tokens per block, one block per SM walking K in 64 serial chunks) was 3.5x slower than
 * k_linear_f_rows; this one keeps ~500 blocks in flight: RG_BM weight rows (a warp each) x RG_BT pairs per
 * block of RG_BM warps; the pairs' activations staged in shared memory RG_BK elements at a time (each
 * activation row read once per RG_BM weight rows instead of once per row), each lane 4 consecutive k of
 * every 128 (float4 loads) for all RG_BT pairs, then the warp's butterfly. Not k_linear_f_rows' order, so
 * within rounding of it; a pair's bits depend only on K (the same in any tile or launch). One group (a
 * dense layer); K a multiple of RG_BK. */
#define RG_BM 8
#define RG_BT 16
#define RG_BK 256
__global__ void __launch_bounds__(RG_BM * 32) k_router_gemm(lin_args a) {
    PDL_ENTER();
    __shared__ __align__(16) float xt[RG_BT][RG_BK];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = blockIdx.x * RG_BM + warp;
    const int n0 = blockIdx.y * RG_BT, count = a.g.n_pairs;
    const float *wrow = (const float *)a.w + (int64_t)(r < a.N ? r : 0) * a.K; /* rows past N: never stored */
    float acc[RG_BT] = {};
    for (int k0 = 0; k0 < a.K; k0 += RG_BK) {
        for (int i = threadIdx.x; i < RG_BT * RG_BK / 4; i += RG_BM * 32) { /* float4 pieces, coalesced */
            const int t = i / (RG_BK / 4), kk = 4 * (i % (RG_BK / 4)), n = n0 + t;
            *(float4 *)&xt[t][kk] = n < count
                ? *(const float4 *)(a.x + (int64_t)in_row(a.g, pair_at(a.g, 0, n)) * a.K + k0 + kk)
                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < RG_BK / 128; c++) {
            const int kk = 128 * c + 4 * lane;
            const float4 w = *(const float4 *)(wrow + k0 + kk);
#pragma unroll
            for (int t = 0; t < RG_BT; t++) {
                const float4 x = *(const float4 *)&xt[t][kk];
                acc[t] = fmaf(w.w, x.w, fmaf(w.z, x.z, fmaf(w.y, x.y, fmaf(w.x, x.x, acc[t]))));
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int t = 0; t < RG_BT; t++)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
    if (lane < RG_BT && r < a.N && n0 + lane < count) {
        float v = acc[0];
#pragma unroll
        for (int t = 1; t < RG_BT; t++) if (lane == t) v = acc[t];
        store_out(a, pair_at(a.g, 0, n0 + lane), r, v, 0.0f);
    }
}

/* Tiled matrix-matrix path on the tensor cores, bitwise equal to the matvec kernel.
 *
 * A block computes MM_BM = 64 weight rows x BN pairs of one group (4 warps, each 16 rows x
 * BN / 8 n-tiles of 8): BN = MM_BN = 16, or MM_BN_WIDE = 32 for the plain form of a dense layer
 * with enough tiles (the weight unpacking, its L2 requests and fragment loads per mma halve). Per 32-element sub-block the integer dot products come from
 * `mma.sync` m16n8k32 s8 x s8 -> s32 (Q6_K: two m16n8k16, its two half-scales differ),
 * exact like dp4a; every float operation after that is the matvec's, in the matvec's order:
 * each sub-block added into its residue's sum as sub_acc does (two FMAs with explicit roundings),
 * residues i = j mod 32 summed in increasing j (a matvec lane's loop), and the 32 residue sums
 * combined as the warp butterfly does (pairs i, i + 16 first, then + 8, + 4, + 2, + 1).
 * The k loop walks the residues in bit-reversed order, so that tree is built left to right
 * with five pending partial sums per output. Hence a token's result does not depend on
 * which kernel its batch picked, and the GEMM can serve any step size. */
#define MM_BM 64
#define MM_BN 16
#define MM_WP 72 /* padded row count of a staged weight word plane (conflict-free fragments) */
#define MM_BN_WIDE 32 /* dense plain GEMMs with enough tiles: each weight sub-block unpacked and
                        * loaded once for 32 pairs (k_linear_gemm's BN) */
#define MM_BN_FAST 64 /* the prefill form's widest tile (k_linear_gemm's FAST) */
/* padded pair count of a staged activation word plane (conflict-free fragments and stores) */
template <int BN> __host__ __device__ constexpr int mm_xp() { return BN + 8; }

__device__ __forceinline__ void mma_k32(const int (&a)[4], int b0, int b1, int (&d)[4]) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}
/* the same mma as a plain asm (no side effects): the compiler may then keep shared-memory loads across it
 * (one load of a stage's activation fragments for both weights of the prefill form's gate/up) */
__device__ __forceinline__ void mma_k32_pure(const int (&a)[4], int b0, int b1, int (&d)[4]) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}
__device__ __forceinline__ void mma_k16(int a0, int a1, int b0, int (&d)[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0), "r"(0), "r"(0), "r"(0));
}

/* The k loop's schedule entry for canonical position q (see k_linear_gemm): -1 past the end;
 * else bits 0-15 the sub-block j (0xFFFF: j >= nsb, nothing to multiply), bit 21 set where
 * the residue completes (c == C - 1), bits 22-24 the tree level its push reaches (the
 * trailing ones of its bit-reversed index ii: tree_push's branch, decided once per stage). */
template <bool LIN = false> __device__ __forceinline__ int gemm_qentry(int q, int nq, int C, int nsb) {
    if (q >= nq) return -1;
    if (LIN) return q < nsb ? q : 0xFFFF; /* the prefill form: sub-blocks in order (no tree to build) */
    const int ii = q / C, c = q - ii * C, j = 32 * c + (int)(__brev((unsigned)ii) >> 27);
    return (j < nsb ? j : 0xFFFF) | (c == C - 1 ? 1 << 21 : 0) | ((__ffs(~ii) - 1) << 22);
}

/* Push residue sum v (the ii-th in bit-reversed order) into the butterfly tree L[0..4],
 * LV = the trailing ones of ii (the levels this push completes); the 32nd push leaves the
 * dot product in L[4]. LV is uniform, so one branch serves all of a thread's outputs. */
template <int LV> __device__ __forceinline__ void tree_push_lv(float (&L)[5], float v) {
    if (LV == 0) { L[0] = v; return; }
    v = L[0] + v;
    if (LV == 1) { L[1] = v; return; }
    v = L[1] + v;
    if (LV == 2) { L[2] = v; return; }
    v = L[2] + v;
    if (LV == 3) { L[3] = v; return; }
    v = L[3] + v;
    if (LV == 4) { L[4] = v; return; }
    L[4] = L[4] + v;
}
template <int LV, int NW, int NT>
__device__ __forceinline__ void tree_push_all(float (&L)[NW][NT][4][5], float (&cur)[NW][NT][4]) {
#pragma unroll
    for (int w = 0; w < NW; w++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int o = 0; o < 4; o++) {
                tree_push_lv<LV>(L[w][nt][o], cur[w][nt][o]);
                cur[w][nt][o] = 0.0f;
            }
}

/* tree_push_all at a level known only at run time (one uniform branch) */
template <int NW, int NT> __device__ __forceinline__ void tree_push_any(int lv, float (&L)[NW][NT][4][5],
                                                                       float (&cur)[NW][NT][4]) {
    switch (lv) {
    case 0: tree_push_all<0, NW, NT>(L, cur); break;
    case 1: tree_push_all<1, NW, NT>(L, cur); break;
    case 2: tree_push_all<2, NW, NT>(L, cur); break;
    case 3: tree_push_all<3, NW, NT>(L, cur); break;
    case 4: tree_push_all<4, NW, NT>(L, cur); break;
    default: tree_push_all<5, NW, NT>(L, cur); break;
    }
}
__host__ __device__ constexpr int trailing_ones(int r) { return (r & 1) ? 1 + trailing_ones(r >> 1) : 0; }

/* Q4_K GEMMs stage their bytes through shared memory with cp.async: the next stage's weight
 * and activation bytes are copied while this stage's mma work runs (other types load them
 * at the start of each stage). Dynamic shared memory: 48 bytes per (weight, sub-block, row)
 * (the block's d / dmin / scales and the 32 bytes of nibbles) and per (sub-block, pair)
 * (32 bytes of 8-bit values, the scale, the two 16-value sums). Set up by gemm_setup. */
template <int T> __host__ __device__ constexpr bool gemm_raw() { return T == STG_Q4_K; }
/* sub-blocks per k stage: 8 for the plain form's 16 / 32 pairs, 4 for the gate/up form and the prefill
 * form's 64 pairs (3 blocks' shared memory per SM) */
template <bool SW, int BN> __host__ __device__ constexpr int gemm_gk() { return SW || BN == MM_BN_FAST ? 4 : 8; }
template <int T, bool SW, int BN = MM_BN> __host__ __device__ constexpr int gemm_raw_bytes() {
    return gemm_raw<T>() ? 48 * ((SW ? 2 : 1) * gemm_gk<SW, BN>() * MM_BM + gemm_gk<SW, BN>() * BN) : 0;
}

/* A Q4_K GEMM stage's bytes (schedule tab) copied with cp.async into this thread's own slots of
 * the dynamic shared memory: the same thread unpacks them, so its cp.async.wait_group is all
 * the ordering needed. Weight slot it = (weight, sub-block, row) as k_linear_gemm's fill;
 * activation slot NW * GK * MM_BM + (sub-block, pair) entry: 32 bytes of values, then the scale
 * and the two sums (entry tid + 128 u: sub-block xkk0 + u * 128 / BN, pair tid % BN). */
template <bool SW, int BN>
__device__ __forceinline__ void gemm_issue(const lin_args &a, const int *tab, uint4 *dyn, int tid, int m0,
                                           const uint8_t *wbase, const uint8_t *wbase2, int xkk0, int xrow, int nsb) {
    constexpr int GK = gemm_gk<SW, BN>(), WI = (SW ? 2 : 1) * GK * MM_BM / 128, XE = (GK * BN + 127) / 128;
#pragma unroll
    for (int u = 0; u < WI; u++) {
        const int it = tid + 128 * u;
        const int w = it / (GK * MM_BM), rem = it % (GK * MM_BM), kk = rem / MM_BM, m = rem % MM_BM;
        const int qe = tab[kk], j = qe & 0xFFFF, r = m0 + m;
        if (qe >= 0 && j != 0xFFFF && r < a.N) {
            const uint8_t *b = (w ? wbase2 : wbase) + (int64_t)r * a.row_bytes + (int64_t)(j >> 3) * 144;
            const uint8_t *qb = b + 16 + 32 * ((j & 7) >> 1);
            uint4 *d = dyn + 3 * it;
            cp_async16(d, b), cp_async16(d + 1, qb), cp_async16(d + 2, qb + 16);
        }
    }
#pragma unroll
    for (int u = 0; u < XE; u++) {
        const int xkk = xkk0 + u * (128 / BN);
        if (xkk >= GK) break;
        const int qe = tab[xkk], j = qe & 0xFFFF;
        if (qe >= 0 && j != 0xFFFF && xrow >= 0) {
            const int8_t *src = a.aq + (int64_t)xrow * a.K + 32 * j;
            const int32_t *ss = a.as + (int64_t)xrow * (a.K / 16) + 2 * j;
            uint4 *d = dyn + 3 * ((SW ? 2 : 1) * GK * MM_BM + tid + 128 * u);
            int *dw = (int *)(d + 2);
            cp_async16(d, src), cp_async16(d + 1, src + 16);
            cp_async4(dw, a.ad + (int64_t)xrow * nsb + j), cp_async4(dw + 1, ss), cp_async4(dw + 2, ss + 1);
        }
    }
    cp_async_commit();
}

/* Blocks per SM the register allocation must allow: the prefill form at 64 pairs 3; the bitwise forms
 * unconstrained. 73d83de held the bitwise Q4_K gate/up and the 32-pair C = 2 plain form to 3 blocks per
 * SM (168 registers instead of 198): at decode that was slower, 32 sequences 13.01 vs 12.63 ms a step
 * (run 48) and 14.05-14.09 vs 13.88-13.89 (run 53, another build): their few busy blocks gain more from
 * the unbounded schedule than from a third block per SM. */
template <int BN, bool FAST, bool RS = false> __host__ __device__ constexpr int gemm_min_blocks() {
    return (FAST && BN == MM_BN_FAST) || RS ? 3 : 1;
}
/* RS: the routed split form (STRATA_GPU_ROUTED_SPLIT[_DOWN]): its own instantiations, so that the routed
 * parts' epilogue adds no registers to any other form (compiled into every form, it raised them by
 * 20-50: run 53), at 3 blocks per SM (the split's blocks need the warps) */
template <int T, bool SW, int BN, int CS, bool FAST = false, bool RS = false>
__global__ void __launch_bounds__(128, gemm_min_blocks<BN, FAST, RS>()) k_linear_gemm(lin_args a) {
    PDL_ENTER();
    constexpr int NW = SW ? 2 : 1, GK = gemm_gk<SW, BN>(); /* weights; sub-blocks per stage */
    constexpr int NT = BN / 8, XE = (GK * BN + 127) / 128, XP = mm_xp<BN>(); /* n-tiles; activation entries */
    static_assert(BN == MM_BN || (BN == MM_BN_WIDE && !SW) || (FAST && (BN == MM_BN_WIDE || BN == MM_BN_FAST)),
                  "BN: 16, or 32 for the plain form; the prefill form 32 or 64");
    static_assert(!FAST || (gemm_raw<T>() && CS > 0), "the prefill form: Q4_K with C = 1, 2 or 4");
    static_assert(CS == 0 || CS == 1 || CS == 2 || CS == 4, "CS: 0 (any K), or C = 1, 2, 4 sub-blocks per residue");
    constexpr bool Q6 = T == STG_Q6_K || T == STG_Q6_KW, RAW = gemm_raw<T>(); /* KW: Q6_K, wide unpack */
    extern __shared__ __align__(16) uint4 gemm_dyn[]; /* RAW: [NW * GK * MM_BM + GK * BN][3] */
    __shared__ int ws[NW][GK][8][MM_WP];
    __shared__ float wA[NW][GK][MM_BM], wB[NW][GK][MM_BM];
    __shared__ int wc[Q6 ? NW : 1][Q6 ? GK : 1][Q6 ? MM_BM : 1][2];
    __shared__ int xs[GK][8][XP];
    __shared__ __align__(16) float xd[GK][BN];
    __shared__ __align__(16) float xsf[GK][BN]; /* ad * the activation sub-block sum (sub_acc), once per stage */
    __shared__ int prow[BN];
    __shared__ int qtab[2][GK]; /* gemm_qentry of this stage's and the next stage's positions */
    int e, start, count, n0;
    if ((BN == MM_BN || FAST) && a.g.tiles) { /* a block per tile of the groups (group_pairs' list, tiles of MM_BN) */
        const int32_t nt = *a.g.n_tiles, tl = a.g.tiles[blockIdx.y]; /* both loads in flight: the list has room */
        if ((int)blockIdx.y >= nt || !group_of(a.g, tl >> 16, e, start, count)) return;
        /* the prefill form's wider tiles: the listed tiles whose index is a multiple of BN / MM_BN, each
         * with the next ones of its group (the others exit at once) */
        if (FAST && (tl & 0xFFFF) % (BN / MM_BN)) return;
        n0 = (tl & 0xFFFF) * MM_BN;
    } else {
        if (!group_of(a.g, a.ksplit > 1 ? 0 : (int)blockIdx.z, e, start, count)) return;
        n0 = blockIdx.y * BN;
        if (n0 >= count) return;
    }
    const int m0 = blockIdx.x * MM_BM;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t4 = lane & 3;
    if (tid < BN) prow[tid] = n0 + tid < count ? in_row(a.g, pair_at(a.g, start, n0 + tid)) : -1;
    const uint8_t *wbase = a.w + e * a.expert_stride, *wbase2 = SW ? a.w2 + e * a.expert_stride : nullptr;
    if (a.seg.n_seg > 1) { /* q / k / v in one split launch: the tile's weight (segments start at multiples of MM_BM) */
        const int i = (m0 >= a.seg.seg_row[1]) + (a.seg.n_seg > 2 && m0 >= a.seg.seg_row[2]);
        wbase = a.seg.seg_w[i] - (int64_t)a.seg.seg_row[i] * a.row_bytes; /* indexed by rows m0 + m of all segments */
    }
    /* the prefill form walks the sub-blocks in order, nsb rounded up to whole stages: the canonical walk's
     * 32 C positions hold 32 C - nsb empty ones (a quarter of them at K = 768, the down projection) */
    const int nsb = a.K / 32, C = (nsb + 31) / 32, nq = FAST ? (nsb + GK - 1) / GK * GK : 32 * C;
    /* split k loop (a.ksplit S = 2 or 4, block z): positions [z nq / S, (z + 1) nq / S), i.e. the residues
     * of walk indices [32 z / S, 32 (z + 1) / S) in bit-reversed order: one subtree of the butterfly each
     * (multiples of GK: nq / S = 32 C / S) */
    const int ks = (RS || (!SW && !FAST)) && a.ksplit > 1 ? a.ksplit : 1, kz = ks > 1 ? (int)blockIdx.z : 0;
    /* the prefill form skips the mma and float work of n-tiles wholly past the group's end (block-uniform) */
    const int nvt = FAST ? min(NT, (count - n0 + 7) / 8) : NT;
    const int q_beg = kz * (nq / ks), q_end = q_beg + nq / ks;
    float cur[NW][NT][4], L[NW][NT][4][5];
#pragma unroll
    for (int w = 0; w < NW; w++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int o = 0; o < 4; o++) {
                cur[w][nt][o] = 0.0f;
#pragma unroll
                for (int l = 0; l < 5; l++) L[w][nt][o][l] = 0.0f;
            }
    const int r_lo = warp * 16 + g, r_hi = r_lo + 8; /* this thread's two rows in the tile */
    /* the schedule (q -> j, ii, residue end) once per position, not per thread and use;
     * qtab[p] holds the current stage's, qtab[p ^ 1] the next one's */
    if (tid < GK)
        qtab[0][tid] = gemm_qentry<FAST>(q_beg + tid, nq, C, nsb),
        qtab[1][tid] = gemm_qentry<FAST>(q_beg + GK + tid, nq, C, nsb);
    __syncthreads();
    constexpr int WI = NW * GK * MM_BM / 128; /* weight sub-blocks per thread */
    /* activations: (sub-block, pair) entries tid + 128 u, u < XE: pair xn, sub-blocks xkk0 + u * 128 / BN */
    const int xkk0 = tid / BN, xn = tid % BN;
    const int xrow = xkk0 < GK ? prow[xn] : -1;
    if constexpr (RAW) gemm_issue<SW, BN>(a, qtab[0], gemm_dyn, tid, m0, wbase, wbase2, xkk0, xrow, nsb);
    for (int q0 = q_beg, p = 0; q0 < q_end; q0 += GK, p ^= 1) {
        /* stage GK sub-blocks of the canonical sequence (q -> residue rev5(q / C), round q % C):
         * every global load of the stage is issued before the first shared-memory store */
        if constexpr (RAW) cp_async_wait<0>();
        sub_w sv[WI];
#pragma unroll
        for (int u = 0; u < WI; u++) {
            const int it = tid + 128 * u;
            const int w = it / (GK * MM_BM), rem = it % (GK * MM_BM), kk = rem / MM_BM, m = rem % MM_BM;
            const int qe = qtab[p][kk], j = qe & 0xFFFF, r = m0 + m;
            if (qe >= 0 && j != 0xFFFF && r < a.N) {
                (void)w;
                if constexpr (RAW) {
                    const uint4 *d = gemm_dyn + 3 * it;
                    unpack_q4k(d[0], d[1], d[2], j & 7, sv[u]);
                } else {
                    unpack_sub<T>((w ? wbase2 : wbase) + (int64_t)r * a.row_bytes, j, sv[u]);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) sv[u].q[i] = 0;
                sv[u].A = sv[u].B = 0.0f, sv[u].c0 = sv[u].c1 = 0;
            }
        }
        /* activations: 32 bytes (two 16-byte loads), the scale and the two 16-value sums */
        int4 xa[XE], xb[XE];
        float xdv[XE];
        int xsv[XE];
#pragma unroll
        for (int u = 0; u < XE; u++) {
            const int xkk = xkk0 + u * (128 / BN);
            xa[u] = xb[u] = make_int4(0, 0, 0, 0), xdv[u] = 0.0f, xsv[u] = 0;
            if (xkk >= GK) continue;
            const int qe = qtab[p][xkk], j = qe & 0xFFFF;
            if (qe >= 0 && j != 0xFFFF && xrow >= 0) {
                if constexpr (RAW) {
                    const int4 *d = (const int4 *)(gemm_dyn + 3 * (NW * GK * MM_BM + tid + 128 * u));
                    const int4 e2 = d[2];
                    xa[u] = d[0], xb[u] = d[1], xdv[u] = __int_as_float(e2.x), xsv[u] = e2.y + e2.z;
                } else {
                    const int4 *src = (const int4 *)(a.aq + (int64_t)xrow * a.K + 32 * j);
                    xa[u] = src[0], xb[u] = src[1];
                    xdv[u] = a.ad[(int64_t)xrow * nsb + j];
                    xsv[u] = a.as[(int64_t)xrow * (a.K / 16) + 2 * j] + a.as[(int64_t)xrow * (a.K / 16) + 2 * j + 1];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < WI; u++) {
            const int it = tid + 128 * u;
            const int w = it / (GK * MM_BM), rem = it % (GK * MM_BM), kk = rem / MM_BM, m = rem % MM_BM;
#pragma unroll
            for (int i = 0; i < 8; i++) ws[w][kk][i][m] = sv[u].q[i];
            wA[w][kk][m] = sv[u].A, wB[w][kk][m] = sv[u].B;
            if constexpr (Q6) wc[Q6 ? w : 0][kk][m][0] = sv[u].c0, wc[Q6 ? w : 0][kk][m][1] = sv[u].c1;
        }
#pragma unroll
        for (int u = 0; u < XE; u++) {
            const int xkk = xkk0 + u * (128 / BN);
            if (xkk >= GK) continue;
            xs[xkk][0][xn] = xa[u].x, xs[xkk][1][xn] = xa[u].y, xs[xkk][2][xn] = xa[u].z, xs[xkk][3][xn] = xa[u].w;
            xs[xkk][4][xn] = xb[u].x, xs[xkk][5][xn] = xb[u].y, xs[xkk][6][xn] = xb[u].z, xs[xkk][7][xn] = xb[u].w;
            xd[xkk][xn] = xdv[u], xsf[xkk][xn] = __fmul_rn(xdv[u], (float)xsv[u]);
        }
        __syncthreads();
        /* the next stage's bytes fly while this stage's mma work runs (every thread has
         * unpacked its slots of this stage before the barrier) */
        if constexpr (RAW) {
            if (q0 + GK < q_end) gemm_issue<SW, BN>(a, qtab[p ^ 1], gemm_dyn, tid, m0, wbase, wbase2, xkk0, xrow, nsb);
        }
        /* stage sub-block kk's mma and float work into cur */
        auto kk_mma = [&](int kk) {
            if constexpr (FAST) {
                /* the prefill form: n-tiles outer, weights inner, so each n-tile's activation fragment, scales
                 * and sums are loaded once for both weights of gate/up (the same operations per output) */
                int af[NW][4];
                float Alo[NW], Ahi[NW], Blo[NW], Bhi[NW];
#pragma unroll
                for (int w = 0; w < NW; w++) {
                    const int(*W)[MM_WP] = ws[w][kk];
                    af[w][0] = W[t4][r_lo], af[w][1] = W[t4][r_hi], af[w][2] = W[4 + t4][r_lo], af[w][3] = W[4 + t4][r_hi];
                    Alo[w] = wA[w][kk][r_lo], Ahi[w] = wA[w][kk][r_hi], Blo[w] = wB[w][kk][r_lo], Bhi[w] = wB[w][kk][r_hi];
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    if (nt >= nvt) break;
                    const int nb = nt * 8, b0 = xs[kk][t4][nb + g], b1 = xs[kk][4 + t4][nb + g];
                    const float2 xd2 = *(const float2 *)&xd[kk][nb + 2 * t4], xf2 = *(const float2 *)&xsf[kk][nb + 2 * t4];
#pragma unroll
                    for (int w = 0; w < NW; w++) {
                        int d[4];
                        mma_k32_pure(af[w], b0, b1, d);
                        cur[w][nt][0] = sub_acc(cur[w][nt][0], xd2.x, Alo[w], Blo[w], d[0], xf2.x);
                        cur[w][nt][1] = sub_acc(cur[w][nt][1], xd2.y, Alo[w], Blo[w], d[1], xf2.y);
                        cur[w][nt][2] = sub_acc(cur[w][nt][2], xd2.x, Ahi[w], Bhi[w], d[2], xf2.x);
                        cur[w][nt][3] = sub_acc(cur[w][nt][3], xd2.y, Ahi[w], Bhi[w], d[3], xf2.y);
                    }
                }
            } else {
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const int(*W)[MM_WP] = ws[w][kk];
                const float Alo = wA[w][kk][r_lo], Ahi = wA[w][kk][r_hi], Blo = wB[w][kk][r_lo], Bhi = wB[w][kk][r_hi];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const int nb = nt * 8;
                    int d[4];
                    if constexpr (Q6) {
                        int lo[4], hi[4];
                        mma_k16(W[t4][r_lo], W[t4][r_hi], xs[kk][t4][nb + g], lo);
                        mma_k16(W[4 + t4][r_lo], W[4 + t4][r_hi], xs[kk][4 + t4][nb + g], hi);
                        const int *clo = wc[Q6 ? w : 0][kk][r_lo], *chi = wc[Q6 ? w : 0][kk][r_hi];
                        d[0] = clo[0] * lo[0] + clo[1] * hi[0], d[1] = clo[0] * lo[1] + clo[1] * hi[1];
                        d[2] = chi[0] * lo[2] + chi[1] * hi[2], d[3] = chi[0] * lo[3] + chi[1] * hi[3];
                    } else {
                        const int af[4] = {W[t4][r_lo], W[t4][r_hi], W[4 + t4][r_lo], W[4 + t4][r_hi]};
                        mma_k32(af, xs[kk][t4][nb + g], xs[kk][4 + t4][nb + g], d);
                    }
#pragma unroll
                    for (int o = 0; o < 4; o++) {
                        const int n = nb + 2 * t4 + (o & 1);
                        const float A = o < 2 ? Alo : Ahi, B = o < 2 ? Blo : Bhi;
                        cur[w][nt][o] = sub_acc(cur[w][nt][o], xd[kk][n], A, B, d[o], xsf[kk][n]);
                    }
                }
            }
            }
        };
        if constexpr (CS > 0) {
            /* CS = C sub-blocks per residue (K/32 in (16 (CS / 2), 32 CS]): a stage holds GK / CS whole
             * residues, so each push sits at a fixed kk and, but for the stage's last residue, at a level
             * known at compile time (its bit-reversed index's trailing ones); a sub-block past the row's
             * end is zero data (mma 0, sub_acc(cur, 0, 0, 0, 0, 0) == cur: cur is never -0), not a
             * branch. The stage's mma work is then one basic block the compiler can interleave. */
            constexpr int R = GK / CS;
#pragma unroll
            for (int r = 0; r < R; r++) {
#pragma unroll
                for (int c = 0; c < CS; c++) kk_mma(r * CS + c);
                if constexpr (!FAST) {
                    if (r < R - 1) tree_push_any<NW, NT>(trailing_ones(r), L, cur);
                    else tree_push_any<NW, NT>((qtab[p][GK - 1] >> 22) & 7, L, cur);
                }
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < GK; kk++) {
                const int qe = qtab[p][kk];
                if (qe < 0) break;
                if ((qe & 0xFFFF) != 0xFFFF) kk_mma(kk);
                if constexpr (!FAST) {
                    if (qe & (1 << 21)) tree_push_any<NW, NT>((qe >> 22) & 7, L, cur); /* residue complete */
                }
            }
        }
        __syncthreads();
        /* the schedule two stages on: qtab[p] was last read before this barrier */
        if (tid < GK) qtab[p][tid] = gemm_qentry<FAST>(q0 + 2 * GK + tid, nq, C, nsb);
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int o = 0; o < 4; o++) {
            const int r = m0 + (o < 2 ? r_lo : r_hi), n = n0 + nt * 8 + 2 * t4 + (o & 1);
            if (r >= a.N || n >= count) continue;
            if (ks > 1) { /* this block's subtree: 16 residues end in L[4] (0 + the sum for z = 1); 8 residues
                           * in L[3] for even z, in L[4] for odd z (there L[3] was 0) */
                const bool top4 = ks == 2 || (kz & 1); /* both indices static: a run-time index sends L to memory */
                if constexpr (RS) { /* routed: kpart[z][weight][pair][N] (k_ksplit_routed) */
                    const int64_t p = pair_at(a.g, start, n);
#pragma unroll
                    for (int w = 0; w < NW; w++)
                        a.kpart[(((int64_t)kz * NW + w) * a.g.n_pairs + p) * a.N + r] =
                            top4 ? L[w][nt][o][4] : L[w][nt][o][3];
                } else {
                    a.kpart[((int64_t)kz * count + n) * a.N + r] = top4 ? L[0][nt][o][4] : L[0][nt][o][3];
                }
            } else if constexpr (FAST) {
                if (a.seg.n_seg > 1) { /* q / k / v in one launch: each row into its own output */
                    const uint8_t *sw;
                    float *so;
                    int64_t sl;
                    int rr;
                    seg_of(a, r, sw, so, sl, rr);
                    (void)sw;
                    store_at(a, so + (int64_t)pair_at(a.g, start, n) * sl + rr, cur[0][nt][o], 0.0f);
                } else {
                    store_out(a, pair_at(a.g, start, n), r, cur[0][nt][o], SW ? cur[NW - 1][nt][o] : 0.0f);
                }
            } else {
                store_out(a, pair_at(a.g, start, n), r, L[0][nt][o][4], SW ? L[NW - 1][nt][o][4] : 0.0f);
            }
        }
}

/* The parts of a split GEMM (a dense launch: pair p = row p) added as the butterfly's top levels
 * do: S = 2: P0 + P1; S = 4: (P0 + P1) + (P2 + P3); then stored by mode (store or residual add). */
__global__ void k_ksplit_combine(const float *part, int32_t S, int32_t count, int32_t N, float *out, int64_t ldo,
                                 int mode, lin_seg sg) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)count * N) return;
    const int64_t plane = (int64_t)count * N;
    float v = part[i] + part[plane + i];
    if (S == 4) v = v + (part[2 * plane + i] + part[3 * plane + i]);
    const int32_t r = (int32_t)(i % N);
    float *o = out + i / N * ldo + r;
    if (sg.n_seg > 1) { /* row segments (q / k / v): each into its own output */
        const int j = (r >= sg.seg_row[1]) + (sg.n_seg > 2 && r >= sg.seg_row[2]);
        o = sg.seg_out[j] + i / N * sg.seg_ldo[j] + (r - sg.seg_row[j]);
    }
    if (mode == MODE_ADD) *o += v;
    else *o = v;
}

/* The parts of a routed split GEMM, kpart[z][w][pair][N] for S = 2 or 4 blocks z per tile and NW weights
 * (k_linear_gemm with a.ksplit and a.g.gexp), added as k_ksplit_combine does, then stored as the unsplit
 * launch stores: NW = 2 silu(gate) * up (MODE_SWIGLU), NW = 1 the value (MODE_STORE); with hq also the
 * 8-bit blocks of each output row exactly as k_quant_act makes them (N % 32 == 0: a warp is one block). */
__global__ void k_ksplit_routed(const float *part, int32_t S, int32_t NW, int32_t P, int32_t N, float *out, int64_t ldo,
                                int8_t *hq, float *hd, int32_t *hs) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, plane = (int64_t)P * N, zs = NW * plane;
    if (i >= plane) return;
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
            acc = sub_dot(acc, s, a.aq + base + 32 * j, a.ad[base / 32 + j], a.as + base / 16 + 2 * j);
        }
    }
    return acc;
}

template <int T>
__global__ void k_linear_ref(lin_args a) {
    PDL_ENTER();
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

/* The expert sum of a token folded into the next RMSNorm (saves a launch per layer):
 * x[r] += sum_j w_j o_j / sum_j w_j (or / 1), in double with one final rounding, as the CPU. */
struct combine_args {
    const float *pair_out, *w; /* NULL: nothing pending */
    int32_t k, norm;
    /* the output projection's 4 split-GEMM parts [4][kp_t][E] not yet added to the residual (its
     * k_ksplit_combine left to this norm: STRATA_GPU_COMBINE_FUSE); NULL: none */
    const float *kpart;
    int32_t kp_t;
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
        if (!c.norm) den = 1.0;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j < c.k) num += (double)wv[j] * (double)pv[j];
        return x + (float)(num / den);
    }
    double den = 0.0, num = 0.0;
    for (int j = 0; j < c.k; j++) den += (double)wt[j];
    if (!c.norm) den = 1.0;
    for (int j = 0; j < c.k; j++) num += (double)wt[j] * (double)c.pair_out[(r * c.k + j) * E + i];
    return x + (float)(num / den);
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
    } else {
        for (int64_t i = threadIdx.x; i < n; i += bd) {
            float v = xr[i];
            if (c.pair_out || c.kpart) {
                v = combined(c, v, r, i, n);
                if (!rows) xr[i] = v;
            }
            yr[i] = v;
            ss += (double)v * (double)v;
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
        for (int64_t i = threadIdx.x; i < n; i += bd) yr[i] = __fmul_rn(w[i], __fmul_rn(yr[i], scale));
        return;
    }
    for (int64_t b = warp; b < nb; b += nw) {
        const int64_t i = 32 * b + lane; /* == threadIdx.x + k * blockDim.x, as above */
        const float v = __fmul_rn(w[i], __fmul_rn(yr[i], scale));
        yr[i] = v;
        quant_block32(v, lane, aq + row * n + 32 * b, ad + row * nb + b, as + row * (n / 16) + 2 * b);
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

struct qkv_args {
    float *q, *k, *v; /* [T, q_dim], [T, kv_dim] x2 */
    const float *bq, *bk, *bv, *q_norm, *k_norm, *inv_freq;
    const int32_t *pos, *seq, *block_tables;
    int32_t max_blocks, n_head, n_kv, hd, rope_dim, rope_type, block_size;
    float eps, scale;
    __half *kc, *vc; /* this layer's K / V arena */
    /* q / k / v still as the split GEMM's 4 parts [4][kp_t][kp_n] over their stacked rows (the fused
     * decode attention adds them as k_ksplit_combine would: STRATA_GPU_COMBINE_FUSE); NULL: q, k, v */
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
            rope_pair(v, i, a.rope_dim, a.rope_type, (float)cos((double)theta), (float)sin((double)theta));
        }
        __syncwarp();
    }
}

/* K (kind 1) or V (kind 2) head hh of token t from v[hd] into its cache slot. */
__device__ __forceinline__ void kv_store(const qkv_args &a, int t, int kind, int hh, const float *v, int lane) {
    const int kd = a.n_kv * a.hd, hd = a.hd;
    const int32_t p = a.pos[t];
    const int32_t blk = a.block_tables[(int64_t)a.seq[t] * a.max_blocks + p / a.block_size], slot = p % a.block_size;
    const int64_t kbase = (int64_t)blk * kd * a.block_size;
    for (int i = lane; i < hd; i += 32) {
        const int c = hh * hd + i;
        if (kind == 1) a.kc[kbase + (int64_t)c * a.block_size + slot] = __float2half_rn(v[i]);
        else a.vc[kbase + (int64_t)slot * kd + c] = __float2half_rn(v[i]);
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

/* ------------------------------------------------------------ attention */

struct attn_args {
    const float *q; /* [T, n_head * hd], pre-scaled */
    float *out;     /* [T, n_head * hd] */
    const __half *kc, *vc;
    const int32_t *pos, *seq, *block_tables;
    int32_t max_blocks, n_head, n_kv, hd, block_size;
    int32_t stages;                 /* 2: the next chunk's copies fly while this one is used */
    int8_t *aq;                     /* non-NULL: also quantise the output rows (hd % 32 == 0) */
    float *ad;
    int32_t *as;
    /* fused: k_qkv_post's work done here (steps whose tokens all belong to different
     * sequences: decode). q holds the raw q rows then; each block prepares its own q head and
     * its kv head's new K and V (the first q head of each kv group also writes them to the
     * cache) and uses the new key from shared memory, not from the slot being written. */
    int32_t fused;
    int32_t pre; /* fused only: step inputs and the first K/V chunks read before the wait */
    qkv_args qa;
    const __half *kc_next, *vc_next; /* PREP: the next layer's K / V arena (L2 prefetch); NULL: none */
};
/* Warp reductions over the 16 lanes of each half when both halves hold the same 16 values (k_attention's keys:
 * lane and lane ^ 16 score the same key): warp_max's xor-16 level would only take a value's max with itself, and
 * warp_sum(half ? 0 : v)'s would add an exact 0 (the sums are of expf values, never -0), so these give their bits. */
__device__ __forceinline__ float warp_max16(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum16(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}


/* Paged attention, flash-decoding style: one block per (token, head); its ATT_WARPS warps
 * take interleaved chunks of ATT_CK = 16 keys (a chunk never crosses a KV block: block sizes
 * are multiples of 16). A warp copies its chunk's K [hd][16] and V [16][hd] into its own
 * shared memory with 16-byte asynchronous copies (every load of the chunk in flight at
 * once, the next chunk's while this one is used when `stages` is 2), then: scores with lane
 * = key (two lanes per key, even / odd dimensions, added in a fixed order), an online
 * softmax, values with lane = dimension. The warps' partial (max, sum, output) are merged
 * at the end; with aq the output is quantised to 8-bit blocks in the same pass (bitwise
 * k_quant_act). Dynamic shared memory: ATT_WARPS * stages * 2 * 16 * hd halves. */
#define ATT_WARPS 4
#define ATT_CK 16
static inline size_t att_smem_bytes(int hd, int stages) {
    return (size_t)ATT_WARPS * (size_t)stages * 2u * ATT_CK * (size_t)hd * sizeof(__half);
}
/* HALF2 (hd % 64 == 0): the value loop reads dimensions 2 l, 2 l + 1 (+ 64 i) of lane l as one half2, into
 * acc[2 i], acc[2 i + 1]; each dimension's fma order is unchanged.
 * HD > 0 (with HALF2 and head_dim HD = 128): the head dimension known at compile time, so the K/V copies and the
 * score loop unroll, a whole chunk's 16-key value loop is unrolled (every key's shuffle and loads issued ahead of
 * the fma chains, each dimension's chain in the same order), and the softmax's max and sum run over 16 lanes
 * (warp_max16): the same operations in the same order, the same bits. The rolled loops' per-key latencies (a
 * shuffle and two shared loads a key, a runtime-bounded score loop) would be each chunk's chain.
 * PREP (with HALF2, HD = 128, fused steps, rope_dim <= 128): the fused q / k head prep with a shorter chain, the
 * same operations in the same order (the same bits). Warps 0 / 1 hold their head's norm weights and bias in
 * registers (read before the wait: weights), their head's values in registers (4 a lane), and take RoPE's cos /
 * sin from a table rcs that warp 3 (otherwise idle until the chunk loop) computes for the token before the wait
 * (pos is a step input), the same (float)cos((double)theta) / sin: theta = (float)p * inv_freq[i] is the same for
 * the q and k heads. Warp 3 first prefetches the next layer's K / V chunks of the token into L2 (evict_last; each q
 * head of a kv group a share), which that layer's attention then copies from L2 instead of DRAM (steps evict the
 * cache from L2). The cache slot of the new K / V comes from the block table read before the wait. Warp 0's
 * chain: wait, q loads, norm, a named barrier with warp 3, the rotation from shared memory. */
__device__ __forceinline__ void prep_rope_table(const attn_args &a, int32_t p, float f0, float f1, float (*rcs)[64],
                                              int lane) {
    const int np = a.qa.rope_dim / 2;
    const float th0 = __fmul_rn((float)p, f0), th1 = __fmul_rn((float)p, f1);
    const float c0 = (float)cos((double)th0), s0 = (float)sin((double)th0);
    const float c1 = (float)cos((double)th1), s1 = (float)sin((double)th1);
    if (lane < np) rcs[0][lane] = c0, rcs[1][lane] = s0;
    if (lane + 32 < np) rcs[0][lane + 32] = c1, rcs[1][lane + 32] = s1;
    asm volatile("bar.arrive 1, 96;\n" ::: "memory"); /* warps 0 and 1 wait for it (bar.sync 1, 96) */
}
template <bool HALF2, int HD, bool PREP = false>
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attention(attn_args a) {
    pdl_trigger();
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ __align__(16) float qs[256];
    __shared__ float part[ATT_WARPS][256 + 2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x, h = blockIdx.y;
    const int hd = HD ? HD : a.hd, kd = a.n_kv * hd, kvh = h / (a.n_head / a.n_kv), bs = a.block_size;
    const int S = a.stages;
    __half *wbuf = (__half *)att_dyn + (size_t)warp * S * 2 * ATT_CK * hd; /* [S][K hd x 16 | V 16 x hd] */
    __shared__ __half kvnew[2][256]; /* fused: this token's K and V of head kvh */
    __shared__ float b1rcs[PREP ? 2 : 1][64]; /* PREP: cos / sin of the token's RoPE pairs (warp 3) */
    /* pre (fused decode steps only): pos, seq and the block table are the step's uploaded inputs and
     * the cache's earlier keys were written by earlier steps, so they are read, and this warp's first
     * chunks' copies issued, before the wait for the predecessor (the q/k/v projection); the new
     * key's slot, which this launch itself writes, is replaced in shared memory further down */
    const bool pre = a.fused && a.pre;
    if (!pre) pdl_wait();
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t] * a.max_blocks;
    const int32_t n_keys = a.pos[t] + 1, n_chunks = (n_keys + ATT_CK - 1) / ATT_CK;
    /* copies of chunk ci (block blk) into stage st */
    auto issue = [&](int ci, int st, int32_t blk) {
        const int slot0 = (ci * ATT_CK) % bs;
        __half *ks = wbuf + (size_t)st * 2 * ATT_CK * hd, *vs = ks + ATT_CK * hd;
        const __half *kg = a.kc + ((int64_t)blk * kd + (int64_t)kvh * hd) * bs + slot0;
        const __half *vg = a.vc + ((int64_t)blk * bs + slot0) * kd + (int64_t)kvh * hd;
        const int vp = hd / 8; /* 16-byte pieces per V row */
        if constexpr (HD > 0) {
#pragma unroll
            for (int it = lane; it < 2 * HD; it += 32) {
                const int d = it >> 1, pc = it & 1;
                cp_async16(ks + d * ATT_CK + 8 * pc, kg + (int64_t)d * bs + 8 * pc);
                const int jj = it / vp, pv = it % vp;
                cp_async16(vs + jj * hd + 8 * pv, vg + (int64_t)jj * kd + 8 * pv);
            }
        } else {
            for (int it = lane; it < 2 * hd; it += 32) {
                const int d = it >> 1, pc = it & 1;
                cp_async16(ks + d * ATT_CK + 8 * pc, kg + (int64_t)d * bs + 8 * pc);
                const int jj = it / vp, pv = it % vp;
                cp_async16(vs + jj * hd + 8 * pv, vg + (int64_t)jj * kd + 8 * pv);
            }
        }
        cp_async_commit();
    };
    int ci = warp;
    int32_t blk_next = ci < n_chunks ? bt[ci * ATT_CK / bs] : 0;
    int issued = 0; /* this warp's chunks already in flight when the loop starts */
    if (ci < n_chunks && (S == 2 || pre)) {
        issue(ci, 0, blk_next);
        const int cn = ci + ATT_WARPS;
        blk_next = cn < n_chunks ? bt[cn * ATT_CK / bs] : 0;
        issued = 1;
        if (pre && S == 2 && cn < n_chunks) {
            issue(cn, 1, blk_next);
            const int cnn = cn + ATT_WARPS;
            blk_next = cnn < n_chunks ? bt[cnn * ATT_CK / bs] : 0;
            issued = 2;
        }
    }
    float bw[4] = {}, bb[4] = {}; /* PREP: this warp's head norm weights and bias (lane + 32 k) */
    float rf0 = 0.0f, rf1 = 0.0f; /* PREP, warp 3: inv_freq[lane], inv_freq[lane + 32] */
    int64_t kvo = -1; /* PREP, warps 1 / 2 of a kv group's first q head: the new K / V's offset in the cache (kv_store) */
    if constexpr (PREP) {
        static_assert(HD == 128 && HALF2, "PREP: the unrolled form only");
        if (warp < 3) {
            const int hh = warp == 0 ? h : kvh;
            const float *nw = warp == 0 ? a.qa.q_norm : a.qa.k_norm, *bias = warp == 0 ? a.qa.bq : warp == 1 ? a.qa.bk : a.qa.bv;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                bw[k] = warp < 2 && nw ? nw[lane + 32 * k] : 0.0f;
                bb[k] = bias ? bias[hh * HD + lane + 32 * k] : 0.0f;
            }
            if (warp > 0 && h % (a.n_head / a.n_kv) == 0) {
                const int32_t p = n_keys - 1, blk = bt[p / bs], slot = p % bs;
                const int64_t kbase = (int64_t)blk * kd * bs, c = (int64_t)kvh * HD + lane;
                kvo = warp == 1 ? kbase + c * bs + slot : kbase + (int64_t)slot * kd + c;
            }
        } else { /* warp 3: RoPE's inv_freq (weights), the table before the wait where pre */
            const int np = a.qa.rope_dim / 2;
            rf0 = lane < np ? a.qa.inv_freq[lane] : 0.0f, rf1 = lane + 32 < np ? a.qa.inv_freq[lane + 32] : 0.0f;
            if (a.kc_next) { /* the next layer's K / V chunks of this token into L2 (kv group's heads share them) */
                const int G = a.n_head / a.n_kv;
                for (int c = h % G; c < n_chunks; c += G) {
                    const int32_t blk = bt[c * ATT_CK / bs];
                    const int slot0 = (c * ATT_CK) % bs;
                    const __half *kg = a.kc_next + ((int64_t)blk * kd + (int64_t)kvh * HD) * bs + slot0;
                    const __half *vg = a.vc_next + ((int64_t)blk * bs + slot0) * kd + (int64_t)kvh * HD;
#pragma unroll
                    for (int i = 0; i < 4; i++) prefetch_l2_last(kg + (int64_t)(lane + 32 * i) * bs); /* a K row: 32 bytes */
                    prefetch_l2_last(vg + (int64_t)(lane >> 1) * kd + 64 * (lane & 1)); /* a V row: two 128-byte lines */
                }
            }
            if (pre) prep_rope_table(a, n_keys - 1, rf0, rf1, b1rcs, lane);
        }
    }
    if (pre) pdl_wait();
    if constexpr (PREP) {
        if (warp < 3) { /* qkv_head's operations, in registers */
            const qkv_args &qa = a.qa;
            const int hh = warp == 0 ? h : kvh, qd = qa.n_head * HD, kd2 = qa.n_kv * HD;
            const float *src = (warp == 0 ? qa.q + (int64_t)t * qd : warp == 1 ? qa.k + (int64_t)t * kd2 : qa.v + (int64_t)t * kd2) + hh * HD;
            const float *bias = warp == 0 ? qa.bq : warp == 1 ? qa.bk : qa.bv;
            const int64_t pl = (int64_t)qa.kp_t * qa.kp_n,
                          base = (int64_t)t * qa.kp_n + (warp == 0 ? 0 : warp == 1 ? qd : qd + kd2) + hh * HD;
            float x[4]; /* every load of the head in flight at once */
            if (qa.kpart) {
#pragma unroll
                for (int k = 0; k < 4; k++) x[k] = kpart_sum(qa.kpart + base + lane + 32 * k, pl);
            } else {
#pragma unroll
                for (int k = 0; k < 4; k++) x[k] = src[lane + 32 * k];
            }
            if (bias) {
#pragma unroll
                for (int k = 0; k < 4; k++) x[k] = x[k] + bb[k];
            }
            float *v = part[warp];
            if (warp < 2) {
                if (qa.q_norm) { /* head_rmsnorm */
                    double ss = 0.0;
#pragma unroll
                    for (int k = 0; k < 4; k++) ss += (double)x[k] * (double)x[k];
#pragma unroll
                    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                    const float scale = (float)(1.0 / sqrt(ss / (double)HD + (double)qa.eps));
#pragma unroll
                    for (int k = 0; k < 4; k++) x[k] = __fmul_rn(bw[k], __fmul_rn(x[k], scale));
                }
#pragma unroll
                for (int k = 0; k < 4; k++) v[lane + 32 * k] = x[k];
                __syncwarp();
                asm volatile("bar.sync 1, 96;\n" ::: "memory"); /* warp 3's cos / sin table */
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    const int i = lane + 32 * k;
                    if (i < qa.rope_dim / 2) rope_pair(v, i, qa.rope_dim, qa.rope_type, b1rcs[0][i], b1rcs[1][i]);
                }
                __syncwarp();
            } else {
#pragma unroll
                for (int k = 0; k < 4; k++) v[lane + 32 * k] = x[k];
                __syncwarp();
            }
            if (warp == 0) {
#pragma unroll
                for (int k = 0; k < 4; k++) qs[lane + 32 * k] = __fmul_rn(v[lane + 32 * k], qa.scale);
            } else {
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    const int i = lane + 32 * k;
                    const __half hv = __float2half_rn(v[i]);
                    kvnew[warp - 1][i] = hv;
                    if (kvo >= 0) (warp == 1 ? qa.kc : qa.vc)[kvo + (warp == 1 ? (int64_t)32 * k * bs : 32 * k)] = hv; /* kv_store */
                }
            }
        } else if (!pre) {
            prep_rope_table(a, n_keys - 1, rf0, rf1, b1rcs, lane);
        }
    } else if (a.fused) {
        if (warp < 3) { /* warp 0: q head h; 1: k head kvh; 2: v head kvh (part[] is free until the merge) */
            float *v = part[warp];
            qkv_head(a.qa, t, warp, warp == 0 ? h : kvh, v, lane);
            if (warp == 0) {
                for (int i = lane; i < hd; i += 32) qs[i] = __fmul_rn(v[i], a.qa.scale);
            } else {
                for (int i = lane; i < hd; i += 32) kvnew[warp - 1][i] = __float2half_rn(v[i]);
                if (h % (a.n_head / a.n_kv) == 0) kv_store(a.qa, t, warp, kvh, v, lane);
            }
        }
    } else {
        const float *q = a.q + (int64_t)t * a.n_head * hd + h * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[i];
    }
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    const int key = lane & 15, half = lane >> 4;
    for (int it = 0; ci < n_chunks; it++, ci += ATT_WARPS) {
        int st = 0;
        if (S == 1) {
            if (it > 0 || !issued) {
                issue(ci, 0, blk_next);
                const int cn = ci + ATT_WARPS;
                blk_next = cn < n_chunks ? bt[cn * ATT_CK / bs] : 0; /* in flight during this chunk */
            }
            cp_async_wait<0>();
        } else {
            st = it & 1;
            const int cn = ci + ATT_WARPS;
            if (cn < n_chunks) {
                if (it > 0 || issued < 2) {
                    issue(cn, st ^ 1, blk_next);
                    const int cnn = cn + ATT_WARPS;
                    blk_next = cnn < n_chunks ? bt[cnn * ATT_CK / bs] : 0;
                }
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
        }
        __syncwarp();
        __half *ks = wbuf + (size_t)st * 2 * ATT_CK * hd, *vs = ks + ATT_CK * hd;
        const int nk = n_keys - ci * ATT_CK < ATT_CK ? n_keys - ci * ATT_CK : ATT_CK;
        if (a.fused && nk <= ATT_CK && ci == (n_keys - 1) / ATT_CK) { /* the new key: this step's own K / V */
            const int kp = n_keys - 1 - ci * ATT_CK;
            for (int d = lane; d < hd; d += 32) ks[d * ATT_CK + kp] = kvnew[0][d], vs[kp * hd + d] = kvnew[1][d];
            __syncwarp();
        }
        float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f; /* four chains */
        float sv;
        {
            if constexpr (HD > 0) {
#pragma unroll
                for (int i = 0; i < HD / 8; i++) {
                    const int d = half + 8 * i;
                    d0 = fmaf(qs[d], __half2float(ks[d * ATT_CK + key]), d0);
                    d1 = fmaf(qs[d + 2], __half2float(ks[(d + 2) * ATT_CK + key]), d1);
                    d2 = fmaf(qs[d + 4], __half2float(ks[(d + 4) * ATT_CK + key]), d2);
                    d3 = fmaf(qs[d + 6], __half2float(ks[(d + 6) * ATT_CK + key]), d3);
                }
            } else {
                for (int d = half; d < hd; d += 8) {
                    d0 = fmaf(qs[d], __half2float(ks[d * ATT_CK + key]), d0);
                    d1 = fmaf(qs[d + 2], __half2float(ks[(d + 2) * ATT_CK + key]), d1);
                    d2 = fmaf(qs[d + 4], __half2float(ks[(d + 4) * ATT_CK + key]), d2);
                    d3 = fmaf(qs[d + 6], __half2float(ks[(d + 6) * ATT_CK + key]), d3);
                }
            }
            sv = (d0 + d1) + (d2 + d3);
            const float so = __shfl_xor_sync(0xffffffffu, sv, 16);
            sv = half ? so + sv : sv + so; /* the even half first on both lanes */
        }
        const bool ok = key < nk;
        const float s = ok ? sv : -INFINITY;
        const float mn = fmaxf(m, HD ? warp_max16(s) : warp_max(s)); /* HD: the same bits (warp_max16) */
        const float corr = expf(m - mn); /* 0 on the warp's first chunk (m = -inf) */
        const float pj = ok ? expf(s - mn) : 0.0f;
        l = __fmaf_rn(l, corr, HD ? warp_sum16(pj) : warp_sum(half ? 0.0f : pj)); /* explicit: k_attention_tile repeats it */
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] *= corr;
        if constexpr (HALF2 && HD > 0) {
            auto vstep = [&](int jj) {
                const float pb = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int d = 64 * i + 2 * lane;
                    if (d < hd) {
                        const float2 f = __half22float2(*(const __half2 *)(vs + jj * hd + d));
                        acc[2 * i] = fmaf(pb, f.x, acc[2 * i]);
                        acc[2 * i + 1] = fmaf(pb, f.y, acc[2 * i + 1]);
                    }
                }
            };
            if (nk == ATT_CK) { /* a whole chunk: every key's shuffle and loads in flight at once */
#pragma unroll
                for (int jj = 0; jj < ATT_CK; jj++) vstep(jj);
            } else {
                for (int jj = 0; jj < nk; jj++) vstep(jj);
            }
        } else if constexpr (HALF2) {
            for (int jj = 0; jj < nk; jj++) {
                const float pb = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int d = 64 * i + 2 * lane;
                    if (d < hd) {
                        const float2 f = __half22float2(*(const __half2 *)(vs + jj * hd + d));
                        acc[2 * i] = fmaf(pb, f.x, acc[2 * i]);
                        acc[2 * i + 1] = fmaf(pb, f.y, acc[2 * i + 1]);
                    }
                }
            }
        } else {
            for (int jj = 0; jj < nk; jj++) {
                const float pb = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const int d = lane + 32 * i;
                    if (d < hd) acc[i] = fmaf(pb, __half2float(vs[jj * hd + d]), acc[i]);
                }
            }
        }
        m = mn;
        __syncwarp(); /* the stage is refilled two chunks later */
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int d = HALF2 ? 64 * (i >> 1) + 2 * lane + (i & 1) : lane + 32 * i;
        if (d < hd) part[warp][d] = acc[i];
    }
    if (lane == 0) part[warp][256] = m, part[warp][257] = l;
    __syncthreads();
    float M = -INFINITY;
    for (int wi = 0; wi < ATT_WARPS; wi++) M = fmaxf(M, part[wi][256]);
    float L = 0.0f, sc[ATT_WARPS];
    for (int wi = 0; wi < ATT_WARPS; wi++) {
        sc[wi] = part[wi][257] > 0.0f ? expf(part[wi][256] - M) : 0.0f; /* a warp with no keys adds nothing */
        L = __fmaf_rn(part[wi][257], sc[wi], L);
    }
    const int64_t row0 = (int64_t)t * a.n_head * hd + h * hd;
    float *o = a.out + row0;
    for (int d0 = warp * 32; d0 < hd; d0 += ATT_WARPS * 32) { /* a warp per 32 dimensions */
        const int d = d0 + lane;
        float v = 0.0f;
        if (d < hd) {
            for (int wi = 0; wi < ATT_WARPS; wi++) v = __fmaf_rn(part[wi][d], sc[wi], v);
            v = __fdiv_rn(v, L);
            o[d] = v;
        }
        if (a.aq) quant_block32(v, lane, a.aq + row0 + d0, a.ad + (row0 + d0) / 32, a.as + (row0 + d0) / 16);
    }
}

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
template <int HD>
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attention_tile(attn_args a, const int32_t *tiles) {
    PDL_ENTER();
    constexpr int DPL = HD / 32, QP = HD + 2; /* dimensions per lane (values); q row padded: rows r and r + 8 in other banks */
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ __align__(16) float qs[ATT_TR][QP];
    __shared__ __align__(16) float ps[ATT_WARPS][ATT_TR][ATT_CK];
    __shared__ float cs[ATT_WARPS][ATT_TR], ms[ATT_WARPS][ATT_TR], ls[ATT_WARPS][ATT_TR];
    __shared__ int nks[ATT_WARPS][ATT_TR];
    __shared__ int32_t rn[ATT_TR];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int G = a.n_head / a.n_kv, kvh = blockIdx.y, kd = a.n_kv * HD, bs = a.block_size;
    const int32_t tile = tiles[blockIdx.x], t0 = tile >> 5, nrows = (tile & 31) * G;
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
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t0] * a.max_blocks;
    __half *wbuf = (__half *)att_dyn + (size_t)warp * 2 * 2 * ATT_CK * HD; /* [2][K HD x 16 | V 16 x HD] */
    auto issue = [&](int ci, int st, int32_t blk) {
        const int slot0 = (ci * ATT_CK) % bs;
        __half *ks = wbuf + (size_t)st * 2 * ATT_CK * HD, *vs = ks + ATT_CK * HD;
        const __half *kg = a.kc + ((int64_t)blk * kd + (int64_t)kvh * HD) * bs + slot0;
        const __half *vg = a.vc + ((int64_t)blk * bs + slot0) * kd + (int64_t)kvh * HD;
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
    int32_t blk_next = ci < n_chunks ? bt[ci * ATT_CK / bs] : 0;
    if (ci < n_chunks) {
        issue(ci, 0, blk_next);
        const int cn = ci + ATT_WARPS;
        blk_next = cn < n_chunks ? bt[cn * ATT_CK / bs] : 0;
    }
    for (int it = 0; ci < n_chunks; it++, ci += ATT_WARPS) {
        const int st = it & 1;
        const int cn = ci + ATT_WARPS;
        if (cn < n_chunks) {
            issue(cn, st ^ 1, blk_next);
            const int cnn = cn + ATT_WARPS;
            blk_next = cnn < n_chunks ? bt[cnn * ATT_CK / bs] : 0;
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
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
 * the CPU's rule). p: ne floats of shared memory for this warp. Up to 32 * RT_MAX experts the
 * probabilities stay in registers and each of the k rounds is two warp reductions (redux.sync)
 * of an order-preserving key instead of a scan of shared memory and ten shuffles: same ids and
 * weights, bit for bit. */
#define RT_MAX 8
__device__ void route_token(const float *r, float *p, int32_t ne, int32_t k, int lane, int32_t *ids, float *w,
                            bool fast = false) {
    if (fast && ne <= 32 * RT_MAX) {
        float v[RT_MAX];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < RT_MAX; i++) {
            const int e = lane + 32 * i;
            v[i] = e < ne ? r[e] : -INFINITY;
            if (e < ne) mx = fmaxf(mx, v[i]);
        }
        mx = warp_max(mx);
#pragma unroll
        for (int i = 0; i < RT_MAX; i++)
            if (lane + 32 * i < ne) p[lane + 32 * i] = v[i] = exp_cr(v[i] - mx);
        __syncwarp();
        float sum = 0.0f;
        if (lane == 0)
            for (int e = 0; e < ne; e++) sum += p[e];
        sum = __shfl_sync(0xffffffffu, sum, 0);
        /* key: the probability's bits + 1 (p >= 0, so unsigned order is float order); 0: not
         * selectable (past ne, taken, NaN - which the scan's p > -1 never picked either) */
        unsigned key[RT_MAX];
#pragma unroll
        for (int i = 0; i < RT_MAX; i++) {
            const float q = v[i] / sum;
            key[i] = lane + 32 * i < ne && q == q ? __float_as_uint(q) + 1u : 0u;
        }
        __syncwarp(); /* lane 0's reads of p done before this warp's next token writes it */
        for (int j = 0; j < k; j++) {
            unsigned best = 0;
            int bi = ne;
#pragma unroll
            for (int i = 0; i < RT_MAX; i++)
                if (key[i] > best) best = key[i], bi = lane + 32 * i; /* ascending e: ties keep the lower index */
            const unsigned m = __reduce_max_sync(0xffffffffu, best);
            const int wi = (int)__reduce_min_sync(0xffffffffu, best == m ? (unsigned)bi : 0xffffffffu);
#pragma unroll
            for (int i = 0; i < RT_MAX; i++)
                if (lane + 32 * i == wi) key[i] = 0u; /* taken */
            if (lane == 0) {
                ids[j] = wi;
                w[j] = m ? __uint_as_float(m - 1u) : -1.0f;
            }
        }
        return;
    }
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
            ids[j] = bi;
            w[j] = bv;
            p[bi] = -2.0f; /* taken */
        }
        __syncwarp();
    }
}

#define ROUTER_WARPS 4
__global__ void k_router(const float *logits, int32_t T, int32_t ne, int32_t k, int32_t *ids, float *w, int32_t fast) {
    PDL_ENTER();
    extern __shared__ float rs[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return;
    route_token(logits + (int64_t)t * ne, rs + warp * ne, ne, k, lane, ids + (int64_t)t * k, w + (int64_t)t * k,
                fast != 0);
}

/* group_pairs for at most 32 pairs, by the first warp of the block: the pairs sorted by (expert,
 * pair) with a bitonic sort across the lanes, so that lane i holds list[i]; an expert's run of
 * lanes gives its group (start, count, its tiles), the runs' heads counted by ballots. The same
 * groups, starts, counts and tiles as the block's scan; within a group the pairs are listed in
 * ascending order instead of arrival order (a pair's result does not depend on its place). */
__device__ void group_pairs_warp(const int32_t *ids, int32_t n_pairs, int32_t k, int32_t *gexp, int32_t *gstart,
                                 int32_t *gcount, int32_t *n_groups, int32_t *list, int32_t *pair_tok, int32_t *hist,
                                 int32_t *gtiles, int32_t *n_gtiles) {
    const int lane = threadIdx.x % 32;
    const bool valid = lane < n_pairs;
    if (valid) pair_tok[lane] = lane / k;
    int32_t key = valid ? ids[lane] << 5 | lane : 0x7fffffff; /* expert ids < 2^26 */
#pragma unroll
    for (int sz = 2; sz <= 32; sz <<= 1)
#pragma unroll
        for (int j = sz >> 1; j > 0; j >>= 1) {
            const int32_t o = __shfl_xor_sync(0xffffffffu, key, j);
            const bool up = (lane & sz) == 0, low = (lane & j) == 0;
            key = low == up ? min(key, o) : max(key, o);
        }
    const int32_t e = key >> 5, prev = __shfl_up_sync(0xffffffffu, e, 1);
    const bool head = valid && (lane == 0 || e != prev);
    const unsigned heads = __ballot_sync(0xffffffffu, head);
    const unsigned above = lane == 31 ? 0u : heads & (0xffffffffu << (lane + 1));
    const int32_t c = head ? (above ? __ffs(above) - 1 : n_pairs) - lane : 0;
    const int32_t nt = (c + MM_BN - 1) / MM_BN;
    int32_t tincl = nt; /* inclusive scan of the heads' tile counts */
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int32_t u = __shfl_up_sync(0xffffffffu, tincl, o);
        if (lane >= o) tincl += u;
    }
    if (valid) list[lane] = key & 31;
    if (head) {
        const int gi = __popc(heads & ((2u << lane) - 1u)) - 1;
        gexp[gi] = e, gstart[gi] = lane, gcount[gi] = c;
        for (int i = 0; i < nt; i++) gtiles[tincl - nt + i] = gi << 16 | i;
        hist[e] += c;
    }
    const int32_t tiles = __shfl_sync(0xffffffffu, tincl, 31);
    if (lane == 0) *n_groups = __popc(heads), *n_gtiles = tiles;
}

/* Group the T*k (token, slot) pairs by expert (one block): per-expert counts, the compact
 * list of active experts (ascending), pairs listed per expert, each pair's token, and the
 * step's per-layer histogram; and the GEMM's tiles of MM_BN pairs (group << 16 | tile of the
 * group, *n_gtiles of them, at most n_pairs / MM_BN + groups), so that a routed GEMM launch
 * has a block per real tile instead of (the largest group's tiles) x (groups), most of which
 * found nothing to do at prefill. sh: 2 * ne ints of shared memory. */
__device__ void group_pairs(const int32_t *ids, int32_t n_pairs, int32_t k, int32_t ne, int32_t *gexp,
                            int32_t *gstart, int32_t *gcount, int32_t *n_groups, int32_t *list, int32_t *pair_tok,
                            int32_t *hist, int32_t *gtiles, int32_t *n_gtiles, int32_t *sh, bool fast = false) {
    if (fast && n_pairs <= 32) { /* decode (up to 4 tokens of 8 pairs): one warp, no shared memory, no barrier */
        if (threadIdx.x < 32) group_pairs_warp(ids, n_pairs, k, gexp, gstart, gcount, n_groups, list, pair_tok, hist,
                                               gtiles, n_gtiles);
        return;
    }
    int32_t *cnt = sh, *fill = sh + ne;
    for (int e = threadIdx.x; e < ne; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        atomicAdd(&cnt[ids[p]], 1);
        pair_tok[p] = p / k;
    }
    __syncthreads();
    if (threadIdx.x < 32) { /* exclusive scan of the counts by one warp, experts in order */
        const int lane = threadIdx.x;
        int32_t base = 0, g = 0, tb = 0;
        for (int e0 = 0; e0 < ne; e0 += 32) {
            const int e = e0 + lane;
            const int32_t c = e < ne ? cnt[e] : 0, nt = (c + MM_BN - 1) / MM_BN;
            int32_t incl = c, act = c > 0, tincl = nt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int32_t u = __shfl_up_sync(0xffffffffu, incl, o), ua = __shfl_up_sync(0xffffffffu, act, o),
                              ut = __shfl_up_sync(0xffffffffu, tincl, o);
                if (lane >= o) incl += u, act += ua, tincl += ut;
            }
            if (e < ne) {
                fill[e] = base + incl - c;
                if (c) {
                    const int gi = g + act - 1, t0 = tb + tincl - nt;
                    gexp[gi] = e, gstart[gi] = base + incl - c, gcount[gi] = c;
                    for (int i = 0; i < nt; i++) gtiles[t0 + i] = gi << 16 | i;
                }
            }
            base += __shfl_sync(0xffffffffu, incl, 31);
            g += __shfl_sync(0xffffffffu, act, 31);
            tb += __shfl_sync(0xffffffffu, tincl, 31);
        }
        if (lane == 0) *n_groups = g, *n_gtiles = tb;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < ne; e += blockDim.x) hist[e] += cnt[e];
    /* slots within an expert's list are taken in arrival order; a pair's result does not
     * depend on its place in the list */
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) list[atomicAdd(&fill[ids[p]], 1)] = p;
}

__global__ void k_group(const int32_t *ids, int32_t n_pairs, int32_t k, int32_t ne, int32_t *gexp, int32_t *gstart,
                        int32_t *gcount, int32_t *n_groups, int32_t *list, int32_t *pair_tok, int32_t *hist,
                        int32_t *gtiles, int32_t *n_gtiles, int32_t fast) {
    PDL_ENTER();
    extern __shared__ int32_t gsh[];
    group_pairs(ids, n_pairs, k, ne, gexp, gstart, gcount, n_groups, list, pair_tok, hist, gtiles, n_gtiles, gsh,
                fast != 0);
}

/* Router and grouping in one launch for small steps (one block of ROUTE_WARPS warps,
 * tokens spread over the warps): one launch and one dependency fewer per layer.
 * Shared memory: ROUTE_WARPS * ne floats + 2 * ne ints. */
#define ROUTE_WARPS 32
__global__ void __launch_bounds__(ROUTE_WARPS * 32) k_route(const float *logits, int32_t T, int32_t ne, int32_t k,
                                                            int32_t *ids, float *w, int32_t *gexp, int32_t *gstart,
                                                            int32_t *gcount, int32_t *n_groups, int32_t *list,
                                                            int32_t *pair_tok, int32_t *hist, int32_t *gtiles,
                                                            int32_t *n_gtiles) {
    PDL_ENTER();
    extern __shared__ float rsh[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int t = warp; t < T; t += ROUTE_WARPS)
        route_token(logits + (int64_t)t * ne, rsh + warp * ne, ne, k, lane, ids + (int64_t)t * k, w + (int64_t)t * k);
    __syncthreads(); /* ids written above are read below by other threads of the block */
    group_pairs(ids, T * k, k, ne, gexp, gstart, gcount, n_groups, list, pair_tok, hist, gtiles, n_gtiles,
                (int32_t *)(rsh + ROUTE_WARPS * ne));
}

/* Router logits, softmax/top-k and grouping in one launch for steps of at most 8 tokens:
 * block b computes router row b for every token exactly as k_linear_f_rows does, then the
 * last block to finish (a device counter, reset by that block) reads every logit back
 * past L1 and routes and groups as k_route. Saves a kernel boundary per layer at decode.
 * Shared memory: LIN_WARPS * ne floats + 2 * ne ints + 8 * ne floats of logits. */
struct route_args {
    int32_t *counter;
    int32_t T, ne, k;
    int32_t *ids, *gexp, *gstart, *gcount, *n_groups, *list, *pair_tok, *hist;
    float *w;
    int32_t *gtiles, *n_gtiles;
    int32_t pre; /* f_rows_pre (the host checks NT <= 2, K, a dense group) */
};
template <int T, int NT>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_router_route(lin_args a, route_args r) {
    pdl_trigger();
    extern __shared__ float rrs[];
    __shared__ int last;
    if (NT <= 2 && r.pre) {
        f_rows_pre<T, NT <= 2 ? NT : 1>(a);
    } else {
        pdl_wait();
        f_rows_body<T, NT>(a);
    }
    __threadfence(); /* this block's logits visible before it is counted */
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(r.counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *lg = rrs + LIN_WARPS * r.ne + 2 * r.ne; /* [T][ne] logits, read past L1 */
    for (int i = threadIdx.x; i < r.T * r.ne; i += blockDim.x) lg[i] = __ldcg(a.out + i);
    __syncthreads();
    for (int t = warp; t < r.T; t += LIN_WARPS)
        route_token(lg + (int64_t)t * r.ne, rrs + warp * r.ne, r.ne, r.k, lane, r.ids + (int64_t)t * r.k,
                    r.w + (int64_t)t * r.k, true);
    __syncthreads();
    group_pairs(r.ids, r.T * r.k, r.k, r.ne, r.gexp, r.gstart, r.gcount, r.n_groups, r.list, r.pair_tok, r.hist,
                r.gtiles, r.n_gtiles, (int32_t *)(rrs + LIN_WARPS * r.ne), true);
    if (threadIdx.x == 0) *r.counter = 0; /* every block has counted: ready for the next layer */
}

/* x[t] += the expert sum (see combined()), when it cannot wait for the next norm. */
__global__ void k_combine(float *x, const float *pair_out, const float *w, int32_t T, int32_t k, int64_t E, int norm) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)T * E) return;
    const combine_args c{pair_out, w, k, norm, nullptr, 0};
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
