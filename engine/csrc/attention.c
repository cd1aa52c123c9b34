/* Attention over the paged F16 KV cache for one head: a tile of consecutive queries of
 * one sequence (prefill), or a single query (decode).
 *
 * KV layout per layer and block: K is [n_kv][head_dim][block_size] (slots contiguous,
 * so 16 keys' values of one dimension are one vector load), V is [block_size][v_dim] (a
 * head's values may be narrower than its keys: MLA's latent rows).
 *
 * Both paths compute every (query, key) with the same operations in the same order:
 * score = fma chain over dimensions, max, exp, a sequential sum over keys, an fma chain
 * over keys for the values, one division. So a token's output is bit-identical whether
 * it is decoded alone or sits in a prefill tile with others (batch invariance). The
 * tile path puts queries in vector lanes; the decode path puts keys in lanes.
 *
 * Three variants: the generic reference here, and AVX-512 / AVX2 versions below, each
 * compiled for its ISA through target attributes and chosen at run time.
 *
 * Split decode (flash-decoding): a decode query with many keys is cut into chunks; each chunk
 * gives a partial (its max score m, sum l of exp(s - m), unnormalised value sum acc) for the
 * query heads that share one KV head, and st_attn_combine merges a query's partials in chunk
 * order. Per query the partial kernel runs the decode kernel's operations over its chunk, so a
 * single chunk gives the unsplit result bit for bit; several chunks differ from it by the
 * rounding of the rescaling (docs/engine.md states the tolerance). Each variant has its
 * partial kernel (part_ref, part_256, part_512); the combine is one generic function.
 *
 * The 8-bit cache (kv_view.k8) has its reference (attn_q8_ref, part_q8_ref) and one SIMD version,
 * AVX2 (attn_q8_256, part_q8_256), which AVX-512 CPUs run too; its rule is under q8_nb_256. */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

#define LANES 16 /* queries per tile = keys per K load */
_Static_assert(LANES == ST_ATTN_TILE, "a prefill tile fills the vector lanes");

/* A physical block below n_hot is in the hot pool, the rest in the cold one (the tiered cache). */
static inline const f16_t *k_block(const kv_view *kv, int32_t blk) {
    const int32_t p = kv->bt[blk];
    const f16_t *base = p < kv->n_hot ? kv->k : kv->kc;
    const size_t i = (size_t)(p < kv->n_hot ? p : p - kv->n_hot);
    return base + (i * (size_t)kv->n_kv + (size_t)kv->kvh) * (size_t)kv->hd * (size_t)kv->bs;
}

static inline const f16_t *v_row(const kv_view *kv, int32_t j) {
    const int32_t p = kv->bt[j / kv->bs];
    const f16_t *base = p < kv->n_hot ? kv->v : kv->vc;
    const size_t i = (size_t)(p < kv->n_hot ? p : p - kv->n_hot);
    return base + (i * (size_t)kv->bs + (size_t)(j % kv->bs)) * (size_t)kv->v_dim + (size_t)kv->kvh * (size_t)kv->vd;
}

/* ------------------------------------------------------------------ reference */

static void attn_ref(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                     int64_t o_stride, float *scratch) {
    const int hd = kv->hd;
    const int32_t n_keys = p0 + nq;
    float *s = scratch; /* [n_keys] scores of one query */
    for (int i = 0; i < nq; i++) {
        const float *qi = q + i * q_stride;
        const int32_t nk = p0 + i + 1;
        float mx = -INFINITY;
        for (int32_t j = 0; j < nk; j++) {
            const f16_t *kb = k_block(kv, j / kv->bs);
            float acc = 0.0f;
            for (int d = 0; d < hd; d++) acc = fmaf(qi[d], f16_to_f32(kb[d * kv->bs + j % kv->bs]), acc);
            s[j] = acc;
            mx = acc > mx ? acc : mx;
        }
        float sum = 0.0f;
        for (int32_t j = 0; j < nk; j++) sum += (s[j] = expf(s[j] - mx));
        float *oi = out + i * o_stride;
        for (int d = 0; d < kv->vd; d++) {
            float acc = 0.0f;
            for (int32_t j = 0; j < nk; j++) acc = fmaf(s[j], f16_to_f32(v_row(kv, j)[d]), acc);
            oi[d] = acc / sum;
        }
    }
    (void)n_keys;
}

attn_fn st_attn_ref(void) { return attn_ref; }

/* Sliding window and sink: each query on its own (so a token gives the same bits alone or in a
 * tile). The sink s counts as one more score with no value: the maximum is taken over the
 * visible scores and s, and exp(s - max) joins the denominator (ggml's soft_max with sinks). */
void st_attn_ext(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out, int64_t o_stride,
                 float *scratch, int32_t n_swa, const float *sink) {
    const int hd = kv->hd;
    float *s = scratch; /* [p0 + nq] scores of one query */
    for (int i = 0; i < nq; i++) {
        const float *qi = q + i * q_stride;
        const int32_t p = p0 + i, lo = n_swa > 0 && p - n_swa + 1 > 0 ? p - n_swa + 1 : 0;
        float mx = sink ? *sink : -INFINITY;
        for (int32_t j = lo; j <= p; j++) {
            const f16_t *kb = k_block(kv, j / kv->bs);
            float acc = 0.0f;
            for (int d = 0; d < hd; d++) acc = fmaf(qi[d], f16_to_f32(kb[d * kv->bs + j % kv->bs]), acc);
            s[j] = acc;
            mx = acc > mx ? acc : mx;
        }
        float sum = sink ? expf(*sink - mx) : 0.0f;
        for (int32_t j = lo; j <= p; j++) sum += (s[j] = expf(s[j] - mx));
        float *oi = out + i * o_stride;
        for (int d = 0; d < kv->vd; d++) oi[d] = 0.0f;
        for (int32_t j = lo; j <= p; j++) {
            const f16_t *vr = v_row(kv, j);
            for (int d = 0; d < kv->vd; d++) oi[d] = fmaf(s[j], f16_to_f32(vr[d]), oi[d]);
        }
        for (int d = 0; d < kv->vd; d++) oi[d] /= sum;
    }
}

