/* The model: validation of the descriptor handed over from Python, creation and
 * destruction, and the scratch buffers a step works in.
 *
 * Nothing in the descriptor is trusted. Hyper-parameters are bounded (ST_MAX_*) and
 * products of them are formed in 64 bits before anything is sized by them; every
 * tensor's type and shape are checked against the hyper-parameters, its byte length
 * against its type and shape, and its byte range against the mapping it lives in. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"
#include "rope_table.h"

/* ------------------------------------------------------------------ validation */

static void scratch_free(scratch *s);

/* Bytes of a tensor of `type` and shape ne, or -1 when the shape is impossible (an
 * extent < 1 or > ST_MAX_DIM, a row not made of whole blocks, a size past 2^63). */
static int64_t tensor_bytes(int32_t type, const int64_t ne[4]) {
    const int32_t be = st_type_block_elems(type), bb = st_type_block_bytes(type);
    if (be <= 0 || bb <= 0) return -1;
    for (int i = 0; i < 4; i++)
        if (ne[i] < 1 || ne[i] > ST_MAX_DIM) return -1;
    if (ne[0] % be) return -1;
    int64_t bytes = ne[0] / be * bb; /* one row: at most 2^40 / 1 * 34 */
    for (int i = 1; i < 4; i++)
        if (__builtin_mul_overflow(bytes, ne[i], &bytes)) return -1;
    return bytes;
}

/* Checks one tensor: present when required, of a supported type (F32 for float_only),
 * of shape [ne0, ne1, ne2] in its first n_dims dimensions and 1 beyond, rows the
 * kernels accept, n_bytes equal to what type and shape imply, and the bytes inside
 * the mapping. */
static st_status check_tensor(const st_model_desc *d, const st_tensor *t, const char *what, int layer,
                              int required, int n_dims, int64_t ne0, int64_t ne1, int64_t ne2, int float_only) {
    char where[96];
    if (layer < 0) snprintf(where, sizeof where, "model: tensor %s", what);
    else snprintf(where, sizeof where, "layer %d: tensor %s", layer, what);
    if (!t->data) {
        if (required) return st_fail(ST_EINVAL, "%s is missing", where);
        return ST_OK;
    }
    if (!st_type_supported(t->type))
        return st_fail(ST_EUNSUPPORTED, "%s has unsupported quant type %d", where, t->type);
    if (float_only && t->type != ST_TYPE_F32)
        return st_fail(ST_EUNSUPPORTED, "%s must be F32 (got type %d)", where, t->type);
    if (t->n_dims < 1 || t->n_dims > 4) return st_fail(ST_EINVAL, "%s has %d dims", where, t->n_dims);
    const int64_t want[3] = {ne0, ne1, ne2};
    for (int i = 0; i < n_dims; i++) {
        if (t->ne[i] != want[i])
            return st_fail(ST_EINVAL, "%s has ne[%d]=%lld, expected %lld", where, i, (long long)t->ne[i],
                           (long long)want[i]);
    }
    for (int i = n_dims; i < 4; i++) {
        if (t->ne[i] != 1) return st_fail(ST_EINVAL, "%s has %d dims, expected %d", where, t->n_dims, n_dims);
    }
    if (t->ne[0] % st_type_block_elems(t->type))
        return st_fail(ST_EINVAL, "%s row length %lld is not a multiple of its block size %d", where,
                       (long long)t->ne[0], st_type_block_elems(t->type));
    if (t->ne[0] > ST_MAX_ROW)
        return st_fail(ST_EUNSUPPORTED, "%s row length %lld exceeds %d", where, (long long)t->ne[0], ST_MAX_ROW);
    if (!st_type_is_float(t->type) && t->ne[0] % QK)
        return st_fail(ST_EINVAL, "%s row length %lld is not a multiple of 32", where, (long long)t->ne[0]);
    const int64_t bytes = tensor_bytes(t->type, t->ne);
    if (bytes < 0)
        return st_fail(ST_ERANGE, "%s has an impossible shape [%lld, %lld, %lld, %lld]", where, (long long)t->ne[0],
                       (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3]);
    if (t->n_bytes != bytes)
        return st_fail(ST_EINVAL, "%s holds %lld bytes, its type and shape need %lld", where, (long long)t->n_bytes,
                       (long long)bytes);
    const uintptr_t base = (uintptr_t)d->map_data, p = (uintptr_t)t->data;
    if (p < base || p - base > (uint64_t)d->map_bytes || (uint64_t)d->map_bytes - (p - base) < (uint64_t)bytes)
        return st_fail(ST_ERANGE, "%s (%lld bytes at offset %lld) lies outside the model file's %lld bytes", where,
                       (long long)bytes, (long long)(p - base), (long long)d->map_bytes);
    return ST_OK;
}

