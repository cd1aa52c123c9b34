/* Strata engine: the C API reached from Python through cffi.
 *
 * Conventions
 *   - Every entry point returns an st_status (0 = ok). On error, st_last_error()
 *     returns a message for the calling thread. Nothing here calls exit()/abort().
 *   - Tensors follow GGUF/ggml order: ne[0] is the innermost (contiguous) dimension,
 *     so a weight matrix W[n_out, n_in] has ne[0] = n_in (row length), ne[1] = n_out.
 *   - Quant type ids are ggml's (GGMLQuantizationType in gguf-py).
 *   - Weights are borrowed pointers into the mmap'd GGUF file; nothing is copied.
 */
#ifndef STRATA_H
#define STRATA_H

#include <stddef.h>
#include <stdint.h>

typedef int32_t st_status;
#define ST_OK 0
#define ST_EINVAL 1       /* bad argument / shape */
#define ST_ENOMEM 2       /* allocation failed */
#define ST_EUNSUPPORTED 3 /* quant type / architecture not supported */
#define ST_ERANGE 4       /* index out of range (token id, position, block) */
#define ST_ETHREAD 5      /* thread pool failure */

const char *st_last_error(void);

/* ---- quant types (ggml ids) ---------------------------------------------- */
#define ST_TYPE_F32 0
#define ST_TYPE_F16 1
#define ST_TYPE_Q4_0 2
#define ST_TYPE_Q4_1 3
#define ST_TYPE_Q5_0 6
#define ST_TYPE_Q5_1 7
#define ST_TYPE_Q8_0 8
#define ST_TYPE_Q4_K 12
#define ST_TYPE_Q5_K 13
#define ST_TYPE_Q6_K 14
#define ST_TYPE_IQ2_XXS 16
#define ST_TYPE_IQ2_XS 17
#define ST_TYPE_IQ3_XXS 18
#define ST_TYPE_IQ3_S 21
#define ST_TYPE_IQ2_S 22
#define ST_TYPE_Q2_K 10
#define ST_TYPE_Q3_K 11
#define ST_TYPE_IQ4_NL 20
#define ST_TYPE_IQ4_XS 23
#define ST_TYPE_MXFP4 39
/* Q4_1 rows repacked at load in groups of 8 (st_repack_q4_1): never a file type. Per group and
 * 32-column block, 160 bytes: the eight rows' d (f16), their m, then bytes 4j..4j+3 of the
 * codes of rows 0..7 for j = 0..3. Row r still starts at r * row_bytes when r is a multiple
 * of 8, so kernels are called on whole groups. */
#define ST_TYPE_Q4_1_R8 1003
/* Q8_0 rows repacked the same way (st_repack_q8_0): per group and block, 272 bytes: the eight
 * d (f16), then bytes 4j..4j+3 of rows 0..7 for j = 0..7. */
#define ST_TYPE_Q8_0_R8 1008
#define ST_TYPE_BF16 30

/* Kernel variants. AUTO picks the best the CPU supports. */
#define ST_VARIANT_AUTO 0
#define ST_VARIANT_REF 1
#define ST_VARIANT_AVX2 2
#define ST_VARIANT_AVX512 3 /* AVX-512F/BW/VL + VNNI */

int32_t st_type_supported(int32_t type);
/* Elements per block and bytes per block; 0 for an unsupported type. */
int32_t st_type_block_elems(int32_t type);
int32_t st_type_block_bytes(int32_t type);

/* Bitmask of variants this CPU can run: bit v set if variant v is usable. */
int32_t st_cpu_variants(void);
/* Force one variant for every kernel (tests, benchmarks); AUTO restores. */
st_status st_set_variant(int32_t variant);
int32_t st_get_variant(void);

/* Dequantise n elements (a multiple of the block size) to float32. */
st_status st_dequantize(int32_t type, const void *src, float *dst, int64_t n);

/* Activations are quantised to 8 bits in blocks of 32. n is a positive multiple of 32;
 * the caller provides qs[n], d[n/32] (one scale per 32 values) and sums[n/16] (the sum
 * of each 16 consecutive int8 values, used for weight offsets/minimums). Nothing past
 * those lengths is written or read (here and in st_vec_dot_q). */
