"""splitserve: prefill/decode disaggregated LLM serving on an engine of its own."""

from splitserve.engine.config import EngineConfig
from splitserve.engine.params import SamplingParams
from splitserve.engine.request import CompletionOutput, RequestOutput

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202 - lazy imports keep `import splitserve` light
    if name == "LLM":
        from splitserve.engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from splitserve.engine.async_engine import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
