"""Translation and summarization requests as the engine runs them, for `LLM.translate`/`summarize` and the
completions endpoint: prompts from texts, the sampling parameters from the checkpoint's generation config,
and the text of a result."""

from __future__ import annotations

from dataclasses import replace

from encdec_engine.checkpoints.generation_config import generation_sampling_params
from encdec_engine.engine.llm_engine import LLMEngine
from encdec_engine.inputs.prompts import check_unicode
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.translation.conventions import TranslationRequest, task_settings, translation_convention

T5_SUMMARIZE_PREFIX = "summarize: "  # T5's task prefix when config.json names none


class Translator:
    """One engine's translation convention; requests for a language pair are made once and kept."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.convention = translation_convention(engine.hf_config, engine.tokenizer)
        self._requests: dict[tuple[str | None, str], TranslationRequest] = {}

    def request(self, source_language: str | None, target_language: str | None) -> TranslationRequest:
        if not target_language:
            raise ValueError("translate needs a target_language (a code like 'de' or a name like 'German')")
        key = (source_language, target_language)
        if key not in self._requests:
            self._requests[key] = self.convention.request(source_language, target_language)
        return self._requests[key]

    def prompt(self, request: TranslationRequest, text: str) -> dict:
        """An explicit prompt: the text's encoder ids (language codes or prefix included), and the decoder
        start token alone, as HF's generate starts."""
        if not text.strip():
            raise ValueError("a text to translate is empty")
        check_unicode(text, "a text to translate")
        ids = request.encoder_ids(self.engine.tokenizer, text)
        return {"encoder_prompt": {"prompt_token_ids": ids},
                "decoder_prompt": {"prompt_token_ids": [self.engine.input_processor.decoder_start_token_id]}}

    def translation_prompt(self, request: TranslationRequest, prompt: str | dict) -> str | dict:
        """A completion prompt told the languages: a text prompt, or an explicit prompt's text encoder
        prompt, gets them as `prompt` does; an explicit text decoder prompt is a prefix of the translation
        for the model to continue (`decoder_prefix`). Token ids are taken as they are; no decoder prompt
        takes the default."""
        if isinstance(prompt, str):
            return self.prompt(request, prompt)
        if "encoder_prompt" not in prompt:
            return prompt
        prompt = dict(prompt)
        encoder_text = _text_of(prompt["encoder_prompt"])
        if encoder_text is not None:
            check_unicode(encoder_text, "encoder_prompt")
            prompt["encoder_prompt"] = {"prompt_token_ids": request.encoder_ids(self.engine.tokenizer, encoder_text)}
        decoder_text = _text_of(prompt.get("decoder_prompt"))
        if decoder_text:
            prompt["decoder_prompt"] = {"prompt_token_ids": self.decoder_prefix(request, decoder_text)}
        return prompt

    def decoder_prefix(self, request: TranslationRequest, text: str) -> list[int]:
        """The decoder prompt that continues `text` in the target language: the decoder start, the target's
        code where the model forces one (what the first step would have forced), then the text's tokens
        (the target vocabulary's, for Marian) without special tokens, as transformers' `text_target`
        tokenizes it."""
        check_unicode(text, "decoder_prompt")
        start = self.engine.input_processor.decoder_start_token_id
        code = request.forced_bos_token_id
        return [start, *([code] if code is not None and code != start else []), *self.convention.target_ids(text)]

    def params(self, request: TranslationRequest, **overrides) -> SamplingParams:
        """The checkpoint's generation config (and the task's settings), the target's code forced first."""
        if request.forced_bos_token_id is not None:
            overrides.setdefault("forced_bos_token_id", request.forced_bos_token_id)
        return generation_sampling_params(self.engine.generation_config, request.settings, **overrides)

    def text(self, request: TranslationRequest, token_ids: list[int]) -> str:
        """The translation: the tokens decoded without the forced target code and special tokens."""
        if request.forced_bos_token_id is not None and token_ids[:1] == [request.forced_bos_token_id]:
            token_ids = token_ids[1:]
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=True).strip()

    def target_code_text(self, request: TranslationRequest) -> str:
        """What the incremental detokenizer writes for the forced target code ("" when it is a special token,
        as mBART-50's and NLLB's are; M2M100's "__de__" is not one in transformers' tokenizer)."""
        code = request.forced_bos_token_id
        if code is None or code in set(getattr(self.engine.tokenizer, "all_special_ids", ())):
            return ""
        return self.engine.tokenizer.decode([code], skip_special_tokens=True)

    def with_target(self, request: TranslationRequest, params: SamplingParams) -> SamplingParams:
        """A request's own sampling parameters, the target's code forced first."""
        if request.forced_bos_token_id is None:
            return params
        return replace(params, forced_bos_token_id=request.forced_bos_token_id)


def summarization_prefix(hf_config) -> str:
    """The text put before a document to summarize: config.json's task_specific_params["summarization"]
    prefix, else T5's "summarize: " for T5 and mT5, else none (BART)."""
    prefix = task_settings(hf_config, "summarization").get("prefix")
    if prefix is None and getattr(hf_config, "model_type", None) in ("t5", "mt5"):
        return T5_SUMMARIZE_PREFIX
    return prefix or ""


def _text_of(prompt) -> str | None:
    """The text of a text prompt (a string or {"prompt": ...}); None for token ids and anything else."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and "prompt_token_ids" not in prompt:
        return prompt["prompt"]
    return None
