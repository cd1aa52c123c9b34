/* The per-layer handshake between the device and a host thread, and kv_host_attn's use of it.
 *
 * The handshake (hybrid placement's CPU share, hybrid.cu, and kv_host_attn's CPU attention, below): per layer the
 * device writes the layer's inputs into pinned, mapped host memory by k_to_host's stores and then raises the
 * layer's ready word (system-scope release), on which the host thread spins (host_sync_wait, the layer's event
 * queried now and then); the host computes and writes the layer's flag ((seq << 32) | n, release), on which
 * k_wait_flag (one thread, system-scope acquire) holds the stream. The host thread makes no CUDA call between the
 * device's wait and the flag (hybrid.cu's top comment says why).
 *
 * kv_host_attn (stg_settings.kv_host_attn): in a split-KV decode step on a tiered cache whose tokens each read
 * some host-tier block and write none, every layer's attention is shared: k_to_host sends the layer's q (after
 * k_qkv_post) to the host, whose thread (host_attn_thread) has the CPU engine's pool attend the CPU's share of each
 * token's host-tier blocks where they lie (st_attn_blocks_part: a prefix of them in sequence order,
 * kv_host_share) while the split kernel attends the VRAM blocks and the rest of the host blocks, read in place over
 * PCIe as kv_host_attn 0 reads them (a compacted block table and key count per token, uploaded once per step), so
 * that the CPU's and PCIe's rates add; the device then waits for the layer's flag,
 * copies the CPU's partials in, places each (token, head)'s as the split after the device's own
 * (k_host_part_place) and the combine merges them. Such steps are eager (the lists change every step) and run
 * without PDL (kernels follow host waits). Exactness: the CPU sums its keys in another order (its chunks, then a
 * merge), so logits are within rounding of the untiered cache's (1e-3 of max |logit|), not bitwise; a step whose
 * shares round to no CPU block (kv_host_share 0 among them) takes kv_host_attn 0's path, bitwise the untiered
 * cache's.
 *
 * With kv_stream 0 the device's share of the host-tier blocks is staged instead (the form host_attn_form 1): step.cu
 * gives those blocks staging slots (the compacted tables name n_dev + slot, as a staged step's tables do) and each
 * layer's gather (kv_stage_layer) is queued right after k_to_host, so that it runs while the CPU attends its own
 * share; the split kernel then reads them in VRAM. Nothing is written back (such steps write no host block).
 *
 * The measured share (kv_host_share -1) is r_cpu / (r_cpu + r_dev), so that both sides finish together: r_cpu the
 * running mean of the CPU's rate in its steps (kv_cpu_bytes / t_cpu_attn), r_dev the device's rate over its share of
 * the host-tier bytes in the step's form. r_dev starts from a probe timed at the first step of the form that may take
 * the CPU's share (not at open: a tiered cache with kv_host_attn 0 never pays for it): k_pcie_probe's in-place reads
 * of mapped host memory (read in place), k_kv_stage's gathers of it into VRAM (staged). From then on it is the
 * running mean (the first sample replaces the probe, then one eighth a step) of one layer's window a step: its
 * host-tier bytes on the device over the time from its k_to_host to its k_wait_flag (the gather and the split kernel,
 * or the split kernel reading in place), so it is what the device achieves there, not a streaming kernel's best
 * (the in-place probe reads 64 MiB contiguously with every thread's loads in flight and overstates the split kernel,
 * 51 against ~32 GB/s on the H100 machine). A layer whose device bytes are under DEV_SAMPLE_MIN gives no sample
 * (there the launches and the VRAM blocks' time are most of the window). A rate not known yet counts as the
 * other's (a share of one half). */
#include <time.h>

#include <thread>

#include "model.cuh"

