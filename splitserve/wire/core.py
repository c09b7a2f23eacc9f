"""The channel between a worker's front end and its engine-core process: msgpack over ZMQ (msgspec).

Both sides import this module; nothing on the channel is pickled.

    front end ──Add / Import / Abort / Call / Shutdown──▶ engine core      (one PUSH socket)
    front end ◀──────────── Batch (one per engine step) ── engine core    (one PUSH socket)

A `Batch` carries every request's new token ids of one step (`Delta`, never text: the front end
detokenizes) and the events since the last batch: a request accepted or refused, a call's reply, the
core's readiness. Errors travel as `ErrorInfo` with the HTTP status the front end answers with.
"""

from __future__ import annotations

from typing import Any

import msgspec

# ---- front end -> core ---------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True, array_like=True):
    """Run a prompt. `params`: SamplingParams fields (already validated by the front end)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    export: bool = False  # prefill role: lease the KV after the first token


class Import(msgspec.Struct, tag=True, array_like=True):
    """Decode role: fetch a prompt's KV from a prefill worker, then continue the request."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    kv_export: dict[str, Any]  # KVExport.to_dict()
    params: dict[str, Any]
    first_logprob: list[Any] | None = None  # Logprob row (see `Delta.logprobs`)
    policy: str | None = None
    timeout_s: float | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Call(msgspec.Struct, tag=True, array_like=True):
    """A worker operation on the engine (stats, probe, release, faults, check_peer)."""

    call_id: int
    method: str
    args: dict[str, Any] = {}


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


Command = Add | Import | Abort | Call | Shutdown

# ---- core -> front end ---------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, array_like=True):
    status: int  # the HTTP status the worker answers with
    type: str
    message: str
    extra: dict[str, Any] = {}


class Delta(msgspec.Struct, array_like=True):
    """One request's new tokens of one step. `finished`: the engine is done with it (an exported
    prefill is finished with `finish_reason` None and `kv_export` set)."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # one row per token: [token_id, logprob, rank, [[token_id, logprob], ...]]
    logprobs: list[list[Any]] | None = None
    kv_export: dict[str, Any] | None = None  # KVExport.to_dict() of an exported prefill
    metrics: dict[str, float] | None = None  # first delta: queue_s, prefill_s
    num_cached_tokens: int = 0


class Accepted(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    info: dict[str, Any] = {}  # an import's kv_wait_s, kv_fetch_s, kv_bytes, kv_backend, kv_error


class Refused(msgspec.Struct, tag=True, array_like=True):
    """A request refused at admission, or failed later (a failed step): its stream ends with this."""

    request_id: str
    error: ErrorInfo


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: Any = None
    error: ErrorInfo | None = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: dict[str, Any]  # what /health reports (static), kv_address included


Event = Accepted | Refused | Reply | Ready


class Batch(msgspec.Struct, array_like=True):
    deltas: list[Delta] = []
    events: list[Event] = []


class CoreError(Exception):
    """An error the engine core reported, with the HTTP status the worker answers with."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


command_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
batch_encoder = msgspec.msgpack.Encoder()
batch_decoder = msgspec.msgpack.Decoder(Batch)
