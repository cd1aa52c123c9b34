/* The step: batch checks and upload, run_step over the layers and the head, CUDA graphs per shape,
 * the launch / wait halves and stg_forward. */
#include "model.cuh"

/* whether every token of a step (seq[T], runs of consecutive equal ids) is in a run of >= min_run */
static bool all_runs_long(const int32_t *seq, int32_t T, int32_t min_run) {
    if (min_run < 1 || T < min_run) return false;
    for (int32_t i = 0; i < T;) {
        int32_t j = i + 1;
        while (j < T && seq[j] == seq[i]) j++;
        if (j - i < min_run) return false;
        i = j;
    }
    return true;
}

/* The block tables' padded width (columns; the pad is -1), a key of the step's graph, so that one graph serves
 * a range of lengths: a multiple of 16 up to 64 columns, then four widths per octave (at most 25% over), so a
 * sequence growing to 128k tokens in blocks of 16 crosses about 30 widths (one capture each), not 512. */
static int32_t table_width(int32_t max_blocks) {
    const int32_t w = (max_blocks + 15) / 16 * 16;
    if (w <= 64) return w;
    int32_t q = 16;
    while (q * 8 <= w) q *= 2; /* q = 2^(floor(log2 w) - 2) */
    return (w + q - 1) / q * q;
}

/* ------------------------------------------------------------------ the step */

static stg_status validate_batch(const stg_model *m, const stg_kv *kv, const st_batch *b) {
    if (b->n_tokens < 1) return fail(ST_EINVAL, "forward: empty batch");
    if (!b->tokens || !b->pos || !b->seq || !b->block_tables || b->n_seqs < 1 || b->max_blocks < 1)
        return fail(ST_EINVAL, "forward: batch is missing arrays");
    if (b->n_logits < 0 || (b->n_logits > 0 && (!b->logit_idx || (!b->logits && !b->out_tokens))))
        return fail(ST_EINVAL, "forward: logits requested without buffers (logits or out_tokens)");
    for (int32_t i = 0; i < b->n_tokens; i++) {
        const int32_t src = b->token_src ? b->token_src[i] : -1;
        if (src >= 0 && m->last_picks < 1)
            return fail(ST_EINVAL, "forward: token_src[%d] = %d but the previous step left no greedy picks", i, src);
        if (src < -1 || src >= m->last_picks)
            return fail(ST_ERANGE, "forward: token_src[%d] = %d outside [-1, %d)", i, src, m->last_picks);
        if (src < 0 && (b->tokens[i] < 0 || b->tokens[i] >= m->d.n_vocab))
            return fail(ST_ERANGE, "forward: token id %d out of range [0, %d)", b->tokens[i], m->d.n_vocab);
        if (b->seq[i] < 0 || b->seq[i] >= b->n_seqs)
            return fail(ST_ERANGE, "forward: sequence index %d out of range", b->seq[i]);
        if (b->pos[i] < 0 || b->pos[i] / kv->block_size >= b->max_blocks)
            return fail(ST_ERANGE, "forward: position %d exceeds the sequence's KV capacity (%d tokens)", b->pos[i],
                        b->max_blocks * kv->block_size);
        const int32_t *bt = b->block_tables + (size_t)b->seq[i] * (size_t)b->max_blocks;
        for (int32_t j = 0; j <= b->pos[i] / kv->block_size; j++)
            if (bt[j] < 0 || bt[j] >= kv->n_blocks)
                return fail(ST_ERANGE, "forward: block %d of sequence %d is %d, outside [0, %d)", j, b->seq[i], bt[j],
                            kv->n_blocks);
    }
    for (int32_t i = 0; i < b->n_logits; i++)
        if (b->logit_idx[i] < 0 || b->logit_idx[i] >= b->n_tokens)
            return fail(ST_ERANGE, "forward: logit index %d out of range", b->logit_idx[i]);
    return ST_OK;
}

/* The device work of one step (everything between the batch upload and the logits
 * download): captured once per shape as a CUDA graph for small batches. */
struct step_shape {
    int32_t T, NL, mb;
    const int32_t *d_tok, *d_pos, *d_seq, *d_lidx, *d_bt;
    bool capturing;    /* inside a graph capture: events become record nodes */
    bool layer_events; /* per-layer attention / FFN times (stg_settings.layer_events) */
    bool fuse_qkv;     /* every token of another sequence: q/k/v post-processing inside attention */
    const int32_t *d_tiles; /* query tiles of prefill attention (eager steps only; n_tiles 0: none) */
    int32_t n_tiles;
    bool greedy; /* the logit rows' greedy picks into s.picks after the head (k_argmax_split) */
    const int32_t *d_src; /* st_batch.token_src uploaded, or NULL: the embedding reads the previous picks */
    int32_t att_split; /* split-KV decode's grid depth (att_split_grid; 1: the unsplit kernels) */
};

/* An event record that also works inside a capture (there a plain record would only
 * express a dependency; the External flag makes it a node that records at each replay). */
static cudaError_t record(cudaEvent_t e, cudaStream_t st, bool capturing) {
    return cudaEventRecordWithFlags(e, st, capturing ? cudaEventRecordExternal : cudaEventRecordDefault);
}

