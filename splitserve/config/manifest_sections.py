"""The manifest's sections (config/manifest.py puts them together): each a pydantic model whose fields are
the YAML keys, with their defaults, limits and the checks that span fields.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from splitserve.config.cors import CorsSection
from splitserve.config.engine import EngineConfig
from splitserve.config.manifest_limits import RateLimitSection, StructuredSection
from splitserve.config.manifest_routing import CacheAwareSection
from splitserve.config.speculative import checked_dict

Backend = Literal["tcp", "shm", "cuda_ipc", "nccl", "nixl"]
NixlBackend = Literal["UCX", "LIBFABRIC"]  # NIXL's network backends (the plugins it instantiates)
# What a gate may demand: a backend, or nixl with the NIXL backend it must run ("nixl" alone means the
# first of nixl_backends)
Required = Backend | Literal["nixl/UCX", "nixl/LIBFABRIC"]
# seconds, megabytes, milliseconds: finite, and below a week's worth of seconds
PositiveFloat = Annotated[float, Field(gt=0, le=604_800, allow_inf_nan=False)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: Any) -> Any:
        """`replicas: true` would read as 1: a number field takes numbers only."""
        if isinstance(value, bool):
            ann = cls.model_fields[info.field_name].annotation
            kinds = typing.get_args(ann) or (ann,)
            if bool not in kinds and (int in kinds or float in kinds):
                raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


class ModelSection(Section):
    # an HF directory, a .gguf file, "default" (SmolLM2-135M-Instruct), or random:SHAPE (random weights at
    # a named shape, e.g. random:qwen3-8b, for benchmarks; its tokenizer defaults to the default model's)
    source: str = "default"
    tokenizer: str | None = None  # an HF directory or .gguf whose tokenizer to use (default: the source's)
    # the id in /v1/models (default: derived from the source); a list: the first answers, the others
    # are aliases a request may name (as vLLM's --served-model-name A B)
    served_name: str | list[str] | None = Field(
        default=None, validation_alias=AliasChoices("served_name", "served_model_name")
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"  # auto | cpu | cuda (each pool's `devices` pins replicas to cuda:N)
    max_model_len: int | None = Field(default=None, ge=16)
    # ranks per replica (vLLM's --tensor-parallel-size), each its own process and device; a role's
    # engine section may set its own (engine.tensor_parallel_size)
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    # sampling defaults for the fields a request leaves unset (vLLM's --generation-config): "auto" takes the
    # checkpoint's generation_config.json (a GGUF's general.sampling metadata), "vllm" none, or a folder's
    generation_config: str = "auto"
    chat_template: str | None = None  # vLLM's --chat-template: a file, or the template itself

    @field_validator("served_name")
    @classmethod
    def _names(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and (not v or not all(v)):
            raise ValueError("give at least one non-empty name")
        return v

    def served_names(self) -> list[str]:
        """The served name first, then its aliases."""
        if isinstance(self.served_name, list):
            return list(self.served_name)
        return [self.resolved_served_name()]

    def resolved_served_name(self) -> str:
        if isinstance(self.served_name, list):
            return self.served_name[0]
        if self.served_name:
            return self.served_name
        if self.source in ("default", "smollm2-135m-instruct"):
            return "smollm2-135m-instruct"
        name = Path(self.source.rstrip("/")).name
        return name.removesuffix(".gguf") or self.source


_ENGINE = EngineConfig()


class EngineSection(Section):
    """The engine's knobs as the manifest names them; their defaults are EngineConfig's (declared once)."""

    block_size: int = Field(default=_ENGINE.block_size, ge=1, le=256)
    max_num_seqs: int = Field(default=_ENGINE.max_num_seqs, ge=1, le=65_536)
    # tokens a step takes; null: 1024 on CPU, 2048 on GPU (EngineConfig.batched_tokens)
    max_num_batched_tokens: int | None = Field(default=_ENGINE.max_num_batched_tokens, ge=16, le=1 << 22)
    kv_cache_mb: int | None = Field(default=None, ge=1, le=1 << 24)  # KV cache budget per worker
    memory_utilization: float | None = Field(  # GPU: share of the device a worker may hold
        default=None, gt=0, le=1,
        validation_alias=AliasChoices("memory_utilization", "gpu_memory_utilization"),
    )  # fmt: skip
    enable_prefix_caching: bool = _ENGINE.enable_prefix_caching  # reuse KV blocks of identical prefixes
    enforce_eager: bool = _ENGINE.enforce_eager  # GPU: no CUDA graphs
    async_scheduling: bool | None = _ENGINE.async_scheduling  # overlapped decode steps; null: on for GPUs
    # CPU: torch intra-op threads per worker; null: this host's cores shared among its CPU workers
    threads: int | None = Field(default=None, ge=1, le=1024)
    cpu_weights: Literal["fp32", "int4"] = "fp32"  # CPU: int4 = weight-only int4 (kernels/cpu/linear.py)
    seed: int = _ENGINE.seed
    # Host-side cache of converted weights, shared by the workers of a host and kept across restarts:
    # "auto" = $SPLITSERVE_CACHE_DIR/weights or ~/.cache/splitserve/weights; a path (/dev/shm/... keeps
    # it in memory); null turns it off.
    weight_cache_dir: str | None = _ENGINE.weight_cache_dir
    weight_cache_max_gb: float | None = Field(default=_ENGINE.weight_cache_max_gb, gt=0)
    weight_cache_verify: bool = _ENGINE.weight_cache_verify  # a CRC32 of every 32 MiB chunk on load
    # speculative decoding, as vLLM's --speculative-config: {method: ngram, num_speculative_tokens: 4,
    # prompt_lookup_min, prompt_lookup_max, disable_by_batch_size} (config/speculative.py); null: off
    speculative_config: Annotated[dict[str, Any] | None, AfterValidator(checked_dict)] = None
    # ranks per replica of this role (engine/tp/); null: model.tensor_parallel_size
    tensor_parallel_size: int | None = Field(default=None, ge=1, le=64)

    @model_validator(mode="after")
    def _one_budget(self) -> EngineSection:
        if self.kv_cache_mb is not None and self.memory_utilization is not None:
            raise ValueError("give kv_cache_mb or memory_utilization, not both")
        return self


# Engine fields that fix the KV cache's layout (transport/layout.py): a prefill and a decode worker must agree
# on them or the transfer refuses the connection, so a pool's `engine` may not override them.
LAYOUT_FIELDS = ("block_size",)
BUDGET_FIELDS = ("kv_cache_mb", "memory_utilization")  # one choice: a pool that gives one drops the other


class _EngineOverrideBase(Section):
    """A pool's `engine`: some fields of EngineSection, each checked as there; only the fields given
    count (and are dumped), so an explicit null overrides too (e.g. `kv_cache_mb: null`)."""

    @field_validator(*LAYOUT_FIELDS, check_fields=False)
    @classmethod
    def _not_layout(cls, v: Any, info: Any) -> Any:
        raise ValueError(
            f"{info.field_name} cannot differ between roles: prefill and decode workers share the KV "
            f"layout; set it in the top-level engine section"
        )

    @model_validator(mode="after")
    def _one_budget(self) -> _EngineOverrideBase:
        if all(f in self.model_fields_set and getattr(self, f) is not None for f in BUDGET_FIELDS):
            raise ValueError("give kv_cache_mb or memory_utilization, not both")
        return self

    @model_serializer(mode="wrap")
    def _given_only(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}

    def given(self) -> dict[str, Any]:
        """The fields this pool overrides, with their values."""
        return {k: getattr(self, k) for k in self.model_fields_set}


def _constrained(annotation: Any, metadata: list) -> Any:
    return Annotated[(annotation, *metadata)] if metadata else annotation


# EngineSection's fields (types and bounds), none required; generated so the two cannot drift apart.
EngineOverride = create_model(
    "EngineOverride",
    __base__=_EngineOverrideBase,
    __module__=__name__,
    **{
        name: (
            _constrained(info.annotation, info.metadata),
            Field(default=None, validation_alias=info.validation_alias),
        )
        for name, info in EngineSection.model_fields.items()
    },
)


class PlacementSection(Section):
    """Ray: where a pool's replicas may run (Ray resources a node must offer) and what each takes."""

    num_cpus: float | None = Field(default=None, ge=0)
    num_gpus: float | None = Field(default=None, ge=0)  # default: 1 when the pool's devices are cuda
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources, e.g. {"prefill_node": 1}
    label_selector: dict[str, str] = Field(default_factory=dict)  # node labels (Ray >= 2.49)
    memory_gb: float | None = Field(default=None, gt=0)


