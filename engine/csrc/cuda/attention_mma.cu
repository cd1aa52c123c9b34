/* Prefill attention on the tensor cores (flash style, online softmax): `mma.sync` m16n8k16
 * with f16 inputs and f32 accumulation for q.k and for p.v, over the paged f16 KV cache.
 *
 * Work split: one block per (query tile, kv head). A tile is a run of at most ROWS / G
 * consecutive tokens of one sequence (G = query heads per kv head), so its ROWS = 16 W rows
 * (token, query head of the group) share every K/V stage; each of the W warps owns 16 rows
 * (one m16 fragment). Keys go in stages of AMMA_BC = 64 (four 16-key chunks, each inside one
 * KV block since block sizes are multiples of 16), copied with cp.async into NS slots (one
 * barrier a stage). Each stage's P.V runs one stage behind, beside the next stage's softmax
 * (PIPE), where the form's shared memory fits the device.
 *
 * Forms (amma_pick, by the device's opt-in shared memory a block; every form gives the same bits):
 * W = 8 (128 rows, one block an SM, PIPE: 4 slots, 140 KiB at head_dim 128, sm_90) where it fits:
 * at depth every block streams the whole cached prefix of its kv head, so 128 rows halve the K/V
 * bytes each SM pulls from L2 per mma, with the 8 warps an SM of two 64-row blocks; else W = 4
 * (64 rows) with PIPE (3 slots) or without it (2 slots: 70 KiB at head_dim 128, sm_89's 99 KiB).
 *
 * Arithmetic (not bitwise k_attention's): q is pre-scaled fp32; it enters the mma as f16, by
 * default split as q = hi + lo (two f16 each, two mma per fragment), which leaves the score
 * error at the fp32 accumulation's level, since K is f16 already in the cache. The
 * probabilities p = exp2(s * log2e - m) enter p.v rounded to f16 (relative 2^-11 at most
 * per weight; V is f16 already); the row sum l is taken over the fp32 p. Per row: online
 * max / rescale per 64-key stage, then out = acc / l. Rows are independent (an mma output
 * element depends on its own row of A only; a stage whose keys a row cannot see adds exact
 * zeros to it), so a row's result does not depend on the other rows of its tile or step, but
 * it is not the decode kernel's: see stg_settings.att_mma_min for where each kernel runs.
 *
 * Layouts (PTX ISA, m16n8k16 .f16, groupID g = lane >> 2, t = lane % 4): A regs {a0,a1} row g,
 * cols 2t, 2t+1; {a2,a3} row g+8; {a4,a5} row g, cols 2t+8, 2t+9; {a6,a7} row g+8, cols 2t+8..;
 * B {b0,b1} rows (k) 2t, 2t+1, col (n) g; {b2,b3} rows 2t+8, 2t+9; C/D {c0,c1} row g, cols 2t,
 * 2t+1; {c2,c3} row g+8. K is staged as the cache holds it, [dim][key], V as [key][dim]; both
 * B operands then come from `ldmatrix .trans` (thread (g, t) of an 8x8 matrix gets its
 * elements (2t, g) and (2t+1, g)), and S's C fragments are P's A fragments directly. */
#include "attention.cuh"

#define AMMA_BC 64
#define AMMA_KP (AMMA_BC + 8) /* padded K stage row (one dimension, halves): ldmatrix rows in distinct banks */

__host__ __device__ constexpr int amma_vp(int hd) { return hd + 8; } /* padded V stage row */
/* one K/V stage: K [hd][AMMA_KP], then V [AMMA_BC][hd + 8] halves */
__host__ __device__ constexpr size_t amma_stage_halves(int hd) {
    return (size_t)hd * AMMA_KP + (size_t)AMMA_BC * amma_vp(hd);
}
/* K/V stage slots of W warps: NS - 1 stages in flight beside the one computed (PIPE: NS - 2, as a slot keeps its V
 * one stage longer) */
