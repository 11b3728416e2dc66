"""The engine request for a job's current window, at the temperature the loop (transcriber.py) has got to.

A window's request is one of three:

    detection   <|startoftranscript|>                       -> 1 token among the language tokens
    decode      [<|startofprev|> previous...] <|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>]
                [prefix]  (prompts.py)                      -> every candidate (best_of samples, beams),
                                                               ranked in ranking.py
    alignment   <|startoftranscript|> ... <|notimestamps|> text <|endoftext|>   (teacher-forced)
                                                            -> cross-attention of the alignment heads

Every request carries the window's log-mel as its encoder input, so with prefix caching on (the
default) the second and later requests of a window reuse its encoder output.
"""

from __future__ import annotations

from encdec_engine.checkpoints.whisper.tokens import WhisperTokens
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.inputs.audio import INPUT_STRIDE
from encdec_engine.speech.job import DecodedWindow, TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.prompts import WindowPrompts
from encdec_engine.speech.timestamp_rules import TimestampRules, timestamp_rules_from_generation_config
from encdec_engine.speech.word_timestamps import alignment_heads


class WindowRequests:
    """Builds each window's engine request from the options and the checkpoint's generation config.
    Reads a job, never writes it."""

    def __init__(self, engine, options: TranscribeOptions, tokens: WhisperTokens) -> None:
        self.options = options
        self.tokens = tokens
        gc = engine.generation_config
        self.suppress = suppressed_tokens(options.suppress_tokens, getattr(gc, "suppress_tokens", None), tokens)
        self.begin_suppress = list(getattr(gc, "begin_suppress_tokens", None) or [])
        self.timestamp_rules = timestamp_rules_from_generation_config(gc)
        self.max_decoder_len = engine.max_decoder_len  # decoder positions
        self.max_length = getattr(gc, "max_length", None) or self.max_decoder_len
        self.prompts = WindowPrompts(options, tokens, engine.tokenizer, self.max_decoder_len)
        spec = engine.model.kv_cache_spec
        self.alignment_heads = alignment_heads(gc, spec.num_layers, spec.num_kv_heads)
        max_seqs = engine.scheduler.config.max_num_seqs
        for name in ("beam_size", "best_of"):
            if getattr(options, name) > max_seqs:
                raise ValueError(f"{name} {getattr(options, name)} is more than the engine's max_num_seqs {max_seqs}")
        if options.language is not None:
            tokens.decoder_prompt(options.language, options.task)  # validates language and task

    def build(self, job: TranscriptionJob, features) -> tuple[dict, SamplingParams]:
        """The engine request (prompt, params) for the job's current window; features: its log-mel
        [n_mels, N_FRAMES]."""
        encoder = {"prompt": "", "multi_modal_data": {"input_features": features}}
        if job.pending is not None:  # teacher-force the window's text for its cross-attention
            decoder = self.alignment_prefix(job) + job.pending.text_tokens(self.tokens.eot) + [self.tokens.eot]
            # Word probabilities as openai-whisper's: over the text tokens only.
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                                    allowed_token_ids=range(self.tokens.eot),
                                    cross_attention_heads=self.alignment_heads)
        elif job.language is None:  # a multilingual checkpoint detects the language first
            params = SamplingParams(temperature=0.0, max_tokens=1,
                                    allowed_token_ids=list(self.tokens.lang_to_id.values()))
            decoder = [self.tokens.sot]
        else:
            decoder = self.prompts.decoder_prompt(job)
            params = self._decode_params(job, len(decoder), self.prompts.forced(job))
        return {"encoder_prompt": encoder, "decoder_prompt": {"prompt_token_ids": decoder}}, params

    def alignment_prefix(self, job: TranscriptionJob) -> list[int]:
        """The decoder prompt the alignment request teacher-forces the text after."""
        return self.tokens.decoder_prompt(job.language, self.options.task, timestamps=False)

    def can_align(self, job: TranscriptionJob, window: DecodedWindow) -> bool:
        """Whether the window's words can be aligned: it has text, the text fits the decoder with
        the alignment prefix, and the audio spans at least two encoder positions."""
        text = window.text_tokens(self.tokens.eot)
        fits = len(self.alignment_prefix(job)) + len(text) + 1 <= self.max_decoder_len
        return bool(text) and fits and window.num_frames // INPUT_STRIDE >= 2

    def _decode_params(self, job: TranscriptionJob, prompt_len: int, forced: list[int]) -> SamplingParams:
        """Every candidate comes back (n = best_of samples, or every beam) with its summed
        log-probability, for ranking.py to choose as openai-whisper does."""
        options = self.options
        temperature = options.temperatures[job.temperature_index]
        sampled = temperature > 0
        beams = 1 if sampled else options.beam_size  # openai-whisper: beams at 0, best_of samples above
        fanout = options.best_of if sampled else beams
        rules = None
        if options.timestamps:  # a forced start counts as generated, as in CTranslate2's prefix
            rules = [self.timestamp_rules if not forced else _AfterForced(self.timestamp_rules, tuple(forced))]
        return SamplingParams(
            temperature=temperature, n=fanout, best_of=fanout, num_beams=beams,
            seed=options.seed + 1000 * job.index + job.window + 1_000_000 * job.part if sampled else None,
            max_tokens=self._max_tokens(prompt_len, job.long_form), logprobs=0 if beams == 1 else None,
            skip_special_tokens=True,
            no_speech_token_id=self.tokens.no_speech,
            suppress_tokens=self.suppress, begin_suppress_tokens=self.begin_suppress,
            repetition_penalty=options.repetition_penalty, no_repeat_ngram_size=options.no_repeat_ngram_size,
            logits_processors=rules,
        )

    def _max_tokens(self, prompt_len: int, long_form: bool) -> int:
        """max_new_tokens, or HF's rule: the checkpoint's max_length counts new tokens plus (up to half
        the context of) the prompt; either way within the decoder's positions. A long-form window
        (openai-whisper's path) also stops at half the decoder's positions, openai-whisper's sample_len
        (224 on Whisper): a window that loops or hallucinates costs half the steps, and one of real
        speech never comes near it."""
        limit = self.max_decoder_len
        if self.options.max_new_tokens is not None:
            return max(1, min(self.options.max_new_tokens, limit - prompt_len))
        hf = min(self.max_length + min(limit // 2 - 1, prompt_len), limit) - prompt_len
        return max(1, min(hf, limit // 2) if long_form else hf)


def suppressed_tokens(requested: tuple[int, ...], checkpoint: list[int] | None, tokens: WhisperTokens) -> list[int]:
    """openai-whisper's `_get_suppress_tokens`: -1 expands to the checkpoint's list (its non-speech
    symbols), and the task tokens, <|startoftranscript|>, <|startofprev|>, <|startoflm|> and
    <|nospeech|> are always suppressed. Their ids follow openai-whisper's layout, which puts them
    right before <|notimestamps|>."""
    ids = {t for t in requested if t >= 0}
    if -1 in requested:
        ids.update(checkpoint or [])
    nt = tokens.no_timestamps  # translate, transcribe, startoflm, startofprev, nospeech, notimestamps
    ids.update([tokens.sot, *range(nt - 5, nt)])
    ids.update(tokens.task_to_id.values())
    return sorted(ids)


class _AfterForced:
    """Timestamp rules for a window whose decoder prompt ends with forced tokens (a prefix): they
    judge the generated tokens as if the forced ones had been generated first."""

    def __init__(self, rules: TimestampRules, forced: tuple[int, ...]) -> None:
        self.rules, self.forced = rules, list(forced)

    def __call__(self, output_token_ids: list[int], logits) -> None:
        self.rules(self.forced + list(output_token_ids), logits)