static double host_seconds() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wait until the host has written (want << 32) | n into *flag (pinned host memory, one 8-byte word: the step's
 * value and the layer's count arrive together), then leave n in *n (device memory). The host writes the flag
 * only once its results are in pinned memory (a system-scope acquire here). One thread. */
__global__ void k_wait_flag(const unsigned long long *flag, uint32_t want, int32_t *n) {
    PDL_ENTER();
    for (;;) {
        unsigned long long v;
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
        if ((uint32_t)(v >> 32) == want) {
            *n = (int32_t)(uint32_t)v;
            break;
        }
        __nanosleep(256);
    }
}

/* P ids and n floats of x written straight into pinned host memory by one block (posted PCIe writes: no
 * copy-engine round trip per array), then a system-scope fence and *ready = want, on which the host spins
 * (host_sync_wait) instead of synchronising on an event. */
__global__ void k_to_host(const int32_t *ids, int32_t P, const float *x, int64_t n, int32_t *h_ids, float *h_x,
                          uint32_t *ready, uint32_t want) {
    PDL_ENTER();
    for (int i = threadIdx.x; i < P; i += blockDim.x) h_ids[i] = ids[i];
    if ((n & 3) == 0)
        for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x) ((float4 *)h_x)[i] = ((const float4 *)x)[i];
    else
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) h_x[i] = x[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ready), "r"(want) : "memory");
}

static stg_status host_sync_alloc(host_sync &hs, int n, const char *what) {
    /* flags [n] (8 bytes each, host -> device), then from the next 64-byte line ready [n] (device -> host) */
    const size_t flag_bytes = ((size_t)n * sizeof(uint64_t) + 63) / 64 * 64;
    const size_t bytes = flag_bytes + sizeof(uint32_t) * (size_t)n;
    void *p = nullptr;
    CU(cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable), what);
    memset(p, 0, bytes);
    hs.flags = (uint64_t *)p;
    hs.ready = (uint32_t *)((char *)p + flag_bytes);
    return ST_OK;
}

static void host_sync_free(host_sync &hs) {
    if (hs.flags) cudaFreeHost(hs.flags);
    hs.flags = nullptr, hs.ready = nullptr;
}

/* The host writes word i's flag: the device's wait for it ends (n results, or none, are in place). */
static void host_sync_signal(host_sync &hs, int i, uint32_t seq, int32_t n) {
    __atomic_store_n(&hs.flags[i], ((uint64_t)seq << 32) | (uint32_t)n, __ATOMIC_RELEASE);
}

/* The host's wait for word i's ready = seq, with ev (recorded after the k_to_host that writes it) queried now and
 * then: a failed device, or a word not seen although ev completed, ends it. */
static stg_status host_sync_wait(const host_sync &hs, int i, uint32_t seq, cudaEvent_t ev, const char *what) {
    for (uint32_t spins = 1;; spins++) {
        if (__atomic_load_n(&hs.ready[i], __ATOMIC_ACQUIRE) == seq) return ST_OK;
        if (spins % 512 == 0) {
            const cudaError_t q = cudaEventQuery(ev);
            if (q == cudaSuccess) return ST_OK; /* ev follows k_to_host: its writes are visible */
            if (q != cudaErrorNotReady) {
                cudaGetLastError();
                return fail(ST_EINVAL, "%s: %s", what, cudaGetErrorString(q));
            }
        }
#if defined(__x86_64__)
        asm volatile("pause");
#endif
    }
}

/* ------------------------------------------------------------------ kv_host_attn */

/* Block (t, h): the CPU's partial of (token t, head h) (part: T * n_head (max, sum) pairs, then T * n_head rows of
 * hd) into the split partials at the split after the device's own (the count k_attention_combine takes with
 * split_x: the last of its ns). */
__global__ void k_host_part_place(attn_args a, const float *part, int32_t T) {
    PDL_ENTER();
    const int t = blockIdx.x, h = blockIdx.y, hd = a.hd;
    const int32_t nk = a.pos[t] + 1;
    const int ns = min(att_split_count(nk, a.split_min, a.split_chunks, a.split_max), a.split_z - 1) + 1;
    const int64_t r = (int64_t)t * a.n_head + h, prow = r * a.split_z + (ns - 1);
    const float *acc = part + 2 * (int64_t)T * a.n_head + r * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) a.part_acc[prow * hd + d] = acc[d];
    if (threadIdx.x == 0) a.part_ml[2 * prow] = part[2 * r], a.part_ml[2 * prow + 1] = part[2 * r + 1];
}

