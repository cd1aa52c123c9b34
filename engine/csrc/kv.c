/* The paged KV cache (F16), one allocation for K and one for V covering every layer.
 *
 * K is slot-minor inside a block ([n_kv][head_dim][block_size]) so that 16 keys' values
 * of one dimension are one vector load in attention; V is row-major per slot
 * ([block_size][v_dim]). The heads are the model's as cached (st_model.c_*): for MLA one
 * latent row per token, its values the latent's first kv_lora_rank dimensions. Which blocks a sequence owns is decided in Python (block
 * tables); C only checks that every block index it is handed lies inside the cache.
 *
 * A tiered cache (st_kv_create_tiered) has two allocations: a hot pool (on the GPU engine, the
 * device's blocks) and a cold pool (pinned host RAM there; host memory here as well). Block ids in
 * the tables are logical; the cache maps each to a physical block in either pool, and st_kv_swap
 * moves blocks between pools (copying their bytes) without changing any id the tables hold. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* One pool's K and V arrays of n blocks (all layers): NULL on overflow or failure. */
static int pool_alloc(const st_kv *kv, int32_t n, f16_t **k, f16_t **v) {
    uint64_t nk = 0, nv = 0, bytes = 0;
    const uint64_t per = (uint64_t)kv->n_layer * (uint64_t)kv->block_size;
    if (__builtin_mul_overflow(per * (uint64_t)kv->k_dim, (uint64_t)n, &nk) ||
        __builtin_mul_overflow(per * (uint64_t)kv->v_dim, (uint64_t)n, &nv) ||
        __builtin_mul_overflow(nk + nv, sizeof(f16_t), &bytes) || bytes > (uint64_t)PTRDIFF_MAX)
        return 0;
    *k = calloc((size_t)nk, sizeof(f16_t));
    *v = calloc((size_t)nv, sizeof(f16_t));
    return *k && *v;
}

/* The 8-bit arrays of an untiered cache: int8 values at the F16 layout's indices, one scale per 32. */
static int q8_alloc(st_kv *kv) {
    const size_t per = (size_t)kv->n_layer * (size_t)kv->n_blocks * (size_t)kv->block_size;
    const size_t nk = per * (size_t)kv->k_dim, nv = per * (size_t)kv->v_dim;
    if (nk / (size_t)kv->k_dim != per || nv / (size_t)kv->v_dim != per) return 0;
    kv->k8 = malloc(nk), kv->v8 = malloc(nv);
    kv->ks = calloc(nk / 32, sizeof(f16_t)), kv->vs = calloc(nv / 32, sizeof(f16_t));
    if (kv->k8) memset(kv->k8, 0, nk);
    if (kv->v8) memset(kv->v8, 0, nv);
    return kv->k8 && kv->v8 && kv->ks && kv->vs;
}

st_status st_kv_create_tiered(const st_model *m, int32_t n_hot, int32_t n_cold, int32_t block_size, int32_t type,
                              st_kv **out) {
    if (!m || !out) return st_fail(ST_EINVAL, "kv_create: NULL argument");
    *out = NULL;
    if (n_hot < 1 || n_cold < 0 || n_hot > INT32_MAX - n_cold || block_size < ST_ATTN_TILE ||
        block_size > ST_MAX_BLOCK_SIZE || block_size % ST_ATTN_TILE)
        return st_fail(ST_EINVAL,
                       "kv_create: n_hot=%d n_cold=%d block_size=%d invalid (n_hot >= 1, n_cold >= 0; block size: a "
                       "multiple of %d, at most %d)",
                       n_hot, n_cold, block_size, ST_ATTN_TILE, ST_MAX_BLOCK_SIZE);
    if (type != ST_KV_F16 && type != ST_KV_Q8_0) return st_fail(ST_EINVAL, "kv_create: KV type %d unknown", type);
    if (type == ST_KV_Q8_0) {
        int sinks = 0;
        for (int il = 0; il < m->d.n_layer; il++) sinks |= m->layers[il].sinks.data != NULL;
        if (n_cold > 0 || m->c_hd_k % 32 || m->c_hd_v % 32 || m->d.n_swa > 0 || sinks)
            return st_fail(ST_EINVAL,
                           "kv_create: the 8-bit KV cache needs an untiered cache, head dimensions that are multiples "
                           "of 32 (K %d, V %d) and no sliding-window or sink layers",
                           m->c_hd_k, m->c_hd_v);
    }
    st_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return st_fail(ST_ENOMEM, "kv_create: out of memory");
    kv->type = type;
    kv->n_hot = n_hot;
    kv->n_cold = n_cold;
    kv->n_blocks = n_hot + n_cold;
    kv->block_size = block_size;
    kv->n_layer = m->d.n_layer;
    kv->n_kv = m->c_n_kv;
    kv->head_dim = m->c_hd_k;
    kv->head_dim_v = m->c_hd_v;
    const uint64_t k_dim = (uint64_t)m->c_n_kv * (uint64_t)m->c_hd_k, v_dim = (uint64_t)m->c_n_kv * (uint64_t)m->c_hd_v;
    kv->k_dim = (int32_t)k_dim;
    kv->v_dim = (int32_t)v_dim;
    int ok = type == ST_KV_Q8_0 ? q8_alloc(kv) : pool_alloc(kv, n_hot, &kv->k, &kv->v);
    if (ok && n_cold > 0) {
        ok = pool_alloc(kv, n_cold, &kv->k_cold, &kv->v_cold);
        kv->map = ok ? malloc(sizeof(int32_t) * (size_t)kv->n_blocks) : NULL;
        ok = kv->map != NULL;
        for (int32_t i = 0; ok && i < kv->n_blocks; i++) kv->map[i] = i;
    }
    if (!ok) {
        st_kv_destroy(kv);
        return st_fail(ST_ENOMEM, "kv_create: cannot allocate %d + %d blocks of %d tokens of KV cache", n_hot, n_cold,
                       block_size);
    }
    *out = kv;
    return ST_OK;
}

