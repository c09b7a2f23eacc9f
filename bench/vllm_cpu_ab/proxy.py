"""vLLM P/D for the A/B (not splitserve): each completion is prefilled on P with max_tokens 1 (its KV saved
by ExampleConnector), then sent to D and streamed back. Usage: proxy.py PREFILL_URL DECODE_URL PORT"""

from __future__ import annotations

import sys

import aiohttp
from aiohttp import web

PREFILL, DECODE = sys.argv[1], sys.argv[2]


async def completions(req: web.Request) -> web.StreamResponse:
    body = await req.json()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        pre = dict(body, max_tokens=1, stream=False)
        pre.pop("stream_options", None)
        async with s.post(PREFILL + "/v1/completions", json=pre) as r:
            await r.read()
        resp = web.StreamResponse()
        await resp.prepare(req)
        async with s.post(DECODE + "/v1/completions", json=body) as r:
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
        await resp.write_eof()
        return resp


async def models(req: web.Request) -> web.Response:
    async with aiohttp.ClientSession() as s, s.get(DECODE + "/v1/models") as r:
        return web.json_response(await r.json())


app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/v1/models", models)
web.run_app(app, port=int(sys.argv[3]), print=None)
