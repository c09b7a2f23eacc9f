"""The deployment manifest: one YAML file that says what to serve, how, and where.

    model:     {source, tokenizer, served_name, dtype, device, max_model_len, tensor_parallel_size,
                generation_config, chat_template}
    engine:    {block_size, max_num_seqs, max_num_batched_tokens, kv_cache_mb, memory_utilization,
                enable_prefix_caching, enforce_eager, async_scheduling, threads, cpu_weights, seed,
                weight_cache_*, speculative_config, tensor_parallel_size}
    (vLLM's names are accepted beside ours: model.served_model_name, engine.gpu_memory_utilization)
    mode:      colocated | disaggregated          (one key switches the same manifest between them)
    prefill / decode / colocated:  pools {replicas, devices, placement, engine}; a pool's `engine` overrides
                fields of the top-level one for that role only (`Manifest.engine_for(role)`), all but
                the KV layout's (block_size), which prefill and decode workers must share
    transport: {backend, required_backends, fallback, nixl_backends, lease_s, fetch_timeout_s, policy,
                checksum, secret_env, secret}
    router:    {policy, timeouts per stage, on_fault: migrate | fail, max_migrations, worker_wait_s,
                first_token: prefill | decode}
    server:    {host, port, api_keys, api_keys_env, max_body_bytes, max_concurrent_requests,
                max_queued_requests, stream_interval, access_log, log_stats_interval_s, metrics_auth,
                reject_unknown_fields, cors, trust_request_chat_template, header_timeout_s,
                body_timeout_s, max_header_bytes, tool_call_parser, reasoning_parser,
                enable_auto_tool_choice,
                structured, rate_limit: grammar limits, per-client rate (config/manifest_limits.py)}
    runtime:   {kind: local | ray, health_interval_s, restart backoff, drain_timeout_s}
    verify:    thresholds of `splitserve verify` and the run-time KV probe (min_gbps, max_transfer_share)
    slos, prices: read by `splitserve bench` (goodput and cost per accepted response)
    scaling:   {enabled, interval_s, percentile, cooldown_s, down_after_s, low_load, profile, ...}: the
                SLO-driven controller that adds and removes replicas of a role between its pool's
                min_replicas and max_replicas (config/manifest_scaling.py, splitserve/scale/)

Every section has defaults: an empty manifest (or none at all) serves the embedded default model,
disaggregated, on this host. `load_manifest(path)` validates the YAML and raises `ManifestError`
naming each bad field by its YAML path and line, with what to write instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from splitserve.config.kv_backends import across_sizes_refusal
from splitserve.config.manifest_errors import ManifestError, describe
from splitserve.config.manifest_scaling import ScalingSection
from splitserve.config.manifest_sections import (
    BUDGET_FIELDS,
    EngineSection,
    ModelSection,
    PoolSection,
    PricesSection,
    RouterSection,
    RuntimeSection,
    Section,
    ServerSection,
    SLOSection,
    TransportSection,
    VerifySection,
)
from splitserve.config.manifest_yaml import ManifestYAMLError, load_yaml

MAX_PROBLEMS = 20  # a manifest error lists this many problems, then counts the rest
ROLES = ("prefill", "decode", "colocated")  # the pool sections, one per worker role


class Manifest(Section):
    name: str = "splitserve"
    model: ModelSection = Field(default_factory=ModelSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    mode: Literal["colocated", "disaggregated"] = "disaggregated"
    prefill: PoolSection = Field(default_factory=PoolSection)
    decode: PoolSection = Field(default_factory=PoolSection)
    colocated: PoolSection = Field(default_factory=PoolSection)
    transport: TransportSection = Field(default_factory=TransportSection)
    router: RouterSection = Field(default_factory=RouterSection)
    server: ServerSection = Field(default_factory=ServerSection)
    runtime: RuntimeSection = Field(default_factory=RuntimeSection)
    verify: VerifySection = Field(default_factory=VerifySection)
    slos: SLOSection = Field(default_factory=SLOSection)
    prices: PricesSection = Field(default_factory=PricesSection)
    scaling: ScalingSection = Field(default_factory=ScalingSection)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v or not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("use letters, digits, '-', '_' or '.'")
        return v

    @model_validator(mode="after")
    def _pools(self) -> Manifest:
        pools = ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)
        for name in pools:
            if getattr(self, name).replicas < 1:
                raise ValueError(f"{self.mode} mode needs {name}.replicas >= 1")
        for name in ROLES:
            try:
                self.engine_for(name)
            except ValidationError as exc:
                reasons = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
                raise ValueError(f"{name}.engine over the top-level engine section: {reasons}") from None
        for name in pools if self.scaling.enabled else ():
            pool = getattr(self, name)
            lo, hi = pool.min_replicas, pool.max_replicas
            if (lo is not None and pool.replicas < lo) or (hi is not None and pool.replicas > hi):
                raise ValueError(f"{name}.replicas ({pool.replicas}) must lie within its min/max_replicas")
        if self.mode == "disaggregated":
            self._backends_across_sizes()
        if self.mode == "disaggregated" and len({_mtp(self.engine_for(r)) for r in pools}) > 1:
            raise ValueError(
                'speculative method "mtp" must be on for both roles or neither: the MTP head\'s K/V '
                "are layers of the KV cache that the transfer moves (prefill computes them for the prompt)"
            )
        return self

    def _backends_across_sizes(self) -> None:
        """Refuse a backend (or fallback) that cannot move KV between the roles' tensor-parallel sizes."""
        sizes = (self.tensor_parallel_size("prefill"), self.tensor_parallel_size("decode"))
        for backend in (self.transport.backend, *self.transport.fallback):
            refusal = across_sizes_refusal(backend, *sizes)
            if refusal:
                where = "transport.backend" if backend == self.transport.backend else "transport.fallback"
                raise ValueError(f"{where}: {refusal}")

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks per replica of `role`: its engine section's size, else the model's."""
        return self.engine_for(role).tensor_parallel_size or self.model.tensor_parallel_size

    def engine_for(self, role: str) -> EngineSection:
        """The engine section of `role`'s workers: the top-level one with the pool's `engine` fields
        over it (giving kv_cache_mb or memory_utilization replaces both: the budget is one choice)."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
        given = getattr(self, role).engine.given()
        if not given:
            return self.engine
        base = self.engine.model_dump()
        if any(f in given for f in BUDGET_FIELDS):
            base |= dict.fromkeys(BUDGET_FIELDS)
        return EngineSection.model_validate(base | given)

    def pools(self) -> dict[str, PoolSection]:
        """role -> pool, for the roles this mode runs."""
        if self.mode == "disaggregated":
            return {"prefill": self.prefill, "decode": self.decode}
        return {"colocated": self.colocated}


