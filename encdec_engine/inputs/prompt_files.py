"""Prompt files: one JSON value per line, in any supported prompt format.

A line is a JSON string (a text prompt) or an object: a TextPrompt, a
TokensPrompt or an explicit {"encoder_prompt", "decoder_prompt"} prompt. An
optional "sampling_params" object on a line overrides the run's parameters
for that line only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_prompt_file(path: str | Path) -> list[tuple[Any, dict[str, Any]]]:
    """[(prompt, sampling-param overrides)] for every non-blank line of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    entries = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        overrides = {}
        if isinstance(value, dict):
            value = dict(value)
            overrides = value.pop("sampling_params", None) or {}
            if not isinstance(overrides, dict):
                raise ValueError(f"{path}:{lineno}: sampling_params must be an object")
        entries.append((value, overrides))
    return entries
