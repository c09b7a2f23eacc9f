"""The GPU backends (cuda_ipc, nccl) on a machine without a GPU.

  * asking for them without CUDA, or with a KV on the CPU, is a clear `BackendUnavailable`, and an
    explicit fallback works;
  * their protocol (open exchange, payload header + state, "done", leases, checksums, faults,
    refusals) runs end to end through test doubles: `cpu_test_double` lets a CPU KV through, cuda_ipc
    then reads a same-process exporter's tensor and nccl runs on Gloo instead of NCCL;
  * the block-copy planner (runs vs gather/scatter) and the chunking are exact.

The real thing (two processes, two GPUs) is tests/gpu/test_kv_gpu.py.
"""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch
from kv_helpers import SECRET, layout_of, small_kv, wait_for

import splitserve.transport.gpu.nccl as nccl_mod
from splitserve.transport import (
    AuthError,
    BackendUnavailable,
    CorruptTransfer,
    FaultyTransport,
    LeaseExpired,
    PeerRefused,
    TransportError,
    TransportOptions,
    available_backends,
    make_transport,
    trace,
)
from splitserve.transport.faults import FaultKnobs, FaultPlan
from splitserve.transport.gpu.cuda_ipc import CudaIpcTransport, copy_blocks, kv_rows, open_peer, paired_runs
from splitserve.transport.gpu.nccl import NcclTransport, chunk_spans
from splitserve.transport.gpu.state_arena import row_spans

NO_CUDA = not torch.cuda.is_available()
STATES = (("conv", (4, 8), "float32"), ("ssm", (2, 3, 5), "float32"))


class IpcDouble(CudaIpcTransport):
    cpu_test_double = True


class NcclDouble(NcclTransport):
    cpu_test_double = True


DOUBLES = {"cuda_ipc": IpcDouble, "nccl": NcclDouble}


@pytest.fixture
def pair():
    """pair(backend, **options) -> (exporter, fetcher, freed): test doubles over the same layout."""
    made = []

    def _pair(backend, num_blocks=48, states=STATES, **options):
        src = small_kv(num_blocks=num_blocks, seed=1)
        layout = layout_of(src, states=states)
        freed: list[list[int]] = []
        opts = TransportOptions(**options)
        exporter = DOUBLES[backend](src, layout, secret=SECRET, on_free=freed.append, options=opts)
        fetcher = DOUBLES[backend](torch.zeros_like(src), layout, secret=SECRET, options=opts)
        made.extend([exporter, fetcher])
        return exporter, fetcher, freed

    yield _pair
    for t in made:
        t.close()


def some_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape, _ in STATES}


# -- start-up ------------------------------------------------------------------------------------
@pytest.mark.skipif(not NO_CUDA, reason="this host has CUDA")
@pytest.mark.parametrize("backend, missing", [("cuda_ipc", "needs CUDA"), ("nccl", "needs CUDA and NCCL")])
def test_no_cuda_is_a_clear_start_up_error(backend, missing):
    kv = small_kv()
    with pytest.raises(BackendUnavailable, match=missing) as info:
        make_transport(backend, kv, layout_of(kv), secret=SECRET)
    assert "torch.cuda.is_available() is False" in str(info.value)
    assert available_backends()[backend].startswith(f"{backend}: needs CUDA")


@pytest.mark.parametrize("cls", [CudaIpcTransport, NcclTransport])
def test_a_cpu_kv_is_refused_even_with_cuda(cls):
    kv = small_kv()
    with pytest.raises(BackendUnavailable, match="needs the KV cache on a CUDA device.*cpu"):
        cls(kv, layout_of(kv), secret=SECRET)


@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
def test_explicit_fallback_to_tcp(backend):
    kv = small_kv()
    t = make_transport(backend, kv, layout_of(kv), secret=SECRET, fallback=["tcp"])
    try:
        info = t.describe()
        assert info.backend == "tcp" and info.requested == backend
        assert info.counts["fallbacks"] == 1 and backend in info.fallback_reasons[0]
    finally:
        t.close()


