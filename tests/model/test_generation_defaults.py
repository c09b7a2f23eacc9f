"""A checkpoint's sampling defaults (model/generation_defaults.py), as vLLM's `--generation-config` reads
them: an HF directory's generation_config.json, a GGUF's general.sampling metadata, or none."""

from __future__ import annotations

import json
from pathlib import Path

from splitserve.model.checkpoint_path import default_model_path
from splitserve.model.generation_defaults import describe, generation_defaults, gguf_sampling


def _folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_an_hf_directory_gives_its_sampling_fields_and_nothing_else(tmp_path: Path) -> None:
    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True, "eos_token_id": [1, 2],
              "max_new_tokens": 99, "repetition_penalty": None}  # fmt: skip
    folder = _folder(tmp_path, config)
    defaults, source = generation_defaults("auto", str(folder))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert source.endswith("generation_config.json")
    assert "temperature=0.6" in describe(defaults, source)


def test_vllm_ignores_them_and_a_folder_setting_reads_that_folder(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    model = _folder(tmp_path / "model", {"temperature": 0.6})
    other = tmp_path / "other"
    other.mkdir()
    _folder(other, {"top_k": 5, "min_p": 0.1})
    assert generation_defaults("vllm", str(model))[0] == {}
    assert generation_defaults(str(other), str(model))[0] == {"top_k": 5, "min_p": 0.1}
    assert generation_defaults("auto", "random:tiny-qwen3")[0] == {}
    assert generation_defaults("auto", str(tmp_path))[0] == {}  # a folder without the file


def test_gguf_metadata_maps_to_the_request_fields() -> None:
    meta = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40,
            "general.sampling.penalty_repeat": 1.1, "general.sampling.sequence": "edkypmxt"}  # fmt: skip
    assert gguf_sampling(meta) == {"temperature": 0.7, "top_k": 40, "repetition_penalty": 1.1}
    # the embedded model's GGUF carries none: requests keep the OpenAI defaults
    assert generation_defaults("auto", str(default_model_path()))[0] == {}
