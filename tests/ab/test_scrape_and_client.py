"""/metrics scraping against the router's own Prometheus output, and the client's timing and error kinds
against a mocked streaming endpoint."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from splitserve.ab.client import ClientOptions, run_trace
from splitserve.ab.runner import manifest_hardware, url_hardware
from splitserve.ab.scrape import UtilSampler, delta, parse_metrics, server_breakdown, workers
from splitserve.ab.workload import BenchRequest
from splitserve.config.manifest import load_manifest
from splitserve.router.metrics import RouterMetrics


def test_breakdown_from_the_routers_metrics():
    m = RouterMetrics("smol")
    m.observe_first(0.5, {"queue_s": 0.1, "prefill_s": 0.2})  # before the run: differenced away
    before = parse_metrics(m.render().decode())
    for _ in range(2):
        m.observe_first(
            1.0,
            {"queue_s": 0.1, "prefill_s": 0.4, "kv_fetch_s": 0.2, "kv_wait_s": 0.1, "kv_backend": "shm",
             "kv_bytes": 2 << 20},
        )  # fmt: skip
    m.worker_up.labels("smol", "prefill-0", "prefill").set(1)
    m.worker_up.labels("smol", "decode-0", "decode").set(1)
    m.errors.labels("smol", "503").inc()
    after = parse_metrics(m.render().decode())
    s = server_breakdown(delta(before, after))
    assert s["ttft_ms"] == pytest.approx(1000.0)
    assert s["queue_ms"] == pytest.approx(100.0)
    assert s["prefill_ms"] == pytest.approx(400.0)
    assert s["first_decode_ms"] == pytest.approx(200.0)  # 1.0 - 0.1 - 0.4 - 0.2 - 0.1
    assert s["transfer_incl_wait_ms"] == pytest.approx(300.0)  # fetch + wait for room
    assert s["kv"]["shm"]["transfers"] == 2
    assert s["kv"]["shm"]["mean_ms"] == pytest.approx(200.0)
    assert s["kv"]["shm"]["mean_mib"] == pytest.approx(2.0)
    assert s["kv"]["shm"]["outcomes"] == {"ok": 2}
    assert s["kv_share_of_ttft"] == pytest.approx(0.2)
    assert s["errors_by_status"] == {"503": 1}
    assert workers(after) == [
        {"worker": "decode-0", "role": "decode"},
        {"worker": "prefill-0", "role": "prefill"},
    ]
    colocated = RouterMetrics("smol")
    colocated.observe_first(0.3, {"queue_s": 0.0, "prefill_s": 0.2})
    c = server_breakdown(delta(None, parse_metrics(colocated.render().decode())))
    assert c["kv"] == {} and math.isnan(c["kv_share_of_ttft"]) and c["transfer_incl_wait_ms"] == 0.0


def test_a_first_token_ahead_of_the_transfer_leaves_it_out_of_ttft():
    """`router.first_token: prefill`: the first token is the prefill worker's, the transfer is counted
    with the decode worker's first line after it, and is no part of TTFT."""
    m = RouterMetrics("smol")
    m.observe_first(0.6, {"queue_s": 0.1, "prefill_s": 0.4, "kv_backend": "shm"})
    m.observe_transfer({"kv_fetch_s": 0.2, "kv_wait_s": 0.1, "kv_backend": "shm", "kv_bytes": 1 << 20})
    s = server_breakdown(delta(None, parse_metrics(m.render().decode())))
    assert s["ttft_ms"] == pytest.approx(600.0) and s["first_decode_ms"] == pytest.approx(100.0)
    assert s["kv"]["shm"]["transfers"] == 1 and s["kv"]["shm"]["outcomes"] == {"ok": 1}
    assert s["transfer_incl_wait_ms"] == 0.0 and s["kv_share_of_ttft"] == 0.0


def test_hardware_and_price_per_hour():
    prices = {"cpu": 0.05, "cuda": 4.0}
    dis = load_manifest(None, {"model.device": "cpu", "decode.replicas": 2})
    hw = manifest_hardware(dis, prices)
    assert hw["devices"] == {"cpu": 3} and hw["usd_per_hour"] == pytest.approx(0.15)
    gpu = load_manifest(None, {"prefill.devices": ["cuda:0"], "decode.devices": ["cuda:1"]})
    assert manifest_hardware(gpu, prices)["usd_per_hour"] == pytest.approx(8.0)
    samples = {("splitserve:worker_up", (("role", "colocated"), ("worker", "colocated-0"))): 1.0}
    assert url_hardware(samples, "cpu", prices)["devices"] == {"cpu": 1}
    with pytest.raises(ValueError, match="no price for device kind tpu"):
        url_hardware(None, "tpu", prices)


def test_util_sampler_measures_this_process():
    s = UtilSampler(None).start()
    sum(i * i for i in range(200_000))
    out = s.stop()
    assert 0 <= out["cpu_host_pct"] <= 100.5
    assert out["gpu_util_pct"] is None or out["gpu_util_pct"] >= 0


def _sse(events: list[dict | str]) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events
    )


class _Slow(httpx.AsyncByteStream):
    """An SSE body that yields its chunks with a delay before each."""

    def __init__(self, chunks: list[bytes], gap: float) -> None:
        self.chunks, self.gap = chunks, gap

    async def __aiter__(self):
        for c in self.chunks:
            await asyncio.sleep(self.gap)
            yield c


