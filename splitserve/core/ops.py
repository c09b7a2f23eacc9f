"""The worker operations an engine core answers (`Call` on the channel): health, stats, the KV probe
(real blocks over the real transport), releasing an export, checking a peer, fault injection.

Each runs on the engine's thread between steps, except those that block on the network
(`check_peer`, the probe's fetch), which run on a call thread and hop onto the engine's thread
(`EngineCore.on_loop`) for what touches the engine. Every reply is one `Reply` event. The engine is
read through `LLMEngine.stats()` and its blocks borrowed through `lease_blocks` / `release_blocks`;
nothing here touches its pool, scheduler, state slots or KV cache.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from splitserve.core.errors import error_info
from splitserve.startup_clock import marks
from splitserve.wire import core as wire

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
    BLOCKING = frozenset({"check_peer", "probe"})

    def __init__(self, core: Core) -> None:
        self.core = core
        self.engine = core.engine
        self.config = core.config
        self._probes = 0

    def call(self, cmd: wire.Call) -> None:
        """Engine thread: run `cmd` (on a call thread if it blocks); its reply joins a later batch."""
        fn = getattr(self, f"op_{cmd.method}", None)
        if fn is None:
            err = wire.ErrorInfo(400, "invalid_request", f"no such call {cmd.method!r}")
            self.core.events.append(wire.Reply(cmd.call_id, error=err))
            return
        if cmd.method not in self.BLOCKING:
            try:
                self.core.events.append(wire.Reply(cmd.call_id, fn(**cmd.args)))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self.core.events.append(wire.Reply(cmd.call_id, error=error_info(exc)))
            return

        def run() -> wire.Reply:
            try:
                return wire.Reply(cmd.call_id, fn(**cmd.args))
            except Exception as exc:  # noqa: BLE001
                return wire.Reply(cmd.call_id, error=error_info(exc))

        def done(fut: Any) -> None:
            self.core.on_loop_nowait(lambda: self.core.events.append(fut.result()))

        self.core.call_pool.submit(run).add_done_callback(done)

    def _need(self, role: str) -> None:
        if self.config.role != role:
            raise RoleError(f"this is a {self.config.role} worker: only a {role} worker serves that")

    # ---- on the engine thread --------------------------------------------------------------------

    def health(self) -> dict:
        conn, engine = self.core.connector, self.engine
        desc = conn.transport.describe() if conn and conn.transport else {}
        stats = engine.stats()
        return {
            "status": "ok",
            "role": self.config.role,
            "model": engine.model_path,
            "tokenizer": self.config.engine.tokenizer,
            "core_pid": os.getpid(),
            "kv_backend": desc.get("backend"),
            "kv_address": self.core.kv_address,
            "layout_fingerprint": desc.get("layout_fingerprint"),
            "kv_requested": desc.get("requested"),
            "max_model_len": engine.max_model_len,
            "block_bytes": stats.block_bytes,
            "num_blocks": stats.blocks.total,
            "vocab_size": engine.model_config.vocab_size,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "load": engine.loaded.load_stats,  # weights: method, cache status, seconds per stage
            "startup": marks(),  # this process's age at the end of each start-up phase
            "engine": engine_settings(engine.config, stats, engine.scheduler.max_num_batched_tokens),
        }

    def op_stats(self) -> dict:
        engine, conn = self.engine, self.core.connector
        st = engine.stats()
        ckpt = dataclasses.asdict(st.state_checkpoints) if st.state_checkpoints else None
        return {
            "role": self.config.role,
            "running": st.running,
            "waiting": st.waiting,
            "importing": st.waiting_for_kv,
            "unfinished": st.unfinished,
            "blocks": {"total": st.blocks.total, "free": st.blocks.free, "held": st.blocks.held},
            "state_slots": {"total": st.state_slots_total, "free": st.state_slots_free},
            "preemptions": st.preemptions,
            # model steps by tokens run, in vLLM's iteration_tokens buckets (engine/stats.py)
            "iteration_tokens": {"counts": st.step_tokens.counts, "sum": st.step_tokens.total},
            "prompt_tokens_computed": st.prompt_tokens_computed,
            "kv_bytes_per_token": st.block_bytes // engine.block_size,
            "steps": {
                "forward": st.forward_steps,
                "overlapped": st.overlapped_steps,
                "step_s": st.step_seconds,
                "loop_s": self.core.busy_seconds,
            },  # fmt: skip
            "threads": {  # CPU: its own, its last step's, steps on lent cores (core/policy.py)
                "own": self.config.threads,
                "now": self.core.policy.threads,
                "borrowed_steps": self.core.policy.borrowed_steps,
                "paced_steps": self.core.policy.paced_steps,
            },
            "prefix_cache": {
                "queries": st.prefix_queries,
                "hits": st.prefix_hits,
                "state_checkpoints": ckpt,
            },
            "kv_transfer": {**conn.stats(), "importing": st.waiting_for_kv} if conn else None,
            "memory": _memory(engine),
            "spec_decode": dataclasses.asdict(st.spec_decode) if st.spec_decode is not None else None,
        }

    def op_release(self, kv_export: dict) -> dict:
        """Prefill side: end an export's lease now (its blocks come back at once)."""
        from splitserve.engine.kv_transfer_types import KVExport

        self._need("prefill")
        conn = self.core.connector
        assert conn is not None and conn.transport is not None
        handle = KVExport.from_dict(kv_export).handle
        if handle.address != self.core.kv_address:
            raise ValueError(f"handle {handle.request_id} was exported by {handle.address}, not by us")
        conn.transport.release(handle)
        self.engine.free_released_kv()
        return {"ok": True}

    def op_probe_export(self, num_blocks: int) -> dict:
        """Prefill side: lease `num_blocks` free blocks (their bytes as they are) as a probe export;
        they come back when its lease ends, as an export's do."""
        from splitserve.engine.kv_transfer_types import KVExport

        self._need("prefill")
        conn, engine = self.core.connector, self.engine
        assert conn is not None and conn.transport is not None
        lease = engine.lease_blocks(num_blocks)
        self._probes += 1
        try:
            handle = conn.transport.export(f"probe-{os.getpid()}-{self._probes}", lease.block_ids,
                                           lease.num_tokens, lease.state)  # fmt: skip
        except Exception:
            engine.release_blocks(lease)
            raise
        return {"kv_export": KVExport(handle).to_dict()}

    def op_set_faults(self, **knobs: Any) -> dict:
        """Test-only: make this exporter drop / delay / corrupt / kill the fetches it serves."""
        from splitserve.transport.fault_plan import FaultKnobs, FaultPlan

        conn = self.core.connector
        transport = conn.transport if conn else None
        if not self.config.fault_injection or transport is None:
            raise RoleError("fault injection is off: start the worker with --enable-fault-injection")
        k = FaultKnobs(**knobs)
        active = any((k.drop, k.delay, k.corrupt, k.kill))
        transport.install_faults(FaultPlan(k) if active else None)
        return {"faults": dataclasses.asdict(k) if active else None}

    # ---- on a call thread ------------------------------------------------------------------------

    def op_check_peer(self, address: str, timeout_s: float) -> dict:
        """Handshake with an exporter now (decode side); raises PeerRefused / AuthError on a bad pair."""
        conn = self.core.connector
        if conn is None:
            raise RoleError("a colocated worker has no KV transport")
        peer = conn.check_peer(address, timeout_s)
        return {"ok": True, "address": address, "peer_layout": peer.to_dict() if peer else None}

    def op_probe(self, kv_export: dict, timeout_s: float) -> dict:
        """Decode side: fetch a probe export into free blocks, time it, give everything back."""
        from splitserve.engine.kv_transfer_types import KVExport

        self._need("decode")
        conn, engine = self.core.connector, self.engine
        assert conn is not None and conn.transport is not None
        handle = KVExport.from_dict(kv_export).handle
        # touched first: the probe measures the transport, not page faults
        lease = self.core.on_loop(lambda: engine.lease_blocks(handle.num_blocks, touch=True))
        start = time.perf_counter()
        try:
            conn.transport.fetch(handle, lease.block_ids, timeout_s)
            seconds = time.perf_counter() - start
        finally:
            self.core.on_loop_nowait(lambda: engine.release_blocks(lease))
            conn.transport.release(handle)
        nbytes = lease.nbytes
        return {
            "bytes": nbytes,
            "seconds": seconds,
            "gbps": nbytes / seconds / 1e9,
            "blocks": handle.num_blocks,
            "backend": conn.backend_name,
            "peer": handle.address,
        }


def _memory(engine: Any) -> dict | None:
    """CUDA: the worker's memory plan (bytes, engine/memory_plan.py) and what torch holds now and at peak."""
    plan = engine.memory_plan
    if plan is None:
        return None
    import torch

    dev = engine.device
    return {**plan.as_dict(), "torch_reserved": torch.cuda.memory_reserved(dev),
            "torch_peak_reserved": torch.cuda.max_memory_reserved(dev)}  # fmt: skip


def engine_settings(c: EngineConfig, stats: EngineStats, batched_tokens: int) -> dict:
    """The knobs the engine runs with (prefix caching as in effect: off without state checkpoints;
    `batched_tokens`: the step budget as resolved for the device)."""
    return {
        "block_size": c.block_size,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": batched_tokens,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "kv_cache_bytes": c.kv_cache_bytes,
        "enable_prefix_caching": stats.prefix_caching,
        "enforce_eager": c.enforce_eager,
        "seed": c.seed,
        "tokenizer": c.tokenizer,
    }
