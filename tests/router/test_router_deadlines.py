"""The router's stage deadlines hold against a worker that takes the request and never answers (a worker
answers its status and headers only with its first line): the wait for the answer is part of the
stage. Before, only the first line after the headers was timed, and a /decode whose worker never
answered waited for the whole request's deadline (600 s; CI saw a client time out at 120 s after a
prefill worker's engine core was killed).

The stalled worker is a fake, named as such: a plain socket server that reads the request and says
nothing. The real worker that did this (its engine core lost an import's outcome) is fixed in
core/loop.py and tested in test_core_imports.py; the router must not depend on that."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.config.manifest_sections import RouterSection
from splitserve.router.dispatch import Dispatcher
from splitserve.router.openai_protocol import APIError
from splitserve.sampling.params import SamplingParams


class _Endpoint:
    def __init__(self, name: str, role: str, url: str) -> None:
        self.name, self.role, self.url, self.inflight = name, role, url, 0

    @property
    def ready(self) -> bool:
        return True


class _Workers:
    def __init__(self, *endpoints: _Endpoint) -> None:
        self.endpoints = endpoints

    def ready(self, role: str) -> list[_Endpoint]:
        return [e for e in self.endpoints if e.role == role]


PREFILL_ANSWER = (
    b'{"request_id":"r","first_token":7,"text":"x","finish_reason":null,"seconds":0.01,"kv_export":'
    b'{"handle":{"backend":"shm","address":"unix:/nowhere","request_id":"r","lease_id":"l",'
    b'"block_ids":[0],"num_tokens":4,"layout_fingerprint":"f","lease_expires_at":0.0}}}'
)


async def _fake_worker(answers: dict[str, bytes | None]) -> tuple[asyncio.Server, str, list[str]]:
    """A fake worker: answers each path in `answers` with that JSON body at once, or (None) never."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")), 0,
                )  # fmt: skip
                await reader.readexactly(length)
                seen.append(path)
                body = answers.get(path)
                if body is None:  # taken, never answered
                    await asyncio.sleep(3600)
                    return
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


async def _run(dispatcher: Dispatcher) -> tuple[APIError, float]:
    t0 = time.perf_counter()
    with pytest.raises(APIError) as info:
        async with asyncio.timeout(10):  # the old code waited for the request's 600 s: fail in seconds
            async for _ in dispatcher.run(0, [1, 2, 3, 4], SamplingParams(max_tokens=8), "r"):
                pass
    return info.value, time.perf_counter() - t0


def _router(**timeouts: float) -> RouterSection:
    return RouterSection.model_validate({"timeouts": {"request_s": 600, **timeouts}})


async def test_a_decode_worker_that_never_answers_is_a_504_at_the_transfer_deadline() -> None:
    server, url, seen = await _fake_worker(
        {"/prefill": PREFILL_ANSWER, "/decode": None, "/kv/release": b"{}"}
    )
    workers = _Workers(_Endpoint("prefill-0", "prefill", url), _Endpoint("decode-0", "decode", url))
    dispatcher = Dispatcher(workers, _router(kv_transfer_s=0.4, connect_s=0.2), "disaggregated")
    try:
        err, took = await _run(dispatcher)
        assert err.status == 504 and err.code == "worker_timeout", err
        assert "kv transfer stage" in err.message and "decode-0" in err.message
        assert 0.5 < took < 3.0, took  # kv_transfer_s + connect_s, not the request's 600 s
        deadline = time.monotonic() + 5  # the release and the abort go out in the background
        while not {"/kv/release", "/abort"} <= set(seen) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert seen[:2] == ["/prefill", "/decode"] and "/kv/release" in seen and "/abort" in seen, seen
    finally:
        await dispatcher.close()
        server.close()


async def test_a_first_token_sent_ahead_gives_the_kv_back_when_the_decode_worker_never_answers() -> None:
    """`router.first_token: prefill`, streamed: the prefill worker's token is the choice's first piece
    before the decode worker has answered anything; the decode stage's deadline then ends the choice,
    and the export the decode worker never took is released."""
    server, url, seen = await _fake_worker(
        {"/prefill": PREFILL_ANSWER, "/decode": None, "/kv/release": b"{}"}
    )
    workers = _Workers(_Endpoint("prefill-0", "prefill", url), _Endpoint("decode-0", "decode", url))
    router = RouterSection.model_validate(
        {"first_token": "prefill", "timeouts": {"request_s": 600, "kv_transfer_s": 0.4, "connect_s": 0.2}}
    )
    dispatcher = Dispatcher(workers, router, "disaggregated")
    pieces = []
    try:
        with pytest.raises(APIError) as info:
            async with asyncio.timeout(10):
                params = SamplingParams(max_tokens=8)
                async for p in dispatcher.run(0, [1, 2, 3, 4], params, "r", stream=True):
                    pieces.append(p)
        assert [(p.token_ids, p.text, p.finished) for p in pieces] == [([7], "x", False)]
        assert pieces[0].metrics["kv_backend"] == "shm" and "kv_fetch_s" not in pieces[0].metrics
        assert info.value.status == 504 and info.value.code == "worker_timeout", info.value
        deadline = time.monotonic() + 5
        while "/kv/release" not in seen and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert seen[:2] == ["/prefill", "/decode"] and "/kv/release" in seen, seen
    finally:
        await dispatcher.close()
        server.close()