static stg_status run_step(stg_model *m, stg_kv *kv, const step_shape &sh) {
    scratch &s = m->s;
    cudaStream_t st = m->stream;
    cudaEvent_t *ev = m->ev.data();
    const int nL = m->d.n_layer;
    const int64_t E = m->d.n_embd;
    if (m->d.n_expert > 0) CU(cudaMemsetAsync(m->hist, 0, sizeof(int32_t) * nL * m->d.n_expert, st), "forward");
    m->pending = combine_args{};
    const bool pdl = g_pdl;
    g_pdl = false; /* the first kernel follows a copy, not a kernel */
    const stg_status erc = embed(m, sh.d_tok, sh.d_src, sh.T);
    g_pdl = pdl;
    CHECK(erc);
    for (int il = 0; il < nL; il++) {
        if (sh.layer_events) CU(record(ev[3 * il], st, sh.capturing), "forward");
        CHECK(attention_block(m, kv, il, sh.T, sh.d_pos, sh.d_seq, sh.d_bt, sh.mb, sh.fuse_qkv, sh.d_tiles,
                              sh.n_tiles, sh.att_split));
        if (sh.layer_events) CU(record(ev[3 * il + 1], st, sh.capturing), "forward");
        CHECK(ffn_block(m, il, sh.T));
        if (sh.layer_events) CU(record(ev[3 * il + 2], st, sh.capturing), "forward");
    }
    CU(record(ev[3 * nL + 1], st, sh.capturing), "forward");
    if (sh.NL > 0) {
        const bool nq = stg_reads_q32(m->output.type);
        launch_k(k_rmsnorm, sh.NL, RMS_THREADS, 0, st, s.x, sh.d_lidx, m->output_norm.f(), s.xl, E, m->d.norm_eps,
                                          nq ? s.aq : nullptr, s.ad, s.as, take_combine(m));
        LAUNCHED("output norm");
        const acts_d in{s.aq, s.ad, s.as, s.xl};
        lin_groups g = {};
        g.n_pairs = sh.NL;
        const bool fast = g_gemm_fast;
        g_gemm_fast = false; /* the head keeps the bitwise kernels (a few rows of logits: the matvec) */
        const stg_status hrc = linear(st, m->output, nullptr, g, 1, sh.NL, sh.NL, in, s.logits, m->d.n_vocab, MODE_STORE);
        g_gemm_fast = fast;
        CHECK(hrc);
        if (sh.greedy) {
            launch_k(k_argmax_split, dim3((unsigned)ARGMAX_SPLIT, (unsigned)sh.NL), ARGMAX_SPLIT_THREADS, 0, st,
                     (const float *)s.logits, (int64_t)m->d.n_vocab, s.picks, s.pick_keys, s.pick_cnt);
            LAUNCHED("greedy pick");
        }
    }
    m->pending = combine_args{}; /* no logits: the last layer's sum is never needed */
    return ST_OK;
}

#define LAYER_EVENT_PERIOD 64 /* graph-sized steps: per-layer events on one step in 64 (each such step +0.2 ms at batch 1) */

/* A sampled kind of step (have: one has been measured; steps: those launched so far): whether this one records its
 * events, the first until one is measured and then one in LAYER_EVENT_PERIOD. */
static bool sample_events(bool have, int64_t &steps) {
    const bool now = !have || steps % LAYER_EVENT_PERIOD == 0;
    steps++;
    return now;
}
#define GRAPH_CACHE 64

/* a hybrid model's steps are queued layer by layer by the host (hybrid.cu): never a graph */
static bool graphs_enabled(const stg_model *m, int32_t T) { return T <= GRAPH_MAX_TOKENS && m->set.graphs && !m->hy.on; }

#define KV_FORM_TIMED 3    /* kv_stream -1: timed steps of each form before the faster one is kept */
#define KV_FORM_PERIOD 64  /* steps between two looks at the other form */
#define KV_FORM_EWMA 0.25  /* a new step time's weight in its form's running mean */

/* kv_stream -1: the form (1 in place, 0 staged) of a decode step of T tokens on a tiered cache. Until both forms
 * have KV_FORM_TIMED timed steps, the one with fewer; then the faster by its running mean. Every KV_FORM_PERIOD
 * steps the other form is timed afresh (its first step skipped again), since a step's host-tier bytes grow with
 * its sequences and so move the two forms' times apart. */
static int kv_form_pick(stg_model *m, int32_t T) {
    kv_form_state &s = m->kv_forms[T];
    if (s.n[0] < KV_FORM_TIMED || s.n[1] < KV_FORM_TIMED) return s.n[1] < s.n[0] ? 1 : 0;
    const int best = s.t[1] < s.t[0] ? 1 : 0;
    if (++s.since % KV_FORM_PERIOD == 0) s.n[1 - best] = 0, s.skip[1 - best] = 1; /* the next steps time it */
    return best;
}

