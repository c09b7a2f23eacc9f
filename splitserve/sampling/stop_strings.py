"""Stop strings in generated text: where the earliest one starts, and the text cut there (or after it).
The engine (engine/stop.py) and the worker front end (worker/text_stream.py) cut with the same code."""

from __future__ import annotations


def find_stop_string(text: str, stop: tuple[str, ...], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that overlaps its last `new_chars` characters (only such a
    match can be new), as (where it starts, which); None if there is none. The engine (engine/stop.py) and
    the worker front end (worker/text_stream.py) both cut with this."""
    start = max(0, len(text) - new_chars - max(len(s) for s in stop) + 1)
    best: tuple[int, str] | None = None
    for s in stop:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def cut_text(text: str, found: tuple[int, str], include: bool) -> str:
    i, s = found
    return text[: i + len(s)] if include else text[:i]


__all__ = ["cut_text", "find_stop_string"]
