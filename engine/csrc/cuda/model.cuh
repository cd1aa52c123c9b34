/* The model on the device: weights (dtensor / dlayer), the step's scratch, the graph cache, launched
 * steps in flight, the paged KV cache. model.cu creates them. */
#pragma once
#include <atomic>

#include "linear.cuh"

struct dtensor {
    const uint8_t *d = nullptr; /* device bytes; NULL = absent */
    int type = 0;
    int64_t ne[4] = {1, 1, 1, 1};
    int64_t row_bytes = 0, expert_stride = 0;
    const float *f() const { return (const float *)d; }
};

struct dlayer {
    dtensor attn_norm, wq, wk, wv, wo, bq, bk, bv, q_norm, k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down, gate_inp,
        gate_exps, up_exps, down_exps, gate_inp_shexp, gate_shexp, up_shexp, down_shexp;
    dtensor bo, sinks, gate_inp_b, gate_exps_b, up_exps_b, down_exps_b; /* gpt-oss (gptoss.cu) */
    dtensor exp_probs_b; /* [n_expert] F32: the score-correction bias of rule routing (router_sigmoid.cu) */
    /* deepseek2's latent attention (mla.cu; st_layer's fields): mla_kb the absorption matrix, wk_b or wkv_b's key
     * rows transposed per head (F32 [n_head][kv_lora_rank][nope], made at upload) */
    dtensor wq_a, q_a_norm, wq_b, wkv_a, kv_a_norm, wkv_b, wk_b, wv_b, mla_kb;
};

/* A list of device allocations freed together, and the bytes they hold (stg_model_memory). */
struct dlist : std::vector<void *> {
    int64_t bytes = 0;
};

struct scratch {
    int64_t cap_t = 0, cap_l = 0, cap_bt = 0;
    float *x, *xn, *q, *k, *v, *att, *router, *topk_w, *h, *h2, *pair_out, *gsh, *logits, *xl;
    int8_t *aq, *hq;
    float *ad, *hd;
    int32_t *as, *hs, *topk_id, *pair_tok, *list, *gexp, *gstart, *gcount, *n_groups, *ints;
    int32_t *gtiles, *n_gtiles; /* the routed GEMM's tiles (group_pairs) */
    int32_t *mexp, *mstart, *mcount, *n_mgroups, *pair_mv; /* a mixed routed launch's matvec share (group_out) */
    float *kpart;      /* the split dense GEMM's parts (g_kpart) */
    /* linear()'s per-256 activation view (g_k256q ...) of the largest activation matrix (aq's or hq's) */
    int8_t *kq;
    float *kd;
    int32_t *ks;
    int64_t k_cap; /* elements */
    /* latent attention (mla.cu; allocated for deepseek2 only): mq [T, n_head * head_dim] the queries, mkv [T,
     * kv_lora_rank + rope_dim] the new cache rows, mqa [T, q_lora_rank] the low-rank q, mg [T * n_head, nope] the
     * scaled non-rotary query parts, mo [T, n_head * head_dim_v] the heads' expanded outputs; the per-head linears'
     * groups (a group per head: mla_gexp / gstart / gcount [n_head], mla_list [T * n_head]) */
    float *mq, *mkv, *mqa, *mg, *mo;
    int32_t *mla_gexp, *mla_gstart, *mla_gcount, *mla_list;
    int64_t kpart_cap; /* floats */
    int32_t *h_ints; /* pinned host staging for the batch's index arrays: two slots of cap_ints (stg_step_launch's
                      * ticket parity), so that a step's upload may still be queued while the next one is filled */
    int32_t *picks;  /* [cap_l] the step's greedy picks (k_argmax_split), copied back instead of the logits */
    unsigned long long *pick_keys; /* [cap_l] k_argmax_split's per-row maxima, 0 between launches */
    unsigned int *pick_cnt;        /* [cap_l] its per-row tickets, 0 between launches */
    int64_t cap_ints;
    int32_t cur_seq_rows; /* sequences of the step being run (block-table rows) */
    /* split-KV decode's partials (attention_split.cu): cap_parts rows of (output [head_dim]) and (max, sum),
     * allocated by the first step that splits (ensure_att_parts) */
    float *apart = nullptr, *aml = nullptr;
    int64_t cap_parts = 0;
    dlist step_allocs, ints_allocs, part_allocs; /* replaced (freed) when a step needs more */
};

