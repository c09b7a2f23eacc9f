"""A random-weight tiny Qwen3.5 carrying Qwen3.5's own chat template (tests/fixtures/qwen3_5), and its
deployments, shared by the modules that serve it (the parsers served, the agent clients): colocated and
disaggregated (1 prefill + 1 decode), each with `--enable-auto-tool-choice` and the parsers the template
asks for (`qwen3_coder`, `qwen3`), named as vLLM's flags name them: in the colocated deployment's
manifest, and on the disaggregated one's command line, as vLLM is started for Qwen3.5."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "qwen3_5" / "chat_template.jinja"
QWEN_SERVER = {"port": 0, "enable_auto_tool_choice": True, "tool_call_parser": "qwen3_coder",
               "reasoning_parser": "qwen3"}  # fmt: skip
# vLLM's command line for Qwen3.5 (`vllm serve MODEL --enable-auto-tool-choice ...`), after the model
QWEN_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3",
              "--max-model-len", "2048"]  # fmt: skip


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 checkpoint (the default model's vocabulary, so its tokenizer fits) with Qwen3.5's
    template, as a real checkpoint ships it."""
    import torch
    from tiny_configs import TINY_QWEN3_5
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from splitserve.model.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("qwen3_5-template")
    tok = load_tokenizer(None)
    assert tok is not None
    tok.hf.chat_template = TEMPLATE.read_text()
    tok.hf.save_pretrained(str(path))
    torch.manual_seed(1)
    config = Qwen3_5TextConfig(
        **{**TINY_QWEN3_5, "vocab_size": tok.vocab_size, "max_position_embeddings": 2048}
    )
    Qwen3_5ForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen_served(qwen_dir) -> Iterator[Any]:
    """Colocated: the model and the parsers in the manifest."""
    from serve_harness import manifest_yaml, start_deployment  # imports the openai client

    model = {"source": str(qwen_dir), "max_model_len": 2048}
    dep = start_deployment(manifest_yaml(mode="colocated", model=model, server=QWEN_SERVER))
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)


@pytest.fixture(scope="session")
def qwen_split(qwen_dir) -> Iterator[Any]:
    """Disaggregated, the model and the parsers given as vLLM's flags (`--model DIR` and QWEN_FLAGS) after
    a manifest that holds only the test deployments' runtime settings (serve_harness.manifest_yaml)."""
    from serve_harness import manifest_yaml, start_deployment

    dep = start_deployment(manifest_yaml(mode="disaggregated"), args=["--model", str(qwen_dir), *QWEN_FLAGS])
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)
