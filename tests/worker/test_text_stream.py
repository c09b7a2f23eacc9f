"""The worker front end's text (worker/text_stream.py) equals the engine's own: the same tokens cut by
the same stop strings to the same text and finish reason as `LLM` with stop strings in the engine,
whatever the deltas' chunking, and streamed text is never taken back."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.wire.core import Delta
from splitserve.worker.text_stream import TextStream


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random:tiny", max_model_len=256, kv_cache_bytes=8 << 20, progress=False)


PROMPT = [5, 77, 123, 9, 300, 41, 18, 260]


def _feed(llm: LLM, tokens: list[int], reason: str, params: SamplingParams, chunk: int) -> TextStream:
    text = TextStream("r", params, llm.tokenizer)
    streamed = ""
    for i in range(0, len(tokens), chunk):
        part = tokens[i : i + chunk]
        last = i + chunk >= len(tokens)
        line = text.feed([Delta("r", part, last, reason if last else None)])
        if line is not None:
            streamed += line.text
        if text.finished:
            break
    assert streamed == text.text  # what was streamed is exactly the final text
    return text


@pytest.mark.parametrize("chunk", [1, 3, 64])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_as_the_engine_cuts_them(llm: LLM, chunk: int, include: bool) -> None:
    free = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    tokens, full = free[0].outputs[0].token_ids, free[0].outputs[0].text
    assert len(full) > 20
    for stop in (full[12:15], full[-3:], full[:2], "zzz-not-there"):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)  # fmt: skip
        ref = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        got = _feed(llm, tokens, "length", params, chunk)
        assert got.text == ref.text
        assert (got.finish_reason, got.stop_reason) == (ref.finish_reason, ref.stop_reason)
        assert got.seen == len(ref.token_ids)


def test_min_tokens_defers_stop_strings(llm: LLM) -> None:
    free = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False
    )
    tokens, full = free[0].outputs[0].token_ids, free[0].outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[full[:2]], min_tokens=10)
    ref = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    got = _feed(llm, tokens, "length", params, 4)
    assert (got.text, got.finish_reason, got.seen) == (ref.text, ref.finish_reason, len(ref.token_ids))


def test_engine_finish_reasons_pass_through(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    text = TextStream("r", params, llm.tokenizer)
    line = text.feed([Delta("r", [5, 6], False), Delta("r", [7], True, "stop", 7)])
    assert line is not None and line.finished and line.token_ids == [5, 6, 7]
    assert (text.finish_reason, text.stop_reason) == ("stop", 7)
    assert not text.stopped_early


@pytest.mark.parametrize("cut", [1, 7, 13, 25])
def test_a_migrated_stream_reads_as_one(llm: LLM, cut: int) -> None:
    """The first `cut` tokens through one worker's text stream, the rest through another's that resumed
    after them (a migrated request): together the same text, stop and finish as one stream."""
    free = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False
    )
    tokens, full = free[0].outputs[0].token_ids, free[0].outputs[0].text
    for stop in (full[12:15], full[-3:], "zzz-not-there"):
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
        ref = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        if len(ref.token_ids) <= cut:
            continue  # it ended before the fault
        before = TextStream("r", params, llm.tokenizer)
        streamed = "".join(line.text for t in tokens[:cut] if (line := before.feed([Delta("r", [t], False)])))
        after = TextStream("r", params, llm.tokenizer)
        after.resume(tokens[:cut])
        for i, t in enumerate(tokens[cut:], cut):
            line = after.feed(
                [Delta("r", [t], i == len(tokens) - 1, "length" if i == len(tokens) - 1 else None)]
            )
            streamed += line.text if line is not None else ""
            if after.finished:
                break
        assert (streamed, after.finish_reason, after.seen) == (
            ref.text,
            ref.finish_reason,
            len(ref.token_ids),
        )
