"""Copied `vllm serve` command lines: each parses into the manifest it means (splitserve/vllm_flags.py),
and two start for real and answer: the reference deployment's flags (its NixlConnector over LIBFABRIC,
served colocated here, where no KV moves) and the API server's (chat template, CORS, logging)."""

from __future__ import annotations

import json
import shlex

import httpx
import pytest

from splitserve.cli import build_parser
from splitserve.cli_serve import serve_overrides
from splitserve.config import load_manifest
from splitserve.runtime.process import start_serve

NIXL = json.dumps(
    {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"backends": ["LIBFABRIC"]},
    }
)
# the reference's vLLM command line (Qwen3.5-9B, bf16, 4096 tokens, KV over NIXL/LIBFABRIC), model swapped
REFERENCE = (f"default --dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.9 --max-num-seqs 128 "
             f"--max-num-batched-tokens 8192 --served-model-name qwen3.5-9b --enable-prefix-caching "
             f"--trust-remote-code --kv-transfer-config '{NIXL}'")  # fmt: skip
COMMAND_LINES = [
    REFERENCE,
    "default --uvicorn-log-level warning --disable-log-requests",
    "default --enable-log-requests --trust-remote-code --seed 0",
    'default --allowed-origins \'["*"]\' --allowed-methods \'["GET", "POST"]\' --allowed-headers \'["*"]\' '
    "--allow-credentials",
    "default --chat-template '{% for m in messages %}{{ m.content }}{% endfor %}'",
    'default --kv-transfer-config \'{"kv_connector": "NixlConnector"}\' --port 8001 --host 0.0.0.0',
]


def _manifest(line: str):
    path, overrides = serve_overrides(build_parser().parse_args(["serve", *shlex.split(line)]))
    return load_manifest(path, overrides)


@pytest.mark.parametrize("line", COMMAND_LINES)
def test_vllm_command_lines_parse(line):
    _manifest(line)


def test_what_the_flags_mean_here():
    m = _manifest(REFERENCE)
    assert (m.transport.backend, m.transport.nixl_backends) == ("nixl", ["LIBFABRIC"])
    assert m.model.served_names() == ["qwen3.5-9b"] and m.model.max_model_len == 4096
    assert _manifest(COMMAND_LINES[5]).transport.nixl_backends == ["UCX"]  # NIXL's default kept
    cors = _manifest(COMMAND_LINES[3]).server.cors
    assert (cors.allowed_origins, cors.allowed_methods, cors.allow_credentials) == (
        ["*"],
        ["GET", "POST"],
        True,
    )
    assert _manifest("default").server.cors is None  # no --allowed-origins: no CORS
    assert _manifest("default --enable-log-requests --no-access-log").server.access_log is True
    assert "{{ m.content }}" in _manifest(COMMAND_LINES[4]).model.chat_template
    with pytest.raises(ValueError, match="LMCacheConnectorV1.*has no backend here"):
        _manifest("""default --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1"}'""")
    with pytest.raises(SystemExit):  # argparse: not JSON
        _manifest("default --kv-transfer-config nixl")


def test_the_reference_command_line_starts_and_answers():
    args = [*shlex.split(REFERENCE), "--mode", "colocated", "--port", "0", "--max-model-len", "1024",
            "--gpu-memory-utilization", "0.05", "--max-num-seqs", "8"]  # fmt: skip
    with start_serve(None, 180, args=args) as sp:
        body = {"model": "qwen3.5-9b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        r = httpx.post(f"{sp.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert any("kv_role 'kv_both' accepted" in line for line in sp.log), list(sp.log)[-20:]
        assert any("--trust-remote-code: accepted" in line for line in sp.log)


def test_api_server_flags_start_chat_template_and_cors(tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    args = ["default", "--mode", "colocated", "--port", "0", "--chat-template", str(template),
            "--uvicorn-log-level", "warning", "--enable-log-requests", "--disable-log-requests",
            "--allowed-origins", '["http://ui.example"]', "--allow-credentials",
            "--api-key", "k"]  # fmt: skip
    with start_serve(None, 180, args=args) as sp:
        preflight = httpx.options(f"{sp.url}/v1/chat/completions", timeout=10, headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
        assert preflight.headers["access-control-allow-credentials"] == "true"
        other = httpx.options(f"{sp.url}/v1/chat/completions", timeout=10, headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})  # fmt: skip
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        h = {"Authorization": "Bearer k", "Origin": "http://ui.example"}
        ids = httpx.post(f"{sp.url}/tokenize", headers=h, timeout=10,
                         json={"messages": [{"role": "user", "content": "Hi"}]}).json()["tokens"]  # fmt: skip
        text = httpx.post(f"{sp.url}/detokenize", headers=h, json={"tokens": ids}, timeout=10).json()[
            "prompt"
        ]
        assert text == "[user] Hi\n[assistant] "  # the template given, not the checkpoint's
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
        }
        r = httpx.post(f"{sp.url}/v1/chat/completions", headers=h, json=body, timeout=60)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example", (
            r.text
        )
        assert json.loads(r.text)["choices"]
