/* Hybrid placement: a model some of whose routed experts stay in host memory. The device holds a layer's
 * resident experts in slots (ascending expert id at creation; stg_model_swap_expert moves one into the slot of
 * another between steps) and groups the layer's pairs by slot, leaving out the pairs
 * of other experts; those go to the CPU engine (st_moe_pairs on the lane's pool, reading the mapped file),
 * whose unweighted rows are scattered into the same pair_out rows the device's own experts fill, so the
 * weighted sum that follows (combine, st_forward's order of additions) sees every pair as the all-device
 * step does.
 *
 * Per layer with a CPU share the stream holds (the handshake's kernels and words are host_sync.cu's, shared with
 * kv_host_attn): event s0, xn and the routing to pinned memory (a decode-sized
 * step: k_to_host's stores, then the layer's ready flag, on which the host spins; larger: copies), event s1 (the
 * host waits on ready or on it), the shared expert and the resident experts (they run while the CPU works), event a,
 * then the CPU's rows into pair_out, event c. A decode-sized step (hybrid_direct) has one kernel between a and c
 * (k_rows_direct: the pair indices worked out on the device before the wait, then the wait for the host to write
 * the step's value and its row count into the layer's pinned flag, then the layer's n rows read in place from the
 * pinned region into pair_out; no event b). A larger step has a one-thread kernel that waits for the flag, event b,
 * a copy of the pinned rows' region into device memory (the copy engine, queued on the compute stream behind the
 * wait: a large step's rows read in place from mapped host memory ran at ~1.6 GB/s on the H200 machine, a copy at
 * tens of GB/s) and the CPU's rows scattered from there into pair_out. The region has room for every pair of the
 * step (the copy is queued before the count is known); the layer's n rows and indices sit at its front. The host
 * thread that computes makes no CUDA call between the device's wait and the flag: a call there could block
 * behind the context's own synchronisation (lazy kernel loading by the queueing thread waits for the device, which
 * waits for the flag). The device never waits on anything else of the host and the host never synchronises the
 * device: it waits on the ready flag or s1 alone. Who computes
 * (stg_settings.hybrid_overlap): 1, a thread started for the step walks the layers while
 * the calling thread queues the whole step at once (the next layer's attention is already queued when a flag
 * is written); 0, the calling thread computes each layer's share between queueing its wait and its rows.
 * The same kernels read the same rows either way: the bits do not depend on the mode.
 *
 * A layer the step stages (staging.cu) has no CPU share: hybrid_layer is false for it.
 *
 * Programmatic dependent launch (stg_settings.pdl, on sm_90): the step's kernels are launched as
 * other steps' are (common.cuh), each triggering its dependents at entry and waiting (griddepcontrol.wait) before it
 * reads anything a predecessor wrote; the event records stay between them. The handshake keeps its order through
 * that. k_to_host waits before its stores and its ready flag, so the host reads a layer's xn and routing only once
 * every earlier kernel is done; and since every kernel waits before it exits, layer l+1's ready flag (after which
 * the host overwrites h_xn, h_ids and h_rows) comes after layer l's rows kernel has finished reading h_rows.
 * k_rows_direct and k_wait_flag wait before they poll the host's flag: launched early, they sit in the wait (not
 * polling) until the layer's device work is done, and block 0's clock starts after it. The kernels behind them are
 * scheduled only once every block of theirs is resident (a dependent launches when each block of its predecessor
 * has triggered or exited), so nothing launched early holds an SM that the polling kernel or anything before it
 * still needs, and the flag's producer is the host, which needs no SM. A kernel that follows a copy (a larger
 * step's xn and routing to the host, its CPU rows back) or an event wait (a staged layer's copies) is launched
 * without the attribute (pdl_cut). Scheduling only: the same kernels read the same rows either way.
 *
 * The frame profile comes from those events: the device's time splits into the copies (s0..s1, b..c: the rows'
 * copy and scatter), the wait (a..b) and the rest (compute), each summed from its own intervals; a k_rows_direct
 * layer's a..c splits at block 0's own clock (its start to its seeing the flag: the wait; the rest: the rows).
 * Each record ends the next kernel's early launch, so a decode-sized step records s0, a and c
 * (s1 always: the host's wait checks it) only when sampled; the others' wait comes from the same clock alone. */
#include "model.cuh"

/* hybrid_direct's bound: a step's xn of at most this many floats (256 KB; 32 tokens of a 2,048-wide model) goes
 * to the host by k_to_host's stores, a larger one by the copy engine */
#define HY_DIRECT_FLOATS 65536

/* sid[p] = the slot of pair p's expert in this layer (-1: not resident, left out of the grouping) */
__global__ void k_slot_ids(const int32_t *ids, int32_t P, const int32_t *slot_of, int32_t *sid) {
    PDL_ENTER();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < P) sid[i] = slot_of[ids[i]];
}

