"""KVHandle: the claim ticket for one exported request's KV, passed prefill -> router -> decode as JSON.

It names where the KV is (`backend`, `address` of the exporter's server), which lease holds it
(`lease_id`, good until `lease_expires_at`, wall clock), what it is (`request_id`, the exporter's
`block_ids`, `num_tokens`), and how to check it (`layout_fingerprint`, optional `checksum` of the
payload computed at export). A handle is not a secret on its own: fetching also needs the shared secret.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KVHandle:
    backend: str
    address: str  # "host:port" or "unix:/path/to.sock" of the exporter's server
    request_id: str
    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    layout_fingerprint: str
    lease_expires_at: float  # wall clock (time.time()); a hint for routers, the exporter's clock rules
    checksum: str | None = None  # "crc32:1a2b3c4d" or "blake2b:<hex>"
    lease_slot: int | None = None  # cuda_ipc: the lease's slot on the exporter's lease board (board.py)
    state_row: int | None = None  # cuda_ipc: the row of the exporter's state arena (state_arena.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def seconds_left(self, now: float | None = None) -> float:
        return self.lease_expires_at - (time.time() if now is None else now)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["block_ids"] = list(self.block_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> KVHandle:
        try:
            return cls(
                backend=str(data["backend"]),
                address=str(data["address"]),
                request_id=str(data["request_id"]),
                lease_id=str(data["lease_id"]),
                block_ids=tuple(int(b) for b in data["block_ids"]),
                num_tokens=int(data["num_tokens"]),
                layout_fingerprint=str(data["layout_fingerprint"]),
                lease_expires_at=float(data["lease_expires_at"]),
                checksum=None if data.get("checksum") is None else str(data["checksum"]),
                lease_slot=None if data.get("lease_slot") is None else int(data["lease_slot"]),
                state_row=None if data.get("state_row") is None else int(data["state_row"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed KV handle {data!r}: {exc}") from exc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> KVHandle:
        return cls.from_dict(json.loads(text))
