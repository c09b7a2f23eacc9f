"""A deployment's first start and warm restarts: time to ready, time to the first token of the README's
question, and where each process's start-up time went.

For each mode (the default `splitserve serve`, disaggregated, and `--mode colocated`): one first start
after setup, then `--runs` warm restarts (the same deployment stopped and started again, caches and page
cache warm), each a fresh `splitserve serve` process:
  - ready: from the command's spawn to its ready event (the port answers 503 "starting" meanwhile: the
    polls of /health during start-up are counted, with their slowest answer);
  - first token: the README's question ("What is the capital of France?", temperature 0, streamed)
    sent at once after ready: the seconds to its first content chunk, and from the spawn;
  - the per-process breakdown the ready line prints (runtime/startup_report.py).
Each figure beside its goal (ready: 3 s disaggregated, 2 s colocated on 2 cores) and the ratio.

`--fresh` first runs `python -m splitserve.model.prepare` (what scripts/setup.sh runs) into empty cache
directories ($SPLITSERVE_CACHE_DIR, $TORCH_EXTENSIONS_DIR) and times it, so that the first start is a
fresh clone's.

    python bench/first_start.py                  # both modes, 3 warm restarts each
    python bench/first_start.py --fresh --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a bare checkout, too
GOALS = {"disaggregated": 3.0, "colocated": 2.0}
QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        rows = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
        return rows[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return platform.processor() or "unknown CPU"


def poll_starting(url: str, stop: threading.Event, seen: list[float]) -> None:
    """GET /health until `stop`: the seconds of each 503 answer (connection refused: not bound yet)."""
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = client.get(f"{url}/health")
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            if r.status_code == 503:
                seen.append(time.perf_counter() - t0)
            time.sleep(0.05)


def first_token(url: str) -> tuple[float, str]:
    """The README's question, streamed: (seconds to the first content chunk, the whole answer)."""
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0, "max_tokens": 32, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    first, text = None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        for raw in r.iter_lines():
            if not raw.startswith("data: ") or raw == "data: [DONE]":
                continue
            delta = json.loads(raw[6:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter() - t0
            text.append(delta)
    return (first if first is not None else float("nan")), "".join(text)


def one_start(mode: str, env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "splitserve.cli", "serve", "--mode", mode, "--port", str(port)]
    cmd.append("--no-progress")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    stop, seen = threading.Event(), []
    poller = threading.Thread(target=poll_starting, args=(url, stop, seen), daemon=True)
    poller.start()
    ready, log = None, []
    assert proc.stderr is not None
    for line in proc.stderr:
        log.append(line.rstrip())
        if line.startswith('{"event": "ready"'):
            ready = json.loads(line)
            break
    ready_s = time.perf_counter() - t0
    stop.set()
    poller.join()
    try:
        if ready is None:
            raise RuntimeError("splitserve serve did not start:\n" + "\n".join(log[-40:]))
        ttft, answer = first_token(url)
        return {"ready_s": ready_s, "ttft_s": ttft, "first_token_from_spawn_s": ready_s + ttft,
                "answer": answer, "startup": ready["startup"],
                "starting_503s": len(seen), "slowest_503_ms": 1e3 * max(seen, default=0.0)}  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prepare(env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "splitserve.model.prepare"], env=env, cwd=ROOT, check=True)
    return time.perf_counter() - t0


def show(mode: str, kind: str, r: dict[str, Any]) -> None:
    from splitserve.runtime.startup_report import line

    goal = GOALS[mode]
    ratio = r["ready_s"] / goal
    print(f"{mode:13s} {kind:13s} ready {r['ready_s']:5.2f} s (goal {goal:.1f} s, ratio {ratio:.2f})"
          f" | first token {1e3 * r['ttft_s']:4.0f} ms after ready, {r['first_token_from_spawn_s']:5.2f} s"
          f" from spawn | 503s while starting: {r['starting_503s']} (slowest {r['slowest_503_ms']:.0f} ms)"
          f" | answer {r['answer'][:60]!r}")  # fmt: skip
    print("    " + line(r["startup"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, help="warm restarts per mode")
    p.add_argument("--modes", default="disaggregated,colocated")
    p.add_argument("--fresh", action="store_true", help="prepare into empty cache directories first")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    results: dict[str, Any] = {"cpu": cpu_name(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="splitserve-first-start-") as tmp:
        if args.fresh:
            env["SPLITSERVE_CACHE_DIR"] = f"{tmp}/cache"
            env["TORCH_EXTENSIONS_DIR"] = f"{tmp}/torch_extensions"
            results["prepare_s"] = prepare(env)
            print(f"prepare (setup's build step, empty caches): {results['prepare_s']:.1f} s")
        print(f"machine: {results['cpu']}, {results['cores']} cores")
        for mode in args.modes.split(","):
            runs = [("first start", one_start(mode, env))]
            runs += [(f"restart {i + 1}", one_start(mode, env)) for i in range(args.runs)]
            for kind, r in runs:
                show(mode, kind, r)
            met = sum(r["ready_s"] <= GOALS[mode] for _, r in runs[1:])
            print(f"{mode}: warm restarts ready within {GOALS[mode]:.1f} s: {met} of {args.runs}")
            results[mode] = [{"kind": kind, **r} for kind, r in runs]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
