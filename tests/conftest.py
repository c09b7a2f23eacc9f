"""Shared fixtures: the real default model (loaded once), its HF transformers twin, tiny random models, and
the serving tests' session deployments (one disaggregated, one colocated; built by serve_harness.py)."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from tiny_configs import save_tiny_qwen3_5

from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.llm import LLM
from splitserve.model.checkpoint import default_model_path
from splitserve.model.loader import load_model
from splitserve.model.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from serve_harness import Deployment

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs the CLI in-process (`splitserve.logs.setup_logging`) points the root logger at
    that test's captured stderr; restored after it, so that a later test's log lines (say a background
    release's warning) do not go to a closed stream ("--- Logging error ---" in CI's output)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch at one intra-op thread for a module of tiny-model tests (`pytestmark = usefixtures(...)`):
    their tensors are so small that more threads only add synchronization, which on a busy shared
    machine costs more than the work (50x slower with 2 threads under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    """A tiny random-weight Qwen3.5 checkpoint (tiny_configs.TINY_QWEN3_5, weight seed 1)."""
    return save_tiny_qwen3_5(tmp_path_factory.mktemp("tiny-qwen3_5") / "a", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen_loaded(tiny_qwen):
    """`tiny_qwen` loaded once on the CPU in fp32 (max_model_len 256), for engines made in-process."""
    return load_model(tiny_qwen, torch.device("cpu"), torch.float32, lambda cfg: 256, progress=False)


@pytest.fixture(scope="session")
def default_path() -> str:
    return str(default_model_path())


@pytest.fixture(scope="session")
def smol_loaded(default_path):
    return load_model(default_path, torch.device("cpu"), torch.float32, lambda cfg: 2048, progress=False)


@pytest.fixture(scope="session")
def smol_tokenizer(default_path, smol_loaded) -> Tokenizer:
    """The default model's tokenizer as a worker loads it: the GGUF's vocabulary converted once into the
    cache (scripts/setup.sh's prepare does it) and read from there. tests/model/test_tokenizer.py holds
    the conversion to the cache, and what is read from it to transformers' ids."""
    tok = load_tokenizer(default_path, eos_ids=smol_loaded.config.eos_token_ids)
    assert tok is not None
    return tok


@pytest.fixture(scope="session")
def make_smol_llm(smol_loaded, smol_tokenizer):
    """Build an LLM over the already-loaded default weights with any engine knobs."""

    def make(**knobs) -> LLM:
        knobs.setdefault("kv_cache_bytes", 256 * 2**20)
        config = EngineConfig(model=str(default_model_path()), max_model_len=2048, progress=False, **knobs)
        return LLM.from_engine(LLMEngine(config, tokenizer=smol_tokenizer, loaded=smol_loaded))

    return make


@pytest.fixture(scope="session")
def smol_llm(make_smol_llm) -> LLM:
    return make_smol_llm()


@pytest.fixture(scope="session")
def chat_prompt_ids(smol_tokenizer) -> list[list[int]]:
    return [smol_tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


@pytest.fixture(scope="session")
def hf_smol(default_path):
    """transformers' own load of the default GGUF. Its loader parses the file's header twice and builds
    the same tensor-name map once per module (10 of its 20 s); both are memoised for this one load
    (the same reader and map every time: nothing it loads changes)."""
    from unittest import mock

    import gguf
    from transformers import AutoModelForCausalLM

    with (
        mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)),
        mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
    ):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(default_path), gguf_file=os.path.basename(default_path), dtype=torch.float32
        ).eval()


def hf_greedy(
    model, prompts: list[list[int]], max_new_tokens: int, eos_ids: tuple[int, ...]
) -> list[list[int]]:
    """HF transformers' greedy continuations of the prompts, each up to and including its EOS: one
    `generate` over the batch, the prompts left-padded under an attention mask (HF's batched path; on
    the default model it gives each prompt's unbatched answer, token for token, in a third of the time)."""
    width, pad = max(map(len, prompts)), eos_ids[0] if eos_ids else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=list(eos_ids) or None,
            pad_token_id=pad,
        )
    answers = []
    for row in out[:, width:].tolist():  # after its EOS, a finished row is padding
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:end])
    return answers


@pytest.fixture(scope="session")
def hf_smol_greedy(hf_smol, chat_prompt_ids, smol_tokenizer) -> list[list[int]]:
    return hf_greedy(hf_smol, chat_prompt_ids, 64, smol_tokenizer.eos_token_ids)


@pytest.fixture(scope="session")
def disaggregated() -> Deployment:
    """Disaggregated (1 prefill + 1 decode over shm), API keys on; a streamed choice's first token goes
    ahead of the KV transfer (`router.first_token: prefill`, test_first_token.py)."""
    from serve_harness import API_KEY, manifest_yaml, start_deployment  # imports the openai client

    dep = start_deployment(manifest_yaml(mode="disaggregated", router={"first_token": "prefill"}), API_KEY)
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)


@pytest.fixture(scope="session")
def colocated() -> Deployment:
    """Colocated (1 worker), no keys, a small bounded queue (2 running + 1 queued) for the overload test."""
    from serve_harness import manifest_yaml, start_deployment

    manifest = manifest_yaml(
        mode="colocated", server={"port": 0, "max_concurrent_requests": 2, "max_queued_requests": 1}
    )
    dep = start_deployment(manifest)
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)


@pytest.fixture(scope="session")
def openai_schema() -> dict:
    from serve_harness import SCHEMA_PATHS

    path = next(p for p in SCHEMA_PATHS if p.exists())
    return json.loads(path.read_text())
