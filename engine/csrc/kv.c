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

st_status st_kv_create_tiered(const st_model *m, int32_t n_hot, int32_t n_cold, int32_t block_size, st_kv **out) {
    if (!m || !out) return st_fail(ST_EINVAL, "kv_create: NULL argument");
    *out = NULL;
    if (n_hot < 1 || n_cold < 0 || n_hot > INT32_MAX - n_cold || block_size < ST_ATTN_TILE ||
        block_size > ST_MAX_BLOCK_SIZE || block_size % ST_ATTN_TILE)
        return st_fail(ST_EINVAL,
                       "kv_create: n_hot=%d n_cold=%d block_size=%d invalid (n_hot >= 1, n_cold >= 0; block size: a "
                       "multiple of %d, at most %d)",
                       n_hot, n_cold, block_size, ST_ATTN_TILE, ST_MAX_BLOCK_SIZE);
    st_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return st_fail(ST_ENOMEM, "kv_create: out of memory");
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
    int ok = pool_alloc(kv, n_hot, &kv->k, &kv->v);
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
    return st_kv_create_tiered(m, n_blocks, 0, block_size, out);
}

void st_kv_destroy(st_kv *kv) {
    if (!kv) return;
    free(kv->k);
    free(kv->v);
    free(kv->k_cold);
    free(kv->v_cold);
    free(kv->map);
    free(kv->bt_phys);
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

void st_kv_store(st_kv *kv, int layer, int32_t block, int32_t slot, const float *k, const float *v) {
    f16_t *kb = kv_k_block(kv, layer, block), *vr = kv_v_row(kv, layer, block, slot);
    for (int i = 0; i < kv->k_dim; i++) kb[(size_t)i * (size_t)kv->block_size + (size_t)slot] = f32_to_f16(k[i]);
    for (int i = 0; i < kv->v_dim; i++) vr[i] = f32_to_f16(v[i]);
}
