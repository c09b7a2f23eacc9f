"""The gate's proof that a disaggregated deployment disaggregates: probe requests sent through the
router, and every worker's counters read before and after them.

A deployment can answer every request correctly and still not split: the router sends prompts
straight to the decode pool (which prefills them itself), or the handoff fails and the decode worker
recomputes each prompt under the `recompute` policy, or the transfer moves less than the prompt's KV.
Each is one fact, checked on the counters' differences over the probes:

  prefill pool     the prefill workers computed at least the probes' prompt tokens
                   (`prompt_tokens_computed` on their /stats; the probes' prompts begin with a fresh
                   nonce, so that no prefix cache serves them)
  decode recompute the decode workers recomputed no prompt tokens of handed-off requests
                   (`kv_transfer.counts.recomputed_tokens`)
  handoff bytes    the bytes the decode workers' transports fetched, per handed-off prompt token, are
                   at least one KV block's bytes / its tokens (`block_bytes` / `block_size` of the
                   layout; whole blocks move, so a correct handoff never moves less)
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Protocol

import httpx

from splitserve.router.probe import blocks_for


class Report(Protocol):
    """What these checks need of verify.py's report: adding a check."""

    def add(self, name: str, scope: str, ok: bool, detail: str, value: Any = None) -> None: ...


PROBES = 3  # requests sent through the router
PROBE_REPEAT = 8  # the verify prompt, repeated: a prompt of several KV blocks


async def check_split(
    http: httpx.AsyncClient, url: str, headers: dict[str, str], dep: dict, report: Report
) -> None:
    """Add the three facts' checks to `report` (a disaggregated deployment's ready workers)."""
    ready = [w for w in dep["workers"] if w["state"] == "ready" and w["role"] in ("prefill", "decode")]
    before = await _snapshot(http, ready)
    try:
        prompt_tokens = await _probe(http, url, headers, dep["verify"])
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        report.add("split probes", "deployment", False, f"probe requests through the router failed: {exc}")
        return
    after = await _snapshot(http, ready)
    delta = {
        role: _delta(before, after, [w for w in ready if w["role"] == role]) for role in ("prefill", "decode")
    }
    _prefill_fact(delta, prompt_tokens, report)
    _recompute_fact(delta["decode"], report)
    _bytes_fact(delta["decode"], ready, dep["verify"], report)


async def _snapshot(http: httpx.AsyncClient, workers: list[dict]) -> dict[str, dict]:
    stats = await asyncio.gather(*(http.get(f"{w['url']}/stats") for w in workers))
    return {w["name"]: s.json() for w, s in zip(workers, stats, strict=True)}


async def _probe(http: httpx.AsyncClient, url: str, headers: dict[str, str], v: dict) -> int:
    """Send the probes one after another; -> their prompt tokens (the router's usage count)."""
    models = (await http.get(f"{url}/v1/models", headers=headers)).json()
    model = models["data"][0]["id"]
    total = 0
    for _ in range(PROBES):
        prompt = f"{secrets.token_hex(8)}: " + " ".join([v["prompt"]] * PROBE_REPEAT)
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = await http.post(f"{url}/v1/completions", json=body, headers=headers)
        r.raise_for_status()
        total += int(r.json()["usage"]["prompt_tokens"])
    return total


def _counts(stats: dict) -> dict[str, float]:
    kv = stats.get("kv_transfer") or {}
    conn, tr = kv.get("counts") or {}, (kv.get("transport") or {}).get("counts") or {}
    return {
        "prompt_tokens": stats.get("prompt_tokens_computed", 0),
        "recomputed_tokens": conn.get("recomputed_tokens", 0),
        "imported_tokens": conn.get("imported_tokens", 0),
        "imports": conn.get("fetches", 0),
        "fetched_bytes": tr.get("fetched_bytes", 0),
        "transport_fetches": tr.get("fetches", 0),
    }


def _delta(before: dict, after: dict, workers: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {"workers": {}}
    for w in workers:
        a, b = _counts(after[w["name"]]), _counts(before[w["name"]])
        d = {k: a[k] - b[k] for k in a}
        out["workers"][w["name"]] = d
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _per_worker(delta: dict, key: str) -> str:
    return ", ".join(f"{name} {d[key]:g}" for name, d in delta["workers"].items())


def _prefill_fact(delta: dict, prompt_tokens: int, report: Report) -> None:
    pre, dec = delta["prefill"], delta["decode"]
    ok = pre.get("prompt_tokens", 0) >= prompt_tokens
    detail = (
        f"the prefill pool computed {pre.get('prompt_tokens', 0):g} of the {PROBES} probes' {prompt_tokens} "
        f"prompt tokens ({_per_worker(pre, 'prompt_tokens')})"
    )
    if not ok:
        detail = "NOT PREFILLED: " + detail
        if dec.get("prompt_tokens", 0) > 0:
            detail += (
                f"; the decode pool computed {dec['prompt_tokens']:g} prompt tokens itself: the router did "
                "not send the prompts to the prefill pool"
            )
    report.add("prefill pool", "deployment", ok, detail, pre.get("prompt_tokens", 0))


def _recompute_fact(dec: dict, report: Report) -> None:
    n = dec.get("recomputed_tokens", 0)
    if n == 0:
        imported = dec.get("imported_tokens", 0)
        detail = f"decode workers recomputed no handed-off prompt ({imported:g} prompt tokens imported)"
    else:
        detail = (
            f"RECOMPUTED: decode workers recomputed {n:g} prompt tokens of handed-off requests "
            f"({_per_worker(dec, 'recomputed_tokens')}): their KV never arrived, each prompt ran twice"
        )
    report.add("decode recompute", "deployment", n == 0, detail, n)


def _bytes_fact(dec: dict, workers: list[dict], v: dict, report: Report) -> None:
    decodes = [w for w in workers if w["role"] == "decode"]
    info = decodes[0].get("info") or {} if decodes else {}
    block_bytes = int(info.get("block_bytes") or 0)
    block_size = int((info.get("engine") or {}).get("block_size") or 0)
    tokens, nbytes = dec.get("imported_tokens", 0), dec.get("fetched_bytes", 0)
    if not block_bytes or not block_size:
        report.add("handoff bytes", "deployment", False, "the decode workers do not report their KV layout")
        return
    expected = block_bytes / block_size
    if tokens <= 0:
        report.add("handoff bytes", "deployment", False, "no prompt KV was handed off for the probes", 0.0)
        return
    # the router's run-time KV probes (verify.runtime_probe_mb each) may have fetched meanwhile: their
    # whole payloads are taken off, so that they can only lower the figure, never hide a shortfall
    extra = max(0, dec.get("transport_fetches", 0) - dec.get("imports", 0))
    nbytes -= extra * blocks_for(v["runtime_probe_mb"], block_bytes) * block_bytes
    per_token = nbytes / tokens
    ok = per_token >= expected
    detail = (
        f"{per_token:,.0f} B fetched per handed-off prompt token (KV layout: {expected:,.0f} B/token; "
        f"{nbytes / 2**20:.2f} MiB for {tokens:g} tokens"
        + (f", less {extra:g} run-time probes' payloads)" if extra else ")")
    )
    report.add("handoff bytes", "deployment", ok, detail if ok else "SHORT: " + detail, per_token)


__all__ = ["PROBES", "check_split"]