/* Reads n 16-byte words of mapped host memory over PCIe in place (the host tier's zero-copy path), grid-stride;
 * *out gets their XOR only where it is a value no page of zeros gives (so the reads are not dropped). */
__global__ void k_pcie_probe(const uint4 *p, int64_t n, uint32_t *out) {
    uint32_t x = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x9e3779b9u) *out = x;
}

/* GB/s of launch() moving bytes a pass on the model's stream: one pass to warm up, then three timed with events;
 * 0 where the events or a launch fail. The stream is synchronised and no error is left behind either way. */
template <class F> static double timed_passes_gbs(stg_model *m, size_t bytes, F launch) {
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    double gbs = 0.0;
    if (cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess) {
        launch();
        bool ok = cudaEventRecord(e0, m->stream) == cudaSuccess;
        for (int i = 0; i < 3 && ok; i++) {
            launch();
            ok = cudaGetLastError() == cudaSuccess;
        }
        float ms = 0.0f;
        if (ok && cudaEventRecord(e1, m->stream) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess &&
            cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms > 0.0f)
            gbs = 3.0 * (double)bytes / (1e-3 * (double)ms) / 1e9;
    }
    cudaStreamSynchronize(m->stream);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    cudaGetLastError(); /* a failed probe leaves no error behind */
    return gbs;
}

/* PCIe's rate for in-place reads in GB/s: k_pcie_probe over 64 MiB of pinned, mapped memory (the way the split
 * kernel reads host-tier blocks), timed_passes_gbs; 0 where the buffers cannot be had (the measured share then
 * counts it as the CPU's rate). */
static double pcie_probe_gbs(stg_model *m) {
    const size_t n = (size_t)64 << 20;
    void *h = nullptr, *hd = nullptr;
    uint32_t *dv = nullptr;
    double gbs = 0.0;
    if (cudaHostAlloc(&h, n, cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess &&
        cudaHostGetDevicePointer(&hd, h, 0) == cudaSuccess && cudaMalloc(&dv, sizeof(uint32_t)) == cudaSuccess) {
        memset(h, 0, n);
        int n_sm = 0;
        cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, m->device);
        const unsigned grid = (unsigned)std::max(1, 4 * n_sm);
        const int64_t words = (int64_t)(n / sizeof(uint4));
        gbs = timed_passes_gbs(m, n, [&] { k_pcie_probe<<<grid, 256, 0, m->stream>>>((const uint4 *)hd, words, dv); });
    }
    cudaStreamSynchronize(m->stream);
    if (dv) cudaFree(dv);
    if (h) cudaFreeHost(h);
    cudaGetLastError(); /* a failed probe leaves no error behind */
    return gbs;
}

/* The staging gather's rate in GB/s: k_kv_stage copying 64 MiB of pinned, mapped memory into VRAM in pieces of the
 * cache's block of one layer's K (a staged step's gathers), timed_passes_gbs; 0 where the buffers cannot be had. */
static double stage_probe_gbs(stg_model *m, const stg_kv *kv) {
    unsigned char *dev[4], *host[4];
    int64_t per[4], dl[4], hl[4];
    kv_arrays(kv, dev, host, per, dl, hl);
    const int64_t blk = std::max<int64_t>(16, per[0] / 16 * 16);
    const int32_t n = (int32_t)std::max<int64_t>(1, ((int64_t)64 << 20) / blk);
    const size_t bytes = (size_t)n * (size_t)blk;
    void *h = nullptr, *hd = nullptr, *d = nullptr;
    int32_t *dlist = nullptr;
    double gbs = 0.0;
    if (cudaHostAlloc(&h, bytes, cudaHostAllocMapped | cudaHostAllocPortable) == cudaSuccess &&
        cudaHostGetDevicePointer(&hd, h, 0) == cudaSuccess && cudaMalloc(&d, bytes) == cudaSuccess &&
        cudaMalloc(&dlist, sizeof(int32_t) * 2 * (size_t)n) == cudaSuccess) {
        memset(h, 0, bytes);
        std::vector<int32_t> list(2 * (size_t)n);
        for (int32_t i = 0; i < n; i++) list[2 * (size_t)i] = i, list[2 * (size_t)i + 1] = n - 1 - i; /* (slot, block) */
        kv_stage_args a = {};
        a.host[0] = (unsigned char *)hd, a.stage[0] = (unsigned char *)d, a.per[0] = blk, a.list = dlist, a.dir = 0;
        if (cudaMemcpy(dlist, list.data(), sizeof(int32_t) * list.size(), cudaMemcpyHostToDevice) == cudaSuccess)
            gbs = timed_passes_gbs(m, bytes, [&] { k_kv_stage<<<dim3((unsigned)n, 1), 256, 0, m->stream>>>(a); });
    }
    cudaStreamSynchronize(m->stream);
    if (dlist) cudaFree(dlist);
    if (d) cudaFree(d);
    if (h) cudaFreeHost(h);
    cudaGetLastError(); /* a failed probe leaves no error behind */
    return gbs;
}

