"""cuda_ipc between replicas of different tensor-parallel sizes, on a machine without a GPU.

Each decode rank reads, from each prefill rank holding some of its KV heads and state channels, only
those, copied straight out of the exporter's (mapped) KV into its own blocks and state
(transport/gpu/cuda_ipc_part.py). The test doubles (`cpu_test_double`: a CPU KV, a same-process
exporter's tensor read directly) run that whole path on the CPU: the same tensor indexing, the same
protocol (lease pinned, the answer's block ids, the state from the exporter's arena or the answer's
body, "done"), each prefill rank a transport of its own. What lands is compared byte for byte with the
model's unsharded KV and state gathered by hand; every lease ends. nccl, which moves whole blocks only,
is refused before any byte moves, naming both sizes and the backends that work.

The GPU's version (two engines, a rank per process): tests/gpu/test_tp_disagg_gpu.py.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
from kv_helpers import SECRET, wait_for

from splitserve.engine.tp.kv_routes import Plan, Sharding, parts
from splitserve.engine.tp.kv_transport import ShardedFetch
from splitserve.engine.tp.rank_reads import RankReader, fetch_only
from splitserve.model.config import ModelConfig
from splitserve.model.random_weights import random_source_config
from splitserve.transport import (
    BackendUnavailable,
    LeaseExpired,
    PeerRefused,
    TransferTimeout,
    TransportError,
    TransportOptions,
)
from splitserve.transport.faults import FaultKnobs, FaultPlan
from splitserve.transport.gpu.cuda_ipc import CudaIpcTransport
from splitserve.transport.gpu.cuda_ipc_part import copy_channels, copy_heads
from splitserve.transport.gpu.nccl import NcclTransport
from splitserve.transport.layout import KVLayout
from splitserve.transport.part_sink import PartTarget
from splitserve.transport.payload import selected_nbytes
from splitserve.wire.kv_handle import KVShard


class IpcDouble(CudaIpcTransport):
    cpu_test_double = True


class NcclDouble(NcclTransport):
    cpu_test_double = True


DOUBLES = {"cuda_ipc": IpcDouble, "nccl": NcclDouble}
IDS = [9, 2, 30, 31, 32, 7, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 33, 35, 37, 39]  # 18 runs
INTO = [0, 40, 41, 42, 3, 17, 5, 6, 1, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28]


def _cfg() -> ModelConfig:
    """The small Qwen3.5 hybrid, widened so that 1, 2 and 4 ranks split its KV heads and channels."""
    hf = random_source_config("random:qwen3.5-tiny")
    hf.update(num_key_value_heads=4, num_attention_heads=8, linear_num_key_heads=4, linear_num_value_heads=8)
    return ModelConfig.from_hf(hf)


def _full(cfg: ModelConfig) -> KVLayout:
    lin = cfg.linear
    assert lin is not None
    states = (("conv", (3, lin.conv_dim, 3), "float32"),
              ("recurrent", (3, lin.num_value_heads, 4, 2), "float32"))  # fmt: skip
    return KVLayout("m", "float32", 4, 2, cfg.num_kv_heads, 8, states)


class Prefill:
    """A prefill replica at `size`: one exporter per rank over its own pool, and one export's TP handle."""

    def __init__(self, cfg: ModelConfig, full: KVLayout, size: int, backend: str, **options: object) -> None:
        gen = torch.Generator().manual_seed(size)
        self.sharding = Sharding.of(cfg, size)
        self.freed: list[list[int]] = []
        self.ranks, self.kv, self.states = [], [], []
        opts = TransportOptions(lease_s=30.0, **options)  # type: ignore[arg-type]
        for r in range(size):
            layout = self.sharding.rank_layout(full, r)
            kv = torch.randn((48, *layout.block_shape), generator=gen)
            state = {name: torch.randn(shape, generator=gen) for name, shape, _ in layout.state_shapes}
            self.ranks.append(
                DOUBLES[backend](kv, layout, secret=SECRET, on_free=self.freed.append, options=opts)
            )
            self.kv.append(kv)
            self.states.append(state)
        made = [
            t.export("req", IDS, len(IDS) * full.block_size, s)
            for t, s in zip(self.ranks, self.states, strict=True)
        ]
        shards = tuple(
            KVShard(h.address, h.lease_id, h.layout_fingerprint, None, r, tuple(self.sharding.kv[r]))
            for r, h in enumerate(made)
        )
        self.handle = made[0] if size == 1 else msgspec.structs.replace(
            made[0], layout_fingerprint=full.fingerprint, tp_size=size, shards=shards
        )  # fmt: skip

    def full_kv(self, cfg: ModelConfig) -> torch.Tensor:
        """The model's unsharded KV of the exported blocks, head by head from the rank holding it."""
        out = torch.empty((len(IDS), *self.kv[0].shape[1:4], cfg.num_kv_heads, self.kv[0].shape[5]))
        for kv, heads in zip(self.kv, self.sharding.kv, strict=True):
            out[..., heads, :] = kv[IDS]
        return out

    def full_state(self, name: str) -> torch.Tensor:
        axis, channels, count = self.sharding.states[name]
        shape = list(self.states[0][name].shape)
        shape[axis] = count
        out = torch.empty(shape)
        for state, held in zip(self.states, channels, strict=True):
            out.index_copy_(axis, torch.tensor(held), state[name])
        return out

    def close(self) -> None:
        for t in self.ranks:
            t.close()