# -- the protocol, through the doubles -----------------------------------------------------------
@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
@pytest.mark.parametrize("checksum", [None, "crc32"])
@pytest.mark.parametrize(
    "ids, into",
    [([4, 5, 6, 7], [20, 21, 22, 23]), ([9, 2, 30, 31, 32, 7], [0, 40, 41, 42, 3, 17])],
    ids=["one-run", "scattered"],
)
def test_round_trip(pair, backend, checksum, ids, into):
    exporter, fetcher, freed = pair(backend, checksum=checksum)
    state = some_state()
    handle = exporter.export("r1", ids, len(ids) * 16 - 3, state)
    assert handle.backend == backend and (handle.checksum is not None) == bool(checksum)
    got = fetcher.fetch(handle, into, timeout_s=10)
    assert torch.equal(fetcher.kv_cache[into], exporter.kv_cache[ids])
    untouched = [b for b in range(fetcher.kv_cache.shape[0]) if b not in into]
    assert not fetcher.kv_cache[untouched].any()
    assert all(torch.equal(got[k], state[k]) for k in state)
    fetcher.release(handle)
    assert wait_for(lambda: freed == [ids])
    info = fetcher.describe()
    assert info.backend == backend and info.counts["fetches"] == 1
    assert info.counts.get("checksums_verified", 0) == (1 if checksum else 0)
    with pytest.raises(LeaseExpired):
        fetcher.fetch(handle, into, timeout_s=5)


@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
def test_connection_is_reused_and_opened_once(pair, backend):
    exporter, fetcher, _ = pair(backend, states=())
    for i in range(3):
        handle = exporter.export(f"r{i}", [i * 3, i * 3 + 1], 32)
        fetcher.fetch(handle, [40 - i * 2, 41 - i * 2], timeout_s=10)
        fetcher.release(handle)
    assert fetcher.describe().connections_opened == 1
    key = "ipc_handles_opened" if backend == "cuda_ipc" else "nccl_groups"
    assert fetcher.describe().counts[key] == 1


def test_nccl_chunks_mix_direct_and_staged(pair, monkeypatch):
    block = layout_of(small_kv()).block_nbytes
    monkeypatch.setattr(nccl_mod, "CHUNK_BYTES", 3 * block)  # 3 blocks a chunk
    monkeypatch.setattr(nccl_mod, "ONE_MESSAGE_BYTES", 0)  # chunks even for a small transfer
    exporter, fetcher, _ = pair("nccl", states=())
    assert exporter.mover.link.chunk_blocks == 3
    ids = [10, 11, 12, 1, 5, 3, 20, 21, 22, 30, 31]  # chunks: run | scattered | run | run(2)
    into = [0, 8, 2, 3, 4, 5, 6, 7, 44, 45, 46]  # chunks: scattered | run | scattered | run(2)
    handle = exporter.export("r", ids, len(ids) * 16)
    fetcher.fetch(handle, into, timeout_s=10)
    assert torch.equal(fetcher.kv_cache[into], exporter.kv_cache[ids])
    assert fetcher.describe().copies == {"chunks": 4, "chunks_staged": 2}


@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
def test_wrong_secret_and_layout_are_refused(pair, backend):
    exporter, _, _ = pair(backend)
    handle = exporter.export("r", [1, 2], 32, some_state())
    kv = small_kv(num_blocks=48)
    stranger = DOUBLES[backend](kv, layout_of(kv, states=STATES), secret="wrong")
    other = small_kv(num_blocks=48, block_size=32)
    different = DOUBLES[backend](other, layout_of(other, states=STATES), secret=SECRET)
    try:
        with pytest.raises(AuthError):
            stranger.fetch(handle, [3, 4], timeout_s=5)
        with pytest.raises(PeerRefused, match="block_size"):
            different.fetch(handle, [3, 4], timeout_s=5)
    finally:
        stranger.close()
        different.close()


@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
def test_corruption_is_caught_and_kill_is_an_error(pair, backend):
    exporter, fetcher, _ = pair(backend, states=(), checksum="crc32")
    faulty = FaultyTransport(exporter, corrupt=1.0)
    handle = faulty.export("r", [1, 2, 3], 48)
    with pytest.raises(CorruptTransfer):
        fetcher.fetch(handle, [4, 5, 6], timeout_s=10)
    faulty.plan.knobs = type(faulty.plan.knobs)(kill=1.0)
    start = time.monotonic()
    with pytest.raises(TransportError):
        fetcher.fetch(handle, [4, 5, 6], timeout_s=10)
    assert time.monotonic() - start < 5
    exporter.install_faults(None)
    fetcher.fetch(handle, [4, 5, 6], timeout_s=10)  # served again, intact
    assert torch.equal(fetcher.kv_cache[[4, 5, 6]], exporter.kv_cache[[1, 2, 3]])


def test_cuda_ipc_refuses_another_host(pair):
    exporter, fetcher, _ = pair("cuda_ipc")
    share = msgspec.structs.replace(exporter.mover.link.share(), host="some-other-boot-id")
    with pytest.raises(PeerRefused, match="one host"):
        open_peer(share, fetcher.kv_cache.device, fetcher.layout)


