"""Real deployments for the serving tests: `splitserve serve MANIFEST` as a subprocess (router + worker
processes, the real default model), reached over real HTTP with the official `openai` client. The test
modules import these helpers by this module's name (tests/ is on sys.path under pytest's `prepend`
import mode): `from conftest import ...` would reach whichever folder's conftest pytest loaded last."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import yaml

from splitserve.config import parse_manifest
from splitserve.runtime.process import ServeProcess, start_serve
from splitserve.wire.auth import worker_headers

MODEL = "smollm2-135m-instruct"
API_KEY = "sk-splitserve-test"
# The deployments' KV secret (inherited by `splitserve serve`), so that tests can reach the workers' API.
SECRET = os.environ.setdefault("SPLITSERVE_KV_SECRET", "splitserve-test-secret-0123456789abcdef")
# OpenAI's own API schema: the whole file where the workplace has it, else the components the tests
# use, extracted from it into tests/data (so that CI on a fresh clone validates too).
SCHEMA_PATHS = [
    Path(__file__).resolve().parents[2] / "shared" / "openai-openapi.json",
    Path(__file__).resolve().parent / "data" / "openai_schemas.json",
]


@dataclass
class Deployment:
    sp: ServeProcess
    proc: subprocess.Popen
    url: str  # http://host:port (no /v1)
    api_key: str | None
    workers: list[dict]
    log: deque[str] = field(default_factory=lambda: deque(maxlen=400))

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0, **kw
        )

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def admin(self) -> dict:
        """GET /admin/deployment (behind the API key): workers with their addresses, thresholds."""
        return httpx.get(f"{self.url}/admin/deployment", headers=self.headers(), timeout=10).json()

    def worker_urls(self) -> dict[str, str]:
        return {w["name"]: w["url"] for w in self.admin()["workers"] if w["url"]}

    def worker_stats(self) -> dict[str, dict]:
        h = worker_headers(SECRET)
        return {
            # a worker answers /stats between engine steps: one long CPU prefill step under load can
            # take longer than 10 s (seen in CI), so the wait is the step's, not the test's
            name: httpx.get(f"{url}/stats", headers=h, timeout=60).json()
            for name, url in self.worker_urls().items()
        }

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, dict]:
        """Until every worker has nothing running or waiting and every block free; -> the stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.worker_stats()
            idle = all(
                s["unfinished"] == 0
                and s["blocks"]["free"] == s["blocks"]["total"]
                and (s["kv_transfer"] or {}).get("importing", 0) == 0
                for s in stats.values()
            )
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)

    def stop(self, timeout_s: float = 60.0) -> int:
        return self.sp.stop(timeout_s)


def manifest_yaml(**sections) -> dict:
    """The test deployments' manifest: the default model, small KV caches, quick health checks, and no
    standby spare worker (`runtime.standby`): it only speeds up restarts, and starting one (a front end
    and an engine core, importing torch and the engine) takes CPU from the tests of every deployment.
    The tests that kill workers and look at restarts turn it back on. No warm-up request either
    (`runtime.warm_up`): tests count their own requests in the workers' stats (test_warmup.py has it on)."""
    base = {
        "model": {"max_model_len": 2048},
        "engine": {"kv_cache_mb": 128, "max_num_seqs": 32},
        "server": {"port": 0},
        "runtime": {"health_interval_s": 0.5, "restart_backoff_s": 0.5, "standby": False, "warm_up": False},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return base


def start_deployment(
    manifest: dict, api_key: str | None = None, timeout_s: float = 180.0, args: list[str] | None = None
) -> Deployment:
    """`splitserve serve` on `manifest` (a dict of YAML sections) as a child process, through the same
    launcher the benchmarks and `verify` use; returns once it serves. `args`: command-line flags after
    the manifest (vLLM's names; each overrides a manifest field)."""
    overrides = {"server.api_keys": [api_key]} if api_key else None
    parsed = parse_manifest(yaml.safe_dump(manifest), "test manifest", overrides)
    sp = start_serve(parsed, timeout_s, args=args)
    return Deployment(sp, sp.proc, sp.url, api_key, sp.ready["workers"], sp.log)


def check_schema(schema: dict, name: str, body: dict) -> None:
    """Validate `body` against OpenAI's own schema component `name`."""
    import jsonschema

    doc = {"$ref": f"#/components/schemas/{name}", "components": _nullable(schema["components"])}
    jsonschema.validate(body, doc, cls=jsonschema.Draft202012Validator)


def _nullable(node):
    """OpenAPI 3.0's `nullable: true` (which the file still uses in places) as JSON Schema: null allowed."""
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items()}
    if out.pop("nullable", False):
        if isinstance(out.get("type"), str):
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        if "$ref" in out or "allOf" in out or "anyOf" in out or "oneOf" in out:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


def sse_events(raw: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^data: (.*)$", raw, flags=re.M)]


async def stream_tokens(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, list[str]]:
    """A streamed `/v1/completions` with `logprobs`: ("ok" or the error, the tokens streamed), whether the
    error is the status or an event in the stream."""
    tokens: list[str] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {(await r.aread())[:300]!r}", tokens
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error {event['error']}", tokens
                tokens += event["choices"][0]["logprobs"]["tokens"]
    return "ok", tokens