/* A waited kv_stream -1 step: its device time t into its form's running mean (after the form's skipped steps). */
static void kv_form_observe(stg_model *m, int32_t T, int form, double t) {
    const auto it = m->kv_forms.find(T);
    if (it == m->kv_forms.end() || (form != 0 && form != 1) || !(t > 0.0)) return;
    kv_form_state &s = it->second;
    if (s.skip[form] > 0) {
        s.skip[form]--;
        return;
    }
    s.t[form] = s.n[form] == 0 ? t : (1.0 - KV_FORM_EWMA) * s.t[form] + KV_FORM_EWMA * t;
    if (s.n[form] < KV_FORM_TIMED) s.n[form]++;
}

#define MV_DECIDE 32 /* decode steps of one size between two decisions of the routed split (mv_update) */
#define MV_FIRST 4   /* and before the first one */

/* Whether a step of T tokens takes the routed split in some layer (routed_mv_max): a decode-sized step from
 * gemm_min_tokens on, of a model with routed experts. */
static bool mv_applies(const stg_model *m, int32_t T) {
    const stg_settings &st = m->set;
    return m->d.n_expert > 0 && st.routed_mv_max > 0 && st.gemm_min_tokens > 0 && T >= st.gemm_min_tokens &&
           T <= GRAPH_MAX_TOKENS;
}

/* The layers that keep the routed split in this step of T tokens (stg_model.mv_on's row), or NULL: all of them. */
static const uint8_t *mv_mask(stg_model *m, int32_t T) {
    if (!mv_applies(m, T) || m->set.routed_mv_groups <= 0) return nullptr;
    const size_t nL = (size_t)m->d.n_layer, rows = GRAPH_MAX_TOKENS + 1;
    if (m->mv_on.empty()) {
        m->mv_mean.assign(rows * nL, -1.0f);
        m->mv_on.assign(rows * nL, 1);
        m->mv_seen.assign(rows, MV_DECIDE - MV_FIRST);
    }
    return &m->mv_on[(size_t)T * nL];
}

/* A step's histogram [n_layer, n_expert] into the running means of its size; every MV_DECIDE steps, the layers
 * that keep the split. A layer's sample is the number of experts the split puts on the matvec (1..routed_mv_max
 * pairs; 0 where the busiest expert makes the device keep the GEMM alone, as group_out does). A layer keeps the
 * split while its mean stays at least half of routed_mv_groups and takes it back once the mean reaches it. */
static void mv_update(stg_model *m, int32_t T, const int32_t *hist) {
    const int nL = m->d.n_layer, ne = m->d.n_expert, mv = m->set.routed_mv_max;
    float *mean = &m->mv_mean[(size_t)T * nL];
    for (int il = 0; il < nL; il++) {
        const int32_t *row = hist + (size_t)il * ne;
        int32_t busiest = 0, small = 0;
        for (int e = 0; e < ne; e++) busiest = std::max(busiest, row[e]), small += row[e] > 0 && row[e] <= mv;
        const float v = busiest > MV_GUARD * mv ? 0.0f : (float)small;
        mean[il] = mean[il] < 0.0f ? v : mean[il] + (v - mean[il]) * (1.0f / 16.0f);
    }
    if (++m->mv_seen[(size_t)T] < MV_DECIDE) return;
    m->mv_seen[(size_t)T] = 0;
    uint8_t *on = &m->mv_on[(size_t)T * nL];
    const float g = (float)m->set.routed_mv_groups;
    for (int il = 0; il < nL; il++) on[il] = mean[il] >= (on[il] ? 0.5f * g : g);
}

static bool same_mask(const std::vector<uint8_t> &a, const uint8_t *b, int n) {
    return b ? a.size() == (size_t)n && memcmp(a.data(), b, (size_t)n) == 0 : a.empty();
}

extern "C" int32_t stg_model_routed_split_layers(const stg_model *m, int32_t T) {
    if (!m || !mv_applies(m, T)) return 0;
    const int nL = m->d.n_layer;
    if (m->set.routed_mv_groups <= 0 || m->mv_on.empty()) return nL;
    int32_t n = 0;
    for (int il = 0; il < nL; il++) n += m->mv_on[(size_t)T * nL + il];
    return n;
}

/* Replay the graph of this shape, capturing it first; a shape that cannot be captured
 * runs eagerly. Graphs hold scratch pointers: ensure_scratch drops them on growth. */
