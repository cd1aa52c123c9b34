/* Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4: type table, dequantisation (bit for bit gguf-py's numpy
 * reference: the same float operations in the same order, e.g. d * sc first, then * q - m) and
 * the generic reference dot kernels the SIMD variants are checked against. The layouts are in
 * quants_lowbit.h. */
#include "quants_lowbit.h"

int st_lowbit_type(int32_t type) { return st_lowbit_block_elems(type) > 0; }

int32_t st_lowbit_block_elems(int32_t type) {
    switch (type) {
    case ST_TYPE_Q2_K: case ST_TYPE_Q3_K: case ST_TYPE_IQ4_XS: return QK_K;
    case ST_TYPE_IQ4_NL: case ST_TYPE_MXFP4: return QK;
    default: return 0;
    }
}

int32_t st_lowbit_block_bytes(int32_t type) {
    switch (type) {
    case ST_TYPE_Q2_K: return sizeof(blk_q2_k);
    case ST_TYPE_Q3_K: return sizeof(blk_q3_k);
    case ST_TYPE_IQ4_NL: return sizeof(blk_iq4_nl);
    case ST_TYPE_IQ4_XS: return sizeof(blk_iq4_xs);
    case ST_TYPE_MXFP4: return sizeof(blk_mxfp4);
    default: return 0;
    }
}

/* ---- dequantisation ---- */

/* Q2_K / Q3_K low two bits of element e: byte e % 32 of the 32-byte chunk e / 128, bits
 * 2 * ((e % 128) / 32). */
static inline int k_low2(const uint8_t *qs, int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3; }

/* Q2_K's codes and the scale part of its groups (g16_fn): the scale in the low nibble of scales[g], the
 * minimum in the high one. */
static inline int q2k_code(const void *blk, int e) { return k_low2(((const blk_q2_k *)blk)->qs, e); }
static inline int q2k_scale(const void *blk, int g) { return ((const blk_q2_k *)blk)->scales[g] & 0xF; }

static void deq_q2_k(const blk_q2_k *b, float *y) {
    const float d = f16_to_f32(b->d), dmin = f16_to_f32(b->dmin);
    for (int g = 0; g < QK_K / 16; g++) {
        const float dl = d * (float)(b->scales[g] & 0xF), ml = dmin * (float)(b->scales[g] >> 4);
        for (int l = 0; l < 16; l++) y[16 * g + l] = dl * (float)k_low2(b->qs, 16 * g + l) - ml;
    }
}

/* Q3_K code e (g16_fn): low two bits as Q2_K, minus 4 unless bit e / 32 of hmask[e % 32] is set; and group
 * g's scale (q3k_scale). */
static inline int q3k_value(const void *blk, int e) {
    const blk_q3_k *b = blk;
    return k_low2(b->qs, e) - (((b->hmask[e % 32] >> (e / 32)) & 1) ? 0 : 4);
}

static inline int q3k_group_scale(const void *blk, int g) { return q3k_scale(((const blk_q3_k *)blk)->scales, g); }

static void deq_q3_k(const blk_q3_k *b, float *y) { g16_dequant(b, q3k_value, q3k_group_scale, f16_to_f32(b->d), y); }

/* 16 bytes of 4-bit indices: element l in the low nibble of byte l, element 16 + l in the high. */
static inline void deq_nibbles(const uint8_t *qs, const int8_t *table, float d, float *y) {
    for (int l = 0; l < 16; l++) {
        y[l] = d * (float)table[qs[l] & 0xF];
        y[16 + l] = d * (float)table[qs[l] >> 4];
    }
}

static void deq_iq4_xs(const blk_iq4_xs *b, float *y) {
    const float d = f16_to_f32(b->d);
    for (int ib = 0; ib < QK_K / 32; ib++)
        deq_nibbles(b->qs + 16 * ib, kvalues_iq4nl, d * (float)iq4xs_scale(b, ib), y + 32 * ib);
}

void st_lowbit_dequantize_block(int32_t type, const void *blk, float *y) {
    switch (type) {
    case ST_TYPE_Q2_K: deq_q2_k(blk, y); break;
    case ST_TYPE_Q3_K: deq_q3_k(blk, y); break;
    case ST_TYPE_IQ4_NL: {
        const blk_iq4_nl *b = blk;
        deq_nibbles(b->qs, kvalues_iq4nl, f16_to_f32(b->d), y);
        break;
    }
    case ST_TYPE_IQ4_XS: deq_iq4_xs(blk, y); break;
    case ST_TYPE_MXFP4: {
        const blk_mxfp4 *b = blk;
        deq_nibbles(b->qs, kvalues_mxfp4, e8m0_half(b->e), y);
        break;
    }
    default: break;
    }
}

