"""A KV transport's self-description (`KVTransport.describe()`), as a worker's GET /stats carries it in
`kv_transfer.transport`: the backend running and the one asked for, counters, recent rates, leases, the
host's fabric, and what the backend's payload mover adds. The router, the runtimes and the gate read a
few of its fields (the backend asked for, fallbacks and their reasons, fetched bytes, active leases, the
fabric); the rest is for an operator reading why a transfer is slow.

Parts a backend lacks are left out of the JSON (`omit_defaults`), so each backend's description keeps
the shape it always had: a shm transport has `shm_mode`, a GPU one `device`, `copies` and its link's
part under its backend's name (`cuda_ipc`, `nccl`), a NIXL one `nixl`, a tensor-parallel one
`tensor_parallel`, and test hooks their knobs.
"""

from __future__ import annotations

import msgspec


class FaultKnobs(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How an exporter misbehaves on each fetch it serves (test-only, --enable-fault-injection)."""

    drop: float = 0.0  # probabilities, each in [0, 1], summing to at most 1
    delay: float = 0.0
    corrupt: float = 0.0
    kill: float = 0.0
    delay_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        probs = (self.drop, self.delay, self.corrupt, self.kill)
        if any(p < 0 for p in probs) or sum(probs) > 1 + 1e-9:
            raise ValueError(f"fault probabilities must be >= 0 and sum to <= 1, got {probs}")


class LeaseCounts(msgspec.Struct):
    """The exporter's leases: held now, and how the ended ones ended."""

    active: int
    granted: int = 0
    released: int = 0
    expired: int = 0


class FabricInfo(msgspec.Struct):
    """The host's RDMA fabric and the path KV takes over it (transport/fabric.py)."""

    devices: list[str]
    kinds: list[str]
    gpudirect: bool
    gpudirect_via: str | None
    path: str


class BoardInfo(msgspec.Struct):
    """A lease board (transport/board.py): its file, slots in use, and whether fetchers read it."""

    path: str
    slots: int
    used: int
    full: int
    one_sided: bool


class PeerInfo(msgspec.Struct):
    """cuda_ipc, fetcher side: one exporter's KV as this process maps it."""

    mode: str  # p2p | staged | local
    gpu: str
    device: str
    one_sided: bool


class CudaIpcInfo(msgspec.Struct):
    peers: list[PeerInfo]
    p2p_access: dict[str, bool] | None  # other GPU index -> whether this GPU reaches it directly
    checksum_on: str
    lease_board: BoardInfo | None


class NcclInfo(msgspec.Struct):
    version: str | None
    chunk_blocks: int
    send_calls_ms: float | None  # the median time to queue one fetch's sends
    checksum_on: str


class NixlInfo(msgspec.Struct):
    backend: str  # the NIXL backend in use ("UCX", "LIBFABRIC")
    asked: list[str]
    failed: dict[str, str]  # backend -> why it did not start
    module: str | None
    agent: str
    memory: str
    ucx_error_handling: str
    ucx_cuda_ipc_get: str | None  # UCX's cuda_ipc GET zero-copy setting, for a KV pool on a GPU
    registered_bytes: int
    state_slots_registered: bool
    reads: dict[str, int] = {}  # NIXL backend that served a read -> reads
    descriptors: int = 0
    descriptors_last: int = 0
    state_descriptors_last: int = 0
    state_reads: int = 0  # state rows read by NIXL out of the exporter's registered slots
    state_inline: int = 0  # states carried in the frame body instead


class RankParts(msgspec.Struct):
    """One decode rank's reads across tensor-parallel sizes: bytes its own channels fetched, in all and
    by prefill rank, and the process that read them."""

    fetched_bytes: int = 0
    by_prefill_rank: dict[int, int] = msgspec.field(default_factory=dict, name="from")
    pid: int = 0  # the process that ran this rank's reads (its own)


class TensorParallelInfo(msgspec.Struct):
    size: int
    addresses: list[str | None]
    served_bytes: list[int]  # per rank
    fetched_bytes: list[int]
    parts: list[RankParts] = msgspec.field(default_factory=list)  # per decode rank
    served_pids: list[int] = msgspec.field(default_factory=list)  # per rank: the process serving its exports
    leases_active: list[int] = msgspec.field(default_factory=list)  # per rank: its export leases held now


class MoverInfo(msgspec.Struct, omit_defaults=True):
    """What a backend's payload mover adds to the description (transport/channel.py's `PayloadMover`)."""

    shm_mode: str | None = None  # shm: direct (the KV in shared memory) | staged
    device: str | None = None  # GPU movers: the KV's device, its GPU, how blocks moved, phase medians
    gpu: str | None = None
    copies: dict[str, int] | None = None  # how the blocks moved -> count
    fetch_phases_ms: dict[str, float] | None = None  # phase -> median ms (gpu/mover.py)
    serve_phases_ms: dict[str, float] | None = None
    cuda_ipc: CudaIpcInfo | None = None
    nccl: NcclInfo | None = None
    nixl: NixlInfo | None = None


class TransportInfo(MoverInfo, kw_only=True, omit_defaults=True):
    """The whole description (see the module docstring): the channel's fields, always there, the
    mover's (inherited), and those of a tensor-parallel group or a test hook, where there is one."""

    backend: str
    requested: str  # the backend asked for; differs from `backend` after a fallback
    fallback_reasons: list[str]
    peer: str | None
    fetch_gbps_last: float | None
    fetch_gbps_recent: float | None
    serve_gbps_recent: float | None
    counts: dict[str, int]  # counter name -> running total (fetches, fetched_bytes, fallbacks, ...)
    errors: dict[str, int]  # error class -> transfers it failed
    address: str | None
    layout_fingerprint: str
    checksum: str | None
    leases: LeaseCounts
    connections_opened: int
    connections_reaped: int
    fabric: FabricInfo
    server: dict[str, int] | None = None  # the exporter's server: connections, refusals by cause
    faults: dict[str, int] | None = None  # injected faults by kind (tests)
    tensor_parallel: TensorParallelInfo | None = None
    fault_knobs: FaultKnobs | None = None  # test hooks: the knobs, the throttle, the share of blocks landed
    throttle_gbps: float | None = None
    fetch_fraction: float | None = None


__all__ = [
    "BoardInfo",
    "CudaIpcInfo",
    "FabricInfo",
    "FaultKnobs",
    "LeaseCounts",
    "MoverInfo",
    "NcclInfo",
    "NixlInfo",
    "RankParts",
    "PeerInfo",
    "TensorParallelInfo",
    "TransportInfo",
]