__host__ __device__ constexpr int amma_ns(int w, bool pipe) { return (w == 8 ? 3 : 2) + (pipe ? 1 : 0); }
/* dynamic shared memory: the K/V stages, and at the end the output rows in the same memory ([16 W][hd + 8] floats) */
constexpr size_t amma_smem_bytes(int hd, int w, bool pipe) {
    const size_t stages = amma_ns(w, pipe) * amma_stage_halves(hd) * sizeof(__half);
    const size_t rows = (size_t)16 * w * (hd + 8) * sizeof(float);
    return stages > rows ? stages : rows;
}
/* static shared memory: the key count of each of the 16 W rows (rn) */
constexpr size_t amma_static_bytes(int w) { return sizeof(int32_t) * 16 * w; }
/* whether a form fits a block of a device that opts in to smem_optin bytes */
constexpr bool amma_fits(int hd, int w, bool pipe, int smem_optin) {
    return amma_smem_bytes(hd, w, pipe) + amma_static_bytes(w) <= (size_t)smem_optin;
}

__device__ __forceinline__ void amma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* four 8x8 b16 matrices, transposed: lanes 8i..8i+7 give the row addresses of matrix i */
__device__ __forceinline__ void amma_ldsm_t(uint32_t (&r)[4], const __half *p) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}
/* 2^x as the one MUFU operation (flush to zero): exp2f's bits wherever 2^x is a normal float (x >= -126); below
 * that 0 instead of a subnormal, which neither an f16 p (its least subnormal is 2^-24) nor an fp32 row sum that
 * already holds a p of 1 (every row's max key gives one) can see. exp2f (not -ftz) adds a compare and two scalings. */
__device__ __forceinline__ float amma_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t amma_pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi); /* .x (low 16 bits) = lo */
    return *(const uint32_t *)&h;
}

/* 8 int8 values times their 8 F16 scales (one 16-byte word), each product rounded to f16: one 16-byte word. */
__device__ __forceinline__ uint4 q8x8_scaled(uint2 q, uint4 sc) {
    const uint32_t qw[2] = {q.x, q.y}, sw[4] = {sc.x, sc.y, sc.z, sc.w};
    uint32_t r[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 d = __half22float2(*(const __half2 *)&sw[i]);
        const int8_t q0 = (int8_t)(qw[i >> 1] >> (16 * (i & 1))), q1 = (int8_t)(qw[i >> 1] >> (16 * (i & 1) + 8));
        r[i] = amma_pack(__fmul_rn((float)q0, d.x), __fmul_rn((float)q1, d.y));
    }
    return make_uint4(r[0], r[1], r[2], r[3]);
}

/* tiles[i] = first_token * 256 + tokens (at most 16 W / G); QSPLIT: q as f16 hi + lo.
 * exp2 is amma_ex2, and a stage whose keys move no row's max of the warp skips the output's rescale (a multiply by
 * exactly 1). PIPE: P.V one stage behind (stage kt - 1's P.V queued beside stage kt's softmax, so a warp has tensor
 * work while the softmax's chain of dependent steps runs; one more K/V slot, since a slot's V is read an iteration
 * later); without it each stage's P.V follows its own softmax. The same bits either way.
 * Q8 (the 8-bit cache, attn_args.k8; HD 64 or 128): each stage's K and V enter shared memory as f16(q * d), the
 * integer times its group's scale rounded once to f16 (relative 2^-11 at most, as p's rounding), loaded into
 * registers and stored converted instead of the asynchronous copies; the arithmetic after that is the F16 cache's. */
