/* Kernel variants (reference, AVX2, AVX-512): run-time selection of the best one the
 * CPU supports or a forced one, and the entry points that run one variant's kernel
 * directly (the kernel test harness and benchmarks). The kernels themselves live in
 * quants.c, kernels_*.c and attention.c and know nothing of this selection. */
#include <stdlib.h>
#include <time.h>

#include "internal.h"

static int32_t g_variant = ST_VARIANT_AUTO;

int32_t st_cpu_variants(void) {
    int32_t mask = 1 << ST_VARIANT_REF;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        mask |= 1 << ST_VARIANT_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && (mask & (1 << ST_VARIANT_AVX2)))
        mask |= 1 << ST_VARIANT_AVX512;
#endif
    return mask;
}

static int32_t resolve(int32_t variant) {
    if (variant != ST_VARIANT_AUTO) return variant;
    const int32_t mask = st_cpu_variants();
    if (mask & (1 << ST_VARIANT_AVX512)) return ST_VARIANT_AVX512;
    if (mask & (1 << ST_VARIANT_AVX2)) return ST_VARIANT_AVX2;
    return ST_VARIANT_REF;
}

static st_status check_variant(int32_t variant) {
    if (variant < ST_VARIANT_AUTO || variant > ST_VARIANT_AVX512)
        return st_fail(ST_EINVAL, "unknown kernel variant %d", variant);
    if (variant != ST_VARIANT_AUTO && !(st_cpu_variants() & (1 << variant)))
        return st_fail(ST_EUNSUPPORTED, "kernel variant %d is not supported by this CPU", variant);
    return ST_OK;
}

st_status st_set_variant(int32_t variant) {
    const st_status rc = check_variant(variant);
    if (rc == ST_OK) g_variant = variant;
    return rc;
}

int32_t st_get_variant(void) { return resolve(g_variant); }

static dot_q_fn pick_q(int32_t variant, int32_t type) {
    dot_q_fn f = NULL;
    if (variant == ST_VARIANT_AVX512) f = st_dot_q_avx512(type);
    else if (variant == ST_VARIANT_AVX2) f = st_dot_q_avx2(type);
    return f ? f : st_dot_q_ref(type);
}

static dot_f_fn pick_f(int32_t variant, int32_t type) {
    dot_f_fn f = NULL;
    if (variant == ST_VARIANT_AVX512) f = st_dot_f_avx512(type);
    else if (variant == ST_VARIANT_AVX2) f = st_dot_f_avx2(type);
    return f ? f : st_dot_f_ref(type);
}

static attn_fn attn_variant(int32_t variant) {
    const int32_t v = resolve(variant);
    attn_fn f = v == ST_VARIANT_AVX512 ? st_attn_avx512() : v == ST_VARIANT_AVX2 ? st_attn_avx2() : NULL;
    return f ? f : st_attn_ref();
}

attn_fn st_attn(void) { return attn_variant(g_variant); }

static attn_part_fn part_variant(int32_t variant) {
    const int32_t v = resolve(variant);
    attn_part_fn f = v == ST_VARIANT_AVX512 ? st_attn_part_avx512() : v == ST_VARIANT_AVX2 ? st_attn_part_avx2() : NULL;
    return f ? f : st_attn_part_ref();
}

attn_part_fn st_attn_part(void) { return part_variant(g_variant); }

/* The 8-bit cache's kernels: the AVX2 version on every SIMD variant (AVX-512 CPUs too). */
static attn_fn attn_q8_variant(int32_t variant) {
    const attn_fn f = resolve(variant) != ST_VARIANT_REF ? st_attn_q8_avx2() : NULL;
    return f ? f : st_attn_q8_ref();
}

attn_fn st_attn_q8(void) { return attn_q8_variant(g_variant); }

static attn_part_fn part_q8_variant(int32_t variant) {
    const attn_part_fn f = resolve(variant) != ST_VARIANT_REF ? st_attn_part_q8_avx2() : NULL;
    return f ? f : st_attn_part_q8_ref();
}

attn_part_fn st_attn_part_q8(void) { return part_q8_variant(g_variant); }

