"""The Ray runtime: the same manifest across the nodes of a Ray cluster, on Ray Serve.

    runtime: {kind: ray, address: auto}            # in the manifest; then `splitserve serve manifest.yaml`

Pieces (one Serve application per manifest):
  <name>-prefill / <name>-decode / <name>-colocated   Serve deployments, `replicas` each (or autoscaled
      between `min_replicas` and `max_replicas`: on Serve's queue signal, or with `scaling.enabled` to
      the count the router's SLO controller asks for, runtime/ray_scale.py), placed by each pool's
      `placement` (Ray resources such as {"prefill_node": 1}, node labels, CPUs/GPUs per replica). A
      replica builds the same `Worker` the local runtime starts as a process, serves the worker HTTP API
      on its node's address (port from the OS), and registers itself with the deployment's registry
      actor. Serve health-checks it
      (`check_health`: the HTTP server and the engine thread are alive) and replaces it when it fails
      or its process dies; the new replica registers under a new id. A replica can change role
      (prefill <-> decode) in place: POST /admin/workers/{name}/role, runtime/ray_role.py.
  <name>-router   the Serve ingress: the same OpenAI API (`install_routes`) and `Dispatcher` as the local
      runtime. It reads the registry, health-checks every worker it lists over HTTP and routes only to
      ready ones, dropping those that stopped answering.
  registry        a named actor (no resources) mapping replica id -> {role, url, kv address, node}.
KV moves between workers over splitserve's own transports (the worker addresses travel through the
registry; tensors never go through Ray's object store). The KV secret reaches the workers through their
runtime_env, from `transport.secret_env` on the driver (or a fresh one per deployment).

Ray is optional: `pip install 'splitserve[ray]'`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import threading
import time
from typing import Any

import httpx
import msgspec
import ray
from fastapi import FastAPI
from ray import serve

from splitserve.config.manifest import Manifest
from splitserve.config.manifest_sections import PlacementSection
from splitserve.router.routes import install_routes
from splitserve.router.server import ModelInfo, OpenAIServer
from splitserve.runtime.common import worker_config
from splitserve.runtime.ray_workers import RayWorkers
from splitserve.wire.auth import worker_headers

log = logging.getLogger(__name__)

INGRESS = FastAPI(title="splitserve (ray)")
_SERVER: OpenAIServer | None = None


def _server() -> OpenAIServer:
    if _SERVER is None:
        raise RuntimeError("the router is still starting")
    return _SERVER


install_routes(INGRESS, _server)


@ray.remote(num_cpus=0)
class Registry:
    """replica id -> what the router needs to reach that worker."""

    def __init__(self) -> None:
        self.entries: dict[str, dict] = {}
        self.wanted: dict[str, int] = {}  # role -> replicas the scaling controller asks for

    def set_desired(self, role: str, replicas: int) -> None:
        self.wanted[role] = replicas

    def desired(self, role: str) -> int | None:
        return self.wanted.get(role)

    def register(self, entry: dict) -> None:
        self.entries[entry["id"]] = entry

    def unregister(self, replica_id: str) -> None:
        self.entries.pop(replica_id, None)

    def update(self, replica_id: str, change: dict) -> None:
        """A listed replica's entry changed (its role, runtime/ray_role.py)."""
        if replica_id in self.entries:
            self.entries[replica_id] = {**self.entries[replica_id], **change}

    def list(self) -> list[dict]:
        return list(self.entries.values())


