/* Split-KV decode attention (flash-decoding across blocks): at long context a decode step's attention
 * spreads each sequence's keys over many blocks instead of one block per (token, head) walking them all.
 *
 * A step splits when every token belongs to another sequence (decode), it has at most ATT_SPLIT_MAX_T tokens,
 * its longest sequence has at least stg_settings.att_split_min keys, and the model's heads take the
 * split kernel (att_split_ok: head_dim 32 / 64 / 128, at most 8 query heads per kv head, dividing 16). Then the
 * layer runs k_qkv_post (not the fused head prep), the split kernel k_attention_split_mma (tensor cores) over the
 * grid (token, kv head, split) and k_attention_combine (a block per (token, head)): the splits' (max, sum,
 * unnormalised output) merged into the output and, where the output projection reads 8-bit blocks, its
 * quantisation (quant_block32, as every attention kernel does it).
 *
 * The grid depth comes from the padded block-table width (part of a captured graph's key), so a graph
 * replays for every length up to it; each token's own split count follows its length (att_split_chunks)
 * and blocks past it exit before their wait. Which splits a sequence gets depends on its length, the
 * setting and the device's SM count only: a sequence's bits do not depend on its batch, and one below
 * att_split_min keys (one split) gets exactly the unsplit kernels' bits (the split kernel runs k_attention's
 * own blocks for it).
 *
 * Exactness: a split sequence sums its keys in another order (per split, then across splits with one
 * more rescale) and rounds q and p to f16 hi + lo, so it is not bitwise the unsplit kernel's;
 * tests/engine/gpu/test_gpu_attention_split.py holds it within 1e-4 of max|out| of the unsplit kernel and 1e-3
 * of the CPU reference (docs/engine.md). */
#include "attention.cuh"

#define ATT_SPLIT_MAX_T 64 /* decode steps of at most this many tokens split (the partials' scratch) */
#define ATT_SPLIT_WAVES 2  /* a batch-1 sequence is cut into about this many blocks per SM */

/* Splits of one sequence at most on a device of n_sm SMs: enough (token, kv head, split) blocks for
 * ATT_SPLIT_WAVES per SM at batch 1, within ATT_SPLIT_MAX. */
static int32_t att_split_zmax(int32_t n_sm, int32_t n_kv) {
    const int32_t z = (ATT_SPLIT_WAVES * std::max(n_sm, 1) + n_kv - 1) / n_kv;
    return std::max(1, std::min(z, ATT_SPLIT_MAX));
}

/* The split kernel for a model's heads: head_dim 32, 64 or 128 and G = n_head / n_kv at most 8 (one m16n8k16
 * fragment's hi rows) and dividing 16 (att_tile_tokens). */
static bool att_split_ok(int32_t n_head, int32_t n_kv, int32_t hd) {
    return att_tile_tokens(n_head, n_kv, hd) > 0 && n_head / n_kv <= 8;
}

/* The grid depth of a split launch: att_split_bound of the tables' width, and at least G (query heads per kv
 * head), so that a token of one split has a block (t, kv head, z) for each head z of its group
 * (k_attention_split_mma runs the unsplit kernel's blocks for it). */
static int32_t att_split_depth(int64_t cap_keys, int32_t min_chunks, int32_t z_max, int32_t G) {
    return std::max(att_split_bound(cap_keys, min_chunks, z_max), std::min(G, (int32_t)ATT_SPLIT_MAX));
}

/* The split grid's depth for a step (1: no split; see the top of this file): a decode step whose longest
 * sequence has max_keys >= att_split_min keys; cap_keys: the padded block-table width in tokens. */
static int32_t att_split_grid(const stg_settings &set, const st_model_desc &d, int32_t z_max, int32_t T, bool decode,
                              int32_t max_keys, int64_t cap_keys) {
    if (!decode || set.att_split_min < 1 || T > ATT_SPLIT_MAX_T || max_keys < set.att_split_min) return 1;
    if (d.arch == ST_ARCH_GPT_OSS) return 1; /* sinks and windows: k_attention only (gptoss.cu) */
    if (!att_split_ok(d.n_head, d.n_head_kv, d.head_dim)) return 1;
    return att_split_depth(cap_keys, ATT_SPLIT_CHUNKS, z_max, d.n_head / d.n_head_kv);
}

/* ------------------------------------------------------------ the tensor-core split kernel */

/* k_attention_split_mma: block (t, kv head, split) over its split's chunks, the G <= 8 query heads of the kv group
 * as the rows of one m16n8k16 fragment (mma.sync, f16 inputs, f32 accumulation). Rows 0-7 carry each head's q
 * rounded to f16 (hi) and rows 8-15 the rest (lo = q - hi, as f16), so one mma gives both halves of a score and
 * their sum is the score at the fp32 accumulation's level (K is f16 in the cache); the probabilities enter p.v
 * the same way (hi in rows 0-7, lo in rows 8-15: the output's two halves are added at the end), so the result is
 * within rounding of the fp32 kernels while a 16-key chunk costs a warp about 40 instructions of mma and
 * ldmatrix instead of the fp32 query tile's ~3,000.
 *
 * Each warp streams the chunks c_lo + w, c_lo + w + ATT_WARPS, ... through ASM_NS stages of its own (16-byte
 * cp.async, K as the cache holds it [dim][16 keys], V [key][dim], both XOR-swizzled by 16-byte piece so that
 * the transposed ldmatrix reads hit distinct banks), with its own online softmax; the warps' (max, sum, output)
 * are merged at the end as k_attention_tile merges them and written unnormalised to the partials. The block
 * ids of a warp's next 32 chunks sit one per lane (one load per 32 chunks). Chunks that cannot hold this
 * step's new key (written by k_qkv_post, the predecessor) are issued before the wait. The next layer's K / V is
 * not prefetched into L2 here (docs/engine.md: it measured slower).
 *
 * A token of one split (att_split_chunks: below split_min keys) runs the unsplit decode kernel's blocks instead
 * (att_decode_head, one per head of the group on blocks z < G), so a short sequence batched with a long one gets
 * its bits and its speed alone. */