/* ------------------------------------------------------------------ split decode: reference */

static void part_ref(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t j0, int32_t j1, float *part,
                     float *scratch) {
    const int hd = kv->hd;
    float *s = scratch; /* [j1 - j0] scores of one query */
    for (int i = 0; i < nq; i++) {
        const float *qi = q + i * q_stride;
        float mx = -INFINITY;
        for (int32_t j = j0; j < j1; j++) {
            const f16_t *kb = k_block(kv, j / kv->bs);
            float acc = 0.0f;
            for (int d = 0; d < hd; d++) acc = fmaf(qi[d], f16_to_f32(kb[d * kv->bs + j % kv->bs]), acc);
            s[j - j0] = acc;
            mx = acc > mx ? acc : mx;
        }
        float sum = 0.0f;
        for (int32_t j = j0; j < j1; j++) sum += (s[j - j0] = expf(s[j - j0] - mx));
        float *pi = part + (size_t)i * (size_t)(kv->vd + 2);
        pi[0] = mx, pi[1] = sum;
        for (int d = 0; d < kv->vd; d++) {
            float acc = 0.0f;
            for (int32_t j = j0; j < j1; j++) acc = fmaf(s[j - j0], f16_to_f32(v_row(kv, j)[d]), acc);
            pi[2 + d] = acc;
        }
    }
}

attn_part_fn st_attn_part_ref(void) { return part_ref; }

/* ------------------------------------------------------------------ 8-bit cache: reference */

/* Score of query qi against key j of an 8-bit cache: per group of 32 dimensions, the integer
 * values' dot with the query times the group's scale. */
static inline float q8_score(const kv_view *kv, const float *qi, int32_t j) {
    const size_t bs = (size_t)kv->bs, p = (size_t)kv->bt[j / kv->bs], slot = (size_t)(j % kv->bs);
    const size_t k_dim = (size_t)kv->n_kv * (size_t)kv->hd, h0 = (size_t)kv->kvh * (size_t)kv->hd;
    const int8_t *kb = kv->k8 + p * bs * k_dim;       /* [k_dim][bs] */
    const f16_t *sb = kv->ks + p * bs * (k_dim / 32); /* [k_dim / 32][bs] */
    float acc = 0.0f;
    for (int g = 0; g < kv->hd / 32; g++) {
        float dot = 0.0f;
        for (int d = 32 * g; d < 32 * g + 32; d++) dot = fmaf(qi[d], (float)kb[(h0 + (size_t)d) * bs + slot], dot);
        acc = fmaf(f16_to_f32(sb[(h0 / 32 + (size_t)g) * bs + slot]), dot, acc);
    }
    return acc;
}

/* Adds w times value row j (this head's vd values, dequantised) to o. */
static inline void q8_add_value(const kv_view *kv, float w, int32_t j, float *o) {
    const size_t row = (size_t)kv->bt[j / kv->bs] * (size_t)kv->bs + (size_t)(j % kv->bs);
    const size_t c0 = (size_t)kv->kvh * (size_t)kv->vd;
    const int8_t *vr = kv->v8 + row * (size_t)kv->v_dim + c0;
    const f16_t *sr = kv->vs + row * (size_t)(kv->v_dim / 32) + c0 / 32;
    for (int g = 0; g < kv->vd / 32; g++) {
        const float ws = w * f16_to_f32(sr[g]);
        for (int d = 32 * g; d < 32 * g + 32; d++) o[d] = fmaf(ws, (float)vr[d], o[d]);
    }
}

static void attn_q8_ref(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                        int64_t o_stride, float *scratch) {
    float *s = scratch; /* [p0 + nq] scores of one query */
    for (int i = 0; i < nq; i++) {
        const float *qi = q + i * q_stride;
        const int32_t nk = p0 + i + 1;
        float mx = -INFINITY;
        for (int32_t j = 0; j < nk; j++) {
            s[j] = q8_score(kv, qi, j);
            mx = s[j] > mx ? s[j] : mx;
        }
        float sum = 0.0f;
        for (int32_t j = 0; j < nk; j++) sum += (s[j] = expf(s[j] - mx));
        float *oi = out + i * o_stride;
        for (int d = 0; d < kv->vd; d++) oi[d] = 0.0f;
        for (int32_t j = 0; j < nk; j++) q8_add_value(kv, s[j], j, oi);
        for (int d = 0; d < kv->vd; d++) oi[d] /= sum;
    }
}

static void part_q8_ref(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t j0, int32_t j1,
                        float *part, float *scratch) {
    float *s = scratch; /* [j1 - j0] scores of one query */
    for (int i = 0; i < nq; i++) {
        const float *qi = q + i * q_stride;
        float mx = -INFINITY;
        for (int32_t j = j0; j < j1; j++) {
            s[j - j0] = q8_score(kv, qi, j);
            mx = s[j - j0] > mx ? s[j - j0] : mx;
        }
        float sum = 0.0f;
        for (int32_t j = j0; j < j1; j++) sum += (s[j - j0] = expf(s[j - j0] - mx));
        float *pi = part + (size_t)i * (size_t)(kv->vd + 2);
        pi[0] = mx, pi[1] = sum;
        for (int d = 0; d < kv->vd; d++) pi[2 + d] = 0.0f;
        for (int32_t j = j0; j < j1; j++) q8_add_value(kv, s[j - j0], j, pi + 2);
    }
}

attn_fn st_attn_q8_ref(void) { return attn_q8_ref; }
attn_part_fn st_attn_part_q8_ref(void) { return part_q8_ref; }

