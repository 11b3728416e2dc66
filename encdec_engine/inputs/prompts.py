"""Prompt types and the parser that tags them.

A *singleton* prompt is a plain string, a `TextPrompt` or a `TokensPrompt`.
For an encoder/decoder model it is the encoder prompt and the decoder gets
the model's default decoder prompt; an `ExplicitEncoderDecoderPrompt` names
both. Audio rides in `multi_modal_data={"audio": (samples, sample_rate)}`, and options of its
processing in `mm_processor_kwargs` (vLLM's name; Whisper's `audio_ctx`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Union

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


SingletonPrompt = Union[str, TextPrompt, TokensPrompt]


class ExplicitEncoderDecoderPrompt(TypedDict):
    encoder_prompt: SingletonPrompt
    decoder_prompt: SingletonPrompt | None


PromptType = Union[SingletonPrompt, ExplicitEncoderDecoderPrompt]


@dataclass(frozen=True)
class ParsedSingleton:
    """A singleton prompt in one shape: text or token ids, plus optional audio."""

    kind: Literal["text", "tokens"]
    text: str | None
    token_ids: list[int] | None
    multi_modal_data: dict[str, Any] | None
    mm_processor_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class ParsedPrompt:
    """`primary` is the encoder prompt of an encoder/decoder model and the only
    prompt of a decoder-only one; `decoder` is set by explicit prompts alone."""

    primary: ParsedSingleton
    decoder: ParsedSingleton | None
    explicit: bool  # the user named encoder and decoder prompts


def check_unicode(text: str, what: str) -> None:
    """A ValueError naming `what` if `text` cannot be written as UTF-8 (a lone surrogate, which JSON's
    "\\ud800" makes): tokenizers fail on it with a TypeError that names nothing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate (U+{ord(text[e.start]):04X}) "
                         f"at character {e.start}") from None


def parse_singleton(prompt: Any, what: str = "prompt") -> ParsedSingleton:
    if isinstance(prompt, str):
        return ParsedSingleton("text", prompt, None, None)
    if isinstance(prompt, dict):
        mm = prompt.get("multi_modal_data")
        if mm is not None and not isinstance(mm, dict):
            raise ValueError(f"{what}: multi_modal_data must be a dict, got {type(mm).__name__}")
        kwargs = prompt.get("mm_processor_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"{what}: mm_processor_kwargs must be a dict, got {type(kwargs).__name__}")
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise ValueError(f"{what}: prompt_token_ids must be a list of ints")
            return ParsedSingleton("tokens", None, list(ids), mm, kwargs)
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"{what}: 'prompt' must be a string, got {type(prompt['prompt']).__name__}")
            return ParsedSingleton("text", prompt["prompt"], None, mm, kwargs)
        raise ValueError(f"{what}: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    raise ValueError(f"{what}: unsupported prompt type {type(prompt).__name__}")


def is_explicit_encoder_decoder_prompt(prompt: Any) -> bool:
    return isinstance(prompt, dict) and "encoder_prompt" in prompt


def parse_prompt(prompt: PromptType) -> ParsedPrompt:
    """Tag a prompt of any supported format."""
    if is_explicit_encoder_decoder_prompt(prompt):
        extra = set(prompt) - {"encoder_prompt", "decoder_prompt"}
        if extra:
            raise ValueError(f"explicit encoder/decoder prompt has unknown keys {sorted(extra)}")
        encoder = parse_singleton(prompt["encoder_prompt"], "encoder_prompt")
        dec = prompt.get("decoder_prompt")
        decoder = None if dec is None else parse_singleton(dec, "decoder_prompt")
        if decoder is not None and (decoder.multi_modal_data or decoder.mm_processor_kwargs):
            raise ValueError("decoder_prompt: multi_modal_data and mm_processor_kwargs belong to the encoder prompt")
        return ParsedPrompt(encoder, decoder, explicit=True)
    return ParsedPrompt(parse_singleton(prompt), None, explicit=False)
