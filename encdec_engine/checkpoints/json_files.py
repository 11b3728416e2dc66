"""Reading a checkpoint's JSON files (config.json, generation_config.json, tokenizer_config.json, ...)."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint file; anything else is a ValueError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
