"""A served checkpoint's generation_config.json fills the sampling fields a request leaves unset, as vLLM's
`--generation-config auto` does; `vllm` ignores it. A random-weight HF directory with the default
model's tokenizer: its text is noise, but seeded sampling makes the tokens comparable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from serve_harness import manifest_yaml, start_deployment

from splitserve.model.random_weights import TINY_CHAT, random_model, save_hf_checkpoint
from splitserve.model.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

DEFAULTS = {"temperature": 0.5, "top_p": 0.9, "top_k": 3, "repetition_penalty": 1.2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt")
    save_hf_checkpoint(random_model(TINY_CHAT, "cpu", torch.float32).model, TINY_CHAT, folder, progress=False)
    tokenizer = load_tokenizer(None)  # the default model's converted tokenizer: TINY_CHAT's vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer.folder / name, folder / name)
    config = {**DEFAULTS, "do_sample": True, "eos_token_id": 2}
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def _text(dep, **fields) -> str:  # noqa: ANN001
    r = dep.client().completions.create(
        model=dep.sp.ready["model"], prompt="Once upon a time", max_tokens=12, seed=7,
        extra_body={"ignore_eos": True, **fields.pop("extra", {})}, **fields,
    )  # fmt: skip
    return r.choices[0].text


def _serve(checkpoint: Path, setting: str):  # noqa: ANN202
    model = {"source": str(checkpoint), "max_model_len": 256, "generation_config": setting}
    return start_deployment(manifest_yaml(mode="colocated", model=model))


def test_auto_applies_the_checkpoint_defaults_to_unset_fields_and_logs_them(checkpoint: Path) -> None:
    dep = _serve(checkpoint, "auto")
    try:
        assert dep.sp.ready["generation_defaults"] == DEFAULTS
        assert any("generation defaults from" in line and "top_k=3" in line for line in dep.log), dep.log
        unset = _text(dep)
        explicit = _text(dep, temperature=0.5, top_p=0.9, extra={"top_k": 3, "repetition_penalty": 1.2})
        # every default overridden: the OpenAI defaults (a field left unset would take its default)
        plain = {"top_k": -1, "repetition_penalty": 1.0}
        openai_defaults = _text(dep, temperature=1.0, top_p=1.0, extra=plain)
        assert unset == explicit
        assert unset != openai_defaults  # top_k 3 of 49152 near-uniform tokens: another draw
        # a field the request sets wins over the default
        assert _text(dep, temperature=0.0) == _text(dep, temperature=0.0, extra={"top_k": 3})
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)


def test_vllm_setting_ignores_the_generation_config(checkpoint: Path) -> None:
    dep = _serve(checkpoint, "vllm")
    try:
        assert dep.sp.ready["generation_defaults"] == {}
        assert _text(dep) == _text(dep, temperature=1.0, top_p=1.0)
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
