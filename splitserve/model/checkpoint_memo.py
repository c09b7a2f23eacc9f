"""Where `weight_cache.open_checkpoint_memo` remembers a GGUF file's parsed header, and the file signature
that keeps the memo valid (path, size, mtime, ctime, inode: any write changes the ctime, a replaced
file has a new inode). No torch here: the router reads a memo's fingerprint to find its tokenizer."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """Where converted artifacts live: $SPLITSERVE_CACHE_DIR, else ~/.cache/splitserve."""
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "splitserve"


def signature(path: Path) -> list[str | int]:
    p = path.expanduser().resolve()
    st = p.stat()
    return [str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def memo_file(path: Path, directory: Path) -> Path:
    """The memo of GGUF file `path` in weight cache directory `directory`."""
    p = path.expanduser().resolve()
    return directory / "checkpoints" / f"{hashlib.sha256(str(p).encode()).hexdigest()[:24]}.json"


__all__ = ["cache_root", "memo_file", "signature"]
