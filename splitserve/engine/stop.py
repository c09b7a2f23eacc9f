"""Stop conditions, checked after each appended token, in vLLM's order of precedence.

A stop string cuts the text exactly where it starts (or after it, with include_stop_str_in_output);
tokens are kept as generated, since a string may end inside a token.
"""

from __future__ import annotations

import logging

from splitserve.engine.request import Request
from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.stop_strings import cut_text, find_stop_string

log = logging.getLogger(__name__)


def take_token(req: Request, token: int, lp: TokenLogprob | None, max_model_len: int) -> str | None:
    """Append one sampled token to `req` (its logprob, its grammar's matcher, its text), then check the
    stop conditions. -> the finish reason if `req` must stop after `token`, else None."""
    req.output_token_ids.append(token)
    if lp is not None:
        req.logprobs.append(lp)
    if req.grammar is not None and not req.grammar.accept(token):
        log.warning("%s: token %d is outside its grammar", req.request_id, token)  # a bug if seen
    new_chars = 0
    if req.detokenizer is not None:
        new_chars = len(req.detokenizer.step(token))
        req.text = req.detokenizer.text
    reason = check_stop(req, token, max_model_len, new_chars)
    if reason is None and req.grammar is not None and req.grammar.terminated:
        reason = req.finish_reason = "stop"  # the grammar took a stop token (ignore_eos kept it)
    return reason


def check_stop(req: Request, token: int, max_model_len: int, new_chars: int = 0) -> str | None:
    """Set and return the finish reason ("stop" or "length") if `req` must stop after `token`."""
    p = req.params
    n_out = len(req.output_token_ids)
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return _finish(req, "stop", None)
        if token in p.stop_token_ids:
            return _finish(req, "stop", token)
        if p.stop and _cut_stop_string(req, new_chars):
            return "stop"
    if n_out >= req.max_tokens or req.num_tokens >= max_model_len:
        return _finish(req, "length", None)
    return None


def _finish(req: Request, reason: str, stop_reason: int | str | None) -> str:
    req.finish_reason = reason
    req.stop_reason = stop_reason
    return reason


def _cut_stop_string(req: Request, new_chars: int) -> bool:
    best = find_stop_string(req.text, req.params.stop, new_chars)
    if best is None:
        return False
    req.text = cut_text(req.text, best, req.params.include_stop_str_in_output)
    _finish(req, "stop", best[1])
    return True