#define SCATTER_THREADS 128

/* Block r < *n: dst row idx[r] = rows row r, where rows holds P rows of E floats and then P pair indices (d_rows
 * as copied in; the layer's n at the front of each). Blocks past the count return at once (the grid is every pair
 * of the step: it is queued before the count is known). */
__global__ void k_scatter_rows(const float *rows, const int32_t *n, int64_t P, int64_t E, float *dst) {
    PDL_ENTER();
    const int32_t r = (int32_t)blockIdx.x;
    const int32_t cnt = *n;
    if (r >= cnt) return;
    const int64_t at = ((const int32_t *)(rows + P * E))[r];
    const float *s = rows + (int64_t)r * E;
    float *d = dst + at * E;
    if ((E & 3) == 0) { /* rows of whole float4s, 16-byte aligned at both ends */
        const float4 *s4 = (const float4 *)s;
        float4 *d4 = (float4 *)d;
        for (int64_t i = threadIdx.x; i < E / 4; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (int64_t i = threadIdx.x; i < E; i += blockDim.x) d[i] = s[i];
    }
}

/* k_rows_direct (hybrid_direct steps): at most ROWS_BLOCKS blocks of ROWS_THREADS (each polls the flag itself),
 * each thread with up to ROWS_VEC 16-byte loads in flight; a step takes it only where a block holds at most
 * ROWS_MAX_AT rows (their pair indices in shared memory: 16 KB) */
#define ROWS_BLOCKS 32
#define ROWS_THREADS 256
#define ROWS_VEC 4
#define ROWS_MAX_AT 4096

__device__ __forceinline__ uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* hybrid_direct steps: k_wait_flag, the rows' copy and k_scatter_rows as one kernel. Grid G = min(P, ROWS_BLOCKS)
 * blocks of ROWS_THREADS, ceil(P / G) ints of dynamic shared memory. Before the wait, from device memory alone: the
 * rank of each of the layer's CPU pairs (pair p with slot_of[ids[p]] = -1, in ascending p: hybrid_cpu_layer's
 * order of the rows), block b keeping the pair index of each row r = b + j G in at_s[j] (so no index crosses PCIe
 * after the flag). Then thread 0 polls the host's flag (a system-scope acquire, __nanosleep backoff) until it holds
 * want, and after the block's barrier its threads copy rows r < n (the flag's count) from rows (pinned, mapped: row r
 * at r E, written by the host before the flag) to dst row at_s[j]: all of a thread's loads (ROWS_VEC float4s across
 * the block's rows) before its stores. Every block polls the flag itself: none waits on another, so the grid cannot
 * deadlock whatever the scheduler runs first. ts (block 0): %globaltimer at its start and when it saw the flag. */
