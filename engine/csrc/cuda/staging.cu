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
 * hybrid_stage_skip (default 50: 0.05 expected hits): the copies leave out the non-resident experts that the
 * routing seen so far (each waited step's histogram, staging_observe) expects too seldom in a step of T tokens
 * (staging_want); the slot's mask of what came is set on the copy stream before the copies (k_set_have), and after
 * the compute stream's wait k_fill_missing reads any expert the step's grouping takes but the copies left out from
 * the page-locked file (registered mapped) into the slot. The experts then read the same bytes as after whole
 * copies: the same bits. */
#include "model.cuh"

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
    /* mapped too, so that the device can read an expert the copies left out (hybrid_stage_skip); where that is not
     * allowed, registered without it (hybrid_stage_skip then copies every expert) */
    const unsigned flags = cudaHostRegisterPortable | cudaHostRegisterReadOnly;
    bool mapped = cudaHostRegister((void *)lo, (size_t)(hi - lo), flags | cudaHostRegisterMapped) == cudaSuccess;
    if (!mapped) {
        cudaGetLastError();
        if (cudaHostRegister((void *)lo, (size_t)(hi - lo), flags) != cudaSuccess) {
            cudaGetLastError(); /* not on this platform or not allowed: staging stays off (the profile's rates are 0) */
            return ST_OK;
        }
    }
    g.reg = (void *)lo;
    void *dev = nullptr;
    if (mapped && cudaHostGetDevicePointer(&dev, (void *)lo, 0) == cudaSuccess) g.reg_dev = (const uint8_t *)dev;
    cudaGetLastError();
    const size_t nh = (size_t)nL * (size_t)m->d.n_expert;
    g.seen.assign(nh, 0.0), g.want.assign(nh, 1);
    for (int i = 0; i < 2; i++) CHECK(dalloc(m, &g.have[i], (size_t)m->d.n_expert));
    for (int i = 0; i < 2; i++) CHECK(dalloc(m, &g.slot[i], (size_t)(g.slot_bytes + STG_WEIGHT_TAIL)));
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

extern "C" stg_status stg_model_stage_info(const stg_model *m, int32_t *available, double *pcie_gbs,
                                           double *gpu_gbs, double *cpu_pairs_s) {
    if (!m || !available || !pcie_gbs || !gpu_gbs || !cpu_pairs_s) return fail(ST_EINVAL, "stage_info: NULL argument");
    const staging &g = m->hy.stg;
    *available = g.on ? 1 : 0, *pcie_gbs = g.pcie_gbs, *gpu_gbs = g.gpu_gbs, *cpu_pairs_s = g.cpu_pairs_s;
    return ST_OK;
}

/* A waited step of T tokens: its pairs per layer and expert join the routing seen so far (halved now and then, so
 * that recent steps weigh more). Counted only while hybrid_stage_skip is on: every decode step passes here. */
static void staging_observe(stg_model *m, int32_t T, const int32_t *hist) {
    staging &g = m->hy.stg;
    if (!g.on || g.seen.empty() || T < 1 || m->set.hybrid_stage_skip <= 0) return;
    if (g.seen_tokens > (double)(1 << 20)) {
        for (double &v : g.seen) v *= 0.5;
        g.seen_tokens *= 0.5;
    }
    for (size_t i = 0; i < g.seen.size(); i++) g.seen[i] += hist[i];
    g.seen_tokens += T;
}

/* hybrid_stage_skip: which experts of staged layer il the step of T tokens copies (want): the resident ones (device
 * to device, cheap), and the others where the routing seen so far expects at least skip / 1000 hits in the step.
 * Without a step's worth of tokens seen, every one. */
static void staging_want(stg_model *m, int il, int32_t T) {
    staging &g = m->hy.stg;
    const int ne = m->d.n_expert;
    const int32_t skip = m->set.hybrid_stage_skip;
    const uint8_t *res = m->hy.resident.data() + (size_t)il * ne;
    uint8_t *want = g.want.data() + (size_t)il * ne;
    const bool judge = skip > 0 && g.reg_dev && g.seen_tokens >= (double)T;
    const double *seen = g.seen.data() + (size_t)il * ne;
    for (int e = 0; e < ne; e++)
        want[e] = !judge || res[e] || 1000.0 * (double)T * seen[e] / g.seen_tokens >= (double)skip;
}

/* Which partial layers this step of T tokens stages (before the layers are queued and the CPU thread starts). */
static void staging_decide(stg_model *m, int32_t T) {
    staging &g = m->hy.stg;
    const int nL = m->d.n_layer, ne = m->d.n_expert, k = m->d.n_expert_used;
    g.now.assign((size_t)nL, 0);
    if (!g.on || !m->set.hybrid_stage || g.cpu_pairs_s <= 0.0) return; /* set_settings may turn it off */
    if (T < m->set.hybrid_stage) return; /* the setting is the fewest tokens of a step that may stage */
    for (int il = 0; il < nL; il++) {
        if (!partial_layer(m, il)) continue;
        const dlayer &L = m->L[(size_t)il];
        const int64_t per_expert = L.gate_exps.expert_stride + L.up_exps.expert_stride + L.down_exps.expert_stride;
        const int off = ne - m->hy.n_slots[(size_t)il];
        const double cpu_s = (double)T * k * off / ne / g.cpu_pairs_s;
        const double copy_s = (double)off * per_expert / (g.pcie_gbs * 1e9);
        const double gpu_s = (double)ne * per_expert / (g.gpu_gbs * 1e9);
        g.now[(size_t)il] = std::max(copy_s, gpu_s) < cpu_s;
        if (g.now[(size_t)il]) staging_want(m, il, T);
    }
}

static bool staged_layer(const stg_model *m, int il) {
    const staging &g = m->hy.stg;
    return g.on && (size_t)il < g.now.size() && g.now[(size_t)il];
}

/* Copies of one tensor of a staged layer into its slot on the copy stream, in runs of one kind (not resident: over
 * PCIe from the registered host range; resident: device to device from consecutive arena slots; left out by
 * hybrid_stage_skip: none), each expert at its own index; the bytes over PCIe added to *h2d. */
static stg_status staging_copy(stg_model *m, int il, const dtensor &src, const uint8_t *host, uint8_t *dst,
                               int64_t *h2d) {
    staging &g = m->hy.stg;
    const int ne = m->d.n_expert;
    const int64_t stride = src.expert_stride;
    const uint8_t *res = m->hy.resident.data() + (size_t)il * ne, *want = g.want.data() + (size_t)il * ne;
    const int32_t *slot = m->hy.slot_of.data() + (size_t)il * ne;
    auto kind = [&](int e) { return res[e] ? 2 : want[e] ? 1 : 0; };
    for (int e = 0; e < ne;) { /* runs of one kind; resident ones only where their arena slots are consecutive */
        const int k = kind(e);
        int r = e + 1;
        while (r < ne && kind(r) == k && (k != 2 || slot[r] == slot[e] + (r - e))) r++;
        const size_t bytes = (size_t)(r - e) * (size_t)stride;
        if (k == 2) {
            CU(cudaMemcpyAsync(dst + e * stride, src.d + (int64_t)slot[e] * stride, bytes, cudaMemcpyDeviceToDevice,
                               g.copy), "staging: experts");
        } else if (k == 1) {
            CU(cudaMemcpyAsync(dst + e * stride, host + e * stride, bytes, cudaMemcpyHostToDevice, g.copy),
               "staging: experts");
            *h2d += (int64_t)bytes;
        }
        e = r;
    }
    return ST_OK;
}

/* hybrid_stage_skip: which experts a slot's copies brought (have[e] = bit e of w), set on the copy stream before
 * them. The mask travels as the launch's argument, so the host may reuse its own copy at once. */
struct have_bits {
    uint32_t w[32]; /* n_expert <= 1024 */
};
__global__ void k_set_have(uint8_t *have, int32_t ne, have_bits b) {
    for (int e = threadIdx.x; e < ne; e += blockDim.x) have[e] = (uint8_t)((b.w[e >> 5] >> (e & 31)) & 1u);
}

/* hybrid_stage_skip: the experts of a staged layer the step's routing takes (its grouping: gexp[0 .. *n_groups))
 * that the copies left out, read into the slot from the page-locked file (src: its device address) by the whole
 * grid, 16 bytes a thread at a time where the tensors allow it. */
struct fill_args {
    const uint8_t *src[3];
    uint8_t *dst[3];
    int64_t stride[3];
    const int32_t *gexp, *n_groups;
    const uint8_t *have;
};
__global__ void k_fill_missing(fill_args a) {
    const int32_t ng = *a.n_groups;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, nth = (int64_t)gridDim.x * blockDim.x;
    for (int32_t gi = 0; gi < ng; gi++) {
        const int32_t e = a.gexp[gi];
        if (a.have[e]) continue;
        for (int i = 0; i < 3; i++) {
            const uint8_t *s = a.src[i] + (int64_t)e * a.stride[i];
            uint8_t *d = a.dst[i] + (int64_t)e * a.stride[i];
            if (((uintptr_t)s | (uintptr_t)d | (uintptr_t)a.stride[i]) % 16 == 0) {
                for (int64_t j = tid; j < a.stride[i] / 16; j += nth) ((uint4 *)d)[j] = ((const uint4 *)s)[j];
            } else {
                for (int64_t j = tid; j < a.stride[i]; j += nth) d[j] = s[j];
            }
        }
    }
}

#define FILL_BLOCKS 64 /* k_fill_missing's grid: enough loads in flight to stream from host memory */

/* A staged layer, before its routed experts: the copies into the ring's next slot (after its last user is done)
 * on the copy stream, the compute stream waiting for them between the step's s0 and s1 of the layer (it has no
 * CPU share), and *Ls, the layer with the slot as its routed weights (every expert at its index). */
static stg_status staging_queue(stg_model *m, int il, dlayer *Ls) {
    hybrid &h = m->hy;
    staging &g = h.stg;
    if (!h.cur) return fail(ST_EINVAL, "staging: layer %d queued outside a step", il);
    hybrid_step &hs = *h.cur;
    const int ne = m->d.n_expert;
    const int j = g.next;
    g.next ^= 1;
    const dlayer &L = m->L[(size_t)il];
    *Ls = L;
    int64_t off[3];
    slot_layout(m, L, off);
    CU(cudaStreamWaitEvent(g.copy, g.freed[j], 0), "staging: slot");
    /* hybrid_stage_skip left some expert out of the copies: the mask and the fill (else neither is queued) */
    have_bits b = {};
    bool skip = false;
    const uint8_t *want = g.want.data() + (size_t)il * ne;
    for (int e = 0; e < ne; e++) b.w[e >> 5] |= (uint32_t)want[e] << (e & 31), skip = skip || !want[e];
    if (skip) {
        k_set_have<<<1, 256, 0, g.copy>>>(g.have[j], ne, b);
        CU(cudaGetLastError(), "staging: mask");
    }
    dtensor *out[3] = {&Ls->gate_exps, &Ls->up_exps, &Ls->down_exps};
    const dtensor *src[3] = {&L.gate_exps, &L.up_exps, &L.down_exps};
    for (int i = 0; i < 3; i++) {
        uint8_t *dst = g.slot[j] + off[i];
        CHECK(staging_copy(m, il, *src[i], h.host[(size_t)il * 3 + i], dst, &hs.staged_bytes));
        out[i]->d = dst;
        out[i]->ne[2] = ne;
    }
    CU(cudaEventRecord(g.staged[j], g.copy), "staging: event");
    CU(cudaEventRecord(hs.s0[(size_t)il], m->stream), "staging: event");
    CU(cudaStreamWaitEvent(m->stream, g.staged[j], 0), "staging: wait");
    pdl_cut(m->stream); /* the next kernel follows the wait */
    if (skip) { /* the experts the routing takes that the copies left out (timed with the copies: s0..s1) */
        fill_args a = {};
        for (int i = 0; i < 3; i++)
            a.src[i] = g.reg_dev + (h.host[(size_t)il * 3 + i] - (const uint8_t *)g.reg), a.dst[i] = g.slot[j] + off[i],
            a.stride[i] = src[i]->expert_stride;
        a.gexp = m->s.gexp, a.n_groups = m->s.n_groups, a.have = g.have[j];
        launch_k(k_fill_missing, FILL_BLOCKS, 256, 0, m->stream, a);
        LAUNCHED("staging: experts left out");
    }
    CU(cudaEventRecord(hs.s1[(size_t)il], m->stream), "staging: event");
    hs.used[(size_t)il] = 2;
    hs.staged_layers++;
    return ST_OK;
}

/* After a staged layer's routed experts: its slot is free for the layer two staged layers on. */
static stg_status staging_release(stg_model *m) {
    staging &g = m->hy.stg;
    CU(cudaEventRecord(g.freed[g.next ^ 1], m->stream), "staging: event");
    return ST_OK;
}
