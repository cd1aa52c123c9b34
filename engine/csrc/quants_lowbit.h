/* The low-bit quant types Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4: block layouts (exactly as in
 * GGUF files), their dequantisation and generic reference dot kernels (quants_lowbit.c), and
 * the SIMD kernels (gemm_lowbit.h, compiled into each SIMD variant's file).
 *
 * What each block holds (w = the dequantised weight):
 *   Q2_K   (256, 84 B): 16 groups of 16 with a 4-bit scale and a 4-bit min each (scales[g]: scale
 *          in the low nibble), codes q in 0..3: w = d * sc * q - dmin * m.
 *   Q3_K   (256, 110 B): 16 groups of 16 with a signed 6-bit scale (sc - 32), codes q in -4..3 from
 *          two low bits (qs) and a high bit (hmask; a set bit means no -4): w = d * (sc - 32) * q.
 *   IQ4_NL (32, 18 B): one f16 scale, 4-bit indices into a fixed non-linear table of int8 values.
 *   IQ4_XS (256, 136 B): the IQ4_NL table with a signed 6-bit scale per 32 (low 4 bits in
 *          scales_l, high 2 in scales_h): w = d * (ls - 32) * table[i].
 *   MXFP4  (32, 17 B): an E8M0 exponent byte and 4-bit E2M1 codes, kept as twice their value
 *          (integers -12..12) with half the power of two as the scale. */
#ifndef STRATA_QUANTS_LOWBIT_H
#define STRATA_QUANTS_LOWBIT_H

#include "internal.h"

typedef struct { uint8_t scales[QK_K / 16]; uint8_t qs[QK_K / 4]; f16_t d, dmin; } blk_q2_k;
typedef struct { uint8_t hmask[QK_K / 8]; uint8_t qs[QK_K / 4]; uint8_t scales[12]; f16_t d; } blk_q3_k;
typedef struct { f16_t d; uint8_t qs[QK / 2]; } blk_iq4_nl;
typedef struct { f16_t d; uint16_t scales_h; uint8_t scales_l[QK_K / 64]; uint8_t qs[QK_K / 2]; } blk_iq4_xs;
typedef struct { uint8_t e; uint8_t qs[QK / 2]; } blk_mxfp4;

_Static_assert(sizeof(blk_q2_k) == 84, "q2_k");
_Static_assert(sizeof(blk_q3_k) == 110, "q3_k");
_Static_assert(sizeof(blk_iq4_nl) == 18, "iq4_nl");
_Static_assert(sizeof(blk_iq4_xs) == 136, "iq4_xs");
_Static_assert(sizeof(blk_mxfp4) == 17, "mxfp4");

/* The IQ4_NL / IQ4_XS value table and the MXFP4 one (E2M1 doubled), indexed by the 4-bit code. */
static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Half of 2^(e - 127) as float bits (E8M0 with the doubled codes above): subnormal for e < 2. */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q3_K: the signed 6-bit scale of group g (0..15), minus 32. */
static inline int q3k_scale(const uint8_t *sc, int g) {
    const int lo = g < 8 ? sc[g] & 0xF : sc[g - 8] >> 4;
    const int hi = (sc[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* IQ4_XS: the signed 6-bit scale of sub-block ib (0..7), minus 32. */
static inline int iq4xs_scale(const blk_iq4_xs *b, int ib) {
    return (((b->scales_l[ib / 2] >> (4 * (ib & 1))) & 0xF) | (((b->scales_h >> (2 * ib)) & 3) << 4)) - 32;
}

/* Is `type` one of this file's types; its block elements and bytes (0 otherwise). */
int st_lowbit_type(int32_t type);
int32_t st_lowbit_block_elems(int32_t type);
int32_t st_lowbit_block_bytes(int32_t type);
/* Dequantise one block of `type` (one of this file's) to y[block elems]. */
void st_lowbit_dequantize_block(int32_t type, const void *blk, float *y);
/* The generic reference kernels (NULL for other types). The SIMD ones are in gemm_lowbit.h. */
dot_q_fn st_dot_q_ref_lowbit(int32_t type);

#endif
