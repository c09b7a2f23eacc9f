"""`splitserve render kuberay`: the RayService a manifest becomes, pinned field by field.

KubeRay's RayService CRD cannot be fetched here (no network beyond package registries), so the render is
checked against a schema of the fields we emit, written for this test from the CRD's structure (the
types of a Kubernetes pod template: quantities as strings, env with secretKeyRef, securityContext
capabilities). Point SPLITSERVE_RAYSERVICE_CRD at ray.io_rayservices.yaml to validate against the CRD's
own openAPIV3Schema as well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from splitserve.config import load_manifest, parse_manifest
from splitserve.runtime.kuberay import KubeRayOptions, render_rayservice

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SCHEMA = json.loads((Path(__file__).resolve().parent / "data" / "rayservice_fields.schema.json").read_text())


def _render(**opts) -> dict:
    manifest = load_manifest(EXAMPLES / "reference-qwen35-9b.yaml")
    return render_rayservice(manifest, KubeRayOptions(**opts))


def _validate(doc: dict) -> None:
    jsonschema.validate(doc, SCHEMA)
    crd = os.environ.get("SPLITSERVE_RAYSERVICE_CRD")
    if crd:
        spec = yaml.safe_load(Path(crd).read_text())
        schema = next(v for v in spec["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
        jsonschema.validate(doc, schema)


def test_reference_deployment_renders_gpu_groups_on_a_cpu_head():
    doc = _render(zone="us-west-2a", instance_type="p5.48xlarge", efa_per_pod=1)
    _validate(doc)
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    head_c = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head_c["resources"]["limits"]
    assert head_c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, g in groups.items():
        assert json.loads(g["rayStartParams"]["resources"].strip("'")) == {f"{role}_node": 1.0}
        spec = g["template"]["spec"]
        c = spec["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "1"
        assert spec["nodeSelector"] == {
            "topology.kubernetes.io/zone": "us-west-2a",
            "node.kubernetes.io/instance-type": "p5.48xlarge",
        }
        # least privilege: never privileged; only IPC_LOCK, for nixl's RDMA memory registration
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
        }
        secret = next(e for e in c["env"] if e["name"] == "SPLITSERVE_KV_SECRET")
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "splitserve-kv", "key": "kv-secret"}
    assert "privileged" not in json.dumps(doc)


def test_serve_config_builds_the_manifest_with_the_router_on_the_head():
    doc = _render()
    config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    app = config["applications"][0]
    assert app["import_path"] == "splitserve.runtime.ray_serve:app_builder"
    m = app["args"]["manifest"]
    assert m["runtime"]["kind"] == "ray"
    assert m["runtime"]["router_placement"]["resources"] == {"splitserve_router": 1}
    assert m["transport"]["backend"] == "nixl" and "secret" not in m["transport"]
    parse_manifest(yaml.safe_dump(m))  # the embedded manifest is a valid manifest


def test_tcp_without_gpus_adds_no_capability_and_same_host_transports_are_refused():
    m = parse_manifest("transport: {backend: tcp}\nprefill: {placement: {resources: {p: 1}}}")
    doc = render_rayservice(m)
    _validate(doc)
    for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        c = g["template"]["spec"]["containers"][0]
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
    with pytest.raises(ValueError, match="only within one host"):
        render_rayservice(parse_manifest("transport: {backend: shm}"))


def test_render_cli():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.cli",
            "render",
            "kuberay",
            str(EXAMPLES / "reference-qwen35-9b.yaml"),
            "--efa-per-pod",
            "2",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "IPC_LOCK added" in out.stdout
    doc = yaml.safe_load(out.stdout)
    _validate(doc)
    assert doc["kind"] == "RayService"
