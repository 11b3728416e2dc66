"""One turn of a live stream: its audio buffer, the words confirmed so far, and the next decode.

While the turn lasts, its buffer is decoded again each time `min_chunk_seconds` of new audio has come
(a PARTIAL decode), and LocalAgreement (live/agreement.py) confirms the words that the last `agreement`
hypotheses share after the words confirmed before: those go out as deltas. Once the turn has ended, one
FINAL decode reads its whole buffer, with exactly the request offline transcription makes for that
audio, and gives the turn's final text; a last delta sends its words after the confirmed ones.

    buffer  |<----------------- audio[:30 s] ----------------->|      decoder prompt:
            [cut off: its text conditions] [confirmed words][...]      [<|startofprev|> prompt, text cut off]
                                                                       <|startoftranscript|> [lang task]

A long turn's buffer is trimmed (whisper_streaming's "segment" trimming): once it holds more than
`trim_seconds`, it is cut at the last segment end (a closing timestamp token) of the newest hypothesis
whose words are all confirmed, and that segment's tokens move into the decoder prompt as previous text,
as openai-whisper conditions a window on the one before. A buffer that reaches `FLUSH_SECONDS` without
such a cut (or whose decodes fall that far behind) gets a FLUSH decode: its words up to its last
segment end are confirmed whatever the agreement, and the buffer is cut there (openai-whisper's seek),
so no window ever exceeds Whisper's 30 s and no audio is dropped. A trimmed turn's final text is the
text confirmed before the cut, then the final decode of the rest.
"""

from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass

import numpy as np

from encdec_engine.checkpoints.whisper.tokens import TIME_PRECISION
from encdec_engine.inputs.audio import N_SAMPLES, SAMPLE_RATE
from encdec_engine.sampling_params import SamplingParams
from encdec_engine.speech.live.agreement import Hypothesis, Word, agreed_words, align
from encdec_engine.speech.live.model import LiveModel
from encdec_engine.speech.live.options import LiveOptions

# A turn's buffer is first decoded once it holds this much audio. With 0.3 s chunks, 1.0 s let the first
# hypotheses agree on words tiny.en mishears at a clip's start (deltas 8.2% from the final text, 6.6% with
# 1.5 s; the policy's own p95 word lag 0.83 against 1.30 s: test_live_stream.py).
FIRST_DECODE_SECONDS = 1.5
FLUSH_SECONDS = 28.0  # a buffer this long is decoded as a FLUSH (its text confirmed up to a segment end, then cut)
NO_SPEECH_THRESHOLD = 0.6  # openai-whisper's: a decode is silence when its no-speech probability is
LOGPROB_THRESHOLD = -1.0  # above the first and its mean log-probability below the second
COMPRESSION_RATIO_THRESHOLD = 2.4  # a partial hypothesis compressing better than this loops: it is not used
POSITIONS_PER_SECOND = 50  # Whisper's encoder: 100 mel frames a second, halved by the second convolution


class Kind(enum.Enum):
    DETECT = "detect"  # the language (multilingual checkpoints without one): one step over the language tokens
    PARTIAL = "partial"  # the growing buffer while the turn lasts: LocalAgreement confirms what it shares
    FLUSH = "flush"  # a buffer too long to grow: confirmed up to its last segment end, then cut there
    FINAL = "final"  # the ended turn's buffer: the turn's final text


@dataclass(eq=False)
class LiveRequest:
    """An engine request for a turn, with what is needed to take its result back."""

    turn: LiveTurn
    kind: Kind
    prompt: dict  # {"encoder_prompt": audio window, "decoder_prompt": token ids}
    params: SamplingParams
    covers: int  # samples of the buffer the window holds
    generation: int  # the buffer's generation when the request was built (a cut makes it stale)
    audio_end: int  # the window's end, in samples of the stream (for the lag)