#define ASM_NS 2 /* K/V chunk stages per warp (two blocks of 128 threads an SM with the static arrays) */
/* Q8: raw stages per warp. A raw chunk is 34 HD bytes against the F16 chunk's 64 HD, so four of them keep about
 * the bytes in flight of the F16 kernel's two (the same copies outstanding per SM at the same occupancy). At
 * head_dim 128 four take 102,656 bytes a block, over sm_89's 101,376: there the kernel takes three (85,248 bytes;
 * the same arithmetic, so the same bits, with fewer copies in flight): asm_q8_stages. */
#define ASM_Q8_NS 4
template <int HD> __host__ __device__ constexpr size_t asm_stage_halves() { return 2u * ATT_CK * HD; }
/* Q8 (the 8-bit cache): a chunk's raw stage, copied as the cache holds it: K values [HD][16], V values [16][HD],
 * K scales [HD / 32][16] and V scales [16][HD / 32] (F16): 34 HD bytes. */
template <int HD> __host__ __device__ constexpr size_t asm_q8_raw_bytes() { return 34u * HD; }
/* dynamic shared memory; QNS: the 8-bit form's raw stages a warp */
template <int HD, bool Q8 = false, int QNS = ASM_Q8_NS> static constexpr size_t asm_smem_bytes() {
    constexpr size_t merge = (size_t)ATT_WARPS * 8 * (HD + 8) * sizeof(float);
    if constexpr (Q8) { /* per warp: QNS raw stages and one F16 chunk (the values as integers) */
        return std::max((size_t)ATT_WARPS * (QNS * asm_q8_raw_bytes<HD>() + asm_stage_halves<HD>() * sizeof(__half)),
                        merge);
    } else {
        constexpr size_t stages = (size_t)ATT_WARPS * ASM_NS * asm_stage_halves<HD>() * sizeof(__half);
        constexpr size_t tile = (size_t)ATT_WARPS * 2 * 2 * ATT_CK * HD * sizeof(__half); /* att_smem_bytes(HD, 2): att_decode_head */
        return std::max(stages, std::max(merge, tile));
    }
}
/* static shared memory: the warps' maxima and sums (wm, wl) */
constexpr size_t asm_static_bytes() { return 2u * ATT_WARPS * 8 * sizeof(float); }
/* whether the 8-bit form of QNS raw stages fits a block of a device that opts in to smem_optin bytes */
template <int HD, int QNS> constexpr bool asm_q8_fits(int smem_optin) {
    return asm_smem_bytes<HD, true, QNS>() + asm_static_bytes() <= (size_t)smem_optin;
}
/* The 8-bit form's raw stages a warp on such a device: ASM_Q8_NS where they fit, else 3 at head_dim 128 (sm_89);
 * 0 where none fits (head_dim 64 needs 51,456 bytes, 128 85,248). */
static int asm_q8_stages(int32_t hd, int smem_optin) {
    if (hd == 64) return asm_q8_fits<64, ASM_Q8_NS>(smem_optin) ? ASM_Q8_NS : 0;
    if (hd != 128) return 0;
    return asm_q8_fits<128, ASM_Q8_NS>(smem_optin) ? ASM_Q8_NS : asm_q8_fits<128, 3>(smem_optin) ? 3 : 0;
}

/* 16 int8 values (one 16-byte word) as 16 exact halves (two words): each byte b xor 0x80 becomes the half
 * 1024 + (b + 128) (exponent of 1024, the byte as mantissa), minus 1152. */
__device__ __forceinline__ void i8x16_to_half(const uint4 u, uint4 &h0, uint4 &h1) {
    const uint32_t w[4] = {u.x ^ 0x80808080u, u.y ^ 0x80808080u, u.z ^ 0x80808080u, u.w ^ 0x80808080u};
    uint32_t r[8];
    const __half2 off = __half2half2(__ushort_as_half((unsigned short)0x6480)); /* 1152 */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t lo = __byte_perm(w[i], 0x64646464u, 0x4140), hi = __byte_perm(w[i], 0x64646464u, 0x4342);
        const __half2 a = __hsub2(*(const __half2 *)&lo, off), b = __hsub2(*(const __half2 *)&hi, off);
        r[2 * i] = *(const uint32_t *)&a, r[2 * i + 1] = *(const uint32_t *)&b;
    }
    h0 = make_uint4(r[0], r[1], r[2], r[3]), h1 = make_uint4(r[4], r[5], r[6], r[7]);
}

/* The 8-bit form's helpers: x as an opaque value (the compiler keeps it in a register instead of computing it
 * again where it is used), and shared-memory accesses at shared-window addresses (a base kept in a register plus a
 * constant: one instruction each), the copies predicated instead of branched around. */
template <class T> __device__ __forceinline__ T asm_keep(T x) {
    asm volatile("" : "+r"(x));
    return x;
}
__device__ __forceinline__ void cp_async16_s(uint32_t s, const void *gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
/* N bytes (16, 8 or 4) where p */
template <int N> __device__ __forceinline__ void cp_async_if(bool p, uint32_t s, const void *gmem) {
    if constexpr (N == 16)
        asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n@q cp.async.cg.shared.global [%0], [%1], 16;\n}\n" ::"r"(s),
                     "l"(gmem), "r"((int)p)
                     : "memory");
    else
        asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n@q cp.async.ca.shared.global [%0], [%1], %3;\n}\n" ::"r"(s),
                     "l"(gmem), "r"((int)p), "n"(N)
                     : "memory");
}
__device__ __forceinline__ uint4 lds128(uint32_t s) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(s)
                 : "memory");
    return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t s) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(s) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t s) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(s) : "memory");
    return v;
}
__device__ __forceinline__ void sts128(uint32_t s, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(s), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ void ldsm_t_s(uint32_t (&r)[4], uint32_t s) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s)
                 : "memory");
}
/* The 8-bit form's swizzle of V's raw rows (HD bytes, 16-byte pieces): row j's piece p lies at piece p ^ vsw(j),
 * so that the 8 rows of each ldmatrix (keys 8 h .. 8 h + 7, one piece) fall on 8 distinct 16-byte bank groups. */
