"""A real Prometheus scrapes a running deployment; every alert rule must fire on the first event of its
kind, within its `for:` window; every dashboard query must return data.

What it runs: `splitserve serve` (disaggregated: 1 prefill + 2 decode workers, the default model) set
up so that each alert's condition can be caused, then Debian's `prometheus` (apt-get install
prometheus) scraping the router's /metrics and every worker's own /metrics (vLLM's names) every second,
with deploy/prometheus/alerts.yaml as its rule file, evaluated every second. Events, in order:

  startup    transport nixl (not installed here) with fallback [tcp]: the worker falls back
             (KVFallbackTaken; KVBackendNotRequired, `for: 1m`); the KV transfer throttled to
             --throttle-gbps, below verify.min_gbps (KVBandwidthLow, `for: 2m`) and slow enough to
             be most of TTFT under the steady load that runs throughout, one request at a time with
             a prompt of five KV blocks (KVShareOfTTFTHigh, `for: 10m`)
  kv-fault   the prefill worker hangs up every KV fetch (fault injection) for a few seconds: requests
             fail (KVTransferFailures) and so do the run-time probes (KVProbeFailing)
  restart    decode-1 is SIGKILLed and restarts (WorkerRestarted); killed again it has used its one
             restart and stays down (WorkerDown, `for: 1m`)
  overload   bursts beyond max_concurrent_requests + max_queued_requests: 429s (Overloaded, `for: 5m`)

SplitserveKVBlocksHeldByLateCopies needs a failed cuda_ipc copy still running on a GPU: it cannot be
caused on a CPU machine and is reported as such.

`--scale N` divides every `for:` and every range window of the rules by N (a copy of the file; the
table shows the durations as run): `--scale 1` takes the real windows (over 10 minutes, for
KVShareOfTTFTHigh); the default, 10, about 2 minutes. Each alert passes when it fires no later than its
(scaled) `for:` plus 3 s (scrape and evaluation intervals) after its event; KVProbeFailing 2.5 s more
(the next probe has to run and fail first).

    python bench/prometheus_alerts.py               # prints the table; exit 0 when every row passes
    python bench/prometheus_alerts.py --scale 1     # the shipped windows, unscaled
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitserve.config import parse_manifest  # noqa: E402
from splitserve.runtime.process import ServeProcess, start_serve  # noqa: E402
from splitserve.wire.auth import worker_headers  # noqa: E402

RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "splitserve-dashboard.json"
SECRET = os.environ.setdefault("SPLITSERVE_KV_SECRET", "splitserve-bench-secret-0123456789abcdef")
KEY = "sk-bench"
LOAD_PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. " * 3
# the first failed probe comes up to one probe interval (1 s) plus one throttled probe (one 8-token block,
# 368 KiB: 1.2 s at 0.0003 GB/s) after the fault
PROBE_S = 2.5
GPU_ONLY = {"SplitserveKVBlocksHeldByLateCopies": "needs a late cuda_ipc copy on a GPU"}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _epoch(stamp: str) -> float:
    """Prometheus' RFC 3339 time (nanoseconds, Z) -> seconds since the epoch."""
    from datetime import datetime

    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(head + "+00:00").timestamp() + float(f"0.{frac or 0}")


def seconds(text: str) -> float:
    return sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+)([smhd])", text))


def scaled_rules(scale: float, out: Path) -> dict[str, float]:
    """The rule file with `for:` and range windows divided by `scale`; -> alert -> its `for:` in s."""
    doc = yaml.safe_load(RULES.read_text())
    fors = {}

    def window(m: re.Match) -> str:
        return f"[{max(2, round(seconds(m.group(1)) / scale))}s]"

    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["expr"] = re.sub(r"\[(\d+[smhd])\]", window, rule["expr"])
            if "for" in rule:
                rule["for"] = f"{max(1, round(seconds(rule['for']) / scale))}s"
            fors[rule["alert"]] = seconds(rule.get("for", "0s"))
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return fors


def deployment(throttle_gbps: float) -> ServeProcess:
    manifest = {
        "mode": "disaggregated",
        "model": {"max_model_len": 512},
        "engine": {"kv_cache_mb": 64, "max_num_seqs": 8, "block_size": 8},  # a small probe (one block)
        "decode": {"replicas": 2},
        "transport": {"backend": "nixl", "fallback": ["tcp"], "policy": "fail"},
        "router": {"policy": "round_robin"},
        "server": {"port": 0, "api_keys": [KEY], "max_concurrent_requests": 3, "max_queued_requests": 1,
                   "log_stats_interval_s": 5},
        "runtime": {"health_interval_s": 0.5, "restart_backoff_s": 0.5, "max_restarts": 1,
                    "worker_args": ["--enable-fault-injection", "--kv-throttle-gbps", str(throttle_gbps)]},
        "verify": {"probe_interval_s": 1, "runtime_probe_mb": 0.05, "min_gbps": 0.2},
    }  # fmt: skip
    return start_serve(parse_manifest(yaml.safe_dump(manifest), "bench manifest"), 300)


