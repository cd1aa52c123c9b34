/* Attention at decode: k_attention (a block per (token, head), flash-decoding over the paged f16
 * cache; with the q / k / v post-processing fused at decode) and the reference kernel the tests use. */
#include "attention.cuh"

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
    const float ms = a.qa.mscale; /* qkv_head's scaled cos / sin */
    const float c0 = __fmul_rn((float)cos((double)th0), ms), s0 = __fmul_rn((float)sin((double)th0), ms);
    const float c1 = __fmul_rn((float)cos((double)th1), ms), s1 = __fmul_rn((float)sin((double)th1), ms);
    if (lane < np) rcs[0][lane] = c0, rcs[1][lane] = s0;
    if (lane + 32 < np) rcs[0][lane + 32] = c1, rcs[1][lane + 32] = s1;
    asm volatile("bar.arrive 1, 96;\n" ::: "memory"); /* warps 0 and 1 wait for it (bar.sync 1, 96) */
}
/* The block of (token t, head h): k_attention's body, also run by k_attention_split_mma for a token of one split
 * (so that token gets exactly what it gets alone). */
template <bool HALF2, int HD, bool PREP>
__device__ __forceinline__ void att_decode_head(const attn_args &a, int t, int h) {
    pdl_trigger();
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ __align__(16) float qs[256];
    __shared__ float part[ATT_WARPS][256 + 2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
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
    /* a sliding window's first key (0 without one): the warps start at its chunk, whose keys before it are masked */
    const int32_t k_lo = a.n_swa > 0 && n_keys > a.n_swa ? n_keys - a.n_swa : 0;
    /* copies of chunk ci (block blk) into stage st */
    auto issue = [&](int ci, int st, int32_t blk) {
        const int slot0 = (ci * ATT_CK) % bs;
        __half *ks = wbuf + (size_t)st * 2 * ATT_CK * hd, *vs = ks + ATT_CK * hd;
        const int64_t per = (int64_t)kd * bs;
        const __half *kg = kv_blk(a.kc, a.ht.kc, blk, a.ht.n_dev, per) + (int64_t)kvh * hd * bs + slot0;
        const __half *vg = kv_blk(a.vc, a.ht.vc, blk, a.ht.n_dev, per) + (int64_t)slot0 * kd + (int64_t)kvh * hd;
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
    int ci = warp + k_lo / ATT_CK;
    int32_t blk_next = ci < n_chunks ? bt[ci * ATT_CK / bs] : 0;
    int issued = 0; /* this warp's chunks already in flight when the loop starts */
    if (ci < n_chunks && (S == 2 || pre)) {
        att_issue_chunk(issue, ci, 0, blk_next, bt, n_chunks, bs);
        issued = 1;
        if (pre && S == 2 && ci + ATT_WARPS < n_chunks) {
            att_issue_chunk(issue, ci + ATT_WARPS, 1, blk_next, bt, n_chunks, bs);
            issued = 2;
        }
    }
    float bw[4] = {}, bb[4] = {}; /* PREP: this warp's head norm weights and bias (lane + 32 k) */
    float rf0 = 0.0f, rf1 = 0.0f; /* PREP, warp 3: inv_freq[lane], inv_freq[lane + 32] */
    __half *kvw = nullptr; /* PREP, warps 1 / 2 of a kv group's first q head: the new K / V's place in the cache (kv_store) */
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
                const int64_t per = (int64_t)kd * bs, c = (int64_t)kvh * HD + lane;
                kvw = warp == 1 ? kv_blk(a.qa.kc, a.qa.ht.kc, blk, a.qa.ht.n_dev, per) + c * bs + slot
                                : kv_blk(a.qa.vc, a.qa.ht.vc, blk, a.qa.ht.n_dev, per) + (int64_t)slot * kd + c;
            }
        } else { /* warp 3: RoPE's inv_freq (weights), the table before the wait where pre */
            const int np = a.qa.rope_dim / 2;
            rf0 = lane < np ? a.qa.inv_freq[lane] : 0.0f, rf1 = lane + 32 < np ? a.qa.inv_freq[lane + 32] : 0.0f;
            if (a.kc_next) { /* the next layer's K / V chunks of this token into L2 (kv group's heads share them) */
                const int G = a.n_head / a.n_kv;
                for (int c = h % G; c < n_chunks; c += G) {
                    const int32_t blk = bt[c * ATT_CK / bs];
                    if (blk >= a.ht.n_dev) continue; /* a host-tier block: not prefetched over PCIe */
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
                    if (kvw) kvw[warp == 1 ? (int64_t)32 * k * bs : 32 * k] = hv; /* kv_store */
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
            if (it > 0 || !issued) att_issue_chunk(issue, ci, 0, blk_next, bt, n_chunks, bs);
            cp_async_wait<0>();
        } else {
            st = it & 1;
            att_next_stage(issue, ci, st, it > 0 || issued < 2, blk_next, bt, n_chunks, bs);
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
        const bool ok = key < nk && ci * ATT_CK + key >= k_lo;
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
    const float sink = a.sinks ? a.sinks[h] : -INFINITY; /* a score with no value (attention.c's st_attn_ext) */
    float M = sink;
    for (int wi = 0; wi < ATT_WARPS; wi++) M = fmaxf(M, part[wi][256]);
    float L = 0.0f, sc[ATT_WARPS];
    for (int wi = 0; wi < ATT_WARPS; wi++) {
        sc[wi] = part[wi][257] > 0.0f ? expf(part[wi][256] - M) : 0.0f; /* a warp with no keys adds nothing */
        L = __fmaf_rn(part[wi][257], sc[wi], L);
    }
    if (a.sinks) L = L + expf(sink - M);
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

template <bool HALF2, int HD, bool PREP = false>
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attention(attn_args a) {
    att_decode_head<HALF2, HD, PREP>(a, blockIdx.x, blockIdx.y);
}

/* Reference attention: one thread per (token, head), two passes exactly like attn_ref in
 * attention.c (scores, max, exp and sum in key order, fma chain over keys per dimension); Q8: over the 8-bit cache
 * (a.k8), as attn_q8_ref (q8_score: per group of 32 dimensions the fma chain with the integers, then the scale
 * times it added in; the values: w times the group's scale, then the fma chain over keys per dimension). */
template <bool Q8 = false>
__global__ void k_attention_ref(attn_args a, float *scratch, int32_t max_keys) {
    const int t = blockIdx.x, h = threadIdx.x;
    if (h >= a.n_head) return;
    const int hd = a.hd, kd = a.n_kv * hd, kvh = h / (a.n_head / a.n_kv);
    const float *q = a.q + (int64_t)t * a.n_head * hd + h * hd;
    float *s = scratch + ((int64_t)t * a.n_head + h) * max_keys;
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t] * a.max_blocks;
    const int32_t nk = a.pos[t] + 1;
    const int bs = a.block_size, kd32 = kd / 32;
    const int64_t per = (int64_t)kd * bs, nd = a.ht.n_dev;
    float mx = -INFINITY;
    for (int32_t j = 0; j < nk; j++) {
        const int64_t blk = bt[j / bs], slot = j % bs;
        float acc = 0.0f;
        if constexpr (Q8) {
            const int8_t *kp = kv_blk(a.k8, a.ht.k8, blk, nd, per) + (int64_t)kvh * hd * bs + slot;
            const __half *sp = kv_blk(a.ks, a.ht.ks, blk, nd, per / 32) + (int64_t)kvh * hd / 32 * bs + slot;
            for (int g = 0; g < hd / 32; g++) {
                float dot = 0.0f;
                for (int d = 32 * g; d < 32 * g + 32; d++) dot = fmaf(q[d], (float)kp[(int64_t)d * bs], dot);
                acc = fmaf(__half2float(sp[(int64_t)g * bs]), dot, acc);
            }
        } else {
            const __half *kp = kv_blk(a.kc, a.ht.kc, blk, nd, per) + (int64_t)kvh * hd * bs + slot;
            for (int d = 0; d < hd; d++) acc = fmaf(q[d], __half2float(kp[(int64_t)d * bs]), acc);
        }
        s[j] = acc;
        mx = fmaxf(mx, acc);
    }
    float sum = 0.0f;
    for (int32_t j = 0; j < nk; j++) sum += (s[j] = expf(s[j] - mx));
    float *o = a.out + (int64_t)t * a.n_head * hd + h * hd;
    if constexpr (Q8) {
        for (int d = 0; d < hd; d++) {
            float acc = 0.0f;
            for (int32_t j = 0; j < nk; j++) {
                const int64_t blk = bt[j / bs], slot = j % bs;
                const __half *vsp = kv_blk(a.vs, a.ht.vs, blk, nd, per / 32) + slot * kd32;
                const int8_t *vp = kv_blk(a.v8, a.ht.v8, blk, nd, per) + slot * kd;
                const float ws = s[j] * __half2float(vsp[((int64_t)kvh * hd + d) / 32]);
                acc = fmaf(ws, (float)vp[(int64_t)kvh * hd + d], acc);
            }
            o[d] = acc / sum;
        }
    } else {
    for (int d = 0; d < hd; d++) {
        float acc = 0.0f;
        for (int32_t j = 0; j < nk; j++) {
            const __half *vp = kv_blk(a.vc, a.ht.vc, bt[j / bs], nd, per) + (int64_t)(j % bs) * kd + (int64_t)kvh * hd;
            acc = fmaf(s[j], __half2float(vp[d]), acc);
        }
        o[d] = acc / sum;
    }
    }
}

/* k_attention at decode: one chunk stage (half the shared memory, more blocks per SM) from
 * ATT_ONE_STAGE_MIN tokens, two below (at 32 sequences one stage saves 0.2-0.5 ms a step on an H200,
 * at 8 two stages are 0.06 ms faster; docs/gpu-runs.md). The stages change when copies are issued,
 * not the arithmetic: same bits. */
#define ATT_ONE_STAGE_MIN 16
static stg_status launch_attention(attn_args &aa, int32_t n_tok, cudaStream_t st) {
    aa.stages = aa.hd <= 128 ? (n_tok >= ATT_ONE_STAGE_MIN ? 1 : 2) : 1;
    const size_t smem = att_smem_bytes(aa.hd, aa.stages);
    if (smem > ATT_SMEM_MAX) return fail(ST_EUNSUPPORTED, "attention: head_dim %d needs too much shared memory", aa.hd);
    const dim3 grid((unsigned)n_tok, (unsigned)aa.n_head);
    const bool half2 = aa.hd % 64 == 0;
    if (half2 && aa.hd == 128 && aa.fused && aa.qa.rope_dim <= 128)
        launch_k(k_attention<true, 128, true>, grid, ATT_WARPS * 32, smem, st, aa);
    else if (half2 && aa.hd == 128) launch_k(k_attention<true, 128>, grid, ATT_WARPS * 32, smem, st, aa);
    else if (half2) launch_k(k_attention<true, 0>, grid, ATT_WARPS * 32, smem, st, aa);
    else launch_k(k_attention<false, 0>, grid, ATT_WARPS * 32, smem, st, aa);
    LAUNCHED("attention");
    return ST_OK;
}