class PoolSection(Section):
    replicas: int = Field(default=1, ge=0, le=64)
    # per replica, e.g. ["cuda:0", "cuda:1"]; a replica at tensor_parallel_size n takes its device and the
    # n - 1 after it (["cuda:0", "cuda:2"] for two replicas of two ranks)
    devices: list[str] = Field(default_factory=list)
    placement: PlacementSection = Field(default_factory=PlacementSection)
    # ray: autoscaling bounds (both set: Serve autoscales the pool between them)
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    # this role's overrides of the top-level engine section (fields not given inherit)
    engine: EngineOverride = Field(default_factory=EngineOverride)  # type: ignore[valid-type]

    @field_validator("engine", mode="before")
    @classmethod
    def _no_overrides(cls, v: Any) -> Any:
        return {} if v is None else v  # `engine:` with every line commented out


class TransportSection(Section):
    backend: Backend = "shm"
    # What `verify` demands be actually in use on every pair; default: [backend].
    required_backends: list[Required] | None = None
    fallback: list[Backend] = Field(default_factory=list)  # tried in order if `backend` cannot run
    # nixl: NIXL backends tried in order; the first is asked for, a later one is a declared fallback
    # (it serves, logged and counted, and fails `verify` unless required_backends names it, "nixl/UCX")
    nixl_backends: list[NixlBackend] = Field(default_factory=lambda: ["UCX"], min_length=1)
    lease_s: PositiveFloat = 30.0  # an unclaimed export is freed after this
    fetch_timeout_s: PositiveFloat = 30.0  # room on the decode worker + the transfer
    policy: Literal["fail", "recompute"] = "fail"  # a failed transfer: error, or recompute the prompt
    checksum: Literal["crc32", "blake2b"] | None = None
    # hybrid models' recurrent state: the dtype it travels in (cuda_ipc; bfloat16 halves the bytes but
    # rounds the state once, so tokens may change: off by default), and the exporter's GPU rows for it
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    state_rows: int = Field(default=8, ge=0)
    secret_env: str = "SPLITSERVE_KV_SECRET"  # unset: the local runtime makes one per deployment
    secret: str | None = Field(default=None, repr=False)  # prefer secret_env

    @model_validator(mode="after")
    def _fallback_differs(self) -> TransportSection:
        if self.backend in self.fallback:
            raise ValueError(f"fallback lists the backend itself ({self.backend}); list only alternatives")
        return self

    def required(self) -> list[str]:
        """What the gate accepts as running, "nixl" spelled out as "nixl/<first of nixl_backends>"."""
        names = list(self.required_backends) if self.required_backends else [self.backend]
        return [f"nixl/{self.nixl_backends[0]}" if n == "nixl" else n for n in names]


