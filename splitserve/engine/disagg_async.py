"""A KV import under `AsyncLLM`: the decode side of disaggregation, without stalling the batch.

Life of one import (`AsyncKVImporter.generate(spec)`), threads named:
  1. engine thread (`run_in_engine`): `KVConnector.prepare` validates the spec, builds the request and
     tries to reserve blocks (+ a state slot). While there is no room, retry every `poll_s` until the
     spec's deadline; running requests keep stepping meanwhile.
  2. a fetch thread (this importer's pool): `KVConnector.fetch` pulls the KV into the reserved blocks,
     bounded by what is left of the deadline; the engine thread keeps stepping other requests, which
     never touch those blocks.
  3. engine thread (`AsyncLLM.stream`'s submit): `KVConnector.complete` joins the request to the batch,
     or follows the policy: "fail" raises `KVTransferFailed` here, before any output; "recompute"
     queues it to recompute the prompt. Then its outputs stream like any other request's.
If the caller goes away during 1 or 2, the ticket is discarded on the engine thread once its fetch
(if any) has stopped writing into the blocks; during 3, the stream's own abort frees everything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor

from splitserve.engine.async_engine import AsyncLLM
from splitserve.engine.disagg import ImportSpec, ImportTicket, KVConnector
from splitserve.engine.request import RequestOutput


class AsyncKVImporter:
    def __init__(
        self, llm: AsyncLLM, connector: KVConnector, max_fetches: int = 16, poll_s: float = 0.01
    ) -> None:
        self.llm = llm
        self.connector = connector
        self.poll_s = poll_s
        self._pool = ThreadPoolExecutor(max_workers=max_fetches, thread_name_prefix="kv-fetch")

    async def generate(self, spec: ImportSpec, info: dict | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of a request whose prompt KV is fetched per `spec` (see the module doc).
        Raises ValueError (bad spec) or KVTransferFailed (policy "fail") before the first output.
        `info`, if given, gets the import's timings before the first output: kv_wait_s (room),
        kv_fetch_s, kv_bytes, kv_backend, kv_error (the failure a "recompute" recovered from)."""
        conn = self.connector
        start = time.perf_counter()
        ticket = await self.llm.run_in_engine(lambda: conn.prepare(spec))
        fetching: asyncio.Future | None = None
        try:
            while ticket.waits_for_room:
                await asyncio.sleep(self.poll_s)
                await self.llm.run_in_engine(lambda: conn.try_reserve(ticket))
            reserved = time.perf_counter()
            fetching = asyncio.get_running_loop().run_in_executor(self._pool, conn.fetch, ticket)
            await asyncio.shield(fetching)
        except BaseException:  # cancelled (the client went away) or the engine died
            self._discard_when_safe(ticket, fetching)
            raise
        if info is not None:
            info.update(
                kv_wait_s=reserved - start,
                kv_fetch_s=time.perf_counter() - reserved,
                kv_bytes=ticket.fetched_bytes,
                kv_backend=conn.backend_name,
                kv_error=None if ticket.error is None else type(ticket.error).__name__,
            )
        async for out in self.llm.stream(spec.request_id, lambda: conn.complete(ticket)):
            yield out

    def _discard_when_safe(self, ticket: ImportTicket, fetching: asyncio.Future | None) -> None:
        def discard(_: Future | asyncio.Future | None = None) -> None:
            self.llm.call_soon_in_engine(lambda: self.connector.discard(ticket))

        if fetching is None or fetching.done():
            discard()
        else:
            fetching.add_done_callback(discard)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
