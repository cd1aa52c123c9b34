"""The `strata` command: generate, chat and inspect models from a terminal; ``strata keys`` manages
the gateway's API keys; ``strata bench`` runs the benchmark scenarios against a stack.

Engine subcommands import the engine only when they run: ``strata keys`` and ``strata --help``
work without the C build.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any


def _engine(args: argparse.Namespace) -> Any:
    from engine.engine import Engine

    return Engine.open(args.model, threads=args.threads, kv_tokens=args.kv_tokens, device=args.device)


def _stream_text(outputs: Iterable[Any]) -> str:
    """Print the text deltas of ``Engine.stream`` as they arrive (the scheduler's detokenizer
    never splits a UTF-8 character and drops the end token); return the text."""
    out = []
    for o in outputs:
        if o.error:
            raise RuntimeError(o.error)
        out.append(o.text)
        sys.stdout.write(o.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(out)


def _sampling(args: argparse.Namespace) -> Any:
    from engine.sampling import SamplingParams

    return SamplingParams.parse(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _sampling(args)  # bad values fail before the model loads
    with _engine(args) as eng:
        if args.chat:
            ids = eng.render_chat([{"role": "user", "content": args.prompt}])
        else:
            ids = eng.tokenizer.encode(args.prompt, add_special=True, parse_special=True)
        _stream_text(eng.stream(ids, params))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    with _engine(args) as eng:
        print("strata chat: empty line or Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = _stream_text(eng.stream(eng.render_chat(messages), params))
            messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from engine.gguf_model import open_model
    from engine.gpu_settings import staging_slots
    from engine.inspect_model import render, render_hybrid

    mf = open_model(args.path)
    slots = staging_slots(mf.hparams.n_expert) if args.staging_slots is None else args.staging_slots
    print(render(mf, args.ram, args.vram, args.ctx, args.step_tokens))
    if args.vram is not None and mf.hparams.n_expert:
        print(render_hybrid(mf, args.vram, ctx=args.ctx, seqs=args.seqs, placement=args.placement,
                            cpu_gbs=args.cpu_bw, gpu_gbs=args.gpu_bw, gpu=args.gpu, threads=args.threads,
                            step_tokens=args.step_tokens, staging_slots=slots, ram_gib=args.ram))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from engine.calibrate import builtin_corpus, calibrate_file, read_prompts
    from engine.engine import Engine
    from engine.placement import default_placement_path

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.prompts is not None:
        read_prompts(args.prompts)  # a bad prompt file fails before the model loads
    else:
        builtin_corpus()
    out = args.output if args.output is not None else default_placement_path(args.model)
    with Engine.open(args.model, threads=args.threads, kv_tokens=args.kv_tokens) as eng:
        pf = calibrate_file(eng, args.prompts, out, max_tokens=args.max_tokens)
    print(f"{out}: {pf.source}")
    return 0


def cmd_build_default(args: argparse.Namespace) -> int:
    from engine.default_model import build_default_model, default_model_path

    print(build_default_model(default_model_path(), force=args.force))
    return 0


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF path (default: the embedded default model)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all allowed cores)")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache capacity in tokens")
    p.add_argument("--device", default="cpu", help='cpu, cuda:N (the whole model on that GPU) or auto')
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="strata", description="Strata MoE engine")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    _add_run_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat on the terminal")
    _add_run_args(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(fn=cmd_chat)
    m = sub.add_parser("model", help="model files")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    i = msub.add_parser("inspect", help="architecture, parameters, quant mix, memory fit")
    i.add_argument("path")
    i.add_argument("--ram", type=float, default=None, help="RAM budget in GiB")
    i.add_argument("--vram", type=float, default=None, help="VRAM budget in GiB")
    i.add_argument("--ctx", type=int, default=None, help="context length for the KV estimate")
    i.add_argument("--seqs", type=int, default=1, help="hybrid plan: sequences the GPU's KV cache holds at --ctx each")
    i.add_argument("--placement", default=None, help="hybrid plan: routing frequencies from this placement file "
                                                     "(`strata plan calibrate`; default: uniform routing)")
    i.add_argument("--cpu-bw", type=float, default=None, help="hybrid plan: RAM read GB/s (default: measured now)")
    i.add_argument("--threads", type=int, default=None, help="hybrid plan: threads of the RAM probe (default: all cores)")
    i.add_argument("--gpu-bw", type=float, default=None, help="hybrid plan: GPU memory GB/s (default: --gpu's)")
    i.add_argument("--gpu", default=None, help="hybrid plan: GPU name for the bandwidth table (default RTX 4090D)")
    i.add_argument("--step-tokens", type=int, default=2048,
                   help="the VRAM lines and the hybrid plan: the largest step, a lane's max(prefill_chunk, "
                        "scheduler.max_batch_tokens) (default 2048: a GPU lane's)")
    i.add_argument("--staging-slots", type=int, default=None,
                   help="hybrid plan: GPU slots for staged experts (default: the engine's, two layers' experts "
                        "unless STRATA_GPU_HYBRID_STAGE=0)")
    i.set_defaults(fn=cmd_inspect)
    b = msub.add_parser("build-default", help="build the embedded default model")
    b.add_argument("--force", action="store_true")
    b.set_defaults(fn=cmd_build_default)
    pl = sub.add_parser("plan", help="hybrid GPU/CPU placement")
    plsub = pl.add_subparsers(dest="plan_cmd", required=True)
    cal = plsub.add_parser("calibrate", help="routing statistics from a prompt file into a placement file")
    cal.add_argument("model", help="GGUF path")
    cal.add_argument("--prompts", default=None, help="one prompt per line, or JSONL ({\"prompt\": ...} / "
                                                     "{\"messages\": [...]}); default: the built-in corpus")
    cal.add_argument("-o", "--output", default=None,
                     help="the placement file to write (JSON); default: the model's default placement beside it, "
                          "MODEL.placement.json, which a GPU lane with a budget places by when no file is configured")
    cal.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    cal.add_argument("--threads", type=int, default=None, help="engine threads (default: all allowed cores)")
    cal.add_argument("--kv-tokens", type=int, default=8192, help="KV cache capacity in tokens")
    cal.set_defaults(fn=cmd_calibrate)
    sub.add_parser("keys", help="gateway API keys: create (prints the key once), list, revoke")
    sub.add_parser("bench", help="benchmark scenarios against a running stack (run), diff results (compare)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keys"]:  # the gateway's key tool owns its own arguments
        from gateway.keys import main as keys_main

        return int(keys_main(argv[1:]))
    if argv[:1] == ["bench"]:  # the harness owns its own arguments (bench/harness/cli.py)
        from bench.harness.cli import main as bench_main

        return int(bench_main(argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (ValueError, RuntimeError, ImportError) as exc:  # typed engine/model errors, an unbuilt engine
        print(f"strata: error: {exc}", file=sys.stderr)  # one line, no traceback
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
