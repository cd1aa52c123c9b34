/* Streaming (issue 29's third home for a non-resident expert at decode): the device computes a static set of
 * each partial layer's non-resident experts itself, its routed kernels reading their weights in place from the
 * page-locked mapped file over PCIe (zero-copy), while the CPU pool computes the layer's other non-resident pairs.
 * Why: at batch 1 every hit expert's weights are read once whoever computes it; the CPU reads its share from RAM
 * at its bandwidth and the link can carry another share at the same time, so the two shares' bytes split in
 * proportion to the two rates finish together (the caller sizes the set: engine/placement.py's stream_set).
 *
 * The set (stg_model_set_streamed) holds between calls and is known to both sides: the host's CPU share leaves
 * its pairs out (hybrid_cpu_layer) and the device's map (d_map: e where streamed, -1 elsewhere) groups them, so no
 * step needs a handshake beyond the CPU share's. Per layer with streamed experts, after the resident experts and
 * before the wait for the CPU's flag: event d0, the pairs of streamed experts grouped by expert id (k_slot_ids over
 * d_map, k_group over n_expert ids), the routed experts over that grouping with the registered range's device
 * address as the weights (the file's layout: every expert at its own index, as a staging slot holds them), event
 * d1. Their rows land in pair_out beside the resident ones (each pair is grouped on exactly one side). The range is
 * registered by staging_setup (hybrid_stage or hybrid_stream set at creation) with cudaHostRegisterMapped; the
 * setting hybrid_stream 0 ignores the set (the step is today's). Rows of streamed experts are the device's
 * (within the GPU engine's tolerances of the CPU's).
 *
 * Access over PCIe: the matvec kernels read each weight row with 16-byte loads (unpack_sub's uint4 for Q4_K),
 * lanes over consecutive sub-blocks, so one warp instruction covers up to four consecutive 144-byte blocks; the
 * device does not cache mapped host memory the way it caches VRAM, so a kernel that passes over the same row
 * more than once (k_linear_q with more pairs in a group than NT per pass; k_linear_q_chunk and k_linear_q_rows
 * once per pair of their group) reads those bytes over the link again each time: at batch 1 every group holds one
 * pair (one pass); at 8 sequences the routed split's matvec share (groups of up to routed_mv_max pairs) rereads. */
#include "model.cuh"

/* Whether this step streams: the setting, a set with something in it, the range's device address. */
static void streaming_decide(stg_model *m) {
    streaming &sr = m->hy.str;
    sr.now = m->hy.on && m->set.hybrid_stream != 0 && sr.n_total > 0 && m->hy.stg.reg_dev && sr.d_map;
}

/* A layer whose streamed experts the step computes on the device (it has a CPU share). */
static bool streamed_layer(const stg_model *m, int il) {
    const streaming &sr = m->hy.str;
    return sr.now && hybrid_layer(m, il) && sr.n_on[(size_t)il] > 0;
}

/* The layer's `on` row from `want` and the residency, and its device map (the stream synchronised by the caller,
 * or no step in flight). */
static stg_status streaming_layer_map(stg_model *m, int il) {
    hybrid &h = m->hy;
    streaming &sr = h.str;
    const int ne = m->d.n_expert;
    if (sr.want.empty()) return ST_OK;
    const size_t row = (size_t)il * ne;
    const bool partial = partial_layer(m, il);
    int32_t n = 0;
    std::vector<int32_t> map((size_t)ne, -1);
    for (int e = 0; e < ne; e++) {
        const bool on = partial && sr.want[row + e] && !h.resident[row + e];
        sr.on[row + e] = on ? 1 : 0;
        if (on) map[(size_t)e] = e, n++;
    }
    sr.n_total += n - sr.n_on[(size_t)il];
    sr.n_on[(size_t)il] = n;
    if (sr.d_map)
        CU(cudaMemcpy(sr.d_map + row, map.data(), sizeof(int32_t) * (size_t)ne, cudaMemcpyHostToDevice),
           "streaming: the device's map");
    return ST_OK;
}