dot_q_fn st_dot_q(int32_t type) { return pick_q(resolve(g_variant), type); }

static quant_act_fn quant_variant(int32_t variant) {
    const quant_act_fn f = resolve(variant) != ST_VARIANT_REF ? st_quant_act_avx2() : NULL; /* AVX-512 CPUs run it too */
    return f ? f : st_quantize_act_row;
}

quant_act_fn st_quant_act(void) { return quant_variant(g_variant); }

static quant_act_k_fn quant_k_variant(int32_t variant) {
    const quant_act_k_fn f = resolve(variant) != ST_VARIANT_REF ? st_quant_act_k_avx2() : NULL; /* AVX-512 too */
    return f ? f : st_quantize_act_k_row;
}

quant_act_k_fn st_quant_act_k(void) { return quant_k_variant(g_variant); }

st_status st_quantize_act_k(int32_t variant, const float *x, int64_t n, int8_t *qs, float *d, int16_t *bsums) {
    const st_status rc = check_variant(variant);
    if (rc) return rc;
    if (!x || !qs || !d || !bsums || n <= 0 || n % QK_K)
        return st_fail(ST_EINVAL, "quantize_act_k: n=%lld must be a positive multiple of %d", (long long)n, QK_K);
    quant_k_variant(variant)(x, n, qs, d, bsums);
    return ST_OK;
}

/* The per-256 view of nt per-32 activation rows (qs, d): x = q * d per element, quantised per 256
 * by the reference quantiser into qk[nt * n], dk[nt * n/256], bk[nt * n/16]. */
static void k_view_from_blocks(const int8_t *qs, const float *d, int64_t n, int nt, int8_t *qk, float *dk,
                               int16_t *bk, float *x) {
    for (int t = 0; t < nt; t++) {
        const int8_t *q = qs + (size_t)t * (size_t)n;
        const float *dt = d + (size_t)t * (size_t)(n / QK);
        for (int64_t i = 0; i < n; i++) x[i] = (float)q[i] * dt[i / QK];
        st_quantize_act_k_row(x, n, qk + (size_t)t * (size_t)n, dk + (size_t)t * (size_t)(n / QK_K),
                              bk + (size_t)t * (size_t)(n / 16));
    }
}

static silu_mul_fn silu_variant(int32_t variant) {
    const silu_mul_fn f = resolve(variant) != ST_VARIANT_REF ? st_silu_mul_avx2() : NULL; /* AVX-512 CPUs too */
    return f ? f : st_silu_mul_ref;
}

silu_mul_fn st_silu_mul(void) { return silu_variant(g_variant); }

st_status st_silu_mul_variant(int32_t variant, const float *g, const float *u, float *h, int64_t n) {
    const st_status rc = check_variant(variant);
    if (rc) return rc;
    if (!g || !u || !h || n < 1) return st_fail(ST_EINVAL, "silu_mul_variant: bad arguments (n=%lld)", (long long)n);
    silu_variant(variant)(g, u, h, n);
    return ST_OK;
}

st_status st_quantize_act_variant(int32_t variant, const float *x, int64_t n, int8_t *qs, float *d, int32_t *sums) {
    const st_status rc = check_variant(variant);
    if (rc) return rc;
    if (!x || !qs || !d || !sums || n <= 0 || n % QK)
        return st_fail(ST_EINVAL, "quantize_act_variant: n=%lld must be a positive multiple of %d", (long long)n, QK);
    quant_variant(variant)(x, n, qs, d, sums, NULL, NULL);
    return ST_OK;
}
dot_f_fn st_dot_f(int32_t type) { return pick_f(resolve(g_variant), type); }

/* nr rows x nt tokens through the variant's kernel, building the derived activation views
 * exactly as the quantiser does. out[t * nr + r]. */
