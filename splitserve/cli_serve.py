"""`splitserve serve [MODEL_OR_MANIFEST]`, with the flags `vllm serve` users already type.

    splitserve serve                                   # the default model, disaggregated, on :8000
    splitserve serve examples/colocated.yaml           # a manifest (a .yaml / .yml file)
    splitserve serve HuggingFaceTB/SmolLM2-135M-Instruct --max-num-seqs 64 --no-enable-prefix-caching
    splitserve serve /models/qwen3-8b --gpu-memory-utilization 0.85 --served-model-name qwen qwen3

A positional argument that ends in .yaml or .yml is a manifest; anything else is a model (as
`vllm serve MODEL`): a local HF directory or .gguf file, `default`, `random:SHAPE`, or a Hugging Face
repo id (fetched into the Hub cache first, once, in this process). Every flag overrides one manifest
field and is named as vLLM names it; the manifest accepts vLLM's names too
(`engine.gpu_memory_utilization`, `model.served_model_name`). The API key comes from --api-key, the
manifest, or else the environment variable SPLITSERVE_API_KEY (or vLLM's VLLM_API_KEY).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import splitserve
from splitserve.config.manifest_sections import ModelSection
from splitserve.vllm_flags import add_vllm_flags, vllm_overrides

# flag(s), manifest field, type (None: a switch), help
_FLAGS: list[tuple[tuple[str, ...], str, Any, str]] = [
    (("--host",), "server.host", str, "address to bind"),
    (("--port",), "server.port", int, "port to bind (0: the OS picks)"),
    (("--mode",), "mode", str, "colocated | disaggregated"),
    (("--model",), "model.source", str, "the model (as the positional argument)"),
    (("--tokenizer",), "model.tokenizer", str, "an HF directory or .gguf whose tokenizer to use"),
    (("--dtype",), "model.dtype", str, "auto | float32 | bfloat16 | float16"),
    (("--device",), "model.device", str, "auto | cpu | cuda"),
    (("--max-model-len",), "model.max_model_len", int, "context length (prompt + completion)"),
    (
        ("--generation-config",),
        "model.generation_config",
        str,
        "auto (the checkpoint's sampling defaults) | vllm (none) | a folder with generation_config.json",
    ),
    (("--gpu-memory-utilization",), "engine.memory_utilization", float, "GPU: a worker's device share"),
    (("--kv-cache-mb",), "engine.kv_cache_mb", int, "KV cache budget per worker, MiB"),
    (("--max-num-seqs",), "engine.max_num_seqs", int, "sequences per engine step"),
    (("--max-num-batched-tokens",), "engine.max_num_batched_tokens", int, "tokens per engine step"),
    (("--block-size",), "engine.block_size", int, "tokens per KV block"),
    (("--seed",), "engine.seed", int, "the engine's random seed"),
    (("--kv-backend",), "transport.backend", str, "tcp | shm | cuda_ipc | nccl | nixl"),
    (("--prefill-replicas",), "prefill.replicas", int, "prefill workers"),
    (("--decode-replicas",), "decode.replicas", int, "decode workers"),
    (("--colocated-replicas",), "colocated.replicas", int, "colocated workers"),
    (
        ("--router-policy",),
        "router.policy",
        str,
        "round_robin | least_loaded | prefix_affinity | cache_aware",
    ),  # fmt: skip
    (("--max-concurrent-requests",), "server.max_concurrent_requests", int, "in flight to the workers"),
    (("--stream-interval",), "server.stream_interval", int, "tokens a streamed chunk holds at least"),
    (("--log-stats-interval",), "server.log_stats_interval_s", float, "seconds between stats lines; 0: off"),
    (
        ("--tool-call-parser",),
        "server.tool_call_parser",
        str,
        "hermes | llama3_json | qwen3_coder | qwen3_xml (default: from the chat template)",
    ),
    (
        ("--reasoning-parser",),
        "server.reasoning_parser",
        str,
        "qwen3 | deepseek_r1 | none (default: from the chat template)",
    ),
    (
        ("--speculative-config",),
        "engine.speculative_config",
        json.loads,
        'speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 4}',
    ),
]
# switches: flag, manifest field, value it sets
_SWITCHES: list[tuple[tuple[str, ...], str, Any, str]] = [
    (("--enforce-eager",), "engine.enforce_eager", True, "GPU: no CUDA graphs"),
    (("--disable-log-stats",), "server.log_stats_interval_s", 0, "no periodic stats line"),
    (("--no-access-log", "--disable-uvicorn-access-log"), "server.access_log", False, "no per-request line"),
    (("--metrics-auth",), "server.metrics_auth", True, "with API keys set, /metrics wants a key too"),
    (("--reject-unknown-fields",), "server.reject_unknown_fields", True, "an unknown request field is a 400"),
]
MANIFEST_SUFFIXES = (".yaml", ".yml")
# the embedded default model's Hub id: served from the package, not fetched
DEFAULT_HUB_IDS = ("huggingfacetb/smollm2-135m-instruct",)


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve a model or a manifest (default: the default model)")
    serve.add_argument(
        "target", nargs="?", default=None, metavar="MODEL_OR_MANIFEST",
        help="a .yaml/.yml manifest, or a model (HF directory, .gguf, Hub id, default, random:SHAPE)",
    )  # fmt: skip
    serve.add_argument("--version", action="version", version=f"splitserve {splitserve.__version__}")
    for flags, field, kind, hint in _FLAGS:
        serve.add_argument(*flags, dest=field, type=kind, default=None, help=f"{hint} ({field})")
    for flags, field, value, hint in _SWITCHES:
        serve.add_argument(*flags, dest=field, action="store_const", const=value, default=None,
                           help=f"{hint} ({field})")  # fmt: skip
    serve.add_argument("--enable-prefix-caching", dest="engine.enable_prefix_caching", default=None,
                       action=argparse.BooleanOptionalAction,
                       help="reuse KV of shared prompt prefixes (engine.enable_prefix_caching)")  # fmt: skip
    serve.add_argument("--enable-auto-tool-choice", dest="server.enable_auto_tool_choice", default=None,
                       action=argparse.BooleanOptionalAction,
                       help="the model may choose to call tools (tool_choice auto); on unless "
                       "--no-enable-auto-tool-choice (server.enable_auto_tool_choice)")  # fmt: skip
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the model's id in the API; more names are aliases")  # fmt: skip
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                       help="ranks (processes, devices) per replica; above 1 serves colocated "
                       "(model.tensor_parallel_size)")  # fmt: skip
    serve.add_argument("--api-key", action="append", default=None,
                       help="repeatable; default: $SPLITSERVE_API_KEY or $VLLM_API_KEY")  # fmt: skip
    serve.add_argument("--log-format", choices=["text", "json"], default=None, help="text or JSON lines")
    serve.add_argument("--log-level", default=None, help="debug | info | warning (default info)")
    serve.add_argument("--print-manifest", action="store_true", help="print the resolved manifest and exit")
    serve.add_argument("--no-progress", action="store_true", help="no progress bar while workers load")
    add_vllm_flags(serve)


def serve_overrides(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """-> (the manifest path or None, the manifest fields the command line sets)."""
    o: dict[str, Any] = {}
    for _, field, _, _ in _FLAGS + _SWITCHES:
        if getattr(args, field) is not None:
            o[field] = getattr(args, field)
    o |= vllm_overrides(args)
    for field in ("engine.enable_prefix_caching", "server.enable_auto_tool_choice"):
        if getattr(args, field) is not None:
            o[field] = getattr(args, field)
    tp = args.tensor_parallel_size
    if tp is not None:
        o["model.tensor_parallel_size"] = tp
        if tp > 1 and "mode" not in o:  # as vLLM's -tp: one engine over n ranks, unless --mode says
            o["mode"] = "colocated"
    manifest, target = None, args.target
    if target is not None and target.lower().endswith(MANIFEST_SUFFIXES):
        if not Path(target).is_file():
            raise ValueError(f"{target}: no such manifest file (a .yaml / .yml argument is a manifest)")
        manifest = target
    elif target is not None:
        if "model.source" in o and o["model.source"] != target:
            raise ValueError(f"two models given: {target} and --model {o['model.source']}")
        o["model.source"] = target
    if "model.source" in o:
        given = o["model.source"]
        o["model.source"] = resolve_model_source(given, fetch=not args.print_manifest)
        named = given in ("default", "smollm2-135m-instruct") or given.startswith("random:")
        if args.served_model_name is None and manifest is None and not named:
            # as vllm serve: the model argument is the served name; the name derived from it an alias
            derived = ModelSection(source=o["model.source"]).resolved_served_name()
            o["model.served_name"] = [given] if derived == given else [given, derived]
    if args.served_model_name:
        o["model.served_name"] = list(args.served_model_name)
    if args.api_key:
        o["server.api_keys"] = args.api_key
    return manifest, o


def resolve_model_source(source: str, fetch: bool = True) -> str:
    """A model argument as the manifest's `model.source`: paths and named sources as given, a Hub id
    fetched (the default model's id is the embedded GGUF). `fetch` False (--print-manifest): no
    download and no check that a path exists."""
    if source in ("default", "smollm2-135m-instruct") or source.startswith("random:"):
        return source
    if Path(source).expanduser().exists():
        return str(Path(source).expanduser().resolve())
    if source.lower() in DEFAULT_HUB_IDS:
        return "default"
    if not fetch:
        return source
    parts = source.split("/")
    if len(parts) != 2 or not all(parts) or source.startswith((".", "/", "~")):
        raise ValueError(f"{source}: no such model file or directory (and not a Hugging Face repo id)")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.gguf", "*.txt", "*.model"]
        return snapshot_download(source, allow_patterns=patterns)
    except Exception as exc:  # noqa: BLE001 - the Hub's own reason, in the message
        raise ValueError(
            f"{source}: not a local path, and fetching it from the Hugging Face Hub failed "
            f"({type(exc).__name__}: {exc}); download it and pass the directory"
        ) from None


__all__ = ["MANIFEST_SUFFIXES", "add_serve_parser", "resolve_model_source", "serve_overrides"]
