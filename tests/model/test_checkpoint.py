"""Tests for the checkpoint layer: GGUF + safetensors loading, HF naming/layout, fingerprints, errors."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from splitserve.model.checkpoint import (
    SUPPORTED_ARCHITECTURES,
    Checkpoint,
    default_model_path,
    open_checkpoint,
)
from splitserve.model.errors import ModelLoadError

QTYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
# max |dequantized - original| / max |original| that each type may introduce
QTOL = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}


# ----------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def smollm() -> Checkpoint:
    return open_checkpoint(default_model_path())


def test_default_model_config(smollm: Checkpoint) -> None:
    assert default_model_path().is_file()
    assert smollm.format == "gguf"
    cfg = smollm.hf_config
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["vocab_size"] == 49152 and cfg["intermediate_size"] == 1536
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_default_model_matches_transformers(smollm: Checkpoint, hf_smol) -> None:
    """`hf_smol` (conftest): transformers' own load of the same GGUF, shared with the parity tests."""
    assert Path(hf_smol.config._name_or_path).resolve() == smollm.path.parent.resolve()
    expected = hf_smol.state_dict()
    names = smollm.tensor_names()
    assert len(names) == len(set(names)) == 272
    assert set(names) == set(expected) - {"lm_head.weight"}  # tied: the GGUF has no output.weight
    seen = []
    for name, tensor in smollm.iter_tensors():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected[name]), name  # dequantization + llama q/k un-permutation
        seen.append(name)
    assert seen == names


def test_fingerprint_is_stable_and_picklable(smollm: Checkpoint) -> None:
    fp = smollm.fingerprint()
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert open_checkpoint(smollm.path).fingerprint() == fp
    clone = pickle.loads(pickle.dumps(smollm))
    assert clone.fingerprint() == fp and clone.tensor_names() == smollm.tensor_names()


# ------------------------------------------------------------------------------ synthetic GGUF


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama q/k weights."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    out = w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(llama_cpp_permute(out, n_head), w)
    return out


def tiny_tensors(arch: str, rng: np.random.Generator, tied: bool) -> dict[str, np.ndarray]:
    """GGUF-named HF-layout ([out, in]) tensors of a 2-layer model; row lengths are multiples of 32."""
    hidden, inter, vocab = 64, 96, 64
    heads, kv_heads, head_dim = (4, 2, 32) if arch == "qwen3" else (4, 2, 16)
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
    }
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(2):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (hidden,),
            b + "attn_q.weight": (heads * head_dim, hidden),
            b + "attn_k.weight": (kv_heads * head_dim, hidden),
            b + "attn_v.weight": (kv_heads * head_dim, hidden),
            b + "attn_output.weight": (hidden, heads * head_dim),
            b + "ffn_norm.weight": (hidden,),
            b + "ffn_gate.weight": (inter, hidden),
            b + "ffn_up.weight": (inter, hidden),
            b + "ffn_down.weight": (hidden, inter),
        }
        if arch == "qwen3":
            shapes |= {b + "attn_q_norm.weight": (head_dim,), b + "attn_k_norm.weight": (head_dim,)}
        if arch == "qwen2":
            for p in ("q", "k", "v"):
                shapes[f"{b}attn_{p}.bias"] = (shapes[f"{b}attn_{p}.weight"][0],)
    return {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in shapes.items()}


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    qtype: Q = Q.F32,
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    rope_scaling: float | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny GGUF; 2-D tensors are stored as ``qtype``. Returns the dequantized stored values."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    if arch == "qwen3":
        w.add_key_length(32)
        w.add_value_length(32)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    stored = {}
    for name, value in tensors.items():
        t = qtype if value.ndim == 2 else Q.F32
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            value = llama_cpp_permute(value, 4 if ".attn_q." in name else 2)
        data = gguf.quants.quantize(value, t)
        w.add_tensor(name, data, raw_dtype=t if data.dtype == np.uint8 else None)
        stored[name] = gguf.quants.dequantize(data, t)
    for name, (data, t) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def hf(name: str) -> str:
    from splitserve.model.gguf_loader import gguf_to_hf_name

    hf_name = gguf_to_hf_name(name)
    assert hf_name is not None
    return hf_name


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_synthetic_gguf_roundtrip(tmp_path: Path, arch: str, qtype: Q) -> None:
    rng = np.random.default_rng(0)
    originals = tiny_tensors(arch, rng, tied=arch == "llama")
    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    stored = write_gguf(path, arch, originals, qtype)
    ckpt = open_checkpoint(path)
    cfg = ckpt.hf_config
    assert cfg["model_type"] == arch and SUPPORTED_ARCHITECTURES[cfg["architectures"][0]] == arch
    assert cfg["tie_word_embeddings"] is (arch == "llama")
    assert cfg["head_dim"] == (32 if arch == "qwen3" else 16)
    assert (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (64, 2, 2)
    assert ckpt.tensor_names() == [hf(n) for n in originals]

    wanted_dtype = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)
    by_hf = {hf(n): n for n in originals}
    for name, tensor in ckpt.iter_tensors():
        gname = by_hf[name]
        orig = originals[gname]
        assert tuple(tensor.shape) == orig.shape, name
        assert tensor.dtype == (wanted_dtype if orig.ndim == 2 else torch.float32), name
        expected = stored[gname]
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            expected = llama_cpp_unpermute(expected, 4 if ".attn_q." in gname else 2)
            # quant blocks lie within rows, so quantizing commutes with the row permutation
            assert np.array_equal(expected, gguf.quants.dequantize(gguf.quants.quantize(orig, qtype), qtype))
        assert torch.equal(tensor.float(), torch.from_numpy(np.ascontiguousarray(expected)).float()), name
        err = (tensor.float() - torch.from_numpy(orig)).abs().max().item()
        assert err <= QTOL[qtype if orig.ndim == 2 else Q.F32] * np.abs(orig).max() + 1e-7, name


