"""The worker service's HTTP bodies (pydantic at the edge), and sampling params from JSON.

A KV handle travels as `KVExportBody` (`{"handle": KVHandleBody, "generator_state": base64 | null}`, the
wire form of `splitserve.engine.kv_transfer_types.KVExport`): plain JSON, typed on both sides, never pickled.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams
from splitserve.wire.kv_handle import KVHandle

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)} - {"extra"}


def sampling_params(data: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a JSON object of its fields (vLLM's names); unknown keys are an error."""
    unknown = set(data) - _PARAM_FIELDS
    if unknown:
        raise ValueError(f"unknown sampling params {sorted(unknown)}; known: {sorted(_PARAM_FIELDS)}")
    try:
        return SamplingParams(**data)
    except TypeError as exc:
        raise ValueError(f"bad sampling params: {exc}") from exc


def logprob_to_dict(lp: TokenLogprob) -> dict[str, Any]:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}


def logprob_from_dict(data: dict[str, Any]) -> TokenLogprob:
    try:
        top = tuple((int(t), float(v)) for t, v in data.get("top", []))
        return TokenLogprob(int(data["token_id"]), float(data["logprob"]), int(data["rank"]), top)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed logprob {data!r}: {exc}") from exc


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVHandleBody(_Body):
    """The wire form of `kv.KVHandle`, field for field (a test keeps the two in step)."""

    backend: str
    address: str
    request_id: str
    lease_id: str
    block_ids: list[int]
    num_tokens: int = Field(ge=0)
    layout_fingerprint: str
    lease_expires_at: float
    checksum: str | None = None
    lease_slot: int | None = None
    state_row: int | None = None

    @classmethod
    def of(cls, handle: KVHandle) -> KVHandleBody:
        return cls.model_validate(handle.to_dict())

    def to_handle(self) -> KVHandle:
        return KVHandle.from_dict(self.model_dump())


class KVExportBody(_Body):
    """What /prefill hands on and /decode, /kv/release, /kv/probe take: the handle and the sampler state."""

    handle: KVHandleBody
    generator_state: str | None = None  # base64 of torch.Generator.get_state() (seeded requests)


class PrefillRequest(_Body):
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)
    prompt: str | None = None  # tokenized by the worker (the answer carries the ids)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None
    # a migrated request: the last `resumed` prompt tokens are the completion's own, streamed by a worker
    # that failed; the engine prefills them with the prompt, max_tokens and min_tokens count them, and
    # the text stream goes on after them
    resumed: int = Field(default=0, ge=0)

    def prompt_input(self) -> str | list[int]:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        return self.prompt if self.prompt is not None else list(self.prompt_token_ids or [])


class PrefillResponse(_Body):
    request_id: str
    first_token: int
    text: str
    # Set when the first token already ends the request (EOS, stop, max_tokens=1): kv_export is then null.
    finish_reason: str | None
    kv_export: KVExportBody | None  # what /decode needs besides the prompt
    seconds: float
    logprob: dict[str, Any] | None = None  # the first token's (logprob_to_dict), when asked for
    prompt_token_ids: list[int] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)  # queue_s, prefill_s (request_timings)


class DecodeRequest(_Body):
    prompt_token_ids: list[int] = Field(min_length=1)
    first_token: int
    first_logprob: dict[str, Any] | None = None  # as /prefill returned it
    kv_export: KVExportBody
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None  # default: the handle's (the prefill worker's id)
    kv_policy: Literal["fail", "recompute"] | None = None  # default: the worker's --kv-policy
    timeout_s: float | None = Field(default=None, gt=0)  # room + fetch; default --kv-fetch-timeout-s
    stream: bool = True
    resumed: int = Field(default=0, ge=0)  # as PrefillRequest.resumed


class GenerateRequest(_Body):
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = None
    stream: bool = True
    resumed: int = Field(default=0, ge=0)  # as PrefillRequest.resumed

    def prompt_input(self) -> str | list[int]:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        return self.prompt if self.prompt is not None else list(self.prompt_token_ids or [])


class AbortRequest(_Body):
    request_id: str


class ReleaseRequest(_Body):
    """Give back an export's blocks now (e.g. its decode peer was refused and cannot release it)."""

    kv_export: KVExportBody  # as /prefill returned it


class PeerRequest(_Body):
    address: str  # a prefill worker's kv_address (from its /health)
    timeout_s: float = Field(default=5.0, gt=0)


class ProbeExportRequest(_Body):
    num_blocks: int = Field(default=64, ge=1)


class ProbeExportResponse(_Body):
    kv_export: KVExportBody  # N free blocks of the prefill worker, leased as an export


class ProbeRequest(_Body):
    kv_export: KVExportBody  # as /kv/probe/export returned it
    timeout_s: float = Field(default=30.0, gt=0)


class FaultsRequest(_Body):
    """Test-only (--enable-fault-injection): how this exporter misbehaves on each fetch it serves."""

    drop: float = 0.0
    delay: float = 0.0
    corrupt: float = 0.0
    kill: float = 0.0
    delay_s: float = 5.0
    seed: int = 0


class StreamLine(msgspec.Struct, omit_defaults=False):
    """One NDJSON line of /generate and /decode: the tokens new since the previous line. Encoded by the
    worker and decoded by the router with msgspec (`LINE_DECODER`): the one definition both sides use."""

    request_id: str
    offset: int  # index of token_ids[0] in the completion (a /decode stream starts with the first token)
    token_ids: list[int]
    text: str  # new text
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None  # one per token of token_ids, when asked for
    # The first line only: where the time went (queue_s, prefill_s on /generate; kv_* on /decode).
    metrics: dict[str, Any] | None = None


LINE_ENCODER = msgspec.json.Encoder()
LINE_DECODER = msgspec.json.Decoder(StreamLine)