def test_cuda_ipc_refuses_a_gpu_it_cannot_see(pair):
    exporter, fetcher, _ = pair("cuda_ipc")
    share = msgspec.structs.replace(exporter.mover.link.share(), pid=-1, handle=b"\0\0\0", gpu="GPU-not-here")
    with pytest.raises(PeerRefused):
        open_peer(share, torch.device("cuda", 0), fetcher.layout)


# -- cuda_ipc's one-sided fetches (the lease board) -----------------------------------------------
def test_cuda_ipc_reads_one_sided_and_stops_when_the_lease_ends(pair):
    exporter, fetcher, freed = pair("cuda_ipc", states=())
    handle = exporter.export("r", [9, 2, 30], 40)
    board = exporter.leases.board  # made when serving starts
    assert handle.lease_slot is not None and board.words[handle.lease_slot] != 0
    fetcher.fetch(handle, [0, 40, 41], timeout_s=10)
    assert torch.equal(fetcher.kv_cache[[0, 40, 41]], exporter.kv_cache[[9, 2, 30]])
    counts = fetcher.describe().counts
    assert counts["one_sided_fetches"] == 1 and counts["fetches"] == 1
    assert "served" not in exporter.describe().counts  # no request reached the exporter
    fetcher.fetch(handle, [3, 4, 5], timeout_s=10)  # again: still live
    assert fetcher.describe().counts["one_sided_fetches"] == 2
    fetcher.release(handle)
    assert wait_for(lambda: freed == [[9, 2, 30]])
    assert board.words[handle.lease_slot] == 0  # cleared before the blocks were freed
    with pytest.raises(LeaseExpired):  # the slot sends it to the exporter, which says why
        fetcher.fetch(handle, [0, 40, 41], timeout_s=5)


def test_cuda_ipc_one_sided_read_of_a_lease_ending_mid_copy_is_refused(pair, monkeypatch):
    exporter, fetcher, freed = pair("cuda_ipc", states=())
    handle = exporter.export("r", [1, 2], 32)
    fetcher.fetch(exporter.export("warm", [5], 16), [7], timeout_s=10)  # mapped, one-sided
    copy = fetcher.mover.link._copy

    def copy_then_lose_the_lease(peer, src_ids, into):  # the lease expires while the bytes move
        how = copy(peer, src_ids, into)
        exporter.leases.release(handle.lease_id)
        return how

    monkeypatch.setattr(fetcher.mover.link, "_copy", copy_then_lose_the_lease)
    with pytest.raises(LeaseExpired):
        fetcher.fetch(handle, [10, 11], timeout_s=5)
    assert fetcher.describe().counts["one_sided_lost"] == 1
    assert [1, 2] in freed


def test_cuda_ipc_one_sided_read_from_a_dead_exporter_is_an_error(pair):
    exporter, fetcher, _ = pair("cuda_ipc", states=())
    handle = exporter.export("r", [1, 2], 32)
    fetcher.fetch(handle, [10, 11], timeout_s=10)  # mapped, one-sided
    exporter._server.close()  # its process "dies": the board still says live, the socket is gone
    with pytest.raises(TransportError):
        fetcher.fetch(handle, [12, 13], timeout_s=5)
    assert fetcher.describe().counts["one_sided_fetches"] == 1


def test_cuda_ipc_asks_first_for_state_faults_and_a_full_board(pair, monkeypatch):
    # no state arena: the state travels on the control channel, so the fetch asks first
    exporter, fetcher, _ = pair("cuda_ipc", state_arena_rows=0)
    fetcher.fetch(exporter.export("s", [1, 2], 32, some_state()), [3, 4], timeout_s=10)
    assert "one_sided_fetches" not in fetcher.describe().counts
    exporter, fetcher, _ = pair("cuda_ipc", states=())
    exporter.listen()
    monkeypatch.setattr(exporter.leases.board, "_free", [exporter.leases.board._free[-1]])  # 1 slot
    first, second = exporter.export("a", [1], 16), exporter.export("b", [2], 16)
    assert first.lease_slot is not None and second.lease_slot is None
    assert exporter.describe().cuda_ipc.lease_board.full == 1
    fetcher.fetch(second, [5], timeout_s=10)
    assert fetcher.describe().counts["fetches"] == 1
    assert "one_sided_fetches" not in fetcher.describe().counts
    exporter.install_faults(FaultPlan(FaultKnobs()))  # a fault plan: every fetch must meet it
    fetcher.fetch(first, [6], timeout_s=10)
    assert "one_sided_fetches" not in fetcher.describe().counts
    exporter.install_faults(None)
    fetcher.fetch(first, [6], timeout_s=10)
    assert fetcher.describe().counts["one_sided_fetches"] == 1
    assert torch.equal(fetcher.kv_cache[[5, 6]], exporter.kv_cache[[2, 1]])


