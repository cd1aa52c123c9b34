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
    int32_t layer_events;     /* per-layer attention / FFN times: -1 sampled on graph steps and decode-sized hybrid
                               * steps (with the hybrid frame's events), 0 never, 1 every step (and every hybrid
                               * frame measured) */
    int32_t gemm_min;         /* expected pairs per group from which the tensor-core GEMM replaces the matvec (>= 1) */
    int32_t gemm_min_tokens;  /* routed layers of steps of at least this many tokens take the GEMM (0, 8, 16, 24) */
    int32_t gemm_dense_min;   /* pairs from which a single-group launch (a dense layer, the head) may take the GEMM */
    int32_t gemm_wide_min;    /* blocks from which a dense GEMM takes tiles of 32 pairs (prefill form: 64) */
    int32_t dense_split;      /* tokens from which a small dense layer's GEMM splits its k loop (0: never) */
    int32_t routed_split_max; /* routed gate/up GEMMs of at most this many tokens split their k loop (0..64, x8) */
    int32_t routed_mv_max;    /* in steps whose routed layers take the GEMM, experts with at most this many of the
                               * step's pairs take the matvec instead, in layers whose busiest expert holds at
                               * most 3x as many (0: none; 0..64) */
    int32_t routed_mv_groups; /* a layer keeps that split in decode-sized steps of T tokens while its recent such
                               * steps average at least this many experts on the matvec (routing measured on the
                               * device, decided every 32 steps; 0: every layer always keeps it) */
    int32_t gemm_fast_min;    /* steps whose every run of one sequence's tokens is this long take the prefill-form
                               * Q4_K and Q8_0 GEMMs (within rounding of the bitwise kernels; 0: never) */
    int32_t att_mma;          /* prefill attention on tensor cores: 0 off (fp32, bitwise), 1 q as f16, 2 q as f16 hi+lo
                               * (within tolerance of the fp32 kernel) */
    int32_t att_mma_min;      /* runs of at least this many tokens take the tensor-core attention (>= 1) */
    int32_t att_split_min;    /* split-KV decode: decode steps of at most 64 tokens whose longest sequence has at
                               * least this many keys spread each sequence of at least this many keys over
                               * several blocks (within tolerance of the unsplit kernel; shorter sequences keep
                               * its bits); 0: never */
    int32_t hybrid_overlap;   /* hybrid placement: 1: the host queues the whole step at once and a thread of its own
                               * computes the CPU's experts, the device waiting on a host-written flag per layer
                               * (the GPU's work of the next layer is already queued); 0: the host queues layer by
                               * layer and computes each layer's CPU share in between. Same bits either way */
    int32_t hybrid_stage;     /* hybrid placement: N >= 1: a step of at least N tokens may compute a layer's
                               * non-resident experts on the device from copies staged over PCIe (a ring of two
                               * whole-layer slots) where the rates measured at start-up say that is faster than the
                               * CPU (stg_model_set_stage_rate); the host range holding them is page-locked at model
                               * creation. Rows of staged layers are the device's (within tolerance of the CPU's).
                               * 0: never */
    int32_t kv_stream;        /* a tiered KV cache (stg_kv_create_tiered): 1: decode and graph-sized steps read
                               * host-tier blocks in place over PCIe (zero-copy, graphs kept) and only prefill-form
                               * steps stage them into VRAM; 0: every step that reads one stages (eagerly, no
                               * graphs); -1: each decode step takes the form its recent steps of the same size
                               * measured faster (both forms timed at first and the other one again every 64
                               * steps; stg_profile.kv_form), other steps stage. Same bits either way */
    int32_t kv_host_attn;     /* a tiered KV cache with a CPU engine for it (stg_model_set_cpu_attn): 1, a split-KV
                               * decode step's host-tier blocks are attended by the CPU pool where they lie
                               * (st_attn_blocks_part) while the device's split kernel attends its VRAM blocks, the
                               * CPU's partials merged as one more split (within 1e-3 of max|logit| of the untiered
                               * cache: another order of additions); such steps run eagerly, without PDL. A step that
                               * writes a host block, reads none, or runs hybrid placement or latent attention
                               * streams as with 0. 0: host blocks streamed over PCIe (kv_stream) */
    int32_t kv_host_share;    /* kv_host_attn 1: the CPU's share (%) of each token's host-tier blocks (a prefix of them
                               * in sequence order, rounded to whole blocks); the device's split kernel reads the rest in
                               * place over PCIe (kv_stream 1) or staged into VRAM (kv_stream 0) beside its VRAM blocks,
                               * so the two rates add. -1: measured, r_cpu / (r_cpu + r_dev) (stg_profile.kv_cpu_gbs /
                               * kv_pcie_gbs); 0: no CPU share (a
                               * step whose shares round to no block takes exactly kv_host_attn 0's path, bitwise) */
    int32_t hybrid_stage_skip; /* staging (hybrid_stage): N >= 1, a staged layer's non-resident expert is copied only
                               * where the routing of the steps so far expects at least N / 1000 hits of it in the
                               * step (its hits a token x the step's tokens); an expert the step's routing then
                               * takes although it was left out is read into its slot by the device from the
                               * page-locked file before the experts run, so the slot holds the same bytes for every
                               * expert the step uses: the same bits as copying them all. 50 (0.05 hits) by default;
                               * 0: every one copied */
} stg_settings;

