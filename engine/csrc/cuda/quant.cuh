/* Quant blocks on the GPU: dequantisation (bitwise equal to quants.c) and the
 * "sub-block" view the integer kernels use.
 *
 * Every quantised type is read in 32-element sub-blocks, each described as
 *   q[32] : signed 8-bit values (offsets already subtracted), packed 4 per int
 *   A, B  : float scale and minimum, c0, c1: integer scales of the two 16-halves
 * so that with 8-bit activations a = ad * qa (sum over the sub-block of qa = asum):
 *   dot(sub-block) = ad * (A * (c0 * sum_lo(q*qa) + c1 * sum_hi(q*qa)) + B * asum).
 * Q4_0 / Q5_0 / Q8_0: A = d, B = 0.  Q4_1 / Q5_1: A = d, B = m (q unsigned).
 * Q4_K / Q5_K: A = d*sc, B = -(dmin*m).  Q6_K: A = d, c0/c1 = the two int8 scales.
 * m0, m1 weigh the two 16-sums of the activations in the B term: B * (m0 * asum_lo + m1 * asum_hi).
 * They are 1 for every type but Q2_K (A = d, B = -dmin, c0/c1 and m0/m1 the 4-bit scales and mins
 * of its two 16-groups), whose minimum is per 16 elements.
 * This is the same integer arithmetic as quants.c's reference dots; only the float
 * rounding order of the scale products differs (<= 1 ulp per sub-block). */
#pragma once
#include <cuda_fp16.h>
#include <stdint.h>

#define STG_F32 0
#define STG_F16 1
#define STG_Q4_0 2
#define STG_Q4_1 3
#define STG_Q5_0 6
#define STG_Q5_1 7
#define STG_Q8_0 8
#define STG_Q4_K 12
#define STG_Q5_K 13
#define STG_Q6_K 14
#define STG_BF16 30
#define STG_Q2_K 10
#define STG_Q3_K 11
#define STG_IQ2_XXS 16
#define STG_IQ2_XS 17
#define STG_IQ3_XXS 18
#define STG_IQ4_NL 20
#define STG_IQ3_S 21
#define STG_IQ2_S 22
#define STG_IQ4_XS 23
#define STG_MXFP4 39

template <int T> struct qt;
template <> struct qt<STG_Q4_0> { static constexpr int BE = 32, BB = 18; };
template <> struct qt<STG_Q4_1> { static constexpr int BE = 32, BB = 20; };
template <> struct qt<STG_Q5_0> { static constexpr int BE = 32, BB = 22; };
template <> struct qt<STG_Q5_1> { static constexpr int BE = 32, BB = 24; };
template <> struct qt<STG_Q8_0> { static constexpr int BE = 32, BB = 34; };
template <> struct qt<STG_Q4_K> { static constexpr int BE = 256, BB = 144; };
template <> struct qt<STG_Q5_K> { static constexpr int BE = 256, BB = 176; };
template <> struct qt<STG_Q6_K> { static constexpr int BE = 256, BB = 210; };
template <> struct qt<STG_Q2_K> { static constexpr int BE = 256, BB = 84; };
template <> struct qt<STG_Q3_K> { static constexpr int BE = 256, BB = 110; };
template <> struct qt<STG_IQ2_XXS> { static constexpr int BE = 256, BB = 66; };
template <> struct qt<STG_IQ2_XS> { static constexpr int BE = 256, BB = 74; };
template <> struct qt<STG_IQ2_S> { static constexpr int BE = 256, BB = 82; };
template <> struct qt<STG_IQ3_XXS> { static constexpr int BE = 256, BB = 98; };
template <> struct qt<STG_IQ3_S> { static constexpr int BE = 256, BB = 110; };
template <> struct qt<STG_IQ4_NL> { static constexpr int BE = 32, BB = 18; };
template <> struct qt<STG_IQ4_XS> { static constexpr int BE = 256, BB = 136; };
template <> struct qt<STG_MXFP4> { static constexpr int BE = 32, BB = 17; };
template <> struct qt<STG_F32> { static constexpr int BE = 1, BB = 4; };
template <> struct qt<STG_F16> { static constexpr int BE = 1, BB = 2; };
template <> struct qt<STG_BF16> { static constexpr int BE = 1, BB = 2; };

static inline int stg_block_elems(int t) {
    switch (t) {
    case STG_F32: case STG_F16: case STG_BF16: return 1;
    case STG_Q4_0: case STG_Q4_1: case STG_Q5_0: case STG_Q5_1: case STG_Q8_0: case STG_IQ4_NL: case STG_MXFP4:
        return 32;
    case STG_Q4_K: case STG_Q5_K: case STG_Q6_K: case STG_Q2_K: case STG_Q3_K: case STG_IQ2_XXS: case STG_IQ2_XS: case STG_IQ2_S:
    case STG_IQ3_XXS: case STG_IQ3_S: case STG_IQ4_XS:
        return 256;
    default: return 0;
    }
}
static inline int stg_block_bytes(int t) {
    switch (t) {
    case STG_F32: return 4;
    case STG_F16: case STG_BF16: return 2;
    case STG_Q4_0: return 18;
    case STG_Q4_1: return 20;
    case STG_Q5_0: return 22;
    case STG_Q5_1: return 24;
    case STG_Q8_0: return 34;
    case STG_Q4_K: return 144;
    case STG_Q5_K: return 176;
    case STG_Q6_K: return 210;
    case STG_Q2_K: return 84;
    case STG_Q3_K: return 110;
    case STG_IQ2_XXS: return 66;
    case STG_IQ2_XS: return 74;
    case STG_IQ2_S: return 82;
    case STG_IQ3_XXS: return 98;
    case STG_IQ3_S: return 110;
    case STG_IQ4_NL: return 18;
    case STG_IQ4_XS: return 136;
    case STG_MXFP4: return 17;
    default: return 0;
    }
}
static inline int stg_is_float(int t) { return t == STG_F32 || t == STG_F16 || t == STG_BF16; }
/* The types whose products read the per-256 activation view (the CPU's st_type_q8k: the same set, so that the
 * GPU's codes are the CPU's; linear() makes the view, k_quant_act256). */
