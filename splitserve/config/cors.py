"""The manifest's `server.cors`: CORS as vLLM's --allowed-origins, --allowed-methods, --allowed-headers
and --allow-credentials set it (Starlette's CORSMiddleware, router/routes.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CorsSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    allowed_origins: list[str] = Field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


__all__ = ["CorsSection"]