async def _released(seen: list[str], *paths: str) -> None:
    """Wait (5 s at most) until the fake worker has seen each of `paths`: they go out in the background."""
    deadline = time.monotonic() + 5
    while not set(paths) <= set(seen) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


DECODE_NEVER_ANSWERS: dict[str, bytes | None] = {
    "/prefill": PREFILL_ANSWER,
    "/decode": None,
    "/kv/release": b"{}",
}


def _early_pair(url: str) -> tuple[_Workers, Dispatcher]:
    workers = _Workers(_Endpoint("prefill-0", "prefill", url), _Endpoint("decode-0", "decode", url))
    router = RouterSection.model_validate(
        {"first_token": "prefill", "timeouts": {"request_s": 600, "kv_transfer_s": 0.4, "connect_s": 0.2}}
    )
    return workers, Dispatcher(workers, router, "disaggregated")


async def test_a_paced_first_token_holds_the_decode_request_and_a_cancel_there_gives_the_kv_back() -> None:
    """Paced (the run's choice task queues the pieces for the task that writes them): the decode request
    waits until the first piece is written out (`taken`). A client that goes away meanwhile cancels that
    wait: the cancellation comes out as itself (it is the caller's, not turned into an error), no decode
    request is made, and the export is released."""
    server, url, seen = await _fake_worker(DECODE_NEVER_ANSWERS)
    workers, dispatcher = _early_pair(url)
    pieces = dispatcher.run(0, [1, 2, 3, 4], SamplingParams(max_tokens=8), "r", stream=True, paced=True)
    try:
        first = await anext(pieces)
        assert first.token_ids == [7] and first.taken is not None and not first.taken.is_set()
        waiting = asyncio.ensure_future(anext(pieces))
        for _ in range(20):  # the loop goes round; only `taken` lets the decode request go
            await asyncio.sleep(0)
        assert not waiting.done() and workers.endpoints[1].inflight == 0 and seen == ["/prefill"]
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await _released(seen, "/kv/release")
        assert seen == ["/prefill", "/kv/release"], seen
        assert [e.inflight for e in workers.endpoints] == [0, 0]
    finally:
        await dispatcher.close()
        server.close()


async def test_a_paced_first_token_once_written_meets_the_decode_deadline() -> None:
    """Paced, the first piece written out (`taken` set): the decode request goes, and a decode worker
    that never answers is the kv transfer stage's 504; the export it never took is released."""
    server, url, seen = await _fake_worker(DECODE_NEVER_ANSWERS)
    workers, dispatcher = _early_pair(url)
    pieces = dispatcher.run(0, [1, 2, 3, 4], SamplingParams(max_tokens=8), "r", stream=True, paced=True)
    try:
        first = await anext(pieces)
        assert first.taken is not None
        first.taken.set()
        with pytest.raises(APIError) as info:
            async with asyncio.timeout(10):
                await anext(pieces)
        assert info.value.status == 504 and info.value.code == "worker_timeout", info.value
        await _released(seen, "/kv/release", "/abort")
        assert seen[:2] == ["/prefill", "/decode"] and {"/kv/release", "/abort"} <= set(seen), seen
        assert [e.inflight for e in workers.endpoints] == [0, 0]
    finally:
        await dispatcher.close()
        server.close()


async def test_a_colocated_worker_that_never_answers_is_a_504_at_the_prefill_deadline() -> None:
    server, url, _ = await _fake_worker({"/generate": None, "/abort": b"{}"})
    dispatcher = Dispatcher(
        _Workers(_Endpoint("colocated-0", "colocated", url)), _router(prefill_s=0.5), "colocated"
    )
    try:
        err, took = await _run(dispatcher)
        assert err.status == 504 and "prefill stage" in err.message, err
        assert 0.4 < took < 3.0, took
    finally:
        await dispatcher.close()
        server.close()
