"""Workloads for `splitserve bench`: the traces driven identically at every deployment.

A trace is a list of `BenchRequest`s made from a seed, so two runs with the same arguments send the same
prompts at the same offsets. Kinds:

    synthetic   prompt and output lengths from `fixed:N`, `uniform:LO:HI` or `lognormal:MEDIAN:SIGMA`
    rag         a few retrieved chunks from a fixed corpus (popular chunks recur) + a short question
    summarize   a long unique document, a longer answer
    long-mix    short chat requests with a fraction of rag/summarize ones mixed in
    agent       multi-turn sessions: a system prompt shared by every session, each turn resending the
                whole history plus a new user/tool message; a turn is sent after the previous one
                finishes and a think time
    replay      a JSONL trace: {"timestamp": s, "prompt": str | "prompt_len": n, "output_len": n}

Arrivals (open loop) follow `vllm bench serve`: gaps from a gamma distribution of shape `burstiness`
(1: Poisson) and mean 1/rate, rescaled so that the last request is due at n/rate; rate inf sends all
at once. In a sweep each rate has its own requests (`sweep_traces`: the seed moves on with the rate's
position), so that a deployment's prefix cache never answers a prompt it saw at an earlier rate; the
gap pattern is the same at every rate, scaled. Every target gets the same requests at a given rate.
Prompts are token ids (exact lengths), except replayed text prompts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

WORKLOADS = ("synthetic", "rag", "summarize", "long-mix", "agent", "replay")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str | tuple[int, ...]  # token ids, or text (replayed traces)
    prompt_len: int  # tokens; for a text prompt, the server's usage count replaces it
    output_len: int  # max_tokens (with ignore_eos: exactly this many)
    arrival_s: float = 0.0  # offset from the start of the run (open loop; a session's first turn)
    kind: str = "synthetic"
    session: int | None = None  # agent sessions: later turns wait for the earlier ones ...
    turn: int = 0
    think_s: float = 0.0  # ... and then this long


@dataclass(frozen=True)
class LengthDist:
    """A length distribution: fixed:N, uniform:LO:HI (inclusive), lognormal:MEDIAN:SIGMA."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        parts = spec.split(":")
        try:
            nums = [float(p) for p in parts[1:]]
        except ValueError:
            nums = []
        want = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(parts[0])
        if want is None or len(nums) != want or nums[0] <= 0 or (want == 2 and nums[1] < 0):
            raise ValueError(
                f"bad length spec {spec!r}: use fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA"
            )
        if parts[0] == "uniform" and nums[1] < nums[0]:
            raise ValueError(f"bad length spec {spec!r}: HI < LO")
        return cls(parts[0], nums[0], nums[1] if want == 2 else 0.0)

    def sample(self, rng: np.random.Generator, n: int, lo: int = 1, hi: int | None = None) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, size=n)
        else:
            x = np.round(rng.lognormal(math.log(self.a), self.b, size=n))
        return np.clip(x.astype(np.int64), lo, hi if hi is not None else None)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "synthetic"
    num_prompts: int = 40
    input_len: LengthDist = LengthDist("uniform", 128, 512)
    output_len: LengthDist = LengthDist("uniform", 32, 64)
    burstiness: float = 1.0
    seed: int = 0
    max_model_len: int = 2048
    vocab: tuple[int, int] = (100, 32000)  # token ids drawn from [lo, hi)
    long_fraction: float = 0.3  # long-mix
    system_prompt_len: int = 256  # agent: shared by every session
    turns: tuple[int, int] = (2, 5)  # agent: turns per session, inclusive
    think_s: float = 1.0  # agent: mean think time between turns
    trace: str | None = None  # replay


def arrival_offsets(rng: np.random.Generator, n: int, rate: float, burstiness: float = 1.0) -> np.ndarray:
    """Send times from the run's start, as `vllm bench serve` makes them (see the module docstring)."""
    if n == 0 or math.isinf(rate):
        return np.zeros(n)
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    t = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))
    return t * (n / rate) / t[-1] if t[-1] > 0 else t


