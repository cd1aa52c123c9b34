/* The linear-layer dispatcher: picks matvec, GEMM (plain, k-split, routed split, prefill form) or the
 * fused forms for a launch, by type, shape and the settings' thresholds. */
#include "model.cuh"

static bool gemm_fast_layer(const dtensor &W) {
    if (W.type != STG_Q4_K && W.type != STG_Q8_0) return false; /* gemm_fast_type */
    const int64_t C = (W.ne[0] / 32 + 31) / 32;
    return C == 1 || C == 2 || C == 4;
}

/* The GEMM for a launch of `groups` groups of about `expected` pairs over N weight rows:
 * from gemm_min pairs per group, only with enough tiles to fill the GPU (a dense q or o
 * projection at 8-32 tokens has 64-128 tiles of 64 rows, each a serial pass over K: the
 * matvec's thousands of warps finish first there), and for a single group (a dense layer,
 * the output head) only from gemm_dense pairs (32: the 151,936-row Q6_K head at 8 tokens is
 * faster on the matvec, at 32 on the GEMM). Same results either way. */
static bool use_gemm(int64_t N, int groups, int expected) {
    const int64_t tiles = (N + MM_BM - 1) / MM_BM * groups * ((expected + MM_BN - 1) / MM_BN);
    if (groups == 1 && expected < g_set.gemm_dense_min) return false;
    return expected >= g_set.gemm_min && tiles >= 256;
}