static stg_status run_step_graph(stg_model *m, stg_kv *kv, const step_shape &sh) {
    cudaStream_t st = m->stream;
    for (const graph_entry &g : m->graphs)
        if (g.kv == kv && g.T == sh.T && g.NL == sh.NL && g.mb == sh.mb && g.n_seq_rows == m->s.cur_seq_rows &&
            g.att_split == sh.att_split &&
            g.layer_events == sh.layer_events && g.fuse_qkv == sh.fuse_qkv && g.greedy == sh.greedy &&
            g.src == (sh.d_src != nullptr) && same_mask(g.mv_on, m->mv_step, m->d.n_layer)) {
            CU(cudaGraphLaunch(g.exec, st), "forward: graph launch");
            return ST_OK;
        }
    if (m->graphs.size() >= GRAPH_CACHE) {
        CU(cudaStreamSynchronize(st), "forward: graph cache"); /* a launched step may be running one of them */
        drop_graphs(m);
    }
    CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "forward: capture");
    step_shape cap = sh;
    cap.capturing = true;
    const stg_status rc = run_step(m, kv, cap);
    cudaGraph_t graph = nullptr;
    const cudaError_t ce = cudaStreamEndCapture(st, &graph);
    cudaGraphExec_t exec = nullptr;
    if (rc == ST_OK && ce == cudaSuccess && graph && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess) {
        cudaGraphDestroy(graph);
        m->graphs.push_back(graph_entry{kv, sh.T, sh.NL, sh.mb, m->s.cur_seq_rows, sh.att_split, sh.layer_events,
                                        sh.fuse_qkv, sh.greedy,
                                        sh.d_src != nullptr,
                                        m->mv_step ? std::vector<uint8_t>(m->mv_step, m->mv_step + m->d.n_layer)
                                                   : std::vector<uint8_t>(),
                                        exec});
        CU(cudaGraphLaunch(exec, st), "forward: graph launch");
        return ST_OK;
    }
    if (graph) cudaGraphDestroy(graph);
    m->graph_failures++;
    snprintf(m->graph_note, sizeof m->graph_note, "capture of a %d-token step failed: %.200s", sh.T,
             rc != ST_OK ? g_err : cudaGetErrorString(ce != cudaSuccess ? ce : cudaGetLastError()));
    cudaGetLastError();
    if (rc != ST_OK) return rc;
    return run_step(m, kv, sh); /* not capturable here: run it as is */
}

/* The step in two halves. step_launch validates, uploads (from the ticket's staging slot), queues
 * the step and its copies back (picks and histogram into the slot's pinned buffers) and the slot's
 * end event; it returns without waiting. step_wait synchronises on that event and fills the outputs.
 * stg_forward is the two back to back (and alone may copy logits). */
