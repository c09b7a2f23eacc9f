"""The manifest's knobs of cache-aware routing, `router.cache_aware` (router/cache_policy.py scores the
replicas with them; docs/usage.md tells the score):

    router:
      policy: cache_aware
      cache_aware: {poll_wait_s, stale_s, cache_threshold, load_weight, request_tokens,
                    balance_abs_threshold, balance_rel_threshold, kv_usage_limit, hybrid_kv_credit}
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CacheAwareSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # the long poll of each replica's GET /kv/events answers at least this often (a heartbeat) ...
    poll_wait_s: float = Field(default=2.0, gt=0, le=60, allow_inf_nan=False)
    # ... and a replica with no answer for this long (or a sequence gap, or a restart, until its snapshot
    # is in) is routed by the hash policy (prefix_affinity) instead of by its cache
    stale_s: float = Field(default=5.0, gt=0, le=600, allow_inf_nan=False)
    # a prompt of which no replica holds this share (its leading blocks) is new: it goes to the replica
    # with the least queued and the smallest cache, so that new prefixes spread over the replicas
    cache_threshold: float = Field(default=0.5, ge=0, le=1, allow_inf_nan=False)
    # cost = prompt tokens the replica must compute + load_weight * tokens of prefill queued there
    load_weight: float = Field(default=1.0, ge=0, le=1000, allow_inf_nan=False)
    # what one request in flight weighs in the queue, besides its prompt tokens to compute
    request_tokens: int = Field(default=64, ge=0, le=1 << 20)
    # SGLang's balance rule: when the busiest replica has more than `abs` requests in flight over the
    # least busy and more than `rel` times as many, the least busy gets the request, cache aside
    balance_abs_threshold: int = Field(default=8, ge=0, le=1 << 20)
    balance_rel_threshold: float = Field(default=1.5, ge=1, le=1000, allow_inf_nan=False)
    # a replica whose KV blocks are in use above this share takes no request while another is below it
    kv_usage_limit: float = Field(default=0.95, gt=0, le=1, allow_inf_nan=False)
    # hybrid models: blocks cached past the last state checkpoint save nothing now, but the engine
    # checkpoints the shared boundary on a hit, so the next request gains them; they count this much
    hybrid_kv_credit: float = Field(default=0.5, ge=0, le=1, allow_inf_nan=False)


__all__ = ["CacheAwareSection"]
