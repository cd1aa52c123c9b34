/* Staging (issue 29's three-way choice, its staging half): a layer of a hybrid model whose non-resident experts
 * the CPU would take longer to compute than PCIe takes to bring them over is computed on the device from a
 * staged copy. With stg_settings.hybrid_stage, model creation page-locks the host range that holds the partial
 * layers' routed experts (cudaHostRegister, read-only: the mapped file itself, no copy), allocates a ring of two
 * device slots, each one layer's routed experts in full (gate, up, down, every expert at its own index, so the
 * layer's plain grouping indexes them), and measures the PCIe rate (host to slot) and the device's copy rate.
 * The caller measures the CPU engine's rate (stg_model_set_stage_rate: routed pairs per second at its prefill
 * chunk). Per step of T tokens and partial layer l (staging_decide):
 *     cpu_s   = T x k x (experts not resident / n_expert) / cpu_pairs_s   (expected pairs on the CPU)
 *     stage_s = max(non-resident bytes / pcie rate, the layer's expert bytes / device rate)
 * and the layer is staged when stage_s < cpu_s, in steps of at least hybrid_stage tokens only (the setting is that
 * floor; 64 keeps every decode step of up to 64 sequences off the ring whatever the measured rates say: a rate
 * measured low on a busy machine must not put milliseconds of copies where microseconds of CPU work belong; at
 * PCIe 55 GB/s and ~140k CPU pairs/s, the H200 machine's rates, the formula's own crossover on the Qwen3-30B-A3B
 * shape is near 120 tokens). A staged layer skips the CPU share: on the copy stream, after
 * the slot's previous layer released it, its non-resident experts come from the registered host range and its
 * resident ones from the arena (device to device), then an event; the compute stream waits on that event, runs
 * the routed experts over the router's own grouping (every expert) with the slot as the weights, and releases
 * the slot. The copy of layer l+1 thus runs while layer l computes. Steps are queued whole (hybrid_overlap) or
 * layer by layer; both see the same decision. Rows of staged layers are the device's (within the GPU engine's
 * tolerances of the CPU's), so the decision can change a result.
 *
 * Partial staging (stg_settings.hybrid_stage_split): the copy of layer l+1 starts before its routing is known,
 * so a staged layer's split comes from a routing estimate (staging_shares): each expert's share of the layer's
 * pairs, shrunk from the observed shares (the waited steps' histograms, decayed) toward a prior (uniform, or
 * stg_model_set_stage_freq's placement frequencies) by how far the observations stray from the prior beyond
 * their counting noise (a James-Stein factor from the layer's chi-square): a few decode steps' histograms under
 * uniform routing stay uniform, a skewed router shows within a step or two. Expected pairs of non-resident
 * expert e = T x k x its share; the CPU's time for a set of experts = split_scale x (its expected pairs x
 * split_pair_s + its experts' chances of being touched x split_expert_s) (the CPU engine's two costs, measured at
 * start-up: stg_model_set_split_costs; split_scale the running ratio of the split layers' measured CPU seconds to
 * that model's, starting at the CPU's measured slowdown beside a copy load, since the DMA engine's reads of host
 * memory slow the CPU's reads of the same memory: stg_model_stage_load queues host -> slot copies of the partial
 * layers' experts on the copy stream while the caller times the CPU engine, stg_model_stage_load_wait waits them;
 * the whole-layer rule keeps the quiet rate); the coldest
 * go to the CPU while that stays under the copies of the rest (staging_split), the layer split where that beats
 * both the whole layer staged and the CPU alone. A split layer has a CPU share (hybrid.cu's handshake): its pairs
 * grouped by the step's map (d_map: the slot's experts, staged and resident, at their own index; the CPU's -1),
 * the host computing the pairs the step really routes to the CPU's experts; the copy stream brings only the
 * staged experts (and the resident ones from the arena), the compute stream waiting between w0 and w1. Each
 * pair's row comes from the same kernels as in any other assignment and the combine adds by pair index, so the
 * split moves results only within the GPU-vs-CPU tolerance. */
#include "model.cuh"

/* hybrid_stage_split's routing estimate: the half-life (tokens) of the steps' histograms
 * (engine.Engine.REPLACE_HALF_LIFE_TOKENS, the re-placement statistics'); split_scale's bounds */
#define STAGE_HALF_LIFE_TOKENS 4096.0
#define SPLIT_SCALE_MIN 0.25
#define SPLIT_SCALE_MAX 8.0
/* stg_model_stage_load's bounds: its duration (ms) and the copies it queues */
#define STAGE_LOAD_MAX_MS 2000.0
#define STAGE_LOAD_MAX_COPIES 65536