static inline int stg_type_k256(int t) {
    return t == STG_Q6_K || t == STG_Q2_K || t == STG_Q3_K || t == STG_IQ4_XS || t == STG_IQ2_XXS ||
           t == STG_IQ2_XS || t == STG_IQ2_S || t == STG_IQ3_XXS || t == STG_IQ3_S;
}
/* Whether a weight of type t reads the per-32 blocks (aq / hq): a quantised type of neither view above. A buffer
 * whose only readers are per-256 or float weights skips its per-32 quantisation. */
static inline int stg_reads_q32(int t) { return !stg_is_float(t) && !stg_type_k256(t); }
static inline int64_t stg_row_bytes(int t, int64_t n) { return n / stg_block_elems(t) * stg_block_bytes(t); }

__device__ __forceinline__ float ld_f16(const uint8_t *p) {
    return __half2float(__ushort_as_half(*(const uint16_t *)p));
}
__device__ __forceinline__ float bf16f(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ __forceinline__ uint32_t ld_u32_2a(const uint8_t *p) { /* 2-byte aligned 32-bit load */
    const uint16_t *h = (const uint16_t *)p;
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
}
__device__ __forceinline__ uint32_t ld_u32_4a(const uint8_t *p) { return *(const uint32_t *)p; }

__device__ __forceinline__ void scale_min_k4(int j, const uint8_t *q, int &d, int &m) {
    if (j < 4) {
        d = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Spread 4 bits (b0..b3) of v into bit 4 of 4 bytes. */
__device__ __forceinline__ uint32_t bits_to_b4(uint32_t v) {
    return ((v & 1u) << 4) | ((v & 2u) << 11) | ((v & 4u) << 18) | ((v & 8u) << 25);
}

struct sub_w {
    int q[8];
    float A, B;
    int c0, c1;
    int m0 = 1, m1 = 1; /* constants but for Q2_K: folded away in every other type's kernels */
};

/* Sub-block j (32 elements) of a weight row. */
template <int T> __device__ __forceinline__ void unpack_sub(const uint8_t *row, int j, sub_w &s);

template <> __device__ __forceinline__ void unpack_sub<STG_Q4_0>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)j * 18;
    s.A = ld_f16(b), s.B = 0.0f, s.c0 = s.c1 = 1;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t v = ld_u32_2a(b + 2 + 4 * i);
        s.q[i] = (int)__vsub4(v & 0x0F0F0F0Fu, 0x08080808u);
        s.q[4 + i] = (int)__vsub4((v >> 4) & 0x0F0F0F0Fu, 0x08080808u);
    }
}
template <> __device__ __forceinline__ void unpack_sub<STG_Q4_1>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)j * 20;
    s.A = ld_f16(b), s.B = ld_f16(b + 2), s.c0 = s.c1 = 1;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t v = ld_u32_4a(b + 4 + 4 * i);
        s.q[i] = (int)(v & 0x0F0F0F0Fu);
        s.q[4 + i] = (int)((v >> 4) & 0x0F0F0F0Fu);
    }
}
template <> __device__ __forceinline__ void unpack_sub<STG_Q5_0>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)j * 22;
    s.A = ld_f16(b), s.B = 0.0f, s.c0 = s.c1 = 1;
    const uint32_t qh = ld_u32_2a(b + 2);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t v = ld_u32_2a(b + 6 + 4 * i);
        s.q[i] = (int)__vsub4((v & 0x0F0F0F0Fu) | bits_to_b4(qh >> (4 * i)), 0x10101010u);
        s.q[4 + i] = (int)__vsub4(((v >> 4) & 0x0F0F0F0Fu) | bits_to_b4(qh >> (16 + 4 * i)), 0x10101010u);
    }
}
template <> __device__ __forceinline__ void unpack_sub<STG_Q5_1>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)j * 24;
    s.A = ld_f16(b), s.B = ld_f16(b + 2), s.c0 = s.c1 = 1;
    const uint32_t qh = ld_u32_4a(b + 4);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t v = ld_u32_4a(b + 8 + 4 * i);
        s.q[i] = (int)((v & 0x0F0F0F0Fu) | bits_to_b4(qh >> (4 * i)));
        s.q[4 + i] = (int)(((v >> 4) & 0x0F0F0F0Fu) | bits_to_b4(qh >> (16 + 4 * i)));
    }
}
template <> __device__ __forceinline__ void unpack_sub<STG_Q8_0>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)j * 34;
    s.A = ld_f16(b), s.B = 0.0f, s.c0 = s.c1 = 1;
#pragma unroll
    for (int i = 0; i < 8; i++) s.q[i] = (int)ld_u32_2a(b + 2 + 4 * i);
}
/* Bytes allocated past the last weight of a device buffer (the arena, a staging slot, a test's upload): the GEMM's
 * staged Q8_0 windows (unpack_q8_0_window) read up to 14 bytes past a block. */
#define STG_WEIGHT_TAIL 256
/* A Q8_0 block from the 48 bytes of the 16-byte-aligned window that holds it (three aligned pieces always do: a
 * block is 34 bytes, at an even offset o = 0, 2, ..., 14 into its window), O = o: the GEMM's prefill form, which
 * stages the windows with cp.async. The same values as unpack_sub<STG_Q8_0> reading the block in place. */
