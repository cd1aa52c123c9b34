/* The kernel harness of the GPU engine: engine/_strata_cuda_test.so (strata_cuda_test.cu), loaded by
 * the GPU tests only (tests/engine/gpu/conftest.py), never by production code. Host buffers in, host
 * buffers out; each call runs one kernel family as a step would, on device 0. Conventions as
 * strata_cuda.h (whose declarations this library also exports). path: STG_PATH_REF 0 (the reference
 * kernel, one thread per output: the oracle), STG_PATH_MATVEC 1, STG_PATH_GEMM 2, STG_PATH_AUTO 3
 * (what a step picks for this many tokens); linear.cuh defines them. */
#ifndef STRATA_CUDA_TEST_H
#define STRATA_CUDA_TEST_H

#include "strata_cuda.h"

/* The settings every harness call runs under (NULL: stg_settings_default's with gemm_fast_min 0, the bitwise
 * kernels); ST_EINVAL when a field is out of range. */
stg_status stg_test_set_settings(const stg_settings *s);
/* The harness's calls (and models created through this library) assume that a block may opt in to `bytes` of shared
 * memory instead of the device's limit (cudaDevAttrMaxSharedMemoryPerBlockOptin), so that one device runs the forms
 * a smaller one takes (sm_89: 101,376); 0: the device's limit again. ST_EINVAL when negative. */
stg_status stg_test_assume_smem_optin(int32_t bytes);
/* The form of the tensor-core prefill attention a prefill step takes at head_dim under the (assumed) limit: rows 128
 * or 64 a tile (0: no form fits), pipe 1 where P.V runs one stage behind the softmax. */
stg_status stg_test_attention_mma_form(int32_t head_dim, int32_t *rows, int32_t *pipe);
/* The raw stages a warp of the 8-bit cache's split decode kernel takes at head_dim under the (assumed) limit: 4, 3
 * (head_dim 128 where 4 do not fit: sm_89), 0 where none fits (the cache is then refused: ST_EUNSUPPORTED from
 * stg_kv_create_tiered and from stg_test_attention_q8's modes 1 and 2). */
int32_t stg_test_q8_split_stages(int32_t head_dim);

stg_status stg_test_dequantize(int32_t type, const void *src, float *dst, int64_t n);
/* x[n_tok, k] float rows -> 8-bit blocks like st_quantize_act: qs[n_tok*k], d[n_tok*k/32], sums[n_tok*k/16]. */
stg_status stg_test_quantize_act(const float *x, int64_t n_tok, int64_t k, int8_t *qs, float *d, int32_t *sums);
/* The same rows quantised per 256 like st_quantize_act_k (one scale per 256, codes round(x / d)) in the per-32
 * layout the GPU kernels read: d[n_tok*k/32] each 256-group's scale 8 times, sums[n_tok*k/16] the sums of 16.
 * k % 256 == 0. */
stg_status stg_test_quantize_act256(const float *x, int64_t n_tok, int64_t k, int8_t *qs, float *d, int32_t *sums);
/* out[n_tok, n_rows] = W[n_rows, k] . x[n_tok, k]^T (x quantised to 8 bits on the GPU for quant types);
 * with w2 (same type and shape) the fused gate/up form: out = silu(W . x) * (W2 . x). */
stg_status stg_test_linear(int32_t type, int32_t path, const void *w, const void *w2, int64_t n_rows, int64_t k,
                           const float *x, int64_t n_tok, float *out);
/* q / k / v as one row-segmented launch (n_seg = 2 or 3 weights of rows[i] rows, w their rows stacked):
 * path STG_PATH_MATVEC (the fused matvec) or STG_PATH_GEMM (the split GEMM; ST_EINVAL where it does
 * not apply); out holds each segment's [n_tok, rows[i]] one after another. */
stg_status stg_test_linear_seg(int32_t type, int32_t path, const void *w, int32_t n_seg, const int64_t *rows,
                               int64_t k, const float *x, int64_t n_tok, float *out);
/* Routed experts as a MoE layer runs them: pairs p = token * k_used + slot with expert ids[p],
 * grouped on the GPU, then one grouped launch over the stacked experts w[n_expert][n_rows]
 * (w2: the fused gate/up form); out[n_tok * k_used, n_rows]. path: STG_PATH_MATVEC or
 * STG_PATH_GEMM (a block per tile of the grouping's tile list where that is fewer blocks). */
stg_status stg_test_routed_linear(int32_t type, int32_t path, const void *w, const void *w2,
                                  int32_t n_expert, int64_t n_rows, int64_t k, const float *x, int32_t n_tok,
                                  const int32_t *ids, int32_t k_used, float *out);
/* The routed gate/up GEMM (w2 required; Q4_K, whose split form exists for C = 1, 2, 4) over the tile list with
 * the decode form of steps of at most routed_split_max tokens: its k loop split and the split's combine also
 * quantising the output for the down projection:
 * out[n_tok * k_used, n_rows] and its 8-bit blocks hq, hd[/32], hs[/16] (n_rows a multiple of 32); EINVAL
 * when the launch did not quantise (no split). */
