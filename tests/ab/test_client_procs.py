"""The load client over several processes (splitserve.ab.procs) against a small streaming server on a
real socket: every record comes back, timed on one clock; sessions, concurrency and the share split; the
byte-search chunk reader against the full parse; bench/client_check.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import multiprocessing
import shutil
import threading
import time
from pathlib import Path

import pytest

from splitserve.ab import curl_load, procs
from splitserve.ab.client import _PARSE, ClientOptions, RequestResult, _parse, _quick, chains, run_trace
from splitserve.ab.metrics import SLO, summarize
from splitserve.ab.scrape import UtilSampler
from splitserve.ab.workload import BenchRequest, at_rate

GAP = 0.02  # the server's delay before each token chunk


class _Server:
    """/v1/completions stand-in in a thread: `max_tokens` chunks GAP apart (vLLM's shape, `"usage":null`
    on each), then usage and [DONE], on kept-alive connections. Notes when each request (prompt[0]) was
    read, on time.time(), and the most requests in flight at once."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.in_flight = self.max_in_flight = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> _Server:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _main(self) -> None:
        self._loop, self._stop, writers = asyncio.get_running_loop(), asyncio.Event(), []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            try:
                await self._serve(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        await self._stop.wait()
        server.close()
        for w in writers:
            w.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.lower().split(b"\r\n")
            length = next(int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length"))
            body = json.loads(await reader.readexactly(length))
            self.seen[body["prompt"][0]] = time.time()
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            n = body["max_tokens"]
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            choice = {"index": 0, "text": " x", "logprobs": None, "finish_reason": None}
            token = {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": "m",
                "usage": None,
                "choices": [choice],
            }
            usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": n}}
            for k in range(n + 2):
                if k < n:
                    await asyncio.sleep(GAP)
                event = token if k < n else usage if k == n else "[DONE]"
                chunk = (
                    b"data: " + (event if isinstance(event, str) else json.dumps(event)).encode() + b"\n\n"
                )
                writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                await writer.drain()
            self.in_flight -= 1
            writer.write(b"0\r\n\r\n")
            await writer.drain()


def _trace() -> list[BenchRequest]:
    """18 Poisson arrivals at 30 req/s, and one agent session of three turns (think 0.05 s)."""
    firsts = at_rate([BenchRequest(i, (i, 7), 2, 5) for i in range(18)], 30.0, 1.0, 0)
    session = [
        BenchRequest(18 + k, (18 + k, 7), 2, 3, 0.1 if k == 0 else 0.0, "agent", 0, k, 0.05 if k else 0.0)
        for k in range(3)
    ]
    return firsts + session


def test_several_processes_return_every_record_timed_on_one_clock():
    trace, done = _trace(), []
    stats: dict = {}
    with _Server() as srv:

        async def go():
            return await run_trace(srv.url, trace, ClientOptions("m", procs=3), done.append, stats=stats)

        results, duration = asyncio.run(go())
    assert stats["procs"] == 3 and stats["child_cpu_s"] > 0
    assert [r.index for r in results] == [q.index for q in trace]  # complete, in trace order
    assert sorted(r.index for r in done) == sorted(q.index for q in trace)  # on_done once each
    for r, q in zip(results, trace, strict=True):
        assert type(r) is RequestResult and r.success, (r.error_kind, r.error)
        assert r.output_tokens == q.output_len and r.prompt_len == 2 and len(r.itl_s) == q.output_len - 1
        assert r.ttft_s == pytest.approx(GAP, abs=0.1) and r.ttft_s >= GAP * 0.9
        assert all(0 < g < 0.1 for g in r.itl_s)
        assert r.latency_s == pytest.approx(r.ttft_s + sum(r.itl_s), abs=1e-6)
        if q.turn == 0:  # sent at its arrival offset from the shared start (late only under load)
            assert -0.005 <= r.start_s - q.arrival_s < 0.1
    # one clock: the server's wall time of each request, less the record's start_s, is the shared start
    starts = [srv.seen[r.index] - r.start_s for r in results]
    assert max(starts) - min(starts) < 0.05
    turns = results[18:]  # a session's turns in order, each after the last answer and the think time
    for a, b in zip(turns, turns[1:], strict=False):
        assert b.start_s >= a.start_s + a.latency_s + 0.05 - 0.005
    assert duration >= max(r.start_s + r.latency_s for r in results)
    assert duration < max(r.start_s + r.latency_s for r in results) + 0.1
    m = summarize(results, duration, SLO())  # the metrics read them as before
    assert m["completed"] == 21 and m["total_output_tokens"] == 18 * 5 + 3 * 3 and m["tpot_ms"]["count"] == 21


def test_max_concurrency_holds_across_processes():
    trace = [BenchRequest(i, (i, 7), 2, 3) for i in range(10)]  # all due at once
    with _Server() as srv:
        results, _ = asyncio.run(run_trace(srv.url, trace, ClientOptions("m", procs=2, max_concurrency=3)))
        assert srv.max_in_flight == 3
    assert all(r.success for r in results)


def test_failures_come_back_from_the_processes_too():
    trace = [BenchRequest(i, (5,), 1, 2) for i in range(4)]
    results, _ = asyncio.run(run_trace("http://127.0.0.1:1", trace, ClientOptions("m", procs=2, timeout_s=5)))
    assert [r.error_kind for r in results] == ["connect"] * 4


def test_a_cancelled_run_stops_its_processes():
    trace = [BenchRequest(i, (i, 7), 2, 200) for i in range(4)]  # 4 s streams
    with _Server() as srv:
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(run_trace(srv.url, trace, ClientOptions("m", procs=2)), 1.0))
        assert time.perf_counter() - t0 < 3.5 and multiprocessing.active_children() == []


def test_how_many_processes_and_who_gets_what(monkeypatch):
    monkeypatch.setattr(procs, "_cores", lambda: 4)
    many = [BenchRequest(i, (5,), 1, 2) for i in range(200)]
    assert procs.client_procs(many, ClientOptions("m", procs=None)) == 4  # ceil(200 / 64), capped by cores
    assert procs.client_procs(many[:64], ClientOptions("m", procs=None)) == 1  # today's one process
    assert procs.client_procs(many, ClientOptions("m", procs=None, max_concurrency=100)) == 2
    assert procs.client_procs(many[:3], ClientOptions("m", procs=8)) == 3  # no more than the chains
    assert procs.client_procs(many, ClientOptions("m", procs=8, max_concurrency=2)) == 2
    assert procs.client_procs(many, ClientOptions("m")) == 1  # ClientOptions' own default
    with pytest.raises(ValueError, match="at least 1"):
        procs.client_procs(many, ClientOptions("m", procs=0))
    assert procs.concurrency_shares(5, 2) == [3, 2] and procs.concurrency_shares(None, 2) == [None, None]
    shares = procs.split(_trace(), 3)
    assert sorted(r.index for s in shares for r in s) == list(range(21))
    assert [len(chains(s)) for s in shares] == [7, 6, 6]  # 19 chains dealt round-robin
    assert sum(any(r.session == 0 for r in s) for s in shares) == 1  # a session stays in one process


CHUNKS = [
    b'{"choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null}],"usage":null}',
    b'{"id": "x", "choices": [{"index": 0, "text": "b", "finish_reason": null}]}',  # ours (spaces)
    b'{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}',
    b'{"choices":[],"usage":null}',
    b'{"choices":[{"text":"","index":0}],"usage":{"prompt_tokens":1,"completion_tokens":2}}',
    b'{"error": {"message": "decode worker died"}, "status": 500}',
    b'{"choices":[{"text":"\\"choices\\": [], \\"usage\\": {\\"error\\"","index":0}]}',  # forged in text
    b'{"choices":[{"text":"u","logprobs":{"top_logprobs":[{"usage":-0.1,"choices":-2.0}]}}]}',
    b'{"object":"error","message":"bad"}',
    b'{"id":"y"}',
]


def test_the_byte_search_agrees_with_the_full_parse():
    for data in CHUNKS:
        quick = _quick(data)
        full = RequestResult(0, "t", 0, 0)
        kind = _parse(full, data)
        assert quick == _PARSE or quick == kind, data  # never a wrong answer, at worst "parse it"
    assert _quick(CHUNKS[0]) != _PARSE and _quick(CHUNKS[1]) != _PARSE  # the common token chunks
    assert _quick(CHUNKS[6]) != _PARSE  # escaped quotes in a token's text forge nothing
    assert _quick(b"[DONE]") != _PARSE and _parse(RequestResult(0, "t", 0, 0), CHUNKS[5]) < 0


def test_util_counts_the_client_processes_as_the_clients():
    s = UtilSampler(None).start()
    time.sleep(0.05)
    out = s.stop(extra_client_cpu_s=10.0)
    assert out["cpu_client_cores"] > 5  # 10 CPU seconds over well under 2 s of wall


def _client_check():
    path = Path(__file__).resolve().parents[2] / "bench" / "client_check.py"
    spec = importlib.util.spec_from_file_location("client_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_client_check_help_and_a_run_against_the_test_server(capsys):
    cc = _client_check()
    with pytest.raises(SystemExit) as exit_:
        cc.main(["--help"])
    assert exit_.value.code == 0 and "curl" in capsys.readouterr().out
    assert curl_load.count_stream(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[],"usage":'
                           b'{"completion_tokens":3}}\n\ndata: [DONE]\n\n') == 3  # fmt: skip
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    with _Server() as srv:
        res = cc.check(
            srv.url, "m", requests=6, prompt_len=4, max_tokens=4, client_procs=2, say=lambda _: None
        )
    assert [r["client"] for r in res["runs"]] == ["curl", "bench"] and res["short_runs"] == 0
    assert res["runs"][1]["procs"] == 2 and res["ratio"] > 0
