"""How each family of translation models is told the languages, as its tokenizer and generate expect.

    family            source language                        target language
    T5, mT5           task prefix "translate English to German: " (the checkpoint's own prefix when
                      config.json's task_specific_params has one for the pair)
    Marian (OPUS-MT)  fixed by the model                     ">>de<< " before the text (multilingual
                                                             targets), else fixed by the model
    mBART-50, NLLB,   [code] text </s> (mBART-25 and         the code forced as the first generated
    M2M100            legacy NLLB: text </s> [code])         token (forced_bos_token_id)

`TranslationRequest` is what one (source, target) pair needs: the encoder ids of a text and the forced
first token. Codes are resolved through translation/languages.py against the codes the tokenizer
has; an unknown one is a ValueError that names it and lists the model's languages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from encdec_engine.translation.languages import Language, find_language

DEFAULT_SOURCE = "en"  # T5's task prefixes translate from English; the lang-code families default to it too
_NLLB_CODE = re.compile(r"^[a-z]{3}_[A-Z][a-z]{3}$")


@dataclass(frozen=True)
class TranslationRequest:
    """What translating from one language into another takes for this model."""

    text_prefix: str  # put before the text (T5's task prefix, Marian's ">>xx<< ")
    prefix_ids: tuple[int, ...]  # encoder ids before the text's own (a source language code)
    suffix_ids: tuple[int, ...]  # after them (</s>, and a legacy source code)
    forced_bos_token_id: int | None  # the target language code, the first generated token
    settings: dict  # the checkpoint's generation settings for this task (task_specific_params)

    def encoder_ids(self, tokenizer, text: str) -> list[int]:
        ids = tokenizer(self.text_prefix + text, add_special_tokens=not (self.prefix_ids or self.suffix_ids))
        return [*self.prefix_ids, *ids["input_ids"], *self.suffix_ids]


class Convention:
    family = ""

    def __init__(self, tokenizer, hf_config) -> None:
        self.tokenizer, self.hf_config = tokenizer, hf_config

    def request(self, source: str | None, target: str) -> TranslationRequest:
        raise NotImplementedError

    def target_ids(self, text: str) -> list[int]:
        """A target-language text's tokens, without special tokens: the prefix of a decoder prompt."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _unknown(self, what: str, code: str, known: list[str]) -> ValueError:
        shown = ", ".join(sorted(known)[:40]) + (f" ... ({len(known)} in all)" if len(known) > 40 else "")
        return ValueError(f"{what} {code!r} is not a language this {self.family} model translates; "
                          f"it has: {shown or 'none'}")


class TaskPrefix(Convention):
    """T5 and mT5: the task is a text prefix, "translate English to German: "."""

    family = "T5"

    def request(self, source: str | None, target: str) -> TranslationRequest:
        src, tgt = (_language(code, what) for code, what in ((source or DEFAULT_SOURCE, "source_language"),
                                                               (target, "target_language")))
        task = task_settings(self.hf_config, f"translation_{src.iso1 or src.iso3}_to_{tgt.iso1 or tgt.iso3}")
        prefix = task.pop("prefix", None) or f"translate {src.name} to {tgt.name}: "
        return TranslationRequest(prefix, (), (), None, task)


class TargetToken(Convention):
    """Marian: a multilingual target side takes ">>xx<<" before the text; otherwise the model's pair is fixed."""

    family = "Marian"

    def request(self, source: str | None, target: str) -> TranslationRequest:
        codes = list(getattr(self.tokenizer, "supported_language_codes", None) or [])
        if codes:
            token = self._target_token(target, codes)
            return TranslationRequest(f"{token} ", (), (), None, {})
        for what, code, fixed in (("source_language", source, getattr(self.tokenizer, "source_lang", None)),
                                  ("target_language", target, getattr(self.tokenizer, "target_lang", None))):
            if code is not None and fixed and not _same_language(code, fixed):
                raise ValueError(f"{what} {code!r}: this Marian model translates {self.tokenizer.source_lang} to "
                                 f"{self.tokenizer.target_lang} only")
        return TranslationRequest("", (), (), None, {})

    def target_ids(self, text: str) -> list[int]:
        """In the target vocabulary, where the model has its own (transformers' `text_target`)."""
        return self.tokenizer(text_target=text, add_special_tokens=False)["input_ids"]

    def _target_token(self, code: str, tokens: list[str]) -> str:
        candidates = [code]
        lang = find_language(code)
        if lang is not None:
            candidates += [c for c in (lang.iso1, lang.iso3, lang.nllb) if c]
        for candidate in candidates:
            if f">>{candidate}<<" in tokens:
                return f">>{candidate}<<"
        raise self._unknown("target_language", code, [t[2:-2] for t in tokens])