class TimeoutsSection(Section):
    """A deadline per stage of a request, seconds."""

    queue_s: PositiveFloat = 30.0  # waiting for a free slot in the router's bounded queue
    prefill_s: PositiveFloat = 120.0  # the prefill (colocated: first) token's answer: queue + prompt
    kv_transfer_s: PositiveFloat = 30.0  # room on the decode worker + the KV fetch
    inter_token_s: PositiveFloat = 30.0  # the longest gap between two streamed chunks
    request_s: PositiveFloat = 600.0  # the whole request
    connect_s: PositiveFloat = 5.0  # opening a connection to a worker


class RouterSection(Section):
    policy: Literal["round_robin", "least_loaded", "prefix_affinity", "cache_aware"] = "least_loaded"
    # cache_aware: each replica's prefix cache as its own events tell it, weighed against its load
    cache_aware: CacheAwareSection = Field(default_factory=CacheAwareSection)
    timeouts: TimeoutsSection = Field(default_factory=TimeoutsSection)
    # prefix_affinity: how many leading prompt tokens choose the worker, and how much busier than the
    # least-loaded worker the chosen one may be before the request goes elsewhere.
    affinity_prefix_tokens: int = Field(default=256, ge=1)
    affinity_max_imbalance: int = Field(default=8, ge=0)
    # A worker's fault (its process or engine core died, its stream was cut) under a request in flight:
    # "migrate" prefills the prompt and the tokens already streamed on another (or the restarted) worker
    # and goes on, the client seeing one stream (router/migrate.py); "fail" ends the request with a 502.
    on_fault: Literal["migrate", "fail"] = "migrate"
    max_migrations: int = Field(default=3, ge=0, le=100)  # per choice of a request
    # how long a request waits for a ready worker of a role whose workers are all (re)starting, within
    # its deadline; 0: a 503 at once
    worker_wait_s: float = Field(default=60.0, ge=0, le=3600, allow_inf_nan=False)
    # disaggregated, a streamed choice's first token: "prefill" sends it as soon as the prefill worker
    # answers (TTFT without the KV transfer, the decode worker's import and its hop), the decode stream
    # going on after it; "decode" holds it until the decode worker streams it (router/first_token.py).
    # A non-streamed answer is sent whole either way.
    first_token: Literal["decode", "prefill"] = "prefill"


