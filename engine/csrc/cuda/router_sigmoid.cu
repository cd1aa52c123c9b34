/* Routing by st_model_desc's rule (GLM-4.5, DeepSeek-V3): sigmoid (or softmax) gating, the score-correction
 * bias exp_probs_b, group-limited top-k; moe.c's st_route_token step for step, so that the same logits give the
 * same experts and weights as on the CPU:
 *   p = gating(logits)               sigmoid: 1 / (1 + exp(-l)); softmax: exp(l - max) / sum, summed in order
 *   c = p + bias                     (the bias steers the choice only)
 *   groups (n_group > 1): a group's score is the sum of its two best c; only the n_group_used best groups
 *                         (lowest index on ties) stay eligible, the others' c become -inf
 *   ids = the top k of c             (largest first, lowest index on ties)
 *   w = p[ids]                       (unbiased: the combine normalises when expert_norm, times the scale)
 * The plain softmax top-k (no bias, no groups) keeps router.cu's route_token. Each launch form here mirrors one of
 * router.cu's (k_router, k_route, k_router_route) with route_token_rule in place of route_token, so the decode step
 * still computes the router logits, routes and groups in one launch. */
#include "linear.cuh"

struct route_rule {
    const float *bias; /* [ne] F32 exp_probs_b, or NULL */
    int32_t ne, k, gating, n_group, n_group_used; /* gating: ST_GATING_SOFTMAX or ST_GATING_SIGMOID */
};

/* Floats of one warp's scratch: p [ne], c [ne], then with groups their scores and kept flags [n_group] each. */
static __host__ __device__ int32_t rule_scratch(const route_rule &rr) {
    return 2 * rr.ne + (rr.n_group > 1 ? 2 * rr.n_group : 0);
}

/* One token's routing by one warp: r [ne] its logits, sp rule_scratch(rr) floats of shared memory, ids / w [k]
 * written by lane 0. */
__device__ void route_token_rule(const route_rule &rr, const float *r, float *sp, int lane, int32_t *ids, float *w) {
    const int ne = rr.ne;
    float *p = sp, *c = sp + ne;
    if (rr.gating == ST_GATING_SIGMOID) {
        for (int e = lane; e < ne; e += 32) p[e] = 1.0f / (1.0f + exp_cr(-r[e]));
    } else { /* softmax as route_token computes it: the max, exp, the sum in expert order by one lane */
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
    }
    for (int e = lane; e < ne; e += 32) c[e] = rr.bias ? p[e] + rr.bias[e] : p[e];
    __syncwarp();
    if (rr.n_group > 1) {
        const int ng = rr.n_group, per = ne / ng;
        float *gs = c + ne;
        int32_t *kept = (int32_t *)(gs + ng);
        for (int g = lane; g < ng; g += 32) { /* moe.c's top_k(c of the group, 2): first max, then the next */
            const float *cg = c + (int64_t)g * per;
            int b0 = 0;
            for (int e = 1; e < per; e++)
                if (cg[e] > cg[b0]) b0 = e;
            float s = 0.0f;
            s += cg[b0];
            if (per >= 2) {
                int b1 = b0 == 0 ? 1 : 0;
                for (int e = b1 + 1; e < per; e++)
                    if (e != b0 && cg[e] > cg[b1]) b1 = e;
                s += cg[b1];
            }
            gs[g] = s;
            kept[g] = 0;
        }
        __syncwarp();
        if (lane == 0) /* top_k(gs, ng, n_group_used): lowest index on ties */
            for (int u = 0; u < rr.n_group_used; u++) {
                int best = -1;
                for (int g = 0; g < ng; g++)
                    if (!kept[g] && (best < 0 || gs[g] > gs[best])) best = g;
                kept[best] = 1;
            }
        __syncwarp();
        for (int e = lane; e < ne; e += 32)
            if (!kept[e / per]) c[e] = -INFINITY;
        __syncwarp();
    }
    /* top k of c: k rounds of a warp argmax (larger value, then lower index); lane l owns experts l + 32 i,
     * its taken ones in a bit mask (ne <= 1024) */
    uint32_t taken = 0u;
    for (int j = 0; j < rr.k; j++) {
        float bv = 0.0f;
        int bi = -1;
        for (int e = lane, i = 0; e < ne; e += 32, i++)
            if (!(taken >> i & 1u) && (bi < 0 || c[e] > bv)) bv = c[e], bi = e; /* ascending e: ties keep the lower */
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
        }
        if (bi >= 0 && bi % 32 == lane) taken |= 1u << (bi / 32);
        if (lane == 0) {
            ids[j] = bi;
            w[j] = p[bi];
        }
    }
    __syncwarp(); /* lane 0's reads of p done before this warp's next token writes it */
}