/* The form of a kv_host_attn step's device share of the host-tier blocks: 0 read in place (kv_stream 1), 1 staged
 * into VRAM (kv_stream 0 or -1; step.cu stages every eager step there, and kv_host_attn's steps are eager). */
static int host_attn_form(const stg_model *m) { return m->set.kv_stream == 1 ? 0 : 1; }

/* The CPU's share of the step's host-tier blocks (0..1): kv_host_share's percentage, or the measured rates' */
static double host_attn_share(const stg_model *m) {
    if (m->set.kv_host_share >= 0) return 0.01 * (double)m->set.kv_host_share;
    const host_attn &ha = m->ha;
    const double r = ha.dev_gbs[host_attn_form(m)];
    const double rc = ha.cpu_gbs > 0.0 ? ha.cpu_gbs : r, rp = r > 0.0 ? r : rc;
    return rc > 0.0 ? rc / (rc + rp) : 0.5;
}

#define DEV_SAMPLE_MIN ((int64_t)4 << 20) /* bytes: a timed layer's device share below this gives no rate sample */

/* The step being queued (kv_host_attn, bytes: the host-tier bytes its device reads in all layers, staged or in
 * place): whether it times layer n_layer / 2's window (one timed step pending at a time). */
static void host_attn_time_plan(stg_model *m, int64_t bytes) {
    host_attn &ha = m->ha;
    ha.t_bytes = bytes / m->d.n_layer, ha.t_form = host_attn_form(m);
    ha.t_now = ha.te[0] && ha.te[1] && ha.t_ticket == 0 && ha.t_bytes >= DEV_SAMPLE_MIN;
}

/* Layer il's window on the device's share: which 0 after its k_to_host, 1 before its k_wait_flag. */
static stg_status host_attn_mark(stg_model *m, int il, int which, cudaStream_t st) {
    host_attn &ha = m->ha;
    if (!ha.t_now || il != m->d.n_layer / 2) return ST_OK;
    CU(cudaEventRecord(ha.te[which], st), "kv_host_attn: the device's window");
    return ST_OK;
}

/* At the wait of ticket (its events complete): the device's rate of its timed window into the running mean. */
static void host_attn_timed(stg_model *m, int64_t ticket) {
    host_attn &ha = m->ha;
    if (ha.t_ticket == 0 || ha.t_ticket != ticket) return;
    ha.t_ticket = 0;
    float ms = 0.0f;
    if (cudaEventElapsedTime(&ms, ha.te[0], ha.te[1]) != cudaSuccess || ms <= 0.0f) {
        cudaGetLastError();
        return;
    }
    const double g = (double)ha.t_bytes / (1e-3 * (double)ms) / 1e9;
    double &r = ha.dev_gbs[ha.t_form];
    r = ha.measured[ha.t_form] ? r + (g - r) * 0.125 : g;
    ha.measured[ha.t_form] = true;
}