def test_synthetic_qwen2_gguf_biases_and_rope_scaling(tmp_path: Path) -> None:
    originals = tiny_tensors("qwen2", np.random.default_rng(1), tied=False)
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(path, "qwen2", originals, Q.F32, rope_scaling=4.0)
    ckpt = open_checkpoint(path)
    cfg = ckpt.hf_config
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["attention_bias"] is True
    assert cfg["tie_word_embeddings"] is False and cfg["head_dim"] == 16
    assert cfg["rope_scaling"]["rope_type"] == "linear" and cfg["rope_scaling"]["factor"] == 4.0
    tensors = dict(ckpt.iter_tensors())
    assert "lm_head.weight" in tensors
    for gname, orig in originals.items():  # qwen2 q/k are not permuted
        assert torch.equal(tensors[hf(gname)], torch.from_numpy(orig)), gname
    assert "model.layers.1.self_attn.k_proj.bias" in tensors


def test_gguf_fingerprint_tracks_content(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, "llama", tiny_tensors("llama", np.random.default_rng(2), tied=True))
    write_gguf(b, "llama", tiny_tensors("llama", np.random.default_rng(3), tied=True))
    fa, fb = open_checkpoint(a).fingerprint(), open_checkpoint(b).fingerprint()
    assert fa != fb  # same headers, different weights
    assert open_checkpoint(a).fingerprint() == fa


# ------------------------------------------------------------------------ synthetic HF directories


