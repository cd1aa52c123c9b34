/* Attention's arguments and shared helpers (decode and prefill kernels). */
#pragma once
#include "linear.cuh"

/* ------------------------------------------------------------ attention */

struct attn_args {
    const float *q; /* [T, n_head * hd], pre-scaled */
    float *out;     /* [T, n_head * hd] */
    const __half *kc, *vc;
    /* the 8-bit cache (STG_KV_Q8_0; kv_store's layout: int8 values at the F16 layout's indices, an F16 scale per 32
     * values, K's [block][kv_dim / 32][block_size], V's [block][block_size][kv_dim / 32]); NULL: the F16 kc / vc.
     * Read by the split decode kernel, the tensor-core prefill kernel and the reference only. */
    const int8_t *k8 = nullptr, *v8 = nullptr;
    const __half *ks = nullptr, *vs = nullptr;
    kv_host ht; /* a tiered cache's host arrays of this layer: physical blocks >= ht.n_dev (kv_blk) */
    const int32_t *pos, *seq, *block_tables;
    int32_t max_blocks, n_head, n_kv, hd, block_size;
    int32_t stages;                 /* 2: the next chunk's copies fly while this one is used */
    int8_t *aq;                     /* non-NULL: also quantise the output rows (hd % 32 == 0) */
    float *ad;
    int32_t *as;
    /* fused: k_qkv_post's work done here (steps whose tokens all belong to different
     * sequences: decode). q holds the raw q rows then; each block prepares its own q head and
     * its kv head's new K and V (the first q head of each kv group also writes them to the
     * cache) and uses the new key from shared memory, not from the slot being written. */
    int32_t fused;
    int32_t pre; /* fused only: step inputs and the first K/V chunks read before the wait */
    qkv_args qa;
    const __half *kc_next, *vc_next; /* PREP and the split kernel: the next layer's K / V arena (L2 prefetch); NULL: none */
    /* split-KV decode (attention_split.cu): each sequence's keys in splits of att_split_chunks chunks,
     * a block per (token, kv head, split) writing its rows' unnormalised output to part_acc
     * [T][n_head][split_z][hd] and their (max, sum) to part_ml [T][n_head][split_z][2] */
    float *part_acc, *part_ml;
    int32_t split_z;      /* the launch's splits per token (grid z, the partials' stride) */
    int32_t split_min;    /* sequences of fewer keys stay in one split */
    int32_t split_chunks; /* chunks a split holds at least */
    int32_t split_max;    /* splits of one sequence at most */
    int32_t split_x = 0;  /* 1: one more split per token after the device's (kv_host_attn: the CPU's partial of the
                           * host-tier blocks, placed by k_host_part_place); split_z counts it (the stride), the
                           * grid does not, and every token writes partials (no unsplit kernel's output) */
    /* gpt-oss (k_attention only): sinks [n_head] one logit per head joining each softmax's denominator (NULL:
     * none); n_swa > 0: a query at position p sees the keys p - n_swa + 1 .. p only (0: every earlier key) */
    const float *sinks;
    int32_t n_swa;
};
/* Warp reductions over the 16 lanes of each half when both halves hold the same 16 values (k_attention's keys:
 * lane and lane ^ 16 score the same key): warp_max's xor-16 level would only take a value's max with itself, and
 * warp_sum(half ? 0 : v)'s would add an exact 0 (the sums are of expf values, never -0), so these give their bits. */
__device__ __forceinline__ float warp_max16(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum16(float v) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}


/* Paged attention, flash-decoding style: one block per (token, head); its ATT_WARPS warps
 * take interleaved chunks of ATT_CK = 16 keys (a chunk never crosses a KV block: block sizes
 * are multiples of 16). A warp copies its chunk's K [hd][16] and V [16][hd] into its own
 * shared memory with 16-byte asynchronous copies (every load of the chunk in flight at
 * once, the next chunk's while this one is used when `stages` is 2), then: scores with lane
 * = key (two lanes per key, even / odd dimensions, added in a fixed order), an online
 * softmax, values with lane = dimension. The warps' partial (max, sum, output) are merged
 * at the end; with aq the output is quantised to 8-bit blocks in the same pass (bitwise
 * k_quant_act). Dynamic shared memory: ATT_WARPS * stages * 2 * 16 * hd halves. */
