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

import logging
from pathlib import Path

from encdec_engine.checkpoints.json_files import read_json
from encdec_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# Bookkeeping keys of the file, never generation settings.
_METADATA = ("_from_model_config", "_commit_hash", "_original_object_hash", "transformers_version")


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
    standard generation fields config.json sets (`model_config`: the model's config object).
    A field the engine reads with a value of the wrong kind is a ValueError naming the file."""
    path = folder / GENERATION_CONFIG_FILE
    if not path.is_file():
        logger.info("%s: no %s; generation settings come from config.json", folder, GENERATION_CONFIG_FILE)
        config = model_config.to_dict()
        values = {k: config[k] for k in GENERATION_FIELDS if config.get(k) is not None}
        if config.get("force_bos_token_to_be_generated"):  # older BART configs' spelling, as transformers reads it
            values["forced_bos_token_id"] = values.get("bos_token_id")
        path = folder / "config.json"
    else:
        values = {key: value for key, value in read_json(path).items() if key not in _METADATA}
    _check_kinds(values, path)
    return GenerationSettings(values)


def generation_sampling_params(generation_config, settings: dict | None = None, **overrides) -> SamplingParams:
    """The checkpoint's HF generation config (updated by `settings`, e.g. a task's task_specific_params)
    as SamplingParams, for requests that start, as in HF, from the decoder start token alone: BOS and EOS
    forced by processors; HF's max_length/min_length count that start token; suppress_tokens and the
    one-token bad_words_ids never generated (longer bad word sequences are not mapped). `overrides`
    replace fields."""
    values = {**generation_config.to_dict(), **(settings or {})}

    def get(name: str):
        return values.get(name)

    # HF: max/min_new_tokens win; else max/min_length count the start token; else 20 new tokens.
    max_new = get("max_new_tokens") or max(1, (get("max_length") or 21) - 1)
    min_new = get("min_new_tokens") or max(0, (get("min_length") or 0) - 1)
    fields = dict(
        temperature=0.0,
        max_tokens=max_new,
        min_tokens=min(min_new, max_new),
        no_repeat_ngram_size=get("no_repeat_ngram_size") or 0,
        repetition_penalty=get("repetition_penalty") or 1.0,
        forced_bos_token_id=get("forced_bos_token_id"),
        forced_eos_token_id=get("forced_eos_token_id"),
        num_beams=get("num_beams") or 1,
        length_penalty=_or_default(get("length_penalty"), 1.0),
        early_stopping=_or_default(get("early_stopping"), False),
    )
    # HF's bad_words_ids of one token are never generated (Marian's configs ban <pad> so): suppressed tokens
    banned = [ids[0] for ids in get("bad_words_ids") or [] if isinstance(ids, list) and len(ids) == 1]
    suppress = list(get("suppress_tokens") or []) + banned
    if suppress:
        fields["suppress_tokens"] = suppress
    fields.update(overrides)
    return SamplingParams(**fields)


def _or_default(value, default):
    return default if value is None else value


def decoder_start_token_id(model_config, generation_config=None) -> int | None:
    """The token HF's `generate` starts an encoder/decoder's decoder from: the generation config's, else
    config.json's, else BOS (mBART-family configs may leave it out)."""
    for source in (generation_config, model_config):
        value = getattr(source, "decoder_start_token_id", None)
        if value is not None:
            return value
    return getattr(model_config, "bos_token_id", None)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(_is_int(i) for i in value)


# What each field the engine reads must hold (None is always allowed).
_KINDS = {
    **dict.fromkeys(("max_length", "max_new_tokens", "min_length", "min_new_tokens", "num_beams", "no_repeat_ngram_size",
                     "num_return_sequences", "max_initial_timestamp_index"),
                    ("a whole number >= 0", lambda v: _is_int(v) and v >= 0)),
    **dict.fromkeys(("length_penalty", "repetition_penalty"),
                    ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))),
    **dict.fromkeys(("bos_token_id", "pad_token_id", "decoder_start_token_id", "forced_bos_token_id",
                     "forced_eos_token_id", "no_timestamps_token_id", "prev_sot_token_id"), ("a token id", _is_int)),
    "eos_token_id": ("a token id or a list of them", lambda v: _is_int(v) or _is_ids(v)),
    **dict.fromkeys(("suppress_tokens", "begin_suppress_tokens"), ("a list of token ids", _is_ids)),
    "early_stopping": ('true, false or "never"', lambda v: isinstance(v, bool) or v == "never"),
    "is_multilingual": ("true or false", lambda v: isinstance(v, bool)),
}


def _check_kinds(values: dict, path: Path) -> None:
    for name, value in values.items():
        if value is not None and name in _KINDS and not _KINDS[name][1](value):
            raise ValueError(f"{path}: {name} must be {_KINDS[name][0]}, got {value!r}")