void st_attn_combine(const float *parts, int32_t n_chunks, size_t chunk_stride, int nq, int vd, const float *sink,
                     float *out, int64_t o_stride) {
    for (int i = 0; i < nq; i++) {
        const float *p0 = parts + (size_t)i * (size_t)(vd + 2);
        float mx = sink ? sink[i] : -INFINITY;
        for (int32_t c = 0; c < n_chunks; c++) mx = p0[c * chunk_stride] > mx ? p0[c * chunk_stride] : mx;
        float sum = sink ? expf(sink[i] - mx) : 0.0f;
        float *oi = out + i * o_stride;
        for (int d = 0; d < vd; d++) oi[d] = 0.0f;
        for (int32_t c = 0; c < n_chunks; c++) {
            const float *p = p0 + c * chunk_stride;
            const float w = expf(p[0] - mx); /* 1 exactly for the chunk holding the maximum */
            sum = fmaf(w, p[1], sum);
            for (int d = 0; d < vd; d++) oi[d] = fmaf(w, p[2 + d], oi[d]);
        }
        for (int d = 0; d < vd; d++) oi[d] /= sum;
    }
}

/* The split rule (docs/engine.md, "Decode attention at long context"). A query with fewer than
 * SPLIT_MIN_KEYS keys takes one chunk: the grouped kernel then gives the per-head kernel's bits
 * (so the token has the bits it has in a prefill tile), and a split would cost more than it
 * saves. From SPLIT_MIN_KEYS keys on they are cut into enough chunks
 * that the query's KV heads give every thread of the pool SPLIT_ITEMS_PER_THREAD items (so a
 * slow thread does not hold up the step), with chunks of at least SPLIT_MIN_CHUNK keys (a chunk
 * must outweigh its combine) and at most SPLIT_MAX_CHUNK (its K and V stay in the core's L2
 * cache while the group's query heads read them), and at most SPLIT_MAX_CHUNKS chunks (the
 * partials' memory). Chunks are multiples of 16 keys (one vector of K, never across a block). */
#define SPLIT_MIN_KEYS 1024
#define SPLIT_ITEMS_PER_THREAD 2
#define SPLIT_MIN_CHUNK 256
#define SPLIT_MAX_CHUNK 1024
#define SPLIT_MAX_CHUNKS 256

static int32_t g_split_mode = ST_SPLIT_AUTO;

int32_t st_attn_split_chunk(int32_t n_keys, int32_t n_threads, int32_t n_kv) {
    const int32_t mode = g_split_mode;
    if (mode == ST_SPLIT_OFF || n_keys < 1) return 0;
    if (mode > 0) return mode;
    if (n_keys < SPLIT_MIN_KEYS) return (n_keys + 15) / 16 * 16;
    const int64_t want = ((int64_t)SPLIT_ITEMS_PER_THREAD * (n_threads > 1 ? n_threads : 1) + n_kv - 1) / n_kv;
    int64_t n_chunks = want < n_keys / SPLIT_MIN_CHUNK ? want : n_keys / SPLIT_MIN_CHUNK;
    if (n_chunks < ((int64_t)n_keys + SPLIT_MAX_CHUNK - 1) / SPLIT_MAX_CHUNK)
        n_chunks = ((int64_t)n_keys + SPLIT_MAX_CHUNK - 1) / SPLIT_MAX_CHUNK;
    if (n_chunks > SPLIT_MAX_CHUNKS) n_chunks = SPLIT_MAX_CHUNKS;
    if (n_chunks < 1) n_chunks = 1;
    const int64_t per = ((int64_t)n_keys + n_chunks - 1) / n_chunks;
    return (int32_t)((per + 15) / 16 * 16);
}

void st_attn_split_set_mode(int32_t mode) { g_split_mode = mode; }
int32_t st_attn_split_mode(void) { return g_split_mode; }

#if defined(__x86_64__)
#include <immintrin.h>

/* KERNEL(NB, ...) with NB the constant 1, 2, 3 or 4 (nb above 4 calls it with 4): each inlined copy of an
 * always_inline kernel over NB queries keeps its accumulators in registers. */
#define CALL_WITH_NB(nb, KERNEL, ...)           \
    do {                                        \
        switch ((nb) < 4 ? (nb) : 4) {          \
        case 1: KERNEL(1, __VA_ARGS__); break;  \
        case 2: KERNEL(2, __VA_ARGS__); break;  \
        case 3: KERNEL(3, __VA_ARGS__); break;  \
        default: KERNEL(4, __VA_ARGS__); break; \
        }                                       \
    } while (0)

/* ------------------------------------------------------------------ AVX-512 */

#define T512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")))

/* exp(x) to ~1 ulp over the range that matters (x <= 0 here): 2^n * p(r). */
T512 static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