/* After a kv_host_attn step: its CPU rate into the running mean (one eighth a step). */
static void host_attn_account(stg_model *m) {
    host_attn &ha = m->ha;
    if (ha.bytes <= 0 || ha.t_cpu <= 0.0) return;
    const double g = (double)ha.bytes / ha.t_cpu / 1e9;
    ha.cpu_gbs = ha.cpu_gbs > 0.0 ? ha.cpu_gbs + (g - ha.cpu_gbs) * 0.125 : g;
}

extern "C" stg_status stg_model_set_cpu_attn(stg_model *m, const stg_cpu_attn *cpu) {
    if (!m) return fail(ST_EINVAL, "set_cpu_attn: NULL model");
    if (m->n_live > 0) return fail(ST_EINVAL, "set_cpu_attn: %d launched step(s) in flight", m->n_live);
    if (!cpu) {
        m->ha.cpu = stg_cpu_attn{};
        return ST_OK;
    }
    if (!cpu->attn_blocks || !cpu->last_error || !cpu->pool)
        return fail(ST_EINVAL, "set_cpu_attn: attn_blocks, last_error and pool are all needed");
    host_attn &ha = m->ha;
    CU(cudaSetDevice(m->device), "set_cpu_attn");
    if (!ha.sync.flags) CHECK(host_sync_alloc(ha.sync, m->d.n_layer, "set_cpu_attn: flags"));
    while (ha.ev.size() < (size_t)m->d.n_layer) {
        cudaEvent_t e = nullptr;
        CU(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "set_cpu_attn: events");
        ha.ev.push_back(e);
    }
    if (!ha.d_n) CHECK(dalloc(m, &ha.d_n, sizeof(int32_t)));
    for (cudaEvent_t &e : ha.te)
        if (!e) CU(cudaEventCreate(&e), "set_cpu_attn: events");
    ha.cpu = *cpu;
    return ST_OK;
}

static void host_attn_free_bufs(host_attn &ha) {
    for (void *p : {(void *)ha.h_q, (void *)ha.h_part, (void *)ha.h_up})
        if (p) cudaFreeHost(p);
    for (void *p : {(void *)ha.d_part, (void *)ha.d_bt, (void *)ha.d_pos})
        if (p) cudaFree(p);
    ha.h_q = ha.h_part = ha.d_part = nullptr, ha.h_up = ha.d_bt = ha.d_pos = nullptr;
    ha.cap_t = ha.cap_bt = 0;
}

static void host_attn_destroy(stg_model *m) {
    host_attn &ha = m->ha;
    host_attn_free_bufs(ha);
    host_sync_free(ha.sync);
    for (cudaEvent_t e : ha.ev) cudaEventDestroy(e);
    ha.ev.clear();
    for (cudaEvent_t &e : ha.te)
        if (e) cudaEventDestroy(e), e = nullptr;
}

/* Room for a step of T tokens and n_bt block-table entries (the stream synchronised before anything is freed). */
static stg_status host_attn_room(stg_model *m, int64_t T, int64_t n_bt) {
    host_attn &ha = m->ha;
    if (T <= ha.cap_t && n_bt <= ha.cap_bt) return ST_OK;
    CU(cudaStreamSynchronize(m->stream), "kv_host_attn buffers");
    const int64_t ct = std::max(T, ha.cap_t), cb = std::max(n_bt, 2 * ha.cap_bt);
    host_attn_free_bufs(ha);
    const int64_t H = m->d.n_head, hd = m->d.head_dim;
    void *p = nullptr;
    CU(cudaHostAlloc(&p, sizeof(float) * (size_t)(ct * m->q_dim), cudaHostAllocMapped | cudaHostAllocPortable),
       "kv_host_attn: pinned q");
    ha.h_q = (float *)p;
    CU(cudaHostAlloc(&p, sizeof(float) * (size_t)(ct * H * (2 + hd)), cudaHostAllocPortable), "kv_host_attn: partials");
    ha.h_part = (float *)p;
    CU(cudaHostAlloc(&p, sizeof(int32_t) * (size_t)(cb + ct), cudaHostAllocPortable), "kv_host_attn: tables");
    ha.h_up = (int32_t *)p;
    CU(cudaMalloc(&ha.d_part, sizeof(float) * (size_t)(ct * H * (2 + hd))), "kv_host_attn: partials");
    CU(cudaMalloc(&ha.d_bt, sizeof(int32_t) * (size_t)cb), "kv_host_attn: tables");
    CU(cudaMalloc(&ha.d_pos, sizeof(int32_t) * (size_t)ct), "kv_host_attn: tables");
    ha.cap_t = ct, ha.cap_bt = cb;
    return ST_OK;
}

