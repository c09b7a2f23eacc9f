"""A discrete-event simulator of a deployment serving a trace: colocated N replicas, or x prefill
and y decode workers with a KV handoff between them.

A request's life, as the router and workers run it:

    colocated       arrive -> router picks the replica with the fewest requests in flight -> waits
                    in its queue -> prefilled in chunks (continuous batching) -> one token per step
    disaggregated   arrive -> the least-loaded prefill worker prefills it and samples its first token
                    -> the handoff moves its KV (`StepCost.transfer_s`) -> the least-loaded decode
                    worker takes it -> waits for a `max_num_seqs` slot -> one token per step
                    (a request of one output token ends at the prefill worker: nothing to move)
                    The first token reaches the client as the router's `router.first_token` says:
                    "prefill" (the default) as the prefill worker answers, "decode" once the decode
                    worker has the KV.

Every token reaches the client `StepCost.request_s` after the step that sampled it: the fixed part
of a request's way that is no engine step (the load client, the router, the worker's front end and
HTTP; served.py measures it), so that TTFT and e2e carry it once and the gaps between tokens not at all.

Each replica runs `replica.Replica`'s step loop; a step's time is the cost model's, stretched while
it overlaps another replica's step (`StepCost.corun`: by its kind and the other's, decode-only or
with prompt tokens; beside several, the largest factor). The
router picks the replica with the fewest requests in flight, its ties going round the replicas.
Agent sessions' later turns arrive a think time after the previous turn's last token. Ties between
events at the same time are broken by the order they were made in, so that a run is a function of its inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from splitserve.ab.workload import BenchRequest
from splitserve.plan.cost import StepCost
from splitserve.plan.replica import EngineLimits, Replica, Seq, block_hashes

_LIMITS = EngineLimits()


@dataclass(frozen=True)
class Deployment:
    """`prefill` == 0: colocated with `decode` replicas; else `prefill` P workers and `decode` D."""

    prefill: int
    decode: int
    limits: EngineLimits = _LIMITS
    prefill_limits: EngineLimits | None = None  # a role's own engine knobs (default: `limits`)
    decode_limits: EngineLimits | None = None
    first_token: str = "prefill"  # disaggregated: when the first token streams (`router.first_token`)

    @classmethod
    def colocated(cls, n: int, limits: EngineLimits = _LIMITS) -> Deployment:
        return cls(0, n, limits)

    @classmethod
    def split(
        cls, p: int, d: int, limits: EngineLimits = _LIMITS, first_token: str = "prefill"
    ) -> Deployment:
        if first_token not in ("prefill", "decode"):
            raise ValueError(f"first_token: 'prefill' or 'decode', not {first_token!r}")
        return cls(p, d, limits, first_token=first_token)

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def devices(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"{self.prefill}P:{self.decode}D" if self.disaggregated else f"colocated x{self.decode}"


@dataclass
class RequestRecord:
    """What the client sees of one request (seconds from the run's start)."""

    index: int
    prompt_len: int
    output_len: int
    arrival_s: float = 0.0
    token_s: list[float] = field(default_factory=list)  # when each output token reached the client
    transfer_s: float = 0.0
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.token_s[-1] - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_s)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_s, self.token_s[1:], strict=False)]


@dataclass
class _StepClock:
    """A step in flight: `work_s` of its time alone still to run, at `rate` (1: alone) since `since`.
    `version` counts the pushes of its end; only the latest one ends the step."""

    work_s: float
    since: float
    end: float  # where it ends at full speed (pushed as is, so that an unshared step ends exactly there)
    rate: float = 0.0
    version: int = 0

    def run_at(self, rate: float, now: float) -> float | None:
        """Go on at `rate` from `now`; -> the new end to push, or None if the speed did not change."""
        self.work_s -= (now - self.since) * self.rate
        self.since = now
        if rate == self.rate:
            return None
        first, self.rate = self.rate == 0.0, rate
        self.version += 1
        return self.end if first and rate == 1.0 else now + self.work_s / rate


@dataclass
class SimRun:
    deployment: Deployment
    records: list[RequestRecord]
    replicas: list[Replica]

    @property
    def duration_s(self) -> float:
        """The run's start (time 0: arrival times are offsets from it) to the last answer, as
        `splitserve bench` measures a run."""
        return max((r.token_s[-1] for r in self.records), default=0.0)


