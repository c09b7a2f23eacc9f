"""What the servers say about a run: /metrics before and after it, and CPU/GPU use while it ran.

From splitserve's Prometheus metrics (router/metrics.py), differenced over the run:
    TTFT as the router saw it and its parts: queue on the prefill worker, prefill, first decode;
    KV transfer seconds, bytes and transfers per backend (`kv_transfer_seconds{backend}`), and its share
    of TTFT = sum of KV fetch seconds / sum of TTFT seconds; "transfer incl. wait" = TTFT - queue -
    prefill - first decode (room on the decode worker + the fetch), per request;
    errors by status; the workers (`worker_up{worker,role}`), which cost is counted by for a URL target.
An endpoint that is not splitserve (no /metrics, or none of these names) gives empty sections.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

P = "splitserve:"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            key = (s.name, labels)
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


async def fetch_metrics(base_url: str, api_key: str | None = None) -> Samples | None:
    """GET /metrics, parsed; None when the endpoint has none. `?fresh=1`: splitserve's router answers
    with its next snapshot, taken after the request (other servers ignore the parameter)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30.0) as client:
            resp = await client.get("/metrics", params={"fresh": "1"})
        if resp.status_code != 200:
            return None
        return parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError):
        return None


def delta(before: Samples | None, after: Samples | None) -> Samples:
    if after is None:
        return {}
    before = before or {}
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _sum(d: Samples, name: str, **match: str) -> float:
    return sum(
        v
        for (n, labels), v in d.items()
        if n == name and all(dict(labels).get(k) == x for k, x in match.items())
    )


def _mean_ms(d: Samples, hist: str) -> float:
    count = _sum(d, f"{P}{hist}_count")
    return _sum(d, f"{P}{hist}_sum") / count * 1e3 if count else math.nan


def server_breakdown(d: Samples) -> dict:
    """TTFT parts and KV transfers over a run, from a /metrics delta."""
    ttft_sum, ttft_n = (
        _sum(d, f"{P}time_to_first_token_seconds_sum"),
        _sum(d, f"{P}time_to_first_token_seconds_count"),
    )
    kv: dict[str, dict] = {}
    for (name, labels), value in d.items():
        backend = dict(labels).get("backend")
        if name == f"{P}kv_transfer_seconds_count" and backend and value > 0:
            secs = _sum(d, f"{P}kv_transfer_seconds_sum", backend=backend)
            moved = _sum(d, f"{P}kv_transfer_bytes_total", backend=backend)
            outcomes = defaultdict(float)
            for (n2, l2), v2 in d.items():
                if n2 == f"{P}kv_transfers_total" and dict(l2).get("backend") == backend and v2 > 0:
                    outcomes[dict(l2).get("outcome", "?")] += v2
            kv[backend] = {
                "transfers": int(value),
                "seconds": secs,
                "mean_ms": secs / value * 1e3,
                "bytes": int(moved),
                "mean_mib": moved / value / 2**20,
                "outcomes": {k: int(v) for k, v in outcomes.items()},
            }
    kv_secs = sum(b["seconds"] for b in kv.values())
    parts = {
        name: _mean_ms(d, f"request_{name}_time_seconds") for name in ("queue", "prefill", "first_decode")
    }
    ttft_ms = ttft_sum / ttft_n * 1e3 if ttft_n else math.nan
    residual = ttft_ms - sum(v for v in parts.values() if not math.isnan(v))
    # the transfer's share of TTFT counts what TTFT waited for: a streamed first token that went ahead
    # of the transfer (`router.first_token: prefill`) waited for none of it; NaN: no transfer at all
    on_path = max(0.0, residual) * ttft_n / 1e3 if ttft_n else 0.0
    errors = {
        dict(labels).get("status", "?"): int(v)
        for (n, labels), v in d.items()
        if n == f"{P}request_errors_total" and v > 0
    }
    return {
        "ttft_ms": ttft_ms,
        "queue_ms": parts["queue"],
        "prefill_ms": parts["prefill"],
        "transfer_incl_wait_ms": max(0.0, residual) if kv else 0.0,
        "first_decode_ms": parts["first_decode"],
        "kv": kv,
        "kv_seconds": kv_secs,
        "kv_share_of_ttft": min(kv_secs, on_path) / ttft_sum if ttft_sum > 0 and kv else math.nan,
        "errors_by_status": errors,
        "generation_tokens": int(_sum(d, f"{P}generation_tokens_total")),
        "prompt_tokens": int(_sum(d, f"{P}prompt_tokens_total")),
    }