template <int O> __device__ __forceinline__ void unpack_q8_0_at(const uint32_t (&w)[12], sub_w &s) {
    constexpr int QW = (O + 2) >> 2, SH = ((O + 2) & 3) * 8; /* the values' first word and the shift into it */
    s.A = __half2float(__ushort_as_half((unsigned short)(w[O >> 2] >> (8 * (O & 3))))), s.B = 0.0f, s.c0 = s.c1 = 1;
#pragma unroll
    for (int i = 0; i < 8; i++) s.q[i] = SH ? (int)__funnelshift_r(w[QW + i], w[QW + i + 1], SH) : (int)w[QW + i];
}
__device__ __forceinline__ void unpack_q8_0_window(uint4 v0, uint4 v1, uint4 v2, int o, sub_w &s) {
    const uint32_t w[12] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w, v2.x, v2.y, v2.z, v2.w};
    switch (o) { /* uniform across a warp where rows are whole 16-byte pieces (K a multiple of 256) */
    case 0: unpack_q8_0_at<0>(w, s); break;
    case 2: unpack_q8_0_at<2>(w, s); break;
    case 4: unpack_q8_0_at<4>(w, s); break;
    case 6: unpack_q8_0_at<6>(w, s); break;
    case 8: unpack_q8_0_at<8>(w, s); break;
    case 10: unpack_q8_0_at<10>(w, s); break;
    case 12: unpack_q8_0_at<12>(w, s); break;
    default: unpack_q8_0_at<14>(w, s); break;
    }
}
/* Scale and min j of a K-quant block from its 12 packed bytes held in 3 words (no byte loads). */
__device__ __forceinline__ void scale_min_k4_w(int j, uint32_t s0, uint32_t s1, uint32_t s2, int &d, int &m) {
    /* words picked by selects, not an array indexed at run time (the GEMM's j comes from
     * shared memory: an array would live on the stack) */
    auto byte = [&](int i) -> int {
        const uint32_t w = i < 4 ? s0 : (i < 8 ? s1 : s2);
        return (int)((w >> (8 * (i & 3))) & 0xFFu);
    };
    if (j < 4) {
        d = byte(j) & 63;
        m = byte(j + 4) & 63;
    } else {
        d = (byte(j + 4) & 0xF) | ((byte(j - 4) >> 6) << 4);
        m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
    }
}
/* Sub-block sb of a Q4_K block from its first 16 bytes (d, dmin, 12 scale bytes) and the 32
 * bytes of nibbles it shares with sb ^ 1: the matvec (unpack_sub) and the GEMM's staged copy
 * (k_linear_gemm, bytes copied to shared memory) both unpack through this, the same bits. */
__device__ __forceinline__ void unpack_q4k(uint4 hd, uint4 v0, uint4 v1, int sb, sub_w &s) {
    int sc, m;
    scale_min_k4_w(sb, hd.y, hd.z, hd.w, sc, m);
    const float d = __half2float(__ushort_as_half((unsigned short)(hd.x & 0xFFFFu)));
    const float dmin = __half2float(__ushort_as_half((unsigned short)(hd.x >> 16)));
    s.A = d * (float)sc, s.B = -(dmin * (float)m), s.c0 = s.c1 = 1;
    const uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    const int sh = (sb & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) s.q[i] = (int)((w[i] >> sh) & 0x0F0F0F0Fu);
}
template <> __device__ __forceinline__ void unpack_sub<STG_Q4_K>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)(j >> 3) * 144;
    const int sb = j & 7;
    /* d, dmin and the 12 scale bytes in one load: blocks are 16-byte aligned (144 = 9 x 16,
     * rows a whole number of blocks, tensors 256-byte aligned in the arena) */
    const uint4 *qp = (const uint4 *)(b + 16 + 32 * (sb >> 1));
    unpack_q4k(*(const uint4 *)b, qp[0], qp[1], sb, s);
}
template <> __device__ __forceinline__ void unpack_sub<STG_Q5_K>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)(j >> 3) * 176;
    const int sb = j & 7;
    int sc, m;
    scale_min_k4(sb, b + 4, sc, m);
    s.A = ld_f16(b) * (float)sc, s.B = -(ld_f16(b + 2) * (float)m), s.c0 = s.c1 = 1;
    const uint4 *qp = (const uint4 *)(b + 48 + 32 * (sb >> 1));
    const uint4 *hp = (const uint4 *)(b + 16);
    const uint4 v0 = qp[0], v1 = qp[1], h0 = hp[0], h1 = hp[1];
    const uint32_t w[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    const uint32_t h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
    const int sh = (sb & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) s.q[i] = (int)(((w[i] >> sh) & 0x0F0F0F0Fu) | (((h[i] >> sb) & 0x01010101u) << 4));
}
template <> __device__ __forceinline__ void unpack_sub<STG_Q6_K>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)(j >> 3) * 210;
    const int sb = j & 7, h = sb >> 2, g = sb & 3;
    const uint8_t *ql = b + 64 * h + ((g & 1) ? 32 : 0), *qh = b + 128 + 32 * h;
    s.A = ld_f16(b + 208), s.B = 0.0f;
    s.c0 = (int)(int8_t)b[192 + 2 * sb], s.c1 = (int)(int8_t)b[192 + 2 * sb + 1];
    const int lsh = g < 2 ? 0 : 4, hsh = 2 * g;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t lo = (ld_u32_2a(ql + 4 * i) >> lsh) & 0x0F0F0F0Fu;
        const uint32_t hi = ((ld_u32_2a(qh + 4 * i) >> hsh) & 0x03030303u) << 4;
        s.q[i] = (int)__vsub4(lo | hi, 0x20202020u);
    }
}

