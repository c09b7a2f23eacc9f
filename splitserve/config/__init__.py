"""The deployment manifest (YAML, pydantic): see manifest.py.

The manifest's names load on first use: the engine core and the worker front end import only
`config.engine` and `config.worker` (dataclasses), and importing this package must not make them pay
for pydantic and the manifest's schema (~0.2 s of each process's start)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.config.manifest import (
        Manifest,
        ManifestError,
        dump_manifest,
        load_manifest,
        parse_manifest,
    )

__all__ = ["Manifest", "ManifestError", "dump_manifest", "load_manifest", "parse_manifest"]


def __getattr__(name: str):  # noqa: ANN202 - lazy: see the module docstring
    if name not in __all__:
        raise AttributeError(name)
    from splitserve.config import manifest

    return getattr(manifest, name)