static int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

/* A layer's routed tensors in a slot: gate at 0, then up, then down, each 256-aligned (bytes of the three). */
static int64_t slot_layout(const stg_model *m, const dlayer &L, int64_t off[3]) {
    const dtensor *t[3] = {&L.gate_exps, &L.up_exps, &L.down_exps};
    int64_t o = 0;
    for (int i = 0; i < 3; i++) {
        off[i] = o;
        o += align256((int64_t)m->d.n_expert * t[i]->expert_stride);
    }
    return o;
}

/* Seconds of one timed copy on the copy stream (best of two). */
static stg_status timed_copy(stg_model *m, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                             double *seconds) {
    staging &g = m->hy.stg;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    CU(cudaEventCreate(&e0), "staging: events");
    if (cudaEventCreate(&e1) != cudaSuccess) {
        cudaEventDestroy(e0);
        return cuda_fail(cudaGetLastError(), "staging: events");
    }
    double best = 0.0;
    cudaError_t e = cudaSuccess;
    for (int rep = 0; rep < 2 && e == cudaSuccess; rep++) {
        float ms = 0.0f;
        e = cudaEventRecord(e0, g.copy);
        if (e == cudaSuccess) e = cudaMemcpyAsync(dst, src, bytes, kind, g.copy);
        if (e == cudaSuccess) e = cudaEventRecord(e1, g.copy);
        if (e == cudaSuccess) e = cudaEventSynchronize(e1);
        if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
        if (e == cudaSuccess && ms > 0.0f && (best == 0.0 || 1e-3 * ms < best)) best = 1e-3 * ms;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    if (e != cudaSuccess) return cuda_fail(e, "staging: a timed copy");
    *seconds = best;
    return ST_OK;
}

static stg_status staging_setup(stg_model *m, const st_layer *layers) {
    hybrid &h = m->hy;
    staging &g = h.stg;
    if (!h.on || !m->set.hybrid_stage) return ST_OK;
    const int nL = m->d.n_layer;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    int first = -1;
    for (int il = 0; il < nL; il++) {
        if (!partial_layer(m, il)) continue;
        const st_tensor *t[3] = {&layers[il].gate_exps, &layers[il].up_exps, &layers[il].down_exps};
        for (int i = 0; i < 3; i++) {
            lo = std::min(lo, (uintptr_t)t[i]->data);
            hi = std::max(hi, (uintptr_t)t[i]->data + (uintptr_t)t[i]->n_bytes);
        }
        int64_t off[3];
        g.slot_bytes = std::max(g.slot_bytes, slot_layout(m, m->L[(size_t)il], off));
        if (first < 0) first = il;
    }
    if (first < 0) return ST_OK;
    /* the mapped file's pages are page-locked where they are: read-only, so the file's own mapping serves */
    const uintptr_t page = 4096;
    lo = lo / page * page, hi = (hi + page - 1) / page * page;
    if (cudaHostRegister((void *)lo, (size_t)(hi - lo), cudaHostRegisterPortable | cudaHostRegisterReadOnly) !=
        cudaSuccess) {
        cudaGetLastError(); /* not on this platform or not allowed: staging stays off (the profile's rates are 0) */
        return ST_OK;
    }
    g.reg = (void *)lo;
    for (int i = 0; i < 2; i++) CHECK(dalloc(m, &g.slot[i], (size_t)g.slot_bytes));
    CU(cudaStreamCreateWithFlags(&g.copy, cudaStreamNonBlocking), "staging: stream");
    for (int i = 0; i < 2; i++) {
        CU(cudaEventCreateWithFlags(&g.staged[i], cudaEventDisableTiming), "staging: events");
        CU(cudaEventCreateWithFlags(&g.freed[i], cudaEventDisableTiming), "staging: events");
    }
    /* the rates: one partial layer's gate experts host -> slot 0, then slot 0 -> slot 1 */
    const dtensor &gt = m->L[(size_t)first].gate_exps;
    const size_t bytes = (size_t)m->d.n_expert * (size_t)gt.expert_stride;
    double t_h2d = 0.0, t_d2d = 0.0;
    CHECK(timed_copy(m, g.slot[0], h.host[(size_t)first * 3], bytes, cudaMemcpyHostToDevice, &t_h2d));
    CHECK(timed_copy(m, g.slot[1], g.slot[0], bytes, cudaMemcpyDeviceToDevice, &t_d2d));
    if (t_h2d <= 0.0 || t_d2d <= 0.0) return ST_OK;
    g.pcie_gbs = (double)bytes / t_h2d * 1e-9;
    g.gpu_gbs = 2.0 * (double)bytes / t_d2d * 1e-9; /* a device copy reads and writes each byte */
    /* hybrid_stage_split: the step's map on the device, the routing estimate's prior uniform, nothing observed */
    const size_t n = (size_t)nL * (size_t)m->d.n_expert;
    CHECK(dalloc(m, &g.d_map, n * sizeof(int32_t)));
    g.prior.assign(n, 1.0 / m->d.n_expert);
    g.obs.assign(n, 0.0);
    g.obs_w1 = g.obs_w2 = 0.0;
    g.on = true;
    return ST_OK;
}

static void staging_destroy(stg_model *m) {
    staging &g = m->hy.stg;
    if (g.copy) cudaStreamSynchronize(g.copy);
    for (int i = 0; i < 2; i++) {
        if (g.staged[i]) cudaEventDestroy(g.staged[i]);
        if (g.freed[i]) cudaEventDestroy(g.freed[i]);
    }
    if (g.load0) cudaEventDestroy(g.load0);
    if (g.load1) cudaEventDestroy(g.load1);
    if (g.copy) cudaStreamDestroy(g.copy);
    if (g.reg) cudaHostUnregister(g.reg);
    g = staging{};
}

extern "C" stg_status stg_model_set_stage_rate(stg_model *m, double cpu_pairs_per_s) {
    if (!m) return fail(ST_EINVAL, "set_stage_rate: NULL model");
    if (!(cpu_pairs_per_s >= 0.0) || cpu_pairs_per_s > 1e12)
        return fail(ST_EINVAL, "set_stage_rate: %g pairs per second", cpu_pairs_per_s);
    if (m->n_live > 0) return fail(ST_EINVAL, "set_stage_rate: %d launched step(s) in flight", m->n_live);
    m->hy.stg.cpu_pairs_s = cpu_pairs_per_s;
    return ST_OK;
}

extern "C" stg_status stg_model_set_split_costs(stg_model *m, double pair_s, double expert_s, double scale) {
    if (!m) return fail(ST_EINVAL, "set_split_costs: NULL model");
    if (!(pair_s > 0.0) || pair_s > 1.0 || !(expert_s >= 0.0) || expert_s > 1.0)
        return fail(ST_EINVAL, "set_split_costs: %g s a pair, %g s an expert", pair_s, expert_s);
    if (!(scale >= SPLIT_SCALE_MIN) || scale > SPLIT_SCALE_MAX)
        return fail(ST_EINVAL, "set_split_costs: scale %g outside [%g, %g]", scale, SPLIT_SCALE_MIN, SPLIT_SCALE_MAX);
    if (m->n_live > 0) return fail(ST_EINVAL, "set_split_costs: %d launched step(s) in flight", m->n_live);
    staging &g = m->hy.stg;
    g.split_pair_s = pair_s, g.split_expert_s = expert_s, g.split_scale = scale;
    return ST_OK;
}

extern "C" stg_status stg_model_stage_info(const stg_model *m, int32_t *available, double *pcie_gbs,
                                           double *gpu_gbs, double *cpu_pairs_s, double *split_scale) {
    if (!m || !available || !pcie_gbs || !gpu_gbs || !cpu_pairs_s || !split_scale)
        return fail(ST_EINVAL, "stage_info: NULL argument");
    const staging &g = m->hy.stg;
    *available = g.on ? 1 : 0, *pcie_gbs = g.pcie_gbs, *gpu_gbs = g.gpu_gbs, *cpu_pairs_s = g.cpu_pairs_s;
    *split_scale = g.split_scale;
    return ST_OK;
}

/* A copy load on the copy stream (the caller times the CPU engine beside it: the split's CPU rate while the copies
 * read host memory): the partial layers' routed tensors from the registered host range into the ring's slots,
 * whole tensors, layer after layer, the slots alternating, as many as last about ms milliseconds at the measured
 * PCIe rate (at most STAGE_LOAD_MAX_COPIES copies; *bytes the bytes queued). The copies first wait on both slots'
 * freed events (any step's last use of the slot); a step queued later copies behind them on the same stream and
 * its compute waits on its own staged events, so no step reads what the load writes. Returns once queued. */
extern "C" stg_status stg_model_stage_load(stg_model *m, double ms, int64_t *bytes) {
    if (!m || !bytes) return fail(ST_EINVAL, "stage_load: NULL argument");
    hybrid &h = m->hy;
    staging &g = h.stg;
    if (!g.on || !(g.pcie_gbs > 0.0)) return fail(ST_EINVAL, "stage_load: staging is not available on this model");
    if (!(ms > 0.0) || ms > STAGE_LOAD_MAX_MS)
        return fail(ST_EINVAL, "stage_load: %g ms (0 < ms <= %g)", ms, STAGE_LOAD_MAX_MS);
    if (m->n_live > 0) return fail(ST_EINVAL, "stage_load: %d launched step(s) in flight", m->n_live);
    if (g.loading) return fail(ST_EINVAL, "stage_load: a load is running (stg_model_stage_load_wait first)");
    if (!g.load0) CU(cudaEventCreate(&g.load0), "stage_load: events");
    if (!g.load1) CU(cudaEventCreate(&g.load1), "stage_load: events");
    for (int i = 0; i < 2; i++) CU(cudaStreamWaitEvent(g.copy, g.freed[i], 0), "stage_load: slot");
    CU(cudaEventRecord(g.load0, g.copy), "stage_load: event");
    g.loading = true; /* from here stg_model_stage_load_wait waits for what is queued, also after an error */
    const double want = ms * 1e-3 * g.pcie_gbs * 1e9;
    const int nL = m->d.n_layer;
    int64_t done = 0;
    int copies = 0, j = 0;
    stg_status rc = ST_OK;
    while (rc == ST_OK && (double)done < want && copies < STAGE_LOAD_MAX_COPIES) {
        for (int il = 0; il < nL && rc == ST_OK && (double)done < want && copies < STAGE_LOAD_MAX_COPIES; il++) {
            if (!partial_layer(m, il)) continue;
            const dlayer &L = m->L[(size_t)il];
            const dtensor *t[3] = {&L.gate_exps, &L.up_exps, &L.down_exps};
            int64_t off[3];
            slot_layout(m, L, off);
            for (int i = 0; i < 3 && (double)done < want && copies < STAGE_LOAD_MAX_COPIES; i++) {
                const size_t n = (size_t)m->d.n_expert * (size_t)t[i]->expert_stride;
                const cudaError_t e = cudaMemcpyAsync(g.slot[j] + off[i], h.host[(size_t)il * 3 + i], n,
                                                      cudaMemcpyHostToDevice, g.copy);
                if (e != cudaSuccess) {
                    rc = cuda_fail(e, "stage_load: a copy");
                    break;
                }
                done += (int64_t)n, copies++;
            }
            j ^= 1;
        }
        if (copies == 0) break; /* no partial layer (staging would be off): nothing to copy */
    }
    const cudaError_t e = cudaEventRecord(g.load1, g.copy);
    if (rc == ST_OK && e != cudaSuccess) rc = cuda_fail(e, "stage_load: event");
    *bytes = done;
    return rc;
}

/* The end of stg_model_stage_load's copies (the host waits for the copy stream); *seconds their time on it. */
extern "C" stg_status stg_model_stage_load_wait(stg_model *m, double *seconds) {
    if (!m || !seconds) return fail(ST_EINVAL, "stage_load_wait: NULL argument");
    staging &g = m->hy.stg;
    if (!g.loading) return fail(ST_EINVAL, "stage_load_wait: no load queued (stg_model_stage_load)");
    g.loading = false;
    CU(cudaStreamSynchronize(g.copy), "stage_load_wait: the copies");
    float ms = 0.0f;
    CU(cudaEventElapsedTime(&ms, g.load0, g.load1), "stage_load_wait: event");
    *seconds = 1e-3 * ms;
    return ST_OK;
}

extern "C" stg_status stg_model_set_stage_freq(stg_model *m, const float *freq, int64_t n) {
    if (!m || !freq) return fail(ST_EINVAL, "set_stage_freq: NULL argument");
    const int nL = m->d.n_layer, ne = m->d.n_expert;
    if (n != (int64_t)nL * ne) return fail(ST_EINVAL, "set_stage_freq: %lld values, the model has %d x %d", (long long)n, nL, ne);
    if (m->n_live > 0) return fail(ST_EINVAL, "set_stage_freq: %d launched step(s) in flight", m->n_live);
    for (int64_t i = 0; i < n; i++)
        if (!(freq[i] >= 0.0f) || !std::isfinite(freq[i]))
            return fail(ST_EINVAL, "set_stage_freq: frequency %g at %lld", (double)freq[i], (long long)i);
    staging &g = m->hy.stg;
    if (!g.on) return ST_OK; /* nothing stages: no estimate to keep */
    for (int il = 0; il < nL; il++) {
        const float *f = freq + (size_t)il * ne;
        double sum = 0.0;
        for (int e = 0; e < ne; e++) sum += f[e];
        for (int e = 0; e < ne; e++) g.prior[(size_t)il * ne + e] = sum > 0.0 ? f[e] / sum : 1.0 / ne;
    }
    std::fill(g.obs.begin(), g.obs.end(), 0.0); /* the new prior stands until steps are observed */
    g.obs_w1 = g.obs_w2 = 0.0;
    return ST_OK;
}

/* A waited step's histogram [n_layer * n_expert] (pairs per expert, T tokens) into the routing estimate: the
 * counts and both token weights decay by the half-life, the step's T tokens weigh 1 each. Only steps that may
 * stage (T >= hybrid_stage) count: a decode step's tokens are each sequence's next one, whose routing follows
 * the sequence's last (greedy decoding can repeat a token outright), so a few of them are not the independent
 * draws the estimate's noise model assumes and read as skew that a prompt's tokens do not have. */
static void staging_observe(stg_model *m, int32_t T, const int32_t *hist) {
    staging &g = m->hy.stg;
    if (!g.on || g.obs.empty() || T <= 0 || T < m->set.hybrid_stage) return;
    const double decay = std::pow(0.5, (double)T / STAGE_HALF_LIFE_TOKENS);
    for (size_t i = 0; i < g.obs.size(); i++) g.obs[i] = g.obs[i] * decay + (double)hist[i];
    g.obs_w1 = g.obs_w1 * decay + T, g.obs_w2 = g.obs_w2 * decay * decay + T;
}

/* Layer il's estimated routing shares share[ne] (summing to 1): prior + (1 - B) (observed - prior). With N the
 * layer's observed (decayed) pairs, an expert's count has mean N prior_e and, counted as Poisson per token, variance
 * N prior_e r, r = obs_w2 / obs_w1 (1 without decay). D = sum_e (obs_e - N prior_e)^2 / (N prior_e r) over the
 * experts the prior expects is a chi-square of df = those experts - 1 when the routing follows the prior, and
 * B = min(1, df / D) (James-Stein) keeps the prior where the observations are within their noise and follows them
 * where they are not. Nothing observed: the prior. */
static void staging_shares(const staging &g, int il, int ne, double *share) {
    const double *pr = g.prior.data() + (size_t)il * ne, *ob = g.obs.data() + (size_t)il * ne;
    double N = 0.0;
    for (int e = 0; e < ne; e++) N += ob[e];
    if (!(N > 0.0) || !(g.obs_w1 > 0.0)) {
        std::copy(pr, pr + ne, share);
        return;
    }
    const double r = g.obs_w2 / g.obs_w1;
    double D = 0.0;
    int df = -1;
    for (int e = 0; e < ne; e++) {
        if (!(pr[e] > 0.0)) continue;
        const double mu = N * pr[e], d = ob[e] - mu;
        D += d * d / (mu * r), df++;
    }
    const double B = D > 0.0 && df > 0 ? std::min(1.0, (double)df / D) : 1.0;
    for (int e = 0; e < ne; e++) share[e] = pr[e] + (1.0 - B) * (ob[e] / N - pr[e]);
}

/* The split's CPU seconds for an expert expected to get `pairs` pairs of a step: its pairs, and its weights where
 * it is touched at all (Poisson: 1 - e^-pairs), by split_model_seconds, times split_scale. */
static double split_cpu_seconds(const staging &g, double pairs) {
    return g.split_scale * split_model_seconds(g, pairs, 1.0 - std::exp(-pairs));
}

/* hybrid_stage_split for partial layer il of a step of T tokens: the CPU's experts (cpu[e] = 1, *n_cpu of the
 * layer's n_off non-resident ones), the layer's expected seconds that way (max of the CPU's, the copies', the
 * device's copies of the resident experts) and *cpu_all_s, the CPU's expected seconds for every non-resident
 * expert. Expected pairs of a non-resident expert: T x k x its estimated share; the coldest (ties: lower id) go to
 * the CPU while its expected time stays under the copy time of the experts left to stage (so all of them only
 * where the estimate expects none of their pairs). */
static double staging_split(const stg_model *m, int il, int32_t T, int64_t per_expert, uint8_t *cpu, int *n_cpu_out,
                            double *cpu_all_s) {
    const staging &g = m->hy.stg;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    const uint8_t *res = m->hy.resident.data() + (size_t)il * ne;
    std::vector<double> share((size_t)ne);
    staging_shares(g, il, ne, share.data());
    std::vector<std::pair<double, int>> off;
    for (int e = 0; e < ne; e++)
        if (!res[e]) off.push_back({(double)T * k * share[(size_t)e], e});
    std::sort(off.begin(), off.end());
    const int n_off = (int)off.size();
    const double pcie = g.pcie_gbs * 1e9;
    double cpu_s = 0.0;
    int n_cpu = 0;
    while (n_cpu < n_off) {
        const double more = cpu_s + split_cpu_seconds(g, off[(size_t)n_cpu].first);
        if (more > (double)(n_off - n_cpu - 1) * per_expert / pcie) break;
        cpu_s = more, n_cpu++;
    }
    double all = cpu_s;
    for (int i = n_cpu; i < n_off; i++) all += split_cpu_seconds(g, off[(size_t)i].first);
    *n_cpu_out = n_cpu, *cpu_all_s = all;
    for (int i = 0; i < n_cpu; i++) cpu[off[(size_t)i].second] = 1;
    const double copy_s = (double)(n_off - n_cpu) * per_expert / pcie;
    const double gpu_s = (double)(ne - n_off) * per_expert / (g.gpu_gbs * 1e9); /* the resident experts' copies */
    return std::max(std::max(cpu_s, copy_s), gpu_s);
}

/* Which partial layers this step of T tokens stages, and with hybrid_stage_split which of their experts stay on
 * the CPU (before the layers are queued and the CPU thread starts): the split layers' device mask and map, the
 * map uploaded on the compute stream (stream order keeps it from a step still running). */
static stg_status staging_decide(stg_model *m, hybrid_step &hs, int32_t T) {
    staging &g = m->hy.stg;
    const int nL = m->d.n_layer, ne = m->d.n_expert, k = m->d.n_expert_used;
    g.now.assign((size_t)nL, 0);
    g.split.assign((size_t)nL, 0);
    hs.split_layers = hs.split_gpu_experts = hs.split_cpu_experts = hs.split_cpu_pairs = 0;
    hs.split_cpu_s = hs.split_model_s = 0.0;
    hs.split.assign((size_t)nL, 0);
    if (!g.on || !m->set.hybrid_stage || g.cpu_pairs_s <= 0.0) return ST_OK; /* set_settings may turn it off */
    if (T < m->set.hybrid_stage) return ST_OK; /* the setting is the fewest tokens of a step that may stage */
    const bool split = m->set.hybrid_stage_split != 0;
    if (split) g.dev.assign((size_t)nL * ne, 0), g.map.assign((size_t)nL * ne, -1);
    std::vector<uint8_t> cpu((size_t)ne);
    for (int il = 0; il < nL; il++) {
        if (!partial_layer(m, il)) continue;
        const dlayer &L = m->L[(size_t)il];
        const int64_t per_expert = L.gate_exps.expert_stride + L.up_exps.expert_stride + L.down_exps.expert_stride;
        const int off = ne - m->hy.n_slots[(size_t)il];
        const double cpu_s = (double)T * k * off / ne / g.cpu_pairs_s;
        const double copy_s = (double)off * per_expert / (g.pcie_gbs * 1e9);
        const double gpu_s = (double)ne * per_expert / (g.gpu_gbs * 1e9);
        g.now[(size_t)il] = std::max(copy_s, gpu_s) < cpu_s;
        if (!split) continue;
        std::fill(cpu.begin(), cpu.end(), 0);
        int n_cpu = 0;
        double cpu_all = 0.0;
        const double split_s = staging_split(m, il, T, per_expert, cpu.data(), &n_cpu, &cpu_all);
        if (n_cpu == 0) continue; /* the CPU takes nothing: the whole-layer rule */
        if (n_cpu == off) { /* none of the layer's pairs expected off the device: no copies */
            g.now[(size_t)il] = 0;
            continue;
        }
        /* against the whole layer on the CPU (the same model) and, where the whole-layer rule stages, staged */
        if (!(split_s < std::min(cpu_all, g.now[(size_t)il] ? std::max(copy_s, gpu_s) : cpu_all))) continue;
        const uint8_t *res = m->hy.resident.data() + (size_t)il * ne;
        g.now[(size_t)il] = 1, g.split[(size_t)il] = 1;
        uint8_t *dev = g.dev.data() + (size_t)il * ne;
        int32_t *map = g.map.data() + (size_t)il * ne;
        for (int e = 0; e < ne; e++) {
            dev[e] = !cpu[(size_t)e];
            map[e] = dev[e] ? e : -1;
            hs.split_gpu_experts += dev[e] && !res[e];
            hs.split_cpu_experts += cpu[(size_t)e];
        }
        hs.split_layers++;
    }
    if (hs.split_layers > 0)
        CU(cudaMemcpyAsync(g.d_map, g.map.data(), sizeof(int32_t) * g.map.size(), cudaMemcpyHostToDevice, m->stream),
           "staging: the step's expert map");
    return ST_OK;
}

static bool staged_layer(const stg_model *m, int il) {
    const staging &g = m->hy.stg;
    return g.on && (size_t)il < g.now.size() && g.now[(size_t)il];
}

static bool split_layer(const stg_model *m, int il) {
    const staging &g = m->hy.stg;
    return staged_layer(m, il) && (size_t)il < g.split.size() && g.split[(size_t)il];
}

static bool staging_whole(const stg_model *m, int il) { return staged_layer(m, il) && !split_layer(m, il); }

static const int32_t *staging_map(const stg_model *m, int il) {
    return m->hy.stg.d_map + (size_t)il * m->d.n_expert;
}

static const uint8_t *staging_device_mask(const stg_model *m, int il) {
    const size_t row = (size_t)il * m->d.n_expert;
    return split_layer(m, il) ? m->hy.stg.dev.data() + row : m->hy.resident.data() + row;
}

/* Copies of one tensor of a staged layer into its slot on the copy stream, in runs of one kind (cls: 0 the CPU's,
 * not copied; 1 over PCIe from the registered host range; 2 resident, device to device from consecutive arena
 * slots), each expert at its own index; the bytes over PCIe added to *h2d. With batch (a split layer: its staged
 * experts are scattered ids) and CUDA 13, the runs go in one cudaMemcpyBatchAsync instead of a call each. */
static stg_status staging_copy(stg_model *m, int il, const dtensor &src, const uint8_t *host, uint8_t *dst,
                               const uint8_t *cls, bool batch, int64_t *h2d) {
    staging &g = m->hy.stg;
    const int ne = m->d.n_expert;
    const int64_t stride = src.expert_stride;
    const int32_t *slot = m->hy.slot_of.data() + (size_t)il * ne;
    std::vector<void *> dsts;
    std::vector<const void *> srcs;
    std::vector<size_t> sizes;
    std::vector<cudaMemcpyKind> kinds;
    for (int e = 0; e < ne;) { /* runs of one kind; resident ones only where their arena slots are consecutive */
        int r = e + 1;
        while (r < ne && cls[r] == cls[e] && (cls[e] != 2 || slot[r] == slot[e] + (r - e))) r++;
        const size_t bytes = (size_t)(r - e) * (size_t)stride;
        if (cls[e]) {
            dsts.push_back(dst + e * stride);
            srcs.push_back(cls[e] == 2 ? (const void *)(src.d + (int64_t)slot[e] * stride)
                                       : (const void *)(host + e * stride));
            sizes.push_back(bytes);
            kinds.push_back(cls[e] == 2 ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice);
            if (cls[e] == 1) *h2d += (int64_t)bytes;
        }
        e = r;
    }
    if (dsts.empty()) return ST_OK;
#if CUDART_VERSION >= 13000
    if (batch && dsts.size() > 1) {
        cudaMemcpyAttributes attr = {};
        attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        size_t at = 0;
        if (cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attr, &at, 1, g.copy) ==
            cudaSuccess)
            return ST_OK;
        cudaGetLastError(); /* refused (a platform without it): the runs one by one */
    }
#endif
    for (size_t i = 0; i < dsts.size(); i++)
        CU(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], kinds[i], g.copy), "staging: experts");
    return ST_OK;
}

