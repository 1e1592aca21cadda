"""Crash-safe checkpoint writes: ``atomic_torch_save(obj, path)`` (used by ``pixdit.callbacks.AtomicCheckpointIO``).

The object is streamed into a temporary file next to ``path`` and renamed over it (``pixdit.files.atomic_write``: fsync
of the file and of the directory), so a kill at any moment leaves either the old checkpoint or the new one at
``path``, never a partial one. (Lightning's own writer first serialises the whole checkpoint into memory and does not
fsync.)
"""

from __future__ import annotations

import os

import torch

from pixdit.files import atomic_write


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    with atomic_write(path) as f:
        torch.save(obj, f)
