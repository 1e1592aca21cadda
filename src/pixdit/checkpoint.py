"""Crash-safe checkpoint writes: ``atomic_torch_save(obj, path)`` (used by ``pixdit.callbacks.AtomicCheckpointIO``).

The object is streamed into ``<dir>/.<name>.tmp-XXXX`` (same file system, so the final rename is atomic), the file is
fsync'ed, renamed over ``path`` with ``os.replace``, and the directory is fsync'ed so the rename survives a power loss.
A kill at any moment leaves either the old file or the new one at ``path``, never a partial one. (Lightning's own
writer first serialises the whole checkpoint into memory and does not fsync.) Imports only torch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        # Remove the partial file; the previous checkpoint at `path` was never touched.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