def tiny_hf_model(model_type: str, tied: bool, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {"head_dim": 32} if model_type == "qwen3" else {}
    config = AutoConfig.for_model(
        model_type,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        **extra,
    )
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("model_type", "tied", "shard", "dtype"),
    [
        ("qwen2", True, None, torch.float32),
        ("qwen2", False, None, torch.bfloat16),
        ("qwen3", False, "40KB", torch.float32),
        ("qwen3", True, "40KB", torch.float16),
    ],
)
def test_hf_dir_roundtrip(tmp_path: Path, model_type: str, tied: bool, shard: str | None, dtype) -> None:
    model = tiny_hf_model(model_type, tied).to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
    assert (tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors")).is_file()
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.format == "hf" and ckpt.path == tmp_path.resolve()
    assert ckpt.hf_config["model_type"] == model_type
    expected = model.state_dict()
    written = set(expected) - ({"lm_head.weight"} if tied else set())
    names = ckpt.tensor_names()
    assert set(names) == written and len(names) == len(written)
    loaded = list(ckpt.iter_tensors())
    assert [n for n, _ in loaded] == names
    for name, tensor in loaded:
        assert tensor.dtype == dtype and torch.equal(tensor, expected[name]), name


def test_hf_fingerprint(tmp_path: Path) -> None:
    fps = []
    for seed in (0, 1):
        tiny_hf_model("qwen2", tied=True, seed=seed).save_pretrained(tmp_path / str(seed))
        fps.append(open_checkpoint(tmp_path / str(seed)).fingerprint())
    assert fps[0] != fps[1]
    assert open_checkpoint(tmp_path / "0").fingerprint() == fps[0]


# ---------------------------------------------------------------------------------------- errors


def load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        open_checkpoint(path)
    return str(info.value)


def test_missing_path(tmp_path: Path) -> None:
    assert str(tmp_path / "nope") in load_error(tmp_path / "nope")


def test_dir_without_config(tmp_path: Path) -> None:
    msg = load_error(tmp_path)
    assert str(tmp_path.resolve()) in msg and "config.json" in msg


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    msg = load_error(tmp_path)
    assert "config.json" in msg and "GPT2LMHeadModel" in msg
    assert all(arch in msg for arch in SUPPORTED_ARCHITECTURES)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2", {"token_embd.weight": np.zeros((64, 64), np.float32)})
    msg = load_error(path)
    assert str(path) in msg and "'gpt2'" in msg and "llama" in msg and "qwen3" in msg


def test_unsupported_quant_type(tmp_path: Path) -> None:
    path = tmp_path / "q5k.gguf"
    block, size = gguf.GGML_QUANT_SIZES[Q.Q5_K]
    q5k = np.random.default_rng(0).integers(0, 255, (64, 256 // block * size), dtype=np.uint8)
    tensors = tiny_tensors("llama", np.random.default_rng(0), tied=True)
    tensors.pop("blk.0.ffn_up.weight")
    write_gguf(path, "llama", tensors, raw={"blk.0.ffn_up.weight": (q5k, Q.Q5_K)})
    msg = load_error(path)
    assert str(path) in msg
    assert "unsupported quantization type Q5_K in tensor blk.0.ffn_up.weight" in msg
    assert all(q.name in msg for q in QTYPES)


def test_corrupt_gguf(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    assert str(junk) in load_error(junk)
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert "empty.gguf" in load_error(tmp_path / "empty.gguf")
    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", tiny_tensors("llama", np.random.default_rng(0), tied=True))
    data = good.read_bytes()
    for cut in (6, 40, 300, len(data) // 2, len(data) - 16):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        assert str(bad) in load_error(bad), cut
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(1000))
    assert str(garbage) in load_error(garbage)


def test_truncated_safetensors(tmp_path: Path) -> None:
    tiny_hf_model("qwen2", tied=True).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    for cut in (3, 100, len(data) - 8):
        weights.write_bytes(data[:cut])
        msg = load_error(tmp_path)
        assert str(weights.resolve()) in msg and "corrupt or truncated" in msg, cut


def test_missing_shard(tmp_path: Path) -> None:
    tiny_hf_model("qwen3", tied=True).save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    msg = load_error(tmp_path)
    assert shard.name in msg and "missing" in msg


def test_no_weights_and_bin_weights(tmp_path: Path) -> None:
    tiny_hf_model("qwen2", tied=True).config.save_pretrained(tmp_path)
    assert "no model weights" in load_error(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    msg = load_error(tmp_path)
    assert "pytorch_model.bin" in msg and "safetensors" in msg


def test_error_is_picklable() -> None:
    err = ModelLoadError("bad header", path="/x/y.gguf", hint="re-download")
    clone = pickle.loads(pickle.dumps(err))
    assert str(clone) == str(err) == "/x/y.gguf: bad header (re-download)"
    assert str(ModelLoadError("plain message")) == "plain message"