template <int HD, int W, bool QSPLIT, bool Q8, bool PIPE>
__global__ void __launch_bounds__(W * 32, W == 8 ? 1 : 2) k_attention_mma(attn_args a, const int32_t *tiles) {
    PDL_ENTER();
    constexpr int AMMA_ROWS = 16 * W;
    constexpr int VP = amma_vp(HD), NT = AMMA_BC / 8, KS = HD / 16, DT = HD / 8, NS = amma_ns(W, PIPE);
    constexpr int AHEAD = PIPE ? NS - 2 : NS - 1; /* stages issued ahead of the one computed */
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ int32_t rn[AMMA_ROWS]; /* amma_static_bytes(W) */
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t4 = lane & 3;
    const int G = a.n_head / a.n_kv, kvh = blockIdx.y, kd = a.n_kv * HD, bs = a.block_size;
    const int32_t tile = tiles[blockIdx.x], t0 = tile >> 8, nrows = (tile & 255) * G;
    if (threadIdx.x < AMMA_ROWS) rn[threadIdx.x] = (int)threadIdx.x < nrows ? a.pos[t0 + threadIdx.x / G] + 1 : 0;
    __syncthreads();
    int32_t max_keys = 0, wmax = 0, wmin = 0x7fffffff; /* keys seen by the block; by this warp's rows */
    for (int r = 0; r < AMMA_ROWS; r++) max_keys = max(max_keys, rn[r]);
    for (int r = warp * 16; r < warp * 16 + 16; r++)
        if (rn[r] > 0) wmax = max(wmax, rn[r]), wmin = min(wmin, rn[r]);
    const int r_lo = warp * 16 + g, r_hi = r_lo + 8;
    /* padding rows (past the tile's tokens) see the warp's keys: finite, then discarded */
    const int32_t lim_lo = rn[r_lo] > 0 ? rn[r_lo] : wmax, lim_hi = rn[r_hi] > 0 ? rn[r_hi] : wmax;
    const bool active = wmax > 0;

    /* q fragments for the whole head dimension, kept in registers */
    uint32_t qh[KS][4], ql[QSPLIT ? KS : 1][4];
    {
        const float *qr[2] = {nullptr, nullptr};
        const int rows[2] = {r_lo, r_hi};
#pragma unroll
        for (int i = 0; i < 2; i++)
            if (rows[i] < nrows)
                qr[i] = a.q + (int64_t)(t0 + rows[i] / G) * a.n_head * HD + (int64_t)(kvh * G + rows[i] % G) * HD;
#pragma unroll
        for (int kk = 0; kk < KS; kk++)
#pragma unroll
            for (int i = 0; i < 4; i++) { /* reg i: row (i & 1 ? g + 8 : g), cols 16 kk + 2t (+ 8 for i >= 2) */
                const float *p = qr[i & 1];
                const float2 x = p ? *(const float2 *)(p + 16 * kk + 2 * t4 + (i >= 2 ? 8 : 0)) : make_float2(0.0f, 0.0f);
                const __half hx = __float2half_rn(x.x), hy = __float2half_rn(x.y);
                qh[kk][i] = amma_pack(__half2float(hx), __half2float(hy));
                if constexpr (QSPLIT) ql[kk][i] = amma_pack(x.x - __half2float(hx), x.y - __half2float(hy));
            }
    }

    const int32_t *bt = a.block_tables + (int64_t)a.seq[t0] * a.max_blocks;
    const int n_kt = (max_keys + AMMA_BC - 1) / AMMA_BC;
    __half *const stage0 = (__half *)att_dyn;
    /* A stage is four 16-key chunks, each inside one KV block. A thread copies into one chunk, kc_c: K's HD rows x
     * 2 pieces of 16 bytes (its piece kc_p), and V's 16 rows x HD / 8 pieces, the chunk's W * 8 threads taking
     * every (W * 8)-th piece from kc_v on. So a thread reads one block-table entry a stage, loaded a stage ahead
     * (b_next), and its copies share one base address per cache. */
    const int kc_p = threadIdx.x & 1, kc_c = (threadIdx.x >> 1) & 3, kc_v = kc_p | ((threadIdx.x >> 3) << 1);
    const int bs_sh = (bs & (bs - 1)) == 0 ? __ffs(bs) - 1 : -1; /* block sizes are powers of two but for tests */
    auto chunk_block = [&](int jc) { return bs_sh >= 0 ? jc >> bs_sh : jc / bs; }; /* the block index of key jc */
    int32_t b_next = 16 * kc_c < max_keys ? bt[chunk_block(16 * kc_c)] : 0; /* stage 0's, then each next one's */
    auto issue = [&](int kt) { /* stage kt's copies into slot kt % NS, as one commit group (empty past the end) */
        if (kt < n_kt) {
            __half *ks = stage0 + (size_t)(kt % NS) * amma_stage_halves(HD), *vs = ks + HD * AMMA_KP;
            constexpr int VPC = HD / 8, KR = HD / (4 * W), VR = 16 * VPC / (8 * W); /* a thread's K and V copies */
            const int64_t per = (int64_t)kd * bs, nd = a.ht.n_dev;
            /* the chunk's first key; its keys: min(16, nv) */
            const int jc = kt * AMMA_BC + 16 * kc_c, nv = max_keys - jc;
            const int32_t b = b_next; /* block 0 where nv <= 0: nothing is read from it then */
            b_next = jc + AMMA_BC < max_keys ? bt[chunk_block(jc + AMMA_BC)] : 0;
            const int sl = jc - chunk_block(jc) * bs;
            __half *const krow = ks + 16 * kc_c + 8 * kc_p, *const vrow = vs + 16 * kc_c * VP;
            /* K of keys past the last stays stale (their scores are masked); V rows past it are zeros (p = 0 there,
             * and 0 * stale NaN would not be 0) */
            if constexpr (Q8) { /* every load of the stage first, then the converted stores */
                constexpr int NG = HD / 32;
                const int kd32 = kd / 32;
                uint2 kq[KR], vq[VR];
                uint4 kscl[KR];
                __half vsc[VR];
                if (nv > 0) {
                    const int8_t *kg = kv_blk(a.k8, a.ht.k8, b, nd, per) + (int64_t)kvh * HD * bs + sl + 8 * kc_p;
                    const __half *kg_s =
                        kv_blk(a.ks, a.ht.ks, b, nd, per / 32) + (int64_t)kvh * NG * bs + sl + 8 * kc_p;
#pragma unroll
                    for (int r = 0; r < KR; r++) {
                        const int d = (threadIdx.x >> 3) + 4 * W * r;
                        kq[r] = *(const uint2 *)(kg + (int64_t)d * bs);
                        kscl[r] = *(const uint4 *)(kg_s + (d / 32) * bs);
                    }
                }
                const int8_t *vg = kv_blk(a.v8, a.ht.v8, b, nd, per) + (int64_t)sl * kd + (int64_t)kvh * HD;
                const __half *vg_s = kv_blk(a.vs, a.ht.vs, b, nd, per / 32) + (int64_t)sl * kd32 + (int64_t)kvh * NG;
#pragma unroll
                for (int r = 0; r < VR; r++) {
                    const int e = kc_v + 8 * W * r, jj = e / VPC, pc = e % VPC;
                    vq[r] = make_uint2(0u, 0u), vsc[r] = __ushort_as_half((unsigned short)0);
                    if (jj < nv)
                        vq[r] = *(const uint2 *)(vg + (int64_t)jj * kd + 8 * pc), vsc[r] = vg_s[jj * kd32 + pc / 4];
                }
                if (nv > 0)
#pragma unroll
                    for (int r = 0; r < KR; r++)
                        *(uint4 *)(krow + ((threadIdx.x >> 3) + 4 * W * r) * AMMA_KP) = q8x8_scaled(kq[r], kscl[r]);
#pragma unroll
                for (int r = 0; r < VR; r++) { /* zeros past the last key (q and d are 0 there) */
                    const int e = kc_v + 8 * W * r;
                    const uint32_t d2 = __half_as_ushort(vsc[r]) * 0x10001u;
                    *(uint4 *)(vrow + (e / VPC) * VP + 8 * (e % VPC)) = q8x8_scaled(vq[r], make_uint4(d2, d2, d2, d2));
                }
            } else {
                if (nv > 0) {
                    const __half *kg = kv_blk(a.kc, a.ht.kc, b, nd, per) + (int64_t)kvh * HD * bs + sl + 8 * kc_p;
#pragma unroll
                    for (int r = 0; r < KR; r++) {
                        const int d = (threadIdx.x >> 3) + 4 * W * r;
                        cp_async16(krow + d * AMMA_KP, kg + (int64_t)d * bs);
                    }
                }
                const __half *vg = kv_blk(a.vc, a.ht.vc, b, nd, per) + (int64_t)sl * kd + (int64_t)kvh * HD;
#pragma unroll
                for (int r = 0; r < VR; r++) {
                    const int e = kc_v + 8 * W * r, jj = e / VPC, pc = e % VPC;
                    cp_async16_or_zero(vrow + jj * VP + 8 * pc, vg + (int64_t)jj * kd + 8 * pc, jj < nv);
                }
            }
        }
        cp_async_commit();
    };

    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f; /* l: this thread's share of the row sum */
    const int mi = lane >> 3, mr = lane & 7; /* ldmatrix: matrix and row this lane addresses */
    /* S = q.k of the stage whose K is at ks */
    auto qk = [&](const __half *ks, float (&s)[NT][4]) {
#pragma unroll
        for (int i = 0; i < NT; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
#pragma unroll
            for (int np = 0; np < NT / 2; np++) { /* key n-tiles 2np, 2np + 1; dims 16kk..+7, +8..+15 */
                uint32_t b[4];
                amma_ldsm_t(b, ks + (16 * kk + 8 * (mi & 1) + mr) * AMMA_KP + 8 * (2 * np + (mi >> 1)));
                if constexpr (QSPLIT) {
                    amma_f16(s[2 * np], ql[kk], b[0], b[1]);
                    amma_f16(s[2 * np + 1], ql[kk], b[2], b[3]);
                }
                amma_f16(s[2 * np], qh[kk], b[0], b[1]);
                amma_f16(s[2 * np + 1], qh[kk], b[2], b[3]);
            }
        }
    };
    /* the online softmax of stage j0's scores: the running max and row sums move; P (f16, as p.v's A operand: S's C
     * fragments, two n-tiles per k step) and the factor c that the output takes before P.V of this stage */
    auto soft = [&](int j0, float (&s)[NT][4], uint32_t (&pa)[NT / 2][4], float &c_lo, float &c_hi) {
        /* causal / length mask (only where a row of the warp ends inside this stage), log2 domain */
        const bool mask = j0 + AMMA_BC > wmin;
        float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = j0 + 8 * nt + 2 * t4 + e;
                float v0 = s[nt][e] * LOG2E, v1 = s[nt][2 + e] * LOG2E;
                if (mask) {
                    if (key >= lim_lo) v0 = -INFINITY;
                    if (key >= lim_hi) v1 = -INFINITY;
                }
                s[nt][e] = v0, s[nt][2 + e] = v1;
                mx_lo = fmaxf(mx_lo, v0), mx_hi = fmaxf(mx_hi, v1);
            }
#pragma unroll
        for (int o2 = 1; o2 <= 2; o2 <<= 1) { /* the 4 lanes of a row */
            mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o2));
            mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o2));
        }
        /* every row sees key 0 in stage 0, so the running max is finite from then on */
        const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
        c_lo = amma_ex2(m_lo - mn_lo), c_hi = amma_ex2(m_hi - mn_hi); /* 0 on the first stage */
        m_lo = mn_lo, m_hi = mn_hi;
        float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const float p0 = amma_ex2(s[nt][0] - mn_lo), p1 = amma_ex2(s[nt][1] - mn_lo);
            const float p2 = amma_ex2(s[nt][2] - mn_hi), p3 = amma_ex2(s[nt][3] - mn_hi);
            sum_lo += p0 + p1, sum_hi += p2 + p3;
            pa[nt / 2][(nt & 1) * 2] = amma_pack(p0, p1);
            pa[nt / 2][(nt & 1) * 2 + 1] = amma_pack(p2, p3);
        }
        l_lo = fmaf(l_lo, c_lo, sum_lo), l_hi = fmaf(l_hi, c_hi, sum_hi);
    };
    auto rescale = [&](float c_lo, float c_hi) {
        /* at depth a row's max rarely moves, and a multiply by exactly 1 changes nothing */
        if (__any_sync(0xffffffffu, c_lo != 1.0f || c_hi != 1.0f)) {
#pragma unroll
            for (int i = 0; i < DT; i++) o[i][0] *= c_lo, o[i][1] *= c_lo, o[i][2] *= c_hi, o[i][3] *= c_hi;
        }
    };
    /* o += P.V of the stage whose V is at vs */
    auto pv = [&](const __half *vs, const uint32_t (&pa)[NT / 2][4]) {
#pragma unroll
        for (int k2 = 0; k2 < NT / 2; k2++) {
#pragma unroll
            for (int dp = 0; dp < DT / 2; dp++) { /* dim n-tiles 2dp, 2dp + 1; keys 16k2..+7, +8..+15 */
                uint32_t b[4];
                amma_ldsm_t(b, vs + (16 * k2 + 8 * (mi & 1) + mr) * VP + 8 * (2 * dp + (mi >> 1)));
                amma_f16(o[2 * dp], pa[k2], b[0], b[1]);
                amma_f16(o[2 * dp + 1], pa[k2], b[2], b[3]);
            }
        }
    };
    auto slot = [&](int kt) { return stage0 + (size_t)(kt % NS) * amma_stage_halves(HD); };
    uint32_t pa[NT / 2][4]; /* PIPE: the previous stage's P, its P.V not yet added */
    float cp_lo = 1.0f, cp_hi = 1.0f;
    bool prev = false;
