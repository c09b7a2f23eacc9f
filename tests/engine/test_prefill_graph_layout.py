"""The padding of prefill CUDA graphs (engine/prefill_graphs.py), checked on the host: whatever the chunk's
length, the three varlen sequences fill the captured rows and fla walks the same number of 64-token
chunks (its launch grids), so one graph per bucket serves every length up to it."""

from __future__ import annotations

import numpy as np

from splitserve.engine import prefill_graphs as pg


def test_padding_keeps_fla_chunk_count_fixed():
    for size in pg.SIZES[:4]:
        rows = size + pg.CHUNK
        for length in range(2, size + 1):
            a, c = pg.padding(length, rows)
            assert a > 0 and c > 0 and length + a + c == rows
            table = pg.chunk_table([length, a, c])
            assert table.shape == (rows // pg.CHUNK + 1, 2), (size, length)


def test_chunk_table_is_fla_order():
    table = pg.chunk_table([70, 1, 64])
    assert table.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0]]
    assert table.dtype == np.int64


def test_sizes_and_env(monkeypatch):
    assert pg.prefill_graph_sizes(256) == [64, 128, 256]
    assert pg.prefill_graph_sizes(100) == [64]
    assert pg.prefill_graph_sizes(45) == []
    monkeypatch.setenv(pg.ENV, "0")
    assert pg.env_max_tokens() == 0
