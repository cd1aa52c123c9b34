/* The KV cache on the device: the paged arrays (F16, or the 8-bit cache's values and scales), and the tiers: a pool
 * of blocks in VRAM and one in pinned, mapped host memory behind one logical -> physical map, the moves between
 * them (stg_kv_swap) and the staging of a prefill-form step's host blocks into VRAM (docs/engine.md, "KV tiers on
 * the GPU"). */
#include "model.cuh"

/* ------------------------------------------------------------------ KV cache */

/* The 8-bit cache's conditions on a model (why, for the message; true where it runs): decode takes the split kernel
 * (att_split_ok, head_dim 64 or 128: its scales' 4- / 8-byte copies) and prefill the tensor-core kernel
 * (att_mma_tokens), both for every sequence; K and V heads of one size (no latent attention); every layer full
 * (kv.c's 8-bit cache takes no sliding window either). */
static bool kv_q8_ok(const st_model_desc &d, const char **why) {
    *why = nullptr;
    if (d.kv_lora_rank > 0) *why = "latent attention (kv_lora_rank)";
    else if (d.n_swa > 0) *why = "sliding-window layers";
    else if (d.head_dim != 64 && d.head_dim != 128) *why = "head_dim other than 64 or 128";
    else if (!att_split_ok(d.n_head, d.n_head_kv, d.head_dim) || !att_mma_tokens(d.n_head, d.n_head_kv, d.head_dim, 64))
        *why = "query heads per kv head not dividing 16 or above 8";
    return *why == nullptr;
}

/* The bytes of a cache of n values per K (and V): both F16 or 8-bit with their scales; latent attention one F16 row
 * per token (K only). */
static int64_t kv_need(const stg_model *m, int32_t type, int64_t n) {
    if (type == STG_KV_Q8_0) return 2 * (n + n / 32 * (int64_t)sizeof(__half));
    return (m->d.kv_lora_rank > 0 ? 1 : 2) * n * (int64_t)sizeof(__half);
}

static void kv_free(stg_kv *kv) {
    cudaFree(kv->k);
    cudaFree(kv->v);
    cudaFree(kv->k8);
    cudaFree(kv->v8);
    cudaFree(kv->ks);
    cudaFree(kv->vs);
    cudaFree(kv->stage);
    cudaFree(kv->d_list);
    for (void *p : {(void *)kv->hk, (void *)kv->hv, (void *)kv->hk8, (void *)kv->hv8, (void *)kv->hks, (void *)kv->hvs})
        if (p) cudaFreeHost(p);
    delete kv;
}

/* One host-tier array of `bytes`: pinned, mapped (the kernels read it over PCIe through its UVA address, which on
 * every 64-bit CUDA platform is the host pointer itself), zeroed as the device arrays are. */
template <class T> static bool host_tier_alloc(T **out, size_t bytes) {
    void *p = nullptr, *dp = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) return false;
    *out = (T *)p;
    if (cudaHostGetDevicePointer(&dp, p, 0) != cudaSuccess || dp != p) return false;
    memset(p, 0, bytes);
    return true;
}

