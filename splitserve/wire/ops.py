"""The worker operations its engine core answers: one struct per operation (front end -> core, each
with the `call_id` its `Reply` comes back under) and one per answer (a `Result`, in the `Reply`; the
worker's HTTP endpoint answers with the same struct as JSON).

    GetStats                         -> WorkerStats (wire/stats.py)     GET  /stats
    Release(kv_export)               -> Ok                               POST /kv/release     (prefill)
    ProbeExport(num_blocks)          -> ProbeExported(kv_export)         POST /kv/probe/export (prefill)
    Probe(kv_export, timeout_s)      -> ProbeResult                      POST /kv/probe       (decode)
    CheckPeer(address, timeout_s)    -> PeerChecked                      POST /kv/connect     (decode)
    SetFaults(knobs)                 -> FaultsSet                        POST /debug/faults   (tests)
"""

from __future__ import annotations

import msgspec

from splitserve.wire.kv_handle import KVExport
from splitserve.wire.result import Result
from splitserve.wire.stats import WorkerStats
from splitserve.wire.transport_info import FaultKnobs  # also a transport description's part


class KVLayoutInfo(msgspec.Struct):
    """A peer's KV layout as its handshake told it (transport/layout.py's `KVLayout`)."""

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    state_shapes: list[tuple[str, list[int], str]]  # (name, shape, dtype) per recurrent state tensor
    protocol_version: int


# ---- front end -> core ---------------------------------------------------------------------------


class _Op(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class GetStats(_Op):
    pass


class Release(_Op):
    kv_export: KVExport


class ProbeExport(_Op):
    num_blocks: int


class Probe(_Op):
    kv_export: KVExport
    timeout_s: float


class CheckPeer(_Op):
    address: str
    timeout_s: float


class SetFaults(_Op):
    knobs: FaultKnobs


Op = GetStats | Release | ProbeExport | Probe | CheckPeer | SetFaults

# ---- core -> front end ---------------------------------------------------------------------------


class Ok(Result):
    ok: bool = True


class ProbeExported(Result):
    kv_export: KVExport  # N free blocks of the prefill worker, leased as an export


class ProbeResult(Result):
    bytes: int
    seconds: float
    gbps: float
    blocks: int
    backend: str
    peer: str


class PeerChecked(Result):
    ok: bool
    address: str
    peer_layout: KVLayoutInfo | None


class FaultsSet(Result):
    faults: FaultKnobs | None  # None: faults off


OpResult = Ok | ProbeExported | ProbeResult | PeerChecked | FaultsSet | WorkerStats

__all__ = [
    "CheckPeer",
    "FaultKnobs",
    "FaultsSet",
    "GetStats",
    "KVLayoutInfo",
    "Ok",
    "Op",
    "OpResult",
    "PeerChecked",
    "Probe",
    "ProbeExport",
    "ProbeExported",
    "ProbeResult",
    "Release",
    "SetFaults",
]
