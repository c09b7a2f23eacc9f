"""Which KV transport backends carry a request between replicas of different tensor_parallel_size.

A decode rank of a replica at another size than the prefill replica's holds other KV heads and state
channels than any one prefill rank: it reads only its share (some heads and channels) from each prefill
rank holding part of it (engine/tp/kv_transport.py). tcp and shm stream just those bytes; cuda_ipc's
GPU copies just those heads and channels out of the prefill rank's mapped KV. nccl and nixl move whole
blocks only, so a pair of sizes that differ is refused with them before any byte moves: when the
manifest is read, and again when the decode worker checks its peer or fetches a handle.

Plain data and strings: the router reads manifests, so nothing here loads torch or the transports.
"""

from __future__ import annotations

ACROSS_SIZES: tuple[str, ...] = ("tcp", "shm", "cuda_ipc")  # backends that carry part of an export


def across_sizes_refusal(backend: str, prefill_size: int, decode_size: int) -> str | None:
    """Why `backend` cannot carry KV from a prefill replica at `prefill_size` to a decode replica at
    `decode_size`, or None when it can (equal sizes always can)."""
    if prefill_size == decode_size or backend in ACROSS_SIZES:
        return None
    return (
        f"kv transport {backend} cannot move KV from a prefill replica at tensor_parallel_size "
        f"{prefill_size} to a decode replica at tensor_parallel_size {decode_size}: it moves whole "
        f"blocks only, and each decode rank needs part of several prefill ranks' blocks; use "
        f"{', '.join(ACROSS_SIZES)} across sizes, or give both roles the same tensor_parallel_size"
    )


__all__ = ["ACROSS_SIZES", "across_sizes_refusal"]
