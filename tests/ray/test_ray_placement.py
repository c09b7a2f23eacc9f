"""A tensor-parallel replica's placement on a real (local) Ray cluster: Serve reserves one placement
group per replica, one bundle per rank, packed on one node (STRICT_PACK), and places the replica's
actor in its first bundle; the group goes with the replica. The session's cluster (conftest.py) gains a node
with two CPUs, marked by a custom resource, so that two ranks fit only on that node."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from splitserve.config import parse_manifest  # noqa: E402
from splitserve.runtime.ray_placement import STRATEGY, rank_gpus, replica_placement  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp_node(cluster, serve_port):  # noqa: ANN001
    """A node with two CPUs, marked `tp_node`, added to the session's cluster for this module; Serve on
    the session's port (it keeps the port it first started on)."""
    node = cluster.add_node(num_cpus=2, resources={"tp_node": 1}, object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
    yield node
    cluster.remove_node(node)


def test_a_replica_of_two_ranks_gets_a_group_of_two_bundles_on_one_node(tp_node):
    manifest = parse_manifest("""
name: tp
mode: colocated
model: {tensor_parallel_size: 2}
colocated: {replicas: 1, placement: {resources: {tp_node: 0.5}, num_cpus: 1}}
""")
    size = manifest.tensor_parallel_size("colocated")
    actor, group = replica_placement({"num_cpus": 1, "resources": {"tp_node": 0.5}}, size, on_gpu=False)
    assert group == {
        "placement_group_bundles": [{"CPU": 1.0, "tp_node": 0.5}, {"CPU": 1.0}],
        "placement_group_strategy": STRATEGY,
    }
    assert replica_placement(actor, 1, on_gpu=False) == (actor, {})

    class Where:  # defined here: Ray pickles it by value
        """Stands in for a worker replica: tells where it runs and which group holds it."""

        def __call__(self) -> dict:
            from ray.util.placement_group import get_current_placement_group

            pg = get_current_placement_group()
            return {
                "node": ray.get_runtime_context().get_node_id(),
                "group": pg.id.hex() if pg else None,
                "bundles": pg.bundle_specs if pg else [],
                "rank_gpus": rank_gpus(),
            }

    handle = serve.run(
        serve.deployment(Where, name="tp-colocated", ray_actor_options=actor, **group).bind(),
        name="tp",
        route_prefix=None,
    )
    got = handle.remote().result(timeout_s=120)
    tp_node = next(n["NodeID"] for n in ray.nodes() if "tp_node" in n["Resources"])
    assert got["node"] == tp_node and got["rank_gpus"] == []
    assert [dict(b) for b in got["bundles"]] == group["placement_group_bundles"]
    table = ray.util.placement_group_table()[got["group"]]
    assert table["strategy"] == STRATEGY and table["state"] == "CREATED"
    assert set(table["bundles_to_node_id"].values()) == {tp_node}
    serve.delete("tp")
    for _ in range(100):  # the group goes with the replica (Serve removes it once the actor is gone)
        if ray.util.placement_group_table()[got["group"]]["state"] == "REMOVED":
            break
        time.sleep(0.1)
    assert ray.util.placement_group_table()[got["group"]]["state"] == "REMOVED"


def test_gpu_replicas_put_one_gpu_in_each_rank_bundle():
    actor, group = replica_placement({"num_cpus": 2, "num_gpus": 4}, 4, on_gpu=True)
    assert actor["num_gpus"] == 1  # rank 0's; the others' are their bundles'
    assert group["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}] + [{"CPU": 1.0, "GPU": 1.0}] * 3