extern "C" stg_status stg_kv_create_tiered(stg_model *m, int32_t n_dev, int32_t n_host, int32_t block_size,
                                           int32_t type, stg_kv **out) {
    if (!m || !out) return fail(ST_EINVAL, "kv_create: NULL argument");
    *out = nullptr;
    if (n_dev < 1 || n_host < 0 || n_dev > INT32_MAX - n_host || block_size < 16 || block_size > 4096 ||
        block_size % 16)
        return fail(ST_EINVAL,
                    "kv_create: n_dev=%d n_host=%d block_size=%d invalid (n_dev >= 1, n_host >= 0; block size: a "
                    "multiple of 16)",
                    n_dev, n_host, block_size);
    if (type != STG_KV_F16 && type != STG_KV_Q8_0) return fail(ST_EINVAL, "kv_create: KV type %d unknown", type);
    const char *why = nullptr;
    if (type == STG_KV_Q8_0 && !kv_q8_ok(m->d, &why))
        return fail(ST_EUNSUPPORTED, "kv_create: the 8-bit KV cache on the GPU does not take this model: %s", why);
    if (type == STG_KV_Q8_0) CHECK(kv_q8_device_check(m->d.head_dim, m->smem_optin, "kv_create"));
    if (n_host > 0 && m->d.kv_lora_rank > 0)
        return fail(ST_EUNSUPPORTED, "kv_create: KV tiers on the GPU do not take latent attention (kv_lora_rank) yet");
    CU(cudaSetDevice(m->device), "kv_create");
    stg_kv *kv = new stg_kv();
    kv->m = m;
    kv->n_blocks = n_dev + n_host, kv->block_size = block_size, kv->n_layer = m->d.n_layer, kv->kv_dim = m->kv_dim;
    kv->type = type;
    kv->n_dev = n_dev, kv->n_host = n_host;
    kv->layer_elems = (int64_t)n_dev * block_size * m->kv_dim;
    kv->host_elems = (int64_t)n_host * block_size * m->kv_dim;
    const size_t n = (size_t)kv->layer_elems * (size_t)kv->n_layer;
    bool ok;
    if (type == STG_KV_Q8_0) {
        ok = cudaMalloc(&kv->k8, n) == cudaSuccess && cudaMalloc(&kv->v8, n) == cudaSuccess &&
             cudaMalloc(&kv->ks, n / 32 * sizeof(__half)) == cudaSuccess &&
             cudaMalloc(&kv->vs, n / 32 * sizeof(__half)) == cudaSuccess;
    } else if (m->d.kv_lora_rank > 0) { /* latent attention: one row per token in k (mla.cu) */
        ok = cudaMalloc(&kv->k, n * sizeof(__half)) == cudaSuccess;
    } else {
        ok = cudaMalloc(&kv->k, n * sizeof(__half)) == cudaSuccess && cudaMalloc(&kv->v, n * sizeof(__half)) == cudaSuccess;
    }
    if (!ok) {
        cudaGetLastError();
        const int64_t want = kv_need(m, type, (int64_t)n);
        kv_free(kv);
        return fail(ST_ENOMEM, "kv_create: cannot allocate %lld bytes of KV cache in VRAM", (long long)want);
    }
    /* zeroed so a stray read of an unwritten slot is finite, as on the CPU (calloc) */
    if (type == STG_KV_Q8_0)
        ok = cudaMemset(kv->k8, 0, n) == cudaSuccess && cudaMemset(kv->v8, 0, n) == cudaSuccess &&
             cudaMemset(kv->ks, 0, n / 32 * sizeof(__half)) == cudaSuccess &&
             cudaMemset(kv->vs, 0, n / 32 * sizeof(__half)) == cudaSuccess;
    else
        ok = cudaMemset(kv->k, 0, n * sizeof(__half)) == cudaSuccess &&
             (!kv->v || cudaMemset(kv->v, 0, n * sizeof(__half)) == cudaSuccess);
    if (!ok) {
        kv_free(kv);
        return fail(ST_EINVAL, "kv_create: cannot clear the KV cache");
    }
    if (n_host > 0) {
        const size_t nh = (size_t)kv->host_elems * (size_t)kv->n_layer;
        ok = type == STG_KV_Q8_0 ? host_tier_alloc(&kv->hk8, nh) && host_tier_alloc(&kv->hv8, nh) &&
                                       host_tier_alloc(&kv->hks, nh / 32 * sizeof(__half)) &&
                                       host_tier_alloc(&kv->hvs, nh / 32 * sizeof(__half))
                                 : host_tier_alloc(&kv->hk, nh * sizeof(__half)) &&
                                       host_tier_alloc(&kv->hv, nh * sizeof(__half));
        if (!ok) {
            cudaGetLastError();
            kv_free(kv);
            return fail(ST_ENOMEM, "kv_create: cannot allocate %d blocks of KV cache in pinned, mapped host memory",
                        n_host);
        }
        kv->map.resize((size_t)kv->n_blocks);
        for (int32_t i = 0; i < kv->n_blocks; i++) kv->map[(size_t)i] = i;
        if (cudaMalloc(&kv->d_list, sizeof(int32_t) * 4 * (size_t)n_host) != cudaSuccess) {
            cudaGetLastError();
            kv_free(kv);
            return fail(ST_ENOMEM, "kv_create: cannot allocate the host tier's staging list");
        }
    }
    *out = kv;
    return ST_OK;
}

extern "C" stg_status stg_kv_create_typed(stg_model *m, int32_t n_blocks, int32_t block_size, int32_t type,
                                          stg_kv **out) {
    return stg_kv_create_tiered(m, n_blocks, 0, block_size, type, out);
}

extern "C" stg_status stg_kv_create(stg_model *m, int32_t n_blocks, int32_t block_size, stg_kv **out) {
    return stg_kv_create_typed(m, n_blocks, block_size, STG_KV_F16, out);
}

extern "C" void stg_kv_destroy(stg_kv *kv) {
    if (!kv) return;
    cudaSetDevice(kv->m->device);
    cudaStreamSynchronize(kv->m->stream);
    drop_graphs(kv->m); /* they point into this cache */
    kv_free(kv);
}