st_status st_kv_create(const st_model *m, int32_t n_blocks, int32_t block_size, st_kv **out) {
    return st_kv_create_tiered(m, n_blocks, 0, block_size, ST_KV_F16, out);
}

void st_kv_destroy(st_kv *kv) {
    if (!kv) return;
    free(kv->k);
    free(kv->v);
    free(kv->k_cold);
    free(kv->v_cold);
    free(kv->map);
    free(kv->bt_phys);
    free(kv->k8);
    free(kv->v8);
    free(kv->ks);
    free(kv->vs);
    free(kv);
}

/* Swaps n elements of a and b (both directions) or copies a -> b (one). */
static void move_elems(f16_t *a, f16_t *b, size_t n, int both) {
    if (!both) {
        memcpy(b, a, n * sizeof(f16_t));
        return;
    }
    for (size_t i = 0; i < n; i++) {
        const f16_t t = a[i];
        a[i] = b[i];
        b[i] = t;
    }
}

st_status st_kv_swap(st_kv *kv, int32_t a, int32_t b, int32_t copy_a, int32_t copy_b, uint64_t *bytes) {
    if (!kv) return st_fail(ST_EINVAL, "kv_swap: NULL cache");
    if (!kv->map) return st_fail(ST_EINVAL, "kv_swap: the cache is not tiered");
    if (a < 0 || a >= kv->n_blocks || b < 0 || b >= kv->n_blocks)
        return st_fail(ST_ERANGE, "kv_swap: blocks %d, %d outside [0, %d)", a, b, kv->n_blocks);
    const int32_t pa = kv->map[a], pb = kv->map[b];
    const size_t nk = (size_t)kv->block_size * (size_t)kv->k_dim, nv = (size_t)kv->block_size * (size_t)kv->v_dim;
    uint64_t moved = 0;
    if (a != b && (copy_a || copy_b)) {
        /* copy_a only: a's contents go to pb (b's are dropped); copy_b only: b's go to pa; both: swapped */
        const int both = copy_a && copy_b;
        const int32_t src = copy_a ? pa : pb, dst = copy_a ? pb : pa;
        for (int l = 0; l < kv->n_layer; l++) {
            move_elems(kv_k_block(kv, l, src), kv_k_block(kv, l, dst), nk, both);
            move_elems(kv_v_row(kv, l, src, 0), kv_v_row(kv, l, dst, 0), nv, both);
        }
        moved = (uint64_t)(both ? 2 : 1) * (uint64_t)kv->n_layer * (uint64_t)(nk + nv) * sizeof(f16_t);
    }
    kv->map[a] = pb;
    kv->map[b] = pa;
    if (bytes) *bytes = moved;
    return ST_OK;
}

/* Q8_0's rule on 32 floats: d = max|x| / 127, q = round(x / d) (x * (1/d), as ggml), d kept as F16. */
static f16_t q8_group(const float *x, int64_t stride, int8_t *q, int64_t q_stride) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i * stride]));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < 32; i++) q[i * q_stride] = (int8_t)roundf(x[i * stride] * id);
    return f32_to_f16(d);
}

void st_kv_q8_group(const float *x, int8_t *q, uint16_t *d) { *d = q8_group(x, 1, q, 1); }

void st_kv_store(st_kv *kv, int layer, int32_t block, int32_t slot, const float *k, const float *v) {
    if (kv->type == ST_KV_Q8_0) { /* untiered: physical = logical */
        const size_t bs = (size_t)kv->block_size, row = ((size_t)layer * (size_t)kv->n_blocks + (size_t)block) * bs;
        int8_t *kb = kv->k8 + row * (size_t)kv->k_dim; /* [k_dim][bs]: element (i, slot) at i * bs + slot */
        f16_t *ksb = kv->ks + row * (size_t)(kv->k_dim / 32);
        for (int g = 0; g < kv->k_dim / 32; g++)
            ksb[(size_t)g * bs + (size_t)slot] = q8_group(k + 32 * g, 1, kb + (size_t)(32 * g) * bs + (size_t)slot, (int64_t)bs);
        const size_t vrow = row + (size_t)slot;
        for (int g = 0; g < kv->v_dim / 32; g++)
            kv->vs[vrow * (size_t)(kv->v_dim / 32) + (size_t)g] =
                q8_group(v + 32 * g, 1, kv->v8 + vrow * (size_t)kv->v_dim + (size_t)(32 * g), 1);
        return;
    }
    f16_t *kb = kv_k_block(kv, layer, block), *vr = kv_v_row(kv, layer, block, slot);
    for (int i = 0; i < kv->k_dim; i++) kb[(size_t)i * (size_t)kv->block_size + (size_t)slot] = f32_to_f16(k[i]);
    for (int i = 0; i < kv->v_dim; i++) vr[i] = f32_to_f16(v[i]);
}
