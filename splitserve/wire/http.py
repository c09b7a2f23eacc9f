"""The worker HTTP API's bodies (router <-> worker, and the gate and the runtimes as clients): msgspec
structs, JSON on the wire, the same definition on both sides.

    POST /prefill          PrefillRequest  -> PrefillResponse (its `kv_export` is what /decode needs)
    POST /decode           DecodeRequest   -> NDJSON StreamLines (stream) or one StreamLine
    POST /generate         GenerateRequest -> NDJSON StreamLines (stream) or one StreamLine
    POST /abort            AbortRequest    -> Ok (wire/ops.py)
    POST /kv/release       ReleaseRequest  -> Ok (wire/ops.py)
    POST /kv/connect       PeerRequest     -> PeerChecked (wire/ops.py)
    POST /kv/probe/export  ProbeExportRequest -> ProbeExported (wire/ops.py)
    POST /kv/probe         ProbeRequest    -> ProbeResult (wire/ops.py)
    POST /debug/faults     FaultKnobs (wire/ops.py) -> FaultsSet
    POST /role/prepare     (no body) -> Ok: a role change's drain has begun (wire/role.py)
    POST /role             RoleSwitch (wire/role.py) -> Health (wire/stats.py)
    GET  /stats            WorkerStats (wire/stats.py);  GET /health: Health (wire/stats.py)

/prefill, /decode and /kv/* take an optional `stamp` (wire/role.py): the role and role epoch the caller
picked the worker under; a worker whose own differ answers 409 `stale_role`.
Decoding checks every field (types, ranges, no unknown field; sampling params by `SamplingParams`'s
own checks), and a body that fails is a 400 with msgspec's message naming the field.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams
from splitserve.wire.kv_handle import KVExport
from splitserve.wire.role import RoleStamp

NonEmptyIds = Annotated[list[int], msgspec.Meta(min_length=1)]
Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    pass


class Timings(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a request's time went before its first token: this engine's queue and prefill
    (/prefill, /generate), or the KV import (/decode). Fields not measured are left out."""

    queue_s: float | None = None
    prefill_s: float | None = None
    kv_wait_s: float | None = None  # waiting for room (free blocks, a state slot) on the decode worker
    kv_fetch_s: float | None = None
    kv_bytes: int | None = None
    kv_backend: str | None = None
    kv_error: str | None = None  # the fetch's error class, when the prompt was recomputed instead


def _prompt_input(prompt: str | None, ids: list[int] | None) -> str | list[int]:
    if (prompt is None) == (ids is None):
        raise ValueError("give exactly one of prompt and prompt_token_ids")
    return prompt if prompt is not None else list(ids or [])


class PrefillRequest(_Body):
    prompt_token_ids: NonEmptyIds | None = None
    prompt: str | None = None  # tokenized by the worker (the answer carries the ids)
    sampling_params: SamplingParams = SamplingParams()
    request_id: str | None = None
    # a migrated request: the last `resumed` prompt tokens are the completion's own, streamed by a worker
    # that failed; the engine prefills them with the prompt, max_tokens and min_tokens count them, and
    # the text stream goes on after them
    resumed: NonNegative = 0
    stamp: RoleStamp | None = None  # the role and epoch the caller picked this worker under

    def prompt_input(self) -> str | list[int]:
        return _prompt_input(self.prompt, self.prompt_token_ids)


class PrefillResponse(_Body):
    request_id: str
    first_token: int
    text: str
    # Set when the first token already ends the request (EOS, stop, max_tokens=1): kv_export is then null.
    finish_reason: str | None
    kv_export: KVExport | None  # what /decode needs besides the prompt
    seconds: float
    logprob: TokenLogprob | None = None  # the first token's, when asked for
    prompt_token_ids: list[int] = []
    timings: Timings = Timings()


class DecodeRequest(_Body):
    prompt_token_ids: NonEmptyIds
    first_token: int
    kv_export: KVExport
    first_logprob: TokenLogprob | None = None  # as /prefill returned it
    sampling_params: SamplingParams = SamplingParams()
    request_id: str | None = None  # default: the handle's (the prefill worker's id)
    kv_policy: Literal["fail", "recompute"] | None = None  # default: the worker's --kv-policy
    timeout_s: Positive | None = None  # room + fetch; default --kv-fetch-timeout-s
    stream: bool = True
    resumed: NonNegative = 0  # as PrefillRequest.resumed
    stamp: RoleStamp | None = None  # as PrefillRequest.stamp


class GenerateRequest(_Body):
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    sampling_params: SamplingParams = SamplingParams()
    request_id: str | None = None
    stream: bool = True
    resumed: NonNegative = 0  # as PrefillRequest.resumed

    def prompt_input(self) -> str | list[int]:
        return _prompt_input(self.prompt, self.prompt_token_ids)


class AbortRequest(_Body):
    request_id: str


class ReleaseRequest(_Body):
    """Give back an export's blocks now (e.g. its decode peer was refused and cannot release it)."""

    kv_export: KVExport  # as /prefill returned it
    stamp: RoleStamp | None = None  # as PrefillRequest.stamp


class PeerRequest(_Body):
    address: str  # a prefill worker's kv_address (from its /health)
    timeout_s: Positive = 5.0
    stamp: RoleStamp | None = None


class ProbeExportRequest(_Body):
    num_blocks: Annotated[int, msgspec.Meta(ge=1)] = 64
    stamp: RoleStamp | None = None


class ProbeRequest(_Body):
    kv_export: KVExport  # as /kv/probe/export returned it
    timeout_s: Positive = 30.0
    stamp: RoleStamp | None = None


class StreamLine(msgspec.Struct, omit_defaults=False):
    """One NDJSON line of /generate and /decode: the tokens new since the previous line."""

    request_id: str
    offset: int  # index of token_ids[0] in the completion (a /decode stream starts with the first token)
    token_ids: list[int]
    text: str  # new text
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for
    timings: Timings | None = None  # the first line only: where the time went


LINE_ENCODER = msgspec.json.Encoder()
LINE_DECODER = msgspec.json.Decoder(StreamLine)
