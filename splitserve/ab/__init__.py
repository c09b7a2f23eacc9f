"""splitserve.ab, the A/B behind the `splitserve bench` command: drive identical traces at deployments
(started from manifests or given by URL), measure them as `vllm bench serve` does, and write a report
with goodput, cost and a verdict.

workload (traces) -> client (streamed requests, timed) -> metrics (the math) + scrape (/metrics, CPU/GPU)
-> runner (targets and rate sweeps) -> verdict (rules) -> report (JSON, HTML, PNG plots); cli wires them.

This package ships with splitserve and is a user's tool (the A/B of two deployments). The repository's
top-level `bench/` scripts are not part of it: they are the developers' measurements of splitserve itself
(engine, kernels, transports, endpoint overhead), run from a checkout; `bench/README.md` lists them.
"""
