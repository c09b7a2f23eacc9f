"""The GPU KV transports for real: an exporter process on cuda:0, this process fetching on cuda:1.

Skipped without CUDA (CI has none); on a GPU machine: `python -m pytest tests/gpu -q`. With one GPU,
cuda_ipc runs between two processes on that GPU and the nccl transfers are skipped (NCCL cannot pair
a GPU with itself: that refusal is still checked).
Checks for cuda_ipc and nccl: the fetched bytes equal the exported ones (one run of blocks, scattered
blocks, many blocks), state tensors and checksums arrive, release frees the exporter's blocks, and a
peer with another layout or secret is refused before any KV moves; cuda_ipc reads one-sided when
there is no state to carry. cuda_ipc also in one process (local mode); nccl refuses to pair a GPU
with itself.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict, dataclass

import msgspec
import pytest
import torch
from tp_pd_engines import run as _run

from splitserve.transport import AuthError, KVHandle, KVLayout, PeerRefused, TransportOptions, make_transport

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
FETCH_ON = "cuda:1" if TWO_GPUS else "cuda:0"

SECRET = "gpu-test-secret"
BACKENDS = ["cuda_ipc", "nccl"]
TRANSFERS = ["cuda_ipc", pytest.param("nccl", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs"))]


@dataclass(frozen=True)
class Spec:
    num_blocks: int = 96
    num_layers: int = 4
    block_size: int = 16
    num_kv_heads: int = 2
    head_dim: int = 64
    seed: int = 7
    checksum: str | None = None
    states: tuple = (("conv", (4, 8), "float32"),)

    def layout(self) -> KVLayout:
        return KVLayout("gpu-test", "bfloat16", self.block_size, self.num_layers, self.num_kv_heads,
                        self.head_dim, tuple(self.states))  # fmt: skip

    def cpu_kv(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    def state(self, request_id: str) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(sum(request_id.encode()))
        return {name: torch.randn(shape, generator=gen) for name, shape, _ in self.states}

    def options(self) -> TransportOptions:
        return TransportOptions(checksum=self.checksum, lease_s=60, fetch_timeout_s=60)


def _exporter_main(conn, spec_dict: dict) -> None:
    spec = Spec(**spec_dict)
    kv = spec.cpu_kv().to("cuda:0")
    freed: list[list[int]] = []
    transports = {
        b: make_transport(b, kv, spec.layout(), secret=SECRET, on_free=freed.append, options=spec.options())
        for b in BACKENDS
    }
    for t in transports.values():
        t.listen()
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "export":
            backend, request_id, ids = args
            handle = transports[backend].export(
                request_id, ids, len(ids) * spec.block_size, spec.state(request_id)
            )
            conn.send(msgspec.msgpack.encode(handle))
        elif cmd == "freed":
            conn.send(list(freed))
        elif cmd == "stop":
            for t in transports.values():
                t.close()
            conn.send("bye")
            return


class Exporter:
    def __init__(self, spec: Spec) -> None:
        ctx = mp.get_context("spawn")
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_exporter_main, args=(child, asdict(spec)), daemon=True)
        self.proc.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("exporter process did not start")

    def call(self, *cmd):
        self.conn.send(cmd)
        if not self.conn.poll(60):
            raise TimeoutError(f"exporter did not answer {cmd[0]}")
        return self.conn.recv()

    def export(self, backend: str, request_id: str, ids: list[int]) -> KVHandle:
        return msgspec.msgpack.decode(self.call("export", backend, request_id, ids), type=KVHandle)

    def stop(self) -> None:
        try:
            self.call("stop")
        finally:
            self.proc.join(timeout=20)
            if self.proc.is_alive():
                self.proc.kill()


SPECS = {"plain": Spec(), "crc32": Spec(checksum="crc32"), "stateless": Spec(states=())}


@pytest.fixture(scope="module", params=list(SPECS))
def exporter(request):
    ex = Exporter(SPECS[request.param])
    yield ex
    ex.stop()


@pytest.fixture
def fetcher_for(exporter):
    made = []

    def _make(backend: str, device: str = FETCH_ON, layout: KVLayout | None = None, secret: str = SECRET):
        spec = exporter.spec
        kv = torch.zeros_like(spec.cpu_kv(), device=device)
        t = make_transport(backend, kv, layout or spec.layout(), secret=secret, options=spec.options())
        made.append(t)
        return t

    yield _make
    for t in made:
        t.close()


CASES = {
    "one-run": (list(range(10, 18)), list(range(40, 48))),
    "scattered": ([3, 90, 4, 5, 61, 17], [0, 1, 2, 80, 81, 82]),
    "many": (list(range(95, 31, -1)), [2 * i + 1 for i in range(40)] + list(range(0, 48, 2))[:24]),
}


@pytest.mark.parametrize("backend", TRANSFERS)
@pytest.mark.parametrize("case", list(CASES))
def test_fetch_across_processes_is_exact(exporter, fetcher_for, backend, case):
    ids, into = CASES[case]
    request_id = f"{backend}-{case}-{time.monotonic_ns()}"
    handle = exporter.export(backend, request_id, ids)
    fetcher = fetcher_for(backend)
    state = fetcher.fetch(handle, into, timeout_s=60)
    expected = exporter.spec.cpu_kv()
    got = fetcher.kv_cache.cpu()
    assert torch.equal(got[into].view(torch.uint8), expected[ids].view(torch.uint8))
    assert not got[[b for b in range(got.shape[0]) if b not in into]].view(torch.uint8).any()
    want = exporter.spec.state(request_id)
    assert all(torch.equal(state[k].cpu(), want[k]) for k in want)  # over cuda_ipc: on our GPU
    fetcher.release(handle)
    deadline = time.monotonic() + 10
    while ids not in exporter.call("freed") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ids in exporter.call("freed")
    info = fetcher.describe()
    assert info.backend == backend and info.counts["fetches"] == 1
    if exporter.spec.checksum:
        assert info.counts["checksums_verified"] == 1
    if backend == "cuda_ipc":  # read one-sided (the lease board), no round trip, unless state must
        # travel the host way (with checksums the exporter keeps no state arena: state_arena.py)
        host_state = bool(exporter.spec.states and exporter.spec.checksum)
        assert info.counts.get("one_sided_fetches", 0) == (0 if host_state else 1)
        (peer,) = info.cuda_ipc.peers
        staged = TWO_GPUS and not torch.cuda.can_device_access_peer(1, 0)
        assert peer.mode == ("staged" if staged else "p2p")
        assert info.copies
        if peer.mode == "p2p" and case != "one-run":  # many runs: one launch of the kernel
            assert set(info.copies) == {"p2p_kernel"}, info.copies


@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_layout_and_secret_are_refused(exporter, fetcher_for, backend):
    handle = exporter.export(backend, f"refuse-{backend}-{time.monotonic_ns()}", [1, 2])
    spec = exporter.spec
    kv = torch.zeros((8, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim + 64),
                     dtype=torch.bfloat16, device=FETCH_ON)  # fmt: skip
    other = KVLayout.from_tensor(kv, "gpu-test", spec.states)
    mismatched = make_transport(backend, kv, other, secret=SECRET, options=spec.options())
    try:
        with pytest.raises(PeerRefused, match="head_dim"):
            mismatched.fetch(handle, [3, 4], timeout_s=20)
    finally:
        mismatched.close()
    with pytest.raises(AuthError):
        fetcher_for(backend, secret="not-the-secret").fetch(handle, [3, 4], timeout_s=20)


def test_nccl_refuses_to_pair_a_gpu_with_itself(exporter, fetcher_for):
    handle = exporter.export("nccl", f"self-{time.monotonic_ns()}", [5])
    with pytest.raises(PeerRefused, match="refused us: gpu: exporter and fetcher both on"):
        fetcher_for("nccl", device="cuda:0").fetch(handle, [6], timeout_s=20)


def test_cuda_ipc_in_one_process_reads_the_tensor_directly():
    spec = Spec()
    src = spec.cpu_kv().to("cuda:0")
    dst = torch.zeros_like(src, device=FETCH_ON)
    exp = make_transport("cuda_ipc", src, spec.layout(), secret=SECRET, options=spec.options())
    fet = make_transport("cuda_ipc", dst, spec.layout(), secret=SECRET, options=spec.options())
    try:
        ids, into = [7, 8, 9, 50], [1, 2, 3, 4]
        handle = exp.export("local", ids, 64, spec.state("local"))
        fet.fetch(handle, into, timeout_s=30)
        assert torch.equal(dst[into].cpu().view(torch.uint8), src[ids].cpu().view(torch.uint8))
        assert fet.describe().cuda_ipc.peers[0].mode == "local"
    finally:
        fet.close()
        exp.close()


def test_a_late_copy_times_out_and_its_blocks_are_held_until_it_ends():
    """A cuda_ipc copy still running at the fetch's deadline: TransferTimeout at the deadline, not a
    hang, carrying the copy's event (`pending`); the engine's stream is not held up, and a block pool
    given the blocks with `free_after` keeps them until the copy has written them. Later copies
    queue without the host waiting for the late one. The late copy is a one-block copy queued
    behind a ~1 s sleep kernel on the transport's side stream."""
    from splitserve.engine.block_pool import BlockPool
    from splitserve.transport.errors import TransferTimeout
    from splitserve.transport.gpu.cuda_ipc import copy_blocks, kv_rows
    from splitserve.transport.protocol import Deadline

    spec = Spec()
    dst = torch.zeros((spec.num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads,
                       spec.head_dim), dtype=torch.bfloat16, device=FETCH_ON)  # fmt: skip
    src = torch.randn(dst.shape, device=dst.device).to(dst.dtype)
    rows_src, rows_dst = kv_rows(src), kv_rows(dst)
    fet = make_transport("cuda_ipc", dst, spec.layout(), secret=SECRET, options=spec.options())
    try:
        with torch.cuda.device(dst.device):
            later = (([3, 9, 4], [20, 2, 30]), ([7, 1, 60, 5], [11, 12, 40, 0]))
            for s_ids, d_ids in later:  # warm-up: the first launch of a kernel variant loads its
                with fet.mover.on_device():  # module, which waits for the whole GPU
                    copy_blocks(rows_src, rows_dst, s_ids, d_ids)
            torch.cuda.synchronize()
            dst.zero_()
            torch.cuda.synchronize()
            with fet.mover.on_device():
                torch.cuda._sleep(2_000_000_000)  # ~1 s of clock cycles
                copy_blocks(rows_src, rows_dst, [3], [10])  # the late copy, into block 10
                done = torch.cuda.Event()
                done.record()
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match="cuda_ipc copy from late peer") as info:
                fet.mover.link._wait_copies("late peer", Deadline.after(0.05), done)
            assert time.monotonic() - t0 < 0.5
            assert info.value.pending is done and not done.query()
            assert torch.cuda.current_stream().query()  # the engine's stream is not held up
            pool = BlockPool(spec.num_blocks)
            pool.allocate(spec.num_blocks)
            pool.free_after([10], info.value.pending)
            assert pool.num_free == 0 and pool.num_held == 1
            t0 = time.monotonic()
            for s_ids, d_ids in later:
                with fet.mover.on_device():
                    assert copy_blocks(rows_src, rows_dst, s_ids, d_ids) == "kernel"
            assert time.monotonic() - t0 < 0.5  # queued, not waited for on the host
            torch.cuda.synchronize()
            assert pool.num_held == 0 and pool.num_free == 1  # back once the copy has ended
            assert torch.equal(dst[[10, 20, 2, 30, 11, 12, 40, 0]], src[[3, 3, 9, 4, 7, 1, 60, 5]])
        assert fet.stats._counts["copy_deadline_missed"] == 1
        assert fet.stats._counts["late_copies_handed_over"] == 1
    finally:
        fet.close()