static st_status dot_q_block(const char *what, int32_t type, int32_t variant, const void *w, int32_t nr, int32_t nt,
                             int group_ok,
                             const int8_t *qs, const float *d, const int32_t *sums, int64_t n, float *out) {
    st_status rc = check_variant(variant);
    if (rc) return rc;
    /* a repacked type reads a whole group of 8 rows: only where the caller passes row blocks */
    if ((!st_type_supported(type) && !(group_ok && st_r8_plain(type) != type)) ||
        st_type_is_float(type))
        return st_fail(ST_EUNSUPPORTED, "%s: type %d is not a supported quantised type", what, type);
    if (!w || !qs || !d || !sums || !out || n <= 0 || n % st_type_block_elems(type) || nt < 1 || nt > ST_MAX_NT ||
        nr < 1 || nr > ST_ROW_BLOCK)
        return st_fail(ST_EINVAL, "%s: bad arguments (n=%lld nr=%d nt=%d)", what, (long long)n, nr, nt);
    if (n > ST_MAX_ROW) return st_fail(ST_EINVAL, "%s: n=%lld exceeds %d", what, (long long)n, ST_MAX_ROW);
    float *xs8 = malloc(sizeof(float) * (size_t)nt * (size_t)(n / 4));
    float *xs = malloc(sizeof(float) * (size_t)nt * (size_t)(n / QK));
    const int k8 = n % QK_K == 0;
    int8_t *qk = k8 ? malloc((size_t)nt * (size_t)n) : NULL;
    float *dk = k8 ? malloc(sizeof(float) * (size_t)nt * (size_t)(n / QK_K)) : NULL;
    int16_t *bk = k8 ? malloc(sizeof(int16_t) * (size_t)nt * (size_t)(n / 16)) : NULL;
    float *xf = k8 ? malloc(sizeof(float) * (size_t)n) : NULL;
    if (!xs8 || !xs || (k8 && (!qk || !dk || !bk || !xf))) {
        free(xs8), free(xs), free(qk), free(dk), free(bk), free(xf);
        return st_fail(ST_ENOMEM, "%s: out of memory", what);
    }
    if (k8) k_view_from_blocks(qs, d, n, nt, qk, dk, bk, xf);
    act_row rows[ST_MAX_NT];
    for (int32_t t = 0; t < nt; t++) {
        const float *dt = d + (size_t)t * (size_t)(n / QK);
        const int32_t *st = sums + (size_t)t * (size_t)(n / 16);
        float *x8 = xs8 + (size_t)t * (size_t)(n / 4), *x = xs + (size_t)t * (size_t)(n / QK);
        for (int64_t b = 0; b < n / QK; b++) {
            const float x0 = dt[b] * (float)st[2 * b], x1 = dt[b] * (float)st[2 * b + 1];
            for (int l = 0; l < 4; l++) x8[b * 8 + l] = x0, x8[b * 8 + 4 + l] = x1;
            x[b] = dt[b] * (float)(st[2 * b] + st[2 * b + 1]);
        }
        rows[t] = (act_row){qs + (size_t)t * (size_t)n, dt, st, x8, x, k8 ? qk + (size_t)t * (size_t)n : NULL,
                            k8 ? dk + (size_t)t * (size_t)(n / QK_K) : NULL,
                            k8 ? bk + (size_t)t * (size_t)(n / 16) : NULL};
    }
    float res[ST_MAX_NT * ST_ROW_BLOCK];
    pick_q(resolve(variant), type)(w, st_row_bytes(type, n), nr, n, nt, rows, res, ST_ROW_BLOCK);
    for (int32_t t = 0; t < nt; t++)
        for (int32_t r = 0; r < nr; r++) out[t * nr + r] = res[t * ST_ROW_BLOCK + r];
    free(xs8), free(xs), free(qk), free(dk), free(bk), free(xf);
    return ST_OK;
}

st_status st_vec_dot_q(int32_t type, int32_t variant, const void *w, const int8_t *qs, const float *d,
                       const int32_t *sums, int64_t n, float *out) {
    return dot_q_block("vec_dot_q", type, variant, w, 1, 1, 0, qs, d, sums, n, out);
}

st_status st_vec_dot_q_tokens(int32_t type, int32_t variant, const void *w, int32_t nt, const int8_t *qs,
                              const float *d, const int32_t *sums, int64_t n, float *out) {
    return dot_q_block("vec_dot_q_tokens", type, variant, w, 1, nt, 0, qs, d, sums, n, out);
}

