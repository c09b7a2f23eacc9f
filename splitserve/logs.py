"""Log lines with a timestamp and a level on every line, as text or as one JSON object per line.

`setup_logging(level, fmt)` configures the root logger of this process and exports the choice in
SPLITSERVE_LOG_FORMAT, so that the worker processes a runtime spawns log the same way (they call
`setup_logging(level)`, which reads it; SPLITSERVE_LOG_LEVEL, when set, is the default level).

    2026-12-02 01:10:03,511 INFO splitserve.access: cmpl-3f... POST /v1/completions 200 ...
    {"ts": "2026-12-02T01:10:03.511Z", "level": "INFO", "logger": "splitserve.access", "msg": "...", ...}

A record's `extra` fields (the access log's request id, status, tokens) become keys of its JSON object.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMAT_ENV, LEVEL_ENV = "SPLITSERVE_LOG_FORMAT", "SPLITSERVE_LOG_LEVEL"
_CHATTY = ("httpx", "httpcore")
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out |= {k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str | int | None = None, fmt: str | None = None) -> None:
    """Root logger to stderr in `fmt` ("text" or "json"; None: $SPLITSERVE_LOG_FORMAT or text) at
    `level` (None: $SPLITSERVE_LOG_LEVEL or WARNING); the format is exported for child processes."""
    fmt = fmt or os.environ.get(FORMAT_ENV) or "text"
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: text or json")
    level = level if level is not None else os.environ.get(LEVEL_ENV) or "WARNING"
    name = logging.getLevelName(level) if isinstance(level, int) else str(level).upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError(f"log level {level!r}: debug, info, warning or error")
    os.environ[FORMAT_ENV] = fmt
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(name)
    for chatty in _CHATTY:  # a line per health check and scrape otherwise
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))


def worker_line(name: str, line: str) -> str:
    """A worker's log line as this process prints it: `[name] line`, or, when the line is a JSON object
    (--log-format json), the object with `"worker": name` added, so that every line stays JSON."""
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return json.dumps({**obj, "worker": name})
    return f"[{name}] {line}"


__all__ = ["FORMAT_ENV", "LEVEL_ENV", "JsonFormatter", "TEXT_FORMAT", "setup_logging", "worker_line"]
