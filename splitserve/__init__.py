"""splitserve: prefill/decode disaggregated LLM serving on an engine of its own."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.engine.async_engine import AsyncLLM
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm import LLM
    from splitserve.engine.params import SamplingParams
    from splitserve.engine.request import CompletionOutput, RequestOutput

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# the public names' modules, imported on first use: `import splitserve` (the router, the workers' front
# ends) stays free of torch, which only the engine needs
_LAZY = {
    "LLM": "splitserve.engine.llm",
    "AsyncLLM": "splitserve.engine.async_engine",
    "EngineConfig": "splitserve.engine.config",
    "SamplingParams": "splitserve.engine.params",
    "RequestOutput": "splitserve.engine.request",
    "CompletionOutput": "splitserve.engine.request",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