/* The 32 bytes at a 2-byte aligned p as 8 little-endian words: five 8-byte loads from the 8-byte
 * boundary at or below p (so never below the tensor's aligned start; up to 8 bytes past the 32) and
 * funnel shifts, instead of sixteen
 * 2-byte loads: a Q6_K block (210 bytes) is only 2-byte aligned, and the matvec over the
 * 151,936-row output head issued ~35 loads per sub-block and lane. Same bytes, same words. */
__device__ __forceinline__ void ld32_2a(const uint8_t *p, uint32_t (&w)[8]) {
    const uintptr_t a = (uintptr_t)p;
    const uint2 *b = (const uint2 *)(a & ~(uintptr_t)7);
    uint32_t x[10];
#pragma unroll
    for (int i = 0; i < 5; i++) {
        const uint2 v = b[i];
        x[2 * i] = v.x, x[2 * i + 1] = v.y;
    }
    const bool up = (a & 4) != 0;            /* p is in the upper word of its 8 bytes */
    const unsigned sh = (unsigned)(a & 3) * 8; /* 0 or 16 */
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = __funnelshift_r(up ? x[i + 1] : x[i], up ? x[i + 2] : x[i + 1], sh);
}
/* ld32_2a on shared memory (explicit ld.shared: through ld32_2a's integer address the compiler emits generic loads):
 * the same five 8-byte words from the 8-byte boundary at or below p and the same funnel shifts (p's address mod 16
 * is its global address's, so the same words) */
__device__ __forceinline__ void ld32_2a_s(const uint8_t *p, uint32_t (&w)[8]) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p), b = a & ~7u;
    uint32_t x[10];
#pragma unroll
    for (int i = 0; i < 5; i++)
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(x[2 * i]), "=r"(x[2 * i + 1]) : "r"(b + 8 * i));
    const bool up = (a & 4) != 0;
    const unsigned sh = (a & 3) * 8;
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = __funnelshift_r(up ? x[i + 1] : x[i], up ? x[i + 2] : x[i + 1], sh);
}
/* Sub-block j of a Q6_K row through ld32_2a (every Q6_K matvec and GEMM; bitwise unpack_sub<STG_Q6_K>). Its
 * last 32-byte chunk (qh of the upper half) ends 18 bytes before the block: the over-read stays inside.
 * SMEM: the row is in shared memory (k_q6_stage's copy): ld32_2a_s's explicit shared loads, the same words. */
template <bool SMEM = false> __device__ __forceinline__ void unpack_q6k_wide(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)(j >> 3) * 210;
    const int sb = j & 7, h = sb >> 2, g = sb & 3;
    uint32_t lw[8], hw[8];
    if constexpr (SMEM) {
        ld32_2a_s(b + 64 * h + ((g & 1) ? 32 : 0), lw);
        ld32_2a_s(b + 128 + 32 * h, hw);
    } else {
        ld32_2a(b + 64 * h + ((g & 1) ? 32 : 0), lw);
        ld32_2a(b + 128 + 32 * h, hw);
    }
    const uint32_t sc = *(const uint16_t *)(b + 192 + 2 * sb);
    s.A = ld_f16(b + 208), s.B = 0.0f;
    s.c0 = (int)(int8_t)(sc & 0xFFu), s.c1 = (int)(int8_t)(sc >> 8);
    const int lsh = g < 2 ? 0 : 4, hsh = 2 * g;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t lo = (lw[i] >> lsh) & 0x0F0F0F0Fu;
        const uint32_t hi = ((hw[i] >> hsh) & 0x03030303u) << 4;
        s.q[i] = (int)__vsub4(lo | hi, 0x20202020u);
    }
}

#define STG_Q6_KW 114 /* not a GGUF type: Q6_K through unpack_q6k_wide, for the matvec's template only */
template <> __device__ __forceinline__ void unpack_sub<STG_Q6_KW>(const uint8_t *row, int j, sub_w &s) {
    unpack_q6k_wide(row, j, s);
}

/* ---- dequantisation of one block (bitwise equal to quants.c: no contraction) ---- */
template <int T> __device__ __forceinline__ void deq_block(const uint8_t *b, float *y);

