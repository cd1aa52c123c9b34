/* The paged KV cache (F16), one allocation for K and one for V covering every layer.
 *
 * K is slot-minor inside a block ([n_kv][head_dim][block_size]) so that 16 keys' values
 * of one dimension are one vector load in attention; V is row-major per slot
 * ([block_size][v_dim]). The heads are the model's as cached (st_model.c_*): for MLA one
 * latent row per token, its values the latent's first kv_lora_rank dimensions. Which blocks a sequence owns is decided in Python (block
 * tables); C only checks that every block index it is handed lies inside the cache. */
#include <stdlib.h>

#include "internal.h"

st_status st_kv_create(const st_model *m, int32_t n_blocks, int32_t block_size, st_kv **out) {
    if (!m || !out) return st_fail(ST_EINVAL, "kv_create: NULL argument");
    *out = NULL;
    if (n_blocks < 1 || block_size < ST_ATTN_TILE || block_size > ST_MAX_BLOCK_SIZE || block_size % ST_ATTN_TILE)
        return st_fail(ST_EINVAL, "kv_create: n_blocks=%d block_size=%d invalid (block size: a multiple of %d, at most %d)",
                       n_blocks, block_size, ST_ATTN_TILE, ST_MAX_BLOCK_SIZE);
    /* elements = layers * blocks * block_size * (K and V row), checked for overflow (the first
     * three are bounded, so only a huge n_blocks can get here) */
    const uint64_t k_dim = (uint64_t)m->c_n_kv * (uint64_t)m->c_hd_k, v_dim = (uint64_t)m->c_n_kv * (uint64_t)m->c_hd_v;
    uint64_t nk = 0, nv = 0, bytes = 0;
    if (__builtin_mul_overflow((uint64_t)m->d.n_layer * (uint64_t)block_size * k_dim, (uint64_t)n_blocks, &nk) ||
        __builtin_mul_overflow((uint64_t)m->d.n_layer * (uint64_t)block_size * v_dim, (uint64_t)n_blocks, &nv) ||
        __builtin_mul_overflow(nk + nv, sizeof(f16_t), &bytes) || bytes > (uint64_t)PTRDIFF_MAX)
        return st_fail(ST_ENOMEM, "kv_create: %d blocks of %d tokens do not fit in memory", n_blocks, block_size);
    st_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return st_fail(ST_ENOMEM, "kv_create: out of memory");
    kv->n_blocks = n_blocks;
    kv->block_size = block_size;
    kv->n_layer = m->d.n_layer;
    kv->n_kv = m->c_n_kv;
    kv->head_dim = m->c_hd_k;
    kv->head_dim_v = m->c_hd_v;
    kv->k_dim = (int32_t)k_dim;
    kv->v_dim = (int32_t)v_dim;
    kv->k = calloc((size_t)nk, sizeof(f16_t));
    kv->v = calloc((size_t)nv, sizeof(f16_t));
    if (!kv->k || !kv->v) {
        st_kv_destroy(kv);
        return st_fail(ST_ENOMEM, "kv_create: cannot allocate %llu bytes of KV cache", (unsigned long long)bytes);
    }
    *out = kv;
    return ST_OK;
}

void st_kv_destroy(st_kv *kv) {
    if (!kv) return;
    free(kv->k);
    free(kv->v);
    free(kv);
}

void st_kv_store(st_kv *kv, int layer, int32_t block, int32_t slot, const float *k, const float *v) {
    const size_t kbase = kv_offset_k(kv, layer, block), off = kv_offset_v(kv, layer, block, slot);
    for (int i = 0; i < kv->k_dim; i++) kv->k[kbase + (size_t)i * (size_t)kv->block_size + (size_t)slot] = f32_to_f16(k[i]);
    for (int i = 0; i < kv->v_dim; i++) kv->v[off + i] = f32_to_f16(v[i]);
}
