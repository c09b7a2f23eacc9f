"""When the engine core's loop runs on which cores, and when it waits: core lending and decode pacing
behind one object, so that the loop itself only drains commands, steps and sends the batch.

  - idle (nothing to run, or only imports waiting for their KV): this worker's cores are lent to the
    other CPU workers of the host (share.py); its own idle work (the KV prefault) waits while another
    worker is busy, since it would run on the core it lends.
  - before a step: the step runs on this worker's own threads plus every core the others leave free,
    looked up again at the checkpoints inside the step (kernels/cpu/threads.py).
  - after a decode worker's step, while another worker is busy: pacing, at most one step per
    `decode_pace_s`, the rest of that time lent (share.py, "Decode pacing").

Without a shared file (a single worker, a GPU worker, `runtime.lend_cores: false`) every call is a
no-op: the worker runs on its own threads, unpaced.
"""

from __future__ import annotations

from typing import Any

from splitserve.core.share import CoreShare, open_share
from splitserve.kernels.cpu import threads as cpu_threads


class CorePolicy:
    def __init__(self, share: CoreShare | None, own_threads: int, pace_s: float) -> None:
        self.share = share
        self.own = own_threads
        self.threads = own_threads  # what the last step started on
        self.pace_s = pace_s if share is not None else 0.0
        self.borrowed_steps = 0  # steps that started on more threads than the worker's own
        self.paced_steps = 0  # steps after which this decode worker lent its cores until its pace ended
        if share is not None:
            cpu_threads.set_hook(lambda: self._take(True))  # at each checkpoint of a step

    @classmethod
    def open(cls, config: Any) -> CorePolicy:
        """The policy of a worker (`config`: its WorkerConfig): lending when the runtime gave a file."""
        return cls(open_share(config), config.threads, config.decode_pace_s)

    def idle(self) -> None:
        """Nothing to run now: this worker's cores are lent."""
        self._take(False)

    def may_work_idle(self) -> bool:
        """Whether an idle worker may do its own background work: no other worker is busy (it may be
        running on this worker's lent core)."""
        return self.share is None or not self.share.others_busy()

    def before_step(self, working: bool) -> None:
        """A step is about to run (`working`: it has more to do than wait for KV): mark this worker busy
        and take the cores it may use."""
        self._take(working)
        self.borrowed_steps += working and self.threads > self.own

    def pace(self, step_start: float) -> float | None:
        """After a step that started at `step_start` (time.perf_counter()): decode pacing, while another
        worker is busy -> until when this worker stays idle, its cores lent; None: no pause."""
        if not self.pace_s or self.share is None or not self.share.others_busy():
            return None
        self._take(False)
        self.paced_steps += 1
        return step_start + self.pace_s

    def close(self) -> None:
        if self.share is not None:
            cpu_threads.set_hook(None)
            self.share.close()

    def _take(self, busy: bool) -> None:
        """Mark this worker busy or idle in the shared file; a busy one runs its next step (and, called
        at its checkpoints, the rest of this one) on its own cores plus those idle workers lend."""
        if self.share is None:
            return
        n = self.share.threads(busy)
        if busy and n != self.threads:
            import torch

            torch.set_num_threads(n)
            self.threads = n


__all__ = ["CorePolicy"]
