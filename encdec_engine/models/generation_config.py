"""A checkpoint's generation config, read so that nothing its file says is lost, without transformers.

transformers builds a `GenerationConfig` from `generation_config.json`, but when the file carries
`"_from_model_config": true` (what `save_pretrained` writes for a config derived from the model
config) it keeps only the standard fields and drops every other one: Whisper's
`no_timestamps_token_id`, `lang_to_id`, `alignment_heads`, ... Fine-tuned checkpoints often have such a
file with those fields in it. The engine reads the JSON itself instead (transformers' import alone
costs a second of every start): every field the file holds, and None for the standard fields it
leaves out (transformers 5's `GenerationConfig` defaults every field to None). Without the file the
settings come from config.json's standard generation fields, as `GenerationConfig.from_model_config`
takes them.
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


# `GenerationConfig`'s fields (transformers 5.x), each None unless a file sets it.
GENERATION_FIELDS = (
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "max_time", "stop_strings",
    "do_sample", "num_beams", "use_mtp", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
    "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "repetition_penalty", "encoder_repetition_penalty", "length_penalty", "no_repeat_ngram_size", "bad_words_ids",
    "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
    "token_healing", "guidance_scale", "watermarking_config", "num_return_sequences", "output_attentions",
    "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate", "pad_token_id",
    "bos_token_id", "eos_token_id", "encoder_no_repeat_ngram_size", "decoder_start_token_id", "is_assistant",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind",
    "target_lookbehind", "assistant_ensemble_weight", "speculation_type", "compile_config", "disable_compile",
    "continuous_batching_config", "low_memory", "penalty_alpha", "dola_layers", "diversity_penalty",
    "num_beam_groups", "constraints", "force_words_ids", "prefill_chunk_size",
)


class GenerationSettings:
    """A generation config's settings as attributes: the standard fields (None when unset) and every
    other field the file holds."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(dict.fromkeys(GENERATION_FIELDS))
        self.__dict__.update(values)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"GenerationSettings({ {k: v for k, v in self.__dict__.items() if v is not None} })"


def load_generation_config(folder: Path, model_config) -> GenerationSettings:
    """The folder's `generation_config.json` with every field it holds; without the file, the
    standard generation fields config.json sets (`model_config`: the model's config object)."""
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        logger.info("%s: no %s; generation settings come from config.json", folder, GENERATION_CONFIG_FILE)
        values = model_config.to_dict()
        return GenerationSettings({k: values[k] for k in GENERATION_FIELDS if values.get(k) is not None})
    raw = read_json(path)
    return GenerationSettings({key: value for key, value in raw.items() if key not in _METADATA})
