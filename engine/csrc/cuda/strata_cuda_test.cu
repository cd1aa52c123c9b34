/* The kernel harness: engine/_strata_cuda_test.so, the engine's sources (strata_cuda.cu) plus the
 * stg_test_* entry points of strata_cuda_test.h, which run one kernel family on host buffers for the
 * GPU tests (tests/engine/gpu). Production code never loads this library. */
#include "strata_cuda.cu"

extern "C" {
#include "strata_cuda_test.h"
}

/* the harness: the prefill form when gemm_fast_min >= 1 and its n_tok tokens, taken as one run, reach it */
static bool harness_fast(int64_t n_tok) { return g_set.gemm_fast_min >= 1 && n_tok >= g_set.gemm_fast_min; }

/* ------------------------------------------------------------------ kernel harness */

/* A device buffer freed at scope exit (harness only). */
struct dbuf {
    void *p = nullptr;
    ~dbuf() {
        if (p) cudaFree(p);
    }
    template <typename P> P *as() const { return (P *)p; }
};

/* The harness's settings (stg_test_set_settings): stg_settings_default's, but without the prefill form
 * (gemm_fast_min 0), so that the kernels the tests compare are the bitwise ones unless a test asks. */
static stg_settings g_test_set;
static bool g_test_set_init = false;

extern "C" stg_status stg_test_set_settings(const stg_settings *s) {
    if (s) CHECK(check_settings(s));
    if (s) g_test_set = *s;
    else stg_settings_default(&g_test_set), g_test_set.gemm_fast_min = 0;
    g_test_set_init = true;
    return ST_OK;
}

static stg_status harness_device(void) {
    if (!g_test_set_init) stg_test_set_settings(nullptr);
    g_pdl = false;
    g_set = g_test_set;
    g_defer_combine = g_deferred = false;
    g_gemm_fast = false;
    g_kpart = nullptr, g_kpart_cap = 0; /* a harness call that wants the split GEMM sets its own */
    const int n = stg_device_count();
    if (n < 0) return ST_EUNSUPPORTED;
    if (n == 0) return fail(ST_EUNSUPPORTED, "no CUDA device");
    CU(cudaSetDevice(0), "harness");
    return gemm_setup();
}

static stg_status up(dbuf &b, const void *src, size_t n) {
    CU(cudaMalloc(&b.p, n + STG_WEIGHT_TAIL), "harness alloc"); /* weights: as the arena */
    if (src && n) CU(cudaMemcpy(b.p, src, n, cudaMemcpyHostToDevice), "harness upload");
    return ST_OK;
}

/* A harness call's activations x [n_tok, k] on the device, with room for their 8-bit form
 * (quantize's qs [n_tok, k], d [n_tok, k / 32], sums [n_tok, k / 16]). */
static stg_status up_acts(dbuf &bx, dbuf &bq, dbuf &bd, dbuf &bs, const float *x, int64_t n_tok, int64_t k) {
    const size_t n = (size_t)n_tok * (size_t)k;
    CHECK(up(bx, x, sizeof(float) * n));
    CHECK(up(bq, nullptr, n));
    CHECK(up(bd, nullptr, sizeof(float) * n / 32));
    return up(bs, nullptr, sizeof(int32_t) * n / 16);
}
static stg_status down(void *dst, const dbuf &b, size_t n) {
    CU(cudaDeviceSynchronize(), "harness kernel");
    CU(cudaMemcpy(dst, b.p, n, cudaMemcpyDeviceToHost), "harness download");
    return ST_OK;
}
/* linear()'s per-256 view scratch (g_k256q ...) for a launch over n activation elements, released (and the
 * globals cleared) with the harness call. */
struct k256_view {
    dbuf q, d, s;
    stg_status make(int64_t n) {
        CHECK(up(q, nullptr, (size_t)n));
        CHECK(up(d, nullptr, sizeof(float) * (size_t)n / 32));
        CHECK(up(s, nullptr, sizeof(int32_t) * (size_t)n / 16));
        g_k256q = q.as<int8_t>(), g_k256d = d.as<float>(), g_k256s = s.as<int32_t>(), g_k256_cap = n;
        return ST_OK;
    }
    ~k256_view() { g_k256q = nullptr, g_k256d = nullptr, g_k256s = nullptr, g_k256_cap = 0; }
};

extern "C" stg_status stg_test_dequantize(int32_t type, const void *src, float *dst, int64_t n) {
    const int be = stg_block_elems(type);
    if (!be) return fail(ST_EUNSUPPORTED, "dequantize: unsupported quant type %d", type);
    if (!src || !dst || n <= 0 || n % be) return fail(ST_EINVAL, "dequantize: n=%lld invalid", (long long)n);
    CHECK(harness_device());
    const int64_t nb = n / be;
    dbuf s, d;
    CHECK(up(s, src, (size_t)(nb * stg_block_bytes(type))));
    CHECK(up(d, nullptr, sizeof(float) * (size_t)n));
    const unsigned grid = (unsigned)((nb + 127) / 128);
    switch (type) {
#define CASE_D(T) case T: k_dequant<T><<<grid, 128>>>(s.as<uint8_t>(), d.as<float>(), nb); break;
        QUANT_CASES(CASE_D)
        FLOAT_CASES(CASE_D)
#undef CASE_D
    }
    LAUNCHED("dequantize");
    return down(dst, d, sizeof(float) * (size_t)n);
}

