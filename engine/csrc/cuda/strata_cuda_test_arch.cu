/* The kernel harness, continued (included by strata_cuda_test.cu): deepseek2's latent attention, the decode
 * router's weight preloads and RMSNorm with its 8-bit blocks, each against its reference form; the assumed opt-in
 * shared memory limit and the kernel forms it gives. */

extern "C" stg_status stg_test_assume_smem_optin(int32_t bytes) {
    if (bytes < 0) return fail(ST_EINVAL, "assume_smem_optin: %d bytes", bytes);
    g_smem_optin_assumed = bytes;
    return ST_OK;
}

extern "C" int32_t stg_test_q8_split_stages(int32_t head_dim) {
    return stg_device_count() < 1 ? 0 : asm_q8_stages(head_dim, device_smem_optin(0));
}

extern "C" stg_status stg_test_attention_mma_form(int32_t head_dim, int32_t *rows, int32_t *pipe) {
    if (!rows || !pipe) return fail(ST_EINVAL, "attention_mma_form: NULL argument");
    const int n = stg_device_count();
    if (n < 1) return n < 0 ? ST_EUNSUPPORTED : fail(ST_EUNSUPPORTED, "no CUDA device");
    const amma_form f = amma_pick(head_dim, device_smem_optin(0));
    *rows = f.rows, *pipe = f.pipe ? 1 : 0;
    return ST_OK;
}

extern "C" stg_status stg_test_rmsnorm_q(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y,
                                         int8_t *qs, float *d, int32_t *sums) {
    if (!x || !w || !y || !qs || !d || !sums || n_rows < 1 || n < 32 || n % 32)
        return fail(ST_EINVAL, "rmsnorm (quantised): bad arguments");
    CHECK(harness_device());
    dbuf bx, bw, by, bq, bd, bs;
    const size_t ne = (size_t)(n_rows * n);
    CHECK(up(bx, x, sizeof(float) * ne));
    CHECK(up(bw, w, sizeof(float) * (size_t)n));
    CHECK(up(by, nullptr, sizeof(float) * ne));
    CHECK(up(bq, nullptr, ne));
    CHECK(up(bd, nullptr, sizeof(float) * ne / 32));
    CHECK(up(bs, nullptr, sizeof(int32_t) * ne / 16));
    k_rmsnorm<<<(unsigned)n_rows, RMS_THREADS>>>(bx.as<float>(), nullptr, bw.as<float>(), by.as<float>(), n, eps,
                                                 bq.as<int8_t>(), bd.as<float>(), bs.as<int32_t>(), combine_args{});
    LAUNCHED("rmsnorm (quantised)");
    CHECK(down(y, by, sizeof(float) * ne));
    CHECK(down(qs, bq, ne));
    CHECK(down(d, bd, sizeof(float) * ne / 32));
    return down(sums, bs, sizeof(int32_t) * ne / 16);
}

extern "C" stg_status stg_test_mla_attention(int32_t G, int32_t ref, const uint16_t *kc, int32_t n_blocks,
                                             int32_t block_size, const int32_t *block_tables, int32_t max_blocks,
                                             int32_t n_seq, const float *q, const int32_t *pos, const int32_t *seq,
                                             int32_t T, int32_t H, int32_t kl, int32_t rd, float *out) {
    const int64_t ck = (int64_t)kl + rd;
    if (!kc || !block_tables || !q || !pos || !seq || !out || n_blocks < 1 || block_size < 1 || max_blocks < 1 ||
        n_seq < 1 || T < 1 || H < 1 || kl < 32 || kl % 32 || kl > MLA_MAX_KL || rd < 0 || (G != 1 && G != 2 && G != 4 && G != 8) ||
        H % G || mla_att_smem(G, (int)ck) > MLA_SMEM_MAX)
        return fail(ST_EINVAL, "mla attention: bad arguments");
    for (int32_t t = 0; t < T; t++) {
        if (seq[t] < 0 || seq[t] >= n_seq || pos[t] < 0 || pos[t] >= max_blocks * block_size)
            return fail(ST_EINVAL, "mla attention: token %d at sequence %d position %d", t, seq[t], pos[t]);
        for (int32_t b = 0; b <= pos[t] / block_size; b++) {
            const int32_t blk = block_tables[(int64_t)seq[t] * max_blocks + b];
            if (blk < 0 || blk >= n_blocks) return fail(ST_EINVAL, "mla attention: block %d out of range", blk);
        }
    }
    CHECK(harness_device());
    dbuf bk, bt, bq, bp, bs, bo;
    CHECK(up(bk, kc, sizeof(__half) * (size_t)n_blocks * block_size * ck));
    CHECK(up(bt, block_tables, sizeof(int32_t) * (size_t)n_seq * max_blocks));
    CHECK(up(bq, q, sizeof(float) * (size_t)T * H * ck));
    CHECK(up(bp, pos, sizeof(int32_t) * (size_t)T));
    CHECK(up(bs, seq, sizeof(int32_t) * (size_t)T));
    CHECK(up(bo, nullptr, sizeof(float) * (size_t)T * H * kl));
    mla_att_args aa;
    aa.q = bq.as<float>(), aa.out = bo.as<float>(), aa.kc = bk.as<__half>();
    aa.pos = bp.as<int32_t>(), aa.seq = bs.as<int32_t>(), aa.block_tables = bt.as<int32_t>();
    aa.max_blocks = max_blocks, aa.H = H, aa.ck = (int32_t)ck, aa.kl = kl, aa.block_size = block_size;
    CHECK(mla_attention(0, aa, T, G, ref != 0));
    return down(out, bo, sizeof(float) * (size_t)T * H * kl);
}

