/* Split-KV decode attention (flash-decoding across blocks): at long context a decode step's attention
 * spreads each sequence's keys over many blocks instead of one block per (token, head) walking them all.
 *
 * A step splits when every token belongs to another sequence (decode), it has at most ATT_SPLIT_MAX_T tokens,
 * its block tables cover at least stg_settings.att_split_min tokens, and the model's heads take the query
 * tiles (att_tile_tokens: head_dim 32 / 64 / 128, query heads per kv head dividing 16). Then the layer runs
 * k_qkv_post (not the fused head prep), k_attention_tile<HD, true> over the grid (token, kv head, split) and
 * k_attention_combine (a block per (token, head)): the splits' (max, sum, unnormalised output) merged
 * into the output and, where the output projection reads 8-bit blocks, its quantisation (quant_block32,
 * as every attention kernel does it).
 *
 * The grid depth comes from the padded block-table width (part of a captured graph's key), so a graph
 * replays for every length up to it; each token's own split count follows its length (att_split_chunks)
 * and blocks past it exit before their wait. Which splits a sequence gets depends on its length, the
 * setting and the device's SM count only: a sequence's bits do not depend on its batch, and one below
 * att_split_min keys (one split) gets exactly the unsplit kernels' bits (k_attention_tile's rows are
 * k_attention's, and a single partial is divided by its own sum).
 *
 * Exactness: a split sequence sums its keys in another order (per split, then across splits with one
 * more rescale), so it is not bitwise the unsplit kernel's; tests/engine/gpu/test_gpu_attention_split.py
 * holds it within 1e-4 of max|out| of the unsplit kernel and 1e-3 of the CPU reference (docs/engine.md). */
#include "attention.cuh"

#define ATT_SPLIT_MAX_T 64 /* decode steps of at most this many tokens split (the partials' scratch) */
#define ATT_SPLIT_WAVES 2  /* a batch-1 sequence is cut into about this many blocks per SM */

/* Splits of one sequence at most on a device of n_sm SMs: enough (token, kv head, split) blocks for
 * ATT_SPLIT_WAVES per SM at batch 1, within ATT_SPLIT_MAX. */
static int32_t att_split_zmax(int32_t n_sm, int32_t n_kv) {
    const int32_t z = (ATT_SPLIT_WAVES * std::max(n_sm, 1) + n_kv - 1) / n_kv;
    return std::max(1, std::min(z, ATT_SPLIT_MAX));
}

/* The split grid's depth for a step (1: no split; see the top of this file). cap_keys: the padded
 * block-table width in tokens. */
static int32_t att_split_grid(const stg_settings &set, const st_model_desc &d, int32_t z_max, int32_t T, bool decode,
                              int64_t cap_keys) {
    if (!decode || set.att_split_min < 1 || T > ATT_SPLIT_MAX_T || cap_keys < set.att_split_min) return 1;
    if (!att_tile_tokens(d.n_head, d.n_head_kv, d.head_dim)) return 1;
    return att_split_bound(cap_keys, ATT_SPLIT_CHUNKS, z_max);
}

/* Merge of a (token, head)'s splits: M = max of the splits' maxima, each split weighed by
 * exp(max_s - M), summed in split order, divided by the weighed sum of the sums; one split is its own
 * partial over its own sum (the unsplit kernel's bits). */
__global__ void __launch_bounds__(ATT_WARPS * 32) k_attention_combine(attn_args a) {
    PDL_ENTER();
    __shared__ float sc[ATT_SPLIT_MAX];
    const int t = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, hd = a.hd;
    const int32_t nk = a.pos[t] + 1;
    const int ns = min(att_split_count(nk, a.split_min, a.split_chunks, a.split_max), a.split_z); /* min: never binds */
    const int64_t p0 = ((int64_t)t * a.n_head + h) * a.split_z;
    const float *ml = a.part_ml + 2 * p0, *acc = a.part_acc + p0 * hd;
    float M = -INFINITY;
    for (int s = 0; s < ns; s++) M = fmaxf(M, ml[2 * s]);
    for (int s = threadIdx.x; s < ns; s += blockDim.x) sc[s] = expf(ml[2 * s] - M);
    __syncthreads();
    float L = 0.0f;
    for (int s = 0; s < ns; s++) L = __fmaf_rn(ml[2 * s + 1], sc[s], L);
    const int64_t row0 = ((int64_t)t * a.n_head + h) * hd;
    for (int d0 = warp * 32; d0 < hd; d0 += ATT_WARPS * 32) { /* a warp per 32 dimensions */
        const int d = d0 + lane;
        float v = 0.0f;
        if (d < hd) {
            if (ns == 1) {
                v = __fdiv_rn(acc[d], ml[1]);
            } else {
                for (int s = 0; s < ns; s++) v = __fmaf_rn(acc[(int64_t)s * hd + d], sc[s], v);
                v = __fdiv_rn(v, L);
            }
            a.out[row0 + d] = v;
        }
        if (a.aq) quant_block32(v, lane, a.aq + row0 + d0, a.ad + (row0 + d0) / 32, a.as + (row0 + d0) / 16);
    }
}

/* The split kernel over grid (n_tok, n_kv, z) and the combine. aa: the layer's arguments with part_acc /
 * part_ml (room for n_tok * n_head * z rows) and split_min / split_chunks / split_max set. */
static stg_status launch_attention_split(attn_args &aa, int32_t n_tok, int32_t z, cudaStream_t st) {
    if (z < 1 || z > ATT_SPLIT_MAX || aa.split_chunks < 1 || aa.split_max < 1 || aa.split_max > ATT_SPLIT_MAX ||
        !aa.part_acc || !aa.part_ml)
        return fail(ST_EINVAL, "split attention: %d splits, %d chunks each at least, at most %d splits", z,
                    aa.split_chunks, aa.split_max);
    aa.split_z = z, aa.stages = 2;
    const size_t smem = att_smem_bytes(aa.hd, 2);
    const dim3 grid((unsigned)n_tok, (unsigned)aa.n_kv, (unsigned)z);
    const int32_t *no_tiles = nullptr;
    if (aa.hd == 128) launch_k(k_attention_tile<128, true>, grid, ATT_WARPS * 32, smem, st, aa, no_tiles);
    else if (aa.hd == 64) launch_k(k_attention_tile<64, true>, grid, ATT_WARPS * 32, smem, st, aa, no_tiles);
    else if (aa.hd == 32) launch_k(k_attention_tile<32, true>, grid, ATT_WARPS * 32, smem, st, aa, no_tiles);
    else return fail(ST_EUNSUPPORTED, "split attention: head_dim %d", aa.hd);
    LAUNCHED("attention (split)");
    launch_k(k_attention_combine, dim3((unsigned)n_tok, (unsigned)aa.n_head), ATT_WARPS * 32, 0, st, aa);
    LAUNCHED("attention (split combine)");
    return ST_OK;
}