#define ATT_WARPS 4
#define ATT_CK 16
static inline size_t att_smem_bytes(int hd, int stages) {
    return (size_t)ATT_WARPS * (size_t)stages * 2u * ATT_CK * (size_t)hd * sizeof(__half);
}

/* A warp's chunks are ci, ci + ATT_WARPS, ... Chunk c's copies issued into stage st by issue(c, st, blk), blk its
 * KV block (read one chunk ahead), then the block of the warp's chunk after c read into blk (0 past the end):
 * that load flies while chunk c is used. */
template <class Issue>
__device__ __forceinline__ void att_issue_chunk(Issue &issue, int c, int st, int32_t &blk, const int32_t *bt,
                                                int n_chunks, int bs) {
    issue(c, st, blk);
    const int cn = c + ATT_WARPS;
    blk = cn < n_chunks ? bt[cn * ATT_CK / bs] : 0;
}
/* Two stages, at chunk ci in stage st: where the warp has a next chunk, its copies issued into the other stage
 * (unless already in flight: !fresh) and all copies but that newest group waited for; else all of them. */
template <class Issue>
__device__ __forceinline__ void att_next_stage(Issue &issue, int ci, int st, bool fresh, int32_t &blk,
                                               const int32_t *bt, int n_chunks, int bs) {
    const int cn = ci + ATT_WARPS;
    if (cn < n_chunks) {
        if (fresh) att_issue_chunk(issue, cn, st ^ 1, blk, bt, n_chunks, bs);
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
}

/* Split-KV decode: how a sequence of n_keys keys is cut. Below split_min keys it stays whole (one split:
 * the unsplit kernels' work and bits); from there into splits of max(min_chunks, ceil(n_chunks / z_max))
 * chunks, so at most z_max of them. The cut depends on the sequence's own length only, never on the rest
 * of its batch, so a sequence's result does not depend on what else is in its step. Chunks per split. */
#define ATT_SPLIT_MAX 64    /* splits of one sequence at most (k_attention_combine's shared memory) */
#define ATT_SPLIT_CHUNKS 16 /* chunks (of ATT_CK keys) a split holds at least */
__host__ __device__ __forceinline__ int32_t att_split_chunks(int32_t n_keys, int32_t split_min, int32_t min_chunks,
                                                             int32_t z_max) {
    const int32_t nc = (n_keys + ATT_CK - 1) / ATT_CK;
    if (n_keys < split_min) return nc;
    const int32_t c = (nc + z_max - 1) / z_max;
    return c > min_chunks ? c : min_chunks;
}
/* Splits of a sequence of n_keys keys under that rule (1 below split_min). */
__host__ __device__ __forceinline__ int32_t att_split_count(int32_t n_keys, int32_t split_min, int32_t min_chunks,
                                                            int32_t z_max) {
    const int32_t nc = (n_keys + ATT_CK - 1) / ATT_CK, cps = att_split_chunks(n_keys, split_min, min_chunks, z_max);
    return (nc + cps - 1) / cps;
}
/* A grid depth that covers every sequence of at most cap_keys keys: att_split_count <= z_max, and splits hold
 * at least min_chunks chunks, so at most ceil(n_chunks / min_chunks) of them. */
static inline int32_t att_split_bound(int64_t cap_keys, int32_t min_chunks, int32_t z_max) {
    const int64_t nc = (cap_keys + ATT_CK - 1) / ATT_CK, by_len = (nc + min_chunks - 1) / min_chunks;
    return (int32_t)std::max<int64_t>(1, std::min<int64_t>(z_max, by_len));
}

/* k_attention with its dynamic shared memory (two chunk stages up to head_dim 128, one above:
 * at most 64 KiB, within every targeted GPU's limit once opted in). */
#define ATT_SMEM_MAX 65536