template <> __device__ __forceinline__ void deq_block<STG_F32>(const uint8_t *b, float *y) { y[0] = *(const float *)b; }
template <> __device__ __forceinline__ void deq_block<STG_F16>(const uint8_t *b, float *y) { y[0] = ld_f16(b); }
template <> __device__ __forceinline__ void deq_block<STG_BF16>(const uint8_t *b, float *y) {
    y[0] = bf16f(*(const uint16_t *)b);
}
template <> __device__ __forceinline__ void deq_block<STG_Q4_0>(const uint8_t *b, float *y) {
    const float d = ld_f16(b);
    for (int l = 0; l < 16; l++) {
        y[l] = __fmul_rn(d, (float)((b[2 + l] & 0xF) - 8));
        y[l + 16] = __fmul_rn(d, (float)((b[2 + l] >> 4) - 8));
    }
}
template <> __device__ __forceinline__ void deq_block<STG_Q4_1>(const uint8_t *b, float *y) {
    const float d = ld_f16(b), m = ld_f16(b + 2);
    for (int l = 0; l < 16; l++) {
        y[l] = __fadd_rn(__fmul_rn(d, (float)(b[4 + l] & 0xF)), m);
        y[l + 16] = __fadd_rn(__fmul_rn(d, (float)(b[4 + l] >> 4)), m);
    }
}
template <> __device__ __forceinline__ void deq_block<STG_Q5_0>(const uint8_t *b, float *y) {
    const float d = ld_f16(b);
    const uint32_t qh = ld_u32_2a(b + 2);
    for (int l = 0; l < 16; l++) {
        const int q0 = (b[6 + l] & 0xF) | (((qh >> l) & 1) << 4);
        const int q1 = (b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        y[l] = __fmul_rn(d, (float)(q0 - 16));
        y[l + 16] = __fmul_rn(d, (float)(q1 - 16));
    }
}
template <> __device__ __forceinline__ void deq_block<STG_Q5_1>(const uint8_t *b, float *y) {
    const float d = ld_f16(b), m = ld_f16(b + 2);
    const uint32_t qh = ld_u32_4a(b + 4);
    for (int l = 0; l < 16; l++) {
        const int q0 = (b[8 + l] & 0xF) | (((qh >> l) & 1) << 4);
        const int q1 = (b[8 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
        y[l] = __fadd_rn(__fmul_rn(d, (float)q0), m);
        y[l + 16] = __fadd_rn(__fmul_rn(d, (float)q1), m);
    }
}
template <> __device__ __forceinline__ void deq_block<STG_Q8_0>(const uint8_t *b, float *y) {
    const float d = ld_f16(b);
    for (int l = 0; l < 32; l++) y[l] = __fmul_rn((float)(int8_t)b[2 + l], d);
}
/* Q4_K / Q5_K block b's sub-block j: its scale and min times the block's d and dmin */
__device__ __forceinline__ void deq_scale_min_k4(int j, const uint8_t *b, float d, float dmin, float &dj, float &mj) {
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    dj = __fmul_rn(d, (float)sc), mj = __fmul_rn(dmin, (float)m);
}
template <> __device__ __forceinline__ void deq_block<STG_Q4_K>(const uint8_t *b, float *y) {
    const float d = ld_f16(b), dmin = ld_f16(b + 2);
    for (int c = 0; c < 4; c++) {
        float d1, m1, d2, m2;
        deq_scale_min_k4(2 * c, b, d, dmin, d1, m1);
        deq_scale_min_k4(2 * c + 1, b, d, dmin, d2, m2);
        const uint8_t *q = b + 16 + 32 * c;
        for (int l = 0; l < 32; l++) y[64 * c + l] = __fsub_rn(__fmul_rn(d1, (float)(q[l] & 0xF)), m1);
        for (int l = 0; l < 32; l++) y[64 * c + 32 + l] = __fsub_rn(__fmul_rn(d2, (float)(q[l] >> 4)), m2);
    }
}
template <> __device__ __forceinline__ void deq_block<STG_Q5_K>(const uint8_t *b, float *y) {
    const float d = ld_f16(b), dmin = ld_f16(b + 2);
    const uint8_t *qh = b + 16;
    for (int c = 0; c < 4; c++) {
        float d1, m1, d2, m2;
        deq_scale_min_k4(2 * c, b, d, dmin, d1, m1);
        deq_scale_min_k4(2 * c + 1, b, d, dmin, d2, m2);
        const uint8_t *q = b + 48 + 32 * c;
        for (int l = 0; l < 32; l++)
            y[64 * c + l] = __fsub_rn(__fmul_rn(d1, (float)((q[l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4))), m1);
        for (int l = 0; l < 32; l++)
            y[64 * c + 32 + l] =
                __fsub_rn(__fmul_rn(d2, (float)((q[l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4))), m2);
    }
}
template <> __device__ __forceinline__ void deq_block<STG_Q6_K>(const uint8_t *b, float *y) {
    const float d = ld_f16(b + 208);
    for (int s = 0; s < 16; s++) {
        const float ds = __fmul_rn(d, (float)(int8_t)b[192 + s]);
        for (int l = 0; l < 16; l++) {
            const int e = 16 * s + l, h = e / 128, r = e % 128, g = r / 32, ll = r % 32;
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            const int lo = (g & 1) ? ql[32 + ll] : ql[ll];
            const int low4 = g < 2 ? (lo & 0xF) : (lo >> 4);
            const int high2 = (qh[ll] >> (2 * g)) & 3;
            y[e] = __fmul_rn(ds, (float)((low4 | (high2 << 4)) - 32));
        }
    }
}

/* Float weight element i of a row. */
template <int T> __device__ __forceinline__ float wf(const uint8_t *row, int64_t i);
template <> __device__ __forceinline__ float wf<STG_F32>(const uint8_t *row, int64_t i) { return ((const float *)row)[i]; }
template <> __device__ __forceinline__ float wf<STG_F16>(const uint8_t *row, int64_t i) {
    return __half2float(((const __half *)row)[i]);
}
template <> __device__ __forceinline__ float wf<STG_BF16>(const uint8_t *row, int64_t i) {
    return bf16f(((const uint16_t *)row)[i]);
}

/* ---- the issue-32 types: Q3_K, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, MXFP4 ----
 * Their sub-block view (the CPU's integer form, quants_lowbit.c / quants_iq.c):
 *   Q3_K:   q = low 2 bits - (high bit ? 0 : 4), A = d, c0 / c1 = the two 6-bit scales - 32.
 *   IQ*:    q = +-grid magnitude, A = d * F (F = 1/8 IQ2, 1/4 IQ3_XXS, 1 IQ3_S), c0 / c1 = 2 ls + 1.
 *   IQ4_NL: q = kvalues_iq4nl[code], A = d.  IQ4_XS: the same, A = d * (6-bit scale - 32).
 *   MXFP4:  q = the doubled E2M1 value, A = half of 2^(e - 127).
 * B = 0 throughout. The codebooks live in device memory, copied from iq_grids.h (iq_tables_setup). */
__device__ uint64_t g_iq2xxs_grid[256];
__device__ uint64_t g_iq2xs_grid[512];
__device__ uint64_t g_iq2s_grid[1024];
__device__ uint32_t g_iq3xxs_grid[256];
__device__ uint32_t g_iq3s_grid[512];
__device__ uint8_t g_iq_ksigns[128];

/* The types whose two 16-halves carry different integer scales (the GEMM's two m16n8k16 form). */
template <int T> __host__ __device__ constexpr bool has_c() {
    return T == STG_Q6_K || T == STG_Q6_KW || T == STG_Q3_K || T == STG_IQ2_XXS || T == STG_IQ2_XS ||
           T == STG_IQ2_S || T == STG_IQ3_XXS || T == STG_IQ3_S || T == STG_Q2_K;
}
/* The types whose two 16-halves carry different minima (m0 / m1 not 1: the GEMM keeps them per row and the
 * activations' two 16-sums per pair). */
template <int T> __host__ __device__ constexpr bool has_m() { return T == STG_Q2_K; }

__device__ __forceinline__ uint32_t ld_u32_1a(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
__device__ __forceinline__ uint32_t ld_u16(const uint8_t *p) { return *(const uint16_t *)p; }

/* 4 unsigned magnitudes (bytes of g) negated where sign bit k (of 4) is set: (g ^ m) - m per byte. */
__device__ __forceinline__ int signed4(uint32_t g, uint32_t s4) {
    const uint32_t m = ((s4 * 0x00204081u) & 0x01010101u) * 0xFFu;
    return (int)__vsub4(g ^ m, m);
}

/* 4 bytes of 4-bit codes (each byte 0..15) looked up in a 16-entry int8 table held as 4 words. */
__device__ __forceinline__ int lut16(uint32_t v, uint32_t t0, uint32_t t1, uint32_t t2, uint32_t t3) {
    const uint32_t x = v & 0x07070707u, y = x | (x >> 4);
    const uint32_t sel = (y & 0xFFu) | ((y >> 8) & 0xFF00u);
    const uint32_t lo = __byte_perm(t0, t1, sel), hi = __byte_perm(t2, t3, sel);
    const uint32_t m = ((v >> 3) & 0x01010101u) * 0xFFu;
    return (int)((hi & m) | (lo & ~m));
}
/* kvalues_iq4nl / kvalues_mxfp4 (quants_lowbit.h) as little-endian words: the dequantisation tests
 * compare every code against the CPU's table */
#define IQ4NL_T 0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u
#define MXFP4_T 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu
__device__ __forceinline__ int iq4nl_lut(uint32_t v) { return lut16(v, IQ4NL_T); }
__device__ __forceinline__ int mxfp4_lut(uint32_t v) { return lut16(v, MXFP4_T); }

/* 16 bytes of codes (element l low nibble of byte l, element 16 + l high) as q[8]. */
template <int LUT> __device__ __forceinline__ void nibbles16(const uint32_t (&w)[4], int (&q)[8]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t lo = w[i] & 0x0F0F0F0Fu, hi = (w[i] >> 4) & 0x0F0F0F0Fu;
        q[i] = LUT ? mxfp4_lut(lo) : iq4nl_lut(lo);
        q[4 + i] = LUT ? mxfp4_lut(hi) : iq4nl_lut(hi);
    }
}

/* Half of 2^(e - 127) (quants_lowbit.h e8m0_half). */
__device__ __forceinline__ float e8m0_half_d(uint32_t e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

/* Q3_K: the signed 6-bit scale of group g (0..15), minus 32. */
__device__ __forceinline__ int q3k_scale_d(const uint8_t *sc, int g) {
    const int lo = g < 8 ? sc[g] & 0xF : sc[g - 8] >> 4;
    const int hi = (sc[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}
/* IQ4_XS: the signed 6-bit scale of sub-block ib (0..7), minus 32. */
__device__ __forceinline__ int iq4xs_scale_d(const uint8_t *b, int ib) {
    return (((b[4 + ib / 2] >> (4 * (ib & 1))) & 0xF) | (((ld_u16(b + 2) >> (2 * ib)) & 3) << 4)) - 32;
}

/* Sub-block sb (0..7) of a Q3_K block: q[8] and the two group scales. */
__device__ __forceinline__ void q3k_sub(const uint8_t *b, int sb, int (&q)[8], int &c0, int &c1) {
    const uint8_t *qs = b + 32 + 32 * (sb >> 2);
    const int sh = 2 * (sb & 3);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t low = (ld_u32_2a(qs + 4 * i) >> sh) & 0x03030303u;
        const uint32_t hb = (ld_u32_2a(b + 4 * i) >> sb) & 0x01010101u;
        q[i] = (int)__vsub4(low, (hb ^ 0x01010101u) << 2);
    }
    c0 = q3k_scale_d(b + 96, 2 * sb), c1 = q3k_scale_d(b + 96, 2 * sb + 1);
}

/* Sub-block ib (0..7) of an IQ2 / IQ3 block: q[8] = signed grid magnitudes, ls0 / ls1 = the raw 4-bit
 * scale fields of its two 16-halves (iq_decode in quants_iq.c). */
template <int T> __device__ __forceinline__ void iq_sub(const uint8_t *b, int ib, int (&q)[8], int &ls0, int &ls1);
template <> __device__ __forceinline__ void iq_sub<STG_IQ2_XXS>(const uint8_t *b, int ib, int (&q)[8], int &ls0,
                                                                 int &ls1) {
    const uint8_t *p = b + 2 + 8 * ib;
    const uint32_t idx = ld_u32_2a(p), aux = ld_u32_2a(p + 4);
    ls0 = ls1 = (int)(aux >> 28);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint64_t g = g_iq2xxs_grid[(idx >> (8 * k)) & 0xFF];
        const uint32_t s = g_iq_ksigns[(aux >> (7 * k)) & 127];
        q[2 * k] = signed4((uint32_t)g, s & 0xF), q[2 * k + 1] = signed4((uint32_t)(g >> 32), s >> 4);
    }
}
template <> __device__ __forceinline__ void iq_sub<STG_IQ2_XS>(const uint8_t *b, int ib, int (&q)[8], int &ls0,
                                                                int &ls1) {
    const uint8_t *p = b + 2 + 8 * ib;
    const uint32_t sc = b[66 + ib];
    ls0 = (int)(sc & 0xF), ls1 = (int)(sc >> 4);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint32_t v = ld_u16(p + 2 * k);
        const uint64_t g = g_iq2xs_grid[v & 511];
        const uint32_t s = g_iq_ksigns[v >> 9];
        q[2 * k] = signed4((uint32_t)g, s & 0xF), q[2 * k + 1] = signed4((uint32_t)(g >> 32), s >> 4);
    }
}
template <> __device__ __forceinline__ void iq_sub<STG_IQ2_S>(const uint8_t *b, int ib, int (&q)[8], int &ls0,
                                                               int &ls1) {
    const uint8_t *qs = b + 2, *signs = b + 2 + 32, *qh = b + 66;
    const uint32_t sc = b[74 + ib], h = qh[ib];
    ls0 = (int)(sc & 0xF), ls1 = (int)(sc >> 4);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint64_t g = g_iq2s_grid[qs[4 * ib + k] | (((h >> (2 * k)) & 3) << 8)];
        const uint32_t s = signs[4 * ib + k];
        q[2 * k] = signed4((uint32_t)g, s & 0xF), q[2 * k + 1] = signed4((uint32_t)(g >> 32), s >> 4);
    }
}
template <> __device__ __forceinline__ void iq_sub<STG_IQ3_XXS>(const uint8_t *b, int ib, int (&q)[8], int &ls0,
                                                                 int &ls1) {
    const uint8_t *qs = b + 2 + 8 * ib;
    const uint32_t aux = ld_u32_2a(b + 2 + 64 + 4 * ib);
    ls0 = ls1 = (int)(aux >> 28);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const uint32_t s = g_iq_ksigns[(aux >> (7 * k)) & 127];
        q[2 * k] = signed4(g_iq3xxs_grid[qs[2 * k]], s & 0xF);
        q[2 * k + 1] = signed4(g_iq3xxs_grid[qs[2 * k + 1]], s >> 4);
    }
}
template <> __device__ __forceinline__ void iq_sub<STG_IQ3_S>(const uint8_t *b, int ib, int (&q)[8], int &ls0,
                                                               int &ls1) {
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    const uint32_t h = qh[ib];
    ls0 = ls1 = (scales[ib / 2] >> (4 * (ib % 2))) & 0xF;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const uint32_t g = g_iq3s_grid[qs[8 * ib + k] | (((h >> k) & 1) << 8)];
        q[k] = signed4(g, (signs[4 * ib + k / 2] >> (4 * (k % 2))) & 0xF);
    }
}
/* d * F of quants_iq.c (the dot's float scale) and gguf-py's per-16 dequantisation scale (iq_db). */
template <int T> __device__ __forceinline__ float iq_f() {
    return T == STG_IQ3_S ? 1.0f : T == STG_IQ3_XXS ? 0.25f : 0.125f;
}
template <int T> __device__ __forceinline__ float iq_db_d(float d, int ls) {
    if constexpr (T == STG_IQ3_XXS) return __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)ls)), 0.5f);
    else if constexpr (T == STG_IQ3_S) return __fmul_rn(d, (float)(1 + 2 * ls));
    else return __fmul_rn(__fmul_rn(d, __fadd_rn(0.5f, (float)ls)), 0.25f);
}

