"""Whisper's special tokens and decoder prompts, read from a checkpoint's generation config.

    [<|startofprev|>, previous text tokens...]        optional (prompt / previous window)
    <|startoftranscript|> [<|lang|> <|task|>]        language and task: multilingual checkpoints only
    [<|notimestamps|>]                                absent in timestamp mode
"""

from __future__ import annotations

from dataclasses import dataclass, field

from encdec_engine.checkpoints.whisper.languages import LANGUAGES, TO_LANGUAGE_CODE

TIME_PRECISION = 0.02  # seconds per timestamp token step


@dataclass(frozen=True)
class WhisperTokens:
    sot: int  # <|startoftranscript|>, the decoder start token
    eot: int  # <|endoftext|>
    no_timestamps: int  # <|notimestamps|>; <|0.00|> is the next id
    sot_prev: int | None  # <|startofprev|>, before a text prompt
    is_multilingual: bool
    lang_to_id: dict[str, int] = field(default_factory=dict)  # "<|en|>" -> id
    task_to_id: dict[str, int] = field(default_factory=dict)  # "transcribe" -> id

    @property
    def timestamp_begin(self) -> int:
        return self.no_timestamps + 1

    @property
    def no_speech(self) -> int:
        """<|nospeech|> (<|nocaptions|> in the first vocabularies): right before <|notimestamps|>, as in HF."""
        return self.no_timestamps - 1

    @classmethod
    def from_configs(cls, config, generation_config) -> WhisperTokens:
        gc = generation_config
        if gc is None or getattr(gc, "no_timestamps_token_id", None) is None:
            raise ValueError("a Whisper checkpoint needs a generation_config.json with no_timestamps_token_id")
        lang_to_id = dict(getattr(gc, "lang_to_id", None) or {})
        return cls(
            sot=config.decoder_start_token_id,
            eot=config.eos_token_id,
            no_timestamps=gc.no_timestamps_token_id,
            sot_prev=getattr(gc, "prev_sot_token_id", None),
            is_multilingual=bool(getattr(gc, "is_multilingual", False) and lang_to_id),
            lang_to_id=lang_to_id,
            task_to_id=dict(getattr(gc, "task_to_id", None) or {}),
        )

    def language_token(self, language: str) -> int:
        """`en`, `EN`, `<|en|>` or a name like `English` -> token id."""
        key = f"<|{language_code(language)}|>"
        if key not in self.lang_to_id:
            known = ", ".join(sorted(k.strip("<|>") for k in self.lang_to_id)[:20])
            raise ValueError(f"unknown language {language!r}; this checkpoint knows: {known} ...")
        return self.lang_to_id[key]

    def language_of(self, token_id: int) -> str | None:
        return next((k.strip("<|>") for k, v in self.lang_to_id.items() if v == token_id), None)

    def decoder_prompt(self, language: str | None = None, task: str = "transcribe", timestamps: bool = False,
                       previous: list[int] | None = None) -> list[int]:
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task must be 'transcribe' or 'translate', got {task!r}")
        tokens = []
        if previous:
            if self.sot_prev is None:
                raise ValueError("this checkpoint has no <|startofprev|> token for text prompts")
            tokens = [self.sot_prev, *previous]
        tokens.append(self.sot)
        if self.is_multilingual:
            tokens.append(self.language_token(language or "en"))
            tokens.append(self.task_to_id.get(task, self.sot))
        elif language is not None and language_code(language) != "en":
            raise ValueError(f"this checkpoint is English-only; cannot transcribe language {language!r}")
        elif task == "translate":
            raise ValueError("this checkpoint is English-only; it cannot translate")
        if not timestamps:
            tokens.append(self.no_timestamps)
        return tokens


def language_code(language: str) -> str:
    """Whisper's code for a language given as a code, a token or a name, any case:
    "EN", "<|en|>", "English" -> "en". Unknown names come back lowercased, for the caller to refuse."""
    key = language.strip().lower().removeprefix("<|").removesuffix("|>")
    return TO_LANGUAGE_CODE.get(key, key)


def known_language_code(language: str) -> str:
    """`language_code`, refusing what names no language Whisper knows (ValueError listing the codes)."""
    code = language_code(language)
    if code not in LANGUAGES:
        raise ValueError(f"{language!r} is not a language Whisper knows; give a code ({', '.join(sorted(LANGUAGES))}) "
                         f"or a name such as English")
    return code
