"""Split-KV decode attention (engine/csrc/cuda/attention_split.cu): each sequence's keys spread over several
blocks, the splits' partials merged by a combine kernel.

Kernel level (the harness's stg_test_attention_decode, one decode step of 1 or 8 sequences of different
lengths, 1 to ~33k cached tokens), the split kernel (tensor cores, q and p as f16 hi + lo): against the CPU
reference (``st_attention``, within 1e-3 of max|ref|, the
rule of every GPU attention kernel) and the unsplit decode kernel (k_attention): a sequence cut into
several splits sums in another order, so within 1e-4 of max|out| of the unsplit kernel's output; a sequence
of one split has exactly its bits (floats and the output's 8-bit blocks). The 8-bit blocks of every output
are the CPU's quantisation of that output. The split counts are the rule's (att_split_chunks).

Model level (a random F32 model with Qwen3-30B-A3B's head dimension 128): one 32,800-token sequence decoded
beside fifteen short ones gives each sequence the logits it gets alone (the split of a sequence depends on
its own length only; short ones keep the unsplit kernels' bits), the split path really runs (the long
sequence's logits are not the unsplit ones' bits, yet within tolerance), and graphs on and off give the
same bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import Engine
from engine.native import lib, ptr
from tests.engine.gguf_factory import make_random_gguf
from tests.engine.gpu._env import rel_err, requires_gpu
from tests.engine.gpu._kernel_helpers import cpu_quant, gcheck, gptr

pytestmark = requires_gpu

SPLIT_TOL = 1e-4  # split vs unsplit kernel, of max|out| of the sequence (docs/engine.md)
REF_TOL = 1e-3  # any GPU attention vs the CPU reference, of max|ref|


def decode_case(rng: np.random.Generator, hd: int, bs: int, n_kv: int, n_keys: list[int]) -> tuple:
    """A paged f16 cache holding sequences of n_keys[i] keys in disjoint, shuffled blocks (3 spare):
    (n_blocks, tables [n_seq, n_table], k, v)."""
    need = [-(-n // bs) for n in n_keys]
    n_blocks = sum(need) + 3
    perm = rng.permutation(n_blocks).astype(np.int32)
    tables = np.zeros((len(n_keys), max(need)), np.int32)
    off = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[off : off + n]
        off += n
    size = n_blocks * bs * n_kv * hd
    k = (rng.standard_normal(size, dtype=np.float32) * 0.5).astype(np.float16).view(np.uint16)
    v = rng.standard_normal(size, dtype=np.float32).astype(np.float16).view(np.uint16)
    return n_blocks, tables, k, v


def run_decode(g: tuple, c: tuple, bs: int, hd: int, n_head: int, n_kv: int, q: np.ndarray, pos: np.ndarray,
               split_min: int, split_chunks: int = 0, split_max: int = 0) -> tuple:
    """stg_test_attention_decode: (out, aq, ad, as, n_splits)."""
    n_blocks, tables, k, v = c
    n_seq, qd = q.shape
    out = np.full((n_seq, qd), np.nan, np.float32)
    aq, ad, as_ = np.zeros((n_seq, qd), np.int8), np.full((n_seq, qd // 32), np.nan, np.float32), \
        np.zeros((n_seq, qd // 16), np.int32)
    ns = np.zeros(n_seq, np.int32)
    gcheck(g, g[1].stg_test_attention_decode(split_min, split_chunks, split_max, gptr(g, k, "uint16_t *"),
                                             gptr(g, v, "uint16_t *"), n_blocks, gptr(g, tables, "int32_t *"),
                                             tables.shape[1], bs, hd, n_head, n_kv, gptr(g, q, "float *"),
                                             gptr(g, pos, "int32_t *"), n_seq, gptr(g, out, "float *"),
                                             gptr(g, aq, "int8_t *"), gptr(g, ad, "float *"),
                                             gptr(g, as_, "int32_t *"), gptr(g, ns, "int32_t *")))
    return out, aq, ad, as_, ns


def cpu_reference(c: tuple, bs: int, hd: int, n_head: int, n_kv: int, q: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """st_attention's reference kernel for every (sequence, head): [n_seq, n_head * hd]."""
    _, tables, k, v = c
    G = n_head // n_kv
    ref = np.empty(q.shape, np.float32)
    for i, p in enumerate(pos.tolist()):
        table = np.ascontiguousarray(tables[i])
        for h in range(n_head):
            qh = np.ascontiguousarray(q[i, h * hd : (h + 1) * hd])
            oh = np.empty(hd, np.float32)
            assert lib.st_attention(lib.ST_VARIANT_REF, ptr(k, "uint16_t *"), ptr(v, "uint16_t *"),
                                    ptr(table, "int32_t *"), bs, hd, n_kv, h // G, ptr(qh, "float *"), 1, p,
                                    ptr(oh, "float *")) == 0
            ref[i, h * hd : (h + 1) * hd] = oh
    return ref


