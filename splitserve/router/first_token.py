"""`router.first_token: prefill`: a streamed disaggregated choice's first token reaches the client as soon
as the prefill worker answers, not after the decode worker has fetched the KV and streamed it.

The prefill worker's answer carries the first token, its text (after the worker's `TextStream`, stop
strings and partial UTF-8 held back) and its logprob: `early_piece` makes them the choice's first piece.
The decode worker's stream starts again from that token, its first line carrying it alone; `SentFirst`
takes the token, its logprob and its text out of the decode's pieces, so the client sees each once.
The decode worker's `TextStream` runs the same algorithm on the same tokens, so its text begins with
the prefill's; text it held back longer comes off its next pieces. The decode's first piece, emptied,
still carries the KV transfer's figures (the router counts them, run.py) and is not written out.
"""

from __future__ import annotations

import asyncio
import logging
import os

from splitserve.router.openai_protocol import APIError
from splitserve.router.worker_answers import Piece
from splitserve.wire.http import PrefillResponse

log = logging.getLogger(__name__)


def early_piece(index: int, pre: PrefillResponse, metrics: dict, paced: bool = False) -> Piece:
    """The prefill's first token as the choice's first piece; `metrics`: the prefill's figures. The KV
    backend is the export's (the handshake refuses a pair that does not share one); the transfer's
    figures come later, with the decode worker's first piece. `paced` (the pieces go through a queue to
    the task that writes them, run.py): it carries a `taken` event, which that task sets once the
    client's stream has it; the decode request waits for that (dispatch.py), so that making it is not on
    the first token's way out. Unpaced, the consumer asking for the next piece says as much."""
    assert pre.kv_export is not None
    lps = None if pre.logprob is None else [pre.logprob]
    metrics = {**metrics, "kv_backend": pre.kv_export.handle.backend}
    taken = asyncio.Event() if paced else None
    return Piece(index, [pre.first_token], pre.text, lps, None, False, metrics, taken)


class SentFirst:
    """The decode stream of a choice whose first token was sent already: each piece without it."""

    def __init__(self, pre: PrefillResponse, request_id: str) -> None:
        self.token: int | None = pre.first_token  # None once taken off the decode's first piece
        self.text = pre.text  # what of the prefill's text the decode's pieces have not repeated yet
        self.request_id = request_id

    def __call__(self, p: Piece) -> Piece:
        if self.token is not None:
            if p.token_ids[:1] != [self.token]:
                raise APIError(502, f"the decode worker's stream began with {p.token_ids[:1]}, not the "
                               f"first token {self.token}", type="server_error")  # fmt: skip
            p.token_ids = p.token_ids[1:]
            p.logprobs = p.logprobs[1:] if p.logprobs else p.logprobs
            self.token = None
        if self.text:
            p.text = self._without_sent_text(p.text)
        return p

    def _without_sent_text(self, text: str) -> str:
        """`text` less what of it the client has had from the prefill's answer."""
        n = len(os.path.commonprefix([text, self.text]))
        if n == len(text) or n == len(self.text):  # agreeing so far: what is left, on the next pieces
            self.text = self.text[n:]
            return text[n:]
        # NOTE: both workers' TextStreams cut the same tokens the same way, so this is a fault (another
        # tokenizer on one side): the text goes on after as many characters as the client has had
        log.warning("request %s: the decode worker's text %r disagrees with the prefill's %r after %d "
                    "characters", self.request_id, text, self.text, n)  # fmt: skip
        skip, self.text = len(self.text), ""
        return text[skip:]


__all__ = ["SentFirst", "early_piece"]
