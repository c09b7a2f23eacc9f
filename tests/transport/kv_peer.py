"""A KV exporter in another OS process, driven over a multiprocessing pipe (tests and nothing else).

The parent starts it with `ExporterProcess(spec)`; the child rebuilds the same seeded KV tensor
(`make_kv(spec)`), opens one transport per backend in `spec["backends"]`, and answers commands:
export -> handle dict, freed -> the block-id lists its `on_free` saw, describe, stop.
"""

from __future__ import annotations

import multiprocessing as mp
import zlib
from dataclasses import asdict, dataclass, field

import msgspec
import torch

from splitserve.transport import KVHandle, KVLayout, TransportOptions, make_transport
from splitserve.transport.stream.shm import allocate_shared_kv


@dataclass(frozen=True)
class PeerSpec:
    num_blocks: int = 64
    num_layers: int = 4
    block_size: int = 16
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "bfloat16"
    fingerprint: str = "test-model"
    state_shapes: tuple = (("conv", (4, 8), "float32"), ("ssm", (2, 3, 5), "float32"))
    seed: int = 1234
    secret: str = "test-secret"
    backends: tuple[str, ...] = ("tcp", "shm", "shm-direct")  # shm-direct: shm over a shared-memory KV
    options: dict = field(default_factory=dict)

    def layout(self) -> KVLayout:
        return KVLayout(
            self.fingerprint, self.dtype, self.block_size, self.num_layers,
            self.num_kv_heads, self.head_dim, tuple(self.state_shapes),
        )  # fmt: skip


def make_kv(spec: PeerSpec, num_blocks: int | None = None, seed: int | None = None) -> torch.Tensor:
    """Seeded random KV [num_blocks, L, 2, block_size, KVH, D]: the same bytes in every process."""
    gen = torch.Generator().manual_seed(spec.seed if seed is None else seed)
    n = num_blocks or spec.num_blocks
    shape = (n, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=gen).to(getattr(torch, spec.dtype))


def shared_copy(kv: torch.Tensor) -> torch.Tensor:
    out = allocate_shared_kv(kv.shape, kv.dtype)
    out.copy_(kv)
    return out


def make_state(spec: PeerSpec, request_id: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
    return {name: torch.randn(shape, generator=gen) for name, shape, _ in spec.state_shapes}


def _serve(conn, spec_dict: dict) -> None:
    spec = PeerSpec(**spec_dict)
    kv, freed = make_kv(spec), []
    options = TransportOptions(**spec.options)
    transports = {}
    for name in spec.backends:
        backend, cache = ("shm", shared_copy(kv)) if name == "shm-direct" else (name, kv)
        transports[name] = make_transport(
            backend, cache, spec.layout(), secret=spec.secret, on_free=freed.append, options=options
        )
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "export":
            backend, request_id, block_ids, num_tokens = args
            state = make_state(spec, request_id) if spec.state_shapes else None
            conn.send(
                msgspec.msgpack.encode(transports[backend].export(request_id, block_ids, num_tokens, state))
            )
        elif cmd == "freed":
            conn.send(list(freed))
        elif cmd == "describe":
            conn.send(msgspec.to_builtins(transports[args[0]].describe()))
        elif cmd == "stop":
            for t in transports.values():
                t.close()
            conn.send("bye")
            return


class ExporterProcess:
    """The parent's end: start, export(...) -> KVHandle, freed(), stop()."""

    def __init__(self, spec: PeerSpec) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, asdict(spec)), daemon=True)
        self.proc.start()
        if not self.conn.poll(60) or self.conn.recv() != "ready":
            raise RuntimeError("exporter process did not start")

    def call(self, *cmd):
        self.conn.send(cmd)
        if not self.conn.poll(30):
            raise TimeoutError(f"exporter process did not answer {cmd[0]}")
        return self.conn.recv()

    def export(self, backend: str, request_id: str, block_ids: list[int], num_tokens: int) -> KVHandle:
        return msgspec.msgpack.decode(
            self.call("export", backend, request_id, block_ids, num_tokens), type=KVHandle
        )

    def freed(self) -> list[list[int]]:
        return self.call("freed")

    def stop(self) -> None:
        try:
            self.call("stop")
        finally:
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
