"""The NIXL side of the nixl transport: one agent per transport, its backend, its registered KV, READs.

Life of a `NixlAgent`:
  1. start-up: `NixlAgent(wanted=("LIBFABRIC", "UCX"), ...)` imports NIXL (under either distribution
     name: `nixl` or `nixl_cu12`), makes an agent with no progress thread (NIXL's spins a core) and
     tries each wanted backend in order; the first that instantiates is the one used. Every one that
     failed is kept with NIXL's own error (its exception and what its C++ log wrote to stderr) and,
     where the plugin cannot even be loaded, the loader's reason (`libfabric.so.1: cannot open ...`).
     None instantiated: `BackendUnavailable` with all of that. Before the agent, on a CUDA machine,
     the CUDA 12 runtime that nixl-cu12's UCX links is loaded (`preload_cuda_runtime`, env.py).
  2. `register(kv)`: the whole KV pool once (DRAM for a CPU tensor, VRAM for a CUDA one); a VRAM
     registration that UCX refuses says which library was missing.
  3. exporter: `metadata()` goes to each fetcher over the authenticated channel; while a fetch is
     served, `progress()` is pumped (the exporter's side of UCX's wire-up and of non-RDMA transports).
  4. fetcher: `load_peer(metadata)` once per exporter agent; `read(...)` posts one READ of a descriptor
     list (one descriptor per run of blocks consecutive on both sides) and polls it against the
     deadline and the control connection; -> the backend NIXL used for it (read back per transfer).
     A READ that fails or runs out of time while NIXL still owns it leaves a `PendingRead` on the
     error: its blocks must not be reused before `query()` says it ended.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from splitserve.transport.errors import BackendUnavailable, TransferTimeout, TransportError
from splitserve.transport.frames import Region
from splitserve.transport.nixl.env import (
    CUDART,
    load_nixl,
    plugin_load_error,
    preload_cuda_runtime,
    stderr_captured,
)
from splitserve.transport.protocol import Deadline

log = logging.getLogger(__name__)

POLL_PEER_S = 0.005  # while a READ runs, how often the control connection is checked
_GLOG = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ \S+\] ")  # glog's line prefix
SPIN_S = 0.0005  # a READ is polled without sleeping this long, then in short naps


def region_of(kv: torch.Tensor) -> Region:
    """kv [num_blocks, ...] (contiguous) as a Region."""
    mem = "VRAM" if kv.device.type == "cuda" else "DRAM"
    dev = kv.get_device() if kv.device.type == "cuda" else 0
    nbytes = kv.numel() * kv.element_size()
    return Region(kv.data_ptr(), nbytes, nbytes // kv.shape[0], mem, dev)


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, count) for each run of blocks consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def descriptors(region: Region, starts: Sequence[int], counts: Sequence[int]) -> np.ndarray:
    """Nx3 uint64 (address, length, device) rows of `region`'s blocks [start, start + count)."""
    rows = np.empty((len(starts), 3), dtype=np.uint64)
    rows[:, 0] = region.addr + np.asarray(starts, dtype=np.uint64) * np.uint64(region.block_nbytes)
    rows[:, 1] = np.asarray(counts, dtype=np.uint64) * np.uint64(region.block_nbytes)
    rows[:, 2] = region.dev
    return rows


class PendingRead:
    """A READ that NIXL still owned when the fetch gave up: `query()` is true once it ended (the
    engine holds the blocks back until then, BlockPool.free_after)."""

    def __init__(self, mover: NixlAgent, handle: Any) -> None:
        self.mover = mover
        self.handle = handle

    def query(self) -> bool:
        try:
            if self.mover.agent.check_xfer_state(self.handle) == "PROC":
                return False
        except Exception:  # noqa: BLE001 - an errored READ has ended too
            pass
        with contextlib.suppress(Exception):
            self.mover.agent.release_xfer_handle(self.handle)
        return True