class WorkerReplica:
    """A Serve replica of a prefill, decode or colocated pool: one engine and its worker HTTP API."""

    def __init__(self, manifest_json: str, role: str, registry: str, namespace: str) -> None:
        from splitserve.worker.app import serve as serve_http
        from splitserve.worker.main import Worker

        manifest = Manifest.model_validate_json(manifest_json)
        secret = os.environ.get(manifest.transport.secret_env)
        host = ray.util.get_node_ip_address()
        ctx = serve.get_replica_context()
        self.id = ctx.replica_id.unique_id
        self.worker = Worker(worker_config(manifest, role, 0, secret, host))
        ready, url = threading.Event(), []

        def on_ready(u: str) -> None:
            from splitserve.heap import freeze_heap

            freeze_heap(f"{role} replica front end")
            url.append(u)
            ready.set()

        self.http = threading.Thread(
            target=serve_http, args=(self.worker, host, 0, on_ready), daemon=True, name="worker-http"
        )
        self.http.start()
        if not ready.wait(60):
            raise RuntimeError("the worker's HTTP server did not start")
        health = self.worker.health()
        self.entry = {
            "id": self.id,
            "role": role,
            "name": f"{role}-{self.id[:6]}",
            "url": url[0],
            "kv_address": self.worker.kv_address,
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": host,
            "pid": os.getpid(),
            "started": time.time(),
            "info": msgspec.to_builtins(health),  # as GET /health answers it
        }
        self.registry = ray.get_actor(registry, namespace=namespace)
        ray.get(self.registry.register.remote(self.entry))
        self.drain_s = manifest.scaling.drain_timeout_s if manifest.scaling.enabled else 0.0
        self.headers = worker_headers(secret)
        log.info("worker %s ready at %s", self.entry["name"], url[0])

    async def __del__(self) -> None:
        """Serve stops this replica (scaled down, or the deployment deleted): with scaling on, drained
        first (runtime/ray_scale.py)."""
        if self.drain_s:
            from splitserve.runtime.ray_scale import drain_replica

            await drain_replica(self.registry, self.id, self.entry["url"], self.headers, self.drain_s)

    def check_health(self) -> None:
        if not self.http.is_alive():
            raise RuntimeError("the worker's HTTP server stopped")
        # NOTE: a role change stops the old engine core before the new one is ready; a new core that
        # does not start ends this process (the worker app's on_death), which Serve sees
        if not self.worker.alive() and not self.worker.switching:
            raise RuntimeError("the worker's engine core died")

    def info(self) -> dict:
        return self.entry


@serve.ingress(INGRESS)
class Router:
    """The Serve ingress: the OpenAI API over the registered workers."""

    def __init__(self, manifest_json: str, registry: str, namespace: str, *_worker_apps: Any) -> None:
        self.manifest = Manifest.model_validate_json(manifest_json)
        self.registry = ray.get_actor(registry, namespace=namespace)
        rt = self.manifest.runtime
        self.headers = worker_headers(os.environ.get(self.manifest.transport.secret_env))
        self.workers = RayWorkers(self.registry, rt.health_interval_s, rt.health_failures, self.headers)
        self._setup = asyncio.get_event_loop().create_task(self._start())

    async def _start(self) -> None:
        global _SERVER
        from splitserve.model.tokenizer import load_tokenizer
        from splitserve.router.probe import KVProber
        from splitserve.router.stats_log import StatsLogger

        m = self.manifest
        deadline = time.monotonic() + m.runtime.startup_timeout_s
        while not all(self.workers.ready(role) for role in m.pools()):
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not register in time")
            await self.workers.refresh()
            await asyncio.sleep(0.5)
        first = next(iter(self.workers.ready(next(iter(m.pools()))))).health
        assert first is not None  # ready: its /health is in
        tokenizer = await asyncio.to_thread(load_tokenizer, first.model, first.tokenizer)
        from splitserve.router.chat_template import use_chat_template

        use_chat_template(tokenizer, m.model.chat_template)
        info = ModelInfo(
            m.model.resolved_served_name(),
            first.max_model_len,
            first.vocab_size,
            first.model,
            aliases=tuple(m.model.served_names()[1:]),
        )
        server = OpenAIServer(
            m, self.workers, tokenizer, info, self.workers.describe, self.workers.stats, self.headers
        )
        self.prober = KVProber(m, self.workers.ready, server.on_probe, self.headers)
        self.prober.start()
        self.stats_line = StatsLogger(server, m.server.log_stats_interval_s)
        self.stats_line.start()
        from splitserve.runtime.ray_role import RayRoleSwitcher  # POST /admin/workers/{name}/role

        roles = RayRoleSwitcher(m, self.workers, self.registry, server.metrics.registry, info.served_name)
        server.change_role = roles.switch
        if m.scaling.enabled:
            from splitserve.runtime.ray_scale import ray_controller

            self.scaling = ray_controller(m, self.registry, self.workers, server)
            self.scaling.start()
        _SERVER = server
        asyncio.get_running_loop().create_task(self.workers.loop())

    async def check_health(self) -> None:
        if self._setup.done() and self._setup.exception() is not None:
            raise RuntimeError(f"the router failed to start: {self._setup.exception()}")


def _actor_options(p: PlacementSection, gpus_default: float = 0.0, env: dict[str, str] | None = None) -> dict:
    opts: dict[str, Any] = {"num_cpus": p.num_cpus if p.num_cpus is not None else 1}
    gpus = p.num_gpus if p.num_gpus is not None else gpus_default
    if gpus:
        opts["num_gpus"] = gpus
    if p.resources:
        opts["resources"] = dict(p.resources)
    if p.label_selector:
        opts["label_selector"] = dict(p.label_selector)
    if p.memory_gb:
        opts["memory"] = int(p.memory_gb * (1 << 30))
    if env:
        opts["runtime_env"] = {"env_vars": env}
    return opts