template <int HD> __device__ __forceinline__ int asm_q8_vsw(int j) { return HD == 128 ? (j & 7) : ((j >> 1) & 3); }

/* Q8 (the 8-bit cache, attn_args.k8): each warp's chunks are copied raw (asm_q8_raw_bytes) through QNS stages,
 * K's integer values turned into exact halves in the warp's F16 chunk (the F16 kernel's swizzled layout), V's read
 * from the raw stage straight into the mma's fragments and turned into halves there, and the scales applied in
 * fp32: a score is the sum over groups of 32 dimensions of the group's K scale times the mma's dot of q (hi + lo)
 * with the integers (kv.c's q8_score, in another order), and p.v takes, per group of 32 dimensions, p times the
 * key's V scale as its weights (q8_add_value's w * d). A token of one split is one block
 * (z = 0) over all its chunks, normalised by the combine; there is no unsplit kernel on this cache. */
template <int HD, bool Q8 = false, int QNS = ASM_Q8_NS>
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attention_split_mma(attn_args a) {
    pdl_trigger();
    constexpr int KS = HD / 16, DT = HD / 8, VPC = HD / 8, VSW = (VPC >= 8 ? 8 : VPC) - 1, OP = HD + 8, NG = HD / 32;
    constexpr int NS = Q8 ? QNS : ASM_NS; /* the warp's stages */
    const int t = blockIdx.x, kvh = blockIdx.y;
    const int32_t nk = a.pos[t] + 1, nc = (nk + ATT_CK - 1) / ATT_CK;
    const int32_t cps = att_split_chunks(nk, a.split_min, a.split_chunks, a.split_max);
    const int G = a.n_head / a.n_kv;
    if constexpr (!Q8) { /* the 8-bit form has no unsplit kernel (nor its static shared memory: asm_static_bytes) */
        if (cps >= nc && !a.split_x) { /* one split, no CPU split: blocks z < G run the unsplit kernel's head z */
            if ((int)blockIdx.z < G) {
                const int h = (int)blockIdx.y * G + (int)blockIdx.z;
                if constexpr (HD == 128) att_decode_head<true, 128, false>(a, t, h);
                else if constexpr (HD == 64) att_decode_head<true, 0, false>(a, t, h);
                else att_decode_head<false, 0, false>(a, t, h);
            }
            return;
        }
    }
    const int32_t c_lo = (int32_t)blockIdx.z * cps;
    if (c_lo >= nc) return; /* the whole block: no barrier reached yet */
    const int32_t c_hi = min(nc, c_lo + cps);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t4 = lane & 3;
    const int kd = a.n_kv * HD, bs = a.block_size;
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ float wm[ATT_WARPS][8], wl[ATT_WARPS][8]; /* asm_static_bytes() */
    const bool last = c_hi == nc;
    const int32_t *bt = a.block_tables + (int64_t)a.seq[t] * a.max_blocks;
    /* F16: the warp's NS stages; Q8: its F16 chunk, then its NS raw stages */
    __half *const wbuf = Q8 ? (__half *)(att_dyn + (size_t)warp * (NS * asm_q8_raw_bytes<HD>() +
                                                                   asm_stage_halves<HD>() * sizeof(__half)))
                            : (__half *)att_dyn + (size_t)warp * NS * asm_stage_halves<HD>();
    [[maybe_unused]] unsigned char *const wraw = (unsigned char *)(wbuf + asm_stage_halves<HD>()); /* Q8 only */
    /* this warp's chunks: i = 0 .. n_my - 1 is chunk c_lo + warp + ATT_WARPS * i */
    const int n_my = c_hi - c_lo > warp ? (c_hi - c_lo - warp + ATT_WARPS - 1) / ATT_WARPS : 0;
    int32_t blkv = 0; /* lane j: the KV block of the warp's chunk i0 + j */
    auto load_blocks = [&](int i0) {
        const int i = i0 + lane;
        blkv = i < n_my ? bt[(c_lo + warp + ATT_WARPS * i) * ATT_CK / bs] : 0;
    };
    /* F16: chunk i of the warp into stage i % NS (an empty group past the end) */
    [[maybe_unused]] auto issue_f16 = [&](int i) {
        if (i < n_my) {
            if (i % 32 == 0 && i > 0) load_blocks(i);
            const int32_t blk = __shfl_sync(0xffffffffu, blkv, i % 32), c = c_lo + warp + ATT_WARPS * i;
            const int slot0 = (c * ATT_CK) % bs;
            const int64_t per = (int64_t)kd * bs, nd = a.ht.n_dev;
            __half *ks = wbuf + (size_t)(i % NS) * asm_stage_halves<HD>(), *vs = ks + ATT_CK * HD;
            const __half *kg = kv_blk(a.kc, a.ht.kc, blk, nd, per) + (int64_t)kvh * HD * bs + slot0;
            const __half *vg = kv_blk(a.vc, a.ht.vc, blk, nd, per) + (int64_t)slot0 * kd + (int64_t)kvh * HD;
#pragma unroll
            for (int it = lane; it < 2 * HD; it += 32) {
                const int d = it >> 1, pc = it & 1;
                cp_async16(ks + d * ATT_CK + 8 * (pc ^ ((d >> 2) & 1)), kg + (int64_t)d * bs + 8 * pc);
                const int j = it / VPC, pv = it % VPC;
                cp_async16(vs + j * HD + 8 * (pv ^ (j & VSW)), vg + (int64_t)j * kd + 8 * pv);
            }
        }
        cp_async_commit();
    };
    /* Q8: the chunk's raw copies (K's HD rows of 16 bytes, V's 16 rows of HD bytes, then the scales), addressed from
     * per-lane offsets inside a KV block (launch_attention_split checks that a block's elements fit in int32) and
     * from shared addresses fixed for the launch, kept in registers (asm_keep: computed once, not again each
     * chunk); the chunk's first slot follows from the last one's (no division by the block size a chunk) and its
     * stage from a counter. V's rows land XOR-swizzled by 16-byte piece (asm_q8_vsw), which the transposed
     * ldmatrix of the raw bytes reads without bank conflicts. Lanes below HD / 16 copy K's scales, lanes 16 .. 31
     * V's (key lane - 16). */
    constexpr int PPR = HD / 16, KR = HD / 32; /* V's 16-byte pieces a row; copies of K (and of V) a lane */
    constexpr int VR = HD == 128 ? 2 : 1;      /* V's destination patterns (row j's swizzle repeats every VR) */
    constexpr uint32_t RAWB = (uint32_t)asm_q8_raw_bytes<HD>();
    [[maybe_unused]] const int32_t per32 = kd * bs, kdg = kd / 32, nd32 = a.ht.n_dev;
    [[maybe_unused]] uint32_t ksrc[KR], vsrc[KR]; /* K row kvh HD + lane + 32 r; V row (lane + 32 r) / PPR, its piece */
    [[maybe_unused]] uint32_t vdst[VR];           /* + 512 (r - r % VR): V's piece in the raw stage */
    [[maybe_unused]] uint32_t ssrc = 0, smul = 0; /* the scales' elements inside the block; the slot's multiple */
    [[maybe_unused]] uint32_t sraw = 0, kdst = 0, sdst = 0; /* the warp's raw stage 0; K's row lane in a stage; the scales' */
    if constexpr (Q8) {
#pragma unroll
        for (int r = 0; r < KR; r++) {
            const int j = (lane + 32 * r) / PPR;
            ksrc[r] = asm_keep((uint32_t)((kvh * HD + lane + 32 * r) * bs));
            vsrc[r] = asm_keep((uint32_t)(j * kd + kvh * HD + 16 * (lane % PPR)));
            if (r < VR) vdst[r] = asm_keep((uint32_t)(16 * HD + HD * j + 16 * ((lane % PPR) ^ asm_q8_vsw<HD>(j))));
        }
        const bool kl = lane < HD / 16;
        const int sk = lane - ATT_CK;
        ssrc = asm_keep((uint32_t)(kl ? (kvh * NG + (lane >> 1)) * bs + 8 * (lane & 1) : sk * kdg + kvh * NG));
        smul = asm_keep((uint32_t)(kl ? 1 : kdg));
        sdst = asm_keep((uint32_t)(kl ? 32 * HD + 16 * lane : 33 * HD + 2 * NG * sk));
        sraw = asm_keep((uint32_t)__cvta_generic_to_shared(wraw));
        kdst = asm_keep(16u * (uint32_t)lane);
    }
    [[maybe_unused]] int32_t islot = ((c_lo + warp) * ATT_CK) % bs; /* the next issued chunk's first slot */
    [[maybe_unused]] const int32_t sstep = (ATT_WARPS * ATT_CK) % bs;
    [[maybe_unused]] uint32_t ist = 0; /* the next issued chunk's stage (byte offset) */
    /* Q8: chunk i's copies (an empty group past the end); chunks are issued in order 0, 1, ... */
    [[maybe_unused]] auto issue_q8 = [&](int i) {
        if (i < n_my) {
            if (i % 32 == 0 && i > 0) load_blocks(i);
            const int32_t blk = __shfl_sync(0xffffffffu, blkv, i & 31);
            const bool dev = blk < nd32;
            const int32_t b = dev ? blk : blk - nd32;
            const int64_t e = (int64_t)b * per32, es = (int64_t)b * (per32 / 32);
            const int8_t *kg = (dev ? a.k8 : a.ht.k8) + (e + islot);
            const int8_t *vg = (dev ? a.v8 : a.ht.v8) + (e + islot * kd);
            const uint32_t st = sraw + ist;
#pragma unroll
            for (int r = 0; r < KR; r++) {
                cp_async16_s(st + kdst + 512 * r, kg + ksrc[r]);
                cp_async16_s(st + vdst[r % VR] + 512 * (r - r % VR), vg + vsrc[r]);
            }
            const __half *sb = lane < HD / 16 ? (dev ? a.ks : a.ht.ks) : (dev ? a.vs : a.ht.vs);
            const __half *sg = sb + (es + (ssrc + (uint32_t)islot * smul));
            cp_async_if<16>(lane < HD / 16, st + sdst, sg);
            cp_async_if<2 * NG>(lane >= ATT_CK, st + sdst, sg);
        }
        cp_async_commit();
        islot += sstep;
        if (islot >= bs) islot -= bs;
        ist = ist == (NS - 1) * RAWB ? 0 : ist + RAWB;
    };
    [[maybe_unused]] auto issue = [&](int i) {
        if constexpr (Q8) issue_q8(i);
        else issue_f16(i);
    };
    load_blocks(0);
    /* before the wait: the chunks that cannot hold the new key (only the last chunk does) */
    if (!last)
        for (int i = 0; i < NS - 1; i++) issue(i);
    pdl_wait();
    if (last)
        for (int i = 0; i < NS - 1; i++) issue(i);
    /* q of head kvh * G + g: rows g (hi) and g + 8 (lo) of the A fragments, every k step */
    uint32_t qf[KS][4];
    {
        const float *qr = g >= G ? nullptr : a.q + (int64_t)t * a.n_head * HD + (int64_t)(kvh * G + g) * HD;
#pragma unroll
        for (int kk = 0; kk < KS; kk++)
#pragma unroll
            for (int hpart = 0; hpart < 2; hpart++) { /* cols 16 kk + 2 t4 (+ 8) */
                const float2 x = qr ? *(const float2 *)(qr + 16 * kk + 2 * t4 + 8 * hpart) : make_float2(0.0f, 0.0f);
                const __half hx = __float2half_rn(x.x), hy = __float2half_rn(x.y);
                qf[kk][2 * hpart] = amma_pack(__half2float(hx), __half2float(hy));
                qf[kk][2 * hpart + 1] = amma_pack(x.x - __half2float(hx), x.y - __half2float(hy));
            }
    }
    float o[DT][4];
#pragma unroll
    for (int i = 0; i < DT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m = -INFINITY, l = 0.0f; /* head g's running max; this lane's share of its sum */
    const int mi = lane >> 3, mr = lane & 7;
    if constexpr (Q8) {
        /* per group of 32 dimensions, a score is its K scale times the mma's dot with the integers (K through the
         * warp's F16 chunk, turned into exact halves there and read as the F16 loop reads its stage); V's integers
         * go straight from the raw stage into B fragments (ldmatrix.trans of the bytes as b16 pairs: a lane gets keys
         * 2 t4, 2 t4 + 1 (+ 8) of two adjacent dimensions, split into the tile of even dimensions and the tile of odd
         * ones), so o[2 P] holds dimensions 16 P + 4 t4 + {0, 2} and o[2 P + 1] 16 P + 4 t4 + {1, 3}; p.v takes, per
         * group of 32 dimensions, p times the key's V scale as its weights; the rescale is skipped where no row's
         * max moved (a multiply by exactly 1: expf(0) is 1). Shared addresses: kept bases plus constants. */
        const uint32_t sw16 = (uint32_t)__cvta_generic_to_shared(wbuf); /* the F16 chunk (K only here) */
        const int ksw = (lane >> 2) & 1;                                  /* K row d = lane + 32 r's swizzle */
        const uint32_t kst0 = asm_keep(sw16 + 32 * lane + 16 * ksw), kst1 = asm_keep(sw16 + 32 * lane + 16 * (1 - ksw));
        /* K's ldmatrix: dims 16 kk + 8 (mi & 1) + mr, keys 8 (mi >> 1) .. (+ 512 kk bytes) */
        const uint32_t kld = asm_keep(sw16 + 32 * (8 * (mi & 1) + mr) + 16 * ((mi >> 1) ^ ((mr >> 2) & 1)));
        const int vj = 8 * (mi & 1) + mr; /* the V row (key) whose address this lane gives each ldmatrix */
        uint32_t voffs[NG];               /* piece 2 gv + (mi >> 1) of row vj in a raw stage */
#pragma unroll
        for (int gv = 0; gv < NG; gv++)
            voffs[gv] = asm_keep((uint32_t)(16 * HD + HD * vj + 16 * ((2 * gv + (mi >> 1)) ^ asm_q8_vsw<HD>(vj))));
        /* the scales a lane reads: K's of keys 8 nt + 2 t4 (+ 1) (+ 32 gk + 16 nt bytes); V's of keys 2 t4, 2 t4 + 1
         * (+ 8) (NG halves each: + 16 NG nt bytes) */
        const uint32_t ksl = asm_keep((uint32_t)(32 * HD + 4 * t4)), vsl = asm_keep((uint32_t)(33 * HD + 4 * NG * t4));
        const __half2 v_off = __half2half2(__ushort_as_half((unsigned short)0x6480)); /* 1152: i8x16_to_half's */
        uint32_t cst = 0;                                                                /* chunk i's stage (bytes) */
        for (int i = 0; i < n_my; i++) {
            issue(i + NS - 1);
            cp_async_wait<NS - 1>();
            __syncwarp();
            const uint32_t st = sraw + cst;
            cst = cst == (NS - 1) * RAWB ? 0 : cst + RAWB;
#pragma unroll
            for (int r = 0; r < KR; r++) { /* K row lane + 32 r: 16 keys */
                uint4 h0, h1;
                i8x16_to_half(lds128(st + kdst + 512 * r), h0, h1);
                sts128(kst0 + 1024 * r, h0);
                sts128(kst1 + 1024 * r, h1);
            }
            __syncwarp();
            const int k0 = (c_lo + warp + ATT_WARPS * i) * ATT_CK;
            const bool tail = k0 + ATT_CK > nk;
            float sc[4], mx = -INFINITY; /* keys k0 + 8 nt + 2 t4 + e at [2 nt + e] */
            {
                float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int gk = 0; gk < NG; gk++) {
                    float s[2][4] = {};
#pragma unroll
                    for (int kk = 2 * gk; kk < 2 * gk + 2; kk++) {
                        uint32_t b[4];
                        ldsm_t_s(b, kld + 512 * kk);
                        amma_f16(s[0], qf[kk], b[0], b[1]);
                        amma_f16(s[1], qf[kk], b[2], b[3]);
                    }
#pragma unroll
                    for (int nt = 0; nt < 2; nt++) {
                        const uint32_t kw = lds32(st + ksl + 32 * gk + 16 * nt); /* keys 8 nt + 2 t4, + 1 */
                        const float2 kf = __half22float2(*(const __half2 *)&kw);
#pragma unroll
                        for (int e = 0; e < 2; e++)
                            acc[2 * nt + e] = fmaf(e ? kf.y : kf.x, s[nt][e] + s[nt][2 + e], acc[2 * nt + e]);
                    }
                }
#pragma unroll
                for (int j = 0; j < 4; j++) sc[j] = acc[j];
                if (tail) /* keys past the last one: -inf (every key of the other chunks is below nk) */
#pragma unroll
                    for (int j = 0; j < 4; j++) sc[j] = k0 + 8 * (j >> 1) + 2 * t4 + (j & 1) < nk ? sc[j] : -INFINITY;
#pragma unroll
                for (int j = 0; j < 4; j++) mx = fmaxf(mx, sc[j]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m, mx), dm = m - mn;
            /* a row whose max moved (or a NaN) in any lane: the full rescale; else corr is expf(0) = 1 everywhere */
            const bool moved = __any_sync(0xffffffffu, dm != 0.0f);
            m = mn;
            float p[4], sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) p[j] = expf(sc[j] - mn), sum += p[j];
            if (moved) {
                const float corr = expf(dm); /* 0 on the warp's first chunk */
                l = __fmaf_rn(l, corr, sum);
#pragma unroll
                for (int dt = 0; dt < DT; dt++) o[dt][0] *= corr, o[dt][1] *= corr, o[dt][2] *= corr, o[dt][3] *= corr;
            } else {
                l = __fmaf_rn(l, 1.0f, sum);
            }
            /* V: matrices (keys 0-7, piece 2 gv), (keys 8-15, piece 2 gv), (keys 0-7, piece 2 gv + 1), (8-15, ...) */
            uint32_t vr[NG][4];
#pragma unroll
            for (int gv = 0; gv < NG; gv++) ldsm_t_s(vr[gv], st + voffs[gv]);
            if (tail) { /* keys past the last one to 0: p = 0 there, but 0 times a stale NaN is not 0 */
                const int nv = nk - k0;
                const uint32_t m0 = (2 * t4 < nv ? 0x0000ffffu : 0u) | (2 * t4 + 1 < nv ? 0xffff0000u : 0u);
                const uint32_t m1 = (2 * t4 + 8 < nv ? 0x0000ffffu : 0u) | (2 * t4 + 9 < nv ? 0xffff0000u : 0u);
#pragma unroll
                for (int gv = 0; gv < NG; gv++) vr[gv][0] &= m0, vr[gv][1] &= m1, vr[gv][2] &= m0, vr[gv][3] &= m1;
            }
            __half vsh[2][2][NG]; /* [nt][key 8 nt + 2 t4 (+ 1)][gv]: V's scales */
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                if constexpr (NG == 4) {
                    const uint4 w = lds128(st + vsl + 16 * NG * nt);
                    memcpy(vsh[nt], &w, sizeof(w));
                } else {
                    const uint2 w = lds64(st + vsl + 16 * NG * nt);
                    memcpy(vsh[nt], &w, sizeof(w));
                }
            }
#pragma unroll
            for (int gv = 0; gv < NG; gv++) { /* weights p times the key's V scale */
                uint32_t pg[4];
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const float w0 = __fmul_rn(p[2 * nt], __half2float(vsh[nt][0][gv]));
                    const float w1 = __fmul_rn(p[2 * nt + 1], __half2float(vsh[nt][1][gv]));
                    const __half h0 = __float2half_rn(w0), h1 = __float2half_rn(w1);
                    pg[2 * nt] = amma_pack(__half2float(h0), __half2float(h1));
                    pg[2 * nt + 1] = amma_pack(w0 - __half2float(h0), w1 - __half2float(h1));
                }
#pragma unroll
                for (int q = 0; q < 2; q++) { /* piece P = 2 gv + q: bytes (key, dim) -> exact halves */
                    uint32_t ev[2], od[2];
#pragma unroll
                    for (int h = 0; h < 2; h++) { /* keys 2 t4 (+ 8), 2 t4 + 1 (+ 8); dims 16 P + 2 g, + 1 */
                        const uint32_t w = vr[gv][2 * q + h] ^ 0x80808080u;
                        uint32_t lo = __byte_perm(w, 0x64646464u, 0x4240), hi = __byte_perm(w, 0x64646464u, 0x4341);
                        const __half2 x = __hsub2(*(const __half2 *)&lo, v_off), y = __hsub2(*(const __half2 *)&hi, v_off);
                        ev[h] = *(const uint32_t *)&x, od[h] = *(const uint32_t *)&y;
                    }
                    amma_f16(o[2 * (2 * gv + q)], pg, ev[0], ev[1]);
                    amma_f16(o[2 * (2 * gv + q) + 1], pg, od[0], od[1]);
                }
            }
            __syncwarp(); /* the stage is refilled NS - 1 chunks later */
        }
    } else {
        for (int i = 0; i < n_my; i++) {
            issue(i + NS - 1);
            cp_async_wait<NS - 1>();
            __syncwarp();
            __half *ks = wbuf + (size_t)(i % NS) * asm_stage_halves<HD>(), *vs = ks + ATT_CK * HD;
            const int k0 = (c_lo + warp + ATT_WARPS * i) * ATT_CK;
            if (k0 + ATT_CK > nk) { /* V rows past the last key to 0: p = 0 there, but 0 times a stale NaN is not 0 */
                for (int u = (nk - k0) * (HD / 8) + lane; u < ATT_CK * (HD / 8); u += 32)
                    *(uint4 *)(vs + 8 * u) = make_uint4(0u, 0u, 0u, 0u);
                __syncwarp();
            }
            float sc[4], mx = -INFINITY; /* keys k0 + 8 nt + 2 t4 + e at [2 nt + e] */
            {
                float s[2][4] = {};
#pragma unroll
                for (int kk = 0; kk < KS; kk++) { /* matrices: dims 16 kk + 8 (mi & 1) .., keys 8 (mi >> 1) .. */
                    const int d = 16 * kk + 8 * (mi & 1) + mr;
                    uint32_t b[4];
                    amma_ldsm_t(b, ks + d * ATT_CK + 8 * ((mi >> 1) ^ ((d >> 2) & 1)));
                    amma_f16(s[0], qf[kk], b[0], b[1]);
                    amma_f16(s[1], qf[kk], b[2], b[3]);
                }
#pragma unroll
                for (int nt = 0; nt < 2; nt++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float v = s[nt][e] + s[nt][2 + e]; /* hi row + lo row */
                        sc[2 * nt + e] = k0 + 8 * nt + 2 * t4 + e < nk ? v : -INFINITY;
                        mx = fmaxf(mx, sc[2 * nt + e]);
                    }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mn = fmaxf(m, mx), corr = expf(m - mn); /* 0 on the warp's first chunk */
            m = mn;
            float p[4], sum = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) p[j] = expf(sc[j] - mn), sum += p[j];
            l = __fmaf_rn(l, corr, sum);
            uint32_t pa[4]; /* P's A fragment: row g p as f16 (hi), row g + 8 the rest (lo); keys 2 t4 (+ 8) */
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const __half h0 = __float2half_rn(p[2 * nt]), h1 = __float2half_rn(p[2 * nt + 1]);
                pa[2 * nt] = amma_pack(__half2float(h0), __half2float(h1));
                pa[2 * nt + 1] = amma_pack(p[2 * nt] - __half2float(h0), p[2 * nt + 1] - __half2float(h1));
            }
#pragma unroll
            for (int dt = 0; dt < DT; dt++) o[dt][0] *= corr, o[dt][1] *= corr, o[dt][2] *= corr, o[dt][3] *= corr;
            for (int dp = 0; dp < DT / 2; dp++) { /* matrices: keys 8 (mi & 1) + mr, dims 8 (2 dp + (mi >> 1)) .. */
                const int j = 8 * (mi & 1) + mr;
                uint32_t b[4];
                amma_ldsm_t(b, vs + j * HD + 8 * ((2 * dp + (mi >> 1)) ^ (j & VSW)));
                amma_f16(o[2 * dp], pa, b[0], b[1]);
                amma_f16(o[2 * dp + 1], pa, b[2], b[3]);
            }
            __syncwarp(); /* the stage is refilled NS - 1 chunks later */
        }
    }
    cp_async_wait<0>();
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t4 == 0) wm[warp][g] = m, wl[warp][g] = n_my > 0 ? l : 0.0f;
    __syncthreads(); /* every warp's copies are done: the stages become the merge buffer */
    float *os = (float *)att_dyn + (size_t)warp * 8 * OP; /* [ATT_WARPS][8][OP]: the warp's output rows */
    if constexpr (Q8) { /* o[2 P] dimensions 16 P + 4 t4 + {0, 2}, o[2 P + 1] + {1, 3} */
#pragma unroll
        for (int P = 0; P < HD / 16; P++)
            *(float4 *)&os[g * OP + 16 * P + 4 * t4] =
                make_float4(o[2 * P][0] + o[2 * P][2], o[2 * P + 1][0] + o[2 * P + 1][2], o[2 * P][1] + o[2 * P][3],
                            o[2 * P + 1][1] + o[2 * P + 1][3]);
    } else {
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
            *(float2 *)&os[g * OP + 8 * dt + 2 * t4] = make_float2(o[dt][0] + o[dt][2], o[dt][1] + o[dt][3]);
    }
    __syncthreads();
    const float *all = (const float *)att_dyn;
    for (int r = warp; r < G; r += ATT_WARPS) {
        float M = -INFINITY;
        for (int wi = 0; wi < ATT_WARPS; wi++) M = fmaxf(M, wl[wi][r] > 0.0f ? wm[wi][r] : -INFINITY);
        float L = 0.0f, scw[ATT_WARPS];
        for (int wi = 0; wi < ATT_WARPS; wi++) {
            scw[wi] = wl[wi][r] > 0.0f ? expf(wm[wi][r] - M) : 0.0f;
            L = __fmaf_rn(wl[wi][r], scw[wi], L);
        }
        const int64_t prow = ((int64_t)t * a.n_head + kvh * G + r) * a.split_z + blockIdx.z;
        for (int d = lane; d < HD; d += 32) {
            float v = 0.0f;
            for (int wi = 0; wi < ATT_WARPS; wi++) v = __fmaf_rn(all[((size_t)wi * 8 + r) * OP + d], scw[wi], v);
            a.part_acc[prow * HD + d] = v;
        }
        if (lane == 0) a.part_ml[2 * prow] = M, a.part_ml[2 * prow + 1] = L;
    }
}

