/* Rotary embedding's per-pair angles and magnitude factor, rope scaling included (none / linear / YaRN, the rule
 * beside strata.h's rope_* fields): one definition for both engines (model.c, cuda/model.cu), so that the CPU and
 * the GPU rotate by the same floats. Host code only. */
#ifndef STRATA_ROPE_TABLE_H
#define STRATA_ROPE_TABLE_H

#include <math.h>

#include "strata.h"

/* YaRN's correction dimension: the pair index whose wavelength fits n_rot times into the
 * original context (ggml_rope_yarn_corr_dim, in float as ggml computes it). */
static inline float yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return (float)n_dims * logf((float)n_ctx_orig / (n_rot * 2.0f * 3.14159265358979f)) / (2.0f * logf(base));
}

/* Each rotary pair's angle per position and the magnitude factor, rope scaling included (the
 * rule is in strata.h beside the rope_* fields). The descriptor is validated. */
static inline void rope_table(const st_model_desc *d, float *inv_freq, float *mscale) {
    const int n_dims = d->rope_dim;
    const float fs = d->rope_freq_scale > 0.0f ? d->rope_freq_scale : 1.0f;
    const float ext = d->rope_ext_factor;
    float lo = 0.0f, hi = 0.0f, ms = d->rope_attn_factor > 0.0f ? d->rope_attn_factor : 1.0f;
    if (ext != 0.0f) {
        const float start = floorf(yarn_corr_dim(n_dims, d->rope_n_ctx_orig, d->rope_beta_fast, d->rope_base));
        const float end = ceilf(yarn_corr_dim(n_dims, d->rope_n_ctx_orig, d->rope_beta_slow, d->rope_base));
        lo = start > 0.0f ? start : 0.0f;
        hi = end < (float)(n_dims - 1) ? end : (float)(n_dims - 1);
        ms *= 1.0f + 0.1f * logf(1.0f / fs);
    }
    for (int i = 0; i < n_dims / 2; i++) {
        const double extrap = 1.0 / pow((double)d->rope_base, (double)(2 * i) / (double)n_dims);
        double mix = 0.0;
        if (ext != 0.0f) {
            const float span = hi - lo > 0.001f ? hi - lo : 0.001f;
            float y = ((float)i - lo) / span;
            y = y < 0.0f ? 0.0f : (y > 1.0f ? 1.0f : y);
            mix = (double)((1.0f - y) * ext);
        }
        inv_freq[i] = (float)(extrap * ((double)fs * (1.0 - mix) + mix));
    }
    *mscale = ms;
}

#endif