class NixlAgent:
    """One NIXL agent: its backend, the KV pool it registered, the exporters it knows; thread-safe."""

    def __init__(self, name: str, wanted: Sequence[str], ucx_error_mode: str = "peer") -> None:
        if not wanted:
            raise ValueError("nixl needs at least one NIXL backend (transport.nixl_backends)")
        self.nixl, self.module = load_nixl()  # the API module, and the name it was imported by
        self.cudart = preload_cuda_runtime()
        config = self.nixl.nixl_agent_config(
            enable_prog_thread=False,  # NIXL's progress thread polls without sleeping: one core busy
            backends=[],
            sync_mode=self.nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = name
        self.agent = self.nixl.nixl_agent(name, config)
        self.wanted = tuple(wanted)
        self.ucx_error_mode = ucx_error_mode
        self.failed: dict[str, str] = {}
        self.backend = self._instantiate()
        self._regs: list[Any] = []
        self._peers: set[str] = set()
        self._lock = threading.Lock()

    def _instantiate(self) -> str:
        for backend in self.wanted:
            said: list[str] = []
            try:
                with stderr_captured(said):
                    self.agent.create_backend(backend, self._init_params(backend))
                return backend
            except Exception as exc:  # noqa: BLE001 - NIXL raises its own error types (nixlNotFoundError)
                why = f"{type(exc).__name__}({exc})"
                lines = [_GLOG.sub("", line) for text in said for line in text.splitlines() if line.strip()]
                if lines:
                    why += f"; NIXL: {' | '.join(lines)}"
                loader = plugin_load_error(self.nixl, backend)
                if loader:
                    why += f"; its plugin cannot load here: {loader}"
                self.failed[backend] = why
        tried = "; ".join(f"{b}: {w}" for b, w in self.failed.items())
        raise BackendUnavailable(f"nixl: no NIXL backend of {list(self.wanted)} instantiates here: {tried}")

    def _init_params(self, backend: str) -> dict[str, str]:
        """The plugin's own defaults (NIXL replaces them by what it is given), UCX's error mode ours."""
        if backend != "UCX":
            return {}
        try:
            params = {str(k): str(v) for k, v in self.agent.get_plugin_params(backend).items()}
        except Exception:  # noqa: BLE001 - no plugin: create_backend says why
            params = {}
        if "ucx_error_handling_mode" in params or not params:
            params["ucx_error_handling_mode"] = self.ucx_error_mode
        return params

    # -- both sides ------------------------------------------------------------------------------
    def register(self, kv: torch.Tensor) -> Region:
        """Register the whole KV pool with our backend, once; -> how a peer addresses it."""
        if not kv.is_contiguous():
            raise ValueError("nixl registers a contiguous tensor")
        said: list[str] = []
        try:
            with stderr_captured(said):
                self._regs.append(self.agent.register_memory(kv, backends=[self.backend]))
        except Exception as exc:  # noqa: BLE001 - NIXL's own error types
            why = f"nixl: {self.backend} could not register {kv.device} memory: {exc!r} {' '.join(said)}"
            if kv.device.type == "cuda" and self.cudart is None:
                why += f"; UCX's CUDA support needs {CUDART}: pip install --no-deps nvidia-cuda-runtime-cu12"
            raise BackendUnavailable(why) from exc
        return region_of(kv)

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def progress(self) -> None:
        """Let the backend progress (the exporter's side of wire-up, non-RDMA transports)."""
        self.agent.get_new_notifs()

    def close(self) -> None:
        with self._lock:
            peers, self._peers = self._peers, set()
        for peer in peers:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(peer)
        for reg in self._regs:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg, backends=[self.backend])
        self._regs.clear()

    # -- fetcher side ----------------------------------------------------------------------------
    def knows(self, peer: str) -> bool:
        with self._lock:
            return peer in self._peers

    def load_peer(self, metadata: bytes) -> str:
        """Load an exporter agent's metadata (connection info + memory keys); -> its name."""
        with self._lock:
            try:
                name = self.agent.add_remote_agent(metadata)
            except Exception as exc:  # noqa: BLE001
                raise TransportError(f"nixl: could not load the exporter's agent metadata: {exc!r}") from exc
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers.add(name)
            return name

    def read(
        self,
        peer: str,
        local: np.ndarray,
        local_mem: str,
        remote: np.ndarray,
        remote_mem: str,
        deadline: Deadline,
        peer_alive: Callable[[], bool],
    ) -> str:
        """READ remote rows into local rows (Nx3 each, pairwise equal lengths); -> the backend used."""
        agent = self.agent
        try:
            handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, local_mem), agent.get_xfer_descs(remote, remote_mem),
                peer, backends=[self.backend],
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            raise TransportError(f"nixl: could not prepare a READ from {peer}: {exc!r}") from exc
        try:
            self._wait(handle, peer, deadline, peer_alive)
        except TransportError as exc:
            exc.pending = self._settle(handle)
            raise
        used = agent.query_xfer_backend(handle)
        with contextlib.suppress(Exception):
            agent.release_xfer_handle(handle)
        return str(used)

    def _wait(self, handle: Any, peer: str, deadline: Deadline, peer_alive: Callable[[], bool]) -> None:
        agent = self.agent
        try:
            state = agent.transfer(handle)
            start = checked = time.monotonic()
            while state == "PROC":
                now = time.monotonic()
                if now >= deadline.at:
                    raise TransferTimeout(
                        f"nixl READ from {peer}: deadline of {deadline.total_s:.3g}s passed"
                    )
                if now - checked >= POLL_PEER_S:
                    checked = now
                    if not peer_alive():
                        raise TransportError(f"nixl READ from {peer}: the exporter hung up mid-transfer")
                if now - start > SPIN_S:
                    time.sleep(0.00005)
                state = agent.check_xfer_state(handle)
        except TransportError:
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL's errors (nixlRemoteDisconnectError, ...)
            raise TransportError(f"nixl READ from {peer} failed: {exc!r}") from exc
        if state != "DONE":
            raise TransportError(f"nixl READ from {peer} ended in state {state}")

    def _settle(self, handle: Any) -> PendingRead | None:
        """After a failed READ: release it if NIXL lets go of it now, else the pending one."""
        pending = PendingRead(self, handle)
        try:
            self.agent.release_xfer_handle(handle)
            return None
        except Exception:  # noqa: BLE001 - still in flight and not cancellable yet
            log.warning("nixl: a failed READ is still in flight; its blocks are held until it ends")
            return pending
