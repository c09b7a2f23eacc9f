"""The KV handle: the claim ticket for one exported request's KV, from the prefill engine to the decode
engine (prefill core -> its front end -> router -> decode front end -> decode core).

`KVHandle` names where the KV is (`backend`, `address` of the exporter's server), which lease holds it
(`lease_id`, good until `lease_expires_at`, wall clock), what it is (`request_id`, the exporter's
`block_ids`, `num_tokens`), and how to check it (`layout_fingerprint`, optional `checksum` of the
payload computed at export): what a transport makes and fetches by. `KVExport` is what crosses every
wire: the handle and the sampler's generator state after the first token (seeded requests).

Both are frozen msgspec structs, used as they are inside a process and encoded by msgspec on every
edge (JSON over HTTP, the bytes as base64; msgpack to and from the engine core). A handle is not a
secret on its own: fetching also needs the shared secret.
"""

from __future__ import annotations

import time
from typing import Annotated

import msgspec
from msgspec.structs import force_setattr

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class KVShard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor-parallel rank's part of an export: the server of that rank's own process, which
    serves its heads out of its own pool, its lease there, its own layout (the rank's KV heads and
    state channels) and which of the model's KV heads those are. The block ids are the handle's, the
    same on every rank."""

    address: str
    lease_id: str
    layout_fingerprint: str
    checksum: str | None = None
    rank: NonNegative = 0
    kv_heads: tuple[int, ...] = ()  # the model's KV heads this rank serves, in its cache's order


class KVHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: str
    address: str  # "host:port" or "unix:/path/to.sock" of the exporter's server
    request_id: str
    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: NonNegative
    layout_fingerprint: str
    lease_expires_at: float  # wall clock (time.time()); a hint for routers, the exporter's clock rules
    checksum: str | None = None  # "crc32:1a2b3c4d" or "blake2b:<hex>"
    lease_slot: int | None = None  # cuda_ipc: the lease's slot on the exporter's lease board (board.py)
    state_row: int | None = None  # cuda_ipc: the row of the exporter's state arena (state_arena.py)
    # an exporter at tensor_parallel_size > 1: its size and each rank's part, rank order (the fields
    # above then name rank 0's server and lease, and the model's unsharded layout)
    tp_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    shards: tuple[KVShard, ...] = ()

    def __post_init__(self) -> None:
        force_setattr(self, "block_ids", tuple(int(b) for b in self.block_ids))

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def seconds_left(self, now: float | None = None) -> float:
        return self.lease_expires_at - (time.time() if now is None else now)


class KVExport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a prefill engine hands on: where the KV is, and the sampler's generator after draw one."""

    handle: KVHandle
    generator_state: bytes | None = None  # torch.Generator.get_state() of a seeded request


__all__ = ["KVExport", "KVHandle", "KVShard"]
