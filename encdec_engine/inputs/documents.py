"""Text documents read for summarization, bounded in size before they are read."""

from __future__ import annotations

from pathlib import Path

MAX_DOCUMENT_BYTES = 16 << 20  # far past what an encoder reads (BART: 1,024 tokens); bounds a worker's memory


def read_document(path: str | Path, max_bytes: int | None = MAX_DOCUMENT_BYTES) -> str:
    """The UTF-8 text of `path`. ValueError naming the file when it is missing, not a file, larger than
    `max_bytes` (checked before reading), not UTF-8 or empty."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file" if not path.exists() else f"{path}: not a regular file")
    size = path.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{path} is {size} bytes, more than the limit of {max_bytes} bytes per document "
                         "(--max-document-bytes)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return text
