"""Where the engine keeps what it makes once per machine: imported models, the CPU kernel calibration.

Imports nothing heavy (no torch): the CLI resolves model names before anything loads.
"""

from __future__ import annotations

import os
from pathlib import Path


IMPORT_MARKER = ".encdec-import.json"  # written into an import's folder once it is complete (checkpoints/ct2/)


def cache_root(model_dir: str | os.PathLike | None = None) -> Path:
    """Where models are kept: `model_dir` (CLI --model-dir), else $ENCDEC_CACHE, else ~/.cache/encdec-engine."""
    if model_dir is not None:
        return Path(model_dir).expanduser()
    return Path(os.environ.get("ENCDEC_CACHE") or Path.home() / ".cache" / "encdec-engine")
