"""On-disk cache of reference results, keyed by a hash of the inputs and the parameters.

Safe when several ranks or pytest-xdist workers share a directory: a result is written to a
temporary file in the same directory and moved into place with `os.replace` (atomic on POSIX
and Windows), so a reader sees either no file or a whole one; two writers of the same key
write the same content and the last one wins. A file that cannot be read (e.g. written by
an incompatible version) is treated as a miss and rewritten.

The location is an explicit argument; the default, `default_cache_dir()`, is
``~/.cache/ringcheck/mp``. Nothing here reads environment variables (the CLI or conftest may
map one to ``cache_dir=``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "ringcheck" / "mp"


def cache_key(tensors: list[torch.Tensor], params: dict) -> str:
    """sha256 over each tensor's dtype, shape and raw bytes, then the JSON of `params`."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(json.dumps(params, sort_keys=True).encode())
    return h.hexdigest()


class ResultCache:
    """A directory of ``<key>.pt`` files holding dicts of tensors and plain values."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.pt"

    def get(self, key: str) -> dict | None:
        path = self.path(key)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            return None
        except Exception:  # unreadable or from another format: recompute and overwrite
            return None

    def put(self, key: str, payload: dict) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
            os.replace(tmp, self.path(key))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return self.path(key)
