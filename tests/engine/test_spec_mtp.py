"""Speculative decoding with Qwen3.5's MTP head (model/qwen3_5_mtp.py, engine/spec/mtp.py) on a tiny
hybrid checkpoint whose `mtp.*` tensors are random, fp32 CPU: the head loads from the checkpoint (and a
checkpoint without one is refused by name); greedy output with its drafts verified equals output
without speculation, token for token; with drafts rejected at every position, or at some, the
recurrent state, the conv window and every KV layer (the head's own included) at each computed
position equal a run without drafts; the head's K/V written step by step equal one pass over the whole
sequence; every block and state slot comes back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_helpers import OracleDrafter, trace
from tiny_configs import TINY_QWEN3_5

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.llm import LLM
from splitserve.model.errors import ModelLoadError
from splitserve.model.loader import load_model
from splitserve.model.qwen3_5_mtp import Qwen3_5MTP
from splitserve.model.random_weights import init_random_

CONFIG = {**TINY_QWEN3_5, "mtp_num_hidden_layers": 1}
VOCAB = CONFIG["vocab_size"]
PROMPT_LENS = (3, 17, 41, 70)
MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": None}
NO_DRAFTS = {**MTP, "disable_by_batch_size": 1}  # nobody drafts (the head's grace: `_no_drafts`)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """-> (directory with the MTP head's tensors, directory without, the head's tensors)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(1)
    bare = tmp_path_factory.mktemp("qwen3_5_bare")
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG)).eval().save_pretrained(bare)
    loaded = load_model(bare, torch.device("cpu"), torch.float32, lambda cfg: 256, progress=False)
    head = Qwen3_5MTP(loaded.config)
    init_random_(head, seed=3, std=0.1)
    mtp = {k: v.clone().contiguous() for k, v in head.hf_state_dict().items()}
    full = tmp_path_factory.mktemp("qwen3_5_mtp")
    for f in bare.iterdir():
        (full / f.name).write_bytes(f.read_bytes())
    save_file({**load_file(full / "model.safetensors"), **mtp}, full / "model.safetensors", {"format": "pt"})
    return full, bare, mtp


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _engine(path, **knobs) -> LLMEngine:
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
                          kv_cache_bytes=4 * 2**20, progress=False, **knobs)  # fmt: skip
    return LLMEngine(config, tokenizer=None)


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    outs = LLM.from_engine(engine).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False
    )
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.states.num_free == engine.states.num_slots > 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(checkpoint, prompts) -> list[list[int]]:
    return _generate(_engine(checkpoint[0]), prompts)


def test_the_head_loads_from_the_checkpoint_and_its_kv_joins_the_cache(checkpoint):
    path, bare, tensors = checkpoint
    engine = _engine(path, speculative_config=MTP)
    head = engine.spec.mtp.head
    for name, t in head.hf_state_dict().items():
        torch.testing.assert_close(t, tensors[name], rtol=0, atol=0)
    cfg = engine.model_config
    assert engine.kv_cache.shape[1] == cfg.num_kv_layers + 1
    assert head.layers[0].self_attn.kv_index == cfg.num_kv_layers
    with pytest.raises(ModelLoadError, match="no MTP head"):
        _engine(bare, speculative_config=MTP)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain(checkpoint, prompts, plain, k):
    engine = _engine(checkpoint[0], speculative_config={**MTP, "num_speculative_tokens": k})
    assert _generate(engine, prompts) == plain
    stats = engine.stats().spec_decode
    assert stats.method == "mtp" and stats.num_drafts > 0
    assert len(stats.accepted_per_pos) == k


def _no_drafts(path) -> LLMEngine:
    """An engine whose requests never draft while its MTP head catches up on every step (its back-off,
    spec/verify.py, given a grace longer than any run)."""
    engine = _engine(path, speculative_config=NO_DRAFTS)
    engine.spec.head_grace = 10**9
    return engine