/* The routing fields of a descriptor (also st_route's arguments). */
st_status st_check_routing(const st_model_desc *d) {
    if (d->gating < 0 || d->gating > ST_GATING_SOFTMAX_WEIGHT)
        return st_fail(ST_EUNSUPPORTED, "model: expert gating function %d unsupported (1 softmax, 2 sigmoid, 3 softmax "
                                        "of the chosen)", d->gating);
    if (!isfinite(d->expert_weights_scale) || d->expert_weights_scale < 0.0f)
        return st_fail(ST_EINVAL, "model: expert weights scale %g invalid", (double)d->expert_weights_scale);
    if (d->n_expert_group < 0 || d->n_group_used < 0 || (d->n_expert == 0 && d->n_expert_group > 1))
        return st_fail(ST_EINVAL, "model: expert groups %d / %d invalid for expert_count %d", d->n_expert_group,
                       d->n_group_used, d->n_expert);
    if (d->n_expert_group > 1) {
        /* the rules llama.cpp checks at load, plus enough eligible experts for the top k */
        if (d->n_expert_group >= d->n_expert || d->n_expert % d->n_expert_group || d->n_group_used < 1 ||
            d->n_group_used >= d->n_expert_group ||
            (int64_t)d->n_group_used * (d->n_expert / d->n_expert_group) < d->n_expert_used)
            return st_fail(ST_EINVAL,
                           "model: %d expert groups with %d used invalid for %d experts, top-%d (groups must divide "
                           "the experts, 0 < used < groups, and the used groups hold at least top-k experts)",
                           d->n_expert_group, d->n_group_used, d->n_expert, d->n_expert_used);
    }
    return ST_OK;
}


/* The latent attention's fields (deepseek2 has them, no other architecture does). Its cached row
 * (kv_lora_rank + rope_dim) is attended as one head, so it is bounded like a head and its parts
 * are multiples of 16 (the attention kernels' vectors). */
static st_status check_mla(const st_model_desc *d) {
    const int mla = d->arch == ST_ARCH_DEEPSEEK2;
    if (!mla) {
        if (d->kv_lora_rank || d->q_lora_rank || d->head_dim_v)
            return st_fail(ST_EINVAL, "model: latent attention fields (kv_lora_rank %d, q_lora_rank %d, head_dim_v %d) "
                                      "set for arch %d", d->kv_lora_rank, d->q_lora_rank, d->head_dim_v, d->arch);
        return ST_OK;
    }
    if (d->kv_lora_rank < 1)
        return st_fail(ST_EINVAL, "model: latent attention needs kv_lora_rank >= 1, got %d", d->kv_lora_rank);
    if (d->kv_lora_rank % 16 || d->rope_dim % 16 ||
        d->kv_lora_rank + d->rope_dim > ST_MAX_HEAD_DIM)
        return st_fail(ST_EUNSUPPORTED, "model: latent rank %d with %d rotary dims unsupported (both multiples of 16, "
                                        "together at most %d)", d->kv_lora_rank, d->rope_dim, ST_MAX_HEAD_DIM);
    if (d->q_lora_rank < 0 || d->q_lora_rank > ST_MAX_ROW || d->head_dim_v < 1 || d->head_dim_v > ST_MAX_HEAD_DIM ||
        (int64_t)d->n_head * d->head_dim_v > ST_MAX_ROW || d->rope_dim >= d->head_dim)
        return st_fail(ST_EINVAL, "model: latent attention q_lora_rank %d / head_dim_v %d / rope %d of head_dim %d "
                                  "invalid", d->q_lora_rank, d->head_dim_v, d->rope_dim, d->head_dim);
    if (d->n_head_kv != 1)
        return st_fail(ST_EINVAL, "model: latent attention caches one shared row: n_head_kv must be 1, got %d",
                       d->n_head_kv);
    /* llama.cpp scales deepseek2's attention logits by its own rule whenever the rope is scaled
     * (mscale^2 from rope.scaling.yarn_log_multiplier); that rule is not implemented here. */
    if ((d->rope_freq_scale != 0.0f && d->rope_freq_scale != 1.0f) || d->rope_ext_factor != 0.0f ||
        (d->rope_attn_factor != 0.0f && d->rope_attn_factor != 1.0f))
        return st_fail(ST_EUNSUPPORTED, "model: rotary scaling (freq_scale %g, ext_factor %g, attn_factor %g) with "
                                        "latent attention is not supported", (double)d->rope_freq_scale,
                       (double)d->rope_ext_factor, (double)d->rope_attn_factor);
    if (d->n_swa > 0 || d->n_nextn > 0)
        return st_fail(ST_EUNSUPPORTED, "model: sliding windows or NextN layers with latent attention unsupported");
    return ST_OK;
}

