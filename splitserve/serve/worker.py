"""The worker service: one engine in one process, in a role, reached over HTTP (worker_app.py).

    python -m splitserve.serve.worker --role prefill --model PATH --port 0 --kv-backend tcp \
        --kv-secret-env SPLITSERVE_KV_SECRET

prints one JSON line `{"event": "ready", "url": ..., "kv_address": ..., ...}` once it serves (ports
come from the OS), then logs to stderr.

Roles and the life of a disaggregated request through two workers (a router, issue 4, drives it):
  1. prefill worker, POST /prefill {prompt_token_ids, sampling_params}: the engine runs the prompt,
     samples the first token, leases the blocks (and hybrid state) to the KV transport, and answers
     {first_token, kv: {handle, generator_state}}. Unclaimed, the lease ends after --kv-lease-s.
  2. decode worker, POST /decode {prompt_token_ids, first_token, kv, sampling_params}: reserves blocks,
     fetches (the transport's handshake checks the layout and the shared secret on first contact),
     has the prefill lease released, joins the batch and streams NDJSON lines from the first token on.
     A failed fetch follows --kv-policy (or the body's kv_policy): "fail" answers an HTTP error
     before any line; "recompute" recomputes the prompt here and streams the same tokens.
  colocated worker: POST /generate only (every role serves /generate: a whole request on one engine).
All roles: POST /abort, GET /health, GET /stats (queues, free blocks and state slots, KV counters).
KV plumbing: POST /kv/connect (decode: handshake with a prefill worker now, to check a pair),
POST /kv/release (prefill: end an export's lease now), POST /debug/faults (--enable-fault-injection).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from splitserve.engine.async_engine import AsyncLLM
from splitserve.engine.config import EngineConfig
from splitserve.engine.disagg import ImportSpec, KVConnector, KVExport, NoRoom
from splitserve.engine.disagg_async import AsyncKVImporter
from splitserve.engine.engine import LLMEngine
from splitserve.kv import TransportError, TransportOptions
from splitserve.kv.faults import FaultKnobs, FaultPlan
from splitserve.model.errors import ModelLoadError
from splitserve.serve.schemas import (
    DecodeRequest,
    FaultsRequest,
    GenerateRequest,
    LineMaker,
    PrefillRequest,
    PrefillResponse,
    StreamLine,
    logprob_from_dict,
    logprob_to_dict,
    request_timings,
    sampling_params,
)
from splitserve.serve.worker_auth import worker_headers, worker_token  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


class RoleError(ValueError):
    """An endpoint this worker's role does not serve."""


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "colocated"
    model: str | None = None
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_mb: int | None = None  # None: the engine's default budget
    gpu_memory_utilization: float | None = None  # CUDA: fraction for weights + KV (None: the engine's)
    seed: int = 0
    weight_cache_dir: str | None = "auto"
    weight_cache_max_gb: float | None = 64.0
    weight_cache_verify: bool = True
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    async_scheduling: bool | None = None  # overlapped decode steps; None: on for CUDA
    kv_backend: str = "tcp"
    kv_fallback: tuple[str, ...] = ()  # backends allowed if kv_backend cannot run (logged, counted)
    kv_secret: str | None = dataclasses.field(default=None, repr=False)
    kv_host: str = "127.0.0.1"
    kv_lease_s: float = 30.0
    kv_fetch_timeout_s: float = 30.0
    kv_policy: str = "fail"
    kv_checksum: str | None = None
    fault_injection: bool = False
    kv_throttle_gbps: float | None = None  # test hook: hold every fetch to this bandwidth
    http_auth: bool = False  # every endpoint but GET /health wants `Bearer worker_token(kv_secret)`

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose one of {ROLES}")
        if self.http_auth and not self.kv_secret:
            raise ValueError("http_auth needs the deployment's secret (kv_secret) to derive its token")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            device=self.device,
            dtype=self.dtype,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv_cache_bytes=None if self.kv_cache_mb is None else self.kv_cache_mb << 20,
            **(
                {}
                if self.gpu_memory_utilization is None
                else {"gpu_memory_utilization": self.gpu_memory_utilization}
            ),
            seed=self.seed,
            progress=False,
            weight_cache_dir=self.weight_cache_dir,
            weight_cache_max_gb=self.weight_cache_max_gb,
            weight_cache_verify=self.weight_cache_verify,
            enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling,
            # the exporter's cache in a memfd: shm fetchers copy straight out of it (kv/shm_direct.py)
            kv_shared_memory=self.role == "prefill" and "shm" in (self.kv_backend, *self.kv_fallback),
        )

    def transport_options(self) -> TransportOptions:
        return TransportOptions(
            host=self.kv_host,
            lease_s=self.kv_lease_s,
            fetch_timeout_s=self.kv_fetch_timeout_s,
            checksum=self.kv_checksum,
        )