stg_status stg_test_routed_quant(int32_t type, const void *w, const void *w2, int32_t n_expert, int64_t n_rows,
                                 int64_t k, const float *x, int32_t n_tok, const int32_t *ids, int32_t k_used,
                                 float *out, int8_t *hq, float *hd, int32_t *hs);
/* stg_test_routed_quant's arguments and outputs on the matvec path (the routed gate/up matvec of one pair per pass
 * quantising its chunks in-block, k_linear_q_chunk); EINVAL when the launch did not quantise. */
stg_status stg_test_routed_chunk_quant(int32_t type, const void *w, const void *w2, int32_t n_expert, int64_t n_rows,
                                       int64_t k, const float *x, int32_t n_tok, const int32_t *ids, int32_t k_used,
                                       float *out, int8_t *hq, float *hd, int32_t *hs);
/* st_attention's contract for one kv head's queries; path: STG_PATH_REF or STG_PATH_AUTO. */
stg_status stg_test_attention(int32_t path, const uint16_t *k, const uint16_t *v, int32_t n_blocks,
                              const int32_t *block_table, int32_t n_table, int32_t block_size, int32_t head_dim,
                              int32_t n_kv, int32_t kv_head, const float *q, int32_t nq, int32_t p0, float *out);
/* Every query head of one sequence's nq tokens (q[nq, n_head * head_dim], pre-scaled) through the
 * decode kernel (tile 0), the prefill query-tile kernel (tile 1) or the tensor-core prefill kernel
 * (attention_mma.cu: tile 2 with q as f16 hi + lo, 3 with q as one f16; its form is stg_test_attention_mma_form's);
 * out[nq, n_head * head_dim];
 * aq/ad/as (all or none): also the output's 8-bit blocks. */
stg_status stg_test_attention_heads(int32_t tile, const uint16_t *k, const uint16_t *v, int32_t n_blocks,
                                    const int32_t *block_table, int32_t n_table, int32_t block_size, int32_t head_dim,
                                    int32_t n_head, int32_t n_kv, const float *q, int32_t nq, int32_t p0, float *out,
                                    int8_t *aq, float *ad, int32_t *as);
/* One decode step's attention over n_seq sequences (token i: sequence i at position pos[i], its
 * keys 0..pos[i] in the cache through block_tables[i * n_table ..]; q[n_seq, n_head * head_dim]
 * pre-scaled): split_min 0 runs the unsplit decode kernel (k_attention), split_min >= 1 the split-KV
 * path (attention_split.cu: k_attention_split_mma and k_attention_combine) cutting sequences of
 * at least split_min keys into splits of at least split_chunks chunks of 16 keys (<= 0: the step's
 * value), at most split_max of them (<= 0: this device's value; at most 64), its grid depth from the
 * table width as a step's. out[n_seq, n_head * head_dim]; aq/ad/as (all or none): the output's 8-bit
 * blocks; n_splits (may be NULL): the splits each sequence took (1 on the unsplit kernel). */
stg_status stg_test_attention_decode(int32_t split_min, int32_t split_chunks, int32_t split_max, const uint16_t *k,
                                     const uint16_t *v, int32_t n_blocks, const int32_t *block_tables,
                                     int32_t n_table, int32_t block_size, int32_t head_dim, int32_t n_head,
                                     int32_t n_kv, const float *q, const int32_t *pos, int32_t n_seq, float *out,
                                     int8_t *aq, float *ad, int32_t *as, int32_t *n_splits);
/* gpt-oss's attention (attn_args.sinks / n_swa) for the next stg_test_attention_decode calls on this thread:
 * sinks[n_head] one logit per head joining each softmax's denominator (NULL: none), n_swa > 0 a sliding window
 * of that many keys (0: none). The unsplit kernel only: a call with split_min > 0 is then ST_EINVAL, and
 * n_head must match the call's. */
stg_status stg_test_attention_oss(const float *sinks, int32_t n_head, int32_t n_swa);
/* Attention over the 8-bit cache (STG_KV_Q8_0, kv.c's layout over n_blocks blocks: k8 / v8 [n_blocks * block_size *
 * n_kv * head_dim] int8, ks / vs [that / 32] F16 scales) for n_tok tokens (token i: sequence seq[i] at position
 * pos[i], its keys 0..pos[i] through block_tables[seq[i] * n_table ..]; q[n_tok, n_head * head_dim] pre-scaled).
 * mode 0: the reference (k_attention_ref, attn_q8_ref's arithmetic); 1: the split decode path (one token per
 * sequence; split_min / split_chunks / split_max as stg_test_attention_decode's, split_min 0: every sequence in one
 * split); 2: the tensor-core prefill kernel in stg_test_attention_mma_form's form (a sequence's tokens consecutive).
 * out[n_tok, n_head * head_dim];
 * n_splits (may be NULL): the splits each token took (1 outside mode 1). head_dim 64 or 128. */