def _oracle(engine: LLMEngine, prompts, refs, wrong_every: int) -> None:
    """The head still runs every step, but the drafts verified are the oracle's (known continuations,
    some or all made wrong), so that runs end in a rejection at chosen positions."""
    oracle = OracleDrafter(prompts, refs, VOCAB, wrong_every)
    mtp, k = engine.spec.mtp, engine.spec.k

    def take(req):
        mtp.drafts.pop(id(req), None)
        return oracle.propose(np.asarray(req.prompt_token_ids + req.output_token_ids), k)

    mtp.take = take


@pytest.mark.parametrize("wrong_every", [1, 3, 7])  # 7: some runs accept all their drafts
def test_mtp_rejections_leave_state_and_every_kv_layer_as_without_drafts(checkpoint, prompts, plain,
                                                                          wrong_every):  # fmt: skip
    prompt, ref = prompts[2], plain[2]
    ref_tokens, ref_snaps = trace(_no_drafts(checkpoint[0]), prompt, GREEDY)
    engine = _engine(checkpoint[0], speculative_config=MTP)
    _oracle(engine, [prompt], [ref], wrong_every)
    tokens, snaps = trace(engine, prompt, GREEDY)
    assert tokens == ref_tokens == ref
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 3
    assert (stats.num_accepted_tokens == 0) == (wrong_every == 1)
    by_computed = {s.computed: s for s in ref_snaps}
    compared = 0
    for s in snaps:
        if s.computed not in by_computed:
            continue  # after a restore the request stands at an earlier position than any plain step
        want = by_computed[s.computed]
        for name, t in s.states.items():
            torch.testing.assert_close(t, want.states[name], rtol=1e-5, atol=1e-5)
        assert s.kv.shape[0] == engine.model_config.num_kv_layers + 1  # the head's layer is the last
        torch.testing.assert_close(s.kv, want.kv, rtol=1e-4, atol=1e-4)
        compared += 1
    assert compared >= len(snaps) // 2


def _reference_head(head, target, hidden: torch.Tensor, next_ids: list[int]):
    """The head over one whole sequence from its definition, with dense causal attention and no cache:
    -> (its K and V [T, KVH, D] at each position, its output states [T, H])."""
    layer = head.layers[0]
    attn = layer.self_attn
    t, h, kvh, d = len(next_ids), attn.h, attn.kvh, attn.d
    e = head.pre_fc_norm_embedding(target.embed_tokens(torch.tensor(next_ids)))
    x = head.fc(torch.cat([e, head.pre_fc_norm_hidden(hidden)], dim=-1))
    qg, k, v = attn.qkv_proj(layer.input_layernorm(x)).split([2 * h * d, kvh * d, kvh * d], dim=-1)
    q, gate = qg.view(t, h, 2 * d).chunk(2, dim=-1)
    q, k = target.partial_rope(torch.arange(t), attn.q_norm(q), attn.k_norm(k.view(t, kvh, d)))
    v = v.view(t, kvh, d)
    kk, vv = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * d**-0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), vv).reshape(t, h * d)
    x = x + attn.o_proj(out * torch.sigmoid(gate.reshape(t, h * d)))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return k, v, head.norm(x)


def _target_hidden(path, seq: list[int]) -> torch.Tensor:
    """The target's final hidden states [T, H] over `seq`, from one prefill."""
    engine = _engine(path)
    kept = []
    engine.loaded.model.register_forward_hook(lambda m, a, out: kept.append(out.clone()))
    LLM.from_engine(engine).generate([{"prompt_token_ids": seq}], SamplingParams(temperature=0, max_tokens=1),
                                     use_tqdm=False)  # fmt: skip
    return kept[0]