void stg_settings_default(stg_settings *s);

/* desc: a const st_model_desc * (strata.h). Validates shapes like st_model_create, then
 * uploads every weight to `device`. settings: NULL for stg_settings_default's (ST_EINVAL when
 * a field is out of its range). */
stg_status stg_model_create(int32_t device, const void *desc, const stg_settings *settings, stg_model **out);
/* Hybrid placement: the CPU engine that computes the routed experts the device does not hold. moe_pairs is the C
 * engine's st_moe_pairs (strata.h; called with model and pool, on the thread that queues the step), last_error its
 * st_last_error (the message of a failed call). Both libraries are loaded into one process; the function
 * pointers join them. */
typedef int32_t (*stg_moe_pairs_fn)(void *model, void *pool, int32_t layer, int32_t T, const float *x, int32_t n_pairs,
                                    const int32_t *pair_tok, const int32_t *pair_exp, float *out);
typedef const char *(*stg_last_error_fn)(void);
typedef struct stg_cpu_experts {
    stg_moe_pairs_fn moe_pairs;
    stg_last_error_fn last_error;
    void *model; /* st_model * opened on the same file (the same mapping as desc's tensors) */
    void *pool;  /* st_pool *: the lane's cores */
} stg_cpu_experts;

/* kv_host_attn's CPU side: the C engine's st_attn_blocks_part (strata.h; called with pool on a thread of the
 * device library's own, once per layer of a step that takes it) and its st_last_error. type is STG_KV_F16 /
 * STG_KV_Q8_0 (the C engine's ST_KV_F16 / ST_KV_Q8_0: the same values and layouts). */
typedef int32_t (*stg_attn_blocks_fn)(void *pool, int32_t type, const void *k, const void *v, const uint16_t *ks,
                                      const uint16_t *vs, int32_t n_blocks, int32_t block_size, int32_t head_dim,
                                      int32_t n_head, int32_t n_kv, int32_t n_tok, const float *q,
                                      const int32_t *blk_off, const int32_t *blocks, const int32_t *n_keys,
                                      float *part_ml, float *part_acc);
typedef struct stg_cpu_attn {
    stg_attn_blocks_fn attn_blocks;
    stg_last_error_fn last_error;
    void *pool; /* st_pool *: the lane's cores */
} stg_cpu_attn;

/* stg_model_create with only some routed experts on the device: resident[layer * n_expert + e] (0 or 1) says
 * whether expert e of the layer is uploaded; the device holds a layer's resident experts in slots (ascending
 * expert id; stg_model_swap_expert moves them later), and a step hands every (token, expert) pair of another expert to cpu->moe_pairs, whose rows join
 * the device's before the weighted sum (the order of additions of st_forward's combine). resident NULL, or all
 * ones: stg_model_create. A model with any expert off the device runs every step eagerly (no CUDA graphs); per
 * layer with a CPU share, one event marks the rows the CPU needs (xn, the routing) and the device waits on a
 * host-written flag for the CPU's rows (stg_settings.hybrid_overlap says who queues and who computes).
 * Errors: resident values other than 0 / 1, or experts left off without cpu (all four fields) -> ST_EINVAL. */
stg_status stg_model_create_hybrid(int32_t device, const void *desc, const stg_settings *settings,
                                   const uint8_t *resident, const stg_cpu_experts *cpu, stg_model **out);
/* Online re-placement, between steps (no launched step in flight): routed expert in_e of a layer that is partly
 * on the device takes the device slot of its resident expert out_e (which the CPU computes from then on). The
 * model's bytes do not change. ST_EINVAL: not a hybrid model, out_e not resident or in_e resident, steps in
 * flight; ST_ERANGE: an index out of range. A failed copy leaves both experts on the CPU. */
