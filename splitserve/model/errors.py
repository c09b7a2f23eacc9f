"""Errors raised while locating, opening or reading model checkpoints."""

from __future__ import annotations

import os


class ModelLoadError(Exception):
    """A checkpoint could not be opened or read.

    ``ModelLoadError("message")`` works like any exception.  The checkpoint loaders also pass ``path=``
    (the offending file or directory, prefixed to the message) and ``hint=`` (how to fix it, appended in
    parentheses), so that every message names the file, what is wrong and what to do.  The low-level
    exception (ValueError, SafetensorError, ...) is chained as ``__cause__``.
    """

    def __init__(
        self, message: str, *, path: str | os.PathLike[str] | None = None, hint: str | None = None
    ) -> None:
        self.message = message
        self.path = None if path is None else os.fspath(path)
        self.hint = hint
        text = f"{self.path}: {message}" if self.path is not None else message
        if hint:
            text = f"{text} ({hint})"
        super().__init__(text)

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the keyword-only fields across pickling (errors may cross process boundaries).
        return (_rebuild, (type(self), self.message, self.path, self.hint))


def _rebuild(cls: type[ModelLoadError], message: str, path: str | None, hint: str | None) -> ModelLoadError:
    return cls(message, path=path, hint=hint)
