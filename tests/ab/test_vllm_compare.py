"""bench/vllm_compare's shared workload: prompts of exact token counts, the two clients' copies differing
only in their first token, written once for vLLM's `custom` dataset and read back by our trace replay."""

from __future__ import annotations

import json

from splitserve.ab.vllm_compare import VLLM_EXTRA_FIELDS, paired_prompts, write_workload
from splitserve.ab.workload import load_trace


class _WordTokenizer:
    """A toy tokenizer: token i is the word " w<i>"; ids 0 and 1 are special (a BOS is added)."""

    all_special_ids = [0, 1]

    def __len__(self) -> int:
        return 500

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [int(w[1:]) for w in text.split()]
        return ([0] if add_special_tokens else []) + ids

    def decode(self, ids: list[int]) -> str:
        return "".join(f" w{i}" for i in ids)


def test_paired_prompts_have_exact_lengths_and_differ_only_in_the_first_token():
    tok = _WordTokenizer()
    theirs, ours = paired_prompts(tok, 5, 12, seed=3)
    assert len(theirs) == len(ours) == 5
    for a, b in zip(theirs, ours, strict=True):
        ia, ib = tok.encode(a), tok.encode(b)
        assert len(ia) == len(ib) == 12  # with the BOS, as the server and vLLM count
        assert ia[1] != ib[1] and ia[2:] == ib[2:]
        assert not set(ia[1:]) & {0, 1}
    assert len(set(theirs)) == 5
    assert paired_prompts(tok, 5, 12, seed=3) == (theirs, ours)  # the seed decides


def test_workload_file_serves_both_clients(tmp_path):
    path = tmp_path / "w.jsonl"
    write_workload(path, ["hello there", "general kenobi"], 7, 32, [0.0, 1.5])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["output_tokens"] == 32 and isinstance(r["prompt"], str) for r in rows)  # vLLM's `custom`
    trace = load_trace(path)
    assert [r.prompt for r in trace] == ["hello there", "general kenobi"]
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in trace] == [(7, 32, 0.0), (7, 32, 1.5)]
    assert VLLM_EXTRA_FIELDS == {"repetition_penalty": 1.0, "logprobs": None}
