"""Where a tensor-parallel replica runs on Ray: one placement group per replica, one bundle per rank,
all on one node (STRICT_PACK), as Ray Serve LLM reserves the GPUs of a vLLM replica.

A replica at tensor_parallel_size n is one Serve actor (its engine core: rank 0) that starts ranks
1..n-1 as its own child processes (engine/tp/ranks.py). Serve creates the group with the replica and
removes it with the replica, and places the actor in bundle 0, which holds the actor's own resources
(its CPUs, custom resources and memory; one GPU on CUDA); bundles 1..n-1 hold one CPU (and one GPU)
for each further rank, on the same node, so that no other replica is placed on them.

    actor, group = replica_placement(actor_options, size, on_gpu)   # the deployment's options
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(rank_gpus())      # in the replica, on CUDA

On CUDA, Ray shows the actor only bundle 0's GPU; the ranks, its children, need theirs: `rank_gpus`
asks each other bundle for its GPU's id (a task of no CPU and that one GPU, run in that bundle), and
the replica lists them in rank order before its engine starts the ranks (rank r takes cuda:r).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

log = logging.getLogger(__name__)
STRATEGY = "STRICT_PACK"  # every rank of a replica on one node: the ranks meet over local sockets


def replica_placement(
    actor: dict[str, Any], size: int, on_gpu: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the replica actor's options, the deployment's placement-group options) for a replica of
    `size` ranks whose actor alone would ask for `actor` (ray_actor_options). Size 1: unchanged, no
    group."""
    if size == 1:
        return actor, {}
    actor = dict(actor)
    if on_gpu:
        actor["num_gpus"] = 1  # rank 0's: the others' are in their own bundles
    first: dict[str, float] = {"CPU": float(actor.get("num_cpus", 1)), **actor.get("resources", {})}
    if on_gpu:
        first["GPU"] = 1.0
    if actor.get("memory"):
        first["memory"] = float(actor["memory"])
    rank = {"CPU": 1.0, **({"GPU": 1.0} if on_gpu else {})}
    bundles = [{k: v for k, v in first.items() if v} or {"CPU": 0.01}] + [dict(rank) for _ in range(size - 1)]
    return actor, {"placement_group_bundles": bundles, "placement_group_strategy": STRATEGY}


@ray.remote(num_cpus=0)
def _gpu_ids() -> list[str]:
    return [str(g) for g in ray.get_gpu_ids()]


def rank_gpus(timeout_s: float = 60.0) -> list[str]:
    """In a replica actor placed in a group of one bundle per rank: the GPU id of each rank's bundle,
    rank order (bundle 0's is the actor's own). Empty outside such a group, or where the bundles hold
    no GPU."""
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) < 2 or not all(b.get("GPU") for b in group.bundle_specs):
        return []
    ids = [str(g) for g in ray.get_gpu_ids()][:1]
    tasks = [
        _gpu_ids.options(
            num_gpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
        ).remote()
        for i in range(1, len(group.bundle_specs))
    ]
    for got in ray.get(tasks, timeout=timeout_s):
        ids += got[:1]
    return ids


def show_rank_gpus() -> None:
    """Set CUDA_VISIBLE_DEVICES to the rank bundles' GPUs (rank order) when this replica has them."""
    ids = rank_gpus()
    if len(ids) > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
        log.info("tensor-parallel ranks on GPUs %s", os.environ["CUDA_VISIBLE_DEVICES"])


__all__ = ["STRATEGY", "rank_gpus", "replica_placement", "show_rank_gpus"]
