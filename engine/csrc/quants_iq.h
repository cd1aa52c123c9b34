/* The IQ quant types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S): block layouts exactly as in GGUF
 * files and the entry points quants.c and the SIMD variants reach them through.
 *
 * Every IQ type is a 256-element super-block with one f16 scale d. Its weights are codebook
 * ("grid") entries of 8 (IQ2) or 4 (IQ3) unsigned magnitudes, each group of 8 elements with its
 * own signs, times a small integer scale per 32 (IQ2_XXS, IQ3_XXS, IQ3_S) or per 16 (IQ2_XS,
 * IQ2_S) elements. Written as integers: w = d * F * k * g * sign with g the grid byte, k the odd
 * integer scale below and F a power of two per type:
 *     IQ2_XXS, IQ2_XS, IQ2_S  k = 2 * ls + 1, F = 1/8   (ls: 4-bit field)
 *     IQ3_XXS                 k = 2 * ls + 1, F = 1/4
 *     IQ3_S                   k = 2 * ls + 1, F = 1
 * so a dot with 8-bit activations is d * F * dx * sum(k * g * sign * qa): exact integers per
 * 32-element block, as for the other types. */
#ifndef STRATA_QUANTS_IQ_H
#define STRATA_QUANTS_IQ_H

#include "internal.h"

typedef struct { f16_t d; uint16_t qs[QK_K / 8]; } blk_iq2_xxs;
typedef struct { f16_t d; uint16_t qs[QK_K / 8]; uint8_t scales[QK_K / 32]; } blk_iq2_xs;
/* qs: 32 low bytes of the grid indices, then 32 sign bytes (one per group of 8) */
typedef struct { f16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t scales[QK_K / 32]; } blk_iq2_s;
/* qs: 64 grid indices, then 8 words of 4 x 7-bit sign indices and a 4-bit scale */
typedef struct { f16_t d; uint8_t qs[3 * QK_K / 8]; } blk_iq3_xxs;
typedef struct { f16_t d; uint8_t qs[QK_K / 4]; uint8_t qh[QK_K / 32]; uint8_t signs[QK_K / 8]; uint8_t scales[QK_K / 64]; } blk_iq3_s;

_Static_assert(sizeof(blk_iq2_xxs) == 66, "iq2_xxs");
_Static_assert(sizeof(blk_iq2_xs) == 74, "iq2_xs");
_Static_assert(sizeof(blk_iq2_s) == 82, "iq2_s");
_Static_assert(sizeof(blk_iq3_xxs) == 98, "iq3_xxs");
_Static_assert(sizeof(blk_iq3_s) == 110, "iq3_s");

static inline int st_type_is_iq(int32_t type) {
    return type == ST_TYPE_IQ2_XXS || type == ST_TYPE_IQ2_XS || type == ST_TYPE_IQ2_S || type == ST_TYPE_IQ3_XXS ||
           type == ST_TYPE_IQ3_S;
}

/* Bytes per 256-element block of an IQ type, 0 for any other type. */
int32_t st_iq_block_bytes(int32_t type);
/* Dequantise one block (gguf-py's reference, bit for bit). */
void st_iq_dequant_block(int32_t type, const void *blk, float *y);
/* The generic reference kernel of an IQ type (NULL for any other type). */
dot_q_fn st_dot_q_ref_iq(int32_t type);

#endif