extern "C" stg_status stg_model_set_streamed(stg_model *m, const uint8_t *streamed) {
    if (!m) return fail(ST_EINVAL, "set_streamed: NULL model");
    hybrid &h = m->hy;
    streaming &sr = h.str;
    if (!h.on) return fail(ST_EINVAL, "set_streamed: every routed expert is on the device already");
    if (m->n_live > 0) return fail(ST_EINVAL, "set_streamed: %d launched step(s) in flight", m->n_live);
    const int nL = m->d.n_layer, ne = m->d.n_expert;
    const size_t n = (size_t)nL * (size_t)ne;
    bool any = false;
    for (size_t i = 0; streamed && i < n; i++) {
        if (streamed[i] > 1)
            return fail(ST_EINVAL, "set_streamed: streamed[%d][%d] = %d (0 or 1)", (int)(i / ne), (int)(i % ne),
                        (int)streamed[i]);
        const int il = (int)(i / ne);
        any = any || (streamed[i] && partial_layer(m, il) && !h.resident[i]);
    }
    if (any && !h.stg.reg_dev)
        return fail(ST_EUNSUPPORTED, "set_streamed: the host range of the experts is not page-locked and mapped "
                                     "(hybrid_stage and hybrid_stream were 0 at creation, or the platform refused)");
    for (int il = 0; any && il < nL; il++) {
        if (!partial_layer(m, il)) continue;
        for (int i = 0; i < 3; i++) /* the kernels' 16-byte loads; the file's alignment is 32 */
            if ((uintptr_t)h.host[(size_t)il * 3 + i] % 32)
                return fail(ST_EUNSUPPORTED, "set_streamed: layer %d's routed weights are not 32-byte aligned in the "
                                             "file", il);
    }
    CU(cudaSetDevice(m->device), "set_streamed");
    CU(cudaStreamSynchronize(m->stream), "set_streamed");
    if (any && !sr.d_map) {
        CHECK(dalloc(m, &sr.d_map, sizeof(int32_t) * n));
        CU(cudaMemset(sr.d_map, 0xff, sizeof(int32_t) * n), "set_streamed: the device's map"); /* -1 */
    }
    sr.want.assign(n, 0);
    if (streamed) sr.want.assign(streamed, streamed + n);
    sr.on.resize(n, 0);
    sr.n_on.resize((size_t)nL, 0);
    sr.seen.assign((size_t)ne, 0);
    for (int il = 0; il < nL; il++) CHECK(streaming_layer_map(m, il));
    return ST_OK;
}

extern "C" stg_status stg_model_stream_info(const stg_model *m, int32_t *available, double *pcie_gbs,
                                            int64_t *n_streamed) {
    if (!m || !available || !pcie_gbs || !n_streamed) return fail(ST_EINVAL, "stream_info: NULL argument");
    const staging &g = m->hy.stg;
    *available = m->hy.on && g.reg_dev ? 1 : 0;
    *pcie_gbs = g.reg_dev ? g.pcie_gbs : 0.0;
    *n_streamed = m->hy.str.n_total;
    return ST_OK;
}

/* A streamed layer, after its resident experts are queued: d0, the streamed pairs grouped by expert, the routed
 * experts over them with the registered range as the weights, d1. */
static stg_status streaming_queue(stg_model *m, int il, int32_t T, int mv_max) {
    hybrid &h = m->hy;
    if (!h.cur) return fail(ST_EINVAL, "streaming: layer %d queued outside a step", il);
    hybrid_step &hs = *h.cur;
    scratch &s = m->s;
    cudaStream_t st = m->stream;
    const int ne = m->d.n_expert, k = m->d.n_expert_used;
    const int64_t P = (int64_t)T * k;
    const staging &g = h.stg;
    CU(cudaEventRecord(hs.d0[(size_t)il], st), "streaming: event");
    launch_k(k_slot_ids, (unsigned)((P + 255) / 256), 256, 0, st, (const int32_t *)s.topk_id, (int32_t)P,
             (const int32_t *)(h.str.d_map + (int64_t)il * ne), h.sid);
    LAUNCHED("streaming: ids");
    const group_out go = {s.gexp,   s.gstart, s.gcount, s.n_groups,  s.list,    s.pair_tok, nullptr, s.gtiles,
                          s.n_gtiles, s.mexp, s.mstart, s.mcount, s.n_mgroups, s.pair_mv, mv_max};
    launch_k(k_group, 1, 1024, 2 * (size_t)ne * sizeof(int32_t), st, (const int32_t *)h.sid, (int32_t)P, k, ne, go, 0);
    LAUNCHED("streaming: group by expert");
    const dlayer &L = m->L[(size_t)il];
    dlayer Ls = L;
    dtensor *out[3] = {&Ls.gate_exps, &Ls.up_exps, &Ls.down_exps};
    for (int i = 0; i < 3; i++) {
        out[i]->d = g.reg_dev + (h.host[(size_t)il * 3 + i] - (const uint8_t *)g.reg);
        out[i]->ne[2] = ne;
    }
    CHECK(routed_experts(m, Ls, T, mv_max));
    CU(cudaEventRecord(hs.d1[(size_t)il], st), "streaming: event");
    hs.streamed[(size_t)il] = 1;
    return ST_OK;
}
