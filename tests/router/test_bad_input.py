"""Bad input gets OpenAI's error body with the right status, and the server goes on serving."""

from __future__ import annotations

import httpx
import pytest
from serve_harness import API_KEY, MODEL, check_schema

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "Hi"}]

# (name, path, body (dict: JSON; bytes: raw), status, error param or None, a word in the message)
CASES = [
    ("malformed json", CHAT, b'{"model": "x", "messages": [', 400, None, "JSON"),
    ("not an object", CHAT, b"[1, 2]", 400, None, "object"),
    (
        "invalid utf-8",
        CHAT,
        b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
        None,
        "UTF-8",
    ),
    ("missing messages", CHAT, {"model": MODEL}, 400, "messages", "missing"),
    ("missing model", CHAT, {"messages": MSG}, 400, "model", "missing"),
    ("empty messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    (
        "message without role",
        CHAT,
        {"model": MODEL, "messages": [{"content": "hi"}]},
        400,
        "messages.0.role",
        "",
    ),
    (
        "unknown role",
        CHAT,
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages.0.role",
        "",
    ),
    (
        "user without content",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user"}]},
        400,
        "messages.0",
        "content",
    ),
    (
        "content of wrong type",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": 42}]},
        400,
        "messages.0.content",
        "",
    ),
    (
        "image part",
        CHAT,
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}
            ],
        },
        400,
        "messages.0.content",
        "",
    ),
    (
        "temperature as string",
        CHAT,
        {"model": MODEL, "messages": MSG, "temperature": "hot"},
        400,
        "temperature",
        "",
    ),
    (
        "temperature too high",
        CHAT,
        {"model": MODEL, "messages": MSG, "temperature": 5},
        400,
        "temperature",
        "",
    ),
    ("top_p zero", CHAT, {"model": MODEL, "messages": MSG, "top_p": 0}, 400, "top_p", ""),
    ("negative max_tokens", CHAT, {"model": MODEL, "messages": MSG, "max_tokens": -1}, 400, "max_tokens", ""),
    ("zero max_tokens", COMP, {"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens", ""),
    (
        "huge max_tokens",
        CHAT,
        {"model": MODEL, "messages": MSG, "max_tokens": 10**9},
        400,
        "max_tokens",
        "maximum context length is 2048",
    ),
    ("n too large", CHAT, {"model": MODEL, "messages": MSG, "n": 1000}, 400, "n", ""),
    ("n zero", CHAT, {"model": MODEL, "messages": MSG, "n": 0}, 400, "n", ""),
    (  # an unknown field is ignored (as vLLM); a bad one beside it is still named
        "unknown field beside a bad one",
        CHAT,
        {"model": MODEL, "messages": MSG, "frobnicate": 1, "temperature": "hot"},
        400,
        "temperature",
        "",
    ),
    (
        "tool without a function",
        CHAT,
        {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]},
        400,
        "tools.0.function",
        "missing",
    ),
    (
        "legacy functions",
        CHAT,
        {"model": MODEL, "messages": MSG, "functions": [{"name": "f"}]},
        400,
        None,
        "not supported",
    ),
    ("logit_bias", CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"1": 5}}, 400, None, "logit_bias"),
    (
        "top_logprobs without logprobs",
        CHAT,
        {"model": MODEL, "messages": MSG, "top_logprobs": 2},
        400,
        None,
        "logprobs",
    ),
    ("empty stop string", CHAT, {"model": MODEL, "messages": MSG, "stop": [""]}, 400, "stop", "non-empty"),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model", "does not exist"),
    ("unknown model (completions)", COMP, {"model": "gpt-9", "prompt": "a"}, 404, "model", "does not exist"),
    ("empty prompt", COMP, {"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
    ("empty id prompt", COMP, {"model": MODEL, "prompt": []}, 400, None, "empty"),
    ("token id out of range", COMP, {"model": MODEL, "prompt": [1, 10**7]}, 400, "prompt", "token ids"),
    ("negative token id", COMP, {"model": MODEL, "prompt": [-1]}, 400, "prompt", "token ids"),
    (
        "prompt over max_model_len",
        COMP,
        {"model": MODEL, "prompt": [42] * 2100},
        400,
        "prompt",
        "maximum context length is 2048",
    ),
    (
        "prompt plus completion over max_model_len",
        COMP,
        {"model": MODEL, "prompt": [42] * 2000, "max_tokens": 100},
        400,
        "max_tokens",
        "2100 tokens (2000 in the prompt, 100 in the completion)",
    ),
    # each of these must be a 400, not a 500 (nor fail other requests' step)
    (
        "lone surrogate in model",
        CHAT,
        b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}',
        400,
        None,
        "surrogate",
    ),
    (
        "lone surrogate in prompt",
        COMP,
        b'{"model": "' + MODEL.encode() + b'", "prompt": "a\\udfffb"}',
        400,
        None,
        "surrogate",
    ),
    (
        "5000-digit integer",
        COMP,
        b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        400,
        None,
        "digits",
    ),
    (
        "100,000-deep JSON",
        COMP,
        b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        None,
        "nested",
    ),
    (
        "Infinity penalty",
        COMP,
        b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "repetition_penalty": Infinity}',
        400,
        None,
        "Infinity",
    ),
    (
        "NaN temperature",
        COMP,
        b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "temperature": NaN}',
        400,
        None,
        "NaN",
    ),
    ("top_k 2^63", COMP, {"model": MODEL, "prompt": "x", "top_k": 2**63}, 400, None, "top_k"),
    # a request's own template must not replace the server's (looping templates would stall others)
    (
        "request chat template",
        CHAT,
        {
            "model": MODEL,
            "messages": MSG,
            "chat_template_kwargs": {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},
        },
        400,
        "chat_template_kwargs",
        "does not take chat templates",
    ),
    (
        "template kwargs the server owns",
        CHAT,
        {"model": MODEL, "messages": MSG, "chat_template_kwargs": {"tokenize": False}},
        400,
        "chat_template_kwargs",
        "the server sets those",
    ),
]