/* Merge of a (token, head)'s splits: M = max of the splits' maxima, each split weighed by
 * exp(max_s - M), the weighed sums added in a fixed tree, the outputs in split order, divided by that sum;
 * a token of one split has no partials (k_attention_split_mma wrote its output). Every load of the splits'
 * (max, sum) and outputs is issued at once (at most ATT_SPLIT_MAX, one or two a lane / thread). */
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attention_combine(attn_args a) {
    PDL_ENTER();
    __shared__ float sc[ATT_SPLIT_MAX];
    __shared__ float sL;
    const int t = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, hd = a.hd;
    const int32_t nk = a.pos[t] + 1;
    /* min: never binds; split_x: the CPU's split after the device's (kv_host_attn) */
    const int ns = min(att_split_count(nk, a.split_min, a.split_chunks, a.split_max), a.split_z - a.split_x) + a.split_x;
    if (ns == 1 && !a.k8) return; /* the unsplit kernel's blocks wrote it (k_attention_split_mma; 8-bit: its partial) */
    const int64_t p0 = ((int64_t)t * a.n_head + h) * a.split_z;
    const float *ml = a.part_ml + 2 * p0, *acc = a.part_acc + p0 * hd;
    if (warp == 0) { /* splits lane and lane + 32 */
        const bool h0 = lane < ns, h1 = lane + 32 < ns;
        const float m0 = h0 ? ml[2 * lane] : -INFINITY, l0 = h0 ? ml[2 * lane + 1] : 0.0f;
        const float m1 = h1 ? ml[2 * (lane + 32)] : -INFINITY, l1 = h1 ? ml[2 * (lane + 32) + 1] : 0.0f;
        const float M = warp_max(fmaxf(m0, m1));
        const float s0 = h0 ? expf(m0 - M) : 0.0f, s1 = h1 ? expf(m1 - M) : 0.0f;
        if (h0) sc[lane] = s0;
        if (h1) sc[lane + 32] = s1;
        float L = __fmaf_rn(l1, s1, l0 * s0);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
        if (lane == 0) sL = L;
    }
    __syncthreads();
    const int64_t row0 = ((int64_t)t * a.n_head + h) * hd;
    for (int d0 = warp * 32; d0 < hd; d0 += ATT_WARPS * 32) { /* a warp per 32 dimensions */
        const int d = d0 + lane;
        float v = 0.0f;
        if (d < hd) {
#pragma unroll 16
            for (int s = 0; s < ns; s++) v = __fmaf_rn(acc[(int64_t)s * hd + d], sc[s], v);
            v = __fdiv_rn(v, sL);
            a.out[row0 + d] = v;
        }
        if (a.aq) quant_block32(v, lane, a.aq + row0 + d0, a.ad + (row0 + d0) / 32, a.as + (row0 + d0) / 16);
    }
}