stg_status stg_model_swap_expert(stg_model *m, int32_t layer, int32_t out_e, int32_t in_e);
/* The CPU engine that kv_host_attn's steps hand the host tier's attention to (all three fields; NULL clears it:
 * those steps then stream). ST_EINVAL with steps in flight or a field missing. */
stg_status stg_model_set_cpu_attn(stg_model *m, const stg_cpu_attn *cpu);
/* Replace a model's settings between steps (drops its CUDA graphs; ST_EINVAL with steps in flight). */
stg_status stg_model_set_settings(stg_model *m, const stg_settings *settings);
void stg_model_destroy(stg_model *m);
/* VRAM held by the weights, in bytes. */
int64_t stg_model_weight_bytes(const stg_model *m);
/* Layers that keep the routed split (routed_mv_groups) in decode-sized steps of T tokens: 0..n_layer (all of them
 * until the first decision; 0 where the split does not apply: T outside [gemm_min_tokens, 64], no routed experts). */
int32_t stg_model_routed_split_layers(const stg_model *m, int32_t T);
/* VRAM the model's own allocations hold, in bytes: weights (the arena: every non-routed tensor and the resident
 * experts) and scratch (the step buffers at their current size, the routing histogram, the hybrid buffers);
 * the KV cache is stg_kv_bytes. The driver's figure adds the CUDA context and its allocation granularity. */
stg_status stg_model_memory(const stg_model *m, int64_t *weights, int64_t *scratch);
/* Routed experts the device holds (all of them without hybrid placement). */
int64_t stg_model_resident_experts(const stg_model *m);
/* CUDA graphs cached for decode-sized steps, and how many captures failed (the last
 * failure's message in note, note_len bytes; those steps ran as plain launches). */
int32_t stg_model_graphs(const stg_model *m, int32_t *n_failed, char *note, int32_t note_len);

stg_status stg_kv_create(stg_model *m, int32_t n_blocks, int32_t block_size, stg_kv **out);
/* The cache's element type: STG_KV_F16 (stg_kv_create's), or STG_KV_Q8_0, the CPU engine's 8-bit cache (kv.c,
 * ST_KV_Q8_0): per group of 32 values of a token's K or V row, d = max|x| / 127 kept as F16 and q = round(x / d)
 * as int8, in kv.c's layout (K values [layer][block][kv_dim][block_size] with scales [layer][block][kv_dim / 32]
 * [block_size], V values [layer][block][block_size][kv_dim] with scales [layer][block][block_size][kv_dim / 32]),
 * so the device holds the CPU's bytes for the same K / V. Decode reads it in the split kernel, prefill in the
 * tensor-core kernel (docs/engine.md); ST_EUNSUPPORTED for models those do not take (head_dim other than 64 / 128,
 * more than 8 query heads per kv head or not dividing 16, latent attention) and for a device whose blocks cannot
 * opt in to their shared memory (head_dim 128: 85,248 bytes; sm_89 allows 101,376). */
#define STG_KV_F16 0
#define STG_KV_Q8_0 1
stg_status stg_kv_create_typed(stg_model *m, int32_t n_blocks, int32_t block_size, int32_t type, stg_kv **out);
/* A tiered cache (the CPU engine's st_kv_create_tiered on the device): n_dev blocks in VRAM and n_host in pinned,
 * mapped host memory (cudaHostAlloc), addressed by logical ids 0 .. n_dev + n_host - 1 that start at physical
 * block = id (ids below n_dev in VRAM). The kernels read and write host blocks in place over PCIe (the "streamed"
 * choice of the tiers: no staging copy), so a step's tokens are the same whichever tier holds a block.
 * stg_kv_create_typed is n_host = 0. ST_ENOMEM when either pool cannot be allocated. */
stg_status stg_kv_create_tiered(stg_model *m, int32_t n_dev, int32_t n_host, int32_t block_size, int32_t type,
                                stg_kv **out);
/* st_kv_swap's contract on the device: swaps the physical homes of logical blocks a and b (every layer's K and V,
 * and the 8-bit cache's scales), copying a's contents when copy_a and b's when copy_b. The copy is queued on the
 * model's stream (after every step already launched, before every later one); *bytes (optional): bytes copied.
 * Errors: untiered cache -> ST_EINVAL; an id outside the cache -> ST_ERANGE. */
stg_status stg_kv_swap(stg_kv *kv, int32_t a, int32_t b, int32_t copy_a, int32_t copy_b, uint64_t *bytes);
void stg_kv_destroy(stg_kv *kv);
/* Bytes the cache holds in VRAM, in the host tier (0 untiered), and in VRAM staging slots for the host tier's
 * blocks of a prefill-form step (grown on demand up to one layer of the whole host tier; 0 untiered). */