static stg_status step_launch(stg_model *m, stg_kv *kv, const st_batch *b, int64_t *ticket) {
    if (m->n_live >= 2)
        return fail(ST_EINVAL, "step_launch: two launched steps are in flight already (wait for the older first)");
    CHECK(validate_batch(m, kv, b));
    CU(cudaSetDevice(m->device), "forward");
    cudaGetLastError(); /* a failed call elsewhere must not be reported by this step's first check */
    const int32_t T = b->n_tokens, NL = b->n_logits;
    const int64_t tk = m->next_ticket;
    inflight &f = m->fl[tk & 1];
    const inflight &other = m->fl[(tk + 1) & 1];
    const int32_t mb = table_width(b->max_blocks);
    const int64_t n_bt = (int64_t)b->n_seqs * mb;
    CHECK(ensure_scratch(m, T, NL, n_bt));
    /* q/k/v post-processing inside attention when no token reads another's new K/V of this
     * step: every token of a different sequence (decode). */
    /* latent attention (mla.cu) prepares its queries and cache rows itself and takes one kernel at every step */
    const bool mla = m->d.kv_lora_rank > 0;
    bool fuse_qkv = m->d.head_dim <= 256 && !mla;
    if (fuse_qkv) {
        std::vector<char> &seen = m->seq_seen;
        seen.assign((size_t)b->n_seqs, 0);
        for (int32_t i = 0; i < T && fuse_qkv; i++) {
            if (seen[(size_t)b->seq[i]]) fuse_qkv = false;
            seen[(size_t)b->seq[i]] = 1;
        }
    }
    /* split-KV decode at long context: whether from the step's longest sequence, the grid's depth from the padded
     * table width (both in the graph's key). The 8-bit cache has no unsplit decode kernel: its decode steps of at
     * most ATT_SPLIT_MAX_T tokens always take the split kernel (a sequence below att_split_min keys in one split),
     * larger ones the prefill tiles, and its other steps never replay a graph (their tiles are eager). */
    const bool q8 = kv->type == STG_KV_Q8_0;
    if (q8 && T > ATT_SPLIT_MAX_T) fuse_qkv = false;
    int32_t max_keys = 0;
    for (int32_t i = 0; i < T; i++) max_keys = std::max(max_keys, b->pos[i] + 1);
    auto split_depth = [&](int32_t z_max) {
        return mla  ? 1
               : q8 ? (fuse_qkv ? att_split_bound((int64_t)mb * kv->block_size, ATT_SPLIT_CHUNKS, z_max) : 1)
                    : att_split_grid(m->set, m->d, z_max, T, fuse_qkv, max_keys, (int64_t)mb * kv->block_size);
    };
    int32_t att_split = split_depth(m->att_zmax);
    /* kv_host_attn (host_sync.cu): the CPU attends its share of the host-tier blocks as one more split (so the
     * device keeps one split fewer at most); eager, without PDL; kv_stream 0 stages the device's share */
    bool hattn = false;
    CHECK(host_attn_plan(m, kv, b, mb, att_split > 1 || (q8 && fuse_qkv), &hattn));
    if (hattn) att_split = split_depth(m->ha.zmax);
    if (att_split > 1 || (q8 && fuse_qkv))
        CHECK(ensure_att_parts(m, (int64_t)T * (att_split + (hattn ? 1 : 0)) * m->d.n_head));
    /* a tiered cache with kv_stream 0 stages every step's host blocks: eagerly (the slots change every step); -1
     * picks a decode step's form by the two forms' measured times (kv_form_pick), other steps stage */
    const bool kv_timed = m->set.kv_stream < 0 && kv->n_host > 0 && fuse_qkv && !hattn;
    const int kv_stream = kv_timed ? kv_form_pick(m, T) : m->set.kv_stream < 0 ? 0 : m->set.kv_stream;
    const bool graph = graphs_enabled(m, T) && (!q8 || fuse_qkv) && (kv->n_host == 0 || kv_stream) && !hattn;
    scratch &s = m->s;
    s.cur_seq_rows = b->n_seqs;
    cudaStream_t st = m->stream;
    const int nL = m->d.n_layer;
    const bool moe = m->d.n_expert > 0;
    if (!f.e0) CU(cudaEventCreate(&f.e0), "forward: events");
    if (!f.e1) CU(cudaEventCreate(&f.e1), "forward: events");
    const bool greedy = NL > 0 && b->out_tokens;
    if (greedy && NL > f.cap_picks) { /* the slot is free: nothing queued writes into it */
        if (f.h_picks) cudaFreeHost(f.h_picks);
        f.h_picks = nullptr, f.cap_picks = 0;
        const int64_t want = std::max<int64_t>(NL, 64);
        CU(cudaMallocHost(&f.h_picks, sizeof(int32_t) * (size_t)want), "pinned picks");
        f.cap_picks = want;
    }
    if (moe && !f.h_hist)
        CU(cudaMallocHost(&f.h_hist, sizeof(int32_t) * (size_t)nL * (size_t)m->d.n_expert), "pinned histogram");
    CU(cudaEventRecord(f.e0, st), "forward");
    /* one upload of the batch's index arrays, from this ticket's staging slot (the other slot's upload
     * may still be queued behind the step in flight) */
    int32_t *hi = s.h_ints + (tk & 1) * s.cap_ints;
    memcpy(hi, b->tokens, sizeof(int32_t) * T);
    memcpy(hi + T, b->pos, sizeof(int32_t) * T);
    memcpy(hi + 2 * T, b->seq, sizeof(int32_t) * T);
    if (NL) memcpy(hi + 3 * T, b->logit_idx, sizeof(int32_t) * NL);
    int32_t *hbt = hi + 3 * T + NL;
    for (int32_t r = 0; r < b->n_seqs; r++) {
        memcpy(hbt + (int64_t)r * mb, b->block_tables + (int64_t)r * b->max_blocks, sizeof(int32_t) * b->max_blocks);
        for (int32_t c = b->max_blocks; c < mb; c++) hbt[(int64_t)r * mb + c] = -1;
    }
    f.kv_host_bytes = 0;
    f.kv_form = -1, f.kv_pick = kv_timed ? kv_stream : -1;
    kv->st_n = kv->st_wb = 0;
    if (kv->n_host > 0) { /* a tiered cache: the kernels see physical blocks (kv->map), host ones from n_dev on */
        std::vector<int32_t> &last = m->seq_last, &first = m->seq_first;
        last.assign((size_t)b->n_seqs, -1); /* each row's last block read by the step */
        first.assign((size_t)b->n_seqs, INT32_MAX); /* and the first it writes */
        for (int32_t i = 0; i < T; i++) {
            const size_t r = (size_t)b->seq[i];
            last[r] = std::max(last[r], b->pos[i] / kv->block_size), first[r] = std::min(first[r], b->pos[i] / kv->block_size);
        }
        /* a prefill-form step (eager, runs of one sequence's tokens: query tiles that each read every key) stages
         * its host blocks in VRAM layer by layer; a decode step reads each host byte once and streams it (kv_stream
         * 0: every step stages, graphs off above; a kv_host_attn step only the device's share, below) */
        const bool staged = !graph && (!fuse_qkv || !kv_stream), stage = staged && !hattn;
        if (staged) kv->slot_of.assign((size_t)kv->n_host, -1), kv->list.clear(), kv->slot_w.clear();
        auto slot_for = [&](int32_t e) { /* host block e's staging slot (e - n_dev), taken at its first read */
            int32_t &sl = kv->slot_of[(size_t)(e - kv->n_dev)];
            if (sl < 0) {
                sl = (int32_t)(kv->list.size() / 2);
                kv->list.push_back(sl), kv->list.push_back(e - kv->n_dev);
                kv->slot_w.push_back(0);
            }
            return sl;
        };
        std::vector<int32_t> &wb = m->seq_wb;
        wb.clear();
        int64_t host_blocks = 0;
        for (int32_t r = 0; r < b->n_seqs; r++)
            for (int32_t c = 0; c < b->max_blocks; c++) {
                int32_t &e = hbt[(int64_t)r * mb + c];
                if (e < 0 || e >= kv->n_blocks) continue; /* past the row's blocks (validate_batch checked the rest) */
                e = kv->map[(size_t)e];
                if (c > last[(size_t)r] || e < kv->n_dev) continue;
                if (!stage) {
                    host_blocks++;
                    continue;
                }
                const int32_t sl = slot_for(e);
                if (c >= first[(size_t)r] && !kv->slot_w[(size_t)sl]) { /* written by the step: goes back after */
                    kv->slot_w[(size_t)sl] = 1;
                    wb.push_back(sl), wb.push_back(e - kv->n_dev);
                }
                e = kv->n_dev + sl;
            }
        if (staged && hattn) { /* the device's share (its compacted tables, host_attn_plan's) into staging slots */
            host_blocks = 0;
            for (int64_t i = 0; i < m->ha.n_bt; i++) {
                int32_t &e = m->ha.h_up[i];
                if (e >= kv->n_dev) e = kv->n_dev + slot_for(e);
            }
        }
        if (staged && !kv->list.empty()) {
            kv->st_n = (int32_t)(kv->list.size() / 2), kv->st_wb = (int32_t)(wb.size() / 2);
            CHECK(kv_stage_room(kv, kv->st_n));
            kv->list.insert(kv->list.end(), wb.begin(), wb.end());
            CU(cudaMemcpyAsync(kv->d_list, kv->list.data(), sizeof(int32_t) * kv->list.size(), cudaMemcpyHostToDevice,
                               st),
               "forward: upload the staging list");
            host_blocks = kv->st_n + kv->st_wb;
        }
        /* kv_host_attn: the device streams (or stages) its share of them, the CPU reads the rest */
        f.kv_host_bytes = hattn && !staged ? m->ha.gpu_bytes : host_blocks * kv_block_bytes(kv);
        f.kv_form = f.kv_host_bytes > 0 ? (staged ? 0 : 1) : -1;
        if (hattn) host_attn_time_plan(m, f.kv_host_bytes); /* the device's rate over its share, for the next steps */
    }
    f.kv_cpu_bytes = hattn ? m->ha.bytes : 0, f.t_cpu_attn = 0.0, f.kv_cpu_share = hattn ? m->ha.share : 0.0;
    /* query tiles for prefill attention: eager steps only (a graph's grid could not follow
     * the tile count), after the block tables (ensure_scratch leaves room for T more ints) */
    /* gpt-oss's sinks and sliding windows are k_attention's alone (gptoss.cu): no query tiles */
    const bool oss = m->d.arch == ST_ARCH_GPT_OSS;
    const int tq = oss || mla ? 0 : att_tile_tokens(m->d.n_head, m->d.n_head_kv, m->d.head_dim);
    int32_t n_tiles = 0, n_mma = 0;
    const bool tiles_wanted = tq > 0 && !graph;
    /* runs of at least att_mma_min tokens on the tensor cores (attention_mma.cuh); on the 8-bit cache every run */
    const int mma_mode = q8 ? 2 : m->set.att_mma,
              tqm = mma_mode && !oss && !mla ? att_mma_tokens(m->d.n_head, m->d.n_head_kv, m->d.head_dim,
                                                              amma_pick(m->d.head_dim, m->smem_optin).rows)
                                             : 0;
    if (tiles_wanted && tqm)
        att_split_tiles(b->seq, T, tq, tqm, q8 ? 1 : m->set.att_mma_min, hi + 3 * T + NL + n_bt, &n_tiles, &n_mma);
    else if (tiles_wanted) n_tiles = att_tiles(b->seq, T, tq, hi + 3 * T + NL + n_bt);
    int64_t n_ints = 3 * T + NL + n_bt + n_tiles + n_mma;
    /* token_src after them (ensure_scratch leaves room for T more ints): only when a row uses it */
    bool use_src = false;
    for (int32_t i = 0; b->token_src && i < T && !use_src; i++) use_src = b->token_src[i] >= 0;
    const int64_t src_off = n_ints;
    if (use_src) {
        memcpy(hi + n_ints, b->token_src, sizeof(int32_t) * T);
        n_ints += T;
    }
    CU(cudaMemcpyAsync(s.ints, hi, sizeof(int32_t) * n_ints, cudaMemcpyHostToDevice, st), "forward: upload batch");
    if (hattn) CHECK(host_attn_upload(m));
    /* Per-layer events cost about 7% of a batch-1 decode step (96 record nodes in a 3.3 ms
     * graph), so graph-sized steps record them on the first step of each size and then
     * every LAYER_EVENT_PERIOD-th; the others report t_total (always measured) split by the
     * shares of the last measured step of their size. layer_events 1: every step; 0: never
     * (then t_attn / t_experts / t_dense stay 0). Eager steps always record them.
     * A step launched while one that records them is in flight records none (the events are
     * shared: it would overwrite them before that step's wait reads them). A decode-sized hybrid step (eager)
     * samples them as a graph step does, and its frame events (hybrid.cu) likewise: each record ends the next
     * kernel's early launch; layer_events 1 records both on every step. */
    const int32_t le = m->set.layer_events;
    bool layer_events = true;
    const bool hy_sample = m->hy.on && le != 1 && hybrid_direct(m, T);
    const bool sampled = le < 0 && (graph || hy_sample);
    if (le >= 0) layer_events = le != 0;
    else if (sampled) {
        stg_model::split &sp = m->splits[T];
        layer_events = sample_events(sp.have, sp.steps);
    }
    if (other.live && other.layer_events) layer_events = false;
    bool hy_events = true; /* the hybrid frame's events (per launched step: no other step shares them) */
    if (hy_sample) {
        stg_model::split &sp = m->splits[T];
        hy_events = sample_events(sp.hy_have, sp.hy_steps);
    }
    const step_shape sh{T,     NL, mb, s.ints, s.ints + T, s.ints + 2 * T, s.ints + 3 * T, s.ints + 3 * T + NL,
                        false, layer_events, fuse_qkv, s.ints + 3 * T + NL + n_bt, fuse_qkv ? 0 : n_tiles, greedy,
                        use_src ? s.ints + src_off : nullptr, att_split};
    g_att_mma_tiles = fuse_qkv ? 0 : n_mma, g_att_mma_mode = mma_mode;
    g_set = m->set;
    g_defer_combine = g_deferred = false;
    g_gemm_fast = !graph && all_runs_long(b->seq, T, m->set.gemm_fast_min);
    /* see g_gemm_fast. Hybrid steps take it too (hybrid.cu's top comment: where the handshake's kernels stand in
     * it); kv_host_attn never (its kernels follow copies and host waits) */
    g_pdl = m->cc_major >= 9 && m->set.pdl && !g_gemm_fast && !hattn;
    g_pdl_cut = false;
    g_kpart = s.kpart, g_kpart_cap = s.kpart_cap;
    g_k256q = s.kq, g_k256d = s.kd, g_k256s = s.ks, g_k256_cap = s.k_cap;
    m->mv_step = g_gemm_fast ? nullptr : mv_mask(m, T);
    m->last_picks = 0; /* s.picks is this step's from here on */
    CHECK(hybrid_step_begin(m, f.hy, T, hy_events));
    /* hybrid_overlap: the CPU share's thread runs from here until finish() (leaving early abandons the step) */
    hybrid_thread cpu_share(m);
    CHECK(cpu_share.start());
    host_attn_thread cpu_attn(m, kv); /* kv_host_attn: the CPU's attention, its thread until finish() */
    CHECK(cpu_attn.start());
    const stg_status src = graph ? run_step_graph(m, kv, sh) : run_step(m, kv, sh);
    g_pdl = g_pdl_cut = false;
    const bool mv_fed = m->mv_step != nullptr;
    m->mv_step = nullptr;
    CHECK(src);
    if (NL > 0 && b->logits)
        CU(cudaMemcpyAsync(b->logits, s.logits, sizeof(float) * (size_t)NL * m->d.n_vocab, cudaMemcpyDeviceToHost, st),
           "forward: logits");
    if (greedy)
        CU(cudaMemcpyAsync(f.h_picks, s.picks, sizeof(int32_t) * (size_t)NL, cudaMemcpyDeviceToHost, st),
           "forward: greedy picks");
    if (moe) /* always: the stats count pairs and active experts */
        CU(cudaMemcpyAsync(f.h_hist, m->hist, sizeof(int32_t) * (size_t)nL * m->d.n_expert, cudaMemcpyDeviceToHost, st),
           "forward: histogram");
    CU(cudaEventRecord(f.e1, st), "forward");
    CHECK(cpu_share.finish());
    const stg_status arc = cpu_attn.finish();
    m->ha.now = false;
    CHECK(arc);
    f.t_cpu_attn = hattn ? m->ha.t_cpu : 0.0;
    if (hattn) host_attn_account(m); /* the CPU's rate, for the next steps' share */
    if (hattn && m->ha.t_now) m->ha.t_ticket = tk, m->ha.t_now = false; /* its window read by its wait */
    f.live = true, f.ticket = tk, f.T = T, f.NL = NL, f.greedy = greedy;
    f.layer_events = layer_events, f.sampled = sampled, f.moe = moe, f.expert_hist = b->expert_hist;
    f.mv = mv_fed;
    m->next_ticket++;
    m->n_live++;
    m->last_picks = greedy ? NL : 0;
    *ticket = tk;
    return ST_OK;
}