/* The F16 forms (at most 64 KiB, within every targeted device's limit) and the 8-bit forms that fit a block of
 * smem_optin bytes opt in to their dynamic shared memory (asm_q8_stages launches no other there). */
static stg_status attention_split_setup(int smem_optin) {
#define ASM_SETUP(HD)                                                                                        \
    CU(cudaFuncSetAttribute(k_attention_split_mma<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,           \
                            (int)asm_smem_bytes<HD>()),                                                       \
       "attention (split) setup");
#define ASM_SETUP_Q8(HD, QNS)                                                                                \
    if (asm_q8_fits<HD, QNS>(smem_optin)) {                                                                   \
        CU(cudaFuncSetAttribute(k_attention_split_mma<HD, true, QNS>, cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                (int)asm_smem_bytes<HD, true, QNS>()),                                        \
           "attention (split) setup");                                                                        \
    }
    ASM_SETUP(32)
    ASM_SETUP(64)
    ASM_SETUP(128)
    ASM_SETUP_Q8(64, ASM_Q8_NS)
    ASM_SETUP_Q8(128, ASM_Q8_NS)
    ASM_SETUP_Q8(128, 3)
#undef ASM_SETUP_Q8
#undef ASM_SETUP
    return ST_OK;
}

/* The 8-bit cache's kernels on a device whose blocks opt in to smem_optin bytes: a split decode form
 * (asm_q8_stages) and a prefill form (amma_pick). stg_kv_create_tiered refuses the cache (and the harness its
 * calls) with ST_EUNSUPPORTED where either is missing, instead of a launch failing in the first step. */
