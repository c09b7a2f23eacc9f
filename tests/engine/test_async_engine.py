"""AsyncLLM: concurrent streams equal the offline results; cancellation and errors free everything."""

from __future__ import annotations

import asyncio

import pytest

from splitserve import SamplingParams
from splitserve.engine.async_engine import AsyncLLM

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture
def async_llm(make_smol_llm):
    llm = make_smol_llm()
    engine = AsyncLLM(llm.engine)
    yield engine
    asyncio.run(engine.shutdown())


async def _collect(engine: AsyncLLM, prompt, params, rid=None):
    outs = [o async for o in engine.generate(prompt, params, request_id=rid)]
    return outs


def test_concurrent_streams_equal_offline(async_llm, make_smol_llm, chat_prompt_ids):
    offline = make_smol_llm().generate(
        [{"prompt_token_ids": p} for p in chat_prompt_ids[:4]], GREEDY, use_tqdm=False
    )

    async def main():
        return await asyncio.gather(*(_collect(async_llm, p, GREEDY) for p in chat_prompt_ids[:4]))

    streams = asyncio.run(main())
    for outs, ref in zip(streams, offline, strict=True):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # text only grows


def test_cancel_mid_stream_frees_blocks(async_llm, chat_prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        agen = async_llm.generate(chat_prompt_ids[0], params, request_id="cancel-me")
        seen = 0
        async for _ in agen:
            seen += 1
            if seen == 3:
                break
        await agen.aclose()
        for _ in range(100):  # the abort is applied by the engine thread between steps
            if not async_llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    pool = async_llm.engine.pool
    assert not async_llm.engine.has_unfinished_requests()
    assert pool.num_free == pool.num_blocks


def test_validation_error_is_raised_to_caller(async_llm):
    async def main():
        await _collect(async_llm, list(range(5000)), GREEDY)

    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(main())
    assert not async_llm.engine.has_unfinished_requests()