def _opener(backend: str, **options: object):  # noqa: ANN202
    def opener(kv: torch.Tensor, layout: KVLayout):  # noqa: ANN202
        opts = fetch_only(TransportOptions(**options))  # type: ignore[arg-type]
        return DOUBLES[backend](kv, layout, secret=SECRET, options=opts)

    return opener


def _check_rank(
    cfg: ModelConfig, prefill: Prefill, dst: Sharding, rank: int, kv: torch.Tensor, state
) -> None:  # noqa: ANN001
    """Rank `rank`'s blocks and state hold exactly its heads and channels of the model's."""
    assert torch.equal(kv[INTO], prefill.full_kv(cfg)[..., dst.kv[rank], :])
    for name, (axis, channels, _) in dst.states.items():
        want = prefill.full_state(name).index_select(axis, torch.tensor(channels[rank]))
        assert torch.equal(state[name], want), name


@pytest.mark.parametrize("state_rows", [8, 0], ids=["state-in-arena", "state-in-answer"])
@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 4), (4, 2), (4, 1)], ids=lambda s: f"P{s[0]}D{s[1]}")
def test_each_decode_rank_copies_exactly_its_heads_and_channels(sizes, state_rows):
    cfg = _cfg()
    full = _full(cfg)
    prefill = Prefill(cfg, full, sizes[0], "cuda_ipc", state_arena_rows=state_rows)
    plan = Plan.build(cfg, *sizes)
    readers = []
    try:
        for rank in range(sizes[1]):
            layout = plan.dst.rank_layout(full, rank)
            kv = torch.zeros((48, *layout.block_shape))
            reader = RankReader(cfg, full, rank, sizes[1], kv, _opener("cuda_ipc"))
            readers.append(reader)
            state = reader.read(prefill.handle, INTO, time.monotonic() + 20.0, whole=False)
            _check_rank(cfg, prefill, plan.dst, rank, kv, state)
            untouched = [b for b in range(48) if b not in INTO]
            assert not kv[untouched].any()  # nothing written outside its blocks
            want = {
                p.src: selected_nbytes(plan.src.rank_layout(full, p.src), len(IDS), p.select)
                for p in parts(plan, rank)
            }
            assert dict(reader.by_src) == want and reader.nbytes == sum(want.values())
            for peer in reader.peers.values():
                info = peer.describe()
                assert info.counts["part_fetches"] == 1 and info.counts["fetched_bytes"] in want.values()
                assert set(info.copies) == {"local_part_gather_scatter"}  # 18 runs of block ids
        read = [sum(r.by_src[p] for r in readers) for p in range(sizes[0])]  # each prefill rank's share
        assert wait_for(lambda: [t.describe().counts.get("served_bytes", 0) for t in prefill.ranks] == read)
        for rank, h in enumerate(prefill.handle.shards or (prefill.handle,)):
            prefill.ranks[rank].release(
                msgspec.structs.replace(prefill.handle, address=h.address, lease_id=h.lease_id)
            )
        assert len(prefill.freed) == sizes[0] and all(t.describe().leases.active == 0 for t in prefill.ranks)
    finally:
        for reader in readers:
            reader.close()
        prefill.close()