def expected_splits(n_keys: int, split_min: int, chunks: int, zmax: int) -> int:
    """The rule of attention.cuh's att_split_chunks, written again: below split_min one split, else splits of
    max(chunks, ceil(n_chunks / zmax)) chunks of 16 keys."""
    nc = -(-n_keys // 16)
    cps = nc if n_keys < split_min else max(chunks, -(-nc // zmax))
    return -(-nc // cps)


# (split_min, split_chunks, split_max): the step's rule with every sequence long enough; splits of one chunk
# (17 cached tokens already split in two); at most 7 uneven splits, only sequences of >= 1,000 keys cut
FORMS = {"step_rule": (1, 16, 64), "one_chunk": (1, 1, 64), "seven_from_1000": (1000, 1, 7)}
SHAPES = {  # (head_dim, block_size, n_head, n_kv)
    "qwen3_30b": (128, 16, 32, 4),
    "hd64_no_groups": (64, 32, 8, 8),
    "hd32_pairs": (32, 16, 4, 2),
}
CASES = [  # (shape, cached tokens of each sequence = its position, query scale)
    ("qwen3_30b", [1], 1.0),
    ("qwen3_30b", [17], 1.0),
    ("qwen3_30b", [4099], 1.0),
    ("qwen3_30b", [33000], 1.0),
    ("qwen3_30b", [300, 17, 33000, 1, 4099, 1030, 9000, 2000], 1.0),
    ("qwen3_30b", [300, 17, 33000, 1, 4099, 1030, 9000, 2000], 8.0),  # peaked: split maxima far apart
    ("hd64_no_groups", [17, 4099, 700, 1], 1.0),
    ("hd32_pairs", [1, 17, 4099, 5000], 4.0),
]


@pytest.mark.parametrize(("shape", "cached", "qscale"), CASES,
                         ids=[f"{s}-{len(c)}seq-{max(c)}-q{q:g}" for s, c, q in CASES])
def test_split_decode_attention_matches_reference(g: tuple, shape: str, cached: list[int], qscale: float) -> None:
    hd, bs, n_head, n_kv = SHAPES[shape]
    rng = np.random.default_rng(sum(cached) + hd)
    pos = np.array(cached, np.int32)
    c = decode_case(rng, hd, bs, n_kv, [p + 1 for p in cached])
    q = (rng.standard_normal((len(cached), n_head * hd)) * (qscale / np.sqrt(hd))).astype(np.float32)
    ref = cpu_reference(c, bs, hd, n_head, n_kv, q, pos)
    base, bq, bd, bsum, bns = run_decode(g, c, bs, hd, n_head, n_kv, q, pos, 0)
    assert (bns == 1).all()
    for i, p in enumerate(cached):
        e = rel_err(base[i], ref[i])
        assert e <= REF_TOL, f"the unsplit kernel at {p} cached tokens: {e:.3e} of max|ref| from the CPU reference"
    for form, (smin, chunks, zmax) in FORMS.items():
        out, aq, ad, as_, ns = run_decode(g, c, bs, hd, n_head, n_kv, q, pos, smin, chunks, zmax)
        want = [expected_splits(p + 1, smin, chunks, zmax) for p in cached]
        assert ns.tolist() == want, f"{form}: splits per sequence {ns.tolist()}, the rule gives {want}"
        cq, cd, cs = cpu_quant(out)
        assert np.array_equal(aq, cq) and np.array_equal(ad.view(np.uint32), cd.view(np.uint32)) and \
            np.array_equal(as_, cs), f"{form}: the combine's 8-bit blocks are not the CPU's quantisation of its output"
        for i, p in enumerate(cached):
            tag = f"{form}, sequence {i} ({p} cached tokens, {ns[i]} splits)"
            e_ref, e_base = rel_err(out[i], ref[i]), rel_err(out[i], base[i])
            print(f"{tag}: {e_base:.2e} of max|out| from the unsplit kernel, {e_ref:.2e} from the CPU reference")
            assert e_ref <= REF_TOL, f"{tag}: {e_ref:.3e} of max|ref| from the CPU reference"
            assert e_base <= SPLIT_TOL, f"{tag}: {e_base:.3e} of max|out| from the unsplit kernel"
            if ns[i] == 1:
                assert np.array_equal(out[i].view(np.uint32), base[i].view(np.uint32)), \
                    f"{tag}: one split but not the unsplit kernel's bits (max diff {np.abs(out[i] - base[i]).max():.3e})"
                assert np.array_equal(aq[i], bq[i]) and np.array_equal(ad[i].view(np.uint32), bd[i].view(np.uint32)) \
                    and np.array_equal(as_[i], bsum[i]), f"{tag}: one split but other 8-bit blocks"
        if max(cached) >= 4099:
            assert ns.max() > 1, f"{form}: no sequence was split"


def test_split_decode_refuses_bad_arguments(g: tuple) -> None:
    rng = np.random.default_rng(0)
    c = decode_case(rng, 128, 16, 4, [40])
    q = np.zeros((1, 32 * 128), np.float32)
    pos = np.array([39], np.int32)
    n_blocks, tables, k, v = c
    out = np.zeros_like(q)
    base = (gptr(g, k, "uint16_t *"), gptr(g, v, "uint16_t *"), n_blocks, gptr(g, tables, "int32_t *"),
            tables.shape[1], 16)
    null = g[0].NULL
    # more splits than the combine holds; a model whose heads do not take the split kernel (head_dim 80; 16 query
    # heads per kv head: more than one m16n8k16 fragment's 8 hi rows)
    assert g[1].stg_test_attention_decode(1, 16, 65, *base, 128, 32, 4, gptr(g, q, "float *"),
                                          gptr(g, pos, "int32_t *"), 1, gptr(g, out, "float *"), null, null, null,
                                          null) != 0
    q80 = np.zeros((1, 2 * 80), np.float32)
    assert g[1].stg_test_attention_decode(1, 16, 64, *base, 80, 2, 1, gptr(g, q80, "float *"),
                                          gptr(g, pos, "int32_t *"), 1, gptr(g, q80, "float *"), null, null, null,
                                          null) != 0
    assert b"split attention" in g[0].string(g[1].stg_last_error())
    q16 = np.zeros((1, 16 * 128), np.float32)
    assert g[1].stg_test_attention_decode(1, 16, 64, *base, 128, 16, 1, gptr(g, q16, "float *"),
                                          gptr(g, pos, "int32_t *"), 1, gptr(g, q16, "float *"), null, null, null,
                                          null) != 0
    assert b"split attention" in g[0].string(g[1].stg_last_error())


# ------------------------------------------------------------------------------------------------ model level

LONG = 32_800  # the long prompt: its decode steps split (att_split_min's default is 512)
N_SHORT = 15
STEPS = 6
VOCAB = 300


@pytest.fixture(scope="module")
def long_ctx(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A random F32 MoE model with head_dim 128 (4 query heads on 1 kv head) on the GPU, one prompt of LONG
    tokens and N_SHORT of 5-40 prefilled into their own blocks: (engine, tables, prompt lengths, first tokens)."""
    path = make_random_gguf(tmp_path_factory.mktemp("split") / "long.gguf", n_vocab=VOCAB, n_layer=2, n_embd=512,
                            n_head=4, n_head_kv=1, n_ff=128, n_expert=8, n_expert_used=2)
    rng = np.random.default_rng(30)
    lens = [LONG] + [int(n) for n in rng.integers(5, 41, size=N_SHORT)]
    eng = Engine.open(path, device="cuda:0", kv_tokens=LONG + 64 * (N_SHORT + 1) + 1024)
    eng._gpu.set_settings({})  # the defaults, whatever the environment overrides
    tables = [eng.blocks.allocate(-(-(n + STEPS + 1) // eng.block_size)) for n in lens]
    first = []
    for n, tb in zip(lens, tables, strict=True):
        ids = [int(t) for t in rng.integers(0, VOCAB, size=n)]
        first.append(int(np.argmax(eng.prefill(ids, tb))))
    yield eng, tables, lens, first
    eng.close()


def decode(eng: Engine, tables: list, lens: list[int], rows: list[int], feed: list[list[int]]) -> np.ndarray:
    """STEPS decode steps of the sequences `rows` in one batch, sequence r fed feed[r][s] at step s (its
    positions continue its prompt; what a step writes to the cache is rewritten by the next run before it
    is read): logits [STEPS, len(rows), vocab]."""
    out = []
    for s in range(STEPS):
        out.append(eng.forward([feed[r][s] for r in rows], [lens[r] + s for r in rows], list(range(len(rows))),
                               [tables[r] for r in rows], list(range(len(rows)))))
    return np.stack(out)


def alone(eng: Engine, tables: list, lens: list[int], first: list[int], r: int) -> tuple[list[int], np.ndarray]:
    """Sequence r decoded greedily by itself: its fed tokens and logits [STEPS, vocab]."""
    toks, logits = [first[r]], []
    for s in range(STEPS):
        lg = eng.forward([toks[-1]], [lens[r] + s], [0], [tables[r]], [0])[0]
        logits.append(lg)
        toks.append(int(np.argmax(lg)))
    return toks, np.stack(logits)


def test_mixed_batch_gives_each_sequence_its_alone_logits(long_ctx: tuple) -> None:
    eng, tables, lens, first = long_ctx
    runs = [alone(eng, tables, lens, first, r) for r in range(len(lens))]
    feed = [t for t, _ in runs]
    batched = decode(eng, tables, lens, list(range(len(lens))), feed)
    for r, (toks, lg) in enumerate(runs):
        what = f"sequence {r} ({lens[r]} tokens of prompt)"
        e = max(rel_err(batched[s, r], lg[s]) for s in range(STEPS))
        assert e <= 1e-5, f"{what}: batched logits {e:.3e} of max|logit| from its logits alone"
        for s in range(STEPS):  # greedy tokens the same, up to a near-tie of the run alone
            got = int(np.argmax(batched[s, r]))
            if got != toks[s + 1]:
                gap = float(lg[s][toks[s + 1]] - lg[s][got])
                assert gap <= 1e-4 * float(np.abs(lg[s]).max()), \
                    f"{what}, step {s}: batched picks {got}, alone {toks[s + 1]} (margin {gap:.3e})"
        why = "its splits must depend on its own length only" if lens[r] >= 512 else \
            "one split: alone the fused decode kernel, batched k_qkv_post + the split kernel, the same bits"
        assert np.array_equal(batched[:, r].view(np.uint32), lg.view(np.uint32)), \
            f"{what}: batched logits within {e:.3e} but not bitwise those alone ({why})"


def test_long_sequence_takes_the_split_path(long_ctx: tuple) -> None:
    """The long sequence's logits with att_split_min 0 (the unsplit decode kernel) are within tolerance of the
    default's and not the same bits (a summation in another order): the split path ran."""
    eng, tables, lens, first = long_ctx
    split = decode(eng, tables, lens, [0], [[first[0]] * STEPS])
    eng._gpu.set_settings({"STRATA_GPU_ATT_SPLIT_MIN": "0"})
    try:
        unsplit = decode(eng, tables, lens, [0], [[first[0]] * STEPS])
    finally:
        eng._gpu.set_settings({})
    e = rel_err(split, unsplit)
    print(f"long sequence: split vs unsplit logits {e:.3e} of max|logit|")
    assert e <= 1e-4, f"split decode's logits {e:.3e} of max|logit| from the unsplit kernel's"
    assert not np.array_equal(split.view(np.uint32), unsplit.view(np.uint32)), \
        "split and unsplit logits are bitwise equal: the split path did not run at 32,800 tokens"


def test_split_decode_graphs_on_and_off_same_bits(long_ctx: tuple) -> None:
    eng, tables, lens, first = long_ctx
    rows = list(range(len(lens)))
    feed = [[first[r]] * STEPS for r in rows]
    with_graphs = decode(eng, tables, lens, rows, feed)
    n_graphs, n_failed, note = eng._gpu.graph_status()
    assert n_graphs > 0 and n_failed == 0, f"graph captures: {n_graphs} cached, {n_failed} failed ({note})"
    eng._gpu.set_settings({"STRATA_GPU_GRAPHS": "0"})
    try:
        plain = decode(eng, tables, lens, rows, feed)
    finally:
        eng._gpu.set_settings({})
    assert np.array_equal(plain.view(np.uint32), with_graphs.view(np.uint32)), \
        f"graphs on and off differ by {rel_err(plain, with_graphs):.3e} of max|logit|"