extern "C" int32_t stg_test_mla_att_g(int32_t T, int32_t H, int32_t ck) { return mla_att_g(T, H, ck); }

/* f_rows_pre with PRE weights per thread in a kernel of its own (the decode routers run it inside k_router_route and
 * k_router_route_rule, whose routing tail the harness's other calls check) */
template <int T, int NT, int PRE> __global__ void __launch_bounds__(LIN_WARPS * WARP) k_test_f_rows_pre(lin_args a) {
    f_rows_pre<T, NT, false, PRE>(a);
}

extern "C" stg_status stg_test_router_rows(int32_t type, int32_t pre, const void *w, int64_t n_rows, int64_t k,
                                           const float *x, int32_t n_tok, float *out) {
    if (!w || !x || !out || n_rows < 1 || n_rows > 1024 || k < 1 || n_tok < 1 || n_tok > 2 || pre < 0 || pre > 2 ||
        (pre == 1 && k > ROUTER_PRE * LIN_WARPS * WARP) || (pre == 2 && k > ROUTER_PRE_WIDE * LIN_WARPS * WARP) ||
        (type != STG_F32 && type != STG_F16 && type != STG_BF16))
        return fail(ST_EINVAL, "router rows: bad arguments");
    CHECK(harness_device());
    const int64_t rb = stg_row_bytes(type, k);
    dbuf bw, bx, bo;
    CHECK(up(bw, w, (size_t)(rb * n_rows)));
    CHECK(up(bx, x, sizeof(float) * (size_t)(n_tok * k)));
    CHECK(up(bo, nullptr, sizeof(float) * (size_t)(n_tok * n_rows)));
    lin_args a = {};
    a.w = bw.as<uint8_t>(), a.row_bytes = rb, a.expert_stride = rb * n_rows;
    a.N = (int32_t)n_rows, a.K = (int32_t)k, a.x = bx.as<float>(), a.out = bo.as<float>(), a.ldo = n_rows;
    a.mode = MODE_STORE, a.g.n_pairs = n_tok;
    const dim3 grid((unsigned)n_rows);
    switch (type * 16 + pre * 4 + n_tok) {
#define CASE_RR(TY)                                                                                         \
    case TY * 16 + 1: launch_k(k_linear_f_rows<TY, 1>, grid, LIN_WARPS * WARP, 0, 0, a); break;             \
    case TY * 16 + 2: launch_k(k_linear_f_rows<TY, 2>, grid, LIN_WARPS * WARP, 0, 0, a); break;             \
    case TY * 16 + 5: launch_k(k_test_f_rows_pre<TY, 1, ROUTER_PRE>, grid, LIN_WARPS * WARP, 0, 0, a); break; \
    case TY * 16 + 6: launch_k(k_test_f_rows_pre<TY, 2, ROUTER_PRE>, grid, LIN_WARPS * WARP, 0, 0, a); break; \
    case TY * 16 + 9: launch_k(k_test_f_rows_pre<TY, 1, ROUTER_PRE_WIDE>, grid, LIN_WARPS * WARP, 0, 0, a); break; \
    case TY * 16 + 10: launch_k(k_test_f_rows_pre<TY, 2, ROUTER_PRE_WIDE>, grid, LIN_WARPS * WARP, 0, 0, a); break;
        FLOAT_CASES(CASE_RR)
#undef CASE_RR
    default: return fail(ST_EINVAL, "router rows: type %d", type);
    }
    LAUNCHED("router rows");
    return down(out, bo, sizeof(float) * (size_t)(n_tok * n_rows));
}
