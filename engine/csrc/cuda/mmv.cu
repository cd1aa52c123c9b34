/* Dense matvec family: a warp per weight row, up to 8 pairs per pass (decode); float weights;
 * the reference kernel (one thread per output) that the tests use as the oracle. */
#include "linear.cuh"

/* Matvec path: one warp per weight row, NT pairs per pass, lanes over 32-sub-blocks, U of a lane's sub-blocks
 * unrolled (their loads in flight together; the same fma order at any U). */
template <int T, int NT, bool SW, int U = 2>
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
#pragma unroll (U)
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

/* The matvec of short rows (K / 32 <= L sub-blocks, L 4, 8 or 16: DeepSeek-V3's per-head attn_k_b of 128 and
 * attn_v_b of 512 elements, small models) at one pair per pass: L lanes per row, 32 / L rows per warp (k_linear_q's
 * warp per row leaves 28 of 32 lanes idle on a 4-sub-block row: 65,536 warps for attn_k_b's 128 heads). Lane j of a
 * row takes sub-block j, the one k_linear_q's lane j takes, and the butterfly over the row's L lanes is k_linear_q's
 * warp_sum with its all-zero upper lanes left out (x + 0 == x: a lane's sum starts at +0 and sub_dot's fmas never
 * make -0 from it): the same bits. */
template <int T, int L>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_q_short(lin_args a) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, j = lane % L;
    const int r = (blockIdx.x * LIN_WARPS + warp) * (WARP / L) + lane / L;
    int e, start, count;
    PDL_ENTER(); /* routed: the expert ids come from the predecessor */
    if (!group_of(a.g, blockIdx.y, e, start, count)) return; /* uniform over the block */
    const bool live = r < a.N && j < a.K / 32;
    sub_w s;
    if (live) unpack_sub<T>(a.w + e * a.expert_stride + (int64_t)r * a.row_bytes, j, s);
    for (int pi = 0; pi < count; pi++) {
        const int p = pair_at(a.g, start, pi);
        const int64_t base = (int64_t)in_row(a.g, p) * a.K;
        float acc = 0.0f;
        if (live) acc = sub_dot(acc, s, a.aq + base + 32 * j, a.ad[base / 32 + j], a.as + base / 16 + 2 * j);
#pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (j == 0 && r < a.N) store_at(a, a.out + (int64_t)p * a.ldo + r, acc, 0.0f);
    }
}
/* k_linear_q_short's launch where it applies (a plain launch of one pair per pass, no row segments, rows of at most
 * 16 sub-blocks): false (nothing launched) elsewhere */
template <int T> static bool launch_short(const lin_args &a, int nt, int max_groups, cudaStream_t st) {
    const int nsb = a.K / 32;
    if (nt != 1 || a.seg.n_seg >= 2 || nsb > 16) return false;
    const int L = nsb <= 4 ? 4 : nsb <= 8 ? 8 : 16, rpb = LIN_WARPS * (WARP / L);
    const dim3 grid((unsigned)((a.N + rpb - 1) / rpb), (unsigned)max_groups);
    if (L == 4) launch_k(k_linear_q_short<T, 4>, grid, LIN_WARPS * WARP, 0, st, a);
    else if (L == 8) launch_k(k_linear_q_short<T, 8>, grid, LIN_WARPS * WARP, 0, st, a);
    else launch_k(k_linear_q_short<T, 16>, grid, LIN_WARPS * WARP, 0, st, a);
    return true;
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

/* A dense plain layer of few long rows at one pair (DeepSeek-V3's q_a and kv_a: 1,536 and 576 rows of 224
 * sub-blocks): too few warps to hide the latency of 2 sub-blocks at a time, so a lane's first 8 are loaded together */
#define MV_DEEP_MAX_N 4096
#define MV_DEEP_MIN_SB 128
template <int T, bool SW> static void launch_mv(const lin_args &a, int nt, dim3 grid, cudaStream_t st) {
    if (!SW && nt == 1 && !a.g.gexp && a.seg.n_seg < 2 && a.N <= MV_DEEP_MAX_N && a.K / 32 >= MV_DEEP_MIN_SB) {
        launch_k(k_linear_q<T, 1, false, 8>, grid, LIN_WARPS * 32, 0, st, a);
        return;
    }
    if (nt >= 8) launch_k(k_linear_q<T, 8, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else if (nt >= 4) launch_k(k_linear_q<T, 4, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else if (nt >= 2) launch_k(k_linear_q<T, 2, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else launch_k(k_linear_q<T, 1, SW>, grid, LIN_WARPS * 32, 0, st, a);
}
