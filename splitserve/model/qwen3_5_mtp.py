"""Qwen3.5's multi-token-prediction (MTP) head: a one-layer draft model that rides on the target.

At position i the head reads the target's final hidden state h_i (after its last norm: the state that
predicted token i+1) and the embedding of token i+1; it normalizes both (zero-centred RMSNorms),
concatenates them as [embedding | hidden] (2 * hidden_size), projects back with `fc`, runs one
full-attention decoder layer (gated attention and SwiGLU MLP, as the target's own full-attention
layers) and a final norm; the target's LM head then gives its guess for token i+2. Drafting k tokens
repeats the head on its own output hidden state and its own previous guess (engine/spec/mtp.py).

The head's layer keeps K/V like any attention layer: in the engine's KV cache, as extra layers after the
target's (`kv_index = cfg.num_kv_layers + n`), in the request's own blocks, so they are freed, trimmed
and transferred with the request's KV. Its output state at a request's last prompt position, which the
first drafts start from, is one more per-request state (`state_shapes`: `STATE`, [H] in the model's
dtype) in the engine's state slots, so a KV export carries it with the recurrent state.

Checkpoint names (`Qwen3_5ForConditionalGeneration` and `Qwen3_5ForCausalLM` alike): `mtp.fc.weight`,
`mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight` and
`mtp.layers.N.*` (named as a target layer's). The head has no embedding or LM head of its own.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.model.config import ModelConfig
from splitserve.model.decoder import ForwardContext
from splitserve.model.errors import ModelLoadError
from splitserve.model.layers import Linear, ZeroCentredRMSNorm
from splitserve.model.loader import LoadedModel
from splitserve.model.qwen3_5 import HybridLayer, Qwen3_5LM
from splitserve.model.qwen3_5_weights import expected_keys, hf_named, map_layer_name, merged_rows
from splitserve.model.random_weights import init_random_
from splitserve.model.weights import load_mapped_weights

PREFIX = "mtp."
STATE = "mtp_hidden"  # the state slot's entry: the head's output state at the last prompt position


class Qwen3_5MTP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.num_mtp_layers < 1 or not cfg.kv_layer_ids:
            raise ModelLoadError(f"{cfg.architecture}: the checkpoint's config has no MTP layers "
                                 "(mtp_num_hidden_layers)")  # fmt: skip
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.cfg = cfg
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
        self.fc = Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(
            _attention_layer(cfg, cfg.num_kv_layers + n) for n in range(cfg.num_mtp_layers)
        )
        self.norm = ZeroCentredRMSNorm(h, eps)

    def forward(
        self,
        target: Qwen3_5LM,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        step: int = 0,
    ) -> torch.Tensor:
        """`next_ids` [T]: the token after each position; `hidden` [T, H]: the target's (or, drafting
        further, the head's own) final hidden state at each position. -> the head's hidden states [T, H]
        (the target's `compute_logits` turns them into guesses for the token after `next_ids`). `step`:
        the drafting step, which picks the layer when the head has several (`step % layers`)."""
        e = self.pre_fc_norm_embedding(target.embed_tokens(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))  # [T, 2H] -> [T, H]
        layer = self.layers[step % len(self.layers)]
        return self.norm(layer(positions, x, target.partial_rope, ctx))

    @property
    def num_kv_layers(self) -> int:
        return len(self.layers)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The per-request state the head adds to the target's (the engine's state slots)."""
        return {STATE: ((self.cfg.hidden_size,), self.fc.weight.dtype)}

    def load_weights(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy the checkpoint's `mtp.*` tensors in; every parameter must be set."""
        merged = merged_rows(self.cfg)

        def map_name(name: str) -> tuple[str | None, tuple[int, int] | None]:
            return map_layer_name(name[len(PREFIX) :], merged) if name.startswith(PREFIX) else (None, None)

        expected = expected_keys(self, merged)
        load_mapped_weights(self, tensors, map_name, expected, f"{self.cfg.architecture} MTP head")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Our parameters under the checkpoint's `mtp.*` names (views)."""
        return hf_named(self, merged_rows(self.cfg), prefix=PREFIX)


def _attention_layer(cfg: ModelConfig, kv_index: int) -> HybridLayer:
    """A full-attention decoder layer of the target's kind, addressing KV layer `kv_index`."""
    layer = HybridLayer(cfg, cfg.kv_layer_ids[0])  # built as the target's first full-attention layer
    layer.self_attn.kv_index = kv_index
    return layer


def load_mtp(loaded: LoadedModel, device: torch.device, dtype: torch.dtype) -> Qwen3_5MTP:
    """The MTP head of `loaded`'s checkpoint (its `mtp.*` tensors) on `device` in `dtype`; for a model
    built without a checkpoint (random weights), random weights of the same scale."""
    with torch.device("meta"):
        head = Qwen3_5MTP(loaded.config).to(dtype)
    head = head.to_empty(device=device)
    ckpt = loaded.checkpoint
    if ckpt is None:
        init_random_(
            head,
            seed=int(loaded.load_stats.get("seed", 0)) + 1,
            std=float(loaded.load_stats.get("std", 0.02)),
        )
        return head.eval()
    names = [n for n in ckpt.tensor_names() if n.startswith(PREFIX)] if ckpt.format == "hf" else []
    if not names:
        raise ModelLoadError(
            "the checkpoint has no MTP head (no mtp.* tensors)", path=ckpt.path,
            hint='use a checkpoint with its mtp.* weights, or speculative_config {"method": "ngram"}',
        )  # fmt: skip
    with torch.no_grad():
        head.load_weights(list(ckpt.iter_tensors(names)))
    return head.eval()
