/* Tensor-core GEMM family: k_linear_gemm (bitwise the matvec's sums; its k-split form; the prefill
 * form FAST), the split parts' combine, kernel selection by row length, and the shared-memory setup. */
#include "linear.cuh"

/* A dense quantised layer too small for the GEMM's grid (use_gemm: fewer than 256 tiles, e.g. q / k / v / o
 * at 16-64 tokens) runs the GEMM with its k loop split over KSPLIT blocks per tile (lin_args.ksplit;
 * k_ksplit_combine adds the parts as the butterfly's top levels do, so the result is the matvec's bit for
 * bit) instead of the matvec, which unpacks each weight row once per 8 pairs: from dense_split tokens. */
#define KSPLIT 4
#define KSPLIT_MAX_T 64
/* the split GEMM's parts: KSPLIT x KSPLIT_MAX_T x the widest dense layer (scratch), set per step */
static thread_local float *g_kpart = nullptr;
static thread_local int64_t g_kpart_cap = 0; /* floats */
/* linear()'s per-256 activation view (k_quant_act256) for the weights of a per-256 type: codes [cap], scales
 * [cap / 32], sums [cap / 16]; set per step (the step's scratch) or by the harness */
static thread_local int8_t *g_k256q = nullptr;
static thread_local float *g_k256d = nullptr;
static thread_local int32_t *g_k256s = nullptr;
static thread_local int64_t g_k256_cap = 0; /* elements */
/* At 16-64 tokens the split GEMMs of q / k / v (one segmented launch, decode steps whose q/k/v
 * post-processing runs inside attention) and of the output projection leave their 4 parts to their
 * consumers, which add them as k_ksplit_combine does (the fused attention's head prep; the FFN's RMSNorm,
 * then the residual add): two launches per layer fewer, the same bits. g_defer_combine asks launch_q to
 * skip the combine; g_deferred says it did. */
static thread_local bool g_defer_combine = false, g_deferred = false;

/* The prefill form of the Q4_K and Q8_0 GEMMs (k_linear_gemm's FAST: one float sum per output in the walk order
 * instead of the matvec's butterfly tree, so tiles of 32 or 64 pairs fit the registers; within rounding
 * of the matvec, not bitwise; both stage their bytes with cp.async a stage ahead: Q4_K as its bitwise forms do, Q8_0
 * each 34-byte block as the 48-byte window of three aligned 16-byte pieces that holds it). An eager step takes it
 * for every such layer but the output head (row lengths with C = 1, 2 or 4 sub-blocks per residue, whatever the
 * launch's size) when each of its tokens belongs to a run of at least gemm_fast_min consecutive tokens of one
 * sequence: a long prompt's tokens then get the same bits whether it is prefilled whole or in chunks of at least that many tokens; a step
 * that also holds short runs (decode tokens) keeps the bitwise kernels for all its tokens. Such steps
 * also run the F32 routers on k_router_gemm, k and v as one row-segmented launch (k and v alone are 8 row
 * tiles each), and no programmatic dependent launch: each GEMM's next launch would put its blocks on the
 * SMs early, where they wait on the current launch and hold the registers and shared memory its later
 * blocks would use. */
