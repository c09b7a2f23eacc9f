"""The KV connector over a transport: the connector's side of the hooks in kv_transfer_hooks.py.

Life of a disaggregated request (the engine's side is kv_transfer.py):
  Prefill engine P (role "prefill"):
    1. `add_request(prompt, params, kv_transfer="export")`: a normal request with `export_kv` set.
    2. The scheduler prefills it (chunked as usual); the step that completes the prompt samples the
       first token with the request's own params and seeded generator.
    3. If that token ends the request (EOS, stop, max_tokens=1) it finishes as usual: nothing to export.
       Otherwise the engine asks `request_finished(req, block_ids, state)`: the transport leases the
       blocks (`export(request_id, block_ids, num_tokens=len(prompt), state)`) and copies a hybrid
       model's state (over nixl, which registered the state slots, `holds_state`: the engine holds
       the slot with the blocks, and the fetcher READs it); -> the `KVExport` (handle + generator
       state) that the request's final output carries as `kv_transfer`.
    4. When D releases the lease, or nobody claims it within kv_lease_s, the transport calls `on_free`
       on one of its threads, which posts `LeaseEnded` to the engine's inbox: the engine frees them.
  Decode engine D:
    1. The engine builds the request (WAITING_FOR_KV, the seeded generator restored to where P left
       it) and its scheduler reserves the prompt's blocks and a state slot once they are free. A
       handle stamped with another layout (`accepts` False) reserves nothing.
    2. `start_load(load)`: on a fetch thread, pull the payload into the reserved blocks (the first
       contact with P runs the handshake: layout and shared secret), ask P to release in the
       background, on success and on failure alike (P then frees at once rather than at lease
       expiry), and post one `LoadDone` to the engine's inbox. A foreign handle's load fails with
       P's refusal, every difference listed.
    3. The engine joins the request to the batch, or follows the policy (kv_transfer.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from splitserve.engine.kv_transfer import POLICIES, REFUSALS
from splitserve.engine.kv_transfer_hooks import Inbox, KVLoad, LeaseEnded, LoadDone
from splitserve.engine.kv_transfer_types import (
    ImportSpec,
    KVExport,
    KVTransferFailed,
    NoRoom,
    payload_nbytes,
)
from splitserve.engine.request import Request
from splitserve.engine.tp.build import full_model_config
from splitserve.engine.tp.kv_ranks import open_ranks
from splitserve.engine.tp.kv_routes import Sharding
from splitserve.engine.tp.kv_transport import ShardedFetch
from splitserve.engine.tp.rank_reads import fetch_only
from splitserve.engine.tp.read_orders import Reach
from splitserve.model.config import ModelConfig
from splitserve.transport import (
    KVHandle,
    KVLayout,
    KVTransport,
    PeerRefused,
    TransferTimeout,
    TransportOptions,
    make_transport,
)
from splitserve.transport.layout import dtype_name
from splitserve.transport.lease import FreeCallback

if TYPE_CHECKING:
    from splitserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def engine_layout(engine: LLMEngine) -> KVLayout:
    """The layout two engines must share to exchange KV: weights fingerprint, KV and state shapes. At
    tensor_parallel_size > 1, the model's unsharded layout (what engines of every size agree on)."""
    cfg = model_config(engine)
    ckpt = engine.loaded.checkpoint
    if ckpt is not None:
        fingerprint = ckpt.fingerprint()
    else:  # random weights: the config is all there is to compare
        fingerprint = "config:" + hashlib.sha256(repr(cfg).encode()).hexdigest()
    shapes = engine.state_shapes  # the model's recurrent state, and the MTP head's (qwen3_5_mtp.py)
    states = [(name, tuple(shape), dtype_name(dtype)) for name, (shape, dtype) in shapes.items()]
    layout = KVLayout.from_tensor(engine.kv_cache, fingerprint, states)
    size = engine.config.tensor_parallel_size
    return layout if size == 1 else Sharding.of(cfg, size).full_layout(layout, cfg.num_kv_heads)


def model_config(engine: LLMEngine) -> ModelConfig:
    """The unsharded model's config (an engine at tensor_parallel_size > 1 holds a rank's)."""
    if engine.config.tensor_parallel_size == 1:
        return engine.model_config
    return full_model_config(engine.config)


