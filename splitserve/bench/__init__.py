"""`splitserve bench`: drive identical traces at deployments (started from manifests or given by URL),
measure them as `vllm bench serve` does, and write a report with goodput, cost and a verdict.

workload (traces) -> client (streamed requests, timed) -> metrics (the math) + scrape (/metrics, CPU/GPU)
-> runner (targets and rate sweeps) -> verdict (rules) -> report (JSON, HTML, PNG plots); cli wires them.
"""
