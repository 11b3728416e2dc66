"""Files written so that no reader, crash or power loss ever sees half of one; files checked by digest."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

_CHUNK = 1 << 20  # bytes read at a time when hashing (a model's weights need not fit in memory twice)


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of the file's bytes, read a chunk at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomically(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to a temporary file beside `path`, then rename it over `path`: readers, and
    a crash or Ctrl-C midway, see the old file or the whole new one, never half of it. The data reaches
    the disk before the rename, and the rename before this returns, so that after a power loss a file
    that exists is whole (a job's results row, written after its files, never vouches for an empty one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        # newline="" keeps the bytes equal to render() on every platform (no "\r\n" on Windows).
        with open(tmp, "x", encoding="utf-8", newline="") as fh:  # "x": the umask's mode, unlike mkstemp's 0600
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def fsync_folder(folder: str | Path) -> None:
    """Make a rename or a new file in `folder` durable (where the platform lets a folder be synced)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """Make a file's content durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
