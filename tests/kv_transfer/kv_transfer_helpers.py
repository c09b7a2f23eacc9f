"""Helpers for the prefill/decode tests (a uniquely named module: tests/ has several conftests):
worker processes started with `python -m splitserve.worker.main`, an HTTP client for them, the
tiny Qwen3.5 checkpoint, and the disaggregated round trip prefill -> decode."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

SECRET_ENV = "SPLITSERVE_PD_TEST_SECRET"
SECRET = "pd-test-secret"

TINY_ARGS = ("--max-model-len", "256", "--kv-cache-mb", "4", "--max-num-seqs", "8")
LEASE_S = 4.0
# the shared tiny-Qwen3.5 prefill workers' extras: faults off until a test sets them, checksums, short leases
FAULT_ARGS = ("--enable-fault-injection", "--kv-checksum", "crc32", "--kv-lease-s", str(LEASE_S))

HAVE_NIXL = any(importlib.util.find_spec(n) for n in ("nixl", "nixl_cu12", "nixl_cu13"))
# a `backend` parameter: nixl over UCX, CPU memory (skipped, with the install line, without NIXL)
NIXL = pytest.param(
    "nixl",
    marks=pytest.mark.skipif(
        not HAVE_NIXL, reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1, then numpy)"
    ),
)


def running(backend: str) -> str:
    """What a worker reports running for `backend`: nixl names the NIXL backend it instantiated."""
    return "nixl/UCX" if backend == "nixl" else backend


def random_prompts(lens: Sequence[int], vocab: int = 512, seed: int = 1) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


class WorkerProcess:
    """One worker in its own OS process; `url` once it printed its ready line."""

    def __init__(self, role: str, *args: str, backend: str = "tcp", secret: str = SECRET) -> None:
        self.role = role
        env = {**os.environ, "OMP_NUM_THREADS": "1", SECRET_ENV: secret}
        cmd = [sys.executable, "-m", "splitserve.worker.main", "--role", role, "--port", "0",
               "--kv-backend", backend, "--kv-secret-env", SECRET_ENV, "--threads", "1", *args]  # fmt: skip
        self.stderr = tempfile.NamedTemporaryFile("w+", prefix=f"pd-{role}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, env=env, text=True)
        self.info: dict = {}
        self.client: httpx.Client | None = None

    def wait_ready(self, timeout_s: float = 180.0) -> WorkerProcess:
        end = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < end:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("{"):
                    self.info = json.loads(line)
                    self.client = httpx.Client(base_url=self.info["url"], timeout=120)
                    return self
            if self.proc.poll() is not None:
                break
        self.kill()
        raise RuntimeError(f"{self.role} worker did not start:\n{self.log_tail()}")

    @property
    def url(self) -> str:
        return self.info["url"]

    def log_tail(self, nbytes: int = 4000) -> str:
        self.stderr.flush()
        return Path(self.stderr.name).read_text()[-nbytes:]

    def post(self, path: str, body: dict) -> httpx.Response:
        assert self.client is not None
        return self.client.post(path, json=body)

    def stats(self) -> dict:
        assert self.client is not None
        return self.client.get("/stats").json()

    def generate(self, prompt: list[int], params: dict) -> list[int]:
        r = self.post("/generate", {"prompt_token_ids": prompt, "sampling_params": params, "stream": False})
        assert r.status_code == 200, r.text
        return r.json()["token_ids"]

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        print(f"--- {self.role} worker log ---\n{self.log_tail()}", file=sys.stderr)  # shown on failure
        os.unlink(self.stderr.name)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_workers(*workers: WorkerProcess) -> list[WorkerProcess]:
    """Wait for workers started together (they load their models in parallel)."""
    try:
        return [w.wait_ready() for w in workers]
    except BaseException:
        for w in workers:
            w.kill()
        raise


class QwenPairs:
    """Tiny Qwen3.5 prefill/decode pairs, one per backend, started on first use and shared by the
    modules that need one (test_disaggregated_qwen3_5, test_faults): each pair costs two worker starts."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self._pairs: dict[str, tuple[WorkerProcess, WorkerProcess]] = {}

    def get(self, backend: str) -> tuple[WorkerProcess, WorkerProcess]:
        if backend not in self._pairs:
            model = ("--model", str(self.model), *TINY_ARGS)
            p = WorkerProcess("prefill", *model, *FAULT_ARGS, backend=backend)
            d = WorkerProcess("decode", *model, backend=backend)
            start_workers(p, d)
            self._pairs[backend] = (p, d)
        return self._pairs[backend]

    def discard(self, backend: str) -> None:
        """Stop a pair a test broke (killed its prefill): the next `get` starts a fresh one."""
        for w in self._pairs.pop(backend, ()):
            w.stop()

    def close(self) -> None:
        for backend in list(self._pairs):
            self.discard(backend)


@dataclass
class DecodeResult:
    status: int
    tokens: list[int]
    body: dict
    seconds: float  # the /decode call alone


def prefill(worker: WorkerProcess, prompt: list[int], params: dict) -> dict:
    r = worker.post("/prefill", {"prompt_token_ids": prompt, "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def decode(
    worker: WorkerProcess, prompt: list[int], pre: dict, params: dict, **extra: object
) -> DecodeResult:
    body = {"prompt_token_ids": prompt, "first_token": pre["first_token"], "kv_export": pre["kv_export"],
            "sampling_params": params, "stream": False, **extra}  # fmt: skip
    start = time.monotonic()
    r = worker.post("/decode", body)
    seconds = time.monotonic() - start
    data = r.json()
    return DecodeResult(r.status_code, data.get("token_ids", []), data, seconds)


def disaggregated(
    p: WorkerProcess, d: WorkerProcess, prompt: list[int], params: dict, **extra: object
) -> list[int]:
    pre = prefill(p, prompt, params)
    if pre["kv_export"] is None:  # the first token ended it
        return [pre["first_token"]]
    res = decode(d, prompt, pre, params, **extra)
    assert res.status == 200, res.body
    assert res.tokens[0] == pre["first_token"]
    return res.tokens


def in_parallel(fn: Callable, items: Sequence) -> list:
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        return list(pool.map(fn, items))


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0, every_s: float = 0.1) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(every_s)
    return bool(predicate())


def pools_full(worker: WorkerProcess) -> bool:
    s = worker.stats()
    blocks, slots = s["blocks"], s["state_slots"]
    return s["unfinished"] == 0 and blocks["free"] == blocks["total"] and slots["free"] == slots["total"]


def assert_pools_full(*workers: WorkerProcess, timeout_s: float = 15.0) -> None:
    for w in workers:
        assert wait_for(lambda w=w: pools_full(w), timeout_s), f"{w.role} pool not full: {w.stats()}"