/* Whether the step takes kv_host_attn (*take), and if so its lists and the device's tables in h_up (uploaded by
 * host_attn_upload). Blocks through kv->map (the step's physical ids: host ones from n_dev on); split: the step
 * takes the split kernel. A step takes it when no token writes a host-tier block (each one's last block in VRAM)
 * and the CPU's share (host_attn_share) rounds to some block: token t's CPU blocks are the first
 * round(share * n_host(t)) of its host blocks (whole blocks), the device's the others in order (VRAM and host,
 * those read in place or, kv_stream 0, renamed to their staging slots by step.cu), ending with the new key. */
static stg_status host_attn_plan(stg_model *m, const stg_kv *kv, const st_batch *b, int32_t mb, bool split,
                                 bool *take) {
    host_attn &ha = m->ha;
    *take = false;
    ha.now = ha.t_now = false;
    const st_model_desc &d = m->d;
    if (kv->n_host < 1 || !m->set.kv_host_attn || !ha.cpu.attn_blocks || !split || m->hy.on || d.kv_lora_rank > 0 ||
        d.n_swa > 0 || d.arch == ST_ARCH_GPT_OSS || m->q_dim != d.n_head * d.head_dim ||
        b->n_tokens > ATT_SPLIT_MAX_T)
        return ST_OK;
    const int form = host_attn_form(m);
    if (!ha.probed[form]) { /* outside any capture: the step's graph, if any, is captured after its plan */
        ha.dev_gbs[form] = form ? stage_probe_gbs(m, kv) : pcie_probe_gbs(m);
        ha.probed[form] = true;
    }
    const double share = host_attn_share(m);
    if (share <= 0.0) return ST_OK;
    const int32_t T = b->n_tokens, bs = kv->block_size;
    auto phys = [&](int32_t t, int32_t c) { /* the physical block of token t's column c (validate_batch checked it) */
        return kv->map[(size_t)b->block_tables[(int64_t)b->seq[t] * b->max_blocks + c]];
    };
    ha.blk_off.assign(1, 0), ha.blocks.clear(), ha.n_keys.assign((size_t)T, 0);
    int64_t n_gpu_host = 0; /* host blocks the device streams */
    for (int32_t t = 0; t < T; t++) {
        const int32_t last = b->pos[t] / bs;
        if (phys(t, last) >= kv->n_dev) return ST_OK; /* the step writes a host block: it streams */
        int32_t n_host = 0;
        for (int32_t c = 0; c < last; c++) n_host += phys(t, c) >= kv->n_dev;
        const int32_t n_cpu = std::min(n_host, (int32_t)lround(share * (double)n_host));
        for (int32_t c = 0, k = 0; c < last && k < n_cpu; c++)
            if (phys(t, c) >= kv->n_dev) ha.blocks.push_back(phys(t, c) - kv->n_dev), k++;
        ha.n_keys[(size_t)t] = n_cpu * bs;
        ha.blk_off.push_back((int32_t)ha.blocks.size());
        n_gpu_host += n_host - n_cpu;
    }
    if (ha.blocks.empty()) return ST_OK; /* the CPU's share holds no block: kv_host_attn 0's path */
    const int64_t n_bt = (int64_t)b->n_seqs * mb;
    CHECK(host_attn_room(m, T, n_bt));
    /* the device's tables: each token's blocks in order less the CPU's (its sequence's row; decode: one token a
     * row) */
    int32_t *bt = ha.h_up, *pos = ha.h_up + n_bt;
    for (int64_t i = 0; i < n_bt; i++) bt[i] = -1;
    for (int32_t t = 0; t < T; t++) {
        const int32_t last = b->pos[t] / bs, n_cpu = ha.n_keys[(size_t)t] / bs;
        int32_t *out = bt + (int64_t)b->seq[t] * mb, n = 0;
        for (int32_t c = 0, k = 0; c <= last; c++) {
            const bool host = phys(t, c) >= kv->n_dev;
            if (!host || k++ >= n_cpu) out[n++] = phys(t, c);
        }
        pos[t] = (n - 1) * bs + b->pos[t] % bs; /* the device's keys: n - 1 whole blocks and the last one's */
    }
    ha.n_bt = n_bt;
    if (++ha.seq == 0) ha.seq = 1; /* 0 is the flags' value before any step */
    ha.T = T, ha.now = true;
    ha.zmax = std::min(m->att_zmax, (int32_t)(ATT_SPLIT_MAX - 1));
    ha.bytes = (int64_t)ha.blocks.size() * kv_block_bytes(kv), ha.gpu_bytes = n_gpu_host * kv_block_bytes(kv);
    ha.share = (double)ha.blocks.size() / (double)(ha.blocks.size() + n_gpu_host), ha.t_cpu = ha.t_wait = 0.0;
    *take = true;
    return ST_OK;
}