#define GRAPH_MAX_TOKENS 64 /* decode-sized steps: launch-bound, so replayed as graphs */

/* A captured step: its shape. The settings it was captured under are the model's (stg_model_set_settings drops
 * every graph), so they are not part of the key. */
struct graph_entry {
    const stg_kv *kv;
    int32_t T, NL, mb, n_seq_rows;
    int32_t att_split; /* step_shape.att_split: the split-KV grid's depth (1: the unsplit kernels) */
    bool layer_events, fuse_qkv, greedy;
    bool src; /* step_shape.d_src set (st_batch.token_src) */
    std::vector<uint8_t> mv_on; /* the layers that kept the routed split (stg_model.mv_step; empty: all) */
    cudaGraphExec_t exec;
};

/* A hybrid step's CPU share (hybrid.cu), per launched step. Per layer with a CPU share, five timed events on
 * the compute stream: s0 before xn and the routing go to the host, s1 after (the host waits on it), a before the
 * wait for the CPU's flag, b after it, c after the CPU's rows are copied in and scattered; the host's sums beside them. */
struct hybrid_step {
    std::vector<cudaEvent_t> s0, s1, a, b, c;
    std::vector<char> used;   /* [n_layer] the layer's handshake was queued (1 copies, 2 staged, 3 k_rows_direct) */
    bool events = true;       /* s0, a, b, c recorded (sampling leaves them out of most decode steps; s1 always) */
    double t_cpu = 0.0;      /* seconds in the CPU engine's experts (with the pair lists) */
    double t_cpu_wait = 0.0; /* seconds the host waited for s1 (and, overlapped, for the layer to be queued) */
    int64_t cpu_pairs = 0;
    int64_t pcie_d2h = 0, pcie_h2d = 0; /* bytes to the host (the queueing thread's sum), back (the CPU's) */
    uint32_t seq = 0; /* the flag value of this step */
    /* pinned, mapped [n_layer][2] (k_rows_direct layers): the device's %globaltimer (ns) when k_rows_direct's
     * block 0 starts and when it sees the layer's flag (the profile's wait inside a..c) */
    uint64_t *ts = nullptr;
    int64_t staged_layers = 0, staged_bytes = 0; /* staging.cu: layers computed from staged weights, bytes copied */
};

/* The overlapped step's CPU thread and the queueing thread: layers queued so far (s1 recorded), whether the
 * queueing stopped early, and the thread's result (its message: g_err is per thread). */
struct hybrid_worker {
    std::atomic<int32_t> queued{0};
    std::atomic<bool> abort{false};
    stg_status rc = ST_OK;
    char err[512] = "";
};

/* Staging (staging.cu): a step's layers whose experts are copied over PCIe into one of two device slots (each
 * a whole layer's routed experts: gate, up, down, every expert at its own index) and computed there instead of
 * on the CPU, chosen per step from rates measured at start-up. */
struct staging {
    bool on = false;                   /* registered, slots allocated, rates measured */
    uint8_t *slot[2] = {nullptr, nullptr};
    int64_t slot_bytes = 0;
    cudaStream_t copy = nullptr;
    cudaEvent_t staged[2] = {nullptr, nullptr}, freed[2] = {nullptr, nullptr};
    void *reg = nullptr; /* the page-locked (registered) host range holding those experts */
    double pcie_gbs = 0.0, gpu_gbs = 0.0; /* measured when the model opens */
    double cpu_pairs_s = 0.0;             /* the CPU engine's routed pairs per second (stg_model_set_stage_rate) */
    std::vector<char> now;                /* [n_layer]: staged in the step being queued */
    int32_t next = 0;                     /* the ring's next slot */
    /* hybrid_stage_skip: the routing seen so far (pairs per layer and expert, summed over the waited steps, and
     * their tokens); per partial layer of the step being queued, which experts its copies bring (want, [n_layer *
     * n_expert]); per slot, the device's copy of that mask (have[j], [n_expert]); the registered range's device
     * address (the same bytes as reg) */
    std::vector<double> seen;
    double seen_tokens = 0.0;
    std::vector<uint8_t> want;
    uint8_t *have[2] = {nullptr, nullptr};
    const uint8_t *reg_dev = nullptr;
};

