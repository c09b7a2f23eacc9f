"""The offline API, spelled as vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm.auto import tqdm

from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.request import RequestOutput
from splitserve.sampling.params import SamplingParams

Prompt = str | Sequence[int] | dict[str, Any]
Messages = list[dict[str, Any]]


class LLM:
    """Runs a model in this process. `model`: an HF directory, a GGUF file, or None for the default."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine options {sorted(unknown)}; known: {sorted(known)}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        ids: list[str] = []
        try:
            for p, sp in zip(batch, params, strict=True):
                ids.append(self.engine.add_request(_prompt_of(p), sp))
        except Exception:  # an invalid prompt: drop the ones already added rather than leave them queued
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot render chat messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            self.engine.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
        return [done[rid] for rid in ids]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return prompts


def _prompt_of(p: Prompt) -> str | Sequence[int]:
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return p["prompt_token_ids"]
        if "prompt" in p:
            return p["prompt"]
        raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
    return p


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
