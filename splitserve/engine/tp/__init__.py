"""Tensor parallelism in the engine: one process per rank, rank 0's scheduler driving the others.

    group.py    the ranks' process groups (gloo on the CPU, NCCL on CUDA), collectives, the step broadcast
    ranks.py    rank 0 starts ranks 1..n-1 as child processes, meets them, and watches them
    journal.py  state-slot operations rank 0's scheduler makes (zero, checkpoint save and restore),
                replayed by every other rank before the step that follows them
    runner.py   rank 0's runner (broadcasts each step's batch, then runs its shard) and the other ranks'
                loop (receive the step, run their shard)
    build.py    what the engine's builder does differently under tensor parallelism
    kv_ranks.py the KV transport of a replica (rank 0's process): every rank's exports served by that
                rank's own process (rank_exports.py), imports read by each rank in its own
                (kv_transport.py, rank_reads.py; read_orders.py carries rank 0's orders to the others)
    worker.py   `python -m splitserve.engine.tp.worker`: one rank other than 0

The model side (which weights each rank holds, the parallel layers) is splitserve/model/parallel.py.
"""
