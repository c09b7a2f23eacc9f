"""A worker's configuration: one frozen record, the same for the front end and its engine core (which
gets it as JSON), built from the command line (worker/main.py) or from the manifest (runtime/common.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.config.engine import EngineConfig

if TYPE_CHECKING:
    from splitserve.transport.transport import TransportOptions

ROLES = ("prefill", "decode", "colocated")
DECODE_STAGING_ROWS = 4  # cuda_ipc: state rows a decode worker may stage at once (fetches in flight)


@dataclass(frozen=True)
class WorkerConfig:
    """A worker: its role, its engine (an `EngineConfig`, where every engine knob is declared once) and
    what the worker adds around the engine (the KV transport, the HTTP API, threads, streaming)."""

    role: str = "colocated"
    engine: EngineConfig = EngineConfig(progress=False)
    served_name: str | None = None  # the API's model name (the label of the worker's own /metrics)
    kv_backend: str = "tcp"
    kv_fallback: tuple[str, ...] = ()  # backends allowed if kv_backend cannot run (logged, counted)
    kv_nixl_backends: tuple[str, ...] = ("UCX",)  # nixl: NIXL backends, first that instantiates wins
    kv_secret: str | None = dataclasses.field(default=None, repr=False)
    kv_host: str = "127.0.0.1"  # the HTTP and tcp KV address
    kv_lease_s: float = 30.0
    kv_fetch_timeout_s: float = 30.0
    kv_policy: str = "fail"
    kv_checksum: str | None = None
    kv_state_dtype: str = "float32"  # cuda_ipc: hybrid state on the wire (transport/state_arena.py)
    kv_state_rows: int = 8
    fault_injection: bool = False
    kv_throttle_gbps: float | None = None  # test hook: hold every fetch to this bandwidth
    kv_fetch_fraction: float | None = None  # test hook: fetches write only this share of their blocks
    http_auth: bool = False  # every endpoint but GET /health wants `Bearer worker_token(kv_secret)`
    threads: int = 1  # the engine core's torch intra-op threads (its own cores)
    core_share: str | None = None  # the local runtime's file of lent cores (core/share.py)
    core_slot: int = 0  # this worker's slot in it
    core_total: int = 0  # the host's cores the sharing workers split (at most this many threads)
    decode_pace_s: float = 0.0  # lending decode worker: at most one step per this while another is busy
    cpus: tuple[int, ...] = ()  # the CPUs its front end and engine core are pinned to; (): not pinned
    stream_interval: int = 1  # tokens a stream line holds at least (fewer only when it ends)
    role_epoch: int = 0  # how many times the runtime changed this worker's role (wire/role.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown role {self.role!r}; choose one of {ROLES}")
        if self.threads < 1 or self.stream_interval < 1:
            raise ValueError("threads and stream_interval must be at least 1")
        if self.http_auth and not self.kv_secret:
            raise ValueError("http_auth needs the deployment's secret (kv_secret) to derive its token")
        object.__setattr__(self, "kv_fallback", tuple(self.kv_fallback))
        object.__setattr__(self, "kv_nixl_backends", tuple(self.kv_nixl_backends))
        object.__setattr__(self, "cpus", tuple(self.cpus))

    def engine_config(self) -> EngineConfig:
        """The engine as the core builds it: no progress bars; a prefill worker's cache in a memfd
        when shm may carry its KV (shm fetchers copy straight out of it, transport/shm_direct.py)."""
        backends = (self.kv_backend, *self.kv_fallback)
        shared = self.role == "prefill" and "shm" in backends
        rows = self.engine.transfer_state_rows
        if not rows and "cuda_ipc" in backends:  # its state arena / a fetch's staging row on the GPU
            rows = {"prefill": self.kv_state_rows, "decode": DECODE_STAGING_ROWS}.get(self.role, 0)
        return dataclasses.replace(
            self.engine, progress=False, kv_shared_memory=shared, transfer_state_rows=rows
        )

    def transport_options(self) -> TransportOptions:
        from splitserve.transport.transport import TransportOptions  # the engine core's: it loads torch

        return TransportOptions(
            host=self.kv_host,
            lease_s=self.kv_lease_s,
            fetch_timeout_s=self.kv_fetch_timeout_s,
            checksum=self.kv_checksum,
            state_wire_dtype=self.kv_state_dtype,
            state_arena_rows=self.kv_state_rows,
            nixl_backends=tuple(self.kv_nixl_backends),
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
        if not isinstance(data, dict) or not isinstance(data.get("engine", {}), dict):
            raise ValueError("a worker spec is a JSON object (its engine one too)")
        if kv_secret is not None:
            data["kv_secret"] = kv_secret
        _known(cls, data, "worker config")
        engine = data.pop("engine", {})
        _known(EngineConfig, engine, "engine config")
        return cls(**data, engine=EngineConfig(**engine))


def _known(cls: type, data: dict, what: str) -> None:
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"unknown {what} fields {sorted(unknown)}")
