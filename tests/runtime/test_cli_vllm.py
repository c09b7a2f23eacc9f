"""`splitserve serve` parsed as `vllm serve` is typed, and the manifest's vLLM names (no processes)."""

from __future__ import annotations

import pytest

from splitserve.cli import build_parser, main
from splitserve.cli_serve import serve_overrides
from splitserve.config import ManifestError, load_manifest, parse_manifest


def _manifest(*argv: str):
    path, overrides = serve_overrides(build_parser().parse_args(["serve", *argv]))
    return load_manifest(path, overrides)


def test_a_model_argument_and_vllm_flags_fill_the_manifest():
    m = _manifest(
        "default", "--gpu-memory-utilization", "0.7", "--max-num-batched-tokens", "1024",
        "--max-num-seqs", "9", "--block-size", "32", "--no-enable-prefix-caching", "--enforce-eager",
        "--seed", "4", "--tokenizer", "/tok", "--served-model-name", "a", "b", "-tp", "1",
    )  # fmt: skip
    e = m.engine
    assert (e.memory_utilization, e.max_num_batched_tokens, e.max_num_seqs) == (0.7, 1024, 9)
    assert e.block_size == 32
    assert (e.enable_prefix_caching, e.enforce_eager, e.seed) == (False, True, 4)
    assert m.model.source == "default" and m.model.tokenizer == "/tok"
    assert m.model.served_names() == ["a", "b"] and m.model.resolved_served_name() == "a"
    assert _manifest("--enable-prefix-caching").engine.enable_prefix_caching is True
    assert _manifest().server.metrics_auth is False  # /metrics open, as vLLM's
    assert _manifest("--metrics-auth").server.metrics_auth is True
    tp = _manifest("-tp", "2")
    assert (tp.model.tensor_parallel_size, tp.mode) == (2, "colocated")
    assert tp.tensor_parallel_size("colocated") == 2
    spec = _manifest("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}').engine
    assert spec.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ManifestError, match="speculative method"):
        _manifest("--speculative-config", '{"method": "eagle"}')


def test_a_model_path_is_served_under_its_own_name_as_vllm_does(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"")
    m = _manifest(str(gguf))
    assert m.model.source == str(gguf) and m.model.served_names() == [str(gguf), "tiny"]
    assert _manifest("HuggingFaceTB/SmolLM2-135M-Instruct").model.source == "default"


def test_refusals_say_why(capsys, tmp_path):
    assert main(["serve", str(tmp_path / "missing.yaml")]) == 2
    assert "no such manifest file" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "missing-model")]) == 2
    assert "no such model file or directory" in capsys.readouterr().err
    assert main(["serve", "--api-key", ""]) == 2  # an empty key would admit an empty token
    assert "an API key must not be empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("splitserve ")


def test_the_manifest_takes_vllm_names():
    m = parse_manifest(
        "model: {served_model_name: [x, y], tensor_parallel_size: 1}\n"
        "engine: {gpu_memory_utilization: 0.5, enable_prefix_caching: false}\n"
        "decode: {engine: {gpu_memory_utilization: 0.6}}\n"
    )
    assert m.engine.memory_utilization == 0.5 and m.engine.enable_prefix_caching is False
    assert m.engine_for("decode").memory_utilization == 0.6 and m.model.served_names() == ["x", "y"]
    tp = parse_manifest(
        "mode: colocated\nmodel: {tensor_parallel_size: 2}\ncolocated: {engine: {tensor_parallel_size: 4}}"
    )
    assert tp.tensor_parallel_size("colocated") == 4
    assert (
        parse_manifest("mode: colocated\nmodel: {tensor_parallel_size: 2}").tensor_parallel_size("colocated")
        == 2
    )
    pd = parse_manifest("model: {tensor_parallel_size: 2}\ndecode: {engine: {tensor_parallel_size: 1}}")
    assert (pd.mode, pd.tensor_parallel_size("prefill"), pd.tensor_parallel_size("decode")) == (
        "disaggregated",
        2,
        1,
    )  # prefill and decode at different sizes (the KV moves between the layouts)


def test_the_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    assert parse_manifest("").server.keys() == ["vk"]
    monkeypatch.setenv("SPLITSERVE_API_KEY", "sk")
    assert parse_manifest("").server.keys() == ["sk"]
    assert parse_manifest("server: {api_keys: [given]}").server.keys() == ["given"]
