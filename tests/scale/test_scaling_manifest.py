"""The manifest's `scaling` section: the policy it makes (SLOs from `slos` unless given, each pool's
bounds), replicas outside the bounds refused by name, and the Serve autoscaling config of a pool."""

from __future__ import annotations

import pytest

from splitserve.config import parse_manifest
from splitserve.config.manifest_errors import ManifestError
from splitserve.scale.controller import policy

SCALED = """
scaling: {enabled: true, itl_ms: 80}
slos: {ttft_ms: 900, itl_ms: 200}
prefill: {replicas: 2, min_replicas: 1, max_replicas: 4}
decode: {replicas: 1}
"""


def test_policy_takes_the_slos_and_each_pools_bounds():
    p = policy(parse_manifest(SCALED))
    assert (p.ttft_s, p.itl_s) == (0.9, 0.08)  # TTFT from slos, ITL from scaling
    assert p.bounds == {"prefill": (1, 4), "decode": (1, 2)}  # decode: 1 .. twice its replicas
    off = parse_manifest("scaling: {enabled: false}\nprefill: {replicas: 3, max_replicas: 2}")
    assert off.prefill.replicas == 3  # bounds are not checked while scaling is off


def test_replicas_outside_the_bounds_are_refused():
    with pytest.raises(ManifestError, match=r"prefill.replicas \(5\) must lie within"):
        parse_manifest("scaling: {enabled: true}\nprefill: {replicas: 5, max_replicas: 4}")
    with pytest.raises(ManifestError, match="interval_s"):
        parse_manifest("scaling: {enabled: true, interval_s: 0}")


def test_a_pools_serve_autoscaling_follows_the_registry():
    pytest.importorskip("ray")
    from ray.serve.config import AutoscalingConfig

    from splitserve.runtime.ray_scale import FollowRegistry, autoscaling

    config = AutoscalingConfig(**autoscaling(parse_manifest(SCALED), "prefill", "x-registry"))
    assert (config.min_replicas, config.max_replicas, config.initial_replicas) == (1, 4, 2)
    assert config.upscale_delay_s == config.downscale_delay_s == 0
    assert config.policy.get_policy() is FollowRegistry
    assert config.policy.policy_kwargs == {
        "registry": "x-registry",
        "namespace": "splitserve",
        "role": "prefill",
    }