class LiveTurn:
    """The policy state of one turn (see the module docstring); plain Python, no engine."""

    def __init__(self, model: LiveModel, options: LiveOptions, item_id: str, start: int,
                 context: list[int], language: str | None) -> None:
        self.model, self.options, self.item_id = model, options, item_id
        self.start = start  # the turn's first sample, in the stream
        self.context = context  # tokens before the turn that condition it (the prompt, earlier turns)
        self.language = language  # None: detected at the first decode
        self.audio = np.zeros(0, dtype=np.float32)  # the buffer: 16 kHz samples after the last cut
        self.offset = 0  # samples cut from the start of the turn
        self.history: list[int] = []  # the latest tokens of the audio cut off (timestamps relative to their window)
        self.cut_text = ""  # the text confirmed in the audio cut off
        self.confirmed: list[Word] = []  # the buffer's confirmed words
        self.hypotheses: list[Hypothesis] = []  # the buffer's last decodes, oldest first
        self.decoded = 0  # buffer samples the last decode covered
        self.generation = 0
        self.ended = False  # no more audio comes: the next decode is the final one
        self.done = False
        self.final = ""  # the final text of the buffer, once done
        self.final_tokens: list[int] = []  # its tokens
        self.emitted = ""  # the text sent so far (the deltas, joined)

    # -- audio --------------------------------------------------------------------------
    def append(self, samples: np.ndarray) -> None:
        if len(samples):
            self.audio = np.concatenate([self.audio, samples.astype(np.float32, copy=False)])

    def end(self) -> None:
        self.ended = True

    @property
    def num_samples(self) -> int:
        """Samples of the whole turn so far (cut-off ones included)."""
        return self.offset + len(self.audio)

    @property
    def pending(self) -> int:
        """Samples of the buffer no decode has covered yet."""
        return len(self.audio) - self.decoded

    def wants_decode(self) -> bool:
        """Whether a request is due: the ended turn's final decode, or a new chunk of audio (the first once
        the buffer holds FIRST_DECODE_SECONDS: less is too little speech to say anything of)."""
        if self.done:
            return False
        chunk = self.options.min_chunk_seconds * SAMPLE_RATE
        return self.ended or (self.pending >= chunk and len(self.audio) >= FIRST_DECODE_SECONDS * SAMPLE_RATE)

    # -- requests -----------------------------------------------------------------------
    def request(self) -> LiveRequest:
        window = self.audio[:N_SAMPLES]
        encoder = {"prompt": "", "multi_modal_data": {"audio": (window, SAMPLE_RATE)}}
        tokens = self.model.tokens
        if self.language is None and tokens.is_multilingual:
            decoder, params, kind = [tokens.sot], self.model.detect_params(), Kind.DETECT
        else:
            if self.ended and len(self.audio) <= N_SAMPLES:
                kind = Kind.FINAL
            elif self.ended or len(self.audio) >= FLUSH_SECONDS * SAMPLE_RATE:
                kind = Kind.FLUSH
            else:
                kind = Kind.PARTIAL
            previous = (self.context + self.history)[-self.model.half :]
            decoder = tokens.decoder_prompt(self.language, self.options.task, True, previous)
            params = self.model.decode_params(len(decoder), len(window) / SAMPLE_RATE)
            if kind is Kind.PARTIAL:
                positions = self._interim_positions(len(window))
                if positions is not None:
                    encoder["mm_processor_kwargs"] = {"audio_ctx": positions}
        return LiveRequest(self, kind, {"encoder_prompt": encoder, "decoder_prompt": {"prompt_token_ids": decoder}},
                           params, len(window), self.generation, self.start + self.offset + len(window))

    def _interim_positions(self, samples: int) -> int | None:
        """The encoder positions an interim decode of `samples` reads: the audio and `interim_padding_seconds`
        of padding, in whole seconds (fewer distinct lengths); None where that is the whole window."""
        padding = self.options.interim_padding_seconds
        if padding is None:
            return None
        seconds = math.ceil(samples / SAMPLE_RATE + padding)
        positions = seconds * POSITIONS_PER_SECOND
        return positions if positions < self.model.encoder_positions else None

    def take(self, request: LiveRequest, generated: list[int], no_speech_prob: float = 0.0,
             avg_logprob: float = 0.0) -> str:
        """Fold a finished request in; returns the newly confirmed text (the next delta, maybe empty).
        A request built before the buffer was last cut is stale and changes nothing."""
        if request.generation != self.generation or self.done:
            return ""
        if request.kind is Kind.DETECT:
            self.language = (self.model.tokens.language_of(generated[0]) if generated else None) or "en"
            return ""
        eot = self.model.tokens.eot
        tokens = generated[: generated.index(eot)] if eot in generated else list(generated)
        if no_speech_prob > NO_SPEECH_THRESHOLD and avg_logprob < LOGPROB_THRESHOLD:
            tokens = []  # silence (openai-whisper's rule): no text
        m = self.model
        hypothesis = Hypothesis(tokens, m.is_text, m.starts_word, m.text)
        self.decoded = request.covers
        if request.kind is Kind.FINAL:
            self.done, self.final, self.final_tokens = True, m.text(tokens), tokens
            return self._confirm(hypothesis.words[align(hypothesis.words, self.confirmed):])
        if request.kind is Kind.FLUSH:
            return self._flush(hypothesis, request.covers)
        if _compression_ratio(m.text(tokens)) > COMPRESSION_RATIO_THRESHOLD:
            return ""
        delta = self._agree(hypothesis)
        if len(self.audio) > self.options.trim_seconds * SAMPLE_RATE:
            self._trim(hypothesis)
        return delta

    @property
    def text(self) -> str:
        """The turn's transcript: once done, its final text; before, the text confirmed so far."""
        if self.done:
            return (self.cut_text + self.final).lstrip()
        return self.emitted

    # -- the policy ---------------------------------------------------------------------
    def _agree(self, hypothesis: Hypothesis) -> str:
        """LocalAgreement-n over the last n hypotheses: confirm the words they all have next."""
        n = self.options.agreement
        self.hypotheses = [*self.hypotheses, hypothesis][-n:]
        if len(self.hypotheses) < n:
            return ""
        after = [h.words[align(h.words, self.confirmed):] for h in self.hypotheses]
        agreed = min(agreed_words([[w.tokens for w in words] for words in after]), max(0, len(after[-1]) - 1))
        return self._confirm(after[-1][:agreed])

    def _trim(self, newest: Hypothesis) -> None:
        """Cut the buffer at the newest hypothesis's last segment end whose words are all confirmed."""
        confirmed_end = align(newest.words, self.confirmed)
        ends = [(i, n) for i, n in newest.segment_ends if n <= confirmed_end]
        if ends:
            index, words = ends[-1]
            self._cut(newest.tokens[: index + 1], words, self._seconds(newest.tokens[index]), len(self.audio))

    def _flush(self, hypothesis: Hypothesis, covered: int) -> str:
        """Confirm the words up to the last segment end and cut there; all of them, and the whole window,
        when the text ends the window or has no segment end."""
        start = align(hypothesis.words, self.confirmed)
        ends = hypothesis.segment_ends
        if not ends or ends[-1][0] == len(hypothesis.tokens) - 1:
            delta = self._confirm(hypothesis.words[start:])
            self._cut(hypothesis.tokens, len(hypothesis.words), covered / SAMPLE_RATE, covered)
            return delta
        index, words = ends[-1]
        delta = self._confirm(hypothesis.words[start:words])
        self._cut(hypothesis.tokens[: index + 1], words, self._seconds(hypothesis.tokens[index]), covered)
        return delta

    def _cut(self, tokens: list[int], words: int, seconds: float, most: int) -> None:
        """Cut the buffer's first `seconds` (at most `most` samples) off: `tokens` (the decode of that
        part, its first `words` words) join the history, and the confirmed words among them its text."""
        samples = min(max(1, round(seconds * SAMPLE_RATE)), most)
        gone, self.confirmed = self.confirmed[:words], self.confirmed[words:]
        self.cut_text += "".join(w.text for w in gone)
        self.history = (self.history + tokens)[-self.model.half :]  # only the latest condition a decode
        self.audio = self.audio[samples:]
        self.offset += samples
        self.decoded = max(0, self.decoded - samples)
        self.hypotheses = []
        self.generation += 1

    def _seconds(self, timestamp: int) -> float:
        return (timestamp - self.model.tokens.timestamp_begin) * TIME_PRECISION

    def _confirm(self, words: list[Word]) -> str:
        self.confirmed += words
        delta = "".join(w.text for w in words)
        if not self.emitted:
            delta = delta.lstrip()
        self.emitted += delta
        return delta


def _compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0