#define IQ_UNPACK(T)                                                                                 \
    template <> __device__ __forceinline__ void unpack_sub<T>(const uint8_t *row, int j, sub_w &s) { \
        const uint8_t *b = row + (int64_t)(j >> 3) * qt<T>::BB;                                      \
        int l0, l1;                                                                                   \
        iq_sub<T>(b, j & 7, s.q, l0, l1);                                                             \
        s.A = ld_f16(b) * iq_f<T>(), s.B = 0.0f, s.c0 = 2 * l0 + 1, s.c1 = 2 * l1 + 1;              \
    }                                                                                                 \
    template <> __device__ __forceinline__ void deq_block<T>(const uint8_t *b, float *y) {           \
        const float d = ld_f16(b);                                                                    \
        for (int ib = 0; ib < 8; ib++) {                                                              \
            int q[8], l0, l1;                                                                         \
            iq_sub<T>(b, ib, q, l0, l1);                                                              \
            const float db0 = iq_db_d<T>(d, l0), db1 = iq_db_d<T>(d, l1);                             \
            for (int l = 0; l < 32; l++)                                                              \
                y[32 * ib + l] = __fmul_rn(l < 16 ? db0 : db1, (float)(int8_t)(q[l / 4] >> (8 * (l % 4)))); \
        }                                                                                             \
    }
