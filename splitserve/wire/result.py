"""`Result`: the base of every answer to an engine-core operation (wire/ops.py). Tagged by class
name, so that one `Reply` carries any of them and the front end decodes the right type."""

from __future__ import annotations

import msgspec


class Result(msgspec.Struct, tag=True):
    pass


__all__ = ["Result"]