class ServerSection(Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)  # 0: the OS picks (printed)
    api_keys: list[str] = Field(default_factory=list, repr=False)  # empty: no authentication
    api_keys_env: str | None = None  # comma-separated keys from this environment variable
    max_body_bytes: int = Field(default=4 << 20, ge=1024, le=1 << 30)
    max_concurrent_requests: int = Field(default=256, ge=1, le=1 << 20)  # in flight to the workers
    max_queued_requests: int = Field(default=1024, ge=0, le=1 << 20)  # waiting beyond that; more: 429
    max_n: int = Field(default=16, ge=1, le=128)
    # tokens a streamed chunk holds at least (fewer only at the end; the first chunk is the first token
    # alone, for TTFT), vLLM's --stream-interval: fewer, larger frames on every hop
    # (docs/bench/served-path.md: on 2 cores a frame costs more than a token)
    stream_interval: int = Field(default=1, ge=1, le=4096)
    access_log: bool = True  # one INFO line per request (id, route, status, tokens, latency)
    log_stats_interval_s: float = Field(default=10.0, ge=0)  # the periodic throughput line; 0: off
    metrics_auth: bool = False  # true: with api keys set, /metrics wants one too (vLLM leaves it open)
    reject_unknown_fields: bool = False  # true: a request field the server does not know is a 400
    cors: CorsSection | None = None  # vLLM's --allowed-origins & co.; none: no CORS headers
    trust_request_chat_template: bool = False  # vLLM's flag: a request's own chat_template may be used
    # the model's output parsers, by vLLM's flags and names; None: read off the chat template
    tool_call_parser: Literal["hermes", "llama3_json", "qwen3_coder", "qwen3_xml"] | None = None
    reasoning_parser: Literal["qwen3", "deepseek_r1", "none"] | None = None  # "none": thinking stays content
    enable_auto_tool_choice: bool = True  # false: tool_choice "auto" is refused, as vLLM without the flag
    # slow or huge requests (slowloris): headers must arrive within this of their first byte ...
    header_timeout_s: float = Field(default=10.0, ge=0.1, le=600, allow_inf_nan=False)
    body_timeout_s: float = Field(default=60.0, ge=0.1, le=3600, allow_inf_nan=False)  # ... a body, of them
    max_header_bytes: int = Field(default=64 << 10, ge=1024, le=16 << 20)  # more: 431
    structured: StructuredSection = Field(default_factory=StructuredSection)  # grammar limits
    rate_limit: RateLimitSection | None = None  # a token bucket per client (router/gate.py); null: none

    @field_validator("api_keys")
    @classmethod
    def _no_empty_key(cls, keys: list[str]) -> list[str]:
        if any(not k.strip() for k in keys):
            raise ValueError("an API key must not be empty (it would let an empty bearer token in)")
        return [k.strip() for k in keys]

    def keys(self) -> list[str]:
        """api_keys, then api_keys_env's; with neither given, the key in SPLITSERVE_API_KEY (or vLLM's
        VLLM_API_KEY), as `vllm serve` reads its key when --api-key is not given."""
        keys = list(self.api_keys)
        if self.api_keys_env:
            keys += [k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip()]
        elif not keys:
            key = os.environ.get("SPLITSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")
            keys += [key.strip()] if key and key.strip() else []
        return keys


