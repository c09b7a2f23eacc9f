"""Host-side weight cache: built once, then served (CPU mapping and the streamed path); a corrupt or
stale entry is rebuilt, never served; size limit and LRU eviction; streamed loads equal per-tensor ones."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.config.engine import EngineConfig
from splitserve.model import loader, weight_cache_entry
from splitserve.model.checkpoint import default_model_path, open_checkpoint
from splitserve.model.loader import LoadedModel, load_model
from splitserve.model.random_weights import TINY_QWEN3, random_model, save_hf_checkpoint
from splitserve.model.stream import plan_chunks
from splitserve.model.weight_cache import (
    DATA_OFFSET,
    SUFFIX,
    WeightCache,
    default_cache_dir,
    open_checkpoint_memo,
    read_entry,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_configs import TINY_QWEN3_5  # noqa: E402


def load(path: Path | str, cache: WeightCache | None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(path, torch.device("cpu"), dtype, lambda cfg: 256, progress=False, weight_cache=cache)


def assert_same_weights(got: LoadedModel, want: LoadedModel) -> None:
    want_params = dict(want.model.named_parameters())
    got_params = dict(got.model.named_parameters())
    assert got_params.keys() == want_params.keys()
    for name, tensor in got_params.items():
        assert tensor.dtype == want_params[name].dtype, name
        assert torch.equal(tensor, want_params[name]), name


def cache_report(m: LoadedModel) -> dict:
    return m.load_stats["cache"]


def save_tiny(directory: Path, seed: int = 0, shard_bytes: int = 10**9) -> Path:
    model = random_model(TINY_QWEN3, "cpu", torch.float32, seed=seed).model
    return save_hf_checkpoint(model, TINY_QWEN3, directory, shard_bytes=shard_bytes, progress=False)


@pytest.fixture(params=["mmap", "stream"])
def mode(request, monkeypatch) -> str:
    """CPU loads either map the entry (the CPU path) or stream it (the accelerator path, on CPU)."""
    monkeypatch.setattr(loader, "_CPU_STREAM", request.param == "stream")
    return request.param


# ------------------------------------------------------------------------------ the default model


def test_default_gguf_is_built_once_then_served_exactly(smol_loaded, tmp_path) -> None:
    cache = WeightCache(tmp_path)
    first = load(default_model_path(), cache)
    assert cache_report(first)["status"] == "miss" and cache_report(first)["built"]
    assert set(first.load_stats["seconds"]) >= {"open", "read", "convert", "cache_write", "warmup"}
    second = load(default_model_path(), cache)
    report = cache_report(second)
    assert (report["status"], report["built"]) == ("hit", False)
    assert second.load_stats["method"] == "cache-mmap"
    assert second.load_stats["bytes"] == sum(p.numel() * 4 for p in smol_loaded.model.parameters())
    assert_same_weights(first, smol_loaded)  # dequantized once, cached bit for bit
    assert_same_weights(second, smol_loaded)
    # a hit does not parse the GGUF again: its header is memoized next to the entries
    memo = open_checkpoint_memo(default_model_path(), tmp_path)
    assert memo._source._reader is None  # type: ignore[attr-defined]
    fresh = smol_loaded.checkpoint
    assert memo.fingerprint() == fresh.fingerprint() and memo.hf_config == fresh.hf_config
    assert memo.tensor_names() == fresh.tensor_names()


def test_gguf_memo_follows_the_file(tmp_path) -> None:
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), copy)
    first = open_checkpoint_memo(copy, tmp_path)  # parsed, and memoized
    before = first.fingerprint()
    data_start = int(first._source._get_reader().data_offset)  # type: ignore[attr-defined]
    assert open_checkpoint_memo(copy, tmp_path)._source._reader is None  # type: ignore[attr-defined]
    with copy.open("r+b") as fh:  # the first sampled window of the data region
        fh.seek(data_start + 10)
        byte = fh.read(1)
        fh.seek(data_start + 10)
        fh.write(bytes([byte[0] ^ 0xFF]))
    after = open_checkpoint_memo(copy, tmp_path)  # the file's ctime and mtime changed: parsed again
    assert after._source._reader is not None  # type: ignore[attr-defined]
    assert after.fingerprint() != before
    assert open_checkpoint_memo(copy, tmp_path).fingerprint() == after.fingerprint()


# ---------------------------------------------------------------------------------------- corrupt


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


def test_corrupt_data_is_rebuilt_not_served(tmp_path, mode) -> None:
    ckpt = save_tiny(tmp_path / "ckpt")
    want = load(ckpt, None)
    cache = WeightCache(tmp_path / "cache")
    built = load(ckpt, cache)
    entry = Path(cache_report(built)["path"])
    assert_same_weights(built, want)
    size = read_entry(entry).layout.data_bytes
    flip_byte(entry, DATA_OFFSET + size // 2)  # a bit flip inside a weight: only the CRCs can tell
    got = load(ckpt, cache)
    report = cache_report(got)
    assert report["status"] == "corrupt" and report["built"], report
    assert "CRC32 mismatch" in report["detail"]
    assert_same_weights(got, want)
    again = load(ckpt, cache)
    assert cache_report(again)["status"] == "hit"
    assert_same_weights(again, want)


def test_a_checked_entry_is_checked_again_only_once_its_file_changed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(weight_cache_entry, "RACY_S", 0.0)  # trust a stamp written in the file's tick
    ckpt = save_tiny(tmp_path / "ckpt")
    want = load(ckpt, None)
    cache = WeightCache(tmp_path / "cache")
    entry = Path(cache_report(load(ckpt, cache))["path"])  # built: its CRC32s made as it was written
    assert entry.with_name(entry.name + weight_cache_entry.VERIFIED).exists()
    hit = load(ckpt, cache)
    assert (cache_report(hit)["status"], cache_report(hit)["verified"]) == ("hit", False)  # stamped
    assert_same_weights(hit, want)
    time.sleep(0.05)  # file times advance by the kernel's tick: the flip below lands in a later one
    flip_byte(entry, DATA_OFFSET + read_entry(entry).layout.data_bytes // 2)
    got = load(ckpt, cache)  # the file changed since its stamp: checked, and rebuilt
    assert cache_report(got)["status"] == "corrupt" and "CRC32 mismatch" in cache_report(got)["detail"]
    assert_same_weights(got, want)


@pytest.mark.parametrize("damage", ["truncated", "footer", "preamble", "empty"])
@pytest.mark.parametrize("verify", [True, False])
def test_damaged_entry_is_rebuilt_even_without_crc_checks(tmp_path, damage, verify) -> None:
    ckpt = save_tiny(tmp_path / "ckpt")
    want = load(ckpt, None)
    cache = WeightCache(tmp_path / "cache", verify=verify)
    entry = Path(cache_report(load(ckpt, cache))["path"])
    size = entry.stat().st_size
    if damage == "truncated":
        os.truncate(entry, size - 1000)
    elif damage == "footer":
        flip_byte(entry, size - 20)
    elif damage == "preamble":
        flip_byte(entry, 3)
    else:
        os.truncate(entry, 0)
    got = load(ckpt, cache)
    assert cache_report(got)["status"] == "corrupt" and cache_report(got)["built"]
    assert_same_weights(got, want)
    assert cache_report(load(ckpt, cache))["status"] == "hit"


# ------------------------------------------------------------------------------------------ stale


def test_changed_checkpoint_does_not_use_the_old_entry(tmp_path, mode) -> None:
    ckpt = tmp_path / "ckpt"
    save_tiny(ckpt, seed=0)
    cache = WeightCache(tmp_path / "cache")
    old = load(ckpt, cache)
    shutil.rmtree(ckpt)
    save_tiny(ckpt, seed=1)  # same path, shapes and names; other weights
    want = load(ckpt, None)
    got = load(ckpt, cache)
    assert cache_report(got)["status"] == "miss" and cache_report(got)["built"]  # a new fingerprint
    assert cache_report(got)["path"] != cache_report(old)["path"]
    assert_same_weights(got, want)
    assert not torch.equal(got.model.embed_tokens.weight, old.model.embed_tokens.weight)


def test_in_place_edit_the_fingerprint_misses_is_caught_by_file_stats(tmp_path) -> None:
    ckpt = save_tiny(tmp_path / "ckpt")  # one 650 KB shard: its fingerprint samples 5 x 64 KB windows
    cache = WeightCache(tmp_path / "cache")
    built = load(ckpt, cache)
    fingerprint = open_checkpoint(ckpt).fingerprint()
    shard = ckpt / "model.safetensors"
    header = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
    flip_byte(shard, header + 100_000)  # between the first two sampled windows
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert open_checkpoint(ckpt).fingerprint() == fingerprint  # the key alone would be fooled
    want = load(ckpt, None)
    got = load(ckpt, cache)
    assert cache_report(got)["status"] == "stale" and cache_report(got)["built"]
    assert cache_report(got)["path"] == cache_report(built)["path"]
    assert_same_weights(got, want)


def test_dtype_is_part_of_the_key(tmp_path) -> None:
    ckpt = save_tiny(tmp_path / "ckpt")
    cache = WeightCache(tmp_path / "cache")
    fp32 = load(ckpt, cache, torch.float32)
    bf16 = load(ckpt, cache, torch.bfloat16)
    assert cache_report(bf16)["status"] == "miss" and cache_report(fp32)["path"] != cache_report(bf16)["path"]
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert cache_report(load(ckpt, cache, torch.bfloat16))["status"] == "hit"
    assert cache_report(load(ckpt, cache, torch.float32))["status"] == "hit"


# ------------------------------------------------------------------------------------------- size


def test_size_limit_evicts_least_recently_used_and_skips_what_cannot_fit(tmp_path) -> None:
    a, b = save_tiny(tmp_path / "a", seed=0), save_tiny(tmp_path / "b", seed=1)
    probe = WeightCache(tmp_path / "probe")
    entry_bytes = Path(cache_report(load(a, probe))["path"]).stat().st_size
    cache = WeightCache(tmp_path / "cache", max_bytes=int(entry_bytes * 1.5))
    first = Path(cache_report(load(a, cache))["path"])
    second = Path(cache_report(load(b, cache))["path"])
    assert second.exists() and not first.exists()  # `a` was evicted to make room for `b`
    assert [p for p, _, _ in cache.entries()] == [second]

    tiny = WeightCache(tmp_path / "tiny", max_bytes=entry_bytes // 2)
    got = load(a, tiny)
    assert cache_report(got)["status"] == "skipped" and got.load_stats["method"] == "direct-stream"
    assert not list((tmp_path / "tiny").glob(f"*{SUFFIX}"))
    assert_same_weights(got, load(a, None))


def test_orphaned_temporary_files_are_removed(tmp_path) -> None:
    ckpt = save_tiny(tmp_path / "ckpt")
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    orphan = cache_dir / f".x{SUFFIX}.{2**22 + 12345}.tmp"  # a pid above pid_max: not running
    orphan.write_bytes(b"partial")
    load(ckpt, WeightCache(cache_dir))
    assert not orphan.exists()


# ------------------------------------------------------------------------------------ streaming


def test_direct_stream_equals_per_tensor_with_mixed_dtypes(tmp_path, monkeypatch, mode) -> None:
    ckpt = save_tiny(tmp_path / "ckpt", shard_bytes=200_000)  # several shards
    shards = sorted(ckpt.glob("*.safetensors"))
    tensors = load_file(shards[0])
    tensors = {k: v.bfloat16() if "norm" in k else v for k, v in tensors.items()}  # cast on load
    save_file(tensors, shards[0], metadata={"format": "pt"})
    got = load(ckpt, None)
    assert got.load_stats["method"] == "direct-stream"
    streamed = got.load_stats["checkpoint_stream"]["bytes"]
    assert 0 < streamed < got.load_stats["bytes"]  # the bf16 norms went per tensor
    monkeypatch.setattr(loader, "_DIRECT", False)
    want = load(ckpt, None)
    assert want.load_stats["method"] == "per-tensor"
    assert_same_weights(got, want)
    cache = WeightCache(tmp_path / "cache")  # a miss fills the entry the same way
    monkeypatch.setattr(loader, "_DIRECT", True)
    built = load(ckpt, cache)
    assert built.load_stats["checkpoint_stream"]["bytes"] == streamed
    assert_same_weights(built, want)
    assert_same_weights(load(ckpt, cache), want)


def test_hybrid_model_streams_and_caches(tmp_path, mode, monkeypatch) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY_QWEN3_5)).save_pretrained(tmp_path / "ckpt")
    with monkeypatch.context() as patch:
        patch.setattr(loader, "_DIRECT", False)
        want = load(tmp_path / "ckpt", None)
    direct = load(tmp_path / "ckpt", None)
    assert direct.load_stats["method"] == "direct-stream"
    assert_same_weights(direct, want)  # merged in_proj / qkv / gate_up rows placed by byte offsets
    cache = WeightCache(tmp_path / "cache")
    load(tmp_path / "ckpt", cache)
    hit = load(tmp_path / "ckpt", cache)
    assert cache_report(hit)["status"] == "hit"
    assert_same_weights(hit, want)


def test_plan_chunks_splits_and_merges() -> None:
    pieces = [("f", 0, 8, 0), ("f", 8, 8, 100), ("f", 20, 4, 50), ("f", 40, 8, 7), ("g", 0, 70, 300)]
    chunks = plan_chunks(pieces, chunk_bytes=32, max_gap=4)
    assert [(c.path, c.start, c.nbytes) for c in chunks] == [
        ("f", 0, 24),  # neighbours share a read; a 4-byte gap is read and skipped
        ("f", 40, 8),  # a 16-byte gap starts a new read
        ("g", 0, 32),  # a piece larger than a chunk is split
        ("g", 32, 32),
        ("g", 64, 6),
    ]
    assert chunks[0].segments == ((0, 8, 0), (8, 8, 100), (20, 4, 50))
    assert chunks[3].segments == ((0, 32, 332),)
    assert sum(n for c in chunks for _, n, _ in c.segments) == sum(p[2] for p in pieces)


# ------------------------------------------------------------------------------------------ knobs


def test_engine_config_knobs(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "weights"
    cache = EngineConfig().weight_cache()
    assert cache is not None and cache.directory == tmp_path / "weights" and cache.verify
    assert cache.max_bytes == 64 * 10**9
    for off in (None, "off", "none", ""):
        assert EngineConfig(weight_cache_dir=off).weight_cache() is None
    custom = EngineConfig(weight_cache_dir=str(tmp_path / "shm"), weight_cache_max_gb=None).weight_cache()
    assert custom is not None and custom.directory == tmp_path / "shm" and custom.max_bytes is None


def test_unusable_cache_directory_falls_back_to_the_checkpoint(tmp_path) -> None:
    ckpt = save_tiny(tmp_path / "ckpt")
    (tmp_path / "file").write_text("not a directory")
    got = load(ckpt, WeightCache(tmp_path / "file" / "weights"))
    assert cache_report(got)["status"] == "error"
    assert_same_weights(got, load(ckpt, None))
