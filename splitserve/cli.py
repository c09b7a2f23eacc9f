"""`splitserve` command line: serve a manifest, run the engine on a prompt or a chat message, or show a model.

splitserve serve                                       # the default model, disaggregated, on :8000
splitserve serve examples/colocated.yaml --port 8080   # a manifest; flags override its fields
splitserve serve HuggingFaceTB/SmolLM2-135M-Instruct --max-num-seqs 64   # a model, as `vllm serve`
splitserve chat "What is the capital of France?"      # the embedded default model
splitserve generate --model /path/to/hf-dir "Once upon a time"
splitserve models                                      # what the default model is
"""

from __future__ import annotations

# NOTE: nothing heavy at the top: `splitserve serve` starts the engine cores' fork server first thing
# in main(), and every import before it holds its start up (the parser's pydantic sections: ~0.2 s)
import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.runtime.zygote import Zygote
    from splitserve.sampling.params import SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    import splitserve
    from splitserve.cli_serve import add_serve_parser
    from splitserve.runtime.kuberay import KubeRayOptions

    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.split("\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--version", action="version", version=f"splitserve {splitserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a raw prompt")
    _engine_args(gen)
    gen.add_argument("prompt", nargs="+")
    chat = sub.add_parser("chat", help="answer one chat message with the model's chat template")
    _engine_args(chat)
    chat.add_argument("message", nargs="+")
    chat.add_argument("--system", default=None, help="an optional system message")
    models = sub.add_parser("models", help="show a model's architecture and where it was found")
    models.add_argument("--model", default=None)
    add_serve_parser(sub)
    from splitserve.ab.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    from splitserve.plan.cli import add_parser as add_plan_parser

    add_plan_parser(sub)
    render = sub.add_parser("render", help="render a manifest for another platform (kuberay: a RayService)")
    render.add_argument("target", choices=["kuberay"])
    render.add_argument("manifest", nargs="?", default=None)
    render.add_argument("--image", default=KubeRayOptions.image,
                        help="splitserve on Ray: docker build -f deploy/docker/Dockerfile")  # fmt: skip
    render.add_argument("--model-pvc", default=KubeRayOptions.model_pvc,
                        help="the PersistentVolumeClaim holding model.source ('' for none)")  # fmt: skip
    render.add_argument("--shm-size", default=KubeRayOptions.shm_size, help="memory-backed /dev/shm per pod")
    render.add_argument("--namespace", default=None)
    render.add_argument("--secret-name", default="splitserve-kv", help="the Secret holding key kv-secret")
    render.add_argument("--zone", default=None, help="topology.kubernetes.io/zone for every pod")
    render.add_argument("--instance-type", default=None, help="node.kubernetes.io/instance-type of GPU pods")
    render.add_argument("--efa-per-pod", type=int, default=0, help="vpc.amazonaws.com/efa per GPU pod")
    verify = sub.add_parser("verify", help="the deployment gate: exit 0 only when every check passes")
    verify.add_argument(
        "manifest", nargs="?", default=None, help="start this manifest's deployment and check it"
    )
    verify.add_argument("--url", default=None, help="check a running deployment instead (its router URL)")
    verify.add_argument("--api-key", default=None, help="the router's API key (default: the manifest's)")
    verify.add_argument("--json", default=None, help="also write the report as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from splitserve.runtime import zygote

    # `serve` on a CPU host: the engine cores' fork server first, before this parser and the manifest
    early = zygote.early(list(sys.argv[1:] if argv is None else argv))
    if early is not None:
        from splitserve.heap import pause_collector

        pause_collector()  # over the router's imports; `run_manifest` turns it back on (freeze_heap)
    try:
        return _main(build_parser().parse_args(argv), early)
    finally:
        if early is not None:
            early.stop()


def _main(args: argparse.Namespace, early: Zygote | None) -> int:
    from splitserve.logs import setup_logging
    from splitserve.model.errors import ModelLoadError

    try:
        if args.command == "serve":  # as vllm serve: INFO (the access log, the stats line) unless told
            setup_logging(args.log_level or ("DEBUG" if args.verbose else "INFO"), args.log_format)
        else:
            setup_logging(logging.INFO if args.verbose else logging.WARNING)
        if args.command == "models":
            return _models(args)
        if args.command == "serve":
            return _serve(args, early)
        if args.command == "bench":
            from splitserve.ab.cli import run as run_bench

            return run_bench(args)
        if args.command == "plan":
            from splitserve.plan.cli import run as run_plan

            return run_plan(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "render":
            return _render(args)
        return _run(args)
    except (ValueError, OSError, ModelLoadError, RuntimeError) as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace, early: Zygote | None = None) -> int:
    import gc
    import os

    from splitserve.cli_serve import serve_overrides
    from splitserve.config import dump_manifest, load_manifest
    from splitserve.runtime import zygote

    path, overrides = serve_overrides(args)
    manifest = load_manifest(path, overrides)
    if args.print_manifest:
        print(dump_manifest(manifest), end="")
        return 0
    if early is not None and not zygote.wanted(manifest):
        early.stop()  # a GPU or Ray deployment: its cores start on their own
        early = None
    if manifest.runtime.kind == "ray":
        gc.enable()  # paused over the imports (main); the local runtime's `run_manifest` enables it
        try:
            from splitserve.runtime import ray_serve
        except ImportError as exc:
            raise ValueError(f"runtime.kind ray needs Ray: pip install 'splitserve[ray]' ({exc})") from exc
        return ray_serve.run(manifest)
    # the engine cores' fork server before the router's imports, which its own (torch) run beside
    server = early or (zygote.start_zygote(dict(os.environ)) if zygote.wanted(manifest) else None)
    try:
        from splitserve.runtime.launch import run_manifest
        from splitserve.web import loop

        return loop.run(run_manifest(manifest, progress=not args.no_progress, zygote=server))
    finally:
        if server is not None:
            server.stop()


def _render(args: argparse.Namespace) -> int:
    from splitserve.config import load_manifest
    from splitserve.runtime.kuberay import KubeRayOptions, render_yaml

    opts = KubeRayOptions(
        image=args.image,
        namespace=args.namespace,
        secret_name=args.secret_name,
        zone=args.zone,
        instance_type=args.instance_type,
        efa_per_pod=args.efa_per_pod,
        model_pvc=args.model_pvc or None,
        shm_size=args.shm_size,
    )
    print(render_yaml(load_manifest(args.manifest), opts), end="")
    return 0


def _verify(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import os
    from pathlib import Path

    from splitserve.config import load_manifest
    from splitserve.gate.verify import verify_manifest, verify_url

    if args.url:
        key, secret_env = args.api_key, "SPLITSERVE_KV_SECRET"
        if args.manifest:
            m = load_manifest(args.manifest)
            keys, secret_env = m.server.keys(), m.transport.secret_env
            key = key or (keys[0] if keys else None)
        secret = os.environ.get(secret_env)
        report = asyncio.run(verify_url(args.url.rstrip("/").removesuffix("/v1"), key, secret))
    else:
        report = verify_manifest(load_manifest(args.manifest))
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
    return 0 if report.ok else 1


def _models(args: argparse.Namespace) -> int:
    from splitserve.model.checkpoint import open_checkpoint
    from splitserve.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    ckpt = open_checkpoint(path)
    cfg = ckpt.hf_config
    print(f"path: {path}\nformat: {ckpt.format}\narchitecture: {cfg.get('architectures')}")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"):
        print(f"{key}: {cfg.get(key)}")
    print(f"fingerprint: {ckpt.fingerprint()}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from splitserve.config.engine import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.sampling.params import SamplingParams

    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len
    )
    engine = LLMEngine(config)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )
    if args.command == "chat":
        if engine.tokenizer is None:
            raise ValueError("this model ships no tokenizer, so it cannot chat")
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": " ".join(args.message)})
        prompt: str | list[int] = engine.tokenizer.apply_chat_template(messages)
    else:
        prompt = " ".join(args.prompt)
    _stream(engine, prompt, params)
    return 0


def _stream(engine, prompt: str | list[int], params: SamplingParams) -> None:  # noqa: ANN001
    rid = engine.add_request(prompt, params)
    printed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != rid:
                continue
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")


if __name__ == "__main__":
    sys.exit(main())