#pragma unroll
    for (int kt = 0; kt < AHEAD; kt++) issue(kt);
    for (int kt = 0; kt < n_kt; kt++) {
        cp_async_wait<AHEAD - 1>(); /* this thread's copies of stage kt are complete: AHEAD - 1 newer groups may fly */
        __syncthreads(); /* everyone's are, and every warp is past stage kt - 1 (PIPE: past P.V of stage kt - 2) */
        issue(kt + AHEAD); /* into the slot that frees: one barrier a stage */
        const int j0 = kt * AMMA_BC;
        const bool cur = active && j0 < wmax;
        const __half *ks = slot(kt);
        if constexpr (!PIPE) {
            if (cur) {
                float s[NT][4], c_lo, c_hi;
                qk(ks, s);
                soft(j0, s, pa, c_lo, c_hi);
                rescale(c_lo, c_hi);
                pv(ks + HD * AMMA_KP, pa);
            }
        } else { /* P.V of stage kt - 1 beside this stage's softmax: tensor work for the warp while it waits on the
                  * softmax's chain; each row's o still takes rescale, P.V stage by stage in order (the same bits) */
            const __half *vprev = slot(kt + NS - 1) + HD * AMMA_KP;
            if (prev) rescale(cp_lo, cp_hi);
            if (cur && prev) {
                float s[NT][4];
                uint32_t pn[NT / 2][4];
                qk(ks, s);
                pv(vprev, pa);
                soft(j0, s, pn, cp_lo, cp_hi);
#pragma unroll
                for (int i = 0; i < NT / 2; i++) pa[i][0] = pn[i][0], pa[i][1] = pn[i][1], pa[i][2] = pn[i][2], pa[i][3] = pn[i][3];
            } else if (cur) {
                float s[NT][4];
                qk(ks, s);
                soft(j0, s, pa, cp_lo, cp_hi);
            } else if (prev) {
                pv(vprev, pa);
            }
            prev = cur;
        }
    }
    if (PIPE && prev) { /* the last stage's P.V (its V is still in its slot: nothing was issued past n_kt) */
        rescale(cp_lo, cp_hi);
        pv(slot(n_kt - 1) + HD * AMMA_KP, pa);
    }
    cp_async_wait<0>(); /* only empty groups are left */
