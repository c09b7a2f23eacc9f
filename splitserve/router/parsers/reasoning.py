"""Reasoning parsers: the model's thinking (`<think> ... </think>`) apart from its answer.

Two shapes, by vLLM's names:
  - `qwen3`: the thinking block is the model's own output (Qwen3 writes `<think>`), or its chat template
    opened it in the prompt (Qwen3.5's template ends the prompt with `<think>\\n`); with thinking off the
    template prefills an empty block (`<think>\\n\\n</think>\\n\\n`), so the answer is all content.
  - `deepseek_r1`: the prompt always opens the block, so the output starts inside the thinking.
Which of the two an answer starts in is read off the prompt (`starts_in_reasoning`): inside when the
rendered prompt ends with an open `<think>`. Either way an answer that begins with `<think>` opens one.

What the parser gives: the reasoning (the text inside the block, white space at its two ends taken off;
None when empty) and the content after `</think>` (its leading white space taken off). An answer cut
while still thinking (max_tokens) is all reasoning, and has no content.

Tool calls are looked for in the content only. A call the model writes inside its thinking stays part
of the reasoning, and is not executed: the thinking is where the model drafts and weighs what to do
(Qwen's template tells it to call functions after it reasons), so a call drafted there may be one it
rejects a line later, and running it would act on something the model did not decide. Nothing is lost:
the text is in `reasoning_content` for the client to see, and a call the model does decide on, it
writes again after `</think>`.
"""

from __future__ import annotations

from splitserve.router.parsers.base import partial_suffix

THINK, END_THINK = "<think>", "</think>"
QWEN3, DEEPSEEK_R1 = "qwen3", "deepseek_r1"
REASONING, CONTENT = "reasoning", "content"
Piece = tuple[str, str]  # (REASONING | CONTENT, text)


def starts_in_reasoning(kind: str, prompt_tail: str) -> bool:
    """Whether an answer to a prompt ending in `prompt_tail` starts inside the thinking block."""
    tail = prompt_tail.rstrip()
    if kind == DEEPSEEK_R1:
        return not tail.endswith(END_THINK)
    return tail.endswith(THINK)


class ReasoningParser:
    """One answer: `parse(text)` -> (reasoning or None, content text); streamed, `feed(delta)` and
    `finish()` -> pieces [(REASONING | CONTENT, text)] whose joins equal what `parse` gives."""

    def __init__(self, inside: bool) -> None:
        self._inside = inside  # at the start: the prompt opened the block
        self._state = "start"  # start | reasoning | after (`</think>` seen) | content
        self._buf = ""
        self._ws = ""  # reasoning's white space held back until more reasoning follows
        self._sent = False  # some reasoning has been sent

    def parse(self, text: str) -> tuple[str | None, str]:
        pieces = self.feed(text) + self.finish()
        reasoning = "".join(t for k, t in pieces if k == REASONING)
        return (reasoning or None), "".join(t for k, t in pieces if k == CONTENT)

    def feed(self, delta: str) -> list[Piece]:
        self._buf += delta
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._state == "start":
            self._state = "reasoning" if self._inside else "content"
            self._buf = self._buf if self._inside else self._buf.lstrip()
        if self._state == "after":  # nothing but white space came after `</think>`
            self._buf = ""
        if self._state == "reasoning":
            self._reasoning(self._buf, out)
        elif self._buf:
            out.append((CONTENT, self._buf))
        self._buf = ""
        return out

    def _step(self, out: list[Piece]) -> bool:
        if self._state == "start":
            head = self._buf.lstrip()
            if len(head) < len(THINK) and THINK.startswith(head):
                return False  # may yet open a block
            if head.startswith(THINK):
                self._buf, self._state = head[len(THINK) :], "reasoning"
            else:
                self._state = "reasoning" if self._inside else "content"
                self._buf = self._buf if self._inside else head
            return True
        if self._state == "reasoning":
            end = self._buf.find(END_THINK)
            if end == -1:
                keep = partial_suffix(self._buf, END_THINK)
                self._reasoning(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            self._reasoning(self._buf[:end], out)
            self._buf, self._state, self._ws = self._buf[end + len(END_THINK) :], "after", ""
            return True
        if self._state == "after":  # the white space between `</think>` and the answer is neither
            head = self._buf.lstrip()
            if not head:
                return False
            self._buf, self._state = head, "content"
            return True
        if self._buf:
            out.append((CONTENT, self._buf))
            self._buf = ""
        return False

    def _reasoning(self, text: str, out: list[Piece]) -> None:
        body = text.rstrip()
        if not body:
            self._ws += text
            return
        out.append((REASONING, (self._ws + body) if self._sent else body.lstrip()))
        self._sent, self._ws = True, text[len(body) :]


__all__ = ["CONTENT", "DEEPSEEK_R1", "QWEN3", "REASONING", "ReasoningParser", "starts_in_reasoning"]