__global__ void __launch_bounds__(ROWS_THREADS)
    k_rows_direct(const unsigned long long *flag, uint32_t want, const int32_t *ids, const int32_t *slot_of,
                  int32_t ne, int32_t P, const float *rows, int64_t E, float *dst, uint64_t *ts) {
    PDL_ENTER();
    extern __shared__ int32_t at_s[];
    __shared__ int32_t warp_s[ROWS_THREADS / 32];
    __shared__ int32_t n_s;
    const int32_t G = (int32_t)gridDim.x, b = (int32_t)blockIdx.x, tid = (int32_t)threadIdx.x;
    const uint64_t t_start = globaltimer_ns();
    auto cpu_pair = [&](int32_t p) -> int32_t {
        const int32_t e = ids[p];
        return e >= 0 && e < ne && slot_of[e] < 0; /* the host rejects an id out of range (no rows) */
    };
    /* thread tid's pairs [p0, p1): their CPU pairs counted, then ranked by a block-wide exclusive scan */
    const int32_t chunk = (P + ROWS_THREADS - 1) / ROWS_THREADS;
    const int32_t p0 = min(P, tid * chunk), p1 = min(P, p0 + chunk);
    int32_t c = 0;
    for (int32_t p = p0; p < p1; p++) c += cpu_pair(p);
    const int32_t lane = tid & 31, w = tid >> 5;
    int32_t incl = c;
    for (int o = 1; o < 32; o <<= 1) {
        const int32_t u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
    }
    if (lane == 31) warp_s[w] = incl;
    __syncthreads();
    if (w == 0) {
        int32_t v = lane < ROWS_THREADS / 32 ? warp_s[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        if (lane < ROWS_THREADS / 32) warp_s[lane] = v;
    }
    __syncthreads();
    int32_t r = incl - c + (w > 0 ? warp_s[w - 1] : 0);
    const int32_t n_dev = warp_s[ROWS_THREADS / 32 - 1];
    for (int32_t p = p0; p < p1; p++)
        if (cpu_pair(p)) {
            if (r % G == b) at_s[r / G] = p;
            r++;
        }
    if (tid == 0) {
        unsigned long long v;
        unsigned ns = 32;
        for (;;) {
            asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
            if ((uint32_t)(v >> 32) == want) break;
            __nanosleep(ns);
            if (ns < 256) ns <<= 1;
        }
        n_s = min((int32_t)(uint32_t)v, n_dev); /* equal but where the host gave up on the layer (0) */
        if (b == 0) ts[0] = t_start, ts[1] = globaltimer_ns();
    }
    __syncthreads(); /* the flag's acquire (thread 0) before every thread's loads; at_s complete */
    const int32_t n = n_s, mine = n > b ? (n - b + G - 1) / G : 0; /* this block's rows: b + j G, j < mine */
    if ((E & 3) == 0) { /* rows of whole float4s, 16-byte aligned at both ends */
        const int32_t n4 = (int32_t)(E / 4), total = mine * n4;
        for (int32_t base = tid; base < total; base += ROWS_THREADS * ROWS_VEC) {
            float4 v[ROWS_VEC];
#pragma unroll
            for (int k = 0; k < ROWS_VEC; k++) {
                const int32_t f = base + k * ROWS_THREADS, j = f / n4;
                if (f < total) v[k] = ((const float4 *)(rows + (int64_t)(b + j * G) * E))[f - j * n4];
            }
#pragma unroll
            for (int k = 0; k < ROWS_VEC; k++) {
                const int32_t f = base + k * ROWS_THREADS, j = f / n4;
                if (f < total) ((float4 *)(dst + (int64_t)at_s[j] * E))[f - j * n4] = v[k];
            }
        }
    } else {
        const int32_t total = mine * (int32_t)E;
        for (int32_t f = tid; f < total; f += ROWS_THREADS) {
            const int32_t j = f / (int32_t)E, i = f - j * (int32_t)E;
            dst[(int64_t)at_s[j] * E + i] = rows[(int64_t)(b + j * G) * E + i];
        }
    }
}

/* pinned host memory, mapped into every device's address space (k_to_host writes xn and the routing in place) */
static stg_status host_mapped(hybrid &h, size_t bytes, void **out) {
    *out = nullptr;
    CU(cudaHostAlloc(out, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "pinned hybrid buffers");
    h.pinned.push_back(*out);
    return ST_OK;
}

/* The placement at model creation (before upload): the mask, the slots, the CPU engine, the flags. */
static stg_status hybrid_setup(stg_model *m, const uint8_t *resident, const stg_cpu_experts *cpu) {
    hybrid &h = m->hy;
    const int nL = m->d.n_layer, ne = m->d.n_expert;
    if (!resident || ne == 0) return ST_OK;
    const size_t n = (size_t)nL * (size_t)ne;
    std::vector<int32_t> slot(n, -1);
    std::vector<int32_t> n_slots((size_t)nL, 0);
    int64_t off = 0;
    std::vector<uint8_t> mask(resident, resident + n);
    for (int il = 0; il < nL; il++)
        for (int e = 0; e < ne; e++) {
            uint8_t &v = mask[(size_t)il * ne + e];
            if (v > 1) return fail(ST_EINVAL, "model_create: resident[%d][%d] = %d (0 or 1)", il, e, (int)v);
            if (il < m->d.n_dense_lead) v = 0; /* a leading dense layer has no routed experts: no slots, none off */
            else if (v) slot[(size_t)il * ne + e] = n_slots[(size_t)il]++;
            else off++;
        }
    if (off == 0) return ST_OK; /* every expert resident: the plain model */
    if (!cpu || !cpu->moe_pairs || !cpu->last_error || !cpu->model || !cpu->pool)
        return fail(ST_EINVAL, "model_create: %lld routed experts are not resident and no CPU engine is given to "
                               "compute them", (long long)off);
    h.on = true;
    h.resident = mask;
    h.n_slots = n_slots;
    h.slot_of = slot;
    h.host.assign((size_t)nL * 3, nullptr);
    h.cpu = *cpu;
    CHECK(dalloc(m, &h.d_slot, n * sizeof(int32_t)));
    CU(cudaMemcpy(h.d_slot, slot.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice), "model_create: slot map");
    CHECK(dalloc(m, &h.d_n, sizeof(int32_t)));
    CU(cudaMemset(h.d_n, 0, sizeof(int32_t)), "model_create: hybrid count");
    CHECK(host_sync_alloc(h.sync, nL, "model_create: hybrid flags"));
    return ST_OK;
}

/* The CPU share's buffers for steps of up to T tokens (ensure_scratch, the stream synchronised). */
static stg_status hybrid_scratch(stg_model *m, int64_t T) {
    hybrid &h = m->hy;
    if (!h.on) return ST_OK;
    scratch &s = m->s;
    const int64_t P = T * m->d.n_expert_used, E = m->d.n_embd;
    CHECK(dalloc_in(s.step_allocs, &h.sid, sizeof(int32_t) * P));
    bool shexp = false;
    for (const dlayer &L : m->L) shexp = shexp || L.gate_shexp.d != nullptr;
    if (shexp) CHECK(dalloc_in(s.step_allocs, &h.d_shx, sizeof(float) * T * E));
    /* the CPU's rows and their pair indices (a float's room each) */
    CHECK(dalloc_in(s.step_allocs, &h.d_rows, sizeof(float) * P * (E + 1)));
    for (void *p : h.pinned) cudaFreeHost(p);
    h.pinned.clear();
    h.h_xn = h.h_rows = nullptr, h.h_ids = nullptr;
    void *xn = nullptr, *rows = nullptr, *ids = nullptr;
    CHECK(host_mapped(h, sizeof(float) * T * E, &xn));
    CHECK(host_mapped(h, sizeof(float) * P * (E + 1), &rows));
    CHECK(host_mapped(h, sizeof(int32_t) * P, &ids));
    h.h_xn = (float *)xn, h.h_rows = (float *)rows, h.h_ids = (int32_t *)ids;
    h.pair_tok.resize((size_t)P), h.pair_exp.resize((size_t)P), h.pair_idx.resize((size_t)P);
    return ST_OK;
}

/* A step small enough (decode) that the device writes xn and the routing into pinned memory itself and
 * raises the layer's ready flag (k_to_host): a kernel's posted writes cost less than two copy-engine round
 * trips, and the host's spin on a line of its own memory wakes sooner than an event synchronisation. Larger
 * steps copy (bandwidth, not latency, is their cost) and the host synchronises on s1. */
static bool hybrid_direct(const stg_model *m, int32_t T) { return (int64_t)T * m->d.n_embd <= HY_DIRECT_FLOATS; }

/* The host's wait for layer il's xn and routing (s1): the ready flag's spin (hybrid_direct), with the event
 * queried now and then (a failed device, or a flag not seen although s1 completed, ends it), or the event. */
static stg_status hybrid_wait_routing(const hybrid &h, const hybrid_step &hs, int il) {
    if (!h.direct) {
        CU(cudaEventSynchronize(hs.s1[(size_t)il]), "hybrid: routing to the host");
        return ST_OK;
    }
    return host_sync_wait(h.sync, il, hs.seq, hs.s1[(size_t)il], "hybrid: routing to the host");
}

/* A layer with a CPU share in the step being queued (a partial layer that this step does not stage). */
static bool hybrid_layer(const stg_model *m, int il) {
    return partial_layer(m, il) && !staged_layer(m, il);
}

/* Layer il's expert -> resident slot map on the device (-1: the CPU's expert) */
static const int32_t *layer_slot_map(const stg_model *m, int il) {
    return m->hy.d_slot + (int64_t)il * m->d.n_expert;
}

/* The launched step's events, sums and flag value (step_launch, before the layers are queued). events: whether
 * the step records its frame's events (sampled: step.cu); a step that stages a layer, or whose rows come
 * back by copies, records them whatever it says (their waits and copies are timed by them alone). */
static stg_status hybrid_step_begin(stg_model *m, hybrid_step &hs, int32_t T, bool events) {
    m->hy.cur = nullptr;
    if (!m->hy.on) return ST_OK;
    const size_t nL = (size_t)m->d.n_layer;
    std::vector<cudaEvent_t> *sets[5] = {&hs.s0, &hs.s1, &hs.a, &hs.b, &hs.c};
    for (std::vector<cudaEvent_t> *v : sets)
        while (v->size() < nL) {
            cudaEvent_t e = nullptr;
            CU(cudaEventCreate(&e), "hybrid: events");
            v->push_back(e);
        }
    hs.used.assign(nL, 0);
    hs.t_cpu = hs.t_cpu_wait = 0.0, hs.cpu_pairs = hs.pcie_d2h = hs.pcie_h2d = 0;
    hs.staged_layers = hs.staged_bytes = 0;
    staging_decide(m, T);
    if (++m->hy.seq == 0) m->hy.seq = 1; /* 0 is the flags' value before any step */
    hs.seq = m->hy.seq;
    hybrid &h = m->hy;
    h.direct = hybrid_direct(m, T);
    const int64_t P = (int64_t)T * m->d.n_expert_used, G = std::min<int64_t>(P, ROWS_BLOCKS);
    h.rows_direct = h.direct && P > 0 && (P + G - 1) / G <= ROWS_MAX_AT;
    bool staged = false;
    for (const uint8_t v : h.stg.now) staged = staged || v != 0;
    hs.events = events || staged || !h.rows_direct;
    if (h.rows_direct && !hs.ts) {
        void *p = nullptr;
        CU(cudaHostAlloc(&p, sizeof(uint64_t) * 2 * nL, cudaHostAllocMapped | cudaHostAllocPortable),
           "hybrid: profile stamps");
        memset(p, 0, sizeof(uint64_t) * 2 * nL);
        hs.ts = (uint64_t *)p;
    }
    h.cur = &hs, h.T = T;
    return ST_OK;
}

/* The host writes a layer's flag: the device's wait for it ends (its n rows, or none, are in place). */
static void hybrid_signal(hybrid &h, int il, uint32_t seq, int32_t n) {
    host_sync_signal(h.sync, il, seq, n);
}

/* A failed or abandoned step: no rows from layer il on, every flag written so that no wait queued for them
 * blocks the stream (the step's results are then not used). */
static void hybrid_release(stg_model *m, int il, uint32_t seq) {
    hybrid &h = m->hy;
    for (int j = il; j < m->d.n_layer; j++)
        if (hybrid_layer(m, j)) hybrid_signal(h, j, seq, 0);
}

/* The CPU's share of layer il (its s1 recorded): wait for xn and the routing, compute the pairs of experts the
 * device does not hold into pinned memory with their pair indices (h_rows' layout), write the flag with their
 * count. No CUDA call from here to the flag (the file's comment says why). */
static stg_status hybrid_cpu_layer(stg_model *m, hybrid_step &hs, int il) {
    hybrid &h = m->hy;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    const int32_t T = h.T;
    const int64_t E = m->d.n_embd, P = (int64_t)T * k;
    const double t0 = host_seconds();
    CHECK(hybrid_wait_routing(h, hs, il));
    const double t1 = host_seconds();
    hs.t_cpu_wait += t1 - t0;
    const uint8_t *res = h.resident.data() + (size_t)il * ne;
    int32_t n = 0;
    for (int64_t p = 0; p < P; p++) {
        const int32_t e = h.h_ids[p];
        if (e < 0 || e >= ne)
            return fail(ST_ERANGE, "hybrid: layer %d routed pair %lld to expert %d of %d", il, (long long)p, e, ne);
        if (res[e]) continue;
        h.pair_tok[(size_t)n] = (int32_t)(p / k), h.pair_exp[(size_t)n] = e, h.pair_idx[(size_t)n] = (int32_t)p;
        n++;
    }
    if (n > 0) {
        const int32_t rc = h.cpu.moe_pairs(h.cpu.model, h.cpu.pool, il, T, h.h_xn, n, h.pair_tok.data(),
                                           h.pair_exp.data(), h.h_rows);
        if (rc != ST_OK) {
            const char *msg = h.cpu.last_error();
            return fail(rc, "layer %d: the CPU engine's experts: %s", il, msg ? msg : "(no message)");
        }
    }
    hs.t_cpu += host_seconds() - t1;
    hs.cpu_pairs += n;
    if (h.rows_direct) { /* k_rows_direct reads the n rows in place (their indices are the device's own) */
        hs.pcie_h2d += (int64_t)sizeof(float) * n * E;
    } else { /* the pair indices after room for every pair's row; the device copies the whole region */
        if (n > 0) memcpy(h.h_rows + P * E, h.pair_idx.data(), sizeof(int32_t) * (size_t)n);
        hs.pcie_h2d += (int64_t)sizeof(float) * P * (E + 1);
    }
    hs.pcie_h2d += (int64_t)sizeof(uint64_t);
    hybrid_signal(h, il, hs.seq, n);
    return ST_OK;
}

/* The overlapped step's CPU thread: the layers in order, each once the queueing thread has recorded its s1;
 * on an error or an abandoned queue, every later flag written (hybrid_release). */
static void hybrid_worker_run(stg_model *m, hybrid_step *hs, hybrid_worker *w) {
    int il = 0;
    if (cudaSetDevice(m->device) != cudaSuccess) {
        cudaGetLastError();
        w->rc = fail(ST_EINVAL, "hybrid: the CPU thread could not select device %d", m->device);
    }
    for (; il < m->d.n_layer && w->rc == ST_OK; il++) {
        if (!hybrid_layer(m, il)) continue;
        const double t0 = host_seconds();
        for (int spins = 1; w->queued.load(std::memory_order_acquire) <= il; spins++) {
            if (w->abort.load(std::memory_order_acquire)) break;
            if (spins % 64 == 0) std::this_thread::yield();
        }
        hs->t_cpu_wait += host_seconds() - t0;
        if (w->queued.load(std::memory_order_acquire) <= il) break; /* abandoned before this layer */
        w->rc = hybrid_cpu_layer(m, *hs, il);
        if (w->rc != ST_OK) break;
    }
    if (w->rc != ST_OK) snprintf(w->err, sizeof w->err, "%s", stg_last_error());
    if (il < m->d.n_layer) hybrid_release(m, il, hs->seq);
}

/* The CPU thread of one launched step (hybrid_overlap): started before the layers are queued; finish() joins
 * it and gives its result; leaving scope without finish() (a failed queue) abandons the step first. */
struct hybrid_thread {
    stg_model *m;
    hybrid_worker w;
    std::thread th;
    explicit hybrid_thread(stg_model *model) : m(model) {}
    hybrid_thread(const hybrid_thread &) = delete;
    hybrid_thread &operator=(const hybrid_thread &) = delete;
    stg_status start() {
        hybrid &h = m->hy;
        if (!h.on || !h.cur || !m->set.hybrid_overlap) return ST_OK;
        try {
            th = std::thread(hybrid_worker_run, m, h.cur, &w);
        } catch (...) {
            return fail(ST_ENOMEM, "hybrid: the CPU thread did not start");
        }
        h.worker = &w;
        return ST_OK;
    }
    stg_status finish() {
        if (!th.joinable()) return ST_OK;
        th.join();
        m->hy.worker = nullptr;
        if (w.rc != ST_OK) return fail(w.rc, "%s", w.err);
        return ST_OK;
    }
    ~hybrid_thread() {
        if (!th.joinable()) return;
        w.abort.store(true, std::memory_order_release);
        th.join();
        m->hy.worker = nullptr;
    }
};

/* After the router (topk_id and xn written): both to the host between s0 and s1 (the CPU thread may start on
 * the layer from here); then the resident pairs grouped by slot into the grouping's arrays (gexp holds slots:
 * the kernels index the slotted weights). */
static stg_status hybrid_send(stg_model *m, int il, int32_t T, int mv_max) {
    scratch &s = m->s;
    hybrid &h = m->hy;
    if (!h.cur) return fail(ST_EINVAL, "hybrid: layer %d queued outside a step", il);
    hybrid_step &hs = *h.cur;
    cudaStream_t st = m->stream;
    const int k = m->d.n_expert_used;
    const int64_t E = m->d.n_embd, P = (int64_t)T * k;
    if (hs.events) CU(cudaEventRecord(hs.s0[(size_t)il], st), "hybrid: event");
    if (h.direct) {
        launch_k(k_to_host, 1, 1024, 0, st, (const int32_t *)s.topk_id, (int32_t)P, (const float *)s.xn, (int64_t)T * E,
                 h.h_ids, h.h_xn, h.sync.ready + il, hs.seq);
        LAUNCHED("hybrid: xn and routing to the host");
    } else {
        CU(cudaMemcpyAsync(h.h_ids, s.topk_id, sizeof(int32_t) * P, cudaMemcpyDeviceToHost, st), "hybrid: routing");
        CU(cudaMemcpyAsync(h.h_xn, s.xn, sizeof(float) * T * E, cudaMemcpyDeviceToHost, st), "hybrid: xn");
        pdl_cut(st); /* the next kernel follows the copies */
    }
    CU(cudaEventRecord(hs.s1[(size_t)il], st), "hybrid: event");
    hs.pcie_d2h += (int64_t)sizeof(int32_t) * P + (int64_t)sizeof(float) * T * E;
    if (h.worker) h.worker->queued.store(il + 1, std::memory_order_release);
    const int32_t n_slots = h.n_slots[(size_t)il];
    if (n_slots == 0) return ST_OK;
    launch_k(k_slot_ids, (unsigned)((P + 255) / 256), 256, 0, st, (const int32_t *)s.topk_id, (int32_t)P,
             layer_slot_map(m, il), h.sid);
    LAUNCHED("hybrid: slots");
    /* the histogram is the expert grouping's (the router's launch counted every pair) */
    const group_out go = {s.gexp,   s.gstart, s.gcount, s.n_groups,  s.list,    s.pair_tok, nullptr, s.gtiles,
                          s.n_gtiles, s.mexp, s.mstart, s.mcount, s.n_mgroups, s.pair_mv, mv_max};
    launch_k(k_group, 1, 1024, 2 * (size_t)n_slots * sizeof(int32_t), st, (const int32_t *)h.sid, (int32_t)P, k,
             n_slots, go, 0);
    LAUNCHED("hybrid: group by slot");
    return ST_OK;
}

/* After the device's own work of the layer is queued (shared expert, resident experts): the wait for the
 * layer's flag between a and b, and the CPU's rows into pair_out before c (the weighted sum comes next).
 * Without the CPU thread, this thread computes the share between the wait and the rows. */
static stg_status hybrid_receive(stg_model *m, int il, int32_t T) {
    hybrid &h = m->hy;
    if (!h.cur) return fail(ST_EINVAL, "hybrid: layer %d queued outside a step", il);
    hybrid_step &hs = *h.cur;
    cudaStream_t st = m->stream;
    const int64_t E = m->d.n_embd, P = (int64_t)T * m->d.n_expert_used;
    if (hs.events) CU(cudaEventRecord(hs.a[(size_t)il], st), "hybrid: event");
    if (h.rows_direct) { /* the wait and the rows' reads in one kernel, then event c (no b) */
        const int64_t G = std::min<int64_t>(P, ROWS_BLOCKS);
        launch_k(k_rows_direct, (unsigned)G, ROWS_THREADS, sizeof(int32_t) * (size_t)((P + G - 1) / G), st,
                 (const unsigned long long *)(h.sync.flags + il), hs.seq, (const int32_t *)m->s.topk_id,
                 layer_slot_map(m, il), (int32_t)m->d.n_expert, (int32_t)P, (const float *)h.h_rows, E,
                 m->s.pair_out, hs.ts + 2 * il);
        LAUNCHED("hybrid: wait for the CPU and read its rows");
    } else {
        launch_k(k_wait_flag, 1, 1, 0, st, (const unsigned long long *)(h.sync.flags + il), hs.seq, h.d_n);
        LAUNCHED("hybrid: wait for the CPU");
    }
    if (!h.worker) {
        const stg_status rc = hybrid_cpu_layer(m, hs, il);
        if (rc != ST_OK) {
            hybrid_release(m, il, hs.seq);
            return rc;
        }
    }
    if (h.rows_direct) {
        if (hs.events) CU(cudaEventRecord(hs.c[(size_t)il], st), "hybrid: event");
        hs.used[(size_t)il] = 3;
        return ST_OK;
    }
    CU(cudaEventRecord(hs.b[(size_t)il], st), "hybrid: event");
    CU(cudaMemcpyAsync(h.d_rows, h.h_rows, sizeof(float) * (size_t)(P * (E + 1)), cudaMemcpyHostToDevice, st),
       "hybrid: CPU rows");
    pdl_cut(st); /* k_scatter_rows follows the copy */
    launch_k(k_scatter_rows, (unsigned)P, SCATTER_THREADS, 0, st, (const float *)h.d_rows, (const int32_t *)h.d_n, P,
             E, m->s.pair_out);
    LAUNCHED("hybrid: CPU rows");
    CU(cudaEventRecord(hs.c[(size_t)il], st), "hybrid: event");
    hs.used[(size_t)il] = 1;
    return ST_OK;
}

/* The waited step's frame profile (step_wait, after its end event e1; e0 its start; T its tokens). A step without
 * its frame's events (sampled out) takes the device's wait from k_rows_direct's clock (block 0: its start to its
 * seeing the flag, as a measured step's wait inside a..c) and splits the rest into compute and PCIe as the last
 * measured step of its size did. */
static void hybrid_profile(stg_model *m, const hybrid_step &hs, int32_t T, cudaEvent_t e0, cudaEvent_t e1,
                           double t_total, int64_t pairs) {
    const staging &g = m->hy.stg;
    if (!m->hy.on) {
        m->profile = stg_profile{};
        m->profile.t_total = m->profile.t_gpu = t_total;
        m->profile.pairs_gpu = pairs;
        m->profile.measured = 1;
        return;
    }
    /* the sampled sizes' shares (decode-sized steps only: the map stays as small as the graph cache's) */
    stg_model::split *sp = hybrid_direct(m, T) ? &m->splits[T] : nullptr;
    auto el = [](cudaEvent_t x, cudaEvent_t y) -> double {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, x, y) != cudaSuccess) {
            cudaGetLastError();
            return 0.0;
        }
        return ms > 0.0f ? 1e-3 * ms : 0.0;
    };
    /* k_rows_direct layer il's wait by block 0's own clock: its start to its seeing the flag */
    auto clock_wait = [&hs](size_t il) -> double {
        const uint64_t t0 = hs.ts[2 * il], t1 = hs.ts[2 * il + 1];
        return t1 >= t0 ? 1e-9 * (double)(t1 - t0) : 0.0;
    };
    double gpu = 0.0, wait = 0.0, pcie = 0.0;
    if (!hs.events) { /* every used layer is a k_rows_direct one */
        for (size_t il = 0; il < hs.used.size(); il++)
            if (hs.used[il] == 3) wait += clock_wait(il);
        wait = std::min(wait, t_total);
        gpu = (t_total - wait) * (sp ? sp->hy_gpu : 1.0), pcie = t_total - wait - gpu;
    } else {
        cudaEvent_t prev = e0;
        for (size_t il = 0; il < hs.used.size(); il++) {
            if (!hs.used[il]) continue;
            if (hs.used[il] == 2) { /* staged: the device waiting for the layer's copies */
                gpu += el(prev, hs.s0[il]);
                pcie += el(hs.s0[il], hs.s1[il]);
                prev = hs.s1[il];
                continue;
            }
            gpu += el(prev, hs.s0[il]) + el(hs.s1[il], hs.a[il]);
            pcie += el(hs.s0[il], hs.s1[il]);
            if (hs.used[il] == 3) { /* k_rows_direct: a..c less block 0's wait is the rows' part */
                const double ac = el(hs.a[il], hs.c[il]), w = std::min(ac, clock_wait(il));
                wait += w, pcie += ac - w;
            } else {
                pcie += el(hs.b[il], hs.c[il]);
                wait += el(hs.a[il], hs.b[il]);
            }
            prev = hs.c[il];
        }
        gpu += el(prev, e1);
        if (sp && gpu + pcie > 0.0) sp->hy_gpu = gpu / (gpu + pcie), sp->hy_have = true;
    }
    stg_profile &p = m->profile;
    p = stg_profile{};
    p.measured = hs.events ? 1 : 0;
    p.t_total = t_total, p.t_gpu = gpu, p.t_cpu_experts = hs.t_cpu, p.t_gpu_wait = wait;
    p.pairs_gpu = pairs - hs.cpu_pairs, p.pairs_cpu = hs.cpu_pairs, p.staged_bytes = hs.staged_bytes;
    p.t_pcie = pcie, p.t_cpu_wait = hs.t_cpu_wait, p.pcie_bytes = hs.pcie_d2h + hs.pcie_h2d;
    p.staged_layers = hs.staged_layers, p.stage_pcie_gbs = g.pcie_gbs, p.stage_gpu_gbs = g.gpu_gbs;
    p.stage_cpu_pairs_s = g.cpu_pairs_s;
}