class Worker:
    """prefill / decode / generate / abort / health / stats over one engine (the same class a Ray
    deployment would wrap)."""

    def __init__(self, config: WorkerConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        engine = engine or LLMEngine(config.engine_config())
        capacity = engine.pool.num_blocks * engine.block_size
        if capacity < engine.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({engine.pool.num_blocks} blocks of "
                f"{engine.block_size}), fewer than max_model_len ({engine.max_model_len}): a long request "
                "could never run. Give the worker more KV cache (--kv-cache-mb / engine.kv_cache_mb) or "
                "lower max_model_len"
            )
        self.connector: KVConnector | None = None
        self.kv_address: str | None = None
        if config.role != "colocated":
            self.connector = KVConnector.open(
                engine, config.kv_backend, secret=config.kv_secret,
                options=config.transport_options(), policy=config.kv_policy, fallback=config.kv_fallback,
            )  # fmt: skip
            if config.role == "prefill":
                self.kv_address = self.connector.transport.listen()  # type: ignore[union-attr]
            if config.kv_throttle_gbps:
                from splitserve.kv.throttle import ThrottledTransport

                log.warning("kv fetches throttled to %.3f GB/s (a test hook)", config.kv_throttle_gbps)
                self.connector.transport = ThrottledTransport(
                    self.connector.transport, config.kv_throttle_gbps
                )
        self.llm = AsyncLLM(engine)
        self.importer = AsyncKVImporter(self.llm, self.connector) if config.role == "decode" else None
        self._ids = itertools.count()
        self._tag = secrets.token_hex(4)  # request ids unique across workers: decode keeps them

    @property
    def engine(self) -> LLMEngine:
        return self.llm.engine

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{self._tag}-{next(self._ids)}"

    def _need(self, role: str) -> None:
        if self.config.role != role:
            raise RoleError(f"this is a {self.config.role} worker: only a {role} worker serves that")

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        self._need("prefill")
        params = sampling_params(req.sampling_params)
        rid = req.request_id or self._new_id("pf")
        start, last = time.perf_counter(), None
        async for out in self.llm.generate(req.prompt_input(), params, rid, kv_transfer="export"):
            last = out
        assert last is not None and last.finished
        comp = last.outputs[0]
        if comp.finish_reason == "error":
            raise RuntimeError(f"prefill of {rid} failed: {comp.stop_reason}")
        export = last.kv_transfer
        return PrefillResponse(
            request_id=rid,
            first_token=comp.token_ids[0],
            text=comp.text,
            finish_reason=comp.finish_reason,
            kv=export.to_dict() if isinstance(export, KVExport) else None,
            seconds=time.perf_counter() - start,
            logprob=logprob_to_dict(comp.logprobs[0]) if comp.logprobs else None,
            prompt_token_ids=list(last.prompt_token_ids),
            metrics=request_timings(last),
        )

    async def decode(self, req: DecodeRequest) -> AsyncIterator[StreamLine]:
        """Lines from the first token on; KVTransferFailed / ValueError come before the first line."""
        self._need("decode")
        assert self.importer is not None
        export = KVExport.from_dict(req.kv)
        spec = ImportSpec(
            handle=export.handle,
            prompt_token_ids=list(req.prompt_token_ids),
            first_token=req.first_token,
            params=sampling_params(req.sampling_params),
            request_id=req.request_id or export.handle.request_id,
            generator_state=export.generator_state,
            first_logprob=None if req.first_logprob is None else logprob_from_dict(req.first_logprob),
            policy=req.kv_policy,
            timeout_s=req.timeout_s,
        )
        info: dict = {}
        line = LineMaker(info, timings=False)  # info (kv backend, bytes, seconds): filled before line one
        async for out in self.importer.generate(spec, info):
            yield line(out)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamLine]:
        params = sampling_params(req.sampling_params)
        line = LineMaker()
        async for out in self.llm.generate(req.prompt_input(), params, req.request_id or self._new_id("gen")):
            yield line(out)

    def abort(self, request_id: str) -> None:
        self.llm.abort(request_id)

    def health(self) -> dict:
        desc = self.connector.transport.describe() if self.connector and self.connector.transport else {}
        return {
            "status": "ok",
            "role": self.config.role,
            "model": self.engine.model_path,
            "tokenizer": self.config.tokenizer,
            "pid": os.getpid(),
            "kv_backend": desc.get("backend"),
            "kv_address": self.kv_address,
            "layout_fingerprint": desc.get("layout_fingerprint"),
            "kv_requested": desc.get("requested"),
            "max_model_len": self.engine.max_model_len,
            "block_bytes": self.engine.kv[0].numel() * self.engine.kv.element_size(),
            "num_blocks": self.engine.pool.num_blocks,
            "vocab_size": self.engine.model_config.vocab_size,
            "device": str(self.engine.device),
            "dtype": str(self.engine.dtype).removeprefix("torch."),
            "load": self.engine.loaded.load_stats,  # weights: method, cache status, seconds per stage
        }

    async def stats(self) -> dict:
        def snapshot() -> dict:
            engine = self.engine
            engine.free_released_kv()
            return {
                "role": self.config.role,
                "running": len(engine.scheduler.running),
                "waiting": len(engine.scheduler.waiting),
                "unfinished": engine.num_unfinished_requests,
                "blocks": {
                    "total": engine.pool.num_blocks,
                    "free": engine.pool.num_free,
                    "held": engine.pool.num_held,  # freed, but a late KV copy may still write them
                },
                "state_slots": {"total": engine.states.num_slots, "free": engine.states.num_free},
                "preemptions": engine.scheduler.num_preemptions,
                "kv_transfer": self.connector.stats() if self.connector else None,
            }

        return await self.llm.run_in_engine(snapshot)

    async def check_peer(self, address: str, timeout_s: float) -> dict:
        """Handshake with an exporter now (decode side); raises PeerRefused / AuthError on a bad pair."""
        if self.connector is None:
            raise RoleError("a colocated worker has no KV transport")
        peer = await asyncio.to_thread(self.connector.check_peer, address, timeout_s)
        return {"ok": True, "address": address, "peer_layout": peer.to_dict() if peer else None}

    def release(self, kv: dict) -> dict:
        """Prefill side: end an export's lease now (its blocks come back at the next step)."""
        self._need("prefill")
        assert self.connector is not None and self.connector.transport is not None
        handle = KVExport.from_dict(kv).handle
        if handle.address != self.kv_address:
            raise ValueError(f"handle {handle.request_id} was exported by {handle.address}, not by us")
        self.connector.transport.release(handle)
        self.llm.call_soon_in_engine(self.engine.free_released_kv)
        return {"ok": True}

    # ---- KV probe (the gate and the run-time check): real blocks over the real transport ----------

    async def probe_export(self, num_blocks: int) -> dict:
        """Prefill side: lease `num_blocks` free blocks (their bytes as they are) as a probe export."""
        self._need("prefill")
        conn = self.connector
        assert conn is not None and conn.transport is not None
        engine = self.engine

        def export() -> dict:
            engine.free_released_kv()
            if engine.pool.num_free < num_blocks:
                raise NoRoom(f"only {engine.pool.num_free} free blocks for a {num_blocks}-block probe")
            ids = engine.pool.allocate(num_blocks)
            state = {name: t[0].clone() for name, t in engine.states.states.items()} or None
            try:
                handle = conn.transport.export(
                    self._new_id("probe"), ids, num_blocks * engine.block_size, state
                )
            except Exception:
                engine.pool.free(ids)
                raise
            return KVExport(handle).to_dict()

        return {"kv": await self.llm.run_in_engine(export)}

    async def probe(self, kv: dict, timeout_s: float) -> dict:
        """Decode side: fetch a probe export into free blocks, time it, give everything back."""
        self._need("decode")
        conn = self.connector
        assert conn is not None and conn.transport is not None
        engine, handle = self.engine, KVExport.from_dict(kv).handle

        def reserve() -> list[int]:
            if engine.pool.num_free < handle.num_blocks:
                raise NoRoom(f"only {engine.pool.num_free} free blocks for a {handle.num_blocks}-block probe")
            ids = engine.pool.allocate(handle.num_blocks)
            for i in ids:  # touch the pages first: the probe measures the transport, not page faults
                engine.kv[i].zero_()
            return ids

        ids = await self.llm.run_in_engine(reserve)
        start = time.perf_counter()
        try:
            await asyncio.to_thread(conn.transport.fetch, handle, ids, timeout_s)
            seconds = time.perf_counter() - start
        finally:
            self.llm.call_soon_in_engine(lambda: engine.pool.free(ids))
            await asyncio.to_thread(conn.transport.release, handle)
        nbytes = handle.num_blocks * engine.kv[0].numel() * engine.kv.element_size()
        return {
            "bytes": nbytes,
            "seconds": seconds,
            "gbps": nbytes / seconds / 1e9,
            "blocks": handle.num_blocks,
            "backend": conn.backend_name,
            "peer": handle.address,
        }

    def set_faults(self, knobs: FaultsRequest) -> dict:
        """Test-only: make this exporter drop / delay / corrupt / kill the fetches it serves."""
        transport = self.connector.transport if self.connector else None
        if not self.config.fault_injection or not hasattr(transport, "install_faults"):
            raise RoleError("fault injection is off: start the worker with --enable-fault-injection")
        k = FaultKnobs(**knobs.model_dump())
        active = any((k.drop, k.delay, k.corrupt, k.kill))
        transport.install_faults(FaultPlan(k) if active else None)  # type: ignore[union-attr]
        return {"faults": dataclasses.asdict(k) if active else None}

    async def close(self) -> None:
        await self.llm.shutdown()
        if self.importer is not None:
            self.importer.close()
        if self.connector is not None:
            self.connector.close()