def test_cuda_ipc_state_arena(pair):
    """The state waits in a row of the exporter's arena: read one-sided with the blocks (or by row on
    the two-sided path), the row back when the lease ends; a full arena sends it the host way; bf16 on
    the wire is the state rounded once."""
    exporter, fetcher, _ = pair("cuda_ipc", state_arena_rows=2)
    state = some_state(3)
    handle = exporter.export("a", [1, 2], 32, state)
    assert handle.state_row is not None and exporter.mover.link.arena.num_free == 1
    got = fetcher.fetch(handle, [3, 4], timeout_s=10)
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert fetcher.describe().counts["one_sided_fetches"] == 1
    exporter.install_faults(FaultPlan(FaultKnobs()))  # two-sided: the answer names the row
    got = fetcher.fetch(handle, [5, 6], timeout_s=10)
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert fetcher.describe().counts["state_rows_read"] == 2
    exporter.install_faults(None)
    second, third = exporter.export("b", [7], 16, some_state(4)), exporter.export("c", [8], 16, some_state(5))
    assert second.state_row is not None and third.state_row is None  # full: the host way
    got = fetcher.fetch(third, [9], timeout_s=10)
    assert all(torch.equal(got[k], some_state(5)[k]) for k in state)
    fetcher.release(handle)
    assert wait_for(lambda: exporter.mover.link.arena.num_free == 1)

    exporter, fetcher, _ = pair("cuda_ipc", state_wire_dtype="bfloat16")
    got = fetcher.fetch(exporter.export("d", [1], 16, state), [2], timeout_s=10)
    spans = row_spans(exporter.layout, "bfloat16")
    assert sum(span[-1] for span in spans) == sum(t.numel() * 2 for t in state.values())
    for k in state:
        assert got[k].dtype == torch.float32 and torch.equal(got[k], state[k].bfloat16().float())


def test_lease_board_file_is_private_and_removed_on_close(pair):
    exporter, _, _ = pair("cuda_ipc", states=())
    exporter.listen()
    path = exporter.leases.board.path
    assert os.stat(path).st_mode & 0o777 == 0o600
    exporter.close()
    assert not os.path.exists(path)


# -- copies and chunks ---------------------------------------------------------------------------
def test_paired_runs_and_chunks():
    assert paired_runs([5, 6, 7, 2, 3], [0, 1, 2, 3, 4]) == [(5, 0, 3), (2, 3, 2)]
    assert paired_runs([5, 6, 7], [0, 2, 3]) == [(5, 0, 1), (6, 2, 2)]
    assert chunk_spans(7, 3) == [(0, 3), (3, 6), (6, 7)]


