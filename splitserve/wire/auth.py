"""The worker HTTP API's bearer token: derived from the deployment's KV secret, so that one secret
authenticates both side channels (the KV transport's HMAC handshake and the worker endpoints) and the
secret itself never travels in a header. Light on imports: the router and the runtimes use it."""

from __future__ import annotations

import hashlib
import hmac


def worker_token(secret: str) -> str:
    return hmac.new(secret.encode(), b"splitserve worker http v1", hashlib.sha256).hexdigest()


def worker_headers(secret: str | None) -> dict[str, str]:
    """The headers a client of the worker API sends ({} without a secret: an unauthenticated worker)."""
    return {"Authorization": f"Bearer {worker_token(secret)}"} if secret else {}


__all__ = ["worker_headers", "worker_token"]
