"""The KV transport's control frames: one msgspec struct per kind, told apart by their "op" tag.

A frame's header (protocol.py: prefix | header | body) is one of these structs as JSON; `encode` and
`decode` below are the only places a header is turned into bytes or back. A header that is not JSON,
has an unknown op, or a field missing or of the wrong type is `MalformedFrame`, naming what is wrong.

The frames, by who sends them (protocol.py tells the handshake, the backends their payload dialogues):
  handshake   Challenge (exporter), Hello (fetcher), Welcome (exporter), Error (either side)
  requests    Fetch, Release (fetcher) -> a payload frame, Ok, or Error (exporter)
  payloads    Kv (tcp), KvShm + Chunk / Ack (staged shm), KvDirect (direct shm), KvCuda (cuda_ipc),
              KvNccl (nccl), KvNixl (nixl); the fetcher answers Done, nixl's exporter then Ok
  open        CudaIpcOpen -> CudaIpcShare (cuda_ipc); NcclOpen -> NcclRendezvous, NcclReady (nccl)

Bytes fields (IPC handles, packed block ids, NIXL agent metadata) travel as base64 in the JSON.
"""

from __future__ import annotations

from typing import TypeVar, Union

import msgspec

from splitserve.transport.errors import PeerRefused, TransportError, error_class
from splitserve.transport.layout import KVLayout


class MalformedFrame(TransportError):
    """A frame header that is not one of the frames below (not JSON, unknown op, a bad field)."""


class Frame(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True, frozen=True):
    """A control frame; each kind below sets its own `op` tag."""


# -- the handshake -------------------------------------------------------------------------------
class Challenge(Frame, tag="challenge", kw_only=True):
    nonce: str


class Hello(Frame, tag="hello", kw_only=True):
    nonce: str
    layout: KVLayout
    proof: str


class Welcome(Frame, tag="welcome", kw_only=True):
    layout: KVLayout
    proof: str


class Error(Frame, tag="error", kw_only=True):
    """A refusal or failure; `code` names the exception class (errors.py). A layout refusal lists the
    differences, and carries the exporter's layout when the fetcher proved the secret."""

    code: str = "transport"
    message: str = ""
    mismatches: tuple[str, ...] = ()
    layout: KVLayout | None = None

    @classmethod
    def of(cls, exc: TransportError, layout: KVLayout | None = None) -> Error:
        mismatches = tuple(exc.mismatches) if isinstance(exc, PeerRefused) else ()
        return cls(code=exc.code, message=str(exc), mismatches=mismatches, layout=layout)

    def exception(self) -> TransportError:
        """The exception this frame carries, as the peer's class (errors.py)."""
        if self.code == PeerRefused.code:
            return PeerRefused("peer refused the layout", list(self.mismatches))
        return error_class(self.code)(f"from the peer: {self.message or self.code}")


# -- requests and short answers ------------------------------------------------------------------
Runs = tuple[tuple[int, int], ...]  # (first, count) along one axis, in payload order