# ---- command line --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m splitserve.serve.worker", description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=ROLES, default="colocated")
    p.add_argument("--model", default=None,
                   help="HF directory, GGUF file or random:SHAPE (default: SmolLM2-135M)")  # fmt: skip
    p.add_argument("--tokenizer", default=None, help="HF directory or GGUF file (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP (and tcp KV) address to bind")
    p.add_argument("--port", type=int, default=0, help="HTTP port; 0: the OS picks (printed)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-mb", type=int, default=None, help="KV cache budget (default: the engine's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-cache-dir", default="auto", help='"auto", a path, or "off"')
    p.add_argument("--weight-cache-max-gb", type=float, default=64.0)
    p.add_argument("--no-weight-cache-verify", action="store_true", help="skip the per-chunk CRC32 on load")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode CUDA graphs")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="overlap the host's and the GPU's work in decode (auto: on for CUDA)")  # fmt: skip
    p.add_argument("--kv-backend", default="tcp",
                   help="tcp | shm | cuda_ipc (GPU KV, one host) | nccl (GPU KV); nixl: not yet")  # fmt: skip
    p.add_argument("--kv-fallback", default="",
                   help="comma-separated backends allowed if --kv-backend cannot run (logged)")  # fmt: skip
    p.add_argument("--kv-secret-env", default="SPLITSERVE_KV_SECRET",
                   help="name of the environment variable holding the shared KV secret")  # fmt: skip
    p.add_argument("--kv-lease-s", type=float, default=30.0, help="free an unclaimed export after this")
    p.add_argument("--kv-fetch-timeout-s", type=float, default=30.0, help="default deadline of an import")
    p.add_argument("--kv-policy", choices=("fail", "recompute"), default="fail")
    p.add_argument("--kv-checksum", choices=("crc32", "blake2b"), default=None)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--enable-fault-injection", action="store_true", help="tests: POST /debug/faults")
    p.add_argument(
        "--http-auth",
        action="store_true",
        help="require a bearer token derived from the KV secret on every endpoint but /health",
    )
    p.add_argument(
        "--kv-throttle-gbps", type=float, default=None, help="test hook: hold fetches to this GB/s"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    secret = os.environ.get(args.kv_secret_env) or None
    if (args.role != "colocated" or args.http_auth) and not secret:
        why = "--http-auth" if args.role == "colocated" else f"the {args.role} role"
        raise ValueError(f"{why} needs the deployment's shared secret in ${args.kv_secret_env}")
    return WorkerConfig(
        role=args.role, model=args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
        block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_mb=args.kv_cache_mb, seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weight_cache_dir=None if args.weight_cache_dir == "off" else args.weight_cache_dir,
        weight_cache_max_gb=args.weight_cache_max_gb, weight_cache_verify=not args.no_weight_cache_verify,
        enforce_eager=args.enforce_eager,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        kv_backend=args.kv_backend, kv_fallback=tuple(b for b in args.kv_fallback.split(",") if b),
        kv_secret=secret, kv_host=args.host, kv_lease_s=args.kv_lease_s,
        kv_fetch_timeout_s=args.kv_fetch_timeout_s, kv_policy=args.kv_policy,
        kv_checksum=args.kv_checksum, fault_injection=args.enable_fault_injection,
        kv_throttle_gbps=args.kv_throttle_gbps, http_auth=args.http_auth,
    )  # fmt: skip


STANDBY = "--standby"


def standby() -> list[str]:
    """A warm spare: import what a worker needs (torch, the engine, the HTTP stack; a CUDA context when
    there is a GPU), say so, and wait for the worker's command line as one JSON line on stdin. The local
    runtime keeps one, so that a restart skips interpreter start-up and imports (seconds)."""
    import torch

    import splitserve.serve.worker_app  # noqa: F401 - the import is the point
    from splitserve.model import loader  # noqa: F401

    if torch.cuda.is_available():
        torch.cuda.init()
    print(json.dumps({"event": "standby", "pid": os.getpid()}), flush=True)
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the runtime went away
    argv = json.loads(line)["argv"]
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise SystemExit('splitserve worker: a standby wants {"argv": [str, ...]}')
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == [STANDBY]:
        argv = standby()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    import torch

    torch.set_num_threads(max(1, args.threads))
    from splitserve.serve.worker_app import serve

    try:
        worker = Worker(config_from_args(args))
    except (ValueError, OSError, ModelLoadError, TransportError) as exc:
        print(f"splitserve worker: error: {exc}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        info = {"event": "ready", "url": url, **worker.health()}
        print(json.dumps(info), flush=True)

    serve(worker, args.host, args.port, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