int64_t stg_kv_bytes(const stg_kv *kv);
int64_t stg_kv_host_bytes(const stg_kv *kv);
int64_t stg_kv_stage_bytes(const stg_kv *kv);

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

/* The frame profile of the last waited step (stg_step_wait, stg_forward). Two timelines of one step: the
 * device's t_total = t_gpu + t_pcie + t_gpu_wait, each part summed from its own events (so their sum checks the
 * account); the host's CPU-share thread spends t_cpu_experts computing and t_cpu_wait waiting on the device. */
typedef struct stg_profile {
    double t_total;       /* seconds: the step on the device, from its upload to its copies back */
    double t_gpu;         /* the device computing: t_total outside the CPU share's copies and waits */
    double t_cpu_experts; /* the host's wall time in the CPU engine's experts (pair lists included) */
    double t_gpu_wait;    /* the device waiting for the CPU's rows, summed over layers */
    int64_t pairs_gpu, pairs_cpu; /* routed (token, expert) pairs computed on each side */
    int64_t staged_bytes;         /* expert weights copied over PCIe into the staging ring for the step */
    double t_pcie;        /* the device copying xn and the routing to the host and reading the CPU's rows back */
    double t_cpu_wait;    /* the host waiting for a layer's xn and routing (the device's work before them) */
    int64_t pcie_bytes;   /* bytes of those copies (xn, routing, the CPU's rows and their indices) */
    /* staging (stg_settings.hybrid_stage): layers staged in the step (their copies' wait is in t_pcie, their bytes
     * in staged_bytes) and the rates the decision used: host -> device GB/s and the device's copy GB/s measured
     * at model creation, the CPU engine's routed pairs per second (0: staging unavailable or not rated) */
    int64_t staged_layers;
    double stage_pcie_gbs, stage_gpu_gbs, stage_cpu_pairs_s;
    /* a tiered KV cache: bytes of host-tier blocks the step's attention read over PCIe (each block its sequence
     * reads counted once: a decode step's exact figure, a lower bound for prefill tiles that reread it) */
    int64_t kv_host_bytes;
    /* kv_host_attn: bytes of host-tier blocks the CPU pool attended in the step (not in kv_host_bytes: they did not
     * cross PCIe) and the host's seconds in st_attn_blocks_part, summed over layers */
    int64_t kv_cpu_bytes;
    double t_cpu_attn;
    /* kv_host_attn: the CPU's share of the host-tier bytes the step read (kv_cpu_bytes over both), and the rates
     * the measured share (kv_host_share -1) weighs: the CPU pool's (GB/s, a running mean of its steps' kv_cpu_bytes
     * / t_cpu_attn; 0 before the first) and the device's over its share in the current form (kv_stream 1 in place,
     * 0 staged): a probe's, timed once by the first step of the form that may take the CPU's share, then the running
     * mean of one timed layer a step (host_sync.cu) */
    double kv_cpu_share, kv_cpu_gbs, kv_pcie_gbs;
    /* 1: t_gpu, t_pcie and t_gpu_wait come from the step's own events; 0 (a decode-sized hybrid step between two
     * sampled ones): t_gpu_wait from k_rows_direct's clock, t_gpu and t_pcie the rest split as the last measured
     * step of its size split it */
    int32_t measured;
    /* a tiered KV cache: the step read its host-tier blocks in place (1) or staged them into VRAM (0); -1 none */
    int32_t kv_form;
} stg_profile;
stg_status stg_step_profile(const stg_model *m, stg_profile *out);
/* Staging's CPU rate: the CPU engine's routed (token, expert) pairs per second at a prefill chunk, measured by
 * the caller at start-up (0: never stage). ST_EINVAL with steps in flight or a rate outside [0, 1e12]. */
stg_status stg_model_set_stage_rate(stg_model *m, double cpu_pairs_per_s);
/* Whether staging is available (hybrid_stage set, some layer partial, its host range page-locked) and its rates. */
stg_status stg_model_stage_info(const stg_model *m, int32_t *available, double *pcie_gbs, double *gpu_gbs,
                                double *cpu_pairs_s);

/* Page-locked host memory (cudaHostAlloc, portable to every device): a step whose logits
 * buffer is such memory copies them by DMA instead of through the driver's own staging
 * (the 19.4 MB of 32 sequences' logits take 1.3 ms per step into pageable memory).
 * The caller frees it with stg_host_free, also after the model is destroyed. */
stg_status stg_host_alloc(int64_t bytes, void **out);
void stg_host_free(void *p);

#endif