st_status st_quantize_act(const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums);
/* The same through one variant's quantiser (the step uses the current variant's); every
 * variant gives the bytes and floats of st_quantize_act. For the kernel harness. */
st_status st_quantize_act_variant(int32_t variant, const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums);
/* The per-256 quantisation the Q6_K kernels read (llama.cpp's Q8_K): n a positive
 * multiple of 256; qs[n], d[n/256] (amax / 127 of each 256 values), bsums[n/16] (the sums of each 16
 * qs). st_vec_dot_q and friends build this view from their per-32 inputs: x = qs * d (float
 * products, per 32-block) quantised here. variant: as st_quantize_act_variant (same bytes on every one). */
st_status st_quantize_act_k(int32_t variant, const float *x, int64_t n, int8_t *qs, float *d, int16_t *bsums);
/* h = silu(g) * u elementwise through one variant (the expert FFN's gate); n >= 1. */
st_status st_silu_mul_variant(int32_t variant, const float *g, const float *u, float *h, int64_t n);

/* out = dot(row of weights of `type`, activations) with the given variant.
 * Quantised types use the 8-bit activations; F32/F16/BF16 use float x. */
st_status st_vec_dot_q(int32_t type, int32_t variant, const void *w, const int8_t *qs, const float *d,
                       const int32_t *sums, int64_t n, float *out);
st_status st_vec_dot_f(int32_t type, int32_t variant, const void *w, const float *x, int64_t n, float *out);
/* One weight row against nt (1..64) token rows at once, through the variant's
 * multi-token path (the one grouped experts and batched linears use): qs[nt, n],
 * d[nt, n/32], sums[nt, n/16], out[nt]. For the harness's batched == alone check. */
st_status st_vec_dot_q_tokens(int32_t type, int32_t variant, const void *w, int32_t nt, const int8_t *qs,
                              const float *d, const int32_t *sums, int64_t n, float *out);
/* nr (1..8) consecutive weight rows against nt (1..64) token rows: the register-blocked
 * micro-kernel the step uses. out[nt, nr]. For the harness's blocked == alone check.
 * The repacked types (ST_TYPE_*_R8) are accepted here only, with w holding a whole group of 8 rows. */
/* Repack rows (a multiple of 8) Q4_1 rows of n elements from src into dst (the same size) as
 * ST_TYPE_Q4_1_R8. */
st_status st_repack_q4_1(const void *src, void *dst, int64_t rows, int64_t n);
st_status st_repack_q8_0(const void *src, void *dst, int64_t rows, int64_t n);
st_status st_vec_dot_q_rows(int32_t type, int32_t variant, const void *w, int32_t nr, int32_t nt, const int8_t *qs,
                            const float *d, const int32_t *sums, int64_t n, float *out);
/* The micro-kernel's rate with its weights in cache, for benchmarks: 8 rows x n of `type`
 * (random codes, small scales) against nt (1..64) token rows, run until `seconds` of this
 * thread's CPU time have passed; *gmac_s = multiply-accumulates per CPU second / 1e9. The
 * repacked types (ST_TYPE_Q4_1_R8, ST_TYPE_Q8_0_R8: the engine's form of those tensors) are
 * accepted, their group built from random plain rows. */
st_status st_kernel_rate(int32_t type, int32_t variant, int64_t n, int32_t nt, double seconds, double *gmac_s);

/* Attention of one head over caller-provided paged K/V (the layout of st_kv: K is
 * [block][n_kv][head_dim][block_size] F16, V is [block][block_size][n_kv * head_dim]).
 * nq queries (rows of q, [nq][head_dim], already scaled) at positions p0..p0+nq-1;
 * query i attends to keys 0..p0+i. For the kernel test harness and benchmarks. */
st_status st_attention(int32_t variant, const uint16_t *k, const uint16_t *v, const int32_t *block_table,
                       int32_t block_size, int32_t head_dim, int32_t n_kv, int32_t kv_head, const float *q,
                       int32_t nq, int32_t p0, float *out);
