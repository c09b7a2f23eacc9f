"""The engine core's start: its engine, sized and checked, and, on a prefill or decode worker, its KV
connector with the transport listening (loop.py's `EngineCore` runs them)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.kv_connector import KVConnector

log = logging.getLogger(__name__)


def open_engine(config: Any) -> tuple[LLMEngine, KVConnector | None, str | None]:
    """-> (the engine, its KV connector or None when colocated, the address fetchers reach this worker's
    exports at or None when it does not export). Raises ValueError for a KV cache too small for one
    request of max_model_len, and the transport's errors for a backend this host cannot run."""
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.kv_connector import KVConnector
    from splitserve.transport.backends import preflight

    if config.role != "colocated" and not config.kv_fallback:  # fail before the model loads
        preflight(config.kv_backend, config.transport_options())
    engine = LLMEngine(config.engine_config())
    num_blocks = engine.stats().blocks.total
    capacity = num_blocks * engine.block_size
    if capacity < engine.max_model_len:
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
            f"{engine.block_size}), fewer than max_model_len ({engine.max_model_len}): a long request "
            "could never run. Give the worker more KV cache (--kv-cache-mb / engine.kv_cache_mb) or "
            "lower max_model_len"
        )
    if config.role == "colocated":
        return engine, None, None
    connector = KVConnector.open(
        engine, config.kv_backend, secret=config.kv_secret,
        options=config.transport_options(), policy=config.kv_policy, fallback=config.kv_fallback,
    )  # fmt: skip
    assert connector.transport is not None  # open() made it
    kv_address = connector.transport.listen() if config.role == "prefill" else None
    if config.kv_throttle_gbps or config.kv_fetch_fraction is not None:  # test hooks
        from splitserve.transport.partial import with_test_hooks

        connector.transport = with_test_hooks(
            connector.transport, config.kv_throttle_gbps, config.kv_fetch_fraction
        )
    return engine, connector, kv_address


def warm_imports() -> None:
    """What an engine core imports before its spec: a spare core waits with them done, and the fork
    server (zygote.py) does them once for the cores it forks."""
    import torch  # noqa: F401

    from splitserve.engine import engine as _engine  # noqa: F401 - the import is the point
    from splitserve.engine.tp import ranks as tp_ranks
    from splitserve.kernels.cpu import linear as cpu_linear
    from splitserve.model import loader as _loader  # noqa: F401

    tp_ranks.EXIT_ON_RANK_DEATH = True  # a dead tensor-parallel rank takes this replica down whole
    cpu_linear.DEFER_ONEDNN = True  # oneDNN's layouts once ready (`_finish_deferred`)


__all__ = ["open_engine", "warm_imports"]