static stg_status step_wait(stg_model *m, int64_t ticket, int32_t *out_tokens, st_step_stats *stt) {
    const int64_t oldest = m->fl[0].live && (!m->fl[1].live || m->fl[0].ticket < m->fl[1].ticket) ? m->fl[0].ticket
                           : m->fl[1].live ? m->fl[1].ticket : 0;
    if (!oldest) return fail(ST_EINVAL, "step_wait: no launched step is in flight");
    if (ticket != oldest)
        return fail(ST_EINVAL, "step_wait: ticket %lld is not the oldest step in flight (%lld): wait in launch order",
                    (long long)ticket, (long long)oldest);
    inflight &f = m->fl[ticket & 1];
    const bool later = m->fl[(ticket + 1) & 1].live; /* a step launched after this one */
    if (f.greedy && !out_tokens) return fail(ST_EINVAL, "step_wait: the step has picks but out_tokens is NULL");
    f.live = false; /* from here on the ticket is spent, whatever happens */
    m->n_live--;
    memset(stt, 0, sizeof *stt);
    CU(cudaSetDevice(m->device), "forward");
    CU(cudaEventSynchronize(f.e1), "forward");
    CU(cudaGetLastError(), "forward");
    if (f.greedy) memcpy(out_tokens, f.h_picks, sizeof(int32_t) * (size_t)f.NL);
    const int nL = m->d.n_layer;
    cudaEvent_t *ev = m->ev.data();
    int64_t pairs = 0;
    int32_t active = 0;
    if (f.moe) {
        const size_t nh = (size_t)nL * m->d.n_expert;
        for (size_t i = 0; i < nh; i++) {
            pairs += f.h_hist[i], active += f.h_hist[i] > 0;
            if (f.expert_hist) f.expert_hist[i] += f.h_hist[i];
        }
        staging_observe(m, f.T, f.h_hist);
        if (f.mv) mv_update(m, f.T, f.h_hist);
    }
    auto elapsed = [](cudaEvent_t a, cudaEvent_t b) -> double {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, a, b) != cudaSuccess) {
            cudaGetLastError();
            return 0.0;
        }
        return 1e-3 * ms;
    };
    for (int il = 0; il < nL && f.layer_events; il++) {
        stt->t_attn += elapsed(ev[3 * il], ev[3 * il + 1]);
        if (f.moe) stt->t_experts += elapsed(ev[3 * il + 1], ev[3 * il + 2]);
        else stt->t_dense += elapsed(ev[3 * il + 1], ev[3 * il + 2]);
    }
    /* the head's start event is recorded by every step: a later launch re-records it */
    stt->t_output = later ? 0.0 : elapsed(ev[3 * nL + 1], f.e1);
    stt->t_total = elapsed(f.e0, f.e1);
    if (f.sampled && stt->t_total > 0.0) {
        const auto it = m->splits.find(f.T);
        if (it != m->splits.end()) {
            stg_model::split &sp = it->second;
            if (f.layer_events) {
                sp.attn = stt->t_attn / stt->t_total, sp.experts = stt->t_experts / stt->t_total;
                sp.dense = stt->t_dense / stt->t_total, sp.have = true;
            } else if (sp.have) {
                stt->t_attn = sp.attn * stt->t_total, stt->t_experts = sp.experts * stt->t_total;
                stt->t_dense = sp.dense * stt->t_total;
            }
        }
    }
    hybrid_profile(m, f.hy, f.T, f.e0, f.e1, stt->t_total, pairs);
    m->profile.kv_host_bytes = f.kv_host_bytes, m->profile.kv_form = f.kv_form;
    if (f.kv_pick >= 0) kv_form_observe(m, f.T, f.kv_pick, stt->t_total);
    m->profile.kv_cpu_bytes = f.kv_cpu_bytes, m->profile.t_cpu_attn = f.t_cpu_attn;
    m->profile.kv_cpu_share = f.kv_cpu_share, m->profile.kv_cpu_gbs = m->ha.cpu_gbs;
    host_attn_timed(m, ticket);
    m->profile.kv_pcie_gbs = m->ha.dev_gbs[host_attn_form(m)];
    stt->n_tokens = f.T;
    stt->n_expert_tokens = pairs;
    stt->n_active_experts = active;
    return ST_OK;
}