extern "C" int64_t stg_kv_bytes(const stg_kv *kv) {
    if (!kv) return 0;
    return kv_need(kv->m, kv->type, kv->layer_elems * kv->n_layer);
}

extern "C" int64_t stg_kv_host_bytes(const stg_kv *kv) {
    if (!kv) return 0;
    const int64_t n = kv->host_elems * kv->n_layer;
    return kv->type == STG_KV_Q8_0 ? 2 * (n + n / 32 * (int64_t)sizeof(__half)) : 2 * n * (int64_t)sizeof(__half);
}

extern "C" int64_t stg_kv_stage_bytes(const stg_kv *kv) {
    if (!kv) return 0;
    const int64_t blk = (int64_t)kv->block_size * kv->kv_dim;
    const int64_t n = kv->type == STG_KV_Q8_0 ? 2 * (blk + blk / 32 * (int64_t)sizeof(__half)) : 2 * blk * (int64_t)sizeof(__half);
    return n * kv->stage_cap;
}

/* Bytes of one block, every layer's K and V (and their scales): a move's and a host read's unit. */
static int64_t kv_block_bytes(const stg_kv *kv) {
    const int64_t n = (int64_t)kv->block_size * kv->kv_dim * kv->n_layer;
    return kv->type == STG_KV_Q8_0 ? 2 * (n + n / 32 * (int64_t)sizeof(__half)) : 2 * n * (int64_t)sizeof(__half);
}

/* A tier move: physical block src's bytes into dst (both: the two exchanged) for every layer (grid x) and array
 * (grid y), each block's address through kv_blk, 16 bytes a thread at a time. */
struct kv_move_args {
    unsigned char *dev[4], *host[4];
    int64_t per[4], dev_layer[4], host_layer[4]; /* bytes: a block, a layer's device and host arrays */
    int32_t n_dev, src, dst, both;
};
__global__ void k_kv_move(kv_move_args a) {
    const int l = blockIdx.x, i = blockIdx.y;
    unsigned char *d = a.dev[i] + (int64_t)l * a.dev_layer[i], *h = a.host[i] + (int64_t)l * a.host_layer[i];
    uint4 *x = (uint4 *)kv_blk(d, h, a.src, a.n_dev, a.per[i]), *y = (uint4 *)kv_blk(d, h, a.dst, a.n_dev, a.per[i]);
    for (int64_t j = threadIdx.x; j < a.per[i] / 16; j += blockDim.x) {
        const uint4 u = x[j], w = y[j];
        y[j] = u;
        if (a.both) x[j] = w;
    }
}

/* The arrays of a cache (F16: K, V; Q8_0: K, V values, K, V scales): device and host bases, bytes a block of one
 * layer, bytes a layer of each pool. Returns how many. */
static int kv_arrays(const stg_kv *kv, unsigned char **dev, unsigned char **host, int64_t *per, int64_t *dev_layer,
                     int64_t *host_layer) {
    const bool q8 = kv->type == STG_KV_Q8_0;
    unsigned char *dv[4] = {(unsigned char *)(q8 ? (void *)kv->k8 : (void *)kv->k),
                            (unsigned char *)(q8 ? (void *)kv->v8 : (void *)kv->v), (unsigned char *)kv->ks,
                            (unsigned char *)kv->vs};
    unsigned char *hv[4] = {(unsigned char *)(q8 ? (void *)kv->hk8 : (void *)kv->hk),
                            (unsigned char *)(q8 ? (void *)kv->hv8 : (void *)kv->hv), (unsigned char *)kv->hks,
                            (unsigned char *)kv->hvs};
    const int64_t val = q8 ? 1 : (int64_t)sizeof(__half), blk = (int64_t)kv->block_size * kv->kv_dim;
    const int n = q8 ? 4 : 2;
    for (int i = 0; i < n; i++) {
        const int64_t esz = i < 2 ? val : (int64_t)sizeof(__half), div = i < 2 ? 1 : 32;
        dev[i] = dv[i], host[i] = hv[i];
        per[i] = blk / div * esz, dev_layer[i] = kv->layer_elems / div * esz, host_layer[i] = kv->host_elems / div * esz;
    }
    return n;
}

/* Staging's copies of one layer: list pairs (slot, host block), grid (pairs, arrays); dir 0 gathers host blocks into
 * their slots, 1 writes slots back to their host blocks. */
