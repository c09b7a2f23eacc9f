"""One local Ray cluster for every Ray test module (starting one takes seconds of a small host's CPU):
a head with no model resources, a prefill node and a decode node marked by custom resources, each with
room for two replicas (`prefill_node: 2`, `decode_node: 2`), and one port for Serve's HTTP proxy (Serve
keeps the port it first started on; each module's deployment is deleted at the module's end)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    mem = 150 * 2**20
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"head": 1}, "object_store_memory": mem,
                        "include_dashboard": False},
    )  # fmt: skip
    c.add_node(num_cpus=1, resources={"prefill_node": 2}, object_store_memory=mem)
    c.add_node(num_cpus=1, resources={"decode_node": 2}, object_store_memory=mem)
    ray.init(address=c.address, namespace="splitserve-test", logging_level="WARNING")
    yield c
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="session")
def serve_port(cluster) -> int:  # noqa: ANN001
    """The port of Serve's HTTP proxy, the same for every deployment of the session."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