def test_a_size_one_decode_replica_imports_a_sharded_export_through_its_fetch():
    """The decode side's ShardedFetch at size 1 (a connector's) reads a size-2 export over cuda_ipc,
    and its handshake check finds the exporter's rank layout."""
    cfg = _cfg()
    full = _full(cfg)
    prefill = Prefill(cfg, full, 2, "cuda_ipc")
    kv = torch.zeros((48, *full.block_shape))
    own = IpcDouble(kv, full, secret=SECRET)
    fetch = ShardedFetch(cfg, full, kv, own, 1, _opener("cuda_ipc"))
    try:
        assert fetch.check_peer(prefill.handle.address, 5.0).num_kv_heads == 2
        state = fetch.fetch(prefill.handle, INTO, 20.0)
        _check_rank(cfg, prefill, Sharding.of(cfg, 1), 0, kv, state)
        assert fetch.rank_bytes[0] == sum(fetch.rank_parts()[0].by_prefill_rank.values()) > 0
        fetch.release(prefill.handle)
        assert len(prefill.freed) == 2
    finally:
        fetch.close()
        own.close()
        prefill.close()


def test_nccl_across_sizes_is_refused_before_any_byte_moves_naming_both_sizes():
    cfg = _cfg()
    full = _full(cfg)
    prefill = Prefill(cfg, full, 2, "nccl")
    kv = torch.zeros((48, *full.block_shape))
    own = NcclDouble(kv, full, secret=SECRET)
    fetch = ShardedFetch(cfg, full, kv, own, 1, _opener("nccl"))
    try:
        with pytest.raises(PeerRefused) as checked:
            fetch.check_peer(prefill.handle.address, 5.0)
        with pytest.raises(PeerRefused) as fetched:
            fetch.fetch(prefill.handle, INTO, 5.0)
        for exc in (checked.value, fetched.value):
            assert "kv transport nccl cannot move KV from a prefill replica at tensor_parallel_size 2 " \
                   "to a decode replica at tensor_parallel_size 1" in str(exc)  # fmt: skip
            assert "use tcp, shm, cuda_ipc" in str(exc)
        assert not kv.any() and fetch.rank_bytes == [0] and not fetch.peers
        assert all(t.describe().counts.get("served_bytes", 0) == 0 for t in prefill.ranks)
        # a part asked of an nccl channel directly is refused the same way, before it connects
        layout = Sharding.of(cfg, 2).rank_layout(full, 0)
        channel = _opener("nccl")(torch.zeros((1, *layout.block_shape)), layout)
        part = parts(Plan.build(cfg, 2, 1), 0)[0]
        target = PartTarget(kv, full, INTO, part.heads, {}, ())
        with pytest.raises(BackendUnavailable, match="nccl moves whole blocks only.*use tcp, shm, cuda_ipc"):
            channel.read_part(
                msgspec.structs.replace(prefill.handle, tp_size=1, shards=()), part.select, target
            )  # type: ignore[arg-type]
        channel.close()
    finally:
        fetch.close()
        own.close()
        prefill.close()


