/* Hybrid placement: a model some of whose routed experts stay in host memory. The device holds a layer's
 * resident experts in slots (ascending expert id) and groups the layer's pairs by slot, leaving out the pairs
 * of other experts; those go to the CPU engine (st_moe_pairs on the lane's pool, reading the mapped file),
 * whose unweighted rows are copied into the same pair_out rows the device's own experts fill, so the
 * weighted sum that follows (combine, st_forward's order of additions) sees every pair as the all-device
 * step does. The step runs eagerly, queued by the host layer by layer: per layer with a CPU share, xn and
 * the routing are copied to pinned memory behind the router and one event marks them; the device's
 * resident experts are queued next and run while the host waits on that event (cudaEventSynchronize on it
 * alone) and then computes its pairs; their rows go back on the stream, scattered into pair_out before the
 * sum. The frame profile comes from two events per such layer: after the resident experts, and at the
 * copy of the CPU's rows (their gap is the device waiting on the CPU). */
#include <time.h>

#include "model.cuh"

/* sid[p] = the slot of pair p's expert in this layer (-1: not resident, left out of the grouping) */
__global__ void k_slot_ids(const int32_t *ids, int32_t P, const int32_t *slot_of, int32_t *sid) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < P) sid[i] = slot_of[ids[i]];
}

/* dst row idx[r] = src row r, rows of E floats (the CPU's pair rows into pair_out) */
__global__ void k_scatter_rows(const float *src, const int32_t *idx, int32_t n, int64_t E, float *dst) {
    PDL_ENTER();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)n * E) return;
    const int64_t r = i / E;
    dst[(int64_t)idx[r] * E + (i - r * E)] = src[i];
}

static double host_seconds() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The placement at model creation (before upload): the mask, the slots, the CPU engine. */
static stg_status hybrid_setup(stg_model *m, const uint8_t *resident, const stg_cpu_experts *cpu) {
    hybrid &h = m->hy;
    const int nL = m->d.n_layer, ne = m->d.n_expert;
    if (!resident || ne == 0) return ST_OK;
    const size_t n = (size_t)nL * (size_t)ne;
    std::vector<int32_t> slot(n, -1);
    std::vector<int32_t> n_slots((size_t)nL, 0);
    int64_t off = 0;
    for (int il = 0; il < nL; il++)
        for (int e = 0; e < ne; e++) {
            const uint8_t v = resident[(size_t)il * ne + e];
            if (v > 1) return fail(ST_EINVAL, "model_create: resident[%d][%d] = %d (0 or 1)", il, e, (int)v);
            if (v) slot[(size_t)il * ne + e] = n_slots[(size_t)il]++;
            else off++;
        }
    if (off == 0) return ST_OK; /* every expert resident: the plain model */
    if (!cpu || !cpu->moe_pairs || !cpu->last_error || !cpu->model || !cpu->pool)
        return fail(ST_EINVAL, "model_create: %lld routed experts are not resident and no CPU engine is given to "
                               "compute them", (long long)off);
    h.on = true;
    h.resident.assign(resident, resident + n);
    h.n_slots = n_slots;
    h.cpu = *cpu;
    CHECK(dalloc(m, &h.d_slot, n * sizeof(int32_t)));
    CU(cudaMemcpy(h.d_slot, slot.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice), "model_create: slot map");
    CU(cudaEventCreateWithFlags(&h.ready, cudaEventDisableTiming), "model_create: events");
    return ST_OK;
}