st_status st_vec_dot_q_rows(int32_t type, int32_t variant, const void *w, int32_t nr, int32_t nt, const int8_t *qs,
                            const float *d, const int32_t *sums, int64_t n, float *out) {
    return dot_q_block("vec_dot_q_rows", type, variant, w, nr, nt, 1, qs, d, sums, n, out);
}

st_status st_vec_dot_f(int32_t type, int32_t variant, const void *w, const float *x, int64_t n, float *out) {
    st_status rc = check_variant(variant);
    if (rc) return rc;
    if (!st_type_is_float(type)) return st_fail(ST_EUNSUPPORTED, "vec_dot_f: type %d is not a float type", type);
    if (!w || !x || !out || n <= 0) return st_fail(ST_EINVAL, "vec_dot_f: bad arguments (n=%lld)", (long long)n);
    pick_f(resolve(variant), type)(w, x, n, out);
    return ST_OK;
}

st_status st_attention_kv(int32_t variant, const uint16_t *k, const uint16_t *v, const int32_t *block_table,
                          int32_t block_size, int32_t head_dim, int32_t v_dim, int32_t n_kv, int32_t kv_head,
                          const float *q, int32_t nq, int32_t p0, float *out) {
    if (!k || !v || !block_table || !q || !out) return st_fail(ST_EINVAL, "attention: NULL argument");
    if (block_size < ST_ATTN_TILE || block_size > ST_MAX_BLOCK_SIZE || block_size % ST_ATTN_TILE || head_dim < 16 ||
        head_dim > ST_MAX_HEAD_DIM || head_dim % 16 || v_dim < 16 || v_dim > head_dim || v_dim % 16 || n_kv < 1 ||
        n_kv > ST_MAX_HEADS || kv_head < 0 || kv_head >= n_kv || nq < 1 || nq > ST_ATTN_TILE || p0 < 0 ||
        p0 > INT32_MAX - nq)
        return st_fail(ST_EINVAL, "attention: bad shape (bs=%d hd=%d vd=%d n_kv=%d kvh=%d nq=%d p0=%d)", block_size,
                       head_dim, v_dim, n_kv, kv_head, nq, p0);
    const st_status rc = check_variant(variant);
    if (rc) return rc;
    const attn_fn fn = attn_variant(variant);
    float *scratch = malloc(sizeof(float) * st_attn_scratch_floats(head_dim, p0 + nq));
    if (!scratch) return st_fail(ST_ENOMEM, "attention: out of memory");
    const kv_view view = {k, v, block_table, block_size, head_dim, v_dim, n_kv, n_kv * v_dim, kv_head, INT32_MAX, NULL, NULL, NULL, NULL, NULL, NULL};
    fn(&view, q, head_dim, nq, p0, out, v_dim, scratch);
    free(scratch);
    return ST_OK;
}

st_status st_attention(int32_t variant, const uint16_t *k, const uint16_t *v, const int32_t *block_table,
                       int32_t block_size, int32_t head_dim, int32_t n_kv, int32_t kv_head, const float *q,
                       int32_t nq, int32_t p0, float *out) {
    return st_attention_kv(variant, k, v, block_table, block_size, head_dim, head_dim, n_kv, kv_head, q, nq, p0, out);
}