class LanguageCodes(Convention):
    """mBART-50, mBART-25, NLLB-200 and M2M100: language code tokens around the source, the target's forced."""

    def __init__(self, tokenizer, hf_config, family: str) -> None:
        super().__init__(tokenizer, hf_config)
        self.family = family
        self.codes = self._model_codes()

    def _model_codes(self) -> list[str]:
        if self.family == "NLLB":
            vocab = self.tokenizer.get_vocab()
            return [token for token in vocab if _NLLB_CODE.match(token)]
        return list(getattr(self.tokenizer, "lang_code_to_id", {}))

    def code(self, user_code: str, what: str) -> str:
        """The model's code for a user's language code or name."""
        if user_code in self.codes:
            return user_code
        lang = find_language(user_code)
        if lang is not None:
            for candidate in self._spellings(lang):
                if candidate in self.codes:
                    return candidate
        raise self._unknown(what, user_code, self.codes)

    def _spellings(self, lang: Language) -> list[str]:
        if self.family == "NLLB":
            return [lang.nllb] + [c for c in self.codes if c.startswith(lang.iso3 + "_")]
        if self.family == "M2M100":
            return [c for c in (lang.iso1, lang.iso3) if c]
        return [c for c in self.codes if c.split("_")[0] == lang.iso1]  # mBART: de_DE, en_XX, ...

    def token_id(self, code: str) -> int:
        if self.family == "M2M100":
            return self.tokenizer.get_lang_id(code)
        return self.tokenizer.convert_tokens_to_ids(code)

    def request(self, source: str | None, target: str) -> TranslationRequest:
        src = self.token_id(self.code(source or DEFAULT_SOURCE, "source_language"))
        tgt = self.token_id(self.code(target, "target_language"))
        eos = self.tokenizer.eos_token_id
        suffix_code = self.family == "mBART" or getattr(self.tokenizer, "legacy_behaviour", False)
        prefix, suffix = ((), (eos, src)) if suffix_code else ((src,), (eos,))
        return TranslationRequest("", prefix, suffix, tgt, {})


def translation_convention(hf_config, tokenizer) -> Convention:
    """The convention of a checkpoint (its config.json and tokenizer); ValueError for models that do not
    translate this way."""
    if tokenizer is None:
        raise ValueError("translate needs a tokenizer (skip_tokenizer_init=True was set)")
    model_type = getattr(hf_config, "model_type", None)
    tokenizer_class = type(tokenizer).__name__
    if model_type in ("t5", "mt5"):
        return TaskPrefix(tokenizer, hf_config)
    if model_type == "marian":
        return TargetToken(tokenizer, hf_config)
    if model_type == "mbart":
        return LanguageCodes(tokenizer, hf_config, "mBART-50" if tokenizer_class.startswith("MBart50") else "mBART")
    if model_type == "m2m_100":
        return LanguageCodes(tokenizer, hf_config, "NLLB" if tokenizer_class.startswith("Nllb") else "M2M100")
    raise ValueError(f"{model_type} models do not translate by language codes; translate serves T5, mT5, Marian, "
                     "mBART, M2M100 and NLLB (use generate with your own prompts)")


def task_settings(hf_config, task: str) -> dict:
    """config.json's task_specific_params[task] (a copy; empty when absent): HF pipelines' settings."""
    params = getattr(hf_config, "task_specific_params", None) or {}
    value = params.get(task)
    return dict(value) if isinstance(value, dict) else {}


def _language(code: str, what: str) -> Language:
    lang = find_language(code)
    if lang is None:
        raise ValueError(f"{what} {code!r} is not a language code or name this engine knows (ISO 639-1 like "
                         "'de', ISO 639-3 like 'deu', or an English name like 'German')")
    return lang


def _same_language(a: str, b: str) -> bool:
    la, lb = find_language(a), find_language(b)
    return a.lower() == b.lower() or (la is not None and la == lb)
