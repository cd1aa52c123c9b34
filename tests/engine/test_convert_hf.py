"""engine.convert_hf: HF checkpoint -> GGUF in llama.cpp's names, keys and layouts (no engine needed).

Expected values here are written independently of the converter (own q/k un-permute, own
expert unfusing from the live transformers-5 model), and llama.cpp itself, when installed,
checks that the files compute what Hugging Face computes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch_file

from engine.convert_hf import OUTTYPES, ConversionError, convert_hf, permute_qk, unpermute_qk

try:
    import hf_models as H  # tests/engine is on sys.path (rootdir-relative import mode)
except ImportError:  # pragma: no cover - package-style test layout
    from tests.engine import hf_models as H

REPO = Path(__file__).resolve().parents[2]
ARCHES = ["mixtral", "qwen3moe", "qwen2moe", "llama"]
GGUF_ARCH = {"mixtral": "llama", "qwen3moe": "qwen3moe", "qwen2moe": "qwen2moe", "llama": "llama"}


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Path]]:
    """arch -> (hf_dir, live HF model, F32 GGUF)."""
    root = tmp_path_factory.mktemp("convert_hf")
    out = {}
    for arch in ARCHES:
        hf_dir, model = H.MAKERS[arch](root / arch)
        out[arch] = (hf_dir, model, H.to_gguf(hf_dir, root / f"{arch}.f32.gguf"))
    return out


def _kv(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _tensors(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in reader.tensors}


def _values(t: gguf.ReaderTensor) -> np.ndarray:
    """Row-major float32 values of a GGUF tensor (numpy shape = reversed ne)."""
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))


def _hf_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # inverse of llama.cpp's reshape(n_head, 2, hd/2, ...).swapaxes(1, 2) on q/k rows
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected(arch: str, model: Any) -> dict[str, np.ndarray]:
    """GGUF name -> HF values in llama.cpp layout (q/k left in HF order), from the live model."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    exp = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        exp["output.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        exp[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        exp[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            exp[f"{b}{gg}.weight"] = sd[f"{p}self_attn.{hf}.weight"]
            if f"{p}self_attn.{hf}.bias" in sd:
                exp[f"{b}{gg}.bias"] = sd[f"{p}self_attn.{hf}.bias"]
        if arch == "qwen3moe":
            exp[b + "attn_q_norm.weight"] = sd[p + "self_attn.q_norm.weight"]
            exp[b + "attn_k_norm.weight"] = sd[p + "self_attn.k_norm.weight"]
        if arch == "llama":
            for kind in ("gate", "up", "down"):
                exp[f"{b}ffn_{kind}.weight"] = sd[f"{p}mlp.{kind}_proj.weight"]
            continue
        exp[b + "ffn_gate_inp.weight"] = sd[p + "mlp.gate.weight"]
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # transformers 5: [E, 2F, D], gate rows first
        f = gate_up.shape[1] // 2
        exp[b + "ffn_gate_exps.weight"] = gate_up[:, :f]
        exp[b + "ffn_up_exps.weight"] = gate_up[:, f:]
        exp[b + "ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]
        if arch == "qwen2moe":
            exp[b + "ffn_gate_inp_shexp.weight"] = sd[p + "mlp.shared_expert_gate.weight"].reshape(-1)
            for kind in ("gate", "up", "down"):
                exp[f"{b}ffn_{kind}_shexp.weight"] = sd[f"{p}mlp.shared_expert.{kind}_proj.weight"]
    return exp


# ----------------------------------------------------------------------------------------------
# metadata, shapes, values


@pytest.mark.parametrize("arch", ARCHES)
def test_metadata(models: dict, arch: str) -> None:
    _, model, path = models[arch]
    cfg, r = model.config, gguf.GGUFReader(path)
    a = GGUF_ARCH[arch]
    assert _kv(r, "general.architecture") == a
    assert _kv(r, "general.file_type") == int(gguf.LlamaFileType.ALL_F32)
    assert _kv(r, "general.quantization_version") == gguf.GGML_QUANT_VERSION
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    want = {
        "vocab_size": 320, "context_length": 256, "embedding_length": 64,
        "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": head_dim, "attention.value_length": head_dim, "rope.dimension_count": head_dim,
        "rope.freq_base": 10000.0,
    }
    for key, val in want.items():
        assert _kv(r, f"{a}.{key}") == val, key
    assert _kv(r, f"{a}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    moe = {
        "mixtral": dict(expert_count=4, expert_used_count=2, expert_feed_forward_length=96, expert_weights_norm=True),
        "qwen3moe": dict(expert_count=32, expert_used_count=8, expert_feed_forward_length=32, expert_weights_norm=True),
        "qwen2moe": dict(expert_count=8, expert_used_count=4, expert_feed_forward_length=32, expert_weights_norm=False,
                         expert_shared_feed_forward_length=64),
    }.get(arch)
    if moe is None:
        assert _kv(r, f"{a}.expert_count") is None
        return
    for key, val in moe.items():
        assert _kv(r, f"{a}.{key}") == val, key
    assert _kv(r, f"{a}.expert_gating_func") == int(gguf.ExpertGatingFuncType.SOFTMAX)
    if arch == "qwen3moe":  # the case llama.cpp cannot infer: 8 heads x 16 != 64
        assert cfg.num_attention_heads * head_dim != cfg.hidden_size


@pytest.mark.parametrize("arch", ARCHES)
def test_tensor_shapes_are_llama_cpp_ne(models: dict, arch: str) -> None:
    _, model, path = models[arch]
    cfg = model.config
    D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or D // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    ne: dict[str, list[int]] = {"token_embd.weight": [D, V], "output_norm.weight": [D], "output.weight": [D, V]}
    for i in range(L):
        b = f"blk.{i}."
        ne |= {b + "attn_norm.weight": [D], b + "ffn_norm.weight": [D], b + "attn_q.weight": [D, q],
               b + "attn_k.weight": [D, kv], b + "attn_v.weight": [D, kv], b + "attn_output.weight": [q, D]}
        if arch == "llama":
            F = cfg.intermediate_size
            ne |= {b + "ffn_gate.weight": [D, F], b + "ffn_up.weight": [D, F], b + "ffn_down.weight": [F, D]}
            continue
        E = cfg.num_local_experts if arch == "mixtral" else cfg.num_experts
        F = cfg.intermediate_size if arch == "mixtral" else cfg.moe_intermediate_size
        ne |= {b + "ffn_gate_inp.weight": [D, E], b + "ffn_gate_exps.weight": [D, F, E],
               b + "ffn_up_exps.weight": [D, F, E], b + "ffn_down_exps.weight": [F, D, E]}
        if arch == "qwen3moe":
            ne |= {b + "attn_q_norm.weight": [hd], b + "attn_k_norm.weight": [hd]}
        if arch == "qwen2moe":
            Fs = cfg.shared_expert_intermediate_size
            ne |= {b + "attn_q.bias": [q], b + "attn_k.bias": [kv], b + "attn_v.bias": [kv],
                   b + "ffn_gate_inp_shexp.weight": [D], b + "ffn_gate_shexp.weight": [D, Fs],
                   b + "ffn_up_shexp.weight": [D, Fs], b + "ffn_down_shexp.weight": [Fs, D]}
    got = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(path).tensors}
    assert got == ne


@pytest.mark.parametrize("arch", ARCHES)
def test_f32_round_trip_matches_hf(models: dict, arch: str) -> None:
    _, model, path = models[arch]
    cfg = model.config
    tensors = _tensors(gguf.GGUFReader(path))
    expected = _expected(arch, model)
    assert set(tensors) == set(expected)
    for name, want in expected.items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, name
        got = _values(t)
        if GGUF_ARCH[arch] == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            assert not np.array_equal(got, want), f"{name} was not permuted"
            got = _hf_unpermute(got, heads)
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_permute_matches_llama_cpp_formula_and_inverts() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    ref = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)  # llama.cpp's convert_hf_to_gguf permute
    np.testing.assert_array_equal(permute_qk(w, 3), ref)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 3), 3), w)
    np.testing.assert_array_equal(permute_qk(w[:, 0], 3), ref[:, 0])  # biases too


