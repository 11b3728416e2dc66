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

from encdec_engine.sampling_params import FIELD_NAMES, SamplingParams


def load_prompt_file(path: str | Path) -> list[tuple[Any, dict[str, Any]]]:
    """[(prompt, sampling-param overrides)] for every non-blank line of a JSONL file."""
    return [(value, overrides) for _, value, overrides in _entries(path)]


def load_prompts_with_params(path: str | Path, base: dict[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
    """[(prompt, its sampling parameters: `base` updated by the line's overrides)] for every non-blank line,
    each checked by building its SamplingParams: an unknown field or a bad value is a ValueError naming
    the file, the prompt (0-based, blank lines not counted) and its line."""
    entries = []
    for i, (lineno, value, overrides) in enumerate(_entries(path)):
        params = {**base, **overrides}
        try:
            unknown = sorted(set(overrides) - FIELD_NAMES)
            if unknown:
                raise ValueError(f"unknown field {unknown[0]!r}")
            SamplingParams(**params)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: prompt {i}: sampling_params: {e}") from None
        entries.append((value, params))
    return entries


def _entries(path: str | Path):
    """(line number, prompt, overrides) for every non-blank line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
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
        yield lineno, value, overrides
