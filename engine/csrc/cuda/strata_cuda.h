/* Strata GPU engine: the C API of engine/_strata_cuda.so, reached from Python through
 * cffi in ABI mode (ffi.dlopen; engine/cuda_backend.py feeds this header to cdef).
 *
 * Conventions (as strata.h): every entry point returns an st_status (0 = ok) and leaves a
 * per-thread message for stg_last_error(); nothing calls exit()/abort(). The model, batch
 * and stats structs are strata.h's own (st_model_desc, st_batch, st_step_stats); they are
 * passed as void pointers so this header stays independent of strata.h's layout.
 *
 * Weights are uploaded once, in their GGUF quant format, from the host pointers of the
 * descriptor (the mmap). The KV cache lives in VRAM in the CPU engine's paged layout:
 * K [layer][block][n_kv][head_dim][block_size] F16, V [layer][block][block_size][kv_dim] F16,
 * so the scheduler's block tables mean the same thing on both devices. */
#ifndef STRATA_CUDA_H
#define STRATA_CUDA_H

#include <stdint.h>

typedef int32_t stg_status;
typedef struct stg_model stg_model;
typedef struct stg_kv stg_kv;

const char *stg_last_error(void);

/* Number of CUDA devices (>= 0), or -1 when no usable driver is present (message set). */
int32_t stg_device_count(void);
/* name: a buffer of name_len bytes; memory in bytes; compute capability. */
stg_status stg_device_info(int32_t device, char *name, int32_t name_len, int64_t *total_mem, int64_t *free_mem,
                           int32_t *cc_major, int32_t *cc_minor);

/* The settings of a model on the GPU: read when it opens, replaced only by stg_model_set_settings.
 * stg_settings_default gives the defaults; engine/gpu_settings.py is the one registry of the
 * environment variables that override them (STRATA_GPU_*). None changes a result unless said. */
typedef struct stg_settings {
    int32_t graphs;           /* 1: steps of at most 64 tokens replay a CUDA graph per shape (0: plain launches) */
    int32_t pdl;              /* 1: programmatic dependent launch on sm_90+ (never in prefill-form steps) */
    int32_t layer_events;     /* per-layer attention / FFN times: -1 sampled on graph steps, 0 never, 1 every step */
    int32_t gemm_min;         /* expected pairs per group from which the tensor-core GEMM replaces the matvec (>= 1) */
    int32_t gemm_min_tokens;  /* routed layers of steps of at least this many tokens take the GEMM (0, 8, 16, 24) */
    int32_t gemm_dense_min;   /* pairs from which a single-group launch (a dense layer, the head) may take the GEMM */
    int32_t gemm_wide_min;    /* blocks from which a dense GEMM runs 32 (prefill form: 64) pairs per tile */
    int32_t dense_split;      /* tokens from which a small dense layer's GEMM splits its k loop (0: never) */
    int32_t routed_split_max; /* routed gate/up GEMMs of at most this many tokens split their k loop (0..64, x8) */
    int32_t gemm_fast_min;    /* steps whose every run of one sequence's tokens is this long take the prefill-form
                               * Q4_K GEMM (within rounding of the bitwise kernels; 0: never) */
    int32_t att_mma;          /* prefill attention on tensor cores: 0 off (fp32, bitwise), 1 q as f16, 2 q as f16 hi+lo
                               * (within tolerance of the fp32 kernel) */
    int32_t att_mma_min;      /* runs of at least this many tokens take the tensor-core attention (>= 1) */
} stg_settings;

void stg_settings_default(stg_settings *s);

/* desc: a const st_model_desc * (strata.h). Validates shapes like st_model_create, then
 * uploads every weight to `device`. settings: NULL for stg_settings_default's (ST_EINVAL when
 * a field is out of its range). */
stg_status stg_model_create(int32_t device, const void *desc, const stg_settings *settings, stg_model **out);
/* Replace a model's settings between steps (drops its CUDA graphs; ST_EINVAL with steps in flight). */
stg_status stg_model_set_settings(stg_model *m, const stg_settings *settings);
void stg_model_destroy(stg_model *m);
/* VRAM held by the weights, in bytes. */
int64_t stg_model_weight_bytes(const stg_model *m);
/* CUDA graphs cached for decode-sized steps, and how many captures failed (the last
 * failure's message in note, note_len bytes; those steps ran as plain launches). */
int32_t stg_model_graphs(const stg_model *m, int32_t *n_failed, char *note, int32_t note_len);

stg_status stg_kv_create(stg_model *m, int32_t n_blocks, int32_t block_size, stg_kv **out);
void stg_kv_destroy(stg_kv *kv);
int64_t stg_kv_bytes(const stg_kv *kv);

