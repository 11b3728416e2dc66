"""A checkpoint's generation config, read so that nothing its file says is lost.

transformers builds a `GenerationConfig` from `generation_config.json`, but when
the file carries `"_from_model_config": true` (what `save_pretrained` writes for
a config derived from the model config) it keeps only the standard fields and
drops every other one: Whisper's `no_timestamps_token_id`, `lang_to_id`,
`alignment_heads`, ... Fine-tuned checkpoints often have such a file with those
fields in it, so we read the JSON ourselves and put the dropped fields back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# Bookkeeping keys of the file, never generation settings.
_METADATA = ("_from_model_config", "_commit_hash", "_original_object_hash", "transformers_version")


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint file; anything else is a ValueError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_generation_config(folder: Path, hf_config):
    """The folder's `generation_config.json` with every field it holds; without the file, the
    generation settings of `config.json` (what transformers falls back to as well)."""
    from transformers import GenerationConfig

    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        logger.info("%s: no %s; generation settings come from config.json", folder, GENERATION_CONFIG_FILE)
        return GenerationConfig.from_model_config(hf_config)
    raw = read_json(path)
    try:
        config = GenerationConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: transformers cannot read it as a generation config ({e})") from e
    restored = [key for key in raw if key not in _METADATA and not hasattr(config, key)]
    for key in restored:
        setattr(config, key, raw[key])
    if restored:
        logger.info("%s: restored %s, which transformers drops from a file marked _from_model_config",
                    path, ", ".join(restored))
    return config