#pragma unroll
    for (int o2 = 1; o2 <= 2; o2 <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o2);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o2);
    }
    __syncthreads(); /* every copy is done and every warp past its last stage: the stages become the output rows */
    float *os = (float *)att_dyn;
    constexpr int OP = HD + 8; /* float2 stores of a half-warp in distinct banks */
    if (active) {
#pragma unroll
        for (int i = 0; i < DT; i++) {
            *(float2 *)&os[r_lo * OP + 8 * i + 2 * t4] = make_float2(o[i][0] / l_lo, o[i][1] / l_lo);
            *(float2 *)&os[r_hi * OP + 8 * i + 2 * t4] = make_float2(o[i][2] / l_hi, o[i][3] / l_hi);
        }
    }
    __syncwarp();
    for (int r = warp * 16; r < warp * 16 + 16 && r < nrows; r++) {
        const int64_t row0 = (int64_t)(t0 + r / G) * a.n_head * HD + (int64_t)(kvh * G + r % G) * HD;
#pragma unroll
        for (int d0 = 0; d0 < HD; d0 += 32) {
            const float v = os[r * OP + d0 + lane];
            a.out[row0 + d0 + lane] = v;
            if (a.aq) quant_block32(v, lane, a.aq + row0 + d0, a.ad + (row0 + d0) / 32, a.as + (row0 + d0) / 16);
        }
    }
}