def test_permute_turns_neox_rope_into_norm_rope() -> None:
    """Why llama needs the permute: NORM rope on permuted rows == NEOX (HF) rope on HF rows."""
    hd, pos, theta = 16, 7, 10000.0
    x = np.random.default_rng(1).standard_normal(hd)
    ang = pos * theta ** (-np.arange(hd // 2) * 2 / hd)
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[: hd // 2], x[hd // 2:]
    neox = np.concatenate([a * c - b * s, a * s + b * c])  # HF rotate_half pairs (i, i + hd/2)
    y = permute_qk(x[:, None], 1)[:, 0]
    norm = np.empty(hd)
    norm[0::2] = y[0::2] * c - y[1::2] * s  # ggml NORM rope pairs (2i, 2i + 1)
    norm[1::2] = y[0::2] * s + y[1::2] * c
    np.testing.assert_allclose(norm, permute_qk(neox[:, None], 1)[:, 0], rtol=1e-12)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2moe"])
def test_fused_transformers5_layout_converts_identically(models: dict, arch: str, tmp_path: Path) -> None:
    hf_dir, model, f32_path = models[arch]
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((hf_dir / "config.json").read_text())
    # live state_dict names: mlp.gate.weight, mlp.experts.gate_up_proj [E, 2F, D], mlp.experts.down_proj
    save_torch_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    out = convert_hf(fused, tmp_path / "fused.gguf", "f32", skip_tokenizer=True)
    a, b = _tensors(gguf.GGUFReader(out)), _tensors(gguf.GGUFReader(f32_path))
    assert set(a) == set(b)
    for name in a:
        assert bytes(a[name].data) == bytes(b[name].data), name


def test_bf16_and_f16_checkpoint_dtypes_are_read(models: dict, tmp_path: Path) -> None:
    hf_dir, model, _ = models["llama"]
    for dtype in (torch.bfloat16, torch.float16):
        d = tmp_path / str(dtype).split(".")[-1]
        d.mkdir()
        (d / "config.json").write_text((hf_dir / "config.json").read_text())
        sd = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
        save_torch_file(sd, str(d / "model.safetensors"))
        t = _tensors(gguf.GGUFReader(convert_hf(d, d / "m.gguf", "f32", skip_tokenizer=True)))
        want = sd["model.layers.0.self_attn.v_proj.weight"].float().numpy()
        np.testing.assert_array_equal(_values(t["blk.0.attn_v.weight"]), want)


# ----------------------------------------------------------------------------------------------
# output types


# worst case per element relative to the tensor's max |w|: half a step, or a whole step where
# the symmetric types clip the positive extreme (q4_0: 1/8, q5_0: 1/16)
_QUANT_TOL = {"f16": 1e-3, "bf16": 4e-3, "q8_0": 8e-3, "q5_0": 0.07, "q5_1": 0.04, "q4_0": 0.13, "q4_1": 0.07}


@pytest.mark.parametrize("outtype", sorted(_QUANT_TOL))
def test_outtypes(models: dict, outtype: str, tmp_path: Path) -> None:
    hf_dir, _, f32_path = models["qwen2moe"]
    r = gguf.GGUFReader(convert_hf(hf_dir, tmp_path / f"m.{outtype}.gguf", outtype))
    qtype, file_type = OUTTYPES[outtype]
    assert _kv(r, "general.file_type") == int(file_type)
    ref = _tensors(gguf.GGUFReader(f32_path))
    for name, t in _tensors(r).items():
        if len(t.shape) == 1 or ".ffn_gate_inp" in name:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, name  # norms, biases, routers
            assert bytes(t.data) == bytes(ref[name].data), name
            continue
        assert t.tensor_type == qtype, name
        want = _values(ref[name])
        err = np.abs(_values(t) - want).max() / np.abs(want).max()
        assert err <= _QUANT_TOL[outtype], (name, err)


def test_rows_not_divisible_by_block_fall_back_to_f16(tmp_path: Path) -> None:
    hf_dir, _ = H.make_llama(tmp_path / "odd", intermediate_size=48, tokenizer=False)  # ffn_down rows: 48
    tensors = _tensors(gguf.GGUFReader(convert_hf(hf_dir, tmp_path / "odd.gguf", "q4_0")))
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0


def test_tied_embeddings_omit_output(tmp_path: Path) -> None:
    hf_dir, model = H.make_llama(tmp_path / "tied", tie_word_embeddings=True, tokenizer=False)
    tensors = _tensors(gguf.GGUFReader(convert_hf(hf_dir, tmp_path / "tied.gguf", "f32")))
    assert "output.weight" not in tensors
    np.testing.assert_array_equal(_values(tensors["token_embd.weight"]),
                                  model.lm_head.weight.detach().numpy())


# ----------------------------------------------------------------------------------------------
# tokenizer


def test_byte_level_bpe_tokenizer_written(models: dict) -> None:
    hf_dir, _, path = models["mixtral"]
    r = gguf.GGUFReader(path)
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"] | {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert _kv(r, "tokenizer.ggml.model") == "gpt2"
    assert _kv(r, "tokenizer.ggml.pre") == "default"
    tokens, types = _kv(r, "tokenizer.ggml.tokens"), _kv(r, "tokenizer.ggml.token_type")
    assert len(tokens) == len(types) == 320  # = embedding rows, padded
    for text, i in vocab.items():
        assert tokens[i] == text
    assert types[vocab["<|im_end|>"]] == gguf.TokenType.CONTROL
    assert types[vocab["the"] if "the" in vocab else vocab["t"]] == gguf.TokenType.NORMAL
    assert tokens[319] == "[PAD319]" and types[319] == gguf.TokenType.UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert _kv(r, "tokenizer.ggml.merges") == merges
    assert _kv(r, "tokenizer.ggml.bos_token_id") == vocab["<|im_start|>"]
    assert _kv(r, "tokenizer.ggml.eos_token_id") == vocab["<|im_end|>"]
    assert _kv(r, "tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in _kv(r, "tokenizer.chat_template")
    assert _kv(gguf.GGUFReader(models["qwen3moe"][2]), "tokenizer.ggml.pre") == "qwen2"


def test_no_tokenizer_json_writes_no_vocab(tmp_path: Path) -> None:
    hf_dir, _ = H.make_llama(tmp_path / "notok", tokenizer=False)
    r = gguf.GGUFReader(convert_hf(hf_dir, tmp_path / "notok.gguf", "f32"))
    assert not [k for k in r.fields if k.startswith("tokenizer.")]


def test_non_byte_level_tokenizer_is_rejected_unless_skipped(tmp_path: Path) -> None:
    hf_dir, _ = H.make_llama(tmp_path / "spm", tokenizer=False)
    spm_like = {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "byte_fallback": True},
                "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581"}, "added_tokens": []}
    (hf_dir / "tokenizer.json").write_text(json.dumps(spm_like))
    with pytest.raises(ConversionError, match="byte-level BPE"):
        convert_hf(hf_dir, tmp_path / "spm.gguf", "f32")
    assert not (tmp_path / "spm.gguf").exists()
    convert_hf(hf_dir, tmp_path / "spm.gguf", "f32", skip_tokenizer=True)


# ----------------------------------------------------------------------------------------------
# errors: typed, named, and nothing half-written


def _copy_model(src: Path, dst: Path, edit_tensors: Any = None, edit_config: Any = None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.endswith(".tmp")]


def test_unsupported_architecture(models: dict, tmp_path: Path) -> None:
    d = _copy_model(models["llama"][0], tmp_path / "m",
                    edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConversionError, match="unsupported architecture 'GPT2LMHeadModel'"):
        convert_hf(d, tmp_path / "out.gguf", "f32")
    _assert_nothing_written(tmp_path / "out.gguf")


def test_missing_tensor_names_it(models: dict, tmp_path: Path) -> None:
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    d = _copy_model(models["mixtral"][0], tmp_path / "m", edit_tensors=lambda sd: sd.pop(name))
    with pytest.raises(ConversionError, match=f"missing tensor '{name}'"):
        convert_hf(d, tmp_path / "out.gguf", "f32")
    _assert_nothing_written(tmp_path / "out.gguf")


def test_bad_shape_names_tensor(models: dict, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"

    def edit(sd: dict) -> None:
        sd[name] = sd[name][:16].copy()

    d = _copy_model(models["qwen3moe"][0], tmp_path / "m", edit_tensors=edit)
    with pytest.raises(ConversionError, match=rf"{name}.*shape \[16, 64\], expected \[32, 64\]"):
        convert_hf(d, tmp_path / "out.gguf", "f32")
    _assert_nothing_written(tmp_path / "out.gguf")


def test_unexpected_tensor_is_not_dropped_silently(models: dict, tmp_path: Path) -> None:
    d = _copy_model(models["llama"][0], tmp_path / "m",
                    edit_tensors=lambda sd: sd.update({"model.layers.0.mlp.extra.weight": np.zeros(4, np.float32)}))
    with pytest.raises(ConversionError, match="model.layers.0.mlp.extra.weight"):
        convert_hf(d, tmp_path / "out.gguf", "f32")


def test_missing_config_key_and_dense_qwen_layers(models: dict, tmp_path: Path) -> None:
    d = _copy_model(models["qwen2moe"][0], tmp_path / "a", edit_config=lambda c: c.pop("hidden_size"))
    with pytest.raises(ConversionError, match="'hidden_size'"):
        convert_hf(d, tmp_path / "a.gguf", "f32")
    d = _copy_model(models["qwen2moe"][0], tmp_path / "b", edit_config=lambda c: c.update(mlp_only_layers=[1]))
    with pytest.raises(ConversionError, match=r"dense \(non-MoE\) layers \[1\]"):
        convert_hf(d, tmp_path / "b.gguf", "f32")
    with pytest.raises(ConversionError, match="no config.json"):
        convert_hf(tmp_path, tmp_path / "c.gguf", "f32")
    with pytest.raises(ConversionError, match="unknown outtype"):
        convert_hf(models["llama"][0], tmp_path / "d.gguf", "q3_k")


def test_truncated_checkpoint_is_rejected_before_writing(models: dict, tmp_path: Path) -> None:
    d = _copy_model(models["llama"][0], tmp_path / "m")
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1024])
    with pytest.raises(ConversionError, match="inconsistent"):
        convert_hf(d, tmp_path / "out.gguf", "f32")
    _assert_nothing_written(tmp_path / "out.gguf")


def test_failure_mid_write_leaves_existing_output_untouched(models: dict, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import convert_hf as mod

    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous good file")
    real_load, calls = mod._Checkpoint.load, []

    def failing_load(self: Any, name: str) -> np.ndarray:
        calls.append(name)
        if len(calls) == 5:  # header, KV and some tensor data are already in the temp file
            raise OSError("disk went away")
        return real_load(self, name)

    monkeypatch.setattr(mod._Checkpoint, "load", failing_load)
    with pytest.raises(OSError, match="disk went away"):
        convert_hf(models["llama"][0], out, "f32")
    assert out.read_bytes() == b"previous good file"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_cli(models: dict, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "cli.gguf"
    ok = subprocess.run([sys.executable, "-m", "engine.convert_hf", str(models["llama"][0]), str(out),
                         "--outtype", "q8_0"], capture_output=True, text=True, env=env, cwd=REPO)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(out)
    assert _kv(gguf.GGUFReader(out), "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    bad = subprocess.run([sys.executable, "-m", "engine.convert_hf", str(tmp_path), str(tmp_path / "x.gguf")],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert bad.returncode == 2
    assert "error:" in bad.stderr and "config.json" in bad.stderr
    assert not (tmp_path / "x.gguf").exists()


# ----------------------------------------------------------------------------------------------
# llama.cpp as the oracle of the layout (llama-cpp-python is a required test dependency)


def _llama_cpp_rel_err(path: Path, model: Any) -> float:
    import llama_cpp

    ids = [int(x) for x in np.random.default_rng(1234).integers(0, 320, 32)]
    ref = H.hf_logits(model, ids)
    # F32 KV cache so the comparison is exact to float rounding (F16 KV alone costs ~3e-4).
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False,
                          n_threads=2, type_k=0, type_v=0)
    try:
        llm.eval(ids)
        got = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("arch", ARCHES)
def test_llama_cpp_logits_match_hf(models: dict, arch: str) -> None:
    _, model, path = models[arch]
    assert _llama_cpp_rel_err(path, model) < 1e-5


def test_llama_cpp_llama_attention_biases(tmp_path: Path) -> None:
    """q/k biases get the same row permute as the weights; o_proj bias is carried too."""
    hf_dir, model = H.make_llama(tmp_path / "bias", attention_bias=True)
    path = convert_hf(hf_dir, tmp_path / "bias.gguf", "f32")
    assert "blk.0.attn_output.bias" in _tensors(gguf.GGUFReader(path))
    assert _llama_cpp_rel_err(path, model) < 1e-5