T512 static void attn_tile_512(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                               int64_t o_stride, float *scratch) {
    const int hd = kv->hd, bs = kv->bs;
    const int32_t n_keys = p0 + nq;
    float *qt = scratch;               /* [hd][16] queries transposed */
    float *kf = qt + hd * LANES;       /* [hd][16] one K chunk as float */
    float *S = kf + hd * LANES;        /* [n_keys][16] scores, then probabilities */
    for (int d = 0; d < hd; d++)
        for (int i = 0; i < LANES; i++) qt[d * LANES + i] = i < nq ? q[i * q_stride + d] : 0.0f;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int32_t j0 = 0; j0 < n_keys; j0 += LANES) {
        const f16_t *kb = k_block(kv, j0 / bs) + j0 % bs;
        for (int d = 0; d < hd; d++)
            _mm512_storeu_ps(kf + d * LANES, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kb + d * bs))));
        const int32_t jn = n_keys - j0 < LANES ? n_keys - j0 : LANES;
        for (int32_t jj = 0; jj < jn; jj++) {
            __m512 acc = _mm512_setzero_ps();
            for (int d = 0; d < hd; d++)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * LANES), _mm512_set1_ps(kf[d * LANES + jj]), acc);
            _mm512_storeu_ps(S + (size_t)(j0 + jj) * LANES, acc);
        }
    }
    /* query i sees key j when j <= p0 + i, i.e. lane >= j - p0 */
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int32_t j = 0; j < n_keys; j++) {
        const __mmask16 vis = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(j - p0));
        mx = _mm512_mask_max_ps(mx, vis, mx, _mm512_loadu_ps(S + (size_t)j * LANES));
    }
    __m512 sum = _mm512_setzero_ps();
    const __mmask16 live = (__mmask16)((1u << nq) - 1);
    for (int32_t j = 0; j < n_keys; j++) {
        const __mmask16 vis = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32(j - p0)) & live;
        const __m512 e = _mm512_maskz_mov_ps(vis, exp512(_mm512_sub_ps(_mm512_loadu_ps(S + (size_t)j * LANES), mx)));
        _mm512_storeu_ps(S + (size_t)j * LANES, e);
        sum = _mm512_add_ps(sum, e);
    }
    float sums[LANES];
    _mm512_storeu_ps(sums, sum);
    for (int c = 0; c < kv->vd; c += 16) {
        __m512 acc[LANES];
        for (int i = 0; i < LANES; i++) acc[i] = _mm512_setzero_ps();
        for (int32_t j = 0; j < n_keys; j++) {
            const __m512 vv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v_row(kv, j) + c)));
            const float *p = S + (size_t)j * LANES;
            for (int i = 0; i < LANES; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i]), vv, acc[i]);
        }
        for (int i = 0; i < nq; i++) _mm512_storeu_ps(out + i * o_stride + c, _mm512_div_ps(acc[i], _mm512_set1_ps(sums[i])));
    }
}

T512 static void attn_one_512(const kv_view *kv, const float *q, float *out, int32_t p0, float *scratch) {
    const int hd = kv->hd, bs = kv->bs;
    const int32_t n_keys = p0 + 1;
    float *S = scratch; /* [n_keys rounded up to 16] */
    for (int32_t j0 = 0; j0 < n_keys; j0 += LANES) {
        const f16_t *kb = k_block(kv, j0 / bs) + j0 % bs;
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < hd; d++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(q[d]), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kb + d * bs))), acc);
        _mm512_storeu_ps(S + j0, acc);
    }
    const int32_t full = n_keys / LANES * LANES;
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    for (int32_t j = 0; j < full; j += LANES) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(S + j));
    float mx = _mm512_reduce_max_ps(mxv);
    for (int32_t j = full; j < n_keys; j++) mx = S[j] > mx ? S[j] : mx;
    for (int32_t j = 0; j < n_keys; j += LANES) _mm512_storeu_ps(S + j, exp512(_mm512_sub_ps(_mm512_loadu_ps(S + j), _mm512_set1_ps(mx))));
    float sum = 0.0f; /* sequential over keys: the same order as a tile lane */
    for (int32_t j = 0; j < n_keys; j++) sum += S[j];
    for (int c = 0; c < kv->vd; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int32_t j = 0; j < n_keys; j++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(S[j]), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v_row(kv, j) + c))), acc);
        _mm512_storeu_ps(out + c, _mm512_div_ps(acc, _mm512_set1_ps(sum)));
    }
}

/* The partials of NB (1..4) queries over keys [j0, j1) (j0 a multiple of 16): per query the
 * operations of attn_one_512 on the chunk, so each lane's fma chains are the same; the queries
 * share each K and V load and conversion. S: NB rows of round_up(j1 - j0, 16) floats. NB is a
 * constant in each inlined copy, so the accumulators stay in registers. */
T512 static inline __attribute__((always_inline)) void part_512_nb(const int NB, const kv_view *kv, const float *q,
                                                                   int64_t q_stride, int32_t j0, int32_t j1,
                                                                   float *part, float *S) {
    const int hd = kv->hd, bs = kv->bs, ps = kv->vd + 2; /* a partial: max, sum, vd values */
    const int32_t n = j1 - j0, rs = (n + LANES - 1) / LANES * LANES;
    for (int32_t o = 0; o < n; o += LANES) {
        const f16_t *kb = k_block(kv, (j0 + o) / bs) + (j0 + o) % bs;
        __m512 acc[4];
        for (int g = 0; g < NB; g++) acc[g] = _mm512_setzero_ps();
        for (int d = 0; d < hd; d++) {
            const __m512 kd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kb + d * bs)));
            for (int g = 0; g < NB; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * q_stride + d]), kd, acc[g]);
        }
        for (int g = 0; g < NB; g++) _mm512_storeu_ps(S + g * rs + o, acc[g]);
    }
    const int32_t full = n / LANES * LANES;
    float sums[4];
    for (int g = 0; g < NB; g++) {
        float *Sg = S + g * rs;
        __m512 mxv = _mm512_set1_ps(-INFINITY);
        for (int32_t j = 0; j < full; j += LANES) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(Sg + j));
        float mx = _mm512_reduce_max_ps(mxv);
        for (int32_t j = full; j < n; j++) mx = Sg[j] > mx ? Sg[j] : mx;
        for (int32_t j = 0; j < n; j += LANES)
            _mm512_storeu_ps(Sg + j, exp512(_mm512_sub_ps(_mm512_loadu_ps(Sg + j), _mm512_set1_ps(mx))));
        float sum = 0.0f; /* sequential over keys, as attn_one_512 */
        for (int32_t j = 0; j < n; j++) sum += Sg[j];
        part[g * ps] = mx, sums[g] = sum;
    }
    for (int g = 0; g < NB; g++) part[g * ps + 1] = sums[g];
    for (int c = 0; c < kv->vd; c += 16) {
        __m512 acc[4];
        for (int g = 0; g < NB; g++) acc[g] = _mm512_setzero_ps();
        for (int32_t j = j0; j < j1;) { /* keys in order, one block table lookup per block */
            const f16_t *vb = v_row(kv, j) + c;
            const int32_t jn = bs - j % bs < j1 - j ? bs - j % bs : j1 - j;
            for (int32_t jj = 0; jj < jn; jj++) {
                const __m512 vv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vb + (size_t)jj * kv->v_dim)));
                for (int g = 0; g < NB; g++) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(S[g * rs + j - j0 + jj]), vv, acc[g]);
            }
            j += jn;
        }
        for (int g = 0; g < NB; g++) _mm512_storeu_ps(part + g * ps + 2 + c, acc[g]);
    }
}

