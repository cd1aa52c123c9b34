/* Router family: float few-row kernels (router logits), the prefill-form router GEMM, top-k routing and
 * the grouping of (token, slot) pairs by expert, fused into one launch at decode. */
#include "linear.cuh"

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
         * 4 (the router's latency, not its bandwidth, bounds it at batch 1); the order of each
         * thread's sum is the same either way */
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
/* A decode router of a longer row (K <= ROUTER_PRE_WIDE * LIN_WARPS * WARP: DeepSeek-V3's 7,168, GLM-4.5's 4,096):
 * f_rows_pre with this many weights per thread (route_args.pre 2), rather than f_rows_body's loop, whose loads wait
 * on the predecessor and come 16 at a time. The same chains: the same bits. */
#define ROUTER_PRE_WIDE 64
template <int T, int NT, bool XPRE = false, int PRE = ROUTER_PRE>
__device__ __forceinline__ void f_rows_pre(const lin_args &a) {
    __shared__ float part[LIN_WARPS][NT];
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int r = blockIdx.x;
    const uint8_t *wrow = a.w + (int64_t)r * a.row_bytes;
    float wv[PRE];
#pragma unroll
    for (int u = 0; u < PRE; u++) {
        const int i = warp * WARP + lane + u * LIN_WARPS * WARP;
        wv[u] = i < a.K ? wf<T>(wrow, i) : 0.0f;
    }
    pdl_wait();
    for (int p0 = (int)blockIdx.z * NT; p0 < a.g.n_pairs; p0 += (int)gridDim.z * NT) {
        int rows[NT];
        float acc[NT], xv[NT][PRE]; /* xv: XPRE only */
#pragma unroll
        for (int t = 0; t < NT; t++) {
            rows[t] = p0 + t < a.g.n_pairs ? in_row(a.g, pair_at(a.g, 0, p0 + t)) : -1;
            acc[t] = 0.0f;
        }
        if constexpr (XPRE) {
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int u = 0; u < PRE; u++) {
                    const int i = warp * WARP + lane + u * LIN_WARPS * WARP;
                    xv[t][u] = rows[t] >= 0 && i < a.K ? a.x[(int64_t)rows[t] * a.K + i] : 0.0f;
                }
        }
#pragma unroll
        for (int u = 0; u < PRE; u++) {
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
 * (steps of 9-64 tokens): each thread's weights loaded into registers before the wait for the predecessor
 * (f_rows_pre, as for <= 2 tokens), then all NT x ROUTER_PRE of its activations of a pass loaded before the
 * first fma: k_linear_f_rows<8> consumes its loads one iteration at a time (at 32 tokens 13.8 us a layer on
 * an H200, 17 cycles of long scoreboard per instruction; this form 9.1 us, 167 registers on sm_90). Each
 * output's fmaf chain (increasing i) and the warps' sum are k_linear_f_rows' own: the same bits
 * (test_router_mlp_bitwise_equal_f_rows). */
template <int T, int NT> __global__ void __launch_bounds__(LIN_WARPS * WARP) k_linear_f_rows_mlp(lin_args a) {
    pdl_trigger();
    f_rows_pre<T, NT, true>(a);
}

/* F32 weights of a few rows (a router) in a prefill-form step (the host's g_gemm_fast). It keeps ~500 blocks in
 * flight (one block per SM walking K in serial chunks would be 3.5x slower than k_linear_f_rows): RG_BM weight rows (a warp each) x RG_BT pairs per
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

/* Where group_pairs writes. The GEMM's groups: gexp / gstart / gcount [ne] and *n_groups, with their tiles of
 * MM_BN pairs (group << 16 | tile of the group, *n_gtiles of them, at most n_pairs / MM_BN + groups); list /
 * pair_tok [n_pairs]: the pairs listed per expert (ascending experts) and each pair's token; hist [ne]: the
 * layer's histogram, added to. mv_max > 0 splits the groups by size for a mixed routed launch: groups of at
 * most mv_max pairs go to the matvec's set (mexp / mstart / mcount, *n_mgroups) instead, get no tiles, and
 * their pairs are flagged in pair_mv (1) so that the GEMM's combine skips them; unless a group holds more
 * than MV_GUARD x mv_max pairs: then the layer's routing is skewed, its busy experts keep the GEMM's wave
 * long and the small groups ride in it for free, while a matvec branch beside it only competes for the
 * SMs, so every group stays the GEMM's (n_mgroups 0). mv_max 0: every group is the GEMM's and the
 * matvec's set is not written. */
struct group_out {
    int32_t *gexp, *gstart, *gcount, *n_groups, *list, *pair_tok, *hist, *gtiles, *n_gtiles;
    int32_t *mexp, *mstart, *mcount, *n_mgroups, *pair_mv;
    int32_t mv_max;
};

/* group_pairs for at most 32 pairs, by the first warp of the block: the pairs sorted by (expert,
 * pair) with a bitonic sort across the lanes, so that lane i holds list[i]; an expert's run of
 * lanes gives its group (start, count, its tiles), the runs' heads counted by ballots. The same
 * groups, starts, counts and tiles as the block's scan; within a group the pairs are listed in
 * ascending order instead of arrival order (a pair's result does not depend on its place). */
__device__ void group_pairs_warp(const int32_t *ids, int32_t n_pairs, int32_t k, const group_out &o) {
    const int lane = threadIdx.x % 32;
    const bool valid = lane < n_pairs;
    if (valid) o.pair_tok[lane] = lane / k;
    int32_t key = valid ? ids[lane] << 5 | lane : 0x7fffffff; /* expert ids < 2^26 */
#pragma unroll
    for (int sz = 2; sz <= 32; sz <<= 1)
#pragma unroll
        for (int j = sz >> 1; j > 0; j >>= 1) {
            const int32_t x = __shfl_xor_sync(0xffffffffu, key, j);
            const bool up = (lane & sz) == 0, low = (lane & j) == 0;
            key = low == up ? min(key, x) : max(key, x);
        }
    const int32_t e = key >> 5, prev = __shfl_up_sync(0xffffffffu, e, 1);
    const bool head = valid && (lane == 0 || e != prev);
    const unsigned heads = __ballot_sync(0xffffffffu, head);
    const unsigned above = lane == 31 ? 0u : heads & (0xffffffffu << (lane + 1));
    const int32_t c = head ? (above ? __ffs(above) - 1 : n_pairs) - lane : 0;
    const int32_t cmax = (int32_t)__reduce_max_sync(0xffffffffu, (unsigned)c);
    const int32_t mv = cmax > MV_GUARD * o.mv_max ? 0 : o.mv_max; /* this layer's split (0: none) */
    const bool small = head && c <= mv;
    const unsigned smalls = __ballot_sync(0xffffffffu, small), bigs = heads & ~smalls;
    const int32_t nt = head && !small ? (c + MM_BN - 1) / MM_BN : 0;
    int32_t tincl = nt; /* inclusive scan of the GEMM groups' tile counts */
#pragma unroll
    for (int s = 1; s < 32; s <<= 1) {
        const int32_t u = __shfl_up_sync(0xffffffffu, tincl, s);
        if (lane >= s) tincl += u;
    }
    /* this lane's group: its head's lane (the highest head at or below it) and count */
    const int hl = 31 - __clz(heads & ((2u << lane) - 1u));
    const int32_t gc = __shfl_sync(0xffffffffu, c, valid ? hl : 0);
    if (valid) {
        o.list[lane] = key & 31;
        if (o.mv_max > 0) o.pair_mv[key & 31] = gc <= mv;
    }
    const unsigned below = (2u << lane) - 1u;
    if (small) {
        const int gi = __popc(smalls & below) - 1;
        o.mexp[gi] = e, o.mstart[gi] = lane, o.mcount[gi] = c;
    } else if (head) {
        const int gi = __popc(bigs & below) - 1;
        o.gexp[gi] = e, o.gstart[gi] = lane, o.gcount[gi] = c;
        for (int i = 0; i < nt; i++) o.gtiles[tincl - nt + i] = gi << 16 | i;
    }
    if (head) o.hist[e] += c;
    const int32_t tiles = __shfl_sync(0xffffffffu, tincl, 31);
    if (lane == 0) {
        *o.n_groups = __popc(bigs), *o.n_gtiles = tiles;
        if (o.mv_max > 0) *o.n_mgroups = __popc(smalls);
    }
}

/* Group the T*k (token, slot) pairs by expert (one block) into `o` (group_out). The GEMM's tile
 * list gives a routed GEMM launch a block per real tile instead of (the largest group's tiles) x
 * (groups), most of which found nothing to do at prefill. sh: 2 * ne ints of shared memory. The block's
 * form (not `fast`) also takes a pair whose id is negative (an expert the device does not hold: hybrid.cu):
 * it is in no group and, with mv_max, flagged in pair_mv as another launch's; o.hist NULL: no histogram. */
__device__ void group_pairs(const int32_t *ids, int32_t n_pairs, int32_t k, int32_t ne, const group_out &o,
                            int32_t *sh, bool fast = false) {
    if (fast && n_pairs <= 32) { /* decode (up to 4 tokens of 8 pairs): one warp, no shared memory, no barrier */
        if (threadIdx.x < 32) group_pairs_warp(ids, n_pairs, k, o);
        return;
    }
    int32_t *cnt = sh, *fill = sh + ne;
    __shared__ int32_t mv; /* this layer's split (0: none), as group_pairs_warp's */
    for (int e = threadIdx.x; e < ne; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        if (ids[p] >= 0) atomicAdd(&cnt[ids[p]], 1);
        o.pair_tok[p] = p / k;
    }
    __syncthreads();
    if (threadIdx.x < 32) { /* exclusive scans of the counts by one warp, experts in order */
        const int lane = threadIdx.x;
        int32_t cmax = 0;
        for (int e = lane; e < ne; e += 32) cmax = max(cmax, cnt[e]);
        cmax = (int32_t)__reduce_max_sync(0xffffffffu, (unsigned)cmax);
        const int32_t mvl = cmax > MV_GUARD * o.mv_max ? 0 : o.mv_max;
        if (lane == 0) mv = mvl;
        int32_t base = 0, g = 0, gm = 0, tb = 0;
        for (int e0 = 0; e0 < ne; e0 += 32) {
            const int e = e0 + lane;
            const int32_t c = e < ne ? cnt[e] : 0;
            const bool small = c > 0 && c <= mvl, big = c > 0 && !small;
            const int32_t nt = big ? (c + MM_BN - 1) / MM_BN : 0;
            int32_t incl = c, act = big, mact = small, tincl = nt;
#pragma unroll
            for (int s = 1; s < 32; s <<= 1) {
                const int32_t u = __shfl_up_sync(0xffffffffu, incl, s), ua = __shfl_up_sync(0xffffffffu, act, s),
                              um = __shfl_up_sync(0xffffffffu, mact, s), ut = __shfl_up_sync(0xffffffffu, tincl, s);
                if (lane >= s) incl += u, act += ua, mact += um, tincl += ut;
            }
            if (e < ne) {
                fill[e] = base + incl - c;
                if (big) {
                    const int gi = g + act - 1, t0 = tb + tincl - nt;
                    o.gexp[gi] = e, o.gstart[gi] = base + incl - c, o.gcount[gi] = c;
                    for (int i = 0; i < nt; i++) o.gtiles[t0 + i] = gi << 16 | i;
                } else if (small) {
                    const int gi = gm + mact - 1;
                    o.mexp[gi] = e, o.mstart[gi] = base + incl - c, o.mcount[gi] = c;
                }
            }
            base += __shfl_sync(0xffffffffu, incl, 31);
            g += __shfl_sync(0xffffffffu, act, 31);
            gm += __shfl_sync(0xffffffffu, mact, 31);
            tb += __shfl_sync(0xffffffffu, tincl, 31);
        }
        if (lane == 0) {
            *o.n_groups = g, *o.n_gtiles = tb;
            if (o.mv_max > 0) *o.n_mgroups = gm;
        }
    }
    __syncthreads();
    if (o.hist)
        for (int e = threadIdx.x; e < ne; e += blockDim.x) o.hist[e] += cnt[e];
    /* slots within an expert's list are taken in arrival order; a pair's result does not
     * depend on its place in the list */
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int32_t e = ids[p];
        if (e < 0) {
            if (o.mv_max > 0) o.pair_mv[p] = 1;
            continue;
        }
        o.list[atomicAdd(&fill[e], 1)] = p;
        if (o.mv_max > 0) o.pair_mv[p] = cnt[e] <= mv;
    }
}

__global__ void k_group(const int32_t *ids, int32_t n_pairs, int32_t k, int32_t ne, group_out o, int32_t fast) {
    PDL_ENTER();
    extern __shared__ int32_t gsh[];
    group_pairs(ids, n_pairs, k, ne, o, gsh, fast != 0);
}

/* Router and grouping in one launch for small steps (one block of ROUTE_WARPS warps,
 * tokens spread over the warps): one launch and one dependency fewer per layer.
 * Shared memory: ROUTE_WARPS * ne floats + 2 * ne ints. */
#define ROUTE_WARPS 32
__global__ void __launch_bounds__(ROUTE_WARPS * 32) k_route(const float *logits, int32_t T, int32_t ne, int32_t k,
                                                            int32_t *ids, float *w, group_out o) {
    PDL_ENTER();
    extern __shared__ float rsh[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int t = warp; t < T; t += ROUTE_WARPS)
        route_token(logits + (int64_t)t * ne, rsh + warp * ne, ne, k, lane, ids + (int64_t)t * k, w + (int64_t)t * k);
    __syncthreads(); /* ids written above are read below by other threads of the block */
    group_pairs(ids, T * k, k, ne, o, (int32_t *)(rsh + ROUTE_WARPS * ne));
}

/* Router logits, softmax/top-k and grouping in one launch for steps of at most 8 tokens:
 * block b computes router row b for every token exactly as k_linear_f_rows does, then the
 * last block to finish (a device counter, reset by that block) reads every logit back
 * past L1 and routes and groups as k_route. Saves a kernel boundary per layer at decode.
 * Shared memory: LIN_WARPS * ne floats + 2 * ne ints + 8 * ne floats of logits. */
struct route_args {
    int32_t *counter;
    int32_t T, ne, k;
    int32_t *ids;
    float *w;
    group_out o;
    int32_t pre; /* f_rows_pre (the host checks NT <= 2, K, a dense group): 1 ROUTER_PRE, 2 ROUTER_PRE_WIDE weights */
};
/* The fused router kernels' first half: this block's router row for every token (k_linear_f_rows' arithmetic), then
 * whether this block finished last, the one that routes and groups (every block's logits visible to it). */
template <int T, int NT>
__device__ __forceinline__ bool router_rows_then_last(const lin_args &a, const route_args &r) {
    __shared__ int last;
    if (NT <= 2 && r.pre == 2) {
        f_rows_pre<T, NT <= 2 ? NT : 1, false, ROUTER_PRE_WIDE>(a);
    } else if (NT <= 2 && r.pre) {
        f_rows_pre<T, NT <= 2 ? NT : 1>(a);
    } else {
        pdl_wait();
        f_rows_body<T, NT>(a);
    }
    __threadfence(); /* this block's logits visible before it is counted */
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(r.counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return false;
    __threadfence();
    return true;
}

template <int T, int NT>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_router_route(lin_args a, route_args r) {
    pdl_trigger();
    extern __shared__ float rrs[];
    if (!router_rows_then_last<T, NT>(a, r)) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *lg = rrs + LIN_WARPS * r.ne + 2 * r.ne; /* [T][ne] logits, read past L1 */
    for (int i = threadIdx.x; i < r.T * r.ne; i += blockDim.x) lg[i] = __ldcg(a.out + i);
    __syncthreads();
    for (int t = warp; t < r.T; t += LIN_WARPS)
        route_token(lg + (int64_t)t * r.ne, rrs + warp * r.ne, r.ne, r.k, lane, r.ids + (int64_t)t * r.k,
                    r.w + (int64_t)t * r.k, true);
    __syncthreads();
    group_pairs(r.ids, r.T * r.k, r.k, r.ne, r.o, (int32_t *)(rrs + LIN_WARPS * r.ne), true);
    if (threadIdx.x == 0) *r.counter = 0; /* every block has counted: ready for the next layer */
}