/* Hyper-parameters alone, before anything is allocated from them. */
static st_status check_hparams(const st_model_desc *d) {
    if (d->arch < ST_ARCH_LLAMA || d->arch > ST_ARCH_DEEPSEEK2) return st_fail(ST_EUNSUPPORTED, "model: arch %d", d->arch);
    if (d->n_layer < 1 || d->n_layer > ST_MAX_LAYERS || d->n_embd < 1 || d->n_embd > ST_MAX_ROW || d->n_head < 1 ||
        d->n_head > ST_MAX_HEADS || d->n_head_kv < 1 || d->n_head_kv > d->n_head || d->head_dim < 2 ||
        d->head_dim > ST_MAX_HEAD_DIM || d->n_vocab < 1 || d->n_vocab > ST_MAX_VOCAB)
        return st_fail(ST_EINVAL, "model: bad hyper-parameters (layers=%d embd=%d heads=%d/%d head_dim=%d vocab=%d)",
                       d->n_layer, d->n_embd, d->n_head, d->n_head_kv, d->head_dim, d->n_vocab);
    if (d->n_head % d->n_head_kv)
        return st_fail(ST_EINVAL, "model: head count %d is not a multiple of kv head count %d", d->n_head, d->n_head_kv);
    if (d->head_dim % 16) return st_fail(ST_EUNSUPPORTED, "model: head_dim %d is not a multiple of 16", d->head_dim);
    const int64_t q_dim = (int64_t)d->n_head * d->head_dim; /* <= 2^20, and the row length of attn_output */
    if (q_dim > ST_MAX_ROW)
        return st_fail(ST_EUNSUPPORTED, "model: %d heads x %d = %lld exceeds the longest row %d", d->n_head,
                       d->head_dim, (long long)q_dim, ST_MAX_ROW);
    if (d->rope_dim < 2 || d->rope_dim > d->head_dim || d->rope_dim % 2)
        return st_fail(ST_EINVAL, "model: rope dimension %d invalid for head_dim %d", d->rope_dim, d->head_dim);
    if (d->rope_type != ST_ROPE_NORM && d->rope_type != ST_ROPE_NEOX)
        return st_fail(ST_EUNSUPPORTED, "model: rope type %d unsupported", d->rope_type);
    if (!isfinite(d->rope_base) || d->rope_base <= 0.0f || !isfinite(d->norm_eps) || d->norm_eps < 0.0f)
        return st_fail(ST_EINVAL, "model: rope base %g / norm epsilon %g invalid", (double)d->rope_base,
                       (double)d->norm_eps);
    {
        const float fs = d->rope_freq_scale, ext = d->rope_ext_factor, att = d->rope_attn_factor;
        if (!isfinite(fs) || fs < 0.0f || fs > 1e6f || !isfinite(ext) || ext < 0.0f || ext > 1e3f || !isfinite(att) ||
            att < 0.0f || att > 1e3f || !isfinite(d->rope_beta_fast) || !isfinite(d->rope_beta_slow))
            return st_fail(ST_EINVAL, "model: rope scaling invalid (freq_scale %g, ext_factor %g, attn_factor %g, "
                                      "beta_fast %g, beta_slow %g)", (double)fs, (double)ext, (double)att,
                           (double)d->rope_beta_fast, (double)d->rope_beta_slow);
        if (ext != 0.0f && (d->rope_n_ctx_orig < 1 || d->rope_beta_fast <= 0.0f || d->rope_beta_slow <= 0.0f))
            return st_fail(ST_EINVAL, "model: YaRN needs an original context >= 1 and positive betas (got %d, %g, %g)",
                           d->rope_n_ctx_orig, (double)d->rope_beta_fast, (double)d->rope_beta_slow);
    }
    if (d->n_expert < 0 || d->n_expert > ST_MAX_EXPERTS || d->n_expert_used < 0 ||
        (d->n_expert > 0 && (d->n_expert_used < 1 || d->n_expert_used > d->n_expert ||
                             d->n_expert_used > ST_MAX_EXPERTS_USED)) ||
        (d->n_expert == 0 && d->n_expert_used != 0))
        return st_fail(ST_EINVAL, "model: expert_used_count %d invalid for expert_count %d", d->n_expert_used,
                       d->n_expert);
    CHECK(st_check_routing(d));
    if (d->n_dense_lead < 0 || d->n_dense_lead > d->n_layer)
        return st_fail(ST_EINVAL, "model: %d leading dense layers out of range [0, %d]", d->n_dense_lead, d->n_layer);
    if (d->n_nextn < 0 || d->n_nextn > ST_MAX_LAYERS || (d->n_nextn > 0 && (!d->nextn_layers || !d->nextn)))
        return st_fail(ST_EINVAL, "model: %d NextN layers without their descriptors", d->n_nextn);
    if (!d->map_data || d->map_bytes < 1)
        return st_fail(ST_EINVAL, "model: the mapping the tensors live in is not given (map_data/map_bytes)");
    if (!d->layers) return st_fail(ST_EINVAL, "model: layers is NULL");
    if (d->n_swa < 0 || d->swa_pattern < 0)
        return st_fail(ST_EINVAL, "model: sliding window %d / pattern %d invalid", d->n_swa, d->swa_pattern);
    return check_mla(d);
}

/* A SwiGLU FFN of layer il: gate and up [n_embd -> ff], down [ff -> n_embd], stacked
 * n_exp times (routed experts) or single (n_exp = 0). ff comes from gate's rows: at most
 * a kernel row, since down takes it as its row length, and the same in every layer of its
 * kind (*width holds that of layer `first`, the first of the kind; 0 while unset, so a
 * layer with it when the first had none differs too). */