/* The CPU share's buffers for steps of up to T tokens (ensure_scratch, the stream synchronised). */
static stg_status hybrid_scratch(stg_model *m, int64_t T) {
    hybrid &h = m->hy;
    if (!h.on) return ST_OK;
    scratch &s = m->s;
    const int64_t P = T * m->d.n_expert_used, E = m->d.n_embd;
    CHECK(dalloc_in(s.step_allocs, &h.sid, sizeof(int32_t) * P));
    CHECK(dalloc_in(s.step_allocs, &h.d_idx, sizeof(int32_t) * P));
    CHECK(dalloc_in(s.step_allocs, &h.d_out, sizeof(float) * P * E));
    for (void *p : h.pinned) cudaFreeHost(p);
    h.pinned.clear();
    h.h_xn = h.h_out = nullptr, h.h_ids = h.h_idx = nullptr;
    void *xn = nullptr, *out = nullptr, *ids = nullptr, *idx = nullptr;
    CU(cudaMallocHost(&xn, sizeof(float) * T * E), "pinned hybrid buffers");
    h.pinned.push_back(xn);
    CU(cudaMallocHost(&out, sizeof(float) * P * E), "pinned hybrid buffers");
    h.pinned.push_back(out);
    CU(cudaMallocHost(&ids, sizeof(int32_t) * P), "pinned hybrid buffers");
    h.pinned.push_back(ids);
    CU(cudaMallocHost(&idx, sizeof(int32_t) * P), "pinned hybrid buffers");
    h.pinned.push_back(idx);
    h.h_xn = (float *)xn, h.h_out = (float *)out, h.h_ids = (int32_t *)ids, h.h_idx = (int32_t *)idx;
    h.pair_tok.resize((size_t)P), h.pair_exp.resize((size_t)P);
    return ST_OK;
}

/* A layer with a CPU share. */
static bool hybrid_layer(const stg_model *m, int il) { return partial_layer(m, il); }

/* The launched step's events and sums (step_launch, before the layers are queued). */
static stg_status hybrid_step_begin(stg_model *m, hybrid_step &hs) {
    m->hy.cur = nullptr;
    if (!m->hy.on) return ST_OK;
    const size_t nL = (size_t)m->d.n_layer;
    if (hs.a.size() != nL) {
        for (cudaEvent_t e : hs.a) cudaEventDestroy(e);
        for (cudaEvent_t e : hs.b) cudaEventDestroy(e);
        hs.a.clear(), hs.b.clear();
        for (size_t i = 0; i < 2 * nL; i++) {
            cudaEvent_t e = nullptr;
            CU(cudaEventCreate(&e), "hybrid: events");
            (i < nL ? hs.a : hs.b).push_back(e);
        }
    }
    hs.used.assign(nL, 0);
    hs.t_cpu = 0.0, hs.cpu_pairs = 0;
    m->hy.cur = &hs;
    return ST_OK;
}

/* After the router (topk_id and xn written): both to the host, marked by `ready`; then the resident pairs
 * grouped by slot into the grouping's arrays (gexp holds slots: the kernels index the slotted weights). */
static stg_status hybrid_send(stg_model *m, int il, int32_t T, int mv_max) {
    scratch &s = m->s;
    hybrid &h = m->hy;
    cudaStream_t st = m->stream;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    const int64_t E = m->d.n_embd, P = (int64_t)T * k;
    CU(cudaMemcpyAsync(h.h_ids, s.topk_id, sizeof(int32_t) * P, cudaMemcpyDeviceToHost, st), "hybrid: routing");
    CU(cudaMemcpyAsync(h.h_xn, s.xn, sizeof(float) * T * E, cudaMemcpyDeviceToHost, st), "hybrid: xn");
    CU(cudaEventRecord(h.ready, st), "hybrid: event");
    const int32_t n_slots = h.n_slots[(size_t)il];
    if (n_slots == 0) return ST_OK;
    launch_k(k_slot_ids, (unsigned)((P + 255) / 256), 256, 0, st, (const int32_t *)s.topk_id, (int32_t)P,
             (const int32_t *)(h.d_slot + (int64_t)il * ne), h.sid);
    LAUNCHED("hybrid: slots");
    /* the histogram is the expert grouping's (the router's launch counted every pair) */
    const group_out go = {s.gexp,   s.gstart, s.gcount, s.n_groups,  s.list,    s.pair_tok, nullptr, s.gtiles,
                          s.n_gtiles, s.mexp, s.mstart, s.mcount, s.n_mgroups, s.pair_mv, mv_max};
    launch_k(k_group, 1, 1024, 2 * (size_t)n_slots * sizeof(int32_t), st, (const int32_t *)h.sid, (int32_t)P, k,
             n_slots, go, 0);
    LAUNCHED("hybrid: group by slot");
    return ST_OK;
}

