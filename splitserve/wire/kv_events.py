"""A worker's prefix-cache events, for cache-aware routing, and the block hash chain both sides compute.

    engine core ──CacheEvents (in a Batch, wire/core.py)──▶ worker front end (a mirror + recent events)
    router ──GET /kv/events?epoch=E&after=S&wait_s=W──▶ worker front end ──▶ KVEventsPage

A block's hash (`hash_block`) covers its tokens and, through its parent's hash, every token before it:
the engine's prefix cache keys blocks by it, and the router computes a prompt's chain (`block_hashes`)
from its token ids to look the prompt up in its per-replica index of what each worker holds.

Each event has a sequence number, one more than the previous event of the same worker process; the
process's `epoch` (drawn at its start) tells a restarted worker from the one before. Kinds:

    stored             blocks now findable in the prefix cache (their KV complete)
    removed            blocks evicted from it (their memory reused)
    cleared            the whole prefix cache dropped (`hashes` empty)
    checkpoint_stored  hybrid models: recurrent-state checkpoints saved at these blocks' ends
    checkpoint_removed hybrid models: checkpoints evicted

A page answers with the events after `after` when the worker still holds all of them, else with a full
`KVSnapshot` (its epoch differs, or the caller fell too far behind); the long poll answers as soon as
there are events, or after `wait_s` with none (a heartbeat: the channel is alive).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

ROOT_HASH = b"splitserve-root"

EventKind = Literal["stored", "removed", "cleared", "checkpoint_stored", "checkpoint_removed"]


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The content hash of one block: blake2b-128 of the parent's hash and the ids as little-endian int64."""
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.blake2b(parent + ids.tobytes(), digest_size=16).digest()


def extend_chain(parent: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hashes of the whole blocks of `token_ids`, chained on from `parent`: `hash_block` of each
    block in turn, with the ids packed into one int64 buffer for all of them (a 4,096-token prompt's
    256 blocks: one conversion instead of 256 slices and arrays)."""
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    buf = memoryview(ids).cast("B")
    step = 8 * block_size
    out: list[bytes] = []
    blake2b = hashlib.blake2b
    for i in range(0, len(buf) - step + 1, step):
        h = blake2b(parent, digest_size=16)
        h.update(buf[i : i + step])
        parent = h.digest()
        out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[bytes]:
    """The hash chain of the whole blocks of `token_ids` (at most `max_blocks`)."""
    n = len(token_ids) // block_size
    n = n if max_blocks is None else min(n, max_blocks)
    return extend_chain(ROOT_HASH, token_ids[: n * block_size], block_size)


class KVEvent(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    kind: EventKind
    hashes: list[bytes]


class CacheLoad(msgspec.Struct, array_like=True, frozen=True):
    """The worker's load as its engine saw it when it last changed the cache."""

    unfinished: int  # requests running or waiting in the engine
    blocks_free: int
    blocks_total: int


class KVSnapshot(msgspec.Struct, frozen=True):
    """Everything findable now: what a follower that lost track starts again from."""

    stored: list[bytes]
    checkpoints: list[bytes]


class KVEventsPage(msgspec.Struct, forbid_unknown_fields=True):
    """GET /kv/events: `events` after the caller's `after` (seq order), or a `snapshot` as of `seq`."""

    epoch: str
    seq: int  # the last event's number this page brings the caller up to
    block_size: int
    hybrid: bool  # a prefix is usable only up to a state checkpoint
    events: list[KVEvent] = []
    snapshot: KVSnapshot | None = None
    load: CacheLoad | None = None


class KVEventsQuery(msgspec.Struct, forbid_unknown_fields=True):
    """The query of GET /kv/events (from the URL's parameters)."""

    epoch: str = ""  # the epoch the caller follows ("" the first time)
    after: Annotated[int, msgspec.Meta(ge=-1)] = -1  # the last seq the caller has; -1: send a snapshot
    wait_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.0  # long poll: how long to wait for events


__all__ = [
    "CacheLoad",
    "EventKind",
    "KVEvent",
    "KVEventsPage",
    "KVEventsQuery",
    "KVSnapshot",
    "ROOT_HASH",
    "block_hashes",
    "hash_block",
]