static st_status check_ffn(const st_model_desc *d, int il, int first, const char *const names[3], const st_tensor *gate,
                           const st_tensor *up, const st_tensor *down, int64_t n_exp, int32_t *width) {
    const int64_t E = d->n_embd, ff = gate->data ? gate->ne[1] : 0, n = n_exp ? n_exp : 1;
    const int n_dims = n_exp ? 3 : 2;
    CHECK(check_tensor(d, gate, names[0], il, 1, n_dims, E, ff, n, 0));
    if (ff < 1 || ff > ST_MAX_ROW)
        return st_fail(ST_EINVAL, "layer %d: %s width %lld out of range [1, %d]", il, names[0], (long long)ff,
                       ST_MAX_ROW);
    if (il == first) *width = (int32_t)ff;
    if (ff != *width)
        return st_fail(ST_EINVAL, "layer %d: %s width %lld differs from layer %d's %d", il, names[0], (long long)ff,
                       first, *width);
    CHECK(check_tensor(d, up, names[1], il, 1, n_dims, E, ff, n, 0));
    CHECK(check_tensor(d, down, names[2], il, 1, n_dims, ff, E, n, 0));
    return ST_OK;
}

/* deepseek2's attention tensors (see st_layer). */
static st_status check_mla_layer(st_model *m, const st_layer *L, int il) {
    const st_model_desc *d = &m->d;
    const int64_t E = d->n_embd, H = d->n_head, ql = d->q_lora_rank, kl = d->kv_lora_rank;
    const int64_t nope = d->head_dim - d->rope_dim, vd = d->head_dim_v;
    if (ql > 0) {
        CHECK(check_tensor(d, &L->wq_a, "attn_q_a", il, 1, 2, E, ql, 1, 0));
        CHECK(check_tensor(d, &L->q_a_norm, "attn_q_a_norm", il, 1, 1, ql, 1, 1, 1));
        CHECK(check_tensor(d, &L->wq_b, "attn_q_b", il, 1, 2, ql, m->q_dim, 1, 0));
    } else {
        CHECK(check_tensor(d, &L->wq, "attn_q", il, 1, 2, E, m->q_dim, 1, 0));
    }
    CHECK(check_tensor(d, &L->wkv_a, "attn_kv_a_mqa", il, 1, 2, E, kl + d->rope_dim, 1, 0));
    CHECK(check_tensor(d, &L->kv_a_norm, "attn_kv_a_norm", il, 1, 1, kl, 1, 1, 1));
    if (L->wk_b.data || L->wv_b.data || !L->wkv_b.data) {
        if (L->wkv_b.data)
            return st_fail(ST_EINVAL, "layer %d: attn_kv_b and the split attn_k_b / attn_v_b together", il);
        CHECK(check_tensor(d, &L->wk_b, "attn_k_b", il, 1, 3, nope, kl, H, 0));
        CHECK(check_tensor(d, &L->wv_b, "attn_v_b", il, 1, 3, kl, vd, H, 0));
    } else {
        CHECK(check_tensor(d, &L->wkv_b, "attn_kv_b", il, 1, 2, kl, H * (nope + vd), 1, 0));
    }
    CHECK(check_tensor(d, &L->wo, "attn_output", il, 1, 2, m->o_in, E, 1, 0));
    return ST_OK;
}

/* The q/k/v attention tensors of every other architecture. */
static st_status check_attn_layer(st_model *m, const st_layer *L, int il) {
    const st_model_desc *d = &m->d;
    const int64_t E = d->n_embd;
    CHECK(check_tensor(d, &L->wq, "attn_q", il, 1, 2, E, m->q_dim, 1, 0));
    CHECK(check_tensor(d, &L->wk, "attn_k", il, 1, 2, E, m->kv_dim, 1, 0));
    CHECK(check_tensor(d, &L->wv, "attn_v", il, 1, 2, E, m->kv_dim, 1, 0));
    CHECK(check_tensor(d, &L->wo, "attn_output", il, 1, 2, m->q_dim, E, 1, 0));
    const int oss = d->arch == ST_ARCH_GPT_OSS; /* llama.cpp requires its biases and sinks */
    CHECK(check_tensor(d, &L->bq, "attn_q.bias", il, oss, 1, m->q_dim, 1, 1, 1));
    CHECK(check_tensor(d, &L->bk, "attn_k.bias", il, oss, 1, m->kv_dim, 1, 1, 1));
    CHECK(check_tensor(d, &L->bv, "attn_v.bias", il, oss, 1, m->kv_dim, 1, 1, 1));
    CHECK(check_tensor(d, &L->bo, "attn_output.bias", il, oss, 1, E, 1, 1, 1));
    CHECK(check_tensor(d, &L->sinks, "attn_sinks", il, oss, 1, d->n_head, 1, 1, 1));
    const int qk_norm = d->arch == ST_ARCH_QWEN3MOE;
    CHECK(check_tensor(d, &L->q_norm, "attn_q_norm", il, qk_norm, 1, d->head_dim, 1, 1, 1));
    CHECK(check_tensor(d, &L->k_norm, "attn_k_norm", il, qk_norm, 1, d->head_dim, 1, 1, 1));
    if (!L->q_norm.data != !L->k_norm.data)
        return st_fail(ST_EINVAL, "layer %d: attn_q_norm and attn_k_norm come together", il);
    return ST_OK;
}