/* A staged layer, before its routed experts: the copies into the ring's next slot (after its last user is done)
 * on the copy stream, the compute stream waiting for them, and *Ls, the layer with the slot as its routed weights
 * (every expert at its index). A whole layer's wait sits between the step's s0 and s1 of the layer (it has no CPU
 * share); a split layer's (hybrid_stage_split: the CPU's experts not copied) between w0 and w1, its s0 / s1 being
 * the CPU share's. */
static stg_status staging_queue(stg_model *m, int il, dlayer *Ls) {
    hybrid &h = m->hy;
    staging &g = h.stg;
    if (!h.cur) return fail(ST_EINVAL, "staging: layer %d queued outside a step", il);
    hybrid_step &hs = *h.cur;
    const int ne = m->d.n_expert;
    const bool split = split_layer(m, il);
    const int j = g.next;
    g.next ^= 1;
    const dlayer &L = m->L[(size_t)il];
    *Ls = L;
    int64_t off[3];
    slot_layout(m, L, off);
    const uint8_t *res = h.resident.data() + (size_t)il * ne;
    const uint8_t *dev = staging_device_mask(m, il);
    std::vector<uint8_t> cls((size_t)ne);
    for (int e = 0; e < ne; e++) cls[(size_t)e] = res[e] ? 2 : dev[e] || !split ? 1 : 0;
    CU(cudaStreamWaitEvent(g.copy, g.freed[j], 0), "staging: slot");
    dtensor *out[3] = {&Ls->gate_exps, &Ls->up_exps, &Ls->down_exps};
    const dtensor *src[3] = {&L.gate_exps, &L.up_exps, &L.down_exps};
    for (int i = 0; i < 3; i++) {
        uint8_t *dst = g.slot[j] + off[i];
        CHECK(staging_copy(m, il, *src[i], h.host[(size_t)il * 3 + i], dst, cls.data(), split, &hs.staged_bytes));
        out[i]->d = dst;
        out[i]->ne[2] = ne;
    }
    CU(cudaEventRecord(g.staged[j], g.copy), "staging: event");
    if (split) {
        const size_t nL = (size_t)m->d.n_layer;
        for (std::vector<cudaEvent_t> *v : {&hs.w0, &hs.w1})
            while (v->size() < nL) {
                cudaEvent_t e = nullptr;
                CU(cudaEventCreate(&e), "staging: events");
                v->push_back(e);
            }
        CU(cudaEventRecord(hs.w0[(size_t)il], m->stream), "staging: event");
        CU(cudaStreamWaitEvent(m->stream, g.staged[j], 0), "staging: wait");
        pdl_cut(m->stream); /* the routed experts' first kernel follows the wait */
        CU(cudaEventRecord(hs.w1[(size_t)il], m->stream), "staging: event");
        hs.split[(size_t)il] = 1;
    } else {
        CU(cudaEventRecord(hs.s0[(size_t)il], m->stream), "staging: event");
        CU(cudaStreamWaitEvent(m->stream, g.staged[j], 0), "staging: wait");
        pdl_cut(m->stream); /* the routed experts' first kernel follows the wait */
        CU(cudaEventRecord(hs.s1[(size_t)il], m->stream), "staging: event");
        hs.used[(size_t)il] = 2;
    }
    hs.staged_layers++;
    return ST_OK;
}

