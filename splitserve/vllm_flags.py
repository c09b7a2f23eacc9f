"""More of `vllm serve`'s flags for `splitserve serve`, so a copied vLLM command line starts: each sets
the manifest field that has its meaning here, or, where a flag has no meaning here, is accepted with one
log line that says so.

    --chat-template T          model.chat_template: a file, or the Jinja template itself
    --uvicorn-log-level L      the HTTP server's own log level (uvicorn's loggers)
    --enable-log-requests      server.access_log on (a line per request); --disable-log-requests: no
                               change (vLLM's prompt logging is off here by default)
    --trust-remote-code        nothing to trust: no model code is fetched or run from a checkpoint
    --allowed-origins JSON     server.cors: CORS as vLLM (Starlette's CORSMiddleware), with
    --allowed-methods JSON     --allowed-methods, --allowed-headers and --allow-credentials; no
    --allowed-headers JSON     --allowed-origins: no CORS (vLLM's default is every origin)
    --allow-credentials
    --kv-transfer-config JSON  {"kv_connector": "NixlConnector", "kv_connector_extra_config":
                               {"backends": [...]}} -> transport.backend nixl and its nixl_backends;
                               kv_role: the pools decide each worker's role
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

log = logging.getLogger("splitserve.serve")
UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_vllm_flags(serve: argparse.ArgumentParser) -> None:
    vllm = serve.add_argument_group("more of vllm serve's flags (splitserve/vllm_flags.py)")
    vllm.add_argument("--chat-template", default=None, help="a chat template file, or the template itself")
    vllm.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LEVELS, help="the HTTP server's")
    vllm.add_argument("--enable-log-requests", action="store_true", help="a log line per request")
    vllm.add_argument("--disable-log-requests", action="store_true", help="accepted (no prompt logging here)")
    vllm.add_argument("--trust-remote-code", action="store_true", help="accepted (no remote code is run)")
    vllm.add_argument("--allowed-origins", type=_json_list, default=None, help="CORS origins, e.g. '[\"*\"]'")
    vllm.add_argument("--allowed-methods", type=_json_list, default=None, help="CORS methods (default all)")
    vllm.add_argument("--allowed-headers", type=_json_list, default=None, help="CORS headers (default all)")
    vllm.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    vllm.add_argument("--kv-transfer-config", type=_json_object, default=None,
                      help="vLLM's KV connector config; NixlConnector -> --kv-backend nixl")  # fmt: skip


def vllm_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The manifest fields these flags set; logs a line for each flag that changes nothing here."""
    o: dict[str, Any] = {}
    if args.chat_template is not None:
        o["model.chat_template"] = args.chat_template
    if args.uvicorn_log_level is not None:
        level = "DEBUG" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level.upper()
        for name in ("uvicorn", "uvicorn.error"):
            logging.getLogger(name).setLevel(level)
    if args.enable_log_requests:
        o["server.access_log"] = True
    if args.disable_log_requests:
        log.info("--disable-log-requests: accepted; request prompts are not logged here (the access log "
                 "line per request stays as configured: --no-access-log turns it off)")  # fmt: skip
    if args.trust_remote_code:
        log.info("--trust-remote-code: accepted; no code is fetched or run from a checkpoint here")
    cors = {"allowed_methods": args.allowed_methods, "allowed_headers": args.allowed_headers}
    if args.allowed_origins is not None:
        given = {k: v for k, v in cors.items() if v is not None}
        o["server.cors"] = {"allowed_origins": args.allowed_origins,
                            "allow_credentials": args.allow_credentials, **given}  # fmt: skip
    elif args.allow_credentials or any(v is not None for v in cors.values()):
        log.info("--allowed-methods / --allowed-headers / --allow-credentials: no CORS without "
                 "--allowed-origins")  # fmt: skip
    if args.kv_transfer_config is not None:
        o |= kv_transfer_overrides(args.kv_transfer_config)
    return o


def kv_transfer_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's --kv-transfer-config -> transport fields (NixlConnector only: the others have no backend
    here)."""
    connector = config.get("kv_connector")
    if connector != "NixlConnector":
        raise ValueError(f"--kv-transfer-config: kv_connector {connector!r} has no backend here; "
                         "NixlConnector maps onto nixl, or pick one with --kv-backend "
                         "(tcp | shm | cuda_ipc | nccl | nixl)")  # fmt: skip
    o: dict[str, Any] = {"transport.backend": "nixl"}
    backends = (config.get("kv_connector_extra_config") or {}).get("backends")
    if backends is not None:
        if not isinstance(backends, list) or not backends:  # the names: the manifest checks them
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.backends {backends!r}: "
                             'a list of NIXL backends, e.g. ["LIBFABRIC"]')  # fmt: skip
        o["transport.nixl_backends"] = list(backends)
    if config.get("kv_role") is not None:
        log.info("--kv-transfer-config: kv_role %r accepted; each worker's role comes from its pool "
                 "(prefill / decode / colocated)", config["kv_role"])  # fmt: skip
    return o


def _json_list(text: str) -> list[str]:
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise argparse.ArgumentTypeError(f"{text!r}: a JSON list of strings, e.g. '[\"*\"]'")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object")
    return value


__all__ = ["add_vllm_flags", "kv_transfer_overrides", "vllm_overrides"]