def build_trace(spec: WorkloadSpec) -> list[BenchRequest]:
    """The requests of a workload, arrival times not yet set (`at_rate` sets them)."""
    rng = np.random.default_rng(spec.seed)
    if spec.kind == "synthetic":
        return _synthetic(spec, rng, spec.num_prompts, "synthetic")
    if spec.kind in ("rag", "summarize"):
        return _long(spec, rng, [spec.kind] * spec.num_prompts)
    if spec.kind == "long-mix":
        kinds = [
            ("rag" if rng.random() < 0.5 else "summarize") if rng.random() < spec.long_fraction else "chat"
            for _ in range(spec.num_prompts)
        ]
        return _long(spec, rng, kinds)
    if spec.kind == "agent":
        return _agent(spec, rng)
    if spec.kind == "replay":
        if not spec.trace:
            raise ValueError("the replay workload needs --trace FILE.jsonl")
        return load_trace(spec.trace, spec.max_model_len, spec.vocab, spec.seed)
    raise ValueError(f"unknown workload {spec.kind!r}; one of {', '.join(WORKLOADS)}")


def sweep_traces(spec: WorkloadSpec, n_rates: int) -> list[list[BenchRequest]]:
    """One trace per swept rate, with fresh prompts each (a replayed trace's text prompts stay the same:
    the report says so)."""
    return [build_trace(replace(spec, seed=spec.seed + 1009 * i)) for i in range(n_rates)]


def at_rate(
    trace: list[BenchRequest], rate: float | None, burstiness: float, seed: int
) -> list[BenchRequest]:
    """The trace with arrival times for `rate` requests/s. rate None keeps a replayed trace's own
    timestamps; agent sessions start at rate / (mean turns per session)."""
    if rate is None:
        return list(trace)
    firsts = [r for r in trace if r.turn == 0]
    if any(r.session is not None for r in trace):
        rate = rate * len(firsts) / max(len(trace), 1)  # sessions per second
    if _is_replay(trace) and not math.isinf(rate):
        # keep the recorded shape, rescaled to the wanted mean rate
        stamps = np.array([r.arrival_s for r in firsts])
        span = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
        scale = (len(firsts) / rate) / span if span > 0 else 0.0
        offsets = (stamps - stamps[0]) * scale
    else:
        offsets = arrival_offsets(np.random.default_rng(seed + 7919), len(firsts), rate, burstiness)
    it = iter(offsets.tolist())
    return [replace(r, arrival_s=next(it)) if r.turn == 0 else r for r in trace]


def _is_replay(trace: list[BenchRequest]) -> bool:
    return bool(trace) and trace[0].kind == "replay"


def _ids(rng: np.random.Generator, n: int, vocab: tuple[int, int]) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(vocab[0], vocab[1], size=n))


def _room(spec: WorkloadSpec, out: int) -> int:
    """The longest prompt that leaves room for `out` tokens in max_model_len."""
    return max(1, spec.max_model_len - out - 1)


def _synthetic(spec: WorkloadSpec, rng: np.random.Generator, n: int, kind: str) -> list[BenchRequest]:
    outs = spec.output_len.sample(rng, n, 1, spec.max_model_len - 2)
    ins = spec.input_len.sample(rng, n, 1)
    reqs = []
    for i in range(n):
        plen = int(min(ins[i], _room(spec, int(outs[i]))))
        reqs.append(BenchRequest(i, _ids(rng, plen, spec.vocab), plen, int(outs[i]), kind=kind))
    return reqs