static stg_status kv_q8_device_check(int32_t hd, int smem_optin, const char *what) {
    if (!asm_q8_stages(hd, smem_optin))
        return fail(ST_EUNSUPPORTED,
                    "%s: the 8-bit KV cache's split decode kernel at head_dim %d needs %d bytes of shared memory a "
                    "block; this device allows %d",
                    what, hd, (int)(hd == 64 ? asm_smem_bytes<64, true>() : asm_smem_bytes<128, true, 3>()) +
                                  (int)asm_static_bytes(), smem_optin);
    if (!amma_pick(hd, smem_optin).rows)
        return fail(ST_EUNSUPPORTED,
                    "%s: the 8-bit KV cache's prefill kernel at head_dim %d needs %d bytes of shared memory a block; "
                    "this device allows %d",
                    what, hd, (int)(amma_smem_bytes(hd, 4, false) + amma_static_bytes(4)), smem_optin);
    return ST_OK;
}

static stg_status launch_attention_combine(const attn_args &aa, int32_t n_tok, cudaStream_t st) {
    launch_k(k_attention_combine, dim3((unsigned)n_tok, (unsigned)aa.n_head), ATT_WARPS * 32, 0, st, aa);
    LAUNCHED("attention (split combine)");
    return ST_OK;
}

/* The split kernel over grid (n_tok, n_kv, z) and, unless combine is false, the combine. aa: the layer's arguments
 * with part_acc / part_ml (room for n_tok * n_head * (z + split_x) rows) and split_min / split_chunks / split_max
 * set. The heads must take the split kernel (att_split_ok). smem_optin: the model's stg_model.smem_optin (the 8-bit
 * form's stages). */
