"""Fixtures for the prefill/decode tests: the tiny Qwen3.5 checkpoints (two weight seeds) and the
SmolLM2 chat prompts, tokenized without loading the model in the test process."""

from __future__ import annotations

import pytest
from kv_transfer_helpers import QwenPairs
from tiny_configs import save_tiny_qwen3_5

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="session")
def qwen_pairs(tiny_qwen):
    """Tiny Qwen3.5 prefill/decode pairs per backend, shared across modules
    (kv_transfer_helpers.QwenPairs)."""
    pairs = QwenPairs(tiny_qwen)
    yield pairs
    pairs.close()


@pytest.fixture(scope="session")
def other_tiny_qwen(tmp_path_factory):
    """The same architecture and shapes with other weights: another model to the handshake."""
    return save_tiny_qwen3_5(tmp_path_factory.mktemp("pd-qwen3_5") / "b", seed=2)


@pytest.fixture(scope="session")
def smol_chat_prompts(default_path) -> list[list[int]]:
    from pathlib import Path

    from splitserve.model.tokenizer import Tokenizer, gguf_fingerprint

    # the cache key from the weight cache's memo (opening the whole GGUF for it takes seconds)
    tok = Tokenizer.from_checkpoint(default_path, (), cache_key=gguf_fingerprint(Path(default_path)))
    assert tok is not None
    return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT]