/* Any number of tokens, a warp each (RULE_WARPS per block): k_router's form. */
#define RULE_WARPS 2
__global__ void k_route_rule(const float *logits, int32_t T, route_rule rr, int32_t *ids, float *w) {
    PDL_ENTER();
    extern __shared__ float rls[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int t = blockIdx.x * RULE_WARPS + warp;
    if (t >= T) return;
    route_token_rule(rr, logits + (int64_t)t * rr.ne, rls + warp * rule_scratch(rr), lane, ids + (int64_t)t * rr.k,
                     w + (int64_t)t * rr.k);
}

/* Small steps: routing and grouping in one block of RULE_GROUP_WARPS warps (k_route's form). Shared memory:
 * RULE_GROUP_WARPS scratches, then 2 * ne ints for group_pairs. */
#define RULE_GROUP_WARPS 8
__global__ void __launch_bounds__(RULE_GROUP_WARPS * 32) k_route_rule_group(const float *logits, int32_t T,
                                                                            route_rule rr, int32_t *ids, float *w,
                                                                            group_out o) {
    PDL_ENTER();
    extern __shared__ float rgs[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t scr = rule_scratch(rr);
    for (int t = warp; t < T; t += RULE_GROUP_WARPS)
        route_token_rule(rr, logits + (int64_t)t * rr.ne, rgs + warp * scr, lane, ids + (int64_t)t * rr.k,
                         w + (int64_t)t * rr.k);
    __syncthreads(); /* ids written above are read below by other threads of the block */
    group_pairs(ids, T * rr.k, rr.k, rr.ne, o, (int32_t *)(rgs + RULE_GROUP_WARPS * scr));
}

/* Steps of at most 8 tokens: router logits, routing and grouping in one launch (k_router_route's form: block b
 * computes router row b for every token as k_linear_f_rows does; the last block to finish routes and groups).
 * Shared memory: LIN_WARPS scratches, 2 * ne ints, T * ne floats of logits. */
template <int TY, int NT>
__global__ void __launch_bounds__(LIN_WARPS * WARP) k_router_route_rule(lin_args a, route_args r, route_rule rr) {
    pdl_trigger();
    extern __shared__ float rrl[];
    if (!router_rows_then_last<TY, NT>(a, r)) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t scr = rule_scratch(rr);
    int32_t *gsh = (int32_t *)(rrl + LIN_WARPS * scr);
    float *lg = rrl + LIN_WARPS * scr + 2 * r.ne; /* [T][ne] logits, read past L1 */
    for (int i = threadIdx.x; i < r.T * r.ne; i += blockDim.x) lg[i] = __ldcg(a.out + i);
    __syncthreads();
    for (int t = warp; t < r.T; t += LIN_WARPS)
        route_token_rule(rr, lg + (int64_t)t * r.ne, rrl + warp * scr, lane, r.ids + (int64_t)t * r.k,
                         r.w + (int64_t)t * r.k);
    __syncthreads();
    group_pairs(r.ids, r.T * r.k, r.k, r.ne, r.o, gsh, true);
    if (threadIdx.x == 0) *r.counter = 0; /* every block has counted: ready for the next layer */
}

/* Whether layer L routes by the rule (else route_token's softmax top-k). */
static bool rule_routing(const stg_model *m, const dlayer &L) {
    return m->d.gating == ST_GATING_SIGMOID || m->d.n_expert_group > 1 || L.exp_probs_b.d != nullptr;
}

/* The routed scaling factor the combine multiplies the expert sum by (expert_weights_scale, 0 = 1). */
static float route_scale(const st_model_desc &d) { return d.expert_weights_scale != 0.0f ? d.expert_weights_scale : 1.0f; }

/* Router logits of xn into s.router, the rule's routing into s.topk_id / s.topk_w and the grouping into go, for
 * the T tokens of a layer that routes by the rule (ffn_block). */
static stg_status route_by_rule(stg_model *m, const dlayer &L, int32_t T, const group_out &go) {
    scratch &s = m->s;
    const st_model_desc &d = m->d;
    cudaStream_t st = m->stream;
    const int ne = d.n_expert, k = d.n_expert_used;
    route_rule rr;
    rr.bias = L.exp_probs_b.d ? L.exp_probs_b.f() : nullptr;
    rr.ne = ne, rr.k = k;
    rr.gating = d.gating == ST_GATING_SIGMOID ? ST_GATING_SIGMOID : ST_GATING_SOFTMAX;
    rr.n_group = d.n_expert_group > 1 ? d.n_expert_group : 1;
    rr.n_group_used = d.n_expert_group > 1 ? d.n_group_used : 1;
    const size_t scr = (size_t)rule_scratch(rr) * sizeof(float);
    lin_groups g1 = {};
    g1.n_pairs = T;
    const size_t rr_smem = LIN_WARPS * scr + 2 * (size_t)ne * sizeof(int32_t) + (size_t)T * ne * sizeof(float);
    if (T <= 8 && stg_is_float(L.gate_inp.type) && rr_smem <= 48 * 1024) {
        lin_args a = {};
        a.w = L.gate_inp.d, a.row_bytes = L.gate_inp.row_bytes, a.expert_stride = L.gate_inp.expert_stride;
        a.N = ne, a.K = (int32_t)L.gate_inp.ne[0], a.g = g1, a.x = s.xn, a.out = s.router, a.ldo = ne;
        a.mode = MODE_STORE;
        route_args ra = {m->route_counter, T, ne, k, s.topk_id, s.topk_w, go, 0};
        int nt = 1;
        while (nt < T) nt *= 2;
        ra.pre = nt > 2 ? 0 : a.K <= ROUTER_PRE * LIN_WARPS * WARP ? 1 : a.K <= ROUTER_PRE_WIDE * LIN_WARPS * WARP ? 2 : 0;
        switch (L.gate_inp.type) {
#define CASE_RRR(TY)                                                                                   \
    case TY:                                                                                           \
        if (nt == 8) launch_k(k_router_route_rule<TY, 8>, ne, LIN_WARPS * 32, rr_smem, st, a, ra, rr);  \
        else if (nt == 4) launch_k(k_router_route_rule<TY, 4>, ne, LIN_WARPS * 32, rr_smem, st, a, ra, rr); \
        else if (nt == 2) launch_k(k_router_route_rule<TY, 2>, ne, LIN_WARPS * 32, rr_smem, st, a, ra, rr); \
        else launch_k(k_router_route_rule<TY, 1>, ne, LIN_WARPS * 32, rr_smem, st, a, ra, rr);          \
        break;
            FLOAT_CASES(CASE_RRR)
#undef CASE_RRR
        default: return fail(ST_EUNSUPPORTED, "router type %d", L.gate_inp.type);
        }
        LAUNCHED("router + route (rule)");
        return ST_OK;
    }
    const acts_d rin{s.aq, s.ad, s.as, s.xn};
    CHECK(linear(st, L.gate_inp, nullptr, g1, 1, T, T, rin, s.router, ne, MODE_STORE));
    const size_t group_smem = RULE_GROUP_WARPS * scr + 2 * (size_t)ne * sizeof(int32_t);
    if (T <= 2 * RULE_GROUP_WARPS * 4 && group_smem <= 48 * 1024) { /* small steps: one launch for both */
        launch_k(k_route_rule_group, 1, RULE_GROUP_WARPS * 32, group_smem, st, (const float *)s.router, T, rr,
                 s.topk_id, s.topk_w, go);
        LAUNCHED("route (rule)");
        return ST_OK;
    }
    launch_k(k_route_rule, (T + RULE_WARPS - 1) / RULE_WARPS, RULE_WARPS * 32, RULE_WARPS * scr, st,
             (const float *)s.router, T, rr, s.topk_id, s.topk_w);
    LAUNCHED("route (rule)");
    launch_k(k_group, 1, 1024, 2 * ne * sizeof(int32_t), st, (const int32_t *)s.topk_id, T * k, k, ne, go, 0);
    LAUNCHED("group");
    return ST_OK;
}
