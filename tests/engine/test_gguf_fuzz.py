"""GGUF fuzzing: thousands of mutated model files, each opened in its own forked child.

Every file must either load and run a forward step, or raise the typed load error
(GGUFError). A signal (crash), a hang, any other exception or a MemoryError (an
allocation sized by the file: the child runs under RLIMIT_AS) fails the run.

The corpus is derived from one seed, printed at the start; set STRATA_FUZZ_SEED to
replay a run and STRATA_FUZZ_N to change its size. The runner is this module run as a
script: it imports everything once, builds the seed models, then forks a child per
file, so a child costs a fork and a load, not an interpreter start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

N_FILES = int(os.environ.get("STRATA_FUZZ_N", "2000"))
CHILD_TIMEOUT_S = 10.0  # a tiny model loads in milliseconds; this is a hang
CHILD_AS_LIMIT = 4 << 30  # RLIMIT_AS of a child: an unbounded allocation fails there
EXIT_LOADED, EXIT_TYPED, EXIT_OTHER, EXIT_MEMORY, EXIT_FORWARD = 0, 10, 20, 30, 40
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ corpus


@dataclass
class Seed:
    """A seed model and where its mutable integers and regions are."""

    data: bytes
    meta_start: int  # end of the 24-byte header
    info_start: int  # first tensor info
    data_start: int  # first tensor byte
    int_slots: list[tuple[int, int]] = field(default_factory=list)  # (offset, size) of every count/length/dim


def _offset(part: Any, base: int) -> int:
    return int(part.__array_interface__["data"][0]) - base


def describe_seed(path: Path) -> Seed:
    from gguf import GGUFReader

    r = GGUFReader(path, "r")
    base = int(r.data.__array_interface__["data"][0])
    slots: list[tuple[int, int]] = [(4, 4), (8, 8), (16, 8)]  # version, tensor count, kv count
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        for part in f.parts:
            if part.dtype.kind in "ui" and part.nbytes in (4, 8) and part.size == 1:
                slots.append((_offset(part, base), part.nbytes))  # key length, type, value, array type/len
    info_start = min(_offset(t.field.parts[0], base) for t in r.tensors)
    for t in r.tensors:
        name_len, _name, n_dims, dims, dtype, off = t.field.parts
        slots += [(_offset(name_len, base), 8), (_offset(n_dims, base), 4), (_offset(dtype, base), 4),
                  (_offset(off, base), 8)]
        slots += [(_offset(dims, base) + 8 * i, 8) for i in range(dims.size)]
    data = path.read_bytes()
    return Seed(data, 24, info_start, int(r.data_offset), sorted(set(slots)))


INTERESTING = [0, 1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 255, 256, 4095, 4096, 65535, 65536, 65537,
               (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 40), (1 << 62), (1 << 63) - 1, 1 << 63,
               (1 << 64) - 1, (1 << 64) - 2]


def mutate(seed: Seed, rng: random.Random) -> tuple[bytes, list[str]]:
    """One mutated file and a description of what was done."""
    b = bytearray(seed.data)
    ops: list[str] = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        kind = rng.choices(["flip", "bytes", "int", "huge", "truncate", "data"], [25, 12, 30, 12, 14, 7])[0]
        head_end = min(seed.data_start, len(b))  # an earlier op may have truncated the file
        if head_end <= 4 or (kind in ("int", "huge") and len(b) < seed.data_start) or \
                (kind == "data" and len(b) < len(seed.data)):
            kind = "truncate"
        if kind == "flip":  # bit flips in the header, metadata or tensor infos
            pos = rng.randrange(4, head_end)
            for _ in range(rng.randint(1, 4)):
                b[pos] ^= 1 << rng.randrange(8)
            ops.append(f"flip@{pos}")
        elif kind == "bytes":  # random values over a short run
            pos = rng.randrange(4, head_end)
            n = rng.randint(1, 8)
            b[pos:pos + n] = bytes(rng.randrange(256) for _ in range(n))[: max(0, len(b) - pos)]
            ops.append(f"bytes@{pos}+{n}")
        elif kind in ("int", "huge"):  # a count, length, type, dimension or offset set to an edge value
            pos, size = rng.choice(seed.int_slots)
            if kind == "huge":
                v = rng.choice(INTERESTING[20:]) if rng.random() < 0.7 else rng.getrandbits(8 * size)
            else:
                old = int.from_bytes(b[pos:pos + size], "little")
                v = rng.choice(INTERESTING + [old + 1, old - 1, old * 2, old // 2, old + 32, old << 8])
            v %= 1 << (8 * size)
            b[pos:pos + size] = v.to_bytes(size, "little")
            ops.append(f"{kind}@{pos}:{size}={v}")
        elif kind == "truncate":
            cut = rng.randrange(0, min(len(b), seed.data_start + 64) + 1) if rng.random() < 0.7 else \
                rng.randrange(0, len(b) + 1)
            del b[cut:]
            ops.append(f"truncate@{cut}")
        else:  # weight bytes: must still load and run (values may be NaN)
            pos = rng.randrange(seed.data_start, len(seed.data))
            n = rng.randint(1, 64)
            b[pos:pos + n] = bytes(rng.randrange(256) for _ in range(n))[: max(0, len(b) - pos)]
            ops.append(f"data@{pos}+{n}")
    return bytes(b), ops


def build_seeds(work: Path) -> list[Path]:
    from gguf import GGMLQuantizationType

    from tests.engine.gguf_factory import make_deepseek2_gguf, make_glm4moe_gguf, make_random_gguf

    tiny = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32, n_vocab=32)
    return [  # every architecture and optional tensor the C validation knows, a float and a quant type
        make_random_gguf(work / "seed_moe_f32.gguf", n_expert=2, n_expert_used=1, **tiny),
        make_random_gguf(work / "seed_dense_q8.gguf", n_expert=0, weight_type=GGMLQuantizationType.Q8_0, **tiny),
        make_random_gguf(work / "seed_qwen2moe_f16.gguf", arch="qwen2moe", n_expert=2, n_expert_used=2,
                         qkv_bias=True, n_ff_shexp=32, weight_type=GGMLQuantizationType.F16, **tiny),
        make_random_gguf(work / "seed_qwen3moe_q4.gguf", arch="qwen3moe", n_expert=2, n_expert_used=1,
                         qk_norm=True, weight_type=GGMLQuantizationType.Q4_0, **tiny),
        # dense lead, routed layer with exp_probs_b and groups, NextN layer (validated, not run)
        make_glm4moe_gguf(work / "seed_glm4moe_q8.gguf", n_moe=1, n_embd=32, n_head=2, n_head_kv=1, head_dim=16,
                          rope_dim=8, n_ff=32, n_expert=4, n_expert_used=2, n_ff_exp=32, n_group=2, n_group_used=1,
                          qk_norm=True, weight_type=GGMLQuantizationType.Q8_0, vocab=False),
        # latent attention (low-rank q, split k_b / v_b), dense lead, routed layer with groups and shared expert
        make_deepseek2_gguf(work / "seed_deepseek2_q8.gguf", n_moe=1, n_embd=32, n_head=2, q_lora_rank=32,
                            kv_lora_rank=16, qk_nope=16, qk_rope=16, v_head_dim=16, n_ff=32, n_expert=4,
                            n_expert_used=2, n_ff_exp=32, n_group=2, n_group_used=1,
                            expert_type=GGMLQuantizationType.Q8_0, vocab=False),
    ]


# ------------------------------------------------------------------ one child


def child(path: Path, err_path: Path) -> int:
    """Runs in the forked child: open, step, classify. Never returns normally."""
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS_LIMIT, CHILD_AS_LIMIT))
    from engine.engine import Engine
    from engine.gguf_model import GGUFError

    def report(code: int) -> int:
        err_path.write_text(traceback.format_exc())
        return code

    try:
        eng = Engine.open(path, threads=1, kv_tokens=64)
    except GGUFError:
        return EXIT_TYPED
    except MemoryError:
        return report(EXIT_MEMORY)
    except BaseException:
        return report(EXIT_OTHER)
    try:
        # token ids inside the file's own vocabulary: a mutated n_vocab of 3 is a valid model (the engine's
        # OutOfRangeError for id 3 would be the harness's input error, not the file's)
        toks = [t % eng.hparams.n_vocab for t in (1, 2, 3)]
        logits = eng.forward(toks, [0, 1, 2], [0, 0, 0], [[0]], [2])
        assert logits.shape == (1, eng.hparams.n_vocab)
    except BaseException:
        return report(EXIT_FORWARD)
    return EXIT_LOADED


# ------------------------------------------------------------------ the runner


def run_corpus(seed: int, n_files: int, work: Path, parallel: int) -> dict[str, Any]:
    # Import everything the children need before the first fork.
    import engine.engine  # noqa: F401
    import engine.gguf_model  # noqa: F401
    import engine.native  # noqa: F401

    seeds = [describe_seed(p) for p in build_seeds(work)]
    rng = random.Random(seed)
    counts = {"loaded": 0, "typed_error": 0}
    failures: list[dict[str, Any]] = []
    running: dict[int, tuple[int, float, Path, list[str]]] = {}
    t0 = time.monotonic()

    def finish(pid: int, status: int | None) -> None:
        i, _start, path, ops = running.pop(pid)
        err = path.with_suffix(".err")
        if status is None:
            kind = "hang"
        elif os.WIFSIGNALED(status):
            kind = f"signal {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            code = os.WEXITSTATUS(status)
            kind = {EXIT_LOADED: "loaded", EXIT_TYPED: "typed_error", EXIT_MEMORY: "memory_error",
                    EXIT_FORWARD: "forward_error"}.get(code, f"exception (exit {code})")
        if ops == ["none"] and kind != "loaded":
            kind = f"unmutated seed did not load: {kind}"
        if kind in counts:
            counts[kind] += 1
            path.unlink(missing_ok=True)
        else:
            keep = work / "failures" / path.name
            keep.parent.mkdir(exist_ok=True)
            path.replace(keep)
            failures.append({"index": i, "kind": kind, "ops": ops, "file": str(keep),
                             "detail": err.read_text()[-2000:] if err.exists() else ""})
        err.unlink(missing_ok=True)

    def reap(block: bool) -> None:
        while running:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            if pid == 0:
                break
            finish(pid, status)
            block = False
        now = time.monotonic()
        for pid, (_i, start, _p, _o) in list(running.items()):
            if now - start > CHILD_TIMEOUT_S:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                finish(pid, None)

    # the unmutated seeds first: they must load and run, or the harness itself is broken
    jobs: list[tuple[bytes, list[str]]] = [(s.data, ["none"]) for s in seeds]
    for _ in range(n_files):
        s = seeds[rng.randrange(len(seeds))]
        jobs.append(mutate(s, rng))
    for i, (blob, ops) in enumerate(jobs):
        while len(running) >= parallel:
            reap(block=False)
            if len(running) >= parallel:
                time.sleep(0.001)
        path = work / f"case{i:05d}.gguf"
        path.write_bytes(blob)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # child
            code = EXIT_OTHER
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)
                os.dup2(devnull, 2)
                code = child(path, path.with_suffix(".err"))
            finally:
                os._exit(code)
        running[pid] = (i, time.monotonic(), path, ops)
    while running:
        reap(block=False)
        time.sleep(0.001)
    return {"seed": seed, "files": len(jobs), "seconds": round(time.monotonic() - t0, 1), **counts,
            "failures": failures}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--n", type=int, default=N_FILES)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--parallel", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(json.dumps(run_corpus(args.seed, args.n, args.work, args.parallel)))
    return 0


# ------------------------------------------------------------------ the test


def test_mutated_gguf_files_load_or_raise_the_typed_error(tmp_path: Path) -> None:
    seed = int(os.environ.get("STRATA_FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"GGUF fuzz corpus seed: {seed} (replay: STRATA_FUZZ_SEED={seed})")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.engine.test_gguf_fuzz", "--seed", str(seed), "--n",
                           str(N_FILES), "--work", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"seed {seed}: runner failed\n{proc.stderr[-4000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"seed {seed}: {res['files']} files in {res['seconds']} s: {res['loaded']} loaded and ran, "
          f"{res['typed_error']} typed errors, {len(res['failures'])} failures")
    if res["failures"]:
        lines = [f"  #{f['index']} {f['kind']} ops={f['ops']} file={f['file']}\n{f['detail']}"
                 for f in res["failures"][:10]]
        pytest.fail(f"seed {seed}: {len(res['failures'])} of {res['files']} files crashed, hung or raised an "
                    f"untyped error (replay with STRATA_FUZZ_SEED={seed}):\n" + "\n".join(lines))
    assert res["files"] >= N_FILES
    # the corpus exercises both outcomes: the seeds and light mutations load, damage is refused
    assert res["loaded"] >= 2 and res["typed_error"] >= res["files"] // 10, res


if __name__ == "__main__":
    sys.exit(main())