T512 static void part_512(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t j0, int32_t j1,
                          float *part, float *scratch) {
    const size_t ps = (size_t)(kv->vd + 2);
    for (int i = 0; i < nq; i += 4)
        CALL_WITH_NB(nq - i, part_512_nb, kv, q + i * q_stride, q_stride, j0, j1, part + (size_t)i * ps, scratch);
}

T512 static void attn_avx512(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                             int64_t o_stride, float *scratch) {
    if (nq == 1) attn_one_512(kv, q, out, p0, scratch);
    else attn_tile_512(kv, q, q_stride, nq, p0, out, o_stride, scratch);
}

/* ------------------------------------------------------------------ AVX2 */

#define T256 __attribute__((target("avx2,fma,f16c")))

T256 static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* One 8-lane half of the 16-lane tile at a time keeps the AVX2 code the same shape. */
T256 static void attn_tile_256(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                               int64_t o_stride, float *scratch) {
    const int hd = kv->hd, bs = kv->bs;
    const int32_t n_keys = p0 + nq;
    float *qt = scratch, *kf = qt + hd * LANES, *S = kf + hd * LANES;
    for (int d = 0; d < hd; d++)
        for (int i = 0; i < LANES; i++) qt[d * LANES + i] = i < nq ? q[i * q_stride + d] : 0.0f;
    for (int32_t j0 = 0; j0 < n_keys; j0 += LANES) {
        const f16_t *kb = k_block(kv, j0 / bs) + j0 % bs;
        for (int d = 0; d < hd; d++) {
            _mm256_storeu_ps(kf + d * LANES, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kb + d * bs))));
            _mm256_storeu_ps(kf + d * LANES + 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kb + d * bs + 8))));
        }
        const int32_t jn = n_keys - j0 < LANES ? n_keys - j0 : LANES;
        for (int32_t jj = 0; jj < jn; jj++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int d = 0; d < hd; d++) {
                const __m256 kv8 = _mm256_set1_ps(kf[d * LANES + jj]);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qt + d * LANES), kv8, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qt + d * LANES + 8), kv8, a1);
            }
            _mm256_storeu_ps(S + (size_t)(j0 + jj) * LANES, a0);
            _mm256_storeu_ps(S + (size_t)(j0 + jj) * LANES + 8, a1);
        }
    }
    float sums[LANES];
    for (int h = 0; h < 2; h++) {
        const __m256i lane = _mm256_setr_epi32(8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3, 8 * h + 4, 8 * h + 5, 8 * h + 6, 8 * h + 7);
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int32_t j = 0; j < n_keys; j++) {
            const __m256 vis = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(j - p0 - 1)));
            mx = _mm256_blendv_ps(mx, _mm256_max_ps(mx, _mm256_loadu_ps(S + (size_t)j * LANES + 8 * h)), vis);
        }
        __m256 sum = _mm256_setzero_ps();
        const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nq), lane));
        for (int32_t j = 0; j < n_keys; j++) {
            const __m256 vis = _mm256_and_ps(live, _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32(j - p0 - 1))));
            float *sp = S + (size_t)j * LANES + 8 * h;
            const __m256 e = _mm256_and_ps(vis, exp256(_mm256_sub_ps(_mm256_loadu_ps(sp), mx)));
            _mm256_storeu_ps(sp, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(sums + 8 * h, sum);
    }
    for (int c = 0; c < kv->vd; c += 8) {
        __m256 acc[LANES];
        for (int i = 0; i < LANES; i++) acc[i] = _mm256_setzero_ps();
        for (int32_t j0 = 0; j0 < n_keys; j0 += bs) { /* keys in order, one block table lookup per block */
            const f16_t *vb = v_row(kv, j0) + c;
            const int32_t jn = n_keys - j0 < bs ? n_keys - j0 : bs;
            for (int32_t jj = 0; jj < jn; jj++) {
                const __m256 vv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vb + (size_t)jj * kv->v_dim)));
                const float *p = S + (size_t)(j0 + jj) * LANES;
                for (int i = 0; i < LANES; i++) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), vv, acc[i]);
            }
        }
        for (int i = 0; i < nq; i++) _mm256_storeu_ps(out + i * o_stride + c, _mm256_div_ps(acc[i], _mm256_set1_ps(sums[i])));
    }
}