class KVConnector:
    """Joins an engine to a `KVTransport` through the hooks of kv_transfer_hooks.KVConnectorBase. It reads
    and writes the KV cache's bytes (through the transport) but never allocates or frees a block or
    a state slot: it answers through the engine's inbox."""

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        transport: KVTransport | None = None,
        policy: str = "fail",
        fetch_timeout_s: float = 30.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown kv transfer policy {policy!r}; choose one of {POLICIES}")
        self.layout = layout
        self.kv_cache = kv_cache
        self.transport = transport  # set after construction when it needs our on_lease_end
        self.policy = policy
        self.fetch_timeout_s = fetch_timeout_s
        # the transport reads state straight out of (and into) the engine's slots (register_states):
        # an export's slot is then held with its blocks until the lease ends
        self.holds_state = False
        self.counts: Counter[str] = Counter()  # exports, fetches, fetched_bytes, fetch_seconds, ...
        self.failures: Counter[str] = Counter()
        self._inbox: Inbox | None = None
        self._loading = 0  # loads started and not posted yet
        self._lock = threading.Lock()  # guards the counters, written by fetch threads too
        self._fetcher = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-fetch")
        self._releaser = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-release")
        self.sharded: ShardedFetch | None = None  # fetches handles of another tensor-parallel size

    @classmethod
    def open(
        cls,
        engine: LLMEngine,
        backend: str,
        *,
        secret: bytes | str | None = None,
        options: TransportOptions | None = None,
        policy: str = "fail",
        fallback: Sequence[str] = (),
    ) -> KVConnector:
        """A connector over a new transport of `backend` (or of the first usable one of `fallback`,
        logged and counted) for this engine's KV cache, attached to the engine."""
        options = options or TransportOptions()
        conn = cls(engine_layout(engine), engine.kv_cache, None, policy, options.fetch_timeout_s)

        def make(kv: torch.Tensor, layout: KVLayout, on_free: FreeCallback | None) -> KVTransport:
            return make_transport(backend, kv, layout, secret=secret, on_free=on_free, options=options,
                                  fallback=fallback)  # fmt: skip

        def opener(kv: torch.Tensor, layout: KVLayout) -> KVTransport:  # a fetch-only channel
            name = conn.backend_name or backend
            return make_transport(name, kv, layout, secret=secret, options=fetch_only(options))

        if engine.config.tensor_parallel_size > 1:

            def reach() -> Reach:
                return Reach(conn.backend_name or backend, secret, options)

            conn.transport = open_ranks(engine, conn.layout, model_config(engine), make, opener,
                                        conn.on_lease_end, reach)  # fmt: skip
        else:
            conn.transport = make(engine.kv_cache, conn.layout, conn.on_lease_end)
            # a handle from an exporter at tensor_parallel_size > 1: each rank's heads read into our one pool
            conn.sharded = ShardedFetch(
                model_config(engine), conn.layout, engine.kv_cache, conn.transport, 1, opener
            )
            if engine.states.enabled:
                conn.holds_state = conn.transport.register_states(engine.states.states)
        engine.attach_kv_connector(conn)
        return conn

    def bind(self, inbox: Inbox) -> None:
        self._inbox = inbox

    def _post(self, message: object) -> None:
        if self._inbox is None:
            log.error("kv connector: %r dropped, no engine attached", message)
            return
        self._inbox.post(message)

    # ---- prefill side ---------------------------------------------------------------------------

    def check_export(self, kv_transfer: str, n: int) -> None:
        if kv_transfer != "export":
            raise ValueError(f"kv_transfer must be 'export' or None, got {kv_transfer!r}")
        if n != 1:
            raise ValueError("a request with n > 1 cannot be exported (its samples share one prompt)")
        if self.transport is None:
            raise ValueError("this engine's KV connector has no transport")

    def request_finished(
        self, req: Request, block_ids: list[int], state: dict[str, torch.Tensor] | None
    ) -> KVExport:
        """Engine thread, right after the first token: lease the prompt's blocks to the transport."""
        assert self.transport is not None
        try:
            handle = self.transport.export(req.request_id, block_ids, req.num_prompt_tokens, state)
        except Exception:
            self.count("export_errors")
            raise
        gen_state = req.generator.get_state().numpy().tobytes() if req.generator is not None else None
        self.count("exports")
        self.count("exported_blocks", len(block_ids))
        return KVExport(handle, gen_state)

    def on_lease_end(self, block_ids: list[int]) -> None:
        """The transport's on_free, on any thread: tell the engine."""
        self._post(LeaseEnded(tuple(block_ids)))

    # ---- decode side ----------------------------------------------------------------------------

    def accepts(self, handle: KVHandle) -> bool:
        return handle.layout_fingerprint == self.layout.fingerprint

    def start_load(self, load: KVLoad) -> None:
        with self._lock:
            self._loading += 1
        self._fetcher.submit(self._load, load)

    def discard(self, handle: KVHandle) -> None:
        if self.transport is not None:
            self._releaser.submit(self.release, handle)

    def fetch_blocks(
        self, handle: KVHandle, block_ids: Sequence[int], timeout_s: float
    ) -> dict[str, torch.Tensor]:
        """Fetch `handle` into our `block_ids` now, from an exporter of any tensor-parallel size (a
        transport probe's fetch); -> the state tensors."""
        assert self.transport is not None
        if handle.shards and self.sharded is not None:
            return self.sharded.fetch(handle, block_ids, timeout_s)
        return self.transport.fetch(handle, block_ids, timeout_s)

    def release(self, handle: KVHandle) -> None:
        """End the handle's lease(s): every rank's, for an exporter at tensor_parallel_size > 1."""
        assert self.transport is not None
        if handle.shards and self.sharded is not None:
            self.sharded.release(handle)
        else:
            self.transport.release(handle)

    def _load(self, load: KVLoad) -> None:
        """A fetch thread: fill the load's blocks from the exporter, have the lease released, post
        the outcome. Never raises: exactly one `LoadDone` goes to the engine."""
        done = LoadDone(load.request_id, RuntimeError("the load ended without an outcome"))
        try:
            done = self._fetch(load)
        finally:
            with self._lock:
                self._loading -= 1
            self._post(done)

    def _fetch(self, load: KVLoad) -> LoadDone:
        assert self.transport is not None
        handle, left = load.handle, load.deadline - time.monotonic()
        error: BaseException | None = None
        state: dict[str, torch.Tensor] = {}
        nbytes = 0
        if not self.accepts(handle):
            error = self._refusal(handle, max(left, 0.1))
        elif left <= 0:
            error = TransferTimeout("the import deadline passed before the fetch started")
        else:
            start = time.perf_counter()
            try:
                if load.ready is not None:
                    load.ready.synchronize()  # NOTE: the engine's zero_() must not land after the READ
                if handle.shards and self.sharded is not None:
                    state = self.sharded.fetch(handle, load.block_ids, left)
                else:  # (in place into the slot, where the transport reads state so)
                    state = self.transport.fetch(handle, load.block_ids, left, into_state=load.state)
            except Exception as exc:  # noqa: BLE001 - every failure follows the policy
                error = exc
            else:
                nbytes = payload_nbytes(handle, state, self.kv_cache)
                self.count("fetches")
                self.count("fetched_bytes", nbytes)
                self.count("fetch_seconds", time.perf_counter() - start)
        if not isinstance(error, REFUSALS):  # a refused peer would refuse the release too
            self._releaser.submit(self.release, handle)
        return LoadDone(load.request_id, error, state, nbytes)

    # ---- both -----------------------------------------------------------------------------------

    def check_peer(self, address: str, timeout_s: float = 5.0) -> KVLayout:
        """Connect (and handshake) with an exporter now; -> its layout. Raises PeerRefused / AuthError."""
        if self.transport is None:
            raise ValueError("no kv transport: cannot check a peer")
        if self.sharded is not None:  # the exporter may run at another tensor-parallel size
            return self.sharded.check_peer(address, timeout_s)
        return self.transport.check_peer(address, timeout_s)

    def _refusal(self, handle: KVHandle, timeout_s: float) -> BaseException:
        """Why a handle stamped with another layout cannot be fetched: the peer's own refusal, with
        every difference listed, when the handshake fails (it should); else the stamp itself."""
        try:
            self.check_peer(handle.address, timeout_s)
        except REFUSALS as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - unreachable: the stamp still says it all
            log.info("could not ask %s about its layout: %s", handle.address, exc)
        diff = f"layout_fingerprint: ours {self.layout.fingerprint}, handle {handle.layout_fingerprint}"
        return PeerRefused(f"handle {handle.request_id} was made for another KV layout", [diff])

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def count_failure(self, kind: str) -> None:
        with self._lock:
            self.failures[kind] += 1

    @property
    def backend_name(self) -> str | None:
        """The backend the transport actually runs (after any fallback), not the one asked for."""
        return self.transport.stats.backend if self.transport is not None else None  # what describe() says

    def stats(self) -> dict:
        with self._lock:
            counts, failures, loading = dict(self.counts), dict(self.failures), self._loading
        desc = self.transport.describe() if self.transport is not None else None
        return {
            "backend": desc.backend if desc is not None else None,
            "policy": self.policy,
            "importing": loading,  # loads in flight (the engine's stats count those waiting for room too)
            "counts": counts,
            "failures": failures,
            "transport": desc,
        }

    def close(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._releaser.shutdown(wait=True, cancel_futures=False)
        if self.sharded is not None:
            self.sharded.close()
        if self.transport is not None:
            self.transport.close()


__all__ = [
    "POLICIES",
    "ImportSpec",
    "KVConnector",
    "KVExport",
    "KVTransferFailed",
    "NoRoom",
    "engine_layout",
]