/* The per-layer handshake between the device and a host thread (host_sync.cu; hybrid placement's CPU share and
 * kv_host_attn's): pinned, mapped words, flags[i] written by the host ((seq << 32) | n: layer i's results are in
 * place, n of them) and waited on by k_wait_flag, ready[i] written by k_to_host (seq: layer i's inputs are in
 * pinned memory) and spun on by the host. */
struct host_sync {
    uint64_t *flags = nullptr; /* [n] host -> device */
    uint32_t *ready = nullptr; /* [n] device -> host, from the next 64-byte line (flags' allocation) */
};
static stg_status host_sync_alloc(host_sync &hs, int n, const char *what);
static void host_sync_free(host_sync &hs);

/* kv_host_attn (host_sync.cu's host_attn_*; layer.cu): the CPU pool attends a decode step's host-tier blocks while
 * the device's split kernel attends its VRAM blocks; the CPU's partials join the combine as one more split. */
struct host_attn {
    stg_cpu_attn cpu = {};       /* stg_model_set_cpu_attn's (attn_blocks NULL: none) */
    host_sync sync;              /* [n_layer] */
    bool now = false;            /* the step being queued takes it */
    uint32_t seq = 0;            /* the last such step's flag value */
    int32_t T = 0, zmax = 1;     /* its tokens; its splits of one sequence at most (one left for the CPU's) */
    /* per step, on the host: each token's host-tier blocks (host-local ids, in sequence order) and their keys */
    std::vector<int32_t> blk_off, blocks, n_keys;
    /* grown with the steps (host_attn_room): pinned, mapped h_q [cap_t * q_dim] (k_to_host writes a layer's q),
     * pinned h_part [cap_t * n_head * (2 + head_dim)] the CPU's partials (ml rows, then acc rows) and their device
     * copy d_part; the step's compacted VRAM block tables d_bt [cap_bt] and key counts as positions d_pos [cap_t]
     * (uploaded from h_up) */
    float *h_q = nullptr, *h_part = nullptr, *d_part = nullptr;
    int32_t *d_bt = nullptr, *d_pos = nullptr, *h_up = nullptr, *d_n = nullptr;
    int64_t cap_t = 0, cap_bt = 0, n_bt = 0; /* n_bt: the step's table entries */
    std::vector<cudaEvent_t> ev; /* [n_layer] after each layer's k_to_host (the host's fallback on its spin) */
    /* the step's account: host-tier bytes the CPU attended and those the device streams (its share), the CPU's
     * seconds in st_attn_blocks_part and waiting, and its share of the host-tier bytes */
    int64_t bytes = 0, gpu_bytes = 0;
    double t_cpu = 0.0, t_wait = 0.0, share = 0.0;
    /* the rates kv_host_share -1 weighs (GB/s, 0: not known): the CPU's running mean over its steps, and the
     * device's over its share of the host blocks, per form (host_attn_form: 0 read in place, kv_stream 1; 1 staged
     * into VRAM, kv_stream 0): a probe's (k_pcie_probe's in-place reads, k_kv_stage's gathers) timed once, by the
     * first step of the form that may take the CPU's share (probed: not again, even where the probe found nothing),
     * then replaced by the running mean of the timed window of one layer a step (host_attn_mark, measured) */
    double cpu_gbs = 0.0, dev_gbs[2] = {0.0, 0.0};
    bool probed[2] = {false, false}, measured[2] = {false, false};
    /* that window: te [2] timing events around layer n_layer / 2's device work on its share (after k_to_host, before
     * k_wait_flag), recorded by the step being queued where t_now, read by the wait of t_ticket (0: none pending);
     * t_bytes the host-tier bytes of that layer the device reads there, t_form its form */
    cudaEvent_t te[2] = {nullptr, nullptr};
    bool t_now = false;
    int32_t t_form = 0;
    int64_t t_ticket = 0, t_bytes = 0;
    hybrid_worker *worker = nullptr; /* the step's CPU thread while it runs */
};