T256 static void attn_one_256(const kv_view *kv, const float *q, float *out, int32_t p0, float *scratch) {
    const int hd = kv->hd, bs = kv->bs;
    const int32_t n_keys = p0 + 1;
    float *S = scratch;
    /* Scores, 8 keys per vector; up to four vectors of keys at once so that four independent
     * fma chains hide the fma latency (each lane's chain over d is unchanged). */
    for (int32_t j0 = 0; j0 < n_keys; j0 += 32) {
        const int ng = n_keys - j0 >= 32 ? 4 : (n_keys - j0 + 7) / 8;
        const f16_t *kb[4];
        for (int g = 0; g < 4; g++) {
            const int32_t j = j0 + 8 * (g < ng ? g : 0);
            kb[g] = k_block(kv, j / bs) + j % bs;
        }
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int d = 0; d < hd; d++) {
            const __m256 qd = _mm256_set1_ps(q[d]);
            for (int g = 0; g < 4; g++)
                acc[g] = _mm256_fmadd_ps(qd, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kb[g] + d * bs))), acc[g]);
        }
        for (int g = 0; g < ng; g++) _mm256_storeu_ps(S + j0 + 8 * g, acc[g]);
    }
    float mx = -INFINITY;
    for (int32_t j = 0; j < n_keys; j++) mx = S[j] > mx ? S[j] : mx;
    for (int32_t j = 0; j < n_keys; j += 8) _mm256_storeu_ps(S + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(S + j), _mm256_set1_ps(mx))));
    float sum = 0.0f;
    for (int32_t j = 0; j < n_keys; j++) sum += S[j];
    /* Values: 16 dims (two vectors) at a time, keys in order (each lane's fma chain over keys is
     * unchanged), v_row (a division) once per KV block instead of once per key. */
    for (int c = 0; c < kv->vd; c += 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int32_t j0 = 0; j0 < n_keys; j0 += bs) {
            const f16_t *vb = v_row(kv, j0) + c;
            const int32_t jn = n_keys - j0 < bs ? n_keys - j0 : bs;
            for (int32_t jj = 0; jj < jn; jj++) {
                const __m256 p = _mm256_set1_ps(S[j0 + jj]);
                const f16_t *vr = vb + (size_t)jj * kv->v_dim;
                a0 = _mm256_fmadd_ps(p, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)vr)), a0);
                a1 = _mm256_fmadd_ps(p, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vr + 8))), a1);
            }
        }
        _mm256_storeu_ps(out + c, _mm256_div_ps(a0, _mm256_set1_ps(sum)));
        _mm256_storeu_ps(out + c + 8, _mm256_div_ps(a1, _mm256_set1_ps(sum)));
    }
}

/* The partials of NB (1..4) queries over keys [j0, j1) (j0 a multiple of 16): per query the
 * operations of attn_one_256 on the chunk (each lane's fma chains unchanged); the queries share
 * each K and V load and conversion, 16 keys (two vectors) at a time. S as part_512_nb's. */
T256 static inline __attribute__((always_inline)) void part_256_nb(const int NB, const kv_view *kv, const float *q,
                                                                   int64_t q_stride, int32_t j0, int32_t j1,
                                                                   float *part, float *S) {
    const int hd = kv->hd, bs = kv->bs, ps = kv->vd + 2; /* a partial: max, sum, vd values */
    const int32_t n = j1 - j0, rs = (n + LANES - 1) / LANES * LANES;
    for (int32_t o = 0; o < n; o += LANES) { /* 16 keys of one block (a block holds whole groups of 16) */
        const f16_t *kb = k_block(kv, (j0 + o) / bs) + (j0 + o) % bs;
        __m256 a0[4], a1[4];
        for (int g = 0; g < NB; g++) a0[g] = a1[g] = _mm256_setzero_ps();
        for (int d = 0; d < hd; d++) {
            const __m256 k0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kb + d * bs)));
            const __m256 k1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kb + d * bs + 8)));
            for (int g = 0; g < NB; g++) {
                const __m256 qd = _mm256_set1_ps(q[g * q_stride + d]);
                a0[g] = _mm256_fmadd_ps(qd, k0, a0[g]);
                a1[g] = _mm256_fmadd_ps(qd, k1, a1[g]);
            }
        }
        for (int g = 0; g < NB; g++) {
            _mm256_storeu_ps(S + g * rs + o, a0[g]);
            _mm256_storeu_ps(S + g * rs + o + 8, a1[g]);
        }
    }
    float sums[4];
    for (int g = 0; g < NB; g++) {
        float *Sg = S + g * rs;
        float mx = -INFINITY;
        for (int32_t j = 0; j < n; j++) mx = Sg[j] > mx ? Sg[j] : mx;
        for (int32_t j = 0; j < n; j += 8)
            _mm256_storeu_ps(Sg + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(Sg + j), _mm256_set1_ps(mx))));
        float sum = 0.0f;
        for (int32_t j = 0; j < n; j++) sum += Sg[j];
        part[g * ps] = mx, sums[g] = sum;
    }
    for (int g = 0; g < NB; g++) part[g * ps + 1] = sums[g];
    for (int c = 0; c < kv->vd; c += 16) {
        __m256 a0[4], a1[4];
        for (int g = 0; g < NB; g++) a0[g] = a1[g] = _mm256_setzero_ps();
        for (int32_t j = j0; j < j1;) { /* keys in order, one block table lookup per block */
            const f16_t *vb = v_row(kv, j) + c;
            const int32_t jn = bs - j % bs < j1 - j ? bs - j % bs : j1 - j;
            for (int32_t jj = 0; jj < jn; jj++) {
                const f16_t *vr = vb + (size_t)jj * kv->v_dim;
                const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)vr));
                const __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(vr + 8)));
                for (int g = 0; g < NB; g++) {
                    const __m256 p = _mm256_set1_ps(S[g * rs + j - j0 + jj]);
                    a0[g] = _mm256_fmadd_ps(p, v0, a0[g]);
                    a1[g] = _mm256_fmadd_ps(p, v1, a1[g]);
                }
            }
            j += jn;
        }
        for (int g = 0; g < NB; g++) {
            _mm256_storeu_ps(part + g * ps + 2 + c, a0[g]);
            _mm256_storeu_ps(part + g * ps + 2 + c + 8, a1[g]);
        }
    }
}