def app_builder(args: dict[str, Any]) -> Any:
    """Serve's application builder (`import_path` of the KubeRay serveConfigV2): args = {"manifest": the
    manifest as a mapping (or a JSON string)}."""
    data = args["manifest"]
    return build_app(
        Manifest.model_validate_json(data) if isinstance(data, str) else Manifest.model_validate(data)
    )


def registry_name(manifest: Manifest) -> str:
    return f"{manifest.name}-registry"


def build_app(manifest: Manifest, secret: str | None = None) -> Any:
    """The Serve application of a manifest (its registry actor is created here, on the driver)."""
    t, rt = manifest.transport, manifest.runtime
    secret = secret or t.secret or os.environ.get(t.secret_env) or secrets.token_hex(32)
    reg = registry_name(manifest)
    Registry.options(name=reg, namespace=rt.namespace, get_if_exists=True, lifetime="detached").remote()
    blob = manifest.model_dump_json()
    workers = []
    for role, pool in manifest.pools().items():
        on_gpu = any(d.startswith("cuda") for d in pool.devices) or manifest.model.device.startswith("cuda")
        # a replica's tensor-parallel ranks run in its one actor (its engine core starts them): one GPU each
        gpus = float(manifest.tensor_parallel_size(role)) if on_gpu else 0
        opts: dict[str, Any] = {
            "name": f"{manifest.name}-{role}",
            "ray_actor_options": _actor_options(pool.placement, gpus, {t.secret_env: secret}),
            "health_check_period_s": rt.health_interval_s,
            "health_check_timeout_s": max(10.0, 5 * rt.health_interval_s),
            "max_ongoing_requests": 4096,
        }
        if manifest.scaling.enabled:  # the SLO-driven controller sets the count (runtime/ray_scale.py)
            from splitserve.runtime.ray_scale import autoscaling

            opts["autoscaling_config"] = autoscaling(manifest, role, reg)
            opts["graceful_shutdown_timeout_s"] = manifest.scaling.drain_timeout_s + 5
        elif pool.min_replicas is not None and pool.max_replicas is not None:
            opts["autoscaling_config"] = {
                "min_replicas": pool.min_replicas,
                "max_replicas": pool.max_replicas,
                "initial_replicas": pool.replicas,
            }
        else:
            opts["num_replicas"] = pool.replicas
        workers.append(serve.deployment(WorkerReplica, **opts).bind(blob, role, reg, rt.namespace))
    srv = manifest.server
    router = serve.deployment(
        Router,
        name=f"{manifest.name}-router",
        ray_actor_options=_actor_options(rt.router_placement, env={t.secret_env: secret}),
        max_ongoing_requests=srv.max_concurrent_requests + srv.max_queued_requests,
        health_check_period_s=rt.health_interval_s,
    )
    return router.bind(blob, reg, rt.namespace, *workers)


def deploy(manifest: Manifest, timeout_s: float | None = None) -> str:
    """Connect to the cluster, start Serve's HTTP proxy at `server.host:port`, run the application and
    wait until the router answers /health with every pool ready. -> the URL."""
    rt, srv = manifest.runtime, manifest.server
    if not ray.is_initialized():
        ray.init(address=rt.address or "auto", namespace=rt.namespace, logging_level=logging.WARNING)
    serve.start(http_options={"host": srv.host, "port": srv.port})
    serve.run(build_app(manifest), name=manifest.name, route_prefix="/", blocking=False)
    url = f"http://{srv.host}:{srv.port}"
    deadline = time.monotonic() + (timeout_s or rt.startup_timeout_s)
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray deployment {manifest.name} did not become healthy at {url} in time")
        time.sleep(0.5)


def undeploy(manifest: Manifest) -> None:
    serve.delete(manifest.name)
    try:
        ray.kill(ray.get_actor(registry_name(manifest), namespace=manifest.runtime.namespace))
    except ValueError:
        pass


def run(manifest: Manifest) -> int:
    """`splitserve serve` with `runtime.kind: ray`: deploy, print the URL, serve until SIGINT/SIGTERM."""
    url = deploy(manifest)
    print(
        f"splitserve: serving {manifest.model.resolved_served_name()} at {url}/v1 (ray; {manifest.mode})",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    undeploy(manifest)
    return 0


__all__ = [
    "INGRESS",
    "Registry",
    "Router",
    "WorkerReplica",
    "app_builder",
    "build_app",
    "deploy",
    "run",
    "undeploy",
]
