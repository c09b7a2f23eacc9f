"""From the manifest to the simulator's engine knobs, and from the planner's choice back to a
manifest: the base manifest with its mode, pool sizes, devices, SLOs and price set to the plan's."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from splitserve.ab.metrics import SLO
from splitserve.config.engine import CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS
from splitserve.config.manifest import Manifest, dump_manifest, parse_manifest
from splitserve.plan.profile import Profile
from splitserve.plan.replica import EngineLimits
from splitserve.plan.simulator import Deployment

if TYPE_CHECKING:
    from splitserve.plan.search import Choice


def device_kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


def limits_for(manifest: Manifest, role: str, profile: Profile) -> EngineLimits:
    """A role's engine knobs as the simulator needs them (its step budget resolved as the engine does)."""
    e = manifest.engine_for(role)
    budget = e.max_num_batched_tokens
    if budget is None:
        budget = GPU_BATCHED_TOKENS if device_kind(profile.device) == "cuda" else CPU_BATCHED_TOKENS
    return EngineLimits(budget, e.max_num_seqs, e.block_size, e.enable_prefix_caching)


def plan_manifest(
    base: Manifest, deployment: Deployment, profile: Profile, slo: SLO, usd_per_device_hour: float
) -> Manifest:
    """`base` deploying `deployment`. On CUDA each replica gets its own device (cuda:0, cuda:1, ...,
    prefill first); on a CPU the workers share the host's cores, as the base manifest says."""
    data = base.model_dump(mode="json", exclude={"transport": {"secret"}, "server": {"api_keys"}})
    cuda = device_kind(profile.device) == "cuda"
    if deployment.disaggregated:
        data["mode"] = "disaggregated"
        data["prefill"]["replicas"], data["decode"]["replicas"] = deployment.prefill, deployment.decode
        if cuda:
            data["prefill"]["devices"] = [f"cuda:{i}" for i in range(deployment.prefill)]
            data["decode"]["devices"] = [f"cuda:{deployment.prefill + i}" for i in range(deployment.decode)]
    else:
        data["mode"] = "colocated"
        data["colocated"]["replicas"] = deployment.decode
        if cuda:
            data["colocated"]["devices"] = [f"cuda:{i}" for i in range(deployment.decode)]
    data["slos"] = {"ttft_ms": slo.ttft_ms, "itl_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms}
    if usd_per_device_hour == usd_per_device_hour:  # not NaN
        data["prices"]["usd_per_hour"][device_kind(profile.device)] = usd_per_device_hour
    return Manifest.model_validate(data)


def write_manifest(path: Path, manifest: Manifest, choice: Choice, target: float, workload: str) -> None:
    """The manifest as YAML, headed by what it was chosen for; read back through the manifest parser
    before it is kept, so that a file the parser refuses is never written."""
    header = [
        f"# splitserve plan for {workload}",
        *(f"# {line}" for line in textwrap.wrap(choice.sentence(target), 100)),
        f"#   splitserve serve {path}",
    ]
    text = "\n".join(header) + "\n" + dump_manifest(manifest)
    parse_manifest(text, str(path))  # raises ManifestError (a ValueError) on a bad manifest
    path.write_text(text)


__all__ = ["device_kind", "limits_for", "plan_manifest", "write_manifest"]