/* The same with values of v_dim dimensions per head (V is [block][block_size][n_kv * v_dim]; keys
 * and queries keep head_dim): out is [nq][v_dim]. MLA's latent rows attend this way. */
st_status st_attention_kv(int32_t variant, const uint16_t *k, const uint16_t *v, const int32_t *block_table,
                          int32_t block_size, int32_t head_dim, int32_t v_dim, int32_t n_kv, int32_t kv_head,
                          const float *q, int32_t nq, int32_t p0, float *out);

/* Split decode attention (flash-decoding) of the nq query heads that share KV head kv_head
 * (rows of q, [nq][head_dim], already scaled) at one position seeing keys 0..n_keys-1: the
 * keys cut into chunks of `chunk` keys (a multiple of 16), one variant's partial per chunk,
 * then the combine; sink: NULL or [nq] logits that join each softmax's denominator (gpt-oss).
 * out: [nq][head_dim]. For the kernel test harness and benchmarks. */
st_status st_attention_split(int32_t variant, const uint16_t *k, const uint16_t *v, const int32_t *block_table,
                             int32_t block_size, int32_t head_dim, int32_t n_kv, int32_t kv_head, const float *q,
                             int32_t nq, int32_t n_keys, int32_t chunk, const float *sink, float *out);
/* The same with values of v_dim dimensions per head (V as st_attention_kv's): out is [nq][v_dim]. */
st_status st_attention_split_kv(int32_t variant, const uint16_t *k, const uint16_t *v, const int32_t *block_table,
                                int32_t block_size, int32_t head_dim, int32_t v_dim, int32_t n_kv, int32_t kv_head,
                                const float *q, int32_t nq, int32_t n_keys, int32_t chunk, const float *sink,
                                float *out);
/* Attention over an 8-bit cache's layout (ST_KV_Q8_0) with the given variant's kernels (those
 * st_forward uses for it: the generic reference, or AVX2 for any SIMD variant): k8 [block][n_kv][head_dim][block_size] int8 with ks [block][n_kv][head_dim/32][block_size]
 * F16 scales, v8 [block][block_size][n_kv * v_dim] with vs [block][block_size][n_kv * v_dim / 32].
 * chunk 0: nq (<= 16) queries at positions p0..p0+nq-1 (st_attention_kv's tile); chunk > 0 (a
 * multiple of 16): nq query heads at position p0, split into chunks of keys and combined
 * (st_attention_split_kv's). out [nq][v_dim]. head_dim, v_dim: multiples of 32. For the harness. */
st_status st_attention_q8(int32_t variant, const int8_t *k8, const uint16_t *ks, const int8_t *v8, const uint16_t *vs,
                          const int32_t *block_table, int32_t block_size, int32_t head_dim, int32_t v_dim,
                          int32_t n_kv, int32_t kv_head, const float *q, int32_t nq, int32_t p0, int32_t chunk,
                          float *out);
/* How st_forward splits decode attention: ST_SPLIT_AUTO, the rule of docs/engine.md (by the
 * query's keys and the pool's threads); ST_SPLIT_OFF, never (the per-head kernels: the
 * reference the split is tested and measured against); n >= 16, a multiple of 16: every decode
 * query in chunks of n keys. Process-wide, like st_set_variant; for tests and benchmarks. */
#define ST_SPLIT_AUTO 0
#define ST_SPLIT_OFF 1
st_status st_set_attn_split(int32_t mode);
int32_t st_get_attn_split(void);
/* *chunk = the keys per chunk st_forward uses (0: not split) for a decode query seeing n_keys
 * keys (>= 1) with a pool of n_threads (>= 1) and n_kv KV heads (>= 1), under the current mode. */
st_status st_attn_split_plan(int32_t n_keys, int32_t n_threads, int32_t n_kv, int32_t *chunk);

