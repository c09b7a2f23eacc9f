"""cuda_ipc keeps hybrid state on the GPU outside the KV cache (the exporter's arena, the fetcher's staging
row): the worker holds those rows back from its KV budget (`transfer_state_rows`), so two workers'
`memory_utilization` shares on one GPU leave room for the transfer."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.config.worker import DECODE_STAGING_ROWS, WorkerConfig
from splitserve.engine.builder import state_bytes


def test_rows_follow_the_role_and_backend():
    rows = lambda **kw: WorkerConfig(kv_secret="s", **kw).engine_config().transfer_state_rows  # noqa: E731
    assert rows(role="prefill", kv_backend="cuda_ipc", kv_state_rows=5) == 5
    assert rows(role="decode", kv_backend="cuda_ipc") == DECODE_STAGING_ROWS
    assert rows(role="decode", kv_backend="tcp", kv_fallback=("cuda_ipc",)) == DECODE_STAGING_ROWS
    assert rows(role="prefill", kv_backend="tcp") == 0
    assert rows(role="colocated") == 0


def test_state_bytes():
    class Hybrid(nn.Module):
        def state_shapes(self):
            return {"conv": ((2, 8, 3), torch.float32), "recurrent": ((2, 4, 4, 4), torch.bfloat16)}

    assert state_bytes(Hybrid()) == 2 * 8 * 3 * 4 + 2 * 4 * 4 * 4 * 2
    assert state_bytes(nn.Linear(2, 2)) == 0
