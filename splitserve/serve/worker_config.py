"""A worker's configuration: one frozen record, the same for the front end and its engine core (which
gets it as JSON), built from the command line (worker.py) or from the manifest (runtime/common.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from splitserve.engine.config import EngineConfig
from splitserve.kv import TransportOptions

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "colocated"
    model: str | None = None
    served_name: str | None = None  # the API's model name (the label of the worker's own /metrics)
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    kv_cache_mb: int | None = None  # None: the engine's default budget
    gpu_memory_utilization: float | None = None  # CUDA: fraction for weights + KV (None: the engine's)
    seed: int = 0
    weight_cache_dir: str | None = "auto"
    weight_cache_max_gb: float | None = 64.0
    weight_cache_verify: bool = True
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None  # overlapped decode steps; None: on for CUDA
    kv_backend: str = "tcp"
    kv_fallback: tuple[str, ...] = ()  # backends allowed if kv_backend cannot run (logged, counted)
    kv_secret: str | None = dataclasses.field(default=None, repr=False)
    kv_host: str = "127.0.0.1"
    kv_lease_s: float = 30.0
    kv_fetch_timeout_s: float = 30.0
    kv_policy: str = "fail"
    kv_checksum: str | None = None
    fault_injection: bool = False
    kv_throttle_gbps: float | None = None  # test hook: hold every fetch to this bandwidth
    http_auth: bool = False  # every endpoint but GET /health wants `Bearer worker_token(kv_secret)`
    threads: int = 1  # the engine core's torch intra-op threads
    stream_interval: int = 1  # tokens a stream line holds at least (fewer only when it ends)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose one of {ROLES}")
        if self.threads < 1 or self.stream_interval < 1:
            raise ValueError("threads and stream_interval must be at least 1")
        if self.http_auth and not self.kv_secret:
            raise ValueError("http_auth needs the deployment's secret (kv_secret) to derive its token")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            device=self.device,
            dtype=self.dtype,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            kv_cache_bytes=None if self.kv_cache_mb is None else self.kv_cache_mb << 20,
            **(
                {}
                if self.gpu_memory_utilization is None
                else {"gpu_memory_utilization": self.gpu_memory_utilization}
            ),
            seed=self.seed,
            progress=False,
            weight_cache_dir=self.weight_cache_dir,
            weight_cache_max_gb=self.weight_cache_max_gb,
            weight_cache_verify=self.weight_cache_verify,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            async_scheduling=self.async_scheduling,
            # the exporter's cache in a memfd: shm fetchers copy straight out of it (kv/shm_direct.py)
            kv_shared_memory=self.role == "prefill" and "shm" in (self.kv_backend, *self.kv_fallback),
        )

    def transport_options(self) -> TransportOptions:
        return TransportOptions(
            host=self.kv_host,
            lease_s=self.kv_lease_s,
            fetch_timeout_s=self.kv_fetch_timeout_s,
            checksum=self.kv_checksum,
        )

    def to_json(self, include_secret: bool = True) -> str:
        """With the secret: for the engine core's stdin, never for a log. Without it: the worker spec a
        runtime puts on a command line (the secret travels in an environment variable)."""
        data = dataclasses.asdict(self)
        if not include_secret:
            data["kv_secret"] = None
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str, kv_secret: str | None = None) -> WorkerConfig:
        """`kv_secret`: set when the JSON was written without it."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("a worker spec is a JSON object")
        if kv_secret is not None:
            data["kv_secret"] = kv_secret
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown worker config fields {sorted(unknown)}")
        data["kv_fallback"] = tuple(data.get("kv_fallback") or ())
        return cls(**data)
