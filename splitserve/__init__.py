"""splitserve: prefill/decode disaggregated LLM serving on an engine of its own."""

__all__ = ["LLM", "AsyncLLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

# The engine's names load on first use: every process imports this package first, and the router's
# must not pay for torch and the engine (tests/test_import_graph.py keeps the router off them).
_LAZY = {
    "LLM": "splitserve.engine.llm",
    "AsyncLLM": "splitserve.engine.async_engine",
    "EngineConfig": "splitserve.config.engine",
    "SamplingParams": "splitserve.sampling.params",
    "RequestOutput": "splitserve.engine.request",
    "CompletionOutput": "splitserve.engine.request",
}


def __getattr__(name: str):  # noqa: ANN202 - lazy imports keep `import splitserve` light
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module), name)