st_status st_attention_split_kv(int32_t variant, const uint16_t *k, const uint16_t *v, const int32_t *block_table,
                                int32_t block_size, int32_t head_dim, int32_t v_dim, int32_t n_kv, int32_t kv_head,
                                const float *q, int32_t nq, int32_t n_keys, int32_t chunk, const float *sink,
                                float *out) {
    if (!k || !v || !block_table || !q || !out) return st_fail(ST_EINVAL, "attention_split: NULL argument");
    if (block_size < ST_ATTN_TILE || block_size > ST_MAX_BLOCK_SIZE || block_size % ST_ATTN_TILE || head_dim < 16 ||
        head_dim > ST_MAX_HEAD_DIM || head_dim % 16 || v_dim < 16 || v_dim > head_dim || v_dim % 16 || n_kv < 1 ||
        n_kv > ST_MAX_HEADS || kv_head < 0 || kv_head >= n_kv || nq < 1 || nq > ST_MAX_HEADS || n_keys < 1 ||
        chunk < 16 || chunk % 16)
        return st_fail(ST_EINVAL,
                       "attention_split: bad shape (bs=%d hd=%d vd=%d n_kv=%d kvh=%d nq=%d keys=%d chunk=%d)",
                       block_size, head_dim, v_dim, n_kv, kv_head, nq, n_keys, chunk);
    const st_status rc = check_variant(variant);
    if (rc) return rc;
    const attn_part_fn fn = part_variant(variant);
    const int32_t n_chunks = (int32_t)(((int64_t)n_keys + chunk - 1) / chunk);
    const size_t stride = (size_t)nq * (size_t)(v_dim + 2);
    const int32_t span = chunk < n_keys ? chunk : n_keys;
    float *scratch = malloc(sizeof(float) * st_attn_scratch_floats(head_dim, span));
    float *parts = malloc(sizeof(float) * stride * (size_t)n_chunks);
    if (!scratch || !parts) {
        free(scratch), free(parts);
        return st_fail(ST_ENOMEM, "attention_split: out of memory");
    }
    const kv_view view = {k, v, block_table, block_size, head_dim, v_dim, n_kv, n_kv * v_dim, kv_head, INT32_MAX, NULL, NULL, NULL, NULL, NULL, NULL};
    for (int32_t c = 0; c < n_chunks; c++) {
        const int32_t j0 = c * chunk, j1 = n_keys - j0 < chunk ? n_keys : j0 + chunk;
        fn(&view, q, head_dim, nq, j0, j1, parts + (size_t)c * stride, scratch);
    }
    st_attn_combine(parts, n_chunks, stride, nq, v_dim, sink, out, v_dim);
    free(scratch), free(parts);
    return ST_OK;
}

st_status st_attention_split(int32_t variant, const uint16_t *k, const uint16_t *v, const int32_t *block_table,
                             int32_t block_size, int32_t head_dim, int32_t n_kv, int32_t kv_head, const float *q,
                             int32_t nq, int32_t n_keys, int32_t chunk, const float *sink, float *out) {
    return st_attention_split_kv(variant, k, v, block_table, block_size, head_dim, head_dim, n_kv, kv_head, q, nq,
                                 n_keys, chunk, sink, out);
}

st_status st_set_attn_split(int32_t mode) {
    if (mode != ST_SPLIT_AUTO && mode != ST_SPLIT_OFF && (mode < 16 || mode % 16))
        return st_fail(ST_EINVAL, "attention split mode %d: 0 (auto), 1 (off) or a chunk of n >= 16 keys, n %% 16 == 0",
                       mode);
    st_attn_split_set_mode(mode);
    return ST_OK;
}

int32_t st_get_attn_split(void) { return st_attn_split_mode(); }

st_status st_attn_split_plan(int32_t n_keys, int32_t n_threads, int32_t n_kv, int32_t *chunk) {
    if (!chunk || n_keys < 1 || n_threads < 1 || n_kv < 1 || n_kv > ST_MAX_HEADS)
        return st_fail(ST_EINVAL, "attn_split_plan: bad arguments (keys=%d threads=%d n_kv=%d)", n_keys, n_threads,
                       n_kv);
    *chunk = st_attn_split_chunk(n_keys, n_threads, n_kv);
    return ST_OK;
}

static double thread_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