/* ---- thread pool ------------------------------------------------------------ */
typedef struct st_pool st_pool;
/* n_threads workers; the thread that calls st_forward runs worker 0's share itself.
 * If cores != NULL, the pool's own threads (workers 1..n_threads-1) are each pinned
 * to cores[i % n_cores] (best effort: a thread whose core is outside the process's
 * allowed set stays unpinned). The calling thread is never pinned here: it keeps the
 * affinity of the process or thread that owns it, so cores[0] is the caller's to use. */
st_status st_pool_create(int32_t n_threads, const int32_t *cores, int32_t n_cores, st_pool **out);
void st_pool_destroy(st_pool *pool);
int32_t st_pool_threads(const st_pool *pool);

/* ---- model -------------------------------------------------------------------- */
/* A weight tensor inside the model file's mapping. n_bytes must equal the size its
 * type and shape imply, and [data, data + n_bytes) must lie inside the mapping given
 * in st_model_desc; st_model_create checks both. */
typedef struct {
    const void *data; /* NULL = absent */
    int32_t type;
    int32_t n_dims;   /* 1..4; ne[i] = 1 for i >= n_dims */
    int64_t ne[4];
    int64_t n_bytes;  /* (keep last: the CUDA backend relies on this layout) */
} st_tensor;

typedef struct {
    st_tensor attn_norm, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm;
    st_tensor ffn_norm;
    st_tensor ffn_gate, ffn_up, ffn_down;                  /* dense FFN */
    st_tensor gate_inp, gate_exps, up_exps, down_exps;     /* routed experts */
    st_tensor gate_inp_shexp, gate_shexp, up_shexp, down_shexp; /* shared expert */
    /* [n_expert] F32 score-correction bias (DeepSeek-V3, GLM-4.5): added to the routing
     * probabilities for the choice of experts only, never to their weights. */
    st_tensor exp_probs_b;
    /* gpt-oss (added last: the CUDA backend reads the fields above by this layout):
     * bo [n_embd] the attention output's bias; sinks [n_head] F32, one learned logit per head
     * that joins the softmax's denominator only; gate_inp_b [n_expert] the router's bias;
     * gate_exps_b / up_exps_b [n_ff_exp, n_expert] and down_exps_b [n_embd, n_expert] the
     * experts' biases, added to each expert's projections. */
    st_tensor bo, sinks, gate_inp_b, gate_exps_b, up_exps_b, down_exps_b;
    /* deepseek2's multi-head latent attention (added last; st_model_desc.kv_lora_rank > 0), in
     * ggml order: q from wq, or low-rank from wq_a [n_embd -> q_lora_rank], its RMSNorm q_a_norm
     * [q_lora_rank] and wq_b [q_lora_rank -> n_head * head_dim]; wkv_a [n_embd -> kv_lora_rank +
     * rope_dim]: the compressed KV latent then the rotary key part shared by every head; kv_a_norm
     * [kv_lora_rank] the latent's RMSNorm; the latent's expansion per head to the key's non-rotary
     * part (nope = head_dim - rope_dim) and the value (head_dim_v), either as one wkv_b [kv_lora_rank,
     * n_head * (nope + head_dim_v)] (older files) or split: wk_b [nope, kv_lora_rank, n_head] and
     * wv_b [kv_lora_rank, head_dim_v, n_head]. wo reads n_head * head_dim_v. */
    st_tensor wq_a, q_a_norm, wq_b, wkv_a, kv_a_norm, wkv_b, wk_b, wv_b;
} st_layer;

/* The next-token-prediction (NextN / MTP) head of an extra layer after the forward layers:
 * kept with the model for speculative decoding, never run by st_forward. eh_proj maps
 * [enorm(embedding); hnorm(hidden)] (2 * n_embd) to n_embd; the other three are optional. */
typedef struct {
    st_tensor eh_proj, enorm, hnorm;
    st_tensor embed_tokens, shared_head_head, shared_head_norm;
} st_nextn;

#define ST_ARCH_LLAMA 0
#define ST_ARCH_QWEN3MOE 1
#define ST_ARCH_QWEN2MOE 2
#define ST_ARCH_GLM4MOE 3
#define ST_ARCH_GPT_OSS 4 /* experts' SwiGLU clamped as gpt-oss's (alpha 1.702, limit 7) */
#define ST_ARCH_DEEPSEEK2 5 /* multi-head latent attention (kv_lora_rank), NORM rotary on the heads' last rope_dim dims */

