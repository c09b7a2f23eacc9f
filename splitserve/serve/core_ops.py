"""The worker operations an engine core answers (`Call` on the channel): health, stats, the KV probe
(real blocks over the real transport), releasing an export, checking a peer, fault injection.

Each runs on the engine's thread between steps, except those that block on the network
(`check_peer`, the probe's fetch), which run on a call thread and hop onto the engine's thread
(`EngineCore.on_loop`) for what touches the engine. Every reply is one `Reply` event.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from splitserve.serve import core_protocol as wire
from splitserve.serve.core_errors import error_info

if TYPE_CHECKING:
    from splitserve.engine.disagg import KVConnector
    from splitserve.engine.engine import LLMEngine
    from splitserve.serve.worker_config import WorkerConfig


class Core(Protocol):
    """What the operations use of their engine core (core.py's EngineCore)."""

    engine: LLMEngine
    config: WorkerConfig
    connector: KVConnector | None
    kv_address: str | None
    imports: dict[str, Any]
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
            "block_bytes": engine.kv[0].numel() * engine.kv.element_size(),
            "num_blocks": engine.pool.num_blocks,
            "vocab_size": engine.model_config.vocab_size,
            "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "load": engine.loaded.load_stats,  # weights: method, cache status, seconds per stage
            "engine": engine_settings(engine),
        }

    def op_stats(self) -> dict:
        engine, conn = self.engine, self.core.connector
        sched = engine.scheduler
        engine.free_released_kv()
        return {
            "role": self.config.role,
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "importing": len(self.core.imports),
            "unfinished": engine.num_unfinished_requests,
            "blocks": {
                "total": engine.pool.num_blocks,
                "free": engine.pool.num_free,
                "held": engine.pool.num_held,  # freed, but a late KV copy may still write them
            },
            "state_slots": {"total": engine.states.num_slots, "free": engine.states.num_free},
            "preemptions": engine.scheduler.num_preemptions,
            "steps": {
                "forward": engine.forward_steps,
                "overlapped": engine.overlapped_steps,
                "step_s": engine.step_seconds,
                "loop_s": self.core.busy_seconds,
            },  # fmt: skip
            "prefix_cache": {
                "queries": sched.prefix_queries,
                "hits": sched.prefix_hits,
                "state_checkpoints": _checkpoint_stats(sched.kv.checkpoints),
            },
            "kv_transfer": conn.stats() if conn else None,
        }

    def op_release(self, kv: dict) -> dict:
        """Prefill side: end an export's lease now (its blocks come back at once)."""
        from splitserve.engine.disagg import KVExport

        self._need("prefill")
        conn = self.core.connector
        assert conn is not None and conn.transport is not None
        handle = KVExport.from_dict(kv).handle
        if handle.address != self.core.kv_address:
            raise ValueError(f"handle {handle.request_id} was exported by {handle.address}, not by us")
        conn.transport.release(handle)
        self.engine.free_released_kv()
        return {"ok": True}

    def op_probe_export(self, num_blocks: int) -> dict:
        """Prefill side: lease `num_blocks` free blocks (their bytes as they are) as a probe export."""
        from splitserve.engine.disagg import KVExport, NoRoom

        self._need("prefill")
        conn, engine = self.core.connector, self.engine
        assert conn is not None and conn.transport is not None
        engine.free_released_kv()
        if engine.pool.num_free < num_blocks:
            raise NoRoom(f"only {engine.pool.num_free} free blocks for a {num_blocks}-block probe")
        ids = engine.pool.allocate(num_blocks)
        state = {name: t[0].clone() for name, t in engine.states.states.items()} or None
        self._probes += 1
        try:
            handle = conn.transport.export(f"probe-{os.getpid()}-{self._probes}", ids,
                                           num_blocks * engine.block_size, state)  # fmt: skip
        except Exception:
            engine.pool.free(ids)
            raise
        return {"kv": KVExport(handle).to_dict()}

    def op_set_faults(self, **knobs: Any) -> dict:
        """Test-only: make this exporter drop / delay / corrupt / kill the fetches it serves."""
        from splitserve.kv.fault_plan import FaultKnobs, FaultPlan

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

    def op_probe(self, kv: dict, timeout_s: float) -> dict:
        """Decode side: fetch a probe export into free blocks, time it, give everything back."""
        from splitserve.engine.disagg import KVExport, NoRoom

        self._need("decode")
        conn, engine = self.core.connector, self.engine
        assert conn is not None and conn.transport is not None
        handle = KVExport.from_dict(kv).handle

        def reserve() -> list[int]:
            if engine.pool.num_free < handle.num_blocks:
                raise NoRoom(f"only {engine.pool.num_free} free blocks for a {handle.num_blocks}-block probe")
            ids = engine.pool.allocate(handle.num_blocks)
            for i in ids:  # touch the pages first: the probe measures the transport, not page faults
                engine.kv[i].zero_()
            return ids

        ids = self.core.on_loop(reserve)
        start = time.perf_counter()
        try:
            conn.transport.fetch(handle, ids, timeout_s)
            seconds = time.perf_counter() - start
        finally:
            self.core.on_loop_nowait(lambda: engine.pool.free(ids))
            conn.transport.release(handle)
        nbytes = handle.num_blocks * engine.kv[0].numel() * engine.kv.element_size()
        return {
            "bytes": nbytes,
            "seconds": seconds,
            "gbps": nbytes / seconds / 1e9,
            "blocks": handle.num_blocks,
            "backend": conn.backend_name,
            "peer": handle.address,
        }


def engine_settings(engine: Any) -> dict:
    """The knobs the engine runs with (prefix caching as in effect: off without state checkpoints)."""
    c = engine.config
    return {
        "block_size": c.block_size,
        "max_num_seqs": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "kv_cache_bytes": c.kv_cache_bytes,
        "enable_prefix_caching": engine.pool.enable_prefix_caching,
        "enforce_eager": c.enforce_eager,
        "seed": c.seed,
        "tokenizer": c.tokenizer,
    }


def _checkpoint_stats(ckpt: Any) -> dict | None:
    """Hybrid models' prefix caching (engine/state_cache.py): entries held, saved and restored."""
    if ckpt is None:
        return None
    return {
        "entries": len(ckpt),
        "capacity": ckpt.num_entries,
        "saved": ckpt.saved,
        "restored": ckpt.restored,
    }