/* ---- reference dot kernels ----
 * Q2_K, Q3_K and IQ4_XS read the per-256 view (act_row.qk, scale dk per super-block, int16 sums bk per
 * 16): the exact integer sums of the super-block (g: its 16 groups of 16), then one float step:
 *   Q2_K:  dk * (d * sum_g sc_g * sum(q a) - dmin * sum_g m_g * bsum_g)
 *   Q3_K:  dk * (d * sum_g (sc_g - 32) * sum(q a))
 *   IQ4_XS: dk * (d * sum_j (ls_j - 32) * sum(v a))   (j: its 8 sub-blocks of 32)
 * The others, per 32-element activation block b (scale dx = d[b], int8 codes a):
 *   IQ4_NL, MXFP4:  s * dx * sum(v a), s the block's float scale. */

static void dot_q2_k_k8(const void *w, const int8_t *a, const float *dk, const int16_t *bk, int64_t n, float *out) {
    const blk_q2_k *b = w;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const int32_t isum = g16_sum(&b[i], q2k_code, q2k_scale, a + i * QK_K);
        int32_t msum = 0;
        for (int g = 0; g < QK_K / 16; g++) msum += (b[i].scales[g] >> 4) * bk[16 * i + g];
        acc += dk[i] * (f16_to_f32(b[i].d) * (float)isum - f16_to_f32(b[i].dmin) * (float)msum);
    }
    *out = acc;
}

static void dot_q3_k_k8(const void *w, const int8_t *a, const float *dk, const int16_t *bk, int64_t n, float *out) {
    const blk_q3_k *b = w;
    (void)bk;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++)
        acc += dk[i] * (f16_to_f32(b[i].d) * (float)g16_sum(&b[i], q3k_value, q3k_group_scale, a + i * QK_K));
    *out = acc;
}

/* The integer sum of one 32-block of nibble indices into `table` against a[0..31]. */
static inline int32_t nibble_sum(const uint8_t *qs, const int8_t *table, const int8_t *a) {
    int32_t isum = 0;
    for (int l = 0; l < 16; l++) isum += table[qs[l] & 0xF] * a[l] + table[qs[l] >> 4] * a[16 + l];
    return isum;
}

static void dot_iq4_nl_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_iq4_nl *b = w;
    (void)s;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK; i++)
        acc += f16_to_f32(b[i].d) * d[i] * (float)nibble_sum(b[i].qs, kvalues_iq4nl, a + i * QK);
    *out = acc;
}

static void dot_iq4_xs_k8(const void *w, const int8_t *a, const float *dk, const int16_t *bk, int64_t n, float *out) {
    const blk_iq4_xs *b = w;
    (void)bk;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int32_t isum = 0;
        for (int j = 0; j < 8; j++) isum += iq4xs_scale(&b[i], j) * nibble_sum(b[i].qs + 16 * j, kvalues_iq4nl, a + i * QK_K + QK * j);
        acc += dk[i] * (f16_to_f32(b[i].d) * (float)isum);
    }
    *out = acc;
}

static void dot_mxfp4_one(const void *w, const int8_t *a, const float *d, const int32_t *s, int64_t n, float *out) {
    const blk_mxfp4 *b = w;
    (void)s;
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK; i++)
        acc += e8m0_half(b[i].e) * d[i] * (float)nibble_sum(b[i].qs, kvalues_mxfp4, a + i * QK);
    *out = acc;
}

DEF_REF_MULTI_K8(q2_k)
DEF_REF_MULTI_K8(q3_k)
DEF_REF_MULTI(iq4_nl)
DEF_REF_MULTI_K8(iq4_xs)
DEF_REF_MULTI(mxfp4)

dot_q_fn st_dot_q_ref_lowbit(int32_t type) {
    switch (type) {
    case ST_TYPE_Q2_K: return dot_q2_k_ref;
    case ST_TYPE_Q3_K: return dot_q3_k_ref;
    case ST_TYPE_IQ4_NL: return dot_iq4_nl_ref;
    case ST_TYPE_IQ4_XS: return dot_iq4_xs_ref;
    case ST_TYPE_MXFP4: return dot_mxfp4_ref;
    default: return NULL;
    }
}
