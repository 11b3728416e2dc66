"""A Whisper checkpoint's config.json read without transformers.

`AutoConfig` costs a transformers import (about a second) before it reads the file. For Whisper the
engine reads config.json itself: every field of `WhisperConfig` with its default, overlaid by what
the file says (files written by older transformers releases leave defaults out), with transformers'
aliases (`hidden_size` -> `d_model`, ...). tests/checkpoints/test_whisper_files.py checks each field against
`AutoConfig` on the configs it writes. Other model types go through `AutoConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from encdec_engine.checkpoints.json_files import read_json

CONFIG_FILE = "config.json"
# Bookkeeping keys, never settings.
_METADATA = ("transformers_version", "_name_or_path", "_commit_hash")

# `WhisperConfig()`'s fields and defaults (transformers 5.x, the base config's fields included).
WHISPER_DEFAULTS: dict[str, Any] = {
    "architectures": None, "output_hidden_states": False, "output_attentions": False, "return_dict": True,
    "dtype": None, "chunk_size_feed_forward": 0, "is_encoder_decoder": True,
    "id2label": {0: "LABEL_0", 1: "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "problem_type": None,
    "vocab_size": 51865, "num_mel_bins": 80, "encoder_layers": 4, "encoder_attention_heads": 6,
    "decoder_layers": 4, "decoder_attention_heads": 6, "decoder_ffn_dim": 1536, "encoder_ffn_dim": 1536,
    "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "decoder_start_token_id": 50257, "use_cache": True,
    "activation_function": "gelu", "d_model": 384, "dropout": 0.0, "attention_dropout": 0.0,
    "activation_dropout": 0.0, "init_std": 0.02, "scale_embedding": False, "max_source_positions": 1500,
    "max_target_positions": 448, "pad_token_id": 50256, "bos_token_id": 50256, "eos_token_id": 50256,
    "suppress_tokens": None, "begin_suppress_tokens": [220, 50256], "use_weighted_layer_sum": False,
    "classifier_proj_size": 256, "apply_spec_augment": False, "mask_time_prob": 0.05, "mask_time_length": 10,
    "mask_time_min_masks": 2, "mask_feature_prob": 0.0, "mask_feature_length": 10, "mask_feature_min_masks": 0,
    "median_filter_width": 7, "tie_word_embeddings": True, "model_type": "whisper",
}
# Generation settings older config.json files carry, which transformers 5 drops from a model config
# (they belong in generation_config.json) unless the config class declares them.
_LEGACY_GENERATION_KEYS = (
    "max_length", "min_length", "do_sample", "use_cache", "early_stopping", "num_beams", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "epsilon_cutoff", "eta_cutoff",
    "encoder_repetition_penalty", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "num_beam_groups",
    "diversity_penalty",
)
WHISPER_ALIASES = {"num_key_value_heads": "encoder_attention_heads", "num_attention_heads": "encoder_attention_heads",
                   "hidden_size": "d_model", "num_hidden_layers": "encoder_layers"}


class ModelConfig:
    """config.json's settings as attributes, like a transformers config."""

    def __init__(self, values: dict[str, Any], aliases: dict[str, str], name_or_path: str) -> None:
        self.__dict__.update(values)
        self._aliases = aliases
        self._name_or_path = name_or_path

    def __getattr__(self, name: str) -> Any:  # only called for names not set
        aliases = self.__dict__.get("_aliases", {})
        if name in aliases:
            return getattr(self, aliases[name])
        raise AttributeError(f"{type(self).__name__} of {self.__dict__.get('_name_or_path')} has no {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in self.__dict__.items() if not key.startswith("_")}

    def get_text_config(self, decoder: bool = False) -> ModelConfig:
        return self

    def __repr__(self) -> str:
        return f"ModelConfig({self.model_type!r}, {self._name_or_path!r})"


def read_whisper_config(folder: Path) -> ModelConfig | None:
    """The folder's config.json as a `ModelConfig` when it is a Whisper config; None for any other
    model type (read it with `AutoConfig`)."""
    raw = read_json(folder / CONFIG_FILE)
    if raw.get("model_type") != "whisper":
        return None
    dropped = set(_METADATA) | (set(_LEGACY_GENERATION_KEYS) - set(WHISPER_DEFAULTS))
    values = {key: value for key, value in raw.items() if key not in dropped}
    if "torch_dtype" in values:  # the name before transformers 5
        values.setdefault("dtype", values.pop("torch_dtype"))
    if isinstance(values.get("id2label"), dict):  # JSON keys are strings; transformers makes them ints
        values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
        values.setdefault("label2id", None)  # not derived from it (transformers 5 neither)
    return ModelConfig({**WHISPER_DEFAULTS, **values}, WHISPER_ALIASES, str(folder))
