"""A worker's own GET /metrics, in vLLM's names, for what scrapes model servers one by one.

The Kubernetes Gateway API Inference Extension (its endpoint picker) scrapes every model-server pod for
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (older releases: `vllm:gpu_cache_usage_perc`)
and routes on them, so each worker serves them itself, with vLLM's meaning: requests queued in the
engine, and the fraction (0..1) of KV blocks in use. Beside them: running requests, preemptions and
prefix-cache queries/hits (running totals since the worker started, as vLLM's counters), the
cache configuration, and with speculative decoding on, vLLM's spec_decode counters (drafts, draft
tokens, accepted tokens, accepted tokens by draft position). The router's /metrics
(router/metrics.py) stays the deployment's view, `splitserve:` named; this endpoint carries no secret
and, like /health, needs no worker token.
"""

from __future__ import annotations

_GAUGES = (
    ("vllm:num_requests_running", "Requests in the engine's running batch"),
    ("vllm:num_requests_waiting", "Requests waiting in the engine's queue"),
    ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)"),
    ("vllm:gpu_cache_usage_perc", "Fraction of KV blocks in use (1 = full); the older name"),
)
_COUNTERS = (
    ("vllm:num_preemptions", "Preemptions since the worker started"),
    ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    ("vllm:prefix_cache_hits", "Prompt tokens the prefix cache served"),
)
_SPEC_COUNTERS = (  # speculative decoding, labelled by drafter (method), when it is on
    ("vllm:spec_decode_num_drafts", "num_drafts", "Verify runs: a request's drafts checked in a step"),
    ("vllm:spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed and verified"),
    ("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted"),
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_worker_metrics(stats: dict, model_name: str, block_size: int) -> bytes:
    """Prometheus text exposition of one worker's `/stats`."""
    blocks = stats.get("blocks") or {}
    usage = 1 - blocks["free"] / blocks["total"] if blocks.get("total") else 0.0
    prefix = stats.get("prefix_cache") or {}
    values = {
        "vllm:num_requests_running": stats.get("running", 0),
        "vllm:num_requests_waiting": stats.get("waiting", 0),
        "vllm:kv_cache_usage_perc": usage,
        "vllm:gpu_cache_usage_perc": usage,
        "vllm:num_preemptions": stats.get("preemptions", 0),
        "vllm:prefix_cache_queries": prefix.get("queries", 0),
        "vllm:prefix_cache_hits": prefix.get("hits", 0),
    }
    role = _escape(str(stats.get("role", "")))
    labels = f'model_name="{_escape(model_name)}",role="{role}"'
    lines = []
    for name, help_text in _GAUGES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{labels}}} {values[name]}"]
    for name, help_text in _COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter",
                  f"{name}_total{{{labels}}} {values[name]}"]  # fmt: skip
    lines += _spec_lines(stats.get("spec_decode"), labels)
    info = f'{labels},block_size="{block_size}",num_gpu_blocks="{blocks.get("total", 0)}"'
    lines += ["# HELP vllm:cache_config_info The KV cache's configuration",
              "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{info}}} 1"]  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


def _spec_lines(spec: dict | None, labels: str) -> list[str]:
    """vLLM's spec_decode counters (and accepted drafts by position, `position` labelled)."""
    if not spec:
        return []
    labels = f'{labels},method="{_escape(str(spec.get("method", "")))}"'
    lines = []
    for name, key, help_text in _SPEC_COUNTERS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter",
                  f"{name}_total{{{labels}}} {spec.get(key, 0)}"]  # fmt: skip
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    lines += [f"# HELP {name} Draft tokens accepted, by their position in the draft (0: the first)",
              f"# TYPE {name} counter"]  # fmt: skip
    for pos, n in enumerate(spec.get("accepted_per_pos") or ()):
        lines.append(f'{name}_total{{{labels},position="{pos}"}} {n}')
    return lines


__all__ = ["render_worker_metrics"]
