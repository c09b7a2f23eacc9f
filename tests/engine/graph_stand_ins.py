"""Stand-ins for the CUDA graphs of the target's decode and verify steps and of the MTP head's runs, for
CPU tests without capture: each graph is a `Run` that runs its forward over the static buffers (as a
replay does) and counts its replays by kind."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from splitserve.engine.decode_graphs import DecodeGraphs
from splitserve.engine.engine import LLMEngine
from splitserve.engine.spec.mtp_graphs import HeadGraphs
from splitserve.engine.verify_graphs import VerifyGraphs, verify_graph_shapes


class Run:
    """A stand-in for a captured graph: its replay runs `forward` and counts under `name`."""

    def __init__(self, forward: Callable[[], None], counts: Counter, name: str) -> None:
        self.forward, self.counts, self.name = forward, counts, name

    def replay(self) -> None:
        self.forward()
        self.counts[self.name] += 1


def stand_ins(engine: LLMEngine, k: int, head: bool, batch: int = 4) -> Counter:
    """Decode, verify and (with `head`) MTP head graphs on `engine`'s runner for up to `batch` requests,
    each a `Run`, over a block and a state slot taken from its pools as the scratch ones; -> the
    replays by kind."""
    runner, counts = engine.runner, Counter()
    block, slot = engine.pool.allocate(1)[0], engine.states.allocate()
    assert slot is not None
    dec = DecodeGraphs(runner, batch, engine.max_model_len, block, slot)

    def decode(b: int) -> None:
        dec.hidden[b], dec.logits[b] = dec._forward(b)

    for b in dec.sizes:
        dec.graphs[b] = Run(lambda b=b: decode(b), counts, "decode")  # type: ignore[assignment]
    runner.graphs = dec
    shapes = verify_graph_shapes(k, batch, None)
    ver = VerifyGraphs(runner, shapes, engine.max_model_len, block, slot)
    ver.logits = torch.empty(ver.max_rows, engine.model_config.vocab_size)
    ver.hidden = torch.empty(ver.max_rows, engine.model_config.hidden_size)

    def verify_step(w: int, s: int) -> None:
        hidden, logits = ver.forward(w, s)
        ver.logits[: w * s].copy_(logits)  # type: ignore[index]
        ver.hidden[: w * s].copy_(hidden)  # type: ignore[index]

    for w, s in shapes:
        ver.graphs[(w, s)] = Run(lambda w=w, s=s: verify_step(w, s), counts, "verify")  # type: ignore[assignment]
    runner.verify_graphs = ver
    if head:
        hg = HeadGraphs(runner, engine.spec.mtp.head, k, batch, engine.max_model_len, block)  # type: ignore[union-attr]
        for key in [("decode", b) for b in dec.sizes] + [("verify", sh) for sh in shapes]:
            hg.catch_graphs[key] = Run(
                lambda key=key: hg._catch_up_forward(key), counts, f"catch-up {key[0]}"
            )  # type: ignore[assignment]
        for kk in range(1, k + 1):
            for n in hg.draft_sizes:
                hg.draft_graphs[(n, kk)] = Run(lambda n=n, kk=kk: hg._draft_forward(n, kk), counts, "drafts")  # type: ignore[assignment]
        runner.head_graphs = hg
    return counts
