"""The router's early first token (`router.first_token: prefill`, streamed): how long the piece waits in the
run's queue before the task that writes it gets it, paced (the decode request is made once it is written
out) against unpaced (the baseline: the choice's task makes the decode request in the same turn of the
loop, before the writer runs), in one run, requests alternating.

    python bench/first_token_pacing.py --requests 400 --prompt-len 1088

The router's `Dispatcher` runs in this process, each choice relayed through a queue to a writer task as
`Run` does; the workers are a fake in a child process (the prefill answers at once with a KV handle, the
decode streams `--tokens` tokens), so the figures are the router's own loop, not a model's.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PREFILL = (
    b'{"request_id":"r","first_token":7,"text":"x","finish_reason":null,"seconds":0.01,"kv_export":'
    b'{"handle":{"backend":"shm","address":"unix:/nowhere","request_id":"r","lease_id":"l",'
    b'"block_ids":[0],"num_tokens":4,"layout_fingerprint":"f","lease_expires_at":0.0}}}'
)


def _decode_body(tokens: int) -> bytes:
    lines = [b'{"request_id":"r","offset":0,"token_ids":[7],"text":"x","finished":false}']
    for i in range(1, tokens):
        end = b'true,"finish_reason":"length"' if i == tokens - 1 else b"false"
        line = b'{"request_id":"r","offset":%d,"token_ids":[%d],"text":"y","finished":%s}' % (i, i, end)
        lines.append(line)
    return b"\n".join(lines) + b"\n"


def _fake_workers(port_out: Connection, tokens: int) -> None:
    """Keep-alive HTTP/1.1: /prefill -> PREFILL, /decode -> the whole stream, anything else -> {}."""
    answers = {"/prefill": PREFILL, "/decode": _decode_body(tokens)}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                n = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                          if h.lower().startswith(b"content-length:")), 0)  # fmt: skip
                await reader.readexactly(n)
                body = answers.get(path, b"{}")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_out.send(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(main())


class _Endpoint:
    def __init__(self, name: str, role: str, url: str) -> None:
        self.name, self.role, self.url, self.inflight = name, role, url, 0


class _Workers:
    def __init__(self, url: str) -> None:
        self.endpoints = [_Endpoint("prefill-0", "prefill", url), _Endpoint("decode-0", "decode", url)]

    def ready(self, role: str) -> list[_Endpoint]:
        return [e for e in self.endpoints if e.role == role]


async def one(dispatcher, paced: bool, ids: list[int]) -> tuple[float, float]:  # noqa: ANN001
    """One streamed choice relayed as `Run` does -> (queued -> the writer has the first piece, the whole
    choice), seconds."""
    from splitserve.sampling.params import SamplingParams

    queue: asyncio.Queue = asyncio.Queue()
    queued: list[float] = []

    async def relay() -> None:
        async for p in dispatcher.run(0, ids, SamplingParams(max_tokens=8), "r", None, True, paced):
            queued.append(time.perf_counter())
            queue.put_nowait(p)
        queue.put_nowait(None)

    t0 = time.perf_counter()
    task = asyncio.create_task(relay())
    last = await queue.get()
    wait = time.perf_counter() - queued[0]
    if last.taken is not None:
        last.taken.set()  # written out, the writer asks for the next piece: as `Run.next` does
    while (p := await queue.get()) is not None:
        last = p
    await task
    assert last is not None and last.finished
    return wait, time.perf_counter() - t0


async def main(args: argparse.Namespace, url: str) -> None:
    from splitserve.config.manifest_sections import RouterSection
    from splitserve.router.dispatch import Dispatcher

    router = RouterSection.model_validate({"first_token": "prefill"})
    dispatcher = Dispatcher(_Workers(url), router, "disaggregated")
    ids = list(range(1, args.prompt_len + 1))  # the decode request carries them
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        for i in range(args.warmup + 2 * args.requests):
            paced = i % 2 == 0
            r = await one(dispatcher, paced, ids)
            if i >= args.warmup:
                got[paced].append(r)
    finally:
        await dispatcher.close()
    med = {k: [1e6 * statistics.median(x[j] for x in v) for j in (0, 1)] for k, v in got.items()}
    (pw, pt), (bw, bt) = med[True], med[False]
    print(f"early first token, queued -> its writer has it (median of {args.requests}): paced {pw:.0f} us, "
          f"unpaced (baseline) {bw:.0f} us = {bw / pw:.1f}x; the whole {args.tokens}-token choice: "
          f"paced {pt:.0f} us, unpaced {bt:.0f} us = {bt / pt:.2f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400, help="of each kind")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1088, help="the prompt's ids, in the decode request")
    a = ap.parse_args()
    recv, send = mp.Pipe(duplex=False)
    proc = mp.get_context("spawn").Process(target=_fake_workers, args=(send, a.tokens), daemon=True)
    proc.start()
    try:
        asyncio.run(main(a, f"http://127.0.0.1:{recv.recv()}"))
    finally:
        proc.terminate()
