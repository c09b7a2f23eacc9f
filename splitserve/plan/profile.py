"""A profile: the step-time and handoff model of one model on one kind of device, fitted to steps
timed on the real engine and transfers timed over the real transport (`measure.py` takes them), and
saved as JSON so that the planner can be rerun without measuring again.

The fit is least squares on relative error (each point weighted by 1 / its time, so that a 5 ms
decode step counts as much as a 500 ms prefill), over the features of `cost.StepShape`, with every
coefficient kept >= 0 (a feature whose coefficient would come out negative is dropped and the rest
refitted). The handoff is `latency + bytes / bandwidth`, fitted the same way. `FitReport` keeps the
residuals: the planner prints them, and a bad fit is there to be seen, not hidden.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from splitserve.plan.cost import StepCost, StepShape

PROFILE_VERSION = 1


class StepPoint(msgspec.Struct, frozen=True):
    prefill_tokens: int
    prefill_pairs: float
    decode_seqs: int
    decode_context: int
    seconds: float

    @property
    def shape(self) -> StepShape:
        return StepShape(self.prefill_tokens, self.prefill_pairs, self.decode_seqs, self.decode_context)


class TransferPoint(msgspec.Struct, frozen=True):
    bytes: int
    seconds: float


class FitReport(msgspec.Struct, frozen=True):
    points: int
    rms_rel: float  # root mean square of (fitted - measured) / measured
    max_rel: float  # the worst point's |fitted - measured| / measured
    worst: str  # which point that was


class Profile(msgspec.Struct, kw_only=True):
    version: int = PROFILE_VERSION
    model: str
    device: str
    dtype: str
    threads: int  # torch threads per worker the steps were timed with (CPU)
    pinned: bool = False  # timed bound to `threads` CPUs of its own (runtime.pin_cores)
    backend: str  # the KV transport the handoff was timed over
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    cost: StepCost
    step_fit: FitReport
    transfer_fit: FitReport
    steps: list[StepPoint] = []
    transfers: list[TransferPoint] = []
    measured_s: float = 0.0  # wall time of the profiling run
    # the prefill shapes' (slowest - fastest) / median over the profile's rounds: (median, worst);
    # the host's own noise at profiling time, which no fit removes
    prefill_spread: tuple[float, float] = (0.0, 0.0)

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            profile = msgspec.json.decode(Path(path).read_bytes(), type=cls)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ValueError(f"{path}: not a splitserve profile ({exc})") from None
        if profile.version != PROFILE_VERSION:
            raise ValueError(
                f"{path}: profile version {profile.version}, this splitserve reads {PROFILE_VERSION}"
            )
        return profile

    def describe(self) -> str:
        c = self.cost
        return "\n".join(
            [
                f"profile: {self.model} on {self.device} ({self.dtype}, {self.threads} thread(s)"
                f"{', pinned' if self.pinned else ''}), "
                f"KV over {self.backend}; measured in {self.measured_s:.0f} s",
                f"  step = {c.base_s * 1e3:.2f} ms + {c.prefill_token_s * 1e6:.1f} us/prompt token "
                f"+ {c.prefill_pair_s * 1e9:.3f} ns/query-key pair + {c.decode_seq_s * 1e3:.3f} ms/decoding "
                f"request + {c.decode_context_s * 1e6:.3f} us/context token",
                f"    fit over {self.step_fit.points} steps: rms {self.step_fit.rms_rel:.1%}, "
                f"worst {self.step_fit.max_rel:.1%} ({self.step_fit.worst}); a prefill's spread between "
                f"rounds: median {self.prefill_spread[0]:.1%}, worst {self.prefill_spread[1]:.1%}",
                f"  co-run (pinned), a step beside another worker's: decode|decode x{c.corun_factor:.2f}, "
                f"prompt|decode x{c.corun_prefill_factor:.2f}, "
                f"decode|prompt x{c.corun_decode_prefill_factor:.2f}, "
                f"prompt|prompt x{c.corun_prefill_prefill_factor:.2f}",
                f"  served: prompt steps x{c.served_factor:.3f} the engine's, decode steps "
                f"x{c.served_decode_factor:.3f}, + {c.request_s * 1e3:.1f} ms a request",
                f"  handoff = {c.latency_s * 1e3:.2f} ms + bytes / {c.bytes_per_s / 1e9:.2f} GB/s; "
                f"{c.kv_bytes_per_token} B/token + {c.state_bytes} B state per request",
                f"    fit over {self.transfer_fit.points} transfers: rms {self.transfer_fit.rms_rel:.1%}, "
                f"worst {self.transfer_fit.max_rel:.1%} ({self.transfer_fit.worst})",
            ]
        )


STEP_FEATURES = ("base_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_s")


def _step_row(p: StepPoint) -> list[float]:
    return [1.0, p.prefill_tokens, p.prefill_pairs, p.decode_seqs, p.decode_context]


def nonneg_relative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of x @ coef ~ y on relative error, with coef >= 0: features whose coefficient
    comes out negative are dropped (held at 0) and the rest refitted. Columns all zero stay at 0."""
    w = 1.0 / y
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


