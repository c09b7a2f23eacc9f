"""CUDA graphs of the MTP head's runs (spec/mtp.py), so that a step's catch-up and its drafting replay a
few graphs instead of launching the head's kernels one by one and preparing its inputs on the host.

Two kinds, captured at start-up after the target's decode and verify graphs, in their memory pool:

  * catch-up: the head over the rows of the step the target just replayed, read from that graph's own
    static buffers: a decode graph of batch b (engine/decode_graphs.py: row i is the step's chunk i)
    and a hybrid verify graph of (width, steps) (engine/verify_graphs.py: chunk i's position j at row
    j * width + i). Positions, KV slots, context lengths, block tables and the target's final hidden
    states are already on the device; a replay takes only the token after each row's position (one
    host-to-device copy). A row whose next token is not known (a rejected draft's position, a padded
    row) runs on token 0: its K/V land at a position the request has not reached (rewritten by the
    next step's catch-up or draft before any row attends to it) or in the scratch block, and its
    output is not read. So does the row of a request that lost the head's context (spec/verify.py:
    no draft ever reads its head K/V).
  * drafting: for n requests (the decode ladder up to the verify graphs' widest step) and k drafts,
    one graph makes all k: the first from the head's state at each request's second-to-last known
    position q (the LM head's argmax), and each further draft j from one more run of the head at
    position q + j on the previous draft and the previous state: a decode-shaped step whose rows
    stay on the device, argmax included. The positions of all k - 1 further runs and the block table
    reach the device in two copies before the replay, and the k drafts of every request come back
    in one copy after it. A request with fewer drafts than the graph's k gets padded rows (scratch
    block) in the runs it does not take.

Memory: the graphs' intermediates share the target graphs' pool (the largest is a drafting graph's
logits, [n, vocab] fp32 per draft); outside it, the head's output rows ([rows, hidden] for the widest
catch-up), the drafting state ([n, hidden]) and the small integer inputs. Steps that fit no graph run
the head eagerly (spec/mtp.py). While the head is backed off (spec/verify.py: the batch past the
drafting cap beyond a grace of a few steps) the engine runs plain steps and none of these replays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch

from splitserve.engine.decode_graphs import graph_batch_sizes
from splitserve.model.attention import AttentionMetadata, DecodeGroup
from splitserve.model.decoder import ForwardContext

log = logging.getLogger(__name__)

# The graph the target's step replayed, as the runner records it: ("decode", batch) or
# ("verify", (width, steps)).
Replayed = tuple[str, Any]


class HeadGraphs:
    """CUDA graphs of the MTP head's catch-up (per target graph) and drafting (per batch and k)."""

    def __init__(self, runner: Any, head: torch.nn.Module, k: int, draft_batch: int, max_model_len: int,
                 scratch_block: int) -> None:  # fmt: skip
        self.runner = runner  # the engine's ModelRunner, its decode (and verify) graphs set up
        self.head = head  # Qwen3_5MTP
        self.target = runner.model  # Qwen3_5LM
        self.vocab_size = self.target.cfg.vocab_size
        self.k = k
        self.draft_sizes = graph_batch_sizes(max(draft_batch, 1))
        self.scratch_block = scratch_block
        dev, bs = runner.device, runner.block_size
        self.max_blocks = -(-max_model_len // bs)
        n, hidden = self.draft_sizes[-1], self.target.cfg.hidden_size
        dtype = self.head.fc.weight.dtype
        ver = runner.verify_graphs
        rows = max(runner.graphs.max_batch, ver.max_rows if ver is not None else 0)
        self.catch_ids = torch.zeros(rows, dtype=torch.int64, device=dev)  # each row's next token
        self.out = torch.zeros((rows, hidden), dtype=dtype, device=dev)  # the head's output rows
        self.catch_graphs: dict[Replayed, torch.cuda.CUDAGraph] = {}
        # drafting: the state each request drafts from, and the rows of each further run (positions,
        # KV slots, context lengths); a padded row: position 0, the scratch block, a context of one
        self.pad_col = np.array([0, scratch_block * bs, 1], dtype=np.int64)
        self.state = torch.zeros((n, hidden), dtype=dtype, device=dev)
        self.steps = torch.from_numpy(self._padded(max(k - 1, 0))).to(dev)  # [k - 1, 3, n]
        self.tables = torch.full((n, self.max_blocks), scratch_block, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros((n, k), dtype=torch.int64, device=dev)
        self.draft_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = runner.graphs.pool
        self.stream: torch.cuda.Stream | None = None
        self.replays = 0

    def _padded(self, runs: int) -> np.ndarray:
        return np.repeat(np.repeat(self.pad_col[None, :, None], runs, axis=0), self.draft_sizes[-1], axis=2)

    # ---- the head's forwards over the static buffers ----------------------------------------------

    def _head(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata,
              step: int) -> torch.Tensor:  # fmt: skip
        r = self.runner
        ctx = ForwardContext(r.attn, meta, r.kv_cache, r.states)
        return self.head(self.target, ids, hidden, pos, ctx, step)

    def _catch_up_forward(self, replayed: Replayed) -> None:
        kind, shape = replayed
        if kind == "decode":
            n = shape
            _, pos, meta = self.runner.graphs.step_meta(shape)
            hidden = self.runner.graphs.hidden[shape]
        else:
            n = shape[0] * shape[1]
            _, pos, meta = self.runner.verify_graphs.step_meta(*shape)
            hidden = self.runner.verify_graphs.hidden[:n]
        self.out[:n].copy_(self._head(self.catch_ids[:n], hidden, pos, meta, 0))

    def _argmax(self, state: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(state)[:, : self.vocab_size].argmax(dim=-1)

    def _draft_forward(self, n: int, k: int) -> None:
        from splitserve.kernels.paged_attention import decode_num_splits

        r = self.runner
        splits = decode_num_splits(n, r.num_kv_heads, self.max_blocks * r.block_size, r.sm_count)
        state = self.state[:n]
        ids = self._argmax(state)
        self.drafts[:n, 0].copy_(ids)
        for j in range(1, k):  # the head at position q + j, on draft j - 1 and its own last state
            pos, slots, lens = self.steps[j - 1, :, :n]
            # positions q + 1 .. q + j were stored by this replay (kernels/pdl.py: read after the wait)
            group = DecodeGroup(0, n, self.tables[:n], lens, splits, fresh=j)
            meta = AttentionMetadata(slots, num_decode_tokens=n, decode_groups=(group,), prefills=())
            state = self._head(ids, state, pos, meta, j)
            ids = self._argmax(state)
            self.drafts[:n, j].copy_(ids)

    # ---- capture -----------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> float:
        with torch.cuda.device(self.runner.device):  # graphs and Triton use the current device
            return self._capture()

    def _capture(self) -> float:
        t0 = time.perf_counter()
        r = self.runner
        self.stream = torch.cuda.Stream(r.device)
        r.graphs.pad()  # the target graphs' rows all padded rows: warm-ups write the scratch block only
        for b in r.graphs.hidden.values():  # read before the target's first replay: make them finite
            b.zero_()
        keys: list[Replayed] = [("decode", b) for b in reversed(r.graphs.sizes)]
        if r.verify_graphs is not None:
            r.verify_graphs.pad()
            assert r.verify_graphs.hidden is not None
            r.verify_graphs.hidden.zero_()
            keys += [("verify", shape) for shape in r.verify_graphs.graphs]
        for key in sorted(keys, key=_rows, reverse=True):  # largest first: the smaller reuse its pool
            self.catch_graphs[key] = self._graph(lambda key=key: self._catch_up_forward(key))
        for k in range(self.k, 0, -1):
            for n in reversed(self.draft_sizes):
                self.draft_graphs[(n, k)] = self._graph(lambda n=n, k=k: self._draft_forward(n, k))
        torch.cuda.synchronize(r.device)
        seconds = time.perf_counter() - t0
        log.info("captured %d MTP head CUDA graphs (catch-up %s; drafting: batch %s, up to %d drafts) in "
                 "%.1f s", len(self.catch_graphs) + len(self.draft_graphs),
                 sorted(self.catch_graphs, key=_rows), self.draft_sizes, self.k, seconds)  # fmt: skip
        return seconds

    def _graph(self, forward: Any) -> torch.cuda.CUDAGraph:
        forward()  # warm-up: Triton compiles at these shapes
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        # NOTE: a capture stream of our own device, as the decode graphs capture (decode_graphs.py)
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            forward()
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    # ---- replay ------------------------------------------------------------------------------------

    def covers(self, replayed: Replayed) -> bool:
        """Whether the catch-up after the target's graph `replayed` replays a graph (then that graph
        need not gather its hidden states for an eager catch-up)."""
        return replayed in self.catch_graphs

    def catch_up(self, replayed: Replayed | None, pieces: Sequence[tuple[int, list[int]]]
                 ) -> list[torch.Tensor] | None:  # fmt: skip
        """The head over the step the target replayed as `replayed`; `pieces`: (the chunk's index in the
        step, the tokens after each of its first positions, as many as the head runs there). -> the
        head's output state at each piece's last such position, or None (no graph: run it eagerly)."""
        graph = self.catch_graphs.get(replayed) if replayed is not None else None
        if graph is None:
            return None
        kind, shape = replayed  # type: ignore[misc]
        width, n = (shape, shape) if kind == "decode" else (shape[0], shape[0] * shape[1])
        rows = [index + width * j for index, nxt in pieces for j in range(len(nxt))]  # position j's row
        ids = np.zeros(n, dtype=np.int64)
        ids[rows] = [t for _, nxt in pieces for t in nxt]
        ends = [index + width * (len(nxt) - 1) for index, nxt in pieces]
        with _current(self.runner.device):
            _put(self.catch_ids[:n], ids)
            graph.replay()
        self.replays += 1
        return [self.out[row] for row in ends]

    def draft(self, todo: Sequence[tuple[Any, int]], states: Sequence[torch.Tensor]
              ) -> list[list[int]] | None:  # fmt: skip
        """Drafts for `todo` ((request, drafts it takes), its K/V room allocated) from `states` (the head's
        state at each one's second-to-last known position), or None (no graph: draft eagerly)."""
        k = max(kr for _, kr in todo)
        if len(todo) > self.draft_sizes[-1] or k > self.k:
            return None
        n = next(s for s in self.draft_sizes if s >= len(todo))
        bs = self.runner.block_size
        with _current(self.runner.device):
            torch.stack(list(states), out=self.state[: len(todo)])
            if k > 1:
                host = self._padded(k - 1)
                width = max(-(-(req.num_tokens - 2 + kr) // bs) for req, kr in todo)
                table = np.full((n, width), self.scratch_block, dtype=np.int64)
                for i, (req, kr) in enumerate(todo):
                    blocks = np.asarray(req.block_ids, dtype=np.int64)
                    pos = np.arange(req.num_tokens - 1, req.num_tokens - 2 + kr, dtype=np.int64)  # q + j
                    host[: kr - 1, :, i] = np.stack([pos, blocks[pos // bs] * bs + pos % bs, pos + 1], axis=1)
                    used = -(-(req.num_tokens - 2 + kr) // bs)
                    table[i, :used] = blocks[:used]
                _put(self.steps[: k - 1], host)
                _put(self.tables[:n, :width], table)
            self.draft_graphs[(n, k)].replay()
            made = self.drafts[: len(todo), :k].tolist()  # the one wait on the device
        self.replays += 1
        return [row[:kr] for row, (_, kr) in zip(made, todo, strict=True)]


def _rows(key: Replayed) -> int:
    kind, shape = key
    return shape if kind == "decode" else shape[0] * shape[1]


def _current(device: torch.device) -> Any:
    """`device` the current CUDA device (Triton launches there), or nothing to do on the CPU (where layout
    tests run these forwards without capture)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _put(dst: torch.Tensor, host: np.ndarray) -> None:
    """Copy `host` into `dst`: from pinned memory without waiting, on CUDA."""
    t = torch.from_numpy(host)
    cuda = dst.device.type == "cuda"
    dst.copy_(t.pin_memory() if cuda else t, non_blocking=cuda)