/* Router gating functions (llama.cpp's expert_gating_func values). 0 in a descriptor means
 * softmax. */
#define ST_GATING_SOFTMAX 1        /* softmax over all experts, top-k of the probabilities */
#define ST_GATING_SIGMOID 2        /* sigmoid of each logit */
#define ST_GATING_SOFTMAX_WEIGHT 3 /* top-k of the logits, then softmax over the k chosen */

#define ST_ROPE_NORM 0 /* rotate adjacent pairs (x[2i], x[2i+1]) */
#define ST_ROPE_NEOX 2 /* rotate halves (x[i], x[i + d/2]) */

typedef struct {
    int32_t arch;
    int32_t n_layer, n_embd, n_head, n_head_kv, head_dim, n_vocab;
    int32_t n_expert, n_expert_used; /* 0 / 0 for a dense model */
    int32_t expert_norm;             /* renormalise the top-k weights to sum to 1 */
    int32_t rope_type, rope_dim;
    float rope_base, norm_eps;
    st_tensor token_embd, output_norm, output;
    st_layer *layers; /* [n_layer], borrowed during st_model_create only */
    /* The mapping every tensor lives in (the whole GGUF file); tensors outside it are
     * refused. It must outlive the model. */
    const void *map_data;
    int64_t map_bytes;
    /* Routing and layer layout (all zero: softmax routing, every layer routed when
     * n_expert > 0, no NextN layers). Routing follows llama.cpp's build_moe_ffn:
     *   probabilities p = gating(logits); choice scores c = p + exp_probs_b (when present);
     *   with n_expert_group > 1 only the n_group_used groups (of n_expert / n_expert_group
     *   consecutive experts) with the largest sum of their two best c stay eligible;
     *   the top n_expert_used of c are chosen (lowest index on ties); their weights are the
     *   unbiased p, divided by max(sum, 2^-14) when expert_norm, times expert_weights_scale. */
    int32_t gating;             /* ST_GATING_*, 0 = softmax */
    float expert_weights_scale; /* 0 = 1 */
    int32_t n_expert_group;     /* 0 or 1 = no groups */
    int32_t n_group_used;
    int32_t n_dense_lead;       /* layers 0 .. n_dense_lead-1 use the dense FFN (ffn_gate/up/down) */
    int32_t n_nextn;            /* NextN layers after the n_layer forward layers (kept, not run) */
    st_layer *nextn_layers;     /* [n_nextn] their transformer blocks, borrowed during st_model_create */
    st_nextn *nextn;            /* [n_nextn] their prediction heads, borrowed likewise */
    /* Sliding-window attention (llama.cpp's standard kind): with n_swa > 0 and swa_pattern > 0,
     * layer il is a sliding layer when il % swa_pattern < swa_pattern - 1, and there a query at
     * position p sees the keys at positions p - n_swa + 1 .. p only. Zero: every layer full. */
    int32_t n_swa, swa_pattern;
    /* RoPE scaling for every architecture (gpt-oss's YaRN included), the effective values of
     * llama.cpp's context (llama_context's rules, applied by engine/rope.py). Pair i of the rotary dims turns by pos * theta_i with
     *   theta_i = base^(-2i/rope_dim) * (freq_scale * (1 - mix_i) + mix_i),
     *   mix_i = ext_factor * ramp_i, ramp_i = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1),
     * lo / hi YaRN's correction dims from rope_n_ctx_orig, beta_fast and beta_slow
     * (ggml_rope_yarn_corr_dims), and both rotated values scale by
     *   mscale = attn_factor * (ext_factor != 0 ? 1 + 0.1 ln(1 / freq_scale) : 1).
     * All zero: no scaling (freq_scale 0 and attn_factor 0 read as 1). */
    float rope_freq_scale;  /* 1 / factor; (0, 1e6] */
    float rope_ext_factor;  /* YaRN's extrapolation mix, [0, 1e3]; 0: plain (linear) interpolation */
    float rope_attn_factor; /* YaRN's magnitude factor before the ln term */
    float rope_beta_fast, rope_beta_slow;
    int32_t rope_n_ctx_orig; /* the original training context; >= 1 when ext_factor != 0 */
    /* Multi-head latent attention (ST_ARCH_DEEPSEEK2; zero: none). Each head's query and key have
     * head_dim = nope + rope_dim dimensions (the rotary part last), its value head_dim_v. The KV
     * cache holds, per token and layer, one shared row: the normalised latent (kv_lora_rank) and
     * the rotated key part (rope_dim), so n_head_kv is 1. Attention runs on that row with each
     * head's query absorbed into the latent space (its non-rotary part times that head's wk_b),
     * and the head's output is expanded by wv_b: the same result as expanding K and V per head.
     * q_lora_rank > 0: q through wq_a / q_a_norm / wq_b, else through wq. */
    int32_t kv_lora_rank, q_lora_rank, head_dim_v;
} st_model_desc;