/* One transformer block (a forward layer, or the block of a NextN layer: il >= n_layer). */
static st_status check_layer(st_model *m, const st_layer *L, int il) {
    const st_model_desc *d = &m->d;
    const int64_t E = d->n_embd;
    const int oss = d->arch == ST_ARCH_GPT_OSS; /* llama.cpp requires its biases */
    CHECK(check_tensor(d, &L->attn_norm, "attn_norm", il, 1, 1, E, 1, 1, 1));
    CHECK(d->kv_lora_rank > 0 ? check_mla_layer(m, L, il) : check_attn_layer(m, L, il));
    CHECK(check_tensor(d, &L->ffn_norm, "ffn_norm", il, 1, 1, E, 1, 1, 1));
    if (d->n_expert > 0 && il >= d->n_dense_lead) {
        const int first = d->n_dense_lead; /* the first routed layer sets the widths */
        CHECK(check_tensor(d, &L->gate_inp, "ffn_gate_inp", il, 1, 2, E, d->n_expert, 1, 0));
        CHECK(check_tensor(d, &L->exp_probs_b, "exp_probs_b", il, 0, 1, d->n_expert, 1, 1, 1));
        static const char *exps[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
        CHECK(check_ffn(d, il, first, exps, &L->gate_exps, &L->up_exps, &L->down_exps, d->n_expert, &m->n_ff_exp));
        CHECK(check_tensor(d, &L->gate_inp_b, "ffn_gate_inp.bias", il, oss, 1, d->n_expert, 1, 1, 1));
        CHECK(check_tensor(d, &L->gate_exps_b, "ffn_gate_exps.bias", il, oss, 2, m->n_ff_exp, d->n_expert, 1, 1));
        CHECK(check_tensor(d, &L->up_exps_b, "ffn_up_exps.bias", il, oss, 2, m->n_ff_exp, d->n_expert, 1, 1));
        CHECK(check_tensor(d, &L->down_exps_b, "ffn_down_exps.bias", il, oss, 2, E, d->n_expert, 1, 1));
        if (L->gate_shexp.data || m->n_ff_shexp) {
            static const char *shexp[3] = {"ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"};
            CHECK(check_ffn(d, il, first, shexp, &L->gate_shexp, &L->up_shexp, &L->down_shexp, 0, &m->n_ff_shexp));
            CHECK(check_tensor(d, &L->gate_inp_shexp, "ffn_gate_inp_shexp", il, 0, 1, E, 1, 1, 1));
        }
    } else {
        static const char *dense[3] = {"ffn_gate", "ffn_up", "ffn_down"};
        CHECK(check_ffn(d, il, 0, dense, &L->ffn_gate, &L->ffn_up, &L->ffn_down, 0, &m->n_ff));
    }
    return ST_OK;
}

/* A NextN layer's head (layer il = n_layer + i). */
static st_status check_nextn(const st_model_desc *d, const st_nextn *n, int il) {
    const int64_t E = d->n_embd;
    CHECK(check_tensor(d, &n->eh_proj, "nextn.eh_proj", il, 1, 2, 2 * E, E, 1, 0));
    CHECK(check_tensor(d, &n->enorm, "nextn.enorm", il, 1, 1, E, 1, 1, 1));
    CHECK(check_tensor(d, &n->hnorm, "nextn.hnorm", il, 1, 1, E, 1, 1, 1));
    CHECK(check_tensor(d, &n->embed_tokens, "nextn.embed_tokens", il, 0, 2, E, d->n_vocab, 1, 0));
    CHECK(check_tensor(d, &n->shared_head_head, "nextn.shared_head_head", il, 0, 2, E, d->n_vocab, 1, 0));
    CHECK(check_tensor(d, &n->shared_head_norm, "nextn.shared_head_norm", il, 0, 1, E, 1, 1, 1));
    return ST_OK;
}

static st_status validate(st_model *m) {
    const st_model_desc *d = &m->d;
    const int64_t E = d->n_embd;
    CHECK(check_tensor(d, &d->token_embd, "token_embd", -1, 1, 2, E, d->n_vocab, 1, 0));
    CHECK(check_tensor(d, &d->output_norm, "output_norm", -1, 1, 1, E, 1, 1, 1));
    CHECK(check_tensor(d, &d->output, "output", -1, 1, 2, E, d->n_vocab, 1, 0));
    m->n_ff = m->n_ff_exp = m->n_ff_shexp = 0;
    for (int il = 0; il < d->n_layer; il++) CHECK(check_layer(m, &m->layers[il], il));
    for (int i = 0; i < d->n_nextn; i++) {
        CHECK(check_layer(m, &m->nextn_layers[i], d->n_layer + i));
        CHECK(check_nextn(d, &m->nextn[i], d->n_layer + i));
    }
    return ST_OK;
}

st_status st_model_create(const st_model_desc *desc, st_model **out) {
    if (!desc || !out) return st_fail(ST_EINVAL, "model_create: NULL argument");
    *out = NULL;
    CHECK(check_hparams(desc));
    st_model *m = calloc(1, sizeof *m);
    if (!m) return st_fail(ST_ENOMEM, "model_create: out of memory");
    m->d = *desc;
    m->layers = calloc((size_t)desc->n_layer, sizeof *m->layers);
    if (!m->layers) {
        free(m);
        return st_fail(ST_ENOMEM, "model_create: out of memory");
    }
    memcpy(m->layers, desc->layers, (size_t)desc->n_layer * sizeof *m->layers);
    m->d.layers = m->layers;
    if (desc->n_nextn > 0) { /* copied like the layers: the descriptor's arrays are only borrowed */
        m->nextn_layers = calloc((size_t)desc->n_nextn, sizeof *m->nextn_layers);
        m->nextn = calloc((size_t)desc->n_nextn, sizeof *m->nextn);
        if (!m->nextn_layers || !m->nextn) {
            st_model_destroy(m);
            return st_fail(ST_ENOMEM, "model_create: out of memory");
        }
        memcpy(m->nextn_layers, desc->nextn_layers, (size_t)desc->n_nextn * sizeof *m->nextn_layers);
        memcpy(m->nextn, desc->nextn, (size_t)desc->n_nextn * sizeof *m->nextn);
    }
    m->d.nextn_layers = m->nextn_layers;
    m->d.nextn = m->nextn;
    m->q_dim = desc->n_head * desc->head_dim; /* bounded by check_hparams */
    m->kv_dim = desc->n_head_kv * desc->head_dim;
    if (desc->kv_lora_rank > 0) { /* one cached latent row, queries absorbed into it */
        m->c_n_kv = 1;
        m->c_hd_k = desc->kv_lora_rank + desc->rope_dim;
        m->c_hd_v = desc->kv_lora_rank;
        m->o_in = desc->n_head * desc->head_dim_v;
    } else {
        m->c_n_kv = desc->n_head_kv;
        m->c_hd_k = m->c_hd_v = desc->head_dim;
        m->o_in = m->q_dim;
    }
    m->c_q_dim = (int64_t)desc->n_head * m->c_hd_k;
    m->c_o_dim = (int64_t)desc->n_head * m->c_hd_v;
    st_status rc = validate(m);
    if (rc == ST_OK && desc->kv_lora_rank > 0) rc = st_mla_prepare(m);
    if (rc != ST_OK) {
        st_model_destroy(m);
        return rc;
    }
    m->max_k = m->d.n_embd;
    if (m->q_dim > m->max_k) m->max_k = m->q_dim;
    /* latent attention: the low ranks, and the per-head rows of the absorption and expansion
     * (T * n_head rows of nope and of kv_lora_rank share the layer-input buffers) */
    if (m->d.q_lora_rank > m->max_k) m->max_k = m->d.q_lora_rank;
    if (m->d.kv_lora_rank > m->max_k) m->max_k = m->d.kv_lora_rank;
    if (m->o_in > m->max_k) m->max_k = m->o_in;
    if (m->d.kv_lora_rank > 0 && m->c_o_dim > m->max_k) m->max_k = (int32_t)m->c_o_dim;
    if (m->n_ff > m->max_k) m->max_k = m->n_ff;
    if (m->n_ff_shexp > m->max_k) m->max_k = m->n_ff_shexp;
    m->inv_freq = malloc(sizeof(float) * (size_t)(m->d.rope_dim / 2));
    if (!m->inv_freq) {
        st_model_destroy(m);
        return st_fail(ST_ENOMEM, "model_create: out of memory");
    }
    rope_table(&m->d, m->inv_freq, &m->rope_mscale);
    *out = m;
    return ST_OK;
}

/* ------------------------------------------------------------------ repacking */

static int repackable(const st_tensor *t) {
    return t->data && (t->type == ST_TYPE_Q4_1 || t->type == ST_TYPE_Q8_0) &&
           t->ne[1] % ST_R8_ROWS == 0; /* no group spans two experts */
}

/* The tensors st_model_repack considers: every Q4_1 or Q8_0 matrix the step reads through
 * the quantised kernels (not token_embd, which is read row by row). */
static int repack_list(st_model *m, st_tensor **out) {
    int n = 0;
    for (int il = 0; il < m->d.n_layer; il++) {
        st_layer *L = &m->layers[il];
        st_tensor *c[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->ffn_gate, &L->ffn_up, &L->ffn_down, &L->gate_exps,
                          &L->up_exps, &L->down_exps, &L->gate_shexp, &L->up_shexp, &L->down_shexp};
        for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
            if (repackable(c[i])) out[n++] = c[i];
    }
    if (repackable(&m->d.output) && m->d.output.data != m->d.token_embd.data) out[n++] = &m->d.output;
    return n;
}

/* Why: with plain Q4_1 the kernel gathers each 8-row block from eight rows 360-960 bytes
 * apart and transposes them; repacked, a row block is one contiguous stream of 160-byte
 * blocks loaded as is (same registers, same bits). Resident memory stays near the file's
 * size: the repacked copy replaces the file pages, which are dropped from this process
 * (they stay in the page cache, reclaimable). The copy is private to the process while
 * the file's pages are shared by every lane that maps it, so tensors are repacked, in list
 * order, only while the copy stays within an eighth of physical memory: a large model keeps
 * the shared file layout for the rest instead of one anonymous copy per lane. */
void st_model_repack(st_model *m) {
    if (m->repack_done) return;
    m->repack_done = 1;
    const char *env = getenv("STRATA_REPACK");
    if (env && env[0] == '0') return;
    st_tensor **list = malloc(sizeof(st_tensor *) * ((size_t)m->d.n_layer * 13 + 1));
    if (!list) return;
    const int all = repack_list(m, list);
    const long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    const size_t cap = pages > 0 && psz > 0 ? (size_t)pages / 8 * (size_t)psz : (size_t)1 << 30;
    size_t total = 0;
    int n = 0;
    for (int i = 0; i < all; i++)
        if (total + (size_t)list[i]->n_bytes <= cap) total += (size_t)list[i]->n_bytes, list[n++] = list[i];
    if (!total) {
        free(list);
        return;
    }
    void *buf = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (buf == MAP_FAILED) { /* keep the file's tensors */
        free(list);
        return;
    }
    const long page = sysconf(_SC_PAGESIZE);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        st_tensor *t = list[i];
        uint8_t *dst = (uint8_t *)buf + off;
        const int64_t rows = t->ne[1] * t->ne[2] * t->ne[3]; /* shape checked: the repack cannot fail */
        st_repack_rows(t->type, t->data, dst, rows, t->ne[0]);
        /* drop the file pages wholly inside this tensor from the process (not from the file) */
        const uintptr_t lo = ((uintptr_t)t->data + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
        const uintptr_t hi = ((uintptr_t)t->data + (uintptr_t)t->n_bytes) & ~((uintptr_t)page - 1);
        if (page > 0 && hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
        t->data = dst;
        t->type = st_r8_of(t->type);
        off += (size_t)t->n_bytes;
    }
    free(list);
    m->repack = buf;
    m->repack_bytes = total;
}

size_t st_model_repacked_bytes(const st_model *m) { return m ? m->repack_bytes : 0; }

int32_t st_model_nextn_layers(const st_model *m) { return m ? m->d.n_nextn : -1; }

void st_model_destroy(st_model *m) {
    if (!m) return;
    scratch_free(&m->s);
    free(m->picks);
    free(m->tok_buf);
    free(m->inv_freq);
    if (m->repack) munmap(m->repack, m->repack_bytes);
    free(m->layers);
    free(m->mla_kb);
    free(m->mla_kb_buf);
    free(m->nextn_layers);
    free(m->nextn);
    free(m);
}

/* ------------------------------------------------------------------ scratch */

static void scratch_free(scratch *s) {
    void *ptrs[] = {s->x, s->xn, s->q, s->k, s->v, s->att, s->tmp, s->router, s->topk_w, s->scores, s->gate_shexp,
                    s->aq, s->ad, s->ad4, s->axs, s->as, s->topk_id, s->h, s->pair_out, s->hq, s->hd, s->hd4,
                    s->hxs, s->hs, s->pair_tok, s->akq, s->akd, s->akb, s->hkq, s->hkd, s->hkb,
                    s->pairs_by_expert, s->expert_start, s->tiles, s->rtiles, s->split, s->parts,
                    (void *)s->left, s->logits, s->mqa, s->mq, s->mkv, s->mg, s->mo};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) free(ptrs[i]);
    memset(s, 0, sizeof *s);
}

/* Grow the scratch buffers to hold T tokens (and their expert pairs). */
st_status st_scratch_ensure(st_model *m, size_t T, size_t n_threads, size_t ctx) {
    scratch *s = &m->s;
    const st_model_desc *d = &m->d;
    const size_t k = d->n_expert > 0 ? (size_t)d->n_expert_used : 1;
    const size_t P = T * k + T; /* routed pairs + one shared/dense pair per token */
    const size_t ffw = (size_t)(m->n_ff_exp > m->n_ff ? m->n_ff_exp : m->n_ff);
    const size_t ffmax = ffw > (size_t)m->n_ff_shexp ? ffw : (size_t)m->n_ff_shexp;
    if (T > s->cap_tokens) {
        scratch_free(s);
        const size_t E = (size_t)d->n_embd, K = (size_t)m->max_k, ne = d->n_expert > 0 ? (size_t)d->n_expert : 1;
        s->x = malloc(sizeof(float) * T * E);
        s->xn = malloc(sizeof(float) * T * E);
        s->q = malloc(sizeof(float) * T * (size_t)m->c_q_dim);
        s->k = malloc(sizeof(float) * T * (size_t)m->kv_dim);
        s->v = malloc(sizeof(float) * T * (size_t)m->kv_dim);
        s->att = malloc(sizeof(float) * T * (size_t)m->c_o_dim);
        s->tmp = malloc(sizeof(float) * T * (E > (size_t)m->q_dim ? E : (size_t)m->q_dim));
        int mla_ok = 1;
        if (d->kv_lora_rank > 0) {
            const size_t H = (size_t)d->n_head, nope = (size_t)(d->head_dim - d->rope_dim);
            s->mqa = malloc(sizeof(float) * T * (size_t)(d->q_lora_rank > 0 ? d->q_lora_rank : 1));
            s->mq = malloc(sizeof(float) * T * (size_t)m->q_dim);
            s->mkv = malloc(sizeof(float) * T * (size_t)m->c_hd_k);
            s->mg = malloc(sizeof(float) * T * H * nope);
            s->mo = malloc(sizeof(float) * T * (size_t)m->o_in);
            mla_ok = s->mqa && s->mq && s->mkv && s->mg && s->mo;
        }
        s->router = malloc(sizeof(float) * T * ne);
        s->topk_w = malloc(sizeof(float) * T * k);
        s->topk_id = malloc(sizeof(int32_t) * T * k);
        s->gate_shexp = malloc(sizeof(float) * T);
        s->aq = malloc(T * K);
        s->ad = malloc(sizeof(float) * T * (K / QK + 1));
        s->ad4 = malloc(sizeof(float) * T * (K / 4 + 1));
        s->axs = malloc(sizeof(float) * T * (K / QK + 1)); /* xs: one float per 32-block */
        s->as = malloc(sizeof(int32_t) * T * (K / 16 + 1));
        s->akq = malloc(T * K);
        s->akd = malloc(sizeof(float) * T * (K / QK_K + 1));
        s->akb = malloc(sizeof(int16_t) * T * (K / 16 + 1));
        s->hkq = malloc(P * ffmax);
        s->hkd = malloc(sizeof(float) * P * (ffmax / QK_K + 1));
        s->hkb = malloc(sizeof(int16_t) * P * (ffmax / 16 + 1));
        s->h = malloc(sizeof(float) * P * ffmax);
        s->hq = malloc(P * ffmax);
        s->hd = malloc(sizeof(float) * P * (ffmax / QK + 1));
        s->hd4 = malloc(sizeof(float) * P * (ffmax / 4 + 1));
        s->hxs = malloc(sizeof(float) * P * (ffmax / QK + 1));
        s->hs = malloc(sizeof(int32_t) * P * (ffmax / 16 + 1));
        s->pair_out = malloc(sizeof(float) * P * E);
        s->pair_tok = malloc(sizeof(int32_t) * P);
        s->pairs_by_expert = malloc(sizeof(int32_t) * P);
        s->expert_start = malloc(sizeof(int32_t) * (ne + 1));
        s->tiles = malloc(sizeof(int32_t) * 2 * T);
        s->rtiles = malloc(sizeof(int32_t) * 2 * T);
        s->split = malloc(sizeof(split_tok) * T);
        s->cap_tokens = T;
        s->cap_pairs = P;
        if (!s->x || !s->xn || !s->q || !s->k || !s->v || !s->att || !s->tmp || !s->router || !s->topk_w ||
            !s->topk_id || !s->gate_shexp || !s->aq || !s->ad || !s->as || !s->h || !s->hq || !s->hd || !s->hs ||
            !s->ad4 || !s->axs || !s->hd4 || !s->hxs || !s->akq || !s->akd || !s->akb || !s->hkq || !s->hkd ||
            !s->hkb ||
            !s->pair_out || !s->pair_tok || !s->pairs_by_expert || !s->expert_start || !s->tiles || !s->rtiles ||
            !s->split || !mla_ok) {
            scratch_free(s);
            return st_fail(ST_ENOMEM, "forward: out of memory for a batch of %zu tokens", T);
        }
    }
    if (n_threads > s->cap_threads || ctx > s->cap_ctx) { /* per-thread attention score rows */
        free(s->scores);
        s->scores = malloc(sizeof(float) * n_threads * ctx);
        s->cap_ctx = s->scores ? ctx : 0;
        s->cap_threads = s->scores ? n_threads : 0;
        if (!s->scores) return st_fail(ST_ENOMEM, "forward: out of memory for attention scores (ctx %zu)", ctx);
    }
    return ST_OK;
}

st_status st_scratch_split(scratch *s, size_t n_parts, size_t n_left) {
    if (n_parts > s->cap_parts) {
        free(s->parts);
        s->parts = malloc(sizeof(float) * n_parts);
        s->cap_parts = s->parts ? n_parts : 0;
        if (!s->parts) return st_fail(ST_ENOMEM, "forward: out of memory for %zu floats of split attention", n_parts);
    }
    if (n_left > s->cap_left) {
        free((void *)s->left);
        s->left = malloc(sizeof(*s->left) * n_left);
        s->cap_left = s->left ? n_left : 0;
        if (!s->left) return st_fail(ST_ENOMEM, "forward: out of memory for split attention counters");
    }
    return ST_OK;
}

