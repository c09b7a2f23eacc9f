"""KVLayout: what two workers must agree on before one copies KV bytes into the other.

The engine's cache is one block-major tensor per worker,

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

so a block is `block_nbytes` contiguous bytes and a request's KV is its list of block ids. Hybrid models
add per-request recurrent state of fixed shapes (`state_shapes`), which travels after the blocks.

Both sides of a connection send their layout in the handshake (msgspec encodes and decodes the
dataclass itself, running `__post_init__`'s checks, frames.py); `mismatches` lists every difference in
words ("block_size: ours 16, peer 32") and any difference refuses the connection. The `fingerprint`
(a short hash of the layout) is stamped on every handle so a fetcher can tell a handle made for another
model before it connects.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields
from functools import cached_property

import msgspec
import torch

PROTOCOL_VERSION = 1

# (name, shape, dtype) of one per-request state tensor, e.g. ("layer3.conv", (4, 128), "float32")
StateShape = tuple[str, tuple[int, ...], str]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def itemsize(name: str) -> int:
    return torch_dtype(name).itemsize


@dataclass(frozen=True)
class KVLayout:
    model_fingerprint: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    state_shapes: tuple[StateShape, ...] = ()
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        itemsize(self.dtype)  # validates the name
        for name, shape, dtype in self.state_shapes:
            itemsize(dtype)
            if any(d < 0 for d in shape):
                raise ValueError(f"state {name!r} has a negative dimension: {shape}")
        names = [s[0] for s in self.state_shapes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate state names in {names}")

    @classmethod
    def from_tensor(
        cls, kv: torch.Tensor, fingerprint: str, state_shapes: tuple[StateShape, ...] | list = ()
    ) -> KVLayout:
        """Read the layout off an engine KV tensor [num_blocks, L, 2, block_size, KVH, D]."""
        if kv.dim() != 6 or kv.shape[2] != 2:
            want = "kv[num_blocks, layers, 2, block_size, kv_heads, head_dim]"
            raise ValueError(f"expected {want}, got {tuple(kv.shape)}")
        _, layers, _, block_size, heads, head_dim = kv.shape
        states = tuple((str(n), tuple(int(d) for d in s), str(t)) for n, s, t in state_shapes)
        return cls(fingerprint, dtype_name(kv.dtype), block_size, layers, heads, head_dim, states)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * itemsize(self.dtype)

    @property
    def state_nbytes(self) -> int:
        return sum(math.prod(shape) * itemsize(dtype) for _, shape, dtype in self.state_shapes)

    def payload_nbytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_nbytes + self.state_nbytes

    @cached_property
    def fingerprint(self) -> str:
        """A short stable hash of the whole layout (what a handle is stamped with)."""
        blob = msgspec.json.encode(self, order="sorted")  # compact JSON, keys sorted
        return hashlib.blake2b(blob, digest_size=12).hexdigest()

    def mismatches(self, other: KVLayout) -> list[str]:
        """Every difference from `other` (the peer's layout), in words; empty when compatible."""
        out = [
            f"{f.name}: ours {getattr(self, f.name)!r}, peer {getattr(other, f.name)!r}"
            for f in fields(self)
            if f.name != "state_shapes" and getattr(self, f.name) != getattr(other, f.name)
        ]
        return out + _state_mismatches(self.state_shapes, other.state_shapes)


def _state_mismatches(ours: tuple[StateShape, ...], theirs: tuple[StateShape, ...]) -> list[str]:
    mine, peer = {n: (s, t) for n, s, t in ours}, {n: (s, t) for n, s, t in theirs}
    out = []
    for name in sorted(mine.keys() | peer.keys()):
        if name not in peer:
            out.append(f"state {name!r}: ours {_fmt(mine[name])}, peer has none")
        elif name not in mine:
            out.append(f"state {name!r}: ours has none, peer {_fmt(peer[name])}")
        elif mine[name] != peer[name]:
            out.append(f"state {name!r}: ours {_fmt(mine[name])}, peer {_fmt(peer[name])}")
    if not out and [n for n, _, _ in ours] != [n for n, _, _ in theirs]:
        out.append(f"state order: ours {[n for n, _, _ in ours]}, peer {[n for n, _, _ in theirs]}")
    return out


def _fmt(shape_dtype: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = shape_dtype
    return f"{tuple(shape)} {dtype}"