/* The step's compacted tables and key counts to the device (queued with the step's own upload). */
static stg_status host_attn_upload(stg_model *m) {
    host_attn &ha = m->ha;
    CU(cudaMemcpyAsync(ha.d_bt, ha.h_up, sizeof(int32_t) * (size_t)ha.n_bt, cudaMemcpyHostToDevice, m->stream),
       "kv_host_attn: tables");
    CU(cudaMemcpyAsync(ha.d_pos, ha.h_up + ha.n_bt, sizeof(int32_t) * (size_t)ha.T, cudaMemcpyHostToDevice, m->stream),
       "kv_host_attn: tables");
    return ST_OK;
}

/* The CPU's work of layer il: wait for its q, attend the host-tier blocks, write the flag. No CUDA call from the
 * wait's end to the flag. */
static stg_status host_attn_layer(stg_model *m, const stg_kv *kv, int il) {
    host_attn &ha = m->ha;
    const double t0 = host_seconds();
    CHECK(host_sync_wait(ha.sync, il, ha.seq, ha.ev[(size_t)il], "kv_host_attn: q to the host"));
    const double t1 = host_seconds();
    const st_model_desc &d = m->d;
    const int64_t he = (int64_t)il * kv->host_elems;
    const bool q8 = kv->type == STG_KV_Q8_0;
    const void *k = q8 ? (const void *)(kv->hk8 + he) : (const void *)(kv->hk + he);
    const void *v = q8 ? (const void *)(kv->hv8 + he) : (const void *)(kv->hv + he);
    const uint16_t *ks = q8 ? (const uint16_t *)(kv->hks + he / 32) : nullptr;
    const uint16_t *vs = q8 ? (const uint16_t *)(kv->hvs + he / 32) : nullptr;
    const int64_t rows = (int64_t)ha.T * d.n_head;
    const int32_t rc = ha.cpu.attn_blocks(ha.cpu.pool, kv->type, k, v, ks, vs, kv->n_host, kv->block_size, d.head_dim,
                                          d.n_head, d.n_head_kv, ha.T, ha.h_q, ha.blk_off.data(), ha.blocks.data(),
                                          ha.n_keys.data(), ha.h_part, ha.h_part + 2 * rows);
    if (rc != ST_OK) {
        const char *msg = ha.cpu.last_error();
        return fail(rc, "layer %d: the CPU engine's attention over the host tier: %s", il, msg ? msg : "(no message)");
    }
    ha.t_wait += t1 - t0, ha.t_cpu += host_seconds() - t1;
    host_sync_signal(ha.sync, il, ha.seq, 0);
    return ST_OK;
}

/* The step's CPU thread: the layers in order, each once the queueing thread has queued its k_to_host; on an error
 * or an abandoned queue, every later flag written so that no wait queued for them blocks the stream. */