IQ_UNPACK(STG_IQ2_XXS)
IQ_UNPACK(STG_IQ2_XS)
IQ_UNPACK(STG_IQ2_S)
IQ_UNPACK(STG_IQ3_XXS)
IQ_UNPACK(STG_IQ3_S)
#undef IQ_UNPACK

template <> __device__ __forceinline__ void unpack_sub<STG_Q3_K>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)(j >> 3) * 110;
    q3k_sub(b, j & 7, s.q, s.c0, s.c1);
    s.A = ld_f16(b + 108), s.B = 0.0f;
}
template <> __device__ __forceinline__ void deq_block<STG_Q3_K>(const uint8_t *b, float *y) {
    const float d = ld_f16(b + 108);
    for (int sb = 0; sb < 8; sb++) {
        int q[8], c0, c1;
        q3k_sub(b, sb, q, c0, c1);
        const float d0 = __fmul_rn(d, (float)c0), d1 = __fmul_rn(d, (float)c1);
        for (int l = 0; l < 32; l++)
            y[32 * sb + l] = __fmul_rn(l < 16 ? d0 : d1, (float)(int8_t)(q[l / 4] >> (8 * (l % 4))));
    }
}

/* Q2_K (84 bytes: scales[16], qs[64], d, dmin): sub-block sb (0..7) is 16-groups 2 sb and 2 sb + 1; its codes
 * are bits 2 (sb % 4) of bytes 32 (sb / 4) .. + 31 of qs (quants_lowbit.c k_low2). Blocks are 4-byte aligned
 * (84 = 21 x 4, rows whole blocks, tensors 256-byte aligned). */