/* ------------------------------------------------------------ host side */

/* stg_settings.att_mma: 0 = the fp32 query-tile kernel for every prefill run (bitwise k_attention);
 * 1 = tensor cores with q as one f16; 2 (default) = tensor cores with q as f16 hi + lo.
 * att_mma_min: runs (consecutive tokens of one sequence in a step) shorter than this keep the fp32
 * query-tile kernel, whose rows are bitwise k_attention's: decode tokens, short prompts and the tails
 * that a graph step would compute, so that a short sequence's tokens do not depend on how it was
 * batched. Longer runs, where attention is worth the tensor cores, use the mma kernel: their tokens
 * are within tolerance (not bitwise) of what another chunking gives. */
/* The form a device takes (rows 128 or 64, PIPE): the first that fits a block of smem_optin bytes of opt-in shared
 * memory (cudaDevAttrMaxSharedMemoryPerBlockOptin: the model's stg_model.smem_optin) of 128 rows with P.V one stage
 * behind, 64 rows with it, 64 rows without it; rows 0 where none fits or head_dim is not 32, 64 or 128. head_dim
 * 128: 140, 105 and 70 KiB (sm_90 takes the first, sm_89's 99 KiB the last); head_dim 64: 72, 54 and 36 KiB. */
struct amma_form {
    int rows;
    bool pipe;
};
static amma_form amma_pick(int32_t hd, int smem_optin) {
    if (hd != 32 && hd != 64 && hd != 128) return {0, false};
    const amma_form forms[3] = {{128, true}, {64, true}, {64, false}};
    for (const amma_form &f : forms)
        if (amma_fits(hd, f.rows / 16, f.pipe, smem_optin)) return f;
    return {0, false};
}
/* Tokens per mma tile of `rows` rows (64 or 128: amma_pick's) for a model: head_dim 32, 64 or 128 and G = n_head /
 * n_kv dividing 16 (the short runs need the query-tile kernel, which takes the same shapes); 0 otherwise. */
