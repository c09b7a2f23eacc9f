"""What the engine's builder does differently under tensor parallelism (`tensor_parallel_size` > 1).

    group = join(config, device)            # rank 0: start the other ranks; rank r: its worker's group
    loaded = load_shard(config, device, dtype, group)
    ...                                      # the builder sizes the cache from the shard's config
    num_blocks, slots = group.agree_min(num_blocks, slots)

Every rank loads the full weights on the host and keeps its shard (model/parallel.py); the KV cache and
state pools hold this rank's heads. Random weights (`random:SHAPE`) are made on the rank's device, by
that device's generator, as an engine at size 1 makes them there, so both sizes run the same model.

CUDA graphs: on CUDA every rank captures the decode graphs (and a hybrid model's one-chunk prefill
graphs) at start-up, the model's NCCL all-reduces and all-gathers inside them. The ranks agree first
that all of them capture (`agree_min`), then capture the same batch sizes in the same order from the
same agreed sizes (max_num_seqs, the KV blocks); each capture's warm-up pass runs the collectives
eagerly, so the ranks meet before every capture. At run time every rank replays the graph of the step
rank 0 broadcast (runner.py), so the captured collectives pair up. Under `tensor_parallel_one_device`
(the model's collectives over gloo: a test mode) graphs stay off, with a logged reason.

Off under tensor parallelism: overlapped steps (rank 0 broadcasts each step's tokens from the host),
speculative decoding, and the CPU's whole-layer decode op (its products have no all-reduce between
them); the CPU's per-projection and fused ops stay on, per rank.
"""

from __future__ import annotations

import logging

import torch

from splitserve.config.engine import EngineConfig
from splitserve.engine.tp.group import TPGroup
from splitserve.engine.tp.ranks import RankProcesses
from splitserve.model.checkpoint import is_random_source, open_checkpoint
from splitserve.model.config import ModelConfig
from splitserve.model.loader import LoadedModel, load_model, resolve_model_path
from splitserve.model.parallel import check_divisible, shard_model
from splitserve.model.random_weights import hf_state_dict, random_model, random_source_config
from splitserve.model.registry import resolve_architecture

log = logging.getLogger(__name__)

# Set in a rank other than 0 (worker.py): the group its engine joins instead of starting one.
_WORKER_GROUP: TPGroup | None = None


def join(config: EngineConfig) -> tuple[TPGroup, RankProcesses | None]:
    """This process's group: a worker rank's, or (rank 0) a new one with its ranks started."""
    if config.speculative_config is not None:
        raise ValueError("speculative decoding is not supported with tensor_parallel_size > 1")
    if _WORKER_GROUP is not None:
        return _WORKER_GROUP, None
    check_divisible(full_model_config(config), config.tensor_parallel_size)  # before any rank starts
    ranks = RankProcesses.start(config, config.torch_device())
    return ranks.group, ranks


def full_model_config(config: EngineConfig) -> ModelConfig:
    """The unsharded model's config (what every size splits)."""
    if is_random_source(config.model):
        return ModelConfig.from_hf(random_source_config(str(config.model)))
    hf = open_checkpoint(resolve_model_path(config.model)).hf_config
    return ModelConfig.from_hf({**hf, "architectures": [resolve_architecture(hf)]})


def load_shard(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, group: TPGroup
) -> tuple[LoadedModel, str]:
    """This rank's shard of the configured weights, and the model's path."""
    host = torch.device("cpu")
    if is_random_source(config.model):  # the weights size 1 makes on this device (its generator's)
        path = str(config.model)
        full = random_model(random_source_config(path), device, dtype, config.resolve_max_model_len)
    else:
        path = resolve_model_path(config.model)
        cache = config.weight_cache()  # the host's converted weights, mapped by every rank
        full = load_model(path, host, dtype, config.resolve_max_model_len, progress=config.progress,
                          weight_cache=cache)  # fmt: skip
    positions = config.resolve_max_model_len(full.config)
    model = shard_model(full.model, hf_state_dict(full.model), group, device, positions)
    stats = {**full.load_stats, "tensor_parallel": {"rank": group.rank, "size": group.size}}
    return LoadedModel(model, model.cfg, full.checkpoint, full.load_seconds, stats), path


def graphs_allowed(group: TPGroup, graphs: bool) -> bool:
    """Whether this rank may capture CUDA graphs: where it would, and its collectives are capturable."""
    if graphs and not group.capturable:
        log.info("CUDA graphs are off: under tensor_parallel_one_device the model's collectives run "
                 "over gloo, which a CUDA graph cannot capture")  # fmt: skip
        return False
    return graphs


def wire_journal(
    runner: object, states: object, checkpoints: object | None, ranks: RankProcesses | None
) -> None:
    """One journal for rank 0's state pool, checkpoints and runner; the runner's ranks to step."""
    journal: list = []
    for holder in (runner, states, checkpoints):
        if holder is not None:
            holder.journal = journal  # type: ignore[attr-defined]
    if ranks is not None:
        runner.start(ranks, journal)  # type: ignore[attr-defined]


__all__ = ["full_model_config", "graphs_allowed", "join", "load_shard", "wire_journal"]