/* Online re-placement (between steps): expert in_e of a partial layer takes the slot of its resident expert
 * out_e. The slot leaves the map first (out_e goes to the CPU from here on), the weights come over, then
 * in_e enters the map: a failed copy leaves both on the CPU and the slot idle. The layer's slot count, and
 * so every byte the model holds, stays the same. */
extern "C" stg_status stg_model_swap_expert(stg_model *m, int32_t layer, int32_t out_e, int32_t in_e) {
    if (!m) return fail(ST_EINVAL, "swap_expert: NULL model");
    hybrid &h = m->hy;
    const int ne = m->d.n_expert;
    if (!h.on) return fail(ST_EINVAL, "swap_expert: every routed expert is on the device already");
    if (layer < 0 || layer >= m->d.n_layer || out_e < 0 || out_e >= ne || in_e < 0 || in_e >= ne)
        return fail(ST_ERANGE, "swap_expert: layer %d, experts %d / %d out of range", layer, out_e, in_e);
    if (m->n_live > 0) return fail(ST_EINVAL, "swap_expert: %d launched step(s) in flight", m->n_live);
    const size_t row = (size_t)layer * ne;
    if (!h.resident[row + out_e] || h.resident[row + in_e])
        return fail(ST_EINVAL, "swap_expert: layer %d: expert %d must be resident and %d not", layer, out_e, in_e);
    CU(cudaSetDevice(m->device), "swap_expert");
    CU(cudaStreamSynchronize(m->stream), "swap_expert");
    const int32_t slot = h.slot_of[row + out_e], none = -1;
    CU(cudaMemcpy(h.d_slot + row + out_e, &none, sizeof none, cudaMemcpyHostToDevice), "swap_expert: slot map");
    h.slot_of[row + out_e] = -1, h.resident[row + out_e] = 0;
    const dlayer &L = m->L[(size_t)layer];
    const dtensor *t[3] = {&L.gate_exps, &L.up_exps, &L.down_exps};
    for (int i = 0; i < 3; i++)
        CU(cudaMemcpy((void *)(t[i]->d + (int64_t)slot * t[i]->expert_stride),
                      h.host[(size_t)layer * 3 + i] + (int64_t)in_e * t[i]->expert_stride, (size_t)t[i]->expert_stride,
                      cudaMemcpyHostToDevice),
           "swap_expert: weights");
    CU(cudaMemcpy(h.d_slot + row + in_e, &slot, sizeof slot, cudaMemcpyHostToDevice), "swap_expert: slot map");
    h.slot_of[row + in_e] = slot, h.resident[row + in_e] = 1;
    return ST_OK;
}

extern "C" stg_status stg_step_profile(const stg_model *m, stg_profile *out) {
    if (!m || !out) return fail(ST_EINVAL, "step_profile: NULL argument");
    *out = m->profile;
    return ST_OK;
}
