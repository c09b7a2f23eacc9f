"""`splitserve render kuberay`: the RayService a manifest becomes, pinned field by field, validated
against KubeRay's real RayService CRD (vendored: tests/runtime/data/ray.io_rayservices.yaml.gz) and
checked against the Kubernetes Pod Security Standards (tests/runtime/pss.py): `restricted` for the tcp
and nccl layouts, `baseline` but for nixl's one documented capability (IPC_LOCK).
"""

from __future__ import annotations

import functools
import gzip
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from splitserve.config import load_manifest, parse_manifest
from splitserve.runtime.kuberay import IPC_LOCK_NOTE, KubeRayOptions, render_rayservice

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pss  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CRD = Path(__file__).resolve().parent / "data" / "ray.io_rayservices.yaml.gz"
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _crd_schema() -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    spec = yaml.load(gzip.decompress(CRD.read_bytes()), Loader=loader)
    return next(v for v in spec["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]


def _unknown_fields(doc: object, schema: dict, path: str = "") -> list[str]:
    """Fields the CRD does not declare (the API server drops them, or refuses them under
    `kubectl apply --validate=strict`): what jsonschema alone lets through."""
    out = []
    if isinstance(doc, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, value in doc.items():
            if props is not None and key in props:
                out += _unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None:
                out.append(f"{path}.{key}")
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(doc):
            out += _unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


def _render(**opts) -> dict:
    manifest = load_manifest(EXAMPLES / "reference-qwen35-9b.yaml")
    return render_rayservice(manifest, KubeRayOptions(**opts))


@functools.cache
def _crd_validator() -> jsonschema.Draft4Validator:
    """The CRD's schema checked once (jsonschema.validate would check the 1 MB schema on every call)."""
    schema = _crd_schema()
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def _validate(doc: dict) -> None:
    _crd_validator().validate(doc)
    assert not _unknown_fields(doc, _crd_schema())


def test_the_crd_check_catches_a_typo_and_a_wrong_type():
    doc = render_rayservice(parse_manifest("transport: {backend: tcp}"))
    head = doc["spec"]["rayClusterConfig"]["headGroupSpec"]
    head["template"]["spec"]["containers"][0]["imagePullPolicyy"] = 1
    assert _unknown_fields(doc, _crd_schema()) == [
        ".spec.rayClusterConfig.headGroupSpec.template.spec.containers[0].imagePullPolicyy"
    ]
    doc = render_rayservice(parse_manifest("transport: {backend: tcp}"))
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        _crd_validator().validate(doc)


RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def test_reference_deployment_renders_gpu_groups_on_a_cpu_head():
    doc = _render(zone="us-west-2a", instance_type="p5.48xlarge", efa_per_pod=1)
    _validate(doc)
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0" and head["rayStartParams"]["num-gpus"] == "0"
    head_c = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head_c["resources"]["limits"]
    assert head_c["securityContext"] == RESTRICTED_CONTAINER
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
            **RESTRICTED_CONTAINER,
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
    assert "IPC_LOCK added" in out.stdout and "pod-security.kubernetes.io/enforce=privileged" in out.stdout
    assert "# image: splitserve:0.1.0-ray2.60.0 (docker build -f deploy/docker/Dockerfile" in out.stdout
    doc = yaml.safe_load(out.stdout)
    _validate(doc)
    assert doc["kind"] == "RayService"


LAYOUTS = {
    "tcp": "transport: {backend: tcp}\nmodel: {source: /models/qwen3-8b, device: cuda}",
    "nccl": "transport: {backend: nccl}\nmodel: {source: /models/qwen3-8b, device: cuda}",
    "colocated": "mode: colocated\nmodel: {source: /models/qwen3-8b, device: cuda}",
    "cpu-tcp": "transport: {backend: tcp}",
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tcp_nccl_and_colocated_pods_pass_restricted(layout):
    doc = render_rayservice(parse_manifest(LAYOUTS[layout]))
    _validate(doc)
    for group, pod in pss.pods(doc).items():
        assert pss.restricted(pod) == [], (layout, group)


def test_nixl_pods_pass_baseline_but_for_the_documented_capability():
    opts = KubeRayOptions()
    doc = _render_with(opts)
    _validate(doc)
    found = pss.pods(doc)
    assert pss.restricted(found["head"]) == []
    for group in ("prefill", "decode"):
        assert pss.baseline(found[group]) == ["non-default capabilities: ray-worker adds ['IPC_LOCK']"]
        assert pss.restricted(found[group]) == [
            "non-default capabilities: ray-worker adds ['IPC_LOCK']",
            "unrestricted capabilities: ray-worker adds ['IPC_LOCK']",
        ]
    assert opts.notes == [IPC_LOCK_NOTE]


def _render_with(opts: KubeRayOptions) -> dict:
    return render_rayservice(load_manifest(EXAMPLES / "reference-qwen35-9b.yaml"), opts)


def test_the_checker_refuses_what_restricted_forbids():
    doc = render_rayservice(parse_manifest(LAYOUTS["tcp"]))
    pod = pss.pods(doc)["prefill"]
    pod["securityContext"]["runAsNonRoot"] = False
    pod["containers"][0]["securityContext"].pop("runAsNonRoot")
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    pod["containers"][0]["securityContext"]["privileged"] = True
    assert pss.restricted(pod) == [
        "hostPath volumes: host", "privileged: ray-worker", "restricted volume types: host is ['hostPath']",
        "runAsNonRoot != true: ray-worker",
    ]  # fmt: skip


def test_image_and_volumes_are_named():
    doc = _render(model_pvc="models-rwx", shm_size="32Gi")
    for group, pod in pss.pods(doc).items():
        c = pod["containers"][0]
        assert c["image"] == "splitserve:0.1.0-ray2.60.0", group
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
        claim = {"claimName": "models-rwx", "readOnly": True}
        assert {"name": "model", "persistentVolumeClaim": claim} in pod["volumes"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert pod["securityContext"]["runAsUser"] == 1000
    no_model = render_rayservice(parse_manifest("transport: {backend: tcp}"))  # the embedded default model
    assert [v["name"] for v in pss.pods(no_model)["head"]["volumes"]] == ["dshm"]
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert "FROM rayproject/ray:${RAY_VERSION}" in dockerfile and "USER 1000:100" in dockerfile
