"""The decode panels in the weight cache (kernels/cpu/panel_cache.py): written once by the first engine
that packs them, then mapped, equal to `cpu_gemm.pack`'s; a damaged entry is rebuilt, never used; an
engine over mapped panels answers token for token as one that packed its own."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.llm import LLM
from splitserve.kernels.cpu import gemm as cpu_gemm
from splitserve.kernels.cpu.panel_cache import cached_panels
from splitserve.model import weight_cache_entry
from splitserve.model.layers import Linear
from splitserve.model.loader import load_model
from splitserve.model.random_weights import TINY_QWEN3, random_model, save_hf_checkpoint
from splitserve.model.weight_cache import DATA_OFFSET, WeightCache, read_entry
from splitserve.sampling.params import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def op() -> None:
    if not cpu_gemm.load(force=True):
        pytest.skip("no AVX-512 on this host: engines take no panels here")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    model = random_model(TINY_QWEN3, "cpu", torch.float32, seed=0).model
    return save_hf_checkpoint(model, TINY_QWEN3, tmp_path_factory.mktemp("ckpt"), progress=False)


def projections(ckpt: Path, cache: WeightCache) -> tuple[str, dict[str, torch.Tensor]]:
    """The weights' cache entry and {name: weight} of the model's projections."""
    loaded = load_model(ckpt, torch.device("cpu"), torch.float32, lambda cfg: 256, progress=False,
                        weight_cache=cache)  # fmt: skip
    weights = {n: m.weight for n, m in loaded.model.named_modules() if isinstance(m, Linear)}
    return loaded.load_stats["cache"]["path"], weights


def test_panels_are_written_once_then_mapped_and_equal_packing(ckpt, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(weight_cache_entry, "RACY_S", 0.0)  # trust a stamp written in the file's tick
    cache = WeightCache(tmp_path)
    entry, weights = projections(ckpt, cache)
    first = cached_panels(cache, entry, weights)
    assert first is not None and first.keys() == weights.keys()
    for name, w in weights.items():
        assert torch.equal(first[name], cpu_gemm.pack(w)), name
    [path] = [p for p in tmp_path.glob("*-panels-*.sswc")]
    inode = path.stat().st_ino
    again = cached_panels(cache, entry, weights)
    assert again is not None and path.stat().st_ino == inode  # mapped, not written again
    assert all(torch.equal(again[n], first[n]) for n in weights)
    time.sleep(0.05)  # file times advance by the kernel's tick: the flip below lands in a later one
    with path.open("r+b") as fh:  # a flipped bit inside the panels: only the CRC32s can tell
        at = DATA_OFFSET + read_entry(path).layout.data_bytes // 2
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x5A]))
    fixed = cached_panels(cache, entry, weights)
    assert fixed is not None and path.stat().st_ino != inode  # rebuilt
    assert all(torch.equal(fixed[n], cpu_gemm.pack(w)) for n, w in weights.items())


def test_an_engine_over_mapped_panels_answers_as_one_that_packed_them(ckpt, tmp_path) -> None:
    def greedy(cache_dir: str) -> list[list[int]]:
        config = EngineConfig(model=str(ckpt), device="cpu", dtype="float32", max_model_len=256,
                              max_num_seqs=4, kv_cache_bytes=4 * 2**20, progress=False,
                              weight_cache_dir=cache_dir)  # fmt: skip
        engine = LLMEngine(config, tokenizer=None)
        assert engine.loaded.model.cpu_lm_head.panels is not None
        prompts = [{"prompt_token_ids": [1 + i, 7, 42 + i, 3]} for i in range(3)]
        outs = LLM.from_engine(engine).generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                                                use_tqdm=False)  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs]

    packed = greedy("off")
    written = greedy(str(tmp_path))  # packs, and writes the panels' entry
    assert list(tmp_path.glob("*-panels-*.sswc"))
    mapped = greedy(str(tmp_path))
    assert packed == written == mapped