st_status st_kernel_rate(int32_t type, int32_t variant, int64_t n, int32_t nt, double seconds, double *gmac_s) {
    st_status rc = check_variant(variant);
    if (rc) return rc;
    /* the repacked types (the engine runs every Q4_1 / Q8_0 tensor of 8k rows as these) from random plain rows */
    const int32_t plain = st_r8_plain(type);
    if (!st_type_supported(plain) || st_type_is_float(plain))
        return st_fail(ST_EUNSUPPORTED, "kernel_rate: type %d is not a supported quantised type", type);
    if (!gmac_s || n <= 0 || n > ST_MAX_ROW || n % st_type_block_elems(type) || nt < 1 || nt > ST_MAX_NT ||
        !(seconds > 0.0 && seconds <= 60.0))
        return st_fail(ST_EINVAL, "kernel_rate: bad arguments (n=%lld nt=%d)", (long long)n, nt);
    const size_t rb = st_row_bytes(type, n);
    uint8_t *w = malloc(rb * ST_ROW_BLOCK);
    int8_t *q = malloc((size_t)n * (size_t)nt);
    float *d = malloc(sizeof(float) * (size_t)(n / QK) * (size_t)nt);
    float *xs8 = malloc(sizeof(float) * (size_t)(n / 4) * (size_t)nt), *xs = malloc(sizeof(float) * (size_t)(n / QK) * (size_t)nt);
    int32_t *s = malloc(sizeof(int32_t) * (size_t)(n / 16) * (size_t)nt);
    float *x = malloc(sizeof(float) * (size_t)n);
    const int k8 = n % QK_K == 0;
    int8_t *qk = malloc((size_t)n * (size_t)nt);
    float *dk = malloc(sizeof(float) * (size_t)(n / QK_K + 1) * (size_t)nt);
    int16_t *bk = malloc(sizeof(int16_t) * (size_t)(n / 16) * (size_t)nt);
    if (!w || !q || !d || !xs8 || !xs || !s || !x || !qk || !dk || !bk) {
        free(w), free(q), free(d), free(xs8), free(xs), free(s), free(x), free(qk), free(dk), free(bk);
        return st_fail(ST_ENOMEM, "kernel_rate: out of memory");
    }
    uint32_t r = 12345u;
    for (size_t i = 0; i < rb * ST_ROW_BLOCK; i++) r = r * 1664525u + 1013904223u, w[i] = (uint8_t)(r >> 24);
    for (size_t i = 1; i < rb * ST_ROW_BLOCK; i += 2) w[i] &= 0x3b; /* f16 fields wherever they fall stay finite */
    if (type == ST_TYPE_MXFP4) /* E8M0 exponents near 2^-5 (random ones overflow or go subnormal: slow) */
        for (size_t i = 0; i < rb * ST_ROW_BLOCK; i += 17) w[i] = (uint8_t)(119 + i % 7);
    if (plain != type) {
        uint8_t *g = malloc(rb * ST_ROW_BLOCK);
        if (!g) {
            free(w), free(q), free(d), free(xs8), free(xs), free(s), free(x);
            return st_fail(ST_ENOMEM, "kernel_rate: out of memory");
        }
        rc = st_repack_rows(plain, w, g, ST_ROW_BLOCK, n);
        free(w);
        w = g;
        if (rc) {
            free(w), free(q), free(d), free(xs8), free(xs), free(s), free(x);
            return rc;
        }
    }
    act_row rows[ST_MAX_NT];
    for (int32_t t = 0; t < nt; t++) {
        for (int64_t i = 0; i < n; i++) r = r * 1664525u + 1013904223u, x[i] = (float)(r >> 8) / 16777216.0f - 0.5f;
        const size_t o = (size_t)t;
        st_quantize_act_row(x, n, q + o * (size_t)n, d + o * (size_t)(n / QK), s + o * (size_t)(n / 16),
                            xs8 + o * (size_t)(n / 4), xs + o * (size_t)(n / QK));
        rows[t] = (act_row){q + o * (size_t)n, d + o * (size_t)(n / QK), s + o * (size_t)(n / 16),
                            xs8 + o * (size_t)(n / 4), xs + o * (size_t)(n / QK), NULL, NULL, NULL};
        if (k8) {
            st_quantize_act_k_row(x, n, qk + o * (size_t)n, dk + o * (size_t)(n / QK_K), bk + o * (size_t)(n / 16));
            rows[t].qk = qk + o * (size_t)n, rows[t].dk = dk + o * (size_t)(n / QK_K), rows[t].bk = bk + o * (size_t)(n / 16);
        }
    }
    const dot_q_fn f = pick_q(resolve(variant), type);
    float out[ST_MAX_NT * ST_ROW_BLOCK];
    /* The clock is read once per batch of calls, the batch doubled until it takes a 64th of the
     * time asked: reading the thread CPU clock is a system call (1.3-1.6 us on the Zen 3 VM), as
     * long as a whole 8 x 8192 one-token call, and reading it after every call had cut the
     * reported rate by a third. */
    int64_t calls = 0, batch = 1;
    const double t0 = thread_cpu_s();
    double dt = 0.0;
    do {
        for (int64_t i = 0; i < batch; i++) f(w, rb, ST_ROW_BLOCK, n, nt, rows, out, ST_ROW_BLOCK);
        calls += batch;
        dt = thread_cpu_s() - t0;
        if (dt < seconds / 64.0) batch *= 2;
    } while (dt < seconds);
    *gmac_s = (double)calls * ST_ROW_BLOCK * (double)n * nt / dt / 1e9;
    free(w), free(q), free(d), free(xs8), free(xs), free(s), free(x), free(qk), free(dk), free(bk);
    return ST_OK;
}