/* Hybrid placement (hybrid.cu): which routed experts the device holds (in slots, ascending expert id per layer at
 * creation, moved by stg_model_swap_expert)
 * and the buffers through which the CPU engine computes the others. */
struct hybrid {
    bool on = false;              /* some routed expert is not resident */
    std::vector<uint8_t> resident; /* [n_layer * n_expert] */
    std::vector<int32_t> n_slots;  /* [n_layer] resident experts (slots; stg_model_swap_expert keeps the count) */
    std::vector<int32_t> slot_of;  /* [n_layer * n_expert]: d_slot's host copy */
    std::vector<const uint8_t *> host; /* [n_layer * 3]: a partial layer's gate / up / down experts in host memory */
    int32_t *d_slot = nullptr;     /* device [n_layer * n_expert]: expert -> slot, -1 not resident */
    stg_cpu_experts cpu = {};
    /* grown with the scratch (cap_t tokens): device slot ids, the shared expert's rows (computed while the CPU
     * works) and the CPU's rows as copied in (d_rows: room for every pair's row of n_embd floats, then every
     * pair's index: the layer's n rows and n indices at the front of each); pinned host copies of xn and topk_id,
     * and the CPU's rows laid out as d_rows (h_rows) */
    int32_t *sid = nullptr;
    float *d_shx = nullptr, *d_rows = nullptr;
    float *h_xn = nullptr, *h_rows = nullptr;
    int32_t *h_ids = nullptr;
    int32_t *d_n = nullptr; /* device: the CPU's row count of the layer being summed (k_wait_flag writes it) */
    std::vector<void *> pinned;
    /* [n_layer]: the host writes a flag (seq << 32) | n when the layer's n rows are in h_rows (the device then copies
     * h_rows into d_rows); the device writes a step's seq into ready when the layer's xn and routing are in h_xn /
     * h_ids (hybrid_direct steps) */
    host_sync sync;
    bool direct = false;       /* the step being queued is hybrid_direct */
    bool rows_direct = false;  /* ... and its rows come in by k_rows_direct (a decode-sized step within ROWS_MAX_AT) */
    uint32_t seq = 0;          /* the last launched step's flag value */
    std::vector<int32_t> pair_tok, pair_exp, pair_idx; /* the CPU pairs of a layer (st_moe_pairs), their pair rows */
    hybrid_step *cur = nullptr;  /* the step being queued */
    hybrid_worker *worker = nullptr; /* the overlapped step's CPU thread, while it runs (NULL: inline) */
    staging stg;
    int32_t T = 0;                   /* the step's tokens (for the CPU thread) */
};

/* A launched step (stg_step_launch) until its stg_step_wait: two slots, by ticket parity. */
struct inflight {
    bool live = false;
    int64_t ticket = 0;
    int32_t T = 0, NL = 0;
    bool greedy = false, layer_events = false, sampled = false, moe = false;
    bool mv = false; /* its histogram feeds the routed split's decision (routed_mv_groups) */
    int32_t *expert_hist = nullptr; /* the batch's, added to at the wait */
    cudaEvent_t e0 = nullptr, e1 = nullptr; /* the step's start (before its upload) and end (after its copies) */
    int32_t *h_picks = nullptr;             /* pinned [cap_picks]: the picks' copy */
    int64_t cap_picks = 0;
    int32_t *h_hist = nullptr; /* pinned [n_layer * n_expert]: the histogram's copy */
    int64_t kv_host_bytes = 0; /* host-tier KV bytes its attention reads (stg_profile.kv_host_bytes) */
    int64_t kv_cpu_bytes = 0;  /* kv_host_attn: host-tier bytes the CPU attended, its seconds (stg_profile) */
    double t_cpu_attn = 0.0;
    double kv_cpu_share = 0.0; /* kv_host_attn: the CPU's share of the host-tier bytes */
    int32_t kv_form = -1;      /* a tiered step: 1 host blocks read in place, 0 staged, -1 none read */
    int32_t kv_pick = -1;      /* kv_stream -1: the form kv_form_pick chose (its time feeds kv_forms); -1 none */
    hybrid_step hy;
};