def _post(dep, path: str, body, headers: dict | None = None) -> httpx.Response:
    h = {"Content-Type": "application/json", **(dep.headers() if headers is None else headers)}
    if isinstance(body, dict):
        return httpx.post(f"{dep.url}{path}", json=body, headers=h, timeout=60)
    return httpx.post(f"{dep.url}{path}", content=body, headers=h, timeout=60)


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param", "word"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request(disaggregated, openai_schema, name, path, body, status, param, word):
    r = _post(disaggregated, path, body)
    assert r.status_code == status, (name, r.text)
    err = r.json()
    check_schema(openai_schema, "ErrorResponse", err)
    assert word.lower() in err["error"]["message"].lower(), err
    if param is not None:
        assert err["error"]["param"] == param, err
    assert "Traceback" not in r.text


def test_auth(disaggregated, openai_schema):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 1}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": "Bearer"},
    ):  # fmt: skip  (an empty token: never a pass)
        r = _post(disaggregated, CHAT, body, headers)
        assert r.status_code == 401, headers
        check_schema(openai_schema, "ErrorResponse", r.json())
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{disaggregated.url}/v1/models", timeout=10).status_code == 401
    # /metrics is open to a scraper, as vLLM's (server.metrics_auth: true closes it too)
    assert httpx.get(f"{disaggregated.url}/metrics", timeout=10).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):  # these describe the deployment: a key, with keys set
        assert httpx.get(f"{disaggregated.url}{path}", timeout=10).status_code == 401, path
        assert (
            httpx.get(f"{disaggregated.url}{path}", headers=disaggregated.headers(), timeout=10).status_code
            == 200
        ), path
    assert _post(disaggregated, CHAT, body, {"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_body_too_large(disaggregated):
    huge = b'{"model": "x", "prompt": "' + b"a" * (5 << 20) + b'"}'
    r = _post(disaggregated, COMP, huge)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: the limit is counted as the body streams in
        yield b'{"model": "x", "prompt": "'
        for _ in range(80):
            yield b"a" * (64 << 10)
        yield b'"}'

    r = httpx.post(
        f"{disaggregated.url}{COMP}", content=chunks(), headers=disaggregated.headers(), timeout=60
    )
    assert r.status_code == 413


def test_unknown_route_and_method(disaggregated):
    r = httpx.get(f"{disaggregated.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{disaggregated.url}{CHAT}", headers=disaggregated.headers(), timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_still_serving_after_the_battery(disaggregated):
    r = _post(disaggregated, CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    stats = disaggregated.wait_idle()
    for s in stats.values():
        assert s["blocks"]["free"] == s["blocks"]["total"]


def test_a_client_gone_mid_body_is_one_log_line(disaggregated):
    """A disconnect mid-body is one log line, not two full tracebacks (2,000 of them gave 225,280 lines)."""
    import socket
    import time

    host, port = disaggregated.url.removeprefix("http://").rsplit(":", 1)
    marker = f"-- partial bodies {time.time()} --"
    disaggregated.log.append(marker)  # the log is a bounded deque: read what came after this line
    for _ in range(3):
        s = socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\n".encode()  # past the key check, into the body
            + b'Content-Length: 1000\r\n\r\n{"model": '
        )
        time.sleep(0.2)
        s.close()

    def after() -> list[str]:
        lines = list(disaggregated.log)
        return lines[lines.index(marker) + 1 :] if marker in lines else lines

    deadline = time.monotonic() + 10
    while sum(" 499 " in line for line in after()) < 3:
        assert time.monotonic() < deadline, after()
        time.sleep(0.1)
    assert not any("Traceback" in line for line in after()), after()


def test_template_variables_still_reach_the_template(disaggregated):
    body = {
        "model": MODEL,
        "messages": MSG,
        "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert _post(disaggregated, CHAT, body).status_code == 200
