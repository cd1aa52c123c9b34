/* The IQ quant types on the CPU: dequantisation (the only implementation, gguf-py's order of
 * float operations) and the generic reference dot kernels the SIMD variants are checked
 * against. Layouts and the integer form of a weight: quants_iq.h; codebooks: iq_grids.h. */
#include "quants_iq.h"
#include "iq_grids.h"

int32_t st_iq_block_bytes(int32_t type) {
    switch (type) {
    case ST_TYPE_IQ2_XXS: return sizeof(blk_iq2_xxs);
    case ST_TYPE_IQ2_XS: return sizeof(blk_iq2_xs);
    case ST_TYPE_IQ2_S: return sizeof(blk_iq2_s);
    case ST_TYPE_IQ3_XXS: return sizeof(blk_iq3_xxs);
    case ST_TYPE_IQ3_S: return sizeof(blk_iq3_s);
    default: return 0;
    }
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint16_t rd16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* One block decoded to its parts: per element the grid magnitude g and whether it is negated,
 * per 16 elements the raw 4-bit scale field ls (both halves of a 32 share it where the type has
 * one per 32), and d. */
typedef struct {
    uint8_t g[QK_K], neg[QK_K], ls[QK_K / 16];
    float d;
} iq_parts;

static inline void put8(iq_parts *p, int e, uint64_t grid, uint8_t signs) {
    for (int k = 0; k < 8; k++) p->g[e + k] = (uint8_t)(grid >> (8 * k)), p->neg[e + k] = (signs >> k) & 1;
}

static inline void put4(iq_parts *p, int e, uint32_t grid, uint8_t signs, int shift) {
    for (int k = 0; k < 4; k++) p->g[e + k] = (uint8_t)(grid >> (8 * k)), p->neg[e + k] = (signs >> (shift + k)) & 1;
}

static void iq_decode(int32_t type, const uint8_t *b, iq_parts *p) {
    p->d = f16_to_f32(rd16(b));
    switch (type) {
    case ST_TYPE_IQ2_XXS: {
        const blk_iq2_xxs *x = (const blk_iq2_xxs *)b;
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = (const uint8_t *)(x->qs + 4 * ib);
            const uint32_t aux = rd32(q + 4);
            p->ls[2 * ib] = p->ls[2 * ib + 1] = (uint8_t)(aux >> 28);
            for (int j = 0; j < 4; j++) put8(p, 32 * ib + 8 * j, iq2xxs_grid[q[j]], iq_ksigns[(aux >> (7 * j)) & 127]);
        }
        break;
    }
    case ST_TYPE_IQ2_XS: {
        const blk_iq2_xs *x = (const blk_iq2_xs *)b;
        for (int ib = 0; ib < 8; ib++) {
            p->ls[2 * ib] = x->scales[ib] & 0xF, p->ls[2 * ib + 1] = x->scales[ib] >> 4;
            for (int j = 0; j < 4; j++) {
                const uint16_t v = rd16((const uint8_t *)(x->qs + 4 * ib + j));
                put8(p, 32 * ib + 8 * j, iq2xs_grid[v & 511], iq_ksigns[v >> 9]);
            }
        }
        break;
    }
    case ST_TYPE_IQ2_S: {
        const blk_iq2_s *x = (const blk_iq2_s *)b;
        const uint8_t *signs = x->qs + QK_K / 8;
        for (int ib = 0; ib < 8; ib++) {
            p->ls[2 * ib] = x->scales[ib] & 0xF, p->ls[2 * ib + 1] = x->scales[ib] >> 4;
            for (int j = 0; j < 4; j++) {
                const int idx = x->qs[4 * ib + j] | (((x->qh[ib] >> (2 * j)) & 3) << 8);
                put8(p, 32 * ib + 8 * j, iq2s_grid[idx], signs[4 * ib + j]);
            }
        }
        break;
    }
    case ST_TYPE_IQ3_XXS: {
        const blk_iq3_xxs *x = (const blk_iq3_xxs *)b;
        for (int ib = 0; ib < 8; ib++) {
            const uint32_t aux = rd32(x->qs + QK_K / 4 + 4 * ib);
            p->ls[2 * ib] = p->ls[2 * ib + 1] = (uint8_t)(aux >> 28);
            for (int j = 0; j < 4; j++) {
                const uint8_t s = iq_ksigns[(aux >> (7 * j)) & 127];
                put4(p, 32 * ib + 8 * j, iq3xxs_grid[x->qs[8 * ib + 2 * j]], s, 0);
                put4(p, 32 * ib + 8 * j + 4, iq3xxs_grid[x->qs[8 * ib + 2 * j + 1]], s, 4);
            }
        }
        break;
    }
    case ST_TYPE_IQ3_S: {
        const blk_iq3_s *x = (const blk_iq3_s *)b;
        for (int ib = 0; ib < 8; ib++) {
            p->ls[2 * ib] = p->ls[2 * ib + 1] = (x->scales[ib / 2] >> (4 * (ib % 2))) & 0xF;
            for (int j = 0; j < 8; j++) {
                const int idx = x->qs[8 * ib + j] | (((x->qh[ib] >> j) & 1) << 8);
                put4(p, 32 * ib + 4 * j, iq3s_grid[idx], x->signs[4 * ib + j / 2], 4 * (j % 2));
            }
        }
        break;
    }
    default: memset(p, 0, sizeof *p);
    }
}

