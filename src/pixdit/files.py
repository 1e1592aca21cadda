"""Crash-safe file writes, and locks. Every file pixdit writes for a later reader (checkpoints and their EMA artifacts,
shards, manifests, FID statistics, metrics, sweep status files, downloaded weights) is written with one of these:

    with atomic_write(path) as f:            # binary; atomic_write(path, "w") for text
        torch.save(obj, f)
    write_json(path, obj)                    # the same for a JSON document
    commit_file(tmp_path, path)              # a file another library wrote under a temporary name (shards)

The bytes go to a temporary file in the same directory (same file system, so the rename is atomic); the file is
fsync'ed, renamed over ``path`` with ``os.replace``, and the directory is fsync'ed so the rename survives a power loss.
A kill at any moment leaves either the old file or the new one at ``path``, never part of one; an exception inside
the ``with`` block removes the temporary file and leaves ``path`` untouched. A process killed mid-write (kill -9,
power loss) leaves its temporary file (``.NAME.tmp-PID-XXXXXXXX``) behind; ``remove_stale_temporaries(directory)``
deletes those once nothing else writes there (pixdit-train does it for its checkpoints when a run starts).

A folder that one process at a time may write (a prepare_data ``--out``) is guarded with ``exclusive_lock``:

    with exclusive_lock(out / ".prepare" / "lock", what=f"--out {out}", fix="wait for it, or use another --out"):
        ...                                  # a second process gets one PixditError naming the holder
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import socket
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pixdit.errors import PixditError

MODES = ("wb", "w")
TEMPORARY_NAME = re.compile(r"\..+\.tmp-\d+-[0-9a-f]{8}")  # atomic_write's temporary files (see below)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """An open file (binary ``"wb"`` or text ``"w"``, UTF-8) whose contents replace ``path`` when the block ends."""
    if mode not in MODES:
        raise ValueError(f"atomic_write: mode={mode!r}; allowed: {', '.join(MODES)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique hidden name, created exclusively ("x") with the usual permissions (mkstemp would make it 0600).
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_directory(path.parent)


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that writers killed mid-write left in ``directory``; returns them. Call it only
    while no other process writes into ``directory`` (a run directory's lock, pixdit.rundir), or a write in progress
    would lose its file."""
    directory = Path(directory)
    stale = (
        sorted(p for p in directory.glob(".*.tmp-*") if TEMPORARY_NAME.fullmatch(p.name)) if directory.is_dir() else []
    )
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def commit_file(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make a complete, closed file ``tmp`` durable and rename it over ``path`` (same directory)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_directory(Path(path).parent)


def write_json(path: str | os.PathLike, obj: Any, indent: int = 1) -> None:
    """``obj`` as a JSON document at ``path``, written atomically (readers never see half of it)."""
    with atomic_write(path, "w") as f:
        f.write(json.dumps(obj, indent=indent) + "\n")


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str, fix: str) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created if needed) for the block. If another process holds it,
    raise PixditError "{what} is in use by <pid, host, start time, command>; {fix}". The lock is the kernel's (flock):
    it goes away with its holder however that ends, kill -9 included, so it is never stale. The file holds the
    holder's description only for that message."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise PixditError(f"{what}: cannot create {path} ({error.strerror}); use a writable folder") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another process"
            raise PixditError(f"{what} is in use by {holder}; {fix}") from None
        except OSError as error:  # a file system without locks (some network mounts): go on, unprotected
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            warnings.warn(
                f"{what}: cannot lock {path} ({error.strerror}); make sure no other process writes there", stacklevel=3
            )
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {started} ({' '.join(sys.argv)})"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # the description is only true while the lock is held
    finally:
        os.close(fd)  # releases the lock
