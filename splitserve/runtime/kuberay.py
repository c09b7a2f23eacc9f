"""`splitserve render kuberay MANIFEST`: a KubeRay RayService for Kubernetes from the same manifest.

What it renders (apiVersion ray.io/v1, kind RayService):
  serveConfigV2      one Serve application built by `splitserve.runtime.ray_serve:app_builder` from the
                     manifest (embedded), with the router pinned to the head node
  headGroupSpec      a CPU-only head: `num-cpus: 0` and no GPUs, so no model replica can land there; it
                     offers the custom resource `splitserve_router` for the router alone
  workerGroupSpecs   one group per pool (prefill, decode / colocated): replicas and autoscaling bounds
                     from the pool, the pool's custom resources as the group's Ray resources (so the
                     Serve replicas of that pool land only there), GPU and optional EFA requests, a node
                     selector for one availability zone and an optional instance type
Every pod passes the Kubernetes Pod Security Standard `restricted` (tests/runtime/pss.py checks it):
`runAsNonRoot` as the Ray image's user (uid 1000, gid 100), `seccompProfile: RuntimeDefault`,
`allowPrivilegeEscalation: false`, every capability dropped, `privileged` never set, only `restricted`
volume types (a PersistentVolumeClaim, emptyDir). The one exception is an RDMA transport (nixl over
EFA): it adds IPC_LOCK (RDMA registration pins memory, beyond the default RLIMIT_MEMLOCK), which no
Pod Security level allows, so those GPU pods need a namespace labelled `privileged` for
pod-security.kubernetes.io/enforce (or an exemption); the rendered notes say so. tcp and nccl need
nothing. The KV secret comes from a Kubernetes Secret (`secretKeyRef`), never inline.

Volumes: the model (`model.source`, an absolute path) from a PersistentVolumeClaim mounted read-only at
its parent directory (`--model-pvc`, default `splitserve-models`), and /dev/shm as a memory-backed
emptyDir (`--shm-size`): containers get a 64 MiB /dev/shm otherwise, too small for torch's and NCCL's
shared memory. The image is splitserve on the Ray image: deploy/docker/Dockerfile (docs/ray-kubernetes.md).
Same-host transports (shm, cuda_ipc) cannot span pods and are refused for a disaggregated deployment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import yaml

from splitserve.config.manifest import Manifest

ROUTER_RESOURCE = "splitserve_router"
RAY_UID, RAY_GID = 1000, 100  # the `ray` user of the rayproject/ray images (deploy/docker/Dockerfile)
IPC_LOCK_NOTE = (
    "IPC_LOCK added to the GPU pods: nixl registers (pins) memory for RDMA; no Pod Security level allows "
    "an added capability, so their namespace needs pod-security.kubernetes.io/enforce=privileged (or an "
    "exemption); nothing else is added, nothing runs privileged or as root"
)


@dataclass
class KubeRayOptions:
    image: str = "splitserve:0.1.0-ray2.60.0"  # built from deploy/docker/Dockerfile (splitserve[ray] on Ray)
    namespace: str | None = None
    secret_name: str = "splitserve-kv"  # a Kubernetes Secret with key `kv-secret`
    zone: str | None = None  # topology.kubernetes.io/zone for every pod
    instance_type: str | None = None  # node.kubernetes.io/instance-type for the GPU groups
    efa_per_pod: int = 0  # vpc.amazonaws.com/efa devices per GPU pod (nixl over EFA)
    head_cpu: str = "2"
    head_memory: str = "8Gi"
    worker_cpu: str = "8"
    worker_memory: str = "64Gi"
    model_pvc: str | None = "splitserve-models"  # a PersistentVolumeClaim holding model.source
    shm_size: str = "16Gi"  # the memory-backed /dev/shm of every pod
    notes: list[str] = field(default_factory=list)


def _quantity(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _security(manifest: Manifest, opts: KubeRayOptions, moves_kv: bool) -> dict:
    ctx: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    rdma = manifest.transport.backend == "nixl" or "nixl" in manifest.transport.fallback
    if moves_kv and rdma and manifest.mode == "disaggregated":
        ctx["capabilities"]["add"] = ["IPC_LOCK"]
        if IPC_LOCK_NOTE not in opts.notes:
            opts.notes.append(IPC_LOCK_NOTE)
    return ctx


def _pod_security() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": RAY_UID,
        "runAsGroup": RAY_GID,
        "fsGroup": RAY_GID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _model_mount(manifest: Manifest) -> str | None:
    """Where the model's volume goes: the parent of an absolute `model.source` (None: nothing to mount,
    e.g. the embedded default model or random weights)."""
    source = manifest.model.source
    if not source.startswith("/"):
        return None
    parent = str(PurePosixPath(source).parent)
    return parent if parent != "/" else source


def _volumes(manifest: Manifest, opts: KubeRayOptions) -> tuple[list[dict], list[dict]]:
    """-> (the pod's volumes, the container's mounts)."""
    volumes: list[dict] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}}]
    mounts: list[dict] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    where = _model_mount(manifest)
    if where and opts.model_pvc:
        claim = {"claimName": opts.model_pvc, "readOnly": True}
        volumes.append({"name": "model", "persistentVolumeClaim": claim})
        mounts.append({"name": "model", "mountPath": where, "readOnly": True})
    return volumes, mounts


def _pod(container: dict, manifest: Manifest, opts: KubeRayOptions) -> dict:
    volumes, mounts = _volumes(manifest, opts)
    container["volumeMounts"] = mounts
    return {"securityContext": _pod_security(), "containers": [container], "volumes": volumes}


def _container(
    name: str,
    manifest: Manifest,
    opts: KubeRayOptions,
    cpu: str,
    memory: str,
    gpus: float,
    ports: list[dict] | None = None,
) -> dict:
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = _quantity(gpus)
        if opts.efa_per_pod:
            limits["vpc.amazonaws.com/efa"] = str(opts.efa_per_pod)
    env = [
        {
            "name": manifest.transport.secret_env,
            "valueFrom": {"secretKeyRef": {"name": opts.secret_name, "key": "kv-secret"}},
        }
    ]
    if opts.efa_per_pod and gpus:
        env.append({"name": "FI_PROVIDER", "value": "efa"})
    c: dict[str, Any] = {
        "name": name,
        "image": opts.image,
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "env": env,
        "securityContext": _security(manifest, opts, moves_kv=bool(gpus) or name != "ray-head"),
    }
    if ports:
        c["ports"] = ports
    return c


def _selector(opts: KubeRayOptions, gpu: bool) -> dict[str, str]:
    sel = {}
    if opts.zone:
        sel["topology.kubernetes.io/zone"] = opts.zone
    if gpu and opts.instance_type:
        sel["node.kubernetes.io/instance-type"] = opts.instance_type
    return sel


def render_rayservice(manifest: Manifest, opts: KubeRayOptions | None = None) -> dict:
    opts = opts or KubeRayOptions()
    if manifest.mode == "disaggregated" and manifest.transport.backend in ("shm", "cuda_ipc"):
        raise ValueError(
            f"transport.backend {manifest.transport.backend} works only within one host, but prefill and "
            "decode run in different pods: use nccl or nixl (GPUs) or tcp"
        )
    served = manifest.model_copy(deep=True)
    served.runtime.kind = "ray"
    served.runtime.address = None
    served.runtime.router_placement.num_cpus = 0
    served.runtime.router_placement.resources = {ROUTER_RESOURCE: 1}
    served.server.host, served.server.port = "0.0.0.0", 8000
    serve_config = {
        "http_options": {"host": "0.0.0.0", "port": 8000},
        "applications": [
            {
                "name": manifest.name,
                "route_prefix": "/",
                "import_path": "splitserve.runtime.ray_serve:app_builder",
                "args": {"manifest": served.model_dump(mode="json", exclude={"transport": {"secret"}})},
            }
        ],
    }
    head_ports = [
        {"containerPort": 6379, "name": "gcs"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 8000, "name": "serve"},
    ]
    head_pod = _pod(_container("ray-head", manifest, opts, opts.head_cpu, opts.head_memory, 0, head_ports),
                    manifest, opts)  # fmt: skip
    if sel := _selector(opts, gpu=False):
        head_pod["nodeSelector"] = sel
    groups = []
    for role, pool in manifest.pools().items():
        p = pool.placement
        gpus = (
            p.num_gpus
            if p.num_gpus is not None
            else (
                float(manifest.tensor_parallel_size(role))  # a GPU per tensor-parallel rank of a replica
                if any(d.startswith("cuda") for d in pool.devices) or manifest.model.device.startswith("cuda")
                else 0.0
            )
        )
        resources = {**p.resources}
        params = {"num-gpus": _quantity(gpus)} if gpus else {}
        if resources:  # `ray start --resources`, quoted as KubeRay passes it through a shell
            params["resources"] = f"'{json.dumps(resources)}'"
        pod = _pod(_container("ray-worker", manifest, opts, opts.worker_cpu, opts.worker_memory, gpus),
                   manifest, opts)  # fmt: skip
        if sel := _selector(opts, gpu=bool(gpus)):
            pod["nodeSelector"] = sel
        if gpus:
            pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        lo = pool.min_replicas if pool.min_replicas is not None else pool.replicas
        hi = pool.max_replicas if pool.max_replicas is not None else pool.replicas
        groups.append(
            {
                "groupName": role,
                "replicas": pool.replicas,
                "minReplicas": lo,
                "maxReplicas": max(hi, pool.replicas),
                "rayStartParams": params,
                "template": {"metadata": {"labels": {"splitserve/role": role}}, "spec": pod},
            }
        )
    metadata: dict[str, Any] = {"name": manifest.name, "labels": {"app.kubernetes.io/name": "splitserve"}}
    if opts.namespace:
        metadata["namespace"] = opts.namespace
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": metadata,
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": _ray_version(),
                "enableInTreeAutoscaling": any(p.min_replicas is not None for p in manifest.pools().values()),
                "headGroupSpec": {
                    "rayStartParams": {
                        "num-cpus": "0",
                        "num-gpus": "0",
                        "dashboard-host": "0.0.0.0",
                        "resources": f"'{json.dumps({ROUTER_RESOURCE: 100})}'",
                    },
                    "template": {"metadata": {"labels": {"splitserve/role": "head"}}, "spec": head_pod},
                },
                "workerGroupSpecs": groups,
            },
        },
    }


def _ray_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return "2.60.0"


def render_yaml(manifest: Manifest, opts: KubeRayOptions | None = None) -> str:
    opts = opts or KubeRayOptions()
    doc = render_rayservice(manifest, opts)
    head = [
        f"# RayService for splitserve deployment {manifest.name!r}, rendered by `splitserve render kuberay`.",
        f"# Create the KV secret first: kubectl create secret generic {opts.secret_name} "
        "--from-literal=kv-secret=$(openssl rand -hex 32)",
    ]
    head.append(f"# image: {opts.image} (docker build -f deploy/docker/Dockerfile -t {opts.image} .)")
    if _model_mount(manifest) and opts.model_pvc:
        head.append(f"# model: PersistentVolumeClaim {opts.model_pvc} mounted at {_model_mount(manifest)}")
    head += [f"# note: {n}" for n in opts.notes]
    return "\n".join(head) + "\n" + yaml.dump(doc, Dumper=_BlockDumper, sort_keys=False)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2) as literal blocks, as people write them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


__all__ = ["KubeRayOptions", "render_rayservice", "render_yaml"]