def _endpoint(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    prompt = body["prompt"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    kind = prompt[0] if isinstance(prompt, list) else 0
    if kind == 1:
        return httpx.Response(503, json={"error": {"message": "busy"}})
    if kind == 2:
        chunks = [_sse([{"choices": [{"text": "a"}]}, {"error": {"message": "decode worker died"}}])]
        return httpx.Response(200, stream=_Slow(chunks, 0.0))
    if kind == 3:
        return httpx.Response(200, stream=_Slow([_sse([{"choices": [{"text": "a"}]}])], 0.0))  # no [DONE]
    n = body["max_tokens"]
    chunks = [_sse([{"choices": [{"text": "x", "index": 0}]}]) for _ in range(n)]
    chunks.append(_sse([{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}}, "[DONE]"]))
    headers = {
        "x-splitserve-ttft-ms": "12.5",
        "x-splitserve-ttft-prefill-ms": "10.0",
        "x-splitserve-kv-backend": "shm",
    }
    return httpx.Response(200, stream=_Slow(chunks, 0.05), headers=headers)


def test_client_times_chunks_and_sorts_failures():
    trace = [
        BenchRequest(0, (0, 5, 6), 3, 5, 0.0),
        BenchRequest(1, (1, 5), 2, 5, 0.01),
        BenchRequest(2, (2, 5), 2, 5, 0.02),
        BenchRequest(3, (3, 5), 2, 5, 0.03),
    ]
    results, duration = asyncio.run(
        run_trace("http://bench.test", trace, ClientOptions("m"), transport=httpx.MockTransport(_endpoint))
    )
    ok = results[0]
    assert ok.success and ok.output_tokens == 5 and ok.prompt_len == 7  # the server's usage count
    assert ok.ttft_s == pytest.approx(0.05, abs=0.04)
    assert len(ok.itl_s) == 4 and all(g == pytest.approx(0.05, abs=0.04) for g in ok.itl_s)
    # e2e ends at the last chunk with a choice, not at the usage chunk after it (vLLM)
    assert ok.latency_s == pytest.approx(ok.ttft_s + sum(ok.itl_s), abs=1e-6)
    assert ok.server_ms == {"ttft": 12.5, "prefill": 10.0} and ok.kv_backend == "shm"
    assert [r.error_kind for r in results[1:]] == ["http_503", "stream_error", "incomplete"]
    assert "decode worker died" in results[2].error
    assert duration >= ok.latency_s


def test_extra_body_fields_join_every_request():
    seen = []

    def endpoint(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return _endpoint(request)

    opts = ClientOptions("m", extra_body={"repetition_penalty": 1.0, "logprobs": None})
    mock = httpx.MockTransport(endpoint)
    asyncio.run(run_trace("http://bench.test", [BenchRequest(0, (0, 5), 2, 2)], opts, transport=mock))
    assert seen[0]["repetition_penalty"] == 1.0 and "logprobs" in seen[0] and seen[0]["max_tokens"] == 2


def test_requests_reuse_one_kept_alive_connection():
    """Each answer is read to its end (past [DONE]), so one at a time all go over one connection, as with
    vLLM's client (a stream abandoned at [DONE] would cost a new connection per request)."""
    connections = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the client closed this connection
            lines = head.lower().split(b"\r\n")
            length = next(int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length"))
            body = json.loads(await reader.readexactly(length))
            events = [{"choices": [{"text": "x", "index": 0}]}] * body["max_tokens"]
            events += [
                {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": body["max_tokens"]}}
            ]
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for chunk in [_sse([e]) for e in events] + [_sse(["[DONE]"]), b""]:
                writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                await writer.drain()

    async def go() -> list:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        trace = [BenchRequest(i, (5, 6), 2, 3) for i in range(4)]
        try:
            results, _ = await run_trace(
                f"http://127.0.0.1:{port}", trace, ClientOptions("m", max_concurrency=1)
            )
        finally:
            server.close()
            for w in connections:
                w.close()
        return results

    results = asyncio.run(go())
    assert all(r.success and r.output_tokens == 3 for r in results)
    assert len(connections) == 1


def test_connection_refused_is_a_failure_kind():
    results, _ = asyncio.run(
        run_trace("http://127.0.0.1:1", [BenchRequest(0, (5,), 1, 2)], ClientOptions("m", timeout_s=5))
    )
    assert results[0].error_kind == "connect" and not results[0].success


def test_interleaved_targets_alternate_by_rate(monkeypatch):
    from splitserve.ab import runner
    from splitserve.ab.metrics import SLO

    calls = []
    monkeypatch.setattr(
        runner.Session, "open", lambda self: calls.append(("open", self.run.target.name)) or True
    )
    monkeypatch.setattr(
        runner.Session, "bench", lambda self, i: calls.append((self.run.target.name, self.opts.rates[i]))
    )
    opts = runner.RunOptions(rates=[1.0, 2.0, 4.0], slo=SLO(), prices={"cpu": 1.0})
    targets = [runner.Target("a", "http://a"), runner.Target("b", "http://b")]
    runner.run_targets(targets, [], opts, interleave=True)
    assert calls == [
        ("open", "a"),
        ("open", "b"),
        ("a", 1.0),
        ("b", 1.0),
        ("b", 2.0),
        ("a", 2.0),
        ("a", 4.0),
        ("b", 4.0),
    ]
    calls.clear()
    runner.run_targets(targets, [], opts)
    assert calls == [
        ("open", "a"),
        ("a", 1.0),
        ("a", 2.0),
        ("a", 4.0),
        ("open", "b"),
        ("b", 1.0),
        ("b", 2.0),
        ("b", 4.0),
    ]
