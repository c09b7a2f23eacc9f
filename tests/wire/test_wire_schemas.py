"""The wire's bodies round-trip through both encodings (JSON over HTTP, msgpack to the engine core), and
decoding refuses what construction refuses: a malformed KV handle, bad sampling params, unknown fields."""

from __future__ import annotations

import msgspec
import pytest

from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import GrammarSpec, SamplingParams
from splitserve.wire import core, ops
from splitserve.wire.http import DecodeRequest, GenerateRequest, PrefillResponse, StreamLine, Timings
from splitserve.wire.kv_handle import KVExport, KVHandle

HANDLE = KVHandle(
    backend="tcp", address="127.0.0.1:5000", request_id="pf-1", lease_id="L1", block_ids=(3, 4, 9),
    num_tokens=40, layout_fingerprint="abc", lease_expires_at=1.5e9, checksum="crc32:00ff00ff",
)  # fmt: skip
EXPORT = KVExport(HANDLE, generator_state=b"\x00\x01seed")
LOGPROB = TokenLogprob(7, -0.25, 1, ((7, -0.25), (9, -1.5)))


def test_the_export_round_trips_through_json_and_msgpack() -> None:
    assert msgspec.json.decode(msgspec.json.encode(EXPORT), type=KVExport) == EXPORT
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(EXPORT), type=KVExport) == EXPORT
    # the JSON form: the generator state as base64, the block ids as a list
    raw = msgspec.json.decode(msgspec.json.encode(EXPORT))
    assert raw["generator_state"] == "AAFzZWVk" and raw["handle"]["block_ids"] == [3, 4, 9]


def test_a_prefill_answer_carries_the_export_to_the_decode_core() -> None:
    """/prefill's answer -> the router -> /decode's body -> the core's Import: one type end to end."""
    timings = Timings(queue_s=0.01, prefill_s=0.2)
    answer = PrefillResponse(request_id="pf-1", first_token=7, text="x", finish_reason=None, kv_export=EXPORT,
                             seconds=0.1, logprob=LOGPROB, timings=timings)  # fmt: skip
    pre = msgspec.json.decode(msgspec.json.encode(answer), type=PrefillResponse)
    assert pre == answer
    params = SamplingParams(temperature=0, seed=3)
    body = DecodeRequest(prompt_token_ids=[1, 2], first_token=pre.first_token, kv_export=pre.kv_export,
                         first_logprob=pre.logprob, sampling_params=params)  # fmt: skip
    got = msgspec.json.decode(msgspec.json.encode(body), type=DecodeRequest)
    assert got == body
    cmd = core.Import("pf-1", got.prompt_token_ids, got.first_token, got.kv_export, got.sampling_params,
                      got.first_logprob)  # fmt: skip
    assert core.command_decoder.decode(core.command_encoder.encode(cmd)) == cmd


def test_stream_lines_and_replies_round_trip() -> None:
    line = StreamLine(
        "r", 0, [7], "x", False, logprobs=[LOGPROB], timings=Timings(kv_fetch_s=0.5, kv_bytes=9)
    )
    assert msgspec.json.decode(msgspec.json.encode(line), type=StreamLine) == line
    assert b"kv_error" not in msgspec.json.encode(line.timings)  # fields not measured are left out
    batch = core.Batch(
        [core.Delta("r", [7], True, "stop", 7, [LOGPROB], EXPORT, Timings(queue_s=0.0))],
        [core.Reply(3, ops.ProbeResult(1, 0.5, 2.0, 1, "tcp", "peer")), core.Reply(4, ops.Ok())],
    )
    assert core.batch_decoder.decode(core.batch_encoder.encode(batch)) == batch


@pytest.mark.parametrize(
    "bad",
    [
        {"block_ids": "nope"},
        {"surprise": 1},
        {"lease_id": None},
        {"num_tokens": -1},
    ],
)
def test_a_malformed_handle_is_refused_at_the_edge(bad: dict) -> None:
    raw = msgspec.json.decode(msgspec.json.encode(EXPORT))
    raw["handle"].update(bad)
    body = {"prompt_token_ids": [1], "first_token": 2, "kv_export": raw}
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(body), type=DecodeRequest)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"top_p": 0}, "top_p must be in"),
        ({"temperature": "hot"}, "Expected `float`"),
        ({"grammar": {"kind": "xml", "spec": "x"}}, "grammar kind"),
        ({"best_of": 2}, "unknown field `best_of`"),
    ],
)
def test_sampling_params_are_checked_when_decoded(params: dict, match: str) -> None:
    body = msgspec.json.encode({"prompt_token_ids": [1], "sampling_params": params})
    with pytest.raises(msgspec.ValidationError, match=match):
        msgspec.json.decode(body, type=GenerateRequest)


def test_sampling_params_decode_to_the_one_type() -> None:
    raw = (
        b'{"temperature": 0, "stop": "END", "stop_token_ids": [2], "grammar": {"kind": "regex", "spec": "a"}}'
    )
    p = msgspec.json.decode(raw, type=SamplingParams)
    assert p == SamplingParams(
        temperature=0.0, stop=("END",), stop_token_ids=(2,), grammar=GrammarSpec("regex", "a")
    )
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