def workers(samples: Samples | None) -> list[dict[str, str]]:
    """The deployment's workers, from `worker_up{worker,role}` (what cost is counted by)."""
    found = []
    for (name, labels), _ in (samples or {}).items():
        if name == f"{P}worker_up":
            lab = dict(labels)
            found.append({"worker": lab.get("worker", "?"), "role": lab.get("role", "?")})
    return sorted(found, key=lambda w: w["worker"])


class UtilSampler:
    """CPU use over a run, from CPU-time deltas (psutil, else /proc/stat for the host only): the host's,
    one process tree's (a started deployment), this client's, and the rest (other processes: the
    interference a shared machine adds); GPU utilization sampled each second from nvidia-smi."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self._gpu: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> UtilSampler:
        self._t0 = time.perf_counter()
        self._self0 = time.process_time()
        self._host0 = _host_cpu()
        self._tree0 = _tree_cpu(self.pid)
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._poll_gpu, daemon=True)
            self._thread.start()
        return self

    def stop(self, extra_client_cpu_s: float = 0.0) -> dict:
        """The figures since start(); `extra_client_cpu_s`: CPU seconds of client processes other than
        this one (splitserve.ab.procs), counted as the client's, not as other processes'."""
        wall = max(time.perf_counter() - self._t0, 1e-9)
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        host1, tree1 = _host_cpu(), _tree_cpu(self.pid)
        cores = os.cpu_count() or 1
        out: dict = {
            "host_cores": cores,
            "cpu_host_pct": math.nan,  # all cores busy = 100
            "cpu_deployment_cores": math.nan,  # the started deployment's processes
            # the load client: this process and its other processes
            "cpu_client_cores": (time.process_time() - self._self0 + extra_client_cpu_s) / wall,
            "cpu_other_cores": math.nan,  # everything else on the host: interference
            "gpu_util_pct": None,
        }
        if self._host0 and host1:
            # clamped: busy = total - idle in floats of seconds since boot, so an interval with nothing
            # new can come out a rounding error below 0 (seen: -7e-10)
            busy = min(1.0, max(0.0, (host1[0] - self._host0[0]) / max(host1[1] - self._host0[1], 1e-9)))
            out["cpu_host_pct"] = 100.0 * busy
        if tree1 is not None and self._tree0 is not None:
            used = sum(t - self._tree0.get(pid, 0.0) for pid, t in tree1.items())
            out["cpu_deployment_cores"] = used / wall
            other = out["cpu_host_pct"] / 100 * cores - out["cpu_deployment_cores"] - out["cpu_client_cores"]
            out["cpu_other_cores"] = max(0.0, other)
        if self._gpu:
            out["gpu_util_pct"] = sum(self._gpu) / len(self._gpu)
        return out

    def _poll_gpu(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        while not self._stop.wait(1.0):
            try:
                text = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
                vals = [float(x) for x in text.split()]
            except (OSError, ValueError, subprocess.SubprocessError):
                return
            if vals:
                self._gpu.append(sum(vals) / len(vals))


def _host_cpu() -> tuple[float, float] | None:
    """(busy seconds, total seconds) of all cores since boot."""
    try:
        import psutil

        t = psutil.cpu_times()
        total = sum(t)
        return total - t.idle - getattr(t, "iowait", 0.0), total
    except ImportError:
        pass
    try:
        with open("/proc/stat") as f:
            vals = [float(x) for x in f.readline().split()[1:]]
        return sum(vals) - vals[3] - vals[4], sum(vals)
    except (OSError, IndexError, ValueError):
        return None


def _tree_cpu(pid: int | None) -> dict[int, float] | None:
    """CPU seconds (user + system) of a process and its descendants, by pid (None without psutil)."""
    if pid is None:
        return None
    try:
        import psutil

        root = psutil.Process(pid)
        out = {}
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out
    except Exception:  # psutil missing, or the process gone
        return None


__all__ = ["UtilSampler", "delta", "fetch_metrics", "parse_metrics", "server_breakdown", "workers"]