def load_manifest(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None) -> Manifest:
    """Read and validate a manifest (None: all defaults), then apply `overrides` ({"server.port": 0}).
    Raises ManifestError (or OSError for an unreadable file)."""
    source = "<defaults>" if path is None else str(path)
    text = "" if path is None else Path(path).read_text()
    return parse_manifest(text, source, overrides)


def parse_manifest(text: str, source: str = "<string>", overrides: dict[str, Any] | None = None) -> Manifest:
    try:
        root, data = load_yaml(text) if text.strip() else (None, {})
    except ManifestYAMLError as exc:
        raise ManifestError(source, [str(exc)]) from None
    except yaml.YAMLError as exc:
        raise ManifestError(source, [f"not valid YAML: {exc}"]) from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ManifestError(
            source, [f"the top level must be a mapping of sections, got {type(data).__name__}"]
        )
    for dotted, value in (overrides or {}).items():
        _set_path(data, dotted.split("."), value)  # an overridden field keeps its YAML line, if any
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        problems = [describe(err, root, Manifest) for err in errors[:MAX_PROBLEMS]]
        if len(errors) > MAX_PROBLEMS:
            problems.append(f"... and {len(errors) - MAX_PROBLEMS} more")
        raise ManifestError(source, problems) from None


def _mtp(engine: EngineSection) -> bool:
    return (engine.speculative_config or {}).get("method") == "mtp"


def _set_path(data: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        nxt = data.get(key)
        if not isinstance(nxt, dict):
            nxt = data[key] = {}
        data = nxt
    data[keys[-1]] = value


def dump_manifest(manifest: Manifest) -> str:
    """The manifest with every default filled in, as YAML (secrets left out)."""
    data = manifest.model_dump(mode="json")
    data["transport"].pop("secret", None)
    data["server"].pop("api_keys", None)
    return yaml.safe_dump(data, sort_keys=False)


__all__ = ["Manifest", "ManifestError", "dump_manifest", "load_manifest", "parse_manifest"]