def _long(spec: WorkloadSpec, rng: np.random.Generator, kinds: list[str]) -> list[BenchRequest]:
    """RAG: 3-6 chunks of 192 tokens from a 64-chunk corpus (Zipf-popular) + a 16-64 token question,
    32-128 out. Summarize: a unique 1024-1800 token document, 128-256 out. Chat: the synthetic lengths."""
    corpus = [_ids(rng, 192, spec.vocab) for _ in range(64)]
    popularity = 1.0 / np.arange(1, 65)
    popularity /= popularity.sum()
    reqs = []
    for i, kind in enumerate(kinds):
        if kind == "rag":
            out = int(rng.integers(32, 129))
            picks = rng.choice(64, size=int(rng.integers(3, 7)), replace=False, p=popularity)
            ids = sum((corpus[k] for k in picks), ()) + _ids(rng, int(rng.integers(16, 65)), spec.vocab)
        elif kind == "summarize":
            out = int(rng.integers(128, 257))
            ids = _ids(rng, int(rng.integers(1024, 1801)), spec.vocab)
        else:
            r = _synthetic(spec, rng, 1, kind)[0]
            reqs.append(replace(r, index=i))
            continue
        out = min(out, spec.max_model_len // 4)
        ids = ids[: _room(spec, out)]
        reqs.append(BenchRequest(i, ids, len(ids), out, kind=kind))
    return reqs


def _agent(spec: WorkloadSpec, rng: np.random.Generator) -> list[BenchRequest]:
    """Sessions until num_prompts turns: history = system + (message + reply) per turn, where the
    reply is a stand-in of the turn's output length (the trace must not depend on what was answered)."""
    system = _ids(rng, spec.system_prompt_len, spec.vocab)
    reqs: list[BenchRequest] = []
    session = 0
    while len(reqs) < spec.num_prompts:
        history = system
        turns = int(rng.integers(spec.turns[0], spec.turns[1] + 1))
        for turn in range(min(turns, spec.num_prompts - len(reqs))):
            msg = spec.input_len.sample(rng, 1, 1)[0]
            out = int(spec.output_len.sample(rng, 1, 1, spec.max_model_len // 4)[0])
            prompt = history + _ids(rng, int(msg), spec.vocab)
            if len(prompt) > _room(spec, out):
                break  # the session's context is full: it ends here
            think = float(rng.exponential(spec.think_s)) if turn else 0.0
            reqs.append(BenchRequest(len(reqs), prompt, len(prompt), out, 0.0, "agent", session, turn, think))
            history = prompt + _ids(rng, out, spec.vocab)
        session += 1
    return reqs


def load_trace(
    path: str | Path, max_model_len: int = 2048, vocab: tuple[int, int] = (100, 32000), seed: int = 0
) -> list[BenchRequest]:
    """A JSONL trace: one request a line with `timestamp` (seconds; or `timestamp_ms`), `prompt` (text)
    or `prompt_len` / `input_length` (random token ids of that length), and `output_len` /
    `output_length`. Lines are sorted by timestamp; blank lines and `#` comments are skipped."""
    rng = np.random.default_rng(seed)
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            row = json.loads(line)
            ts = float(row["timestamp_ms"]) / 1e3 if "timestamp_ms" in row else float(row.get("timestamp", 0))
            out = int(row.get("output_len", row.get("output_length", 0)))
            text = row.get("prompt")
            plen = int(row.get("prompt_len", row.get("input_length", 0)))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{path}:{n}: not a trace line ({exc})") from None
        if out < 1 or (text is None and plen < 1) or (text is not None and not isinstance(text, str)):
            raise ValueError(f"{path}:{n}: needs output_len >= 1 and a prompt (text) or prompt_len >= 1")
        rows.append((ts, n, text, plen, out))
    if not rows:
        raise ValueError(f"{path}: no requests in the trace")
    rows.sort()
    t0 = rows[0][0]
    reqs = []
    for i, (ts, _, text, plen, out) in enumerate(rows):
        if text is None:
            plen = min(plen, max(1, max_model_len - out - 1))
            prompt: str | tuple[int, ...] = _ids(rng, plen, vocab)
        else:
            prompt = text
            plen = plen or max(1, len(text) // 4)  # an estimate until the server counts it
        reqs.append(BenchRequest(i, prompt, plen, out, ts - t0, "replay"))
    return reqs


def write_trace(path: str | Path, trace: list[BenchRequest]) -> None:
    """Save a trace (its lengths and arrival times) as JSONL that `load_trace` reads back."""
    with open(path, "w") as f:
        for r in trace:
            row: dict = {"timestamp": round(r.arrival_s, 6), "output_len": r.output_len}
            if isinstance(r.prompt, str):
                row["prompt"] = r.prompt
            else:
                row["prompt_len"] = r.prompt_len
            f.write(json.dumps(row) + "\n")


__all__ = [
    "WORKLOADS",
    "BenchRequest",
    "LengthDist",
    "WorkloadSpec",
    "arrival_offsets",
    "at_rate",
    "build_trace",
    "sweep_traces",
    "load_trace",
    "write_trace",
]