class RuntimeSection(Section):
    kind: Literal["local", "ray"] = "local"
    health_interval_s: float = Field(default=1.0, ge=0.05, le=3600, allow_inf_nan=False)
    health_failures: int = Field(default=3, ge=1, le=1000)  # missed health checks before a restart
    startup_timeout_s: PositiveFloat = 600.0  # a worker must be ready (weights loaded) by then
    restart_backoff_s: PositiveFloat = 1.0  # doubled per consecutive failure ...
    restart_backoff_max_s: PositiveFloat = 30.0  # ... up to this
    max_restarts: int = Field(
        default=100, ge=0, le=1_000_000
    )  # per worker; then it stays down (and /health says so)
    drain_timeout_s: PositiveFloat = 30.0  # SIGTERM: in-flight requests get this long to finish
    worker_args: list[str] = Field(default_factory=list)  # extra worker flags (tests, debugging)
    standby: bool = True  # local: keep a spare process with its imports done, for fast restarts
    lend_cores: bool = True  # local: CPU workers lend idle cores to each other (core/share.py)
    # local: each CPU worker pinned to its own share of the host's cores, no lending (core/pinning.py)
    pin_cores: bool = False
    # local, lending: while another worker of the host is busy, a decode worker starts at most one step
    # per this many ms and lends its cores in between (core/share.py); null: slos.itl_ms; 0: off
    decode_pace_ms: float | None = Field(default=None, ge=0, le=60_000)
    warm_up: bool = True  # local: short requests through the workers before the ready line (router/warmup.py)
    # local: a private CUDA MPS daemon when workers share a GPU (auto | on | off; runtime/mps.py)
    cuda_mps: Literal["auto", "on", "off"] = "auto"
    address: str | None = None  # ray: the cluster to join ("auto", "ray://...", host:port); None: auto
    namespace: str = "splitserve"  # ray: namespace of the deployment's registry actor
    router_placement: PlacementSection = Field(default_factory=PlacementSection)  # ray: the router replica


class SLOSection(Section):
    ttft_ms: PositiveFloat = 2000.0
    itl_ms: PositiveFloat = 200.0
    e2e_ms: PositiveFloat | None = None


class VerifySection(Section):
    """Thresholds of the deployment gate (`splitserve verify`) and of the run-time KV probe."""

    min_gbps: PositiveFloat = 0.2  # the KV probe's bandwidth floor on every prefill/decode pair
    max_transfer_share: float = Field(default=0.5, gt=0, le=1)  # KV transfer / TTFT of the round trip
    probe_mb: PositiveFloat = 32.0  # payload of the gate's bandwidth probe
    probe_interval_s: float = Field(default=30.0, ge=0)  # run time: one small probe per pair; 0 = off
    runtime_probe_mb: PositiveFloat = 4.0
    max_transfer_failures: int = Field(default=0, ge=0)  # KV transfer failures the gate tolerates
    prompt: str = "What is the capital of France?"  # the round trip's known prompt (greedy)
    max_tokens: int = Field(default=16, ge=1)
    # a GPU worker whose host offers no GPUDirect RDMA to its EFA / InfiniBand devices fails the gate
    # (KV would be staged through host memory); off: the fabric is reported, the bandwidth floor holds
    require_gpudirect: bool = False


class PricesSection(Section):
    """USD per device-hour, by device kind; `splitserve bench` turns it into cost per response."""

    usd_per_hour: dict[str, float] = Field(default_factory=lambda: {"cpu": 0.05, "cuda": 4.0})