stg_status stg_test_attention_q8(int32_t mode, int32_t split_min, int32_t split_chunks, int32_t split_max,
                                 const int8_t *k8, const uint16_t *ks, const int8_t *v8, const uint16_t *vs,
                                 int32_t n_blocks, const int32_t *block_tables, int32_t n_seqs, int32_t n_table,
                                 int32_t block_size, int32_t head_dim, int32_t n_head, int32_t n_kv, const float *q,
                                 const int32_t *pos, const int32_t *seq, int32_t n_tok, float *out, int32_t *n_splits);
/* K / V rows k, v [n_tok, n_kv * head_dim] written by k_qkv_post into an 8-bit cache of n_blocks blocks (token i at
 * cache slot slots[i] = block * block_size + slot; no bias, norm or rotation): the cache's arrays (layout as
 * stg_test_attention_q8's), every byte, for comparison with the CPU's (st_kv_q8_group). */
stg_status stg_test_kv_store_q8(const float *k, const float *v, int32_t n_tok, int32_t n_kv, int32_t head_dim,
                                int32_t block_size, int32_t n_blocks, const int32_t *slots, int8_t *k8, uint16_t *ks,
                                int8_t *v8, uint16_t *vs);
stg_status stg_test_rmsnorm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y);
/* stg_test_rmsnorm's y and, from the same launch, its 8-bit blocks (qs[n_rows*n], d[/32], sums[/16]; n a multiple of
 * 32), as a layer's norm feeding quantised weights runs it. */
stg_status stg_test_rmsnorm_q(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y,
                              int8_t *qs, float *d, int32_t *sums);
/* x[n_tok, n_heads * head_dim] rotated in place at positions pos[n_tok]. */
stg_status stg_test_rope(float *x, const int32_t *pos, int32_t n_tok, int32_t n_heads, int32_t head_dim,
                         int32_t rope_dim, int32_t rope_type, float rope_base);
/* logits[n_tok, n_expert] -> top-k ids and weights (softmax probabilities, raw). */
stg_status stg_test_router(const float *logits, int32_t n_tok, int32_t n_expert, int32_t k, int32_t *ids, float *w);
/* logits[n_tok, n_expert] -> top-k ids and weights by the descriptor's routing rule (router_sigmoid.cu):
 * gating ST_GATING_SOFTMAX or ST_GATING_SIGMOID, n_group > 1 for group-limited top-k (n_group_used kept), bias
 * [n_expert] the score-correction bias or NULL; weights unnormalised (the combine normalises and scales). form 0:
 * a warp per token (k_route_rule), 1: the small steps' block that also groups the pairs (k_route_rule_group,
 * n_tok <= 64). */
stg_status stg_test_route_rule(const float *logits, int32_t n_tok, int32_t n_expert, int32_t k, int32_t gating,
                               int32_t n_group, int32_t n_group_used, const float *bias, int32_t form, int32_t *ids,
                               float *w);
/* The step's greedy pick (k_argmax_split, st_batch.out_tokens' rule) of rows x[rows, n], uploaded
 * `misalign` floats (0..3) past a 16-byte boundary (1..3: the kernel's unaligned loop), as the step runs
 * it (launched twice on the same counters). */
stg_status stg_test_argmax(const float *x, int32_t rows, int64_t n, int32_t misalign, int32_t *out);
/* deepseek2's latent attention over a paged cache of latent rows (mla.cu): kc[n_blocks][block_size][kl + rd] (F16
 * bits), q[T, H, kl + rd] the absorbed queries (pre-scaled), token t of sequence seq[t] at position pos[t] attending
 * keys 0 .. pos[t] through block_tables[n_seq][max_blocks]; out[T, H, kl]. G heads per block (1, 2, 4 or 8); ref 1:
 * the reference kernel (k_mla_attention_ref), 0: the step's kernel (k_mla_attention). */
stg_status stg_test_mla_attention(int32_t G, int32_t ref, const uint16_t *kc, int32_t n_blocks, int32_t block_size,
                                  const int32_t *block_tables, int32_t max_blocks, int32_t n_seq, const float *q,
                                  const int32_t *pos, const int32_t *seq, int32_t T, int32_t H, int32_t kl, int32_t rd,
                                  float *out);
/* The heads per block a step of T tokens gives k_mla_attention (H heads, rows of ck values). */
int32_t stg_test_mla_att_g(int32_t T, int32_t H, int32_t ck);
/* A decode router's logits out[n_tok, n_rows] (n_tok 1 or 2, float weights w[n_rows, k], at most 1,024 rows) by
 * f_rows_body (pre 0: k_linear_f_rows) or f_rows_pre with ROUTER_PRE (pre 1) or ROUTER_PRE_WIDE (pre 2) weights per
 * thread, as k_router_route / k_router_route_rule run it; EINVAL where k is too long for the form. */
stg_status stg_test_router_rows(int32_t type, int32_t pre, const void *w, int64_t n_rows, int64_t k, const float *x,
                                int32_t n_tok, float *out);

#endif