static stg_status check_model(stg_model *m, stg_kv *kv) {
    if (kv->m != m || kv->n_layer != m->d.n_layer || kv->kv_dim != m->kv_dim)
        return fail(ST_EINVAL, "forward: KV cache was created for another model");
    return ST_OK;
}

extern "C" stg_status stg_forward(stg_model *m, stg_kv *kv, const void *vbatch, void *vstats) {
    const st_batch *b = (const st_batch *)vbatch;
    if (!m || !kv || !b) return fail(ST_EINVAL, "forward: NULL argument");
    CHECK(check_model(m, kv));
    if (m->n_live > 0)
        return fail(ST_EINVAL, "forward: %d launched step(s) in flight (stg_step_wait them first)", m->n_live);
    st_step_stats local;
    st_step_stats *stt = vstats ? (st_step_stats *)vstats : &local;
    memset(stt, 0, sizeof *stt);
    int64_t ticket = 0;
    CHECK(step_launch(m, kv, b, &ticket));
    return step_wait(m, ticket, b->out_tokens, stt);
}

extern "C" stg_status stg_step_launch(stg_model *m, stg_kv *kv, const void *vbatch, int64_t *ticket) {
    const st_batch *b = (const st_batch *)vbatch;
    if (!m || !kv || !b || !ticket) return fail(ST_EINVAL, "step_launch: NULL argument");
    *ticket = 0;
    CHECK(check_model(m, kv));
    if (b->logits)
        return fail(ST_EINVAL, "step_launch: a launched step returns greedy picks only (logits must be NULL; "
                               "use stg_forward for logits)");
    return step_launch(m, kv, b, ticket);
}

extern "C" stg_status stg_step_wait(stg_model *m, int64_t ticket, int32_t *out_tokens, void *vstats) {
    if (!m) return fail(ST_EINVAL, "step_wait: NULL model");
    st_step_stats local;
    return step_wait(m, ticket, out_tokens, vstats ? (st_step_stats *)vstats : &local);
}

extern "C" int32_t stg_step_in_flight(const stg_model *m) { return m ? m->n_live : 0; }