@torch.inference_mode()
def test_the_heads_kv_and_drafts_follow_its_definition(checkpoint, prompts):
    """The head's K/V, written step by step as the request decodes (catching up on each step's
    positions), and its drafts (the first from the target's state, the next ones chained on its own)
    equal the head computed from its definition over the whole sequence."""
    prompt, k = prompts[1], MTP["num_speculative_tokens"]
    engine = _engine(checkpoint[0], speculative_config=MTP)
    mtp, made = engine.spec.mtp, {}
    draft = mtp.draft

    def keep_drafts(*args):  # record each step's drafts, and verify none (each step a plain decode)
        draft(*args)
        made.update({n: list(d) for n, d in mtp.drafts.values()})
        mtp.drafts = {}

    mtp.draft = keep_drafts
    tokens, snaps = trace(engine, prompt, GREEDY)
    last = snaps[-1]
    seq = (prompt + tokens)[: last.num_tokens]
    n = len(seq) - 1  # positions whose next token the step-by-step run knew
    assert last.computed == n
    hidden = _target_hidden(checkpoint[0], seq)  # [len(seq), H]
    key, value, out = _reference_head(mtp.head, mtp.target, hidden[:n], seq[1:])
    torch.testing.assert_close(last.kv[-1, 0, :n], key, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last.kv[-1, 1, :n], value, rtol=1e-4, atol=1e-4)
    firsts = mtp.target.compute_logits(out)[:, :VOCAB].argmax(dim=-1).tolist()
    assert len(made) == MAX_NEW - 2  # after each token but the last two (max_tokens leaves no room)
    for num_tokens, drafts in made.items():  # the first draft after each step: from position q
        assert drafts[0] == firsts[num_tokens - 2]
    # the chained drafts of one step: the head at q + j on its own state at q + j - 1 and its draft j
    q = len(prompt) + 5
    chain_hidden, chain_ids = hidden[: q + 1], seq[1 : q + 2]
    for _ in range(k):
        _, _, out = _reference_head(mtp.head, mtp.target, chain_hidden, chain_ids)
        chain_hidden = torch.cat([chain_hidden, out[-1:]])
        chain_ids = [*chain_ids, int(mtp.target.compute_logits(out[-1:])[0, :VOCAB].argmax())]
    assert made[q + 2] == chain_ids[q + 1 :]


def _accept_all_drafts(
    engine: LLMEngine, prompts
) -> tuple[list[list[int]], dict[tuple[int, int], list[int]]]:
    """`prompts` generated together with every draft accepted (the target's own token after the last):
    -> (the outputs, the drafts made after each step by (prompt index, the request's num_tokens))."""
    mtp, made = engine.spec.mtp, {}
    draft = mtp.draft

    def keep_drafts(runner, blocks, budget, reqs):
        draft(runner, blocks, budget, reqs)
        for req in reqs:
            if id(req) in mtp.drafts:
                num_tokens, drafts = mtp.drafts[id(req)]
                made[prompts.index(req.prompt_token_ids), num_tokens] = list(drafts)

    mtp.draft = keep_drafts
    return _generate(engine, prompts), made


@torch.inference_mode()
def test_mtp_drafts_with_every_draft_accepted_follow_the_heads_definition(checkpoint, prompts, monkeypatch):
    """With every draft accepted, the head's catch-up after a verify step runs over positions past the
    requests' appended tokens, for several requests in one pass: each one's rows must stay its own.
    The drafts of a batch equal each request's alone and do not vary between runs, and each step's
    first draft equals the head computed from its definition over the whole sequence."""
    from splitserve.engine.spec import verify

    monkeypatch.setattr(
        verify, "accept_greedy", lambda logits, drafts: [*drafts, int(logits[len(drafts)].argmax())]
    )
    outs, made = _accept_all_drafts(_engine(checkpoint[0], speculative_config=MTP), prompts)
    assert sum(len(d) for d in made.values()) > 3 * len(prompts)
    assert _accept_all_drafts(_engine(checkpoint[0], speculative_config=MTP), prompts) == (outs, made)
    for i, prompt in enumerate(prompts):
        alone_outs, alone = _accept_all_drafts(_engine(checkpoint[0], speculative_config=MTP), [prompt])
        assert alone_outs == [outs[i]]
        assert {(i, n): d for (_, n), d in alone.items()} == {
            key: d for key, d in made.items() if key[0] == i
        }
        seq = prompt + outs[i]
        mtp = _engine(checkpoint[0], speculative_config=MTP).spec.mtp
        _, _, out = _reference_head(mtp.head, mtp.target, _target_hidden(checkpoint[0], seq)[:-1], seq[1:])
        firsts = mtp.target.compute_logits(out)[:, :VOCAB].argmax(dim=-1).tolist()
        for (_, num_tokens), drafts in alone.items():
            assert drafts[0] == firsts[num_tokens - 2]