st_status st_attention_q8(int32_t variant, const int8_t *k8, const uint16_t *ks, const int8_t *v8, const uint16_t *vs,
                          const int32_t *block_table, int32_t block_size, int32_t head_dim, int32_t v_dim,
                          int32_t n_kv, int32_t kv_head, const float *q, int32_t nq, int32_t p0, int32_t chunk,
                          float *out) {
    if (!k8 || !ks || !v8 || !vs || !block_table || !q || !out) return st_fail(ST_EINVAL, "attention_q8: NULL argument");
    if (block_size < ST_ATTN_TILE || block_size > ST_MAX_BLOCK_SIZE || block_size % ST_ATTN_TILE || head_dim < 32 ||
        head_dim > ST_MAX_HEAD_DIM || head_dim % 32 || v_dim < 32 || v_dim > head_dim || v_dim % 32 || n_kv < 1 ||
        n_kv > ST_MAX_HEADS || kv_head < 0 || kv_head >= n_kv || nq < 1 || p0 < 0 || p0 > INT32_MAX - nq ||
        (chunk == 0 && nq > ST_ATTN_TILE) || (chunk != 0 && (nq > ST_MAX_HEADS || chunk < 16 || chunk % 16)))
        return st_fail(ST_EINVAL, "attention_q8: bad shape (bs=%d hd=%d vd=%d n_kv=%d kvh=%d nq=%d p0=%d chunk=%d)",
                       block_size, head_dim, v_dim, n_kv, kv_head, nq, p0, chunk);
    const st_status rc = check_variant(variant);
    if (rc) return rc;
    const kv_view view = {NULL, NULL, block_table, block_size, head_dim, v_dim, n_kv, n_kv * v_dim, kv_head,
                          INT32_MAX, NULL, NULL, k8, v8, (const f16_t *)ks, (const f16_t *)vs};
    const int32_t n_keys = p0 + (chunk ? 1 : nq);
    float *scratch = malloc(sizeof(float) * st_attn_scratch_floats(head_dim, n_keys));
    if (!scratch) return st_fail(ST_ENOMEM, "attention_q8: out of memory");
    if (!chunk) {
        attn_q8_variant(variant)(&view, q, head_dim, nq, p0, out, v_dim, scratch);
        free(scratch);
        return ST_OK;
    }
    const int32_t n_chunks = (int32_t)(((int64_t)n_keys + chunk - 1) / chunk);
    const size_t stride = (size_t)nq * (size_t)(v_dim + 2);
    float *parts = malloc(sizeof(float) * stride * (size_t)n_chunks);
    if (!parts) {
        free(scratch);
        return st_fail(ST_ENOMEM, "attention_q8: out of memory");
    }
    const attn_part_fn fn = part_q8_variant(variant);
    for (int32_t c = 0; c < n_chunks; c++) {
        const int32_t j0 = c * chunk, j1 = n_keys - j0 < chunk ? n_keys : j0 + chunk;
        fn(&view, q, head_dim, nq, j0, j1, parts + (size_t)c * stride, scratch);
    }
    st_attn_combine(parts, n_chunks, stride, nq, v_dim, NULL, out, v_dim);
    free(scratch), free(parts);
    return ST_OK;
}