/* kv_stream -1 (step.cu, kv_form_pick): per decode step size T on a tiered cache, the running mean step time of
 * each form (1 in place, 0 staged) over its timed steps, the steps of each form still to skip before timing one
 * (its first: scratch and graph capture), the steps since the last look at the other form, and how many steps of
 * the other form are left in that look. */
struct kv_form_state {
    double t[2] = {0.0, 0.0};
    int32_t n[2] = {0, 0};
    int32_t skip[2] = {1, 1};
    int64_t since = 0;
    int32_t look = 0;
};

struct stg_model {
    int device;
    int cc_major = 0;
    int smem_optin = 48 * 1024; /* shared memory a block may opt in to (device_smem_optin, at model creation) */
    int32_t att_zmax = 1; /* splits of one sequence at most in split-KV decode (att_split_zmax of the SM count) */
    stg_settings set; /* read when the model opens (stg_model_create), replaced by stg_model_set_settings */
    st_model_desc d;
    std::vector<dlayer> L;
    dtensor token_embd, output_norm, output;
    /* latent attention: q_dim is n_head * max(kv_lora_rank + rope_dim, head_dim, head_dim_v) (the absorbed queries
     * [T, n_head, ck] and every per-head row set fit s.q / s.att / s.aq) and kv_dim the cached row ck */
    int32_t q_dim, kv_dim, n_ff, n_ff_exp, n_ff_shexp, max_k, ff_max;
    uint8_t *arena = nullptr;
    int64_t arena_bytes = 0;
    float *inv_freq = nullptr; /* [rope_dim / 2] each rotary pair's angle per position, rope scaling included */
    float rope_mscale = 1.0f;  /* the factor both rotated values take (YaRN's magnitude scaling) */
    int32_t *hist = nullptr; /* [n_layer, n_expert] */
    int32_t *route_counter = nullptr; /* k_router_route's finished-block count (0 between launches) */
    cudaStream_t stream = nullptr;
    /* the matvec share of a mixed routed launch runs here beside the GEMM's on `stream` (routed_mv_max),
     * forked and joined by two events (captured into the step's graph as two branches) */
    cudaStream_t side = nullptr;
    cudaEvent_t fork = nullptr, join = nullptr;
    std::vector<cudaEvent_t> ev; /* 3 per layer + 3 */
    scratch s;
    dlist allocs;
    std::vector<graph_entry> graphs;
    int32_t graph_failures = 0;
    char graph_note[256] = "";
    combine_args pending = {}; /* an expert sum not yet added to the residual (see take_combine) */
    /* per graph-sized step size: steps run, and the attention / experts / dense shares of
     * t_total measured on the last one with per-layer events (see stg_forward) */
    struct split {
        int64_t steps = 0;
        bool have = false;
        double attn = 0.0, experts = 0.0, dense = 0.0;
        /* decode-sized hybrid steps of this size launched, whether one has measured its frame, and
         * that frame's compute share of the device's time outside its waits for the CPU (t_gpu / (t_gpu + t_pcie)) */
        int64_t hy_steps = 0;
        bool hy_have = false;
        double hy_gpu = 1.0;
    };
    std::map<int32_t, split> splits;
    std::map<int32_t, kv_form_state> kv_forms; /* kv_stream -1, by decode step size */
    /* routed_mv_groups, per decode-sized step size T (rows of n_layer, T = 0..GRAPH_MAX_TOKENS): each layer's
     * running mean of the experts the split puts on the matvec (-1: no step yet), the layers that keep the split
     * (re-decided every MV_DECIDE steps of that size, so graphs are re-captured seldom) and the steps since; mv_step
     * is the launched step's row of mv_on (NULL: every layer keeps it), read by ffn_block. */
    std::vector<float> mv_mean;
    std::vector<uint8_t> mv_on;
    std::vector<int32_t> mv_seen;
    const uint8_t *mv_step = nullptr;
    std::vector<int32_t> hist_h; /* the step's expert histogram, copied back with the logits */
    std::vector<char> seq_seen;  /* stg_forward's distinct-sequence check */
    /* a tiered cache (step.cu): each row's last block a step reads and first it writes; the staging write-backs */
    std::vector<int32_t> seq_last, seq_first, seq_wb;
    inflight fl[2];              /* launched steps, slot = ticket & 1 */
    int64_t next_ticket = 1;
    int32_t n_live = 0;
    int32_t last_picks = 0; /* greedy picks in s.picks from the last launched step (token_src's bound); 0 none */
    hybrid hy;
    host_attn ha;
    stg_profile profile = {}; /* the last waited step's (stg_step_profile) */
};

