"""The worker service's front end: one engine-core process (core.py) behind HTTP (worker_app.py).

    python -m splitserve.serve.worker --role prefill --model PATH --port 0 --kv-backend tcp \
        --kv-secret-env SPLITSERVE_KV_SECRET

prints one JSON line `{"event": "ready", "url": ..., "kv_address": ..., ...}` once it serves (ports
come from the OS), then logs to stderr. Two processes: this one (HTTP, tokenization, detokenization,
stop strings, streams) and the engine core it starts (the device, the engine, the KV transport), joined
by core_protocol.py. If the core dies, every request in flight fails at once and this process exits
too, so that the runtime restarts the worker.

Roles and the life of a disaggregated request through two workers (the router drives it):
  1. prefill worker, POST /prefill {prompt_token_ids, sampling_params}: the core runs the prompt,
     samples the first token, leases the blocks (and hybrid state) to the KV transport, and the answer
     is {first_token, kv: {handle, generator_state}}. Unclaimed, the lease ends after --kv-lease-s.
  2. decode worker, POST /decode {prompt_token_ids, first_token, kv, sampling_params}: the core
     reserves blocks, fetches (the transport's handshake checks the layout and the shared secret on
     first contact), has the prefill lease released, joins the batch, and this process streams NDJSON
     lines from the first token on. A failed fetch follows --kv-policy (or the body's kv_policy):
     "fail" answers an HTTP error before any line; "recompute" recomputes the prompt and streams the
     same tokens.
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
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from splitserve.kv import TransportError
from splitserve.model.errors import ModelLoadError
from splitserve.serve import core_protocol as wire
from splitserve.serve.core_client import CoreClient, CoreDead, RequestStream
from splitserve.serve.core_ops import RoleError
from splitserve.serve.schemas import (
    DecodeRequest,
    FaultsRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResponse,
    StreamLine,
    logprob_from_dict,
    sampling_params,
)
from splitserve.serve.text_stream import TextStream
from splitserve.serve.worker_auth import worker_headers, worker_token  # noqa: F401 - re-exported
from splitserve.serve.worker_config import ROLES, WorkerConfig

log = logging.getLogger(__name__)

__all__ = ["ROLES", "RoleError", "Worker", "WorkerConfig"]


class Worker:
    """prefill / decode / generate / abort / health / stats over one engine core (the same class a Ray
    deployment wraps)."""

    def __init__(self, config: WorkerConfig, client: CoreClient | None = None) -> None:
        from splitserve.model.tokenizer import load_tokenizer

        self.config = config
        self.client = client or CoreClient.spawn()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.client.begin(config, log_level=level)
        try:
            # while the core loads the weights
            self.tokenizer = load_tokenizer(config.model, config.tokenizer)
        except Exception:
            self.client.close()
            raise
        self.info = self.client.wait_ready()
        self.kv_address: str | None = self.info.get("kv_address")
        self._ids = itertools.count()
        self._tag = secrets.token_hex(4)  # request ids unique across workers: decode keeps them

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """From the event loop that serves HTTP, before the first request."""
        self.client.attach(loop)

    def alive(self) -> bool:
        return self.client.dead is None

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{self._tag}-{next(self._ids)}"

    def _need(self, role: str) -> None:
        if self.config.role != role:
            raise RoleError(f"this is a {self.config.role} worker: only a {role} worker serves that")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("this worker has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt)

    @staticmethod
    def _params(data: dict[str, Any]) -> Any:
        params = sampling_params(data)
        if params.n != 1:
            raise ValueError("a worker serves one sample per request (n = 1): the router fans out n")
        return params

    # ---- requests --------------------------------------------------------------------------------

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        self._need("prefill")
        params = self._params(req.sampling_params)
        ids = self._prompt_ids(req.prompt_input())
        rid = req.request_id or self._new_id("pf")
        start = time.perf_counter()
        stream = self.client.add(rid, ids, req.sampling_params, export=True)
        deltas: list[wire.Delta] = []
        try:
            await stream.accepted
            while not (deltas and deltas[-1].finished):
                deltas += await stream.take()
        except BaseException:
            self.client.cancel(rid)
            raise
        last = deltas[-1]
        if last.finish_reason in ("error", "abort"):
            raise RuntimeError(f"prefill of {rid} ended without a first token ({last.finish_reason})")
        text = TextStream(rid, params, self.tokenizer)
        line = text.feed(deltas)
        assert line is not None and line.token_ids
        kv = last.kv
        if text.finished and kv is not None:  # a stop string ended it at once: nothing to hand on
            await self.client.call("release", kv=kv)
            kv = None
        return PrefillResponse(
            request_id=rid, first_token=line.token_ids[0], text=line.text,
            finish_reason=text.finish_reason if text.finished else None, kv=kv,
            seconds=time.perf_counter() - start, logprob=line.logprobs[0] if line.logprobs else None,
            prompt_token_ids=ids, metrics=deltas[0].metrics or {},
        )  # fmt: skip

    async def decode(self, req: DecodeRequest) -> AsyncIterator[StreamLine]:
        """Lines from the first token on; a failed import (CoreError) comes before the first line."""
        self._need("decode")
        params = self._params(req.sampling_params)
        rid = req.request_id or str(req.kv.get("handle", {}).get("request_id") or self._new_id("dc"))
        lp = None
        if req.first_logprob is not None:
            x = logprob_from_dict(req.first_logprob)
            lp = [x.token_id, x.logprob, x.rank, [list(t) for t in x.top]]
        cmd = wire.Import(rid, list(req.prompt_token_ids), req.first_token, req.kv, req.sampling_params,
                          lp, req.kv_policy, req.timeout_s)  # fmt: skip
        stream = self.client.import_kv(cmd)
        async for line in self._lines(rid, stream, TextStream(rid, params, self.tokenizer), timings=False):
            yield line

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamLine]:
        params = self._params(req.sampling_params)
        ids = self._prompt_ids(req.prompt_input())
        rid = req.request_id or self._new_id("gen")
        stream = self.client.add(rid, ids, req.sampling_params)
        async for line in self._lines(rid, stream, TextStream(rid, params, self.tokenizer), timings=True):
            yield line

    async def _lines(
        self, rid: str, stream: RequestStream, text: TextStream, timings: bool
    ) -> AsyncIterator[StreamLine]:
        """Deltas -> lines, at least `stream_interval` tokens each; closing early aborts the request.
        The first line carries where the time went (this engine's queue/prefill, or the KV import)."""
        done = False
        interval = self.config.stream_interval
        try:
            info = await stream.accepted
            while True:
                deltas = await stream.take()
                while (
                    interval > 1
                    and not deltas[-1].finished
                    and sum(len(d.token_ids) for d in deltas) < interval
                ):
                    deltas += await stream.take()
                metrics = None
                if text.tokens == 0:
                    metrics = (deltas[0].metrics or {}) if timings else dict(info)
                line = text.feed(deltas, metrics)
                if text.stopped_early:
                    self.client.cancel(rid)
                if line is None:
                    continue
                done = line.finished
                yield line
                if done:
                    return
        finally:
            if not done:
                self.client.cancel(rid)  # the caller went away, or the stream failed
            elif not text.stopped_early:
                self.client.forget(rid)

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    # ---- operations ------------------------------------------------------------------------------

    def health(self) -> dict:
        return {**self.info, "status": "ok" if self.alive() else "engine_dead", "pid": os.getpid()}

    async def stats(self) -> dict:
        return await self.client.call("stats")

    async def check_peer(self, address: str, timeout_s: float) -> dict:
        """Handshake with an exporter now (decode side); refused pairs raise CoreError (403 / 409)."""
        if self.config.role == "colocated":
            raise RoleError("a colocated worker has no KV transport")
        return await self.client.call(
            "check_peer", wait_s=timeout_s + 5, address=address, timeout_s=timeout_s
        )

    async def release(self, kv: dict) -> dict:
        self._need("prefill")
        return await self.client.call("release", kv=kv)

    async def probe_export(self, num_blocks: int) -> dict:
        self._need("prefill")
        return await self.client.call("probe_export", num_blocks=num_blocks)

    async def probe(self, kv: dict, timeout_s: float) -> dict:
        self._need("decode")
        return await self.client.call("probe", wait_s=timeout_s + 5, kv=kv, timeout_s=timeout_s)

    async def set_faults(self, knobs: FaultsRequest) -> dict:
        return await self.client.call("set_faults", **knobs.model_dump())

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)