/* One step with st_forward's contract: batch is a const st_batch *, stats an
 * st_step_stats * (may be NULL); times come from CUDA events. With batch->out_tokens set the
 * logit rows' greedy picks are taken on the device (k_argmax_split, inside the step's graph) and
 * only those n_logits ids are copied back (batch->logits may then be NULL: no logits copy). */
stg_status stg_forward(stg_model *m, stg_kv *kv, const void *batch, void *stats);

/* The step in two halves, so that the host prepares step N+1 while the GPU runs step N:
 * stg_step_launch validates the batch, uploads it and queues the step (batch->logits must be NULL:
 * a launched step returns greedy picks only, when batch->out_tokens is set, which is then only a
 * flag) and returns at once with a ticket (> 0); stg_step_wait(ticket) waits for it, writes its
 * n_logits picks into out_tokens (NULL allowed for a step without picks) and fills stats (may be
 * NULL), adding to the batch's expert_hist (which must stay alive until then). At most two steps
 * in flight, waited in launch order. st_batch.token_src rows read the previous launched step's
 * picks on the device (in stream order), so step N+1 can be launched before step N is waited.
 * Misuse is refused (ST_EINVAL): a third launch, a wait out of order or without a launch, logits
 * in a launched step, stg_forward while a launched step is in flight. A step launched while one
 * is in flight reports t_output 0 for the earlier one (shared events) and skips per-layer events
 * while the earlier one records them. */
stg_status stg_step_launch(stg_model *m, stg_kv *kv, const void *batch, int64_t *ticket);
stg_status stg_step_wait(stg_model *m, int64_t ticket, int32_t *out_tokens, void *stats);
/* Launched steps not yet waited (0..2). */
int32_t stg_step_in_flight(const stg_model *m);

/* Page-locked host memory (cudaHostAlloc, portable to every device): a step whose logits
 * buffer is such memory copies them by DMA instead of through the driver's own staging
 * (the 19.4 MB of 32 sequences' logits take 1.3 ms per step into pageable memory).
 * The caller frees it with stg_host_free, also after the model is destroyed. */
stg_status stg_host_alloc(int64_t bytes, void **out);
void stg_host_free(void *p);

/* ---- kernel harness (tests, benchmarks): host buffers in, host buffers out ---- */
/* The settings every harness call runs under (NULL: stg_settings_default's with gemm_fast_min 0, the bitwise
 * kernels); ST_EINVAL when a field is out of range. */
stg_status stg_test_set_settings(const stg_settings *s);
#define STG_PATH_REF 0    /* the generic reference kernel: one thread per output */
#define STG_PATH_MATVEC 1 /* warp per weight row, up to 8 tokens per pass (decode) */
#define STG_PATH_GEMM 2   /* tiled int8 dp4a matrix-matrix kernel (prefill, big batches) */
#define STG_PATH_AUTO 3   /* what stg_forward picks for this many tokens */

stg_status stg_test_dequantize(int32_t type, const void *src, float *dst, int64_t n);
/* x[n_tok, k] float rows -> 8-bit blocks like st_quantize_act: qs[n_tok*k], d[n_tok*k/32], sums[n_tok*k/16]. */
stg_status stg_test_quantize_act(const float *x, int64_t n_tok, int64_t k, int8_t *qs, float *d, int32_t *sums);
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
 * (attention_mma.cuh: tile 2 with q as f16 hi + lo, tile 3 with q as one f16); out[nq, n_head * head_dim];
 * aq/ad/as (all or none): also the output's 8-bit blocks. */
stg_status stg_test_attention_heads(int32_t tile, const uint16_t *k, const uint16_t *v, int32_t n_blocks,
                                    const int32_t *block_table, int32_t n_table, int32_t block_size, int32_t head_dim,
                                    int32_t n_head, int32_t n_kv, const float *q, int32_t nq, int32_t p0, float *out,
                                    int8_t *aq, float *ad, int32_t *as);
stg_status stg_test_rmsnorm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y);
/* x[n_tok, n_heads * head_dim] rotated in place at positions pos[n_tok]. */
stg_status stg_test_rope(float *x, const int32_t *pos, int32_t n_tok, int32_t n_heads, int32_t head_dim,
                         int32_t rope_dim, int32_t rope_type, float rope_base);
/* logits[n_tok, n_expert] -> top-k ids and weights (softmax probabilities, raw). */
stg_status stg_test_router(const float *logits, int32_t n_tok, int32_t n_expert, int32_t k, int32_t *ids, float *w);
/* The step's greedy pick (k_argmax_split, st_batch.out_tokens' rule) of rows x[rows, n], uploaded
 * `misalign` floats (0..3) past a 16-byte boundary (1..3: the kernel's unaligned loop), as the step runs
 * it (launched twice on the same counters). */
stg_status stg_test_argmax(const float *x, int32_t rows, int64_t n, int32_t misalign, int32_t *out);

#endif