/* After the resident experts are queued: wait for xn and the routing, compute the other pairs on the CPU,
 * and queue their rows into pair_out (before the weighted sum, which the caller queues next). */
static stg_status hybrid_receive(stg_model *m, int il, int32_t T) {
    hybrid &h = m->hy;
    if (!h.cur) return fail(ST_EINVAL, "hybrid: layer %d queued outside a step", il);
    hybrid_step &hs = *h.cur;
    cudaStream_t st = m->stream;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    const int64_t E = m->d.n_embd, P = (int64_t)T * k;
    CU(cudaEventRecord(hs.a[(size_t)il], st), "hybrid: event");
    CU(cudaEventSynchronize(h.ready), "hybrid: routing to the host");
    const uint8_t *res = h.resident.data() + (size_t)il * ne;
    int32_t n = 0;
    for (int64_t p = 0; p < P; p++) {
        const int32_t e = h.h_ids[p];
        if (e < 0 || e >= ne)
            return fail(ST_ERANGE, "hybrid: layer %d routed pair %lld to expert %d of %d", il, (long long)p, e, ne);
        if (res[e]) continue;
        h.pair_tok[(size_t)n] = (int32_t)(p / k), h.pair_exp[(size_t)n] = e, h.h_idx[n] = (int32_t)p;
        n++;
    }
    hs.cpu_pairs += n;
    if (n == 0) return ST_OK;
    const double t0 = host_seconds();
    const int32_t rc = h.cpu.moe_pairs(h.cpu.model, h.cpu.pool, il, T, h.h_xn, n, h.pair_tok.data(),
                                       h.pair_exp.data(), h.h_out);
    hs.t_cpu += host_seconds() - t0;
    if (rc != ST_OK) {
        const char *msg = h.cpu.last_error();
        return fail(rc, "layer %d: the CPU engine's experts: %s", il, msg ? msg : "(no message)");
    }
    CU(cudaEventRecord(hs.b[(size_t)il], st), "hybrid: event");
    hs.used[(size_t)il] = 1;
    CU(cudaMemcpyAsync(h.d_idx, h.h_idx, sizeof(int32_t) * n, cudaMemcpyHostToDevice, st), "hybrid: CPU rows");
    CU(cudaMemcpyAsync(h.d_out, h.h_out, sizeof(float) * n * E, cudaMemcpyHostToDevice, st), "hybrid: CPU rows");
    launch_k(k_scatter_rows, (unsigned)((n * E + 255) / 256), 256, 0, st, (const float *)h.d_out,
             (const int32_t *)h.d_idx, n, E, m->s.pair_out);
    LAUNCHED("hybrid: CPU rows");
    return ST_OK;
}

/* The waited step's frame profile (step_wait, after its end event). */
static void hybrid_profile(stg_model *m, const hybrid_step &hs, double t_total, int64_t pairs) {
    double wait = 0.0;
    for (size_t il = 0; il < hs.used.size(); il++) {
        float ms = 0.0f;
        if (!hs.used[il]) continue;
        if (cudaEventElapsedTime(&ms, hs.a[il], hs.b[il]) != cudaSuccess) cudaGetLastError();
        else if (ms > 0.0f) wait += 1e-3 * ms;
    }
    const int64_t cpu = m->hy.on ? hs.cpu_pairs : 0;
    m->profile = stg_profile{t_total, t_total - wait, m->hy.on ? hs.t_cpu : 0.0, wait, pairs - cpu, cpu, 0};
}

extern "C" stg_status stg_step_profile(const stg_model *m, stg_profile *out) {
    if (!m || !out) return fail(ST_EINVAL, "step_profile: NULL argument");
    *out = m->profile;
    return ST_OK;
}