@pytest.mark.parametrize("into", [INTO, list(range(20, 40))], ids=["scattered", "one-run"])
def test_copy_heads_and_channels_are_exact_on_both_paths(into):
    """The copies themselves: every head run pair, both block-copy paths (runs and gather/scatter,
    forced both ways), across dtypes as bytes; the state channels' runs."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randn((48, 2, 2, 4, 5, 8), generator=gen).to(torch.bfloat16)
    heads_src, heads_dst = ((0, 1), (2, 2), (4, 1)), ((3, 1), (0, 2), (2, 1))
    ids = list(range(5, 25)) if into is INTO else IDS
    want = torch.zeros((48, 2, 2, 4, 4, 8), dtype=torch.bfloat16)
    for (s, n), (d, _) in zip(heads_src, heads_dst, strict=True):
        want[into, :, :, :, d : d + n] = src[ids][:, :, :, :, s : s + n]
    hows = set()
    for max_runs, staging in ((0, 1), (0, 1 << 20), (64, 1 << 20)):
        dst = torch.zeros_like(want)
        hows.add(copy_heads(src, ids, heads_src, dst, into, heads_dst, max_runs, staging))
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16))
    assert hows == {"runs", "gather_scatter"}
    state_src = {"conv": torch.randn((3, 10, 3), generator=gen), "rec": torch.randn((3, 4, 2), generator=gen)}
    state_dst = {"conv": torch.zeros((3, 6, 3)), "rec": torch.zeros((3, 2, 2))}
    copy_channels(state_src, (("conv", 1, ((1, 2), (6, 4))), ("rec", 1, ((3, 1), (0, 1)))),
                  state_dst, (("conv", 1, ((4, 2), (0, 4))), ("rec", 1, ((0, 1), (1, 1)))))  # fmt: skip
    assert torch.equal(state_dst["conv"], state_src["conv"][:, [6, 7, 8, 9, 1, 2]])
    assert torch.equal(state_dst["rec"], state_src["rec"][:, [3, 0]])
    with pytest.raises(ValueError, match="differ in shape"):
        copy_heads(src, ids, ((0, 2),), want, into, ((0, 1),))


def test_a_part_read_meets_the_whole_reads_deadline_lease_and_hang_up_rules():
    """A prefill rank that never answers fails the part read at its deadline, one that hangs up fails
    it at once, and an ended lease is the exporter's LeaseExpired; the lease holds meanwhile, and the
    same read succeeds, byte-exact, once the exporter behaves."""
    cfg = _cfg()
    full = _full(cfg)
    prefill = Prefill(cfg, full, 2, "cuda_ipc")
    kv = torch.zeros((48, *full.block_shape))
    reader = RankReader(cfg, full, 0, 1, kv, _opener("cuda_ipc", connect_timeout_s=2.0))
    try:
        prefill.ranks[1].install_faults(FaultPlan(FaultKnobs(drop=1.0)))
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            reader.read(prefill.handle, INTO, time.monotonic() + 1.0, whole=False)
        assert time.monotonic() - start < 5  # at its deadline: nothing hangs
        prefill.ranks[1].install_faults(FaultPlan(FaultKnobs(kill=1.0)))
        start = time.monotonic()
        with pytest.raises(TransportError):
            reader.read(prefill.handle, INTO, time.monotonic() + 10.0, whole=False)
        assert time.monotonic() - start < 5
        prefill.ranks[1].install_faults(None)
        assert all(t.describe().leases.active == 1 for t in prefill.ranks)
        state = reader.read(prefill.handle, INTO, time.monotonic() + 10.0, whole=False)
        _check_rank(cfg, prefill, Sharding.of(cfg, 1), 0, kv, state)
        shard = prefill.handle.shards[1]
        prefill.ranks[1].release(
            msgspec.structs.replace(prefill.handle, address=shard.address, lease_id=shard.lease_id)
        )
        with pytest.raises(LeaseExpired):
            reader.read(prefill.handle, INTO, time.monotonic() + 10.0, whole=False)
    finally:
        reader.close()
        prefill.close()