__device__ __forceinline__ void q2k_sub(const uint8_t *b, int sb, sub_w &s) {
    const uint8_t *qs = b + 16 + 32 * (sb >> 2);
    const int sh = 2 * (sb & 3);
#pragma unroll
    for (int i = 0; i < 8; i++) s.q[i] = (int)((ld_u32_4a(qs + 4 * i) >> sh) & 0x03030303u);
    const uint32_t g0 = b[2 * sb], g1 = b[2 * sb + 1];
    s.c0 = (int)(g0 & 0xF), s.m0 = (int)(g0 >> 4), s.c1 = (int)(g1 & 0xF), s.m1 = (int)(g1 >> 4);
}
template <> __device__ __forceinline__ void unpack_sub<STG_Q2_K>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)(j >> 3) * 84;
    q2k_sub(b, j & 7, s);
    s.A = ld_f16(b + 80), s.B = -ld_f16(b + 82);
}
/* deq_q2_k: dl * q - ml with dl = d * scale, ml = dmin * min per 16-group (no contraction) */
template <> __device__ __forceinline__ void deq_block<STG_Q2_K>(const uint8_t *b, float *y) {
    const float d = ld_f16(b + 80), dmin = ld_f16(b + 82);
    for (int sb = 0; sb < 8; sb++) {
        sub_w s;
        q2k_sub(b, sb, s);
        const float dl0 = __fmul_rn(d, (float)s.c0), ml0 = __fmul_rn(dmin, (float)s.m0);
        const float dl1 = __fmul_rn(d, (float)s.c1), ml1 = __fmul_rn(dmin, (float)s.m1);
        for (int l = 0; l < 32; l++) {
            const float q = (float)((s.q[l / 4] >> (8 * (l % 4))) & 0xFF);
            y[32 * sb + l] = l < 16 ? __fsub_rn(__fmul_rn(dl0, q), ml0) : __fsub_rn(__fmul_rn(dl1, q), ml1);
        }
    }
}

template <> __device__ __forceinline__ void unpack_sub<STG_IQ4_NL>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)j * 18;
    const uint32_t w[4] = {ld_u32_2a(b + 2), ld_u32_2a(b + 6), ld_u32_2a(b + 10), ld_u32_2a(b + 14)};
    nibbles16<0>(w, s.q);
    s.A = ld_f16(b), s.B = 0.0f, s.c0 = s.c1 = 1;
}
template <> __device__ __forceinline__ void unpack_sub<STG_IQ4_XS>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)(j >> 3) * 136;
    const int ib = j & 7;
    const uint2 *qp = (const uint2 *)(b + 8 + 16 * ib); /* blocks 8-byte aligned (136 = 17 x 8), qs at 8 */
    const uint2 v0 = qp[0], v1 = qp[1];
    const uint32_t w[4] = {v0.x, v0.y, v1.x, v1.y};
    nibbles16<0>(w, s.q);
    s.A = __fmul_rn(ld_f16(b), (float)iq4xs_scale_d(b, ib)), s.B = 0.0f, s.c0 = s.c1 = 1;
}
template <> __device__ __forceinline__ void unpack_sub<STG_MXFP4>(const uint8_t *row, int j, sub_w &s) {
    const uint8_t *b = row + (int64_t)j * 17; /* 17-byte blocks: byte loads */
    const uint32_t w[4] = {ld_u32_1a(b + 1), ld_u32_1a(b + 5), ld_u32_1a(b + 9), ld_u32_1a(b + 13)};
    nibbles16<1>(w, s.q);
    s.A = e8m0_half_d(b[0]), s.B = 0.0f, s.c0 = s.c1 = 1;
}
/* IQ4_NL / IQ4_XS / MXFP4 dequantisation: scale * table[code] (deq_nibbles) through the unpack's values */
template <int T> __device__ __forceinline__ void deq_nib(const uint8_t *row, int j, float *y) {
    sub_w s;
    unpack_sub<T>(row, j, s);
    for (int l = 0; l < 32; l++) y[l] = __fmul_rn(s.A, (float)(int8_t)(s.q[l / 4] >> (8 * (l % 4))));
}
template <> __device__ __forceinline__ void deq_block<STG_IQ4_NL>(const uint8_t *b, float *y) { deq_nib<STG_IQ4_NL>(b, 0, y); }
template <> __device__ __forceinline__ void deq_block<STG_MXFP4>(const uint8_t *b, float *y) { deq_nib<STG_MXFP4>(b, 0, y); }
template <> __device__ __forceinline__ void deq_block<STG_IQ4_XS>(const uint8_t *b, float *y) {
    for (int ib = 0; ib < 8; ib++) deq_nib<STG_IQ4_XS>(b, ib, y + 32 * ib);
}