struct kv_stage_args {
    unsigned char *host[4], *stage[4]; /* the layer's host arrays; the slots of each array */
    int64_t per[4];
    const int32_t *list;
    int32_t dir;
};
__global__ void k_kv_stage(kv_stage_args a) {
    const int i = blockIdx.y;
    const int64_t slot = a.list[2 * blockIdx.x], hb = a.list[2 * blockIdx.x + 1];
    uint4 *h = (uint4 *)(a.host[i] + hb * a.per[i]), *s = (uint4 *)(a.stage[i] + slot * a.per[i]);
    uint4 *src = a.dir ? s : h, *dst = a.dir ? h : s;
    for (int64_t j = threadIdx.x; j < a.per[i] / 16; j += blockDim.x) dst[j] = src[j];
}

/* Queues layer il's gathers (dir 0) or write-backs (dir 1) of the step being queued (kv->st_n / st_wb). */
static stg_status kv_stage_layer(stg_kv *kv, int il, int dir, cudaStream_t st) {
    const int32_t n = dir ? kv->st_wb : kv->st_n;
    if (n < 1) return ST_OK;
    unsigned char *dev[4], *host[4];
    int64_t per[4], dl[4], hl[4];
    const int na = kv_arrays(kv, dev, host, per, dl, hl);
    kv_stage_args a = {};
    for (int i = 0; i < na; i++)
        a.host[i] = host[i] + (int64_t)il * hl[i], a.stage[i] = kv->stage + kv->stage_off[i], a.per[i] = per[i];
    a.list = kv->d_list + (dir ? 2 * kv->st_n : 0), a.dir = dir;
    k_kv_stage<<<dim3((unsigned)n, (unsigned)na), 256, 0, st>>>(a);
    CU(cudaGetLastError(), "KV staging");
    return ST_OK;
}

/* Room for n staging slots (at most n_host): grows by doubling, after the steps in flight (which read the old). */
static stg_status kv_stage_room(stg_kv *kv, int32_t n) {
    if (n <= kv->stage_cap) return ST_OK;
    unsigned char *dev[4], *host[4];
    int64_t per[4], dl[4], hl[4];
    const int na = kv_arrays(kv, dev, host, per, dl, hl);
    const int32_t cap = std::min(kv->n_host, std::max(n, 2 * kv->stage_cap));
    CU(cudaStreamSynchronize(kv->m->stream), "KV staging");
    cudaFree(kv->stage);
    kv->stage = nullptr, kv->stage_cap = 0;
    int64_t off = 0;
    for (int i = 0; i < na; i++) kv->stage_off[i] = off, off += per[i] * cap;
    if (cudaMalloc(&kv->stage, (size_t)off) != cudaSuccess) {
        cudaGetLastError();
        return fail(ST_ENOMEM, "forward: cannot allocate %lld bytes of VRAM to stage %d host-tier KV blocks",
                    (long long)off, cap);
    }
    kv->stage_cap = cap;
    return ST_OK;
}

extern "C" stg_status stg_kv_swap(stg_kv *kv, int32_t a, int32_t b, int32_t copy_a, int32_t copy_b,
                                  uint64_t *bytes) {
    if (!kv) return fail(ST_EINVAL, "kv_swap: NULL cache");
    if (bytes) *bytes = 0;
    if (kv->n_host < 1) return fail(ST_EINVAL, "kv_swap: the cache is not tiered");
    if (a < 0 || a >= kv->n_blocks || b < 0 || b >= kv->n_blocks)
        return fail(ST_ERANGE, "kv_swap: blocks %d, %d outside [0, %d)", a, b, kv->n_blocks);
    const int32_t pa = kv->map[(size_t)a], pb = kv->map[(size_t)b];
    uint64_t moved = 0;
    if (a != b && (copy_a || copy_b)) {
        /* copy_a only: a's contents go to pb (b's are dropped); copy_b only: b's go to pa; both: exchanged. Queued
         * on the model's stream: after every step already queued (which read the old homes through the tables
         * they uploaded), before every later one (whose tables step.cu maps through the new map) */
        CU(cudaSetDevice(kv->m->device), "kv_swap");
        kv_move_args m = {};
        int64_t per[4];
        const int n_arr = kv_arrays(kv, m.dev, m.host, per, m.dev_layer, m.host_layer);
        for (int i = 0; i < n_arr; i++) m.per[i] = per[i];
        m.n_dev = kv->n_dev, m.src = copy_a ? pa : pb, m.dst = copy_a ? pb : pa, m.both = copy_a && copy_b;
        k_kv_move<<<dim3((unsigned)kv->n_layer, (unsigned)n_arr), 256, 0, kv->m->stream>>>(m);
        CU(cudaGetLastError(), "kv_swap");
        moved = (uint64_t)(m.both ? 2 : 1) * (uint64_t)kv_block_bytes(kv);
    }
    kv->map[(size_t)a] = pb;
    kv->map[(size_t)b] = pa;
    if (bytes) *bytes = moved;
    return ST_OK;
}