class _Sim:
    def __init__(self, trace: Sequence[BenchRequest], dep: Deployment, cost: StepCost) -> None:
        self.dep, self.cost = dep, cost
        base = dep.limits
        if dep.disaggregated:
            p_limits, d_limits = dep.prefill_limits or base, dep.decode_limits or base
            self.prefill = [Replica(f"prefill-{i}", cost, p_limits) for i in range(dep.prefill)]
            self.decode = [Replica(f"decode-{i}", cost, d_limits) for i in range(dep.decode)]
        else:
            self.prefill = []
            self.decode = [Replica(f"colocated-{i}", cost, base) for i in range(dep.decode)]
        self.block_size = (self.prefill or self.decode)[0].limits.block_size
        self.trace = {r.index: r for r in trace}
        self.records = {r.index: RequestRecord(r.index, r.prompt_len, r.output_len) for r in trace}
        self.next_turn = {(r.session, r.turn): r for r in trace if r.session is not None}
        # (time, priority, order, kind, data): a replica's next step starts after every other event
        # of its instant, so that requests arriving together are scheduled together
        self.events: list[tuple[float, int, int, str, object]] = []
        self.n = 0
        self.pending: set[str] = set()
        self.picks = 0  # the router's pick counter: its ties go round the workers (router/dispatch.py)
        self.clocks: dict[str, _StepClock] = {}  # each replica's step in flight

    def push(self, t: float, kind: str, data: object, priority: int = 0) -> None:
        heapq.heappush(self.events, (t, priority, self.n, kind, data))
        self.n += 1

    def run(self) -> SimRun:
        for r in self.trace.values():
            if r.turn == 0:
                self.push(r.arrival_s, "arrive", r.index)
        while self.events:
            now, _, _, kind, data = heapq.heappop(self.events)
            if kind == "start":
                self._start(now, data)  # type: ignore[arg-type]
            elif kind == "arrive":
                self._arrive(now, data)  # type: ignore[arg-type]
            elif kind == "step":
                self._step_end(now, *data)  # type: ignore[misc]
            else:
                self._handoff(now, data)  # type: ignore[arg-type]
        unfinished = [r.index for r in self.records.values() if len(r.token_s) < r.output_len]
        if unfinished:
            raise RuntimeError(f"simulation ended with requests unfinished: {unfinished[:5]}")
        records = sorted(self.records.values(), key=lambda r: r.index)
        return SimRun(self.dep, records, self.prefill + self.decode)

    def _kick(self, replica: Replica, now: float) -> None:
        if not replica.busy and replica.name not in self.pending:
            self.pending.add(replica.name)
            self.push(now, "start", replica, priority=1)

    def _start(self, now: float, replica: Replica) -> None:
        self.pending.discard(replica.name)
        if not replica.busy and replica.has_work():
            end = replica.start_step(now)
            self.clocks[replica.name] = _StepClock(end - now, now, end)
            self._retime(now)

    def _retime(self, now: float) -> None:
        """A step started or ended: every step in flight goes on at the speed the host now allows it
        (beside other workers' steps: 1 / the largest `StepCost.corun` factor among them; alone: 1),
        and its end is pushed again where that speed moved it (the earlier push goes stale)."""
        busy = [r for r in self.prefill + self.decode if r.busy]
        for r in busy:
            factors = [self.cost.corun(not r.decode_only, not o.decode_only) for o in busy if o is not r]
            rate = 1.0 / max(factors, default=1.0)
            clock = self.clocks[r.name]
            end = clock.run_at(rate, now)
            if end is not None:
                self.push(end, "step", (r, clock, clock.version))

    def _arrive(self, now: float, rid: int) -> None:
        req, rec = self.trace[rid], self.records[rid]
        rec.arrival_s = now
        prompt = req.prompt if isinstance(req.prompt, tuple) else ()
        blocks = block_hashes(prompt, self.block_size)
        if self.dep.disaggregated:
            replica, stop = self._least_loaded(self.prefill), 1
        else:
            replica, stop = self._least_loaded(self.decode), req.output_len
        replica.add(Seq(rid, req.prompt_len, stop, blocks))
        self._kick(replica, now)

    def _step_end(self, now: float, replica: Replica, clock: _StepClock, version: int) -> None:
        if self.clocks[replica.name] is not clock or clock.version != version:
            return  # the step's speed changed after this end was pushed (or it ended): a later push ends it
        sampled, finished = replica.end_step(now)
        self._retime(now)
        role_prefill = replica in self.prefill
        early = self.dep.first_token == "prefill"  # the prefill worker's answer carries the first token
        for seq in sampled:
            rec = self.records[seq.rid]
            if seq.sampled == 1 and seq.cached:
                rec.cached_tokens = seq.cached
            if not role_prefill or rec.output_len == 1 or early:
                rec.token_s.append(now + self.cost.request_s)
        for seq in finished:
            rec = self.records[seq.rid]
            if role_prefill and rec.output_len > 1:
                rec.transfer_s = self.cost.transfer_s(seq.prompt_len)
                self.push(now + rec.transfer_s, "handoff", seq.rid)
            else:
                self._finished(now + self.cost.request_s, seq.rid)
        self._kick(replica, now)

    def _handoff(self, now: float, rid: int) -> None:
        rec = self.records[rid]
        if self.dep.first_token == "decode":  # the first token, sampled by the prefill worker, streams now
            rec.token_s.append(now + self.cost.request_s)
        replica = self._least_loaded(self.decode)
        seq = Seq(rid, rec.prompt_len, rec.output_len, computed=rec.prompt_len, sampled=1)
        replica.add(seq)
        self._kick(replica, now)

    def _least_loaded(self, replicas: list[Replica]) -> Replica:
        """The router's least-loaded pick: fewest requests in flight; ties go round the replicas, the
        start moving one place with each pick among several (a lone replica is no pick)."""
        if len(replicas) == 1:
            return replicas[0]
        start, n = self.picks, len(replicas)
        self.picks += 1
        return min(replicas, key=lambda r: (r.outstanding, (replicas.index(r) - start) % n))

    def _finished(self, now: float, rid: int) -> None:
        req = self.trace[rid]
        if req.session is None:
            return
        nxt = self.next_turn.get((req.session, req.turn + 1))
        if nxt is not None:
            self.push(now + nxt.think_s, "arrive", nxt.index)


def simulate(trace: Sequence[BenchRequest], deployment: Deployment, cost: StepCost) -> SimRun:
    """Run `trace` (arrival times set, e.g. by `ab.workload.at_rate`) through `deployment`."""
    if deployment.decode < 1:
        raise ValueError("a deployment needs at least one decode (or colocated) replica")
    return _Sim(trace, deployment, cost).run()


__all__ = ["Deployment", "RequestRecord", "SimRun", "simulate"]