typedef struct st_model st_model;
/* Validates the hyper-parameters (bounded: see ST_MAX_* in internal.h) and every
 * tensor's type, shape, byte length and extent before anything is allocated from them;
 * an invalid descriptor gives ST_EINVAL / ST_EUNSUPPORTED / ST_ERANGE with a message. */
st_status st_model_create(const st_model_desc *desc, st_model **out);
void st_model_destroy(st_model *m);
/* Bytes of weights the model holds repacked (0 before its first CPU step, with
 * STRATA_REPACK=0, or when nothing qualifies). */
size_t st_model_repacked_bytes(const st_model *m);
/* The NextN layers the model keeps (validated with it, not run by st_forward); -1 for NULL. */
int32_t st_model_nextn_layers(const st_model *m);

/* The router's rule (st_model_desc's routing fields) on rows of logits, for tests:
 * logits[T, n_expert] (read only), bias[n_expert] (exp_probs_b) or NULL; out: ids[T, k] the
 * chosen experts in order, weights[T, k] the weights their outputs are summed with
 * (normalised when norm, scaled). The arguments are checked as st_model_create checks them. */
st_status st_route(int32_t n_expert, int32_t k, int32_t gating, int32_t n_expert_group, int32_t n_group_used,
                   int32_t norm, float scale, const float *bias, const float *logits, int32_t T, int32_t *ids,
                   float *weights);

/* ---- paged KV cache (F16) ------------------------------------------------------ */
typedef struct st_kv st_kv;
st_status st_kv_create(const st_model *m, int32_t n_blocks, int32_t block_size, st_kv **out);
/* A tiered cache: n_hot blocks in one allocation (the hot tier) and n_cold in another (the cold
 * tier), addressed by logical ids 0 .. n_hot + n_cold - 1 that start at physical block = id (ids
 * below n_hot hot). st_kv_create is the untiered F16 case (n_cold = 0, ST_KV_F16).
 * type: ST_KV_F16, or ST_KV_Q8_0 (8-bit values with one F16 scale per 32, Q8_0's rule; untiered
 * only, head dimensions multiples of 32, no sliding-window or sink layers: else ST_EINVAL). */
/* Q8_0's rule on one group of 32 floats (the 8-bit cache's store): d = max|x| / 127 (*d as F16 bits),
 * q[i] = round(x[i] * (1 / d)). For the kernel harness. */
void st_kv_q8_group(const float *x, int8_t *q, uint16_t *d);
#define ST_KV_F16 0
#define ST_KV_Q8_0 1
st_status st_kv_create_tiered(const st_model *m, int32_t n_hot, int32_t n_cold, int32_t block_size, int32_t type,
                              st_kv **out);
/* Swaps the physical homes of logical blocks a and b of a tiered cache (every layer's K and V),
 * copying a's contents when copy_a and b's when copy_b (a block holding nothing needed is not
 * copied). *bytes (optional): the bytes copied. Errors: untiered cache -> ST_EINVAL; an id
 * outside the cache -> ST_ERANGE. Never concurrently with st_forward on the same cache. */