T256 static void part_256(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t j0, int32_t j1,
                          float *part, float *scratch) {
    const size_t ps = (size_t)(kv->vd + 2);
    for (int i = 0; i < nq; i += 4)
        CALL_WITH_NB(nq - i, part_256_nb, kv, q + i * q_stride, q_stride, j0, j1, part + (size_t)i * ps, scratch);
}

T256 static void attn_avx2(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                           int64_t o_stride, float *scratch) {
    if (nq == 1) attn_one_256(kv, q, out, p0, scratch);
    else attn_tile_256(kv, q, q_stride, nq, p0, out, o_stride, scratch);
}

/* ------------------------------------------------------------------ 8-bit cache: AVX2 */

/* The 8-bit cache's kernel for NB (1..4) queries of one KV head over keys [j0, e[NB-1]), query g
 * seeing keys [j0, e[g]) (ends nondecreasing; j0 a multiple of 16). Per query it runs the
 * reference's operations in the reference's order (q8_score's fma chains over each group of 32
 * dimensions and over the groups, the sequential max and sum over keys, q8_add_value's
 * w * scale and fma chain over keys), with keys in vector lanes for the scores and dimensions
 * in lanes for the values; only the exponential differs (exp256, ~1 ulp, for expf). The queries
 * share each K and V load and int8 conversion. A key past a query's end gets weight 0, whose
 * fma leaves the accumulator's bits unchanged, so a query's result does not depend on the
 * queries beside it (a tile gives each token its decode bits). Writes the unnormalised value
 * sums to o + g * o_stride, and the max and sum of each query to mx, sum. S: 2 * NB rows of
 * round_up(e[NB-1] - j0, 16) floats (scores, then weights times scales). Registers: 8
 * accumulators, 2 key or value vectors, 1 broadcast. */
T256 static inline __attribute__((always_inline)) void q8_nb_256(const int NB, const kv_view *kv, const float *q,
                                                                 int64_t q_stride, int32_t j0, const int32_t *e,
                                                                 float *S, float *mx, float *sum, float *o,
                                                                 int64_t o_stride) {
    const int hd = kv->hd;
    const int32_t bs = kv->bs, j1 = e[NB - 1], n = j1 - j0, rs = (n + LANES - 1) / LANES * LANES;
    const size_t k_dim = (size_t)kv->n_kv * (size_t)hd, h0 = (size_t)kv->kvh * (size_t)hd;
    for (int32_t oo = 0; oo < n; oo += LANES) { /* 16 keys of one block (a block holds whole groups of 16) */
        const int32_t j = j0 + oo;
        const size_t p = (size_t)kv->bt[j / bs], slot = (size_t)(j % bs);
        const int8_t *kb = kv->k8 + p * (size_t)bs * k_dim + h0 * (size_t)bs + slot;             /* [hd][bs] */
        const f16_t *sb = kv->ks + p * (size_t)bs * (k_dim / 32) + h0 / 32 * (size_t)bs + slot; /* [hd/32][bs] */
        for (int g = 0; g < NB; g++) {
            _mm256_storeu_ps(S + g * rs + oo, _mm256_setzero_ps());
            _mm256_storeu_ps(S + g * rs + oo + 8, _mm256_setzero_ps());
        }
        for (int gr = 0; gr < hd / 32; gr++) {
            __m256 d0[4], d1[4];
            for (int g = 0; g < NB; g++) d0[g] = d1[g] = _mm256_setzero_ps();
            for (int d = 32 * gr; d < 32 * gr + 32; d++) {
                const int8_t *kd = kb + (size_t)d * (size_t)bs;
                const __m256 k0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)kd)));
                const __m256 k1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(kd + 8))));
                for (int g = 0; g < NB; g++) {
                    const __m256 qd = _mm256_set1_ps(q[g * q_stride + d]);
                    d0[g] = _mm256_fmadd_ps(qd, k0, d0[g]);
                    d1[g] = _mm256_fmadd_ps(qd, k1, d1[g]);
                }
            }
            const f16_t *sg = sb + (size_t)gr * (size_t)bs;
            const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
            const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 8)));
            for (int g = 0; g < NB; g++) {
                float *sp = S + g * rs + oo;
                _mm256_storeu_ps(sp, _mm256_fmadd_ps(s0, d0[g], _mm256_loadu_ps(sp)));
                _mm256_storeu_ps(sp + 8, _mm256_fmadd_ps(s1, d1[g], _mm256_loadu_ps(sp + 8)));
            }
        }
    }
    for (int g = 0; g < NB; g++) {
        float *Sg = S + g * rs;
        const int32_t ng = e[g] - j0, full = ng / 8 * 8;
        __m256 mv = _mm256_set1_ps(-INFINITY); /* the max is the same in any order */
        for (int32_t j = 0; j < full; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(Sg + j));
        float mb[8], m = -INFINITY;
        _mm256_storeu_ps(mb, mv);
        for (int l = 0; l < 8; l++) m = mb[l] > m ? mb[l] : m;
        for (int32_t j = full; j < ng; j++) m = Sg[j] > m ? Sg[j] : m;
        for (int32_t j = 0; j < ng; j += 8)
            _mm256_storeu_ps(Sg + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(Sg + j), _mm256_set1_ps(m))));
        for (int32_t j = ng; j < n; j++) Sg[j] = 0.0f; /* keys this query does not see */
        mx[g] = m;
    }
    /* The sums, each sequential over keys (the reference's order); the queries' chains interleave.
     * Past a query's end its terms are 0, which leave the sum's bits unchanged. */
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int32_t j = 0; j < n; j++)
        for (int g = 0; g < NB; g++) s[g] += S[g * rs + j];
    for (int g = 0; g < NB; g++) sum[g] = s[g];
    /* Values, a group of 32 dimensions (one scale per key) at a time: W holds each query's weight
     * times the key's scale (q8_add_value's ws), then two passes of 16 dimensions over the keys. */
    float *W = S + NB * rs; /* NB rows of rs */
    const size_t vrow = (size_t)kv->v_dim, n_sc = (size_t)(kv->v_dim / 32), c0 = (size_t)kv->kvh * (size_t)kv->vd;
    for (int c32 = 0; c32 < kv->vd; c32 += 32) {
        for (int32_t j = j0; j < j1;) {
            const int32_t jn = bs - j % bs < j1 - j ? bs - j % bs : j1 - j;
            const size_t row = (size_t)kv->bt[j / bs] * (size_t)bs + (size_t)(j % bs);
            const f16_t *sr = kv->vs + row * n_sc + (c0 + (size_t)c32) / 32;
            for (int32_t jj = 0; jj < jn; jj++) {
                const float sc = _cvtsh_ss(sr[(size_t)jj * n_sc]);
                for (int g = 0; g < NB; g++) W[g * rs + j - j0 + jj] = S[g * rs + j - j0 + jj] * sc;
            }
            j += jn;
        }
        for (int c = c32; c < c32 + 32; c += 16) {
            __m256 a0[4], a1[4];
            for (int g = 0; g < NB; g++) a0[g] = a1[g] = _mm256_setzero_ps();
            for (int32_t j = j0; j < j1;) { /* keys in order, one block table lookup per block */
                const int32_t jn = bs - j % bs < j1 - j ? bs - j % bs : j1 - j;
                const size_t row = (size_t)kv->bt[j / bs] * (size_t)bs + (size_t)(j % bs);
                const int8_t *vb = kv->v8 + row * vrow + c0 + (size_t)c;
                const float *Wj = W + (j - j0);
                for (int32_t jj = 0; jj < jn; jj++) {
                    const int8_t *vr = vb + (size_t)jj * vrow;
                    const __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)vr)));
                    const __m256 v1 =
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(vr + 8))));
                    for (int g = 0; g < NB; g++) {
                        const __m256 w = _mm256_broadcast_ss(Wj + g * rs + jj);
                        a0[g] = _mm256_fmadd_ps(w, v0, a0[g]);
                        a1[g] = _mm256_fmadd_ps(w, v1, a1[g]);
                    }
                }
                j += jn;
            }
            for (int g = 0; g < NB; g++) {
                _mm256_storeu_ps(o + g * o_stride + c, a0[g]);
                _mm256_storeu_ps(o + g * o_stride + c + 8, a1[g]);
            }
        }
    }
}

