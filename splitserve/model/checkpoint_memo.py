"""Where `weight_cache.open_checkpoint_memo` remembers a GGUF file's parsed header, and the file signature
that keeps the memo valid (path, size, mtime, ctime, inode: any write changes the ctime, a replaced
file has a new inode). No torch here: the router reads a memo's fingerprint to find its tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path


def signature(path: Path) -> list[str | int]:
    p = path.expanduser().resolve()
    st = p.stat()
    return [str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def memo_file(path: Path, directory: Path) -> Path:
    """The memo of GGUF file `path` in weight cache directory `directory`."""
    p = path.expanduser().resolve()
    return directory / "checkpoints" / f"{hashlib.sha256(str(p).encode()).hexdigest()[:24]}.json"


__all__ = ["memo_file", "signature"]
