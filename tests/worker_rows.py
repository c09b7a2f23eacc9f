"""Workers' /stats as the router's metrics get them (`WorkerRow`s with a decoded `WorkerStats`), for tests
that feed the metrics without running workers: every field at an idle worker's value unless given."""

from __future__ import annotations

from typing import Any

import msgspec

from splitserve.wire.stats import STEP_TOKEN_BUCKETS, WorkerRow, WorkerStats

IDLE: dict[str, Any] = {
    "role": "decode", "running": 0, "waiting": 0, "importing": 0, "unfinished": 0,
    "blocks": {"total": 10, "free": 10, "held": 0}, "state_slots": {"total": 0, "free": 0}, "preemptions": 0,
    "iteration_tokens": {"counts": [0] * (len(STEP_TOKEN_BUCKETS) + 1), "sum": 0}, "block_size": 16,
    "prompt_tokens_computed": 0, "kv_bytes_per_token": 0,
    "steps": {"forward": 0, "overlapped": 0, "step_s": 0.0, "loop_s": 0.0},
    "threads": {"own": 1, "now": 1, "borrowed_steps": 0, "paced_steps": 0},
    "prefix_cache": {"enabled": True, "queries": 0, "hits": 0, "state_checkpoints": None},
    "kv_transfer": None, "memory": None, "spec_decode": None,
}  # fmt: skip


def _merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if nested else value
    return out


def worker_row(worker: str, role: str, up: bool = True, **stats: Any) -> WorkerRow:
    """A worker that answered /stats with an idle worker's figures changed by `stats` (nested dicts
    change only the keys they name); `up=False`: a worker that is down, without stats."""
    if not up:
        return WorkerRow(worker, role, False)
    return WorkerRow(worker, role, True, msgspec.convert(_merged({**IDLE, "role": role}, stats), WorkerStats))