/* q8_nb_256 with NB a constant in each inlined copy, so the accumulators stay in registers. */
T256 static void q8_group_256(const kv_view *kv, const float *q, int64_t q_stride, int nb, int32_t j0,
                              const int32_t *e, float *S, float *mx, float *sum, float *o, int64_t o_stride) {
    CALL_WITH_NB(nb, q8_nb_256, kv, q, q_stride, j0, e, S, mx, sum, o, o_stride);
}

/* Whole attention (attn_q8_ref's contract): queries four at a time, query i seeing keys
 * 0..p0+i, then each output row divided by its sum as the reference does. */
T256 static void attn_q8_256(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t p0, float *out,
                             int64_t o_stride, float *scratch) {
    for (int i = 0; i < nq; i += 4) {
        const int nb = nq - i < 4 ? nq - i : 4;
        int32_t e[4];
        float mx[4], sum[4];
        for (int g = 0; g < nb; g++) e[g] = p0 + i + g + 1;
        float *oi = out + i * o_stride;
        q8_group_256(kv, q + i * q_stride, q_stride, nb, 0, e, scratch, mx, sum, oi, o_stride);
        for (int g = 0; g < nb; g++) {
            const __m256 sv = _mm256_set1_ps(sum[g]);
            for (int d = 0; d < kv->vd; d += 8)
                _mm256_storeu_ps(oi + g * o_stride + d, _mm256_div_ps(_mm256_loadu_ps(oi + g * o_stride + d), sv));
        }
    }
}

/* Split partials (part_q8_ref's contract): the group's query heads four at a time over one chunk. */
T256 static void part_q8_256(const kv_view *kv, const float *q, int64_t q_stride, int nq, int32_t j0, int32_t j1,
                             float *part, float *scratch) {
    const int64_t ps = kv->vd + 2;
    const int32_t e[4] = {j1, j1, j1, j1};
    for (int i = 0; i < nq; i += 4) {
        const int nb = nq - i < 4 ? nq - i : 4;
        float mx[4], sum[4];
        float *pi = part + i * ps;
        q8_group_256(kv, q + i * q_stride, q_stride, nb, j0, e, scratch, mx, sum, pi + 2, ps);
        for (int g = 0; g < nb; g++) pi[g * ps] = mx[g], pi[g * ps + 1] = sum[g];
    }
}

attn_fn st_attn_avx512(void) { return attn_avx512; }
attn_fn st_attn_avx2(void) { return attn_avx2; }
attn_part_fn st_attn_part_avx2(void) { return part_256; }
attn_part_fn st_attn_part_avx512(void) { return part_512; }
attn_fn st_attn_q8_avx2(void) { return attn_q8_256; }
attn_part_fn st_attn_part_q8_avx2(void) { return part_q8_256; }
#else
attn_fn st_attn_avx512(void) { return NULL; }
attn_fn st_attn_avx2(void) { return NULL; }
attn_part_fn st_attn_part_avx2(void) { return NULL; }
attn_part_fn st_attn_part_avx512(void) { return NULL; }
attn_fn st_attn_q8_avx2(void) { return NULL; }
attn_part_fn st_attn_part_q8_avx2(void) { return NULL; }
#endif

size_t st_attn_scratch_floats(int hd, int32_t max_keys) {
    return (size_t)2 * (size_t)hd * LANES + ((size_t)max_keys + LANES) * LANES;
}