st_status st_kv_swap(st_kv *kv, int32_t a, int32_t b, int32_t copy_a, int32_t copy_b, uint64_t *bytes);
void st_kv_destroy(st_kv *kv);

/* ---- one step -------------------------------------------------------------------- */
typedef struct {
    double t_total, t_attn, t_experts, t_dense, t_output; /* seconds */
    int64_t n_tokens, n_expert_tokens;                     /* routed (token, expert) pairs */
    int32_t n_active_experts;
    /* Share of the pool's thread time spent waiting in parallel regions (0..1): worker
     * time not inside a work item over n_threads x region wall time. (Added last: the
     * CUDA backend includes this header.) */
    double pool_idle_share;
} st_step_stats;

/* A batch: any mix of prefill chunks and decode tokens of many sequences.
 * Token i belongs to sequence seq[i] at position pos[i]; its K/V are written to
 * block block_tables[seq[i] * max_blocks + pos[i] / block_size] and it attends to
 * positions 0..pos[i] of its sequence. Logits are produced for the tokens listed in
 * logit_idx, into logits[n_logits, n_vocab], and/or their greedy picks into
 * out_tokens[n_logits] (at least one of the two when n_logits > 0). */
typedef struct {
    int32_t n_tokens;
    const int32_t *tokens;
    const int32_t *pos;
    const int32_t *seq;
    int32_t n_seqs;
    int32_t max_blocks;
    const int32_t *block_tables; /* [n_seqs, max_blocks] */
    int32_t n_logits;
    const int32_t *logit_idx;
    float *logits;
    int32_t *expert_hist; /* optional [n_layer, n_expert]: tokens routed per expert */
    /* optional [n_logits]: each logit row's greedy pick, the first index of its maximum (numpy
     * argmax's rule: ties go to the lowest index, -0.0 equals +0.0, and a NaN counts as larger
     * than any number, so a row holding NaN picks its first NaN). With out_tokens set, logits
     * may be NULL: then no logits leave the step (on a GPU only the n_logits ids are copied
     * back). Both set: both filled, the picks from exactly those logits. (Keep last: added
     * after the CUDA backend first read this struct.) */
    int32_t *out_tokens;
    /* optional [n_tokens]: where token i's id comes from. -1: tokens[i]; j >= 0: the previous
     * step's greedy pick j (its out_tokens[j]: the step run just before this one on the same model,
     * which must have had out_tokens set and n_logits > j), so that a decode step can be issued
     * before the host has read the previous step's ids (the GPU backend's stg_step_launch /
     * stg_step_wait; st_forward resolves it from its own last picks). tokens[i] is then not read
     * (nor range-checked). A step with out_tokens set and n_logits > 0 keeps its picks for the
     * next step; any other step that runs forgets them. Errors: an index j >= 0 with no previous
     * picks -> ST_EINVAL; j outside [-1, n_picks) -> ST_ERANGE. (Keep last: added after out_tokens.) */
    const int32_t *token_src;
} st_batch;

st_status st_forward(st_model *m, st_kv *kv, st_pool *pool, const st_batch *b, st_step_stats *stats);

/* ---- routed experts for a caller that owns the rest of the layer (the hybrid GPU engine) ----
 * Both run on the model's CPU scratch and the given pool: never concurrently with st_forward or
 * each other on the same model. x[T, n_embd] is the FFN input after the layer's RMSNorm (float,
 * host memory); 1 <= T <= ST_MOE_MAX_TOKENS. Errors: a NULL argument, a model or layer without
 * routed experts, T or n_pairs out of bounds -> ST_EINVAL; a layer, token or expert index out
 * of range -> ST_ERANGE. */
#define ST_MOE_MAX_TOKENS 1048576
/* The routed FFN of one layer exactly as st_forward computes it (router, top-k, grouped experts,
 * the weighted sum; not the shared expert): out[T, n_embd]; the routing into topk_id[T, k] and
 * topk_w[T, k] (raw softmax probabilities, slot order) when not NULL. */