static int att_mma_tokens(int32_t n_head, int32_t n_kv, int32_t hd, int32_t rows) {
    if (n_kv < 1 || n_head % n_kv || (hd != 32 && hd != 64 && hd != 128) || (rows != 64 && rows != 128)) return 0;
    const int G = n_head / n_kv;
    return G <= 16 && 16 % G == 0 ? rows / G : 0;
}
/* A step's prefill tiles: runs shorter than min_run as query tiles of tq tokens (first * 32 +
 * count) in out[0, n_old), then the longer runs as mma tiles of tqm tokens (first * 256 + count)
 * in out[n_old, n_old + n_mma). At most T entries in all. */
static void att_split_tiles(const int32_t *seq, int32_t T, int tq, int tqm, int32_t min_run, int32_t *out,
                            int32_t *n_old, int32_t *n_mma) {
    int32_t n = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int32_t i = 0; i < T;) {
            int32_t j = i + 1;
            while (j < T && seq[j] == seq[i]) j++;
            const bool long_run = j - i >= min_run;
            if (long_run == (pass == 1)) {
                const int32_t step = long_run ? tqm : tq, mul = long_run ? 256 : 32;
                for (int32_t f = i; f < j; f += step) out[n++] = f * mul + std::min(step, j - f);
            }
            i = j;
        }
        if (pass == 0) *n_old = n;
    }
    *n_mma = n - *n_old;
}

/* Every form that fits a block of smem_optin bytes opts in to its dynamic shared memory (amma_pick launches no
 * other there). */