class Select(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Part of a lease's payload: what a fetcher holding only some of the exporter's KV heads and state
    channels asks for (tensor parallelism at another size). `heads`: runs along every block's head
    axis; `states`: (name, split axis, runs along it) per state tensor. The bytes' order is
    payload.py's `selected_pieces`."""

    heads: Runs
    states: tuple[tuple[str, int, Runs], ...] = ()


class Fetch(Frame, tag="fetch", kw_only=True):
    lease_id: str
    request_id: str
    timeout_s: float
    into_run: bool = False  # nccl: the fetcher's blocks are one run (one message is enough)
    select: Select | None = None  # tcp, shm, cuda_ipc: only these heads and state channels (None: all)


class Release(Frame, tag="release", kw_only=True):
    lease_id: str


class Ok(Frame, tag="ok", kw_only=True):
    released: bool | None = None  # a release's answer: whether the lease was still held


class Done(Frame, tag="done", kw_only=True):
    """The fetcher has the payload: the exporter may drop its pin."""


# -- payloads: what an exporter answers a fetch with ---------------------------------------------
class Payload(Frame, kw_only=True):
    """The fields every payload frame carries: the lease's block count and the export's checksum."""

    blocks: int
    checksum: str | None = None


class Kv(Payload, tag="kv", kw_only=True):
    nbytes: int  # the frame body: the blocks, then the state tensors


class Chunk(Frame, tag="chunk", kw_only=True):
    """Staged shm: `nbytes` of the payload from byte `pos` wait in slot `slot` of the segment."""

    slot: int
    pos: int
    nbytes: int


class KvShm(Payload, tag="kv_shm", kw_only=True):
    nbytes: int
    segment: str
    slot_nbytes: int
    chunk: Chunk  # the first chunk


class Ack(Frame, tag="ack", kw_only=True):
    slot: int


class KvDirect(Payload, tag="kv_direct", kw_only=True):
    block_ids: tuple[int, ...]
    kv_nbytes: int
    block_nbytes: int
    fd: bool  # the cache's descriptor rides along with this frame (the connection's first fetch)


class GpuPayload(Payload, kw_only=True):
    """A GPU backend's answer: the exporter's block ids (little-endian int32), the row of its state
    arena when the state waits there (else the state tensors are the frame body), and for nccl the
    blocks of each message (the last may be shorter)."""

    block_ids: bytes
    state_row: int | None = None
    chunk_blocks: int = 0


class KvCuda(GpuPayload, tag="kv_cuda", kw_only=True):
    pass


class KvNccl(GpuPayload, tag="kv_nccl", kw_only=True):
    pass


class Region(msgspec.Struct, frozen=True):
    """A registered NIXL memory region: base address, size, row size, memory kind, device."""

    addr: int
    nbytes: int
    block_nbytes: int
    mem: str  # "DRAM" | "VRAM"
    dev: int

    def __post_init__(self) -> None:
        if self.block_nbytes <= 0 or self.nbytes % self.block_nbytes or self.mem not in ("DRAM", "VRAM"):
            raise ValueError(f"malformed KV region: {self}")

    @property
    def num_blocks(self) -> int:
        return self.nbytes // self.block_nbytes


class KvNixl(Payload, tag="kv_nixl", kw_only=True):
    agent: str
    region: Region
    block_ids: tuple[int, ...]
    agent_md: bytes | None = None  # the exporter agent's metadata, on the connection's first fetch
    state_slot: int | None = None  # the state is in this slot of the exporter's registered tensors
    state_regions: tuple[Region, ...] = ()


# -- the GPU backends' open exchange -------------------------------------------------------------
class IpcStorage(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """A CUDA IPC handle of a storage (torch's `_share_cuda_`); no handle on a CPU test double."""

    handle: bytes | None = None
    storage_nbytes: int = 0
    storage_offset: int = 0
    ref_counter: bytes = b""
    ref_counter_offset: int = 0


class ArenaShare(IpcStorage, kw_only=True):
    """cuda_ipc: the exporter's state arena (gpu/state_arena.py)."""

    key: str
    pid: int
    rows: int
    row_nbytes: int
    wire_dtype: str
    offset: int


class BoardShare(msgspec.Struct, frozen=True):
    """cuda_ipc: the exporter's lease board file (board.py)."""

    path: str
    slots: int


class CudaIpcOpen(Frame, tag="cuda_ipc_open", kw_only=True):
    host: str
    pid: int
    gpu: str


class CudaIpcShare(IpcStorage, Frame, tag="cuda_ipc_handle", kw_only=True):
    """The exporter's whole KV storage, its lease board and its state arena (gpu/cuda_ipc_share.py)."""

    key: str
    host: str
    pid: int
    gpu: str
    kv_offset: int
    kv_nbytes: int
    block_nbytes: int
    board: BoardShare | None = None
    state: ArenaShare | None = None


class NcclOpen(Frame, tag="nccl_open", kw_only=True):
    gpu: str
    host: str
    timeout_s: float


class NcclRendezvous(Frame, tag="nccl_rendezvous", kw_only=True):
    port: int
    prefix: str
    gpu: str
    host: str
    nccl: str | None = None  # the exporter's NCCL version


class NcclReady(Frame, tag="nccl_ready", kw_only=True):
    pass


AnyFrame = Union[  # noqa: UP007 - msgspec needs the union as a value
    Challenge, Hello, Welcome, Error, Fetch, Release, Ok, Done, Kv, KvShm, Chunk, Ack, KvDirect, KvCuda,
    KvNccl, KvNixl, CudaIpcOpen, CudaIpcShare, NcclOpen, NcclRendezvous, NcclReady,
]  # fmt: skip
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(AnyFrame)
F = TypeVar("F", bound=Frame)


def encode(frame: Frame) -> bytes:
    return _ENCODER.encode(frame)


def decode(raw: bytes) -> Frame:
    try:
        return _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedFrame(f"malformed frame header: {exc}") from exc


def op(frame: Frame | type[Frame]) -> str:
    """The "op" tag of a frame or of a kind of frame."""
    return str(frame.__struct_config__.tag)