# ---- command line --------------------------------------------------------------------------------


def build_parser(suppress: bool = False) -> argparse.ArgumentParser:
    """`suppress`: no defaults, so that parsing tells which flags were given."""

    def d(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    p = argparse.ArgumentParser(prog="python -m splitserve.serve.worker", description=__doc__.split("\n")[0],
                                argument_default=argparse.SUPPRESS if suppress else None)  # fmt: skip
    p.add_argument("--spec", default=d(None),
                   help="the worker's config as JSON (a runtime's WorkerConfig, no secret); flags given "
                        "beside it override its fields")  # fmt: skip
    p.add_argument("--role", choices=ROLES, default=d("colocated"))
    p.add_argument("--model", default=d(None),
                   help="HF directory, GGUF file or random:SHAPE (default: SmolLM2-135M)")  # fmt: skip
    p.add_argument("--tokenizer", default=d(None), help="HF directory or GGUF file (default: the model's)")
    p.add_argument("--host", default=d("127.0.0.1"), help="HTTP (and tcp KV) address to bind")
    p.add_argument("--port", type=int, default=d(0), help="HTTP port; 0: the OS picks (printed)")
    p.add_argument("--device", default=d("auto"))
    p.add_argument("--dtype", default=d("auto"))
    p.add_argument("--block-size", type=int, default=d(16))
    p.add_argument("--max-model-len", type=int, default=d(None))
    p.add_argument("--max-num-seqs", type=int, default=d(128))
    p.add_argument("--max-num-batched-tokens", type=int, default=d(2048))
    p.add_argument("--kv-cache-mb", type=int, default=d(None), help="KV cache budget (default: the engine's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d(None))
    p.add_argument("--seed", type=int, default=d(0))
    p.add_argument("--weight-cache-dir", default=d("auto"), help='"auto", a path, or "off"')
    p.add_argument("--weight-cache-max-gb", type=float, default=d(64.0))
    p.add_argument("--no-weight-cache-verify", action="store_true", help="skip the per-chunk CRC32 on load")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode CUDA graphs")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default=d("auto"),
                   help="overlap the host's and the GPU's work in decode (auto: on for CUDA)")  # fmt: skip
    p.add_argument("--kv-backend", default=d("tcp"),
                   help="tcp | shm | cuda_ipc (GPU KV, one host) | nccl (GPU KV); nixl: not yet")  # fmt: skip
    p.add_argument("--kv-fallback", default=d(""),
                   help="comma-separated backends allowed if --kv-backend cannot run (logged)")  # fmt: skip
    p.add_argument("--kv-secret-env", default=d("SPLITSERVE_KV_SECRET"),
                   help="name of the environment variable holding the shared KV secret")  # fmt: skip
    p.add_argument("--kv-lease-s", type=float, default=d(30.0), help="free an unclaimed export after this")
    p.add_argument("--kv-fetch-timeout-s", type=float, default=d(30.0), help="default deadline of an import")
    p.add_argument("--kv-policy", choices=("fail", "recompute"), default=d("fail"))
    p.add_argument("--kv-checksum", choices=("crc32", "blake2b"), default=d(None))
    p.add_argument("--threads", type=int, default=d(1), help="the engine core's torch intra-op threads")
    p.add_argument("--stream-interval", type=int, default=d(1),
                   help="tokens per stream line at least (fewer only at the end)")  # fmt: skip
    p.add_argument("--enable-fault-injection", action="store_true", help="tests: POST /debug/faults")
    p.add_argument(
        "--http-auth",
        action="store_true",
        help="require a bearer token derived from the KV secret on every endpoint but /health",
    )
    p.add_argument(
        "--kv-throttle-gbps", type=float, default=d(None), help="test hook: hold fetches to this GB/s"
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p


# command-line dests that are not a WorkerConfig field of the same name
_FLAG_FIELDS = {"no_weight_cache_verify": "weight_cache_verify", "enable_fault_injection": "fault_injection",
                "host": "kv_host"}  # fmt: skip
_NOT_FIELDS = {"spec", "port", "kv_secret_env", "verbose"}


def config_from_args(args: argparse.Namespace, argv: Sequence[str] | None = None) -> WorkerConfig:
    """The worker's config: `--spec` (a runtime's WorkerConfig as JSON) with the flags given in `argv`
    over it, or the flags alone."""
    secret = os.environ.get(args.kv_secret_env) or None
    role, http_auth = args.role, args.http_auth
    if args.spec:
        try:
            spec = json.loads(args.spec)
            role, http_auth = spec["role"], spec["http_auth"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--spec is not a worker spec: {exc}") from None
    if (role != "colocated" or http_auth) and not secret:
        why = "--http-auth" if role == "colocated" else f"the {role} role"
        raise ValueError(f"{why} needs the deployment's shared secret in ${args.kv_secret_env}")
    flags = _fields_from_flags(args, secret)
    if not args.spec:
        return WorkerConfig(**flags)
    given = vars(build_parser(suppress=True).parse_args(list(argv or [])))
    fields = {_FLAG_FIELDS.get(d, d) for d in given if d not in _NOT_FIELDS}
    base = WorkerConfig.from_json(args.spec, kv_secret=secret)
    return dataclasses.replace(base, **{f: flags[f] for f in fields})


def _fields_from_flags(args: argparse.Namespace, secret: str | None) -> dict:
    return dict(
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
        kv_throttle_gbps=args.kv_throttle_gbps, http_auth=args.http_auth, threads=args.threads,
        stream_interval=args.stream_interval,
    )  # fmt: skip


STANDBY = "--standby"


def standby() -> list[str]:
    """A warm spare: import what the front end needs (the HTTP stack, the tokenizer) while its engine
    core, already started, imports torch and the engine (and makes a CUDA context where there is a
    GPU); say so, and wait for the worker's command line as one JSON line on stdin. The local runtime
    keeps one, so that a restart skips interpreter start-up and imports (seconds)."""
    import splitserve.model.tokenizer  # noqa: F401 - the import is the point
    import splitserve.serve.worker_app  # noqa: F401

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
    # SIGTERM before serving (a standby told to go): unwind, so that the core and its sockets go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    client = CoreClient.spawn()  # the core imports torch and the engine meanwhile
    try:
        if argv == [STANDBY]:
            argv = standby()
        args = build_parser().parse_args(argv)
    except SystemExit:
        client.close(1)
        raise
    from splitserve.logs import setup_logging

    setup_logging(logging.INFO if args.verbose else logging.WARNING)  # as the router: text or JSON
    from splitserve.serve.worker_app import serve

    try:
        worker = Worker(config_from_args(args, argv), client)
    except SystemExit:  # SIGTERM while loading
        client.close(1)
        raise
    except (ValueError, OSError, ModelLoadError, TransportError, CoreDead) as exc:
        client.close(1)
        if not isinstance(exc, CoreDead):  # the core said why itself, on our stderr
            print(f"splitserve worker: error: {exc}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        info = {"event": "ready", "url": url, **worker.health()}
        print(json.dumps(info), flush=True)

    serve(worker, args.host, args.port, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