static stg_status attention_mma_setup(int smem_optin) {
#define AMMA_SETUP(HD, W, QS, Q8, PIPE)                                                                        \
    if (amma_fits(HD, W, PIPE, smem_optin))                                                                    \
        CU(cudaFuncSetAttribute(k_attention_mma<HD, W, QS, Q8, PIPE>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                (int)amma_smem_bytes(HD, W, PIPE)),                                             \
           "attention (mma) setup");
#define AMMA_SETUP_FORMS(HD, QS, Q8)                                                                           \
    AMMA_SETUP(HD, 8, QS, Q8, true)                                                                            \
    AMMA_SETUP(HD, 4, QS, Q8, true)                                                                            \
    AMMA_SETUP(HD, 4, QS, Q8, false)
    AMMA_SETUP_FORMS(32, false, false)
    AMMA_SETUP_FORMS(32, true, false)
    AMMA_SETUP_FORMS(64, false, false)
    AMMA_SETUP_FORMS(64, true, false)
    AMMA_SETUP_FORMS(128, false, false)
    AMMA_SETUP_FORMS(128, true, false)
    AMMA_SETUP_FORMS(64, true, true)
    AMMA_SETUP_FORMS(128, true, true)
#undef AMMA_SETUP_FORMS
#undef AMMA_SETUP
    return ST_OK;
}

/* A step's tensor-core tiles (d_tiles: n_tiles of att_mma_tokens' size for amma_pick(aa.hd, smem_optin).rows) on the
 * form amma_pick gives: mode 1 (q as f16) or 2 (q as f16 hi + lo), as stg_settings.att_mma; the 8-bit cache takes q
 * as hi + lo always. smem_optin: the model's stg_model.smem_optin (the harness: device_smem_optin's). */
static stg_status launch_attention_mma(const attn_args &aa, const int32_t *d_tiles, int32_t n_tiles, int mode,
                                       int smem_optin, cudaStream_t st) {
    if (mode != 1 && mode != 2) return fail(ST_EINVAL, "attention (mma): mode %d", mode);
    const amma_form f = amma_pick(aa.hd, smem_optin);
    if (!f.rows)
        return fail(ST_EUNSUPPORTED, "attention (mma): no form of head_dim %d fits %d bytes of shared memory a block",
                    aa.hd, smem_optin);
    const dim3 grid((unsigned)n_tiles, (unsigned)aa.n_kv), block((unsigned)f.rows * 2);
#define AMMA_F(HD, QS, Q8)                                                                                      \
    if (f.rows == 128)                                                                                          \
        launch_k(k_attention_mma<HD, 8, QS, Q8, true>, grid, block, amma_smem_bytes(HD, 8, true), st, aa, d_tiles); \
    else if (f.pipe)                                                                                            \
        launch_k(k_attention_mma<HD, 4, QS, Q8, true>, grid, block, amma_smem_bytes(HD, 4, true), st, aa, d_tiles); \
    else launch_k(k_attention_mma<HD, 4, QS, Q8, false>, grid, block, amma_smem_bytes(HD, 4, false), st, aa, d_tiles);
    if (aa.k8) {
        if (!aa.v8 || !aa.ks || !aa.vs || (aa.hd != 64 && aa.hd != 128))
            return fail(ST_EUNSUPPORTED, "attention (mma, 8-bit KV): head_dim %d", aa.hd);
        if (aa.hd == 128) {
            AMMA_F(128, true, true)
        } else {
            AMMA_F(64, true, true)
        }
        LAUNCHED("attention (mma tiles, 8-bit KV)");
        return ST_OK;
    }
#define AMMA_MODE(HD)                                                                                          \
    if (mode == 1) {                                                                                           \
        AMMA_F(HD, false, false)                                                                               \
    } else {                                                                                                   \
        AMMA_F(HD, true, false)                                                                                \
    }
    if (aa.hd == 128) {
        AMMA_MODE(128)
    } else if (aa.hd == 64) {
        AMMA_MODE(64)
    } else {
        AMMA_MODE(32)
    }
#undef AMMA_MODE
#undef AMMA_F
    LAUNCHED("attention (mma tiles)");
    return ST_OK;
}