/* gptoss.cu: the checks of gpt-oss's own tensors and routing (after validate's) */
static stg_status oss_validate(const stg_model *m, const st_layer *layers);
/* mla.cu: deepseek2's latent attention: the checks of its tensors, the absorption matrices (after the upload) */
static stg_status mla_validate(const stg_model *m, const st_layer *layers);
static stg_status mla_prepare(stg_model *m);
/* host_sync.cu: kv_host_attn's buffers, flags and events (at model destruction) */
static void host_attn_destroy(stg_model *m);
/* hybrid.cu: the placement (at model creation) and the CPU share's buffers (with the scratch) */
static stg_status hybrid_setup(stg_model *m, const uint8_t *resident, const stg_cpu_experts *cpu);
static stg_status hybrid_scratch(stg_model *m, int64_t T);
/* staging.cu: the ring, the registration and the rates (at model creation, the streams made); its teardown */
static stg_status staging_setup(stg_model *m, const st_layer *layers);
static void staging_destroy(stg_model *m);
static void staging_decide(stg_model *m, int32_t T); /* which layers the step of T tokens stages */
static void staging_observe(stg_model *m, int32_t T, const int32_t *hist); /* a waited step's routing [n_layer * ne] */
static bool staged_layer(const stg_model *m, int il); /* staged in the step being queued */

static void drop_graphs(stg_model *m) {
    for (graph_entry &g : m->graphs) cudaGraphExecDestroy(g.exec);
    m->graphs.clear();
}

struct stg_kv {
    stg_model *m;
    int32_t n_blocks, block_size, n_layer, kv_dim; /* n_blocks: logical blocks, both tiers (n_dev + n_host) */
    int32_t type;       /* STG_KV_F16 or STG_KV_Q8_0 */
    __half *k, *v;      /* F16: [layer][block][kv_dim][block_size], [layer][block][block_size][kv_dim]; latent
                         * attention: k holds the rows [layer][block][block_size][kv_dim] (mla.cu), v NULL */
    int8_t *k8, *v8;    /* Q8_0: the values at those indices (kv_store) */
    __half *ks, *vs;    /* Q8_0: a scale per 32 values, layer_elems / 32 per layer */
    int64_t layer_elems; /* values per layer of K (and of V) in VRAM: n_dev blocks */
    /* the host tier (stg_kv_create_tiered; n_host 0: none): the same arrays for n_host blocks in pinned, mapped host
     * memory (cudaHostAlloc, read by the kernels through kv_blk), host_elems values per layer; map[logical] the
     * physical block (< n_dev: VRAM) that step.cu writes into the uploaded block tables; stg_kv_swap moves blocks */
    int32_t n_dev = 0, n_host = 0;
    __half *hk = nullptr, *hv = nullptr;
    int8_t *hk8 = nullptr, *hv8 = nullptr;
    __half *hks = nullptr, *hvs = nullptr;
    int64_t host_elems = 0;
    std::vector<int32_t> map;
    /* staging (prefill-form steps of a tiered cache, step.cu): the step's host blocks gathered layer by layer into
     * device slots before its attention (whose query tiles each read every key: streamed, a host block would cross
     * PCIe once per tile), written back after it where the step wrote them. stage: stage_cap slots of every array
     * (array i at stage_off[i]); d_list: (slot, host block) pairs, the gathers then the write-backs; st_n / st_wb:
     * the step being queued's counts (0: the step streams) */
    unsigned char *stage = nullptr;
    int64_t stage_off[4] = {};
    int32_t stage_cap = 0;
    int32_t *d_list = nullptr;
    int32_t st_n = 0, st_wb = 0;
    std::vector<int32_t> slot_of, list; /* host block -> slot of the step being built; the pairs */
    std::vector<char> slot_w;           /* slot -> written by the step (in the write-backs) */
};
