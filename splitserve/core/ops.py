"""The worker operations an engine core answers (wire/ops.py: one struct per operation and per answer):
health, stats, the KV probe (real blocks over the real transport), releasing an export, checking a
peer, fault injection.

Each runs on the engine's thread between steps, except those that block on the network
(`check_peer`, the probe's fetch), which run on a call thread and hop onto the engine's thread
(`EngineCore.on_loop`) for what touches the engine. Every reply is one `Reply` event. The engine is
read through `LLMEngine.stats()` and its blocks borrowed through `lease_blocks` / `release_blocks`;
nothing here touches its pool, scheduler, state slots or KV cache.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from splitserve.core.errors import error_info
from splitserve.startup_clock import marks
from splitserve.wire import core as wire
from splitserve.wire import ops, stats
from splitserve.wire.kv_handle import KVExport
from splitserve.wire.stats import EngineSettings, Health, WorkerStats

if TYPE_CHECKING:
    from splitserve.config.engine import EngineConfig
    from splitserve.config.worker import WorkerConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.kv_connector import KVConnector
    from splitserve.engine.stats import EngineStats


class Core(Protocol):
    """What the operations use of their engine core (loop.py's EngineCore)."""

    engine: LLMEngine
    config: WorkerConfig
    connector: KVConnector | None
    kv_address: str | None
    events: list[wire.Event]
    busy_seconds: float
    call_pool: ThreadPoolExecutor

    def on_loop(self, fn: Callable[[], Any], timeout_s: float = 60.0) -> Any: ...

    def on_loop_nowait(self, fn: Callable[[], Any]) -> None: ...


class RoleError(ValueError):
    """An operation this worker's role does not serve."""


class CoreOps:
    """Runs the operations of wire/ops.py: each `op_*` method takes its operation's struct and returns
    its `Result`."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.engine = core.engine
        self.config = core.config
        self._probes = 0
        # per operation: its method, and whether it blocks on the network (then it runs on a call thread)
        self._table: dict[type, tuple[Callable[[Any], ops.OpResult], bool]] = {
            ops.GetStats: (self.op_stats, False),
            ops.Release: (self.op_release, False),
            ops.ProbeExport: (self.op_probe_export, False),
            ops.SetFaults: (self.op_set_faults, False),
            ops.CheckPeer: (self.op_check_peer, True),
            ops.Probe: (self.op_probe, True),
        }

    def call(self, op: ops.Op) -> None:
        """Engine thread: run `op` (on a call thread if it blocks); its reply joins a later batch."""
        fn, blocking = self._table[type(op)]

        def run() -> wire.Reply:
            try:
                return wire.Reply(op.call_id, fn(op))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                return wire.Reply(op.call_id, error=error_info(exc))

        if not blocking:
            self.core.events.append(run())
            return

        def done(fut: Any) -> None:
            self.core.on_loop_nowait(lambda: self.core.events.append(fut.result()))

        self.core.call_pool.submit(run).add_done_callback(done)

    def _need(self, role: str) -> None:
        if self.config.role != role:
            raise RoleError(f"this is a {self.config.role} worker: only a {role} worker serves that")

    # ---- on the engine thread --------------------------------------------------------------------

    def health(self) -> Health:
        conn, engine = self.core.connector, self.engine
        desc = conn.transport.describe() if conn and conn.transport else None
        st = engine.stats()
        return Health(
            status="ok", role=self.config.role, model=str(engine.model_path),
            tokenizer=self.config.engine.tokenizer, core_pid=os.getpid(), kv_backend=desc and desc.backend,
            kv_address=self.core.kv_address, layout_fingerprint=desc and desc.layout_fingerprint,
            kv_requested=desc and desc.requested, max_model_len=engine.max_model_len,
            block_bytes=st.block_bytes, num_blocks=st.blocks.total,
            vocab_size=engine.model_config.vocab_size, device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."),
            load=engine.loaded.load_stats,  # weights: method, cache status, seconds per stage
            startup=marks(),  # this process's age at the end of each start-up phase
            engine=engine_settings(engine.config, st, engine.scheduler.max_num_batched_tokens),
        )  # fmt: skip

    def op_stats(self, _: ops.GetStats) -> WorkerStats:
        engine, conn, core = self.engine, self.core.connector, self.core
        st = engine.stats()
        ckpt = st.state_checkpoints
        spec = st.spec_decode
        return WorkerStats(
            role=self.config.role, running=st.running, waiting=st.waiting, importing=st.waiting_for_kv,
            unfinished=st.unfinished,
            blocks=stats.BlockCounts(st.blocks.total, st.blocks.free, st.blocks.held),
            state_slots=stats.SlotCounts(st.state_slots_total, st.state_slots_free),
            preemptions=st.preemptions,
            # model steps by tokens run, in vLLM's iteration_tokens buckets (engine/stats.py)
            iteration_tokens=stats.IterationTokens(list(st.step_tokens.counts), st.step_tokens.total),
            block_size=engine.block_size, prompt_tokens_computed=st.prompt_tokens_computed,
            kv_bytes_per_token=st.block_bytes // engine.block_size,
            steps=stats.StepCounts(st.forward_steps, st.overlapped_steps, st.step_seconds, core.busy_seconds),
            # CPU: its own threads, its last step's, steps on lent cores (core/policy.py)
            threads=stats.ThreadCounts(self.config.threads, core.policy.threads, core.policy.borrowed_steps,
                                       core.policy.paced_steps),
            prefix_cache=stats.PrefixCacheCounts(
                st.prefix_caching, st.prefix_queries, st.prefix_hits,
                None if ckpt is None else stats.CheckpointCounts(ckpt.entries, ckpt.capacity, ckpt.saved,
                                                                 ckpt.restored),
            ),
            kv_transfer=_kv_transfer(conn, st.waiting_for_kv),
            memory=_memory(engine),
            spec_decode=None if spec is None else stats.SpecDecodeCounts(
                spec.method, spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                tuple(spec.accepted_per_pos), spec.num_first_step_drafts, spec.num_head_lost),
        )  # fmt: skip

    def op_release(self, op: ops.Release) -> ops.Ok:
        """Prefill side: end an export's lease now (its blocks come back at once)."""
        self._need("prefill")
        conn = self.core.connector
        assert conn is not None and conn.transport is not None
        handle = op.kv_export.handle
        if handle.address != self.core.kv_address:
            raise ValueError(f"handle {handle.request_id} was exported by {handle.address}, not by us")
        conn.transport.release(handle)
        self.engine.free_released_kv()
        return ops.Ok()

    def op_probe_export(self, op: ops.ProbeExport) -> ops.ProbeExported:
        """Prefill side: lease `num_blocks` free blocks (their bytes as they are) as a probe export;
        they come back when its lease ends, as an export's do."""
        self._need("prefill")
        conn, engine = self.core.connector, self.engine
        assert conn is not None and conn.transport is not None
        lease = engine.lease_blocks(op.num_blocks)
        self._probes += 1
        try:
            handle = conn.transport.export(f"probe-{os.getpid()}-{self._probes}", lease.block_ids,
                                           lease.num_tokens, lease.state)  # fmt: skip
        except Exception:
            engine.release_blocks(lease)
            raise
        return ops.ProbeExported(KVExport(handle))

    def op_set_faults(self, op: ops.SetFaults) -> ops.FaultsSet:
        """Test-only: make this exporter drop / delay / corrupt / kill the fetches it serves."""
        from splitserve.transport.fault_plan import FaultPlan

        conn = self.core.connector
        transport = conn.transport if conn else None
        if not self.config.fault_injection or transport is None:
            raise RoleError("fault injection is off: start the worker with --enable-fault-injection")
        k = op.knobs
        active = any((k.drop, k.delay, k.corrupt, k.kill))
        transport.install_faults(FaultPlan(k) if active else None)
        return ops.FaultsSet(k if active else None)

    # ---- on a call thread ------------------------------------------------------------------------

    def op_check_peer(self, op: ops.CheckPeer) -> ops.PeerChecked:
        """Handshake with an exporter now (decode side); raises PeerRefused / AuthError on a bad pair."""
        conn = self.core.connector
        if conn is None:
            raise RoleError("a colocated worker has no KV transport")
        peer = conn.check_peer(op.address, op.timeout_s)
        layout = None if peer is None else msgspec.convert(msgspec.to_builtins(peer), ops.KVLayoutInfo)
        return ops.PeerChecked(True, op.address, layout)

    def op_probe(self, op: ops.Probe) -> ops.ProbeResult:
        """Decode side: fetch a probe export into free blocks, time it, give everything back."""
        self._need("decode")
        conn, engine = self.core.connector, self.engine
        assert conn is not None and conn.transport is not None
        handle = op.kv_export.handle
        # touched first: the probe measures the transport, not page faults
        lease = self.core.on_loop(lambda: engine.lease_blocks(handle.num_blocks, touch=True))
        start = time.perf_counter()
        try:
            conn.fetch_blocks(handle, lease.block_ids, op.timeout_s)  # from every rank of the exporter
            seconds = time.perf_counter() - start
        finally:
            self.core.on_loop_nowait(lambda: engine.release_blocks(lease))
            conn.release(handle)
        nbytes = lease.nbytes
        return ops.ProbeResult(nbytes, seconds, nbytes / seconds / 1e9, handle.num_blocks, conn.backend_name,
                               handle.address)  # fmt: skip


def _kv_transfer(conn: KVConnector | None, importing: int) -> stats.KVTransferCounts | None:
    """The connector's counters; `importing`: the engine's imports not yet joined (waiting for room too)."""
    if conn is None:
        return None
    c = conn.stats()
    return stats.KVTransferCounts(c["backend"], c["policy"], importing, c["counts"], c["failures"],
                                  c["transport"])  # fmt: skip


def _memory(engine: Any) -> stats.MemoryBytes | None:
    """CUDA: the worker's memory plan (bytes, engine/memory_plan.py) and what torch holds now and at peak."""
    plan = engine.memory_plan
    if plan is None:
        return None
    import torch

    dev = engine.device
    return stats.MemoryBytes(**plan.as_dict(), torch_reserved=torch.cuda.memory_reserved(dev),
                             torch_peak_reserved=torch.cuda.max_memory_reserved(dev))  # fmt: skip


def engine_settings(c: EngineConfig, st: EngineStats, batched_tokens: int) -> EngineSettings:
    """The knobs the engine runs with (prefix caching as in effect: off without state checkpoints;
    `batched_tokens`: the step budget as resolved for the device)."""
    return EngineSettings(
        block_size=c.block_size, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=batched_tokens,
        gpu_memory_utilization=c.gpu_memory_utilization, kv_cache_bytes=c.kv_cache_bytes,
        enable_prefix_caching=st.prefix_caching, enforce_eager=c.enforce_eager, seed=c.seed,
        tokenizer=c.tokenizer,
    )  # fmt: skip