@pytest.mark.parametrize(
    "src_ids, dst_ids, max_runs, how",
    [
        ([7, 8, 9, 1, 33, 2, 3, 4, 39], [0, 1, 2, 30, 31, 10, 11, 12, 5], 100, "runs"),
        ([7, 8, 9, 1, 33, 2, 3, 4, 39], [0, 1, 2, 30, 31, 10, 11, 12, 5], 0, "gather_scatter"),
        ([5, 6, 7, 8, 9], [30, 2, 17, 3, 11], 0, "scatter"),
        ([30, 2, 17, 3, 11], [5, 6, 7, 8, 9], 0, "gather"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_copy_blocks_is_exact_every_way(src_ids, dst_ids, max_runs, how, dtype):
    src = small_kv(num_blocks=40, seed=3).to(dtype)
    dst = torch.zeros_like(src)
    got = copy_blocks(kv_rows(src), kv_rows(dst), src_ids, dst_ids, max_runs=max_runs, staging_bytes=1)
    assert got == how
    assert torch.equal(kv_rows(dst)[dst_ids], kv_rows(src)[src_ids])
    assert not kv_rows(dst)[[b for b in range(40) if b not in dst_ids]].any()


@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
def test_fetch_checks_its_arguments(pair, backend):
    exporter, fetcher, _ = pair(backend, states=())
    handle = exporter.export("r", [1, 2, 3, 4], 64)
    with pytest.raises(ValueError, match="4 blocks"):
        fetcher.fetch(handle, [0, 1], timeout_s=5)
    with pytest.raises(ValueError, match="distinct"):
        fetcher.fetch(handle, [0, 1, 1, 2], timeout_s=5)
    with pytest.raises(ValueError, match="distinct"):
        fetcher.fetch(handle, [0, 1, 2, 48], timeout_s=5)
    with pytest.raises(ValueError, match="distinct"):
        exporter.export("r2", [5, 5], 32)
    other = "nccl" if backend == "cuda_ipc" else "cuda_ipc"
    with DOUBLES[other](torch.zeros_like(fetcher.kv_cache), fetcher.layout, secret=SECRET) as wrong:
        with pytest.raises(PeerRefused, match=f"backend: ours {other}, peer {backend}"):
            wrong.fetch(handle, [0, 1, 2, 3])


def test_trace_gives_the_timeline_of_a_fetch(pair, monkeypatch):
    """SPLITSERVE_KV_TRACE: marks from both ends in one clock (here one process holds both)."""
    monkeypatch.setattr(trace, "ON", True)
    trace.events()
    exporter, fetcher, _ = pair("cuda_ipc", states=())
    fetcher.fetch(exporter.export("r", [1, 2], 32), [3, 4], timeout_s=10)
    labels = [label for _, label in trace.events()]
    assert labels.index("f.one_sided") < labels.index("f.copy_queued") < labels.index("f.copied")
    exporter, fetcher, _ = pair("nccl", states=())
    fetcher.fetch(exporter.export("r", [1, 2], 32), [3, 4], timeout_s=10)
    marks: list = []
    assert wait_for(lambda: marks.extend(trace.events()) or "e.done" in [label for _, label in marks])
    marks.sort()
    labels = [label for _, label in marks]
    for label in ("f.request", "e.request", "e.send_called", "e.answered", "f.answer", "f.pulled"):
        assert label in labels, labels
    assert labels.index("f.request") < labels.index("e.request") < labels.index("f.answer")


def test_a_dead_exporters_board_is_swept_a_live_ones_is_not(tmp_path):
    from splitserve.transport.board import PREFIX, STALE_AFTER_S, LeaseBoard, sweep_stale

    live = LeaseBoard(slots=4, directory=str(tmp_path))
    dead = tmp_path / f"{PREFIX}dead"  # what a killed exporter leaves: a file nobody holds locked
    dead.write_bytes(b"\0" * 40)
    young = tmp_path / f"{PREFIX}young"
    young.write_bytes(b"\0" * 40)
    old = time.time() - STALE_AFTER_S - 5
    os.utime(dead, (old, old))
    os.utime(live.path, (old, old))
    assert sweep_stale(str(tmp_path)) == 1
    assert not dead.exists() and young.exists() and os.path.exists(live.path)
    live.close()
    assert not os.path.exists(live.path)


def test_a_closed_board_shows_no_live_lease(tmp_path):
    from splitserve.transport.board import BoardView, LeaseBoard

    board = LeaseBoard(slots=4, directory=str(tmp_path))
    slot = board.post("abcdef0123456789abcdef01")
    view = BoardView(board.path, 4)
    assert view.live(slot, "abcdef0123456789abcdef01")
    board.close()  # e.g. a lease still pinned: its clear would come later, into nothing
    assert not view.live(slot, "abcdef0123456789abcdef01") and not view.one_sided()


class _FakeEvent:
    """A stand-in for torch.cuda.Event (no GPU here): `query()` is False `pending` times, then True
    (None: never, a copy that hangs)."""

    def __init__(self, pending: int | None) -> None:
        self.pending = pending
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.pending is not None and self.queries > self.pending


def test_a_copy_that_never_ends_times_out_at_the_deadline():
    """cuda_ipc waits for its copies by polling an event against the fetch's deadline, not with a
    stream synchronize that would hang with a hung copy."""
    from splitserve.transport.errors import TransferTimeout
    from splitserve.transport.gpu.cuda_ipc import wait_event
    from splitserve.transport.protocol import Deadline

    t0 = time.monotonic()
    with pytest.raises(TransferTimeout, match="copy from peer"):
        wait_event(_FakeEvent(None), Deadline.after(0.05), "copy from peer")
    assert 0.05 <= time.monotonic() - t0 < 0.5
    done = _FakeEvent(5)
    wait_event(done, Deadline.after(5.0), "copy")  # returns as soon as the event has happened
    assert done.queries == 6