/* A waited step's split layers in its frame profile (after hybrid_profile): each one's wait for its copies
 * (w0..w1, inside the CPU share's s1..a, which hybrid_profile counted as compute) moves to t_pcie, and the
 * split's figures; split_scale follows the ratio of the CPU's measured seconds in them to the model's (a
 * geometric running mean, bounded): the CPU's rate beside the copies' traffic, not the start-up measurement's. */
static void staging_profile(stg_model *m, hybrid_step &hs) {
    staging &g = m->hy.stg;
    if (hs.split_cpu_pairs > 0 && hs.split_model_s > 0.0 && hs.split_cpu_s > 0.0)
        g.split_scale = std::min(SPLIT_SCALE_MAX, std::max(SPLIT_SCALE_MIN,
                                                           std::sqrt(g.split_scale * hs.split_cpu_s / hs.split_model_s)));
    stg_profile &p = m->profile;
    p.stage_split_layers = hs.split_layers, p.stage_gpu_experts = hs.split_gpu_experts;
    p.stage_cpu_experts = hs.split_cpu_experts, p.stage_cpu_pairs = hs.split_cpu_pairs;
    double wait = 0.0;
    for (size_t il = 0; il < hs.split.size(); il++) {
        if (!hs.split[il]) continue;
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, hs.w0[il], hs.w1[il]) != cudaSuccess) cudaGetLastError();
        else if (ms > 0.0f) wait += 1e-3 * ms;
    }
    wait = std::min(wait, p.t_gpu);
    p.t_gpu -= wait, p.t_pcie += wait;
}

/* After a staged layer's routed experts: its slot is free for the layer two staged layers on. */
static stg_status staging_release(stg_model *m) {
    staging &g = m->hy.stg;
    CU(cudaEventRecord(g.freed[g.next ^ 1], m->stream), "staging: event");
    return ST_OK;
}
