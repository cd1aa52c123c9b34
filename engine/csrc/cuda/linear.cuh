/* The arguments of every linear-layer kernel (dense and routed, matvec and GEMM): groups of pairs,
 * row segments, output modes. */
#pragma once
#include "common.cuh"

/* a layer whose busiest expert holds more than MV_GUARD x routed_mv_max pairs keeps the GEMM alone (group_out) */
#define MV_GUARD 3

/* which kernels a launch may use (linear()): a step asks for AUTO; the harness for each */
#define STG_PATH_REF 0    /* the generic reference kernel: one thread per output */
#define STG_PATH_MATVEC 1 /* warp per weight row, up to 8 tokens per pass (decode) */
#define STG_PATH_GEMM 2   /* tiled int8 dp4a matrix-matrix kernel (prefill, big batches) */
#define STG_PATH_AUTO 3   /* what stg_forward picks for this many tokens */

/* ------------------------------------------------------------ linear layers */

/* Rows of an input or output matrix are addressed through groups of "pairs":
 * group g holds pairs list[start[g] .. start[g] + count[g]) (list NULL: start + i) of
 * weight matrix (expert) gexp[g]; pair p reads input row in_map[p] (NULL: p) and writes
 * output row p. A dense layer is one group; routed experts are one group per active
 * expert, so one launch covers every expert of a layer. */
struct lin_groups {
    const int32_t *gexp, *gstart, *gcount; /* NULL: one group (expert 0, start 0, count n_pairs) */
    const int32_t *n_groups;               /* device scalar; NULL: gridDim.y */
    const int32_t *list, *in_map;
    int32_t n_pairs; /* with gexp: at most this many pairs in all groups together (sizes a tiled GEMM grid) */
    /* with gexp: group_pairs' GEMM tiles (group << 16 | tile) and their device count; the GEMM
     * launch gets them only when it runs a block per tile (gridDim.z == 1), else NULL */
    const int32_t *tiles, *n_tiles;
    /* with gexp: pairs flagged 1 are another launch's (a mixed routed launch's matvec share, group_out): the
     * routed split's combine leaves their rows; NULL: every pair is this launch's */
    const int32_t *pair_mv;
};

#define MODE_STORE 0
#define MODE_ADD 1    /* out += result (residual) */
#define MODE_SWIGLU 2 /* out = silu(W . x) * (W2 . x) */

/* Up to 3 weights of one type and row length in one launch (q, k, v): rows [seg_row[i],
 * seg_row[i+1]) of the launch read seg_w[i] and write seg_out[i] (leading dimension
 * seg_ldo[i]). n_seg < 2: the single weight w into out. */
struct lin_seg {
    int32_t n_seg;
    int32_t seg_row[4];
    const uint8_t *seg_w[3];
    float *seg_out[3];
    int64_t seg_ldo[3];
};

struct lin_args {
    const uint8_t *w, *w2;
    int64_t expert_stride, row_bytes;
    int32_t N, K;
    lin_seg seg;
    lin_groups g;
    const int8_t *aq;
    const float *ad;
    const int32_t *as;
    const float *x; /* float activations (float weights) */
    float *out;
    int64_t ldo;
    int mode;
    /* routed SWIGLU only (N % 32 == 0, ldo == N): also quantise the output rows to 8-bit blocks for the
     * down projection (hq[P, N], hd[P, N/32], hs[P, N/16], exactly k_quant_act's layout and values), by
     * k_linear_q_chunk or the routed split's k_ksplit_routed. NULL: not fused. */
    int8_t *hq;
    float *hd;
    int32_t *hs;
    /* GEMM plain form of a dense launch only: ksplit 2 or 4 splits the k loop over gridDim.z = ksplit
     * blocks, each writing its part of the butterfly tree to kpart[z][pair][N] (k_ksplit_combine adds
     * them as the tree's top levels do and stores by mode); 0 or 1: no split */
    float *kpart;
    int32_t ksplit;
};

__device__ __forceinline__ bool group_of(const lin_groups &g, int gi, int &e, int &start, int &count) {
    if (g.gexp) {
        if (g.n_groups && gi >= *g.n_groups) return false;
        e = g.gexp[gi], start = g.gstart[gi], count = g.gcount[gi];
    } else {
        if (gi > 0) return false;
        e = 0, start = 0, count = g.n_pairs;
    }
    return true;
}
__device__ __forceinline__ int pair_at(const lin_groups &g, int start, int i) { return g.list ? g.list[start + i] : start + i; }
__device__ __forceinline__ int in_row(const lin_groups &g, int p) { return g.in_map ? g.in_map[p] : p; }

__device__ __forceinline__ void store_at(const lin_args &a, float *o, float v, float v2) {
    if (a.mode == MODE_ADD) *o += v;
    else if (a.mode == MODE_SWIGLU) *o = silu_f(v) * v2;
    else *o = v;
}
__device__ __forceinline__ void store_out(const lin_args &a, int p, int r, float v, float v2) {
    float *o = a.out + (int64_t)p * a.ldo + r;
    store_at(a, o, v, v2);
}
/* The weight row and output column of launch row r (segments: q, k, v in one launch). */
__device__ __forceinline__ void seg_of(const lin_args &a, int r, const uint8_t *&w, float *&out, int64_t &ldo,
                                       int &rr) {
    w = a.w, out = a.out, ldo = a.ldo, rr = r;
    if (a.seg.n_seg > 1) {
        const int i = (r >= a.seg.seg_row[1]) + (a.seg.n_seg > 2 && r >= a.seg.seg_row[2]);
        w = a.seg.seg_w[i], out = a.seg.seg_out[i], ldo = a.seg.seg_ldo[i], rr = r - a.seg.seg_row[i];
    }
}

/* A launch's activations: the per-32 blocks (q, d, s) and the floats x they came from. linear() makes the
 * per-256 view of x itself for a weight of a per-256 type (stg_type_k256), over `rows` rows of x (0: the
 * launch's n_pairs, which a launch with in_map must not rely on); rows with skip[r] == skip_val (skip NULL: none)
 * are another stream's launch's and left alone there. */
struct acts_d {
    const int8_t *q;
    const float *d;
    const int32_t *s;
    const float *x;
    int64_t rows = 0;
    const int32_t *skip = nullptr;
    int32_t skip_val = 0;
};