static stg_status launch_attention_split(attn_args &aa, int32_t n_tok, int32_t z, int smem_optin,
                                         cudaStream_t st, bool combine = true) {
    if (z < 1 || z > ATT_SPLIT_MAX || aa.split_chunks < 1 || aa.split_max < 1 || aa.split_max > ATT_SPLIT_MAX ||
        !aa.part_acc || !aa.part_ml)
        return fail(ST_EINVAL, "split attention: %d splits, %d chunks each at least, at most %d splits", z,
                    aa.split_chunks, aa.split_max);
    if (!att_split_ok(aa.n_head, aa.n_kv, aa.hd))
        return fail(ST_EUNSUPPORTED, "split attention: n_head %d / n_kv %d / head_dim %d", aa.n_head, aa.n_kv, aa.hd);
    if (aa.fused) return fail(ST_EINVAL, "split attention: the head prep runs in k_qkv_post");
    if (aa.split_x && z + aa.split_x > ATT_SPLIT_MAX)
        return fail(ST_EINVAL, "split attention: %d splits and the CPU's exceed %d", z, ATT_SPLIT_MAX);
    aa.split_z = z + aa.split_x, aa.stages = 2;
    const dim3 grid((unsigned)n_tok, (unsigned)aa.n_kv, (unsigned)z);
    if (aa.k8) { /* the 8-bit cache: head_dim 64 or 128 (stg_kv_create_typed) */
        if (!aa.v8 || !aa.ks || !aa.vs || (aa.hd != 64 && aa.hd != 128))
            return fail(ST_EUNSUPPORTED, "split attention (8-bit KV): head_dim %d", aa.hd);
        const int qns = asm_q8_stages(aa.hd, smem_optin);
        if (!qns) return kv_q8_device_check(aa.hd, smem_optin, "split attention (8-bit KV)");
        /* the kernel's copies address a KV block's elements with int32 offsets */
        if ((int64_t)aa.n_kv * aa.hd * aa.block_size > INT32_MAX)
            return fail(ST_EUNSUPPORTED, "split attention (8-bit KV): a KV block of %d x %d x %d elements", aa.n_kv,
                        aa.hd, aa.block_size);
        if (aa.hd == 64)
            launch_k(k_attention_split_mma<64, true>, grid, ATT_WARPS * 32, asm_smem_bytes<64, true>(), st, aa);
        else if (qns == ASM_Q8_NS)
            launch_k(k_attention_split_mma<128, true>, grid, ATT_WARPS * 32, asm_smem_bytes<128, true>(), st, aa);
        else launch_k(k_attention_split_mma<128, true, 3>, grid, ATT_WARPS * 32, asm_smem_bytes<128, true, 3>(), st, aa);
    } else if (aa.hd == 128) launch_k(k_attention_split_mma<128>, grid, ATT_WARPS * 32, asm_smem_bytes<128>(), st, aa);
    else if (aa.hd == 64) launch_k(k_attention_split_mma<64>, grid, ATT_WARPS * 32, asm_smem_bytes<64>(), st, aa);
    else launch_k(k_attention_split_mma<32>, grid, ATT_WARPS * 32, asm_smem_bytes<32>(), st, aa);
    LAUNCHED("attention (split)");
    return combine ? launch_attention_combine(aa, n_tok, st) : ST_OK;
}
