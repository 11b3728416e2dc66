"""Decoding requests: the engine request for a job's current window, and the temperature it is
decoded at.

A window's request is one of three:

    detection   <|startoftranscript|>                       -> 1 token among the language tokens
    decode      [<|startofprev|> previous...] <|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>]
                                                            -> the window's text and timestamps
    alignment   <|startoftranscript|> ... <|notimestamps|> text <|endoftext|>   (teacher-forced)
                                                            -> cross-attention of the alignment heads

Every request carries the window's log-mel as its encoder input, so with prefix caching on (the
default) the second and later requests of a window reuse its encoder output.
"""

from __future__ import annotations

from encdec_engine.models.whisper_tokens import WhisperTokens
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.speech.audio import INPUT_STRIDE
from encdec_engine.speech.fallback import Verdict, WindowQuality, judge
from encdec_engine.speech.job import DecodedWindow, TranscriptionJob
from encdec_engine.speech.options import TranscribeOptions
from encdec_engine.speech.timestamp_rules import timestamp_rules_from_generation_config
from encdec_engine.speech.word_timestamps import alignment_heads


class WindowRequests:
    """Builds each window's engine request from the options and the checkpoint's generation config,
    and moves a job's temperature after each decode (openai-whisper's fallback)."""

    def __init__(self, engine, options: TranscribeOptions, tokens: WhisperTokens) -> None:
        self.options = options
        self.tokens = tokens
        gc = engine.generation_config
        self.suppress = list(getattr(gc, "suppress_tokens", None) or [])
        self.begin_suppress = list(getattr(gc, "begin_suppress_tokens", None) or [])
        self.timestamp_rules = timestamp_rules_from_generation_config(gc)
        self.max_decoder_len = engine.max_decoder_len  # decoder positions
        self.max_length = getattr(gc, "max_length", None) or self.max_decoder_len
        self.prompt_tokens = self._initial_prompt_tokens(engine.tokenizer)
        spec = engine.model.kv_cache_spec
        self.alignment_heads = alignment_heads(gc, spec.num_layers, spec.num_kv_heads)
        max_seqs = engine.scheduler.config.max_num_seqs
        for name in ("beam_size", "best_of"):
            if getattr(options, name) > max_seqs:
                raise ValueError(f"{name} {getattr(options, name)} is more than the engine's max_num_seqs {max_seqs}")
        if options.language is not None:
            tokens.decoder_prompt(options.language, options.task)  # validates language and task

    def _initial_prompt_tokens(self, tokenizer) -> list[int]:
        if not self.options.initial_prompt:
            return []
        ids = tokenizer(" " + self.options.initial_prompt.strip(), add_special_tokens=False)["input_ids"]
        special = [t for t in ids if t >= self.tokens.eot]  # as HF's get_prompt_ids refuses
        if special:
            raise ValueError(f"initial_prompt contains special-token text "
                             f"{tokenizer.convert_ids_to_tokens(special)}; write it without <|...|> tokens")
        return ids

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
            decoder = self.tokens.decoder_prompt(job.language, self.options.task, self.options.timestamps,
                                                 self._previous(job))
            params = self._decode_params(job, len(decoder))
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

    def fallback(self, job: TranscriptionJob, quality: WindowQuality) -> Verdict:
        """Judge a decoded window and set the temperature of the job's next decode: the next one on
        RETRY, else the first (for the next window)."""
        verdict = judge(quality, self.options, job.temperature_index)
        if verdict is Verdict.RETRY:
            job.temperature_index += 1
        else:
            job.temperature_index = 0
            job.window += 1
        return verdict

    def _previous(self, job: TranscriptionJob) -> list[int]:
        previous = list(self.prompt_tokens)
        # openai-whisper keeps at most half the decoder context for the prompt.
        limit = self.max_decoder_len // 2 - 1
        if self.options.condition_on_previous_text:
            text = job.tokens[job.prompt_reset :]
            if self.options.carry_initial_prompt:  # the carried prompt first: the text gets the room it leaves
                room = limit - len(previous)
                text = text[-room:] if room > 0 else []
            previous += text
        return previous[-limit:] if previous else []

    def _decode_params(self, job: TranscriptionJob, prompt_len: int) -> SamplingParams:
        options = self.options
        temperature = options.temperatures[job.temperature_index]
        sampled = temperature > 0
        beams = 1 if sampled else options.beam_size  # openai-whisper: beams at 0, best_of samples above
        return SamplingParams(
            temperature=temperature, n=1, best_of=options.best_of if sampled else 1, num_beams=beams,
            seed=options.seed + 1000 * job.index + job.window + 1_000_000 * job.part if sampled else None,
            max_tokens=self._max_tokens(prompt_len), logprobs=0 if beams == 1 else None, skip_special_tokens=True,
            no_speech_token_id=self.tokens.no_speech,
            suppress_tokens=self.suppress, begin_suppress_tokens=self.begin_suppress,
            logits_processors=[self.timestamp_rules] if options.timestamps else None,
        )

    def _max_tokens(self, prompt_len: int) -> int:
        """HF's rule: the checkpoint's max_length counts new tokens plus (up to half the context
        of) the prompt, capped by the decoder's positions."""
        limit = self.max_decoder_len
        return max(1, min(self.max_length + min(limit // 2 - 1, prompt_len), limit) - prompt_len)
