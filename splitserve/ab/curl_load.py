"""A C load client to check endpoints against: one `curl -N` process per streamed request.

Used by `bench/serve_gpu.py` (the endpoint against the engine) and `bench/client_check.py` (the bench
client against curl). Every curl is started first and waits for its body on stdin, so the clock starts
when the bodies are handed over, all at once, and does not time process creation. Each stream goes to
a file (an unread pipe would hold the server back). Tokens are counted from each stream's usage chunk.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict:
    """A streamed, greedy /v1/completions request that makes exactly `max_tokens` tokens."""
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip


def count_stream(raw: bytes) -> int:
    """Completion tokens of one SSE stream: its usage chunk's, else the chunks with a choice. An error
    event raises."""
    usage = chunks = 0
    for line in raw.split(b"\n"):
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']}")
        chunks += bool(chunk.get("choices"))
        if chunk.get("usage"):
            usage = int(chunk["usage"].get("completion_tokens") or 0)
    return usage or chunks


def run_curl(url: str, bodies: list[dict]) -> dict:
    """POST each body to `url`/v1/completions through its own curl, all at once; -> tokens, wall_s,
    tok_s, client_cpu_s (the curls' own), ttfb_s (each curl's time to the answer's first byte)."""
    if shutil.which("curl") is None:
        raise SystemExit("curl is not installed (apt-get install curl)")
    with tempfile.TemporaryDirectory(prefix="splitserve-curl-") as tmp:
        outs = [Path(tmp) / f"out{i}.sse" for i in range(len(bodies))]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        procs = []
        for o in outs:
            with open(o, "wb") as out:
                procs.append(subprocess.Popen(
                    ["curl", "-sS", "-N", "--fail-with-body", "-H", "Content-Type: application/json",
                     "--data-binary", "@-", "-w", "\nTIMES %{time_starttransfer}\n", f"{url}/v1/completions"],
                    stdin=subprocess.PIPE, stdout=out,
                ))  # fmt: skip
        payloads = [json.dumps(b).encode() for b in bodies]
        time.sleep(0.2)  # every curl is up and waiting on stdin
        t0 = time.perf_counter()
        for p, data in zip(procs, payloads, strict=True):
            assert p.stdin is not None
            p.stdin.write(data)
            p.stdin.close()
        codes = [p.wait() for p in procs]
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        raws = [o.read_bytes() for o in outs]
    bad = [i for i, c in enumerate(codes) if c != 0]
    if bad:
        raise RuntimeError(f"{len(bad)} curl requests failed, e.g. {raws[bad[0]][:300]!r}")
    streams, ttfb = [], []
    for raw in raws:
        body, _, times = raw.rpartition(b"\nTIMES ")
        streams.append(body)
        ttfb.append(float(times))
    tokens = sum(count_stream(s) for s in streams)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "client_cpu_s": cpu,
            "ttfb_s": sorted(ttfb)}  # fmt: skip