static void host_attn_run(stg_model *m, const stg_kv *kv, hybrid_worker *w) {
    int il = 0;
    if (cudaSetDevice(m->device) != cudaSuccess) {
        cudaGetLastError();
        w->rc = fail(ST_EINVAL, "kv_host_attn: the CPU thread could not select device %d", m->device);
    }
    for (; il < m->d.n_layer && w->rc == ST_OK; il++) {
        for (int spins = 1; w->queued.load(std::memory_order_acquire) <= il; spins++) {
            if (w->abort.load(std::memory_order_acquire)) break;
            if (spins % 64 == 0) std::this_thread::yield();
        }
        if (w->queued.load(std::memory_order_acquire) <= il) break; /* abandoned before this layer */
        w->rc = host_attn_layer(m, kv, il);
        if (w->rc != ST_OK) break;
    }
    if (w->rc != ST_OK) snprintf(w->err, sizeof w->err, "%s", stg_last_error());
    for (int j = il; j < m->d.n_layer; j++) host_sync_signal(m->ha.sync, j, m->ha.seq, 0);
}

/* The CPU thread of one kv_host_attn step: started before the layers are queued; finish() joins it and gives its
 * result; leaving scope without finish() (a failed queue) abandons the step first. */
struct host_attn_thread {
    stg_model *m;
    const stg_kv *kv;
    hybrid_worker w;
    std::thread th;
    host_attn_thread(stg_model *model, const stg_kv *cache) : m(model), kv(cache) {}
    host_attn_thread(const host_attn_thread &) = delete;
    host_attn_thread &operator=(const host_attn_thread &) = delete;
    stg_status start() {
        if (!m->ha.now) return ST_OK;
        try {
            th = std::thread(host_attn_run, m, kv, &w);
        } catch (...) {
            return fail(ST_ENOMEM, "kv_host_attn: the CPU thread did not start");
        }
        m->ha.worker = &w;
        return ST_OK;
    }
    stg_status finish() {
        if (!th.joinable()) return ST_OK;
        th.join();
        m->ha.worker = nullptr;
        if (w.rc != ST_OK) return fail(w.rc, "%s", w.err);
        return ST_OK;
    }
    ~host_attn_thread() {
        if (!th.joinable()) return;
        w.abort.store(true, std::memory_order_release);
        th.join();
        m->ha.worker = nullptr;
    }
};

/* Layer il's device side, after k_qkv_post: q to the host (the CPU thread may start on the layer from here). */
static stg_status host_attn_send(stg_model *m, int il, int32_t T, cudaStream_t st) {
    host_attn &ha = m->ha;
    launch_k(k_to_host, 1, 1024, 0, st, (const int32_t *)nullptr, (int32_t)0, (const float *)m->s.q,
             (int64_t)T * m->q_dim, (int32_t *)nullptr, ha.h_q, ha.sync.ready + il, ha.seq);
    LAUNCHED("kv_host_attn: q to the host");
    CU(cudaEventRecord(ha.ev[(size_t)il], st), "kv_host_attn: event");
    if (ha.worker) ha.worker->queued.store(il + 1, std::memory_order_release);
    return ST_OK;
}

/* After the split kernel (its partials in aa's): the wait for the CPU's flag, its partials copied in and placed as
 * each (token, head)'s last split. */
static stg_status host_attn_join(stg_model *m, int il, const attn_args &aa, int32_t T, cudaStream_t st) {
    host_attn &ha = m->ha;
    launch_k(k_wait_flag, 1, 1, 0, st, (const unsigned long long *)(ha.sync.flags + il), ha.seq, ha.d_n);
    LAUNCHED("kv_host_attn: wait for the CPU");
    const size_t n = sizeof(float) * (size_t)T * (size_t)m->d.n_head * (size_t)(2 + m->d.head_dim);
    CU(cudaMemcpyAsync(ha.d_part, ha.h_part, n, cudaMemcpyHostToDevice, st), "kv_host_attn: the CPU's partials");
    launch_k(k_host_part_place, dim3((unsigned)T, (unsigned)m->d.n_head), 128, 0, st, aa, (const float *)ha.d_part, T);
    LAUNCHED("kv_host_attn: place the CPU's partials");
    return ST_OK;
}
