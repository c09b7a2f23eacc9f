"""One tensor-parallel rank other than 0: `python -m splitserve.engine.tp.worker`, spec on stdin.

It joins rank 0's store, builds the same engine parts from the same config (its shard of the weights,
its heads' KV cache and state pools; the scheduler it builds stays idle) and runs every step rank 0
broadcasts (runner.py's `serve_rank`) until rank 0 says stop; threads of it read this rank's share
of each KV import rank 0 orders (rank_reads.py) and serve its share of each export from its own
transport (rank_exports.py). It exits at once when its parent
(rank 0's process) is gone.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

log = logging.getLogger("splitserve.engine.tp.worker")


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main() -> int:
    spec = json.loads(sys.stdin.read())
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    logging.basicConfig(
        level=logging.WARNING, format=f"tp-rank-{spec['rank']} %(levelname)s %(name)s: %(message)s"
    )

    import dataclasses
    import datetime

    import torch
    import torch.distributed as dist

    from splitserve.config.engine import EngineConfig
    from splitserve.engine.builder import build
    from splitserve.engine.tp import build as tp_build
    from splitserve.engine.tp.group import TPGroup, rank_device
    from splitserve.engine.tp.read_orders import RankReadService
    from splitserve.engine.tp.runner import serve_rank

    torch.set_num_threads(int(spec["threads"]))
    rank = int(spec["rank"])
    config = EngineConfig(**spec["engine"])
    one_device = config.tensor_parallel_one_device
    device = rank_device(torch.device(spec["device"]), rank, one_device)
    config = dataclasses.replace(config, device=str(device))
    size = config.tensor_parallel_size
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL and Triton work on the current device
    store = dist.TCPStore("127.0.0.1", int(spec["port"]), size, False, timeout=datetime.timedelta(minutes=10))
    store.set(f"joined/{rank}", "1")
    tp_build._WORKER_GROUP = TPGroup(rank, size, store, device, one_device)
    parts = build(config, False, None)
    # this rank's share of KV imports and exports, in this process
    RankReadService(int(spec["port"]), rank, size, parts.kv_cache, parts.states.states)
    serve_rank(parts.runner, tp_build._WORKER_GROUP, parts.scheduler.block_manager.checkpoints)
    return 0


if __name__ == "__main__":
    sys.exit(main())
