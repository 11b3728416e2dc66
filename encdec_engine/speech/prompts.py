"""The decoder prompt of a window's decode request: the text that conditions it and the text it is
forced to start with, as openai-whisper's `transcribe` and faster-whisper's `get_prompt` build them.

    [<|startofprev|> [hotwords] previous...]  <|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>]
                                              [<|0.00|>] [prefix...]   (the first window only)

- previous: the initial prompt and the tokens of the segments kept so far (openai-whisper's
  `all_tokens[prompt_reset_since:]`), the last max_decoder_len // 2 - 1 of them. With
  `carry_initial_prompt` the initial prompt leads every window's context and is never reset; the
  text fills the room it leaves. A window kept at a
  temperature above `prompt_reset_on_temperature`, or any window without
  `condition_on_previous_text`, resets it: later windows see only what comes after.
- hotwords (faster-whisper): before the previous text in every window's prompt, except a window
  that has a prefix.
- prefix (faster-whisper): the first window's transcript starts with it. With timestamps it follows
  `<|0.00|>`, so the window opens with a segment; both are part of the window's tokens and text.
"""

from __future__ import annotations

from encdec_engine.checkpoints.whisper.tokens import WhisperTokens
from encdec_engine.speech.job import TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions


class WindowPrompts:
    """Text options tokenized once; each window's decoder prompt and forced start from them."""

    def __init__(self, options: TranscribeOptions, tokens: WhisperTokens, tokenizer, max_decoder_len: int) -> None:
        self.options = options
        self.tokens = tokens
        self.half = max_decoder_len // 2 - 1  # openai-whisper's and faster-whisper's cap on a prompt part
        self.initial = self._text_tokens(tokenizer, "initial_prompt")
        self.hotwords = self._text_tokens(tokenizer, "hotwords")[: self.half]
        self.prefix = self._text_tokens(tokenizer, "prefix")[: self.half]

    def _text_tokens(self, tokenizer, name: str) -> list[int]:
        text = getattr(self.options, name)
        if not text or not text.strip():
            return []
        ids = tokenizer(" " + text.strip(), add_special_tokens=False)["input_ids"]
        special = [t for t in ids if t >= self.tokens.eot]  # as HF's get_prompt_ids refuses
        if special:
            raise ValueError(f"{name} contains special-token text {tokenizer.convert_ids_to_tokens(special)}; "
                             f"write it without <|...|> tokens")
        return ids

    def forced(self, job: TranscriptionJob) -> list[int]:
        """The tokens the job's current window starts with (prompted, not generated)."""
        if not self.prefix or job.window or job.part:
            return []
        return ([self.tokens.timestamp_begin] if self.options.timestamps else []) + self.prefix

    def decoder_prompt(self, job: TranscriptionJob) -> list[int]:
        """The decode request's decoder prompt, its forced start included."""
        if self.options.carry_initial_prompt:  # the prompt leads every window; the text fills the room left
            text = job.tokens[job.prompt_reset or 0 :] if self.options.condition_on_previous_text else []
            room = self.half - len(self.initial)
            previous = self.initial + (text[-room:] if room > 0 else [])
        elif job.prompt_reset is None:
            previous = self.initial + job.tokens
        else:
            previous = job.tokens[job.prompt_reset :]
        forced = self.forced(job)
        context = ([] if forced else self.hotwords) + previous[-self.half :]
        prompt = self.tokens.decoder_prompt(job.language, self.options.task, self.options.timestamps, context)
        return prompt + forced

    def after_window(self, job: TranscriptionJob, temperature: float) -> None:
        """Once a window is committed: whether later windows still see the text so far."""
        if not self.options.condition_on_previous_text or temperature > self.options.prompt_reset_on_temperature:
            job.prompt_reset = len(job.tokens)