def _report(fitted: np.ndarray, y: np.ndarray, labels: list[str]) -> FitReport:
    rel = (fitted - y) / y
    worst = int(np.argmax(np.abs(rel)))
    return FitReport(len(y), float(np.sqrt(np.mean(rel**2))), float(abs(rel[worst])), labels[worst])


def fit_steps(points: list[StepPoint]) -> tuple[dict[str, float], FitReport]:
    x = np.array([_step_row(p) for p in points], dtype=float)
    y = np.array([p.seconds for p in points], dtype=float)
    coef = nonneg_relative_fit(x, y)
    labels = [
        f"{p.prefill_tokens} prompt tokens, {p.decode_seqs} decoding at context {p.decode_context}: "
        f"{p.seconds * 1e3:.1f} ms measured"
        for p in points
    ]
    return dict(zip(STEP_FEATURES, coef.tolist(), strict=True)), _report(x @ coef, y, labels)


def fit_transfers(points: list[TransferPoint]) -> tuple[float, float, FitReport]:
    """-> (latency_s, bytes_per_s, report)."""
    x = np.array([[1.0, p.bytes] for p in points], dtype=float)
    y = np.array([p.seconds for p in points], dtype=float)
    coef = nonneg_relative_fit(x, y)
    labels = [f"{p.bytes / 2**20:.1f} MiB: {p.seconds * 1e3:.2f} ms measured" for p in points]
    per_byte = float(coef[1])
    return float(coef[0]), (1.0 / per_byte if per_byte > 0 else float("inf")), _report(x @ coef, y, labels)


def fitted_cost(
    steps: list[StepPoint], transfers: list[TransferPoint], kv_bytes_per_token: int, state_bytes: int
) -> tuple[StepCost, FitReport, FitReport]:
    coefs, step_fit = fit_steps(steps)
    latency, bandwidth, transfer_fit = fit_transfers(transfers)
    cost = StepCost(
        **coefs,
        latency_s=latency,
        bytes_per_s=bandwidth,
        kv_bytes_per_token=kv_bytes_per_token,
        state_bytes=state_bytes,
    )
    return cost, step_fit, transfer_fit


def pooled(profiles: Sequence[Profile]) -> Profile:
    """One profile from several of one model on one host: each coefficient of the cost at its median
    over them (a profile taken while the host ran slow or fast moves the median less than it moves
    itself), their steps and transfers together, the fit reports those of the pooled coefficients."""
    if not profiles:
        raise ValueError("no profile to pool")
    first = profiles[0]
    keys = ("model", "device", "dtype", "threads", "pinned", "backend", "block_size")
    for p in profiles[1:]:
        if any(getattr(p, k) != getattr(first, k) for k in keys):
            raise ValueError(
                "profiles of different models, devices or knobs cannot be pooled: " + ", ".join(keys)
            )
    if len(profiles) == 1:
        return first
    fields = {}
    for name in StepCost.__struct_fields__:
        mid = statistics.median(getattr(p.cost, name) for p in profiles)
        fields[name] = round(mid) if isinstance(getattr(first.cost, name), int) else mid
    cost = StepCost(**fields)
    steps = [s for p in profiles for s in p.steps]
    transfers = [t for p in profiles for t in p.transfers]
    coef = np.array([fields[f] for f in STEP_FEATURES])
    y = np.array([s.seconds for s in steps], dtype=float)
    step_fit = _report(
        np.array([_step_row(s) for s in steps]) @ coef, y, [f"step {i}" for i in range(len(y))]
    )
    ty = np.array([t.seconds for t in transfers], dtype=float)
    fitted = np.array([cost.latency_s + t.bytes / cost.bytes_per_s for t in transfers])
    transfer_fit = _report(fitted, ty, [f"{t.bytes / 2**20:.1f} MiB" for t in transfers])
    spread = (
        statistics.median(p.prefill_spread[0] for p in profiles),
        max(p.prefill_spread[1] for p in profiles),
    )
    return msgspec.structs.replace(
        first, cost=cost, step_fit=step_fit, transfer_fit=transfer_fit, steps=steps, transfers=transfers,
        measured_s=sum(p.measured_s for p in profiles), prefill_spread=spread,
    )  # fmt: skip


__all__ = [
    "FitReport",
    "Profile",
    "StepPoint",
    "TransferPoint",
    "fit_steps",
    "fit_transfers",
    "fitted_cost",
    "nonneg_relative_fit",
    "pooled",
]
