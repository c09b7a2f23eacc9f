"""One request's text in the worker's front end: the engine core's token deltas -> stream lines.

Detokenization happens here, once, incrementally; so do stop strings, which need text. The core
decides EOS, stop token ids and length (`Delta.finish_reason`); this class applies the engine's order
of precedence (engine/stop.py): EOS and stop token ids, then stop strings (only from `min_tokens` on),
then length. A stop string found before the core finished the request makes `stopped_early` true: the
caller aborts the request in the core, and tokens that arrive after it are dropped. Text that could
still become a stop string is held back, so streamed text never has to be taken back.
"""

from __future__ import annotations

from typing import Any

from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams
from splitserve.sampling.stop_strings import cut_text, find_stop_string
from splitserve.wire.core import Delta
from splitserve.wire.http import StreamLine, Timings


class TextStream:
    def __init__(self, request_id: str, params: SamplingParams, tokenizer: Any) -> None:
        self.request_id = request_id
        self.params = params
        self.decoder = (
            tokenizer.decode_stream(params.skip_special_tokens) if tokenizer is not None and params.detokenize
            else None
        )  # fmt: skip
        self.stop = params.stop
        self.longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0  # characters already sent
        self.tokens = 0  # tokens already sent
        self.seen = 0  # tokens taken (the completion's length so far)
        self.finished = False
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stopped_early = False  # a stop string ended it before the core did

    def resume(self, token_ids: list[int]) -> None:
        """A migrated request: take the completion's first tokens, streamed by a worker that failed,
        without sending them. The text and what was sent of it are then what that worker had, so stop
        strings spanning the two and characters split across their tokens come out as in one stream."""
        for tok in token_ids:
            self.seen += 1
            if self.decoder is not None:
                self.text += self.decoder.step(tok)
        self.emitted = len(self.text) if not self.stop else max(0, len(self.text) - self.longest + 1)

    def feed(self, deltas: list[Delta], timings: Timings | None = None) -> StreamLine | None:
        """The line for `deltas` (None if nothing can be sent yet); `timings` rides on the first line."""
        first = self.tokens == 0
        new_ids: list[int] = []
        lps: list[TokenLogprob] | None = [] if self.params.logprobs is not None else None
        for d in deltas:
            last = len(d.token_ids) - 1
            for i, tok in enumerate(d.token_ids):
                if self.finished:
                    break
                new_ids.append(tok)
                if lps is not None and d.logprobs is not None and i < len(d.logprobs):
                    lps.append(d.logprobs[i])
                self._take(tok, d if i == last else None)
            if not d.token_ids and d.finished and not self.finished and d.finish_reason is not None:
                self._finish(d.finish_reason, d.stop_reason)  # e.g. aborted with nothing new
        visible = (
            len(self.text) if self.finished or not self.stop else max(0, len(self.text) - self.longest + 1)
        )
        text = self.text[self.emitted : visible] if visible > self.emitted else ""
        if not new_ids and not text and not self.finished:
            return None
        line = StreamLine(
            request_id=self.request_id, offset=self.tokens, token_ids=new_ids, text=text,
            finished=self.finished, finish_reason=self.finish_reason, logprobs=lps,
            timings=(timings or Timings()) if first else None,
        )  # fmt: skip
        self.tokens += len(new_ids)
        self.emitted = max(self.emitted, visible)
        return line

    def _take(self, tok: int, final: Delta | None) -> None:
        """One token; `final`: the delta it ends, when it is that delta's last token."""
        self.seen += 1
        n_out = self.seen
        new_chars = 0
        if self.decoder is not None:
            piece = self.decoder.step(tok)
            self.text += piece
            new_chars = len(piece)
        reason = final.finish_reason if final is not None else None
        if reason == "stop":  # EOS or a stop token id: the engine checked those before stop strings
            self._finish("stop", final.stop_reason)  # type: ignore[union-attr]
            return
        if self.stop and n_out >= self.params.min_tokens and self._cut(new_chars):
            self.stopped_early = reason is None
            return
        if reason is not None:
            self._finish(reason, final.stop_reason)  # type: ignore[union-attr]

    def _cut(self, new_chars: int) -> bool:
        best = find_stop_string(self.text, self.stop, new_chars)
        if best is None:
            return False
        self.text = cut_text(self.text, best, self.params.include_stop_str_in_output)
        self._finish("stop", best[1])
        return True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.finished = True
        self.finish_reason, self.stop_reason = reason, stop_reason
