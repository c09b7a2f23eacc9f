"""Unknown request fields: ignored with a warning line and a counter, as vLLM does (router/lenient.py),
through a real deployment; refused with a 400 naming the field under `server.reject_unknown_fields`."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry
from serve_harness import MODEL

from splitserve.router.lenient import ignored_fields_counter, validate_request
from splitserve.router.openai_protocol import APIError, ChatCompletionRequest

BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "x"}}],
                  "vendor_note": 1}],
    "max_tokens": 2,
    "foo_unknown": True,
    "stream_options": None,
}  # fmt: skip


def _server(strict: bool) -> SimpleNamespace:
    manifest = SimpleNamespace(server=SimpleNamespace(reject_unknown_fields=strict))
    reg = CollectorRegistry()
    return SimpleNamespace(manifest=manifest, ignored_fields=ignored_fields_counter(reg),
                           info=SimpleNamespace(served_name="m"), registry=reg)  # fmt: skip


def test_unknown_fields_at_every_level_are_ignored_and_counted():
    server = _server(strict=False)
    req = validate_request(server, ChatCompletionRequest, BODY)
    assert req.messages[0].text() == "Hi" and req.max_tokens == 2
    assert "foo_unknown" in BODY  # the caller's body stays as sent
    value = server.registry.get_sample_value
    for field in ("foo_unknown", "messages.*.vendor_note", "messages.*.content.*.cache_control"):
        assert value("splitserve:ignored_request_fields_total", {"model_name": "m", "field": field}) == 1
    with pytest.raises(APIError) as exc:  # a bad known field is still a 400 that names it
        validate_request(server, ChatCompletionRequest, {**BODY, "temperature": "hot"})
    assert exc.value.param == "temperature"


def test_strictness_kept_on_request():
    with pytest.raises(APIError) as exc:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "foo_unknown": 1}
        validate_request(_server(strict=True), ChatCompletionRequest, body)
    assert exc.value.status == 400 and exc.value.message == "foo_unknown: unrecognized request argument"


def test_a_deployment_answers_and_logs_them(disaggregated):
    r = httpx.post(f"{disaggregated.url}/v1/chat/completions", json=BODY, headers=disaggregated.headers(),
                   timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    comp = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "foo_unknown": 1}
    r = httpx.post(
        f"{disaggregated.url}/v1/completions", json=comp, headers=disaggregated.headers(), timeout=60
    )
    assert r.status_code == 200, r.text
    text = httpx.get(f"{disaggregated.url}/metrics?fresh=1", timeout=10).text
    assert f'splitserve:ignored_request_fields_total{{field="foo_unknown",model_name="{MODEL}"}} 2.0' in text
    deadline = time.monotonic() + 10
    while not any("present in the request but ignored" in line for line in disaggregated.log):
        assert time.monotonic() < deadline, list(disaggregated.log)[-20:]
        time.sleep(0.2)
