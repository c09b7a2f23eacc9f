"""Kill a worker process again and again under load; print how each kill's streams ended, and when.

    python bench/kill_loop.py                     # 20 kills of prefill-0's engine core
    python bench/kill_loop.py --kills 50 --victim decode-0 --process "front end"

One disaggregated deployment (the resilience test's `fragile` manifest: shm, 10 s deadlines, the
standby spare on). Each round starts four streams (1,500-token prompts for a prefill victim; 150 tokens
of decoding for a decode victim), SIGKILLs the process once its role is busy, waits for every stream to
end, then for the worker to come back. A stream still open `--straggler-s` after the kill is a hang:
the script prints every process's Python stacks (py-spy, where installed) and the deployment's last log
lines, then stops. It reproduced a hang in 1 of 5 kills, an import refused outside a step
(docs/bench/chaos.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d) for d in (".", "router")]

import openai  # noqa: E402
from serve_harness import MODEL, Deployment, manifest_yaml, start_deployment  # noqa: E402
from test_resilience import VICTIMS, _wait_role_busy  # noqa: E402

PROCESS_KEY = {"front end": "pid", "engine core": "core_pid"}


async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, float]:
    try:
        s = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=max_tokens,
                                            stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        async for _ in s:
            pass
        return "ok", time.monotonic()
    except openai.APIError as exc:
        return f"{getattr(exc, 'status_code', None) or type(exc).__name__}", time.monotonic()


def _stacks(dep: Deployment) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    workers = dep.admin()["workers"]
    cores = [(w.get("info") or {}).get("core_pid") for w in workers]  # a restarting worker has no info
    pids = [dep.proc.pid] + [w["pid"] for w in workers] + cores
    for pid in filter(None, pids):
        if Path(spy).exists():
            out = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, check=False
            )
            print(f"===== pid {pid}\n{out.stdout[-6000:]}")
    print("\n".join(list(dep.log)[-120:]))


async def _round(
    dep: Deployment, victim: str, process: str, straggler_s: float
) -> tuple[list[tuple[str, float]], bool]:
    before = {w["name"]: w for w in dep.admin()["workers"]}
    info = before[victim] if process == "front end" else before[victim]["info"]
    prompt, max_tokens = VICTIMS[victim]
    async with dep.async_client(timeout=120) as client:
        jobs = [asyncio.create_task(_stream(client, prompt, max_tokens)) for _ in range(4)]
        await asyncio.to_thread(_wait_role_busy, dep, victim.split("-")[0])
        if victim.startswith("decode"):
            await asyncio.sleep(1.0)
        os.kill(info[PROCESS_KEY[process]], signal.SIGKILL)
        killed = time.monotonic()
        _, pending = await asyncio.wait(jobs, timeout=straggler_s)
        if pending:
            await asyncio.to_thread(_stacks, dep)
        ends = [(outcome, round(t - killed, 2)) for outcome, t in await asyncio.gather(*jobs)]
    deadline = time.monotonic() + 90
    while True:  # the worker is back
        h = dep.health()
        w = {x["name"]: x for x in h["workers"]}[victim]
        if h["status"] == "ok" and w["restarts"] == before[victim]["restarts"] + 1:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{victim} did not come back: {h}")
        await asyncio.sleep(0.2)
    return ends, bool(pending)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--victim", choices=sorted(VICTIMS), default="prefill-0")
    ap.add_argument("--process", choices=sorted(PROCESS_KEY), default="engine core")
    ap.add_argument(
        "--straggler-s", type=float, default=25.0, help="a stream open this long after the kill hangs"
    )
    args = ap.parse_args()
    timeouts = {"inter_token_s": 10, "kv_transfer_s": 10, "prefill_s": 30}
    dep = start_deployment(manifest_yaml(mode="disaggregated", router={"timeouts": timeouts},
                                         transport={"lease_s": 10}, runtime={"standby": True}))  # fmt: skip
    worst, hung, done = 0.0, False, 0
    try:
        while done < args.kills and not hung:
            ends, hung = asyncio.run(_round(dep, args.victim, args.process, args.straggler_s))
            done += 1
            worst = max([worst] + [t for _, t in ends])
            print(f"kill {done}/{args.kills}: " + ", ".join(f"{o} at {t:.2f}s" for o, t in ends), flush=True)
            time.sleep(2)
    finally:
        dep.stop()
    print(f"{args.victim}'s {args.process}: {done} kills, {'a HANG' if hung else 'no hang'}; "
          f"the last stream ended {worst:.2f}s after its kill at worst")  # fmt: skip
    return 1 if hung else 0


if __name__ == "__main__":
    sys.exit(main())