st_status st_moe_layer(st_model *m, st_pool *pool, int32_t layer, int32_t T, const float *x, float *out,
                       int32_t *topk_id, float *topk_w);
/* The routed experts of one layer for a list of (token row, expert) pairs: out[p, n_embd] =
 * expert pair_exp[p]'s SwiGLU FFN of x[pair_tok[p]], unweighted (the caller weights and sums).
 * The step's kernels (8-bit activations, pairs grouped by expert, gate and up fused): each row
 * has the bits the step gives that (token, expert). At most one pair per (token, expert) is
 * meaningful; n_pairs <= T x n_expert. n_pairs = 0 does nothing. */
st_status st_moe_pairs(st_model *m, st_pool *pool, int32_t layer, int32_t T, const float *x, int32_t n_pairs,
                       const int32_t *pair_tok, const int32_t *pair_exp, float *out);

/* Decode attention over listed blocks of one layer's paged cache (the GPU engine's host tier under
 * stg_settings.kv_host_attn): token t (of n_tok) sees n_keys[t] keys, key j at slot j % block_size of block
 * blocks[blk_off[t] + j / block_size] (blk_off [n_tok + 1], blk_off[0] = 0; blocks index the n_blocks blocks of
 * k / v). Per (token, query head) row r = t * n_head + h: part_ml[2 r ..] = {max score, sum of exp(s - max)} and
 * part_acc[r * head_dim ..] = the sum of exp(s - max) * v, not divided (a token without keys: {-inf, 0}, zeros),
 * for a caller that merges them with partials of the token's other keys. q [n_tok][n_head][head_dim], scaled by
 * 1/sqrt(head_dim); query head h reads KV head h / (n_head / n_kv). type ST_KV_F16: k, v F16 in st_kv's layout
 * (K [block][n_kv][head_dim][block_size], V [block][block_size][n_kv * head_dim]), ks, vs NULL; ST_KV_Q8_0: int8
 * values in that layout with the F16 scales of st_attention_q8 (head_dim a multiple of 32). The work: (token, KV
 * head, chunk of keys) items of the current variant's split-decode partial kernels across pool (NULL: the calling
 * thread), each chunk's partials then merged in order. Within rounding of one pass over the keys (another order
 * of additions). */
st_status st_attn_blocks_part(st_pool *pool, int32_t type, const void *k, const void *v, const uint16_t *ks,
                              const uint16_t *vs, int32_t n_blocks, int32_t block_size, int32_t head_dim,
                              int32_t n_head, int32_t n_kv, int32_t n_tok, const float *q, const int32_t *blk_off,
                              const int32_t *blocks, const int32_t *n_keys, float *part_ml, float *part_acc);
/* The pool's rate in st_attn_blocks_part (the measured figure a per-step choice between it and streaming the
 * blocks to the GPU weighs): n_tok tokens of n_keys keys each over scattered blocks of a synthetic cache of that
 * type and shape, calls repeated for `seconds` (0 < s <= 60) of wall time after a first one; *gbs = K and V bytes
 * (with the 8-bit cache's scales) read per second / 1e9. */
st_status st_attn_blocks_gbs(st_pool *pool, int32_t type, int32_t block_size, int32_t head_dim, int32_t n_head,
                             int32_t n_kv, int32_t n_tok, int32_t n_keys, double seconds, double *gbs);

/* Memory read bandwidth through the pool: every pool thread reads its share of a private buffer
 * of `bytes` (>= 1 MiB, at most 64 GiB) `passes` times (1..1000); *gb_s = the best pass's bytes /
 * wall seconds / 1e9. The hybrid planner's CPU figure (the rate experts stream from RAM). */
st_status st_mem_read_gbs(st_pool *pool, int64_t bytes, int32_t passes, double *gb_s);

/* The greedy pick of each row of x[rows, n] (n >= 1): out[r] = the first index of row r's
 * maximum, by st_batch.out_tokens' rule (NaN first, then ties to the lowest index). The generic
 * reference that st_forward uses and that the GPU's argmax is checked against. */
st_status st_argmax_rows(const float *x, int32_t rows, int64_t n, int32_t *out);

#endif
