"""Batched sampling with per-request parameters.

Order of operations (vLLM's): raw logprobs are taken first (so they are the model's own distribution),
then penalties and the min_tokens ban on stop tokens, then greedy rows take the argmax; the rest are
divided by temperature, filtered by min_p, top_k and top_p, and drawn: on CUDA by the exponential race
(argmax of p / q, q ~ Exp(1): no host wait), on CPU by inverse CDF (one uniform number a row instead of
one per vocabulary entry). A constrained request's row is masked by its grammar after the penalties
(engine/grammar.py), so every filter and the draw see only the tokens it allows. A seeded request
draws from its own generator, so its tokens do not depend on its batch mates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.grammar import mask_logits
from splitserve.engine.request import Request
from splitserve.kernels.cpu import fused as cpu_fused
from splitserve.sampling.logprobs import TokenLogprob


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._bitmask: dict[str, torch.Tensor] = {}  # the grammar mask's pinned host buffer (CUDA)

    def __call__(
        self, logits: torch.Tensor, reqs: Sequence[Request]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits [N, V] fp32, one row per request to sample
        logits = logits[:, : self.vocab_size]
        want_lp = [r.params.logprobs is not None for r in reqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_lp) else None
        if any(r.params.has_penalties for r in reqs):
            logits = self._apply_penalties(logits.clone(), reqs)
        logits = self._apply_min_tokens(logits, reqs)
        if any(r.grammar is not None for r in reqs):
            logits = mask_logits(logits, reqs, self._bitmask)
        tokens = self._sample(logits, reqs)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, [None] * len(reqs)
        return token_list, _gather_logprobs(raw_logprobs, tokens, reqs)

    def sample_tokens(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """The next token of each row, left on the device (nothing waits for the GPU): for requests
        without logprobs, penalties or min_tokens (the engine's overlapped steps). Constrained rows are
        masked by their grammars' current state (filled on the host; its copy is queued, not awaited)."""
        logits = logits[:, : self.vocab_size]
        if any(r.grammar is not None for r in reqs):
            logits = mask_logits(logits, reqs, self._bitmask)
        return self._sample(logits, reqs)

    def _sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        greedy_rows = [r.params.greedy for r in reqs]
        if all(greedy_rows):  # decided on the host: no wait on the GPU
            return logits.argmax(dim=-1)
        # CPU: skip what changes nothing (at 64 rows of 49,152 the argmax and the division by 1 take
        # ~10 ms of a ~190 ms decode step); CUDA keeps one shape of work, with no host decisions
        cpu = logits.device.type == "cpu"
        temps_list = [1.0 if g else r.params.temperature for g, r in zip(greedy_rows, reqs, strict=True)]
        gens = [r.generator if r.generator is not None else self.generator for r in reqs]
        if cpu and logits.dtype == torch.float32 and cpu_fused.ready():
            return _sample_cpu_op(logits, reqs, greedy_rows, temps_list, gens)
        if not (cpu and all(t == 1.0 for t in temps_list)):
            logits = logits / _on(logits.device, temps_list)[:, None]
        probs = torch.softmax(_filter(logits, reqs), dim=-1)
        if cpu:
            sampled = _inverse_cdf(probs, gens)
        else:
            q = torch.empty_like(probs)
            for i, gen in enumerate(gens):
                _exponentials(q[i], gen)
            sampled = (probs / q).argmax(dim=-1)
        if cpu and not any(greedy_rows):
            return sampled
        return torch.where(_on(logits.device, greedy_rows, torch.bool), logits.argmax(dim=-1), sampled)

    def _apply_min_tokens(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Until a request has min_tokens outputs, EOS (unless ignored) and its stop_token_ids cannot be
        sampled (vLLM's semantics: otherwise EOS would be emitted mid-output without stopping it)."""
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(reqs):
            p = r.params
            if len(r.output_token_ids) >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            ids = [t for t in banned if 0 <= t < logits.shape[1]]
            rows += [i] * len(ids)
            cols += ids
        if not rows:
            return logits
        logits = logits.clone()
        logits[rows, cols] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        for i, r in enumerate(reqs):
            p = r.params
            if not p.has_penalties:
                continue
            out_ids = torch.tensor(
                r.earlier_output + r.output_token_ids, dtype=torch.long, device=logits.device
            )
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(r.prompt_token_ids + r.output_token_ids, device=logits.device).unique()
                row = logits[i, seen]
                logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            if out_ids.numel() and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(out_ids, minlength=logits.shape[1])[: logits.shape[1]].float()
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits


def _sample_cpu_op(
    logits: torch.Tensor,
    reqs: Sequence[Request],
    greedy_rows: list[bool],
    temps_list: list[float],
    gens: Sequence[torch.Generator],
) -> torch.Tensor:
    """CPU fp32 with kernels/cpu/fused.py loaded: the same draw as `_inverse_cdf` (one uniform number a
    row, every row: a generator moves as `replay_draw` says) in one op over the logits, without the
    [N, V] probabilities, their fp64 cumsum and the search. With a filter (min_p, top_k, top_p) the
    rows are divided by their temperatures and filtered in torch first, then drawn at temperature 1."""
    u = torch.cat([_uniform(g) for g in gens])
    temps = [0.0 if g else t for g, t in zip(greedy_rows, temps_list, strict=True)]
    if _filters_apply(reqs):
        logits = _filter(logits / torch.tensor(temps_list)[:, None], reqs)
        temps = [0.0 if g else 1.0 for g in greedy_rows]
    return cpu_fused.sample_rows(logits, torch.tensor(temps, dtype=torch.float32), u)


def target_probs(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """The distribution a sampled (non-greedy) row is drawn from, as `_sample` draws it: softmax of the
    logits [N, V] over the temperature, filtered by min_p, top_k and top_p. -> [N, V] fp32."""
    temps = _on(logits.device, [r.params.temperature for r in reqs])
    return torch.softmax(_filter(logits / temps[:, None], reqs), dim=-1)


def _filters_apply(reqs: Sequence[Request]) -> bool:
    """Whether `_filter` changes any row (min_p, top_k or top_p asked for)."""
    return any(r.params.min_p > 0 or r.params.top_k or r.params.top_p < 1 for r in reqs)


def _inverse_cdf(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """CPU: one draw of each row's categorical distribution from one uniform number, the first token
    whose cumulative probability (fp64) passes u * the row's total. The exponential race draws a number
    per vocabulary entry from a serial generator: at 64 rows of 49,152 (the default model at
    temperature 1) 64 ms against 8 ms, softmax included (`bench/cpu_sampler.py`), where a whole decode
    step takes ~170 ms. A token of probability 0 (filtered out) has an empty interval: never drawn."""
    cdf = probs.to(torch.float64).cumsum_(dim=-1)
    u = torch.cat([_uniform(g) for g in generators])
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def replay_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance `generator` as one row's draw in `_sample` does: a decode engine that imports a seeded
    request without the prefill's generator state replays the first token's draw with this."""
    if generator.device.type == "cpu":
        _uniform(generator)
    else:
        _exponentials(torch.empty(vocab_size, dtype=torch.float32, device=generator.device), generator)


def _uniform(generator: torch.Generator) -> torch.Tensor:
    """A CPU row's draw (`_inverse_cdf`): one fp64 number in [0, 1)."""
    return torch.rand(1, generator=generator, dtype=torch.float64)


def _exponentials(q: torch.Tensor, generator: torch.Generator) -> None:
    """A CUDA row's draw (the exponential race): q[v] ~ Exp(1) for every vocabulary entry, in place."""
    q.exponential_(generator=generator)


def _on(device: torch.device, values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-row parameters on the device without a host wait (a plain torch.tensor(..., device=cuda)
    synchronizes the stream: it would wait for the step that is still running)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _filter(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """min_p, top_k and top_p, each applied only if some row asks for it. logits [N, V]."""
    dev = logits.device
    # which filters run is decided from the host-side parameters: no wait on the GPU
    if not _filters_apply(reqs):
        return logits
    if any(r.params.min_p > 0 for r in reqs):
        min_p = _on(dev, [r.params.min_p for r in reqs])
        probs = torch.softmax(logits, dim=-1)
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    top_k = [r.params.top_k for r in reqs]
    if not any(top_k) and all(r.params.top_p >= 1 for r in reqs):
        return logits
    v = logits.shape[1]
    top_p = _on(dev, [r.params.top_p for r in reqs])
    ks = [t if 0 < t < v else v for t in top_k]
    k = _on(dev, ks, torch.int64)
    c = max([t for t in ks if t < v] + [TOP_CANDIDATES])
    if dev.type != "cpu" or c * 4 > v:  # sort the whole vocabulary (on CUDA: no host wait, and cheap)
        return _top_k_top_p(logits, logits.sort(dim=-1, descending=True), k, top_p)[0]
    # CPU: the c most likely tokens of each row, then top_k and top_p over them; exact wherever the cut
    # falls inside them: a row with a top_k always (c >= every top_k below V), a top_p-only row when the
    # c candidates hold more than top_p of its probability; any other row is sorted whole
    p_only = [i for i, t in enumerate(ks) if t >= v and reqs[i].params.top_p < 1]  # top_p over all of V
    out, beyond = _top_k_top_p(logits, logits.topk(c, dim=-1), k, top_p, whole=k >= v, p_only=p_only)
    untouched = [i for i, t in enumerate(ks) if t >= v and reqs[i].params.top_p >= 1]
    if untouched:  # no filter on these rows
        out[untouched] = logits[untouched]
    if beyond is not None and bool(beyond.any()):
        rows = beyond.nonzero().flatten()
        sub = logits[rows]
        out[rows] = _top_k_top_p(sub, sub.sort(dim=-1, descending=True), k[rows], top_p[rows])[0]
    return out


TOP_CANDIDATES = 256  # CPU, rows with top_p only: the tokens looked at before a whole sort


def _top_k_top_p(
    logits: torch.Tensor,
    top: tuple[torch.Tensor, torch.Tensor],  # (values, indices): each row's first C tokens, descending
    k: torch.Tensor,  # [N] tokens kept by top_k (V: all)
    top_p: torch.Tensor,  # [N]
    whole: torch.Tensor | None = None,  # [N] bool, for C < V: the row has no top_k (p over all of V)
    p_only: Sequence[int] = (),  # with `whole`: the rows with a top_p and no top_k (host-side)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits with everything outside each row's top_k and top_p at -inf, and with C < V a [N] bool:
    the rows whose top_p cut may lie beyond the C tokens, which this answer cuts at C)."""
    values, order = top
    c = values.shape[1]
    drop = torch.arange(c, device=logits.device)[None, :] >= k[:, None]
    kept = values.masked_fill(drop, float("-inf"))
    if whole is None:
        probs = torch.softmax(kept, dim=-1)
    else:
        # a top_k row's probabilities are over its kept tokens; only a top_p-only row's need the
        # normalizer over the whole vocabulary (rows with no filter at all are put back by the caller)
        lse = kept.logsumexp(dim=-1)
        if p_only:
            lse[list(p_only)] = logits[list(p_only)].logsumexp(dim=-1)
        probs = (kept - lse[:, None]).exp()
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before > top_p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    filtered = values.masked_fill(drop, float("-inf"))
    if whole is None:
        return logits.scatter(1, order, filtered), None
    out = torch.full_like(logits, float("-inf")).scatter(1, order, filtered)
    return out, whole & (top_p < 1) & (probs.sum(dim=-1) <= top_p)


def _gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, reqs: Sequence[Request]
) -> list[TokenLogprob | None]:
    max_k = max((r.params.logprobs or 0) for r in reqs)
    top_vals, top_ids = logprobs.topk(max(max_k, 1), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    out: list[TokenLogprob | None] = []
    for i, r in enumerate(reqs):
        k = r.params.logprobs
        if k is None:
            out.append(None)
            continue
        top = tuple(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist(), strict=True))
        out.append(TokenLogprob(int(tokens[i]), float(chosen[i]), int(ranks[i]), top))
    return out