def prometheus(workdir: Path, router: str, workers: list[str], rules: Path, port: int) -> subprocess.Popen:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": "splitserve-router",
                "static_configs": [{"targets": [router]}],
                "authorization": {"type": "Bearer", "credentials": KEY},
            },  # /metrics wants the API key too
            {"job_name": "splitserve-workers", "static_configs": [{"targets": workers}]},
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not installed: apt-get install -y prometheus")
    return subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(workdir / "prometheus.log", "w"),
    )  # fmt: skip


class Bench:
    def __init__(self, sp: ServeProcess, prom: str) -> None:
        self.sp, self.prom = sp, prom
        self.h = {"Authorization": f"Bearer {KEY}"}
        self.events: dict[str, float] = {}
        self.fired: dict[str, list[float]] = {}  # alert -> each time it started firing
        self.active: dict[str, float] = {}  # alert -> when its expression first held (activeAt)
        self.stop = threading.Event()
        self.statuses: dict[int, int] = {}

    def admin(self) -> dict:
        return httpx.get(f"{self.sp.url}/admin/deployment", headers=self.h, timeout=10).json()

    def request(self, prompt: str = "The capital of France is", tokens: int = 4) -> int:
        body = {"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        try:
            r = httpx.post(f"{self.sp.url}/v1/completions", json=body, headers=self.h, timeout=60)
            code = r.status_code
        except httpx.HTTPError:
            code = -1
        self.statuses[code] = self.statuses.get(code, 0) + 1
        return code

    def load(self) -> None:  # one request at a time, all along: a prompt of 5 KV blocks to move
        while not self.stop.is_set():
            self.request(LOAD_PROMPT)

    def watch(self) -> None:  # when each alert starts firing (again)
        before: set[str] = set()
        while not self.stop.is_set():
            try:
                alerts = httpx.get(f"{self.prom}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
            except (httpx.HTTPError, ValueError, KeyError):
                alerts = []
            for a in alerts:  # when Prometheus first saw the condition (pending, before `for:` ran)
                self.active.setdefault(a["labels"]["alertname"], _epoch(a["activeAt"]))
            now = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
            for name in now - before:
                self.fired.setdefault(name, []).append(time.time())
            before = now
            time.sleep(0.5)

    def fired_after(self, alert: str, event: str) -> float | None:
        """Seconds from `event` to the alert's first start of firing at or after it. A startup condition
        (there before Prometheus) counts from when Prometheus first saw it hold: for the KV share of
        TTFT, once the first requests have finished."""
        t0 = self.events[event]
        if event == "startup" and alert in self.active:
            t0 = self.active[alert]
        return next((t - t0 for t in self.fired.get(alert, []) if t >= t0), None)

    def query(self, expr: str) -> list:
        r = httpx.get(f"{self.prom}/api/v1/query", params={"query": expr}, timeout=10).json()
        return r["data"]["result"] if r.get("status") == "success" else []

    def wait_scraped(self) -> None:
        deadline = time.time() + 60
        while not self.query('splitserve:worker_restarts_total{worker="decode-1"} == 0'):
            if time.time() > deadline:
                raise SystemExit("Prometheus never scraped the router's zero-valued counters")
            time.sleep(0.5)

    def kv_fault(self, seconds_: float = 4.0) -> None:
        (url,) = [w["url"] for w in self.admin()["workers"] if w["role"] == "prefill"]
        post = lambda knobs: httpx.post(f"{url}/debug/faults", json=knobs, headers=worker_headers(SECRET))  # noqa: E731
        post({"kill": 1.0}).raise_for_status()
        self.events["kv-fault"] = time.time()
        end = time.time() + seconds_
        while time.time() < end:
            self.request()
        post({}).raise_for_status()

    def kill_decode(self, wait_ready: bool) -> None:
        (w,) = [w for w in self.admin()["workers"] if w["name"] == "decode-1"]
        os.kill(w["pid"], signal.SIGKILL)
        deadline = time.time() + 120
        while wait_ready and time.time() < deadline:
            time.sleep(0.5)
            (w2,) = [w for w in self.admin()["workers"] if w["name"] == "decode-1"]
            if w2["state"] == "ready" and w2["pid"] != w["pid"]:
                return

    def overload(self, until: float) -> None:
        self.events["overload"] = time.time()
        while time.time() < until and self.fired_after("SplitserveOverloaded", "overload") is None:
            threads = [threading.Thread(target=self.request, args=("Tell me a story", 16)) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()


EVENT_OF = {
    "SplitserveKVBackendNotRequired": "startup", "SplitserveKVFallbackTaken": "startup",
    "SplitserveKVBandwidthLow": "startup", "SplitserveKVShareOfTTFTHigh": "startup",
    "SplitserveKVProbeFailing": "kv-fault", "SplitserveKVTransferFailures": "kv-fault",
    "SplitserveWorkerRestarted": "restart", "SplitserveWorkerDown": "down",
    "SplitserveOverloaded": "overload",
}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="splitserve-prom-"))
    fors = scaled_rules(args.scale, workdir / "alerts.yaml")
    sp = deployment(args.throttle_gbps)
    prom_proc = None
    try:
        workers = [w["url"].removeprefix("http://") for w in sp.ready["workers"]]
        prom_proc = prometheus(workdir, sp.url.removeprefix("http://"), workers, workdir / "alerts.yaml",
                               args.prometheus_port)  # fmt: skip
        b = Bench(sp, f"http://127.0.0.1:{args.prometheus_port}")
        threading.Thread(target=b.watch, daemon=True).start()
        b.wait_scraped()  # the startup conditions (fallback, slow KV) are there from the first scrape on
        b.events["startup"] = time.time()
        threading.Thread(target=b.load, daemon=True).start()
        time.sleep(3)
        b.kv_fault()
        time.sleep(3)
        b.events["restart"] = time.time()
        b.kill_decode(wait_ready=True)
        time.sleep(2)
        b.events["down"] = time.time()
        b.kill_decode(wait_ready=False)
        longest = max(fors.values()) + 15
        b.overload(time.time() + fors["SplitserveOverloaded"] + 15)
        deadline = b.events["startup"] + longest + 60
        while time.time() < deadline and any(b.fired_after(a, e) is None for a, e in EVENT_OF.items()):
            time.sleep(1)
        dash = dashboard_rows(b)
        b.stop.set()
    finally:
        if prom_proc is not None:
            prom_proc.terminate()
            prom_proc.wait(10)
        code = sp.stop()
    ok = report(b, fors, dash, args.scale, code)
    return 0 if ok else 1


def dashboard_rows(b: Bench) -> list[tuple[str, str, list]]:
    rows = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in panel["targets"]:
            expr = t["expr"].replace("$model", ".*")
            rows.append((panel["title"], expr, b.query(expr)))
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):  # what a gateway scrapes
        rows.append(("worker endpoints (Gateway API Inference Extension)", name, b.query(name)))
    return rows


