"""The channel between a worker's front end and its engine-core process: msgpack over ZMQ (msgspec).

Both sides import this module; nothing on the channel is pickled.

    front end ──CoreSpec (one JSON line on the core's stdin, first)──▶ engine core
    front end ──Add / Import / Abort / an Op / Shutdown──▶ engine core     (one PUSH socket)
    front end ◀──────────── Batch (one per engine step) ── engine core    (one PUSH socket)

A `Batch` carries every request's new token ids of one step (`Delta`, never text: the front end
detokenizes) and the events since the last batch: a request accepted or refused, an operation's
`Reply` (wire/ops.py), the core's readiness, the prefix cache's changes (`CacheEvents`). Errors travel
as `ErrorInfo` with the HTTP status the front end answers with.
"""

from __future__ import annotations

import msgspec

from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams
from splitserve.wire.http import Timings
from splitserve.wire.kv_events import CacheLoad, KVEvent
from splitserve.wire.kv_handle import KVExport
from splitserve.wire.ops import Op, OpResult
from splitserve.wire.stats import Health

# ---- front end -> core ---------------------------------------------------------------------------


class CoreSpec(msgspec.Struct, forbid_unknown_fields=True):
    """The one JSON line the front end writes on the core's stdin before anything else."""

    config: str  # the WorkerConfig, as its own JSON (config/worker.py: checked field by field)
    threads: int
    log_level: str
    commands: str  # the ZMQ address of the command socket (the front end binds it)
    batches: str  # the ZMQ address of the batch socket


class Add(msgspec.Struct, tag=True, array_like=True):
    """Run a prompt. `params`: checked by the front end, with stop strings left to it (it detokenizes)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    export: bool = False  # prefill role: lease the KV after the first token


class Import(msgspec.Struct, tag=True, array_like=True):
    """Decode role: fetch a prompt's KV from a prefill worker, then continue the request."""

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    kv_export: KVExport
    params: SamplingParams
    first_logprob: TokenLogprob | None = None
    policy: str | None = None
    timeout_s: float | None = None


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


Command = Add | Import | Abort | Shutdown | Op

# ---- core -> front end ---------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, array_like=True):
    status: int  # the HTTP status the worker answers with
    type: str
    message: str
    # a KV transfer's failure: the error class, the request, and a refused peer's layout differences
    kind: str | None = None
    request_id: str | None = None
    mismatches: list[str] | None = None


class Delta(msgspec.Struct, array_like=True):
    """One request's new tokens of one step. `finished`: the engine is done with it (an exported
    prefill is finished with `finish_reason` None and `kv_export` set)."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when asked for
    kv_export: KVExport | None = None  # an exported prefill's
    timings: Timings | None = None  # the first delta: queue_s, prefill_s
    num_cached_tokens: int = 0


class Accepted(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    timings: Timings | None = None  # an import's: kv_wait_s, kv_fetch_s, kv_bytes, kv_backend, kv_error


class Refused(msgspec.Struct, tag=True, array_like=True):
    """A request refused at admission, or failed later (a failed step): its stream ends with this."""

    request_id: str
    error: ErrorInfo


class Reply(msgspec.Struct, tag=True, array_like=True):
    """An operation's answer: its `Result`, or the error it raised."""

    call_id: int
    result: OpResult | None = None
    error: ErrorInfo | None = None


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: Health  # what /health reports (static), kv_address included


class CacheEvents(msgspec.Struct, tag=True, array_like=True):
    """The prefix-cache events of this turn (wire/kv_events.py), in order, and the load they left."""

    events: list[KVEvent]
    load: CacheLoad
    hybrid: bool  # a prefix is usable only up to a state checkpoint


Event = Accepted | Refused | Reply | Ready | CacheEvents


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