static thread_local bool g_gemm_fast = false; /* set per step (stg_forward); graph steps: false */

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
/* f(w, nt, o) for each of a thread's NW x NT x 4 outputs in turn, unrolled */
template <int NW, int NT, class F> __device__ __forceinline__ void each_out(F f) {
#pragma unroll
    for (int w = 0; w < NW; w++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int o = 0; o < 4; o++) f(w, nt, o);
}
template <int LV, int NW, int NT>
__device__ __forceinline__ void tree_push_all(float (&L)[NW][NT][4][5], float (&cur)[NW][NT][4]) {
    each_out<NW, NT>([&](int w, int nt, int o) {
        tree_push_lv<LV>(L[w][nt][o], cur[w][nt][o]);
        cur[w][nt][o] = 0.0f;
    });
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
/* the types with a prefill form (FAST): its float work is the plain types' (no half-scales, no minima) */
template <int T> __host__ __device__ constexpr bool gemm_fast_type() { return T == STG_Q4_K || T == STG_Q8_0; }
/* sub-blocks per k stage: 8 for the plain form's 16 / 32 pairs, 4 for the gate/up form and the prefill
 * form's 64 pairs (3 blocks' shared memory per SM) */
template <bool SW, int BN> __host__ __device__ constexpr int gemm_gk() { return SW || BN == MM_BN_FAST ? 4 : 8; }
/* the forms that stage their bytes: gemm_raw's types, and Q8_0's prefill form */
template <int T, bool FAST> __host__ __device__ constexpr bool gemm_staged() {
    return gemm_raw<T>() || (FAST && T == STG_Q8_0);
}
template <int T, bool SW, int BN = MM_BN, bool FAST = false> __host__ __device__ constexpr int gemm_raw_bytes() {
    return gemm_staged<T, FAST>() ? 48 * ((SW ? 2 : 1) * gemm_gk<SW, BN>() * MM_BM + gemm_gk<SW, BN>() * BN) : 0;
}

/* A staged GEMM stage's bytes (schedule tab) copied with cp.async into this thread's own slots of
 * the dynamic shared memory: the same thread unpacks them, so its cp.async.wait_group is all
 * the ordering needed. Weight slot it = (weight, sub-block, row) as k_linear_gemm's fill: Q4_K's block
 * header and the 32 bytes of nibbles, Q8_0's block in its 16-byte-aligned 48-byte window (up to 14 bytes
 * past a tensor's end are read: the arena and the staging slots leave room); activation slot NW * GK * MM_BM
 * + (sub-block, pair) entry: 32 bytes of values, then the scale and the two sums (entry tid + 128 u: sub-block
 * xkk0 + u * 128 / BN, pair tid % BN). */
template <int T, bool SW, int BN>
__device__ __forceinline__ void gemm_issue(const lin_args &a, const int *tab, uint4 *dyn, int tid, int m0,
                                           const uint8_t *wbase, const uint8_t *wbase2, int xkk0, int xrow, int nsb) {
    constexpr int GK = gemm_gk<SW, BN>(), WI = (SW ? 2 : 1) * GK * MM_BM / 128, XE = (GK * BN + 127) / 128;
#pragma unroll
    for (int u = 0; u < WI; u++) {
        const int it = tid + 128 * u;
        const int w = it / (GK * MM_BM), rem = it % (GK * MM_BM), kk = rem / MM_BM, m = rem % MM_BM;
        const int qe = tab[kk], j = qe & 0xFFFF, r = m0 + m;
        if (qe >= 0 && j != 0xFFFF && r < a.N) {
            const uint8_t *row = (w ? wbase2 : wbase) + (int64_t)r * a.row_bytes;
            uint4 *d = dyn + 3 * it;
            if constexpr (T == STG_Q8_0) {
                const uint8_t *win = (const uint8_t *)((uintptr_t)(row + 34 * (int64_t)j) & ~(uintptr_t)15);
                cp_async16(d, win), cp_async16(d + 1, win + 16), cp_async16(d + 2, win + 32);
            } else {
                const uint8_t *b = row + (int64_t)(j >> 3) * 144, *qb = b + 16 + 32 * ((j & 7) >> 1);
                cp_async16(d, b), cp_async16(d + 1, qb), cp_async16(d + 2, qb + 16);
            }
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

/* Blocks per SM the register allocation must allow: the prefill form at 64 pairs and the routed split 3;
 * the bitwise forms unconstrained: at decode their few busy blocks gain more from the unbounded schedule
 * than from a third block per SM (held to 3 blocks, 168 registers instead of 198, a 32-sequence step is
 * about 0.2-0.4 ms slower). */
template <int BN, bool FAST, bool RS = false> __host__ __device__ constexpr int gemm_min_blocks() {
    return (FAST && BN == MM_BN_FAST) || RS ? 3 : 1;
}
/* RS: the routed split form of gate/up (linear(), ROUTED_SPLIT): its own instantiations, so that the
 * routed parts' epilogue adds no registers to any other form (compiled into every form, it raises them
 * by 20-50), at 3 blocks per SM (the split's blocks need the warps) */
template <int T, bool SW, int BN, int CS, bool FAST = false, bool RS = false>
__global__ void __launch_bounds__(128, gemm_min_blocks<BN, FAST, RS>()) k_linear_gemm(lin_args a) {
    PDL_ENTER();
    constexpr int NW = SW ? 2 : 1, GK = gemm_gk<SW, BN>(); /* weights; sub-blocks per stage */
    constexpr int NT = BN / 8, XE = (GK * BN + 127) / 128, XP = mm_xp<BN>(); /* n-tiles; activation entries */
    static_assert(BN == MM_BN || (BN == MM_BN_WIDE && !SW) || (FAST && (BN == MM_BN_WIDE || BN == MM_BN_FAST)),
                  "BN: 16, or 32 for the plain form; the prefill form 32 or 64");
    static_assert(!FAST || (gemm_fast_type<T>() && CS > 0), "the prefill form: Q4_K or Q8_0 with C = 1, 2 or 4");
    static_assert(CS == 0 || CS == 1 || CS == 2 || CS == 4, "CS: 0 (any K), or C = 1, 2, 4 sub-blocks per residue");
    constexpr bool Q6 = has_c<T>(), RAW = gemm_staged<T, FAST>(); /* Q6: halves with their own integer scales (Q6_K, Q3_K, IQ2/IQ3, Q2_K) */
    constexpr bool QM = has_m<T>(); /* Q2_K: per-16 minima (wm per row) against the activations' 16-sums (xh per pair) */
    extern __shared__ __align__(16) uint4 gemm_dyn[]; /* RAW: [NW * GK * MM_BM + GK * BN][3] */
    __shared__ int ws[NW][GK][8][MM_WP];
    __shared__ float wA[NW][GK][MM_BM], wB[NW][GK][MM_BM];
    __shared__ int wc[Q6 ? NW : 1][Q6 ? GK : 1][Q6 ? MM_BM : 1][2];
    __shared__ int wm[QM ? NW : 1][QM ? GK : 1][QM ? MM_BM : 1][2];
    __shared__ int xh[QM ? GK : 1][QM ? BN : 1][2];
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
    each_out<NW, NT>([&](int w, int nt, int o) {
        cur[w][nt][o] = 0.0f;
#pragma unroll
        for (int l = 0; l < 5; l++) L[w][nt][o][l] = 0.0f;
    });
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
    if constexpr (RAW) gemm_issue<T, SW, BN>(a, qtab[0], gemm_dyn, tid, m0, wbase, wbase2, xkk0, xrow, nsb);
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
                    if constexpr (T == STG_Q8_0) { /* the block's offset into its window */
                        const uint8_t *blk = (w ? wbase2 : wbase) + (int64_t)r * a.row_bytes + 34 * (int64_t)j;
                        unpack_q8_0_window(d[0], d[1], d[2], (int)((uintptr_t)blk & 15), sv[u]);
                    } else {
                        unpack_q4k(d[0], d[1], d[2], j & 7, sv[u]);
                    }
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
        int xsv[XE], xs0[XE];
#pragma unroll
        for (int u = 0; u < XE; u++) {
            const int xkk = xkk0 + u * (128 / BN);
            xa[u] = xb[u] = make_int4(0, 0, 0, 0), xdv[u] = 0.0f, xsv[u] = xs0[u] = 0;
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
                    xs0[u] = a.as[(int64_t)xrow * (a.K / 16) + 2 * j];
                    xsv[u] = xs0[u] + a.as[(int64_t)xrow * (a.K / 16) + 2 * j + 1];
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
            if constexpr (QM) wm[QM ? w : 0][kk][m][0] = sv[u].m0, wm[QM ? w : 0][kk][m][1] = sv[u].m1;
        }
#pragma unroll
        for (int u = 0; u < XE; u++) {
            const int xkk = xkk0 + u * (128 / BN);
            if (xkk >= GK) continue;
            xs[xkk][0][xn] = xa[u].x, xs[xkk][1][xn] = xa[u].y, xs[xkk][2][xn] = xa[u].z, xs[xkk][3][xn] = xa[u].w;
            xs[xkk][4][xn] = xb[u].x, xs[xkk][5][xn] = xb[u].y, xs[xkk][6][xn] = xb[u].z, xs[xkk][7][xn] = xb[u].w;
            xd[xkk][xn] = xdv[u], xsf[xkk][xn] = __fmul_rn(xdv[u], (float)xsv[u]);
            if constexpr (QM) xh[QM ? xkk : 0][QM ? xn : 0][0] = xs0[u], xh[QM ? xkk : 0][QM ? xn : 0][1] = xsv[u] - xs0[u];
        }
        __syncthreads();
        /* the next stage's bytes fly while this stage's mma work runs (every thread has
         * unpacked its slots of this stage before the barrier) */
        if constexpr (RAW) {
            if (q0 + GK < q_end) gemm_issue<T, SW, BN>(a, qtab[p ^ 1], gemm_dyn, tid, m0, wbase, wbase2, xkk0, xrow, nsb);
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
                        float sf = xsf[kk][n];
                        if constexpr (QM) { /* sub_dot's ad * (m0 * asum_lo + m1 * asum_hi): the row's minima */
                            const int *mm = wm[QM ? w : 0][kk][o < 2 ? r_lo : r_hi], *hs = xh[QM ? kk : 0][QM ? n : 0];
                            sf = __fmul_rn(xd[kk][n], (float)(mm[0] * hs[0] + mm[1] * hs[1]));
                        }
                        cur[w][nt][o] = sub_acc(cur[w][nt][o], xd[kk][n], A, B, d[o], sf);
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

/* k_linear_gemm's variant for a row of K: Q4_K with C = 1, 2 or 4 sub-blocks per residue (K/32 up
 * to 128) runs the stage-aligned k loop (CS = C), anything else the general one. Same results. */
using gemm_fn = void (*)(lin_args);
template <int T, bool SW, int BN> static gemm_fn gemm_kernel(int K) {
    if constexpr (gemm_raw<T>()) {
        const int C = (K / 32 + 31) / 32;
        if (C == 1) return k_linear_gemm<T, SW, BN, 1>;
        if (C == 2) return k_linear_gemm<T, SW, BN, 2>;
        if (C == 4) return k_linear_gemm<T, SW, BN, 4>;
    }
    return k_linear_gemm<T, SW, BN, 0>;
}
/* the routed split form of gate/up (Q4_K, C = 1, 2 or 4 only; NULL: no split for this K) */
template <int T> static gemm_fn gemm_rs_kernel(int K) {
    if constexpr (gemm_raw<T>()) {
        const int C = (K / 32 + 31) / 32;
        if (C == 1) return k_linear_gemm<T, true, MM_BN, 1, false, true>;
        if (C == 2) return k_linear_gemm<T, true, MM_BN, 2, false, true>;
        if (C == 4) return k_linear_gemm<T, true, MM_BN, 4, false, true>;
    }
    return nullptr;
}
template <int T, bool SW, int BN> static gemm_fn gemm_fast_kernel(int K) {
    const int C = (K / 32 + 31) / 32;
    if (C == 1) return k_linear_gemm<T, SW, BN, 1, true>;
    if (C == 2) return k_linear_gemm<T, SW, BN, 2, true>;
    return k_linear_gemm<T, SW, BN, 4, true>;
}
/* The prefill form (g_gemm_fast) of a T layer: routed launches over group_pairs' tile list (64 pairs from 32
 * expected per group), dense ones over a grid of 64-pair tiles where that still gives gemm_wide_min
 * blocks, else 32. */
template <int T, bool SW> static void launch_fast_t(const lin_args &a, int max_groups, int max_count, int expected,
                                                    cudaStream_t st) {
    const unsigned mt = (unsigned)((a.N + MM_BM - 1) / MM_BM);
    const bool listed = a.g.gexp && a.g.tiles;
    int bn;
    if (a.g.gexp) bn = expected >= MM_BN_WIDE ? MM_BN_FAST : MM_BN_WIDE;
    else bn = (int64_t)mt * ((max_count + MM_BN_FAST - 1) / MM_BN_FAST) >= g_set.gemm_wide_min ? MM_BN_FAST : MM_BN_WIDE;
    lin_args b = a;
    b.kpart = nullptr, b.ksplit = 0;
    dim3 grid(mt, (unsigned)((a.g.n_pairs + MM_BN - 1) / MM_BN + max_groups), 1); /* the list's entries */
    if (!listed) {
        b.g.tiles = b.g.n_tiles = nullptr;
        grid = dim3(mt, (unsigned)((max_count + bn - 1) / bn), (unsigned)max_groups);
    }
    if (bn == MM_BN_FAST)
        launch_k(gemm_fast_kernel<T, SW, MM_BN_FAST>(a.K), grid, 128, gemm_raw_bytes<T, SW, MM_BN_FAST, true>(), st, b);
    else launch_k(gemm_fast_kernel<T, SW, MM_BN_WIDE>(a.K), grid, 128, gemm_raw_bytes<T, SW, MM_BN_WIDE, true>(), st, b);
}
/* type: a gemm_fast_type (gemm_fast_layer checked it) */
template <bool SW> static void launch_fast(int type, const lin_args &a, int max_groups, int max_count, int expected,
                                           cudaStream_t st) {
    if (type == STG_Q8_0) launch_fast_t<STG_Q8_0, SW>(a, max_groups, max_count, expected, st);
    else launch_fast_t<STG_Q4_K, SW>(a, max_groups, max_count, expected, st);
}

/* The GEMMs that stage bytes in dynamic shared memory (gemm_raw): their size opted in (with the
 * static arrays over 48 KiB) and the largest shared-memory carve-out, so that 3 blocks fit an SM. */
template <int T, bool SW, int BN> static stg_status gemm_setup_one(void) {
    if constexpr (gemm_raw_bytes<T, SW, BN>() > 0) {
        for (const int K : {1024, 2048, 4096, 3072}) { /* CS = 1, 2, 4 and the general loop (C = 3) */
            const gemm_fn f = gemm_kernel<T, SW, BN>(K);
            CU(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, gemm_raw_bytes<T, SW, BN>()),
               "gemm setup");
            CU(cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
               "gemm setup");
        }
    }
    return ST_OK;
}
/* The prefill form of type T (CS = 1, 2, 4): its dynamic shared memory (the staged bytes) and the largest
 * carve-out, so that 3 blocks fit an SM. */
template <int T> static stg_status gemm_fast_setup(void) {
    for (const int K : {1024, 2048, 4096}) {
        const gemm_fn fs[4] = {gemm_fast_kernel<T, false, MM_BN_WIDE>(K), gemm_fast_kernel<T, false, MM_BN_FAST>(K),
                               gemm_fast_kernel<T, true, MM_BN_WIDE>(K), gemm_fast_kernel<T, true, MM_BN_FAST>(K)};
        const int bytes[4] = {gemm_raw_bytes<T, false, MM_BN_WIDE, true>(), gemm_raw_bytes<T, false, MM_BN_FAST, true>(),
                              gemm_raw_bytes<T, true, MM_BN_WIDE, true>(), gemm_raw_bytes<T, true, MM_BN_FAST, true>()};
        for (int i = 0; i < 4; i++) {
            if (bytes[i] > 0)
                CU(cudaFuncSetAttribute(fs[i], cudaFuncAttributeMaxDynamicSharedMemorySize, bytes[i]), "gemm setup");
            CU(cudaFuncSetAttribute(fs[i], cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
               "gemm setup");
        }
    }
    return ST_OK;
}
static stg_status gemm_setup(void) {
#define SETUP_GEMM(T)                                  \
    CHECK((gemm_setup_one<T, false, MM_BN>()));        \
    CHECK((gemm_setup_one<T, false, MM_BN_WIDE>()));   \
    CHECK((gemm_setup_one<T, true, MM_BN>()));
    QUANT_CASES(SETUP_GEMM)
#undef SETUP_GEMM
    CHECK(iq_tables_setup());
    for (const int K : {1024, 2048, 4096}) { /* the routed split form: CS = 1, 2, 4 */
        const gemm_fn f = gemm_rs_kernel<STG_Q4_K>(K);
        CU(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, gemm_raw_bytes<STG_Q4_K, true>()),
           "gemm setup");
        CU(cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared),
           "gemm setup");
    }
    CHECK(gemm_fast_setup<STG_Q4_K>());
    CHECK(gemm_fast_setup<STG_Q8_0>());
    return ST_OK;
}