def report(b: Bench, fors: dict[str, float], dash: list, scale: float, code: int) -> bool:
    ok = True
    print(f"\nalerts (deploy/prometheus/alerts.yaml, windows / {scale:g}); requests by status: {b.statuses}")
    print(f"{'alert':38} {'event':9} {'for':>6} {'fired after':>12} {'limit':>7}  result")
    for alert, f in fors.items():
        if alert in GPU_ONLY:
            print(f"{alert:38} {'-':9} {f:6.0f} {'-':>12} {'-':>7}  not run: {GPU_ONLY[alert]}")
            continue
        event = EVENT_OF[alert]
        limit = f + 3 + (PROBE_S if alert == "SplitserveKVProbeFailing" else 0)
        after = b.fired_after(alert, event)
        good = after is not None and after <= limit
        ok &= good
        shown = f"{after:10.1f} s" if after is not None else "never"
        print(f"{alert:38} {event:9} {f:5.0f}s {shown:>12} {limit:6.0f}s  {'PASS' if good else 'FAIL'}")
    print("\ndashboard queries (deploy/grafana/splitserve-dashboard.json, $model = .*)")
    for title, expr, result in dash:
        ok &= bool(result)
        first = f"{float(result[0]['value'][1]):.4g}" if result else "-"
        verdict = "PASS" if result else "FAIL"
        print(f"{verdict} {len(result):3d} series (first {first:>9})  {title}: {expr[:80]}")
    print(f"\nsplitserve serve exited {code}; {'every row passes' if ok else 'SOME ROWS FAIL'}")
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=10.0, help="divide the rules' windows by this")
    p.add_argument("--throttle-gbps", type=float, default=0.0003, help="the KV transfer's bandwidth")
    p.add_argument("--prometheus-port", type=int, default=19090)
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    main()