# -- through the engine: prefill on cuda:0, decode on cuda:1, one process -------------------------
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", TRANSFERS)
def test_engine_disaggregated_on_two_gpus_equals_colocated(backend, eager):
    """KVConnector over cuda_ipc (one process: the exporter's tensor directly) or nccl (two ranks
    in one process), fp32 tiny Qwen3 with random weights: decode continues token for token."""
    from splitserve import SamplingParams
    from splitserve.config.engine import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.kv_connector import KVConnector
    from splitserve.model.random_weights import random_model, random_model_config

    cfg = random_model_config("tiny-random")
    devices = ["cuda:0", FETCH_ON]
    models = [random_model(cfg, dev, torch.float32, 256) for dev in devices]
    models[1].model.load_state_dict(models[0].model.state_dict())
    engines, conns = [], []
    for i, loaded in enumerate(models):
        config = EngineConfig(model="tiny-random", device=devices[i], dtype="float32", max_model_len=256,
                              kv_cache_bytes=8 << 20, max_num_seqs=4, progress=False,
                              enforce_eager=eager)  # fmt: skip
        engines.append(LLMEngine(config, tokenizer=None, loaded=loaded))
        options = TransportOptions(lease_s=30, fetch_timeout_s=30)
        conns.append(KVConnector.open(engines[-1], backend, secret=SECRET, options=options))
    p, d = engines
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (7, 40, 70)]
    try:
        for i, prompt in enumerate(prompts):
            p.add_request(prompt, params, request_id=f"r{i}", kv_transfer="export")
        outs = _run(p)
        for i, prompt in enumerate(prompts):
            out = outs[f"r{i}"]
            ex = out.kv_export
            d.add_request_with_kv(ex.handle, prompt, out.outputs[0].token_ids[0], params, f"d{i}",
                                  generator_state=ex.generator_state)  # fmt: skip
        split = _run(d)
        for i, prompt in enumerate(prompts):
            d.add_request(prompt, params, request_id=f"c{i}")
        colocated = _run(d)
        for i in range(len(prompts)):
            assert split[f"d{i}"].outputs[0].token_ids == colocated[f"c{i}"].outputs[0].token_ids
        assert conns[1].transport.describe().counts["fetches"] == len(prompts)
    finally:
        for conn in conns:
            conn.close()
