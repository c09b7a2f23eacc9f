"""A deployment's start: after `python -m splitserve.model.prepare` (what scripts/setup.sh runs) nothing is
left to compile or convert, and a served start logs no build; while it starts, its port answers every
request at once with a 503 that says so (runtime/start_gate.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_harness import manifest_yaml, start_deployment

from splitserve.model.prepare import cpu_ops, missing_ops

pytestmark = pytest.mark.slow


def _prepare() -> str:
    run = subprocess.run([sys.executable, "-m", "splitserve.model.prepare"], capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_after_prepare_the_build_cache_is_complete_and_a_start_compiles_nothing() -> None:
    def all_cached(out: str) -> bool:
        return "all were cached" in out and "weight cache: hit" in out

    # idempotent: a run after a run (scripts/setup.sh's, or this test's first where that one built
    # something) finds everything built
    out = _prepare()
    again = out if all_cached(out) else _prepare()
    assert all_cached(again), again
    assert cpu_ops(), "this host runs at least the portable CPU ops"
    assert missing_ops() == [], [o.name for o in missing_ops()]
    assert all(o.cached() for o in cpu_ops())
    dep = start_deployment(manifest_yaml(mode="colocated"))
    try:
        r = dep.client().completions.create(model="smollm2-135m-instruct", prompt="Hi", max_tokens=2)
        assert r.choices[0].text is not None
        built = [line for line in dep.log if "compiling" in line or "compiled at start" in line]
        assert not built, "\n".join(dep.log)
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(client: httpx.Client, url: str, path: str) -> tuple[httpx.Response | None, float]:
    """One request: (None when nothing listens yet, its seconds)."""
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}
    t0 = time.perf_counter()
    try:
        if path == "/health":
            r = client.get(url + path)
        else:
            r = client.post(url + path, json=body)
    except httpx.ConnectError:
        return None, time.perf_counter() - t0
    return r, time.perf_counter() - t0


def test_requests_during_start_up_get_503_with_retry_after_at_once_then_200() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    starting: list[tuple[str, float]] = []
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=10) as client:
        started = pool.submit(start_deployment, manifest_yaml(mode="disaggregated", server={"port": port}))
        opened = False
        while not started.done() and not opened:
            for path in ("/health", "/v1/chat/completions", "/v1/models"):
                r, seconds = _ask(client, url, path)
                if r is None:  # not bound yet: the process is still importing
                    time.sleep(0.02)
                    continue
                if r.status_code == 200:  # the API took the port over
                    opened = True
                    break
                assert r.status_code == 503, (path, r.status_code, r.text)
                assert seconds < 0.1, f"{path} took {seconds * 1e3:.0f} ms during start-up"
                assert int(r.headers["retry-after"]) >= 1
                if path == "/health":
                    assert r.json()["status"] == "starting"
                else:
                    error = r.json()["error"]
                    assert "starting" in error["message"] and error["type"] == "service_unavailable"
                starting.append((path, seconds))
            time.sleep(0.05)
        dep = started.result()
    try:
        assert len(starting) >= 6, starting  # the workers took seconds to load: many requests saw it
        assert {p for p, _ in starting} == {"/health", "/v1/chat/completions", "/v1/models"}
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        r = dep.client().chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )  # fmt: skip
        assert "Paris" in r.choices[0].message.content
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