extern "C" stg_status stg_test_quantize_act(const float *x, int64_t n_tok, int64_t k, int8_t *qs, float *d,
                                            int32_t *sums) {
    if (!x || !qs || !d || !sums || n_tok < 1 || k < 32 || k % 32) return fail(ST_EINVAL, "quantize_act: bad shape");
    CHECK(harness_device());
    dbuf bx, bq, bd, bs;
    const size_t n = (size_t)(n_tok * k);
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(quantize(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    CHECK(down(qs, bq, n));
    CHECK(down(d, bd, sizeof(float) * n / 32));
    return down(sums, bs, sizeof(int32_t) * n / 16);
}

extern "C" stg_status stg_test_quantize_act256(const float *x, int64_t n_tok, int64_t k, int8_t *qs, float *d,
                                               int32_t *sums) {
    if (!x || !qs || !d || !sums || n_tok < 1 || k < 256 || k % 256)
        return fail(ST_EINVAL, "quantize_act256: bad shape");
    CHECK(harness_device());
    dbuf bx, bq, bd, bs;
    const size_t n = (size_t)(n_tok * k);
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(quantize256(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    CHECK(down(qs, bq, n));
    CHECK(down(d, bd, sizeof(float) * n / 32));
    return down(sums, bs, sizeof(int32_t) * n / 16);
}

extern "C" stg_status stg_test_linear(int32_t type, int32_t path, const void *w, const void *w2, int64_t n_rows,
                                      int64_t k, const float *x, int64_t n_tok, float *out) {
    const int be = stg_block_elems(type);
    if (!be) return fail(ST_EUNSUPPORTED, "linear: unsupported quant type %d", type);
    if (!w || !x || !out || n_rows < 1 || n_tok < 1 || k < 32 || k % 32 || k % be || path < 0 || path > 3)
        return fail(ST_EINVAL, "linear: bad arguments (rows=%lld k=%lld tokens=%lld path=%d)", (long long)n_rows,
                    (long long)k, (long long)n_tok, path);
    CHECK(harness_device());
    dtensor W;
    W.type = type, W.ne[0] = k, W.ne[1] = n_rows, W.row_bytes = stg_row_bytes(type, k);
    W.expert_stride = W.row_bytes * n_rows;
    dbuf bw, bw2, bx, bq, bd, bs, bo;
    CHECK(up(bw, w, (size_t)W.expert_stride));
    W.d = bw.as<uint8_t>();
    dtensor W2 = W;
    if (w2) {
        CHECK(up(bw2, w2, (size_t)W.expert_stride));
        W2.d = bw2.as<uint8_t>();
    }
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(up(bo, nullptr, sizeof(float) * (size_t)(n_tok * n_rows)));
    if (!stg_is_float(type)) CHECK(quantize(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    lin_groups g = {};
    g.n_pairs = (int32_t)n_tok;
    k256_view kv;
    CHECK(kv.make(n_tok * k));
    const acts_d in{bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>(), bx.as<float>()};
    dbuf bp; /* the split GEMM's parts (dense_split decides whether the GEMM path splits) */
    CHECK(up(bp, nullptr, sizeof(float) * KSPLIT * (size_t)(n_tok * n_rows)));
    g_kpart = bp.as<float>(), g_kpart_cap = KSPLIT * n_tok * n_rows;
    g_gemm_fast = harness_fast(n_tok);
    const stg_status rc = linear(0, W, w2 ? &W2 : nullptr, g, 1, (int)n_tok, (int)n_tok, in, bo.as<float>(), n_rows,
                                 MODE_STORE, path);
    g_kpart = nullptr, g_kpart_cap = 0;
    CHECK(rc);
    return down(out, bo, sizeof(float) * (size_t)(n_tok * n_rows));
}

/* q / k / v as the attention block runs them: n_seg (2 or 3) weights of rows[i] rows each (w: their
 * rows stacked; uploaded as separate buffers) in one row-segmented launch: path STG_PATH_MATVEC (the
 * fused matvec) or STG_PATH_GEMM (the split GEMM, where dense_split allows n_tok and
 * every segment is whole tiles of 64 rows; else ST_EINVAL). out: each segment's [n_tok, rows[i]]. */
extern "C" stg_status stg_test_linear_seg(int32_t type, int32_t path, const void *w, int32_t n_seg,
                                          const int64_t *rows, int64_t k, const float *x, int64_t n_tok, float *out) {
    const int be = stg_block_elems(type);
    if (!be || stg_is_float(type)) return fail(ST_EUNSUPPORTED, "linear_seg: unsupported quant type %d", type);
    if (!w || !rows || !x || !out || n_seg < 2 || n_seg > 3 || n_tok < 1 || n_tok > KSPLIT_MAX_T || k < 32 ||
        k % 32 || k % be || (path != STG_PATH_MATVEC && path != STG_PATH_GEMM))
        return fail(ST_EINVAL, "linear_seg: bad arguments");
    int64_t total = 0;
    for (int i = 0; i < n_seg; i++) {
        if (rows[i] < 1) return fail(ST_EINVAL, "linear_seg: segment %d has %lld rows", i, (long long)rows[i]);
        total += rows[i];
    }
    CHECK(harness_device());
    const int64_t rb = stg_row_bytes(type, k);
    dbuf bw[3], bo[3], bx, bq, bd, bs, bp;
    lin_seg sg = {};
    sg.n_seg = n_seg;
    for (int i = 0, r0 = 0; i < n_seg; r0 += (int)rows[i], i++) {
        CHECK(up(bw[i], (const uint8_t *)w + r0 * rb, (size_t)(rb * rows[i])));
        CHECK(up(bo[i], nullptr, sizeof(float) * (size_t)(n_tok * rows[i])));
        sg.seg_row[i] = r0, sg.seg_w[i] = bw[i].as<uint8_t>(), sg.seg_out[i] = bo[i].as<float>(), sg.seg_ldo[i] = rows[i];
    }
    sg.seg_row[n_seg] = (int32_t)total;
    dtensor W;
    W.type = type, W.ne[0] = k, W.ne[1] = rows[0], W.row_bytes = rb, W.expert_stride = rb * rows[0];
    W.d = bw[0].as<uint8_t>();
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(quantize(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    lin_groups g = {};
    g.n_pairs = (int32_t)n_tok;
    k256_view kv;
    CHECK(kv.make(n_tok * k));
    const acts_d in{bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>(), bx.as<float>()};
    CHECK(up(bp, nullptr, sizeof(float) * KSPLIT * (size_t)(n_tok * total)));
    g_kpart = bp.as<float>(), g_kpart_cap = KSPLIT * n_tok * total;
    g_gemm_fast = harness_fast(n_tok);
    const stg_status rc = linear(0, W, nullptr, g, 1, (int)n_tok, (int)n_tok, in, bo[0].as<float>(), rows[0],
                                 MODE_STORE, path, &sg);
    g_kpart = nullptr, g_kpart_cap = 0;
    CHECK(rc);
    for (int i = 0; i < n_seg; out += n_tok * rows[i], i++)
        CHECK(down(out, bo[i], sizeof(float) * (size_t)(n_tok * rows[i])));
    return ST_OK;
}

/* Routed experts as a MoE layer runs them: the n_tok * k_used pairs (ids[p]: pair p's expert,
 * p / k_used its token) grouped by k_group, then one grouped launch over the stacked experts
 * w[n_expert][n_rows] (w2: the gate/up form); out[pair, n_rows]. path: STG_PATH_MATVEC or
 * STG_PATH_GEMM; tiles 1: the GEMM's block per tile of group_pairs' list, 0: its grid of
 * (largest group's tiles) x (groups). */
/* stg_test_routed_linear and stg_test_routed_quant: hq / hd / hs (all or none) ask gate/up's launch to quantise
 * its output for the down projection as the step does (the routed split's k_ksplit_routed), and require that
 * it did. */
static stg_status routed_linear(int32_t type, int32_t path, const void *w, const void *w2,
                                int32_t n_expert, int64_t n_rows, int64_t k, const float *x, int32_t n_tok,
                                const int32_t *ids, int32_t k_used, float *out, int8_t *hq, float *hd, int32_t *hs) {
    const int be = stg_block_elems(type);
    if (!be || stg_is_float(type)) return fail(ST_EUNSUPPORTED, "routed linear: unsupported quant type %d", type);
    if (!w || !x || !ids || !out || n_expert < 1 || n_rows < 1 || n_tok < 1 || k_used < 1 || k_used > n_expert ||
        k < 32 || k % 32 || k % be || (path != STG_PATH_MATVEC && path != STG_PATH_GEMM))
        return fail(ST_EINVAL, "routed linear: bad arguments");
    const int32_t P = n_tok * k_used;
    for (int32_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= n_expert) return fail(ST_ERANGE, "routed linear: expert id %d", ids[p]);
    CHECK(harness_device());
    dtensor W;
    W.type = type, W.ne[0] = k, W.ne[1] = n_rows, W.row_bytes = stg_row_bytes(type, k);
    W.expert_stride = W.row_bytes * n_rows;
    const size_t wb = (size_t)(W.expert_stride * n_expert);
    dbuf bw, bw2, bx, bq, bd, bs, bo, bids, bg;
    CHECK(up(bw, w, wb));
    W.d = bw.as<uint8_t>();
    dtensor W2 = W;
    if (w2) {
        CHECK(up(bw2, w2, wb));
        W2.d = bw2.as<uint8_t>();
    }
    CHECK(up_acts(bx, bq, bd, bs, x, n_tok, k));
    CHECK(up(bo, nullptr, sizeof(float) * (size_t)P * (size_t)n_rows));
    CHECK(up(bids, ids, sizeof(int32_t) * (size_t)P));
    /* gexp, gstart, gcount [ne]; n_groups; list, pair_tok [P]; hist [ne]; tiles [P / MM_BN + ne]; n_tiles */
    const int64_t nt_max = (P + MM_BN - 1) / MM_BN + n_expert;
    CHECK(up(bg, nullptr, sizeof(int32_t) * (size_t)(4 * n_expert + 2 * P + nt_max + 2)));
    int32_t *gexp = bg.as<int32_t>(), *gstart = gexp + n_expert, *gcount = gstart + n_expert,
            *n_groups = gcount + n_expert, *list = n_groups + 1, *pair_tok = list + P, *hist = pair_tok + P,
            *gtiles = hist + n_expert, *n_gtiles = gtiles + nt_max;
    CU(cudaMemset(hist, 0, sizeof(int32_t) * (size_t)n_expert), "routed linear");
    CHECK(quantize(0, bx.as<float>(), n_tok, k, bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>()));
    const group_out go = {gexp, gstart, gcount, n_groups, list, pair_tok, hist, gtiles, n_gtiles,
                          nullptr, nullptr, nullptr, nullptr, nullptr, 0};
    k_group<<<1, 1024, 2 * n_expert * sizeof(int32_t)>>>(bids.as<int32_t>(), P, k_used, n_expert, go,
                                                         1); /* the decode router's one-warp grouping */
    LAUNCHED("routed linear: group");
    lin_groups g = {};
    g.gexp = gexp, g.gstart = gstart, g.gcount = gcount, g.n_groups = n_groups, g.list = list, g.in_map = pair_tok;
    g.n_pairs = P;
    g.tiles = gtiles, g.n_tiles = n_gtiles;
    g_gemm_fast = harness_fast(n_tok);
    const int max_groups = std::min(n_expert, P), expected = (P + n_expert - 1) / n_expert;
    k256_view kv;
    CHECK(kv.make((int64_t)n_tok * k));
    const acts_d in{bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>(), bx.as<float>(), n_tok};
    dbuf bp; /* a routed split's parts (routed_split_max decides whether the gate/up GEMM splits) */
    CHECK(up(bp, nullptr, sizeof(float) * KSPLIT * 2 * (size_t)P * (size_t)n_rows));
    g_kpart = bp.as<float>(), g_kpart_cap = KSPLIT * 2 * (int64_t)P * n_rows;
    const size_t no = (size_t)P * (size_t)n_rows;
    dbuf bhq, bhd, bhs;
    bool done = false;
    fused_quant fq{nullptr, nullptr, nullptr, &done};
    if (hq) {
        CHECK(up(bhq, nullptr, no));
        CHECK(up(bhd, nullptr, sizeof(float) * no / 32));
        CHECK(up(bhs, nullptr, sizeof(int32_t) * no / 16));
        CU(cudaMemset(bhq.p, 0x7f, no), "routed linear");
        fq.q = bhq.as<int8_t>(), fq.d = bhd.as<float>(), fq.s = bhs.as<int32_t>();
    }
    const stg_status rc = linear(0, W, w2 ? &W2 : nullptr, g, max_groups, expected, n_tok, in, bo.as<float>(), n_rows,
                                 MODE_STORE, path, nullptr, hq ? &fq : nullptr);
    g_kpart = nullptr, g_kpart_cap = 0;
    CHECK(rc);
    if (hq && !done) return fail(ST_EINVAL, "routed linear: the launch did not quantise its output");
    CHECK(down(out, bo, sizeof(float) * no));
    if (!hq) return ST_OK;
    CHECK(down(hq, bhq, no));
    CHECK(down(hd, bhd, sizeof(float) * no / 32));
    return down(hs, bhs, sizeof(int32_t) * no / 16);
}
extern "C" stg_status stg_test_routed_linear(int32_t type, int32_t path, const void *w, const void *w2,
                                             int32_t n_expert, int64_t n_rows, int64_t k, const float *x, int32_t n_tok,
                                             const int32_t *ids, int32_t k_used, float *out) {
    return routed_linear(type, path, w, w2, n_expert, n_rows, k, x, n_tok, ids, k_used, out, nullptr, nullptr,
                         nullptr);
}
extern "C" stg_status stg_test_routed_quant(int32_t type, const void *w, const void *w2, int32_t n_expert,
                                            int64_t n_rows, int64_t k, const float *x, int32_t n_tok, const int32_t *ids,
                                            int32_t k_used, float *out, int8_t *hq, float *hd, int32_t *hs) {
    if (!w2 || !hq || !hd || !hs || n_rows % 32) return fail(ST_EINVAL, "routed quant: bad arguments");
    return routed_linear(type, STG_PATH_GEMM, w, w2, n_expert, n_rows, k, x, n_tok, ids, k_used, out, hq, hd, hs);
}

extern "C" stg_status stg_test_routed_chunk_quant(int32_t type, const void *w, const void *w2, int32_t n_expert,
                                                  int64_t n_rows, int64_t k, const float *x, int32_t n_tok,
                                                  const int32_t *ids, int32_t k_used, float *out, int8_t *hq, float *hd,
                                                  int32_t *hs) {
    if (!w2 || !hq || !hd || !hs || n_rows % 32) return fail(ST_EINVAL, "routed chunk quant: bad arguments");
    return routed_linear(type, STG_PATH_MATVEC, w, w2, n_expert, n_rows, k, x, n_tok, ids, k_used, out, hq, hd, hs);
}

extern "C" stg_status stg_test_attention(int32_t path, const uint16_t *k, const uint16_t *v, int32_t n_blocks,
                                         const int32_t *block_table, int32_t n_table, int32_t block_size,
                                         int32_t head_dim, int32_t n_kv, int32_t kv_head, const float *q, int32_t nq,
                                         int32_t p0, float *out) {
    if (!k || !v || !block_table || !q || !out || n_blocks < 1 || block_size < 16 || block_size % 16 ||
        head_dim < 16 || head_dim % 16 || head_dim > 256 || n_kv < 1 || kv_head < 0 || kv_head >= n_kv || nq < 1 ||
        p0 < 0 || (p0 + nq - 1) / block_size >= n_table)
        return fail(ST_EINVAL, "attention: bad arguments");
    for (int32_t j = 0; j <= (p0 + nq - 1) / block_size; j++)
        if (block_table[j] < 0 || block_table[j] >= n_blocks) return fail(ST_ERANGE, "attention: block out of range");
    CHECK(harness_device());
    const int64_t kd = (int64_t)n_kv * head_dim, cache = (int64_t)n_blocks * block_size * kd;
    /* the heads of every kv group but kv_head's first get zero queries */
    std::vector<float> qf((size_t)(nq * kd), 0.0f);
    std::vector<int32_t> ints((size_t)(2 * nq + n_table));
    for (int i = 0; i < nq; i++) {
        memcpy(&qf[(size_t)(i * kd + kv_head * head_dim)], q + (int64_t)i * head_dim, sizeof(float) * head_dim);
        ints[(size_t)i] = p0 + i;
        ints[(size_t)(nq + i)] = 0;
    }
    memcpy(&ints[(size_t)(2 * nq)], block_table, sizeof(int32_t) * n_table);
    dbuf bk, bv, bq, bo, bi, bsc;
    CHECK(up(bk, k, sizeof(uint16_t) * cache));
    CHECK(up(bv, v, sizeof(uint16_t) * cache));
    CHECK(up(bq, qf.data(), sizeof(float) * qf.size()));
    CHECK(up(bo, nullptr, sizeof(float) * qf.size()));
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    attn_args a = {};
    a.q = bq.as<float>(), a.out = bo.as<float>(), a.kc = bk.as<__half>(), a.vc = bv.as<__half>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + nq, a.block_tables = bi.as<int32_t>() + 2 * nq;
    a.max_blocks = n_table, a.n_head = n_kv, a.n_kv = n_kv, a.hd = head_dim, a.block_size = block_size;
    if (path == STG_PATH_REF) {
        CHECK(up(bsc, nullptr, sizeof(float) * (size_t)(nq * n_kv) * (size_t)(p0 + nq)));
        k_attention_ref<false><<<nq, n_kv>>>(a, bsc.as<float>(), p0 + nq);
        LAUNCHED("attention");
    } else {
        CHECK(attention_setup(device_smem_optin(0)));
        CHECK(launch_attention(a, nq, 0));
    }
    std::vector<float> o(qf.size());
    CHECK(down(o.data(), bo, sizeof(float) * o.size()));
    for (int i = 0; i < nq; i++)
        memcpy(out + (int64_t)i * head_dim, &o[(size_t)(i * kd + kv_head * head_dim)], sizeof(float) * head_dim);
    return ST_OK;
}

/* Every query head of one sequence's nq tokens at positions p0.. (q[nq, n_head * hd], pre-scaled)
 * through k_attention (tile 0), k_attention_tile (tile 1, as an eager prefill step would run
 * it) or k_attention_mma (tile 2: q as f16 hi + lo, 3: as one f16; the form amma_pick gives the (assumed) opt-in
 * limit), out[nq, n_head * hd]; with aq/ad/as also the output's 8-bit blocks (hd % 32 == 0). */
extern "C" stg_status stg_test_attention_heads(int32_t tile, const uint16_t *k, const uint16_t *v, int32_t n_blocks,
                                               const int32_t *block_table, int32_t n_table, int32_t block_size,
                                               int32_t head_dim, int32_t n_head, int32_t n_kv, const float *q,
                                               int32_t nq, int32_t p0, float *out, int8_t *aq, float *ad, int32_t *as) {
    if (!k || !v || !block_table || !q || !out || tile < 0 || tile > 3 || n_blocks < 1 || block_size < 16 ||
        block_size % 16 || head_dim < 16 || head_dim % 16 || head_dim > 256 || n_kv < 1 || n_head < n_kv || n_head % n_kv || nq < 1 ||
        p0 < 0 || (p0 + nq - 1) / block_size >= n_table || ((aq || ad || as) && (!aq || !ad || !as || head_dim % 32)))
        return fail(ST_EINVAL, "attention heads: bad arguments");
    for (int32_t j = 0; j <= (p0 + nq - 1) / block_size; j++)
        if (block_table[j] < 0 || block_table[j] >= n_blocks) return fail(ST_ERANGE, "attention: block out of range");
    const int tq = att_tile_tokens(n_head, n_kv, head_dim);
    if (tile && !tq) return fail(ST_EUNSUPPORTED, "attention tiles: n_head %d / n_kv %d / head_dim %d", n_head, n_kv,
                                 head_dim);
    CHECK(harness_device());
    const int64_t kd = (int64_t)n_kv * head_dim, cache = (int64_t)n_blocks * block_size * kd;
    const int64_t qd = (int64_t)n_head * head_dim, nout = (int64_t)nq * qd;
    std::vector<int32_t> ints((size_t)(3 * nq + n_table));
    for (int i = 0; i < nq; i++) ints[(size_t)i] = p0 + i, ints[(size_t)(nq + i)] = 0;
    memcpy(&ints[(size_t)(2 * nq)], block_table, sizeof(int32_t) * n_table);
    int32_t n_tiles = 0, n_mma = 0;
    const int optin = device_smem_optin(0);
    if (tile >= 2) {
        const int tqm = att_mma_tokens(n_head, n_kv, head_dim, amma_pick(head_dim, optin).rows);
        if (!tqm)
            return fail(ST_EUNSUPPORTED, "attention (mma): n_head %d / n_kv %d / head_dim %d in %d bytes of shared memory",
                        n_head, n_kv, head_dim, optin);
        att_split_tiles(&ints[(size_t)nq], nq, tq, tqm, 1, &ints[(size_t)(2 * nq + n_table)], &n_tiles, &n_mma);
    }
    else if (tile) n_tiles = att_tiles(&ints[(size_t)nq], nq, tq, &ints[(size_t)(2 * nq + n_table)]);
    dbuf bk, bv, bq, bo, bi, baq, bad, bas;
    CHECK(up(bk, k, sizeof(uint16_t) * cache));
    CHECK(up(bv, v, sizeof(uint16_t) * cache));
    CHECK(up(bq, q, sizeof(float) * nout));
    CHECK(up(bo, nullptr, sizeof(float) * nout));
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    attn_args a = {};
    a.q = bq.as<float>(), a.out = bo.as<float>(), a.kc = bk.as<__half>(), a.vc = bv.as<__half>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + nq, a.block_tables = bi.as<int32_t>() + 2 * nq;
    a.max_blocks = n_table, a.n_head = n_head, a.n_kv = n_kv, a.hd = head_dim, a.block_size = block_size;
    if (aq) {
        CHECK(up(baq, nullptr, (size_t)nout));
        CHECK(up(bad, nullptr, sizeof(float) * (size_t)nout / 32));
        CHECK(up(bas, nullptr, sizeof(int32_t) * (size_t)nout / 16));
        a.aq = baq.as<int8_t>(), a.ad = bad.as<float>(), a.as = bas.as<int32_t>();
    }
    CHECK(attention_setup(optin));
    if (tile >= 2) {
        CHECK(launch_attention_mma(a, bi.as<int32_t>() + 2 * nq + n_table, n_mma, tile == 3 ? 1 : 2, optin, 0));
    } else if (tile) {
        a.stages = 2;
        CHECK(launch_attention_tile(a, bi.as<int32_t>() + 2 * nq + n_table, n_tiles, 0));
    } else {
        CHECK(launch_attention(a, nq, 0));
    }
    CHECK(down(out, bo, sizeof(float) * nout));
    if (aq) {
        CHECK(down(aq, baq, (size_t)nout));
        CHECK(down(ad, bad, sizeof(float) * (size_t)nout / 32));
        CHECK(down(as, bas, sizeof(int32_t) * (size_t)nout / 16));
    }
    return ST_OK;
}

static thread_local std::vector<float> g_oss_sinks; /* stg_test_attention_oss's */
static thread_local int32_t g_oss_swa = 0;
extern "C" stg_status stg_test_attention_decode(int32_t split_min, int32_t split_chunks, int32_t split_max,
                                                const uint16_t *k, const uint16_t *v, int32_t n_blocks,
                                                const int32_t *block_tables, int32_t n_table, int32_t block_size,
                                                int32_t head_dim, int32_t n_head, int32_t n_kv, const float *q,
                                                const int32_t *pos, int32_t n_seq, float *out, int8_t *aq, float *ad,
                                                int32_t *as, int32_t *n_splits) {
    if (!k || !v || !block_tables || !q || !pos || !out || split_min < 0 || split_max > ATT_SPLIT_MAX ||
        n_blocks < 1 || n_table < 1 || block_size < 16 || block_size % 16 || head_dim < 16 || head_dim % 16 ||
        head_dim > 256 || n_kv < 1 || n_head < n_kv || n_head % n_kv || n_seq < 1 ||
        ((aq || ad || as) && (!aq || !ad || !as || head_dim % 32)))
        return fail(ST_EINVAL, "attention decode: bad arguments");
    for (int32_t i = 0; i < n_seq; i++) {
        if (pos[i] < 0 || pos[i] / block_size >= n_table) return fail(ST_ERANGE, "attention decode: position %d", pos[i]);
        for (int32_t j = 0; j <= pos[i] / block_size; j++) {
            const int32_t b = block_tables[(int64_t)i * n_table + j];
            if (b < 0 || b >= n_blocks) return fail(ST_ERANGE, "attention decode: block out of range");
        }
    }
    const bool oss = !g_oss_sinks.empty() || g_oss_swa > 0;
    if (oss && (split_min || (!g_oss_sinks.empty() && (int32_t)g_oss_sinks.size() != n_head)))
        return fail(ST_EINVAL, "attention decode: sinks of %d heads for %d, or a split asked with sinks / a window",
                    (int)g_oss_sinks.size(), n_head);
    if (split_min && !att_split_ok(n_head, n_kv, head_dim))
        return fail(ST_EUNSUPPORTED, "split attention: n_head %d / n_kv %d / head_dim %d", n_head, n_kv, head_dim);
    CHECK(harness_device());
    int n_sm = 0;
    CU(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0), "harness");
    const int32_t chunks = split_chunks > 0 ? split_chunks : ATT_SPLIT_CHUNKS;
    const int32_t zmax = split_max > 0 ? split_max : att_split_zmax(n_sm, n_kv);
    const int32_t z = att_split_depth((int64_t)n_table * block_size, chunks, zmax, n_head / n_kv);
    const int64_t kd = (int64_t)n_kv * head_dim, cache = (int64_t)n_blocks * block_size * kd;
    const int64_t qd = (int64_t)n_head * head_dim, nout = (int64_t)n_seq * qd, rows = (int64_t)n_seq * n_head * z;
    std::vector<int32_t> ints((size_t)(2 * n_seq) + (size_t)n_seq * n_table);
    for (int32_t i = 0; i < n_seq; i++) ints[(size_t)i] = pos[i], ints[(size_t)(n_seq + i)] = i;
    memcpy(&ints[(size_t)(2 * n_seq)], block_tables, sizeof(int32_t) * (size_t)n_seq * n_table);
    dbuf bk, bv, bq, bo, bi, baq, bad, bas, bpa, bpm, bsk;
    CHECK(up(bk, k, sizeof(uint16_t) * cache));
    CHECK(up(bv, v, sizeof(uint16_t) * cache));
    CHECK(up(bq, q, sizeof(float) * nout));
    CHECK(up(bo, nullptr, sizeof(float) * nout));
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    attn_args a = {};
    a.q = bq.as<float>(), a.out = bo.as<float>(), a.kc = bk.as<__half>(), a.vc = bv.as<__half>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + n_seq, a.block_tables = bi.as<int32_t>() + 2 * n_seq;
    a.max_blocks = n_table, a.n_head = n_head, a.n_kv = n_kv, a.hd = head_dim, a.block_size = block_size;
    if (!g_oss_sinks.empty()) {
        CHECK(up(bsk, g_oss_sinks.data(), sizeof(float) * g_oss_sinks.size()));
        a.sinks = bsk.as<float>();
    }
    a.n_swa = g_oss_swa;
    if (aq) {
        CHECK(up(baq, nullptr, (size_t)nout));
        CHECK(up(bad, nullptr, sizeof(float) * (size_t)nout / 32));
        CHECK(up(bas, nullptr, sizeof(int32_t) * (size_t)nout / 16));
        a.aq = baq.as<int8_t>(), a.ad = bad.as<float>(), a.as = bas.as<int32_t>();
    }
    CHECK(attention_setup(device_smem_optin(0)));
    if (split_min) {
        CHECK(up(bpa, nullptr, sizeof(float) * (size_t)rows * (size_t)head_dim));
        CHECK(up(bpm, nullptr, sizeof(float) * (size_t)rows * 2));
        a.part_acc = bpa.as<float>(), a.part_ml = bpm.as<float>();
        a.split_min = split_min, a.split_chunks = chunks, a.split_max = zmax;
        CHECK(launch_attention_split(a, n_seq, z, device_smem_optin(0), 0));
    } else {
        CHECK(launch_attention(a, n_seq, 0));
    }
    CHECK(down(out, bo, sizeof(float) * nout));
    if (aq) {
        CHECK(down(aq, baq, (size_t)nout));
        CHECK(down(ad, bad, sizeof(float) * (size_t)nout / 32));
        CHECK(down(as, bas, sizeof(int32_t) * (size_t)nout / 16));
    }
    for (int32_t i = 0; n_splits && i < n_seq; i++)
        n_splits[i] = split_min ? att_split_count(pos[i] + 1, split_min, chunks, zmax) : 1;
    return ST_OK;
}

extern "C" stg_status stg_test_attention_oss(const float *sinks, int32_t n_head, int32_t n_swa) {
    if (n_swa < 0 || (sinks && (n_head < 1 || n_head > 1024))) return fail(ST_EINVAL, "attention oss: bad arguments");
    g_oss_sinks.clear();
    if (sinks) g_oss_sinks.assign(sinks, sinks + n_head);
    g_oss_swa = n_swa;
    return ST_OK;
}

extern "C" stg_status stg_test_attention_q8(int32_t mode, int32_t split_min, int32_t split_chunks, int32_t split_max,
                                            const int8_t *k8, const uint16_t *ks, const int8_t *v8, const uint16_t *vs,
                                            int32_t n_blocks, const int32_t *block_tables, int32_t n_seqs,
                                            int32_t n_table, int32_t block_size, int32_t head_dim, int32_t n_head,
                                            int32_t n_kv, const float *q, const int32_t *pos, const int32_t *seq,
                                            int32_t n_tok, float *out, int32_t *n_splits) {
    if (!k8 || !ks || !v8 || !vs || !block_tables || !q || !pos || !seq || !out || mode < 0 || mode > 2 ||
        split_min < 0 || split_max > ATT_SPLIT_MAX || n_blocks < 1 || n_seqs < 1 || n_table < 1 || block_size < 16 ||
        block_size % 16 || (head_dim != 64 && head_dim != 128) || n_kv < 1 || n_head < n_kv || n_head % n_kv ||
        n_tok < 1)
        return fail(ST_EINVAL, "attention (8-bit KV): bad arguments");
    if (!att_split_ok(n_head, n_kv, head_dim) || !att_mma_tokens(n_head, n_kv, head_dim, 64))
        return fail(ST_EUNSUPPORTED, "attention (8-bit KV): n_head %d / n_kv %d", n_head, n_kv);
    int32_t max_keys = 0;
    std::vector<char> seen((size_t)n_seqs, 0);
    for (int32_t i = 0; i < n_tok; i++) {
        if (seq[i] < 0 || seq[i] >= n_seqs || pos[i] < 0 || pos[i] / block_size >= n_table)
            return fail(ST_ERANGE, "attention (8-bit KV): token %d (sequence %d, position %d)", i, seq[i], pos[i]);
        if (mode == 1 && seen[(size_t)seq[i]]++)
            return fail(ST_EINVAL, "attention (8-bit KV): the split path takes one token per sequence");
        if (mode >= 2 && i > 0 && seq[i] == seq[i - 1] && pos[i] != pos[i - 1] + 1)
            return fail(ST_EINVAL, "attention (8-bit KV): a sequence's prefill tokens are consecutive");
        for (int32_t j = 0; j <= pos[i] / block_size; j++) {
            const int32_t b = block_tables[(int64_t)seq[i] * n_table + j];
            if (b < 0 || b >= n_blocks) return fail(ST_ERANGE, "attention (8-bit KV): block out of range");
        }
        max_keys = std::max(max_keys, pos[i] + 1);
    }
    CHECK(harness_device());
    const int optin = device_smem_optin(0);
    if (mode > 0) CHECK(kv_q8_device_check(head_dim, optin, "attention (8-bit KV)")); /* stg_kv_create_tiered's */
    int n_sm = 0;
    CU(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0), "harness");
    const int32_t chunks = split_chunks > 0 ? split_chunks : ATT_SPLIT_CHUNKS;
    const int32_t zmax = split_max > 0 ? split_max : att_split_zmax(n_sm, n_kv);
    const int32_t smin = split_min > 0 ? split_min : INT32_MAX;
    const int32_t z = att_split_bound((int64_t)n_table * block_size, chunks, zmax);
    const int64_t kd = (int64_t)n_kv * head_dim, cache = (int64_t)n_blocks * block_size * kd;
    const int64_t qd = (int64_t)n_head * head_dim, nout = (int64_t)n_tok * qd, rows = (int64_t)n_tok * n_head * z;
    const int64_t n_bt = (int64_t)n_seqs * n_table;
    std::vector<int32_t> ints((size_t)(3 * n_tok + n_bt));
    for (int32_t i = 0; i < n_tok; i++) ints[(size_t)i] = pos[i], ints[(size_t)(n_tok + i)] = seq[i];
    memcpy(&ints[(size_t)(2 * n_tok)], block_tables, sizeof(int32_t) * (size_t)n_bt);
    int32_t n_qt = 0, n_mma = 0;
    if (mode == 2) {
        const int tqm = att_mma_tokens(n_head, n_kv, head_dim, amma_pick(head_dim, optin).rows);
        if (!tqm) return fail(ST_EUNSUPPORTED, "attention (8-bit KV): no prefill form in %d bytes of shared memory", optin);
        att_split_tiles(seq, n_tok, att_tile_tokens(n_head, n_kv, head_dim), tqm, 1, &ints[(size_t)(2 * n_tok + n_bt)],
                        &n_qt, &n_mma);
    }
    dbuf bk, bks, bv, bvs, bq, bo, bi, bsc, bpa, bpm;
    CHECK(up(bk, k8, (size_t)cache));
    CHECK(up(bks, ks, sizeof(uint16_t) * (size_t)(cache / 32)));
    CHECK(up(bv, v8, (size_t)cache));
    CHECK(up(bvs, vs, sizeof(uint16_t) * (size_t)(cache / 32)));
    CHECK(up(bq, q, sizeof(float) * (size_t)nout));
    CHECK(up(bo, nullptr, sizeof(float) * (size_t)nout));
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    attn_args a = {};
    a.q = bq.as<float>(), a.out = bo.as<float>();
    a.k8 = bk.as<int8_t>(), a.ks = bks.as<__half>(), a.v8 = bv.as<int8_t>(), a.vs = bvs.as<__half>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + n_tok, a.block_tables = bi.as<int32_t>() + 2 * n_tok;
    a.max_blocks = n_table, a.n_head = n_head, a.n_kv = n_kv, a.hd = head_dim, a.block_size = block_size;
    CHECK(attention_setup(optin));
    if (mode == 0) {
        CHECK(up(bsc, nullptr, sizeof(float) * (size_t)n_tok * (size_t)n_head * (size_t)max_keys));
        k_attention_ref<true><<<n_tok, n_head>>>(a, bsc.as<float>(), max_keys);
        LAUNCHED("attention (8-bit KV, reference)");
    } else if (mode == 1) {
        CHECK(up(bpa, nullptr, sizeof(float) * (size_t)rows * (size_t)head_dim));
        CHECK(up(bpm, nullptr, sizeof(float) * (size_t)rows * 2));
        a.part_acc = bpa.as<float>(), a.part_ml = bpm.as<float>();
        a.split_min = smin, a.split_chunks = chunks, a.split_max = zmax;
        CHECK(launch_attention_split(a, n_tok, z, optin, 0));
    } else {
        if (n_qt) return fail(ST_EINVAL, "attention (8-bit KV): query tiles in an mma-only tile list");
        CHECK(launch_attention_mma(a, bi.as<int32_t>() + 2 * n_tok + n_bt, n_mma, 2, optin, 0));
    }
    CHECK(down(out, bo, sizeof(float) * (size_t)nout));
    for (int32_t i = 0; n_splits && i < n_tok; i++)
        n_splits[i] = mode == 1 ? att_split_count(pos[i] + 1, smin, chunks, zmax) : 1;
    return ST_OK;
}

extern "C" stg_status stg_test_kv_store_q8(const float *k, const float *v, int32_t n_tok, int32_t n_kv,
                                           int32_t head_dim, int32_t block_size, int32_t n_blocks, const int32_t *slots,
                                           int8_t *k8, uint16_t *ks, int8_t *v8, uint16_t *vs) {
    if (!k || !v || !slots || !k8 || !ks || !v8 || !vs || n_tok < 1 || n_kv < 1 || head_dim < 32 || head_dim % 32 ||
        head_dim > 256 || block_size < 16 || block_size % 16 || n_blocks < 1)
        return fail(ST_EINVAL, "kv store (8-bit): bad arguments");
    for (int32_t i = 0; i < n_tok; i++)
        if (slots[i] < 0 || slots[i] / block_size >= n_blocks) return fail(ST_ERANGE, "kv store (8-bit): slot %d", slots[i]);
    CHECK(harness_device());
    const int64_t kd = (int64_t)n_kv * head_dim, cache = (int64_t)n_blocks * block_size * kd;
    /* token i: sequence i at position slots[i] % block_size of its one-block table {slots[i] / block_size} */
    std::vector<int32_t> ints((size_t)(3 * n_tok));
    for (int32_t i = 0; i < n_tok; i++)
        ints[(size_t)i] = slots[i] % block_size, ints[(size_t)(n_tok + i)] = i, ints[(size_t)(2 * n_tok + i)] = slots[i] / block_size;
    std::vector<float> qz((size_t)(n_tok * head_dim), 0.0f);
    dbuf bq, bk, bv, bi, bk8, bks, bv8, bvs;
    CHECK(up(bq, qz.data(), sizeof(float) * qz.size()));
    CHECK(up(bk, k, sizeof(float) * (size_t)(n_tok * kd)));
    CHECK(up(bv, v, sizeof(float) * (size_t)(n_tok * kd)));
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    CHECK(up(bk8, nullptr, (size_t)cache));
    CHECK(up(bks, nullptr, sizeof(uint16_t) * (size_t)(cache / 32)));
    CHECK(up(bv8, nullptr, (size_t)cache));
    CHECK(up(bvs, nullptr, sizeof(uint16_t) * (size_t)(cache / 32)));
    CU(cudaMemset(bk8.p, 0, (size_t)cache), "kv store (8-bit)");
    CU(cudaMemset(bv8.p, 0, (size_t)cache), "kv store (8-bit)");
    CU(cudaMemset(bks.p, 0, sizeof(uint16_t) * (size_t)(cache / 32)), "kv store (8-bit)");
    CU(cudaMemset(bvs.p, 0, sizeof(uint16_t) * (size_t)(cache / 32)), "kv store (8-bit)");
    qkv_args a = {};
    a.q = bq.as<float>(), a.k = bk.as<float>(), a.v = bv.as<float>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + n_tok, a.block_tables = bi.as<int32_t>() + 2 * n_tok;
    a.max_blocks = 1, a.n_head = 1, a.n_kv = n_kv, a.hd = head_dim, a.rope_dim = 0, a.rope_type = 0;
    a.block_size = block_size, a.eps = 1e-6f, a.scale = 1.0f;
    a.k8 = bk8.as<int8_t>(), a.v8 = bv8.as<int8_t>(), a.ks = bks.as<__half>(), a.vs = bvs.as<__half>();
    k_qkv_post<<<dim3((unsigned)n_tok, (unsigned)((1 + 2 * n_kv + QKV_WARPS - 1) / QKV_WARPS)), QKV_WARPS * 32>>>(a);
    LAUNCHED("kv store (8-bit)");
    CHECK(down(k8, bk8, (size_t)cache));
    CHECK(down(ks, bks, sizeof(uint16_t) * (size_t)(cache / 32)));
    CHECK(down(v8, bv8, (size_t)cache));
    return down(vs, bvs, sizeof(uint16_t) * (size_t)(cache / 32));
}

extern "C" stg_status stg_test_rmsnorm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y) {
    if (!x || !w || !y || n_rows < 1 || n < 1) return fail(ST_EINVAL, "rmsnorm: bad arguments");
    CHECK(harness_device());
    dbuf bx, bw, by;
    CHECK(up(bx, x, sizeof(float) * (size_t)(n_rows * n)));
    CHECK(up(bw, w, sizeof(float) * (size_t)n));
    CHECK(up(by, nullptr, sizeof(float) * (size_t)(n_rows * n)));
    k_rmsnorm<<<(unsigned)n_rows, RMS_THREADS>>>(bx.as<float>(), nullptr, bw.as<float>(), by.as<float>(), n, eps, nullptr,
                                          nullptr, nullptr, combine_args{});
    LAUNCHED("rmsnorm");
    return down(y, by, sizeof(float) * (size_t)(n_rows * n));
}

/* RoPE alone: k_qkv_post with no norms or biases and a q scale of 1 (its K/V go to a
 * scratch cache: token i owns blocks i*nb .. i*nb+nb-1). */
extern "C" stg_status stg_test_rope(float *x, const int32_t *pos, int32_t n_tok, int32_t n_heads, int32_t head_dim,
                                    int32_t rope_dim, int32_t rope_type, float rope_base) {
    if (!x || !pos || n_tok < 1 || n_heads < 1 || head_dim < 2 || rope_dim < 2 || rope_dim > head_dim ||
        rope_dim % 2 || (rope_type != ST_ROPE_NORM && rope_type != ST_ROPE_NEOX))
        return fail(ST_EINVAL, "rope: bad arguments");
    int32_t max_pos = 0;
    for (int i = 0; i < n_tok; i++) {
        if (pos[i] < 0 || pos[i] > (1 << 20)) return fail(ST_ERANGE, "rope: position %d out of range", pos[i]);
        max_pos = std::max(max_pos, pos[i]);
    }
    CHECK(harness_device());
    const int bs = 16, nb = max_pos / bs + 1;
    std::vector<float> inv((size_t)rope_dim / 2);
    for (int i = 0; i < rope_dim / 2; i++)
        inv[(size_t)i] = (float)(1.0 / pow((double)rope_base, (double)(2 * i) / (double)rope_dim));
    const int64_t qd = (int64_t)n_heads * head_dim;
    std::vector<int32_t> ints((size_t)(2 * n_tok + n_tok * nb));
    for (int i = 0; i < n_tok; i++) {
        ints[(size_t)i] = pos[i], ints[(size_t)(n_tok + i)] = i;
        for (int j = 0; j < nb; j++) ints[(size_t)(2 * n_tok + i * nb + j)] = i * nb + j;
    }
    const size_t cache = sizeof(__half) * (size_t)n_tok * nb * bs * head_dim;
    dbuf bq, bk, bv, bi, bf, bkc, bvc;
    CHECK(up(bq, x, sizeof(float) * (size_t)(n_tok * qd)));
    CHECK(up(bk, nullptr, sizeof(float) * (size_t)(n_tok * head_dim)));
    CHECK(up(bv, nullptr, sizeof(float) * (size_t)(n_tok * head_dim)));
    CU(cudaMemset(bk.p, 0, sizeof(float) * (size_t)(n_tok * head_dim)), "rope");
    CU(cudaMemset(bv.p, 0, sizeof(float) * (size_t)(n_tok * head_dim)), "rope");
    CHECK(up(bi, ints.data(), sizeof(int32_t) * ints.size()));
    CHECK(up(bf, inv.data(), sizeof(float) * inv.size()));
    CHECK(up(bkc, nullptr, cache));
    CHECK(up(bvc, nullptr, cache));
    qkv_args a = {};
    a.q = bq.as<float>(), a.k = bk.as<float>(), a.v = bv.as<float>(), a.inv_freq = bf.as<float>();
    a.pos = bi.as<int32_t>(), a.seq = bi.as<int32_t>() + n_tok, a.block_tables = bi.as<int32_t>() + 2 * n_tok;
    a.max_blocks = nb, a.n_head = n_heads, a.n_kv = 1, a.hd = head_dim, a.rope_dim = rope_dim, a.rope_type = rope_type;
    a.block_size = bs, a.eps = 1e-6f, a.scale = 1.0f, a.mscale = 1.0f, a.kc = bkc.as<__half>(), a.vc = bvc.as<__half>();
    k_qkv_post<<<dim3((unsigned)n_tok, (unsigned)((n_heads + 2 + QKV_WARPS - 1) / QKV_WARPS)), QKV_WARPS * 32>>>(a);
    LAUNCHED("rope");
    return down(x, bq, sizeof(float) * (size_t)(n_tok * qd));
}

extern "C" stg_status stg_test_router(const float *logits, int32_t n_tok, int32_t n_expert, int32_t k, int32_t *ids,
                                      float *w) {
    if (!logits || !ids || !w || n_tok < 1 || n_expert < 1 || k < 1 || k > n_expert)
        return fail(ST_EINVAL, "router: bad arguments");
    CHECK(harness_device());
    dbuf bl, bi, bw, bp;
    CHECK(up(bl, logits, sizeof(float) * (size_t)n_tok * n_expert));
    CHECK(up(bi, nullptr, sizeof(int32_t) * (size_t)n_tok * k));
    CHECK(up(bw, nullptr, sizeof(float) * (size_t)n_tok * k));
    CHECK(up(bp, nullptr, sizeof(float) * (size_t)n_tok * n_expert));
    k_router<<<(n_tok + ROUTER_WARPS - 1) / ROUTER_WARPS, ROUTER_WARPS * 32, ROUTER_WARPS * n_expert * sizeof(float)>>>(
        bl.as<float>(), n_tok, n_expert, k, bi.as<int32_t>(), bw.as<float>(), 1);
    LAUNCHED("router");
    CHECK(down(ids, bi, sizeof(int32_t) * (size_t)n_tok * k));
    return down(w, bw, sizeof(float) * (size_t)n_tok * k);
}

extern "C" stg_status stg_test_route_rule(const float *logits, int32_t n_tok, int32_t n_expert, int32_t k,
                                          int32_t gating, int32_t n_group, int32_t n_group_used, const float *bias,
                                          int32_t form, int32_t *ids, float *w) {
    if (!logits || !ids || !w || n_tok < 1 || n_expert < 1 || n_expert > 1024 || k < 1 || k > n_expert ||
        (gating != ST_GATING_SOFTMAX && gating != ST_GATING_SIGMOID) || form < 0 || form > 1 || (form == 1 && n_tok > 64))
        return fail(ST_EINVAL, "route rule: bad arguments");
    if (n_group > 1 && (n_expert % n_group || n_group_used < 1 || n_group_used > n_group))
        return fail(ST_EINVAL, "route rule: %d groups with %d used for %d experts", n_group, n_group_used, n_expert);
    CHECK(harness_device());
    route_rule rr;
    rr.ne = n_expert, rr.k = k, rr.gating = gating;
    rr.n_group = n_group > 1 ? n_group : 1, rr.n_group_used = n_group > 1 ? n_group_used : 1;
    dbuf bl, bi, bw, bb;
    CHECK(up(bl, logits, sizeof(float) * (size_t)n_tok * n_expert));
    CHECK(up(bi, nullptr, sizeof(int32_t) * (size_t)n_tok * k));
    CHECK(up(bw, nullptr, sizeof(float) * (size_t)n_tok * k));
    if (bias) CHECK(up(bb, bias, sizeof(float) * (size_t)n_expert));
    rr.bias = bias ? bb.as<float>() : nullptr;
    const size_t scr = (size_t)rule_scratch(rr) * sizeof(float);
    if (form == 0) {
        k_route_rule<<<(n_tok + RULE_WARPS - 1) / RULE_WARPS, RULE_WARPS * 32, RULE_WARPS * scr>>>(
            bl.as<float>(), n_tok, rr, bi.as<int32_t>(), bw.as<float>());
    } else {
        const int32_t P = n_tok * k;
        dbuf g[9];
        const size_t sz[9] = {(size_t)n_expert, (size_t)n_expert, (size_t)n_expert, 1, (size_t)P, (size_t)P,
                              (size_t)n_expert, (size_t)(P + n_expert), 1};
        for (int i = 0; i < 9; i++) CHECK(up(g[i], nullptr, sizeof(int32_t) * sz[i]));
        CU(cudaMemset(g[6].p, 0, sizeof(int32_t) * (size_t)n_expert), "route rule");
        const group_out go = {g[0].as<int32_t>(), g[1].as<int32_t>(), g[2].as<int32_t>(), g[3].as<int32_t>(),
                              g[4].as<int32_t>(), g[5].as<int32_t>(), g[6].as<int32_t>(), g[7].as<int32_t>(),
                              g[8].as<int32_t>(), nullptr, nullptr, nullptr, nullptr, nullptr, 0};
        k_route_rule_group<<<1, RULE_GROUP_WARPS * 32, RULE_GROUP_WARPS * scr + 2 * (size_t)n_expert * sizeof(int32_t)>>>(
            bl.as<float>(), n_tok, rr, bi.as<int32_t>(), bw.as<float>(), go);
    }
    LAUNCHED("route rule");
    CHECK(down(ids, bi, sizeof(int32_t) * (size_t)n_tok * k));
    return down(w, bw, sizeof(float) * (size_t)n_tok * k);
}

extern "C" stg_status stg_test_argmax(const float *x, int32_t rows, int64_t n, int32_t misalign, int32_t *out) {
    if (!x || !out || rows < 1 || n < 1 || n > INT32_MAX || misalign < 0 || misalign > 3)
        return fail(ST_EINVAL, "argmax: bad arguments");
    CHECK(harness_device());
    dbuf bx, bo;
    CHECK(up(bx, nullptr, sizeof(float) * ((size_t)rows * n + 3)));
    CU(cudaMemcpy(bx.as<float>() + misalign, x, sizeof(float) * (size_t)rows * n, cudaMemcpyHostToDevice), "harness upload");
    CHECK(up(bo, nullptr, sizeof(int32_t) * (size_t)rows));
    dbuf bk, bc;
    CHECK(up(bk, nullptr, sizeof(unsigned long long) * (size_t)rows));
    CHECK(up(bc, nullptr, sizeof(unsigned int) * (size_t)rows));
    CU(cudaMemset(bk.p, 0, sizeof(unsigned long long) * (size_t)rows), "harness");
    CU(cudaMemset(bc.p, 0, sizeof(unsigned int) * (size_t)rows), "harness");
    for (int rep = 0; rep < 2; rep++) { /* twice: the first launch must leave its counters at 0 */
        CU(cudaMemset(bo.p, 0xff, sizeof(int32_t) * (size_t)rows), "harness");
        k_argmax_split<<<dim3((unsigned)ARGMAX_SPLIT, (unsigned)rows), ARGMAX_SPLIT_THREADS>>>(
            bx.as<float>() + misalign, n, bo.as<int32_t>(), bk.as<unsigned long long>(), bc.as<unsigned int>());
    }
    LAUNCHED("greedy pick");
    return down(out, bo, sizeof(int32_t) * (size_t)rows);
}

#include "strata_cuda_test_arch.cu" /* the newer architectures' kernels and the long-row forms */