template <int T, bool SW, int TG = T>
static void launch_q(const lin_args &a, int path, int nt, int max_groups, int max_count, cudaStream_t st) {
    if constexpr (T == STG_Q6_K && TG == T) { /* the GEMM unpacks through unpack_q6k_wide (STG_Q6_KW) */
        if (path == STG_PATH_GEMM) {
            launch_q<T, SW, STG_Q6_KW>(a, path, nt, max_groups, max_count, st);
            return;
        }
    }
    if (path == STG_PATH_REF) {
        launch_k(k_linear_ref<T>, dim3((unsigned)((a.N + 127) / 128), (unsigned)max_groups), 128, 0, st, a);
    } else if (path == STG_PATH_GEMM) {
        const unsigned mt = (unsigned)((a.N + MM_BM - 1) / MM_BM);
        const int64_t per_group = (int64_t)((max_count + MM_BN - 1) / MM_BN) * max_groups;
        const int64_t listed = a.g.gexp && a.g.tiles ? (a.g.n_pairs + MM_BN - 1) / MM_BN + max_groups
                                                                       : INT64_MAX;
        const int64_t wide = (max_count + MM_BN_WIDE - 1) / MM_BN_WIDE;
        if constexpr (SW) {
            if (a.ksplit > 1) { /* routed gate/up over the tile list, its k loop split over grid z */
                const unsigned nl = (unsigned)((a.g.n_pairs + MM_BN - 1) / MM_BN + max_groups);
                launch_k(gemm_rs_kernel<T>(a.K), dim3(mt, nl, (unsigned)a.ksplit), 128, gemm_raw_bytes<T, SW>(), st, a);
                const int64_t n = (int64_t)a.g.n_pairs * a.N;
                launch_k(k_ksplit_routed, (unsigned)((n + 255) / 256), 256, 0, st, (const float *)a.kpart, a.ksplit,
                         2, a.g.n_pairs, a.N, a.out, a.ldo, a.hq, a.hd, a.hs, a.g.pair_mv);
                return;
            }
        }
        if (a.ksplit > 1) { /* a dense plain layer, its k loop split over grid z (lin_args.ksplit) */
            const bool wide = max_count > MM_BN;
            const int bn = wide ? MM_BN_WIDE : MM_BN;
            const dim3 grid(mt, (unsigned)((max_count + bn - 1) / bn), (unsigned)a.ksplit);
            if (wide)
                launch_k(gemm_kernel<TG, false, MM_BN_WIDE>(a.K), grid, 128, gemm_raw_bytes<TG, false, MM_BN_WIDE>(),
                         st, a);
            else launch_k(gemm_kernel<TG, false, MM_BN>(a.K), grid, 128, gemm_raw_bytes<TG, false, MM_BN>(), st, a);
            const int64_t n = (int64_t)max_count * a.N;
            if (g_defer_combine && a.ksplit == KSPLIT) g_deferred = true; /* the consumer adds the parts */
            else
                launch_k(k_ksplit_combine, (unsigned)((n + 255) / 256), 256, 0, st, (const float *)a.kpart, a.ksplit,
                         max_count, a.N, a.out, a.ldo, a.mode, a.seg);
        } else if (listed < per_group) { /* a block per tile of group_pairs' list */
            launch_k(gemm_kernel<TG, SW, MM_BN>(a.K), dim3(mt, (unsigned)listed, 1), 128, gemm_raw_bytes<TG, SW, MM_BN>(),
                     st, a);
        } else if (!SW && !a.g.gexp && mt * wide >= g_set.gemm_wide_min) {
            /* a dense layer with enough tiles of 32 pairs: half the weight unpacking per mma */
            lin_args b = a;
            b.g.tiles = b.g.n_tiles = nullptr;
            launch_k(gemm_kernel<TG, false, MM_BN_WIDE>(a.K), dim3(mt, (unsigned)wide, 1), 128,
                     gemm_raw_bytes<TG, false, MM_BN_WIDE>(), st, b);
        } else {
            lin_args b = a;
            b.g.tiles = b.g.n_tiles = nullptr;
            launch_k(gemm_kernel<TG, SW, MM_BN>(a.K), dim3(mt, (unsigned)((max_count + MM_BN - 1) / MM_BN),
                     (unsigned)max_groups), 128, gemm_raw_bytes<TG, SW, MM_BN>(), st, b);
        }
    } else {
        const dim3 grid((unsigned)((a.N + LIN_WARPS - 1) / LIN_WARPS), (unsigned)max_groups);
        if constexpr (SW && (T == STG_Q4_K || T == STG_Q8_0 || T == STG_IQ3_XXS)) {
            if (a.hq) { /* the routed gate/up of single-pair passes quantising its chunks in-block (linear()) */
                launch_k(k_linear_q_chunk<T>, dim3((unsigned)(a.N / 32), (unsigned)max_groups), GU_CHUNK_WARPS * 32, 0,
                         st, a);
                return;
            }
        }
        if constexpr ((T == STG_Q4_K || T == STG_IQ3_XXS) && !SW) {
            if (nt == 1 && a.g.gexp && a.seg.n_seg < 2) { /* routed single pairs: 8 rows per warp */
                const dim3 g((unsigned)((a.N + LIN_WARPS * 8 - 1) / (LIN_WARPS * 8)), grid.y);
                launch_k(k_linear_q_rows<T, 8>, g, LIN_WARPS * 32, 0, st, a);
                return;
            }
        }
        if constexpr (T == STG_Q6_K && !SW) {
            if (nt == 1 && !a.g.gexp && a.seg.n_seg < 2 && a.N >= Q6_ROWS_MIN_N) { /* the output head at one pair */
                if (grid.y == 1 && launch_q6_stage(a, st)) return;
                const dim3 g((unsigned)((a.N + LIN_WARPS * 2 - 1) / (LIN_WARPS * 2)), grid.y);
                launch_k(k_linear_q_rows<STG_Q6_KW, 2>, g, LIN_WARPS * 32, 0, st, a);
                return;
            }
        }
        if constexpr (!SW) {
            if (launch_short<T>(a, nt, max_groups, st)) return; /* rows of at most 16 sub-blocks */
        }
        if constexpr (T == STG_Q6_K) {
            launch_mv<STG_Q6_KW, SW>(a, nt, grid, st); /* five 8-byte loads per 32-byte chunk (unpack_q6k_wide) */
            return;
        }
        launch_mv<T, SW>(a, nt, grid, st);
    }
}
template <int T, bool SW> static void launch_f(const lin_args &a, int path, int nt, int max_groups, int max_count,
                                               cudaStream_t st) {
    if (path == STG_PATH_REF) {
        launch_k(k_linear_ref<T>, dim3((unsigned)((a.N + 127) / 128), (unsigned)max_groups), 128, 0, st, a);
        return;
    }
    if (!SW && a.N <= 1024 && nt == 8 && max_count > 8 && max_count <= 64 && max_groups == 1 &&
        !a.g.gexp && a.K <= ROUTER_PRE * LIN_WARPS * WARP) {
        /* 9-64 pairs of a router: weights before the wait, a pass's activations all in flight (same bits) */
        const dim3 grid((unsigned)a.N, 1u, (unsigned)((max_count + 7) / 8));
        launch_k(k_linear_f_rows_mlp<T, 8>, grid, LIN_WARPS * 32, 0, st, a);
        return;
    }
    if (!SW && a.N <= 1024) { /* few rows (a router): a block per row and pass of nt pairs keeps the GPU busy */
        const dim3 grid((unsigned)a.N, (unsigned)max_groups, (unsigned)std::min((max_count + nt - 1) / nt, 65535));
        if (nt >= 8) launch_k(k_linear_f_rows<T, 8>, grid, LIN_WARPS * 32, 0, st, a);
        else if (nt >= 4) launch_k(k_linear_f_rows<T, 4>, grid, LIN_WARPS * 32, 0, st, a);
        else if (nt >= 2) launch_k(k_linear_f_rows<T, 2>, grid, LIN_WARPS * 32, 0, st, a);
        else launch_k(k_linear_f_rows<T, 1>, grid, LIN_WARPS * 32, 0, st, a);
        return;
    }
    const dim3 grid((unsigned)((a.N + LIN_WARPS - 1) / LIN_WARPS), (unsigned)max_groups);
    if (nt >= 8) launch_k(k_linear_f<T, 8, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else if (nt >= 4) launch_k(k_linear_f<T, 4, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else if (nt >= 2) launch_k(k_linear_f<T, 2, SW>, grid, LIN_WARPS * 32, 0, st, a);
    else launch_k(k_linear_f<T, 1, SW>, grid, LIN_WARPS * 32, 0, st, a);
}

/* One linear layer over groups of pairs. W2 (optional, same type) makes it SWIGLU.
 * expected: pairs a group is expected to hold (picks the kernel); max_count: an upper
 * bound on any group's pairs (sizes the GEMM grid). */
/* Where a SWIGLU launch may also quantise its output for the down projection (lin_args.hq); `done` says
 * whether it did. */
struct fused_quant {
    int8_t *q;
    float *d;
    int32_t *s;
    bool *done;
};

static stg_status linear(cudaStream_t st, const dtensor &W, const dtensor *W2, const lin_groups &g, int max_groups,
                         int expected, int max_count, const acts_d &in, float *out, int64_t ldo, int mode,
                         int path = STG_PATH_AUTO, const lin_seg *seg = nullptr, const fused_quant *fq = nullptr) {
    lin_args a;
    a.w = W.d, a.w2 = W2 ? W2->d : nullptr;
    a.expert_stride = W.expert_stride, a.row_bytes = W.row_bytes;
    a.N = (int32_t)W.ne[1], a.K = (int32_t)W.ne[0];
    a.seg = {};
    if (seg) a.seg = *seg, a.N = seg->seg_row[seg->n_seg];
    a.g = g;
    a.aq = in.q, a.ad = in.d, a.as = in.s, a.x = in.x;
    a.out = out, a.ldo = ldo, a.mode = W2 ? MODE_SWIGLU : mode;
    a.hq = nullptr, a.hd = nullptr, a.hs = nullptr;
    a.kpart = nullptr, a.ksplit = 0;
    if (fq) *fq->done = false;
    if (max_groups < 1 || max_count < 1) return ST_OK;
    const bool q = !stg_is_float(W.type);
    if (q && stg_type_k256(W.type)) {
        /* the CPU's per-256 codes of x (st_type_q8k) in the per-32 layout: every kernel below reads them unchanged */
        const int64_t rows = in.rows > 0 ? in.rows : g.in_map ? -1 : g.n_pairs;
        if (rows < 0) return fail(ST_EINVAL, "linear: a per-256 type's launch with in_map needs acts_d.rows");
        if (!in.x || !g_k256q || rows * a.K > g_k256_cap)
            return fail(ST_EINVAL, "linear: per-256 view of %lld x %d: no floats or over the scratch (%lld)",
                        (long long)rows, a.K, (long long)g_k256_cap);
        CHECK(quantize256(st, in.x, rows, a.K, g_k256q, g_k256d, g_k256s, in.skip, in.skip_val));
        a.aq = g_k256q, a.ad = g_k256d, a.as = g_k256s;
    }
    if (g_gemm_fast && !W2 && !seg && W.type == STG_F32 && !g.gexp && max_groups == 1 &&
        a.N <= 1024 && a.K % RG_BK == 0 && (uintptr_t)W.d % 16 == 0 && (uintptr_t)in.x % 16 == 0 &&
        (path == STG_PATH_AUTO || path == STG_PATH_GEMM)) {
        /* a router in a prefill-form step: activations read once per RG_BM rows instead of once per row */
        launch_k(k_router_gemm, dim3((unsigned)((a.N + RG_BM - 1) / RG_BM), (unsigned)((max_count + RG_BT - 1) / RG_BT)),
                 RG_BM * 32, 0, st, a);
        LAUNCHED("linear (router, prefill form)");
        return ST_OK;
    }
    /* the prefill form takes row segments (q / k / v in one launch) whose every boundary is a whole tile */
    const auto whole_tiles = [&] {
        for (int i = 0; seg && i <= seg->n_seg; i++)
            if (seg->seg_row[i] % MM_BM) return false;
        return true;
    };
    if (g_gemm_fast && gemm_fast_layer(W) && whole_tiles() && (path == STG_PATH_AUTO || path == STG_PATH_GEMM)) {
        if (W2) launch_fast<true>(W.type, a, max_groups, max_count, expected, st);
        else launch_fast<false>(W.type, a, max_groups, max_count, expected, st);
        LAUNCHED("linear (prefill form)");
        return ST_OK;
    }
    /* routed layers from gemm_min_tokens tokens: the GEMM at 1 expected pair per expert too (with the split) */
    const int min_tok = g_set.gemm_min_tokens;
    const bool gemm = q && !seg && (use_gemm(a.N, max_groups, expected) || (g.gexp && min_tok > 0 && max_count >= min_tok));
    /* row segments on the split GEMM: each segment whole tiles of MM_BM rows */
    const bool seg_split = seg && seg->n_seg >= 2 && seg->n_seg <= 3 && [&] {
        for (int i = 0; i <= seg->n_seg; i++)
            if (seg->seg_row[i] % MM_BM) return false;
        return true;
    }();
    /* a dense plain layer the GEMM's grid would not fill: the GEMM with its k loop split (see KSPLIT) */
    const bool split = q && !gemm && !W2 && (!seg || seg_split) && !g.gexp && max_groups == 1 && g_set.dense_split > 0 &&
                       expected >= g_set.dense_split && max_count <= KSPLIT_MAX_T && g_kpart &&
                       (int64_t)KSPLIT * max_count * a.N <= g_kpart_cap && (path == STG_PATH_AUTO || path == STG_PATH_GEMM);
    if (split) path = STG_PATH_GEMM, a.kpart = g_kpart, a.ksplit = KSPLIT;
    if (path == STG_PATH_AUTO) path = gemm ? STG_PATH_GEMM : STG_PATH_MATVEC;
    if (path == STG_PATH_GEMM && !q) path = STG_PATH_MATVEC;
    /* a routed gate/up launch over the tile list at decode: the split GEMM (ROUTED_SPLIT), its combine also
     * quantising the output for the down projection */
    const int rs = ROUTED_SPLIT;
    const bool rs_form = W.type == STG_Q4_K && gemm_rs_kernel<STG_Q4_K>((int)a.K) != nullptr;
    if (path == STG_PATH_GEMM && q && rs_form && W2 && !seg && !split && g.gexp && g.tiles &&
        max_count <= g_set.routed_split_max && g_kpart && (int64_t)rs * 2 * g.n_pairs * a.N <= g_kpart_cap &&
        mode == MODE_STORE) {
        a.kpart = g_kpart, a.ksplit = rs;
        if (fq && W2 && a.N % 32 == 0 && ldo == a.N) {
            a.hq = fq->q, a.hd = fq->d, a.hs = fq->s;
            *fq->done = true;
        }
    }
    /* a routed gate/up matvec of one pair per pass quantises its chunks in-block (k_linear_q_chunk) */
    const bool gu_chunk = fq && W2 && path == STG_PATH_MATVEC && !seg && g.gexp && expected <= 1 &&
                          a.N % 32 == 0 && ldo == a.N &&
                          (W.type == STG_Q4_K || W.type == STG_Q8_0 || W.type == STG_IQ3_XXS);
    if (gu_chunk) {
        a.hq = fq->q, a.hd = fq->d, a.hs = fq->s;
        *fq->done = true;
    }
    if (seg && !split && (path != STG_PATH_MATVEC || !q))
        return fail(ST_EINVAL, "linear: row segments need the matvec path or the split GEMM");
    int nt = 1;
    while (nt < expected && nt < 8) nt *= 2;
    switch (W.type) {
#define CASE_Q(T)                                                         \
    case T:                                                               \
        if (W2) launch_q<T, true>(a, path, nt, max_groups, max_count, st); \
        else launch_q<T, false>(a, path, nt, max_groups, max_count, st);  \
        break;
        QUANT_CASES(CASE_Q)
#undef CASE_Q
#define CASE_F(T)                                           \
    case T:                                                 \
        if (W2) launch_f<T, true>(a, path, nt, max_groups, max_count, st); \
        else launch_f<T, false>(a, path, nt, max_groups, max_count, st);   \
        break;
        FLOAT_CASES(CASE_F)
#undef CASE_F
    default: return fail(ST_EUNSUPPORTED, "linear: quant type %d", W.type);
    }
    LAUNCHED("linear");
    return ST_OK;
}

/* h = silu(Wg . x) * (Wu . x): one fused launch, or three when the two weights have
 * different quant types (gate into tmp, up into h, then the product). */
static stg_status swiglu(cudaStream_t st, const dtensor &Wg, const dtensor &Wu, const lin_groups &g, int max_groups,
                         int expected, int max_count, const acts_d &in, float *h, int64_t ldo, float *tmp,
                         int64_t n_rows, const fused_quant *fq = nullptr, int path = STG_PATH_AUTO) {
    if (fq) *fq->done = false;
    if (Wg.type == Wu.type)
        return linear(st, Wg, &Wu, g, max_groups, expected, max_count, in, h, ldo, MODE_STORE, path, nullptr, fq);
    CHECK(linear(st, Wg, nullptr, g, max_groups, expected, max_count, in, tmp, ldo, MODE_STORE, path));
    CHECK(linear(st, Wu, nullptr, g, max_groups, expected, max_count, in, h, ldo, MODE_STORE, path));
    const int64_t n = n_rows * ldo;
    launch_k(k_silu_mul, (unsigned)((n + 255) / 256), 256, 0, st, h, tmp, n);
    LAUNCHED("silu");
    return ST_OK;
}