/* gguf-py's scale of a 16-element group: numpy computes it in float32 in this order. */
static inline float iq_db(int32_t type, float d, uint8_t ls) {
    switch (type) {
    case ST_TYPE_IQ3_XXS: return d * (0.5f + (float)ls) * 0.5f;
    case ST_TYPE_IQ3_S: return d * (float)(1 + 2 * ls);
    default: return d * (0.5f + (float)ls) * 0.25f; /* the IQ2 types */
    }
}

void st_iq_dequant_block(int32_t type, const void *blk, float *y) {
    iq_parts p;
    iq_decode(type, blk, &p);
    for (int s = 0; s < QK_K / 16; s++) {
        const float db = iq_db(type, p.d, p.ls[s]);
        for (int l = 0; l < 16; l++) {
            const int e = 16 * s + l;
            y[e] = db * (float)p.g[e] * (p.neg[e] ? -1.0f : 1.0f);
        }
    }
}

/* F of quants_iq.h: d * F * k * g * sign is the weight. */
static inline float iq_f(int32_t type) {
    return type == ST_TYPE_IQ3_S ? 1.0f : type == ST_TYPE_IQ3_XXS ? 0.25f : 0.125f;
}

/* One row against one token on the per-256 activation view (act_row.qk, scale dk per super-block):
 * the exact integer sum of the super-block, sum_ib sum_h k_h * sum_{16} (+-g) * qa, then one
 * float step acc += dk * ((d * F) * isum) (|isum| <= 256 * 62 * 127 * 31 < 2^26). */
static void dot_iq_k8(int32_t type, const uint8_t *w, const int8_t *a, const float *dk, int64_t n, float *out) {
    const size_t bb = (size_t)st_iq_block_bytes(type);
    const float f = iq_f(type);
    float acc = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        iq_parts p;
        iq_decode(type, w + (size_t)i * bb, &p);
        int32_t isum = 0;
        for (int s16 = 0; s16 < QK_K / 16; s16++) {
            int32_t part = 0;
            for (int l = 0; l < 16; l++) {
                const int e = 16 * s16 + l;
                const int v = p.neg[e] ? -(int)p.g[e] : (int)p.g[e];
                part += v * a[i * QK_K + e];
            }
            isum += (2 * p.ls[s16] + 1) * part;
        }
        acc += dk[i] * ((p.d * f) * (float)isum);
    }
    *out = acc;
}

#define DEF_IQ_REF(NAME, TYPE)                                                                                      \
    static void NAME(const void *w, size_t row_bytes, int nr, int64_t n, int nt, const act_row *a, float *out,     \
                     int64_t ldo) {                                                                                 \
        for (int r = 0; r < nr; r++)                                                                                \
            for (int t = 0; t < nt; t++)                                                                            \
                dot_iq_k8(TYPE, (const uint8_t *)w + (size_t)r * row_bytes, a[t].qk, a[t].dk, n, &out[t * ldo + r]); \
    }
DEF_IQ_REF(dot_iq2_xxs_ref, ST_TYPE_IQ2_XXS)
DEF_IQ_REF(dot_iq2_xs_ref, ST_TYPE_IQ2_XS)
DEF_IQ_REF(dot_iq2_s_ref, ST_TYPE_IQ2_S)
DEF_IQ_REF(dot_iq3_xxs_ref, ST_TYPE_IQ3_XXS)
DEF_IQ_REF(dot_iq3_s_ref, ST_TYPE_IQ3_S)

dot_q_fn st_dot_q_ref_iq(int32_t type) {
    switch (type) {
    case ST_TYPE_IQ2_XXS: return dot_iq2_xxs_ref;
    case ST_TYPE_IQ2_XS: return dot_iq2_xs_ref;
    case ST_TYPE_IQ2_S: return dot_iq2_s_ref;
    case ST_TYPE_IQ3_XXS: return dot_iq3_xxs_ref;
    case ST_TYPE_IQ3_S: return dot_iq3_s_ref;
    default: return NULL;
    }
}
